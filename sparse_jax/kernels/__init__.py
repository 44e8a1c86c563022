"""Fused attention kernels written in Pallas (GPU and TPU; interpret mode on CPU for tests).

:func:`pallas_attention` computes block-sparse attention over a
:class:`~sparse_jax.masks.BlockLayout` for softmax, sparsemax, 1.5-entmax and α-entmax in
on-chip memory, flash-style: Triton kernels for GPUs (:mod:`sparse_jax.kernels.flash`) and
the same algorithm for TPUs (:mod:`sparse_jax.kernels.mosaic`).
"""

from sparse_jax.kernels.flash import TRITON_TILE, pallas_attention, pallas_supports

__all__ = ["TRITON_TILE", "pallas_attention", "pallas_supports"]
