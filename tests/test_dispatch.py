"""Tests of sparse_jax.dispatch: the query-chunked XLA path against a naive dense reference
(values and gradients), masks, GQA/MQA, cross-attention, fully masked rows, low precision,
the flax adapter, argument errors and the memory bound of the chunking."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_jax as sj
from sparse_jax.dispatch import ImplChoice, attention, attention_fn, attention_impl
from sparse_jax.masks import causal, from_array, local, padding, per_head, sink, strided
from tests.conftest import jit_fast
from tests.engines import assert_engine, traced_equations

CHUNK = 4  # small query chunk: Tq = 13 gives 4 chunks and 3 padded rows

# name: (batch, q_len, kv_len, query heads, key heads, head_dim, value head_dim)
CONFIGS = {
    "self": (2, 13, 13, 2, 2, 8, 8),
    "cross": (2, 13, 7, 2, 2, 8, 6),
    "gqa": (2, 13, 13, 4, 2, 8, 8),
    "mqa": (2, 13, 9, 3, 1, 8, 5),
}
NORMALIZERS = ["softmax", "sparsemax", "entmax15", "alpha_1.3", "alpha_per_head"]
MASKS = ["none", "causal", "causal_local", "array", "padding"]


# ----------------------------------------------------------------------------------------------
# The naive reference: whole score matrix, einsum, mask, normalizer, einsum.


def naive_attention(q, k, v, allowed, normalizer, alpha=None, bias=None):
    """Dense attention on the full [B, N, Tq, Tk] scores; allowed broadcasts to them."""
    n, kh, h = q.shape[2], k.shape[2], q.shape[3]
    k = jnp.repeat(k, n // kh, axis=2)  # query head i reads key head i // (N // K)
    v = jnp.repeat(v, n // kh, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * h**-0.5
    if bias is not None:
        s = s + bias
    allowed = jnp.broadcast_to(allowed, s.shape)
    if normalizer == "softmax":
        p = jax.nn.softmax(s, axis=-1, where=allowed)  # zeros on fully masked rows
    elif normalizer == "sparsemax":
        p = sj.sparsemax(s, where=allowed)
    elif normalizer == "entmax15":
        p = sj.entmax15(s, where=allowed)
    elif normalizer == "alpha_1.3":
        p = sj.entmax(s, 1.3, where=allowed)
    else:
        p = sj.entmax(s, alpha[:, None], where=allowed)
    return jnp.einsum("bnqk,bknh->bqnh", p, v), p


def _normalizer_arg(name, alpha):
    return {"alpha_1.3": 1.3, "alpha_per_head": alpha}.get(name, name)


def _inputs(config, seed=0, dtype=jnp.float32):
    b, tq, tk, n, kh, h, hv = CONFIGS[config] if isinstance(config, str) else config
    keys = jax.random.split(jax.random.key(seed), 4)
    q = 2.0 * jax.random.normal(keys[0], (b, tq, n, h), dtype)
    k = 2.0 * jax.random.normal(keys[1], (b, tk, kh, h), dtype)
    v = jax.random.normal(keys[2], (b, tk, kh, hv), dtype)
    ct = jax.random.normal(keys[3], (b, tq, n, hv), jnp.float32)  # output cotangent
    alpha = jnp.linspace(1.25, 2.5, n, dtype=jnp.float32)
    return q, k, v, ct, alpha


def _mask(kind, b, n, tq, tk, seed=0):
    """(mask argument, dense bool [B or 1, N or 1, Tq, Tk])."""
    if kind == "none":
        return None, np.ones((1, 1, tq, tk), bool)
    if kind == "causal":
        return causal(), causal().dense(tq, tk)[None, None]
    if kind == "causal_local":  # rows i >= kv_len + 3 of cross-attention are fully masked
        m = causal() & local(3, 0)
        return m, m.dense(tq, tk)[None, None]
    if kind == "array":
        arr = np.random.default_rng(seed).random((b, 1, tq, tk)) < 0.6
        return jnp.asarray(arr), arr
    m = padding(np.array([tk, 3])[:b])
    return m, np.asarray(m.dense(tq, tk))[:, None]


def _close(actual, expected, tol=1e-5):
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol * scale)


def _value_and_grads(fn, q, k, v, alpha, ct):
    out, vjp = jax.vjp(fn, q, k, v, alpha)
    return out, vjp(ct)


# ----------------------------------------------------------------------------------------------
# Values and gradients against the reference.


def _grid(config_index):
    """(normalizer, mask) pairs tested for one config: two masks per normalizer, rotated with the
    config so that every (normalizer, config), (normalizer, mask) and (config, mask) pair occurs
    (pairwise coverage of the 5 x 4 x 5 product at 40 of its 100 cases)."""
    return [
        (norm, MASKS[(i + config_index + shift) % len(MASKS)])
        for i, norm in enumerate(NORMALIZERS)
        for shift in (0, len(MASKS) - 1)
    ]


def test_grid_covers_every_pair():
    cases = {(n, c, m) for ci, c in enumerate(CONFIGS) for n, m in _grid(ci)}
    assert {(n, m) for n, _, m in cases} == {(n, m) for n in NORMALIZERS for m in MASKS}
    assert {(c, m) for _, c, m in cases} == {(c, m) for c in CONFIGS for m in MASKS}
    assert {(n, c) for n, c, _ in cases} == {(n, c) for n in NORMALIZERS for c in CONFIGS}


@pytest.mark.parametrize("config_index", range(len(CONFIGS)), ids=list(CONFIGS))
def test_matches_naive_reference_values_and_gradients(config_index):
    config = list(CONFIGS)[config_index]
    q, k, v, ct, alpha = _inputs(config)
    b, tq, tk, n = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    cases = _grid(config_index)

    def all_cases(q, k, v, alpha):
        results = []
        for normalizer, kind in cases:
            mask, dense = _mask(kind, b, n, tq, tk)

            def ours(q, k, v, alpha, mask=mask, normalizer=normalizer):
                norm = _normalizer_arg(normalizer, alpha)
                return attention(q, k, v, mask=mask, normalizer=norm, query_chunk=CHUNK)

            def ref(q, k, v, alpha, dense=dense, normalizer=normalizer):
                return naive_attention(q, k, v, jnp.asarray(dense), normalizer, alpha)[0]

            results.append(
                (
                    _value_and_grads(ours, q, k, v, alpha, ct),
                    _value_and_grads(ref, q, k, v, alpha, ct),
                )
            )
        return results

    for (normalizer, kind), ((out, grads), (ref_out, ref_grads)) in zip(
        cases, jit_fast(all_cases, q, k, v, alpha), strict=True
    ):
        where = f"normalizer={normalizer}, mask={kind}"
        assert out.shape == (b, tq, n, v.shape[3]) and out.dtype == q.dtype, where
        for name, x, rx in zip(
            "out dq dk dv dalpha".split(), (out, *grads), (ref_out, *ref_grads), strict=True
        ):
            try:
                _close(x, rx)
            except AssertionError as e:
                raise AssertionError(f"{where}: {name}") from e
        if normalizer == "alpha_per_head":
            assert np.abs(np.asarray(grads[3])).min() > 0, where  # every head's α is learned


@pytest.mark.parametrize("normalizer", ["softmax", "alpha_per_head"])
def test_bias_weights_and_chunk_sizes(normalizer):
    q, k, v, ct, alpha = _inputs("gqa", seed=1)
    b, tq, n, tk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    rng = np.random.default_rng(1)
    bias = jnp.asarray(rng.normal(size=(b, n, tq, tk)), jnp.float32)
    bias_row = jnp.asarray(rng.normal(size=(1, n, 1, tk)), jnp.float32)  # broadcast over q
    mask_row = jnp.asarray(rng.random((1, 1, 1, tk)) < 0.7)  # broadcast over q
    causal_dense = jnp.asarray(causal().dense(tq, tk))[None, None]
    # A Mask and a bool array cannot both go through `mask`: the causal part is given as a
    # -inf bias (which must act as masked) and the row mask as the array.
    neg = jnp.where(causal_dense, 0.0, -jnp.inf)

    def run(q, k, v, alpha, bias):
        norm = _normalizer_arg(normalizer, alpha)
        outs = [
            attention(
                q,
                k,
                v,
                mask=mask_row,
                bias=bias + bias_row + neg,
                normalizer=norm,
                query_chunk=chunk,
                return_weights=True,
            )
            for chunk in (1, 5, None)  # 13 chunks of 1 row; 3 of 5 (2 padded); one chunk
        ]
        ref = naive_attention(q, k, v, causal_dense & mask_row, normalizer, alpha, bias + bias_row)

        # Gradient with respect to a per-query bias (sliced chunk by chunk).
        def ours_loss(bias):
            out = attention(q, k, v, mask=causal(), bias=bias, normalizer=norm, query_chunk=CHUNK)
            return jnp.sum(out * ct)

        def ref_loss(bias):
            return jnp.sum(naive_attention(q, k, v, causal_dense, normalizer, alpha, bias)[0] * ct)

        return outs, ref, jax.grad(ours_loss)(bias), jax.grad(ref_loss)(bias)

    outs, (ref_out, ref_p), grad, ref_grad = jit_fast(run, q, k, v, alpha, bias)
    for out, p in outs:
        assert p.shape == (b, n, tq, tk)
        _close(out, ref_out)
        _close(p, ref_p)
    _close(grad, ref_grad)


def test_per_head_mask_decoding_offset_and_from_array():
    q, k, v, _, _ = _inputs("self", seed=2)
    tq, tk = q.shape[1], k.shape[1]
    m = per_head([causal(), local(1, 1)])
    arr = np.random.default_rng(0).random((20, 20)) < 0.5  # larger than needed: top-left corner
    t = 9  # one decoding step at position t: query row 0 is absolute position t

    def run(q, k, v):
        return (
            attention(q, k, v, mask=m, normalizer="sparsemax", query_chunk=CHUNK),
            naive_attention(q, k, v, jnp.asarray(m.dense(tq, tk))[None], "sparsemax")[0],
            attention(q[:, t : t + 1], k, v, mask=causal().with_offset(t), normalizer="entmax15"),
            attention(q, k, v, mask=causal(), normalizer="entmax15", query_chunk=CHUNK),
            attention(q, k, v, mask=from_array(arr), query_chunk=CHUNK),
            naive_attention(q, k, v, jnp.asarray(arr[:tq, :tk]), "softmax")[0],
        )

    per_head_out, per_head_ref, step, full_out, arr_out, arr_ref = jit_fast(run, q, k, v)
    _close(per_head_out, per_head_ref)
    _close(step, full_out[:, t : t + 1])
    _close(arr_out, arr_ref)


def test_under_jit_with_traced_padding_lengths_and_learned_alpha():
    q, k, v, ct, alpha = _inputs("mqa", seed=3)
    tq, tk = q.shape[1], k.shape[1]

    def run(q, alpha, lengths, dense):
        def loss(q, alpha):  # the padding mask is built from traced lengths
            out = attention(q, k, v, mask=causal() & padding(lengths), normalizer=alpha)
            return jnp.sum(out * ct)

        def ref(q, alpha):
            return jnp.sum(naive_attention(q, k, v, dense[:, None], "alpha", alpha)[0] * ct)

        grad = jax.value_and_grad
        return grad(loss, argnums=(0, 1))(q, alpha), grad(ref, argnums=(0, 1))(q, alpha)

    dense = jnp.asarray((causal() & padding(np.array([5, 9]))).dense(tq, tk))
    (value, grads), (ref_value, ref_grads) = jit_fast(run, q, alpha, jnp.array([5, 9]), dense)
    _close(value, ref_value)
    for g, rg in zip(grads, ref_grads, strict=True):
        _close(g, rg)


# ----------------------------------------------------------------------------------------------
# Fully masked rows, precision.


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_fully_masked_rows_give_zero_output_and_zero_finite_gradients(normalizer):
    q, k, v, ct, alpha = _inputs("gqa", seed=4)
    b, tq, n, tk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    arr = np.ones((b, n, tq, tk), bool)
    arr[0, :, 2] = False  # a fully masked row in every head
    arr[1, 1, 7:] = False  # rows 7.. of one head (spread over two chunks)
    bias = np.zeros((b, n, tq, tk), np.float32)
    bias[1, 0, 3] = -np.inf  # allowed, but every score is -inf: also empty
    empty = (~arr | np.isneginf(bias)).all(-1)  # [B, N, Tq]

    def run(q, k, v, alpha, bias):
        norm = _normalizer_arg(normalizer, alpha)

        def ours(q, k, v, alpha, bias):
            norm = _normalizer_arg(normalizer, alpha)
            return attention(
                q, k, v, mask=jnp.asarray(arr), bias=bias, normalizer=norm, query_chunk=CHUNK
            )

        out, vjp = jax.vjp(ours, q, k, v, alpha, bias)
        _, weights = attention(
            q, k, v, mask=jnp.asarray(arr), bias=bias, normalizer=norm, return_weights=True
        )
        # A padding length of 0 empties a whole batch element.
        padded = attention(q, k, v, mask=padding(np.array([0, tk])), normalizer=norm)
        return out, vjp(ct), weights, padded

    out, grads, w, padded = jit_fast(run, q, k, v, alpha, jnp.asarray(bias))
    assert (np.moveaxis(np.asarray(out), 2, 1)[empty] == 0).all()
    for g in (out, *grads, w, padded):
        assert np.isfinite(np.asarray(g)).all()
    assert (np.moveaxis(np.asarray(grads[0]), 2, 1)[empty] == 0).all()  # dq of empty rows
    assert (np.asarray(grads[4])[empty] == 0).all()  # dbias of empty rows
    np.testing.assert_array_equal(np.asarray(w)[empty], 0.0)
    np.testing.assert_allclose(np.asarray(w)[~empty].sum(-1), 1.0, rtol=1e-5)
    assert (np.asarray(padded[0]) == 0).all() and (np.abs(np.asarray(padded[1])) > 0).any()


@pytest.mark.parametrize(
    ("dtype", "normalizer"),
    [(jnp.bfloat16, "softmax"), (jnp.bfloat16, "alpha_per_head"), (jnp.float16, "sparsemax")],
)
def test_low_precision_round_trip(dtype, normalizer):
    q, k, v, ct, alpha = _inputs("gqa", seed=5)

    def run(q, k, v, alpha):
        norm = _normalizer_arg(normalizer, alpha)

        def f(q, k, v):
            return attention(q, k, v, mask=causal(), normalizer=norm, query_chunk=CHUNK)

        lo = [x.astype(dtype) for x in (q, k, v)]
        same = [x.astype(jnp.float32) for x in lo]  # the rounded inputs, in float32
        weights = attention(*lo, mask=causal(), normalizer=norm, return_weights=True)[1]
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct)
        grad = jax.grad(loss, argnums=(0, 1, 2))
        return f(q, k, v), f(*lo), weights, grad(*lo), grad(*same)

    ref, out, w, grads, ref_grads = jit_fast(run, q, k, v, alpha)
    assert out.dtype == dtype and w.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.1, rtol=0.05)
    # The gradients against float32 on the same (rounded) inputs: scores and weights are
    # computed in float32 inside, so what is left is rounding to the low-precision dtype on the
    # way in and out of the products: measured at most 0.8 (bfloat16) and 0.6 (float16) of the
    # dtype's eps times the largest gradient; 3 eps leaves room for TF32 references on a GPU.
    for name, g, want in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == dtype, name
        atol = 3 * float(jnp.finfo(dtype).eps) * float(np.abs(want).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), want, rtol=0, atol=atol, err_msg=name)


# ----------------------------------------------------------------------------------------------
# Dispatch, flax adapter, docs.


def test_attention_impl_reports_choice(monkeypatch):
    q, k, v, _, _ = _inputs("self")
    # on this machine: the engine the program runs is the one reported (a GPU's: pallas)
    sparse = functools.partial(attention, k=k, v=v, mask=causal(), normalizer="sparsemax")
    assert_engine(attention_impl(q, k, v, mask=causal(), normalizer="sparsemax").impl, sparse, q)
    _close(attention(q, k, v, impl="xla"), attention(q, k, v, impl="auto"))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the CPU's policy, anywhere
    choice = attention_impl(q, k, v, mask=causal(), normalizer="sparsemax")
    assert isinstance(choice, ImplChoice) and choice.impl == "xla"
    assert "auto" in choice.reason and "block-sparse" in choice.reason
    assert attention_impl(q, k, v, impl="xla").reason.startswith("impl='xla'")
    abstract = jax.ShapeDtypeStruct(q.shape, q.dtype)
    assert attention_impl(abstract, abstract, abstract).impl == "xla"
    assert_engine("xla", lambda q: attention(q, k, v, impl="auto"), q)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15", 1.25])
@pytest.mark.parametrize("impl", ["xla", "blocksparse", "auto"])
def test_attention_fn_runs_the_engine_it_is_asked_for(normalizer, impl):
    # The adapter is compared with attention() under a window|sink mask whose effect is visible
    # (a third of the causal entries are cut), with flax's own per-call mask cutting one more
    # key per batch row, and the engine in the traced program must be the one asked for.
    q, k, v, _, _ = _inputs((2, 32, 32, 2, 2, 4, 4))
    pattern = causal() & (local(5, 0) | sink(2))
    flax_mask = jnp.ones((2, 1, 32, 32), bool).at[0, :, :, 3].set(False).at[1, :, :, 7].set(False)
    fn = attention_fn(normalizer, mask=pattern, impl=impl, block_size=(8, 8))
    want = attention(q, k, v, mask=pattern, normalizer=normalizer, impl="xla")
    cut = attention(
        q, k, v, mask=pattern, bias=jnp.where(flax_mask, 0.0, -jnp.inf), normalizer=normalizer
    )
    dense = attention(q, k, v, mask=causal(), normalizer=normalizer, impl="xla")
    assert float(jnp.abs(want - dense).max()) > 1e-2  # the window matters
    assert float(jnp.abs(want - cut).max()) > 1e-2  # and so does flax's mask
    _close(fn(q, k, v), want)
    _close(fn(q, k, v, mask=flax_mask), cut)
    engine = "blocksparse" if impl == "auto" else impl  # 28% of the blocks of 8: block-sparse
    assert_engine(engine, fn, q, k, v)
    assert_engine(engine, fn, q, k, v, mask=flax_mask)
    grad = jax.grad(lambda q: jnp.sum(fn(q, k, v, mask=flax_mask) ** 2))
    assert_engine(engine, grad, q)


def test_attention_fn_splash_engine():
    q, k, v, _, _ = _inputs((1, 128, 128, 2, 2, 8, 8))
    fn = attention_fn("softmax", mask=causal() & local(31, 0), impl="splash")
    _close(fn(q, k, v), attention(q, k, v, mask=causal() & local(31, 0), impl="xla"))
    assert_engine("splash", fn, q, k, v)
    with pytest.raises(ValueError, match="impl='splash' does not take"):
        fn(q, k, v, mask=jnp.ones((1, 1, 128, 128), bool))


def test_attention_engine_assertions_fail_closed():
    q, k, v, _, _ = _inputs((1, 32, 32, 2, 2, 4, 4))
    run_xla = lambda q: attention(q, k, v, mask=causal(), impl="xla")
    with pytest.raises(AssertionError, match="expected engine 'blocksparse'"):
        assert_engine("blocksparse", run_xla, q)
    assert_engine("xla", run_xla, q)


def test_flax_multi_head_attention_adapter():
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.key(0), (2, 7, 12))

    def make(**kw):
        return nnx.MultiHeadAttention(
            num_heads=3, in_features=12, qkv_features=12, decode=False, rngs=nnx.Rngs(0), **kw
        )

    default = make()
    ours = make(attention_fn=attention_fn("softmax", query_chunk=CHUNK))
    ours_causal = make(attention_fn=attention_fn("softmax", mask=causal()))
    mask = nnx.make_causal_mask(jnp.ones((2, 7)))  # flax mask [batch, 1, q, kv]

    @nnx.jit
    def outputs(default, ours, ours_causal, x, mask):
        return (
            (ours(x), default(x)),
            (ours(x, mask=mask), default(x, mask=mask)),
            (ours_causal(x), default(x, mask=mask)),  # the adapter's Mask = flax's mask
            (ours(x, mask=mask, is_causal=True), default(x, mask=mask)),
        )

    for got, want in outputs(default, ours, ours_causal, x, mask):
        _close(got, want)
    # Sparse normalizers run, and the weights are sown when flax asks for them.
    sparse = make(attention_fn=attention_fn("sparsemax", mask=causal()))
    out, sown = nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate)(sparse, x)
    assert out.shape == x.shape
    (w,) = jax.tree.leaves(sown)
    assert w.shape == (2, 3, 7, 7) and float(w[0, 0, 0, 1]) == 0.0

    # Several (or no) batch axes, as flax allows.
    fn = attention_fn("entmax15")
    q, k, v, _, _ = _inputs((6, 5, 5, 2, 2, 4, 4))

    def run(q, k, v):
        return (
            fn(q, k, v),
            fn(*(a.reshape(2, 3, *a.shape[1:]) for a in (q, k, v))),
            fn(q[0], k[0], v[0]),
            fn(q, k, v, dropout_rate=0.1, deterministic=True),
        )

    flat, two_axes, no_axis, deterministic = jit_fast(run, q, k, v)
    _close(two_axes.reshape(flat.shape), flat)
    _close(no_axis, flat[0])
    _close(deterministic, flat)
    with pytest.raises(ValueError, match="dropout is not supported"):
        fn(q, k, v, dropout_rate=0.1, deterministic=False)


# ----------------------------------------------------------------------------------------------
# Argument errors: raised in Python, with the argument, the value and what is allowed.

_Q = jnp.zeros((2, 5, 4, 8))
_K = jnp.zeros((2, 6, 2, 8))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"q": jnp.zeros((2, 5, 8))}, ValueError, r"`q` must have rank 4 .*\(2, 5, 8\)"),
        ({"k": jnp.zeros((3, 6, 2, 8))}, ValueError, r"batch sizes differ"),
        ({"v": jnp.zeros((2, 7, 2, 8))}, ValueError, r"same sequence length .*\(2, 7, 2, 8\)"),
        ({"v": jnp.zeros((2, 6, 1, 8))}, ValueError, r"same number of heads"),
        ({"k": jnp.zeros((2, 6, 2, 4))}, ValueError, r"same head_dim"),
        (
            {"k": jnp.zeros((2, 6, 3, 8)), "v": jnp.zeros((2, 6, 3, 8))},
            ValueError,
            r"key/value heads \(3.*must divide .* query heads \(4",
        ),
        ({"q": jnp.zeros((2, 5, 4, 8), jnp.int32)}, TypeError, r"`q` must have a floating"),
        ({"v": jnp.zeros((2, 6, 2, 8), jnp.bfloat16)}, TypeError, r"same dtype"),
        ({"q": [[1.0]]}, TypeError, r"`q` must be a jax or numpy array"),
        ({"mask": from_array(np.ones((4, 6), bool))}, ValueError, r"fixed shape \(4, 6\)"),
        ({"mask": per_head([causal()] * 3)}, ValueError, r"per-head mask with 3 heads"),
        ({"mask": padding(np.array([1, 2, 3]))}, ValueError, r"batch size 3 .* batch size 2"),
        ({"mask": jnp.ones((2, 4, 5, 5), bool)}, ValueError, r"`mask` with shape \(2, 4, 5, 5\)"),
        ({"mask": jnp.ones((5, 6))}, TypeError, r"must have dtype bool"),
        ({"mask": "causal"}, TypeError, r"`mask` must be None, a sparse_jax.masks.Mask"),
        ({"bias": jnp.ones((3, 1, 5, 6))}, ValueError, r"`bias` with shape \(3, 1, 5, 6\)"),
        ({"bias": jnp.ones((5, 6), int)}, TypeError, r"`bias` must have a floating"),
        (
            {"normalizer": "entmax"},
            ValueError,
            r"unknown `normalizer`='entmax'.*'softmax', 'sparsemax', 'entmax15'",
        ),
        ({"normalizer": 0.5}, ValueError, r"α must be finite and >= 1 .*softmax.*got 0.5"),
        ({"normalizer": float("inf")}, ValueError, r"attention: `normalizer` α must be finite"),
        ({"normalizer": jnp.array(jnp.nan)}, ValueError, r"every α .* must be finite"),
        ({"normalizer": True}, TypeError, r"`normalizer` must be"),
        ({"normalizer": jnp.array([1.5, 0.9, 2.0, 2.0])}, ValueError, r"every α .* >= 1"),
        ({"normalizer": jnp.ones((2,)) * 1.5}, ValueError, r"shape \[\], \[1\] or \[heads\]"),
        ({"normalizer": jnp.array([2, 2, 2, 2])}, TypeError, r"floating dtype"),
        (
            {"impl": "splash", "normalizer": "sparsemax"},
            ValueError,
            r"impl='splash' does not take normalizer='sparsemax'.*impl='blocksparse'",
        ),
        (
            {"impl": "cudnn", "bias": jnp.zeros((5, 6)), "return_weights": True},
            ValueError,
            r"impl='cudnn' does not take a `bias`; return_weights=True",
        ),
        (
            {"impl": "cudnn", "mask": strided(2)},
            ValueError,
            r"cuDNN kernel takes full\(\), causal\(\), local",
        ),
        ({"impl": "blocksparse"}, ValueError, r"'blocksparse' needs `mask` to be a .*Mask"),
        ({"impl": "flash"}, ValueError, r"unknown `impl`='flash'.*'splash', 'cudnn'"),
        ({"block_size": 128}, TypeError, r"`block_size` must be a pair"),
        ({"block_size": (128, 0)}, ValueError, r"block_size\[1\]"),
        ({"query_chunk": 0}, ValueError, r"`query_chunk` must be an int >= 1"),
        ({"scale": "big"}, TypeError, r"`scale` must be None"),
        ({"scale": float("nan")}, ValueError, r"`scale` must be finite"),
        ({"return_weights": "yes"}, TypeError, r"`return_weights` must be a bool"),
    ],
)
def test_bad_arguments_raise_before_compiling(kwargs, error, match):
    args = {"q": _Q, "k": _K, "v": _K, **kwargs}
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=match):
        attention(q, k, v, **args)
    # attention_impl computes nothing and checks the same way.
    impl_args = {a: b for a, b in args.items() if a not in ("scale", "query_chunk")}
    if len(impl_args) == len(args):
        with pytest.raises(error, match=match):
            attention_impl(q, k, v, **impl_args)


def test_adapter_bad_arguments():
    with pytest.raises(ValueError, match="unknown `normalizer`='soft'"):
        attention_fn("soft")
    with pytest.raises(TypeError, match=r"must be None or a sparse_jax\.masks\.Mask"):
        attention_fn(mask=jnp.ones((3, 3), bool))
    with pytest.raises(ValueError, match=r"impl='splash' does not take normalizer=1\.5"):
        attention_fn(1.5, impl="splash")


# ----------------------------------------------------------------------------------------------
# Memory: the chunked path needs O(chunk * Tk) scratch, the naive one O(Tq * Tk).


def test_chunked_path_memory_is_far_below_naive():
    n = 2048
    spec = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)

    def naive(q, k, v):
        return naive_attention(q, k, v, jnp.asarray(causal().dense(n, n)), "softmax")[0]

    def chunked(q, k, v):
        return attention(q, k, v, mask=causal(), query_chunk=256)

    def with_grad(f):
        return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))

    def temp_bytes(f):
        compiled = jax.jit(f).lower(spec, spec, spec).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    scores = n * n * 2 * 4  # one float32 [1, 2, n, n] array
    assert temp_bytes(naive) >= scores  # the reference does materialise the scores
    assert temp_bytes(chunked) < temp_bytes(naive) / 3
    assert temp_bytes(with_grad(chunked)) < temp_bytes(with_grad(naive)) / 3


def _chunking(fn, *args) -> tuple[list[int], set[tuple[int, ...]]]:
    """(lengths of the scans, shapes of the dot_general outputs) in ``fn``'s jaxpr, nested
    jaxprs included: the chunks impl='xla' ran and the scores each one formed."""
    lengths, shapes = [], set()
    for eqn in traced_equations(fn, *args):
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        if eqn.primitive.name == "dot_general":
            shapes.add(tuple(eqn.outvars[0].aval.shape))
    return lengths, shapes


@pytest.mark.parametrize(
    "backend, shape, chunks, rows",
    [
        # 2**20 // (12 * 4 * 264) = 82 rows at most: 4 equal chunks of 72 (a multiple of 8)
        ("cpu", (12, 264, 4, 16), 4, 72),
        # 2**20 // (2 * 12 * 1024) = 42, but at least 2 * 64 rows: 8 chunks of 128
        ("cpu", (2, 1024, 12, 64), 8, 128),
        ("cpu", (8, 128, 12, 64), 1, 128),  # 2**20 // (8 * 12 * 128) = 85 < 2 * 64: one chunk
        ("gpu", (12, 264, 4, 16), 1, 264),  # 2**22 // (12 * 4 * 264) = 331: one chunk
        ("gpu", (2, 1024, 12, 64), 7, 152),  # 2**22 // (2 * 12 * 1024) = 170: 7 chunks of 152
    ],
)
def test_default_query_chunk_is_the_chunking_used(monkeypatch, backend, shape, chunks, rows):
    # query_chunk=None takes default_query_chunk's rows for the backend; counted in the traced
    # program (its scan and the scores' shape), not from the function itself
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    b, t, n, h = shape
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    lengths, shapes = _chunking(lambda q: attention(q, q, q, mask=causal(), impl="xla"), spec)
    assert lengths == ([chunks] if chunks > 1 else [])
    # the scores of one chunk, [B, N, rows, Tk] in the dot's own order of axes
    assert any(math.prod(s) == b * n * rows * t and {rows, t} <= set(s) for s in shapes)
    assert sj.dispatch.default_query_chunk(b, n, t, h, backend=backend) >= rows


@pytest.mark.parametrize(
    "args, error, named",
    [
        ((0, 4, 264, 16), ValueError, "`batch` must be an int >= 1; got 0"),
        ((12, 4.0, 264, 16), TypeError, "`heads` must be an int >= 1; got 4.0"),
        ((12, 4, True, 16), TypeError, "`kv_len` must be an int >= 1; got True"),
        ((12, 4, 264, -1), ValueError, "`head_dim` must be an int >= 1; got -1"),
    ],
)
def test_default_query_chunk_refuses_bad_arguments(args, error, named):
    with pytest.raises(error, match=re.escape(f"default_query_chunk: {named}")):
        sj.dispatch.default_query_chunk(*args, backend="cpu")
    with pytest.raises(TypeError, match="`backend` must be a platform name"):
        sj.dispatch.default_query_chunk(12, 4, 264, 16, backend=jax.devices()[0])


def test_auto_dispatch_follows_the_mask_density(monkeypatch):
    # the CPU's policy (a GPU takes the Pallas kernel for any Mask), checked on any machine
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    long = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
    window = attention_impl(long, long, long, mask=causal() & local(256, 0))
    assert window.impl == "blocksparse" and "9.4%" in window.reason
    causal_choice = attention_impl(long, long, long, mask=causal())  # rows grouped: 57% formed
    assert causal_choice.impl == "blocksparse" and "57.2%" in causal_choice.reason
    assert attention_impl(long, long, long, mask=causal() | sink(4)).impl == "blocksparse"
    assert attention_impl(long, long, long, mask=local(2048, 2048)).impl == "xla"  # 83% formed
    assert attention_impl(long, long, long).impl == "xla"
    q = jnp.ones((1, 64, 2, 8))
    windowed = lambda q: attention(q, q, q, mask=causal() & local(7, 0), block_size=(8, 8))
    wide = lambda q: attention(q, q, q, mask=local(40, 40), block_size=(8, 8))
    choices = [
        attention_impl(q, q, q, mask=mask, block_size=(8, 8))
        for mask in (causal() & local(7, 0), local(40, 40))
    ]
    assert [choice.impl for choice in choices] == ["blocksparse", "xla"]
    # and the program "auto" traces runs the engine it reports, on this machine
    monkeypatch.undo()
    for fn, mask in ((windowed, causal() & local(7, 0)), (wide, local(40, 40))):
        assert_engine(attention_impl(q, q, q, mask=mask, block_size=(8, 8)).impl, fn, q)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15", "alpha_per_head"])
def test_blocksparse_impl_equals_xla_values_and_gradients(normalizer):
    q, k, v, ct, alpha = _inputs("gqa", seed=7)
    norm = _normalizer_arg(normalizer, alpha)
    mask = (causal() & local(5, 0)) | sink(2)

    def loss(impl):
        def f(q, k, v, a):
            n = a if normalizer == "alpha_per_head" else norm
            out = attention(q, k, v, mask=mask, normalizer=n, impl=impl, block_size=(8, 8))
            return jnp.sum(out * ct)

        grad = jax.value_and_grad(f, argnums=(0, 1, 2, 3))
        assert_engine(impl, grad, q, k, v, alpha)  # not xla compared with xla
        return grad(q, k, v, alpha)

    jax.tree.map(_close, loss("blocksparse"), loss("xla"))
