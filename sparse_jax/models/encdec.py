"""A sparse encoder–decoder for chain-of-thought reasoning (the "GiantRabbit" study's design).

Shapes: ``B`` batch, ``S`` source (question) length, ``T`` target (chain of thought and answer)
length, ``D`` model width, ``N`` heads, ``V`` vocabulary.

The architecture, each part a switch of :class:`EncDecConfig` (all switches off: a plain dense
softmax encoder–decoder of the same size, the baseline):

* ``SparseEmbed(x) = E[x] ⊙ M`` (``embed_keep < 1``): ``M`` keeps a fraction ``embed_keep`` of
  the embedding dimensions, either a fixed random set drawn once (``embed_mask="random"``, the
  default: every token uses the same dimensions, so the embedding table really shrinks to
  ``V x round(keep·D)``, and nothing in the mask depends on the data) or each token's largest
  entries by magnitude (``"magnitude"``, :func:`sparse_jax.topk_mask`; it keeps more of each
  row's information but saves no parameters). Sinusoidal positions are added after the mask,
  and with ``literal_tokens`` (not a sparsity switch: the baseline has it too) learned
  embeddings of each token's depth, row and column in bracketed literals such as
  ``[[1, 2], [3, 4]]`` (:func:`literal_coordinates`), in the question and in the decoder's
  input, so that an entry of a matrix can be found by where it sits, whatever text precedes it.
  With ``positions="rotary"`` no sinusoids are added: every self-attention rotates its queries
  and keys by their positions instead (:func:`~sparse_jax.models.positions.rotate`), so that a
  head can look a fixed distance back wherever it is (e.g. from a number to the ``m =`` before
  it).
* Encoder layers (post-norm, "Add & Norm"): self-attention ``normalizer(QKᵀ/√d + M) V``
  (``normalizer="sparsemax"``; ``M`` is ``-inf`` outside the source's padding and, with
  ``encoder_window``, outside a window of that many keys either side), then an FFN. With
  ``logit_scale = c`` every attention's scores get a learned factor per head, ``c_h QKᵀ/√d``,
  starting at ``c`` (for sparsemax it sets how many keys a head keeps, not only how peaked its
  weights are). With ``learn_alpha`` every attention is α-entmax with one learned α per head,
  ``α_h = 1 + softplus(θ_h)``, starting at the normalizer's (sparsemax: 2, entmax15: 1.5), so
  that a head may become denser (α → 1 is softmax) or sparser where the loss asks for it.
* A chain-of-thought module (``cot_steps = T_c > 0``): ``C_0`` is the encoder output and
  ``R_t = f_t(SparseEmbed(x), C_{t-1})``: the embedded question is added to ``C_{t-1}``, then a
  self-attention and an FFN (each with Add & Norm); ``C_t = R_t ⊙ M_t`` with ``M_t`` each
  position's ``round(cot_keep·D)`` largest features by magnitude, chosen at that step. The
  decoder reads ``C_{T_c}``.
* Decoder layers: masked self-attention (causal; with ``decoder_window`` only that many recent
  tokens plus the first ``decoder_sinks``: the mask algebra's ``causal() & (local(w - 1, 0) |
  sink(s))``) and cross-attention to the reasoning context, combined as in the study,
  ``H_d = FFN(A_self·V + A_cross·C) ⊙ M_d`` (``M_d``: each position's ``round(decoder_keep·D)``
  largest FFN outputs), with Add & Norm around the attention sum and the FFN. The
  cross-attention's queries are the layer's input, in parallel with the self-attention
  (``cross_queries="input"``, the study's form), or ``LN(y + A_self·V)``, what the
  self-attention found (``"self"``: a one-layer decoder can then look up in the question what
  its recent tokens ask for, e.g. the entry after ``m = ``; the baseline has the same).
* A final linear layer and the output distribution: ``output="sparsemax"`` trains with the
  sparsemax Fenchel–Young loss (:func:`sparse_jax.sparsemax_loss`), ``"softmax"`` with cross
  entropy. Greedy decoding takes the argmax either way.

:func:`greedy_decode` decodes with a key/value cache (the cross-attention keys and values are
computed once per question; with ``decoder_window`` the self-attention cache holds only the
sinks and a ring of the window's tokens); its logits equal the full forward pass's (a test).

Example:
  >>> from flax import nnx
  >>> cfg = EncDecConfig(vocab_size=11, d_model=16, num_heads=2, d_ff=32, cot_steps=1)
  >>> model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
  >>> src = jnp.ones((2, 5), jnp.int32); tgt = jnp.ones((2, 4), jnp.int32)
  >>> model(src, jnp.array([5, 3]), tgt).shape  # [batch, target, vocab]
  (2, 4, 11)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import masks as masks_lib
from sparse_jax.dispatch import attention
from sparse_jax.dynamic import topk_mask
from sparse_jax.models.positions import rotate, sinusoid
from sparse_jax.normalizers import NORMALIZERS, sparsemax_loss
from sparse_jax.validation import (
    ALPHA_OF_NORMALIZER,
    check_alpha_start,
    check_bool,
    check_choice,
    check_int,
)

__all__ = [
    "EncDecConfig",
    "EncoderDecoder",
    "describe",
    "greedy_decode",
    "literal_coordinates",
    "literal_step",
    "sequence_loss",
]

OUTPUTS = ("softmax", "sparsemax")
EMBED_MASKS = ("random", "magnitude")
CROSS_QUERIES = ("input", "self")
POSITIONS = ("sinusoid", "rotary")


@dataclasses.dataclass(frozen=True)
class EncDecConfig:
    """Sizes and switches of :class:`EncoderDecoder` (defaults: the sparse model; see
    :meth:`dense` for its baseline).

    The model it describes maps ``source [B, S]`` and ``target [B, T]`` token ids to logits
    ``[B, T, V]`` (``V = vocab_size``), with width ``D = d_model`` split into ``N = num_heads``
    heads of ``head_dim = D / N``.

    Example:
      >>> cfg = EncDecConfig(vocab_size=11, d_model=16, num_heads=2, d_ff=32, decoder_window=2)
      >>> cfg.head_dim  # D / N
      8
      >>> cfg.decoder_mask().dense(3, 3).astype(int)  # [T, T]: the 2 most recent tokens
      array([[1, 0, 0],
             [1, 1, 0],
             [0, 1, 1]])
      >>> cfg.dense().normalizer, cfg.dense().decoder_window  # the baseline of the same size
      ('softmax', None)
    """

    vocab_size: int = 260  # token ids in [0, vocab_size)
    d_model: int = 128  # D, the width of every layer
    num_heads: int = 4  # N, heads of every attention (D must divide by it)
    encoder_layers: int = 2  # encoder self-attention + FFN layers
    decoder_layers: int = 2  # decoder layers
    d_ff: int = 512  # FFN inner width
    normalizer: str = "sparsemax"  # every attention's normalizer: softmax/sparsemax/entmax15
    logit_scale: float | None = None  # a learned per-head factor on QKᵀ/√d, starting here
    learn_alpha: bool = False  # α-entmax attention, α learned per head from the normalizer's
    output: Literal["softmax", "sparsemax"] = "sparsemax"  # output distribution and its loss
    embed_keep: float = 0.5  # SparseEmbed: kept fraction of embedding dims, (0, 1] (1: off)
    embed_mask: Literal["random", "magnitude"] = "random"  # which dims SparseEmbed keeps
    encoder_window: int | None = None  # encoder keys within this distance either side (None: all)
    cot_steps: int = 2  # chain-of-thought steps T_c (0: the decoder reads the encoder output)
    cot_keep: float = 0.5  # kept fraction of features at each CoT step, (0, 1] (1: off)
    decoder_keep: float = 1.0  # kept fraction of each decoder FFN output, (0, 1] (1: off)
    decoder_window: int | None = None  # decoder self-attention: recent keys kept (None: causal)
    decoder_sinks: int = 0  # with decoder_window: the first tokens every query also sees
    decoder_block: int = 16  # blocks of a windowed decoder's mask (see decoder_mask)
    # What a decoder layer's cross-attention queries are formed from: the layer's input, in
    # parallel with its self-attention (the study's form), or "self", LN(y + A_self(y)), what
    # the self-attention found (not a sparsity switch: the baseline has the same).
    cross_queries: Literal["input", "self"] = "input"
    # How positions enter: sinusoids added to the embeddings, or "rotary": every
    # self-attention's queries and keys rotated by their positions (RoPE), so that a score
    # depends on the distance between two tokens, not on where they are (the cross-attention
    # has none: a question's and a solution's positions are not comparable). Not a sparsity
    # switch: the baseline has the same.
    positions: Literal["sinusoid", "rotary"] = "sinusoid"
    # Token ids (open, close, separator) of bracketed literals such as [[1, 2], [3, 4]]: when
    # set, every token also gets learned embeddings of where it sits in one (literal_coordinates).
    literal_tokens: tuple[int, int, int] | None = None
    seed: int = 0  # draws the fixed random SparseEmbed dimensions

    def __post_init__(self):
        caller = "EncDecConfig"
        for name in ("vocab_size", "d_model", "num_heads", "encoder_layers", "decoder_layers"):
            check_int(getattr(self, name), name, caller)
        check_int(self.d_ff, "d_ff", caller)
        check_int(self.decoder_block, "decoder_block", caller)
        for name in ("cot_steps", "decoder_sinks", "seed"):
            check_int(getattr(self, name), name, caller, low=0)
        for name in ("encoder_window", "decoder_window"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, caller)
        if self.d_model % self.num_heads:
            raise ValueError(
                f"{caller}: `num_heads`={self.num_heads} must divide `d_model`={self.d_model}"
            )
        check_choice(self.normalizer, "normalizer", NORMALIZERS, caller)
        if self.logit_scale is not None and not (
            isinstance(self.logit_scale, (int, float))
            and not isinstance(self.logit_scale, bool)
            and 0 < self.logit_scale < math.inf
        ):
            raise ValueError(
                f"{caller}: `logit_scale` must be a finite number > 0 or None; "
                f"got {self.logit_scale!r}"
            )
        object.__setattr__(self, "learn_alpha", check_bool(self.learn_alpha, "learn_alpha", caller))
        if self.learn_alpha:
            check_alpha_start(self.normalizer, caller)
        check_choice(self.output, "output", OUTPUTS, caller)
        check_choice(self.cross_queries, "cross_queries", CROSS_QUERIES, caller)
        check_choice(self.positions, "positions", POSITIONS, caller)
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"{caller}: `positions`='rotary' rotates pairs of features: the head size "
                f"`d_model` / `num_heads` = {self.d_model // self.num_heads} must be even"
            )
        check_choice(self.embed_mask, "embed_mask", EMBED_MASKS, caller)
        for name in ("embed_keep", "cot_keep", "decoder_keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"{caller}: `{name}` must be in (0, 1] (1: off); got {value!r}")
        if self.literal_tokens is not None:
            ids = self.literal_tokens
            if (
                not isinstance(ids, (tuple, list))
                or len(ids) != 3
                or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids)
                or len(set(ids)) != 3
                or not all(0 <= i < self.vocab_size for i in ids)
            ):
                raise ValueError(
                    f"{caller}: `literal_tokens` must be None or 3 distinct token ids (open, "
                    f"close, separator) in [0, vocab_size={self.vocab_size}); got {ids!r}"
                )
            object.__setattr__(self, "literal_tokens", tuple(int(i) for i in ids))  # JSON: list
        if self.decoder_sinks and self.decoder_window is None:
            raise ValueError(
                f"{caller}: `decoder_sinks`={self.decoder_sinks} needs a `decoder_window` (without "
                "one every query already sees the first tokens)"
            )

    def dense(self) -> EncDecConfig:
        """The baseline of the same size: every switch off (softmax attention and outputs, no
        feature masks, no windows). The chain-of-thought steps stay (they are layers, not a
        sparsity switch), so both models have the same parameters and depth."""
        return dataclasses.replace(
            self,
            normalizer="softmax",
            logit_scale=None,
            learn_alpha=False,
            output="softmax",
            embed_keep=1.0,
            encoder_window=None,
            cot_keep=1.0,
            decoder_keep=1.0,
            decoder_window=None,
            decoder_sinks=0,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def decoder_mask(self) -> masks_lib.Mask:
        """The decoder self-attention's static mask (the mask algebra).

        With a window, the forward pass hands it to :func:`sparse_jax.attention` as a mask
        object with blocks of ``decoder_block`` x ``decoder_block``, so that ``impl="auto"``
        can take the block-sparse kernel, which skips the blocks the window leaves empty; a
        plain causal mask goes as a dense array (half its blocks are kept, and at a few hundred
        positions the block-sparse kernel measured no faster there:
        docs/archive/results-history.md, "The window through the block-sparse kernel").
        """
        if self.decoder_window is None:
            return masks_lib.causal()
        keep = masks_lib.local(self.decoder_window - 1, 0)
        if self.decoder_sinks:
            keep = keep | masks_lib.sink(self.decoder_sinks)
        return masks_lib.causal() & keep

    def encoder_mask(self) -> masks_lib.Mask | None:
        """The encoder's static mask (None: every source position)."""
        if self.encoder_window is None:
            return None
        return masks_lib.local(self.encoder_window, self.encoder_window)


