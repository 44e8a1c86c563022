"""The fused block-sparse attention kernels for TPU (Pallas with the Mosaic lowering).

The same algorithm as the Triton kernels (:mod:`sparse_jax.kernels.triton`; the algorithm is
described in :mod:`sparse_jax.kernels.flash`), with the tile maths they share
(:mod:`sparse_jax.kernels.tilemath`), in the shape the TPU wants: one program per (batch
element, head, query block) on a grid of independent programs, the queries' tile brought to VMEM
by the grid's pipeline, and the key blocks the layout keeps streamed from HBM by the kernel
itself, double-buffered (the copy of block ``j + 1`` runs while block ``j`` is computed), so
that every pass of a threshold search visits only the kept blocks and VMEM holds a few tiles
whatever the sequence length. Layout arrays are read from SMEM one query block (or key block) at
a time.

Forward: softmax by the online recurrence; sparsemax, 1.5-entmax and α-entmax by the
searches of :mod:`sparse_jax.normalizers` summed block by block, then one pass for ``p @ v``
that records which blocks hold weight. Backward: the dead blocks are dropped from the lists
the two backward kernels walk (compacted in XLA between the passes), so they are not even
copied; ``dq`` (and the α, scale and bias row terms) walks a query block's live blocks,
``dk``/``dv`` (and the bias column terms, and a dense bias gradient written tile by tile)
walks a key block's live query blocks.

Tensors are head-major inside (``[B, N, T, D]``, as splash attention keeps them), row
statistics are lane vectors (``[B, N, S, T]``). Run-time masks are read as the Triton kernels
read them: key lengths and segment ids beside the static tiles, or a tile expression (run-time
leaves under ``|``/``~``) evaluated on each tile's positions. Blocks must be multiples of 128
(the lane width) in both directions. The kernels run unchanged in Pallas' TPU interpret mode,
which is how the tests run them on CPU; on CPU they also lower to Mosaic for TPU (a test checks
that, it does not compile them: that needs libtpu).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparse_jax.kernels import tilemath
from sparse_jax.kernels.plan import LANES, mosaic_block_error
from sparse_jax.normalizers import (
    SIGMA_MAX_EPS,
    expm1_from_exp,
)

# ``forward`` and ``backward`` are what :func:`sparse_jax.kernels.pallas_attention` runs for
# ``target="mosaic"`` (they take the :class:`~sparse_jax.kernels.plan.Plan` of a call);
# ``visits``: the lists the backward kernels walk. The block-size rule (``LANES``,
# ``mosaic_block_error``) is the call plan's, named here too.
# The API; the other names without an underscore are shared by the kernels' modules only.
__all__ = ["LANES", "mosaic_block_error"]

_F32 = jnp.float32
_MAX = float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------------------------------------
# Pieces of the kernels.


def _lanes(column):
    """A ``[rows, 1]`` column as a ``[1, rows]`` lane vector (broadcast, transpose, one row)."""
    rows = column.shape[0]
    return jnp.transpose(jnp.broadcast_to(column, (rows, LANES)))[0:1, :]


def _stream(count, views, buffers, sem, body, init):
    """``fori_loop`` over ``t < count`` whose tiles are copied from HBM, double-buffered.

    ``views(t)`` gives the HBM slices of visit ``t``, one per buffer (``buffers[i]`` a VMEM
    scratch ``[2, ...]``); the copy of visit ``t + 1`` starts before visit ``t`` is computed.
    ``body(t, tiles, carry)`` gets the VMEM tiles of visit ``t``.
    """

    def copies(t, slot):
        return [
            pltpu.make_async_copy(src, buf.at[slot], sem.at[i, slot])
            for i, (src, buf) in enumerate(zip(views(t), buffers, strict=True))
        ]

    @pl.when(count > 0)
    def _():
        for copy in copies(0, 0):
            copy.start()

    def step(t, carry):
        slot = jnp.bitwise_and(t, 1)

        @pl.when(t + 1 < count)
        def _():
            for copy in copies(t + 1, 1 - slot):
                copy.start()

        for copy in copies(t, slot):
            copy.wait()
        return body(t, [buf.at[slot] for buf in buffers], carry)

    return jax.lax.fori_loop(0, count, step, init)


def _div(index, divisor: int):
    """``index // divisor`` for the non-negative indices of a grid (``//`` lowers through
    ``sign``, whose Mosaic rule asks the TPU generation, so it cannot be lowered off a TPU)."""
    return jax.lax.div(index, jnp.int32(divisor))


def _tile_allowed(plan, full, mask_index, masks_ref, q_block, kv_block, kv_length, same=None):
    """Element mask ``[bq, bkv]`` of a kept block (see ``_masked`` of the Triton kernels): the
    static tile, keys below the batch element's ``padding`` length and in the query's segment;
    for a tile expression (run-time leaves under ``|``/``~``), keys below ``Tk`` where the
    expression, evaluated on the tile's positions, the length and the segment tile, holds.
    Positions are iotas in the tile's own layout (queries on sublanes, keys on lanes)."""
    static = jnp.logical_or(full != 0, masks_ref[mask_index] != 0)
    keys = kv_block * plan.bkv + jax.lax.broadcasted_iota(jnp.int32, (1, plan.bkv), 1)
    if plan.expr is None:
        allowed = jnp.logical_and(static, keys < kv_length)
        return allowed if same is None else jnp.logical_and(allowed, same)
    rows = q_block * plan.bq + jax.lax.broadcasted_iota(jnp.int32, (plan.bq, 1), 0)
    tile = plan.expr(rows, keys, key_length=kv_length, same_segment=same)
    return jnp.logical_and(jnp.logical_and(static, keys < plan.kv_len), tile)


