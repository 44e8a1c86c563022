"""The tile maths both kernel families share: public within :mod:`sparse_jax.kernels`.

Functions of tiles a kernel has loaded (on-chip), in ``jax.numpy`` and ``lax`` only, so that the
Triton kernels (:mod:`~sparse_jax.kernels.triton`) and the Mosaic ones
(:mod:`~sparse_jax.kernels.mosaic`) call them on the tiles each loads its own way: the tiles'
products, the search variable and weights at a threshold, the threshold search pass after pass
(each kernel family sums a pass' terms over its key blocks), the large values its start is
taken from, the row reductions, the online softmax, and for the backward the weights
recomputed from the row statistics with each tile's share of the gradients. The kernels'
modules call them as ``tilemath.<name>``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.kernels.plan import Plan
from sparse_jax.normalizers import (
    LIFT_FROM_EPS,
    entmax15_search,
    entmax_alpha_terms,
    entmax_powers,
    entmax_search,
    sparsemax_search,
)

# The API; the other names without an underscore are shared by the kernels' modules only.
__all__ = ["BLOCK_TOP", "START_TOP"]

_F32 = jnp.float32
_LOG2E = float(np.log2(np.e))


def dot(plan: Plan, a, b, contract_a: int = 1, contract_b: int = 1):
    """a @ b contracting the given axes of two 2-d tiles, accumulated in float32."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=plan.precision, preferred_element_type=_F32)


# ----------------------------------------------------------------------------------------------
# The threshold search of sparsemax, 1.5-entmax and α-entmax.


def search_variable(kind: str, x, row_max, eps):
    """The search variable of a masked score tile ``x`` (-inf where masked): x - max, scaled."""
    shifted = x - row_max
    if kind == "sparsemax":
        return shifted
    if kind == "entmax15":
        return 0.5 * shifted
    return eps * shifted


def weights(kind: str, z, tau, eps, sigma):
    """Unnormalized weights p̂ and Jacobian weights ŝ = p̂^(2-α) of a tile at threshold τ."""
    if kind == "sparsemax":
        return jnp.maximum(z - tau, 0.0), (z > tau).astype(_F32)
    if kind == "entmax15":
        u = jnp.maximum(z - tau, 0.0)
        return u * u, u
    return entmax_powers(z, tau, eps, sigma)


def bad_alpha(eps):
    """Rows whose α breaks the α rule (ε NaN, :func:`sparse_jax.normalizers.alpha_eps`): the
    kernels make them NaN rows, as a NaN score would; False for the other normalizers."""
    return False if eps is None else jnp.isnan(eps)


def row_search(
    kind: str, row_max, n_valid, eps, sigma, row_length: int, expm1=jnp.expm1, tau0=None
):
    """The :class:`~sparse_jax.normalizers.RowSearch` of a row tile, started from ``tau0`` (a
    lower bound of τ; default -1, the bound every row has once its maximum is 0)."""
    done0 = jnp.logical_not(row_max > -jnp.inf)  # nothing allowed, or NaN: no search
    tau0 = jnp.full_like(row_max, -1.0) if tau0 is None else jnp.where(done0, -1.0, tau0)
    if kind == "sparsemax":  # (smallest: a pass here costs more than a row minimum)
        return sparsemax_search(tau0, done0, row_length, smallest=True)
    if kind == "entmax15":
        return entmax15_search(tau0, done0, smallest=True)
    return entmax_search(eps, sigma, n_valid, done0, expm1)


def term_count(plan: Plan, search, rows: int) -> int:
    """How many row reductions a pass of ``search`` takes (its terms of a tile)."""
    tile = jax.ShapeDtypeStruct((rows, plan.bkv), _F32)
    return len(jax.eval_shape(search.terms, tile, search.init))


def pass_limit(plan: Plan, search) -> int:
    """The search's passes at most: its own bound, or capped_forward's cap below it."""
    return search.max_iter if plan.search_cap is None else min(search.max_iter, plan.search_cap)


def every_row(flags):
    """Whether every row's flag ``[rows, 1]`` is set, a scalar bool (Triton lowers no boolean
    reductions: as a max over 0/1)."""
    return jnp.max(jnp.where(flags, 0, 1).astype(jnp.int32)) == 0


def threshold(plan: Plan, row_max, n_valid, eps, sigma, row_sums, expm1=jnp.expm1, tau0=None):
    """Each row's threshold τ ``[rows, 1]`` by the normalizer's search, pass after pass until
    every row of the tile is done. ``row_sums(terms_of, n_terms)`` sums ``terms_of(z)`` (a tuple
    of ``n_terms`` tiles from a tile of search variables) over the row's kept blocks: each
    kernel family walks its blocks its own way. ``expm1``: for compilers without one. ``tau0``:
    a start (sparsemax; see :func:`row_search`)."""
    search = row_search(plan.kind, row_max, n_valid, eps, sigma, plan.row_length, expm1, tau0)
    n_terms = term_count(plan, search, row_max.shape[0])
    max_iter = pass_limit(plan, search)

    def cond(carry):
        it, state = carry
        return jnp.logical_and(it < max_iter, jnp.logical_not(every_row(state[-1])))

    def step(carry):
        it, state = carry
        terms_of = lambda z: search.terms(z, state)
        return it + 1, search.update(state, row_sums(terms_of, n_terms, search.minima))

    _, state = jax.lax.while_loop(cond, step, (jnp.int32(0), search.init))
    return state[0]  # (1.5-entmax's search polishes its rows itself, where they need it)


