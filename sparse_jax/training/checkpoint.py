"""Checkpoints for training runs: save every N steps, keep the last k and the best, resume exactly.

A thin layer over :class:`orbax.checkpoint.CheckpointManager`. One checkpoint is one directory
``<directory>/<step>/`` with three Orbax items:

* ``state``: the training-state pytree (parameters, optimizer state, ...), written by
  ``ocp.args.StandardSave`` with each array's sharding; restored onto the *current* mesh by
  giving :meth:`Checkpointer.restore` a target of ``jax.ShapeDtypeStruct`` leaves that carry a
  ``.sharding``;
* ``extra``: a JSON document with the data position (``data_state``), the RNG key (its raw
  ``key_data`` and PRNG implementation name) and the step, so that a resumed run continues
  exactly where the interrupted one stopped;
* ``metrics``: the metrics given to :meth:`Checkpointer.save` (written by Orbax itself when the
  best checkpoint is tracked).

Which checkpoints are kept is Orbax's ``preservation_policy``: the union
(``AnyPreservationPolicy``) of ``LatestN(keep_last)`` and ``BestN(n=1)`` on ``best_metric``, so
the best checkpoint survives however old it is, while older non-best ones are deleted. When a
checkpoint is saved is Orbax's ``save_decision_policy``: every ``save_every`` steps
(``FixedIntervalPolicy``), on a preemption notice, and whenever ``force=True`` (the end of a
run).

Reliability:

* Orbax writes a step to ``<step>.orbax-checkpoint-tmp...`` and renames it on commit, so a
  write killed midway never looks like a checkpoint. Such leftovers are reported (logged) when
  a :class:`Checkpointer` opens the directory, and then removed by Orbax
  (``cleanup_tmp_directories``); other step-like entries that are not complete checkpoints
  are reported and left alone.
* :meth:`Checkpointer.restore` without a step takes the latest checkpoint; when that one cannot
  be read (truncated or missing files, corrupt metadata) it warns with the checkpoint's path and
  the error (:class:`CorruptCheckpointWarning`), moves it aside to ``<step>.corrupt`` (kept for
  inspection, never deleted) and uses the previous one. A checkpoint that reads fine but does
  not fit the given target is an error, not a reason to fall back.
* Nothing is overwritten: saving a step that already exists is skipped with a log message,
  and saving a step older than the latest checkpoint raises.
* :func:`check_finite` stops a run on a NaN/inf loss with the step and the last good checkpoint.
* :meth:`Checkpointer.restore` refuses a checkpoint whose model arrays hold NaN or inf
  (:class:`NonFiniteCheckpointError`, a ``ValueError`` naming the checkpoint's path, its step,
  the first such array and how many of its entries are non-finite) before anything trains on
  them or answers with them (such a checkpoint was damaged after it was written, or the
  update before it diverged from a finite loss, which the loss check cannot see). The
  optimizer state (the ``"opt"`` entry of :meth:`~sparse_jax.training.loop.Trainer.state`) is
  not checked: optax states may hold ``inf`` by design (``reduce_on_plateau``'s best value and
  the backtracking line search's last value start at ``inf``).

Example:

>>> import tempfile
>>> import jax, jax.numpy as jnp
>>> from sparse_jax.training.checkpoint import Checkpointer
>>> state = {"w": jnp.arange(4.0), "b": jnp.zeros(2)}
>>> with tempfile.TemporaryDirectory() as tmp, Checkpointer(tmp, save_every=2) as ckpt:
...     ckpt.save(1, state, data_state={"epoch": 0, "index": 8}, rng=jax.random.key(0))
...     ckpt.save(2, state, data_state={"epoch": 0, "index": 16}, rng=jax.random.key(0))
...     state2, data_state, rng, step = ckpt.restore()
...     print(step, data_state, bool((state2["w"] == state["w"]).all()))
False
True
2 {'epoch': 0, 'index': 16} True
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocp_managers

from sparse_jax.validation import check_bool, check_int

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "Checkpointer",
    "CorruptCheckpointWarning",
    "NoReadableCheckpointError",
    "NonFiniteCheckpointError",
    "NonFiniteLossError",
    "abstract_like",
    "check_finite",
]

logger = logging.getLogger(__name__)

_STATE = "state"
_EXTRA = "extra"
_FORMAT = 1
_TMP_MARKER = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a checkpoint that does not fit what is asked of it."""


