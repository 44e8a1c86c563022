"""The cascade run — CANDS: a language model whose later blocks see fewer heads,
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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.cascade.config import CascadeExperiment, linear_schedule, parse
from experiments.cascade.report import write_report
from experiments.common import measure
from experiments.common.phase import main_of, stop_request, train_phase
from experiments.common.run_folder import (
    CASCADE,
    RECORD,
    check_folder,
    check_same_flags,
    check_writable,
    clear_failed_start,
    with_program,
)
from sparse_jax.data import text
from sparse_jax.files import write_text_atomically
from sparse_jax.models import GPT2, GPT2Config
from sparse_jax.models.cascade import CascadeLM, cascade_flops
from sparse_jax.training.loop import TrainConfig
from sparse_jax.training.losses import cross_entropy_loss
from sparse_jax.training.stopping import StopRequest

__all__ = ["log", "main", "run"]


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
    """Trains (or resumes) one model (:func:`experiments.common.phase.train_phase`)."""
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


def _tokens_per_s(fns: dict, ids, repeats: int = 7) -> dict[str, float]:
    """Tokens per second of each ``fns[name](ids)`` (outputs ready): the median of ``repeats``
    rounds after two warm-up calls each, every round calling each function once in turn, so
    that a change in the machine's load falls on all of them alike (compilation excluded; the
    pruned model's routing included)."""
    for fn in fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(ids))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(ids))
            times[name].append(time.perf_counter() - start)
    return {name: ids.size / float(np.median(t)) for name, t in times.items()}


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

    def dense_flops(length: int) -> float:  # per token
        units = [g.inner(i) for i in range(g.n_layer)]
        layers = [length] * g.n_layer, [g.n_head] * g.n_layer, units
        return cascade_flops(g, length, *layers) / length

    pruned = cascade.prune()
    keep = cascade.keep_ratio(ids)
    graphdef, state = nnx.split(dense)
    dense_fn = jax.jit(lambda ids: nnx.merge(graphdef, state)(ids))
    speed = {}
    for length in (t, 4 * t):
        text_ids = jnp.asarray(_long_text(data, length, 1))
        timed = _tokens_per_s({"dense": dense_fn, "pruned": pruned.logits}, text_ids)
        speed[str(length)] = {f"{name}_tokens_per_s": v for name, v in timed.items()} | {
            # What each model computes on the timed sequence: the pruned one's kept tokens, and
            # the slots it ran on (the speed-up a machine bound by FLOPs would give).
            "dense_flops_per_token": dense_flops(length),
            "pruned_flops_per_token": pruned.flops_per_token(text_ids),
            "pruned_run_flops_per_token": pruned.flops_as_run(text_ids).total / length,
        }
    return {
        "dense": {
            "ppl": math.exp(dense_nll),
            "flops_per_token": dense_flops(t),
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
    :class:`experiments.common.phase.RunStopped`, whose ``folder`` ``--run.resume`` continues."""
    with stop_request(cfg.run.max_minutes, log) as stop:
        return _run(cfg, stop)


def _run(cfg: CascadeExperiment, stop: StopRequest) -> dict:
    started = time.perf_counter()
    folder = cfg.run.dir or pathlib.Path("runs") / time.strftime("cascade-%Y%m%d-%H%M%S")
    folder = pathlib.Path(folder)
    cache = pathlib.Path(cfg.run.cache_dir).expanduser()
    # The folders, before any data or model work (experiments.common.run_folder).
    saved = check_folder(folder, CASCADE, resume=cfg.run.resume)
    if saved is not None:
        # Only flags.CHECKPOINT_FLAGS must match: --sweep and --run.eval-batches may change.
        check_same_flags(cfg, folder, CASCADE)
    check_writable(folder, "--run.dir")
    check_writable(cache, "--run.cache-dir", existing_may_be_read_only=True)
    data = text.prepare(cfg.data.source, "byte", cfg.data.seq_len, data_dir=cache / "tfds")
    n_eval = min(len(data.eval), cfg.run.eval_batches * cfg.data.batch_size)
    if n_eval < 1:
        raise ValueError(
            f"the evaluation split of --data.source {cfg.data.source!r} has no window of "
            f"--data.seq-len + 1 = {cfg.data.seq_len + 1} tokens: pass a shorter --data.seq-len "
            "or a longer corpus"
        )
    windows = np.asarray(data.eval[list(range(n_eval))], np.int32)
    if saved is None:
        clear_failed_start(folder, log)
    folder.mkdir(parents=True, exist_ok=True)
    record = with_program(dataclasses.asdict(cfg), CASCADE.name)
    write_text_atomically(folder / RECORD, json.dumps(record, default=str, indent=2) + "\n")
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
                "tokens_per_s_4x": _tokens_per_s({"pruned": other.prune().logits}, long_ids)[
                    "pruned"
                ],
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
    write_report(folder, summary)
    log(f"done in {summary['wall_time_s']:.0f} s: {folder / 'report.md'}")
    return summary


def main(argv: list[str] | None = None) -> None:
    main_of("experiments.cascade", run, parse, argv, log)
