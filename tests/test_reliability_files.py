"""Reliability of files, caches and run folders (issue 18, classes 4 and 5).

* Damaged Hugging Face folders (``model.safetensors`` empty, truncated or foreign; ``config.json``
  invalid, empty, not an object, lacking a key, of a wrong type) raise ``PretrainedFileError``
  (a ``ValueError``) naming the file, what is wrong and what to do: for ``from_pretrained``, for
  ``--teacher.source`` (refused when the config is built, before anything is written) and for
  the cached teacher.
* ``save_pretrained`` and the teacher cache: a folder appears whole or not at all; an
  interrupted cache write, or a folder left incomplete by an older version, makes the next run
  train the teacher again instead of failing for good.
* The run folder: its damaged ``config.json`` on --resume, --resume on a folder that does not
  exist, a run that failed before its first checkpoint then started again with corrected flags,
  the refusal of a folder holding checkpoints (its message gives commands that parse), every
  checkpoint of a phase unreadable (moved aside, a message, then the phase trained again), the
  metrics line of a checkpointed step kept when a kill comes before the checkpoint, and bad
  flags refused before the run folder is written.

The phases trained here are a bag of embeddings (compiles in about a second); the teacher
comes from a folder or a stub, so no test trains a GPT-2.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest
import safetensors.numpy
from flax import nnx

from experiments import distill
from experiments.distill import phases as distill_phases
from experiments.distill.run_folder import Run
from sparse_jax.models import from_pretrained, save_pretrained
from sparse_jax.models.gpt2 import GPT2, GPT2Config
from sparse_jax.models.hf import PretrainedFileError
from sparse_jax.training import loop
from sparse_jax.training.checkpoint import Checkpointer, CheckpointError
from tests import dead_sibling
from tests.test_distill import ROOT, TINY


def _args(tmp_path, run="run", *extra):
    dirs = ["--run.dir", str(tmp_path / run), "--run.cache-dir", str(tmp_path / "cache")]
    return [*TINY, *dirs, *extra]


def _teacher(vocab=257):
    return GPT2(GPT2Config.preset("tiny", vocab_size=vocab), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A good Hugging Face folder of a tiny GPT-2 on bytes (vocabulary 257)."""
    return save_pretrained(_teacher(), tmp_path_factory.mktemp("hf") / "tiny")


def _copy(folder, to):
    return pathlib.Path(shutil.copytree(folder, to))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    record = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del record[key]
        else:
            record[key] = value
    path.write_text(json.dumps(record))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# (what is done to the folder, the file named, what the message says)
DAMAGES = {
    "weights truncated": (lambda f: _truncate(f / "model.safetensors"), "model.safetensors",
                          "cannot be read as safetensors"),
    "weights empty": (lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors",
                      "is empty (0 bytes)"),
    "weights foreign": (lambda f: (f / "model.safetensors").write_bytes(b"PK\x03\x04" * 64),
                        "model.safetensors", "truncated, damaged or of another format"),
    "config invalid": (lambda f: (f / "config.json").write_text("{not json"), "config.json",
                       "is not valid JSON"),
    "config empty": (lambda f: (f / "config.json").write_text(""), "config.json", "is empty"),
    "config a list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json",
                      "must hold a JSON object"),
    "config lacks a key": (lambda f: _edit_config(f, n_layer=None), "config.json",
                           "lacks the keys ['n_layer']"),
    "config wrong type": (lambda f: _edit_config(f, n_head="3"), "config.json",
                          "`n_head` must be an int >= 1; got '3'"),
    "config bad epsilon": (lambda f: _edit_config(f, layer_norm_epsilon=-1), "config.json",
                           "`layer_norm_epsilon` must be a finite float > 0"),
    "config of another size": (lambda f: _edit_config(f, n_layer=3), "model.safetensors",
                               "does not hold the GPT-2 tensors that config.json describes"),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Class 4: damaged files.


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_from_pretrained_names_the_damaged_file(hf_folder, tmp_path, damage):
    mutate, name, problem = DAMAGES[damage]
    folder = _copy(hf_folder, tmp_path / "copy")
    mutate(folder)
    with pytest.raises(PretrainedFileError) as info:
        from_pretrained(folder)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and info.value.path == folder / name
    assert str(folder / name) in message and problem in message, message
    assert "pass another" in message.lower() or "pass a folder" in message.lower()  # what to do
    if damage != "config of another size":
        assert info.value.__cause__ is not None  # the library's error is kept


