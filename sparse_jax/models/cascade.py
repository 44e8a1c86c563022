"""Cascade attention with differentiable sparsity (CANDS), built so that what it prunes is not
computed: a GPT-2-shaped causal LM whose later blocks see fewer heads, FFN units and tokens.

Shapes: ``B`` batch, ``T`` tokens, ``D`` width, ``N`` heads, ``H`` head dim, ``U`` FFN units,
``L`` blocks, ``C`` token slots of a pruned block.

Block 1 is dense. Each later block ``l`` has

* a gate per head and per FFN unit (Hard Concrete L0 gates by default, or the published
  sigmoid with a straight-through estimator), multiplying the head's output and the unit's
  activation, so a closed gate removes the unit's whole work. Heads are *nested* by default
  (SpAtten's cascade head pruning): head ``i``'s keep value in block ``l`` is the product of
  its gates ``i`` in blocks ``2..l``, so a head closed in block ``l`` is absent from every
  later block (``nested_heads=False`` gates each block's heads on their own);
* a gate per *token*, computed from that token's own hidden state (a linear map of the block's
  layer-normalised input to one logit: causal, no look-ahead), nested the same way: the token's
  keep value in block ``l`` is the product of its gates in blocks ``2..l``. A closed token
  passes through the block untouched (the block's update is multiplied by the keep value) and
  is **not** a key or value there: kept tokens attend only to kept tokens (as SpAtten and
  Mixture-of-Depths drop them). That is what lets the pruned model run each block on the kept
  tokens alone, gathered into a shorter sequence, and compute exactly what the gated model
  computes; keeping closed tokens as keys would leave every block's key and value projections
  at full length and save a fraction of the attention only.

Training samples the gates (Hard Concrete, ``rngs`` given) or uses the straight-through
sigmoid; evaluation (``rngs=None``) uses *hard* decisions: a token is kept when its gate's logit
is > 0 (for Hard Concrete: ``P(sample > 1/2) > 1/2``); a head or unit when its logit is > 0
(sigmoid + STE), or, for Hard Concrete, when it is among the expected number of the family's
gates with the largest keep probability, at its test-time value
(:func:`deterministic_gates`). With these decisions the model equals
:meth:`CascadeLM.prune`'s model (a test).

The sparsity targets: ``keep_ratios`` ``r_1 = 1 >= r_2 >= ...``, the expected kept fraction of
tokens in each block (and, unless given separately, of heads and units), optionally warmed up
from 1 (:meth:`CascadeConfig.targets`, :func:`sparse_jax.gates.sparsity_schedule`), enforced
with CoFi's Lagrangian (:func:`cascade_penalty`, multipliers trained by gradient ascent through
a gradient-reversing identity, so one minimising optimizer trains everything), or the published
penalty ``λ Σ sigmoid(z)`` (``penalty="l1"``). ``score_scaling=True`` is the CANDS code's module
instead: heads multiply the attention *scores* by ``sigmoid(z)`` (a temperature), no token or
unit gates: it prunes nothing, and is here to show that.

Example:
  >>> from flax import nnx
  >>> cfg = CascadeConfig(GPT2Config.preset("tiny"), keep_ratios=(1.0, 0.5))
  >>> model = CascadeLM(cfg, rngs=nnx.Rngs(0))
  >>> ids = jnp.zeros((2, 8), jnp.int32)
  >>> logits, aux = model(ids, return_aux=True)
  >>> logits.shape, aux["kept_tokens"].shape, aux["expected_keep"].shape
  ((2, 8, 101), (2, 2, 8), (2, 3))
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import gates as gates_lib
from sparse_jax import masks as masks_lib
from sparse_jax.dispatch import attention
from sparse_jax.models.flops import ModelFlops, kept_flops
from sparse_jax.models.gpt2 import GPT2Config, activation_fn, linear_layer
from sparse_jax.models.layers import Gate
from sparse_jax.validation import check_bool, check_choice, check_int, check_token_batch

__all__ = [
    "CascadeConfig",
    "CascadeLM",
    "PrunedCascadeLM",
    "capacity_for",
    "cascade_flops",
    "cascade_penalty",
    "deterministic_gates",
    "open_probability",
]

GATES = ("hard_concrete", "sigmoid_ste")
PENALTIES = ("lagrangian", "l1")
FAMILIES = ("tokens", "heads", "units")  # the columns of the [L, 3] keep ratios and targets


@jax.custom_vjp
def _ascend(x):
    """Identity whose gradient is negated: a parameter behind it is trained by ascent."""
    return x


_ascend.defvjp(lambda x: (x, None), lambda _, g: (-g,))


def _ratios(value, name: str, n_layer: int, caller: str, *, cascade: bool) -> tuple[float, ...]:
    """One ratio per block in (0, 1]; a ``cascade`` schedule also starts at 1 and never rises."""
    try:
        ratios = tuple(float(r) for r in value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{caller}: `{name}` must be a sequence of numbers; got {value!r}") from err
    if len(ratios) != n_layer:
        raise ValueError(
            f"{caller}: `{name}` needs one ratio per block ({n_layer}); got {len(ratios)}: "
            f"{list(ratios)}"
        )
    if not all(0 < r <= 1 for r in ratios):  # NaN fails too
        raise ValueError(f"{caller}: `{name}` must lie in (0, 1]; got {list(ratios)}")
    if cascade and ratios[0] != 1.0:
        raise ValueError(f"{caller}: `{name}` starts at 1 (block 1 is dense); got {ratios[0]}")
    if cascade and any(b > a for a, b in itertools.pairwise(ratios)):
        raise ValueError(f"{caller}: `{name}` must not increase; got {list(ratios)}")
    return ratios


def _check_capacity(capacity, keep_ratios: tuple[float, ...], caller: str) -> tuple[float, ...]:
    """Token slots per block as fractions of ``T``, none below its block's keep target."""
    capacity = _ratios(capacity, "capacity", len(keep_ratios), caller, cascade=False)
    for block, (c, r) in enumerate(zip(capacity, keep_ratios, strict=True), start=1):
        if c < r:
            raise ValueError(
                f"{caller}: `capacity` of block {block} ({c}) is below its kept tokens "
                f"(`keep_ratios` {r}): the block is trained to keep that fraction, so its "
                "slots would overflow; allowed: capacity >= keep_ratios per block"
            )
    return capacity


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """Sizes, gates, targets and pruned capacities of :class:`CascadeLM`.

    Example:
      >>> cfg = CascadeConfig(GPT2Config.preset("tiny"), keep_ratios=(1.0, 0.5),
      ...                     target_warmup_steps=100)
      >>> np.asarray(cfg.targets(50))[1].tolist()  # tokens, heads, units of block 2
      [0.75, 0.75, 0.75]
    """

    gpt2: GPT2Config  # sizes (a dense GPT2 of this config is the baseline)
    keep_ratios: tuple[float, ...] | None = None  # token keep target per block (None: 1 -> 1/2)
    head_keep: tuple[float, ...] | None = None  # head keep targets (None: keep_ratios)
    unit_keep: tuple[float, ...] | None = None  # FFN unit keep targets (None: keep_ratios)
    gate: Literal["hard_concrete", "sigmoid_ste"] = "hard_concrete"  # every gate's kind
    penalty: Literal["lagrangian", "l1"] = "lagrangian"  # how the targets are pursued
    l1_weight: float = 0.01  # penalty "l1": λ of λ Σ sigmoid(z) (mean per gate family)
    gate_init: float = 3.0  # initial gate logit (open: sigmoid(3) = 0.95)
    score_scaling: bool = False  # the CANDS code's variant: head gates scale scores only
    nested_heads: bool = True  # a head closed in block l stays closed in later blocks (SpAtten)
    target_warmup_steps: int = 0  # targets fall linearly from 1 over these steps (0: at once)
    # Pruned model: token slots per block as a fraction of T, one compiled call for the whole
    # model (None: each block's slots chosen per batch from its kept count, a host round trip
    # per block). A block that keeps more tokens than its slots runs on more, chosen in the
    # compiled call.
    capacity: tuple[float, ...] | None = None

    def __post_init__(self):
        caller = "CascadeConfig"
        if not isinstance(self.gpt2, GPT2Config):
            raise TypeError(f"{caller}: `gpt2` must be a GPT2Config; got {self.gpt2!r:.80}")
        n = self.gpt2.n_layer
        if self.gpt2.heads_per_layer is not None or self.gpt2.inner_per_layer is not None:
            raise ValueError(
                f"{caller}: `gpt2` must have every head and unit (heads_per_layer and "
                "inner_per_layer None): the cascade prunes them itself"
            )
        if self.gpt2.smear_keys:
            raise ValueError(
                f"{caller}: `gpt2.smear_keys` must be False: the cascade's attention does not "
                "smear keys (its blocks would drop the smear weights of a GPT2 loaded into it)"
            )
        if self.gpt2.positions != "learned":
            raise ValueError(
                f"{caller}: `gpt2.positions` must be 'learned' (the cascade adds learned position "
                f"embeddings); got {self.gpt2.positions!r}"
            )
        if self.keep_ratios is None:  # linear from 1 to 1/2
            default = tuple(1.0 - 0.5 * i / max(n - 1, 1) for i in range(n))
            object.__setattr__(self, "keep_ratios", default)
        ratios = _ratios(self.keep_ratios, "keep_ratios", n, caller, cascade=True)
        object.__setattr__(self, "keep_ratios", ratios)
        for name in ("head_keep", "unit_keep"):
            value = getattr(self, name)
            value = ratios if value is None else _ratios(value, name, n, caller, cascade=True)
            object.__setattr__(self, name, value)
        check_choice(self.gate, "gate", GATES, caller)
        check_choice(self.penalty, "penalty", PENALTIES, caller)
        for name, ok, allowed in (
            ("l1_weight", lambda v: v >= 0, "a finite number >= 0"),
            ("gate_init", lambda v: True, "a finite number"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{caller}: `{name}` must be {allowed}; got {value!r}")
            if not (math.isfinite(value) and ok(value)):
                raise ValueError(f"{caller}: `{name}` must be {allowed}; got {value!r}")
        check_bool(self.score_scaling, "score_scaling", caller)
        check_bool(self.nested_heads, "nested_heads", caller)
        check_int(self.target_warmup_steps, "target_warmup_steps", caller, low=0)
        if self.capacity is not None:
            object.__setattr__(self, "capacity", _check_capacity(self.capacity, ratios, caller))

    def targets(self, step=None) -> jax.Array:
        """float32 ``[L, 3]``: the keep targets of tokens, heads and units per block at ``step``
        (an int or a traced scalar; ``None``: the final targets), warmed up linearly from 1 over
        ``target_warmup_steps`` (:func:`~sparse_jax.gates.sparsity_schedule`)."""
        final = jnp.asarray(
            np.stack([self.keep_ratios, self.head_keep, self.unit_keep], axis=1), jnp.float32
        )
        if step is None or self.target_warmup_steps == 0:
            return final
        ramp = gates_lib.sparsity_schedule(step, target=1.0, warmup_steps=self.target_warmup_steps)
        return 1.0 - (1.0 - final) * ramp


def cascade_penalty(
    expected_keep: jax.Array,
    targets: jax.Array,
    multipliers: jax.Array | None = None,
    *,
    kind: str = "lagrangian",
    l1_weight: float = 0.01,
) -> jax.Array:
    """The sparsity terms per block and gate family, ``[L, 3]`` (block 1, dense, is 0): sum
    them into the loss.

    ``kind="lagrangian"``: CoFi's ``λ1 (s - t) + λ2 (s - t)²`` with expected sparsity ``s = 1 -
    expected_keep`` and target ``t = 1 - targets`` (:func:`~sparse_jax.gates.lagrangian_sparsity`),
    ``multipliers [L, 3, 2]`` (λ1, λ2) to be trained by *ascent*. ``kind="l1"``: the published
    ``λ Σ sigmoid(z)``, here ``l1_weight`` times the expected kept fraction.

    Args:
      expected_keep: ``[L, 3]`` expected kept fraction of tokens, heads, units per block.
      targets: ``[L, 3]`` their targets (:meth:`CascadeConfig.targets`).
      multipliers: ``[L, 3, 2]`` (``kind="lagrangian"`` only).

    Example:
      >>> keep, targets = jnp.array([[1.0, 1, 1], [0.9, 0.8, 1]]), jnp.full((2, 3), 0.5)
      >>> lam = jnp.zeros((2, 3, 2)).at[1, :, 0].set(-1.0)  # λ1 = -1: more sparsity is cheaper
      >>> np.asarray(cascade_penalty(keep, targets, lam), np.float64).round(3).tolist()
      [[0.0, 0.0, 0.0], [0.4, 0.3, 0.5]]
    """
    check_choice(kind, "kind", PENALTIES, "cascade_penalty")
    if kind == "l1":
        terms = l1_weight * expected_keep
    else:
        if multipliers is None:
            raise ValueError("cascade_penalty: kind 'lagrangian' needs `multipliers` [L, 3, 2]")
        terms = gates_lib.lagrangian_sparsity(
            1.0 - expected_keep, 1.0 - targets, multipliers[..., 0], multipliers[..., 1]
        )
    return terms.at[0].set(0.0)


@functools.partial(jax.jit, static_argnames="kind")
def _evaluation_gates(logits, previous, expected, kind: str):
    """``(values, expected)`` of one family after a block's deterministic gates: the expected
    keep times this block's open probabilities, and :func:`deterministic_gates` (compiled: the
    models call it on the host too)."""
    expected = expected * open_probability(logits, kind)
    return deterministic_gates(logits, expected, previous, kind), expected


def _causal(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), bool))


