"""One trainer for every experiment: an Optax loop over NNX state, sharded, checkpointed.

:class:`Trainer` trains the parameters of a model that a filter names (all of them, or e.g.
only the candidate-mask weights) with AdamW under a warm-up + cosine schedule, gradient
clipping and optional gradient accumulation (each update's batch split into micro-batches
whose gradients are averaged inside the one jitted step). The step is one ``jax.jit`` with
``in_shardings``/``out_shardings`` over a ``("data", "model")`` mesh (what ``pjit`` became):
batches split on ``data``, parameters and optimizer moments placed by the name rules of
:mod:`sparse_jax.training.sharding`. Other models the loss needs (a frozen teacher) are passed
to the step as arguments, never baked into the program as constants.

Checkpoints (:mod:`sparse_jax.training.checkpoint`) hold the model state, the optimizer state,
the data position and the RNG, so ``resume=True`` continues exactly where the last complete
checkpoint left off; the per-step RNG is ``fold_in(key, step)``, independent of resumption.
Metrics stay on the device between logging steps (every ``log_every`` updates, evaluations,
saves and the last update), where they are fetched together and the losses checked: a NaN or
inf loss stops the run with its step number, before anything is saved, and the last good
checkpoint is kept.

Example:
  >>> from flax import nnx
  >>> from sparse_jax.models import GPT2, GPT2Config
  >>> from sparse_jax.training.losses import cross_entropy_loss
  >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
  >>> def loss_fn(model, batch, rng):
  ...     return cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])
  >>> trainer = Trainer(model, loss_fn, TrainConfig(steps=2, batch_size=2, warmup_steps=1))
  >>> batches = iter([np.zeros((2, 9), np.int32)] * 2)
  >>> [round(float(m["loss"]), 2) for m in trainer.fit(batches)][:1]
  [3.91]
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparse_jax.training import checkpoint as ckpt_lib
from sparse_jax.training import sharding as sharding_lib
from sparse_jax.validation import check_int

__all__ = ["TrainConfig", "Trainer", "append_jsonl", "trainable_filter"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one training phase.

    Example:
      >>> config = TrainConfig(steps=100, batch_size=8, grad_accum=2)
      >>> config.batch_size // config.grad_accum  # rows of a micro-batch [4, ...]
      4
      >>> TrainConfig(batch_size=8, grad_accum=3)
      Traceback (most recent call last):
      ...
      ValueError: TrainConfig: `grad_accum`=3 must divide `batch_size`=8 (each update's ...
    """

    steps: int = 200  # optimizer updates
    batch_size: int = 8  # global batch (sequences) of one update
    learning_rate: float = 3e-3  # peak learning rate (after warm-up)
    warmup_steps: int = 20  # linear warm-up from 0, then cosine decay to 10% of the peak
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    clip_norm: float = 1.0  # global gradient-norm clipping (0: off)
    grad_accum: int = 1  # micro-batches per update: batch_size / grad_accum rows at a time
    trainable: str = ".*"  # regex on '/'-joined parameter paths that are trained
    fast_params: str = ""  # regex of parameters trained at `fast_lr_multiplier` x the rate
    fast_lr_multiplier: float = 10.0  # e.g. mask weights and gates, which start far from 0
    # Adam's ε for `fast_params`. Adam moves every parameter at about the full rate whatever
    # its gradient's size, so a tiny but steady gradient (a small price) and batch noise move
    # mask logits as fast as the KL does; an ε above the gradients' size (e.g. 1e-3 for
    # gradients of 1e-4) makes the step proportional to the gradient there (SGD-like).
    fast_eps: float = 1e-8
    seed: int = 0  # RNG seed of the step keys (Hard Concrete sampling, ...)

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum"):
            check_int(getattr(self, name), name, "TrainConfig")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"TrainConfig: `grad_accum`={self.grad_accum} must divide `batch_size`="
                f"{self.batch_size} (each update's batch is split into that many micro-batches)"
            )
        if not self.warmup_steps >= 0:
            raise ValueError(f"TrainConfig: `warmup_steps` must be >= 0; got {self.warmup_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"TrainConfig: `learning_rate` must be > 0; got {self.learning_rate}")
        for name in ("trainable", "fast_params"):
            try:
                re.compile(getattr(self, name))
            except re.error as err:
                raise ValueError(
                    f"TrainConfig: `{name}`={getattr(self, name)!r} is not a regex: {err}"
                ) from err
        if not self.fast_lr_multiplier > 0:
            raise ValueError(
                f"TrainConfig: `fast_lr_multiplier` must be > 0; got {self.fast_lr_multiplier}"
            )
        if not (self.fast_eps > 0 and math.isfinite(self.fast_eps)):
            raise ValueError(f"TrainConfig: `fast_eps` must be a finite ε > 0; got {self.fast_eps}")


def trainable_filter(pattern: str) -> Callable[[Any, Any], bool]:
    """An NNX filter: ``nnx.Param``s whose '/'-joined path matches ``pattern`` (``re.search``).

    Example:
      >>> f = trainable_filter("core/logits")
      >>> f(("h", 0, "attn", "core", "logits"), nnx.Param(np.zeros(3)))
      True
    """
    rx = re.compile(pattern)

    def keep(path, value) -> bool:
        return isinstance(value, nnx.Param) and bool(rx.search("/".join(map(str, path))))

    return keep


def _path_string(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW with warm-up + cosine decay (``fast_params`` at a multiple of the
    rate); gradients are accumulated in the step, not here."""
    total = max(config.steps, config.warmup_steps + 1)

    def adamw(peak, eps=1e-8):
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, peak, config.warmup_steps, total, end_value=0.1 * peak
        )
        return optax.adamw(schedule, eps=eps, weight_decay=config.weight_decay)

    if config.fast_params:
        rx = re.compile(config.fast_params)

        def labels(params):
            return jax.tree_util.tree_map_with_path(
                lambda path, _: "fast" if rx.search(_path_string(path)) else "base", params
            )

        fast = config.learning_rate * config.fast_lr_multiplier
        update = optax.multi_transform(
            {"base": adamw(config.learning_rate), "fast": adamw(fast, config.fast_eps)}, labels
        )
    else:
        update = adamw(config.learning_rate)
    parts = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm > 0 else []
    return optax.chain(*parts, update)


class Trainer:
    """Trains ``model`` in place with ``loss_fn`` (see the module docstring).

    Args:
      model: an NNX module; the parameters ``config.trainable`` names are trained.
      loss_fn: ``loss_fn(model, batch, rng, **frozen_models) -> (loss, metrics)`` where
        ``batch`` is the (sharded) int32 array of a step and metrics a dict of scalars. A
        ``loss_fn`` with a parameter named ``step`` also gets the index of the update it
        computes (traced int32 scalar, 0 for the first): for a penalty that follows a schedule.
      config: :class:`TrainConfig`.
      frozen_models: other modules the loss reads (e.g. ``teacher=...``); not trained.
      mesh: a ``("data", "model")`` mesh (default: all devices on ``data``).
      rules: parameter partition rules (:data:`sparse_jax.training.sharding.DEFAULT_RULES`).
      checkpointer: a :class:`~sparse_jax.training.checkpoint.Checkpointer` or None.

    Example (only the parameters ``trainable`` names move):
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> def loss_fn(model, batch, rng):  # batch: int32 [batch_size, 4]
      ...     return jnp.mean(model(batch.astype(jnp.float32)) ** 2), {}
      >>> config = TrainConfig(steps=2, batch_size=2, warmup_steps=0, trainable="bias")
      >>> trainer = Trainer(model, loss_fn, config)
      >>> kernel = np.array(model.kernel[...])
      >>> metrics = list(trainer.fit([np.ones((2, 4), np.int32)] * 2))  # a batch per update
      >>> trainer.step, sorted(metrics[0]), metrics[1]["loss"] < metrics[0]["loss"]
      (2, ['grad_norm', 'loss', 'tokens_per_s'], True)
      >>> bool((model.kernel[...] == kernel).all()), bool((model.bias[...] != 0).all())
      (True, True)
    """

    def __init__(
        self,
        model: nnx.Module,
        loss_fn: Callable[..., tuple[jax.Array, Mapping[str, jax.Array]]],
        config: TrainConfig,
        *,
        frozen_models: Mapping[str, nnx.Module] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        rules=sharding_lib.DEFAULT_RULES,
        checkpointer: ckpt_lib.Checkpointer | None = None,
    ):
        self.model, self.loss_fn, self.config = model, loss_fn, config
        self.mesh = sharding_lib.make_mesh() if mesh is None else mesh
        sharding_lib.check_batch(config.batch_size, self.mesh)
        self.checkpointer = checkpointer
        self.step = 0
        self.rng = jax.random.key(config.seed)
        keep = trainable_filter(config.trainable)
        self.graphdef, self.params, self.rest = nnx.split(model, keep, ...)
        if not jax.tree.leaves(self.params):
            raise ValueError(
                f"TrainConfig.trainable={config.trainable!r} matches no parameter of the model"
            )
        self.tx = _optimizer(config)
        frozen_models = dict(frozen_models or {})
        self._pass_step = "step" in inspect.signature(loss_fn).parameters
        if self._pass_step and "step" in frozen_models:
            raise ValueError(
                "Trainer: `frozen_models` may not hold a model named 'step': `loss_fn` takes "
                "`step`, the index of the update"
            )
        self.frozen_defs = {k: nnx.split(m) for k, m in frozen_models.items()}
        # Placement: parameters and moments by the rules, batches on "data".
        place = lambda tree: sharding_lib.param_shardings(tree, self.mesh, rules)[0]
        put = lambda tree: jax.device_put(tree, place(tree))
        # A copy: the step donates the parameter buffers, which must not be the model's own
        # (or another model's, for a student made from a teacher).
        self.params = jax.tree.map(lambda x: x.copy(), put(self.params))
        self.rest = put(self.rest)
        # On the shardings the step returns it with: a state from `tx.init` (its counts on no
        # mesh) would compile the first update twice, once for the first step, once for the rest.
        self.opt_state = put(self.tx.init(self.params))
        self.frozen_states = {k: put(state) for k, (_, state) in self.frozen_defs.items()}
        self._shardings = (
            place(self.params),
            place(self.rest),
            place(self.opt_state),
            {k: place(s) for k, s in self.frozen_states.items()},
        )
        self._batch_sharding = sharding_lib.batch_sharding(self.mesh)
        self._step_fn = self._compile_step()

    # ------------------------------------------------------------------------------------------

    def _model(self, params, rest):
        return nnx.merge(self.graphdef, params, rest)

    def _compile_step(self):
        graphdefs = {k: g for k, (g, _) in self.frozen_defs.items()}

        def step(params, rest, opt_state, frozen, batch, key, index):
            def objective(params, rows=batch):
                model = nnx.merge(self.graphdef, params, rest)
                others = {k: nnx.merge(graphdefs[k], s) for k, s in frozen.items()}
                if self._pass_step:
                    others["step"] = index
                loss, metrics = self.loss_fn(model, rows, key, **others)
                return loss, metrics

            grad_fn = jax.value_and_grad(objective, has_aux=True)
            k = self.config.grad_accum
            if k == 1:
                (loss, metrics), grads = grad_fn(params)
            else:  # the mean over k micro-batches of equal size: the gradient of the batch
                # Micro-batch i holds rows i, i + k, ...: the rows split on "data" stay there.
                micro = batch.reshape(batch.shape[0] // k, k, *batch.shape[1:]).swapaxes(0, 1)

                def add(total, rows):
                    return jax.tree.map(jnp.add, total, grad_fn(params, rows)), None

                shapes = jax.eval_shape(grad_fn, params, micro[0])
                zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
                total, _ = jax.lax.scan(add, zeros, micro)
                (loss, metrics), grads = jax.tree.map(lambda x: x / k, total)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
            return params, opt_state, metrics

        p, r, o, f = self._shardings
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.jit(
            step,
            in_shardings=(p, r, o, f, self._batch_sharding, replicated, replicated),
            out_shardings=(p, o, replicated),
            donate_argnums=(0, 2),
        )

    def _put_batch(self, batch) -> jax.Array:
        return sharding_lib.shard_batch(np.asarray(batch), self.mesh)

    # ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The checkpointed arrays: trained parameters, the rest of the model, optimizer."""
        return {"params": self.params, "rest": self.rest, "opt": self.opt_state}

    def save(self, data_state: Mapping[str, Any], metrics=None, *, force=False) -> bool:
        if self.checkpointer is None:
            return False
        return self.checkpointer.save(
            self.step,
            self.state(),
            data_state={**data_state, "step": self.step},
            rng=self.rng,
            metrics=metrics,
            force=force,
        )

    def restore(self, *, quarantine: bool = True) -> dict[str, Any] | None:
        """Restores the latest readable checkpoint onto the current mesh; returns its data
        state (None when there is no checkpoint). ``quarantine``: as
        :meth:`~sparse_jax.training.checkpoint.Checkpointer.restore` (False: a reader that
        leaves unreadable checkpoints where they are)."""
        if self.checkpointer is None or self.checkpointer.latest_step() is None:
            return None
        target = ckpt_lib.abstract_like(self.state())
        state, data_state, rng, step = self.checkpointer.restore(
            target=target, quarantine=quarantine
        )
        self.params, self.rest, self.opt_state = state["params"], state["rest"], state["opt"]
        self.rng, self.step = rng, step
        self.sync_model()
        return data_state

    def sync_model(self) -> nnx.Module:
        """Writes the trained state back into ``self.model`` (in place) and returns it."""
        nnx.update(self.model, self.params, self.rest)
        return self.model

    def fit(
        self,
        batches: Iterable[Any],
        *,
        data_state: Callable[[], Mapping[str, Any]] | None = None,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        evaluate: Callable[[nnx.Module], Mapping[str, float]] | None = None,
        eval_every: int = 0,
        log_every: int = 10,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[dict[str, float]]:
        """Runs updates ``self.step + 1 ... config.steps``; yields each step's metrics.

        The metrics stay on the device until a *logging step*: every ``log_every`` updates, an
        evaluation, a checkpoint save and the last update. There they are fetched together (one
        device sync, not one per update), their losses are checked (a NaN/inf stops the run
        before anything is evaluated or saved, so no checkpoint ever holds one), and each
        step's metrics are given to ``on_step`` and yielded, in order. So the metrics of every
        step still arrive, up to ``log_every - 1`` updates late; ``tokens_per_s`` is the rate
        over the updates fetched together.

        Args:
          batches: an iterable of ``[batch_size, ..., T]`` int arrays (one per update;
            ``tokens_per_s`` counts ``batch_size * T`` tokens of each).
          data_state: returns the data pipeline's position, saved with checkpoints.
          on_step: called with ``(step, metrics)`` for every update, at the next logging step
            (before that step's checkpoint is saved; the metrics are yielded after it).
          evaluate: ``evaluate(model) -> metrics``, run every ``eval_every`` updates and at the
            end; its metrics are yielded (prefixed ``eval_``) and rank checkpoints.
          eval_every: 0 = only at the end.
          log_every: fetch metrics (and check the loss) every this many updates at least;
            1 = after every update (a device sync per step).
          stop: asked after each update (e.g. a
            :class:`~sparse_jax.training.stopping.StopRequest`: a time limit, SIGTERM); when it
            returns True the update's metrics are fetched, a checkpoint of that step is saved
            (with a checkpointer; no evaluation) and the loop ends early: ``self.step <
            config.steps`` then. On several processes it is asked at the logging steps only,
            and the loop stops when it returned True on any of them, so that every process
            saves the same step.

        Raises:
          NonFiniteLossError: on a NaN/inf loss, naming its step, the steps checked together
            and the last good checkpoint.
        """
        eval_every = check_int(eval_every, "eval_every", "Trainer.fit", low=0)
        log_every = check_int(log_every, "log_every", "Trainer.fit")
        iterator = iter(batches)
        pending: list[tuple[int, Any]] = []  # (step, metrics on the device) not yet fetched
        tokens = 0
        start = time.perf_counter()
        while self.step < self.config.steps:
            batch = self._put_batch(next(iterator))
            key = jax.random.fold_in(self.rng, self.step)
            index = jnp.asarray(self.step, jnp.int32)
            self.params, self.opt_state, metrics = self._step_fn(
                self.params, self.rest, self.opt_state, self.frozen_states, batch, key, index
            )
            self.step += 1
            pending.append((self.step, metrics))
            tokens += batch.shape[0] * batch.shape[-1]  # [B, ..., T]: ids and any marks
            last = self.step == self.config.steps
            do_eval = evaluate is not None and (
                last or bool(eval_every and self.step % eval_every == 0)
            )
            due = self.checkpointer is not None and self.checkpointer.due(self.step, force=last)
            logging_step = last or do_eval or due or self.step % log_every == 0
            stopping = not last and _asked_to_stop(stop, logging_step)
            do_save = due or (stopping and self.checkpointer is not None)
            if not (logging_step or stopping):
                continue
            records = self._fetch_metrics(pending)  # raises on a NaN/inf loss
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            for _, record in records:
                record["tokens_per_s"] = rate
            pending, tokens, start = [], 0, time.perf_counter()
            eval_metrics = None
            if do_eval:
                eval_metrics = {
                    f"eval_{k}": float(v) for k, v in evaluate(self.sync_model()).items()
                }
                records[-1][1].update(eval_metrics)
            if on_step is not None:  # before the save: a log never lacks a saved step's lines
                for step, record in records:
                    on_step(step, record)
            if do_save:
                position = dict(data_state()) if data_state is not None else {}
                self.save(position, eval_metrics, force=True)
            yield from (record for _, record in records)
            if stopping:
                break
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.sync_model()

    def _fetch_metrics(self, pending: list[tuple[int, Any]]) -> list[tuple[int, dict[str, float]]]:
        """The metrics of ``pending`` steps as floats (one transfer); raises on a NaN/inf loss."""
        fetched = jax.device_get([metrics for _, metrics in pending])
        records = [
            (step, {k: float(v) for k, v in metrics.items()})
            for (step, _), metrics in zip(pending, fetched, strict=True)
        ]
        checked = (records[0][0], records[-1][0])
        for step, record in records:
            ckpt_lib.check_finite(record["loss"], step, self.checkpointer, checked=checked)
        return records


def _asked_to_stop(stop: Callable[[], bool] | None, logging_step: bool) -> bool:
    """``stop()`` after an update; on several processes only at logging steps (which every
    process reaches together), and True on all when it is True on any."""
    if stop is None:
        return False
    if jax.process_count() == 1:
        return bool(stop())
    return logging_step and sharding_lib.any_process(bool(stop()))


def append_jsonl(path, record: Mapping[str, Any]) -> None:
    """Appends one JSON line (floats, ints, strings, lists).

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     path = Path(tmp) / "metrics.jsonl"
      ...     append_jsonl(path, {"step": 1, "loss": np.float32(0.5)})  # numpy scalars: floats
      ...     append_jsonl(path, {"step": 2, "loss": 0.25})
      ...     print(path.read_text(), end="")
      {"step": 1, "loss": 0.5}
      {"step": 2, "loss": 0.25}
    """
    with open(path, "a") as f:
        f.write(json.dumps(record, default=float) + "\n")
