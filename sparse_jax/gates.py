"""Learned gates and sparsity penalties: sigmoid gates with a straight-through estimator, Hard
Concrete (L0) gates, L1/L0 penalties and a CoFi-style Lagrangian for a target sparsity.

A *gate* is a number in [0, 1] that multiplies a unit of the model: an attention head, an FFN
unit (a column of the intermediate layer), a whole layer, or the weight of one candidate mask in
a learned mixture of masks (CANDS). Every gate here is an elementwise function of a real
parameter array (logits ``z`` or ``log_alpha``) and returns an array of that parameter's shape,
so a gate per head is a ``[layers, heads]`` parameter and its gate is ``[layers, heads]`` too.

* ``sigmoid_gate``: ``M = sigmoid(z / T)``. With ``straight_through=True`` the forward value is
  the hard gate ``1[M > threshold]`` and the backward pass is the sigmoid's (the straight-through
  estimator, Bengio et al., 2013). Pair it with :func:`l1_penalty` ``(from_logits=True)``, i.e.
  ``λ Σ sigmoid(z)``.
* ``hard_concrete``: the stretched and clipped binary Concrete gate of Louizos, Welling & Kingma
  (2018), "Learning Sparse Neural Networks through L0 Regularization". Sampled gates are exactly 0
  or exactly 1 with positive probability and are differentiable in ``log_alpha``
  (reparameterised); :func:`expected_l0` is the probability that a gate is non-zero, whose sum
  (:func:`l0_penalty`) is a differentiable expected L0 norm.
* ``reviving_sparsemax``: a choice among candidates (e.g. the masks of one head) as the
  ``sparsemax`` of their logits, with a backward pass that lets a dropped candidate come back
  when the loss would gain from it (sparsemax's own gradient is exactly zero outside its support,
  so a candidate dropped early stays dropped).
* ``expected_sparsity`` / ``lagrangian_sparsity`` / ``sparsity_schedule``: the constrained
  formulation of CoFi (Xia, Zhong & Chen, 2022, "Structured Pruning Learns Compact and Accurate
  Models"): instead of tuning λ in ``loss + λ L0``, the expected fraction of removed units is
  driven to a target (warmed up linearly from 0) by a Lagrangian whose multipliers are trained by
  gradient *ascent*.

Conventions: every function is pure, jittable and vmappable; gate parameters must have a floating
dtype (integer arrays raise ``TypeError``); float16/bfloat16 inputs are computed in float32 and the
elementwise functions (``sigmoid_gate``, ``hard_concrete``, ``expected_l0``) return the input's
shape and dtype, while the reductions (penalties, ``expected_sparsity``, the Lagrangian) return
float32 (float64 for float64 inputs). Hyperparameters (``beta``, ``gamma``, ``zeta``,
``temperature``, ``threshold``, ``target``) are checked when they are concrete numbers; a traced
value (e.g. a temperature annealed inside a jitted step) is used unchecked.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.normalizers import sparsemax

__all__ = [
    "expected_l0",
    "expected_sparsity",
    "hard_concrete",
    "l0_penalty",
    "l1_penalty",
    "lagrangian_sparsity",
    "reviving_sparsemax",
    "sigmoid_gate",
    "sparsity_schedule",
]

# Hard Concrete defaults of Louizos et al. (2018), also used by CoFi: temperature β = 2/3 and the
# stretch interval (γ, ζ) = (-0.1, 1.1).
_BETA = 2.0 / 3.0
_GAMMA = -0.1
_ZETA = 1.1

# Uniform noise is drawn from [eps, 1 - eps] so that log(u) - log(1 - u) stays finite (|.| <= 13.9).
_UNIFORM_EPS = 1e-6

_REDUCTIONS = ("sum", "mean")


# --------------------------------------------------------------------------------------------
# Argument checking.
# --------------------------------------------------------------------------------------------


def _compute_dtype(dtype) -> jnp.dtype:
    """float64 stays float64 (with x64 enabled); every other float computes in float32."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _describe(value) -> str:
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return f"{type(value).__name__} with dtype {dtype} and shape {np.shape(value)}"
    return f"{value!r} ({type(value).__name__})"


