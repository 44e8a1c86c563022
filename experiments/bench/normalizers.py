"""``python -m experiments.bench normalizers``: a normalizer alone on ``[batch, heads, n, n]``
scores, and inside whole attention, forward and forward+backward, with ratios to
``jax.nn.softmax`` measured in the same run."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from optax.projections import projection_simplex

import sparse_jax
from experiments.common import timing


def _fmt_ratio(value: float, reference: float | None) -> str:
    return "–" if reference is None else f"{value / reference:.2f}x"


NormalizerName = Literal["softmax", "sparsemax", "entmax15", "entmax", "projection_simplex"]
_ALL_NORMALIZERS: tuple[NormalizerName, ...] = (
    "softmax",
    "sparsemax",
    "entmax15",
    "entmax",
    "projection_simplex",
)


@dataclasses.dataclass(frozen=True)
class NormalizersConfig(timing.TimingFlags):
    """Times normalizers alone on [batch, heads, n, n] scores (a) and inside whole attention
    (b), forward and forward+backward, with ratios to jax.nn.softmax measured in the same run."""

    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    """Sequence lengths n (queries = keys = n)."""
    batch: int = 1
    """Batch size."""
    heads: int = 8
    """Number of attention heads."""
    head_dim: int = 64
    """Size of each head (q, k, v are [batch, n, heads, head_dim]); scores are scaled by
    head_dim**-0.5."""
    which: tuple[NormalizerName, ...] = _ALL_NORMALIZERS
    """Normalizers to time: jax.nn.softmax, sparse_jax.sparsemax, sparse_jax.entmax15,
    sparse_jax.entmax with alpha=--entmax-alpha, and optax.projections.projection_simplex
    vmapped over rows. Ratios are to softmax when it is included."""
    entmax_alpha: float = 1.3
    """The alpha of the 'entmax' row (>= 1; 1 is softmax, through entmax's general path)."""
    entmax_alpha_per_head: bool = False
    """Give the 'entmax' row its alpha as an array of one alpha per head, [heads, 1], that the
    program cannot fold into a constant: how a learned alpha reaches it (a python float
    otherwise)."""
    causal: bool = True
    """Apply a causal mask (key j visible from query i iff j <= i)."""
    mask_mode: Literal["neg_inf", "where"] = "neg_inf"
    """How the mask reaches softmax/sparsemax/entmax: 'neg_inf' sets masked scores to -inf with
    jnp.where and calls the normalizer without a mask; 'where' passes where=mask to it.
    projection_simplex has no mask argument and always gets a large finite negative value."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of scores, q, k, v and cotangents."""
    seed: int = 0
    """Seed of the random inputs and cotangents."""

    def __post_init__(self) -> None:
        def positive(name: str, value: int) -> None:
            if not timing.is_count(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if not self.lengths:
            raise ValueError("lengths must name at least one sequence length, got ()")
        for n in self.lengths:
            positive("each of lengths", n)
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths must not repeat, got {self.lengths!r}")
        super().__post_init__()
        timing.check_counts(self, "batch", "heads", "head_dim")
        if not self.which:
            raise ValueError(f"which must name at least one of {_ALL_NORMALIZERS}, got ()")
        unknown = [w for w in self.which if w not in _ALL_NORMALIZERS]
        if unknown or len(set(self.which)) != len(self.which):
            raise ValueError(
                f"which must be distinct names from {_ALL_NORMALIZERS}, got {self.which!r}"
            )
        if not (self.entmax_alpha >= 1 and math.isfinite(self.entmax_alpha)):
            raise ValueError(
                f"entmax_alpha must be finite and >= 1 (1 is softmax), got {self.entmax_alpha!r}"
            )
        if self.mask_mode not in ("neg_inf", "where"):
            raise ValueError(f"mask_mode must be 'neg_inf' or 'where', got {self.mask_mode!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")


# A normalizer maps (scores [..., n], mask broadcastable to scores or None) to a distribution
# over the last axis with exactly zero mass on masked positions.
Normalizer = Callable[[jax.Array, "jax.Array | None"], jax.Array]


def _label(name: NormalizerName, config: NormalizersConfig) -> str:
    if name != "entmax":
        return name
    per_head = " per head" if config.entmax_alpha_per_head else ""
    return f"entmax α={config.entmax_alpha:g}{per_head}"


def _make_normalizer(name: NormalizerName, config: NormalizersConfig) -> Normalizer:
    """Resolves a normalizer by its benchmark name."""
    if name == "projection_simplex":
        return _projection_simplex_rows
    if name == "softmax":
        fn: Callable[..., jax.Array] = jax.nn.softmax
    else:
        fn = getattr(sparse_jax, name)
        if name == "entmax" and config.entmax_alpha_per_head:

            def fn(x, axis=-1, where=None, _f=fn, _alpha=config.entmax_alpha):
                # [batch, heads, n, n] scores: one alpha per head, kept from constant folding
                alpha = jax.lax.optimization_barrier(jnp.full((x.shape[1], 1), _alpha))
                return _f(x, alpha, axis, where=where)

        elif name == "entmax":
            alpha = config.entmax_alpha
            fn = lambda x, axis=-1, where=None, _f=fn: _f(x, alpha, axis, where=where)

    if config.mask_mode == "where":
        return lambda x, mask: fn(x, axis=-1, where=mask)
    return lambda x, mask: fn(x if mask is None else jnp.where(mask, x, -jnp.inf), axis=-1)


def _projection_simplex_rows(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """optax.projections.projection_simplex(tree, scale=1) (optax 0.2.8) applied to every row.

    It takes no mask and flattens a whole pytree, so it is vmapped over all rows, and masked
    positions get the row's smallest visible score minus 1e4. That puts exactly zero mass
    there: the projection is relu(x - tau) with a threshold tau >= max(x) - 1 (the mass of the
    largest entry alone is at most 1), and every filled value is < min - 1e4 < max - 1. The
    benchmark also checks this on the smallest length (masked mass == 0, rows sum to 1).
    """
    if mask is not None:
        row_min = jnp.min(jnp.where(mask, x, jnp.inf), axis=-1, keepdims=True)
        fill = jax.lax.stop_gradient(row_min - 1e4)
        x = jnp.where(mask, x, fill)
    # In float32: with bfloat16 rows optax 0.2.8's custom JVP returns a float32 tangent for a
    # bfloat16 primal and jax rejects it.
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.promote_types(x.dtype, jnp.float32))
    return jax.vmap(projection_simplex)(rows).reshape(x.shape).astype(x.dtype)


def _causal_mask(n: int, causal: bool) -> jax.Array | None:
    """[1, 1, n, n] bool, True = may attend (built from iota inside the jitted function)."""
    if not causal:
        return None
    return (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :])[None, None]


def _normalizer_fns(norm: Normalizer, n: int, causal: bool) -> tuple[Callable, Callable]:
    """(a): normalizer alone on scores [batch, heads, n, n]."""

    def fwd(x):
        return norm(x, _causal_mask(n, causal))

    def loss(x, g):
        return jnp.sum(fwd(x).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.jit(fwd), jax.jit(jax.grad(loss))


def _attention_fns(norm: Normalizer, n: int, causal: bool) -> tuple[Callable, Callable]:
    """(b): whole attention on q, k, v [batch, n, heads, head_dim]."""

    def fwd(q, k, v):
        scale = q.shape[-1] ** -0.5
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype)
        probs = norm(scores, _causal_mask(n, causal))
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)

    def loss(q, k, v, g):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _check(name: str, config: NormalizersConfig, norm: Normalizer, n: int, key) -> list[str]:
    """Sanity checks at length n; returns notes (failures and mean support)."""
    dtype = jnp.dtype(config.dtype)
    kx, kg = jax.random.split(key)
    shape = (config.batch, config.heads, n, n)
    x = jax.random.normal(kx, shape, dtype)
    g = jax.random.normal(kg, shape, dtype)
    fwd, fwdbwd = _normalizer_fns(norm, n, config.causal)
    p = np.asarray(fwd(x), dtype=np.float32)
    grad = np.asarray(fwdbwd(x, g), dtype=np.float32)
    mask = np.ones((n, n), bool) if not config.causal else np.tril(np.ones((n, n), bool))
    tol = 1e-3 if dtype == jnp.float32 else 2e-2
    problems = []
    if not (np.isfinite(p).all() and np.isfinite(grad).all()):
        problems.append("non-finite values or gradients")
    if np.any(p[..., ~mask] != 0):
        problems.append(f"mass on masked positions (max {np.abs(p[..., ~mask]).max():.3g})")
    if np.any(p < 0):
        problems.append(f"negative probabilities (min {p.min():.3g})")
    err = np.abs(p.sum(-1) - 1).max()
    if err > tol:
        problems.append(f"rows sum to 1 only within {err:.3g}")
    support = (p > 0).sum(-1).mean()
    visible = mask.sum(-1).mean()
    if problems:
        msg = f"sanity check FAILED for {name} at n={n}: " + "; ".join(problems)
        timing.log("WARNING: " + msg)
        return [msg]
    return [
        f"{name} at n={n}: masked mass 0, rows sum to 1 (±{tol:g}); mean support "
        f"{support:.1f} of {visible:.1f} visible keys"
    ]


