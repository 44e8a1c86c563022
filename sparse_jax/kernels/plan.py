"""The call plan of the fused kernels: what they support, their block rules, and :class:`Plan`.

:func:`pallas_supports` says whether the kernels compute a call (the dispatcher asks before
choosing them); :func:`prepare` checks a :func:`~sparse_jax.kernels.pallas_attention` call's
arguments and builds its :class:`Plan` (the static shapes, the normalizer, the layout arrays the
kernels read, the tiles each pass runs on) and the padded inputs of the kernels. The block
rules: the Triton kernels take powers of two >= 16 (Triton's smallest dot tile) and run on
tiles of at most :data:`TRITON_TILE` cut from the layout's blocks (:func:`refine`); the Mosaic
kernels take multiples of :data:`LANES`.

The lowest module of :mod:`sparse_jax.kernels`: the tile maths
(:mod:`~sparse_jax.kernels.tilemath`), the Triton and Mosaic kernels and the entry
(:mod:`~sparse_jax.kernels.flash`) build on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
from sparse_jax.masks import causal as causal_mask
from sparse_jax.masks import full as full_mask
from sparse_jax.normalizers import SIGMA_MAX_EPS, alpha_eps
from sparse_jax.validation import (
    check_bias,
    check_block_size,
    check_bool,
    check_normalizer,
    check_qkv,
    check_scale,
)

# The API; the other names without an underscore are shared by the kernels' modules only.
__all__ = ["LANES", "TRITON_TILE", "mosaic_block_error", "pallas_supports"]

_NAME = "pallas_attention"
_MIN_BLOCK = 16  # Triton's smallest dot tile
_F32 = jnp.float32
LANES = 128  # the TPU's lane width: the Mosaic kernels' blocks must be multiples of it


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


# The Triton kernels' default tiles in both passes: the fastest in the GPU sweeps of tiles, for
# softmax and sparsemax, causal and windowed (docs/archive/benchmarks-history.md,
# "Second GPU pass").
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
    """Whether :func:`~sparse_jax.kernels.pallas_attention` computes this call, and why not.

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
        return mosaic_block_error(block_q, block_kv)
    for name, size in (("block_q", block_q), ("block_kv", block_kv)):
        if size < _MIN_BLOCK or size & (size - 1):
            return f"`{name}`={size} is not a power of two >= {_MIN_BLOCK}"
    return ""


def mosaic_block_error(block_q: int, block_kv: int) -> str:
    """Why the TPU kernels cannot take these block sizes ("" when they can).

    Example:
      >>> mosaic_block_error(128, 64)
      '`block_kv`=64 is not a multiple of 128 (the TPU lane width)'
    """
    for name, size in (("block_q", block_q), ("block_kv", block_kv)):
        if size % LANES:
            return f"`{name}`={size} is not a multiple of {LANES} (the TPU lane width)"
    return ""


def _runtime_parts(mask: Mask) -> tuple[tuple[Padding, ...], tuple[Segments, ...]] | None:
    """The ``Padding`` and ``Segments`` leaves of ``mask`` if its run-time part is ``&`` of any
    number of paddings and at most one segments leaf, joined by ``&`` to a static mask; None
    for other run-time masks."""
    parts = split_runtime(mask)
    return None if parts is None or len(parts[2]) > 1 else parts[1:]


