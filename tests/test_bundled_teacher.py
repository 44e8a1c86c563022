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


def test_bundled_teacher_reproduces_its_recorded_recall(tmp_path, monkeypatch):
    """``bundle_teacher --remeasure`` on a copy of the shipped teacher writes the record it
    ships with: the recall is recomputed from the weights, not copied."""
    record = teachers.record()
    copy = tmp_path / "default"
    shutil.copytree(teachers.BUNDLED, copy)
    (copy / "teacher.json").write_text(
        json.dumps({key: v for key, v in record.items() if key != "recall"})
    )
    monkeypatch.setattr(teachers, "BUNDLED", copy)
    try:
        remade = bundle_teacher.main(["--remeasure", "--run.cache-dir", str(tmp_path / "cache")])
    except ValueError as err:
        if "teacher's dataset is" not in str(err):
            raise
        pytest.skip(f"this Python's embedded corpus is not {record['dataset']}")
    assert remade["recall"]["lengths"] == [128, 256, 512]  # 1x, 2x and 4x the training length
    assert remade == record == json.loads((copy / "teacher.json").read_text())


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
        (["--teacher.size", "tiny", "--data.seq-len", "16"], "--teacher.size 'tiny' applies to"),
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
