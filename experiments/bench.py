"""Benchmarks of sparse_jax against references measured in the same run.

Each subcommand prints one markdown table to stdout (progress goes to stderr)::

    python -m experiments.bench normalizers
    python -m experiments.bench normalizers --which softmax projection_simplex --lengths 256 512
    python -m experiments.bench normalizers --help
    python -m experiments.bench attention --lengths 1024 4096
    python -m experiments.bench hardening --lengths 1024
    python -m experiments.bench kernels    # fused kernels and, on a GPU, the PyTorch peers
    python -m experiments.bench forward_passes   # what a pass of the sparse forward costs
    python -m experiments.bench query_chunks     # impl='xla': query rows per chunk

The default ``normalizers`` run takes about 8 minutes on a 2-core CPU, most of it in optax's
sort-based ``projection_simplex`` and the general-alpha entmax at n = 2048 and 4096.

Adding a benchmark: write a frozen config dataclass (a docstring per field; tyro turns them
into ``--help``) and a function ``run_<name>(config, command) -> str`` that returns the
markdown, and register it with ``@benchmark("<name>", Config)``.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx
from optax.projections import projection_simplex

import sparse_jax
from experiments import timing
from experiments.bench_kernels import (
    ForwardPassesConfig,
    Interrupted,
    KernelsConfig,
    SearchPassesConfig,
    TuningConfig,
    run_forward_passes,
    run_kernels,
    run_search_passes,
    run_tuning,
)
from sparse_jax import masks
from sparse_jax.blocksparse import blocksparse_cost
from sparse_jax.dispatch import attention, default_query_chunk
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config, harden
from sparse_jax.models.flops import model_flops

# name -> (config class, runner(config, command) -> markdown)
_BENCHMARKS: dict[str, tuple[type, Callable[[Any, str], str]]] = {}


def benchmark(name: str, config_cls: type) -> Callable:
    """Registers ``runner(config, command) -> markdown`` as subcommand ``name``.

    ``config_cls`` is a frozen dataclass whose field defaults are the subcommand's defaults.
    """

    def register(runner: Callable[[Any, str], str]) -> Callable[[Any, str], str]:
        _BENCHMARKS[name] = (config_cls, runner)
        return runner

    return register


def _fmt_ratio(value: float, reference: float | None) -> str:
    return "–" if reference is None else f"{value / reference:.2f}x"


# ----------------------------------------------------------------------------------------------
# normalizers: a normalizer alone, and inside whole causal attention
# ----------------------------------------------------------------------------------------------

NormalizerName = Literal["softmax", "sparsemax", "entmax15", "entmax", "projection_simplex"]
_ALL_NORMALIZERS: tuple[NormalizerName, ...] = (
    "softmax",
    "sparsemax",
    "entmax15",
    "entmax",
    "projection_simplex",
)


@dataclasses.dataclass(frozen=True)
class NormalizersConfig:
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
    """The alpha of the 'entmax' row (> 1)."""
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
    repeats: int = 5
    """Timed calls per cell; the median is reported. One extra warm-up call after
    compilation is excluded."""
    slow_s: float = 10.0
    """If the first call after compilation (the warm-up) takes longer than this many seconds,
    that call is the cell's only sample."""
    budget_s: float = 15.0
    """Stop repeating a cell once its timed calls have used this many seconds (at least one
    call). Cells timed fewer than --repeats times are marked with a dagger and the count."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of scores, q, k, v and cotangents."""
    seed: int = 0
    """Seed of the random inputs and cotangents."""
    output: pathlib.Path | None = None
    """Also write the markdown (header, table, notes) to this file."""

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
        timing.check_counts(self, "batch", "heads", "head_dim", "repeats")
        if not self.which:
            raise ValueError(f"which must name at least one of {_ALL_NORMALIZERS}, got ()")
        unknown = [w for w in self.which if w not in _ALL_NORMALIZERS]
        if unknown or len(set(self.which)) != len(self.which):
            raise ValueError(
                f"which must be distinct names from {_ALL_NORMALIZERS}, got {self.which!r}"
            )
        if not self.entmax_alpha > 1:
            raise ValueError(f"entmax_alpha must be > 1, got {self.entmax_alpha!r}")
        timing.check_seconds(self, "slow_s", "budget_s")
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


