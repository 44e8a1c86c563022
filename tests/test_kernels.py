"""The fused Pallas kernels (sparse_jax.kernels) in interpret mode against the XLA reference.

One parametrised grid (each row a normalizer with a mask, shape and dtype; not the product),
values and gradients of q, k, v and, where it is an array, α and the scale. Small shapes: the
kernels run in Pallas' interpret mode on CPU.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import attention, attention_impl, masks
from sparse_jax.kernels import TRITON_TILE, pallas_attention, pallas_supports, tilemath, triton
from sparse_jax.kernels.flash import capped_forward
from sparse_jax.kernels.plan import Plan, expression, layout_arrays, refine, refined_live
from tests.engines import assert_engine

# name: (normalizer, mask, (B, Tq, Tk, N, Kh, D), dtype, block, bias shape or None); the bias
# shapes cover a full bias (with -inf entries), one per key, one per query row, one per head.
CASES = {
    "softmax-causal-row-bias": (
        "softmax", masks.causal(), (1, 64, 64, 2, 2, 8), jnp.float32, 16, (1, 2, 64, 1),
    ),
    "sparsemax-per-head": (
        "sparsemax",
        masks.per_head([masks.causal() & masks.local(20, 0), masks.causal() & masks.sink(4)]),
        (1, 64, 64, 2, 2, 8), jnp.float32, 16, (2, 1, 1),
    ),
    "entmax15-cross-full-bias": (
        "entmax15", masks.local(24, 24), (2, 40, 72, 2, 1, 12), jnp.float32, 16, (2, 2, 40, 72),
    ),
    "alpha-heads-gqa-key-bias": (
        "alpha", masks.causal() & (masks.local(16, 0) | masks.sink(2)), (1, 64, 64, 4, 2, 8),
        jnp.float32, 16, (64,),
    ),
    "alpha-2.5-window": (
        2.5, masks.causal() & masks.local(24, 0), (1, 64, 64, 2, 2, 8), jnp.float32, 16, None,
    ),
    "sparsemax-padding": (
        "sparsemax", masks.causal() & masks.padding(np.array([40, 17])), (2, 64, 64, 2, 2, 8),
        jnp.float32, 16, None,
    ),
    "entmax15-segments-padding-gqa": (
        "entmax15",
        masks.causal()
        & masks.segments(np.array([[0] * 20 + [1] * 30 + [2] * 14, [5] * 64]))
        & masks.padding(np.array([60, 50])),
        (2, 64, 64, 2, 1, 8), jnp.float32, 16, None,
    ),
    # Run-time leaves under | and ~, evaluated tile by tile: a prefix-LM mask with a run-time
    # prefix per batch element; packed sequences with sinks shared across them, keys before a
    # run-time start masked (batch 0's first rows see no key: zero output and gradients).
    "sparsemax-prefix-lm-gqa": (
        "sparsemax", masks.causal() | masks.padding(np.array([13, 40])), (2, 64, 64, 2, 1, 8),
        jnp.float32, 16, None,
    ),
    "alpha-segments-or-sinks-not-padding": (
        "alpha",
        ((masks.causal() & masks.segments(np.array([[0] * 24 + [1] * 40, [2] * 30 + [3] * 34])))
         | masks.sink(3))
        & ~masks.padding(np.array([4, 0])),
        (2, 64, 64, 2, 2, 8), jnp.float32, 16, None,
    ),
    "sparsemax-window-gqa-bf16": (
        "sparsemax", masks.causal() & masks.local(24, 0), (1, 64, 64, 2, 1, 16), jnp.bfloat16, 32,
        None,
    ),
}  # fmt: skip


def _bias(shape):
    if shape is None:
        return None
    bias = jax.random.normal(jax.random.PRNGKey(7), shape)
    if len(shape) == 4 and shape[-1] > 1 and shape[-2] > 1:  # some entries masked by the bias
        bias = bias.at[..., 3::7].set(-jnp.inf)
    return bias


def _inputs(shape, dtype, seed=0):
    b, tq, tk, n, kh, d = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, tq, n, d)) * 1.5
    k = jax.random.normal(keys[1], (b, tk, kh, d)) * 1.5
    v = jax.random.normal(keys[2], (b, tk, kh, d))
    cot = jax.random.normal(keys[3], (b, tq, n, d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), cot


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_match_the_xla_reference(case):
    norm, mask, shape, dtype, block, bias_shape = CASES[case]

    def pallas(q, k, v, normalizer, scale, bias):
        return attention(q, k, v, mask=mask, normalizer=normalizer, scale=scale, bias=bias,
                         impl="pallas", block_size=(block, block))  # fmt: skip

    _assert_matches_the_reference(pallas, norm, mask, shape, dtype, bias_shape)


# Tiles cut from the layout's blocks: the backward's half the forward's (backward_block, the
# forward pass' live flags mapped onto them), both passes' half the blocks (forward_block), the
# two cuts at once (blocks 4x the backward's tiles), and the two backward kernels on tiles of
# their own, each rectangular (dq_block: twice as many rows as keys, the dk/dv kernel's the
# reverse).
_TILE_CASES = ["softmax-causal-row-bias", "sparsemax-per-head", "entmax15-cross-full-bias",
               "alpha-heads-gqa-key-bias", "entmax15-segments-padding-gqa",
               "sparsemax-prefix-lm-gqa"]  # fmt: skip


@pytest.mark.parametrize(
    ("cut", "case"),
    [("backward", case) for case in _TILE_CASES]
    + [("both passes", case) for case in _TILE_CASES]
    + [("forward then backward", case) for case in _TILE_CASES[1:3]]
    + [("dq tiles", case) for case in _TILE_CASES[1:4]],
)
def test_tiles_cut_from_the_blocks_match_the_reference(cut, case):
    norm, mask, shape, dtype, block, bias_shape = CASES[case]
    layout_block, forward = {"backward": (2, 2), "both passes": (2, 1)}.get(cut, (4, 2))
    if cut == "dq tiles":
        layout_block = forward = 2
    layout = mask.blocks(shape[1], shape[2], layout_block * block, layout_block * block)
    tiles = {"forward_block": (forward * block,) * 2, "backward_block": (block, block)}
    if cut == "dq tiles":
        tiles.update(backward_block=(block, 2 * block), dq_block=(2 * block, block))

    def pallas(q, k, v, normalizer, scale, bias):
        return pallas_attention(q, k, v, layout, mask=mask, normalizer=normalizer, scale=scale,
                                bias=bias, **tiles)  # fmt: skip

    _assert_matches_the_reference(pallas, norm, mask, shape, dtype, bias_shape)


# dq added by the dk/dv kernel's atomic adds: every kind of bias and its row sums, a learnable
# α's and the scale's row terms, grouped-query heads, run-time masks, bfloat16, backward tiles.
_ATOMIC_CASES = ["softmax-causal-row-bias", "entmax15-cross-full-bias", "alpha-heads-gqa-key-bias",
                 "entmax15-segments-padding-gqa", "sparsemax-prefix-lm-gqa",
                 "sparsemax-window-gqa-bf16"]  # fmt: skip


@pytest.mark.parametrize("case", _ATOMIC_CASES)
def test_atomic_dq_accumulation_matches_the_reference(case):
    norm, mask, shape, dtype, block, bias_shape = CASES[case]
    layout = mask.blocks(shape[1], shape[2], 2 * block, 2 * block)

    def pallas(q, k, v, normalizer, scale, bias):
        return pallas_attention(q, k, v, layout, mask=mask, normalizer=normalizer, scale=scale,
                                bias=bias, backward_block=(block, block),
                                dq_accumulation="atomic")  # fmt: skip

    _assert_matches_the_reference(pallas, norm, mask, shape, dtype, bias_shape)


@pytest.mark.parametrize(("normalizer", "adds"), [("softmax", 1), ("alpha", 4)])
def test_atomic_dq_accumulation_runs_in_the_dkv_kernel(normalizer, adds):
    """One backward kernel, not two, in the program lowered for a GPU (Triton IR with
    atomic read-modify-writes), and in the traced one the atomic adds of dq and of each row
    term the call asks for: the scale's and α's arrays and the bias' rows (``alpha``)."""
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    layout = (masks.causal() & masks.local(32, 0)).blocks(128, 128, 64, 64)
    alpha, bias = jnp.full((4,), 1.3), jnp.zeros((1, 4, 128, 1))
    if normalizer == "softmax":
        alpha = bias = None

    def grad(mode):
        def loss(q, alpha, bias):
            norm = normalizer if alpha is None else alpha
            scale = None if alpha is None else jnp.float32(0.1)
            out = pallas_attention(q, q, q, layout, normalizer=norm, bias=bias, scale=scale,
                                   interpret=False, dq_accumulation=mode)  # fmt: skip
            return jnp.sum(out.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2) if alpha is not None else 0))

    for mode, kernels in [("separate", 3), ("atomic", 2)]:
        text = grad(mode).trace(q, alpha, bias).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == kernels, mode
        assert ("\\00atomic_rmw\\00" in text) == (mode == "atomic"), mode
        jaxpr = str(jax.make_jaxpr(grad(mode))(q, alpha, bias))
        assert jaxpr.count("atomic_rmw") == (adds if mode == "atomic" else 0), mode