class NoReadableCheckpointError(CheckpointError):
    """Every checkpoint of a directory is unreadable: ``steps`` lists them (newest first) and
    ``details`` says why each failed. Nothing was moved; :meth:`Checkpointer.quarantine` moves
    them aside (a run then starts again from step 0)."""

    def __init__(self, message: str, steps: Sequence[int], details: str):
        super().__init__(message)
        self.steps = list(steps)
        self.details = details


class NonFiniteCheckpointError(CheckpointError, ValueError):
    """A checkpoint reads fine but its model arrays hold NaN or infinite values.

    Attributes:
      path: the checkpoint's directory (``<directory>/<step>``).
      step: its step.
      name: the '/'-joined path of the first array (in the state's order) holding some, such as
        ``params/decoder/0/self_attn/q/kernel``.
      count: how many entries of that array are NaN or infinite; ``size``: how many it has.
      others: the paths of the other arrays holding some.
    """

    def __init__(
        self, path: Any, step: int, name: str, count: int, size: int, others: Sequence[str] = ()
    ):
        self.path, self.step, self.name = path, step, name
        self.count, self.size, self.others = count, size, list(others)
        more = ""
        if self.others:
            listed = ", ".join(self.others[:3]) + (", ..." if len(self.others) > 3 else "")
            more = f"; {len(self.others)} more arrays hold some ({listed})"
        super().__init__(
            f"checkpoint {path} (step {step}) holds non-finite values: {name} has {count} NaN "
            f"or infinite entries of {size}{more}. Nothing can be trained from it or answered "
            "with it (it was damaged after it was written, or the update before it diverged): "
            "move it aside (rename its folder) to use the one before it, or train again"
        )


class CheckpointSaveError(CheckpointError, OSError):
    """A checkpoint could not be written (a full or read-only disk, a folder made unwritable):
    the checkpoints before it are untouched, so the run resumes from the newest of them once the
    folder can be written again. Also an ``OSError`` with the failure's ``errno``, ``strerror``
    and ``filename``.

    Attributes:
      path: the checkpoint's directory (``<directory>/<step>``); ``step``: its step.
      kept: the step of the newest checkpoint before it, or None.
    """

    def __init__(self, path: Any, step: int, kept: int | None, cause: BaseException):
        self.path, self.step, self.kept = path, step, kept
        self.errno = getattr(cause, "errno", None)
        self.strerror = getattr(cause, "strerror", None)
        self.filename = getattr(cause, "filename", None)
        before = (
            f"the checkpoint of step {kept} is kept: resume from it"
            if kept is not None
            else "no checkpoint was written before it: start again"
        )
        super().__init__(
            f"could not write checkpoint {path} (step {step}): {self.strerror or cause}"
            f"{f' ({self.filename})' if self.filename else ''}; {before} once its folder can be "
            "written"
        )

    def __str__(self) -> str:
        return str(self.args[0])


def _brief(error: BaseException, limit: int = 300) -> str:
    """The first line of ``error``'s message, at most ``limit`` characters: what a reader of a
    one-line refusal needs (TensorStore's errors go on with the whole JSON spec of the array)."""
    text = str(error).strip().split("\n", 1)[0]
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint could not be read and was skipped (its path is in the message)."""


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; the run stops and keeps its last good checkpoint.

    Attributes:
      step: the (first) step whose loss was not finite.
      loss: the loss value (``nan``, ``inf`` or ``-inf``).
      last_good_step: the latest complete checkpoint's step, or ``None`` if there is none.
      directory: the checkpoint directory, or ``None`` without a checkpointer.
      checked: ``(first, last)``: the steps whose losses were fetched and checked together
        (the trainer checks at logging steps and before every save), or ``None``.
    """

    def __init__(
        self,
        step: int,
        loss: float,
        last_good_step: int | None,
        directory: str | None,
        checked: tuple[int, int] | None = None,
    ):
        self.step = step
        self.loss = loss
        self.last_good_step = last_good_step
        self.directory = directory
        self.checked = checked
        if last_good_step is not None:
            kept = (
                f"last good checkpoint: step {last_good_step} in {directory} "
                "(resume from it with --resume)"
            )
        elif directory is not None:
            kept = f"no checkpoint has been saved yet in {directory}"
        else:
            kept = "no checkpointer was given"
        found = f"loss is {loss} at step {step}"
        if checked is not None and checked[0] != checked[1]:
            first, last = checked
            found += f" (the first non-finite loss of steps {first}-{last}, checked together)"
        super().__init__(f"{found}; training stopped; {kept}")


