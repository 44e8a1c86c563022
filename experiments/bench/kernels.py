"""``python -m experiments.bench kernels``: every attention engine of sparse_jax, and on a GPU
its PyTorch peers, on the same work in the same run (see KernelsConfig)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Literal

import jax
import jax.numpy as jnp

from experiments.common import timing
from sparse_jax import masks
from sparse_jax.dispatch import attention
from sparse_jax.fused import cudnn_mask_arguments
from sparse_jax.kernels import TRITON_TILE

KernelMask = Literal["causal", "local", "local_sink"]
Engine = Literal["xla", "blocksparse", "pallas", "cudnn", "splash"]


@dataclasses.dataclass(frozen=True)
class _KernelCells(timing.TimingFlags):
    """The work and timing fields that the kernel benchmarks share (q, k, v ``[batch, n,
    heads, head_dim]``, windows of ``window`` keys)."""

    window: int = 512
    """Keys of the local masks' window."""
    batch: int = 2
    heads: int = 16
    head_dim: int = 64
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Input dtype; default bfloat16 on an accelerator, float32 on CPU."""
    slow_s: float = 20.0
    """A cell whose warm-up call takes longer than this many seconds is timed by that one
    call."""
    budget_s: float = 10.0
    """Stop repeating a cell once its timed calls have used this many seconds."""
    seed: int = 0

    def _check_cells(self) -> None:
        super().__post_init__()
        timing.check_counts(self, "window", "batch", "heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class KernelsConfig(_KernelCells):
    """Fused and XLA engines for every normalizer under causal, windowed and sink masks,
    forward and forward+backward, with compiled memory; PyTorch peers (SDPA, FlexAttention,
    AdaSplash) on a CUDA machine where torch is importable, each in its own process."""

    lengths: tuple[int, ...] | None = None
    """Sequence lengths; default 4096 ... 131072 on an accelerator, 256 and 512 on CPU (where
    the Pallas kernel runs in interpret mode: a correctness run, not a timing)."""
    normalizers: tuple[str, ...] = ("softmax", "sparsemax", "entmax15", "1.3")
    """Normalizers: names or an α for α-entmax."""
    masks: tuple[KernelMask, ...] = ("causal", "local", "local_sink")
    """causal; local = causal & local(window, 0); local_sink = that | sink(4)."""
    engines: tuple[Engine, ...] | None = None
    """Engines to time; default: xla, blocksparse, pallas, and cudnn (GPU) / splash (TPU)."""
    block: int = 128
    """Block size (query and key) of the block-sparse and Pallas kernels."""
    dense_up_to: int = 16384
    """The dense XLA reference (O(n²) work) is timed up to this length only."""
    repeats: int = 10
    """Timed calls per cell (median), after compilation and a warm-up call."""
    budget_s: float = 20.0
    peers: bool = True
    """Also time the PyTorch peers (GPU only, torch importable)."""
    peers_timeout_s: float = 900.0
    """Wall-clock limit of the peers' process, compilations included (AdaSplash's Triton
    kernels compile for minutes on a first call); the rows it finished are kept, and the notes
    say that it was stopped."""

    def __post_init__(self) -> None:
        self._check_cells()
        timing.check_counts(self, "block", "dense_up_to")
        timing.check_count_tuples(self, "lengths", optional=True)
        _check_normalizer_names(self.normalizers)
        timing.check_seconds(self, "peers_timeout_s")


def _check_normalizer_names(names) -> None:
    for name in names:
        if name not in ("softmax", "sparsemax", "entmax15"):
            try:
                alpha = float(name)
            except ValueError:
                alpha = float("nan")
            if not alpha >= 1.0 or alpha == float("inf"):
                raise ValueError(
                    f"normalizers: {name!r} is neither softmax, sparsemax, entmax15 nor a "
                    "finite α >= 1 (1 is softmax)"
                )


def _mask(name: str, window: int):
    if name == "causal":
        return masks.causal(), "causal"
    local = masks.causal() & masks.local(window, 0)
    if name == "local":
        return local, f"causal & local({window}, 0)"
    return local | masks.sink(4), f"(causal & local({window}, 0)) | sink(4)"


def _work(seed: int, n: int, b: int, h: int, d: int, dtype):
    """The kernel benchmarks' inputs at length ``n``: q, k, v ``[b, n, h, d]`` in ``dtype``
    and a float32 cotangent ``g`` of the same shape, drawn from ``seed + n``."""
    keys = jax.random.split(jax.random.key(seed + n), 4)
    q, k, v, g = (jax.random.normal(key, (b, n, h, d), jnp.float32) for key in keys)
    return (*(x.astype(dtype) for x in (q, k, v)), g)


def _normalizer(name: str):
    return name if name in ("softmax", "sparsemax", "entmax15") else float(name)


def _applies(engine: str, norm, mask, n: int, dtype, config: KernelsConfig) -> str:
    """'' when the engine computes the cell, else why not (shown in the table)."""
    if engine == "xla" and n > config.dense_up_to:
        return f"dense O(n²) above {config.dense_up_to}"
    if engine in ("cudnn", "splash") and norm != "softmax":
        return "softmax only"
    if engine == "cudnn":
        if dtype not in (jnp.bfloat16, jnp.float16):
            return "half precision only"
        try:
            cudnn_mask_arguments(mask)
        except ValueError:
            return "mask not expressible"
    if engine == "pallas" and jax.default_backend() == "cpu" and n > 2048:
        return "interpret mode on CPU: too slow above 2048"
    return ""


def _cells(config, q, k, v, g, mask, norm, engine):
    block = (config.block, config.block)

    def fwd(q, k, v):
        return attention(q, k, v, mask=mask, normalizer=norm, impl=engine, block_size=block)

    def loss(q, k, v, g):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32) * g)

    limits = {"repeats": config.repeats, "slow_s": config.slow_s, "budget_s": config.budget_s}
    grad = jax.grad(loss, argnums=(0, 1, 2))
    return timing.time_fn(fwd, q, k, v, **limits), timing.time_fn(grad, q, k, v, g, **limits)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGINT (``timeout --signal=INT``) during the benchmark: ``markdown`` holds the
    table of the cells measured before it, which ``experiments.bench`` still prints and writes."""

    def __init__(self, markdown: str):
        super().__init__("interrupted")
        self.markdown = markdown


