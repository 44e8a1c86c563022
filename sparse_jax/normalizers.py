"""Sparse normalizers (sparsemax, 1.5-entmax, α-entmax) and their Fenchel–Young losses.

α-entmax maps scores ``x`` to the probability vector

    p_i = [(α - 1) x_i - τ]_+ ^ (1 / (α - 1)),      with τ chosen so that Σ_i p_i = 1.

α → 1 recovers softmax, α = 2 is sparsemax (Martins & Astudillo, 2016) and α = 1.5 is 1.5-entmax
(Peters, Niculae & Martins, 2019); every α > 1 gives exact zeros. "Adaptively Sparse Transformers"
(Correia et al., 2019) learn one α per attention head, so ``entmax`` differentiates in α too.

How the threshold τ is found (the part that decides speed)
-----------------------------------------------------------
The textbook algorithm sorts every row. On XLA:CPU a row sort costs about 10x the rest of
attention, so nothing here sorts. Every row is shifted so that its maximum is 0; then
τ ∈ [-1, -(1/n)^(α-1)] and f(τ) = Σ_i [z_i - τ]_+^(1/(α-1)) - 1 is decreasing. Each iteration
is *one* pass over the row that gathers a few sums over the current support
S(τ) = {i : z_i > τ} in a single variadic reduction; all rows iterate together until the last
one is finished.

* ``sparsemax``: Michelot's fixed point τ ← (Σ_S z - 1) / |S| from τ = -1, which is Newton's
  method on the piecewise linear f started left of the root. The iterates increase, the
  support shrinks strictly until it is the true support, and an unchanged support size ends
  the row: τ is then the closed-form threshold of its own support, i.e. exact. At most n
  passes; on attention scores 3-7.
* ``entmax15``: Newton steps on ||[z - τ]_+||_2 - 1 from τ = -1 (convex and nearly linear, so
  the iterates rise monotonically and fast). Each pass also forms the exact root τ_c of
  Σ_S (z - τ)² = 1 on the current support and the next pass checks that the entries >= τ_c
  cover S (the KKT conditions); a final pass recomputes the same closed form from sums centred
  on τ_c, which makes it exact to float rounding.
* general α (``entmax`` with any other α, or an array of α): Newton on
  ||[z - τ]_+||_(1/(α-1)) - 1, safeguarded by a bisection bracket (a step that leaves the
  bracket, or fails to halve the previous step, is replaced by bisection; this matters for
  α > 2), until the step is at rounding level; the output is divided by its sum.

The iterations never enter the derivative: custom rules use the closed form
``dp = s ⊙ dx - s (sᵀdx) / Σs`` with s_i = p_i^(2-α) on the support (a symmetric Jacobian, so
the same product serves forward and reverse mode), which is linear in the row length, and the
α derivative of Correia et al. (2019), re-derived in ``_entmax_rows_bwd``. ``sparsemax`` has a
custom JVP (forward and reverse mode); ``entmax15`` and ``entmax`` have custom VJPs (reverse
mode only), whose only residual is the output: see the comment above ``_entmax15_rows``.

Conventions shared by every function here: the row is ``axis`` (default last); positions where
``where`` is False, or whose score is ``-inf``, get probability exactly 0; a row with no allowed
position returns zeros and a zero gradient (never NaN); float16/bfloat16 inputs are computed in
float32 and returned in their own dtype.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "NORMALIZERS",
    "entmax",
    "entmax15",
    "entmax15_loss",
    "entmax_loss",
    "masked_softmax",
    "normalize",
    "sparsemax",
    "sparsemax_loss",
]

# Iteration caps. Sparsemax needs none (it terminates in at most n steps, see module docstring);
# Newton on entmax converges quadratically, so rows still running after this many passes are
# only those stuck at float rounding, whose τ is then as good as float arithmetic allows.
_ENTMAX15_MAX_ITER = 40
_ENTMAX_MAX_ITER = 60


# --------------------------------------------------------------------------------------------
# Argument checking and layout (shared by the public functions).
# --------------------------------------------------------------------------------------------


def _compute_dtype(dtype) -> jnp.dtype:
    """float64 stays float64 (with x64 enabled); every other float computes in float32."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _check_scores(x, name: str, arg: str = "x") -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name}: `{arg}` must have a floating dtype (float32, float16, bfloat16, float64); "
            f"got dtype {x.dtype}. Cast it first, e.g. `{arg}.astype(jnp.float32)`."
        )
    if x.ndim == 0:
        raise ValueError(f"{name}: `{arg}` must have at least one dimension; got a scalar.")
    return x


