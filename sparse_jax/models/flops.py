"""Analytic FLOPs and attention density of GPT-2 models (dense, soft students, hardened).

Counts are multiply-adds x 2 of the matrix products, forward pass, for ``batch`` sequences of
``seq_len`` tokens; elementwise work (normalizers, LayerNorm, activations) is left out, as is
usual. Attention counts the score entries the implementation *forms*, which is what costs time:

* dense (``impl="xla"``): every ``T x S`` entry, whatever the mask;
* block-sparse: the kept blocks, padded within row groups (``blocksparse_cost``);
* a soft candidate mixture (``soft_union``/``soft_mask``): dense with a bias; ``mixture``: the
  sum over its candidates.

``attention_density`` is the fraction of the ``T x S`` score matrix the layer's mask allows
(the union of the candidates for a soft student), averaged over its heads.

Example:
  >>> from flax import nnx
  >>> from sparse_jax.models import GPT2, GPT2Config
  >>> report = model_flops(GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0)), 8)
  >>> report.layers[0].ffn == 2 * 2 * 8 * 48 * 192
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sparse_jax import masks as masks_lib
from sparse_jax.blocksparse import blocksparse_cost
from sparse_jax.dispatch import attention_impl

__all__ = ["LayerFlops", "ModelFlops", "attention_scores", "model_flops"]


@dataclasses.dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one transformer block."""

    layer: int  # block index
    heads: int  # attention heads
    ffn_units: int  # FFN width
    attention_density: float  # allowed fraction of the score matrix (mean over heads)
    computed_fraction: float  # fraction of the T x S scores the implementation forms
    projections: int  # q, k, v and output projections
    attention: int  # q k^T and p v over the formed score entries
    ffn: int  # the two FFN matrices

    @property
    def total(self) -> int:
        return self.projections + self.attention + self.ffn


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of a model on ``batch`` sequences of ``seq_len`` tokens."""

    seq_len: int
    batch: int
    layers: tuple[LayerFlops, ...]
    lm_head: int  # the tied output projection onto the vocabulary

    @property
    def total(self) -> int:
        return self.lm_head + sum(layer.total for layer in self.layers)

    @property
    def attention(self) -> int:
        """FLOPs of the score and value products, all layers."""
        return sum(layer.attention for layer in self.layers)

    @property
    def per_token(self) -> float:
        return self.total / (self.batch * self.seq_len)

    @property
    def attention_density(self) -> float:
        """Mean allowed fraction of the score matrix over the heads of all layers."""
        heads = sum(layer.heads for layer in self.layers)
        if not heads:
            return 0.0
        return sum(layer.attention_density * layer.heads for layer in self.layers) / heads


def attention_scores(
    mask: masks_lib.Mask | None,
    seq_len: int,
    *,
    batch: int = 1,
    num_heads: int,
    head_dim: int,
    impl: str = "auto",
    block_size: tuple[int, int] = (128, 128),
    normalizer: Any = "softmax",
) -> tuple[int, float, str]:
    """Score entries formed by ``sparse_jax.attention`` for a causal self-attention call, the
    mask's density, and the implementation that ``impl`` resolves to.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> n, density, impl = attention_scores(causal() & local(127, 0), 1024, num_heads=1,
      ...                                     head_dim=64)
      >>> impl, n, round(density, 3)
      ('blocksparse', 262144, 0.117)
    """
    mask = masks_lib.causal() if mask is None else mask
    shape = jax.ShapeDtypeStruct((batch, seq_len, num_heads, head_dim), jnp.float32)
    choice = attention_impl(
        shape, shape, shape, mask=mask, normalizer=normalizer, impl=impl, block_size=block_size
    ).impl
    layout = mask.blocks(seq_len, seq_len, *block_size)
    if choice == "blocksparse":
        cost = blocksparse_cost(layout, batch=batch, num_heads=num_heads, head_dim=head_dim)
        formed = cost.computed_scores
    else:
        formed = batch * num_heads * seq_len * seq_len
    return formed, float(layout.density), choice


def model_flops(model: Any, seq_len: int, *, batch: int = 1) -> ModelFlops:
    """Analytic forward FLOPs of a :class:`~sparse_jax.models.gpt2.GPT2`, layer by layer.

    Args:
      model: a GPT2 (teacher, soft student or hardened model).
      seq_len: tokens per sequence ``T`` (causal self-attention, ``S = T``).
      batch: sequences.

    Returns:
      A :class:`ModelFlops`.
    """
    from sparse_jax.models.layers import SELF, CandidateMaskAttention

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"model_flops: `seq_len` must be an int >= 1; got {seq_len!r}")
    config = model.config
    d, h, t = config.n_embd, config.head_dim, seq_len
    layers = []
    for i, block in enumerate(model.h):
        n, u = block.attn.num_heads, block.mlp.units
        formed, density = 0, 0.0
        if n:
            core = block.attn.core
            if isinstance(core, CandidateMaskAttention):
                union = core.candidates[0]
                for c in core.candidates[1:]:
                    union = union | c
                if core.anchor_self:
                    union = union | SELF
                density = float(union.blocks(t, t, min(t, 128), min(t, 128)).density)
                if core.combine == "mixture":
                    formed = sum(
                        attention_scores(c, t, batch=batch, num_heads=n, head_dim=h)[0]
                        for c in core.candidates
                    )
                else:
                    formed = batch * n * t * t
            else:
                spec = model.specs[i]
                formed, density, _ = attention_scores(
                    core.mask,
                    t,
                    batch=batch,
                    num_heads=n,
                    head_dim=h,
                    impl=spec.impl,
                    block_size=spec.block_size,
                )
        layers.append(
            LayerFlops(
                layer=i,
                heads=n,
                ffn_units=u,
                attention_density=density,
                computed_fraction=formed / (batch * max(n, 1) * t * t),
                projections=2 * batch * t * d * 4 * n * h,
                attention=2 * 2 * formed * h,
                ffn=2 * 2 * batch * t * d * u,
            )
        )
    return ModelFlops(t, batch, tuple(layers), 2 * batch * t * d * config.vocab_size)
