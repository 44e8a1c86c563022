"""The state one distillation run shares between its phases: run folder, resumption, data,
mesh, metrics log, and the checkpointed training of one phase.

On several processes (hosts) every process runs every step; process 0 alone writes the run's
files (Orbax coordinates the checkpoints) and each process reads its own rows of every batch.

Example::

    from experiments import distill

    run = distill.Run(distill.parse(["--run.dir", "/tmp/run"]))
    model = run.train_phase("teacher", model, loss_fn, loop.TrainConfig(steps=10))
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
import zlib

import numpy as np
from tqdm.auto import tqdm

from experiments.common import run_folder
from experiments.common.flags import changed_flags
from experiments.common.phase import fit_to_the_end
from experiments.common.run_folder import (
    Program,
    RunFolderError,
    check_writable,
    failed_before_first_checkpoint,
    sibling,
)
from experiments.distill.cli import command, command_line
from experiments.distill.config import OLD_FLAGS, TEACHER_TEXT_ONLY, DistillConfig, TrainConfig
from sparse_jax.data import text
from sparse_jax.data.text import BatchIterator
from sparse_jax.files import write_text_atomically
from sparse_jax.training import sharding
from sparse_jax.training.checkpoint import Checkpointer
from sparse_jax.training.loop import Trainer, append_jsonl
from sparse_jax.training.stopping import StopRequest

__all__ = [
    "Run",
    "check_same_config",
    "log",
    "read_record",
    "resolve_run_dir",
]


def log(msg: str) -> None:
    """Progress on stderr, from the primary process only (the others run the same steps)."""
    if sharding.is_primary():
        print(msg, file=sys.stderr, flush=True)


def resolve_run_dir(config: DistillConfig, now: float | None = None) -> pathlib.Path:
    """The run folder: --run.dir, a new one named after ``now`` (default: the current time),
    or the newest one for --resume."""
    if config.run.dir is not None:
        return config.run.dir
    if config.resume:
        runs = sorted(pathlib.Path("runs").glob("distill-*"))
        if not runs:
            raise ValueError("--resume: no runs/distill-* folder to resume; pass --run.dir")
        return runs[-1]
    stamp = time.localtime(time.time() if now is None else now)
    return pathlib.Path("runs") / time.strftime("distill-%Y%m%d-%H%M%S", stamp)


# Flags that may differ between a run and its resumption (they change no trained number: a
# finished run resumed with more passkey sequences measures its recall table again on them); the
# data description follows from the data flags (and names the cache folder).
_RESUME_FREE = (
    "config",
    "resume",
    "run.dir",
    "run.cache_dir",
    "run.max_minutes",
    "measure.report_prompts",
    "measure.recall_sequences",
    "data_description",
)


def _flags_of_record(record: dict) -> dict:
    """A config.json as dotted flag names; a run written before the flags were grouped (no
    group holds a dict) is read through OLD_FLAGS. A run written before --harden.price
    budgeted in density, and one written before --harden.finetune-lr fine-tuned at --train.lr
    without a warm-up: each is read so."""
    if not any(isinstance(v, dict) for v in record.values()):
        out = {OLD_FLAGS.get(key, key): value for key, value in record.items()}
    else:
        out = {}
        for key, value in record.items():
            if isinstance(value, dict):
                out |= {f"{key}.{name}": v for name, v in value.items()}
            else:
                out[key] = value
    out = {"harden.price": "density", **out}
    if "harden.finetune_lr" not in out:
        lr = out.get("train.lr", TrainConfig.lr)
        out |= {"harden.finetune_lr": lr, "harden.finetune_warmup": 0}
    return out


def check_same_config(saved: dict, given: dict, folder: pathlib.Path | None = None) -> None:
    """--resume continues the run it finds: refuse flags that would change what it computes.
    ``saved`` and ``given`` are config.json records; a flag that the run's (older) record lacks
    must be at the value the run had (its default then: the text-only teacher's flags, for those
    added since; today's default for the others). ``folder`` (the run's) lets the message give
    the exact command."""
    saved, given = _flags_of_record(saved), _flags_of_record(given)
    # The teacher and student-data flags the record lacks, at the values the run had (so that
    # the command below that resumes it names them too).
    before = {f"teacher.{name}": value for name, value in TEACHER_TEXT_ONLY.items()}
    before["train.recall_fraction"] = 0.0  # the student's batches were text alone then
    saved = {**before, **saved}
    changed = changed_flags(saved, given, ignore=_RESUME_FREE, defaults=DistillConfig().flags())
    if changed:
        how = "Resume with the run's flags, or start a new --run.dir"
        if folder is not None:
            run_flags = {**saved, "resume": True, "run.dir": str(folder)}
            # A run that stopped before its first checkpoint may be started afresh in place.
            restart = folder.is_dir() and failed_before_first_checkpoint(folder)
            where = "" if restart else " in a new folder"
            now_dir = folder if restart else sibling(folder)
            now = {**given, "resume": False, "run.dir": str(now_dir)}
            how = (
                f"Resume with the run's flags:  {command_line(run_flags)}   or start these flags "
                f"afresh{where}:  {command_line(now)}"
            )
        raise RunFolderError(
            "--resume: this command's configuration differs from the run's config.json in "
            + "; ".join(changed)
            + ". "
            + how
        )


class Run:
    """State shared by the phases of one run: data, mesh, folders, the metrics log.

    Nothing is written into the run folder before every check that can fail has passed (flags,
    mesh, data, the folder itself, whether it and the cache can be written). A fresh start
    refuses a folder that holds checkpoints or a finished run, saying the command that continues
    it; a folder left by a run that failed before its first checkpoint is started afresh.
    ``--resume`` refuses a folder that does not exist, holds no run or another program's run,
    saying the command that starts one (:mod:`experiments.common.run_folder`, the checks the
    cascade and the chain of thought share).
    """

    def __init__(self, config: DistillConfig):
        self.config = config
        self.stop: StopRequest | None = None  # ends the phases early (distill.run sets it)
        # Several processes (one per host): all run every step; process 0 alone writes the
        # run's files, and each reads its slice of a batch.
        sharding.maybe_initialize_distributed()
        self.primary = sharding.is_primary()
        now = float(sharding.broadcast_from_primary(np.float64(time.time())))
        self.dir = resolve_run_dir(config, now)
        self.cache = pathlib.Path(os.path.expanduser(config.run.cache_dir))
        self.metrics_path = self.dir / "metrics.jsonl"
        config_path = self.dir / "config.json"
        saved = self._check_folder()  # the run's record on --resume, else None
        self.mesh = sharding.make_mesh(config.run.data_axis, config.run.model_axis)
        sharding.check_batch(config.data.batch_size, self.mesh)
        d = config.data
        log(f"preparing data {d.source!r} ...")
        # The primary writes the prepared dataset once; the others then read it.
        for turn in ("primary", "others"):
            if self.primary == (turn == "primary"):
                self.data = text.prepare(
                    d.source, d.tokenizer, d.seq_len, data_dir=self.cache / "tfds"
                )
            sharding.sync_processes(f"distill_data_prepared_{turn}")
        teacher = config.teacher.hf_config()  # a local --teacher.source folder's sizes
        if teacher is not None and teacher.vocab_size < self.data.vocab_size:
            raise ValueError(
                f"--teacher.source {config.teacher.source!r} has a vocabulary of "
                f"{teacher.vocab_size} but --data.tokenizer {d.tokenizer!r} produces ids up to "
                f"{self.data.vocab_size - 1}: pass a teacher of that tokenizer"
            )
        record = json.loads(json.dumps(_record(config, self.data.describe()), default=str))
        if saved is not None:
            check_same_config(saved, record, self.dir)
        # Fixed evaluation batches: the first windows of the evaluation split.
        n_eval = min(len(self.data.eval), config.measure.eval_batches * d.batch_size)
        if n_eval < 1:
            raise ValueError(
                f"the evaluation split of --data.source {d.source!r} has no window of "
                f"--data.seq-len + 1 = {d.seq_len + 1} tokens: pass a shorter --data.seq-len "
                "or a longer corpus"
            )
        self.eval_windows = np.asarray(self.data.eval[list(range(n_eval))], np.int32)
        # Every check passed: the run folder is written from here on.
        if self.primary:
            if saved is None:
                self._clear_failed_start()
                self.dir.mkdir(parents=True, exist_ok=True)
                write_text_atomically(config_path, json.dumps(record, indent=2) + "\n")
        sharding.sync_processes("distill_run_dir_ready")
        log(self.data.describe())

    def _check_folder(self) -> dict | None:
        """Refuses a run folder this command cannot use, or a run or cache folder it cannot
        write (:mod:`experiments.common.run_folder`; leaves nothing behind); returns the run's
        record for --resume."""
        saved = run_folder.check_folder(self.dir, self.program(), resume=self.config.resume)
        if self.primary:  # the one that writes them
            check_writable(self.dir, "--run.dir")
            check_writable(self.cache, "--run.cache-dir", existing_may_be_read_only=True)
        return saved

    def program(self) -> Program:
        """How the run-folder checks speak of this job's runs: the commands that start one in a
        folder and continue the one there."""
        c = self.config

        def resume(folder: pathlib.Path, record: dict | None) -> str:
            if record is None:  # its config.json is damaged: read_record says so on --resume
                return command(c, resume=True, run_dir=folder)
            flags = {**_flags_of_record(record), "resume": True}
            return command_line(flags | {"run.dir": str(folder)})

        return Program(
            "distill",
            resume_flag="--resume",
            start=lambda folder: command(c, resume=False, run_dir=folder),
            resume=resume,
            check_record=_check_groups,
        )

    def _clear_failed_start(self) -> None:
        """A folder left by a run that failed before its first checkpoint: its log and
        checkpoint leftovers go (config.json is written again)."""
        run_folder.clear_failed_start(self.dir, log)

    def log(self, record) -> None:
        if self.primary:
            append_jsonl(self.metrics_path, record)

    def forget_metrics_after(self, phase: str, step: int) -> None:
        """Drops the metrics a killed run logged for ``phase`` after the checkpoint it resumes
        from (``step``): they are computed again, and the log keeps one line per step."""
        if self.primary:
            run_folder.forget_metrics_after(self.metrics_path, phase, step)

    def batches(self, phase: str, data_state):
        """This process's rows of the phase's batches, from where ``data_state`` left off."""
        index, count = sharding.process_data_slice(self.mesh)
        processes = {"process_index": index, "process_count": count}
        if data_state and "iterator" in data_state:
            return BatchIterator.from_state(self.data.train, data_state["iterator"], **processes)
        seed = self.config.run.seed + zlib.crc32(phase.encode()) % 1000
        return BatchIterator(self.data.train, self.config.data.batch_size, seed=seed, **processes)

    def train_phase(
        self, phase, model, loss_fn, train_config, *, frozen=None, evaluate=None, batches=None
    ):
        """Runs (or resumes) one phase with a progress bar; returns the trained model (its
        arrays on this process's device, see :func:`~sparse_jax.training.sharding.local_model`).
        ``batches(iterator_state or None)`` gives another iterator than the corpus windows (one
        with ``state()``, e.g. a :class:`~sparse_jax.data.recall.RecallMixture`)."""
        c = self.config
        ckpt = Checkpointer(
            self.dir / "checkpoints" / phase,
            save_every=c.run.checkpoint_every,
            keep_last=2,
            best_metric="eval_loss",
        )
        trainer = Trainer(
            model, loss_fn, train_config, frozen_models=frozen, mesh=self.mesh, checkpointer=ckpt
        )
        again = command(c, resume=True, run_dir=self.dir)
        data_state = run_folder.restore_phase(trainer, phase, again) if c.resume else None
        if data_state is not None:
            log(f"{phase}: resumed at step {trainer.step} from {ckpt.directory}")
        if c.resume:
            self.forget_metrics_after(phase, trainer.step)
        if batches is None:
            iterator = self.batches(phase, data_state)
        else:
            iterator = batches(data_state.get("iterator") if data_state else None)
        bar = tqdm(
            total=train_config.steps,
            initial=trainer.step,
            desc=phase,
            file=sys.stderr,
            disable=not self.primary,
        )

        def on_step(step, metrics):
            shown = {k: metrics[k] for k in ("loss", "kl", "density") if k in metrics}
            shown["tok/s"] = metrics.get("tokens_per_s", 0.0)
            bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})
            bar.update(1)
            self.log({"phase": phase, "step": step, **metrics})

        fit_to_the_end(
            trainer, iterator, phase, on_step=on_step, evaluate=evaluate,
            eval_every=c.run.checkpoint_every, stop=self.stop, closing=(bar, ckpt), folder=self.dir,
        )  # fmt: skip
        return sharding.local_model(trainer.sync_model())


def read_record(path: pathlib.Path, config: DistillConfig) -> dict:
    """A run folder's config.json (its flags); a ValueError naming the file, what is wrong and
    what to do when it cannot be read."""
    new_run = command(config, resume=False, run_dir=sibling(path.parent))
    advice = (
        "It records the run's flags: put back a good copy, or start a new run with:  " + new_run
    )
    record = run_folder.read_record(path, advice)
    _check_groups(path, record, advice)
    return record


def _check_groups(path: pathlib.Path, record: dict, advice: str) -> None:
    """Refuses a grouped config.json whose group is not an object of flags."""
    grouped = any(isinstance(value, dict) for value in record.values())  # else the old flat
    for key, value in record.items():
        if grouped and key in _GROUPS and not isinstance(value, dict):
            raise RunFolderError(
                f"{path}: the group {key!r} must be a JSON object of flags; got "
                f"{type(value).__name__} {value!r:.60}. {advice}"
            )


_GROUPS = tuple(
    f.name for f in dataclasses.fields(DistillConfig) if dataclasses.is_dataclass(f.default)
)


def _record(config: DistillConfig, data_description: str) -> dict:
    """What config.json holds: the program, every group as a dict, and the data's
    description."""
    record = {**dataclasses.asdict(config), "data_description": data_description}
    return run_folder.with_program(record, "distill")
