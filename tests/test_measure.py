"""experiments.common.measure: the evaluation means are over tokens, whatever the batching."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.common import measure, timing
from sparse_jax.models import GPT2, GPT2Config
from sparse_jax.training.losses import cross_entropy_loss, distillation_loss


def test_evaluate_lm_weights_a_short_last_batch_by_its_windows():
    config = GPT2Config.preset("tiny")
    model = GPT2(config, rngs=nnx.Rngs(0))
    teacher = GPT2(config, rngs=nnx.Rngs(1))
    windows = np.random.default_rng(0).integers(0, config.vocab_size, (10, 9)).astype(np.int32)
    nll, kl = measure.evaluate_lm(model, windows, teacher, batch=8)  # batches of 8 and 2
    # An independent computation over all ten windows at once.
    logits = model(windows[:, :-1])
    want_nll = float(cross_entropy_loss(logits, windows[:, 1:])[0])
    want_kl = float(distillation_loss(logits, teacher(windows[:, :-1]))[1]["kl"])
    assert nll == pytest.approx(want_nll, rel=1e-5)
    assert kl == pytest.approx(want_kl, rel=1e-4)
    # the unweighted mean of the two batch means differs: the test can tell the two apart
    short = measure.evaluate_lm(model, windows[8:], batch=8)[0]
    first = measure.evaluate_lm(model, windows[:8], batch=8)[0]
    assert abs((first + short) / 2 - want_nll) > 1e-4


def test_time_interleaved_gives_every_function_the_same_rounds():
    x = jnp.ones((16, 16))
    calls = [(lambda x: x @ x, (x,)), (lambda x: x + 1, (x,)), (lambda x: x * 2, (x,))]
    stats = timing.time_interleaved(calls, rounds=6)
    assert [len(s.times_s) for s in stats] == [6, 6, 6]
    assert all(s.compile_s > 0 and s.warmup_s > 0 and not s.truncated for s in stats)
    # A spent budget stops after min_rounds, for all alike.
    stats = timing.time_interleaved(calls, rounds=30, min_rounds=2, budget_s=0.0)
    assert [len(s.times_s) for s in stats] == [2, 2, 2] and stats[0].truncated
    for bad in ({"rounds": 0}, {"rounds": 3, "min_rounds": 4}, {"rounds": 2.0}):
        with pytest.raises(ValueError, match="time_interleaved: `rounds` and `min_rounds`"):
            timing.time_interleaved(calls, **bad)


def test_cost_times_teacher_and_student_in_alternation(monkeypatch):
    """The figures are the medians of one interleaved measurement per pair (forwards, then every
    attention core of both models), recomputed here from stand-in timings."""
    config = GPT2Config.preset("tiny")
    teacher = GPT2(config, rngs=nnx.Rngs(0))
    hard = GPT2(config, rngs=nnx.Rngs(1))
    seen = []

    def fake(calls, **kwargs):
        seen.append(len(calls))
        # call i takes (10 * measurement + i + 1) ms in every round
        base = 10 * len(seen)
        times = [tuple((base + i + 1) / 1e3 for _ in range(3)) for i in range(len(calls))]
        return [timing.TimingStats(t, 3, 0.0, 0.0, None) for t in times]

    monkeypatch.setattr(timing, "time_interleaved", fake)
    out = measure.cost(teacher, hard, seq_len=8)
    blocks = config.n_layer
    assert seen == [2, 2 * blocks]  # both forwards together, then all cores together
    assert out["teacher_ms"] == pytest.approx(11) and out["hardened_ms"] == pytest.approx(12)
    assert out["teacher_tokens_per_s"] == pytest.approx(8 / 0.011)
    assert out["teacher_attention_ms"] == pytest.approx(sum(20 + i + 1 for i in range(blocks)))
    assert out["hardened_attention_ms"] == pytest.approx(
        sum(20 + i + 1 for i in range(blocks, 2 * blocks))
    )
