"""GPT-2 in Flax NNX: the dense teacher and its sparse students, one model class.

A :class:`GPT2` is built from a :class:`GPT2Config` (sizes) and one :class:`AttentionSpec` per
block (how that block attends): the teacher uses the default spec (causal softmax); a student
swaps in a fixed sparse :class:`~sparse_jax.masks.Mask` with any normalizer, a learnable
combination of candidate masks, and/or gates on heads and FFN units. Parameter names follow
Hugging Face's ``GPT2LMHeadModel`` (``wte``, ``wpe``, ``h[i].attn.c_attn`` with q, k, v
concatenated on the output axis, ``mlp.c_fc``, ...; kernels ``[in, out]`` like HF's ``Conv1D``),
so weights load by name (:func:`sparse_jax.models.hf.from_pretrained`, which builds a GPT2; this
module does not import it) and a student is made from a teacher by copying its parameters
(:func:`student_from_teacher`).

A model describes itself: :meth:`GPT2.attention_density` (what its heads keep, with learned
choices made hard), :meth:`GPT2.candidate_weights`, :meth:`GPT2.allowed_masks` and
:meth:`GPT2.flops`; densities are defined in :mod:`sparse_jax.models.flops`.

Shapes: ``B`` batch, ``T`` tokens, ``D`` width (``n_embd``), ``N`` heads of a block, ``H`` head
dim (``n_embd // n_head``, also after heads are pruned), ``U`` FFN units, ``V`` vocabulary.

Example:
  >>> from flax import nnx
  >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 5), jnp.int32)).shape  # logits [batch, seq, vocab]
  (2, 5, 101)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import masks as masks_lib
from sparse_jax.models import flops as flops_lib
from sparse_jax.models.layers import (
    COMBINES,
    GATE_KINDS,
    CandidateMaskAttention,
    FixedAttention,
    Gate,
)
from sparse_jax.models.positions import rotate
from sparse_jax.validation import check_choice, check_int, check_token_batch

__all__ = [
    "GPT2",
    "PRESETS",
    "AttentionSpec",
    "GPT2Config",
    "generate",
    "student_from_teacher",
]


# name -> (n_embd, n_layer, n_head, n_positions, vocab_size)
PRESETS = {
    "gpt2": (768, 12, 12, 1024, 50257),
    "gpt2-medium": (1024, 24, 16, 1024, 50257),
    "gpt2-large": (1280, 36, 20, 1024, 50257),
    "gpt2-xl": (1600, 48, 25, 1024, 50257),
    # For tests: odd sizes catch transposition and head-split mistakes.
    "tiny": (48, 2, 3, 37, 101),
    # A CPU-sized model on bytes (the byte tokenizer's 257 ids): the embedded default teacher.
    "cpu-small": (256, 4, 4, 512, 257),
    # The same with 2048 positions: trains at 512 and is measured at 4x that (WikiText-2 study).
    "cpu-long": (256, 4, 4, 2048, 257),
}

# Initial smear logit: each key starts as the mean of its own and the previous position's.
SMEAR_INIT = 0.0
POSITIONS = ("learned", "rotary")  # GPT2Config.positions


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Sizes of a GPT-2 (Hugging Face's ``GPT2Config`` fields of the same names).

    Example:
      >>> cfg = GPT2Config.preset("tiny")
      >>> cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.inner(0)  # D, blocks, N, H, U
      (48, 2, 3, 16, 192)
      >>> cfg.n_positions, cfg.vocab_size  # ids [B, T] with T <= 37 -> logits [B, T, 101]
      (37, 101)
      >>> GPT2Config(n_embd=48, n_head=5)
      Traceback (most recent call last):
      ...
      ValueError: GPT2Config: `n_embd` (48) must be divisible by `n_head` (5)
    """

    vocab_size: int = 50257  # tokens
    n_positions: int = 1024  # longest sequence (the learned position embeddings' rows)
    n_embd: int = 768  # model width D
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block (before pruning)
    n_inner: int | None = None  # FFN width U (None: 4 * n_embd)
    layer_norm_epsilon: float = 1e-5  # LayerNorm epsilon
    activation_function: Literal["gelu_new", "gelu", "relu"] = "gelu_new"  # FFN activation
    heads_per_layer: tuple[int, ...] | None = None  # per-block heads after pruning (None: n_head)
    inner_per_layer: tuple[int, ...] | None = None  # per-block FFN width after pruning
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (parameters stay float32)
    smear_keys: bool = False  # each key mixed with the previous position's (a weight per head)
    # With smear_keys, how many previous positions' keys each key mixes in (a weight per head and
    # position back): 1 is the previous one; more let a head match the few tokens before a key.
    smear_width: int = 1
    # How positions enter: "learned" embeddings added to the tokens' (GPT-2's ``wpe``), or
    # "rotary": no ``wpe``, every attention rotates its queries and keys by their positions
    # (sparse_jax.models.positions.rotate), so scores see only distances and a model trained
    # on short sequences still has a meaning for later positions.
    positions: Literal["learned", "rotary"] = "learned"

    def __post_init__(self):
        # Counts may be numpy integers (sizes read from arrays or files): stored as python ints.
        caller = "GPT2Config"
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            object.__setattr__(self, name, check_int(getattr(self, name), name, caller))
        if self.n_inner is not None:
            object.__setattr__(self, "n_inner", check_int(self.n_inner, "n_inner", caller))
        eps = self.layer_norm_epsilon
        if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
            raise TypeError(
                f"{caller}: `layer_norm_epsilon` must be a finite float > 0; got {eps!r}"
            )
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(
                f"{caller}: `layer_norm_epsilon` must be a finite float > 0 (GPT-2 uses 1e-5); "
                f"got {eps!r}"
            )
        object.__setattr__(self, "layer_norm_epsilon", float(eps))
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config: `n_embd` ({self.n_embd}) must be divisible by `n_head` "
                f"({self.n_head})"
            )
        activations = ("gelu_new", "gelu", "relu")
        check_choice(self.activation_function, "activation_function", activations, caller)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"GPT2Config: `dtype` must be 'float32' or 'bfloat16'; got {self.dtype!r}"
            )
        if not isinstance(self.smear_keys, (bool, np.bool_)):
            raise TypeError(
                f"{caller}: `smear_keys` must be True or False; got {self.smear_keys!r}"
            )
        object.__setattr__(self, "smear_keys", bool(self.smear_keys))
        object.__setattr__(self, "smear_width", check_int(self.smear_width, "smear_width", caller))
        if self.smear_width != 1 and not self.smear_keys:
            raise ValueError(
                f"{caller}: `smear_width`={self.smear_width} mixes keys over the previous "
                "positions: it needs `smear_keys`=True (or smear_width=1)"
            )
        check_choice(self.positions, "positions", POSITIONS, caller)
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"{caller}: `positions`='rotary' turns pairs of features: the head size "
                f"n_embd // n_head = {self.head_dim} must be even"
            )
        for name in ("heads_per_layer", "inner_per_layer"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise TypeError(
                        f"{caller}: `{name}` must be None or {self.n_layer} ints >= 0 (one per "
                        f"block); got {value!r}"
                    )
                value = tuple(value)
                if len(value) != self.n_layer or any(
                    isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral) or x < 0
                    for x in value
                ):
                    raise ValueError(
                        f"{caller}: `{name}` must be {self.n_layer} ints >= 0 (one per "
                        f"block); got {value!r}"
                    )
                object.__setattr__(self, name, tuple(int(x) for x in value))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPT2Config:
        """A named size (:data:`PRESETS`) with optional field overrides.

        Example:
          >>> GPT2Config.preset("gpt2-medium").n_layer
          24
        """
        check_choice(name, "name", tuple(PRESETS), "GPT2Config.preset")
        d, layers, heads, positions, vocab = PRESETS[name]
        fields = dict(n_embd=d, n_layer=layers, n_head=heads, n_positions=positions)
        return cls(**{"vocab_size": vocab, **fields, **overrides})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def heads(self, layer: int) -> int:
        """Heads of block ``layer``."""
        return self.n_head if self.heads_per_layer is None else self.heads_per_layer[layer]

    def inner(self, layer: int) -> int:
        """FFN width of block ``layer``."""
        if self.inner_per_layer is not None:
            return self.inner_per_layer[layer]
        return 4 * self.n_embd if self.n_inner is None else self.n_inner


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How one block attends (default: the dense teacher's causal softmax).

    ``kind="fixed"`` runs ``mask`` (None: causal; per-head masks allowed) under
    ``normalizer`` (optionally a learned α per head); ``kind="candidates"`` learns a
    combination of ``candidates`` (see :class:`~sparse_jax.models.layers.CandidateMaskAttention`).
    ``head_gate`` / ``ffn_gate`` add a gate per head / FFN unit (``"sigmoid_ste"``,
    ``"sigmoid"``, ``"hard_concrete"``; ``"score_scaling"`` for heads scales the scores instead,
    the CANDS code's variant).

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.masks import causal, local
      >>> spec = AttentionSpec(mask=causal() & local(3, 0), normalizer="sparsemax")
      >>> model = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))  # every block
      >>> type(model.h[0].attn.core).__name__, float(model.attention_density(8))  # 26 of 64
      ('FixedAttention', 0.40625)
      >>> student = GPT2(GPT2Config.preset("tiny"), AttentionSpec(kind="candidates",
      ...                granularity="head"), rngs=nnx.Rngs(0))  # the default bank of 7
      >>> [w.shape for w in student.candidate_weights()]  # [N, C] per block
      [(3, 7), (3, 7)]
    """

    kind: Literal["fixed", "candidates"] = "fixed"
    mask: masks_lib.Mask | None = None  # fixed: the mask (None = causal)
    normalizer: str | float = "softmax"  # "softmax", "sparsemax", "entmax15" or α >= 1 (1: softmax)
    learn_alpha: bool = False  # fixed: learn α per head, initialised at `normalizer`
    candidates: tuple[masks_lib.Mask, ...] | None = None  # candidates (None: the default bank)
    granularity: Literal["layer", "head"] = "layer"  # candidates: weights per layer or head
    combine: Literal["soft_union", "soft_mask", "mixture"] = "soft_union"  # candidates
    anchor_self: bool = False  # candidates: each query keeps its own position at weight 1
    weighting: str = "sigmoid"  # candidates: "sigmoid", or a row distribution (sparsemax, ...)
    price_len: int | None = None  # candidates: the serving length expected_cost prices at
    head_gate: str | None = None  # gate kind per head, or None
    ffn_gate: str | None = None  # gate kind per FFN unit, or None
    gate_init: float = 3.0  # initial gate logit (open)
    impl: str = "auto"  # attention implementation (sparse_jax.attention's `impl`)
    block_size: tuple[int, int] = (128, 128)  # block-sparse kernel blocks
    selections: tuple = ()  # fixed: BlockSelections whose chosen blocks heads add to `mask`
    selected: tuple[tuple[bool, ...], ...] | None = None  # fixed: [N, len(selections)] (all)
    head_block_sizes: tuple[tuple[int, int], ...] | None = None  # fixed: blocks per head

    def __post_init__(self):
        caller = "AttentionSpec"
        check_choice(self.kind, "kind", ("fixed", "candidates"), caller)
        check_choice(self.combine, "combine", COMBINES, caller)
        if self.anchor_self and self.combine == "mixture":
            raise ValueError(
                f"{caller}: `anchor_self` needs a log-bias `combine` ('soft_union', 'soft_mask'); "
                "got 'mixture'"
            )
        for name in ("head_gate", "ffn_gate"):
            value = getattr(self, name)
            allowed = GATE_KINDS if name == "head_gate" else GATE_KINDS[:3]
            check_choice(value, name, (None, *allowed), caller)
        if self.candidates is not None:
            object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "selections", tuple(self.selections))
        if self.selected is not None:
            object.__setattr__(self, "selected", tuple(tuple(row) for row in self.selected))
        if self.head_block_sizes is not None:
            object.__setattr__(
                self, "head_block_sizes", tuple(tuple(pair) for pair in self.head_block_sizes)
            )
            if self.kind != "fixed":
                raise ValueError(
                    f"{caller}: `head_block_sizes` belong to kind 'fixed'; got kind {self.kind!r}"
                )
        if self.selections and self.kind != "fixed":
            raise ValueError(
                f"{caller}: `selections` belong to kind 'fixed' (a candidates spec lists them "
                f"among its `candidates`); got kind {self.kind!r}"
            )


def activation_fn(name: str):
    """The FFN activation of ``GPT2Config.activation_function`` (``"gelu_new"``: tanh GELU)."""
    if name == "gelu_new":
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    return jax.nn.relu


def linear_layer(d_in: int, d_out: int, rngs: nnx.Rngs, std: float = 0.02) -> nnx.Linear:
    """A GPT-2 projection ``[.., d_in] -> [.., d_out]``: float32 kernel drawn from N(0, std²)."""
    return nnx.Linear(
        d_in, d_out, kernel_init=nnx.initializers.normal(std), rngs=rngs, param_dtype=jnp.float32
    )


class SelfAttention(nnx.Module):
    """GPT-2 attention: ``c_attn`` (q, k, v), an attention core, an optional head gate, and
    ``c_proj``."""

    def __init__(self, config: GPT2Config, layer: int, spec: AttentionSpec, rngs: nnx.Rngs):
        d, h, n = config.n_embd, config.head_dim, config.heads(layer)
        self.num_heads, self.head_dim = n, h
        std_proj = 0.02 / math.sqrt(2 * config.n_layer)
        self.c_attn = linear_layer(d, 3 * n * h, rngs) if n else None
        self.c_proj = linear_layer(n * h, d, rngs, std_proj) if n else None
        if not n:  # every head pruned: the block's attention contributes its bias only
            self.c_proj_bias = nnx.Param(jnp.zeros((d,), jnp.float32))
        if n and spec.kind == "candidates":
            self.core = CandidateMaskAttention(
                n,
                spec.candidates,
                granularity=spec.granularity,
                combine=spec.combine,
                normalizer=spec.normalizer,
                anchor_self=spec.anchor_self,
                weighting=spec.weighting,
                price_len=spec.price_len,
                block_size=spec.block_size,
                head_dim=h,
            )
        elif n:
            self.core = FixedAttention(
                n,
                mask=spec.mask,
                normalizer=spec.normalizer,
                learn_alpha=spec.learn_alpha,
                impl=spec.impl,
                block_size=spec.block_size,
                selections=spec.selections,
                selected=spec.selected,
                head_dim=h,
                head_block_sizes=spec.head_block_sizes,
            )
        self.head_gate = (
            Gate(n, spec.head_gate, init=spec.gate_init) if n and spec.head_gate else None
        )
        self.rotary = config.positions == "rotary"
        # Smeared keys: learned weights per head on the previous positions' keys (see smear()):
        # [N] for the previous position alone (smear_width 1), else [N, smear_width].
        width = config.smear_width
        shape = (n,) if width == 1 else (n, width)
        self.smear_logit = (
            nnx.Param(jnp.full(shape, SMEAR_INIT, jnp.float32)) if n and config.smear_keys else None
        )

    def head_densities(self, seq_len: int, *, threshold: float | None = None) -> jax.Array:
        """float32 ``[N]``: each head's density at ``seq_len`` with its learned choices made hard:
        the core's :meth:`~sparse_jax.models.layers.FixedAttention.head_densities` (candidate
        weights kept at ``threshold``), 0 for a head whose gate is closed (a
        ``"score_scaling"`` gate closes nothing). Empty ``[0]`` when every head is pruned."""
        if not self.num_heads:
            return jnp.zeros((0,), jnp.float32)
        d = self.core.head_densities(seq_len, threshold=threshold)
        gate = self.head_gate
        if gate is None or gate.kind == "score_scaling":
            return d
        return d * gate.hard_values()

    def project_qkv(
        self, x: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values ``[B, T, N, H]`` of the block's normalized input ``x [B, T,
        D]`` as the scores see them (keys smeared, and with rotary positions queries and keys
        turned by ``positions [T]``, None: ``0 .. T-1``), before any score-scaling gate; needs
        ``num_heads > 0``.

        Example:
          >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
          >>> q, k, v = model.h[0].attn.project_qkv(jnp.ones((1, 5, 48)))
          >>> q.shape  # [B, T, N, H]
          (1, 5, 3, 16)
        """
        b, t, _ = x.shape
        qkv = self.c_attn(x).reshape(b, t, 3, self.num_heads, self.head_dim)
        q, k = qkv[:, :, 0], self.smear(qkv[:, :, 1])
        if self.rotary:
            positions = jnp.arange(t) if positions is None else positions
            q, k = rotate(q, positions), rotate(k, positions)
        return q, k, qkv[:, :, 2]

    def smear(self, k: jax.Array, previous: jax.Array | None = None) -> jax.Array:
        """Keys ``[B, T, N, H]`` as the scores see them: with ``GPT2Config.smear_keys``, each
        head's key at position j becomes ``(1 - w) k_j + w k_{j-1}``, ``w = sigmoid
        (smear_logit)`` per head, so a query can find the token that *follows* a match in one
        layer (the step an induction head otherwise needs a previous-token head for);
        ``previous [B, N, H]`` is the key before the first position (decoding: the cached
        one; None: zeros). Without smearing, ``k`` unchanged.

        With ``GPT2Config.smear_width`` W > 1, the key at j is ``Σ_{i=0..W} a_i k_{j-i}`` with
        ``a = softmax([0, smear_logit[n]])`` per head (``smear_logit [N, W]``; W = 1 is the
        formula above), so a head can match the few tokens before a key; ``previous [B, W, N,
        H]`` holds the W keys before the first position, oldest first.

        Example:
          >>> cfg = GPT2Config.preset("tiny", smear_keys=True)
          >>> attn = GPT2(cfg, rngs=nnx.Rngs(0)).h[0].attn
          >>> k = jnp.ones((1, 3, 3, 16)).at[:, 1:].set(3.0)  # [B, T, N, H]
          >>> attn.smear_logit[...] = jnp.zeros(3)  # w = 0.5 in every head
          >>> attn.smear(k)[0, :, 0, 0].tolist()  # (1 - w) k_j + w k_{j-1}, zeros before
          [0.5, 2.0, 3.0]
        """
        if self.smear_logit is None:
            return k
        logits = self.smear_logit[...]
        if logits.ndim == 1:
            if previous is None:
                previous = jnp.zeros_like(k[:, 0])
            before = jnp.concatenate([previous[:, None].astype(k.dtype), k[:, :-1]], axis=1)
            w = jax.nn.sigmoid(logits).astype(k.dtype)[None, None, :, None]
            return k + w * (before - k)
        b, t, n, h = k.shape
        width = logits.shape[1]
        if previous is None:
            previous = jnp.zeros((b, width, n, h), k.dtype)
        padded = jnp.concatenate([previous.astype(k.dtype), k], axis=1)  # [B, W + T, N, H]
        a = jax.nn.softmax(jnp.concatenate([jnp.zeros((n, 1)), logits], axis=1), axis=1)
        a = a.astype(k.dtype)  # [N, W + 1]: tap i weighs the key i positions back
        return sum(
            a[None, None, :, i, None] * padded[:, width - i : width - i + t]
            for i in range(width + 1)
        )

    def smear_history(self, k: jax.Array, previous: jax.Array | None) -> jax.Array | None:
        """The raw keys a decoding cache keeps for the next call's :meth:`smear`: the last one
        ``[B, N, H]`` (smear_width 1) or the last W ``[B, W, N, H]``, from this call's raw keys
        ``k [B, T, N, H]`` after the cached ``previous``; None without smearing."""
        if self.smear_logit is None:
            return None
        if self.smear_logit[...].ndim == 1:
            return k[:, -1]
        width = self.smear_logit[...].shape[1]
        if previous is None:
            previous = jnp.zeros((k.shape[0], width, *k.shape[2:]), k.dtype)
        return jnp.concatenate([previous.astype(k.dtype), k], axis=1)[:, -width:]

    def __call__(self, x, positions, *, cache=None, rngs=None):
        """``x [B, T, D]`` at ``positions [T]`` (used by rotary positions only)."""
        b, t, _ = x.shape
        if not self.num_heads:
            return jnp.broadcast_to(self.c_proj_bias[...].astype(x.dtype), x.shape), {}, cache
        n, h = self.num_heads, self.head_dim
        qkv = self.c_attn(x).reshape(b, t, 3, n, h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        gate = self.head_gate
        if gate is not None and gate.kind == "score_scaling":
            q = q * gate.values().astype(q.dtype)[None, None, :, None]
        if cache is not None:  # decoding: write k, v at the cache index, attend to the prefix
            index = cache["index"]
            history = self.smear_history(k, cache.get("k_last"))
            k = self.smear(k, cache.get("k_last"))
            if self.rotary:  # the cache holds keys already turned by their own positions
                q, k = rotate(q, positions), rotate(k, positions)
            k_all = jax.lax.dynamic_update_slice(
                cache["k"], k.astype(cache["k"].dtype), (0, index, 0, 0)
            )
            v_all = jax.lax.dynamic_update_slice(
                cache["v"], v.astype(cache["v"].dtype), (0, index, 0, 0)
            )
            cache = {"k": k_all, "v": v_all, "index": index + t}
            if history is not None:
                cache["k_last"] = history.astype(k_all.dtype)
            out, aux = self.core(q, k_all, v_all, q_offset=index, rngs=rngs)
        else:
            k = self.smear(k)
            if self.rotary:
                q, k = rotate(q, positions), rotate(k, positions)
            out, aux = self.core(q, k, v, rngs=rngs)
        aux = {f"mask_{key}": val for key, val in aux.items()}
        if gate is not None and gate.kind != "score_scaling":
            out = gate(out.swapaxes(-1, -2), rngs=rngs).swapaxes(-1, -2)
        if gate is not None:
            aux["head_gate"] = gate.penalty()
        return self.c_proj(out.reshape(b, t, n * h)), aux, cache


class MLP(nnx.Module):
    """GPT-2 FFN: ``c_fc`` -> activation (-> unit gate) -> ``c_proj``."""

    def __init__(self, config: GPT2Config, layer: int, spec: AttentionSpec, rngs: nnx.Rngs):
        d, u = config.n_embd, config.inner(layer)
        self.units = u
        std_proj = 0.02 / math.sqrt(2 * config.n_layer)
        self.c_fc = linear_layer(d, u, rngs) if u else None
        self.c_proj = linear_layer(u, d, rngs, std_proj) if u else None
        if not u:
            self.c_proj_bias = nnx.Param(jnp.zeros((d,), jnp.float32))
        self.gate = Gate(u, spec.ffn_gate, init=spec.gate_init) if u and spec.ffn_gate else None
        self.act = activation_fn(config.activation_function)

    def __call__(self, x, *, rngs=None):
        if not self.units:
            return jnp.broadcast_to(self.c_proj_bias[...].astype(x.dtype), x.shape), {}
        hidden = self.act(self.c_fc(x))
        aux = {}
        if self.gate is not None:
            hidden = self.gate(hidden, rngs=rngs)
            aux["ffn_gate"] = self.gate.penalty()
        return self.c_proj(hidden), aux


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPT2Config, layer: int, spec: AttentionSpec, rngs: nnx.Rngs):
        eps, d = config.layer_norm_epsilon, config.n_embd
        self.ln_1 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.attn = SelfAttention(config, layer, spec, rngs)
        self.ln_2 = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.mlp = MLP(config, layer, spec, rngs)

    def __call__(self, x, positions, *, cache=None, rngs=None):
        a, aux, cache = self.attn(self.ln_1(x), positions, cache=cache, rngs=rngs)
        x = x + a
        m, aux_mlp = self.mlp(self.ln_2(x), rngs=rngs)
        return x + m, {**aux, **aux_mlp}, cache


