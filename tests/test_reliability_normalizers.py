"""Reliability of the normalizers: α near 1, non-finite scores, argument errors.

* α -> 1: values, d/dx, d/dα and the Fenchel–Young loss of α-entmax against a float64 reference
  (bisection on the threshold written as t = (1 + τ)/(α - 1), with log1p, so the reference itself
  keeps its digits as α -> 1; derivatives by central differences of it), on a grid of α down to
  1 + 1e-7. Everything runs jitted: XLA's algebraic simplifier only acts under jit.
* Non-finite scores, the policy of ``sparse_jax.normalizers`` (module docstring): NaN at an
  allowed position -> the row is NaN (values and gradients); masked values never matter; -inf is
  masked; +inf takes the row's weight, uniformly over the +inf entries. Checked with hypothesis
  for every normalizer, and for both attention engines, which must agree.
* Bad arguments raise errors that name the argument.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_jax as sj
from sparse_jax import masks
from sparse_jax.normalizers import masked_softmax, normalize
from tests.engines import assert_engine
from tests.reference import entmax15_ref, entmax_ref, sparsemax_ref

# ---------------------------------------------------------------------------------------------
# α near 1.
# ---------------------------------------------------------------------------------------------


def entmax_ref_near_one(x, alpha, iterations: int = 120):
    """float64 α-entmax of rows x (-inf masked): p_i = exp(log1p(ε (x_i - max - t)) / ε)."""
    x = np.asarray(x, np.float64)
    eps = np.asarray(alpha, np.float64) - 1.0
    eps = np.broadcast_to(eps, x.shape[:-1])[..., None]
    finite = np.isfinite(x)
    has_any = finite.any(-1, keepdims=True)
    x = np.where(has_any, x, 0.0)  # rows with nothing allowed: computed on zeros, returned as 0
    finite = np.where(has_any, finite, True)
    y = np.where(finite, x - np.max(np.where(finite, x, -np.inf), -1, keepdims=True), -np.inf)

    def powers(t):
        w = eps * (y - t)
        positive = w > -1
        log_u = np.log1p(np.where(positive, w, 0.0))
        return np.where(positive, np.exp(log_u / eps), 0.0)

    lo = np.zeros_like(eps)
    hi = -np.expm1(-eps * np.log(finite.sum(-1, keepdims=True))) / eps
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        above = powers(mid).sum(-1, keepdims=True) >= 1
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    p = powers(lo)
    return np.where(has_any, p / p.sum(-1, keepdims=True), 0.0)


def _loss_ref(x, labels, alpha):
    p = entmax_ref_near_one(x, alpha)
    eps = float(alpha) - 1.0
    theta = x - x.max(-1, keepdims=True)
    log_p = np.log(np.where(p > 0, p, 1.0))
    tsallis = -(p * np.expm1(eps * log_p)).sum(-1) / (float(alpha) * eps)
    label = np.take_along_axis(theta, labels[:, None], -1)[:, 0]
    return (p * theta).sum(-1) - label + tsallis


ALPHAS = [1 + 1e-7, 1 + 1e-6, 1 + 1e-5, 1 + 1e-4, 1.001, 1.01, 1.05, 1.1, 1.3, 1.7, 2.5]

_entmax_jit = jax.jit(sj.entmax)


@functools.cache
def _rows():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(12, 7)) * 2.5).astype(np.float32)
    x[0, 3] = -np.inf  # a masked entry
    x[1] = x[1, 0]  # ties
    return x, rng.normal(size=x.shape), np.arange(12) % 7


@pytest.mark.parametrize("alpha", ALPHAS)
def test_entmax_near_one_matches_float64_reference(alpha):
    x, cotangent, labels = _rows()
    alpha32 = float(np.float32(alpha))  # what an array α holds
    for a, a_ref in ((alpha, alpha), (jnp.full(12, alpha, jnp.float32), alpha32)):
        ref = entmax_ref_near_one(x, a_ref)
        p = np.asarray(_entmax_jit(jnp.asarray(x), a))
        np.testing.assert_allclose(p, ref, atol=4e-7)
        # d/dx: central differences of the reference (rows of 7, one entry at a time).
        grad = jax.jit(jax.grad(lambda v, a=a: jnp.sum(sj.entmax(v, a) * cotangent)))(x)
        numeric = np.zeros(x.shape)
        for j in range(x.shape[1]):
            step = np.zeros(x.shape[1])
            step[j] = 1e-6
            diff = entmax_ref_near_one(x + step, a_ref) - entmax_ref_near_one(x - step, a_ref)
            numeric[:, j] = (diff / 2e-6 * cotangent).sum(-1)
        numeric[~np.isfinite(x)] = 0.0
        np.testing.assert_allclose(np.asarray(grad), numeric, atol=1e-6)
    # d/dα, per row, against central differences (steps below α - 1).
    h = min((alpha32 - 1.0) / 10, 1e-5)
    grad_alpha = jax.jit(jax.grad(lambda a: jnp.sum(sj.entmax(x, a) * cotangent)))(
        jnp.full(12, alpha, jnp.float32)
    )
    diff = entmax_ref_near_one(x, alpha32 + h) - entmax_ref_near_one(x, alpha32 - h)
    numeric_alpha = (diff / (2 * h) * cotangent).sum(-1)
    np.testing.assert_allclose(np.asarray(grad_alpha), numeric_alpha, atol=2e-6, rtol=2e-5)
    # The Fenchel–Young loss: >= 0 and equal to the float64 loss; its α-derivative.
    loss = np.asarray(jax.jit(sj.entmax_loss, static_argnums=2)(x[1:], labels[1:], alpha))
    assert (loss >= 0).all()
    np.testing.assert_allclose(loss, _loss_ref(x[1:], labels[1:], alpha), atol=2e-6)
    dloss = jax.jit(jax.grad(lambda a: jnp.sum(sj.entmax_loss(x[1:], labels[1:], a))))(
        jnp.full(11, alpha, jnp.float32)
    )
    numeric_dloss = (
        _loss_ref(x[1:], labels[1:], alpha32 + h) - _loss_ref(x[1:], labels[1:], alpha32 - h)
    ) / (2 * h)
    np.testing.assert_allclose(np.asarray(dloss), numeric_dloss, atol=2e-6, rtol=2e-5)


def test_alpha_to_one_is_continuous_with_softmax():
    x, _, _ = _rows()
    soft = np.asarray(jax.nn.softmax(jnp.asarray(x)))
    # p = softmax + (α - 1) ∂p/∂α + ..., with |∂p/∂α| <~ 3 on these rows.
    for alpha in (1 + 1e-7, 1 + 1e-5, 1 + 1e-3):
        p = np.asarray(_entmax_jit(jnp.asarray(x), alpha))
        assert np.abs(p - soft).max() <= 3 * (alpha - 1) + 2e-7
    # The example of the reliability issue.
    p = _entmax_jit(jnp.array([1.0, 0.8, -1.0]), 1.0000001)
    np.testing.assert_allclose(p, jax.nn.softmax(jnp.array([1.0, 0.8, -1.0])), atol=3e-7)


# ---------------------------------------------------------------------------------------------
# Non-finite scores.
# ---------------------------------------------------------------------------------------------


def _softmax_ref(x):
    finite = np.isfinite(x)
    out = np.zeros(x.shape)
    for r, row in enumerate(np.asarray(x, np.float64)):
        if finite[r].any():
            e = np.exp(row[finite[r]] - row[finite[r]].max())
            out[r, finite[r]] = e / e.sum()
    return out


# name -> (function of (x, where), float64 reference of rows with -inf masked)
POLICY_CASES = {
    "softmax": (lambda x, w: normalize(x, w, "softmax"), _softmax_ref),
    "masked_softmax": (lambda x, w: masked_softmax(x, jnp.ones(x.shape, bool) & w), _softmax_ref),
    "sparsemax": (lambda x, w: sj.sparsemax(x, where=w), sparsemax_ref),
    "entmax15": (lambda x, w: sj.entmax15(x, where=w), entmax15_ref),
    "entmax-1.3": (lambda x, w: sj.entmax(x, 1.3, where=w), lambda r: entmax_ref(r, 1.3)),
    "entmax-1.01": (
        lambda x, w: sj.entmax(x, 1.01, where=w),
        lambda r: entmax_ref_near_one(r, 1.01),
    ),
    "entmax-2.5": (lambda x, w: sj.entmax(x, 2.5, where=w), lambda r: entmax_ref(r, 2.5)),
    "entmax-array": (
        lambda x, w: sj.entmax(x, jnp.array([1.02, 1.6, 2.2, 3.0], jnp.float32), where=w),
        lambda r: entmax_ref(r, np.float32([1.02, 1.6, 2.2, 3.0]).astype(np.float64)),
    ),
}


def policy_expectation(x, where, ref):
    """What the documented policy gives: NaN rows, +inf rows uniform, the rest by ``ref``."""
    x = np.where(where, x, -np.inf)
    nan_row = np.isnan(x).any(-1)
    inf_row = (x == np.inf).any(-1) & ~nan_row
    finite_rows = np.where(np.isnan(x) | (x == np.inf), 0.0, x)
    expected = ref(finite_rows)
    counts = np.maximum((x == np.inf).sum(-1, keepdims=True), 1)
    expected = np.where(inf_row[:, None], (x == np.inf) / counts, expected)
    return np.where(nan_row[:, None], np.nan, expected), nan_row


@st.composite
def nonfinite_rows(draw):
    """4 rows of 6 scores mixing finite values, ±inf and NaN, and a where mask."""
    kinds = st.sampled_from(["finite"] * 5 + ["-inf", "inf", "nan"])
    values = np.zeros((4, 6), np.float32)
    for i in range(4):
        for j in range(6):
            kind = draw(kinds)
            values[i, j] = {
                "finite": draw(st.floats(-30, 30, width=32)),
                "-inf": -np.inf,
                "inf": np.inf,
                "nan": np.nan,
            }[kind]
    where = np.asarray(draw(st.lists(st.booleans(), min_size=24, max_size=24))).reshape(4, 6)
    where |= draw(st.booleans())  # often everything allowed
    return values, where


_policy_jit = {
    name: (jax.jit(fn), jax.jit(jax.grad(lambda x, w, c, fn=fn: jnp.sum(fn(x, w) * c))))
    for name, (fn, _) in POLICY_CASES.items()
}


@pytest.mark.parametrize("name", list(POLICY_CASES))
@hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
@hypothesis.given(case=nonfinite_rows())
def test_nonfinite_policy_every_normalizer(name, case):
    x, where = case
    fn, grad_fn = _policy_jit[name]
    expected, nan_row = policy_expectation(x, where, POLICY_CASES[name][1])
    p = np.asarray(fn(jnp.asarray(x), jnp.asarray(where)))
    np.testing.assert_array_equal(np.isnan(p), np.isnan(expected))
    np.testing.assert_allclose(p[~nan_row], expected[~nan_row], atol=2e-6)
    # Masked values never matter, NaN included.
    poisoned = np.where(where, x, np.nan).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(poisoned), jnp.asarray(where))), p)
    # Gradients: finite on rows without an allowed NaN (zero on their masked entries), NaN on the
    # allowed entries of the others.
    cotangent = np.linspace(-1, 1, x.size, dtype=np.float32).reshape(x.shape)
    grad = np.asarray(grad_fn(jnp.asarray(x), jnp.asarray(where), jnp.asarray(cotangent)))
    assert np.isfinite(grad[~nan_row]).all()
    assert (grad[~nan_row[:, None] & ~where] == 0).all()
    nan_allowed = nan_row[:, None] & where
    assert np.isnan(grad[nan_allowed]).all()


ENGINE_NORMALIZERS = ["softmax", "sparsemax", "entmax15", 1.3, 1.02, "array"]
_ENGINE_MASK = masks.causal() & masks.local(5, 0)


def _attention(q, k, v, bias, normalizer, impl):
    if normalizer == "array":
        normalizer = jnp.array([1.3, 2.0], jnp.float32)
    return sj.attention(
        q, k, v, mask=_ENGINE_MASK, bias=bias, normalizer=normalizer, impl=impl, block_size=(4, 4)
    )


@functools.cache
def _engine_fns(normalizer):
    out = {}
    for impl in ("xla", "blocksparse"):
        fn = functools.partial(_attention, normalizer=normalizer, impl=impl)
        out[impl] = (
            jax.jit(fn),
            jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3))),
        )
    return out


@pytest.mark.parametrize("normalizer", ENGINE_NORMALIZERS)
def test_the_engines_compared_are_the_engines_named(normalizer):
    # The comparisons below are xla against blocksparse, not xla against itself.
    q = jnp.zeros((1, 12, 2, 4), jnp.float32)
    bias = jnp.zeros((1, 2, 12, 12), jnp.float32)
    for impl in ("xla", "blocksparse"):
        fn = functools.partial(_attention, normalizer=normalizer, impl=impl)
        assert_engine(impl, fn, q, q, q, bias)
        assert_engine(impl, jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2)), q, q, q, bias)


@st.composite
def poisoned_attention(draw):
    """q, k, v [1, 12, 2, 4] and a bias [1, 2, 12, 12] with a few non-finite entries."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    q, k, v = (rng.normal(size=(1, 12, 2, 4)).astype(np.float32) for _ in range(3))
    bias = rng.normal(size=(1, 2, 12, 12)).astype(np.float32)
    only_inf = draw(st.booleans())  # then no NaN anywhere: every gradient must be finite
    for _ in range(draw(st.integers(1, 4))):
        target = draw(st.sampled_from(["bias", "bias", "q", "k", "v"]))
        value = draw(st.sampled_from([np.inf, -np.inf] if only_inf else [np.inf, -np.inf, np.nan]))
        if target == "bias":
            bias[0, rng.integers(2), rng.integers(12), rng.integers(12)] = value
        elif not only_inf:
            array = {"q": q, "k": k, "v": v}[target]
            array[0, rng.integers(12), rng.integers(2), rng.integers(4)] = np.nan
    return q, k, v, bias, only_inf


