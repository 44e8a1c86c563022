"""A teacher that retrieves: its flags, its training phase, and the recall measurement."""

from __future__ import annotations

import hashlib
import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import distill
from experiments.common import measure
from experiments.distill import phases, report
from experiments.distill.run_folder import Run
from sparse_jax.data.recall import make_examples, make_filler
from sparse_jax.masks import causal, local
from sparse_jax.models import GPT2, AttentionSpec, GPT2Config, student_from_teacher

FILLER = make_filler(" ".join(f"word{i % 89} then more" for i in range(4000)), "byte")


class NgramCopier(nnx.Module):
    """A model that retrieves by rule: at each position it predicts the token that followed
    the latest earlier occurrence of its last ``n`` tokens within the last ``window`` positions
    (0 when there is none), as one-hot logits ``[B, T, 257]``."""

    def __init__(self, n: int = 8, window: int | None = None):
        self.n, self.window = n, window

    def __call__(self, ids):
        b, t = ids.shape
        pos = jnp.arange(t)
        # same[i, j]: the n tokens ending at j equal those ending at i (j < i).
        same = jnp.ones((b, t, t), bool)
        for k in range(self.n):
            shifted = jnp.pad(ids, ((0, 0), (k, 0)), constant_values=-1)[:, :t]
            same &= shifted[:, :, None] == shifted[:, None, :]
        earlier = (pos[None, :] < pos[:, None]) & (pos[None, :] >= self.n - 1)
        if self.window is not None:
            earlier &= pos[:, None] - pos[None, :] <= self.window
        match = same & earlier[None]
        latest = jnp.max(jnp.where(match, pos[None, None, :], -1), axis=-1)  # [B, T]
        follow = jnp.take_along_axis(ids, jnp.clip(latest + 1, 0, t - 1), axis=1)
        guess = jnp.where(latest >= 0, follow, 0)
        return jnp.eye(257, dtype=jnp.float32)[guess]


def test_recall_accuracy_grades_each_length_and_depth_from_greedy_answers():
    lengths, depths = (128, 512), (0.1, 0.5, 0.9)
    perfect = measure.recall_accuracy(NgramCopier(), "byte", FILLER, lengths=lengths, count=3)
    assert perfect == {(n, d): 1.0 for n in lengths for d in depths}
    # A copier that sees only the last 200 positions: right wherever the key is that close
    # (all of 128; depth 0.9 of 512), wrong where it is further back.
    window = measure.recall_accuracy(
        NgramCopier(window=200), "byte", FILLER, lengths=lengths, count=3
    )
    assert window == {
        (128, 0.1): 1.0, (128, 0.5): 1.0, (128, 0.9): 1.0,
        (512, 0.1): 0.0, (512, 0.5): 0.0, (512, 0.9): 1.0,
    }  # fmt: skip
    # The figure is the greedy answer's: recomputed here from the copier's own continuation.
    batch = make_examples("passkey", "byte", FILLER, length=512, count=3, depths=depths,
                          seed=1_000_000)  # fmt: skip
    for i in range(3):
        prompt = batch.ids[i, : batch.answer_start[i, 0]]
        answer = []
        for _ in range(int(batch.answer_len[i, 0])):
            ids = np.concatenate([prompt, np.array(answer, np.int32)])
            logits = NgramCopier(window=200)(jnp.asarray(ids)[None])
            answer.append(int(jnp.argmax(logits[0, -1])))
        right = bytes(answer).decode("latin-1") == batch.answer_text[i][0]
        assert right == (window[(512, depths[i % 3])] == 1.0)


def _config(tmp_path, *extra):
    return distill.parse([
        "--teacher.source", "train", "--teacher.steps", "1", "--teacher.smear-keys",
        "--teacher.positions", "learned",
        "--teacher.recall-steps", "2", "--teacher.recall-long-steps", "0",
        "--teacher.recall-lengths", "96", "--teacher.recall-tokens", "192", "--data.seq-len", "32",
        "--run.dir", str(tmp_path / "run"), "--run.cache-dir", str(tmp_path / "cache"), *extra,
    ])  # fmt: skip