def _check_axis(axis, ndim: int, name: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{name}: `axis` must be an int; got {axis!r} ({type(axis).__name__}).")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{name}: `axis`={axis} is out of range for an input with {ndim} dimension(s); "
            f"allowed: {-ndim} <= axis < {ndim}."
        )
    return int(axis) % ndim


def _check_where(where, shape: tuple[int, ...], name: str) -> jax.Array | None:
    if where is None:
        return None
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(
            f"{name}: `where` must be a boolean array (True = allowed); got dtype {where.dtype}."
        )
    try:
        np.broadcast_shapes(where.shape, shape)
    except ValueError:
        raise ValueError(
            f"{name}: `where` with shape {where.shape} does not broadcast to the scores' shape "
            f"{shape}."
        ) from None
    return where


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _check_alpha(alpha, row_batch_shape: tuple[int, ...], name: str):
    """Returns a python float for scalar α, or a float array broadcastable to the row batch."""
    if isinstance(alpha, bool):
        raise TypeError(f"{name}: `alpha` must be a float > 1 or a float array; got {alpha!r}.")
    if isinstance(alpha, numbers.Real):
        alpha = float(alpha)
        if not alpha > 1.0:
            raise ValueError(
                f"{name}: `alpha` must be > 1 (α = 1 is softmax, use jax.nn.softmax); "
                f"got alpha={alpha}."
            )
        return alpha
    alpha = jnp.asarray(alpha)
    if not (jnp.issubdtype(alpha.dtype, jnp.floating) or jnp.issubdtype(alpha.dtype, jnp.integer)):
        raise TypeError(f"{name}: `alpha` must be a real number or array; got dtype {alpha.dtype}.")
    if alpha.ndim > len(row_batch_shape) or _broadcasts(alpha.shape, row_batch_shape) is None:
        raise ValueError(
            f"{name}: `alpha` with shape {alpha.shape} must broadcast to the scores' shape "
            f"without the normalized axis, {row_batch_shape} (for example one α per head)."
        )
    if _is_concrete(alpha):
        bad = np.asarray(alpha) <= 1.0
        if bad.any():
            raise ValueError(
                f"{name}: every `alpha` must be > 1; got {np.asarray(alpha)[bad][:5]} "
                "(a learned α is usually parametrised as 1 + softplus(θ) or 1 + sigmoid(θ))."
            )
    return alpha


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]):
    try:
        out = np.broadcast_shapes(a, b)
    except ValueError:
        return None
    return out if tuple(out) == tuple(b) else None


def _prepare(x, axis, where, name):
    """Checks arguments; returns (scores with the row last and masked entries -inf, axis, dtype)."""
    x = _check_scores(x, name)
    axis = _check_axis(axis, x.ndim, name)
    where = _check_where(where, x.shape, name)
    in_dtype = x.dtype
    x = x.astype(_compute_dtype(in_dtype))
    if where is not None:
        x = jnp.where(where, x, -jnp.inf)
    return jnp.moveaxis(x, axis, -1), axis, in_dtype


def _finish(p, axis, dtype):
    return jnp.moveaxis(p, -1, axis).astype(dtype)


# --------------------------------------------------------------------------------------------
# Row kernels: the row is the last axis, dtype float32/64, masked entries are -inf.
# --------------------------------------------------------------------------------------------


def _shift_to_zero_max(x):
    """z = x - max(x) per row; rows with no finite entry get shift 0. Returns (z, has_any)."""
    row_max = jnp.max(x, axis=-1, keepdims=True)
    has_any = row_max > -jnp.inf
    return x - jnp.where(has_any, row_max, 0.0), has_any


