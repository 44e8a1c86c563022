"""Block-sparse attention in plain XLA: cost and memory in proportion to the kept blocks.

:func:`blocksparse_attention` computes the same function as dense masked attention,

    out[b, i, n] = Σ_j p[b, n, i, j] v[b, j, n // G],
    p[b, n, i, :] = normalizer(scale · q[b, i, n] · k[b, :, n // G] + bias[b, n, i, :], mask),

but only over the (query block, key block) pairs that a :class:`~sparse_jax.masks.BlockLayout`
keeps (``mask.blocks(Tq, Tk, block_q, block_kv)``), in ``jax.nn.dot_product_attention``'s layout
(``[batch, seq, heads, head_dim]``), with grouped-query attention when the key heads divide the
query heads.

Design: gather, then normalize
------------------------------
``Tq``/``Tk`` are padded to multiples of the blocks and the queries are cut into ``nq`` blocks
of ``block_q`` rows. For every query block the layout lists its non-empty key blocks, padded
with a sentinel to a static width ``K`` (see *rows of different widths* below). The kernel
gathers those key/value blocks (``k[:, blocks]``, an XLA gather on static-shaped index arrays;
sentinel slots gather block 0 and are masked out), so each query block sees a *compact
row* of ``K * block_kv`` keys; scores ``[B, N, nq, block_q, K * block_kv]`` are formed, the
element mask of each gathered block is rebuilt from the layout (all True for full blocks, the
stored ``partial_masks`` for partial ones, False for sentinel slots; for run-time ``padding``
masks AND-ed with ``mask.predicate`` evaluated on the gathered positions), the normalizer runs
along the compact row and the weights multiply the gathered values.

This is exact for every normalizer, not an approximation: an entry that the mask excludes gets
probability exactly 0 under softmax, sparsemax and entmax alike, so normalising the compact row
(all the allowed entries plus some masked ones) gives the same probabilities as normalising the
full row. Work and memory are O(B · N · nq · K · block_q · block_kv), i.e. the kept blocks
(padded to the widest row of each row group), instead of O(B · N · Tq · Tk).

Gradients (q, k, v, bias, and α for α-entmax) come from autodiff: through the gathers (a
scatter-add in the backward pass) and the normalizers' custom rules (:mod:`sparse_jax.normalizers`).

Long sequences: the query blocks are processed ``query_blocks_per_step`` at a time with
``jax.lax.map`` over a ``jax.checkpoint``-ed step, so the peak memory of the forward *and* the
backward pass is that of one step (the backward recomputes a step's scores instead of storing
them). By default a step holds at most ``STEP_SCORES[backend]`` score entries; small problems
run as one step (no loop, no recomputation). On CPU small, cache-sized steps are also faster
(measured: docs/benchmarks.md, "Design measurements").

Rows of different widths: a query block computes ``K`` key blocks, its own kept ones padded
with sentinel slots (computed, then masked) up to the width of its *row group*. The query blocks
are sorted by count and cut into at most :data:`MAX_ROW_GROUPS` groups, each traced with its own
width (:func:`row_groups`), so a plain causal mask (rows of 1 ... nq blocks) computes about 1.1x
its kept blocks instead of 2x, and sliding windows (equal rows) stay in one group. Column
patterns whose stride is below the block size (``strided``, ``fixed`` with small blocks) keep
every causal block: their element density is low but their block density is not.
:func:`blocksparse_cost` reports the computed, kept and dense score counts, which is what a
dispatcher should compare.

Numerics follow :func:`sparse_jax.attention`: scores, the normalizer and the accumulation of
``p @ v`` are in float32 (float64 stays float64); ``p`` is cast to ``v``'s dtype for the product
and the output has ``q``'s dtype. A query row with nothing allowed (fully masked, or only
``-inf`` biases) gives output 0 and zero gradients for every normalizer, softmax included;
non-finite input follows the policy of :func:`sparse_jax.attention` (NaN in, NaN out for the rows
that see it; masked positions never matter), exactly as the dense engine does.
Arguments are checked in Python before anything is traced and raise ``ValueError``/``TypeError``
naming the argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import masks as masks_lib
from sparse_jax.masks import SENTINEL, BlockLayout
from sparse_jax.normalizers import NORMALIZERS, normalize
from sparse_jax.validation import (
    check_bias,
    check_bool,
    check_int,
    check_mask_fits,
    check_normalizer,
    check_qkv,
    check_scale,
)

__all__ = [
    "MAX_ROW_GROUPS",
    "NORMALIZERS",
    "STEP_SCORES",
    "BlockSparseCost",
    "blocksparse_attention",
    "blocksparse_cost",
    "head_groups",
    "row_groups",
]

#: With ``query_blocks_per_step=None``, a step takes as many query blocks as keep its scores
#: ``[B, N, blocks, block_q, K * block_kv]`` within this many entries, by
#: ``jax.default_backend()``: 2 MiB of float32 on CPU (measured: cache-sized steps run fastest),
#: 32 MiB elsewhere (not yet measured on accelerators, where bigger steps keep the device busy).
STEP_SCORES = {"cpu": 2**19, "default": 2**23}

_NAME = "blocksparse_attention"


# ----------------------------------------------------------------------------------------------
# Argument checking (Python, on static shapes; runs before anything is traced).


def _check_layout_mask(mask: Any, layout: BlockLayout, b: int, caller: str) -> Any:
    if not layout.dynamic:
        masks_lib.check_mask(mask, "mask", caller, optional=True)
        return None  # a static layout is exact: the mask is not needed
    if not isinstance(mask, masks_lib.Mask) or not mask.is_dynamic:
        raise ValueError(
            f"{caller}: `layout` is dynamic (built from a run-time `padding` mask) and only "
            "bounds the mask: pass the run-time mask it was built from as `mask=` (got "
            f"{type(mask).__name__}{'' if mask is None else ' without a padding part'})"
        )
    check_mask_fits(mask, caller, batch_size=b)
    if mask.num_heads != layout.num_heads:
        raise ValueError(
            f"{caller}: `mask` has num_heads={mask.num_heads} but `layout` has "
            f"num_heads={layout.num_heads}; pass the mask the layout was built from"
        )
    return mask


# ----------------------------------------------------------------------------------------------
# The kernel.


#: At most this many row groups (each is traced and compiled separately).
MAX_ROW_GROUPS = 8
#: Row grouping stops once the computed blocks are within this factor of the kept ones.
ROW_GROUP_SLACK = 1.125


def row_groups(layout: BlockLayout) -> list[tuple[np.ndarray, int]]:
    """Splits the query blocks of ``layout`` into groups computed with their own width.

    Every query block of a group computes ``width`` key blocks (its own kept ones padded with
    sentinel slots), so rows of very different counts (causal: 1 ... nq) waste work when they
    share one width. The rows are sorted by count (the maximum over heads) and cut into at most
    :data:`MAX_ROW_GROUPS` contiguous groups minimising ``Σ len(group) · width(group)`` (dynamic
    programming), using the fewest groups that come within :data:`ROW_GROUP_SLACK` of the kept
    blocks. Sliding windows stay in one group; a causal mask with 64 query blocks gets 8 groups
    that compute 1.11x its kept blocks instead of 1.97x.

    Returns:
      ``[(rows, width), ...]``: the query-block indices of each group (int32, sorted by count)
      and its width (>= 1).

    Example:
      >>> from sparse_jax.masks import causal
      >>> [(r.tolist(), w) for r, w in row_groups(causal().blocks(8, 8, 2, 2))]
      [([0], 1), ([1], 2), ([2, 3], 4)]
    """
    counts = np.maximum(layout.kv_block_counts.max(axis=0), 1).astype(np.int64)
    order = np.argsort(counts, kind="stable").astype(np.int32)
    c = counts[order]
    nq, kept = len(c), int(c.sum())
    # best[g][i]: least computed blocks covering the first i sorted rows with g groups.
    inf = np.iinfo(np.int64).max // 4
    best = np.full((MAX_ROW_GROUPS + 1, nq + 1), inf, np.int64)
    cut = np.zeros((MAX_ROW_GROUPS + 1, nq + 1), np.int64)
    best[0, 0] = 0
    sizes = np.arange(nq + 1)
    for g in range(1, MAX_ROW_GROUPS + 1):
        for i in range(1, nq + 1):
            j = sizes[:i]  # the last group is rows j .. i-1, of width c[i - 1]
            cost = best[g - 1, :i] + (i - j) * c[i - 1]
            cut[g, i] = int(np.argmin(cost))
            best[g, i] = cost[cut[g, i]]
        if best[g, nq] <= ROW_GROUP_SLACK * kept or g == min(MAX_ROW_GROUPS, nq):
            break
    groups, i = [], nq
    for last in range(g, 0, -1):
        j = int(cut[last, i])
        groups.append((order[j:i], int(c[i - 1])))
        i = j
    return [grp for grp in reversed(groups) if len(grp[0])]


class _Plan(NamedTuple):
    """Static shapes of one call."""

    b: int  # batch
    n: int  # query heads
    g: int  # query heads per key head
    a: int  # "gather heads": key heads (shared layout) or query heads (per-head layout)
    ga: int  # query heads per gather head (a * ga == n)
    per_head: bool  # the layout differs between heads
    bq: int
    bkv: int
    nq: int  # query blocks
    nk: int  # key blocks
    groups: tuple[tuple[np.ndarray, int, int, int], ...]  # (rows, width K, step, steps)


def _make_plan(q, v, layout: BlockLayout, steps_arg: int | None) -> _Plan:
    b, _, n, _ = q.shape
    kh = v.shape[2]
    g = n // kh
    per_head = layout.kv_block_indices.shape[0] > 1
    a, ga = (n, 1) if per_head else (kh, g)
    bq, bkv = layout.block_q, layout.block_kv
    budget = STEP_SCORES.get(jax.default_backend(), STEP_SCORES["default"])
    groups = []
    for rows, width in row_groups(layout):
        step = steps_arg or max(1, budget // (b * n * bq * width * bkv))
        step = min(len(rows), step)
        steps = -(-len(rows) // step)
        step = -(-len(rows) // steps)  # equal steps, least padding
        groups.append((rows, width, step, steps))
    return _Plan(
        b, n, g, a, ga, per_head, bq, bkv, layout.num_q_blocks, layout.num_kv_blocks, tuple(groups)
    )


def _layout_arrays(layout: BlockLayout, rows: np.ndarray, width: int, step: int, steps: int):
    """The layout rows ``rows`` cut to ``width`` slots and padded to ``steps * step`` rows,
    split per step: ``[steps, H, step, K]`` block indices (sentinels -> 0), validity, fullness
    and partial-mask ids, and the query-block index of each row ``[steps, step]`` (padding rows
    repeat row ``rows[0]``; their slots are invalid and their output is dropped)."""
    pad = steps * step - len(rows)
    rows_p = np.concatenate([rows, np.full(pad, rows[0], rows.dtype)])
    pad_row = np.arange(steps * step) >= len(rows)

    def take(x, fill):
        x = x[:, rows_p, :width]
        return np.where(pad_row[None, :, None], fill, x)

    idx = take(layout.kv_block_indices, SENTINEL)
    full = take(layout.block_is_full, False)
    pmi = take(layout.partial_mask_index, SENTINEL)
    valid = idx != SENTINEL
    h = idx.shape[0]

    def split(x):
        x = x.reshape(h, steps, step, width)
        return np.ascontiguousarray(np.moveaxis(x, 1, 0))

    return {
        "idx": split(np.where(valid, idx, 0).astype(np.int32)),
        "valid": split(valid),
        "full": split(full),
        "pmi": split(np.maximum(pmi, 0).astype(np.int32)),
        "partial": split(valid & ~full & (pmi != SENTINEL)),
        "rows": rows_p.astype(np.int32).reshape(steps, step),
    }


def nonfinite_values(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``v [B, Tk, K, Dv]`` -> (v with its non-finite value vectors zeroed, ``[B, Tk, K]`` score
    offsets: NaN at the keys whose value vector held a NaN or ±inf, 0 elsewhere).

    Why: ``p @ v`` computes ``0 * NaN = NaN``, so a non-finite value would reach every query row
    whose product happens to include its position, masked or not, and which rows those are
    depends on how an engine blocks the work (the dense engine: all of them). Added to the
    scores instead, the NaN reaches exactly the rows whose mask allows the key (the normalizers
    ignore masked scores), in every engine, for the cost of one fused addition.
    """
    bad = ~jnp.all(jnp.isfinite(v), axis=-1)
    clean = jnp.where(bad[..., None], jnp.zeros((), v.dtype), v)
    return clean, jnp.where(bad, jnp.nan, 0.0)


