"""The run folders of the three programs (the main job, the cascade, the chain of thought),
handled alike by experiments.common.run_folder: a resumption refuses a missing, empty or foreign
folder, a fresh start refuses a folder holding a run, a run or cache folder that cannot be
written is refused by its flag, all before any data is prepared (also on a read-only file system,
which the tests simulate: they may run as root, whom a read-only folder does not stop); a
checkpoint save that fails so midway keeps the checkpoint before it, and the run resumes from
it; a resumed chain-of-thought run falls back from a corrupt checkpoint and logs each update
once. And the messages that pointed
elsewhere: capacity_for's arguments, the cascade's --model.l1-weight, the chain of thought's
flag groups."""

from __future__ import annotations

import builtins
import dataclasses
import errno
import io
import json
import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from experiments import cascade as cascade_experiment
from experiments import cot as cot_experiment
from experiments import distill
from experiments.common import phase, run_folder
from experiments.distill.run_folder import Run
from sparse_jax import cot
from sparse_jax.data import linalg_cot, text
from sparse_jax.models.cascade import capacity_for
from sparse_jax.training.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    CorruptCheckpointWarning,
)
from sparse_jax.training.loop import TrainConfig
from tests.test_cascade import TINY_RUN as CASCADE_FLAGS
from tests.test_cot import RUN_FLAGS as COT_FLAGS
from tests.test_distill import TINY as DISTILL_FLAGS
from tests.test_reliability_files import _args as distill_args
from tests.test_reliability_files import _Bag, _bag_loss


@dataclasses.dataclass(frozen=True)
class Program:
    """One program as a user runs it: its main, its flags, its resume flag, and a run folder
    of it as it writes one (an older one: without the ``program`` field)."""

    name: str
    main: object
    flags: tuple[str, ...]
    resume: str
    record: dict
    files: tuple[str, ...] = ()  # besides config.json, what identifies its run

    def argv(self, folder, cache, *extra) -> list[str]:
        return [*self.flags, "--run.dir", str(folder), "--run.cache-dir", str(cache), *extra]

    def write_run(self, folder, *, program: bool = True, step: int | None = None) -> None:
        """A run folder of this program: its config.json (with the program's name unless
        ``program`` is False, as runs of before the field), its other files, a checkpoint."""
        folder.mkdir(parents=True)
        record = {"program": self.name, **self.record} if program else self.record
        (folder / "config.json").write_text(json.dumps(record))
        for name in self.files:
            (folder / name).write_text("{}")
        if step is not None:
            (folder / "checkpoints" / "phase" / str(step)).mkdir(parents=True)


PROGRAMS = {
    "distill": Program(
        "distill", distill.main, tuple(DISTILL_FLAGS), "--resume",
        {"teacher": {"source": "train"}, "data_description": "bytes"},
    ),
    "cascade": Program(
        "cascade", cascade_experiment.main, tuple(CASCADE_FLAGS), "--run.resume",
        {"model": {"size": "tiny"}, "sweep": []},
    ),
    "cot": Program(
        "cot", cot_experiment.main, ("train", *COT_FLAGS), "--run.resume",
        {"data": {"kinds": ["rref"]}}, files=(cot.RECORD,),
    ),
}  # fmt: skip
NAMES = list(PROGRAMS)


@pytest.fixture
def no_data(monkeypatch):
    """Preparing data fails: every refusal must come before it."""

    def prepare(*args, **kwargs):
        raise AssertionError("data prepared before the run folder was checked")

    monkeypatch.setattr(text, "prepare", prepare)
    monkeypatch.setattr(linalg_cot, "prepare", prepare)


def _refusal(program: Program, argv, capsys) -> str:
    """What the program's main says when it refuses ``argv``: a ValueError's message (the main
    job's main raises it), or the one line of a command that exits with status 2."""
    try:
        program.main(argv)
    except ValueError as err:
        return " ".join(str(err).split())
    except SystemExit as exit:
        assert exit.code == 2, exit.code
        return " ".join(capsys.readouterr().err.replace("│", " ").split())
    raise AssertionError(f"{program.name} accepted {argv}")


