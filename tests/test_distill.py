"""The main job end to end on a tiny configuration: run folder, report, resumption after
SIGKILL, configuration errors before anything compiles, and the named study configs."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from experiments import distill
from experiments.common import measure
from experiments.distill import config as distill_config
from experiments.distill import configs, job
from experiments.distill import phases as distill_phases
from experiments.distill.run_folder import Run, check_same_config
from sparse_jax.training.checkpoint import Checkpointer
from tests import kill_when, script_env, start_logged

ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = [
    "--teacher.source", "train", "--teacher.size", "tiny", "--teacher.steps", "6",
    "--teacher.recall-steps", "0",
    "--data.seq-len", "16",
    "--data.batch-size", "4", "--train.steps", "8", "--harden.finetune-steps", "3",
    "--measure.eval-batches", "1", "--run.checkpoint-every", "2", "--student.windows", "4", "8",
    "--measure.report-prompts", "1",
]  # fmt: skip


def _args(tmp_path, run="run", *extra):
    dirs = ["--run.dir", str(tmp_path / run), "--run.cache-dir", str(tmp_path / "cache")]
    return [*TINY, *dirs, *extra]


# The uninterrupted run: its folder is checked, and the killed-and-resumed runs must end with
# its parameters (shared, since a run is the slowest thing these tests do).
WHOLE = ("--train.steps", "16", "--run.checkpoint-every", "1")


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    summary = distill.run(distill.parse(_args(root, "run", *WHOLE)))
    return root, summary


@pytest.mark.slow
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
    again = ["--train.steps", "2", "--harden.finetune-steps", "0", "--measure.report-prompts", "0"]
    distill.run(distill.parse(_args(tmp_path, "again", *again)))
    lines = (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()
    assert "teacher" not in {json.loads(line)["phase"] for line in lines}


def _report_table(report: str) -> dict[str, list[str]]:
    """The rows of report.md's tables: first cell -> the other cells."""
    rows = {}
    for line in report.splitlines():
        if line.startswith("| ") and line.endswith(" |"):
            cells = [cell.strip() for cell in line[2:-2].split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def _flops_cell(cell: str) -> float:
    """A FLOPs cell of the report ("1.23 M") as a number."""
    number, _, unit = cell.partition(" ")
    return float(number) * {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]


@pytest.mark.slow
def test_report_and_summary_figures_are_those_of_the_saved_models(whole_run):
    """Each figure of summary.json and of report.md's table against a recomputation from the run
    folder's own models (restored from their checkpoints: nothing is trained again): a fresh
    evaluate_lm in other batches, and the models' own density and FLOPs methods."""
    root, _ = whole_run
    folder = root / "run"
    summary = json.loads((folder / "summary.json").read_text())
    table = _report_table((folder / "report.md").read_text())
    r = Run(distill.parse([*_args(root, "run", *WHOLE), "--resume"]))
    teacher = distill_phases.teacher(r)
    student, _ = distill_phases.student(r, teacher)
    hard = distill_phases.hardened(r, student, teacher)
    windows = r.eval_windows
    assert len(windows) == 4  # one evaluation batch of 4; evaluated below in batches of 3 and 1
    nll = {"teacher": measure.evaluate_lm(teacher, windows, batch=3)[0]}
    nll["student"], kl_student = measure.evaluate_lm(student, windows, teacher, batch=3)
    nll["hardened"], kl_hardened = measure.evaluate_lm(hard, windows, teacher, batch=3)
    ppl = {k: float(np.exp(v)) for k, v in nll.items()}
    close = dict(rel=1e-5, abs=1e-6)
    for name in ("teacher", "student", "hardened"):
        assert summary[f"{name}_ppl"] == pytest.approx(ppl[name], **close), name
    assert summary["student_kl"] == pytest.approx(kl_student, **close)
    assert summary["hardened_kl"] == pytest.approx(kl_hardened, **close)
    # The table shows them rounded (3 and 4 decimals), each in its own column.
    cells = [float(c) for c in table["perplexity"]]
    want = [ppl["teacher"], ppl["student"], ppl["hardened"]]
    np.testing.assert_allclose(cells, want, rtol=0, atol=5.1e-4)
    cells = [float(c) for c in table["KL(teacher ‖ ·), nats/token"]]
    np.testing.assert_allclose(cells, [0.0, kl_student, kl_hardened], rtol=0, atol=5.1e-5)
    # Density and FLOPs from the models' own methods, in the summary and in the table.
    n = 16
    speed = summary["speed"][str(n)]
    densities = {"teacher": float(teacher.attention_density(n))}
    densities["hardened"] = float(hard.attention_density(n))
    flops = {"teacher": teacher.flops(n), "hardened": hard.flops(n)}
    for name in ("teacher", "hardened"):
        assert speed[f"{name}_density"] == pytest.approx(densities[name], rel=1e-6), name
        assert speed[f"{name}_flops_per_token"] == pytest.approx(flops[name].per_token), name
        assert speed[f"{name}_attention_flops"] == flops[name].attention, name
    teacher_cell, _, hard_cell = table[f"attention density at n={n}"]
    assert float(teacher_cell.rstrip("%")) == pytest.approx(100 * densities["teacher"], abs=0.051)
    assert float(hard_cell.rstrip("%")) == pytest.approx(100 * densities["hardened"], abs=0.051)
    for row, of in (
        (f"FLOPs/token at n={n}", "per_token"),
        (f"attention FLOPs at n={n}", "attention"),
    ):
        teacher_cell, _, hard_cell = table[row]
        assert _flops_cell(teacher_cell) == pytest.approx(getattr(flops["teacher"], of), rel=5e-3)
        assert _flops_cell(hard_cell) == pytest.approx(getattr(flops["hardened"], of), rel=5e-3)
    # What the hardened model keeps.
    assert summary["hardened_heads"] == [b.attn.num_heads for b in hard.h]
    assert summary["hardened_ffn_units"] == [b.mlp.units for b in hard.h]
    assert summary["hardened_masks"] == [
        repr(b.attn.core.mask) if b.attn.num_heads else None for b in hard.h
    ]
    per_block = [
        float(b.attn.head_densities(n).mean()) if b.attn.num_heads else 0.0 for b in hard.h
    ]
    np.testing.assert_allclose(summary["hardened_layer_density"], per_block, rtol=1e-6)


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


@pytest.mark.slow
def test_sigkill_in_training_and_in_a_checkpoint_write_then_resume_ends_identically(whole_run):
    tmp_path, _ = whole_run
    args = _args(tmp_path, "killed", *WHOLE, "--measure.report-prompts", "0")
    cli = [sys.executable, "-m", "experiments.distill"]
    ckpts = tmp_path / "killed" / "checkpoints" / "student"

    def saved_steps():
        return sorted(int(p.name) for p in ckpts.glob("*") if p.name.isdigit())

    # 1. Killed between updates, once the student has checkpoints up to step 3.
    log = tmp_path / "first.log"
    proc = start_logged([*cli, *args], log, stdout=subprocess.DEVNULL)
    kill_when(proc, lambda: max(saved_steps(), default=0) >= 3, log)
    # 2. Resumed, then killed inside the write of the step-12 checkpoint.
    (tmp_path / "hang_in_write.py").write_text(_HANG_IN_WRITE)
    log = tmp_path / "second.log"
    env = script_env()
    cmd = [sys.executable, str(tmp_path / "hang_in_write.py"), *args, "--resume"]
    proc = start_logged(cmd, log, stdout=subprocess.PIPE, env=env)
    kill_when(proc, lambda: proc.stdout.readline().strip() == b"WRITING", log)
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


@pytest.mark.slow
def test_a_time_limit_stops_with_a_checkpoint_and_resume_ends_identically(whole_run, capsys):
    """--run.max-minutes (spent before the first update ends): the student phase (the teacher
    is cached by the uninterrupted run) saves step 1 and the command exits with status 75,
    naming the command that continues; resumed without the limit, the run ends with the
    uninterrupted run's parameters, bit for bit."""
    tmp_path, _ = whole_run
    args = _args(tmp_path, "limited", *WHOLE, "--measure.report-prompts", "0")
    with pytest.raises(SystemExit) as exit:
        distill.main([*args, "--run.max-minutes", "1e-9"])
    assert exit.value.code == 75
    err = " ".join(capsys.readouterr().err.split())
    config = distill.parse([*args, "--run.max-minutes", "1e-9"])
    command = " ".join(distill.command(config, resume=True, run_dir=tmp_path / "limited").split())
    assert "student: stopped (the time limit (6e-08 s)) after update 1 of 16" in err
    assert f"Continue with: {command}" in err and "--resume" in command
    ckpts = Checkpointer(tmp_path / "limited" / "checkpoints" / "student", save_every=1)
    assert ckpts.all_steps() == [1]
    ckpts.close()
    distill.main([*args, "--resume"])  # a time limit is not a flag a resumed run must keep
    assert "student: resumed at step 1" in capsys.readouterr().err
    a, b = _final_params(tmp_path / "limited"), _final_params(tmp_path / "run")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--data.seq-len", "64"], "--data.seq-len 64 is longer than the teacher's 37 positions"),
        (["--data.batch-size", "0"], "--data.batch-size must be an int >= 1; got 0"),
        (["--data.source", "/no/such"], "--data.source path '/no/such' does not exist"),
        (["--teacher.source", "./no/such"], "--teacher.source folder './no/such' does not exist"),
        (["--teacher.steps", "0"], "--teacher.steps must be an int >= 1; got 0"),
        (["--harden.budget", "1.5"], "--harden.budget must be in (0, 1] or None; got 1.5"),
        (["--harden.threshold", "1"], "--harden.threshold must be in (0, 1); got 1.0"),
        (["--student.normalizer", "soft"], "--student.normalizer must be softmax, sparsemax"),
        (["--student.normalizer", "inf"], "entmax15 or a finite float alpha >= 1 (1 is softmax)"),
        (["--student.normalizer", "0.5"], "alpha >= 1 (1 is softmax); got '0.5'"),
        (["--student.windows", "0"], "--student.windows must be ints >= 1; got (0,)"),
        (["--loss.mask-density", "-1"], "--loss.mask-density must be a number >= 0; got -1.0"),
        (["--loss.temperature", "nan"], "--loss.temperature must be a number > 0; got nan"),
        (
            ["--loss.penalty-ramp", "0.8", "0.5"],
            "--loss.penalty-ramp must be two fractions START <= END in [0, 1]; got (0.8, 0.5)",
        ),
        (["--measure.report-prompts", "-1"], "--measure.report-prompts must be an int >= 0"),
        (
            ["--student.anchor-self", "--student.combine", "mixture"],
            "--student.anchor-self needs --student.combine soft_union or soft_mask; got mixture",
        ),
        (
            ["--student.weighting", "reviving_sparsemax", "--student.combine", "soft_union"],
            "--student.weighting reviving_sparsemax needs --student.combine mixture; got soft_u",
        ),
        (["--train.lr", "0"], "--train.lr must be a number > 0; got 0.0"),
        (["--student.select-blocks", "-1"], "--student.select-blocks must be an int >= 0"),
        (
            ["--student.select-blocks", "1", "--student.kind", "fixed"],
            "--student.select-blocks 1 adds a candidate: it needs --student.kind candidates",
        ),
        (
            ["--student.select-blocks", "1", "--teacher.source", "planted"],
            "--student.select-blocks adds a data-dependent candidate, which the planted",
        ),
        (["--train.trainable", "(["], "--train.trainable '([' is not a regex"),
        (["--train.fast-params", "a)"], "--train.fast-params 'a)' is not a regex"),
        (["--run.model-axis", "0"], "--run.model-axis must be an int >= 1; got 0"),
        (["--run.max-minutes", "-2"], "--run.max-minutes must be a number of minutes > 0"),
        (["--teacher.size", "huge"], "--teacher.size"),
        (["--config", "nope"], "--config"),
    ],
)
def test_bad_configuration_fails_before_training(tmp_path, extra, match, capsys):
    with pytest.raises((ValueError, SystemExit)) as info:
        distill.main(_args(tmp_path, "bad", *extra))
    message = str(info.value) + capsys.readouterr().err
    message = " ".join(message.replace("│", " ").split())  # tyro boxes and wraps the message
    assert match in message
    assert not (tmp_path / "bad").exists()  # refused before the run folder is made


