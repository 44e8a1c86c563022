"""python -m experiments.cascade — CANDS: a language model whose later blocks see fewer heads,
FFN units and tokens, against a dense GPT-2 of the same shape, data, steps and seed.

    python -m experiments.cascade                       # the embedded corpus, a few minutes
    python -m experiments.cascade --data.source ../shared/data/wikitext-2 --train.steps 1500 \
        --model.final-keep 0.3                          # the WikiText-2 study
    python -m experiments.cascade --sweep 0.7 0.5 0.3   # Pareto: perplexity against FLOPs

Phases: the dense baseline (``GPT2``), the cascade (:class:`sparse_jax.models.cascade.CascadeLM`,
cross entropy plus the Lagrangian that drives each block's expected keep ratios to their
targets), then the measurements: perplexity of both on the evaluation split (the cascade with
hard gates, which is exactly its pruned model), analytic FLOPs per token (the tokens, heads and
units each block keeps on the evaluation text), and tokens/s of the pruned model (closed heads
and units cut out of the weights, kept tokens gathered) against the dense one at the training
length and at 4x, on evaluation text, in this run. Each phase checkpoints (``--run.resume``
with ``--run.dir`` continues a run); the run folder holds ``config.json``, ``metrics.jsonl``,
``summary.json``, ``report.md`` and its plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx

from experiments import measure
from experiments.distill_run import write_text_atomically
from experiments.flags import check_max_minutes, check_resume, flag_name, set_ints_at_least
from experiments.phase import main_of, stop_request, train_phase
from sparse_jax.data import text
from sparse_jax.models import GPT2, GPT2Config
from sparse_jax.models.cascade import CascadeConfig, CascadeLM, cascade_flops
from sparse_jax.models.gpt2 import PRESETS
from sparse_jax.training.loop import TrainConfig
from sparse_jax.training.losses import cross_entropy_loss
from sparse_jax.training.stopping import StopRequest


@dataclasses.dataclass(frozen=True)
class Data:
    source: str = "default"
    """Corpus: 'default' (the embedded CPython documentation topics), a WikiText-2 folder, a
    .txt file or folder, or tfds:<name> (as the main job reads them)."""
    seq_len: int = 128
    """Training length T (the speed is also measured at 4 T)."""
    batch_size: int = 8
    """Sequences per update."""


@dataclasses.dataclass(frozen=True)
class Model:
    size: str = "cpu-small"
    """GPT-2 size preset of both models (sparse_jax.models.gpt2.PRESETS)."""
    keep_ratios: tuple[float, ...] | None = None
    """Target kept fraction of tokens, heads and units per block, r_1 = 1 >= r_2 >= ... (None:
    from 1 down to --model.final-keep, linearly)."""
    final_keep: float = 0.4
    """The last block's target when --model.keep-ratios is not given (how it was chosen:
    docs/results.md, the cascade)."""
    gate: Literal["hard_concrete", "sigmoid_ste"] = "hard_concrete"
    """Gate kind: Hard Concrete L0 gates, or the published sigmoid with a straight-through
    estimator."""
    penalty: Literal["lagrangian", "l1"] = "lagrangian"
    """How the targets are pursued: CoFi's Lagrangian, or the published λ Σ sigmoid(z)."""
    l1_weight: float = 0.01
    """λ of --model.penalty l1."""
    head_keep: tuple[float, ...] | None = None
    """Target kept fraction of heads per block (None: --model.keep-ratios)."""
    unit_keep: tuple[float, ...] | None = None
    """Target kept fraction of FFN units per block (None: --model.keep-ratios)."""
    nested_heads: bool = True
    """A head closed in block l stays closed in every later block (SpAtten's cascade)."""
    capacity_slack: float = 0.125
    """The pruned model's token slots per block: its keep target plus this fraction of T (at
    most T), one compiled call; a batch that keeps more is rerun exactly and counted."""
    score_scaling: bool = False
    """The CANDS code's module instead (head gates scale the attention scores): prunes nothing."""


@dataclasses.dataclass(frozen=True)
class Train:
    steps: int = 400
    """Updates of each model."""
    lr: float = 3e-3
    """Peak learning rate (warm-up, cosine decay)."""
    gate_lr_multiplier: float = 1.0
    """Learning-rate multiplier of the gates, routers and Lagrange multipliers (faster
    multipliers oscillate: docs/results.md, the cascade)."""