def widened(x: jax.Array, compute: Any) -> jax.Array:
    """``x`` in ``compute`` (float32/64) when its dtype is narrower, else ``x``."""
    return x.astype(compute) if jnp.finfo(x.dtype).bits < jnp.finfo(compute).bits else x


def shared_einsum(spec: str, a: jax.Array, shared: jax.Array, dtype, compute, precision):
    """``einsum(spec, a, shared.astype(dtype))`` accumulated in ``compute``, where ``shared`` may
    be a widened copy of a ``dtype`` operand (:func:`widened`) that many query chunks or blocks
    read; then its derivative stays in ``compute`` too instead of being rounded to ``dtype``
    piece by piece before the pieces are summed."""
    if shared.dtype == dtype:
        return jnp.einsum(spec, a, shared, preferred_element_type=compute, precision=precision)
    return _einsum_wide(spec, dtype, compute, precision, a, shared)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _einsum_wide(spec, dtype, compute, precision, a, wide):
    return jnp.einsum(
        spec, a, wide.astype(dtype), preferred_element_type=compute, precision=precision
    )


@_einsum_wide.defjvp
def _einsum_wide_jvp(spec, dtype, compute, precision, primals, tangents):
    a, wide = primals
    a_dot, wide_dot = tangents
    narrow = wide.astype(dtype)
    out = jnp.einsum(spec, a, narrow, preferred_element_type=compute, precision=precision)
    # The tangent of the wide operand meets ``a`` in ``compute``: its transpose (the gradient of
    # ``wide``) is then never rounded to ``dtype``.
    out_dot = jnp.einsum(
        spec, a_dot, narrow, preferred_element_type=compute, precision=precision
    ) + jnp.einsum(
        spec, a.astype(compute), wide_dot, preferred_element_type=compute, precision=precision
    )
    return out, out_dot