class GPT2(nnx.Module):
    """GPT-2 language model with pluggable attention per block (see the module docstring).

    Args:
      config: sizes.
      attention: one :class:`AttentionSpec` for every block, or a sequence of one per block.
      rngs: ``nnx.Rngs`` for the initial parameters (GPT-2's: normal(0.02), residual
        projections scaled by ``1 / sqrt(2 * n_layer)``).

    Call: ``model(ids [B, T], *, rngs=None, return_aux=False)`` -> logits ``[B, T, V]``
    (float32), or ``(logits, aux)`` where ``aux`` sums each penalty over the blocks
    (``mask_l1``, ``mask_density``, ``mask_expected_density``, ``mask_expected_cost``,
    ``mask_selector_kl`` with learned block selections, ``head_gate``, ``ffn_gate``). ``rngs``
    samples Hard
    Concrete gates (training); without it gates are deterministic.

    Example:
      >>> from flax import nnx
      >>> spec = AttentionSpec(head_gate="sigmoid_ste")  # a gate per head, every block
      >>> model = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
      >>> logits, aux = model(jnp.zeros((2, 5), jnp.int32), return_aux=True)  # ids [B, T]
      >>> logits.shape, logits.dtype, sorted(aux)  # logits [B, T, V]
      ((2, 5, 101), dtype('float32'), ['head_gate'])
    """

    def __init__(
        self,
        config: GPT2Config,
        attention: AttentionSpec | Sequence[AttentionSpec] = AttentionSpec(),
        *,
        rngs: nnx.Rngs,
    ):
        if not isinstance(config, GPT2Config):
            raise TypeError(f"GPT2: `config` must be a GPT2Config; got {type(config).__name__}")
        specs = (
            (attention,) * config.n_layer
            if isinstance(attention, AttentionSpec)
            else tuple(attention)
        )
        if len(specs) != config.n_layer or not all(isinstance(s, AttentionSpec) for s in specs):
            raise ValueError(
                f"GPT2: `attention` must be an AttentionSpec or {config.n_layer} of them (one per "
                f"block); got {attention!r:.200}"
            )
        self.config, self.specs = config, specs
        d = config.n_embd
        self.wte = nnx.Embed(
            config.vocab_size, d, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )
        self.wpe = (
            nnx.Embed(
                config.n_positions, d, embedding_init=nnx.initializers.normal(0.01), rngs=rngs
            )
            if config.positions == "learned"
            else None  # rotary: positions enter the attentions
        )
        self.h = nnx.List([Block(config, i, specs[i], rngs) for i in range(config.n_layer)])
        self.ln_f = nnx.LayerNorm(d, epsilon=config.layer_norm_epsilon, rngs=rngs)

    def __call__(self, ids, *, rngs: nnx.Rngs | None = None, return_aux: bool = False):
        """Logits ``[B, T, vocab_size]`` (float32) of token ids ``[B, T]`` (and the aux losses).

        Ids must lie in ``[0, vocab_size)``. Concrete ids (numpy or jax arrays, outside
        ``jit``) are checked here: an id out of range raises ``ValueError`` naming it and its
        place. Under ``jit`` the ids are tracers and cannot be checked without a host sync:
        there an out-of-range id, negative ones included, embeds as NaN, so its logits and
        those of every later position that attends to it are NaN (never a silent wrong token).
        """
        check_token_batch(ids, self.config.vocab_size, self.config.n_positions, "GPT2")
        logits, aux, _ = self._forward(ids, jnp.arange(ids.shape[1]), None, rngs)
        return (logits, aux) if return_aux else logits

    def embed(self, ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The first block's input ``[B, T, D]`` in the model's dtype: token embeddings of ids
        ``[B, T]`` plus, with learned positions, the embeddings of ``positions [T]``; an id
        outside ``[0, vocab_size)`` embeds as NaN (see :meth:`__call__`).

        Example:
          >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
          >>> x = model.embed(jnp.array([[1, 2, -1]]), jnp.arange(3))  # [B, T, D]
          >>> x.shape, bool(jnp.isnan(x[0, 2]).all()), bool(jnp.isfinite(x[0, :2]).all())
          ((1, 3, 48), True, True)
        """
        # Ids outside [0, vocab_size) cannot be refused under jit (they are tracers there): each
        # embeds as NaN (a negative id would otherwise wrap around to another token), so its
        # logits, and those after it, are NaN. The lookup itself is left as it is (a select on
        # its output), so that in-range ids compute exactly what they did without the guard.
        outside = (ids < 0) | (ids >= self.config.vocab_size)
        tokens = jnp.where(outside[..., None], jnp.nan, self.wte(ids))
        if self.wpe is not None:
            tokens = tokens + self.wpe(positions)[None]
        return tokens.astype(jnp.dtype(self.config.dtype))

    def _forward(self, ids, positions, caches, rngs):
        dtype = jnp.dtype(self.config.dtype)
        x = self.embed(ids, positions)
        totals: dict[str, jax.Array] = {}
        new_caches = []
        for i, block in enumerate(self.h):
            cache = None if caches is None else caches[i]
            x, aux, cache = block(x, positions, cache=cache, rngs=rngs)
            new_caches.append(cache)
            for key, val in aux.items():
                totals[key] = totals.get(key, 0.0) + val
        x = self.ln_f(x)
        logits = jnp.einsum("btd,vd->btv", x, self.wte.embedding[...].astype(dtype))
        return logits.astype(jnp.float32), totals, new_caches

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> list[dict[str, jax.Array]]:
        """Empty key/value caches ``[B, max_len, N, H]`` per block, and the write index (and,
        with smeared keys, the last raw key ``k_last [B, N, H]``, or the last ``smear_width``
        ones ``[B, W, N, H]``)."""
        if max_len > self.config.n_positions:
            raise ValueError(
                f"GPT2.init_cache: `max_len`={max_len} exceeds n_positions="
                f"{self.config.n_positions}"
            )
        caches = []
        for block in self.h:
            shape = (batch, max_len, block.attn.num_heads, block.attn.head_dim)
            cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            if block.attn.smear_logit is not None:  # the raw keys before the next position
                width = self.config.smear_width
                history = (batch, *shape[2:]) if width == 1 else (batch, width, *shape[2:])
                cache["k_last"] = jnp.zeros(history, dtype)
            caches.append({**cache, "index": jnp.int32(0)})
        return caches

    def attention_density(self, seq_len: int, *, threshold: float | None = None) -> jax.Array:
        """float32 scalar: the mean density at ``seq_len`` over every head of the model, with its
        learned choices made hard (:meth:`SelfAttention.head_densities`: candidate weights kept
        at ``threshold`` as :func:`~sparse_jax.models.harden` keeps them, a closed head gate
        counts 0). Traceable, so a training step can log it; 0.0 when no head is left.

        Example:
          >>> from flax import nnx
          >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
          >>> float(model.attention_density(4))  # causal: 10 of 16 entries
          0.625
        """
        seq_len = check_int(seq_len, "seq_len", "GPT2.attention_density")
        values = [
            b.attn.head_densities(seq_len, threshold=threshold) for b in self.h if b.attn.num_heads
        ]
        return jnp.mean(jnp.concatenate(values)) if values else jnp.float32(0.0)

    def candidate_weights(self) -> tuple[jax.Array | None, ...]:
        """Per block, the candidate weights ``[1 or N, C]`` of a learned-mask block
        (:meth:`~sparse_jax.models.layers.CandidateMaskAttention.candidate_weights`), None for
        other blocks. Differentiable.

        Example:
          >>> from flax import nnx
          >>> spec = AttentionSpec(kind="candidates", candidates=(masks_lib.causal(),))
          >>> [w.shape for w in GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
          ...  .candidate_weights()]
          [(1, 1), (1, 1)]
        """
        return tuple(
            b.attn.core.candidate_weights()
            if b.attn.num_heads and isinstance(b.attn.core, CandidateMaskAttention)
            else None
            for b in self.h
        )

    def allowed_masks(self) -> tuple[masks_lib.Mask | None, ...]:
        """Per block, the static mask of every pair its heads may attend to (a learned-mask
        block: the union of its candidates), None for a block whose heads were all pruned."""
        return tuple(b.attn.core.allowed_mask() if b.attn.num_heads else None for b in self.h)

    def flops(self, seq_len: int, *, batch: int = 1) -> flops_lib.ModelFlops:
        """Analytic forward FLOPs on ``batch`` sequences of ``seq_len`` tokens, layer by layer
        (:func:`sparse_jax.models.flops.model_flops`).

        Example:
          >>> from flax import nnx
          >>> GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0)).flops(8).lm_head == 2 * 8 * 48 * 101
          True
        """
        return flops_lib.model_flops(self, seq_len, batch=batch)

    def decode(self, ids, caches):
        """Runs ``ids [B, T]`` at the caches' current position; returns ``(logits, caches)``."""
        index = caches[0]["index"]
        positions = index + jnp.arange(ids.shape[1])
        logits, _, caches = self._forward(ids, positions, caches, None)
        return logits, caches


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k"))
def _generate(graphdef, state, prompt, rng, *, max_new_tokens, temperature, top_k):
    model = nnx.merge(graphdef, state)
    b, p = prompt.shape
    caches = model.init_cache(b, p + max_new_tokens)
    logits, caches = model.decode(prompt, caches)

    def pick(last, key):  # last [B, V] -> next token [B]
        if temperature == 0.0:
            return jnp.argmax(last, axis=-1).astype(prompt.dtype)
        scaled = last / temperature
        if top_k is not None:
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        return jax.random.categorical(key, scaled, axis=-1).astype(prompt.dtype)

    def step(carry, key):
        caches, last = carry
        token = pick(last, key)
        logits, caches = model.decode(token[:, None], caches)
        return (caches, logits[:, -1]), (token, last)

    keys = jax.random.split(rng, max_new_tokens)
    _, (tokens, step_logits) = jax.lax.scan(step, (caches, logits[:, -1]), keys)
    return jnp.concatenate([prompt, tokens.T], axis=1), jnp.swapaxes(step_logits, 0, 1)


