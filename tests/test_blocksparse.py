"""Tests of sparse_jax.blocksparse: the block-sparse kernel against an exact dense float64
reference (values and gradients) for every normalizer, several masks and self/cross/grouped-query
attention (every pair of the three), with lengths that are not multiples of the blocks; fully
masked rows, biases, learnable α, the multi-step (lax.map) path, memory that follows the mask,
and argument errors.

The reference is numpy, not jax: the whole ``[B, N, Tq, Tk]`` score matrix, ``mask.dense``,
the normalizer by bisection on its threshold to float64 precision, and the gradients of
``<out, cotangent>`` written out by hand (``dp/dx = diag(s) - s sᵀ / Σs`` with ``s = p^(2-α)``
on the support, ``s = p`` for softmax). It shares no code with the kernel, and costs no
compilation, which keeps the grid fast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.blocksparse import blocksparse_attention, blocksparse_cost
from sparse_jax.masks import causal, full, local, padding, per_head, sink, strided
from tests.conftest import FAST_COMPILE

TOL = {"rtol": 1e-5, "atol": 1e-5}

# name: (batch, q_len, kv_len, query heads, key heads, head_dim, value head_dim, block_q, block_kv)
CONFIGS = {
    "self": (2, 37, 37, 2, 2, 8, 8, 8, 8),
    "cross": (2, 21, 37, 2, 2, 8, 6, 4, 8),
    "gqa": (2, 37, 37, 4, 2, 8, 5, 8, 8),
}
NORMALIZERS = ["softmax", "sparsemax", "entmax15", "alpha_per_head"]
MASKS = ["causal", "window", "window_sink", "strided", "per_head", "padding_causal"]


def make_mask(name, num_heads, kv_len):
    if name == "causal":
        return causal()
    if name == "window":
        return causal() & local(5, 0)
    if name == "window_sink":
        return (causal() & local(5, 0)) | sink(2)
    if name == "strided":
        return strided(4)
    if name == "per_head":
        return per_head([causal(), causal() & local(3, 0)] * (num_heads // 2))
    return padding(np.array([kv_len, kv_len // 2 - 1])) & causal()


def normalizer_arg(name, num_heads):
    """The kernel's ``normalizer=``: a name, or one α per head (α = 1.3, 1.35, ...)."""
    if name == "alpha_per_head":
        return 1.3 + 0.05 * jnp.arange(num_heads, dtype=jnp.float32)
    return name


def inputs(config, seed=0):
    """Random float32 q, k, v and an output cotangent (numpy: nothing to compile)."""
    b, tq, tk, n, kh, d, dv, _, _ = config
    rng = np.random.default_rng(seed)
    shapes = [(b, tq, n, d), (b, tk, kh, d), (b, tk, kh, dv), (b, tq, n, dv)]
    return [jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in shapes]


# ----------------------------------------------------------------------------------------------
# The float64 numpy reference.


def dense_allowed(mask, q_len, kv_len):
    """``mask.dense`` as a bool array broadcastable to [B, N, Tq, Tk]."""
    m = np.asarray(mask.dense(q_len, kv_len))
    if mask.batch_size is None:
        m = m[None]
    if mask.num_heads is None:
        m = m[:, None]
    return m


def np_normalize(s, allowed, normalizer):
    """Normalizer over the last axis in float64: softmax, or α-entmax by bisection on τ.

    Returns (p, s_jac), with the Jacobian dp/dx = diag(s_jac) - s_jac s_jacᵀ / Σ s_jac.
    """
    x = np.where(allowed, s, -np.inf)
    row_max = x.max(-1, keepdims=True)
    has = np.isfinite(row_max)
    x = x - np.where(has, row_max, 0.0)
    if isinstance(normalizer, str) and normalizer == "softmax":
        e = np.exp(x)
        p = e / np.where(has, e.sum(-1, keepdims=True), 1.0)
        return p, p
    if isinstance(normalizer, str):
        alpha = {"sparsemax": 2.0, "entmax15": 1.5}[normalizer]
    else:
        alpha = normalizer
    alpha = np.broadcast_to(np.asarray(alpha, np.float64), s.shape[:-1])[..., None]
    z, power = (alpha - 1.0) * x, 1.0 / (alpha - 1.0)  # max z = 0, so τ lies in [-1, 0]
    lo, hi = np.full(row_max.shape, -1.0), np.zeros(row_max.shape)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        enough = (np.maximum(z - mid, 0.0) ** power).sum(-1, keepdims=True) >= 1.0
        lo, hi = np.where(enough, mid, lo), np.where(enough, hi, mid)
    p = np.maximum(z - lo, 0.0) ** power
    p = p / np.where(has, p.sum(-1, keepdims=True), 1.0)
    return p, np.where(p > 0.0, np.where(p > 0.0, p, 1.0) ** (2.0 - alpha), 0.0)