# ----------------------------------------------------------------------------------------------
# The start of the search, and the row reductions of a pass.

# The start of τ's search (normalizers.sparsemax_start / entmax15_start: a lower bound from
# any of the row's values, tightest from its largest): the first pass merges each block's
# BLOCK_TOP largest values of a row into the row's START_TOP largest of those. Two per block
# start the search about as close as the row's own largest values would, for fewer row maxima
# per block; a value more in the start can save a search pass (a pass over every kept block)
# for a merge of [rows, 1] values, and 1.5-entmax's supports are wider than sparsemax's. The
# passes counted (`python -m experiments.bench search_passes`) and the forwards timed
# (`bench forward_passes --start-values`): docs/archive/benchmarks-history.md, "Fourth GPU pass".
START_TOP = {"sparsemax": 16, "entmax15": 32}
BLOCK_TOP = 2


def tile_top(x, k: int):
    """The ``k`` largest values of each row of a tile ``[rows, n]``, each ``[rows, 1]``, in
    decreasing order; a value tied with a larger one is dropped (a smaller one, or -inf, takes
    its place: the start it feeds is then only lower)."""
    values = []
    for i in range(k):
        value = jnp.max(x, axis=-1, keepdims=True)
        values.append(value)
        if i + 1 < k:
            x = jnp.where(x >= value, -jnp.inf, x)
    return values


def insert_top(top, value):
    """The ``len(top)`` largest of ``top`` (``[rows, 1]`` each, decreasing) and ``value``."""
    out = [jnp.maximum(top[0], value)]
    for i in range(1, len(top)):
        out.append(jnp.maximum(top[i], jnp.minimum(top[i - 1], value)))
    return tuple(out)


def reductions_init(n_terms: int, minima: int, rows: int) -> tuple:
    """The ``[rows, 1]`` start of a pass' row reductions: 0 for sums, +inf for the last
    ``minima`` (minima; see :class:`~sparse_jax.normalizers.RowSearch`)."""
    return tuple(
        jnp.full((rows, 1), jnp.inf if i >= n_terms - minima else 0.0, _F32) for i in range(n_terms)
    )


def reduce_block(acc: tuple, terms: tuple, minima: int) -> tuple:
    """``acc`` with one block's terms (``[rows, bkv]`` tiles) added, or for the last
    ``minima``, their row minimum taken."""
    n = len(terms)
    return tuple(
        jnp.minimum(a, jnp.min(x, axis=-1, keepdims=True))
        if i >= n - minima
        else a + jnp.sum(x, axis=-1, keepdims=True)
        for i, (a, x) in enumerate(zip(acc, terms, strict=True))
    )


# ----------------------------------------------------------------------------------------------
# The online softmax.


def exp(plan: Plan, y):
    """``exp(y)`` of the softmax kernels' tiles. Triton: as ``exp2(y · log₂e)``, one
    multiply and the GPU's ``ex2`` instruction (FlashAttention's and jax's Pallas ``mha``'s
    way), where Pallas lowers ``exp`` to libdevice's ``__nv_expf``, which adds a range
    reduction around it: the softmax kernels take one exponential per score, in the forward
    and in each backward kernel, and at head dim 64 those weigh against the tile products.
    Relative error ``|y| · 2⁻²⁴`` or so, at the weights that count (``y`` near 0)."""
    if plan.target == "triton":
        return jnp.exp2(y * _LOG2E)
    return jnp.exp(y)


def softmax_init(plan: Plan, rows: int):
    """The online softmax's carry before the first key tile: (row max, total, acc)."""
    return (
        jnp.full((rows, 1), -jnp.inf, _F32),
        jnp.zeros((rows, 1), _F32),
        jnp.zeros((rows, plan.dv), _F32),
    )


def softmax_step(plan: Plan, carry, x, v):
    """The online (flash) softmax after one more key tile: masked scores ``x [bq, bkv]``
    (-inf where not allowed), values ``v [bkv, Dv]``."""
    row_max, total, acc = carry
    new_max = jnp.maximum(row_max, jnp.max(x, axis=-1, keepdims=True))
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = exp(plan, row_max - shift)
    e = exp(plan, x - shift)
    acc = correction * acc + dot(plan, e.astype(v.dtype), v, 1, 0)
    return new_max, correction * total + jnp.sum(e, axis=-1, keepdims=True), acc


