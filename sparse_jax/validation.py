"""Argument checks shared by the engines and the models: each raises ``TypeError``/``ValueError``
naming the caller, the argument, its value and what is allowed, before anything is traced.

The module sits low in the import levels (it imports only :mod:`sparse_jax.normalizers`), so
checks of a :class:`sparse_jax.masks.Mask` read its attributes (``shape``, ``num_heads``,
``batch_size``) without importing the type; whether a value *is* a Mask is checked where the
type lives (:func:`sparse_jax.masks.check_mask`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.normalizers import NORMALIZERS, bad_alpha

#: The α of α-entmax that each sparse normalizer name is (sparsemax is 2-entmax): where a
#: learned α starts from (``learn_alpha``).
ALPHA_OF_NORMALIZER = {"sparsemax": 2.0, "entmax15": 1.5}


def check_qkv(q: Any, k: Any, v: Any, caller: str, abstract: bool = False) -> tuple[Any, Any, Any]:
    """q ``[B, Tq, N, H]``, k ``[B, Tk, K, H]``, v ``[B, Tk, K, Hv]`` (K divides N), one dtype.

    ``abstract`` also accepts ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).

    Example:
      >>> q = np.zeros((2, 5, 4, 8), np.float32)  # [batch, seq, heads, head_dim]
      >>> k = v = np.zeros((2, 7, 2, 8), np.float32)  # 2 key/value heads for the 4 query heads
      >>> [x.shape for x in check_qkv(q, k, v, "my_kernel")]  # returned as they are
      [(2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8)]
      >>> k3 = v3 = np.zeros((2, 7, 3, 8), np.float32)  # 3 key/value heads do not divide 4
      >>> check_qkv(q, k3, v3, "my_kernel")
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: the number of key/value heads (3, axis 2 of k) must divide the ...
    """
    kinds = (jax.Array, np.ndarray, jax.ShapeDtypeStruct) if abstract else (jax.Array, np.ndarray)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, kinds):
            raise TypeError(
                f"{caller}: `{name}` must be a jax or numpy array [batch, seq, heads, head_dim]; "
                f"got {type(x).__name__}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{caller}: `{name}` must have a floating dtype (float32, bfloat16, float16, "
                f"float64); got dtype {x.dtype}"
            )
        if x.ndim != 4:
            raise ValueError(
                f"{caller}: `{name}` must have rank 4 [batch, seq, heads, head_dim]; got shape "
                f"{tuple(x.shape)} (rank {x.ndim})"
            )
        if 0 in x.shape:
            raise ValueError(f"{caller}: `{name}` must have no empty axis; got shape {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"{caller}: `q`, `k` and `v` must have the same dtype; got {q.dtype}, {k.dtype}, "
            f"{v.dtype} (cast them first, e.g. `k.astype(q.dtype)`)"
        )
    (b, _, n, h), (bk, tk, kh, hk), (bv, tv, vh, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(
            f"{caller}: batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}; axis 0 of "
            "q, k and v must be equal"
        )
    if tk != tv:
        raise ValueError(
            f"{caller}: `k` and `v` must have the same sequence length (axis 1); got k "
            f"{k.shape} and v {v.shape}"
        )
    if kh != vh:
        raise ValueError(
            f"{caller}: `k` and `v` must have the same number of heads (axis 2); got k "
            f"{k.shape} and v {v.shape}"
        )
    if hk != h:
        raise ValueError(
            f"{caller}: `q` and `k` must have the same head_dim (axis 3); got q {q.shape} and "
            f"k {k.shape} (only v's head_dim may differ)"
        )
    if n % kh:
        raise ValueError(
            f"{caller}: the number of key/value heads ({kh}, axis 2 of k) must divide the number "
            f"of query heads ({n}, axis 2 of q) for grouped-query attention; got q {q.shape}, "
            f"k {k.shape}"
        )
    return q, k, v


def check_int(value: Any, name: str, caller: str, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as a python int in ``[low, high]`` (``high`` None: unbounded; bools refused).

    Example:
      >>> check_int(np.int64(3), "query_chunk", "my_kernel")  # a numpy int: a python int
      3
      >>> check_int(0, "query_chunk", "my_kernel")  # low=1 by default
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `query_chunk` must be an int >= 1; got 0
    """
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{caller}: `{name}` must be {allowed}; got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{caller}: `{name}` must be {allowed}; got {value!r}")
    return int(value)


