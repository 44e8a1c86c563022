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

  ``anchor_self=True`` (``soft_union``/``soft_mask``) keeps every query's own position at
  ``A = 1`` whatever the weights: under softmax, ``log A`` of small weights is ≈ ``log Σ w·M``,
  which scaling every weight by one factor only shifts by a constant, so without an anchor a
  penalty can shrink all weights together at no cost in KL; against the fixed diagonal the
  weights' absolute size matters. Hardening then adds the diagonal to each head's union.
  (In the distillation runs of docs/results.md this alone did not keep the weights apart;
  the evidence there points at Adam's step size setting how far every logit fell.)

  The penalties are ``aux["l1"] = Σ w``, ``aux["density"]`` and the scale-free
  ``aux["expected_density"]`` (see ``__call__``). The
  default combine is decided by measurement (``python -m experiments.distill --combine ...``,
  docs/results.md): on the embedded default, ``soft_union`` ended with KL 0.023 nats/token
  after hardening against 0.032 (``soft_mask``) and 0.030 (``mixture``, whose run also took
  1.35x longer), at ~25-30% attention density, and it is the one whose hardening is exact.
* :class:`Gate`: one learnable gate per head or per FFN unit (``"sigmoid_ste"``,
  ``"sigmoid"``, ``"hard_concrete"``), multiplying head *outputs* or FFN activations, so that
  a closed gate removes the unit's whole contribution (what :func:`~sparse_jax.models.harden`
  deletes). ``"score_scaling"`` reproduces the CANDS code's variant, which multiplies the
  attention *scores* by ``sigmoid(z)``: that only changes each head's softmax temperature and
  prunes nothing; it is here to show the difference, never the default.

Example:
  >>> from flax import nnx
  >>> from sparse_jax.masks import causal, local, sink
  >>> attn = CandidateMaskAttention(2, [sink(4) & causal(), causal() & local(8, 0), causal()],
  ...                               rngs=nnx.Rngs(0))
  >>> q = jnp.ones((1, 16, 2, 8))  # [batch, seq, heads, head_dim]
  >>> out, aux = attn(q, q, q)
  >>> out.shape, sorted(aux)
  ((1, 16, 2, 8), ['density', 'expected_density', 'l1'])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import gates as gates_lib
from sparse_jax import masks as masks_lib
from sparse_jax.dispatch import attention

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


def _check_heads(num_heads: Any, caller: str) -> int:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{caller}: `num_heads` must be an int >= 1; got {num_heads!r}")
    return num_heads


def _check_choice(value: Any, name: str, allowed: Sequence[str], caller: str) -> str:
    if value not in allowed:
        raise ValueError(f"{caller}: unknown `{name}`={value!r}; allowed: {list(allowed)}")
    return value


