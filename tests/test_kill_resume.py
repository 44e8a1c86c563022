"""A real SIGKILL in the middle of a run of the cascade (``python -m experiments.cascade``) and of
the chain of thought (``python -m experiments.cot train``), each started in a process of its
own, then the same command with ``--run.resume`` to the end: the run ends as the uninterrupted
run of the same command does (its final checkpoints bit for bit: parameters, optimizer state, data
position, RNG), its metrics log holds one line per update of each phase (the values of the
uninterrupted run's), and its summary and report are complete. (The main job's:
tests/test_distill.py.)

Each program runs on its tests' tiny flags with a checkpoint after every update, and is killed
in its second phase, once that has a checkpoint of step 2 or later and has logged the update
after it: the kill lands while that update's checkpoint is being written (the log line of an
update with no checkpoint must go, the partial checkpoint must be ignored), and the resumption
restores a finished phase and continues one from the middle. (Killed at other moments, before
the first checkpoint, between the phases, in the measurements, the same checks hold; a kill
inside a file's write leaves a hidden temporary file that the next write of that file removes,
tests/test_files.py.)
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import cascade as cascade_experiment
from experiments import cot as cot_experiment
from experiments.common.run_folder import checkpoint_steps
from sparse_jax.training.checkpoint import Checkpointer
from tests import kill_when, start_logged
from tests.test_cascade import TINY_RUN as CASCADE_FLAGS
from tests.test_cot import RUN_FLAGS as COT_FLAGS

KILLED_AFTER = 2  # the kill comes once the second phase has a checkpoint of this step or later

# The cascade: phases dense then cascade, 12 updates each (about 0.2 s apiece with a checkpoint).
CASCADE_STEPS = 12
CASCADE = [*CASCADE_FLAGS, "--train.steps", str(CASCADE_STEPS), "--run.checkpoint-every", "1"]
# The chain of thought: phases sparse then dense, 6 updates each (about 0.3 s apiece with a
# checkpoint and an evaluation of the validation loss); the flags of test_run_folders' run.
COT_STEPS = 6
COT = ["train", *COT_FLAGS, "--train.steps", str(COT_STEPS), "--run.checkpoint-every", "1"]


def _argv(flags, root: pathlib.Path, run: str) -> list[str]:
    return [*flags, "--run.dir", str(root / run), "--run.cache-dir", str(root)]


@pytest.fixture(scope="module")
def cascade_whole(tmp_path_factory):
    """The uninterrupted run of the cascade command (in this process)."""
    root = tmp_path_factory.mktemp("cascade")
    cascade_experiment.run(cascade_experiment.parse(_argv(CASCADE, root, "whole")))
    return root


@pytest.fixture(scope="module")
def cot_whole(tmp_path_factory):
    """The uninterrupted run of the chain-of-thought command (in this process)."""
    root = tmp_path_factory.mktemp("cot")
    cot_experiment.run(cot_experiment.parse(_argv(COT, root, "whole")))
    return root


def _kill_then_resume(
    program, module: str, argv, folder: pathlib.Path, phase: str, steps: int, capsys
) -> int:
    """``python -m module argv`` SIGKILLed in ``phase`` (the run's second) once it has a
    checkpoint of step :data:`KILLED_AFTER` or later and has logged the update after it (the
    kill lands while that update's checkpoint is written: its metrics line must go), then the
    same command with ``--run.resume`` to the end (``program.main``, in this process: a process
    less to start); the step the resumption started ``phase`` from."""

    def saved() -> int:
        return max(checkpoint_steps(folder).get(phase, [0]))

    def logged() -> int:
        steps = [0]
        path = folder / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.exists() else ():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if record.get("phase") == phase:
                steps.append(record["step"])
        return max(steps)

    def ready() -> bool:
        step = saved()
        return step >= KILLED_AFTER and logged() > step

    log = folder.parent / f"{folder.name}-killed.log"
    proc = start_logged([sys.executable, "-m", module, *argv], log, stdout=subprocess.DEVNULL)
    kill_when(proc, ready, log, poll=0.02)
    killed_at = saved()
    assert KILLED_AFTER <= killed_at < steps, (
        f"the kill came with {phase}'s checkpoints at step {killed_at} of {steps}, not in the "
        f"middle of the phase: {log.read_text()[-2000:]}"
    )
    capsys.readouterr()
    program.main([*argv, "--run.resume"])
    # From the last checkpoint the killed run committed: a kill loses none of them.
    err = capsys.readouterr().err
    assert f"{phase}: resumed at step {killed_at} of {steps}" in err, err[-3000:]
    return killed_at


def _assert_same_checkpoints(a: pathlib.Path, b: pathlib.Path, phases) -> None:
    """Each phase's checkpoints in run folders ``a`` and ``b``: the same steps kept, and the last
    one's state (parameters, the rest of the model, optimizer), data position, RNG equal."""
    for phase in phases:
        with (
            Checkpointer(a / "checkpoints" / phase, save_every=1) as x,
            Checkpointer(b / "checkpoints" / phase, save_every=1) as y,
        ):
            assert x.all_steps() == y.all_steps(), phase
            (sa, da, ra, step_a), (sb, db, rb, step_b) = (
                c.restore(quarantine=False) for c in (x, y)
            )
        assert step_a == step_b and da == db, phase
        np.testing.assert_array_equal(jax.random.key_data(ra), jax.random.key_data(rb))
        leaves_a = jax.tree_util.tree_leaves_with_path(sa)
        leaves_b = jax.tree.leaves(sb)
        assert len(leaves_a) == len(leaves_b) > 0, phase
        for (path, x), y in zip(leaves_a, leaves_b, strict=True):
            err = f"{phase}: {jax.tree_util.keystr(path)}"
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=err)


def _metrics(folder: pathlib.Path) -> list[dict]:
    # Every line whole JSON: a line cut short by the kill must be gone.
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _assert_one_line_per_update(killed: pathlib.Path, whole: pathlib.Path, phases, steps):
    """metrics.jsonl of ``killed``: steps 1 to ``steps`` of each phase, in order, once each (no
    line of an update the kill left past its checkpoint, no gap); and line for line the values
    of the uninterrupted run's (the rate, tokens/s, aside)."""
    lines = _metrics(killed)
    assert {r["phase"] for r in lines} == set(phases)
    for phase in phases:
        assert [r["step"] for r in lines if r["phase"] == phase] == list(range(1, steps + 1))

    def values(records):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

    assert values(lines) == values(_metrics(whole))


def _assert_same_files(killed: pathlib.Path, whole: pathlib.Path) -> None:
    """The same files in both run folders, and in each phase's checkpoint folder the same
    entries: nothing the kill left behind (a partial checkpoint, a temporary file), nothing
    missing. (Inside a checkpoint, how Orbax splits the arrays into files may differ.)"""

    def names(folder):
        return sorted(p.name for p in folder.iterdir())

    assert names(killed) == names(whole)
    assert names(killed / "checkpoints") == names(whole / "checkpoints")
    for phase in names(whole / "checkpoints"):
        assert names(killed / "checkpoints" / phase) == names(whole / "checkpoints" / phase), phase


def _record(folder: pathlib.Path) -> dict:
    """config.json without the run folder and the resume flag."""
    record = json.loads((folder / "config.json").read_text())
    record["run"] = {k: v for k, v in record["run"].items() if k not in ("dir", "resume")}
    return record


# Measured in the run, not computed from the models: they differ between two runs.
TIMINGS = {"speed", "phase_seconds", "wall_time_s"}


def _without_timings(report: str) -> str:
    report = re.sub(r"(\| forward tokens/s at n=\d+ \|).*", r"\1", report)
    return re.sub(r"wall time \d+ s \([^)]*\)", "wall time", report)


@pytest.mark.slow
def test_the_cascade_killed_mid_phase_resumes_to_the_uninterrupted_runs_end(cascade_whole, capsys):
    root = cascade_whole
    whole, killed = root / "whole", root / "killed"
    phases = ("dense", "cascade")
    argv = _argv(CASCADE, root, "killed")
    _kill_then_resume(cascade_experiment, "experiments.cascade", argv, killed, "cascade",
                      CASCADE_STEPS, capsys)  # fmt: skip
    _assert_same_checkpoints(killed, whole, phases)
    _assert_one_line_per_update(killed, whole, phases, CASCADE_STEPS)
    _assert_same_files(killed, whole)
    assert _record(killed) == _record(whole)
    # The summary: every figure of the models that of the uninterrupted run.
    got, want = (json.loads((f / "summary.json").read_text()) for f in (killed, whole))
    assert set(got) == set(want)
    for key in set(want) - TIMINGS:
        if key in ("dense", "pruned"):  # perplexity and FLOPs; tokens/s is measured
            got[key].pop("tokens_per_s"), want[key].pop("tokens_per_s")
        assert got[key] == want[key], key
    assert set(got["speed"]) == set(want["speed"])
    assert set(got["phase_seconds"]) == {"dense", "cascade", "measure"}
    # The report: the uninterrupted run's, but for the speeds and times measured.
    got, want = (_without_timings((f / "report.md").read_text()) for f in (killed, whole))
    assert got == want
    assert "| perplexity (per byte, evaluation split) |" in got and "![gates" in got


@pytest.mark.slow
def test_the_chain_of_thought_killed_mid_phase_resumes_to_the_uninterrupted_runs_end(
    cot_whole, capsys
):
    root = cot_whole
    whole, killed = root / "whole", root / "killed"
    phases = ("sparse", "dense")
    argv = _argv(COT, root, "killed")
    _kill_then_resume(cot_experiment, "experiments.cot", argv, killed, "dense", COT_STEPS, capsys)
    _assert_same_checkpoints(killed, whole, phases)
    _assert_one_line_per_update(killed, whole, phases, COT_STEPS)
    _assert_same_files(killed, whole)
    assert _record(killed) == _record(whole)
    # What the train command writes besides: the models' record (format, configurations) and
    # the training's summary, both phases in it.
    assert (killed / "cot.json").read_text() == (whole / "cot.json").read_text()
    got, want = (json.loads((f / "training.json").read_text()) for f in (killed, whole))
    assert got["dataset"] == want["dataset"]
    assert set(got["phase_seconds"]) == {"data", "train_sparse", "train_dense"}
