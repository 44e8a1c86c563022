"""The three phases of the distillation job, each checkpointed and resumable through
:class:`~experiments.distill.run_folder.Run`:

1. ``teacher``: the bundled teacher (:mod:`experiments.common.teachers`), a Hugging Face GPT-2
   loaded from a folder or the hub, or a GPT-2 of a preset size trained here with cross-entropy and
   cached (Hugging Face layout) under the cache folder, densely or with a planted candidate
   mask per head (:func:`planted_pattern`);
2. ``student``: the teacher's weights with learnable sparse attention, trained on
   KL(teacher || student) plus the sparsity penalties;
3. ``hardened``: ``harden()`` turns the learned weights into fixed masks and pruned heads/units,
   then a short fine-tune on the same objective.

Example::

    run = distill_run.Run(config)
    teacher = distill_phases.teacher(run)
    student, spec = distill_phases.student(run, teacher)
    hard = distill_phases.hardened(run, student, teacher)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import shlex
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import measure, teachers
from experiments.distill.config import DistillConfig
from experiments.distill.run_folder import Run, log
from sparse_jax import masks
from sparse_jax.block_gate import LearnedBlockSelection
from sparse_jax.data import recall, text
from sparse_jax.dynamic import BlockSelection
from sparse_jax.files import replace_atomically
from sparse_jax.models import (
    GPT2,
    AttentionSpec,
    GPT2Config,
    from_pretrained,
    harden,
    save_pretrained,
    student_from_teacher,
)
from sparse_jax.models.hf import PretrainedFileError
from sparse_jax.models.layers import CandidateMaskAttention, default_candidates, mask_at
from sparse_jax.training import loop, sharding
from sparse_jax.training.losses import cross_entropy_loss, distillation_loss, sparsity_penalty

__all__ = [
    "cached_teacher",
    "candidate_bank",
    "harden_student",
    "hardened",
    "load_cached_teacher",
    "objective",
    "planted_pattern",
    "planted_specs",
    "planted_swaps",
    "student",
    "student_spec",
    "teacher",
    "teacher_key",
    "trainable",
]


# ----------------------------------------------------------------------------------------------
# 1. The teacher.


def teacher_key(config: DistillConfig, data) -> str:
    """The cache key of a teacher trained here: what its training depends on (a planted
    teacher adds its pattern and candidates)."""
    t = config.teacher
    parts = [t.size, data.dataset_name, t.steps, t.lr, config.data.batch_size, config.run.seed, 1]
    if t.smear_keys or t.recall_steps:  # (a teacher trained without them keeps its old key)
        parts += [t.smear_keys, t.recall_steps]
    if t.positions != "learned":
        parts += [t.positions]
    if t.smear_width != 1:
        parts += [f"smear_width={t.smear_width}"]
    if t.recall_steps:
        recall = [t.recall_fraction, config.teacher_recall_lengths(), t.recall_tokens]
        parts += [*recall, t.recall_lr, t.answer_weight]
    if t.recall_steps and t.recall_long_steps:
        parts += [f"recall_long_steps={t.recall_long_steps}"]
        if t.recall_long_lr != 2e-3:  # (the rate of the teachers keyed before it was a flag)
            parts += [f"recall_long_lr={t.recall_long_lr}"]
    if t.source == "planted":
        pattern = planted_pattern(config)
        parts += ["planted", pattern.tolist(), [repr(m) for m in candidate_bank(config)]]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def candidate_bank(config: DistillConfig) -> tuple[masks.Mask, ...]:
    """The student's candidate masks: sink(4), causal windows of --student.windows, the Sparse
    Transformer's strided(round(sqrt(--data.seq-len))) and full causal attention."""
    bank = default_candidates(4, config.student.windows)
    stride = max(2, round(math.sqrt(config.data.seq_len)))
    return (*bank[:-2], masks.strided(stride), bank[-1])