@pytest.mark.parametrize("damage", ["weights truncated", "config invalid", "config lacks a key"])
def test_teacher_source_folder_is_refused_when_the_config_is_built(
    hf_folder, tmp_path, damage, capsys
):
    mutate, name, problem = DAMAGES[damage]
    folder = _copy(hf_folder, tmp_path / "teacher")
    mutate(folder)
    with pytest.raises((ValueError, SystemExit)) as info:
        distill.main(_args(tmp_path, "run", "--teacher.source", str(folder)))
    message = " ".join((str(info.value) + capsys.readouterr().err).replace("│", " ").split())
    assert "--teacher.source" in message and name in message and problem in message, message
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_teacher_with_a_smaller_vocabulary_is_refused_before_the_run_folder(tmp_path):
    folder = save_pretrained(_teacher(vocab=101), tmp_path / "small")
    with pytest.raises(ValueError, match=r"has a vocabulary of 101 but --data.tokenizer 'byte'"):
        distill.main(_args(tmp_path, "run", "--teacher.source", str(folder)))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Class 5: save_pretrained and the teacher cache.


_save_file = safetensors.numpy.save_file


def _killed_after_the_weights(*args, **kwargs):
    """save_file, then the kill: model.safetensors is written, config.json is not."""
    _save_file(*args, **kwargs)
    raise KeyboardInterrupt


