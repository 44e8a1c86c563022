"""Softmax attention through the fused kernels of the accelerators: TPU splash and GPU cuDNN.

Both kernels compute softmax attention only (sparsemax and entmax need the threshold pass of
:mod:`sparse_jax.blocksparse`), in :func:`sparse_jax.attention`'s layout
(``[batch, seq, heads, head_dim]``) and with its conventions: ``scale`` defaults to
``head_dim ** -0.5``, grouped-query attention when the key heads divide the query heads, and
a query row with no allowed key gives output 0 (the kernels themselves would average the
values there: splash starts every row from a zero-valued sink whose logit only counts when the
row has no key; for cuDNN the rows are found from the mask's block layout at trace time and
zeroed).

* :func:`splash_attention`: ``jax.experimental.pallas.ops.tpu.splash_attention``. The
  :class:`~sparse_jax.masks.Mask` becomes a splash ``MultiHeadMask`` (``Mask.to_splash``),
  which the kernel turns into block metadata so that empty blocks are skipped, on TPU.
  Elsewhere it runs the same kernel in Pallas *interpret mode* (``interpret=None`` picks it off
  TPU): slow, for tests. Lengths that are not multiples of the blocks are padded internally
  and the padded keys excluded with splash ``SegmentIds``, as are the keys a run-time
  ``& padding(lengths)`` leaves out; a run-time ``& segments(ids)`` becomes those
  ``SegmentIds`` itself. Grouped-query attention repeats the
  key/value heads (the per-head mask may differ between the query heads of a group). The
  kernel object is built once per (mask, lengths, heads, blocks) and cached.
* :func:`cudnn_attention`: ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA
  GPUs, float16/bfloat16). cuDNN takes its masks as arguments, not arrays: ``full()``,
  ``causal()``, ``local(left, 0)`` and ``causal() & local(left, right)`` (without
  offsets) are translated (:func:`cudnn_mask_arguments`); any other mask raises a
  ``ValueError`` that says which masks work.

Example:
  >>> from sparse_jax.masks import causal, local
  >>> q = k = v = jnp.ones((1, 16, 2, 8))  # [batch, seq, heads, head_dim]
  >>> splash_attention(q, k, v, mask=causal() & local(4, 0)).shape
  (1, 16, 2, 8)
  >>> cudnn_mask_arguments(causal() & local(4, 0))
  {'is_causal': True, 'local_window_size': (4, 0)}
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import masks as masks_lib
from sparse_jax.validation import check_block_size, check_mask_fits, check_qkv, check_scale

__all__ = ["cudnn_attention", "cudnn_mask_arguments", "cudnn_shape_problem", "splash_attention"]

# The logit of the zero-valued sink that every splash row starts from: far above splash's
# mask value (-0.7 x float32's largest), far below any score of real inputs.
EMPTY_ROW_LOGIT = -1e30


def _check_qkv(q: Any, k: Any, v: Any, caller: str, dtypes: tuple[Any, ...]) -> None:
    """The block-sparse kernel's shape checks, plus the kernels' dtypes and equal head dims."""
    check_qkv(q, k, v, caller)
    if q.dtype not in dtypes:
        allowed = ", ".join(str(np.dtype(d)) for d in dtypes)
        raise TypeError(f"{caller}: `q` has dtype {q.dtype}; the kernel takes {allowed}")
    if v.shape[3] != q.shape[3]:
        raise ValueError(
            f"{caller}: the kernel needs v's head_dim equal to q's; got q {q.shape}, v {v.shape}"
        )


def _check_static_mask(mask: Any, n: int, caller: str) -> masks_lib.Mask:
    if mask is None:
        return masks_lib.full()
    why = "the kernel needs the pattern at trace time, not an array"
    masks_lib.check_mask(mask, "mask", caller, optional=True, why=why)  # None: full() above
    if mask.is_dynamic:
        raise ValueError(
            f"{caller}: run-time masks (padding, segments) are not supported by this kernel; "
            "use impl='pallas', impl='blocksparse' or impl='xla'"
        )
    return check_mask_fits(mask, caller, num_heads=n)


def _rows_with_keys(layout: masks_lib.BlockLayout) -> np.ndarray:
    """bool ``[H, q_len]``: which query rows of the layout allow at least one key."""
    h, nq, _ = layout.kv_block_indices.shape
    rows = np.zeros((h, nq, layout.block_q), bool)
    valid = layout.kv_block_indices != masks_lib.SENTINEL
    rows |= (valid & layout.block_is_full).any(axis=2)[..., None]
    partial = valid & ~layout.block_is_full
    if partial.any():
        row_any = layout.partial_masks.any(axis=2)  # [n_unique, bq]
        hh, rr, ss = np.nonzero(partial)
        np.logical_or.at(rows, (hh, rr), row_any[layout.partial_mask_index[hh, rr, ss]])
    return rows.reshape(h, nq * layout.block_q)[:, : layout.q_len]


def _zero_empty_rows(out: jax.Array, mask: masks_lib.Mask, tq: int, tk: int) -> jax.Array:
    """``out [B, Tq, N, D]`` with rows that allow no key set to 0 (none: ``out`` unchanged)."""
    live = _rows_with_keys(mask.blocks(tq, tk, min(tq, 128), min(tk, 128)))  # [H, Tq]
    if live.all():
        return out
    return jnp.where(jnp.asarray(live.T)[None, :, :, None], out, jnp.zeros((), out.dtype))


def splash_mask_parts(
    mask: Any, n: int, caller: str
) -> tuple[masks_lib.Mask, tuple[masks_lib.Padding, ...], masks_lib.Segments | None]:
    """``(static part, padding leaves, segments leaf or None)`` of a splash call's mask
    (``full()`` for None); raises for a mask splash cannot take (run-time masks under ``|``,
    ``~`` or ``per_head``, more than one ``segments`` leaf, arrays)."""
    if not isinstance(mask, masks_lib.Mask):  # None: full(); anything else: its TypeError
        return _check_static_mask(mask, n, caller), (), None
    parts = masks_lib.split_runtime(mask)
    if parts is None or len(parts[2]) > 1:
        raise ValueError(
            f"{caller}: the kernel takes run-time masks only as `& padding(lengths)` and/or one "
            f"`& segments(ids)` joined to a static mask; got {mask!r}. For other run-time "
            "masks use impl='pallas', impl='blocksparse' or impl='xla'"
        )
    static, paddings, segs = parts
    _check_static_mask(static, n, caller)
    return static, paddings, (segs[0] if segs else None)


def _splash_segment_ids(
    segs: masks_lib.Segments | None,
    lengths: jax.Array | None,
    b: int,
    shapes: tuple[int, int, int, int],
    caller: str,
) -> tuple[jax.Array, jax.Array] | None:
    """``(q_ids [B, Tq_p], kv_ids [B, Tk_p])`` int32 for splash's ``SegmentIds``, None when
    every key is allowed (no segments, no run-time lengths, no padded keys). ``shapes`` is
    ``(Tq, Tk, Tq_p, Tk_p)``: the call's lengths and the blocks' padded ones. Queries see the
    keys of their own segment; the padded queries, and the padded keys and those beyond each
    batch element's ``lengths``, get ids below every id of ``segs`` (one for queries, another
    for keys), so they match nothing."""
    tq, tk, tq_p, tk_p = shapes
    if segs is None and lengths is None and tk_p == tk:
        return None
    if segs is None:
        q_ids, kv_ids = jnp.zeros((b, tq), jnp.int32), jnp.zeros((b, tk), jnp.int32)
        low = jnp.int32(0)
    else:
        q_ids, kv_ids = masks_lib.segment_ids(segs, b, caller)
        if segs.shape[0] < tq or segs.shape[1] < tk:
            raise ValueError(
                f"{caller}: `mask` has the fixed shape {segs.shape} (segments) but the inputs "
                f"need (q_len, kv_len) = ({tq}, {tk}); allowed: q_len <= {segs.shape[0]}, "
                f"kv_len <= {segs.shape[1]}"
            )
        q_ids, kv_ids = q_ids[:, :tq], kv_ids[:, :tk]
        low = jnp.minimum(q_ids.min(), kv_ids.min())
    kv_lengths = jnp.full((b,), tk, jnp.int32) if lengths is None else lengths
    q_ids = jnp.pad(q_ids, ((0, 0), (0, tq_p - tq)), constant_values=low - 1)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, tk_p - tk)))
    kv_ids = jnp.where(jnp.arange(tk_p)[None, :] < kv_lengths[:, None], kv_ids, low - 2)
    return q_ids, kv_ids


# ----------------------------------------------------------------------------------------------
# TPU splash attention.


@functools.lru_cache(maxsize=32)
def _splash_kernel(mask, tq: int, tk: int, n: int, bq: int, bk: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    splash_mask = mask.to_splash(tq, tk, num_heads=n)
    # Concrete arrays even when the first call is traced: the kernel (with its mask metadata)
    # is cached and reused by later traces, which a tracer would leak into.
    with jax.ensure_compile_time_eval():
        kernel = sa.make_splash_mha(
            splash_mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
        )
    return kernel, sa.SegmentIds


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: masks_lib.Mask | None = None,
    scale: float | None = None,
    block_size: tuple[int, int] = (128, 128),
    interpret: bool | None = None,
) -> jax.Array:
    """Softmax attention through the TPU splash kernel (interpret mode off TPU).

    Args:
      q: ``[B, Tq, N, H]`` float32 or bfloat16 queries.
      k: ``[B, Tk, Kh, H]`` keys (``Kh`` divides ``N``), same dtype.
      v: ``[B, Tk, Kh, H]`` values (splash needs v's head_dim equal to q's).
      mask: a :class:`~sparse_jax.masks.Mask` (None: full attention): static, or static
        ``& padding(lengths)`` and/or ``& segments(q_ids, kv_ids)`` (packed sequences; one
        ``segments`` leaf, its ids greater than int32's minimum + 2): both become splash
        ``SegmentIds``, the keys beyond each batch element's length given an id no query has.
        Per-head masks need ``N`` heads.
      scale: multiplier of ``q·k`` (applied to ``q``); default ``H ** -0.5``.
      block_size: ``(block_q, block_kv)`` of the kernel, multiples of 128 (the lengths are
        padded to multiples of them).
      interpret: run the Pallas kernel in interpret mode; None: only when the default backend
        is not TPU.

    Returns:
      ``[B, Tq, N, H]`` in ``q``'s dtype; a row with no allowed key is 0 (and so are its
      gradients).

    Example:
      >>> from sparse_jax.masks import causal, segments
      >>> q = k = v = jnp.ones((2, 12, 4, 8))
      >>> splash_attention(q, k, v, mask=causal()).shape
      (2, 12, 4, 8)
      >>> ids = jnp.array([[0] * 5 + [1] * 7, [3] * 12])  # [batch, seq]: packed sequences
      >>> splash_attention(q, k, v, mask=causal() & segments(ids)).shape
      (2, 12, 4, 8)
    """
    caller = "splash_attention"
    _check_qkv(q, k, v, caller, (jnp.float32, jnp.bfloat16))
    b, tq, n, h = q.shape
    tk, kh = k.shape[1], k.shape[2]
    mask, paddings, segs = splash_mask_parts(mask, n, caller)
    lengths = masks_lib.key_lengths(paddings, b, tk, caller)
    scale = check_scale(scale, h, caller)
    bq, bk = check_block_size(block_size, caller, multiple_of=128)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    tq_p, tk_p = -(-tq // bq) * bq, -(-tk // bk) * bk
    if mask.shape is not None and (tq_p, tk_p) != (tq, tk):
        raise ValueError(
            f"{caller}: a from_array mask cannot be padded to the blocks: lengths ({tq}, {tk}) "
            f"must be multiples of `block_size`={block_size}"
        )
    ids = _splash_segment_ids(segs, lengths, b, (tq, tk, tq_p, tk_p), caller)
    kernel, segment_ids = _splash_kernel(mask, tq_p, tk_p, n, bq, bk, bool(interpret))
    # Every row's softmax starts from a sink of logit EMPTY_ROW_LOGIT and value 0: it adds
    # exp(EMPTY_ROW_LOGIT - max) = 0 to a row with an allowed key, and is the whole of a row
    # without one, whose output and gradients are then exactly 0 (the kernel alone would
    # average the masked values there).
    sinks = jnp.full((n,), EMPTY_ROW_LOGIT, jnp.float32)

    def heads_first(x, t_p):  # [B, T, heads, H] -> [B, N, T_p, H]
        x = jnp.pad(x, ((0, 0), (0, t_p - x.shape[1]), (0, 0), (0, 0)))
        if x.shape[2] != n:
            x = jnp.repeat(x, n // kh, axis=2)
        return jnp.transpose(x, (0, 2, 1, 3))

    qs = heads_first(q * jnp.asarray(scale, q.dtype), tq_p)
    ks, vs = heads_first(k, tk_p), heads_first(v, tk_p)
    if ids is None:
        out = jax.vmap(lambda a, c, d: kernel(a, c, d, sinks=sinks))(qs, ks, vs)
    else:

        def one(a, c, d, q_ids, kv_ids):
            return kernel(a, c, d, segment_ids=segment_ids(q=q_ids, kv=kv_ids), sinks=sinks)

        out = jax.vmap(one)(qs, ks, vs, *ids)
    return jnp.transpose(out, (0, 2, 1, 3))[:, :tq].astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# GPU cuDNN flash attention.


def cudnn_mask_arguments(mask: masks_lib.Mask | None) -> dict[str, Any]:
    """The ``jax.nn.dot_product_attention`` arguments that express ``mask``.

    ``full()`` and None give ``{}``, ``causal()`` gives ``is_causal=True``, and
    ``causal() & local(l, r)`` gives it with ``local_window_size=(l, r)`` (an unbounded side as
    the longest possible window is not expressible: both sides must be ints). cuDNN takes a
    window only beside its causal mask (jax passes it as a left bound, ``sliding_window_length
    = l + 1``): ``local(l, 0)``, which keeps the same keys as ``causal() & local(l, 0)``, is
    sent as that; ``local(l, r)`` with ``r > 0`` is only taken under ``causal()``
    (``jax.nn.dot_product_attention`` refuses it otherwise).

    Raises:
      ValueError: for any other mask (or one with an offset), naming what is supported.

    Example:
      >>> from sparse_jax.masks import causal
      >>> cudnn_mask_arguments(causal())
      {'is_causal': True}
    """
    if mask is None or isinstance(mask, masks_lib.Full):
        return {}
    parts = [mask.left, mask.right] if isinstance(mask, masks_lib.And) else [mask]
    out: dict[str, Any] = {}
    for part in parts:
        if isinstance(part, masks_lib.Causal) and "is_causal" not in out:
            out["is_causal"] = True
        elif (
            isinstance(part, masks_lib.Local)
            and "local_window_size" not in out
            and part.left is not None
            and part.right is not None
        ):
            out["local_window_size"] = (part.left, part.right)
        else:
            raise ValueError(
                f"cudnn_attention: the cuDNN kernel takes full(), causal(), local(left, 0) "
                f"or causal() & local(left, right) without offsets; got `mask`={mask!r}. Use "
                "impl='blocksparse' or impl='xla' for other masks"
            )
    right = out.get("local_window_size", (0, 0))[1]
    if "local_window_size" in out and right == 0:
        out["is_causal"] = True  # local(l, 0) keeps j <= i already: the same keys
    if right != 0 and "is_causal" not in out:
        raise ValueError(
            f"cudnn_attention: the cuDNN kernel's window has no right side without causal(); "
            f"got `mask`={mask!r} (right={right}). Use causal() & local(left, right), "
            "impl='pallas', impl='blocksparse' or impl='xla'"
        )
    return out


def cudnn_shape_problem(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> str:
    """Why cuDNN's flash attention cannot take (and differentiate) these shapes, or ``""``.

    Args:
      q_shape: ``[B, Tq, N, H]``.
      k_shape: ``[B, Tk, Kh, H]``.

    cuDNN's flash kernel takes head dims that are multiples of 8, at most 256 on Hopper and
    later GPUs (compute capability 9.0) and 128 before; and ``jax.nn.dot_product_attention``'s
    gradient refuses odd lengths (its backward passes an empty bias that its own check counts as
    a bias, which needs even lengths: ``NotImplementedError: Unsupported sequence length Q 13,
    KV 13`` on an H200, jax 0.11.2). ``attention(impl="auto")`` takes cuDNN only where this is
    ``""``; an explicit ``impl="cudnn"`` leaves the call to jax.

    Example:
      >>> cudnn_shape_problem((1, 13, 2, 64), (1, 13, 2, 64))
      'odd lengths (Tq=13, Tk=13): its gradient takes even ones'
      >>> cudnn_shape_problem((1, 16, 2, 64), (1, 16, 2, 64))
      ''
    """
    tq, head_dim, tk = q_shape[1], q_shape[3], k_shape[1]
    capability = getattr(jax.devices()[0], "compute_capability", "")
    try:
        hopper_or_later = int(str(capability).split(".")[0]) >= 9
    except ValueError:
        hopper_or_later = False
    largest = 256 if hopper_or_later else 128
    if head_dim % 8 or head_dim > largest:
        return f"head dim {head_dim} (its kernel takes multiples of 8 up to {largest} here)"
    if tq % 2 or tk % 2:
        return f"odd lengths (Tq={tq}, Tk={tk}): its gradient takes even ones"
    return ""


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: masks_lib.Mask | None = None,
    scale: float | None = None,
    implementation: str = "cudnn",
) -> jax.Array:
    """Softmax attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

    Args:
      q: ``[B, Tq, N, H]`` float16 or bfloat16 queries (cuDNN's requirement).
      k, v: ``[B, Tk, Kh, H]`` (``Kh`` divides ``N``), same dtype.
      mask: None, ``full()``, ``causal()``, ``local(l, 0)`` or ``causal() & local(l, r)``
        (see :func:`cudnn_mask_arguments`).
      scale: multiplier of ``q·k``; default ``H ** -0.5``.
      implementation: ``"cudnn"`` (needs an NVIDIA GPU), or ``"xla"`` to run the same call
        through XLA (how the mask translation is tested without a GPU).

    Returns:
      ``[B, Tq, N, H]`` in ``q``'s dtype.

    Raises:
      ValueError: for a mask cuDNN cannot express, or ``implementation="cudnn"`` when the
        default backend is not a GPU.

    Example:
      >>> from sparse_jax.masks import causal
      >>> q = k = v = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
      >>> cudnn_attention(q, k, v, mask=causal(), implementation="xla").shape
      (1, 4, 2, 8)
    """
    caller = "cudnn_attention"
    if implementation not in ("cudnn", "xla"):
        raise ValueError(
            f"{caller}: `implementation` must be 'cudnn' or 'xla'; got {implementation!r}"
        )
    _check_qkv(q, k, v, caller, (jnp.float16, jnp.bfloat16))
    _, tq, n, h = q.shape
    if isinstance(mask, masks_lib.Mask):
        _check_static_mask(mask, n, caller)
    elif mask is not None:
        raise TypeError(f"{caller}: `mask` must be None or a sparse_jax.masks.Mask; got {mask!r}")
    kwargs = cudnn_mask_arguments(mask)
    scale = check_scale(scale, h, caller)
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"{caller}: implementation='cudnn' needs an NVIDIA GPU; the default backend is "
            f"{jax.default_backend()!r} (use impl='xla' or 'blocksparse' there)"
        )
    if not isinstance(scale, float):  # a scalar array: jax.nn takes a python float
        q, scale = q * scale.astype(q.dtype), 1.0
    out = jax.nn.dot_product_attention(
        q, k, v, scale=scale, implementation=implementation, **kwargs
    )
    if mask is None:
        return out
    return _zero_empty_rows(out, mask, tq, k.shape[1])
