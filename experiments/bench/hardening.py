"""``python -m experiments.bench hardening``: a hardened sparse GPT against the dense one, the
same weights, in the same run."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.common import timing
from experiments.common.measure import attention_core_call
from sparse_jax import masks
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config, harden
from sparse_jax.models.flops import model_flops


@dataclasses.dataclass(frozen=True)
class HardeningConfig(timing.TimingFlags):
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
    """Timed calls per cell; the median is reported."""

    def __post_init__(self) -> None:
        super().__post_init__()
        timing.check_counts(self, "layers", "width", "heads", "vocab", "block")
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
        # Attention alone at the model's shapes: block 0's attention core (what the model
        # runs: the dense one's causal xla engine, the hardened per-head pattern at its heads'
        # blocks) on one block's q, k, v.
        hd = config.width // config.heads
        q, k, v = (
            jax.random.normal(kk, (1, n, config.heads, hd), jnp.float32)
            for kk in jax.random.split(jax.random.key(n + 1), 3)
        )
        calls = [attention_core_call(m.h[0].attn.core, q, k, v) for m in (dense, hard)]
        attn_dense, attn_hard = (timing.time_fn(fn, *args, **limits) for fn, args in calls)
        core = hard.h[0].attn.core
        head_blocks = ", ".join(
            f"head {h} {core.head_block_size(h)[0]}" for h in range(config.heads)
        )
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
        f"impl='auto' (block-sparse, layer blocks {config.block}, each head at the blocks "
        f"harden() chose for it: {head_blocks}); dense = impl='xla' with the same weights.",
        "GFLOPs = analytic forward FLOPs (sparse_jax.models.flops: matmuls, the score entries each "
        "implementation forms); forward ms = whole model; attention ms = block 0's attention "
        "core alone, as the model runs it (dense causal vs the hardened per-head pattern at its "
        "heads' blocks); attn ratio = hardened attention "
        "/ (density x dense attention); peak MiB = XLA buffer assignment of the forward pass.",
        config.dagger_note(),
        *findings,
        f"Total wall time {elapsed:.0f} s; load average at the end {timing.load_average()}.",
    ]
    return "\n".join([header, "", table, "", *(f"- {note}" for note in notes)]) + "\n"