def np_attention(q, k, v, cot, allowed, normalizer, bias=None):
    """Dense attention in float64 and the gradients of ``<out, cot>``.

    ``normalizer``: a name, or α per query head ``[N]``. Returns a dict with ``out``, ``p``
    ``[B, N, Tq, Tk]`` and ``dq``, ``dk``, ``dv``, ``ds`` (the gradient of the scores, which is
    the gradient of a full ``[B, N, Tq, Tk]`` bias).
    """
    q, k, v, cot = (np.asarray(x, np.float64) for x in (q, k, v, cot))
    b, tk, kh, _ = k.shape
    d, g = q.shape[3], q.shape[2] // kh
    if not isinstance(normalizer, str):
        normalizer = np.asarray(normalizer, np.float64)[None, :, None]  # α per head
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = d**-0.5
    s = np.einsum("bqnd,bknd->bnqk", q, kr) * scale
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    p, sj = np_normalize(s, np.broadcast_to(allowed, s.shape), normalizer)
    out = np.einsum("bnqk,bknd->bqnd", p, vr)
    dp = np.einsum("bqnd,bknd->bnqk", cot, vr)
    ds = sj * dp - sj * (sj * dp).sum(-1, keepdims=True) / np.maximum(
        sj.sum(-1, keepdims=True), 1e-300
    )
    dq = np.einsum("bnqk,bknd->bqnd", ds, kr) * scale
    dk = (np.einsum("bnqk,bqnd->bknd", ds, q) * scale).reshape(b, tk, kh, g, d).sum(3)
    dv = np.einsum("bnqk,bqnd->bknd", p, cot).reshape(b, tk, kh, g, -1).sum(3)
    return {"out": out, "p": p, "dq": dq, "dk": dk, "dv": dv, "ds": ds}


