"""Dynamic masks from the data: top-k masks and block top-k attention with a fixed capacity.

The masks of :mod:`sparse_jax.masks` are fixed descriptions known before the data is seen.
This module builds masks *from the data*, at run time, inside ``jax.jit``:

* :func:`topk_mask` keeps the ``k`` largest scores of every row (among the entries a
  ``where`` mask allows), exactly ``min(k, allowed)`` per row, ties to the lower key index;
* :func:`topk_block_attention` is the data-dependent sibling of
  :func:`sparse_jax.blocksparse.blocksparse_attention`: each query block attends to its
  ``local_blocks`` most recent key blocks plus the ``keep_blocks`` key blocks with the highest
  pooled score, a capacity that is static, so shapes are static and the kernel is jittable.

Top-k without sorting
---------------------
``jax.lax.top_k`` sorts partially; on XLA:CPU its cost grows with ``k``. :func:`topk_mask`
finds the ``k``-th largest value of each row as a *threshold*: float32 scores are mapped to
uint32 keys whose unsigned order is the float order (flip every bit of negative numbers, set
the sign bit of the others), and the threshold key is built from the most significant bit
down, two bits per pass (each pass counts, in one fused reduction over the row, how many keys
reach each of the three candidate extensions of the prefix). After 16 passes the prefix *is*
the ``k``-th largest key, exactly. Entries above it are kept; entries equal to it are kept by
increasing key index until the row holds ``k`` (a cumulative count, computed only when some
row has surplus ties). The cost is O(16 · row) with no sort, independent of ``k``.

Block top-k attention
---------------------
``Tq``/``Tk`` are padded to multiples of the blocks (``nq``/``nk`` blocks of ``bq``/``bkv``
rows). Each query block and each key block is pooled (mean over its rows, padded rows left
out); because scores are bilinear, ``scale · pooled_q · pooled_k`` is exactly the mean score
of the block's (unpadded) entries, which ranks the key blocks of every (batch, query head,
query block). The query block keeps

1. its ``local_blocks`` most recent key blocks: the *diagonal* block ``d`` (the key block
   holding the query block's last position, clipped to the keys) and ``d - 1, d - 2, ...``
   (blocks before 0 are invalid slots), and
2. the ``keep_blocks`` best of the other *allowed* key blocks (with ``causal=True`` the blocks
   not after ``d``; otherwise all), chosen by ``jax.lax.top_k`` on the small
   ``[B, N, nq, nk]`` array of block scores. When fewer blocks are allowed, the extra slots
   are invalid (masked).

The selection is not differentiated (``stop_gradient``). The kept key/value blocks are then
gathered (advanced indexing), scores ``[B, N, nq, bq, K · bkv]`` are formed on the compact row,
the element mask (slot validity, key padding and, with ``causal=True``, ``j <= i`` on absolute
positions) is applied and the normalizer runs along the compact row. As in the static kernel
this is exact for every normalizer: masked entries get probability exactly 0 under softmax,
sparsemax and entmax alike, so the result equals dense attention under the mask the selected
blocks define, values and gradients (to ``q``, ``k``, ``v`` and a learnable α) alike.

Cost: O(B · N · nq · K · bq · bkv) work and memory for the attention itself, with the static
capacity ``K = local_blocks + keep_blocks`` (at most ``2 · nk - 1`` are computed), plus
O(B · N · nq · nk · D) for the block scores and the pooling O(B · (Tq · N + Tk · Kh) · D).
With grouped-query attention the gathered key/value blocks are held once per query head
(``N / Kh`` times the key memory of one group). A long sequence at a fixed capacity therefore
costs linear, not quadratic, work in its length apart from the small block-score array.

Engines (``impl``): ``"xla"`` (the default) is the gather above, in plain XLA; ``"pallas"`` runs
the attention over the selected blocks in the fused Pallas kernels
(:func:`sparse_jax.kernels.pallas_block_list_attention`: the Triton kernels on GPU, the Mosaic
ones on TPU, interpret mode on CPU), which read each query block's list at run time, so scores
never leave the chip and nothing is gathered; the selection stays in XLA. ``"auto"`` takes
``"pallas"`` on GPU when the kernels compute the call (block sizes powers of two >= 16, no
float64, no ``return_weights``), else ``"xla"`` (on TPU too, as :func:`sparse_jax.attention`'s
``impl="auto"``: the Mosaic kernels are not yet compiled and measured on one).

Numerics follow :func:`sparse_jax.attention`: scores, the normalizer and the accumulation of
``p @ v`` are in float32 (float64 stays float64), ``p`` is cast to ``v``'s dtype for the
product, and the output has ``q``'s dtype. A query row with nothing allowed (possible when
``block_size[0] > block_size[1]``: the first rows of a query block may precede its diagonal key
block) gives output 0 and zero gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.kernels import pallas_block_list_attention, pallas_supports
from sparse_jax.masks import SENTINEL
from sparse_jax.normalizers import normalize
from sparse_jax.validation import (
    check_block_size,
    check_bool,
    check_choice,
    check_float_array,
    check_int,
    check_normalizer,
    check_qkv,
    check_scale,
)

__all__ = [
    "IMPLS",
    "SENTINEL",
    "BlockSelection",
    "earlier_blocks",
    "topk_block_attention",
    "topk_mask",
]

#: Values of ``topk_block_attention(..., impl=)``.
IMPLS = ("xla", "pallas", "auto")

# Bits of the threshold key settled per pass of :func:`topk_mask` (2 bits = 16 passes of 3 counts
# each): faster on a 2-core CPU than 1 bit or 4 bits per pass (timed once on [8, 2048, 2048]
# float32, k = 64; docs/benchmarks.md, "Design measurements").
_BITS_PER_PASS = 2


# ----------------------------------------------------------------------------------------------
# topk_mask.


def _sortable_keys(x: jax.Array) -> jax.Array:
    """uint32 keys whose unsigned order is the order of the float32 ``x`` (NaN -> -inf and
    -0.0 -> +0.0 first, so that equal floats have equal keys).

    Done on the bits only: XLA:CPU flushes denormals to zero in float comparisons, so
    ``x == 0`` would merge ±1e-45 with 0; the bits order them exactly (as numpy does).
    """
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = jnp.where((u & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000), jnp.uint32(0xFF800000), u)
    u = jnp.where(u == jnp.uint32(0x80000000), jnp.uint32(0), u)
    negative = (u >> 31) == 1
    return jnp.where(negative, ~u, u | jnp.uint32(0x80000000))


def _row_counts(*conditions: jax.Array) -> tuple[jax.Array, ...]:
    """Counts of True along the last axis of several bool arrays, in one fused reduction (XLA:CPU
    fuses the producers of a variadic reduce; a plain sum would materialise each operand)."""
    ops = tuple(c.astype(jnp.int32) for c in conditions)
    zeros = tuple(jnp.zeros((), jnp.int32) for _ in ops)
    return jax.lax.reduce(
        ops, zeros, lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)), (ops[0].ndim - 1,)
    )


@functools.partial(jax.jit, static_argnames=("k",))
def _topk_mask(scores: jax.Array, where: jax.Array | None, k: int) -> jax.Array:
    scores = jax.lax.stop_gradient(scores).astype(jnp.float32)
    key = _sortable_keys(scores)
    if where is None:
        kk = jnp.full(scores.shape[:-1], k, jnp.int32)
    else:
        where = jnp.broadcast_to(where, scores.shape)
        key = jnp.where(where, key, jnp.uint32(0))  # below every real key (-inf is 0x007FFFFF)
        kk = jnp.minimum(_row_counts(where)[0], k)

    bits, total = _BITS_PER_PASS, 32

    def one_pass(i, t):
        # Settles bits [total - (i + 1) * bits, total - i * bits) of the threshold prefix t.
        shift = (jnp.uint32(total - bits) - jnp.uint32(bits) * i.astype(jnp.uint32)).astype(
            jnp.uint32
        )
        cands = [t | (jnp.uint32(j) << shift) for j in range(1, 2**bits)]
        counts = _row_counts(*(key >= c[..., None] for c in cands))
        for c, n in zip(cands, counts, strict=True):  # increasing: the last one that holds wins
            t = jnp.where(n >= kk, c, t)
        return t

    t = jax.lax.fori_loop(0, total // bits, one_pass, jnp.zeros(scores.shape[:-1], jnp.uint32))
    # t is the largest key with count(key >= t) >= kk, i.e. the kk-th largest key (rows with
    # kk = 0 end at 0xFFFFFFFF, which no key reaches). Keep keys above it, then ties by index.
    t = t[..., None]
    above, tied = key > t, key == t
    if where is not None:
        tied = tied & where
    n_above, n_tied = _row_counts(above, tied)
    need = (kk - n_above)[..., None]

    def by_index(_):
        rank = jnp.cumsum(tied, axis=-1, dtype=jnp.int32)
        return above | (tied & (rank <= need))

    def all_tied(_):
        return above | (tied & (need > 0))

    return jax.lax.cond(jnp.any(n_tied > need[..., 0]), by_index, all_tied, None)


def topk_mask(scores: jax.Array, k: int, *, where: jax.Array | None = None) -> jax.Array:
    """Bool mask of the ``k`` largest scores of every row (last axis), among allowed entries.

    Exactly ``min(k, number of allowed entries)`` entries of each row are True: the largest
    scores, with ties broken deterministically in favour of the lower key index (so a row of
    equal scores keeps its first ``k`` allowed entries). NaN ranks below ``-inf``; ``-0.0``
    equals ``0.0``. Jittable and vmappable; the result is bool, so nothing is differentiated.

    Found by a threshold, not a sort (see the module docstring): 16 passes over the row,
    whatever ``k``; ``jax.lax.top_k`` plus a scatter is faster only for small ``k`` (measured:
    docs/benchmarks.md, "Design measurements").

    Args:
      scores: float array ``[..., q_len, kv_len]`` (any rank >= 1; the last axis is the row),
        e.g. attention scores before the normalizer. Half precision is compared in float32
        (exactly); float64 is rounded to float32 for the comparison.
      k: python int >= 1, at most ``kv_len``.
      where: optional bool array broadcastable to ``scores`` (True = may be kept); None allows
        every entry.

    Returns:
      bool array with the shape of ``scores``.

    Raises:
      TypeError, ValueError: for a non-int or out-of-range ``k``, non-float ``scores`` or a
      ``where`` that is not bool or does not broadcast to ``scores``.

    Example:
      >>> s = jnp.array([[0.1, 0.9, 0.5, 0.9], [3.0, 1.0, 2.0, 0.0]])
      >>> topk_mask(s, 2).astype(int).tolist()
      [[0, 1, 0, 1], [1, 0, 1, 0]]
      >>> topk_mask(s, 2, where=jnp.array([True, False, True, False])).astype(int).tolist()
      [[1, 0, 1, 0], [1, 0, 1, 0]]
    """
    caller = "topk_mask"
    check_float_array(scores, "scores", caller, "a jax or numpy float array [..., q_len, kv_len]")
    if scores.ndim < 1 or scores.shape[-1] == 0:
        raise ValueError(
            f"{caller}: `scores` must have rank >= 1 and a non-empty last (key) axis; got shape "
            f"{tuple(scores.shape)}"
        )
    kv_len = scores.shape[-1]
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral):
        raise TypeError(
            f"{caller}: `k` must be a python int in [1, kv_len] = [1, {kv_len}]; got "
            f"{type(k).__name__} {k!r}"
        )
    if not 1 <= k <= kv_len:
        raise ValueError(
            f"{caller}: `k` must be an int in [1, kv_len] = [1, {kv_len}]; got k={k}"
            + (f", larger than kv_len={kv_len} (the last axis of scores)" if k > kv_len else "")
        )
    if where is not None:
        if not isinstance(where, (jax.Array, np.ndarray)) or where.dtype != np.bool_:
            raise TypeError(
                f"{caller}: `where` must be None or a bool array broadcastable to scores "
                f"{tuple(scores.shape)}; got {type(where).__name__} "
                f"{getattr(where, 'dtype', '')}"
            )
        try:
            ok = np.broadcast_shapes(where.shape, scores.shape) == tuple(scores.shape)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"{caller}: `where` with shape {tuple(where.shape)} does not broadcast to the "
                f"shape of scores {tuple(scores.shape)}"
            )
    return _topk_mask(jnp.asarray(scores), None if where is None else jnp.asarray(where), int(k))


# ----------------------------------------------------------------------------------------------
# topk_block_attention.


class _Plan(NamedTuple):
    """Static shapes and the static part of the block selection of one call."""

    b: int
    tq: int
    tk: int
    n: int  # query heads
    kh: int  # key/value heads
    bq: int
    bkv: int
    nq: int
    nk: int
    local: int  # local slots computed: min(local_blocks, nk)
    top: int  # top-k slots computed: min(keep_blocks, nk - 1)
    capacity: int  # local_blocks + keep_blocks (width of the returned indices)
    causal: bool
    return_weights: bool
    return_indices: bool


def _static_selection(p: _Plan):
    """numpy: local block indices and validity [nq, L], candidate blocks [nq, nk], and the
    validity of the top slots [nq, T] (a slot is valid when enough candidates exist)."""
    rows = np.arange(p.nq)
    last_q = np.minimum((rows + 1) * p.bq, p.tq) - 1
    diag = np.minimum(last_q, p.tk - 1) // p.bkv  # the key block of the block's last query
    local = diag[:, None] - np.arange(p.local)[None, :]
    local_valid = local >= 0
    cols = np.arange(p.nk)[None, :]
    allowed = cols <= diag[:, None] if p.causal else np.ones((p.nq, p.nk), bool)
    is_local = (cols <= diag[:, None]) & (cols > diag[:, None] - p.local)
    candidate = allowed & ~is_local
    top_valid = np.arange(p.top)[None, :] < candidate.sum(-1)[:, None]
    return np.where(local_valid, local, 0).astype(np.int32), local_valid, candidate, top_valid


def _select_blocks(q, k, p: _Plan, scale, compute, block_scores=None):
    """Selected key blocks ``[B, N, nq, L + T]`` (int32, invalid slots 0) and their validity;
    the top slots ranked by ``block_scores [B, N, nq, nk]`` when given, else by the pooled
    mean score."""
    g = p.n // p.kh
    local, local_valid, candidate, top_valid = _static_selection(p)
    idx = jnp.broadcast_to(jnp.asarray(local), (p.b, p.n, p.nq, p.local))
    valid = np.broadcast_to(local_valid, (p.b, p.n, p.nq, p.local))
    if p.top and block_scores is not None:
        scores = jax.lax.stop_gradient(block_scores).astype(compute)
    elif p.top:
        q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)

        def pooled(x, t, blocks, size):  # [B, T, H, D] -> mean per block [B, H, blocks, D]
            x = jnp.pad(x.astype(compute), ((0, 0), (0, blocks * size - t), (0, 0), (0, 0)))
            x = x.reshape(x.shape[0], blocks, size, *x.shape[2:]).sum(axis=2)
            rows = np.minimum(size, t - np.arange(blocks) * size).astype(np.float32)
            return jnp.moveaxis(x / rows[:, None, None], 1, 2)

        pq = pooled(q, p.tq, p.nq, p.bq).reshape(p.b, p.kh, g, p.nq, -1)
        pk = pooled(k, p.tk, p.nk, p.bkv)
        scores = jnp.einsum("bhgrd,bhcd->bhgrc", pq, pk).reshape(p.b, p.n, p.nq, p.nk)
        scores = scores * jnp.asarray(scale, compute)  # = mean score of each block pair
    if p.top:
        big = jnp.finfo(compute).max
        scores = jnp.nan_to_num(scores, nan=-big, posinf=big, neginf=-big)
        scores = jnp.where(jnp.asarray(candidate), scores, -jnp.inf)
        _, top = jax.lax.top_k(scores, p.top)  # candidates (finite) come before the rest
        idx = jnp.concatenate([idx, top.astype(jnp.int32)], axis=-1)
        valid = np.concatenate(
            [valid, np.broadcast_to(top_valid, (p.b, p.n, p.nq, p.top))], axis=-1
        )
    valid = jnp.asarray(valid)
    return jnp.where(valid, idx, 0), valid


@functools.partial(jax.jit, static_argnames=("plan", "normalizer_static", "scale_static"))
def _run(
    q,
    k,
    v,
    normalizer_array,
    scale_array,
    block_scores,
    *,
    plan: _Plan,
    normalizer_static,
    scale_static,
):
    p = plan
    compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    normalizer = normalizer_static if normalizer_array is None else normalizer_array
    scale = scale_static if scale_array is None else scale_array
    g = p.n // p.kh
    d, dv = q.shape[-1], v.shape[-1]

    idx, valid = _select_blocks(q, k, p, scale, compute, block_scores)  # [B, N, nq, K]
    width = idx.shape[-1]

    # Blocks: queries [B, N, nq, bq, D]; keys/values [B, Kh, nk, bkv, D].
    qb = jnp.pad(q, ((0, 0), (0, p.nq * p.bq - p.tq), (0, 0), (0, 0)))
    qb = jnp.transpose(qb.reshape(p.b, p.nq, p.bq, p.n, d), (0, 3, 1, 2, 4))

    def key_blocks(x):
        x = jnp.pad(x, ((0, 0), (0, p.nk * p.bkv - p.tk), (0, 0), (0, 0)))
        return jnp.transpose(x.reshape(p.b, p.nk, p.bkv, p.kh, x.shape[-1]), (0, 3, 1, 2, 4))

    # Gather the selected blocks of every (batch, query head, query block): [B, N, nq, K, bkv, D].
    sel = (
        np.arange(p.b)[:, None, None, None],
        (np.arange(p.n) // g)[None, :, None, None],
        idx,
    )
    kg, vg = key_blocks(k)[sel], key_blocks(v)[sel]

    s = jnp.einsum("bnrid,bnrkjd->bnrikj", qb, kg, preferred_element_type=compute)
    s = s * jnp.asarray(scale, compute)  # [B, N, nq, bq, K, bkv]

    # Element mask: valid slot, real key, and j <= i under causality.
    kv_pos = idx[..., None] * p.bkv + jnp.arange(p.bkv, dtype=jnp.int32)  # [B, N, nq, K, bkv]
    allowed = (valid[..., None] & (kv_pos < p.tk))[:, :, :, None]  # [B, N, nq, 1, K, bkv]
    if p.causal:
        q_pos = jnp.arange(p.nq * p.bq, dtype=jnp.int32).reshape(p.nq, p.bq)
        allowed = allowed & (kv_pos[:, :, :, None] <= q_pos[:, :, None, None])
    allowed = jnp.broadcast_to(allowed, s.shape)

    if not isinstance(normalizer, (str, float)):  # α [], [1] or [N] -> [1, N, 1, 1]
        normalizer = jnp.broadcast_to(normalizer, (p.n,)).reshape(1, p.n, 1, 1)
    rows = (*s.shape[:4], width * p.bkv)
    w = normalize(s.reshape(rows), allowed.reshape(rows), normalizer).reshape(s.shape)
    out = jnp.einsum("bnrikj,bnrkje->bnrie", w.astype(v.dtype), vg, preferred_element_type=compute)
    out = jnp.transpose(out, (0, 2, 3, 1, 4)).reshape(p.b, p.nq * p.bq, p.n, dv)[:, : p.tq]
    out = out.astype(q.dtype)

    extras = []
    if p.return_weights:  # scatter into [B, N, nq, nk + 1, bq, bkv]; invalid slots -> block nk
        dense = jnp.zeros((p.b, p.n, p.nq, p.nk + 1, p.bq, p.bkv), q.dtype)
        target = jnp.where(valid, idx, p.nk)
        w_blocks = jnp.transpose(w.astype(q.dtype), (0, 1, 2, 4, 3, 5))  # [B, N, nq, K, bq, bkv]
        dense = dense.at[
            np.arange(p.b)[:, None, None, None],
            np.arange(p.n)[None, :, None, None],
            np.arange(p.nq)[None, None, :, None],
            target,
        ].add(w_blocks)
        dense = jnp.transpose(dense[:, :, :, : p.nk], (0, 1, 2, 4, 3, 5))
        extras.append(dense.reshape(p.b, p.n, p.nq * p.bq, p.nk * p.bkv)[:, :, : p.tq, : p.tk])
    if p.return_indices:
        extras.append(_indices(p, idx, valid))
    return (out, *extras) if extras else out


def _indices(p: _Plan, idx, valid):
    """The selected blocks as returned: ``[B, N, nq, capacity]`` int32, ``SENTINEL`` where
    invalid."""
    indices = jnp.where(valid, idx, SENTINEL).astype(jnp.int32)
    pad = p.capacity - idx.shape[-1]
    if pad:
        indices = jnp.pad(indices, ((0, 0),) * 3 + ((0, pad),), constant_values=SENTINEL)
    return indices


@functools.partial(
    jax.jit, static_argnames=("plan", "normalizer_static", "scale_static", "interpret")
)
def _run_pallas(
    q,
    k,
    v,
    normalizer_array,
    scale_array,
    block_scores,
    *,
    plan: _Plan,
    normalizer_static,
    scale_static,
    interpret,
):
    """``impl="pallas"``: the selection of :func:`_run`, the attention over the selected blocks
    in the fused kernels (:func:`sparse_jax.kernels.pallas_block_list_attention`)."""
    p = plan
    normalizer = normalizer_static if normalizer_array is None else normalizer_array
    scale = scale_static if scale_array is None else scale_array
    idx, valid = _select_blocks(q, k, p, scale, jnp.float32, block_scores)  # [B, N, nq, K]
    with jax.named_scope("sparse_jax/pallas"):
        out = pallas_block_list_attention(
            q, k, v, jnp.where(valid, idx, SENTINEL), block_size=(p.bq, p.bkv), causal=p.causal,
            normalizer=normalizer, scale=scale, interpret=interpret,
        )  # fmt: skip
    return (out, _indices(p, idx, valid)) if p.return_indices else out


def _choose_impl(impl: str, q, block_size, return_weights: bool, caller: str) -> str:
    """The engine of a :func:`topk_block_attention` call (see the module docstring), or a
    ValueError when ``impl="pallas"`` is asked for a call the kernels do not compute."""
    if impl == "xla":
        return impl
    ok, why = pallas_supports(q, return_weights=return_weights, block_size=block_size)
    why = why.replace("`block_q`", "`block_size[0]`").replace("`block_kv`", "`block_size[1]`")
    if impl == "pallas" and not ok:
        raise ValueError(f"{caller}: impl='pallas': {why}; use impl='xla' for this call")
    if impl == "auto":  # the fused kernels where sparse_jax.attention's impl="auto" takes them
        return "pallas" if ok and jax.default_backend() == "gpu" else "xla"
    return impl


def topk_block_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    keep_blocks: int,
    block_size: tuple[int, int] = (64, 64),
    causal: bool = True,
    local_blocks: int = 1,
    normalizer: Any = "softmax",
    scale: float | jax.Array | None = None,
    return_weights: bool = False,
    return_indices: bool = False,
    block_scores: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
    """Attention over the key blocks each query block selects from the data (block top-k).

    Each query block attends to its ``local_blocks`` most recent key blocks (its diagonal block
    and the ones before it) plus the ``keep_blocks`` other allowed key blocks with the highest
    mean score ``scale · mean(q_block) · mean(k_block)``, per batch element and query head; see
    the module docstring for the algorithm and its cost. Within the kept blocks the result is
    exact: it equals :func:`sparse_jax.attention` under the mask the selected blocks define
    (with ``j <= i`` when ``causal``), values and gradients. The selection itself is not
    differentiated.

    Shapes: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``N`` query heads, ``Kh`` key/value
    heads (``Kh`` divides ``N``; query head ``n`` reads key head ``n // (N // Kh)``), ``D``
    head dim of q/k, ``Dv`` of v; ``nq = ceil(Tq / bq)``, ``nk = ceil(Tk / bkv)`` blocks and the
    static capacity ``K = local_blocks + keep_blocks``.

    Args:
      q: ``[B, Tq, N, D]`` float queries.
      k: ``[B, Tk, Kh, D]`` keys, same dtype as ``q``.
      v: ``[B, Tk, Kh, Dv]`` values, same dtype as ``q``.
      keep_blocks: python int >= 0, key blocks chosen by score besides the local ones.
      block_size: ``(bq, bkv)``, ints >= 1; the sequences are padded internally. With
        ``bq > bkv`` the first rows of a query block may precede its diagonal key block, so
        use ``local_blocks >= bq / bkv`` there unless rows with nothing to attend to (output
        0) are intended.
      causal: if True, key ``j`` is allowed for query ``i`` only when ``j <= i`` (absolute
        positions, as :func:`sparse_jax.masks.causal`) and only key blocks not after the
        diagonal block are candidates; if False every key block is a candidate.
      local_blocks: python int >= 1, the most recent key blocks always kept (slot 0 is the
        diagonal block: the key block of the query block's last position).
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"``, or α-entmax's α: a float
        > 1, or a float array of shape ``[]``, ``[1]`` or ``[N]`` (differentiable).
      scale: multiplier of ``q·k``; default ``D ** -0.5``. A scalar float array is accepted.
      return_weights: also return the weights scattered into a dense ``[B, N, Tq, Tk]`` array
        (O(Tq·Tk) memory: for tests and inspection).
      return_indices: also return the selected key blocks, int32 ``[B, N, nq, K]``: slots
        ``0 .. local_blocks - 1`` hold the local blocks (most recent first), the next ones the
        selected blocks by decreasing score; invalid slots hold ``SENTINEL`` (-1).
      block_scores: optional float ``[B, N, nq, nk]``: the scores that rank the candidate key
        blocks of each query block in place of the pooled mean score (a learned selector's,
        :class:`sparse_jax.block_gate.BlockGate`); entries of blocks that are not candidates
        are ignored, and NaN ranks last. Not differentiated, like the pooled score.
      impl: ``"xla"`` (gathers the selected blocks), ``"pallas"`` (the fused kernels read the
        selected blocks' list at run time: block sizes powers of two >= 16 on GPU and CPU,
        multiples of 128 on TPU; no ``return_weights``, no float64) or ``"auto"`` (``"pallas"``
        on GPU where it computes the call, else ``"xla"``); see the module docstring.
      interpret: run the Pallas kernels in Pallas' interpret mode (default: on CPU only), as
        :func:`sparse_jax.kernels.pallas_attention` takes it; must be None with ``impl="xla"``.

    Returns:
      ``out [B, Tq, N, Dv]`` in ``q``'s dtype; with ``return_weights`` and/or
      ``return_indices``, a tuple ``(out, weights, indices)`` of the requested ones in this
      order.

    Raises:
      ValueError, TypeError: for bad arguments, before anything is traced.

    Example:
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 10, 2, 4))
      >>> out, idx = topk_block_attention(q, k, v, keep_blocks=1, block_size=(2, 2),
      ...                                 normalizer="sparsemax", return_indices=True)
      >>> out.shape, idx.shape  # [B, Tq, N, Dv], [B, N, nq, K]
      ((1, 10, 2, 4), (1, 2, 5, 2))
      >>> idx[0, 0, :, 0].tolist()  # slot 0: the diagonal block; block 0 has no other choice
      [0, 1, 2, 3, 4]
      >>> idx[0, 0, 0, 1].item()
      -1
      >>> q = k = v = jax.random.normal(jax.random.key(1), (1, 64, 2, 16))
      >>> fused = topk_block_attention(q, k, v, keep_blocks=1, block_size=(16, 16), impl="pallas")
      >>> gathered = topk_block_attention(q, k, v, keep_blocks=1, block_size=(16, 16))
      >>> bool(jnp.allclose(fused, gathered, atol=1e-5))
      True
    """
    caller = "topk_block_attention"
    impl = check_choice(impl, "impl", IMPLS, caller)
    interpret = check_bool(interpret, "interpret", caller, optional=True)
    check_qkv(q, k, v, caller)
    b, tq, n, d = q.shape
    tk, kh = k.shape[1], k.shape[2]
    keep_blocks = check_int(keep_blocks, "keep_blocks", caller, low=0)
    local_blocks = check_int(local_blocks, "local_blocks", caller, low=1)
    bq, bkv = check_block_size(block_size, caller)
    causal = check_bool(causal, "causal", caller)
    normalizer = check_normalizer(normalizer, n, caller)
    scale = check_scale(scale, d, caller)
    return_weights = check_bool(return_weights, "return_weights", caller)
    return_indices = check_bool(return_indices, "return_indices", caller)
    if impl == "xla" and interpret is not None:
        raise ValueError(
            f"{caller}: `interpret`={interpret} is for the Pallas kernels (impl='pallas' or "
            f"'auto'); with impl='xla' it must be None"
        )
    impl = _choose_impl(impl, q, (bq, bkv), return_weights, caller)
    nq, nk = -(-tq // bq), -(-tk // bkv)
    if block_scores is not None:
        check_float_array(block_scores, "block_scores", caller, "a float array")
        if tuple(block_scores.shape) != (b, n, nq, nk):
            raise ValueError(
                f"{caller}: `block_scores` must have shape [B, N, nq, nk] = {[b, n, nq, nk]}; "
                f"got {list(block_scores.shape)}"
            )
    plan = _Plan(
        b=b,
        tq=tq,
        tk=tk,
        n=n,
        kh=kh,
        bq=bq,
        bkv=bkv,
        nq=nq,
        nk=nk,
        local=min(local_blocks, nk),
        top=min(keep_blocks, nk - 1),
        capacity=local_blocks + keep_blocks,
        causal=causal,
        return_weights=return_weights,
        return_indices=return_indices,
    )
    static_norm = isinstance(normalizer, (str, float))
    static_scale = isinstance(scale, float)
    arrays = (
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        None if static_norm else normalizer,
        None if static_scale else scale,
        None if block_scores is None else jnp.asarray(block_scores),
    )
    static = dict(
        plan=plan,
        normalizer_static=normalizer if static_norm else None,
        scale_static=scale if static_scale else None,
    )
    if impl == "pallas":
        return _run_pallas(*arrays, **static, interpret=interpret)
    return _run(*arrays, **static)


# ----------------------------------------------------------------------------------------------
# BlockSelection: a data-dependent candidate mask.


def earlier_blocks(q_pos: jax.Array, nk: int, block: int, local_blocks: int) -> jax.Array:
    """bool ``[Tq, nk]``: the complete key blocks before the ``local_blocks`` most recent ones of
    each query (absolute positions ``q_pos [Tq]``, ``nk`` key blocks of ``block``): the blocks a
    :class:`BlockSelection` (and :class:`sparse_jax.block_gate.BlockGate`) may add.

    Example:
      >>> earlier_blocks(jnp.array([3, 9]), nk=3, block=4, local_blocks=1).astype(int).tolist()
      [[0, 0, 0], [1, 1, 0]]
    """
    cols = jnp.arange(nk, dtype=jnp.int32)
    return cols[None, :] <= (q_pos // block)[:, None] - local_blocks


@dataclasses.dataclass(frozen=True)
class BlockSelection:
    """A data-dependent candidate mask: key blocks chosen per query token (MoBA's gate).

    The keys are cut into blocks of ``block`` positions. Query ``i`` (absolute position ``p``)
    attends causally to its own key block ``p // block`` and the ``local_blocks - 1`` blocks
    before it, plus the ``keep_blocks`` *earlier* blocks whose mean key scores highest against
    its own query, ``scale · q_i · mean(k_block)``, per batch element and head. The earlier
    blocks are complete (all their keys precede ``p``), so the selection is strictly causal and
    the same whether the sequence is read at once or decoded token by token. The selection is
    not differentiated (``stop_gradient``); within the selected keys attention is exact.

    It is :func:`topk_block_attention` with query blocks of one row (``block_size=(1, block)``):
    :meth:`attention` runs that engine, and :meth:`dense` the same selection as an explicit
    bool mask (for the soft candidate layer and for decoding into a cache).

    Its cost does not depend on the data: query ``p`` forms ``(local + kept) · block`` scores,
    ``local = min(local_blocks, p // block + 1)`` and ``kept = min(keep_blocks, p // block + 1 -
    local)``, of which :meth:`entries` counts the allowed ones (the own block only up to ``p``).

    Args:
      keep_blocks: int >= 0, earlier key blocks chosen by score.
      block: int >= 1, keys per block.
      local_blocks: int >= 1, the most recent key blocks always kept (the own block first).

    Example:
      >>> sel = BlockSelection(keep_blocks=1, block=2)
      >>> q = k = jax.random.normal(jax.random.key(0), (1, 6, 1, 4))  # [B, T, N, D]
      >>> m = sel.dense(q, k)  # bool [B, N, T, T]
      >>> m.shape, int(m[0, 0, 5].sum())  # query 5: its own block (4, 5) and one of 2 earlier
      ((1, 1, 6, 6), 4)
      >>> sel.entries(6, 6)  # 1 + 2 + (2 + 1) + (2 + 2) + (2 + 1) + (2 + 2): data-independent
      17
    """

    keep_blocks: int
    block: int = 64
    local_blocks: int = 1

    def __post_init__(self):
        caller = "BlockSelection"
        check_int(self.keep_blocks, "keep_blocks", caller, low=0)
        check_int(self.block, "block", caller)
        check_int(self.local_blocks, "local_blocks", caller)

    def blocks_per_query(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two int arrays shaped like ``positions`` (absolute query positions): the local key
        blocks each query keeps and the earlier blocks it chooses by score.

        Example:
          >>> local, chosen = BlockSelection(2, block=4).blocks_per_query(np.arange(0, 16, 4))
          >>> local.tolist(), chosen.tolist()
          ([1, 1, 1, 1], [0, 1, 2, 2])
        """
        own = positions // self.block
        local = np.minimum(self.local_blocks, own + 1)
        return local, np.minimum(self.keep_blocks, own + 1 - local)

    def entries(self, tq: int, tk: int) -> int:
        """Allowed score entries of ``tq`` queries (the last ``tq`` of ``tk`` positions): the
        same for every input (see the class docstring)."""
        p = np.arange(tk - tq, tk)
        local, kept = self.blocks_per_query(p)
        own_start = (p // self.block - local + 1) * self.block
        return int(np.sum(p - own_start + 1 + kept * self.block))

    def formed(self, seq_len: int) -> int:
        """Score entries the engine forms for causal self-attention on ``seq_len`` tokens: whole
        blocks, ``Σ_p (local + kept) · block`` (one batch element, one head)."""
        local, kept = self.blocks_per_query(np.arange(seq_len))
        return int(np.sum(local + kept) * self.block)

    def dense(
        self,
        q: jax.Array,
        k: jax.Array,
        *,
        scale: Any = None,
        q_offset: Any = None,
        block_scores: jax.Array | None = None,
    ):
        """bool ``[B, N, Tq, Tk]``: the selected entries for ``q [B, Tq, N, D]`` against
        ``k [B, Tk, Kh, D]`` (``Kh`` divides ``N``). Query ``i`` sits at absolute position
        ``Tk - Tq + i``, or ``q_offset + i`` when ``q_offset`` (an int or a traced int) is
        given: decoding into a cache of ``Tk`` slots, where keys from ``q_offset + Tq`` on are
        not yet written. Traceable; ``scale`` defaults to ``D ** -0.5``. ``block_scores``
        (float ``[B, N, Tq, ceil(Tk / block)]``, a learned selector's,
        :class:`sparse_jax.block_gate.BlockGate`) rank the earlier blocks in place of the
        pooled score ``scale · q · mean(k_block)``."""
        b, tq, n, d = q.shape
        tk, kh = k.shape[1], k.shape[2]
        scale = d**-0.5 if scale is None else scale
        nk = -(-tk // self.block)
        start = tk - tq if q_offset is None else q_offset
        q_pos = start + jnp.arange(tq, dtype=jnp.int32)  # [Tq]
        own = q_pos // self.block
        cols = jnp.arange(nk, dtype=jnp.int32)
        local = (cols[None, :] <= own[:, None]) & (cols[None, :] > own[:, None] - self.local_blocks)
        blocks = jnp.broadcast_to(local, (b, n, tq, nk))
        if self.keep_blocks and block_scores is not None:
            if tuple(block_scores.shape) != (b, n, tq, nk):
                raise ValueError(
                    f"BlockSelection.dense: `block_scores` must have shape [B, N, Tq, nk] = "
                    f"{[b, n, tq, nk]}; got {list(block_scores.shape)}"
                )
            compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
            scores = jax.lax.stop_gradient(block_scores).astype(compute)
        elif self.keep_blocks:
            compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
            qs = jax.lax.stop_gradient(q).astype(compute)
            ks = jnp.pad(
                jax.lax.stop_gradient(k).astype(compute),
                ((0, 0), (0, nk * self.block - tk), (0, 0), (0, 0)),
            )
            pooled = ks.reshape(b, nk, self.block, kh, d).mean(axis=2)  # [B, nk, Kh, D]
            pooled = jnp.repeat(pooled, n // kh, axis=2)  # [B, nk, N, D]
            scores = jnp.einsum("bind,bcnd->bnic", qs, pooled) * jnp.asarray(scale, compute)
        if self.keep_blocks:
            big = jnp.finfo(compute).max
            scores = jnp.nan_to_num(scores, nan=-big, posinf=big, neginf=-big)
            earlier = earlier_blocks(q_pos, nk, self.block, self.local_blocks)  # [Tq, nk]
            scores = jnp.where(earlier, scores, -jnp.inf)
            top = jax.lax.top_k(scores, min(self.keep_blocks, nk))[1]  # [B, N, Tq, keep]
            chosen = jnp.any(top[..., None] == cols, axis=-2) & earlier
            blocks = blocks | chosen
        kv_pos = jnp.arange(tk, dtype=jnp.int32)
        allowed = blocks[..., kv_pos // self.block] & (kv_pos[None, :] <= q_pos[:, None])
        if q_offset is not None:
            allowed = allowed & (kv_pos < q_offset + tq)
        return allowed

    def attention(
        self, q, k, v, *, normalizer: Any = "softmax", scale: Any = None, block_scores=None
    ):
        """Self-attention (``Tq == Tk``, query ``i`` at position ``i``) over the selected keys:
        :func:`topk_block_attention` with query blocks of one row, under the named scope
        ``sparse_jax/block_selection``; ``block_scores`` as in :meth:`dense`.
        ``[B, T, N, Dv]``."""
        with jax.named_scope("sparse_jax/block_selection"):
            return self._attention(q, k, v, normalizer, scale, block_scores)

    def _attention(self, q, k, v, normalizer, scale, block_scores=None):
        return topk_block_attention(
            q,
            k,
            v,
            keep_blocks=self.keep_blocks,
            block_size=(1, self.block),
            local_blocks=self.local_blocks,
            normalizer=normalizer,
            scale=scale,
            block_scores=block_scores,
        )
