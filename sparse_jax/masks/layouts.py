"""Block layouts: the block-sparse form of a mask that block-sparse kernels consume
(:class:`BlockLayout`), the kernels' check of one (:func:`check_layout`), and how
``Mask.blocks`` computes one.

The computation reads a mask only through the methods every node of the algebra has
(``num_heads``, ``is_dynamic``, ``for_head``, ``_block_bounds``, ``_bounds``, ``_toeplitz``), so
this module sits below the :class:`~sparse_jax.masks.Mask` class that calls it.

Example:
  >>> from sparse_jax.masks import causal
  >>> causal().blocks(4, 4, 2, 2).block_mask()[0].tolist()  # 0 empty, 1 partial, 2 full
  [[1, 0], [2, 1]]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

__all__ = ["SENTINEL", "BlockLayout", "check_layout"]

#: Value of the padded entries of ``BlockLayout.kv_block_indices`` and of
#: ``BlockLayout.partial_mask_index`` where there is no partial mask.
SENTINEL = -1

# Number of bools evaluated at once by ``blocks`` (a chunk of undecided blocks).
_BLOCK_CHUNK_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """Block-sparse description of a mask, consumed by block-sparse attention kernels.

    The query axis is cut into ``num_q_blocks = ceil(q_len / block_q)`` blocks and the key axis
    into ``num_kv_blocks = ceil(kv_len / block_kv)`` blocks; positions beyond ``q_len``/``kv_len``
    (padding added internally) are masked out, so edge blocks are never "full" unless the
    lengths divide. ``H`` below is ``num_heads`` for per-head masks and 1 otherwise (the layout
    is then shared by every head); ``K = max_count``, the largest number of kept key blocks in a
    query-block row (at least 1). All arrays are read-only numpy arrays.

    Attributes:
      kv_block_indices: int32 ``[H, num_q_blocks, K]``; for each head and query block, the
        indices of its non-empty key blocks in increasing order, padded with ``SENTINEL`` (-1).
      kv_block_counts: int32 ``[H, num_q_blocks]``; number of valid entries of each row of
        ``kv_block_indices`` (0 for a fully masked query block).
      block_is_full: bool ``[H, num_q_blocks, K]``; True where the listed key block is all True
        (no masking needed inside it); False for partial blocks and padded slots.
      partial_mask_index: int32 ``[H, num_q_blocks, K]``; for partial blocks, the index into
        ``partial_masks`` of that block's mask; ``SENTINEL`` for full blocks and padded slots.
      partial_masks: bool ``[n_unique, block_q, block_kv]``; the distinct masks of partial blocks
        (deduplicated over all heads and rows, in order of first appearance).
      q_len, kv_len: the original (unpadded) lengths.
      block_q, block_kv: the block sizes.
      num_heads: number of heads of a per-head mask, or None when the layout is shared by all
        heads (arrays then have a leading axis of size 1).
      density: fraction of True entries of the dense ``[(h,) q_len, kv_len]`` mask (for a dynamic
        layout, of its static upper bound).
      block_density: fraction of kept blocks, ``sum(kv_block_counts) / (H * nq * nk)``.
      dynamic: True when the mask has run-time parts (``padding``): kept/full are valid for any
        run-time value, ``partial_masks`` hold static upper bounds, and a kernel must AND them
        with ``mask.predicate(q_idx, kv_idx, batch=b)`` evaluated at run time.

    Example:
      >>> from sparse_jax.masks import causal
      >>> layout = causal().blocks(4, 4, 2, 2)  # q_len, kv_len, block_q, block_kv
      >>> layout.kv_block_indices.tolist()  # [H, num_q_blocks, K]; -1 is SENTINEL
      [[[0, -1], [0, 1]]]
      >>> layout.kv_block_counts.tolist(), layout.block_is_full.tolist()  # [H, nq], [H, nq, K]
      ([[1, 2]], [[[False, False], [True, False]]])
      >>> layout.partial_masks.shape, layout.density  # [n_unique, block_q, block_kv]
      ((1, 2, 2), 0.625)
    """

    kv_block_indices: np.ndarray  # int32 [H, nq, K], SENTINEL-padded
    kv_block_counts: np.ndarray  # int32 [H, nq]
    block_is_full: np.ndarray  # bool [H, nq, K]
    partial_mask_index: np.ndarray  # int32 [H, nq, K], SENTINEL where none
    partial_masks: np.ndarray  # bool [n_unique, block_q, block_kv]
    q_len: int  # original query length
    kv_len: int  # original key length
    block_q: int  # query block size
    block_kv: int  # key block size
    num_heads: int | None  # None: one layout shared by all heads (H = 1)
    density: float  # fraction of True entries of the dense mask
    block_density: float  # fraction of kept (non-empty) blocks
    dynamic: bool = False  # True: layout is a static bound of a run-time mask

    @property
    def num_q_blocks(self) -> int:
        """Number of query blocks, ``ceil(q_len / block_q)``."""
        return self.kv_block_counts.shape[1]

    @property
    def num_kv_blocks(self) -> int:
        """Number of key blocks, ``ceil(kv_len / block_kv)``."""
        return -(-self.kv_len // self.block_kv)

    @property
    def max_count(self) -> int:
        """Width ``K`` of the padded per-row arrays."""
        return self.kv_block_indices.shape[2]

    def block_mask(self) -> np.ndarray:
        """int8 ``[H, nq, nk]``: 0 = empty block, 1 = partial, 2 = full (splash's convention).

        Example:
          >>> from sparse_jax.masks import causal
          >>> causal().blocks(4, 4, 2, 2).block_mask()[0].tolist()
          [[1, 0], [2, 1]]
        """
        h, nq, _ = self.kv_block_indices.shape
        out = np.zeros((h, nq, self.num_kv_blocks), np.int8)
        hh, rr, ss = np.nonzero(self.kv_block_indices != SENTINEL)
        out[hh, rr, self.kv_block_indices[hh, rr, ss]] = np.where(
            self.block_is_full[hh, rr, ss], 2, 1
        )
        return out

    def to_dense(self) -> np.ndarray:
        """Reconstructs the dense bool mask ``[(h,) q_len, kv_len]`` from the layout.

        For debugging and tests; it materialises the whole mask.

        Example:
          >>> from sparse_jax.masks import causal, local
          >>> m = causal() & local(3, 0)
          >>> bool((m.blocks(10, 9, 4, 2).to_dense() == m.dense(10, 9)).all())
          True
        """
        h, nq, _ = self.kv_block_indices.shape
        nk = self.num_kv_blocks
        out = np.zeros((h, nq, self.block_q, nk, self.block_kv), bool)
        hh, rr, ss = np.nonzero(self.kv_block_indices != SENTINEL)
        cols = self.kv_block_indices[hh, rr, ss]
        full = self.block_is_full[hh, rr, ss]
        out[hh[full], rr[full], :, cols[full], :] = True
        part = ~full
        out[hh[part], rr[part], :, cols[part], :] = self.partial_masks[
            self.partial_mask_index[hh[part], rr[part], ss[part]]
        ]
        out = out.reshape(h, nq * self.block_q, nk * self.block_kv)[:, : self.q_len, : self.kv_len]
        return out if self.num_heads is not None else out[0]


def check_layout(layout: Any, tq: int, tk: int, n: int, caller: str) -> BlockLayout:
    """``layout`` if it is a :class:`BlockLayout` for query/key lengths ``tq``/``tk`` and ``n``
    query heads (shared, or per-head with ``n`` heads); a ``TypeError``/``ValueError`` naming
    ``caller`` and the argument otherwise. The kernels' check, before anything is traced:
    ``tq``, ``tk`` and ``n`` come from ``q [batch, tq, n, head_dim]`` and ``k [batch, tk, ...]``.

    Example:
      >>> from sparse_jax.masks import causal
      >>> layout = causal().blocks(4, 4, 2, 2)
      >>> check_layout(layout, 4, 4, 8, "my_kernel") is layout  # shared: any number of heads
      True
      >>> check_layout(layout, 8, 8, 8, "my_kernel")
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `layout` was built for (q_len, kv_len) = (4, 4) but q and k ...
    """
    if not isinstance(layout, BlockLayout):
        raise TypeError(
            f"{caller}: `layout` must be a sparse_jax.masks.BlockLayout (from "
            f"`mask.blocks(q_len, kv_len, block_q, block_kv)`); got {type(layout).__name__}"
        )
    if (layout.q_len, layout.kv_len) != (tq, tk):
        raise ValueError(
            f"{caller}: `layout` was built for (q_len, kv_len) = ({layout.q_len}, "
            f"{layout.kv_len}) but q and k have lengths ({tq}, {tk}); build it with "
            f"`mask.blocks({tq}, {tk}, {layout.block_q}, {layout.block_kv})`"
        )
    if layout.num_heads is not None and layout.num_heads != n:
        raise ValueError(
            f"{caller}: `layout` is per-head with {layout.num_heads} heads but q has {n} query "
            f"heads; allowed: a per-head layout with exactly {n} heads, or a shared one"
        )
    return layout


# ----------------------------------------------------------------------------------------------
# Computing a layout (``Mask.blocks``).


@functools.lru_cache(maxsize=16)
def cached_layout(mask: Any, q_len: int, kv_len: int, block_q: int, block_kv: int) -> BlockLayout:
    """:func:`compute_layout`, cached for the last few (static, hashable) masks and sizes: what
    ``Mask.blocks`` returns for a static mask.

    Example:
      >>> from sparse_jax.masks import causal
      >>> cached_layout(causal(), 8, 8, 4, 4) is cached_layout(causal(), 8, 8, 4, 4)
      True
    """
    return compute_layout(mask, q_len, kv_len, block_q, block_kv)


def _eval_blocks(mask: Any, r: Any, c: Any, q_len: int, kv_len: int, bq: int, bk: int, unique):
    """Evaluates the blocks ``(r[n], c[n])`` element by element, a chunk at a time.

    Partial blocks are deduplicated into ``unique`` (packed bits -> id), shared across heads.
    Returns per block: kept, full, partial-mask id (SENTINEL if none), True count of the upper
    bound.
    """
    n = r.size
    kept, full = np.zeros(n, bool), np.zeros(n, bool)
    pid, count = np.full(n, SENTINEL, np.int32), np.zeros(n, np.int64)
    step = max(1, _BLOCK_CHUNK_ELEMENTS // (bq * bk))
    q_off = np.arange(bq, dtype=np.int32)[None, :, None]
    kv_off = np.arange(bk, dtype=np.int32)[None, None, :]
    for s in range(0, n, step):
        sl = slice(s, min(n, s + step))
        q = (r[sl] * bq).astype(np.int32)[:, None, None] + q_off  # [m, bq, 1]
        kv = (c[sl] * bk).astype(np.int32)[:, None, None] + kv_off  # [m, 1, bk]
        shape = (q.shape[0], bq, bk)
        with np.errstate(over="ignore"):
            lo, hi = mask._bounds(q, kv)
        in_range = (q < q_len) & (kv < kv_len)
        static = lo is hi
        hi = np.broadcast_to(hi, shape) & in_range
        lo = hi if static else np.broadcast_to(lo, shape) & in_range
        kept[sl], full[sl] = hi.any(axis=(1, 2)), lo.all(axis=(1, 2))
        count[sl] = np.count_nonzero(hi, axis=(1, 2))
        part = np.nonzero(kept[sl] & ~full[sl])[0]
        if part.size:
            packed = np.packbits(hi[part].reshape(part.size, -1), axis=1)
            ids = [unique.setdefault(row.tobytes(), len(unique)) for row in packed]
            pid[s + part] = ids
    return kept, full, pid, count


def _head_blocks(mask: Any, q_len: int, kv_len: int, bq: int, bk: int, unique: dict):
    """Block classification of one head-agnostic mask.

    Blocks are first classified from index ranges (``_block_bounds``); only the undecided ones
    are evaluated element by element, and for masks that depend on ``i - j`` only, just one
    interior block per block diagonal.

    Returns (kept [nq, nk], full [nq, nk], partial-mask ids [nq, nk] (SENTINEL where none),
    number of True entries of the upper bound).
    """
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    rows, cols = np.arange(nq, dtype=np.int64)[:, None], np.arange(nk, dtype=np.int64)[None, :]
    qa, qb = rows * bq, np.minimum((rows + 1) * bq, q_len) - 1
    ka, kb = cols * bk, np.minimum((cols + 1) * bk, kv_len) - 1
    with np.errstate(over="ignore"):
        must, may = mask._block_bounds(qa, qb, ka, kb)
    inside = ((rows + 1) * bq <= q_len) & ((cols + 1) * bk <= kv_len)
    must = np.broadcast_to(must, (nq, nk)) & inside  # blocks with padding are never full
    may = np.broadcast_to(may, (nq, nk)) | must
    kept, full = must.copy(), must.copy()
    pid = np.full((nq, nk), SENTINEL, np.int32)
    true_count = int(np.count_nonzero(must)) * bq * bk
    ci, cj = np.nonzero(may & ~must)  # undecided blocks
    if mask._toeplitz() and ci.size:
        interior = inside[ci, cj]
        diag = ci[interior] * bq - cj[interior] * bk
        _, first, inverse = np.unique(diag, return_index=True, return_inverse=True)
        ri, rj = ci[interior][first], cj[interior][first]  # one block per diagonal
        k, f, p, n = _eval_blocks(mask, ri, rj, q_len, kv_len, bq, bk, unique)
        ii, ij = ci[interior], cj[interior]
        kept[ii, ij], full[ii, ij], pid[ii, ij] = k[inverse], f[inverse], p[inverse]
        true_count += int(n[inverse].sum())
        ci, cj = ci[~interior], cj[~interior]  # edge blocks: evaluated one by one
    k, f, p, n = _eval_blocks(mask, ci, cj, q_len, kv_len, bq, bk, unique)
    kept[ci, cj], full[ci, cj], pid[ci, cj] = k, f, p
    true_count += int(n.sum())
    return kept, full, pid, true_count


def compute_layout(mask: Any, q_len: int, kv_len: int, bq: int, bk: int) -> BlockLayout:
    """The :class:`BlockLayout` of ``mask`` (a :class:`~sparse_jax.masks.Mask`) for lengths
    ``q_len``/``kv_len`` and blocks ``bq``/``bk`` (checked by ``Mask.blocks``, which calls it):
    each head's blocks classified, identical heads once, partial blocks deduplicated.

    Example:
      >>> from sparse_jax.masks import causal
      >>> compute_layout(causal(), 4, 4, 2, 2).kv_block_counts.tolist()
      [[1, 2]]
    """
    n_heads = mask.num_heads
    heads = [mask.for_head(h) for h in range(n_heads)] if n_heads is not None else [mask]
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    per_mask: dict[Any, Any] = {}  # identical heads are classified once
    unique: dict[bytes, int] = {}  # packed partial block -> its index
    kept_all, full_all, pid_all = [], [], []
    true_total = 0
    for m in heads:
        try:
            res = per_mask.get(m)
        except TypeError:  # unhashable (padding with a jax array): no reuse
            res = None
        if res is None:
            res = _head_blocks(m, q_len, kv_len, bq, bk, unique)
            try:
                per_mask[m] = res
            except TypeError:
                pass
        kept, full, pid, count = res
        kept_all.append(kept)
        full_all.append(full)
        pid_all.append(pid)
        true_total += count
    kept = np.stack(kept_all)  # [H, nq, nk]
    full = np.stack(full_all)
    pid = np.stack(pid_all)
    counts = kept.sum(-1).astype(np.int32)
    width = max(1, int(counts.max()))
    order = np.argsort(~kept, axis=-1, kind="stable")[..., :width]  # kept blocks first
    valid = np.arange(width) < counts[..., None]
    indices = np.where(valid, order, SENTINEL).astype(np.int32)
    is_full = np.take_along_axis(full, order, -1) & valid
    pindex = np.where(valid & ~is_full, np.take_along_axis(pid, order, -1), SENTINEL)
    packed = np.frombuffer(b"".join(unique), np.uint8)  # in dict (= id) order
    packed = packed.reshape(len(unique), -(-bq * bk // 8))
    partial = np.unpackbits(packed, axis=1, count=bq * bk).view(bool).reshape(-1, bq, bk)
    arrays = [indices, counts, is_full, pindex.astype(np.int32), partial]
    for a in arrays:
        a.flags.writeable = False
    return BlockLayout(
        kv_block_indices=arrays[0],
        kv_block_counts=arrays[1],
        block_is_full=arrays[2],
        partial_mask_index=arrays[3],
        partial_masks=arrays[4],
        q_len=q_len,
        kv_len=kv_len,
        block_q=bq,
        block_kv=bk,
        num_heads=n_heads,
        density=true_total / (len(heads) * q_len * kv_len),
        block_density=float(counts.sum()) / (len(heads) * nq * nk),
        dynamic=mask.is_dynamic,
    )