def planted_pattern(config: DistillConfig) -> np.ndarray:
    """int ``[n_layer, n_head]``: the candidate (index into :func:`candidate_bank`) each head of
    the planted teacher is trained with: every candidate equally often (as far as the heads
    divide), placed by --run.seed so that heads and blocks differ.

    Example::

        planted_pattern(distill.parse(["--teacher.source", "planted"]))  # [4, 4]
    """
    size = GPT2Config.preset(config.teacher.size)
    heads = size.n_layer * size.n_head
    order = np.resize(np.arange(len(candidate_bank(config))), heads)
    rng = np.random.default_rng(config.run.seed)
    return rng.permutation(order).reshape(size.n_layer, size.n_head)


def planted_specs(config: DistillConfig) -> list[AttentionSpec]:
    """The planted teacher's attention, one spec per block: each head under its planted mask."""
    bank = candidate_bank(config)
    return [
        AttentionSpec(mask=masks.per_head([bank[c] for c in row]))
        for row in planted_pattern(config)
    ]


def planted_swaps(run: Run, teacher: GPT2, student: GPT2) -> np.ndarray:
    """:func:`measure.planted_swaps` for the run's planted teacher on its evaluation windows,
    cached beside the cached teacher (it depends only on the teacher and the windows)."""
    c = run.config
    folder = run.cache / "teachers" / teacher_key(c, run.data)
    path = folder / f"planted_swaps_{len(run.eval_windows)}.npy"
    if path.is_file():
        return np.load(path)
    swaps = measure.planted_swaps(teacher, student, planted_pattern(c), run.eval_windows)
    if run.primary and folder.is_dir():

        def save(tmp: pathlib.Path) -> None:
            with open(tmp, "wb") as file:
                np.save(file, swaps)

        replace_atomically(path, save)
    return swaps


def teacher(run: Run) -> GPT2:
    """The teacher: bundled, loaded, cached, or trained here (and cached), dense or planted."""
    c = run.config
    source = c.teacher.source
    if source == "bundled":
        model = from_pretrained(teachers.BUNDLED)
        log(f"teacher: the bundled one ({teachers.BUNDLED}; {teachers.record()['command']})")
    elif source not in c.teacher.TRAINED:
        try:
            model = from_pretrained(source)
        except PretrainedFileError as err:
            raise PretrainedFileError(
                err.path,
                err.problem,
                f"--teacher.source {source!r}: download the folder again, or pass "
                "another folder holding a Hugging Face GPT-2.",
            ) from err
    else:
        attention = planted_specs(c) if source == "planted" else None
        folder = run.cache / "teachers" / teacher_key(c, run.data)
        if cached_teacher(folder) is not None:
            log(f"teacher: reusing {folder}")
            model = load_cached_teacher(folder, attention)
        else:
            model = _train_teacher(run, attention)
            if run.primary:  # written whole or not at all (save_pretrained renames a new folder)
                save_pretrained(model, folder)
            sharding.sync_processes("distill_teacher_cached")
            log(f"teacher: cached in {folder}")
    if model.config.vocab_size < run.data.vocab_size:
        raise ValueError(
            f"--teacher.source {source!r} has a vocabulary of {model.config.vocab_size} but "
            f"--data.tokenizer {c.data.tokenizer!r} produces ids up to {run.data.vocab_size - 1}"
        )
    if model.config.n_positions < c.data.seq_len:
        raise ValueError(
            f"--data.seq-len {c.data.seq_len} is longer than the teacher's "
            f"{model.config.n_positions} positions"
        )
    return model


def cached_teacher(folder: pathlib.Path) -> pathlib.Path | None:
    """``folder`` if it holds a complete cached teacher, else None. A folder holding only
    part of one (left by a version that wrote the files in place, killed between them) is
    moved aside, so that the teacher is trained and cached again."""
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    if folder.exists() and sharding.is_primary():
        log(f"teacher: {folder} holds an incomplete cached teacher; removed, training it again")
        aside = folder.with_name(f".{folder.name}.incomplete-{os.getpid()}")
        os.rename(folder, aside)  # gone from its name at once, then deleted
        shutil.rmtree(aside, ignore_errors=True)
    sharding.sync_processes("distill_teacher_cache_checked")
    return None


