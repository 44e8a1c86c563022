"""One rule for α, the same in ``entmax``, the losses and every attention engine, eager or traced:
α > 1 is α-entmax, α = 1 exactly is softmax, α < 1 or non-finite gives NaN rows when traced
(and raises by name when concrete; ``checkify`` turns the traced case into an error). Also the
Fenchel–Young losses at a -inf or out-of-range label, and ``random_blocks``' seed range."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify

import sparse_jax as sj
from sparse_jax import masks
from sparse_jax.normalizers import enable_traced_checks

# One α per head: entmax15, softmax, two that break the rule, sparsemax.
ALPHA = np.array([1.5, 1.0, 0.5, np.nan, 2.0], np.float32)
GOOD = np.isfinite(ALPHA) & (ALPHA >= 1.0)


def _reference(s, where):
    """Each good head's rows by jax.nn.softmax or the exact entmax15/sparsemax (head axis 0);
    the other heads' rows are left as the scores."""
    rows = {1.0: jax.nn.softmax, 1.5: sj.entmax15, 2.0: sj.sparsemax}
    return jnp.stack(
        [
            rows[float(a)](s[h], axis=-1, where=where) if GOOD[h] else s[h]
            for h, a in enumerate(ALPHA)
        ]
    )


def _check_rows(p, reference, head_axis):
    """Rows of good heads equal the reference (α = 1: softmax); the others are NaN."""
    for h, alpha in enumerate(ALPHA):
        got = np.take(np.asarray(p), h, axis=head_axis)
        if GOOD[h]:
            want = np.take(np.asarray(reference), h, axis=head_axis)
            np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"head {h}, α = {alpha}")
        else:
            assert np.isnan(got).all(), f"head {h}, α = {alpha}: not NaN rows"


def test_entmax_follows_the_rule_for_a_traced_alpha_per_head():
    x = 3.0 * jax.random.normal(jax.random.key(0), (5, 3, 12))  # [heads, rows, keys]
    weights = jnp.arange(12.0)

    def f(x, alpha):
        p = sj.entmax(x, alpha[:, None])
        return jnp.sum(jnp.where(GOOD[:, None, None], p, 0.0) * weights), p

    @jax.jit
    def run(x, alpha):
        (_, p), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(x, alpha)
        softmax_dx = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * weights))(x[1])
        return p, grads, _reference(x, None), softmax_dx

    p, (dx, dalpha), reference, softmax_dx = run(x, jnp.asarray(ALPHA))
    _check_rows(p, reference, 0)
    assert np.isfinite(np.asarray(dx)[GOOD]).all() and np.isfinite(np.asarray(dalpha)[GOOD]).all()
    np.testing.assert_allclose(dx[1], softmax_dx, atol=2e-6)  # d/dx at α = 1: softmax's
    # dα at α = 1 is the limit from above: against differences at 1, 1 + h, 1 + 2h.
    h = 1e-3
    value = jax.jit(lambda a: jnp.sum(sj.entmax(x[1], a) * weights))
    at = [value(jnp.float32(1.0 + i * h)) for i in range(3)]
    extrapolated = (4 * at[1] - 3 * at[0] - at[2]) / (2 * h)  # one-sided, second order
    np.testing.assert_allclose(dalpha[1], extrapolated, rtol=1e-2)