@dataclasses.dataclass(frozen=True)
class Run:
    dir: pathlib.Path | None = None
    """Run folder (default: runs/cascade-<date>-<time>)."""
    resume: bool = False
    """Continue the run in --run.dir from its last checkpoints."""
    seed: int = 0
    """Seed of both models' initial weights, of the batches and of the gate samples."""
    checkpoint_every: int = 100
    """Updates between checkpoints (and evaluations)."""
    cache_dir: pathlib.Path = pathlib.Path("~/.cache/sparse_jax")
    """Where the prepared corpus is cached."""
    eval_batches: int = 8
    """Evaluation batches of --data.batch-size windows."""
    max_minutes: float | None = None
    """Stop training after this many minutes of the command, with a checkpoint of the step
    reached (as on SIGTERM or Ctrl-C), and exit with status 75: the same command with
    --run.resume continues."""


@dataclasses.dataclass(frozen=True)
class CascadeExperiment:
    """python -m experiments.cascade: dense GPT-2 against the CANDS cascade."""

    data: Data = Data()
    model: Model = Model()
    train: Train = Train()
    run: Run = Run()
    sweep: tuple[float, ...] = ()
    """Also train cascades whose last block keeps these fractions (schedules from 1 down to
    each, linearly) for a Pareto plot of perplexity against FLOPs."""

    def __post_init__(self):
        d, t = self.data, self.train
        set_ints_at_least(d, "data", seq_len=2, batch_size=1)
        set_ints_at_least(t, "train", steps=1)
        set_ints_at_least(self.run, "run", checkpoint_every=1, eval_batches=1)
        if self.model.size not in PRESETS:
            raise ValueError(
                f"--model.size {self.model.size!r} is not a preset; allowed: {list(PRESETS)}"
            )
        for name, value in (
            ("--train.lr", t.lr),
            ("--train.gate-lr-multiplier", t.gate_lr_multiplier),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0; got {value!r}")
        if self.run.resume and self.run.dir is None:
            raise ValueError("--run.resume needs the --run.dir of the run to continue")
        check_max_minutes(self.run.max_minutes)
        slack = self.model.capacity_slack
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack <= 1:
            raise ValueError(f"--model.capacity-slack must be a number in [0, 1]; got {slack!r}")
        if not 0 < self.model.final_keep <= 1:
            raise ValueError(
                f"--model.final-keep must lie in (0, 1]; got {self.model.final_keep!r}"
            )
        for r in self.sweep:
            if not 0 < r <= 1:
                raise ValueError(f"--sweep ratios must lie in (0, 1]; got {list(self.sweep)}")
        sizes = GPT2Config.preset(self.model.size)
        if 4 * d.seq_len > sizes.n_positions:
            raise ValueError(
                f"--data.seq-len {d.seq_len}: the speed is measured at 4 x {d.seq_len} = "
                f"{4 * d.seq_len} tokens, more than --model.size {self.model.size!r}'s "
                f"{sizes.n_positions} positions"
            )
        try:  # the model's own checks, named by their flags
            self.cascade_config(vocab_size=257)
        except (ValueError, TypeError) as err:
            flag = next(
                (
                    flag_name(f"model.{n}")
                    for n in ("head_keep", "unit_keep")
                    if f"`{n}`" in str(err)
                ),
                "--model.keep-ratios",
            )
            raise ValueError(f"{flag}: {err}") from err

    def cascade_config(self, vocab_size: int, keep_ratios=None) -> CascadeConfig:
        """The cascade's config; ``keep_ratios`` (a sweep point) replaces every target."""
        m = self.model
        sweep = keep_ratios is not None
        g = GPT2Config.preset(m.size, vocab_size=vocab_size)
        if not sweep:
            keep_ratios = m.keep_ratios or linear_schedule(m.final_keep, g.n_layer)
        config = CascadeConfig(
            g,
            keep_ratios=keep_ratios,
            head_keep=None if sweep else m.head_keep,
            unit_keep=None if sweep else m.unit_keep,
            gate=m.gate,
            penalty=m.penalty,
            l1_weight=m.l1_weight,
            score_scaling=m.score_scaling,
            nested_heads=m.nested_heads,
        )
        if m.score_scaling:  # no token gates: every block keeps every token
            return config
        slots = [1.0] + [min(1.0, r + m.capacity_slack) for r in config.keep_ratios[1:]]
        return dataclasses.replace(config, capacity=tuple(slots))


def linear_schedule(final: float, blocks: int) -> tuple[float, ...]:
    """Keep targets from 1 (block 1) down to ``final`` (the last block), linearly."""
    return tuple(1.0 - (1.0 - final) * i / max(blocks - 1, 1) for i in range(blocks))


def log(msg: str) -> None:
    print(f"[cascade] {msg}", file=sys.stderr, flush=True)


def _lm_loss(model, batch, rng):
    ce, _ = cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])
    return ce, {"ce": ce}