def _check_float(x, name: str, arg: str) -> jax.Array:
    """A jax array with a floating dtype (python floats are accepted; ints/bools are not)."""
    try:
        x = jnp.asarray(x)
    except TypeError:
        raise TypeError(f"{name}: `{arg}` must be a float array; got {_describe(x)}.") from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{name}: `{arg}` must have a floating dtype (float32, float16, bfloat16, float64); "
            f"got dtype {x.dtype}. Cast it first, e.g. `{arg}.astype(jnp.float32)`."
        )
    return x


def _check_float_leaves(tree, name: str, arg: str) -> list[jax.Array]:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(
            f"{name}: `{arg}` must be an array or a non-empty pytree of arrays; got {tree!r}."
        )
    if len(leaves) == 1:
        return [_check_float(leaves[0], name, arg)]
    # Leaves are named by their index in jax.tree.leaves order.
    return [_check_float(leaf, name, f"{arg}[{i}]") for i, leaf in enumerate(leaves)]


def _check_scalar(value, name: str, arg: str, ok, allowed: str):
    """A concrete real scalar satisfying ``ok`` (returned as a python float), or a tracer."""
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: `{arg}` must be a real number; got {value!r}.")
    if isinstance(value, numbers.Real):
        v = float(value)
    else:
        dtype = getattr(value, "dtype", None)
        if (
            dtype is None
            or np.ndim(value) != 0
            or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
        ):
            raise TypeError(
                f"{name}: `{arg}` must be a real scalar (a python float or a 0-d array); "
                f"got {_describe(value)}."
            )
        v = float(np.asarray(value))
    if not ok(v):  # NaN fails every condition
        raise ValueError(f"{name}: `{arg}` must be {allowed}; got {v!r}.")
    return v


def _check_stretch(beta, gamma, zeta, name: str):
    beta = _check_scalar(beta, name, "beta", lambda v: v > 0.0, "> 0 (the Concrete temperature)")
    gamma = _check_scalar(gamma, name, "gamma", lambda v: v < 0.0, "< 0 (the stretch's low end)")
    zeta = _check_scalar(zeta, name, "zeta", lambda v: v > 1.0, "> 1 (the stretch's high end)")
    return beta, gamma, zeta


def _check_reduction(reduction, name: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: `reduction` must be one of {_REDUCTIONS}; got {reduction!r}.")
    return reduction


def _check_rng(rng, name: str) -> jax.Array:
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if rng.ndim != 0:
            raise ValueError(
                f"{name}: `rng` must be a single PRNG key; got a key array of shape {rng.shape}. "
                "For many independent draws pass `sample_shape`, or vmap over "
                "`jax.random.split(rng, n)`."
            )
        return rng
    if dtype is not None and dtype == np.uint32 and np.ndim(rng) == 1:
        return jnp.asarray(rng)  # a legacy raw key, e.g. jax.random.PRNGKey(0)
    raise TypeError(
        f"{name}: `rng` must be a JAX PRNG key (`jax.random.key(seed)`, or a legacy uint32 key "
        f"from `jax.random.PRNGKey(seed)`), or None for the deterministic gate; "
        f"got {_describe(rng)}."
    )


def _check_sample_shape(sample_shape, name: str) -> tuple[int, ...]:
    if isinstance(sample_shape, numbers.Integral) and not isinstance(sample_shape, bool):
        sample_shape = (sample_shape,)
    if not isinstance(sample_shape, (tuple, list)) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in sample_shape
    ):
        raise ValueError(
            f"{name}: `sample_shape` must be a tuple of non-negative ints; got {sample_shape!r}."
        )
    return tuple(int(d) for d in sample_shape)


def _leaf_compute_dtype(leaves) -> jnp.dtype:
    return _compute_dtype(jnp.result_type(*[leaf.dtype for leaf in leaves]))