@functools.partial(jax.jit, static_argnames=("dtype",))
def log_sum_exp(s: jax.Array, allowed: Any, dtype: Any) -> jax.Array:
    """``log Σ_j exp(s[..., j])`` over the allowed keys, ``[B, N, C, Tk] -> [B, N, C]`` in
    ``dtype``, without gradient (the residual of ``return_residual``). The scores follow the
    softmax policy: ``-inf`` masks, ``+inf`` counts as the largest float, an allowed NaN gives
    NaN. A row with no allowed key gets ``finfo(dtype).min``, a finite stand-in for -inf."""
    s = jnp.minimum(s, jnp.finfo(s.dtype).max)
    keep = ~(s == -jnp.inf)
    if allowed is not None:
        keep = keep & allowed
    row_max = jnp.max(jnp.where(keep, s, jnp.finfo(s.dtype).min), axis=-1, keepdims=True)
    e = jnp.where(keep, jnp.exp(jnp.where(keep, s, row_max) - row_max), 0.0)
    has_any = jnp.any(keep, axis=-1)
    lse = row_max[..., 0] + jnp.log(jnp.where(has_any, jnp.sum(e, axis=-1), 1.0))
    return jax.lax.stop_gradient(jnp.where(has_any, lse.astype(dtype), jnp.finfo(dtype).min))


