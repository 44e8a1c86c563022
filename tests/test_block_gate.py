"""The learned block selector (sparse_jax.block_gate): its scores, the teacher's block mass, the
KL that trains it, and the selection it drives through the block-top-k engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparse_jax.block_gate import (
    BlockGate,
    block_attention_mass,
    block_gate_loss,
    block_gate_scores,
)
from sparse_jax.dispatch import attention
from sparse_jax.dynamic import BlockSelection, topk_block_attention
from tests.test_block_selection import inputs

TOL = {"rtol": 1e-5, "atol": 1e-5}


def reference_scores(q, k, w_q, w_k, block, local):
    """numpy, loop by loop: scale · (q_i W_q) · ([mean, max, min] of block c) W_k for the
    earlier blocks c <= i // block - local, -inf elsewhere."""
    q, k, w_q, w_k = (np.asarray(x, np.float64) for x in (q, k, w_q, w_k))
    b, t, n, d = q.shape
    g = n // k.shape[2]
    nk = -(-t // block)
    out = np.full((b, n, t, nk), -np.inf)
    for bi in range(b):
        for h in range(n):
            for i in range(t):
                for c in range(i // block - local + 1):
                    keys = k[bi, c * block : (c + 1) * block, h // g]
                    pooled = np.concatenate([keys.mean(0), keys.max(0), keys.min(0)])
                    out[bi, h, i, c] = d**-0.5 * (q[bi, i, h] @ w_q[h]) @ (pooled @ w_k[h])
    return out


@pytest.mark.parametrize("block, local", [(3, 1), (2, 2)])
def test_scores_are_the_maps_of_the_pooled_blocks(block, local):
    q, k, _ = inputs(t=11)
    keys = jax.random.split(jax.random.key(1), 2)
    w_q = jax.random.normal(keys[0], (4, 8, 5))
    w_k = jax.random.normal(keys[1], (4, 24, 5))
    got = block_gate_scores(q, k, w_q, w_k, block=block, local_blocks=local)
    assert got.dtype == jnp.float32 and got.shape == (2, 4, 11, -(-11 // block))
    np.testing.assert_allclose(got, reference_scores(q, k, w_q, w_k, block, local), rtol=1e-4)


@pytest.mark.parametrize("keep, block, local", [(1, 3, 1), (2, 2, 1), (1, 2, 2)])
def test_an_initial_gate_selects_as_the_pooled_score(keep, block, local):
    sel = BlockSelection(keep_blocks=keep, block=block, local_blocks=local)
    gate = BlockGate(sel, num_heads=4, head_dim=8)
    q, k, _ = inputs()
    np.testing.assert_array_equal(gate.mask(q, k), sel.dense(q, k))
    pooled = gate.scores(q, k)
    finite = np.isfinite(pooled)
    means = reference_scores(q, k, np.eye(8)[None].repeat(4, 0), np.eye(24, 8)[None].repeat(4, 0),
                             block, local)  # fmt: skip
    np.testing.assert_allclose(
        np.where(finite, pooled, 0), np.where(finite, means, 0), rtol=1e-5, atol=1e-6
    )


def _planted_scores(q, k, block):
    """Scores that rank the earlier blocks in reverse order of the pooled score (the selection
    must follow them, not the pooled score)."""
    pooled = BlockGate(BlockSelection(1, block=block), num_heads=4, head_dim=8).scores(q, k)
    return -pooled


def test_the_engine_and_the_dense_mask_follow_given_block_scores():
    block = 3
    sel = BlockSelection(keep_blocks=1, block=block)
    q, k, v = inputs()
    scores = _planted_scores(q, k, block)
    mask = sel.dense(q, k, block_scores=scores)
    assert not np.array_equal(mask, sel.dense(q, k))  # the given scores changed the choice
    out, idx = topk_block_attention(
        q, k, v, keep_blocks=1, block_size=(1, block), block_scores=scores, return_indices=True
    )
    # The chosen slot is the earlier block of the highest given score.
    best = np.argmax(np.where(np.isfinite(scores), scores, -np.inf), axis=-1)
    has = np.isfinite(scores).any(-1)
    np.testing.assert_array_equal(np.asarray(idx[..., 1])[has], best[has])

    def ours(q, k, v):
        return sel.attention(q, k, v, normalizer="sparsemax", block_scores=scores)

    def reference(q, k, v):
        return attention(q, k, v, mask=mask, normalizer="sparsemax", impl="xla")

    np.testing.assert_allclose(out, sel.attention(q, k, v, block_scores=scores), **TOL)
    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), **TOL)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)
        for f in (ours, reference)
    ]
    for ga, gb in zip(*grads, strict=True):
        np.testing.assert_allclose(ga, gb, **TOL)


def test_the_block_mass_sums_the_weights_of_each_candidate_block():
    w = jax.nn.softmax(jax.random.normal(jax.random.key(2), (2, 3, 7, 7)), axis=-1)
    mass = np.asarray(block_attention_mass(w, 2, local_blocks=1))
    want = np.zeros((2, 3, 7, 4))
    for i in range(7):
        for c in range(i // 2):  # the blocks before the query's own
            want[:, :, i, c] = np.asarray(w)[:, :, i, 2 * c : 2 * c + 2].sum(-1)
    np.testing.assert_allclose(mass, want, rtol=1e-6, atol=1e-7)
    # Decoding: the last two queries of a cache of 7, as rows 5 and 6 of the whole.
    tail = block_attention_mass(w[:, :, 5:], 2, q_offset=5)
    np.testing.assert_allclose(tail, want[:, :, 5:], rtol=1e-6, atol=1e-7)
    # pool="max": each candidate block's largest weight (block 3 holds one key, 6).
    top = np.asarray(block_attention_mass(w, 2, local_blocks=1, pool="max"))
    want_top = np.zeros((2, 3, 7, 4))
    for i in range(7):
        for c in range(i // 2):
            want_top[:, :, i, c] = np.asarray(w)[:, :, i, 2 * c : 2 * c + 2].max(-1)
    np.testing.assert_allclose(top, want_top, rtol=1e-6, atol=1e-7)
    assert not np.allclose(top, mass)
    # A gate of a LearnedBlockSelection(pool="max") learns from that target.
    from sparse_jax.block_gate import LearnedBlockSelection

    q = k = jax.random.normal(jax.random.key(3), (2, 7, 3, 4))
    for pool, target in (("sum", mass), ("max", top)):
        gate = BlockGate(LearnedBlockSelection(1, block=2, pool=pool), num_heads=3, head_dim=4)
        want_loss = block_gate_loss(gate.scores(q, k), jnp.asarray(target))
        np.testing.assert_allclose(gate.loss(q, k, w), want_loss, rtol=1e-6)


def test_the_loss_is_the_mass_weighted_kl_recomputed():
    scores = jnp.array([[1.0, 0.0, -jnp.inf], [2.0, -1.0, 0.5], [-jnp.inf] * 3])
    mass = jnp.array([[0.2, 0.2, 0.0], [0.5, 0.0, 0.1], [0.0, 0.0, 0.0]])
    kl = []
    for s, m in zip(np.asarray(scores), np.asarray(mass), strict=True):
        keep = np.isfinite(s)
        if not keep.any() or m[keep].sum() == 0:
            kl.append(0.0)
            continue
        t, g = m[keep] / m[keep].sum(), np.exp(s[keep]) / np.exp(s[keep]).sum()
        kl.append(sum(x * np.log(x / y) for x, y in zip(t, g, strict=True) if x > 0))
    rows = np.asarray(mass).sum(-1)
    want = (rows * np.array(kl)).sum() / rows.sum()
    assert float(block_gate_loss(scores, mass)) == pytest.approx(want, rel=1e-5)
    grad = jax.grad(block_gate_loss)(scores, mass)
    assert np.isfinite(np.asarray(grad)[np.isfinite(scores)]).all()
    assert float(block_gate_loss(scores, jnp.zeros_like(mass))) == 0.0  # nothing to learn


def test_a_gate_trained_on_a_teachers_attention_finds_its_blocks():
    """The teacher attends with a rotated query (q R), which the pooled score cannot see; the
    gate's maps learn it: the KL falls and the selection finds more of the teacher's mass."""
    b, t, n, d, block = 4, 48, 2, 8, 4
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, t, n, d))
    k = jax.random.normal(keys[1], (b, t, n, d))
    rotation = jnp.linalg.qr(jax.random.normal(keys[2], (d, d)))[0]
    s = jnp.einsum("bind,bjnd->bnij", q @ rotation, k) * 3.0
    causal = jnp.tril(jnp.ones((t, t), bool))
    teacher = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    gate = BlockGate(BlockSelection(keep_blocks=2, block=block), num_heads=n, head_dim=d)

    def found(gate):  # the share of the teacher's candidate mass the selection keeps
        mass = block_attention_mass(teacher, block)
        kept = gate.mask(q, k) & ~BlockSelection(0, block=block).dense(q, k)
        return float((teacher * kept).sum() / mass.sum())

    before, loss_before = found(gate), float(gate.loss(q, k, teacher))
    optimizer = nnx.Optimizer(gate, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def step(gate, optimizer):
        loss, grads = nnx.value_and_grad(lambda g: g.loss(q, k, teacher))(gate)
        optimizer.update(gate, grads)
        return loss

    for _ in range(150):
        step(gate, optimizer)
    assert float(gate.loss(q, k, teacher)) < 0.4 * loss_before
    assert found(gate) > before + 0.3, (before, found(gate))


def test_gate_describes_itself_and_its_parameters_are_params():
    gate = BlockGate(BlockSelection(1, block=8), num_heads=3, head_dim=4, gate_dim=2)
    assert repr(gate) == (
        "BlockGate(keep 1 earlier blocks of 8 keys, 3 heads, gate width 2: 96 parameters)"
    )
    params = nnx.state(gate, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == 3 * 4 * 2 + 3 * 12 * 2


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: BlockGate("window", 2, 4), TypeError, "`selection` must be a"),
        (lambda: BlockGate(BlockSelection(1), 0, 4), ValueError, "num_heads"),
        (lambda: BlockGate(BlockSelection(1), 2, 4, gate_dim=0), ValueError, "gate_dim"),
        (
            lambda: block_gate_scores(
                jnp.ones((1, 4, 2, 4)),
                jnp.ones((1, 4, 2, 4)),
                jnp.ones((2, 4, 3)),
                jnp.ones((2, 4, 3)),
                block=2,
            ),
            ValueError,
            r"`w_k` must be \[N, 3D, G\]",
        ),
        (
            lambda: block_gate_scores(
                jnp.ones((1, 4, 2, 4)),
                jnp.ones((1, 4, 3, 4)),
                jnp.ones((2, 4, 3)),
                jnp.ones((2, 12, 3)),
                block=2,
            ),
            ValueError,
            r"key heads \(3\) must divide query heads \(2\)",
        ),
        (
            lambda: block_attention_mass(jnp.ones((1, 4, 4)), 2),
            ValueError,
            r"`weights` must be \[B, N, Tq, Tk\]",
        ),
        (
            lambda: block_gate_loss(jnp.ones((2, 3)), jnp.ones((2, 4))),
            ValueError,
            "must have one shape",
        ),
        (
            lambda: block_attention_mass(jnp.ones((1, 1, 4, 4)), 2, pool="mean"),
            ValueError,
            r"`pool` must be one of \('sum', 'max'\); got 'mean'",
        ),
        (
            lambda: topk_block_attention(
                *inputs(t=8)[:3],
                keep_blocks=1,
                block_size=(1, 2),
                block_scores=jnp.ones((2, 4, 8, 3)),
            ),
            ValueError,
            r"`block_scores` must have shape \[B, N, nq, nk\] = \[2, 4, 8, 4\]",
        ),
        (
            lambda: BlockSelection(1, block=2).dense(
                *inputs(t=8)[:2], block_scores=jnp.ones((2, 4, 8, 3))
            ),
            ValueError,
            r"`block_scores` must have shape \[B, N, Tq, nk\]",
        ),
        (
            lambda: topk_block_attention(
                *inputs(t=8)[:3],
                keep_blocks=1,
                block_size=(1, 2),
                block_scores=np.ones((2, 4, 8, 4), np.int32),
            ),
            TypeError,
            "`block_scores` must have a floating dtype",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()
