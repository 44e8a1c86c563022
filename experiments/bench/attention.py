"""``python -m experiments.bench attention``: the block-sparse kernel against the dense
(query-chunked XLA) reference under each mask and normalizer; and ``query_chunks``: how many
query rows ``impl="xla"`` should take at once."""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from typing import Literal

import jax
import jax.numpy as jnp

from experiments.common import timing
from sparse_jax import masks
from sparse_jax.blocksparse import blocksparse_cost
from sparse_jax.dispatch import attention, default_query_chunk
from sparse_jax.dynamic import BlockSelection
from sparse_jax.models.flops import SERVING_BLOCKS, serving_block_size


def _fmt_ratio(value: float, reference: float | None) -> str:
    return "–" if reference is None else f"{value / reference:.2f}x"


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
class _AlternatedShapes:
    """The flags of the benchmarks that time several calls on each of some shapes, the calls of
    a cell in alternation (experiments.common.timing.time_interleaved)."""

    shapes: tuple[str, ...] = ()
    """Self-attention shapes 'BxNxTxH' (batch x heads x length x head dim)."""
    rounds: int = 7
    """Rounds of the alternation (median reported)."""
    budget_s: float = 20.0
    """Stop a cell's rounds (after 3) once its timed calls have used this many seconds."""
    seed: int = 0
    """Seed of the random inputs."""
    output: pathlib.Path | None = None
    """Also write the markdown to this file."""

    def __post_init__(self) -> None:
        timing.check_counts(self, "rounds")
        if not self.shapes:
            raise ValueError("shapes must name at least one shape 'BxNxTxH', got ()")
        for text in self.shapes:
            _shape(text)
        timing.check_seconds(self, "budget_s")


def _timed_pass(config: _AlternatedShapes, fns, which: str, q, k, v, go) -> list:
    """Each of ``fns`` (``(q, k, v) -> out``) timed in alternation (``config.rounds``,
    ``config.budget_s``): the call itself (``"forward"``) or the gradient of ``sum(out * go)``
    with respect to q, k, v (``"fwd+bwd"``)."""
    calls = []
    for fn in fns:
        if which == "forward":
            calls.append((fn, (q, k, v)))
        else:

            def loss(q, k, v, g, fn=fn):
                return jnp.sum(fn(q, k, v) * g)

            calls.append((jax.grad(loss, argnums=(0, 1, 2)), (q, k, v, go)))
    return timing.time_interleaved(
        calls, rounds=config.rounds, min_rounds=min(3, config.rounds), budget_s=config.budget_s
    )


@dataclasses.dataclass(frozen=True)
class QueryChunksConfig(_AlternatedShapes):
    """impl='xla' (query-chunked dense attention) under the causal mask at several chunk budgets
    and at the default's chunk (sparse_jax.dispatch.default_query_chunk): a budget's chunk takes
    as many query rows as keep its scores [B, N, rows, Tk] within it, at least 8;
    forward+backward, the chunks of a cell timed in alternation
    (experiments.common.timing.time_interleaved)."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        timing.check_count_tuples(self, "budgets")
        if not self.normalizers:
            raise ValueError("normalizers must name at least one normalizer, got ()")


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
class AttentionConfig(timing.TimingFlags):
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
    seed: int = 0
    """Seed of the random inputs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        timing.check_counts(self, "batch", "heads", "head_dim", "block", "window")
        timing.check_count_tuples(self, "lengths")
        if not self.masks or any(m not in _ALL_MASKS for m in self.masks):
            raise ValueError(f"masks must be names from {_ALL_MASKS}, got {self.masks!r}")
        if not self.normalizers:
            raise ValueError("normalizers must name at least one normalizer, got ()")


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
        config.dagger_note(),
        *findings["speed"],
        *findings["density"],
        *findings["normalizer"],
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"


@dataclasses.dataclass(frozen=True)
class SelectionConfig(_AlternatedShapes):
    """A BlockSelection (each query token's own key block and the best earlier blocks) run two
    ways: its gather engine (BlockSelection.attention: only the chosen blocks' scores) and the
    XLA engine on its dense [B, N, T, T] mask, beside causal attention on the XLA engine; the
    forward pass and forward+backward, the three calls of a cell timed in alternation."""

    shapes: tuple[str, ...] = ("8x4x128x64", "2x4x512x64", "1x4x2048x64", "1x4x4096x64")
    """Self-attention shapes 'BxNxTxH' (the main job's student at 128 and its serving 512)."""
    keep_blocks: int = 2
    """Earlier key blocks each query chooses (--student.select-blocks)."""
    block: int = 16
    """Keys per block (--student.select-block)."""

    def __post_init__(self) -> None:
        timing.check_counts(self, "keep_blocks", "block")
        super().__post_init__()