def test_alpha_one_is_softmax_for_the_student():
    # The library's rule for α (sparse_jax.entmax): α = 1 exactly is softmax, so the flag
    # takes it, and the student's attention gets the name.
    from experiments.distill.cli import parse
    from sparse_jax.validation import check_normalizer

    config = parse(["--student.normalizer", "1.0"])
    assert config.student.normalizer_value() == 1.0
    assert check_normalizer(config.student.normalizer_value(), 4, "test") == "softmax"


def test_the_mask_price_is_off_then_ramped_in():
    # --loss.penalty-ramp 0.25 0.75 over 8 updates: off for updates 0-1, then linear, full
    # from update 5 on (index 5 is the 6th update); the loss differs from the KL by exactly
    # that share of the weighted penalty the model returns.
    import jax.numpy as jnp
    from flax import nnx

    from sparse_jax.models import GPT2, GPT2Config

    config = distill.parse([*TINY, "--loss.penalty-ramp", "0.25", "0.75"])
    assert config.loss.ramp_steps(config.train.steps) == (2, 6)
    spec = distill_phases.student_spec(config)
    teacher = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(1))
    loss_fn = distill_phases.objective(config, config.loss.ramp_steps(config.train.steps))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 101, (2, 17)), jnp.int32)
    rng = jax.random.key(0)
    _, aux = student(batch[:, :-1], return_aux=True)
    price = config.loss.mask_expected_cost * float(aux["mask_expected_cost"])
    assert price > 0
    loss_fn = nnx.jit(loss_fn)  # one program for every step: the step is an argument
    for step, share in [(0, 0.0), (1, 0.0), (2, 0.25), (3, 0.5), (5, 1.0), (7, 1.0)]:
        loss, metrics = loss_fn(student, batch, rng, teacher, jnp.int32(step))
        np.testing.assert_allclose(
            float(loss) - float(metrics["kl"]), share * price, rtol=1e-4, atol=1e-9
        )