# --------------------------------------------------------------------------------------------
# Gates.
# --------------------------------------------------------------------------------------------


def sigmoid_gate(z, *, straight_through: bool = False, threshold=0.5, temperature=1.0) -> jax.Array:
    """Sigmoid gate ``M = sigmoid(z / temperature)``, optionally hard in the forward pass.

    With ``straight_through=True`` the forward value is the hard gate ``1[M > threshold]``
    (exactly 1.0 or 0.0; strict, so ``z = 0`` with the default threshold gives 0) and the
    gradient is that of the soft gate, ``M (1 - M) / temperature`` (the straight-through
    estimator ``hard + (soft - stop_gradient(soft))``). The hard gate is decided in logit space,
    ``z / temperature > log(threshold / (1 - threshold))``, so it does not depend on float
    rounding of a saturated sigmoid. A lower temperature sharpens the soft gate.

    Args:
      z: gate logits of any float dtype and shape, e.g. one per head ``[layers, heads]``.
      straight_through: hard forward value with the sigmoid's gradient.
      threshold: the hard gate's threshold on ``M``, in (0, 1).
      temperature: > 0; divides the logits.

    Returns:
      Gates with the shape and dtype of ``z``.

    Example:
      >>> z = jnp.array([-2.0, 0.0, 3.0])
      >>> print(np.asarray(sigmoid_gate(z)).round(4))
      [0.1192 0.5    0.9526]
      >>> print(np.asarray(sigmoid_gate(z, straight_through=True)))
      [0. 0. 1.]
      >>> grad = jax.grad(lambda z: sigmoid_gate(z, straight_through=True).sum())(z)
      >>> print(np.asarray(grad).round(4))  # sigmoid'(z)
      [0.105  0.25   0.0452]
    """
    name = "sigmoid_gate"
    z = _check_float(z, name, "z")
    if not isinstance(straight_through, (bool, np.bool_)):
        raise TypeError(
            f"{name}: `straight_through` must be a bool; got {_describe(straight_through)}."
        )
    threshold = _check_scalar(threshold, name, "threshold", lambda v: 0.0 < v < 1.0, "in (0, 1)")
    temperature = _check_scalar(temperature, name, "temperature", lambda v: v > 0.0, "> 0")
    in_dtype = z.dtype
    x = z.astype(_compute_dtype(in_dtype)) / temperature
    soft = jax.nn.sigmoid(x)
    if not straight_through:
        return soft.astype(in_dtype)
    if isinstance(threshold, float):
        logit = math.log(threshold) - math.log1p(-threshold)  # exactly 0 for 0.5
    else:
        logit = jnp.log(threshold) - jnp.log1p(-threshold)
    hard = (x > logit).astype(x.dtype)
    # soft - stop_gradient(soft) is exactly 0 in the forward pass and carries soft's gradient.
    return (hard + (soft - jax.lax.stop_gradient(soft))).astype(in_dtype)


@jax.custom_vjp
def _reviving_sparsemax_rows(z):
    return sparsemax(z, axis=-1)


def _reviving_sparsemax_fwd(z):
    p = sparsemax(z, axis=-1)
    return p, p


def _reviving_sparsemax_bwd(p, g):
    kept = (p > 0).astype(g.dtype)
    # sparsemax's Jacobian-vector product: g minus its mean over the support, on the support.
    centred = g - jnp.sum(g * kept, -1, keepdims=True) / jnp.sum(kept, -1, keepdims=True)
    # Off the support: the descent direction only where raising the logit would lower the loss.
    return (kept * centred + (1 - kept) * jnp.minimum(centred, 0.0),)


_reviving_sparsemax_rows.defvjp(_reviving_sparsemax_fwd, _reviving_sparsemax_bwd)


