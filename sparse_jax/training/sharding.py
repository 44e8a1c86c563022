"""Sharding a model and its batches over a ``("data", "model")`` device mesh.

The trainer runs one ``jax.jit`` program whose ``in_shardings`` / ``out_shardings`` are the
:class:`~jax.sharding.NamedSharding`s made here (the successor of ``pjit``; a ``with mesh:`` block
no longer gives ``jit`` a mesh):

* **data parallelism** over the ``"data"`` axis: every ``[batch, ...]`` array is split on its
  first axis (:func:`batch_sharding`, :func:`shard_batch`); XLA averages the gradients across it;
* **tensor (model) parallelism** over the ``"model"`` axis, Megatron-style (Shoeybi et al., 2019):
  in each block the first projection is split on its *output* axis (column-parallel: ``c_attn``,
  q/k/v, and the FFN's ``c_fc``, with their biases) and the second on its *input* axis
  (row-parallel: ``c_proj``), so each device computes a slice of the heads / FFN units and one
  all-reduce per sublayer restores the full activations. Everything else (embeddings,
  LayerNorms, ``c_proj``'s bias, gates, mask weights) is replicated. See :data:`DEFAULT_RULES`.

Parameters are matched by their ``/``-joined path in ``nnx.state(model)`` (``h/0/attn/c_attn/
kernel``, ``wte/embedding``, ...) with regular expressions (``re.search``, first matching rule
wins), so the same rules also place an optimizer's moments, whose paths end with the parameter's.
A rule that does not fit a parameter (an axis size that does not divide the dimension, or a spec
with more axes than the array) falls back to replication for that parameter and says so in the
returned notes (and a logging warning), never silently.

Meshes use ``AxisType.Auto`` axes: the model code carries no sharding annotations, and XLA's
partitioner propagates the shardings of the inputs through it.

Example (one device: a ``(1, 1)`` mesh, everything replicated):
  >>> import jax, jax.numpy as jnp
  >>> mesh = make_mesh()
  >>> dict(mesh.shape) == {"data": jax.device_count(), "model": 1}
  True
  >>> spec_for("h/0/attn/c_attn/kernel")
  P(None, 'model')
  >>> spec_for("h/0/ln_1/scale")
  P()
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from sparse_jax.validation import check_int

__all__ = [
    "AXES",
    "DEFAULT_RULES",
    "any_process",
    "batch_sharding",
    "broadcast_from_primary",
    "check_batch",
    "distributed_environment",
    "host_copy",
    "is_primary",
    "local_model",
    "make_mesh",
    "maybe_initialize_distributed",
    "param_shardings",
    "process_data_slice",
    "shard_batch",
    "shard_model",
    "spec_for",
    "sync_processes",
]

logger = logging.getLogger(__name__)

AXES = ("data", "model")  # mesh axis names: data parallelism, tensor parallelism

P = PartitionSpec

# (regex on the '/'-joined parameter path, PartitionSpec); the first rule that matches wins and
# an unmatched parameter is replicated. Kernels are [in, out] (Hugging Face's Conv1D layout).
DEFAULT_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    # column-parallel: split the output axis (heads' q/k/v, FFN units) and the bias with it
    (r"(^|/)c_attn/kernel$", P(None, "model")),
    (r"(^|/)c_attn/bias$", P("model")),
    (r"(^|/)c_fc/kernel$", P(None, "model")),
    (r"(^|/)c_fc/bias$", P("model")),
    # row-parallel: split the input axis; the output (and c_proj/bias) is full after a psum
    (r"(^|/)c_proj/kernel$", P("model", None)),
)

_FORCE_DEVICES_HINT = (
    "(to try a mesh on CPU, force 8 host devices: set "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported)"
)


def make_mesh(data: int | None = None, model: int = 1, *, devices: Sequence[Any] | None = None):
    """A ``(data, model)`` mesh with axes :data:`AXES` over ``devices`` (default: all).

    Args:
      data: size of the data-parallel axis; None: ``len(devices) // model``.
      model: size of the tensor-parallel axis (1: pure data parallelism).
      devices: the devices to use (default ``jax.devices()``, every process's).

    Raises:
      ValueError: ``data * model`` differs from the number of devices (the message says how
        many there are and how to force 8 CPU devices), or a size is < 1.
      TypeError: a size is not an int.

    Example:
      >>> mesh = make_mesh(model=1)
      >>> mesh.axis_names
      ('data', 'model')
    """
    caller = "make_mesh"
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise ValueError(f"{caller}: `devices` is empty")
    model = check_int(model, "model", caller)
    data = None if data is None else check_int(data, "data", caller)
    if data is None:
        if n % model:
            raise ValueError(
                f"{caller}: `model`={model} does not divide the {n} available device(s) "
                f"{_FORCE_DEVICES_HINT}"
            )
        data = n // model
    if data * model != n:
        raise ValueError(
            f"{caller}: a mesh of data={data} x model={model} = {data * model} devices does not "
            f"match the {n} available device(s) ({devices[0].platform}); choose sizes whose "
            f"product is {n} {_FORCE_DEVICES_HINT}"
        )
    return jax.make_mesh(
        (data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices
    )


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_string(path) -> str:
    names = [_key_name(k) for k in path]
    # an nnx.Variable flattens to its raw value under the attribute key "value"
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names = names[:-1]
    return "/".join(names)


def spec_for(path: str, rules: Sequence[tuple[str, PartitionSpec]] = DEFAULT_RULES):
    """The PartitionSpec of the first rule whose regex ``re.search``-es ``path`` (else ``P()``).

    Example:
      >>> spec_for("h/3/mlp/c_proj/kernel")
      P('model', None)
    """
    for pattern, spec in rules:
        if re.search(pattern, path):
            return spec
    return PartitionSpec()


def _check_rules(rules, mesh: Mesh):
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ValueError(
            f"`rules` must be a sequence of (regex, PartitionSpec) pairs; got {rules!r:.200}"
        )
    for rule in rules:
        if not (
            isinstance(rule, (tuple, list))
            and len(rule) == 2
            and isinstance(rule[0], str)
            and isinstance(rule[1], PartitionSpec)
        ):
            raise ValueError(f"`rules`: each rule must be (regex, PartitionSpec); got {rule!r}")
        re.compile(rule[0])
        for entry in rule[1]:
            names = entry if isinstance(entry, tuple) else (entry,)
            for axis in names:
                if axis is not None and axis not in mesh.axis_names:
                    raise ValueError(
                        f"`rules`: rule {rule[0]!r} uses mesh axis {axis!r}; the mesh has "
                        f"{mesh.axis_names}"
                    )


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> str | None:
    """Why ``spec`` cannot shard an array of ``shape`` on ``mesh`` (None when it can)."""
    if len(spec) > len(shape):
        return f"spec {spec} has {len(spec)} axes but the array has shape {shape}"
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        size = math.prod(mesh.shape[name] for name in names)
        if shape[dim] % size:
            return (
                f"dimension {dim} (size {shape[dim]}) is not divisible by mesh axis "
                f"{entry!r} ({size})"
            )
    return None


def param_shardings(
    model_or_state, mesh: Mesh, rules: Sequence[tuple[str, PartitionSpec]] = DEFAULT_RULES
):
    """NamedShardings for every array of a model's state, from path rules.

    Args:
      model_or_state: an ``nnx.Module`` (its full ``nnx.state``), an ``nnx.State`` or any pytree
        of arrays / ``jax.ShapeDtypeStruct`` (e.g. optimizer state).
      mesh: a mesh with the axes the rules name (:func:`make_mesh`).
      rules: ``(regex, PartitionSpec)`` pairs (:data:`DEFAULT_RULES`); first match wins,
        unmatched arrays are replicated.

    Returns:
      ``(shardings, notes)``: a pytree with the structure of ``nnx.state(model)`` (each
      ``nnx.Variable`` holding a ``NamedSharding`` in place of its value), usable as
      ``jax.device_put(state, shardings)`` and as ``jit``'s ``in_shardings``/``out_shardings``;
      and a list of messages, one per array whose rule did not fit and which was replicated
      instead (each is also logged as a warning).

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.models import GPT2, GPT2Config
      >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
      >>> shardings, notes = param_shardings(model, make_mesh())
      >>> shardings["h"][0]["attn"]["c_attn"]["kernel"].get_value().spec
      P(None, 'model')
      >>> notes
      []
    """
    _check_rules(rules, mesh)
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    notes: list[str] = []
    out = []
    for path, leaf in leaves:
        name = _path_string(path)
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        spec = spec_for(name, rules)
        problem = _fit(spec, shape, mesh)
        if problem is not None:
            note = f"{name}: {problem}; replicated instead of {spec}"
            notes.append(note)
            logger.warning("param_shardings: %s", note)
            spec = PartitionSpec()
        out.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(treedef, out), notes


def shard_model(
    model: nnx.Module, mesh: Mesh, rules: Sequence[tuple[str, PartitionSpec]] = DEFAULT_RULES
):
    """Places ``model``'s state on ``mesh`` by ``rules``, in place (``jax.device_put`` then
    ``nnx.update``); returns ``(shardings, notes)`` as :func:`param_shardings` does.

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.models import GPT2, GPT2Config
      >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
      >>> shardings, notes = shard_model(model, make_mesh())
      >>> model.h[0].attn.c_attn.kernel[...].sharding.spec
      P(None, 'model')
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"shard_model: `model` must be an nnx.Module; got {type(model).__name__}")
    shardings, notes = param_shardings(model, mesh, rules)
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    return shardings, notes


