"""The main job: distil a dense GPT-2 teacher into a sparse student, harden it, measure both.

    python -m experiments.distill                       # the embedded default, ~7 min on 2 cores
    python -m experiments.distill --data ../shared/data/wikitext-2 --seq-len 512
    python -m experiments.distill --teacher path/to/hf-gpt2-folder --tokenizer path/to/vocab
    python -m experiments.distill --resume              # continue the run in --run-dir
    python -m experiments.distill --help

Phases (each checkpointed under ``<run-dir>/checkpoints/<phase>`` and resumable):

1. teacher: a Hugging Face GPT-2 (``--teacher <folder>`` or a hub name with a network), or, by
   default, a small GPT-2 trained here on the training split with cross-entropy and cached
   (Hugging Face layout) under ``--cache-dir`` so that later runs reuse it;
2. student: the teacher's weights with learnable sparse attention (``--student candidates``:
   a learned combination of candidate masks per head; ``gated``: head and FFN gates;
   ``fixed``: a fixed window + sinks mask), trained on KL(teacher || student) plus the
   sparsity penalties;
3. hardened: ``harden()`` turns the learned weights into fixed per-head masks (meeting
   ``--budget``) and pruned heads/units, then a short fine-tune on the same KL.

The run folder gets ``config.json``, ``metrics.jsonl`` (one line per step and evaluation),
``checkpoints/``, ``summary.json`` and ``report.md`` with its plots: quality (perplexity of
teacher, student and hardened model on the evaluation split, KL), attention density, FLOPs per
token and measured tokens/s of the dense teacher and the hardened student at the run's length
and at 4x it, all measured in this run.

On several hosts the same command runs in every process (``jax.distributed`` is initialised from
``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``, SLURM, Open MPI or a Cloud
TPU pod): each process reads its rows of every batch, trains its part of the sharded step and
evaluates on its own device; process 0 writes the run folder (a shared filesystem is assumed).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import time
import zlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import tyro

Student = Literal["candidates", "gated", "fixed"]


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Distil a dense GPT-2 into a sparse student, harden it and report quality, FLOPs, speed."""

    teacher: str = "train"
    """'train': a small GPT-2 trained here (cached in --cache-dir); a folder holding a Hugging
    Face GPT-2 (config.json + model.safetensors); or a hub name such as 'gpt2' (network)."""
    teacher_size: str = "cpu-small"
    """Preset of the trained teacher (sparse_jax.models.gpt2.PRESETS), vocab from the tokenizer."""
    teacher_steps: int = 800
    """Updates of the trained teacher."""
    teacher_lr: float = 3e-3
    """Peak learning rate of the trained teacher."""
    data: str = "default"
    """'default' (CPython's bundled pydoc topics: no network, no files), a .txt file or folder,
    a WikiText-2 folder (trains on valid.txt, evaluates on test.txt) or 'tfds:<name>'."""
    tokenizer: str = "byte"
    """'byte' (257 ids, needs nothing), 'gpt2' (tiktoken files) or a folder of vocabulary files."""
    seq_len: int = 128
    """Tokens per training sequence (<= the teacher's positions; speed is also measured at 4x)."""
    batch_size: int = 8
    """Global batch (sequences per update); must divide over the data axis of the mesh."""
    student: Student = "candidates"
    """Student kind: learned candidate masks, gated heads/FFN units, or a fixed sparse mask."""
    normalizer: str = "softmax"
    """Student normalizer: softmax, sparsemax, entmax15 or a float alpha > 1."""
    combine: Literal["soft_union", "soft_mask", "mixture"] = "soft_union"
    """How candidate masks combine (see sparse_jax.models.layers)."""
    anchor_self: bool = False
    """Candidates: keep each query's own position at weight 1, so that the penalty cannot
    shrink all candidate weights together at no cost (see CandidateMaskAttention)."""
    granularity: Literal["layer", "head"] = "head"
    """Candidate weights per layer or per head."""
    windows: tuple[int, ...] = (8, 16, 32)
    """Causal window sizes of the candidate bank (besides sink(4), strided and full causal)."""
    fixed_window: int = 32
    """Window of the 'fixed' student (causal window | sink(4))."""
    block_size: int = 64
    """Block size of the block-sparse kernel in the students (64 ran fastest on CPU; 128 on TPU)."""
    gate: Literal["sigmoid_ste", "hard_concrete", "sigmoid"] = "sigmoid_ste"
    """Gate kind of the 'gated' student."""
    steps: int = 400
    """Distillation updates of the student."""
    learning_rate: float = 3e-3
    """Peak learning rate of the student."""
    trainable: str = ".*"
    """Regex of the student parameters trained (e.g. 'core/logits': only the mask weights)."""
    fast_params: str = "core/logits|gate/logits|alpha_logit"
    """Regex of parameters trained at --fast-lr-multiplier x the rate (mask weights, gates)."""
    fast_lr_multiplier: float = 10.0
    """Learning-rate multiplier of --fast-params."""
    mask_l1: float = 0.02
    """Weight of the L1 penalty on candidate weights (sum of sigmoid(logits), per block)."""
    mask_density: float = 0.0
    """Weight of the density-weighted penalty on candidate weights (Σ weight x the candidate's
    share of the causal entries, per block): prices each candidate by what it costs."""
    mask_expected_density: float = 0.0
    """Weight of the scale-free density penalty (per block, the mean over heads of Σ π_c x
    share_c with π = weights / their sum): only the weights' ratios count, as under softmax.
    It prices score entries, not kernel blocks: see docs/results.md before using it."""
    gate_l1: float = 0.0005
    """Weight of the head/FFN gate penalties."""
    temperature: float = 1.0
    """Distillation temperature T (the loss is scaled by T^2)."""
    direction: Literal["forward", "reverse", "jsd"] = "forward"
    """forward = KL(teacher || student), reverse, or Jensen-Shannon."""
    budget: float | None = 0.3
    """Mean attention density the hardened model may use (None: keep weights >= --threshold)."""
    threshold: float = 0.5
    """Candidate weight kept by hardening when --budget is None."""
    finetune_steps: int = 200
    """KL fine-tuning updates of the hardened model."""
    eval_batches: int = 8
    """Evaluation batches (of --batch-size sequences from the evaluation split)."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many updates (and at the end of each phase)."""
    data_axis: int | None = None
    """Devices on the mesh's data axis (None: all devices / --model-axis)."""
    model_axis: int = 1
    """Devices on the mesh's model axis (tensor-parallel split of the projections)."""
    run_dir: pathlib.Path | None = None
    """Run folder (config.json, metrics.jsonl, checkpoints/, report.md); default a new
    runs/distill-<date>-<time>, or with --resume the newest runs/distill-* folder."""
    cache_dir: pathlib.Path = pathlib.Path("~/.cache/sparse_jax")
    """Where prepared data and trained teachers are cached."""
    resume: bool = False
    """Continue the run in --run-dir from its last complete checkpoints."""
    seed: int = 0
    """Seed of initialisation, data order and sampling."""
    report_prompts: int = 3
    """Evaluation prompts generated by teacher and student for the report."""

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1; got {value!r}")

        for name in ("teacher_steps", "seq_len", "batch_size", "steps", "eval_batches"):
            positive(name)
        for name in ("checkpoint_every", "model_axis", "block_size"):
            positive(name)
        for name in ("mask_l1", "mask_density", "mask_expected_density", "gate_l1"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be a number >= 0; got {value}")
        for name in ("learning_rate", "teacher_lr", "temperature", "fast_lr_multiplier"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be a number > 0; got {value}")
        for name in ("finetune_steps", "report_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0; got {value!r}")
        if self.anchor_self and self.combine == "mixture":
            raise ValueError("--anchor-self needs --combine soft_union or soft_mask; got mixture")
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"--budget must be in (0, 1] or None; got {self.budget}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"--threshold must be in (0, 1); got {self.threshold}")
        if self.normalizer not in ("softmax", "sparsemax", "entmax15"):
            try:
                alpha = float(self.normalizer)
            except ValueError:
                alpha = 0.0
            if not alpha > 1:
                raise ValueError(
                    f"--normalizer must be softmax, sparsemax, entmax15 or a float alpha > 1; "
                    f"got {self.normalizer!r}"
                )
        if self.teacher != "train" and not pathlib.Path(self.teacher).is_dir():
            if "/" in self.teacher or self.teacher.startswith("."):
                raise ValueError(f"--teacher folder {self.teacher!r} does not exist")
        positions = self.teacher_positions()
        if positions is not None and self.seq_len > positions:
            raise ValueError(
                f"--seq-len {self.seq_len} is longer than the teacher's {positions} positions"
            )
        if self.data != "default" and not self.data.startswith("tfds:"):
            if not pathlib.Path(self.data).exists():
                raise ValueError(f"--data path {self.data!r} does not exist")


def _teacher_positions(config: DistillConfig) -> int | None:
    """n_positions of the teacher, known before anything is built (None for a hub name)."""
    from sparse_jax.models.gpt2 import PRESETS

    if config.teacher == "train":
        if config.teacher_size not in PRESETS:
            raise ValueError(
                f"--teacher-size {config.teacher_size!r} is not a preset; allowed: {list(PRESETS)}"
            )
        return PRESETS[config.teacher_size][3]
    hf_config = pathlib.Path(config.teacher) / "config.json"
    if hf_config.exists():
        return int(json.loads(hf_config.read_text())["n_positions"])
    return None


DistillConfig.teacher_positions = _teacher_positions


def resolve_run_dir(config: DistillConfig, now: float | None = None) -> pathlib.Path:
    """The run folder: --run-dir, a new one named after ``now`` (default: the current time),
    or the newest one for --resume."""
    if config.run_dir is not None:
        return config.run_dir
    if config.resume:
        runs = sorted(pathlib.Path("runs").glob("distill-*"))
        if not runs:
            raise ValueError("--resume: no runs/distill-* folder to resume; pass --run-dir")
        return runs[-1]
    stamp = time.localtime(time.time() if now is None else now)
    return pathlib.Path("runs") / time.strftime("distill-%Y%m%d-%H%M%S", stamp)


def _log(msg: str) -> None:
    """Progress on stderr, from the primary process only (the others run the same steps)."""
    from sparse_jax.training.sharding import is_primary

    if is_primary():
        print(msg, file=sys.stderr, flush=True)


def _normalizer(config: DistillConfig):
    if config.normalizer in ("softmax", "sparsemax", "entmax15"):
        return config.normalizer
    return float(config.normalizer)


def student_spec(config: DistillConfig):
    """The student's AttentionSpec for the configured kind."""
    from sparse_jax import masks
    from sparse_jax.models import AttentionSpec
    from sparse_jax.models.layers import default_candidates

    norm = _normalizer(config)
    blocks = (config.block_size, config.block_size)
    if config.student == "candidates":
        bank = default_candidates(4, config.windows)
        stride = max(2, round(math.sqrt(config.seq_len)))
        bank = (*bank[:-2], masks.strided(stride), bank[-1])
        return AttentionSpec(
            kind="candidates",
            candidates=bank,
            granularity=config.granularity,
            combine=config.combine,
            anchor_self=config.anchor_self,
            normalizer=norm,
            block_size=blocks,
        )
    if config.student == "gated":
        return AttentionSpec(
            normalizer=norm, head_gate=config.gate, ffn_gate=config.gate, block_size=blocks
        )
    window = masks.causal() & masks.local(config.fixed_window - 1, 0)
    mask = window | (masks.sink(4) & masks.causal())
    return AttentionSpec(mask=mask, normalizer=norm, block_size=blocks)


# ----------------------------------------------------------------------------------------------
# Phases.


# Flags that may differ between a run and its resumption (they change no trained number); the
# data description follows from --data, --tokenizer and --seq-len (and names the cache folder).
_RESUME_FREE = ("resume", "run_dir", "report_prompts", "cache_dir", "data_description")


def _check_same_config(saved: dict, given: dict) -> None:
    """--resume continues the run it finds: refuse flags that would change what it computes.
    A flag that the run's (older) config.json lacks must be at its default."""
    defaults = json.loads(
        json.dumps({f.name: f.default for f in dataclasses.fields(DistillConfig)}, default=str)
    )
    changed = [
        f"--{key.replace('_', '-')} (run: {saved.get(key, defaults.get(key))!r}, "
        f"now: {given.get(key)!r})"
        for key in sorted(set(saved) | set(given))
        if key not in _RESUME_FREE and saved.get(key, defaults.get(key)) != given.get(key)
    ]
    if changed:
        raise ValueError(
            "--resume: this command's configuration differs from the run's config.json in "
            + "; ".join(changed)
            + ". Resume with the run's flags, or start a new --run-dir"
        )


class Run:
    """State shared by the phases of one run: data, mesh, folders, the metrics log."""

    def __init__(self, config: DistillConfig):
        from sparse_jax.data import text
        from sparse_jax.training import sharding

        self.config = config
        # Several processes (one per host): all run every step; process 0 alone writes the
        # run's files (Orbax coordinates the checkpoints), and each reads its slice of a batch.
        sharding.maybe_initialize_distributed()
        self.primary = sharding.is_primary()
        now = float(sharding.broadcast_from_primary(np.float64(time.time())))
        self.dir = resolve_run_dir(config, now)
        cache = pathlib.Path(os.path.expanduser(config.cache_dir))
        if self.dir.exists() and any(self.dir.iterdir()) and not config.resume:
            raise ValueError(
                f"--run-dir {str(self.dir)!r} already holds a run: pass --resume to continue it "
                "or choose another --run-dir (nothing is overwritten)"
            )
        sharding.sync_processes("distill_run_dir_checked")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mesh = sharding.make_mesh(config.data_axis, config.model_axis)
        sharding.check_batch(config.batch_size, self.mesh)
        _log(f"preparing data {config.data!r} ...")
        # The primary writes the prepared dataset once; the others then read it.
        for turn in ("primary", "others"):
            if self.primary == (turn == "primary"):
                self.data = text.prepare(
                    config.data, config.tokenizer, config.seq_len, data_dir=cache / "tfds"
                )
            sharding.sync_processes(f"distill_data_prepared_{turn}")
        self.cache = cache
        self.metrics_path = self.dir / "metrics.jsonl"
        record = {**dataclasses.asdict(config), "data_description": self.data.describe()}
        record = json.loads(json.dumps(record, default=str))
        config_path = self.dir / "config.json"
        if config.resume and config_path.exists():
            _check_same_config(json.loads(config_path.read_text()), record)
        elif self.primary:
            config_path.write_text(json.dumps(record, indent=2) + "\n")
        _log(self.data.describe())
        # Fixed evaluation batches: the first windows of the evaluation split.
        n_eval = min(len(self.data.eval), config.eval_batches * config.batch_size)
        if n_eval < 1:
            raise ValueError("the evaluation split has no window of --seq-len + 1 tokens")
        self.eval_windows = np.asarray(self.data.eval[list(range(n_eval))], np.int32)

    def log(self, record) -> None:
        from sparse_jax.training.loop import append_jsonl

        if self.primary:
            append_jsonl(self.metrics_path, record)

    def forget_metrics_after(self, phase: str, step: int) -> None:
        """Drops the metrics a killed run logged for ``phase`` after the checkpoint it resumes
        from (``step``): they are computed again, and the log keeps one line per step."""
        if not self.primary or not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill
                continue
            if record.get("phase") == phase and record.get("step", -1) > step:
                continue
            kept.append(line)
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(self.metrics_path)

    def batches(self, phase: str, data_state):
        from sparse_jax.data.text import BatchIterator
        from sparse_jax.training import sharding

        c = self.config
        index, count = sharding.process_data_slice(self.mesh)  # this process's rows
        processes = {"process_index": index, "process_count": count}
        if data_state and "iterator" in data_state:
            return BatchIterator.from_state(self.data.train, data_state["iterator"], **processes)
        seed = c.seed + zlib.crc32(phase.encode()) % 1000
        return BatchIterator(self.data.train, c.batch_size, seed=seed, **processes)

    def train_phase(self, phase, model, loss_fn, train_config, *, frozen=None, evaluate=None):
        """Runs (or resumes) one phase with a progress bar; returns the trained model (its
        arrays on this process's device, see :func:`~sparse_jax.training.sharding.local_model`)."""
        from tqdm.auto import tqdm

        from sparse_jax.training.checkpoint import Checkpointer
        from sparse_jax.training.loop import Trainer
        from sparse_jax.training.sharding import local_model

        c = self.config
        ckpt = Checkpointer(
            self.dir / "checkpoints" / phase,
            save_every=c.checkpoint_every,
            keep_last=2,
            best_metric="eval_loss",
        )
        trainer = Trainer(
            model, loss_fn, train_config, frozen_models=frozen, mesh=self.mesh, checkpointer=ckpt
        )
        data_state = trainer.restore() if c.resume else None
        if data_state is not None:
            _log(f"{phase}: resumed at step {trainer.step} from {ckpt.directory}")
        if c.resume:
            self.forget_metrics_after(phase, trainer.step)
        iterator = self.batches(phase, data_state)
        bar = tqdm(
            total=train_config.steps,
            initial=trainer.step,
            desc=phase,
            file=sys.stderr,
            disable=not self.primary,
        )

        def on_step(step, metrics):
            shown = {k: metrics[k] for k in ("loss", "kl", "density") if k in metrics}
            shown["tok/s"] = metrics.get("tokens_per_s", 0.0)
            bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})
            bar.update(1)
            self.log({"phase": phase, "step": step, **metrics})

        for _ in trainer.fit(
            iterator,
            data_state=lambda: {"iterator": iterator.state()},
            on_step=on_step,
            evaluate=evaluate,
            eval_every=c.checkpoint_every,
        ):
            pass
        bar.close()
        ckpt.close()
        return local_model(trainer.sync_model())