@pytest.mark.parametrize("normalizer", ENGINE_NORMALIZERS)
@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(case=poisoned_attention())
def test_engines_agree_on_nonfinite_input(normalizer, case):
    q, k, v, bias, only_inf = case
    fns = _engine_fns(normalizer)
    outs = {impl: np.asarray(fwd(q, k, v, bias)) for impl, (fwd, _) in fns.items()}
    np.testing.assert_array_equal(np.isnan(outs["xla"]), np.isnan(outs["blocksparse"]))
    np.testing.assert_allclose(outs["xla"], outs["blocksparse"], atol=1e-5)
    # A row is NaN exactly when it is NaN in every head dim (never a partial NaN row).
    nan = np.isnan(outs["xla"])
    assert (nan.any(-1) == nan.all(-1)).all()
    if only_inf:
        for impl, (_, grad) in fns.items():
            for g in grad(q, k, v, bias):
                assert np.isfinite(np.asarray(g)).all(), impl


def test_nonfinite_in_attention_follows_the_policy():
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(1, 8, 2, 4)).astype(np.float32) for _ in range(3))
    causal = masks.causal()
    for normalizer in ["softmax", "sparsemax", "entmax15", 1.3]:
        for impl in ("xla", "blocksparse"):
            run = functools.partial(
                sj.attention, mask=causal, normalizer=normalizer, impl=impl, block_size=(4, 4)
            )
            assert_engine(impl, run, q, k, v)
            # A NaN query row: that row is NaN (never a silent zero), the others are not.
            clean = np.asarray(run(q, k, v))
            q_nan = q.copy()
            q_nan[0, 3, 0, 1] = np.nan
            out = np.asarray(run(q_nan, k, v))
            assert np.isnan(out[0, 3, 0]).all() and np.isfinite(out[0, :, 1]).all()
            others = np.arange(8) != 3
            np.testing.assert_allclose(out[0, others, 0], clean[0, others, 0])
            # +inf bias: all of the row's weight on that key.
            bias = np.zeros((1, 2, 8, 8), np.float32)
            bias[0, 0, 5, 2] = np.inf
            out = np.asarray(run(q, k, v, bias=bias))
            np.testing.assert_allclose(out[0, 5, 0], v[0, 2, 0], rtol=1e-6)
            # A NaN value at a key no row may attend to (causal: key 7 for rows < 7) reaches
            # only the rows that weigh it.
            v_nan = v.copy()
            v_nan[0, 7, 0, 0] = np.nan
            out = np.asarray(run(q, k, v_nan))
            np.testing.assert_allclose(out[0, :7], clean[0, :7], rtol=1e-6)


