"""Attention with sparse normalizers and masks: ``attention(q, k, v, mask=, normalizer=, impl=)``.

One function, :func:`attention`, computes

    out[b, i, n] = Σ_j p[b, n, i, j] v[b, j, n // G],
    p[b, n, i, :] = normalizer(scale · q[b, i, n] · k[b, :, n // G] + bias[b, n, i, :], mask)

in the layout of ``jax.nn.dot_product_attention`` (``[batch, seq, heads, head_dim]``, "BTNH"),
with grouped-query attention when the ``K`` key/value heads divide the ``N`` query heads
(query head ``n`` reads key head ``n // (N // K)``, the convention of jax and flax). The
normalizer is softmax, sparsemax, 1.5-entmax or α-entmax with a fixed or learnable α per head
(see :mod:`sparse_jax.normalizers`); the mask is a :class:`sparse_jax.masks.Mask` description or
a bool array.

Implementations and dispatch
----------------------------
``impl`` picks how the same function is computed; :func:`attention_impl` says which one
``impl="auto"`` would take and why, without computing anything.

* ``"xla"`` (implemented): the dense reference in plain ``jax.numpy``, **chunked over
  queries**. The queries are cut into equal chunks of a static size of at most
  ``query_chunk`` rows (by default :func:`default_query_chunk`: as many as keep one chunk's
  scores within ``CHUNK_SCORES`` = 2**22 elements, on CPU within ``CPU_CHUNK_SCORES`` = 2**20
  and at least twice the head dim; Tq is padded internally to a multiple, padded rows are
  masked and dropped) and ``jax.lax.map`` runs one chunk at a time (a problem that fits in one
  chunk runs without the loop). Each chunk forms its ``[B, N, chunk, Tk]`` scores,
  evaluates its part of the mask *inside the chunk* (from ``Mask.predicate`` on ``iota``
  indices, or a slice of a bool-array mask; the ``[Tq, Tk]`` mask is never materialised),
  normalizes and multiplies by ``v``. The chunk function is wrapped in ``jax.checkpoint``, so
  the backward pass recomputes one chunk at a time too: peak memory is O(B·N·chunk·Tk) in both
  directions instead of O(B·N·Tq·Tk). Why bother for a reference: sparse normalizers are
  evaluated row by row with a few passes over each row, the whole score matrix of a long
  sequence does not fit, and the reference must run wherever the kernels are compared with it.
  Work is still dense (O(Tq·Tk) per head, masked entries included).
* ``"blocksparse"``: :func:`sparse_jax.blocksparse.blocksparse_attention` driven by
  ``mask.blocks(Tq, Tk, *block_size)`` (:class:`sparse_jax.masks.BlockLayout`): it gathers the
  key blocks each query block keeps and normalizes over that compact row, so work and memory
  follow the kept blocks, for every normalizer. Needs a :class:`~sparse_jax.masks.Mask`.
* ``"pallas"``: :func:`sparse_jax.kernels.pallas_attention`, the fused Pallas kernel over the
  same layout (flash-style: scores stay on chip), every normalizer, static masks,
  ``static & padding(lengths)`` and ``static & segments(ids)`` (packed sequences), also one
  ``padding`` and one ``segments`` leaf under ``|``/``~`` (the prefix-LM mask
  ``causal() | padding(prefix)``), a ``bias``; GPU (Triton kernels, block sizes powers of two
  >= 16), TPU (Mosaic kernels, :mod:`sparse_jax.kernels.mosaic`, block sizes multiples of
  128), and interpret mode on CPU (slow: for tests).
* ``"splash"``: TPU splash attention (:func:`sparse_jax.fused.splash_attention`), softmax
  only, static masks joined with ``& padding(lengths)`` and/or ``& segments(ids)`` (packed
  sequences), ``block_size`` multiples of 128; off TPU it runs in Pallas interpret mode (slow:
  for tests).
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on NVIDIA GPUs
  (:func:`sparse_jax.fused.cudnn_attention`), softmax only, float16/bfloat16, masks
  ``causal()``, ``local(l, 0)``, ``causal() & local(l, r)`` or none.
* ``"auto"`` takes ``"splash"`` on TPU and ``"cudnn"`` on GPU when the call is one they
  compute (softmax, no bias, no array mask, no ``return_weights``, a mask they express, their
  dtypes; for cuDNN also its head dims and even lengths,
  :func:`sparse_jax.fused.cudnn_shape_problem`); on GPU ``"pallas"`` for any other call with a
  ``Mask`` that it computes (on TPU not yet: the Mosaic kernels have not been compiled and
  measured on one); otherwise ``"blocksparse"`` when the kernel would form at most
  ``BLOCKSPARSE_MAX_FRACTION`` (75%) of the dense score entries (``blocksparse_cost``), else
  ``"xla"``. :func:`attention_impl` says which and why. Asking a softmax-only kernel for
  anything else raises a ``ValueError`` that names the obstacle and what would work.

Numerics: scores, the normalizer and the accumulation of ``p @ v`` are in float32 (float64
stays float64); like ``jax.nn.dot_product_attention``, ``p`` is cast to ``v``'s dtype for the
product and the output has the input dtype. A query row with no allowed key (fully masked, or
whose biased scores are all ``-inf``) gives output 0 and zero gradients for every normalizer
(softmax included, where ``jax.nn`` would average the values). Arguments are checked in Python
before anything is traced: bad input raises ``ValueError``/``TypeError`` naming the argument,
its value or shape and what is allowed.

Non-finite input, the same in every engine (the policy of :mod:`sparse_jax.normalizers`, applied
to the biased scores): a NaN score at an allowed position (a NaN in a query row, in an allowed
key, or in the bias) makes that query row's output NaN; masked positions never matter, NaN
included; a ``-inf`` bias masks; a ``+inf`` bias puts all of the row's weight, uniformly, on its
``+inf`` keys. A value vector in ``v`` holding NaN or ±inf makes NaN (with their gradients) the
rows whose mask allows its key, whatever weight they give it: it enters as a NaN score of that
key, since ``p @ v`` would otherwise spread ``0 * NaN`` to rows that depend on how an engine
blocks the work. ``normalizer`` α follows the rule of :func:`sparse_jax.entmax`, the same in
every engine: α = 1 is softmax; α < 1, NaN or ±inf raise when concrete and make that head's
rows NaN when traced (``checkify`` reports them: ``normalizers.enable_traced_checks``).

As a drop-in for ``jax.nn.dot_product_attention``, :func:`attention` also takes its keywords
``is_causal``, ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size`` (turned
into mask leaves), ``return_residual`` (softmax's log-sum-exp) and rank-3 inputs; it runs under
``jax.numpy_rank_promotion("raise")``, and under ``jax.debug_infs(True)``: the normalizers'
``-inf`` masking stays inside one compiled call (``normalizers.normalize``), so a masked call
is not stopped by it.

:func:`attention_fn` adapts :func:`attention` to the ``attention_fn`` argument of
``flax.nnx.MultiHeadAttention``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import masks as masks_lib
from sparse_jax.blocksparse import (
    blocksparse_attention,
    blocksparse_cost,
    log_sum_exp,
    nonfinite_values,
    shared_einsum,
    widened,
)
from sparse_jax.fused import (
    cudnn_attention,
    cudnn_mask_arguments,
    cudnn_shape_problem,
    splash_attention,
    splash_mask_parts,
)
from sparse_jax.kernels import pallas_attention, pallas_supports
from sparse_jax.normalizers import NORMALIZERS, normalize
from sparse_jax.validation import (
    as_4d_broadcastable,
    check_bias,
    check_block_size,
    check_bool,
    check_choice,
    check_int,
    check_mask_fits,
    check_normalizer,
    check_qkv,
    check_scale,
)

__all__ = [
    "BLOCKSPARSE_MAX_FRACTION",
    "CHUNK_SCORES",
    "CPU_CHUNK_SCORES",
    "IMPLS",
    "NORMALIZERS",
    "ImplChoice",
    "attention",
    "attention_fn",
    "attention_impl",
    "default_query_chunk",
]

#: Values of ``impl=``.
IMPLS = ("auto", "xla", "blocksparse", "pallas", "splash", "cudnn")
#: With ``query_chunk=None``, ``impl="xla"`` takes as many query rows per chunk as keep one
#: chunk's scores ``[B, N, chunk, Tk]`` within this many elements (16 MiB in float32), and at
#: least 8 rows, on a GPU or TPU (:func:`default_query_chunk`).
CHUNK_SCORES = 2**22
#: The same budget on CPU (4 MiB of float32 scores), where the chunk also takes at least twice
#: the head dim in rows (:func:`default_query_chunk`).
CPU_CHUNK_SCORES = 2**20


def default_query_chunk(
    batch: int, heads: int, kv_len: int, head_dim: int, backend: str | None = None
) -> int:
    """The query rows ``impl="xla"`` takes per chunk when ``query_chunk`` is None, for
    ``[batch, *, heads, head_dim]`` queries against ``kv_len`` keys on ``backend`` (default:
    jax's default backend): as many as keep the chunk's scores within :data:`CHUNK_SCORES`, at
    least 8. On CPU within :data:`CPU_CHUNK_SCORES`, and at least ``2 * head_dim`` rows.

    Why (measured by ``python -m experiments.bench query_chunks``, figures in
    docs/benchmarks.md): on a CPU the backward pass of a chunk makes several passes over its
    scores, which run faster while they stay in the cache; but every chunk also reads all of
    ``k`` and ``v`` and adds into their whole gradients, work that grows with the head dim and
    the number of chunks, so at a large head dim short chunks lose.

    Example:
      >>> default_query_chunk(12, 4, 264, 16, backend="cpu")  # 2**20 // (12 * 4 * 264)
      82
      >>> default_query_chunk(2, 12, 1024, 64, backend="cpu")  # 42 by the budget; 2 * 64
      128
      >>> default_query_chunk(2, 12, 1024, 64, backend="gpu")  # 2**22 // (2 * 12 * 1024)
      170
    """
    caller = "default_query_chunk"
    batch = check_int(batch, "batch", caller)
    heads = check_int(heads, "heads", caller)
    kv_len = check_int(kv_len, "kv_len", caller)
    head_dim = check_int(head_dim, "head_dim", caller)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"{caller}: `backend` must be a platform name ('cpu', 'gpu', 'tpu') or None; "
            f"got {backend!r}"
        )
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        return max(8, 2 * head_dim, CPU_CHUNK_SCORES // (batch * heads * kv_len))
    return max(8, CHUNK_SCORES // (batch * heads * kv_len))


_NAME = "attention"


class ImplChoice(NamedTuple):
    """Which implementation :func:`attention` uses, and why (see :func:`attention_impl`).

    Example:
      >>> from sparse_jax.masks import causal
      >>> q = jax.ShapeDtypeStruct((1, 8, 2, 4), jnp.float32)  # [batch, seq, heads, head_dim]
      >>> attention_impl(q, q, q, normalizer="sparsemax")  # no Mask: no blocks to skip
      ImplChoice(impl='xla', reason="impl='auto': no sparse_jax.masks.Mask, so no block
      structure to exploit: 'xla' (query-chunked dense)")
      >>> impl, reason = attention_impl(q, q, q, mask=causal(), impl="blocksparse")
      >>> impl, reason
      ('blocksparse', "impl='blocksparse' was requested explicitly")
    """

    impl: str  # the concrete implementation, e.g. "xla"
    reason: str  # one sentence on why it was chosen


# ----------------------------------------------------------------------------------------------
# Argument checking (all in Python, on static shapes: runs before anything is compiled).


def _check_mask(mask: Any, target: tuple[int, int, int, int], caller: str) -> Any:
    """None, a Mask that fits ``target`` [B, N, Tq, Tk], or a bool array broadcastable to it."""
    if mask is None:
        return None
    b, n, tq, tk = target
    if isinstance(mask, masks_lib.Mask):
        return check_mask_fits(mask, caller, batch_size=b, num_heads=n, q_len=tq, kv_len=tk)
    if isinstance(mask, (jax.Array, np.ndarray)):
        if mask.dtype != np.bool_:
            raise TypeError(
                f"{caller}: an array `mask` must have dtype bool (True = may attend); got dtype "
                f"{mask.dtype} (convert with `mask.astype(bool)` if that is what you mean)"
            )
        return as_4d_broadcastable(mask, "mask", target, caller)
    raise TypeError(
        f"{caller}: `mask` must be None, a sparse_jax.masks.Mask or a bool array broadcastable "
        f"to [batch, heads, q_len, kv_len]; got {type(mask).__name__}"
    )


def _fused_problems(normalizer: Any, bias: Any, mask_arr: Any, return_weights: bool) -> list:
    """What the softmax-only fused kernels (splash, cudnn) cannot take."""
    problems = []
    if not (isinstance(normalizer, str) and normalizer == "softmax"):
        problems.append(f"normalizer={normalizer!r} (they compute softmax only)")
    if bias is not None:
        problems.append("a `bias`")
    if mask_arr is not None:
        problems.append("a bool-array `mask` (describe it with sparse_jax.masks)")
    if return_weights:
        problems.append("return_weights=True")
    return problems


def _check_fused(impl, normalizer, bias, mask_arr, return_weights, caller) -> None:
    problems = _fused_problems(normalizer, bias, mask_arr, return_weights)
    if problems:
        raise ValueError(
            f"{caller}: impl={impl!r} does not take {'; '.join(problems)}. Use "
            "impl='blocksparse' (every normalizer, Mask patterns) or impl='xla'"
        )


def _add_batch(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any, bool]:
    """q, k, v of rank 3 ([seq, heads, head_dim], as jax.nn.dot_product_attention takes them)
    with a batch axis of 1 in front, and True; other inputs as they are, and False."""
    if not all(getattr(x, "ndim", None) == 3 for x in (q, k, v)):
        return q, k, v, False

    def lift(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((1, *x.shape), x.dtype)
        return x[None]

    return lift(q), lift(k), lift(v), True


class _Args(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    mask_obj: Any  # sparse_jax.masks.Mask or None
    mask_arr: Any  # bool [b', n', tq', tk'] broadcastable to [B, N, Tq, Tk], or None
    bias: Any  # float [b', n', tq', tk'] or None
    normalizer: Any  # name, python float α, or float array α [N] / []
    scale: Any  # python float or float scalar array
    impl: str
    query_chunk: int
    block_size: tuple[int, int]
    return_weights: bool
    return_residual: bool = False  # also the log-sum-exp [B, Tq, N] (softmax, impl 'xla')


def _check_all(
    q,
    k,
    v,
    mask,
    bias,
    normalizer,
    scale,
    impl,
    block_size,
    query_chunk,
    return_weights,
    caller,
    abstract=False,
    jax_nn=(False, None, None, None, False),
) -> _Args:
    """Checks every argument; ``jax_nn``: jax.nn.dot_product_attention's ``is_causal``,
    ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size`` (turned into a Mask
    AND-ed with ``mask``) and ``return_residual``."""
    q, k, v = check_qkv(q, k, v, caller, abstract)
    b, tq, n, h = q.shape
    target = (b, n, tq, k.shape[1])
    mask = _check_mask(mask, target, caller)
    is_causal, q_lengths, kv_lengths, window, return_residual = jax_nn
    extra = masks_lib.jax_nn_mask(
        (b, tq, k.shape[1]),
        is_causal=is_causal,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        local_window_size=window,
        caller=caller,
    )
    beside = None  # a bool-array mask kept beside the keywords' Mask (impl 'xla' takes both)
    if extra is not None:
        extra = check_mask_fits(
            extra, caller, batch_size=b, num_heads=n, q_len=tq, kv_len=k.shape[1]
        )
        if isinstance(mask, masks_lib.Mask):
            mask = mask & extra
        elif mask is None:
            mask = extra
        else:
            beside, mask = mask, extra
    is_obj = isinstance(mask, masks_lib.Mask)
    bias = check_bias(bias, target, caller)
    normalizer = check_normalizer(normalizer, n, caller)
    scale = check_scale(scale, h, caller)
    impl = check_choice(impl, "impl", IMPLS, caller)
    block_size = check_block_size(block_size, caller)
    if beside is not None and impl not in ("auto", "xla"):
        raise ValueError(
            f"{caller}: impl={impl!r} takes one sparse_jax.masks.Mask, and a bool-array `mask` "
            "given with is_causal, query_seq_lengths, key_value_seq_lengths or "
            "local_window_size is not one. Use impl='xla', or describe the whole mask with "
            "sparse_jax.masks"
        )
    return_residual = check_bool(return_residual, "return_residual", caller)
    if return_residual:
        problem = (
            f"normalizer={normalizer!r} has none (sparsemax and entmax normalize by a threshold, "
            "not by a sum of exponentials): use normalizer='softmax'"
            if not (isinstance(normalizer, str) and normalizer == "softmax")
            else f"impl={impl!r} does not compute it: use impl='auto' or 'xla'"
            if impl not in ("auto", "xla")
            else "it cannot be combined with return_weights=True: ask for one of them"
            if return_weights
            else None
        )
        if problem:
            raise ValueError(
                f"{caller}: return_residual=True returns softmax's log-sum-exp of the scores; "
                + problem
            )
    if impl in ("blocksparse", "pallas") and not isinstance(mask, masks_lib.Mask):
        raise ValueError(
            f"{caller}: `impl`={impl!r} needs `mask` to be a sparse_jax.masks.Mask (the "
            f"kernel skips the blocks the mask leaves out); got "
            f"{'None' if mask is None else 'a bool array'}. Use impl='xla', or describe the "
            "pattern with sparse_jax.masks (masks.from_array for a fixed numpy array)."
        )
    if query_chunk is None:
        query_chunk = default_query_chunk(b, n, k.shape[1], h)
    query_chunk = check_int(query_chunk, "query_chunk", caller)
    return_weights = check_bool(return_weights, "return_weights", caller)
    if impl in ("splash", "cudnn"):
        _check_fused(impl, normalizer, bias, None if is_obj else mask, return_weights, caller)
        if impl == "cudnn" and is_obj:
            cudnn_mask_arguments(mask)  # raises for masks cuDNN cannot express
        if impl == "splash" and is_obj:
            splash_mask_parts(mask, n, caller)  # raises for run-time masks splash cannot take
    if impl == "pallas":
        ok, why = _pallas_ok(q, mask, return_weights, block_size)
        if not ok:
            raise ValueError(
                f"{caller}: impl='pallas' cannot compute this call: {why}. Use "
                "impl='blocksparse' (every run-time mask, return_weights) or impl='xla'"
            )
    args = _Args(
        q,
        k,
        v,
        mask if is_obj else None,
        None if is_obj else mask,
        bias,
        normalizer,
        scale,
        impl,
        query_chunk,
        block_size,
        bool(return_weights),
    )
    if beside is not None:
        args = args._replace(mask_arr=beside)
    return args._replace(return_residual=bool(return_residual))


# impl="auto" takes the block-sparse kernel when it forms at most this fraction of the dense
# score entries (its gathers cost extra work per entry), so that causal masks (56-63% of the
# entries) take it; how it compares with the dense reference at each length is measured in
# docs/benchmarks.md, "Attention under masks: block-sparse kernel vs the dense reference".
BLOCKSPARSE_MAX_FRACTION = 0.75


def _pallas_ok(q, mask, return_weights, block_size) -> tuple[bool, str]:
    """Whether the fused Pallas kernel computes the call (see pallas_supports), from its
    arguments alone (no layout is built)."""
    mask = mask if isinstance(mask, masks_lib.Mask) else None
    ok, why = pallas_supports(
        q, None, mask=mask, return_weights=return_weights, block_size=block_size
    )
    return ok, why.replace("`block_q`", "`block_size[0]`").replace("`block_kv`", "`block_size[1]`")


def _layout(args: _Args) -> masks_lib.BlockLayout:
    return args.mask_obj.blocks(args.q.shape[1], args.k.shape[1], *args.block_size)


def _splash_takes(mask: masks_lib.Mask | None, num_heads: int) -> bool:
    """Whether splash computes this mask (:func:`splash_mask_parts` accepts it)."""
    try:
        splash_mask_parts(mask, num_heads, "attention")
    except ValueError:
        return False
    return True


def _resolve_impl(args: _Args) -> ImplChoice:
    if args.impl != "auto":
        return ImplChoice(args.impl, f"impl={args.impl!r} was requested explicitly")
    if args.return_residual:
        return ImplChoice(
            "xla", "impl='auto': return_residual=True: 'xla' computes the log-sum-exp"
        )
    if args.mask_arr is not None and args.mask_obj is not None:
        return ImplChoice(
            "xla",
            "impl='auto': a bool-array mask beside a sparse_jax.masks.Mask: 'xla' takes both",
        )
    backend = jax.default_backend()
    mask = args.mask_obj
    softmax_ok = not _fused_problems(args.normalizer, args.bias, args.mask_arr, args.return_weights)
    fused_ok = softmax_ok and (mask is None or not mask.is_dynamic)
    same_dims = args.q.shape[3] == args.v.shape[3]
    if (
        backend == "tpu"
        and softmax_ok
        and _splash_takes(mask, args.q.shape[2])
        and same_dims
        and args.q.dtype in (jnp.float32, jnp.bfloat16)
    ):
        return ImplChoice(
            "splash",
            "impl='auto': softmax with a static mask (& padding, & segments) on TPU: splash",
        )
    if (
        backend == "gpu"
        and fused_ok
        and same_dims
        and args.q.dtype in (jnp.float16, jnp.bfloat16)
        and not cudnn_shape_problem(args.q.shape, args.k.shape)
    ):
        try:
            cudnn_mask_arguments(mask)
            return ImplChoice(
                "cudnn", "impl='auto': half-precision softmax with a causal/local mask on GPU"
            )
        except ValueError:
            pass
    not_pallas = ""
    if backend == "tpu" and mask is not None:
        # The Mosaic kernels lower for TPU and run in interpret mode, but have not been compiled
        # and measured on a TPU yet: auto keeps the measured engines until they have.
        not_pallas = (
            " (not the Pallas kernel: on TPU it is not yet compiled and measured there; "
            "impl='pallas' opts in)"
        )
    if backend == "gpu" and mask is not None:
        ok, why = _pallas_ok(args.q, mask, args.return_weights, args.block_size)
        if ok:
            return ImplChoice(
                "pallas", "impl='auto': a sparse_jax.masks.Mask on GPU: the fused Pallas kernel"
            )
        not_pallas = f" (not the Pallas kernel: {why})"
    if mask is None:
        return ImplChoice(
            "xla",
            "impl='auto': no sparse_jax.masks.Mask, so no block structure to exploit: 'xla' "
            "(query-chunked dense)",
        )
    b, _, n, h = args.q.shape
    cost = blocksparse_cost(_layout(args), batch=b, num_heads=n, head_dim=h)
    fraction = cost.computed_scores / cost.dense_scores
    verdict = "<=" if fraction <= BLOCKSPARSE_MAX_FRACTION else ">"
    return ImplChoice(
        "blocksparse" if fraction <= BLOCKSPARSE_MAX_FRACTION else "xla",
        f"impl='auto': with blocks {args.block_size} the block-sparse kernel would form "
        f"{fraction:.1%} of the dense score entries ({verdict} {BLOCKSPARSE_MAX_FRACTION:.0%})"
        + not_pallas,
    )


# ----------------------------------------------------------------------------------------------
# The query-chunked XLA implementation.


def _chunk_layout(tq: int, query_chunk: int) -> tuple[int, int]:
    """(number of chunks, chunk size): equal chunks of at most ``query_chunk`` rows, a multiple
    of 8 when that costs nothing, and as little padding as possible."""
    num = -(-tq // query_chunk)
    if num == 1:
        return 1, tq
    size = -(-tq // num)
    size = min(query_chunk, -(-size // 8) * 8)
    return -(-tq // size), size


def _split_rows(x: jax.Array, num: int, size: int, fill: Any) -> jax.Array:
    """[b, n, tq, tk] -> [num, b, n, size, tk], padding the query axis with ``fill``."""
    pad = num * size - x.shape[2]
    if pad:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=fill)
    x = x.reshape(x.shape[0], x.shape[1], num, size, x.shape[3])
    return jnp.moveaxis(x, 2, 0)


def _xla_attention(args: _Args, *, return_weights: bool, precision: Any) -> Any:
    q, k, v = args.q, args.k, args.v
    b, tq, n, h = q.shape
    _, tk, kh, hv = v.shape
    g = n // kh
    compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    num, size = _chunk_layout(tq, args.query_chunk)
    mask_obj, normalizer, scale = args.mask_obj, args.normalizer, args.scale
    if not isinstance(normalizer, (str, float)) and normalizer.ndim:
        normalizer = normalizer[:, None]  # one α per query head of the [B, N, C, Tk] scores
    v, key_nan = nonfinite_values(v)  # non-finite value vectors -> NaN scores of their keys
    key_nan = jnp.repeat(jnp.moveaxis(key_nan, 2, 1), g, axis=1)[:, :, None, :]  # [B, N, 1, Tk]
    # Every chunk adds its part to the gradients of k, v (and of a bias shared by the queries):
    # summed in half precision over many chunks that loses digits, so what the chunks share
    # enters the loop in float32 (its cotangents add up in float32) and is cast inside each.
    k_in, v_in, shared_bias = k, v, args.bias
    if num > 1:
        k_in, v_in = widened(k, compute), widened(v, compute)
        if shared_bias is not None and shared_bias.shape[2] == 1:
            shared_bias = widened(shared_bias, compute)

    def chunk(q_c, start, mask_c, bias_c):
        # q_c [B, C, N, H] -> scores [B, N, C, Tk] in float32.
        c = q_c.shape[1]
        # The queries go to [B, Kh, G, C, H] first, so that the product comes out in the
        # scores' order: asked for in another order, XLA:CPU transposes the scores themselves
        # (docs/benchmarks.md, "The dense reference's products in the order XLA forms them").
        q_t = jnp.transpose(q_c.reshape(b, c, kh, g, h), (0, 2, 3, 1, 4))
        s = shared_einsum("bkgch,bskh->bkgcs", q_t, k_in, k.dtype, compute, precision).reshape(
            b, n, c, tk
        )
        s = s * jnp.asarray(scale, compute) + key_nan.astype(compute)
        if bias_c is not None:
            s = s + bias_c.astype(compute)
        allowed = mask_c
        if mask_obj is not None:
            q_idx = start + jnp.arange(c, dtype=jnp.int32)
            kv_idx = jnp.arange(tk, dtype=jnp.int32)
            m = mask_obj.predicate(q_idx[:, None], kv_idx[None, :])  # [(B,) (N,) C, Tk]
            if mask_obj.num_heads is None:
                m = m[..., None, :, :]
            if mask_obj.batch_size is None:
                m = m[None]
            allowed = m if allowed is None else allowed & m
        p = normalize(s, allowed, normalizer)  # [B, N, C, Tk]
        out = shared_einsum(
            "bkgcs,bskh->bkgch",
            p.reshape(b, kh, g, c, tk).astype(v.dtype),
            v_in,
            v.dtype,
            compute,
            precision,
        )
        out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, c, n, hv)
        result = {"out": out.astype(q.dtype)}
        if return_weights:
            result["weights"] = p.astype(q.dtype)
        if args.return_residual:
            result["lse"] = log_sum_exp(s, allowed, q.dtype)  # [B, N, C]
        return result

    def per_query(x):  # the query axis of a [b', n', tq', tk'] mask/bias: 1 or Tq
        return x is not None and x.shape[2] != 1

    if num == 1:
        result = chunk(q, jnp.int32(0), args.mask_arr, args.bias)
        out, weights, lse = result["out"], result.get("weights"), result.get("lse")
    else:
        pad = num * size - tq
        q_p = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else q
        xs = {
            "q": jnp.moveaxis(q_p.reshape(b, num, size, n, h), 1, 0),
            "start": jnp.arange(num, dtype=jnp.int32) * size,
        }
        if per_query(args.mask_arr):
            xs["mask"] = _split_rows(args.mask_arr, num, size, False)
        if per_query(args.bias):
            xs["bias"] = _split_rows(args.bias, num, size, 0)

        def body(x):
            mask_c = x["mask"] if "mask" in x else args.mask_arr
            bias_c = x["bias"] if "bias" in x else shared_bias
            return chunk(x["q"], x["start"], mask_c, bias_c)

        result = jax.lax.map(jax.checkpoint(body, prevent_cse=False), xs)
        out, weights, lse = result["out"], result.get("weights"), result.get("lse")
        out = jnp.moveaxis(out, 0, 1).reshape(b, num * size, n, hv)[:, :tq]
        if weights is not None:
            weights = jnp.moveaxis(weights, 0, 2).reshape(b, n, num * size, tk)[:, :, :tq]
        if lse is not None:
            lse = jnp.moveaxis(lse, 0, 2).reshape(b, n, num * size)[:, :, :tq]
    if return_weights:
        return out, weights
    if args.return_residual:
        return out, jnp.transpose(lse, (0, 2, 1))  # [B, Tq, N], as jax.nn returns it
    return out


def _check_public(q, k, v, mask, bias, options, jax_nn, abstract) -> tuple[_Args, bool]:
    """The checks :func:`attention` and :func:`attention_impl` share: rank-3 ``q``, ``k``, ``v``
    get a batch axis (the bool says so), then :func:`_check_all` under the name ``attention``;
    ``options``: ``normalizer, scale, impl, block_size, query_chunk, return_weights``."""
    q, k, v, unbatched = _add_batch(q, k, v)
    return _check_all(q, k, v, mask, bias, *options, _NAME, abstract, jax_nn), unbatched


# ----------------------------------------------------------------------------------------------
# Public API.


def attention_impl(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: Any = None,
    bias: jax.Array | None = None,
    normalizer: Any = "softmax",
    impl: str = "auto",
    block_size: tuple[int, int] = (128, 128),
    return_weights: bool = False,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    return_residual: bool = False,
) -> ImplChoice:
    """The implementation :func:`attention` would run for these arguments, and why.

    Takes the arguments of :func:`attention` (``q``, ``k``, ``v`` may be ``jax.ShapeDtypeStruct``
    -like arrays; only shapes and dtypes are read, nothing is computed) and checks them exactly
    as :func:`attention` does, so bad arguments raise the same errors.

    Returns:
      ``ImplChoice(impl, reason)``, e.g. ``("xla", "impl='auto': ...")``.

    Example:
      >>> q = jnp.zeros((1, 8, 2, 4))
      >>> attention_impl(q, q, q, normalizer="sparsemax").impl
      'xla'
    """
    jax_nn = (is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size)
    options = (normalizer, None, impl, block_size, None, return_weights)
    args, _ = _check_public(q, k, v, mask, bias, options, (*jax_nn, return_residual), True)
    return _resolve_impl(args)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: Any = None,
    bias: jax.Array | None = None,
    normalizer: Any = "softmax",
    scale: float | jax.Array | None = None,
    impl: str = "auto",
    block_size: tuple[int, int] = (128, 128),
    return_weights: bool = False,
    query_chunk: int | None = None,
    precision: Any = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    return_residual: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head attention with a sparse or dense normalizer and an optional mask.

    Shapes (``jax.nn.dot_product_attention``'s layout): ``B`` batch, ``Tq``/``Tk`` query/key
    lengths, ``N`` query heads, ``K`` key/value heads (``K`` divides ``N``: ``K == N`` is
    multi-head, ``K == 1`` multi-query, otherwise grouped-query attention, query head ``n``
    using key head ``n // (N // K)``), ``H`` head dim of q/k, ``Hv`` head dim of v.

    Args:
      q: ``[B, Tq, N, H]`` float queries.
      k: ``[B, Tk, K, H]`` keys, same dtype as ``q``.
      v: ``[B, Tk, K, Hv]`` values, same dtype as ``q``.
      mask: None (everything allowed), a :class:`sparse_jax.masks.Mask` (evaluated chunk by chunk
        inside the computation; a per-head mask needs ``N`` heads, a ``padding`` mask batch
        size ``B``; row ``i`` is query position ``i``, use ``mask.with_offset`` when decoding),
        or a bool array broadcastable to ``[B, N, Tq, Tk]``. True = may attend.
      bias: optional float array broadcastable to ``[B, N, Tq, Tk]``, added to the scaled
        scores (``-inf`` entries are masked).
      normalizer: ``"softmax"``, ``"sparsemax"``, ``"entmax15"``, or α-entmax's α: a python
        float >= 1 (2.0 and 1.5 use the exact sparsemax/entmax15 algorithms, 1.0 is softmax),
        or a float array of shape ``[]`` or ``[N]`` (one α per *query* head). An array α is
        differentiable: parametrise a learned α as ``1 + softplus(θ)``; a traced α < 1 or
        non-finite makes its head's rows NaN (see :func:`sparse_jax.entmax`).
      scale: multiplier of ``q·k``; default ``H ** -0.5``. A scalar float array is accepted.
      impl: ``"auto"``, ``"xla"``, ``"blocksparse"``, ``"pallas"``, ``"splash"`` or ``"cudnn"``
        (see the module docstring; :func:`attention_impl` tells which ``"auto"`` takes and why).
      block_size: ``(block_q, block_kv)`` of the block-sparse, Pallas and splash kernels; unused by
        ``"xla"`` and ``"cudnn"``.
      return_weights: also return the attention weights. This materialises a
        ``[B, N, Tq, Tk]`` array: O(Tq·Tk) memory, which the chunking otherwise avoids.
      query_chunk: the most query rows ``"xla"`` processes at once; peak memory is about
        ``B·N·query_chunk·Tk`` floats times a small constant (about 1 forward, 5-6 for
        forward+backward), independent of ``Tq``. ``Tq`` is split into equal chunks of at
        most this size (a multiple of 8 where possible) and padded internally. Default (None):
        :func:`default_query_chunk`, as many rows as keep ``B·N·chunk·Tk <= CHUNK_SCORES``
        (2**22; on CPU ``CPU_CHUNK_SCORES``, 2**20, and at least ``2·H`` rows), at least 8, so
        small problems run as one chunk (no loop, no recomputation in the backward pass).
      precision: passed to the two einsums (``jax.lax.Precision``), as in flax.
      is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size: the mask keywords
        of ``jax.nn.dot_product_attention`` with its meaning (lengths int ``[B]``, may be
        traced; a window ``w`` or ``(left, right)``), as mask leaves AND-ed with ``mask``
        (:func:`sparse_jax.masks.jax_nn_mask`), so every engine sees one mask; beside a
        bool-array ``mask`` only ``"xla"`` takes them. A row left with no key gives 0 (where
        jax averages the values); rows past a query length are 0, as in jax.
      return_residual: also return softmax's log-sum-exp of the (scaled, biased, masked) scores
        ``[B, Tq, N]`` in ``q``'s dtype, without gradient, as jax does; a row with no allowed
        key gets ``finfo(dtype).min`` (finite). Softmax only (sparsemax and entmax normalize by
        a threshold and have no such sum: ``ValueError``), computed by ``"xla"``.

    Inputs of rank 3 (``q [Tq, N, H]``, ``k``/``v [Tk, K, H]``, no batch axis, as jax takes
    them) run as a batch of one and return without the batch axis.

    Returns:
      ``[B, Tq, N, Hv]`` in ``q``'s dtype; with ``return_weights``, ``(out, weights)`` with
      weights ``[B, N, Tq, Tk]`` in ``q``'s dtype (rows sum to 1, or are 0 where fully masked);
      with ``return_residual``, ``(out, log_sum_exp)``.

    Raises:
      ValueError, TypeError: for bad arguments, before anything is traced or compiled.

    Example:
      >>> from sparse_jax.masks import causal
      >>> q = k = v = jnp.ones((1, 3, 2, 4))  # [batch, seq, heads, head_dim]
      >>> out, w = attention(q, k, v, mask=causal(), normalizer="sparsemax",
      ...                    return_weights=True)
      >>> out.shape, w.shape
      ((1, 3, 2, 4), (1, 2, 3, 3))
      >>> (6 * w[0, 0]).round().astype(int).tolist()  # equal scores: uniform on allowed keys
      [[6, 0, 0], [3, 3, 0], [2, 2, 2]]
      >>> out, lse = attention(q[0], k[0], v[0], is_causal=True, return_residual=True)
      >>> out.shape, lse.shape  # jax.nn's keywords; rank-3 inputs: no batch axis
      ((3, 2, 4), (3, 2))
    """
    jax_nn = (is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size)
    options = (normalizer, scale, impl, block_size, query_chunk, return_weights)
    args, unbatched = _check_public(q, k, v, mask, bias, options, (*jax_nn, return_residual), False)
    result = _run(args, _resolve_impl(args), precision)
    if not unbatched:
        return result
    return jax.tree.map(lambda x: x[0], result)  # out [Tq, N, Hv], weights [N, Tq, Tk], lse [Tq, N]


def _run(args: _Args, choice: ImplChoice, precision: Any) -> Any:
    """Runs the chosen engine under the name scope ``sparse_jax/<engine>`` (visible in the
    jaxpr and HLO, so tests and profiles can tell which engine ran)."""
    with jax.named_scope(f"sparse_jax/{choice.impl}"):
        if choice.impl == "splash":
            return splash_attention(
                args.q,
                args.k,
                args.v,
                mask=args.mask_obj,
                scale=args.scale,
                block_size=args.block_size,
            )
        if choice.impl == "cudnn":
            return cudnn_attention(args.q, args.k, args.v, mask=args.mask_obj, scale=args.scale)
        if choice.impl in ("pallas", "blocksparse"):
            # The two block-layout engines take the same arguments; only the XLA one can
            # return the weights.
            if choice.impl == "pallas":
                engine, extra = pallas_attention, {}
            else:
                engine, extra = blocksparse_attention, {"return_weights": args.return_weights}
            return engine(
                args.q,
                args.k,
                args.v,
                _layout(args),
                mask=args.mask_obj,
                normalizer=args.normalizer,
                scale=args.scale,
                bias=args.bias,
                precision=precision,
                **extra,
            )
        return _xla_attention(args, return_weights=args.return_weights, precision=precision)


def attention_fn(
    normalizer: Any = "softmax",
    *,
    mask: masks_lib.Mask | None = None,
    scale: float | None = None,
    impl: str = "auto",
    block_size: tuple[int, int] = (128, 128),
    query_chunk: int | None = None,
) -> Callable[..., jax.Array]:
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that calls :func:`attention`.

    The returned function has the signature of ``flax.nnx.dot_product_attention``
    (``query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
    dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
    promote_dtype=None, is_causal=False``) with flax's shapes: ``[batch..., length, heads,
    depth]`` (any number of batch axes, possibly none) and flax masks/biases broadcastable to
    ``[batch..., heads, q_len, kv_len]``. The flax ``mask`` is combined (AND) with this
    adapter's ``mask`` and with ``is_causal``.

    Attention dropout is not supported: a call with ``dropout_rate > 0`` and
    ``deterministic=False`` raises ``ValueError`` (use ``dropout_rate=0`` or pass
    ``deterministic=True``). When flax asks for the weights to be sown (``sow_weights=True``,
    i.e. ``module`` is given), they are materialised and sown as ``attention_weights`` in
    ``nnx.Intermediate``, as flax does (this is the only place flax is imported, lazily).
    A learnable α must live in a module that calls :func:`attention` itself; here α is fixed.

    Args:
      normalizer, scale, impl, block_size, query_chunk: as in :func:`attention`.
      mask: a static :class:`sparse_jax.masks.Mask` applied on top of flax's mask (for
        example ``causal() & local(255, 0)``).

    Returns:
      The attention function.

    Example:
      >>> from flax import nnx
      >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
      ...     attention_fn=attention_fn("sparsemax"), rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)
    """
    caller = "attention_fn"
    why = "array masks are passed per call by flax"
    masks_lib.check_mask(mask, "mask", caller, optional=True, why=why)
    if isinstance(normalizer, (str, numbers.Real)):
        check_normalizer(normalizer, 1, caller)
    if scale is not None:
        check_scale(scale, 1, caller)
    check_choice(impl, "impl", IMPLS, caller)
    if impl in ("splash", "cudnn"):
        _check_fused(impl, normalizer, None, None, False, caller)
    check_block_size(block_size, caller)
    if query_chunk is not None:
        check_int(query_chunk, "query_chunk", caller)
    static_mask = mask

    def fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        promote_dtype=None,
        is_causal=False,
    ):
        del broadcast_dropout, dropout_rng
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError(
                f"{caller}: attention dropout is not supported (dropout_rate={dropout_rate}, "
                "deterministic=False); use dropout_rate=0.0 or deterministic=True"
            )
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            common = dtype or jnp.result_type(query, key, value)
            query, key, value = (jnp.asarray(x, common) for x in (query, key, value))
        shapes = [getattr(x, "shape", ()) for x in (query, key, value)]
        if (
            min(len(s) for s in shapes) < 3
            or not shapes[0][:-3] == shapes[1][:-3] == shapes[2][:-3]
        ):
            raise ValueError(
                f"{caller}: query, key and value must be [batch..., length, heads, depth] with the "
                f"same batch axes; got {query.shape}, {key.shape}, {value.shape}"
            )
        batch = query.shape[:-3]
        flat = math.prod(batch)

        def to_4d(x):  # [batch..., a, b, c] -> [B or 1, a, b, c]
            return x.reshape((flat, *x.shape[-3:]))

        def to_4d_bcast(x):  # flax mask/bias [batch..., heads, q, kv] (broadcastable)
            if x is None:
                return None
            x = jnp.asarray(x)
            x = x.reshape((1,) * max(0, len(batch) + 3 - x.ndim) + x.shape)
            lead, rest = x.shape[: x.ndim - 3], x.shape[x.ndim - 3 :]
            if all(d == 1 for d in lead):
                return x.reshape((1, *rest))
            return jnp.broadcast_to(x, batch + rest).reshape((flat, *rest))

        m = static_mask
        if is_causal:
            m = masks_lib.causal() if m is None else m & masks_lib.causal()
        if impl in ("blocksparse", "pallas") and m is None:
            m = masks_lib.full()  # the kernels need a Mask for their block layout
        mask_arr = to_4d_bcast(mask)
        bias4 = to_4d_bcast(bias)
        if mask_arr is not None and m is not None:
            # attention() takes one mask; the Mask keeps the block structure the engines skip
            # by, and flax's per-call bool mask rides along as a -inf bias (the same weights:
            # every normalizer gives -inf scores probability 0).
            mask_bias = jnp.where(mask_arr.astype(bool), 0.0, -jnp.inf).astype(jnp.float32)
            bias4 = mask_bias if bias4 is None else bias4 + mask_bias
        elif mask_arr is not None:
            m = mask_arr.astype(bool)
        q4, k4, v4 = to_4d(query), to_4d(key), to_4d(value)
        sow = module is not None
        args = _check_all(
            q4,
            k4,
            v4,
            m,
            bias4,
            normalizer,
            scale,
            impl,
            block_size,
            query_chunk,
            sow,
            caller,
        )
        result = _run(args, _resolve_impl(args), precision)
        if sow:
            from flax import nnx  # only to sow the weights, as flax's own function does

            out, weights = result
            weights = weights.reshape((*batch, *weights.shape[1:]))
            module.sow(nnx.Intermediate, "attention_weights", weights)
        else:
            out = result
        return out.reshape((*batch, *out.shape[1:]))

    return fn
