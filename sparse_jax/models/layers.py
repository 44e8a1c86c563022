"""Flax NNX layers for sparse and learned-sparse attention: thin modules around the pure
functions of :mod:`sparse_jax.dispatch`, :mod:`sparse_jax.masks` and :mod:`sparse_jax.gates`.

Shapes: ``B`` batch, ``T`` query length, ``S`` key length (``S >= T``; with a cache the queries
are the last ``T`` positions, i.e. query ``i`` sits at absolute position ``S - T + i``), ``N``
heads, ``H`` head dim, ``C`` candidate masks, ``U`` FFN units.

Every attention module maps ``q [B, T, N, H], k, v [B, S, N, H]`` to ``(out [B, T, N, H], aux)``
where ``aux`` is a dict of scalar penalties (empty for fixed attention) that the training loss
adds up; gates map activations ``[..., N or U]`` to gated activations and a penalty.

* :class:`FixedAttention`: a static :class:`~sparse_jax.masks.Mask` (default causal) under any
  normalizer, optionally with a learnable α per head (α = 1 + softplus(θ)).
* :class:`CandidateMaskAttention`: a learnable combination of candidate masks (a GPT-2
  distillation study's design, extended): weights ``w = sigmoid(logits)`` per layer or per
  head, combined as

  - ``"soft_mask"`` (the published form): ``A = Σ_c w_c M_c`` enters the scores as the
    log-bias ``log A`` (``-inf`` where no candidate allows the pair);
  - ``"soft_union"`` (default): ``A = 1 - Π_c (1 - w_c M_c)``, a noisy-OR. With weights
    at 0/1 it *is* the union of the kept masks, so hardening (a union mask run by the
    block-sparse kernel) reproduces the soft model exactly; ``"soft_mask"`` adds
    ``log(#kept candidates)`` where kept candidates overlap, so its hardened model differs;
  - ``"mixture"`` (DuoAttention-style): ``out = Σ_c π_c out_c`` with ``π = w / Σ w``, each
    ``out_c`` computed under candidate ``c`` alone (cost: the sum of the candidates').

  A candidate may also be data-dependent: a :class:`~sparse_jax.dynamic.BlockSelection`
  (each query token's own key block and the earlier blocks whose mean key scores highest
  against it), whose ``M_c`` is computed from the call's queries and keys, ``[B, N, T, S]``;
  its price is its entry count, which does not depend on the data. A
  :class:`~sparse_jax.block_gate.LearnedBlockSelection` ranks the blocks with a gate the layer
  holds (``selector_gates``), trained by ``aux["selector_kl"]``: the KL from the layer's own full
  causal attention per block to the gate (:meth:`~sparse_jax.block_gate.BlockGate.self_loss`).

  ``anchor_self=True`` (``soft_union``/``soft_mask``) keeps every query's own position at
  ``A = 1`` whatever the weights: under softmax, ``log A`` of small weights is ≈ ``log Σ w·M``,
  which scaling every weight by one factor only shifts by a constant, so without an anchor a
  penalty can shrink all weights together at no cost in KL; against the fixed diagonal the
  weights' absolute size matters. Hardening then adds the diagonal to each head's union
  (measured: docs/results.md, section "Why the candidate weights collapse").

  The penalties are ``aux["l1"] = Σ w``, ``aux["density"]`` and the scale-free
  ``aux["expected_density"]`` (see ``__call__``; both are priced in causal shares), and
  ``aux["expected_cost"]``, priced by the key blocks the kernel computes at a serving length
  (:meth:`CandidateMaskAttention.block_costs`). ``weighting="sparsemax"`` (or ``"entmax15"``)
  makes each head's weights a distribution over its candidates with exact zeros instead of
  independent sigmoids. The
  default combine, ``soft_union``, is the one whose hardening is exact and was chosen by
  measurement (measured: docs/results.md, section "Which way to combine the candidates").
* :class:`Gate`: one learnable gate per head or per FFN unit (``"sigmoid_ste"``,
  ``"sigmoid"``, ``"hard_concrete"``), multiplying head *outputs* or FFN activations, so that
  a closed gate removes the unit's whole contribution (what :func:`~sparse_jax.models.harden`
  deletes). ``"score_scaling"`` reproduces the CANDS code's variant, which multiplies the
  attention *scores* by ``sigmoid(z)``: that only changes each head's softmax temperature and
  prunes nothing; it is here to show the difference, never the default.

The attention layers describe themselves: :meth:`~FixedAttention.allowed_mask` (every pair the
layer may attend to), :meth:`~FixedAttention.head_masks` (each head's kept mask: for a learned
layer, the union of the candidates it keeps, see :meth:`CandidateMaskAttention.kept_candidates`),
:meth:`~FixedAttention.head_densities` / :meth:`~FixedAttention.attention_density` and
:meth:`~FixedAttention.scores_formed` (the score entries a call forms, for FLOPs). *Density* is
the fraction of the whole ``T x T`` score matrix a mask allows (full causal attention: about
1/2), as defined once in :mod:`sparse_jax.models.flops`; a fraction of the *causal* entries is
called a *causal share* (:meth:`CandidateMaskAttention.causal_shares`).

Example:
  >>> from flax import nnx
  >>> from sparse_jax.masks import causal, local, sink
  >>> attn = CandidateMaskAttention(2, [sink(4) & causal(), causal() & local(8, 0), causal()],
  ...                               rngs=nnx.Rngs(0))
  >>> q = jnp.ones((1, 16, 2, 8))  # [batch, seq, heads, head_dim]
  >>> out, aux = attn(q, q, q)
  >>> out.shape, sorted(aux)
  ((1, 16, 2, 8), ['density', 'expected_cost', 'expected_density', 'l1'])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import gates as gates_lib
from sparse_jax import masks as masks_lib
from sparse_jax.dispatch import attention, attention_impl
from sparse_jax.dynamic import BlockSelection
from sparse_jax.models.flops import (
    attention_scores,
    mask_block_cost,
    mask_density,
    selection_block_cost,
)
from sparse_jax.models.head_blocks import (
    attention_by_block_size,
    block_groups,
    check_head_block_sizes,
    formed_by_block_size,
)
from sparse_jax.models.selections import (
    block_scores,
    check_selections,
    chosen_per_row,
    entries_of,
    fixed_part,
    gathers,
    selector_gates,
    union_density_bound,
)
from sparse_jax.normalizers import entmax15, sparsemax
from sparse_jax.validation import (
    check_alpha_start,
    check_block_size,
    check_bool,
    check_choice,
    check_int,
)

__all__ = [
    "COMBINES",
    "GATE_KINDS",
    "CandidateMaskAttention",
    "FixedAttention",
    "Gate",
    "default_candidates",
    "mask_at",
]

COMBINES = ("soft_union", "soft_mask", "mixture")
#: How CandidateMaskAttention turns logits into weights.
WEIGHTINGS = ("sigmoid", "sparsemax", "entmax15", "softmax", "reviving_sparsemax")
# The weightings whose rows are distributions with exact zeros: hardened by their support.
_SPARSE_WEIGHTINGS = ("sparsemax", "entmax15", "reviving_sparsemax")
GATE_KINDS = ("sigmoid_ste", "sigmoid", "hard_concrete", "score_scaling")


def default_candidates(sink_tokens: int = 4, windows: Sequence[int] = (32, 64, 128, 256)):
    """The default candidate bank: ``sink(4)``, causal windows of 32/64/128/256 keys, the Sparse
    Transformer's ``strided(64)`` and full causal attention (all causal).

    Example:
      >>> len(default_candidates())
      7
    """
    c = masks_lib.causal()
    bank = [masks_lib.sink(sink_tokens) & c]
    bank += [c & masks_lib.local(w - 1, 0) for w in windows]
    return (*bank, masks_lib.strided(64), c)


# Each query's own position: what `anchor_self` always keeps.
SELF = masks_lib.local(0, 0)


def mask_at(
    mask: masks_lib.Mask, q_len: int, kv_len: int, q_offset: Any = None
) -> np.ndarray | jax.Array:
    """bool ``[(N,) T, S]``: ``mask`` for ``q_len`` queries against ``kv_len`` keys.

    With ``q_offset=None`` the queries are the last ``q_len`` positions and the result is a
    numpy constant (evaluated at trace time). With an int or a traced ``q_offset`` (decoding
    into a key/value cache of ``kv_len`` slots) query ``i`` is at position ``q_offset + i`` and
    keys at or after ``q_offset + q_len`` (not yet written) are excluded.

    Example:
      >>> mask_at(masks_lib.causal(), 1, 4, q_offset=jnp.int32(1)).astype(int).tolist()
      [[1, 1, 0, 0]]
    """
    if q_offset is None:
        return mask.with_offset(kv_len - q_len).dense(q_len, kv_len)
    q_pos = q_offset + jnp.arange(q_len, dtype=jnp.int32)
    kv_pos = jnp.arange(kv_len, dtype=jnp.int32)
    written = kv_pos[None, :] < q_offset + q_len
    return mask.predicate(q_pos[:, None], kv_pos[None, :]) & written


def _check_threshold(threshold: Any, caller: str) -> float:
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, numbers.Real):
        raise TypeError(
            f"{caller}: `threshold` must be a real number (a candidate weight; inf keeps only "
            f"each head's strongest); got {threshold!r}"
        )
    return float(threshold)


class FixedAttention(nnx.Module):
    """Attention under a static mask and a normalizer (the dense GPT-2 teacher is the default:
    causal softmax).

    Args:
      num_heads: ``N``.
      mask: a static :class:`~sparse_jax.masks.Mask` (default ``causal()``), per-head masks
        need ``N`` heads.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"`` or a float α >= 1 (1: softmax).
      learn_alpha: learn one α per head (α = 1 + softplus(θ), initialised at ``normalizer``'s
        α: the float itself, 2 for ``"sparsemax"``, 1.5 for ``"entmax15"``); ``normalizer``
        must then be sparse (:func:`~sparse_jax.validation.check_alpha_start`).
      impl, block_size: passed to :func:`sparse_jax.attention` (``"auto"``: the block-sparse
        kernel when the mask leaves enough out).
      selections: :class:`~sparse_jax.dynamic.BlockSelection` s whose chosen entries a head adds
        to its mask (a hardened head that kept a data-dependent candidate); such heads run the
        selection's gather engine where it is alone and cheap enough
        (:func:`~sparse_jax.models.selections.gathers`), else the XLA engine on the dense
        ``[B, N, T, S]`` mask of each call.
      selected: bool ``[N, len(selections)]``: which heads add which selection (default: all).
      head_dim: ``H``; needed only for a :class:`~sparse_jax.block_gate.LearnedBlockSelection`
        among ``selections``, whose gate (``selector_gates[str(j)]``) ranks its blocks.
      head_block_sizes: ``N`` pairs ``(block_q, block_kv)``, one per head, for calls whose
        engine (with ``block_size``) is block-sparse: each group of equal blocks runs as one
        call (:mod:`~sparse_jax.models.head_blocks`); other engines, and ``selections``, use
        ``block_size``. None: ``block_size`` for every head.

    Call: ``q [B, T, N, H]``, ``k, v [B, S, N, H]`` -> ``(out [B, T, N, H], {})``.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> attn = FixedAttention(2, mask=causal() & local(1, 0))  # 2 heads, windows of 2 keys
      >>> q = jnp.ones((1, 16, 2, 8))  # [B, T, N, H]
      >>> v = jnp.broadcast_to(jnp.arange(16.0)[None, :, None, None], q.shape)  # v = position
      >>> out, aux = attn(q, q, v)
      >>> out.shape, out[0, :4, 0, 0].tolist(), aux  # equal scores: the window's mean value
      ((1, 16, 2, 8), [0.0, 0.5, 1.5, 2.5], {})
    """

    def __init__(
        self,
        num_heads: int,
        *,
        mask: masks_lib.Mask | None = None,
        normalizer: str | float = "softmax",
        learn_alpha: bool = False,
        impl: str = "auto",
        block_size: tuple[int, int] = (128, 128),
        selections: Sequence[BlockSelection] = (),
        selected: Any = None,
        head_dim: int | None = None,
        head_block_sizes: Sequence[tuple[int, int]] | None = None,
    ):
        caller = "FixedAttention"
        self.num_heads = check_int(num_heads, "num_heads", caller)
        mask = masks_lib.causal() if mask is None else mask
        if not isinstance(mask, masks_lib.Mask) or mask.is_dynamic:
            raise TypeError(
                f"{caller}: `mask` must be a static sparse_jax.masks.Mask; got {mask!r}"
            )
        self.mask = mask
        self.impl, self.block_size = impl, tuple(block_size)
        self.head_block_sizes = check_head_block_sizes(
            head_block_sizes, self.num_heads, self.block_size, caller
        )
        self.selections, self.selected = check_selections(selections, selected, num_heads, impl)
        self.selector_gates = selector_gates(self.selections, num_heads, head_dim, caller)
        if learn_alpha:
            alpha0 = check_alpha_start(normalizer, caller)
            theta0 = math.log(math.expm1(alpha0 - 1.0))  # softplus^-1(α - 1)
            self.alpha_logit = nnx.Param(jnp.full((num_heads,), theta0, jnp.float32))
            self.normalizer = None
        else:
            self.alpha_logit = None
            self.normalizer = normalizer

    def alpha(self) -> jax.Array | None:
        """The learned α per head ``[N]``, or None."""
        if self.alpha_logit is None:
            return None
        return 1.0 + jax.nn.softplus(self.alpha_logit[...])

    def allowed_mask(self) -> masks_lib.Mask:
        """The static mask of every pair this layer may attend to: its ``mask``, and with
        ``selections`` every causal pair too (a selection may choose any earlier block).

        Example:
          >>> FixedAttention(2).allowed_mask() == masks_lib.causal()
          True
        """
        return self.mask | masks_lib.causal() if self.selections else self.mask

    def head_masks(self) -> tuple[masks_lib.Mask, ...]:
        """The ``N`` heads' masks (one entry per head; a per-head mask split up).

        Example:
          >>> two = [masks_lib.causal(), masks_lib.sink(1)]
          >>> FixedAttention(2, mask=masks_lib.per_head(two)).head_masks() == tuple(two)
          True
        """
        m = self.mask
        return tuple(m.for_head(h) if m.num_heads is not None else m for h in range(self.num_heads))

    def _with_selections(self, q, k, v, normalizer, q_offset):
        """A call of a layer with selections. On a whole sequence, the heads whose attention is
        one selection alone run its gather engine (:meth:`BlockSelection.attention`: the
        chosen blocks only) where :func:`~sparse_jax.models.selections.gathers` says so; the
        others, and every head when decoding into a cache, run the XLA engine on the dense
        mask (static mask or chosen blocks, ``[B, N, T, S]``)."""
        tq, tk = q.shape[1], k.shape[1]
        masks = self.head_masks()
        alone = self._alone(tk) if q_offset is None and tq == tk else {}
        groups = list(alone.items())  # (selection index, its heads)
        rest = [h for h in range(self.num_heads) if not any(h in g for _, g in groups)]
        if rest:
            groups.append((None, rest))

        def of_heads(x, heads):
            return x if len(heads) == self.num_heads else x[:, :, np.asarray(heads)]

        def norm_of(heads):
            if isinstance(normalizer, jax.Array) and normalizer.ndim == 1:
                return normalizer[np.asarray(heads)]
            return normalizer

        outs, order = [], []
        for j, heads in groups:
            qh, kh, vh = (of_heads(x, heads) for x in (q, k, v))
            if j is not None:
                scores = block_scores(self.selector_gates, j, qh, kh, heads=heads)
                outs.append(
                    self.selections[j].attention(
                        qh, kh, vh, normalizer=norm_of(heads), block_scores=scores
                    )
                )
            else:
                static = masks_lib.per_head([masks[h] for h in heads])
                m = jnp.asarray(mask_at(static, tq, tk, q_offset))  # [n, T, S]
                for j, s in enumerate(self.selections):
                    picks = [self.selected[h][j] for h in heads]
                    if any(picks):  # no head of the group adds it: nothing to compute
                        on = jnp.asarray(picks)[None, :, None, None]
                        scores = block_scores(
                            self.selector_gates, j, qh, kh, q_offset=q_offset, heads=heads
                        )
                        chosen = s.dense(qh, kh, q_offset=q_offset, block_scores=scores)
                        m = m | (chosen & on)
                outs.append(attention(qh, kh, vh, mask=m, normalizer=norm_of(heads), impl="xla"))
            order += heads
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
        if order == sorted(order):
            return out
        return out[:, :, np.argsort(order)]

    def _alone(self, seq_len: int) -> dict[int, list[int]]:
        """Selection index -> the heads whose attention is that selection alone (their static
        mask only their own position, which the selection's own block holds), where it runs
        its gather engine at ``seq_len`` (:func:`~sparse_jax.models.selections.gathers`)."""
        alone = {}
        for h, (row, mask) in enumerate(zip(self.selected, self.head_masks(), strict=True)):
            single = sum(row) == 1 and gathers(self.selections[row.index(True)], seq_len)
            if single and mask == SELF:
                alone.setdefault(row.index(True), []).append(h)
        return alone

    def describe(self) -> str:
        """The layer's attention in one line: its mask, and each selection with the heads that
        add it.

        Example:
          >>> from sparse_jax.dynamic import BlockSelection
          >>> attn = FixedAttention(2, mask=SELF, selections=[BlockSelection(1, block=4)],
          ...                       selected=[[True], [False]])
          >>> for part in attn.describe().split(" | "): print(part)
          Local(left=0, right=0)
          BlockSelection(keep_blocks=1, block=4, local_blocks=1) on heads [0]
        """
        parts = [repr(self.mask)]
        for j, sel in enumerate(self.selections):
            heads = [h for h, row in enumerate(self.selected) if row[j]]
            parts.append(f"{sel!r} on heads {heads}")
        return " | ".join(parts)

    def head_selections(self, head: int) -> tuple[BlockSelection, ...]:
        """The :class:`BlockSelection` s head ``head`` adds to its mask (empty for most layers).

        Example:
          >>> from sparse_jax.dynamic import BlockSelection
          >>> sel = BlockSelection(1, block=4)
          >>> attn = FixedAttention(2, selections=[sel], selected=[[True], [False]])
          >>> attn.head_selections(0) == (sel,), attn.head_selections(1)
          (True, ())
        """
        if not self.selections:
            return ()
        return tuple(s for s, on in zip(self.selections, self.selected[head], strict=True) if on)

    def head_densities(self, seq_len: int, *, threshold: float | None = None) -> jax.Array:
        """float32 ``[N]``: each head's density at ``seq_len`` (:mod:`~sparse_jax.models.flops`).

        ``threshold`` is accepted for the common interface of the attention layers and unused:
        a fixed layer keeps its whole mask.

        Example:
          >>> FixedAttention(2).head_densities(4).tolist()  # causal: 10 of 16 entries
          [0.625, 0.625]
        """
        caller = "FixedAttention.head_densities"
        seq_len = check_int(seq_len, "seq_len", caller)
        if threshold is not None:
            _check_threshold(threshold, caller)
        if self.selections:  # the selection's chosen blocks: an upper bound (see the helper)
            return jnp.asarray(
                [
                    union_density_bound(m, self.head_selections(h), seq_len)
                    for h, m in enumerate(self.head_masks())
                ],
                jnp.float32,
            )
        if self.mask.num_heads is None:
            d = np.full(self.num_heads, mask_density(self.mask, seq_len))
        else:
            d = np.array([mask_density(m, seq_len) for m in self.head_masks()])
        return jnp.asarray(d, jnp.float32)

    def attention_density(self, seq_len: int, *, threshold: float | None = None) -> jax.Array:
        """float32 scalar: the mean of :meth:`head_densities` over the heads."""
        return jnp.mean(self.head_densities(seq_len, threshold=threshold))

    def scores_formed(self, seq_len: int, *, batch: int = 1, head_dim: int) -> int:
        """Score entries one causal self-attention call on ``[batch, seq_len]`` forms, all heads
        together: the kept blocks when ``impl`` resolves (with this layer's own normalizer, as its
        calls do) to the block-sparse kernel, else all
        ``batch * N * seq_len**2`` (see :func:`~sparse_jax.models.flops.attention_scores`).

        Example:
          >>> FixedAttention(2, impl="xla").scores_formed(8, head_dim=4)
          128
        """
        if self.selections:  # gather engine: its blocks; the XLA engine: every entry
            alone = {
                h: self.selections[j] for j, heads in self._alone(seq_len).items() for h in heads
            }
            return batch * sum(
                alone[h].formed(seq_len) if h in alone else seq_len * seq_len
                for h in range(self.num_heads)
            )
        formed, _, impl = attention_scores(
            self.mask,
            seq_len,
            batch=batch,
            num_heads=self.num_heads,
            head_dim=head_dim,
            impl=self.impl,
            block_size=self.block_size,
            normalizer=self.alpha() if self.alpha_logit is not None else self.normalizer,
        )
        if impl != "blocksparse" or self.head_block_sizes is None:
            return formed
        return formed_by_block_size(self._block_groups(), seq_len, batch, head_dim)

    def head_block_size(self, head: int) -> tuple[int, int]:
        """Head ``head``'s blocks on the block-sparse engine (else ``block_size``).

        Example:
          >>> attn = FixedAttention(2, block_size=(64, 64), head_block_sizes=[(128, 128), (32, 32)])
          >>> attn.head_block_size(1)
          (32, 32)
        """
        if self.head_block_sizes is None:
            return self.block_size
        return self.head_block_sizes[head]

    def _block_groups(self) -> list:
        """:func:`~sparse_jax.models.head_blocks.block_groups` of this layer's heads."""
        return block_groups(self.head_masks(), [*map(self.head_block_size, range(self.num_heads))])

    def __call__(self, q, k, v, *, q_offset: Any = None, rngs: nnx.Rngs | None = None):
        """``q [B, T, N, H]``, ``k, v [B, S, N, H]`` -> ``(out [B, T, N, H], {})``; see
        :func:`mask_at` for ``q_offset`` (decoding into a cache)."""
        tq, tk = q.shape[1], k.shape[1]
        normalizer = self.alpha() if self.alpha_logit is not None else self.normalizer
        if self.selections:
            return self._with_selections(q, k, v, normalizer, q_offset), {}
        if q_offset is not None:  # traced position: the mask becomes an array
            m = mask_at(self.mask, tq, tk, q_offset)
            return attention(q, k, v, mask=m, normalizer=normalizer, impl="xla"), {}
        mask = self.mask.with_offset(tk - tq) if tk != tq else self.mask
        if self.head_block_sizes is not None:  # per-head blocks, if the engine is block-sparse
            how = {"normalizer": normalizer, "impl": self.impl, "block_size": self.block_size}
            if attention_impl(q, k, v, mask=mask, **how).impl == "blocksparse":
                groups = self._block_groups()
                return attention_by_block_size(q, k, v, groups, normalizer, tk - tq), {}
        out = attention(
            q, k, v, mask=mask, normalizer=normalizer, impl=self.impl, block_size=self.block_size
        )
        return out, {}


class CandidateMaskAttention(nnx.Module):
    """Attention under a learned combination of candidate masks (see the module docstring).

    Args:
      num_heads: ``N``.
      candidates: static head-agnostic masks (default :func:`default_candidates`), and any
        number of :class:`~sparse_jax.dynamic.BlockSelection` (data-dependent: chosen per
        query token from the call's queries and keys).
      granularity: ``"layer"`` (one weight per candidate, ``[C]``) or ``"head"`` (``[N, C]``).
      combine: ``"soft_union"`` (default), ``"soft_mask"`` or ``"mixture"``.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"`` or a float α.
      init_logit: initial logit of every weight (``sigmoid(3) = 0.95``: all candidates on).
      anchor_self: keep each query's own position at weight 1 (log-bias combines only).
      weighting: how logits become weights: ``"sigmoid"`` (each candidate on its own, the
        published form) or a distribution over each row of candidates, ``"sparsemax"`` or
        ``"entmax15"`` (rows sum to 1 with exact zeros: shift-invariant, so a penalty cannot
        lower all weights together, and hardening by support is exact), or ``"softmax"``
        (a distribution without zeros: no candidate ever loses its gradient; hardened at
        weight 0.5, i.e. each head's strongest), or ``"reviving_sparsemax"`` (sparsemax's
        weights with a backward pass that lets a dropped candidate return when the loss would
        gain from it: :func:`~sparse_jax.gates.reviving_sparsemax`; ``combine="mixture"``
        only, since under the log-bias combines a candidate at weight 0 masks its entries and
        the loss has no gradient for it to read).
      price_len: the length at which :meth:`block_costs` prices the candidates for the
        ``expected_cost`` penalty (a serving length); None: the call's own length.
      block_size: ``(block_q, block_kv)`` of the block-sparse kernel whose blocks are priced.
      head_dim: ``H``; needed only for a :class:`~sparse_jax.block_gate.LearnedBlockSelection`
        candidate, whose gate (``selector_gates[str(c)]``) ranks its blocks.
      rngs: unused (weights start equal); accepted for the NNX constructor convention.

    Call: ``q [B, T, N, H]``, ``k, v [B, S, N, H]`` -> ``(out [B, T, N, H], aux)``, ``aux`` a
    dict of scalar penalties.

    Example:
      >>> from sparse_jax.masks import causal, local, sink
      >>> cands = [sink(1) & causal(), causal() & local(1, 0), causal()]
      >>> attn = CandidateMaskAttention(2, cands, granularity="head")  # N = 2 heads, C = 3
      >>> attn.candidate_weights().shape  # [N, C], each sigmoid(3) = 0.95 at the start
      (2, 3)
      >>> q = jnp.ones((1, 16, 2, 8))  # [B, T, N, H]
      >>> out, aux = attn(q, q, q)
      >>> out.shape, round(float(aux["l1"]), 2)  # l1 = the sum of the 6 weights
      ((1, 16, 2, 8), 5.72)
    """

    def __init__(
        self,
        num_heads: int,
        candidates: Sequence[masks_lib.Mask] | None = None,
        *,
        granularity: Literal["layer", "head"] = "layer",
        combine: Literal["soft_union", "soft_mask", "mixture"] = "soft_union",
        normalizer: str | float = "softmax",
        init_logit: float = 3.0,
        anchor_self: bool = False,
        weighting: Literal[
            "sigmoid", "sparsemax", "entmax15", "softmax", "reviving_sparsemax"
        ] = "sigmoid",
        price_len: int | None = None,
        block_size: tuple[int, int] = (128, 128),
        head_dim: int | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        caller = "CandidateMaskAttention"
        self.weighting = check_choice(weighting, "weighting", WEIGHTINGS, caller)
        self.price_len = None if price_len is None else check_int(price_len, "price_len", caller)
        self.block_size = check_block_size(block_size, caller)
        anchor_self = check_bool(anchor_self, "anchor_self", caller)
        if anchor_self and combine == "mixture":
            raise ValueError(
                f"{caller}: `anchor_self` applies to the log-bias combines ('soft_union', "
                "'soft_mask'); `combine`='mixture' has no bias to anchor"
            )
        self.anchor_self = anchor_self
        if self.weighting == "reviving_sparsemax" and combine != "mixture":
            raise ValueError(
                f"{caller}: `weighting`='reviving_sparsemax' needs `combine`='mixture' (under "
                f"a log-bias combine a dropped candidate has no gradient to revive it); got "
                f"`combine`={combine!r}"
            )
        self.num_heads = check_int(num_heads, "num_heads", caller)
        candidates = tuple(default_candidates() if candidates is None else candidates)
        if not candidates:
            raise ValueError(f"{caller}: `candidates` must name at least one mask")
        for i, c in enumerate(candidates):
            if isinstance(c, BlockSelection):
                continue
            if not isinstance(c, masks_lib.Mask) or c.is_dynamic or c.num_heads is not None:
                raise TypeError(
                    f"{caller}: candidates[{i}] must be a static head-agnostic Mask or a "
                    f"sparse_jax.dynamic.BlockSelection; got {c!r}"
                )
        self.candidates = candidates
        self.selector_gates = selector_gates(candidates, self.num_heads, head_dim, caller)
        self.granularity = check_choice(granularity, "granularity", ("layer", "head"), caller)
        self.combine = check_choice(combine, "combine", COMBINES, caller)
        self.normalizer = normalizer
        shape = (len(candidates),) if granularity == "layer" else (num_heads, len(candidates))
        self.logits = nnx.Param(jnp.full(shape, float(init_logit), jnp.float32))

    def weights(self) -> jax.Array:
        """The weights in the parameters' shape, ``[C]`` or ``[N, C]``: ``sigmoid(logits)``, or
        each row's ``sparsemax``/``entmax15``/``softmax`` (see ``weighting``)."""
        if self.weighting == "reviving_sparsemax":
            return gates_lib.reviving_sparsemax(self.logits[...], axis=-1)
        if self.weighting == "sparsemax":
            return sparsemax(self.logits[...], axis=-1)
        if self.weighting == "entmax15":
            return entmax15(self.logits[...], axis=-1)
        if self.weighting == "softmax":
            return jax.nn.softmax(self.logits[...], axis=-1)
        return jax.nn.sigmoid(self.logits[...])

    def candidate_weights(self, *, per_head: bool = False) -> jax.Array:
        """The candidates' weights ``sigmoid(logits)`` as rows: ``[1, C]`` (granularity
        ``"layer"``) or ``[N, C]`` (``"head"``); ``per_head=True``: always ``[N, C]`` (a layer's
        row repeated for every head). Differentiable.

        Example:
          >>> layer = CandidateMaskAttention(3, [masks_lib.causal()] * 2, init_logit=0.0)
          >>> layer.candidate_weights().tolist(), layer.candidate_weights(per_head=True).shape
          ([[0.5, 0.5]], (3, 2))
        """
        per_head = check_bool(per_head, "per_head", "CandidateMaskAttention.candidate_weights")
        w = self.weights()
        if per_head:
            return jnp.broadcast_to(w, (self.num_heads, w.shape[-1]))
        return jnp.atleast_2d(w)

    def causal_shares(self, tq: int, tk: int) -> np.ndarray:
        """float64 ``[C]``: each candidate's *causal share*, the fraction of the causal
        ``tq x tk`` entries it allows (queries are the last ``tq`` positions); what the
        ``density`` and ``expected_density`` penalties price.

        Example:
          >>> layer = CandidateMaskAttention(1, [masks_lib.sink(1) & masks_lib.causal()])
          >>> layer.causal_shares(4, 4).tolist()  # 4 of the 10 causal entries
          [0.4]
        """
        n_causal = max(int(np.sum(mask_at(masks_lib.causal(), tq, tk))), 1)
        return np.array([entries_of(c, tq, tk) / n_causal for c in self.candidates])

    @property
    def selection_indices(self) -> tuple[int, ...]:
        """The indices of the data-dependent candidates (:class:`BlockSelection`) in
        ``candidates``."""
        return tuple(i for i, c in enumerate(self.candidates) if isinstance(c, BlockSelection))

    def candidate_densities(self, seq_len: int) -> np.ndarray:
        """float64 ``[C]``: each candidate's density at ``seq_len`` (its fraction of the whole
        ``seq_len x seq_len`` score matrix; see :mod:`~sparse_jax.models.flops`).

        Example:
          >>> layer = CandidateMaskAttention(1, [masks_lib.sink(1) & masks_lib.causal()])
          >>> layer.candidate_densities(4).tolist()  # 4 of the 16 entries
          [0.25]
        """
        seq_len = check_int(seq_len, "seq_len", "CandidateMaskAttention.candidate_densities")
        return np.array([
            c.entries(seq_len, seq_len) / seq_len**2
            if isinstance(c, BlockSelection)
            else mask_density(c, seq_len)
            for c in self.candidates
        ])  # fmt: skip

    def kept_candidates(self, threshold: float | None = None) -> jax.Array:
        """bool ``[N, C]``: the candidates each head keeps when its weights are made hard: those
        with weight ``>= threshold``, and always the head's strongest (the first on ties), so no
        head is empty (``threshold=inf``: the strongest alone). Default threshold: 0.5 for
        sigmoid and softmax weights; the support (weight > 0) for sparsemax, entmax15 and
        reviving_sparsemax weights. Traceable.

        Example:
          >>> layer = CandidateMaskAttention(1, [masks_lib.causal()] * 3)
          >>> layer.logits[...] = jnp.array([-1.0, -2.0, 1.0])
          >>> layer.kept_candidates().tolist(), layer.kept_candidates(0.9).tolist()
          ([[False, False, True]], [[False, False, True]])
          >>> layer.kept_candidates(0.2).astype(int).tolist()  # weights 0.27, 0.12, 0.73
          [[1, 0, 1]]
        """
        caller = "CandidateMaskAttention.kept_candidates"
        w = self.candidate_weights(per_head=True)  # [N, C]
        strongest = jnp.arange(w.shape[1]) == jnp.argmax(w, axis=1)[:, None]
        if threshold is None and self.weighting in _SPARSE_WEIGHTINGS:
            return (w > 0.0) | strongest
        threshold = _check_threshold(0.5 if threshold is None else threshold, caller)
        return (w >= threshold) | strongest

    def _union(self, kept_row) -> masks_lib.Mask:
        """The union of the candidates a head keeps (and the diagonal, when anchored); a
        selection stands for the causal pairs it may choose from."""
        chosen = [
            masks_lib.causal() if isinstance(c, BlockSelection) else c
            for c, k in zip(self.candidates, kept_row, strict=True)
            if k
        ]
        chosen += [SELF] if self.anchor_self else []
        out = chosen[0]
        for m in chosen[1:]:
            out = out | m
        return out

    def allowed_mask(self) -> masks_lib.Mask:
        """The static mask of every pair this layer may attend to: the union of all candidates
        (and the diagonal, when anchored), whatever their weights; causal when a candidate is a
        :class:`BlockSelection` (it may choose any earlier block).

        Example:
          >>> a, b = masks_lib.sink(1), masks_lib.causal() & masks_lib.local(2, 0)
          >>> CandidateMaskAttention(1, [a, b]).allowed_mask() == a | b
          True
        """
        return self._union([True] * len(self.candidates))

    def head_masks(self, kept: Any = None) -> tuple[masks_lib.Mask, ...]:
        """The ``N`` heads' hard masks: each the union of the candidates it keeps (and the
        diagonal, when anchored), what :func:`~sparse_jax.models.harden` runs.

        Args:
          kept: bool ``[N, C]``, at least one candidate per head (default
            :meth:`kept_candidates` at 0.5).

        Example:
          >>> a, b = masks_lib.sink(1), masks_lib.causal() & masks_lib.local(2, 0)
          >>> layer = CandidateMaskAttention(2, [a, b])
          >>> layer.head_masks([[True, False], [True, True]]) == (a, a | b)
          True
        """
        caller = "CandidateMaskAttention.head_masks"
        kept = self._check_kept(kept, caller)
        chosen = [h for h, row in enumerate(kept) if any(row[i] for i in self.selection_indices)]
        if chosen:
            raise ValueError(
                f"{caller}: heads {chosen} keep a BlockSelection candidate, whose entries "
                "depend on the input; ask head_parts() for each head's static mask and its "
                "selections"
            )
        return tuple(self._union(row) for row in kept)

    def _check_kept(self, kept: Any, caller: str) -> np.ndarray:
        """``kept`` (default :meth:`kept_candidates`) as a checked bool ``[N, C]`` array."""
        kept = np.asarray(self.kept_candidates() if kept is None else kept)
        shape = (self.num_heads, len(self.candidates))
        if kept.shape != shape or kept.dtype != bool or not kept.any(axis=1).all():
            raise ValueError(
                f"{caller}: `kept` must be a bool array of shape {shape} (heads, candidates) "
                f"with at least one True per head; got {kept.dtype} {kept.shape}: "
                f"{kept.tolist()!r:.200}"
            )
        return kept

    def head_parts(self, kept: Any = None) -> tuple[tuple[masks_lib.Mask, ...], np.ndarray]:
        """Each head's hard attention in two parts, what :func:`~sparse_jax.models.harden`
        builds a :class:`FixedAttention` from: the union of the *static* candidates it keeps
        (and the diagonal, when anchored, or when it keeps selections only: a selection
        always keeps each query's own block), and bool ``[N, len(selection_indices)]``, which
        of the selections it keeps (in :attr:`selection_indices` order). Without selections it
        is ``(head_masks(kept), [N, 0])``.

        Example:
          >>> from sparse_jax.dynamic import BlockSelection
          >>> window, sel = masks_lib.causal() & masks_lib.local(2, 0), BlockSelection(1, 4)
          >>> layer = CandidateMaskAttention(2, [window, sel])
          >>> masks, selected = layer.head_parts([[True, True], [False, True]])
          >>> masks == (window, SELF), selected.tolist()
          (True, [[True], [True]])
        """
        kept = self._check_kept(kept, "CandidateMaskAttention.head_parts")
        selections = list(self.selection_indices)
        static = kept.copy()
        static[:, selections] = False
        masks = tuple(self._union(row) if row.any() else SELF for row in static)
        return masks, kept[:, selections]

    def head_densities(self, seq_len: int, *, threshold: float | None = None) -> jax.Array:
        """float32 ``[N]``: each head's density at ``seq_len`` with its weights made hard, i.e.
        of its :meth:`head_masks` at ``threshold`` (see :meth:`kept_candidates`; None: its
        default). A head that keeps a :class:`BlockSelection` gets an upper bound, exact when
        the selection is all it keeps: the selection's chosen blocks are counted as if no other
        kept candidate covered them. Traceable (a training step can log it); not
        differentiable (it counts entries).

        Example:
          >>> a, b = masks_lib.sink(1) & masks_lib.causal(), masks_lib.causal()
          >>> layer = CandidateMaskAttention(2, [a, b], granularity="head")
          >>> layer.logits[...] = jnp.array([[3.0, -3.0], [-3.0, 3.0]])
          >>> layer.head_densities(4).tolist()  # sink: 4, causal: 10 of 16 entries
          [0.25, 0.625]
        """
        caller = "CandidateMaskAttention.head_densities"
        seq_len = check_int(seq_len, "seq_len", caller)
        # A selection's own local blocks are the same for every input; its chosen earlier blocks
        # are counted as if no other kept candidate covered them (an upper bound), each row at
        # most its causal entries.
        dense = np.stack([fixed_part(c, seq_len) for c in self.candidates])  # [C, T, T]
        chosen = np.stack([chosen_per_row(c, seq_len) for c in self.candidates])  # [C, T]
        kept = self.kept_candidates(threshold).astype(jnp.float32)  # [N, C]
        union = jnp.einsum("nc,cts->nts", kept, jnp.asarray(dense, jnp.float32))
        if self.anchor_self:
            union = union + jnp.asarray(mask_at(SELF, seq_len, seq_len), jnp.float32)
        rows = jnp.sum(union > 0, axis=2) + kept @ jnp.asarray(chosen, jnp.float32)  # [N, T]
        rows = jnp.minimum(rows, jnp.arange(1, seq_len + 1, dtype=jnp.float32))
        return jnp.sum(rows, axis=1) / seq_len**2

    def attention_density(self, seq_len: int, *, threshold: float | None = None) -> jax.Array:
        """float32 scalar: the mean of :meth:`head_densities` over the heads."""
        return jnp.mean(self.head_densities(seq_len, threshold=threshold))

    def scores_formed(self, seq_len: int, *, batch: int = 1, head_dim: int) -> int:
        """Score entries one causal self-attention call on ``[batch, seq_len]`` forms, all heads
        together: ``batch * N * seq_len**2`` for the log-bias combines (dense scores with a
        bias), the sum over candidates of each one's attention for ``"mixture"``.

        Example:
          >>> CandidateMaskAttention(2, [masks_lib.causal()] * 3).scores_formed(8, head_dim=4)
          128
        """
        if self.combine == "mixture":
            return sum(
                batch * self.num_heads * (c.formed(seq_len) if gathers(c, seq_len) else seq_len**2)
                if isinstance(c, BlockSelection)
                else attention_scores(
                    c,
                    seq_len,
                    batch=batch,
                    num_heads=self.num_heads,
                    head_dim=head_dim,
                    normalizer=self.normalizer,
                )[0]
                for c in self.candidates
            )
        return batch * self.num_heads * seq_len * seq_len

    def block_costs(self, seq_len: int | None = None) -> np.ndarray:
        """float64 ``[C]``: the key blocks the block-sparse kernel computes for each candidate
        at ``seq_len`` (default ``price_len``) with this layer's ``block_size``, relative to
        full causal attention's (row groups included, as
        :func:`~sparse_jax.blocksparse.blocksparse_cost` counts them): what serving a head
        under that candidate costs. A pattern that touches every block (a strided mask whose
        stride is below the block size) costs what causal costs, whatever its density.

        Example:
          >>> from sparse_jax import masks
          >>> layer = CandidateMaskAttention(1, [masks.causal() & masks.local(127, 0),
          ...                                    masks.strided(64), masks.causal()])
          >>> layer.block_costs(2048).round(3).tolist()  # window: 2 key blocks per query block
          [0.213, 1.0, 1.0]
        """
        caller = "CandidateMaskAttention.block_costs"
        n = self.price_len if seq_len is None else check_int(seq_len, "seq_len", caller)
        if n is None:
            raise ValueError(f"{caller}: pass `seq_len` (the layer has no `price_len`)")
        return np.array([
            selection_block_cost(c, n, self.block_size)
            if isinstance(c, BlockSelection)
            else mask_block_cost(c, n, self.block_size)
            for c in self.candidates
        ])  # fmt: skip

    def _penalties(self, tq: int, tk: int) -> dict[str, jax.Array]:
        """The penalties of ``__call__``'s ``aux`` (shares and costs computed once)."""
        shares = jnp.asarray(self.causal_shares(tq, tk), jnp.float32)  # [C]
        costs = jnp.asarray(self.block_costs(self.price_len or tk), jnp.float32)  # [C]
        w = self.candidate_weights(per_head=True)  # [N, C]
        pi = w / jnp.sum(w, axis=-1, keepdims=True)
        return {
            "l1": jnp.sum(self.weights()),
            "density": jnp.sum(self.weights() * shares),
            "expected_density": jnp.mean(pi @ shares),
            "expected_cost": jnp.mean(pi @ costs),
        }

    def __call__(self, q, k, v, *, q_offset: Any = None, rngs: nnx.Rngs | None = None):
        """``q [B, T, N, H]``, ``k, v [B, S, N, H]`` -> ``(out [B, T, N, H], aux)``; see
        :func:`mask_at` for ``q_offset``.

        ``aux`` holds three penalties on the weights (a model sums them over blocks as
        ``mask_l1``, ``mask_density`` and ``mask_expected_density``): ``"l1"`` = ``Σ w``,
        ``"density"`` = ``Σ w_c · share_c``, where ``share_c`` is candidate ``c``'s causal
        share at this length (:meth:`causal_shares`: full causal 1, a 32-token window at T=512
        about 0.12), and ``"expected_density"`` = the mean over heads of ``Σ_c π_c · share_c``
        with ``π = w / Σ w``: the causal share a head would have if it picked one candidate
        with probability ``π``, in ``[0, 1]``. (The names are the penalties'; the prices are
        causal shares, not densities.) ``"expected_cost"`` is the same expectation priced by
        the kernel's blocks at the serving length, :meth:`block_costs` (causal = 1). A layer
        with learned selections adds ``"selector_kl"`` on whole sequences: the sum over its
        gates of :meth:`~sparse_jax.block_gate.BlockGate.self_loss` (the KL from this layer's
        own causal attention per block to the gate; its gradient reaches the gates only).

        Under softmax the log-bias of small weights changes only by a constant when every
        weight is scaled by one factor, so the first two can be lowered by shrinking all
        weights together at almost no cost in KL (measured: docs/results.md, section "A
        penalty that only the weights' ratios can lower"). ``expected_density`` depends only
        on the weights' ratios: it falls only when cheap candidates gain on expensive ones,
        which is what the KL can weigh.
        """
        tq, tk = q.shape[1], k.shape[1]
        w = self.candidate_weights(per_head=True)  # [N, C]
        aux = self._penalties(tq, tk)
        if self.selector_gates is not None and q_offset is None and tq == tk:
            aux["selector_kl"] = sum(
                gate.self_loss(q, k, normalizer=self.normalizer)
                for gate in self.selector_gates.values()
            )

        def scores_of(i):  # a learned selection's block scores (None: the pooled score)
            return block_scores(self.selector_gates, i, q, k, q_offset=q_offset)

        if self.combine == "mixture":
            outs = []
            for i, c in enumerate(self.candidates):
                whole = q_offset is None and tq == tk
                if isinstance(c, BlockSelection) and whole and gathers(c, tk):
                    outs.append(
                        c.attention(q, k, v, normalizer=self.normalizer, block_scores=scores_of(i))
                    )
                    continue
                if isinstance(c, BlockSelection):
                    m = c.dense(q, k, q_offset=q_offset, block_scores=scores_of(i))
                elif q_offset is not None:
                    m = mask_at(c, tq, tk, q_offset)
                else:
                    m = c.with_offset(tk - tq) if tk != tq else c
                outs.append(attention(q, k, v, mask=m, normalizer=self.normalizer))
            pi = w / jnp.sum(w, axis=-1, keepdims=True)  # [N, C]
            out = sum(o * pi[None, None, :, c, None].astype(o.dtype) for c, o in enumerate(outs))
            return out, aux
        # The noisy-OR as a sum of logs: log Π_c (1 - w_c M_c) = Σ_c M_c log(1 - w_c); the
        # static masks in one contraction ([C, T, S]), each selection's [B, N, T, S] added.
        terms = w if self.combine == "soft_mask" else jnp.log1p(-w * (1 - 1e-7))  # [N, C]
        chosen = self.selection_indices
        static = [i for i in range(len(self.candidates)) if i not in chosen]
        total = jnp.zeros((1, self.num_heads, tq, tk), jnp.float32)
        allowed = jnp.zeros((1, 1, tq, tk), bool)
        if static:
            xp = np if q_offset is None else jnp
            dense = xp.stack([mask_at(self.candidates[i], tq, tk, q_offset) for i in static])
            m = jnp.asarray(dense, jnp.float32)  # [C_static, T, S]
            total = jnp.einsum("nc,cts->nts", terms[:, static], m)[None]
            allowed = jnp.asarray(dense.any(axis=0))[None, None]
        for i in chosen:
            m = self.candidates[i].dense(q, k, q_offset=q_offset, block_scores=scores_of(i))
            total = total + terms[None, :, i, None, None] * m.astype(jnp.float32)
            allowed = allowed | m
        a = total if self.combine == "soft_mask" else 1.0 - jnp.exp(total)  # [B or 1, N, T, S]
        if self.anchor_self:
            own = mask_at(SELF, tq, tk, q_offset)
            a = jnp.where(own, 1.0, a)
            allowed = allowed | own
        # An entry whose candidates all have weight exactly 0 (sparsemax/entmax15 weights, or a
        # sigmoid that underflowed) is masked by a -inf bias, with a zero gradient rather than
        # log's infinite one (which made the whole gradient NaN).
        open_ = allowed & (a > 0.0)
        bias = jnp.where(open_, jnp.log(jnp.where(open_, a, 1.0)), -jnp.inf)  # [B or 1,N,T,S]
        out = attention(
            q, k, v, mask=allowed, bias=bias.astype(jnp.float32), normalizer=self.normalizer
        )
        return out, aux


class Gate(nnx.Module):
    """One learnable gate per unit (head or FFN unit): ``x * gate`` on the last axis.

    Args:
      num_units: number of gated units (``N`` heads or ``U`` FFN units).
      kind: ``"sigmoid_ste"`` (hard 0/1 forward, sigmoid backward; penalty ``Σ sigmoid(z)``),
        ``"sigmoid"`` (soft ``sigmoid(z)``; same penalty), ``"hard_concrete"`` (L0 gates,
        sampled when ``rngs`` is given to ``__call__``, deterministic otherwise; penalty the
        expected L0 ``Σ P(gate != 0)``), or ``"score_scaling"`` (the CANDS code's variant,
        applied by the attention layer to the queries, i.e. to the scores: a temperature).
      init: initial logit / log α (``3.0``: open gates, ``sigmoid(3) = 0.95``).

    Call: ``x [..., units]`` -> ``x * gate`` of the same shape.

    Example:
      >>> gate = Gate(3)  # "sigmoid_ste": hard 0/1 forward
      >>> gate.logits[...] = jnp.array([3.0, -1.0, 2.0])
      >>> gate(jnp.ones((2, 3))).tolist()  # [..., units]: unit 1 is closed
      [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]
      >>> gate.hard_values().tolist(), round(float(gate.penalty()), 3)  # Σ sigmoid(z)
      ([1.0, 0.0, 1.0], 2.102)
    """

    def __init__(self, num_units: int, kind: str = "sigmoid_ste", *, init: float = 3.0):
        caller = "Gate"
        check_int(num_units, "num_units", caller)
        self.kind = check_choice(kind, "kind", GATE_KINDS, caller)
        self.logits = nnx.Param(jnp.full((num_units,), float(init), jnp.float32))

    def values(self, rngs: nnx.Rngs | None = None) -> jax.Array:
        """Gate values ``[units]`` (sampled for Hard Concrete when ``rngs`` is given)."""
        z = self.logits[...]
        if self.kind == "hard_concrete":
            return gates_lib.hard_concrete(z, None if rngs is None else rngs.gates())
        return gates_lib.sigmoid_gate(z, straight_through=self.kind == "sigmoid_ste")

    def hard_values(self) -> jax.Array:
        """The gates a hardened model keeps: 1.0 where open, 0.0 where closed (bool-valued)."""
        z = self.logits[...]
        if self.kind == "hard_concrete":
            return (gates_lib.hard_concrete(z) > 0).astype(jnp.float32)
        return (z > 0).astype(jnp.float32)

    def penalty(self) -> jax.Array:
        """Scalar sparsity penalty: ``Σ sigmoid(z)`` or the expected L0 ``Σ P(gate != 0)``."""
        if self.kind == "hard_concrete":
            return gates_lib.l0_penalty(self.logits[...])
        return gates_lib.l1_penalty(self.logits[...], from_logits=True)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        return x * self.values(rngs).astype(x.dtype)
