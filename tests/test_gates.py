"""Tests of ``sparse_jax.gates``: sigmoid/straight-through gates, Hard Concrete gates, L1/L0
penalties and the CoFi-style target-sparsity Lagrangian.

Formulas are checked against float64 numpy; the sampler's statistics (P(gate != 0), P(gate = 0),
P(gate = 1), the mean) against closed forms and a numerical integral over the uniform noise;
derivatives with ``jax.test_util.check_grads`` in float64.
"""

from __future__ import annotations

import functools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from sparse_jax import gates
from sparse_jax.gates import (
    expected_l0,
    expected_sparsity,
    hard_concrete,
    l0_penalty,
    l1_penalty,
    lagrangian_sparsity,
    reviving_sparsemax,
    sigmoid_gate,
    sparsity_schedule,
)
from sparse_jax.normalizers import sparsemax

BETA, GAMMA, ZETA = 2.0 / 3.0, -0.1, 1.1
LOG_ALPHAS = np.array([-2.0, -0.5, 0.0, 0.7, 2.5])
HYP = hypothesis.settings(max_examples=40, deadline=None)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def _p_nonzero_ref(la, beta=BETA, gamma=GAMMA, zeta=ZETA):
    return _sigmoid(np.asarray(la, np.float64) - beta * math.log(-gamma / zeta))


def _p_one_ref(la, beta=BETA, gamma=GAMMA, zeta=ZETA):
    # gate = 1  <=>  s >= (1 - γ)/(ζ - γ)  <=>  logistic noise >= β log((1 - γ)/(ζ - 1)) - la.
    return _sigmoid(np.asarray(la, np.float64) - beta * math.log((1.0 - gamma) / (zeta - 1.0)))


def _deterministic_ref(la, gamma=GAMMA, zeta=ZETA):
    return np.clip(_sigmoid(la) * (zeta - gamma) + gamma, 0.0, 1.0)


def _mean_ref(la, beta=BETA, gamma=GAMMA, zeta=ZETA, n=2_000_000):
    """E[gate] by the midpoint rule over u ∈ (0, 1); the gate is monotone in u."""
    u = (np.arange(n, dtype=np.float64) + 0.5) / n
    noise = np.log(u) - np.log1p(-u)
    return np.array(
        [
            np.mean(np.clip(_sigmoid((noise + a) / beta) * (zeta - gamma) + gamma, 0.0, 1.0))
            for a in np.atleast_1d(la)
        ]
    )


# ----------------------------------------------------------------------------------------------
# Closed forms.


def test_expected_l0_at_zero_is_0832():
    value = float(expected_l0(jnp.float32(0.0)))
    assert value == pytest.approx(1.0 / (1.0 + math.exp((2.0 / 3.0) * math.log(0.1 / 1.1))))
    assert value == pytest.approx(0.8318, abs=1e-4)
    assert round(value, 3) == 0.832


@pytest.mark.parametrize("beta,gamma,zeta", [(BETA, GAMMA, ZETA), (0.5, -0.2, 1.3), (1.0, -1.0, 2)])
def test_expected_l0_formula(beta, gamma, zeta):
    la = np.linspace(-8.0, 8.0, 33)
    got = expected_l0(jnp.asarray(la, jnp.float32), beta=beta, gamma=gamma, zeta=zeta)
    assert got.shape == la.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _p_nonzero_ref(la, beta, gamma, zeta), rtol=1e-5, atol=1e-7)


def test_deterministic_gate_formula_and_range():
    la = np.linspace(-10.0, 10.0, 201).reshape(3, 67)
    got = hard_concrete(jnp.asarray(la, jnp.float32))
    assert got.shape == la.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _deterministic_ref(la), atol=1e-6)
    got = np.asarray(got)
    assert got.min() == 0.0 and got.max() == 1.0  # exact zeros and ones at the extremes
    assert np.all((got >= 0.0) & (got <= 1.0))
    # Independent of beta (the test-time estimator has no temperature).
    np.testing.assert_array_equal(hard_concrete(jnp.asarray(la, jnp.float32), beta=0.1), got)


def test_deterministic_gate_has_no_randomness():
    la = jnp.linspace(-3.0, 3.0, 7)
    first = hard_concrete(la)
    np.testing.assert_array_equal(first, hard_concrete(la))
    np.testing.assert_allclose(first, jax.jit(hard_concrete)(la), rtol=1e-6)  # fusion rounding
    # log_alpha = 0 gives exactly the stretched midpoint 0.5 (ζ + γ) = 0.5.
    assert float(hard_concrete(jnp.float32(0.0))) == pytest.approx(0.5)