@pytest.mark.parametrize("name", NAMES)
def test_a_resumption_refuses_a_missing_an_empty_and_a_foreign_folder(
    name, tmp_path, no_data, capsys
):
    program = PROGRAMS[name]
    cache = tmp_path / "cache"
    missing = tmp_path / "missing"
    said = _refusal(program, program.argv(missing, cache, program.resume), capsys)
    assert f"{program.resume}: the run folder '{missing}' does not exist" in said, said
    assert "Start it with" in said and not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    said = _refusal(program, program.argv(empty, cache, program.resume), capsys)
    assert f"{empty} is empty: it holds no " in said and "run to continue (no config.json)" in said
    assert os.listdir(empty) == []
    # Another program's run, with the program recorded and from before the field (its files
    # say which): named as such, not as flags that differ.
    other = PROGRAMS[NAMES[(NAMES.index(name) + 1) % len(NAMES)]]
    for recorded in (True, False):
        foreign = tmp_path / f"foreign-{recorded}"
        other.write_run(foreign, program=recorded, step=4)
        said = _refusal(program, program.argv(foreign, cache, program.resume), capsys)
        assert (
            f"'{foreign}' holds a run of python -m experiments.{other.name}, not of "
            f"python -m experiments.{name}"
        ) in said, said
        assert "differ" not in said
        # A fresh start does not take it either.
        said = _refusal(program, program.argv(foreign, cache), capsys)
        assert f"--run.dir '{foreign}' holds a run of python -m experiments.{other.name}" in said
    assert not cache.exists()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("link", ["step", "phase"])
def test_a_resumption_refuses_checkpoints_linked_out_of_the_run_folder(
    name, link, tmp_path, no_data, capsys
):
    # A run folder may be downloaded: a checkpoint that is a link elsewhere is refused before
    # anything is read (or, on a later save, written) there.
    program = PROGRAMS[name]
    folder, outside = tmp_path / "run", tmp_path / "elsewhere"
    program.write_run(folder, step=4)
    (outside / "4").mkdir(parents=True)
    linked = folder / "checkpoints" / "phase"
    if link == "step":
        linked = linked / "4"
    os.rmdir(linked) if link == "step" else shutil.rmtree(linked)
    linked.symlink_to(outside / "4" if link == "step" else outside, target_is_directory=True)
    said = _refusal(program, program.argv(folder, tmp_path / "cache", program.resume), capsys)
    assert f"{linked} leads to {(outside / '4' if link == 'step' else outside).resolve()}" in said
    assert "outside the run folder" in said
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", NAMES)
def test_a_fresh_start_refuses_a_folder_that_holds_a_run(name, tmp_path, no_data, capsys):
    program = PROGRAMS[name]
    for recorded in (True, False):  # a run of before the program field too
        folder = tmp_path / f"run-{recorded}"
        program.write_run(folder, program=recorded, step=6)
        said = _refusal(program, program.argv(folder, tmp_path / "cache"), capsys)
        assert f"--run.dir '{folder}' already holds a run (checkpoints of phase up to step 6)" in (
            said
        ), said
        assert "nothing is overwritten" in said
    with pytest.raises(ValueError, match="already holds a run"):
        run_folder.check_folder(folder, run_folder.Program(name), resume=False)
    assert run_folder.check_folder(folder, run_folder.Program(name), resume=True) == program.record


