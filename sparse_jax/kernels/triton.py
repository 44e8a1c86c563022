"""The fused block-sparse attention kernels for GPUs (Pallas with the Triton lowering).

One program per (query block, batch element, head) for the forward and the dq kernel, per (key
block, batch element, head) for the dk/dv kernel; every key (or query) of the batch element and
head is a block of the kernel's inputs, and the kept blocks are read from it at the layout's
indices (see :mod:`sparse_jax.kernels.flash` for the algorithm). Only what Pallas lowers with
Triton is used, and the kernels run unchanged in Pallas' interpret mode, which is how the tests
run them on CPU. :func:`forward` and :func:`backward` are what
:func:`~sparse_jax.kernels.pallas_attention` runs for ``target="triton"``; they take the
:class:`~sparse_jax.kernels.plan.Plan` of a call and its padded inputs
(:func:`~sparse_jax.kernels.plan.prepare`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparse_jax.kernels import tilemath
from sparse_jax.kernels.plan import Plan
from sparse_jax.normalizers import SIGMA_MAX_EPS, entmax15_start, sparsemax_start

# No API of its own: its names without an underscore are shared by the kernels' modules only
# (sparse_jax.kernels exports the API).
__all__: list[str] = []

_F32 = jnp.float32
_MAX = float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------------------------------------
# Pieces of the kernels.


def _grid_block(reverse: bool, blocks: int):
    """The block a program works on from its id on the grid's first axis (see
    ``Plan.reverse_q``)."""
    i = pl.program_id(0)
    return blocks - 1 - i if reverse else i


def _runtime_tile(plan: Plan, q_block, kv_block, kv_length, q_ids, kv_ids):
    """``(key bound, tile)`` of the run-time mask on query block ``q_block`` and key block
    ``kv_block``: keys at or beyond the bound are masked, and where ``tile`` (``[bq, bkv]``
    bool, None for none) is False. ``kv_length``: the batch element's ``padding`` length;
    ``q_ids``/``kv_ids``: callables reading the tile's segment ids ``[bq]``/``[bkv]``."""
    same = _same_segment(plan, q_ids, kv_ids)
    if plan.expr is None:
        return kv_length, same
    rows = q_block * plan.bq + jnp.arange(plan.bq, dtype=jnp.int32)[:, None]
    keys = kv_block * plan.bkv + jnp.arange(plan.bkv, dtype=jnp.int32)[None, :]
    return plan.kv_len, plan.expr(rows, keys, key_length=kv_length, same_segment=same)


def _row_tile(plan: Plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block):
    """:func:`_runtime_tile` in the kernels that own one query block (``q_block``, the grid's
    first axis, read outside their loops): its segment ids in ``qseg_ref`` ``[bq]``, every
    key's in ``kvseg_ref`` ``[Tk]``."""
    start = pl.multiple_of(kv_block * plan.bkv, plan.bkv)
    return _runtime_tile(
        plan, q_block, kv_block, kv_length,
        lambda: qseg_ref[...], lambda: kvseg_ref[pl.ds(start, plan.bkv)],
    )  # fmt: skip


def _key_block(ref, plan: Plan, kv_block):
    """Rows ``[bkv, ...]`` of key block ``kv_block`` from a ref of every key's (keys, values)."""
    return ref[pl.ds(pl.multiple_of(kv_block * plan.bkv, plan.bkv), plan.bkv), :]


def _visit_if_live(plan: Plan, live, visit, load, carry):
    """``visit(carry, load())`` for a block that holds weight (``live != 0``; every block for
    softmax), else ``carry``. With ``plan.prefetch`` the loads come before the branch, in the
    loop's own body, where Triton pipelines them with the previous step's work; else only live
    blocks load, inside the branch, each load waited for."""
    if plan.kind == "softmax":
        return visit(carry, load())
    if plan.prefetch:
        loaded = load()
        return jax.lax.cond(live != 0, lambda c: visit(c, loaded), lambda c: c, carry)
    return jax.lax.cond(live != 0, lambda c: visit(c, load()), lambda c: c, carry)


def _block_scores(q, k, kv_block, plan: Plan, scale, bias_ref, key_nan_ref):
    """Scaled, biased scores ``[bq, bkv]`` of a query tile with key block ``kv_block`` (keys
    ``k`` ``[bkv, D]``; +inf clipped), and the raw products q·k. ``bias_ref``: the query
    tile's bias rows; ``key_nan_ref``: NaN at the keys whose value vector is not finite, 0
    elsewhere."""
    start = pl.multiple_of(kv_block * plan.bkv, plan.bkv)
    raw = tilemath.dot(plan, q, k)
    s = raw * scale + key_nan_ref[pl.ds(start, plan.bkv)][None, :]
    if plan.has_bias:
        s = s + (bias_ref[:, pl.ds(start, plan.bkv)] if plan.bias_axes[3] else bias_ref[...])
    return raw, _clip_inf(s)


def _clip_inf(s):
    """+inf scores count as the largest float; NaN stays NaN. Not ``jnp.minimum``: Triton
    lowers float min/max to ``minnumf``/``maxnumf``, which return the other operand where one
    is NaN, so every NaN the attention policy must keep is tested for, never left to them."""
    return jnp.where(s > _MAX, _MAX, s)