def _cascade_loss(model, batch, rng):
    """Cross entropy plus the cascade's penalty; the expected keep ratios as metrics."""
    logits, aux = model(batch[:, :-1], rngs=nnx.Rngs(gates=rng), return_aux=True)
    ce, _ = cross_entropy_loss(logits, batch[:, 1:])
    keep = aux["expected_keep"]
    metrics = {"ce": ce, "penalty": aux["penalty"]}
    metrics |= {f"keep_tokens_{i}": keep[i, 0] for i in range(keep.shape[0])}
    return ce + aux["penalty"], metrics


def _phase(cfg: CascadeExperiment, folder: pathlib.Path, name: str, model, loss_fn, data, stop):
    """Trains (or resumes) one model (:func:`experiments.phase.train_phase`)."""
    t = cfg.train
    tc = TrainConfig(
        steps=t.steps,
        batch_size=cfg.data.batch_size,
        learning_rate=t.lr,
        warmup_steps=min(50, t.steps // 10),
        fast_params="gate/logits|router|lagrange",
        fast_lr_multiplier=t.gate_lr_multiplier,
        seed=cfg.run.seed,
    )
    trainer, _ = train_phase(
        model, loss_fn, tc, data.train, folder=folder, name=name,
        checkpoint_every=cfg.run.checkpoint_every, resume=cfg.run.resume, log=log, shown="ce",
        stop=stop,
    )  # fmt: skip
    return trainer.sync_model()


def _tokens_per_s(fn, ids, repeats: int = 5) -> float:
    """Tokens per second of ``fn(ids)`` (outputs ready), median of repeats after two warm-up
    calls (compilation excluded; the pruned model's host-side routing included)."""
    for _ in range(2):
        jax.block_until_ready(fn(ids))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(ids))
        times.append(time.perf_counter() - start)
    return ids.size / float(np.median(times))


