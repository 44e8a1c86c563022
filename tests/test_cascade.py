"""The CANDS cascade: nested token and head gates, closed tokens untouched and unseen, the pruned
model equal to the gated one with hard gates (with real gathers, smaller weights, and fixed or
host-chosen token slots), FLOPs by hand, gradients to every gate and multiplier, warmed-up
targets, and bad configurations refused."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.models import GPT2
from sparse_jax.models import cascade as cascade_module
from sparse_jax.models.cascade import (
    CascadeConfig,
    CascadeLM,
    PrunedCascadeLM,
    capacity_for,
    cascade_flops,
    cascade_penalty,
)
from sparse_jax.models.flops import kept_flops, model_flops
from sparse_jax.models.gpt2 import GPT2Config
from sparse_jax.training.checkpoint import Checkpointer
from tests.engines import traced_equations

SIZE = GPT2Config.preset("tiny", n_layer=3, n_positions=64)  # D 48, 3 heads of 16, 192 units
KEEP = (1.0, 0.7, 0.5)


def _branch_counts(fn, *args) -> list[int]:
    """The number of branches of every ``lax.cond``/``lax.switch`` that ``fn(*args)`` traces
    to, nested ones included."""
    return [
        len(eqn.params["branches"])
        for eqn in traced_equations(fn, *args)
        if eqn.primitive.name == "cond"
    ]


def _closing_model(seed=0, head_logits=((2.0, -1.0, 1.0), (2.0, -1.0, 1.0)), **kwargs):
    """A cascade whose later blocks close some heads, units and about half the tokens."""
    cfg = CascadeConfig(SIZE, keep_ratios=KEEP, **kwargs)
    model = CascadeLM(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for block, heads in zip(model.h[1:], head_logits, strict=True):
        block.head_gate.logits[...] = jnp.array(heads)
        block.unit_gate.logits[...] = jnp.asarray(rng.normal(size=192), jnp.float32)
        block.router.kernel[...] = jnp.asarray(rng.normal(size=(48, 1)), jnp.float32)
        block.router.bias[...] = jnp.array([0.3])
    return model


def _ids(b=3, t=32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 101, (b, t)), jnp.int32)


@nnx.jit
def _forward(model, ids, rngs=None):
    """``model(ids, rngs=rngs, return_aux=True)``, compiled (faster than op by op here)."""
    return model(ids, rngs=rngs, return_aux=True)


@pytest.fixture(scope="module")
def closing():
    """The closing model, its hard-gated logits and aux on ``_ids()`` (computed once)."""
    model = _closing_model()
    logits, aux = _forward(model, _ids())
    return model, logits, aux


def test_pruned_model_equals_the_gated_model_with_hard_gates(closing):
    model, gated, aux = closing
    ids = _ids()
    pruned = model.prune()
    logits, kept, capacities = pruned.logits(ids, return_kept=True)
    np.testing.assert_allclose(logits, gated, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(aux["kept_tokens"]) > 0)
    # Really smaller: the expected 2 then 1 of 3 heads (Σ sigmoid: 1.88 and 1.38), about half
    # the units (Σ sigmoid of standard normal logits), fewer token slots.
    assert pruned.heads_kept() == [3, 2, 1] == model.heads_kept()
    units = model.units_kept()
    assert pruned.units_kept() == units and units[0] == 192 and 40 < units[1] < 150
    for block, (heads, _, p) in enumerate(pruned.blocks):
        assert p["w_attn"].shape == (48, 3 * heads * 16)
        assert p["w_proj"].shape == (heads * 16, 48)
        assert p["w_fc"].shape == (48, units[block]) and p["w_mlp"].shape == (units[block], 48)
    counts = np.asarray(kept).sum(-1).max(-1)  # most kept tokens in a row, per block
    assert counts[0] == 32 and counts[2] < 24
    assert capacities == [capacity_for(int(c), 32) for c in counts] and capacities[2] < 32
    # FLOPs: both count the same kept tokens, heads and units.
    assert pruned.flops_per_token(ids) == pytest.approx(model.flops_per_token(ids))


def test_fixed_capacities_compile_once_and_never_drop_a_token(closing, monkeypatch):
    model, gated, aux = closing
    ids = _ids()
    counts = np.asarray(aux["kept_tokens"]).sum(-1).max(-1)  # [32, 23, 19]
    assert counts.tolist() == [32, 23, 19]
    pruned = model.prune(capacity=(1.0, 0.875, 0.75))  # fixed slots 32, 28, 24
    logits, _, slots = pruned.logits(ids, return_kept=True)
    assert slots == pruned.capacities(32) == [32, 28, 24] and pruned.overflows == 0
    np.testing.assert_allclose(logits, gated, atol=1e-5, rtol=1e-5)
    # As many slots as tokens: the closed tokens are still no keys of the kept ones.
    whole = model.prune(capacity=(1.0, 1.0, 1.0))
    np.testing.assert_allclose(whole.logits(ids), gated, atol=1e-5, rtol=1e-5)
    # Slots 32, 24, 16 are too few for block 3's 19 tokens: inside the compiled call (no host
    # routing, one lax.switch per routed block), block 3 runs on the next bucketed count, 20,
    # and the logits are still exact.
    tight = model.prune(capacity=KEEP)
    assert tight.capacities(32) == [32, 24, 16]
    with monkeypatch.context() as patch:
        patch.setattr(PrunedCascadeLM, "_routed_on_host", None)  # never called
        logits, _, slots = tight.logits(ids, return_kept=True)
        assert tight.overflows == 1 and slots == [32, 24, 20]
        np.testing.assert_allclose(logits, gated, atol=1e-5, rtol=1e-5)
        tight.logits(ids)
        assert tight.overflows == 2  # counted per call
    plan = tight._plan(32)
    assert plan == ((3, 16, (32,)), (2, 16, (24, 28, 32)), (1, 16, (16, 20, 24, 28, 32)))
    # One switch per routed block whose slots can grow, over its slot counts (3 and 5); the
    # two-way conditionals are the softmax's +inf clamp, in each attention of each branch.
    forward = functools.partial(cascade_module._forward_jit, plan=plan,
                                activation=tight.activation)  # fmt: skip
    sizes = _branch_counts(forward, [p for _, _, p in tight.blocks], tight.wte, tight.wpe,
                           tight.ln_f, ids, jnp.zeros((), jnp.int32))  # fmt: skip
    assert sorted(n for n in sizes if n != 2) == [3, 5]
    # Fewer slots than the blocks are trained to keep are refused before anything compiles.
    with pytest.raises(ValueError, match=r"`capacity` of block 3 \(0.4\) is below its kept"):
        model.prune(capacity=(1.0, 0.7, 0.4))


def test_token_gates_are_nested_and_closed_tokens_are_untouched_and_unseen(closing):
    model, _, aux = closing
    kept = np.asarray(aux["kept_tokens"])  # [L, B, T]
    assert set(np.unique(kept)) == {0.0, 1.0}
    assert (kept[1:] <= kept[:-1]).all()  # a token closed in block l stays closed after it
    assert kept[2].sum() < kept[1].sum() < kept[0].sum()
    expected = np.asarray(aux["expected_keep"])
    assert (np.diff(expected[:, 0]) <= 0).all() and (expected[0] == 1).all()
    # Block 2 on its own: a closed token passes through unchanged, and changing it changes no
    # kept token (it is no key or value there).
    x = jax.random.normal(jax.random.key(0), (1, 16, 48))
    heads, tokens = (jnp.ones(3), jnp.ones(3)), (jnp.ones((1, 16)), jnp.ones((1, 16)))
    block = nnx.jit(lambda block, *args: block(*args))  # compiled: faster than op by op
    out, (new_keep, expected), _, _ = block(model.h[1], x, tokens, heads)
    closed = np.flatnonzero(np.asarray(new_keep[0]) == 0)
    open_ = np.flatnonzero(np.asarray(new_keep[0]) > 0)
    assert len(closed) and len(open_)
    np.testing.assert_array_equal(out[0, closed], x[0, closed])
    y2, (keep2, _), _, _ = block(model.h[1], x.at[0, closed].add(5.0), tokens, heads)
    np.testing.assert_array_equal(keep2, new_keep)  # (the changed tokens are still closed)
    np.testing.assert_allclose(y2[0, open_], out[0, open_], atol=1e-6)
    # Block 3 never reopens a token block 2 closed, whatever its own gate says.
    model.h[2].router.bias[...] = jnp.array([50.0])
    try:
        _, (k3, _), _, _ = block(model.h[2], out, (new_keep, expected), heads)
    finally:
        model.h[2].router.bias[...] = jnp.array([0.3])
    np.testing.assert_array_equal(k3, new_keep)


def test_a_head_closed_in_a_block_is_absent_from_every_later_block():
    # Block 2 closes head 1, block 3 closes head 0 and would reopen head 1.
    heads = ((2.0, -1.0, 1.0), (-1.0, 2.0, 1.0))
    model = _closing_model(head_logits=heads)
    assert [h.tolist() for h in model.open_heads()] == [[0, 1, 2], [0, 2], [2]]
    ids = _ids(2, 16)
    logits, aux = _forward(model, ids)
    open_ = np.asarray(aux["kept_heads"]) > 0
    np.testing.assert_array_equal(open_, [[1, 1, 1], [1, 0, 1], [0, 0, 1]])
    # Expected head keep: products of sigmoid(z) along the cascade.
    p = 1 / (1 + np.exp(-np.array(heads)))
    np.testing.assert_allclose(
        aux["expected_keep"][1:, 1], [p[0].mean(), (p[0] * p[1]).mean()], rtol=1e-6
    )

    # Head 1 of block 3 does nothing: new weights for it leave the logits; head 2's change them.
    def perturbed(head):
        kernel = model.h[2].c_attn.kernel[...].reshape(48, 3, 3, 16)
        noise = jax.random.normal(jax.random.key(head), (48, 3, 16))  # (not a constant: the
        # layer-normalised input sums to 0, so adding one to a column would change nothing)
        model.h[2].c_attn.kernel[...] = kernel.at[:, :, head].add(noise).reshape(48, 144)
        try:
            return _forward(model, ids)[0]
        finally:
            model.h[2].c_attn.kernel[...] = kernel.reshape(48, 144)

    np.testing.assert_array_equal(perturbed(1), logits)
    assert not np.allclose(perturbed(2), logits, atol=1e-3)
    pruned = model.prune()
    assert pruned.heads_kept() == [3, 2, 1]
    np.testing.assert_allclose(pruned.logits(ids), logits, atol=1e-5, rtol=1e-5)
    # Every head closed in block 3: its attention adds the output bias only.
    model.h[2].head_gate.logits[...] = jnp.array([-5.0, -5.0, -5.0])
    assert model.heads_kept() == [3, 2, 0] == model.prune().heads_kept()
    np.testing.assert_allclose(
        model.prune().logits(ids), _forward(model, ids)[0], atol=1e-5, rtol=1e-5
    )
    # Without nesting, each block keeps its own open heads.
    free = _closing_model(head_logits=heads, nested_heads=False)
    assert [h.tolist() for h in free.open_heads()] == [[0, 1, 2], [0, 2], [1, 2]]


def test_hard_concrete_keeps_the_expected_number_of_gates():
    """Gates all a little open meet a mean-keep target of 1/2; a threshold z > 0 would then
    keep every one of them. Evaluation keeps the expected count, the most probable first."""
    model = _closing_model()
    rng = np.random.default_rng(3)
    z = jnp.asarray(0.1 + 0.01 * rng.random(192), jnp.float32)
    model.h[1].unit_gate.logits[...] = z
    expected = int(np.round(np.sum(1 / (1 + np.exp(-np.asarray(z, np.float64))))))
    values = model.unit_values()[1]
    assert model.units_kept()[1] == expected == 101
    np.testing.assert_array_equal(np.flatnonzero(values), np.sort(np.argsort(-z)[:expected]))
    # The kept ones at their test-time value (about the samples' mean), folded into the
    # pruned weights: the pruned model still equals the gated one.
    np.testing.assert_allclose(
        values[values > 0], 1.2 * jax.nn.sigmoid(z[values > 0]) - 0.1, rtol=1e-6
    )
    ids = _ids(2, 16)
    np.testing.assert_allclose(
        model.prune().logits(ids), _forward(model, ids)[0], atol=1e-5, rtol=1e-5
    )


def test_flops_count_by_hand_for_two_blocks():
    g = GPT2Config.preset("tiny")  # D 48, 2 blocks, 3 heads of 16, 192 units, V 101
    t = 6
    by_hand = 2 * t * 48 * 101  # output layer
    for n, heads, units in ((6, 3, 192), (3, 1, 50)):
        by_hand += 2 * n * 48 * 4 * heads * 16  # q, k, v, output projections
        by_hand += 2 * 2 * 16 * heads * (n * (n + 1) // 2)  # causal QK^T and PV
        by_hand += 2 * 2 * n * 48 * units  # FFN
    assert cascade_flops(g, t, [6, 3], [3, 1], [192, 50]) == by_hand
    report = kept_flops(g, t, [6, 3], [3, 1], [192, 50])
    assert report.layers[1].ffn == 2 * 2 * 3 * 48 * 50
    assert report.layers[1].attention == 2 * 2 * 16 * 1 * 6
    # Dense: the same projections, FFN and output layer as the GPT-2 FLOPs of the project; the
    # attention counts the causal entries where the dense kernel's count has all t x t.
    dense = kept_flops(g, t, [t, t], [3, 3], [192, 192])
    reference = model_flops(GPT2(g, rngs=nnx.Rngs(0)), t)
    assert dense.lm_head == reference.lm_head
    for ours, theirs in zip(dense.layers, reference.layers, strict=True):
        assert (ours.projections, ours.ffn) == (theirs.projections, theirs.ffn)
        assert ours.attention * 2 * t == theirs.attention * (t + 1)
    # Every gate open (at logit 3, Hard Concrete would keep the expected 95% of the units).
    cfg = CascadeConfig(g, keep_ratios=(1.0, 0.5), gate_init=10.0)
    model = CascadeLM(cfg, rngs=nnx.Rngs(0))
    assert model.flops_per_token(_ids(2, t)) == pytest.approx(dense.total / t)
    with pytest.raises(ValueError, match=r"`tokens\[1\]` must be an int in \[0, 6\]; got 7"):
        kept_flops(g, t, [6, 7], [3, 3], [192, 192])


def test_flops_per_token_counts_what_each_row_keeps(closing):
    model, _, aux = closing
    kept = np.asarray(aux["kept_tokens"]).sum(-1)  # [L, B]
    heads, units = [3, 2, 1], model.units_kept()
    total = 0
    for row in range(3):
        total += 2 * 32 * 48 * 101
        for block in range(3):
            n, h, u = int(kept[block, row]), heads[block], units[block]
            total += 2 * n * 48 * 4 * h * 16 + 2 * 2 * 16 * h * n * (n + 1) // 2
            total += 2 * 2 * n * 48 * u
    assert model.flops_per_token(_ids()) == pytest.approx(total / (3 * 32))


def test_flops_as_run_count_every_slot_each_block_ran_on(closing):
    model, _, _ = closing
    pruned = model.prune()
    _, _, slots = pruned.logits(_ids(), return_kept=True)
    assert slots[2] < 32  # the last block ran on fewer slots than tokens
    heads, units = [3, 2, 1], model.units_kept()
    total = 2 * 32 * 48 * 101  # the output layer, over every token
    for block in range(3):
        n, h, u = slots[block], heads[block], units[block]
        total += 2 * n * 48 * 4 * h * 16 + 2 * 2 * 16 * h * n * (n + 1) // 2 + 2 * 2 * n * 48 * u
    assert pruned.flops_as_run(_ids()).total == total
    # Above what the rows keep (the empty slots), below the dense model.
    kept = max(r.total for r in pruned.flops(_ids()))
    assert kept < total < cascade_flops(SIZE, 32, [32] * 3, [3] * 3, [192] * 3)


def test_gradients_reach_every_gate_and_the_multipliers_ascend():
    model = _closing_model()
    ids = _ids(2, 16)

    @nnx.jit
    def grads(model):
        def loss(model):
            logits, aux = model(ids, rngs=nnx.Rngs(gates=0), return_aux=True)
            return jnp.mean(logits**2) + aux["penalty"], aux

        return nnx.grad(loss, has_aux=True)(model)

    grads, aux = grads(model)
    for i in (1, 2):
        g = grads.h[i]
        for leaf in (g.head_gate.logits, g.unit_gate.logits, g.router.kernel, g.router.bias):
            assert float(jnp.abs(leaf[...]).sum()) > 0
    # d penalty / d λ1 = s - t; the multipliers' gradient is its negation (ascent).
    gap = (1 - np.asarray(aux["expected_keep"])) - (1 - np.array(KEEP))[:, None]
    np.testing.assert_allclose(grads.lagrange[...][1:, :, 0], -gap[1:], atol=1e-6)
    np.testing.assert_allclose(grads.lagrange[...][1:, :, 1], -(gap[1:] ** 2), atol=1e-6)
    np.testing.assert_allclose(grads.lagrange[...][0], 0.0)


def test_targets_warm_up_and_the_penalties():
    cfg = CascadeConfig(SIZE, keep_ratios=KEEP, target_warmup_steps=10)
    np.testing.assert_allclose(cfg.targets(0), 1.0)
    np.testing.assert_allclose(cfg.targets(5)[:, 0], [1.0, 0.85, 0.75], rtol=1e-6)
    np.testing.assert_allclose(cfg.targets(20), cfg.targets(), rtol=1e-6)
    np.testing.assert_allclose(cfg.targets()[:, 2], KEEP)
    keep = jnp.array([[1.0, 1.0, 1.0], [0.9, 0.8, 0.7], [0.6, 0.6, 0.6]])
    lam = jnp.stack([jnp.full((3, 3), -2.0), jnp.full((3, 3), 3.0)], axis=-1)
    s, t = 1 - np.asarray(keep), 1 - np.asarray(cfg.targets(5))
    by_hand = -2.0 * (s - t) + 3.0 * (s - t) ** 2
    by_hand[0] = 0.0
    np.testing.assert_allclose(cascade_penalty(keep, cfg.targets(5), lam), by_hand, rtol=1e-5)
    l1 = cascade_penalty(keep, cfg.targets(), kind="l1", l1_weight=0.5)
    np.testing.assert_allclose(l1, np.concatenate([np.zeros((1, 3)), 0.5 * keep[1:]]))
    with pytest.raises(ValueError, match="needs `multipliers`"):
        cascade_penalty(keep, cfg.targets())
    # The model's aux uses the targets at the step it is given.
    model = CascadeLM(cfg, rngs=nnx.Rngs(0))
    _, aux = nnx.jit(lambda m, ids: m(ids, return_aux=True, step=5))(model, _ids(1, 8))
    np.testing.assert_allclose(aux["targets"], cfg.targets(5))


def test_sigmoid_ste_gates_are_hard_forward_with_sigmoid_gradients():
    model = _closing_model(gate="sigmoid_ste")
    ids = _ids(2, 16)
    _, aux = _forward(model, ids, nnx.Rngs(gates=0))
    assert set(np.unique(np.asarray(aux["kept_tokens"]))) <= {0.0, 1.0}
    # What counts toward the targets is what is kept (the sigmoid's gradient flows through it).
    units = [(np.asarray(b.unit_gate.logits[...]) > 0).mean() for b in model.h[1:]]
    np.testing.assert_allclose(aux["expected_keep"][1:, 2], units, rtol=1e-6)
    np.testing.assert_allclose(aux["expected_keep"][1:, 0], aux["kept_tokens"][1:].mean((1, 2)))
    assert model.heads_kept() == [3, 2, 2]  # z > 0, nested
    loss = nnx.jit(nnx.grad(lambda m: jnp.mean(m(ids, rngs=nnx.Rngs(gates=0)) ** 2)))
    grads = loss(model)
    for leaf in (
        grads.h[1].router.kernel,
        grads.h[2].head_gate.logits,
        grads.h[2].unit_gate.logits,
    ):
        assert float(jnp.abs(leaf[...]).sum()) > 0
    hard, _ = _forward(model, ids)
    np.testing.assert_allclose(model.prune().logits(ids), hard, atol=1e-5, rtol=1e-5)


def test_score_scaling_variant_prunes_nothing():
    cfg = CascadeConfig(SIZE, keep_ratios=(1.0, 0.5, 0.5), score_scaling=True)
    model = CascadeLM(cfg, rngs=nnx.Rngs(0))
    for block in model.h[1:]:
        block.head_gate.logits[...] = jnp.array([-3.0, 0.5, -1.0])  # "closed" gates
        assert block.unit_gate is None and block.router is None
    ids = _ids(2, 16)
    logits, aux = _forward(model, ids)
    assert model.heads_kept() == [3, 3, 3] and model.units_kept() == [192] * 3
    assert np.asarray(aux["kept_tokens"]).min() == 1.0
    dense = cascade_flops(SIZE, 16, [16] * 3, [3] * 3, [192] * 3) / 16
    assert model.flops_per_token(ids) == pytest.approx(dense)
    assert float(aux["penalty"]) == 0.0
    # The scores are scaled: the outputs differ from the same weights without the gates.
    plain = CascadeLM(dataclasses.replace(cfg, score_scaling=False), rngs=nnx.Rngs(0))
    assert not np.allclose(logits, _forward(plain, ids)[0], atol=1e-4)
    pruned = model.prune()
    assert pruned.flops_per_token(ids) == pytest.approx(dense)
    np.testing.assert_allclose(pruned.logits(ids), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"keep_ratios": (1.0, 0.5)}, ValueError, r"`keep_ratios` needs one ratio per block \(3\)"),
        ({"keep_ratios": (1.0, 0.5, 0.0)}, ValueError, r"`keep_ratios` must lie in \(0, 1\]"),
        ({"keep_ratios": (1.0, 1.2, 0.5)}, ValueError, r"`keep_ratios` must lie in \(0, 1\]"),
        ({"keep_ratios": (1.0, 0.5, 0.7)}, ValueError, "`keep_ratios` must not increase"),
        ({"keep_ratios": (0.9, 0.5, 0.5)}, ValueError, "`keep_ratios` starts at 1"),
        ({"keep_ratios": "abc"}, TypeError, "`keep_ratios` must be a sequence of numbers"),
        ({"head_keep": (1.0, 0.4, 0.6)}, ValueError, "`head_keep` must not increase"),
        # More heads (units) than exist: a keep target above 1.
        ({"head_keep": (1.0, 1.5, 0.5)}, ValueError, r"`head_keep` must lie in \(0, 1\]"),
        ({"unit_keep": (1.0, 2.0, 1.0)}, ValueError, r"`unit_keep` must lie in \(0, 1\]"),
        ({"capacity": (1.0, 0.6, 0.5)}, ValueError, r"`capacity` of block 2 \(0.6\) is below"),
        ({"capacity": (1.0, 1.0)}, ValueError, r"`capacity` needs one ratio per block \(3\)"),
        ({"gate": "relu"}, ValueError, "unknown `gate`='relu'"),
        ({"penalty": "l2"}, ValueError, "unknown `penalty`='l2'"),
        ({"l1_weight": -1.0}, ValueError, "`l1_weight` must be a finite number >= 0; got -1.0"),
        ({"l1_weight": float("inf")}, ValueError, "`l1_weight` must be a finite number >= 0"),
        ({"gate_init": float("nan")}, ValueError, "`gate_init` must be a finite number"),
        ({"nested_heads": 1}, TypeError, "`nested_heads` must be a bool; got 1"),
        ({"target_warmup_steps": -1}, ValueError, "`target_warmup_steps` must be an int >= 0"),
        (
            {"gpt2": GPT2Config.preset("tiny", heads_per_layer=(3, 2))},
            ValueError,
            "`gpt2` must have every head and unit",
        ),
    ],
)
def test_bad_configurations_are_refused(kwargs, error, match):
    kwargs = {"gpt2": SIZE, "keep_ratios": KEEP} | kwargs
    with pytest.raises(error, match=match):
        CascadeConfig(**kwargs)


def test_bad_inputs_are_refused():
    model = CascadeLM(CascadeConfig(SIZE, keep_ratios=KEEP), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`buckets` must be an int >= 1; got 0"):
        PrunedCascadeLM(model, buckets=0)
    with pytest.raises(TypeError, match="`model` must be a CascadeLM"):
        PrunedCascadeLM(GPT2(SIZE, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"`ids` must be token ids in \[0, vocab_size\)"):
        model(jnp.full((1, 4), 101, jnp.int32))
    with pytest.raises(ValueError, match="`ids` has 65 tokens; allowed: 1 to n_positions=64"):
        model.prune().logits(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(TypeError, match="`config` must be a CascadeConfig"):
        CascadeLM(SIZE, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------------------------
# python -m experiments.cascade


TINY_RUN = [
    "--model.size", "tiny", "--data.seq-len", "8", "--data.batch-size", "4",
    "--train.steps", "12", "--run.checkpoint-every", "6", "--run.eval-batches", "2",
]  # fmt: skip


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_resumes(tmp_path, caplog, capsys):
    from experiments import cascade as experiment

    args = [*TINY_RUN, "--run.dir", str(tmp_path / "run"), "--run.cache-dir", str(tmp_path)]
    with caplog.at_level(logging.WARNING):
        summary = experiment.run(experiment.parse(args))
    # No Orbax warning for checkpoints saved without a metric (the phase has no evaluation).
    assert "tracked_metric" not in caplog.text
    assert json.loads((tmp_path / "run" / "config.json").read_text())["program"] == "cascade"
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["dense"] == summary["dense"] and set(saved) >= {
        "dense", "pruned", "keep_ratio", "heads_kept", "units_kept", "phase_seconds",
    }  # fmt: skip
    g = GPT2Config.preset("tiny", vocab_size=257)
    dense = cascade_flops(g, 8, [8, 8], [3, 3], [192, 192]) / 8
    assert summary["dense"]["flops_per_token"] == pytest.approx(dense)
    assert len(summary["keep_ratio"]) == 2 and summary["keep_ratio"][0] == 1.0
    assert set(summary["speed"]) == {"8", "32"}
    report = (tmp_path / "run" / "report.md").read_text()
    for length, speed in summary["speed"].items():
        n = int(length)
        dense_n = cascade_flops(g, n, [n, n], [3, 3], [192, 192]) / n
        run_n = speed["pruned_run_flops_per_token"]
        assert speed["dense_flops_per_token"] == pytest.approx(dense_n)
        assert speed["pruned_flops_per_token"] <= run_n <= dense_n
        row = f"FLOPs per token at n={n}, as run (pruned: every slot of each block)"
        cells = f"{dense_n / 1e6:.2f} M | {run_n / 1e6:.2f} M | {run_n / dense_n:.3f} |"
        assert f"| {row} | {cells}" in report
    # The pruned model ran in fixed slots: the keep target plus the slack, block 1 whole.
    assert summary["capacity"] == [1.0, 0.4625] and summary["overflows"] >= 0
    ratio = summary["pruned"]["ppl"] / summary["dense"]["ppl"]
    assert (
        f"| {summary['dense']['ppl']:.3f} | {summary['pruned']['ppl']:.3f} | {ratio:.3f} |"
        in report
    )
    assert (tmp_path / "run" / "gates.png").exists()
    # A fresh start refuses the folder; --run.resume continues from the last checkpoints (no
    # update left) and measures the same models.
    with pytest.raises(ValueError, match=r"already holds a run .* Continue it with --run\.resume"):
        experiment.run(experiment.parse(args))
    again = experiment.run(experiment.parse([*args, "--run.resume"]))
    assert again["dense"]["ppl"] == summary["dense"]["ppl"]
    assert again["pruned"]["ppl"] == summary["pruned"]["ppl"]
    # A resume with flags that change what the checkpoints hold is refused, by name.
    with pytest.raises(ValueError, match=r"--run\.resume: the flags differ .*--train\.lr"):
        experiment.run(experiment.parse([*args, "--run.resume", "--train.lr", "0.01"]))
    with pytest.raises(ValueError, match="does not exist, so there is no cascade run to continue"):
        experiment.run(experiment.parse([*TINY_RUN, "--run.dir", str(tmp_path / "none"),
                                         "--run.resume"]))  # fmt: skip
    # A time limit (spent before the first update ends) stops the dense phase at step 1 with a
    # checkpoint, exit status 75; resumed without it, the run measures the same models.
    limited = [*TINY_RUN, "--run.dir", str(tmp_path / "limited"), "--run.cache-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit:
        experiment.main([*limited, "--run.max-minutes", "1e-9"])
    assert exit.value.code == 75
    err = " ".join(capsys.readouterr().err.split())
    assert "dense: stopped (the time limit (6e-08 s)) after update 1 of 12" in err
    assert f"--run.dir {tmp_path / 'limited'} --run.resume" in err
    ckpts = Checkpointer(tmp_path / "limited" / "checkpoints" / "dense", save_every=6)
    assert ckpts.all_steps() == [1]
    ckpts.close()
    resumed = experiment.run(experiment.parse([*limited, "--run.resume"]))
    assert resumed["dense"]["ppl"] == summary["dense"]["ppl"]
    assert resumed["pruned"]["ppl"] == summary["pruned"]["ppl"]


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            ["--model.keep-ratios", "1", "0.5", "0.7", "0.4"],
            "--model.keep-ratios: .*must not increase",
        ),
        (["--model.keep-ratios", "1", "0.5"], r"--model.keep-ratios: .*one ratio per block \(4\)"),
        (["--model.keep-ratios", "1", "1.5", "0.5", "0.5"], r"--model.keep-ratios: .*\(0, 1\]"),
        (
            ["--model.head-keep", "1", "0.5", "1.5", "0.5"],
            r"--model.head-keep: .*`head_keep` must lie in \(0, 1\]",
        ),
        (
            ["--model.unit-keep", "1", "0.5", "0.75", "0.5"],
            "--model.unit-keep: .*`unit_keep` must not increase",
        ),
        (
            ["--model.capacity-slack", "-0.1"],
            r"--model.capacity-slack must be a number in \[0, 1\]",
        ),
        (["--data.seq-len", "256"], "4 x 256 = 1024 tokens, more than --model.size 'cpu-small'"),
        (["--model.size", "huge"], "--model.size 'huge' is not a preset"),
        (["--train.steps", "0"], "--train.steps must be an int >= 1; got 0"),
        (["--sweep", "0.5", "1.2"], r"--sweep ratios must lie in \(0, 1\]"),
        (["--run.resume"], "--run.resume needs the --run.dir of the run to continue"),
        (["--run.max-minutes", "inf"], "--run.max-minutes must be a number of minutes > 0"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(flags, match, capsys):
    from experiments import cascade as experiment

    with pytest.raises(SystemExit):  # tyro prints the ValueError and exits
        experiment.parse(flags)
    printed = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert re.search(match, printed), printed
