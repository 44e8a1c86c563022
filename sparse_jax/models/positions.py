"""Position encodings shared by the models: sinusoids added to embeddings, and rotary positions
(RoPE) that turn queries and keys so that a score depends on positions only through their
distance (so a model can read sequences longer than those it trained on, where learned absolute
positions have no entry).

Shapes: ``B`` batch, ``L`` positions, ``N`` heads, ``H`` head dim, ``D`` model width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["rotate", "sinusoid"]


def sinusoid(positions: jax.Array, d_model: int) -> jax.Array:
    """Sinusoidal position encodings ``[..., D]`` of integer ``positions [...]``: sines of
    ``position · 10000^(-i/(D/2))`` in the first half of the features, their cosines in the
    second (an odd ``D`` ends with a zero).

    Example:
      >>> enc = sinusoid(jnp.arange(3), 4)  # [L, D]
      >>> enc.shape, enc[0].tolist()  # position 0: sines 0, cosines 1
      ((3, 4), [0.0, 0.0, 1.0, 1.0])
    """
    half = d_model // 2
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / max(half, 1))
    angle = positions.astype(jnp.float32)[..., None] * freq
    enc = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
    return jnp.pad(enc, [(0, 0)] * (enc.ndim - 1) + [(0, d_model - 2 * half)])


def rotate(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position encoding (RoPE) of queries or keys ``x [B, L, N, H]`` (``H`` even) at
    integer ``positions [L]``: each pair of features ``(x_i, x_{i+H/2})`` turned by the angle
    ``position · 10000^(-2i/H)``, so that the score of a rotated query and key depends on
    their positions only through their difference.

    Example:
      >>> q, k = jnp.ones((1, 1, 1, 4)), jnp.arange(4.0).reshape(1, 1, 1, 4)
      >>> def score(i, j):  # a query at i against a key at j
      ...     return float((rotate(q, jnp.array([i])) * rotate(k, jnp.array([j]))).sum())
      >>> round(score(5, 3), 4) == round(score(9, 7), 4)  # the same distance, the same score
      True
    """
    half = x.shape[-1] // 2
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq  # [L, H/2]
    cos, sin = (f(angle)[:, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))  # [L, 1, H/2]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