LITERAL_SLOTS = 16  # rows and columns of a literal told apart (later ones share the last)
LITERAL_DEPTHS = 4  # bracket depths told apart (0: outside every literal)


def literal_step(state: jax.Array, token: jax.Array, literal_tokens) -> jax.Array:
    """One token's move through bracketed literals: ``state [..., 3]`` = (depth, row, column)
    before ``token [...]``, the state after it. An open bracket goes one level deeper and
    starts a column count (at depth 1 also a row count); a separator at depth 1 starts the
    next row (a vector's entries are rows, as for a column vector), deeper the next column; a
    close bracket goes one level up. Other tokens leave the state as it is.

    Example (ids of ``[``, ``]``, ``,``: 1, 2, 3):
      >>> state = jnp.zeros((3,), jnp.int32)
      >>> for token in (1, 1, 3, 2, 3):  # "[[", ",", "]", ","
      ...     state = literal_step(state, jnp.int32(token), (1, 2, 3))
      >>> state.tolist()  # depth 1, row 1 (the next row), column 0
      [1, 1, 0]
    """
    open_id, close_id, sep_id = literal_tokens
    depth, row, col = state[..., 0], state[..., 1], state[..., 2]
    is_open, is_close, is_sep = token == open_id, token == close_id, token == sep_id
    new_depth = jnp.where(is_open, depth + 1, jnp.where(is_close, jnp.maximum(depth - 1, 0), depth))
    row = jnp.where(is_open & (new_depth == 1), 0, jnp.where(is_sep & (depth == 1), row + 1, row))
    col = jnp.where(
        is_open | (is_sep & (depth == 1)), 0, jnp.where(is_sep & (depth >= 2), col + 1, col)
    )
    return jnp.stack([new_depth, row, col], axis=-1)


