"""experiments.measure: the evaluation means are over tokens, whatever the batching."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from experiments import measure
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