def _start(z):
    """τ = -1 for every row: a lower bound of the threshold once the row maximum is 0."""
    return jnp.full((*z.shape[:-1], 1), -1.0, z.dtype)


def _row_sums(*operands):
    """Sums of several arrays over the last axis in *one* pass (a variadic reduce), keepdims.

    Why not ``jnp.sum`` per quantity: XLA:CPU hands a plain sum to a library kernel that needs
    its input materialised, so each sum costs a write and a read of the whole score array; the
    variadic reduce fuses the elementwise producers into the loop (2-4x faster per pass here).
    """
    zeros = tuple(jnp.zeros((), op.dtype) for op in operands)
    sums = jax.lax.reduce(
        operands,
        zeros,
        lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
        (operands[0].ndim - 1,),
    )
    return tuple(s[..., None] for s in sums)


def _row_loop(body, init, max_iter: int):
    """Runs ``state = body(state)`` until every row reports done (state[-1]) or max_iter passes."""

    def cond(carry):
        it, state = carry
        return jnp.logical_and(it < max_iter, jnp.logical_not(jnp.all(state[-1])))

    def step(carry):
        it, state = carry
        return it + 1, body(state)

    return jax.lax.while_loop(cond, step, (jnp.int32(0), init))[1]


def _sparsemax_threshold(z, tau0, done0):
    """Exact sparsemax threshold of rows z (max 0) by Michelot's iteration; τ shape [..., 1].

    Each pass takes τ ← (Σ_S z - 1)/|S| on S = {z > τ}, from a start τ0 <= τ*. The supports are
    nested and shrink, so an unchanged support size means an unchanged support: τ is then the
    closed form on its own support, which is the exact threshold.
    """

    def body(state):
        tau, previous_size, done = state
        in_support = z > tau
        size, total = _row_sums(in_support.astype(z.dtype), jnp.where(in_support, z, 0.0))
        new_tau = (total - 1.0) / jnp.maximum(size, 1.0)
        return jnp.where(done, tau, new_tau), size, done | (size == previous_size)

    init = (tau0, jnp.full_like(tau0, -1.0), done0)
    tau, _, _ = _row_loop(body, init, max_iter=z.shape[-1] + 1)
    return tau


def _entmax15_threshold(z, tau0, done0):
    """Exact 1.5-entmax threshold of rows z = (x - max)/2 (p = [z - τ]_+²); τ shape [..., 1].

    Newton steps on ||[z - τ]_+||_2 - 1 from a start τ0 <= τ* (monotone: the function is convex
    and decreasing). Every pass also forms the exact quadratic root τ_c of Σ_S (z - τ)² = 1 on
    its support S and, in the next pass, counts the entries >= τ_c: if they cover S, the KKT
    conditions hold and τ_c is the threshold.
    """

    def body(state):
        tau, candidate, candidate_size, done = state
        in_support = z > tau
        u = jnp.where(in_support, z - tau, 0.0)
        size, s1, s2, covered = _row_sums(
            in_support.astype(z.dtype), u, u * u, (z >= candidate).astype(z.dtype)
        )
        finished = covered >= candidate_size
        excess = s2 - 1.0  # >= 0 left of the root
        # Smaller root δ of Σ_S (u - δ)² = 1, written without cancellation.
        disc = s1 * s1 - size * excess
        new_candidate = tau + excess / (s1 + jnp.sqrt(jnp.maximum(disc, 0.0)))
        # Newton on ||u||_2 - 1, which is nearly linear, rather than on s2 - 1.
        norm = jnp.sqrt(s2)
        newton = tau + (norm - 1.0) * norm / s1
        return (
            jnp.where(done, tau, jnp.where(finished, candidate, newton)),
            new_candidate,
            jnp.where(disc >= 0.0, size, jnp.inf),
            done | finished,
        )

    init = (tau0, tau0, jnp.full_like(tau0, jnp.inf), done0)
    tau, _, _, _ = _row_loop(body, init, max_iter=_ENTMAX15_MAX_ITER)
    # Polish: the candidate was formed at a Newton iterate that may still have been far from the
    # root, where Σ(u - δ)² = 1 loses digits to cancellation. The same closed form taken once
    # more, from sums centred on the (now nearly exact) τ, is exact to float rounding.
    in_support = z > tau
    u = jnp.where(in_support, z - tau, 0.0)
    size, s1, s2 = _row_sums(in_support.astype(z.dtype), u, u * u)
    excess = s2 - 1.0
    disc = jnp.maximum(s1 * s1 - size * excess, 0.0)
    polished = tau + excess / jnp.maximum(s1 + jnp.sqrt(disc), jnp.finfo(z.dtype).tiny)
    return jnp.where(size > 0.0, polished, tau)


