"""Tests of the normalizers and Fenchel–Young losses in ``sparse_jax.normalizers``.

Exactness is checked against the float64 sort-based references in ``tests/reference.py``;
properties (non-negativity, sums, masking, shift invariance) with hypothesis; derivatives with
``jax.test_util.check_grads`` in float64.
"""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import sparse_jax as sj
from experiments.bench.passes import sorted_threshold
from tests.reference import entmax15_ref, entmax_ref, sparsemax_ref

# Jitted once per (function, shape, dtype): hypothesis varies lengths, so rows are padded to a
# power of two with masked (-inf) entries, which also exercises masking on every example.
_sparsemax = jax.jit(sj.sparsemax)
_entmax15 = jax.jit(sj.entmax15)
_entmax = jax.jit(sj.entmax)

NORMALIZERS = {
    "sparsemax": (lambda x: _sparsemax(x), sparsemax_ref),
    "entmax15": (lambda x: _entmax15(x), entmax15_ref),
    "entmax-1.3": (
        lambda x: _entmax(x, jnp.float32(1.3)),
        functools.partial(entmax_ref, alpha=1.3),
    ),
    "entmax-2.5": (
        lambda x: _entmax(x, jnp.float32(2.5)),
        functools.partial(entmax_ref, alpha=2.5),
    ),
    "entmax-array2": (lambda x: _entmax(x, jnp.float32(2.0)), sparsemax_ref),
    "entmax-array1.5": (lambda x: _entmax(x, jnp.float32(1.5)), entmax15_ref),
}

SCALES = [1e-6, 1e-3, 1.0, 30.0, 1e4]


@st.composite
def score_rows(draw):
    """A batch of 3 rows of one length n in [1, 4096], padded with -inf to a power of two.

    Rows mix Gaussian scores at a drawn magnitude, optional rounding (ties), optional masked
    entries, and one row that is entirely masked when ``all_masked`` is drawn.
    """
    n = draw(st.one_of(st.integers(1, 64), st.integers(65, 4096)))
    scale = draw(st.sampled_from(SCALES))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(3, n)) * scale
    if draw(st.booleans()):  # ties: a handful of distinct values
        rows = np.round(rows / scale * 2) * scale / 2
    if draw(st.booleans()):  # masked entries, never all of a row
        masked = rng.random((3, n)) < draw(st.floats(0.0, 0.9))
        masked[:, rng.integers(n)] = False
        rows[masked] = -np.inf
    if draw(st.booleans()):
        rows[2] = -np.inf
    width = 1 << (n - 1).bit_length()
    padded = np.full((3, width), -np.inf)
    padded[:, :n] = rows
    return padded.astype(np.float32)


def _check_distribution(p, x, atol):
    p = np.asarray(p, np.float64)
    allowed = np.isfinite(x)
    assert (p >= 0).all()
    assert (p[~allowed] == 0).all(), "masked entries must be exactly zero"
    has_any = allowed.any(-1)
    np.testing.assert_allclose(p.sum(-1)[has_any], 1.0, atol=atol)
    assert (p[~has_any] == 0).all(), "fully masked rows must be all zeros"
    assert np.isfinite(p).all()


@pytest.mark.parametrize("name", list(NORMALIZERS))
@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(x=score_rows())
def test_matches_sort_reference_and_is_a_distribution(name, x):
    fn, ref = NORMALIZERS[name]
    p = np.asarray(fn(jnp.asarray(x)))
    _check_distribution(p, x, atol=2e-5)
    # The reference is exact in float64 on the float32 inputs: 1e-6 is a few float32 roundings
    # of probabilities <= 1, for rows of up to 4096 entries and magnitudes up to 1e4.
    np.testing.assert_allclose(p, ref(x), atol=1e-6)