def expression(mask: Any, layout: BlockLayout) -> TileExpression | None:
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
    if parts is None and expression(mask, layout) is not None:
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
class Plan:
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
    arrays: dict  # numpy layout arrays (see layout_arrays)
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
    # A run-time block list (block_list_arrays): the layout arrays are inputs of the kernels, one
    # row per (batch element, query head), [B * N, ...]; `arrays` holds their shapes
    # (jax.ShapeDtypeStruct) beside the static partial masks, and `launch` the launch orders
    # (reverse_q, reverse_kv) decided from the static bound of the lists.
    runtime: bool = False
    launch: tuple[bool, bool] | None = None

    @property
    def row_length(self) -> int:
        return self.arrays["idx"].shape[-1] * self.bkv

    @property
    def reverse_q(self) -> bool:
        """The kernels with a program per query block start from the last: see _heavy_last."""
        if self.launch is not None:
            return self.launch[0]
        return _heavy_last(self.arrays["count"])

    @property
    def reverse_kv(self) -> bool:
        """The dk/dv kernel, a program per key block, starts from the last: see _heavy_last."""
        if self.launch is not None:
            return self.launch[1]
        return _heavy_last(self.arrays["t_count"])

    def layout_head(self, batch, head):
        """The row of the layout arrays that (batch element, query head) reads, from the
        kernels' program ids: its own for a run-time block list (``[B * N, ...]``), its head's
        for a per-head layout, the shared one otherwise."""
        if self.runtime:
            return batch * self.n + head
        return head * self.per_head

    def layout_inputs(self, blocks, keys) -> list:
        """The layout arrays ``keys`` the kernels read: the run-time block list's (``blocks``,
        of :func:`block_list_arrays`) or the plan's static ones; the static partial masks
        (``"masks"``) are always the plan's."""
        if self.runtime and blocks is None:
            raise ValueError("a plan of a run-time block list needs its arrays (`blocks`)")
        source = self.arrays if blocks is None else {**self.arrays, **blocks}
        return [jnp.asarray(source[key]) for key in keys]


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


def layout_arrays(layout: BlockLayout) -> dict:
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
    """:func:`layout_arrays` of a layout given as its arrays (``BlockLayout``'s fields) and
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
    """A layout cut into smaller tiles by :func:`refine`: :class:`BlockLayout`'s arrays
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


def refine(layout: BlockLayout | _Tiles, bq: int, bkv: int) -> tuple[_Tiles, np.ndarray]:
    """``layout`` cut into ``bq x bkv`` tiles (dividing its blocks), and each tile's parent slot
    ``[H, nq', K']`` (the slot, in its query block's row of ``layout``, of the block it was cut
    from). A full block gives full tiles; a partial one, its mask's tiles: all True -> full,
    all False -> dropped, else partial. Every query and key block gives ``block / tile`` rows
    and columns, padding included, so the kernels' padded shapes are unchanged. For a static
    mask the tiles are those of ``mask.blocks(Tq, Tk, bq, bkv)``.

    Example:
      >>> from sparse_jax.masks import causal
      >>> tiles, parent = refine(causal().blocks(4, 4, 4, 4), 2, 2)
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


def _backward_tiles(plan: Plan, source, forward_block, tile):
    """``(plan of the tiles, parent slots, fq)`` of a backward kernel on ``tile`` ``(bq,
    bkv)`` cut from the forward's tiles (``source``, of ``forward_block``), or None where
    ``tile`` is the forward's own: see :func:`refined_live` for ``parent`` and ``fq``."""
    if tuple(tile) == tuple(forward_block):
        return None
    tiles, parent = refine(source, *tile)
    refined = _tiles_plan(plan, tiles)
    width = refined.arrays["idx"].shape[-1]
    parent = np.pad(parent, ((0, 0), (0, 0), (0, width - parent.shape[-1])))
    return refined, parent, forward_block[0] // tile[0]


def on_tiles(plan: Plan, refined, res: dict) -> tuple[Plan, dict]:
    """``(plan, forward residuals)`` of a backward kernel on ``refined`` tiles (see
    :func:`_backward_tiles`; None: the forward's): the forward's live flags mapped to them."""
    if refined is None:
        return plan, res
    tiles, parent, fq = refined
    if res["live"] is not None:
        res = {**res, "live": refined_live(res["live"], parent, fq)}
    return tiles, res


def _tiles_plan(plan: Plan, tiles: _Tiles) -> Plan:
    """``plan`` on the tiles of :func:`refine` (same padded lengths, smaller tiles)."""
    return dataclasses.replace(
        plan, bq=tiles.block_q, bkv=tiles.block_kv, nq=plan.nq * plan.bq // tiles.block_q,
        nk=tiles.num_kv_blocks, arrays=layout_arrays(tiles),
    )  # fmt: skip