# ----------------------------------------------------------------------------------------------
# Sampling.


@pytest.fixture(scope="module")
def many_samples():
    """200k draws for each of the log_alpha values in LOG_ALPHAS, shape [200_000, 5]."""
    return np.asarray(
        hard_concrete(jnp.asarray(LOG_ALPHAS, jnp.float32), jax.random.key(1), sample_shape=200_000)
    )


def test_samples_in_unit_interval(many_samples):
    assert many_samples.shape == (200_000, len(LOG_ALPHAS))
    assert many_samples.dtype == np.float32
    assert np.all((many_samples >= 0.0) & (many_samples <= 1.0))


def test_sample_probability_nonzero_matches_expected_l0(many_samples):
    empirical = np.mean(many_samples > 0.0, axis=0)
    expected = np.asarray(expected_l0(jnp.asarray(LOG_ALPHAS, jnp.float32)))
    np.testing.assert_allclose(empirical, expected, atol=0.01)
    np.testing.assert_allclose(empirical, _p_nonzero_ref(LOG_ALPHAS), atol=0.01)


def test_sample_hits_exact_zero_and_one(many_samples):
    p_zero = np.mean(many_samples == 0.0, axis=0)
    p_one = np.mean(many_samples == 1.0, axis=0)
    assert np.all(p_zero > 0.0) and np.all(p_one > 0.0)
    np.testing.assert_allclose(p_zero, 1.0 - _p_nonzero_ref(LOG_ALPHAS), atol=0.01)
    np.testing.assert_allclose(p_one, _p_one_ref(LOG_ALPHAS), atol=0.01)


def test_sample_mean_matches_integral(many_samples):
    # The gate's standard deviation is <= 0.5, so the standard error is <= 0.0012.
    np.testing.assert_allclose(many_samples.mean(axis=0), _mean_ref(LOG_ALPHAS), atol=0.006)


def test_vmap_over_split_keys_matches_distribution():
    la = jnp.asarray(LOG_ALPHAS, jnp.float32)
    draw = jax.jit(jax.vmap(lambda key: hard_concrete(la, key)))
    for key in (jax.random.key(7), jax.random.PRNGKey(7)):  # new-style and legacy keys
        samples = np.asarray(draw(jax.random.split(key, 100_000)))
        assert samples.shape == (100_000, len(LOG_ALPHAS))
        np.testing.assert_allclose(np.mean(samples > 0, 0), _p_nonzero_ref(LOG_ALPHAS), atol=0.01)
        np.testing.assert_allclose(samples.mean(0), _mean_ref(LOG_ALPHAS), atol=0.01)


def test_legacy_and_new_style_keys_agree():
    la = jnp.linspace(-2.0, 2.0, 16)
    np.testing.assert_array_equal(
        hard_concrete(la, jax.random.key(3)), hard_concrete(la, jax.random.PRNGKey(3))
    )
    np.testing.assert_array_equal(
        hard_concrete(la, jax.random.key(3)), hard_concrete(la, np.asarray(jax.random.PRNGKey(3)))
    )
    assert not np.array_equal(
        hard_concrete(la, jax.random.key(3)), hard_concrete(la, jax.random.key(4))
    )


def test_sample_shape_prepends_and_draws_independently():
    la = jnp.zeros((2, 3))
    out = hard_concrete(la, jax.random.key(0), sample_shape=(4, 5))
    assert out.shape == (4, 5, 2, 3)
    flat = np.asarray(out).reshape(-1)
    assert len(np.unique(flat[(flat > 0) & (flat < 1)])) > 50
    assert hard_concrete(la, jax.random.key(0), sample_shape=0).shape == (0, 2, 3)


@HYP
@hypothesis.given(
    st.lists(st.floats(-30.0, 30.0, width=32), min_size=8, max_size=8),
    st.lists(st.floats(0.0, 5.0, width=32), min_size=8, max_size=8),
    st.integers(0, 2**31 - 1),
)
def test_sample_in_range_and_monotone_in_log_alpha(la, step, seed):
    la = jnp.asarray(la, jnp.float32)
    low, high = _sample8(la, seed), _sample8(la + jnp.asarray(step, jnp.float32), seed)
    assert np.all(np.isfinite(low)) and np.all((low >= 0.0) & (low <= 1.0))
    assert np.all(high >= low)  # same noise: the gate is non-decreasing in log_alpha