def _read_only(tmp_path):
    """A folder chmod made read-only, or a skip where that does not stop this user (root)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        folder.chmod(0o755)
        pytest.skip("this user writes a read-only folder all the same (root)")
    return folder


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("flag", ["--run.dir", "--run.cache-dir"])
@pytest.mark.parametrize("blocked_by", ["a file", "a read-only folder"])
def test_a_run_or_cache_folder_that_cannot_be_written_is_refused_by_its_flag(
    name, flag, blocked_by, tmp_path, no_data, capsys
):
    program = PROGRAMS[name]
    if blocked_by == "a file":
        above = tmp_path / "file"
        above.write_text("not a folder")
        why = f"({above} is a file)"
    else:
        above = _read_only(tmp_path)
        why = "(Permission denied)"
    folders = {"--run.dir": tmp_path / "run", "--run.cache-dir": tmp_path / "cache"}
    folders[flag] = above / "inside"
    try:
        said = _refusal(program, program.argv(*folders.values()), capsys)
    finally:
        above.chmod(0o755)
    assert f"{flag} '{above / 'inside'}' cannot be created or written {why}" in said, said
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


class ReadOnlyFileSystem:
    """Makes ``mount`` behave as a file system mounted read-only while ``on``: creating,
    writing, renaming or removing anything in it fails with EROFS, as the kernel says it (for
    root too). The calls Python's files go through are patched (``os.mkdir``, which
    ``os.makedirs`` and ``Path.mkdir`` use, ``open`` and ``os.open`` for writing, ``os.rename``,
    ``os.replace``, ``os.unlink``, ``os.rmdir``); ``refused`` lists the paths refused."""

    def __init__(self, monkeypatch, mount, *, on: bool = True):
        self.mount, self.on, self.refused = os.path.abspath(mount), on, []
        for name in ("mkdir", "unlink", "remove", "rmdir", "rename", "replace"):
            monkeypatch.setattr(os, name, self._guard(getattr(os, name), name))
        monkeypatch.setattr(os, "open", self._guard(os.open, "os.open"))
        opened = self._guard(io.open, "open")
        monkeypatch.setattr(io, "open", opened)  # pathlib's reads and writes
        monkeypatch.setattr(builtins, "open", opened)

    def _inside(self, path, dir_fd=None) -> bool:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False  # a file descriptor
        path = os.fsdecode(path)
        if dir_fd is not None:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = os.path.abspath(path)
        return path == self.mount or path.startswith(self.mount + os.sep)

    def _guard(self, call, name):
        def guarded(path, *args, **kwargs):
            writes = True
            if name == "open":
                writes = any(c in (args[0] if args else kwargs.get("mode", "r")) for c in "wax+")
            elif name == "os.open":
                flags = args[0] if args else kwargs["flags"]
                writes = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            paths = [path, args[0]] if name in ("rename", "replace") else [path]
            dir_fd = kwargs.get("dir_fd", kwargs.get("src_dir_fd"))
            if self.on and writes and any(self._inside(p, dir_fd) for p in paths):
                self.refused.append(os.fsdecode(path))
                raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))
            return call(path, *args, **kwargs)

        return guarded


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "flag, exists",
    # (A data cache that exists is taken untried: one shared read-only may hold it all.)
    [("--run.dir", False), ("--run.cache-dir", False), ("--run.dir", True)],
    ids=["new run folder", "new cache folder", "existing run folder"],
)
def test_a_run_or_cache_folder_on_a_read_only_file_system_is_refused_by_its_flag(
    name, flag, exists, tmp_path, no_data, capsys, monkeypatch
):
    # What the read-only-folder case above checks, where a chmod does not stop this user.
    program = PROGRAMS[name]
    mount = tmp_path / "mount"
    mount.mkdir()
    folders = {"--run.dir": tmp_path / "run", "--run.cache-dir": tmp_path / "cache"}
    folders[flag] = mount if exists else mount / "inside"
    read_only = ReadOnlyFileSystem(monkeypatch, mount)
    said = _refusal(program, program.argv(*folders.values()), capsys)
    refused = f"{flag} '{folders[flag]}' cannot be created or written (Read-only file system)"
    assert refused in said, said
    assert read_only.refused and all(p.startswith(str(mount)) for p in read_only.refused)
    assert os.listdir(mount) == []
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def _bag_phase(name: str, tmp_path, *, resume: bool, steps: int = 5):
    """A bag-of-embeddings phase of ``steps`` updates with a checkpoint every 2, through the
    phase code of the main job (``"distill"``) or the one the cascade and the chain of thought
    share (``"shared"``); returns its checkpoint folder."""
    config = TrainConfig(steps=steps, batch_size=4, warmup_steps=0)
    if name == "distill":
        args = distill_args(tmp_path, "run", "--run.checkpoint-every", "2")
        run = Run(distill.parse([*args, "--resume"] if resume else args))
        run.train_phase("bag", _Bag(), _bag_loss, config)
    else:
        rows = np.arange(64, dtype=np.int32).reshape(16, 4)
        phase.train_phase(
            _Bag(), _bag_loss, config, rows, folder=tmp_path / "run", name="bag",
            checkpoint_every=2, resume=resume, log=print,
        )  # fmt: skip
    return tmp_path / "run" / "checkpoints" / "bag"


@pytest.mark.parametrize("name", ["distill", "shared"])
def test_a_save_failing_on_a_read_only_file_system_keeps_the_checkpoint_before_it(
    name, tmp_path, monkeypatch
):
    # The checkpoints' disk turns read-only as the step-4 save starts: the run stops with the
    # error, step 2 stays whole, and once the disk is writable again the run resumes from it.
    read_only = ReadOnlyFileSystem(monkeypatch, tmp_path / "run" / "checkpoints", on=False)
    save = ocp.CheckpointManager.save

    def save_on_a_read_only_disk(self, step, *args, **kwargs):
        read_only.on = step >= 4
        return save(self, step, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(ocp.CheckpointManager, "save", save_on_a_read_only_disk)
        with pytest.raises(OSError) as err:
            _bag_phase(name, tmp_path, resume=False)
    assert err.value.errno == errno.EROFS, err.value
    ckpts = tmp_path / "run" / "checkpoints" / "bag"
    # One line naming the checkpoint and what is kept (the programs print it and exit 1).
    assert isinstance(err.value, CheckpointSaveError), type(err.value)
    assert str(err.value).startswith(f"could not write checkpoint {ckpts / '4'} (step 4): ")
    assert "the checkpoint of step 2 is kept: resume from it" in str(err.value)
    assert "\n" not in str(err.value) and (err.value.step, err.value.kept) == (4, 2)
    assert read_only.refused and read_only.refused[0].startswith(str(ckpts / "4"))
    read_only.on = False
    assert sorted(os.listdir(ckpts)) == ["2"]
    with Checkpointer(ckpts, save_every=2) as ckpt:
        assert ckpt.all_steps() == [2] and ckpt.verify(2)[0], ckpt.verify(2)
    _bag_phase(name, tmp_path, resume=True)
    with Checkpointer(ckpts, save_every=2) as ckpt:
        assert ckpt.latest_step() == 5
    log = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1, 2, 3, 4, 5]  # each update once


def test_a_resumed_cot_run_falls_back_from_a_corrupt_checkpoint_and_logs_each_update_once(
    tmp_path,
):
    """A tiny run trained to its end; then the dense model's last checkpoint is corrupt and
    the metrics log holds what a killed run leaves (updates past the checkpoints, a line cut
    short). --run.resume restores the readable checkpoint before it, trains the updates after
    it again to the uninterrupted run's weights, and the log holds each update once."""
    flags = ["train", *COT_FLAGS, "--train.steps", "6", "--run.checkpoint-every", "3",
             "--run.cache-dir", str(tmp_path)]  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cot_experiment.run(cot_experiment.parse([*flags, "--run.dir", str(whole)]))
    assert json.loads((whole / "config.json").read_text())["program"] == "cot"
    shutil.copytree(whole, killed)
    ckpts = killed / "checkpoints" / "dense"
    for item in (ckpts / "6" / "extra").rglob("*"):
        if item.is_file():
            item.write_text("{not json")
    with (killed / "metrics.jsonl").open("a") as log:
        log.write(json.dumps({"phase": "sparse", "step": 7, "loss": 1.0}) + "\n")
        log.write('{"phase": "dense", "st')  # the kill cut this line short
    # A run of before the program field resumes (its cot.json says what it is).
    record = json.loads((killed / "config.json").read_text())
    del record["program"]
    (killed / "config.json").write_text(json.dumps(record))
    with pytest.warns(CorruptCheckpointWarning):
        cot_experiment.run(cot_experiment.parse([*flags, "--run.dir", str(killed), "--run.resume"]))
    assert sorted(p.name for p in ckpts.iterdir()) == ["3", "6", "6.corrupt"]
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["phase"], r["step"]) for r in rows]
    assert sorted(steps) == sorted((m, s) for m in ("sparse", "dense") for s in range(1, 7))
    for name in ("sparse", "dense"):
        a = nnx.state(cot.Solver.load(whole, name).model, nnx.Param)
        b = nnx.state(cot.Solver.load(killed, name).model, nnx.Param)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((5, 0), ValueError, r"capacity_for: `seq_len` must be an int >= 1; got 0"),
        ((5, 16, 0), ValueError, r"capacity_for: `buckets` must be an int >= 1; got 0"),
        ((-1, 16), ValueError, r"capacity_for: `count` must be an int in \[0, 16\]; got -1"),
        ((17, 16), ValueError, r"capacity_for: `count` must be an int in \[0, 16\]; got 17"),
        ((2.5, 16), TypeError, r"capacity_for: `count` must be an int in \[0, 16\]; got 2.5"),
    ],
)
def test_capacity_for_refuses_its_arguments_by_name(args, error, match):
    with pytest.raises(error, match=match):
        capacity_for(*args)