def _data_size(mesh: Mesh, caller: str) -> int:
    if "data" not in mesh.axis_names:
        raise ValueError(f"{caller}: `mesh` has no 'data' axis; its axes are {mesh.axis_names}")
    return mesh.shape["data"]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """``NamedSharding(mesh, P("data"))``: ``[batch, ...]`` arrays split on their first axis
    over the data axis and replicated over the model axis.

    Example:
      >>> sharding = batch_sharding(make_mesh())
      >>> sharding.spec
      P('data',)
      >>> sharding.shard_shape((2 * jax.device_count(), 3))  # each device: [2, 3] of [batch, 3]
      (2, 3)
    """
    _data_size(mesh, "batch_sharding")
    return NamedSharding(mesh, PartitionSpec("data"))


def check_batch(batch_size: int, mesh: Mesh) -> None:
    """Raises ValueError unless the (global) ``batch_size`` splits evenly over the data axis.

    Example:
      >>> check_batch(2 * jax.device_count(), make_mesh())  # fine: returns None
    """
    data = _data_size(mesh, "check_batch")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise ValueError(f"check_batch: `batch_size` must be an int; got {batch_size!r}")
    if batch_size < 1 or batch_size % data:
        raise ValueError(
            f"batch_size {batch_size} is not divisible by the data axis ({data}): pass a "
            f"--batch-size that is a positive multiple of {data}, or a mesh with a smaller data "
            "axis"
        )


