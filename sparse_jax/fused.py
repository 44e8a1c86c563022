"""Softmax attention through the fused kernels of the accelerators: TPU splash and GPU cuDNN.

Both kernels compute softmax attention only (sparsemax and entmax need the threshold pass of
:mod:`sparse_jax.blocksparse`), in :func:`sparse_jax.attention`'s layout
(``[batch, seq, heads, head_dim]``) and with its conventions: ``scale`` defaults to
``head_dim ** -0.5``, grouped-query attention when the key heads divide the query heads, and
a query row with no allowed key gives output 0 (the kernels themselves would average the
values there; the rows are found from the mask's block layout at trace time and zeroed).

* :func:`splash_attention`: ``jax.experimental.pallas.ops.tpu.splash_attention``. The
  :class:`~sparse_jax.masks.Mask` becomes a splash ``MultiHeadMask`` (``Mask.to_splash``),
  which the kernel turns into block metadata so that empty blocks are skipped, on TPU.
  Elsewhere it runs the same kernel in Pallas *interpret mode* (``interpret=None`` picks it off
  TPU): slow, for tests. Lengths that are not multiples of the blocks are padded internally
  and the padded keys excluded with splash ``SegmentIds``, as are the keys a run-time
  ``& padding(lengths)`` leaves out. Grouped-query attention repeats the
  key/value heads (the per-head mask may differ between the query heads of a group). The
  kernel object is built once per (mask, lengths, heads, blocks) and cached.
* :func:`cudnn_attention`: ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA
  GPUs, float16/bfloat16). cuDNN takes its masks as arguments, not arrays: ``full()``,
  ``causal()``, ``local(left, right)`` and ``causal() & local(left, right)`` (without
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
from sparse_jax.validation import check_block_size, check_qkv, check_scale

__all__ = ["cudnn_attention", "cudnn_mask_arguments", "splash_attention"]


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
    if not isinstance(mask, masks_lib.Mask):
        raise TypeError(
            f"{caller}: `mask` must be None or a sparse_jax.masks.Mask (the kernel needs the "
            f"pattern at trace time, not an array); got {type(mask).__name__}"
        )
    if mask.is_dynamic:
        raise ValueError(
            f"{caller}: run-time masks (padding, segments) are not supported by this kernel; "
            "use impl='pallas', impl='blocksparse' or impl='xla'"
        )
    if mask.num_heads is not None and mask.num_heads != n:
        raise ValueError(
            f"{caller}: `mask` is a per-head mask with {mask.num_heads} heads but q has {n} query "
            "heads"
        )
    return mask


def _first_keys(layout: masks_lib.BlockLayout) -> np.ndarray:
    """int64 ``[H, q_len]``: each query row's first allowed key (``kv_len`` for a row with
    none), from the layout's kept blocks and partial masks."""
    idx, full = layout.kv_block_indices.astype(np.int64), layout.block_is_full
    h, nq, _ = idx.shape
    bq, bk, none = layout.block_q, layout.block_kv, layout.kv_len
    valid = idx != masks_lib.SENTINEL
    first = np.where(valid & full, idx * bk, none).min(axis=2)  # [H, nq]
    first = np.repeat(first[..., None], bq, axis=2)  # [H, nq, bq]
    partial = valid & ~full
    if partial.any():
        masks = layout.partial_masks  # [n_unique, bq, bk]
        col = np.where(masks.any(axis=2), masks.argmax(axis=2), none)  # [n_unique, bq]
        hh, rr, ss = np.nonzero(partial)
        keys = idx[hh, rr, ss][:, None] * bk + col[layout.partial_mask_index[hh, rr, ss]]
        np.minimum.at(first, (hh, rr), np.minimum(keys, none))
    return first.reshape(h, nq * bq)[:, : layout.q_len]


def _zero_empty_rows(
    out: jax.Array, mask: masks_lib.Mask, tq: int, tk: int, lengths: jax.Array | None = None
) -> jax.Array:
    """``out [B, Tq, N, D]`` with rows that allow no key set to 0: rows whose static mask
    allows none, and with run-time key ``lengths [B]`` rows whose first allowed key is beyond
    their batch element's length (none of either: ``out`` unchanged)."""
    first = _first_keys(mask.blocks(tq, tk, min(tq, 128), min(tk, 128)))  # [H, Tq]
    if lengths is None:
        if (first < tk).all():
            return out
        live = jnp.asarray(first.T < tk)[None, :, :, None]  # [1, Tq, H, 1]
    else:
        live = jnp.asarray(first.T)[None] < lengths[:, None, None]  # [B, Tq, H]
        live = live[..., None]
    return jnp.where(live, out, jnp.zeros((), out.dtype))


