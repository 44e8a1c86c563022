"""Attention-mask algebra: small composable mask descriptions that compile to dense arrays,
block layouts and TPU splash-attention masks.

A :class:`Mask` is a *description*, not an array: a predicate on (query index, key index) that
broadcasts over numpy or ``jax.numpy`` integer index arrays (True = may attend). One small frozen
dataclass per mask kind (``Causal``, ``Local``, ``Sink``, ...) holds the parameters of that kind
and nothing else; ``&``, ``|`` and ``~`` build new masks (``And``, ``Or``, ``Not``), so a pattern
such as "causal sliding window of 256 keys plus 4 attention sinks" is written::

    m = causal() & (local(256, 0) | sink(4))

and costs nothing until it is evaluated. The same object is then turned into what a consumer
needs:

* ``m.dense(q_len, kv_len)``: a numpy bool array ``[q, kv]`` (``[h, q, kv]`` for per-head masks,
  ``[b, ...]`` in front for run-time padding masks), for references and small problems;
* ``m.predicate(q_idx, kv_idx)``: the predicate itself, which also accepts jnp arrays (traced
  inside ``jax.jit``), so a kernel can compute the mask of one block on the fly;
* ``m.blocks(q_len, kv_len, block_q, block_kv)``: a :class:`BlockLayout` (numpy, computed at
  trace time): for each query block the non-empty key blocks, which of them are full, and
  deduplicated partial-block masks. This is what block-sparse kernels consume. Each mask kind
  also classifies whole blocks from their index ranges (``_block_bounds``), so only blocks that
  are neither certainly empty nor certainly full are evaluated element by element, a chunk at a
  time (how long that takes per kind: docs/benchmarks.md, "Design measurements");
* ``m.to_splash(q_len, kv_len)``: the equivalent mask object of
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (native ``CausalMask``/``LocalMask``/...
  where one matches, ``NumpyMask`` otherwise).

Positions and offsets. Row ``i`` of a mask is the query at *absolute* position ``i`` and column
``j`` the key at position ``j``. ``m.with_offset(t)`` (decoding with a cache of ``t`` tokens)
maps row ``i`` to absolute position ``i + t`` for the whole sub-expression it wraps, so
``causal().with_offset(t).dense(1, t + 1)`` is a single row of ones.

Shapes. Most masks are defined for any length (``shape is None``). ``from_array`` masks (and
expressions containing one) have a fixed ``shape == (q, kv)``; ``dense``/``blocks``/``to_splash``
then require ``q_len <= q`` and ``kv_len <= kv`` and use the top-left corner.

Per-head masks. ``per_head([m0, m1, ...])`` (or ``from_array`` of a ``[h, q, kv]`` array) gives
one mask per head; combining it with a head-agnostic mask applies that mask to every head, and
two per-head masks must have the same number of heads. ``num_heads`` is None for head-agnostic
masks. ``m.for_head(h)`` extracts the ``[q, kv]`` mask of head ``h``.

Run-time masks. ``padding(lengths)`` (key ``j`` allowed for batch element ``b`` when
``j < lengths[b]``) and ``segments(q_ids, kv_ids)`` (packed sequences: query ``i`` sees key
``j`` when their segment ids are equal) depend on data known only at run time (their arrays
may be traced jax arrays). Any expression containing one is *dynamic* (``m.is_dynamic``,
``m.batch_size``):

* ``dense`` adds a leading batch axis ``[b, (h,) q, kv]`` (a jax array if ``lengths`` is one);
* ``predicate`` takes ``batch=`` indices (and ``head=`` for per-head masks);
* ``blocks`` returns a *conservative* layout valid for every value of the lengths: each padding
  leaf counts as "unknown" (a lower bound of all False and an upper bound of all True, combined
  by the usual rules, ``~`` swapping them). A block is kept when the upper bound has a True in
  it, full when the lower bound is all True, and partial otherwise; the stored partial-block
  mask is then the static *upper bound*, and the exact mask of such a block is
  ``partial_mask & m.predicate(q_idx, kv_idx, batch=b)``, which a kernel evaluates at run time.
  ``BlockLayout.dynamic`` is True for such layouts;
* ``to_splash`` raises (splash handles padding and segments with ``SegmentIds``, not with its
  mask).

The random, per-pair-independent :func:`random_blocks` pattern uses a counter-based integer hash
of (seed, query block, key block), so it is identical in numpy and inside ``jax.jit``, and a
shorter sequence sees a prefix of the pattern of a longer one.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.validation import check_int

__all__ = [
    "SENTINEL",
    "And",
    "BlockLayout",
    "Causal",
    "Chunked",
    "Dilated",
    "Fixed",
    "FromArray",
    "Full",
    "GlobalTokens",
    "Local",
    "Mask",
    "Not",
    "Or",
    "Padding",
    "PerHead",
    "RandomBlocks",
    "Segments",
    "Shifted",
    "Sink",
    "Strided",
    "TileExpression",
    "causal",
    "check_layout",
    "check_mask",
    "chunked",
    "dilated",
    "fixed",
    "from_array",
    "full",
    "global_tokens",
    "key_lengths",
    "local",
    "padding",
    "per_head",
    "random_blocks",
    "runtime_leaves",
    "segment_ids",
    "segments",
    "sink",
    "split_runtime",
    "strided",
    "tile_expression",
]

#: Value of the padded entries of ``BlockLayout.kv_block_indices`` and of
#: ``BlockLayout.partial_mask_index`` where there is no partial mask.
SENTINEL = -1

_INT32_MAX = 2**31 - 1
# Number of bools evaluated at once by ``blocks`` (a chunk of undecided blocks).
_BLOCK_CHUNK_ELEMENTS = 1 << 22


# ----------------------------------------------------------------------------------------------
# Argument checking.


def check_mask(value: Any, name: str, caller: str, *, optional: bool = False, why: str = "") -> Any:
    """``value`` if it is a :class:`Mask` (or, with ``optional``, None); ``why`` says in a few
    words why an array or anything else is refused there. How the mask fits the inputs is
    :func:`sparse_jax.validation.check_mask_fits`.

    Example:
      >>> check_mask(causal(), "mask", "my_kernel") == causal()
      True
      >>> check_mask(None, "mask", "my_kernel", optional=True) is None
      True
      >>> check_mask(np.ones((4, 4), bool), "mask", "my_kernel", why="the pattern is static")
      Traceback (most recent call last):
      ...
      TypeError: my_kernel: `mask` must be a sparse_jax.masks.Mask (the pattern is static); ...
    """
    if (optional and value is None) or isinstance(value, Mask):
        return value
    allowed = ("None or " if optional else "") + "a sparse_jax.masks.Mask"
    because = f" ({why})" if why else ""
    raise TypeError(f"{caller}: `{name}` must be {allowed}{because}; got {type(value).__name__}")


def _check_operand(caller: str, name: str, value: Any) -> Mask:
    """An operand of the mask algebra (``&``, ``|``, ``~``, ``per_head`` ...) is a Mask."""
    if not isinstance(value, Mask):
        raise TypeError(
            f"{caller}: {name} must be a sparse_jax.masks.Mask, got {type(value).__name__} "
            f"({value!r:.80})"
        )
    return value


def _merge(caller: str, what: str, a: Any, b: Any) -> Any:
    """Common value of a structural property of two operands (None = unconstrained)."""
    if a is None:
        return b
    if b is None or a == b:
        return a
    raise ValueError(f"{caller}: operands have mismatched {what}: {a!r} and {b!r}")


def _is_jax(x: Any) -> bool:
    return isinstance(x, jax.Array)


# ----------------------------------------------------------------------------------------------
# The block layout.


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
# The base class.


class Mask:
    """Base class of every mask: a composable predicate on (query index, key index).

    Subclasses are small frozen dataclasses, one per mask kind, that implement ``_eval``. Users
    build masks with the functions of this module (``causal()``, ``local(...)``, ...) and
    combine them with ``&``, ``|``, ``~`` and :meth:`with_offset`.

    Example:
      >>> m = causal() & (local(1, 0) | sink(1))  # a window of 2 keys plus 1 attention sink
      >>> m.dense(4, 4).astype(int)  # [q, kv]
      array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [1, 1, 1, 0],
             [1, 0, 1, 1]])
      >>> m.shape, m.num_heads, m.is_dynamic  # any length, every head, static
      (None, None, False)
    """

    # --- structure (overridden by the nodes that constrain it) --------------------------------

    @property
    def shape(self) -> tuple[int, int] | None:
        """Fixed ``(max_q_len, max_kv_len)`` of the mask, or None when any length works."""
        return None

    @property
    def num_heads(self) -> int | None:
        """Number of heads of a per-head mask, None when the mask is the same for every head."""
        return None

    @property
    def batch_size(self) -> int | None:
        """Batch size of a run-time (``padding``, ``segments``) mask, None for static masks."""
        return None

    @property
    def is_dynamic(self) -> bool:
        """True when the mask depends on run-time data (a ``padding`` or ``segments`` leaf)."""
        return self.batch_size is not None

    def _children(self) -> tuple[Mask, ...]:
        return ()

    def _max_offset(self) -> int:
        return max((c._max_offset() for c in self._children()), default=0)

    def _uses_jax(self) -> bool:
        return any(c._uses_jax() for c in self._children())

    def _toeplitz(self) -> bool:
        """True when the static bounds depend on ``i - j`` only (so every block on the same
        block diagonal has the same content); lets ``blocks`` evaluate one block per diagonal.
        Leaves that qualify override this; combinators qualify when all their children do."""
        children = self._children()
        return bool(children) and all(c._toeplitz() for c in children)

    # --- evaluation (implemented by the nodes) ------------------------------------------------

    def _eval(self, q: Any, kv: Any, h: Any, b: Any, xp: Any) -> Any:
        """Predicate on broadcastable index arrays (absolute positions). ``h``/``b``: head and
        batch index arrays (None when the expression has no per-head / run-time part)."""
        raise NotImplementedError

    def _bounds(self, q: np.ndarray, kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Static (lower, upper) bounds of a head-agnostic mask (numpy); ``lo is hi`` when the
        mask is static."""
        v = self._eval(q, kv, None, None, np)
        return v, v

    def _block_bounds(self, qa: Any, qb: Any, ka: Any, kb: Any) -> tuple[Any, Any]:
        """Conservative block classification for ``blocks``.

        ``qa``/``qb`` (int64 ``[nq, 1]``) and ``ka``/``kb`` (``[1, nk]``) are the inclusive
        absolute index ranges of each query / key block. Returns bool grids broadcastable to
        ``[nq, nk]``: ``must`` (the lower bound is certainly all True in the block) and ``may``
        (the upper bound may be True somewhere). The default knows nothing; blocks left
        undecided are evaluated element by element.
        """
        return np.False_, np.True_

    def _for_head(self, head: int) -> Mask:
        return self

    # --- public API ---------------------------------------------------------------------------

    def for_head(self, head: int) -> Mask:
        """The head-agnostic mask of head ``head`` (``self`` when the mask is not per-head).

        Example:
          >>> per_head([causal(), full()]).for_head(1)
          Full()
        """
        n = self.num_heads
        if n is None:
            return self
        head = check_int(head, "head", "for_head", low=0, high=n - 1)
        return self._for_head(head)

    def with_offset(self, offset: int) -> Mask:
        """This mask for queries at absolute positions ``offset, offset + 1, ...``.

        Row ``i`` of the result is the query at absolute position ``i + offset`` (decoding with
        a cache of ``offset`` tokens); keys are unchanged.

        Args:
          offset: int >= 0.

        Example:
          >>> causal().with_offset(2).dense(1, 4).astype(int).tolist()
          [[1, 1, 1, 0]]
        """
        offset = check_int(offset, "offset", "with_offset", low=0, high=_INT32_MAX)
        if offset == 0:
            return self
        return Shifted(self, offset)

    def predicate(
        self, q_idx: Any, kv_idx: Any, *, head: Any = None, batch: Any = None
    ) -> np.ndarray | jax.Array:
        """Evaluates the mask at broadcastable integer index arrays (True = may attend).

        Works with numpy and jnp arrays alike (jnp if any input, or a padding length, is a jax
        array), so it can run inside ``jax.jit`` on traced indices.

        Args:
          q_idx: int array, query rows (row ``i`` is at absolute position ``i`` + offsets).
          kv_idx: int array, key positions; broadcastable with ``q_idx``.
          head: int array of head indices, broadcastable with the others; when None and the mask
            is per-head, a leading axis over all heads is added.
          batch: int array of batch indices for run-time masks; when None and the mask is
            dynamic, a leading axis over the batch is added (in front of the head axis).

        Returns:
          bool array of shape ``broadcast([B,] [H,] q_idx, kv_idx)``.

        Example:
          >>> local(1, 0).predicate(np.arange(3)[:, None], np.arange(3)[None, :]).astype(int)
          array([[1, 0, 0],
                 [1, 1, 0],
                 [0, 1, 1]])
        """
        use_jax = self._uses_jax() or any(_is_jax(x) for x in (q_idx, kv_idx, head, batch))
        xp = jnp if use_jax else np
        q, kv = xp.asarray(q_idx), xp.asarray(kv_idx)
        for name, arr in (("q_idx", q), ("kv_idx", kv), ("head", head), ("batch", batch)):
            if arr is not None and not np.issubdtype(xp.asarray(arr).dtype, np.integer):
                raise TypeError(
                    f"predicate: {name} must be an integer array, got dtype {xp.asarray(arr).dtype}"
                )
        shapes = [q.shape, kv.shape]
        if head is not None:
            head = xp.asarray(head)
            shapes.append(head.shape)
        elif self.num_heads is not None:
            nd = len(np.broadcast_shapes(*shapes))
            head = xp.arange(self.num_heads).reshape((self.num_heads,) + (1,) * nd)
            shapes.append(head.shape)
        if batch is not None:
            batch = xp.asarray(batch)
            shapes.append(batch.shape)
        elif self.batch_size is not None:
            nd = len(np.broadcast_shapes(*shapes))
            batch = xp.arange(self.batch_size).reshape((self.batch_size,) + (1,) * nd)
            shapes.append(batch.shape)
        shape = np.broadcast_shapes(*shapes)
        if xp is np:
            with np.errstate(over="ignore"):
                value = self._eval(q, kv, head, batch, np)
            value = np.asarray(value)
            if value.shape == shape and value.dtype == np.bool_ and value.base is None:
                return value  # a fresh array of the right shape: no copy
            out = np.empty(shape, bool)
            out[...] = value
            return out
        return jnp.broadcast_to(self._eval(q, kv, head, batch, jnp), shape).astype(bool)

    def _check_lengths(self, caller: str, q_len: Any, kv_len: Any) -> tuple[int, int]:
        q_len = check_int(q_len, "q_len", caller, low=1, high=_INT32_MAX)
        kv_len = check_int(kv_len, "kv_len", caller, low=1, high=_INT32_MAX)
        shape = self.shape
        if shape is not None and (q_len > shape[0] or kv_len > shape[1]):
            raise ValueError(
                f"{caller}: (q_len, kv_len) = ({q_len}, {kv_len}) does not fit this mask of fixed "
                f"shape {shape} (from_array or segments); allowed: q_len <= {shape[0]}, "
                f"kv_len <= {shape[1]}"
            )
        return q_len, kv_len

    def dense(self, q_len: int, kv_len: int) -> np.ndarray | jax.Array:
        """The mask as a bool array (True = may attend).

        Args:
          q_len: number of query rows (>= 1).
          kv_len: number of keys (>= 1).

        Returns:
          numpy bool ``[q_len, kv_len]``; ``[H, q_len, kv_len]`` for per-head masks; with a
          leading batch axis ``[B, ...]`` for run-time (padding) masks, which is a jax array
          when the padding lengths are one.

        Example:
          >>> (causal() & ~local(0, 0)).dense(3, 3).astype(int)
          array([[0, 0, 0],
                 [1, 0, 0],
                 [1, 1, 0]])
        """
        q_len, kv_len = self._check_lengths("dense", q_len, kv_len)
        if q_len + self._max_offset() > _INT32_MAX:
            raise ValueError(f"dense: q_len + offset must be < 2**31, got q_len={q_len}")
        q = np.arange(q_len, dtype=np.int32)[:, None]
        kv = np.arange(kv_len, dtype=np.int32)[None, :]
        return self.predicate(q, kv)

    def blocks(self, q_len: int, kv_len: int, block_q: int, block_kv: int) -> BlockLayout:
        """Block-sparse layout of the mask (see :class:`BlockLayout`), computed with numpy.

        Blocks are first classified from index ranges (causal, local, sinks, chunks, ... know
        which blocks are empty or full without looking at them); only undecided blocks are
        evaluated, a chunk of a few million bools at a time, and for masks that depend on
        ``i - j`` only (causal, local, dilated, strided and their combinations) just one block
        per block diagonal (times: docs/benchmarks.md, "Design measurements"); a ``from_array``
        mask is the worst case (every block evaluated). Apart from the result
        (whose ``partial_masks`` can be O(q_len * kv_len) for irregular masks) it uses a few
        tens of MB. Results are cached for static masks. Lengths need not be multiples of the
        block sizes.
        For run-time (padding) masks the layout is a conservative static bound
        (``layout.dynamic``; see the module docstring).

        Args:
          q_len, kv_len: sequence lengths (>= 1).
          block_q, block_kv: block sizes (>= 1).

        Returns:
          A :class:`BlockLayout` with arrays ``[H, ceil(q_len / block_q), K]``.

        Example:
          >>> lay = causal().blocks(6, 6, 2, 2)
          >>> lay.kv_block_counts.tolist(), lay.partial_masks.shape
          ([[1, 2, 3]], (1, 2, 2))
        """
        q_len, kv_len = self._check_lengths("blocks", q_len, kv_len)
        block_q = check_int(block_q, "block_q", "blocks", low=1, high=_INT32_MAX)
        block_kv = check_int(block_kv, "block_kv", "blocks", low=1, high=_INT32_MAX)
        if -(-q_len // block_q) * block_q + self._max_offset() > _INT32_MAX:
            raise ValueError(f"blocks: q_len + offset must be < 2**31, got q_len={q_len}")
        if self.is_dynamic:
            return _compute_layout(self, q_len, kv_len, block_q, block_kv)
        return _cached_layout(self, q_len, kv_len, block_q, block_kv)

    def to_splash(self, q_len: int, kv_len: int, *, num_heads: int | None = None) -> Any:
        """The equivalent mask of TPU splash attention (``splash_attention_mask``).

        Native classes are used where one matches (``FullMask``, ``CausalMask``, ``LocalMask``
        with their offsets, ``ChunkedCausalMask`` for ``chunked(n) & causal()``, and
        ``LogicalAnd``/``LogicalOr`` of native parts); anything else becomes a ``NumpyMask`` of
        the dense array.

        Args:
          q_len, kv_len: sequence lengths.
          num_heads: when given (or when the mask is per-head), a ``MultiHeadMask`` with one
            mask per head is returned, which is what ``make_splash_mha`` takes; for per-head
            masks it must equal ``self.num_heads``.

        Returns:
          A splash ``Mask`` of shape ``(q_len, kv_len)`` or a ``MultiHeadMask`` of shape
          ``(num_heads, q_len, kv_len)``.

        Raises:
          ValueError: for run-time (padding) masks: use splash's ``SegmentIds`` instead.

        Example:
          >>> type(causal().to_splash(8, 8)).__name__
          'CausalMask'
        """
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask as sm,
        )

        q_len, kv_len = self._check_lengths("to_splash", q_len, kv_len)
        if self.is_dynamic:
            raise ValueError(
                "to_splash: run-time masks (padding, segments) have no splash mask equivalent; "
                "pass the static part of the mask and express them with splash SegmentIds"
            )
        n = self.num_heads
        if num_heads is not None:
            num_heads = check_int(num_heads, "num_heads", "to_splash", low=1, high=_INT32_MAX)
            if n is not None and num_heads != n:
                raise ValueError(
                    f"to_splash: num_heads={num_heads} does not match the per-head mask's "
                    f"{n} heads; allowed: None or {n}"
                )
        shape = (q_len, kv_len)
        if n is None and num_heads is None:
            return _to_splash_2d(sm, self, shape, 0)
        heads = [self.for_head(h) if n is not None else self for h in range(n or num_heads)]
        return sm.MultiHeadMask(tuple(_to_splash_2d(sm, m, shape, 0) for m in heads))

    # --- algebra ------------------------------------------------------------------------------

    def __and__(self, other: Mask) -> Mask:
        return And(self, _check_operand("&", "right operand", other))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, _check_operand("|", "right operand", other))

    def __rand__(self, other: Any) -> Mask:
        return And(_check_operand("&", "left operand", other), self)

    def __ror__(self, other: Any) -> Mask:
        return Or(_check_operand("|", "left operand", other), self)

    def __invert__(self) -> Mask:
        return Not(self)

    def __bool__(self) -> bool:
        raise TypeError("a Mask has no truth value: use & | ~ (not and/or/not) to combine masks")