def reviving_sparsemax(logits, *, axis: int = -1) -> jax.Array:
    """``sparsemax(logits)`` along ``axis``, with a backward pass that can revive candidates.

    The forward value is exactly :func:`sparse_jax.normalizers.sparsemax`: a distribution over
    the candidates with exact zeros. Its true gradient is zero for every logit outside the
    support ``S`` (a dropped candidate's logit moves no weight), so a candidate that falls out of
    ``S`` early in training never returns, however much the loss would gain from it. Here the
    cotangent ``g`` of the weights becomes, per row, ``g_i - mean_S(g)`` on ``S`` (sparsemax's own
    vector-Jacobian product) and ``min(g_i - mean_S(g), 0)`` off ``S``: ``g_i - mean_S(g)`` is the
    loss's derivative along moving weight onto candidate ``i`` from the support, so a dropped
    logit is pushed up exactly when that move would lower the loss, and left alone otherwise. It
    is a surrogate gradient (like the straight-through estimator of :func:`sigmoid_gate`), meant
    for choosing among a few candidates per row, e.g. a head's candidate masks ``[heads, C]``.

    Args:
      logits: float array of any shape, e.g. ``[heads, candidates]``.
      axis: the axis the distribution runs along.

    Returns:
      Weights with the shape and dtype of ``logits``, each row summing to 1.

    Example:
      >>> z = jnp.array([2.0, 0.5, -1.0])
      >>> print(np.asarray(reviving_sparsemax(z)))  # candidate 2 is outside the support
      [1. 0. 0.]
      >>> loss = lambda z: -reviving_sparsemax(z)[2]  # the loss gains from candidate 2
      >>> print(np.asarray(jax.grad(loss)(z)))  # its logit is pushed up (sparsemax's: 0)
      [ 0.  0. -1.]
    """
    name = "reviving_sparsemax"
    logits = _check_float(logits, name, "logits")
    if logits.ndim == 0:
        raise ValueError(f"{name}: `logits` must have at least one axis; got a scalar.")
    if not isinstance(axis, numbers.Integral) or not -logits.ndim <= axis < logits.ndim:
        raise ValueError(
            f"{name}: `axis` must be an int in [{-logits.ndim}, {logits.ndim - 1}] for logits of "
            f"shape {logits.shape}; got {axis!r}."
        )
    z = jnp.moveaxis(logits.astype(_compute_dtype(logits.dtype)), axis, -1)
    return jnp.moveaxis(_reviving_sparsemax_rows(z), -1, axis).astype(logits.dtype)