def refined_live(live, parent, fq: int):
    """The forward pass' live flags ``[B, N, nq, Kp]`` for the refined backward layout: a tile
    is live when the block it was cut from is (a superset of the tiles with weight)."""
    rows = jnp.repeat(live, fq, axis=2)  # [B, N, nq', Kp]
    index = jnp.broadcast_to(jnp.asarray(parent)[None], (*rows.shape[:2], *parent.shape[1:]))
    return jnp.take_along_axis(rows, index, axis=-1)


def prepare(
    q, k, v, layout, mask, normalizer, scale, bias, interpret, precision, target, num_warps,
    num_stages, forward_block, backward_block, dq_accumulation=None, prefetch=None,
    dq_block=None, caller: str = _NAME,
):  # fmt: skip
    """``(plan, inputs)`` of a :func:`~sparse_jax.kernels.pallas_attention` call, its arguments
    checked (ValueError/TypeError naming them): the inputs the kernels take, padded to whole
    blocks, ``(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids)``."""
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
    if kind != "entmax":
        eps = jnp.zeros((), _F32)
    elif isinstance(alpha, float):
        eps = jnp.asarray(alpha - 1.0, _F32)
    else:  # the α rule: α = 1 is softmax, a bad α NaN (its rows then NaN in the kernels)
        eps = alpha_eps(alpha, _F32)
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
    expr = expression(mask, layout)
    plan = Plan(
        kind=kind, sigma=sigma, b=b, n=n, g=n // kh, bq=bq, bkv=bkv, nq=nq, nk=nk, d=d_p,
        dv=dv_p, per_head=int(layout.kv_block_indices.shape[0] > 1), interpret=interpret,
        target=target, segments=seg_ids is not None, expr=expr, kv_len=tk,
        precision=precision if precision is not None or q.dtype != jnp.float32
        else jax.lax.Precision.HIGHEST,
        bias_axes=bias_axes, arrays=layout_arrays(layout), num_warps=num_warps,
        num_stages=2 if num_stages is None else num_stages, has_bias=has_bias,
        scale_grad=scale_grad, dynamic=layout.dynamic, atomic_dq=dq_accumulation == "atomic",
        prefetch=bool(prefetch),
    )  # fmt: skip
    source = layout
    if forward_block != blocks:  # both passes on tiles cut from the layout's blocks
        source, _ = refine(layout, *forward_block)
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


# ----------------------------------------------------------------------------------------------
# A run-time block list: the key blocks of each query block chosen from the data (block top-k).


