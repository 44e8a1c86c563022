"""Checkpoints: save schedule, retention (last k + best), exact resume, sharded restore,
corrupt and half-written checkpoints, and the NaN guard (sparse_jax.training.checkpoint)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax.training import checkpoint as checkpoint_module
from sparse_jax.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointWarning,
    NonFiniteLossError,
    abstract_like,
    check_finite,
)
from tests import script_env

ROOT = Path(__file__).resolve().parents[1]

# When Orbax fails to read a (deliberately damaged) checkpoint, a tensorstore callback can arrive
# after Orbax's private event loop has closed; Python reports it as unraisable, in whichever test
# is running when it arrives. It is harmless noise.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. None:pytest.PytestUnraisableExceptionWarning"
)


def _state(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "params": {
            "w": jax.random.normal(k1, (4, 3), jnp.float32),
            "b": jax.random.normal(k2, (3,), jnp.bfloat16),
        },
        "opt": {"count": jnp.asarray(seed, jnp.int32), "mu": jnp.full((4, 3), 0.5 + seed)},
    }


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _save(ckpt, step, *, metrics=None, force=False, seed=None):
    return ckpt.save(
        step,
        _state(step if seed is None else seed),
        data_state={"index": step},
        rng=jax.random.key(step),
        metrics=metrics,
        force=force,
    )


def test_saves_every_n_steps_and_a_forced_final_step(tmp_path):
    with Checkpointer(tmp_path, save_every=3, keep_last=10, keep_best=False) as ckpt:
        written = [step for step in range(1, 11) if _save(ckpt, step)]
        assert written == [3, 6, 9]
        assert _save(ckpt, 10, force=True)
        assert ckpt.all_steps() == [3, 6, 9, 10]
        assert ckpt.latest_step() == 10
        # The end-of-run save of a step that is already saved is skipped, not overwritten.
        before = (tmp_path / "10").stat().st_mtime_ns
        assert not _save(ckpt, 10, force=True)
        assert (tmp_path / "10").stat().st_mtime_ns == before
        # Going back in steps means two runs are being mixed: refuse.
        with pytest.raises(ValueError, match="older than the latest checkpoint"):
            _save(ckpt, 7, force=True)


def test_keeps_the_last_k_and_the_best_even_when_it_is_old(tmp_path):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: float("nan"), 6: 2.5}
    with Checkpointer(tmp_path, save_every=1, keep_last=2) as ckpt:
        for step, loss in losses.items():
            assert _save(ckpt, step, metrics={"eval_loss": loss, "train_loss": 9.0})
        assert ckpt.all_steps() == [2, 5, 6]
        assert ckpt.best_step() == 2
        assert ckpt.metrics(2)["eval_loss"] == 1.0
        # A checkpoint without metrics counts for recency only.
        assert _save(ckpt, 7)
        assert ckpt.all_steps() == [2, 6, 7]
    # The metrics are on disk: a new run in the same directory still keeps the old best.
    with Checkpointer(tmp_path, save_every=1, keep_last=2) as ckpt:
        assert _save(ckpt, 8, metrics={"eval_loss": 3.0})
        assert ckpt.all_steps() == [2, 7, 8]
        assert _save(ckpt, 9, metrics={"eval_loss": 0.5})
        assert ckpt.all_steps() == [8, 9]
    with Checkpointer(tmp_path / "max", save_every=1, keep_last=1, best_mode="max") as ckpt:
        for step, acc in {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.1}.items():
            _save(ckpt, step, metrics={"eval_loss": acc})
        assert ckpt.all_steps() == [2, 4]


def test_round_trip_is_exact(tmp_path):
    state = _state(3)
    data_state = {"epoch": 2, "index": 123, "seed": 7, "order": [3, 1, 2], "name": "wikitext"}
    rng = jax.random.split(jax.random.key(42))[1]
    raw_rng = jax.random.PRNGKey(5)
    with Checkpointer(tmp_path, save_every=10) as ckpt:
        assert ckpt.save(10, state, data_state=data_state, rng=rng)
        assert ckpt.save(20, state, data_state=data_state, rng=raw_rng)
    with Checkpointer(tmp_path, save_every=10) as ckpt:
        got, got_data, got_rng, step = ckpt.restore(10, target=abstract_like(state))
        assert step == 10
        _assert_trees_equal(got, state)
        assert got_data == data_state
        assert jax.dtypes.issubdtype(got_rng.dtype, jax.dtypes.prng_key)
        assert jax.random.key_impl(got_rng) == jax.random.key_impl(rng)
        np.testing.assert_array_equal(jax.random.key_data(got_rng), jax.random.key_data(rng))
        np.testing.assert_array_equal(
            jax.random.normal(got_rng, (5,)), jax.random.normal(rng, (5,))
        )
        # Without a target the saved shardings are used; a raw uint32 key stays raw.
        got, _, got_raw, step = ckpt.restore()
        assert step == 20
        _assert_trees_equal(got, state)
        assert got_raw.dtype == jnp.uint32
        np.testing.assert_array_equal(got_raw, raw_rng)
        ok, message = ckpt.verify(20)
        assert ok, message
        assert str(tmp_path / "20") in message


def test_async_save_round_trip(tmp_path):
    state = _state(1)
    with Checkpointer(tmp_path, save_every=2, async_save=True) as ckpt:
        assert ckpt.save(2, state, data_state={"index": 2}, rng=jax.random.key(0))
        ckpt.wait()
        assert ckpt.all_steps() == [2]
        got, data_state, _, step = ckpt.restore(target=abstract_like(state))
    _assert_trees_equal(got, state)
    assert (data_state, step) == ({"index": 2}, 2)


def test_restore_lands_on_the_current_mesh(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    row = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    state = {"w": jnp.arange(8.0).reshape(4, 2), "b": jnp.ones(3, jnp.bfloat16)}
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(1, state, data_state={}, rng=jax.random.key(0))
        target = {
            "w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=row),
            "b": jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=replicated),
        }
        got, _, _, _ = ckpt.restore(target=target)
    assert isinstance(got["w"], jax.Array)
    assert got["w"].sharding == row
    assert got["b"].sharding == replicated
    _assert_trees_equal(got, state)


def test_nnx_state_round_trip(tmp_path):
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    other = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(1, nnx.state(model), data_state={}, rng=None)
        restored, _, rng, _ = ckpt.restore(target=abstract_like(nnx.state(other)))
    assert rng is None
    nnx.update(other, restored)
    x = jnp.ones((1, 3))
    np.testing.assert_array_equal(other(x), model(x))


def _truncate_arrays(step_dir: Path) -> None:
    files = [
        p for p in (step_dir / "state").rglob("*") if p.is_file() and "_METADATA" not in p.name
    ]
    data = [p for p in files if p.stat().st_size > 0]
    assert data, sorted(str(p) for p in files)
    for p in data:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)


def _delete_extra(step_dir: Path) -> None:
    files = [p for p in (step_dir / "extra").rglob("*") if p.is_file()]
    assert files
    for p in files:
        p.unlink()


def _garble_json(step_dir: Path) -> None:
    for p in (step_dir / "extra").rglob("*"):
        if p.is_file():
            p.write_text("{not json")


@pytest.mark.parametrize("damage", [_truncate_arrays, _delete_extra, _garble_json])
def test_corrupt_latest_is_reported_and_the_previous_one_is_used(tmp_path, damage):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        for step in (1, 2, 3):
            _save(ckpt, step)
    damage(tmp_path / "3")
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ok, message = ckpt.verify(3)
        assert not ok and str(tmp_path / "3") in message
        with pytest.warns(CorruptCheckpointWarning, match=str(tmp_path / "3")) as record:
            state, data_state, _, step = ckpt.restore(target=abstract_like(_state(2)))
        assert step == 2
        _assert_trees_equal(state, _state(2))
        assert data_state == {"index": 2}
        # The unreadable checkpoint is moved aside and kept, and step 3 can be saved again.
        assert any("3.corrupt" in str(w.message) for w in record)
        assert (tmp_path / "3.corrupt").is_dir()
        assert ckpt.all_steps() == [1, 2]
        assert _save(ckpt, 3)
        assert ckpt.restore()[3] == 3


def test_step_like_entries_that_are_not_checkpoints_are_reported(tmp_path, caplog):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        _save(ckpt, 1)
    (tmp_path / "2").write_text("not a checkpoint")
    with caplog.at_level(logging.WARNING, logger=checkpoint_module.__name__):
        with Checkpointer(tmp_path, save_every=1) as ckpt:
            assert ckpt.all_steps() == [1]
    assert any("not complete checkpoints" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "2").read_text() == "not a checkpoint"


def test_explicit_step_is_not_silently_replaced(tmp_path):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        _save(ckpt, 1)
        _save(ckpt, 2)
        _truncate_arrays(tmp_path / "2")
        with pytest.raises(CheckpointError, match=str(tmp_path / "2")):
            ckpt.restore(2, target=abstract_like(_state(2)))
        with pytest.raises(FileNotFoundError, match="step 5"):
            ckpt.restore(5)
        assert ckpt.all_steps() == [1, 2]


def test_target_mismatch_is_an_error_not_a_fallback(tmp_path):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        _save(ckpt, 1)
        _save(ckpt, 2)
        wrong = jax.tree.map(lambda x: jnp.zeros((7, *x.shape), x.dtype), _state(0))
        with pytest.raises(CheckpointError, match="readable but cannot be restored"):
            ckpt.restore(target=abstract_like(wrong))
        assert ckpt.all_steps() == [1, 2]


def test_all_unreadable_raises_with_every_name(tmp_path):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        _save(ckpt, 1)
        _save(ckpt, 2)
    _delete_extra(tmp_path / "1")
    _delete_extra(tmp_path / "2")
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        with pytest.warns(CorruptCheckpointWarning):
            with pytest.raises(CheckpointError, match="no readable checkpoint") as info:
                ckpt.restore()
        assert str(tmp_path / "1") in str(info.value) and str(tmp_path / "2") in str(info.value)
        assert ckpt.all_steps() == [1, 2]  # nothing is moved when nothing can be resumed
    with Checkpointer(tmp_path / "empty", save_every=1) as ckpt:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpt.restore()


_WRITER = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    from sparse_jax.training.checkpoint import Checkpointer

    directory, mode = sys.argv[1], sys.argv[2]

    def state(step):
        return {"w": jnp.full((256, 256), float(step)), "b": jnp.arange(8.0) + step}

    async def hang(*args, **kwargs):
        print("WRITING", flush=True)
        time.sleep(600)  # blocks the save's event loop until the parent kills us

    ckpt = Checkpointer(directory, save_every=1)
    ckpt.save(1, state(1), data_state={"index": 1}, rng=jax.random.key(1))
    if mode == "before_commit":  # everything written, the final rename not done
        from orbax.checkpoint._src.path import atomicity
        atomicity.AtomicRenameTemporaryPath.finalize = hang
    else:  # the JSON item blocks while the array item is being written
        from orbax.checkpoint._src.handlers import json_checkpoint_handler
        json_checkpoint_handler.JsonCheckpointHandler.async_save = hang
    ckpt.save(2, state(2), data_state={"index": 2}, rng=jax.random.key(2))
    print("UNREACHABLE", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["during_write", "before_commit"])
def test_write_killed_midway_resumes_from_the_last_complete_checkpoint(tmp_path, mode, caplog):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    directory = tmp_path / "ckpt"
    env = script_env(JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.strip() == "WRITING" or not line:
                break
        assert line.strip() == "WRITING", f"writer did not reach the save: {line!r}"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    leftovers = [p.name for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert leftovers and all(name.startswith("2.") for name in leftovers)

    target = {"w": jnp.zeros((256, 256)), "b": jnp.zeros(8)}
    with caplog.at_level(logging.WARNING, logger=checkpoint_module.__name__):
        ckpt = Checkpointer(directory, save_every=1)
    with ckpt:
        assert any("incomplete checkpoint writes" in r.getMessage() for r in caplog.records)
        assert ckpt.all_steps() == [1]
        state, data_state, rng, step = ckpt.restore(target=abstract_like(target))
        assert step == 1 and data_state == {"index": 1}
        np.testing.assert_array_equal(state["w"], np.full((256, 256), 1.0))
        np.testing.assert_array_equal(
            jax.random.key_data(rng), jax.random.key_data(jax.random.key(1))
        )
        new = {"w": jnp.full((256, 256), 2.0), "b": jnp.arange(8.0) + 2}
        assert ckpt.save(2, new, data_state={"index": 2}, rng=rng)
        assert ckpt.all_steps() == [1, 2]
        state, data_state, _, step = ckpt.restore(target=abstract_like(target))
        assert step == 2 and data_state == {"index": 2}
        _assert_trees_equal(state, new)
    assert not [p for p in directory.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def _train(ckpt, params, rng, data_state, start, stop, data):
    """A tiny deterministic training loop that uses the data position and the RNG."""

    @jax.jit
    def update(params, batch, key):
        noise = 0.01 * jax.random.normal(key, params.shape)
        grad = jax.grad(lambda p: jnp.mean((batch @ p) ** 2))(params)
        return params - 0.1 * grad + noise

    for step in range(start + 1, stop + 1):
        index = data_state["index"]
        batch = data[index : index + 2]
        rng, key = jax.random.split(rng)
        params = update(params, batch, key)
        data_state = {"index": (index + 2) % (len(data) - 1)}
        if ckpt is not None:
            ckpt.save(step, {"params": params}, data_state=data_state, rng=rng)
    return params, rng, data_state


def test_resumed_run_matches_an_uninterrupted_one(tmp_path):
    data = jax.random.normal(jax.random.key(9), (11, 4))
    params0 = jnp.ones((4, 2))
    uninterrupted, _, _ = _train(None, params0, jax.random.key(0), {"index": 0}, 0, 10, data)
    with Checkpointer(tmp_path, save_every=3) as ckpt:  # stops after step 7 (a "crash")
        _train(ckpt, params0, jax.random.key(0), {"index": 0}, 0, 7, data)
    with Checkpointer(tmp_path, save_every=3) as ckpt:
        state, data_state, rng, step = ckpt.restore(target=abstract_like({"params": params0}))
        assert step == 6
        params, rng, data_state = _train(ckpt, state["params"], rng, data_state, step, 10, data)
        ckpt.save(10, {"params": params}, data_state=data_state, rng=rng, force=True)
        assert ckpt.latest_step() == 10
    np.testing.assert_array_equal(params, uninterrupted)


def test_nan_guard_names_the_step_and_the_last_good_checkpoint(tmp_path):
    assert check_finite(jnp.float32(1.5), 1) == 1.5
    with Checkpointer(tmp_path, save_every=2) as ckpt:
        for step in (1, 2, 3):
            _save(ckpt, step)
        with pytest.raises(NonFiniteLossError) as info:
            check_finite(jnp.asarray(jnp.nan), 4, ckpt)
        assert info.value.step == 4 and info.value.last_good_step == 2
        message = str(info.value)
        assert "loss is nan at step 4" in message
        assert f"last good checkpoint: step 2 in {tmp_path}" in message
        with pytest.raises(NonFiniteLossError, match="loss is inf at step 5"):
            check_finite(jnp.inf, 5, ckpt)
        assert ckpt.all_steps() == [2]
    with Checkpointer(tmp_path / "new", save_every=2) as ckpt:
        with pytest.raises(NonFiniteLossError, match="no checkpoint has been saved yet"):
            check_finite(-jnp.inf, 1, ckpt)
        with pytest.raises(NonFiniteLossError) as info:
            check_finite(jnp.nan, 3, ckpt, checked=(2, 5))
        assert info.value.checked == (2, 5)
        assert "at step 3 (the first non-finite loss of steps 2-5, checked together)" in str(
            info.value
        )


def test_due_tells_whether_save_would_write(tmp_path):
    with Checkpointer(tmp_path, save_every=3) as ckpt:
        assert [s for s in range(1, 8) if ckpt.due(s)] == [3, 6]
        assert ckpt.due(4, force=True)
        assert ckpt.save(3, _state(), data_state={}, rng=None, force=True)
        assert not ckpt.due(3, force=True)  # exists: save would skip it
        assert ckpt.due(2)  # older: save raises
        with pytest.raises(ValueError, match="older than the latest checkpoint"):
            ckpt.save(2, _state(), data_state={}, rng=None, force=True)


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path, save_every=0)
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, save_every=1, keep_last=0)
    with pytest.raises(ValueError, match="best_mode"):
        Checkpointer(tmp_path, save_every=1, best_mode="lowest")
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        with pytest.raises(TypeError, match="data_state"):
            ckpt.save(1, _state(), data_state={"x": object()}, rng=None)
        with pytest.raises(TypeError, match="rng"):
            ckpt.save(1, _state(), data_state={}, rng=jnp.zeros(2, jnp.float32))
        with pytest.raises(TypeError, match="metrics"):
            ckpt.save(1, _state(), data_state={}, rng=None, metrics={"eval_loss": "low"})
        assert ckpt.all_steps() == []