def process_data_slice(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
    """``(index, count)``: this process reads slice ``index`` of ``count`` equal, contiguous
    row slices of every global batch (``(0, 1)`` on a single process).

    The slices follow the mesh: the process's devices hold a contiguous range of positions on
    the data axis, and processes whose devices share data positions (a model axis that spans
    processes) read the same rows. With 4 processes of one device on a ``(data=2, model=2)``
    mesh, for example, processes 0 and 1 read the first half and 2 and 3 the second.

    Raises:
      ValueError: the process's devices hold a non-contiguous or uneven part of the data axis
        (a mesh laid out across processes in a way no batch slicing can follow).

    Example:
      >>> process_data_slice(make_mesh())
      (0, 1)
    """
    process = jax.process_index() if process_index is None else process_index
    data_dim = mesh.axis_names.index("data")
    devices = np.asarray(mesh.devices)
    size = devices.shape[data_dim]
    owners = np.vectorize(lambda d: d.process_index, otypes=[int])(devices)
    mine = sorted({int(i) for i in np.nonzero(owners == process)[data_dim]})
    if not mine:
        raise ValueError(f"process_data_slice: process {process} has no device on the mesh")
    per = len(mine)
    if mine != list(range(mine[0], mine[0] + per)) or size % per or mine[0] % per:
        raise ValueError(
            f"process_data_slice: process {process} holds data positions {mine} of {size}; "
            "each process must hold a contiguous, equal share of the data axis (lay the mesh "
            "out with the devices of one process next to each other)"
        )
    return mine[0] // per, size // per


def shard_batch(batch, mesh: Mesh):
    """Puts a pytree of ``[batch, ...]`` arrays on ``mesh``, split over the data axis.

    On a single process ``batch`` is the global batch (``jax.device_put``). When several
    processes run (``jax.process_count() > 1``) each passes *its own* slice of the batch, the
    rows :func:`process_data_slice` names, and the global arrays are assembled with
    ``jax.make_array_from_process_local_data`` (global batch = local batch x the number of
    slices, which must divide over the data axis).

    Example:
      >>> import numpy as np
      >>> x = shard_batch({"ids": np.zeros((jax.device_count(), 5), np.int32)}, make_mesh())
      >>> x["ids"].sharding.spec
      P('data',)
    """
    sharding = batch_sharding(mesh)
    processes = jax.process_count()
    slices = process_data_slice(mesh)[1] if processes > 1 else 1

    def put(leaf):
        if np.ndim(leaf) < 1:
            raise ValueError(
                f"shard_batch: every array of `batch` must be [batch, ...]; got shape "
                f"{np.shape(leaf)}"
            )
        shape = np.shape(leaf)
        check_batch(int(shape[0]) * slices, mesh)
        if processes > 1:
            global_shape = (shape[0] * slices, *shape[1:])
            return jax.make_array_from_process_local_data(sharding, np.asarray(leaf), global_shape)
        return jax.device_put(leaf, sharding)

    return jax.tree.map(put, batch)


def _int_env(env, name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"maybe_initialize_distributed: environment variable {name}={value!r} is not an int"
        ) from None


def distributed_environment(environ=None) -> str | None:
    """Which multi-process launcher the environment shows, or None for a single process.

    Checked, in order (the variables jax's own cluster auto-detection reads, see
    ``jax._src.clusters``), each only when it describes more than one process:

    * explicit: ``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` > 1 (and
      ``JAX_PROCESS_ID``);
    * SLURM: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_PROCID``, ``SLURM_LOCALID`` and
      ``SLURM_NTASKS`` > 1 (an ``srun`` step with several tasks);
    * Open MPI: ``OMPI_MCA_orte_hnp_uri`` with ``OMPI_COMM_WORLD_SIZE`` > 1 (``mpirun``);
    * Cloud TPU multi-host: ``MEGASCALE_COORDINATOR_ADDRESS`` (multislice), or
      ``TPU_WORKER_HOSTNAMES`` / ``TPU_PROCESS_ADDRESSES`` listing more than one host (GKE).

    Example:
      >>> distributed_environment({}) is None
      True
      >>> distributed_environment({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1",
      ...                          "OMPI_COMM_WORLD_SIZE": "4"})
      'Open MPI'
    """
    env = os.environ if environ is None else environ
    num = _int_env(env, "JAX_NUM_PROCESSES")
    if env.get("JAX_COORDINATOR_ADDRESS") and num is not None and num > 1:
        return "JAX_COORDINATOR_ADDRESS"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and (_int_env(env, "SLURM_NTASKS") or 1) > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in env and (_int_env(env, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "Open MPI"
    if env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "Cloud TPU"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return "Cloud TPU"
    return None


def maybe_initialize_distributed(*, force: bool = False, environ=None) -> bool:
    """Calls ``jax.distributed.initialize()`` when this is one process of a multi-process run.

    Must run before anything else touches jax's devices. Does nothing (returns False) on a single
    host, when :func:`distributed_environment` finds no multi-process launcher, or when jax's
    distributed system is already initialized. With the explicit variables,
    ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID`` are passed to ``initialize``; for SLURM, Open MPI and Cloud TPU, jax
    detects its own parameters.

    A Cloud TPU VM pod slice created with ``gcloud`` describes its hosts only through the metadata
    server, which is not queried here: pass ``force=True`` there (jax then auto-detects it).

    Returns:
      True when ``jax.distributed.initialize`` was called.

    Example:
      >>> maybe_initialize_distributed(environ={})  # no launcher: one process, nothing to do
      False
      >>> maybe_initialize_distributed(environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
      ...                                       "JAX_NUM_PROCESSES": "2"})  # no JAX_PROCESS_ID
      Traceback (most recent call last):
      ...
      ValueError: maybe_initialize_distributed: JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES ...
    """
    env = os.environ if environ is None else environ
    kind = distributed_environment(env)
    if not force and kind is None:
        return False
    if jax.distributed.is_initialized():
        return False
    if kind == "JAX_COORDINATOR_ADDRESS":
        process_id = _int_env(env, "JAX_PROCESS_ID")
        if process_id is None:
            raise ValueError(
                "maybe_initialize_distributed: JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES are "
                "set but JAX_PROCESS_ID is not; set it to this process's index"
            )
        logger.info("initializing jax.distributed from JAX_* variables (process %d)", process_id)
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=_int_env(env, "JAX_NUM_PROCESSES"),
            process_id=process_id,
        )
    else:
        logger.info("initializing jax.distributed (%s)", kind or "forced")
        jax.distributed.initialize()
    return True


# ----------------------------------------------------------------------------------------------
# Several processes (multi-host): one writes files, all run the same programs.


def is_primary() -> bool:
    """True on the process that writes shared files (process 0; always True on one process).

    Example:
      >>> is_primary()  # a single process is the primary
      True
    """
    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Waits until every process has reached the point called ``name`` (nothing on one
    process): e.g. the others wait while the primary writes a file they then read.

    Example:
      >>> jax.process_count()  # a single process ...
      1
      >>> sync_processes("run_dir_ready")  # ... has no one to wait for: returns None at once
    """
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def broadcast_from_primary(value):
    """Process 0's ``value`` (a pytree of numbers or arrays) on every process, so that the
    processes agree on something each computed alone (a timestamp, a file's existence).

    Example:
      >>> int(broadcast_from_primary(np.int32(7)))
      7
    """
    if jax.process_count() == 1:
        return value
    return multihost_utils.broadcast_one_to_all(value)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is True on any process (every process must call it at the same point:
    a collective), so that the processes agree on a decision each made alone (stop now?).

    Example:
      >>> any_process(False), any_process(True)  # one process: its own flag
      (False, True)
    """
    if jax.process_count() == 1:
        return bool(flag)
    flags = multihost_utils.process_allgather(np.asarray(bool(flag), np.int32))
    return bool(np.asarray(flags).any())


def host_copy(tree):
    """NumPy copies of the arrays in ``tree``, whole on every process: an array split over
    several processes' devices is gathered (``process_allgather``), a replicated one is read
    from this process's copy. Other leaves are returned as they are.

    Example:
      >>> host_copy({"w": jnp.ones(2)})["w"].tolist()
      [1.0, 1.0]
    """

    def get(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)


def local_model(model: nnx.Module) -> nnx.Module:
    """``model`` with its state on this process's default device (a new module), for work
    that each process does alone: evaluation, measurement, generation, saving. On a single
    process the model is returned as it is (its arrays are addressable already).

    Example:
      >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))  # kernel [2, 3]
      >>> local = local_model(model)
      >>> local is model, local.kernel[...].shape  # one process: the model itself
      (True, (2, 3))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"local_model: `model` must be an nnx.Module; got {type(model).__name__}")
    if jax.process_count() == 1:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, host_copy(state)))