@jax.jit
def _sample8(la, seed):
    return hard_concrete(la, jax.random.key(seed))


# ----------------------------------------------------------------------------------------------
# Derivatives.


def test_sample_gradient_matches_formula_and_check_grads(x64):
    key = jax.random.key(11)
    la0 = jnp.linspace(-3.0, 3.0, 40, dtype=jnp.float64)
    gate0 = np.asarray(hard_concrete(la0, key))
    assert gate0.dtype == np.float64
    # Away from the clip boundaries (a step of check_grads' size cannot cross them).
    inside = (gate0 > 0.02) & (gate0 < 0.98)
    assert 5 < inside.sum() < 40 and np.any(gate0 == 0.0) | np.any(gate0 == 1.0)

    grad = np.asarray(jax.grad(lambda la: hard_concrete(la, key).sum())(la0))
    assert np.all(np.isfinite(grad))
    # Every entry against an independent value: the formula where the gate is not clipped
    # (near the clip boundaries too), 0 where it is, and central differences of the forward
    # pass in float64 wherever a step of 1e-6 stays on one side of the boundaries.
    clipped = (gate0 == 0.0) | (gate0 == 1.0)
    assert clipped.any() and (~clipped).any()
    s = (gate0 - GAMMA) / (ZETA - GAMMA)
    expected = np.where(clipped, 0.0, (ZETA - GAMMA) * s * (1.0 - s) / BETA)
    np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=0)
    h = 1e-6
    up, down = (np.asarray(hard_concrete(la0 + d, key)) for d in (h, -h))
    smooth = ((up > 0) & (up < 1) & (down > 0) & (down < 1)) | ((up == down) & clipped)
    assert smooth.sum() >= 35
    np.testing.assert_allclose(grad[smooth], ((up - down) / (2 * h))[smooth], atol=1e-7)

    mask = jnp.asarray(inside, jnp.float64)
    check_grads(lambda la: hard_concrete(la, key) * mask, (la0,), order=2, modes=["fwd", "rev"])
    check_grads(
        lambda la: hard_concrete(la, key, beta=0.4, gamma=-0.3, zeta=1.2) * mask,
        (la0,),
        order=1,
        modes=["fwd", "rev"],
    )


def test_deterministic_gate_and_expected_l0_gradients(x64):
    la = jnp.linspace(-1.5, 1.5, 9, dtype=jnp.float64)  # deterministic gate unclipped here
    check_grads(hard_concrete, (la,), order=2, modes=["fwd", "rev"])
    check_grads(expected_l0, (la,), order=2, modes=["fwd", "rev"])
    p = _p_nonzero_ref(la)
    np.testing.assert_allclose(jax.grad(lambda x: expected_l0(x).sum())(la), p * (1 - p))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_straight_through_forward_is_hard_and_gradient_is_sigmoid(temperature):
    z = jnp.linspace(-4.0, 4.0, 17)  # includes z = 0, where M = 0.5 is not > 0.5
    hard = sigmoid_gate(z, straight_through=True, temperature=temperature)
    np.testing.assert_array_equal(hard, (np.asarray(z) > 0.0).astype(np.float32))
    assert set(np.unique(np.asarray(hard)).tolist()) == {0.0, 1.0}
    grad = jax.grad(
        lambda z: sigmoid_gate(z, straight_through=True, temperature=temperature).sum()
    )(z)
    s = _sigmoid(np.asarray(z, np.float64) / temperature)
    np.testing.assert_allclose(grad, s * (1.0 - s) / temperature, rtol=2e-4)  # f32 1 - s
    soft = sigmoid_gate(z, temperature=temperature)
    np.testing.assert_allclose(soft, s, rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda z: sigmoid_gate(z, temperature=temperature).sum())(z), grad
    )


def test_straight_through_threshold():
    z = jnp.array([-1.0, 0.5, 1.0, 1.5, 3.0])
    got = sigmoid_gate(z, straight_through=True, threshold=0.8)
    np.testing.assert_array_equal(got, (_sigmoid(z) > 0.8).astype(np.float32))
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 1.0, 1.0])
    # A tiny positive logit is on, although sigmoid(1e-9) rounds to 0.5 in float32.
    assert float(sigmoid_gate(jnp.float32(1e-9), straight_through=True)) == 1.0


def test_sigmoid_gate_check_grads(x64):
    z = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.float64)
    check_grads(functools.partial(sigmoid_gate, temperature=0.7), (z,), order=2)