def _eps_sigma(plan, eps_ref, head, rows: int):
    if plan.kind != "entmax":
        return None, None
    eps = jnp.full((rows, 1), eps_ref[head], _F32)
    sigma = plan.sigma if plan.sigma is not None else eps <= SIGMA_MAX_EPS
    return eps, sigma


def _bias_view(plan, bias_hbm, b, h, row_block, kv_block):
    """The bias tile ``[bq or 1, bkv or 1]`` of (query block, key block) in HBM."""
    ab, an, aq, ak = plan.bias_axes
    rows = pl.ds(row_block * plan.bq, plan.bq) if aq else pl.ds(0, 1)
    cols = pl.ds(kv_block * plan.bkv, plan.bkv) if ak else pl.ds(0, 1)
    return bias_hbm.at[b if ab else 0, h if an else 0, rows, cols]


def _bias_scratch(plan):
    _, _, aq, ak = plan.bias_axes
    return pltpu.VMEM((2, plan.bq if aq else 1, plan.bkv if ak else 1), _F32)


# ----------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(len_ref, scale_ref, eps_ref, idx_ref, cnt_ref, full_ref, pmi_ref, q_ref,
                    k_hbm, v_hbm, nan_hbm, bias_hbm, qseg_ref, kvseg_hbm, masks_ref, *refs,
                    plan):  # fmt: skip
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = _div(h, plan.g)
    softmax = plan.kind == "softmax"
    if softmax:
        o_ref, stats_ref = refs[:2]
        kbuf, vbuf, nanbuf, biasbuf, segbuf, sem = refs[2:]
    else:
        o_ref, ubar_ref, stats_ref, live_ref = refs[:4]
        kbuf, vbuf, nanbuf, biasbuf, segbuf, sem = refs[4:]
    q = q_ref[...]
    bq, bkv = plan.bq, plan.bkv
    scale = scale_ref[0]
    kv_length = len_ref[b]
    count = cnt_ref[0, 0]
    eps, sigma = _eps_sigma(plan, eps_ref, h, bq)

    q_seg = qseg_ref[0][:, None] if plan.segments else None  # [bq, 1]

    # The tiles of a visit: key block, its NaN marks, the bias tile, (its segment ids), (values).
    def views(with_v):
        def at(j):
            block = idx_ref[0, j]
            keys = pl.ds(pl.multiple_of(block * bkv, bkv), bkv)
            out = [k_hbm.at[b, kh, keys, :], nan_hbm.at[b, kh, :, keys]]
            out.append(_bias_view(plan, bias_hbm, b, h, i, block))
            if plan.segments:
                out.append(kvseg_hbm.at[b, :, keys])
            return [*out, v_hbm.at[b, kh, keys, :]] if with_v else out

        return at

    k_bufs = [kbuf, nanbuf, biasbuf, *([segbuf] if plan.segments else [])]

    def masked(j, tiles):
        block = idx_ref[0, j]
        raw = tilemath.dot(plan, q, tiles[0][...])
        s = jnp.minimum(raw * scale + tiles[2][...] + tiles[1][...], _MAX)
        same = q_seg == tiles[3][...] if plan.segments else None
        allowed = _tile_allowed(
            plan, full_ref[0, j], pmi_ref[0, j], masks_ref, i, block, kv_length, same
        )
        return jnp.where(allowed, s, -jnp.inf)

    if softmax:

        def body(j, tiles, carry):
            return tilemath.softmax_step(plan, carry, masked(j, tiles), tiles[-1][...])

        init = tilemath.softmax_init(plan, bq)
        carry = _stream(count, views(True), [*k_bufs, vbuf], sem, body, init)
        out, lse = tilemath.softmax_finish(carry)
        o_ref[...] = out.astype(o_ref.dtype)
        stats_ref[...] = _lanes(lse)
        return

    def first(j, tiles, carry):
        row_max, n_valid = carry
        x = masked(j, tiles)
        row_max = jnp.maximum(row_max, jnp.max(x, axis=-1, keepdims=True))
        return row_max, n_valid + jnp.sum((x > -jnp.inf).astype(_F32), axis=-1, keepdims=True)

    init = (jnp.full((bq, 1), -jnp.inf, _F32), jnp.zeros((bq, 1), _F32))
    row_max, n_valid = _stream(count, views(False), k_bufs, sem, first, init)
    nan_row = jnp.isnan(row_max) | tilemath.bad_alpha(eps)
    row_max = jnp.where(nan_row, jnp.nan, row_max)
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)

    def row_sums(terms_of, n_terms, minima=0):
        def body(j, tiles, acc):
            terms = terms_of(tilemath.search_variable(plan.kind, masked(j, tiles), shift, eps))
            return tilemath.reduce_block(acc, terms, minima)

        init = tilemath.reductions_init(n_terms, minima, bq)
        return _stream(count, views(False), k_bufs, sem, body, init)

    # (Mosaic has no expm1.)
    tau = tilemath.threshold(plan, row_max, n_valid, eps, sigma, row_sums, expm1_from_exp)

    lane = jax.lax.broadcasted_iota(jnp.int32, (1, live_ref.shape[-1]), 1)

    def out(j, tiles, carry):
        acc, acc_u, mass, s_sum, live = carry
        p, s = tilemath.weights(
            plan.kind,
            tilemath.search_variable(plan.kind, masked(j, tiles), shift, eps),
            tau,
            eps,
            sigma,
        )
        # Live: a row gives the block weight or is a NaN row (the backward must visit it).
        alive = jnp.max(jnp.where((p > 0.0) | jnp.isnan(p), 1, 0).astype(jnp.int32))
        live = jnp.where(lane == j, alive, live)

        def products(acc, acc_u):
            v = tiles[-1][...]
            return (
                acc + tilemath.dot(plan, p.astype(v.dtype), v, 1, 0),
                acc_u + tilemath.dot(plan, s.astype(v.dtype), v, 1, 0),
            )

        acc, acc_u = jax.lax.cond(alive > 0, products, lambda a, c: (a, c), acc, acc_u)
        mass = mass + jnp.sum(p, axis=-1, keepdims=True)
        return acc, acc_u, mass, s_sum + jnp.sum(s, axis=-1, keepdims=True), live

    zeros_v = jnp.zeros((bq, plan.dv), _F32)
    zeros_r = jnp.zeros((bq, 1), _F32)
    init = (zeros_v, zeros_v, zeros_r, zeros_r, jnp.zeros((1, live_ref.shape[-1]), jnp.int32))
    acc, acc_u, mass, s_sum, live = _stream(count, views(True), [*k_bufs, vbuf], sem, out, init)
    o_ref[...] = jnp.where(nan_row, jnp.nan, acc / jnp.where(mass > 0.0, mass, 1.0)).astype(
        o_ref.dtype
    )
    ubar_ref[...] = acc_u / jnp.where(s_sum > 0.0, s_sum, 1.0)
    stats_ref[pl.ds(0, 1), :] = _lanes(shift)
    stats_ref[pl.ds(1, 1), :] = _lanes(tau)
    stats_ref[pl.ds(2, 1), :] = _lanes(jnp.where(nan_row, jnp.nan, mass))
    live_ref[...] = live


