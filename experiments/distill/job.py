"""The main job: distil a dense GPT-2 teacher into a sparse student, harden it, measure both.

    python -m experiments.distill                       # the embedded default, minutes on a CPU
    python -m experiments.distill --config wikitext2_study   # a study: experiments/distill/configs
    python -m experiments.distill --teacher.source planted   # does the student find planted masks?
    python -m experiments.distill --data.source ../shared/data/wikitext-2 --data.seq-len 512
    python -m experiments.distill --teacher.source path/to/hf-gpt2 --data.tokenizer path/to/vocab
    python -m experiments.distill --resume              # continue the newest run (or --run.dir)
    python -m experiments.distill --help                # every flag, by group

Phases (experiments.distill.phases; each checkpointed under ``<run.dir>/checkpoints/<phase>``
and resumable): the teacher (by default the small GPT-2 bundled with the package, trained by
``python -m experiments.bundle_teacher``; or one trained here and cached under
``--run.cache-dir``, densely or with a planted mask per head; or a Hugging Face GPT-2), the
student (the teacher's weights with learned candidate masks, gates or a fixed sparse mask,
trained on KL(teacher || student) plus the sparsity penalties; a candidates student trains only
its candidate logits, the KL alone first, then the price ramped in: ``--train.trainable``,
``--loss.penalty-ramp``), and the hardened student (fixed masks: each head's candidates at or
above ``--harden.threshold``, by default its strongest, or ``--harden.budget``; then every
weight fine-tuned).

The run folder (experiments.distill.run_folder) gets ``config.json``, ``metrics.jsonl`` (one
line per step and evaluation), ``checkpoints/``, ``summary.json`` and ``report.md`` with its plots
(experiments.distill.report): perplexity of teacher, student and hardened model on the evaluation
split, KL, attention density, FLOPs per token, attention time and tokens/s of the dense teacher and
the hardened student at the run's length and at the serving length (--student.serve-len-factor x
it), the blocks each hardened head computes there, greedy and sampled continuations, the
passkey recall of each model (for contrast also of the student hardened to its windows and
sinks alone, and with ``--student.select-blocks`` without its block selection), and for a
planted teacher the heads whose planted
mask the student found, all measured in this run (experiments.common.measure).

On several hosts the same command runs in every process (``jax.distributed`` is initialised from
``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, SLURM, Open MPI or a Cloud
TPU pod): each process reads its rows of every batch, trains its part of the sharded step and
evaluates on its own device; process 0 writes the run folder (a shared filesystem is assumed).
"""

from __future__ import annotations

import json
import math
import time

import jax
import numpy as np

from experiments.common import measure
from experiments.common.phase import EXIT_STOPPED, RunStopped, stop_request
from experiments.common.run_folder import RunFolderError
from experiments.distill import phases as distill_phases
from experiments.distill.cli import command, parse
from experiments.distill.config import DistillConfig
from experiments.distill.report import write_report
from experiments.distill.run_folder import Run, log
from sparse_jax.files import write_text_atomically
from sparse_jax.training.checkpoint import CheckpointError

__all__ = ["DistillConfig", "Run", "main", "parse", "run"]


