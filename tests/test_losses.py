"""Distillation KL (forward, reverse, JSD), cross-entropy and sparsity penalties."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparse_jax.models import GPT2, AttentionSpec, GPT2Config
from sparse_jax.training.losses import (
    DIRECTIONS,
    cross_entropy_loss,
    distillation_loss,
    perplexity,
    sparsity_penalty,
)


def _logits(seed, shape=(2, 5, 7), scale=3.0):
    return scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _mask(seed, shape=(2, 5)):
    mask = np.random.default_rng(seed).random(shape) < 0.7
    mask[0, 0] = True
    return mask


def _log_softmax64(x, temperature):
    x = np.asarray(x, np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _reference(student, teacher, mask, temperature, direction):
    """Mean per-token divergence in float64 (nats/token at the temperature)."""
    logq, logp = _log_softmax64(student, temperature), _log_softmax64(teacher, temperature)
    p, q = np.exp(logp), np.exp(logq)
    if direction == "forward":
        per = (p * (logp - logq)).sum(-1)
    elif direction == "reverse":
        per = (q * (logq - logp)).sum(-1)
    else:
        m = 0.5 * (p + q)
        per = 0.5 * (p * np.log(p / m)).sum(-1) + 0.5 * (q * np.log(q / m)).sum(-1)
    mask = np.ones(per.shape, bool) if mask is None else mask
    return per[mask].sum() / max(mask.sum(), 1)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_reference(direction, temperature, masked):
    student, teacher = _logits(0), _logits(1)
    mask = _mask(2) if masked else None
    loss, metrics = distillation_loss(
        student, teacher, mask=mask, temperature=temperature, direction=direction
    )
    expected = _reference(student, teacher, mask, temperature, direction)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(float(metrics["kl"]), expected, rtol=2e-5, atol=1e-7)
    # Hinton's T² scaling applies to the loss only; the metric stays in nats/token at T.
    np.testing.assert_allclose(float(loss), temperature**2 * expected, rtol=2e-5, atol=1e-7)
    assert int(metrics["tokens"]) == (mask.sum() if masked else 10)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_equal_logits_give_exactly_zero(direction):
    x = _logits(3)
    loss, metrics = distillation_loss(x, x, temperature=1.7, direction=direction)
    assert float(loss) == 0.0 and float(metrics["kl"]) == 0.0


def test_forward_and_reverse_are_swapped_arguments():
    a, b = _logits(4), _logits(5)
    forward, _ = distillation_loss(a, b, direction="forward")
    reverse, _ = distillation_loss(b, a, direction="reverse")
    np.testing.assert_allclose(forward, reverse, rtol=1e-6)
    assert not np.isclose(forward, distillation_loss(a, b, direction="reverse")[0])


def test_jsd_symmetric_and_bounded_by_log2():
    a, b = _logits(6), _logits(7)
    ab, _ = distillation_loss(a, b, direction="jsd")
    ba, _ = distillation_loss(b, a, direction="jsd")
    np.testing.assert_allclose(ab, ba, rtol=1e-6)
    # Disjoint (near one-hot) distributions approach the bound log 2 from below.
    far_a = np.where(np.eye(7, dtype=bool)[np.arange(10) % 7], 60.0, -60.0).reshape(2, 5, 7)
    far_b = np.roll(far_a, 1, axis=-1)
    _, metrics = distillation_loss(far_a, far_b, direction="jsd")
    assert float(metrics["kl"]) <= math.log(2) + 1e-6
    np.testing.assert_allclose(float(metrics["kl"]), math.log(2), rtol=1e-5)


def test_masked_tokens_do_not_contribute():
    student, teacher, mask = _logits(8), _logits(9), _mask(10)
    garbage = np.where(mask[..., None], student, 1e4 * _logits(11))
    for direction in DIRECTIONS:
        a, ma = distillation_loss(student, teacher, mask=mask, direction=direction)
        b, mb = distillation_loss(garbage, teacher, mask=mask, direction=direction)
        assert float(a) == float(b) and int(ma["tokens"]) == int(mb["tokens"]) == mask.sum()
        # ... and the kept tokens alone give the same mean.
        kept, _ = distillation_loss(student[mask], teacher[mask], direction=direction)
        np.testing.assert_allclose(a, kept, rtol=1e-6)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_all_masked_is_zero_with_finite_grads(direction):
    student, teacher = _logits(12), _logits(13)
    mask = np.zeros((2, 5), bool)

    def f(s, t):
        return distillation_loss(s, t, mask=mask, temperature=2.0, direction=direction)[0]

    loss, metrics = distillation_loss(student, teacher, mask=mask, direction=direction)
    assert float(loss) == 0.0 and int(metrics["tokens"]) == 0
    grads = jax.grad(f, argnums=(0, 1))(student, teacher)
    for g in grads:
        assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gradients_finite_and_match_finite_differences(direction):
    student, teacher, mask = _logits(14, (1, 3, 5)), _logits(15, (1, 3, 5)), _mask(16, (1, 3))

    def f(s):
        return distillation_loss(s, teacher, mask=mask, temperature=1.5, direction=direction)[0]

    g = np.asarray(jax.grad(f)(student))
    assert np.all(np.isfinite(g))
    assert np.all(g[~mask] == 0.0)  # padding gets no gradient
    # central differences in float64 on the reference
    eps, num = 1e-4, np.zeros_like(g, np.float64)
    for idx in np.ndindex(*student.shape):
        hi, lo = student.astype(np.float64), student.astype(np.float64)
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (
            1.5**2
            * (
                _reference(hi, teacher, mask, 1.5, direction)
                - _reference(lo, teacher, mask, 1.5, direction)
            )
            / (2 * eps)
        )
    np.testing.assert_allclose(g, num, atol=2e-5)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_negative_infinite_logits_stay_finite(direction):
    # A padded vocabulary: the same entries are -inf for teacher and student.
    student, teacher = _logits(17), _logits(18)
    student[..., -2:] = -np.inf
    teacher[..., -2:] = -np.inf
    loss, _ = distillation_loss(student, teacher, direction=direction)
    expected = _reference(student[..., :-2], teacher[..., :-2], None, 1.0, direction)
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
    g = jax.grad(lambda s: distillation_loss(s, teacher, direction=direction)[0])(student)
    assert np.all(np.isfinite(np.asarray(g)))


def test_jit_and_low_precision():
    student, teacher = _logits(19), _logits(20)
    loss = jax.jit(lambda s, t: distillation_loss(s, t, temperature=2.0)[0])(student, teacher)
    # jit fuses what eager runs op by op: equal up to float32 rounding, not bit for bit
    eager = distillation_loss(student, teacher, temperature=2.0)[0]
    np.testing.assert_allclose(loss, eager, rtol=1e-6)
    low, _ = distillation_loss(jnp.asarray(student, jnp.bfloat16), jnp.asarray(teacher))
    assert low.dtype == jnp.float32
    # a traced temperature is used unchecked
    traced = jax.jit(lambda t: distillation_loss(student, teacher, temperature=t)[0])(2.0)
    np.testing.assert_allclose(traced, loss, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        (dict(direction="kl"), "`direction`"),
        (dict(temperature=0.0), "`temperature`"),
        (dict(temperature=-1.0), "`temperature`"),
        (dict(temperature=float("nan")), "`temperature`"),
        (dict(temperature=True), "`temperature`"),
        (dict(mask=np.ones((2, 4), bool)), "`mask`"),
    ],
)
def test_distillation_errors_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        distillation_loss(_logits(0), _logits(1), **kwargs)


def test_distillation_shape_mismatch():
    with pytest.raises(ValueError, match="`student_logits`"):
        distillation_loss(_logits(0), _logits(1, (2, 5, 8)))
    with pytest.raises(TypeError, match="`student_logits`"):
        distillation_loss(np.zeros((2, 5, 7), np.int32), _logits(1))


def test_cross_entropy_matches_optax():
    logits = _logits(21)
    targets = np.random.default_rng(22).integers(0, 7, (2, 5))
    mask = _mask(23)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    loss, metrics = cross_entropy_loss(logits, targets)
    np.testing.assert_allclose(loss, np.mean(expected), rtol=1e-6)
    assert int(metrics["tokens"]) == 10
    np.testing.assert_allclose(
        metrics["accuracy"], np.mean(logits.argmax(-1) == targets), rtol=1e-6
    )
    # masked positions may hold padding ids (-100) and contribute nothing, not even to grads
    padded = np.where(mask, targets, -100)
    loss, metrics = cross_entropy_loss(logits, padded, mask=mask)
    np.testing.assert_allclose(loss, np.asarray(expected)[mask].mean(), rtol=1e-6)
    assert int(metrics["tokens"]) == mask.sum()
    g = jax.grad(lambda x: cross_entropy_loss(x, padded, mask=mask)[0])(logits)
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~mask] == 0)
    # fully masked: 0, finite
    zero, metrics = cross_entropy_loss(logits, padded, mask=np.zeros((2, 5), bool))
    assert float(zero) == 0.0 and int(metrics["tokens"]) == 0
    # an out-of-range target at a kept position is loud (NaN), not clipped
    assert np.isnan(float(cross_entropy_loss(logits, padded)[0]))
    assert np.isnan(float(cross_entropy_loss(logits, np.full((2, 5), -1))[0]))
    assert np.isnan(float(cross_entropy_loss(logits, np.full((2, 5), 7))[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_equals_the_log_softmax_gather_it_replaced(dtype):
    # cross_entropy_loss computes through optax since the house step; before, it gathered
    # jax.nn.log_softmax at the targets. Values and gradients agree to float rounding.
    logits = jnp.asarray(_logits(31, (3, 6, 50), scale=8.0), dtype)
    targets = np.random.default_rng(32).integers(0, 50, (3, 6))
    mask = _mask(33, (3, 6))

    def before(x):
        logp = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(mask, -picked, 0.0)) / mask.sum()

    def now(x):
        return cross_entropy_loss(x, targets, mask=mask)[0]

    np.testing.assert_allclose(now(logits), before(logits), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(jax.grad(now)(logits), np.float32),
        np.asarray(jax.grad(before)(logits), np.float32),
        rtol=1e-5,
        atol=1e-7,
    )


def test_perplexity():
    np.testing.assert_allclose(perplexity(math.log(7.0)), 7.0, rtol=1e-6)
    loss, _ = cross_entropy_loss(jnp.zeros((1, 3, 11)), jnp.zeros((1, 3), jnp.int32))
    np.testing.assert_allclose(perplexity(loss), 11.0, rtol=1e-5)


def test_cross_entropy_errors():
    with pytest.raises(ValueError, match="`targets`"):
        cross_entropy_loss(_logits(0), np.zeros((2, 4), np.int32))
    with pytest.raises(TypeError, match="`targets`"):
        cross_entropy_loss(_logits(0), np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="`mask`"):
        cross_entropy_loss(_logits(0), np.zeros((2, 5), np.int32), mask=np.ones((5,), bool))


def _student_aux():
    spec = AttentionSpec(kind="candidates", head_gate="sigmoid_ste", ffn_gate="hard_concrete")
    model = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    _, aux = model(jnp.zeros((1, 4), jnp.int32), return_aux=True)
    return aux


def test_sparsity_penalty_on_a_gpt2_student():
    aux = _student_aux()
    assert set(aux) == {
        "mask_l1", "mask_density", "mask_expected_density", "mask_expected_cost", "head_gate",
        "ffn_gate",
    }  # fmt: skip
    weights = {"mask_l1": 0.1, "mask_density": 0.2, "head_gate": 0.01, "ffn_gate": 0.0}
    total, metrics = sparsity_penalty(aux, weights)
    expected = sum(w * float(aux[k]) for k, w in weights.items())
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert set(metrics) == set(aux) | {"total"}
    np.testing.assert_allclose(metrics["head_gate"], aux["head_gate"])
    # a dense model returns no penalties: zero weights are fine, the total is 0
    total, metrics = sparsity_penalty({}, {"mask_l1": 0.0, "head_gate": 0.0})
    assert float(total) == 0.0 and set(metrics) == {"total"}
    # differentiable and jittable
    g = jax.grad(lambda a: sparsity_penalty(a, {"head_gate": 2.0})[0])(aux)
    assert float(g["head_gate"]) == 2.0 and float(g["ffn_gate"]) == 0.0


def test_sparsity_penalty_errors():
    aux = {"head_gate": jnp.float32(1.0)}
    with pytest.raises(ValueError, match=r"unknown penalty 'hed_gate'.*\['head_gate'\]"):
        sparsity_penalty(aux, {"hed_gate": 0.0})
    with pytest.raises(ValueError, match=r"'ffn_gate'.*non-zero.*\['head_gate'\]"):
        sparsity_penalty(aux, {"ffn_gate": 0.5})
    with pytest.raises(ValueError, match=r"weights\['head_gate'\]"):
        sparsity_penalty(aux, {"head_gate": -1.0})
    with pytest.raises(ValueError, match=r"weights\['head_gate'\]"):
        sparsity_penalty(aux, {"head_gate": "0.1"})