def _gather_bias(bias: jax.Array, rows: jax.Array, idx: jax.Array, plan: _Plan) -> jax.Array:
    """The bias of one step in the scores' layout ``[b', A', G', step, bq', K', bkv']``.

    ``bias`` is ``[b', n', nq' , bq', nk', bkv']`` (the 4-d bias with its padded query and key
    axes split into blocks; primed sizes are 1 where the bias broadcasts).
    """
    n1, nq1, nk1 = bias.shape[1], bias.shape[2], bias.shape[4]
    r = rows if nq1 > 1 else jnp.zeros_like(rows)
    if nk1 == 1:  # no key axis: nothing to gather
        x = bias[:, :, r]  # [b', n', step, bq', 1, 1]
    elif not plan.per_head:
        x = bias[:, :, r[:, None], :, idx[0], :]  # [step, K, b', n', bq', bkv']
        x = jnp.transpose(x, (2, 3, 0, 4, 1, 5))  # [b', n', step, bq', K, bkv']
    else:
        heads = jnp.arange(plan.n) if n1 > 1 else jnp.zeros(plan.n, jnp.int32)
        x = bias[:, heads[:, None, None], r[None, :, None], :, idx, :]  # [N, step, K, b', ...]
        x = jnp.transpose(x, (3, 0, 1, 4, 2, 5))  # [b', N, step, bq', K, bkv']
    n2 = x.shape[1]
    a, ga = (plan.a, plan.ga) if n2 > 1 else (1, 1)
    return x.reshape(x.shape[0], a, ga, *x.shape[2:])


