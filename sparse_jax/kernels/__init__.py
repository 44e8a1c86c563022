"""Fused attention kernels written in Pallas (GPU; interpret mode on CPU for tests).

:func:`pallas_attention` computes block-sparse attention over a
:class:`~sparse_jax.masks.BlockLayout` for softmax, sparsemax, 1.5-entmax and α-entmax in
on-chip memory, flash-style: see :mod:`sparse_jax.kernels.flash`.
"""

from sparse_jax.kernels.flash import pallas_attention, pallas_supports

__all__ = ["pallas_attention", "pallas_supports"]
