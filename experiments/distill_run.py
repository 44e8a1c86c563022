"""The state one distillation run shares between its phases: run folder, resumption, data,
mesh, metrics log, and the checkpointed training of one phase.

On several processes (hosts) every process runs every step; process 0 alone writes the run's
files (Orbax coordinates the checkpoints) and each process reads its own rows of every batch.

Example::

    from experiments import distill_config, distill_run

    run = distill_run.Run(distill_config.parse(["--run.dir", "/tmp/run"]))
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

from experiments.distill_config import OLD_FLAGS, DistillConfig
from sparse_jax.data import text
from sparse_jax.data.text import BatchIterator
from sparse_jax.training import sharding
from sparse_jax.training.checkpoint import Checkpointer
from sparse_jax.training.loop import Trainer, append_jsonl

__all__ = ["Run", "check_same_config", "log", "resolve_run_dir"]


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


# Flags that may differ between a run and its resumption (they change no trained number); the
# data description follows from the data flags (and names the cache folder).
_RESUME_FREE = (
    "config",
    "resume",
    "run.dir",
    "run.cache_dir",
    "measure.report_prompts",
    "data_description",
)


def _flags_of_record(record: dict) -> dict:
    """A config.json as dotted flag names; a run written before the flags were grouped (no
    group holds a dict) is read through OLD_FLAGS."""
    if not any(isinstance(v, dict) for v in record.values()):
        return {OLD_FLAGS.get(key, key): value for key, value in record.items()}
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out |= {f"{key}.{name}": v for name, v in value.items()}
        else:
            out[key] = value
    return out


def check_same_config(saved: dict, given: dict) -> None:
    """--resume continues the run it finds: refuse flags that would change what it computes.
    ``saved`` and ``given`` are config.json records; a flag that the run's (older) record lacks
    must be at its default."""
    saved, given = _flags_of_record(saved), _flags_of_record(given)
    defaults = DistillConfig().flags()
    changed = [
        f"--{key.replace('_', '-')} (run: {saved.get(key, defaults.get(key))!r}, "
        f"now: {given.get(key)!r})"
        for key in sorted(set(saved) | set(given))
        if key not in _RESUME_FREE and saved.get(key, defaults.get(key)) != given.get(key)
    ]
    if changed:
        raise ValueError(
            "--resume: this command's configuration differs from the run's config.json in "
            + "; ".join(changed)
            + ". Resume with the run's flags, or start a new --run.dir"
        )


class Run:
    """State shared by the phases of one run: data, mesh, folders, the metrics log."""

    def __init__(self, config: DistillConfig):
        self.config = config
        # Several processes (one per host): all run every step; process 0 alone writes the
        # run's files, and each reads its slice of a batch.
        sharding.maybe_initialize_distributed()
        self.primary = sharding.is_primary()
        now = float(sharding.broadcast_from_primary(np.float64(time.time())))
        self.dir = resolve_run_dir(config, now)
        self.cache = pathlib.Path(os.path.expanduser(config.run.cache_dir))
        if self.dir.exists() and any(self.dir.iterdir()) and not config.resume:
            raise ValueError(
                f"--run.dir {str(self.dir)!r} already holds a run: pass --resume to continue it "
                "or choose another --run.dir (nothing is overwritten)"
            )
        sharding.sync_processes("distill_run_dir_checked")
        self.dir.mkdir(parents=True, exist_ok=True)
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
        self.metrics_path = self.dir / "metrics.jsonl"
        record = json.loads(json.dumps(_record(config, self.data.describe()), default=str))
        config_path = self.dir / "config.json"
        if config.resume and config_path.exists():
            check_same_config(json.loads(config_path.read_text()), record)
        elif self.primary:
            config_path.write_text(json.dumps(record, indent=2) + "\n")
        log(self.data.describe())
        # Fixed evaluation batches: the first windows of the evaluation split.
        n_eval = min(len(self.data.eval), config.measure.eval_batches * d.batch_size)
        if n_eval < 1:
            raise ValueError("the evaluation split has no window of --data.seq-len + 1 tokens")
        self.eval_windows = np.asarray(self.data.eval[list(range(n_eval))], np.int32)

    def log(self, record) -> None:
        if self.primary:
            append_jsonl(self.metrics_path, record)

    def forget_metrics_after(self, phase: str, step: int) -> None:
        """Drops the metrics a killed run logged for ``phase`` after the checkpoint it resumes
        from (``step``): they are computed again, and the log keeps one line per step."""
        if not self.primary or not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
            if record.get("phase") == phase and record.get("step", -1) > step:
                continue
            kept.append(line)
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(self.metrics_path)

    def batches(self, phase: str, data_state):
        """This process's rows of the phase's batches, from where ``data_state`` left off."""
        index, count = sharding.process_data_slice(self.mesh)
        processes = {"process_index": index, "process_count": count}
        if data_state and "iterator" in data_state:
            return BatchIterator.from_state(self.data.train, data_state["iterator"], **processes)
        seed = self.config.run.seed + zlib.crc32(phase.encode()) % 1000
        return BatchIterator(self.data.train, self.config.data.batch_size, seed=seed, **processes)

    def train_phase(self, phase, model, loss_fn, train_config, *, frozen=None, evaluate=None):
        """Runs (or resumes) one phase with a progress bar; returns the trained model (its
        arrays on this process's device, see :func:`~sparse_jax.training.sharding.local_model`)."""
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
        data_state = trainer.restore() if c.resume else None
        if data_state is not None:
            log(f"{phase}: resumed at step {trainer.step} from {ckpt.directory}")
        if c.resume:
            self.forget_metrics_after(phase, trainer.step)
        iterator = self.batches(phase, data_state)
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

        for _ in trainer.fit(
            iterator,
            data_state=lambda: {"iterator": iterator.state()},
            on_step=on_step,
            evaluate=evaluate,
            eval_every=c.run.checkpoint_every,
        ):
            pass
        bar.close()
        ckpt.close()
        return sharding.local_model(trainer.sync_model())


def _record(config: DistillConfig, data_description: str) -> dict:
    """What config.json holds: every group as a dict, and the data's description."""
    return {**dataclasses.asdict(config), "data_description": data_description}