# ----------------------------------------------------------------------------------------------
# Leaves: one small class per mask kind.


@dataclasses.dataclass(frozen=True)
class Full(Mask):
    """Every query attends to every key. Returned by :func:`full`.

    Example:
      >>> full()
      Full()
      >>> full().dense(2, 3).astype(int).tolist()  # [q, kv]
      [[1, 1, 1], [1, 1, 1]]
    """

    def _toeplitz(self) -> bool:
        return True

    def _eval(self, q, kv, h, b, xp):
        return xp.ones(np.broadcast_shapes(q.shape, kv.shape), bool)

    def _block_bounds(self, qa, qb, ka, kb):
        return np.True_, np.True_


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """Key ``j`` allowed for query ``i`` when ``j <= i``. Returned by :func:`causal`.

    Example:
      >>> causal()
      Causal()
      >>> causal().dense(3, 3).astype(int).tolist()  # [q, kv]
      [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """

    def _toeplitz(self) -> bool:
        return True

    def _eval(self, q, kv, h, b, xp):
        return kv <= q

    def _block_bounds(self, qa, qb, ka, kb):
        return kb <= qa, ka <= qb


@dataclasses.dataclass(frozen=True)
class Local(Mask):
    """Key ``j`` allowed for query ``i`` when ``i - left <= j <= i + right`` (None: unbounded).

    The convention of splash attention's ``LocalMask(window_size=(left, right))``. Returned by
    :func:`local`.

    Example:
      >>> local(1, 0)  # a causal window of 2 keys: the query and the key before it
      Local(left=1, right=0)
      >>> local(1, 0).dense(4, 4).astype(int)  # [q, kv]
      array([[1, 0, 0, 0],
             [1, 1, 0, 0],
             [0, 1, 1, 0],
             [0, 0, 1, 1]])
      >>> bool((local(None, 0).dense(5, 5) == causal().dense(5, 5)).all())  # None: unbounded
      True
    """

    left: int | None  # keys allowed before the query (None: all)
    right: int | None  # keys allowed after the query (None: all)

    def __post_init__(self):
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is not None:
                value = check_int(value, name, "local", low=0, high=_INT32_MAX)
                object.__setattr__(self, name, value)

    def _toeplitz(self) -> bool:
        return True

    def _eval(self, q, kv, h, b, xp):
        if self.left is None and self.right is None:
            return xp.ones(np.broadcast_shapes(q.shape, kv.shape), bool)
        if self.right is None:
            return q - kv <= self.left
        if self.left is None:
            return kv - q <= self.right
        return (q - kv <= self.left) & (kv - q <= self.right)

    def _block_bounds(self, qa, qb, ka, kb):
        dmin, dmax = qa - kb, qb - ka  # range of i - j over the block
        must, may = np.True_, np.True_
        if self.left is not None:
            must, may = must & (dmax <= self.left), may & (dmin <= self.left)
        if self.right is not None:
            must, may = must & (dmin >= -self.right), may & (dmax >= -self.right)
        return must, may