def open_probability(logits: jax.Array, kind: str) -> jax.Array:
    """What a gate's keep counts toward the targets, elementwise.

    ``"hard_concrete"``: ``sigmoid(z)``, the probability that a sample is above 1/2 (``P(L + z
    > 0)``, ``L`` logistic noise). Not ``P(gate != 0)`` (the L0 expectation, ``sigmoid(z +
    1.6)``): driven to a target, that would leave the gates mostly open. ``"sigmoid_ste"``: the
    straight-through gate itself (forward ``1[z > 0]``, the gate actually kept; gradient
    ``sigmoid'(z)``, that of the published ``Σ sigmoid(z)``).

    Example:
      >>> np.asarray(open_probability(jnp.array([-1.0, 0.5]), "sigmoid_ste")).tolist()
      [0.0, 1.0]
    """
    if kind == "hard_concrete":
        return jax.nn.sigmoid(logits)
    return gates_lib.sigmoid_gate(logits, straight_through=True)


def deterministic_gates(
    logits: jax.Array, expected: jax.Array, previous: jax.Array, kind: str
) -> jax.Array:
    """Gate values ``[n]`` of one family of heads or FFN units at evaluation (``rngs=None``).

    ``"sigmoid_ste"``: ``previous * 1[z > 0]``, what training computed. ``"hard_concrete"``:
    the ``round(Σ expected)`` gates with the largest ``expected`` among those ``previous``
    keeps (the expected count, as CoFi's deterministic masks), at ``previous`` times their
    test-time value ``clip(1.2 sigmoid(z) - 0.1, 0, 1)`` (about the mean of the samples
    training saw), the others 0. A threshold ``z > 0`` would not do: the targets bound the
    *mean* keep, which gates all half open (every ``z`` a little above 0) also meet, and then
    every gate would stay.

    Args:
      logits: ``[n]`` the gates' logits (log α).
      expected: ``[n]`` their expected keep (:func:`open_probability`, times the previous
        block's for nested heads).
      previous: ``[n]`` the previous block's values of the same heads (nested), else ones.

    Example:
      >>> z = jnp.array([0.2, 0.1, 0.3, 0.1])  # all half open: keep 2 of 4, the largest two
      >>> values = deterministic_gates(z, jax.nn.sigmoid(z), jnp.ones(4), "hard_concrete")
      >>> (np.asarray(values) > 0).tolist()
      [True, False, True, False]
    """
    if kind == "sigmoid_ste":
        return previous * (logits > 0).astype(previous.dtype)
    allowed = previous > 0
    count = jnp.minimum(jnp.round(jnp.sum(expected)), jnp.sum(allowed))
    order = jnp.argsort(-jnp.where(allowed, expected, -1.0), stable=True)
    rank = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.shape[0]))
    value = previous * gates_lib.hard_concrete(logits)
    return jnp.where(allowed & (rank < count), value, 0.0).astype(previous.dtype)


