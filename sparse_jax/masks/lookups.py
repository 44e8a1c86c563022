"""The static mask kinds that look something up rather than compare positions:
:func:`global_tokens` (a set of indices), :func:`random_blocks` (a hash of the block pair) and
:func:`from_array` (a bool array), each a frozen dataclass (``GlobalTokens``, ``RandomBlocks``,
``FromArray``) with its builder.

Example:
  >>> m = global_tokens([0]) | from_array(np.eye(3, dtype=bool))  # shape fixed by the array
  >>> m.shape, m.dense(3, 3).astype(int).tolist()
  ((3, 3), [[1, 1, 1], [1, 1, 0], [1, 0, 1]])
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sparse_jax.masks.algebra import INT32_MAX, Mask
from sparse_jax.validation import check_int

__all__ = [
    "FromArray",
    "GlobalTokens",
    "RandomBlocks",
    "from_array",
    "global_tokens",
    "random_blocks",
]


# ----------------------------------------------------------------------------------------------
# Leaves.


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
            check_int(v, f"indices[{k}]", "global_tokens", low=0, high=INT32_MAX)
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
    seed: int  # in [-2**31, 2**31)

    def __post_init__(self):
        d = self.density
        if isinstance(d, bool) or not isinstance(d, numbers.Real):
            raise TypeError(f"random_blocks: density must be a float in (0, 1], got {d!r}")
        if not 0.0 < float(d) <= 1.0:
            raise ValueError(f"random_blocks: density must be a float in (0, 1], got {d!r}")
        object.__setattr__(self, "density", float(d))
        object.__setattr__(
            self, "block", check_int(self.block, "block", "random_blocks", low=1, high=INT32_MAX)
        )
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise TypeError(f"random_blocks: seed must be an int, got {self.seed!r}")
        if not -(2**31) <= int(self.seed) < 2**31:  # another int would alias one of these
            raise ValueError(
                f"random_blocks: `seed` must be an int in [-2**31, 2**31) (the pattern's hash "
                f"takes 32 bits); got seed={int(self.seed)}"
            )
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


# ----------------------------------------------------------------------------------------------
# Builders.


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


def random_blocks(density: float, block: int, seed: int) -> Mask:
    """BigBird random blocks: each (query block, key block) pair, with blocks of ``block``
    positions, is kept independently with probability ``density``.

    Deterministic given ``seed`` (a counter-based hash, identical in numpy and jit, the same for
    every sequence length). Not causal by itself. The realised fraction of kept block pairs
    approaches ``density`` as the number of blocks grows.

    Args:
      density: float in (0, 1].
      block: int >= 1, block size of the pattern (need not equal the kernel's block size).
      seed: int in ``[-2**31, 2**31)``, one seed per value of the pattern's 32-bit hash
        (others raise a ``ValueError`` rather than silently repeat a seed of that range).

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
