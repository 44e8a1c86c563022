"""The base class :class:`Mask` and its algebra: ``&``, ``|``, ``~`` (:class:`And`, :class:`Or`,
:class:`Not`), ``with_offset`` (:class:`Shifted`) and :func:`per_head` (:class:`PerHead`), with
the checks of their operands.

Every mask kind (``kinds``, ``lookups``, ``runtime``) subclasses :class:`Mask` and implements
the node methods (``_eval``, ``_block_bounds``, ...); the combinators here build on them, so
this module imports no kind. A kind with a native TPU splash class says so itself
(``_splash``).

Example:
  >>> from sparse_jax.masks import causal, local
  >>> m = causal() & ~local(0, 0)  # And(Causal(), Not(Local(0, 0)))
  >>> m, m.dense(3, 3).astype(int).tolist()
  ((Causal() & ~Local(left=0, right=0)), [[0, 0, 0], [1, 0, 0], [1, 1, 0]])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.masks.layouts import BlockLayout, cached_layout, compute_layout
from sparse_jax.validation import check_int

__all__ = ["And", "Mask", "Not", "Or", "PerHead", "Shifted", "check_mask", "per_head"]

#: Largest position, length, offset or size a mask takes (positions are int32).
INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# Argument checking.


def check_mask(value: Any, name: str, caller: str, *, optional: bool = False, why: str = "") -> Any:
    """``value`` if it is a :class:`Mask` (or, with ``optional``, None); ``why`` says in a few
    words why an array or anything else is refused there. How the mask fits the inputs is
    :func:`sparse_jax.validation.check_mask_fits`.

    Example:
      >>> from sparse_jax.masks import causal
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


def is_jax(x: Any) -> bool:
    """True when ``x`` is a jax array (concrete or traced), as opposed to numpy or a list.

    Example:
      >>> is_jax(jnp.zeros(2)), is_jax(np.zeros(2))
      (True, False)
    """
    return isinstance(x, jax.Array)


# ----------------------------------------------------------------------------------------------
# The base class.


