"""Analytic FLOPs against hand computations on 2-layer models."""

from __future__ import annotations

import pytest
from flax import nnx

from sparse_jax.masks import causal, local, per_head, sink
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config
from sparse_jax.models.flops import attention_scores, mask_density, model_flops


def test_dense_two_layer_model_by_hand():
    # tiny: D=48, N=3 heads of H=16, U=192, V=101; T=8 runs dense (blocks of 128 would be
    # larger than the whole score matrix), so all 3 * 8 * 8 score entries are formed.
    report = model_flops(GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0)), 8, batch=2)
    t, b, d, n, h, u, v = 8, 2, 48, 3, 16, 192, 101
    projections = 2 * b * t * d * (3 * n * h) + 2 * b * t * (n * h) * d
    attention = 2 * (b * n * t * t * h) * 2  # q k^T and p v
    ffn = 2 * b * t * d * u * 2
    for layer in report.layers:
        assert (layer.projections, layer.attention, layer.ffn) == (projections, attention, ffn)
        assert layer.attention_density == pytest.approx(36 / 64)  # causal at T = 8
        assert layer.computed_fraction == 1.0
    assert report.lm_head == 2 * b * t * d * v
    assert report.total == 2 * (projections + attention + ffn) + 2 * b * t * d * v
    assert report.per_token == report.total / (b * t)


def test_block_sparse_and_pruned_two_layer_model_by_hand():
    mask = causal() & local(7, 0)  # at T=32 with blocks of 8: rows keep 1, 2, 2, 2 blocks
    spec = AttentionSpec(mask=mask, impl="blocksparse", block_size=(8, 8))
    config = GPT2Config.preset("tiny", heads_per_layer=(2, 1), inner_per_layer=(100, 0))
    report = model_flops(GPT2(config, spec, rngs=nnx.Rngs(0)), 32)
    for layer, n, u in zip(report.layers, (2, 1), (100, 0), strict=True):
        formed = n * 7 * 8 * 8  # 7 kept blocks of 8 x 8 per head, no padding
        assert layer.attention == 2 * 2 * formed * 16
        assert layer.projections == 2 * 32 * 48 * 4 * n * 16
        assert layer.ffn == 2 * 2 * 32 * 48 * u
        assert layer.attention_density == pytest.approx(mask.dense(32, 32).mean())
    assert report.attention_density == pytest.approx(mask.dense(32, 32).mean())


def test_soft_students_count_dense_or_summed_work():
    cands = (sink(2) & causal(), causal() & local(3, 0))
    union = (cands[0] | cands[1]).dense(16, 16).mean()
    for combine, fraction in (("soft_union", 1.0), ("mixture", 2.0)):
        spec = AttentionSpec(kind="candidates", candidates=cands, combine=combine)
        layer = model_flops(GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0)), 16).layers[0]
        assert layer.attention_density == pytest.approx(union)
        assert layer.computed_fraction == pytest.approx(fraction)  # mixture: two dense passes


def test_layers_describe_their_work_and_gpt2_flops_is_model_flops():
    cands = (sink(2) & causal(), causal() & local(3, 0))
    for combine in ("soft_union", "mixture"):
        spec = AttentionSpec(
            kind="candidates", candidates=cands, combine=combine, anchor_self=False
        )
        model = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
        core = model.h[0].attn.core
        assert core.allowed_mask() == cands[0] | cands[1]
        # 3 heads, T = 16, batch 2: dense with a bias, or one (dense, T < 128) pass per candidate
        per_pass = 2 * 3 * 16 * 16
        want = per_pass if combine == "soft_union" else 2 * per_pass
        assert core.scores_formed(16, batch=2, head_dim=16) == want
        assert model.flops(16, batch=2) == model_flops(model, 16, batch=2)
    fixed = GPT2(
        GPT2Config.preset("tiny"),
        AttentionSpec(mask=causal() & local(7, 0), impl="blocksparse", block_size=(8, 8)),
        rngs=nnx.Rngs(0),
    )
    assert fixed.h[0].attn.core.scores_formed(32, head_dim=16) == 3 * 7 * 8 * 8


def test_density_is_the_fraction_of_the_whole_square():
    # causal at T = 4: 10 of 16 entries (not 10 of the 10 causal ones); a per-head mask: the
    # mean over heads.
    assert mask_density(causal(), 4) == 10 / 16
    assert mask_density(sink(1) & causal(), 4) == 4 / 16
    assert mask_density(per_head([causal(), sink(1) & causal()]), 4) == 14 / 32
    with pytest.raises(TypeError, match="`seq_len` must be an int >= 1"):
        mask_density(causal(), 4.0)


def test_attention_scores_reports_the_implementation():
    formed, density, impl = attention_scores(causal(), 64, num_heads=2, head_dim=8, impl="xla")
    assert (formed, impl) == (2 * 64 * 64, "xla")
    assert density == pytest.approx((64 * 65 / 2) / 64**2)


def test_bad_length():
    with pytest.raises(ValueError, match="seq_len"):
        model_flops(GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0)), 0)