def check_finite(
    loss: Any,
    step: int,
    checkpointer: Checkpointer | None = None,
    *,
    checked: tuple[int, int] | None = None,
) -> float:
    """Returns ``loss`` as a Python float; raises :class:`NonFiniteLossError` if it is NaN/inf.

    Pulls the value to the host (a device sync). Before raising, waits for any asynchronous save
    to finish so that the checkpoint named in the message is complete. ``checked`` is the range
    of steps whose losses were checked together (named in the message).

    >>> check_finite(0.5, 3)
    0.5
    >>> check_finite(float("nan"), 7)
    Traceback (most recent call last):
    ...
    sparse_jax.training.checkpoint.NonFiniteLossError: loss is nan at step 7; training stopped; \
no checkpointer was given
    """
    value = float(np.asarray(jax.device_get(loss)))
    if math.isfinite(value):
        return value
    last_good = None
    directory = None
    if checkpointer is not None:
        checkpointer.wait()
        last_good = checkpointer.latest_step()
        directory = str(checkpointer.directory)
    raise NonFiniteLossError(int(step), value, last_good, directory, checked)


def abstract_like(tree: Any) -> Any:
    """A restore target for ``tree``: ``jax.ShapeDtypeStruct`` leaves keeping each array's sharding.

    ``jax.Array`` leaves become ``ShapeDtypeStruct(shape, dtype, sharding=x.sharding)``;
    ``ShapeDtypeStruct`` leaves and NumPy arrays are kept as they are (a ``ShapeDtypeStruct``
    without a sharding, like a NumPy array, is restored as a NumPy array). Use it on a freshly
    initialised, already sharded state (or on ``jax.eval_shape`` output with shardings attached)
    to restore a checkpoint onto the current mesh.

    Example:
      >>> import jax.numpy as jnp
      >>> tree = {"w": jnp.zeros((2, 3)), "n": np.zeros(2, np.int32)}  # w [2, 3], n [2]
      >>> target = abstract_like(tree)
      >>> target["w"].shape, target["w"].dtype, target["w"].sharding == tree["w"].sharding
      ((2, 3), dtype('float32'), True)
      >>> target["n"] is tree["n"]  # NumPy arrays are kept as they are
      True
    """

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