def _peer_rows(config, lengths, dtype_name) -> tuple[list[dict], str]:
    """Runs experiments.bench.peers in its own process, at most ``config.peers_timeout_s``;
    (rows, note). The process prints a row per line as it measures it: a process stopped at the
    limit, or by an interrupt, keeps what it measured."""
    if not config.peers:
        return [], "peers not requested (--no-peers)"
    if jax.default_backend() != "gpu":
        return [], "no PyTorch peers: not a GPU machine"
    if importlib.util.find_spec("torch") is None:
        return [], "no PyTorch peers: torch is not importable (an optional benchmark extra)"
    cells = [
        {"mask": m, "n": n, "normalizer": name, "window": config.window}
        for n in lengths
        for m in config.masks
        for name in config.normalizers
    ]
    request = {
        "batch": config.batch,
        "heads": config.heads,
        "head_dim": config.head_dim,
        "dtype": dtype_name,
        "repeats": config.repeats,
        "cells": cells,
    }
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    command = [sys.executable, "-m", "experiments.bench.peers", json.dumps(request)]
    return _stream_rows(command, env, config.peers_timeout_s)


def _stream_rows(command, env, timeout_s: float) -> tuple[list[dict], str]:
    """(JSON rows printed one per line by ``command``, note), the process killed after
    ``timeout_s`` seconds or on an interrupt (which is raised again once the rows are read)."""
    rows: list[dict] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

        def read():
            for line in proc.stdout:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        stopped = ""
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stopped = f"stopped at its time limit ({timeout_s:.0f} s)"
        except KeyboardInterrupt:
            stopped = "interrupted"
        if stopped:
            proc.kill()
            proc.wait()
        reader.join()
        err.seek(0)
        tail = err.read().strip()[-300:]
    if stopped == "interrupted":
        raise KeyboardInterrupt(rows)
    if stopped:
        return rows, f"the peers' process was {stopped} after {len(rows)} rows"
    if proc.returncode != 0:
        return rows, f"the peers' process failed after {len(rows)} rows: {tail}"
    if not rows:
        return rows, f"no peer rows: {tail}"
    return rows, "peers measured in their own process"