# ----------------------------------------------------------------------------------------------
# Penalties.


def test_l1_penalty_values_and_gradients():
    z = jnp.array([[-1.0, 0.0], [2.0, -3.0]])
    s = _sigmoid(z)
    assert float(l1_penalty(z, from_logits=True)) == pytest.approx(s.sum(), rel=1e-6)
    assert float(l1_penalty(z, from_logits=True, reduction="mean")) == pytest.approx(s.mean())
    np.testing.assert_allclose(
        jax.grad(lambda z: l1_penalty(z, from_logits=True))(z), s * (1 - s), rtol=1e-5
    )
    w = jnp.array([-1.5, 0.5, 2.0])
    assert float(l1_penalty(w, from_logits=False)) == pytest.approx(4.0)
    assert float(l1_penalty(w, from_logits=False, reduction="mean")) == pytest.approx(4.0 / 3)
    np.testing.assert_array_equal(
        jax.grad(lambda w: l1_penalty(w, from_logits=False))(w), [-1, 1, 1]
    )


def test_penalties_accept_pytrees():
    tree = {"heads": jnp.zeros((2, 4)), "ffn": [jnp.full((3,), 2.0), jnp.full((5,), -1.0)]}
    leaves = [np.zeros(8), np.full(3, 2.0), np.full(5, -1.0)]
    everything = np.concatenate(leaves)
    assert float(l1_penalty(tree, from_logits=True)) == pytest.approx(_sigmoid(everything).sum())
    assert float(l1_penalty(tree, from_logits=False)) == pytest.approx(11.0)
    assert float(l0_penalty(tree, reduction="mean")) == pytest.approx(
        _p_nonzero_ref(everything).mean(), rel=1e-6
    )
    grads = jax.grad(lambda t: l0_penalty(t))(tree)
    p = _p_nonzero_ref(2.0)
    np.testing.assert_allclose(grads["ffn"][0], np.full(3, p * (1 - p)), rtol=1e-5)


def test_l0_penalty_value_and_gradient():
    la = jnp.array([-2.0, 0.0, 1.0, 4.0])
    p = _p_nonzero_ref(la)
    assert float(l0_penalty(la)) == pytest.approx(p.sum(), rel=1e-6)
    assert float(l0_penalty(jnp.zeros(10))) == pytest.approx(8.318, abs=1e-3)
    np.testing.assert_allclose(jax.grad(l0_penalty)(la), p * (1 - p), rtol=1e-4)
    kw = dict(beta=0.5, gamma=-0.2, zeta=1.3)
    assert float(l0_penalty(la, **kw)) == pytest.approx(_p_nonzero_ref(la, 0.5, -0.2, 1.3).sum())
    # The expected L0 norm is the sample average of the number of non-zero gates.
    samples = hard_concrete(la, jax.random.key(5), sample_shape=50_000)
    assert float(jnp.mean(jnp.sum(samples > 0, -1))) == pytest.approx(
        float(l0_penalty(la)), abs=0.03
    )


# ----------------------------------------------------------------------------------------------
# Target sparsity.


def test_expected_sparsity_unweighted_and_weighted():
    heads, ffn = jnp.asarray([[0.0, 1.0], [-1.0, 2.0]]), jnp.asarray([3.0, -4.0, 0.5])
    p_heads, p_ffn = _p_nonzero_ref(heads), _p_nonzero_ref(ffn)
    assert float(expected_sparsity(heads)) == pytest.approx(1 - p_heads.mean(), rel=1e-6)
    both = np.concatenate([p_heads.ravel(), p_ffn])
    assert float(expected_sparsity([heads, ffn])) == pytest.approx(1 - both.mean(), rel=1e-6)
    # One size per array (e.g. parameters per head / per FFN unit).
    weighted = (256 * p_heads.sum() + 32 * p_ffn.sum()) / (256 * 4 + 32 * 3)
    got = expected_sparsity({"h": heads, "f": ffn}, {"h": 256, "f": 32.0})
    assert float(got) == pytest.approx(1 - weighted, rel=1e-6)
    # Per-unit weights broadcast against their array.
    per_row = jnp.asarray([[1.0], [3.0]])
    expected = 1 - (p_heads[0].sum() + 3 * p_heads[1].sum()) / 8
    assert float(expected_sparsity(heads, per_row)) == pytest.approx(expected, rel=1e-6)
    # Gradient: d/d la of 1 - mean(p) is -p(1-p)/n.
    grad = jax.grad(expected_sparsity)(heads)
    np.testing.assert_allclose(grad, -p_heads * (1 - p_heads) / 4, rtol=1e-5)


