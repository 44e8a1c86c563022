"""sparse_jax: sparse attention for JAX/Flax.

The functional API is re-exported here::

    import sparse_jax as sj
    p = sj.sparsemax(scores, axis=-1, where=mask)
    out = sj.attention(q, k, v, mask=sj.masks.causal(), normalizer="entmax15")
"""

from sparse_jax import gates, masks
from sparse_jax.blocksparse import BlockSparseCost, blocksparse_attention, blocksparse_cost
from sparse_jax.dispatch import ImplChoice, attention, attention_fn, attention_impl
from sparse_jax.dynamic import topk_block_attention, topk_mask
from sparse_jax.fused import cudnn_attention, splash_attention
from sparse_jax.kernels import pallas_attention
from sparse_jax.normalizers import (
    entmax,
    entmax15,
    entmax15_loss,
    entmax_loss,
    sparsemax,
    sparsemax_loss,
)

__all__ = [
    "BlockSparseCost",
    "ImplChoice",
    "attention",
    "attention_fn",
    "attention_impl",
    "blocksparse_attention",
    "blocksparse_cost",
    "cudnn_attention",
    "entmax",
    "entmax15",
    "entmax15_loss",
    "entmax_loss",
    "gates",
    "masks",
    "pallas_attention",
    "sparsemax",
    "sparsemax_loss",
    "splash_attention",
    "topk_block_attention",
    "topk_mask",
]

__version__ = "0.1.0"