def load_cached_teacher(folder: pathlib.Path, attention=None) -> GPT2:
    """The cached teacher of ``folder`` (with ``attention``: its specs, which the cache does not
    hold; None: dense causal); an unreadable cache names its file and says to delete the folder
    (the teacher is then trained again)."""
    try:
        return from_pretrained(folder, attention)
    except PretrainedFileError as err:
        raise PretrainedFileError(
            err.path,
            err.problem,
            f"The cached teacher is damaged: delete its folder (rm -r {shlex.quote(str(folder))}) "
            "and run the command again; the teacher is trained and cached again.",
        ) from err


def recall_filler(run: Run, split: str) -> recall.Filler:
    """The recall sequences' text: the ``split`` ("train" or "eval") of --data.source."""
    c = run.config
    source = text.resolve_source(c.data.source, tfds_data_dir=run.cache / "tfds")
    return recall.make_filler(source, c.data.tokenizer, split=split)


def recall_batches(run: Run, lengths, tokens: int, fraction: float):
    """``batches(state)`` for :meth:`Run.train_phase`: a RecallMixture of text and passkey
    sequences of the corpus's train split (this process's rows), fresh or from ``state``."""
    c = run.config
    index, count = sharding.process_data_slice(run.mesh)
    mixture = dict(lengths=lengths, tokens=tokens, recall_fraction=fraction, seed=c.run.seed,
                   process_index=index, process_count=count)  # fmt: skip
    filler = recall_filler(run, "train")

    def batches(state):
        if state is None:
            return recall.RecallMixture(c.data.tokenizer, filler, **mixture)
        return recall.RecallMixture.from_state(c.data.tokenizer, state, filler, **mixture)

    return batches


def _lm_loss(model, batch, rng):
    return cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])


