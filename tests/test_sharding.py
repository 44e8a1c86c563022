"""Meshes, partition rules, batch sharding and multi-process detection.

The multi-device test runs in a subprocess with 8 forced CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax is imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sparse_jax.models import GPT2, GPT2Config
from sparse_jax.training.sharding import (
    DEFAULT_RULES,
    batch_sharding,
    check_batch,
    distributed_environment,
    make_mesh,
    maybe_initialize_distributed,
    param_shardings,
    shard_batch,
    shard_model,
)
from tests import script_env

ROOT = Path(__file__).resolve().parents[1]


def _tiny(seed=0):
    return GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(seed))


def test_single_device_mesh_and_rules():
    n = jax.device_count()
    mesh = make_mesh()
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": n, "model": 1}
    model = _tiny()
    shardings, notes = param_shardings(model, mesh)
    assert notes == []
    specs = {
        "/".join(map(str, path)): var.get_value().spec for path, var in nnx.to_flat_state(shardings)
    }
    assert specs["h/0/attn/c_attn/kernel"] == P(None, "model")
    assert specs["h/1/attn/c_attn/bias"] == P("model")
    assert specs["h/0/mlp/c_fc/kernel"] == P(None, "model")
    assert specs["h/0/mlp/c_proj/kernel"] == P("model", None)
    assert specs["h/0/attn/c_proj/kernel"] == P("model", None)
    for name in ("h/0/attn/c_proj/bias", "h/0/ln_1/scale", "wte/embedding", "ln_f/bias"):
        assert specs[name] == P(), name
    # with a model axis of size 1 every parameter is in fact replicated
    assert all(s.is_fully_replicated for s in jax.tree.leaves(shardings))
    # the structure matches nnx.state(model): usable with device_put and jit
    state = jax.device_put(nnx.state(model), shardings)
    assert jax.tree.structure(state) == jax.tree.structure(nnx.state(model))


def test_shard_model_in_place_and_forward_unchanged():
    model = _tiny()
    ids = jnp.arange(2 * 7, dtype=jnp.int32).reshape(2, 7) % 101
    before = model(ids)
    _, notes = shard_model(model, make_mesh())
    assert notes == []
    kernel = model.h[0].attn.c_attn.kernel[...]
    assert kernel.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(model(ids), before)


def test_rules_fall_back_to_replicated_with_a_note():
    mesh = make_mesh()
    model = _tiny()
    # a spec with more axes than the array cannot apply
    rules = ((r"ln_f/scale$", P(None, "model")), *DEFAULT_RULES)
    shardings, notes = param_shardings(model, mesh, rules)
    assert len(notes) == 1 and "ln_f/scale" in notes[0] and "replicated" in notes[0]
    assert shardings["ln_f"]["scale"].get_value().spec == P()
    with pytest.raises(ValueError, match="mesh axis 'tensor'"):
        param_shardings(model, mesh, ((r"kernel$", P(None, "tensor")),))
    with pytest.raises(ValueError, match="`rules`"):
        param_shardings(model, mesh, ((r"kernel$", (None, "model")),))


def test_param_shardings_on_plain_pytrees_and_optimizer_state():
    mesh = make_mesh()
    tree = {"opt": {"mu": {"h": [{"attn": {"c_attn": {"kernel": np.zeros((4, 6))}}}]}}}
    shardings, notes = param_shardings(tree, mesh)
    assert shardings["opt"]["mu"]["h"][0]["attn"]["c_attn"]["kernel"].spec == P(None, "model")
    assert notes == []
    abstract = {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    assert param_shardings(abstract, mesh)[0]["x"].spec == P()


def test_batch_sharding_and_shard_batch():
    mesh = make_mesh()
    n = jax.device_count()
    assert batch_sharding(mesh).spec == P("data")
    batch = {"ids": np.arange(2 * n * 3).reshape(2 * n, 3), "mask": np.ones((2 * n, 3), bool)}
    out = shard_batch(batch, mesh)
    assert out["ids"].sharding.spec == P("data")
    np.testing.assert_array_equal(out["ids"], batch["ids"])
    with pytest.raises(ValueError, match=r"batch_size 0 .*--batch-size"):
        check_batch(0, mesh)
    with pytest.raises(ValueError, match="shard_batch"):
        shard_batch({"x": np.float32(1.0)}, mesh)


def test_make_mesh_errors():
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"{n} available device.*xla_force_host_platform"):
        make_mesh(data=n + 1)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=8"):
        make_mesh(model=n + 1)
    with pytest.raises(ValueError, match="`model`"):
        make_mesh(model=0)
    with pytest.raises(TypeError, match=r"make_mesh: `data` must be an int >= 1; got .*1\.5"):
        make_mesh(data=1.5)


def test_distributed_environment_detection():
    assert distributed_environment({}) is None
    assert (
        distributed_environment({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1"})
        is None
    )
    explicit = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert distributed_environment(explicit) == "JAX_COORDINATOR_ADDRESS"
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
    }
    assert distributed_environment(slurm) == "SLURM"
    assert distributed_environment({**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed_environment({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert distributed_environment({"TPU_WORKER_HOSTNAMES": "w-0,w-1"}) == "Cloud TPU"


def test_maybe_initialize_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    assert maybe_initialize_distributed(environ={}) is False and calls == []
    env = {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert maybe_initialize_distributed(environ=env) is True
    assert calls[-1] == dict(coordinator_address="h:1234", num_processes=4, process_id=3)
    assert maybe_initialize_distributed(
        environ={"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}
    )
    assert calls[-1] == {}  # jax auto-detects the launcher's parameters
    assert maybe_initialize_distributed(environ={}, force=True) and calls[-1] == {}
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        maybe_initialize_distributed(
            environ={k: v for k, v in env.items() if k != "JAX_PROCESS_ID"}
        )
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    n = len(calls)
    assert maybe_initialize_distributed(environ=env) is False and len(calls) == n


_MULTI_DEVICE = textwrap.dedent(
    """
    import json

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from sparse_jax.models import GPT2, GPT2Config
    from sparse_jax.training import sharding as sh
    from sparse_jax.training.losses import cross_entropy_loss, distillation_loss

    out = {"devices": jax.device_count()}
    mesh = sh.make_mesh(4, 2)
    out["mesh"] = dict(mesh.shape)
    model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    graphdef, reference_state = nnx.split(model)
    reference_state = jax.device_get(reference_state)

    shardings, notes = sh.shard_model(model, mesh)
    out["notes"] = notes
    kernel = model.h[0].attn.c_attn.kernel[...]
    out["c_attn_spec"] = str(kernel.sharding.spec)
    out["c_attn_shard"] = list(kernel.addressable_shards[0].data.shape)
    out["c_proj_shard"] = list(model.h[0].mlp.c_proj.kernel[...].addressable_shards[0].data.shape)
    out["ln_replicated"] = model.h[0].ln_1.scale[...].sharding.is_fully_replicated
    out["wte_replicated"] = model.wte.embedding[...].sharding.is_fully_replicated

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 101, (8, 12)).astype(np.int32)
    teacher = (2 * rng.standard_normal((8, 12, 101))).astype(np.float32)
    mask = rng.random((8, 12)) < 0.8

    def loss_fn(state, ids, teacher, mask):
        logits = nnx.merge(graphdef, state)(ids)
        kl, _ = distillation_loss(logits, teacher, mask=mask, temperature=2.0)
        ce, _ = cross_entropy_loss(logits[:, :-1], ids[:, 1:], mask=mask[:, 1:])
        return kl + 0.5 * ce

    step = jax.value_and_grad(loss_fn)
    data = sh.batch_sharding(mesh)
    sharded_step = jax.jit(
        step,
        in_shardings=(shardings, data, data, data),
        out_shardings=(NamedSharding(mesh, P()), shardings),
    )
    batch = sh.shard_batch({"ids": ids, "teacher": teacher, "mask": mask}, mesh)
    out["batch_shard"] = list(batch["ids"].addressable_shards[0].data.shape)
    loss, grads = sharded_step(nnx.state(model), batch["ids"], batch["teacher"], batch["mask"])
    out["grad_c_attn_spec"] = str(grads["h"][0]["attn"]["c_attn"]["kernel"][...].sharding.spec)

    one = jax.devices()[0]
    ref_loss, ref_grads = jax.jit(step)(*jax.device_put((reference_state, ids, teacher, mask), one))
    out["loss"], out["ref_loss"] = float(loss), float(ref_loss)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         jax.device_get(grads), jax.device_get(ref_grads))
    out["max_grad_diff"] = max(jax.tree.leaves(diffs))
    ref_leaves = jax.tree.leaves(jax.device_get(ref_grads))
    out["max_grad"] = max(float(np.max(np.abs(g))) for g in ref_leaves)

    # the same rules place optimizer moments (paths end with the parameter's)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    opt_shardings, _ = sh.param_shardings(nnx.state(opt), mesh)
    flat = nnx.to_flat_state(opt_shardings)
    specs = {"/".join(map(str, p)): v.get_value().spec for p, v in flat}
    out["opt_paths"] = sorted(k for k in specs if k.endswith("c_attn/kernel"))
    out["opt_c_attn_specs"] = sorted({str(specs[k]) for k in out["opt_paths"]})

    # a rule that does not divide: vocab 101 over model=2 falls back, with a note
    rules = ((r"wte/embedding$", P("model", None)), *sh.DEFAULT_RULES)
    fallback, fallback_notes = sh.param_shardings(model, mesh, rules)
    out["fallback_notes"] = fallback_notes
    out["fallback_spec"] = str(fallback["wte"]["embedding"].get_value().spec)

    errors = {}
    for name, fn in {
        "check_batch": lambda: sh.check_batch(6, mesh),
        "shard_batch": lambda: sh.shard_batch({"ids": ids[:6]}, mesh),
        "mesh": lambda: sh.make_mesh(3, 2),
        "mesh_model": lambda: sh.make_mesh(model=3),
    }.items():
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_eight_device_mesh_matches_one_device(tmp_path):
    script = tmp_path / "multi_device.py"
    script.write_text(_MULTI_DEVICE)
    env = script_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["devices"] == 8 and out["mesh"] == {"data": 4, "model": 2}
    assert out["notes"] == []
    # c_attn [48, 144] split on its output axis over model=2; c_proj [192, 48] on its input axis
    assert out["c_attn_spec"] == "P(None, 'model')" and out["c_attn_shard"] == [48, 72]
    assert out["c_proj_shard"] == [96, 48]
    assert out["ln_replicated"] and out["wte_replicated"]
    assert out["batch_shard"] == [2, 12]
    assert out["grad_c_attn_spec"] == out["c_attn_spec"]
    assert abs(out["loss"] - out["ref_loss"]) <= 1e-5, out
    assert out["max_grad"] > 1e-3 and out["max_grad_diff"] <= 1e-5, out
    assert out["opt_c_attn_specs"] == ["P(None, 'model')"]
    assert out["fallback_spec"] == "P()"
    assert len(out["fallback_notes"]) == 1 and "wte/embedding" in out["fallback_notes"][0]
    assert "(size 101)" in out["fallback_notes"][0]
    errors = out["errors"]
    assert "batch_size 6 is not divisible by the data axis (4)" in errors["check_batch"]
    assert "--batch-size" in errors["check_batch"]
    assert "batch_size 6" in errors["shard_batch"]
    assert "8 available device" in errors["mesh"]
    assert "xla_force_host_platform_device_count=8" in errors["mesh"]
    assert "8 available device" in errors["mesh_model"]


