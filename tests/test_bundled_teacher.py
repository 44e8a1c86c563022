"""The teacher shipped with the package (experiments/distill/teachers): it is what its record says
it is, and the main job's default uses it only with the flags it was trained with."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from experiments import bundle_teacher, distill
from experiments.common import measure, teachers
from experiments.distill import config as distill_config
from experiments.distill import phases as distill_phases
from sparse_jax.data import text
from sparse_jax.models import from_pretrained


def test_bundled_teacher_reproduces_its_recorded_evaluation_loss(tmp_path):
    record = teachers.record()
    flags = record["flags"]
    data = text.prepare(
        flags["data.source"], flags["data.tokenizer"], flags["data.seq_len"], data_dir=tmp_path
    )
    if data.dataset_name != record["dataset"]:
        pytest.skip(
            f"this Python's embedded corpus ({data.dataset_name}) is not the one the teacher was "
            f"recorded on ({record['dataset']}, Python {record['python']})"
        )
    windows = np.asarray(data.eval[list(range(record["eval_windows"]))], np.int32)
    nll, _ = measure.evaluate_lm(from_pretrained(teachers.BUNDLED), windows)
    assert nll == pytest.approx(record["eval_nll"], abs=1e-4)
    # ... and it is the cache entry `--teacher.source train` makes with these flags.
    config = distill.parse(["--teacher.source", "train"])
    assert distill_phases.teacher_key(config, data) == record["teacher_key"]


def test_bundled_teacher_reproduces_its_recorded_recall(tmp_path):
    """The record's recall at the training length, recomputed from the shipped weights with the
    record's sequences (the longer lengths cost 2x and 4x as much and are measured by the same
    call, so the test keeps to 128)."""
    record = teachers.record()
    recall = record["recall"]
    assert recall["lengths"] == [128, 256, 512]  # 1x, 2x and 4x the training length
    for n in recall["lengths"]:  # the mean of a length is the mean of its depths
        depths = [v for key, v in recall["by_depth"].items() if key.startswith(f"{n}@")]
        assert len(depths) == 3 and recall["accuracy"][str(n)] == pytest.approx(np.mean(depths))
    flags = record["flags"]
    data = text.prepare(
        flags["data.source"], flags["data.tokenizer"], flags["data.seq_len"], data_dir=tmp_path
    )
    if data.dataset_name != record["dataset"]:
        pytest.skip(f"this Python's embedded corpus is not {record['dataset']}")
    table = measure.recall_accuracy(
        from_pretrained(teachers.BUNDLED),
        flags["data.tokenizer"],
        lengths=(128,),
        count=recall["sequences"],
    )
    # Within one sequence per depth cell: a greedy answer whose top two logits nearly tie may
    # flip on a CPU whose compiled code rounds differently from the recording machine's.
    per_depth = recall["sequences"] // 3
    measured = {f"{n}@{d}": v for (n, d), v in table.items()}
    recorded = {key: v for key, v in recall["by_depth"].items() if key.startswith("128@")}
    assert measured.keys() == recorded.keys()
    for key, value in recorded.items():
        assert measured[key] == pytest.approx(value, abs=1 / per_depth + 1e-9), key


def test_remeasure_rewrites_the_record_from_the_shipped_weights(tmp_path, monkeypatch):
    """``bundle_teacher --remeasure`` on a copy of the shipped teacher (3 sequences per length
    here): the record keeps what it said and gets the recall measured now."""
    record, sequences = teachers.record(), bundle_teacher.RECALL_SEQUENCES
    copy = tmp_path / "default"
    shutil.copytree(teachers.BUNDLED, copy)
    monkeypatch.setattr(teachers, "BUNDLED", copy)
    monkeypatch.setattr(bundle_teacher, "RECALL_SEQUENCES", 3)
    try:
        remade = bundle_teacher.main(["--remeasure", "--run.cache-dir", str(tmp_path / "cache")])
    except ValueError as err:
        if "teacher's dataset is" not in str(err):
            raise
        pytest.skip(f"this Python's embedded corpus is not {record['dataset']}")
    assert remade == json.loads((copy / "teacher.json").read_text())
    assert {k: v for k, v in remade.items() if k != "recall"} == {
        k: v for k, v in record.items() if k != "recall"
    }
    assert remade["recall"]["sequences"] == 3 and remade["recall"]["lengths"] == [128, 256, 512]
    assert record["recall"]["sequences"] == sequences != 3


def test_bundled_teacher_is_the_default_with_the_default_teacher_flags():
    assert distill_config.DistillConfig().teacher.source == "bundled"
    trained = distill.parse(["--teacher.source", "train"]).flags()
    recorded = {key: trained[key] for key in bundle_teacher.RECORDED}
    assert json.loads(json.dumps(recorded)) == teachers.record()["flags"]
    # every flag a trained teacher depends on is recorded
    training = {f"teacher.{name}" for name in distill_config.TeacherConfig.TRAINING}
    assert training <= set(bundle_teacher.RECORDED)
    assert teachers.record()["command"] == "python -m experiments.bundle_teacher"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--teacher.steps", "50"], "--teacher.steps 50 applies to a teacher trained here"),
        (
            ["--teacher.size", "tiny", "--data.seq-len", "16", "--teacher.recall-steps", "0"],
            "--teacher.size 'tiny' applies to",
        ),
        (["--data.seq-len", "256"], "--data.seq-len 256 is longer than the 128 tokens"),
    ],
)
def test_flags_the_bundled_teacher_was_not_trained_with_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):  # tyro prints the ValueError and exits
        distill.parse(args)
    printed = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert message in printed and "add --teacher.source train" in printed
    distill.parse([*args, "--teacher.source", "train"])  # what the message says works


def test_bundle_teacher_refuses_flags_that_change_the_teacher():
    with pytest.raises(ValueError, match="would change it"):
        bundle_teacher.main(["--teacher.steps", "5"])
    with pytest.raises(ValueError, match="takes no flags that change the teacher"):
        bundle_teacher.main(["--remeasure", "--data.seq-len", "64"])