def softmax_finish(carry):
    """(output ``[bq, Dv]`` float32, log-sum-exp ``[bq, 1]``; the largest float32 for a row
    that sees no key, whose output is 0; NaN for a NaN row, whose derivatives are then NaN) of
    the online softmax's final carry.

    Why not +inf for a row that sees no key: its weights ``exp(-inf - lse)`` are 0 either way,
    and a finite statistic keeps ``jax.debug_infs`` quiet (it checks each compiled call's
    outputs, and the padded rows of a block larger than the sequence see no key)."""
    row_max, total, acc = carry
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    out = acc / jnp.where(total > 0.0, total, 1.0)
    lse = jnp.where(total > 0.0, shift + jnp.log(total), jnp.finfo(_F32).max)
    return out, jnp.where(jnp.isnan(total), jnp.nan, lse)


# ----------------------------------------------------------------------------------------------
# Backward: the weights and Jacobian weights of a tile, recomputed from the row statistics, and
# its shares of the gradients.


def recompute(plan: Plan, x, rows: dict, eps, sigma):
    """(p, g) of a masked score tile: the weights and g = p^(2-α) (softmax: g = p)."""
    if plan.kind == "softmax":
        p = exp(plan, x - rows["lse"])
        return p, p
    z = search_variable(plan.kind, x, rows["max"], eps)
    p_hat, s_hat = weights(plan.kind, z, rows["tau"], eps, sigma)
    # Per-row factors [rows, 1], so that each entry takes a product, not a division. mass is
    # NaN for a NaN row (whose p̂ Triton's max may have zeroed): its weights and derivatives
    # are NaN, by a select (an indicator times NaN came out 0, not NaN, in interpret mode).
    mass = rows["mass"]
    safe = jnp.where(mass > 0.0, mass, 1.0)
    nan_row = jnp.isnan(mass)
    if plan.kind == "sparsemax":
        g_factor = jnp.ones_like(safe)
    elif plan.kind == "entmax15":
        g_factor = jax.lax.rsqrt(safe)
    else:
        g_factor = jnp.exp((eps - 1.0) * jnp.log(safe))
    p = jnp.where(nan_row, jnp.nan, p_hat * (1.0 / safe))
    return p, jnp.where(nan_row, jnp.nan, s_hat * g_factor)


def row_names(plan: Plan) -> tuple[str, ...]:
    stats = ("lse",) if plan.kind == "softmax" else ("max", "tau", "mass")
    return (*stats, "delta")


def row_terms(plan: Plan, p, ds, dp, raw, eps):
    """A key tile's shares of the per-row sums that the scale, the bias and α take: ``(α
    sums, Σ ds·raw, Σ ds)`` ``[rows, 1]`` each (None where the call asks no such gradient);
    the α sums are the four of :func:`alpha_rows` (Σ c, Σ dp c, Σ s_rest, Σ dp s_rest).
    ``ds``: zero off the support."""
    ds_raw = jnp.sum(ds * raw, axis=-1, keepdims=True) if plan.scale_grad else None
    ds_rows = jnp.sum(ds, axis=-1, keepdims=True) if plan.has_bias else None  # the bias' rows
    alpha = None
    if plan.kind == "entmax":
        _, c, s_rest = entmax_alpha_terms(p, eps)
        terms = (c, jnp.where(c != 0.0, dp * c, 0.0), s_rest)
        terms += (jnp.where(s_rest != 0.0, dp * s_rest, 0.0),)
        alpha = tuple(jnp.sum(t, axis=-1, keepdims=True) for t in terms)
    return alpha, ds_raw, ds_rows


def dq_step(plan: Plan, carry, p, g, dp, delta, raw, k, eps):
    """Adds one key tile's share to the dq kernel's sums ``(dq, α sums, Σ ds·raw, Σ ds)``:
    ``ds = g ⊙ (dp - δ)`` and the row terms of :func:`row_terms`."""
    dq, alpha_sums, ds_raw, ds_rows = carry
    ds = g * (dp - delta)
    dq = dq + dot(plan, ds.astype(k.dtype), k, 1, 0)
    ds = jnp.where(g != 0.0, ds, 0.0)
    alpha, raw_sum, row_sum = row_terms(plan, p, ds, dp, raw, eps)
    if alpha is not None:
        alpha_sums = tuple(a + t for a, t in zip(alpha_sums, alpha, strict=True))
    ds_raw = ds_raw if raw_sum is None else ds_raw + raw_sum
    ds_rows = ds_rows if row_sum is None else ds_rows + row_sum
    return dq, alpha_sums, ds_raw, ds_rows


def alpha_rows(plan: Plan, alpha_sums, delta, eps):
    """Each row's share of dα ``[rows, 1]``: δ Σ c - Σ dp c (+ (Σ dp s_rest - δ Σ s_rest) / ε²
    when lifted; see normalizers.entmax_alpha_terms); 0 for the other normalizers."""
    c_sum, dp_c, rest_sum, dp_rest = alpha_sums
    lifted = 0.0
    if plan.kind == "entmax":
        lifted = jnp.where(eps >= LIFT_FROM_EPS, (dp_rest - delta * rest_sum) / (eps * eps), 0.0)
    return delta * c_sum - dp_c + lifted + jnp.zeros_like(delta)