def test_a_concrete_alpha_of_one_is_softmax_and_a_concrete_bad_alpha_raises():
    x = jnp.array([[2.0, 0.5, -1.0, -jnp.inf], [0.0, 0.0, 1.0, 3.0]])
    # Concrete α (a python float, a numpy array) inside a jit is checked as it is traced.
    p_float, p_array = jax.jit(
        lambda x: (sj.entmax(x, 1.0), sj.entmax(x, np.array([1.0, 2.0], np.float32)))
    )(x)
    np.testing.assert_allclose(p_float, jax.nn.softmax(x), atol=1e-7)
    np.testing.assert_allclose(p_array[0], jax.nn.softmax(x[0]), atol=1e-7)
    np.testing.assert_allclose(p_array[1], sj.sparsemax(x[1]), atol=1e-7)
    for bad in (0.5, float("nan"), float("inf"), jnp.array([1.5, 0.999]), jnp.array([jnp.nan, 2])):
        with pytest.raises(ValueError, match=r"entmax: .*`alpha` must be finite and >= 1"):
            sj.entmax(x, bad)
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"attention: `normalizer` α must be finite and >= 1"):
        sj.attention(q, q, q, normalizer=-3.0)
    with pytest.raises(ValueError, match=r"attention: every α of `normalizer` must be finite"):
        sj.attention(q, q, q, normalizer=jnp.array([1.0, jnp.inf]))
    # A python float α = 1 reaches the engines as softmax itself.
    assert sj.validation.check_normalizer(1.0, 2, "test") == "softmax"


@functools.cache
def _attention_case(t: int = 16, d: int = 8):
    """q, k, v ``[1, t, heads, d]`` and the reference output of each good head (dense scores
    under a causal mask, that head's own normalizer, then p @ v)."""
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (1, t, len(ALPHA), d)) for key in keys)

    @jax.jit
    def reference(q, k, v):
        s = jnp.einsum("bqnd,bknd->nbqk", q, k) * d**-0.5
        p = _reference(s, np.tril(np.ones((t, t), bool)))
        return jnp.einsum("nbqk,bknd->bqnd", p, v)

    return q, k, v, reference(q, k, v)


@pytest.mark.parametrize("impl", ["xla", "blocksparse", "pallas"])
def test_every_engine_follows_the_rule_for_a_traced_alpha_per_head(impl):
    q, k, v, reference = _attention_case()
    options = {} if impl == "xla" else {"block_size": (16, 16)}
    good = jnp.asarray(GOOD)[None, None, :, None]

    def f(q, k, v, alpha):
        out = sj.attention(q, k, v, mask=masks.causal(), normalizer=alpha, impl=impl, **options)
        return jnp.sum(jnp.where(good, out, 0.0) ** 2), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2, 3), has_aux=True))(
        q, k, v, jnp.asarray(ALPHA)
    )
    _check_rows(out, reference, 2)
    # The bad heads' outputs take no part in the loss, yet their gradients are NaN, the same in
    # every engine (the Pallas kernels gave dα = 0 there).
    for grad in grads[:3]:  # dq, dk, dv [B, T, N, D]
        assert np.isfinite(np.asarray(grad)[:, :, GOOD]).all()
        assert np.isnan(np.asarray(grad)[:, :, ~GOOD]).all()
    assert np.isfinite(np.asarray(grads[3])[GOOD]).all()  # dα
    assert np.isnan(np.asarray(grads[3])[~GOOD]).all()


@pytest.fixture
def traced_checks():
    previous = enable_traced_checks(True)
    yield
    enable_traced_checks(previous)


def test_traced_checks_are_off_by_default_so_programs_stay_the_same():
    # A check's error code is numbered per process: a program holding one would differ at
    # each trace and never hit jax's persistent compilation cache.
    def lowered():
        f = jax.jit(lambda a, x, y: sj.entmax(x, a) + sj.sparsemax_loss(x, y)[..., None])
        return f.lower(jnp.ones(2) * 1.5, jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32)).as_text()

    assert lowered() == lowered()
    previous = enable_traced_checks(True)
    try:
        assert lowered() != lowered()  # what the default avoids
    finally:
        enable_traced_checks(previous)
    with pytest.raises(TypeError, match=r"`enabled` must be True or False; got 'yes'"):
        enable_traced_checks("yes")


def test_checkify_reports_a_traced_bad_alpha_and_is_silent_otherwise(traced_checks):
    q = jax.random.normal(jax.random.key(2), (1, 8, 2, 8))
    f = jax.jit(lambda alpha: sj.attention(q, q, q, mask=masks.causal(), normalizer=alpha))
    checked = checkify.checkify(f)
    error, _ = checked(jnp.array([1.5, -3.0]))
    with pytest.raises(checkify.JaxRuntimeError, match=r"every α must be finite and >= 1.*-3\.0"):
        error.throw()
    assert checked(jnp.array([1.0, 1.5]))[0].get() is None
    assert np.isnan(np.asarray(f(jnp.array([1.5, -3.0])))[:, :, 1]).all()  # un-checkified: NaN


