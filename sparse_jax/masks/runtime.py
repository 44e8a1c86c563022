"""Run-time masks: :func:`padding` and :func:`segments`, the leaves whose data (lengths, ids)
is known only at run time and may be traced, and how the kernels take an expression that holds
them apart: :func:`split_runtime` and :func:`runtime_leaves` (the leaves, for kernels that
apply them as lengths and ids), :func:`key_lengths` and :func:`segment_ids` (their arrays for a
call), and :func:`tile_expression` (the expression a fused kernel evaluates on one tile).

The mask keywords of ``jax.nn.dot_product_attention`` become leaves here too:
:func:`jax_nn_mask` (and :func:`query_padding`, the query side of its sequence lengths).

Example:
  >>> from sparse_jax.masks import causal
  >>> static, paddings, segs = split_runtime(causal() & padding([2, 3]))
  >>> static, paddings, segs
  (Causal(), (Padding(batch_size=2),), ())
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.masks.algebra import And, Mask, Not, Or, Shifted, check_mask, is_jax
from sparse_jax.masks.kinds import (
    Causal,
    Chunked,
    Dilated,
    Fixed,
    Full,
    Local,
    Sink,
    Strided,
    causal,
    full,
    local,
)
from sparse_jax.validation import check_bool, check_int

__all__ = [
    "Padding",
    "Segments",
    "TileExpression",
    "jax_nn_mask",
    "key_lengths",
    "padding",
    "query_padding",
    "runtime_leaves",
    "segment_ids",
    "segments",
    "split_runtime",
    "tile_expression",
]


# ----------------------------------------------------------------------------------------------
# Run-time leaves.


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
        if not is_jax(lengths):
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
        return is_jax(self.lengths)

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
            if not is_jax(value):
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
        return is_jax(self.q_ids) or is_jax(self.kv_ids)

    def _eval(self, q, kv, h, b, xp):
        if b is None:
            raise ValueError("Segments: evaluating a run-time mask needs batch indices")
        rows, cols = self.shape
        inside = (q >= 0) & (q < rows) & (kv >= 0) & (kv < cols)
        q_ids = xp.asarray(self.q_ids)[b, xp.clip(q, 0, rows - 1)]
        kv_ids = xp.asarray(self.kv_ids)[b, xp.clip(kv, 0, cols - 1)]
        return (q_ids == kv_ids) & inside


# ----------------------------------------------------------------------------------------------
# Builders.


def padding(lengths: Any) -> Mask:
    """Run-time key padding: key ``j`` allowed for batch element ``b`` when ``j < lengths[b]``.

    The resulting masks are dynamic: ``dense`` has a leading batch axis, ``predicate`` takes
    ``batch=`` indices, ``blocks`` gives a conservative static layout and ``to_splash`` raises
    (see the module docstring).

    Args:
      lengths: int array ``[batch]`` (numpy, or jax, possibly traced), values >= 0.

    Example:
      >>> from sparse_jax.masks import causal
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
      >>> from sparse_jax.masks import causal
      >>> ids = [[0, 0, 1, 1]]  # two sequences packed in one row
      >>> (causal() & segments(ids)).dense(4, 4)[0].astype(int).tolist()
      [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    return Segments(q_ids, q_ids if kv_ids is None else kv_ids)


def query_padding(lengths: Any, q_len: int, kv_len: int) -> Mask:
    """Run-time query padding: query row ``i`` of batch element ``b`` sees no key when
    ``i >= lengths[b]`` (its output is then 0). A :func:`segments` mask whose query ids are 0
    inside the length and -1 past it, key ids all 0, so its shape is ``(q_len, kv_len)`` and
    every engine that takes ``segments`` takes it.

    Args:
      lengths: int array ``[batch]`` (numpy, or jax, possibly traced), values >= 0.
      q_len, kv_len: the query and key lengths of the call.

    Example:
      >>> query_padding([1, 2], 2, 3).dense(2, 3).astype(int).tolist()  # [batch, q, kv]
      [[[1, 1, 1], [0, 0, 0]], [[1, 1, 1], [1, 1, 1]]]
    """
    xp = jnp if is_jax(lengths) else np
    lengths = xp.asarray(lengths)
    rows = xp.arange(q_len, dtype=np.int32)[None, :]
    q_ids = xp.where(rows < lengths.astype(np.int32)[:, None], 0, -1).astype(np.int32)
    return segments(q_ids, xp.zeros((lengths.shape[0], kv_len), np.int32))


def _check_seq_lengths(value: Any, name: str, batch: int, caller: str) -> Any:
    """int ``[batch]`` sequence lengths (numpy or jax, possibly traced), values >= 0."""
    x = value if is_jax(value) else np.asarray(value)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(
            f"{caller}: `{name}` must be an int array [batch] of sequence lengths; got dtype "
            f"{x.dtype}"
        )
    if x.shape != (batch,):
        raise ValueError(
            f"{caller}: `{name}` must have shape [batch] = ({batch},); got shape {tuple(x.shape)}"
        )
    if not isinstance(x, jax.core.Tracer) and (np.asarray(x) < 0).any():
        raise ValueError(
            f"{caller}: `{name}` must be >= 0 (a length, as in jax.nn.dot_product_attention); "
            f"got {np.asarray(x).tolist()!r:.200}"
        )
    return x


def jax_nn_mask(
    shape: tuple[int, int, int],
    *,
    is_causal: Any = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: Any = None,
    caller: str = "jax_nn_mask",
) -> Mask | None:
    """The mask of ``jax.nn.dot_product_attention``'s mask keywords, with its meaning, for
    ``shape`` = ``(batch, q_len, kv_len)``: ``causal()`` for ``is_causal``, ``local(left,
    right)`` for ``local_window_size`` (an int ``w`` is ``(w, w)``), ``padding(lengths)`` for
    ``key_value_seq_lengths`` and :func:`query_padding` for ``query_seq_lengths`` (int
    ``[batch]``, >= 0, may be traced), AND-ed; None when no keyword asks for a mask. Bad values
    raise ``ValueError``/``TypeError`` naming the keyword and ``caller``.

    Example:
      >>> jax_nn_mask((2, 4, 4), is_causal=True, local_window_size=(1, 0))
      (Causal() & Local(left=1, right=0))
      >>> jax_nn_mask((1, 4, 4), key_value_seq_lengths=[-1])
      Traceback (most recent call last):
      ...
      ValueError: jax_nn_mask: `key_value_seq_lengths` must be >= 0 (a length, as in ...
    """
    b, q_len, kv_len = shape
    parts = []
    if check_bool(is_causal, "is_causal", caller):
        parts.append(causal())
    if local_window_size is not None:
        window = local_window_size
        if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
            window = (window, window)
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(
                f"{caller}: `local_window_size` must be an int or a (left, right) pair of ints "
                f">= 0; got {local_window_size!r}"
            )
        left, right = (
            check_int(w, f"local_window_size[{i}]", caller, low=0) for i, w in enumerate(window)
        )
        parts.append(local(left, right))
    if key_value_seq_lengths is not None:
        lengths = _check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, caller)
        parts.append(padding(lengths))
    if query_seq_lengths is not None:
        lengths = _check_seq_lengths(query_seq_lengths, "query_seq_lengths", b, caller)
        parts.append(query_padding(lengths, q_len, kv_len))
    return functools.reduce(operator.and_, parts) if parts else None


# ----------------------------------------------------------------------------------------------
# Taking a run-time mask apart: what the kernels apply as lengths and ids.


def split_runtime(mask: Mask) -> tuple[Mask, tuple[Padding, ...], tuple[Segments, ...]] | None:
    """``(static part, padding leaves, segments leaves)`` of a mask that is a ``&`` of static
    masks, ``padding`` and ``segments`` leaves (a fused kernel applies the run-time parts as
    lengths and ids); None when a run-time leaf sits under ``|``, ``~`` or ``per_head``. The
    static part is the ``&`` of the static operands (``full()`` when there are none).

    Example:
      >>> from sparse_jax.masks import causal
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
      >>> from sparse_jax.masks import causal
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


# ----------------------------------------------------------------------------------------------
# Tile expressions: a run-time mask as a fused kernel evaluates it on one tile.


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
      >>> from sparse_jax.masks import causal
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
      >>> from sparse_jax.masks import causal, from_array
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