def _masked(plan: Plan, s, full, mask_index, masks_ref, kv_block, bound_and_tile):
    """Scores ``s [bq, bkv]`` of a kept block, -inf where not allowed: a partial block's
    mask; with ``bound_and_tile`` of :func:`_runtime_tile`, keys at or beyond the bound (the
    batch element's run-time padding length, or ``Tk``) masked, and where the tile is False.

    A full block of a layout without run-time parts passes through untouched, and only a
    partial block loads its mask's ``[bq, bkv]`` tile (a ``lax.cond`` on the block's flag):
    most blocks of a causal or windowed layout are full, and the int32 tile, loaded for every
    block, was twice the bytes of the block's keys and values."""
    kv_length, tile = bound_and_tile
    keys = kv_block * plan.bkv + jnp.arange(plan.bkv, dtype=jnp.int32)

    def apply(s, allowed):
        allowed = jnp.logical_and(allowed, (keys < kv_length)[None, :])
        allowed = allowed if tile is None else jnp.logical_and(allowed, tile)
        return jnp.where(allowed, s, -jnp.inf)

    def whole(s):
        return apply(s, True) if plan.dynamic else s  # (a run-time tile implies dynamic)

    return jax.lax.cond(full != 0, whole, lambda s: apply(s, masks_ref[mask_index] != 0), s)


def _same_segment(plan: Plan, q_ids, kv_ids):
    """``[bq, bkv]``: query and key in the same segment; None without a segments mask.
    ``q_ids``: ``[bq]``, ``kv_ids``: ``[bkv]`` (callables, read only when needed)."""
    return q_ids()[:, None] == kv_ids()[None, :] if plan.segments else None


def _row_pass(count, block_terms, n_terms: int, rows: int, minima: int = 0):
    """Sums ``block_terms(j)`` (a tuple of ``[rows, bkv]`` tiles) over the row's kept blocks
    (the last ``minima``: their minimum)."""

    def body(j, acc):
        return tilemath.reduce_block(acc, block_terms(j), minima)

    return jax.lax.fori_loop(0, count, body, tilemath.reductions_init(n_terms, minima, rows))


def _eps_sigma(plan: Plan, eps_ref, rows: int):
    """(ε = α - 1 as a [rows, 1] tile, how τ is held) for α-entmax; else (None, None)."""
    if plan.kind != "entmax":
        return None, None
    eps = jnp.full((rows, 1), eps_ref[0], _F32)
    sigma = plan.sigma if plan.sigma is not None else eps <= SIGMA_MAX_EPS
    return eps, sigma


# ----------------------------------------------------------------------------------------------
# Forward kernels.


def _forward_softmax_kernel(scale_ref, len_ref, q_ref, k_ref, v_ref, bias_ref, key_nan_ref,
                            qseg_ref, kvseg_ref, idx_ref, cnt_ref, full_ref, pmi_ref, masks_ref,
                            o_ref, lse_ref, *, plan: Plan):  # fmt: skip
    q = q_ref[...]
    scale = scale_ref[0]
    bq = q.shape[0]
    q_block, kv_length = _grid_block(plan.reverse_q, plan.nq), len_ref[0]  # (outside the loops)

    def body(j, carry):
        kv_block = idx_ref[j]
        k = _key_block(k_ref, plan, kv_block)
        _, s = _block_scores(q, k, kv_block, plan, scale, bias_ref, key_nan_ref)
        rt = _row_tile(plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block)
        x = _masked(plan, s, full_ref[j], pmi_ref[j], masks_ref, kv_block, rt)
        return tilemath.softmax_step(plan, carry, x, _key_block(v_ref, plan, kv_block))

    carry = jax.lax.fori_loop(0, cnt_ref[0], body, tilemath.softmax_init(plan, bq))
    out, lse = tilemath.softmax_finish(carry)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