# ----------------------------------------------------------------------------------------------
# Backward.


def _rows_of(plan, column):
    """The row statistics of a tile as ``[bq, 1]`` columns: ``column(s)`` reads row ``s``."""
    return {name: column(s) for s, name in enumerate(tilemath.row_names(plan))}


def _dq_kernel(len_ref, scale_ref, eps_ref, visit_ref, vcount_ref, idx_ref, full_ref, pmi_ref,
               q_ref, do_ref, stats_ref, k_hbm, v_hbm, nan_hbm, bias_hbm, qseg_ref, kvseg_hbm,
               masks_ref, dq_ref, rows_out_ref, kbuf, vbuf, nanbuf, biasbuf, segbuf, sem, *,
               plan):  # fmt: skip
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = _div(h, plan.g)
    q, do = q_ref[...], do_ref[...]
    bq, bkv = plan.bq, plan.bkv
    scale = scale_ref[0]
    kv_length = len_ref[b]
    eps, sigma = _eps_sigma(plan, eps_ref, h, bq)
    rows = _rows_of(plan, lambda s: stats_ref[s][:, None])
    delta = rows["delta"]

    def slot_of(t):
        return visit_ref[0, t]

    q_seg = qseg_ref[0][:, None] if plan.segments else None  # [bq, 1]

    def views(t):  # key block, NaN marks, bias tile, values, (segment ids)
        block = idx_ref[0, slot_of(t)]
        keys = pl.ds(pl.multiple_of(block * bkv, bkv), bkv)
        out = [
            k_hbm.at[b, kh, keys, :],
            nan_hbm.at[b, kh, :, keys],
            _bias_view(plan, bias_hbm, b, h, i, block),
            v_hbm.at[b, kh, keys, :],
        ]
        return [*out, kvseg_hbm.at[b, :, keys]] if plan.segments else out

    def body(t, tiles, carry):
        slot = slot_of(t)
        block = idx_ref[0, slot]
        k, v = tiles[0][...], tiles[3][...]
        raw = tilemath.dot(plan, q, k)
        s = jnp.minimum(raw * scale + tiles[2][...] + tiles[1][...], _MAX)
        same = q_seg == tiles[4][...] if plan.segments else None
        allowed = _tile_allowed(plan, full_ref[0, slot], pmi_ref[0, slot], masks_ref, i, block,
                                kv_length, same)  # fmt: skip
        p, g = tilemath.recompute(plan, jnp.where(allowed, s, -jnp.inf), rows, eps, sigma)
        return tilemath.dq_step(plan, carry, p, g, tilemath.dot(plan, do, v), delta, raw, k, eps)

    zeros_r = jnp.zeros((bq, 1), _F32)
    init = (jnp.zeros((bq, plan.d), _F32), (zeros_r,) * 4, zeros_r, zeros_r)
    bufs = [kbuf, nanbuf, biasbuf, vbuf, *([segbuf] if plan.segments else [])]
    dq, alpha_sums, ds_raw, ds_rows = _stream(vcount_ref[0, 0], views, bufs, sem, body, init)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    rows_out_ref[pl.ds(0, 1), :] = _lanes(tilemath.alpha_rows(plan, alpha_sums, delta, eps))
    rows_out_ref[pl.ds(1, 1), :] = _lanes(ds_raw)
    rows_out_ref[pl.ds(2, 1), :] = _lanes(ds_rows)