def _run(q, k, v, layout, mask, bias, normalizer, scale, plan: _Plan, return_weights, precision):
    b, tq, n, d = q.shape
    tk, kh, dv = v.shape[1], v.shape[2], v.shape[3]
    p_ = plan
    compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    tq_p, tk_p = p_.nq * p_.bq, p_.nk * p_.bkv

    # Queries [B, Tq, N, D] -> blocks [nq, B, A, G', bq, D] (gathered per step by row).
    qb = jnp.pad(q, ((0, 0), (0, tq_p - tq), (0, 0), (0, 0)))
    qb = jnp.transpose(qb.reshape(b, p_.nq, p_.bq, p_.a, p_.ga, d), (1, 0, 3, 4, 2, 5))
    # Keys/values [B, Tk, Kh, D] -> [B, Kh, nk, bkv, D].
    kb = jnp.pad(k, ((0, 0), (0, tk_p - tk), (0, 0), (0, 0)))
    kb = jnp.transpose(kb.reshape(b, p_.nk, p_.bkv, kh, d), (0, 3, 1, 2, 4))
    v, key_nan = nonfinite_values(v)  # non-finite value vectors -> NaN scores of their keys
    vb = jnp.pad(v, ((0, 0), (0, tk_p - tk), (0, 0), (0, 0)))
    vb = jnp.transpose(vb.reshape(b, p_.nk, p_.bkv, kh, dv), (0, 3, 1, 2, 4))
    # Each key block is read by many query blocks, whose gradients add up (a scatter-add, then
    # over the steps): in half precision that sum loses digits, so the blocks are gathered
    # widened and their gradients stay in float32 until the one cast back (shared_einsum).
    kb, vb = widened(kb, compute), widened(vb, compute)
    key_nan = jnp.pad(key_nan.astype(compute), ((0, 0), (0, tk_p - tk), (0, 0)))
    key_nan = jnp.transpose(key_nan.reshape(b, p_.nk, p_.bkv, kh), (0, 3, 1, 2))

    partial_masks = layout.partial_masks
    if partial_masks.shape[0] == 0:  # every kept block is full
        partial_masks = np.zeros((1, p_.bq, p_.bkv), bool)
    partial_masks = jnp.asarray(partial_masks)
    head_of = np.arange(n) // p_.g  # key head read by each query head

    if bias is not None:  # [b', n', tq', tk'] -> [b', n', nq', bq', nk', bkv']
        b1, n1, tq1, tk1 = bias.shape
        bias = bias.astype(compute)
        if tq1 > 1:
            bias = jnp.pad(bias, ((0, 0), (0, 0), (0, tq_p - tq), (0, 0)))
        if tk1 > 1:
            bias = jnp.pad(bias, ((0, 0), (0, 0), (0, 0), (0, tk_p - tk)))
        nq1, bq1 = (p_.nq, p_.bq) if tq1 > 1 else (1, 1)
        nk1, bkv1 = (p_.nk, p_.bkv) if tk1 > 1 else (1, 1)
        bias = bias.reshape(b1, n1, nq1, bq1, nk1, bkv1)

    if isinstance(normalizer, jax.Array) and normalizer.ndim:  # α [1] or [N] -> rows' shape
        normalizer = jnp.broadcast_to(normalizer, (n,)).reshape(1, p_.a, p_.ga, 1, 1)

    def step_fn(x):
        idx, rows = x["idx"], x["rows"]  # [H, step, K], [step]
        width = idx.shape[-1]
        # Gather the key/value blocks of every query block: [B, A, step, K, bkv, D].
        if p_.per_head:
            sel = (slice(None), head_of[:, None, None], idx)
        else:
            sel = (slice(None), slice(None), idx[0])
        kg, vg, nan_g = kb[sel], vb[sel], key_nan[sel]
        qg = jnp.moveaxis(qb[rows], 0, 3)  # [B, A, G', step, bq, D]
        s = shared_einsum("bagcid,backjd->bagcikj", qg, kg, k.dtype, compute, precision)
        s = s * jnp.asarray(scale, compute) + nan_g[:, :, None, :, None]
        if bias is not None:
            s = s + _gather_bias(bias, rows, idx, p_)
        # Element mask of the gathered blocks [H, step, K, bq, bkv] -> scores' layout.
        pm = partial_masks[x["pmi"]]
        allowed = x["valid"][..., None, None] & (
            x["full"][..., None, None] | (pm & x["partial"][..., None, None])
        )
        # -> [1, H, 1, step, bq, K, bkv]
        allowed = jnp.transpose(allowed, (0, 1, 3, 2, 4))[None, :, None]
        if mask is not None:  # run-time part: evaluate the predicate on the gathered positions
            # Absolute positions: queries [step, bq], gathered keys [H, step, K, bkv].
            q_pos = rows[:, None] * p_.bq + jnp.arange(p_.bq, dtype=jnp.int32)[None, :]
            kv_pos = idx[..., None] * p_.bkv + jnp.arange(p_.bkv, dtype=jnp.int32).reshape(
                1, 1, 1, p_.bkv
            )
            h = idx.shape[0]
            live = mask.predicate(
                q_pos[None, None, :, :, None, None],
                kv_pos[None, :, :, None, :, :],
                head=None if mask.num_heads is None else jnp.arange(h).reshape(1, h, 1, 1, 1, 1),
                batch=jnp.arange(b).reshape(b, 1, 1, 1, 1, 1),
            )  # [B, H, step, bq, K, bkv]
            allowed = allowed & live[:, :, None]
        s_rows = s.reshape(*s.shape[:5], width * p_.bkv)
        allowed = jnp.broadcast_to(allowed, (allowed.shape[0], *s.shape[1:]))
        allowed = allowed.reshape(*allowed.shape[:5], width * p_.bkv)
        p = normalize(s_rows, allowed, normalizer).reshape(s.shape)
        out = shared_einsum(
            "bagcikj,backje->bagcie", p.astype(v.dtype), vg, v.dtype, compute, precision
        ).astype(q.dtype)
        return (out, p.astype(q.dtype)) if return_weights else out

    outs, weights, all_rows = [], [], []
    for rows, width, step, steps in p_.groups:
        arrays = _layout_arrays(layout, rows, width, step, steps)
        arrays = {key: jnp.asarray(val) for key, val in arrays.items()}
        if steps == 1:
            result = step_fn({key: val[0] for key, val in arrays.items()})
            result = jax.tree.map(lambda t: t[None], result)
        else:
            result = jax.lax.map(jax.checkpoint(step_fn, prevent_cse=False), arrays)
        out = result[0] if return_weights else result
        # [steps, B, A, G', step, bq, Dv] -> [B, rows, bq, N, Dv].
        out = jnp.transpose(out, (1, 0, 4, 5, 2, 3, 6)).reshape(b, steps * step, p_.bq, n, dv)
        outs.append(out[:, : len(rows)])
        all_rows.append(rows)
        if return_weights:
            weights.append((result[1], rows, width, step, steps))
    order = np.concatenate(all_rows)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    if not np.array_equal(order, np.arange(p_.nq)):
        out = out[:, np.argsort(order)]
    out = out.reshape(b, tq_p, n, dv)[:, :tq]
    if not return_weights:
        return out
    return out, _dense_weights(weights, layout, p_, tq, tk)