def _operand_loads_in_branches(fn, *args) -> dict[str, int]:
    """Per Pallas kernel of ``fn``'s program: the loads of a whole operand's tile (a ref of
    shape ``[128, 64]``: every key's keys or values, every query's rows or output gradients,
    in the tests' calls below) whose innermost enclosing construct is a ``cond`` branch (a
    loop inside a branch, like the output pass a tile may skip, starts afresh)."""

    def loads(jaxpr, in_branch):
        count = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "get" and in_branch:
                count += tuple(eqn.invars[0].aval.shape) == (128, 64)
            inner = name == "cond" or (in_branch and name not in ("while", "scan"))
            count += sum(loads(sub, inner) for sub in _sub_jaxprs(eqn))
        return count

    calls = _pallas_calls(fn, *args)
    return {name: loads(eqn.params["jaxpr"], False) for name, eqn in calls.items()}


def test_prefetch_moves_the_operand_loads_before_the_live_test():
    """The sparse kernels skip blocks without weight by a ``cond``: by default the skipped
    blocks' operands are loaded inside it (forward: v, in the search pass that accumulates the
    output and in the output pass; dq: k and v; dk/dv: q and do), with
    ``prefetch=True`` before it, in the loop's body where Triton pipelines loads."""
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    layout = masks.causal().blocks(128, 128, 64, 64)

    def grad(prefetch):
        def loss(q):
            out = pallas_attention(q, q, q, layout, normalizer="entmax15", prefetch=prefetch)
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss)

    name = "sparse_jax_pallas_entmax15_"
    # (the forward: the accumulating search pass' values and the output pass')
    assert _operand_loads_in_branches(grad(False), q) == {name + "fwd": 2, name + "dq": 2,
                                                          name + "dkv": 2}  # fmt: skip
    assert _operand_loads_in_branches(grad(True), q) == {name + "fwd": 0, name + "dq": 0,
                                                         name + "dkv": 0}  # fmt: skip


@pytest.mark.parametrize("case", ["sparsemax-per-head", "alpha-segments-or-sinks-not-padding"])
def test_prefetching_kernels_match_the_reference(case):
    norm, mask, shape, dtype, block, bias_shape = CASES[case]

    def prefetching(q, k, v, normalizer, scale, bias):
        layout = mask.blocks(shape[1], shape[2], block, block)
        return pallas_attention(q, k, v, layout, mask=mask, normalizer=normalizer, scale=scale,
                                bias=bias, prefetch=True)  # fmt: skip

    _assert_matches_the_reference(prefetching, norm, mask, shape, dtype, bias_shape)


def _first_programs_blocks(fn, *args) -> dict[str, int]:
    """Per Pallas kernel of ``fn``'s program: the block along the grid's first axis that its
    first program (ids 0, 0, 0) reads: query block of ``q`` (operand 3) in the forward and dq
    kernels, key block of ``k`` (operand 4) in the dk/dv kernel."""
    from jax.extend import core as jcore

    blocks = {}
    for name, eqn in _pallas_calls(fn, *args).items():
        grid_mapping = eqn.params["grid_mapping"]
        mapping = grid_mapping.block_mappings[4 if "dkv" in name else 3]
        ids = [jnp.int32(0)] * len(grid_mapping.grid)
        blocks[name] = int(jcore.jaxpr_as_fun(mapping.index_map_jaxpr)(*ids)[1])
    return blocks


@pytest.mark.parametrize(
    ("mask", "first_query_block", "first_key_block"),
    [(masks.causal(), 7, 0), (masks.local(0, 200), 0, 7), (masks.local(24, 24), 0, 0)],
)
def test_grids_launch_their_longest_programs_first(mask, first_query_block, first_key_block):
    """A causal mask's last query blocks keep the most key blocks, and (keys after the query)
    a key block's count grows along the keys: those grids start from their last block, which
    the kernels read back from the program id (the values are checked against the reference in
    every causal case above)."""
    q = jnp.zeros((1, 128, 1, 16))
    layout = mask.blocks(128, 128, 16, 16)

    def loss(q):
        return jnp.sum(pallas_attention(q, q, q, layout, normalizer="sparsemax"))

    name = "sparse_jax_pallas_sparsemax_"
    expected = {name + "fwd": first_query_block, name + "dq": first_query_block,
                name + "dkv": first_key_block}  # fmt: skip
    assert _first_programs_blocks(jax.grad(loss), q) == expected
    # The values under the anti-causal mask, whose dk/dv grid is the reversed one; 56 keys, so
    # that the last key block's padding is masked by its position (read from the program id).
    if first_key_block:
        _assert_matches_the_reference(
            lambda q, k, v, normalizer, scale, bias: pallas_attention(
                q, k, v, mask.blocks(64, 56, 16, 16), normalizer=normalizer, scale=scale,
                bias=bias),
            "entmax15", mask, (1, 64, 56, 2, 2, 8), jnp.float32, bias_shape=(1, 2, 64, 1),
        )  # fmt: skip