def _teacher_key(config: DistillConfig, data) -> str:
    parts = [config.teacher_size, data.dataset_name, config.teacher_steps, config.teacher_lr]
    parts += [config.batch_size, config.seed, 1]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def get_teacher(run: Run):
    """The dense teacher: loaded, cached, or trained here (and cached)."""
    from flax import nnx

    from sparse_jax.models import GPT2, GPT2Config
    from sparse_jax.training import sharding
    from sparse_jax.training.loop import TrainConfig
    from sparse_jax.training.losses import cross_entropy_loss

    c = run.config
    if c.teacher != "train":
        teacher = GPT2.from_pretrained(c.teacher)
        if teacher.config.vocab_size < run.data.vocab_size:
            raise ValueError(
                f"--teacher has a vocabulary of {teacher.config.vocab_size} but --tokenizer "
                f"{c.tokenizer!r} produces ids up to {run.data.vocab_size - 1}"
            )
    else:
        folder = run.cache / "teachers" / _teacher_key(c, run.data)
        if (folder / "model.safetensors").exists():
            _log(f"teacher: reusing {folder}")
            teacher = GPT2.from_pretrained(folder)
        else:
            config = GPT2Config.preset(c.teacher_size, vocab_size=run.data.vocab_size)
            teacher = GPT2(config, rngs=nnx.Rngs(c.seed))

            def loss_fn(model, batch, rng):
                return cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])

            tc = TrainConfig(
                steps=c.teacher_steps,
                batch_size=c.batch_size,
                learning_rate=c.teacher_lr,
                warmup_steps=min(50, c.teacher_steps // 10),
                weight_decay=0.01,
                seed=c.seed,
            )

            def evaluate(model):
                return {"loss": evaluate_lm(model, run.eval_windows)[0]}

            teacher = run.train_phase("teacher", teacher, loss_fn, tc, evaluate=evaluate)
            if run.primary:
                teacher.save_pretrained(folder)
            sharding.sync_processes("distill_teacher_cached")
            _log(f"teacher: cached in {folder}")
    if teacher.config.n_positions < c.seq_len:
        raise ValueError(
            f"--seq-len {c.seq_len} is longer than the teacher's {teacher.config.n_positions} "
            "positions"
        )
    return teacher


def distillation_objective(config: DistillConfig):
    """``loss_fn(student, batch, rng, teacher=...)``: KL to the teacher plus the penalties."""
    from sparse_jax.training.losses import distillation_loss, sparsity_penalty

    weights = {
        "mask_l1": config.mask_l1,
        "mask_density": config.mask_density,
        "mask_expected_density": config.mask_expected_density,
        "head_gate": config.gate_l1,
        "ffn_gate": config.gate_l1,
    }

    def loss_fn(model, batch, rng, teacher):
        ids = batch[:, :-1]
        teacher_logits = jax.lax.stop_gradient(teacher(ids))
        from flax import nnx

        logits, aux = model(ids, rngs=nnx.Rngs(gates=rng), return_aux=True)
        kl_loss, metrics = distillation_loss(
            logits, teacher_logits, temperature=config.temperature, direction=config.direction
        )
        present = {k: w for k, w in weights.items() if k in aux}
        penalty, pen_metrics = sparsity_penalty(aux, present) if present else (0.0, {})
        metrics = {**metrics, **{f"penalty_{k}": v for k, v in pen_metrics.items()}}
        metrics["density"] = attention_density(model, ids.shape[1])
        metrics.update(weight_metrics(model))
        return kl_loss + penalty, metrics

    return loss_fn


@functools.partial(jax.jit, static_argnames=("graphdef", "teacher_def"))
def _eval_scores(graphdef, state, teacher_def, teacher_state, windows):
    from flax import nnx

    from sparse_jax.training.losses import cross_entropy_loss, distillation_loss

    ids, targets = windows[:, :-1], windows[:, 1:]
    logits = nnx.merge(graphdef, state)(ids)
    nll, _ = cross_entropy_loss(logits, targets)
    if teacher_def is None:
        return nll, jnp.float32(0.0)
    teacher_logits = nnx.merge(teacher_def, teacher_state)(ids)
    return nll, distillation_loss(logits, teacher_logits)[1]["kl"]


def evaluate_lm(model, windows: np.ndarray, teacher=None, batch: int = 8):
    """(mean next-token NLL, mean KL(teacher || model) or None) over ``windows``; each process
    evaluates all of them on its own device."""
    from flax import nnx

    from sparse_jax.training.sharding import local_model

    graphdef, state = nnx.split(local_model(model))
    teacher = local_model(teacher) if teacher is not None else None
    teacher_def, teacher_state = nnx.split(teacher) if teacher is not None else (None, None)
    nlls, kls = [], []
    for start in range(0, len(windows), batch):
        w = jnp.asarray(windows[start : start + batch])
        nll, kl = _eval_scores(graphdef, state, teacher_def, teacher_state, w)
        nlls.append(float(nll))
        kls.append(float(kl))
    return float(np.mean(nlls)), (float(np.mean(kls)) if teacher is not None else None)


def attention_density(model, seq_len: int) -> jax.Array:
    """Attention density the model would keep if hardened now (traceable, for progress): per
    head, the union of the candidates with weight >= 0.5 and the strongest one (candidate
    students), the mask times the fraction of open head gates (gated), or the fixed mask's
    density; averaged over heads."""
    from sparse_jax.models.layers import SELF, CandidateMaskAttention, mask_at

    values = []
    for block in model.h:
        attn = block.attn
        if not attn.num_heads:
            continue
        core = attn.core
        if isinstance(core, CandidateMaskAttention):
            dense = np.stack([mask_at(c, seq_len, seq_len) for c in core.candidates])
            w = core._per_head_weights()  # [N, C]; as harden(threshold=0.5): argmax always kept
            kept = (w >= 0.5) | (w >= jnp.max(w, axis=1, keepdims=True))
            union = jnp.einsum(
                "nc,cts->nts", kept.astype(jnp.float32), jnp.asarray(dense, jnp.float32)
            )
            if core.anchor_self:
                union = union + jnp.asarray(mask_at(SELF, seq_len, seq_len), jnp.float32)
            values.append(jnp.mean(union > 0, axis=(1, 2)))
        else:
            d = float(np.mean(mask_at(core.mask, seq_len, seq_len)))
            open_ = attn.head_gate.hard_values() if attn.head_gate is not None else None
            if open_ is None or attn.head_gate.kind == "score_scaling":
                values.append(jnp.full((attn.num_heads,), d))
            else:
                values.append(d * open_)
    return jnp.mean(jnp.concatenate(values)) if values else jnp.float32(0.0)


def weight_metrics(model) -> dict[str, jax.Array]:
    """Scalar metrics ``w/block<i>/c<j>``: candidate ``j``'s weight in block ``i`` (mean over
    heads), for the report's weight-evolution plot."""
    from sparse_jax.models.layers import CandidateMaskAttention

    out = {}
    for i, block in enumerate(model.h):
        core = getattr(block.attn, "core", None)
        if isinstance(core, CandidateMaskAttention):
            w = core.weights()
            w = w.mean(axis=0) if w.ndim == 2 else w
            out |= {f"w/block{i}/c{j}": w[j] for j in range(w.shape[0])}
    return out


def candidate_weights(model) -> dict[str, list[list[float]]]:
    """Per block: the candidate weights ``[heads or 1][C]`` (empty for other attention)."""
    from sparse_jax.models.layers import CandidateMaskAttention

    out = {}
    for i, block in enumerate(model.h):
        core = getattr(block.attn, "core", None)
        if isinstance(core, CandidateMaskAttention):
            w = np.asarray(core.weights())
            out[f"block{i}"] = np.atleast_2d(w).round(4).tolist()
    return out


def measure_speed(model, seq_len: int, vocab: int, repeats: int = 5) -> tuple[float, float]:
    """(tokens/s, ms) of a jitted forward pass on one sequence of ``seq_len`` tokens."""
    from flax import nnx

    from experiments import timing

    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(0), (1, seq_len), 0, vocab, jnp.int32)

    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)

    stats = timing.time_fn(forward, state, ids, repeats=repeats, slow_s=10.0, budget_s=10.0)
    return seq_len / stats.median_s, stats.median_ms