def check_token_ids(ids: Any, vocab_size: int, caller: str, name: str = "ids") -> None:
    """Refuses ids that are not integers (``TypeError``; traced ones too), and token ids
    outside ``[0, vocab_size)`` when ``ids`` is concrete (a numpy or jax array). A tracer
    (under ``jit``) cannot be checked for range without a host sync and is passed on: the
    model then gives NaN logits for such ids (see ``GPT2.__call__``).

    Example:
      >>> ids = np.array([[0, 5, 9], [3, 10, 1]])  # [batch, seq]
      >>> check_token_ids(ids[:1], 10, "GPT2")  # all in [0, 10): returns None
      >>> check_token_ids(ids, 10, "GPT2")
      Traceback (most recent call last):
      ...
      ValueError: GPT2: `ids` must be token ids in [0, vocab_size) = [0, 10); got 10 at index ...
      >>> check_token_ids(np.array([1.0, 2.0]), 10, "GPT2")
      Traceback (most recent call last):
      ...
      TypeError: GPT2: `ids` must be integer token ids; got dtype float64
    """
    dtype = getattr(ids, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{caller}: `{name}` must be integer token ids; got dtype {dtype}")
    if isinstance(ids, jax.core.Tracer) or not hasattr(ids, "shape") or not np.size(ids):
        return
    # On the host with numpy: ids are small, and a concrete array closed over by a traced
    # function must not become a traced reduction here.
    values = np.asarray(ids)
    if values.min() >= 0 and values.max() < vocab_size:
        return
    bad = (values < 0) | (values >= vocab_size)
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{caller}: `{name}` must be token ids in [0, vocab_size) = [0, {vocab_size}); got "
        f"{values[first]} at index {first} ({int(bad.sum())} of {bad.size} ids out of range; "
        "a negative id does not wrap around, and the tokenizer must not produce more ids than "
        "the model's vocabulary)"
    )


def check_token_batch(
    ids: Any, vocab_size: int, n_positions: int, caller: str, name: str = "ids"
) -> None:
    """A batch of token ids for a model: an integer array ``[batch, seq]`` with
    ``1 <= seq <= n_positions``, and (when concrete) ids in ``[0, vocab_size)``
    (:func:`check_token_ids`).

    Example:
      >>> check_token_batch(np.zeros((2, 8), np.int32), 101, 64, "GPT2")  # fits: returns None
      >>> check_token_batch(np.zeros((2, 65), np.int32), 101, 64, "GPT2")
      Traceback (most recent call last):
      ...
      ValueError: GPT2: `ids` has 65 tokens; allowed: 1 to n_positions=64 (the model's ...
      >>> check_token_batch(np.zeros(8, np.int32), 101, 64, "GPT2")
      Traceback (most recent call last):
      ...
      ValueError: GPT2: `ids` must be [batch, seq] token ids; got shape (8,)
    """
    shape = getattr(ids, "shape", None)
    if shape is None or not hasattr(ids, "dtype"):
        raise TypeError(
            f"{caller}: `{name}` must be [batch, seq] token ids (an integer array); got "
            f"{type(ids).__name__} {ids!r:.80}"
        )
    if len(shape) != 2:
        raise ValueError(f"{caller}: `{name}` must be [batch, seq] token ids; got shape {shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{caller}: `{name}` must be integer token ids; got dtype {ids.dtype}")
    if not 1 <= shape[1] <= n_positions:
        raise ValueError(
            f"{caller}: `{name}` has {shape[1]} tokens; allowed: 1 to n_positions={n_positions} "
            "(the model's positions)"
        )
    check_token_ids(ids, vocab_size, caller, name)