def run_normalizers(config: NormalizersConfig, command: str) -> str:
    """Returns the markdown for the normalizers benchmark (see NormalizersConfig)."""
    norms = {name: _make_normalizer(name, config) for name in config.which}
    dtype = jnp.dtype(config.dtype)
    b, h, d = config.batch, config.heads, config.head_dim
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)

    notes = []
    check_n = min(*config.lengths, 512)  # sanity checks run in numpy: keep them small
    for i, (name, norm) in enumerate(norms.items()):
        notes += _check(_label(name, config), config, norm, check_n, jax.random.key(1000 + i))

    results: dict[tuple[str, int], list[timing.TimingStats]] = {}
    for n in config.lengths:
        keys = jax.random.split(jax.random.key(config.seed + n), 6)
        x = jax.random.normal(keys[0], (b, h, n, n), dtype)
        gx = jax.random.normal(keys[1], (b, h, n, n), dtype)
        q, k, v, go = (jax.random.normal(kk, (b, n, h, d), dtype) for kk in keys[2:])
        for name, norm in norms.items():
            fwd_a, fwdbwd_a = _normalizer_fns(norm, n, config.causal)
            fwd_b, fwdbwd_b = _attention_fns(norm, n, config.causal)
            cells = []
            for fn, args in (
                (fwd_a, (x,)),
                (fwdbwd_a, (x, gx)),
                (fwd_b, (q, k, v)),
                (fwdbwd_b, (q, k, v, go)),
            ):
                stats = timing.time_fn(
                    fn,
                    *args,
                    repeats=config.repeats,
                    slow_s=config.slow_s,
                    budget_s=config.budget_s,
                )
                cells.append(stats)
            results[(name, n)] = cells
            timing.log(
                f"[{time.perf_counter() - start:6.0f} s] n={n} {_label(name, config)}: "
                + ", ".join(f"{s.median_ms:.1f}" for s in cells)
                + " ms"
            )

    headers = ["normalizer", "n"]
    for part in ("(a) fwd", "(a) fwd+bwd", "(b) fwd", "(b) fwd+bwd"):
        headers += [f"{part} ms", "× softmax"]
    headers += ["(b) fwd+bwd peak MiB", "compile s"]
    rows = []
    for n in config.lengths:
        ref = results.get(("softmax", n))
        for name in config.which:
            cells = results[(name, n)]
            row: list[str] = [_label(name, config), str(n)]
            for j, stats in enumerate(cells):
                ref_s = None if ref is None else ref[j].median_s
                row += [timing.format_ms(stats), _fmt_ratio(stats.median_s, ref_s)]
            peak = cells[3].peak_bytes
            row.append("–" if peak is None else f"{peak / 2**20:.0f}")
            row.append(f"{math.fsum(s.compile_s for s in cells):.1f}")
            rows.append(row)
    table = timing.markdown_table(headers, rows, align="lr" + "r" * (len(headers) - 2))

    elapsed = time.perf_counter() - start
    notes = [
        f"(a) = normalizer alone on scores [{b}, {h}, n, n]; (b) = whole attention, q, k, v "
        f"[{b}, n, {h}, {d}], {'causal' if config.causal else 'no'} mask, {config.dtype}; "
        "fwd+bwd = gradient of sum(out * g) w.r.t. the scores (a) or q, k, v (b).",
        f"{config.dagger_note()} Peak MiB = arguments + outputs + temporaries of XLA's "
        "compiled buffer assignment, not RSS.",
        f"mask_mode={config.mask_mode}; projection_simplex = optax.projections."
        "projection_simplex vmapped over rows, masked scores set to row min - 1e4.",
        *notes,
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