@dataclasses.dataclass(frozen=True)
class Dilated(Mask):
    """Key ``j`` allowed for query ``i`` when ``i - j = k * dilation`` for ``k in 0..window``.

    That is ``window + 1`` keys: the query itself and ``window`` dilated positions back
    (causal). ``dilated(w, 1)`` allows the same pairs as ``local(w, 0)`` (the two objects are
    different classes and do not compare equal). Returned by :func:`dilated`.

    Example:
      >>> dilated(2, 2)
      Dilated(window=2, dilation=2)
      >>> dilated(2, 2).dense(5, 5)[4].astype(int).tolist()  # query 4 sees keys 4, 2 and 0
      [1, 0, 1, 0, 1]
      >>> bool((dilated(2, 1).dense(5, 5) == local(2, 0).dense(5, 5)).all())
      True
    """

    window: int  # number of dilated steps back (>= 0)
    dilation: int  # spacing between attended keys (>= 1)

    def __post_init__(self):
        object.__setattr__(
            self, "window", check_int(self.window, "window", "dilated", low=0, high=_INT32_MAX)
        )
        object.__setattr__(
            self,
            "dilation",
            check_int(self.dilation, "dilation", "dilated", low=1, high=_INT32_MAX),
        )
        if self.window * self.dilation > _INT32_MAX:
            raise ValueError(
                f"dilated: window * dilation must be < 2**31, got {self.window} * {self.dilation}"
            )

    def _toeplitz(self) -> bool:
        return True

    def _eval(self, q, kv, h, b, xp):
        d = q - kv
        return (d >= 0) & (d <= self.window * self.dilation) & (d % self.dilation == 0)

    def _block_bounds(self, qa, qb, ka, kb):
        dmin, dmax = qa - kb, qb - ka
        span = self.window * self.dilation
        may = (dmax >= 0) & (dmin <= span)
        if self.dilation == 1:
            return (dmin >= 0) & (dmax <= span), may
        return np.False_, may


@dataclasses.dataclass(frozen=True)
class Strided(Mask):
    """Sparse Transformer "strided" pattern (Child et al., 2019), causal.

    Key ``j`` allowed for query ``i`` when ``j <= i`` and (``i - j < stride`` or
    ``(i - j) % stride == 0``): the previous ``stride`` positions (self included) plus every
    ``stride``-th position before them. Returned by :func:`strided`.

    Example:
      >>> strided(2)
      Strided(stride=2)
      >>> strided(2).dense(5, 5).astype(int)  # [q, kv]
      array([[1, 0, 0, 0, 0],
             [1, 1, 0, 0, 0],
             [1, 1, 1, 0, 0],
             [0, 1, 1, 1, 0],
             [1, 0, 1, 1, 1]])
    """

    stride: int  # l in the paper (>= 1)

    def __post_init__(self):
        object.__setattr__(
            self, "stride", check_int(self.stride, "stride", "strided", low=1, high=_INT32_MAX)
        )

    def _toeplitz(self) -> bool:
        return True

    def _eval(self, q, kv, h, b, xp):
        d = q - kv
        return (d >= 0) & ((d < self.stride) | (d % self.stride == 0))

    def _block_bounds(self, qa, qb, ka, kb):
        dmin, dmax = qa - kb, qb - ka
        must = (dmin >= 0) & ((dmax < self.stride) | (self.stride == 1))
        return must, dmax >= 0