def _forward_sparse_kernel(scale_ref, len_ref, eps_ref, q_ref, k_ref, v_ref, bias_ref,
                           key_nan_ref, qseg_ref, kvseg_ref, idx_ref, cnt_ref, full_ref, pmi_ref,
                           masks_ref, o_ref, ubar_ref, max_ref, tau_ref, mass_ref, live_ref, *,
                           plan: Plan):  # fmt: skip
    q = q_ref[...]
    scale = scale_ref[0]
    bq = q.shape[0]
    q_block, kv_length = _grid_block(plan.reverse_q, plan.nq), len_ref[0]  # (outside the loops)
    count = cnt_ref[0]
    eps, sigma = _eps_sigma(plan, eps_ref, bq)

    def masked(j):
        kv_block = idx_ref[j]
        k = _key_block(k_ref, plan, kv_block)
        _, s = _block_scores(q, k, kv_block, plan, scale, bias_ref, key_nan_ref)
        rt = _row_tile(plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block)
        return _masked(plan, s, full_ref[j], pmi_ref[j], masks_ref, kv_block, rt)

    # The first pass finds each row's maximum; for sparsemax and 1.5-entmax, large values of
    # the row (each block's tilemath.BLOCK_TOP largest, the tilemath.START_TOP largest of
    # those), whose start (normalizers.sparsemax_start, entmax15_start), a lower bound of τ,
    # saves search passes (each recomputes the tile's scores over every kept block).
    start_of = {"sparsemax": sparsemax_start, "entmax15": entmax15_start}.get(plan.kind)
    n_top, block_top = (1, 1)
    if start_of is not None:  # (capped_forward's start_top: a diagnostic's other start)
        n_top, block_top = plan.start_top or tilemath.START_TOP[plan.kind], tilemath.BLOCK_TOP
    count_allowed = plan.kind == "entmax"  # only α-entmax's search reads the allowed keys

    def first_pass(j, carry):
        top, n_valid = carry
        x = masked(j)
        # A NaN score enters the maxima as +inf, which no score reaches (_clip_inf): a NaN
        # row's maximum is +inf. (Triton's max drops NaN; a where costs less than a count.)
        for value in tilemath.tile_top(jnp.where(jnp.isnan(x), jnp.inf, x), block_top):
            top = tilemath.insert_top(top, value)
        if count_allowed:
            n_valid = n_valid + jnp.sum((x > -jnp.inf).astype(_F32), axis=-1, keepdims=True)
        return top, n_valid

    init = ((jnp.full((bq, 1), -jnp.inf, _F32),) * n_top, jnp.zeros((bq, 1), _F32))
    top, n_valid = jax.lax.fori_loop(0, count, first_pass, init)
    nan_row = (top[0] == jnp.inf) | tilemath.bad_alpha(eps)
    row_max = jnp.where(nan_row, jnp.nan, top[0])
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # NaN stays NaN: its z is NaN
    tau0 = (
        None
        if start_of is None
        else start_of([tilemath.search_variable(plan.kind, t, shift, eps) for t in top])
    )

    def z_of(j):
        return tilemath.search_variable(plan.kind, masked(j), shift, eps)

    def row_sums(terms_of, n_terms, minima=0):
        return _row_pass(count, lambda j: terms_of(z_of(j)), n_terms, bq, minima)

    def load_v(j):
        return _key_block(v_ref, plan, idx_ref[j])

    def output_pass(tau):
        """(Σ p v, Σ g v, Σ p, Σ g) ``[bq, Dv]``/``[bq, 1]`` of the rows at their thresholds
        ``tau``, and each block's live flag (some row gives it weight, or is a NaN row, whose
        derivatives are NaN: the backward must visit it) written to ``live_ref``."""
        live_ref[...] = jnp.zeros(live_ref.shape, live_ref.dtype)

        def body(j, carry):
            acc, acc_u, mass, s_sum = carry
            p, s = tilemath.weights(plan.kind, z_of(j), tau, eps, sigma)
            block_mass = jnp.sum(p, axis=-1, keepdims=True)
            # A max over the rows' sums of p >= 0, as 0/1 (NaN must not hide rows).
            live = jnp.max(jnp.where((block_mass > 0.0) | nan_row, 1, 0)) > 0
            acc, acc_u = _live_products(plan, live_ref, j, live, (p, s), load_v, (acc, acc_u))
            return acc, acc_u, mass + block_mass, s_sum + jnp.sum(s, axis=-1, keepdims=True)

        zeros_v, zeros_r = jnp.zeros((bq, plan.dv), _F32), jnp.zeros((bq, 1), _F32)
        return jax.lax.fori_loop(0, count, body, (zeros_v, zeros_v, zeros_r, zeros_r))

    if plan.kind in _ACCUMULATE_FROM and plan.speculate:
        search = tilemath.row_search(
            plan.kind, row_max, n_valid, eps, sigma, plan.row_length, tau0=tau0
        )
        tau, confirmed, sums = _accumulating_search(plan, search, z_of, load_v, live_ref,
                                                    nan_row, count)  # fmt: skip
        acc, acc_u, mass, s_sum = jax.lax.cond(confirmed, lambda: sums, lambda: output_pass(tau))
    else:
        tau = tilemath.threshold(plan, row_max, n_valid, eps, sigma, row_sums, tau0=tau0)
        acc, acc_u, mass, s_sum = output_pass(tau)
    out = jnp.where(nan_row, jnp.nan, acc / jnp.where(mass > 0.0, mass, 1.0))
    o_ref[...] = out.astype(o_ref.dtype)
    ubar_ref[...] = acc_u / jnp.where(s_sum > 0.0, s_sum, 1.0)
    max_ref[...] = shift[:, 0]
    tau_ref[...] = tau[:, 0]
    mass_ref[...] = jnp.where(nan_row, jnp.nan, mass)[:, 0]


def _live_products(plan: Plan, live_ref, j, live, weights, load_v, accs, gate=True):
    """Writes kept block ``j``'s live flag and, where it is live (and ``gate``), adds each of
    ``weights`` (``[bq, bkv]`` tiles) times the block's values (``load_v(j)``) to ``accs``
    ``[bq, Dv]``."""
    live_ref[j] = live.astype(live_ref.dtype)

    def products(accs, v):
        return tuple(
            acc + tilemath.dot(plan, w.astype(v.dtype), v, 1, 0)
            for acc, w in zip(accs, weights, strict=True)
        )

    return _visit_if_live(plan, live & gate, products, functools.partial(load_v, j), accs)


# The search pass from which a normalizer's passes accumulate the output (_accumulating_search):
# sparsemax's start is mostly τ* (its first search pass confirms it); 1.5-entmax takes 1-3
# passes from its start, and the first accumulating one would mostly be wasted products.
_ACCUMULATE_FROM = {"sparsemax": 0, "entmax15": 1}