def test_the_teacher_trains_on_text_then_on_the_recall_mixture_then_at_its_longest_length(
    tmp_path, monkeypatch
):
    lengths = ["--teacher.recall-lengths", "96", "128", "--teacher.recall-tokens", "256"]
    config = _config(tmp_path, *lengths, "--teacher.recall-long-steps", "1",
                     "--teacher.recall-long-lr", "5e-4")  # fmt: skip
    asked, rates = [], {}
    recall_batches, train_phase = phases.recall_batches, Run.train_phase

    def spy_batches(run, lengths, tokens, fraction):
        asked.append(tuple(lengths))
        return recall_batches(run, lengths, tokens, fraction)

    def spy_phase(self, name, model, loss, tc, **kwargs):
        rates[name] = tc.learning_rate
        return train_phase(self, name, model, loss, tc, **kwargs)

    monkeypatch.setattr(phases, "recall_batches", spy_batches)
    monkeypatch.setattr(Run, "train_phase", spy_phase)
    run = Run(config)
    model = phases.teacher(run)
    assert model.config.smear_keys and model.h[0].attn.smear_logit is not None
    # The mixture cycles the recall lengths; the long updates ask for the longest alone, at
    # their own peak rate.
    assert asked == [(96, 128), (128,)]
    assert rates == {"teacher": 3e-3, "teacher_recall": 2e-3, "teacher_recall_long": 5e-4}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {}
    for x in lines:
        steps.setdefault(x["phase"], []).append(x["step"])
    assert steps == {"teacher": [1], "teacher_recall": [1, 2], "teacher_recall_long": [1]}
    recall_lines = [x for x in lines if x["phase"].startswith("teacher_recall")]
    assert all(x["answer_nll"] > 0 for x in recall_lines)
    for x in (recall_lines[1], recall_lines[2]):  # each phase's end, at every length
        assert {"eval_recall_96", "eval_recall_128"} <= set(x)
        assert 0.0 <= x["eval_recall_128"] <= 1.0  # evaluated on held-out text
    # Cached under a key of its recall flags; the plain teacher's key does not change.
    data = run.data
    key = phases.teacher_key(config, data)
    assert (tmp_path / "cache" / "teachers" / key / "model.safetensors").is_file()
    off = ["--teacher.recall-steps", "0", "--teacher.no-smear-keys", "--teacher.smear-width", "1"]
    plain = _config(tmp_path, *off)
    variants = [
        config,
        plain,
        _config(
            tmp_path,
            *lengths,
            "--teacher.recall-long-steps",
            "1",
            "--teacher.recall-long-lr",
            "2e-3",
        ),
        _config(tmp_path, *lengths),  # no long updates
        _config(tmp_path, "--teacher.recall-fraction", "0.25"),
        _config(tmp_path, "--teacher.positions", "rotary"),
        _config(tmp_path, "--teacher.smear-width", "2"),
    ]
    assert len({phases.teacher_key(c, data) for c in variants}) == len(variants)
    old = [plain.teacher.size, data.dataset_name, 1, plain.teacher.lr, 8, 0, 1]
    digest = hashlib.sha256(json.dumps(old, default=str).encode()).hexdigest()[:16]
    assert phases.teacher_key(plain, data) == digest
    # --teacher.recall-steps 0 turns every recall update off, the long ones too.
    long_off = _config(tmp_path, *off, "--teacher.recall-long-steps", "5")
    assert phases.teacher_key(long_off, data) == phases.teacher_key(plain, data)
    # The teacher keyed before the long rate was a flag (the bundled one of then, trained at
    # 2e-3) keeps its key.
    then = distill.parse(["--teacher.source", "train", "--teacher.recall-long-steps", "2000",
                          "--teacher.recall-long-lr", "2e-3"])  # fmt: skip
    corpus = types.SimpleNamespace(
        dataset_name="sparse_jax_text/default_byte_s128_a70c75b40ec182bf:1.0.0"
    )
    assert phases.teacher_key(then, corpus) == "6eac035e87d74e2a"


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--teacher.recall-fraction", "1.5"], r"--teacher.recall-fraction must be in \[0, 1\]"),
        (["--teacher.recall-lengths", "0"], r"--teacher.recall-lengths must be ints >= 1"),
        (["--teacher.recall-lengths", "1024"], r"reach beyond the teacher's 512 positions"),
        (["--teacher.recall-tokens", "0"], r"--teacher.recall-tokens must be an int >= 1"),
        (["--teacher.recall-lr", "0"], r"--teacher.recall-lr must be a number > 0"),
        (["--teacher.answer-weight", "-1"], r"--teacher.answer-weight must be a number >= 0"),
        (["--teacher.smear-width", "0"], r"--teacher.smear-width must be an int >= 1"),
        (["--teacher.recall-long-steps", "-1"], r"--teacher.recall-long-steps must be an int >= 0"),
        (["--teacher.recall-long-lr", "0"], r"--teacher.recall-long-lr must be a number > 0"),
        (["--train.recall-fraction", "2"], r"--train.recall-fraction must be None or in \[0, 1\]"),
        (
            ["--train.recall-fraction", "0.5"],  # --data.seq-len 32
            r"--train.recall-fraction 0.5 mixes passkey sequences of --data.seq-len 32 tokens .* "
            r"need \d+ .* or --train.recall-fraction 0",
        ),
        (
            ["--teacher.no-smear-keys", "--teacher.smear-width", "2"],
            r"--teacher.smear-width 2 mixes keys .* add --teacher.smear-keys",
        ),
    ],
)
def test_bad_recall_flags_are_refused_by_name(tmp_path, flags, match, capsys):
    with pytest.raises(SystemExit):
        _config(tmp_path, *flags)
    err = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().err).split())
    assert re.search(match, err), err


