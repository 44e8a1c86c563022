"""Fused block-sparse attention in Pallas for softmax, sparsemax, 1.5-entmax and α-entmax.

:func:`pallas_attention` computes the same function as :func:`sparse_jax.blocksparse_attention`
(``[batch, seq, heads, head_dim]``, a :class:`~sparse_jax.masks.BlockLayout`, grouped-query
attention, ``Tq != Tk``) with the work of a query block done in on-chip memory: the scores of
a block are formed, used and dropped, never written to HBM, and only the key blocks the layout
keeps are visited.

Forward (one program per query block, batch element and head):

* softmax: the online (flash) recurrence over the kept key blocks (running maximum, running
  sum, running ``p @ v``); the row's log-sum-exp is kept for the backward pass.
* sparsemax, 1.5-entmax, α-entmax: the row's threshold τ is found without materialising the
  row. The searches of :mod:`sparse_jax.normalizers` (Michelot's iteration, Newton on the
  2-norm with its exact quadratic check, safeguarded Newton for any α) are written as
  per-entry terms and a per-row update (:class:`~sparse_jax.normalizers.RowSearch`), so each
  pass of a search sums its terms block by block over the kept key blocks. A first pass finds
  the row maximum and large values of the row (each block's 2 largest, the 16 or 32 largest
  of those), whose closed form starts the search from a lower bound of τ; the search passes
  follow, then one pass accumulates ``p @ v``. Sparsemax's and 1.5-entmax's search passes
  (1.5-entmax's from the second) accumulate it as they go (the values times ``(z - τ_k)_+``,
  its square and ``1_S``, from which the output at the threshold the pass finds follows
  exactly when the pass confirms it): a tile whose last search pass confirms every row's
  threshold needs no output pass (most sparsemax tiles: their start is mostly τ itself). The
  output pass (or that last search pass)
  records which key blocks hold any nonzero weight: a block whose scores all fall below τ
  skips its ``p @ v`` products there and its work in the backward pass (with
  ``prefetch=True`` its operands are still loaded, before the test), so the sparsity the
  normalizer creates saves work, not only the mask's.

Backward (two kernels, FlashAttention-2 style, no ``n x n`` buffer): with ``g_i = p_i^(2-α)``
on the support (``p`` for softmax, ``1[p > 0]`` for sparsemax, ``√p`` for 1.5-entmax) the
normalizers' Jacobian gives ``ds = g ⊙ (dp - δ)`` with ``δ = Σ g dp / Σ g = do · ū`` and
``ū = Σ g v / Σ g``, which the forward pass accumulates beside the output (``ū = o`` for
softmax). One kernel walks the kept key blocks of each query block for ``dq`` (and the α and
scale derivatives, ``δ Σ c - Σ dp c`` per row, plus ``(Σ dp s' - δ Σ s') / ε²`` for α >= 1.5,
with the ``c`` and ``s'`` of :func:`~sparse_jax.normalizers.entmax_alpha_terms`); the other
walks, for each key block, the query blocks that keep it (the transposed layout) for ``dk``
and ``dv``. With ``dq_accumulation="atomic"`` the second kernel alone does both: it adds each
tile's share of ``dq`` and of the row terms to float32 sums by atomic adds (FlashAttention-2's
way: 5 tile products where the two kernels take 7, their scores and ``do @ vᵀ`` formed once).

Launch order: a grid whose later blocks hold more work than its earlier ones (a causal mask's
query blocks; key blocks when keys follow their queries) is launched last block first, so that
its longest programs start first and the short ones fill the end.

Numerics follow :func:`sparse_jax.attention`: scores, normalizer and accumulation in float32,
``p`` cast to ``v``'s dtype for its product, output in ``q``'s dtype; fully masked rows give
0 and zero gradients; non-finite input follows the attention policy (``+inf`` scores count as
the largest float, an allowed NaN makes the row NaN, a non-finite value vector makes its key's
scores NaN).

Backends: the kernels of this module use only what Pallas lowers with Triton (GPU) and run
unchanged in Pallas' interpret mode, which is how they run, and are tested, on CPU
(``interpret=None`` picks it there). Block sizes must be powers of two >= 16 (Triton's tiles);
the kernels run on tiles of at most 64 x 64 cut from them (``forward_block``, ``backward_block``);
head dims are zero-padded to one. On TPU, :func:`pallas_attention` runs the same algorithm
written for Mosaic (:mod:`sparse_jax.kernels.mosaic`: blocks multiples of 128, key blocks
streamed by DMA).

Run-time masks: ``static & padding(lengths)`` and ``& segments(ids)`` are applied as each batch
element's key length and segment ids beside the layout's static tiles. A ``padding`` and a
``segments`` leaf under ``|`` or ``~`` (``causal() | padding(prefix)``: a prefix-LM mask with a
run-time prefix per batch element) are evaluated tile by tile in the Triton and the Mosaic
kernels from the positions, the length and the ids (:class:`~sparse_jax.masks.TileExpression`),
over the blocks the layout's conservative bound keeps. Not supported (yet; :func:`pallas_supports`
says so and ``impl="auto"`` takes another engine): other run-time masks (two leaves of a kind
under ``|`` or ``~``, or beside an array mask), ``return_weights``, float64.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparse_jax.blocksparse import nonfinite_values
from sparse_jax.masks import (
    SENTINEL,
    BlockLayout,
    Mask,
    Padding,
    Segments,
    TileExpression,
    check_layout,
    key_lengths,
    runtime_leaves,
    segment_ids,
    split_runtime,
    tile_expression,
)
from sparse_jax.normalizers import (
    LIFT_FROM_EPS,
    SIGMA_MAX_EPS,
    entmax15_search,
    entmax15_start,
    entmax_alpha_terms,
    entmax_powers,
    entmax_search,
    sparsemax_search,
    sparsemax_start,
)
from sparse_jax.validation import (
    check_bias,
    check_bool,
    check_int,
    check_normalizer,
    check_qkv,
    check_scale,
)

__all__ = ["TRITON_TILE", "capped_forward", "pallas_attention", "pallas_supports"]

_NAME = "pallas_attention"
_MIN_BLOCK = 16  # Triton's smallest dot tile
_F32 = jnp.float32
_MAX = float(jnp.finfo(jnp.float32).max)


def _check_tuning(num_warps, num_stages, caller: str) -> None:
    """Refuses Triton tuning options it cannot take (ValueError/TypeError naming them)."""
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{caller}: `{name}` must be None or an int; got {value!r}")
        allowed = value in (1, 2, 4, 8, 16) if name == "num_warps" else value >= 1
        if not allowed:
            what = "1, 2, 4, 8 or 16" if name == "num_warps" else ">= 1"
            raise ValueError(f"{caller}: `{name}` must be None or {what}; got {value}")


# The Triton kernels' default tiles in both passes: the first GPU passes' sweep (docs/benchmarks.md,
# "Second GPU pass") found 64 x 64 tiles 1.7-2x faster than 128 x 128 on an H200 for softmax and
# sparsemax, causal and windowed, at head dim 64.
TRITON_TILE = 64


def _check_tile(tile, name: str, blocks: tuple[int, int], target, caller: str):
    """``tile`` (``forward_block`` or ``backward_block``) as ``(bq, bkv)`` ints dividing
    ``blocks``; None -> the Triton default (:data:`TRITON_TILE`, at most the blocks) or, for
    Mosaic, the blocks. Refuses what the kernels cannot take (ValueError/TypeError naming it)."""
    if tile is None:
        if target == "mosaic":
            return blocks
        return tuple(min(block, TRITON_TILE) for block in blocks)
    if (
        not isinstance(tile, (tuple, list))
        or len(tile) != 2
        or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in tile)
    ):
        raise TypeError(f"{caller}: `{name}` must be None or (bq, bkv) ints; got {tile!r}")
    for size, block in zip(tile, blocks, strict=True):
        if size < _MIN_BLOCK or size & (size - 1) or block % size:
            raise ValueError(
                f"{caller}: `{name}`={tuple(tile)} must be powers of two >= {_MIN_BLOCK} "
                f"dividing {blocks} (the layout's blocks, or for `backward_block` and "
                "`dq_block` the forward's tiles)"
            )
    if target == "mosaic" and tuple(tile) != blocks:
        raise ValueError(f"{caller}: `{name}` is for the Triton kernels (target='triton')")
    return tuple(int(x) for x in tile)


def _next_pow2(x: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(x) - 1).bit_length())


# ----------------------------------------------------------------------------------------------
# What the kernels support (the dispatcher asks before choosing them).


def pallas_supports(
    q: Any,
    layout: BlockLayout | None = None,
    *,
    mask: Any = None,
    return_weights: bool = False,
    backend: str | None = None,
    block_size: tuple[int, int] | None = None,
) -> tuple[bool, str]:
    """Whether :func:`pallas_attention` computes this call, and why not.

    Args:
      q: the queries (only the dtype is read).
      layout: the block layout (its block sizes and whether it is dynamic), if known.
      mask: the call's mask if it has a run-time part (``padding``).
      return_weights: whether the call asks for the weights.
      backend: ``jax.default_backend()`` when None; ``"gpu"`` and ``"cpu"`` run the Triton
        kernels (interpreted on CPU), ``"tpu"`` the Mosaic ones.
      block_size: ``(block_q, block_kv)`` when no layout is given.

    Returns:
      ``(True, "")`` or ``(False, reason)``.

    Example:
      >>> pallas_supports(np.zeros((1, 8, 1, 8)), backend="gpu")[1]  # numpy float64
      'float64 is not supported (the kernels compute in float32)'
    """
    backend = backend or jax.default_backend()
    if backend not in ("cpu", "gpu", "tpu"):
        return False, f"no Pallas kernel for backend {backend!r} (GPU, TPU, CPU interpret)"
    if jnp.dtype(q.dtype) == jnp.float64:
        return False, "float64 is not supported (the kernels compute in float32)"
    if return_weights:
        return False, "return_weights is not supported (the weights are never materialised)"
    if mask is not None and mask.is_dynamic and _runtime_parts(mask) is None:
        expr = tile_expression(mask)
        if isinstance(expr, str):
            return False, f"the run-time mask is not supported by the fused kernels: {expr}"
    if layout is not None:
        block_size = (layout.block_q, layout.block_kv)
    if block_size is not None:
        why = _block_error(*block_size, "mosaic" if backend == "tpu" else "triton")
        if why:
            return False, why
    return True, ""


def _block_error(block_q: int, block_kv: int, target: str) -> str:
    """Why the kernels of ``target`` cannot take these block sizes ("" when they can)."""
    if target == "mosaic":
        from sparse_jax.kernels.mosaic import mosaic_block_error

        return mosaic_block_error(block_q, block_kv)
    for name, size in (("block_q", block_q), ("block_kv", block_kv)):
        if size < _MIN_BLOCK or size & (size - 1):
            return f"`{name}`={size} is not a power of two >= {_MIN_BLOCK}"
    return ""


def _runtime_parts(mask: Mask) -> tuple[tuple[Padding, ...], tuple[Segments, ...]] | None:
    """The ``Padding`` and ``Segments`` leaves of ``mask`` if its run-time part is ``&`` of any
    number of paddings and at most one segments leaf, joined by ``&`` to a static mask; None
    for other run-time masks."""
    parts = split_runtime(mask)
    return None if parts is None or len(parts[2]) > 1 else parts[1:]


def _expression(mask: Any, layout: BlockLayout) -> TileExpression | None:
    """The tile expression of a dynamic layout's mask whose run-time leaves sit under ``|`` or
    ``~``; None when the layout is static or the mask is ``static & run-time leaves``."""
    if not layout.dynamic or not isinstance(mask, Mask) or _runtime_parts(mask) is not None:
        return None
    expr = tile_expression(mask)
    return None if isinstance(expr, str) else expr


def _leaves(mask: Mask, layout: BlockLayout):
    """``(padding leaves, segments leaves)`` the kernels read for a dynamic layout's mask, of
    ``static & run-time leaves`` or of a tile expression; None for other run-time masks."""
    parts = _runtime_parts(mask)
    if parts is None and _expression(mask, layout) is not None:
        parts = runtime_leaves(mask)
    return parts


def _kv_lengths(mask: Any, layout: BlockLayout, b: int, tk: int, caller: str) -> jax.Array:
    """Each batch element's key length ``[B]`` int32: ``Tk`` for a static layout, the run-time
    ``padding`` lengths of ``mask`` (their minimum) for a dynamic one (for a tile expression:
    its ``padding`` leaf's lengths)."""
    if not layout.dynamic:
        return jnp.full((b,), tk, jnp.int32)
    if not isinstance(mask, Mask) or not mask.is_dynamic:
        raise ValueError(
            f"{caller}: `layout` is dynamic (built from a run-time `padding` mask): pass the mask "
            f"it was built from as `mask=` (got {type(mask).__name__})"
        )
    parts = _leaves(mask, layout)
    if parts is None:
        raise ValueError(
            f"{caller}: the run-time part of `mask` must be padding(lengths) and/or one "
            f"segments(...) joined with & to a static mask, or at most one of each under | "
            f"and ~; got {mask!r}. Use impl='blocksparse' for other run-time masks"
        )
    if not parts[0]:
        return jnp.full((b,), tk, jnp.int32)
    return key_lengths(parts[0], b, tk, caller)


def _segment_ids(mask: Any, layout: BlockLayout, b: int, tq_pad: int, tk_pad: int, caller: str):
    """``(q_ids [B, Tq_pad], kv_ids [B, Tk_pad])`` int32 of the mask's ``segments`` leaf, padded
    with ids that never match (-1 for queries, -2 for keys: positions beyond the ids are
    masked, as ``segments`` evaluates them); None when the mask has none."""
    if not layout.dynamic:
        return None
    parts = _leaves(mask, layout)
    if parts is None or not parts[1]:
        return None
    q_ids, kv_ids = segment_ids(parts[1][0], b, caller)
    q_ids, kv_ids = q_ids[:, :tq_pad], kv_ids[:, :tk_pad]
    q_ids = jnp.pad(q_ids, ((0, 0), (0, tq_pad - q_ids.shape[1])), constant_values=-1)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, tk_pad - kv_ids.shape[1])), constant_values=-2)
    return q_ids, kv_ids