def test_lagrangian_value_and_sign_convention():
    s, t, l1, l2 = 0.3, 0.5, -1.0, 2.0
    assert float(lagrangian_sparsity(s, t, l1, l2)) == pytest.approx(
        l1 * (s - t) + l2 * (s - t) ** 2
    )
    grads = jax.grad(lagrangian_sparsity, argnums=(0, 2, 3))(
        jnp.float32(s), jnp.float32(t), jnp.float32(l1), jnp.float32(l2)
    )
    np.testing.assert_allclose(grads, [l1 + 2 * l2 * (s - t), s - t, (s - t) ** 2], rtol=1e-6)
    # Ascent on λ1 (grad = s - t < 0) makes it negative; the model then gains by raising s.
    assert float(grads[1]) < 0


def test_lagrangian_min_max_reaches_target():
    target = 0.6

    def loss(log_alpha, lambdas):
        s = expected_sparsity(log_alpha)
        task = -0.01 * jnp.mean(jax.nn.sigmoid(log_alpha))  # a task that wants gates open
        return task + lagrangian_sparsity(s, target, lambdas[0], lambdas[1]), s

    model_tx = optax.adam(0.05)
    lambda_tx = optax.chain(optax.adam(0.05), optax.scale(-1.0))  # gradient ascent

    @jax.jit
    def step(state, _):
        la, lambdas, model_opt, lambda_opt = state
        (_, s), (g_la, g_lambdas) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            la, lambdas
        )
        updates, model_opt = model_tx.update(g_la, model_opt)
        la = optax.apply_updates(la, updates)
        updates, lambda_opt = lambda_tx.update(g_lambdas, lambda_opt)
        lambdas = optax.apply_updates(lambdas, updates)
        return (la, lambdas, model_opt, lambda_opt), s

    la, lambdas = jnp.linspace(1.0, 3.0, 32), jnp.zeros(2)
    state = (la, lambdas, model_tx.init(la), lambda_tx.init(lambdas))
    _, trace = jax.lax.scan(step, state, None, length=400)
    assert float(trace[0]) < 0.1
    assert float(trace[-1]) == pytest.approx(target, abs=0.02)


def test_sparsity_schedule():
    steps = jnp.array([-5, 0, 25, 50, 100, 1000])
    got = sparsity_schedule(steps, target=0.8, warmup_steps=100)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.2, 0.4, 0.8, 0.8], rtol=1e-6)
    assert got.dtype == jnp.float32 and got.shape == steps.shape
    assert float(sparsity_schedule(7, target=0.5, warmup_steps=0)) == 0.5
    assert float(sparsity_schedule(5, target=0.5, warmup_steps=10, initial=0.1)) == pytest.approx(
        0.3
    )
    schedule = functools.partial(sparsity_schedule, target=0.9, warmup_steps=10)
    assert float(jax.jit(schedule)(jnp.int32(5))) == pytest.approx(0.45)
    reference = optax.linear_schedule(0.0, 0.9, 10)
    np.testing.assert_allclose(
        [float(schedule(i)) for i in range(15)], [float(reference(i)) for i in range(15)], atol=1e-7
    )


# ----------------------------------------------------------------------------------------------
# jit / vmap / dtypes.


def test_jit_matches_eager():
    la = jnp.linspace(-3.0, 3.0, 12).reshape(3, 4)
    key = jax.random.key(2)
    cases = [
        (lambda x: sigmoid_gate(x, straight_through=True, temperature=0.5), (la,)),
        (lambda x: sigmoid_gate(x, threshold=0.3), (la,)),
        (lambda x, k: hard_concrete(x, k), (la, key)),
        (lambda x, k: hard_concrete(x, k, sample_shape=(3,)), (la, jax.random.PRNGKey(2))),
        (hard_concrete, (la,)),
        (expected_l0, (la,)),
        (lambda x: l1_penalty(x, from_logits=True), (la,)),
        (l0_penalty, (la,)),
        (lambda x: expected_sparsity([x, x[0]], [1.0, 2.0]), (la,)),
        (lambda x: lagrangian_sparsity(expected_sparsity(x), 0.5, x[0, 0], x[0, 1]), (la,)),
    ]
    for fn, args in cases:
        np.testing.assert_allclose(jax.jit(fn)(*args), fn(*args), rtol=1e-6, atol=1e-7)