def generate(
    model: GPT2,
    prompt_ids: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    rng: jax.Array | None = None,
    return_logits: bool = False,
):
    """Samples ``max_new_tokens`` tokens after ``prompt_ids [B, P]`` with a key/value cache.

    One jitted program: the prompt fills the caches in one pass, then ``lax.scan`` decodes a
    token at a time (each step attends to the cache through the masks' predicates at the
    current position, so sparse masks, candidate mixtures and gates behave as in a full
    forward pass).

    Args:
      model: a :class:`GPT2` (any attention).
      prompt_ids: int ``[B, P]``, ``P >= 1``, ``P + max_new_tokens <= n_positions``.
      max_new_tokens: tokens to add (>= 1).
      temperature: 0 for greedy decoding, else the softmax temperature of sampling.
      top_k: sample among the ``top_k`` most likely tokens (None: all).
      rng: a PRNG key (required when ``temperature > 0``).
      return_logits: also return the logits that chose each new token ``[B, max_new, V]``.

    Returns:
      ``ids [B, P + max_new_tokens]`` (and the logits).

    Example:
      >>> from flax import nnx
      >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
      >>> generate(model, jnp.zeros((2, 3), jnp.int32), 4, temperature=0.0).shape
      (2, 7)
    """
    caller = "generate"
    if not isinstance(model, GPT2):
        raise TypeError(f"{caller}: `model` must be a GPT2; got {type(model).__name__}")
    g = model.config
    check_token_batch(prompt_ids, g.vocab_size, g.n_positions, caller, "prompt_ids")
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", caller)
    total = prompt_ids.shape[1] + max_new_tokens
    if total > model.config.n_positions:
        raise ValueError(
            f"{caller}: prompt ({prompt_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) = "
            f"{total} exceeds n_positions={model.config.n_positions}"
        )
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"{caller}: `temperature` must be a float >= 0; got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"{caller}: `temperature` must be a finite float >= 0; got {temperature!r}"
        )
    if top_k is not None:
        top_k = check_int(top_k, "top_k", caller, high=model.config.vocab_size)
    if temperature > 0 and rng is None:
        raise ValueError(f"{caller}: sampling with temperature={temperature} needs `rng`")
    graphdef, state = nnx.split(model)
    ids, logits = _generate(
        graphdef,
        state,
        jnp.asarray(prompt_ids),
        jax.random.key(0) if rng is None else rng,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
    )
    return (ids, logits) if return_logits else ids


def student_from_teacher(
    teacher: GPT2,
    attention: AttentionSpec | Sequence[AttentionSpec],
    *,
    rngs: nnx.Rngs | None = None,
) -> GPT2:
    """A student with the teacher's sizes and weights and different attention.

    Every parameter the two models share by name and shape is copied (embeddings, LayerNorms,
    projections); parameters only the student has (candidate weights, gates, α) keep their
    initial values.

    Example:
      >>> from flax import nnx
      >>> teacher = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
      >>> student = student_from_teacher(teacher, AttentionSpec(normalizer="sparsemax"))
      >>> ids = jnp.zeros((1, 4), jnp.int32)
      >>> student(ids).shape
      (1, 4, 101)
    """
    student = GPT2(teacher.config, attention, rngs=rngs or nnx.Rngs(0))
    teacher_params = dict(nnx.to_flat_state(nnx.state(teacher, nnx.Param)))
    student_state = nnx.state(student, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(student_state):
        src = teacher_params.get(path)
        if src is not None and src[...].shape == var[...].shape:
            var = var.replace(jnp.array(src[...], copy=True))  # own buffers, not the teacher's
        flat.append((path, var))
    nnx.update(student, nnx.from_flat_state(flat))
    return student