@pytest.mark.parametrize(
    "name,fn",
    [
        ("sparsemax", lambda x, w: sj.sparsemax(x, axis=0, where=w)),
        ("entmax15", lambda x, w: sj.entmax15(x, axis=0, where=w)),
        ("entmax 1.3", lambda x, w: sj.entmax(x, 1.3, axis=0, where=w)),
        ("entmax per row", lambda x, w: sj.entmax(x, jnp.array([1.2, 1.7, 2.5]), axis=0, where=w)),
        ("masked_softmax", lambda x, w: masked_softmax(x.T, w.T).T),
    ],
)
def test_masking_under_debug_infs_called_eagerly(name, fn):
    # The mask's -inf is an intermediate of one compiled call: jax.debug_infs, which checks
    # every primitive run eagerly, sees only its finite output. Rows along axis 0 here, so that
    # the normalized axis is moved inside the call too.
    x = jax.random.normal(jax.random.key(5), (4, 3))
    where = jnp.array([[1, 0, 1], [0, 0, 1], [1, 0, 0], [1, 0, 1]], bool)  # column 1: none allowed
    with jax.debug_infs(True):
        p = fn(x, where)
        grad = jax.grad(lambda x: jnp.sum(fn(x, where) * jnp.arange(4.0)[:, None]))(x)
    assert np.isfinite(np.asarray(p)).all() and np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(np.asarray(p)[:, 1], 0.0)
    np.testing.assert_array_equal(np.asarray(grad)[:, 1], 0.0)
    np.testing.assert_allclose(np.asarray(p).sum(axis=0), [1.0, 0.0, 1.0], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(p)[~np.asarray(where)], 0.0)