def check_choice(value: Any, name: str, allowed: Sequence[Any], caller: str) -> Any:
    """``value`` if it is one of ``allowed`` (names of modes, kinds, normalizers ...).

    Example:
      >>> check_choice("head", "granularity", ("layer", "head"), "my_layer")
      'head'
      >>> check_choice("row", "granularity", ("layer", "head"), "my_layer")
      Traceback (most recent call last):
      ...
      ValueError: my_layer: unknown `granularity`='row'; allowed: ('layer', 'head')
    """
    if isinstance(value, Hashable) and value in allowed:
        return value
    raise ValueError(f"{caller}: unknown `{name}`={value!r:.200}; allowed: {tuple(allowed)}")


def check_bool(value: Any, name: str, caller: str, *, optional: bool = False) -> bool | None:
    """``value`` as a python bool (numpy bools accepted, ints refused); with ``optional``,
    None passes through.

    Example:
      >>> check_bool(np.True_, "return_weights", "my_kernel")  # a numpy bool: a python bool
      True
      >>> check_bool(1, "return_weights", "my_kernel")
      Traceback (most recent call last):
      ...
      TypeError: my_kernel: `return_weights` must be a bool; got 1
      >>> check_bool(None, "interpret", "my_kernel", optional=True) is None
      True
    """
    if optional and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        allowed = "None or a bool" if optional else "a bool"
        raise TypeError(f"{caller}: `{name}` must be {allowed}; got {value!r}")
    return bool(value)


def check_block_size(block_size: Any, caller: str, *, multiple_of: int = 1) -> tuple[int, int]:
    """A pair ``(block_q, block_kv)`` of positive ints, each a multiple of ``multiple_of``.

    Example:
      >>> check_block_size([128, 64], "my_kernel")  # a list or tuple: a tuple of python ints
      (128, 64)
      >>> check_block_size((128, 64), "my_kernel", multiple_of=128)
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `block_size` must be a pair of positive multiples of 128 ...
    """
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise TypeError(
            f"{caller}: `block_size` must be a pair of ints (block_q, block_kv); got {block_size!r}"
        )
    sizes = tuple(check_int(size, f"block_size[{i}]", caller) for i, size in enumerate(block_size))
    if any(size % multiple_of for size in sizes):
        raise ValueError(
            f"{caller}: `block_size` must be a pair of positive multiples of {multiple_of} "
            f"(block_q, block_kv); got {block_size!r}"
        )
    return sizes


def check_scale(scale: Any, head_dim: int, caller: str) -> Any:
    """``scale`` of the scores: None -> ``head_dim ** -0.5``, a finite real, or a float scalar.

    Example:
      >>> check_scale(None, 16, "my_kernel")  # the default for head_dim 16: 16 ** -0.5
      0.25
      >>> check_scale(float("inf"), 16, "my_kernel")
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `scale` must be finite; got inf
    """
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{caller}: `scale` must be None or a real number; got {scale!r}")
    if isinstance(scale, numbers.Real):
        if not math.isfinite(scale):
            raise ValueError(f"{caller}: `scale` must be finite; got {scale!r}")
        return float(scale)
    if isinstance(scale, (jax.Array, np.ndarray)) and scale.ndim == 0:
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            raise TypeError(f"{caller}: an array `scale` must be a float scalar; got {scale.dtype}")
        return jnp.asarray(scale)
    raise TypeError(
        f"{caller}: `scale` must be None (head_dim ** -0.5), a real number or a scalar float "
        f"array; got {type(scale).__name__} {getattr(scale, 'shape', '')}"
    )


def as_4d_broadcastable(x: Any, name: str, target: tuple[int, ...], caller: str) -> jax.Array:
    """``x`` left-padded to rank 4; checks that it broadcasts to ``target`` [B, N, Tq, Tk].

    Example:
      >>> mask = np.ones((4, 6), bool)  # [q_len, kv_len], shared by batch and heads
      >>> as_4d_broadcastable(mask, "mask", (2, 3, 4, 6), "my_kernel").shape  # [1, 1, Tq, Tk]
      (1, 1, 4, 6)
      >>> as_4d_broadcastable(np.ones((5, 6), bool), "mask", (2, 3, 4, 6), "my_kernel")
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `mask` with shape (5, 6) does not broadcast to [batch, heads, ...
    """
    shape = tuple(x.shape)
    ok = len(shape) <= 4
    if ok:
        try:
            ok = tuple(np.broadcast_shapes(shape, target)) == target
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            f"{caller}: `{name}` with shape {shape} does not broadcast to [batch, heads, q_len, "
            f"kv_len] = {list(target)}"
        )
    return jnp.reshape(jnp.asarray(x), (1,) * (4 - len(shape)) + shape)


