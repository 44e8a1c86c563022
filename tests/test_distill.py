"""The main job end to end on a tiny configuration: run folder, report, resumption after
SIGKILL, and configuration errors before anything compiles."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from experiments import distill
from sparse_jax.training.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = [
    "--teacher-size", "tiny", "--teacher-steps", "6", "--seq-len", "16", "--batch-size", "4",
    "--steps", "8", "--finetune-steps", "3", "--eval-batches", "1", "--checkpoint-every", "2",
    "--windows", "4", "8", "--report-prompts", "1",
]  # fmt: skip


def _args(tmp_path, run="run", *extra):
    return [*TINY, "--run-dir", str(tmp_path / run), "--cache-dir", str(tmp_path / "cache"), *extra]


# The uninterrupted run: its folder is checked, and the killed-and-resumed runs must end with
# its parameters (shared, since a run is the slowest thing these tests do).
WHOLE = ("--steps", "16", "--checkpoint-every", "1")


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    summary = distill.run(distill.tyro.cli(distill.DistillConfig, args=_args(root, "run", *WHOLE)))
    return root, summary


def test_tiny_run_writes_the_run_folder_and_report(whole_run):
    tmp_path, summary = whole_run
    run = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.md", "curves.png"):
        assert (run / name).exists(), name
    assert (run / "weights.png").exists() and (run / "density.png").exists()
    report = (run / "report.md").read_text()
    assert "| perplexity |" in report and "forward tokens/s at n=16" in report
    assert "attention time (forward, all blocks) at n=16" in report
    assert set(summary["speed"]) == {16}  # 4 x 16 = 64 > the tiny teacher's 37 positions
    lines = (run / "metrics.jsonl").read_text().splitlines()
    phases = {json.loads(line)["phase"] for line in lines}
    assert phases == {"teacher", "student", "hardened"}
    for phase in ("teacher", "student", "hardened"):
        assert Checkpointer(run / "checkpoints" / phase, save_every=2).latest_step() is not None
    # The teacher is cached: a second run reuses it (no teacher phase).
    again = _args(
        tmp_path, "again", "--steps", "2", "--finetune-steps", "0", "--report-prompts", "0"
    )
    distill.run(distill.tyro.cli(distill.DistillConfig, args=again))
    lines = (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()
    assert "teacher" not in {json.loads(line)["phase"] for line in lines}


def _final_params(run_dir):
    state, *_ = Checkpointer(run_dir / "checkpoints" / "hardened", save_every=1).restore()
    return state["params"]


# Runs the distill CLI with Orbax's JSON items (data position, metrics) hanging in the write of
# the student's step-12 checkpoint: its arrays are being written, nothing of it is committed.
_HANG_IN_WRITE = textwrap.dedent(
    """
    import sys, time
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler
    from experiments import distill

    original = handler.JsonCheckpointHandler.async_save

    async def async_save(self, directory, *args, **kwargs):
        if "student/12." in str(directory).replace("\\\\", "/"):
            print("WRITING", flush=True)
            time.sleep(600)  # the parent kills us here
        return await original(self, directory, *args, **kwargs)

    handler.JsonCheckpointHandler.async_save = async_save
    distill.main(sys.argv[1:])
    """
)


def _start(cmd, log, **kwargs):
    with open(log, "w") as err:  # a file, not a pipe nobody reads: the child never blocks
        return subprocess.Popen(cmd, cwd=ROOT, stderr=err, **kwargs)


def _kill_when(proc, ready, log, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.2)
    assert proc.poll() is None, log.read_text()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_in_training_and_in_a_checkpoint_write_then_resume_ends_identically(whole_run):
    tmp_path, _ = whole_run
    args = _args(tmp_path, "killed", *WHOLE, "--report-prompts", "0")
    cli = [sys.executable, "-m", "experiments.distill"]
    ckpts = tmp_path / "killed" / "checkpoints" / "student"

    def saved_steps():
        return sorted(int(p.name) for p in ckpts.glob("*") if p.name.isdigit())

    # 1. Killed between updates, once the student has checkpoints up to step 3.
    log = tmp_path / "first.log"
    proc = _start([*cli, *args], log, stdout=subprocess.DEVNULL)
    _kill_when(proc, lambda: max(saved_steps(), default=0) >= 3, log)
    # 2. Resumed, then killed inside the write of the step-12 checkpoint.
    (tmp_path / "hang_in_write.py").write_text(_HANG_IN_WRITE)
    log = tmp_path / "second.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(tmp_path / "hang_in_write.py"), *args, "--resume"]
    proc = _start(cmd, log, stdout=subprocess.PIPE, env=env)
    _kill_when(proc, lambda: proc.stdout.readline().strip() == b"WRITING", log)
    proc.stdout.close()
    assert "student: resumed at step" in log.read_text()
    assert max(saved_steps()) == 11 and list(ckpts.glob("12.*orbax-checkpoint-tmp*"))
    # 3. Resumed to the end.
    resumed = subprocess.run(
        [*cli, *args, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "student: resumed at step 11" in resumed.stderr
    # Each step is logged once (what a kill left after its checkpoint is dropped on resuming).
    records = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").open()]
    steps = [(r["phase"], r["step"]) for r in records if "loss" in r]
    assert len(steps) == len(set(steps)) and ("student", 16) in steps
    # The uninterrupted run ends with the same parameters, bit for bit.
    a, b = _final_params(tmp_path / "killed"), _final_params(tmp_path / "run")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--seq-len", "64"], "longer than the teacher's 37 positions"),
        (["--batch-size", "0"], "--batch-size must be an int >= 1"),
        (["--data", "/no/such/folder"], "--data path '/no/such/folder' does not exist"),
        (["--budget", "1.5"], "--budget must be in"),
        (["--normalizer", "soft"], "--normalizer must be"),
        (["--mask-density", "-1"], "--mask-density must be a number >= 0; got -1.0"),
        (["--report-prompts", "-1"], "--report-prompts must be an int >= 0; got -1"),
        (["--anchor-self", "--combine", "mixture"], "--anchor-self needs --combine soft_union"),
        (["--learning-rate", "0"], "--learning-rate must be a number > 0; got 0.0"),
    ],
)
def test_bad_configuration_fails_before_training(tmp_path, extra, match, capsys):
    with pytest.raises((ValueError, SystemExit)) as info:
        distill.main(_args(tmp_path, "bad", *extra))
    message = str(info.value) + capsys.readouterr().err
    message = " ".join(message.replace("│", " ").split())  # tyro boxes and wraps the message
    assert match in message
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_unknown_student_kind_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        distill.main(_args(tmp_path, "bad", "--student", "dense"))
    assert "student" in capsys.readouterr().err


def test_resume_refuses_flags_that_change_the_run(tmp_path):
    distill.Run(distill.tyro.cli(distill.DistillConfig, args=_args(tmp_path)))
    saved = (tmp_path / "run" / "config.json").read_text()
    changed = _args(tmp_path, "run", "--steps", "9", "--resume")
    with pytest.raises(ValueError, match=r"--steps \(run: 8, now: 9\)"):
        distill.Run(distill.tyro.cli(distill.DistillConfig, args=changed))
    assert (tmp_path / "run" / "config.json").read_text() == saved
    same = _args(tmp_path, "run", "--report-prompts", "2", "--resume")
    distill.Run(distill.tyro.cli(distill.DistillConfig, args=same))  # no trained number changes
    # A run written before a flag existed resumes when that flag is at its default.
    record = json.loads(saved)
    del record["mask_density"]
    (tmp_path / "run" / "config.json").write_text(json.dumps(record))
    distill.Run(distill.tyro.cli(distill.DistillConfig, args=same))
    with pytest.raises(ValueError, match=r"--mask-density \(run: 0.0, now: 0.1\)"):
        changed = [*same, "--mask-density", "0.1"]
        distill.Run(distill.tyro.cli(distill.DistillConfig, args=changed))


def test_existing_run_folder_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="already holds a run: pass --resume"):
        distill.run(distill.tyro.cli(distill.DistillConfig, args=_args(tmp_path)))


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        distill.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--teacher", "--data", "--student", "--resume", "--run-dir", "--budget"):
        assert flag in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_follow_the_one_process_run(whole_run):
    """Multi-host: two processes joined by jax.distributed (JAX_* variables, as a launcher would
    set them), two CPU devices each, on a (data=2, model=2) mesh: each process reads its half
    of every batch and holds a tensor-parallel split of the projections. The run must follow
    the one-device run's losses and write one run folder."""
    tmp_path, summary = whole_run
    run_dir = tmp_path / "two"
    args = [*TINY, "--run-dir", str(run_dir), "--cache-dir", str(tmp_path / "cache-two")]
    args += [*WHOLE[:2], "--checkpoint-every", "4", "--data-axis", "2", "--model-axis", "2"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": "2"}
    env |= {"JAX_PLATFORMS": "cpu"}
    procs, logs = [], []
    for i in range(2):
        logs.append(tmp_path / f"process{i}.log")
        with open(logs[-1], "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "experiments.distill", *args],
                    cwd=ROOT,
                    env={**env, "JAX_PROCESS_ID": str(i)},
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    try:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs:
            proc.kill()

    def steps(run):
        records = [json.loads(x) for x in (run / "metrics.jsonl").open()]
        return {(r["phase"], r["step"]): (r["loss"], r["tokens"]) for r in records if "loss" in r}

    # The same updates up to the order of float sums (batch means and projections split over
    # devices). Measured relative differences: teacher (cross-entropy) <= 2e-7; student (KL of
    # ~0.03 + penalty) <= 9e-4, since Adam turns tiny gradient differences into whole steps.
    # The hardened model starts from those slightly different weights (and harden() ranks
    # near-equal candidate weights), then fine-tunes on a KL of 0.002-0.01 that its first
    # updates make jump: measured up to 2e-4 apart in absolute terms (10% relative), so that
    # phase is only checked to be in the same place.
    one, two = steps(tmp_path / "run"), steps(run_dir)
    assert two.keys() == one.keys()  # one line per step: only process 0 writes
    tolerance = {"teacher": (1e-5, 0.0), "student": (5e-3, 0.0), "hardened": (0.0, 2e-3)}
    for key, (loss, tokens) in one.items():
        assert two[key][1] == tokens, key  # the global batch: each process read its own rows
        rtol, atol = tolerance[key[0]]
        np.testing.assert_allclose(two[key][0], loss, rtol=rtol, atol=atol, err_msg=str(key))
    two_summary = json.loads((run_dir / "summary.json").read_text())
    assert two_summary["device"] == "cpu x4"
    np.testing.assert_allclose(two_summary["student_kl"], summary["student_kl"], rtol=5e-3)
    np.testing.assert_allclose(two_summary["hardened_kl"], summary["hardened_kl"], atol=2e-3)
    np.testing.assert_allclose(two_summary["hardened_ppl"], summary["hardened_ppl"], rtol=0.05)
    assert (run_dir / "report.md").exists()
