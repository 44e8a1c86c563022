"""Sparse normalizers (sparsemax, 1.5-entmax, α-entmax) and their Fenchel–Young losses.

α-entmax maps scores ``x`` to the probability vector

    p_i = [(α - 1) x_i - τ]_+ ^ (1 / (α - 1)),      with τ chosen so that Σ_i p_i = 1.

α → 1 recovers softmax, α = 2 is sparsemax (Martins & Astudillo, 2016) and α = 1.5 is 1.5-entmax
(Peters, Niculae & Martins, 2019); every α > 1 gives exact zeros. "Adaptively Sparse Transformers"
(Correia et al., 2019) learn one α per attention head, so ``entmax`` differentiates in α too.

How the threshold τ is found (the part that decides speed)
-----------------------------------------------------------
The textbook algorithm sorts every row. On XLA:CPU a row sort costs many times the rest of
attention (docs/benchmarks.md, "Normalizers", against optax's sort-based projection), so
nothing here sorts. Every row is shifted so that its maximum is 0; then τ ∈ [-1, -(1/n)^(α-1)]
and f(τ) = Σ_i [z_i - τ]_+^(1/(α-1)) - 1 is decreasing. Each iteration is *one* pass over the
row that gathers a few sums over the current support S(τ) = {i : z_i > τ} in fused variadic
reductions; all rows iterate together until the last one is finished. On CPU each row is summed
in two stages, as a short column of vectors and then across them, which XLA:CPU vectorises
(``_row_sums``; docs/benchmarks.md, "Two-stage row sums on CPU").

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
  α > 2), until the step is at rounding level; the output is divided by its sum. For α - 1 <=
  0.05 the threshold is held as σ = 1 + τ (τ is then near -1, where a float keeps too few of
  its digits for p = u^(1/(α-1))), which keeps values, derivatives and losses accurate to
  float32 rounding for every α > 1 down to 1 + 1e-7, approaching softmax continuously
  (tests/test_reliability_normalizers.py checks them against a float64 reference).

The iterations never enter the derivative: custom rules use the closed form
``dp = s ⊙ dx - s (sᵀdx) / Σs`` with s_i = p_i^(2-α) on the support (a symmetric Jacobian, so
the same product serves forward and reverse mode), which is linear in the row length, and the
α derivative of Correia et al. (2019), rewritten without a division by α - 1 in
``_entmax_dp_dalpha``. ``sparsemax`` has a custom JVP (forward and reverse mode: ``jax.jvp``,
``jax.jacfwd``, ``jax.hessian`` work); ``entmax15`` and ``entmax`` have custom VJPs (reverse
mode only: ``jax.grad``, ``jax.vjp``, ``jax.jacrev``; ``jax.jvp``/``jacfwd``/``hessian``
raise), whose only residual is the output: see the comment above ``_entmax15_s``.

Conventions shared by every function here: the row is ``axis`` (default last); positions where
``where`` is False, or whose score is ``-inf``, get probability exactly 0; a row with no allowed
position returns zeros and a zero gradient (never NaN); float16/bfloat16 inputs are computed in
float32 and returned in their own dtype.

Non-finite scores, one policy for every normalizer (``masked_softmax``/``normalize`` included)
and, through them, both attention engines:

* NaN at an allowed position: the whole row is NaN (NaN in, NaN out: never a silent zero or a
  partly NaN row), and so are the row's derivatives.
* Values at masked positions (``where`` False) never matter, NaN and ±inf included.
* ``-inf``: masked (probability exactly 0).
* ``+inf`` at an allowed position: the row's weight goes uniformly to its ``+inf`` entries
  (the limit of raising them together); the others get 0, the values and gradients are finite.
  (Scores equal to the largest finite float count as ``+inf``.)
* ``alpha`` must be finite and > 1: ``inf``, NaN, <= 1 raise a ``ValueError`` naming it
  (when concrete; a traced α cannot be checked). The losses are NaN for a NaN logit in a row
  that is not padding.

Arguments are checked before anything is traced: a wrong type, an empty normalized axis, a bad
``axis`` (python or numpy integers, 0-d integer arrays), ``where`` or ``alpha`` raise
``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

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
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number, list, tuple)):
        raise TypeError(f"{name}: `{arg}` must be a float array; got {type(x).__name__} {x!r:.60}.")
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name}: `{arg}` must be a float array; got {x!r:.60} ({error})."
        ) from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name}: `{arg}` must have a floating dtype (float32, float16, bfloat16, float64); "
            f"got dtype {x.dtype}. Cast it first, e.g. `{arg}.astype(jnp.float32)`."
        )
    if x.ndim == 0:
        raise ValueError(f"{name}: `{arg}` must have at least one dimension; got a scalar.")
    return x


def _check_row_length(x, axis: int, name: str, arg: str = "x") -> None:
    if x.shape[axis] == 0:
        raise ValueError(
            f"{name}: `{arg}` with shape {tuple(x.shape)} has an empty axis {axis}, the axis that "
            "is normalized; a distribution needs at least one entry (an empty batch axis is fine)."
        )


def _check_axis(axis, ndim: int, name: str) -> int:
    if isinstance(axis, (bool, np.bool_)):
        raise TypeError(f"{name}: `axis` must be an int; got {axis!r}.")
    try:
        index = operator.index(axis)  # python and numpy integers, 0-d integer arrays
    except TypeError:
        raise TypeError(
            f"{name}: `axis` must be a static int; got {axis!r:.60} ({type(axis).__name__})."
        ) from None
    if not -ndim <= index < ndim:
        raise ValueError(
            f"{name}: `axis`={index} is out of range for an input with {ndim} dimension(s); "
            f"allowed: {-ndim} <= axis < {ndim}."
        )
    return index % ndim


def _check_where(where, shape: tuple[int, ...], name: str, arg: str = "where") -> jax.Array | None:
    if where is None:
        return None
    if not isinstance(where, (jax.Array, np.ndarray, np.generic, bool, list, tuple)):
        raise TypeError(
            f"{name}: `{arg}` must be None or a boolean array (True = allowed); got "
            f"{type(where).__name__}."
        )
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(
            f"{name}: `{arg}` must be a boolean array (True = allowed); got dtype {where.dtype}."
        )
    try:
        np.broadcast_shapes(where.shape, shape)
    except ValueError:
        raise ValueError(
            f"{name}: `{arg}` with shape {where.shape} does not broadcast to the scores' shape "
            f"{shape}."
        ) from None
    return where


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _check_alpha(alpha, row_batch_shape: tuple[int, ...], name: str, arg: str = "alpha"):
    """Returns a python float for scalar α, or a float array broadcastable to the row batch.

    α must be finite and > 1; an array α is checked when it is concrete (a traced α cannot be).
    """
    allowed = "a finite float > 1, or a float array of such α"
    if isinstance(alpha, (bool, np.bool_)):
        raise TypeError(f"{name}: `{arg}` must be {allowed}; got {alpha!r}.")
    if isinstance(alpha, numbers.Real):
        value = float(alpha)
        if not (math.isfinite(value) and value > 1.0):
            raise ValueError(
                f"{name}: `{arg}` must be finite and > 1 (α -> 1 is softmax, use "
                f"jax.nn.softmax; α -> inf puts all weight on the maximum); got alpha={value}."
            )
        return value
    if not isinstance(alpha, (jax.Array, np.ndarray, list, tuple)):
        raise TypeError(
            f"{name}: `{arg}` must be {allowed}; got {type(alpha).__name__} {alpha!r:.60}."
        )
    try:
        alpha = jnp.asarray(alpha)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: `{arg}` must be {allowed}; got {alpha!r:.60}.") from None
    if not (jnp.issubdtype(alpha.dtype, jnp.floating) or jnp.issubdtype(alpha.dtype, jnp.integer)):
        raise TypeError(f"{name}: `{arg}` must be a real number or array; got dtype {alpha.dtype}.")
    if alpha.ndim > len(row_batch_shape) or _broadcasts(alpha.shape, row_batch_shape) is None:
        raise ValueError(
            f"{name}: `{arg}` with shape {alpha.shape} must broadcast to the scores' shape "
            f"without the normalized axis, {row_batch_shape} (for example one α per head)."
        )
    if _is_concrete(alpha):
        values = np.asarray(alpha)
        bad = ~(np.isfinite(values) & (values > 1.0))
        if bad.any():
            raise ValueError(
                f"{name}: every `{arg}` must be finite and > 1; got {values[bad][:5]} "
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
    """Checks arguments; returns (scores with the row last and masked entries -inf, axis, dtype).

    Masked entries become -inf whatever they held (NaN included): they never matter.
    """
    x = _check_scores(x, name)
    axis = _check_axis(axis, x.ndim, name)
    _check_row_length(x, axis, name)
    where = _check_where(where, x.shape, name)
    in_dtype = x.dtype
    x = x.astype(_compute_dtype(in_dtype))
    x = _finite_above(x)
    if where is not None:
        x = jnp.where(where, x, -jnp.inf)
    return jnp.moveaxis(x, axis, -1), axis, in_dtype


@jax.custom_jvp
def _finite_above(x):
    """+inf -> the largest finite float (the policy for +inf: see _shift_to_zero_max).

    Done here, where x is formed anyway, with an identity derivative: as a plain jnp.minimum
    in the row kernels, or differentiated (a saved mask and a select in the backward pass), it
    slowed whole attention measurably.
    """
    return jnp.minimum(x, jnp.finfo(x.dtype).max)


@_finite_above.defjvp
def _finite_above_jvp(primals, tangents):
    return _finite_above(primals[0]), tangents[0]


def _finish(p, axis, dtype):
    return jnp.moveaxis(p, -1, axis).astype(dtype)


# --------------------------------------------------------------------------------------------
# Row kernels: the row is the last axis, dtype float32/64, masked entries are -inf.
# --------------------------------------------------------------------------------------------


def _shift_to_zero_max(x):
    """Rows x (masked entries -inf) made ready for a threshold search, under the non-finite policy.

    Returns (z, has_any, nan_row). z = x - max(x) per row. _prepare has replaced +inf by the
    largest finite float, so a row that held +inf has z = 0 exactly at those entries and
    z ~ -3e38 (or -inf) elsewhere: all its weight goes uniformly to them. XLA's max propagates
    NaN, so a row holding NaN gets max NaN and z NaN everywhere; its has_any is False (no
    iteration waits for it) and its output is NaN. A row with nothing allowed gets z = -inf.
    No elementwise operation beyond the old shift: this runs twice per attention chunk (forward
    and recomputation), where every extra pass over the scores shows.
    """
    row_max = jnp.max(x, axis=-1, keepdims=True)
    has_any = row_max > -jnp.inf
    return x - jnp.where(row_max == -jnp.inf, 0.0, row_max), has_any, jnp.isnan(row_max)


def _poison(p, nan_row):
    """A row whose scores held NaN at an allowed position is NaN everywhere (NaN in, NaN out)."""
    return jnp.where(nan_row, jnp.nan, p)


def _start(z):
    """τ = -1 for every row: a lower bound of the threshold once the row maximum is 0."""
    return jnp.full((*z.shape[:-1], 1), -1.0, z.dtype)


def _row_sums(*operands, minima: int = 0):
    """Sums of several arrays over the last axis, keepdims, each pass one fused reduction; the
    last ``minima`` operands are reduced by their minimum instead.

    Why not ``jnp.sum`` per quantity: XLA:CPU hands a plain sum to a library kernel that needs
    its input materialised, so each sum costs a write and a read of the whole score array; the
    variadic reduce fuses the elementwise producers into the loop (a faster pass).
    On CPU the row is also summed in two stages, two quantities per reduction (see
    :func:`_cpu_sum_width`); elsewhere all of them go into one reduction.
    """
    n = operands[0].shape[-1]
    is_min = (False,) * (len(operands) - minima) + (True,) * minima
    width, padded = _cpu_sum_width(n) or (None, n)
    if width is None or padded != n:
        sums = _reduce_last(operands, operands[0].ndim - 1, is_min)
    else:

        def in_two_stages(*ops):
            sums = []
            for i in range(0, len(ops), 2):
                pair, mins = ops[i : i + 2], is_min[i : i + 2]
                split = tuple(op.reshape(*op.shape[:-1], padded // width, width) for op in pair)
                axis = split[0].ndim - 2
                sums += _reduce_last(_reduce_last(split, axis, mins), axis, mins)
            return tuple(sums)

        sums = jax.lax.platform_dependent(
            *operands,
            cpu=in_two_stages,
            default=lambda *ops: _reduce_last(ops, ops[0].ndim - 1, is_min),
        )
    return tuple(s[..., None] for s in sums)


def _reduce_last(operands, axis: int, is_min: tuple[bool, ...] | None = None) -> tuple:
    """Sums (minima where ``is_min``) of ``operands`` over ``axis`` in one variadic reduction
    (one operand: reduce_sum / reduce_min, which, unlike a variadic reduction, have the
    transpose rule reverse mode needs)."""
    is_min = is_min or (False,) * len(operands)
    if len(operands) == 1:
        return ((jnp.min if is_min[0] else jnp.sum)(operands[0], axis=axis),)
    return jax.lax.reduce(
        tuple(operands),
        tuple(
            jnp.array(jnp.inf if m else 0, op.dtype) for op, m in zip(operands, is_min, strict=True)
        ),
        lambda a, b: tuple(
            jnp.minimum(x, y) if m else x + y for x, y, m in zip(a, b, is_min, strict=True)
        ),
        (axis,),
    )


def _cpu_sum_width(n: int) -> tuple[int, int] | None:
    """(w, n') when a row of n, padded to n' < n + 8, is best summed as [n'/w, w] on CPU; or None.

    XLA:CPU does not vectorise a reduction along the minor axis (float addition is not
    reassociated), but it does vectorise one along a short major axis: summing the row viewed
    as [a, w] over a first (w lanes at a time), then the w partial sums, is faster per pass for
    a short a (up to about 37 with sparsemax's two terms, less with 1.5-entmax's four) and w a
    multiple of 8, timed over a = 2-68 and w = 8-2048 on a 2-core CPU. So: the shortest padding,
    then the a of 6-32 closest to 20. Whole normalizers: ``python -m experiments.bench
    normalizers`` (docs/benchmarks.md, "Two-stage row sums on CPU").
    """
    for padded in range(n, n + 8):
        for rows in sorted(range(6, 33), key=lambda a: abs(a - 20)):
            if padded % rows == 0 and (padded // rows) % 8 == 0:
                return padded // rows, padded
    return None


def _pad_last(x, pad: int, value):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=value)


def _row_loop(body, init, max_iter: int):
    """Runs ``state = body(state)`` until every row reports done (state[-1]) or max_iter passes."""

    def cond(carry):
        it, state = carry
        return jnp.logical_and(it < max_iter, jnp.logical_not(jnp.all(state[-1])))

    def step(carry):
        it, state = carry
        return it + 1, body(state)

    return jax.lax.while_loop(cond, step, (jnp.int32(0), init))[1]


class RowSearch(NamedTuple):
    """A threshold search split into per-entry terms and a per-row update.

    One pass of a search sums ``terms(z, state)`` (a tuple of arrays shaped like ``z``) over the
    row (the last ``minima`` terms: takes their minimum) and hands the results (each
    ``[..., 1]``) to ``update(state, sums)``, which returns the next state; ``state[0]`` is the
    threshold and ``state[-1]`` says the row is done. Split this way, the same search runs on
    whole rows here (:func:`_run_search`) and on rows held in blocks by a fused kernel, which
    combines each block's sums and minima (:mod:`sparse_jax.kernels`).
    """

    init: tuple
    terms: Callable[[jax.Array, tuple], tuple]
    update: Callable[[tuple, tuple], tuple]
    max_iter: int
    minima: int = 0


def _run_search(z, search: RowSearch):
    """Runs ``search`` on rows z (last axis) to the end; returns the final state.

    On CPU a row whose length has no fast two-stage split (:func:`_cpu_sum_width`) is padded
    once with up to 7 ``-inf`` (outside every support) to one that has: padding inside each
    pass would cost the speed it buys.
    """

    def run(z):
        def body(state):
            return search.update(state, _row_sums(*search.terms(z, state), minima=search.minima))

        return _row_loop(body, search.init, search.max_iter)

    n = z.shape[-1]
    padded = (_cpu_sum_width(n) or (None, n))[1]
    if padded == n:
        return run(z)
    return jax.lax.platform_dependent(
        z,
        cpu=lambda z: run(_pad_last(z, padded - n, -jnp.inf)),
        default=run,
    )


def sparsemax_start(top) -> jax.Array:
    """A start for :func:`sparsemax_search` from each row's largest values: a lower bound of
    the threshold, tighter than ``-1``.

    ``top``: a sequence of ``k`` arrays ``[..., 1]``, the row's largest values in decreasing
    order, shifted so that the row's maximum is 0 (``top[0]`` = 0), ``-inf`` where a row has
    fewer. Returns ``max_k (Σ_{i<=k} top_i - 1) / k``: each term is the closed form of the
    threshold on the row's k largest entries, and the exact threshold τ* is the largest such
    term over all k (a set that contains the support gives at most τ*, and so does a set inside
    it), so every term is <= τ*. Values smaller than the true k largest (ties dropped) only
    lower a term. With the support among the k, the start is τ* itself and the search only
    confirms it.

    Example:
      >>> top = [jnp.array([[0.0]]), jnp.array([[-0.2]]), jnp.array([[-0.5]]), jnp.array([[-3.0]])]
      >>> round(float(sparsemax_start(top)[0, 0]), 4)  # support {0, -0.2, -0.5}: τ* = -0.5667
      -0.5667
    """
    start, total = None, 0.0
    for k, value in enumerate(top, start=1):
        total = total + value
        term = (total - 1.0) / k
        start = term if start is None else jnp.maximum(start, term)
    return start


def sparsemax_search(tau0, done0, row_length: int, *, smallest: bool = False) -> RowSearch:
    """Exact sparsemax threshold of rows z (max 0) by Michelot's iteration; τ shape [..., 1].

    Each pass takes τ' = (Σ_S z - 1)/|S| on S = {z > τ}, from a start τ0 <= τ*: the iterates
    rise to τ* and the supports shrink to its support, so an unchanged support size means an
    unchanged support: τ is then the closed form on its own support, the exact threshold.

    With ``smallest``, each pass also takes S's smallest entry (a row minimum beside the two
    sums): if it is >= τ', S is the support at τ' too (the entries outside S are <= τ <= τ'),
    so τ' is exact and the row is done in that pass, one pass before the size shows it (a start
    at the threshold takes one pass). The fused kernels take it, where a pass recomputes a
    tile's scores over every kept block; XLA's whole-row passes do not: on CPU the minimum
    costs more than the pass it saves (docs/benchmarks.md).
    """

    def terms(z, state):
        in_support = z > state[0]
        sums = (in_support.astype(z.dtype), jnp.where(in_support, z, 0.0))
        return (*sums, jnp.where(in_support, z, jnp.inf)) if smallest else sums

    def update(state, sums):
        tau, previous_size, done = state
        size, total = sums[:2]
        new_tau = (total - 1.0) / jnp.maximum(size, 1.0)
        finished = size == previous_size
        if smallest:
            finished = finished | (sums[2] >= new_tau)
        return jnp.where(done, tau, new_tau), size, done | finished

    init = (tau0, jnp.full_like(tau0, -1.0), done0)
    return RowSearch(init, terms, update, row_length + 1, minima=int(smallest))


def entmax15_start(top) -> jax.Array:
    """A start for :func:`entmax15_search` from each row's largest values: a lower bound of
    the threshold, tighter than ``-1``.

    ``top``: a sequence of ``k`` arrays ``[..., 1]``, the row's largest search variables
    ``z = (x - max) / 2`` in decreasing order (``top[0]`` = 0), ``-inf`` where a row has fewer.
    For each k, the smaller root τ_k of ``Σ_{i<=k} (top_i - τ)² = 1`` is kept when it lies at
    or below ``top_k``: the k values are then all above it, so ``Σ [z - τ_k]_+² >= 1`` over the
    row and τ_k <= τ* (the row's sum decreases in τ). Returns the largest kept root, or -1.
    Values smaller than the true k largest (ties dropped) keep this true.

    Example:
      >>> top = [jnp.array([[0.0]]), jnp.array([[-0.1]]), jnp.array([[-2.0]]), jnp.array([[-3.0]])]
      >>> round(float(entmax15_start(top)[0, 0]), 4)  # support {0, -0.1}: τ* itself
      -0.7553
    """
    start, s1, s2 = None, 0.0, 0.0
    for k, value in enumerate(top, start=1):
        s1, s2 = s1 + value, s2 + value * value
        disc = s1 * s1 - k * (s2 - 1.0)
        root = (s1 - jnp.sqrt(jnp.where(disc >= 0.0, disc, 0.0))) / k
        root = jnp.where((disc >= 0.0) & (root <= value), root, -1.0)
        start = root if start is None else jnp.maximum(start, root)
    return jnp.maximum(start, -1.0)


def entmax15_search(tau0, done0, *, smallest: bool = False) -> RowSearch:
    """Exact 1.5-entmax threshold of rows z = (x - max)/2 (p = [z - τ]_+²); τ shape [..., 1].

    Newton steps on ||[z - τ]_+||_2 - 1 from a start τ0 <= τ* (monotone: the function is convex
    and decreasing). Every pass also forms the exact quadratic root τ_c of Σ_S (z - τ)² = 1 on
    its support S and, in the next pass, counts the entries >= τ_c: if they cover S, the KKT
    conditions hold and τ_c is the threshold. Finish with :func:`entmax15_polish` (τ_c may have
    been formed far from the root, where its differences lose digits).

    With ``smallest``, a pass takes S's smallest entry m (a row minimum) in place of the count:
    if m >= τ_c, S is the support at τ_c (entries outside S are <= τ <= τ_c) and the row is
    done in that pass, not the next; otherwise τ* > m (Σ_S (z - m)² > 1) and the next τ is the
    larger of m and the Newton step, both lower bounds. For the fused kernels, as in
    :func:`sparsemax_search`. This search polishes itself, and only where it must: τ_c formed
    close to the root (``Σ_S (z - τ)² - 1 <= POLISH_FREE_EXCESS`` and the discriminant at least
    a quarter of ``(Σ_S (z - τ))²``, so that neither difference loses digits) is exact to
    rounding as it is; a row whose τ_c was formed farther takes one more pass, whose sums
    (centred on τ_c) :func:`entmax15_polish` turns into the threshold. No polish after it.
    """
    if smallest:
        return _entmax15_search_smallest(tau0, done0)

    def terms(z, state):
        tau, candidate = state[0], state[1]
        in_support = z > tau
        u = jnp.where(in_support, z - tau, 0.0)
        return in_support.astype(z.dtype), u, u * u, (z >= candidate).astype(z.dtype)

    def update(state, sums):
        tau, candidate, candidate_size, done = state
        size, s1, s2, count = sums
        _, disc, root, newton = _entmax15_steps(tau, size, s1, s2)
        finished = count >= candidate_size
        new_tau = jnp.where(finished, candidate, newton)
        return (
            jnp.where(done, tau, new_tau),
            root,
            jnp.where(disc >= 0.0, size, jnp.inf),
            done | finished,
        )

    init = (tau0, tau0, jnp.full_like(tau0, jnp.inf), done0)
    return RowSearch(init, terms, update, _ENTMAX15_MAX_ITER)


# How far from its root a pass' closed form may be formed and still be exact to rounding
# (checked against float64 thresholds by sorting on random, tied and scaled rows, in
# tests/test_normalizers.py): at the kernels' start the row that finishes is mostly within
# 0.15 of it, and 1.5-entmax's polishing pass is then skipped.
POLISH_FREE_EXCESS = 0.5


def _entmax15_steps(tau, size, s1, s2):
    """From a pass' sums over S = {z > τ} (|S|, Σ u, Σ u², u = z - τ): ``(excess, disc, root,
    newton)``: ``Σ u² - 1`` (>= 0 left of the threshold), the discriminant of the quadratic on
    S, its smaller root (τ plus the δ of ``Σ_S (u - δ)² = 1``, written without cancellation)
    and the Newton step on ``||u||_2 - 1``, which is nearly linear, rather than on ``Σ u² - 1``."""
    excess = s2 - 1.0
    disc = s1 * s1 - size * excess
    root = tau + excess / (s1 + jnp.sqrt(jnp.maximum(disc, 0.0)))
    norm = jnp.sqrt(s2)
    return excess, disc, root, tau + (norm - 1.0) * norm / s1


def _entmax15_search_smallest(tau0, done0) -> RowSearch:
    """:func:`entmax15_search` with ``smallest``: state (τ, root found, done)."""

    def terms(z, state):
        in_support = z > state[0]
        u = jnp.where(in_support, z - state[0], 0.0)
        return in_support.astype(z.dtype), u, u * u, jnp.where(in_support, z, jnp.inf)

    def update(state, sums):
        tau, found, done = state
        size, s1, s2, smallest = sums
        excess, disc, root, newton = _entmax15_steps(tau, size, s1, s2)
        exact = (disc >= 0.0) & (smallest >= root)
        close = (excess <= POLISH_FREE_EXCESS) & (4.0 * disc >= s1 * s1)
        # A found row's sums are centred on its root: the same closed form is then its polish
        # (entmax15_polish's, whose guards matter only for rows with S empty, all done). (A
        # done row's NaN step, s1 = 0, is never taken: its τ is kept.)
        step = jnp.where(newton > smallest, newton, smallest)
        new_tau = jnp.where(found | exact, root, step)
        return (
            jnp.where(done, tau, new_tau),
            found | exact,
            done | found | (exact & close),
        )

    # (one pass more than the count's search: the polishing one)
    return RowSearch((tau0, done0, done0), terms, update, _ENTMAX15_MAX_ITER + 1, minima=1)


def entmax15_polish_terms(z, tau):
    """Per-entry terms of :func:`entmax15_polish` (summed over the row)."""
    in_support = z > tau
    u = jnp.where(in_support, z - tau, 0.0)
    return in_support.astype(z.dtype), u, u * u


def entmax15_polish(tau, sums):
    """The final 1.5-entmax threshold from the sums of :func:`entmax15_polish_terms`.

    The search's candidate was formed at a Newton iterate that may still have been far from the
    root, where Σ(u - δ)² = 1 loses digits to cancellation. The same closed form taken once
    more, from sums centred on the (now nearly exact) τ, is exact to float rounding.
    """
    size, s1, s2 = sums
    excess = s2 - 1.0
    disc = jnp.maximum(s1 * s1 - size * excess, 0.0)
    polished = tau + excess / jnp.maximum(s1 + jnp.sqrt(disc), jnp.finfo(tau.dtype).tiny)
    return jnp.where(size > 0.0, polished, tau)


def _sparsemax_threshold(z, tau0, done0):
    return _run_search(z, sparsemax_search(tau0, done0, z.shape[-1]))[0]


def _entmax15_threshold(z, tau0, done0):
    tau = _run_search(z, entmax15_search(tau0, done0))[0]
    return entmax15_polish(tau, _row_sums(*entmax15_polish_terms(z, tau)))


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
    return _run_search(z, entmax_search(eps, sigma, n_valid, done0))[0]


def _jacobian_product(s, dx):
    """J·dx = s ⊙ dx - s (sᵀdx) / Σs, the Jacobian of entmax (symmetric, so also Jᵀ·dx).

    s_i = p_i^(2-α) on the support and 0 elsewhere: 1[p > 0] for sparsemax, √p for entmax15;
    NaN on a NaN row, which makes the whole row's derivative NaN.
    """
    s_dx = jnp.where(s > 0.0, s * dx, 0.0)
    # Two reductions, not one: under jax.linearize a sum taken together with s ⊙ dx would count
    # as a tangent, and the division by it could not be transposed.
    (s_sum,), (s_dx_sum,) = _row_sums(s), _row_sums(s_dx)
    return s_dx - s * s_dx_sum / jnp.where(s_sum > 0.0, s_sum, 1.0)


# sparsemax has a custom JVP (forward and reverse mode). entmax15 and α-entmax have custom VJPs
# (reverse mode only: jax.jvp, jacfwd and jax.hessian raise) whose only residual is the output
# p, which attention keeps anyway for its value product. A custom JVP, its tangent map
# recomputed from p under jax.checkpoint so that p stays the only residual, was measured too:
# whole attention forward+backward ran slower with 1.5-entmax, so the VJPs stay.


def _entmax15_s(p):
    return jnp.sqrt(p)  # 0 off the support, NaN on NaN rows


def _entmax_s(p, eps):
    positive = p > 0.0
    return jnp.where(positive, jnp.exp((1.0 - eps) * jnp.log(jnp.where(positive, p, 1.0))), p * 0.0)


def _sparsemax_tangent(p, dx):
    # s = sign(p), NaN on NaN rows, which carries them through both modes (in reverse, the
    # product with s comes after the support's select). Forms of s without NaN plus a separate
    # NaN term ran whole attention fwd+bwd slower on XLA:CPU, though sparsemax alone ran its
    # reverse pass faster (docs/benchmarks.md, "A regression found: sparsemax's backward").
    return _jacobian_product(jnp.sign(p), dx)


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
    s_sum, c_sum, rest_sum = _row_sums(s, c, s_rest)
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


@jax.custom_jvp
def _sparsemax_rows(x):
    z, has_any, _ = _shift_to_zero_max(x)
    tau = _sparsemax_threshold(z, _start(z), ~has_any)
    return jnp.maximum(z - tau, 0.0)  # NaN rows: z is NaN, so is p


@_sparsemax_rows.defjvp
def _sparsemax_rows_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    p = _sparsemax_rows(x)
    return p, _sparsemax_tangent(p, dx)


@jax.custom_vjp
def _entmax15_rows(x):
    z, has_any, _ = _shift_to_zero_max(x)
    z = 0.5 * z
    tau = _entmax15_threshold(z, _start(z), ~has_any)
    u = jnp.maximum(z - tau, 0.0)
    return u * u  # NaN rows: z is NaN, so is p


def _entmax15_rows_fwd(x):
    p = _entmax15_rows(x)
    return p, p


def _entmax15_rows_bwd(p, cotangent):
    return (_jacobian_product(_entmax15_s(p), cotangent),)


_entmax15_rows.defvjp(_entmax15_rows_fwd, _entmax15_rows_bwd)


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
    z, has_any, nan_row = _shift_to_zero_max(x)
    z = eps * z

    def solve(sigma):
        theta = _entmax_threshold(z, eps, sigma, ~has_any)
        return entmax_powers(z, theta, eps, sigma)[0]

    if sigma is None:
        # A per-row choice makes every pass select between the two forms, which on XLA:CPU can
        # keep a pass from fusing into its row sums, several times slower than one static form
        # (docs/benchmarks.md, "α as an array"). So the rows are held as τ, in the static form,
        # when no row's α is close enough to 1 to need σ (what each row would get alone), and
        # the per-row choice runs only otherwise. (A static σ form for rows that all need it
        # measured no faster than the per-row choice.)
        near_one = eps <= SIGMA_MAX_EPS
        p = jax.lax.cond(jnp.any(near_one), lambda: solve(near_one), lambda: solve(False))
    else:
        p = solve(sigma)
    # Divided by its sum, so rows sum to one although θ comes from a stopped iteration.
    mass = jnp.sum(p, axis=-1, keepdims=True)
    return _poison(p / jnp.where(mass > 0.0, mass, 1.0), nan_row)


def _entmax_rows_fwd(x, eps, sigma):
    p = _entmax_rows(x, eps, sigma)
    return p, (p, eps)


def _entmax_rows_bwd(sigma, residuals, cotangent):
    p, eps = residuals
    dx = _jacobian_product(_entmax_s(p, eps), cotangent)
    # (XLA drops this when α is not differentiated.)
    deps = jnp.sum(cotangent * _entmax_dp_dalpha(p, eps), axis=-1, keepdims=True)
    return dx, deps


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
    _check_row_length(x, axis, "entmax")
    alpha = _check_alpha(alpha, x.shape[:axis] + x.shape[axis + 1 :], "entmax")
    if isinstance(alpha, float) and alpha == 2.0:
        return sparsemax(x, axis, where=where)
    if isinstance(alpha, float) and alpha == 1.5:
        return entmax15(x, axis, where=where)
    x, axis, dtype = _prepare(x, axis, where, "entmax")
    if isinstance(alpha, float):  # α - 1 in python float64: α = 1 + 1e-7 is not a float32
        eps = jnp.full((*x.shape[:-1], 1), alpha - 1.0, x.dtype)
        sigma = alpha - 1.0 <= SIGMA_MAX_EPS
    else:
        eps = jnp.broadcast_to(jnp.asarray(alpha, x.dtype), x.shape[:-1])[..., None] - 1.0
        sigma = None  # chosen per row
    return _finish(_entmax_rows(x, eps, sigma), axis, dtype)


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
    _check_row_length(logits, logits.ndim - 1, name, "logits")
    if not isinstance(labels, (jax.Array, np.ndarray, np.generic, numbers.Integral, list, tuple)):
        raise TypeError(f"{name}: `labels` must be an integer array; got {type(labels).__name__}.")
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
        alpha_rows, eps_rows = alpha, alpha - 1.0  # α - 1 in python float64
        p = entmax(jax.lax.stop_gradient(theta), alpha)
    else:
        alpha_rows = jnp.broadcast_to(jnp.asarray(alpha, theta.dtype), labels.shape)
        eps_rows = (alpha_rows - 1.0)[..., None]
        p = entmax(jax.lax.stop_gradient(theta), jax.lax.stop_gradient(alpha_rows))
    theta = theta - jax.lax.stop_gradient(jnp.max(theta, axis=-1, keepdims=True))
    support = p > 0.0
    inner = jnp.sum(jnp.where(support, p * theta, 0.0), axis=-1)
    theta_label = jnp.take_along_axis(theta, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    # H_α(p) = (1 - Σ p^α) / (α (α-1)) = -Σ p log p · φ((α-1) log p) / α with φ(a) = expm1(a)/a
    # (using Σ p = 1): no 1/(α-1) left, so it tends to the Shannon entropy as α -> 1 instead of
    # dividing float rounding by α - 1.
    log_p = jnp.log(jnp.where(support, p, 1.0))
    weighted = jnp.where(support, p * log_p * _expm1_ratio(eps_rows * log_p), 0.0)
    tsallis = -jnp.sum(weighted, axis=-1) / alpha_rows
    loss = inner - theta_label + tsallis
    # A Fenchel–Young loss is >= 0; rounding can leave -1e-7 near a one-hot p. The value is
    # clamped, the gradient (p - onehot) is kept.
    loss = loss + jax.lax.stop_gradient(jnp.maximum(loss, 0.0) - loss)
    if where is not None:
        loss = jnp.where(where, loss, 0.0)
    return loss.astype(in_dtype)


# Σ_k a^k / (k+1)! for k = 0..10: φ(a) = expm1(a) / a to float64 rounding for |a| < 1/2.
_PHI_COEFFICIENTS = tuple(1.0 / math.factorial(k + 1) for k in range(11))


def _expm1_ratio(a):
    """φ(a) = expm1(a) / a (φ(0) = 1), accurate and smoothly differentiable near 0."""
    small = jnp.abs(a) < 0.5
    a_small = jnp.where(small, a, 0.0)
    series = jnp.zeros_like(a_small) + _PHI_COEFFICIENTS[-1]
    for c in reversed(_PHI_COEFFICIENTS[:-1]):
        series = series * a_small + c
    a_large = jnp.where(small, 1.0, a)
    return jnp.where(small, series, jnp.expm1(a_large) / a_large)


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
def _softmax_rows(s, allowed):
    # +inf becomes the largest float: a row holding +inf is uniform on those entries (the limit
    # of softmax as they grow). NaN propagates through max/exp/sum: an allowed NaN makes the
    # whole row NaN (the total is NaN). One extra elementwise operation (the minimum).
    s = jnp.minimum(s, jnp.finfo(s.dtype).max)
    row_max = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(row_max > -jnp.inf, row_max, 0.0)
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, row_max) - row_max), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total == 0.0, 1.0, total)


@_softmax_rows.defjvp
def _softmax_rows_jvp(primals, tangents):
    s, allowed = primals
    ds, _ = tangents
    p = _softmax_rows(s, allowed)
    return p, p * (ds - jnp.sum(p * ds, axis=-1, keepdims=True))


def masked_softmax(s: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to ``allowed``; rows with nothing allowed give 0.

    Zero gradients there too, also when the allowed scores are all ``-inf`` (a ``-inf`` bias),
    where ``jax.nn.softmax(where=...)`` gives NaN; ``jax.nn.dot_product_attention`` averages
    the values of a fully masked row instead of returning 0.

    The JVP is written out (``p * (ds - <p, ds>)``) so that reverse mode keeps only ``p`` as a
    residual, not the masking ``where``s (faster whole attention: docs/benchmarks.md,
    "Design measurements").

    Shapes: scores ``s [..., keys]`` (e.g. ``[batch, heads, q, kv]``), ``allowed`` bool
    broadcastable to ``s``; returns weights of ``s``'s shape and dtype.

    Example:
      >>> s = jnp.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]])  # [rows, keys]
      >>> allowed = jnp.array([[True, True, False], [False, False, False]])
      >>> print(np.asarray(masked_softmax(s, allowed)).round(4))  # second row: nothing allowed
      [[0.2689 0.7311 0.    ]
       [0.     0.     0.    ]]
    """
    s = _check_scores(s, "masked_softmax", "s")
    _check_row_length(s, s.ndim - 1, "masked_softmax", "s")
    allowed = _check_where(allowed, s.shape, "masked_softmax", "allowed")
    if allowed is None:
        allowed = jnp.bool_(True)
    dtype = s.dtype
    return _softmax_rows(s.astype(_compute_dtype(dtype)), allowed).astype(dtype)


def normalize(s: jax.Array, allowed: jax.Array | None, normalizer: Any) -> jax.Array:
    """Scores ``s [..., keys]`` to weights under a normalizer (a name or an α): the engines' call.

    ``allowed`` (bool, broadcastable to ``s``, or None) masks keys; ``-inf`` scores are masked
    too; non-finite scores follow the module's policy. ``normalizer``: one of
    :data:`NORMALIZERS` or an α for :func:`entmax` (an α array must broadcast to ``s`` without
    its last axis). Returns weights of ``s``'s shape (e.g. ``[batch, heads, q, kv]``) and dtype.

    Example:
      >>> s = jnp.array([1.0, 0.8, -1.0])  # [keys]
      >>> print(np.asarray(normalize(s, None, "sparsemax")).round(4))
      [0.6 0.4 0. ]
      >>> print(np.asarray(normalize(s, jnp.array([True, False, True]), 1.5)).round(4))
      [1. 0. 0.]
    """
    s = _check_scores(s, "normalize", "s")
    _check_row_length(s, s.ndim - 1, "normalize", "s")
    allowed = _check_where(allowed, s.shape, "normalize", "allowed")
    if isinstance(normalizer, str):
        if normalizer not in NORMALIZERS:
            raise ValueError(
                f"normalize: unknown `normalizer`={normalizer!r}; allowed: {list(NORMALIZERS)} "
                "or an α > 1 for entmax."
            )
        if normalizer == "softmax":
            return masked_softmax(s, jnp.bool_(True) if allowed is None else allowed)
        if normalizer == "sparsemax":
            return sparsemax(s, axis=-1, where=allowed)
        return entmax15(s, axis=-1, where=allowed)
    _check_alpha(normalizer, s.shape[:-1], "normalize", "normalizer")
    return entmax(s, normalizer, axis=-1, where=allowed)