def test_atomic_dq_accumulation_and_prefetch_are_refused_where_they_cannot_run():
    q = jnp.zeros((1, 128, 1, 16))
    layout = masks.causal().blocks(128, 128, 128, 128)
    with pytest.raises(ValueError, match="`dq_accumulation` must be None, 'separate' or 'atomic'"):
        pallas_attention(q, q, q, layout, dq_accumulation="atomics")
    with pytest.raises(ValueError, match="`dq_accumulation`='atomic' is for the Triton kernels"):
        pallas_attention(q, q, q, layout, target="mosaic", interpret=True, dq_accumulation="atomic")
    with pytest.raises(TypeError, match="`prefetch` must be None or a bool; got 1"):
        pallas_attention(q, q, q, layout, prefetch=1)
    with pytest.raises(ValueError, match="`prefetch` is for the Triton kernels"):
        pallas_attention(q, q, q, layout, target="mosaic", interpret=True, prefetch=True)


def test_the_triton_kernels_run_on_64_tiles_unless_told_otherwise():
    q = jnp.zeros((1, 512, 2, 16), jnp.float32)
    layout = masks.causal().blocks(512, 512, 128, 128)

    def grids(**tiles):
        def loss(q):
            return jnp.sum(pallas_attention(q, q, q, layout, normalizer="sparsemax", **tiles))

        found = _kernel_grids(jax.grad(loss), q)
        return found["fwd"][0], found["dq"][0], found["dkv"][0]

    assert TRITON_TILE == 64
    assert grids() == (8, 8, 8)  # 512 / 64 query and key tiles in every kernel
    assert grids(forward_block=(128, 128)) == (4, 4, 4)
    assert grids(forward_block=(128, 128), backward_block=(32, 64)) == (4, 16, 8)
    assert grids(backward_block=(16, 16)) == (8, 32, 32)
    # the dq kernel on its own tiles, a program per 32 query rows; dk/dv's per 128 keys (64)
    assert grids(forward_block=(128, 128), backward_block=(32, 128), dq_block=(32, 64)) == (
        4, 16, 4)  # fmt: skip
    assert grids(dq_block=(32, 64)) == (8, 16, 8)  # dk/dv on the forward's 64 x 64 tiles
    small = masks.causal().blocks(512, 512, 32, 32)  # blocks below the default tile: their own
    loss = lambda q: jnp.sum(pallas_attention(q, q, q, small))
    assert _kernel_grids(jax.grad(loss), q)["fwd"][0] == 16


def _assert_matches_the_reference(pallas, norm, mask, shape, dtype, bias_shape):
    """``pallas(q, k, v, normalizer, scale, bias)`` against impl="xla": values and the
    gradients of q, k, v, an α array, the scale and the bias."""
    q, k, v, cot = _inputs(shape, dtype)
    n = shape[3]
    alpha = jnp.linspace(1.2, 1.9, n) if norm == "alpha" else None
    scale = jnp.float32(0.4)
    bias = _bias(bias_shape)

    def xla(q, k, v, normalizer, scale, bias):
        return attention(q, k, v, mask=mask, normalizer=normalizer, scale=scale, bias=bias,
                         impl="xla")  # fmt: skip

    def loss(run):
        def fn(q, k, v, alpha, scale, bias):
            out = run(q, k, v, norm if alpha is None else alpha, scale, bias)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)

    (_, out), grads = jax.jit(loss(pallas))(q, k, v, alpha, scale, bias)
    (_, ref), ref_grads = jax.jit(loss(xla))(q, k, v, alpha, scale, bias)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=tol, rtol=tol)
    names = ("q", "k", "v", "alpha", "scale", "bias")
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        if r is None:
            continue
        g, r = np.float32(g), np.float32(r)
        # bfloat16: the kernels and the reference round p (and ds) to bfloat16 at different
        # points; compare against the gradient's own scale.
        atol = tol * max(1.0, float(np.abs(r).max())) * (1 if dtype == jnp.float32 else 4)
        if name == "scale":  # sum(q * dq) / scale: a sum whose terms cancel; judge by their size
            atol *= float(np.sum(np.abs(np.float32(q) * np.float32(ref_grads[0])))) / 0.4
        np.testing.assert_allclose(g, r, atol=atol, rtol=tol, err_msg=name)