def run_kernels(config: KernelsConfig, command: str) -> str:
    """Returns the markdown of the kernels benchmark (see KernelsConfig)."""
    backend = jax.default_backend()
    accel = backend != "cpu"
    lengths = config.lengths or ((4096, 16384, 65536, 131072) if accel else (256, 512))
    dtype_name = config.dtype or ("bfloat16" if accel else "float32")
    dtype = jnp.dtype(dtype_name)
    engines = config.engines or (
        ("xla", "blocksparse", "pallas")
        + (("cudnn",) if backend == "gpu" else ("splash",) if backend == "tpu" else ())
    )
    b, h, d = config.batch, config.heads, config.head_dim
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    results: dict[tuple, tuple] = {}
    rows = []
    stopped = ""
    try:
        for n in lengths:
            q, k, v, g = _work(config.seed, n, b, h, d, dtype)
            for mask_name in config.masks:
                mask, label = _mask(mask_name, config.window)
                for norm_name in config.normalizers:
                    norm = _normalizer(norm_name)
                    for engine in engines:
                        why = _applies(engine, norm, mask, n, dtype, config)
                        cells: tuple = ()
                        if not why:
                            try:
                                cells = _cells(config, q, k, v, g, mask, norm, engine)
                            except Exception as err:  # OOM or a backend limit: report, go on
                                why = f"{type(err).__name__}: {str(err)[:80]}"
                        results[(n, mask_name, norm_name, engine)] = cells
                        if cells:
                            fwd, both = cells
                            peak = both.peak_bytes
                            rows.append(
                                [label, str(n), norm_name, engine, timing.format_ms(fwd),
                                 timing.format_ms(both),
                                 "–" if peak is None else f"{peak / 2**20:.0f}"]
                            )  # fmt: skip
                            timing.log(
                                f"[{time.perf_counter() - start:6.0f} s] n={n} {label} {norm_name} "
                                f"{engine}: {both.median_ms:.2f} ms fwd+bwd"
                            )
                        else:
                            rows.append([label, str(n), norm_name, engine, "–", "–", why])
        peer_rows, peer_note = _peer_rows(config, lengths, dtype_name)
    except KeyboardInterrupt as stop:  # keep the table measured so far (see Interrupted)
        peer_rows = stop.args[0] if stop.args and isinstance(stop.args[0], list) else []
        peer_note = "interrupted" + (f" after {len(peer_rows)} rows" if peer_rows else "")
        stopped = (
            f"INTERRUPTED after {time.perf_counter() - start:.0f} s: the cells missing from "
            "the table were not measured."
        )
    for row in peer_rows:
        label = _mask(row["mask"], config.window)[1]
        if "error" in row:
            rows.append(
                [label, str(row["n"]), row["normalizer"], row["peer"], "–", "–", row["error"]]
            )
        else:
            rows.append(
                [label, str(row["n"]), row["normalizer"], row["peer"], f"{row['fwd_ms']:.2f}",
                 f"{row['fwd_bwd_ms']:.2f}", "–"]
            )  # fmt: skip
    headers = ["mask", "n", "normalizer", "engine", "fwd ms", "fwd+bwd ms", "peak MiB / note"]
    table = timing.markdown_table(headers, rows, align="lrllrrl")
    findings = _findings(results, peer_rows, lengths, config)
    elapsed = time.perf_counter() - start
    notes = [
        f"q, k, v [{b}, n, {h}, {d}] {dtype_name}; blocks {config.block}; fwd+bwd = gradient of "
        f"sum(out * g) w.r.t. q, k, v; median of {config.repeats} calls after compilation and a "
        "warm-up call (†k: only k calls). Peak MiB: XLA's compiled buffer assignment.",
        f"Peers: {peer_note}.",
        *(
            f"{row['peer']} (n={row['n']}, {row['normalizer']}): Triton's autotuner chose "
            + "; ".join(f"{kernel}: {config}" for kernel, config in row["autotuned"].items())
            for row in peer_rows
            if row.get("autotuned")
        ),
        *findings,
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
        *([stopped] if stopped else []),
    ]
    markdown = "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
    if stopped:
        raise Interrupted(markdown)
    return markdown


