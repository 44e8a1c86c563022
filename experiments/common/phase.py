"""One training phase of an experiment's run folder: the project's trainer with checkpoints,
resumption, a progress bar and ``metrics.jsonl`` (what ``experiments.cascade`` and
``experiments.cot`` share; the main job's phases add sharding and live in
``experiments.distill.run_folder``). A resumed phase starts from its newest readable checkpoint
and drops the metrics a killed run logged past it (:mod:`experiments.common.run_folder`, as the
main job does)."""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from experiments.common.flags import resume_command
from experiments.common.run_folder import (
    METRICS,
    RunFolderError,
    forget_metrics_after,
    restore_phase,
)
from sparse_jax.data.text import BatchIterator, BucketIterator, RandomAccess
from sparse_jax.training.checkpoint import Checkpointer, CheckpointError
from sparse_jax.training.loop import TrainConfig, Trainer, append_jsonl
from sparse_jax.training.stopping import StopRequest

# The exit status of a command stopped early with its checkpoints (sysexits' EX_TEMPFAIL: run
# it again, with --run.resume, to continue).
EXIT_STOPPED = 75


class RunStopped(Exception):
    """A training phase ended early at a checkpoint (a time limit, SIGTERM, Ctrl-C): the run
    in ``folder`` can be resumed from ``step`` of ``phase``. Its message says so."""

    def __init__(self, phase: str, step: int, steps: int, reason: str | None, folder):
        self.phase, self.step, self.steps, self.reason = phase, step, steps, reason
        self.folder = pathlib.Path(folder)  # the run folder --run.resume continues
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"{phase}: stopped{why} after update {step} of {steps}, with a checkpoint of it"
        )


def stop_request(max_minutes: float | None, log: Callable[[str], None]) -> StopRequest:
    """The :class:`StopRequest` of an experiment's command: ``--run.max-minutes`` from now, and
    SIGTERM / SIGINT, each announced through ``log``."""
    seconds = None if max_minutes is None else 60 * max_minutes
    return StopRequest(
        seconds,
        notify=lambda why: log(f"{why}: saving checkpoints and stopping (again to stop at once)"),
    )


def train_phase(
    model,
    loss_fn,
    config: TrainConfig,
    rows: RandomAccess | list[np.ndarray],
    *,
    folder: pathlib.Path,
    name: str,
    checkpoint_every: int,
    resume: bool,
    log: Callable[[str], None],
    shown: str = "loss",
    evaluate=None,
    stop: StopRequest | None = None,
) -> tuple[Trainer, float]:
    """Trains ``model`` on batches of ``rows`` (``config.batch_size`` rows, shuffled with
    ``config.seed``; a list of arrays: buckets of rows of their own lengths, each batch from
    one, :class:`~sparse_jax.data.text.BucketIterator`; anything else indexable, such as a
    ``WindowSource``: :class:`~sparse_jax.data.text.BatchIterator`) for ``config.steps`` updates,
    checkpointed every ``checkpoint_every`` in ``folder/checkpoints/<name>`` (``resume``: from
    the last one, batches included); each update's metrics go to ``folder/metrics.jsonl``
    under ``"phase": name`` and metric ``shown`` to the bar. ``evaluate(model) -> dict`` runs
    at each checkpoint. Returns the trainer (``sync_model()`` gives the trained model) and the
    phase's seconds.

    ``stop`` (a time limit, SIGTERM, Ctrl-C) ends the phase early with a checkpoint of the
    step it reached: :class:`RunStopped` is raised then, and ``resume`` continues from it."""
    started = time.perf_counter()
    # Without an evaluation there is no metric to keep the best checkpoint by (Orbax would
    # warn at every save).
    ckpt = Checkpointer(
        folder / "checkpoints" / name,
        save_every=checkpoint_every,
        keep_last=2,
        keep_best=evaluate is not None,
    )
    trainer = Trainer(model, loss_fn, config, checkpointer=ckpt)
    state = restore_phase(trainer, name) if resume else None
    if resume:  # the updates a killed run logged past its checkpoint are made (and logged) again
        forget_metrics_after(folder / METRICS, name, trainer.step)
    batches = BucketIterator if isinstance(rows, (list, tuple)) else BatchIterator
    if state is not None:
        log(f"{name}: resumed at step {trainer.step} of {config.steps}")
        iterator = batches.from_state(rows, state["iterator"])
    else:
        iterator = batches(rows, config.batch_size, seed=config.seed)
    bar = tqdm(total=config.steps, initial=trainer.step, desc=name, file=sys.stderr)

    def on_step(step, metrics):
        bar.set_postfix({shown: f"{metrics.get(shown, 0.0):.3g}"})
        bar.update(1)
        append_jsonl(folder / METRICS, {"phase": name, "step": step, **metrics})

    eval_every = checkpoint_every if evaluate is not None else 0
    fit_to_the_end(
        trainer, iterator, name, on_step=on_step, evaluate=evaluate, eval_every=eval_every,
        stop=stop, closing=(bar, ckpt), folder=folder,
    )  # fmt: skip
    return trainer, time.perf_counter() - started


def fit_to_the_end(
    trainer, iterator, name, *, on_step, evaluate, eval_every, stop, closing, folder
) -> None:
    """``trainer.fit`` over the batches of ``iterator`` (a ``BatchIterator`` or
    ``BucketIterator``, whose position the checkpoints keep) up to ``trainer.config.steps``;
    closes each of ``closing`` (a bar, a checkpointer) after, and raises :class:`RunStopped`
    (naming the run ``folder``) when ``stop`` ended it early."""
    try:
        for _ in trainer.fit(
            iterator,
            data_state=lambda: {"iterator": iterator.state()},
            on_step=on_step,
            evaluate=evaluate,
            eval_every=eval_every,
            stop=stop,
        ):
            pass
    finally:
        for thing in closing:
            thing.close()
    steps = trainer.config.steps
    if trainer.step < steps:
        reason = stop.reason if stop is not None else None
        raise RunStopped(name, trainer.step, steps, reason, folder)


def main_of(module: str, run: Callable, parse: Callable, argv, log: Callable[[str], None]):
    """An experiment's ``main``: ``run(parse(argv))`` (argv default: the command line's); a run
    stopped early (:class:`RunStopped`) prints the command that continues it (``python -m
    module`` with these arguments and ``--run.resume``) and exits with :data:`EXIT_STOPPED`. A
    run or cache folder it cannot use (:class:`~experiments.common.run_folder.RunFolderError`)
    is one line and exit status 2, as a bad flag is; checkpoints it cannot read or write
    (:class:`~sparse_jax.training.checkpoint.CheckpointError`), one line and status 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(parse(argv))
    except RunStopped as stopped:
        log(f"{stopped}. Continue with:  {resume_command(module, argv, stopped.folder)}")
        raise SystemExit(EXIT_STOPPED) from None
    except RunFolderError as refused:
        log(f"error: {refused}")
        raise SystemExit(2) from None
    except CheckpointError as unreadable:
        log(f"error: {unreadable}")
        raise SystemExit(1) from None
