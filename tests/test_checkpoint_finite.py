"""A checkpoint whose model weights hold NaN or inf is refused where it is restored (issue 61):
``Checkpointer.restore`` raises ``NonFiniteCheckpointError`` (a ``ValueError``) naming the
checkpoint's path, its step, the first such parameter and how many of its entries are not
finite, before anything trains from it or answers with it. So ``Solver.load`` refuses it, and so
does the resumption of a phase, by the main job's code and by the code the cascade and the
chain of thought share (one line and exit status 1 from their ``main``). The optimizer state
may hold inf by design (optax's ``reduce_on_plateau``) and is not checked.

Each checkpoint here is written the way a run writes one (``Trainer.save``) from a tiny model
with one poisoned parameter; the phases trained are the bag of embeddings of
``tests.test_reliability_files`` (no teacher, compiles in about a second).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import distill
from experiments.common import phase
from experiments.distill.run_folder import Run
from sparse_jax import cot
from sparse_jax.cot.format import CotFormat
from sparse_jax.models.encdec import EncoderDecoder
from sparse_jax.training.checkpoint import Checkpointer, CheckpointError, NonFiniteCheckpointError
from sparse_jax.training.loop import TrainConfig, Trainer
from tests.test_cot import TINY as TINY_COT
from tests.test_reliability_files import _args, _Bag, _bag_loss

BAG = "params/emb/embedding"  # the bag's one parameter, [257, 4]


def _name(path) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(keys[:-1] if keys[-1] == "value" else keys)


def _poison(tree, name: str, prefix: str = "params"):
    """``tree`` with its leaf ``name`` (as the error names it) holding a NaN and an inf."""

    def put(path, x):
        if f"{prefix}/{_name(path)}" != name:
            return x
        return x.at[(0,) * x.ndim].set(jnp.nan).at[(1,) * x.ndim].set(jnp.inf)

    poisoned = jax.tree_util.tree_map_with_path(put, tree)
    assert not all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(poisoned)), name
    return poisoned


def _save_poisoned(directory, model, config: TrainConfig, step: int, name: str) -> None:
    """Checkpoint ``step`` of ``directory``, written by ``Trainer.save`` as a run writes it: the
    newest checkpoint there (or ``model``'s weights when there is none) with parameter ``name``
    holding a NaN and an inf."""
    with Checkpointer(directory, save_every=1, keep_best=False) as ckpt:
        trainer = Trainer(model, lambda m, b, r: (0.0, {}), config, checkpointer=ckpt)
        data_state = trainer.restore() or {}
        trainer.params = _poison(trainer.params, name)
        trainer.step = step
        assert trainer.save(data_state, force=True)


def _said(err: pytest.ExceptionInfo) -> str:
    return " ".join(str(err.value).split())


def _assert_names(said: str, path, step: int, name: str, size: int) -> None:
    assert f"checkpoint {path} (step {step}) holds non-finite values" in said, said
    assert f"{name} has 2 NaN or infinite entries of {size}" in said, said
    assert "move it aside (rename its folder) to use the one before it, or train" in said, said


# ---------------------------------------------------------------------------------------------
# Solver.load


def test_solver_load_refuses_a_checkpoint_holding_nan_naming_the_parameter(tmp_path):
    folder = tmp_path / "cot"
    folder.mkdir()
    train = TrainConfig(steps=1, batch_size=4)
    cot.write_record(folder, CotFormat(96, 64), {"sparse": (TINY_COT, train)}, kinds=["rref"])
    ckpts = folder / "checkpoints" / "sparse"
    model = EncoderDecoder(TINY_COT, rngs=nnx.Rngs(0))
    with Checkpointer(ckpts, save_every=1) as ckpt:  # a good step 1 loads
        trainer = Trainer(model, lambda m, b, r: (0.0, {}), train, checkpointer=ckpt)
        trainer.step = 1
        assert trainer.save({}, force=True)
    assert cot.Solver.load(folder, "sparse").step == 1
    name = "params/decoder/0/self_attn/q/kernel"  # [16, 16]
    _save_poisoned(ckpts, model, train, 2, name)
    with pytest.raises(ValueError) as err:
        cot.Solver.load(folder, "sparse")
    assert isinstance(err.value, NonFiniteCheckpointError)
    _assert_names(_said(err), ckpts / "2", 2, name, 256)
    assert (err.value.name, err.value.count, err.value.size) == (name, 2, 256)
    assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2"]  # nothing moved


# ---------------------------------------------------------------------------------------------
# Resumptions


def test_a_resumed_phase_of_the_main_job_refuses_a_checkpoint_holding_nan(tmp_path):
    args = _args(tmp_path, "run", "--run.checkpoint-every", "1")
    config = TrainConfig(steps=4, batch_size=4, warmup_steps=0)
    Run(distill.parse(args)).train_phase("bag", _Bag(), _bag_loss, config)
    ckpts = tmp_path / "run" / "checkpoints" / "bag"
    _save_poisoned(ckpts, _Bag(), config, 5, BAG)
    logged = (tmp_path / "run" / "metrics.jsonl").read_text()
    config = TrainConfig(steps=7, batch_size=4, warmup_steps=0)
    with pytest.raises(ValueError) as err:
        Run(distill.parse([*args, "--resume"])).train_phase("bag", _Bag(), _bag_loss, config)
    _assert_names(_said(err), ckpts / "5", 5, BAG, 1028)
    assert isinstance(err.value, CheckpointError)  # the main job's main: one line, status 1
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == logged  # nothing trained
    assert sorted(p.name for p in ckpts.iterdir()) == ["3", "4", "5"]


def test_a_resumed_cascade_or_cot_phase_refuses_it_in_one_line(tmp_path, capsys):
    rows = np.arange(64, dtype=np.int32).reshape(16, 4) % 257

    def run(steps: int, resume: bool):
        config = TrainConfig(steps=steps, batch_size=4, warmup_steps=0)
        return phase.train_phase(
            _Bag(), _bag_loss, config, rows, folder=tmp_path, name="bag", checkpoint_every=1,
            resume=resume, log=print,
        )  # fmt: skip

    run(2, resume=False)
    ckpts = tmp_path / "checkpoints" / "bag"
    _save_poisoned(ckpts, _Bag(), TrainConfig(steps=2, batch_size=4, warmup_steps=0), 3, BAG)
    with pytest.raises(SystemExit) as exit:  # as experiments.cascade's and .cot's main say it
        phase.main_of("experiments.cot", lambda _: run(5, resume=True), lambda _: None, [], print)
    assert exit.value.code == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint "), lines
    _assert_names(lines[0], ckpts / "3", 3, BAG, 1028)
    log = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == [1, 2]  # nothing trained from it


# ---------------------------------------------------------------------------------------------
# The rule, on the Checkpointer itself


def test_only_the_model_is_checked_not_the_optimizer_state(tmp_path):
    inf = jnp.asarray(jnp.inf)  # as optax's reduce_on_plateau starts its best value
    good = {"params": {"w": jnp.ones(3)}, "rest": {"n": jnp.arange(2)}, "opt": {"best": inf}}
    with Checkpointer(tmp_path, save_every=1, keep_best=False) as ckpt:
        ckpt.save(1, good, data_state={}, rng=None)
        state, _, _, step = ckpt.restore()
        assert step == 1 and float(state["opt"]["best"]) == np.inf
        bad = {**good, "rest": {"n": jnp.arange(2), "scale": jnp.asarray([0.0, jnp.nan, 1.0])}}
        ckpt.save(2, bad, data_state={}, rng=None)
        for chosen in (None, 2):  # the latest, and a step asked for
            with pytest.raises(NonFiniteCheckpointError) as err:
                ckpt.restore(chosen)
            said = _said(err)
            assert f"checkpoint {tmp_path / '2'} (step 2)" in said, said
            assert "rest/scale has 1 NaN or infinite entries of 3" in said, said
        assert ckpt.restore(1)[3] == 1  # the one before it is still there
        # Another layout names what may hold inf.
        state, _, _, _ = ckpt.restore(unchecked=("rest", "opt"))
        assert np.isnan(state["rest"]["scale"][1])
        for wrong in ("opt", None):
            with pytest.raises(TypeError, match="`unchecked` must be a sequence"):
                ckpt.restore(unchecked=wrong)
