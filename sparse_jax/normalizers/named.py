"""One entry point by name or α, what the attention engines call: :func:`normalize` and the
names it accepts, :data:`NORMALIZERS`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401 (the examples use it)

from sparse_jax.normalizers.alpha_entmax import entmax
from sparse_jax.normalizers.arguments import (
    check_alpha,
    check_row_length,
    check_scores,
    check_where,
)
from sparse_jax.normalizers.exact import entmax15, sparsemax
from sparse_jax.normalizers.softmax import masked_softmax

__all__ = ["NORMALIZERS", "normalize"]

#: Normalizer names accepted by ``normalizer=`` (besides an α, a float > 1 or an array).
NORMALIZERS = ("softmax", "sparsemax", "entmax15")


def normalize(s: jax.Array, allowed: jax.Array | None, normalizer: Any) -> jax.Array:
    """Scores ``s [..., keys]`` to weights under a normalizer (a name or an α): the engines' call.

    ``allowed`` (bool, broadcastable to ``s``, or None) masks keys; ``-inf`` scores are masked
    too; non-finite scores follow the package's policy. ``normalizer``: one of
    :data:`NORMALIZERS` or an α for :func:`entmax` (an α array must broadcast to ``s`` without
    its last axis). Returns weights of ``s``'s shape (e.g. ``[batch, heads, q, kv]``) and dtype.

    Example:
      >>> s = jnp.array([1.0, 0.8, -1.0])  # [keys]
      >>> print(np.asarray(normalize(s, None, "sparsemax")).round(4))
      [0.6 0.4 0. ]
      >>> print(np.asarray(normalize(s, jnp.array([True, False, True]), 1.5)).round(4))
      [1. 0. 0.]
    """
    s = check_scores(s, "normalize", "s")
    check_row_length(s, s.ndim - 1, "normalize", "s")
    allowed = check_where(allowed, s.shape, "normalize", "allowed")
    if isinstance(normalizer, str):
        if normalizer not in NORMALIZERS:
            raise ValueError(
                f"normalize: unknown `normalizer`={normalizer!r}; allowed: {list(NORMALIZERS)} "
                "or an α > 1 for entmax."
            )
        if normalizer == "softmax":
            return masked_softmax(s, jnp.bool_(True) if allowed is None else allowed)
        if normalizer == "sparsemax":
            return sparsemax(s, axis=-1, where=allowed)
        return entmax15(s, axis=-1, where=allowed)
    check_alpha(normalizer, s.shape[:-1], "normalize", "normalizer")
    return entmax(s, normalizer, axis=-1, where=allowed)
