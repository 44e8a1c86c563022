"""The run folder of an experiment's program, handled one way by the main job
(``experiments.distill``), the cascade and the chain of thought: what a folder may be used for
(:func:`check_folder`: a fresh start refuses a folder that already holds a run, a resumption
refuses a folder that is missing, empty or another program's), whether it can be written
(:func:`check_writable`, also for the data cache), which program wrote it (the ``"program"`` of
its ``config.json``, :func:`program_of`), the metrics a killed run logged past the checkpoint it
resumes from (:func:`forget_metrics_after`) and a phase whose every checkpoint is unreadable
(:func:`restore_phase`; the newest readable one is taken by the
:class:`~sparse_jax.training.checkpoint.Checkpointer` itself).

Every refusal is a :class:`RunFolderError` (a ``ValueError``) naming the flag, the folder and
what to do; the programs' ``main`` turns it into one line and exit status 2.

>>> import tempfile
>>> top = pathlib.Path(tempfile.mkdtemp())
>>> check_writable(top / "new" / "run", "--run.dir")  # it can be made; nothing is left behind
>>> sorted(top.iterdir())
[]
>>> _ = (top / "file").write_text("not a folder")
>>> check_writable(top / "file" / "run", "--run.dir")
Traceback (most recent call last):
experiments.common.run_folder.RunFolderError: --run.dir '.../file/run' cannot be created or ...
>>> check_folder(top / "run", CASCADE, resume=True)
Traceback (most recent call last):
experiments.common.run_folder.RunFolderError: --run.resume: the run folder '.../run' does not ...
>>> check_folder(top / "run", CASCADE, resume=False) is None  # a fresh start: nothing there
True
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from experiments.common.flags import CHECKPOINT_FLAGS, check_resume
from sparse_jax.files import write_text_atomically
from sparse_jax.training.checkpoint import CheckpointError, NoReadableCheckpointError

__all__ = [
    "CASCADE",
    "COT",
    "METRICS",
    "PROGRAMS",
    "RECORD",
    "Program",
    "RunFolderError",
    "check_folder",
    "check_same_flags",
    "check_writable",
    "checkpoint_steps",
    "clear_failed_start",
    "failed_before_first_checkpoint",
    "forget_metrics_after",
    "program_of",
    "read_record",
    "restore_phase",
    "sibling",
    "with_program",
]

RECORD = "config.json"  # a run's flags, and the program that wrote it ("program")
METRICS = "metrics.jsonl"  # one line per update (and evaluation) of each phase
# The programs that write run folders, by the name their config.json records.
PROGRAMS = {
    "distill": "python -m experiments.distill",
    "cascade": "python -m experiments.cascade",
    "cot": "python -m experiments.cot",
}
_COT_RECORD = "cot.json"  # sparse_jax.cot.RECORD: what Solver.load reads in a chain-of-thought run


class RunFolderError(ValueError):
    """A run folder (or cache folder) this command cannot use; the message names the flag, the
    folder and what to do."""


@dataclasses.dataclass(frozen=True)
class Program:
    """How one program's messages speak of its run folders.

    ``name``: a key of :data:`PROGRAMS` (recorded in ``config.json``); ``noun``: what the
    messages call its run (``"cascade "`` gives "no cascade run"; the main job's: ""),
    ``resume_flag`` its flag; ``early_files``: what a run writes before its first checkpoint
    besides config.json, metrics.jsonl and checkpoints/ (a folder holding no more is started
    afresh in place). ``start(folder)``: the command that starts a run there, ``resume(folder,
    record)``: the one that continues it (``record``: its config.json, None when unreadable);
    None: the messages say it in words. ``check_record(path, record, advice)``: the program's
    own checks of a config.json read on resumption (raise ``ValueError``)."""

    name: str
    noun: str = ""
    resume_flag: str = "--run.resume"
    early_files: tuple[str, ...] = ()
    start: Callable[[pathlib.Path], str] | None = None
    resume: Callable[[pathlib.Path, dict | None], str] | None = None
    check_record: Callable[[pathlib.Path, dict, str], None] | None = None

    def start_text(self, folder: pathlib.Path, it: str = "it") -> str:
        if self.start is not None:
            return f"Start {it} with:  {self.start(folder)}"
        return f"Start {it} with the same command without {self.resume_flag}."


CASCADE = Program("cascade", noun="cascade ")
COT = Program("cot", noun="chain-of-thought ", early_files=(_COT_RECORD,))


def with_program(record: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``record`` (a run's flags) with the program that wrote it (a key of :data:`PROGRAMS`), as
    config.json holds it."""
    return {"program": name, **record}


def program_of(record: Mapping[str, Any], folder: pathlib.Path) -> str | None:
    """The program that wrote the run of ``folder`` whose config.json is ``record``: its
    ``"program"``, or for a run written before that field, what its files say (a chain-of-thought
    run holds cot.json, a cascade's flags hold ``sweep``, the main job's its teacher and data
    description); None when nothing says."""
    name = record.get("program")
    if isinstance(name, str):
        return name
    if (pathlib.Path(folder) / _COT_RECORD).is_file():
        return "cot"
    if "sweep" in record:
        return "cascade"
    if "teacher" in record or "data_description" in record:  # grouped or the flat flags of old
        return "distill"
    return None


def read_record(path: pathlib.Path, advice: str) -> dict:
    """A run folder's config.json (its flags); a :class:`RunFolderError` naming the file, what is
    wrong and ``advice`` when it cannot be read."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RunFolderError(f"{path} cannot be read ({err}). {advice}") from err
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        what = "is empty" if not text.strip() else f"is not valid JSON ({err})"
        raise RunFolderError(f"{path} {what}. {advice}") from err
    if not isinstance(record, dict):
        raise RunFolderError(
            f"{path} must hold a JSON object of the run's flags; got {type(record).__name__}. "
            + advice
        )
    return record


def _read(folder: pathlib.Path, program: Program) -> dict:
    path = folder / RECORD
    new_run = program.start(sibling(folder)) if program.start is not None else None
    advice = "It records the run's flags: put back a good copy, or start a new run " + (
        f"with:  {new_run}" if new_run else f"in another --run.dir without {program.resume_flag}"
    )
    record = read_record(path, advice)
    if program.check_record is not None:
        try:
            program.check_record(path, record, advice)
        except RunFolderError:
            raise
        except ValueError as err:
            raise RunFolderError(str(err)) from err
    return record


def _foreign(folder: pathlib.Path, other: str | None, program: Program, flag: str) -> str:
    """The message for a folder whose run another program (``other``; None: unknown) wrote."""
    mine = PROGRAMS[program.name]
    if other is None:
        return (
            f"{flag}: {folder / RECORD} is not the record of a run of {mine} (nor of another "
            f"experiment): pass the --run.dir of a {program.noun}run"
        )
    command = PROGRAMS.get(other, other)
    return (
        f"{flag}: {str(folder)!r} holds a run of {command}, not of {mine}: continue it with "
        f"{command} (its --run.dir and resume flag), or pass the --run.dir of a "
        f"{program.noun}run"
    )


def check_folder(folder: str | os.PathLike, program: Program, *, resume: bool) -> dict | None:
    """Refuses a run folder this command cannot use (reads only); returns the run's config.json
    for a resumption (``resume``), else None.

    A resumption needs a folder holding this program's run: a missing folder, a file, an empty
    folder, one without config.json, a damaged config.json or another program's run are
    refused, saying what the folder is and how to start. A fresh start takes a missing or empty
    folder, or one left by a run of this program that failed before its first checkpoint
    (:func:`failed_before_first_checkpoint`; :func:`clear_failed_start` clears it); it refuses a
    file, a folder holding anything else, and a run (saying the command that continues it).
    """
    folder = pathlib.Path(folder)
    flag = program.resume_flag
    record_path = folder / RECORD
    if resume:
        if not folder.is_dir():
            if folder.exists():
                raise RunFolderError(
                    f"{flag}: --run.dir {str(folder)!r} is a file, not a run folder: pass the "
                    f"--run.dir of the {program.noun}run to continue"
                )
            raise RunFolderError(
                f"{flag}: the run folder {str(folder)!r} does not exist, so there is no "
                f"{program.noun}run to continue. {program.start_text(folder)}"
            )
        if not record_path.exists():
            if checkpoint_steps(folder):
                where = (
                    f"with:  {program.start(sibling(folder))}"
                    if program.start is not None
                    else f"(another --run.dir, without {flag})"
                )
                raise RunFolderError(
                    f"{flag}: {folder} holds checkpoints but no config.json (the run's flags): "
                    f"put it back, or start a new run in another folder {where}"
                )
            empty = "is empty: it " if not any(folder.iterdir()) else ""
            raise RunFolderError(
                f"{flag}: {folder} {empty}holds no {program.noun}run to continue (no "
                f"config.json). {program.start_text(folder, 'one')}"
            )
        record = _read(folder, program)
        other = program_of(record, folder)
        if other != program.name:
            raise RunFolderError(_foreign(folder, other, program, flag))
        _check_checkpoints_inside(folder, flag)
        return record
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"--run.dir {str(folder)!r} is a file; choose another --run.dir")
    if not folder.exists() or not any(folder.iterdir()):
        return None
    record = None
    if record_path.exists():
        try:
            record = _read(folder, program)
        except RunFolderError:
            pass  # damaged: a resumption says so
    other = None if record is None else program_of(record, folder)
    if record is not None and other != program.name:
        what = f"a run of {PROGRAMS.get(other, other)}" if other else "a config.json of no run"
        raise RunFolderError(
            f"--run.dir {str(folder)!r} holds {what}; nothing is overwritten: choose another "
            "--run.dir"
        )
    if failed_before_first_checkpoint(folder, program.early_files):
        return None
    steps = checkpoint_steps(folder)
    if not record_path.exists() and not steps and not (folder / "summary.json").exists():
        raise RunFolderError(
            f"--run.dir {str(folder)!r} is not empty and holds no run of this job: choose "
            "another --run.dir (nothing is overwritten)"
        )
    held = ", ".join(f"{phase} up to step {max(s)}" for phase, s in steps.items())
    held = f"checkpoints of {held}" if held else "a finished run"
    if program.resume is not None and program.start is not None:
        how = (
            f"Continue it with:  {program.resume(folder, record)}   or start afresh in a new "
            f"folder with:  {program.start(sibling(folder))}"
        )
    else:
        how = f"Continue it with {flag}, or pass another --run.dir"
    raise RunFolderError(
        f"--run.dir {str(folder)!r} already holds a run ({held}); nothing is overwritten. {how}"
    )


def _check_checkpoints_inside(folder: pathlib.Path, flag: str) -> None:
    """Refuses a resumption whose checkpoints (a phase's folder or a step in it) are links that
    lead out of the run folder: a run folder is data a user may have downloaded, and nothing in
    it may make the run read (or later write) elsewhere."""
    root = folder.resolve()
    top = folder / "checkpoints"
    entries = [top] if top.is_symlink() else []
    if top.is_dir():
        for phase in top.iterdir():
            entries.append(phase)
            if phase.is_dir():
                entries += list(phase.iterdir())
    for entry in entries:
        target = entry.resolve()
        if not target.is_relative_to(root):
            raise RunFolderError(
                f"{flag}: {entry} leads to {target}, outside the run folder {root}: refused "
                "(a run folder's checkpoints lie inside it; copy the files in, not a link)"
            )


def check_same_flags(
    config: Any,
    folder: pathlib.Path,
    program: Program,
    *,
    only=CHECKPOINT_FLAGS,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """A resumption keeps the flags that decide what the checkpoints hold
    (:func:`experiments.common.flags.check_resume`: ``only``, ``defaults``); its refusal, naming
    each changed flag, is a :class:`RunFolderError`."""
    try:
        check_resume(config, folder, kind=program.noun.strip(), only=only, defaults=defaults)
    except RunFolderError:
        raise
    except ValueError as err:
        raise RunFolderError(str(err)) from err


def check_writable(path: str | os.PathLike, flag: str, *, existing_may_be_read_only=False) -> None:
    """Refuses (:class:`RunFolderError` naming ``flag`` and ``path``) a folder that cannot be
    created or written: a read-only filesystem or folder, a path that is a file or lies under
    one. Tries it: the folders it had to make and its test file are removed again, so a refusal
    found later leaves nothing behind. ``existing_may_be_read_only``: a folder that exists
    passes untried (a data cache shared read-only may hold everything a run reads)."""
    path = pathlib.Path(path)
    if existing_may_be_read_only and path.is_dir():
        return
    made: list[pathlib.Path] = []
    try:
        missing, above = [], path
        while not above.exists() and above != above.parent:
            missing.append(above)
            above = above.parent
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        blocking = next((p for p in (path, *path.parents) if p.is_file()), None)
        why = f"{blocking} is a file" if blocking is not None else err.strerror or str(err)
        raise RunFolderError(
            f"{flag} {str(path)!r} cannot be created or written ({why}): pass a folder this "
            "user can write"
        ) from err
    finally:
        for folder in reversed(made):
            try:
                folder.rmdir()
            except OSError:
                pass


def sibling(folder: pathlib.Path) -> pathlib.Path:
    """A folder beside ``folder`` that does not exist yet (``<name>-2``, ``-3``, ...)."""
    n = 2
    while folder.with_name(f"{folder.name}-{n}").exists():
        n += 1
    return folder.with_name(f"{folder.name}-{n}")


def checkpoint_steps(folder: pathlib.Path) -> dict[str, list[int]]:
    """The committed checkpoint steps of each phase in a run folder (Orbax renames a step's
    folder to its number when the write is complete)."""
    steps = {}
    for phase in sorted((folder / "checkpoints").glob("*")):
        found = [int(p.name) for p in phase.glob("*") if p.name.isdigit() and p.is_dir()]
        if found:
            steps[phase.name] = sorted(found)
    return steps


def failed_before_first_checkpoint(folder: pathlib.Path, early_files: tuple[str, ...] = ()) -> bool:
    """The folder holds only what a run writes before its first checkpoint: config.json,
    metrics.jsonl, checkpoint folders without a committed step and ``early_files`` (no summary,
    no report)."""
    allowed = {RECORD, METRICS, "checkpoints", *early_files}
    names = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
    return names <= allowed and RECORD in names and not checkpoint_steps(folder)


def clear_failed_start(folder: pathlib.Path, log: Callable[[str], None]) -> None:
    """A folder left by a run that failed before its first checkpoint: its log and checkpoint
    leftovers go (config.json is written again)."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    log(
        f"{folder}: the run there stopped before its first checkpoint; starting it afresh "
        "with this command's flags"
    )
    (folder / METRICS).unlink(missing_ok=True)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def forget_metrics_after(path: pathlib.Path, phase: str, step: int) -> None:
    """Drops the lines of the metrics log ``path`` that a killed run wrote for ``phase`` after
    the checkpoint it resumes from (``step``): they are computed again, and the log keeps one
    line per step. A line cut short by the kill goes too."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
        if record.get("phase") == phase and record.get("step", -1) > step:
            continue
        kept.append(line)
    write_text_atomically(path, "".join(f"{line}\n" for line in kept))


def restore_phase(trainer, phase: str, command: str | None = None) -> dict | None:
    """``trainer.restore()``: the newest readable checkpoint of the phase (the
    :class:`~sparse_jax.training.checkpoint.Checkpointer` moves an unreadable newer one aside
    and warns), its data state or None. When none can be read they are moved aside (kept) and
    a ``CheckpointError`` says so and that the same command (``command``, when given) trains
    the phase from its start."""
    try:
        return trainer.restore()
    except NoReadableCheckpointError as err:
        ckpt = trainer.checkpointer
        moved = ckpt.quarantine(err.steps)
        ckpt.close()
        again = f":  {command}" if command else "."
        raise CheckpointError(
            f"{phase}: no checkpoint of this phase can be read ({err.details}). They were "
            f"moved aside (kept, not deleted) to {', '.join(str(m) for m in moved)}. Run "
            f"the same command again to train the {phase} phase from its start (the "
            f"earlier phases are kept){again}"
        ) from err