def test_unknown_student_kind_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        distill.main(_args(tmp_path, "bad", "--student.kind", "dense"))
    assert "student.kind" in capsys.readouterr().err


def test_resume_refuses_flags_that_change_the_run(tmp_path):
    distill.Run(distill.parse(_args(tmp_path)))
    saved = (tmp_path / "run" / "config.json").read_text()
    changed = _args(tmp_path, "run", "--train.steps", "9", "--resume")
    with pytest.raises(ValueError, match=r"--train.steps \(run: 8, now: 9\)"):
        distill.Run(distill.parse(changed))
    assert (tmp_path / "run" / "config.json").read_text() == saved
    same = _args(tmp_path, "run", "--measure.report-prompts", "2", "--resume")
    distill.Run(distill.parse(same))  # no trained number changes
    distill.Run(distill.parse([*same, "--measure.recall-sequences", "96"]))  # nor does this
    # A run written before a flag existed resumes when that flag is at its default.
    record = json.loads(saved)
    del record["loss"]["mask_density"]
    (tmp_path / "run" / "config.json").write_text(json.dumps(record))
    distill.Run(distill.parse(same))
    with pytest.raises(ValueError, match=r"--loss.mask-density \(run: 0.0, now: 0.1\)"):
        distill.Run(distill.parse([*same, "--loss.mask-density", "0.1"]))
    # A run written with the flat flags of before the groups is read through OLD_FLAGS.
    flags = distill_config.DistillConfig().flags() | {
        key: value for key, value in json.loads(saved).items() if not isinstance(value, dict)
    }
    for group, fields in json.loads(saved).items():
        if isinstance(fields, dict):
            flags |= {f"{group}.{name}": value for name, value in fields.items()}
    old = {name: flags[new] for name, new in distill_config.OLD_FLAGS.items()}
    (tmp_path / "run" / "config.json").write_text(json.dumps(old))
    # Such a run had the text-only teacher (the teacher flags added since were at the values
    # of TEACHER_TEXT_ONLY): today's teacher defaults would change it.
    with pytest.raises(ValueError, match=r"--teacher.positions \(run: 'learned', now: 'rotary'\)"):
        distill.Run(distill.parse(same))
    try:  # the command the message gives to resume it names the text-only teacher's flags
        distill.Run(distill.parse(same))
    except ValueError as err:
        resume = str(err).split("Resume with the run's flags:  ")[1].split("   or start")[0]
    for flag in (
        "--teacher.positions learned",
        "--teacher.smear-width 1",
        "--teacher.no-smear-keys",
        "--train.recall-fraction 0.0",
    ):
        assert flag in resume, resume
    distill.Run(distill.parse(shlex.split(resume)[3:]))
    text_only = ["--teacher.positions", "learned", "--teacher.no-smear-keys",
                 "--teacher.smear-width", "1", "--train.recall-fraction", "0"]  # fmt: skip
    distill.Run(distill.parse([*same, *text_only]))
    with pytest.raises(ValueError, match=r"--train.steps \(run: 8, now: 9\)"):
        distill.Run(distill.parse([*same, *text_only, "--train.steps", "9"]))


