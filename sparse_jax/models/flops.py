"""Analytic FLOPs and attention density of GPT-2 models (dense, soft students, hardened).

**Density** (one definition for the whole of :mod:`sparse_jax.models`): the fraction of the
whole ``T x T`` score matrix of causal self-attention that a mask allows, upper triangle
included, averaged over heads (:func:`mask_density`). Full causal attention has density
``(T + 1) / (2 T)``, about 1/2; a causal window of ``w`` keys about ``w / T``. A fraction of
the *causal* entries is a different quantity and is always called a *causal share*
(:meth:`~sparse_jax.models.layers.CandidateMaskAttention.causal_shares`, which the candidate
penalties price). :func:`~sparse_jax.models.harden`'s ``budget``, ``attention_density``
below and ``GPT2.attention_density`` are densities.

Counts are multiply-adds x 2 of the matrix products, forward pass, for ``batch`` sequences of
``seq_len`` tokens; elementwise work (normalizers, LayerNorm, activations) is left out, as is
usual. Attention counts the score entries the implementation *forms*, which is what costs time:

* dense (``impl="xla"``): every ``T x S`` entry, whatever the mask;
* block-sparse: the kept blocks, padded within row groups (``blocksparse_cost``);
* a soft candidate mixture (``soft_union``/``soft_mask``): dense with a bias; ``mixture``: the
  sum over its candidates.

``LayerFlops.attention_density`` is the density of the mask the layer may attend to
(``allowed_mask()``: for a soft student the union of all its candidates, whatever their weights);
the layers answer both questions themselves (``allowed_mask``, ``scores_formed``), and
:meth:`~sparse_jax.models.gpt2.GPT2.flops` calls :func:`model_flops`.

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
from sparse_jax.blocksparse import STEP_SCORES, blocksparse_cost, row_groups
from sparse_jax.dispatch import attention_impl
from sparse_jax.validation import check_block_size, check_int

__all__ = [
    "LayerFlops",
    "ModelFlops",
    "attention_scores",
    "kept_flops",
    "mask_block_cost",
    "mask_density",
    "model_flops",
    "selection_block_cost",
    "serving_block_size",
]

#: The block sizes :func:`serving_block_size` chooses among (square blocks).
SERVING_BLOCKS = (32, 64, 128)
#: How many more score entries than the fewest a larger block may form and still be chosen:
#: a larger block costs less per entry on the block-sparse engine (about 1.4x less at 128 than
#: at 32, fewer gathers and row groups), so a few padded entries are worth it; a narrow window
#: at a large block forms twice the entries or more and is not (measured by
#: ``python -m experiments.bench block_sizes``; docs/benchmarks.md, "Block sizes per head").
SERVING_SLACK = 1.25


def mask_density(mask: masks_lib.Mask, seq_len: int) -> float:
    """The density of a static ``mask`` at ``seq_len``: its allowed fraction of the whole
    ``seq_len x seq_len`` score matrix (mean over heads for a per-head mask), exact (a count of
    entries divided by their number).

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> mask_density(causal(), 4), mask_density(causal() & local(0, 0), 4)  # 10/16, 4/16
      (0.625, 0.25)
    """
    seq_len = check_int(seq_len, "seq_len", "mask_density")
    block = min(seq_len, 128)
    return float(mask.blocks(seq_len, seq_len, block, block).density)


def mask_block_cost(mask: masks_lib.Mask, seq_len: int, block_size: tuple[int, int]) -> float:
    """The *block cost* of a static ``mask`` (intersected with causal) at ``seq_len``: the score
    entries the block-sparse kernel forms for it with ``block_size`` blocks (its key blocks,
    padded within row groups, as :func:`~sparse_jax.blocksparse.blocksparse_cost` counts them),
    relative to full causal attention's: what serving a head under ``mask`` costs, causal = 1.
    A pattern that touches every block costs what causal costs, whatever its density.

    Example:
      >>> from sparse_jax.masks import causal, local, strided
      >>> round(mask_block_cost(causal() & local(127, 0), 2048, (128, 128)), 3)
      0.213
      >>> mask_block_cost(strided(64), 2048, (128, 128))
      1.0
    """
    seq_len = check_int(seq_len, "seq_len", "mask_block_cost")
    return _formed(mask & masks_lib.causal(), seq_len, block_size) / _formed(
        masks_lib.causal(), seq_len, block_size
    )


def selection_block_cost(selection: Any, seq_len: int, block_size: tuple[int, int]) -> float:
    """The block cost of a :class:`~sparse_jax.dynamic.BlockSelection` at ``seq_len``: the score
    entries its engine forms (whole key blocks per query token, :meth:`~BlockSelection.formed`;
    the same for every input) relative to those the block-sparse kernel forms for full causal
    attention with ``block_size`` blocks, as :func:`mask_block_cost` prices a static mask.

    Example:
      >>> from sparse_jax.dynamic import BlockSelection
      >>> round(selection_block_cost(BlockSelection(2, block=64), 2048, (64, 64)), 3)
      0.159
    """
    seq_len = check_int(seq_len, "seq_len", "selection_block_cost")
    return selection.formed(seq_len) / _formed(masks_lib.causal(), seq_len, block_size)


def serving_block_size(
    mask: masks_lib.Mask, seq_len: int, block_size: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The block size at which the block-sparse engine serves ``mask`` (intersected with causal)
    at ``seq_len``: among the square blocks of :data:`SERVING_BLOCKS` no larger than
    ``seq_len``, and ``block_size`` (the layer's own) when given, the largest whose formed score
    entries are at most :data:`SERVING_SLACK` times the fewest any of them forms, and whose
    widest query block forms at most the engine's step of scores on this backend
    (``STEP_SCORES``; else the one of those whose widest query block forms the fewest). Full
    causal attention gets the largest block up to the length where one row of such blocks
    outgrows a step, a window narrower than a block a small one.

    Why the step: the engine splits its work into steps of whole query blocks; a query block
    wider than a step is a step of its own, its scores no longer cache-sized, and on CPU causal
    attention at 8,192 tokens runs slower at blocks of 128 than at 64 (docs/benchmarks.md,
    "At 4,096 and 8,192 tokens: no block wider than a step").

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> serving_block_size(causal(), 512), serving_block_size(causal() & local(31, 0), 512)
      ((128, 128), (32, 32))
      >>> serving_block_size(causal() & local(3, 0), 64, (4, 4))  # the layer's own blocks
      (4, 4)
    """
    caller = "serving_block_size"
    seq_len = check_int(seq_len, "seq_len", caller)
    mask = mask & masks_lib.causal()
    sizes = {(b, b) for b in SERVING_BLOCKS if b <= seq_len}
    if block_size is not None:
        sizes.add(check_block_size(block_size, caller))
    sizes = sizes or {(min(SERVING_BLOCKS),) * 2}
    layouts = {size: mask.blocks(seq_len, seq_len, *size) for size in sizes}
    formed = {size: _layout_formed(layout) for size, layout in layouts.items()}
    fewest = min(formed.values())
    near = [size for size in sizes if formed[size] <= SERVING_SLACK * fewest]
    step = STEP_SCORES.get(jax.default_backend(), STEP_SCORES["default"])
    widest = {size: _widest_row(layouts[size]) for size in near}
    fits = [size for size in near if widest[size] <= step]
    if not fits:
        return min(near, key=lambda size: (widest[size], formed[size], size))
    return max(fits, key=lambda size: (size[0] * size[1], size))