def run_selection(config: SelectionConfig, command: str) -> str:
    """Returns the markdown of the block-selection benchmark (see SelectionConfig)."""
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    selection = BlockSelection(config.keep_blocks, block=config.block)
    engines = {
        "gather": selection.attention,
        "dense mask": lambda q, k, v: attention(q, k, v, mask=selection.dense(q, k), impl="xla"),
        "causal": lambda q, k, v: attention(q, k, v, mask=masks.causal(), impl="xla"),
    }
    headers = ["shape B x N x T x H", "pass", "formed / T²", *engines, "gather / dense mask"]
    rows = []
    for text in config.shapes:
        b, n, t, h = _shape(text)
        keys = jax.random.split(jax.random.key(config.seed + t), 4)
        q, k, v, go = (jax.random.normal(kk, (b, t, n, h), jnp.float32) for kk in keys)
        for which in ("forward", "fwd+bwd"):
            stats = _timed_pass(config, engines.values(), which, q, k, v, go)
            ratio = stats[0].median_s / stats[1].median_s
            rows.append([text, which, f"{selection.formed(t) / t**2:.3f}",
                         *(timing.format_ms(s) for s in stats), f"{ratio:.2f}x"])  # fmt: skip
            timing.log(f"[{time.perf_counter() - start:6.0f} s] {text} {which}: " + ", ".join(
                f"{name} {s.median_ms:.1f}" for name, s in zip(engines, stats, strict=True)
            ) + " ms")  # fmt: skip
    table = timing.markdown_table(headers, rows, align="lll" + "r" * (len(headers) - 3))
    elapsed = time.perf_counter() - start
    notes = [
        f"{selection!r}, float32; formed / T²: the scores the gather engine forms (whole "
        "blocks per query token) per entry of the full score matrix; fwd+bwd = gradient of "
        "sum(out * g) w.r.t. q, k, v; each cell the median of its calls, the three engines of "
        f"a row timed in alternation (up to {config.rounds} rounds, after compilation and a "
        "warm-up call).",
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"


@dataclasses.dataclass(frozen=True)
class BlockSizesConfig(_AlternatedShapes):
    """The block-sparse engine on one mask at each of the block sizes that
    sparse_jax.models.flops.serving_block_size chooses among (SERVING_BLOCKS), the block sizes
    of a cell timed in alternation, beside the one it chooses: the measurement behind the
    hardened heads' blocks (a window at small blocks, full causal at large ones)."""

    shapes: tuple[str, ...] = ("1x4x512x64", "1x4x2048x64")
    """Self-attention shapes 'BxNxTxH' (the main job's hardened student serves 512)."""
    windows: tuple[int, ...] = (8, 32, 128, 512)
    """Causal windows of w keys (causal & local(w - 1, 0)), each alone and with a sink of 4
    keys, beside full causal attention."""
    rounds: int = 9
    """Rounds of the alternation (median reported)."""

    def __post_init__(self) -> None:
        timing.check_count_tuples(self, "windows")
        super().__post_init__()


def _block_size_masks(windows: tuple[int, ...]) -> dict[str, masks.Mask]:
    out = {"causal": masks.causal()}
    for w in windows:
        window = masks.causal() & masks.local(w - 1, 0)
        out[f"window({w})"] = window
        out[f"sink(4) ∪ window({w})"] = window | (masks.sink(4) & masks.causal())
    return out


def run_block_sizes(config: BlockSizesConfig, command: str) -> str:
    """Returns the markdown of the block-size benchmark (see BlockSizesConfig)."""
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    sizes = SERVING_BLOCKS
    headers = ["shape B x N x T x H", "mask", "pass", *(f"blocks {s}" for s in sizes),
               "chosen", "chosen / fastest"]  # fmt: skip
    rows, worst = [], 1.0
    for text in config.shapes:
        b, n, t, h = _shape(text)
        keys = jax.random.split(jax.random.key(config.seed + t), 4)
        q, k, v, go = (jax.random.normal(kk, (b, t, n, h), jnp.float32) for kk in keys)
        for name, mask in _block_size_masks(config.windows).items():
            chosen = serving_block_size(mask, t)[0]
            fns = [
                functools.partial(attention, mask=mask, impl="blocksparse", block_size=(s, s))
                for s in sizes
            ]
            for which in ("forward", "fwd+bwd"):
                stats = _timed_pass(config, fns, which, q, k, v, go)
                by_size = {s: st.median_s for s, st in zip(sizes, stats, strict=True)}
                ratio = by_size[chosen] / min(by_size.values())
                worst = max(worst, ratio)
                rows.append([text, name, which, *(timing.format_ms(st) for st in stats),
                             str(chosen), f"{ratio:.2f}x"])  # fmt: skip
                timing.log(f"[{time.perf_counter() - start:6.0f} s] {text} {name} {which}: "
                           + ", ".join(f"{s}: {by_size[s] * 1e3:.2f}" for s in sizes)
                           + f" ms; chosen {chosen}")  # fmt: skip
    table = timing.markdown_table(headers, rows, align="lll" + "r" * (len(headers) - 3))
    elapsed = time.perf_counter() - start
    notes = [
        "impl='blocksparse' with square blocks of each size, float32; chosen = "
        "serving_block_size(mask, T) (the largest block whose formed score entries are within "
        "SERVING_SLACK of the fewest and whose widest query block forms at most the engine's "
        "step of scores), what harden() gives a head with that mask in a layer "
        "whose own blocks are one of these; fwd+bwd = "
        "gradient of sum(out * g) w.r.t. q, k, v; each cell the median of its calls, the block "
        f"sizes of a row timed in alternation (up to {config.rounds} rounds, after compilation "
        "and a warm-up call).",
        f"The chosen block's time is at most {worst:.2f}x the fastest's in every row.",
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