# ----------------------------------------------------------------------------------------------
# Static description of one call.


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """Static shapes, the normalizer and the layout arrays of one call (hashed by identity)."""

    kind: str  # "softmax" | "sparsemax" | "entmax15" | "entmax"
    sigma: Any  # entmax: python bool (static α) or None (decided per head from eps)
    b: int
    n: int
    g: int  # query heads per key head
    bq: int
    bkv: int
    nq: int
    nk: int
    d: int  # padded head dims
    dv: int
    per_head: int  # 1: layout arrays per head, 0: shared
    interpret: bool
    segments: bool  # the mask has a run-time segments leaf (ids compared in the kernels)
    expr: TileExpression | None  # run-time leaves under | or ~: the mask evaluated per tile
    kv_len: int  # Tk: keys at or beyond it are the padding of the last block
    target: str  # "triton" (GPU) or "mosaic" (TPU): which kernels run
    precision: Any  # of the tiles' products (jax.lax.Precision or None)
    bias_axes: tuple[bool, bool, bool, bool]  # the bias has a full (batch, head, q, kv) axis
    arrays: dict  # numpy layout arrays (see _layout_arrays)
    num_warps: int | None = None  # Triton's warps per program (None: by head dim)
    num_stages: int = 2  # Triton's software-pipelining depth
    backward: Any = None  # (plan of the backward tiles, parent slots, fq) or None: the same
    backward_dq: Any = None  # the dq kernel's, the same way (dq_block); None: the forward's
    has_bias: bool = True  # False: no bias was given (nothing added, no bias gradient formed)
    dynamic: bool = False  # the layout bounds a run-time mask: full blocks are masked too
    scale_grad: bool = True  # False: a python float scale (its gradient is never asked for)
    search_cap: int | None = None  # capped_forward's diagnostics: search passes at most
    start_top: int | None = None  # capped_forward's diagnostics: values the start uses
    atomic_dq: bool = False  # dq added by the dk/dv kernel (dq_accumulation="atomic")
    prefetch: bool = False  # sparse normalizers: blocks loaded before the live test
    speculate: bool = True  # sparsemax, 1.5-entmax: search passes accumulate the output

    @property
    def row_length(self) -> int:
        return self.arrays["idx"].shape[-1] * self.bkv

    @property
    def reverse_q(self) -> bool:
        """The kernels with a program per query block start from the last: see _heavy_last."""
        return _heavy_last(self.arrays["count"])

    @property
    def reverse_kv(self) -> bool:
        """The dk/dv kernel, a program per key block, starts from the last: see _heavy_last."""
        return _heavy_last(self.arrays["t_count"])