@pytest.mark.parametrize(
    "mask",
    [masks.causal(), masks.causal() & (masks.local(20, 0) | masks.sink(3)), masks.local(9, 30),
     masks.per_head([masks.causal() & masks.local(24, 0), masks.causal(), masks.sink(5)])],
)  # fmt: skip
@pytest.mark.parametrize("cuts", [[(16, 16)], [(32, 32), (16, 16)]])
def test_the_layout_cut_into_smaller_tiles_is_the_layout_of_those_tiles(mask, cuts):
    """refine of a (64, 32)-block layout into (16, 16) tiles, at once or through (32, 32)
    tiles (the forward's, then the backward's), keeps the same elements, and the same full /
    partial / dropped tiles, as the mask's own (16, 16) layout."""

    def elements(arrays, bq, bkv, nq, nk):
        h, rows = arrays["count"].shape[:2]
        out = np.zeros((h, nq * bq, nk * bkv), int)
        for hh, row in np.ndindex(h, rows):
            for slot in range(arrays["count"][hh, row, 0]):
                col, full = arrays["idx"][hh, row, slot], arrays["full"][hh, row, slot]
                tile = 2 if full else arrays["masks"][arrays["pmi"][hh, row, slot]]
                out[hh, row * bq : (row + 1) * bq, col * bkv : (col + 1) * bkv] += tile
        return out

    tq, tk = 100, 90
    source = mask.blocks(tq, tk, 64, 32)
    for cut in cuts:
        coarse = layout_arrays(source)
        tiles, parent = refine(source, *cut)
        refined = layout_arrays(tiles)
        fq, fk = source.block_q // cut[0], source.block_kv // cut[1]
        for hh, row in np.ndindex(*refined["count"].shape[:2]):
            for slot in range(refined["count"][hh, row, 0]):  # each tile inside its parent block
                parent_block = coarse["idx"][hh, row // fq, parent[hh, row, slot]]
                assert refined["idx"][hh, row, slot] // fk == parent_block
        source = tiles
    direct = layout_arrays(mask.blocks(tq, tk, 16, 16))
    nq, nk = refined["count"].shape[1], 3 * 32 // 16  # every block's tiles, padding included
    assert nq == 2 * 64 // 16 and tiles.num_kv_blocks == nk
    ours, theirs = elements(refined, 16, 16, nq, nk), elements(direct, 16, 16, nq, nk)
    np.testing.assert_array_equal(ours, theirs)  # 2: a full tile, 1: a partial tile's element


def test_a_live_block_keeps_every_tile_cut_from_it_live():
    live = jnp.array([[[[1, 0, 1, 0]]]])  # [B, N, nq, Kp]: slots 0 and 2 of the one row live
    parent = np.array([[[0, 0, 1, 2], [2, 3, 0, 0]]])  # [H, nq', Kp'] with fq = 2
    refined = refined_live(live, parent, 2)
    assert refined.tolist() == [[[[1, 1, 0, 1], [1, 0, 1, 1]]]]


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15", 1.3])
def test_the_capped_forward_stops_the_search_and_is_attention_when_it_may_finish(normalizer):
    q, k, v, _ = _inputs((1, 64, 64, 2, 2, 16), jnp.float32)
    q = q / 6  # flat rows: wide supports, far from the start on the 4 largest values
    layout = masks.causal().blocks(64, 64, 16, 16)
    exact = pallas_attention(q, k, v, layout, normalizer=normalizer)

    def capped(passes):
        return capped_forward(q, k, v, layout, search_passes=passes, normalizer=normalizer)

    np.testing.assert_allclose(capped(100), exact, atol=2e-6)
    stopped = np.asarray(capped(0))
    assert np.isfinite(stopped).all() and np.abs(stopped - np.asarray(exact)).max() > 1e-3
    if normalizer == 1.3:
        return
    # to the end from another start: the same attention; stopped at 0 passes, the start shows
    # (of the 8 values 4 blocks keep, the kernels' start uses them all)
    for top in (1, 4):
        run = functools.partial(capped_forward, q, k, v, layout, normalizer=normalizer,
                                start_values=top)  # fmt: skip
        np.testing.assert_allclose(run(search_passes=None), exact, atol=2e-6)
        assert np.abs(np.asarray(run(search_passes=0)) - stopped).max() > 1e-4, top


def test_the_capped_forward_refuses_what_it_cannot_time():
    q = jnp.zeros((1, 32, 1, 16))
    layout = masks.causal().blocks(32, 32, 16, 16)
    for passes, options, error, match in [
        (-1, {"normalizer": "sparsemax"}, ValueError, "`search_passes` must be"),
        (1, {"normalizer": "sparsemax", "start_values": 0}, ValueError, "`start_values` must"),
        (1, {}, ValueError, "a sparse normalizer on the Triton kernels only; got 'softmax'"),
        (1, {"normaliser": "sparsemax"}, TypeError, "unknown options \\['normaliser'\\]"),
        (1, {"normalizer": "sparsemax", "num_warps": 3}, ValueError, "capped_forward: `num_warps`"),
    ]:  # fmt: skip
        with pytest.raises(error, match=match):
            capped_forward(q, q, q, layout, search_passes=passes, **options)


def test_the_dispatcher_runs_the_kernel_and_auto_takes_it_on_gpu_only():
    q, k, v, _ = _inputs((1, 64, 64, 2, 2, 8), jnp.float32)
    mask = masks.causal() & masks.local(16, 0)

    def run(q, k, v):
        return attention(
            q, k, v, mask=mask, normalizer="entmax15", impl="pallas", block_size=(16, 16)
        )

    assert_engine("pallas", run, q, k, v)
    assert "sparse_jax_pallas_entmax15_fwd" in str(jax.make_jaxpr(run)(q, k, v))
    choice = attention_impl(q, k, v, mask=mask, normalizer="entmax15", block_size=(16, 16))
    if jax.default_backend() == "gpu":  # (this test also runs on a GPU: .ci/gpu-check)
        assert choice.impl == "pallas", choice
    else:
        assert choice.impl in ("blocksparse", "xla"), choice


def test_fully_masked_rows_give_zero_output_and_gradients():
    allowed = np.tril(np.ones((32, 32), bool))
    allowed[5:9] = False  # four query rows see nothing
    mask = masks.from_array(allowed)
    q, k, v, cot = _inputs((1, 32, 32, 2, 2, 8), jnp.float32)
    layout = mask.blocks(32, 32, 16, 16)
    for norm in ("softmax", 1.7):

        def loss(q, k, v, norm=norm):
            return jnp.sum(pallas_attention(q, k, v, layout, normalizer=norm) * cot)

        out = pallas_attention(q, k, v, layout, normalizer=norm)
        dq = jax.grad(loss)(q, k, v)
        assert float(jnp.abs(out[:, 5:9]).max()) == 0.0
        assert float(jnp.abs(dq[:, 5:9]).max()) == 0.0
        assert bool(jnp.isfinite(out).all()) and bool(jnp.isfinite(dq).all())


def test_ties_at_the_threshold_match_the_reference():
    # Integer scores with many equal values: ties at τ are where supports are decided.
    idx = jnp.arange(32)
    q = jnp.stack([(idx % 3).astype(jnp.float32), jnp.ones(32)], -1)[None, :, None, :]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, 14)))
    k = jnp.stack([(idx % 2).astype(jnp.float32), (idx % 4 == 0).astype(jnp.float32)], -1)
    k = jnp.pad(k[None, :, None, :], ((0, 0), (0, 0), (0, 0), (0, 14)))
    v = jax.random.normal(jax.random.PRNGKey(1), (1, 32, 1, 16))
    mask = masks.causal()
    for norm in ("entmax15",):
        out = attention(q, k, v, mask=mask, normalizer=norm, impl="pallas", block_size=(16, 16),
                        scale=1.0)  # fmt: skip
        ref = attention(q, k, v, mask=mask, normalizer=norm, impl="xla", scale=1.0)
        np.testing.assert_allclose(out, ref, atol=1e-6)


def _count_weight_tiles(monkeypatch) -> list:
    """A list that grows by one, at run time, for each tile whose weights a kernel forms from
    its thresholds (kernels.tilemath.weights): in a forward, the output pass' blocks. The kernels
    must run interpreted (``interpret=True``): Triton lowers no host callback."""
    calls = []
    weights = tilemath.weights

    def counted(*args):
        jax.debug.callback(lambda: calls.append(1))
        return weights(*args)

    monkeypatch.setattr(tilemath, "weights", counted)
    return calls


def test_sparsemax_takes_an_output_pass_only_where_its_search_did_not_confirm_every_row(
    monkeypatch,
):
    """Sparsemax's search passes accumulate the output: a tile whose last pass confirms every
    row's threshold takes no output pass (counted at run time: the output pass is where the
    forward forms weights), else one follows. Row 0..15 of the scores: 0, -0.5, -0.75 and -10
    elsewhere, whose threshold -0.75 ties with an entry: from the kernels' start (τ* itself)
    the pass confirms it; from a start on 1 value (τ0 = -1) the pass that finds it still has
    the tied entry in its set, so the output pass follows; a capped search and
    ``speculate=False`` take it too. Each forward is the reference's."""
    calls = _count_weight_tiles(monkeypatch)
    x = np.full(32, -10.0, np.float32)
    x[:3] = [0.0, -0.5, -0.75]
    q = jnp.zeros((1, 16, 1, 16)).at[..., 0].set(1.0)
    k = jnp.zeros((1, 32, 1, 16)).at[0, :, 0, 0].set(x)
    v = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 1, 16))
    mask = masks.local(32, 32)
    ref = attention(q, k, v, mask=mask, normalizer="sparsemax", impl="xla", scale=1.0)
    layout = mask.blocks(16, 32, 16, 16)
    for options, output_pass in [
        ({"search_passes": None}, False),
        ({"search_passes": None, "start_values": 1}, True),
        ({"search_passes": 1}, True),
        ({"search_passes": None, "speculate": False}, True),
    ]:
        calls.clear()
        out = capped_forward(q, k, v, layout, normalizer="sparsemax", scale=1.0,
                                interpret=True, **options)  # fmt: skip
        jax.block_until_ready(out)
        assert len(calls) == 2 * output_pass, options  # (a call per kept block)
        np.testing.assert_allclose(out, ref, atol=1e-6, err_msg=str(options))
    # Random scores (the reference grid checks their values): no tile takes the output pass.
    q, k, v, _ = _inputs((2, 64, 64, 2, 2, 8), jnp.float32)
    calls.clear()
    layout = masks.causal().blocks(64, 64, 16, 16)
    jax.block_until_ready(pallas_attention(q, k, v, layout, normalizer="sparsemax",
                                         interpret=True))  # fmt: skip
    assert not calls
    with pytest.raises(TypeError, match="`speculate` must be None or a bool; got 1"):
        capped_forward(q, k, v, layout, normalizer="sparsemax", search_passes=1, speculate=1)