def test_the_default_recall_lengths_are_the_reports_that_fit_the_teacher():
    config = distill.parse(["--teacher.source", "train", "--data.seq-len", "64"])
    assert config.teacher_recall_lengths() == (64, 128, 256)
    longer = distill.parse(["--teacher.source", "train", "--data.seq-len", "256"])
    assert longer.teacher_recall_lengths() == (256, 512)  # the teacher has 512 positions
    named = distill.parse(["--teacher.source", "train", "--teacher.recall-lengths", "96", "32"])
    assert named.teacher_recall_lengths() == (96, 32)


def test_the_students_batches_carry_the_teachers_mixture_where_a_passkey_fits(tmp_path):
    default = distill.parse([])  # the bundled teacher was trained with recall updates
    assert default.train.recall_fraction is None
    assert default.student_recall_fraction() == default.teacher.recall_fraction == 0.5
    assert distill.parse(["--train.recall-fraction", "0.25"]).student_recall_fraction() == 0.25
    assert distill.parse(["--train.recall-fraction", "0"]).student_recall_fraction() == 0.0
    assert distill.parse(["--data.seq-len", "32"]).student_recall_fraction() == 0.0  # no passkey
    text_only = _config(tmp_path, "--teacher.recall-steps", "0", "--data.seq-len", "128")
    assert text_only.student_recall_fraction() == 0.0
    # What the student phase and the fine-tune read: sequences of --data.seq-len, some of
    # them passkeys (their answers marked in the second row).
    run = Run(_config(tmp_path, "--data.seq-len", "128"))
    assert run.config.student_recall_fraction() == 0.5
    batch = np.asarray(next(phases._student_batches(run)(None)))
    assert batch.shape == (8, 2, 129)
    assert 0 < int((batch[:, 1].sum(axis=1) > 0).sum()) < 8
    assert phases._student_batches(Run(_config(tmp_path, "--run.dir", str(tmp_path / "t")))) is None