def _findings(results, peer_rows, lengths, config) -> list[str]:
    """The issue's targets, 'met' or 'MISSED', from the cells of this run."""

    def ours(n, mask, norm, engine="pallas"):
        cells = results.get((n, mask, norm, engine))
        return cells[1].median_ms if cells else None

    def peer(n, mask, norm, name):
        for row in peer_rows:
            if (row["n"], row["mask"], row["normalizer"], row["peer"]) == (n, mask, norm, name):
                return row.get("fwd_bwd_ms")
        return None

    out = []

    def check(text, value, target, better="<="):
        if value is None:
            return
        ok = value <= target if better == "<=" else value >= target
        out.append(f"{'met' if ok else 'MISSED'}: {text} {value:.2f} (target {better} {target})")

    for n in lengths:
        if n < 16384:
            continue
        mine, ref = ours(n, "causal", "entmax15"), peer(n, "causal", "entmax15", "adasplash-2")
        if mine and ref:
            check(f"n={n} 1.5-entmax causal: pallas / AdaSplash-2 fwd+bwd", mine / ref, 1.0)
        mine, ref = ours(n, "causal", "sparsemax"), peer(n, "causal", "sparsemax", "adasplash-1")
        if mine and ref:
            check(f"n={n} sparsemax causal: AdaSplash-1 / pallas", ref / mine, 3.0, ">=")
        for norm in ("sparsemax", "entmax15"):
            mine, soft = ours(n, "local", norm), ours(n, "local", "softmax")
            if mine and soft:
                check(f"n={n} {norm} local: pallas / pallas softmax", mine / soft, 2.0)
        for mask in config.masks:
            mine, ref = ours(n, mask, "softmax"), peer(n, mask, "softmax", "flex")
            if mine and ref:
                check(f"n={n} softmax {mask}: pallas / FlexAttention", mine / ref, 1.3)
        mine, ref = ours(n, "causal", "softmax"), ours(n, "causal", "softmax", "cudnn")
        if mine and ref:
            check(f"n={n} softmax causal: pallas / cuDNN", mine / ref, 1.5)
    if 16384 in lengths and 65536 in lengths:
        for norm in config.normalizers:
            small, large = ours(16384, "local", norm), ours(65536, "local", norm)
            if small and large:
                check(f"{norm} local: pallas time growth 16384 -> 65536", large / small, 4.5)
    return out


@dataclasses.dataclass(frozen=True)
class TuningConfig(_KernelCells):
    """The fused Pallas kernels' tiles and Triton options on the kernels benchmark's work:
    every combination of forward tile, backward tiles, warps per program and pipelining stages,
    on the layout of one block size, timed in one run, forward and forward+backward, and the
    fastest per cell against ``pallas_attention``'s defaults (tiles of
    ``kernels.TRITON_TILE`` in both passes, its default warps, 2 stages). On CPU the
    kernels run interpreted, where warps and stages mean nothing: a check that every
    combination runs, not a timing."""

    lengths: tuple[int, ...] | None = None
    """Sequence lengths; default 16384 on an accelerator, 256 on CPU (interpret mode, where
    lengths above 2048 are refused: hours)."""
    normalizers: tuple[str, ...] = ("softmax", "sparsemax")
    """Normalizers: names or an α for α-entmax."""
    masks: tuple[KernelMask, ...] = ("causal", "local")
    """causal; local = causal & local(window, 0); local_sink = that | sink(4)."""
    layout_block: int = 128
    """The layout's block size, query and key (``attention``'s ``block_size``)."""
    forward_blocks: tuple[str, ...] = ("128", "64")
    """Tiles of the forward (``forward_block``) cut from the layout's blocks: ``"64"`` for
    64 x 64, ``"64x128"`` for 64 query rows by 128 keys; powers of two >= 16, at most
    ``layout_block``."""
    backward_blocks: tuple[str, ...] = ("0",)
    """Tiles of the backward kernels (``backward_block``), written the same way; ``"0"``: the
    forward's tile. Each is combined with the forward tiles it divides (the kernels cut the
    backward's tiles from the forward's)."""
    dq_blocks: tuple[str, ...] = ("0",)
    """Tiles of the dq kernel alone (``dq_block``), written the same way; ``"0"``: the
    backward's. Combined like ``backward_blocks``, and with ``dq_accumulation`` "separate"
    only (atomic adds form dq on the dk/dv kernel's tiles)."""
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2, 3)
    dq_accumulation: tuple[Literal["separate", "atomic"], ...] = ("separate",)
    """How the backward forms dq (``pallas_attention``'s ``dq_accumulation``): a kernel of its
    own, or atomic adds in the dk/dv kernel."""
    prefetch: tuple[bool, ...] = (False,)
    """``pallas_attention``'s ``prefetch``: the sparse normalizers' operand loads before the
    test that skips blocks without weight (True) or inside it. Softmax skips none: its rows
    are timed once, at False."""

    def __post_init__(self) -> None:
        self._check_cells()
        timing.check_count_tuples(self, "lengths", optional=True)
        if not self.dq_accumulation or any(
            mode not in ("separate", "atomic") for mode in self.dq_accumulation
        ):
            raise ValueError(f"dq_accumulation must name 'separate' and/or 'atomic', got "
                             f"{self.dq_accumulation!r}")  # fmt: skip
        timing.check_count_tuples(self, "num_warps", "num_stages")
        timing.check_counts(self, "layout_block")
        if self.layout_block < 16 or self.layout_block & (self.layout_block - 1):
            raise ValueError(f"layout_block: {self.layout_block} is not a power of two >= 16")
        if not self.forward_blocks:
            raise ValueError("forward_blocks must name at least one tile")
        for text in self.forward_blocks:
            if max(parse_tile(text, "forward_blocks")) > self.layout_block:
                raise ValueError(f"forward_blocks: {text} is larger than the layout's "
                                 f"blocks ({self.layout_block})")  # fmt: skip
        for name in ("backward_blocks", "dq_blocks"):
            if not getattr(self, name):
                raise ValueError(f"{name} must name at least one tile (0: the default)")
            for text in getattr(self, name):
                parse_tile(text, name, zero=True)
        if any(w not in (1, 2, 4, 8, 16) for w in self.num_warps):
            raise ValueError(f"num_warps must be among 1, 2, 4, 8, 16, got {self.num_warps!r}")
        _check_normalizer_names(self.normalizers)