def hard_concrete(
    log_alpha,
    rng=None,
    *,
    beta=_BETA,
    gamma=_GAMMA,
    zeta=_ZETA,
    sample_shape=(),
) -> jax.Array:
    """Hard Concrete gate of Louizos, Welling & Kingma (2018): a sample, or the test-time gate.

    With a key (training): draw ``u ~ U(eps, 1 - eps)`` (eps = 1e-6) and return

        s = sigmoid((log u - log(1 - u) + log_alpha) / beta),
        gate = min(1, max(0, s (zeta - gamma) + gamma)),

    a reparameterised sample, differentiable in ``log_alpha`` (the gradient is zero where the
    gate is clipped). The stretch to (gamma, zeta) ⊃ [0, 1] followed by the clip gives mass to
    exactly 0 (probability ``1 - expected_l0(log_alpha)``) and exactly 1.

    Without a key (evaluation / deterministic mode), the paper's test-time estimator

        gate = min(1, max(0, sigmoid(log_alpha) (zeta - gamma) + gamma)),

    which uses no randomness and does not depend on ``beta``.

    Args:
      log_alpha: gate parameters (log α, the location) of any float dtype and shape, e.g. one
        per FFN unit ``[layers, d_ff]``.
      rng: a JAX PRNG key: new-style ``jax.random.key(seed)`` or a legacy uint32
        ``jax.random.PRNGKey(seed)``; ``None`` for the deterministic gate. One key draws
        independent noise for every entry; vmap over ``jax.random.split(rng, n)`` for batches.
      beta: the Concrete temperature, > 0 (default 2/3).
      gamma: low end of the stretch interval, < 0 (default -0.1).
      zeta: high end of the stretch interval, > 1 (default 1.1).
      sample_shape: leading shape of independent draws (needs ``rng``); the result then has
        shape ``(*sample_shape, *log_alpha.shape)``.

    Returns:
      Gates in [0, 1] with the dtype of ``log_alpha`` and shape
      ``(*sample_shape, *log_alpha.shape)`` (the shape of ``log_alpha`` by default).

    Example:
      >>> log_alpha = jnp.array([-3.0, 0.0, 3.0])
      >>> print(np.asarray(hard_concrete(log_alpha)))
      [0.  0.5 1. ]
      >>> g = hard_concrete(log_alpha, jax.random.key(0), sample_shape=(1000,))
      >>> g.shape, bool(((g >= 0) & (g <= 1)).all())
      ((1000, 3), True)
    """
    name = "hard_concrete"
    log_alpha = _check_float(log_alpha, name, "log_alpha")
    if rng is not None:
        rng = _check_rng(rng, name)
    beta, gamma, zeta = _check_stretch(beta, gamma, zeta, name)
    sample_shape = _check_sample_shape(sample_shape, name)
    if rng is None and sample_shape:
        raise ValueError(
            f"{name}: `sample_shape`={sample_shape} draws samples and needs `rng`; the "
            "deterministic gate (rng=None) takes no `sample_shape`."
        )
    in_dtype = log_alpha.dtype
    la = log_alpha.astype(_compute_dtype(in_dtype))
    if rng is None:
        s = jax.nn.sigmoid(la)
    else:
        u = jax.random.uniform(
            rng, sample_shape + la.shape, la.dtype, _UNIFORM_EPS, 1.0 - _UNIFORM_EPS
        )
        s = jax.nn.sigmoid((jnp.log(u) - jnp.log1p(-u) + la) / beta)
    return jnp.clip(s * (zeta - gamma) + gamma, 0.0, 1.0).astype(in_dtype)


def _p_nonzero(la, beta, gamma, zeta):
    """P(gate != 0) for log_alpha ``la`` already in its compute dtype."""
    return jax.nn.sigmoid(la - beta * jnp.log(jnp.asarray(-gamma / zeta, la.dtype)))


def expected_l0(log_alpha, *, beta=_BETA, gamma=_GAMMA, zeta=_ZETA) -> jax.Array:
    """Probability that a Hard Concrete gate is non-zero, elementwise.

    ``P(gate != 0) = sigmoid(log_alpha - beta log(-gamma / zeta))`` (Louizos et al., 2018,
    eq. 12); its sum is the expected L0 norm (:func:`l0_penalty`). With the defaults,
    ``log_alpha = 0`` gives ``sigmoid((2/3) log 11) ≈ 0.832``.

    Args:
      log_alpha: gate parameters of any float dtype and shape.
      beta, gamma, zeta: as in :func:`hard_concrete`.

    Returns:
      Probabilities with the shape and dtype of ``log_alpha``.

    Example:
      >>> print(np.asarray(expected_l0(jnp.array([-2.0, 0.0, 2.0]))).round(4))
      [0.401  0.8318 0.9734]
    """
    name = "expected_l0"
    log_alpha = _check_float(log_alpha, name, "log_alpha")
    beta, gamma, zeta = _check_stretch(beta, gamma, zeta, name)
    in_dtype = log_alpha.dtype
    return _p_nonzero(log_alpha.astype(_compute_dtype(in_dtype)), beta, gamma, zeta).astype(
        in_dtype
    )


# --------------------------------------------------------------------------------------------
# Penalties.
# --------------------------------------------------------------------------------------------


def _reduce(values, count: int, reduction: str, name: str):
    total = sum(jnp.sum(v) for v in values)
    if reduction == "sum":
        return total
    if count == 0:
        raise ValueError(f"{name}: reduction='mean' over zero entries (every array is empty).")
    return total / count


