"""Cascade attention with differentiable sparsity (CANDS), built so that what it prunes is not
computed: a GPT-2-shaped causal LM whose later blocks see fewer heads, FFN units and tokens.

Shapes: ``B`` batch, ``T`` tokens, ``D`` width, ``N`` heads, ``H`` head dim, ``U`` FFN units.

Block 1 is dense. Each later block ``l`` has

* a gate per head and per FFN unit (:class:`~sparse_jax.models.layers.Gate`: Hard Concrete L0
  gates by default, or the published sigmoid with a straight-through estimator), multiplying the
  head's output and the unit's activation, so a closed gate removes the unit's whole work;
* a gate per *token*, computed from that token's own hidden state (a linear map of the block's
  layer-normalised input to one logit: causal, no look-ahead), *nested*: the token's keep value
  in block ``l`` is the product of its gates in blocks ``2..l``, so a token closed in block
  ``l`` stays closed in every later block. A closed token passes through the block untouched
  (the block's update is multiplied by the keep value) and is **not** a key or value there:
  kept tokens attend only to kept tokens (as SpAtten and Mixture-of-Depths drop them). That is
  what lets the pruned model run each block on the kept tokens alone, gathered into a shorter
  sequence, and compute exactly what the gated model computes; keeping closed tokens as keys
  would leave every block's keys and values (and the projections that make them) at full
  length, saving a fraction of the attention only.

Training samples the gates (Hard Concrete, ``rngs`` given) or uses the straight-through
sigmoid; evaluation (``rngs=None``) uses *hard* gates: a head, unit or token is kept when its
logit is > 0 (for Hard Concrete: when the test-time gate is above 1/2, i.e. ``P(gate > 1/2) >
1/2``). With hard gates the model equals :meth:`CascadeLM.prune`'s model (a test).

The sparsity targets: ``keep_ratios`` ``r_1 = 1 >= r_2 >= ...``, the expected kept fraction of
tokens in each block (and, unless given separately, of heads and units), enforced with CoFi's
Lagrangian (:func:`sparse_jax.gates.lagrangian_sparsity`, multipliers trained by gradient ascent
through a gradient-reversing identity, so one minimising optimizer trains everything), or the
published penalty ``λ Σ sigmoid(z)`` (``penalty="l1"``). ``score_scaling=True`` is the CANDS
code's module instead: heads multiply the attention *scores* by ``sigmoid(z)`` (a temperature),
no token or unit gates: it prunes nothing, and is here to show that.

Example:
  >>> from flax import nnx
  >>> cfg = CascadeConfig(GPT2Config.preset("tiny"), keep_ratios=(1.0, 0.5))
  >>> model = CascadeLM(cfg, rngs=nnx.Rngs(0))
  >>> ids = jnp.zeros((2, 8), jnp.int32)
  >>> logits, aux = model(ids, return_aux=True)
  >>> logits.shape, sorted(aux)[:2]
  ((2, 8, 101), ['expected_keep', 'kept_tokens'])
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import gates as gates_lib
from sparse_jax.dispatch import attention
from sparse_jax.models.gpt2 import GPT2Config, _activation, _linear
from sparse_jax.models.layers import Gate
from sparse_jax.validation import check_int

__all__ = ["CascadeConfig", "CascadeLM", "PrunedCascadeLM", "capacity_for", "cascade_flops"]

GATES = ("hard_concrete", "sigmoid_ste")
PENALTIES = ("lagrangian", "l1")


@jax.custom_vjp
def _ascend(x):
    """Identity whose gradient is negated: a parameter behind it is trained by ascent."""
    return x


_ascend.defvjp(lambda x: (x, None), lambda _, g: (-g,))


def _ratios(value, name: str, n_layer: int, caller: str) -> tuple[float, ...]:
    ratios = tuple(float(r) for r in value)
    if len(ratios) != n_layer:
        raise ValueError(
            f"{caller}: `{name}` needs one ratio per block ({n_layer}); got {len(ratios)}: "
            f"{list(ratios)}"
        )
    if not all(0 < r <= 1 for r in ratios):
        raise ValueError(f"{caller}: `{name}` must lie in (0, 1]; got {list(ratios)}")
    if ratios[0] != 1.0:
        raise ValueError(f"{caller}: `{name}` starts at 1 (block 1 is dense); got {ratios[0]}")
    if any(b > a for a, b in itertools.pairwise(ratios)):
        raise ValueError(f"{caller}: `{name}` must not increase; got {list(ratios)}")
    return ratios


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """Sizes, gates and targets of :class:`CascadeLM`."""

    gpt2: GPT2Config  # sizes (a dense GPT2 of this config is the baseline)
    keep_ratios: tuple[float, ...] | None = None  # token keep target per block (None: 1 -> 1/2)
    head_keep: tuple[float, ...] | None = None  # head keep targets (None: keep_ratios)
    unit_keep: tuple[float, ...] | None = None  # FFN unit keep targets (None: keep_ratios)
    gate: Literal["hard_concrete", "sigmoid_ste"] = "hard_concrete"  # every gate's kind
    penalty: Literal["lagrangian", "l1"] = "lagrangian"  # how the targets are pursued
    l1_weight: float = 0.01  # penalty "l1": λ of λ Σ sigmoid(z) (mean per gate family)
    gate_init: float = 3.0  # initial gate logit (open: sigmoid(3) = 0.95)
    score_scaling: bool = False  # the CANDS code's variant: head gates scale scores only

    def __post_init__(self):
        caller = "CascadeConfig"
        if not isinstance(self.gpt2, GPT2Config):
            raise TypeError(f"{caller}: `gpt2` must be a GPT2Config; got {self.gpt2!r:.80}")
        n = self.gpt2.n_layer
        if self.keep_ratios is None:  # linear from 1 to 1/2
            default = tuple(1.0 - 0.5 * i / max(n - 1, 1) for i in range(n))
            object.__setattr__(self, "keep_ratios", default)
        object.__setattr__(self, "keep_ratios", _ratios(self.keep_ratios, "keep_ratios", n, caller))
        for name in ("head_keep", "unit_keep"):
            value = getattr(self, name)
            value = self.keep_ratios if value is None else _ratios(value, name, n, caller)
            object.__setattr__(self, name, value)
        if self.gate not in GATES:
            raise ValueError(f"{caller}: unknown `gate`={self.gate!r}; allowed: {list(GATES)}")
        if self.penalty not in PENALTIES:
            raise ValueError(
                f"{caller}: unknown `penalty`={self.penalty!r}; allowed: {list(PENALTIES)}"
            )
        if not (math.isfinite(self.l1_weight) and self.l1_weight >= 0):
            raise ValueError(f"{caller}: `l1_weight` must be a number >= 0; got {self.l1_weight}")
        if self.gpt2.heads_per_layer is not None or self.gpt2.inner_per_layer is not None:
            raise ValueError(
                f"{caller}: `gpt2` must have every head and unit (heads_per_layer and "
                "inner_per_layer None): the cascade prunes them itself"
            )


def _dense_causal(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), bool))


class CascadeBlock(nnx.Module):
    """One pre-LayerNorm block with optional head, unit and token gates."""

    def __init__(self, config: CascadeConfig, layer: int, rngs: nnx.Rngs):
        g = config.gpt2
        d, n, h, u = g.n_embd, g.n_head, g.head_dim, g.inner(layer)
        self.num_heads, self.head_dim, self.units = n, h, u
        std_proj = 0.02 / math.sqrt(2 * g.n_layer)
        self.ln_1 = nnx.LayerNorm(d, epsilon=g.layer_norm_epsilon, rngs=rngs)
        self.c_attn = _linear(d, 3 * n * h, rngs)
        self.c_proj = _linear(n * h, d, rngs, std_proj)
        self.ln_2 = nnx.LayerNorm(d, epsilon=g.layer_norm_epsilon, rngs=rngs)
        self.c_fc = _linear(d, u, rngs)
        self.mlp_proj = _linear(u, d, rngs, std_proj)
        self.act = _activation(g.activation_function)
        gated = layer > 0
        self.score_scaling = gated and config.score_scaling
        kind = "score_scaling" if self.score_scaling else config.gate
        self.head_gate = Gate(n, kind, init=config.gate_init) if gated else None
        pruning = gated and not config.score_scaling
        self.unit_gate = Gate(u, config.gate, init=config.gate_init) if pruning else None
        # The token gate: one logit from the token's own normalised hidden state (open at
        # first: weight 0, bias gate_init).
        self.router = (
            nnx.Linear(d, 1, kernel_init=nnx.initializers.zeros, rngs=rngs, param_dtype=jnp.float32)
            if pruning
            else None
        )
        if pruning:
            self.router.bias[...] = jnp.full((1,), config.gate_init, jnp.float32)
        self.kind = config.gate

    # -- gates ---------------------------------------------------------------------------------

    def token_logits(self, x: jax.Array) -> jax.Array:
        """``[B, T]``: the token gates' logits (log α for Hard Concrete) from ``x [B, T, D]``."""
        return self.router(self.ln_1(x))[..., 0].astype(jnp.float32)

    def _gate(self, logits, rngs, *, unit: bool):
        """Training: sampled (Hard Concrete) or straight-through values; else hard 0/1."""
        if rngs is None:
            return (logits > 0).astype(jnp.float32)
        if self.kind == "hard_concrete":
            return gates_lib.hard_concrete(logits, rngs.gates())
        return gates_lib.sigmoid_gate(logits, straight_through=True)

    def _p_open(self, logits):
        """What the expected keep ratios count: ``sigmoid(z)``, for Hard Concrete gates the
        probability that a sampled gate is above 1/2 (``P(L + z > 0)``, ``L`` logistic noise),
        for the straight-through sigmoid its value. The hard gate (``z > 0``) keeps a unit
        exactly when this is above 1/2, so the targets bound what the pruned model keeps
        (Hard Concrete's ``P(gate != 0)``, the L0 expectation, is ``sigmoid(z + 1.6)``: driven
        to a target it would leave the hard gates closed)."""
        return jax.nn.sigmoid(logits)

    # -- forward -------------------------------------------------------------------------------

    def __call__(self, x, keep, rngs=None):
        """``x [B, T, D]``, ``keep [B, T]`` (the tokens' keep values so far) -> ``(x, keep,
        aux)``; ``aux`` holds this block's expected keep ratios (tokens, heads, units)."""
        b, t, _ = x.shape
        aux = {}
        if self.router is not None:
            logits = self.token_logits(x)
            keep = keep * self._gate(logits, rngs, unit=False)
            aux["p_tokens"] = self._p_open(logits)  # [B, T]
        kept = keep > 0
        n, hd = self.num_heads, self.head_dim
        qkv = self.c_attn(self.ln_1(x)).reshape(b, t, 3, n, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.score_scaling:
            q = q * self.head_gate.values().astype(q.dtype)[None, None, :, None]
        mask = _dense_causal(t)[None, None] & kept[:, None, None, :]  # kept keys only
        out = attention(q, k, v, mask=mask)
        if self.head_gate is not None and not self.score_scaling:
            z = self.head_gate.logits[...]
            out = out * self._gate(z, rngs, unit=True).astype(out.dtype)[None, None, :, None]
            aux["p_heads"] = self._p_open(z)
        scale = keep[..., None].astype(x.dtype)
        x = x + scale * self.c_proj(out.reshape(b, t, n * hd))
        hidden = self.act(self.c_fc(self.ln_2(x)))
        if self.unit_gate is not None:
            z = self.unit_gate.logits[...]
            hidden = hidden * self._gate(z, rngs, unit=True).astype(hidden.dtype)
            aux["p_units"] = self._p_open(z)
        return x + scale * self.mlp_proj(hidden), keep, aux

    def hard_heads(self) -> np.ndarray:
        """Indices of the heads a hard gate keeps (all without gates or with score scaling)."""
        if self.head_gate is None or self.score_scaling:
            return np.arange(self.num_heads)
        return np.flatnonzero(np.asarray(self.head_gate.logits[...]) > 0)

    def hard_units(self) -> np.ndarray:
        """Indices of the FFN units a hard gate keeps."""
        if self.unit_gate is None:
            return np.arange(self.units)
        return np.flatnonzero(np.asarray(self.unit_gate.logits[...]) > 0)


class CascadeLM(nnx.Module):
    """The CANDS language model (see the module docstring).

    Call: ``model(ids [B, T], *, rngs=None, return_aux=False)`` -> logits ``[B, T, V]``, or
    ``(logits, aux)``: ``aux["kept_tokens"]`` ``[L, B, T]`` (1 where a token is kept in a block,
    hard gates only; fractional when sampled), ``aux["expected_keep"]`` ``[L, 3]`` (expected
    kept fraction of tokens, heads and units per block, block 1: 1) and ``aux["penalty"]`` (the
    Lagrangian or the L1 penalty, to add to the loss).
    """

    def __init__(self, config: CascadeConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, CascadeConfig):
            raise TypeError(f"CascadeLM: `config` must be a CascadeConfig; got {config!r:.80}")
        self.config = config
        g = config.gpt2
        self.wte = nnx.Embed(
            g.vocab_size, g.n_embd, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )
        self.wpe = nnx.Embed(
            g.n_positions, g.n_embd, embedding_init=nnx.initializers.normal(0.01), rngs=rngs
        )
        self.h = nnx.List([CascadeBlock(config, i, rngs) for i in range(g.n_layer)])
        self.ln_f = nnx.LayerNorm(g.n_embd, epsilon=g.layer_norm_epsilon, rngs=rngs)
        # CoFi's multipliers λ1, λ2 per block and family (tokens, heads, units), by ascent.
        self.lagrange = nnx.Param(jnp.zeros((g.n_layer, 3, 2), jnp.float32))

    def __call__(self, ids, *, rngs: nnx.Rngs | None = None, return_aux: bool = False):
        c = self.config
        _check_ids(ids, c.gpt2, "CascadeLM")
        b, t = ids.shape
        x = self.wte(ids) + self.wpe(jnp.arange(t))[None]
        keep = jnp.ones((b, t), jnp.float32)
        kept, expected = [], []
        for block in self.h:
            x, keep, aux = block(x, keep, rngs)
            kept.append(keep)
            expected.append(_expected_keep(aux, expected[-1][0] if expected else None))
        x = self.ln_f(x)
        logits = jnp.einsum("btd,vd->btv", x, self.wte.embedding[...]).astype(jnp.float32)
        if not return_aux:
            return logits
        expected_keep = jnp.stack([e[1] for e in expected])  # [L, 3]
        return logits, {
            "kept_tokens": jnp.stack(kept),
            "expected_keep": expected_keep,
            "penalty": self._penalty(expected_keep),
        }

    def _penalty(self, expected_keep):
        c = self.config
        targets = jnp.asarray(
            np.stack([c.keep_ratios, c.head_keep, c.unit_keep], axis=1), jnp.float32
        )  # [L, 3]
        if c.score_scaling:
            return jnp.float32(0.0)
        if c.penalty == "l1":  # λ Σ sigmoid(z), as a mean per gate family and block
            return c.l1_weight * jnp.sum(expected_keep[1:])
        lam = _ascend(self.lagrange[...])
        s, target = 1.0 - expected_keep, 1.0 - targets
        terms = gates_lib.lagrangian_sparsity(s, target, lam[..., 0], lam[..., 1])
        return jnp.sum(terms[1:])

    # -- what the model is ---------------------------------------------------------------------

    def heads_kept(self) -> list[int]:
        """Heads per block that hard gates keep."""
        return [len(b.hard_heads()) for b in self.h]

    def units_kept(self) -> list[int]:
        """FFN units per block that hard gates keep."""
        return [len(b.hard_units()) for b in self.h]

    def keep_ratio(self, ids) -> np.ndarray:
        """float64 ``[L]``: the fraction of the tokens of ``ids [B, T]`` each block keeps (hard
        gates)."""
        _, aux = self(ids, return_aux=True)
        return np.asarray(aux["kept_tokens"], np.float64).mean(axis=(1, 2))

    def flops_per_token(self, ids) -> float:
        """Analytic forward FLOPs per token on ``ids [B, T]`` with hard gates: every block
        counted over the tokens it keeps, its kept heads and units, causal attention among its
        kept tokens, and the output layer (:func:`cascade_flops`)."""
        _, aux = self(ids, return_aux=True)
        kept = np.asarray(aux["kept_tokens"]) > 0  # [L, B, T]
        b, t = ids.shape
        total = sum(
            cascade_flops(
                self.config.gpt2, t, kept[:, i].sum(-1), self.heads_kept(), self.units_kept()
            )
            for i in range(b)
        )
        return total / (b * t)

    def prune(self) -> PrunedCascadeLM:
        """The model for inference: closed heads and units removed from the weights, and each
        block run on its kept tokens only (see :class:`PrunedCascadeLM`)."""
        return PrunedCascadeLM(self)


def _expected_keep(aux, previous_tokens):
    """(the tokens' running expected keep ``[B, T]``, ``[3]`` expected keep of tokens, heads,
    units). Token gates multiply along the cascade, so a token's expected keep in block l is the
    product of its open probabilities in blocks 2..l (block 1: 1)."""
    one = jnp.float32(1.0)
    p_tok = aux.get("p_tokens")
    if p_tok is None:
        running = None if previous_tokens is None else previous_tokens
        tokens = one if running is None else jnp.mean(running)
    else:
        running = p_tok if previous_tokens is None else previous_tokens * p_tok
        tokens = jnp.mean(running)
    heads = jnp.mean(aux["p_heads"]) if "p_heads" in aux else one
    units = jnp.mean(aux["p_units"]) if "p_units" in aux else one
    return running, jnp.stack([tokens, heads, units]).astype(jnp.float32)


def _check_ids(ids, g: GPT2Config, caller: str):
    if not hasattr(ids, "shape") or len(ids.shape) != 2:
        raise ValueError(f"{caller}: `ids` must be [batch, seq] token ids; got {ids!r:.80}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{caller}: `ids` must be integer token ids; got dtype {ids.dtype}")
    if ids.shape[1] > g.n_positions:
        raise ValueError(
            f"{caller}: {ids.shape[1]} tokens is longer than n_positions={g.n_positions}"
        )


def cascade_flops(
    config: GPT2Config,
    seq_len: int,
    tokens: Sequence[int],
    heads: Sequence[int],
    units: Sequence[int],
) -> int:
    """Forward FLOPs (2 per multiply-add) of one sequence of ``seq_len`` tokens when block
    ``l`` runs on ``tokens[l]`` tokens with ``heads[l]`` heads and ``units[l]`` FFN units:
    per block ``2·n·D·4·N_l·H`` (q, k, v, output projections), ``2·2·H·N_l·n(n+1)/2`` (causal
    ``QKᵀ`` and ``PV`` among the kept tokens), ``2·2·n·D·U_l`` (FFN); plus the output layer
    ``2·T·D·V``. A dense GPT-2 is ``tokens = [T] * L`` with every head and unit.

    Example:
      >>> g = GPT2Config.preset("tiny")  # D 48, 2 blocks, 3 heads of 16, 192 units, V 101
      >>> cascade_flops(g, 4, [4, 2], [3, 2], [192, 96])
      323712
    """
    d, hd = config.n_embd, config.head_dim
    total = 2 * seq_len * d * config.vocab_size
    for n, h, u in zip(tokens, heads, units, strict=True):
        n, h, u = int(n), int(h), int(u)
        total += 2 * n * d * 4 * h * hd + 2 * 2 * hd * h * n * (n + 1) // 2 + 2 * 2 * n * d * u
    return total


def capacity_for(count: int, seq_len: int, buckets: int = 8) -> int:
    """The compiled length for ``count`` kept tokens out of ``seq_len``: ``count`` rounded up to
    a multiple of ``ceil(seq_len / buckets)`` (at most ``seq_len``), so that at most
    ``buckets`` shapes are ever compiled per block.

    Example:
      >>> capacity_for(5, 64), capacity_for(9, 64), capacity_for(64, 64)
      (8, 16, 64)
    """
    step = -(-seq_len // buckets)
    return min(seq_len, max(step, -(-count // step) * step))


class PrunedCascadeLM:
    """A :class:`CascadeLM` for inference, with what its hard gates close removed.

    Closed heads and FFN units are cut out of the weight matrices. Tokens are routed at run
    time: before block ``l`` the router decides (on device) which tokens stay, the host reads
    the largest kept count of the batch and picks the compiled capacity
    (:func:`capacity_for`, a few shapes per block), and the block runs on the kept tokens
    gathered into that many slots (their original positions decide the causal mask), its updates
    scattered back. A token is never dropped for lack of room: the capacity is computed from
    the count. ``logits(ids)`` equals ``model(ids)`` with hard gates.
    """

    def __init__(self, model: CascadeLM, buckets: int = 8):
        self.config = model.config
        self.buckets = check_int(buckets, "buckets", "PrunedCascadeLM")
        g = self.config.gpt2
        self.wte = np.asarray(model.wte.embedding[...])
        self.wpe = np.asarray(model.wpe.embedding[...])
        self.ln_f = _ln_params(model.ln_f)
        self.blocks = []
        for block in model.h:
            heads, units = block.hard_heads(), block.hard_units()
            n, hd = block.num_heads, block.head_dim
            w_attn = np.asarray(block.c_attn.kernel[...]).reshape(-1, 3, n, hd)
            b_attn = np.asarray(block.c_attn.bias[...]).reshape(3, n, hd)
            q_scale = None
            if block.score_scaling:
                q_scale = np.asarray(block.head_gate.values())[heads]
            params = {
                "ln_1": _ln_params(block.ln_1),
                "ln_2": _ln_params(block.ln_2),
                "w_attn": w_attn[:, :, heads].reshape(w_attn.shape[0], -1),
                "b_attn": b_attn[:, heads].reshape(-1),
                "w_proj": np.asarray(block.c_proj.kernel[...])
                .reshape(n, hd, -1)[heads]
                .reshape(len(heads) * hd, -1),
                "b_proj": np.asarray(block.c_proj.bias[...]),
                "w_fc": np.asarray(block.c_fc.kernel[...])[:, units],
                "b_fc": np.asarray(block.c_fc.bias[...])[units],
                "w_mlp": np.asarray(block.mlp_proj.kernel[...])[units],
                "b_mlp": np.asarray(block.mlp_proj.bias[...]),
                "q_scale": q_scale,
                "router": None
                if block.router is None
                else (np.asarray(block.router.kernel[...])[:, 0], float(block.router.bias[...][0])),
            }
            self.blocks.append((len(heads), hd, params))
        self.activation = g.activation_function
        self._route = jax.jit(_route)
        self._block = jax.jit(
            _run_block, static_argnames=("heads", "head_dim", "capacity", "activation")
        )
        self._head = jax.jit(_logits)

    def heads_kept(self) -> list[int]:
        return [h for h, _, _ in self.blocks]

    def units_kept(self) -> list[int]:
        return [len(p["b_fc"]) for _, _, p in self.blocks]

    def logits(self, ids, *, return_kept: bool = False):
        """Logits ``[B, T, V]`` of ``ids [B, T]`` (and the kept tokens per block ``[L, B, T]``
        and the capacities used, with ``return_kept``)."""
        _check_ids(ids, self.config.gpt2, "PrunedCascadeLM")
        b, t = ids.shape
        x = jnp.asarray(self.wte)[ids] + jnp.asarray(self.wpe)[:t][None]
        keep = jnp.ones((b, t), bool)
        kept, capacities = [], []
        for heads, hd, p in self.blocks:
            if p["router"] is not None:
                keep = self._route(x, keep, p["ln_1"], *p["router"])
            count = int(jnp.max(jnp.sum(keep, axis=1)))  # the host decides the compiled shape
            capacity = capacity_for(max(count, 1), t, self.buckets)
            x = self._block(
                x, keep, p, heads=heads, head_dim=hd, capacity=capacity, activation=self.activation
            )
            kept.append(keep)
            capacities.append(capacity)
        logits = self._head(x, self.ln_f, jnp.asarray(self.wte))
        if return_kept:
            return logits, jnp.stack(kept), capacities
        return logits

    def flops_per_token(self, ids) -> float:
        """:func:`cascade_flops` per token over the tokens this model keeps on ``ids``."""
        _, kept, _ = self.logits(ids, return_kept=True)
        kept = np.asarray(kept)
        b, t = ids.shape
        return sum(
            cascade_flops(
                self.config.gpt2, t, kept[:, i].sum(-1), self.heads_kept(), self.units_kept()
            )
            for i in range(b)
        ) / (b * t)


def _ln_params(ln) -> tuple[np.ndarray, np.ndarray, float]:
    return np.asarray(ln.scale[...]), np.asarray(ln.bias[...]), float(ln.epsilon)


def _layer_norm(x, params):
    scale, bias, eps = params
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _route(x, keep, ln, w, b):
    """Keep a token when it was kept and its router logit is > 0 (the hard gate)."""
    return keep & ((_layer_norm(x, ln) @ w + b) > 0)


def _run_block(x, keep, p, *, heads, head_dim, capacity, activation):
    """One block on the kept tokens of each row, gathered into ``capacity`` slots."""
    b = x.shape[0]
    order = jnp.argsort(~keep, axis=1, stable=True)[:, :capacity]  # kept first, in order
    valid = jnp.take_along_axis(keep, order, axis=1)  # [B, C]
    xs = jnp.take_along_axis(x, order[..., None], axis=1)  # [B, C, D]
    if heads:
        qkv = (_layer_norm(xs, p["ln_1"]) @ p["w_attn"] + p["b_attn"]).reshape(
            b, capacity, 3, heads, head_dim
        )
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if p["q_scale"] is not None:
            q = q * p["q_scale"][None, None, :, None]
        causal = order[:, None, :] <= order[:, :, None]  # key position <= query position
        mask = (causal & valid[:, None, :])[:, None]  # [B, 1, C, C]
        out = attention(q, k, v, mask=mask).reshape(b, capacity, heads * head_dim)
        xs = xs + out @ p["w_proj"] + p["b_proj"]
    else:
        xs = xs + p["b_proj"]
    hidden = _activation(activation)(_layer_norm(xs, p["ln_2"]) @ p["w_fc"] + p["b_fc"])
    xs = xs + hidden @ p["w_mlp"] + p["b_mlp"]
    update = jnp.where(valid[..., None], xs - jnp.take_along_axis(x, order[..., None], axis=1), 0)
    rows = jnp.arange(b)[:, None]
    return x.at[rows, order].add(update)


def _logits(x, ln_f, wte):
    return jnp.einsum("btd,vd->btv", _layer_norm(x, ln_f), wte).astype(jnp.float32)
