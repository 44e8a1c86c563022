"""How the attention layers count and route a :class:`~sparse_jax.dynamic.BlockSelection`, a
data-dependent candidate mask: which engine runs it (:func:`gathers`), the entries it allows
whatever the input and those it may add (:func:`fixed_part`, :func:`chosen_per_row`), the
density bound of a head that adds it to a static mask (:func:`union_density_bound`), and the
gates a layer holds for its learned selections (:func:`selector_gates`, :func:`block_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from sparse_jax import masks as masks_lib
from sparse_jax.block_gate import BlockGate, LearnedBlockSelection
from sparse_jax.dynamic import BlockSelection

__all__ = [
    "GATHER_FRACTION",
    "block_scores",
    "check_selections",
    "chosen_per_row",
    "entries_of",
    "fixed_part",
    "gathers",
    "selector_gates",
    "union_density_bound",
]


def _dense(mask: masks_lib.Mask, seq_len: int) -> np.ndarray:
    """bool ``[(N,) T, T]``: ``mask`` for causal self-attention on ``seq_len`` tokens."""
    return np.asarray(mask.dense(seq_len, seq_len))


# A selection runs its gather engine (only the chosen blocks' scores) when those are at most
# this fraction of the T x T score matrix, else the XLA engine on its dense mask: the gather
# moves each query's blocks, which on a 2-core CPU costs more than dense scores up to about 2048
# tokens (`python -m experiments.bench selection`, docs/benchmarks.md "Block selection").
GATHER_FRACTION = 1 / 64


def gathers(selection: BlockSelection, seq_len: int) -> bool:
    """Whether a layer runs ``selection`` on ``seq_len`` tokens with its gather engine
    (:data:`GATHER_FRACTION`).

    Example:
      >>> from sparse_jax.dynamic import BlockSelection
      >>> gathers(BlockSelection(2, block=16), 512), gathers(BlockSelection(2, block=16), 4096)
      (False, True)
    """
    return selection.formed(seq_len) <= GATHER_FRACTION * seq_len * seq_len


def check_selections(selections, selected, num_heads: int, impl: str):
    """FixedAttention's ``selections`` as a tuple and ``selected`` as ``N`` tuples of bools
    (default: every head adds every selection); ValueError/TypeError naming what is wrong.

    Example:
      >>> check_selections([BlockSelection(1, block=4)], None, 2, "auto")
      ((BlockSelection(keep_blocks=1, block=4, local_blocks=1),), ((True,), (True,)))
    """
    caller = "FixedAttention"
    selections = tuple(selections)
    for i, sel in enumerate(selections):
        if not isinstance(sel, BlockSelection):
            raise TypeError(
                f"{caller}: selections[{i}] must be a sparse_jax.dynamic.BlockSelection; "
                f"got {sel!r}"
            )
    if not selections:
        if selected is not None:
            raise ValueError(f"{caller}: `selected` needs `selections`; got {selected!r}")
        return (), ()
    if impl not in ("auto", "xla"):
        raise ValueError(
            f"{caller}: a layer with `selections` runs the XLA engine on a dense mask; `impl` "
            f"must be 'auto' or 'xla'; got {impl!r}"
        )
    shape = (num_heads, len(selections))
    grid = np.ones(shape, bool) if selected is None else np.asarray(selected)
    if grid.shape != shape or grid.dtype != bool:
        raise ValueError(
            f"{caller}: `selected` must be a bool array of shape {shape} (heads, selections); "
            f"got {grid.dtype} {grid.shape}"
        )
    return selections, tuple(tuple(bool(x) for x in row) for row in grid)


def union_density_bound(
    mask: masks_lib.Mask, selections: Sequence[BlockSelection], seq_len: int
) -> float:
    """An upper bound of the density at ``seq_len`` of a head that attends to ``mask`` and to
    the blocks each of ``selections`` chooses: the entries every input gets (``mask`` and the
    selections' local blocks) plus each selection's chosen blocks counted as if nothing else
    covered them, each row at most its causal entries. Exact for a causal ``mask`` within one
    selection's local blocks and that selection alone.

    Example:
      >>> from sparse_jax.dynamic import BlockSelection
      >>> sel = BlockSelection(keep_blocks=1, block=4)
      >>> union_density_bound(masks_lib.local(0, 0), [sel], 16) == sel.entries(16, 16) / 256
      True
    """
    fixed = np.asarray(_dense(mask, seq_len))
    rows = np.zeros(seq_len, np.int64)
    for sel in selections:
        fixed = fixed | fixed_part(sel, seq_len)
        rows = rows + chosen_per_row(sel, seq_len)
    rows = np.minimum(fixed.sum(axis=1) + rows, np.arange(1, seq_len + 1))
    return float(rows.sum() / seq_len**2)


def entries_of(candidate: Any, tq: int, tk: int) -> int:
    """The entries ``candidate`` (a static mask or a selection) allows for the last ``tq`` of
    ``tk`` positions (a selection's count does not depend on the input).

    Example:
      >>> entries_of(masks_lib.causal(), 4, 4), entries_of(BlockSelection(0, block=2), 4, 4)
      (10, 6)
    """
    if isinstance(candidate, BlockSelection):
        return candidate.entries(tq, tk)
    return int(np.sum(candidate.with_offset(tk - tq).dense(tq, tk)))


def fixed_part(candidate: Any, seq_len: int) -> np.ndarray:
    """bool ``[T, T]``: the entries ``candidate`` allows whatever the input (a selection: the
    causal part of its local blocks).

    Example:
      >>> fixed_part(BlockSelection(1, block=2), 4).astype(int).tolist()  # own block of 2
      [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """
    if not isinstance(candidate, BlockSelection):
        return np.asarray(_dense(candidate, seq_len))
    own = np.arange(seq_len) // candidate.block
    near = own[None, :] > own[:, None] - candidate.local_blocks
    return near & np.tri(seq_len, dtype=bool)


def chosen_per_row(candidate: Any, seq_len: int) -> np.ndarray:
    """int ``[T]``: the entries each query row may add beyond :func:`fixed_part` (a selection's
    chosen earlier blocks; none for a static mask).

    Example:
      >>> chosen_per_row(BlockSelection(1, block=2), 6).tolist()  # one earlier block of 2
      [0, 0, 2, 2, 2, 2]
    """
    if not isinstance(candidate, BlockSelection):
        return np.zeros(seq_len, np.int64)
    return candidate.blocks_per_query(np.arange(seq_len))[1] * candidate.block


def selector_gates(
    selections: Sequence[Any], num_heads: int, head_dim: int | None, caller: str
) -> nnx.Dict | None:
    """One :class:`~sparse_jax.block_gate.BlockGate` per
    :class:`~sparse_jax.block_gate.LearnedBlockSelection` among a layer's candidates or
    selections, keyed by its index as a string (None when there is none); ValueError when
    ``head_dim`` is missing for them.

    Example:
      >>> gates = selector_gates([masks_lib.causal(), LearnedBlockSelection(1, 4)], 2, 8, "layer")
      >>> list(gates.keys()), gates["1"]
      (['1'], BlockGate(keep 1 earlier blocks of 4 keys, 2 heads, gate width 8: 512 parameters))
    """
    learned = {i: s for i, s in enumerate(selections) if isinstance(s, LearnedBlockSelection)}
    if not learned:
        return None
    if head_dim is None:
        raise ValueError(
            f"{caller}: a LearnedBlockSelection (at {sorted(learned)}) holds a gate whose maps "
            "need `head_dim`; got None"
        )
    return nnx.Dict({str(i): BlockGate(s, num_heads, head_dim) for i, s in learned.items()})


def block_scores(gates: nnx.Dict | None, index: int, q, k, *, q_offset: Any = None, heads=None):
    """The learned block scores ``[B, N, Tq, nk]`` of the selection at ``index`` (its gate's,
    :meth:`~sparse_jax.block_gate.BlockGate.scores`, for ``heads`` of the gate; default all),
    or None when that selection ranks by the pooled score.

    Example:
      >>> import jax.numpy as jnp
      >>> gates = selector_gates([masks_lib.causal(), LearnedBlockSelection(1, 4)], 2, 8, "layer")
      >>> q = k = jnp.ones((1, 8, 2, 8))  # [batch, seq, heads, head_dim]
      >>> block_scores(gates, 1, q, k).shape, block_scores(gates, 0, q, k)
      ((1, 2, 8, 2), None)
    """
    if gates is None or str(index) not in gates:
        return None
    return gates[str(index)].scores(q, k, q_offset=q_offset, heads=heads)