def run(config: DistillConfig) -> dict:
    """Runs every phase; returns the summary (also written to ``summary.json``).

    Training stops early, with a checkpoint of the step reached, on SIGTERM or SIGINT (Ctrl-C,
    a notebook's interrupt) or after ``--run.max-minutes``: it raises
    :class:`experiments.common.phase.RunStopped`, whose ``folder`` ``--resume`` continues."""
    started = time.perf_counter()
    seconds = {}  # wall time of each part of the run

    def lap(name):
        seconds[name] = time.perf_counter() - started - sum(seconds.values())

    distill_phases.student_spec(config)  # the student's flags, checked before set-up
    with stop_request(config.run.max_minutes, log) as stop:  # --run.max-minutes from here
        r = Run(config)
        r.stop = stop
        lap("data")
        teacher = distill_phases.teacher(r)
        lap("teacher")
        student, spec = distill_phases.student(r, teacher)
        lap("student")
        hard = distill_phases.hardened(r, student, teacher)
        lap("hardened")
    r.stop = None
    # Quality on the evaluation split.
    t_nll, _ = measure.evaluate_lm(teacher, r.eval_windows)
    s_nll, s_kl = measure.evaluate_lm(student, r.eval_windows, teacher)
    h_nll, h_kl = measure.evaluate_lm(hard, r.eval_windows, teacher)
    # Cost: analytic FLOPs and measured speed at the run's length and at the serving length
    # (if the positions allow).
    n = config.data.seq_len
    serve_len = config.student.serve_len_factor * n
    fits = n < serve_len <= teacher.config.n_positions
    lengths = [n, serve_len] if fits else [n]
    speed = {length: measure.cost(teacher, hard, length) for length in lengths}
    lap("measure")
    samples = measure.sample_texts(
        teacher,
        hard,
        r.eval_windows,
        config.data.tokenizer,
        n,
        config.measure.report_prompts,
        seed=config.run.seed,
    )
    lap("samples")
    models = {"teacher": teacher, "student": student, "hardened": hard}
    contrast = distill_phases.harden_without_selections(config, student)
    if contrast is not None:  # the same student hardened without its selections
        models["hardened without selection"] = contrast
    local = distill_phases.harden_to_local(config, student)
    if local is not None:  # ... and to its windows and sinks alone
        models["hardened to windows and sinks"] = local
    recall_table = distill_phases.recall_table(r, models)
    lap("recall")
    summary = {
        "candidates": [repr(c) for c in (spec.candidates or ())],
        "hardened_layer_density": measure.layer_density(hard, n),
        "hardened_masks": [b.attn.core.describe() if b.attn.num_heads else None for b in hard.h],
        "teacher_ppl": math.exp(t_nll),
        "student_ppl": math.exp(s_nll),
        "hardened_ppl": math.exp(h_nll),
        "student_kl": s_kl,
        "hardened_kl": h_kl,
        "hardened_heads": list(hard.config.heads_per_layer),
        "hardened_ffn_units": list(hard.config.inner_per_layer),
        "speed": speed,
        "candidate_weights": measure.candidate_weights(student),
        "serve_len": serve_len,
        "hardened_block_maps": measure.block_maps(hard, lengths[-1]),
        "samples": samples,
        "recall": recall_table,
        "student_recall_fraction": config.student_recall_fraction(),
        "wall_time_s": time.perf_counter() - started,
        "phase_seconds": seconds,
        "device": f"{jax.default_backend()} x{jax.device_count()}",
    }
    if config.harden.budget is not None:
        summary["hardening"] = _threshold_against_budget(r, student, teacher, serve_len)
    if config.teacher.source == "planted":
        pattern = distill_phases.planted_pattern(config)
        bank = spec.candidates
        swaps = distill_phases.planted_swaps(r, teacher, student)
        specs = distill_phases.planted_specs(config)
        summary |= measure.planted_recovery(
            student,
            hard,
            pattern,
            bank,
            lengths[-1],
            swaps,
            config.measure.planted_tolerance,
            union_swap=lambda i, h, mask: measure.swap_kl(
                teacher, specs, i, h, mask, r.eval_windows
            ),
            threshold=config.harden.threshold,
        )
        excess = measure.masked_score_excess(teacher, r.eval_windows)
        summary["planted_score_excess"] = {
            f"block{i}": [None if np.isnan(x) else round(float(x), 2) for x in row]
            for i, row in enumerate(excess)
        }
    if r.primary:
        text = json.dumps(summary, indent=2, default=float) + "\n"
        write_text_atomically(r.dir / "summary.json", text)
        write_report(r.dir)
    log(f"done in {summary['wall_time_s']:.0f} s: {r.dir / 'report.md'}")
    return summary


def _threshold_against_budget(r, student, teacher, serve_len: int) -> dict:
    """The student hardened by --harden.budget and by threshold (no budget), both before any
    fine-tune: KL to the teacher on the evaluation windows and attention FLOPs per sequence
    at the serving length (does the learned ranking alone give the budget's quality?)."""
    out = {}
    for name, by_budget in (("budget", True), ("threshold", False)):
        hard = distill_phases.harden_student(r.config, student, by_budget=by_budget)
        out[name] = {
            "kl": measure.evaluate_lm(hard, r.eval_windows, teacher)[1],
            "attention_flops": hard.flops(serve_len).attention,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    config = parse(argv, description=__doc__.split("\n\n")[0])
    try:
        run(config)
    except RunStopped as stopped:
        log(f"{stopped}. Continue with:  {command(config, resume=True, run_dir=stopped.folder)}")
        raise SystemExit(EXIT_STOPPED) from None
    except RunFolderError as refused:  # one line and status 2, as a bad flag is
        log(f"error: {refused}")
        raise SystemExit(2) from None
    except CheckpointError as unreadable:
        log(f"error: {unreadable}")
        raise SystemExit(1) from None