LOSSES = {
    "sparsemax_loss": sj.sparsemax_loss,
    "entmax15_loss": sj.entmax15_loss,
    "entmax_loss(1.25)": lambda x, y, **kw: sj.entmax_loss(x, y, 1.25, **kw),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_are_inf_at_a_minus_inf_label_and_nan_at_a_traced_out_of_range_one(
    name, traced_checks
):
    loss = LOSSES[name]
    x = jnp.array([[1.0, -jnp.inf, 0.0]] * 5).at[4].set(-jnp.inf)  # row 4: nothing finite
    labels = jnp.array([0, 1, 3, -1, 1])
    padding = jnp.array([True, True, False, False, True])

    def f(x, labels, where):
        values = loss(x, labels, where=where)
        return jnp.sum(jnp.where(jnp.isnan(values), 0.0, values)), values

    run = jax.jit(jax.value_and_grad(f, has_aux=True))
    error, ((_, values), grad) = checkify.checkify(run)(x, labels, None)
    # -inf at the label: +inf (probability 0), gradient p - onehot(y), finite.
    assert values[1] == jnp.inf and values[4] == jnp.inf and np.isfinite(values[0])
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(np.asarray(grad[1]).sum(), 0.0, atol=1e-6)
    assert grad[1, 1] == -1.0
    # Out of range under jit: NaN (not wrapped to the last class, not filled), zero gradient.
    assert np.isnan(values[2]) and np.isnan(values[3])
    assert (np.asarray(grad)[2:4] == 0).all()
    with pytest.raises(checkify.JaxRuntimeError, match=r"every label must lie in \[0, 3\); got 3"):
        error.throw()
    # Padding rows may hold any label, traced or concrete; eager out-of-range labels raise.
    (_, padded), _ = run(x, labels, padding)
    np.testing.assert_array_equal(padded, [values[0], jnp.inf, 0.0, 0.0, jnp.inf])
    with pytest.raises(ValueError, match=r"_loss: `labels` must lie in \[0, 3\).*\[-1, 3\]"):
        loss(x, labels)
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, 3\).*\[-1, 1\]"):
        loss(x, labels, where=jnp.array([True, True, False, True, True]))


def test_entmax_loss_at_alpha_one_is_cross_entropy_and_nan_where_alpha_breaks_the_rule():
    x = jax.random.normal(jax.random.key(3), (5, 6))
    labels = jnp.arange(5)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(x, labels)
    at_one, traced = jax.jit(
        lambda x, alpha: (sj.entmax_loss(x, labels, 1.0), sj.entmax_loss(x, labels, alpha))
    )(x, jnp.asarray(ALPHA))
    np.testing.assert_allclose(at_one, cross_entropy, rtol=1e-6)
    np.testing.assert_allclose(traced[1], cross_entropy[1], rtol=1e-6)
    assert np.isnan(traced[~GOOD]).all() and np.isfinite(traced[GOOD]).all()


@pytest.mark.parametrize("seed", [2**100 + 5, 2**32 + 5, 2**31, -(2**31) - 1])
def test_random_blocks_refuses_seeds_outside_the_hash_range(seed):
    match = rf"random_blocks: `seed` .*\[-2\*\*31, 2\*\*31\).*got seed={seed}$"
    with pytest.raises(ValueError, match=match):
        masks.random_blocks(0.5, 4, seed=seed)


def test_random_blocks_seeds_of_the_range_give_their_own_patterns():
    seeds = (0, 5, -5, 2**31 - 1, -(2**31))
    patterns = [masks.random_blocks(0.5, 1, seed=seed).dense(32, 32) for seed in seeds]
    for i in range(len(seeds)):
        for j in range(i):
            assert (patterns[i] != patterns[j]).any(), (seeds[i], seeds[j])
