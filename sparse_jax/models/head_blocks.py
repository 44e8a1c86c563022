"""Heads of one layer at different block sizes on the block-sparse engine: a hardened layer's
window heads run at small blocks and its full causal heads at large ones
(:class:`~sparse_jax.models.layers.FixedAttention`'s ``head_block_sizes``, chosen by
:func:`~sparse_jax.models.flops.serving_block_size`). The heads are grouped by block size and
each group runs as one call (:func:`block_groups`, :func:`attention_by_block_size`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import masks as masks_lib
from sparse_jax.blocksparse import blocksparse_cost
from sparse_jax.dispatch import attention
from sparse_jax.validation import check_block_size

__all__ = [
    "attention_by_block_size",
    "block_groups",
    "check_head_block_sizes",
    "formed_by_block_size",
]

Group = tuple[tuple[int, int], list[int], masks_lib.Mask]


def check_head_block_sizes(
    sizes: Any, num_heads: int, block_size: tuple[int, int], caller: str
) -> tuple[tuple[int, int], ...] | None:
    """``head_block_sizes`` as a tuple of ``num_heads`` pairs, or None when absent or every
    head's is ``block_size``.

    Example:
      >>> check_head_block_sizes([[32, 32], (64, 64)], 2, (64, 64), "me")
      ((32, 32), (64, 64))
      >>> check_head_block_sizes([(64, 64)] * 2, 2, (64, 64), "me") is None
      True
    """
    if sizes is None:
        return None
    if not isinstance(sizes, (tuple, list)) or len(sizes) != num_heads:
        raise ValueError(
            f"{caller}: `head_block_sizes` must hold one (block_q, block_kv) pair per head "
            f"({num_heads}); got {sizes!r}"
        )
    pairs = tuple(
        check_block_size(pair, f"{caller} (head_block_sizes[{h}])") for h, pair in enumerate(sizes)
    )
    return None if all(pair == tuple(block_size) for pair in pairs) else pairs


def block_groups(
    head_masks: Sequence[masks_lib.Mask], sizes: Sequence[tuple[int, int]]
) -> list[Group]:
    """``(block size, heads, their mask)`` per group of heads of equal block size, in order of
    each group's first head; the mask is shared when the group's heads agree, else per head.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> masks = [causal(), causal() & local(3, 0), causal()]
      >>> groups = block_groups(masks, [(16, 16), (4, 4), (16, 16)])
      >>> [(size, heads, mask) for size, heads, mask in groups]
      [((16, 16), [0, 2], Causal()), ((4, 4), [1], (Causal() & Local(left=3, right=0)))]
    """
    by_size: dict[tuple[int, int], list[int]] = {}
    for h, size in enumerate(sizes):
        by_size.setdefault(tuple(size), []).append(h)
    groups = []
    for size, heads in by_size.items():
        own = [head_masks[h] for h in heads]
        mask = own[0] if all(m == own[0] for m in own) else masks_lib.per_head(own)
        groups.append((size, heads, mask))
    return groups


def attention_by_block_size(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    groups: Sequence[Group],
    normalizer: Any,
    offset: int = 0,
) -> jax.Array:
    """The block-sparse engine on each group of :func:`block_groups` at its own blocks, the
    outputs put back in head order: ``q [B, T, N, H]``, ``k, v [B, S, N, H]`` ->
    ``[B, T, N, H]``. ``normalizer`` as :func:`sparse_jax.attention` takes it (an α per head
    ``[N]`` follows its heads); ``offset`` shifts the masks (``S - T`` when the queries are the
    last ``T`` positions).

    Example:
      >>> import jax.numpy as jnp
      >>> from sparse_jax.masks import causal, local
      >>> groups = block_groups([causal(), causal() & local(3, 0)], [(16, 16), (4, 4)])
      >>> q = jnp.ones((1, 32, 2, 8))  # [batch, seq, heads, head_dim]
      >>> attention_by_block_size(q, q, q, groups, "softmax").shape
      (1, 32, 2, 8)
    """
    outs, order = [], []
    for size, heads, mask in groups:
        index = np.asarray(heads)
        norm = normalizer
        if isinstance(norm, jax.Array) and norm.ndim == 1:
            norm = norm[index]
        mask = mask.with_offset(offset) if offset else mask
        qh, kh, vh = (x[:, :, index] for x in (q, k, v))
        outs.append(
            attention(qh, kh, vh, mask=mask, normalizer=norm, impl="blocksparse", block_size=size)
        )
        order += heads
    out = jnp.concatenate(outs, axis=2)
    return out if order == sorted(order) else out[:, :, np.argsort(order)]


def formed_by_block_size(groups: Sequence[Group], seq_len: int, batch: int, head_dim: int) -> int:
    """Score entries one causal self-attention call of :func:`attention_by_block_size` forms
    on ``[batch, seq_len]``: each group's computed blocks at its own block size
    (:func:`~sparse_jax.blocksparse.blocksparse_cost`).

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> groups = block_groups([causal(), causal() & local(3, 0)], [(16, 16), (4, 4)])
      >>> formed_by_block_size(groups, 32, batch=1, head_dim=8)  # 3 blocks of 256, 16 of 16
      1024
    """
    return sum(
        blocksparse_cost(
            mask.blocks(seq_len, seq_len, *size), batch=batch, num_heads=len(heads),
            head_dim=head_dim,
        ).computed_scores
        for size, heads, mask in groups
    )  # fmt: skip