def _dkv_kernel(len_ref, scale_ref, eps_ref, vrows_ref, vfull_ref, vpmi_ref, vcount_ref, k_ref,
                v_ref, nan_ref, kvseg_ref, q_hbm, do_hbm, stats_hbm, bias_hbm, qseg_hbm, masks_ref,
                *refs, plan):  # fmt: skip
    dense = plan.bias_axes[2] and plan.bias_axes[3]
    if dense:  # refs: the zeros aliased to the dense bias gradient, then the outputs
        dk_ref, dv_ref, dcols_ref, dbias_hbm = refs[1:5]
        qbuf, dobuf, statbuf, biasbuf, segbuf, dsbuf, sem = refs[5:]
    else:
        dk_ref, dv_ref, dcols_ref = refs[:3]
        qbuf, dobuf, statbuf, biasbuf, segbuf, sem = refs[3:]
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    key_nan = nan_ref[...]
    bq, bkv = plan.bq, plan.bkv
    scale = scale_ref[0]
    kv_length = len_ref[b]
    eps, sigma = _eps_sigma(plan, eps_ref, h, bq)

    def views(t):  # query tile, its output gradient, row statistics, bias, (segment ids)
        row_block = vrows_ref[0, t]
        queries = pl.ds(pl.multiple_of(row_block * bq, bq), bq)
        out = [
            q_hbm.at[b, h, queries, :],
            do_hbm.at[b, h, queries, :],
            stats_hbm.at[b, h, :, queries],
            _bias_view(plan, bias_hbm, b, h, row_block, c),
        ]
        return [*out, qseg_hbm.at[b, :, queries]] if plan.segments else out

    def body(t, tiles, carry):
        dk, dv, ds_cols = carry
        q, do = tiles[0][...], tiles[1][...]
        stats = tiles[2]
        rows = _rows_of(plan, lambda s: stats[s][:, None])
        s = jnp.minimum(tilemath.dot(plan, q, k) * scale + tiles[3][...] + key_nan, _MAX)
        same = tiles[4][0][:, None] == kvseg_ref[...] if plan.segments else None
        allowed = _tile_allowed(
            plan, vfull_ref[0, t], vpmi_ref[0, t], masks_ref, vrows_ref[0, t], c, kv_length, same
        )
        p, g = tilemath.recompute(plan, jnp.where(allowed, s, -jnp.inf), rows, eps, sigma)
        dv = dv + tilemath.dot(plan, p.astype(do.dtype), do, 0, 0)
        ds = jnp.where(g != 0.0, g * (tilemath.dot(plan, do, v) - rows["delta"]), 0.0)
        dk = dk + tilemath.dot(plan, ds.astype(q.dtype), q, 0, 0)
        if dense:
            dsbuf[...] = ds
            row_block = vrows_ref[0, t]
            queries = pl.ds(pl.multiple_of(row_block * bq, bq), bq)
            keys = pl.ds(pl.multiple_of(c * bkv, bkv), bkv)
            pltpu.sync_copy(dsbuf, dbias_hbm.at[b, h, queries, keys])
        return dk, dv, ds_cols + jnp.sum(ds, axis=0, keepdims=True)

    init = (
        jnp.zeros((bkv, plan.d), _F32),
        jnp.zeros((bkv, plan.dv), _F32),
        jnp.zeros((1, bkv), _F32),
    )
    bufs = [qbuf, dobuf, statbuf, biasbuf, *([segbuf] if plan.segments else [])]
    dk, dv, ds_cols = _stream(vcount_ref[0, 0], views, bufs, sem, body, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dcols_ref[...] = ds_cols


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.


def _smem_rows(shape, index_map):
    """A blocked SMEM input: one row ``[1, W]`` of an array ``[..., 1, W]`` per program."""
    return pl.BlockSpec((None, None, 1, shape[-1]), index_map, memory_space=pltpu.SMEM)


def _whole_smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _hbm():
    return pl.BlockSpec(memory_space=pl.ANY)


def _call(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, name, aliases=None):
    return pl.pallas_call(
        functools.partial(kernel, plan=plan),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid)),
        input_output_aliases=aliases or {},
        interpret=pltpu.InterpretParams() if plan.interpret else False,
        name=name,
    )