def check_float_array(x: Any, name: str, caller: str, expected: str) -> None:
    """Refuses ``x`` unless it is a jax or numpy array of a floating dtype; ``expected``: what
    ``name`` must be, in the error for a value that is not an array.

    Example:
      >>> check_float_array(np.zeros(3, np.float32), "scores", "my_kernel", "a float array")
      >>> check_float_array(np.zeros(3, np.int32), "scores", "my_kernel", "a float array")
      Traceback (most recent call last):
      ...
      TypeError: my_kernel: `scores` must have a floating dtype; got dtype int32
    """
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{caller}: `{name}` must be {expected}; got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{caller}: `{name}` must have a floating dtype; got dtype {x.dtype}")


def check_bias(bias: Any, target: tuple[int, int, int, int], caller: str) -> Any:
    """None, or a float array broadcastable to ``target``, returned with rank 4.

    Example:
      >>> bias = np.zeros((3, 1, 6), np.float32)  # per head and key: [N, 1, Tk]
      >>> check_bias(bias, (2, 3, 4, 6), "my_kernel").shape  # target [B, N, Tq, Tk]
      (1, 3, 1, 6)
      >>> check_bias(None, (2, 3, 4, 6), "my_kernel") is None  # no bias
      True
      >>> check_bias(np.zeros((4, 5), np.float32), (2, 3, 4, 6), "my_kernel")
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `bias` with shape (4, 5) does not broadcast to [batch, heads, ...
    """
    if bias is None:
        return None
    expected = (
        f"None or a float array broadcastable to [batch, heads, q_len, kv_len] = {list(target)}"
    )
    check_float_array(bias, "bias", caller, expected)
    return as_4d_broadcastable(bias, "bias", target, caller)


def check_normalizer(normalizer: Any, num_heads: int, caller: str) -> Any:
    """A name of NORMALIZERS, a python float α >= 1, or a float array α of shape [] or [N].

    α follows the rule of :func:`sparse_jax.entmax`: α = 1 is softmax (a python float 1
    comes back as ``"softmax"``); α < 1, NaN and ±inf raise when concrete; a traced array α
    cannot be checked, and its bad entries give NaN rows in every engine.

    Example:
      >>> check_normalizer("sparsemax", 4, "my_kernel"), check_normalizer(1.5, 4, "my_kernel")
      ('sparsemax', 1.5)
      >>> check_normalizer(np.array([1.2, 1.0, 2.0, 3.0]), 4, "my_kernel").shape  # α per head
      (4,)
      >>> check_normalizer(1.0, 4, "my_kernel")
      'softmax'
      >>> check_normalizer(0.5, 4, "my_kernel")
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `normalizer` α must be finite and >= 1 (α = 1 is softmax); got 0.5
    """
    allowed = (
        f"one of {list(NORMALIZERS)}, a float α >= 1, or a float array of α >= 1 of shape [] or "
        f"[heads] = [{num_heads}] (one α per query head)"
    )
    if isinstance(normalizer, str):
        if normalizer not in NORMALIZERS:
            raise ValueError(f"{caller}: unknown `normalizer`={normalizer!r}; allowed: {allowed}")
        return normalizer
    if isinstance(normalizer, (bool, np.bool_)):
        raise TypeError(f"{caller}: `normalizer` must be {allowed}; got {normalizer!r}")
    if isinstance(normalizer, numbers.Real):
        alpha = float(normalizer)
        if bad_alpha(alpha):
            raise ValueError(
                f"{caller}: `normalizer` α must be finite and >= 1 (α = 1 is softmax); got {alpha}"
            )
        return "softmax" if alpha == 1.0 else alpha
    if isinstance(normalizer, (jax.Array, np.ndarray)):
        if not jnp.issubdtype(normalizer.dtype, jnp.floating):
            raise TypeError(
                f"{caller}: an array `normalizer` (α) must have a floating dtype; got dtype "
                f"{normalizer.dtype}"
            )
        shape = tuple(normalizer.shape)
        if shape not in ((), (1,), (num_heads,)):
            raise ValueError(
                f"{caller}: an array `normalizer` (α) must have shape [], [1] or [heads] = "
                f"[{num_heads}] (one α per query head); got shape {list(shape)}"
            )
        if not isinstance(normalizer, jax.core.Tracer):
            values = np.asarray(normalizer)
            if bad_alpha(values).any():
                raise ValueError(
                    f"{caller}: every α of `normalizer` must be finite and >= 1 (α = 1 is "
                    f"softmax); got {values.tolist()!r:.200} "
                    "(parametrise a learned α as 1 + softplus(θ))"
                )
        return jnp.asarray(normalizer)
    raise TypeError(f"{caller}: `normalizer` must be {allowed}; got {type(normalizer).__name__}")


