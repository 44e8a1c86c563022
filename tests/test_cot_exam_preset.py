"""``python -m experiments.cot --preset exam`` (issue 59): the preset's data are the exam's
(linalg_cot.GeneratorConfig.exam(), all kinds, the answers in words included), its splits hold
no question of the GiantRabbit quiz by content (read from the shared folder at run time, skipped
when absent; never copied here: CC BY-NC-SA), a tiny override of it trains; the default command
is unchanged; a Solver trained on a kind answered in words reads and grades it by parts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from experiments.cot import config as cli
from experiments.cot import run_folder
from experiments.cot.exam import DEFAULT_QUIZ
from sparse_jax import cot
from sparse_jax.cot.record import generator_of
from sparse_jax.data import linalg_cot as lc
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder

EVERY_KIND = lc.KINDS + lc.DESCRIPTIVE_KINDS


def test_the_exam_preset_parses_to_the_exams_data():
    cmd = cli.parse(["--preset", "exam"])
    assert type(cmd).__name__ == "AllCommand" and cmd.preset == "exam"
    assert cmd.data.kinds == EVERY_KIND and cmd.data.exclude_quiz
    assert cmd.data.generator() == lc.GeneratorConfig.exam(kinds=EVERY_KIND)
    assert cmd.data.generator().exam_rate > 0 and cmd.data.generator().latex_rate > 0
    # Its other flags still apply, and the train command starts from it too.
    small = cli.parse(["train", "--preset", "exam", "--train.steps", "3"])
    assert small.train.steps == 3 and small.data == cmd.data and small.model == cmd.model


def test_no_flags_is_the_default_unchanged():
    cmd = cli.parse([])
    assert cmd == cli.AllCommand()
    assert cmd.data.kinds == ("rref", "solvability", "column_space")
    assert cmd.data.sizes == "small" and not cmd.data.exclude_quiz
    assert cmd.data.generator() == lc.GeneratorConfig(kinds=cmd.data.kinds, **cli.SIZES["small"])
    assert (cmd.train.steps, cmd.train.batch_size, cmd.model.d_model) == (3600, 12, 64)


def test_the_descriptive_kinds_are_flags():
    cmd = cli.parse(["train", "--data.kinds", "subspaces", "column_space_basis"])
    assert cmd.data.kinds == ("subspaces", "column_space_basis")
    with pytest.raises(SystemExit):
        cli.parse(["train", "--data.kinds", "describe_everything"])


def _capture_prepare(monkeypatch):
    seen = {}

    def fake(root, **kwargs):
        seen.update(kwargs)
        return "data"

    monkeypatch.setattr(run_folder.linalg_cot, "prepare", fake)
    return seen


def test_a_missing_quiz_excludes_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    seen = _capture_prepare(monkeypatch)
    data = cli.Data(kinds=("rref",), exclude_quiz=True)
    assert run_folder.prepare_data(data, tmp_path, quiz=tmp_path / "none.json") == "data"
    assert list(seen["exclude"]) == []
    assert "was not found: nothing excluded" in capsys.readouterr().err


@pytest.fixture(scope="module")
def quiz():
    if not DEFAULT_QUIZ.is_file():
        pytest.skip(f"the study's quiz is not at {DEFAULT_QUIZ}")
    questions = run_folder.quiz_questions(DEFAULT_QUIZ)
    assert questions
    return questions


def test_the_quiz_is_passed_to_prepare_when_asked(quiz, tmp_path, monkeypatch):
    seen = _capture_prepare(monkeypatch)
    run_folder.prepare_data(cli.Data(kinds=("rref",), exclude_quiz=True), tmp_path)
    assert {c for q in seen["exclude"] for c in q.contents} == {c for q in quiz for c in q.contents}
    run_folder.prepare_data(cli.Data(kinds=("rref",)), tmp_path)  # not asked: nothing
    assert list(seen["exclude"]) == []


def test_the_exam_splits_hold_no_quiz_question(quiz, tmp_path):
    data = dataclasses.replace(cli.exam().data, train=96, validation=16, test=24)
    splits = run_folder.prepare_data(data, tmp_path)
    quiz_contents = {c for q in quiz for c in q.contents}
    kinds = set()
    for split in (splits.train, splits.validation, splits.test):
        for p in split:
            kinds.add(p.kind)
            parse = lc.parse_descriptive if p.kind in lc.DESCRIPTIVE_KINDS else lc.parse_question
            assert not parse(p.question).contents & quiz_contents, p.question
    assert kinds == set(EVERY_KIND)


def test_a_tiny_exam_run_trains(tmp_path):
    cmd = cli.parse(
        ["train", "--preset", "exam", "--data.train", "8", "--data.validation", "2",
         "--data.test", "2", "--data.kinds", "rref", "subspaces", "--model.d-model", "16",
         "--model.num-heads", "2", "--model.d-ff", "32", "--model.encoder-layers", "1",
         "--model.decoder-layers", "1", "--model.cot-steps", "0", "--train.steps", "2",
         "--train.batch-size", "2", "--train.warmup", "0", "--train.buckets", "1", "1",
         "--run.checkpoint-every", "2", "--run.dir", str(tmp_path / "run"),
         "--run.cache-dir", str(tmp_path)]
    )  # fmt: skip
    folder = run_folder.train(cmd, models=("sparse",))
    record = cot.read_record(folder)
    assert record["kinds"] == ["rref", "subspaces"]
    assert generator_of(record).rref_shape == (6, 8)
    steps = [p.name for p in (folder / "checkpoints" / "sparse").iterdir() if p.name.isdigit()]
    assert steps == ["2"]


def test_a_solver_trained_on_a_descriptive_kind_reads_it():
    question = "A is a 4 by 6 matrix of rank 2. Describe its column space and its nullspace."
    problems = [lc.generate("subspaces", 0), lc.generate("rref", 0)]
    fmt = cot.fit_format(problems)
    fmt = dataclasses.replace(fmt, source_len=max(fmt.source_len, 128), target_len=8)
    cfg = EncDecConfig(vocab_size=cot.VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
    reads = cot.Solver(model, fmt, kinds=("subspaces",), chunk=8).answer(question)
    assert reads.kind == "subspaces" and reads.error is None and reads.tokens > 0
    # A model not trained on it refuses it with parse_question's reason, undecoded.
    refuses = cot.Solver(model, fmt, kinds=("rref",), chunk=8).answer(question)
    assert refuses.error is not None and "could not parse" in refuses.error
    assert refuses.tokens == 0
    # The article follows the word.
    elimination = lc.generate("elimination", 0).question
    why = cot.Solver(model, fmt, kinds=("rref",), chunk=8).answer(elimination).error
    assert "this is an elimination question" in why
    why = cot.Solver(model, fmt, kinds=("elimination",), chunk=8).answer(problems[1].question)
    assert "this is a rref question" in why.error


class _Scripted(cot.Solver):
    """A solver whose final answers are given (the decoding is not what is tested)."""

    finals: tuple[str | None, ...] = ()

    def decode(self, questions, batch_size, repeats=1):
        out = []
        for q, final in zip(questions, self.finals, strict=True):
            kind = lc.parse_descriptive(q).kind
            answer = cot.Answer(
                text="", final=final, steps=(), seconds=0.0, tokens=1, finished=True, kind=kind
            )
            out.append((answer, None))
        return out


def test_descriptive_answers_are_graded_by_parts():
    cfg = lc.GeneratorConfig(kinds=("column_space_basis",), nullspace_shape=(3, 4))
    problems = list(lc.make_splits(train=0, validation=0, test=3, seed=1, config=cfg)["test"])
    solver = _Scripted(
        EncoderDecoder(
            EncDecConfig(vocab_size=cot.VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0),
            rngs=nnx.Rngs(0),
        ),
        cot.fit_format(problems),
        kinds=("column_space_basis",),
    )
    ref = problems[0].answer
    parts = lc.answer_parts(ref)
    # The first right (its basis doubled: another basis of the same space), the second with the
    # rank wrong, the third with no answer.
    doubled = ", ".join(
        "[" + ", ".join(str(2 * int(x)) for x in v.split(", ")) + "]"
        for v in parts["basis"].strip("[]").split("], [")
    )
    assert "/" not in parts["basis"], "the test writes integer bases"
    wrong_rank = problems[1].answer.replace(f"rank {lc.answer_parts(problems[1].answer)['rank']}",
                                            "rank 9")  # fmt: skip
    solver.finals = (ref.replace(parts["basis"], doubled), wrong_rank, None)
    result = cot.evaluate(solver, problems, batch_size=3)
    records = result["records"]
    assert [r["correct"] for r in records] == [True, False, False]
    assert records[0]["parts"] == dict.fromkeys(parts, True)
    assert records[1]["parts"]["rank"] is False and records[1]["parts"]["basis"] is True
    assert not any(records[2]["parts"].values())
    assert result["kinds"]["column_space_basis"]["exact_match"] == pytest.approx(1 / 3)
    assert np.isclose(result["overall"]["exact_match"], 1 / 3)