def test_a_run_from_before_the_block_price_resumes_with_its_density_budget():
    saved = json.loads(json.dumps(distill_config.DistillConfig().flags()))
    del saved["harden.price"]  # written before --harden.price existed
    given = distill_config.DistillConfig().flags()
    with pytest.raises(ValueError, match=r"--harden.price \(run: 'density', now: 'blocks'\)"):
        check_same_config(saved, given)
    check_same_config(saved, {**given, "harden.price": "density"})


def test_a_run_from_before_the_finetune_rate_resumes_with_its_rate():
    saved = json.loads(json.dumps(distill_config.DistillConfig().flags()))
    saved["train.lr"] = 0.002
    del saved["harden.finetune_lr"], saved["harden.finetune_warmup"]  # before they existed
    given = {**distill_config.DistillConfig().flags(), "train.lr": 0.002}
    with pytest.raises(ValueError, match=r"--harden.finetune-lr \(run: 0.002, now: 0.0003\)"):
        check_same_config(saved, given)
    check_same_config(saved, {**given, "harden.finetune_lr": 0.002, "harden.finetune_warmup": 0})


# Fields added after the flags were grouped: no flat name ever existed (a run folder that lacks
# them ran at their defaults, which check_same_config assumes).
SINCE_GROUPING = {
    *(f"teacher.{name}" for name in ("smear_keys", "smear_width", "positions", "recall_steps",
                                     "recall_fraction",
                                     "recall_lengths", "recall_tokens", "recall_lr",
                                     "answer_weight", "recall_long_steps", "recall_long_lr")),
    "train.recall_fraction",
    "measure.recall_sequences",
    "student.select_blocks",
    "student.select_block",
    "student.select_gate",
    "loss.selector_kl",
    "train.selector_steps",
    "student.select_pool",
}  # fmt: skip