def parse_tile(text: str, name: str, *, zero: bool = False) -> tuple[int, int] | None:
    """A tile of the tuning benchmark's flags as ``(bq, bkv)``: ``"64"`` is ``(64, 64)``,
    ``"64x128"`` ``(64, 128)``; ``"0"`` (where ``zero``) is None, the forward's tile. Raises
    ValueError naming the flag for anything else.

    Example:
      >>> parse_tile("64x128", "forward_blocks"), parse_tile("32", "forward_blocks")
      ((64, 128), (32, 32))
    """
    if zero and text.strip() == "0":
        return None
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"{name}: {text!r} is not a tile: N for N x N or BQxBKV, e.g. 64x128"
                         + (", or 0 for the forward's tile" if zero else ""))  # fmt: skip
    sizes = [int(part) for part in parts]
    if any(size < 16 or size & (size - 1) for size in sizes):
        raise ValueError(f"{name}: {text} is not a power of two >= 16 (or two: BQxBKV)")
    return (sizes[0], sizes[-1])


def _tile_name(tile: tuple[int, int]) -> str:
    """``(64, 64)`` -> ``"64"``, ``(64, 128)`` -> ``"64x128"``: as the flags write tiles."""
    return str(tile[0]) if tile[0] == tile[1] else f"{tile[0]}x{tile[1]}"


def _tuned_cells(q, k, v, g, layout, options: dict, limits: dict):
    """(forward, forward+backward) timings of pallas_attention with these options."""
    from sparse_jax.kernels import pallas_attention

    def fwd(q, k, v):
        return pallas_attention(q, k, v, layout, **options)

    def loss(q, k, v, g):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32) * g)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    return timing.time_fn(fwd, q, k, v, **limits), timing.time_fn(grad, q, k, v, g, **limits)