class FixedAttention(nnx.Module):
    """Attention under a static mask and a normalizer (the dense GPT-2 teacher is the default:
    causal softmax).

    Args:
      num_heads: ``N``.
      mask: a static :class:`~sparse_jax.masks.Mask` (default ``causal()``), per-head masks
        need ``N`` heads.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"`` or a float α > 1.
      learn_alpha: learn one α per head (α = 1 + softplus(θ), initialised at ``normalizer``
        when it is a float, else 1.5); ``normalizer`` must then be a float or ``"entmax15"``.
      impl, block_size: passed to :func:`sparse_jax.attention` (``"auto"``: the block-sparse
        kernel when the mask leaves enough out).
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
    ):
        caller = "FixedAttention"
        self.num_heads = _check_heads(num_heads, caller)
        mask = masks_lib.causal() if mask is None else mask
        if not isinstance(mask, masks_lib.Mask) or mask.is_dynamic:
            raise TypeError(
                f"{caller}: `mask` must be a static sparse_jax.masks.Mask; got {mask!r}"
            )
        self.mask = mask
        self.impl, self.block_size = impl, tuple(block_size)
        if learn_alpha:
            if normalizer not in ("entmax15",) and not isinstance(normalizer, float):
                raise ValueError(
                    f"{caller}: `learn_alpha` needs `normalizer` to be a float α > 1 or "
                    f"'entmax15' (the initial α); got {normalizer!r}"
                )
            alpha0 = 1.5 if normalizer == "entmax15" else float(normalizer)
            if not alpha0 > 1:
                raise ValueError(f"{caller}: the initial α must be > 1; got {alpha0}")
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

    def __call__(self, q, k, v, *, q_offset: Any = None, rngs: nnx.Rngs | None = None):
        """``q [B, T, N, H]``, ``k, v [B, S, N, H]`` -> ``(out [B, T, N, H], {})``; see
        :func:`mask_at` for ``q_offset`` (decoding into a cache)."""
        tq, tk = q.shape[1], k.shape[1]
        normalizer = self.alpha() if self.alpha_logit is not None else self.normalizer
        if q_offset is not None:  # traced position: the mask becomes an array
            m = mask_at(self.mask, tq, tk, q_offset)
            return attention(q, k, v, mask=m, normalizer=normalizer, impl="xla"), {}
        mask = self.mask.with_offset(tk - tq) if tk != tq else self.mask
        out = attention(
            q, k, v, mask=mask, normalizer=normalizer, impl=self.impl, block_size=self.block_size
        )
        return out, {}


class CandidateMaskAttention(nnx.Module):
    """Attention under a learned combination of candidate masks (see the module docstring).

    Args:
      num_heads: ``N``.
      candidates: static masks (default :func:`default_candidates`); head-agnostic.
      granularity: ``"layer"`` (one weight per candidate, ``[C]``) or ``"head"`` (``[N, C]``).
      combine: ``"soft_union"`` (default), ``"soft_mask"`` or ``"mixture"``.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"`` or a float α.
      init_logit: initial logit of every weight (``sigmoid(3) = 0.95``: all candidates on).
      anchor_self: keep each query's own position at weight 1 (log-bias combines only).
      rngs: unused (weights start equal); accepted for the NNX constructor convention.
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
        rngs: nnx.Rngs | None = None,
    ):
        caller = "CandidateMaskAttention"
        if not isinstance(anchor_self, bool):
            raise TypeError(f"{caller}: `anchor_self` must be a bool; got {anchor_self!r}")
        if anchor_self and combine == "mixture":
            raise ValueError(
                f"{caller}: `anchor_self` applies to the log-bias combines ('soft_union', "
                "'soft_mask'); `combine`='mixture' has no bias to anchor"
            )
        self.anchor_self = anchor_self
        self.num_heads = _check_heads(num_heads, caller)
        candidates = tuple(default_candidates() if candidates is None else candidates)
        if not candidates:
            raise ValueError(f"{caller}: `candidates` must name at least one mask")
        for i, c in enumerate(candidates):
            if not isinstance(c, masks_lib.Mask) or c.is_dynamic or c.num_heads is not None:
                raise TypeError(
                    f"{caller}: candidates[{i}] must be a static head-agnostic Mask; got {c!r}"
                )
        self.candidates = candidates
        self.granularity = _check_choice(granularity, "granularity", ("layer", "head"), caller)
        self.combine = _check_choice(combine, "combine", COMBINES, caller)
        self.normalizer = normalizer
        shape = (len(candidates),) if granularity == "layer" else (num_heads, len(candidates))
        self.logits = nnx.Param(jnp.full(shape, float(init_logit), jnp.float32))

    def weights(self) -> jax.Array:
        """``sigmoid(logits)``: ``[C]`` or ``[N, C]``."""
        return jax.nn.sigmoid(self.logits[...])

    def candidate_shares(self, tq: int, tk: int) -> np.ndarray:
        """``[C]``: the fraction of the causal ``tq x tk`` entries each candidate allows."""
        n_causal = max(int(np.sum(mask_at(masks_lib.causal(), tq, tk))), 1)
        return np.array([np.sum(mask_at(c, tq, tk)) / n_causal for c in self.candidates])

    def _penalties(self, tq: int, tk: int) -> dict[str, jax.Array]:
        """The three penalties of ``__call__``'s ``aux`` (the shares computed once)."""
        shares = jnp.asarray(self.candidate_shares(tq, tk), jnp.float32)  # [C]
        w = self._per_head_weights()  # [N, C]
        pi = w / jnp.sum(w, axis=-1, keepdims=True)
        return {
            "l1": jnp.sum(self.weights()),
            "density": jnp.sum(self.weights() * shares),
            "expected_density": jnp.mean(pi @ shares),
        }

    def _per_head_weights(self) -> jax.Array:
        w = self.weights()
        return jnp.broadcast_to(w, (self.num_heads, w.shape[-1]))

    def __call__(self, q, k, v, *, q_offset: Any = None, rngs: nnx.Rngs | None = None):
        """``q [B, T, N, H]``, ``k, v [B, S, N, H]`` -> ``(out [B, T, N, H], aux)``; see
        :func:`mask_at` for ``q_offset``.

        ``aux`` holds three penalties on the weights (a model sums them over blocks as
        ``mask_l1``, ``mask_density`` and ``mask_expected_density``): ``"l1"`` = ``Σ w``,
        ``"density"`` = ``Σ w_c · share_c``, where ``share_c`` is the fraction of the causal
        score entries candidate ``c`` allows at this length (full causal 1, a 32-token window
        at T=512 about 0.12), and ``"expected_density"`` = the mean over heads of
        ``Σ_c π_c · share_c`` with ``π = w / Σ w``: the density a head would have if it picked
        one candidate with probability ``π``, in ``[0, 1]``.

        Under softmax the log-bias of small weights changes only by a constant when every
        weight is scaled by one factor, so the first two can be lowered by shrinking all
        weights together at almost no cost in KL (and Adam, whose steps do not depend on the
        gradient's size, then moves every logit down alike). ``expected_density`` depends only
        on the weights' ratios: it falls only when cheap candidates gain on expensive ones,
        which is what the KL can weigh.
        """
        tq, tk = q.shape[1], k.shape[1]
        w = self._per_head_weights()  # [N, C]
        aux = self._penalties(tq, tk)
        if self.combine == "mixture":
            outs = []
            for c in self.candidates:
                if q_offset is not None:
                    m = mask_at(c, tq, tk, q_offset)
                else:
                    m = c.with_offset(tk - tq) if tk != tq else c
                outs.append(attention(q, k, v, mask=m, normalizer=self.normalizer))
            pi = w / jnp.sum(w, axis=-1, keepdims=True)  # [N, C]
            out = sum(o * pi[None, None, :, c, None].astype(o.dtype) for c, o in enumerate(outs))
            return out, aux
        xp = np if q_offset is None else jnp
        dense = xp.stack([mask_at(c, tq, tk, q_offset) for c in self.candidates])  # [C, T, S]
        m = jnp.asarray(dense, jnp.float32)
        if self.combine == "soft_mask":
            a = jnp.einsum("nc,cts->nts", w, m)
        else:
            a = 1.0 - jnp.exp(jnp.einsum("nc,cts->nts", jnp.log1p(-w * (1 - 1e-7)), m))
        allowed = dense.any(axis=0)  # [T, S]: the union of the candidates
        if self.anchor_self:
            own = mask_at(SELF, tq, tk, q_offset)
            a = jnp.where(own, 1.0, a)
            allowed = allowed | own
        allowed = jnp.asarray(allowed)
        bias = jnp.log(jnp.where(allowed, a, 1.0))[None]  # [1, N, T, S]
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
    """

    def __init__(self, num_units: int, kind: str = "sigmoid_ste", *, init: float = 3.0):
        caller = "Gate"
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"{caller}: `num_units` must be an int >= 1; got {num_units!r}")
        self.kind = _check_choice(kind, "kind", GATE_KINDS, caller)
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
