"""Tests of sparse_jax.dynamic: ``topk_mask`` against a numpy sort reference (ties, ``where``,
``-inf``/NaN, jit/vmap, half precision) and ``topk_block_attention`` against dense
``sparse_jax.attention`` (impl="xla") under the mask its returned block indices define, values
and gradients, for every normalizer, self/grouped-query/cross attention, causal and not, with
lengths that are not multiples of the blocks; the full-capacity case against plain dense
attention; the block selection against a numpy ranking of the mean block scores; fully masked
rows; argument errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.dispatch import attention
from sparse_jax.dynamic import SENTINEL, topk_block_attention, topk_mask
from sparse_jax.masks import causal

TOL = {"rtol": 1e-5, "atol": 1e-5}


# ----------------------------------------------------------------------------------------------
# topk_mask.


def reference_topk(scores, k, where=None):
    """numpy: per row, the first ``min(k, allowed)`` allowed entries sorted by (-score, index);
    NaN ranks as -inf."""
    s = np.asarray(scores, np.float64)
    s = np.where(np.isnan(s), -np.inf, s)
    allowed = np.ones(s.shape, bool) if where is None else np.broadcast_to(where, s.shape)
    out = np.zeros(s.shape, bool)
    flat_s, flat_a = s.reshape(-1, s.shape[-1]), allowed.reshape(-1, s.shape[-1])
    flat_o = out.reshape(-1, s.shape[-1])
    for row in range(flat_s.shape[0]):
        cand = np.flatnonzero(flat_a[row])
        order = cand[np.lexsort((cand, -flat_s[row, cand]))]
        flat_o[row, order[:k]] = True
    return out


@pytest.mark.parametrize("k", [1, 4, 17])
def test_topk_mask_matches_sort_reference(k):
    s = np.random.default_rng(0).normal(size=(3, 5, 17)).astype(np.float32)
    m = np.asarray(topk_mask(jnp.asarray(s), k))
    assert m.dtype == np.bool_ and m.shape == s.shape
    np.testing.assert_array_equal(m.sum(-1), k)
    np.testing.assert_array_equal(m, reference_topk(s, k))


def test_topk_mask_ties_go_to_the_lower_index():
    rng = np.random.default_rng(1)
    s = rng.integers(0, 3, size=(4, 6, 33)).astype(np.float32)  # many ties
    s[0, 0] = 1.0  # a whole row of equal scores keeps its first k entries
    s[0, 1, :4] = [-0.0, 0.0, -0.0, 0.0]  # -0.0 == 0.0
    for k in (1, 5, 20):
        m = np.asarray(topk_mask(jnp.asarray(s), k))
        np.testing.assert_array_equal(m.sum(-1), k)
        np.testing.assert_array_equal(m, reference_topk(s, k))
    assert np.flatnonzero(np.asarray(topk_mask(jnp.asarray(s), 5))[0, 0]).tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_topk_mask_with_where_keeps_min_k_allowed():
    rng = np.random.default_rng(2)
    s = rng.normal(size=(2, 7, 19)).astype(np.float32)
    s[0, 0, :3] = -np.inf  # -inf entries are still ranked (last)
    s[0, 1, 5] = np.nan  # NaN ranks below -inf
    where = rng.random((2, 7, 19)) < 0.3
    where[1, 2] = False  # a row with nothing allowed keeps nothing
    where[0, 0, :3] = True
    k = 4
    m = np.asarray(topk_mask(jnp.asarray(s), k, where=jnp.asarray(where)))
    np.testing.assert_array_equal(m.sum(-1), np.minimum(k, where.sum(-1)))
    assert not (m & ~where).any()
    np.testing.assert_array_equal(m, reference_topk(s, k, where))
    # A broadcast `where` (one key pattern for every row), and -inf / NaN without `where`.
    key_where = rng.random(19) < 0.5
    m = np.asarray(topk_mask(jnp.asarray(s), 3, where=jnp.asarray(key_where)))
    np.testing.assert_array_equal(m, reference_topk(s, 3, key_where))
    np.testing.assert_array_equal(np.asarray(topk_mask(jnp.asarray(s), 18)), reference_topk(s, 18))


def test_topk_mask_extreme_values_and_half_precision():
    s = np.array([[np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-45, 0.0, np.nan]], np.float32)
    for k in (2, 5, 7):  # +inf/3e38 first; 1e-45 > 0.0 > -1e-45 exactly; -inf before NaN
        np.testing.assert_array_equal(
            np.asarray(topk_mask(jnp.asarray(s), k)), reference_topk(s, k)
        )
    h = jnp.asarray(np.random.default_rng(3).normal(size=(5, 40)), jnp.bfloat16)
    expected = reference_topk(np.asarray(h.astype(jnp.float32)), 7)
    np.testing.assert_array_equal(np.asarray(topk_mask(h, 7)), expected)


def test_topk_mask_jit_and_vmap():
    rng = np.random.default_rng(4)
    s = jnp.asarray(rng.normal(size=(3, 6, 21)), jnp.float32)
    where = jnp.asarray(rng.random((3, 6, 21)) < 0.6)
    expected = reference_topk(s, 5, where)
    jitted = jax.jit(lambda x, w: topk_mask(x, 5, where=w))
    np.testing.assert_array_equal(np.asarray(jitted(s, where)), expected)
    mapped = jax.vmap(lambda x, w: topk_mask(x, 5, where=w))
    np.testing.assert_array_equal(np.asarray(mapped(s, where)), expected)
    mapped_rows = jax.vmap(lambda x: topk_mask(x, 5), in_axes=1, out_axes=1)
    np.testing.assert_array_equal(np.asarray(mapped_rows(s)), reference_topk(s, 5))
    # Gradient-free: the scores get a zero gradient through a function that uses the mask.
    g = jax.grad(lambda x: jnp.sum(jnp.where(topk_mask(x, 5), x, 0.0)))(s)
    np.testing.assert_array_equal(np.asarray(g), reference_topk(s, 5).astype(np.float32))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"k": 0}, ValueError, r"`k` must be an int in \[1, kv_len\] = \[1, 6\]; got k=0"),
        ({"k": 7}, ValueError, r"got k=7, larger than kv_len=6"),
        ({"k": 2.0}, TypeError, r"`k` must be a python int.*float 2.0"),
        ({"k": True}, TypeError, r"`k` must be a python int.*bool True"),
        (
            {"k": 2, "where": np.ones((2, 6), np.int32)},
            TypeError,
            r"`where` must be None or a bool",
        ),
        ({"k": 2, "where": np.ones((3, 6), bool)}, ValueError, r"does not broadcast"),
        ({"k": 2, "where": [True] * 6}, TypeError, r"`where` must be None or a bool"),
    ],
)
def test_topk_mask_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        topk_mask(jnp.zeros((2, 6)), **kwargs)


def test_topk_mask_bad_scores():
    with pytest.raises(TypeError, match="floating dtype"):
        topk_mask(jnp.zeros((2, 6), jnp.int32), 1)
    with pytest.raises(TypeError, match="`scores` must be a jax or numpy float array"):
        topk_mask([[1.0, 2.0]], 1)
    with pytest.raises(ValueError, match="non-empty last"):
        topk_mask(jnp.zeros((2, 0)), 1)


# ----------------------------------------------------------------------------------------------
# topk_block_attention.

# name: (batch, q_len, kv_len, query heads, key heads, head_dim, value head_dim, bq, bkv, causal)
CONFIGS = {
    "self_causal": (2, 37, 37, 2, 2, 8, 8, 8, 8, True),
    "gqa_causal": (2, 37, 37, 4, 2, 8, 5, 8, 8, True),
    "cross_noncausal": (2, 21, 37, 2, 1, 8, 6, 4, 8, False),
}
NORMALIZERS = ["softmax", "sparsemax", "entmax15", 1.3]


def inputs(config, seed=0):
    b, tq, tk, n, kh, d, dv, *_ = config
    rng = np.random.default_rng(seed)
    arrays = (
        rng.normal(size=(b, tq, n, d)),
        rng.normal(size=(b, tk, kh, d)),
        rng.normal(size=(b, tk, kh, dv)),
        rng.normal(size=(b, tq, n, dv)),  # output cotangent
    )
    return tuple(jnp.asarray(2 * a if i < 2 else a, jnp.float32) for i, a in enumerate(arrays))


def diagonal_blocks(tq, tk, bq, bkv):
    nq = -(-tq // bq)
    last = np.minimum((np.arange(nq) + 1) * bq, tq) - 1
    return np.minimum(last, tk - 1) // bkv


def mask_from_indices(indices, tq, tk, bq, bkv, is_causal):
    """Dense bool [B, N, Tq, Tk] mask of the selected blocks (and j <= i when causal)."""
    idx = np.asarray(indices)
    b, n, nq, _ = idx.shape
    nk = -(-tk // bkv)
    blocks = np.zeros((b, n, nq, nk + 1), bool)
    np.put_along_axis(blocks, np.where(idx < 0, nk, idx), True, axis=-1)
    m = np.repeat(np.repeat(blocks[..., :nk], bq, axis=2), bkv, axis=3)[:, :, :tq, :tk]
    if is_causal:
        m = m & np.tril(np.ones((tq, tk), bool))
    return m


def value_and_grads(fn, q, k, v, ct):
    """(out, aux, (dq, dk, dv)) of ``sum(fn(q, k, v)[0] * ct)``, jitted."""

    def loss(q, k, v):
        out, aux = fn(q, k, v)
        return jnp.sum(out * ct), (out, aux)

    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v
    )
    return out, aux, grads


def assert_close(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=str)
@pytest.mark.parametrize("config_name", ["gqa_causal", "cross_noncausal"])
def test_matches_dense_attention_under_the_selected_blocks(config_name, normalizer):
    config = CONFIGS[config_name]
    _, tq, tk, _, _, _, _, bq, bkv, is_causal = config
    q, k, v, ct = inputs(config)

    def kernel(q, k, v):
        return topk_block_attention(
            q,
            k,
            v,
            keep_blocks=2,
            block_size=(bq, bkv),
            causal=is_causal,
            normalizer=normalizer,
            return_indices=True,
        )

    out, idx, grads = value_and_grads(kernel, q, k, v, ct)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and idx.dtype == jnp.int32
    m = jnp.asarray(mask_from_indices(idx, tq, tk, bq, bkv, is_causal))
    dense = lambda q, k, v: (attention(q, k, v, mask=m, normalizer=normalizer, impl="xla"), 0)
    ref, _, ref_grads = value_and_grads(dense, q, k, v, ct)
    assert_close((out, *grads), (ref, *ref_grads))
    # The selection is sparse: some query block of the longer configs leaves blocks out.
    assert (np.asarray(m).sum(-1) < tk).any()


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_full_capacity_equals_dense_attention(normalizer):
    config = CONFIGS["self_causal"]
    q, k, v, ct = inputs(config, seed=1)

    def kernel(q, k, v):
        return topk_block_attention(
            q, k, v, keep_blocks=5, block_size=(8, 8), normalizer=normalizer, return_weights=True
        )

    def dense(q, k, v):
        return attention(
            q, k, v, mask=causal(), normalizer=normalizer, impl="xla", return_weights=True
        )

    out, w, grads = value_and_grads(kernel, q, k, v, ct)
    ref, ref_w, ref_grads = value_and_grads(dense, q, k, v, ct)
    assert_close((out, w, *grads), (ref, ref_w, *ref_grads))


def test_full_capacity_noncausal_and_learnable_alpha():
    config = CONFIGS["cross_noncausal"]
    q, k, v, ct = inputs(config, seed=2)
    alpha = jnp.array([1.3, 1.7], jnp.float32)

    def loss(fn):
        def f(q, k, v, alpha):
            return jnp.sum(fn(q, k, v, alpha) * ct)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(q, k, v, alpha)

    # Two local blocks plus all four others: every key block of the 5 (37 keys / 8).
    kernel = lambda q, k, v, a: topk_block_attention(
        q, k, v, keep_blocks=4, local_blocks=2, block_size=(4, 8), causal=False, normalizer=a
    )
    dense = lambda q, k, v, a: attention(q, k, v, normalizer=a, impl="xla")
    (val, grads), (ref_val, ref_grads) = loss(kernel), loss(dense)
    assert_close((val, *grads), (ref_val, *ref_grads))
    assert float(jnp.abs(grads[3]).max()) > 0  # α gets a gradient


def mean_block_scores(q, k, bq, bkv, scale):
    """numpy float64: scale · mean(q block) · mean(k block), [B, N, nq, nk] (GQA by repeat)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    _, tq, n, _ = q.shape
    tk, kh = k.shape[1], k.shape[2]
    pq = np.stack([q[:, s : s + bq].mean(1) for s in range(0, tq, bq)], axis=1)  # [B, nq, N, D]
    pk = np.stack([k[:, s : s + bkv].mean(1) for s in range(0, tk, bkv)], axis=1)
    pk = np.repeat(pk, n // kh, axis=2)
    return scale * np.einsum("brnd,bcnd->bnrc", pq, pk)


@pytest.mark.parametrize("config_name", ["gqa_causal", "cross_noncausal"])
def test_indices_are_local_blocks_then_best_allowed_blocks(config_name):
    config = CONFIGS[config_name]
    b, tq, tk, n, _, d, _, bq, bkv, is_causal = config
    q, k, v, _ = inputs(config, seed=3)
    keep, local = 2, 2
    _, idx = topk_block_attention(
        q,
        k,
        v,
        keep_blocks=keep,
        local_blocks=local,
        block_size=(bq, bkv),
        causal=is_causal,
        return_indices=True,
    )
    idx = np.asarray(idx)
    nq, nk = -(-tq // bq), -(-tk // bkv)
    assert idx.shape == (b, n, nq, local + keep)
    diag = diagonal_blocks(tq, tk, bq, bkv)
    scores = mean_block_scores(q, k, bq, bkv, d**-0.5)
    for bi in range(b):
        for h in range(n):
            for r in range(nq):
                row = idx[bi, h, r]
                expected_local = [c if c >= 0 else SENTINEL for c in (diag[r], diag[r] - 1)]
                assert row[:local].tolist() == expected_local
                valid = row[row != SENTINEL]
                assert len(set(valid.tolist())) == len(valid)  # no block twice
                allowed = np.arange(nk) <= diag[r] if is_causal else np.ones(nk, bool)
                assert allowed[valid].all()  # causality: nothing after the diagonal block
                others = [c for c in np.flatnonzero(allowed) if c not in expected_local]
                best = sorted(others, key=lambda c: -scores[bi, h, r, c])[:keep]
                chosen = row[local:]
                assert chosen[chosen != SENTINEL].tolist() == best  # by decreasing score
                assert (chosen == SENTINEL).sum() == keep - len(best)


def test_capacity_beyond_the_blocks_pads_indices_with_sentinel():
    q, k, v, _ = inputs(CONFIGS["self_causal"])
    _, idx = topk_block_attention(
        q, k, v, keep_blocks=9, local_blocks=7, block_size=(16, 16), return_indices=True
    )
    assert idx.shape == (2, 2, 3, 16)  # K = 7 + 9 although only 3 key blocks exist
    counts = (np.asarray(idx) != SENTINEL).sum(-1)
    np.testing.assert_array_equal(counts, np.broadcast_to([1, 2, 3], counts.shape))


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_fully_masked_rows_give_zeros_and_zero_gradients(normalizer):
    # bq = 8 > bkv = 4 with only the diagonal block: rows 8 .. 11 of query block 1 precede its
    # diagonal key block (keys 12 .. 15) and see no key (query block 2 is cut by the length 20,
    # so its diagonal block is keys 16 .. 19 and every row of it sees a key).
    config = (1, 20, 20, 2, 2, 8, 8, 8, 4, True)
    q, k, v, ct = inputs(config, seed=4)

    def kernel(q, k, v):
        return topk_block_attention(
            q, k, v, keep_blocks=0, block_size=(8, 4), normalizer=normalizer, return_indices=True
        )

    out, idx, (dq, dk, dv) = value_and_grads(kernel, q, k, v, ct)
    assert idx.shape == (1, 2, 3, 1)
    dead = [8, 9, 10, 11]
    assert not np.asarray(out)[:, dead].any()
    assert not np.asarray(dq)[:, dead].any()
    assert np.asarray(out)[:, 12:].all(axis=(1, 2, 3)).all()  # the other rows see keys
    for g in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    m = jnp.asarray(mask_from_indices(idx, 20, 20, 8, 4, True))
    dense = lambda q, k, v: (attention(q, k, v, mask=m, normalizer=normalizer, impl="xla"), 0)
    ref, _, ref_grads = value_and_grads(dense, q, k, v, ct)
    assert_close((out, dq, dk, dv), (ref, *ref_grads))


def test_scale_array_and_jit():
    q, k, v, _ = inputs(CONFIGS["self_causal"])
    scale = jnp.asarray(0.25, jnp.float32)
    f = jax.jit(
        lambda q, k, v, s: topk_block_attention(q, k, v, keep_blocks=1, scale=s, block_size=(8, 8))
    )
    expected = topk_block_attention(q, k, v, keep_blocks=1, scale=0.25, block_size=(8, 8))
    np.testing.assert_allclose(np.asarray(f(q, k, v, scale)), np.asarray(expected), **TOL)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep_blocks": -1}, ValueError, r"`keep_blocks` must be an int >= 0; got -1"),
        ({"keep_blocks": 1.0}, TypeError, r"`keep_blocks` must be an int >= 0"),
        ({"keep_blocks": True}, TypeError, r"`keep_blocks` must be an int >= 0"),
        ({"local_blocks": 0}, ValueError, r"`local_blocks` must be an int >= 1; got 0"),
        ({"block_size": (8,)}, TypeError, r"`block_size` must be a pair"),
        ({"block_size": (8, 0)}, ValueError, r"`block_size\[1\]` must be an int >= 1"),
        ({"causal": 1}, TypeError, r"`causal` must be a bool"),
        ({"normalizer": "relu"}, ValueError, r"unknown `normalizer`='relu'"),
        ({"normalizer": 0.5}, ValueError, r"α must be finite and >= 1"),
        ({"scale": float("nan")}, ValueError, r"`scale` must be finite"),
        ({"return_weights": "yes"}, TypeError, r"`return_weights` must be a bool"),
        ({"return_indices": None}, TypeError, r"`return_indices` must be a bool"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    q = jnp.zeros((1, 8, 2, 4))
    args = {"keep_blocks": 1, **kwargs}
    with pytest.raises(error, match=match):
        topk_block_attention(q, q, q, **args)


def test_bad_shapes_raise():
    q = jnp.zeros((1, 8, 4, 4))
    with pytest.raises(ValueError, match="must divide the number of query heads"):
        topk_block_attention(q, jnp.zeros((1, 8, 3, 4)), jnp.zeros((1, 8, 3, 4)), keep_blocks=1)
    with pytest.raises(ValueError, match="rank 4"):
        topk_block_attention(q[0], q[0], q[0], keep_blocks=1)
    with pytest.raises(TypeError, match="same dtype"):
        topk_block_attention(q, q.astype(jnp.bfloat16), q, keep_blocks=1)
    with pytest.raises(TypeError, match="keep_blocks"):
        topk_block_attention(q, q, q)  # keep_blocks is required