def _entmax_powers(z, tau, power):
    """([z - τ]_+^power, [z - τ]_+^(power - 1)) elementwise, zero off the support."""
    u = z - tau
    positive = u > 0.0
    log_u = jnp.log(jnp.where(positive, u, 1.0))
    u_pow_m1 = jnp.where(positive, jnp.exp((power - 1.0) * log_u), 0.0)
    return u_pow_m1 * jnp.where(positive, u, 0.0), u_pow_m1


def _entmax_threshold(z, power, tau0, done0):
    """α-entmax threshold of rows z = (α-1)(x - max), power = 1/(α-1), from τ0 <= τ*.

    Safeguarded Newton: the bracket [lo, hi] always holds the root; a Newton step that leaves
    it, or does not at least halve the previous step, is replaced by bisection.
    """
    n_valid = jnp.sum(z > -jnp.inf, axis=-1, keepdims=True, dtype=z.dtype)
    hi = -jnp.exp(-jnp.log(jnp.maximum(n_valid, 1.0)) / power)  # -(1/n)^(α-1): f(hi) <= 0
    eps = jnp.finfo(z.dtype).eps

    def body(state):
        tau, lo, hi, previous_step, done = state
        mass, slope = _row_sums(*_entmax_powers(z, tau, power))
        excess = mass - 1.0
        lo = jnp.where(excess >= 0.0, tau, lo)
        hi = jnp.where(excess <= 0.0, tau, hi)
        # Newton on g(τ) = mass^(α-1) - 1 = ||[z - τ]_+||_(1/(α-1)) - 1 rather than on mass - 1:
        # g is convex too (for α <= 2) but nearly linear (exactly so when one entry dominates),
        # so the steps from the left are long where Newton on the mass crawls.
        root = jnp.exp(jnp.log(jnp.maximum(mass, jnp.finfo(z.dtype).tiny)) / power)
        newton = tau + (root - 1.0) * mass / (root * slope)
        # For α > 2 the slope blows up next to a support boundary and pure Newton would crawl,
        # so a Newton step that does not halve the previous one is replaced by bisection --
        # except at the float32 noise floor of the mass, where Newton's step is the last one.
        inside = (newton >= lo) & (newton <= hi)
        close = inside & (jnp.abs(excess) <= 64.0 * eps)
        use_newton = inside & ((jnp.abs(newton - tau) <= 0.5 * previous_step) | close)
        new_tau = jnp.where(use_newton, newton, 0.5 * (lo + hi))
        step = jnp.abs(new_tau - tau)
        # Converged when the mass is one to rounding (the Newton step just taken polishes τ
        # further) or the step is at rounding level. A looser test on the mass is not enough for
        # α > 2, where p = u^(1/(α-1)) is steep next to the threshold.
        finished = close | (step <= 2.0 * eps * jnp.abs(tau))
        return jnp.where(done, tau, new_tau), lo, hi, step, done | finished

    init = (tau0, tau0, jnp.maximum(hi, tau0), jnp.full_like(tau0, jnp.inf), done0)
    return _row_loop(body, init, max_iter=_ENTMAX_MAX_ITER)[0]


def _jacobian_product(s, dx):
    """J·dx = s ⊙ dx - s (sᵀdx) / Σs, the Jacobian of entmax (symmetric, so also Jᵀ·dx).

    s_i = p_i^(2-α) on the support and 0 elsewhere: 1[p > 0] for sparsemax, √p for entmax15.
    """
    s_dx = jnp.where(s > 0.0, s * dx, 0.0)
    s_sum = jnp.sum(s, axis=-1, keepdims=True)
    return s_dx - s * jnp.sum(s_dx, axis=-1, keepdims=True) / jnp.where(s_sum > 0.0, s_sum, 1.0)


