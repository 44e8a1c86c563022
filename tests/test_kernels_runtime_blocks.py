"""The fused Pallas kernels over a run-time block list, against the XLA engine of block top-k.

``topk_block_attention(..., impl="pallas")`` selects the key blocks in XLA and runs the
attention over them in the fused kernels, whose layout arrays are built from the traced
selection (``sparse_jax.kernels.pallas_block_list_attention``); ``impl="xla"`` gathers the same
blocks. Both in interpret mode on CPU: values and gradients of q, k, v (and an α array) for
every normalizer, grouped-query attention, causal and not, lengths that are not multiples of
the blocks, query blocks that select fewer blocks than their capacity, given ``block_scores``;
the Mosaic target once; a hand-made list (any order, gaps, a block with nothing allowed, an
empty row) against dense attention under the mask it defines; the transposed lists; argument
errors. Every comparison also asserts that the Pallas kernels ran (their ``pallas_call``
equations in the traced program), not only that the values agree. Small shapes: interpret
mode is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import attention
from sparse_jax.dynamic import SENTINEL, topk_block_attention
from sparse_jax.kernels import pallas_block_list_attention
from sparse_jax.kernels.plan import block_list_arrays
from sparse_jax.masks import causal as causal_mask
from sparse_jax.masks import full as full_mask
from tests.engines import assert_engine, traced_equations

TOL = 2e-5


def _inputs(b, tq, tk, n, kh, d, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, tq, n, d)) * 1.5
    k = jax.random.normal(keys[1], (b, tk, kh, d)) * 1.5
    v = jax.random.normal(keys[2], (b, tk, kh, d))
    cot = jax.random.normal(keys[3], (b, tq, n, d))
    return q, k, v, cot


def _kernel_grids(fn, *args) -> dict[str, tuple[int, ...]]:
    """{name: grid} of the Pallas kernels ``fn(*args)`` traces (nested jaxprs included)."""
    found = {}
    for eqn in traced_equations(fn, *args):
        if eqn.primitive.name == "pallas_call":
            info = eqn.params.get("name_and_src_info")
            name = getattr(info, "name", None) or str(eqn.params.get("name"))
            found[name] = tuple(eqn.params["grid_mapping"].grid)
    return found


def _pallas_kernels(fn, *args) -> set[str]:
    """The names of the Pallas kernels ``fn(*args)`` traces."""
    return set(_kernel_grids(fn, *args))


def _value_and_grads(run, cot, with_alpha: bool):
    """jit of ``(out, grads of sum(out * cot) in q, k, v[, alpha])`` of ``run(q, k, v, alpha)``."""
    argnums = (0, 1, 2, 3) if with_alpha else (0, 1, 2)

    def loss(q, k, v, alpha):
        out = run(q, k, v, alpha)
        return jnp.sum(out * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def _assert_close(out, grads, ref, ref_grads):
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL, rtol=TOL)
    for name, g, r in zip(("q", "k", "v", "alpha"), grads, ref_grads, strict=False):
        atol = TOL * max(1.0, float(np.abs(np.asarray(r)).max()))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=atol, rtol=TOL, err_msg=name)


# name: (normalizer, causal, (B, Tq, Tk, N, Kh, D), block_size, keep_blocks, local_blocks);
# "alpha" is a learnable α per head. The causal cases' first query blocks have fewer allowed
# blocks than their capacity (SENTINEL slots).
CASES = {
    "softmax-causal-gqa": ("softmax", True, (1, 80, 80, 4, 2, 8), (16, 16), 2, 1),
    "sparsemax-noncausal-padded": ("sparsemax", False, (2, 72, 72, 2, 1, 8), (16, 16), 1, 1),
    "entmax15-causal-tall-blocks": ("entmax15", True, (1, 96, 96, 2, 2, 8), (32, 16), 1, 2),
    "alpha-heads-causal-gqa": ("alpha", True, (1, 80, 80, 4, 1, 8), (16, 16), 1, 1),
    "alpha-2.5-cross": (2.5, False, (1, 48, 80, 2, 2, 8), (16, 16), 2, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pallas_matches_the_xla_engine(case):
    norm, causal, (b, tq, tk, n, kh, d), block, keep, local = CASES[case]
    q, k, v, cot = _inputs(b, tq, tk, n, kh, d)
    alpha = jnp.linspace(1.2, 1.9, n) if norm == "alpha" else None

    def engine(impl, return_indices=False):
        def run(q, k, v, alpha):
            return topk_block_attention(
                q, k, v, keep_blocks=keep, block_size=block, causal=causal, local_blocks=local,
                normalizer=norm if alpha is None else alpha, impl=impl,
                return_indices=return_indices,
            )  # fmt: skip

        return run

    def value_and_grads(impl):  # (out, the selected blocks), grads
        argnums = (0, 1, 2, 3) if alpha is not None else (0, 1, 2)

        def loss(q, k, v, alpha):
            out, indices = engine(impl, True)(q, k, v, alpha)
            return jnp.sum(out * cot), (out, indices)

        return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, alpha)

    (_, (out, indices)), grads = value_and_grads("pallas")
    with jax.default_matmul_precision("highest"):  # (the kernels' float32 products on a GPU)
        (_, (ref, ref_indices)), ref_grads = value_and_grads("xla")
    _assert_close(out, grads, ref, ref_grads)
    assert len(grads) == (4 if alpha is not None else 3)
    # Both engines attended to the same blocks; with causal, some query blocks to fewer than
    # their capacity (the first: only the diagonal block is allowed).
    np.testing.assert_array_equal(indices, ref_indices)
    if causal:
        assert bool(jnp.all(jnp.any(indices[:, :, 0] == SENTINEL, axis=-1)))

    # The kernels ran, forward and both backward kernels (not the gather of impl="xla").
    kind = {"alpha": "entmax", 2.5: "entmax"}.get(norm, norm)
    kernels = _pallas_kernels(
        jax.grad(lambda q: jnp.sum(engine("pallas")(q, k, v, alpha))), q
    )  # fmt: skip
    assert kernels == {f"sparse_jax_pallas_{kind}_{part}" for part in ("fwd", "dq", "dkv")}
    assert_engine("pallas", engine("pallas"), q, k, v, alpha)
    assert not _pallas_kernels(engine("xla"), q, k, v, alpha)


def test_pallas_with_block_scores_matches_the_xla_engine():
    """A learned selector's ``block_scores`` rank the blocks in both engines (here they pick
    other blocks than the pooled score does)."""
    b, t, n, kh, d = 1, 80, 2, 1, 8
    q, k, v, cot = _inputs(b, t, t, n, kh, d, seed=3)
    nq = nk = 5
    scores = jax.random.normal(jax.random.PRNGKey(11), (b, n, nq, nk))

    def engine(impl, block_scores):
        def run(q, k, v, alpha):
            return topk_block_attention(
                q, k, v, keep_blocks=2, block_size=(16, 16), normalizer="sparsemax", impl=impl,
                block_scores=block_scores, return_indices=True,
            )  # fmt: skip

        return run

    def value_and_grads(impl):  # (out, the selected blocks), grads
        def loss(q, k, v):
            out, indices = engine(impl, scores)(q, k, v, None)
            return jnp.sum(out * cot), (out, indices)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, (out, chosen)), grads = value_and_grads("pallas")
    with jax.default_matmul_precision("highest"):
        (_, (ref, ref_chosen)), ref_grads = value_and_grads("xla")
    _assert_close(out, grads, ref, ref_grads)
    np.testing.assert_array_equal(chosen, ref_chosen)
    assert not np.array_equal(chosen, engine("xla", None)(q, k, v, None)[1])  # (pooled)
    assert_engine("pallas", engine("pallas", scores), q, k, v, None)


def test_the_mosaic_kernels_match_the_xla_engine():
    """The TPU kernels (interpret mode) over the selection of ``impl="xla"``: blocks of 128,
    grouped-query heads, a learnable α per head, a causal first query block with an empty
    slot."""
    b, t, n, kh, d = 1, 300, 2, 1, 8
    q, k, v, cot = _inputs(b, t, t, n, kh, d, seed=5)
    alpha = jnp.array([1.3, 1.8])
    options = {"keep_blocks": 1, "block_size": (128, 128)}
    _, indices = topk_block_attention(q, k, v, normalizer=alpha, return_indices=True, **options)
    assert bool(jnp.any(indices == SENTINEL))

    def mosaic(q, k, v, alpha):
        return pallas_block_list_attention(
            q, k, v, indices, block_size=(128, 128), normalizer=alpha, target="mosaic",
            interpret=True,
        )  # fmt: skip

    def xla(q, k, v, alpha):
        return topk_block_attention(q, k, v, normalizer=alpha, **options)

    (_, out), grads = _value_and_grads(mosaic, cot, True)(q, k, v, alpha)
    with jax.default_matmul_precision("highest"):
        (_, ref), ref_grads = _value_and_grads(xla, cot, True)(q, k, v, alpha)
    _assert_close(out, grads, ref, ref_grads)
    kernels = _pallas_kernels(jax.grad(lambda q: jnp.sum(mosaic(q, k, v, alpha))), q)
    assert kernels == {f"sparse_jax_mosaic_entmax_{part}" for part in ("fwd", "dq", "dkv")}


def test_the_triton_kernels_run_on_tiles_cut_from_the_blocks():
    """``forward_block`` smaller than the blocks: each listed block becomes its tiles (the
    empty tiles above a causal diagonal dropped), and the kernels run on the tiles; values and
    gradients are the XLA engine's on the blocks."""
    b, t, n, kh, d = 1, 88, 2, 1, 8
    q, k, v, cot = _inputs(b, t, t, n, kh, d, seed=9)
    options = {"keep_blocks": 1, "block_size": (32, 32), "normalizer": "sparsemax"}
    _, indices = topk_block_attention(q, k, v, return_indices=True, **options)

    def tiled(q, k, v, alpha):
        return pallas_block_list_attention(
            q, k, v, indices, block_size=(32, 32), normalizer="sparsemax", forward_block=(16, 16)
        )

    def xla(q, k, v, alpha):
        return topk_block_attention(q, k, v, **options)

    (_, out), grads = _value_and_grads(tiled, cot, False)(q, k, v, None)
    with jax.default_matmul_precision("highest"):
        (_, ref), ref_grads = _value_and_grads(xla, cot, False)(q, k, v, None)
    _assert_close(out, grads, ref, ref_grads)
    grids = _kernel_grids(jax.grad(lambda q: jnp.sum(tiled(q, k, v, None))), q)
    assert {name: grid[0] for name, grid in grids.items()} == {  # 6 tiles of 16 per axis
        f"sparse_jax_pallas_sparsemax_{part}": 6 for part in ("fwd", "dq", "dkv")
    }