def _bound_tables(bound: BlockLayout | _Tiles) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy ``[nq, nk]`` tables of a shared layout (or its tiles): whether it keeps block
    ``(r, c)``, whether the block is full (int32), and its partial mask's index (0 where
    none)."""
    idx = bound.kv_block_indices[0]
    rows, slots = np.nonzero(idx != SENTINEL)
    cols = idx[rows, slots]
    shape = (idx.shape[0], bound.num_kv_blocks)
    kept, is_full, mask_index = (np.zeros(shape, dtype) for dtype in (bool, np.int32, np.int32))
    kept[rows, cols] = True
    is_full[rows, cols] = bound.block_is_full[0][rows, slots]
    mask_index[rows, cols] = np.maximum(bound.partial_mask_index[0][rows, slots], 0)
    return kept, is_full, mask_index


def block_list_arrays(indices, bound: BlockLayout | _Tiles, kp: int, mp: int) -> dict:
    """The layout arrays of :func:`layout_arrays` built in XLA from a run-time block list,
    one row per (batch element, query head).

    ``indices``: int ``[B, N, nq, K]``, the key blocks each query block of each batch element
    and query head attends to (``topk_block_attention(..., return_indices=True)``), any
    order, ``SENTINEL`` (-1) for an empty slot; the valid entries of a row must be distinct.
    ``bound``: the shared layout of the static mask the blocks live under (``causal()`` or
    ``full()``, or its tiles, :func:`refine`): it says which blocks are full and gives the
    partial ones' masks (the causal diagonal tiles, the padding of the last blocks). An entry
    outside ``[0, nk)``, or of a block the bound leaves empty (nothing to attend to), is
    dropped.

    Returns ``idx``/``full``/``pmi`` ``[B * N, nq, kp]`` (the kept blocks first, in the list's
    order), ``count`` ``[B * N, nq, 1]``, and the transposed lists for the dk/dv kernel,
    ``t_rows``/``t_slots`` ``[B * N, nk, mp]`` (the query blocks keeping each key block, in
    increasing order, and the slot it has there) and ``t_count`` ``[B * N, nk, 1]``; int32.
    ``kp`` >= K and ``mp`` >= the most query blocks the bound keeps in a key block's column
    are the static widths.
    """
    b, n, nq, k = indices.shape
    nk, bn = bound.num_kv_blocks, b * n
    kept_table, full_table, pmi_table = (jnp.asarray(x) for x in _bound_tables(bound))
    idx = jnp.asarray(indices).astype(jnp.int32).reshape(bn, nq, k)
    rows = jnp.arange(nq, dtype=jnp.int32)[None, :, None]
    inside = (idx >= 0) & (idx < nk)
    col = jnp.where(inside, idx, 0)
    valid = inside & kept_table[rows, col]
    order = jnp.argsort(jnp.logical_not(valid), axis=-1, stable=True)  # kept entries first
    col = jnp.take_along_axis(col, order, axis=-1)
    valid = jnp.take_along_axis(valid, order, axis=-1)

    def row_array(x):
        return jnp.pad(jnp.where(valid, x, 0), ((0, 0), (0, 0), (0, kp - k))).astype(jnp.int32)

    # The transposed lists: the slot of (query block r, key block c) in a dense [nq, nk] table
    # (-1: not kept), its columns compacted (the kept query blocks first, in increasing order).
    heads = jnp.arange(bn, dtype=jnp.int32)[:, None, None]
    slots = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), col.shape)
    table = jnp.full((bn, nq, nk + 1), -1, jnp.int32)
    table = table.at[heads, rows, jnp.where(valid, col, nk)].set(slots)  # (empty slots: column nk)
    table = jnp.swapaxes(table[..., :nk], 1, 2)  # [B * N, nk, nq]
    present = table >= 0
    t_count = jnp.sum(present, axis=-1, dtype=jnp.int32)
    t_order = jnp.argsort(jnp.logical_not(present), axis=-1, stable=True)[..., :mp]
    t_slots = jnp.take_along_axis(table, t_order, axis=-1)
    if mp > nq:
        t_order = jnp.pad(t_order, ((0, 0), (0, 0), (0, mp - nq)))
        t_slots = jnp.pad(t_slots, ((0, 0), (0, 0), (0, mp - nq)))
    t_valid = jnp.arange(mp, dtype=jnp.int32) < t_count[..., None]
    return {
        "idx": row_array(col),
        "full": row_array(full_table[rows, col]),
        "pmi": row_array(pmi_table[rows, col]),
        "count": jnp.sum(valid, axis=-1, dtype=jnp.int32)[..., None],
        "t_rows": jnp.where(t_valid, t_order, 0).astype(jnp.int32),
        "t_slots": jnp.where(t_valid, t_slots, 0).astype(jnp.int32),
        "t_count": t_count[..., None],
    }


def _tile_list(indices, fq: int, fk: int):
    """A block list ``[B, N, nq, K]`` as the list of its ``fq x fk`` tiles per block, ``[B, N,
    nq * fq, K * fk]``: tile row ``r * fq + a`` lists the tiles ``c * fk + 0 .. fk - 1`` of
    each block ``c`` its block row ``r`` lists (``SENTINEL`` stays empty)."""
    b, n, nq, k = indices.shape
    idx = jnp.asarray(indices).astype(jnp.int32)[:, :, :, None, :, None]
    tiles = jnp.where(idx >= 0, idx * fk + jnp.arange(fk, dtype=jnp.int32), SENTINEL)
    return jnp.broadcast_to(tiles, (b, n, nq, fq, k, fk)).reshape(b, n, nq * fq, k * fk)


def prepare_block_list(
    q, k, v, indices, block_size, causal, normalizer, scale, interpret, precision, target,
    forward_block, caller: str,
):  # fmt: skip
    """``(plan, inputs)`` of an attention over a run-time block list (``indices`` ``[B, N, nq,
    K]``, see :func:`block_list_arrays`), its arguments checked (ValueError/TypeError naming
    them): the inputs of :func:`prepare` and, last, the block list's layout arrays. The
    Triton kernels run on tiles of ``forward_block`` (default: at most :data:`TRITON_TILE`)
    cut from the blocks, the list of blocks becoming the list of their tiles (a tile with
    nothing allowed dropped, as :func:`refine` cuts a layout); Mosaic's on the blocks."""
    check_qkv(q, k, v, caller)
    b, tq, n, _ = q.shape
    tk = k.shape[1]
    bq, bkv = check_block_size(block_size, caller)
    causal = check_bool(causal, "causal", caller)
    nq, nk = -(-tq // bq), -(-tk // bkv)
    if not isinstance(indices, (jax.Array, np.ndarray)) or not jnp.issubdtype(
        indices.dtype, jnp.integer
    ):
        raise TypeError(
            f"{caller}: `indices` must be an int array [B, N, nq, K] of key blocks "
            f"(SENTINEL = -1 for empty slots); got {type(indices).__name__} "
            f"{getattr(indices, 'dtype', '')}"
        )
    if indices.ndim != 4 or tuple(indices.shape[:3]) != (b, n, nq) or indices.shape[3] < 1:
        raise ValueError(
            f"{caller}: `indices` must have shape [B, N, nq, K] = [{b}, {n}, {nq}, K >= 1] "
            f"(nq = ceil({tq} / {bq})); got {list(indices.shape)}"
        )
    if target is None:
        target = "mosaic" if jax.default_backend() == "tpu" else "triton"
    if target not in ("triton", "mosaic"):
        raise ValueError(f"{caller}: `target` must be None, 'triton' or 'mosaic'; got {target!r}")
    why = _block_error(bq, bkv, target)
    if why:
        why = why.replace("`block_q`", "`block_size[0]`").replace("`block_kv`", "`block_size[1]`")
        raise ValueError(f"{caller}: {why} (the block rule of target={target!r})")
    bound = (causal_mask() if causal else full_mask()).blocks(tq, tk, bq, bkv)
    tile = _check_tile(forward_block, "forward_block", (bq, bkv), target, caller)
    plan, inputs = prepare(
        q, k, v, bound, None, normalizer, scale, None, interpret, precision, target, None, None,
        tile, None, caller=caller,
    )  # fmt: skip
    if tile != (bq, bkv):  # the tiles of the blocks (prepare's plan is on them too)
        bound = refine(bound, *tile)[0]
        indices = _tile_list(indices, bq // tile[0], bkv // tile[1])
    nq, nk = plan.nq, plan.nk
    width = indices.shape[3]
    kp = _next_pow2(width)
    kept = _bound_tables(bound)[0]
    column = kept.sum(axis=0)  # the most query blocks that may keep each key block
    mp = _next_pow2(max(1, int(column.max(initial=0))))
    bn = b * n

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.int32)

    arrays = {
        "idx": shape(bn, nq, kp), "full": shape(bn, nq, kp), "pmi": shape(bn, nq, kp),
        "count": shape(bn, nq, 1), "t_rows": shape(bn, nk, mp), "t_slots": shape(bn, nk, mp),
        "t_count": shape(bn, nk, 1), "masks": plan.arrays["masks"],
    }  # fmt: skip
    rows = np.minimum(bound.kv_block_counts[0], width)  # the most blocks each query block visits
    launch = (_heavy_last(rows[None, :, None]), _heavy_last(column[None, :, None]))
    plan = dataclasses.replace(plan, runtime=True, launch=launch, per_head=0, arrays=arrays)
    return plan, (*inputs, block_list_arrays(indices, bound, kp, mp))
