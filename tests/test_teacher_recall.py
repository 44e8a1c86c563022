"""A teacher that retrieves: its flags, its training phase, and the recall measurement."""

from __future__ import annotations

import hashlib
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import distill
from experiments.common import measure
from experiments.distill import phases
from experiments.distill.run_folder import Run
from sparse_jax.data.recall import make_examples, make_filler

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
        "--teacher.recall-steps", "2", "--teacher.recall-lengths", "96",
        "--teacher.recall-tokens", "192", "--data.seq-len", "32",
        "--run.dir", str(tmp_path / "run"), "--run.cache-dir", str(tmp_path / "cache"), *extra,
    ])  # fmt: skip


def test_the_teacher_trains_on_text_then_on_the_recall_mixture(tmp_path):
    config = _config(tmp_path)
    run = Run(config)
    model = phases.teacher(run)
    assert model.config.smear_keys and model.h[0].attn.smear_logit is not None
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recall_lines = [x for x in lines if x["phase"] == "teacher_recall"]
    assert [x["step"] for x in recall_lines] == [1, 2]
    assert all(x["answer_nll"] > 0 for x in recall_lines)
    assert 0.0 <= recall_lines[-1]["eval_recall_96"] <= 1.0  # evaluated on held-out text
    assert [x["step"] for x in lines if x["phase"] == "teacher"] == [1]
    # Cached under a key of its recall flags; the plain teacher's key does not change.
    data = run.data
    key = phases.teacher_key(config, data)
    assert (tmp_path / "cache" / "teachers" / key / "model.safetensors").is_file()
    plain = _config(tmp_path, "--teacher.recall-steps", "0", "--teacher.no-smear-keys")
    other = _config(tmp_path, "--teacher.recall-fraction", "0.25")
    keys = {phases.teacher_key(c, data) for c in (config, plain, other)}
    assert len(keys) == 3
    old = [plain.teacher.size, data.dataset_name, 1, plain.teacher.lr, 8, 0, 1]
    digest = hashlib.sha256(json.dumps(old, default=str).encode()).hexdigest()[:16]
    assert phases.teacher_key(plain, data) == digest


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--teacher.recall-fraction", "1.5"], r"--teacher.recall-fraction must be in \[0, 1\]"),
        (["--teacher.recall-lengths", "0"], r"--teacher.recall-lengths must be ints >= 1"),
        (["--teacher.recall-lengths", "1024"], r"reach beyond the teacher's 512 positions"),
        (["--teacher.recall-tokens", "0"], r"--teacher.recall-tokens must be an int >= 1"),
        (["--teacher.recall-lr", "0"], r"--teacher.recall-lr must be a number > 0"),
        (["--teacher.answer-weight", "-1"], r"--teacher.answer-weight must be a number >= 0"),
    ],
)
def test_bad_recall_flags_are_refused_by_name(tmp_path, flags, match, capsys):
    with pytest.raises(SystemExit):
        _config(tmp_path, *flags)
    err = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().err).split())
    assert re.search(match, err), err


def test_the_bundled_teacher_refuses_recall_flags_it_was_not_trained_with(capsys):
    with pytest.raises(SystemExit):
        distill.parse(["--teacher.recall-steps", "100"])
    err = capsys.readouterr().err
    assert "--teacher.recall-steps" in err and "add --teacher.source train" in err