@pytest.mark.parametrize("name", list(NORMALIZERS))
@hypothesis.settings(max_examples=10, deadline=None, derandomize=True)
@hypothesis.given(x=score_rows(), shift=st.sampled_from([-1e3, -3.0, 0.5, 100.0]))
def test_invariant_to_adding_a_constant(name, x, shift):
    fn, _ = NORMALIZERS[name]
    finite = x[np.isfinite(x)]
    hypothesis.assume(finite.size == 0 or np.abs(finite).max() < 1e3)
    p = np.asarray(fn(jnp.asarray(x)))
    p_shifted = np.asarray(fn(jnp.asarray(x + np.float32(shift))))
    # Shifting a float32 score by c changes its rounding by ~|c| * 2^-24.
    np.testing.assert_allclose(p_shifted, p, atol=1e-5 * max(1.0, abs(shift)))


@hypothesis.settings(max_examples=10, deadline=None, derandomize=True)
@hypothesis.given(x=score_rows())
def test_bfloat16_and_float16_inputs_compute_in_float32(x):
    for dtype in (jnp.bfloat16, jnp.float16):
        low = jnp.asarray(np.clip(x, -6e4, 6e4), dtype)
        exact = np.asarray(low.astype(jnp.float32))
        for fn, ref in (
            (_sparsemax, sparsemax_ref),
            (_entmax15, entmax15_ref),
            (lambda v: _entmax(v, jnp.float32(1.7)), functools.partial(entmax_ref, alpha=1.7)),
        ):
            p = fn(low)
            assert p.dtype == dtype
            # One rounding of the result to the low-precision dtype, nothing more.
            np.testing.assert_allclose(np.asarray(p, np.float64), ref(exact), atol=1e-2, rtol=1e-2)
            _check_distribution(p, exact, atol=2e-2)


def test_special_alphas_agree_exactly_with_closed_forms():
    x = jax.random.normal(jax.random.key(0), (4, 6, 300)) * 3
    np.testing.assert_array_equal(sj.entmax(x, 2.0), sj.sparsemax(x))
    np.testing.assert_array_equal(sj.entmax(x, 1.5), sj.entmax15(x))
    np.testing.assert_allclose(sj.entmax(x, jnp.array(2.0)), sj.sparsemax(x), atol=1e-6)
    np.testing.assert_allclose(sj.entmax(x, jnp.array(1.5)), sj.entmax15(x), atol=1e-6)


def test_alpha_towards_one_approaches_softmax():
    x = jax.random.normal(jax.random.key(1), (8, 50))
    soft = jax.nn.softmax(x)
    errors = [float(jnp.abs(sj.entmax(x, a) - soft).max()) for a in (1.5, 1.1, 1.01, 1.001)]
    assert errors == sorted(errors, reverse=True), errors
    assert errors[-1] < 2e-3, errors


