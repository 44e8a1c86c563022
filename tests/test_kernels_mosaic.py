"""The TPU (Mosaic) kernels of sparse_jax.kernels in Pallas' TPU interpret mode on CPU.

The same checks as tests/test_kernels.py for the Triton kernels: values and gradients against
the XLA reference (one row per normalizer with a mask, shape, dtype and bias), fully masked
rows, dead blocks dropped from what the backward kernels visit, the choice of kernels on a TPU
backend, and the lowering to Mosaic for TPU (cross-lowered on this CPU; compiling it needs
libtpu). Blocks are 128 (the TPU lane width), so the shapes are a few blocks long.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import attention, attention_impl, masks
from sparse_jax.kernels import mosaic, pallas_attention, pallas_supports
from sparse_jax.kernels.plan import Plan, layout_arrays
from tests.test_kernels import _bias, _inputs

# name: (normalizer, mask, (B, Tq, Tk, N, Kh, D), dtype, bias shape or None)
CASES = {
    "softmax-causal-row-bias-gqa": (
        "softmax", masks.causal() & masks.local(150, 0), (1, 384, 384, 2, 1, 32), jnp.float32,
        (1, 2, 384, 1),
    ),
    "sparsemax-per-head-padding": (
        "sparsemax",
        masks.per_head([masks.causal() & masks.local(150, 0), masks.causal() & masks.sink(4)])
        & masks.padding(np.array([200, 77])),
        (2, 256, 256, 2, 2, 16), jnp.float32, (2, 1, 1),
    ),
    "entmax15-cross-full-bias": (
        "entmax15", masks.local(100, 100), (1, 200, 300, 2, 1, 24), jnp.float32, (1, 2, 200, 300),
    ),
    "alpha-heads-key-bias": (
        "alpha", masks.causal() & (masks.local(150, 0) | masks.sink(2)), (1, 384, 384, 2, 2, 16),
        jnp.float32, (384,),
    ),
    "softmax-segments": (
        "softmax", masks.causal() & masks.segments(np.array([[0] * 100 + [1] * 150 + [2] * 6])),
        (1, 256, 256, 2, 1, 16), jnp.float32, None,
    ),
    "sparsemax-bf16": (
        "sparsemax", masks.causal(), (1, 256, 256, 2, 1, 64), jnp.bfloat16, None,
    ),
    # Run-time leaves under | and ~, evaluated tile by tile (the masks' tile expressions): a
    # prefix-LM mask over chunks with a run-time prefix per batch element (a prefix beyond the
    # first key block, one within it); packed sequences with sinks shared across them and the
    # first keys of batch element 0 cut, so that its first rows see no key.
    "sparsemax-chunked-prefix-lm-gqa": (
        "sparsemax", (masks.causal() & masks.chunked(100)) | masks.padding(np.array([150, 30])),
        (2, 256, 256, 2, 1, 16), jnp.float32, None,
    ),
    "alpha-segments-or-sinks-not-padding": (
        "alpha",
        ((masks.causal() & masks.segments(np.array([[0] * 90 + [1] * 166, [2] * 200 + [3] * 56])))
         | masks.sink(3)) & ~masks.padding(np.array([4, 0])),
        (2, 256, 256, 2, 2, 16), jnp.float32, (2, 1, 1),
    ),
}  # fmt: skip


def _mosaic(q, k, v, mask, norm, scale, bias):
    layout = mask.blocks(q.shape[1], k.shape[1], 128, 128)
    return pallas_attention(
        q, k, v, layout, mask=mask, normalizer=norm, scale=scale, bias=bias, target="mosaic",
        interpret=True,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_the_xla_reference(case):
    norm, mask, shape, dtype, bias_shape = CASES[case]
    q, k, v, cot = _inputs(shape, dtype)
    alpha = jnp.linspace(1.2, 1.9, shape[3]) if norm == "alpha" else None
    scale = jnp.float32(0.4)
    bias = _bias(bias_shape)

    def loss(fn):
        def value(q, k, v, alpha, scale, bias):
            out = fn(q, k, v, mask, norm if alpha is None else alpha, scale, bias)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.value_and_grad(value, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)

    def reference(q, k, v, mask, norm, scale, bias):
        return attention(q, k, v, mask=mask, normalizer=norm, scale=scale, bias=bias, impl="xla")

    (_, out), grads = jax.jit(loss(_mosaic))(q, k, v, alpha, scale, bias)
    (_, ref), ref_grads = jax.jit(loss(reference))(q, k, v, alpha, scale, bias)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=tol, rtol=tol)
    for name, g, r in zip(("q", "k", "v", "alpha", "scale", "bias"), grads, ref_grads, strict=True):
        if r is None:
            continue
        g, r = np.float32(g), np.float32(r)
        if name == "bias" and bias_shape[-1] == 1:
            # One bias per row shifts the whole row, which no normalizer sees: the gradient is
            # exactly 0, and both sides are the rounding noise of sums over every score entry
            # (~1e-5 here; a wrong term in the kernel's dbias gives O(1)).
            assert np.abs(g).max() <= 1e-3 and np.abs(r).max() <= 1e-3, (g, r)
            continue
        atol = tol * max(1.0, float(np.abs(r).max())) * (1 if dtype == jnp.float32 else 4)
        if name == "scale":
            # One scalar summed over every score entry, in a different order on each side:
            # float32 rounding reaches ~1e-4 of it (entmax15-cross-full-bias, 120,000 entries,
            # against a float64 evaluation of its inputs); a wrong term in dscale gives O(1).
            atol = 2e-4 * max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(g, r, atol=atol, rtol=tol, err_msg=name)


def test_fully_masked_rows_give_zero_output_and_gradients():
    allowed = np.tril(np.ones((256, 256), bool))
    allowed[5:9] = False  # four query rows see nothing
    allowed[140:150] = False
    mask = masks.from_array(allowed)
    q, k, v, cot = _inputs((1, 256, 256, 1, 1, 16), jnp.float32)
    for norm in ("softmax", "sparsemax", 1.3):
        # One forward pass for the output and the gradients (interpret mode is slow on CPU).
        out, pullback = jax.vjp(
            lambda q, k, v, n=norm: _mosaic(q, k, v, mask, n, None, None), q, k, v
        )
        dq, dk, dv = pullback(cot)
        assert np.all(np.asarray(out)[0, 5:9] == 0.0) and np.all(np.asarray(dq)[0, 5:9] == 0.0)
        assert np.all(np.asarray(out)[0, 140:150] == 0.0), norm
        ref = attention(q, k, v, mask=mask, normalizer=norm, impl="xla")
        np.testing.assert_allclose(out, ref, atol=2e-5)
        assert np.isfinite(np.asarray(dk)).all() and np.isfinite(np.asarray(dv)).all()


def _plan(q, v, layout, norm):
    b, _, n, d = q.shape
    return Plan(
        kind=norm, sigma=None, b=b, n=n, g=1, bq=layout.block_q, bkv=layout.block_kv,
        nq=layout.num_q_blocks, nk=layout.num_kv_blocks, d=d, dv=v.shape[-1], per_head=0,
        interpret=True, segments=False, expr=None, kv_len=v.shape[1], target="mosaic",
        precision=jax.lax.Precision.HIGHEST,
        bias_axes=(False,) * 4, arrays=layout_arrays(layout),
    )  # fmt: skip


def test_dead_blocks_are_dropped_from_what_the_backward_visits():
    # Queries that score key block 0 far above the rest: sparsemax gives the later blocks no
    # weight; the forward pass marks them dead and the backward kernels' visit lists omit them.
    # (Three blocks of 128: two dead blocks in the last query block's row, one in the middle's.)
    q = jnp.zeros((1, 384, 1, 16)).at[..., 0].set(1.0)
    k = jnp.zeros((1, 384, 1, 16)).at[:, :128, :, 0].set(8.0)
    v = jax.random.normal(jax.random.PRNGKey(2), (1, 384, 1, 16))
    layout = masks.causal().blocks(384, 384, 128, 128)
    plan = _plan(q, v, layout, "sparsemax")
    eps = jnp.zeros((1, 1), jnp.float32)
    lengths = jnp.full((1,), 384, jnp.int32)
    no_bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
    key_nan = jnp.zeros((1, 1, 384), jnp.float32)
    no_ids = (jnp.zeros((1, 384), jnp.int32),) * 2
    _, res = mosaic.forward(plan, jnp.ones(1), lengths, eps, q, k, v, no_bias, key_nan, *no_ids)
    live = np.asarray(res["live"])
    assert live[0, 0, 2, :3].tolist() == [1, 0, 0]  # query block 2 keeps 3, one holds weight
    (dq_count, dq_slots), (t_count, t_rows, _, _) = mosaic.visits(plan, res["live"])
    assert np.asarray(dq_count)[0, 0, :, 0, 0].tolist() == [1, 1, 1]
    assert np.asarray(dq_slots)[0, 0, 2, 0, 0] == 0
    # key block 0 is visited by every query block, the others by none
    assert np.asarray(t_count)[0, 0, :, 0, 0].tolist() == [3, 0, 0]
    assert sorted(np.asarray(t_rows)[0, 0, 0, 0, :3].tolist()) == [0, 1, 2]
    # softmax visits every kept block (p > 0 everywhere it is allowed)
    (sm_count, _), (sm_t_count, *_) = mosaic.visits(_plan(q, v, layout, "softmax"), None)
    assert np.asarray(sm_count)[0, 0, :, 0, 0].tolist() == [1, 2, 3]
    assert np.asarray(sm_t_count)[0, 0, :, 0, 0].tolist() == [3, 2, 1]
    grads = jax.grad(
        lambda q, k, v: jnp.sum(_mosaic(q, k, v, masks.causal(), "sparsemax", 1.0, None) * v),
        argnums=(0, 1, 2),
    )(q, k, v)
    ref_grads = jax.grad(
        lambda q, k, v: jnp.sum(
            attention(q, k, v, mask=masks.causal(), normalizer="sparsemax", impl="xla", scale=1.0)
            * v
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    # dq is 0 up to rounding: 128 tied keys (equal k), sums of 128 terms of 8·|ds|.
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=5e-4)


def test_non_finite_input_follows_the_attention_policy():
    q, k, v, _ = _inputs((1, 256, 256, 1, 1, 16), jnp.float32)
    q = q.at[0, 20, 0, 3].set(jnp.nan)  # query row 20 is NaN
    v = v.at[0, 200, 0, 1].set(jnp.inf)  # key 200: rows >= 200 (causal) become NaN
    for norm in ("softmax", "entmax15"):
        out = np.asarray(_mosaic(q, k, v, masks.causal(), norm, None, None))
        ref = np.asarray(attention(q, k, v, mask=masks.causal(), normalizer=norm, impl="xla"))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        assert np.isnan(out[0, 20]).all() and np.isnan(out[0, 200:]).all()
        np.testing.assert_allclose(out[~np.isnan(ref)], ref[~np.isnan(ref)], atol=2e-5)


def test_a_tpu_backend_runs_the_mosaic_kernels(monkeypatch):
    q, k, v, _ = _inputs((1, 256, 256, 2, 2, 16), jnp.float32)
    mask = masks.causal() & masks.local(100, 0)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")

    def run(q, k, v):
        return attention(q, k, v, mask=mask, normalizer="entmax15", impl="pallas")

    # traced, not compiled: the kernel named in the program is the Mosaic one
    text = str(jax.make_jaxpr(run)(q, k, v))
    assert "sparse_jax_mosaic_entmax15_fwd" in text and "sparse_jax_pallas" not in text
    choice = attention_impl(q, k, v, mask=mask, normalizer="entmax15")
    assert choice.impl in ("blocksparse", "xla") and "not yet compiled" in choice.reason
    assert pallas_supports(q, backend="tpu", block_size=(128, 64)) == (
        False, "`block_kv`=64 is not a multiple of 128 (the TPU lane width)",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"block_size\[1\]`=64 is not a multiple of 128"):
        attention(q, k, v, mask=mask, impl="pallas", block_size=(128, 64))


def test_kernel_arguments_are_checked(monkeypatch):
    q, k, v, _ = _inputs((1, 256, 256, 1, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="`target` must be None, 'triton' or 'mosaic'"):
        pallas_attention(q, k, v, masks.causal().blocks(256, 256, 128, 128), target="cuda")
    with pytest.raises(ValueError, match="`block_q`=64 is not a multiple of 128"):
        pallas_attention(q, k, v, masks.causal().blocks(256, 256, 64, 128), target="mosaic")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="`block_q`=64 is not a multiple"):  # on any machine
        pallas_attention(q, k, v, masks.causal().blocks(256, 256, 64, 128), target="mosaic")
    with pytest.raises(ValueError, match="target='mosaic' compiles for TPU but the backend is"):
        pallas_attention(q, k, v, masks.causal().blocks(256, 256, 128, 128), target="mosaic")


@pytest.mark.parametrize(
    ("normalizer", "per_head", "kv_heads", "dtype", "bias_shape"),
    [
        ("softmax", False, 2, jnp.bfloat16, None),
        ("sparsemax", True, 1, jnp.float32, (1, 2, 384, 1)),
        ("entmax15-packed", False, 1, jnp.bfloat16, (384,)),
        ("alpha", False, 2, jnp.float32, (1, 2, 384, 384)),
        ("softmax-or", False, 1, jnp.float32, None),
        ("entmax15-or", False, 2, jnp.bfloat16, (1, 2, 384, 1)),
    ],
)
def test_the_kernels_lower_to_mosaic_for_tpus(
    normalizer, per_head, kv_heads, dtype, bias_shape, monkeypatch
):
    """Forward and backward lower through Pallas' Mosaic backend (cross-lowered for TPU on this
    CPU machine: an op that Mosaic cannot express, or a block that breaks its tiling rules,
    fails here; what only libtpu's compiler checks does not)."""
    # pallas_attention refuses target='mosaic' on a GPU backend (it would compile there); what
    # this checks, lowering for a TPU, any machine can do: on a GPU it reads as the CPU's
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    q = jnp.zeros((1, 384, 2, 64), dtype)
    k = jnp.zeros((1, 384, kv_heads, 64), dtype)
    window = masks.causal() & (masks.local(150, 0) | masks.sink(4))
    mask = masks.per_head([window, masks.causal()]) if per_head else window
    if normalizer.endswith("-packed"):  # run-time segment ids and lengths (packed sequences)
        normalizer = normalizer.removesuffix("-packed")
        ids = np.repeat(np.arange(4), 384 // 4)[None]
        mask = mask & masks.segments(ids) & masks.padding(np.array([384 - 7]))
    if normalizer.endswith("-or"):  # run-time leaves under | and ~: the tile expression
        normalizer = normalizer.removesuffix("-or")
        ids = np.repeat(np.arange(4), 384 // 4)[None]
        mask = ((mask & masks.dilated(60, 2) & ~masks.segments(ids)) | masks.sink(3)) | (
            masks.causal() & masks.padding(np.array([200]))
        )
    layout = mask.blocks(384, 384, 128, 128)
    alpha = jnp.full((2,), 1.3) if normalizer == "alpha" else None
    bias = None if bias_shape is None else jnp.zeros(bias_shape)

    def loss(q, k, v, alpha, bias):
        norm = normalizer if alpha is None else alpha
        out = pallas_attention(
            q,
            k,
            v,
            layout,
            mask=mask,
            normalizer=norm,
            bias=bias,
            interpret=False,
            target="mosaic",
        )
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3) + ((4,) if bias is not None else ()))
    text = jax.jit(grad).trace(q, k, k, alpha, bias).lower(lowering_platforms=("tpu",)).as_text()
    # forward, dq and dk/dv: three Mosaic kernels in the lowered program
    assert text.count("tpu_custom_call") == 3
    kind = {"alpha": "entmax"}.get(normalizer, normalizer)
    for part in ("fwd", "dq", "dkv"):
        assert f"sparse_jax_mosaic_{kind}_{part}" in text