def measure_attention_time(model, seq_len: int, repeats: int = 5) -> float:
    """Milliseconds of the attention cores alone (scores, normalizer, values; no projections),
    summed over the blocks: each block's jitted core on random ``[1, seq_len, heads, head_dim]``
    queries, keys and values, median of repeated calls."""
    from flax import nnx

    from experiments import timing

    total_ms = 0.0
    head_dim = model.config.head_dim
    for i, block in enumerate(model.h):
        heads = block.attn.num_heads
        if not heads:
            continue
        graphdef, state = nnx.split(block.attn.core)
        keys = jax.random.split(jax.random.key(i), 3)
        q, k, v = (jax.random.normal(key, (1, seq_len, heads, head_dim)) for key in keys)

        def core(state, q, k, v, graphdef=graphdef):
            return nnx.merge(graphdef, state)(q, k, v)[0]

        stats = timing.time_fn(core, state, q, k, v, repeats=repeats, slow_s=10.0, budget_s=10.0)
        total_ms += stats.median_ms
    return total_ms


def run(config: DistillConfig) -> dict:
    """Runs every phase; returns the summary (also written to ``summary.json``)."""
    from sparse_jax.models import flops, harden, student_from_teacher
    from sparse_jax.training.loop import TrainConfig

    started = time.perf_counter()
    seconds = {}  # wall time of each part of the run

    def lap(name):
        seconds[name] = time.perf_counter() - started - sum(seconds.values())

    r = Run(config)
    lap("data")
    teacher = get_teacher(r)
    lap("teacher")
    spec = student_spec(config)
    student = student_from_teacher(teacher, spec)
    objective = distillation_objective(config)

    def evaluate(model):
        nll, kl = evaluate_lm(model, r.eval_windows, teacher)
        return {"loss": kl, "nll": nll, "kl": kl}

    tc = TrainConfig(
        steps=config.steps,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        warmup_steps=min(30, config.steps // 10),
        trainable=config.trainable,
        fast_params=config.fast_params,
        fast_lr_multiplier=config.fast_lr_multiplier,
        seed=config.seed,
    )

    student = r.train_phase(
        "student", student, objective, tc, frozen={"teacher": teacher}, evaluate=evaluate
    )
    lap("student")
    if config.budget is not None:
        hard = harden(student, budget=config.budget, length=config.seq_len)
    else:
        hard = harden(student, threshold=config.threshold, length=config.seq_len)
    if config.finetune_steps:
        ft = dataclasses.replace(tc, steps=config.finetune_steps, warmup_steps=0, trainable=".*")
        hard = r.train_phase(
            "hardened", hard, objective, ft, frozen={"teacher": teacher}, evaluate=evaluate
        )
    lap("hardened")
    # Quality on the evaluation split.
    t_nll, _ = evaluate_lm(teacher, r.eval_windows)
    s_nll, s_kl = evaluate_lm(student, r.eval_windows, teacher)
    h_nll, h_kl = evaluate_lm(hard, r.eval_windows, teacher)
    # Cost: analytic FLOPs and measured speed at the run's length and 4x (if positions allow).
    n = config.seq_len
    lengths = [n] + ([4 * n] if 4 * n <= teacher.config.n_positions else [])
    speed = {}
    for length in lengths:
        t_tps, t_ms = measure_speed(teacher, length, teacher.config.vocab_size)
        h_tps, h_ms = measure_speed(hard, length, teacher.config.vocab_size)
        t_attn_ms = measure_attention_time(teacher, length)
        h_attn_ms = measure_attention_time(hard, length)
        f_t, f_h = flops.model_flops(teacher, length), flops.model_flops(hard, length)
        speed[length] = {
            "teacher_attention_ms": t_attn_ms,
            "hardened_attention_ms": h_attn_ms,
            "teacher_tokens_per_s": t_tps,
            "hardened_tokens_per_s": h_tps,
            "teacher_ms": t_ms,
            "hardened_ms": h_ms,
            "teacher_flops_per_token": f_t.per_token,
            "hardened_flops_per_token": f_h.per_token,
            "teacher_attention_flops": f_t.attention,
            "hardened_attention_flops": f_h.attention,
            "hardened_density": f_h.attention_density,
            "teacher_density": f_t.attention_density,
        }
    lap("measure")
    samples = sample_texts(r, teacher, hard)
    lap("samples")
    layer_density = [layer.attention_density for layer in flops.model_flops(hard, n).layers]
    summary = {
        "candidates": [repr(c) for c in (spec.candidates or ())],
        "hardened_layer_density": layer_density,
        "hardened_masks": [repr(b.attn.core.mask) if b.attn.num_heads else None for b in hard.h],
        "teacher_ppl": math.exp(t_nll),
        "student_ppl": math.exp(s_nll),
        "hardened_ppl": math.exp(h_nll),
        "student_kl": s_kl,
        "hardened_kl": h_kl,
        "hardened_heads": list(hard.config.heads_per_layer),
        "hardened_ffn_units": list(hard.config.inner_per_layer),
        "speed": speed,
        "candidate_weights": candidate_weights(student),
        "samples": samples,
        "wall_time_s": time.perf_counter() - started,
        "phase_seconds": seconds,
        "device": f"{jax.default_backend()} x{jax.device_count()}",
    }
    if r.primary:
        (r.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
        from experiments.report import write_report

        write_report(r.dir)
    _log(f"done in {summary['wall_time_s']:.0f} s: {r.dir / 'report.md'}")
    return summary


def sample_texts(r: Run, teacher, hard) -> list[dict[str, str]]:
    """Greedy continuations of a few evaluation prompts by the teacher and the hardened model."""
    from sparse_jax.data.tokenizers import get_tokenizer
    from sparse_jax.models import generate

    c = r.config
    tok = get_tokenizer(c.tokenizer)
    prompt_len, new = min(32, c.seq_len // 2), min(48, c.seq_len // 2)
    out = []
    for i in range(min(c.report_prompts, len(r.eval_windows))):
        prompt = jnp.asarray(r.eval_windows[i : i + 1, :prompt_len])
        t = generate(teacher, prompt, new, temperature=0.0)[0, prompt_len:]
        h = generate(hard, prompt, new, temperature=0.0)[0, prompt_len:]
        out.append(
            {
                "prompt": tok.decode(np.asarray(prompt[0]).tolist()),
                "teacher": tok.decode(np.asarray(t).tolist()),
                "hardened": tok.decode(np.asarray(h).tolist()),
            }
        )
    return out


def main(argv=None) -> None:
    config = tyro.cli(DistillConfig, args=argv, description=__doc__.split("\n\n")[0])
    run(config)


if __name__ == "__main__":
    main()
