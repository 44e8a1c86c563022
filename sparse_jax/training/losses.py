"""Losses for distilling a dense teacher into a sparse student: token-level KL divergences, the
language-model cross-entropy, and the weighted sum of the sparsity penalties a model returns.

Every function is pure and jittable and returns ``(loss, metrics)``: ``loss`` is a float32 scalar
to differentiate, ``metrics`` a dict of scalars to log. Token losses are averaged over the tokens
a boolean ``mask [B, T]`` keeps (True = a real token, False = padding); a fully masked batch gives
a loss of exactly 0 with finite (zero) gradients, never NaN. Logits of any float dtype are
computed in float32 (float64 stays float64).

Shapes: ``B`` batch, ``T`` tokens, ``V`` vocabulary; any number of leading axes is accepted in
place of ``[B, T]``.

Combining the terms is left to the trainer, e.g.
``distill + ce_weight * ce + sparsity_penalty(aux, weights)[0]``.

Example:
  >>> import jax.numpy as jnp
  >>> student = jnp.array([[[1.0, 2.0, 3.0]]])  # [B=1, T=1, V=3]
  >>> loss, metrics = distillation_loss(student, student)
  >>> float(loss), int(metrics["tokens"])
  (0.0, 1)
  >>> loss, _ = cross_entropy_loss(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]]))
  >>> round(float(perplexity(loss)), 4)  # uniform over 4 tokens
  4.0
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparse_jax.validation import check_choice

__all__ = [
    "DIRECTIONS",
    "KNOWN_PENALTIES",
    "cross_entropy_loss",
    "distillation_loss",
    "perplexity",
    "sparsity_penalty",
]

# The divergences `distillation_loss` computes (p = teacher, q = student, both at temperature T).
DIRECTIONS = ("forward", "reverse", "jsd")

# The penalties sparse_jax.models.GPT2(..., return_aux=True) can return (summed over blocks):
# `mask_l1` the L1 norm of learned candidate-mask weights, `mask_density` those weights priced by
# each candidate's share of the causal entries, `head_gate` / `ffn_gate` the gates' L1 /
# expected-L0 penalties.
KNOWN_PENALTIES = ("mask_l1", "mask_density", "mask_expected_density", "head_gate", "ffn_gate")


def _float(x, caller: str, arg: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{caller}: `{arg}` must be float logits; got dtype {x.dtype}")
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _token_mask(mask, shape: tuple[int, ...], caller: str) -> jax.Array | None:
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape != shape:
        raise ValueError(
            f"{caller}: `mask` must have the logits' shape without the vocabulary axis {shape}; "
            f"got {mask.shape}"
        )
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise TypeError(f"{caller}: `mask` must be boolean (True = real token); got {mask.dtype}")
    return mask.astype(bool)


def _masked_mean(per_token: jax.Array, mask: jax.Array | None):
    """Mean of ``per_token`` over the kept tokens (0 when none is kept) and the token count."""
    if mask is None:
        count = math.prod(per_token.shape)
        return jnp.mean(per_token) if count else jnp.zeros((), per_token.dtype), jnp.int32(count)
    tokens = jnp.sum(mask, dtype=jnp.int32)
    # `where` (not a product) so that whatever the padding positions hold never reaches the sum.
    total = jnp.sum(jnp.where(mask, per_token, 0.0))
    return total / jnp.maximum(tokens, 1).astype(per_token.dtype), tokens


def _kl(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """``KL(p || q) = Σ_v p (log p - log q)`` over the last axis, from log-probabilities.

    Terms with ``p = 0`` are 0 (also where ``log q = -inf``), so ``-inf`` logits (e.g. a padded
    vocabulary) give neither NaN values nor NaN gradients.
    """
    p = jnp.exp(logp)
    keep = p > 0
    diff = jnp.where(keep, logp, 0.0) - jnp.where(keep, logq, 0.0)
    return jnp.sum(jnp.where(keep, p * diff, 0.0), axis=-1)


def _half_log_ratio(d: jax.Array) -> jax.Array:
    """``softplus(d) - log 2 = log((1 + e^d) / 2)``, exactly 0 at ``d = 0`` and stable for all d.

    Written as ``max(d, 0) + log1p(expm1(-|d|) / 2)`` (``expm1`` of a non-positive number lies in
    ``(-1, 0]``), with the branch chosen by ``where`` so the derivative at 0 is the true ½.
    """
    positive = d > 0
    return jnp.where(positive, d, 0.0) + jnp.log1p(0.5 * jnp.expm1(jnp.where(positive, -d, d)))


def _jsd(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """Jensen–Shannon divergence over the last axis, from log-probabilities.

    ``½ Σ p log(p/m) + ½ Σ q log(q/m)`` with ``m = (p + q)/2``, using
    ``log(p/m) = -(softplus(log q - log p) - log 2)``: exactly 0 where ``p = q`` (a direct
    ``logaddexp(log p, log q) - log 2`` is off by rounding), and terms with ``p = 0`` (``q = 0``)
    are 0 without NaN.
    """

    def half(loga, logb):  # Σ a log(a/m)
        a = jnp.exp(loga)
        keep = a > 0
        d = jnp.where(keep, logb, 0.0) - jnp.where(keep, loga, 0.0)
        return -jnp.sum(jnp.where(keep, a * _half_log_ratio(d), 0.0), axis=-1)

    return 0.5 * (half(logp, logq) + half(logq, logp))


def _check_temperature(temperature, caller: str):
    if isinstance(temperature, jax.core.Tracer):  # traced (e.g. annealed): used unchecked
        return temperature
    if isinstance(temperature, (bool, np.bool_)) or not (
        isinstance(temperature, numbers.Real)
        or (hasattr(temperature, "dtype") and np.ndim(temperature) == 0)
    ):
        raise ValueError(f"{caller}: `temperature` must be a number > 0; got {temperature!r}")
    value = float(temperature)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{caller}: `temperature` must be a finite number > 0; got {value!r}")
    return value


def distillation_loss(
    student_logits,
    teacher_logits,
    *,
    mask=None,
    temperature: float = 1.0,
    direction: str = "forward",
):
    """Token-level KL distillation loss (Hinton et al., 2015) between teacher and student.

    With ``p = softmax(teacher_logits / T)`` and ``q = softmax(student_logits / T)`` per token:

    * ``"forward"``: ``KL(p || q)``, the classic distillation loss (mass-covering: the student
      must put probability wherever the teacher does);
    * ``"reverse"``: ``KL(q || p)`` (mode-seeking: the student may drop some of the teacher's
      modes but is punished for mass where the teacher has little);
    * ``"jsd"``: the Jensen–Shannon divergence ``½ KL(p || m) + ½ KL(q || m)`` with
      ``m = ½ (p + q)``: symmetric and bounded by ``log 2``.

    The divergence is averaged over the tokens ``mask`` keeps and the loss is scaled by ``T²`` so
    that its gradients keep their size when ``T`` changes (Hinton's correction). The reported
    ``metrics["kl"]`` is *not* scaled: it is the divergence in nats per token at temperature
    ``T`` (at ``T = 1``, the true KL between the two models' next-token distributions).

    Gradients flow into both arguments: compute the teacher's logits outside the differentiated
    function (or wrap them in ``jax.lax.stop_gradient``) to train the student only.

    Args:
      student_logits: float ``[B, T, V]`` (any leading axes).
      teacher_logits: float, the same shape.
      mask: optional bool ``[B, T]``; False tokens (padding) contribute nothing.
      temperature: ``T > 0`` applied to both logits (a traced value is used unchecked).
      direction: one of :data:`DIRECTIONS`.

    Returns:
      ``(loss, metrics)``: the float32 scalar ``T² · mean divergence`` (0 when no token is kept)
      and ``{"kl": mean divergence in nats/token at T, "tokens": kept tokens (int32)}``.

    Example:
      >>> import jax.numpy as jnp
      >>> teacher = jnp.log(jnp.array([[[0.5, 0.5]]]))
      >>> student = jnp.log(jnp.array([[[0.9, 0.1]]]))
      >>> loss, m = distillation_loss(student, teacher)  # 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1)
      >>> round(float(loss), 4), round(float(m["kl"]), 4)
      (0.5108, 0.5108)
      >>> loss, m = distillation_loss(student, teacher, temperature=2.0)
      >>> bool(jnp.isclose(loss, 4 * m["kl"]))
      True
    """
    caller = "distillation_loss"
    check_choice(direction, "direction", DIRECTIONS, caller)
    temperature = _check_temperature(temperature, caller)
    student = _float(student_logits, caller, "student_logits")
    teacher = _float(teacher_logits, caller, "teacher_logits")
    if student.ndim < 1 or student.shape != teacher.shape:
        raise ValueError(
            f"{caller}: `student_logits` {student.shape} and `teacher_logits` {teacher.shape} "
            "must have the same shape [..., vocab]"
        )
    mask = _token_mask(mask, student.shape[:-1], caller)
    dtype = jnp.promote_types(student.dtype, teacher.dtype)
    logq = jax.nn.log_softmax(student.astype(dtype) / temperature, axis=-1)
    logp = jax.nn.log_softmax(teacher.astype(dtype) / temperature, axis=-1)
    if direction == "forward":
        per_token = _kl(logp, logq)
    elif direction == "reverse":
        per_token = _kl(logq, logp)
    else:
        per_token = _jsd(logp, logq)
    kl, tokens = _masked_mean(per_token, mask)
    return kl * (temperature**2), {"kl": kl, "tokens": tokens}


def cross_entropy_loss(logits, targets, *, mask=None):
    """Mean next-token negative log-likelihood (nats/token) of integer ``targets``.

    Per token it is ``optax.losses.softmax_cross_entropy_with_integer_labels``; this function
    adds the argument checks, the token mask and the mean over kept tokens.

    Args:
      logits: float ``[B, T, V]`` (any leading axes).
      targets: int ``[B, T]``, each in ``[0, V)`` where ``mask`` is True. Targets at masked
        positions are ignored (padding ids such as -100 are fine there); an out-of-range target at
        a kept position gives a NaN loss rather than being silently clipped.
      mask: optional bool ``[B, T]``; False tokens contribute nothing.

    Returns:
      ``(loss, metrics)``: the mean NLL over kept tokens (0 when none is kept) and
      ``{"nll": the same, "accuracy": fraction of kept tokens whose argmax is the target,
      "tokens": kept tokens (int32)}``.

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.log(jnp.array([[[0.25, 0.75], [0.5, 0.5]]]))
      >>> loss, m = cross_entropy_loss(logits, jnp.array([[1, -100]]),
      ...                              mask=jnp.array([[True, False]]))
      >>> round(float(loss), 4), float(m["accuracy"]), int(m["tokens"])  # -log 0.75
      (0.2877, 1.0, 1)
    """
    caller = "cross_entropy_loss"
    logits = _float(logits, caller, "logits")
    targets = jnp.asarray(targets)
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"{caller}: `targets` must have the logits' shape without the vocabulary axis "
            f"{logits.shape[:-1]}; got {targets.shape}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"{caller}: `targets` must be integer token ids; got dtype {targets.dtype}")
    mask = _token_mask(mask, targets.shape, caller)
    vocab = logits.shape[-1]
    # Masked positions may hold any id (padding): gather a valid one there, never used.
    index = targets if mask is None else jnp.where(mask, targets, 0)
    per_token = optax.losses.softmax_cross_entropy_with_integer_labels(
        logits, jnp.clip(index, 0, vocab - 1)
    )
    # An id outside [0, V) at a kept position is loud (NaN), never clipped or wrapped around.
    per_token = jnp.where((index >= 0) & (index < vocab), per_token, jnp.nan)
    nll, tokens = _masked_mean(per_token, mask)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(logits.dtype)
    accuracy, _ = _masked_mean(correct, mask)
    return nll, {"nll": nll, "accuracy": accuracy, "tokens": tokens}


def perplexity(mean_nll):
    """``exp(mean_nll)``: the perplexity of a mean NLL in nats/token (a float or an array).

    Example:
      >>> round(float(perplexity(0.0)), 4)
      1.0
    """
    return jnp.exp(jnp.asarray(mean_nll))


def sparsity_penalty(aux: Mapping[str, jax.Array], weights: Mapping[str, float]):
    """``Σ_name λ_name · aux[name]``: the weighted sparsity penalties a model returned.

    ``aux`` is what ``GPT2(..., return_aux=True)`` returns next to the logits (a student without
    learned masks or gates returns ``{}``). Names in ``weights`` must be among ``aux``'s keys or
    :data:`KNOWN_PENALTIES`; a known penalty the model does not return may be listed with weight
    0 (so one set of flags serves every student) but not with a non-zero weight (that weight
    would silently do nothing). Penalties in ``aux`` without a weight count with weight 0.

    Args:
      aux: name -> scalar penalty.
      weights: name -> ``λ >= 0`` (python numbers; checked before anything is traced).

    Returns:
      ``(total, metrics)``: the float32 scalar sum, and every raw (unweighted) penalty of ``aux``
      under its own name plus ``"total"``.

    Raises:
      ValueError: an unknown name, a negative or non-finite weight, or a non-zero weight for a
        penalty ``aux`` lacks; the message lists the penalties ``aux`` has.

    Example:
      >>> import jax.numpy as jnp
      >>> aux = {"head_gate": jnp.float32(6.0), "ffn_gate": jnp.float32(10.0)}
      >>> total, m = sparsity_penalty(aux, {"head_gate": 0.5, "mask_l1": 0.0})
      >>> float(total), sorted(m)
      (3.0, ['ffn_gate', 'head_gate', 'total'])
    """
    caller = "sparsity_penalty"
    if not isinstance(aux, Mapping):
        raise TypeError(f"{caller}: `aux` must be a dict of penalties; got {type(aux).__name__}")
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{caller}: `weights` must be a dict name -> float; got {type(weights).__name__}"
        )
    available = sorted(aux)
    total = jnp.zeros((), jnp.float32)
    for name, weight in weights.items():
        if name not in aux and name not in KNOWN_PENALTIES:
            raise ValueError(
                f"{caller}: unknown penalty {name!r} in `weights`; the model returns "
                f"{available} (known penalties: {list(KNOWN_PENALTIES)})"
            )
        if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, numbers.Real):
            raise ValueError(f"{caller}: `weights[{name!r}]` must be a number; got {weight!r}")
        weight = float(weight)
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(
                f"{caller}: `weights[{name!r}]` must be a finite number >= 0; got {weight!r}"
            )
        if name not in aux:
            if weight != 0:
                raise ValueError(
                    f"{caller}: `weights[{name!r}]`={weight} is non-zero but the model returns no "
                    f"{name!r} penalty (it returns {available}); give the student that "
                    "mask/gate or set the weight to 0"
                )
            continue
        if weight:
            total = total + weight * jnp.asarray(aux[name], jnp.float32)
    metrics = {name: jnp.asarray(value, jnp.float32) for name, value in aux.items()}
    metrics["total"] = total
    return total, metrics