class CascadeBlock(nnx.Module):
    """One pre-LayerNorm GPT-2 block with optional head, unit and token gates (block ``layer``
    > 0 of a cascade). ``c_attn``/``c_proj``/``c_fc``/``mlp_proj`` are GPT-2's linears; not
    :class:`~sparse_jax.models.gpt2.Block` itself, which has no per-token keep values and no
    mask of kept keys that depends on the hidden states."""

    def __init__(self, config: CascadeConfig, layer: int, rngs: nnx.Rngs):
        g = config.gpt2
        d, n, h, u = g.n_embd, g.n_head, g.head_dim, g.inner(layer)
        self.num_heads, self.head_dim, self.units = n, h, u
        std_proj = 0.02 / math.sqrt(2 * g.n_layer)
        self.ln_1 = nnx.LayerNorm(d, epsilon=g.layer_norm_epsilon, rngs=rngs)
        self.c_attn = linear_layer(d, 3 * n * h, rngs)
        self.c_proj = linear_layer(n * h, d, rngs, std_proj)
        self.ln_2 = nnx.LayerNorm(d, epsilon=g.layer_norm_epsilon, rngs=rngs)
        self.c_fc = linear_layer(d, u, rngs)
        self.mlp_proj = linear_layer(u, d, rngs, std_proj)
        self.act = activation_fn(g.activation_function)
        gated = layer > 0
        self.score_scaling = gated and config.score_scaling
        self.nested_heads = config.nested_heads
        kind = "score_scaling" if self.score_scaling else config.gate
        self.head_gate = Gate(n, kind, init=config.gate_init) if gated else None
        pruning = gated and not config.score_scaling
        self.unit_gate = Gate(u, config.gate, init=config.gate_init) if pruning else None
        # The token gate: one logit from the token's own normalised hidden state (open at
        # first: weight 0, bias gate_init).
        open_bias = nnx.initializers.constant(config.gate_init)
        self.router = (
            nnx.Linear(
                d,
                1,
                kernel_init=nnx.initializers.zeros,
                bias_init=open_bias,
                rngs=rngs,
                param_dtype=jnp.float32,
            )
            if pruning
            else None
        )
        self.kind = config.gate

    def token_logits(self, x: jax.Array) -> jax.Array:
        """``[B, T]``: the token gates' logits (log α for Hard Concrete) from ``x [B, T, D]``."""
        return self.router(self.ln_1(x))[..., 0].astype(jnp.float32)

    def _sample(self, logits: jax.Array, rngs: nnx.Rngs) -> jax.Array:
        """Training values: Hard Concrete samples, or the straight-through sigmoid."""
        if self.kind == "hard_concrete":
            return gates_lib.hard_concrete(logits, rngs.gates())
        return gates_lib.sigmoid_gate(logits, straight_through=True)

    def __call__(self, x, tokens, heads, rngs: nnx.Rngs | None = None):
        """One block: ``x [B, T, D]`` -> ``(x, tokens, heads, units)``.

        ``tokens = (keep [B, T], expected [B, T])`` and ``heads = (values [N], expected [N])``
        are the keep values and expected keep of the tokens and heads after the previous block,
        updated here (products along the cascade); ``units`` is this block's expected kept
        fraction of FFN units. Tokens: sampled (training) or hard ``z > 0`` gates; heads and
        units: sampled, or :func:`deterministic_gates` with ``rngs=None``.
        """
        b, t, _ = x.shape
        keep, expected_tokens = tokens
        if self.router is not None:
            z = self.token_logits(x)
            gate = (z > 0).astype(jnp.float32) if rngs is None else self._sample(z, rngs)
            keep = keep * gate
            expected_tokens = expected_tokens * open_probability(z, self.kind)
        values, expected_heads = heads
        if self.head_gate is not None and not self.score_scaling:
            z = self.head_gate.logits[...]
            if not self.nested_heads:
                values, expected_heads = jnp.ones_like(values), jnp.ones_like(expected_heads)
            if rngs is None:
                values, expected_heads = _evaluation_gates(z, values, expected_heads, self.kind)
            else:
                values = values * self._sample(z, rngs)
                expected_heads = expected_heads * open_probability(z, self.kind)
        n, hd = self.num_heads, self.head_dim
        qkv = self.c_attn(self.ln_1(x)).reshape(b, t, 3, n, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.score_scaling:
            q = q * self.head_gate.values().astype(q.dtype)[None, None, :, None]
        mask = _causal(t)[None, None] & (keep > 0)[:, None, None, :]  # kept keys only
        out = attention(q, k, v, mask=mask) * values.astype(q.dtype)[None, None, :, None]
        scale = keep[..., None].astype(x.dtype)
        x = x + scale * self.c_proj(out.reshape(b, t, n * hd))
        hidden = self.act(self.c_fc(self.ln_2(x)))
        expected_units = jnp.float32(1.0)
        if self.unit_gate is not None:
            z = self.unit_gate.logits[...]
            ones = jnp.ones_like(z)
            if rngs is None:
                unit_values, p = _evaluation_gates(z, ones, ones, self.kind)
            else:
                unit_values, p = self._sample(z, rngs), open_probability(z, self.kind)
            hidden = hidden * unit_values.astype(hidden.dtype)
            expected_units = jnp.mean(p)
        x = x + scale * self.mlp_proj(hidden)
        return x, (keep, expected_tokens), (values, expected_heads), expected_units

    def unit_values(self) -> np.ndarray:
        """``[U]`` the FFN units' gate values at evaluation (0: closed)."""
        if self.unit_gate is None:
            return np.ones(self.units, np.float32)
        ones = jnp.ones((self.units,), jnp.float32)
        return np.asarray(_evaluation_gates(self.unit_gate.logits[...], ones, ones, self.kind)[0])


class CascadeLM(nnx.Module):
    """The CANDS language model (see the module docstring).

    Call: ``model(ids [B, T], *, rngs=None, return_aux=False, step=None)`` -> logits
    ``[B, T, V]``, or ``(logits, aux)``:

    * ``aux["kept_tokens"]`` ``[L, B, T]``, ``aux["kept_heads"]`` ``[L, N]``: the tokens' and
      heads' keep values, 0 where closed (``rngs=None``: tokens 0/1, heads their deterministic
      values; training: samples);
    * ``aux["expected_keep"]`` ``[L, 3]``: expected kept fraction of tokens, heads and units
      per block (block 1: 1), and ``aux["targets"]`` ``[L, 3]`` their targets at ``step``;
    * ``aux["penalties"]`` ``[L, 3]`` and ``aux["penalty"]``, their sum: add it to the loss.

    Training: ``rngs`` with a ``gates`` stream samples the Hard Concrete gates. The Lagrange
    multipliers ``lagrange`` (an ``nnx.Param`` ``[L, 3, 2]``: λ1, λ2 per block and family) sit
    behind a gradient-reversing identity, so the usual minimising optimizer over every
    ``nnx.Param`` (the project's ``Trainer``) moves them by ascent: a trainer needs nothing
    special, but it must train them (a ``trainable`` regex must match ``lagrange``), must not
    weight-decay them (``weight_decay=0``: decay would pull λ back to 0), and should give them
    and the gates a faster rate (``fast_params="gate/logits|router|lagrange"``: they start far
    from where the targets take them). For warmed-up targets pass the update's ``step``.

    Example:
      >>> cfg = CascadeConfig(GPT2Config.preset("tiny"), keep_ratios=(1.0, 0.5))  # L = 2
      >>> model = CascadeLM(cfg, rngs=nnx.Rngs(0))  # D 48, 3 heads, 192 units, V 101
      >>> ids = jnp.zeros((2, 8), jnp.int32)  # [B, T]
      >>> model(ids).shape  # evaluation (rngs=None, hard gates): logits [B, T, V]
      (2, 8, 101)
      >>> logits, aux = model(ids, return_aux=True)  # training adds rngs=nnx.Rngs(gates=...)
      >>> aux["kept_heads"].shape, aux["targets"].shape, aux["penalty"].shape  # [L, N], [L, 3]
      ((2, 3), (2, 3), ())
      >>> model.heads_kept()  # heads per block that hard gates keep
      [3, 3]
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
        self.lagrange = nnx.Param(jnp.zeros((g.n_layer, len(FAMILIES), 2), jnp.float32))

    def __call__(self, ids, *, rngs: nnx.Rngs | None = None, return_aux: bool = False, step=None):
        c = self.config
        check_token_batch(ids, c.gpt2.vocab_size, c.gpt2.n_positions, "CascadeLM")
        b, t = ids.shape
        x = self.wte(ids) + self.wpe(jnp.arange(t))[None]
        tokens = (jnp.ones((b, t), jnp.float32), jnp.ones((b, t), jnp.float32))
        heads = (jnp.ones((c.gpt2.n_head,), jnp.float32), jnp.ones((c.gpt2.n_head,), jnp.float32))
        kept, kept_heads, expected = [], [], []
        for block in self.h:
            x, tokens, heads, units = block(x, tokens, heads, rngs)
            kept.append(tokens[0])
            kept_heads.append(heads[0])
            expected.append(jnp.stack([jnp.mean(tokens[1]), jnp.mean(heads[1]), units]))
        logits = jnp.einsum("btd,vd->btv", self.ln_f(x), self.wte.embedding[...])
        logits = logits.astype(jnp.float32)
        if not return_aux:
            return logits
        expected_keep = jnp.stack(expected).astype(jnp.float32)  # [L, 3]
        targets = c.targets(step)
        if c.score_scaling:
            penalties = jnp.zeros_like(expected_keep)
        else:
            penalties = cascade_penalty(
                expected_keep,
                targets,
                _ascend(self.lagrange[...]),
                kind=c.penalty,
                l1_weight=c.l1_weight,
            )
        return logits, {
            "kept_tokens": jnp.stack(kept),
            "kept_heads": jnp.stack(kept_heads),
            "expected_keep": expected_keep,
            "targets": targets,
            "penalties": penalties,
            "penalty": jnp.sum(penalties),
        }

    # -- what the model is ---------------------------------------------------------------------

    def head_values(self) -> list[np.ndarray]:
        """Per block, the heads' gate values ``[N]`` at evaluation (0: closed; nested: a head
        closed in block ``l`` is 0 in every later block). Block 1 and score scaling: ones."""
        n = self.config.gpt2.n_head
        values, expected, result = jnp.ones(n), jnp.ones(n), []
        for block in self.h:
            if block.head_gate is not None and not block.score_scaling:
                if not self.config.nested_heads:
                    values, expected = jnp.ones(n), jnp.ones(n)
                z = block.head_gate.logits[...]
                values, expected = _evaluation_gates(z, values, expected, block.kind)
            result.append(np.asarray(values))
        return result

    def unit_values(self) -> list[np.ndarray]:
        """Per block, the FFN units' gate values ``[U]`` at evaluation (0: closed)."""
        return [block.unit_values() for block in self.h]

    def open_heads(self) -> list[np.ndarray]:
        """Per block, the indices of the heads kept at evaluation."""
        return [np.flatnonzero(v > 0) for v in self.head_values()]

    def open_units(self) -> list[np.ndarray]:
        """Per block, the indices of the FFN units kept at evaluation."""
        return [np.flatnonzero(v > 0) for v in self.unit_values()]

    def heads_kept(self) -> list[int]:
        """Heads per block that hard gates keep."""
        return [len(heads) for heads in self.open_heads()]

    def units_kept(self) -> list[int]:
        """FFN units per block that hard gates keep."""
        return [len(units) for units in self.open_units()]

    def keep_ratio(self, ids) -> np.ndarray:
        """float64 ``[L]``: the fraction of the tokens of ``ids [B, T]`` each block keeps (hard
        gates)."""
        _, aux = _hard_forward(self, jnp.asarray(ids))
        return np.asarray(aux["kept_tokens"], np.float64).mean(axis=(1, 2))

    def flops(self, ids) -> list[ModelFlops]:
        """Analytic forward FLOPs of each sequence of ``ids [B, T]`` with hard gates, block by
        block (:func:`~sparse_jax.models.flops.kept_flops`): every block counted over the tokens
        it keeps, with its kept heads and units."""
        _, aux = _hard_forward(self, jnp.asarray(ids))
        g, heads, units = self.config.gpt2, self.heads_kept(), self.units_kept()
        return _flops_per_row(g, aux["kept_tokens"], heads, units)

    def flops_per_token(self, ids) -> float:
        """Forward FLOPs per token on ``ids [B, T]`` with hard gates (:meth:`flops`)."""
        reports = self.flops(ids)
        return sum(r.total for r in reports) / (len(reports) * ids.shape[1])

    def prune(self, buckets: int = 8, capacity=None) -> PrunedCascadeLM:
        """The model for inference: closed heads and units removed from the weights, and each
        block run on its kept tokens only (see :class:`PrunedCascadeLM`)."""
        return PrunedCascadeLM(self, buckets=buckets, capacity=capacity)


