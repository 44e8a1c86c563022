"""A learned block selector: a small gate per head that scores the earlier key blocks a query may
add (SeerAttention's idea), trained to match where the attention of a teacher goes.

:class:`~sparse_jax.dynamic.BlockSelection` ranks the earlier key blocks of each query by the
pooled score ``scale · q · mean(k_block)`` (MoBA's gate): free, but a block whose keys match
the query only in a few positions has a small mean and is missed. The gate here scores blocks
with two small learned maps per head,

    score(i, c) = scale · (q_i W_q) · (pool(k_c) W_k),   pool(k_c) = [mean, max, min] of block c,

``W_q [D, G]`` and ``W_k [3D, G]`` per query head (``G`` the gate width). At initialisation
``W_q`` is the identity and ``W_k`` the identity on the mean and zero on max and min, so the
gate starts as the pooled score exactly, and training can only move it from there.

It is trained with :func:`block_gate_loss`: per query row, the KL divergence from the share of
the teacher's attention that falls in each candidate block (:func:`block_attention_mass`,
attention weights summed per key block, or their largest per block, renormalised over the
candidates) to the softmax of
the gate's scores over the same blocks, the rows weighted by how much of their attention goes to
candidates at all (a row that only looks at its own block teaches nothing about the others).
The teacher may be the layer itself: :meth:`BlockGate.self_loss` takes the layer's own full
causal attention of the same queries and keys (SeerAttention's self-distillation), which is how
a student's attention layer trains the gates of its candidates.

In a model, a :class:`LearnedBlockSelection` names the selection in a layer's candidates
(:class:`~sparse_jax.models.layers.CandidateMaskAttention`) or kept selections
(:class:`~sparse_jax.models.layers.FixedAttention`); the layer holds one :class:`BlockGate` per
such entry and ranks its blocks with it.

Candidates are exactly :class:`~sparse_jax.dynamic.BlockSelection`'s: query ``p`` (absolute
position) may add the complete key blocks ``c <= p // block - local_blocks``. Scores of other
blocks are ``-inf``. The selection runs through the same engines (:meth:`BlockGate.mask`,
:meth:`BlockGate.attention`, ``block_scores=`` of :func:`~sparse_jax.dynamic.topk_block_attention`)
and, as there, is not differentiated: the attention's loss reaches the gate only through
:func:`block_gate_loss`.

Shapes: ``B`` batch, ``T``/``Tq``/``Tk`` lengths, ``N`` query heads, ``Kh`` key heads (divides
``N``; query head ``n`` reads key head ``n // (N // Kh)``), ``D`` head dim, ``nk =
ceil(Tk / block)`` key blocks.

Example:
  >>> from sparse_jax.dynamic import BlockSelection, earlier_blocks
  >>> gate = BlockGate(BlockSelection(keep_blocks=1, block=4), num_heads=2, head_dim=8)
  >>> q = k = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))  # [B, T, N, D]
  >>> gate.scores(q, k).shape  # [B, N, T, nk]: -inf where a block is not a candidate
  (1, 2, 16, 4)
  >>> bool((gate.mask(q, k) == gate.selection.dense(q, k)).all())  # starts as the pooled score
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.dynamic import BlockSelection, earlier_blocks
from sparse_jax.normalizers import normalize
from sparse_jax.validation import check_float_array, check_int, check_scale

__all__ = [
    "BlockGate",
    "LearnedBlockSelection",
    "block_attention_mass",
    "block_gate_loss",
    "block_gate_scores",
    "causal_attention_weights",
]


@dataclasses.dataclass(frozen=True)
class LearnedBlockSelection(BlockSelection):
    """A :class:`~sparse_jax.dynamic.BlockSelection` whose earlier blocks a learned
    :class:`BlockGate` ranks instead of the pooled score: the specification only. The attention
    layer that lists it holds the gate's parameters (one gate per entry), so that the same
    specification in two layers gives two gates; a freshly made gate selects exactly as the
    pooled score does.

    Args:
      keep_blocks, block, local_blocks: as in :class:`~sparse_jax.dynamic.BlockSelection`.
      gate_dim: ``G``, the width of the gate's maps (None: the head dim).
      pool: how the gate's target pools the layer's attention per key block
        (:func:`block_attention_mass`): 'sum', the block's share of the attention, or 'max',
        its largest weight (SeerAttention's), which ranks a block holding one sharply attended
        key above a block of many weakly attended ones.

    Example:
      >>> sel = LearnedBlockSelection(2, block=16)
      >>> isinstance(sel, BlockSelection), sel == BlockSelection(2, block=16)
      (True, False)
      >>> BlockGate(sel, num_heads=2, head_dim=8)
      BlockGate(keep 2 earlier blocks of 16 keys, 2 heads, gate width 8: 512 parameters)
    """

    gate_dim: int | None = None
    pool: str = "sum"

    def __post_init__(self):
        super().__post_init__()
        _check_pool(self.pool, "LearnedBlockSelection")
        if self.gate_dim is not None:
            check_int(self.gate_dim, "gate_dim", "LearnedBlockSelection")


POOLS = ("sum", "max")


def _check_pool(pool: Any, caller: str) -> None:
    if pool not in POOLS:
        raise ValueError(f"{caller}: `pool` must be one of {POOLS}; got {pool!r}")


def _positions(tq: int, tk: int, q_offset: Any) -> jax.Array:
    start = tk - tq if q_offset is None else q_offset
    return start + jnp.arange(tq, dtype=jnp.int32)


def _candidates(tq: int, tk: int, block: int, local_blocks: int, q_offset: Any) -> jax.Array:
    """bool ``[Tq, nk]``: the earlier complete key blocks each query may add (BlockSelection's)."""
    return earlier_blocks(_positions(tq, tk, q_offset), -(-tk // block), block, local_blocks)


def _pooled_keys(k: jax.Array, block: int) -> jax.Array:
    """``[B, nk, Kh, 3D]``: mean, max and min of the real keys of each block (float32)."""
    b, tk, kh, d = k.shape
    nk = -(-tk // block)
    x = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, nk * block - tk), (0, 0), (0, 0)))
    x = x.reshape(b, nk, block, kh, d)
    real = (np.arange(nk * block) < tk).reshape(1, nk, block, 1, 1)
    rows = np.minimum(block, tk - np.arange(nk) * block).astype(np.float32)[None, :, None, None]
    mean = jnp.where(real, x, 0.0).sum(axis=2) / rows
    high = jnp.where(real, x, -jnp.inf).max(axis=2)
    low = jnp.where(real, x, jnp.inf).min(axis=2)
    return jnp.concatenate([mean, high, low], axis=-1)


def block_gate_scores(
    q: jax.Array,
    k: jax.Array,
    w_q: jax.Array,
    w_k: jax.Array,
    *,
    block: int,
    local_blocks: int = 1,
    scale: Any = None,
    q_offset: Any = None,
) -> jax.Array:
    """float32 ``[B, N, Tq, nk]``: the gate's score of every earlier key block for every query,
    ``-inf`` where a block is not a candidate (see the module docstring).

    Args:
      q: ``[B, Tq, N, D]`` queries; query ``i`` at absolute position ``Tk - Tq + i``, or
        ``q_offset + i`` (an int or a traced int: decoding into a cache of ``Tk`` slots).
      k: ``[B, Tk, Kh, D]`` keys.
      w_q: ``[N, D, G]``, the query map of each head.
      w_k: ``[N, 3D, G]``, the map of each head from the pooled key block ``[mean, max, min]``.
      block: int >= 1, keys per block.
      local_blocks: int >= 1, the most recent key blocks a query always keeps (not candidates).
      scale: multiplier of the scores; default ``D ** -0.5`` (the attention's).

    Example:
      >>> q = k = jnp.ones((1, 8, 1, 2))
      >>> w_q, w_k = jnp.eye(2)[None], jnp.eye(6, 2)[None]  # the pooled score
      >>> block_gate_scores(q, k, w_q, w_k, block=2)[0, 0, 7].tolist()  # blocks 0-2 of 4
      [1.4142135381698608, 1.4142135381698608, 1.4142135381698608, -inf]
    """
    caller = "block_gate_scores"
    for name, x in (("q", q), ("k", k), ("w_q", w_q), ("w_k", w_k)):
        check_float_array(x, name, caller, "a float array")
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{caller}: `q` [B, Tq, N, D] and `k` [B, Tk, Kh, D] must share B and D; got "
            f"{list(q.shape)} and {list(k.shape)}"
        )
    _, tq, n, d = q.shape
    kh = k.shape[2]
    if n % kh:
        raise ValueError(f"{caller}: key heads ({kh}) must divide query heads ({n})")
    if w_q.ndim != 3 or w_q.shape[:2] != (n, d):
        raise ValueError(
            f"{caller}: `w_q` must be [N, D, G] = [{n}, {d}, G]; got {list(w_q.shape)}"
        )
    if w_k.shape != (n, 3 * d, w_q.shape[2]):
        raise ValueError(
            f"{caller}: `w_k` must be [N, 3D, G] = {[n, 3 * d, w_q.shape[2]]}; got "
            f"{list(w_k.shape)}"
        )
    block = check_int(block, "block", caller)
    local_blocks = check_int(local_blocks, "local_blocks", caller)
    scale = check_scale(scale, d, caller)
    pooled = jnp.repeat(_pooled_keys(k, block), n // kh, axis=2)  # [B, nk, N, 3D]
    gq = jnp.einsum("bind,ndg->bnig", q.astype(jnp.float32), w_q.astype(jnp.float32))
    gk = jnp.einsum("bcne,neg->bncg", jnp.nan_to_num(pooled), w_k.astype(jnp.float32))
    scores = jnp.einsum("bnig,bncg->bnic", gq, gk) * jnp.asarray(scale, jnp.float32)
    where = _candidates(tq, k.shape[1], block, local_blocks, q_offset)
    return jnp.where(where, scores, -jnp.inf)


def causal_attention_weights(
    q: jax.Array, k: jax.Array, *, normalizer: Any = "softmax", scale: Any = None
) -> jax.Array:
    """float32 ``[B, N, T, T]``: full causal self-attention weights of ``q [B, T, N, D]``
    against ``k [B, T, Kh, D]`` (``Kh`` divides ``N``) under ``normalizer`` (a name or an α, as
    :func:`sparse_jax.attention` takes it; an α array ``[N]`` per head), the teacher of
    :meth:`BlockGate.self_loss`.

    Example:
      >>> q = k = jnp.zeros((1, 3, 1, 4))
      >>> causal_attention_weights(q, k)[0, 0, :2].tolist()  # equal scores: uniform on the past
      [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]
    """
    caller = "causal_attention_weights"
    check_float_array(q, "q", caller, "a float array")
    check_float_array(k, "k", caller, "a float array")
    if q.ndim != 4 or k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{caller}: `q` [B, T, N, D] and `k` [B, T, Kh, D] must share B, T and D; got "
            f"{list(q.shape)} and {list(k.shape)}"
        )
    _, t, n, d = q.shape
    scale = check_scale(scale, d, caller)
    k = jnp.repeat(k.astype(jnp.float32), n // k.shape[2], axis=2)
    s = jnp.einsum("bind,bjnd->bnij", q.astype(jnp.float32), k) * jnp.asarray(scale, jnp.float32)
    if isinstance(normalizer, jax.Array) and normalizer.ndim == 1:  # α per head
        normalizer = normalizer[None, :, None]
    return normalize(s, jnp.asarray(np.tri(t, dtype=bool)), normalizer)


def block_attention_mass(
    weights: jax.Array,
    block: int,
    *,
    local_blocks: int = 1,
    q_offset: Any = None,
    pool: str = "sum",
) -> jax.Array:
    """float32 ``[B, N, Tq, nk]``: the attention weight each query puts on each candidate key
    block (summed over the block's keys, or their largest: ``pool``), 0 on the blocks that are
    not candidates.

    Args:
      weights: ``[B, N, Tq, Tk]`` attention weights (a teacher's), rows summing to 1.
      block, local_blocks, q_offset: as in :func:`block_gate_scores`.
      pool: 'sum' (the block's mass) or 'max' (its largest weight).

    Example:
      >>> w = jnp.full((1, 1, 6, 6), 1 / 6)  # uniform over 6 keys
      >>> block_attention_mass(w, 2)[0, 0, 5].tolist()  # blocks 0 and 1 are earlier than 2
      [0.3333333432674408, 0.3333333432674408, 0.0]
      >>> block_attention_mass(w, 2, pool="max")[0, 0, 5].tolist()
      [0.1666666716337204, 0.1666666716337204, 0.0]
    """
    caller = "block_attention_mass"
    check_float_array(weights, "weights", caller, "a float array")
    if weights.ndim != 4:
        raise ValueError(f"{caller}: `weights` must be [B, N, Tq, Tk]; got {list(weights.shape)}")
    block = check_int(block, "block", caller)
    local_blocks = check_int(local_blocks, "local_blocks", caller)
    _check_pool(pool, caller)
    b, n, tq, tk = weights.shape
    nk = -(-tk // block)
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, 0), (0, 0), (0, nk * block - tk)))
    w = w.reshape(b, n, tq, nk, block)
    mass = w.sum(axis=-1) if pool == "sum" else w.max(axis=-1)  # padding is 0: never the max
    return jnp.where(_candidates(tq, tk, block, local_blocks, q_offset), mass, 0.0)


