"""What loading refuses, and how: a chain-of-thought run folder (``Solver.load``) whose cot.json
names a path outside the folder, is truncated or random bytes, or disagrees with its checkpoint
on a size; an unreadable checkpoint skipped for the one before with a warning; questions of a
kind or size the model was not trained on answered with the reason; a Hugging Face
``model.safetensors`` whose bytes were overwritten (NaN, junk) or whose tensor has another shape.

The run folder is made with the library's own functions (``write_record``, a ``Trainer``'s
checkpoints of an untrained tiny model): nothing is trained or decoded beyond one tiny batch.
"""

from __future__ import annotations

import copy as copy_module
import functools
import json
import os
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from sparse_jax import cot
from sparse_jax.cot.batches import loss_fn
from sparse_jax.data import linalg_cot as lc
from sparse_jax.models import hf
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
from sparse_jax.models.gpt2 import GPT2, GPT2Config
from sparse_jax.training.checkpoint import Checkpointer, CorruptCheckpointWarning
from sparse_jax.training.loop import TrainConfig, Trainer

TINY = EncDecConfig(vocab_size=cot.VOCAB_SIZE, d_model=16, num_heads=2, d_ff=32,
                    encoder_layers=1, decoder_layers=1, cot_steps=0)  # fmt: skip