def _layout_rows(plan, blocks, key):
    """A ``[H, nq, Kp]`` layout array as ``[H, nq, 1, Kp]`` (one SMEM row per query block);
    ``H`` is ``B * N`` for a run-time block list (``blocks``)."""
    (a,) = plan.layout_inputs(blocks, (key,))
    return a.reshape(a.shape[0], a.shape[1], 1, a.shape[2])


def _layout_index(batch, head, block, *, plan):
    """Index map of the layout rows ``[H, n, 1, W]``: per head, shared, or per (batch element,
    head) for a run-time block list (``Plan.layout_head``)."""
    return (plan.layout_head(batch, head), block, 0, 0)


def _head_major(x):
    return jnp.transpose(x, (0, 2, 1, 3))


def forward(plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, blocks=None):
    """The forward pass: ``(o [B, Tq, N, Dv], residuals)``; inputs as the Triton kernels'
    :func:`~sparse_jax.kernels.triton.forward` takes them (token-major, padded to whole
    blocks), ``blocks`` too (a run-time block list's layout arrays, or None)."""
    b, n, bq, bkv, nq = plan.b, plan.n, plan.bq, plan.bkv, plan.nq
    tq = q.shape[1]
    kp = plan.arrays["idx"].shape[-1]
    layout_index = functools.partial(_layout_index, plan=plan)
    qh, kh_, vh = _head_major(q), _head_major(k), _head_major(v)
    nan4 = key_nan[:, :, None, :]  # [B, Kh, 1, Tk]
    q_block = pl.BlockSpec((None, None, bq, plan.d), lambda bb, h, i: (bb, h, i, 0))
    o_block = pl.BlockSpec((None, None, bq, plan.dv), lambda bb, h, i: (bb, h, i, 0))
    in_specs = [
        _whole_smem(), _whole_smem(), _whole_smem(),
        _smem_rows(plan.arrays["idx"].shape, layout_index),
        pl.BlockSpec((None, None, 1, 1), layout_index, memory_space=pltpu.SMEM),
        _smem_rows(plan.arrays["full"].shape, layout_index),
        _smem_rows(plan.arrays["pmi"].shape, layout_index),
        q_block, _hbm(), _hbm(), _hbm(), _hbm(),
        pl.BlockSpec((None, 1, bq), lambda bb, h, i: (bb, 0, i)), _hbm(),
        pl.BlockSpec(plan.arrays["masks"].shape, lambda *_: (0, 0, 0)),
    ]  # fmt: skip
    inputs = [
        lengths, scale, eps[:, 0],
        _layout_rows(plan, blocks, "idx"),
        plan.layout_inputs(blocks, ("count",))[0][..., None],
        _layout_rows(plan, blocks, "full"),
        _layout_rows(plan, blocks, "pmi"),
        qh, kh_, vh, nan4, bias, q_ids[:, None, :], kv_ids[:, None, :],
        jnp.asarray(plan.arrays["masks"]),
    ]  # fmt: skip
    scratch = [
        pltpu.VMEM((2, bkv, plan.d), k.dtype),
        pltpu.VMEM((2, bkv, plan.dv), v.dtype),
        pltpu.VMEM((2, 1, bkv), _F32),
        _bias_scratch(plan),
        pltpu.VMEM((2, 1, bkv), jnp.int32),
        pltpu.SemaphoreType.DMA((5, 2)),
    ]
    o_shape = jax.ShapeDtypeStruct((b, n, tq, plan.dv), q.dtype)
    grid = (b, n, nq)
    if plan.kind == "softmax":
        o, lse = _call(
            _forward_kernel, plan, grid, in_specs,
            [o_block, pl.BlockSpec((None, None, 1, bq), lambda bb, h, i: (bb, h, 0, i))],
            [o_shape, jax.ShapeDtypeStruct((b, n, 1, tq), _F32)], scratch,
            "sparse_jax_mosaic_softmax_fwd",
        )(*inputs)  # fmt: skip
        return _head_major(o), {"stats": lse, "ubar": o, "live": None}
    o, ubar, stats, live = _call(
        _forward_kernel, plan, grid, in_specs,
        [o_block, o_block, pl.BlockSpec((None, None, 3, bq), lambda bb, h, i: (bb, h, 0, i)),
         pl.BlockSpec((None, None, None, 1, kp), lambda bb, h, i: (bb, h, i, 0, 0))],
        [o_shape, jax.ShapeDtypeStruct((b, n, tq, plan.dv), _F32),
         jax.ShapeDtypeStruct((b, n, 3, tq), _F32),
         jax.ShapeDtypeStruct((b, n, nq, 1, kp), jnp.int32)],
        scratch, f"sparse_jax_mosaic_{plan.kind}_fwd",
    )(*inputs)  # fmt: skip
    return _head_major(o), {"stats": stats, "ubar": ubar, "live": live[:, :, :, 0, :]}