def _train_teacher(run: Run, attention=None) -> GPT2:
    """--teacher.steps updates on the corpus's windows, then --teacher.recall-steps on a mixture
    of text and passkey sequences (phase ``teacher_recall``), then --teacher.recall-long-steps
    on the same mixture at its longest length alone (phase ``teacher_recall_long``)."""
    c, t = run.config, run.config.teacher
    config = GPT2Config.preset(
        t.size,
        vocab_size=run.data.vocab_size,
        smear_keys=t.smear_keys,
        smear_width=t.smear_width,
        positions=t.positions,
    )
    model = GPT2(config, attention or AttentionSpec(), rngs=nnx.Rngs(c.run.seed))
    tc = loop.TrainConfig(
        steps=t.steps,
        batch_size=c.data.batch_size,
        learning_rate=t.lr,
        warmup_steps=min(50, t.steps // 10),
        weight_decay=0.01,
        seed=c.run.seed,
    )

    def evaluate(model):
        return {"loss": measure.evaluate_lm(model, run.eval_windows)[0]}

    model = run.train_phase("teacher", model, _lm_loss, tc, evaluate=evaluate)
    if not t.recall_steps:
        return model
    lengths = c.teacher_recall_lengths()
    batches = recall_batches(run, lengths, t.recall_tokens, t.recall_fraction)
    held_out = recall_filler(run, "eval")

    def loss(model, batch, rng):
        logits = model(batch[:, 0, :-1])
        targets = batch[:, 0, 1:]
        nll, metrics = cross_entropy_loss(logits, targets)
        answers, _ = cross_entropy_loss(logits, targets, mask=batch[:, 1, 1:] == 1)
        return nll + t.answer_weight * answers, {**metrics, "answer_nll": answers}

    measured = tuple(sorted(set(lengths)))

    def evaluate_recall(model):  # the text loss, and passkey recall at each length
        table = measure.recall_accuracy(
            model, c.data.tokenizer, held_out, lengths=measured, count=24
        )
        accuracy = {f"recall_{n}": np.mean([v for (m, _), v in table.items() if m == n])
                    for n in measured}  # fmt: skip
        return {**evaluate(model), **accuracy}

    recall_tc = dataclasses.replace(
        tc,
        steps=t.recall_steps,
        batch_size=max(1, t.recall_tokens // min(lengths)),
        learning_rate=t.recall_lr,
        warmup_steps=min(50, t.recall_steps // 10),
    )
    model = run.train_phase(
        "teacher_recall", model, loss, recall_tc, evaluate=evaluate_recall, batches=batches
    )
    if not t.recall_long_steps:
        return model
    longest = max(lengths)
    long_tc = dataclasses.replace(
        recall_tc,
        steps=t.recall_long_steps,
        batch_size=max(1, t.recall_tokens // longest),
        learning_rate=t.recall_long_lr,
        warmup_steps=min(50, t.recall_long_steps // 10),
    )
    long_batches = recall_batches(run, (longest,), t.recall_tokens, t.recall_fraction)
    return run.train_phase(
        "teacher_recall_long", model, loss, long_tc, evaluate=evaluate_recall,
        batches=long_batches,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 2. The student.


def student_spec(config: DistillConfig) -> AttentionSpec:
    """The student's AttentionSpec for the configured kind."""
    s = config.student
    norm = s.normalizer_value()
    blocks = (s.block_size, s.block_size)
    if s.kind == "candidates":
        if s.select_gate == "learned":
            kind = functools.partial(LearnedBlockSelection, pool=s.select_pool)
        else:
            kind = BlockSelection
        selection = (kind(s.select_blocks, block=s.select_block),) if s.select_blocks else ()
        return AttentionSpec(
            kind="candidates",
            candidates=(*candidate_bank(config), *selection),
            granularity=s.granularity,
            combine=s.combine,
            anchor_self=s.anchor_self,
            weighting=s.weighting,
            price_len=s.serve_len_factor * config.data.seq_len,
            normalizer=norm,
            block_size=blocks,
        )
    if s.kind == "gated":
        return AttentionSpec(normalizer=norm, head_gate=s.gate, ffn_gate=s.gate, block_size=blocks)
    window = masks.causal() & masks.local(s.fixed_window - 1, 0)
    mask = window | (masks.sink(4) & masks.causal())
    return AttentionSpec(mask=mask, normalizer=norm, block_size=blocks)


_MASK_PENALTIES = ("mask_l1", "mask_density", "mask_expected_density", "mask_expected_cost")


def objective(config: DistillConfig, ramp: tuple[int, int] = (0, 0), selectors: bool = True):
    """``loss_fn(student, batch, rng, teacher=..., step=...)``: KL to the teacher plus the
    penalties, with the progress metrics (density if hardened now, candidate weights). The mask
    penalties are off before update ``ramp[0]`` and grow linearly to full weight at ``ramp[1]``
    (--loss.penalty-ramp). ``selectors=False`` leaves out the learned selectors' loss (a phase
    that holds their gates: the compiled update then never computes it)."""
    start, end = ramp
    weights = config.loss.penalty_weights()  # those the model's aux lacks are left out below
    left_out = () if selectors else ("mask_selector_kl",)
    temperature, direction = config.loss.temperature, config.loss.direction

    def loss_fn(model, batch, rng, teacher, step):
        ids = batch[:, 0, :-1] if batch.ndim == 3 else batch[:, :-1]  # a RecallMixture's: ids
        teacher_logits = jax.lax.stop_gradient(teacher(ids))
        logits, aux = model(ids, rngs=nnx.Rngs(gates=rng), return_aux=True)
        aux = {k: v for k, v in aux.items() if k not in left_out}  # not even as a metric
        kl_loss, metrics = distillation_loss(
            logits, teacher_logits, temperature=temperature, direction=direction
        )
        present = {k: w for k, w in weights.items() if k in aux}
        penalty, pen_metrics = 0.0, {}
        if present:
            on_masks = {k: w for k, w in present.items() if k in _MASK_PENALTIES}
            on_gates = {k: w for k, w in present.items() if k not in on_masks}
            mask_penalty, pen_metrics = sparsity_penalty(aux, on_masks)
            scale = jnp.clip((step + 1 - start) / max(end - start, 1), 0.0, 1.0) if end else 1.0
            penalty = scale * mask_penalty + sparsity_penalty(aux, on_gates)[0]
            pen_metrics["total"] = penalty
        metrics = {**metrics, **{f"penalty_{k}": v for k, v in pen_metrics.items()}}
        metrics["density"] = model.attention_density(ids.shape[1])  # if hardened now
        metrics.update(measure.weight_metrics(model))
        return kl_loss + penalty, metrics

    return loss_fn


def trainable(config: DistillConfig) -> str:
    """The regex of the student parameters its phase trains (--train.trainable, 'auto'
    resolved: the candidate logits of a candidates student, else everything)."""
    if config.train.trainable != "auto":
        return config.train.trainable
    if config.student.kind != "candidates":
        return ".*"
    if config.student.select_gate == "learned" and not config.train.selector_steps:
        return "core/logits|core/selector_gates"
    return "core/logits"


def _train_config(config: DistillConfig) -> loop.TrainConfig:
    t = config.train
    return loop.TrainConfig(
        steps=t.steps,
        batch_size=config.data.batch_size,
        learning_rate=t.lr,
        warmup_steps=min(30, t.steps // 10),
        trainable=trainable(config),
        fast_params=t.fast_params,
        fast_lr_multiplier=t.fast_lr_multiplier,
        fast_eps=t.fast_eps,
        seed=config.run.seed,
    )


def _evaluate_against(run: Run, teacher: GPT2):
    def evaluate(model):
        nll, kl = measure.evaluate_lm(model, run.eval_windows, teacher)
        return {"loss": kl, "nll": nll, "kl": kl}

    return evaluate


def _student_batches(run: Run):
    """The student's batches: a RecallMixture at --data.seq-len with the share of passkey
    sequences DistillConfig.student_recall_fraction resolves, or the corpus's windows when
    that is 0 (None)."""
    c = run.config
    fraction = c.student_recall_fraction()
    if not fraction:
        return None
    n = c.data.seq_len
    return recall_batches(run, (n,), c.data.batch_size * n, fraction)


def selector_length(config: DistillConfig, teacher: GPT2) -> int:
    """The length of the selector phase's sequences: the serving length (--student.serve-len-factor
    x --data.seq-len) where the teacher's positions reach it, else --data.seq-len."""
    serve_len = config.student.serve_len_factor * config.data.seq_len
    return serve_len if serve_len <= teacher.config.n_positions else config.data.seq_len


def _selector_loss(model, batch, rng):
    """The selectors' loss alone (the gates' KL to their layers' attention, summed over layers;
    the model's queries and keys held fixed)."""
    ids = batch[:, 0, :-1] if batch.ndim == 3 else batch[:, :-1]
    _, aux = model(ids, rngs=nnx.Rngs(gates=rng), return_aux=True)
    return aux["mask_selector_kl"], {"selector_kl": aux["mask_selector_kl"]}


@functools.partial(jax.jit, static_argnames="graphdef")
def _held_out_selector_loss(graphdef, state, batch, rng):
    return _selector_loss(nnx.merge(graphdef, state), batch, rng)[0]


def train_selectors(run: Run, model: GPT2, teacher: GPT2) -> GPT2:
    """Phase ``selector`` (--student.select-gate learned, --train.selector-steps > 0): the
    student's selector gates alone learn where their layers attend, on the corpus's text mixed
    with passkeys as the student's batches are, at :func:`selector_length`, so that a gate ranks
    the key blocks of the sequences it will serve (SeerAttention trains its gates on the frozen
    model's long sequences); the search then holds them."""
    c = run.config
    length = selector_length(c, teacher)
    tokens = c.data.batch_size * c.data.seq_len
    fraction = c.student_recall_fraction()  # > 0 only where a passkey fits in --data.seq-len
    tc = dataclasses.replace(
        _train_config(c),
        steps=c.train.selector_steps,
        batch_size=max(1, tokens // length),
        warmup_steps=min(30, c.train.selector_steps // 10),
        trainable="core/selector_gates",
    )
    batches = recall_batches(run, (length,), tokens, fraction)
    mixture = dict(lengths=(length,), tokens=tokens, recall_fraction=fraction, seed=c.run.seed)
    held_out = recall.RecallMixture(c.data.tokenizer, recall_filler(run, "eval"), **mixture)
    eval_batches = [next(held_out) for _ in range(c.measure.eval_batches)]

    def evaluate(model):  # the selectors' loss on held-out text and passkeys of that length
        graphdef, state = nnx.split(sharding.local_model(model))
        key = jax.random.key(c.run.seed)
        losses = [
            float(_held_out_selector_loss(graphdef, state, jnp.asarray(b), key))
            for b in eval_batches
        ]
        return {"loss": float(np.mean(losses))}

    return run.train_phase(
        "selector", model, _selector_loss, tc, evaluate=evaluate, batches=batches
    )


def student(run: Run, teacher: GPT2) -> tuple[GPT2, AttentionSpec]:
    """The distilled student (soft masks or gates) and the spec it was built from; with
    --student.select-gate learned, its selectors' gates first learn alone
    (:func:`train_selectors`)."""
    spec = student_spec(run.config)
    model = student_from_teacher(teacher, spec)
    c = run.config
    held = c.student.select_gate == "learned" and c.train.selector_steps > 0
    if held:
        model = train_selectors(run, model, teacher)
    model = run.train_phase(
        "student",
        model,
        objective(c, c.loss.ramp_steps(c.train.steps), selectors=not held),
        _train_config(run.config),
        frozen={"teacher": teacher},
        evaluate=_evaluate_against(run, teacher),
        batches=_student_batches(run),
    )
    return model, spec


# ----------------------------------------------------------------------------------------------
# 3. The hardened student.


def harden_student(config: DistillConfig, student: GPT2, *, by_budget: bool = True) -> GPT2:
    """``harden(student)`` as --harden.* say, without the fine-tune: by --harden.budget (in
    kernel blocks at the serving length, or in density at the training length: --harden.price)
    when it is set and ``by_budget``, else by --harden.threshold."""
    c = config
    if c.harden.budget is None or not by_budget:
        return harden(student, threshold=c.harden.threshold, length=c.data.seq_len)
    if c.harden.price == "blocks":
        serve_len = c.student.serve_len_factor * c.data.seq_len
        return harden(student, budget=c.harden.budget, length=serve_len, price="blocks")
    return harden(student, budget=c.harden.budget, length=c.data.seq_len)


def reaches_far(candidate, length: int) -> bool:
    """Whether a candidate lets the last query of a ``length``-token sequence see a key in the
    middle half of it (positions ``length // 4`` to ``3 * length // 4``): full causal attention,
    strided patterns and block selections (which may choose any earlier block) do; causal
    windows shorter than a quarter of the sequence and sinks do not.

    Example:
      >>> reaches_far(masks.causal(), 512), reaches_far(masks.causal() & masks.local(31, 0), 512)
      (True, False)
    """
    if isinstance(candidate, BlockSelection):
        return True
    last = np.asarray(mask_at(candidate & masks.causal(), 1, length)).reshape(-1, length)
    return bool(last[:, length // 4 : 3 * length // 4].any())


def harden_to_local(config: DistillConfig, student: GPT2) -> GPT2 | None:
    """The contrast that shows what retrieval needs: the same student hardened as --harden.*
    say with every candidate that reaches far (:func:`reaches_far` at the serving length: full
    causal, strided, selections) taken out of each head's choice, so that each head keeps
    among its windows and sinks; without the fine-tune. None when no layer learns among both
    kinds (a bank of far candidates only, or of near ones only, or a model of fixed layers)."""
    serve_len = config.student.serve_len_factor * config.data.seq_len

    def far(core):
        out = [j for j, c in enumerate(core.candidates) if reaches_far(c, serve_len)]
        return out if len(out) < len(core.candidates) else []

    return _harden_without(config, student, far)


def _harden_without(config: DistillConfig, student: GPT2, dropped) -> GPT2 | None:
    """A copy of ``student`` hardened as --harden.* say with the candidates ``dropped(core)``
    names (indices) taken out of each CandidateMaskAttention layer's choice (weight 0), without
    the fine-tune; None when no layer drops any."""
    copy = nnx.clone(student)
    found = False
    for block in copy.h:
        core = block.attn.core if block.attn.num_heads else None
        drop = dropped(core) if isinstance(core, CandidateMaskAttention) else []
        if drop:
            core.logits[...] = core.logits[...].at[..., drop].set(-1e9)  # weight 0
            found = True
    return harden_student(config, copy) if found else None


def harden_without_selections(config: DistillConfig, student: GPT2) -> GPT2 | None:
    """The contrast to a student that may keep data-dependent candidates: the same student
    hardened as --harden.* say with every BlockSelection taken out of each head's choice (its
    weight set to 0, so each head keeps among its static candidates), without the fine-tune.
    None when the student has no selection to take out."""
    return _harden_without(config, student, lambda core: list(core.selection_indices))


def hardened(run: Run, student: GPT2, teacher: GPT2) -> GPT2:
    """``harden()`` by the budget (in kernel blocks at the serving length, or in density at the
    training length: --harden.price) or by the threshold, then the fine-tune (if any steps)."""
    c = run.config
    hard = harden_student(c, student)
    if c.harden.finetune_steps:
        ft = dataclasses.replace(
            _train_config(c),
            steps=c.harden.finetune_steps,
            learning_rate=c.harden.finetune_lr,
            warmup_steps=min(c.harden.finetune_warmup, c.harden.finetune_steps),
            trainable=".*",
        )
        hard = run.train_phase(
            "hardened",
            hard,
            objective(c),
            ft,
            frozen={"teacher": teacher},
            evaluate=_evaluate_against(run, teacher),
            batches=_student_batches(run),
        )
    return hard


def recall_table(run: Run, models: dict[str, GPT2], count: int | None = None) -> dict:
    """Passkey recall of each model (``count`` sequences per length, None:
    --measure.recall-sequences; depths 0.1, 0.5, 0.9 of the corpus's held-out text) at 1x, 2x and
    4x --data.seq-len, those within the teacher's positions that hold a passkey: ``{"lengths":
    [...], "sequences": count, "models": {name: {"T@depth": accuracy}}}``; ``lengths`` empty
    when none fits or the table is off."""
    c = run.config
    count = c.measure.recall_sequences if count is None else count
    positions = min(m.config.n_positions for m in models.values())
    shortest = recall.shortest_length("passkey", c.data.tokenizer)
    n = c.data.seq_len
    lengths = [t for t in (n, 2 * n, 4 * n) if shortest <= t <= positions] if count else []
    if not lengths:
        return {"lengths": [], "sequences": 0, "models": {}}
    held_out = recall_filler(run, "eval")
    out = {}
    for name, model in models.items():
        table = measure.recall_accuracy(
            model, c.data.tokenizer, held_out, lengths=lengths, count=count
        )
        out[name] = {f"{t}@{d}": accuracy for (t, d), accuracy in table.items()}
    return {"lengths": lengths, "sequences": count, "models": out}
