"""Softmax restricted to a mask, beside the sparse normalizers: rows with nothing allowed give
zeros and zero gradients, under the same non-finite policy (package docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401 (the examples use it)

from sparse_jax.normalizers.arguments import (
    check_row_length,
    check_scores,
    check_where,
    compute_dtype,
)
from sparse_jax.normalizers.search import shift_to_zero_max

__all__ = ["masked_softmax"]


@jax.custom_jvp
def _softmax_rows(s, allowed):
    # The non-finite policy of the sparse normalizers, from the same shift: a row holding +inf
    # is uniform on those entries (the limit of softmax as they grow), clamped only when some
    # row holds +inf; an allowed NaN makes the whole row NaN (its maximum is NaN); masked
    # entries, whatever they hold, are -inf and weigh 0, as is a row with nothing allowed.
    z, _, _ = shift_to_zero_max(jnp.where(allowed, s, -jnp.inf))
    e = jnp.exp(z)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total == 0.0, 1.0, total)


@_softmax_rows.defjvp
def _softmax_rows_jvp(primals, tangents):
    s, allowed = primals
    ds, _ = tangents
    p = _softmax_rows(s, allowed)
    return p, p * (ds - jnp.sum(p * ds, axis=-1, keepdims=True))


def masked_softmax(s: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to ``allowed``; rows with nothing allowed give 0.

    Zero gradients there too, also when the allowed scores are all ``-inf`` (a ``-inf`` bias),
    where ``jax.nn.softmax(where=...)`` gives NaN; ``jax.nn.dot_product_attention`` averages
    the values of a fully masked row instead of returning 0.

    The JVP is written out (``p * (ds - <p, ds>)``) so that reverse mode keeps only ``p`` as a
    residual, not the masking ``where``s (faster whole attention: docs/benchmarks.md,
    "Design measurements").

    Shapes: scores ``s [..., keys]`` (e.g. ``[batch, heads, q, kv]``), ``allowed`` bool
    broadcastable to ``s``; returns weights of ``s``'s shape and dtype.

    Example:
      >>> s = jnp.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]])  # [rows, keys]
      >>> allowed = jnp.array([[True, True, False], [False, False, False]])
      >>> print(np.asarray(masked_softmax(s, allowed)).round(4))  # second row: nothing allowed
      [[0.2689 0.7311 0.    ]
       [0.     0.     0.    ]]
    """
    s = check_scores(s, "masked_softmax", "s")
    check_row_length(s, s.ndim - 1, "masked_softmax", "s")
    allowed = check_where(allowed, s.shape, "masked_softmax", "allowed")
    if allowed is None:
        allowed = jnp.bool_(True)
    return _compiled_softmax(s, allowed)


@jax.jit
def _compiled_softmax(s, allowed):
    # One compiled call, as the sparse normalizers' (arguments.normalize_rows): the masked max
    # is -inf inside, and jax.debug_infs checks only a compiled call's outputs.
    return _softmax_rows(s.astype(compute_dtype(s.dtype)), allowed).astype(s.dtype)