def _compact(keep, *values):
    """Moves the kept entries of the last axis to the front (in order); returns
    ``(count [..., 1, 1], *values compacted [..., 1, W])``."""
    order = jnp.argsort(jnp.logical_not(keep).astype(jnp.int32), axis=-1, stable=True)
    count = jnp.sum(keep.astype(jnp.int32), axis=-1)
    out = [jnp.take_along_axis(x, order, axis=-1)[..., None, :] for x in values]
    return (count[..., None, None], *out)


def visits(plan, live, blocks=None):
    """What the backward kernels walk: for the dq kernel, each query block's slots (the live
    ones for a sparse normalizer); for the dk/dv kernel, each key block's query blocks, with
    the full flag and partial mask of the pair. Arrays ``[B or 1, N or H, n, 1, W]``
    (``[B, N, ...]`` for a run-time block list, ``blocks``)."""
    if plan.runtime:
        return _runtime_visits(plan, live, blocks)
    a = plan.arrays
    t_rows, t_slots = a["t_rows"], a["t_slots"]
    heads = np.arange(t_rows.shape[0])[:, None, None]
    t_full = a["full"][heads, t_rows, t_slots]
    t_pmi = a["pmi"][heads, t_rows, t_slots]
    t_valid = np.arange(t_rows.shape[-1]) < a["t_count"]
    if plan.kind == "softmax":
        kp = a["idx"].shape[-1]
        dq_slots = jnp.asarray(np.arange(kp, dtype=np.int32).reshape(1, 1, 1, 1, kp))
        dq_count = jnp.asarray(a["count"])[None, :, :, :, None]
        dkv = [jnp.asarray(x)[None, :, :, None, :] for x in (t_rows, t_full, t_pmi)]
        dkv_count = jnp.asarray(a["t_count"])[None, :, :, :, None]
        return (dq_count, dq_slots), (dkv_count, *dkv)
    b, n = plan.b, plan.n
    ph = plan.per_head
    dq_count, dq_slots = _compact(live != 0, jnp.broadcast_to(
        jnp.arange(live.shape[-1], dtype=jnp.int32), live.shape))  # fmt: skip
    head_of = np.arange(n) * ph
    rows, slots = t_rows[head_of], t_slots[head_of]  # [N, nk, Mp]
    pair_live = live[:, np.arange(n)[:, None, None], rows, slots]  # [B, N, nk, Mp]
    keep = (pair_live != 0) & t_valid[head_of][None]
    shape = (b, *rows.shape)
    dkv = _compact(
        keep,
        *[jnp.broadcast_to(jnp.asarray(x[head_of]), shape) for x in (t_rows, t_full, t_pmi)],
    )
    return (dq_count, dq_slots), dkv