def test_entmax15_accumulates_the_output_from_its_second_search_pass(monkeypatch):
    """1.5-entmax's passes accumulate the output from the second search pass on: tiles whose
    search the start leaves to two passes or more take no output pass (here all, from a start
    on 1 value), those done in one pass take it (some, from the kernels' start), and every
    tile with ``speculate=False`` (40 kept blocks: 10 per batch element and head). The output
    is the reference's either way, in float32 and (against the float32 reference, whose
    error the two ways share) bfloat16."""
    calls = _count_weight_tiles(monkeypatch)
    layout = masks.causal().blocks(128, 128, 32, 32)
    for dtype, tol in [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)]:
        q, k, v, _ = _inputs((2, 128, 128, 2, 2, 16), dtype)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref = attention(*f32, mask=masks.causal(), normalizer="entmax15", impl="xla")
        errors = {}
        for options, visits in [({"start_values": 1}, [0]), ({}, range(1, 40)),
                                ({"speculate": False}, [40])]:  # fmt: skip
            calls.clear()
            out = capped_forward(q, k, v, layout, normalizer="entmax15", search_passes=None,
                                    interpret=True, **options)  # fmt: skip
            jax.block_until_ready(out)
            assert len(calls) in visits, (dtype, options, len(calls))
            error = np.abs(np.float32(out) - np.float32(ref))
            np.testing.assert_allclose(np.float32(out), ref, atol=tol, err_msg=str(options))
            errors[tuple(options)] = float(error.mean())
        # accumulating keeps the output pass' accuracy (bfloat16: within a tenth)
        assert errors[("start_values",)] <= 1.1 * errors[("speculate",)] + 1e-7, errors


def test_blocks_below_the_threshold_are_skipped():
    # Query rows that score key block 0 far above the rest: sparsemax gives the later blocks
    # zero weight, and the forward pass marks them dead (skipped there and in the backward).
    q = jnp.zeros((1, 64, 1, 16)).at[..., 0].set(1.0)
    k = jnp.zeros((1, 64, 1, 16)).at[:, :16, :, 0].set(8.0)
    v = jax.random.normal(jax.random.PRNGKey(2), (1, 64, 1, 16))
    layout = masks.causal().blocks(64, 64, 16, 16)
    plan_out = pallas_attention(q, k, v, layout, normalizer="sparsemax", scale=1.0)
    ref = attention(q, k, v, mask=masks.causal(), normalizer="sparsemax", impl="xla", scale=1.0)
    np.testing.assert_allclose(plan_out, ref, atol=1e-6)
    live = _live_map(q, k, v, layout, "sparsemax")
    counts = layout.kv_block_counts[0]
    # Query block 3 keeps key blocks 0..3 but only block 0 holds weight.
    assert live[0, 0, 3, : counts[3]].tolist() == [1, 0, 0, 0]
    grads = jax.grad(
        lambda q, k, v: jnp.sum(
            pallas_attention(q, k, v, layout, normalizer="sparsemax", scale=1.0) * v
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    ref_grads = jax.grad(
        lambda q, k, v: jnp.sum(
            attention(q, k, v, mask=masks.causal(), normalizer="sparsemax", impl="xla", scale=1.0)
            * v
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    # dq is 0 up to rounding (16 tied keys with equal k): sums of 16 terms of 8·|ds| ~ 8.
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4)


def _live_map(q, k, v, layout, norm):
    """The forward pass's record of the key blocks holding weight, ``[B, N, nq, slots]``."""
    b, _, n, d = q.shape
    plan = Plan(
        kind=norm, sigma=None, b=b, n=n, g=1, bq=layout.block_q, bkv=layout.block_kv,
        nq=layout.num_q_blocks, nk=layout.num_kv_blocks, d=d, dv=v.shape[-1], per_head=0,
        interpret=True, segments=False, expr=None, kv_len=k.shape[1], target="triton",
        precision=None,
        bias_axes=(False,) * 4, arrays=layout_arrays(layout),
    )  # fmt: skip
    eps = jnp.zeros((n, 1), jnp.float32)
    lengths = jnp.full((b,), k.shape[1], jnp.int32)
    no_bias = jnp.zeros((1, 1, 1, 1), jnp.float32)
    key_nan = jnp.zeros((b, k.shape[2], k.shape[1]), jnp.float32)
    no_ids = (jnp.zeros((b, q.shape[1]), jnp.int32), jnp.zeros((b, k.shape[1]), jnp.int32))
    scale = jnp.ones(1, jnp.float32)
    _, res = triton.forward(plan, scale, lengths, eps, q, k, v, no_bias, key_nan, *no_ids)
    return np.asarray(res["live"])


class _TritonMinMax:
    """``jax.numpy`` with the float maximum and minimum that Pallas' Triton lowering emits
    (``maxnumf``/``minnumf``: where one operand is NaN, the other), where XLA's propagate NaN."""

    maximum = staticmethod(jnp.fmax)
    minimum = staticmethod(jnp.fmin)
    max = staticmethod(jnp.nanmax)
    min = staticmethod(jnp.nanmin)

    def __getattr__(self, name):
        return getattr(jnp, name)


@contextlib.contextmanager
def _kernel_numerics(numerics: str):
    """Traces the kernels (in interpret mode) with the min/max of ``numerics``: "xla" as is,
    "triton" as the GPU compiles them, so that a NaN policy that holds only under XLA's
    min/max fails here, not first on a GPU. The reference must be computed outside. On a GPU
    the kernels compile with Triton, so the "xla" case is the real one and "triton" skips."""
    if numerics == "xla":
        yield
        return
    if jax.default_backend() != "cpu":  # jnp.nanmax's reduce_and has no Triton lowering
        pytest.skip("compiled for a GPU, the kernels' min/max are Triton's own: see 'xla'")
    from sparse_jax.normalizers import alpha_entmax, exact

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton, "jnp", _TritonMinMax())  # the kernels
        patch.setattr(tilemath, "jnp", _TritonMinMax())  # the tile maths they call
        patch.setattr(exact, "jnp", _TritonMinMax())  # the searches' terms
        patch.setattr(alpha_entmax, "jnp", _TritonMinMax())
        yield


def test_the_triton_numerics_drop_nan_as_maxnum_does():
    x = jnp.array([[jnp.nan, -jnp.inf, 1.0], [jnp.nan, jnp.nan, -jnp.inf]])
    with _kernel_numerics("triton"):
        np.testing.assert_array_equal(triton.jnp.maximum(x[0], 0.0), [0.0, 0.0, 1.0])
        np.testing.assert_array_equal(triton.jnp.max(x, axis=-1), [1.0, -jnp.inf])
        assert float(triton.jnp.minimum(jnp.nan, 3.0)) == 3.0
    assert triton.jnp is tilemath.jnp is jnp and bool(jnp.isnan(triton.jnp.maximum(jnp.nan, 0.0)))


@pytest.mark.parametrize("numerics", ["xla", "triton"])
def test_non_finite_input_follows_the_attention_policy(numerics):
    q, k, v, _ = _inputs((1, 32, 32, 1, 1, 16), jnp.float32)
    q = q.at[0, 20, 0, 3].set(jnp.nan)  # query row 20 is NaN
    v = v.at[0, 25, 0, 1].set(jnp.inf)  # key 25: rows >= 25 (causal) become NaN
    mask = masks.causal()
    for norm in ("softmax", "entmax15", "sparsemax", 1.3):
        with _kernel_numerics(numerics):
            out = attention(q, k, v, mask=mask, normalizer=norm, impl="pallas", block_size=(16, 16))
        ref = attention(q, k, v, mask=mask, normalizer=norm, impl="xla")
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        finite = ~np.isnan(np.asarray(ref))
        np.testing.assert_allclose(np.asarray(out)[finite], np.asarray(ref)[finite], atol=1e-5)
        assert np.isnan(np.asarray(out)[0, 20]).all() and np.isnan(np.asarray(out)[0, 25:]).all()


@pytest.mark.parametrize("numerics", ["xla", "triton"])
@pytest.mark.parametrize("normalizer", ["sparsemax", "softmax", 1.3])
def test_a_non_finite_value_leaves_the_gradients_of_rows_that_mask_its_key_finite(
    normalizer, numerics
):
    q, k, v, cot = _inputs((1, 32, 32, 1, 1, 16), jnp.float32)
    v = v.at[0, 25, 0, 1].set(jnp.nan)  # key 25: only rows >= 25 allow it (causal)

    def grads(impl):
        def loss(q, k, v):
            out = attention(q, k, v, mask=masks.causal(), normalizer=normalizer, impl=impl,
                            block_size=(16, 16))  # fmt: skip
            return jnp.sum(out[:, :25] * cot[:, :25])

        return jax.grad(loss, argnums=(0, 1))(q, k, v)

    ref_dq, ref_dk = grads("xla")
    with _kernel_numerics(numerics):
        dq, dk = grads("pallas")
    assert np.isfinite(np.asarray(dq)[:, :25]).all()  # rows 16..24 share key 25's block
    # NaN where the reference has NaN (rows >= 25 are NaN rows: their terms in dk are NaN).
    np.testing.assert_allclose(dq, ref_dq, atol=1e-5)
    np.testing.assert_allclose(dk, ref_dk, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": (8, 16)}, r"block_size\[0\]`=8 is not a power of two >= 16"),
        ({"block_size": (16, 48)}, r"block_size\[1\]`=48"),
        (
            {"mask": masks.causal() | masks.padding(np.array([20])) | masks.padding(np.array([9]))},
            "at most one `padding` leaf",
        ),
        (
            {"mask": masks.from_array(np.tri(32, dtype=bool)) | masks.padding(np.array([20]))},
            "from_array is not evaluated in a kernel tile",
        ),
        (
            {"mask": (masks.causal() | masks.padding(np.array([20]))).with_offset(1)},
            "under with_offset",
        ),
        ({"mask": None}, "needs `mask` to be a sparse_jax.masks.Mask"),
        ({"return_weights": True}, "return_weights is not supported"),
    ],
)
def test_bad_arguments_are_refused_before_tracing(kwargs, match):
    q, k, v, _ = _inputs((1, 32, 32, 1, 1, 16), jnp.float32)
    call = {"mask": masks.causal(), "block_size": (16, 16), **kwargs}
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, impl="pallas", **call)