def l1_penalty(weights_or_logits, *, from_logits: bool, reduction: str = "sum") -> jax.Array:
    """L1 penalty: ``Σ sigmoid(z)`` for gate logits, or ``Σ |w|`` for weights.

    ``from_logits=True`` is the penalty of sigmoid gates and of the candidate-mask weights of a
    learned mixture of masks (CANDS): ``λ Σ sigmoid(z)`` with the λ applied by the caller. The
    gate values are non-negative, so this is their L1 norm. ``from_logits=False`` is the plain
    L1 norm of the entries. ``from_logits`` has no default so that logits are never penalised
    as weights by mistake.

    Args:
      weights_or_logits: a float array, or a pytree of float arrays (e.g. one per layer); the
        reduction runs over every entry of every leaf.
      from_logits: the entries are logits ``z`` (penalise ``sigmoid(z)``) or values (``|w|``).
      reduction: ``"sum"`` or ``"mean"`` (over all entries).

    Returns:
      A scalar in float32 (float64 for float64 inputs).

    Example:
      >>> print(float(l1_penalty(jnp.array([0.0, 0.0]), from_logits=True)))
      1.0
      >>> print(float(l1_penalty(jnp.array([-1.5, 2.0]), from_logits=False, reduction="mean")))
      1.75
    """
    name = "l1_penalty"
    leaves = _check_float_leaves(weights_or_logits, name, "weights_or_logits")
    if not isinstance(from_logits, (bool, np.bool_)):
        raise TypeError(f"{name}: `from_logits` must be a bool; got {_describe(from_logits)}.")
    _check_reduction(reduction, name)
    dtype = _leaf_compute_dtype(leaves)
    f = jax.nn.sigmoid if from_logits else jnp.abs
    values = [f(leaf.astype(dtype)) for leaf in leaves]
    return _reduce(values, sum(leaf.size for leaf in leaves), reduction, name)


def l0_penalty(
    log_alpha, *, beta=_BETA, gamma=_GAMMA, zeta=_ZETA, reduction: str = "sum"
) -> jax.Array:
    """Expected L0 norm of Hard Concrete gates: ``Σ expected_l0(log_alpha)``.

    The expected number of non-zero gates (``reduction="sum"``) or their expected fraction
    (``"mean"``); differentiable in ``log_alpha``.

    Args:
      log_alpha: a float array or a pytree of float arrays (e.g. one per layer).
      beta, gamma, zeta: as in :func:`hard_concrete`.
      reduction: ``"sum"`` or ``"mean"`` (over all entries of all leaves).

    Returns:
      A scalar in float32 (float64 for float64 inputs).

    Example:
      >>> print(round(float(l0_penalty(jnp.zeros(10))), 2))
      8.32
    """
    name = "l0_penalty"
    leaves = _check_float_leaves(log_alpha, name, "log_alpha")
    beta, gamma, zeta = _check_stretch(beta, gamma, zeta, name)
    _check_reduction(reduction, name)
    dtype = _leaf_compute_dtype(leaves)
    values = [_p_nonzero(leaf.astype(dtype), beta, gamma, zeta) for leaf in leaves]
    return _reduce(values, sum(leaf.size for leaf in leaves), reduction, name)


# --------------------------------------------------------------------------------------------
# Target sparsity (CoFi).
# --------------------------------------------------------------------------------------------