def _long_text(data, seq_len: int, count: int) -> np.ndarray:
    """``count`` sequences of ``seq_len`` tokens of evaluation text (consecutive windows)."""
    per = data.eval[0].shape[0] - 1
    need = -(-seq_len // per)
    rows = []
    for i in range(count):
        parts = [np.asarray(data.eval[(i * need + j) % len(data.eval)])[:per] for j in range(need)]
        rows.append(np.concatenate(parts)[:seq_len])
    return np.stack(rows).astype(np.int32)


def _measure(cfg, data, dense, cascade, windows) -> dict:
    g = dense.config
    t = cfg.data.seq_len
    dense_nll, _ = measure.evaluate_lm(dense, windows)
    cascade_nll, _ = measure.evaluate_lm(cascade, windows)  # rngs=None: hard gates
    ids = jnp.asarray(windows[:, :-1])
    dense_flops = (
        cascade_flops(
            g, t, [t] * g.n_layer, [g.n_head] * g.n_layer, [g.inner(i) for i in range(g.n_layer)]
        )
        / t
    )
    pruned = cascade.prune()
    keep = cascade.keep_ratio(ids)
    graphdef, state = nnx.split(dense)
    dense_fn = jax.jit(lambda ids: nnx.merge(graphdef, state)(ids))
    speed = {}
    for length in (t, 4 * t):
        text_ids = jnp.asarray(_long_text(data, length, 1))
        speed[str(length)] = {
            "dense_tokens_per_s": _tokens_per_s(dense_fn, text_ids),
            "pruned_tokens_per_s": _tokens_per_s(pruned.logits, text_ids),
        }
    return {
        "dense": {
            "ppl": math.exp(dense_nll),
            "flops_per_token": dense_flops,
            "tokens_per_s": speed[str(t)]["dense_tokens_per_s"],
        },
        "pruned": {
            "ppl": math.exp(cascade_nll),
            "flops_per_token": pruned.flops_per_token(ids),
            "tokens_per_s": speed[str(t)]["pruned_tokens_per_s"],
        },
        "speed": speed,
        "capacity": None if pruned.capacity is None else list(pruned.capacity),
        "overflows": pruned.overflows,
        "keep_ratio": keep.tolist(),
        "target_keep_ratio": list(cascade.config.keep_ratios),
        "target_head_keep": list(cascade.config.head_keep),
        "target_unit_keep": list(cascade.config.unit_keep),
        "heads_kept": pruned.heads_kept(),
        "units_kept": pruned.units_kept(),
        "head_values": [v.tolist() for v in cascade.head_values()],
        "unit_values": [v.tolist() for v in cascade.unit_values()],
        "head_gates": [
            np.asarray(b.head_gate.logits[...]).tolist() if b.head_gate is not None else None
            for b in cascade.h
        ],
        "unit_gates": [
            np.asarray(b.unit_gate.logits[...]).tolist() if b.unit_gate is not None else None
            for b in cascade.h
        ],
    }


def run(cfg: CascadeExperiment) -> dict:
    """Trains, measures and reports (see the module docstring); returns the summary.

    Training stops early, with a checkpoint of the step reached, on SIGTERM or SIGINT (Ctrl-C,
    a notebook's interrupt) or after ``--run.max-minutes``: it raises
    :class:`experiments.phase.RunStopped`, whose ``folder`` ``--run.resume`` continues."""
    with stop_request(cfg.run.max_minutes, log) as stop:
        return _run(cfg, stop)


def _run(cfg: CascadeExperiment, stop: StopRequest) -> dict:
    started = time.perf_counter()
    folder = cfg.run.dir or pathlib.Path("runs") / time.strftime("cascade-%Y%m%d-%H%M%S")
    folder = pathlib.Path(folder)
    if (not cfg.run.resume and (folder / "summary.json").exists()) or (
        not cfg.run.resume and (folder / "checkpoints").exists()
    ):
        raise ValueError(
            f"--run.dir {str(folder)!r} already holds a run; continue it with --run.resume or "
            "pass another --run.dir"
        )
    if cfg.run.resume:
        # Only flags.CHECKPOINT_FLAGS must match: --sweep and --run.eval-batches may change.
        check_resume(cfg, folder, kind="cascade")
    cache = pathlib.Path(cfg.run.cache_dir).expanduser()
    data = text.prepare(cfg.data.source, "byte", cfg.data.seq_len, data_dir=cache / "tfds")
    n_eval = min(len(data.eval), cfg.run.eval_batches * cfg.data.batch_size)
    windows = np.asarray(data.eval[list(range(n_eval))], np.int32)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        folder / "config.json", json.dumps(dataclasses.asdict(cfg), default=str, indent=2) + "\n"
    )
    seconds = {}
    lap = time.perf_counter()

    def timed(name, fn):
        nonlocal lap
        out = fn()
        seconds[name] = time.perf_counter() - lap
        lap = time.perf_counter()
        return out

    g = GPT2Config.preset(cfg.model.size, vocab_size=data.vocab_size)
    dense = timed(
        "dense",
        lambda: _phase(
            cfg, folder, "dense", GPT2(g, rngs=nnx.Rngs(cfg.run.seed)), _lm_loss, data, stop
        ),
    )
    model = CascadeLM(cfg.cascade_config(data.vocab_size), rngs=nnx.Rngs(cfg.run.seed))
    cascade = timed(
        "cascade", lambda: _phase(cfg, folder, "cascade", model, _cascade_loss, data, stop)
    )
    summary = timed("measure", lambda: _measure(cfg, data, dense, cascade, windows))
    sweep = []
    for final in cfg.sweep:
        ratios = linear_schedule(final, g.n_layer)
        other = CascadeLM(cfg.cascade_config(data.vocab_size, ratios), rngs=nnx.Rngs(cfg.run.seed))
        other = _phase(cfg, folder, f"sweep-{final:g}", other, _cascade_loss, data, stop)
        nll, _ = measure.evaluate_lm(other, windows)
        long_ids = jnp.asarray(_long_text(data, 4 * cfg.data.seq_len, 1))
        sweep.append(
            {
                "final_keep": final,
                "ppl": math.exp(nll),
                "flops_per_token": other.flops_per_token(jnp.asarray(windows[:, :-1])),
                "tokens_per_s_4x": _tokens_per_s(other.prune().logits, long_ids),
            }
        )
    if sweep:
        seconds["sweep"] = time.perf_counter() - lap
    summary |= {
        "sweep": sweep,
        "phase_seconds": seconds,
        "wall_time_s": time.perf_counter() - started,
        "device": f"{jax.default_backend()} x{jax.device_count()}",
        "data": data.describe(),
    }
    write_text_atomically(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    _report(folder, summary)
    log(f"done in {summary['wall_time_s']:.0f} s: {folder / 'report.md'}")
    return summary


def _report(folder: pathlib.Path, s: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = len(s["keep_ratio"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    axes[0].plot(range(1, blocks + 1), s["keep_ratio"], "o-", label="kept (evaluation text)")
    axes[0].plot(range(1, blocks + 1), s["target_keep_ratio"], "k--", label="target")
    axes[0].set(xlabel="block", ylabel="kept fraction of tokens", ylim=(0, 1.05))
    axes[0].legend()
    for ax, key, title in (
        (axes[1], "head_values", "head gates at evaluation (0: closed)"),
        (axes[2], "unit_values", "FFN unit gates at evaluation (first 64)"),
    ):
        grid = np.array([row[:64] for row in s[key]])
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="none")
        ax.set(title=title, xlabel="head" if key == "head_values" else "unit", ylabel="block")
        ax.set_yticks(range(blocks), [str(i) for i in range(1, blocks + 1)])
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(folder / "gates.png", dpi=90)
    plt.close(fig)
    if s["sweep"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        pts = [(p["flops_per_token"], p["ppl"]) for p in s["sweep"]]
        ax.plot(*zip(*sorted(pts), strict=True), "o-", label="cascade (sweep)")
        ax.plot([s["dense"]["flops_per_token"]], [s["dense"]["ppl"]], "k*", ms=12, label="dense")
        ax.set(xlabel="FLOPs per token", ylabel="perplexity")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "pareto.png", dpi=90)
        plt.close(fig)
    d, p = s["dense"], s["pruned"]
    mflops = lambda x: f"{x / 1e6:.2f} M"
    rows = [
        ("perplexity (per byte, evaluation split)", d["ppl"], p["ppl"], "{:.3f}".format),
        ("FLOPs per token", d["flops_per_token"], p["flops_per_token"], mflops),
    ]
    for length, v in s["speed"].items():
        rows.append(
            (
                f"forward tokens/s at n={length}",
                v["dense_tokens_per_s"],
                v["pruned_tokens_per_s"],
                "{:.0f}".format,
            )
        )
    lines = ["# CANDS cascade against the dense baseline", "", s["data"], ""]
    lines += ["| | dense | pruned cascade | pruned / dense |", "|:--|--:|--:|--:|"]
    lines += [f"| {n} | {f(a)} | {f(b)} | {b / a:.3f} |" for n, a, b, f in rows]
    kept = [round(r, 3) for r in s["keep_ratio"]]
    target = [round(r, 3) for r in s["target_keep_ratio"]]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in s["phase_seconds"].items())
    lines += [
        "",
        f"Kept fraction of tokens per block (evaluation text): {kept}, target {target}; heads "
        f"kept {s['heads_kept']}; FFN units kept {s['units_kept']}. Device {s['device']}; wall "
        f"time {s['wall_time_s']:.0f} s ({phases}). The pruned model is the cascade with hard "
        "gates, its closed heads and units cut from the weights and each block run on its kept "
        f"tokens only, in {s['capacity']} x T slots per block (batches rerun because a block "
        f"kept more: {s['overflows']}); FLOPs: sparse_jax.models.flops.kept_flops (causal "
        "attention among kept tokens); tokens/s: one sequence of evaluation text, median of 5 "
        "calls after warm-up, routing included.",
        "",
        "![gates and kept tokens](gates.png)",
        "",
    ]
    if s["sweep"]:
        dense_4x = s["speed"][str(4 * int(next(iter(s["speed"]))))]["dense_tokens_per_s"]
        lines += [
            "| final keep ratio | perplexity | FLOPs per token | tokens/s at 4T over dense |",
            "|--:|--:|--:|--:|",
        ]
        lines += [
            f"| {p['final_keep']:g} | {p['ppl']:.3f} | {p['flops_per_token'] / 1e6:.2f} M | "
            f"{p['tokens_per_s_4x'] / dense_4x:.2f}x |"
            for p in s["sweep"]
        ]
        lines += ["", "![perplexity against FLOPs](pareto.png)", ""]
    write_text_atomically(folder / "report.md", "\n".join(lines) + "\n")


def parse(argv: list[str] | None = None) -> CascadeExperiment:
    """The experiment's flags (``--help`` lists them); a bad value exits with its message."""
    return tyro.cli(CascadeExperiment, args=argv, description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> None:
    main_of("experiments.cascade", run, parse, argv, log)


if __name__ == "__main__":
    main()
