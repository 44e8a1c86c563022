"""What the model tests share about decoding: a GPT-2 decoded with its caches, a prompt, one
token, then a chunk, gives the logits of one full pass, and greedy generation picks each token
as the argmax of the full pass over its prefix."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sparse_jax.models import generate


def check_cached_decoding(model, ids) -> None:
    """Asserts both for ``model`` on ``ids [batch, 12]`` (int32 token ids)."""
    full = model(ids)
    caches = model.init_cache(ids.shape[0], ids.shape[1])
    pieces = []
    for lo, hi in ((0, 5), (5, 6), (6, 12)):  # a prompt, one token on the cache, then a chunk
        logits, caches = model.decode(ids[:, lo:hi], caches)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, atol=1e-5)
    greedy = generate(model, ids[:, :4], 3, temperature=0.0)
    # The model is causal, so one full pass gives every prefix's last logits (position t - 1's).
    prefixes = model(greedy[:, :6])
    for t in range(4, 7):
        np.testing.assert_array_equal(greedy[:, t], jnp.argmax(prefixes[:, t - 1], -1))