def literal_coordinates(ids: jax.Array, literal_tokens) -> jax.Array:
    """Where each token of ``ids [B, L]`` sits in bracketed literals, ``[B, L, 3]`` int32:
    (depth, row, column) after reading it (:func:`literal_step` from (0, 0, 0)). An entry of a
    matrix ``[[a, b], [c, d]]`` gets its (row, column), ``d`` (2, 1, 1); the entries of a
    vector ``[x, y]`` are its rows, ``y`` (1, 1, 0): what copying ``A`` and ``b`` into
    ``[A | b]`` needs to find, whatever text comes before them.

    Example (byte ids; each digit's (depth, row, column)):
      >>> text = b"A = [[1, 2], [3, 4]], b = [5, 6]"  # b's entries are its rows
      >>> where = literal_coordinates(jnp.array([list(text)]), tuple(b"[],"))[0].tolist()
      >>> {chr(t): w[1:] for t, w in zip(text, where) if chr(t).isdigit()}  # (row, column)
      {'1': [0, 0], '2': [0, 1], '3': [1, 0], '4': [1, 1], '5': [0, 0], '6': [1, 0]}
      >>> where[text.index(b"4")][0], where[text.index(b"6")][0]  # depth: matrix, vector
      (2, 1)
    """
    start = jnp.zeros((ids.shape[0], 3), jnp.int32)

    def step(state, token):
        state = literal_step(state, token, literal_tokens)
        return state, state

    _, states = jax.lax.scan(step, start, ids.T)
    return states.swapaxes(0, 1)