def run_tuning(config: TuningConfig, command: str) -> str:
    """Returns the markdown of the Pallas tuning benchmark (see TuningConfig)."""
    accel = jax.default_backend() != "cpu"
    dtype_name = config.dtype or ("bfloat16" if accel else "float32")
    lengths = config.lengths or ((16384,) if accel else (256,))
    skipped = [n for n in lengths if not accel and n > 2048]
    lengths = [n for n in lengths if n not in skipped]
    b, h, d = config.batch, config.heads, config.head_dim
    default_warps = 4 if d <= 64 else 8
    default_tile = min(config.layout_block, TRITON_TILE)
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    rows, best, defaults = [], {}, {}
    limits = {"repeats": config.repeats, "slow_s": config.slow_s, "budget_s": config.budget_s}
    stopped = ""
    # (forward, backward, dq kernel) tiles: each backward tile with the forward tiles it divides
    forward_tiles = [parse_tile(t, "forward_blocks") for t in config.forward_blocks]
    backward_tiles = [parse_tile(t, "backward_blocks", zero=True) for t in config.backward_blocks]
    dq_tiles = [parse_tile(t, "dq_blocks", zero=True) for t in config.dq_blocks]

    def divides(tile, block):
        return block[0] % tile[0] == 0 and block[1] % tile[1] == 0

    tiles = [(block, bwd, dq) for block in dict.fromkeys(forward_tiles)
             for bwd in dict.fromkeys(tile or block for tile in backward_tiles)
             if divides(bwd, block)
             for dq in dict.fromkeys(tile or bwd for tile in dq_tiles)
             if divides(dq, block)]  # fmt: skip
    try:
        for n in lengths:
            q, k, v, g = _work(config.seed, n, b, h, d, dtype_name)
            knobs = (config.num_warps, config.num_stages, config.dq_accumulation, config.prefetch)
            choices = itertools.product(config.masks, config.normalizers, tiles, *knobs)
            layouts = {}  # mask -> (layout, label): built once per length
            for mask_name, norm_name, (block, bwd, dq_tile), warps, stages, dq, prefetch in choices:
                if prefetch and norm_name == "softmax":
                    continue  # (the same kernels)
                if dq == "atomic" and dq_tile != bwd:
                    continue  # (dq formed on the dk/dv kernel's tiles)
                if mask_name not in layouts:
                    mask, label = _mask(mask_name, config.window)
                    size = config.layout_block
                    layouts[mask_name] = mask.blocks(n, n, size, size), label
                layout, label = layouts[mask_name]
                options = {"normalizer": _normalizer(norm_name), "num_warps": warps,
                           "num_stages": stages, "forward_block": block,
                           "backward_block": bwd, "dq_block": dq_tile, "dq_accumulation": dq,
                           "prefetch": prefetch}  # fmt: skip
                cell = (label, n, norm_name)
                backward = _tile_name(bwd)
                if dq_tile != bwd:
                    backward += f", dq {_tile_name(dq_tile)}"
                row = [label, str(n), norm_name, _tile_name(block), backward, str(warps),
                       str(stages), dq, "yes" if prefetch else "no"]  # fmt: skip
                try:
                    one, both = _tuned_cells(q, k, v, g, layout, options, limits)
                except Exception as err:  # a tile too large for the chip: say so, go on
                    rows.append([*row, "–", "–", f"{type(err).__name__}: {str(err)[:60]}"])
                    continue
                ms = both.median_ms
                rows.append([*row, timing.format_ms(one), timing.format_ms(both), ""])
                timing.log(
                    f"[{time.perf_counter() - start:6.0f} s] n={n} {label} {norm_name} tile "
                    f"{_tile_name(block)} backward {backward} warps {warps} stages "
                    f"{stages} dq {dq} prefetch "
                    f"{prefetch}: {ms:.2f} ms fwd+bwd"
                )
                if cell not in best or ms < best[cell][0]:
                    best[cell] = (ms, block, backward, warps, stages, dq, prefetch)
                tile = (default_tile, default_tile)
                default = (tile, tile, tile, default_warps, 2, "separate", False)
                if (block, bwd, dq_tile, warps, stages, dq, prefetch) == default:
                    defaults[cell] = ms
    except KeyboardInterrupt:  # keep the table measured so far (see Interrupted)
        stopped = (
            f"INTERRUPTED after {time.perf_counter() - start:.0f} s: the combinations missing "
            "from the table were not measured."
        )
    headers = ["mask", "n", "normalizer", "fwd tile", "bwd tile", "warps", "stages", "dq",
               "prefetch", "fwd ms", "fwd+bwd ms", "note"]  # fmt: skip
    table = timing.markdown_table(headers, rows, align="lrlrrrrllrrl")
    notes = [
        f"q, k, v [{b}, n, {h}, {d}] {dtype_name}; pallas_attention on the layout of blocks "
        f"{config.layout_block}, the forward's tiles (forward_block) and the backward's "
        f"(backward_block; 'dq': the dq kernel's, dq_block) cut from them; defaults: tiles "
        f"{default_tile}, {default_warps} warps, 2 stages, dq by its own kernel (separate; "
        f"atomic: by the dk/dv kernel), no prefetch; "
        f"fwd+bwd = gradient of sum(out * g) w.r.t. q, k, v; median of "
        f"{config.repeats} calls after compilation and a warm-up call."
        + ("" if accel else " CPU: interpret mode (warps and stages unused): not a timing."),
        *(f"n={n}: not run (interpret mode on CPU: too slow above 2048)" for n in skipped),
    ]
    for (label, n, norm_name), (ms, block, bwd, warps, stages, dq, pf) in best.items():
        default = defaults.get((label, n, norm_name))
        versus = f" (defaults {default:.2f} ms: {default / ms:.2f}x)" if default else ""
        notes.append(
            f"fastest, {label} n={n} {norm_name}: tiles {_tile_name(block)}, backward tiles "
            f"{bwd}, {warps} "
            f"warps, {stages} stages, dq {dq}, prefetch {'yes' if pf else 'no'}, {ms:.2f} ms "
            f"fwd+bwd{versus}"
        )
    notes.append(f"Total wall time {time.perf_counter() - start:.0f} s.")
    notes += [stopped] if stopped else []
    markdown = "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
    if stopped:
        raise Interrupted(markdown)
    return markdown


