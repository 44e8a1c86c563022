"""A chain-of-thought training stopped by SIGTERM and then by its time limit resumes to the
uninterrupted run's weights (python -m experiments.cot train). Apart from tests/test_cot.py, whose
module run it does not use, since pytest-xdist gives each file to one worker (--dist loadfile):
the two files are the two longest of the suite's chain-of-thought runs, side by side."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

from sparse_jax import cot
from tests.test_cot import RUN_FLAGS


def test_a_stopped_training_keeps_its_step_and_resumes_to_the_same_weights(
    tmp_path, monkeypatch, capsys
):
    """SIGTERM in the sparse model's training (sent from its step-10 log line): that phase saves
    step 11 and the command exits with status 75 naming the command that continues; resumed
    with a time limit already spent it saves step 12 and stops again; resumed without one it
    ends with the uninterrupted run's weights, bit for bit, each step logged once."""
    import signal

    from experiments import cot as experiment
    from experiments.common import phase
    from experiments.common.flags import resume_command
    from sparse_jax.training.checkpoint import Checkpointer

    # Two length buckets (two compilations of each phase's update, not the default's three).
    flags = [*RUN_FLAGS, "--train.steps", "16", "--run.checkpoint-every", "100",
             "--data.train", "12", "--train.batch-size", "2", "--train.buckets", "2", "1",
             "--run.cache-dir", str(tmp_path)]  # fmt: skip
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    experiment.run(experiment.parse(["train", *flags, "--run.dir", str(whole)]))
    # Batches from several length buckets (BucketIterator), whose position the checkpoints keep.
    buckets = re.search(r"buckets of \(question, solution\) lengths (.*); run folder",
                        capsys.readouterr().err).group(1)  # fmt: skip
    assert len(re.findall(r"\d+ x \(\d+, \d+\)", buckets)) >= 2, buckets
    log_line = phase.append_jsonl

    def append_jsonl(path, record):
        log_line(path, record)
        if record["phase"] == "sparse" and record["step"] == 10:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(phase, "append_jsonl", append_jsonl)
    handler = signal.getsignal(signal.SIGTERM)
    args = ["train", *flags, "--run.dir", str(stopped)]
    with pytest.raises(SystemExit) as exit:
        experiment.main(args)
    assert exit.value.code == phase.EXIT_STOPPED == 75
    assert signal.getsignal(signal.SIGTERM) == handler
    err = " ".join(capsys.readouterr().err.split())
    assert "SIGTERM: saving checkpoints and stopping" in err
    command = resume_command("experiments.cot", args, stopped)
    assert "sparse: stopped (SIGTERM) after update 11 of 16, with a checkpoint of it. " in err
    assert f"Continue with: {' '.join(command.split())}" in err

    def saved(name):
        with Checkpointer(stopped / "checkpoints" / name, save_every=100) as ckpt:
            return ckpt.all_steps()

    assert saved("sparse") == [11] and not (stopped / "checkpoints" / "dense").exists()
    monkeypatch.setattr(phase, "append_jsonl", log_line)
    again = [*args, "--run.resume", "--run.max-minutes", "1e-9"]
    with pytest.raises(phase.RunStopped, match=r"sparse: stopped \(the time limit \(6e-08 s\)\) "
                       "after update 12 of 16") as info:  # fmt: skip
        experiment.run(experiment.parse(again))
    assert info.value.folder == stopped and saved("sparse") == [11, 12]
    experiment.run(experiment.parse([*args, "--run.resume"]))
    for name in ("sparse", "dense"):
        a = nnx.state(cot.Solver.load(whole, name).model, nnx.Param)
        b = nnx.state(cot.Solver.load(stopped, name).model, nnx.Param)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lines = [json.loads(x) for x in (stopped / "metrics.jsonl").read_text().splitlines()]
    for name in ("sparse", "dense"):
        assert [r["step"] for r in lines if r["phase"] == name] == list(range(1, 17))