def expected_sparsity(
    log_alpha, weights=None, *, beta=_BETA, gamma=_GAMMA, zeta=_ZETA
) -> jax.Array:
    """Expected fraction of removed units: ``1 - Σ w P(gate != 0) / Σ w``.

    With ``weights=None`` every gate counts once, so this is ``1 - mean(expected_l0)`` over all
    gates. Weights make it the expected fraction of removed *parameters*, as in CoFi: weight a
    head gate by its parameter count (``4 d_model d_head``) and an FFN-unit gate by its own
    (``2 d_model``). Hierarchical gates (a layer gate times unit gates, as in CoFi) are not
    modelled here: combine their probabilities yourself.

    Args:
      log_alpha: a float array, or a pytree (list, tuple, dict) of float arrays.
      weights: ``None``, or a pytree with the same structure as ``log_alpha`` whose leaves are
        non-negative real numbers or arrays broadcastable to the matching ``log_alpha`` leaf
        (e.g. one size per array). Their total must be positive.
      beta, gamma, zeta: as in :func:`hard_concrete`.

    Returns:
      A scalar in [0, 1], float32 (float64 for float64 inputs); differentiable in ``log_alpha``.

    Example:
      >>> heads, ffn = jnp.zeros((2, 4)), jnp.full((2, 8), -10.0)
      >>> print(round(float(expected_sparsity([heads, ffn])), 3))
      0.723
      >>> print(round(float(expected_sparsity([heads, ffn], [1024.0, 0.0])), 3))
      0.168
    """
    name = "expected_sparsity"
    leaves = _check_float_leaves(log_alpha, name, "log_alpha")
    beta, gamma, zeta = _check_stretch(beta, gamma, zeta, name)
    dtype = _leaf_compute_dtype(leaves)
    if weights is None:
        weight_leaves = [None] * len(leaves)
    else:
        if jax.tree.structure(weights) != jax.tree.structure(log_alpha):
            raise ValueError(
                f"{name}: `weights` must have the same pytree structure as `log_alpha` "
                f"({jax.tree.structure(log_alpha)}); got {jax.tree.structure(weights)}."
            )
        weight_leaves = jax.tree.leaves(weights)
    kept, total = 0.0, 0.0
    concrete_total = 0.0
    for i, (leaf, w) in enumerate(zip(leaves, weight_leaves, strict=True)):
        p = _p_nonzero(leaf.astype(dtype), beta, gamma, zeta)
        if w is None:
            kept, total = kept + jnp.sum(p), total + leaf.size
            concrete_total += leaf.size
            continue
        label = "weights" if len(leaves) == 1 else f"weights[{i}]"
        if isinstance(w, (bool, np.bool_)):
            raise TypeError(f"{name}: `{label}` must be real numbers; got {w!r}.")
        w = jnp.asarray(w)
        if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer)):
            raise TypeError(f"{name}: `{label}` must be real numbers; got dtype {w.dtype}.")
        try:
            broadcast = np.broadcast_shapes(w.shape, leaf.shape)
        except ValueError:
            broadcast = None
        if broadcast != leaf.shape:
            raise ValueError(
                f"{name}: `{label}` with shape {w.shape} does not broadcast to the shape "
                f"{leaf.shape} of its `log_alpha` array."
            )
        w = jnp.broadcast_to(w.astype(dtype), leaf.shape)
        if not isinstance(w, jax.core.Tracer):
            w_np = np.asarray(w)
            if not np.all(w_np >= 0.0):
                raise ValueError(
                    f"{name}: `{label}` must be non-negative; got minimum {float(w_np.min())!r}."
                )
            concrete_total += float(w_np.sum())
        else:
            concrete_total = np.inf  # a traced weight: the total cannot be checked
        kept, total = kept + jnp.sum(w * p), total + jnp.sum(w)
    if concrete_total <= 0.0:
        raise ValueError(
            f"{name}: the total weight of the gates must be positive; got {concrete_total!r} "
            "(all `log_alpha` arrays empty, or all `weights` zero)."
        )
    return (1.0 - kept / total).astype(dtype)