@benchmark("normalizers", NormalizersConfig)
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
        f"ms = median of {config.repeats} calls after compilation and one warm-up call; †k = "
        f"median of only k calls: the cell's timed calls passed {config.budget_s:g} s, or †1: "
        f"its warm-up call took > {config.slow_s:g} s and is the one sample. Peak MiB = "
        "arguments + outputs + temporaries of XLA's compiled buffer assignment, not RSS.",
        f"mask_mode={config.mask_mode}; projection_simplex = optax.projections."
        "projection_simplex vmapped over rows, masked scores set to row min - 1e4.",
        *notes,
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"


# ----------------------------------------------------------------------------------------------
# query_chunks: how many query rows impl="xla" should take at once
# ----------------------------------------------------------------------------------------------


def _shape(text: str) -> tuple[int, int, int, int]:
    """``"BxNxTxH"`` -> (batch, heads, length, head dim)."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(
            f"shapes must be 'BxNxTxH' (batch x heads x length x head dim, integers >= 1); "
            f"got {text!r}"
        )
    b, n, t, h = (int(p) for p in parts)
    return b, n, t, h


@dataclasses.dataclass(frozen=True)
class QueryChunksConfig:
    """impl='xla' (query-chunked dense attention) under the causal mask at several chunk budgets
    and at the default's chunk (sparse_jax.dispatch.default_query_chunk): a budget's chunk takes
    as many query rows as keep its scores [B, N, rows, Tk] within it, at least 8;
    forward+backward, the chunks of a cell timed in alternation
    (experiments.timing.time_interleaved)."""

    shapes: tuple[str, ...] = (
        "12x4x144x16",  # the chain-of-thought default: encoder, question bucket of 144 tokens
        "12x4x208x16",  # ... its decoder: solution buckets of 208 and 264 tokens
        "12x4x264x16",
        "8x12x128x64",  # the main job: GPT-2 small, windows of 128
        "2x12x1024x64",  # the WikiText-2 study's length
        "1x8x2048x64",  # the normalizers benchmark (b)
        "1x8x4096x64",
    )
    """Self-attention shapes 'BxNxTxH' (batch x heads x length x head dim)."""
    budgets: tuple[int, ...] = (2**19, 2**20, 2**21, 2**22)
    """Scores per chunk (elements of [B, N, rows, Tk]); rows = max(8, budget // (B·N·Tk))."""
    normalizers: tuple[Literal["softmax", "sparsemax", "entmax15"], ...] = ("softmax", "sparsemax")
    """Normalizers to time at each shape."""
    rounds: int = 10
    """Rounds of the alternation (one call of each budget per round; median reported)."""
    budget_s: float = 20.0
    """Stop a cell's rounds (after 3) once its timed calls have used this many seconds."""
    seed: int = 0
    """Seed of the random inputs."""
    output: pathlib.Path | None = None
    """Also write the markdown to this file."""

    def __post_init__(self) -> None:
        timing.check_count_tuples(self, "budgets")
        timing.check_counts(self, "rounds")
        if not self.shapes:
            raise ValueError("shapes must name at least one shape 'BxNxTxH', got ()")
        for text in self.shapes:
            _shape(text)
        if not self.normalizers:
            raise ValueError("normalizers must name at least one normalizer, got ()")
        timing.check_seconds(self, "budget_s")


@benchmark("query_chunks", QueryChunksConfig)
def run_query_chunks(config: QueryChunksConfig, command: str) -> str:
    """Returns the markdown of the query-chunk benchmark (see QueryChunksConfig)."""
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    headers = ["shape B x N x T x H", "normalizer"]
    headers += [f"2^{int(math.log2(c))}" if c & (c - 1) == 0 else str(c) for c in config.budgets]
    headers += ["default", "fastest", "default / fastest"]
    rows = []
    for text in config.shapes:
        b, n, t, h = _shape(text)
        keys = jax.random.split(jax.random.key(config.seed + t), 4)
        q, k, v, go = (jax.random.normal(kk, (b, t, n, h), jnp.float32) for kk in keys)
        # query rows per chunk of each budget (T: one chunk); budgets giving the same are timed once
        chunks = [min(t, max(8, c // (b * n * t))) for c in config.budgets]
        own = min(t, default_query_chunk(b, n, t, h))
        distinct = sorted(set(chunks) | {own}, key=[*chunks, own].index)
        for normalizer in config.normalizers:
            calls = []
            for rows_per_chunk in distinct:

                def loss(q, k, v, g, rows_per_chunk=rows_per_chunk, normalizer=normalizer):
                    out = attention(
                        q, k, v, mask=masks.causal(), normalizer=normalizer, impl="xla",
                        query_chunk=rows_per_chunk,
                    )  # fmt: skip
                    return jnp.sum(out * g)

                calls.append((jax.grad(loss, argnums=(0, 1, 2)), (q, k, v, go)))
            timed = timing.time_interleaved(
                calls, rounds=config.rounds, min_rounds=min(3, config.rounds),
                budget_s=config.budget_s,
            )  # fmt: skip
            stats = dict(zip(distinct, timed, strict=True))
            best = min(distinct, key=lambda c: stats[c].median_s)
            row = [text, normalizer]
            for c in chunks:
                cell = f"{timing.format_ms(stats[c])} ({c} rows)"
                row.append(f"**{cell}**" if c == best else cell)
            cell = f"{timing.format_ms(stats[own])} ({own} rows)"
            row.append(f"**{cell}**" if own == best else cell)
            row.append(f"{best} rows")
            row.append(f"{stats[own].median_s / stats[best].median_s:.2f}x")
            rows.append(row)
            timing.log(
                f"[{time.perf_counter() - start:6.0f} s] {text} {normalizer}: "
                + ", ".join(f"{c} rows {stats[c].median_ms:.1f}" for c in distinct)
                + " ms"
            )
    table = timing.markdown_table(headers, rows, align="ll" + "r" * (len(headers) - 2))
    elapsed = time.perf_counter() - start
    notes = [
        "impl='xla' under masks.causal(), float32; fwd+bwd = gradient of sum(out * g) w.r.t. q, "
        "k, v; each cell: the median of its calls, the budgets of a row timed in alternation "
        f"(up to {config.rounds} rounds, after compilation and a warm-up call), with the query "
        "rows per chunk that budget gives (T rows: one chunk, no loop; budgets that give the "
        "same rows share one timing).",
        "default: the rows sparse_jax.dispatch.default_query_chunk gives on this backend "
        f"({jax.default_backend()}), those of attention(query_chunk=None).",
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"


# ----------------------------------------------------------------------------------------------
# attention: the block-sparse kernel against the dense (query-chunked XLA) reference
# ----------------------------------------------------------------------------------------------

MaskName = Literal["causal", "local", "local_sink", "strided"]
_ALL_MASKS: tuple[MaskName, ...] = ("causal", "local", "local_sink", "strided")


def _bench_mask(name: MaskName, n: int, window: int):
    """The benchmark's masks (``window`` = the local window's left extent)."""
    if name == "causal":
        return masks.causal(), "causal"
    if name == "local":
        return masks.causal() & masks.local(window, 0), f"causal & local({window}, 0)"
    if name == "local_sink":
        mask = (masks.causal() & masks.local(window, 0)) | masks.sink(4)
        return mask, f"(causal & local({window}, 0)) | sink(4)"
    stride = max(1, round(math.sqrt(n)))
    return masks.strided(stride), f"strided({stride}) (causal)"


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Attention under masks: impl='blocksparse' against impl='xla' (the dense reference,
    query-chunked), forward and forward+backward, per mask, length and normalizer."""

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    """Sequence lengths n (self-attention, q_len = kv_len = n)."""
    masks: tuple[MaskName, ...] = _ALL_MASKS
    """Masks: causal; local = causal & local(window, 0); local_sink = that | sink(4);
    strided = the Sparse Transformer's strided(round(sqrt(n))), which is causal."""
    normalizers: tuple[Literal["softmax", "sparsemax", "entmax15"], ...] = ("softmax", "sparsemax")
    """Normalizers to time under each mask."""
    window: int = 256
    """Left extent of the local window (keys i - window ... i)."""
    batch: int = 1
    """Batch size."""
    heads: int = 8
    """Attention heads."""
    head_dim: int = 64
    """Head dimension of q, k, v."""
    block: int = 64
    """Block size (query and key) of the block-sparse kernel (64 ran fastest on a 2-core CPU for
    window masks; TPU kernels want multiples of 128)."""
    dense_every_mask_up_to: int = 4096
    """The dense reference does the same O(n^2) work under every mask; above this length it is
    timed under the causal mask only, and other masks are compared with that."""
    repeats: int = 5
    """Timed calls per cell (median reported), after compilation and a warm-up call."""
    slow_s: float = 10.0
    """A cell whose warm-up call takes longer than this is timed by that one call."""
    budget_s: float = 15.0
    """Stop repeating a cell once its timed calls have used this many seconds."""
    seed: int = 0
    """Seed of the random inputs."""
    output: pathlib.Path | None = None
    """Also write the markdown to this file."""

    def __post_init__(self) -> None:
        timing.check_counts(self, "batch", "heads", "head_dim", "block", "repeats", "window")
        timing.check_count_tuples(self, "lengths")
        if not self.masks or any(m not in _ALL_MASKS for m in self.masks):
            raise ValueError(f"masks must be names from {_ALL_MASKS}, got {self.masks!r}")
        if not self.normalizers:
            raise ValueError("normalizers must name at least one normalizer, got ()")
        timing.check_seconds(self, "slow_s", "budget_s")


def _naive_dense_mib(q, k, v, go) -> float | None:
    """Compiled memory (MiB) of plain causal jax.nn.dot_product_attention fwd+bwd (not run)."""

    def loss(q, k, v, g):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out * g)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, go).compile()
    peak = timing.peak_memory_bytes(compiled)
    return None if peak is None else peak / 2**20


def _attention_cells(config, q, k, v, go, mask, normalizer, impl) -> list[timing.TimingStats]:
    """[fwd, fwd+bwd] timings of sparse_jax.attention with this mask/normalizer/impl."""
    blocks = (config.block, config.block)

    def fwd(q, k, v):
        return attention(q, k, v, mask=mask, normalizer=normalizer, impl=impl, block_size=blocks)

    def loss(q, k, v, g):
        return jnp.sum(fwd(q, k, v) * g)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    limits = {"repeats": config.repeats, "slow_s": config.slow_s, "budget_s": config.budget_s}
    return [timing.time_fn(fwd, q, k, v, **limits), timing.time_fn(grad, q, k, v, go, **limits)]


@benchmark("attention", AttentionConfig)
def run_attention(config: AttentionConfig, command: str) -> str:
    """Returns the markdown of the attention benchmark (see AttentionConfig)."""
    b, h, d = config.batch, config.heads, config.head_dim
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    rows, findings = [], {"speed": [], "density": [], "normalizer": []}
    for n in config.lengths:
        keys = jax.random.split(jax.random.key(config.seed + n), 4)
        q, k, v, go = (jax.random.normal(kk, (b, n, h, d), jnp.float32) for kk in keys)
        bs_softmax: dict[str, float] = {}
        naive_mib = _naive_dense_mib(q, k, v, go)
        for normalizer in config.normalizers:
            dense_causal = None
            for mask_name in config.masks:
                mask, label = _bench_mask(mask_name, n, config.window)
                layout = mask.blocks(n, n, config.block, config.block)
                cost = blocksparse_cost(layout, batch=b, num_heads=h, head_dim=d)
                if mask_name == "causal" or n <= config.dense_every_mask_up_to:
                    dense = _attention_cells(config, q, k, v, go, mask, normalizer, "xla")
                    dense_label = "xla"
                    if mask_name == "causal":
                        dense_causal = dense
                if n > config.dense_every_mask_up_to and mask_name != "causal":
                    if dense_causal is None:
                        causal_mask, _ = _bench_mask("causal", n, config.window)
                        dense_causal = _attention_cells(
                            config, q, k, v, go, causal_mask, normalizer, "xla"
                        )
                    dense, dense_label = dense_causal, "xla (causal)"
                sparse = _attention_cells(config, q, k, v, go, mask, normalizer, "blocksparse")
                if dense_causal is None:  # masks listed without causal: time it for the ratio
                    causal_mask, _ = _bench_mask("causal", n, config.window)
                    dense_causal = _attention_cells(
                        config, q, k, v, go, causal_mask, normalizer, "xla"
                    )
                density = layout.density
                speedup = dense[1].median_s / sparse[1].median_s
                mem = [cell.peak_bytes for cell in (dense[1], sparse[1])]
                mem_ratio = None if None in (mem[1], naive_mib) else mem[1] / 2**20 / naive_mib
                density_ratio = sparse[1].median_s / (density * dense_causal[1].median_s)
                if normalizer == "softmax":
                    bs_softmax[mask_name] = sparse[1].median_s
                rows.append(
                    [
                        label,
                        str(n),
                        f"{density:.1%}",
                        f"{cost.computed_scores / cost.dense_scores:.1%}",
                        normalizer,
                        dense_label,
                        timing.format_ms(dense[0]),
                        timing.format_ms(dense[1]),
                        timing.format_ms(sparse[0]),
                        timing.format_ms(sparse[1]),
                        f"{speedup:.1f}x",
                        "–" if naive_mib is None else f"{naive_mib:.0f}",
                        "–" if mem[0] is None else f"{mem[0] / 2**20:.0f}",
                        "–" if mem[1] is None else f"{mem[1] / 2**20:.0f}",
                        f"{density_ratio:.2f}",
                    ]
                )
                if mask_name == "local" and normalizer == "softmax" and n == 8192:
                    ok = speedup >= 10 and mem_ratio is not None and mem_ratio <= 1 / 8
                    findings["speed"].append(
                        f"{'met' if ok else 'MISSED'}: {label} at n={n}, softmax: block-sparse "
                        f"fwd+bwd {speedup:.1f}x faster than dense (target >= 10x), peak "
                        f"memory {'?' if mem_ratio is None else f'{mem_ratio:.3f}'} of naive "
                        "dense attention's (target <= 0.125)"
                    )
                if density >= 0.05 and n >= 4096:
                    findings["density"].append(
                        f"{'met' if density_ratio <= 2 else 'MISSED'}: {label}, n={n}, "
                        f"{normalizer}: density ratio {density_ratio:.2f} (target <= 2)"
                    )
                if normalizer != "softmax" and mask_name in bs_softmax:
                    ratio = sparse[1].median_s / bs_softmax[mask_name]
                    findings["normalizer"].append(
                        f"{'met' if ratio <= 1.5 else 'MISSED'}: {label}, n={n}: {normalizer} "
                        f"under the block-sparse kernel {ratio:.2f}x softmax's fwd+bwd "
                        "(target <= 1.5x)"
                    )
                timing.log(
                    f"[{time.perf_counter() - start:6.0f} s] n={n} {label} {normalizer}: "
                    f"{dense_label} {dense[1].median_ms:.0f} ms, blocksparse "
                    f"{sparse[1].median_ms:.0f} ms (fwd+bwd)"
                )
    headers = [
        "mask",
        "n",
        "density",
        "computed",
        "normalizer",
        "dense",
        "dense fwd ms",
        "dense fwd+bwd ms",
        "bs fwd ms",
        "bs fwd+bwd ms",
        "speed-up",
        "naive MiB",
        "dense MiB",
        "bs MiB",
        "density ratio",
    ]
    table = timing.markdown_table(headers, rows, align="lrrrll" + "r" * 9)
    elapsed = time.perf_counter() - start
    notes = [
        f"q, k, v [{b}, n, {h}, {d}] float32; bs = impl='blocksparse' with blocks "
        f"{config.block}x{config.block}; dense = impl='xla' (query-chunked dense reference) "
        "under the same mask, or under the causal mask where it says 'xla (causal)' (same "
        f"dense work; timed per mask only up to n={config.dense_every_mask_up_to}).",
        "density = allowed fraction of the n x n scores; computed = score entries the "
        "block-sparse kernel forms / n^2 (kept blocks, padded within row groups).",
        "fwd+bwd = gradient of sum(out * g) w.r.t. q, k, v; speed-up = dense fwd+bwd / bs "
        "fwd+bwd; MiB = XLA's compiled buffer assignment of fwd+bwd (arguments + outputs + "
        "temporaries), not RSS; naive = jax.nn.dot_product_attention(implementation='xla') "
        "with a causal mask, compiled only (the O(n^2) memory a plain dense implementation "
        "needs); density ratio = bs fwd+bwd / (density x dense causal fwd+bwd).",
        f"ms = median of up to {config.repeats} calls after compilation and a warm-up call; "
        f"†k = only k calls (budget {config.budget_s:g} s, or †1: warm-up > "
        f"{config.slow_s:g} s).",
        *findings["speed"],
        *findings["density"],
        *findings["normalizer"],
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"


# ----------------------------------------------------------------------------------------------
# hardening: a hardened sparse GPT against the dense one, same weights, same run
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HardeningConfig:
    """A small GPT-style model with random weights, hardened to a per-head pattern of about
    ``--density`` attention density, against the dense model: analytic FLOPs, measured
    forward time (whole model and attention alone) and peak memory."""

    lengths: tuple[int, ...] = (1024, 4096, 8192)
    """Sequence lengths (the model's n_positions is the largest)."""
    density: float = 0.25
    """Target attention density of the hardened pattern (fraction of the n x n scores)."""
    layers: int = 4
    """Transformer blocks."""
    width: int = 256
    """Model width (n_embd)."""
    heads: int = 8
    """Attention heads per block."""
    vocab: int = 257
    """Vocabulary (257: the byte tokenizer's)."""
    block: int = 64
    """Block size of the block-sparse kernel (see the attention benchmark's --block)."""
    repeats: int = 3
    """Timed calls per cell (median reported)."""
    slow_s: float = 10.0
    """A cell whose warm-up call takes longer than this is timed by that one call."""
    budget_s: float = 15.0
    """Stop repeating a cell once its timed calls have used this many seconds."""
    output: pathlib.Path | None = None
    """Also write the markdown to this file."""

    def __post_init__(self) -> None:
        timing.check_counts(self, "layers", "width", "heads", "vocab", "block", "repeats")
        timing.check_count_tuples(self, "lengths")
        if not 0 < self.density <= 0.5:
            raise ValueError(f"density must be in (0, 0.5] (causal), got {self.density!r}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")


def _pattern_for_density(n: int, heads: int, density: float):
    """Per-head masks with mean density ~ ``density`` at length ``n``: a quarter of the heads
    keep full causal attention (as a distilled student keeps a few global heads), the rest
    attention sinks plus a causal window sized to meet the target."""
    full = max(1, heads // 4) if density >= 0.125 else 0
    rest = heads - full
    target = (density * heads - 0.5 * full) / max(rest, 1)  # density each windowed head needs
    # causal & local(w - 1, 0) has density (w * n - w * (w - 1) / 2) / n^2; solve for w.
    w = int(n * (1 - math.sqrt(max(1 - 2 * target, 0.0))))
    w = max(1, min(n, w))
    window = (masks.causal() & masks.local(w - 1, 0)) | (masks.sink(4) & masks.causal())
    return [masks.causal()] * full + [window] * rest, w


@benchmark("hardening", HardeningConfig)
def run_hardening(config: HardeningConfig, command: str) -> str:
    """Returns the markdown of the hardening benchmark (see HardeningConfig)."""
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    cfg = GPT2Config(
        vocab_size=config.vocab,
        n_positions=max(config.lengths),
        n_embd=config.width,
        n_layer=config.layers,
        n_head=config.heads,
    )
    limits = {"repeats": config.repeats, "slow_s": config.slow_s, "budget_s": config.budget_s}
    blocks = (config.block, config.block)
    rows, findings = [], []
    for n in config.lengths:
        head_masks, window = _pattern_for_density(n, config.heads, config.density)
        # A candidate student whose learned weights select the pattern, hardened by harden().
        candidates = (masks.causal(), head_masks[-1])
        spec = AttentionSpec(
            kind="candidates", candidates=candidates, granularity="head", block_size=blocks
        )
        student = GPT2(cfg, spec, rngs=nnx.Rngs(0))
        choice = [[4.0, -4.0] if m == masks.causal() else [-4.0, 4.0] for m in head_masks]
        for block in student.h:
            block.attn.core.logits[...] = jnp.asarray(choice, jnp.float32)
        hard = harden(student, length=n)
        dense = GPT2(cfg, AttentionSpec(impl="xla"), rngs=nnx.Rngs(0))
        nnx.update(dense, nnx.state(hard, nnx.Param))
        ids = jax.random.randint(jax.random.key(n), (1, n), 0, config.vocab, jnp.int32)
        cells, flops = {}, {}
        for label, model in (("dense", dense), ("hardened", hard)):
            graphdef, state = nnx.split(model)

            def forward(state, ids, graphdef=graphdef):
                return nnx.merge(graphdef, state)(ids)

            cells[label] = timing.time_fn(forward, state, ids, **limits)
            flops[label] = model_flops(model, n)
        # Attention alone at the model's shapes: one block's q, k, v.
        hd = config.width // config.heads
        q, k, v = (
            jax.random.normal(kk, (1, n, config.heads, hd), jnp.float32)
            for kk in jax.random.split(jax.random.key(n + 1), 3)
        )
        pattern = hard.h[0].attn.core.mask

        def dense_attn(q, k, v):
            return attention(q, k, v, mask=masks.causal(), impl="xla")

        def hard_attn(q, k, v, pattern=pattern):
            return attention(q, k, v, mask=pattern, impl="blocksparse", block_size=blocks)

        attn_dense = timing.time_fn(dense_attn, q, k, v, **limits)
        attn_hard = timing.time_fn(hard_attn, q, k, v, **limits)
        density = flops["hardened"].attention_density
        ratio = attn_hard.median_s / (density * attn_dense.median_s)
        for label in ("dense", "hardened"):
            f, c = flops[label], cells[label]
            a = attn_dense if label == "dense" else attn_hard
            rows.append(
                [
                    label,
                    str(n),
                    f"{f.attention_density:.1%}",
                    f"{f.total / 1e9:.2f}",
                    f"{f.attention / 1e9:.2f}",
                    timing.format_ms(c),
                    "–" if c.peak_bytes is None else f"{c.peak_bytes / 2**20:.0f}",
                    timing.format_ms(a),
                    "–" if label == "dense" else f"{ratio:.2f}",
                ]
            )
        if n >= 4096:
            findings.append(
                f"{'met' if ratio <= 2 else 'MISSED'}: n={n}: hardened attention "
                f"{attn_hard.median_ms:.0f} ms = {ratio:.2f} x density x dense "
                f"({attn_dense.median_ms:.0f} ms; target <= 2)"
            )
        timing.log(
            f"[{time.perf_counter() - start:6.0f} s] n={n}: model {cells['dense'].median_ms:.0f}"
            f" -> {cells['hardened'].median_ms:.0f} ms, attention {attn_dense.median_ms:.0f} -> "
            f"{attn_hard.median_ms:.0f} ms (window {window})"
        )
    headers = [
        "model",
        "n",
        "attn density",
        "GFLOPs",
        "attn GFLOPs",
        "forward ms",
        "peak MiB",
        "attention ms",
        "attn ratio",
    ]
    table = timing.markdown_table(headers, rows, align="lr" + "r" * 7)
    elapsed = time.perf_counter() - start
    notes = [
        f"Model: {config.layers} blocks, width {config.width}, {config.heads} heads, vocab "
        f"{config.vocab}, random weights, batch 1, float32. Hardened = harden() of a candidate "
        "student whose weights pick, per head, full causal (a quarter of the heads) or sink(4) "
        f"+ a causal window sized for ~{config.density:.0%} mean density; its blocks run "
        f"impl='auto' (block-sparse, blocks {config.block}); dense = impl='xla' with the same "
        "weights.",
        "GFLOPs = analytic forward FLOPs (sparse_jax.models.flops: matmuls, the score entries each "
        "implementation forms); forward ms = whole model; attention ms = one block's attention "
        "alone (dense causal vs the hardened per-head pattern); attn ratio = hardened attention "
        "/ (density x dense attention); peak MiB = XLA buffer assignment of the forward pass.",
        *findings,
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"


benchmark("kernels", KernelsConfig)(run_kernels)
benchmark("pallas_tuning", TuningConfig)(run_tuning)
benchmark("search_passes", SearchPassesConfig)(run_search_passes)
benchmark("forward_passes", ForwardPassesConfig)(run_forward_passes)


# ----------------------------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> Any:
    """The config of a benchmark command line (``["kernels", "--lengths", "4096"]``); a bad
    flag exits with a message naming it."""
    return tyro.extras.subcommand_cli_from_dict(
        {name: config_cls for name, (config_cls, _) in _BENCHMARKS.items()},
        prog="python -m experiments.bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        args=list(argv),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the subcommand and its flags, runs the benchmark, prints (and writes) markdown."""
    args = list(sys.argv[1:] if argv is None else argv)
    config = parse(args)
    runner = next(r for cls, r in _BENCHMARKS.values() if type(config) is cls)
    interrupted = None
    try:
        markdown = runner(config, shlex.join(["python", "-m", "experiments.bench", *args]))
    except Interrupted as stop:  # the cells measured before it are still printed and written
        markdown, interrupted = stop.markdown, stop
    print(markdown, end="", flush=True)
    output = getattr(config, "output", None)
    if output is not None:
        output = pathlib.Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(markdown)
        timing.log(f"wrote {output}")
    if interrupted is not None:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