def test_save_pretrained_is_all_or_nothing(tmp_path, monkeypatch):
    model = _teacher()

    with monkeypatch.context() as m:
        m.setattr(safetensors.numpy, "save_file", _killed_after_the_weights)
        with pytest.raises(KeyboardInterrupt):
            save_pretrained(model, tmp_path / "model")
    assert os.listdir(tmp_path) == []  # no folder that looks saved, no leftover
    # A SIGKILL leaves the hidden partial folder: a later save removes it (its process is gone).
    leftover = dead_sibling(tmp_path / "model", "partial")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    save_pretrained(model, tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == ["model"]
    assert sorted(os.listdir(tmp_path / "model")) == ["config.json", "model.safetensors"]
    # Saving over an existing folder replaces each file whole.
    save_pretrained(model, tmp_path / "model")
    assert from_pretrained(tmp_path / "model").config == model.config


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """A Run (its data prepared once) whose teacher cache the cache tests use."""
    root = tmp_path_factory.mktemp("cache")
    return Run(distill.parse(_args(root)))


def test_teacher_cache_survives_an_interrupted_write(shared_run, monkeypatch):
    run = shared_run
    trained = []

    def train_teacher(run, attention=None):  # a stub: the cache logic, not training, is tested
        trained.append(1)
        return _teacher()

    monkeypatch.setattr(distill_phases, "_train_teacher", train_teacher)
    folder = run.cache / "teachers" / distill_phases.teacher_key(run.config, run.data)
    # 1. Killed while the cache is written: no cache folder is left that looks complete.
    with monkeypatch.context() as m:
        m.setattr(safetensors.numpy, "save_file", _killed_after_the_weights)
        with pytest.raises(KeyboardInterrupt):
            distill_phases.teacher(run)
    assert not folder.exists() and trained == [1]
    # 2. A folder an older version left incomplete (weights, no config.json) is not reused.
    folder.mkdir(parents=True)
    save_pretrained(_teacher(), folder.with_name("whole"))
    shutil.move(folder.with_name("whole") / "model.safetensors", folder / "model.safetensors")
    distill_phases.teacher(run)
    assert trained == [1, 1] and (folder / "config.json").exists()
    # 3. The complete cache is reused: no training.
    distill_phases.teacher(run)
    assert trained == [1, 1]
    # 4. A damaged cache names its file and says to delete the folder.
    _truncate(folder / "model.safetensors")
    with pytest.raises(PretrainedFileError) as info:
        distill_phases.teacher(run)
    message = str(info.value)
    assert str(folder / "model.safetensors") in message and f"rm -r {folder}" in message
    shutil.rmtree(folder)
    distill_phases.teacher(run)  # as the message says: trained and cached again
    assert trained == [1, 1, 1]


# ---------------------------------------------------------------------------------------------
# Class 5: the run folder.


def _refused(argv, capsys) -> str:
    """The one line ``python -m experiments.distill argv`` prints when it refuses its run
    folder (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as info:
        distill.main(argv)
    assert info.value.code == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert said.startswith("error: "), said
    return said


def test_resume_of_a_folder_that_does_not_exist_fails_and_says_how_to_start(tmp_path, capsys):
    said = _refused(_args(tmp_path, "missing", "--resume"), capsys)
    assert "does not exist, so there is no run to continue" in said
    command = said.split("Start it with:")[1].strip()
    assert not (tmp_path / "missing").exists()
    parsed = distill.parse(shlex.split(command)[3:])
    assert not parsed.resume and parsed == distill.parse(_args(tmp_path, "missing"))


def test_resume_of_a_folder_without_a_run_and_a_file_as_run_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    said = _refused(_args(tmp_path, "empty", "--resume"), capsys)
    assert "holds no run to continue (no config.json)" in said
    command = said.split("Start one with:")[1].strip()
    assert distill.parse(shlex.split(command)[3:]) == distill.parse(_args(tmp_path, "empty"))
    assert os.listdir(tmp_path / "empty") == []
    (tmp_path / "file").write_text("mine")
    assert "is a file; choose another --run.dir" in _refused(_args(tmp_path, "file"), capsys)
    assert (tmp_path / "file").read_text() == "mine"


def test_resume_of_a_missing_folder_from_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.distill", *_args(tmp_path, "missing"), "--resume"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "does not exist, so there is no run to continue" in done.stderr
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "is not valid JSON"),
        ("", "is empty"),
        ("[1, 2]", "must hold a JSON object of the run's flags; got list"),
        ('{"train": 5, "data": {}}', "the group 'train' must be a JSON object of flags"),
    ],
)
def test_damaged_run_config_on_resume_names_the_file(tmp_path, text, problem):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(text)
    with pytest.raises(ValueError) as info:
        Run(distill.parse(_args(tmp_path, "run", "--resume")))
    message = str(info.value)
    assert str(tmp_path / "run" / "config.json") in message and problem in message
    assert "start a new run with:" in message and f"--run.dir {tmp_path / 'run-2'}" in message
    decoding = text in ("{not json", "")
    assert isinstance(info.value.__cause__, json.JSONDecodeError) == decoding


class _Stop(Exception):
    """Raised by a stubbed phase: the run got past its set-up."""


def test_failed_run_then_corrected_rerun_in_the_same_folder(
    hf_folder, tmp_path, monkeypatch, capsys
):
    teacher = ["--teacher.source", str(hf_folder)]
    run_dir = tmp_path / "run"

    def crash(run, teacher):  # the student phase dies before its first checkpoint
        (run.dir / "checkpoints" / "student").mkdir(parents=True)
        run.log({"phase": "student", "step": 1, "loss": 1.0})
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(distill_phases, "student", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        distill.main(_args(tmp_path, "run", *teacher))
    assert (run_dir / "config.json").exists() and (run_dir / "metrics.jsonl").exists()

    def stop(run, teacher):
        raise _Stop(run)

    # --resume with corrected flags is refused, naming the command that starts them in place.
    corrected = _args(tmp_path, "run", *teacher, "--train.steps", "9")
    said = _refused([*corrected, "--resume"], capsys)
    assert "--train.steps (run: 8, now: 9)" in said
    command = said.split("or start these flags afresh:")[1].strip()
    assert distill.parse(shlex.split(command)[3:]) == distill.parse(corrected)
    # That command (a fresh start) takes the folder, since nothing was checkpointed.
    monkeypatch.setattr(distill_phases, "student", stop)
    with pytest.raises(_Stop):
        distill.main(shlex.split(command)[3:])
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 9
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    # So does --resume with the run's flags (there is nothing to restore yet).
    with pytest.raises(_Stop):
        distill.main(_args(tmp_path, "run", *teacher, "--train.steps", "9", "--resume"))


class _Bag(nnx.Module):
    """The smallest model a phase can train: an embedding of the byte ids."""

    def __init__(self):
        self.emb = nnx.Embed(257, 4, rngs=nnx.Rngs(0))


def _bag_loss(model, batch, rng):
    loss = jnp.mean((model.emb(batch) - 1.0) ** 2)
    return loss, {}


def _train_bag(run, steps=3):
    config = loop.TrainConfig(steps=steps, batch_size=4, warmup_steps=0)
    return run.train_phase("bag", _Bag(), _bag_loss, config)


def _lines(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r.get("phase") == "bag"]


def test_unreadable_checkpoints_are_moved_aside_with_a_message_then_the_phase_restarts(
    tmp_path,
):
    args = _args(tmp_path, "run", "--run.checkpoint-every", "1")
    _train_bag(Run(distill.parse(args)))
    ckpts = tmp_path / "run" / "checkpoints" / "bag"
    steps = sorted(p.name for p in ckpts.iterdir() if p.name.isdigit())
    assert steps == ["2", "3"]
    # A fresh start now refuses the folder; its message gives the commands that go on.
    with pytest.raises(ValueError, match="already holds a run") as info:
        Run(distill.parse(args))
    message = str(info.value)
    assert "checkpoints of bag up to step 3" in message
    resume = message.split("Continue it with:")[1].split("or start afresh")[0].strip()
    assert distill.parse(shlex.split(resume)[3:]) == distill.parse([*args, "--resume"])
    fresh = message.split("in a new folder with:")[1].strip()
    assert distill.parse(shlex.split(fresh)[3:]) == distill.parse(
        _args(tmp_path, "run-2", "--run.checkpoint-every", "1")
    )
    # Every checkpoint unreadable: --resume stops, says what to do, moves them aside.
    for step in steps:
        for item in (ckpts / step / "extra").rglob("*"):
            if item.is_file():
                item.write_text("{not json")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as info:
        _train_bag(Run(distill.parse([*args, "--resume"])))
    message = str(info.value)
    assert "bag: no checkpoint of this phase can be read" in message
    assert str(ckpts / "2.corrupt") in message and str(ckpts / "3.corrupt") in message
    assert "Run the same command again to train the bag phase from its start" in message
    again = message.split("(the earlier phases are kept):")[1].strip()
    assert distill.parse(shlex.split(again)[3:]) == distill.parse([*args, "--resume"])
    assert sorted(p.name for p in ckpts.iterdir()) == ["2.corrupt", "3.corrupt"]
    # The same command again: the phase is trained from step 0, each step logged once.
    _train_bag(Run(distill.parse([*args, "--resume"])))
    assert Checkpointer(ckpts, save_every=1).latest_step() == 3
    assert _lines(tmp_path / "run") == [1, 2, 3]


def test_a_kill_between_the_log_line_and_its_checkpoint_loses_no_line(tmp_path, monkeypatch):
    args = _args(tmp_path, "run", "--run.checkpoint-every", "2")
    save = Checkpointer.save

    def killed_at_4(self, step, *a, **k):
        if step == 4:
            raise KeyboardInterrupt  # the kill: step 4's line is logged, its checkpoint is not
        return save(self, step, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", killed_at_4)
        with pytest.raises(KeyboardInterrupt):
            _train_bag(Run(distill.parse(args)), steps=5)
    assert _lines(tmp_path / "run") == [1, 2, 3, 4]
    _train_bag(Run(distill.parse([*args, "--resume"])), steps=5)
    assert _lines(tmp_path / "run") == [1, 2, 3, 4, 5]  # each step once, none lost


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--student.windows", "0"], "--student.windows must be ints >= 1; got (0,)"),
        (["--run.data-axis", "3"], "make_mesh: a mesh of data=3 x model=1 = 3 devices"),
        (["--data.tokenizer", "/no/such"], "--data.tokenizer must be 'byte', 'gpt2' or a folder"),
    ],
)
def test_bad_flags_fail_before_the_run_folder_is_written(tmp_path, extra, match, capsys):
    with pytest.raises((ValueError, TypeError, FileNotFoundError, SystemExit)) as info:
        distill.main(_args(tmp_path, "bad", *extra))
    message = " ".join((str(info.value) + capsys.readouterr().err).replace("│", " ").split())
    assert match in message, message
    assert not (tmp_path / "bad").exists()


def test_run_folder_files_are_written_atomically(tmp_path, monkeypatch):
    Run(distill.parse(_args(tmp_path)))
    assert os.listdir(tmp_path / "run") == ["config.json"]  # no temporary file beside it
    saved = (tmp_path / "run" / "config.json").read_text()
    # A write that fails before its rename leaves the old file whole, and no temporary file.
    from sparse_jax import files

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        files.write_text_atomically(tmp_path / "run" / "config.json", "{}")
    assert (tmp_path / "run" / "config.json").read_text() == saved
    assert os.listdir(tmp_path / "run") == ["config.json"]