def keep_largest(x: jax.Array, keep: float) -> jax.Array:
    """``x ⊙ M`` with ``M`` each row's ``round(keep·D)`` largest ``|x|`` (last axis); ``x``
    itself when ``keep == 1``. The mask is not differentiated (gradients reach kept entries).

    Example:
      >>> keep_largest(jnp.array([[1.0, -3.0, 2.0, 0.5]]), 0.5).tolist()
      [[0.0, -3.0, 2.0, 0.0]]
    """
    if keep >= 1:
        return x
    k = max(1, round(keep * x.shape[-1]))
    m = topk_mask(jax.lax.stop_gradient(jnp.abs(x)).astype(jnp.float32), k)
    return jnp.where(m, x, jnp.zeros((), x.dtype))


def _softplus_inverse(cfg: EncDecConfig) -> float:
    """θ with ``1 + softplus(θ)`` the configured normalizer's α (learn_alpha's start)."""
    return math.log(math.expm1(ALPHA_OF_NORMALIZER[cfg.normalizer] - 1.0))


class Attention(nnx.Module):
    """Multi-head attention ``[B, Tq, D]`` x ``[B, Tk, D]`` -> ``[B, Tq, D]`` under the
    configured normalizer and a bool mask broadcastable to ``[B, N, Tq, Tk]`` (True = may
    attend), through :func:`sparse_jax.attention`."""

    def __init__(self, cfg: EncDecConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.num_heads, self.head_dim, self.normalizer = cfg.num_heads, cfg.head_dim, cfg.normalizer
        self.q = nnx.Linear(d, d, rngs=rngs)
        self.log_scale = (
            None
            if cfg.logit_scale is None
            else nnx.Param(jnp.full((cfg.num_heads,), math.log(cfg.logit_scale), jnp.float32))
        )
        self.alpha_logit = (  # learn_alpha: θ [N], α = 1 + softplus(θ)
            nnx.Param(jnp.full((cfg.num_heads,), _softplus_inverse(cfg), jnp.float32))
            if cfg.learn_alpha
            else None
        )
        self.k = nnx.Linear(d, d, rngs=rngs)
        self.v = nnx.Linear(d, d, rngs=rngs)
        self.o = nnx.Linear(d, d, rngs=rngs)

    def alpha(self) -> jax.Array | None:
        """Each head's α ``[N]`` with ``learn_alpha`` (else None: the configured normalizer)."""
        return None if self.alpha_logit is None else 1.0 + jax.nn.softplus(self.alpha_logit[...])

    def heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

    def keys_values(self, memory: jax.Array, positions=None) -> tuple[jax.Array, jax.Array]:
        """``k, v [B, Tk, N, H]`` of ``memory [B, Tk, D]``, the keys rotated by ``positions
        [Tk]`` when given (:func:`~sparse_jax.models.positions.rotate`)."""
        k = self.heads(self.k(memory))
        if positions is not None:
            k = rotate(k, positions)
        return k, self.heads(self.v(memory))

    def __call__(self, x, k, v, mask, *, positions=None, weights: bool = False, block: int = 128):
        """``x [B, Tq, D]`` queries (rotated by ``positions [Tq]`` when given) against
        precomputed ``k, v [B, Tk, N, H]``; with ``weights``, also the attention weights ``[B,
        N, Tq, Tk]``. ``mask``: a bool array or a :class:`sparse_jax.masks.Mask`, whose blocks
        are ``block`` x ``block``."""
        q = self.heads(self.q(x))
        if positions is not None:
            q = rotate(q, positions)
        if self.log_scale is not None:  # the logits' per-head factor, learned
            q = q * jnp.exp(self.log_scale[...])[:, None].astype(q.dtype)
        out = attention(
            q,
            k,
            v,
            mask=mask,
            normalizer=self.normalizer if self.alpha_logit is None else self.alpha(),
            return_weights=weights,
            block_size=(block, block),
        )
        out, w = out if weights else (out, None)
        out = self.o(out.reshape(*x.shape[:-1], -1))
        return (out, w) if weights else out


class FeedForward(nnx.Module):
    """Position-wise FFN ``[..., D] -> [..., D]`` (GELU)."""

    def __init__(self, cfg: EncDecConfig, rngs: nnx.Rngs):
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class SelfAttentionLayer(nnx.Module):
    """``x = LN(x + Attn(x)); x = LN(x + FFN(x))``: an encoder layer, and each CoT step."""

    def __init__(self, cfg: EncDecConfig, rngs: nnx.Rngs):
        self.attn = Attention(cfg, rngs)
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.ffn = FeedForward(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, x, mask, stats: list | None = None, positions=None):
        """``x [B, S, D]``; ``positions [S]`` rotate the queries and keys (rotary positions)."""
        k, v = self.attn.keys_values(x, positions)
        a = self.attn(x, k, v, mask, positions=positions, weights=stats is not None)
        if stats is not None:
            a, w = a
            stats.append(("encoder", w, mask))
        x = self.ln1(x + a)
        return self.ln2(x + self.ffn(x))


class DecoderLayer(nnx.Module):
    """``h = LN(y + A_self(y) + A_cross(u, C)); out = LN(h + FFN(h) ⊙ M_d)``, the
    cross-attention's queries from ``u = y`` (``cross_queries="input"``) or ``u = LN(y +
    A_self(y))`` (``"self"``)."""

    def __init__(self, cfg: EncDecConfig, rngs: nnx.Rngs):
        self.keep, self.block = cfg.decoder_keep, cfg.decoder_block
        self.self_attn = Attention(cfg, rngs)
        self.cross_attn = Attention(cfg, rngs)
        self.ln_query = (
            nnx.LayerNorm(cfg.d_model, rngs=rngs) if cfg.cross_queries == "self" else None
        )
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.ffn = FeedForward(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, y, self_kv, self_mask, cross_kv, cross_mask, stats=None, positions=None):
        """``self_mask``: a bool array ``[.., T, P]`` or the static :class:`Mask` of the
        decoder (see :meth:`EncDecConfig.decoder_mask`); ``positions [T]`` rotate the
        self-attention's queries (rotary positions: ``self_kv``'s keys come rotated)."""
        want = stats is not None
        a = self.self_attn(
            y, *self_kv, self_mask, positions=positions, weights=want, block=self.block
        )
        if want:
            a, wa = a
        u = y if self.ln_query is None else self.ln_query(y + a)
        c = self.cross_attn(u, *cross_kv, cross_mask, weights=want)
        if want:
            c, wc = c
            if isinstance(self_mask, masks_lib.Mask):
                self_mask = jnp.asarray(self_mask.dense(*wa.shape[-2:]))
            stats += [("decoder_self", wa, self_mask), ("decoder_cross", wc, cross_mask)]
        h = self.ln1(y + a + c)
        return self.ln2(h + keep_largest(self.ffn(h), self.keep))


class EncoderDecoder(nnx.Module):
    """The sparse encoder–decoder (see the module docstring); ``config.dense()`` builds its
    dense baseline with the same parameter shapes.

    Example:
      >>> cfg = EncDecConfig(vocab_size=11, d_model=16, num_heads=2, d_ff=32, cot_steps=1)
      >>> model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
      >>> source = jnp.ones((2, 5), jnp.int32)  # [B, S] question ids
      >>> lengths = jnp.array([5, 3])  # [B]: real tokens of each source, the rest is padding
      >>> target = jnp.ones((2, 4), jnp.int32)  # [B, T] decoder input (the shifted target)
      >>> model(source, lengths, target).shape  # teacher-forced logits [B, T, V]
      (2, 4, 11)
      >>> def size(m):  # number of parameters
      ...     return sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
      >>> size(EncoderDecoder(cfg.dense(), rngs=nnx.Rngs(0))) == size(model)  # the baseline
      True
    """

    def __init__(self, config: EncDecConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, EncDecConfig):
            raise TypeError(f"EncoderDecoder: `config` must be an EncDecConfig; got {config!r}")
        cfg = self.config = config
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        dims = np.random.default_rng(cfg.seed).permutation(cfg.d_model)
        kept = np.zeros(cfg.d_model, bool)
        kept[dims[: max(1, round(cfg.embed_keep * cfg.d_model))]] = True
        self.embed_dims = nnx.Variable(jnp.asarray(kept))  # SparseEmbed's fixed random set
        self.encoder = nnx.List([SelfAttentionLayer(cfg, rngs) for _ in range(cfg.encoder_layers)])
        self.cot = nnx.List([SelfAttentionLayer(cfg, rngs) for _ in range(cfg.cot_steps)])
        self.decoder = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.decoder_layers)])
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, rngs=rngs)
        if cfg.literal_tokens is not None:  # depths, then rows, then columns
            self.literal_embed = nnx.Embed(
                LITERAL_DEPTHS + 2 * LITERAL_SLOTS, cfg.d_model, rngs=rngs
            )

    # -- pieces ------------------------------------------------------------------------------

    def sparse_embed(self, ids: jax.Array) -> jax.Array:
        """``SparseEmbed(ids) [..., D]``: ``E[ids] ⊙ M`` (no positions)."""
        e = self.embed(ids)
        cfg = self.config
        if cfg.embed_keep >= 1:
            return e
        if cfg.embed_mask == "magnitude":
            return keep_largest(e, cfg.embed_keep)
        return jnp.where(self.embed_dims[...], e, 0.0)

    def placement(self, ids: jax.Array, positions: jax.Array, coordinates=None) -> jax.Array:
        """What is added to the embedded ``ids [B, L]``, ``[B, L, D]``: sinusoids of their
        ``positions [L]`` (none with rotary positions) and, with ``literal_tokens``, the learned
        embeddings of their :func:`literal_coordinates` (given as ``coordinates [B, L, 3]``
        when decoding)."""
        if self.config.positions == "sinusoid":
            enc = sinusoid(positions, self.config.d_model)[None]
        else:  # rotary: positions enter the self-attentions (self.rotary)
            enc = jnp.zeros((1, positions.shape[0], self.config.d_model))
        literal_tokens = self.config.literal_tokens
        if literal_tokens is None:
            return enc
        if coordinates is None:
            coordinates = literal_coordinates(ids, literal_tokens)
        depth = jnp.minimum(coordinates[..., 0], LITERAL_DEPTHS - 1)
        row, col = (jnp.minimum(coordinates[..., i], LITERAL_SLOTS - 1) for i in (1, 2))
        e = self.literal_embed
        return enc + e(depth) + e(LITERAL_DEPTHS + row) + e(LITERAL_DEPTHS + LITERAL_SLOTS + col)

    def rotary(self, positions: jax.Array) -> jax.Array | None:
        """``positions [L]`` for the self-attentions to rotate by, or None (sinusoids)."""
        return positions if self.config.positions == "rotary" else None

    def _source_masks(self, source_lengths, s: int):
        """(self-attention mask ``[B, 1, S, S]``: real positions among real positions, under
        the encoder's static mask; cross-attention key mask ``[B, 1, 1, S]``)."""
        valid = jnp.arange(s)[None, :] < source_lengths[:, None]  # [B, S]
        pairs = valid[:, None, :, None] & valid[:, None, None, :]  # padding rows: all masked
        static = self.config.encoder_mask()
        if static is not None:
            pairs = pairs & jnp.asarray(static.dense(s, s))[None, None]
        return pairs, valid[:, None, None, :]

    def encode(self, source: jax.Array, source_lengths: jax.Array, stats=None) -> jax.Array:
        """The reasoning context ``C [B, S, D]``: the encoder's output after the CoT steps."""
        s = source.shape[1]
        self_mask, _ = self._source_masks(source_lengths, s)
        emb = self.sparse_embed(source)
        x = emb + self.placement(source, jnp.arange(s))
        positions = self.rotary(jnp.arange(s))
        for layer in self.encoder:
            x = layer(x, self_mask, stats, positions)
        for step in self.cot:
            x = keep_largest(step(x + emb, self_mask, stats, positions), self.config.cot_keep)
        return x

    def _check(self, source, source_lengths, target=None):
        caller = "EncoderDecoder"
        for name, ids in (("source", source), ("target", target)):
            if ids is None:
                continue
            if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(
                    f"{caller}: `{name}` must be an int array [batch, len]; got {ids!r}"
                )
            if ids.ndim != 2:
                raise ValueError(f"{caller}: `{name}` must be [batch, len]; got {ids.shape}")
        if jnp.shape(source_lengths) != (source.shape[0],):
            raise ValueError(
                f"{caller}: `source_lengths` must be [batch] = ({source.shape[0]},); got "
                f"{jnp.shape(source_lengths)}"
            )

    def __call__(self, source, source_lengths, target, *, return_stats: bool = False):
        """Teacher-forced logits ``[B, T, V]`` for ``target [B, T]`` (the decoder input: the
        shifted target) given ``source [B, S]`` with ``source_lengths [B]``.

        With ``return_stats``, also a dict of attention statistics: for each kind
        (``encoder``, ``decoder_self``, ``decoder_cross``) the mean fraction of allowed keys
        that get a non-zero weight in valid query rows (sparsemax's own sparsity times the
        mask's), and the mean allowed fraction of the mask.
        """
        self._check(source, source_lengths, target)
        stats = [] if return_stats else None
        memory = self.encode(source, source_lengths, stats)
        t = target.shape[1]
        y = self.sparse_embed(target) + self.placement(target, jnp.arange(t))
        self_mask = self.config.decoder_mask()
        if self.config.decoder_window is None:
            self_mask = jnp.asarray(self_mask.dense(t, t))
        _, cross_mask = self._source_masks(source_lengths, source.shape[1])
        positions = self.rotary(jnp.arange(t))
        for layer in self.decoder:
            self_kv = layer.self_attn.keys_values(y, positions)
            cross_kv = layer.cross_attn.keys_values(memory)
            y = layer(y, self_kv, self_mask, cross_kv, cross_mask, stats, positions)
        logits = self.head(y)
        if not return_stats:
            return logits
        return logits, _summarise(stats, source_lengths)

    # -- decoding with a cache ---------------------------------------------------------------

    def cache_slots(self, max_len: int) -> int:
        """Self-attention cache slots for decoding ``max_len`` positions: ``max_len``, or with a
        ``decoder_window`` at most ``decoder_sinks + decoder_window`` (the sinks, then a ring of
        the most recent tokens: what the mask lets a query see), so that a decoding step's work
        follows the window, not the length decoded so far.

        Example:
          >>> cfg = EncDecConfig(vocab_size=7, d_model=8, num_heads=2, d_ff=16, cot_steps=0,
          ...                    decoder_window=4, decoder_sinks=1)
          >>> EncoderDecoder(cfg, rngs=nnx.Rngs(0)).cache_slots(100)
          5
        """
        max_len = check_int(max_len, "max_len", "EncoderDecoder.cache_slots")
        window = self.config.decoder_window
        return max_len if window is None else min(max_len, window + self.config.decoder_sinks)

    def init_cache(self, memory: jax.Array, source_lengths: jax.Array, max_len: int) -> dict:
        """The decoding state for ``max_len`` target tokens: per decoder layer the self-attention
        key/value cache ``[B, P, N, H]`` (zeros; ``P = cache_slots(max_len)``) and the
        cross-attention keys/values of ``memory`` (computed once), the absolute position held
        in each slot ``[P]`` (-1: empty), the cross mask and the next position."""
        b = memory.shape[0]
        n, h = self.config.num_heads, self.config.head_dim
        slots = self.cache_slots(max_len)
        _, cross_mask = self._source_masks(source_lengths, memory.shape[1])
        layers = []
        for layer in self.decoder:
            ck, cv = layer.cross_attn.keys_values(memory)
            zeros = jnp.zeros((b, slots, n, h), memory.dtype)
            layers.append({"k": zeros, "v": zeros, "ck": ck, "cv": cv})
        cache = {
            "layers": layers,
            "positions": jnp.full((slots,), -1, jnp.int32),
            "cross_mask": cross_mask,
            "index": jnp.int32(0),
        }
        if self.config.literal_tokens is not None:  # where the tokens fed so far left off
            cache["literal"] = jnp.zeros((b, 3), jnp.int32)
        return cache

    def decode_step(self, token: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Logits ``[B, V]`` for the next position after feeding ``token [B]`` at
        ``cache["index"]``, and the updated cache (with a decoder window the token takes the
        slot of the oldest token outside the sinks)."""
        index = cache["index"]
        slots = cache["layers"][0]["k"].shape[1]
        literal = None
        if self.config.literal_tokens is not None:
            literal = literal_step(cache["literal"], token, self.config.literal_tokens)
        ids = token[:, None]
        y = self.sparse_embed(ids) + self.placement(
            ids, index[None], None if literal is None else literal[:, None]
        )
        sinks = self.config.decoder_sinks if self.config.decoder_window is not None else 0
        ring = max(slots - sinks, 1)
        slot = jnp.where(index < sinks, index, sinks + (index - sinks) % ring)
        positions = cache["positions"].at[slot].set(index)
        allowed = self.config.decoder_mask().predicate(index[None, None], positions[None, :])
        self_mask = allowed & (positions >= 0)[None, :]  # [1, P]
        new_layers = []
        rotation = self.rotary(index[None])
        for layer, c in zip(self.decoder, cache["layers"], strict=True):
            k, v = layer.self_attn.keys_values(y, rotation)
            k_all = jax.lax.dynamic_update_slice(c["k"], k.astype(c["k"].dtype), (0, slot, 0, 0))
            v_all = jax.lax.dynamic_update_slice(c["v"], v.astype(c["v"].dtype), (0, slot, 0, 0))
            self_kv, cross_kv = (k_all, v_all), (c["ck"], c["cv"])
            y = layer(y, self_kv, self_mask, cross_kv, cache["cross_mask"], positions=rotation)
            new_layers.append({**c, "k": k_all, "v": v_all})
        logits = self.head(y)[:, 0]
        new_cache = {**cache, "layers": new_layers, "positions": positions, "index": index + 1}
        if literal is not None:
            new_cache["literal"] = literal
        return logits, new_cache

    # -- what the model is -------------------------------------------------------------------

    def learned_alphas(self) -> dict[str, list[float]]:
        """Each attention's learned α per head (``learn_alpha``; empty without it), by the
        attention's path in the model, in the order the model runs them (encoder, chain of
        thought, decoder).

        Example:
          >>> cfg = EncDecConfig(vocab_size=11, d_model=16, num_heads=2, d_ff=32, cot_steps=0,
          ...                    learn_alpha=True)
          >>> EncoderDecoder(cfg, rngs=nnx.Rngs(0)).learned_alphas()["encoder.0.attn"]
          [2.0, 2.0]
        """
        found = [
            (path, m)
            for path, m in nnx.iter_graph(self)
            if isinstance(m, Attention) and m.alpha_logit is not None
        ]
        order = ("encoder", "cot", "decoder")  # paths: (part, layer, attention's name)
        found.sort(key=lambda it: (order.index(it[0][0]), it[0][1], it[0][-1] == "cross_attn"))
        return {
            ".".join(map(str, path)): [round(float(a), 4) for a in np.asarray(m.alpha())]
            for path, m in found
        }

    def flops(self, source_len: int, target_len: int) -> dict[str, int]:
        """Analytic matmul FLOPs (2 per multiply-add) of one teacher-forced forward pass of one
        question: ``attention_scores`` counts ``QKᵀ`` and ``PV`` over the entries each mask
        allows (dense masks: all), ``projections`` the q/k/v/o linears, ``ffn`` the FFNs and
        ``output`` the final layer; ``total`` their sum.

        Example:
          >>> cfg = EncDecConfig(vocab_size=10, d_model=8, num_heads=2, d_ff=16,
          ...                    encoder_layers=1, decoder_layers=1, cot_steps=0)
          >>> EncoderDecoder(cfg, rngs=nnx.Rngs(0)).flops(4, 3)["ffn"]  # 2 x 2 x 8 x 16 x 7
          3584
        """
        cfg = self.config
        s = check_int(source_len, "source_len", "EncoderDecoder.flops")
        t = check_int(target_len, "target_len", "EncoderDecoder.flops")
        d = cfg.d_model
        enc_static = cfg.encoder_mask()
        enc_pairs = s * s if enc_static is None else int(enc_static.dense(s, s).sum())
        dec_pairs = int(cfg.decoder_mask().dense(t, t).sum())
        source_layers = cfg.encoder_layers + cfg.cot_steps
        scores = 2 * 2 * d * (source_layers * enc_pairs + cfg.decoder_layers * (dec_pairs + t * s))
        # q, k, v, o of every source layer; per decoder layer self q, k, v, o and cross q, o
        # over the T targets, cross k, v over the S sources.
        proj = 2 * d * d * (4 * source_layers * s + cfg.decoder_layers * (6 * t + 2 * s))
        ffn = 2 * 2 * d * cfg.d_ff * (source_layers * s + cfg.decoder_layers * t)
        output = 2 * d * cfg.vocab_size * t
        return {
            "attention_scores": scores,
            "projections": proj,
            "ffn": ffn,
            "output": output,
            "total": scores + proj + ffn + output,
        }


def _summarise(stats, source_lengths) -> dict[str, jax.Array]:
    """Mean non-zero and allowed fractions of the attention weights per kind (valid rows)."""
    out: dict[str, list] = {}
    for kind, w, mask in stats:
        allowed = jnp.broadcast_to(mask, w.shape)
        rows = jnp.any(allowed, axis=-1)  # a row with any allowed key
        nonzero = jnp.sum((w > 0) & allowed, axis=-1) / jnp.maximum(w.shape[-1], 1)
        share = jnp.sum(allowed, axis=-1) / w.shape[-1]
        n = jnp.maximum(jnp.sum(rows), 1)
        out.setdefault(f"{kind}_nonzero", []).append(jnp.sum(jnp.where(rows, nonzero, 0)) / n)
        out.setdefault(f"{kind}_allowed", []).append(jnp.sum(jnp.where(rows, share, 0)) / n)
    return {k: jnp.mean(jnp.stack(v)) for k, v in out.items()}


def sequence_loss(model: EncoderDecoder, source, source_lengths, target_in, target_out, where):
    """Mean per-token loss of the teacher-forced targets ``target_out [B, T]`` over ``where``
    (bool ``[B, T]``, False on padding): the sparsemax Fenchel–Young loss for
    ``output="sparsemax"``, cross entropy for ``"softmax"``.

    Example:
      >>> cfg = EncDecConfig(vocab_size=7, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> m = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
      >>> ids = jnp.ones((1, 3), jnp.int32)
      >>> float(sequence_loss(m, ids, jnp.array([3]), ids, ids, ids > 0)) > 0
      True
    """
    logits = model(source, source_lengths, target_in).astype(jnp.float32)
    if model.config.output == "sparsemax":
        per_token = sparsemax_loss(logits, target_out, where=where)
    else:
        logp = jax.nn.log_softmax(logits)
        per_token = -jnp.take_along_axis(logp, target_out[..., None], axis=-1)[..., 0]
        per_token = jnp.where(where, per_token, 0.0)
    return jnp.sum(per_token) / jnp.maximum(jnp.sum(where), 1)


def greedy_decode(
    model: EncoderDecoder,
    source: jax.Array,
    source_lengths: jax.Array,
    *,
    bos: int,
    eos: int,
    max_len: int,
) -> tuple[jax.Array, jax.Array]:
    """Greedy decoding with a key/value cache: ``(tokens [B, max_len], logits [B, max_len,
    V])``, starting from ``bos``; after a row emits ``eos`` it emits ``eos`` again (its logits
    are still returned). One jitted ``lax.scan`` over the positions.

    Example:
      >>> cfg = EncDecConfig(vocab_size=7, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> m = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
      >>> tokens, _ = greedy_decode(m, jnp.ones((2, 3), jnp.int32), jnp.array([3, 2]),
      ...                           bos=1, eos=2, max_len=5)
      >>> tokens.shape
      (2, 5)
    """
    caller = "greedy_decode"
    max_len = check_int(max_len, "max_len", caller)
    for name, value in (("bos", bos), ("eos", eos)):
        check_int(value, name, caller, low=0, high=model.config.vocab_size - 1)
    model._check(source, source_lengths)
    graphdef, state = nnx.split(model)
    return _greedy(graphdef, state, source, jnp.asarray(source_lengths), bos, eos, max_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "bos", "eos", "max_len"))
def _greedy(graphdef, state, source, source_lengths, bos, eos, max_len):
    model = nnx.merge(graphdef, state)
    memory = model.encode(source, source_lengths)
    cache = model.init_cache(memory, source_lengths, max_len)
    b = source.shape[0]

    def step(carry, _):
        token, cache, done = carry
        logits, cache = model.decode_step(token, cache)
        nxt = jnp.where(done, eos, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return (nxt, cache, done | (nxt == eos)), (nxt, logits)

    start = (jnp.full((b,), bos, jnp.int32), cache, jnp.zeros((b,), bool))
    _, (tokens, logits) = jax.lax.scan(step, start, None, length=max_len)
    return tokens.T, logits.swapaxes(0, 1)


def describe(config: EncDecConfig) -> dict[str, Any]:
    """The switches of ``config`` that differ from its dense baseline (empty: dense), with
    SparseEmbed's ``embed_mask`` beside ``embed_keep`` when it is on.

    Example:
      >>> describe(EncDecConfig(decoder_window=8))  # the sparse defaults and a window
      {'normalizer': 'sparsemax', 'output': 'sparsemax', 'embed_keep': 0.5, 'embed_mask': 'random',
       'cot_keep': 0.5, 'decoder_window': 8}
      >>> describe(EncDecConfig().dense())  # the baseline: nothing differs
      {}
    """
    dense = config.dense()
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(dense, f.name)
        or (f.name == "embed_mask" and config.embed_keep < 1)
    }