def _list_mask(indices, tq, tk, bq, bkv, causal):
    """numpy bool ``[B, N, Tq, Tk]``: the mask a block list defines."""
    b, n, nq, _ = indices.shape
    nk = -(-tk // bkv)
    blocks = np.zeros((b, n, nq, nk), bool)
    for bb, h, r, c in zip(*np.nonzero(indices >= 0), strict=True):
        blocks[bb, h, r, indices[bb, h, r, c]] = True
    dense = blocks.repeat(bq, axis=2).repeat(bkv, axis=3)[:, :, :tq, :tk]
    if causal:
        dense &= np.tril(np.ones((tq, tk), bool))
    return dense


@pytest.mark.parametrize("causal", [True, False])
def test_a_hand_made_list_matches_dense_attention_under_its_mask(causal):
    """Entries in any order, SENTINEL gaps between them, a block after the diagonal (nothing
    allowed under ``causal``: dropped), a query block with no block (output and gradients
    0), grouped-query heads, a length that is not a multiple of the blocks."""
    b, t, n, kh, d = 1, 72, 2, 1, 8
    q, k, v, cot = _inputs(b, t, t, n, kh, d, seed=7)
    indices = np.array(
        [[[[0, -1, -1], [-1, 1, 0], [2, -1, 4], [-1, -1, -1], [4, 0, 2]],
          [[0, 3, -1], [1, -1, -1], [0, 2, 1], [3, 1, -1], [-1, -1, 4]]]],
        np.int32,
    )  # fmt: skip
    mask = _list_mask(indices, t, t, 16, 16, causal)
    assert not mask[0, 0, 48:64].any()  # query block 3 of head 0: nothing to attend to

    def pallas(q, k, v, alpha):
        return pallas_block_list_attention(
            q, k, v, jnp.asarray(indices), block_size=(16, 16), causal=causal,
            normalizer="entmax15",
        )  # fmt: skip

    def dense(q, k, v, alpha):
        return attention(q, k, v, mask=jnp.asarray(mask), normalizer="entmax15", impl="xla")

    (_, out), grads = _value_and_grads(pallas, cot, False)(q, k, v, None)
    with jax.default_matmul_precision("highest"):
        (_, ref), ref_grads = _value_and_grads(dense, cot, False)(q, k, v, None)
    _assert_close(out, grads, ref, ref_grads)
    assert not np.asarray(out)[0, 48:64, 0].any() and not np.asarray(grads[0])[0, 48:64, 0].any()
    assert _pallas_kernels(pallas, q, k, v, None) == {"sparse_jax_pallas_entmax15_fwd"}


def test_the_transposed_lists_hold_every_kept_block_once():
    """``block_list_arrays``: each row's kept blocks first (the bound's empty blocks and the
    out-of-range entries dropped), and the transposed lists holding each (query block, slot)
    of a key block once, query blocks in increasing order."""
    rng = np.random.default_rng(0)
    b, n, nq, nk, width = 2, 3, 6, 6, 4
    indices = np.full((b, n, nq, width), SENTINEL, np.int32)
    for bb, h, r in np.ndindex(b, n, nq):
        chosen = rng.choice(nk + 1, size=rng.integers(0, width + 1), replace=False)
        indices[bb, h, r, : len(chosen)] = chosen  # nk: out of range, dropped
    rng.shuffle(indices, axis=-1)
    bound = causal_mask().blocks(96, 96, 16, 16)  # (no padding: the blocks before r are full)
    a = block_list_arrays(jnp.asarray(indices), bound, 4, 8)
    a = {key: np.asarray(x) for key, x in a.items()}
    for head, (bb, h) in enumerate(np.ndindex(b, n)):
        for r in range(nq):
            kept = [c for c in indices[bb, h, r] if 0 <= c < nk and c <= r]  # causal bound
            count = a["count"][head, r, 0]
            assert count == len(kept)
            assert a["idx"][head, r, :count].tolist() == kept
            full = [int(c < r) for c in kept]  # the diagonal block is partial
            assert a["full"][head, r, :count].tolist() == full
        for c in range(nk):
            rows = [r for r in range(nq) if c in indices[bb, h, r] and c <= r]
            count = a["t_count"][head, c, 0]
            assert a["t_rows"][head, c, :count].tolist() == rows
            slots = a["t_slots"][head, c, :count]
            assert a["idx"][head, a["t_rows"][head, c, :count], slots].tolist() == [c] * count
    full_bound = full_mask().blocks(96, 96, 16, 16)
    a = block_list_arrays(jnp.asarray(indices), full_bound, 4, 8)
    assert int(a["count"].sum()) == int(np.sum((indices >= 0) & (indices < nk)))


def test_auto_takes_pallas_on_gpu_and_xla_on_cpu(monkeypatch):
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16)

    def run(q, k, v, **options):
        return topk_block_attention(
            q, k, v, keep_blocks=1, block_size=(16, 16), impl="auto", **options
        )

    with monkeypatch.context() as patch:  # as on a CPU (on any machine): the XLA engine
        patch.setattr(jax, "default_backend", lambda: "cpu")
        assert not _pallas_kernels(run, q, k, v)
        np.testing.assert_array_equal(
            run(q, k, v), topk_block_attention(q, k, v, keep_blocks=1, block_size=(16, 16))
        )
    with monkeypatch.context() as patch:  # traced only, as on a GPU (interpreted, so that
        patch.setattr(jax, "default_backend", lambda: "gpu")  # no GPU program is cached)
        kernels = _pallas_kernels(lambda q, k, v: run(q, k, v, interpret=True), q, k, v)
        assert kernels == {"sparse_jax_pallas_softmax_fwd"}

        def weights(q, k, v):  # the kernels never form the weights: the XLA engine
            return run(q, k, v, return_weights=True)[0]

        assert not _pallas_kernels(weights, q, k, v)


