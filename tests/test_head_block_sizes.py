"""Block sizes per head on the block-sparse engine: ``FixedAttention(head_block_sizes=...)``,
``serving_block_size`` and what ``harden()`` chooses with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.blocksparse import blocksparse_cost
from sparse_jax.masks import causal, local, per_head, sink
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config, harden
from sparse_jax.models.flops import SERVING_BLOCKS, SERVING_SLACK, serving_block_size
from sparse_jax.models.layers import FixedAttention
from tests.engines import assert_engine, traced_equations

CAUSAL = causal()
WINDOW = causal() & local(7, 0)


def _score_blocks(fn, *args) -> set[tuple[int, int]]:
    """``(block_q, block_kv)`` of every score product the block-sparse engine forms in the
    program ``fn(*args)`` traces to (its einsum ``...i d, ...k j d -> ...i k j``)."""
    found = set()
    for eqn in traced_equations(fn, *args):
        scope = str(eqn.source_info.name_stack)
        if eqn.primitive.name == "dot_general" and "sparse_jax/blocksparse" in scope:
            if "->bagcikj" in scope:
                shape = eqn.outvars[0].aval.shape
                found.add((shape[-3], shape[-1]))
    return found


def _qkv(shape, seed=0):
    return tuple(jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(seed), 3))


def test_each_group_of_heads_runs_at_its_own_blocks_with_the_same_values_and_gradients():
    mask = per_head([CAUSAL, WINDOW, CAUSAL, WINDOW])
    sizes = [(32, 32), (8, 8), (32, 32), (8, 8)]
    layer = FixedAttention(4, mask=mask, block_size=(16, 16), head_block_sizes=sizes)
    shared = FixedAttention(4, mask=mask, block_size=(16, 16))
    q, k, v = _qkv((2, 64, 4, 8))

    def loss(layer, q, k, v):
        return jnp.sum(jnp.sin(layer(q, k, v)[0]))

    assert _score_blocks(lambda q, k, v: layer(q, k, v)[0], q, k, v) == {(32, 32), (8, 8)}
    assert _score_blocks(lambda q, k, v: shared(q, k, v)[0], q, k, v) == {(16, 16)}
    assert_engine("blocksparse", lambda q, k, v: layer(q, k, v)[0], q, k, v)
    out = jax.jit(lambda q, k, v: (layer(q, k, v)[0], shared(q, k, v)[0]))(q, k, v)
    np.testing.assert_allclose(*out, rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(lambda q, k, v: loss(layer, q, k, v), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda q, k, v: loss(shared, q, k, v), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_a_learned_alpha_per_head_follows_its_head_into_its_group():
    mask = per_head([CAUSAL, WINDOW, CAUSAL])
    sizes = [(16, 16), (4, 4), (16, 16)]
    layer = FixedAttention(
        3,
        mask=mask,
        normalizer="entmax15",
        learn_alpha=True,
        block_size=(8, 8),
        head_block_sizes=sizes,
    )
    shared = FixedAttention(
        3, mask=mask, normalizer="entmax15", learn_alpha=True, block_size=(8, 8)
    )
    alphas = jnp.asarray([0.3, -0.4, 1.1])
    layer.alpha_logit[...] = alphas
    shared.alpha_logit[...] = alphas
    q, k, v = _qkv((1, 32, 3, 8), seed=1)

    def d_alpha(layer):
        grads = nnx.jit(nnx.grad(lambda layer: jnp.sum(layer(q, k, v)[0] ** 2)))(layer)
        return grads["alpha_logit"][...]

    def forward(layer):
        return nnx.jit(lambda layer: layer(q, k, v)[0])(layer)

    np.testing.assert_allclose(forward(layer), forward(shared), rtol=1e-5, atol=1e-6)
    got, want = d_alpha(layer), d_alpha(shared)
    assert np.all(np.abs(want) > 1e-4)  # every head's α moves the loss
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_other_engines_and_decoding_use_the_layers_block_size():
    layer = FixedAttention(
        2,
        mask=per_head([CAUSAL, WINDOW]),
        impl="xla",
        block_size=(16, 16),
        head_block_sizes=[(32, 32), (8, 8)],
    )
    q, k, v = _qkv((1, 32, 2, 8))
    assert_engine("xla", lambda q, k, v: layer(q, k, v)[0], q, k, v)
    blocks = FixedAttention(
        2, mask=per_head([CAUSAL, WINDOW]), block_size=(16, 16), head_block_sizes=[(32, 32), (8, 8)]
    )
    # Decoding one token into a cache: a traced offset, the XLA engine on the mask array.
    out, _ = blocks(q[:, -1:], k, v, q_offset=jnp.int32(31))
    full, _ = blocks(q, k, v)
    np.testing.assert_allclose(out[:, 0], full[:, -1], rtol=1e-5, atol=1e-6)


def test_scores_formed_counts_each_group_at_its_blocks():
    mask = per_head([CAUSAL, WINDOW, CAUSAL])
    sizes = [(32, 32), (8, 8), (32, 32)]
    layer = FixedAttention(
        3, mask=mask, impl="blocksparse", block_size=(16, 16), head_block_sizes=sizes
    )
    n = 64

    def formed(m, size, heads):
        layout = m.blocks(n, n, *size)
        return blocksparse_cost(layout, batch=2, num_heads=heads, head_dim=8).computed_scores

    want = formed(CAUSAL, (32, 32), 2) + formed(WINDOW, (8, 8), 1)
    assert layer.scores_formed(n, batch=2, head_dim=8) == want
    assert want != formed(mask, (16, 16), 3)  # the layer's own blocks would count otherwise
    assert layer.head_block_size(1) == (8, 8)
    assert FixedAttention(3, mask=mask, block_size=(16, 16)).head_block_size(1) == (16, 16)


def test_serving_block_size_is_the_largest_within_the_slack_of_the_fewest_entries():
    for mask in (
        CAUSAL,
        causal() & local(31, 0),
        (sink(4) & causal()) | (causal() & local(31, 0)),
        causal() & local(127, 0),
    ):
        for n in (128, 512, 2048):
            formed = {
                b: blocksparse_cost(
                    mask.blocks(n, n, b, b), batch=1, num_heads=1, head_dim=1
                ).computed_scores
                for b in SERVING_BLOCKS
            }
            fewest = min(formed.values())
            want = max(b for b in SERVING_BLOCKS if formed[b] <= SERVING_SLACK * fewest)
            assert serving_block_size(mask, n) == (want, want), (mask, n)
    assert serving_block_size(CAUSAL, 2048) == (128, 128)
    assert serving_block_size(causal() & local(31, 0), 512) == (32, 32)


def test_serving_block_size_takes_no_block_whose_widest_row_outgrows_a_step(monkeypatch):
    """Causal attention at 8,192 tokens: one query block of 128 against its 64 key blocks forms
    2**20 scores, past the CPU engine's step of 2**19, so blocks of 64 serve it (their widest
    row, 2**19, fits); at 4,096 the row of 128 fits and 128 stays. With a smaller step every
    square block's widest row is recomputed from the layout and the rule followed."""
    import jax

    from sparse_jax import blocksparse
    from sparse_jax.models import flops

    step = blocksparse.STEP_SCORES.get(jax.default_backend(), blocksparse.STEP_SCORES["default"])
    if step == 2**19:  # the CPU's
        assert serving_block_size(CAUSAL, 8192) == (64, 64)
        assert serving_block_size(CAUSAL, 4096) == (128, 128)

    def widest(mask, n, b):
        layout = mask.blocks(n, n, b, b)
        return b * b * max(width for _, width in blocksparse.row_groups(layout))

    for budget in (2**13, 2**15, 2**16):
        monkeypatch.setitem(flops.STEP_SCORES, jax.default_backend(), budget)
        for mask in (CAUSAL, (sink(4) & causal()) | (causal() & local(255, 0))):
            n = 1024
            formed = {b: formed_scores(mask, n, b) for b in SERVING_BLOCKS}
            near = [b for b in SERVING_BLOCKS if formed[b] <= SERVING_SLACK * min(formed.values())]
            fits = [b for b in near if widest(mask, n, b) <= budget]
            want = max(fits) if fits else min(near, key=lambda b: (widest(mask, n, b), formed[b]))
            assert serving_block_size(mask, n) == (want, want), (mask, budget)
    assert serving_block_size(CAUSAL, 1024) == (64, 64)  # 2**16: 64 x 1024 fits, 128 x 1024 not