def _heavy_last(counts: np.ndarray) -> bool:
    """Whether the blocks of a grid axis (``counts`` ``[H, n, 1]``: blocks each visits) hold
    more work in its second half than in its first, as a causal mask's query blocks do. The
    GPU starts programs in grid order, so such a grid is launched last-first: the longest
    programs start first and the shortest fill the end, where in order the longest would run
    last with the chip around them idle (FlashAttention-3 schedules causal attention
    longest-first)."""
    per_block = counts.sum(axis=(0, 2))
    n = per_block.shape[0]
    return bool(per_block[(n + 1) // 2 :].sum() > per_block[: n // 2].sum())


def _grid_block(reverse: bool, blocks: int):
    """The block a program works on from its id on the grid's first axis (see _heavy_last)."""
    i = pl.program_id(0)
    return blocks - 1 - i if reverse else i


def _layout_arrays(layout: BlockLayout) -> dict:
    """The layout as the kernels read it, slot widths padded to powers of two.

    ``idx``/``full``/``pmi`` ``[H, nq, Kp]`` (kept key blocks of each query block, in order),
    ``count`` ``[H, nq, 1]``; ``masks`` ``[P, bq, bkv]`` int32; the transposed layout for the
    key-block kernel: ``t_rows``/``t_slots`` ``[H, nk, Mp]`` (the query blocks keeping each key
    block and the slot it has there), ``t_count`` ``[H, nk, 1]``.
    """
    return _kernel_arrays(
        layout.kv_block_indices, layout.block_is_full, layout.partial_mask_index,
        layout.kv_block_counts, layout.partial_masks, layout.num_kv_blocks,
    )  # fmt: skip


def _kernel_arrays(idx, full, pmi, counts, partial_masks, nk: int) -> dict:
    """:func:`_layout_arrays` of a layout given as its arrays (``BlockLayout``'s fields) and
    its number of key blocks ``nk``."""
    h, _, k = idx.shape
    kp = _next_pow2(k)
    valid = idx != SENTINEL

    def pad(x, fill=0):
        return np.pad(x, ((0, 0), (0, 0), (0, kp - k)), constant_values=fill).astype(np.int32)

    masks = partial_masks.astype(np.int32)
    p = _next_pow2(max(1, masks.shape[0]))
    bq, bkv = masks.shape[1:]
    masks = np.concatenate([masks, np.zeros((p - masks.shape[0], bq, bkv), np.int32)])
    hh, rr, ss = np.nonzero(valid)
    cc = idx[hh, rr, ss]
    order = np.lexsort((rr, cc, hh))
    hh, rr, ss, cc = hh[order], rr[order], ss[order], cc[order]
    key = hh * nk + cc
    t_count = np.bincount(key, minlength=h * nk).reshape(h, nk)
    first = np.searchsorted(key, key, side="left")
    pos = np.arange(len(key)) - first
    mp = _next_pow2(max(1, int(t_count.max(initial=0))))
    t_rows = np.zeros((h, nk, mp), np.int32)
    t_slots = np.zeros((h, nk, mp), np.int32)
    t_rows[hh, cc, pos] = rr
    t_slots[hh, cc, pos] = ss
    return {
        "idx": pad(np.where(valid, idx, 0)),
        "full": pad(full),
        "pmi": pad(np.maximum(pmi, 0)),
        "count": counts[..., None].astype(np.int32),
        "masks": masks,
        "t_rows": t_rows,
        "t_slots": t_slots,
        "t_count": t_count[..., None].astype(np.int32),
    }


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """A layout cut into smaller tiles by :func:`_refine`: :class:`BlockLayout`'s arrays
    (``[H, nq', K']``, ``partial_masks [P, bq, bkv]``) and sizes, padding tiles included (so
    ``num_kv_blocks`` is the layout's times the cut, not ``ceil(kv_len / bkv)``)."""

    kv_block_indices: np.ndarray
    kv_block_counts: np.ndarray
    block_is_full: np.ndarray
    partial_mask_index: np.ndarray
    partial_masks: np.ndarray
    block_q: int
    block_kv: int
    num_kv_blocks: int


def _refine(layout: BlockLayout | _Tiles, bq: int, bkv: int) -> tuple[_Tiles, np.ndarray]:
    """``layout`` cut into ``bq x bkv`` tiles (dividing its blocks), and each tile's parent slot
    ``[H, nq', K']`` (the slot, in its query block's row of ``layout``, of the block it was cut
    from). A full block gives full tiles; a partial one, its mask's tiles: all True -> full,
    all False -> dropped, else partial. Every query and key block gives ``block / tile`` rows
    and columns, padding included, so the kernels' padded shapes are unchanged. For a static
    mask the tiles are those of ``mask.blocks(Tq, Tk, bq, bkv)``.

    Example:
      >>> from sparse_jax.masks import causal
      >>> tiles, parent = _refine(causal().blocks(4, 4, 4, 4), 2, 2)
      >>> tiles.kv_block_counts[0].tolist(), tiles.block_is_full[0, 1].tolist()
      ([1, 2], [True, False])
    """
    fq, fk = layout.block_q // bq, layout.block_kv // bkv
    idx, full = layout.kv_block_indices, layout.block_is_full
    h, nq, k = idx.shape
    valid = idx != SENTINEL
    masks = layout.partial_masks.reshape(-1, fq, bq, fk, bkv).transpose(0, 1, 3, 2, 4)
    tile_any, tile_all = masks.any(axis=(-1, -2)), masks.all(axis=(-1, -2))  # [P, fq, fk]
    partial = tile_any & ~tile_all
    flat = masks[partial].reshape(-1, bq * bkv)
    unique, inverse = np.unique(flat, axis=0, return_inverse=True)
    tile_index = np.full(partial.shape, SENTINEL, np.int64)
    tile_index[partial] = inverse.reshape(-1)
    parent_mask = np.maximum(layout.partial_mask_index, 0)  # [H, nq, K]
    whole = full[..., None, None]
    kept = valid[..., None, None] & (whole | tile_any[parent_mask])  # [H, nq, K, fq, fk]
    tile_full = kept & (whole | tile_all[parent_mask])
    tile_pmi = np.where(tile_full, SENTINEL, tile_index[parent_mask])
    keys = idx[..., None, None] * fk + np.arange(fk)[None, None, None, None, :]
    slots = np.broadcast_to(np.arange(k)[None, None, :, None, None], kept.shape)

    def rows(x):  # [H, nq, K, fq, fk] -> [H, nq * fq, K * fk]: a tile row's entries in key order
        x = np.broadcast_to(x, kept.shape).transpose(0, 1, 3, 2, 4)
        return x.reshape(h, nq * fq, k * fk)

    kept, tile_full, tile_pmi, keys, slots = map(rows, (kept, tile_full, tile_pmi, keys, slots))
    order = np.argsort(~kept, axis=-1, kind="stable")  # kept entries first, in key order
    counts = kept.sum(axis=-1).astype(np.int32)
    width = max(1, int(counts.max(initial=0)))

    def take(x):
        return np.take_along_axis(x, order, axis=-1)[..., :width]

    kept = take(kept)
    tiles = _Tiles(
        kv_block_indices=np.where(kept, take(keys), SENTINEL).astype(np.int32),
        kv_block_counts=counts,
        block_is_full=take(tile_full) & kept,
        partial_mask_index=np.where(kept, take(tile_pmi), SENTINEL).astype(np.int32),
        partial_masks=unique.reshape(-1, bq, bkv).astype(bool),
        block_q=bq,
        block_kv=bkv,
        num_kv_blocks=layout.num_kv_blocks * fk,
    )
    return tiles, np.where(kept, take(slots), 0).astype(np.int32)


def _backward_tiles(plan: _Plan, source, forward_block, tile):
    """``(plan of the tiles, parent slots, fq)`` of a backward kernel on ``tile`` ``(bq,
    bkv)`` cut from the forward's tiles (``source``, of ``forward_block``), or None where
    ``tile`` is the forward's own: see :func:`_refined_live` for ``parent`` and ``fq``."""
    if tuple(tile) == tuple(forward_block):
        return None
    tiles, parent = _refine(source, *tile)
    refined = _tiles_plan(plan, tiles)
    width = refined.arrays["idx"].shape[-1]
    parent = np.pad(parent, ((0, 0), (0, 0), (0, width - parent.shape[-1])))
    return refined, parent, forward_block[0] // tile[0]


def _on_tiles(plan: _Plan, refined, res: dict) -> tuple[_Plan, dict]:
    """``(plan, forward residuals)`` of a backward kernel on ``refined`` tiles (see
    :func:`_backward_tiles`; None: the forward's): the forward's live flags mapped to them."""
    if refined is None:
        return plan, res
    tiles, parent, fq = refined
    if res["live"] is not None:
        res = {**res, "live": _refined_live(res["live"], parent, fq)}
    return tiles, res


def _tiles_plan(plan: _Plan, tiles: _Tiles) -> _Plan:
    """``plan`` on the tiles of :func:`_refine` (same padded lengths, smaller tiles)."""
    return dataclasses.replace(
        plan, bq=tiles.block_q, bkv=tiles.block_kv, nq=plan.nq * plan.bq // tiles.block_q,
        nk=tiles.num_kv_blocks, arrays=_layout_arrays(tiles),
    )  # fmt: skip


def _refined_live(live, parent, fq: int):
    """The forward pass' live flags ``[B, N, nq, Kp]`` for the refined backward layout: a tile
    is live when the block it was cut from is (a superset of the tiles with weight)."""
    rows = jnp.repeat(live, fq, axis=2)  # [B, N, nq', Kp]
    index = jnp.broadcast_to(jnp.asarray(parent)[None], (*rows.shape[:2], *parent.shape[1:]))
    return jnp.take_along_axis(rows, index, axis=-1)


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


def _dot(plan: _Plan, a, b, contract_a: int = 1, contract_b: int = 1):
    """a @ b contracting the given axes of two 2-d tiles, accumulated in float32."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=plan.precision, preferred_element_type=_F32)


def _runtime_tile(plan: _Plan, q_block, kv_block, kv_length, q_ids, kv_ids):
    """``(key bound, tile)`` of the run-time mask on query block ``q_block`` and key block
    ``kv_block``: keys at or beyond the bound are masked, and where ``tile`` (``[bq, bkv]``
    bool, None for none) is False. ``kv_length``: the batch element's ``padding`` length;
    ``q_ids``/``kv_ids``: callables reading the tile's segment ids ``[bq]``/``[bkv]``."""
    same = _same_segment(plan, q_ids, kv_ids)
    if plan.expr is None:
        return kv_length, same
    rows = q_block * plan.bq + jnp.arange(plan.bq, dtype=jnp.int32)[:, None]
    keys = kv_block * plan.bkv + jnp.arange(plan.bkv, dtype=jnp.int32)[None, :]
    return plan.kv_len, plan.expr(rows, keys, key_length=kv_length, same_segment=same)


def _row_tile(plan: _Plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block):
    """:func:`_runtime_tile` in the kernels that own one query block (``q_block``, the grid's
    first axis, read outside their loops): its segment ids in ``qseg_ref`` ``[bq]``, every
    key's in ``kvseg_ref`` ``[Tk]``."""
    start = pl.multiple_of(kv_block * plan.bkv, plan.bkv)
    return _runtime_tile(
        plan, q_block, kv_block, kv_length,
        lambda: qseg_ref[...], lambda: kvseg_ref[pl.ds(start, plan.bkv)],
    )  # fmt: skip


def _key_block(ref, plan: _Plan, kv_block):
    """Rows ``[bkv, ...]`` of key block ``kv_block`` from a ref of every key's (keys, values)."""
    return ref[pl.ds(pl.multiple_of(kv_block * plan.bkv, plan.bkv), plan.bkv), :]


def _visit_if_live(plan: _Plan, live, visit, load, carry):
    """``visit(carry, load())`` for a block that holds weight (``live != 0``; every block for
    softmax), else ``carry``. With ``plan.prefetch`` the loads come before the branch, in the
    loop's own body, where Triton pipelines them with the previous step's work; else only live
    blocks load, inside the branch, each load waited for."""
    if plan.kind == "softmax":
        return visit(carry, load())
    if plan.prefetch:
        loaded = load()
        return jax.lax.cond(live != 0, lambda c: visit(c, loaded), lambda c: c, carry)
    return jax.lax.cond(live != 0, lambda c: visit(c, load()), lambda c: c, carry)


def _block_scores(q, k, kv_block, plan: _Plan, scale, bias_ref, key_nan_ref):
    """Scaled, biased scores ``[bq, bkv]`` of a query tile with key block ``kv_block`` (keys
    ``k`` ``[bkv, D]``; +inf clipped), and the raw products q·k. ``bias_ref``: the query
    tile's bias rows; ``key_nan_ref``: NaN at the keys whose value vector is not finite, 0
    elsewhere."""
    start = pl.multiple_of(kv_block * plan.bkv, plan.bkv)
    raw = _dot(plan, q, k)
    s = raw * scale + key_nan_ref[pl.ds(start, plan.bkv)][None, :]
    if plan.has_bias:
        s = s + (bias_ref[:, pl.ds(start, plan.bkv)] if plan.bias_axes[3] else bias_ref[...])
    return raw, _clip_inf(s)


def _clip_inf(s):
    """+inf scores count as the largest float; NaN stays NaN. Not ``jnp.minimum``: Triton
    lowers float min/max to ``minnumf``/``maxnumf``, which return the other operand where one
    is NaN, so every NaN the attention policy must keep is tested for, never left to them."""
    return jnp.where(s > _MAX, _MAX, s)


def _masked(plan: _Plan, s, full, mask_index, masks_ref, kv_block, bound_and_tile):
    """Scores ``s [bq, bkv]`` of a kept block, -inf where not allowed: a partial block's
    mask; with ``bound_and_tile`` of :func:`_runtime_tile`, keys at or beyond the bound (the
    batch element's run-time padding length, or ``Tk``) masked, and where the tile is False.

    A full block of a layout without run-time parts passes through untouched, and only a
    partial block loads its mask's ``[bq, bkv]`` tile (a ``lax.cond`` on the block's flag):
    most blocks of a causal or windowed layout are full, and the int32 tile, loaded for every
    block, was twice the bytes of the block's keys and values."""
    kv_length, tile = bound_and_tile
    keys = kv_block * plan.bkv + jnp.arange(plan.bkv, dtype=jnp.int32)

    def apply(s, allowed):
        allowed = jnp.logical_and(allowed, (keys < kv_length)[None, :])
        allowed = allowed if tile is None else jnp.logical_and(allowed, tile)
        return jnp.where(allowed, s, -jnp.inf)

    def whole(s):
        return apply(s, True) if plan.dynamic else s  # (a run-time tile implies dynamic)

    return jax.lax.cond(full != 0, whole, lambda s: apply(s, masks_ref[mask_index] != 0), s)


def _same_segment(plan: _Plan, q_ids, kv_ids):
    """``[bq, bkv]``: query and key in the same segment; None without a segments mask.
    ``q_ids``: ``[bq]``, ``kv_ids``: ``[bkv]`` (callables, read only when needed)."""
    return q_ids()[:, None] == kv_ids()[None, :] if plan.segments else None


def _z(kind: str, x, row_max, eps):
    """The search variable of a masked score tile ``x`` (-inf where masked): x - max, scaled."""
    shifted = x - row_max
    if kind == "sparsemax":
        return shifted
    if kind == "entmax15":
        return 0.5 * shifted
    return eps * shifted


def _weights(kind: str, z, tau, eps, sigma):
    """Unnormalized weights p̂ and Jacobian weights ŝ = p̂^(2-α) of a tile at threshold τ."""
    if kind == "sparsemax":
        return jnp.maximum(z - tau, 0.0), (z > tau).astype(_F32)
    if kind == "entmax15":
        u = jnp.maximum(z - tau, 0.0)
        return u * u, u
    return entmax_powers(z, tau, eps, sigma)


def _search(kind: str, row_max, n_valid, eps, sigma, row_length: int, expm1=jnp.expm1, tau0=None):
    """The :class:`~sparse_jax.normalizers.RowSearch` of a row tile, started from ``tau0`` (a
    lower bound of τ; default -1, the bound every row has once its maximum is 0)."""
    done0 = jnp.logical_not(row_max > -jnp.inf)  # nothing allowed, or NaN: no search
    tau0 = jnp.full_like(row_max, -1.0) if tau0 is None else jnp.where(done0, -1.0, tau0)
    if kind == "sparsemax":  # (smallest: a pass here costs more than a row minimum)
        return sparsemax_search(tau0, done0, row_length, smallest=True)
    if kind == "entmax15":
        return entmax15_search(tau0, done0, smallest=True)
    return entmax_search(eps, sigma, n_valid, done0, expm1)


def _term_count(plan: _Plan, search, rows: int) -> int:
    """How many row reductions a pass of ``search`` takes (its terms of a tile)."""
    tile = jax.ShapeDtypeStruct((rows, plan.bkv), _F32)
    return len(jax.eval_shape(search.terms, tile, search.init))


def _pass_limit(plan: _Plan, search) -> int:
    """The search's passes at most: its own bound, or capped_forward's cap below it."""
    return search.max_iter if plan.search_cap is None else min(search.max_iter, plan.search_cap)


def _every_row(flags):
    """Whether every row's flag ``[rows, 1]`` is set, a scalar bool (Triton lowers no boolean
    reductions: as a max over 0/1)."""
    return jnp.max(jnp.where(flags, 0, 1).astype(jnp.int32)) == 0


def _threshold(plan: _Plan, row_max, n_valid, eps, sigma, row_sums, expm1=jnp.expm1, tau0=None):
    """Each row's threshold τ ``[rows, 1]`` by the normalizer's search, pass after pass until
    every row of the tile is done. ``row_sums(terms_of, n_terms)`` sums ``terms_of(z)`` (a tuple
    of ``n_terms`` tiles from a tile of search variables) over the row's kept blocks: each
    kernel family walks its blocks its own way. ``expm1``: for compilers without one. ``tau0``:
    a start (sparsemax; see :func:`_search`)."""
    search = _search(plan.kind, row_max, n_valid, eps, sigma, plan.row_length, expm1, tau0)
    n_terms = _term_count(plan, search, row_max.shape[0])
    max_iter = _pass_limit(plan, search)

    def cond(carry):
        it, state = carry
        return jnp.logical_and(it < max_iter, jnp.logical_not(_every_row(state[-1])))

    def step(carry):
        it, state = carry
        terms_of = lambda z: search.terms(z, state)
        return it + 1, search.update(state, row_sums(terms_of, n_terms, search.minima))

    _, state = jax.lax.while_loop(cond, step, (jnp.int32(0), search.init))
    return state[0]  # (1.5-entmax's search polishes its rows itself, where they need it)


# The start of τ's search (normalizers.sparsemax_start / entmax15_start: a lower bound from
# any of the row's values, tightest from its largest): the first pass merges each block's
# _BLOCK_TOP largest values of a row into the row's _START_TOP largest of those. Counted by
# `python -m experiments.bench search_passes` on 64-row tiles of random scores, 2 per block
# into 8 gives sparsemax the passes of the row's true 8 largest (2: the start exact and a
# confirming pass) for 2 row maxima per block, where the true 4 largest took 4 per block and
# 1 to 2 passes more; 1.5-entmax's supports are wider. Timed on an H200 (causal, n = 16384,
# bfloat16; docs/benchmarks.md, fourth GPU pass: `bench forward_passes --start-values`), the
# forward from 16 values took sparsemax 14.1 ms against 15.3 from 8, and from 32 values
# 1.5-entmax 22.3 ms against 28.4 from 16 (a search pass saved costs 3-4 ms there; the merge
# is on [rows, 1] values, cheap beside a tile's work).
_START_TOP = {"sparsemax": 16, "entmax15": 32}
_BLOCK_TOP = 2


def _tile_top(x, k: int):
    """The ``k`` largest values of each row of a tile ``[rows, n]``, each ``[rows, 1]``, in
    decreasing order; a value tied with a larger one is dropped (a smaller one, or -inf, takes
    its place: the start it feeds is then only lower)."""
    values = []
    for i in range(k):
        value = jnp.max(x, axis=-1, keepdims=True)
        values.append(value)
        if i + 1 < k:
            x = jnp.where(x >= value, -jnp.inf, x)
    return values


def _insert(top, value):
    """The ``len(top)`` largest of ``top`` (``[rows, 1]`` each, decreasing) and ``value``."""
    out = [jnp.maximum(top[0], value)]
    for i in range(1, len(top)):
        out.append(jnp.maximum(top[i], jnp.minimum(top[i - 1], value)))
    return tuple(out)


def _reductions_init(n_terms: int, minima: int, rows: int) -> tuple:
    """The ``[rows, 1]`` start of a pass' row reductions: 0 for sums, +inf for the last
    ``minima`` (minima; see :class:`~sparse_jax.normalizers.RowSearch`)."""
    return tuple(
        jnp.full((rows, 1), jnp.inf if i >= n_terms - minima else 0.0, _F32) for i in range(n_terms)
    )


def _reduce_block(acc: tuple, terms: tuple, minima: int) -> tuple:
    """``acc`` with one block's terms (``[rows, bkv]`` tiles) added, or for the last
    ``minima``, their row minimum taken."""
    n = len(terms)
    return tuple(
        jnp.minimum(a, jnp.min(x, axis=-1, keepdims=True))
        if i >= n - minima
        else a + jnp.sum(x, axis=-1, keepdims=True)
        for i, (a, x) in enumerate(zip(acc, terms, strict=True))
    )


def _row_pass(count, block_terms, n_terms: int, rows: int, minima: int = 0):
    """Sums ``block_terms(j)`` (a tuple of ``[rows, bkv]`` tiles) over the row's kept blocks
    (the last ``minima``: their minimum)."""

    def body(j, acc):
        return _reduce_block(acc, block_terms(j), minima)

    return jax.lax.fori_loop(0, count, body, _reductions_init(n_terms, minima, rows))


def _eps_sigma(plan: _Plan, eps_ref, rows: int):
    """(ε = α - 1 as a [rows, 1] tile, how τ is held) for α-entmax; else (None, None)."""
    if plan.kind != "entmax":
        return None, None
    eps = jnp.full((rows, 1), eps_ref[0], _F32)
    sigma = plan.sigma if plan.sigma is not None else eps <= SIGMA_MAX_EPS
    return eps, sigma


# ----------------------------------------------------------------------------------------------
# Forward kernels.


_LOG2E = float(np.log2(np.e))


def _exp(plan: _Plan, y):
    """``exp(y)`` of the softmax kernels' tiles. Triton: as ``exp2(y · log₂e)``, one
    multiply and the GPU's ``ex2`` instruction (FlashAttention's and jax's Pallas ``mha``'s
    way), where Pallas lowers ``exp`` to libdevice's ``__nv_expf``, which adds a range
    reduction around it: the softmax kernels take one exponential per score, in the forward
    and in each backward kernel, and at head dim 64 those weigh against the tile products.
    Relative error ``|y| · 2⁻²⁴`` or so, at the weights that count (``y`` near 0)."""
    if plan.target == "triton":
        return jnp.exp2(y * _LOG2E)
    return jnp.exp(y)


def _softmax_init(plan: _Plan, rows: int):
    """The online softmax's carry before the first key tile: (row max, total, acc)."""
    return (
        jnp.full((rows, 1), -jnp.inf, _F32),
        jnp.zeros((rows, 1), _F32),
        jnp.zeros((rows, plan.dv), _F32),
    )


def _softmax_step(plan: _Plan, carry, x, v):
    """The online (flash) softmax after one more key tile: masked scores ``x [bq, bkv]``
    (-inf where not allowed), values ``v [bkv, Dv]``."""
    row_max, total, acc = carry
    new_max = jnp.maximum(row_max, jnp.max(x, axis=-1, keepdims=True))
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = _exp(plan, row_max - shift)
    e = _exp(plan, x - shift)
    acc = correction * acc + _dot(plan, e.astype(v.dtype), v, 1, 0)
    return new_max, correction * total + jnp.sum(e, axis=-1, keepdims=True), acc


def _softmax_finish(carry):
    """(output ``[bq, Dv]`` float32, log-sum-exp ``[bq, 1]``; +inf for a row that sees no key,
    whose output is 0; NaN for a NaN row, whose derivatives are then NaN) of the online
    softmax's final carry."""
    row_max, total, acc = carry
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    out = acc / jnp.where(total > 0.0, total, 1.0)
    lse = jnp.where(total > 0.0, shift + jnp.log(total), jnp.inf)
    return out, jnp.where(jnp.isnan(total), jnp.nan, lse)


def _forward_softmax_kernel(scale_ref, len_ref, q_ref, k_ref, v_ref, bias_ref, key_nan_ref,
                            qseg_ref, kvseg_ref, idx_ref, cnt_ref, full_ref, pmi_ref, masks_ref,
                            o_ref, lse_ref, *, plan: _Plan):  # fmt: skip
    q = q_ref[...]
    scale = scale_ref[0]
    bq = q.shape[0]
    q_block, kv_length = _grid_block(plan.reverse_q, plan.nq), len_ref[0]  # (outside the loops)

    def body(j, carry):
        kv_block = idx_ref[j]
        k = _key_block(k_ref, plan, kv_block)
        _, s = _block_scores(q, k, kv_block, plan, scale, bias_ref, key_nan_ref)
        rt = _row_tile(plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block)
        x = _masked(plan, s, full_ref[j], pmi_ref[j], masks_ref, kv_block, rt)
        return _softmax_step(plan, carry, x, _key_block(v_ref, plan, kv_block))

    carry = jax.lax.fori_loop(0, cnt_ref[0], body, _softmax_init(plan, bq))
    out, lse = _softmax_finish(carry)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


def _forward_sparse_kernel(scale_ref, len_ref, eps_ref, q_ref, k_ref, v_ref, bias_ref,
                           key_nan_ref, qseg_ref, kvseg_ref, idx_ref, cnt_ref, full_ref, pmi_ref,
                           masks_ref, o_ref, ubar_ref, max_ref, tau_ref, mass_ref, live_ref, *,
                           plan: _Plan):  # fmt: skip
    q = q_ref[...]
    scale = scale_ref[0]
    bq = q.shape[0]
    q_block, kv_length = _grid_block(plan.reverse_q, plan.nq), len_ref[0]  # (outside the loops)
    count = cnt_ref[0]
    eps, sigma = _eps_sigma(plan, eps_ref, bq)

    def masked(j):
        kv_block = idx_ref[j]
        k = _key_block(k_ref, plan, kv_block)
        _, s = _block_scores(q, k, kv_block, plan, scale, bias_ref, key_nan_ref)
        rt = _row_tile(plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block)
        return _masked(plan, s, full_ref[j], pmi_ref[j], masks_ref, kv_block, rt)

    # The first pass finds each row's maximum; for sparsemax and 1.5-entmax, large values of
    # the row (each block's _BLOCK_TOP largest, the _START_TOP largest of those), whose start
    # (normalizers.sparsemax_start, entmax15_start), a lower bound of τ, saves search passes
    # (each recomputes the tile's scores over every kept block).
    start_of = {"sparsemax": sparsemax_start, "entmax15": entmax15_start}.get(plan.kind)
    n_top, block_top = (1, 1)
    if start_of is not None:  # (capped_forward's start_top: a diagnostic's other start)
        n_top, block_top = plan.start_top or _START_TOP[plan.kind], _BLOCK_TOP
    count_allowed = plan.kind == "entmax"  # only α-entmax's search reads the allowed keys

    def first_pass(j, carry):
        top, n_valid = carry
        x = masked(j)
        # A NaN score enters the maxima as +inf, which no score reaches (_clip_inf): a NaN
        # row's maximum is +inf. (Triton's max drops NaN; a where costs less than a count.)
        for value in _tile_top(jnp.where(jnp.isnan(x), jnp.inf, x), block_top):
            top = _insert(top, value)
        if count_allowed:
            n_valid = n_valid + jnp.sum((x > -jnp.inf).astype(_F32), axis=-1, keepdims=True)
        return top, n_valid

    init = ((jnp.full((bq, 1), -jnp.inf, _F32),) * n_top, jnp.zeros((bq, 1), _F32))
    top, n_valid = jax.lax.fori_loop(0, count, first_pass, init)
    nan_row = top[0] == jnp.inf
    row_max = jnp.where(nan_row, jnp.nan, top[0])
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # NaN stays NaN: its z is NaN
    tau0 = None if start_of is None else start_of([_z(plan.kind, t, shift, eps) for t in top])

    def z_of(j):
        return _z(plan.kind, masked(j), shift, eps)

    def row_sums(terms_of, n_terms, minima=0):
        return _row_pass(count, lambda j: terms_of(z_of(j)), n_terms, bq, minima)

    def load_v(j):
        return _key_block(v_ref, plan, idx_ref[j])

    def output_pass(tau):
        """(Σ p v, Σ g v, Σ p, Σ g) ``[bq, Dv]``/``[bq, 1]`` of the rows at their thresholds
        ``tau``, and each block's live flag (some row gives it weight, or is a NaN row, whose
        derivatives are NaN: the backward must visit it) written to ``live_ref``."""
        live_ref[...] = jnp.zeros(live_ref.shape, live_ref.dtype)

        def body(j, carry):
            acc, acc_u, mass, s_sum = carry
            p, s = _weights(plan.kind, z_of(j), tau, eps, sigma)
            block_mass = jnp.sum(p, axis=-1, keepdims=True)
            # A max over the rows' sums of p >= 0, as 0/1 (NaN must not hide rows).
            live = jnp.max(jnp.where((block_mass > 0.0) | nan_row, 1, 0)) > 0
            acc, acc_u = _live_products(plan, live_ref, j, live, (p, s), load_v, (acc, acc_u))
            return acc, acc_u, mass + block_mass, s_sum + jnp.sum(s, axis=-1, keepdims=True)

        zeros_v, zeros_r = jnp.zeros((bq, plan.dv), _F32), jnp.zeros((bq, 1), _F32)
        return jax.lax.fori_loop(0, count, body, (zeros_v, zeros_v, zeros_r, zeros_r))

    if plan.kind in _ACCUMULATE_FROM and plan.speculate:
        search = _search(plan.kind, row_max, n_valid, eps, sigma, plan.row_length, tau0=tau0)
        tau, confirmed, sums = _accumulating_search(plan, search, z_of, load_v, live_ref,
                                                    nan_row, count)  # fmt: skip
        acc, acc_u, mass, s_sum = jax.lax.cond(confirmed, lambda: sums, lambda: output_pass(tau))
    else:
        tau = _threshold(plan, row_max, n_valid, eps, sigma, row_sums, tau0=tau0)
        acc, acc_u, mass, s_sum = output_pass(tau)
    out = jnp.where(nan_row, jnp.nan, acc / jnp.where(mass > 0.0, mass, 1.0))
    o_ref[...] = out.astype(o_ref.dtype)
    ubar_ref[...] = acc_u / jnp.where(s_sum > 0.0, s_sum, 1.0)
    max_ref[...] = shift[:, 0]
    tau_ref[...] = tau[:, 0]
    mass_ref[...] = jnp.where(nan_row, jnp.nan, mass)[:, 0]


def _live_products(plan: _Plan, live_ref, j, live, weights, load_v, accs, gate=True):
    """Writes kept block ``j``'s live flag and, where it is live (and ``gate``), adds each of
    ``weights`` (``[bq, bkv]`` tiles) times the block's values (``load_v(j)``) to ``accs``
    ``[bq, Dv]``."""
    live_ref[j] = live.astype(live_ref.dtype)

    def products(accs, v):
        return tuple(
            acc + _dot(plan, w.astype(v.dtype), v, 1, 0)
            for acc, w in zip(accs, weights, strict=True)
        )

    return _visit_if_live(plan, live & gate, products, functools.partial(load_v, j), accs)


# The search pass from which a normalizer's passes accumulate the output (_accumulating_search):
# sparsemax's start is mostly τ* (its first search pass confirms it); 1.5-entmax takes 1-3
# passes from its start, and the first accumulating one would mostly be wasted products.
_ACCUMULATE_FROM = {"sparsemax": 0, "entmax15": 1}


def _accumulating_search(plan: _Plan, search, z_of, load_v, live_ref, nan_row, count):
    """Sparsemax's and 1.5-entmax's threshold searches whose passes also accumulate the
    output, so that a tile needs no output pass when its last search pass confirms every
    row's threshold.

    A pass at τ_k (from pass :data:`_ACCUMULATE_FROM` on) sums, beside the search's terms over
    S = {z > τ_k} (|S|, Σ u, and 1.5-entmax's Σ u², u = z - τ_k on S), the products of the
    values with ``u`` and ``1_S`` (and ``u²``). Where the pass ends a row's search at τ' with
    every entry of S above τ' (its smallest, which the search takes, > τ': S is then the
    support at τ', the entries outside it being <= τ_k <= τ'), the row's outputs follow
    exactly from the pass with δ = τ' - τ_k, the weights being ``u - δ`` (sparsemax, g = 1) or
    ``(u - δ)²`` (1.5-entmax, g = u - δ) on S:
    sparsemax ``Σ p v = u@v - δ 1@v``, ``Σ g v = 1@v``, ``Σ p = Σu - δ|S|``, ``Σ g = |S|``;
    1.5-entmax ``Σ p v = u²@v - 2δ u@v + δ² 1@v``, ``Σ g v = u@v - δ 1@v``, ``Σ p = Σu² -
    2δ Σu + δ²|S|``, ``Σ g = Σu - δ|S|`` (δ is the last Newton step, small beside the weights
    that count: the bfloat16 products' rounding of ``u²`` and ``u`` weighs about twice that of
    ``p``). Rows done in earlier passes are evaluated at their own τ (δ = 0). Each pass writes
    the blocks' live flags (some row has entries in S, or is a NaN row).

    ``z_of(j)``: the search variables of kept block ``j`` ``[bq, bkv]``; ``load_v(j)``: its
    values. Returns ``(τ [bq, 1], confirmed, (Σ p v, Σ g v, Σ p, Σ g))``: ``confirmed`` (a
    scalar bool) says every row of the tile took its threshold in an accumulating pass that
    confirmed it; else the sums are not the output and an output pass must follow (a tie at
    τ', a capped search, a tile done before its first accumulating pass).
    """
    rows = nan_row.shape[0]
    entmax15 = plan.kind == "entmax15"
    max_iter = _pass_limit(plan, search)
    zeros_v = jnp.zeros((rows, plan.dv), _F32)
    accs0 = (zeros_v,) * (3 if entmax15 else 2)
    # sparsemax (|S|, Σ_S z, min S); 1.5-entmax (|S|, Σ u, Σ u², min S)
    n_terms = _term_count(plan, search, rows)
    first = _ACCUMULATE_FROM[plan.kind]

    def one_pass(state, accumulate):
        tau = state[0]

        def body(j, carry):
            sums, accs = carry
            z = z_of(j)
            terms = search.terms(z, state)
            inside = terms[0]  # 1 on S, else 0
            size_before = sums[0]
            sums = _reduce_block(sums, terms, search.minima)
            # The block's entries in S: what |S| gained (exact: counts); as 0/1 (see output_pass).
            live = jnp.max(jnp.where((sums[0] > size_before) | nan_row, 1, 0)) > 0
            u = jnp.where(inside > 0.0, z - tau, 0.0)
            weights = (u * u, u, inside) if entmax15 else (u, inside)
            accs = _live_products(plan, live_ref, j, live, weights, load_v, accs, accumulate)
            return sums, accs

        init = (_reductions_init(n_terms, search.minima, rows), accs0)
        return jax.lax.fori_loop(0, count, body, init)

    def running(carry):
        it, state = carry[0], carry[1]
        return jnp.logical_and(it < max_iter, jnp.logical_not(_every_row(state[-1])))

    def step(carry):
        it, state = carry[0], carry[1]
        sums, accs = one_pass(state, it >= first)
        return it + 1, search.update(state, sums), state[0], sums, accs

    init = (jnp.int32(0), search.init, search.init[0],
            _reductions_init(n_terms, search.minima, rows), accs0)  # fmt: skip
    it, state, tau_k, sums, accs = jax.lax.while_loop(running, step, init)
    tau, size, smallest = state[0], sums[0], sums[-1]
    exact = state[-1] & ((smallest > tau) | (size == 0.0))
    confirmed = (it > first) & _every_row(exact)
    delta = tau - tau_k
    if entmax15:
        (u2_v, u_v, ones_v), (s1, s2) = accs, sums[1:3]
        out = (u2_v - 2.0 * delta * u_v + delta * delta * ones_v, u_v - delta * ones_v,
               s2 - 2.0 * delta * s1 + delta * delta * size, s1 - delta * size)  # fmt: skip
    else:
        (u_v, ones_v), total = accs, sums[1]
        out = (u_v - delta * ones_v, ones_v, total - tau * size, size)
    return tau, confirmed, out


# ----------------------------------------------------------------------------------------------
# Backward: the weights and Jacobian weights of a tile, recomputed from the row statistics.


def _recompute(plan: _Plan, x, rows: dict, eps, sigma):
    """(p, g) of a masked score tile: the weights and g = p^(2-α) (softmax: g = p)."""
    if plan.kind == "softmax":
        p = _exp(plan, x - rows["lse"])
        return p, p
    z = _z(plan.kind, x, rows["max"], eps)
    p_hat, s_hat = _weights(plan.kind, z, rows["tau"], eps, sigma)
    # Per-row factors [rows, 1], so that each entry takes a product, not a division. mass is
    # NaN for a NaN row (whose p̂ Triton's max may have zeroed): its weights and derivatives
    # are NaN, by a select (an indicator times NaN came out 0, not NaN, in interpret mode).
    mass = rows["mass"]
    safe = jnp.where(mass > 0.0, mass, 1.0)
    nan_row = jnp.isnan(mass)
    if plan.kind == "sparsemax":
        g_factor = jnp.ones_like(safe)
    elif plan.kind == "entmax15":
        g_factor = jax.lax.rsqrt(safe)
    else:
        g_factor = jnp.exp((eps - 1.0) * jnp.log(safe))
    p = jnp.where(nan_row, jnp.nan, p_hat * (1.0 / safe))
    return p, jnp.where(nan_row, jnp.nan, s_hat * g_factor)


def _row_names(plan: _Plan) -> tuple[str, ...]:
    stats = ("lse",) if plan.kind == "softmax" else ("max", "tau", "mass")
    return (*stats, "delta")


def _row_terms(plan: _Plan, p, ds, dp, raw, eps):
    """A key tile's shares of the per-row sums that the scale, the bias and α take: ``(α
    sums, Σ ds·raw, Σ ds)`` ``[rows, 1]`` each (None where the call asks no such gradient);
    the α sums are the four of :func:`_alpha_rows` (Σ c, Σ dp c, Σ s_rest, Σ dp s_rest).
    ``ds``: zero off the support."""
    ds_raw = jnp.sum(ds * raw, axis=-1, keepdims=True) if plan.scale_grad else None
    ds_rows = jnp.sum(ds, axis=-1, keepdims=True) if plan.has_bias else None  # the bias' rows
    alpha = None
    if plan.kind == "entmax":
        _, c, s_rest = entmax_alpha_terms(p, eps)
        terms = (c, jnp.where(c != 0.0, dp * c, 0.0), s_rest)
        terms += (jnp.where(s_rest != 0.0, dp * s_rest, 0.0),)
        alpha = tuple(jnp.sum(t, axis=-1, keepdims=True) for t in terms)
    return alpha, ds_raw, ds_rows


def _dq_step(plan: _Plan, carry, p, g, dp, delta, raw, k, eps):
    """Adds one key tile's share to the dq kernel's sums ``(dq, α sums, Σ ds·raw, Σ ds)``:
    ``ds = g ⊙ (dp - δ)`` and the row terms of :func:`_row_terms`."""
    dq, alpha_sums, ds_raw, ds_rows = carry
    ds = g * (dp - delta)
    dq = dq + _dot(plan, ds.astype(k.dtype), k, 1, 0)
    ds = jnp.where(g != 0.0, ds, 0.0)
    alpha, raw_sum, row_sum = _row_terms(plan, p, ds, dp, raw, eps)
    if alpha is not None:
        alpha_sums = tuple(a + t for a, t in zip(alpha_sums, alpha, strict=True))
    ds_raw = ds_raw if raw_sum is None else ds_raw + raw_sum
    ds_rows = ds_rows if row_sum is None else ds_rows + row_sum
    return dq, alpha_sums, ds_raw, ds_rows


def _add_dq_share(plan: _Plan, refs, rows, p, ds, dp, raw, k, delta, eps):
    """``dq_accumulation="atomic"``: adds a (query tile, key block) share of dq and of the
    row terms to the float32 sums ``refs`` ``(dq [Tq, D], dα [Tq], d scale [Tq], d bias
    [Tq])`` by atomic adds (several key blocks' programs add to the same rows at once; the
    order of the additions, so the last bits, varies from run to run). ``rows``: the tile's
    query rows (a ``pl.ds``)."""
    from jax.experimental.pallas import triton as plgpu  # (see _call)

    dq_ref, dalpha_ref, dscale_ref, dbias_ref = refs
    plgpu.atomic_add(dq_ref, (rows, slice(None)), _dot(plan, ds.astype(k.dtype), k, 1, 0))
    alpha, raw_sum, row_sum = _row_terms(plan, p, ds, dp, raw, eps)
    if alpha is not None:
        plgpu.atomic_add(dalpha_ref, (rows,), _alpha_rows(plan, alpha, delta, eps)[:, 0])
    if raw_sum is not None:
        plgpu.atomic_add(dscale_ref, (rows,), raw_sum[:, 0])
    if row_sum is not None:
        plgpu.atomic_add(dbias_ref, (rows,), row_sum[:, 0])


def _alpha_rows(plan: _Plan, alpha_sums, delta, eps):
    """Each row's share of dα ``[rows, 1]``: δ Σ c - Σ dp c (+ (Σ dp s_rest - δ Σ s_rest) / ε²
    when lifted; see normalizers.entmax_alpha_terms); 0 for the other normalizers."""
    c_sum, dp_c, rest_sum, dp_rest = alpha_sums
    lifted = 0.0
    if plan.kind == "entmax":
        lifted = jnp.where(eps >= LIFT_FROM_EPS, (dp_rest - delta * rest_sum) / (eps * eps), 0.0)
    return delta * c_sum - dp_c + lifted + jnp.zeros_like(delta)


def _dq_kernel(*refs, plan: _Plan):
    names = _row_names(plan)
    scale_ref, len_ref, eps_ref, q_ref, k_ref, v_ref, bias_ref, key_nan_ref = refs[:8]
    qseg_ref, kvseg_ref, do_ref = refs[8:11]
    row_refs = dict(zip(names, refs[11 : 11 + len(names)], strict=True))
    idx_ref, cnt_ref, full_ref, pmi_ref, masks_ref, live_ref = refs[
        11 + len(names) : 17 + len(names)
    ]
    dq_ref, dalpha_ref, dscale_ref, dbias_ref = refs[17 + len(names) :]
    q, do = q_ref[...], do_ref[...]
    bq = q.shape[0]
    q_block, kv_length = _grid_block(plan.reverse_q, plan.nq), len_ref[0]  # (outside the loops)
    scale = scale_ref[0]
    eps, sigma = _eps_sigma(plan, eps_ref, bq)
    rows = {name: ref[...][:, None] for name, ref in row_refs.items()}
    delta = rows["delta"]

    def body(j, carry):
        kv_block = idx_ref[j]

        def load():
            return _key_block(k_ref, plan, kv_block), _key_block(v_ref, plan, kv_block)

        def visit(carry, loaded):
            k, v = loaded
            raw, s = _block_scores(q, k, kv_block, plan, scale, bias_ref, key_nan_ref)
            rt = _row_tile(plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block)
            x = _masked(plan, s, full_ref[j], pmi_ref[j], masks_ref, kv_block, rt)
            p, g = _recompute(plan, x, rows, eps, sigma)
            return _dq_step(plan, carry, p, g, _dot(plan, do, v), delta, raw, k, eps)

        return _visit_if_live(plan, live_ref[j], visit, load, carry)

    zeros_r = jnp.zeros((bq, 1), _F32)
    init = (jnp.zeros((bq, plan.d), _F32), (zeros_r,) * 4, zeros_r, zeros_r)
    dq, alpha_sums, ds_raw, ds_rows = jax.lax.fori_loop(0, cnt_ref[0], body, init)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dalpha_ref[...] = _alpha_rows(plan, alpha_sums, delta, eps)[:, 0]
    dscale_ref[...] = ds_raw[:, 0]
    dbias_ref[...] = ds_rows[:, 0]


def _dkv_kernel(*refs, plan: _Plan):
    names = _row_names(plan)
    scale_ref, len_ref, eps_ref, q_ref, k_ref, v_ref, bias_ref, key_nan_ref = refs[:8]
    qseg_ref, kvseg_ref, do_ref = refs[8:11]
    row_refs = dict(zip(names, refs[11 : 11 + len(names)], strict=True))
    rest = refs[11 + len(names) :]
    t_rows_ref, t_slots_ref, t_cnt_ref, full_ref, pmi_ref, masks_ref, live_ref = rest[:7]
    outs = rest[7 + 4 * plan.atomic_dq :]  # (after the zeros the atomic sums start from)
    dk_ref, dv_ref, dbias_cols_ref = outs[:3]
    atomic_refs = outs[3:7] if plan.atomic_dq else None  # dq and the row terms' sums
    dense_bias_ref = outs[-1] if plan.bias_axes[2] and plan.bias_axes[3] else None
    bq, bkv = plan.bq, plan.bkv
    if dense_bias_ref is not None:  # tile by tile: Triton takes no tile of nq * bq rows
        zeros = jnp.zeros((bq, bkv), dense_bias_ref.dtype)

        def clear(i, carry):
            dense_bias_ref[pl.ds(pl.multiple_of(i * bq, bq), bq), :] = zeros
            return carry

        jax.lax.fori_loop(0, plan.nq, clear, 0)
    k, v = k_ref[...], v_ref[...]
    scale = scale_ref[0]
    kv_block, kv_length = _grid_block(plan.reverse_kv, plan.nk), len_ref[0]  # (outside loops)
    eps, sigma = _eps_sigma(plan, eps_ref, bq)

    def body(t, carry):
        row_block, slot = t_rows_ref[t], t_slots_ref[t]
        sl = pl.ds(pl.multiple_of(row_block * bq, bq), bq)

        def load():
            rows = {name: ref[sl][:, None] for name, ref in row_refs.items()}
            return q_ref[sl, :], do_ref[sl, :], rows

        def visit(carry, loaded):
            dk, dv, ds_cols = carry
            q, do, rows = loaded
            raw = _dot(plan, q, k)
            s = raw * scale + key_nan_ref[...][None, :]
            if plan.has_bias:
                s = s + (bias_ref[sl, :] if plan.bias_axes[2] else bias_ref[...])
            s = _clip_inf(s)
            rt = _runtime_tile(
                plan, row_block, kv_block, kv_length,
                lambda: qseg_ref[sl], lambda: kvseg_ref[...],
            )  # fmt: skip
            full, mask_index = full_ref[row_block, slot], pmi_ref[row_block, slot]
            x = _masked(plan, s, full, mask_index, masks_ref, kv_block, rt)
            p, g = _recompute(plan, x, rows, eps, sigma)
            dv = dv + _dot(plan, p.astype(do.dtype), do, 0, 0)
            dp = _dot(plan, do, v)
            ds = jnp.where(g != 0.0, g * (dp - rows["delta"]), 0.0)
            dk = dk + _dot(plan, ds.astype(q.dtype), q, 0, 0)
            if atomic_refs is not None:
                _add_dq_share(plan, atomic_refs, sl, p, ds, dp, raw, k, rows["delta"], eps)
            if dense_bias_ref is not None:
                dense_bias_ref[sl, :] = ds
            if plan.has_bias:
                ds_cols = ds_cols + jnp.sum(ds, axis=0)  # the bias' column gradient
            return dk, dv, ds_cols

        return _visit_if_live(plan, live_ref[row_block, slot], visit, load, carry)

    init = (
        jnp.zeros((bkv, plan.d), _F32),
        jnp.zeros((bkv, plan.dv), _F32),
        jnp.zeros((bkv,), _F32),
    )
    dk, dv, ds_cols = jax.lax.fori_loop(0, t_cnt_ref[0], body, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dbias_cols_ref[...] = ds_cols


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.


def _call(
    kernel, plan: _Plan, grid, in_specs, out_specs, out_shape, name: str, aliases=None,
    reverse: bool = False,
):  # fmt: skip
    """``pl.pallas_call`` of ``kernel`` over ``grid``; ``reverse``: its first axis launched
    last-first (the specs' index maps given the block, not the program id: _grid_block)."""
    kwargs = {"input_output_aliases": aliases} if aliases else {}
    if reverse:
        last = grid[0] - 1

        def reorder(spec):
            index_map = spec.index_map
            return dataclasses.replace(spec, index_map=lambda i, *rest: index_map(last - i, *rest))

        in_specs, out_specs = [reorder(x) for x in in_specs], [reorder(x) for x in out_specs]
    if not plan.interpret:
        # Imported here, not at the top: it adds ~80 ms to `import sparse_jax` (measured with
        # python -X importtime), paid on CPU where the kernels only ever run interpreted.
        from jax.experimental.pallas import triton as plgpu

        warps = plan.num_warps or (4 if plan.d <= 64 else 8)
        kwargs["compiler_params"] = plgpu.CompilerParams(
            num_warps=warps, num_stages=plan.num_stages
        )
    return pl.pallas_call(
        functools.partial(kernel, plan=plan),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=plan.interpret,
        name=name,
        **kwargs,
    )


def _scalar_spec():
    return pl.BlockSpec((1,), lambda *_: (0,))


def _length_spec():
    return pl.BlockSpec((1,), lambda i, bb, h: (bb,))


def _eps_spec(head_axis: int):
    return pl.BlockSpec((None, 1), lambda *ids: (ids[head_axis], 0))


def _row_segment_specs(plan: _Plan, tk: int):
    """Segment ids for the grid (query block, batch, head): the query tile's, all the keys'."""
    return [
        pl.BlockSpec((None, plan.bq), lambda i, bb, h: (bb, i)),
        pl.BlockSpec((None, tk), lambda i, bb, h: (bb, 0)),
    ]


def _bias_rows_spec(plan: _Plan, bias_shape):
    """The bias rows of a query tile, for the grid (query block, batch, head)."""
    ab, an, aq, ak = (int(x) for x in plan.bias_axes)
    block = (None, None, plan.bq if aq else 1, bias_shape[3] if ak else 1)
    return pl.BlockSpec(block, lambda i, bb, h: (bb * ab, h * an, i * aq, 0))


def _forward(plan: _Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids):
    a = plan.arrays
    b, n, g, bq, nq = plan.b, plan.n, plan.g, plan.bq, plan.nq
    tq, tk = q.shape[1], k.shape[1]
    ph = plan.per_head
    q_spec = pl.BlockSpec((None, bq, None, plan.d), lambda i, bb, h: (bb, i, h, 0))
    k_spec = pl.BlockSpec((None, tk, None, plan.d), lambda i, bb, h: (bb, 0, h // g, 0))
    v_spec = pl.BlockSpec((None, tk, None, plan.dv), lambda i, bb, h: (bb, 0, h // g, 0))
    kp = a["idx"].shape[-1]
    row_spec = pl.BlockSpec((None, None, kp), lambda i, bb, h: (h * ph, i, 0))
    layout_specs = [
        row_spec,
        pl.BlockSpec((None, None, 1), lambda i, bb, h: (h * ph, i, 0)),
        row_spec,
        row_spec,
        pl.BlockSpec(a["masks"].shape, lambda *_: (0, 0, 0)),
    ]
    layout_in = [jnp.asarray(a[key]) for key in ("idx", "count", "full", "pmi", "masks")]
    o_shape = jax.ShapeDtypeStruct((b, tq, n, plan.dv), q.dtype)
    o_spec = pl.BlockSpec((None, bq, None, plan.dv), lambda i, bb, h: (bb, i, h, 0))
    stat_shape = jax.ShapeDtypeStruct((b, n, tq), _F32)
    stat_spec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
    grid = (nq, b, n)
    bias_spec = _bias_rows_spec(plan, bias.shape)
    key_nan_spec = pl.BlockSpec((None, None, tk), lambda i, bb, h: (bb, h // g, 0))
    seg_specs = _row_segment_specs(plan, tk)
    if plan.kind == "softmax":
        o, lse = _call(
            _forward_softmax_kernel, plan, grid,
            [_scalar_spec(), _length_spec(), q_spec, k_spec, v_spec, bias_spec, key_nan_spec,
             *seg_specs, *layout_specs],
            [o_spec, stat_spec], [o_shape, stat_shape], "sparse_jax_pallas_softmax_fwd",
            reverse=plan.reverse_q,
        )(scale, lengths, q, k, v, bias, key_nan, q_ids, kv_ids, *layout_in)  # fmt: skip
        return o, {"lse": lse, "ubar": o.astype(_F32), "live": None}
    live_shape = jax.ShapeDtypeStruct((b, n, nq, kp), jnp.int32)
    live_spec = pl.BlockSpec((None, None, None, kp), lambda i, bb, h: (bb, h, i, 0))
    ubar_shape = jax.ShapeDtypeStruct((b, tq, n, plan.dv), _F32)
    o, ubar, row_max, tau, mass, live = _call(
        _forward_sparse_kernel, plan, grid,
        [_scalar_spec(), _length_spec(), _eps_spec(2), q_spec, k_spec, v_spec, bias_spec,
         key_nan_spec, *seg_specs, *layout_specs],
        [o_spec, o_spec, stat_spec, stat_spec, stat_spec, live_spec],
        [o_shape, ubar_shape, stat_shape, stat_shape, stat_shape, live_shape],
        f"sparse_jax_pallas_{plan.kind}_fwd", reverse=plan.reverse_q,
    )(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, *layout_in)  # fmt: skip
    return o, {"max": row_max, "tau": tau, "mass": mass, "ubar": ubar, "live": live}


def _live_flags(plan: _Plan, live):
    """The forward's live flags ``[B, N, nq, K]`` on ``plan``'s tiles, or zeros ``[B, N, nq,
    1]`` where there are none (softmax: every block is visited)."""
    return live if live is not None else jnp.zeros((plan.b, plan.n, plan.nq, 1), jnp.int32)


def _dq_call(plan: _Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do,
             row_values, live):  # fmt: skip
    """(dq, and the α, scale and bias row terms ``[B, N, Tq]``): the dq kernel, one program
    per query block of ``plan``'s tiles, over its kept key blocks."""
    a = plan.arrays
    b, n, g, bq, nq = plan.b, plan.n, plan.g, plan.bq, plan.nq
    tq, tk = q.shape[1], k.shape[1]
    ph, kp, live_w = plan.per_head, a["idx"].shape[-1], live.shape[-1]
    layout_in = [jnp.asarray(a[key]) for key in ("idx", "count", "full", "pmi", "masks")]
    q_blk = pl.BlockSpec((None, bq, None, plan.d), lambda i, bb, h: (bb, i, h, 0))
    do_blk = pl.BlockSpec((None, bq, None, plan.dv), lambda i, bb, h: (bb, i, h, 0))
    k_all = pl.BlockSpec((None, tk, None, plan.d), lambda i, bb, h: (bb, 0, h // g, 0))
    v_all = pl.BlockSpec((None, tk, None, plan.dv), lambda i, bb, h: (bb, 0, h // g, 0))
    stat_blk = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
    row_spec = pl.BlockSpec((None, None, kp), lambda i, bb, h: (h * ph, i, 0))
    return _call(
        _dq_kernel, plan, (nq, b, n),
        [_scalar_spec(), _length_spec(), _eps_spec(2), q_blk, k_all, v_all,
         _bias_rows_spec(plan, bias.shape),
         pl.BlockSpec((None, None, tk), lambda i, bb, h: (bb, h // g, 0)),
         *_row_segment_specs(plan, tk), do_blk,
         *[stat_blk] * len(row_values),
         row_spec, pl.BlockSpec((None, None, 1), lambda i, bb, h: (h * ph, i, 0)), row_spec,
         row_spec, pl.BlockSpec(a["masks"].shape, lambda *_: (0, 0, 0)),
         pl.BlockSpec((None, None, None, live_w), lambda i, bb, h: (bb, h, i, 0))],
        [q_blk, stat_blk, stat_blk, stat_blk],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), *[jax.ShapeDtypeStruct((b, n, tq), _F32)] * 3],
        f"sparse_jax_pallas_{plan.kind}_dq", reverse=plan.reverse_q,
    )(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do, *row_values, *layout_in,
      live)  # fmt: skip


def _backward(plan: _Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, res, do,
              dq_tiles=None):  # fmt: skip
    """The Triton backward: the dq kernel (unless dq is added by atomic adds) and the dk/dv
    kernel on ``plan``'s tiles; ``dq_tiles``: ``(plan, live flags)`` of the dq kernel where its
    tiles differ (``dq_block``)."""
    a = plan.arrays
    b, n, g, bkv, nq, nk = plan.b, plan.n, plan.g, plan.bkv, plan.nq, plan.nk
    tq, tk = q.shape[1], k.shape[1]
    ph = plan.per_head
    # δ = do · ū per row [B, N, Tq].
    delta = jnp.einsum("bqnd,bqnd->bnq", do.astype(_F32), res["ubar"])
    rows = {**{key: res[key] for key in _row_names(plan)[:-1]}, "delta": delta}
    row_values = [rows[name] for name in _row_names(plan)]
    live = _live_flags(plan, res["live"])
    kp, live_w = a["idx"].shape[-1], live.shape[-1]
    if plan.atomic_dq:  # the dk/dv kernel adds them
        dq = dalpha_rows = dscale_rows = dbias_rows = None
    else:  # one program per query block
        dq_plan, dq_live = dq_tiles if dq_tiles is not None else (plan, res["live"])
        dq, dalpha_rows, dscale_rows, dbias_rows = _dq_call(
            dq_plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do, row_values,
            _live_flags(dq_plan, dq_live),
        )  # fmt: skip

    # dk, dv per query head: one program per key block, over the query blocks keeping it.
    mp = a["t_rows"].shape[-1]
    q_all = pl.BlockSpec((None, tq, None, plan.d), lambda c, bb, h: (bb, 0, h, 0))
    do_all = pl.BlockSpec((None, tq, None, plan.dv), lambda c, bb, h: (bb, 0, h, 0))
    k_blk = pl.BlockSpec((None, bkv, None, plan.d), lambda c, bb, h: (bb, c, h // g, 0))
    v_blk = pl.BlockSpec((None, bkv, None, plan.dv), lambda c, bb, h: (bb, c, h // g, 0))
    stat_all = pl.BlockSpec((None, None, tq), lambda c, bb, h: (bb, h, 0))
    t_spec = pl.BlockSpec((None, None, mp), lambda c, bb, h: (h * ph, c, 0))
    full_all = pl.BlockSpec((None, nq, kp), lambda c, bb, h: (h * ph, 0, 0))
    dk_blk = pl.BlockSpec((None, bkv, None, plan.d), lambda c, bb, h: (bb, c, h, 0))
    dv_blk = pl.BlockSpec((None, bkv, None, plan.dv), lambda c, bb, h: (bb, c, h, 0))
    ab, an, aq, ak = (int(x) for x in plan.bias_axes)
    bias_cols = pl.BlockSpec(
        (None, None, tq if aq else 1, bkv if ak else 1),
        lambda c, bb, h: (bb * ab, h * an, 0, c * ak),
    )
    # Per query head (GQA sums them below), in float32 when heads are summed.
    grad_dtype = (_F32, _F32) if g > 1 else (k.dtype, v.dtype)
    out_specs = [dk_blk, dv_blk, pl.BlockSpec((None, None, bkv), lambda c, bb, h: (bb, h, c))]
    out_shapes = [
        jax.ShapeDtypeStruct((b, tk, n, plan.d), grad_dtype[0]),
        jax.ShapeDtypeStruct((b, tk, n, plan.dv), grad_dtype[1]),
        jax.ShapeDtypeStruct((b, n, tk), _F32),
    ]
    sums, aliases = [], None
    if plan.atomic_dq:  # float32 sums of dq and of the row terms, from zeros
        n_in = 18 + len(row_values)  # the call's inputs before these
        sum_specs = [
            pl.BlockSpec((None, tq, None, plan.d), lambda c, bb, h: (bb, 0, h, 0)),
            *[pl.BlockSpec((None, None, tq), lambda c, bb, h: (bb, h, 0))] * 3,
        ]
        sums = [jnp.zeros((b, tq, n, plan.d), _F32), *[jnp.zeros((b, n, tq), _F32)] * 3]
        aliases = {n_in + i: 3 + i for i in range(4)}
        out_specs += sum_specs
        out_shapes += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sums]
    if aq and ak:  # a bias with both length axes: its gradient is dense like itself
        out_specs.append(pl.BlockSpec((None, None, tq, bkv), lambda c, bb, h: (bb, h, 0, c)))
        out_shapes.append(jax.ShapeDtypeStruct((b, n, tq, tk), _F32))
    grads = _call(
        _dkv_kernel, plan, (nk, b, n),
        [_scalar_spec(), _length_spec(), _eps_spec(2), q_all, k_blk, v_blk, bias_cols,
         pl.BlockSpec((None, None, bkv), lambda c, bb, h: (bb, h // g, c)),
         pl.BlockSpec((None, tq), lambda c, bb, h: (bb, 0)),
         pl.BlockSpec((None, bkv), lambda c, bb, h: (bb, c)), do_all,
         *[stat_all] * len(row_values),
         t_spec, t_spec, pl.BlockSpec((None, None, 1), lambda c, bb, h: (h * ph, c, 0)),
         full_all, full_all, pl.BlockSpec(a["masks"].shape, lambda *_: (0, 0, 0)),
         pl.BlockSpec((None, None, nq, live_w), lambda c, bb, h: (bb, h, 0, 0)),
         *(sum_specs if plan.atomic_dq else [])],
        out_specs, out_shapes, f"sparse_jax_pallas_{plan.kind}_dkv", aliases, plan.reverse_kv,
    )(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do, *row_values,
      *[jnp.asarray(a[key]) for key in ("t_rows", "t_slots", "t_count", "full", "pmi", "masks")],
      live, *sums)  # fmt: skip
    dk, dv, dbias_cols = grads[:3]
    if plan.atomic_dq:
        dq, dalpha_rows, dscale_rows, dbias_rows = grads[3:7]
        dq = (dq * scale[0]).astype(q.dtype)
    dense_dbias = grads[-1] if aq and ak else None
    return dq, dk, dv, dalpha_rows, dscale_rows, dbias_rows, dbias_cols, dense_dbias


def _finish_gradients(plan: _Plan, k, v, grads):
    """The kernels' gradient pieces reduced to the inputs' gradients: grouped-query heads
    summed, the α and scale row terms summed, the bias' rows/columns/tiles reduced over the
    axes it broadcasts along."""
    dq, dk, dv, dalpha_rows, dscale_rows, dbias_rows, dbias_cols, dense_dbias = grads
    b, tk, kh = k.shape[0], k.shape[1], k.shape[2]
    if plan.g > 1:  # grouped-query attention: a key head's gradient sums its query heads'
        dk = dk.reshape(b, tk, kh, plan.g, plan.d).sum(3).astype(k.dtype)
        dv = dv.reshape(b, tk, kh, plan.g, plan.dv).sum(3).astype(v.dtype)
    deps = jnp.sum(dalpha_rows, axis=(0, 2))[:, None] if plan.kind == "entmax" else None
    dscale = jnp.sum(dscale_rows).reshape(1)
    _, _, aq, ak = plan.bias_axes
    if aq and ak:
        dbias = dense_dbias
    elif ak:
        dbias = dbias_cols[:, :, None, :]
    elif aq:
        dbias = dbias_rows[..., None]
    else:
        dbias = jnp.sum(dbias_rows, axis=-1)[..., None, None]
    dbias = jnp.sum(dbias, axis=tuple(i for i in (0, 1) if not plan.bias_axes[i]), keepdims=True)
    return dq, dk, dv, deps, dscale, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan: _Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids):
    return _fused_fwd(plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids)[0]


def _kernels(plan: _Plan):
    """The module whose forward and backward run: this one (Triton) or the Mosaic one (TPU),
    imported when first used (it adds to `import sparse_jax` what CPU users never run)."""
    if plan.target == "mosaic":
        from sparse_jax.kernels import mosaic

        return mosaic.forward, mosaic.backward
    return _forward, _backward


def _fused_fwd(plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids):
    inputs = (scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids)
    o, res = _kernels(plan)[0](plan, *inputs)
    return o, (inputs, res)


def _fused_bwd(plan, residuals, do):
    inputs, res = residuals
    scale, lengths, eps, _, k, v, bias, key_nan, q_ids, kv_ids = inputs
    if plan.backward is not None or plan.backward_dq is not None:  # (Triton: backward_block,
        kv_plan, kv_res = _on_tiles(plan, plan.backward, res)  # dq_block)
        dq_plan, dq_res = (
            (kv_plan, kv_res) if plan.backward_dq is plan.backward
            else _on_tiles(plan, plan.backward_dq, res)
        )  # fmt: skip
        grads = _backward(kv_plan, *inputs, kv_res, do, dq_tiles=(dq_plan, dq_res["live"]))
    else:
        grads = _kernels(plan)[1](plan, *inputs, res, do)
    dq, dk, dv, deps, dscale, dbias = _finish_gradients(plan, k, v, grads)
    deps = jnp.zeros_like(eps) if deps is None else deps

    def no_cotangent(x):  # integer inputs (lengths, segment ids)
        return np.zeros(x.shape, jax.dtypes.float0)

    # key_nan is NaN or 0 (a mark, not a value): its cotangent is zero.
    return (dscale.astype(scale.dtype), no_cotangent(lengths), deps.astype(eps.dtype), dq, dk,
            dv, dbias.astype(bias.dtype), jnp.zeros_like(key_nan), no_cotangent(q_ids),
            no_cotangent(kv_ids))  # fmt: skip


_fused.defvjp(_fused_fwd, _fused_bwd)


# ----------------------------------------------------------------------------------------------
# Public API.


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: BlockLayout,
    *,
    mask: Mask | None = None,
    normalizer: Any = "softmax",
    scale: float | jax.Array | None = None,
    bias: jax.Array | None = None,
    interpret: bool | None = None,
    precision: Any = None,
    target: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    forward_block: tuple[int, int] | None = None,
    backward_block: tuple[int, int] | None = None,
    dq_accumulation: str | None = None,
    prefetch: bool | None = None,
    dq_block: tuple[int, int] | None = None,
) -> jax.Array:
    """Fused block-sparse attention over the blocks kept by ``layout`` (see the module docstring).

    Shapes: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``N`` query heads, ``Kh`` key/value
    heads (``Kh`` divides ``N``), ``D``/``Dv`` head dims.

    Args:
      q: ``[B, Tq, N, D]`` queries, float32, bfloat16 or float16.
      k: ``[B, Tk, Kh, D]`` keys, ``v``: ``[B, Tk, Kh, Dv]`` values, ``q``'s dtype.
      layout: ``mask.blocks(Tq, Tk, bq, bkv)`` (shared or per-head with ``N`` heads); ``bq``
        and ``bkv`` powers of two >= 16 for the Triton kernels, multiples of 128 for the
        Mosaic ones.
      mask: the run-time mask a dynamic layout was built from: a static mask ``&``
        ``padding(lengths)`` (keys ``j >= lengths[b]`` of batch element ``b`` are masked)
        and/or ``& segments(q_ids, kv_ids)`` (packed sequences), or at most one ``padding``
        and one ``segments`` leaf under ``|`` and ``~`` (e.g. ``causal() | padding(prefix)``);
        ignored for static layouts.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"``, or α-entmax's α: a python
        float > 1 or a float array of shape ``[]``, ``[1]`` or ``[N]`` (differentiable).
      scale: multiplier of ``q·k``, default ``D ** -0.5``; a scalar array is differentiable.
      bias: optional float array broadcastable to ``[B, N, Tq, Tk]`` (rank <= 4), added to the
        scaled scores (``-inf`` masks), read tile by tile; differentiable (its gradient is
        reduced in the kernels over the axes it broadcasts along).
      interpret: run the kernels in Pallas' interpret mode; default: on CPU only.
      precision: of the tiles' products (``jax.lax.Precision``); default: full float32 for
        float32 inputs (Triton's default would be TF32), the inputs' own for half precision.
      target: ``"triton"`` (the GPU kernels of this module) or ``"mosaic"`` (the TPU kernels
        of :mod:`sparse_jax.kernels.mosaic`); default: ``"mosaic"`` on TPU, else
        ``"triton"``. Both run in interpret mode on CPU.
      num_warps, num_stages: the Triton kernels' warps per program (1, 2, 4, 8 or 16) and
        software-pipelining depth (>= 1), as in FlexAttention's ``kernel_options``; default 4
        warps for head dims up to 64, else 8, and 2 stages. Unused by Mosaic and in interpret
        mode. ``python -m experiments.bench pallas_tuning`` times the choices.
      forward_block: ``(bq, bkv)`` tiles of the Triton kernels, powers of two >= 16 dividing
        the layout's blocks: the layout is cut into them (a tile of a partial block that the
        mask leaves empty is dropped, so for a static mask they are the tiles of
        ``mask.blocks(Tq, Tk, bq, bkv)``); default ``(64, 64)`` (:data:`TRITON_TILE`, at most
        the blocks), the fastest measured on an H200 (``docs/benchmarks.md``). Mosaic runs on
        the layout's blocks.
      backward_block: ``(bq, bkv)`` tiles of the two backward kernels, dividing the forward's
        tiles (FlashAttention-2 and jax's Pallas ``mha`` use smaller tiles in the backward
        pass, whose tiles hold more live values); default: the forward's tiles.
      dq_block: ``(bq, bkv)`` tiles of the dq kernel alone, dividing the forward's tiles:
        its programs hold a query tile and walk key tiles, the dk/dv kernel's the reverse, so
        each may take its own shape (FlashAttention-2's Triton backward: many keys by few
        queries for dk/dv, the transpose for dq); default: ``backward_block``. Triton
        kernels, ``dq_accumulation="separate"`` only.
      dq_accumulation: how the backward forms dq (and the α, scale and bias row terms):
        ``"separate"`` (the default), a kernel of its own that walks each query block's key
        blocks, recomputing their scores and ``do @ vᵀ`` (7 tile products in the backward);
        or ``"atomic"``, the dk/dv kernel adds each tile's share to float32 sums by atomic
        adds, FlashAttention-2's way (5 products, one kernel; the order of the additions,
        so dq's last bits, varies from run to run). Triton kernels only.
      prefetch: sparse normalizers skip the products of key blocks in which the forward
        found no weight (softmax skips none); True: each visited block's operands are loaded
        before that test, in the loop's own body, where Triton pipelines the loads with the
        previous block's work, at the cost of loading the blocks then skipped; default
        False: only blocks with weight load theirs, inside the branch they take. Triton
        kernels only (Mosaic streams every block by DMA).

    Returns:
      ``[B, Tq, N, Dv]`` in ``q``'s dtype. Differentiable in q, k, v, an array α and an array
      scale.

    Raises:
      ValueError, TypeError: for bad or unsupported arguments, before anything is traced.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> q = k = v = jnp.ones((1, 32, 2, 16))  # [batch, seq, heads, head_dim]
      >>> layout = (causal() & local(7, 0)).blocks(32, 32, 16, 16)
      >>> out = pallas_attention(q, k, v, layout, normalizer="sparsemax")
      >>> out.shape, bool(jnp.allclose(out, 1.0))
      ((1, 32, 2, 16), True)
    """
    plan, inputs = _prepare(
        q, k, v, layout, mask, normalizer, scale, bias, interpret, precision, target, num_warps,
        num_stages, forward_block, backward_block, dq_accumulation, prefetch, dq_block,
    )  # fmt: skip
    out = _fused(plan, *inputs)
    return out[:, : q.shape[1], :, : v.shape[3]]


def _prepare(
    q, k, v, layout, mask, normalizer, scale, bias, interpret, precision, target, num_warps,
    num_stages, forward_block, backward_block, dq_accumulation=None, prefetch=None,
    dq_block=None, caller: str = _NAME,
):  # fmt: skip
    """(plan, padded inputs of :func:`_fused`) of a :func:`pallas_attention` call, its
    arguments checked (ValueError/TypeError naming them)."""
    check_qkv(q, k, v, caller)
    b, tq, n, d = q.shape
    tk, kh, dv = v.shape[1], v.shape[2], v.shape[3]
    layout = check_layout(layout, tq, tk, n, caller)
    normalizer = check_normalizer(normalizer, n, caller)
    scale = check_scale(scale, d, caller)
    bias = check_bias(bias, (b, n, tq, tk), caller)
    interpret = check_bool(interpret, "interpret", caller, optional=True)
    _check_tuning(num_warps, num_stages, caller)
    if target is None:
        target = "mosaic" if jax.default_backend() == "tpu" else "triton"
    if target not in ("triton", "mosaic"):
        raise ValueError(f"{caller}: `target` must be None, 'triton' or 'mosaic'; got {target!r}")
    blocks = (layout.block_q, layout.block_kv)
    forward_block = _check_tile(forward_block, "forward_block", blocks, target, caller)
    if backward_block is None:
        backward_block = forward_block
    backward_block = _check_tile(backward_block, "backward_block", forward_block, target, caller)
    if dq_accumulation not in (None, "separate", "atomic"):
        raise ValueError(f"{caller}: `dq_accumulation` must be None, 'separate' or 'atomic'; "
                         f"got {dq_accumulation!r}")  # fmt: skip
    if dq_accumulation == "atomic" and target != "triton":
        raise ValueError(f"{caller}: `dq_accumulation`='atomic' is for the Triton kernels "
                         f"(target='triton'); got target={target!r}")  # fmt: skip
    if dq_block is None:
        dq_block = backward_block
    dq_block = _check_tile(dq_block, "dq_block", forward_block, target, caller)
    if dq_accumulation == "atomic" and dq_block != backward_block:
        raise ValueError(f"{caller}: `dq_block`={dq_block} needs dq_accumulation='separate' "
                         f"(atomic adds form dq in the dk/dv kernel, on backward_block "
                         f"{backward_block})")  # fmt: skip
    prefetch = check_bool(prefetch, "prefetch", caller, optional=True)
    if prefetch and target != "triton":
        raise ValueError(f"{caller}: `prefetch` is for the Triton kernels (target='triton'); "
                         f"got target={target!r}")  # fmt: skip
    platform = {"mosaic": "tpu", "triton": "gpu"}[target]
    backend = "cpu" if target == "triton" and interpret else platform  # (Triton interpreted)
    ok, why = pallas_supports(q, layout, mask=mask if layout.dynamic else None, backend=backend)
    if not ok:
        raise ValueError(f"{caller}: {why}; use impl='blocksparse' or impl='xla' for this call")
    # After the arguments' checks, so that a bad argument is named on any machine. A CPU may
    # cross-lower for either target (jit(...).trace(...).lower(lowering_platforms=...)).
    if not interpret and jax.default_backend() not in (platform, "cpu"):
        raise ValueError(
            f"{caller}: target={target!r} compiles for {platform.upper()} but the backend is "
            f"{jax.default_backend()!r}; use target=None (the backend's own kernels) or "
            f"interpret=True"
        )
    interpret = jax.default_backend() == "cpu" if interpret is None else bool(interpret)

    kind, sigma, alpha = normalizer, None, None
    if isinstance(normalizer, float):
        kind = {2.0: "sparsemax", 1.5: "entmax15"}.get(normalizer, "entmax")
        alpha = normalizer
        sigma = normalizer - 1.0 <= SIGMA_MAX_EPS
    elif not isinstance(normalizer, str):
        kind, alpha = "entmax", jnp.broadcast_to(normalizer.astype(_F32).reshape(-1), (n,))
    eps = (jnp.asarray(alpha, _F32) - 1.0) if kind == "entmax" else jnp.zeros((), _F32)
    eps = jnp.broadcast_to(eps, (n,)).reshape(n, 1)

    nq, nk = layout.num_q_blocks, layout.num_kv_blocks
    bq, bkv = layout.block_q, layout.block_kv
    has_bias, scale_grad = bias is not None, not isinstance(scale, float)
    if bias is None:
        bias = jnp.zeros((1, 1, 1, 1), _F32)
    bias_axes = tuple(bool(size > 1) for size in bias.shape)
    bias = jnp.pad(
        jnp.asarray(bias, _F32),
        ((0, 0), (0, 0), (0, (nq * bq - tq) * bias_axes[2]), (0, (nk * bkv - tk) * bias_axes[3])),
    )
    d_p, dv_p = _next_pow2(d, _MIN_BLOCK), _next_pow2(dv, _MIN_BLOCK)
    seg_ids = _segment_ids(mask, layout, b, nq * bq, nk * bkv, caller)
    expr = _expression(mask, layout)
    plan = _Plan(
        kind=kind, sigma=sigma, b=b, n=n, g=n // kh, bq=bq, bkv=bkv, nq=nq, nk=nk, d=d_p,
        dv=dv_p, per_head=int(layout.kv_block_indices.shape[0] > 1), interpret=interpret,
        target=target, segments=seg_ids is not None, expr=expr, kv_len=tk,
        precision=precision if precision is not None or q.dtype != jnp.float32
        else jax.lax.Precision.HIGHEST,
        bias_axes=bias_axes, arrays=_layout_arrays(layout), num_warps=num_warps,
        num_stages=2 if num_stages is None else num_stages, has_bias=has_bias,
        scale_grad=scale_grad, dynamic=layout.dynamic, atomic_dq=dq_accumulation == "atomic",
        prefetch=bool(prefetch),
    )  # fmt: skip
    source = layout
    if forward_block != blocks:  # both passes on tiles cut from the layout's blocks
        source, _ = _refine(layout, *forward_block)
        plan = _tiles_plan(plan, source)
    # The backward kernels on tiles cut from the forward's (the dq kernel's may differ).
    backward = _backward_tiles(plan, source, forward_block, backward_block)
    backward_dq = (
        backward if dq_block == backward_block
        else _backward_tiles(plan, source, forward_block, dq_block)
    )  # fmt: skip
    plan = dataclasses.replace(plan, backward=backward, backward_dq=backward_dq)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    # A non-finite value vector enters as a NaN score of its key (the attention policy), so
    # that 0 * NaN in p @ v cannot reach rows whose mask excludes the key.
    v, key_nan = nonfinite_values(v)
    key_nan = jnp.pad(
        jnp.transpose(key_nan.astype(_F32), (0, 2, 1)), ((0, 0), (0, 0), (0, nk * bkv - tk))
    )
    q = jnp.pad(q, ((0, 0), (0, nq * bq - tq), (0, 0), (0, d_p - d)))
    k = jnp.pad(k, ((0, 0), (0, nk * bkv - tk), (0, 0), (0, d_p - d)))
    v = jnp.pad(v, ((0, 0), (0, nk * bkv - tk), (0, 0), (0, dv_p - dv)))
    lengths = _kv_lengths(mask, layout, b, tk, caller)
    scale = jnp.asarray(scale, _F32).reshape(1)
    if seg_ids is None:  # read by no kernel (plan.segments is False)
        seg_ids = (jnp.zeros((b, nq * bq), jnp.int32), jnp.zeros((b, nk * bkv), jnp.int32))
    key_nan = jax.lax.stop_gradient(key_nan)
    return plan, (scale, lengths, eps, q, k, v, bias, key_nan, *seg_ids)


def capped_forward(
    q,
    k,
    v,
    layout: BlockLayout,
    *,
    search_passes: int | None,
    start_values: int | None = None,
    speculate: bool | None = None,
    **options,
) -> jax.Array:
    """Diagnostics: the forward kernel of :func:`pallas_attention` (same arguments, ``options``
    its keywords) with each query tile's threshold search stopped after ``search_passes``
    passes, so that timing it at 0, 1, 2, ... passes shows what the first pass, a search pass
    and the output pass cost (``python -m experiments.bench forward_passes``). The thresholds,
    so the weights, are then inexact (each row's weights still sum to 1): not attention.

    Args:
      q, k, v, layout: as in :func:`pallas_attention`.
      search_passes: int >= 0, or None: to the end (then attention); sparsemax, 1.5-entmax
        and α-entmax only.
      start_values: how many of the row's large values the first pass keeps for the start of
        sparsemax's and 1.5-entmax's searches (the largest of each block's 2 largest); default
        the kernels' (16 and 32): timing others shows what more values cost and save.
      speculate: sparsemax, 1.5-entmax: the search passes also accumulate the output (1.5-
        entmax's from the second on), and a tile whose
        last pass confirms every row's threshold takes no output pass (the kernels' way;
        see ``_accumulating_search``); False: always an output pass. Default: the kernels'
        way when the search runs to the end; False when it is capped, so that each capped
        timing holds one output pass.

    Returns:
      ``[B, Tq, N, Dv]``, the forward's output (not differentiable).

    Example:
      >>> from sparse_jax.masks import causal
      >>> q = k = v = jnp.ones((1, 32, 1, 16))
      >>> out = capped_forward(q, k, v, causal().blocks(32, 32, 16, 16), search_passes=0,
      ...                      normalizer="sparsemax")
      >>> out.shape
      (1, 32, 1, 16)
    """
    caller = "capped_forward"
    if search_passes is not None:
        search_passes = check_int(search_passes, "search_passes", caller, low=0)
    if start_values is not None:
        start_values = check_int(start_values, "start_values", caller, low=1)
    speculate = check_bool(speculate, "speculate", caller, optional=True)
    if speculate is None:
        speculate = search_passes is None
    params = inspect.signature(pallas_attention).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"{caller}: unknown options {unknown}; allowed: {sorted(defaults)}")
    plan, inputs = _prepare(q, k, v, layout, **{**defaults, **options}, caller=caller)
    if plan.kind == "softmax" or plan.target != "triton":
        raise ValueError(f"{caller}: a sparse normalizer on the Triton kernels only; got "
                         f"{plan.kind!r} on {plan.target!r}")  # fmt: skip
    capped = dataclasses.replace(
        plan, search_cap=search_passes, start_top=start_values, speculate=speculate
    )
    out, _ = _forward(capped, *inputs)
    return out[:, : q.shape[1], :, : v.shape[3]]