def test_traced_hyperparameters_are_accepted():
    la = jnp.linspace(-2.0, 2.0, 5)
    annealed = jax.jit(lambda z, t: sigmoid_gate(z, temperature=t, straight_through=True))
    np.testing.assert_array_equal(
        annealed(la, jnp.float32(0.3)), sigmoid_gate(la, straight_through=True)
    )
    stretched = jax.jit(lambda x, b: hard_concrete(x, jax.random.key(0), beta=b))
    np.testing.assert_allclose(
        stretched(la, jnp.float32(0.5)), hard_concrete(la, jax.random.key(0), beta=0.5)
    )
    target = jax.jit(
        lambda step: lagrangian_sparsity(
            0.4, sparsity_schedule(step, target=0.8, warmup_steps=10), 1.0, 0.0
        )
    )
    assert float(target(jnp.int32(5))) == pytest.approx(0.0, abs=1e-7)


def test_traced_threshold_and_weights():
    z = jnp.array([-1.0, 0.5, 1.0, 1.5, 3.0])
    hard = jax.jit(lambda z, t: sigmoid_gate(z, straight_through=True, threshold=t))
    np.testing.assert_array_equal(hard(z, jnp.float32(0.8)), [0.0, 0.0, 0.0, 1.0, 1.0])
    heads, ffn = jnp.zeros((2, 4)), jnp.full((8,), -10.0)
    weighted = jax.jit(lambda w: expected_sparsity([heads, ffn], w))
    np.testing.assert_allclose(
        weighted([jnp.float32(1024.0), jnp.float32(0.0)]),
        expected_sparsity([heads, ffn], [1024.0, 0.0]),
        rtol=1e-6,
    )


def test_vmap():
    la = jnp.linspace(-3.0, 3.0, 24).reshape(4, 6)
    np.testing.assert_allclose(jax.vmap(hard_concrete)(la), hard_concrete(la))
    np.testing.assert_allclose(jax.vmap(expected_l0)(la), expected_l0(la))
    np.testing.assert_allclose(
        jax.vmap(lambda x: sigmoid_gate(x, straight_through=True))(la),
        sigmoid_gate(la, straight_through=True),
    )
    np.testing.assert_allclose(
        jax.vmap(l0_penalty)(la), [float(l0_penalty(row)) for row in la], rtol=1e-6
    )
    keys = jax.random.split(jax.random.key(0), 4)
    batched = jax.vmap(hard_concrete)(la, keys)
    np.testing.assert_allclose(batched[2], hard_concrete(la[2], keys[2]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_computes_in_float32(dtype):
    la = jnp.linspace(-3.0, 3.0, 13)
    low = la.astype(dtype)
    reference = low.astype(jnp.float32)
    for fn in (
        sigmoid_gate,
        hard_concrete,
        expected_l0,
        lambda x: hard_concrete(x, jax.random.key(0)),
    ):
        out = fn(low)
        assert out.dtype == dtype and out.shape == la.shape
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(fn(reference).astype(dtype), np.float32)
        )
    hard = sigmoid_gate(low, straight_through=True)
    assert hard.dtype == dtype
    np.testing.assert_array_equal(np.asarray(hard, np.float32), np.asarray(reference) > 0)
    assert l0_penalty(low).dtype == jnp.float32
    assert l1_penalty(low, from_logits=True).dtype == jnp.float32
    assert expected_sparsity(low).dtype == jnp.float32
    assert float(l0_penalty(low)) == pytest.approx(float(l0_penalty(reference)))


def test_float64_stays_float64(x64):
    la = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.float64)
    assert hard_concrete(la, jax.random.key(0)).dtype == jnp.float64
    assert sigmoid_gate(la, straight_through=True).dtype == jnp.float64
    assert l0_penalty(la).dtype == jnp.float64
    assert expected_sparsity(la).dtype == jnp.float64


# ----------------------------------------------------------------------------------------------
# reviving_sparsemax.


@pytest.mark.parametrize("axis", [0, -1])
def test_reviving_sparsemax_forward_is_sparsemax(axis):
    z = jax.random.normal(jax.random.key(0), (5, 6)) * 2.0
    np.testing.assert_array_equal(reviving_sparsemax(z, axis=axis), sparsemax(z, axis=axis))
    low = reviving_sparsemax(z.astype(jnp.bfloat16))
    assert low.dtype == jnp.bfloat16 and low.shape == (5, 6)


