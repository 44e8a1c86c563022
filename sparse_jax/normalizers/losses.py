"""The Fenchel–Young losses of sparsemax, 1.5-entmax and α-entmax: multiclass, over the last
axis, with a padding mask; gradient ``p - onehot(y)``, no derivative through the normalizer.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.normalizers.alpha_entmax import entmax
from sparse_jax.normalizers.arguments import (
    check_alpha,
    check_row_length,
    check_scores,
    check_where,
    compute_dtype,
    debug_check,
    is_concrete,
)

__all__ = ["entmax15_loss", "entmax_loss", "sparsemax_loss"]


def _fenchel_young_loss(logits, labels, alpha, where, name):
    """Multiclass Fenchel–Young loss of the Tsallis α-entropy over the last axis.

    L(θ, y) = <p, θ> - θ_y + H_α(p),   p = entmax_α(θ),   H_α(p) = (1 - Σ p^α) / (α (α - 1)),

    which is >= 0, zero iff p is one-hot on y, and has gradient p - onehot(y) (Blondel, Martins &
    Niculae, 2020). The gradient in θ and in α comes from holding p fixed (Danskin's theorem: p
    maximises <p, θ> + H_α(p)), so no derivative is taken through the normalizer.
    """
    logits = check_scores(logits, name, "logits")
    check_row_length(logits, logits.ndim - 1, name, "logits")
    if not isinstance(labels, (jax.Array, np.ndarray, np.generic, numbers.Integral, list, tuple)):
        raise TypeError(f"{name}: `labels` must be an integer array; got {type(labels).__name__}.")
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"{name}: `labels` must be integer class indices; got dtype {labels.dtype}."
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"{name}: `labels` must have shape logits.shape[:-1] = {logits.shape[:-1]}; "
            f"got {labels.shape}."
        )
    num_classes = logits.shape[-1]
    where = check_where(where, labels.shape, name)
    if is_concrete(labels) and (where is None or is_concrete(where)):
        # Padding rows (``where`` False) may hold any label, e.g. -100.
        kept = np.asarray(labels)
        if where is not None:
            kept = kept[np.broadcast_to(np.asarray(where), labels.shape)]
        if kept.size and (kept.min() < 0 or kept.max() >= num_classes):
            raise ValueError(
                f"{name}: `labels` must lie in [0, {num_classes}) for {num_classes} classes "
                f"(at rows that are not padding); got values in [{kept.min()}, {kept.max()}]."
            )
    alpha = check_alpha(alpha, logits.shape[:-1], name)

    in_dtype = logits.dtype
    theta = logits.astype(compute_dtype(in_dtype))
    if where is not None:
        # Padding rows become all-zero logits, so nothing NaN reaches the masked-out gradient.
        theta = jnp.where(where[..., None], theta, 0.0)
    # p enters as a constant (Danskin), so no derivative, forward or reverse, reaches entmax.
    if isinstance(alpha, float):
        alpha_rows, eps_rows = alpha, alpha - 1.0  # α - 1 in python float64
        p = entmax(jax.lax.stop_gradient(theta), alpha)
    else:
        alpha_rows = jnp.broadcast_to(jnp.asarray(alpha, theta.dtype), labels.shape)
        eps_rows = (alpha_rows - 1.0)[..., None]
        p = entmax(jax.lax.stop_gradient(theta), jax.lax.stop_gradient(alpha_rows))
    row_max = jnp.max(theta, axis=-1, keepdims=True)
    theta = theta - jax.lax.stop_gradient(jnp.where(row_max == -jnp.inf, 0.0, row_max))
    support = p > 0.0
    inner = jnp.sum(jnp.where(support, p * theta, 0.0), axis=-1)
    # A label out of [0, num_classes) (possible only when traced) makes its row's loss NaN: a
    # wrapped or filled gather would give a plausible value instead.
    bad_label = (labels < 0) | (labels >= num_classes)
    if where is not None:
        bad_label = bad_label & where
    debug_check(
        ~jnp.any(bad_label),
        f"{name}: every label must lie in [0, {num_classes}); got {{}}",
        labels.reshape(-1)[jnp.argmax(bad_label.reshape(-1))],
    )
    safe_labels = jnp.where(bad_label, 0, labels).astype(jnp.int32)
    theta_label = jnp.take_along_axis(theta, safe_labels[..., None], axis=-1)[..., 0]
    # H_α(p) = (1 - Σ p^α) / (α (α-1)) = -Σ p log p · φ((α-1) log p) / α with φ(a) = expm1(a)/a
    # (using Σ p = 1): no 1/(α-1) left, so it tends to the Shannon entropy as α -> 1 instead of
    # dividing float rounding by α - 1.
    log_p = jnp.log(jnp.where(support, p, 1.0))
    weighted = jnp.where(support, p * log_p * _expm1_ratio(eps_rows * log_p), 0.0)
    tsallis = -jnp.sum(weighted, axis=-1) / alpha_rows
    # A -inf logit at the label: +inf (the label has probability 0), gradient p - onehot.
    loss = inner - theta_label + tsallis
    # A Fenchel–Young loss is >= 0; rounding can leave -1e-7 near a one-hot p. The value is
    # clamped, the gradient (p - onehot) is kept (and +inf stays +inf).
    loss = loss + jax.lax.stop_gradient(jnp.maximum(-loss, 0.0))
    # NaN (with a zero gradient, as training.cross_entropy_loss) for a bad label or a NaN row
    # of p (an α that breaks the rule; the sums above skip p's NaN entries as off the support).
    loss = jnp.where(bad_label | jnp.isnan(p[..., 0]), jnp.nan, loss)
    if where is not None:
        loss = jnp.where(where, loss, 0.0)
    return loss.astype(in_dtype)


# Σ_k a^k / (k+1)! for k = 0..10: φ(a) = expm1(a) / a to float64 rounding for |a| < 1/2.
_PHI_COEFFICIENTS = tuple(1.0 / math.factorial(k + 1) for k in range(11))


def _expm1_ratio(a):
    """φ(a) = expm1(a) / a (φ(0) = 1), accurate and smoothly differentiable near 0."""
    small = jnp.abs(a) < 0.5
    a_small = jnp.where(small, a, 0.0)
    series = jnp.zeros_like(a_small) + _PHI_COEFFICIENTS[-1]
    for c in reversed(_PHI_COEFFICIENTS[:-1]):
        series = series * a_small + c
    a_large = jnp.where(small, 1.0, a)
    return jnp.where(small, series, jnp.expm1(a_large) / a_large)


def sparsemax_loss(logits, labels, *, where=None) -> jax.Array:
    """Multiclass sparsemax loss (the Fenchel–Young loss of sparsemax) over the last axis.

    Not ``optax.losses.sparsemax_loss``, which is the *binary* loss of ``sparse_sigmoid``; this
    one equals ``optax.losses.multiclass_sparsemax_loss`` and adds a padding mask:
    ``loss = <p, θ> - θ_y + (1 - ||p||²) / 2`` with ``p = sparsemax(θ)``; its gradient is
    ``p - onehot(y)``.

    Args:
      logits: ``[..., num_classes]`` float scores.
      labels: ``[...]`` integer class indices in ``[0, num_classes)``. Out of range at a row
        that is not padding: a ``ValueError`` naming ``labels`` when concrete; when traced
        (under ``jit``), that row's loss is NaN with a zero gradient (never a wrapped or
        clipped label; as :func:`sparse_jax.training.losses.cross_entropy_loss`), and with
        :func:`~sparse_jax.normalizers.enable_traced_checks` ``jax.experimental.checkify``
        reports it as an error.
      where: optional ``[...]`` boolean; False entries (padding) get loss 0 and zero gradient,
        whatever their label (e.g. -100).

    Returns:
      Per-example losses ``[...]`` (no reduction), in the logits' dtype: ``+inf`` where the
      label's logit is ``-inf`` (the label has probability 0; the gradient stays
      ``p - onehot(y)``), NaN for a NaN logit in a row that is not padding.

    Example:
      >>> print(np.asarray(sparsemax_loss(jnp.array([[2.0, 0.0, -1.0]]), jnp.array([0]))))
      [0.]
    """
    return _fenchel_young_loss(logits, labels, 2.0, where, "sparsemax_loss")


def entmax15_loss(logits, labels, *, where=None) -> jax.Array:
    """Multiclass 1.5-entmax Fenchel–Young loss over the last axis; gradient ``p - onehot(y)``.

    ``loss = <p, θ> - θ_y + (1 - Σ p^1.5) / 0.75`` with ``p = entmax15(θ)``. Arguments and
    return value as :func:`sparsemax_loss`.

    Example:
      >>> print(np.asarray(entmax15_loss(jnp.array([[0.0, 0.0]]), jnp.array([1]))).round(4))
      [0.3905]
    """
    return _fenchel_young_loss(logits, labels, 1.5, where, "entmax15_loss")


def entmax_loss(logits, labels, alpha, *, where=None) -> jax.Array:
    """Multiclass α-entmax Fenchel–Young loss over the last axis, differentiable in ``alpha``.

    ``loss = <p, θ> - θ_y + (1 - Σ p^α) / (α (α - 1))`` with ``p = entmax(θ, α)``; gradient
    ``p - onehot(y)`` in the logits. ``alpha``: a float >= 1 or an array broadcastable to
    ``labels``' shape, under :func:`~sparse_jax.normalizers.entmax`'s rule for α (α = 1 is
    softmax, where the loss is the cross-entropy; a traced α < 1 or non-finite gives NaN
    rows). Other arguments as :func:`sparsemax_loss`.

    Example:
      >>> print(np.asarray(entmax_loss(jnp.array([[0.0, 0.0]]), jnp.array([1]), 2.0)))
      [0.25]
    """
    return _fenchel_young_loss(logits, labels, alpha, where, "entmax_loss")