def _accumulating_search(plan: Plan, search, z_of, load_v, live_ref, nan_row, count):
    """Sparsemax's and 1.5-entmax's threshold searches whose passes also accumulate the
    output, so that a tile needs no output pass when its last search pass confirms every
    row's threshold.

    A pass at τ_k (from pass :data:`_ACCUMULATE_FROM` on) sums, beside the search's terms over
    S = {z > τ_k} (|S|, Σ u, and 1.5-entmax's Σ u², u = z - τ_k on S), the products of the
    values with ``u`` and ``1_S`` (and ``u²``). Where the pass ends a row's search at τ' with
    every entry of S above τ' (its smallest, which the search takes, > τ': S is then the
    support at τ', the entries outside it being <= τ_k <= τ'), the row's outputs follow
    exactly from the pass with δ = τ' - τ_k, the weights being ``u - δ`` (sparsemax, g = 1) or
    ``(u - δ)²`` (1.5-entmax, g = u - δ) on S:
    sparsemax ``Σ p v = u@v - δ 1@v``, ``Σ g v = 1@v``, ``Σ p = Σu - δ|S|``, ``Σ g = |S|``;
    1.5-entmax ``Σ p v = u²@v - 2δ u@v + δ² 1@v``, ``Σ g v = u@v - δ 1@v``, ``Σ p = Σu² -
    2δ Σu + δ²|S|``, ``Σ g = Σu - δ|S|`` (δ is the last Newton step, small beside the weights
    that count: the bfloat16 products' rounding of ``u²`` and ``u`` weighs about twice that of
    ``p``). Rows done in earlier passes are evaluated at their own τ (δ = 0). Each pass writes
    the blocks' live flags (some row has entries in S, or is a NaN row).

    ``z_of(j)``: the search variables of kept block ``j`` ``[bq, bkv]``; ``load_v(j)``: its
    values. Returns ``(τ [bq, 1], confirmed, (Σ p v, Σ g v, Σ p, Σ g))``: ``confirmed`` (a
    scalar bool) says every row of the tile took its threshold in an accumulating pass that
    confirmed it; else the sums are not the output and an output pass must follow (a tie at
    τ', a capped search, a tile done before its first accumulating pass).
    """
    rows = nan_row.shape[0]
    entmax15 = plan.kind == "entmax15"
    max_iter = tilemath.pass_limit(plan, search)
    zeros_v = jnp.zeros((rows, plan.dv), _F32)
    accs0 = (zeros_v,) * (3 if entmax15 else 2)
    # sparsemax (|S|, Σ_S z, min S); 1.5-entmax (|S|, Σ u, Σ u², min S)
    n_terms = tilemath.term_count(plan, search, rows)
    first = _ACCUMULATE_FROM[plan.kind]

    def one_pass(state, accumulate):
        tau = state[0]

        def body(j, carry):
            sums, accs = carry
            z = z_of(j)
            terms = search.terms(z, state)
            inside = terms[0]  # 1 on S, else 0
            size_before = sums[0]
            sums = tilemath.reduce_block(sums, terms, search.minima)
            # The block's entries in S: what |S| gained (exact: counts); as 0/1 (see output_pass).
            live = jnp.max(jnp.where((sums[0] > size_before) | nan_row, 1, 0)) > 0
            u = jnp.where(inside > 0.0, z - tau, 0.0)
            weights = (u * u, u, inside) if entmax15 else (u, inside)
            accs = _live_products(plan, live_ref, j, live, weights, load_v, accs, accumulate)
            return sums, accs

        init = (tilemath.reductions_init(n_terms, search.minima, rows), accs0)
        return jax.lax.fori_loop(0, count, body, init)

    def running(carry):
        it, state = carry[0], carry[1]
        return jnp.logical_and(it < max_iter, jnp.logical_not(tilemath.every_row(state[-1])))

    def step(carry):
        it, state = carry[0], carry[1]
        sums, accs = one_pass(state, it >= first)
        return it + 1, search.update(state, sums), state[0], sums, accs

    init = (jnp.int32(0), search.init, search.init[0],
            tilemath.reductions_init(n_terms, search.minima, rows), accs0)  # fmt: skip
    it, state, tau_k, sums, accs = jax.lax.while_loop(running, step, init)
    tau, size, smallest = state[0], sums[0], sums[-1]
    exact = state[-1] & ((smallest > tau) | (size == 0.0))
    confirmed = (it > first) & tilemath.every_row(exact)
    delta = tau - tau_k
    if entmax15:
        (u2_v, u_v, ones_v), (s1, s2) = accs, sums[1:3]
        out = (u2_v - 2.0 * delta * u_v + delta * delta * ones_v, u_v - delta * ones_v,
               s2 - 2.0 * delta * s1 + delta * delta * size, s1 - delta * size)  # fmt: skip
    else:
        (u_v, ones_v), total = accs, sums[1]
        out = (u_v - delta * ones_v, ones_v, total - tau * size, size)
    return tau, confirmed, out


# ----------------------------------------------------------------------------------------------
# Backward kernels (the weights of a tile recomputed by tilemath.recompute).


def _add_dq_share(plan: Plan, refs, rows, p, ds, dp, raw, k, delta, eps):
    """``dq_accumulation="atomic"``: adds a (query tile, key block) share of dq and of the
    row terms to the float32 sums ``refs`` ``(dq [Tq, D], dα [Tq], d scale [Tq], d bias
    [Tq])`` by atomic adds (several key blocks' programs add to the same rows at once; the
    order of the additions, so the last bits, varies from run to run). ``rows``: the tile's
    query rows (a ``pl.ds``)."""
    from jax.experimental.pallas import triton as plgpu  # (see _call)

    dq_ref, dalpha_ref, dscale_ref, dbias_ref = refs
    plgpu.atomic_add(dq_ref, (rows, slice(None)), tilemath.dot(plan, ds.astype(k.dtype), k, 1, 0))
    alpha, raw_sum, row_sum = tilemath.row_terms(plan, p, ds, dp, raw, eps)
    if alpha is not None:
        plgpu.atomic_add(dalpha_ref, (rows,), tilemath.alpha_rows(plan, alpha, delta, eps)[:, 0])
    if raw_sum is not None:
        plgpu.atomic_add(dscale_ref, (rows,), raw_sum[:, 0])
    if row_sum is not None:
        plgpu.atomic_add(dbias_ref, (rows,), row_sum[:, 0])