@jax.custom_jvp
def _sparsemax_rows(x):
    z, has_any = _shift_to_zero_max(x)
    tau = _sparsemax_threshold(z, _start(z), ~has_any)
    return jnp.maximum(z - tau, 0.0)


@_sparsemax_rows.defjvp
def _sparsemax_rows_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    p = _sparsemax_rows(x)
    return p, _jacobian_product((p > 0.0).astype(p.dtype), dx)


# entmax15 and α-entmax use custom VJPs whose only residual is the output p, which attention
# keeps anyway for its value product: a custom JVP would also store s = p^(2-α) as a second
# [.., n, n] array, and whole-attention forward+backward measured 1.5x slower for it. The cost
# is forward-mode autodiff (jax.jvp, jacfwd), which these two do not support; sparsemax does.
@jax.custom_vjp
def _entmax15_rows(x):
    z, has_any = _shift_to_zero_max(x)
    z = 0.5 * z
    tau = _entmax15_threshold(z, _start(z), ~has_any)
    u = jnp.maximum(z - tau, 0.0)
    return u * u


def _entmax15_rows_fwd(x):
    p = _entmax15_rows(x)
    return p, p


def _entmax15_rows_bwd(p, cotangent):
    return (_jacobian_product(jnp.sqrt(p), cotangent),)


_entmax15_rows.defvjp(_entmax15_rows_fwd, _entmax15_rows_bwd)


@jax.custom_vjp
def _entmax_rows(x, alpha):
    """α-entmax of rows x [..., n] with alpha [..., 1] (any α > 1)."""
    z, has_any = _shift_to_zero_max(x)
    power = 1.0 / (alpha - 1.0)
    z = (alpha - 1.0) * z
    tau = _entmax_threshold(z, power, _start(z), ~has_any)
    # Divided by its sum, so rows sum to one although τ comes from a stopped iteration.
    p, _ = _entmax_powers(z, tau, power)
    mass = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(mass > 0.0, mass, 1.0)


def _entmax_rows_fwd(x, alpha):
    p = _entmax_rows(x, alpha)
    return p, (p, alpha)


def _entmax_rows_bwd(residuals, cotangent):
    p, alpha = residuals
    support = p > 0.0
    log_p = jnp.log(jnp.where(support, p, 1.0))
    s = jnp.where(support, jnp.exp((2.0 - alpha) * log_p), 0.0)
    dx = _jacobian_product(s, cotangent)
    # α: with u_i = (α-1) x_i - τ(α) and p_i = u_i^(1/(α-1)) on the support,
    #   ∂p_i/∂α = [-p_i log p_i + s_i (x_i - τ'(α))] / (α - 1),
    # and Σ_i ∂p_i/∂α = 0 gives τ'(α) = (Σ s_i x_i - Σ p_i log p_i) / Σ s_i. Only differences
    # x_i - τ' enter, and on the support x_i = (p_i^(α-1) + τ) / (α-1), so x is recovered from
    # p up to a per-row constant. (XLA drops all this when α is not differentiated.)
    x_support = jnp.where(support, jnp.exp((alpha - 1.0) * log_p), 0.0) / (alpha - 1.0)
    p_log_p = jnp.where(support, p * log_p, 0.0)
    s_sum = jnp.sum(s, axis=-1, keepdims=True)
    tau_prime = jnp.sum(s * x_support - p_log_p, axis=-1, keepdims=True)
    tau_prime = tau_prime / jnp.where(s_sum > 0.0, s_sum, 1.0)
    dp_dalpha = jnp.where(support, (s * (x_support - tau_prime) - p_log_p) / (alpha - 1.0), 0.0)
    dalpha = jnp.sum(jnp.where(support, cotangent * dp_dalpha, 0.0), axis=-1, keepdims=True)
    return dx, dalpha


_entmax_rows.defvjp(_entmax_rows_fwd, _entmax_rows_bwd)


# --------------------------------------------------------------------------------------------
# Public normalizers.
# --------------------------------------------------------------------------------------------