def test_bad_arguments_are_refused_with_their_name():
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16)
    options = {"keep_blocks": 1, "block_size": (16, 16)}
    for kwargs, error, match in [
        ({"impl": "cuda"}, ValueError, r"`impl`='cuda'; allowed: \('xla', 'pallas', 'auto'\)"),
        ({"impl": "pallas", "block_size": (24, 16)}, ValueError, r"`block_size\[0\]`=24"),
        ({"impl": "pallas", "return_weights": True}, ValueError, "return_weights"),
        ({"impl": "xla", "interpret": True}, ValueError, "`interpret`=True is for the Pallas"),
        ({"impl": "pallas", "interpret": "yes"}, TypeError, "interpret"),
    ]:
        with pytest.raises(error, match=match):
            topk_block_attention(q, k, v, **{**options, **kwargs})
    with pytest.raises(ValueError, match="float64"):
        topk_block_attention(np.float64(q), np.float64(k), np.float64(v), impl="pallas", **options)

    indices = jnp.zeros((1, 2, 4, 2), jnp.int32)
    for kwargs, error, match in [
        ({"indices": indices.astype(jnp.float32)}, TypeError, "`indices` must be an int array"),
        ({"indices": indices[:, :, :3]}, ValueError, r"`indices` must have shape \[B, N, nq, K\]"),
        ({"target": "cuda"}, ValueError, "`target` must be None, 'triton' or 'mosaic'"),
        ({"target": "mosaic"}, ValueError, r"`block_size\[0\]`=16 is not a multiple of 128"),
        ({"forward_block": (32, 16)}, ValueError, "`forward_block`=\\(32, 16\\) must be powers"),
        ({"causal": 1}, TypeError, "causal"),
        ({"normalizer": "relu"}, ValueError, "normalizer"),
    ]:
        kwargs = {"indices": indices, **kwargs}
        with pytest.raises(error, match=match):
            pallas_block_list_attention(q, k, v, block_size=(16, 16), interpret=True, **kwargs)