def _dq_kernel(*refs, plan: Plan):
    names = tilemath.row_names(plan)
    scale_ref, len_ref, eps_ref, q_ref, k_ref, v_ref, bias_ref, key_nan_ref = refs[:8]
    qseg_ref, kvseg_ref, do_ref = refs[8:11]
    row_refs = dict(zip(names, refs[11 : 11 + len(names)], strict=True))
    idx_ref, cnt_ref, full_ref, pmi_ref, masks_ref, live_ref = refs[
        11 + len(names) : 17 + len(names)
    ]
    dq_ref, dalpha_ref, dscale_ref, dbias_ref = refs[17 + len(names) :]
    q, do = q_ref[...], do_ref[...]
    bq = q.shape[0]
    q_block, kv_length = _grid_block(plan.reverse_q, plan.nq), len_ref[0]  # (outside the loops)
    scale = scale_ref[0]
    eps, sigma = _eps_sigma(plan, eps_ref, bq)
    rows = {name: ref[...][:, None] for name, ref in row_refs.items()}
    delta = rows["delta"]

    def body(j, carry):
        kv_block = idx_ref[j]

        def load():
            return _key_block(k_ref, plan, kv_block), _key_block(v_ref, plan, kv_block)

        def visit(carry, loaded):
            k, v = loaded
            raw, s = _block_scores(q, k, kv_block, plan, scale, bias_ref, key_nan_ref)
            rt = _row_tile(plan, q_block, qseg_ref, kvseg_ref, kv_length, kv_block)
            x = _masked(plan, s, full_ref[j], pmi_ref[j], masks_ref, kv_block, rt)
            p, g = tilemath.recompute(plan, x, rows, eps, sigma)
            return tilemath.dq_step(
                plan, carry, p, g, tilemath.dot(plan, do, v), delta, raw, k, eps
            )

        return _visit_if_live(plan, live_ref[j], visit, load, carry)

    zeros_r = jnp.zeros((bq, 1), _F32)
    init = (jnp.zeros((bq, plan.d), _F32), (zeros_r,) * 4, zeros_r, zeros_r)
    dq, alpha_sums, ds_raw, ds_rows = jax.lax.fori_loop(0, cnt_ref[0], body, init)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dalpha_ref[...] = tilemath.alpha_rows(plan, alpha_sums, delta, eps)[:, 0]
    dscale_ref[...] = ds_raw[:, 0]
    dbias_ref[...] = ds_rows[:, 0]


