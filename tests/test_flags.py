"""The experiments' shared flag checks (`experiments.common.flags`): int flags refused by name, and
a resumed run refused, naming each changed flag, by the main job and the cascade alike (the chain
of thought's in tests/test_cot.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from experiments import cascade, cot, distill
from experiments.common import flags
from experiments.distill import config as distill_config
from experiments.distill.run_folder import check_same_config


@pytest.mark.parametrize("bad", [0, -3, 2.0, "2", True, np.bool_(True), None])
def test_int_at_least_refuses_by_flag(bad):
    with pytest.raises(ValueError, match=rf"^--train\.steps must be an int >= 1; got {bad!r}$"):
        flags.int_at_least(bad, "--train.steps", 1)


def test_int_at_least_accepts_numpy_ints_as_python_ints():
    value = flags.int_at_least(np.int32(5), "--train.steps", 1)
    assert value == 5 and type(value) is int


@pytest.mark.parametrize(
    "build",
    [
        lambda v: distill_config.TrainConfig(steps=v),
        lambda v: cot.Train(steps=v),
        lambda v: (
            dataclasses.replace(
                cascade.CascadeExperiment(), train=dataclasses.replace(cascade.Train(), steps=v)
            ).train
        ),
    ],
    ids=["distill", "cot", "cascade"],
)
def test_every_experiment_checks_its_int_flags_the_same_way(build):
    assert type(build(np.int64(7)).steps) is int
    with pytest.raises(ValueError, match=r"^--train\.steps must be an int >= 1; got 0$"):
        build(0)
    with pytest.raises(ValueError, match=r"^--train\.steps must be an int >= 1; got 1\.5$"):
        build(1.5)


def test_changed_flags_compares_what_it_is_told():
    saved = {"data": {"seq_len": 64}, "train": {"lr": 0.1, "steps": 8}, "run": {"seed": 0}}
    given = {"data": {"seq_len": 64}, "train": {"lr": 0.2, "steps": 9}, "run": {"seed": 1}}
    assert flags.changed_flags(saved, given) == [
        "--run.seed (run: 0, now: 1)",
        "--train.lr (run: 0.1, now: 0.2)",
        "--train.steps (run: 8, now: 9)",
    ]
    # Only the named groups or flags; a prefix is a whole group name (run.seed != run.seeds).
    assert flags.changed_flags(saved, given, only=("train.lr", "data")) == [
        "--train.lr (run: 0.1, now: 0.2)"
    ]
    assert (
        flags.changed_flags({"run": {"seeds": 0}}, {"run": {"seeds": 1}}, only=("run.seed",)) == []
    )
    assert flags.changed_flags(saved, given, ignore=("train.lr", "train.steps")) == [
        "--run.seed (run: 0, now: 1)"
    ]
    # A flag an older record lacks: compared with its default when one is given, else skipped.
    old = {"train": {"lr": 0.1}}
    now = {"train": {"lr": 0.1, "warmup": 5}}
    assert flags.changed_flags(old, now) == []
    assert flags.changed_flags(old, now, defaults={"train.warmup": 0}) == [
        "--train.warmup (run: 0, now: 5)"
    ]
    assert flags.changed_flags(old, now, defaults={"train.warmup": 5}) == []


def test_distill_resume_names_the_changed_flag():
    saved = distill.parse(["--train.steps", "8"]).flags()
    given = distill.parse(["--train.steps", "9", "--run.cache-dir", "/elsewhere"]).flags()
    with pytest.raises(ValueError, match=r"--train\.steps \(run: 8, now: 9\)") as info:
        check_same_config(saved, given)
    assert "cache" not in str(info.value)  # a flag that may change on --resume is not named
    check_same_config(saved, {**given, "train.steps": 8})


def test_a_resume_names_the_changed_flag(tmp_path):
    run = cascade.CascadeExperiment()

    def check(cfg):
        flags.check_resume(cfg, tmp_path, kind="cascade")

    with pytest.raises(ValueError, match=r"holds no cascade run \(no config\.json\)"):
        check(run)
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(run), default=str))
    check(run)
    with pytest.raises(ValueError, match=r"--train\.lr \(run: .*, now: 0\.5\)"):
        check(dataclasses.replace(run, train=dataclasses.replace(run.train, lr=0.5)))
    check(dataclasses.replace(run, sweep=(0.5,)))  # the checkpoints do not depend on it