def _fake_mesh(owners):
    """A stand-in mesh whose devices belong to the processes in ``owners`` [data, model]."""
    import types

    owners = np.asarray(owners)
    devices = np.empty(owners.shape, object)
    for idx in np.ndindex(owners.shape):
        devices[idx] = types.SimpleNamespace(process_index=int(owners[idx]))
    return types.SimpleNamespace(axis_names=("data", "model"), devices=devices)


@pytest.mark.parametrize(
    "owners, expected",
    [
        ([[0, 1], [2, 3]], [(0, 2), (0, 2), (1, 2), (1, 2)]),  # model axis across processes
        ([[0, 0], [1, 1]], [(0, 2), (1, 2)]),  # two devices per process, model within
        ([[0], [0], [1], [1]], [(0, 2), (1, 2)]),  # pure data parallelism, 2 devices each
        ([[0], [1], [2], [3]], [(0, 4), (1, 4), (2, 4), (3, 4)]),
        ([[0, 1]], [(0, 1), (0, 1)]),  # one data position: every process reads everything
    ],
)
def test_process_data_slice_follows_the_mesh(owners, expected):
    from sparse_jax.training.sharding import process_data_slice

    mesh = _fake_mesh(owners)
    assert [process_data_slice(mesh, p) for p in range(len(expected))] == expected


def test_process_data_slice_refuses_interleaved_processes():
    from sparse_jax.training.sharding import process_data_slice

    with pytest.raises(ValueError, match=r"process 0 holds data positions \[0, 2\] of 4"):
        process_data_slice(_fake_mesh([[0], [1], [0], [1]]), 0)
    with pytest.raises(ValueError, match="process 5 has no device"):
        process_data_slice(_fake_mesh([[0], [1]]), 5)


def test_multi_process_helpers_on_one_process():
    from flax import nnx

    from sparse_jax.models import GPT2, GPT2Config
    from sparse_jax.training import sharding as sh

    assert sh.is_primary()
    sh.sync_processes("nothing to wait for")
    assert sh.broadcast_from_primary({"a": 3})["a"] == 3
    model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    assert sh.local_model(model) is model
    copied = sh.host_copy(nnx.state(model))
    assert isinstance(jax.tree.leaves(copied)[0], np.ndarray)
    with pytest.raises(TypeError, match=r"local_model: `model` must be an nnx\.Module"):
        sh.local_model({"not": "a module"})
