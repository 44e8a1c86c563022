"""``python -m experiments.cot --preset exam`` (issue 59): the preset's data are the exam's
(linalg_cot.GeneratorConfig.exam(), all kinds, the answers in words included), its splits hold
no question of the GiantRabbit quiz by content (read from the shared folder at run time, skipped
when absent; never copied here: CC BY-NC-SA), a tiny override of it trains; the default command
is unchanged; --data.exclude-quiz reads the quiz file --eval.quiz names (and a trained run's
later commands the one its training read); a Solver trained on a kind answered in words reads
and grades it by parts.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from experiments.common.run_folder import COT, RunFolderError, with_program
from experiments.cot import config as cli
from experiments.cot import exam, job, run_folder
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


class _Prepared(Exception):
    """Raised by a stand-in for linalg_cot.prepare: the splits asked for are what is tested."""


def _stop_at_prepare(monkeypatch):
    seen = {}

    def fake(root, **kwargs):
        seen.update(kwargs)
        raise _Prepared

    monkeypatch.setattr(run_folder.linalg_cot, "prepare", fake)
    return seen


OWN_QUESTION = "Find the special solutions of A = [[1, 2]]."
TINY = ["--data.kinds", "nullspace", "--data.train", "4", "--train.batch-size", "2",
        "--data.exclude-quiz"]  # fmt: skip


@pytest.fixture
def own_quiz(tmp_path):
    """A quiz file of one question of this file's own, elsewhere than the default path."""
    path = tmp_path / "own-quiz.json"
    entry = {"no": 1, "text": OWN_QUESTION, "type": "computable", "answer": {}}
    path.write_text(json.dumps({"questions": [entry]}))
    return path


def test_exclude_quiz_reads_the_quiz_eval_quiz_names(own_quiz, tmp_path, monkeypatch, capsys):
    seen = _stop_at_prepare(monkeypatch)
    own = [lc.parse_question(OWN_QUESTION).contents]
    folder = tmp_path / "run"
    where = ["--run.dir", str(folder), "--run.cache-dir", str(tmp_path)]
    for command in (["all"], ["seeds", "--seeds", "0"]):
        seen.clear()
        with pytest.raises(_Prepared):
            job.run(cli.parse([*command, *TINY, *where, "--eval.quiz", str(own_quiz)]))
        assert [q.contents for q in seen["exclude"]] == own, command
        log = capsys.readouterr().err
        assert f"--data.exclude-quiz: 1 questions of {own_quiz} in no split" in log
    # The default is unchanged: absent, nothing is excluded and one line says so.
    missing = tmp_path / "nowhere" / "quiz.json"
    monkeypatch.setattr(exam, "DEFAULT_QUIZ", missing)
    with pytest.raises(_Prepared):
        job.run(cli.parse([*TINY, *where]))
    assert list(seen["exclude"]) == []
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "--data.exclude-quiz" in line] == [
        f"[cot] --data.exclude-quiz: the quiz {missing} was not found: nothing excluded"
    ]


def test_a_trained_runs_splits_are_made_without_the_quiz_its_training_read(
    own_quiz, tmp_path, monkeypatch, capsys
):
    """eval, roles and a resumption make the splits again: without the quiz the run's training
    excluded (its config.json records --eval.quiz), whatever the default; a resumption naming
    another --eval.quiz is refused by name."""
    seen = _stop_at_prepare(monkeypatch)
    own = [lc.parse_question(OWN_QUESTION).contents]
    folder = tmp_path / "run"
    where = ["--run.dir", str(folder), "--run.cache-dir", str(tmp_path)]
    trained = cli.parse([*TINY, *where, "--eval.quiz", str(own_quiz)])
    folder.mkdir()
    record = with_program(
        json.loads(json.dumps(dataclasses.asdict(trained), default=str)), COT.name
    )
    (folder / "config.json").write_text(json.dumps(record))
    (folder / cot.RECORD).write_text("{}")
    assert run_folder.recorded_quiz(folder) == own_quiz
    monkeypatch.setattr(exam, "DEFAULT_QUIZ", tmp_path / "nowhere.json")
    for flags in (["eval", *where], ["roles", *where], ["train", *TINY, *where, "--run.resume"],
                  [*TINY, *where, "--run.resume", "--eval.quiz", str(own_quiz)]):  # fmt: skip
        seen.clear()
        with pytest.raises(_Prepared):
            job.run(cli.parse(flags))
        assert [q.contents for q in seen["exclude"]] == own, flags[0]
    other = tmp_path / "other.json"
    other.write_text(own_quiz.read_text())
    with pytest.raises(RunFolderError, match=f"--eval.quiz '{other}': the run in '{folder}' kept "
                       f"the questions of '{own_quiz}' out of its splits"):  # fmt: skip
        job.run(cli.parse([*TINY, *where, "--run.resume", "--eval.quiz", str(other)]))


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
    # A model not trained on it refuses it, undecoded, naming the kind it read (not the
    # computable parser's "could not find a matrix").
    refuses = cot.Solver(model, fmt, kinds=("rref",), chunk=8).answer(question)
    assert refuses.error == (
        "this model was trained on rref questions only; this is a subspaces question"
    )
    assert refuses.tokens == 0 and refuses.kind == "subspaces"
    anything = cot.Solver(model, fmt, chunk=8).answer(question)  # no kinds recorded
    assert "was not trained on questions answered in words" in anything.error
    assert anything.tokens == 0
    # Neither parser reads it: the computable parser's reason.
    why = cot.Solver(model, fmt, kinds=("rref",), chunk=8).answer("What is 2 + 2?").error
    assert why.startswith("could not parse the question")
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