def _runtime_visits(plan, live, blocks):
    """:func:`visits` of a run-time block list, from its arrays ``[B * N, ...]`` (jnp ops)."""
    b, n, nq, nk = plan.b, plan.n, plan.nq, plan.nk
    keys = ("count", "full", "pmi", "t_rows", "t_slots", "t_count")
    a = dict(zip(keys, plan.layout_inputs(blocks, keys), strict=True))
    t_rows, t_slots = a["t_rows"], a["t_slots"]  # [B * N, nk, Mp]
    mp, kp = t_rows.shape[-1], a["full"].shape[-1]
    heads = jnp.arange(b * n)[:, None, None]
    t_full = a["full"][heads, t_rows, t_slots]
    t_pmi = a["pmi"][heads, t_rows, t_slots]
    t_valid = jnp.arange(mp) < a["t_count"]

    def per_head(x):  # [B * N, nk, Mp] -> [B, N, nk, Mp]
        return x.reshape(b, n, nk, mp)

    if plan.kind == "softmax":
        dq_slots = jnp.arange(kp, dtype=jnp.int32).reshape(1, 1, 1, 1, kp)
        dq_count = a["count"].reshape(b, n, nq, 1, 1)
        dkv = [per_head(x)[:, :, :, None, :] for x in (t_rows, t_full, t_pmi)]
        return (dq_count, dq_slots), (a["t_count"].reshape(b, n, nk, 1, 1), *dkv)
    dq_count, dq_slots = _compact(live != 0, jnp.broadcast_to(
        jnp.arange(live.shape[-1], dtype=jnp.int32), live.shape))  # fmt: skip
    rows, slots = per_head(t_rows), per_head(t_slots)
    pair_live = live[jnp.arange(b)[:, None, None, None], jnp.arange(n)[None, :, None, None], rows,
                     slots]  # fmt: skip
    keep = (pair_live != 0) & per_head(t_valid)
    return (dq_count, dq_slots), _compact(keep, rows, per_head(t_full), per_head(t_pmi))