def block_gate_loss(scores: jax.Array, mass: jax.Array) -> jax.Array:
    """float32 scalar: the gate's loss against a teacher's block mass, ``Σ_rows m_r ·
    KL(mass_r / m_r ‖ softmax(scores_r))`` over ``Σ_rows m_r``, where ``m_r`` is the row's mass
    on candidate blocks (rows with none, or no candidate, count 0; all such: 0).

    Args:
      scores: ``[..., nk]`` from :func:`block_gate_scores` (``-inf`` off the candidates).
      mass: ``[..., nk]`` from :func:`block_attention_mass`, the same shape.

    Example:
      >>> mass = jnp.array([[0.3, 0.1, 0.0]])
      >>> scores = jnp.log(jnp.array([[0.75, 0.25, 0.0]]))  # the mass's own shares: KL 0
      >>> bool(abs(block_gate_loss(scores, mass)) < 1e-6)
      True
    """
    caller = "block_gate_loss"
    check_float_array(scores, "scores", caller, "a float array")
    check_float_array(mass, "mass", caller, "a float array")
    if scores.shape != mass.shape:
        raise ValueError(
            f"{caller}: `scores` and `mass` must have one shape; got {list(scores.shape)} and "
            f"{list(mass.shape)}"
        )
    scores, mass = scores.astype(jnp.float32), mass.astype(jnp.float32)
    candidate = jnp.isfinite(scores)
    mass = jnp.where(candidate, mass, 0.0)
    row = mass.sum(axis=-1, keepdims=True)
    share = mass / jnp.where(row > 0, row, 1.0)
    # The lowest finite score off the candidates, not -inf: a row without candidates stays
    # finite (and contributes 0), so no NaN reaches the gradient through the softmax.
    low = jnp.finfo(jnp.float32).min
    log_gate = jax.nn.log_softmax(jnp.where(candidate, scores, low), axis=-1)
    terms = jnp.where(share > 0, share * (jnp.log(jnp.where(share > 0, share, 1.0)) - log_gate), 0)
    kl = terms.sum(axis=-1)
    row = row[..., 0]
    return (row * kl).sum() / jnp.maximum(row.sum(), jnp.finfo(jnp.float32).tiny)