def test_known_values():
    x = jnp.array([1.0, 0.8, -1.0])
    np.testing.assert_allclose(sj.sparsemax(x), [0.6, 0.4, 0.0], atol=1e-7)
    # 1.5-entmax: z = x/2 - 1/2 = [0, -0.1, -1]; t² + (t - 0.1)² = 1 gives t = (0.2 + √7.96)/4.
    t = (0.2 + np.sqrt(7.96)) / 4
    np.testing.assert_allclose(sj.entmax15(x), [t**2, (t - 0.1) ** 2, 0.0], atol=1e-7)
    # Ties and one-hot outputs.
    np.testing.assert_array_equal(sj.sparsemax(jnp.array([3.0, 1.0, 1.0])), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(sj.entmax15(jnp.array([1.0, 1.0, -1.0])), [0.5, 0.5, 0.0], atol=1e-7)


def test_huge_scores_ties_and_minus_inf():
    x = jnp.array([[1e4, 1e4 - 0.5, -1e4, -jnp.inf], [1e4, 1e4, 1e4, 1e4]])
    for fn in (sj.sparsemax, sj.entmax15, lambda v: sj.entmax(v, 1.2)):
        p = np.asarray(fn(x))
        assert np.isfinite(p).all()
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
        np.testing.assert_allclose(p[1], 0.25, atol=1e-6)
        assert p[0, 2] == 0 and p[0, 3] == 0
    np.testing.assert_allclose(sj.sparsemax(x)[0], [0.75, 0.25, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize(
    "fn",
    [sj.sparsemax, sj.entmax15, lambda x, where=None: sj.entmax(x, 1.3, where=where)],
    ids=["sparsemax", "entmax15", "entmax-1.3"],
)
def test_where_mask_and_fully_masked_rows_have_zero_values_and_gradients(fn):
    x = jax.random.normal(jax.random.key(2), (3, 7))
    where = jnp.array([[True] * 7, [True, False] * 3 + [True], [False] * 7])
    p = fn(x, where=where)
    assert (p[~where] == 0).all()
    np.testing.assert_array_equal(p[2], 0.0)
    np.testing.assert_allclose(p[:2].sum(-1), 1.0, atol=1e-6)
    # The same through -inf scores.
    np.testing.assert_array_equal(fn(jnp.where(where, x, -jnp.inf)), p)
    cotangent = jax.random.normal(jax.random.key(3), x.shape)
    grad = jax.grad(lambda v: jnp.sum(fn(v, where=where) * cotangent))(x)
    assert np.isfinite(grad).all()
    assert (grad[~where] == 0).all()
    grad_inf = jax.grad(lambda v: jnp.sum(fn(jnp.where(where, v, -jnp.inf)) * cotangent))(x)
    assert np.isfinite(grad_inf).all()
    np.testing.assert_array_equal(grad_inf[2], 0.0)


def test_alpha_gradient_on_fully_masked_row_is_zero():
    x = jnp.full((2, 5), -jnp.inf).at[0].set(jnp.arange(5.0))
    g = jax.grad(lambda a: jnp.sum(sj.entmax(x, a) * jnp.arange(5.0)))(jnp.array([1.4, 1.4]))
    assert np.isfinite(g).all() and g[1] == 0 and g[0] != 0


def test_axis_and_per_head_alpha():
    scores = jax.random.normal(jax.random.key(4), (2, 3, 5, 6))  # [batch, heads, q, kv]
    alpha = jnp.array([1.2, 1.5, 2.0])[:, None]  # one α per head: [heads, 1]
    p = sj.entmax(scores, alpha)
    for h, a in enumerate([1.2, 1.5, 2.0]):
        np.testing.assert_allclose(p[:, h], entmax_ref(np.asarray(scores[:, h]), a), atol=1e-6)
    # A different axis is the same as moving that axis last.
    q = sj.entmax(scores, 1.3, axis=2)
    np.testing.assert_allclose(q, jnp.moveaxis(sj.entmax(jnp.moveaxis(scores, 2, -1), 1.3), -1, 2))
    np.testing.assert_allclose(
        sj.sparsemax(scores, axis=1), jnp.moveaxis(sj.sparsemax(jnp.moveaxis(scores, 1, -1)), -1, 1)
    )


@pytest.mark.parametrize("alphas", [(1.2, 1.7, 2.5), (1.2, 1.0001, 2.5), (1.02, 1.0001, 1.04)])
def test_per_head_alpha_gives_each_head_what_its_alpha_gives_alone(alphas):
    # An array α holds every row's threshold in one form when none needs σ (α within 0.05 of
    # 1), the rows' own forms otherwise; either way each head is what its float α gives.
    scores = jax.random.normal(jax.random.key(7), (2, 3, 4, 40)) * 3  # [batch, heads, q, kv]
    where = jnp.arange(40) < jnp.array([40, 25])[:, None, None, None]  # padding
    per_head = jax.jit(sj.entmax)(scores, jnp.array(alphas)[:, None], where=where)
    for h, a in enumerate(alphas):
        alone = sj.entmax(scores[:, h], a, where=where[:, 0])
        np.testing.assert_allclose(per_head[:, h], alone, atol=1e-6, rtol=0)  # τ for 1.0001: 3e-5


def test_composes_with_jit_vmap_and_grad():
    x = jax.random.normal(jax.random.key(5), (4, 9)) * 2
    g = jax.random.normal(jax.random.key(6), (4, 9))
    for fn in (sj.sparsemax, sj.entmax15, lambda v: sj.entmax(v, 1.7)):
        chex.assert_trees_all_close(jax.vmap(fn)(x), fn(x), atol=1e-7)
        chex.assert_trees_all_close(jax.jit(fn)(x), fn(x), atol=1e-7)
        loss = lambda v, fn=fn: jnp.sum(fn(v) * g)
        per_row = jax.vmap(jax.grad(lambda v, c, fn=fn: jnp.sum(fn(v) * c)))(x, g)
        chex.assert_trees_all_close(jax.jit(jax.grad(loss))(x), per_row, atol=1e-6)
    # vmap over rows with a per-row α, and the α gradient under jit.
    alphas = jnp.linspace(1.2, 2.5, 4)
    chex.assert_trees_all_close(jax.vmap(sj.entmax)(x, alphas), sj.entmax(x, alphas), atol=1e-6)
    grad_alpha = jax.jit(jax.grad(lambda a: jnp.sum(sj.entmax(x, a) * g)))(alphas)
    chex.assert_shape(grad_alpha, (4,))
    chex.assert_tree_all_finite(grad_alpha)


# ---------------------------------------------------------------------------------------------
# Derivatives, checked numerically in float64. Scores are spread out so that no entry sits
# within the finite-difference step of the support boundary (where the derivative jumps).
# ---------------------------------------------------------------------------------------------


def _spread_scores(key, shape):
    base = jax.random.permutation(key, jnp.arange(np.prod(shape), dtype=jnp.float64))
    return (base.reshape(shape) * 0.37) % 3.1 + 0.013 * jnp.arange(shape[-1])


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_check_grads_normalizers(x64):
    x = _spread_scores(jax.random.key(7), (3, 8))
    where = jnp.ones((3, 8), bool).at[1, 2].set(False).at[2].set(False)
    # Every normalizer has a custom VJP (reverse mode only, by design).
    for fn in (
        sj.sparsemax,
        lambda v: sj.sparsemax(v, where=where),
        sj.entmax15,
        lambda v: sj.entmax(v, 1.3),
        lambda v: sj.entmax(v, 2.6),
        lambda v: sj.entmax15(v, where=where),
        lambda v: sj.entmax(v, 1.7, where=where),
    ):
        check_grads(fn, (x,), order=1, modes=("rev",), eps=1e-6, atol=1e-5, rtol=1e-5)


def test_forward_mode_is_refused_as_documented():
    x = jnp.array([0.3, -0.2, 1.0])
    for fn in (sj.sparsemax, sj.entmax15, lambda v: sj.entmax(v, 1.3)):
        with pytest.raises(TypeError, match="custom_vjp"):
            jax.jvp(fn, (x,), (jnp.ones(3),))


def test_check_grads_alpha(x64):
    x = _spread_scores(jax.random.key(8), (2, 3, 7))  # [batch, heads, kv]
    alpha = jnp.array([1.25, 1.6, 2.4])[None, :]  # per head, broadcast over the batch
    check_grads(lambda a: sj.entmax(x, a), (alpha,), order=1, modes=("rev",), eps=1e-6)
    check_grads(lambda v, a: sj.entmax(v, a), (x, alpha), order=1, modes=("rev",), eps=1e-6)
    # With masked entries and a fully masked row the α gradient stays exact and finite.
    masked = x.at[0, 1, :3].set(-jnp.inf).at[1, 2].set(-jnp.inf)
    check_grads(lambda a: sj.entmax(masked, a), (alpha,), order=1, modes=("rev",), eps=1e-6)


def test_check_grads_losses(x64):
    logits = _spread_scores(jax.random.key(9), (4, 6))
    labels = jnp.array([0, 3, 5, 2])
    alpha = jnp.array([1.3, 1.5, 1.9, 2.2])
    for fn in (
        lambda v: sj.sparsemax_loss(v, labels),
        lambda v: sj.entmax15_loss(v, labels),
        lambda v: sj.entmax_loss(v, labels, 1.4),
        lambda v: sj.entmax_loss(v, labels, alpha),
    ):
        check_grads(fn, (logits,), order=1, modes=("fwd", "rev"), eps=1e-6, atol=1e-5)
    check_grads(lambda a: sj.entmax_loss(logits, labels, a), (alpha,), order=1, eps=1e-6)


# ---------------------------------------------------------------------------------------------
# Fenchel–Young losses.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss_fn", "norm_fn"),
    [
        (sj.sparsemax_loss, sj.sparsemax),
        (sj.entmax15_loss, sj.entmax15),
        (lambda z, y, **kw: sj.entmax_loss(z, y, 1.3, **kw), lambda z: sj.entmax(z, 1.3)),
    ],
    ids=["sparsemax", "entmax15", "entmax-1.3"],
)
def test_loss_gradient_is_p_minus_onehot_and_padding_is_ignored(loss_fn, norm_fn):
    logits = jax.random.normal(jax.random.key(10), (5, 11)) * 3
    labels = jnp.array([0, 4, 10, 3, 3])
    where = jnp.array([True, True, False, True, True])
    losses = loss_fn(logits, labels, where=where)
    assert (losses >= -1e-6).all() and losses[2] == 0
    grad = jax.grad(lambda z: jnp.sum(loss_fn(z, labels, where=where)))(logits)
    expected = (norm_fn(logits) - jax.nn.one_hot(labels, 11)) * where[:, None]
    np.testing.assert_allclose(grad, expected, atol=1e-6)
    # A padding row full of NaN does not leak into the loss or the gradient.
    poisoned = logits.at[2].set(jnp.nan)
    assert np.isfinite(loss_fn(poisoned, labels, where=where)).all()
    assert np.isfinite(jax.grad(lambda z: jnp.sum(loss_fn(z, labels, where=where)))(poisoned)).all()


def test_sparsemax_loss_equals_optax_multiclass_and_is_zero_at_onehot():
    logits = jax.random.normal(jax.random.key(11), (6, 9)) * 2
    labels = jnp.arange(6) % 9
    np.testing.assert_allclose(
        sj.sparsemax_loss(logits, labels),
        optax.losses.multiclass_sparsemax_loss(logits, labels),
        atol=1e-5,
    )
    separated = jnp.array([[5.0, 0.0, -1.0]])
    for loss in (sj.sparsemax_loss, sj.entmax15_loss, lambda z, y: sj.entmax_loss(z, y, 1.2)):
        assert abs(float(loss(separated * 10, jnp.array([0]))[0])) < 1e-6
        assert float(loss(separated, jnp.array([2]))[0]) > 1.0


def test_losses_with_labels_closed_over_under_jit():
    labels = jnp.array([0, 1])
    out = jax.jit(lambda z: sj.sparsemax_loss(z, labels))(jnp.zeros((2, 3)))
    np.testing.assert_allclose(out, 1 / 3, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: sj.entmax(jnp.ones(3), 0.99), ValueError, "alpha.*>= 1.*alpha=0.99"),
        (lambda: sj.entmax(jnp.ones(3), 0.5), ValueError, "alpha"),
        (lambda: sj.entmax(jnp.ones((2, 3)), jnp.array([1.5, 0.9])), ValueError, r"\[0.9"),
        (lambda: sj.entmax(jnp.ones((2, 3)), jnp.ones(3) * 1.5), ValueError, "shape"),
        (lambda: sj.entmax(jnp.ones(3), True), TypeError, "alpha"),
        (lambda: sj.sparsemax(jnp.ones((2, 3)), axis=2), ValueError, "axis.*2.*-2 <= axis < 2"),
        (lambda: sj.entmax15(jnp.ones(3), axis=-2), ValueError, "axis"),
        (lambda: sj.sparsemax(jnp.ones(3), axis=0.5), TypeError, "axis"),
        (lambda: sj.sparsemax(jnp.arange(3)), TypeError, "floating dtype.*int"),
        (lambda: sj.sparsemax(jnp.float32(1.0)), ValueError, "at least one dimension"),
        (lambda: sj.sparsemax(jnp.ones(3), where=jnp.ones(3)), TypeError, "where.*boolean"),
        (
            lambda: sj.sparsemax(jnp.ones(3), where=jnp.ones(4, bool)),
            ValueError,
            "where.*broadcast",
        ),
        (
            lambda: sj.sparsemax_loss(jnp.ones((2, 3)), jnp.array([0, 3])),
            ValueError,
            r"labels.*\[0, 3\).*\[0, 3\]",
        ),
        (lambda: sj.entmax15_loss(jnp.ones((2, 3)), jnp.array([-1, 0])), ValueError, "labels"),
        (lambda: sj.sparsemax_loss(jnp.ones((2, 3)), jnp.array([0.0, 1.0])), TypeError, "integer"),
        (lambda: sj.sparsemax_loss(jnp.ones((2, 3)), jnp.array([0])), ValueError, r"shape.*\(2,\)"),
        (lambda: sj.entmax_loss(jnp.ones((2, 3)), jnp.array([0, 1]), 0.5), ValueError, "alpha"),
        (lambda: sj.sparsemax_loss(jnp.ones((2, 3), int), jnp.array([0, 1])), TypeError, "logits"),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- Two-stage row sums on CPU -----------------------------------------------------------------


@pytest.mark.parametrize(
    "n, expected", [(264, (24, 264)), (259, (24, 264)), (1024, (64, 1024)), (40, None)]
)
def test_cpu_row_sums_split_rows_into_short_columns(n, expected):
    from sparse_jax.normalizers import search

    plan = search._cpu_sum_width(n)
    assert plan == expected
    if plan is not None:
        width, padded = plan
        assert padded - n < 8 and width % 8 == 0 and 6 <= padded // width <= 32


def _two_stage_shape(text: str, padded: int, width: int) -> bool:
    return f"{padded // width},{width}]" in text


@pytest.mark.parametrize("n", [259, 264])
@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "entmax-1.3"])
def test_two_stage_row_sums_run_on_cpu_only_and_match_plain_sums(name, n, monkeypatch):
    from sparse_jax.normalizers import search
    from sparse_jax.normalizers.arguments import normalize_rows

    fn = {"sparsemax": sj.sparsemax, "entmax15": sj.entmax15}.get(name) or (
        lambda x: sj.entmax(x, 1.3)
    )
    x = jax.random.normal(jax.random.PRNGKey(n), (6, n)) * 2.0
    x = x.at[1, n // 2 :].set(-jnp.inf)  # a masked tail
    cotangent = jax.random.normal(jax.random.PRNGKey(1), x.shape)

    def value_and_grad(x):
        return jax.value_and_grad(lambda x: jnp.sum(fn(x) * cotangent))(x), fn(x)

    width, padded = search._cpu_sum_width(n)
    # The CPU program sums over [.., n'/w, w]; one lowered for a GPU keeps plain row sums.
    cpu_text = jax.jit(value_and_grad).lower(x).compile().as_text()
    gpu_text = jax.jit(value_and_grad).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert _two_stage_shape(cpu_text, padded, width)
    assert not _two_stage_shape(gpu_text, padded, width)

    ((_, grad), p) = jax.jit(value_and_grad)(x)
    monkeypatch.setattr(search, "_cpu_sum_width", lambda n: None)
    normalize_rows.clear_cache()  # the normalizers' compiled call is traced again, without it
    plain = jax.jit(lambda x: value_and_grad(x))  # a new function: traced again, without the split
    assert not _two_stage_shape(plain.lower(x).compile().as_text(), padded, width)
    ((_, grad_plain), p_plain) = plain(x)
    np.testing.assert_allclose(p, p_plain, atol=2e-6)
    np.testing.assert_allclose(grad, grad_plain, atol=2e-6)
    np.testing.assert_allclose(np.sum(p, axis=-1), 1.0, atol=1e-5)
    assert np.all(np.asarray(p)[1, n // 2 :] == 0.0)


def _passes(search, z):
    """(passes until every row is done, final τ) of a RowSearch run on whole rows."""
    from experiments.bench.passes import count_passes

    passes, _, tau = count_passes(search, z)
    return passes, tau


def _hard_rows(seed: int) -> list:
    """[64, 300] score rows for the threshold searches: random at four scales, many ties, and
    99% masked (-inf; a row with nothing allowed gets zeros)."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((64, 300)) * scale for scale in (0.3, 1.0, 4.0, 20.0)]
    rows.append(np.round(rng.standard_normal((64, 300)) * 2) / 2)  # many ties
    rows.append(np.where(rng.random((64, 300)) < 0.99, -np.inf, rng.standard_normal((64, 300))))
    return [np.where(np.isneginf(x).all(-1, keepdims=True), 0.0, x) for x in rows]


@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15"])
def test_the_start_is_a_lower_bound_exact_on_small_supports_and_saves_passes(normalizer):
    """normalizers.sparsemax_start / entmax15_start on each row's 4 largest values, against
    the threshold by sorting: never above it (also with smaller values, as dropped ties give),
    equal when the support has at most 4 entries, and fewer search passes to the same τ."""
    from sparse_jax import normalizers as nz

    if normalizer == "sparsemax":
        start_of, halve = nz.sparsemax_start, 1.0
        search_of = functools.partial(nz.sparsemax_search, row_length=300)
    else:
        start_of, halve = nz.entmax15_start, 0.5
        search_of = nz.entmax15_search
    rows = _hard_rows(0)
    for x in rows:
        z = (x - x.max(-1, keepdims=True)) * halve
        exact = sorted_threshold(normalizer, z)
        power = 1 if normalizer == "sparsemax" else 2
        total = np.sum(np.maximum(z - exact, 0.0) ** power, -1)
        np.testing.assert_allclose(total, 1.0, rtol=1e-9)  # the reference itself
        ordered = -np.sort(-z, axis=-1)
        true_top = [jnp.asarray(ordered[:, i : i + 1]) for i in range(4)]
        start = np.asarray(start_of(true_top))
        assert (start <= exact + 1e-6).all()
        small = (z > exact).sum(-1) <= 4
        np.testing.assert_allclose(start[small], exact[small], atol=1e-5)
        lowered = [t - 0.25 * (i > 0) for i, t in enumerate(true_top)]  # ties dropped: lower
        assert (np.asarray(start_of(lowered)) <= exact + 1e-6).all()
    z = jnp.asarray((rows[1] - rows[1].max(-1, keepdims=True)) * halve, jnp.float32)
    ordered = -jnp.sort(-z, axis=-1)
    done = jnp.zeros((64, 1), bool)
    start = start_of([ordered[:, i : i + 1] for i in range(4)])
    base, tau = _passes(search_of(jnp.full((64, 1), -1.0), done), z)
    fewer, tau_from_start = _passes(search_of(start, done), z)
    assert fewer < base
    np.testing.assert_allclose(tau_from_start, tau, atol=1e-5)


def test_entmax15s_search_polishes_only_roots_formed_far_from_them():
    """1.5-entmax's search with ``smallest`` takes its polishing pass only for rows whose
    closed form was formed far from the root (there the form loses digits), and is then exact:
    float32 thresholds against float64 sorting, to 1 ulp of the row's scale."""
    from sparse_jax import normalizers as nz

    def polished_rows(z, tau0):
        """Rows that took a polishing pass (found, not yet done), checking the final τ."""
        z32 = jnp.asarray(z, jnp.float32)
        search = nz.entmax15_search(tau0, jnp.zeros_like(tau0, bool), smallest=True)
        state, polished = search.init, np.zeros(len(z), bool)
        while not bool(jnp.all(state[-1])):
            terms = search.terms(z32, state)
            sums = [jnp.sum(t, -1, keepdims=True) for t in terms[:-1]]
            sums.append(jnp.min(terms[-1], -1, keepdims=True))
            polished |= np.asarray(state[1] & ~state[2])[:, 0]
            state = search.update(state, tuple(sums))
        exact = sorted_threshold("entmax15", np.asarray(z32, np.float64))
        ulp = float(np.finfo(np.float32).eps)
        np.testing.assert_allclose(state[0], exact, rtol=0, atol=ulp)
        return polished

    rng = np.random.default_rng(0)
    ties = np.full((4, 2048), -25.0)
    ties[:, :1000] = rng.standard_normal((4, 1000)) * 1e-3  # 1000 near-ties, then a gap
    # from -1 their support is found at once, 0.98 below τ* (-0.016): Σ (z - τ)² - 1 = 960
    assert polished_rows(ties, jnp.full((4, 1), -1.0)).all()
    # random rows from the kernels' start (the 16 largest values): roots formed within
    # POLISH_FREE_EXCESS of 1 and exact as they are, no polishing pass
    for std in (0.5, 1.0, 4.0):
        x = rng.standard_normal((64, 4096)) * std
        z = jnp.asarray((x - x.max(-1, keepdims=True)) / 2, jnp.float32)
        top = jax.lax.top_k(z, 16)[0]
        start = nz.entmax15_start([top[:, i : i + 1] for i in range(16)])
        assert not polished_rows(z, start).any()


@pytest.mark.parametrize("smallest", [True, False])
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15"])
def test_a_search_is_exact_and_done_in_the_pass_whose_support_holds_its_root(normalizer, smallest):
    """With ``smallest`` each pass also takes its support's smallest entry: when it is >= the
    pass' closed form, that form is the threshold and the row is done in the same pass, so a
    start at the exact threshold takes one pass (without: at least two, the last confirming).
    From -1, on random, tied and mostly masked rows, both end at the threshold found by
    sorting (1.5-entmax without ``smallest`` after its polishing step; with it, the search
    polishes where it must)."""
    from sparse_jax import normalizers as nz
    from sparse_jax.normalizers import search

    for x in _hard_rows(1):
        if normalizer == "sparsemax":
            z = x - x.max(-1, keepdims=True)
            exact = sorted_threshold("sparsemax", z)
            search_of = functools.partial(nz.sparsemax_search, row_length=300, smallest=smallest)
        else:
            z = (x - x.max(-1, keepdims=True)) / 2
            exact = sorted_threshold("entmax15", z)
            search_of = functools.partial(nz.entmax15_search, smallest=smallest)
        z32, done = jnp.asarray(z, jnp.float32), jnp.zeros((64, 1), bool)
        state = search_of(jnp.full((64, 1), -1.0), done)
        _, tau = _passes(state, z32)
        # The XLA engines' runner (its row minima in the CPU's two-stage row sums for n = 300:
        # the sums' order differs, so τ to rounding)
        np.testing.assert_allclose(search.run_search(z32, state)[0], tau, atol=2e-7)
        if normalizer == "entmax15" and not smallest:
            tau = nz.entmax15_polish(tau, search.row_sums(*nz.entmax15_polish_terms(z32, tau)))
        np.testing.assert_allclose(tau, exact, atol=2e-6)
        passes, _ = _passes(search_of(jnp.asarray(exact, jnp.float32) - 1e-7, done), z32)
        # started at (just below) the threshold: one pass, or a confirming one (or two: an
        # entry at the threshold leaves the support in the second, which the third confirms)
        assert passes == 1 if smallest else passes >= 2