@nnx.jit
def _hard_forward(model: CascadeLM, ids: jax.Array):
    """``model(ids, return_aux=True)`` with hard gates, compiled (one call, not op by op)."""
    return model(ids, return_aux=True)


def _flops_per_row(g: GPT2Config, kept_tokens, heads, units) -> list[ModelFlops]:
    kept = np.asarray(kept_tokens) > 0  # [L, B, T]
    t = kept.shape[2]
    return [kept_flops(g, t, kept[:, i].sum(-1), heads, units) for i in range(kept.shape[1])]


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
    ``2·T·D·V``. A dense GPT-2 is ``tokens = [T] * L`` with every head and unit. The total of
    :func:`~sparse_jax.models.flops.kept_flops` (which has the block-by-block breakdown).

    Example:
      >>> g = GPT2Config.preset("tiny")  # D 48, 2 blocks, 3 heads of 16, 192 units, V 101
      >>> cascade_flops(g, 4, [4, 2], [3, 2], [192, 96])
      323712
    """
    return kept_flops(config, seq_len, tokens, heads, units).total


def capacity_for(count: int, seq_len: int, buckets: int = 8) -> int:
    """The compiled length for ``count`` kept tokens out of ``seq_len``: ``count`` rounded up to
    a multiple of ``ceil(seq_len / buckets)`` (at most ``seq_len``), so that at most
    ``buckets`` shapes are ever compiled per block.

    Example:
      >>> capacity_for(5, 64), capacity_for(9, 64), capacity_for(64, 64)
      (8, 16, 64)
      >>> capacity_for(-1, 16)
      Traceback (most recent call last):
      ...
      ValueError: capacity_for: `count` must be an int in [0, 16]; got -1
    """
    seq_len = check_int(seq_len, "seq_len", "capacity_for")
    buckets = check_int(buckets, "buckets", "capacity_for")
    count = check_int(count, "count", "capacity_for", low=0, high=seq_len)
    step = _bucket_step(seq_len, buckets)
    return min(seq_len, max(step, -(-count // step) * step))


def _bucket_step(seq_len: int, buckets: int) -> int:
    """The slot counts :func:`capacity_for` gives are multiples of this (and ``seq_len``)."""
    return -(-seq_len // buckets)


class PrunedCascadeLM:
    """A :class:`CascadeLM` for inference, with what its hard gates close removed.

    Closed heads and FFN units are cut out of the weight matrices (the kept ones' gate values
    folded into the output projections' rows). Tokens are routed at run time (the token gates
    depend on the hidden states): before block ``l`` the router decides which tokens stay, and
    the block runs on the kept tokens of each row gathered into ``C`` slots, in order (their
    original positions decide the causal mask; empty slots are no keys), its updates scattered
    back. ``C`` is bucketed (:func:`capacity_for`: a multiple of ``T / buckets``), so at most
    ``buckets`` shapes are compiled per block:

    * ``capacity`` None (the default: ``config.capacity``, if None too): the host reads each
      block's largest kept count of the batch and picks ``C`` from it (one device round trip
      per block; never too small);
    * ``capacity`` set (fractions of ``T`` per block, none below ``config.keep_ratios``):
      ``C_l = capacity_for(ceil(capacity[l] T))``, and the whole model is one compiled call
      with no round trip to the host. A block whose batch keeps more tokens than ``C_l`` runs
      on the smallest bucketed slot count above ``C_l`` that holds them, chosen inside the
      compiled program (a ``lax.switch`` over the slot counts from ``C_l`` to ``T``);
      ``overflows`` counts such batches (reading it waits for the calls before it).

    A token is never dropped for lack of room.

    ``logits(ids)`` equals ``model(ids)`` with hard gates.

    Example:
      >>> from flax import nnx
      >>> cfg = CascadeConfig(GPT2Config.preset("tiny"), keep_ratios=(1.0, 0.5),
      ...                     capacity=(1.0, 0.75))
      >>> pruned = CascadeLM(cfg, rngs=nnx.Rngs(0)).prune()
      >>> logits, kept, slots = pruned.logits(jnp.zeros((1, 16), jnp.int32), return_kept=True)
      >>> slots, pruned.overflows  # every token open at initialisation: 16 > 12 slots
      ([16, 16], 1)
    """

    def __init__(self, model: CascadeLM, buckets: int = 8, capacity=None):
        caller = "PrunedCascadeLM"
        if not isinstance(model, CascadeLM):
            raise TypeError(f"{caller}: `model` must be a CascadeLM; got {model!r:.80}")
        self.config = model.config
        self.buckets = check_int(buckets, "buckets", caller)
        if capacity is None:
            capacity = self.config.capacity
        elif self.config.score_scaling:  # no token gates: every block keeps every token
            capacity = _check_capacity(capacity, (1.0,) * len(model.h), caller)
        else:
            capacity = _check_capacity(capacity, self.config.keep_ratios, caller)
        self.capacity = capacity
        # Batches in which a block kept more tokens than its fixed slots, counted on the device.
        self._overflow_count = jnp.zeros((), jnp.int32)
        g = self.config.gpt2
        self.wte = jnp.asarray(model.wte.embedding[...])
        self.wpe = jnp.asarray(model.wpe.embedding[...])
        self.ln_f = _ln_params(model.ln_f)
        self.blocks = []  # (heads kept, head dim, weights) per block
        for block, head_values, unit_values in zip(
            model.h, model.head_values(), model.unit_values(), strict=True
        ):
            heads, units = np.flatnonzero(head_values > 0), np.flatnonzero(unit_values > 0)
            d, n, hd = g.n_embd, block.num_heads, block.head_dim
            w_attn = np.asarray(block.c_attn.kernel[...]).reshape(d, 3, n, hd)
            b_attn = np.asarray(block.c_attn.bias[...]).reshape(3, n, hd)
            # The kept gates' values (Hard Concrete's test-time values) folded into the weights.
            w_proj = np.asarray(block.c_proj.kernel[...]).reshape(n, hd, d)
            w_proj = w_proj * head_values[:, None, None]
            q_scale = None
            if block.score_scaling:
                q_scale = np.asarray(block.head_gate.values())[heads]
            router = None
            if block.router is not None:
                router = (block.router.kernel[...][:, 0], block.router.bias[...][0])
            params = {
                "ln_1": _ln_params(block.ln_1),
                "ln_2": _ln_params(block.ln_2),
                "w_attn": w_attn[:, :, heads].reshape(d, 3 * len(heads) * hd),
                "b_attn": b_attn[:, heads].reshape(3 * len(heads) * hd),
                "w_proj": w_proj[heads].reshape(len(heads) * hd, d),
                "b_proj": block.c_proj.bias[...],
                "w_fc": np.asarray(block.c_fc.kernel[...])[:, units],
                "b_fc": np.asarray(block.c_fc.bias[...])[units],
                "w_mlp": (np.asarray(block.mlp_proj.kernel[...]) * unit_values[:, None])[units],
                "b_mlp": block.mlp_proj.bias[...],
                "q_scale": q_scale,
                "router": router,
            }
            self.blocks.append((len(heads), hd, jax.tree.map(jnp.asarray, params)))
        self.activation = g.activation_function

    def heads_kept(self) -> list[int]:
        """Heads per block left in the weights."""
        return [heads for heads, _, _ in self.blocks]

    def units_kept(self) -> list[int]:
        """FFN units per block left in the weights."""
        return [int(p["b_fc"].shape[0]) for _, _, p in self.blocks]

    @property
    def overflows(self) -> int:
        """Batches (calls of :meth:`logits`) in which a block kept more tokens than its fixed
        slots and ran on more (0 without ``capacity``)."""
        return int(self._overflow_count)

    def capacities(self, seq_len: int) -> list[int] | None:
        """The fixed token slots per block for ``seq_len`` tokens (``capacity`` set), else
        None."""
        if self.capacity is None:
            return None
        return [capacity_for(math.ceil(c * seq_len), seq_len, self.buckets) for c in self.capacity]

    def _plan(self, seq_len: int) -> tuple | None:
        """With ``capacity``: (heads, head dim, slot counts) per block, the counts a routed block
        may run on (its fixed slots, then each larger count :func:`capacity_for` gives, up to
        ``seq_len``); None without."""
        fixed = self.capacities(seq_len)
        if fixed is None:
            return None
        step = _bucket_step(seq_len, self.buckets)
        return tuple(
            (h, hd, (c,) if p["router"] is None else (*range(c, seq_len, step), seq_len))
            for (h, hd, p), c in zip(self.blocks, fixed, strict=True)
        )

    def logits(self, ids, *, return_kept: bool = False):
        """Logits ``[B, T, V]`` of ``ids [B, T]`` (and, with ``return_kept``, the kept tokens
        per block ``[L, B, T]`` and the slots each block ran on)."""
        g = self.config.gpt2
        check_token_batch(ids, g.vocab_size, g.n_positions, "PrunedCascadeLM")
        ids = jnp.asarray(ids)
        plan = self._plan(ids.shape[1])
        if plan is not None:
            weights = [p for _, _, p in self.blocks]
            logits, kept, slots, self._overflow_count = _forward_jit(
                weights, self.wte, self.wpe, self.ln_f, ids, self._overflow_count, plan=plan,
                activation=self.activation,
            )  # fmt: skip
            return (logits, kept, np.asarray(slots).tolist()) if return_kept else logits
        logits, kept, capacities = self._routed_on_host(ids)
        return (logits, kept, capacities) if return_kept else logits

    def _routed_on_host(self, ids):
        b, t = ids.shape
        x = _embed_jit(self.wte, self.wpe, ids)
        keep, count = jnp.ones((b, t), bool), t
        kept, capacities = [], []
        for heads, hd, p in self.blocks:
            if p["router"] is not None:
                keep, most = _route_jit(x, keep, p["ln_1"], *p["router"])
                count = int(most)  # the host decides the compiled shape
            capacity = capacity_for(max(count, 1), t, self.buckets)
            x = _run_block_jit(
                x, keep, p, heads=heads, head_dim=hd, capacity=capacity, activation=self.activation
            )
            kept.append(keep)
            capacities.append(capacity)
        return _logits_jit(x, self.ln_f, self.wte), jnp.stack(kept), capacities

    def flops(self, ids) -> list[ModelFlops]:
        """:func:`~sparse_jax.models.flops.kept_flops` of each row of ``ids`` over the tokens,
        heads and units this model keeps."""
        _, kept, _ = self.logits(ids, return_kept=True)
        return _flops_per_row(self.config.gpt2, kept, self.heads_kept(), self.units_kept())

    def flops_per_token(self, ids) -> float:
        """Forward FLOPs per token on ``ids [B, T]`` (:meth:`flops`)."""
        reports = self.flops(ids)
        return sum(r.total for r in reports) / (len(reports) * ids.shape[1])

    def flops_as_run(self, ids) -> ModelFlops:
        """Forward FLOPs of one row of ``ids [B, T]`` as this model computes it: each block on
        all the slots it ran on for this batch, empty ones included (causal attention over the
        slots), with the heads and units it keeps. Above :meth:`flops` by the empty slots. The
        dense model's FLOPs over these are the speed-up a machine bound by its FLOPs would give.

        Example:
          >>> from flax import nnx
          >>> cfg = CascadeConfig(GPT2Config.preset("tiny"), keep_ratios=(1.0, 0.5),
          ...                     capacity=(1.0, 0.75))
          >>> pruned = CascadeLM(cfg, rngs=nnx.Rngs(0)).prune()
          >>> ids = jnp.zeros((1, 16), jnp.int32)
          >>> pruned.flops_as_run(ids).total == cascade_flops(
          ...     cfg.gpt2, 16, [16, 16], pruned.heads_kept(), pruned.units_kept())
          True
        """
        _, _, slots = self.logits(ids, return_kept=True)
        return kept_flops(
            self.config.gpt2, ids.shape[1], slots, self.heads_kept(), self.units_kept()
        )


def _ln_params(ln) -> tuple[jax.Array, jax.Array, float]:
    return jnp.asarray(ln.scale[...]), jnp.asarray(ln.bias[...]), float(ln.epsilon)


def _layer_norm(x, params):
    scale, bias, eps = params
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _embed(wte, wpe, ids):
    return wte[ids] + wpe[: ids.shape[1]][None]


def _route(x, keep, ln, w, b):
    """Keep a token when it was kept and its router logit is > 0 (the hard gate): ``(keep [B,
    T], the largest count of kept tokens in a row)``."""
    keep = keep & ((_layer_norm(x, ln) @ w + b) > 0)
    return keep, jnp.max(jnp.sum(keep, axis=1))


def _run_block(x, keep, p, *, heads, head_dim, capacity, activation):
    """One block on the kept tokens of each row of ``x [B, T, D]`` (``keep [B, T]``), gathered
    into ``capacity`` slots (enough for every kept token: the caller's guarantee)."""
    b, t, _ = x.shape
    routed = p["router"] is not None  # (static: None or a pair of arrays)
    if not routed and capacity == t:  # every token is kept and has a slot: no gather
        order, valid, gathered = jnp.broadcast_to(jnp.arange(t), (b, t)), keep, x
    else:
        order, valid = _slots(keep, capacity)
        gathered = jnp.take_along_axis(x, order[..., None], axis=1)  # [B, C, D]
    xs = gathered
    if heads:
        qkv = (_layer_norm(xs, p["ln_1"]) @ p["w_attn"] + p["b_attn"]).reshape(
            b, capacity, 3, heads, head_dim
        )
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if p["q_scale"] is not None:
            q = q * p["q_scale"][None, None, :, None]
        # The kept tokens fill the first slots in their order and the empty slots come last,
        # so causal in slot order is causal in position among the kept tokens and leaves the
        # empty slots out of every kept token's keys: the static causal mask (the dense
        # model's engine), with no [B, C, C] mask built.
        out = attention(q, k, v, mask=masks_lib.causal()).reshape(b, capacity, heads * head_dim)
        xs = xs + out @ p["w_proj"] + p["b_proj"]
    else:  # every head closed: attention adds the output projection's bias only
        xs = xs + p["b_proj"]
    hidden = activation_fn(activation)(_layer_norm(xs, p["ln_2"]) @ p["w_fc"] + p["b_fc"])
    xs = xs + hidden @ p["w_mlp"] + p["b_mlp"]
    update = jnp.where(valid[..., None], xs - gathered, 0)
    if not routed and capacity == t:
        return x + update
    return x.at[jnp.arange(b)[:, None], order].add(update)


def _slots(keep: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """``(order [B, C], valid [B, C])``: the positions of each row's kept tokens in the first
    slots, in order (a cumulative count, not a sort: sorting is slow on CPU), then the dropped
    tokens' positions in the empty slots (their updates are discarded); ``valid`` marks the
    kept slots. Needs at most ``capacity`` kept tokens per row (the caller's guarantee)."""
    b, t = keep.shape
    kept_before = jnp.cumsum(keep, axis=1) - 1
    dropped_before = jnp.cumsum(~keep, axis=1) - 1
    count = kept_before[:, -1:] + 1
    slot = jnp.where(keep, kept_before, count + dropped_before)  # a permutation of 0..T-1
    rows = jnp.arange(b)[:, None]
    order = jnp.zeros((b, t), jnp.int32).at[rows, slot].set(jnp.arange(t, dtype=jnp.int32))
    valid = jnp.arange(t)[None] < count
    return order[:, :capacity], valid[:, :capacity]


def _logits(x, ln_f, wte):
    return jnp.einsum("btd,vd->btv", _layer_norm(x, ln_f), wte).astype(jnp.float32)


def _forward(weights, wte, wpe, ln_f, ids, overflows, *, plan, activation):
    """The pruned model in one compiled call. ``plan``: (heads, head dim, slot counts) per
    block, the counts ascending, the first the block's fixed slots; a block runs on the first
    count that holds its batch's kept tokens (``lax.switch``: one count is no switch).
    ``(logits [B, T, V], kept [L, B, T], slots run per block [L], overflows)``, ``overflows``
    plus 1 when a block ran on more than its fixed slots."""
    b, t = ids.shape
    x = _embed(wte, wpe, ids)
    keep = jnp.ones((b, t), bool)
    kept, slots = [], []
    for (heads, head_dim, sizes), p in zip(plan, weights, strict=True):
        run = [
            functools.partial(
                _run_block, p=p, heads=heads, head_dim=head_dim, capacity=c, activation=activation
            )
            for c in sizes
        ]
        if p["router"] is not None:
            keep, count = _route(x, keep, p["ln_1"], *p["router"])
        if len(sizes) == 1:
            x = run[0](x, keep)
            slots.append(jnp.asarray(sizes[0]))
        else:
            index = jnp.sum(count > jnp.asarray(sizes[:-1]))  # the first count >= kept tokens
            x = jax.lax.switch(index, run, x, keep)
            slots.append(jnp.asarray(sizes)[index])
        kept.append(keep)
    slots = jnp.stack(slots)
    over = jnp.any(slots > jnp.asarray([sizes[0] for _, _, sizes in plan]))
    return _logits(x, ln_f, wte), jnp.stack(kept), slots, overflows + over


# Module-level, so that every pruned model of the same shapes shares the compiled functions.
_embed_jit = jax.jit(_embed)
_route_jit = jax.jit(_route)
_run_block_jit = jax.jit(
    _run_block, static_argnames=("heads", "head_dim", "capacity", "activation")
)
_logits_jit = jax.jit(_logits)
_forward_jit = jax.jit(_forward, static_argnames=("plan", "activation"))
