"""The fused softmax kernels: TPU splash (interpret mode here) and GPU cuDNN (mask translation
checked through XLA; the cuDNN run itself only on a GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.dispatch import attention, attention_impl
from sparse_jax.fused import (
    cudnn_attention,
    cudnn_mask_arguments,
    cudnn_shape_problem,
    splash_attention,
)
from sparse_jax.masks import (
    causal,
    chunked,
    full,
    local,
    padding,
    per_head,
    segments,
    sink,
    strided,
)
from tests.engines import assert_engine, assert_lowered_contains


def _qkv(b, tq, tk, n, kh, d, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, tq, n, d), dtype)
    k = jax.random.normal(keys[1], (b, tk, kh, d), dtype)
    v = jax.random.normal(keys[2], (b, tk, kh, d), dtype)
    return q, k, v


SPLASH_CASES = {
    "causal": (causal(), 1, 256, 256, 2, 2),
    "window+sinks, padded lengths, GQA": ((causal() & local(40, 0)) | sink(4), 2, 200, 200, 4, 2),
    "per-head, cross lengths": (per_head([causal(), chunked(64) & causal()]), 1, 128, 256, 2, 1),
    "full": (None, 1, 128, 130, 2, 2),
}


@pytest.mark.parametrize("name", list(SPLASH_CASES))
def test_splash_matches_xla_values_and_gradients(name):
    mask, b, tq, tk, n, kh = SPLASH_CASES[name]
    q, k, v = _qkv(b, tq, tk, n, kh, 16)
    cot = jax.random.normal(jax.random.key(9), (b, tq, n, 16))

    def loss(impl):
        def f(q, k, v):
            return jnp.sum(attention(q, k, v, mask=mask, impl=impl) * cot)

        return f

    np.testing.assert_allclose(
        attention(q, k, v, mask=mask, impl="splash"),
        attention(q, k, v, mask=mask, impl="xla"),
        atol=1e-5,
    )
    assert_engine("splash", jax.grad(loss("splash"), argnums=(0, 1, 2)), q, k, v)
    assert_engine("xla", jax.grad(loss("xla"), argnums=(0, 1, 2)), q, k, v)
    got = jax.grad(loss("splash"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_splash_fully_masked_rows_are_zero():
    # Row 0 has no key: causal without the diagonal. The kernel would average the values.
    mask = causal() & ~local(0, 0)
    q, k, v = _qkv(1, 128, 128, 2, 2, 8)
    out = splash_attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    np.testing.assert_allclose(out, attention(q, k, v, mask=mask, impl="xla"), atol=1e-5)
    grads = jax.grad(lambda q: splash_attention(q, k, v, mask=mask)[:, 0].sum())(q)
    np.testing.assert_array_equal(grads, 0.0)


def test_splash_takes_run_time_padding_with_empty_rows_zero():
    # causal & local(40, 0) & padding: in batch element 1 (60 keys) the rows from 100 on see no
    # key (row i sees keys i - 40 ... i): output 0 and zero gradients, as xla gives.
    # 200 positions: the blocks' own padding (to 256) is excluded as well. GQA: 4 heads, 2 kv.
    q, k, v = _qkv(2, 200, 200, 4, 2, 16)
    cot = jax.random.normal(jax.random.key(9), q.shape)
    lengths = jnp.array([150, 60])

    def loss(impl):
        def f(q, k, v, lengths):
            mask = causal() & local(40, 0) & padding(lengths)
            return jnp.sum(attention(q, k, v, mask=mask, impl=impl) * cot)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))  # lengths traced

    (got, got_grads), (want, want_grads) = (
        loss("splash")(q, k, v, lengths),
        loss("xla")(q, k, v, lengths),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    np.testing.assert_array_equal(got_grads[0][1, 100:], 0.0)
    out = splash_attention(q, k, v, mask=causal() & local(40, 0) & padding(lengths))
    np.testing.assert_array_equal(out[1, 100:], 0.0)
    assert float(jnp.abs(out[1, 99]).min()) > 0  # row 99 still sees key 59
    assert_engine("splash", loss("splash"), q, k, v, lengths)


def test_splash_takes_segments_with_padding_and_empty_rows_zero():
    # Packed sequences (segments) & run-time padding & a window, cross lengths, GQA: values and
    # gradients equal xla's with ids and lengths traced. Rows with no key are exactly 0 with
    # zero gradients: in batch element 0 the segment-2 queries, whose keys all lie beyond the
    # length (120); in element 1 the queries of segment 9, which no key has.
    q, k, v = _qkv(2, 200, 180, 4, 2, 16)
    cot = jax.random.normal(jax.random.key(9), q.shape)
    q_ids = jnp.array([[0] * 70 + [1] * 50 + [2] * 80, [5] * 100 + [9] * 100])  # [2, 200]
    kv_ids = jnp.array([[0] * 70 + [1] * 50 + [2] * 60, [5] * 120 + [7] * 60])  # [2, 180]
    lengths = jnp.array([120, 170])
    static = causal() & local(100, 0)

    def loss(impl):
        def f(q, k, v, q_ids, kv_ids, lengths):
            mask = static & segments(q_ids, kv_ids) & padding(lengths)
            return jnp.sum(attention(q, k, v, mask=mask, impl=impl) * cot)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    args = (q, k, v, q_ids, kv_ids, lengths)
    (got, got_grads), (want, want_grads) = loss("splash")(*args), loss("xla")(*args)
    np.testing.assert_allclose(got, want, atol=1e-3)  # a sum of 51,200 terms
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert_engine("splash", loss("splash"), *args)
    mask = static & segments(q_ids, kv_ids) & padding(lengths)
    out = splash_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(out, attention(q, k, v, mask=mask, impl="xla"), atol=1e-5)
    empty = {0: np.r_[120:200], 1: np.r_[100:200]}
    for b, rows in empty.items():
        np.testing.assert_array_equal(out[b, rows], 0.0)
        np.testing.assert_array_equal(got_grads[0][b, rows], 0.0)
    assert float(jnp.abs(out[0, 119]).min()) > 0 and float(jnp.abs(out[1, 99]).min()) > 0


def test_splash_refuses_run_time_masks_it_cannot_take():
    q, k, v = _qkv(1, 128, 128, 2, 2, 8)
    ids = jnp.zeros((1, 128), jnp.int32)
    for mask in (causal() | padding([64]), causal() & segments(ids) & segments(ids)):
        with pytest.raises(ValueError, match=r"only as `& padding\(lengths\)`.*impl='pallas'"):
            splash_attention(q, k, v, mask=mask)
        with pytest.raises(ValueError, match=r"attention: the kernel takes run-time masks only"):
            attention(q, k, v, mask=mask, impl="splash")
    with pytest.raises(ValueError, match=r"padding lengths for batch size \[2\]"):
        splash_attention(q, k, v, mask=causal() & padding([3, 4]))
    with pytest.raises(ValueError, match=r"segment ids for batch size 2 but q has batch size 1"):
        splash_attention(q, k, v, mask=causal() & segments(jnp.zeros((2, 128), jnp.int32)))
    with pytest.raises(ValueError, match=r"fixed shape \(100, 100\) \(segments\).*q_len <= 100"):
        splash_attention(q, k, v, mask=causal() & segments(jnp.zeros((1, 100), jnp.int32)))


def test_auto_takes_splash_for_padding_on_a_tpu(monkeypatch):
    q, k, v = _qkv(2, 128, 128, 2, 2, 8)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    padded = causal() & padding(jnp.array([100, 28]))
    choice = attention_impl(q, k, v, mask=padded)
    assert choice.impl == "splash" and "& padding" in choice.reason
    packed = causal() & segments(jnp.zeros((2, 128), int))
    assert attention_impl(q, k, v, mask=packed).impl == "splash"
    twice = packed & segments(jnp.zeros((2, 128), int))  # splash takes one segments leaf
    assert attention_impl(q, k, v, mask=twice).impl in ("blocksparse", "xla")
    assert_engine("splash", lambda q: attention(q, k, v, mask=padded), q)
    assert_engine("splash", lambda q: attention(q, k, v, mask=packed), q)


def test_splash_with_padding_lowers_for_a_tpu():
    # The compiled (not interpreted) kernel with run-time lengths: forward and backward lower to
    # Mosaic custom calls on this CPU machine (what only libtpu checks is not checked here).
    q = k = v = jnp.zeros((2, 256, 2, 128), jnp.bfloat16)

    def loss(q, k, v, lengths):
        out = splash_attention(q, k, v, mask=causal() & padding(lengths), interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    lengths = jnp.array([200, 7])
    text = jax.jit(grad).trace(q, k, v, lengths).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3
    for name in ("fwd_segmented", "dq_segmented", "dkv_segmented"):  # segment ids reach each
        assert f"splash_mha_{name}" in text


def test_splash_bfloat16_and_scale():
    q, k, v = _qkv(1, 128, 128, 2, 2, 8, jnp.bfloat16)
    got = splash_attention(q, k, v, mask=causal(), scale=0.3)
    want = attention(q, k, v, mask=causal(), scale=0.3, impl="xla")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=3e-2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mask": jnp.ones((8, 8), bool)}, TypeError, r"`mask` must be None or a .*Mask"),
        ({"block_size": (64, 128)}, ValueError, r"`block_size` must be a pair of positive mult"),
        ({"mask": per_head([causal()] * 3)}, ValueError, r"per-head mask with 3 heads"),
        ({"q": jnp.zeros((1, 8, 2, 4), jnp.float16)}, TypeError, r"`q` has dtype float16"),
        ({"k": jnp.zeros((1, 8, 3, 4))}, ValueError, r"key/value heads \(3"),
    ],
)
def test_splash_bad_arguments(kwargs, error, match):
    args = {"q": jnp.zeros((1, 8, 2, 4)), "k": jnp.zeros((1, 8, 1, 4)), "v": None, **kwargs}
    if args["v"] is None:
        args["v"] = jnp.zeros(args["k"].shape, args["k"].dtype)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    if "q" in kwargs:
        k = v = jnp.zeros((1, 8, 2, 4), jnp.float16)
    with pytest.raises(error, match=match):
        splash_attention(q, k, v, **args)


# ----------------------------------------------------------------------------------------------
# cuDNN.


@pytest.mark.parametrize(
    "mask, expected",
    [
        (None, {}),
        (full(), {}),
        (causal(), {"is_causal": True}),
        (local(7, 0), {"is_causal": True, "local_window_size": (7, 0)}),  # same keys
        (local(7, 0) & causal(), {"is_causal": True, "local_window_size": (7, 0)}),
        (causal() & local(7, 2), {"is_causal": True, "local_window_size": (7, 2)}),
    ],
)
def test_cudnn_mask_arguments(mask, expected):
    assert cudnn_mask_arguments(mask) == expected


def test_cudnn_refuses_a_right_window_without_causal():
    # jax.nn.dot_product_attention(implementation="cudnn") raises for it: refused up front
    with pytest.raises(ValueError, match=r"no right side without causal\(\).*right=2"):
        cudnn_mask_arguments(local(7, 2))
    q, k, v = _qkv(1, 16, 16, 2, 2, 8, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"no right side without causal"):
        attention(q, k, v, mask=local(7, 2), impl="cudnn")


def test_cudnn_shape_problems_keep_auto_off_cudnn(monkeypatch):
    """The GPU's auto policy, checked on any machine: cuDNN where it takes the shapes (and
    their gradient), the Pallas kernel where it does not (odd lengths failed the gradient
    through jax on an H200)."""
    assert cudnn_shape_problem((1, 16, 2, 64), (1, 16, 2, 64)) == ""
    assert "odd lengths (Tq=13, Tk=13)" in cudnn_shape_problem((1, 13, 2, 64), (1, 13, 2, 64))
    assert "odd lengths (Tq=16, Tk=15)" in cudnn_shape_problem((1, 16, 2, 64), (1, 15, 2, 64))
    assert "head dim 12" in cudnn_shape_problem((1, 16, 2, 12), (1, 16, 2, 12))
    assert "head dim 512" in cudnn_shape_problem((1, 16, 2, 512), (1, 16, 2, 512))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    even = jax.ShapeDtypeStruct((1, 16, 2, 16), jnp.bfloat16)
    odd = jax.ShapeDtypeStruct((1, 13, 2, 16), jnp.bfloat16)
    assert attention_impl(even, even, even, mask=causal()).impl == "cudnn"
    choice = attention_impl(odd, odd, odd, mask=causal())
    assert choice.impl == "pallas" and "Pallas" in choice.reason
    assert attention_impl(even, even, even, mask=local(3, 1)).impl == "pallas"


@pytest.mark.parametrize(
    "mask", [strided(4), causal().with_offset(3), local(None, 0), causal() | sink(2)]
)
def test_cudnn_refuses_masks_it_cannot_express(mask):
    with pytest.raises(ValueError, match=r"takes full\(\), causal\(\), local"):
        cudnn_mask_arguments(mask)


@pytest.mark.parametrize("mask", [causal(), local(5, 0), causal() & local(5, 3)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_arguments_mean_the_same_mask(mask, dtype):
    """The translated arguments, run through jax.nn's XLA path, equal our masked reference."""
    q, k, v = _qkv(2, 24, 24, 4, 2, 8, dtype)
    got = cudnn_attention(q, k, v, mask=mask, implementation="xla")
    want = attention(q, k, v, mask=mask, impl="xla")
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2)