class Mask:
    """Base class of every mask: a composable predicate on (query index, key index).

    Subclasses are small frozen dataclasses, one per mask kind, that implement ``_eval``. Users
    build masks with the functions of :mod:`sparse_jax.masks` (``causal()``, ``local(...)``,
    ...) and combine them with ``&``, ``|``, ``~`` and :meth:`with_offset`.

    Example:
      >>> from sparse_jax.masks import causal, local, sink
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

    def _splash(self, sm: Any, shape: tuple[int, int], offset: int) -> Any:
        """This head-agnostic static mask, its rows starting at absolute position ``offset``,
        as a mask of splash attention's module ``sm``: a ``NumpyMask`` of the dense array
        unless the node has a native equivalent (overridden then)."""
        return sm.NumpyMask(self.with_offset(offset).dense(*shape))

    def _splash_and(self, other: Mask, sm: Any, shape: tuple[int, int]) -> Any:
        """The native splash mask of ``self & other`` (rows from 0) when this kind has one with
        ``other`` (``chunked(n) & causal()``); None otherwise."""
        return None

    # --- public API ---------------------------------------------------------------------------

    def for_head(self, head: int) -> Mask:
        """The head-agnostic mask of head ``head`` (``self`` when the mask is not per-head).

        Example:
          >>> from sparse_jax.masks import causal, full
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
          >>> from sparse_jax.masks import causal
          >>> causal().with_offset(2).dense(1, 4).astype(int).tolist()
          [[1, 1, 1, 0]]
        """
        offset = check_int(offset, "offset", "with_offset", low=0, high=INT32_MAX)
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
          >>> from sparse_jax.masks import local
          >>> local(1, 0).predicate(np.arange(3)[:, None], np.arange(3)[None, :]).astype(int)
          array([[1, 0, 0],
                 [1, 1, 0],
                 [0, 1, 1]])
        """
        use_jax = self._uses_jax() or any(is_jax(x) for x in (q_idx, kv_idx, head, batch))
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
        # Every index array at the result's rank, so that the leaves combine arrays of equal
        # rank (jax's rank promotion may be set to "raise"); scalars broadcast freely.
        q, kv, head, batch = (
            x
            if x is None or x.ndim in (0, len(shape))
            else x.reshape((1,) * (len(shape) - x.ndim) + x.shape)
            for x in (q, kv, head, batch)
        )
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
        q_len = check_int(q_len, "q_len", caller, low=1, high=INT32_MAX)
        kv_len = check_int(kv_len, "kv_len", caller, low=1, high=INT32_MAX)
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
          >>> from sparse_jax.masks import causal, local
          >>> (causal() & ~local(0, 0)).dense(3, 3).astype(int)
          array([[0, 0, 0],
                 [1, 0, 0],
                 [1, 1, 0]])
        """
        q_len, kv_len = self._check_lengths("dense", q_len, kv_len)
        if q_len + self._max_offset() > INT32_MAX:
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
          >>> from sparse_jax.masks import causal
          >>> lay = causal().blocks(6, 6, 2, 2)
          >>> lay.kv_block_counts.tolist(), lay.partial_masks.shape
          ([[1, 2, 3]], (1, 2, 2))
        """
        q_len, kv_len = self._check_lengths("blocks", q_len, kv_len)
        block_q = check_int(block_q, "block_q", "blocks", low=1, high=INT32_MAX)
        block_kv = check_int(block_kv, "block_kv", "blocks", low=1, high=INT32_MAX)
        if -(-q_len // block_q) * block_q + self._max_offset() > INT32_MAX:
            raise ValueError(f"blocks: q_len + offset must be < 2**31, got q_len={q_len}")
        if self.is_dynamic:
            return compute_layout(self, q_len, kv_len, block_q, block_kv)
        return cached_layout(self, q_len, kv_len, block_q, block_kv)

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
          >>> from sparse_jax.masks import causal
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
            num_heads = check_int(num_heads, "num_heads", "to_splash", low=1, high=INT32_MAX)
            if n is not None and num_heads != n:
                raise ValueError(
                    f"to_splash: num_heads={num_heads} does not match the per-head mask's "
                    f"{n} heads; allowed: None or {n}"
                )
        shape = (q_len, kv_len)
        if n is None and num_heads is None:
            return self._splash(sm, shape, 0)
        heads = [self.for_head(h) if n is not None else self for h in range(n or num_heads)]
        return sm.MultiHeadMask(tuple(m._splash(sm, shape, 0) for m in heads))

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
# Combinators.


@dataclasses.dataclass(frozen=True)
class And(Mask):
    """``left & right``: both masks allow the pair. The operator ``&`` on masks returns it.

    Example:
      >>> from sparse_jax.masks import causal, local
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

    def _splash(self, sm, shape, offset):
        if offset == 0 and hasattr(sm, "ChunkedCausalMask"):
            native = self.left._splash_and(self.right, sm, shape)
            if native is None:
                native = self.right._splash_and(self.left, sm, shape)
            if native is not None:
                return native
        return _logical_splash(sm, "LogicalAnd", self, shape, offset)


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    """``left | right``: either mask allows the pair. The operator ``|`` on masks returns it.

    Example:
      >>> from sparse_jax.masks import local, sink
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

    def _splash(self, sm, shape, offset):
        return _logical_splash(sm, "LogicalOr", self, shape, offset)


def _logical_splash(sm: Any, logical: str, mask: And | Or, shape: tuple[int, int], offset: int):
    """Splash's ``LogicalAnd``/``LogicalOr`` of the operands when both have a native splash
    mask; the dense ``NumpyMask`` of the whole otherwise."""
    if hasattr(sm, logical):
        left = mask.left._splash(sm, shape, offset)
        right = mask.right._splash(sm, shape, offset)
        if not isinstance(left, sm.NumpyMask) and not isinstance(right, sm.NumpyMask):
            return getattr(sm, logical)(left, right)
    return Mask._splash(mask, sm, shape, offset)


@dataclasses.dataclass(frozen=True)
class Not(Mask):
    """``~mask``: the complement (within the mask's own shape). The operator ``~`` on a mask
    returns it.

    Example:
      >>> from sparse_jax.masks import local
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
      >>> from sparse_jax.masks import causal
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
        check_int(self.offset, "offset", "with_offset", low=0, high=INT32_MAX)
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

    def _splash(self, sm, shape, offset):
        return self.mask._splash(sm, shape, offset + self.offset)


@dataclasses.dataclass(frozen=True)
class PerHead(Mask):
    """One head-agnostic mask per head. Returned by :func:`per_head`; ``dense`` gives
    ``[heads, q_len, kv_len]``.

    Example:
      >>> from sparse_jax.masks import causal, local
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
        if isinstance(h, (int, np.integer)) or (not is_jax(h) and np.ndim(h) == 0):
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


def per_head(masks: Sequence[Mask]) -> Mask:
    """One mask per head: ``dense`` gives ``[heads, q, kv]``.

    Args:
      masks: non-empty sequence of head-agnostic masks with the same ``shape``.

    Example:
      >>> from sparse_jax.masks import causal, full
      >>> per_head([causal(), full()]).dense(2, 2).astype(int).tolist()
      [[[1, 0], [1, 1]], [[1, 1], [1, 1]]]
    """
    return PerHead(masks)
