"""Fused block-sparse attention in Pallas for softmax, sparsemax, 1.5-entmax and α-entmax.

:func:`pallas_attention` computes the same function as :func:`sparse_jax.blocksparse_attention`
(``[batch, seq, heads, head_dim]``, a :class:`~sparse_jax.masks.BlockLayout`, grouped-query
attention, ``Tq != Tk``) with the work of a query block done in on-chip memory: the scores of
a block are formed, used and dropped, never written to HBM, and only the key blocks the layout
keeps are visited.

Forward (one program per query block, batch element and head):

* softmax: the online (flash) recurrence over the kept key blocks (running maximum, running
  sum, running ``p @ v``); the row's log-sum-exp is kept for the backward pass.
* sparsemax, 1.5-entmax, α-entmax: the row's threshold τ is found without materialising the
  row. The searches of :mod:`sparse_jax.normalizers` (Michelot's iteration, Newton on the
  2-norm with its exact quadratic check, safeguarded Newton for any α) are written as
  per-entry terms and a per-row update (:class:`~sparse_jax.normalizers.RowSearch`), so each
  pass of a search sums its terms block by block over the kept key blocks. A first pass finds
  the row maximum and large values of the row (each block's 2 largest, the 16 or 32 largest
  of those), whose closed form starts the search from a lower bound of τ; the search passes
  follow, then one pass accumulates ``p @ v``. Sparsemax's and 1.5-entmax's search passes
  (1.5-entmax's from the second) accumulate it as they go (the values times ``(z - τ_k)_+``,
  its square and ``1_S``, from which the output at the threshold the pass finds follows
  exactly when the pass confirms it): a tile whose last search pass confirms every row's
  threshold needs no output pass (most sparsemax tiles: their start is mostly τ itself). The
  output pass (or that last search pass)
  records which key blocks hold any nonzero weight: a block whose scores all fall below τ
  skips its ``p @ v`` products there and its work in the backward pass (with
  ``prefetch=True`` its operands are still loaded, before the test), so the sparsity the
  normalizer creates saves work, not only the mask's.

Backward (two kernels, FlashAttention-2 style, no ``n x n`` buffer): with ``g_i = p_i^(2-α)``
on the support (``p`` for softmax, ``1[p > 0]`` for sparsemax, ``√p`` for 1.5-entmax) the
normalizers' Jacobian gives ``ds = g ⊙ (dp - δ)`` with ``δ = Σ g dp / Σ g = do · ū`` and
``ū = Σ g v / Σ g``, which the forward pass accumulates beside the output (``ū = o`` for
softmax). One kernel walks the kept key blocks of each query block for ``dq`` (and the α and
scale derivatives, ``δ Σ c - Σ dp c`` per row, plus ``(Σ dp s' - δ Σ s') / ε²`` for α >= 1.5,
with the ``c`` and ``s'`` of :func:`~sparse_jax.normalizers.entmax_alpha_terms`); the other
walks, for each key block, the query blocks that keep it (the transposed layout) for ``dk``
and ``dv``. With ``dq_accumulation="atomic"`` the second kernel alone does both: it adds each
tile's share of ``dq`` and of the row terms to float32 sums by atomic adds (FlashAttention-2's
way: 5 tile products where the two kernels take 7, their scores and ``do @ vᵀ`` formed once).

Launch order: a grid whose later blocks hold more work than its earlier ones (a causal mask's
query blocks; key blocks when keys follow their queries) is launched last block first, so that
its longest programs start first and the short ones fill the end.

Numerics follow :func:`sparse_jax.attention`: scores, normalizer and accumulation in float32,
``p`` cast to ``v``'s dtype for its product, output in ``q``'s dtype; fully masked rows give
0 and zero gradients; non-finite input follows the attention policy (``+inf`` scores count as
the largest float, an allowed NaN makes the row NaN, a non-finite value vector makes its key's
scores NaN).

Backends: the GPU kernels (:mod:`sparse_jax.kernels.triton`) use only what Pallas lowers with
Triton and run unchanged in Pallas' interpret mode, which is how they run, and are tested, on
CPU (``interpret=None`` picks it there). Block sizes must be powers of two >= 16 (Triton's
tiles); the kernels run on tiles of at most 64 x 64 cut from them (``forward_block``,
``backward_block``); head dims are zero-padded to one. On TPU, :func:`pallas_attention` runs the
same algorithm written for Mosaic (:mod:`sparse_jax.kernels.mosaic`: blocks multiples of 128,
key blocks streamed by DMA).

Run-time masks: ``static & padding(lengths)`` and ``& segments(ids)`` are applied as each batch
element's key length and segment ids beside the layout's static tiles. A ``padding`` and a
``segments`` leaf under ``|`` or ``~`` (``causal() | padding(prefix)``: a prefix-LM mask with a
run-time prefix per batch element) are evaluated tile by tile in the Triton and the Mosaic
kernels from the positions, the length and the ids (:class:`~sparse_jax.masks.TileExpression`),
over the blocks the layout's conservative bound keeps. Not supported (yet; :func:`pallas_supports`
says so and ``impl="auto"`` takes another engine): other run-time masks (two leaves of a kind
under ``|`` or ``~``, or beside an array mask), ``return_weights``, float64.

Run-time block lists: :func:`pallas_block_list_attention` takes the key blocks of each batch
element, query head and query block as a traced int array (what
:func:`sparse_jax.topk_block_attention` selects from the data). The kernels are the same; their
layout arrays, built in XLA from the lists (:func:`~sparse_jax.kernels.plan.block_list_arrays`:
each row's kept blocks, their full flags and partial masks from the static layout of ``causal()``
or ``full()``, and the transposed lists for the dk/dv kernel, of static widths), are inputs with
one row per (batch element, head), which each program's index maps select, as splash attention
takes its block indices; so a new selection needs no new compilation.

Modules, each importing only those below it: this one, the entries (:func:`pallas_attention`,
:func:`pallas_block_list_attention`, their custom VJP, :func:`capped_forward`);
:mod:`~sparse_jax.kernels.triton` and :mod:`~sparse_jax.kernels.mosaic`, the kernels;
:mod:`~sparse_jax.kernels.tilemath`, the tile maths both share; :mod:`~sparse_jax.kernels.plan`,
the call plan, the block rules and what is supported (:func:`pallas_supports`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.kernels import triton
from sparse_jax.kernels.plan import (
    TRITON_TILE,
    Plan,
    on_tiles,
    pallas_supports,
    prepare,
    prepare_block_list,
)
from sparse_jax.masks import BlockLayout, Mask
from sparse_jax.validation import check_bool, check_int

__all__ = [
    "TRITON_TILE",
    "capped_forward",
    "pallas_attention",
    "pallas_block_list_attention",
    "pallas_supports",
]


# ----------------------------------------------------------------------------------------------
# The custom VJP: the forward and backward kernels of the plan's target.


def _finish_gradients(plan: Plan, k, v, grads):
    """The kernels' gradient pieces reduced to the inputs' gradients: grouped-query heads
    summed, the α and scale row terms summed, the bias' rows/columns/tiles reduced over the
    axes it broadcasts along."""
    dq, dk, dv, dalpha_rows, dscale_rows, dbias_rows, dbias_cols, dense_dbias = grads
    b, tk, kh = k.shape[0], k.shape[1], k.shape[2]
    if plan.g > 1:  # grouped-query attention: a key head's gradient sums its query heads'
        dk = dk.reshape(b, tk, kh, plan.g, plan.d).sum(3).astype(k.dtype)
        dv = dv.reshape(b, tk, kh, plan.g, plan.dv).sum(3).astype(v.dtype)
    deps = jnp.sum(dalpha_rows, axis=(0, 2))[:, None] if plan.kind == "entmax" else None
    dscale = jnp.sum(dscale_rows).reshape(1)
    _, _, aq, ak = plan.bias_axes
    if aq and ak:
        dbias = dense_dbias
    elif ak:
        dbias = dbias_cols[:, :, None, :]
    elif aq:
        dbias = dbias_rows[..., None]
    else:
        dbias = jnp.sum(dbias_rows, axis=-1)[..., None, None]
    dbias = jnp.sum(dbias, axis=tuple(i for i in (0, 1) if not plan.bias_axes[i]), keepdims=True)
    return dq, dk, dv, deps, dscale, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan: Plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, blocks):
    return _fused_fwd(plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, blocks)[0]


def _kernels(plan: Plan):
    """The forward and backward that run: the Triton kernels' or the Mosaic ones' (TPU), the
    latter imported when first used (it adds to `import sparse_jax` what CPU users never run)."""
    if plan.target == "mosaic":
        from sparse_jax.kernels import mosaic

        return mosaic.forward, mosaic.backward
    return triton.forward, triton.backward


def _fused_fwd(plan, scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids, blocks):
    """``blocks``: the layout arrays of a run-time block list (``plan.runtime``), else None."""
    inputs = (scale, lengths, eps, q, k, v, bias, key_nan, q_ids, kv_ids)
    o, res = _kernels(plan)[0](plan, *inputs, blocks=blocks)
    return o, (inputs, blocks, res)


def _fused_bwd(plan, residuals, do):
    inputs, blocks, res = residuals
    scale, lengths, eps, _, k, v, bias, key_nan, q_ids, kv_ids = inputs
    if plan.backward is not None or plan.backward_dq is not None:  # (Triton: backward_block,
        kv_plan, kv_res = on_tiles(plan, plan.backward, res)  # dq_block)
        dq_plan, dq_res = (
            (kv_plan, kv_res) if plan.backward_dq is plan.backward
            else on_tiles(plan, plan.backward_dq, res)
        )  # fmt: skip
        grads = triton.backward(kv_plan, *inputs, kv_res, do, dq_tiles=(dq_plan, dq_res["live"]))
    else:
        grads = _kernels(plan)[1](plan, *inputs, res, do, blocks=blocks)
    dq, dk, dv, deps, dscale, dbias = _finish_gradients(plan, k, v, grads)
    # A head whose α breaks the rule (ε NaN) has NaN rows and NaN dq, dk, dv: its dα is NaN
    # too, as the XLA engines give it, also where its rows' cotangent is zero.
    deps = jnp.zeros_like(eps) if deps is None else jnp.where(jnp.isnan(eps), jnp.nan, deps)

    def no_cotangent(x):  # integer inputs (lengths, segment ids, a block list's arrays)
        return np.zeros(x.shape, jax.dtypes.float0)

    # key_nan is NaN or 0 (a mark, not a value): its cotangent is zero.
    return (dscale.astype(scale.dtype), no_cotangent(lengths), deps.astype(eps.dtype), dq, dk,
            dv, dbias.astype(bias.dtype), jnp.zeros_like(key_nan), no_cotangent(q_ids),
            no_cotangent(kv_ids), jax.tree.map(no_cotangent, blocks))  # fmt: skip


_fused.defvjp(_fused_fwd, _fused_bwd)


# ----------------------------------------------------------------------------------------------
# Public API.


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: BlockLayout,
    *,
    mask: Mask | None = None,
    normalizer: Any = "softmax",
    scale: float | jax.Array | None = None,
    bias: jax.Array | None = None,
    interpret: bool | None = None,
    precision: Any = None,
    target: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    forward_block: tuple[int, int] | None = None,
    backward_block: tuple[int, int] | None = None,
    dq_accumulation: str | None = None,
    prefetch: bool | None = None,
    dq_block: tuple[int, int] | None = None,
) -> jax.Array:
    """Fused block-sparse attention over the blocks kept by ``layout`` (see the module docstring).

    Shapes: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``N`` query heads, ``Kh`` key/value
    heads (``Kh`` divides ``N``), ``D``/``Dv`` head dims.

    Args:
      q: ``[B, Tq, N, D]`` queries, float32, bfloat16 or float16.
      k: ``[B, Tk, Kh, D]`` keys, ``v``: ``[B, Tk, Kh, Dv]`` values, ``q``'s dtype.
      layout: ``mask.blocks(Tq, Tk, bq, bkv)`` (shared or per-head with ``N`` heads); ``bq``
        and ``bkv`` powers of two >= 16 for the Triton kernels, multiples of 128 for the
        Mosaic ones.
      mask: the run-time mask a dynamic layout was built from: a static mask ``&``
        ``padding(lengths)`` (keys ``j >= lengths[b]`` of batch element ``b`` are masked)
        and/or ``& segments(q_ids, kv_ids)`` (packed sequences), or at most one ``padding``
        and one ``segments`` leaf under ``|`` and ``~`` (e.g. ``causal() | padding(prefix)``);
        ignored for static layouts.
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"``, or α-entmax's α: a python
        float >= 1 or a float array of shape ``[]``, ``[1]`` or ``[N]`` (differentiable),
        under the rule of :func:`sparse_jax.entmax` (α = 1 is softmax; a traced α < 1 or
        non-finite makes its head's rows NaN).
      scale: multiplier of ``q·k``, default ``D ** -0.5``; a scalar array is differentiable.
      bias: optional float array broadcastable to ``[B, N, Tq, Tk]`` (rank <= 4), added to the
        scaled scores (``-inf`` masks), read tile by tile; differentiable (its gradient is
        reduced in the kernels over the axes it broadcasts along).
      interpret: run the kernels in Pallas' interpret mode; default: on CPU only.
      precision: of the tiles' products (``jax.lax.Precision``); default: full float32 for
        float32 inputs (Triton's default would be TF32), the inputs' own for half precision.
      target: ``"triton"`` (the GPU kernels of :mod:`sparse_jax.kernels.triton`) or
        ``"mosaic"`` (the TPU kernels of :mod:`sparse_jax.kernels.mosaic`); default:
        ``"mosaic"`` on TPU, else ``"triton"``. Both run in interpret mode on CPU.
      num_warps, num_stages: the Triton kernels' warps per program (1, 2, 4, 8 or 16) and
        software-pipelining depth (>= 1), as in FlexAttention's ``kernel_options``; default 4
        warps for head dims up to 64, else 8, and 2 stages. Unused by Mosaic and in interpret
        mode. ``python -m experiments.bench pallas_tuning`` times the choices.
      forward_block: ``(bq, bkv)`` tiles of the Triton kernels, powers of two >= 16 dividing
        the layout's blocks: the layout is cut into them (a tile of a partial block that the
        mask leaves empty is dropped, so for a static mask they are the tiles of
        ``mask.blocks(Tq, Tk, bq, bkv)``); default ``(64, 64)`` (:data:`TRITON_TILE`, at most
        the blocks), the fastest measured on an H200 (``docs/benchmarks.md``). Mosaic runs on
        the layout's blocks.
      backward_block: ``(bq, bkv)`` tiles of the two backward kernels, dividing the forward's
        tiles (FlashAttention-2 and jax's Pallas ``mha`` use smaller tiles in the backward
        pass, whose tiles hold more live values); default: the forward's tiles.
      dq_block: ``(bq, bkv)`` tiles of the dq kernel alone, dividing the forward's tiles:
        its programs hold a query tile and walk key tiles, the dk/dv kernel's the reverse, so
        each may take its own shape (FlashAttention-2's Triton backward: many keys by few
        queries for dk/dv, the transpose for dq); default: ``backward_block``. Triton
        kernels, ``dq_accumulation="separate"`` only.
      dq_accumulation: how the backward forms dq (and the α, scale and bias row terms):
        ``"separate"`` (the default), a kernel of its own that walks each query block's key
        blocks, recomputing their scores and ``do @ vᵀ`` (7 tile products in the backward);
        or ``"atomic"``, the dk/dv kernel adds each tile's share to float32 sums by atomic
        adds, FlashAttention-2's way (5 products, one kernel; the order of the additions,
        so dq's last bits, varies from run to run). Triton kernels only.
      prefetch: sparse normalizers skip the products of key blocks in which the forward
        found no weight (softmax skips none); True: each visited block's operands are loaded
        before that test, in the loop's own body, where Triton pipelines the loads with the
        previous block's work, at the cost of loading the blocks then skipped; default
        False: only blocks with weight load theirs, inside the branch they take. Triton
        kernels only (Mosaic streams every block by DMA).

    Returns:
      ``[B, Tq, N, Dv]`` in ``q``'s dtype. Differentiable in q, k, v, an array α and an array
      scale.

    Raises:
      ValueError, TypeError: for bad or unsupported arguments, before anything is traced.

    Example:
      >>> from sparse_jax.masks import causal, local
      >>> q = k = v = jnp.ones((1, 32, 2, 16))  # [batch, seq, heads, head_dim]
      >>> layout = (causal() & local(7, 0)).blocks(32, 32, 16, 16)
      >>> out = pallas_attention(q, k, v, layout, normalizer="sparsemax")
      >>> out.shape, bool(jnp.allclose(out, 1.0))
      ((1, 32, 2, 16), True)
    """
    plan, inputs = prepare(
        q, k, v, layout, mask, normalizer, scale, bias, interpret, precision, target, num_warps,
        num_stages, forward_block, backward_block, dq_accumulation, prefetch, dq_block,
    )  # fmt: skip
    out = _fused(plan, *inputs, None)
    return out[:, : q.shape[1], :, : v.shape[3]]


def pallas_block_list_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    indices: jax.Array,
    *,
    block_size: tuple[int, int],
    causal: bool = True,
    normalizer: Any = "softmax",
    scale: float | jax.Array | None = None,
    interpret: bool | None = None,
    precision: Any = None,
    target: str | None = None,
    forward_block: tuple[int, int] | None = None,
) -> jax.Array:
    """Fused attention over key blocks listed at run time, per batch element, query head and
    query block (the kernels of :func:`pallas_attention`, their layout arrays built in XLA).

    ``indices`` is a traced int array, e.g. the blocks :func:`sparse_jax.topk_block_attention`
    selects (``return_indices=True``): the forward and backward kernels read each program's
    list from it, as splash attention takes its block indices, so a selection that changes
    with the data costs no recompilation. The lists are turned into the kernels' layout arrays
    with ``jnp`` ops (:func:`~sparse_jax.kernels.plan.block_list_arrays`): each query block's
    kept blocks, their full/partial flags and partial masks (read from the static layout of
    ``causal()``, or of ``full()``: the causal diagonal tiles and the blocks holding padding
    are partial, the others full), and the transposed lists the dk/dv kernel walks (static
    width: a power of two >= the query blocks that may keep a key block). Within the listed
    blocks attention is exact: it equals :func:`sparse_jax.attention` under the mask the
    blocks define (with ``j <= i`` when ``causal``).

    Shapes: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``N`` query heads, ``Kh`` key/value
    heads (``Kh`` divides ``N``), ``D``/``Dv`` head dims, ``nq = ceil(Tq / bq)`` query blocks,
    ``nk = ceil(Tk / bkv)`` key blocks, ``K`` slots per query block.

    Args:
      q: ``[B, Tq, N, D]`` queries, float32, bfloat16 or float16.
      k: ``[B, Tk, Kh, D]`` keys, ``v``: ``[B, Tk, Kh, Dv]`` values, ``q``'s dtype.
      indices: int ``[B, N, nq, K]``: the key blocks each query block attends to, in any
        order, ``SENTINEL`` (-1) in empty slots; the valid entries of a row must be distinct.
        Entries outside ``[0, nk)`` and blocks with nothing allowed (after the diagonal when
        ``causal``) are dropped. Not differentiated.
      block_size: ``(bq, bkv)``: powers of two >= 16 for the Triton kernels, multiples of 128
        for the Mosaic ones.
      causal: key ``j`` is allowed for query ``i`` only when ``j <= i`` (absolute positions).
      normalizer, scale, interpret, precision, target: as in :func:`pallas_attention`.
      forward_block: ``(bq, bkv)`` tiles of the Triton kernels (both passes), powers of two
        >= 16 dividing ``block_size``: each listed block becomes the list of its tiles, a tile
        with nothing allowed dropped; default ``(64, 64)`` (:data:`TRITON_TILE`, at most the
        blocks), as in :func:`pallas_attention`. Mosaic runs on the blocks.

    Returns:
      ``[B, Tq, N, Dv]`` in ``q``'s dtype. Differentiable in q, k, v, an array α and an array
      scale.

    Raises:
      ValueError, TypeError: for bad or unsupported arguments, before anything is traced.

    Example:
      >>> q = k = v = jnp.ones((1, 32, 1, 16))  # [batch, seq, heads, head_dim]
      >>> indices = jnp.array([[[[0, -1], [1, 0]]]])  # [B, N, nq, K]: block 1 keeps 1 and 0
      >>> out = pallas_block_list_attention(q, k, v, indices, block_size=(16, 16),
      ...                                   normalizer="sparsemax")
      >>> out.shape, bool(jnp.allclose(out, 1.0))
      ((1, 32, 1, 16), True)
    """
    plan, inputs = prepare_block_list(
        q, k, v, indices, block_size, causal, normalizer, scale, interpret, precision, target,
        forward_block, "pallas_block_list_attention",
    )  # fmt: skip
    out = _fused(plan, *inputs)
    return out[:, : q.shape[1], :, : v.shape[3]]


def capped_forward(
    q,
    k,
    v,
    layout: BlockLayout,
    *,
    search_passes: int | None,
    start_values: int | None = None,
    speculate: bool | None = None,
    **options,
) -> jax.Array:
    """Diagnostics: the forward kernel of :func:`pallas_attention` (same arguments, ``options``
    its keywords) with each query tile's threshold search stopped after ``search_passes``
    passes, so that timing it at 0, 1, 2, ... passes shows what the first pass, a search pass
    and the output pass cost (``python -m experiments.bench forward_passes``). The thresholds,
    so the weights, are then inexact (each row's weights still sum to 1): not attention.

    Args:
      q, k, v, layout: as in :func:`pallas_attention`.
      search_passes: int >= 0, or None: to the end (then attention); sparsemax, 1.5-entmax
        and α-entmax only.
      start_values: how many of the row's large values the first pass keeps for the start of
        sparsemax's and 1.5-entmax's searches (the largest of each block's 2 largest); default
        the kernels' (16 and 32): timing others shows what more values cost and save.
      speculate: sparsemax, 1.5-entmax: the search passes also accumulate the output (1.5-
        entmax's from the second on), and a tile whose last pass confirms every row's
        threshold takes no output pass (the kernels' way; see ``_accumulating_search`` in
        :mod:`sparse_jax.kernels.triton`); False: always an output pass. Default: the
        kernels' way when the search runs to the end; False when it is capped, so that each
        capped timing holds one output pass.

    Returns:
      ``[B, Tq, N, Dv]``, the forward's output (not differentiable).

    Example:
      >>> from sparse_jax.masks import causal
      >>> q = k = v = jnp.ones((1, 32, 1, 16))
      >>> out = capped_forward(q, k, v, causal().blocks(32, 32, 16, 16), search_passes=0,
      ...                      normalizer="sparsemax")
      >>> out.shape
      (1, 32, 1, 16)
    """
    caller = "capped_forward"
    if search_passes is not None:
        search_passes = check_int(search_passes, "search_passes", caller, low=0)
    if start_values is not None:
        start_values = check_int(start_values, "start_values", caller, low=1)
    speculate = check_bool(speculate, "speculate", caller, optional=True)
    if speculate is None:
        speculate = search_passes is None
    params = inspect.signature(pallas_attention).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"{caller}: unknown options {unknown}; allowed: {sorted(defaults)}")
    plan, inputs = prepare(q, k, v, layout, **{**defaults, **options}, caller=caller)
    if plan.kind == "softmax" or plan.target != "triton":
        raise ValueError(f"{caller}: a sparse normalizer on the Triton kernels only; got "
                         f"{plan.kind!r} on {plan.target!r}")  # fmt: skip
    capped = dataclasses.replace(
        plan, search_cap=search_passes, start_top=start_values, speculate=speculate
    )
    out, _ = triton.forward(capped, *inputs)
    return out[:, : q.shape[1], :, : v.shape[3]]