def check_alpha_start(normalizer: Any, caller: str) -> float:
    """The α a learned α starts from (``learn_alpha``): the α of a sparse normalizer name
    (:data:`ALPHA_OF_NORMALIZER`: ``"sparsemax"`` 2, ``"entmax15"`` 1.5) or a real α > 1
    (α = 1 + softplus(θ) reaches 1 only at θ = -inf).

    Example:
      >>> check_alpha_start("entmax15", "my_layer"), check_alpha_start(1.2, "my_layer")
      (1.5, 1.2)
      >>> check_alpha_start("softmax", "my_layer")
      Traceback (most recent call last):
      ...
      ValueError: my_layer: `learn_alpha` needs a sparse `normalizer` to start α from: one of ...
    """
    if isinstance(normalizer, str) and normalizer in ALPHA_OF_NORMALIZER:
        return ALPHA_OF_NORMALIZER[normalizer]
    if isinstance(normalizer, numbers.Real) and not isinstance(normalizer, (bool, np.bool_)):
        alpha = check_normalizer(normalizer, 1, caller)
        if alpha != "softmax":
            return alpha
    raise ValueError(
        f"{caller}: `learn_alpha` needs a sparse `normalizer` to start α from: one of "
        f"{tuple(ALPHA_OF_NORMALIZER)} or a float α > 1 (the initial α); got "
        f"`normalizer`={normalizer!r:.200}"
    )


def check_mask_fits(
    mask: Any,
    caller: str,
    *,
    batch_size: int | None = None,
    num_heads: int | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> Any:
    """``mask`` (a :class:`sparse_jax.masks.Mask`, read by its ``shape``, ``num_heads`` and
    ``batch_size``) fits inputs of the given sizes (None: not checked): a fixed-shape mask
    (``from_array``, ``segments``) covers ``q_len x kv_len``, a per-head mask has ``num_heads``
    heads, a run-time mask was built for ``batch_size``.

    Example:
      >>> from sparse_jax.masks import causal, per_head
      >>> check_mask_fits(causal(), "my_kernel", num_heads=4) == causal()  # head-agnostic
      True
      >>> check_mask_fits(per_head([causal()] * 3), "my_kernel", num_heads=4)
      Traceback (most recent call last):
      ...
      ValueError: my_kernel: `mask` is a per-head mask with 3 heads but q has 4 query heads; ...
    """
    shape = mask.shape
    if shape is not None and q_len is not None and kv_len is not None:
        if q_len > shape[0] or kv_len > shape[1]:
            raise ValueError(
                f"{caller}: `mask` has the fixed shape {shape} (from_array or segments) but the "
                f"inputs need (q_len, kv_len) = ({q_len}, {kv_len}); allowed: q_len <= "
                f"{shape[0]}, kv_len <= {shape[1]}"
            )
    if num_heads is not None and mask.num_heads is not None and mask.num_heads != num_heads:
        raise ValueError(
            f"{caller}: `mask` is a per-head mask with {mask.num_heads} heads but q has "
            f"{num_heads} query heads; allowed: a per-head mask with exactly {num_heads} heads, "
            "or a head-agnostic mask"
        )
    if batch_size is not None and mask.batch_size is not None and mask.batch_size != batch_size:
        raise ValueError(
            f"{caller}: `mask` is a run-time (padding or segments) mask for batch size "
            f"{mask.batch_size} but q has batch size {batch_size}"
        )
    return mask