def test_the_bundled_teacher_refuses_recall_flags_it_was_not_trained_with(capsys):
    with pytest.raises(SystemExit):
        distill.parse(["--teacher.recall-steps", "100"])
    err = capsys.readouterr().err
    assert "--teacher.recall-steps" in err and "add --teacher.source train" in err


def test_the_recall_table_measures_each_model_at_the_lengths_that_hold_a_passkey(tmp_path):
    run = Run(_config(tmp_path, "--data.seq-len", "128", "--measure.recall-sequences", "3"))
    copier, near = NgramCopier(), NgramCopier(window=200)
    copier.config = near.config = GPT2Config.preset("cpu-small")  # 512 positions
    table = phases.recall_table(run, {"copier": copier, "near": near})
    assert table["lengths"] == [128, 256, 512] and table["sequences"] == 3
    held_out = phases.recall_filler(run, "eval")
    again = measure.recall_accuracy(near, "byte", held_out, lengths=(128, 256, 512), count=3)
    assert table["models"]["near"] == {f"{t}@{d}": v for (t, d), v in again.items()}
    assert set(table["models"]["copier"].values()) == {1.0}
    assert table["models"]["near"]["512@0.1"] == 0.0  # the key 400 tokens back: out of reach
    # Lengths a passkey does not fit in (80 bytes), or beyond the positions, are left out.
    short = Run(_config(tmp_path, "--data.seq-len", "32", "--run.dir", str(tmp_path / "b")))
    assert phases.recall_table(short, {"copier": copier})["lengths"] == [128]
    off = Run(
        _config(tmp_path, "--measure.recall-sequences", "0", "--run.dir", str(tmp_path / "c"))
    )
    assert phases.recall_table(off, {"copier": copier}) == {
        "lengths": [], "sequences": 0, "models": {}}  # fmt: skip


def test_the_report_shows_the_saved_recall_table(tmp_path):
    summary = {"recall": {"lengths": [128, 512], "models": {
        "teacher": {"128@0.1": 1.0, "128@0.9": 0.5, "512@0.1": 0.25, "512@0.9": 0.75},
    }}}  # fmt: skip
    assert report._plot_recall(summary, tmp_path / "recall.png")
    assert (tmp_path / "recall.png").read_bytes()[:4] == b"\x89PNG"
    lines = report._recall_lines(summary)
    assert "| model | n | depth 0.1 | depth 0.9 | mean |" in lines
    assert "| teacher | 128 | 100% | 50% | 75% |" in lines
    assert "| teacher | 512 | 25% | 75% | 50% |" in lines
    assert not any("passkey sequences" in line or "per length" in line for line in lines)
    counted = report._recall_lines({"recall": {**summary["recall"], "sequences": 96}})
    assert "96 sequences per length, 48 at each depth (--measure.recall-sequences)." in counted
    with_mixture = report._recall_lines({**summary, "student_recall_fraction": 0.5})
    assert "The student's batches held 50% passkey sequences (--train.recall-fraction)." in (
        with_mixture
    )
    assert report._recall_lines({"recall": {"lengths": [], "models": {}}}) == []


def test_the_students_objective_reads_the_ids_of_a_mixture_batch():
    teacher = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    student = student_from_teacher(teacher, AttentionSpec(mask=causal() & local(3, 0)))
    loss_fn = phases.objective(distill.parse([]))
    ids = np.random.default_rng(0).integers(0, 101, (2, 17)).astype(np.int32)
    marked = np.stack([ids, np.zeros_like(ids)], axis=1)  # [B, 2, T + 1]
    marked[:, 1, 5:9] = 1
    args = {"rng": jax.random.key(0), "teacher": teacher, "step": 0}
    plain, _ = loss_fn(student, jnp.asarray(ids), **args)
    mixed, _ = loss_fn(student, jnp.asarray(marked), **args)
    assert float(plain) > 0 and float(mixed) == float(plain)