def test_reviving_sparsemax_backward_on_and_off_the_support():
    """On the support: sparsemax's own vector-Jacobian product; off it: the centred cotangent
    where it is negative (raising that logit would lower the loss) and 0 where it is not."""
    z = jnp.array([[1.5, 1.2, -0.4, 0.1, -2.0], [0.3, 0.2, 0.1, 0.0, -3.0]])
    g = jnp.array([[0.5, -0.1, -2.0, 1.0, 0.3], [1.0, -1.0, 0.5, -0.5, -4.0]])
    p, vjp = jax.vjp(reviving_sparsemax, z)
    _, true_vjp = jax.vjp(sparsemax, z)
    (got,), (true,) = vjp(g), true_vjp(g)
    on = np.asarray(p) > 0
    assert on.sum(1).tolist() == [2, 4]  # both rows have dropped candidates
    np.testing.assert_allclose(np.asarray(got)[on], np.asarray(true)[on], atol=1e-6)
    centred = np.asarray(g) - (np.asarray(g) * on).sum(1, keepdims=True) / on.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(got)[~on], np.minimum(centred, 0)[~on], atol=1e-6)
    assert np.asarray(true)[~on].tolist() == [0.0] * 4  # sparsemax's own: exactly zero there
    assert (np.asarray(got)[~on] < 0).sum() == 2  # (-2.0 and -4.0 below their rows' means)