def _dkv_kernel(*refs, plan: Plan):
    names = tilemath.row_names(plan)
    scale_ref, len_ref, eps_ref, q_ref, k_ref, v_ref, bias_ref, key_nan_ref = refs[:8]
    qseg_ref, kvseg_ref, do_ref = refs[8:11]
    row_refs = dict(zip(names, refs[11 : 11 + len(names)], strict=True))
    rest = refs[11 + len(names) :]
    t_rows_ref, t_slots_ref, t_cnt_ref, full_ref, pmi_ref, masks_ref, live_ref = rest[:7]
    outs = rest[7 + 4 * plan.atomic_dq :]  # (after the zeros the atomic sums start from)
    dk_ref, dv_ref, dbias_cols_ref = outs[:3]
    atomic_refs = outs[3:7] if plan.atomic_dq else None  # dq and the row terms' sums
    dense_bias_ref = outs[-1] if plan.bias_axes[2] and plan.bias_axes[3] else None
    bq, bkv = plan.bq, plan.bkv
    if dense_bias_ref is not None:  # tile by tile: Triton takes no tile of nq * bq rows
        zeros = jnp.zeros((bq, bkv), dense_bias_ref.dtype)

        def clear(i, carry):
            dense_bias_ref[pl.ds(pl.multiple_of(i * bq, bq), bq), :] = zeros
            return carry

        jax.lax.fori_loop(0, plan.nq, clear, 0)
    k, v = k_ref[...], v_ref[...]
    scale = scale_ref[0]
    kv_block, kv_length = _grid_block(plan.reverse_kv, plan.nk), len_ref[0]  # (outside loops)
    eps, sigma = _eps_sigma(plan, eps_ref, bq)

    def body(t, carry):
        row_block, slot = t_rows_ref[t], t_slots_ref[t]
        sl = pl.ds(pl.multiple_of(row_block * bq, bq), bq)

        def load():
            rows = {name: ref[sl][:, None] for name, ref in row_refs.items()}
            return q_ref[sl, :], do_ref[sl, :], rows

        def visit(carry, loaded):
            dk, dv, ds_cols = carry
            q, do, rows = loaded
            raw = tilemath.dot(plan, q, k)
            s = raw * scale + key_nan_ref[...][None, :]
            if plan.has_bias:
                s = s + (bias_ref[sl, :] if plan.bias_axes[2] else bias_ref[...])
            s = _clip_inf(s)
            rt = _runtime_tile(
                plan, row_block, kv_block, kv_length,
                lambda: qseg_ref[sl], lambda: kvseg_ref[...],
            )  # fmt: skip
            full, mask_index = full_ref[row_block, slot], pmi_ref[row_block, slot]
            x = _masked(plan, s, full, mask_index, masks_ref, kv_block, rt)
            p, g = tilemath.recompute(plan, x, rows, eps, sigma)
            dv = dv + tilemath.dot(plan, p.astype(do.dtype), do, 0, 0)
            dp = tilemath.dot(plan, do, v)
            ds = jnp.where(g != 0.0, g * (dp - rows["delta"]), 0.0)
            dk = dk + tilemath.dot(plan, ds.astype(q.dtype), q, 0, 0)
            if atomic_refs is not None:
                _add_dq_share(plan, atomic_refs, sl, p, ds, dp, raw, k, rows["delta"], eps)
            if dense_bias_ref is not None:
                dense_bias_ref[sl, :] = ds
            if plan.has_bias:
                ds_cols = ds_cols + jnp.sum(ds, axis=0)  # the bias' column gradient
            return dk, dv, ds_cols

        return _visit_if_live(plan, live_ref[row_block, slot], visit, load, carry)

    init = (
        jnp.zeros((bkv, plan.d), _F32),
        jnp.zeros((bkv, plan.dv), _F32),
        jnp.zeros((bkv,), _F32),
    )
    dk, dv, ds_cols = jax.lax.fori_loop(0, t_cnt_ref[0], body, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dbias_cols_ref[...] = ds_cols


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.


def _call(
    kernel, plan: Plan, grid, in_specs, out_specs, out_shape, name: str, aliases=None,
    reverse: bool = False,
):  # fmt: skip
    """``pl.pallas_call`` of ``kernel`` over ``grid``; ``reverse``: its first axis launched
    last-first (the specs' index maps given the block, not the program id: _grid_block)."""
    kwargs = {"input_output_aliases": aliases} if aliases else {}
    if reverse:
        last = grid[0] - 1

        def reorder(spec):
            index_map = spec.index_map
            return dataclasses.replace(spec, index_map=lambda i, *rest: index_map(last - i, *rest))

        in_specs, out_specs = [reorder(x) for x in in_specs], [reorder(x) for x in out_specs]
    if not plan.interpret:
        # Imported here, not at the top: it adds to the time of `import sparse_jax` (see
        # python -X importtime), paid on CPU where the kernels only ever run interpreted.
        from jax.experimental.pallas import triton as plgpu

        warps = plan.num_warps or (4 if plan.d <= 64 else 8)
        kwargs["compiler_params"] = plgpu.CompilerParams(
            num_warps=warps, num_stages=plan.num_stages
        )
    return pl.pallas_call(
        functools.partial(kernel, plan=plan),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=plan.interpret,
        name=name,
        **kwargs,
    )


def _scalar_spec():
    return pl.BlockSpec((1,), lambda *_: (0,))


def _length_spec():
    return pl.BlockSpec((1,), lambda i, bb, h: (bb,))


def _eps_spec(head_axis: int):
    return pl.BlockSpec((None, 1), lambda *ids: (ids[head_axis], 0))


def _row_segment_specs(plan: Plan, tk: int):
    """Segment ids for the grid (query block, batch, head): the query tile's, all the keys'."""
    return [
        pl.BlockSpec((None, plan.bq), lambda i, bb, h: (bb, i)),
        pl.BlockSpec((None, tk), lambda i, bb, h: (bb, 0)),
    ]


def _bias_rows_spec(plan: Plan, bias_shape):
    """The bias rows of a query tile, for the grid (query block, batch, head)."""
    ab, an, aq, ak = (int(x) for x in plan.bias_axes)
    block = (None, None, plan.bq if aq else 1, bias_shape[3] if ak else 1)
    return pl.BlockSpec(block, lambda i, bb, h: (bb * ab, h * an, i * aq, 0))


def forward(plan: Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, blocks=None):
    """The Triton forward: ``(o [B, Tq, N, Dv], residuals)`` (the row statistics, ``ū`` and the
    sparse normalizers' live flags ``[B, N, nq, Kp]``), inputs as
    :func:`~sparse_jax.kernels.plan.prepare` gives them (token-major, padded to whole blocks);
    ``blocks``: the layout arrays of a run-time block list (``plan.runtime``), else None."""
    a = plan.arrays
    b, n, g, bq, nq = plan.b, plan.n, plan.g, plan.bq, plan.nq
    tq, tk = q.shape[1], k.shape[1]
    head = plan.layout_head
    q_spec = pl.BlockSpec((None, bq, None, plan.d), lambda i, bb, h: (bb, i, h, 0))
    k_spec = pl.BlockSpec((None, tk, None, plan.d), lambda i, bb, h: (bb, 0, h // g, 0))
    v_spec = pl.BlockSpec((None, tk, None, plan.dv), lambda i, bb, h: (bb, 0, h // g, 0))
    kp = a["idx"].shape[-1]
    row_spec = pl.BlockSpec((None, None, kp), lambda i, bb, h: (head(bb, h), i, 0))
    layout_specs = [
        row_spec,
        pl.BlockSpec((None, None, 1), lambda i, bb, h: (head(bb, h), i, 0)),
        row_spec,
        row_spec,
        pl.BlockSpec(a["masks"].shape, lambda *_: (0, 0, 0)),
    ]
    layout_in = plan.layout_inputs(blocks, ("idx", "count", "full", "pmi", "masks"))
    o_shape = jax.ShapeDtypeStruct((b, tq, n, plan.dv), q.dtype)
    o_spec = pl.BlockSpec((None, bq, None, plan.dv), lambda i, bb, h: (bb, i, h, 0))
    stat_shape = jax.ShapeDtypeStruct((b, n, tq), _F32)
    stat_spec = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
    grid = (nq, b, n)
    bias_spec = _bias_rows_spec(plan, bias.shape)
    key_nan_spec = pl.BlockSpec((None, None, tk), lambda i, bb, h: (bb, h // g, 0))
    seg_specs = _row_segment_specs(plan, tk)
    if plan.kind == "softmax":
        o, lse = _call(
            _forward_softmax_kernel, plan, grid,
            [_scalar_spec(), _length_spec(), q_spec, k_spec, v_spec, bias_spec, key_nan_spec,
             *seg_specs, *layout_specs],
            [o_spec, stat_spec], [o_shape, stat_shape], "sparse_jax_pallas_softmax_fwd",
            reverse=plan.reverse_q,
        )(scale, lengths, q, k, v, bias, key_nan, q_ids, kv_ids, *layout_in)  # fmt: skip
        return o, {"lse": lse, "ubar": o.astype(_F32), "live": None}
    live_shape = jax.ShapeDtypeStruct((b, n, nq, kp), jnp.int32)
    live_spec = pl.BlockSpec((None, None, None, kp), lambda i, bb, h: (bb, h, i, 0))
    ubar_shape = jax.ShapeDtypeStruct((b, tq, n, plan.dv), _F32)
    o, ubar, row_max, tau, mass, live = _call(
        _forward_sparse_kernel, plan, grid,
        [_scalar_spec(), _length_spec(), _eps_spec(2), q_spec, k_spec, v_spec, bias_spec,
         key_nan_spec, *seg_specs, *layout_specs],
        [o_spec, o_spec, stat_spec, stat_spec, stat_spec, live_spec],
        [o_shape, ubar_shape, stat_shape, stat_shape, stat_shape, live_shape],
        f"sparse_jax_pallas_{plan.kind}_fwd", reverse=plan.reverse_q,
    )(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, *layout_in)  # fmt: skip
    return o, {"max": row_max, "tau": tau, "mass": mass, "ubar": ubar, "live": live}


def _live_flags(plan: Plan, live):
    """The forward's live flags ``[B, N, nq, K]`` on ``plan``'s tiles, or zeros ``[B, N, nq,
    1]`` where there are none (softmax: every block is visited)."""
    return live if live is not None else jnp.zeros((plan.b, plan.n, plan.nq, 1), jnp.int32)


def _dq_call(plan: Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do,
             row_values, live, blocks=None):  # fmt: skip
    """(dq, and the α, scale and bias row terms ``[B, N, Tq]``): the dq kernel, one program
    per query block of ``plan``'s tiles, over its kept key blocks."""
    a = plan.arrays
    b, n, g, bq, nq = plan.b, plan.n, plan.g, plan.bq, plan.nq
    tq, tk = q.shape[1], k.shape[1]
    head, kp, live_w = plan.layout_head, a["idx"].shape[-1], live.shape[-1]
    layout_in = plan.layout_inputs(blocks, ("idx", "count", "full", "pmi", "masks"))
    q_blk = pl.BlockSpec((None, bq, None, plan.d), lambda i, bb, h: (bb, i, h, 0))
    do_blk = pl.BlockSpec((None, bq, None, plan.dv), lambda i, bb, h: (bb, i, h, 0))
    k_all = pl.BlockSpec((None, tk, None, plan.d), lambda i, bb, h: (bb, 0, h // g, 0))
    v_all = pl.BlockSpec((None, tk, None, plan.dv), lambda i, bb, h: (bb, 0, h // g, 0))
    stat_blk = pl.BlockSpec((None, None, bq), lambda i, bb, h: (bb, h, i))
    row_spec = pl.BlockSpec((None, None, kp), lambda i, bb, h: (head(bb, h), i, 0))
    return _call(
        _dq_kernel, plan, (nq, b, n),
        [_scalar_spec(), _length_spec(), _eps_spec(2), q_blk, k_all, v_all,
         _bias_rows_spec(plan, bias.shape),
         pl.BlockSpec((None, None, tk), lambda i, bb, h: (bb, h // g, 0)),
         *_row_segment_specs(plan, tk), do_blk,
         *[stat_blk] * len(row_values),
         row_spec, pl.BlockSpec((None, None, 1), lambda i, bb, h: (head(bb, h), i, 0)), row_spec,
         row_spec, pl.BlockSpec(a["masks"].shape, lambda *_: (0, 0, 0)),
         pl.BlockSpec((None, None, None, live_w), lambda i, bb, h: (bb, h, i, 0))],
        [q_blk, stat_blk, stat_blk, stat_blk],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), *[jax.ShapeDtypeStruct((b, n, tq), _F32)] * 3],
        f"sparse_jax_pallas_{plan.kind}_dq", reverse=plan.reverse_q,
    )(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do, *row_values, *layout_in,
      live)  # fmt: skip


def backward(plan: Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, res, do,
             dq_tiles=None, blocks=None):  # fmt: skip
    """The Triton backward: the dq kernel (unless dq is added by atomic adds) and the dk/dv
    kernel on ``plan``'s tiles; ``dq_tiles``: ``(plan, live flags)`` of the dq kernel where its
    tiles differ (``dq_block``); ``blocks``: the layout arrays of a run-time block list."""
    a = plan.arrays
    b, n, g, bkv, nq, nk = plan.b, plan.n, plan.g, plan.bkv, plan.nq, plan.nk
    tq, tk = q.shape[1], k.shape[1]
    head = plan.layout_head
    # δ = do · ū per row [B, N, Tq].
    delta = jnp.einsum("bqnd,bqnd->bnq", do.astype(_F32), res["ubar"])
    rows = {**{key: res[key] for key in tilemath.row_names(plan)[:-1]}, "delta": delta}
    row_values = [rows[name] for name in tilemath.row_names(plan)]
    live = _live_flags(plan, res["live"])
    kp, live_w = a["idx"].shape[-1], live.shape[-1]
    if plan.atomic_dq:  # the dk/dv kernel adds them
        dq = dalpha_rows = dscale_rows = dbias_rows = None
    else:  # one program per query block
        dq_plan, dq_live = dq_tiles if dq_tiles is not None else (plan, res["live"])
        dq, dalpha_rows, dscale_rows, dbias_rows = _dq_call(
            dq_plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do, row_values,
            _live_flags(dq_plan, dq_live), blocks,
        )  # fmt: skip

    # dk, dv per query head: one program per key block, over the query blocks keeping it.
    mp = a["t_rows"].shape[-1]
    q_all = pl.BlockSpec((None, tq, None, plan.d), lambda c, bb, h: (bb, 0, h, 0))
    do_all = pl.BlockSpec((None, tq, None, plan.dv), lambda c, bb, h: (bb, 0, h, 0))
    k_blk = pl.BlockSpec((None, bkv, None, plan.d), lambda c, bb, h: (bb, c, h // g, 0))
    v_blk = pl.BlockSpec((None, bkv, None, plan.dv), lambda c, bb, h: (bb, c, h // g, 0))
    stat_all = pl.BlockSpec((None, None, tq), lambda c, bb, h: (bb, h, 0))
    t_spec = pl.BlockSpec((None, None, mp), lambda c, bb, h: (head(bb, h), c, 0))
    full_all = pl.BlockSpec((None, nq, kp), lambda c, bb, h: (head(bb, h), 0, 0))
    dk_blk = pl.BlockSpec((None, bkv, None, plan.d), lambda c, bb, h: (bb, c, h, 0))
    dv_blk = pl.BlockSpec((None, bkv, None, plan.dv), lambda c, bb, h: (bb, c, h, 0))
    ab, an, aq, ak = (int(x) for x in plan.bias_axes)
    bias_cols = pl.BlockSpec(
        (None, None, tq if aq else 1, bkv if ak else 1),
        lambda c, bb, h: (bb * ab, h * an, 0, c * ak),
    )
    # Per query head (GQA sums them below), in float32 when heads are summed.
    grad_dtype = (_F32, _F32) if g > 1 else (k.dtype, v.dtype)
    out_specs = [dk_blk, dv_blk, pl.BlockSpec((None, None, bkv), lambda c, bb, h: (bb, h, c))]
    out_shapes = [
        jax.ShapeDtypeStruct((b, tk, n, plan.d), grad_dtype[0]),
        jax.ShapeDtypeStruct((b, tk, n, plan.dv), grad_dtype[1]),
        jax.ShapeDtypeStruct((b, n, tk), _F32),
    ]
    sums, aliases = [], None
    if plan.atomic_dq:  # float32 sums of dq and of the row terms, from zeros
        n_in = 18 + len(row_values)  # the call's inputs before these
        sum_specs = [
            pl.BlockSpec((None, tq, None, plan.d), lambda c, bb, h: (bb, 0, h, 0)),
            *[pl.BlockSpec((None, None, tq), lambda c, bb, h: (bb, h, 0))] * 3,
        ]
        sums = [jnp.zeros((b, tq, n, plan.d), _F32), *[jnp.zeros((b, n, tq), _F32)] * 3]
        aliases = {n_in + i: 3 + i for i in range(4)}
        out_specs += sum_specs
        out_shapes += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sums]
    if aq and ak:  # a bias with both length axes: its gradient is dense like itself
        out_specs.append(pl.BlockSpec((None, None, tq, bkv), lambda c, bb, h: (bb, h, 0, c)))
        out_shapes.append(jax.ShapeDtypeStruct((b, n, tq, tk), _F32))
    grads = _call(
        _dkv_kernel, plan, (nk, b, n),
        [_scalar_spec(), _length_spec(), _eps_spec(2), q_all, k_blk, v_blk, bias_cols,
         pl.BlockSpec((None, None, bkv), lambda c, bb, h: (bb, h // g, c)),
         pl.BlockSpec((None, tq), lambda c, bb, h: (bb, 0)),
         pl.BlockSpec((None, bkv), lambda c, bb, h: (bb, c)), do_all,
         *[stat_all] * len(row_values),
         t_spec, t_spec, pl.BlockSpec((None, None, 1), lambda c, bb, h: (head(bb, h), c, 0)),
         full_all, full_all, pl.BlockSpec(a["masks"].shape, lambda *_: (0, 0, 0)),
         pl.BlockSpec((None, None, nq, live_w), lambda c, bb, h: (bb, h, 0, 0)),
         *(sum_specs if plan.atomic_dq else [])],
        out_specs, out_shapes, f"sparse_jax_pallas_{plan.kind}_dkv", aliases, plan.reverse_kv,
    )(scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, do, *row_values,
      *plan.layout_inputs(blocks, ("t_rows", "t_slots", "t_count", "full", "pmi", "masks")),
      live, *sums)  # fmt: skip
    dk, dv, dbias_cols = grads[:3]
    if plan.atomic_dq:
        dq, dalpha_rows, dscale_rows, dbias_rows = grads[3:7]
        dq = (dq * scale[0]).astype(q.dtype)
    dense_dbias = grads[-1] if aq and ak else None
    return dq, dk, dv, dalpha_rows, dscale_rows, dbias_rows, dbias_cols, dense_dbias