@dataclasses.dataclass(frozen=True)
class Fixed(Mask):
    """Sparse Transformer "fixed" pattern (Child et al., 2019), causal.

    Key ``j`` allowed for query ``i`` when ``j <= i`` and (``j // block == i // block``, the
    same block, or ``j % block >= block - summary``, one of the last ``summary`` positions of a
    block). Returned by :func:`fixed`.

    Example:
      >>> fixed(2, 1)  # blocks {0, 1}, {2, 3}, {4}; summary keys 1 and 3
      Fixed(block=2, summary=1)
      >>> fixed(2, 1).dense(5, 5).astype(int)  # [q, kv]
      array([[1, 0, 0, 0, 0],
             [1, 1, 0, 0, 0],
             [0, 1, 1, 0, 0],
             [0, 1, 1, 1, 0],
             [0, 1, 0, 1, 1]])
    """

    block: int  # l in the paper (>= 1)
    summary: int  # c in the paper, 0 <= summary <= block

    def __post_init__(self):
        object.__setattr__(
            self, "block", check_int(self.block, "block", "fixed", low=1, high=_INT32_MAX)
        )
        object.__setattr__(
            self, "summary", check_int(self.summary, "summary", "fixed", low=0, high=self.block)
        )

    def _eval(self, q, kv, h, b, xp):
        same = (q // self.block) == (kv // self.block)
        summary = (kv % self.block) >= (self.block - self.summary)
        return (kv <= q) & (same | summary)

    def _block_bounds(self, qa, qb, ka, kb):
        n = self.block
        one_kv_block = ka // n == kb // n
        same = (qa // n == qb // n) & one_kv_block & (qa // n == ka // n)
        summary = one_kv_block & (ka % n >= n - self.summary)
        return (kb <= qa) & (same | summary), ka <= qb


@dataclasses.dataclass(frozen=True)
class Sink(Mask):
    """Every query may attend to the first ``n`` keys (not causal by itself). Returned by
    :func:`sink`.

    Example:
      >>> sink(2)
      Sink(n=2)
      >>> sink(2).dense(2, 4).astype(int).tolist()  # query 0 also sees key 1: not causal
      [[1, 1, 0, 0], [1, 1, 0, 0]]
    """

    n: int  # number of sink keys (>= 0)

    def __post_init__(self):
        object.__setattr__(self, "n", check_int(self.n, "n", "sink", low=0, high=_INT32_MAX))

    def _eval(self, q, kv, h, b, xp):
        return kv < self.n

    def _block_bounds(self, qa, qb, ka, kb):
        return kb < self.n, ka < self.n


@dataclasses.dataclass(frozen=True)
class GlobalTokens(Mask):
    """Tokens at ``indices`` attend to every key and are attended by every query. Returned by
    :func:`global_tokens`, which sorts the indices and drops duplicates.

    Example:
      >>> global_tokens([2, 0, 2])
      GlobalTokens(indices=(0, 2))
      >>> global_tokens([1]).dense(3, 3).astype(int)  # [q, kv]
      array([[0, 1, 0],
             [1, 1, 1],
             [0, 1, 0]])
    """

    indices: tuple[int, ...]  # sorted, distinct absolute positions

    def __post_init__(self):
        raw = self.indices
        if isinstance(raw, (jax.Array, np.ndarray)):
            arr = np.asarray(raw)
            if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
                raise TypeError(
                    f"global_tokens: indices must be a 1-D sequence of ints, got array of "
                    f"dtype {arr.dtype} and shape {arr.shape}"
                )
            raw = arr.tolist()
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise TypeError(
                f"global_tokens: indices must be a 1-D sequence of ints, got {self.indices!r}"
            )
        ints = {
            check_int(v, f"indices[{k}]", "global_tokens", low=0, high=_INT32_MAX)
            for k, v in enumerate(raw)
        }
        vals = tuple(sorted(ints))
        object.__setattr__(self, "indices", vals)

    def _eval(self, q, kv, h, b, xp):
        if not self.indices:
            return xp.zeros(np.broadcast_shapes(q.shape, kv.shape), bool)
        idx = xp.asarray(self.indices, dtype=q.dtype)
        return xp.isin(q, idx) | xp.isin(kv, idx)

    def _block_bounds(self, qa, qb, ka, kb):
        idx = np.asarray(self.indices, np.int64)

        def count(lo, hi):  # number of global tokens in [lo, hi]
            return np.searchsorted(idx, hi, "right") - np.searchsorted(idx, lo, "left")

        nq, nk = count(qa, qb), count(ka, kb)
        return (nq == qb - qa + 1) | (nk == kb - ka + 1), (nq > 0) | (nk > 0)


@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
    """Attention only within the same chunk: ``i // size == j // size`` (not causal). Returned
    by :func:`chunked`.

    Example:
      >>> chunked(2)
      Chunked(size=2)
      >>> chunked(2).dense(4, 4).astype(int)  # [q, kv]
      array([[1, 1, 0, 0],
             [1, 1, 0, 0],
             [0, 0, 1, 1],
             [0, 0, 1, 1]])
    """

    size: int  # chunk length (>= 1)

    def __post_init__(self):
        object.__setattr__(
            self, "size", check_int(self.size, "size", "chunked", low=1, high=_INT32_MAX)
        )

    def _eval(self, q, kv, h, b, xp):
        return (q // self.size) == (kv // self.size)

    def _block_bounds(self, qa, qb, ka, kb):
        n = self.size
        must = (qa // n == qb // n) & (ka // n == kb // n) & (qa // n == ka // n)
        return must, (qa // n <= kb // n) & (ka // n <= qb // n)


def _mix32(x: Any) -> Any:
    """A 32-bit integer bijection with good avalanche (Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


@dataclasses.dataclass(frozen=True)
class RandomBlocks(Mask):
    """BigBird-style random blocks: each (query block, key block) pair of size ``block`` is
    kept independently with probability ``density``.

    The choice is a hash of ``(seed, i // block, j // block)``, so it is deterministic, the same
    in numpy and in jit, and independent of the sequence length. Not causal by itself. Returned
    by :func:`random_blocks`.

    Example:
      >>> m = random_blocks(0.5, 2, seed=0)
      >>> m
      RandomBlocks(density=0.5, block=2, seed=0)
      >>> m.dense(4, 4).astype(int)  # [q, kv]: whole 2 x 2 blocks kept or dropped
      array([[1, 1, 1, 1],
             [1, 1, 1, 1],
             [1, 1, 0, 0],
             [1, 1, 0, 0]])
      >>> bool((m.dense(8, 8)[:4, :4] == m.dense(4, 4)).all())  # a longer sequence extends it
      True
    """

    density: float  # probability of keeping a block pair, in (0, 1]
    block: int  # block size of the pattern (>= 1)
    seed: int  # any int

    def __post_init__(self):
        d = self.density
        if isinstance(d, bool) or not isinstance(d, numbers.Real):
            raise TypeError(f"random_blocks: density must be a float in (0, 1], got {d!r}")
        if not 0.0 < float(d) <= 1.0:
            raise ValueError(f"random_blocks: density must be a float in (0, 1], got {d!r}")
        object.__setattr__(self, "density", float(d))
        object.__setattr__(
            self, "block", check_int(self.block, "block", "random_blocks", low=1, high=_INT32_MAX)
        )
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise TypeError(f"random_blocks: seed must be an int, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))

    @functools.cached_property
    def _seed_hash(self) -> np.uint32:
        with np.errstate(over="ignore"):
            return _mix32(np.uint32(int(self.seed) % 2**32))

    def _keep(self, q_block: Any, kv_block: Any, xp: Any) -> Any:
        """Whether the pattern keeps the pair (query block, key block) of block indices."""
        x = _mix32(_mix32(q_block.astype(xp.uint32) ^ self._seed_hash) ^ kv_block.astype(xp.uint32))
        threshold = round(self.density * 2**24)  # compare 24 bits: exact in int arithmetic
        return (x >> 8) < np.uint32(threshold) if threshold < 2**24 else (x >> 8) >= 0

    def _eval(self, q, kv, h, b, xp):
        return self._keep(q // self.block, kv // self.block, xp)

    def _block_bounds(self, qa, qb, ka, kb):
        n = self.block
        q0, q1, k0, k1 = qa // n, qb // n, ka // n, kb // n  # pattern blocks touched
        span_q, span_k = int((q1 - q0).max()) + 1, int((k1 - k0).max()) + 1
        if span_q * span_k > 64:  # many small pattern blocks per layout block: evaluate
            return np.False_, np.True_
        must, may = np.True_, np.False_
        with np.errstate(over="ignore"):
            for dq in range(span_q):
                for dk in range(span_k):
                    valid = (q0 + dq <= q1) & (k0 + dk <= k1)
                    keep = self._keep(q0 + dq, k0 + dk, np)
                    must, may = must & (~valid | keep), may | (valid & keep)
        return must, may


@dataclasses.dataclass(frozen=True, eq=False)
class FromArray(Mask):
    """A fixed bool array ``[q, kv]`` (or ``[h, q, kv]``, one mask per head).

    Positions outside the array evaluate to False. ``dense(q_len, kv_len)`` requires the
    lengths to fit (``q_len <= q``, ``kv_len <= kv``) and returns the top-left corner. Returned
    by :func:`from_array` (which copies the array); the repr shows the shape and the fraction
    of True entries.

    Example:
      >>> m = from_array(np.tri(3, dtype=bool))  # [q, kv] = [3, 3]
      >>> m
      FromArray(shape=(3, 3), density=0.667)
      >>> m.shape, m.num_heads
      ((3, 3), None)
      >>> m.dense(2, 3).astype(int).tolist()  # the top-left corner
      [[1, 0, 0], [1, 1, 0]]
      >>> from_array(np.ones((2, 3, 3), bool)).num_heads  # [h, q, kv]: one mask per head
      2
    """

    array: np.ndarray  # read-only bool [q, kv] or [h, q, kv]

    def __post_init__(self):
        arr = self.array
        if isinstance(arr, jax.core.Tracer):
            raise TypeError(
                "from_array: array must be concrete (known at trace time), got a traced jax "
                "array; use padding(...) for run-time masks"
            )
        arr = np.asarray(arr)
        if arr.dtype != np.bool_:
            raise TypeError(
                f"from_array: array must have dtype bool, got {arr.dtype}; convert with "
                f"array.astype(bool) if that is what you mean"
            )
        if arr.ndim not in (2, 3) or 0 in arr.shape:
            raise ValueError(
                f"from_array: array must have shape [q, kv] or [heads, q, kv] with non-zero "
                f"sizes, got shape {arr.shape}"
            )
        arr = np.array(arr, copy=True)
        arr.flags.writeable = False
        object.__setattr__(self, "array", arr)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.array.shape[-2:])

    @property
    def num_heads(self) -> int | None:
        return self.array.shape[0] if self.array.ndim == 3 else None

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.array.shape, np.packbits(self.array).tobytes()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FromArray):
            return NotImplemented
        return self.array.shape == other.array.shape and bool(
            np.array_equal(self.array, other.array)
        )

    def __repr__(self) -> str:
        return f"FromArray(shape={self.array.shape}, density={self.array.mean():.3g})"

    def _for_head(self, head: int) -> Mask:
        return FromArray(self.array[head]) if self.array.ndim == 3 else self

    def _eval(self, q, kv, h, b, xp):
        rows, cols = self.shape
        inside = (q >= 0) & (q < rows) & (kv >= 0) & (kv < cols)
        qc, kc = xp.clip(q, 0, rows - 1), xp.clip(kv, 0, cols - 1)
        arr = xp.asarray(self.array)
        if arr.ndim == 3:
            if h is None:
                raise ValueError("FromArray: a [heads, q, kv] mask needs head indices")
            return arr[h, qc, kc] & inside
        return arr[qc, kc] & inside


class _RunTime(Mask):
    """A leaf known only at run time (its data may be traced): statically every entry may be
    allowed or masked, the same at every position, so a layout keeps every block as partial
    and the kernels evaluate the leaf."""

    def _toeplitz(self) -> bool:
        return True

    def _bounds(self, q, kv):
        return np.zeros((), bool), np.ones((), bool)

    def _block_bounds(self, qa, qb, ka, kb):
        return np.False_, np.True_


@dataclasses.dataclass(frozen=True, eq=False)
class Padding(_RunTime):
    """Run-time key padding: for batch element ``b``, key ``j`` allowed when
    ``j < lengths[b]``. ``lengths`` (int ``[batch]``) may be a (traced) jax array.

    Returned by :func:`padding`. The mask is dynamic: ``dense`` returns ``[batch, q_len, kv_len]``
    (``[batch, h, q_len, kv_len]`` combined with a per-head mask).

    Example:
      >>> m = padding([1, 3])  # lengths [batch] = [2]
      >>> m, m.is_dynamic, m.batch_size
      (Padding(batch_size=2), True, 2)
      >>> m.dense(2, 3).astype(int).tolist()  # [batch, q, kv]
      [[[1, 0, 0], [1, 0, 0]], [[1, 1, 1], [1, 1, 1]]]
    """

    lengths: Any  # int [batch], numpy or jax

    def __post_init__(self):
        lengths = self.lengths
        if not _is_jax(lengths):
            lengths = np.asarray(lengths)
        if lengths.ndim != 1 or lengths.shape[0] == 0:
            raise ValueError(
                f"padding: lengths must be a 1-D array [batch] with batch >= 1, got shape "
                f"{lengths.shape}"
            )
        if not np.issubdtype(lengths.dtype, np.integer):
            raise TypeError(f"padding: lengths must be integers, got dtype {lengths.dtype}")
        if not isinstance(lengths, jax.core.Tracer):
            concrete = np.asarray(lengths)
            if (concrete < 0).any():
                raise ValueError(f"padding: lengths must be >= 0, got {concrete.tolist()!r:.200}")
        object.__setattr__(self, "lengths", lengths)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def __repr__(self) -> str:
        return f"Padding(batch_size={self.batch_size})"

    def _uses_jax(self) -> bool:
        return _is_jax(self.lengths)

    def _eval(self, q, kv, h, b, xp):
        if b is None:
            raise ValueError("Padding: evaluating a run-time mask needs batch indices")
        return kv < xp.asarray(self.lengths)[b]


@dataclasses.dataclass(frozen=True, eq=False)
class Segments(_RunTime):
    """Run-time segments (packed sequences): for batch element ``b``, query ``i`` may see key
    ``j`` when ``q_ids[b, i] == kv_ids[b, j]``. The id arrays fix the mask's shape
    ``(q_len, kv_len)``, as ``from_array``'s array does.

    Returned by :func:`segments`, with ``q_ids`` int ``[batch, q_len]`` and ``kv_ids`` int
    ``[batch, kv_len]``. Dynamic, like :class:`Padding`: ``dense`` returns
    ``[batch, q_len, kv_len]``.

    Example:
      >>> m = segments([[0, 0, 1]])  # q_ids = kv_ids, [batch, len] = [1, 3]
      >>> m
      Segments(batch_size=1, shape=(3, 3))
      >>> m.dense(3, 3).astype(int).tolist()  # [batch, q, kv]
      [[[1, 1, 0], [1, 1, 0], [0, 0, 1]]]
    """

    q_ids: Any  # int [batch, q_len], numpy or jax
    kv_ids: Any  # int [batch, kv_len], numpy or jax

    def __post_init__(self):
        ids = []
        for name in ("q_ids", "kv_ids"):
            value = getattr(self, name)
            if not _is_jax(value):
                value = np.asarray(value)
            if value.ndim != 2 or 0 in value.shape:
                raise ValueError(
                    f"segments: {name} must be a 2-D array [batch, length] with non-zero sizes, "
                    f"got shape {value.shape}"
                )
            if not np.issubdtype(value.dtype, np.integer):
                raise TypeError(f"segments: {name} must be integers, got dtype {value.dtype}")
            object.__setattr__(self, name, value)
            ids.append(value)
        if ids[0].shape[0] != ids[1].shape[0]:
            raise ValueError(
                f"segments: q_ids and kv_ids must have the same batch size, got shapes "
                f"{ids[0].shape} and {ids[1].shape}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q_ids.shape[1]), int(self.kv_ids.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.q_ids.shape[0])

    def __repr__(self) -> str:
        return f"Segments(batch_size={self.batch_size}, shape={self.shape})"

    def _uses_jax(self) -> bool:
        return _is_jax(self.q_ids) or _is_jax(self.kv_ids)

    def _eval(self, q, kv, h, b, xp):
        if b is None:
            raise ValueError("Segments: evaluating a run-time mask needs batch indices")
        rows, cols = self.shape
        inside = (q >= 0) & (q < rows) & (kv >= 0) & (kv < cols)
        q_ids = xp.asarray(self.q_ids)[b, xp.clip(q, 0, rows - 1)]
        kv_ids = xp.asarray(self.kv_ids)[b, xp.clip(kv, 0, cols - 1)]
        return (q_ids == kv_ids) & inside


# ----------------------------------------------------------------------------------------------
# Combinators.


@dataclasses.dataclass(frozen=True)
class And(Mask):
    """``left & right``: both masks allow the pair. The operator ``&`` on masks returns it.

    Example:
      >>> m = local(1, 1) & causal()
      >>> type(m).__name__, m
      ('And', (Local(left=1, right=1) & Causal()))
      >>> m.dense(3, 3).astype(int).tolist()  # [q, kv]
      [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """

    left: Mask
    right: Mask

    def __post_init__(self):
        _check_structure("&", self.left, self.right)

    def _children(self):
        return (self.left, self.right)

    shape = property(lambda self: _merge("&", "shapes", self.left.shape, self.right.shape))
    num_heads = property(
        lambda self: _merge("&", "num_heads", self.left.num_heads, self.right.num_heads)
    )
    batch_size = property(
        lambda self: _merge("&", "batch sizes", self.left.batch_size, self.right.batch_size)
    )

    def __repr__(self) -> str:
        return f"({self.left!r} & {self.right!r})"

    def _for_head(self, head):
        return And(self.left._for_head(head), self.right._for_head(head))

    def _eval(self, q, kv, h, b, xp):
        return self.left._eval(q, kv, h, b, xp) & self.right._eval(q, kv, h, b, xp)

    def _bounds(self, q, kv):
        (la, ha), (lb, hb) = self.left._bounds(q, kv), self.right._bounds(q, kv)
        hi = ha & hb
        return (hi if la is ha and lb is hb else la & lb), hi

    def _block_bounds(self, qa, qb, ka, kb):
        (ma, pa), (mb, pb) = (m._block_bounds(qa, qb, ka, kb) for m in (self.left, self.right))
        return ma & mb, pa & pb


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    """``left | right``: either mask allows the pair. The operator ``|`` on masks returns it.

    Example:
      >>> m = local(0, 0) | sink(1)
      >>> type(m).__name__, m
      ('Or', (Local(left=0, right=0) | Sink(n=1)))
      >>> m.dense(3, 3).astype(int).tolist()  # [q, kv]
      [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    """

    left: Mask
    right: Mask

    def __post_init__(self):
        _check_structure("|", self.left, self.right)

    def _children(self):
        return (self.left, self.right)

    shape = property(lambda self: _merge("|", "shapes", self.left.shape, self.right.shape))
    num_heads = property(
        lambda self: _merge("|", "num_heads", self.left.num_heads, self.right.num_heads)
    )
    batch_size = property(
        lambda self: _merge("|", "batch sizes", self.left.batch_size, self.right.batch_size)
    )

    def __repr__(self) -> str:
        return f"({self.left!r} | {self.right!r})"

    def _for_head(self, head):
        return Or(self.left._for_head(head), self.right._for_head(head))

    def _eval(self, q, kv, h, b, xp):
        return self.left._eval(q, kv, h, b, xp) | self.right._eval(q, kv, h, b, xp)

    def _bounds(self, q, kv):
        (la, ha), (lb, hb) = self.left._bounds(q, kv), self.right._bounds(q, kv)
        hi = ha | hb
        return (hi if la is ha and lb is hb else la | lb), hi

    def _block_bounds(self, qa, qb, ka, kb):
        (ma, pa), (mb, pb) = (m._block_bounds(qa, qb, ka, kb) for m in (self.left, self.right))
        return ma | mb, pa | pb


@dataclasses.dataclass(frozen=True)
class Not(Mask):
    """``~mask``: the complement (within the mask's own shape). The operator ``~`` on a mask
    returns it.

    Example:
      >>> m = ~local(0, 0)
      >>> type(m).__name__, m
      ('Not', ~Local(left=0, right=0))
      >>> m.dense(3, 3).astype(int).tolist()  # [q, kv]
      [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    """

    mask: Mask

    def __post_init__(self):
        _check_operand("~", "operand", self.mask)

    def _children(self):
        return (self.mask,)

    shape = property(lambda self: self.mask.shape)
    num_heads = property(lambda self: self.mask.num_heads)
    batch_size = property(lambda self: self.mask.batch_size)

    def __repr__(self) -> str:
        return f"~{self.mask!r}"

    def _for_head(self, head):
        return Not(self.mask._for_head(head))

    def _eval(self, q, kv, h, b, xp):
        return ~self.mask._eval(q, kv, h, b, xp)

    def _bounds(self, q, kv):
        lo, hi = self.mask._bounds(q, kv)
        if lo is hi:
            v = ~hi
            return v, v
        return ~hi, ~lo

    def _block_bounds(self, qa, qb, ka, kb):
        must, may = self.mask._block_bounds(qa, qb, ka, kb)
        return ~may, ~must


@dataclasses.dataclass(frozen=True)
class Shifted(Mask):
    """``mask.with_offset(offset)``: row ``i`` is the query at absolute position
    ``i + offset``.

    :meth:`Mask.with_offset` returns it for ``offset >= 1`` (the mask itself for 0); nested
    shifts collapse into one.

    Example:
      >>> m = causal().with_offset(2)
      >>> type(m).__name__, m
      ('Shifted', Causal().with_offset(2))
      >>> m.dense(2, 4).astype(int).tolist()  # [q, kv]: queries at positions 2 and 3
      [[1, 1, 1, 0], [1, 1, 1, 1]]
      >>> m.with_offset(1)
      Causal().with_offset(3)
    """

    mask: Mask
    offset: int  # >= 0

    def __post_init__(self):
        _check_operand("with_offset", "mask", self.mask)
        check_int(self.offset, "offset", "with_offset", low=0, high=_INT32_MAX)
        if isinstance(self.mask, Shifted):  # collapse nested shifts
            object.__setattr__(self, "offset", self.offset + self.mask.offset)
            object.__setattr__(self, "mask", self.mask.mask)
        shape = self.mask.shape
        if shape is not None and self.offset >= shape[0]:
            raise ValueError(
                f"with_offset: offset={self.offset} leaves no query row of a mask of fixed "
                f"shape {shape}; allowed: offset < {shape[0]}"
            )

    def _children(self):
        return (self.mask,)

    @property
    def shape(self):
        shape = self.mask.shape
        return None if shape is None else (shape[0] - self.offset, shape[1])

    num_heads = property(lambda self: self.mask.num_heads)
    batch_size = property(lambda self: self.mask.batch_size)

    def _max_offset(self):
        return self.offset + self.mask._max_offset()

    def __repr__(self) -> str:
        return f"{self.mask!r}.with_offset({self.offset})"

    def _for_head(self, head):
        return Shifted(self.mask._for_head(head), self.offset)

    def _eval(self, q, kv, h, b, xp):
        return self.mask._eval(q + self.offset, kv, h, b, xp)

    def _bounds(self, q, kv):
        return self.mask._bounds(q + self.offset, kv)

    def _block_bounds(self, qa, qb, ka, kb):
        return self.mask._block_bounds(qa + self.offset, qb + self.offset, ka, kb)


@dataclasses.dataclass(frozen=True)
class PerHead(Mask):
    """One head-agnostic mask per head. Returned by :func:`per_head`; ``dense`` gives
    ``[heads, q_len, kv_len]``.

    Example:
      >>> m = per_head([causal(), local(0, 0)])
      >>> m
      PerHead(masks=(Causal(), Local(left=0, right=0)))
      >>> m.num_heads, m.for_head(1)
      (2, Local(left=0, right=0))
      >>> m.dense(2, 2).astype(int).tolist()  # [heads, q, kv]
      [[[1, 0], [1, 1]], [[1, 0], [0, 1]]]
    """

    masks: tuple[Mask, ...]

    def __post_init__(self):
        raw = self.masks
        if isinstance(raw, Mask) or not isinstance(raw, Sequence):
            raise TypeError(f"per_head: masks must be a sequence of Masks, got {raw!r:.80}")
        masks = tuple(raw)
        if not masks:
            raise ValueError("per_head: masks must be a non-empty sequence of Masks, got []")
        for i, m in enumerate(masks):
            _check_operand("per_head", f"masks[{i}]", m)
            if m.num_heads is not None:
                raise ValueError(
                    f"per_head: masks[{i}] is already per-head ({m.num_heads} heads); "
                    "allowed: head-agnostic masks only (no nesting)"
                )
        shape, batch = masks[0].shape, masks[0].batch_size
        for i, m in enumerate(masks[1:], 1):
            if m.shape != shape:
                raise ValueError(
                    f"per_head: masks[{i}] has shape {m.shape} but masks[0] has {shape}; "
                    "allowed: all the same shape"
                )
            batch = _merge("per_head", "batch sizes", batch, m.batch_size)
        object.__setattr__(self, "masks", masks)

    def _children(self):
        return self.masks

    shape = property(lambda self: self.masks[0].shape)

    @property
    def num_heads(self):
        return len(self.masks)

    @property
    def batch_size(self):
        return functools.reduce(
            lambda a, m: _merge("per_head", "batch sizes", a, m.batch_size), self.masks, None
        )

    def _for_head(self, head):
        return self.masks[head]

    def _toeplitz(self) -> bool:
        return False

    def _eval(self, q, kv, h, b, xp):
        if h is None:
            raise ValueError("PerHead: evaluating a per-head mask needs head indices")
        if isinstance(h, (int, np.integer)) or (not _is_jax(h) and np.ndim(h) == 0):
            return self.masks[int(h)]._eval(q, kv, h, b, xp)
        out = None
        for k, m in enumerate(self.masks):
            term = (h == k) & m._eval(q, kv, h, b, xp)
            out = term if out is None else out | term
        return out


def _check_structure(caller: str, left: Any, right: Any) -> None:
    _check_operand(caller, "left operand", left)
    _check_operand(caller, "right operand", right)
    _merge(caller, "shapes", left.shape, right.shape)
    _merge(caller, "num_heads", left.num_heads, right.num_heads)
    _merge(caller, "batch sizes", left.batch_size, right.batch_size)


# ----------------------------------------------------------------------------------------------
# Builders (the public way to make masks).


def full() -> Mask:
    """Every query attends to every key.

    Example:
      >>> full().dense(2, 3).all()
      np.True_
    """
    return Full()


def causal() -> Mask:
    """Causal mask: key ``j`` allowed for query ``i`` when ``j <= i``.

    Example:
      >>> causal().dense(3, 3).astype(int)
      array([[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]])
    """
    return Causal()


def local(left: int | None, right: int | None) -> Mask:
    """Sliding window: key ``j`` allowed for query ``i`` when ``i - left <= j <= i + right``.

    Same convention as splash attention's ``LocalMask(window_size=(left, right))``; a causal
    window of ``w`` keys including the query itself is ``local(w - 1, 0)``.

    Args:
      left: int >= 0, keys allowed before the query, or None for no limit.
      right: int >= 0, keys allowed after the query, or None for no limit.

    Example:
      >>> local(1, 1).dense(4, 4).astype(int)
      array([[1, 1, 0, 0],
             [1, 1, 1, 0],
             [0, 1, 1, 1],
             [0, 0, 1, 1]])
    """
    return Local(left, right)


def dilated(window: int, dilation: int) -> Mask:
    """Dilated causal window: key ``j`` allowed for query ``i`` when
    ``i - j ∈ {0, dilation, 2 * dilation, ..., window * dilation}`` (``window + 1`` keys).

    ``dilated(w, 1)`` equals ``local(w, 0)``.

    Args:
      window: int >= 0, number of dilated steps back.
      dilation: int >= 1, distance between attended keys.

    Example:
      >>> dilated(2, 2).dense(1, 6).astype(int).tolist()  # one row: query 0 ...
      [[1, 0, 0, 0, 0, 0]]
      >>> dilated(2, 2).with_offset(5).dense(1, 6).astype(int).tolist()  # ... and query 5
      [[0, 1, 0, 1, 0, 1]]
    """
    return Dilated(window, dilation)


def strided(stride: int) -> Mask:
    """Sparse Transformer strided pattern (Child et al., 2019); causal.

    Key ``j`` allowed for query ``i`` when ``0 <= i - j < stride`` (the previous ``stride``
    positions, self included) or ``i - j ≥ 0`` is a multiple of ``stride``.

    Args:
      stride: int >= 1 (``l`` in the paper, about ``sqrt(n)``).

    Example:
      >>> strided(2).with_offset(5).dense(1, 6).astype(int).tolist()
      [[0, 1, 0, 1, 1, 1]]
    """
    return Strided(stride)


def fixed(block: int, summary: int) -> Mask:
    """Sparse Transformer fixed pattern (Child et al., 2019); causal.

    Key ``j`` allowed for query ``i`` when ``j <= i`` and either ``j`` is in the same block of
    size ``block`` as ``i`` or ``j`` is one of the last ``summary`` positions of its block.

    Args:
      block: int >= 1 (``l`` in the paper).
      summary: int in [0, block] (``c`` in the paper).

    Example:
      >>> fixed(3, 1).with_offset(7).dense(1, 8).astype(int).tolist()
      [[0, 0, 1, 0, 0, 1, 1, 1]]
    """
    return Fixed(block, summary)


def sink(n: int) -> Mask:
    """Attention sinks: every query may attend to the first ``n`` keys (not causal by itself;
    combine as ``causal() & (local(w, 0) | sink(n))``).

    Args:
      n: int >= 0.

    Example:
      >>> sink(2).dense(1, 4).astype(int).tolist()
      [[1, 1, 0, 0]]
    """
    return Sink(n)


def global_tokens(indices: Sequence[int]) -> Mask:
    """Global tokens (Longformer/BigBird): the tokens at absolute positions ``indices`` attend
    to every key and every query attends to them.

    Args:
      indices: 1-D sequence of ints >= 0 (duplicates are ignored).

    Example:
      >>> global_tokens([0]).dense(3, 3).astype(int)
      array([[1, 1, 1],
             [1, 0, 0],
             [1, 0, 0]])
    """
    return GlobalTokens(indices)


def chunked(size: int) -> Mask:
    """Chunked attention: key ``j`` allowed for query ``i`` when ``i // size == j // size``.

    Not causal (unlike splash's ``ChunkedCausalMask``, which is ``chunked(size) & causal()``).

    Args:
      size: int >= 1, chunk length.

    Example:
      >>> chunked(2).dense(1, 4).astype(int).tolist()
      [[1, 1, 0, 0]]
    """
    return Chunked(size)


def random_blocks(density: float, block: int, seed: int) -> Mask:
    """BigBird random blocks: each (query block, key block) pair, with blocks of ``block``
    positions, is kept independently with probability ``density``.

    Deterministic given ``seed`` (a counter-based hash, identical in numpy and jit, the same for
    every sequence length). Not causal by itself. The realised fraction of kept block pairs
    approaches ``density`` as the number of blocks grows.

    Args:
      density: float in (0, 1].
      block: int >= 1, block size of the pattern (need not equal the kernel's block size).
      seed: int.

    Example:
      >>> m = random_blocks(0.5, 2, seed=0)
      >>> bool((m.dense(8, 8) == m.dense(8, 8)).all())  # deterministic
      True
    """
    return RandomBlocks(density, block, seed)


def from_array(array: Any) -> Mask:
    """A fixed mask given by a bool array ``[q, kv]`` or ``[heads, q, kv]`` (per-head).

    Entries outside the array are False; ``dense(q_len, kv_len)`` needs ``q_len <= q`` and
    ``kv_len <= kv``. The array is copied.

    Args:
      array: bool array (numpy or concrete jax), shape ``[q, kv]`` or ``[heads, q, kv]``.

    Example:
      >>> from_array(np.eye(2, dtype=bool)).dense(2, 2).astype(int)
      array([[1, 0],
             [0, 1]])
    """
    return FromArray(array)


def padding(lengths: Any) -> Mask:
    """Run-time key padding: key ``j`` allowed for batch element ``b`` when ``j < lengths[b]``.

    The resulting masks are dynamic: ``dense`` has a leading batch axis, ``predicate`` takes
    ``batch=`` indices, ``blocks`` gives a conservative static layout and ``to_splash`` raises
    (see the module docstring).

    Args:
      lengths: int array ``[batch]`` (numpy, or jax, possibly traced), values >= 0.

    Example:
      >>> (causal() & padding([1, 2])).dense(2, 2).astype(int).tolist()
      [[[1, 0], [1, 0]], [[1, 0], [1, 1]]]
    """
    return Padding(lengths)


def segments(q_ids: Any, kv_ids: Any = None) -> Mask:
    """Run-time segments (packed sequences): query ``i`` of batch element ``b`` sees key ``j``
    when ``q_ids[b, i] == kv_ids[b, j]``. Dynamic, like :func:`padding`.

    Args:
      q_ids: int array ``[batch, q_len]`` (numpy, or jax, possibly traced).
      kv_ids: int array ``[batch, kv_len]``; default ``q_ids`` (self-attention).

    Example:
      >>> ids = [[0, 0, 1, 1]]  # two sequences packed in one row
      >>> (causal() & segments(ids)).dense(4, 4)[0].astype(int).tolist()
      [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    return Segments(q_ids, q_ids if kv_ids is None else kv_ids)


def split_runtime(mask: Mask) -> tuple[Mask, tuple[Padding, ...], tuple[Segments, ...]] | None:
    """``(static part, padding leaves, segments leaves)`` of a mask that is a ``&`` of static
    masks, ``padding`` and ``segments`` leaves (a fused kernel applies the run-time parts as
    lengths and ids); None when a run-time leaf sits under ``|``, ``~`` or ``per_head``. The
    static part is the ``&`` of the static operands (``full()`` when there are none).

    Example:
      >>> static, paddings, segs = split_runtime(causal() & padding([3, 5]))
      >>> static == causal(), len(paddings), len(segs)
      (True, 1, 0)
      >>> split_runtime(causal() | padding([3, 5])) is None
      True
    """
    static, paddings, segs, stack = [], [], [], [check_mask(mask, "mask", "split_runtime")]
    while stack:
        node = stack.pop()
        if isinstance(node, And) and node.is_dynamic:
            stack += [node.right, node.left]
        elif isinstance(node, Padding):
            paddings.append(node)
        elif isinstance(node, Segments):
            segs.append(node)
        elif node.is_dynamic:
            return None
        else:
            static.append(node)
    whole = functools.reduce(operator.and_, static) if static else full()
    return whole, tuple(paddings), tuple(segs)


def runtime_leaves(mask: Mask) -> tuple[tuple[Padding, ...], tuple[Segments, ...]]:
    """The ``padding`` and ``segments`` leaves of ``mask``, wherever they sit, left to right.

    Example:
      >>> paddings, segs = runtime_leaves(causal() | ~padding([3, 5]))
      >>> len(paddings), len(segs)
      (1, 0)
    """
    found: tuple[list, list] = ([], [])
    stack = [check_mask(mask, "mask", "runtime_leaves")]
    while stack:
        node = stack.pop()
        if isinstance(node, Padding):
            found[0].append(node)
        elif isinstance(node, Segments):
            found[1].append(node)
        else:
            stack += reversed(node._children())
    return tuple(found[0]), tuple(found[1])


def key_lengths(paddings: Sequence[Padding], batch: int, kv_len: int, caller: str) -> Any:
    """Each batch element's key length ``[batch]`` int32 under ``padding`` leaves (the minimum
    of their lengths, at most ``kv_len``); None when there are none.

    Example:
      >>> key_lengths(split_runtime(padding([3, 9]) & padding([4, 2]))[1], 2, 8, "f").tolist()
      [3, 2]
    """
    if not paddings:
        return None
    lengths = [jnp.asarray(part.lengths, jnp.int32) for part in paddings]
    if any(length.shape != (batch,) for length in lengths):
        raise ValueError(
            f"{caller}: `mask` has padding lengths for batch size "
            f"{[int(length.shape[0]) for length in lengths]} but q has batch size {batch}"
        )
    return jnp.minimum(functools.reduce(jnp.minimum, lengths), kv_len)


def segment_ids(segs: Segments, batch: int, caller: str) -> tuple[Any, Any]:
    """``(q_ids [batch, q_len], kv_ids [batch, kv_len])`` int32 of a ``segments`` leaf, for a
    call of batch size ``batch`` (ValueError naming ``caller`` for another).

    Example:
      >>> q_ids, kv_ids = segment_ids(split_runtime(segments([[0, 0, 1]]))[2][0], 1, "f")
      >>> q_ids.dtype, q_ids.tolist(), kv_ids.shape
      (dtype('int32'), [[0, 0, 1]], (1, 3))
    """
    if segs.batch_size != batch:
        raise ValueError(
            f"{caller}: `mask` has segment ids for batch size {segs.batch_size} but q has batch "
            f"size {batch}"
        )
    return jnp.asarray(segs.q_ids, jnp.int32), jnp.asarray(segs.kv_ids, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Slot(Mask):
    """Stands for a run-time leaf in a :class:`TileExpression`: its value on the tile is read
    from the ``b`` argument of ``_eval`` (``{"padding": key length, "segments": tile}``)."""

    kind: str  # "padding" | "segments"

    def _eval(self, q, kv, h, b, xp):
        return kv < b["padding"] if self.kind == "padding" else b["segments"]


# Static leaves a kernel can evaluate from index tiles alone (no array lookups, no boolean
# reductions): integer comparisons and arithmetic on the positions.
_TILE_LEAVES = (Full, Causal, Local, Dilated, Strided, Fixed, Sink, Chunked)


@dataclasses.dataclass(frozen=True)
class TileExpression:
    """A run-time mask as a fused kernel evaluates it on one ``[bq, bkv]`` tile: the mask with
    its ``padding`` and ``segments`` leaves (at most one of each, anywhere under ``&``, ``|``,
    ``~``) replaced by the tile's values of those leaves. It holds no run-time data, so a
    kernel's static description can keep it. Built by :func:`tile_expression`.

    Example:
      >>> expr = tile_expression(causal() | padding([2]))  # a prefix-LM mask, run-time prefix
      >>> rows, keys = jnp.arange(3)[:, None], jnp.arange(3)[None, :]
      >>> expr(rows, keys, key_length=2, same_segment=None).astype(int).tolist()
      [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    """

    tree: Mask
    uses_padding: bool
    uses_segments: bool

    def __call__(self, rows: Any, keys: Any, *, key_length: Any, same_segment: Any) -> Any:
        """The mask on a tile: ``rows`` ``[bq, 1]`` and ``keys`` ``[1, bkv]`` int positions,
        ``key_length`` the batch element's ``padding`` length (scalar), ``same_segment`` its
        ``segments`` tile ``[bq, bkv]`` bool (None without one). Returns bool ``[bq, bkv]``."""
        values = {"padding": key_length, "segments": same_segment}
        value = self.tree._eval(rows, keys, None, values, jnp)
        return jnp.broadcast_to(value, np.broadcast_shapes(rows.shape, keys.shape))


def tile_expression(mask: Mask) -> TileExpression | str:
    """The :class:`TileExpression` of a run-time mask whose ``padding`` / ``segments`` leaves
    may sit under ``|`` and ``~`` (what :func:`split_runtime` does not take), or a sentence
    saying why it has none: more than one leaf of a kind, a run-time leaf under
    ``with_offset``, a per-head mask, or a static leaf that needs an array lookup
    (``from_array``, ``global_tokens``, ``random_blocks``).

    Example:
      >>> tile_expression(causal() | padding([2])).uses_padding
      True
      >>> tile_expression(from_array(np.ones((2, 2), bool)) | padding([2]))
      'from_array is not evaluated in a kernel tile (array lookups): use impl="blocksparse"'
    """
    mask = check_mask(mask, "mask", "tile_expression")
    if not mask.is_dynamic:
        return "the mask is static (its block layout holds it)"
    if mask.num_heads is not None:
        return "per-head masks with a run-time leaf under | or ~ are not evaluated in a tile"
    counts = {"padding": 0, "segments": 0}

    def rebuild(node: Mask, shifted: bool) -> Mask | str:
        if isinstance(node, (Padding, Segments)):
            kind = "padding" if isinstance(node, Padding) else "segments"
            if shifted:
                return f"a run-time `{kind}` leaf under with_offset is not evaluated in a tile"
            counts[kind] += 1
            if counts[kind] > 1:
                return f"at most one `{kind}` leaf can be evaluated in a tile"
            return _Slot(kind)
        if isinstance(node, _TILE_LEAVES):
            return node
        if isinstance(node, (And, Or)):
            left, right = rebuild(node.left, shifted), rebuild(node.right, shifted)
            for part in (left, right):
                if isinstance(part, str):
                    return part
            return type(node)(left, right)
        if isinstance(node, Not):
            inner = rebuild(node.mask, shifted)
            return inner if isinstance(inner, str) else Not(inner)
        if isinstance(node, Shifted):
            inner = rebuild(node.mask, True)
            return inner if isinstance(inner, str) else Shifted(inner, node.offset)
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", type(node).__name__).lower()
        return f'{name} is not evaluated in a kernel tile (array lookups): use impl="blocksparse"'

    tree = rebuild(mask, False)
    if isinstance(tree, str):
        return tree
    return TileExpression(tree, counts["padding"] > 0, counts["segments"] > 0)


def per_head(masks: Sequence[Mask]) -> Mask:
    """One mask per head: ``dense`` gives ``[heads, q, kv]``.

    Args:
      masks: non-empty sequence of head-agnostic masks with the same ``shape``.

    Example:
      >>> per_head([causal(), full()]).dense(2, 2).astype(int).tolist()
      [[[1, 0], [1, 1]], [[1, 1], [1, 1]]]
    """
    return PerHead(masks)


# ----------------------------------------------------------------------------------------------
# Block layouts.


@functools.lru_cache(maxsize=16)
def _cached_layout(mask: Mask, q_len: int, kv_len: int, block_q: int, block_kv: int):
    return _compute_layout(mask, q_len, kv_len, block_q, block_kv)


def _eval_blocks(mask: Mask, r: Any, c: Any, q_len: int, kv_len: int, bq: int, bk: int, unique):
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


def _head_blocks(mask: Mask, q_len: int, kv_len: int, bq: int, bk: int, unique: dict):
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


def _compute_layout(mask: Mask, q_len: int, kv_len: int, bq: int, bk: int) -> BlockLayout:
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


# ----------------------------------------------------------------------------------------------
# Splash attention.


def _to_splash_2d(sm: Any, mask: Mask, shape: tuple[int, int], offset: int) -> Any:
    """Converts a head-agnostic static mask whose rows start at ``offset``."""
    if isinstance(mask, Shifted):
        return _to_splash_2d(sm, mask.mask, shape, offset + mask.offset)
    if isinstance(mask, Full):
        return sm.FullMask(shape)
    if isinstance(mask, Causal):
        return sm.CausalMask(shape, offset=offset)
    if isinstance(mask, Local):
        return sm.LocalMask(shape, window_size=(mask.left, mask.right), offset=offset)
    if isinstance(mask, And) and offset == 0 and hasattr(sm, "ChunkedCausalMask"):
        pair = {type(mask.left), type(mask.right)}
        if pair == {Chunked, Causal}:
            chunk = mask.left if isinstance(mask.left, Chunked) else mask.right
            return sm.ChunkedCausalMask(shape, chunk_size=chunk.size)
    logical = {And: "LogicalAnd", Or: "LogicalOr"}.get(type(mask))
    if logical is not None and hasattr(sm, logical):
        left = _to_splash_2d(sm, mask.left, shape, offset)
        right = _to_splash_2d(sm, mask.right, shape, offset)
        if not isinstance(left, sm.NumpyMask) and not isinstance(right, sm.NumpyMask):
            return getattr(sm, logical)(left, right)
    return sm.NumpyMask(mask.with_offset(offset).dense(*shape))