def test_reviving_sparsemax_brings_back_a_dropped_candidate_that_sparsemax_cannot():
    """Gradient descent on a loss that wants candidate 2, dropped at the start: sparsemax's
    exact gradient is zero, so its weights never move; the reviving one's reach candidate 2."""
    start = jnp.array([2.0, 0.5, -1.0])
    for weighting, want in ((sparsemax, [1.0, 0.0, 0.0]), (reviving_sparsemax, [0.0, 0.0, 1.0])):
        z = start
        loss = functools.partial(lambda z, weighting: -weighting(z)[2], weighting=weighting)
        for _ in range(60):
            z = z - 0.2 * jax.grad(loss)(z)
        np.testing.assert_allclose(weighting(z), want, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Argument errors.

LA = jnp.zeros(3)
BAD_ARGUMENTS = [
    (lambda: sigmoid_gate(jnp.arange(3)), TypeError, r"`z` must have a floating dtype.*int32"),
    (
        lambda: sigmoid_gate(LA, threshold=1.0),
        ValueError,
        r"`threshold` must be in \(0, 1\); got 1.0",
    ),
    (lambda: sigmoid_gate(LA, threshold=0.0), ValueError, r"`threshold`"),
    (lambda: sigmoid_gate(LA, temperature=0.0), ValueError, r"`temperature` must be > 0; got 0.0"),
    (lambda: sigmoid_gate(LA, temperature=float("nan")), ValueError, r"`temperature`.*nan"),
    (lambda: sigmoid_gate(LA, temperature="hot"), TypeError, r"`temperature` must be a real"),
    (
        lambda: sigmoid_gate(LA, temperature=jnp.ones(2)),
        TypeError,
        r"`temperature` must be a real scalar",
    ),
    (lambda: sigmoid_gate(LA, straight_through=1), TypeError, r"`straight_through` must be a bool"),
    (
        lambda: hard_concrete(jnp.zeros(3, jnp.int32)),
        TypeError,
        r"`log_alpha` must have a floating",
    ),
    (lambda: hard_concrete(0), TypeError, r"`log_alpha`.*int32"),
    (lambda: hard_concrete(LA, beta=0.0), ValueError, r"`beta` must be > 0.*got 0.0"),
    (lambda: hard_concrete(LA, gamma=0.1), ValueError, r"`gamma` must be < 0.*got 0.1"),
    (lambda: hard_concrete(LA, zeta=1.0), ValueError, r"`zeta` must be > 1.*got 1.0"),
    (lambda: hard_concrete(LA, rng=0), TypeError, r"`rng` must be a JAX PRNG key.*int"),
    (lambda: hard_concrete(LA, jnp.zeros(2)), TypeError, r"`rng` must be a JAX PRNG key.*float32"),
    (
        lambda: hard_concrete(LA, jax.random.split(jax.random.key(0), 3)),
        ValueError,
        r"`rng` must be a single PRNG key; got a key array of shape \(3,\)",
    ),
    (lambda: hard_concrete(LA, sample_shape=(2,)), ValueError, r"`sample_shape`.*needs `rng`"),
    (
        lambda: hard_concrete(LA, jax.random.key(0), sample_shape=(-1,)),
        ValueError,
        r"`sample_shape` must be a tuple of non-negative ints",
    ),
    (lambda: expected_l0(LA, zeta=0.5), ValueError, r"expected_l0: `zeta` must be > 1"),
    (lambda: l0_penalty(LA, beta=-1.0), ValueError, r"l0_penalty: `beta` must be > 0.*; got -1.0"),
    (lambda: l0_penalty(LA, reduction="max"), ValueError, r"`reduction` must be one of"),
    (lambda: l0_penalty([]), ValueError, r"`log_alpha` must be an array or a non-empty pytree"),
    (lambda: l0_penalty([LA, jnp.arange(2)]), TypeError, r"`log_alpha\[1\]` must have a floating"),
    (lambda: l1_penalty(LA), TypeError, r"from_logits"),
    (lambda: l1_penalty(LA, from_logits="yes"), TypeError, r"`from_logits` must be a bool"),
    (lambda: l1_penalty(jnp.arange(3), from_logits=True), TypeError, r"`weights_or_logits`.*int32"),
    (
        lambda: l1_penalty(jnp.zeros(0), from_logits=True, reduction="mean"),
        ValueError,
        r"zero entries",
    ),
    (
        lambda: expected_sparsity([LA, LA], [1.0]),
        ValueError,
        r"`weights` must have the same pytree",
    ),
    (
        lambda: expected_sparsity([LA, LA], [1.0, -1.0]),
        ValueError,
        r"`weights\[1\]` must be non-negative",
    ),
    (lambda: expected_sparsity(LA, jnp.zeros(3)), ValueError, r"total weight.*must be positive"),
    (lambda: expected_sparsity(jnp.zeros(0)), ValueError, r"total weight"),
    (
        lambda: expected_sparsity(LA, jnp.ones(2)),
        ValueError,
        r"`weights` with shape \(2,\) does not broadcast",
    ),
    (
        lambda: expected_sparsity(LA, jnp.ones(3, bool)),
        TypeError,
        r"`weights` must be real numbers",
    ),
    (
        lambda: lagrangian_sparsity(0.5, 1.5, 0.0, 0.0),
        ValueError,
        r"`target` must lie in \[0, 1\]; got 1.5",
    ),
    (lambda: lagrangian_sparsity(0.5, 0.5, jnp.int32(1), 0.0), TypeError, r"`lambda1`.*int32"),
    (lambda: lagrangian_sparsity(jnp.arange(2), 0.5, 0.0, 0.0), TypeError, r"`expected_sparsity`"),
    (
        lambda: sparsity_schedule(1, target=1.2, warmup_steps=10),
        ValueError,
        r"`target` must be in \[0, 1\]; got 1.2",
    ),
    (
        lambda: sparsity_schedule(1, target=0.5, warmup_steps=-1),
        ValueError,
        r"`warmup_steps` must be an int >= 0; got -1",
    ),
    (lambda: sparsity_schedule(1, target=0.5, warmup_steps=2.5), ValueError, r"`warmup_steps`"),
    (
        lambda: sparsity_schedule(1, target=0.5, warmup_steps=5, initial=-0.1),
        ValueError,
        r"`initial`",
    ),
    (lambda: sparsity_schedule(True, target=0.5, warmup_steps=5), TypeError, r"`step`"),
    (lambda: reviving_sparsemax(jnp.arange(3)), TypeError, r"`logits` must have a floating"),
    (lambda: reviving_sparsemax(jnp.float32(1.0)), ValueError, r"`logits` must have at least"),
    (
        lambda: reviving_sparsemax(jnp.zeros((2, 3)), axis=2),
        ValueError,
        r"`axis` must be an int in \[-2, 1\].*got 2",
    ),
]


@pytest.mark.parametrize("call,error,match", BAD_ARGUMENTS)
def test_bad_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_errors_raise_before_tracing():
    # Raised at trace time, i.e. before anything is compiled or run.
    with pytest.raises(ValueError, match="`beta`"):
        jax.jit(lambda la: hard_concrete(la, jax.random.key(0), beta=-1.0))(LA)


def test_public_api():
    assert sorted(gates.__all__) == [
        "expected_l0",
        "expected_sparsity",
        "hard_concrete",
        "l0_penalty",
        "l1_penalty",
        "lagrangian_sparsity",
        "reviving_sparsemax",
        "sigmoid_gate",
        "sparsity_schedule",
    ]
    for name in gates.__all__:
        assert ">>>" in getattr(gates, name).__doc__