def test_run_time_leaves_under_or_and_not_are_evaluated_per_tile(monkeypatch):
    """A prefix-LM mask (causal | padding(prefix)) runs in the Triton kernels with the mask
    evaluated per tile (its tile expression; a mask of `&` only keeps the key lengths); the
    Mosaic kernels take it too (tests/test_kernels_mosaic.py runs them)."""
    q, k, v, _ = _inputs((2, 32, 32, 1, 1, 16), jnp.float32)
    prefix = np.array([5, 20])
    mask = masks.causal() | masks.padding(prefix)
    layout = mask.blocks(32, 32, 16, 16)
    expr = expression(mask, layout)
    assert expr is not None and expr.uses_padding and not expr.uses_segments
    assert expression(masks.causal() & masks.padding(prefix), layout) is None  # lengths

    def run(q, k, v, prefix):  # the prefix lengths traced
        m = masks.causal() | masks.padding(prefix)
        return attention(q, k, v, mask=m, impl="pallas", block_size=(16, 16))

    assert_engine("pallas", run, q, k, v, jnp.asarray(prefix))
    out = jax.jit(run)(q, k, v, jnp.asarray(prefix))
    ref = attention(q, k, v, mask=mask, impl="xla")
    np.testing.assert_allclose(out, ref, atol=2e-6)
    assert pallas_supports(q, layout, mask=mask, backend="gpu") == (True, "")
    assert pallas_supports(q, mask=mask, backend="tpu") == (True, "")
    # auto takes the kernel on a GPU; on a TPU another engine (the Mosaic kernels are not yet
    # measured there: impl="pallas" opts in).
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention_impl(q, k, v, mask=mask, block_size=(16, 16)).impl == "pallas"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    choice = attention_impl(q, k, v, mask=mask)
    assert choice.impl in ("blocksparse", "xla") and "not yet compiled" in choice.reason


def test_kernel_arguments_are_checked():
    q, k, v, _ = _inputs((1, 32, 32, 1, 1, 16), jnp.float32)
    layout = masks.causal().blocks(32, 32, 16, 16)
    with pytest.raises(ValueError, match="float64 is not supported"):
        x = np.zeros((1, 32, 1, 16))
        pallas_attention(x, x, x, layout)
    with pytest.raises(ValueError, match="built for"):
        pallas_attention(q, k, v, masks.causal().blocks(48, 48, 16, 16))
    with pytest.raises(ValueError, match="normalizer"):
        pallas_attention(q, k, v, layout, normalizer="softermax")
    with pytest.raises(TypeError, match="`interpret` must be None or a bool"):
        pallas_attention(q, k, v, layout, interpret="yes")