def backward(plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, res, do,
             blocks=None):  # fmt: skip
    """``(dq, dk per query head, dv per query head, dalpha/dscale/dbias row terms [B, N, Tq]
    each, dbias column terms [B, N, Tk], dense dbias or None)``, token-major like the Triton
    kernels'; ``blocks``: a run-time block list's layout arrays, or None."""
    b, n, bq, bkv, nq, nk = plan.b, plan.n, plan.bq, plan.bkv, plan.nq, plan.nk
    tq, tk = q.shape[1], k.shape[1]
    ph = plan.per_head
    # The softmax visit lists of a static layout are its own (per head or shared).
    static_softmax = plan.kind == "softmax" and not plan.runtime
    qh, kh_, vh, doh = _head_major(q), _head_major(k), _head_major(v), _head_major(do)
    nan4 = key_nan[:, :, None, :]
    delta = jnp.einsum("bnqd,bnqd->bnq", doh.astype(_F32), res["ubar"].astype(_F32))
    stats = jnp.concatenate([res["stats"], delta[:, :, None, :]], axis=2)  # [B, N, S, Tq]
    n_stats = stats.shape[2]
    (dq_count, dq_slots), (t_count, t_rows, t_full, t_pmi) = visits(plan, res["live"], blocks)
    per_batch = int(dq_slots.shape[0] > 1)
    per_q_head = dq_slots.shape[1] == n and plan.kind != "softmax"

    def visit_index(bb, h, i):  # the dq kernel's visit lists: per (b, h) or shared
        return (bb * per_batch, h if per_q_head else 0, i if dq_slots.shape[2] > 1 else 0, 0, 0)

    def count_index(bb, h, i):
        if static_softmax:
            return (0, h * ph, i, 0, 0)
        return (bb, h, i, 0, 0)

    layout_index = functools.partial(_layout_index, plan=plan)
    q_block = pl.BlockSpec((None, None, bq, plan.d), lambda bb, h, i: (bb, h, i, 0))
    do_block = pl.BlockSpec((None, None, bq, plan.dv), lambda bb, h, i: (bb, h, i, 0))
    smem5 = functools.partial(pl.BlockSpec, memory_space=pltpu.SMEM)
    dq, rows_out = _call(
        _dq_kernel, plan, (b, n, nq),
        [_whole_smem(), _whole_smem(), _whole_smem(),
         smem5((None, None, None, 1, dq_slots.shape[-1]), visit_index),
         smem5((None, None, None, 1, 1), count_index),
         _smem_rows(plan.arrays["idx"].shape, layout_index),
         _smem_rows(plan.arrays["full"].shape, layout_index),
         _smem_rows(plan.arrays["pmi"].shape, layout_index),
         q_block, do_block,
         pl.BlockSpec((None, None, n_stats, bq), lambda bb, h, i: (bb, h, 0, i)),
         _hbm(), _hbm(), _hbm(), _hbm(),
         pl.BlockSpec((None, 1, bq), lambda bb, h, i: (bb, 0, i)), _hbm(),
         pl.BlockSpec(plan.arrays["masks"].shape, lambda *_: (0, 0, 0))],
        [q_block, pl.BlockSpec((None, None, 3, bq), lambda bb, h, i: (bb, h, 0, i))],
        [jax.ShapeDtypeStruct((b, n, tq, plan.d), q.dtype),
         jax.ShapeDtypeStruct((b, n, 3, tq), _F32)],
        [pltpu.VMEM((2, bkv, plan.d), k.dtype), pltpu.VMEM((2, bkv, plan.dv), v.dtype),
         pltpu.VMEM((2, 1, bkv), _F32), _bias_scratch(plan), pltpu.VMEM((2, 1, bkv), jnp.int32),
         pltpu.SemaphoreType.DMA((5, 2))],
        f"sparse_jax_mosaic_{plan.kind}_dq",
    )(lengths, scale, eps[:, 0], dq_slots, dq_count, _layout_rows(plan, blocks, "idx"),
      _layout_rows(plan, blocks, "full"), _layout_rows(plan, blocks, "pmi"), qh, doh, stats, kh_,
      vh, nan4, bias,
      q_ids[:, None, :], kv_ids[:, None, :], jnp.asarray(plan.arrays["masks"]))  # fmt: skip

    t_batch = int(t_rows.shape[0] > 1)
    mp = t_rows.shape[-1]

    def t_index(bb, h, c):
        head = h * ph if static_softmax else h
        return (bb * t_batch, head, c, 0, 0)

    g = plan.g
    dense = plan.bias_axes[2] and plan.bias_axes[3]
    grad_dtype = (_F32, _F32) if g > 1 else (k.dtype, v.dtype)
    out_specs = [
        pl.BlockSpec((None, None, bkv, plan.d), lambda bb, h, c: (bb, h, c, 0)),
        pl.BlockSpec((None, None, bkv, plan.dv), lambda bb, h, c: (bb, h, c, 0)),
        pl.BlockSpec((None, None, 1, bkv), lambda bb, h, c: (bb, h, 0, c)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, n, tk, plan.d), grad_dtype[0]),
        jax.ShapeDtypeStruct((b, n, tk, plan.dv), grad_dtype[1]),
        jax.ShapeDtypeStruct((b, n, 1, tk), _F32),
    ]
    in_specs = [
        _whole_smem(), _whole_smem(), _whole_smem(),
        smem5((None, None, None, 1, mp), t_index), smem5((None, None, None, 1, mp), t_index),
        smem5((None, None, None, 1, mp), t_index), smem5((None, None, None, 1, 1), t_index),
        pl.BlockSpec((None, None, bkv, plan.d), lambda bb, h, c: (bb, _div(h, g), c, 0)),
        pl.BlockSpec((None, None, bkv, plan.dv), lambda bb, h, c: (bb, _div(h, g), c, 0)),
        pl.BlockSpec((None, None, 1, bkv), lambda bb, h, c: (bb, _div(h, g), 0, c)),
        pl.BlockSpec((None, 1, bkv), lambda bb, h, c: (bb, 0, c)),
        _hbm(), _hbm(), _hbm(), _hbm(), _hbm(),
        pl.BlockSpec(plan.arrays["masks"].shape, lambda *_: (0, 0, 0)),
    ]  # fmt: skip
    inputs = [lengths, scale, eps[:, 0], t_rows, t_full, t_pmi, t_count, kh_, vh, nan4,
              kv_ids[:, None, :], qh, doh, stats, bias, q_ids[:, None, :],
              jnp.asarray(plan.arrays["masks"])]  # fmt: skip
    scratch = [
        pltpu.VMEM((2, bq, plan.d), q.dtype),
        pltpu.VMEM((2, bq, plan.dv), do.dtype),
        pltpu.VMEM((2, n_stats, bq), _F32),
        _bias_scratch(plan),
        pltpu.VMEM((2, 1, bq), jnp.int32),
    ]
    aliases = None
    if dense:
        in_specs.append(_hbm())
        inputs.append(jnp.zeros((b, n, tq, tk), _F32))
        out_specs.append(_hbm())
        out_shape.append(jax.ShapeDtypeStruct((b, n, tq, tk), _F32))
        scratch.append(pltpu.VMEM((bq, bkv), _F32))
        aliases = {len(inputs) - 1: 3}
    scratch.append(pltpu.SemaphoreType.DMA((5, 2)))
    grads = _call(
        _dkv_kernel, plan, (b, n, nk), in_specs, out_specs, out_shape, scratch,
        f"sparse_jax_mosaic_{plan.kind}_dkv", aliases,
    )(*inputs)  # fmt: skip
    dk, dv, dcols = grads[:3]
    return (
        _head_major(dq),
        _head_major(dk),
        _head_major(dv),
        rows_out[:, :, 0],
        rows_out[:, :, 1],
        rows_out[:, :, 2],
        dcols[:, :, 0],
        grads[3] if dense else None,
    )
