"""α-entmax for any α >= 1 (α = 1: softmax), a float or an array (e.g. one α per head),
differentiable in α.

Safeguarded Newton on the threshold, held as σ = 1 + τ for α near 1 (package docstring, "How
the threshold τ is found"), and the α derivative of Correia et al. (2019) without a division
by α - 1. A python float α of 2.0 or 1.5 uses the exact algorithms of
:mod:`sparse_jax.normalizers.exact`. The search and the α-terms are also what the fused kernels
run block by block (:mod:`sparse_jax.kernels`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401 (the examples use it)

from sparse_jax.normalizers.arguments import (
    alpha_eps,
    check_alpha,
    check_inputs,
    compute_dtype,
    normalize_rows,
    softmax_eps,
)
from sparse_jax.normalizers.exact import entmax15, sparsemax
from sparse_jax.normalizers.search import (
    RowSearch,
    jacobian_product,
    poison,
    row_sums,
    run_search,
    shift_to_zero_max,
)

# The API; the other names without an underscore are shared with the kernels.
__all__ = ["entmax"]

# Iteration cap: Newton converges quadratically, so rows still running after this many passes
# are only those stuck at float rounding, whose τ is then as good as float arithmetic allows.
_ENTMAX_MAX_ITER = 60


def _entmax_u(z, theta, sigma):
    """(u, log u) with u = [z - τ]_+ (0 and 0 off the support) for a threshold held as θ.

    ``sigma`` True: θ = σ = 1 + τ, u = 1 + (z - σ). For α near 1 the threshold τ is near -1,
    where a float keeps only ~eps of it while p = u^(1/(α-1)) needs log u to (α-1)·eps: σ keeps
    those digits, and log u = log(u) + (what rounding u = 1 + w lost), i.e. log1p(w) to a few
    roundings. ``sigma`` False: θ = τ, log u = log(z - τ), which keeps the digits of a τ near 0
    (α > 2, long rows). A bool array picks per row.

    Not jnp.log1p: XLA:CPU does not fuse log-plus-one into the row reductions (every pass then
    wrote and read the whole score array). The offset 1 is written 1 + 0·θ because
    XLA's algebraic simplifier folds (w + 1) - 1 into w when 1 is a constant, which would drop
    the rounding term (under jit only; the tests run jitted).
    """
    arg = z - theta
    if sigma is False:
        positive = arg > 0.0
        return jnp.where(positive, arg, 0.0), jnp.log(jnp.where(positive, arg, 1.0))
    offset = (1.0 if sigma is True else jnp.where(sigma, 1.0, 0.0)) + 0.0 * theta
    u = offset + arg
    positive = u > 0.0
    rounding = arg - (u - offset)  # exact; 0 on τ rows
    log_u = jnp.log(jnp.where(positive, u, 1.0)) + jnp.where(positive, rounding, 0.0)
    return jnp.where(positive, u, 0.0), log_u


def expm1_from_exp(x):
    """exp(x) - 1 from ``exp`` and ``log`` alone, to a few ulps (Kahan's trick: the rounding
    error of u = exp(x) cancels in (u - 1) x / log u). For compilers without ``expm1``.

    Example:
      >>> x = jnp.array([1e-9, 1e-4, 0.3, -50.0, 100.0], jnp.float32)
      >>> bool(jnp.allclose(expm1_from_exp(x), jnp.expm1(x), rtol=1e-6))
      True
    """
    u = jnp.exp(x)
    u_minus_1 = u - 1.0
    exact = (u_minus_1 == 0.0) | (u_minus_1 == -1.0) | jnp.isinf(u)
    ratio = x / jnp.log(jnp.where(exact, 2.0, u))
    return jnp.where(u_minus_1 == 0.0, x, jnp.where(exact, u_minus_1, u_minus_1 * ratio))


def entmax_powers(z, theta, eps, sigma):
    """(u^(1/ε), u^(1/ε - 1)) elementwise, zero off the support, with ε = α - 1."""
    u, log_u = _entmax_u(z, theta, sigma)
    u_pow_m1 = jnp.where(u > 0.0, jnp.exp((1.0 / eps - 1.0) * log_u), 0.0)
    return u_pow_m1 * u, u_pow_m1


def entmax_search(eps, sigma, n_valid, done0, expm1=jnp.expm1) -> RowSearch:
    """α-entmax threshold of rows z = ε (x - max), ε = α - 1, held as θ (see :func:`_entmax_u`).

    ``n_valid`` ``[..., 1]``: the number of allowed entries of each row. Safeguarded Newton from
    τ = -1: the bracket [lo, hi] always holds the root; a Newton step that leaves it, or does
    not at least halve the previous step, is replaced by bisection. ``expm1``: the function
    used for exp(x) - 1 (a kernel whose compiler has no expm1 passes :func:`expm1_from_exp`).
    """
    offset = jnp.where(sigma, 1.0, 0.0) if not isinstance(sigma, bool) else float(sigma)
    eps_log_n = eps * jnp.log(jnp.maximum(n_valid, 1.0))
    # τ = -(1/n)^(α-1) has f <= 0: as σ = 1 + τ that is -expm1(-ε log n), without cancellation.
    if isinstance(sigma, bool):
        hi = -expm1(-eps_log_n) if sigma else -jnp.exp(-eps_log_n)
    else:
        hi = jnp.where(sigma, -expm1(-eps_log_n), -jnp.exp(-eps_log_n))
    lo = jnp.zeros_like(hi) + (offset - 1.0)
    eps_f = jnp.finfo(hi.dtype).eps
    tiny = jnp.finfo(hi.dtype).tiny

    def scale(theta):
        if isinstance(sigma, bool):
            return jnp.maximum(jnp.abs(theta), eps) if sigma else jnp.abs(theta)
        return jnp.where(sigma, jnp.maximum(jnp.abs(theta), eps), jnp.abs(theta))

    def terms(z, state):
        return entmax_powers(z, state[0], eps, sigma)

    def update(state, sums):
        theta, lo, hi, previous_step, done = state
        mass, slope = sums
        excess = mass - 1.0
        lo = jnp.where(excess >= 0.0, theta, lo)
        hi = jnp.where(excess <= 0.0, theta, hi)
        # Newton on g(τ) = mass^(α-1) - 1 = ||[z - τ]_+||_(1/(α-1)) - 1 rather than on mass - 1:
        # g is convex too (for α <= 2) but nearly linear (exactly so when one entry dominates),
        # so the steps from the left are long where Newton on the mass crawls. The step
        # (1 - mass^-ε) mass / slope, written with expm1, tends to ε log(mass) as ε -> 0: the
        # softmax normaliser, reached in one or two steps.
        newton = theta - expm1(-eps * jnp.log(jnp.maximum(mass, tiny))) * mass / slope
        # For α > 2 the slope blows up next to a support boundary and pure Newton would crawl,
        # so a Newton step that does not halve the previous one is replaced by bisection --
        # except at the float noise floor of the mass, where Newton's step is the last one.
        inside = (newton >= lo) & (newton <= hi)
        close = inside & (jnp.abs(excess) <= 64.0 * eps_f)
        use_newton = inside & ((jnp.abs(newton - theta) <= 0.5 * previous_step) | close)
        new_theta = jnp.where(use_newton, newton, 0.5 * (lo + hi))
        step = jnp.abs(new_theta - theta)
        # Converged when the mass is one to rounding (the Newton step just taken polishes θ
        # further) or the step is at rounding level. A looser test on the mass is not enough for
        # α > 2, where p = u^(1/(α-1)) is steep next to the threshold.
        # (A σ is held to (α-1)·eps absolute, i.e. t = σ/(α-1) to eps: finer is float noise.)
        finished = close | (step <= 2.0 * eps_f * scale(theta))
        return jnp.where(done, theta, new_theta), lo, hi, step, done | finished

    init = (lo, lo, jnp.maximum(hi, lo), jnp.full_like(lo, jnp.inf), done0)
    return RowSearch(init, terms, update, _ENTMAX_MAX_ITER)


def _entmax_threshold(z, eps, sigma, done0):
    n_valid = jnp.sum(z > -jnp.inf, axis=-1, keepdims=True, dtype=z.dtype)
    return run_search(z, entmax_search(eps, sigma, n_valid, done0))[0]


def _entmax_s(p, eps):
    positive = p > 0.0
    return jnp.where(positive, jnp.exp((1.0 - eps) * jnp.log(jnp.where(positive, p, 1.0))), p * 0.0)


# Σ_k b^k / (k+2)! for k = 0..10: ψ(b) = (e^b - 1 - b) / b² to float64 rounding for |b| < 1/2.
_PSI_COEFFICIENTS = tuple(1.0 / math.factorial(k + 2) for k in range(11))
_PSI_SERIES_BELOW = 0.5
# From this α - 1 on, the α-terms of the entries above the series are lifted (see
# _entmax_dp_dalpha). Measured in float32 against float64 references, dα of the long rows of
# tests/test_golden_entmax.py (largest relative error, floor 1e-6): α = 1.75 0.40 -> 0.009,
# α = 3 1210 -> 0.037 with lifting; at α = 1.05 and 1.1 lifting put the rows of 7 of
# tests/test_reliability_normalizers.py at 5.9e-5 relative (tolerance 2e-5): there it
# multiplies roundings by 1/ε².
LIFT_FROM_EPS = 0.5


def _entmax_dp_dalpha(p, eps):
    """∂p/∂α of α-entmax from its output p (rows on the last axis), accurate for every α > 1.

    With u_i = (α-1) x_i - τ(α) and p_i = u_i^(1/(α-1)) on the support, Correia et al. (2019)
    give ∂p_i/∂α = [s_i (x_i - τ') - p_i log p_i] / (α - 1) with s_i = p_i^(2-α) and
    τ' = (Σ s_i x_i - Σ p_i log p_i) / Σ s_i, where x_i = (p_i^(α-1) + τ)/(α-1) is recovered
    from p up to a per-row constant that cancels. Written with L_i = log p_i, ε = α - 1 and
    b_i = -ε L_i >= 0 this is

        ∂p_i/∂α = s_i Σ_j t_j / Σ_j s_j - t_i,   t_i = p_i L_i² ψ(b_i),   ψ(b) = (e^b - 1 - b)/b²,

    which has no 1/ε left (the old form divided a difference of O(1/ε) terms by ε and lost every
    digit as α -> 1); as ε -> 0 it tends to softmax's -p_i (L_i² - Σ_j p_j L_j²) / 2. ψ comes
    from its series for b < 1/2 and from t_i = (s_i - r_i) / ε² above, r_i = p_i (1 + b_i)
    (s_i = p_i e^(b_i)), where that subtraction loses at most a few roundings.

    From α = 1.5 on (:data:`LIFT_FROM_EPS`) the entries above the series (*lifted*, ℓ) have
    their s_i / ε² part taken out of both terms, where it cancels exactly: with
    c_i = t_i - ℓ_i s_i / ε² and S_ℓ = Σ ℓ_j s_j,

        ∂p_i/∂α = s_i Σ_j c_j / Σ_j s_j - c_i + (s_i / ε²) (S_ℓ - ℓ_i Σ_j s_j) / Σ_j s_j,

    with S_ℓ - Σ s written as -Σ (1 - ℓ_j) s_j. There s = p^(2-α) grows without bound at the
    edge of the support, and summing the t's first lost the difference of two O(Σ s / ε²)
    numbers: up to 45% of dα in float32 on rows of 4096 at α = 3, against 3.7% with the split
    (tests/test_golden_entmax.py). Near α = 1 the split would multiply roundings by 1/ε².
    """
    s, c, s_rest = entmax_alpha_terms(p, eps)
    s_sum, c_sum, rest_sum = row_sums(s, c, s_rest)
    s_sum = jnp.where(s_sum > 0.0, s_sum, 1.0)
    lifted_sum = jnp.where(eps >= LIFT_FROM_EPS, s_sum - rest_sum, 0.0)  # S_ℓ (0: none lifted)
    share = jnp.where((p > 0.0) & (s_rest == 0.0), -rest_sum, lifted_sum) / s_sum
    return jnp.where(p > 0.0, s * c_sum / s_sum - c + share * s / (eps * eps), 0.0 * p)


def entmax_alpha_terms(p, eps):
    """Per-entry ``(s, c, s_rest)`` of :func:`_entmax_dp_dalpha`: ``s = p^(2-α)``, the α-term
    ``c`` (``t`` with the ``s / ε²`` part taken out of the lifted entries: α - 1 >=
    :data:`LIFT_FROM_EPS`, above the series) and ``s`` on the entries that are not lifted (0
    on the lifted ones). A row's
    ``dα = Σ_i g_i ∂p_i/∂α`` for a cotangent ``g`` is ``δ Σ c - Σ g c`` plus, when lifted,
    ``(Σ g s_rest - δ Σ s_rest) / ε²``, with ``δ = Σ g s / Σ s``: sums a kernel accumulates
    block by block."""
    positive = p > 0.0
    log_p = jnp.log(jnp.where(positive, p, 1.0))
    s = _entmax_s(p, eps)
    b = -eps * log_p
    series = b < _PSI_SERIES_BELOW
    lifted = positive & ~series & (eps >= LIFT_FROM_EPS)
    b_small = jnp.where(series, b, 0.0)
    psi = jnp.zeros_like(b_small) + _PSI_COEFFICIENTS[-1]
    for coefficient in reversed(_PSI_COEFFICIENTS[:-1]):
        psi = psi * b_small + coefficient
    above = (jnp.where(lifted, 0.0, s) - p - p * b) / jnp.where(series, 1.0, eps * eps)
    c = jnp.where(positive, jnp.where(series, p * log_p * log_p * psi, above), 0.0)
    return s, c, jnp.where(lifted, 0.0, s)


# Up to this α - 1 the threshold is held as σ = 1 + τ, above it as τ (see _entmax_u). Measured
# under jit against a float64 reference (rows of 7 and 4096 scores, max abs error of float32
# p): σ stays at ~1e-7 from α = 1 + 1e-7 to 1.5, where τ reaches 9e-2 at α = 1 + 1e-7, 6e-7 at
# 1.01 and 1.7e-7 at 1.05; above α = 1.5 τ is 10-100x better on long near-uniform rows (α = 2.5,
# n = 4096: 1.6e-8 against 1.2e-6). A σ pass costs more than a τ pass on XLA:CPU (the rounding
# term), so σ is used only where τ loses digits.
SIGMA_MAX_EPS = 0.05


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _entmax_rows(x, eps, sigma):
    """α-entmax of rows x [..., n] with eps = α - 1 [..., 1] (any α > 1).

    ``sigma``: True / False (static: how the threshold is held, see :func:`_entmax_u`), or None
    to choose per row from eps.
    """
    z, has_any, nan_row = shift_to_zero_max(x)
    bad_alpha = jnp.isnan(eps)  # a row whose α breaks the rule (arguments.alpha_eps): NaN
    has_any, nan_row = has_any & ~bad_alpha, nan_row | bad_alpha
    z = eps * z

    def solve(sigma):
        theta = _entmax_threshold(z, eps, sigma, ~has_any)
        return entmax_powers(z, theta, eps, sigma)[0]

    if sigma is None:
        # A per-row choice makes every pass select between the two forms, which on XLA:CPU can
        # keep a pass from fusing into its row sums, several times slower than one static form
        # (docs/archive/benchmarks-history.md, "α as an array"). So the rows are held as τ, in the
        # static form, when no row's α is close enough to 1 to need σ (what each row would get
        # alone), and the per-row choice runs only otherwise. (A static σ form for rows that all
        # need it measured no faster than the per-row choice.)
        near_one = eps <= SIGMA_MAX_EPS
        p = jax.lax.cond(jnp.any(near_one), lambda: solve(near_one), lambda: solve(False))
    else:
        p = solve(sigma)
    # Divided by its sum, so rows sum to one although θ comes from a stopped iteration.
    mass = jnp.sum(p, axis=-1, keepdims=True)
    return poison(p / jnp.where(mass > 0.0, mass, 1.0), nan_row)


def _entmax_rows_fwd(x, eps, sigma):
    p = _entmax_rows(x, eps, sigma)
    return p, (p, eps)


def _entmax_rows_bwd(sigma, residuals, cotangent):
    p, eps = residuals
    dx = jacobian_product(_entmax_s(p, eps), cotangent)
    # (XLA drops this when α is not differentiated.)
    deps = jnp.sum(cotangent * _entmax_dp_dalpha(p, eps), axis=-1, keepdims=True)
    return dx, deps


_entmax_rows.defvjp(_entmax_rows_fwd, _entmax_rows_bwd)


def entmax(x, alpha, axis: int = -1, *, where=None) -> jax.Array:
    """α-entmax along ``axis``: ``p = [(α-1) x - τ]_+^(1/(α-1))`` summing to one.

    α → 1 tends to softmax, α = 1.5 is :func:`entmax15`, α = 2 is :func:`sparsemax`; larger α
    gives sparser outputs. A python float 1.5 or 2.0 uses those exact algorithms; any other α
    (or an array of α) uses safeguarded Newton iterations on the threshold, stopped at float
    rounding, with the output divided by its sum so that rows sum to one.

    Differentiable with respect to ``x`` and ``alpha`` (learned α per head, as in "Adaptively
    Sparse Transformers"); parametrise a learned α as ``1 + softplus(θ)`` (or
    ``1 + sigmoid(θ)`` for α ∈ [1, 2]).

    The rule for α, the same here, in the losses and in every attention engine, eager or
    under ``jit``: α > 1 is α-entmax; α = 1 exactly is softmax (with the derivative in α of
    the limit α ↓ 1); α < 1, NaN and ±inf are not α-entmax. Such an α raises a ``ValueError``
    naming ``alpha`` when it is concrete; a traced α cannot be checked, and every row whose
    α breaks the rule is NaN (values and derivatives; the other rows are unaffected). To get
    an error under ``jit``, turn on :func:`~sparse_jax.normalizers.enable_traced_checks`
    before the function is traced and run it under ``jax.experimental.checkify`` (its
    example):

      >>> scores = jnp.zeros((2, 3))  # [heads, keys]
      >>> step = jax.jit(lambda a: entmax(scores, a))  # α per head: [heads]
      >>> print(np.asarray(step(jnp.array([1.0, 0.5]))).round(3))  # α = 1: softmax
      [[0.333 0.333 0.333]
       [  nan   nan   nan]]

    Args:
      x: scores of any float dtype, e.g. ``[batch, heads, q, kv]``.
      alpha: a float >= 1, or an array broadcastable to ``x`` without ``axis`` (e.g. one α
        per head: shape ``[heads, 1]`` for scores ``[batch, heads, q, kv]`` with
        ``axis=-1``).
      axis: the axis that sums to one.
      where: optional boolean mask broadcastable to ``x`` (True = allowed); ``-inf`` also masks.

    Returns:
      Probabilities with the shape and dtype of ``x``.

    Example:
      >>> print(np.asarray(entmax(jnp.array([1.0, 0.8, -1.0]), 1.25)).round(3))
      [0.55  0.433 0.017]
    """
    x, axis, where = check_inputs(x, axis, where, "entmax")
    rows = x.shape[:axis] + x.shape[axis + 1 :]
    alpha = check_alpha(alpha, rows, "entmax")
    if isinstance(alpha, float) and alpha == 2.0:
        return sparsemax(x, axis, where=where)
    if isinstance(alpha, float) and alpha == 1.5:
        return entmax15(x, axis, where=where)
    dtype = compute_dtype(x.dtype)
    if isinstance(alpha, float):  # α - 1 in python float64: α = 1 + 1e-7 is not a float32
        eps_value = alpha - 1.0 if alpha > 1.0 else softmax_eps(dtype)
        eps = jnp.full((*rows, 1), eps_value, dtype)
        sigma = eps_value <= SIGMA_MAX_EPS
    else:
        eps = jnp.broadcast_to(alpha_eps(alpha, dtype), rows)[..., None]
        sigma = None  # chosen per row
    return normalize_rows(_entmax_rows, x, where, axis, (sigma,), eps)