def _leaf_name(path: Sequence[Any]) -> str:
    """``params/encoder/0/kernel``: a leaf's tree path, '/'-joined (the ``value`` that an
    ``nnx.Variable`` flattens to is dropped)."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/").removesuffix("/value")


@jax.jit
def _count_nonfinite(x: Any) -> jax.Array:
    """The number of NaN/inf entries of ``x`` (one fused pass, on the array's devices; compiled
    once per shape, which costs less than one program over a whole state)."""
    return jnp.count_nonzero(~jnp.isfinite(x))


def _is_key_array(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _rng_to_json(rng: Any) -> dict[str, Any] | None:
    if rng is None:
        return None
    if _is_key_array(rng):
        impl = str(jax.random.key_impl(rng))
        data = jax.random.key_data(rng)
    else:
        impl = None
        data = rng
    data = np.asarray(jax.device_get(data))
    if data.dtype != np.uint32:
        raise TypeError(
            "rng must be a JAX key array (jax.random.key) or a raw uint32 key "
            f"(jax.random.PRNGKey); got an array of dtype {data.dtype}"
        )
    return {"impl": impl, "shape": list(data.shape), "key_data": data.ravel().tolist()}


def _rng_from_json(doc: Mapping[str, Any] | None) -> Any:
    if doc is None:
        return None
    data = np.asarray(doc["key_data"], dtype=np.uint32).reshape(doc["shape"])
    if doc["impl"] is None:
        return jax.numpy.asarray(data)
    return jax.random.wrap_key_data(data, impl=doc["impl"])


def _json_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> number or None; got {type(metrics)}")
    out = {}
    for name, value in metrics.items():
        try:
            out[str(name)] = float(np.asarray(jax.device_get(value)))
        except (TypeError, ValueError) as e:
            raise TypeError(f"metrics[{name!r}] must be a scalar number; got {value!r}") from e
    return out


def _is_local(path: epath.Path) -> bool:
    return "://" not in os.fspath(path)


class Checkpointer:
    """Saves and restores training checkpoints under ``directory`` (see the module docstring).

    Args:
      directory: where the step directories live (created if missing). A local path or any
        path Orbax/etils understands (``gs://...``).
      save_every: a checkpoint is written when ``step % save_every == 0`` (or ``force=True``).
      keep_last: how many of the most recent checkpoints are kept.
      keep_best: also keep the checkpoint with the best ``best_metric``, however old.
      best_metric: the key of the ``metrics`` dict given to :meth:`save` that ranks checkpoints;
        checkpoints without it (or with a NaN value) rank last.
      best_mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"``.
      async_save: write in a background thread (Orbax async checkpointing); :meth:`save` returns
        once the arrays are copied off the device. Call :meth:`wait` or :meth:`close` before
        reading the files or exiting.

    Example (keep the last 2 of 3 checkpoints, restore the latest onto a target):
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> state = {"w": jnp.arange(6.0).reshape(2, 3)}  # any pytree of arrays
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     with Checkpointer(tmp, save_every=1, keep_last=2, keep_best=False) as ckpt:
      ...         for step in (1, 2, 3):
      ...             _ = ckpt.save(step, state, data_state={"index": 4 * step}, rng=None)
      ...         steps = ckpt.all_steps()
      ...         restored, data_state, rng, step = ckpt.restore(target=abstract_like(state))
      >>> steps, step, data_state, restored["w"].shape
      ([2, 3], 3, {'index': 12}, (2, 3))
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_every: int,
        keep_last: int = 3,
        keep_best: bool = True,
        best_metric: str = "eval_loss",
        best_mode: str = "min",
        async_save: bool = False,
    ):
        save_every = check_int(save_every, "save_every", "Checkpointer")
        keep_last = check_int(keep_last, "keep_last", "Checkpointer")
        keep_best = check_bool(keep_best, "keep_best", "Checkpointer")
        async_save = check_bool(async_save, "async_save", "Checkpointer")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max'; got {best_mode!r}")
        if not isinstance(best_metric, str) or not best_metric:
            raise ValueError(f"best_metric must be a non-empty string; got {best_metric!r}")
        path = epath.Path(directory)
        if _is_local(path):
            path = epath.Path(os.path.abspath(os.fspath(path)))
        self._directory = path
        self.save_every = save_every
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save
        self._closed = False

        self._report_incomplete_writes()

        preserve: list[Any] = [ocp_managers.LatestN(n=keep_last)]
        best_fn = None
        if keep_best:
            best_fn = self._metric_value
            preserve.append(
                ocp_managers.BestN(
                    get_metric_fn=best_fn,
                    reverse=best_mode == "min",
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp_managers.AnySavePolicy(
                [
                    ocp_managers.FixedIntervalPolicy(save_every),
                    ocp_managers.PreemptionCheckpointingPolicy(),
                ]
            ),
            preservation_policy=ocp_managers.AnyPreservationPolicy(preserve),
            # best_fn makes Orbax write each step's metrics (and gives best_step()); which
            # steps are deleted is decided by preservation_policy alone.
            best_fn=best_fn,
            best_mode=best_mode,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
            create=True,
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(_STATE, ocp.args.StandardSave)
        registry.add(_STATE, ocp.args.StandardRestore)
        registry.add(_EXTRA, ocp.args.JsonSave)
        registry.add(_EXTRA, ocp.args.JsonRestore)
        self._manager = ocp.CheckpointManager(
            self._directory, options=options, handler_registry=registry
        )
        self._report_unlisted_steps()

    # ------------------------------------------------------------------ queries

    @property
    def directory(self) -> epath.Path:
        """The checkpoint directory (absolute for local paths)."""
        return self._directory

    def step_path(self, step: int) -> epath.Path:
        """The directory of the checkpoint for ``step`` (whether or not it exists)."""
        return self._directory / str(int(step))

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending (uncommitted writes are not listed)."""
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step with the best ``best_metric`` (the latest step if ``keep_best`` is False)."""
        return self._manager.best_step()

    def metrics(self, step: int) -> dict[str, float] | None:
        """The metrics saved with ``step`` (``None`` if none were given or tracked)."""
        return self._manager.metrics(step)

    def _metric_value(self, metrics: Mapping[str, Any] | None) -> float:
        worst = math.inf if self.best_mode == "min" else -math.inf
        if not metrics or self.best_metric not in metrics:
            return worst
        value = float(metrics[self.best_metric])
        return value if math.isfinite(value) else worst

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_state: Mapping[str, Any],
        rng: Any,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves a checkpoint for ``step`` if it is due; returns whether one was written.

        Args:
          step: the number of optimizer updates done so far (the step a resumed run starts
            after).
          state: the pytree of arrays to save (``nnx.state(...)``, an optax state, a dict...).
            Arrays are saved with their sharding, each host writing its own shards.
          data_state: where the data pipeline stands (epoch, index, shuffle seed...): a
            JSON-serialisable dict, given back by :meth:`restore` (tuples come back as lists).
          rng: the training RNG: a key array from ``jax.random.key`` (saved as its
            ``key_data`` and implementation name) or a raw ``uint32`` key, or ``None``.
          metrics: numbers to store with the checkpoint; ``metrics[best_metric]`` ranks it for
            ``keep_best``.
          force: save even if ``step`` is not a multiple of ``save_every`` (the end of a run).

        Raises:
          ValueError: ``step`` is older than the latest checkpoint (a run started afresh in a
            directory that already holds a later one: resume instead, or use a new directory).
          TypeError: ``data_state``, ``rng`` or ``metrics`` cannot be stored.
        """
        self._check_open()
        step = check_int(step, "step", "Checkpointer.save", low=0)
        latest = self.latest_step()
        if latest is not None and step < latest:
            raise ValueError(
                f"step {step} is older than the latest checkpoint (step {latest}) in "
                f"{self._directory}; refusing to mix runs: resume from it, or use a new directory"
            )
        if latest == step:
            if force:
                logger.info(
                    "checkpoint for step %d already exists in %s; not overwriting it",
                    step,
                    self._directory,
                )
            return False
        if not force and not self._manager.should_save(step):
            return False
        if not isinstance(data_state, Mapping):
            raise TypeError(f"data_state must be a dict; got {type(data_state)}")
        extra = {
            "format": _FORMAT,
            "step": step,
            "data_state": dict(data_state),
            "rng": _rng_to_json(rng),
        }
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"data_state must be JSON-serialisable: {e}; got {data_state!r}") from e
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{_STATE: ocp.args.StandardSave(state), _EXTRA: ocp.args.JsonSave(extra)}
                ),
                metrics=_json_metrics(metrics),
                force=True,
            )
        except OSError as failed:
            raise CheckpointSaveError(self.step_path(step), step, latest, failed) from failed
        if saved:
            logger.info("saved checkpoint %s", self.step_path(step))
        return bool(saved)

    def due(self, step: int, *, force: bool = False) -> bool:
        """Whether :meth:`save` for ``step`` would write a checkpoint now.

        Asks Orbax's save policy (every ``save_every`` steps, or a preemption notice) once: after
        a True answer, call ``save(step, ..., force=True)``, which does not ask again. This lets
        a caller prepare what it saves (fetch and check its metrics) only when a save is due. An
        existing ``step`` is not due; an older one is (:meth:`save` then raises).
        """
        self._check_open()
        step = check_int(step, "step", "Checkpointer.due", low=0)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return step < latest
        return bool(force or self._manager.should_save(step))

    def wait(self) -> None:
        """Blocks until an asynchronous save (and the deletions it triggers) has finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for outstanding saves and releases Orbax's resources. Idempotent."""
        if not self._closed:
            self._manager.close()
            self._closed = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer for {self._directory} is closed")

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        quarantine: bool = True,
        unchecked: Sequence[str] = ("opt",),
    ) -> tuple[Any, dict[str, Any], Any, int]:
        """Restores a checkpoint; returns ``(state, data_state, rng, step)``.

        Args:
          step: the step to restore; ``None`` takes the latest *readable* checkpoint: an
            unreadable one is reported (:class:`CorruptCheckpointWarning`, naming its path and
            the error), moved aside to ``<step>.corrupt`` and the previous one is tried.
          target: the pytree to restore into, with ``jax.ShapeDtypeStruct`` (or ``jax.Array``)
            leaves whose ``.sharding`` says where each array goes on the current mesh (see
            :func:`abstract_like`). ``None`` restores with the shardings saved in the
            checkpoint, which needs the same devices as the run that wrote it.
          quarantine: move unreadable checkpoints aside (a run that will write their steps
            again); False leaves the folder as it is (a reader, such as a run folder loaded for
            inference, which may be read-only or someone else's).
          unchecked: the top-level entries of the state whose values may be NaN or infinite
            by design (default: ``"opt"``, the optimizer state of
            :meth:`~sparse_jax.training.loop.Trainer.state`); every other floating-point array
            must be finite.

        Raises:
          FileNotFoundError: there is no complete checkpoint (or none for ``step``).
          CheckpointError: the requested step cannot be read, or the latest one reads fine but
            does not fit ``target``.
          NoReadableCheckpointError: (a ``CheckpointError``) no checkpoint at all can be read;
            they are left in place (:meth:`quarantine` moves them aside).
          NonFiniteCheckpointError: (a ``CheckpointError`` and a ``ValueError``) the restored
            checkpoint holds NaN or infinite values outside ``unchecked`` (naming its path, step
            and the first such array); nothing is moved, and no earlier checkpoint is taken
            instead (as for an unreadable one): the message says what to do.
        """
        quarantine = check_bool(quarantine, "quarantine", "Checkpointer.restore")
        keys = unchecked if isinstance(unchecked, Sequence) else None
        if keys is None or isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise TypeError(
                "Checkpointer.restore: `unchecked` must be a sequence of the state's top-level "
                f"keys (str), such as ('opt',); got {unchecked!r}"
            )
        self._check_open()
        self.wait()
        steps = self.all_steps()
        if step is not None:
            if int(step) not in steps:
                raise FileNotFoundError(
                    f"no complete checkpoint for step {step} in {self._directory}; "
                    f"available steps: {steps}"
                )
            try:
                result = self._restore_step(int(step), target)
            except Exception as e:
                raise CheckpointError(
                    f"cannot restore checkpoint {self.step_path(step)}: {type(e).__name__}: {e}"
                ) from e
            self._check_values(result[0], int(step), unchecked)
            return result
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self._directory}")
        unreadable: list[tuple[int, str]] = []
        for candidate in reversed(steps):
            try:
                result = self._restore_step(candidate, target)
            except Exception as e:
                ok, message = self.verify(candidate)
                if ok:
                    raise CheckpointError(
                        f"checkpoint {self.step_path(candidate)} is readable but cannot be "
                        f"restored onto the given target: {type(e).__name__}: {e}"
                    ) from e
                warnings.warn(
                    f"checkpoint {self.step_path(candidate)} cannot be read and is skipped: "
                    f"{message}",
                    CorruptCheckpointWarning,
                    stacklevel=2,
                )
                unreadable.append((candidate, message))
                continue
            self._check_values(result[0], candidate, unchecked)
            if quarantine:
                self._quarantine([s for s, _ in unreadable])
            return result
        details = "; ".join(f"step {s}: {m}" for s, m in unreadable)
        raise NoReadableCheckpointError(
            f"no readable checkpoint in {self._directory}: {details}",
            [s for s, _ in unreadable],
            details,
        )

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict[str, Any], Any, int]:
        state_args = (
            ocp.args.StandardRestore(abstract_like(target))
            if target is not None
            else ocp.args.StandardRestore()
        )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(**{_STATE: state_args, _EXTRA: ocp.args.JsonRestore()}),
        )
        extra = restored[_EXTRA]
        self._check_extra(extra, step)
        return restored[_STATE], dict(extra["data_state"]), _rng_from_json(extra["rng"]), step

    def _check_values(self, state: Any, step: int, unchecked: Sequence[str]) -> None:
        """Raises :class:`NonFiniteCheckpointError` when a floating-point array of ``state``
        outside its top-level entries ``unchecked`` holds NaN or inf."""
        named = [
            (_leaf_name(path), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)
            if not (path and _leaf_name(path[:1]) in unchecked)
            and jax.dtypes.issubdtype(getattr(leaf, "dtype", np.int32), np.inexact)
        ]
        if not named:
            return
        counts = jax.device_get([_count_nonfinite(leaf) for _, leaf in named])
        bad = [(name, int(n), x.size) for (name, x), n in zip(named, counts, strict=True) if n]
        if bad:
            (name, count, size), others = bad[0], [b[0] for b in bad[1:]]
            raise NonFiniteCheckpointError(self.step_path(step), step, name, count, size, others)

    def _check_extra(self, extra: Any, step: int) -> None:
        if not isinstance(extra, Mapping) or extra.get("format") != _FORMAT:
            raise CheckpointError(
                f"{self.step_path(step)}/{_EXTRA}: not a sparse_jax checkpoint record "
                f"(format {_FORMAT} expected); got {extra!r}"
            )
        if extra.get("step") != step or "data_state" not in extra or "rng" not in extra:
            raise CheckpointError(
                f"{self.step_path(step)}/{_EXTRA}: inconsistent record for step {step}: {extra!r}"
            )

    def verify(self, step: int) -> tuple[bool, str]:
        """Reads checkpoint ``step`` completely (arrays to host memory); returns ``(ok, message)``.

        The message names the checkpoint's path; on failure it carries the error. This reads
        every array, so it costs as much host memory as the state.
        """
        path = self.step_path(step)
        if int(step) not in self.all_steps():
            state = "exists but was never committed" if path.exists() else "does not exist"
            return False, f"{path}: not a complete checkpoint ({state})"
        try:
            meta = self._manager.item_metadata(int(step))[_STATE]
            tree = getattr(meta, "tree", meta)
            target = jax.tree.map(_host_target, tree)
            restored = self._manager.restore(
                int(step),
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardRestore(target),
                        _EXTRA: ocp.args.JsonRestore(),
                    }
                ),
            )
            self._check_extra(restored[_EXTRA], int(step))
            leaves = jax.tree.leaves(restored[_STATE])
        except Exception as e:  # any failure to read means the checkpoint is unusable
            return False, f"{path}: {type(e).__name__}: {_brief(e)}"
        nbytes = sum(int(getattr(x, "nbytes", 0)) for x in leaves)
        return True, f"{path}: ok ({len(leaves)} leaves, {nbytes} bytes)"

    def quarantine(self, steps: Sequence[int]) -> list[epath.Path]:
        """Moves the checkpoints of ``steps`` aside to ``<step>.corrupt`` (``.corrupt-1``, ... if
        taken), never deleting them, so that their steps can be written again; returns where
        each went. For checkpoints that :meth:`restore` reported unreadable
        (:class:`NoReadableCheckpointError` lists them)."""
        self._check_open()
        return self._quarantine([check_int(s, "steps[i]", "quarantine", low=0) for s in steps])

    def _quarantine(self, steps: Sequence[int]) -> list[epath.Path]:
        """Moves unreadable checkpoints aside (never deletes them) so their steps can be redone."""
        moved: list[epath.Path] = []
        if not steps:
            return moved
        for step in steps:
            src = self.step_path(step)
            dst = src.parent / f"{src.name}.corrupt"
            n = 1
            while dst.exists():
                dst = src.parent / f"{src.name}.corrupt-{n}"
                n += 1
            if jax.process_index() == 0:
                src.rename(dst)
            moved.append(dst)
            warnings.warn(
                f"moved unreadable checkpoint {src} to {dst} (kept for inspection, not deleted); "
                f"step {step} will be written again",
                CorruptCheckpointWarning,
                stacklevel=3,
            )
        ocp.multihost.sync_global_processes("sparse_jax_checkpoint_quarantine")
        self._manager.reload()
        return moved

    def _report_unlisted_steps(self) -> None:
        if not self._directory.exists():
            return
        listed = set(self.all_steps())
        unlisted = sorted(
            p.name
            for p in self._directory.iterdir()
            if p.name.isdigit() and int(p.name) not in listed
        )
        if unlisted:
            logger.warning(
                "ignoring entries of %s that look like steps but are not complete checkpoints "
                "(not committed, or not directories): %s",
                self._directory,
                ", ".join(unlisted),
            )

    def _report_incomplete_writes(self) -> None:
        if not self._directory.exists():
            return
        leftovers = sorted(p.name for p in self._directory.iterdir() if _TMP_MARKER in p.name)
        if leftovers:
            logger.warning(
                "found incomplete checkpoint writes in %s (a save was interrupted): %s; "
                "they are not checkpoints and will be removed",
                self._directory,
                ", ".join(leftovers),
            )


def _host_target(meta: Any) -> Any:
    """A restore target that reads a saved array into a NumPy array (no device placement)."""
    shape = getattr(meta, "shape", None)
    dtype = getattr(meta, "dtype", None)
    if shape is not None and dtype is not None:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)
    return meta
