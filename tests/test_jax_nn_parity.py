"""``sparse_jax.attention(normalizer="softmax")`` as a drop-in for ``jax.nn.dot_product_attention``.

Cases modelled on jax's own ``tests/nn_test.py`` (``testDotProductAttention``,
``testDotProductAttentionMask``: the same mask modes, dtypes and tolerances, smaller shapes),
compared with ``jax.nn.dot_product_attention`` (its XLA implementation) in values and gradients,
on every engine that takes the call, the whole module under ``jax.numpy_rank_promotion("raise")``;
then ``jax.debug_infs``, half-precision gradients over query chunks, and the keywords
(``is_causal``, ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size``,
``return_residual``, rank-3 inputs) with their errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import attention, attention_impl, masks
from tests.engines import assert_engine, engines_used

B, T, N, H = 2, 32, 4, 16
BLOCK = (16, 16)


@pytest.fixture(autouse=True)
def _rank_promotion_raises():
    with jax.numpy_rank_promotion("raise"):
        yield


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _check_engine(engine, fn, *args, runtime=False):
    """The engine that ran. The dense engine looks up run-time masks (padding lengths, segment
    ids) with gathers, which assert_engine reads as block gathers: for those only its scope."""
    if engine == "xla" and runtime:
        assert engines_used(fn, *args) == {"xla"}
    else:
        assert_engine(engine, fn, *args)


def _close(got, want, tol):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )


# ----------------------------------------------------------------------------------------------
# jax's testDotProductAttention: GQA, bfloat16, with and without vmap (rank-3 inputs inside).


@pytest.mark.parametrize("group,use_vmap", [(1, False), (2, True), (4, False)])
def test_dot_product_attention_gqa(group, use_vmap):
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    q = _normal(keys[0], (B, T, N, H), dtype)
    k = _normal(keys[1], (B, T, N // group, H), dtype)
    v = _normal(keys[2], (B, T, N // group, H), dtype)
    grad = _normal(keys[3], (B, T, N, H), dtype)
    ours = functools.partial(attention, impl="xla")
    if use_vmap:  # each call sees [seq, heads, head_dim], as in jax's test
        ours = jax.vmap(ours)
    k_ref, v_ref = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    out_ref, vjp_ref = jax.vjp(jax.nn.dot_product_attention, q, k_ref, v_ref)
    out, vjp = jax.vjp(ours, q, k, v)
    dq_ref, dk_ref, dv_ref = vjp_ref(grad)
    dq, dk, dv = vjp(grad)
    dk_ref = dk_ref.reshape(B, T, N // group, group, H).sum(axis=3)
    dv_ref = dv_ref.reshape(B, T, N // group, group, H).sum(axis=3)
    assert out.dtype == dtype and out.shape == q.shape
    for got, want in ((out, out_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        _close(got, want, 0.01)
    assert_engine("xla", ours, q, k, v)


# ----------------------------------------------------------------------------------------------
# jax's testDotProductAttentionMask: every mask mode, every engine that takes it.

_MODES = [
    "bias",
    "causal",
    "padding",
    "custom",
    ("causal", "padding"),
    ("custom", "padding"),
    ("bias", "causal"),
    ("causal", "sliding_window"),
]


def _mask_case(mode):
    mode = (mode,) if isinstance(mode, str) else mode
    keys = jax.random.split(jax.random.key(1), 5)
    dtype = jnp.bfloat16
    q, k, v, grad = (_normal(keys[i], (B, T, N, H), dtype) for i in range(4))
    kwargs = {"is_causal": "causal" in mode}
    bias = mask = None
    if "padding" in mode:
        kwargs["query_seq_lengths"] = jnp.array([T // 2, T // 4], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.array([T // 4, T // 2], jnp.int32)
    if "custom" in mode:
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if "bias" in mode:
        bias = _normal(keys[4], (1, N, T, T), dtype)
    if "sliding_window" in mode:
        kwargs["local_window_size"] = (3, 2) if "causal" in mode else (3, 0)
    return mode, (q, k, v, bias, grad), mask, kwargs


def _engines(mode):
    if "custom" in mode or mode == ("bias",):  # a bool array or no mask: the dense engine
        return ["xla"]
    if mode == ("padding",):  # the kernels' run-time leaves: with ("causal", "padding")
        return ["xla"]
    # The Pallas kernel runs in interpret mode on CPU (slow): one mode with run-time leaves.
    pallas = ["pallas"] if mode == ("causal", "padding") else []
    return ["xla", "blocksparse", *pallas]


@pytest.mark.parametrize("mode", _MODES, ids=str)
def test_dot_product_attention_mask(mode):
    mode, (q, k, v, bias, grad), mask, kwargs = _mask_case(mode)

    def ref(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias, mask, **kwargs)

    out_ref, vjp_ref = jax.vjp(ref, q, k, v, bias)
    grads_ref = vjp_ref(grad)
    for engine in _engines(mode):

        def ours(q, k, v, bias, engine=engine):
            return attention(q, k, v, bias=bias, mask=mask, impl=engine, block_size=BLOCK, **kwargs)

        out, vjp = jax.vjp(ours, q, k, v, bias)
        grads = vjp(grad)
        _close(out, out_ref, 0.01)
        for got, want, tol in zip(grads, grads_ref, (0.02, 0.02, 0.01, 0.02), strict=True):
            if want is not None:
                _close(got, want, tol)
        _check_engine(engine, ours, q, k, v, bias, runtime="padding" in mode)


def test_auto_takes_xla_for_a_bool_mask_beside_keywords():
    _, (q, k, v, _, _), mask, kwargs = _mask_case(("custom", "padding"))
    choice = attention_impl(q, k, v, mask=mask, block_size=BLOCK, **kwargs)
    assert choice.impl == "xla", choice
    _check_engine(
        "xla", lambda q: attention(q, k, v, mask=mask, block_size=BLOCK, **kwargs), q, runtime=True
    )


# jax's testDotProductAttentionBiasGradient: x as q, k and v, a bias per batch element, a
# [1, 1, S] mask, under vmap (rank-3 inputs and a rank-3 bias inside) and jit.
def test_bias_gradient_under_vmap():
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(5), 2)
    x = _normal(keys[0], (B, T, N, H), dtype)
    bias = _normal(keys[1], (B, N, T, T), dtype)
    mask = jnp.ones((1, 1, T), bool)

    def ref(x, bias):
        return jax.nn.dot_product_attention(x, x, x, bias, mask)

    def ours(x, bias):
        return attention(x, x, x, bias=bias, mask=mask, impl="xla")

    batched = jax.jit(jax.vmap(ours, in_axes=(0, 0)))
    _close(batched(x, bias), jax.vmap(ref)(x, bias), 0.01)
    grad_ref = jax.jit(jax.vjp(ref, x, bias)[1])(x)
    grad = jax.jit(jax.vjp(jax.vmap(ours), x, bias)[1])(x)
    _close(grad[0], grad_ref[0], 0.02)
    _close(grad[1], grad_ref[1], 0.1)


# ----------------------------------------------------------------------------------------------
# jax.debug_infs: masking makes no infinite value that an eager call's checks would see.


@pytest.mark.parametrize(
    "engine,normalizer,empty,block",
    [
        ("xla", "softmax", True, BLOCK),
        ("blocksparse", "softmax", True, BLOCK),
        ("xla", "sparsemax", True, BLOCK),
        ("pallas", "softmax", True, BLOCK),
        ("pallas", "sparsemax", True, BLOCK),
        ("pallas", "entmax15", True, BLOCK),
        # The default blocks, larger than the sequence: the kernels' padded rows see no key.
        ("pallas", "softmax", False, (128, 128)),
    ],
)
def test_debug_infs_masked_call(engine, normalizer, empty, block):
    keys = jax.random.split(jax.random.key(2), 3)
    q, k, v = (_normal(key, (B, T, N, H), jnp.float32) for key in keys)
    lengths = np.array([0 if empty else 5, T // 2])  # 0: every row of batch element 0 masked

    def f(q, k, v):
        mask = masks.causal() & masks.padding(lengths)
        return attention(q, k, v, mask=mask, impl=engine, normalizer=normalizer, block_size=block)

    with jax.debug_infs(True):
        out = f(q, k, v)  # eagerly: every primitive outside a compiled call is checked
        grads = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    if empty:  # fully masked rows: zeros, no NaN, in values and gradients
        np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
        np.testing.assert_array_equal(np.asarray(grads[0][0]), 0.0)


# ----------------------------------------------------------------------------------------------
# Half-precision gradients over query chunks: the chunks' dK/dV add up in float32.


@pytest.mark.parametrize(
    "engine,kwargs",
    [("xla", {"query_chunk": 8}), ("blocksparse", {"block_size": (8, 8), "mask": masks.full()})],
)
def test_bf16_gradients_over_pieces_as_accurate_as_one_chunk(engine, kwargs):
    # 8 query chunks of 8 rows, or 8 x 8 blocks: each piece adds to dK/dV.
    keys = jax.random.split(jax.random.key(3), 4)
    q, k, v, g = (_normal(key, (1, 64, 2, 32), jnp.bfloat16) for key in keys)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, g)]
    _, vjp = jax.vjp(jax.nn.dot_product_attention, *f32[:3])
    exact = vjp(f32[3])

    def errors(**kw):
        _, vjp = jax.vjp(functools.partial(attention, **kw), q, k, v)
        return [
            float(jnp.abs(a.astype(jnp.float32) - b).max())
            for a, b in zip(vjp(g), exact, strict=True)
        ]

    whole, pieces = errors(impl="xla"), errors(impl=engine, **kwargs)
    for name, one, many in zip(("dq", "dk", "dv"), whole, pieces, strict=True):
        assert many <= 1.1 * one, f"{name}: {many} in pieces, {one} in one chunk"


# ----------------------------------------------------------------------------------------------
# The keywords.


def _qkv(dtype=jnp.float32, seed=4):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [_normal(key, (B, T, N, H), dtype) for key in keys]


@pytest.mark.parametrize("chunk", [None, 8])
def test_return_residual_is_jax_log_sum_exp(chunk):
    q, k, v = _qkv()
    kwargs = {"is_causal": True, "key_value_seq_lengths": jnp.array([5, T], jnp.int32)}
    out_ref, lse_ref = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    out, lse = attention(q, k, v, return_residual=True, query_chunk=chunk, **kwargs)
    assert lse.shape == (B, T, N) and lse.dtype == q.dtype
    _close(out, out_ref, 1e-5)
    _close(lse, lse_ref, 1e-5)
    _check_engine(
        "xla", lambda q: attention(q, k, v, return_residual=True, **kwargs), q, runtime=True
    )


def test_rank3_inputs_and_residual():
    q, k, v = (x[0] for x in _qkv())
    out_ref, lse_ref = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=4, return_residual=True
    )
    out, lse = attention(q, k, v, is_causal=True, local_window_size=4, return_residual=True)
    assert out.shape == (T, N, H) and lse.shape == (T, N)
    _close(out, out_ref, 1e-5)
    _close(lse, lse_ref, 1e-5)
    weights = attention(q, k, v, is_causal=True, return_weights=True)[1]
    assert weights.shape == (N, T, T)


def test_keywords_are_the_mask_algebra_for_sparse_normalizers():
    q, k, v = _qkv()
    lengths = np.array([7, 20])
    by_keyword = attention(
        q,
        k,
        v,
        normalizer="sparsemax",
        is_causal=True,
        local_window_size=(5, 0),
        key_value_seq_lengths=lengths,
        impl="blocksparse",
        block_size=BLOCK,
    )
    mask = masks.causal() & masks.local(5, 0) & masks.padding(lengths)
    by_mask = attention(q, k, v, normalizer="sparsemax", mask=mask, impl="xla")
    _close(by_keyword, by_mask, 1e-5)
    # is_causal with a mask that is already causal: the same mask.
    again = attention(q, k, v, mask=masks.causal(), is_causal=True, normalizer="sparsemax")
    _close(again, attention(q, k, v, mask=masks.causal(), normalizer="sparsemax"), 0)


def test_query_seq_lengths_zero_rows_under_jit():
    q, k, v = _qkv()

    @jax.jit
    def f(q, lengths):
        return attention(q, k, v, query_seq_lengths=lengths, impl="blocksparse", block_size=BLOCK)

    out = f(q, jnp.array([3, 0], jnp.int32))  # traced lengths
    np.testing.assert_array_equal(np.asarray(out[0, 3:]), 0.0)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    ref = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3, 0], jnp.int32))
    _close(out, ref, 1e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"is_causal": 1}, TypeError, r"`is_causal` must be a bool"),
        ({"query_seq_lengths": np.array([3])}, ValueError, r"`query_seq_lengths` must have shape"),
        (
            {"key_value_seq_lengths": np.array([3, -1])},
            ValueError,
            r"`key_value_seq_lengths`.*>= 0",
        ),
        ({"key_value_seq_lengths": np.array([3.0, 1.0])}, TypeError, r"`key_value_seq_lengths`"),
        ({"local_window_size": (1, 2, 3)}, TypeError, r"`local_window_size` must be an int"),
        ({"local_window_size": -1}, ValueError, r"local_window_size\[0\]"),
        ({"local_window_size": "wide"}, TypeError, r"`local_window_size`"),
        (
            {"return_residual": True, "normalizer": "sparsemax"},
            ValueError,
            r"return_residual=True .*normalizer='sparsemax'",
        ),
        (
            {"return_residual": True, "impl": "blocksparse", "mask": masks.causal()},
            ValueError,
            r"return_residual=True .*impl='blocksparse' does not compute it",
        ),
        ({"return_residual": True, "return_weights": True}, ValueError, r"cannot be combined"),
        ({"return_residual": "yes"}, TypeError, r"`return_residual` must be a bool"),
        (
            {"mask": jnp.ones((T, T), bool), "is_causal": True, "impl": "blocksparse"},
            ValueError,
            r"impl='blocksparse' takes one sparse_jax.masks.Mask",
        ),
    ],
)
def test_keyword_errors_name_the_argument(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        attention(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        attention_impl(q, k, v, **{a: b for a, b in kwargs.items()})