def _widest_row(layout) -> int:
    """Score entries the block-sparse kernel forms for one query block of ``layout``'s widest
    row group (one batch element, one head)."""
    return layout.block_q * layout.block_kv * max(width for _, width in row_groups(layout))


def _formed(mask: masks_lib.Mask, seq_len: int, block_size: tuple[int, int]) -> int:
    """Score entries the block-sparse kernel forms for ``mask`` (one batch element, one head)."""
    return _layout_formed(mask.blocks(seq_len, seq_len, *block_size))


def _layout_formed(layout) -> int:
    return blocksparse_cost(layout, batch=1, num_heads=1, head_dim=1).computed_scores


@dataclasses.dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one transformer block.

    Example:
      >>> from sparse_jax.models import GPT2Config
      >>> g = GPT2Config.preset("tiny")  # D 48, 2 blocks, 3 heads of 16, 192 units, V 101
      >>> layer = kept_flops(g, 4, [4, 2], [3, 2], [192, 96]).layers[1]  # 2 of 4 tokens
      >>> layer  # causal among 2 kept tokens: 3 of 16 entries
      LayerFlops(layer=1, heads=2, ffn_units=96, attention_density=0.1875,
                 computed_fraction=0.1875, projections=24576, attention=384, ffn=36864)
      >>> layer.total, layer.ffn == 2 * 2 * 2 * 48 * 96  # 2 x 2 matrices x tokens x D x U
      (61824, True)
    """

    layer: int  # block index
    heads: int  # attention heads
    ffn_units: int  # FFN width
    attention_density: float  # density of the allowed mask (mean over heads)
    computed_fraction: float  # fraction of the T x S scores the implementation forms
    projections: int  # q, k, v and output projections
    attention: int  # q k^T and p v over the formed score entries
    ffn: int  # the two FFN matrices

    @property
    def total(self) -> int:
        return self.projections + self.attention + self.ffn


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of a model on ``batch`` sequences of ``seq_len`` tokens.

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.models import GPT2, GPT2Config
      >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))  # D 48, 2 blocks, V 101
      >>> report = model_flops(model, 8, batch=2)  # ids [B, T] = [2, 8]
      >>> report.seq_len, report.batch, len(report.layers), report.lm_head  # 2 x B x T x D x V
      (8, 2, 2, 155136)
      >>> report.total, report.per_token, report.attention, report.attention_density
      (1973760, 123360.0, 49152, 0.5625)
    """

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
        """Mean density of the allowed masks over the heads of all layers."""
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
    mask's density (:func:`mask_density`), and the implementation that ``impl`` resolves to.

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
      batch: sequences ``B`` (the model's input is ids ``[B, T]``).

    Returns:
      A :class:`ModelFlops`.

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.models import GPT2, GPT2Config
      >>> model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))  # D 48, 2 blocks, V 101
      >>> report = model_flops(model, 8, batch=2)  # ids [B, T] = [2, 8]
      >>> len(report.layers), report.lm_head == 2 * 2 * 8 * 48 * 101  # 2 x B x T x D x V
      (2, True)
      >>> report.layers[0].computed_fraction, report.attention_density  # causal: 36 of 64
      (1.0, 0.5625)
    """
    caller = "model_flops"
    seq_len = check_int(seq_len, "seq_len", caller)
    batch = check_int(batch, "batch", caller)
    config = model.config
    d, h, t = config.n_embd, config.head_dim, seq_len
    layers = []
    for i, block in enumerate(model.h):
        n, u = block.attn.num_heads, block.mlp.units
        formed, density = 0, 0.0
        if n:  # the layer describes itself: what it may attend to, what a call forms
            core = block.attn.core
            density = mask_density(core.allowed_mask(), t)
            formed = core.scores_formed(t, batch=batch, head_dim=h)
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


def kept_flops(
    config: Any,
    seq_len: int,
    tokens: Any,
    heads: Any,
    units: Any,
) -> ModelFlops:
    """Analytic forward FLOPs of one sequence of ``seq_len`` tokens through a GPT-2-shaped model
    whose block ``l`` runs on ``tokens[l]`` of the tokens (the others skip it through the
    residual) with ``heads[l]`` heads and ``units[l]`` FFN units: what a gated model with its
    closed heads, units and tokens removed computes (the CANDS cascade's pruned model).

    Per block, over its ``n`` kept tokens: projections ``2 n D 4 N_l H``, attention ``2·2·H N_l
    n(n+1)/2`` (causal ``QKᵀ`` and ``PV`` among the kept tokens: the causal entries, not the
    ``n²`` that a dense kernel forms, so the dense model is counted the same way), FFN ``2·2 n D
    U_l``; plus the output layer over all ``seq_len`` tokens. ``computed_fraction`` and
    ``attention_density`` are the causal entries among the kept tokens over ``seq_len²``. The
    token gates' own cost (``2 D`` per routed token and block, well under 1% of a block) is left
    out with the elementwise work.

    Args:
      config: a :class:`~sparse_jax.models.gpt2.GPT2Config` (width, head dim, vocabulary).
      seq_len: tokens of the sequence ``T``.
      tokens, heads, units: one count per block (``0 <= tokens[l] <= T``).

    Example:
      >>> from sparse_jax.models import GPT2Config
      >>> g = GPT2Config.preset("tiny")  # D 48, 2 blocks, 3 heads of 16, 192 units, V 101
      >>> report = kept_flops(g, 4, [4, 2], [3, 2], [192, 96])
      >>> report.total, report.layers[1].ffn == 2 * 2 * 2 * 48 * 96
      (323712, True)
    """
    caller = "kept_flops"
    seq_len = check_int(seq_len, "seq_len", caller)
    counts = {"tokens": list(tokens), "heads": list(heads), "units": list(units)}
    for name, values in counts.items():
        if len(values) != config.n_layer:
            raise ValueError(
                f"{caller}: `{name}` needs one count per block ({config.n_layer}); got "
                f"{len(values)}"
            )
        high = seq_len if name == "tokens" else None
        counts[name] = [
            check_int(int(v), f"{name}[{i}]", caller, low=0, high=high)
            for i, v in enumerate(values)
        ]
    d, h = config.n_embd, config.head_dim
    layers = []
    for i, (n, heads_l, units_l) in enumerate(zip(*counts.values(), strict=True)):
        causal = n * (n + 1) // 2
        layers.append(
            LayerFlops(
                layer=i,
                heads=heads_l,
                ffn_units=units_l,
                attention_density=causal / seq_len**2,
                computed_fraction=causal / seq_len**2 if heads_l else 0.0,
                projections=2 * n * d * 4 * heads_l * h,
                attention=2 * 2 * h * heads_l * causal,
                ffn=2 * 2 * n * d * units_l,
            )
        )
    return ModelFlops(seq_len, 1, tuple(layers), 2 * seq_len * d * config.vocab_size)