def _dense_weights(groups, layout: BlockLayout, p_: _Plan, tq: int, tk: int) -> jax.Array:
    """Scatters each group's weights ``[steps, B, A, G', step, bq, K, bkv]`` into the dense
    ``[B, N, Tq, Tk]`` array (sentinel slots and padding rows go to a dropped extra block)."""
    b = p_.b
    dense = None
    for w, rows, width, step, steps in groups:
        if dense is None:
            dense = jnp.zeros((b, p_.n, p_.nq, p_.nk + 1, p_.bq, p_.bkv), w.dtype)
        w = jnp.moveaxis(w, 0, 3).reshape(b, p_.n, steps * step, p_.bq, width, p_.bkv)
        w = jnp.transpose(w, (0, 1, 2, 4, 3, 5))[:, :, : len(rows)]  # [B, N, rows, K, bq, bkv]
        idx = layout.kv_block_indices[:, rows, :width]
        idx = np.broadcast_to(np.where(idx == SENTINEL, p_.nk, idx), (p_.n, len(rows), width))
        heads = np.arange(p_.n)[:, None, None]
        dense = dense.at[:, heads, rows[None, :, None], idx].add(w)
    dense = jnp.transpose(dense[:, :, :, : p_.nk], (0, 1, 2, 4, 3, 5))
    return dense.reshape(b, p_.n, p_.nq * p_.bq, -1)[:, :, :tq, :tk]


# ----------------------------------------------------------------------------------------------
# Public API.


def blocksparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: BlockLayout,
    *,
    mask: masks_lib.Mask | None = None,
    normalizer: Any = "softmax",
    scale: float | jax.Array | None = None,
    bias: jax.Array | None = None,
    return_weights: bool = False,
    query_blocks_per_step: int | None = None,
    precision: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Block-sparse multi-head attention over the blocks kept by ``layout``.

    Shapes: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``N`` query heads, ``Kh`` key/value
    heads (``Kh`` divides ``N``; query head ``n`` reads key head ``n // (N // Kh)``), ``D`` head
    dim of q/k, ``Dv`` head dim of v. ``bq``/``bkv`` are the layout's block sizes and ``K`` its
    ``max_count`` (see the module docstring for the algorithm and its cost).

    Args:
      q: ``[B, Tq, N, D]`` float queries.
      k: ``[B, Tk, Kh, D]`` keys, same dtype as ``q``.
      v: ``[B, Tk, Kh, Dv]`` values, same dtype as ``q``.
      layout: ``mask.blocks(Tq, Tk, bq, bkv)``, a :class:`~sparse_jax.masks.BlockLayout` for
        exactly these lengths; shared by all heads (``num_heads is None``) or per-head with
        ``N`` heads. Any ``bq``/``bkv`` work (padding is internal); multiples of 8 and sizes
        of 64–128 run best.
      mask: the run-time mask the layout was built from; required when ``layout.dynamic``
        (``padding(lengths) & ...``: the layout is only a static bound and the kernel ANDs it
        with ``mask.predicate`` on the gathered positions, batch element by batch element).
        Ignored for static layouts, which are exact.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"``, or α-entmax's α: a python
        float >= 1, or a float array of shape ``[]``, ``[1]`` or ``[N]`` (one α per query head;
        differentiable), under the rule of :func:`sparse_jax.entmax` (α = 1 is softmax; a
        traced α < 1 or non-finite makes its head's rows NaN).
      scale: multiplier of ``q·k``; default ``D ** -0.5``. A scalar float array is accepted.
      bias: optional float array broadcastable to ``[B, N, Tq, Tk]`` (rank <= 4), added to the
        scaled scores; ``-inf`` entries are masked. It is gathered block by block like the keys,
        so only kept blocks are read, but a bias with full ``Tq`` and ``Tk`` axes is itself an
        O(Tq·Tk) array that the caller must hold (a bias broadcasting over ``Tq`` or ``Tk``
        costs nothing extra). Differentiable.
      return_weights: also return the weights, scattered into a dense ``[B, N, Tq, Tk]`` array
        (O(Tq·Tk) memory: for tests and inspection).
      query_blocks_per_step: query blocks per ``lax.map`` step (the memory/recompute trade-off);
        default: as many as keep one step's scores within :data:`STEP_SCORES` entries (2**19
        on CPU), so small problems run in one step without a loop or recomputation.
      precision: passed to the two einsums (``jax.lax.Precision``).

    Returns:
      ``[B, Tq, N, Dv]`` in ``q``'s dtype; with ``return_weights``, ``(out, weights)``.

    Raises:
      ValueError, TypeError: for bad arguments (a layout for other lengths or another number of
      heads, an unknown normalizer, ...), before anything is traced.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> m = causal() & local(3, 0)  # each query sees itself and the 3 previous keys
      >>> q = k = v = jnp.ones((1, 10, 2, 4))  # [batch, seq, heads, head_dim]
      >>> out, w = blocksparse_attention(q, k, v, m.blocks(10, 10, 4, 4),
      ...                                normalizer="sparsemax", return_weights=True)
      >>> out.shape, w.shape
      ((1, 10, 2, 4), (1, 2, 10, 10))
      >>> (12 * w[0, 0, :5, :5]).round().astype(int).tolist()  # uniform on allowed keys
      [[12, 0, 0, 0, 0], [6, 6, 0, 0, 0], [4, 4, 4, 0, 0], [3, 3, 3, 3, 0], [0, 3, 3, 3, 3]]
    """
    caller = _NAME
    check_qkv(q, k, v, caller)
    b, tq, n, d = q.shape
    tk = k.shape[1]
    layout = masks_lib.check_layout(layout, tq, tk, n, caller)
    mask = _check_layout_mask(mask, layout, b, caller)
    bias = check_bias(bias, (b, n, tq, tk), caller)
    normalizer = check_normalizer(normalizer, n, caller)
    scale = check_scale(scale, d, caller)
    steps = (
        None
        if query_blocks_per_step is None
        else check_int(query_blocks_per_step, "query_blocks_per_step", caller)
    )
    return_weights = check_bool(return_weights, "return_weights", caller)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    groups = head_groups(layout)
    if len(groups) == 1:
        plan = _make_plan(q, v, layout, steps)
        return _run(
            q, k, v, layout, mask, bias, normalizer, scale, plan, bool(return_weights), precision
        )
    # Heads with different layouts run separately, each group with its own row widths (a
    # window head no longer computes as many blocks as a full-causal head beside it).
    g = n // k.shape[2]
    outs, weights = [], []
    for heads, sub in groups:
        norm = normalizer
        if isinstance(norm, jax.Array) and norm.ndim:
            norm = jnp.broadcast_to(norm, (n,))[heads]
        sub_bias = bias if bias is None or bias.shape[1] == 1 else bias[:, heads]
        qs, ks, vs = q[:, :, heads], k[:, :, heads // g], v[:, :, heads // g]
        plan = _make_plan(qs, vs, sub, steps)
        result = _run(
            qs, ks, vs, sub, None, sub_bias, norm, scale, plan, bool(return_weights), precision
        )
        outs.append(result[0] if return_weights else result)
        if return_weights:
            weights.append(result[1])
    order = np.argsort(np.concatenate([heads for heads, _ in groups]))
    out = jnp.concatenate(outs, axis=2)[:, :, order]
    if not return_weights:
        return out
    return out, jnp.concatenate(weights, axis=1)[:, order]


def head_groups(layout: BlockLayout) -> list[tuple[np.ndarray, BlockLayout]]:
    """Heads of a per-head ``layout`` grouped by identical block structure, each group with a
    shared (``num_heads=None``) layout; one group holding every head for a shared layout, a
    per-head layout whose heads all agree, or a dynamic one (whose run-time mask is per head).

    Example:
      >>> from sparse_jax.masks import causal, local, per_head
      >>> lay = per_head([causal(), causal() & local(3, 0), causal()]).blocks(16, 16, 4, 4)
      >>> [heads.tolist() for heads, _ in head_groups(lay)]
      [[0, 2], [1]]
    """
    h = layout.kv_block_indices.shape[0]
    if layout.num_heads is None or layout.dynamic:
        return [(np.arange(max(h, layout.num_heads or 1)), layout)]
    keys: dict[bytes, list[int]] = {}
    for head in range(h):
        key = b"".join(
            np.ascontiguousarray(a[head]).tobytes()
            for a in (layout.kv_block_indices, layout.block_is_full, layout.partial_mask_index)
        )
        keys.setdefault(key, []).append(head)
    if len(keys) == 1:
        return [(np.arange(h), layout)]
    groups = []
    for heads in keys.values():
        first = heads[0]
        counts = layout.kv_block_counts[first : first + 1]
        width = max(1, int(counts.max()))
        sub = dataclasses.replace(
            layout,
            kv_block_indices=layout.kv_block_indices[first : first + 1, :, :width],
            kv_block_counts=counts,
            block_is_full=layout.block_is_full[first : first + 1, :, :width],
            partial_mask_index=layout.partial_mask_index[first : first + 1, :, :width],
            num_heads=None,
        )
        groups.append((np.asarray(heads), sub))
    return groups


class BlockSparseCost(NamedTuple):
    """Work of :func:`blocksparse_attention` (see :func:`blocksparse_cost`).

    Example (causal, 4 x 4 blocks of 2 x 2: 10 kept; the row groups of :func:`row_groups`
    compute 1, 2, 4 and 4 key blocks for the 4 query blocks, 11 blocks of 4 scores):

      >>> from sparse_jax.masks import causal
      >>> layout = causal().blocks(8, 8, 2, 2)
      >>> blocksparse_cost(layout, batch=1, num_heads=1, head_dim=4)  # q, k, v [1, 8, 1, 4]
      BlockSparseCost(computed_scores=44, kept_scores=40, dense_scores=64, flops=704,
                      dense_flops=1024)
    """

    computed_scores: int  # score entries the kernel forms: B·N·Σ_groups rows·K·bq·bkv
    kept_scores: int  # entries of the kept blocks: B·N·Σ counts·bq·bkv
    dense_scores: int  # entries of dense attention: B·N·Tq·Tk
    flops: int  # forward matmul FLOPs of the kernel: 2·computed_scores·(D + Dv)
    dense_flops: int  # the same for dense attention: 2·dense_scores·(D + Dv)


def blocksparse_cost(
    layout: BlockLayout,
    *,
    batch: int,
    num_heads: int,
    head_dim: int,
    head_dim_v: int | None = None,
) -> BlockSparseCost:
    """Score entries and forward matmul FLOPs of :func:`blocksparse_attention` for ``layout``,
    against dense attention. The backward pass costs about twice the forward FLOPs (three times
    with recomputation when the kernel runs in several steps).

    Args:
      layout: the :class:`~sparse_jax.masks.BlockLayout` passed to the kernel.
      batch, num_heads: ``B`` and ``N`` (query heads).
      head_dim, head_dim_v: ``D`` and ``Dv`` (default ``D``).

    Returns:
      A :class:`BlockSparseCost`.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> c = blocksparse_cost((causal() & local(255, 0)).blocks(4096, 4096, 128, 128),
      ...                      batch=1, num_heads=1, head_dim=64)
      >>> round(c.dense_flops / c.flops, 1)  # each query block computes 3 key blocks of 32
      10.7
    """
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"blocksparse_cost: `layout` must be a BlockLayout; got {type(layout)}")
    dv = head_dim if head_dim_v is None else head_dim_v
    per_head = num_heads if layout.num_heads is None else 1
    block = layout.block_q * layout.block_kv
    if layout.num_heads is None:
        blocks = num_heads * sum(len(rows) * width for rows, width in row_groups(layout))
    else:  # head groups run separately, each with its own row groups
        blocks = sum(
            len(heads) * sum(len(rows) * width for rows, width in row_groups(sub))
            for heads, sub in head_groups(layout)
        )
    computed = batch * blocks * block
    kept = batch * per_head * int(layout.kv_block_counts.sum()) * block
    dense = batch * num_heads * layout.q_len * layout.kv_len
    return BlockSparseCost(
        computed, kept, dense, 2 * computed * (head_dim + dv), 2 * dense * (head_dim + dv)
    )