def sparsemax(x, axis: int = -1, *, where=None) -> jax.Array:
    """Sparsemax: the Euclidean projection of ``x`` onto the probability simplex along ``axis``.

    ``sparsemax(x) = argmin_{p ∈ Δ} ||p - x||²``, i.e. ``p = max(x - τ, 0)`` with τ such that the
    row sums to one (Martins & Astudillo, 2016). Equal to ``entmax(x, 2.0)``.

    The threshold is found by Michelot's iteration from the left (no sort; see the module
    docstring) and is exact: the support and τ are those of the sort-based algorithm.

    Args:
      x: scores of any float dtype and shape, e.g. attention logits ``[batch, heads, q, kv]``.
      axis: the axis that sums to one.
      where: optional boolean array broadcastable to ``x``; False positions get probability 0.
        ``-inf`` scores are masked too. Rows with no allowed position return zeros.

    Returns:
      Probabilities with the shape and dtype of ``x``.

    Example:
      >>> print(np.asarray(sparsemax(jnp.array([1.0, 0.8, -1.0]))).round(4))
      [0.6 0.4 0. ]
    """
    x, axis, dtype = _prepare(x, axis, where, "sparsemax")
    return _finish(_sparsemax_rows(x), axis, dtype)


def entmax15(x, axis: int = -1, *, where=None) -> jax.Array:
    """1.5-entmax along ``axis``: ``p = [x/2 - τ]_+²`` with τ such that the row sums to one.

    Sparse like sparsemax but smoother (Peters, Niculae & Martins, 2019). Equal to
    ``entmax(x, 1.5)``. The threshold comes from Newton steps from the left that stop as soon
    as the exact quadratic root on the current support is consistent (module docstring), so the
    result is exact to float rounding.

    Args:
      x: scores of any float dtype and shape, e.g. ``[batch, heads, q, kv]``.
      axis: the axis that sums to one.
      where: optional boolean mask broadcastable to ``x`` (True = allowed); ``-inf`` also masks.

    Returns:
      Probabilities with the shape and dtype of ``x``.

    Example:
      >>> print(np.asarray(entmax15(jnp.array([1.0, 0.8, -1.0]))).round(4))
      [0.5705 0.4295 0.    ]
    """
    x, axis, dtype = _prepare(x, axis, where, "entmax15")
    return _finish(_entmax15_rows(x), axis, dtype)


def entmax(x, alpha, axis: int = -1, *, where=None) -> jax.Array:
    """α-entmax along ``axis``: ``p = [(α-1) x - τ]_+^(1/(α-1))`` summing to one.

    α → 1 tends to softmax, α = 1.5 is :func:`entmax15`, α = 2 is :func:`sparsemax`; larger α
    gives sparser outputs. A python float 1.5 or 2.0 uses those exact algorithms; any other α
    (or an array of α) uses safeguarded Newton iterations on the threshold, stopped at float
    rounding, with the output divided by its sum so that rows sum to one.

    Differentiable with respect to ``x`` and ``alpha`` (learned α per head, as in "Adaptively
    Sparse Transformers"). A traced α cannot be checked for α > 1: parametrise a learned α as
    ``1 + softplus(θ)`` (or ``1 + sigmoid(θ)`` for α ∈ (1, 2)).

    Args:
      x: scores of any float dtype, e.g. ``[batch, heads, q, kv]``.
      alpha: a float > 1, or an array broadcastable to ``x`` without ``axis`` (e.g. one α per
        head: shape ``[heads, 1]`` for scores ``[batch, heads, q, kv]`` with ``axis=-1``).
      axis: the axis that sums to one.
      where: optional boolean mask broadcastable to ``x`` (True = allowed); ``-inf`` also masks.

    Returns:
      Probabilities with the shape and dtype of ``x``.

    Example:
      >>> print(np.asarray(entmax(jnp.array([1.0, 0.8, -1.0]), 1.25)).round(3))
      [0.55  0.433 0.017]
    """
    x = _check_scores(x, "entmax")
    axis = _check_axis(axis, x.ndim, "entmax")
    alpha = _check_alpha(alpha, x.shape[:axis] + x.shape[axis + 1 :], "entmax")
    if isinstance(alpha, float) and alpha == 2.0:
        return sparsemax(x, axis, where=where)
    if isinstance(alpha, float) and alpha == 1.5:
        return entmax15(x, axis, where=where)
    x, axis, dtype = _prepare(x, axis, where, "entmax")
    alpha = jnp.asarray(alpha, x.dtype)
    alpha = jnp.broadcast_to(alpha, x.shape[:-1])[..., None]
    return _finish(_entmax_rows(x, alpha), axis, dtype)


