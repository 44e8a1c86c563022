"""The row-threshold search every sparse normalizer shares, and the non-finite policy
(package-internal).

Rows on the last axis, dtype float32/64, masked entries ``-inf``. :func:`shift_to_zero_max`
applies the non-finite policy (package docstring) and shifts each row's maximum to 0; a
:class:`RowSearch` (per-entry terms, per-row update) runs on whole rows by :func:`run_search`,
each pass one fused reduction (:func:`row_sums`, in two stages on CPU); the fused kernels run
the same searches block by block (:mod:`sparse_jax.kernels`). :func:`jacobian_product` is the
closed-form derivative that every sparse normalizer's custom rule uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# No API here: the names without an underscore are shared by the package's modules and the
# kernels only.
__all__: list[str] = []


def shift_to_zero_max(x):
    """Rows x (masked entries -inf) made ready for a threshold search, under the non-finite policy.

    Returns (z, has_any, nan_row). z = x - max(x) per row. +inf: a row holding +inf has it
    replaced by the largest finite float, so z = 0 exactly at those entries and z ~ -3e38 (or
    -inf) elsewhere: all its weight goes uniformly to them. XLA's max propagates NaN, so a row
    holding NaN gets max NaN and z NaN everywhere; its has_any is False (no iteration waits for
    it) and its output is NaN. A row with nothing allowed gets z = -inf.

    The row maxima say whether any row holds +inf, and only then does the clamp run
    (``lax.cond``; under ``vmap`` with a batched flag both branches run, with the same result).
    The clamp changes nothing in a row without +inf, so finite scores take the branch without
    it. The conditional also hands z on as one computed array: without it XLA:CPU recomputed z
    from the raw scores (mask, shift) inside each of the later passes over the scores (the
    output, the derivative's terms), each of which then cost as much as an extra pass
    (docs/benchmarks.md, "The non-finite policy behind one conditional"). No derivative goes
    through here (the normalizers' custom rules call it on primal values only).
    """
    row_max = jnp.max(x, axis=-1, keepdims=True)
    big = jnp.finfo(x.dtype).max

    def shift(x, row_max):
        return x - jnp.where(row_max == -jnp.inf, 0.0, row_max)

    def clamp_then_shift(x, row_max):  # max commutes with the clamp: no second reduction
        return shift(jnp.minimum(x, big), jnp.minimum(row_max, big))

    z = jax.lax.cond(jnp.any(row_max == jnp.inf), clamp_then_shift, shift, x, row_max)
    return z, row_max > -jnp.inf, jnp.isnan(row_max)


def poison(p, nan_row):
    """A row whose scores held NaN at an allowed position is NaN everywhere (NaN in, NaN out)."""
    return jnp.where(nan_row, jnp.nan, p)


def start_at_minus_one(z):
    """τ = -1 for every row: a lower bound of the threshold once the row maximum is 0."""
    return jnp.full((*z.shape[:-1], 1), -1.0, z.dtype)


def row_sums(*operands, minima: int = 0):
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
    normalizers`` (docs/archive/benchmarks-history.md, "Two-stage row sums on CPU").
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
    whole rows here (:func:`run_search`) and on rows held in blocks by a fused kernel, which
    combines each block's sums and minima (:mod:`sparse_jax.kernels`).
    """

    init: tuple
    terms: Callable[[jax.Array, tuple], tuple]
    update: Callable[[tuple, tuple], tuple]
    max_iter: int
    minima: int = 0


def run_search(z, search: RowSearch):
    """Runs ``search`` on rows z (last axis) to the end; returns the final state.

    On CPU a row whose length has no fast two-stage split (:func:`_cpu_sum_width`) is padded
    once with up to 7 ``-inf`` (outside every support) to one that has: padding inside each
    pass would cost the speed it buys.
    """

    def run(z):
        def body(state):
            return search.update(state, row_sums(*search.terms(z, state), minima=search.minima))

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


def jacobian_product(s, dx):
    """J·dx = s ⊙ dx - s (sᵀdx) / Σs, the Jacobian of entmax (symmetric, so also Jᵀ·dx).

    s_i = p_i^(2-α) on the support and 0 elsewhere: 1[p > 0] for sparsemax, √p for entmax15;
    NaN on a NaN row, which makes the whole row's derivative NaN.
    """
    s_dx = jnp.where(s > 0.0, s * dx, 0.0)
    # Two reductions, not one: under jax.linearize a sum taken together with s ⊙ dx would count
    # as a tangent, and the division by it could not be transposed.
    (s_sum,), (s_dx_sum,) = row_sums(s), row_sums(s_dx)
    return s_dx - s * s_dx_sum / jnp.where(s_sum > 0.0, s_sum, 1.0)