def _check_operand(value, name: str, arg: str) -> jax.Array:
    """A float operand (python reals are accepted); low precision computes in float32."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return jnp.asarray(float(value), jnp.float32)
    value = _check_float(value, name, arg)
    return value.astype(_compute_dtype(value.dtype))


def lagrangian_sparsity(expected_sparsity, target, lambda1, lambda2) -> jax.Array:
    """CoFi's Lagrangian ``λ1 (s - t) + λ2 (s - t)²`` for expected sparsity ``s``, target ``t``.

    Add it to the training loss. The model parameters *minimise* the total loss, while the
    multipliers ``lambda1`` and ``lambda2`` are trained by gradient *ascent* (they maximise it),
    which drives ``s`` to ``t``: while ``s < t``, ascent moves λ1 negative, and the model then
    lowers ``λ1 s`` by raising ``s``. So negate the multipliers' gradients before a usual
    (minimising) update, or give them a flipped optimizer, e.g.
    ``optax.chain(optax.adam(lr), optax.scale(-1.0))``. Initialise both at 0.

    ``∂/∂λ1 = s - t`` and ``∂/∂λ2 = (s - t)²``.

    Args:
      expected_sparsity: the expected sparsity ``s``, e.g. from :func:`expected_sparsity`.
      target: the target sparsity ``t`` in [0, 1], e.g. from :func:`sparsity_schedule`.
      lambda1: the linear multiplier (a trained float scalar).
      lambda2: the quadratic multiplier (a trained float scalar).

    Returns:
      The term, broadcast over the arguments (a scalar for scalars), float32 (float64 for
      float64 inputs).

    Example:
      >>> print(round(float(lagrangian_sparsity(0.3, 0.5, -1.0, 2.0)), 4))
      0.28
    """
    name = "lagrangian_sparsity"
    s = _check_operand(expected_sparsity, name, "expected_sparsity")
    t = _check_operand(target, name, "target")
    if not isinstance(t, jax.core.Tracer):
        t_np = np.asarray(t)
        if not np.all((t_np >= 0.0) & (t_np <= 1.0)):  # NaN fails too
            raise ValueError(f"{name}: `target` must lie in [0, 1]; got {t_np.tolist()!r}.")
    l1 = _check_operand(lambda1, name, "lambda1")
    l2 = _check_operand(lambda2, name, "lambda2")
    gap = s - t
    return l1 * gap + l2 * gap * gap


def sparsity_schedule(step, *, target, warmup_steps: int, initial=0.0) -> jax.Array:
    """Target sparsity at ``step``, warmed up linearly from ``initial`` to ``target`` (CoFi).

    ``initial + (target - initial) min(1, max(0, step / warmup_steps))``; ``warmup_steps = 0``
    gives ``target`` at once. Jittable in ``step`` (an int or a traced array), and an
    optax-style schedule once the keywords are bound:
    ``functools.partial(sparsity_schedule, target=0.9, warmup_steps=1000)``.

    Args:
      step: the training step (int or array of ints/floats).
      target: the final target sparsity, in [0, 1].
      warmup_steps: the number of steps of the linear warm-up, an int >= 0.
      initial: the target sparsity at step 0, in [0, 1].

    Returns:
      float32 array of ``step``'s shape.

    Example:
      >>> print(np.asarray(sparsity_schedule(jnp.array([0, 50, 100, 200]), target=0.6,
      ...                                    warmup_steps=100)))
      [0.  0.3 0.6 0.6]
    """
    name = "sparsity_schedule"
    target = _check_scalar(target, name, "target", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
    initial = _check_scalar(initial, name, "initial", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
    if (
        isinstance(warmup_steps, bool)
        or not isinstance(warmup_steps, numbers.Integral)
        or warmup_steps < 0
    ):
        raise ValueError(f"{name}: `warmup_steps` must be an int >= 0; got {warmup_steps!r}.")
    if isinstance(step, (bool, np.bool_)):
        raise TypeError(f"{name}: `step` must be a number or an array; got {step!r}.")
    step = jnp.asarray(step)
    if not (jnp.issubdtype(step.dtype, jnp.integer) or jnp.issubdtype(step.dtype, jnp.floating)):
        raise TypeError(f"{name}: `step` must be an int or float array; got dtype {step.dtype}.")
    step = step.astype(jnp.float32)
    if warmup_steps == 0:
        fraction = jnp.ones_like(step)
    else:
        fraction = jnp.clip(step / warmup_steps, 0.0, 1.0)
    return (initial + (target - initial) * fraction).astype(jnp.float32)
