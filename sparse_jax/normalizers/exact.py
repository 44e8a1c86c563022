"""Sparsemax and 1.5-entmax: the normalizers whose threshold is found exactly.

Sparsemax by Michelot's iteration, 1.5-entmax by Newton steps checked against the quadratic
root on the current support (package docstring, "How the threshold τ is found"). Their starts
and searches (:func:`sparsemax_start`, :func:`sparsemax_search`, :func:`entmax15_start`,
:func:`entmax15_search`, :func:`entmax15_polish`) are also what the fused kernels run block by
block (:mod:`sparse_jax.kernels`). Both have custom VJPs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401 (the examples use it)

from sparse_jax.normalizers.arguments import check_inputs, normalize_rows
from sparse_jax.normalizers.search import (
    RowSearch,
    jacobian_product,
    row_sums,
    run_search,
    shift_to_zero_max,
    start_at_minus_one,
)

# The API; the other names without an underscore are shared with the kernels.
__all__ = ["entmax15", "sparsemax"]

# Iteration cap. Sparsemax needs none (it terminates in at most n steps, see the package
# docstring); Newton on 1.5-entmax converges quadratically, so rows still running after this
# many passes are only those stuck at float rounding, whose τ is then as good as float
# arithmetic allows.
_ENTMAX15_MAX_ITER = 40


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
    costs more than the pass it saves (docs/archive/benchmarks-history.md, "Second GPU pass").
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
    return run_search(z, sparsemax_search(tau0, done0, z.shape[-1]))[0]


def _entmax15_threshold(z, tau0, done0):
    tau = run_search(z, entmax15_search(tau0, done0))[0]
    return entmax15_polish(tau, row_sums(*entmax15_polish_terms(z, tau)))


# sparsemax, entmax15 and α-entmax have custom VJPs (reverse mode only: jax.jvp, jacfwd and
# jax.hessian raise) whose only residual is the output p, which attention keeps anyway for its
# value product. sparsemax had a custom JVP (forward mode too) until its plain attention's
# forward+backward was timed against this VJP, which ran it faster (docs/benchmarks.md,
# "Sparsemax's derivative as a VJP"); linearizing the JVP stored its support masks beside p. A
# custom JVP whose tangent map is recomputed from p under jax.checkpoint was no faster, for
# sparsemax as for 1.5-entmax.


def _entmax15_s(p):
    return jnp.sqrt(p)  # 0 off the support, NaN on NaN rows


def _sparsemax_vjp(p, cotangent):
    """Jᵀ·g for sparsemax (J is symmetric), ``s ⊙ (g - (sᵀg) / Σs)`` with s the support of p
    (p > 0): 0 off it, NaN on NaN rows (p NaN).

    Not :func:`search.jacobian_product`'s ``s ⊙ g - s (sᵀg) / Σs``: in attention that form let
    XLA:CPU fuse the row sum and the subtraction into the matmul that forms the cotangent
    (dp = g vᵀ), a fusion that ran over twice as long as the matmul alone (docs/benchmarks.md,
    "The non-finite policy behind one conditional"). With the subtraction inside, as in
    softmax's derivative, the matmul stays alone (tests/test_normalizer_programs.py).
    """
    support = p > 0.0
    count, total = row_sums(support.astype(p.dtype), jnp.where(support, cotangent, 0.0))
    mean = total / jnp.where(count > 0.0, count, 1.0)
    return jnp.where(support, cotangent - mean, jnp.where(jnp.isnan(p), jnp.nan, 0.0))


@jax.custom_vjp
def _sparsemax_rows(x):
    z, has_any, _ = shift_to_zero_max(x)
    tau = _sparsemax_threshold(z, start_at_minus_one(z), ~has_any)
    return jnp.maximum(z - tau, 0.0)  # NaN rows: z is NaN, so is p


def _sparsemax_rows_fwd(x):
    p = _sparsemax_rows(x)
    return p, p


def _sparsemax_rows_bwd(p, cotangent):
    return (_sparsemax_vjp(p, cotangent),)


_sparsemax_rows.defvjp(_sparsemax_rows_fwd, _sparsemax_rows_bwd)


@jax.custom_vjp
def _entmax15_rows(x):
    z, has_any, _ = shift_to_zero_max(x)
    z = 0.5 * z
    tau = _entmax15_threshold(z, start_at_minus_one(z), ~has_any)
    u = jnp.maximum(z - tau, 0.0)
    return u * u  # NaN rows: z is NaN, so is p


def _entmax15_rows_fwd(x):
    p = _entmax15_rows(x)
    return p, p


def _entmax15_rows_bwd(p, cotangent):
    return (jacobian_product(_entmax15_s(p), cotangent),)


_entmax15_rows.defvjp(_entmax15_rows_fwd, _entmax15_rows_bwd)


def sparsemax(x, axis: int = -1, *, where=None) -> jax.Array:
    """Sparsemax: the Euclidean projection of ``x`` onto the probability simplex along ``axis``.

    ``sparsemax(x) = argmin_{p ∈ Δ} ||p - x||²``, i.e. ``p = max(x - τ, 0)`` with τ such that the
    row sums to one (Martins & Astudillo, 2016). Equal to ``entmax(x, 2.0)``.

    The threshold is found by Michelot's iteration from the left (no sort; see the package
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
    x, axis, where = check_inputs(x, axis, where, "sparsemax")
    return normalize_rows(_sparsemax_rows, x, where, axis, ())


def entmax15(x, axis: int = -1, *, where=None) -> jax.Array:
    """1.5-entmax along ``axis``: ``p = [x/2 - τ]_+²`` with τ such that the row sums to one.

    Sparse like sparsemax but smoother (Peters, Niculae & Martins, 2019). Equal to
    ``entmax(x, 1.5)``. The threshold comes from Newton steps from the left that stop as soon
    as the exact quadratic root on the current support is consistent (package docstring), so the
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
    x, axis, where = check_inputs(x, axis, where, "entmax15")
    return normalize_rows(_entmax15_rows, x, where, axis, ())