@pytest.mark.parametrize(
    ("normalizer", "per_head", "kv_heads", "dtype", "bias_shape", "block"),
    [
        ("softmax", False, 4, jnp.bfloat16, None, 32),
        ("sparsemax", True, 4, jnp.bfloat16, (1, 4, 128, 128), 128),
        ("entmax15-packed", False, 2, jnp.float16, (1, 1, 1, 128), 128),
        ("softmax-or", False, 4, jnp.bfloat16, None, 32),
        ("alpha", False, 4, jnp.float32, (1, 4, 128, 1), 32),
    ],
)
def test_the_kernels_lower_to_triton_for_gpus(
    normalizer, per_head, kv_heads, dtype, bias_shape, block
):
    """Forward and backward lower through Pallas' Triton backend (cross-lowered for CUDA on
    this CPU machine: no GPU needed to catch an op that Triton cannot express); blocks of 128
    run on the default tiles of 64 cut from them."""
    q = jnp.zeros((1, 128, 4, 64), dtype)
    k = jnp.zeros((1, 128, kv_heads, 64), dtype)
    window = masks.causal() & masks.local(32, 0)
    mask = masks.per_head([window, masks.causal()] * 2) if per_head else window
    if normalizer.endswith("-packed"):  # run-time segment ids and lengths (packed sequences)
        normalizer = normalizer.removesuffix("-packed")
        ids = np.repeat(np.arange(4), 128 // 4)[None]
        mask = mask & masks.segments(ids) & masks.padding(np.array([128 - 7]))
    if normalizer.endswith("-or"):  # run-time leaves under | and ~, evaluated per tile
        normalizer = normalizer.removesuffix("-or")
        ids = np.repeat(np.arange(4), 128 // 4)[None]
        mask = (mask & ~masks.segments(ids)) | masks.padding(np.array([16]))
    layout = mask.blocks(128, 128, block, block)
    alpha = jnp.full((4,), 1.3) if normalizer == "alpha" else None
    bias = None if bias_shape is None else jnp.zeros(bias_shape)

    def loss(q, k, v, alpha, bias):
        norm = normalizer if alpha is None else alpha
        out = pallas_attention(
            q, k, v, layout, mask=mask, normalizer=norm, bias=bias, interpret=False
        )
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    text = jax.jit(grad).trace(q, k, k, alpha, bias).lower(lowering_platforms=("cuda",)).as_text()
    # forward, dq and dk/dv: three Triton kernels in the lowered program
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_the_softmax_kernels_take_exp2_on_gpus():
    """Softmax's exponentials are ex2 instructions in the Triton kernels (libdevice's exp2f),
    not libdevice's expf with its range reduction: every score takes one in each kernel."""
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    layout = masks.causal().blocks(128, 128, 64, 64)

    def loss(q):
        out = pallas_attention(q, q, q, layout, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    text = jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    assert text.count("__nv_exp2f") == 3 and "__nv_expf" not in text


def test_ragged_lengths_and_a_dense_bias_lower_to_triton():
    """Tq, Tk and the head dim off the blocks (padded inside) with a bias of both length axes,
    whose gradient the dk/dv kernel clears tile by tile: Triton takes only power-of-two tiles,
    so a tile of all nq * bq query rows (48 here) must never appear."""
    q, k = jnp.zeros((2, 40, 2, 12)), jnp.zeros((2, 72, 1, 12))
    mask = masks.local(24, 24)
    layout = mask.blocks(40, 72, 16, 16)

    def loss(q, k, v, bias):
        out = pallas_attention(
            q, k, v, layout, mask=mask, normalizer="entmax15", bias=bias, interpret=False
        )
        return jnp.sum(out)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    bias = jnp.zeros((2, 2, 40, 72))
    text = jax.jit(grad).trace(q, k, k, bias).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_triton_tuning_options_reach_the_kernels_and_bad_ones_are_refused():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    layout = masks.causal().blocks(128, 128, 64, 64)

    def lowered(**options):
        def fn(q):
            out = pallas_attention(q, q, q, layout, normalizer="sparsemax", interpret=False,
                                   **options)  # fmt: skip
            return jnp.sum(out.astype(jnp.float32))

        return jax.jit(jax.grad(fn)).trace(q).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered()  # the defaults: 4 warps for head dim 64, 2 stages
    assert text.count("num_warps = 4 : i32") == 3 and text.count("num_stages = 2 : i32") == 3
    text = lowered(num_warps=8, num_stages=3)
    assert text.count("num_warps = 8 : i32") == 3 and text.count("num_stages = 3 : i32") == 3
    text = lowered(backward_block=(32, 16))  # the backward kernels on tiles of the 64-blocks
    assert text.count("__gpu$xla.gpu.triton") == 3
    text = lowered(backward_block=(16, 64), dq_block=(64, 16))  # each on its own tiles
    assert text.count("__gpu$xla.gpu.triton") == 3
    text = lowered(prefetch=True, dq_accumulation="atomic")
    assert text.count("__gpu$xla.gpu.triton") == 2
    blocks = "must be powers of two >= 16 dividing \\(64, 64\\) \\(the layout's blocks"
    for options, error, match in [
        ({"num_warps": 6}, ValueError, "`num_warps` must be None or 1, 2, 4, 8 or 16; got 6"),
        ({"num_stages": 0}, ValueError, "`num_stages` must be None or >= 1; got 0"),
        ({"num_warps": 4.0}, TypeError, "`num_warps` must be None or an int; got 4.0"),
        ({"backward_block": (48, 16)}, ValueError, blocks),
        ({"backward_block": (128, 64)}, ValueError, blocks),
        ({"backward_block": (32,)}, TypeError, "`backward_block` must be None or \\(bq, bkv\\)"),
        ({"dq_block": (48, 16)}, ValueError, "`dq_block`=\\(48, 16\\) must be powers of two"),
        ({"dq_block": [32, 1.0]}, TypeError, "`dq_block` must be None or \\(bq, bkv\\)"),
        (
            {"dq_block": (32, 64), "dq_accumulation": "atomic"},
            ValueError,
            "`dq_block`=\\(32, 64\\) needs dq_accumulation='separate'",
        ),
        (
            {"dq_block": (32, 32), "target": "mosaic", "interpret": True},
            ValueError,
            "`dq_block` is for the Triton kernels",
        ),
        ({"forward_block": (128, 64)}, ValueError, "`forward_block`=\\(128, 64\\) must be"),
        (
            {"forward_block": (32, 32), "backward_block": (64, 64)},
            ValueError,
            "`backward_block`=\\(64, 64\\) must be powers of two >= 16 dividing \\(32, 32\\)",
        ),
        ({"forward_block": [32, True]}, TypeError, "`forward_block` must be None or"),
        (
            {"backward_block": (32, 32), "target": "mosaic", "interpret": True},
            ValueError,
            "`backward_block` is for the Triton kernels",
        ),
        (
            {"forward_block": (32, 32), "target": "mosaic", "interpret": True},
            ValueError,
            "`forward_block` is for the Triton kernels",
        ),
    ]:
        with pytest.raises(error, match=match):
            pallas_attention(q, q, q, layout, **options)


def _sub_jaxprs(eqn):
    """The jaxprs an equation holds in its parameters (branches, loop bodies, kernels)."""
    from jax.extend import core as jcore

    for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
            if isinstance(sub, jcore.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jcore.Jaxpr):
                yield sub


def _pallas_calls(fn, *args) -> dict:
    """{kernel name: its pallas_call equation} of the Pallas calls ``fn`` traces."""
    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info")
                found[getattr(info, "name", None) or str(eqn.params.get("name"))] = eqn
            for sub in _sub_jaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _kernel_reduce_sums(fn, *args) -> dict[str, int]:
    """{kernel name: reduce_sum operations in its body} of the Pallas calls ``fn`` traces."""
    calls = _pallas_calls(fn, *args)
    return {name: str(eqn.params["jaxpr"]).count("reduce_sum") for name, eqn in calls.items()}


def _kernel_grids(fn, *args) -> dict[str, tuple[int, ...]]:
    """{"fwd" / "dq" / "dkv": grid} of the Pallas calls ``fn`` traces (the grid's first axis:
    the query tiles of the forward and dq kernels, the key tiles of the dk/dv kernel)."""
    calls = _pallas_calls(fn, *args)
    return {
        name.rsplit("_", 1)[-1]: tuple(eqn.params["grid_mapping"].grid)
        for name, eqn in calls.items()
    }


def test_no_bias_and_a_python_float_scale_form_no_gradient_sums_for_them():
    """Without a bias the kernels add none and form no bias gradient; with a python float
    scale (never differentiated) no scale gradient: the backward kernels' row and column sums
    of ds for them disappear. Values and gradients stay the reference's."""
    q, k, v, cot = _inputs((1, 64, 64, 2, 2, 16), jnp.float32)
    layout = masks.causal().blocks(64, 64, 16, 16)

    def grads(bias, scale):
        def loss(q, k, v):
            out = pallas_attention(q, k, v, layout, normalizer="sparsemax", bias=bias, scale=scale)
            return jnp.sum(out * cot)

        return jax.grad(loss, argnums=(0, 1, 2))

    plain = _kernel_reduce_sums(grads(None, 0.5), q, k, v)
    with_both = _kernel_reduce_sums(grads(jnp.zeros((64,)), jnp.float32(0.5)), q, k, v)
    assert plain["sparse_jax_pallas_sparsemax_dq"] == 0
    assert with_both["sparse_jax_pallas_sparsemax_dq"] == 2  # Σ ds·raw (scale), Σ ds (rows)
    assert (
        plain["sparse_jax_pallas_sparsemax_dkv"],
        with_both["sparse_jax_pallas_sparsemax_dkv"],
    ) == (0, 1)

    def reference(q, k, v):
        out = attention(q, k, v, mask=masks.causal(), normalizer="sparsemax", impl="xla", scale=0.5)
        return jnp.sum(out * cot)

    ref = jax.grad(reference, argnums=(0, 1, 2))(q, k, v)
    for ours in (grads(None, 0.5)(q, k, v), grads(jnp.zeros((64,)), jnp.float32(0.5))(q, k, v)):
        for g, r in zip(ours, ref, strict=True):
            np.testing.assert_allclose(g, r, atol=2e-5)


@pytest.mark.parametrize(("normalizer", "sums"), [("sparsemax", 4), ("entmax15", 5), (1.3, 5)])
def test_the_sparse_forward_sums_only_what_its_passes_need(normalizer, sums):
    """The forward kernel's row sums: the search's terms (sparsemax 2, 1.5-entmax 3, whose
    polishing is a pass of its search, α-entmax 2 and the allowed keys, which only its search
    reads; beside a
    minimum, the support's smallest entry, for sparsemax and 1.5-entmax), and the output
    pass' two (Σ p, Σ s); no count of NaN (a NaN enters the maxima as +inf). Its only
    reduction of a whole tile to one value, the block's live flag, is taken over the rows'
    sums ``[bq, 1]``, not over the ``[bq, bkv]`` tile."""
    q = jnp.zeros((1, 64, 2, 16))
    layout = masks.causal().blocks(64, 64, 16, 16)
    ((_, fwd),) = _pallas_calls(
        lambda q: pallas_attention(q, q, q, layout, normalizer=normalizer), q
    ).items()
    body = fwd.params["jaxpr"]
    assert str(body).count("reduce_sum") == sums

    def whole_tile_reductions(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("reduce_") and len(eqn.params["axes"]) == 2:
                yield eqn.invars[0].aval.shape
            for sub in _sub_jaxprs(eqn):
                yield from whole_tile_reductions(sub)

    shapes = set(whole_tile_reductions(body))
    assert shapes and shapes <= {(16, 1)}, shapes


def test_the_first_pass_keeps_the_largest_of_each_blocks_largest_values():
    """tile_top of each block (its 2 largest) merged by insert_top into the row's 8 largest of
    those: a value tied with a larger one in its own block gives way to a smaller one, and a
    block's third value is not kept (a lower start, still a bound: any of the row's values
    give one)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 160)).astype(np.float32)
    x[0, 40] = x[0, 41] = x[0].max() + 1.0  # a tie inside one block, at the top
    x[1, 10] = x[1, 70] = x[1].max() + 1.0  # a tie across two blocks: both kept
    x[2, :] = -np.inf  # a row with 3 allowed keys, 2 in one block
    x[2, [5, 6, 100]] = [0.5, 0.25, 0.75]
    top = (jnp.full((16, 1), -jnp.inf),) * 8
    for block in range(5):
        tile = jnp.asarray(x[:, block * 32 : (block + 1) * 32])
        for value in tilemath.tile_top(tile, tilemath.BLOCK_TOP):
            top = tilemath.insert_top(top, value)
    got = np.concatenate([np.asarray(t) for t in top], axis=-1)
    picks = []  # each block's 2 largest of each row, a tie with the largest dropped
    for block in np.split(x, 5, axis=1):
        first = block.max(-1, keepdims=True)
        second = np.where(block >= first, -np.inf, block).max(-1, keepdims=True)
        picks += [first, second]
    want = -np.sort(-np.concatenate(picks, axis=-1), axis=-1)[:, :8]
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == x[0].max() and got[0, 1] < got[0, 0]  # the in-block tie dropped
    assert got[1, 0] == got[1, 1] == x[1].max()
    assert got[2].tolist() == [0.75, 0.5, 0.25] + [-np.inf] * 5
    assert (got <= -np.sort(-x, axis=-1)[:, :8]).all()  # never above the row's own 8 largest


def test_the_kernels_start_their_searches_from_the_rows_largest_values(monkeypatch):
    from sparse_jax import normalizers as nz

    calls = []

    def spy(name):
        def start(top):
            calls.append((name, len(top)))
            return getattr(nz, f"{name}_start")(top)

        return start

    monkeypatch.setattr(triton, "sparsemax_start", spy("sparsemax"))
    monkeypatch.setattr(triton, "entmax15_start", spy("entmax15"))
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 64, 1, 16))
    layout = masks.causal().blocks(64, 64, 16, 16)
    for name in ("sparsemax", "entmax15"):
        out = pallas_attention(q, q, q, layout, normalizer=name)  # traced: the spy runs
        ref = attention(q, q, q, mask=masks.causal(), normalizer=name, impl="xla")
        np.testing.assert_allclose(out, ref, atol=2e-6)
    assert calls == [("sparsemax", 16), ("entmax15", 32)] and tilemath.BLOCK_TOP == 2
    calls.clear()
    pallas_attention(q, q, q, layout, normalizer=1.3)
    assert calls == []  # α-entmax's search has its own start
