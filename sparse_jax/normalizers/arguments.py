"""Argument checking and layout shared by the normalizers (package-internal).

Every public function of :mod:`sparse_jax.normalizers` checks its arguments here before
anything is traced (a wrong type, an empty normalized axis, a bad ``axis``, ``where`` or
``alpha`` raise ``TypeError``/``ValueError`` naming the argument: :func:`check_inputs`), and
:func:`normalize_rows` runs a row function with the normalized axis last, in float32 (float64
stays float64), as one compiled call.
"""

from __future__ import annotations

import functools
import numbers
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# No API here: the names without an underscore are shared by the package's modules only.
__all__: list[str] = []


# Traced checks (a checkify.debug_check per check): off unless asked for, because each check
# puts an error code that jax numbers per process into the compiled program, so programs that
# hold one never match jax's persistent compilation cache (nor each other).
_TRACED_CHECKS = [os.environ.get("SPARSE_JAX_TRACED_CHECKS", "0") not in ("", "0")]


def enable_traced_checks(enabled: bool = True) -> bool:
    """Turns the traced checks of the normalizers on or off; returns the previous setting.

    A traced α or label cannot be checked without a host sync: a bad one gives NaN rows (the
    documented rule). With traced checks on, the functions traced *afterwards* also carry a
    ``jax.experimental.checkify.debug_check`` per check, so that running them under
    ``checkify.checkify`` reports a bad value as an error (outside ``checkify`` nothing is
    raised). jax caches a function's trace: turn the checks on before the function is first
    traced. Off by default (``SPARSE_JAX_TRACED_CHECKS=1`` in the environment turns them on at
    import), since a program holding a check is compiled anew in every process (jax numbers
    the checks' error codes per process).

    Example:
      >>> from jax.experimental import checkify
      >>> from sparse_jax.normalizers import entmax
      >>> previous = enable_traced_checks(True)
      >>> step = jax.jit(lambda a: entmax(jnp.zeros((2, 3)), a))  # α per row
      >>> error, _ = checkify.checkify(step)(jnp.array([1.0, 0.5]))
      >>> error.throw()
      Traceback (most recent call last):
      ...
      jax._src.checkify.JaxRuntimeError: α-entmax: every α must be ... got α = 0.5 (1 of 2 ...
      >>> enable_traced_checks(previous)
      True
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enable_traced_checks: `enabled` must be True or False; got {enabled!r}")
    previous, _TRACED_CHECKS[0] = _TRACED_CHECKS[0], bool(enabled)
    return previous


def debug_check(predicate, message: str, *args) -> None:
    """``checkify.debug_check(predicate, message, *args)`` when traced checks are on
    (:func:`enable_traced_checks`), else nothing."""
    if _TRACED_CHECKS[0]:
        checkify.debug_check(predicate, message, *args)


def compute_dtype(dtype) -> jnp.dtype:
    """float64 stays float64 (with x64 enabled); every other float computes in float32."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def check_scores(x, name: str, arg: str = "x") -> jax.Array:
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number, list, tuple)):
        raise TypeError(f"{name}: `{arg}` must be a float array; got {type(x).__name__} {x!r:.60}.")
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name}: `{arg}` must be a float array; got {x!r:.60} ({error})."
        ) from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name}: `{arg}` must have a floating dtype (float32, float16, bfloat16, float64); "
            f"got dtype {x.dtype}. Cast it first, e.g. `{arg}.astype(jnp.float32)`."
        )
    if x.ndim == 0:
        raise ValueError(f"{name}: `{arg}` must have at least one dimension; got a scalar.")
    return x


def check_row_length(x, axis: int, name: str, arg: str = "x") -> None:
    if x.shape[axis] == 0:
        raise ValueError(
            f"{name}: `{arg}` with shape {tuple(x.shape)} has an empty axis {axis}, the axis that "
            "is normalized; a distribution needs at least one entry (an empty batch axis is fine)."
        )


def check_axis(axis, ndim: int, name: str) -> int:
    if isinstance(axis, (bool, np.bool_)):
        raise TypeError(f"{name}: `axis` must be an int; got {axis!r}.")
    try:
        index = operator.index(axis)  # python and numpy integers, 0-d integer arrays
    except TypeError:
        raise TypeError(
            f"{name}: `axis` must be a static int; got {axis!r:.60} ({type(axis).__name__})."
        ) from None
    if not -ndim <= index < ndim:
        raise ValueError(
            f"{name}: `axis`={index} is out of range for an input with {ndim} dimension(s); "
            f"allowed: {-ndim} <= axis < {ndim}."
        )
    return index % ndim


def check_where(where, shape: tuple[int, ...], name: str, arg: str = "where") -> jax.Array | None:
    if where is None:
        return None
    if not isinstance(where, (jax.Array, np.ndarray, np.generic, bool, list, tuple)):
        raise TypeError(
            f"{name}: `{arg}` must be None or a boolean array (True = allowed); got "
            f"{type(where).__name__}."
        )
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(
            f"{name}: `{arg}` must be a boolean array (True = allowed); got dtype {where.dtype}."
        )
    try:
        np.broadcast_shapes(where.shape, shape)
    except ValueError:
        raise ValueError(
            f"{name}: `{arg}` with shape {where.shape} does not broadcast to the scores' shape "
            f"{shape}."
        ) from None
    return where


def is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def bad_alpha(values) -> np.ndarray:
    """Where concrete α values break the rule for α (α < 1, NaN, ±inf; :func:`entmax`'s
    docstring), as a numpy bool array."""
    values = np.asarray(values, np.float64)
    return ~(np.isfinite(values) & (values >= 1.0))


