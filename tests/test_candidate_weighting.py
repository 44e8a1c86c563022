"""Candidate weights as a distribution (sparsemax/entmax15 over each head's candidates) and the
block-priced expected cost: the parts of the main job's learning issue that live in the layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparse_jax import attention, masks
from sparse_jax.blocksparse import row_groups
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config, harden
from sparse_jax.models.layers import CandidateMaskAttention, mask_at

CANDIDATES = (
    masks.causal() & masks.sink(2),
    masks.causal() & masks.local(4, 0),
    masks.causal() & masks.local(16, 0),
    masks.causal(),
)


@pytest.mark.parametrize("weighting", ["sparsemax", "entmax15", "reviving_sparsemax"])
def test_weights_are_a_distribution_per_head_that_a_shift_cannot_change(weighting):
    combine = "mixture" if weighting == "reviving_sparsemax" else "soft_union"
    layer = CandidateMaskAttention(
        3, CANDIDATES, granularity="head", weighting=weighting, combine=combine
    )
    layer.logits[...] = jnp.array([[2.0, 0.0, -1.0, 0.5], [0.0] * 4, [5.0, 1.0, 0.0, 0.0]])
    w = layer.candidate_weights()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-6)
    assert float(w[2, 1]) == 0.0 and float(w[2, 0]) == 1.0  # exact zeros
    np.testing.assert_allclose(w[1], 0.25)
    before = layer.candidate_weights()
    layer.logits[...] = layer.logits[...] + 3.0  # the same shift on every logit of a row
    np.testing.assert_allclose(layer.candidate_weights(), before, atol=1e-6)
    # Support hardening: exactly the candidates with weight > 0.
    np.testing.assert_array_equal(layer.kept_candidates(), np.asarray(before) > 0)


def test_softmax_weights_keep_every_candidates_gradient_and_harden_to_the_strongest():
    layer = CandidateMaskAttention(2, CANDIDATES, granularity="head", weighting="softmax")
    layer.logits[...] = jnp.array([[4.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.9, -30.0]])
    w = np.asarray(layer.candidate_weights())
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(w, np.asarray(jax.nn.softmax(layer.logits[...], axis=-1)))
    assert (w > 0).all()  # no exact zeros: a weak candidate still gets a gradient (below)
    np.testing.assert_array_equal(  # default: weight >= 0.5 or the strongest
        layer.kept_candidates(), [[True, False, False, False], [False, True, False, False]]
    )
    q = jax.random.normal(jax.random.key(0), (1, 12, 2, 4))

    layer.logits[...] = jnp.array([[4.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.9, -3.0]])
    grad = nnx.grad(lambda layer: jnp.sum(layer(q, q, q)[0] ** 2))(layer).logits[...]
    assert (np.abs(np.asarray(grad)) > 0).all()


def test_block_costs_price_the_kernels_blocks_at_the_serving_length():
    layer = CandidateMaskAttention(
        1,
        [masks.causal() & masks.local(127, 0), masks.strided(64), masks.causal()],
        price_len=2048,
        block_size=(128, 128),
    )
    costs = layer.block_costs()

    def computed_blocks(mask):  # counted here from the layout's row groups
        return sum(
            len(rows) * width for rows, width in row_groups(mask.blocks(2048, 2048, 128, 128))
        )

    causal = computed_blocks(masks.causal())
    expected = [computed_blocks(masks.causal() & masks.local(127, 0)) / causal, 1.0, 1.0]
    np.testing.assert_allclose(costs, expected)
    # The strided mask keeps under a tenth of the causal entries but touches every causal
    # block: it costs what causal costs, although its density is far lower.
    assert layer.causal_shares(2048, 2048)[1] < 0.1 and costs[1] == 1.0
    # The penalty prices at price_len, whatever the call's length.
    q = jnp.ones((1, 32, 1, 8))
    _, aux = layer(q, q, q)
    np.testing.assert_allclose(aux["expected_cost"], np.mean(costs), rtol=1e-6)


def test_zero_weights_mask_their_entries_with_finite_gradients():
    layer = CandidateMaskAttention(2, CANDIDATES, granularity="head", weighting="sparsemax")
    layer.logits[...] = jnp.array([[9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])  # one-hot
    q, k, v = (
        jax.random.normal(key, (1, 24, 2, 8)) for key in jax.random.split(jax.random.key(0), 3)
    )

    def loss(layer):
        out, aux = layer(q, k, v)
        return jnp.sum(out**2) + aux["expected_cost"]

    grads = nnx.jit(nnx.grad(loss))(layer)
    assert bool(jnp.isfinite(grads.logits[...]).all())
    out, _ = layer(q, k, v)
    sink = attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], mask=CANDIDATES[0])
    np.testing.assert_allclose(out[:, :, :1], sink, atol=1e-5)  # head 0 is the sink alone


def test_the_learned_distribution_recovers_planted_masks_and_support_hardening_keeps_them():
    """Each head of a target uses one candidate; only the student's logits train (MSE to the
    target plus the expected block cost). The support of each head's weights is a set of
    candidates whose union is the planted mask."""
    t, n = 32, 4
    planted = [1, 0, 2, 3]
    q, k, v = (
        x * 2
        for x in (
            jax.random.normal(key, (4, t, n, 8)) for key in jax.random.split(jax.random.key(0), 3)
        )
    )
    target = jnp.concatenate(
        [attention(q[:, :, h : h + 1], k[:, :, h : h + 1], v[:, :, h : h + 1], mask=CANDIDATES[c])
         for h, c in enumerate(planted)],
        axis=2,
    )  # fmt: skip
    layer = CandidateMaskAttention(
        n, CANDIDATES, granularity="head", weighting="sparsemax", init_logit=0.0,
        price_len=256, block_size=(16, 16),
    )  # fmt: skip
    optimizer = nnx.Optimizer(layer, optax.adam(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(layer, optimizer):
        def loss(layer):
            out, aux = layer(q, k, v)
            return jnp.mean((out - target) ** 2) + 0.01 * aux["expected_cost"]

        optimizer.update(layer, nnx.grad(loss)(layer))

    for _ in range(300):
        step(layer, optimizer)
    w = np.asarray(layer.candidate_weights())
    assert (w.argmax(axis=1) == planted).mean() >= 0.75, w  # the largest weight is planted
    for head, mask in enumerate(layer.head_masks()):  # support hardening
        np.testing.assert_array_equal(
            mask_at(mask, t, t), mask_at(CANDIDATES[planted[head]], t, t), err_msg=str(w[head])
        )


def test_reviving_weights_find_a_candidate_dropped_at_the_start():
    """One head of the mixture whose target attends under full causal attention, its weights
    starting on the sink alone (causal outside the support): sparsemax weights never move
    (their gradient is exactly zero off the support and a one-candidate support has no
    direction), reviving sparsemax weights end on causal."""
    t = 32
    q, k, v = (
        jax.random.normal(key, (4, t, 1, 8)) * 2 for key in jax.random.split(jax.random.key(1), 3)
    )
    target = attention(q, k, v, mask=CANDIDATES[3])
    found = {}
    for weighting in ("sparsemax", "reviving_sparsemax"):
        layer = CandidateMaskAttention(
            1, CANDIDATES, granularity="head", combine="mixture", weighting=weighting
        )
        layer.logits[...] = jnp.array([[3.0, 0.0, 0.0, 0.0]])  # weights [1, 0, 0, 0]
        optimizer = nnx.Optimizer(layer, optax.adam(0.05), wrt=nnx.Param)

        @nnx.jit
        def step(layer, optimizer):
            loss = lambda layer: jnp.mean((layer(q, k, v)[0] - target) ** 2)
            optimizer.update(layer, nnx.grad(loss)(layer))

        for _ in range(150):
            step(layer, optimizer)
        found[weighting] = np.asarray(layer.candidate_weights())[0]
    np.testing.assert_array_equal(found["sparsemax"], [1.0, 0.0, 0.0, 0.0])
    assert found["reviving_sparsemax"].argmax() == 3, found


def test_gpt2_sums_the_expected_cost_and_hardens_by_support():
    spec = AttentionSpec(
        kind="candidates", candidates=CANDIDATES, granularity="head", weighting="sparsemax",
        price_len=64, block_size=(16, 16),
    )  # fmt: skip
    model = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    for block in model.h:
        block.attn.core.logits[...] = jnp.tile(
            jnp.array([1.0, 0.5, -3.0, -3.0]), (block.attn.num_heads, 1)
        )
    _, aux = model(jnp.zeros((1, 16), jnp.int32), return_aux=True)
    per_layer = [b.attn.core.block_costs() for b in model.h]
    w = np.asarray(model.h[0].attn.core.candidate_weights()[0])  # [0.75, 0.25, 0, 0]
    expected = sum(float(w @ costs) for costs in per_layer)
    np.testing.assert_allclose(aux["mask_expected_cost"], expected, rtol=1e-5)
    hard = harden(model)  # default threshold: each layer's support
    assert all(m == CANDIDATES[0] | CANDIDATES[1] for b in hard.h for m in b.attn.core.head_masks())