def test_capacity_for_accepts_numpy_counts():
    assert capacity_for(np.int64(0), 16) == 2 and capacity_for(np.int32(16), 16) == 16


def _parse_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        parse(argv)
    assert exit.value.code == 2
    return " ".join(capsys.readouterr().err.replace("│", " ").split())


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--model.l1-weight", "-1"], "--model.l1-weight"),
        (["--model.head-keep", "1", "0.5", "1.5", "0.5"], "--model.head-keep"),
        (["--model.keep-ratios", "1", "0.5", "0.7", "0.4"], "--model.keep-ratios"),
        (["--data.source", "/no/such/corpus"], "--data.source"),
    ],
)
def test_the_cascade_names_the_flag_at_fault(argv, flag, capsys):
    said = _parse_error(cascade_experiment.parse, argv, capsys)
    assert re.search(rf"Error parsing CascadeExperiment: {re.escape(flag)}\b", said), said
    others = {"--model.keep-ratios", "--model.head-keep", "--model.l1-weight", "--data.source"}
    others.discard(flag)
    assert not any(other in said for other in others), said


@pytest.mark.parametrize(
    "argv, group, message",
    [
        (["--train.steps", "0"], "train", "--train.steps must be an int >= 1; got 0"),
        (["train", "--run.checkpoint-every", "0"], "run", "--run.checkpoint-every must be an"),
        (["eval", "--eval.chunk", "0"], "eval", "--eval.chunk must be an int >= 1; got 0"),
        (["seeds", "--model.num-heads", "3"], "model", "--model.num-heads: "),
        (["train", "--run.resume"], "run", "--run.resume needs the --run.dir"),
    ],
)
def test_the_cot_command_line_names_the_flag_group_not_tyros_wrapper(argv, group, message, capsys):
    said = _parse_error(cot_experiment.parse, argv, capsys)
    assert "dummy" not in said and f"Error parsing {group}: {message}" in said, said
    assert "python -m experiments.cot" in said  # where the help is


def test_the_cot_command_line_still_lists_its_subcommands(capsys):
    with pytest.raises(SystemExit):
        cot_experiment.parse(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in cot_experiment.config.SUBCOMMANDS), out
    with pytest.raises(SystemExit):
        cot_experiment.parse(["train", "--help"])
    assert "usage: python -m experiments.cot train" in " ".join(capsys.readouterr().out.split())
    said = _parse_error(cot_experiment.parse, ["train-all"], capsys)
    assert "train-all" in said