# The sizes the run was "trained" on: rref matrices up to 2 x 3, no block matrices.
SIZES = lc.GeneratorConfig(kinds=("rref",), rref_shape=(2, 3), block_rate=0.0, max_entry=3)
FMT = cot.CotFormat(64, 32)
RREF = "Find the reduced row echelon form R of A = [[2, 1], [1, 3]]."


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder of the 'sparse' model: cot.json and checkpoints at steps 1 and 2 of 2."""
    folder = tmp_path_factory.mktemp("loading") / "run"
    train = TrainConfig(steps=2, batch_size=1)
    cot.write_record(folder, FMT, {"sparse": (TINY, train)}, kinds=["rref"], generator=SIZES)
    net = EncoderDecoder(TINY, rngs=nnx.Rngs(0))
    loss = functools.partial(loss_fn, source_len=FMT.source_len)
    with Checkpointer(folder / "checkpoints" / "sparse", save_every=1) as ckpt:
        trainer = Trainer(net, loss, train, checkpointer=ckpt)
        for step in (1, 2):
            trainer.step = step
            trainer.save({}, force=True)
    return folder


@pytest.fixture
def copy(run, tmp_path):
    """A fresh copy of the run folder, and its record as a dict."""
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    return folder, json.loads((folder / cot.RECORD).read_text())


def _write(folder, record):
    (folder / cot.RECORD).write_text(json.dumps(record))


@pytest.mark.parametrize("where", ["../../../../", "/", "checkpoints/../.."])
def test_a_checkpoint_path_outside_the_run_folder_is_refused(copy, where):
    folder, record = copy
    record["models"]["sparse"]["checkpoint"] = where
    _write(folder, record)
    with pytest.raises(ValueError) as info:
        cot.Solver.load(folder)
    message = str(info.value)
    assert str(folder / cot.RECORD) in message and "models.sparse.checkpoint" in message
    assert repr(where) in message and "outside the run folder" in message


def test_a_link_out_of_the_run_folder_is_refused(copy, tmp_path):
    folder, _ = copy
    elsewhere = tmp_path / "elsewhere"
    shutil.move(folder / "checkpoints" / "sparse" / "2", elsewhere)
    os.symlink(elsewhere, folder / "checkpoints" / "sparse" / "2")
    with pytest.raises(ValueError, match=r"sparse/2 is a link to .*elsewhere, outside the run"):
        cot.Solver.load(folder)


def _cut(folder):
    path = folder / cot.RECORD
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damage, problem",
    [
        (_cut, "it is not valid JSON"),
        (lambda f: (f / cot.RECORD).write_bytes(np.random.default_rng(0).bytes(500)),
         "it is not UTF-8 text"),
        (lambda f: (f / cot.RECORD).write_text(""), "it is empty"),
        (lambda f: (f / cot.RECORD).write_text("[1, 2]"), "must be a JSON object"),
    ],
)  # fmt: skip
def test_a_damaged_record_names_the_file_and_what_is_wrong(copy, damage, problem):
    folder, _ = copy
    damage(folder)
    with pytest.raises(ValueError) as info:
        cot.Solver.load(folder)
    assert type(info.value) is ValueError  # not a JSONDecodeError / UnicodeDecodeError
    assert str(folder / cot.RECORD) in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda r: r.update(models=["sparse"]), "`models` must be a JSON object; got list"),
        (lambda r: r["models"].update(sparse="checkpoints"), "`models.sparse` must be a JSON"),
        (lambda r: r["models"]["sparse"].update(checkpoint=3), "`models.sparse.checkpoint` must"),
        (lambda r: r["models"]["sparse"]["model"].update(width=3), "`models.sparse.model` is not"),
        (lambda r: r.update(kinds=["magic"]), "`kinds` must be null or a list of"),
    ],
)
def test_a_record_of_the_wrong_structure_names_the_field(copy, edit, problem):
    folder, record = copy
    edit(record)
    _write(folder, record)
    with pytest.raises(ValueError) as info:
        cot.Solver.load(folder)
    assert str(folder / cot.RECORD) in str(info.value) and problem in str(info.value)


def test_an_unreadable_checkpoint_falls_back_to_the_one_before_with_a_warning(copy):
    folder, _ = copy
    latest = folder / "checkpoints" / "sparse" / "2"
    for data in (latest / "state").rglob("d/*"):  # the arrays' bytes, cut in half
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    with pytest.warns(CorruptCheckpointWarning, match=re.escape(f"{latest} cannot be read")):
        solver = cot.Solver.load(folder)
    assert solver.step == 1
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing moved
    assert solver.answer(RREF).error is None  # it decodes


@pytest.mark.parametrize("field, value", [("d_model", 32), ("d_ff", 48)])
def test_a_size_that_disagrees_with_the_checkpoint_names_the_field_and_both_shapes(
    copy, field, value
):
    folder, record = copy
    record["models"]["sparse"]["model"][field] = value
    _write(folder, record)
    with pytest.raises(ValueError) as info:
        cot.Solver.load(folder)
    message = str(info.value)
    assert f"`models.sparse.model.{field}`={value}" in message
    assert f"trained with {field}={getattr(TINY, field)}" in message
    shapes = re.search(r"has shape (\(.*?\)) in checkpoint .* and (\(.*?\)) under", message)
    assert shapes and shapes[1] != shapes[2], message
    assert str(folder / cot.RECORD) in message


def test_a_changed_layer_count_names_the_field_and_the_parameters(copy):
    folder, record = copy
    record["models"]["sparse"]["model"]["encoder_layers"] = 2
    _write(folder, record)
    with pytest.raises(ValueError) as info:
        cot.Solver.load(folder)
    message = str(info.value)
    assert "`models.sparse.model.encoder_layers`=2 does not match the checkpoint" in message
    assert "trained with encoder_layers=1" in message and "'encoder/1/" in message


@pytest.fixture(scope="module")
def solver(run):
    return cot.Solver.load(run, batch_size=2)


@pytest.mark.parametrize(
    "question, why",
    [
        ("Is b = [1, 2] in the column space of A = [[1, 2], [3, 4]]?",
         "trained on rref questions only; this is a column_space question"),
        ("Find the reduced row echelon form R of A = [[1, 2, 0], [2, 1, 1], [0, 0, 1]].",
         "trained on rref questions of matrices up to 2 x 3; this one is 3 x 3"),
        ("Find the reduced row echelon form R of [[A, A]] for A = [[1, 2], [3, 4]].",
         "trained on rref questions without block matrices; this one asks about one"),
    ],
)  # fmt: skip
def test_a_question_the_model_was_not_trained_for_is_answered_with_the_reason(
    solver, question, why
):
    answer = solver.answer(question)
    assert answer.error is not None and why in answer.error, answer.error
    assert answer.text == f"Cannot answer: {answer.error}" and answer.tokens == 0
    assert (solver.kinds, solver.generator) == (("rref",), SIZES)
    assert solver.answer(RREF).error is None  # a question within both is decoded


# ---------------------------------------------------------------------------------------------
# Hugging Face weights.


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    return hf.save_pretrained(model, tmp_path_factory.mktemp("hf") / "gpt2")


def _overwrite_tail(path, junk):
    data = path.read_bytes()
    path.write_bytes(data[: -len(junk)] + junk)


@pytest.mark.parametrize(
    "junk, problem",
    [
        (b"\xff" * 100, "NaN or infinite entries"),  # NaN bit patterns
        (np.random.default_rng(0).bytes(100), "entries as large as"),
    ],
    ids=["nan-bytes", "random-bytes"],
)
def test_weights_whose_last_bytes_were_overwritten_are_refused(hf_folder, tmp_path, junk, problem):
    folder = shutil.copytree(hf_folder, tmp_path / "gpt2")
    weights = folder / "model.safetensors"
    _overwrite_tail(weights, junk)
    with pytest.raises(hf.PretrainedFileError) as info:
        hf.from_pretrained(folder)
    message = str(info.value)
    assert str(weights) in message and "tensor 'wte.weight'" in message and problem in message


@pytest.mark.parametrize(
    "name, change, problem",
    [
        ("h.0.mlp.c_fc.bias", lambda v: np.full_like(v, np.inf), "NaN or infinite"),
        ("h.1.ln_1.weight", lambda v: v[:-1], "has shape"),
    ],
)
def test_each_tensor_is_checked_by_name(hf_folder, tmp_path, name, change, problem):
    folder = shutil.copytree(hf_folder, tmp_path / "gpt2")
    weights = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(weights)
    tensors["transformer." + name] = np.ascontiguousarray(change(tensors["transformer." + name]))
    safetensors.numpy.save_file(tensors, weights)
    with pytest.raises(hf.PretrainedFileError) as info:
        hf.from_pretrained(folder)
    message = str(info.value)
    assert str(weights) in message and f"tensor {name!r}" in message and problem in message


def test_a_broken_safetensors_header_is_a_value_error_naming_the_file(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "gpt2")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"x" * 32  # the JSON header's start
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        hf.from_pretrained(folder)


def test_tensors_of_a_type_numpy_cannot_read_are_a_value_error_naming_the_file(hf_folder, tmp_path):
    folder = shutil.copytree(hf_folder, tmp_path / "gpt2")
    weights = folder / "model.safetensors"
    header = json.dumps({"wte.weight": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})
    weights.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(2))
    with pytest.raises(hf.PretrainedFileError) as info:
        hf.from_pretrained(folder)
    assert str(weights) in str(info.value) and "float8" in str(info.value)


def test_the_cot_command_line_refuses_a_model_it_cannot_load_in_one_line(copy, capsys):
    from experiments.cot.job import main

    folder, record = copy
    ask = ["ask", RREF, "--run.dir", str(folder), "--model", "sparse"]
    changed = copy_module.deepcopy(record)
    changed["models"]["sparse"]["model"]["d_model"] = 32
    _write(folder, changed)
    with pytest.raises(SystemExit) as info:
        main(ask)
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[cot]")]
    assert len(lines) == 1 and lines[0].startswith(f"[cot] error: --run.dir {str(folder)!r}: its")
    assert "`models.sparse.model.d_model`=32 does not match the checkpoint" in lines[0]
    # No checkpoint readable: one line giving each step's reason in brief, and status 1.
    _write(folder, record)
    for data in (folder / "checkpoints" / "sparse").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.warns(CorruptCheckpointWarning), pytest.raises(SystemExit) as info:
        main(ask)
    assert info.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[cot]")]
    assert len(lines) == 1 and lines[0].startswith("[cot] error: no readable checkpoint in ")
    assert "step 2: " in lines[0] and "step 1: " in lines[0] and len(lines[0]) < 1500, lines[0]