def reduce_to(x, shape):
    """Sums ``x`` [B, N, Tq, Tk] over the axes where a bias of ``shape`` broadcasts."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(i for i, size in enumerate(shape4) if size == 1 and x.shape[i] != 1)
    return x.sum(axes, keepdims=True).reshape(shape)


# ----------------------------------------------------------------------------------------------
# Helpers for the kernel.


def value_and_grads(fn, cot, *args):
    """(out, grads of ``<out, cot>`` w.r.t. every argument), in one jitted function."""

    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cot)

    return jax.jit(run).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def assert_close(actual, expected, **tol):
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), **(tol or TOL))


# ----------------------------------------------------------------------------------------------
# Against the dense reference.


def _grid():
    """(config, mask, normalizer) cases: each config meets each normalizer with two masks, three
    apart and shifted by two per config, so that every (config, mask), (mask, normalizer) and
    (config, normalizer) pair occurs (pairwise coverage of the 3 x 6 x 4 product at 24 of its
    72 cases: each case is one compilation)."""
    return [
        (config, MASKS[(2 * c + i + shift) % len(MASKS)], norm)
        for c, config in enumerate(CONFIGS)
        for i, norm in enumerate(NORMALIZERS)
        for shift in (0, len(MASKS) // 2)
    ]


def test_grid_covers_every_pair():
    cases = set(_grid())
    assert len(cases) == 24
    assert {(c, m) for c, m, _ in cases} == {(c, m) for c in CONFIGS for m in MASKS}
    assert {(m, n) for _, m, n in cases} == {(m, n) for m in MASKS for n in NORMALIZERS}
    assert {(c, n) for c, _, n in cases} == {(c, n) for c in CONFIGS for n in NORMALIZERS}


@pytest.mark.parametrize("config, mask_name, norm_name", _grid())
def test_matches_dense_values_and_grads(config, mask_name, norm_name):
    cfg = CONFIGS[config]
    b, tq, tk, n, _, _, dv, bq, bkv = cfg
    q, k, v, cot = inputs(cfg)
    mask = make_mask(mask_name, n, tk)
    layout = mask.blocks(tq, tk, bq, bkv)
    assert layout.dynamic == (mask_name == "padding_causal")
    normalizer = normalizer_arg(norm_name, n)

    def kernel(q, k, v):
        return blocksparse_attention(q, k, v, layout, mask=mask, normalizer=normalizer)

    out, (dq, dk, dv_) = value_and_grads(kernel, cot, q, k, v)
    ref = np_attention(q, k, v, cot, dense_allowed(mask, tq, tk), normalizer)
    assert out.shape == (b, tq, n, dv)
    assert_close((out, dq, dk, dv_), (ref["out"], ref["dq"], ref["dk"], ref["dv"]))


def test_layout_is_sparse_for_the_test_masks():
    # The grid above only means something if blocks are really skipped.
    lay = (causal() & local(5, 0)).blocks(37, 37, 8, 8)
    assert lay.max_count == 2 and lay.num_q_blocks == 5
    assert lay.kv_block_indices[0, 4].tolist() == [3, 4]


@pytest.mark.parametrize("per_head_layout", [False, True])
def test_alpha_and_bias_gradients(per_head_layout):
    cfg = CONFIGS["gqa"]
    b, tq, tk, n, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg, seed=1)
    mask = per_head([causal() & local(9, 0), causal()] * 2) if per_head_layout else causal()
    layout = mask.blocks(tq, tk, bq, bkv)
    allowed = dense_allowed(mask, tq, tk)
    alpha = jnp.array([1.25, 1.5, 1.8, 2.5])
    rng = np.random.default_rng(5)
    biases = [
        jnp.asarray(rng.standard_normal((b, n, tq, tk), np.float32)),
        jnp.asarray(rng.standard_normal((n, 1, tk), np.float32)),  # broadcasts over batch and Tq
        jnp.asarray(rng.standard_normal((b, 1, tq, 1), np.float32)),
    ]

    def kernel(q, k, v, alpha, bias):
        return blocksparse_attention(q, k, v, layout, normalizer=alpha, bias=bias)

    for bias in biases:
        out, grads = value_and_grads(kernel, cot, q, k, v, alpha, bias)
        ref = np_attention(q, k, v, cot, allowed, alpha, bias)
        expected = (ref["out"], ref["dq"], ref["dk"], ref["dv"], reduce_to(ref["ds"], bias.shape))
        # α = 2.5 has s = p^(-1/2), which amplifies the float32 rounding of small p: the
        # library's dense path deviates from float64 by the same ~5e-5 relative here.
        assert_close((out, grads[0], grads[1], grads[2], grads[4]), expected, rtol=2e-4, atol=2e-4)
        # dα by central differences of the float64 reference.
        dalpha = []
        for h in range(n):
            step = np.eye(n)[h] * 1e-5
            plus = np_attention(q, k, v, cot, allowed, np.asarray(alpha) + step, bias)["out"]
            minus = np_attention(q, k, v, cot, allowed, np.asarray(alpha) - step, bias)["out"]
            dalpha.append(((plus - minus) * np.asarray(cot)).sum() / 2e-5)
        np.testing.assert_allclose(grads[3], dalpha, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_name", ["softmax", "sparsemax"])
def test_return_weights_is_the_dense_matrix(norm_name):
    cfg = CONFIGS["cross"]
    b, tq, tk, n, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg)
    mask = (causal() & local(5, 0)) | sink(2)
    layout = mask.blocks(tq, tk, bq, bkv)
    out, w = jax.jit(
        lambda q, k, v: blocksparse_attention(
            q, k, v, layout, normalizer=norm_name, return_weights=True
        )
    )(q, k, v)
    ref = np_attention(q, k, v, cot, dense_allowed(mask, tq, tk), norm_name)
    assert w.shape == (b, n, tq, tk)
    assert_close((out, w), (ref["out"], ref["p"]))
    if norm_name == "sparsemax":
        assert (w == 0).mean() > 0.8  # exact zeros outside the mask and beyond


@pytest.mark.parametrize("norm_name", NORMALIZERS)
def test_fully_masked_rows_give_zeros_and_finite_grads(norm_name):
    # Rows 0..20 have no key (query blocks 0 and 1 are empty: count 0, sentinel slots only);
    # batch element 1 has no key at all (padding length 0).
    cfg = CONFIGS["self"]
    _, tq, tk, n, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg)
    mask = causal() & ~local(20, 0) & padding(np.array([37, 0]))
    layout = mask.blocks(tq, tk, bq, bkv)
    assert layout.kv_block_counts[0, :2].tolist() == [0, 0]
    normalizer = normalizer_arg(norm_name, n)

    def kernel(q, k, v):
        return blocksparse_attention(q, k, v, layout, mask=mask, normalizer=normalizer)

    out, (dq, dk, dv) = value_and_grads(kernel, cot, q, k, v)
    assert all(bool(jnp.isfinite(x).all()) for x in (out, dq, dk, dv))
    assert not out[0, :21].any() and not out[1].any()
    assert not dq[0, :21].any() and not dq[1].any() and not dk[1].any() and not dv[1].any()
    ref = np_attention(q, k, v, cot, dense_allowed(mask, tq, tk), normalizer)
    assert_close((out, dq, dk, dv), (ref["out"], ref["dq"], ref["dk"], ref["dv"]))


def test_minus_inf_bias_row_gives_zeros():
    cfg = CONFIGS["self"]
    _, tq, tk, _, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg)
    bias = jnp.zeros((1, 1, tq, tk)).at[:, :, 5].set(-jnp.inf)  # row 5 sees only -inf
    layout = causal().blocks(tq, tk, bq, bkv)
    for norm in ("softmax", "sparsemax", "entmax15"):

        def kernel(q, k, v, norm=norm):
            return blocksparse_attention(q, k, v, layout, normalizer=norm, bias=bias)

        out, grads = value_and_grads(kernel, cot, q, k, v)
        assert all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
        assert not out[:, 5].any() and not grads[0][:, 5].any()


def test_full_mask_without_partial_blocks():
    cfg = (1, 16, 24, 2, 1, 8, 8, 8, 8)  # lengths divide the blocks: every block is full
    q, k, v, cot = inputs(cfg)
    layout = full().blocks(16, 24, 8, 8)
    assert layout.partial_masks.shape[0] == 0

    def kernel(q, k, v):
        return blocksparse_attention(q, k, v, layout, normalizer="entmax15")

    out, (dq, dk, dv) = value_and_grads(kernel, cot, q, k, v)
    ref = np_attention(q, k, v, cot, np.ones((1, 1, 16, 24), bool), "entmax15")
    assert_close((out, dq, dk, dv), (ref["out"], ref["dq"], ref["dk"], ref["dv"]))


# ----------------------------------------------------------------------------------------------
# The multi-step path, jit with run-time lengths, low precision.


@pytest.mark.parametrize("steps", [1, 2])
def test_several_steps_match_the_reference(steps):
    # 5 query blocks in steps of 1 (5 steps) or 2 (3 steps, one padded query block); per-head
    # dynamic mask, GQA, a bias and per-head α: every closure of the lax.map step.
    cfg = CONFIGS["gqa"]
    b, tq, tk, _, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg, seed=2)
    mask = per_head([causal() & local(9, 0), causal()] * 2) & padding(np.array([30, 11]))
    layout = mask.blocks(tq, tk, bq, bkv)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((b, 1, tq, tk), np.float32))
    alpha = jnp.array([1.3, 1.5, 2.0, 1.7])

    def kernel(q, k, v, bias):
        return blocksparse_attention(
            q, k, v, layout, mask=mask, normalizer=alpha, bias=bias, query_blocks_per_step=steps
        )

    out, (dq, dk, dv, dbias) = value_and_grads(kernel, cot, q, k, v, bias)
    ref = np_attention(q, k, v, cot, dense_allowed(mask, tq, tk), alpha, bias)
    expected = (ref["out"], ref["dq"], ref["dk"], ref["dv"], reduce_to(ref["ds"], bias.shape))
    assert_close((out, dq, dk, dv, dbias), expected)


def test_traced_padding_lengths_inside_jit():
    cfg = CONFIGS["self"]
    _, tq, tk, _, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg)

    @jax.jit
    def fn(q, k, v, lengths):
        mask = padding(lengths) & causal() & local(9, 0)
        layout = mask.blocks(tq, tk, bq, bkv)  # a static bound, computed at trace time
        return blocksparse_attention(q, k, v, layout, mask=mask, normalizer="sparsemax")

    for lengths in ([37, 20], [5, 0]):
        mask = padding(np.array(lengths)) & causal() & local(9, 0)
        ref = np_attention(q, k, v, cot, dense_allowed(mask, tq, tk), "sparsemax")
        np.testing.assert_allclose(fn(q, k, v, jnp.array(lengths)), ref["out"], **TOL)


def test_bfloat16_inputs():
    cfg = CONFIGS["self"]
    _, tq, tk, _, _, _, _, bq, bkv = cfg
    q, k, v, cot = inputs(cfg)
    layout = (causal() & local(5, 0)).blocks(tq, tk, bq, bkv)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, layout, normalizer="entmax15"))(
        *low
    )
    assert out.dtype == jnp.bfloat16
    ref = np_attention(*low, cot, dense_allowed(causal() & local(5, 0), tq, tk), "entmax15")
    np.testing.assert_allclose(np.asarray(out, np.float32), ref["out"], atol=3e-2)


# ----------------------------------------------------------------------------------------------
# Cost and memory follow the mask.


def test_memory_follows_the_mask():
    b, t, n, d = 1, 2048, 2, 32
    x = jax.ShapeDtypeStruct((b, t, n, d), jnp.float32)
    mask = causal() & local(64, 0)
    layout = mask.blocks(t, t, 64, 64)  # K = 2 key blocks of 64 per query block
    allowed = jnp.asarray(mask.dense(t, t))

    def sparse(q, k, v):
        return blocksparse_attention(q, k, v, layout)

    def dense(q, k, v):  # the dense masked softmax path
        s = jnp.einsum("bqnd,bknd->bnqk", q, k) * d**-0.5
        return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, where=allowed), v)

    def grads(fn):
        return jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))

    def temp_bytes(fn):
        return jax.jit(fn).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    for fn_sparse, fn_dense in ((sparse, dense), (grads(sparse), grads(dense))):
        sparse_bytes, dense_bytes = temp_bytes(fn_sparse), temp_bytes(fn_dense)
        # Dense holds [B, N, T, T] floats (32 MiB each); the kernel [B, N, T, K·bkv] ones.
        assert sparse_bytes < dense_bytes / 4, (sparse_bytes, dense_bytes)
        assert sparse_bytes < 16 * b * n * t * 128 * 4, sparse_bytes


def test_steps_bound_the_memory():
    x = jax.ShapeDtypeStruct((1, 1024, 2, 16), jnp.float32)
    layout = causal().blocks(1024, 1024, 64, 64)  # 16 query blocks, K = 16 key blocks

    def temp_bytes(steps):
        def loss(q, k, v):
            out = blocksparse_attention(
                q, k, v, layout, normalizer="sparsemax", query_blocks_per_step=steps
            )
            return out.sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    # One query block per step never holds the whole score matrix [heads, n, n] (float32);
    # all 16 at once hold at least two such arrays (scores and their cotangent).
    scores = 2 * 1024 * 1024 * 4
    one, all_ = temp_bytes(1), temp_bytes(16)
    assert one < scores <= 2 * scores <= all_, (one, all_, scores)


def test_cost():
    layout = (causal() & local(5, 0)).blocks(37, 37, 8, 8)  # 5 query blocks, 9 kept, K = 2
    cost = blocksparse_cost(layout, batch=2, num_heads=3, head_dim=8, head_dim_v=4)
    assert cost.computed_scores == 2 * 3 * 5 * 2 * 64
    assert cost.kept_scores == 2 * 3 * 9 * 64
    assert cost.dense_scores == 2 * 3 * 37 * 37
    assert cost.flops == 2 * cost.computed_scores * 12
    ph = per_head([causal(), local(0, 0)]).blocks(16, 16, 8, 8)  # kept: 3 + 2 blocks
    assert blocksparse_cost(ph, batch=1, num_heads=2, head_dim=4).kept_scores == 5 * 64
    # Heads with different layouts run as separate groups: nothing padded to the widest head.
    assert blocksparse_cost(ph, batch=1, num_heads=2, head_dim=4).computed_scores == 5 * 64


def test_per_head_groups_return_weights_in_head_order():
    cfg = CONFIGS["gqa"]
    _, tq, tk, _, _, _, _, bq, bkv = cfg
    q, k, v, _ = inputs(cfg, seed=2)
    mask = per_head([causal(), causal() & local(3, 0), causal(), sink(1) & causal()])
    layout = mask.blocks(tq, tk, bq, bkv)
    # jitted: one compilation instead of op-by-op dispatch of every head group (much faster)
    out, w = jax.jit(lambda *a: blocksparse_attention(*a, layout, return_weights=True))(q, k, v)
    from sparse_jax.dispatch import attention

    ref_out, ref_w = attention(q, k, v, mask=mask, impl="xla", return_weights=True)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(w, ref_w, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Errors.


def test_bad_arguments_raise_before_tracing():
    q, k, v, _ = inputs(CONFIGS["self"])
    layout = causal().blocks(37, 37, 8, 8)
    cases = [
        ({"layout": causal().blocks(36, 37, 8, 8)}, ValueError, r"\(q_len, kv_len\)"),
        ({"layout": np.ones((37, 37), bool)}, TypeError, "BlockLayout"),
        ({"layout": per_head([causal()] * 3).blocks(37, 37, 8, 8)}, ValueError, "3 heads"),
        ({"normalizer": "softmin"}, ValueError, "unknown `normalizer`"),
        ({"normalizer": 0.5}, ValueError, "must be finite and >= 1"),
        ({"normalizer": jnp.ones(3) * 1.5}, ValueError, "shape"),
        ({"normalizer": jnp.array([1.5, 0.5])}, ValueError, ">= 1"),
        ({"normalizer": True}, TypeError, "normalizer"),
        ({"bias": jnp.zeros((2, 37))}, ValueError, "bias"),
        ({"bias": jnp.zeros((37, 37), int)}, TypeError, "bias"),
        ({"scale": "x"}, TypeError, "scale"),
        ({"query_blocks_per_step": 0}, ValueError, "query_blocks_per_step"),
        ({"mask": np.ones((37, 37), bool)}, TypeError, "mask"),
        ({"return_weights": "yes"}, TypeError, "return_weights"),
    ]
    for kwargs, error, text in cases:
        kwargs = {"layout": layout, **kwargs}
        with pytest.raises(error, match=text):
            blocksparse_attention(q, k, v, **kwargs)
    dynamic = padding(np.array([3, 4])) & causal()
    with pytest.raises(ValueError, match="dynamic"):
        blocksparse_attention(q, k, v, dynamic.blocks(37, 37, 8, 8))
    other_batch = padding(np.array([3, 4, 5])) & causal()
    with pytest.raises(ValueError, match="batch size 3"):
        blocksparse_attention(q, k, v, other_batch.blocks(37, 37, 8, 8), mask=other_batch)
    k3, v3 = jnp.repeat(k[:, :, :1], 3, 2), jnp.repeat(v[:, :, :1], 3, 2)
    with pytest.raises(ValueError, match="divide"):
        blocksparse_attention(q, k3, v3, layout)
    with pytest.raises(TypeError, match="same dtype"):
        blocksparse_attention(q, k.astype(jnp.bfloat16), v, layout)
