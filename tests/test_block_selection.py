"""Tests of sparse_jax.dynamic.BlockSelection, the data-dependent candidate mask: its dense mask
against a numpy ranking of each query's mean block scores, its count against ``entries`` (the
same for every input), its attention against ``sparse_jax.attention`` under the dense mask
(values and gradients, grouped-query heads, lengths that are not multiples of the block), the
selection read token by token into a cache equal to the whole-sequence one, strict causality
(changing a later token changes no earlier row), and argument errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.dispatch import attention
from sparse_jax.dynamic import BlockSelection

TOL = {"rtol": 1e-5, "atol": 1e-5}


def inputs(t=11, n=4, kh=2, d=8, b=2, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, n, d))
    k = jax.random.normal(kk, (b, t, kh, d))
    v = jax.random.normal(kv, (b, t, kh, d))
    return q, k, v


def reference_mask(sel, q, k):
    """numpy, loop by loop: per (batch, head, query) the own block and the local_blocks - 1
    before it, plus the keep_blocks earlier blocks of highest scale·q·mean(k_block) (ties to the
    lower block), then causal."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, t, n, d = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, n, t, t), bool)
    for bi in range(b):
        for h in range(n):
            for i in range(t):
                own = i // sel.block
                blocks = {c for c in range(own - sel.local_blocks + 1, own + 1) if c >= 0}
                earlier = list(range(0, own - sel.local_blocks + 1))
                means = [
                    k[bi, c * sel.block : (c + 1) * sel.block, h // g].mean(0) for c in earlier
                ]
                score = [d**-0.5 * q[bi, i, h] @ m for m in means]
                order = sorted(range(len(earlier)), key=lambda j: (-score[j], j))
                blocks |= {earlier[j] for j in order[: sel.keep_blocks]}
                for c in blocks:
                    out[bi, h, i, c * sel.block : min((c + 1) * sel.block, i + 1)] = True
    return out


@pytest.mark.parametrize(
    "keep, block, local", [(0, 3, 1), (1, 3, 1), (2, 2, 1), (1, 2, 2), (5, 3, 1)]
)
def test_the_dense_mask_is_the_ranking_of_mean_block_scores_and_counts_entries(keep, block, local):
    sel = BlockSelection(keep_blocks=keep, block=block, local_blocks=local)
    q, k, _ = inputs()
    m = np.asarray(sel.dense(q, k))
    assert m.dtype == np.bool_ and m.shape == (2, 4, 11, 11)
    np.testing.assert_array_equal(m, reference_mask(sel, q, k))
    # The count is data-independent: every batch element and head allows `entries` scores.
    np.testing.assert_array_equal(m.sum((-1, -2)), sel.entries(11, 11))


def test_entries_and_formed_by_position():
    sel = BlockSelection(keep_blocks=1, block=4)
    # Query p keeps its own block up to p, plus one earlier block of 4 from p = 4 on.
    per_query = [p % 4 + 1 + (4 if p >= 4 else 0) for p in range(10)]
    assert sel.entries(10, 10) == sum(per_query)
    assert sel.entries(3, 10) == sum(per_query[-3:])  # the last 3 of 10 positions
    # Formed: whole blocks, one for p < 4 and two after.
    assert sel.formed(10) == 4 * (4 * 1 + 6 * 2)
    assert BlockSelection(keep_blocks=0, block=4).formed(10) == 40


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_attention_is_attention_under_the_dense_mask_values_and_gradients(normalizer):
    sel = BlockSelection(keep_blocks=1, block=3)
    q, k, v = inputs()
    mask = sel.dense(q, k)

    def ours(q, k, v):
        return sel.attention(q, k, v, normalizer=normalizer)

    def reference(q, k, v):
        return attention(q, k, v, mask=mask, normalizer=normalizer, impl="xla")

    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), **TOL)

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)

    for ga, gb in zip(grads(ours), grads(reference), strict=True):
        np.testing.assert_allclose(ga, gb, **TOL)


def test_token_by_token_selection_equals_the_whole_sequence():
    sel = BlockSelection(keep_blocks=2, block=2)
    q, k, _ = inputs(t=9)
    whole = sel.dense(q, k)
    step = jax.jit(lambda q, k, i: sel.dense(q, k, q_offset=i))
    for i in range(9):
        # A cache of 9 slots written up to i; later slots hold junk the selection must not see.
        cache = k.at[:, i + 1 :].set(1e3)
        row = step(q[:, i : i + 1], cache, i)
        np.testing.assert_array_equal(row[:, :, 0], whole[:, :, i])


def test_a_later_token_changes_no_earlier_row():
    sel = BlockSelection(keep_blocks=1, block=2)
    q, k, v = inputs(t=10)
    out = sel.attention(q, k, v)
    later = 7
    k2 = k.at[:, later:].multiply(-3.0)
    v2 = v.at[:, later:].add(5.0)
    out2 = sel.attention(q, k2, v2)
    np.testing.assert_allclose(out2[:, :later], out[:, :later], **TOL)
    assert not np.allclose(out2[:, later:], out[:, later:])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_blocks": -1}, "keep_blocks"),
        ({"keep_blocks": 1.5}, "keep_blocks"),
        ({"keep_blocks": 1, "block": 0}, "block"),
        ({"keep_blocks": 1, "local_blocks": 0}, "local_blocks"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        BlockSelection(**kwargs)
