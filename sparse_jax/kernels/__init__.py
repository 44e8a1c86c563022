"""Fused attention kernels written in Pallas (GPU and TPU; interpret mode on CPU for tests).

:func:`pallas_attention` computes block-sparse attention over a
:class:`~sparse_jax.masks.BlockLayout` for softmax, sparsemax, 1.5-entmax and α-entmax in
on-chip memory, flash-style (:func:`pallas_block_list_attention`: over key blocks listed at
run time, as :func:`sparse_jax.topk_block_attention` selects them): Triton kernels for GPUs
(:mod:`sparse_jax.kernels.triton`) and the same algorithm for TPUs
(:mod:`sparse_jax.kernels.mosaic`), on the tile maths both share
(:mod:`sparse_jax.kernels.tilemath`). :mod:`sparse_jax.kernels.flash` holds the entries and
their custom VJP, :mod:`sparse_jax.kernels.plan` the call plan, the block rules and what the
kernels support (:func:`pallas_supports`). Imports go one way: flash -> triton, mosaic ->
tilemath -> plan.
"""

from sparse_jax.kernels.flash import pallas_attention, pallas_block_list_attention
from sparse_jax.kernels.plan import TRITON_TILE, pallas_supports

__all__ = ["TRITON_TILE", "pallas_attention", "pallas_block_list_attention", "pallas_supports"]
