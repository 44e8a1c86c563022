"""The mask kinds given by arithmetic on the positions: :func:`full`, :func:`causal`,
:func:`local`, :func:`dilated`, :func:`strided`, :func:`fixed`, :func:`sink` and
:func:`chunked`, one small frozen dataclass each (``Full``, ``Causal``, ...) and its builder.

A kernel can evaluate these from index tiles alone (integer comparisons, no array lookups);
the kinds that look something up are in ``lookups``, the run-time ones in ``runtime``.

Example:
  >>> m = causal() & (local(1, 0) | sink(1))
  >>> m.dense(4, 4)[3].astype(int).tolist()  # query 3 sees the sink, itself and key 2
  [1, 0, 1, 1]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparse_jax.masks.algebra import INT32_MAX, Mask
from sparse_jax.validation import check_int

__all__ = [
    "Causal",
    "Chunked",
    "Dilated",
    "Fixed",
    "Full",
    "Local",
    "Sink",
    "Strided",
    "causal",
    "chunked",
    "dilated",
    "fixed",
    "full",
    "local",
    "sink",
    "strided",
]


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

    def _splash(self, sm, shape, offset):
        return sm.FullMask(shape)


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

    def _splash(self, sm, shape, offset):
        return sm.CausalMask(shape, offset=offset)


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
                value = check_int(value, name, "local", low=0, high=INT32_MAX)
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

    def _splash(self, sm, shape, offset):
        return sm.LocalMask(shape, window_size=(self.left, self.right), offset=offset)


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
            self, "window", check_int(self.window, "window", "dilated", low=0, high=INT32_MAX)
        )
        object.__setattr__(
            self,
            "dilation",
            check_int(self.dilation, "dilation", "dilated", low=1, high=INT32_MAX),
        )
        if self.window * self.dilation > INT32_MAX:
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
            self, "stride", check_int(self.stride, "stride", "strided", low=1, high=INT32_MAX)
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
            self, "block", check_int(self.block, "block", "fixed", low=1, high=INT32_MAX)
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
        object.__setattr__(self, "n", check_int(self.n, "n", "sink", low=0, high=INT32_MAX))

    def _eval(self, q, kv, h, b, xp):
        return kv < self.n

    def _block_bounds(self, qa, qb, ka, kb):
        return kb < self.n, ka < self.n


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
            self, "size", check_int(self.size, "size", "chunked", low=1, high=INT32_MAX)
        )

    def _eval(self, q, kv, h, b, xp):
        return (q // self.size) == (kv // self.size)

    def _block_bounds(self, qa, qb, ka, kb):
        n = self.size
        must = (qa // n == qb // n) & (ka // n == kb // n) & (qa // n == ka // n)
        return must, (qa // n <= kb // n) & (ka // n <= qb // n)

    def _splash_and(self, other, sm, shape):
        if type(self) is Chunked and type(other) is Causal:  # splash's ChunkedCausalMask
            return sm.ChunkedCausalMask(shape, chunk_size=self.size)
        return None


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