def test_old_flags_name_every_field():
    fields = {k for k in distill_config.DistillConfig().flags() if k != "config"}
    assert sorted(distill_config.OLD_FLAGS.values()) == sorted(fields - SINCE_GROUPING)
    assert SINCE_GROUPING <= fields


def test_existing_run_folder_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"holds no run of this job: choose another --run.dir"):
        distill.run(distill.parse(_args(tmp_path)))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        distill.main(["--help"])
    text = capsys.readouterr().out
    for flag in distill_config.DistillConfig().flags():
        assert f"--{flag.replace('_', '-')}" in text, flag
    assert "wikitext2_study" in text  # --config lists the named studies


# ----------------------------------------------------------------------------------------------
# Named study configs (experiments/distill/configs) and the commands the docs quote.


def _named_or_skip(name):
    """The study config, or a skip when the data folder it names is absent."""
    try:
        return distill.named(name)
    except ValueError as error:
        if "--data.source path" in str(error) and "does not exist" in str(error):
            pytest.skip(f"{name}: {error} (the shared data folder is absent)")
        raise


@pytest.mark.parametrize("name", configs.NAMES)
def test_named_config_opens_with_its_command_and_parses(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the studies name data relative to the checkout
    module = importlib.import_module(f"experiments.distill.configs.{name}")
    first = module.__doc__.splitlines()[0]
    assert first.startswith(f"python -m experiments.distill --config {name}"), first
    # what the study reached lives in the docs, not in code: the docstring names the section
    where = re.search(r'docs/results\.md,\s+"([^"]+)"', module.__doc__)
    assert where, "the docstring names the docs/results.md section of what the study reached"
    title = " ".join(where.group(1).split())
    headings = (ROOT / "docs/results.md").read_text().splitlines()
    assert any(h.startswith("#") and title in h for h in headings), f"no section {title!r}"
    config = _named_or_skip(name)
    assert config.config == name
    command = shlex.split(first)[3:]
    parsed = distill.parse(command)
    assert parsed.flags() | {"run.dir": None} == config.flags() | {"run.dir": None}
    assert distill.parse(["--config", name, "--train.steps", "3"]).train.steps == 3


def test_default_config_is_the_flags_defaults():
    assert distill.named("default") == distill_config.DistillConfig()
    assert distill.parse([]) == distill_config.DistillConfig()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_follow_the_one_process_run(whole_run):
    """Multi-host: two processes joined by jax.distributed (JAX_* variables, as a launcher would
    set them), two CPU devices each, on a (data=2, model=2) mesh: each process reads its half
    of every batch and holds a tensor-parallel split of the projections. The run must follow
    the one-device run's losses and write one run folder."""
    tmp_path, summary = whole_run
    run_dir = tmp_path / "two"
    args = [*TINY, "--run.dir", str(run_dir), "--run.cache-dir", str(tmp_path / "cache-two")]
    args += [*WHOLE[:2], "--run.checkpoint-every", "4", "--run.data-axis", "2"]
    args += ["--run.model-axis", "2"]
    # Two CPU devices each, on top of the suite's XLA options (conftest.py): the one-process run
    # compiled with them too.
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
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
    # devices). Measured relative differences: teacher (cross-entropy) <= 2e-7; student (KL +
    # penalty) <= 9e-4 where the KL is ~0.03, since Adam turns tiny gradient differences into
    # whole steps; with only the candidate logits trained from the teacher's own weights (the
    # default since the search) the KL here is ~1e-7, and 3e-8 apart.
    # The hardened model starts from those slightly different weights (and harden() ranks
    # near-equal candidate weights), then fine-tunes on a KL of 0.002-0.01 that its first
    # updates make jump: measured up to 2e-4 apart in absolute terms (10% relative), so that
    # phase is only checked to be in the same place.
    one, two = steps(tmp_path / "run"), steps(run_dir)
    assert two.keys() == one.keys()  # one line per step: only process 0 writes
    tolerance = {"teacher": (1e-5, 0.0), "student": (5e-3, 1e-6), "hardened": (0.0, 2e-3)}
    for key, (loss, tokens) in one.items():
        assert two[key][1] == tokens, key  # the global batch: each process read its own rows
        rtol, atol = tolerance[key[0]]
        np.testing.assert_allclose(two[key][0], loss, rtol=rtol, atol=atol, err_msg=str(key))
    two_summary = json.loads((run_dir / "summary.json").read_text())
    assert two_summary["device"] == "cpu x4"
    np.testing.assert_allclose(
        two_summary["student_kl"], summary["student_kl"], rtol=5e-3, atol=1e-6
    )
    np.testing.assert_allclose(two_summary["hardened_kl"], summary["hardened_kl"], atol=2e-3)
    # Same hardened masks; the fine-tune of every weight of this barely trained tiny model then
    # moves its perplexity (~130) by a few percent on summation-order noise (measured 5.6%).
    assert two_summary["hardened_masks"] == summary["hardened_masks"]
    np.testing.assert_allclose(two_summary["hardened_ppl"], summary["hardened_ppl"], rtol=0.1)
    assert (run_dir / "report.md").exists()


def test_threshold_against_budget_hardens_the_student_both_ways(tmp_path):
    """The summary's `hardening` figures are those of harden() by the budget and by threshold,
    recomputed here; the report prints them with their ratio."""
    from types import SimpleNamespace

    from flax import nnx

    from experiments.distill.report import _hardening_lines
    from sparse_jax.models import GPT2, GPT2Config, harden

    config = distill.parse(
        _args(tmp_path, "run", "--harden.budget", "0.5", "--student.block-size", "4",
              "--harden.threshold", "None")
    )  # fmt: skip
    spec = distill_phases.student_spec(config)
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    teacher = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for block in student.h:  # supports of 2-3 candidates: threshold keeps them all
        logits = rng.normal(size=block.attn.core.logits[...].shape).astype(np.float32)
        block.attn.core.logits[...] = logits
    windows = rng.integers(0, 101, (4, 17)).astype(np.int32)
    run = SimpleNamespace(config=config, eval_windows=windows)
    out = job._threshold_against_budget(run, student, teacher, 64)
    by_budget = harden(student, budget=0.5, length=64, price="blocks")
    by_threshold = harden(student, threshold=config.harden.threshold, length=16)
    for name, model in (("budget", by_budget), ("threshold", by_threshold)):
        assert out[name]["kl"] == pytest.approx(measure.evaluate_lm(model, windows, teacher)[1])
        assert out[name]["attention_flops"] == model.flops(64).attention
    assert out["budget"]["attention_flops"] < out["threshold"]["attention_flops"]
    text = "\n".join(_hardening_lines({"hardening": out, "serve_len": 64}))
    assert f"{out['threshold']['kl'] / out['budget']['kl']:.2f}" in text
    assert f"| --harden.budget | {out['budget']['kl']:.4f} |" in text


def test_the_windows_and_sinks_contrast_takes_out_every_candidate_that_reaches_far(tmp_path):
    """The report's contrast for a student without selections: the same student hardened with
    full causal and the strided pattern taken out (they reach the middle of a sequence at the
    serving length), each head on its strongest window or sink; the student unchanged."""
    from flax import nnx

    from sparse_jax.models import GPT2, GPT2Config, harden

    config = distill.parse(_args(tmp_path))
    bank = distill_phases.candidate_bank(config)  # sink(4), windows of 4 and 8, strided, causal
    serve = config.student.serve_len_factor * config.data.seq_len
    assert [distill_phases.reaches_far(c, serve) for c in bank] == [False] * 3 + [True] * 2
    spec = distill_phases.student_spec(config)
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    for block in student.h:  # strongest: causal, strided, the window of 8; then another
        logits = np.full(block.attn.core.logits[...].shape, -5.0, np.float32)
        logits[0, 4], logits[0, 1] = 5.0, 2.0  # causal, then the window of 4
        logits[1, 3], logits[1, 0] = 5.0, 2.0  # strided, then the sink
        logits[2, 2] = 5.0  # the window of 8
        block.attn.core.logits[...] = logits
    local = distill_phases.harden_to_local(config, student)
    for block in local.h:
        assert block.attn.core.head_masks() == (bank[1], bank[0], bank[2])
    assert harden(student).h[0].attn.core.head_masks()[0] == bank[4]  # the student unchanged
    # A model of fixed layers (nothing learned to choose among) has no such contrast.
    assert distill_phases.harden_to_local(config, harden(student)) is None


def test_select_blocks_adds_a_selection_that_hardening_keeps(tmp_path):
    """--student.select-blocks puts a BlockSelection last in the student's bank; a head that
    keeps it is hardened with it, and the summary's masks and block maps say so."""
    from flax import nnx

    from sparse_jax.dynamic import BlockSelection
    from sparse_jax.models import GPT2, GPT2Config, harden

    flags = ["--student.select-blocks", "2", "--student.select-block", "4"]
    spec = distill_phases.student_spec(distill.parse(_args(tmp_path, "run", *flags)))
    assert spec.candidates[:-1] == distill_phases.candidate_bank(distill.parse(_args(tmp_path)))
    assert spec.candidates[-1] == BlockSelection(2, block=4)
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    for block in student.h:  # head 0 on the selection alone, the others on full causal
        logits = np.full(block.attn.core.logits[...].shape, -5.0, np.float32)
        logits[0, -1] = logits[1:, -2] = 5.0
        block.attn.core.logits[...] = logits
    hard = harden(student)
    described = hard.h[0].attn.core.describe()
    assert described.endswith(
        "| BlockSelection(keep_blocks=2, block=4, local_blocks=1) on heads [0]"
    )
    maps = measure.block_maps(hard, 16)["blocks"][0]
    assert maps[0]["selections"] == ["BlockSelection(keep_blocks=2, block=4, local_blocks=1)"]
    assert "selections" not in maps[1]
    # The report's contrast: hardened with the selection taken out, head 0 on its strongest
    # static candidate (all at -5: the first, the sink); the student itself unchanged.
    config = distill.parse(_args(tmp_path, "run", *flags))
    contrast = distill_phases.harden_without_selections(config, student)
    bank = distill_phases.candidate_bank(config)
    for block in contrast.h:
        assert block.attn.core.selections == ()
        assert block.attn.core.head_masks() == (bank[0], bank[-1], bank[-1])
    assert harden(student).h[0].attn.core.selections  # the student still holds its selection
    plain = distill.parse(_args(tmp_path))
    assert distill_phases.harden_without_selections(plain, harden(student)) is None