@dataclasses.dataclass(frozen=True)
class ForwardPassesConfig(_KernelCells):
    """Where the sparse forward's time goes: the Triton forward kernel timed with each query
    tile's threshold search stopped after 0, 1, 2, ... passes (``kernels.flash.capped_forward``:
    inexact thresholds, the same work per pass), beside the full sparse forward and the softmax
    forward on the same layout. The step from k to k + 1 passes is what one search pass costs;
    at 0 passes, the first pass (maximum and largest values) and the output pass (two products
    with the values); 1.5-entmax's polishing, where a row needs it, is one of its search
    passes. The capped forwards take an output pass in every tile; the full forward only in
    the tiles whose last search pass did not accumulate and confirm the output (sparsemax,
    1.5-entmax), and the row "to the end, output pass" is the full forward taking it in every
    tile, as before the passes accumulated. On CPU the kernels run interpreted: a check that
    it runs, not a timing."""

    lengths: tuple[int, ...] | None = None
    """Sequence lengths; default 16384 on an accelerator, 256 on CPU."""
    normalizers: tuple[Literal["sparsemax", "entmax15"], ...] = ("sparsemax", "entmax15")
    masks: tuple[KernelMask, ...] = ("causal", "local")
    """causal; local = causal & local(window, 0); local_sink = that | sink(4)."""
    passes: tuple[int, ...] = (0, 1, 2, 3)
    """Search passes at which the search is stopped (ints >= 0, increasing)."""
    start_values: tuple[int, ...] = ()
    """Also the whole forward with the search started from this many of the row's large values
    (``capped_forward(start_values=...)``; the kernels' default: 16 for sparsemax, 32 for
    1.5-entmax): what more values cost in the first pass against the search passes they save
    (``bench search_passes --top`` counts those)."""
    block: int = 128
    """The layout's block size (the kernels' default tiles are cut from it)."""

    def __post_init__(self) -> None:
        self._check_cells()
        timing.check_counts(self, "block")
        timing.check_count_tuples(self, "lengths", optional=True)
        if self.start_values:
            timing.check_count_tuples(self, "start_values")
        if not self.passes or any(
            isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in self.passes
        ):
            raise ValueError(f"passes must be ints >= 0, got {self.passes!r}")
        if list(self.passes) != sorted(set(self.passes)):
            raise ValueError(f"passes must increase, got {self.passes!r}")