def check_alpha(alpha, row_batch_shape: tuple[int, ...], name: str, arg: str = "alpha"):
    """Returns a python float for scalar α, or a float array broadcastable to the row batch.

    α must be finite and >= 1 (the rule for α); an array α is checked when it is concrete
    (a traced one is handled by :func:`alpha_eps`).
    """
    allowed = "a finite float >= 1, or a float array of such α"
    if isinstance(alpha, (bool, np.bool_)):
        raise TypeError(f"{name}: `{arg}` must be {allowed}; got {alpha!r}.")
    if isinstance(alpha, numbers.Real):
        value = float(alpha)
        if bad_alpha(value):
            raise ValueError(
                f"{name}: `{arg}` must be finite and >= 1 (α = 1 is softmax; α -> inf puts all "
                f"weight on the maximum); got alpha={value}."
            )
        return value
    if not isinstance(alpha, (jax.Array, np.ndarray, list, tuple)):
        raise TypeError(
            f"{name}: `{arg}` must be {allowed}; got {type(alpha).__name__} {alpha!r:.60}."
        )
    try:
        alpha = jnp.asarray(alpha)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: `{arg}` must be {allowed}; got {alpha!r:.60}.") from None
    if not (jnp.issubdtype(alpha.dtype, jnp.floating) or jnp.issubdtype(alpha.dtype, jnp.integer)):
        raise TypeError(f"{name}: `{arg}` must be a real number or array; got dtype {alpha.dtype}.")
    if alpha.ndim > len(row_batch_shape) or _broadcasts(alpha.shape, row_batch_shape) is None:
        raise ValueError(
            f"{name}: `{arg}` with shape {alpha.shape} must broadcast to the scores' shape "
            f"without the normalized axis, {row_batch_shape} (for example one α per head)."
        )
    if is_concrete(alpha):
        values = np.asarray(alpha)
        bad = bad_alpha(values)
        if bad.any():
            raise ValueError(
                f"{name}: every `{arg}` must be finite and >= 1 (α = 1 is softmax); got "
                f"{values[bad][:5]} (a learned α is usually parametrised as 1 + softplus(θ) or "
                "1 + sigmoid(θ))."
            )
    return alpha


def softmax_eps(dtype) -> float:
    """The ε = α - 1 that α = 1 is computed with: the square of the dtype's machine epsilon
    (2⁻⁴⁶ in float32). α-entmax at ε differs from softmax by O(ε x²) relative (x: a score
    less the row's maximum), below the dtype's rounding for |x| up to about 10³, and runs the
    same search and derivatives as any α (the threshold held as σ = 1 + τ), so a row of α = 1
    is softmax in every engine and dα there is its limit from above."""
    return float(jnp.finfo(dtype).eps) ** 2


def alpha_eps(alpha, dtype) -> jax.Array:
    """ε = α - 1 of an α array (traced or not) under the rule for α, in ``dtype``.

    α = 1 gives :func:`softmax_eps` (softmax); α < 1, NaN or ±inf give NaN, which the
    normalizer and the kernels turn into NaN rows. dε/dα = 1 everywhere. With
    :func:`enable_traced_checks`, under ``jax.experimental.checkify.checkify`` a bad α is also
    reported: the way to an error for a traced α.
    """
    alpha = jnp.asarray(alpha, dtype)
    bad = ~((alpha >= 1.0) & (alpha < jnp.inf))  # NaN compares False
    flat = bad.reshape(-1)
    debug_check(
        ~jnp.any(bad),
        "α-entmax: every α must be finite and >= 1 (α = 1 is softmax); got α = {} ({} of "
        f"{flat.size} values break the rule)",
        alpha.reshape(-1)[jnp.argmax(flat)],
        jnp.sum(flat),
    )
    nudge = jnp.where(alpha == 1.0, softmax_eps(dtype), jnp.where(bad, jnp.nan, 0.0))
    return (alpha - 1.0) + nudge.astype(dtype)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]):
    try:
        out = np.broadcast_shapes(a, b)
    except ValueError:
        return None
    return out if tuple(out) == tuple(b) else None


def check_inputs(x, axis, where, name):
    """Checks a normalizer's arguments; returns (``x`` as an array, ``axis`` in ``[0, ndim)``,
    ``where`` as a boolean array or None)."""
    x = check_scores(x, name)
    axis = check_axis(axis, x.ndim, name)
    check_row_length(x, axis, name)
    return x, axis, check_where(where, x.shape, name)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def normalize_rows(rows, x, where, axis: int, static: tuple, *operands) -> jax.Array:
    """``rows(z, *operands, *static)`` of the checked scores ``x``, where ``z`` is ``x`` with
    the normalized ``axis`` last, in the compute dtype (float32; float64 stays float64) and
    -inf where ``where`` is False (whatever it held, NaN included: masked entries never
    matter); returned in ``x``'s layout and dtype. ``+inf`` is left as it is:
    ``search.shift_to_zero_max`` applies its policy, and only to inputs that hold it.

    Why one compiled call: the mask's ``-inf`` is an intermediate, and ``jax.debug_infs``
    checks every primitive run eagerly but only the outputs of a compiled call, which are
    finite. Inside ``jit`` the call is inlined: the same program.
    """
    dtype = x.dtype
    z = x.astype(compute_dtype(dtype))
    if where is not None:
        z = jnp.where(where, z, -jnp.inf)
    p = rows(jnp.moveaxis(z, axis, -1), *operands, *static)
    return jnp.moveaxis(p, -1, axis).astype(dtype)