def formed_scores(mask, n: int, b: int) -> int:
    return blocksparse_cost(
        mask.blocks(n, n, b, b), batch=1, num_heads=1, head_dim=1
    ).computed_scores


def test_harden_gives_each_head_its_serving_blocks_and_the_same_logits():
    config = GPT2Config.preset("tiny")  # 3 heads of 16, 2 blocks
    config = GPT2Config(**{**config.__dict__, "n_positions": 1024})
    window = causal() & local(15, 0)
    spec = AttentionSpec(
        kind="candidates", candidates=(causal(), window), granularity="head", block_size=(64, 64)
    )
    student = GPT2(config, spec, rngs=nnx.Rngs(0))
    for block in student.h:  # head 0 keeps causal, heads 1 and 2 the window
        block.attn.core.logits[...] = jnp.asarray([[3.0, -3.0], [-3.0, 3.0], [-3.0, 3.0]])
    hard = harden(student, threshold=0.5)
    for block in hard.h:
        core = block.attn.core
        assert (
            core.head_block_sizes
            == (
                serving_block_size(causal(), 1024),
                serving_block_size(window, 1024),
                serving_block_size(window, 1024),
            )
            == ((128, 128), (32, 32), (32, 32))
        )
    ids = jax.random.randint(jax.random.key(0), (1, 256), 0, config.vocab_size)
    same_blocks = GPT2(
        hard.config,
        [AttentionSpec(mask=b.attn.core.mask, block_size=(64, 64)) for b in hard.h],
        rngs=nnx.Rngs(1),
    )
    nnx.update(same_blocks, nnx.state(hard, nnx.Param))
    logits = nnx.jit(lambda model: model(ids))
    np.testing.assert_allclose(logits(hard), logits(same_blocks), rtol=1e-4, atol=1e-4)
    assert hard.flops(256).attention < same_blocks.flops(256).attention


@pytest.mark.parametrize(
    "sizes, match",
    [
        ([(32, 32)], "one .* pair per head"),
        ([(32, 32), (0, 8)], r"head_block_sizes\[1\]"),
        ("big", "one .* pair per head"),
    ],
)
def test_bad_head_block_sizes_are_refused_by_name(sizes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FixedAttention(2, head_block_sizes=sizes)


def test_head_block_sizes_belong_to_fixed_specs():
    with pytest.raises(ValueError, match="head_block_sizes"):
        AttentionSpec(kind="candidates", head_block_sizes=((32, 32),))