class BlockGate(nnx.Module):
    """The learned selector of one attention layer: a :class:`~sparse_jax.dynamic.BlockSelection`
    (how many earlier blocks each query adds, of what size) whose blocks are ranked by a gate
    per head (:func:`block_gate_scores`), starting as the pooled score.

    Args:
      selection: the :class:`~sparse_jax.dynamic.BlockSelection` it ranks the blocks for.
      num_heads: ``N``, query heads.
      head_dim: ``D``.
      gate_dim: ``G``, the width of the gate's maps (default: a
        :class:`LearnedBlockSelection`'s own, else ``D``; the first ``min(D, G)``
        dimensions of the pooled score when smaller).

    Example:
      >>> gate = BlockGate(BlockSelection(2, block=16), num_heads=4, head_dim=32, gate_dim=8)
      >>> gate  # doctest: +ELLIPSIS
      BlockGate(keep 2 earlier blocks of 16 keys, 4 heads, gate width 8: 4,096 parameters)
    """

    def __init__(
        self,
        selection: BlockSelection,
        num_heads: int,
        head_dim: int,
        *,
        gate_dim: int | None = None,
    ):
        caller = "BlockGate"
        if not isinstance(selection, BlockSelection):
            raise TypeError(
                f"{caller}: `selection` must be a sparse_jax.dynamic.BlockSelection; got "
                f"{type(selection).__name__}"
            )
        n = check_int(num_heads, "num_heads", caller)
        d = check_int(head_dim, "head_dim", caller)
        if gate_dim is None and isinstance(selection, LearnedBlockSelection):
            gate_dim = selection.gate_dim
        g = d if gate_dim is None else check_int(gate_dim, "gate_dim", caller)
        self.selection = selection
        eye = np.eye(d, g, dtype=np.float32)
        self.w_q = nnx.Param(jnp.asarray(np.broadcast_to(eye, (n, d, g))))
        w_k = np.concatenate([eye, np.zeros((2 * d, g), np.float32)])
        self.w_k = nnx.Param(jnp.asarray(np.broadcast_to(w_k, (n, 3 * d, g))))

    def __repr__(self) -> str:
        n, _, g = self.w_q[...].shape
        size = self.w_q[...].size + self.w_k[...].size
        s = self.selection
        return (
            f"BlockGate(keep {s.keep_blocks} earlier blocks of {s.block} keys, {n} heads, "
            f"gate width {g}: {size:,} parameters)"
        )

    def scores(
        self,
        q: jax.Array,
        k: jax.Array,
        *,
        scale: Any = None,
        q_offset: Any = None,
        heads: Sequence[int] | None = None,
    ):
        """float32 ``[B, N, Tq, nk]``: :func:`block_gate_scores` with this gate's maps;
        ``heads``: the gate's heads that ``q`` holds (``N = len(heads)``; default all)."""
        s = self.selection
        w_q, w_k = self.w_q[...], self.w_k[...]
        if heads is not None:
            w_q, w_k = w_q[np.asarray(heads)], w_k[np.asarray(heads)]
        return block_gate_scores(
            q, k, w_q, w_k, block=s.block, local_blocks=s.local_blocks, scale=scale,
            q_offset=q_offset,
        )  # fmt: skip

    def mask(self, q: jax.Array, k: jax.Array, *, scale: Any = None, q_offset: Any = None):
        """bool ``[B, N, Tq, Tk]``: the entries the selection keeps when the gate ranks the
        blocks (:meth:`BlockSelection.dense` with ``block_scores``)."""
        scores = self.scores(q, k, scale=scale, q_offset=q_offset)
        return self.selection.dense(q, k, scale=scale, q_offset=q_offset, block_scores=scores)

    def attention(self, q, k, v, *, normalizer: Any = "softmax", scale: Any = None):
        """``[B, T, N, Dv]``: self-attention over the blocks the gate selects, through the
        selection's block-top-k engine (:meth:`BlockSelection.attention`)."""
        scores = self.scores(q, k, scale=scale)
        return self.selection.attention(
            q, k, v, normalizer=normalizer, scale=scale, block_scores=scores
        )

    def loss(self, q: jax.Array, k: jax.Array, weights: jax.Array, *, scale: Any = None):
        """float32 scalar: :func:`block_gate_loss` of this gate on ``q``, ``k`` against the
        attention ``weights [B, N, Tq, Tk]`` of a teacher (e.g. the dense attention of the same
        layer), pooled per key block as the selection's ``pool`` says (a
        :class:`LearnedBlockSelection`'s; 'sum' for a plain BlockSelection)."""
        s = self.selection
        mass = block_attention_mass(
            jax.lax.stop_gradient(weights),
            s.block,
            local_blocks=s.local_blocks,
            pool=getattr(s, "pool", "sum"),
        )
        return block_gate_loss(self.scores(q, k, scale=scale), mass)

    def self_loss(
        self, q: jax.Array, k: jax.Array, *, normalizer: Any = "softmax", scale: Any = None
    ):
        """float32 scalar: :meth:`loss` against the layer's own full causal attention of ``q
        [B, T, N, D]`` and ``k [B, T, Kh, D]`` (:func:`causal_attention_weights`), with ``q`` and
        ``k`` held fixed: its gradient reaches the gate's maps only, never the model that made
        the queries and keys."""
        q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
        weights = causal_attention_weights(q, k, normalizer=normalizer, scale=scale)
        return self.loss(q, k, weights, scale=scale)
