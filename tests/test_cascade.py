"""The CANDS cascade: nested token gates, closed tokens untouched and unseen, the pruned model
equal to the gated one with hard gates (with real gathers and smaller weights), FLOPs by hand,
gradients to every gate and multiplier, and bad configurations refused."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.models.cascade import (
    CascadeConfig,
    CascadeLM,
    PrunedCascadeLM,
    capacity_for,
    cascade_flops,
)
from sparse_jax.models.gpt2 import GPT2Config

SIZE = GPT2Config.preset("tiny", n_layer=3, n_positions=64)  # D 48, 3 heads of 16, 192 units


def _closing_model(seed=0, **kwargs):
    """A cascade whose later blocks close some heads, units and about half the tokens."""
    cfg = CascadeConfig(SIZE, keep_ratios=(1.0, 0.7, 0.5), **kwargs)
    model = CascadeLM(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for block in model.h[1:]:
        block.head_gate.logits[...] = jnp.array([2.0, -1.0, 1.0])
        block.unit_gate.logits[...] = jnp.asarray(rng.normal(size=192), jnp.float32)
        block.router.kernel[...] = jnp.asarray(rng.normal(size=(48, 1)), jnp.float32)
        block.router.bias[...] = jnp.array([0.3])
    return model


def _ids(b=3, t=32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 101, (b, t)), jnp.int32)


def test_pruned_model_equals_the_gated_model_with_hard_gates():
    model = _closing_model()
    ids = _ids()
    gated, aux = model(ids, return_aux=True)
    pruned = model.prune()
    logits, kept, capacities = pruned.logits(ids, return_kept=True)
    np.testing.assert_allclose(logits, gated, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(aux["kept_tokens"]) > 0)
    # Really smaller: 2 of 3 heads and the open units in the later blocks, fewer token slots.
    assert pruned.heads_kept() == [3, 2, 2] == model.heads_kept()
    units = model.units_kept()
    assert pruned.units_kept() == units and units[0] == 192 and units[1] < 150
    _, _, p = pruned.blocks[1]
    assert p["w_attn"].shape == (48, 3 * 2 * 16) and p["w_fc"].shape == (48, units[1])
    counts = np.asarray(kept).sum(-1).max(-1)  # most kept tokens in a row, per block
    assert counts[0] == 32 and counts[2] < 24
    assert capacities == [capacity_for(int(c), 32) for c in counts] and capacities[2] < 32
    # FLOPs: both count the same kept tokens, heads and units.
    assert pruned.flops_per_token(ids) == pytest.approx(model.flops_per_token(ids))


def test_token_gates_are_nested_and_closed_tokens_are_untouched_and_unseen():
    model = _closing_model()
    ids = _ids()
    _, aux = model(ids, return_aux=True)
    kept = np.asarray(aux["kept_tokens"])  # [L, B, T]
    assert (kept[1:] <= kept[:-1]).all()  # a token closed in block l stays closed after it
    assert kept[2].sum() < kept[1].sum() < kept[0].sum()
    expected = np.asarray(aux["expected_keep"])[:, 0]
    assert (np.diff(expected) <= 0).all() and expected[0] == 1
    # Block 2 on its own: a closed token passes through unchanged, and changing it changes no
    # kept token (it is no key or value there).
    x = jax.random.normal(jax.random.key(0), (1, 16, 48))
    keep = jnp.ones((1, 16))
    block = model.h[1]
    out, new_keep, _ = block(x, keep)
    closed = np.flatnonzero(np.asarray(new_keep[0]) == 0)
    open_ = np.flatnonzero(np.asarray(new_keep[0]) > 0)
    assert len(closed) and len(open_)
    np.testing.assert_array_equal(out[0, closed], x[0, closed])
    later = model.h[2]
    kept_in = new_keep.at[0, closed[0]].set(0.0)
    y1, k1, _ = later(out, kept_in)
    y2, k2, _ = later(out.at[0, closed[0]].add(5.0), kept_in)
    still = np.flatnonzero(np.asarray(k1[0]) > 0)
    np.testing.assert_allclose(y1[0, still], y2[0, still], atol=1e-6)
    np.testing.assert_array_equal(k1, k2 * (k1 > 0))  # the closed token stays closed


def test_flops_count_by_hand_for_two_blocks():
    g = GPT2Config.preset("tiny")  # D 48, 2 blocks, 3 heads of 16, 192 units, V 101
    t = 6
    by_hand = 2 * t * 48 * 101  # output layer
    for n, heads, units in ((6, 3, 192), (3, 1, 50)):
        by_hand += 2 * n * 48 * 4 * heads * 16  # q, k, v, output projections
        by_hand += 2 * 2 * 16 * heads * (n * (n + 1) // 2)  # causal QK^T and PV
        by_hand += 2 * 2 * n * 48 * units  # FFN
    assert cascade_flops(g, t, [6, 3], [3, 1], [192, 50]) == by_hand
    cfg = CascadeConfig(g, keep_ratios=(1.0, 0.5))
    model = CascadeLM(cfg, rngs=nnx.Rngs(0))  # every gate open
    dense = cascade_flops(g, t, [t, t], [3, 3], [192, 192])
    assert model.flops_per_token(_ids(2, t)) == pytest.approx(dense / t)


def test_gradients_reach_every_gate_and_the_multipliers_ascend():
    model = _closing_model()
    ids = _ids(2, 16)

    def loss(model):
        logits, aux = model(ids, rngs=nnx.Rngs(gates=0), return_aux=True)
        return jnp.mean(logits**2) + aux["penalty"], aux

    grads, aux = nnx.grad(loss, has_aux=True)(model)
    for i in (1, 2):
        g = grads.h[i]
        for leaf in (g.head_gate.logits, g.unit_gate.logits, g.router.kernel, g.router.bias):
            assert float(jnp.abs(leaf[...]).sum()) > 0
    # d penalty / d λ1 = s - t; the multipliers' gradient is its negation (ascent).
    targets = np.array([[1.0, 1.0, 1.0], [0.7, 0.7, 0.7], [0.5, 0.5, 0.5]])
    gap = (1 - np.asarray(aux["expected_keep"])) - (1 - targets)
    np.testing.assert_allclose(grads.lagrange[...][1:, :, 0], -gap[1:], atol=1e-6)
    np.testing.assert_allclose(grads.lagrange[...][0], 0.0)


def test_sigmoid_ste_gates_are_hard_forward_with_sigmoid_gradients():
    model = _closing_model(gate="sigmoid_ste")
    ids = _ids(2, 16)
    _, aux = model(ids, rngs=nnx.Rngs(gates=0), return_aux=True)
    assert set(np.unique(np.asarray(aux["kept_tokens"]))) <= {0.0, 1.0}
    grads = nnx.grad(lambda m: jnp.mean(m(ids, rngs=nnx.Rngs(gates=0)) ** 2))(model)
    assert float(jnp.abs(grads.h[1].router.kernel[...]).sum()) > 0
    np.testing.assert_allclose(model.prune().logits(ids), model(ids), atol=2e-5, rtol=1e-5)


def test_score_scaling_variant_prunes_nothing():
    cfg = CascadeConfig(SIZE, keep_ratios=(1.0, 0.5, 0.5), score_scaling=True)
    model = CascadeLM(cfg, rngs=nnx.Rngs(0))
    for block in model.h[1:]:
        block.head_gate.logits[...] = jnp.array([-3.0, 0.5, -1.0])  # "closed" gates
    ids = _ids(2, 16)
    _, aux = model(ids, return_aux=True)
    assert model.heads_kept() == [3, 3, 3] and model.units_kept() == [192] * 3
    assert np.asarray(aux["kept_tokens"]).min() == 1.0
    dense = cascade_flops(SIZE, 16, [16] * 3, [3] * 3, [192] * 3) / 16
    assert model.flops_per_token(ids) == pytest.approx(dense)
    assert float(aux["penalty"]) == 0.0
    # The scores are scaled: the outputs differ from the same weights without the gates.
    plain = CascadeLM(dataclasses.replace(cfg, score_scaling=False), rngs=nnx.Rngs(0))
    assert not np.allclose(model(ids), plain(ids), atol=1e-4)
    np.testing.assert_allclose(model.prune().logits(ids), model(ids), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_ratios": (1.0, 0.5)}, r"`keep_ratios` needs one ratio per block \(3\); got 2"),
        ({"keep_ratios": (1.0, 0.5, 0.0)}, r"`keep_ratios` must lie in \(0, 1\]"),
        ({"keep_ratios": (1.0, 1.2, 0.5)}, r"`keep_ratios` must lie in \(0, 1\]"),
        ({"keep_ratios": (1.0, 0.5, 0.7)}, "`keep_ratios` must not increase"),
        ({"keep_ratios": (0.9, 0.5, 0.5)}, "`keep_ratios` starts at 1"),
        ({"head_keep": (1.0, 0.4, 0.6)}, "`head_keep` must not increase"),
        ({"gate": "relu"}, "unknown `gate`='relu'"),
        ({"penalty": "l2"}, "unknown `penalty`='l2'"),
    ],
)
def test_bad_configurations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CascadeConfig(SIZE, **kwargs)
    with pytest.raises(ValueError, match="`buckets` must be"):
        PrunedCascadeLM(CascadeLM(CascadeConfig(SIZE), rngs=nnx.Rngs(0)), buckets=0)


# ----------------------------------------------------------------------------------------------
# python -m experiments.cascade


TINY_RUN = [
    "--model.size", "tiny", "--data.seq-len", "8", "--data.batch-size", "4",
    "--train.steps", "12", "--run.checkpoint-every", "6", "--run.eval-batches", "2",
]  # fmt: skip


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_resumes(tmp_path):
    from experiments import cascade as experiment

    args = [*TINY_RUN, "--run.dir", str(tmp_path / "run"), "--run.cache-dir", str(tmp_path)]
    summary = experiment.run(experiment.parse(args))
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
    ratio = summary["pruned"]["ppl"] / summary["dense"]["ppl"]
    assert (
        f"| {summary['dense']['ppl']:.3f} | {summary['pruned']['ppl']:.3f} | {ratio:.3f} |"
        in report
    )
    assert (tmp_path / "run" / "gates.png").exists()
    # A fresh start refuses the folder; --run.resume continues from the last checkpoints (no
    # update left) and measures the same models.
    with pytest.raises(ValueError, match=r"already holds a run; continue it with --run\.resume"):
        experiment.run(experiment.parse(args))
    again = experiment.run(experiment.parse([*args, "--run.resume"]))
    assert again["dense"]["ppl"] == summary["dense"]["ppl"]
    assert again["pruned"]["ppl"] == summary["pruned"]["ppl"]


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            ["--model.keep-ratios", "1", "0.5", "0.7", "0.4"],
            "--model.keep-ratios: .*must not increase",
        ),
        (["--model.keep-ratios", "1", "0.5"], r"--model.keep-ratios: .*one ratio per block \(4\)"),
        (["--model.keep-ratios", "1", "1.5", "0.5", "0.5"], r"--model.keep-ratios: .*\(0, 1\]"),
        (["--data.seq-len", "256"], "4 x 256 = 1024 tokens, more than --model.size 'cpu-small'"),
        (["--model.size", "huge"], "--model.size 'huge' is not a preset"),
        (["--train.steps", "0"], "--train.steps must be an int >= 1; got 0"),
        (["--sweep", "0.5", "1.2"], r"--sweep ratios must lie in \(0, 1\]"),
        (["--run.resume"], "--run.resume needs the --run.dir of the run to continue"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(flags, match, capsys):
    from experiments import cascade as experiment

    with pytest.raises(SystemExit):  # tyro prints the ValueError and exits
        experiment.parse(flags)
    printed = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert re.search(match, printed), printed