def test_cudnn_needs_a_gpu_and_half_precision():
    q, k, v = _qkv(1, 8, 8, 2, 2, 8, jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=r"needs an NVIDIA GPU; the default backend is"):
            attention(q, k, v, mask=causal(), impl="cudnn")
    q32 = q.astype(jnp.float32)
    with pytest.raises(TypeError, match=r"`q` has dtype float32; the kernel takes float16"):
        cudnn_attention(q32, q32, q32, implementation="xla")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN runs on NVIDIA GPUs only")
def test_cudnn_on_gpu_matches_xla():
    q, k, v = _qkv(2, 256, 256, 4, 2, 64, jnp.bfloat16)
    for mask in (causal(), causal() & local(64, 0), local(64, 0), causal() & local(64, 8)):
        got = attention(q, k, v, mask=mask, impl="cudnn")
        want = attention(q, k, v, mask=mask, impl="xla")
        fused = functools.partial(attention, k=k, v=v, mask=mask, impl="cudnn")
        assert_engine("cudnn", fused, q)
        assert_lowered_contains(fused, q, needle="__cudnn$fmha")
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2)
        # and the gradient (with odd lengths jax's own check refuses it: auto then avoids cuDNN)
        grads = [
            jax.grad(
                lambda *a, impl=impl, m=mask: jnp.sum(attention(*a, mask=m, impl=impl)),
                (0, 1, 2),
            )(q, k, v)
            for impl in ("cudnn", "xla")
        ]
        for name, g, want in zip("qkv", *grads, strict=True):
            g, want = np.asarray(g, np.float32), np.asarray(want, np.float32)
            atol = 0.05 * float(np.abs(want).max())
            np.testing.assert_allclose(g, want, rtol=0, atol=atol, err_msg=name)
    assert attention_impl(q, k, v, mask=causal()).impl == "cudnn"
    assert_engine("cudnn", lambda q: attention(q, k, v, mask=causal()), q)


def test_auto_never_picks_a_fused_kernel_off_its_backend():
    q, k, v = _qkv(1, 16, 16, 2, 2, 8, jnp.bfloat16)
    backend = jax.default_backend()
    impl = attention_impl(q, k, v, mask=causal()).impl
    assert impl == {"tpu": "splash", "gpu": "cudnn"}.get(backend, impl)
    if backend == "cpu":
        assert impl in ("xla", "blocksparse")
    assert_engine(impl, lambda q: attention(q, k, v, mask=causal()), q)  # and that one runs
    # sparse normalizers never go to a softmax-only kernel (on a GPU: the Pallas kernel)
    sparse = {"gpu": ("pallas",)}.get(backend, ("xla", "blocksparse"))
    assert attention_impl(q, k, v, mask=causal(), normalizer="sparsemax").impl in sparse