@pytest.mark.parametrize(
    ("target", "platform", "block", "normalizer"),
    [("triton", "cuda", 64, "sparsemax"), ("mosaic", "tpu", 128, "softmax")],
)
def test_the_block_list_kernels_lower_for_their_chips(target, platform, block, normalizer,
                                                      monkeypatch):  # fmt: skip
    """Forward and backward over a run-time list lower through Pallas' Triton (GPU) and Mosaic
    (TPU) backends, cross-lowered on this machine (an index map or op the backend cannot
    express fails here; what only the chip's own compiler checks does not)."""
    # target='mosaic' is refused on a GPU backend (it would compile there); lowering for a TPU,
    # which any machine can do, is what is checked: on a GPU this reads as the CPU's.
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    q = jnp.zeros((2, 384, 2, 64), jnp.bfloat16)
    k = jnp.zeros((2, 384, 1, 64), jnp.bfloat16)
    nq = 384 // block
    indices = jnp.zeros((2, 2, nq, 2), jnp.int32)

    def loss(q, k, v, indices):
        out = pallas_block_list_attention(
            q, k, v, indices, block_size=(block, block), normalizer=normalizer,
            interpret=False, target=target,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.trace(q, k, k, indices).lower(lowering_platforms=(platform,)).as_text()
    prefix = "sparse_jax_pallas" if target == "triton" else "sparse_jax_mosaic"
    for part in ("fwd", "dq", "dkv"):
        assert f"{prefix}_{normalizer}_{part}" in text