def splash_mask_parts(
    mask: Any, n: int, caller: str
) -> tuple[masks_lib.Mask, tuple[masks_lib.Padding, ...]]:
    """``(static part, padding leaves)`` of a splash call's mask (``full()`` for None); raises
    for a mask splash cannot take (segments, other run-time masks, arrays)."""
    if not isinstance(mask, masks_lib.Mask):  # None: full(); anything else: its TypeError
        return _check_static_mask(mask, n, caller), ()
    parts = masks_lib.split_runtime(mask)
    if parts is None or parts[2]:
        raise ValueError(
            f"{caller}: the kernel takes run-time masks only as `& padding(lengths)` joined to a "
            f"static mask; got {mask!r}. For segments(...) or other run-time masks use "
            "impl='pallas', impl='blocksparse' or impl='xla'"
        )
    static, paddings, _ = parts
    _check_static_mask(static, n, caller)
    return static, paddings


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
        ``& padding(lengths)`` (the keys beyond each batch element's length become splash
        ``SegmentIds``; ``segments`` masks are refused). Per-head masks need ``N`` heads.
      scale: multiplier of ``q·k`` (applied to ``q``); default ``H ** -0.5``.
      block_size: ``(block_q, block_kv)`` of the kernel, multiples of 128 (the lengths are
        padded to multiples of them).
      interpret: run the Pallas kernel in interpret mode; None: only when the default backend
        is not TPU.

    Returns:
      ``[B, Tq, N, H]`` in ``q``'s dtype.

    Example:
      >>> from sparse_jax.masks import causal
      >>> q = k = v = jnp.ones((2, 12, 4, 8))
      >>> splash_attention(q, k, v, mask=causal()).shape
      (2, 12, 4, 8)
    """
    caller = "splash_attention"
    _check_qkv(q, k, v, caller, (jnp.float32, jnp.bfloat16))
    _, tq, n, h = q.shape
    tk, kh = k.shape[1], k.shape[2]
    mask, paddings = splash_mask_parts(mask, n, caller)
    lengths = masks_lib.key_lengths(paddings, q.shape[0], tk, caller)
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
    kernel, segment_ids = _splash_kernel(mask, tq_p, tk_p, n, bq, bk, bool(interpret))

    def heads_first(x, t_p):  # [B, T, heads, H] -> [B, N, T_p, H]
        x = jnp.pad(x, ((0, 0), (0, t_p - x.shape[1]), (0, 0), (0, 0)))
        if x.shape[2] != n:
            x = jnp.repeat(x, n // kh, axis=2)
        return jnp.transpose(x, (0, 2, 1, 3))

    qs = heads_first(q * jnp.asarray(scale, q.dtype), tq_p)
    ks, vs = heads_first(k, tk_p), heads_first(v, tk_p)
    if lengths is not None or tk_p != tk:
        # Keys beyond a batch element's length (run-time padding, or the blocks' padding) form
        # their own segment, which no query belongs to.
        kv_lengths = jnp.full((q.shape[0],), tk, jnp.int32) if lengths is None else lengths
        kv_ids = (jnp.arange(tk_p)[None, :] >= kv_lengths[:, None]).astype(jnp.int32)
        q_ids = jnp.zeros(tq_p, jnp.int32)

        def one(a, c, d, kv):
            return kernel(a, c, d, segment_ids=segment_ids(q=q_ids, kv=kv))

        out = jax.vmap(one)(qs, ks, vs, kv_ids)
    else:
        out = jax.vmap(kernel)(qs, ks, vs)
    out = jnp.transpose(out, (0, 2, 1, 3))[:, :tq].astype(q.dtype)
    return _zero_empty_rows(out, mask, tq, tk, lengths)


# ----------------------------------------------------------------------------------------------
# GPU cuDNN flash attention.


def cudnn_mask_arguments(mask: masks_lib.Mask | None) -> dict[str, Any]:
    """The ``jax.nn.dot_product_attention`` arguments that express ``mask``.

    ``full()`` and None give ``{}``, ``causal()`` gives ``is_causal=True``, ``local(l, r)``
    gives ``local_window_size=(l, r)`` (an unbounded side as the longest possible window is not
    expressible: both sides must be ints), and ``causal() & local(l, r)`` both.

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
                f"cudnn_attention: the cuDNN kernel takes full(), causal(), local(left, right) "
                f"or causal() & local(left, right) without offsets; got `mask`={mask!r}. Use "
                "impl='blocksparse' or impl='xla' for other masks"
            )
    return out


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
      mask: None, ``full()``, ``causal()``, ``local(l, r)`` or ``causal() & local(l, r)``
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
