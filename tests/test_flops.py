"""Analytic FLOPs against hand computations on 2-layer models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from sparse_jax.blocksparse import blocksparse_cost
from sparse_jax.dispatch import attention, attention_impl
from sparse_jax.masks import causal, local, per_head, sink
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config
from sparse_jax.models.flops import attention_scores, mask_density, model_flops
from tests.engines import assert_engine


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


# ----------------------------------------------------------------------------------------------
# Against an independent count: XLA's cost analysis of the compiled program.


def _xla_flops(fn, *args) -> float:
    # XLA:CPU's count on any machine: the GPU compiler counts other work (the blocksparse
    # softmax difference below came out 7% above the matmuls on an H200)
    args = jax.device_put(args, jax.devices("cpu")[0])
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
@pytest.mark.parametrize("impl", ["xla", "blocksparse"])
def test_attention_matmul_flops_agree_with_xla_cost_analysis(impl, normalizer):
    # XLA counts every operation; the analytic count is the two matrix products over the score
    # entries formed. Work on the scores (scaling, the normalizer) does not grow with the head
    # dim, so the difference of two head dims is the matmul work of the larger minus the smaller
    # (the few operations that do grow with it, e.g. q * scale, stay within the 3% allowed).
    # The shapes run in one chunk / one kernel step: no loop whose body XLA would count once.
    mask, t, b, n = causal() & local(15, 0), 128, 2, 2
    counted = {}
    for h in (16, 32):
        q = jnp.ones((b, t, n, h), jnp.float32)
        fn = functools.partial(
            attention, mask=mask, normalizer=normalizer, impl=impl, block_size=(16, 16)
        )
        assert_engine(impl, fn, q, q, q)
        counted[h] = _xla_flops(fn, q, q, q)
    formed, _, chosen = attention_scores(
        mask, t, batch=b, num_heads=n, head_dim=16, impl=impl, block_size=(16, 16)
    )
    assert chosen == impl
    if impl == "blocksparse":  # 8 query blocks keep 15 blocks of 16 x 16, widths padded to 2
        cost = blocksparse_cost(mask.blocks(t, t, 16, 16), batch=b, num_heads=n, head_dim=16)
        assert formed == cost.computed_scores == b * n * 8 * 2 * 16 * 16
    matmul = 2 * 2 * formed * 16  # q k^T and p v at head dim 32 minus head dim 16
    assert matmul <= counted[32] - counted[16] <= 1.03 * matmul
    # And the whole count: matmuls plus at most ~40 operations per score entry formed.
    assert 2 * 2 * formed * 16 < counted[16] < 2 * 2 * formed * 16 + 40 * formed


@functools.cache
def _model_counts(impl):
    """(XLA's count, the analytic ModelFlops) of a width where matrix products dominate (D =
    128, head dim 64, T = 128, batch 2)."""
    spec = AttentionSpec(mask=causal() & local(15, 0), impl=impl, block_size=(16, 16))
    config = GPT2Config.preset("tiny", n_embd=128, n_head=2, n_positions=128)
    model = GPT2(config, spec, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((2, 128), jnp.int32)
    forward = lambda state, ids: nnx.merge(graphdef, state)(ids)
    assert_engine(impl, forward, state, ids)
    return _xla_flops(forward, state, ids), model_flops(model, 128, batch=2)


@pytest.mark.parametrize("impl", ["xla", "blocksparse"])
def test_model_flops_agree_with_xla_cost_analysis(impl):
    # XLA's count exceeds the analytic one by the elementwise work (LayerNorm, GELU, the
    # normalizer, residuals), at most 4% at this width.
    counted, analytic = _model_counts(impl)
    assert analytic.total <= counted <= 1.04 * analytic.total


def test_model_flops_saved_by_the_block_sparse_engine_agree_with_xla():
    # What separates the two models is attention alone (2 of 8 key blocks per query block):
    # the saving XLA counts is the analytic one plus the normalizer's work on the scores not
    # formed (a few operations per entry, against 4 * 64 for the products).
    dense_xla, dense = _model_counts("xla")
    sparse_xla, sparse = _model_counts("blocksparse")
    assert sparse.attention == dense.attention / 4
    saved = dense.total - sparse.total
    assert saved <= dense_xla - sparse_xla <= 1.1 * saved


def test_model_flops_resolve_the_engine_with_the_models_own_normalizer(monkeypatch):
    # Where the engine depends on the normalizer (on a TPU, softmax runs splash and the sparse
    # normalizers the block-sparse kernel), the count follows the engine that the model's own
    # calls resolve to: attention_impl given the layer's normalizer.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    mask, t = causal() & local(15, 0), 128
    shape = jax.ShapeDtypeStruct((1, t, 3, 16), jnp.float32)
    for normalizer, learn_alpha in (("softmax", False), ("sparsemax", False), (1.5, True)):
        spec = AttentionSpec(
            mask=mask, normalizer=normalizer, learn_alpha=learn_alpha, block_size=(16, 16)
        )
        model = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
        layer = model.flops(t).layers[0]
        run_with = model.h[0].attn.core.alpha() if learn_alpha else normalizer
        engine = attention_impl(
            shape, shape, shape, mask=mask, normalizer=run_with, block_size=(16, 16)
        ).impl
        assert engine == ("splash" if normalizer == "softmax" else "blocksparse")
        kept = blocksparse_cost(mask.blocks(t, t, 16, 16), batch=1, num_heads=3, head_dim=16)
        want = 1.0 if engine == "splash" else kept.computed_scores / kept.dense_scores
        assert layer.computed_fraction == pytest.approx(want)
        assert layer.attention == 2 * 2 * 16 * round(want * 3 * t * t)
