"""sparse_jax: sparse attention for JAX/Flax.

The functional API is re-exported here::

    import sparse_jax as sj
    p = sj.sparsemax(scores, axis=-1, where=mask)
"""

from sparse_jax.sparsemax import (
    entmax,
    entmax15,
    entmax15_loss,
    entmax_loss,
    sparsemax,
    sparsemax_loss,
)

__all__ = [
    "entmax",
    "entmax15",
    "entmax15_loss",
    "entmax_loss",
    "sparsemax",
    "sparsemax_loss",
]

__version__ = "0.1.0"