# --------------------------------------------------------------------------------------------
# Fenchel–Young losses.
# --------------------------------------------------------------------------------------------


def _fenchel_young_loss(logits, labels, alpha, where, name):
    """Multiclass Fenchel–Young loss of the Tsallis α-entropy over the last axis.

    L(θ, y) = <p, θ> - θ_y + H_α(p),   p = entmax_α(θ),   H_α(p) = (1 - Σ p^α) / (α (α - 1)),

    which is >= 0, zero iff p is one-hot on y, and has gradient p - onehot(y) (Blondel, Martins &
    Niculae, 2020). The gradient in θ and in α comes from holding p fixed (Danskin's theorem: p
    maximises <p, θ> + H_α(p)), so no derivative is taken through the normalizer.
    """
    logits = _check_scores(logits, name, "logits")
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"{name}: `labels` must be integer class indices; got dtype {labels.dtype}."
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"{name}: `labels` must have shape logits.shape[:-1] = {logits.shape[:-1]}; "
            f"got {labels.shape}."
        )
    num_classes = logits.shape[-1]
    if _is_concrete(labels) and labels.size:
        low, high = int(np.min(np.asarray(labels))), int(np.max(np.asarray(labels)))
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"{name}: `labels` must lie in [0, {num_classes}) for {num_classes} classes; "
                f"got values in [{low}, {high}]."
            )
    where = _check_where(where, labels.shape, name)
    alpha = _check_alpha(alpha, logits.shape[:-1], name)

    in_dtype = logits.dtype
    theta = logits.astype(_compute_dtype(in_dtype))
    if where is not None:
        # Padding rows become all-zero logits, so nothing NaN reaches the masked-out gradient.
        theta = jnp.where(where[..., None], theta, 0.0)
    # p enters as a constant (Danskin), so no derivative, forward or reverse, reaches entmax.
    if isinstance(alpha, float):
        alpha_rows = alpha
        p = entmax(jax.lax.stop_gradient(theta), alpha)
    else:
        alpha_rows = jnp.broadcast_to(jnp.asarray(alpha, theta.dtype), labels.shape)
        p = entmax(jax.lax.stop_gradient(theta), jax.lax.stop_gradient(alpha_rows))
    theta = theta - jax.lax.stop_gradient(jnp.max(theta, axis=-1, keepdims=True))
    support = p > 0.0
    inner = jnp.sum(jnp.where(support, p * theta, 0.0), axis=-1)
    theta_label = jnp.take_along_axis(theta, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    alpha_per_class = alpha_rows if isinstance(alpha, float) else alpha_rows[..., None]
    log_p = jnp.log(jnp.where(support, p, 1.0))
    p_pow_alpha = jnp.sum(jnp.where(support, jnp.exp(alpha_per_class * log_p), 0.0), axis=-1)
    tsallis = (1.0 - p_pow_alpha) / (alpha_rows * (alpha_rows - 1.0))
    loss = inner - theta_label + tsallis
    if where is not None:
        loss = jnp.where(where, loss, 0.0)
    return loss.astype(in_dtype)


def sparsemax_loss(logits, labels, *, where=None) -> jax.Array:
    """Multiclass sparsemax loss (the Fenchel–Young loss of sparsemax) over the last axis.

    Not ``optax.losses.sparsemax_loss``, which is the *binary* loss of ``sparse_sigmoid``; this
    one equals ``optax.losses.multiclass_sparsemax_loss`` and adds a padding mask:
    ``loss = <p, θ> - θ_y + (1 - ||p||²) / 2`` with ``p = sparsemax(θ)``; its gradient is
    ``p - onehot(y)``.

    Args:
      logits: ``[..., num_classes]`` float scores.
      labels: ``[...]`` integer class indices in ``[0, num_classes)``.
      where: optional ``[...]`` boolean; False entries (padding) get loss 0 and zero gradient.

    Returns:
      Per-example losses ``[...]`` (no reduction), in the logits' dtype.

    Example:
      >>> print(np.asarray(sparsemax_loss(jnp.array([[2.0, 0.0, -1.0]]), jnp.array([0]))))
      [0.]
    """
    return _fenchel_young_loss(logits, labels, 2.0, where, "sparsemax_loss")


def entmax15_loss(logits, labels, *, where=None) -> jax.Array:
    """Multiclass 1.5-entmax Fenchel–Young loss over the last axis; gradient ``p - onehot(y)``.

    ``loss = <p, θ> - θ_y + (1 - Σ p^1.5) / 0.75`` with ``p = entmax15(θ)``. Arguments and
    return value as :func:`sparsemax_loss`.

    Example:
      >>> print(np.asarray(entmax15_loss(jnp.array([[0.0, 0.0]]), jnp.array([1]))).round(4))
      [0.3905]
    """
    return _fenchel_young_loss(logits, labels, 1.5, where, "entmax15_loss")


def entmax_loss(logits, labels, alpha, *, where=None) -> jax.Array:
    """Multiclass α-entmax Fenchel–Young loss over the last axis, differentiable in ``alpha``.

    ``loss = <p, θ> - θ_y + (1 - Σ p^α) / (α (α - 1))`` with ``p = entmax(θ, α)``; gradient
    ``p - onehot(y)`` in the logits. ``alpha``: a float > 1 or an array broadcastable to
    ``labels``' shape. Other arguments as :func:`sparsemax_loss`.

    Example:
      >>> print(np.asarray(entmax_loss(jnp.array([[0.0, 0.0]]), jnp.array([1]), 2.0)))
      [0.25]
    """
    return _fenchel_young_loss(logits, labels, alpha, where, "entmax_loss")


# --------------------------------------------------------------------------------------------
# Softmax beside the sparse normalizers, and one entry point by name (what the engines call).
# --------------------------------------------------------------------------------------------

#: Normalizer names accepted by ``normalizer=`` (besides an α, a float > 1 or an array).
NORMALIZERS = ("softmax", "sparsemax", "entmax15")


@jax.custom_jvp
def masked_softmax(s: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to ``allowed``; rows with nothing allowed give 0.

    Zero gradients there too, also when the allowed scores are all ``-inf`` (a ``-inf`` bias),
    where ``jax.nn.softmax(where=...)`` gives NaN; ``jax.nn.dot_product_attention`` averages
    the values of a fully masked row instead of returning 0.

    The JVP is written out (``p * (ds - <p, ds>)``) so that reverse mode keeps only ``p`` as a
    residual, not the masking ``where``s (2.4x faster whole attention: docs/benchmarks.md,
    "Design measurements").
    """
    row_max = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(row_max > -jnp.inf, row_max, 0.0))
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, row_max) - row_max), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0.0, total, 1.0)


@masked_softmax.defjvp
def _masked_softmax_jvp(primals, tangents):
    s, allowed = primals
    ds, _ = tangents
    p = masked_softmax(s, allowed)
    return p, p * (ds - jnp.sum(p * ds, axis=-1, keepdims=True))


def normalize(s: jax.Array, allowed: jax.Array | None, normalizer: Any) -> jax.Array:
    """Scores ``s [..., keys]`` to weights under a checked normalizer (a name or an α).

    ``allowed`` (bool, broadcastable to ``s``, or None) masks keys; ``-inf`` scores are masked
    too. An α array must already broadcast to ``s`` without its last axis.
    """
    if isinstance(normalizer, str):
        if normalizer == "softmax":
            finite = s > -jnp.inf
            return masked_softmax(s, finite if allowed is None else finite & allowed)
        if normalizer == "sparsemax":
            return sparsemax(s, axis=-1, where=allowed)
        return entmax15(s, axis=-1, where=allowed)
    return entmax(s, normalizer, axis=-1, where=allowed)