def run_forward_passes(config: ForwardPassesConfig, command: str) -> str:
    """Returns the markdown of the forward-passes benchmark (see ForwardPassesConfig)."""
    from sparse_jax.kernels import flash, pallas_attention

    accel = jax.default_backend() != "cpu"
    dtype_name = config.dtype or ("bfloat16" if accel else "float32")
    lengths = config.lengths or ((16384,) if accel else (256,))
    b, h, d = config.batch, config.heads, config.head_dim
    start = time.perf_counter()
    header = timing.environment_line(command)
    timing.log(header)
    limits = {"repeats": config.repeats, "slow_s": config.slow_s, "budget_s": config.budget_s}
    rows, findings, stopped = [], [], ""
    try:
        for n in lengths:
            q, k, v, _ = _work(config.seed, n, b, h, d, dtype_name)
            for mask_name in config.masks:
                mask, label = _mask(mask_name, config.window)
                layout = mask.blocks(n, n, config.block, config.block)

                def full(q, k, v, normalizer, layout=layout):
                    return pallas_attention(q, k, v, layout, normalizer=normalizer)

                soft = timing.time_fn(functools.partial(full, normalizer="softmax"), q, k, v,
                                      **limits)  # fmt: skip
                rows.append([label, str(n), "softmax", "–", timing.format_ms(soft), "–"])
                for norm in config.normalizers:
                    whole = timing.time_fn(functools.partial(full, normalizer=norm), q, k, v,
                                           **limits)  # fmt: skip
                    capped = []
                    capped_of = functools.partial(flash.capped_forward, layout=layout,
                                                  normalizer=norm)  # fmt: skip
                    for cap in config.passes:
                        fwd = functools.partial(capped_of, search_passes=cap)
                        cell = timing.time_fn(fwd, q, k, v, **limits)
                        step = "–"
                        if capped:
                            last_cap, last = capped[-1]
                            step = f"{(cell.median_ms - last.median_ms) / (cap - last_cap):.2f}"
                        capped.append((cap, cell))
                        rows.append([label, str(n), norm, str(cap), timing.format_ms(cell), step])
                    rows.append([label, str(n), norm, "to the end", timing.format_ms(whole), "–"])
                    # Their search passes accumulate the output: the forward without that.
                    if norm in ("sparsemax", "entmax15"):
                        fwd = functools.partial(capped_of, search_passes=None, speculate=False)
                        cell = timing.time_fn(fwd, q, k, v, **limits)
                        rows.append([label, str(n), norm, "to the end, output pass",
                                     timing.format_ms(cell), "–"])  # fmt: skip
                    for top in config.start_values:
                        started = functools.partial(capped_of, search_passes=None,
                                                    start_values=top)  # fmt: skip
                        cell = timing.time_fn(started, q, k, v, **limits)
                        rows.append([label, str(n), norm, f"to the end, start {top}",
                                     timing.format_ms(cell), "–"])  # fmt: skip
                    (c0, t0), (c1, t1) = capped[0], capped[-1]
                    if c1 > c0:
                        per_pass = (t1.median_ms - t0.median_ms) / (c1 - c0)
                        implied = (
                            f"is as {(whole.median_ms - t0.median_ms) / per_pass:.1f} search "
                            "passes" if per_pass > 0 else "(no cost per pass resolved)"
                        )  # fmt: skip
                        findings.append(
                            f"{label} n={n} {norm}: {t0.median_ms:.2f} ms at {c0} passes, "
                            f"{per_pass:.2f} ms per search pass ({c0}-{c1}), softmax's whole "
                            f"forward {soft.median_ms:.2f} ms; the full forward "
                            f"({whole.median_ms:.2f} ms) {implied}"
                        )
                    timing.log(
                        f"[{time.perf_counter() - start:6.0f} s] n={n} {label} {norm}: "
                        f"{whole.median_ms:.2f} ms"
                    )
    except KeyboardInterrupt:  # keep the table measured so far (see Interrupted)
        stopped = (
            f"INTERRUPTED after {time.perf_counter() - start:.0f} s: the cells missing from the "
            "table were not measured."
        )
    headers = ["mask", "n", "normalizer", "search passes", "fwd ms", "ms per pass"]
    table = timing.markdown_table(headers, rows, align="lrlrrr")
    notes = [
        f"q, k, v [{b}, n, {h}, {d}] {dtype_name}; layouts of blocks {config.block}, the "
        "kernels' default tiles; forward only (kernels.flash.capped_forward: the search stopped "
        "after that many passes, the thresholds then inexact; 'to the end': pallas_attention; "
        "'start k': capped_forward to the end, its start from k of the row's largest values; "
        "'output pass': to the end with an output pass in every tile, not only where "
        "the last search pass did not confirm the thresholds (capped_forward(speculate=False), "
        "as every capped row above); "
        f"median of {config.repeats} calls after compilation and a warm-up call; ms per pass: "
        "the step from the row above." + ("" if accel else " CPU: interpret mode: not a timing."),
        *findings,
        f"Total wall time {time.perf_counter() - start:.0f} s.",
    ]
    notes += [stopped] if stopped else []
    markdown = "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
    if stopped:
        raise Interrupted(markdown)
    return markdown