# ---------------------------------------------------------------------------------------------
# Bad arguments.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: sj.sparsemax(jnp.ones((2, 0))), ValueError, r"`x`.*\(2, 0\).*empty axis 1"),
        (lambda: sj.entmax15(jnp.ones((0,))), ValueError, r"`x`.*\(0,\)"),
        (lambda: sj.entmax(jnp.ones((3, 0)), 1.3), ValueError, r"`x`.*\(3, 0\)"),
        (lambda: sj.entmax_loss(jnp.ones((2, 0)), jnp.zeros(2, int), 1.3), ValueError, "logits"),
        (lambda: sj.entmax(jnp.ones(3), "1.5"), TypeError, "alpha"),
        (lambda: sj.entmax(jnp.ones(3), None), TypeError, "alpha"),
        (lambda: sj.entmax(jnp.ones(3), float("inf")), ValueError, "alpha.*finite"),
        (lambda: sj.entmax(jnp.ones(3), float("nan")), ValueError, "alpha"),
        (lambda: sj.entmax(jnp.ones((2, 3)), jnp.array([1.5, jnp.inf])), ValueError, "alpha"),
        (lambda: sj.entmax_loss(jnp.ones((2, 3)), jnp.zeros(2, int), np.inf), ValueError, "alpha"),
        (lambda: sj.sparsemax("abc"), TypeError, "`x`"),
        (lambda: sj.sparsemax(jnp.ones(3), axis="0"), TypeError, "axis"),
        (lambda: sj.sparsemax(jnp.ones(3), where="yes"), TypeError, "where"),
        (lambda: normalize(jnp.ones((2, 3)), None, "relu"), ValueError, "normalizer.*relu"),
        (lambda: normalize(jnp.ones((2, 3)), None, float("inf")), ValueError, "normalizer"),
        (lambda: normalize(jnp.ones((2, 0)), None, "softmax"), ValueError, r"`s`.*\(2, 0\)"),
        (lambda: masked_softmax(jnp.ones(3), jnp.ones(3)), TypeError, "allowed.*boolean"),
        (lambda: masked_softmax(jnp.ones(3, int), jnp.ones(3, bool)), TypeError, "`s`"),
        (
            lambda: sj.attention(*(jnp.ones((1, 4, 1, 2)),) * 3, normalizer=float("inf")),
            ValueError,
            "normalizer",
        ),
    ],
)
def test_bad_arguments_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_integers_are_integers():
    x = jax.random.normal(jax.random.key(0), (3, 4))
    for axis in (np.int64(0), np.int32(-1), np.array(1)):
        np.testing.assert_array_equal(sj.sparsemax(x, axis=axis), sj.sparsemax(x, axis=int(axis)))
        expected = sj.entmax(x, 1.3, axis=int(axis))
        np.testing.assert_array_equal(sj.entmax(x, 1.3, axis=axis), expected)
    np.testing.assert_array_equal(sj.entmax(x, np.float64(1.3)), sj.entmax(x, 1.3))
    labels = np.array([0, 1, 2], np.int64)
    np.testing.assert_allclose(sj.sparsemax_loss(x, labels), sj.sparsemax_loss(x, labels.tolist()))
