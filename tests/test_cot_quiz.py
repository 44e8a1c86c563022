"""The GiantRabbit study's exam in every chain-of-thought report (experiments.cot.exam): the
``quiz`` command on a tiny trained run, the table recomputed from the saved answers, a hand-made
answers file whose counts are fixed by hand, the questions answered in words asked of a model
trained on their kind and graded by parts, the table pooled over the seeds in ``seeds.md``, the
line when the quiz is not found, and the study's own nine questions (read from the shared folder
at run time, skipped when absent; never copied here: CC BY-NC-SA).
"""

from __future__ import annotations

import json
import pathlib
import re
import types

import pytest
from flax import nnx

from experiments import cot as experiment
from experiments.cot import exam
from experiments.cot import seeds as seeds_command
from sparse_jax import cot
from sparse_jax.data import linalg_cot as lc
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder

STUDY = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "giantrabbit-quiz"

# A tiny run: the models answer wrong, which is fine: the table is what is tested.
RUN_FLAGS = [
    "--data.kinds", "rref", "--data.train", "4", "--data.validation", "1", "--data.test", "1",
    "--model.d-model", "16", "--model.num-heads", "2", "--model.d-ff", "32",
    "--model.cot-steps", "0", "--train.steps", "2", "--train.batch-size", "2",
    "--train.warmup", "0", "--train.buckets", "1", "1", "--run.checkpoint-every", "2",
]  # fmt: skip


def _matrix_of(answer: str) -> list:
    """A canonical matrix answer as the quiz file writes it (fractions as strings)."""
    return json.loads(re.sub(r"(-?\d+/\d+)", r'"\1"', answer))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny run folder, its training problems and a quiz file in this file's own words."""
    tmp = tmp_path_factory.mktemp("cot-quiz")
    folder = tmp / "run"
    args = [*RUN_FLAGS, "--run.dir", str(folder), "--run.cache-dir", str(tmp)]
    assert experiment.run(experiment.parse(["train", *args])) == folder
    generator = lc.GeneratorConfig(kinds=("rref",), **experiment.SIZES["small"])
    data = lc.prepare(tmp / "tfds", train=4, validation=1, test=1, seed=0, config=generator)
    problems = list(data.train)
    questions = [
        (problems[0].question, "computable", {"R": _matrix_of(problems[0].answer)}),
        ("Find the special solutions of A = [[1, 2]].", "computable",
         {"special_solutions": [[-2, 1]]}),
        ("Describe the column space of A = [[1, 2], [2, 4]].", "descriptive", {"text": "-"}),
        ("Explain in words why Ax = b can be solved exactly when b is in the column space of A.",
         "descriptive", {"text": "-"}),
        (problems[1].question, "computable", {"text": "no matrix"}),
    ]  # fmt: skip
    quiz_file = tmp / "quiz.json"
    entries = [
        {"no": i + 1, "text": q, "type": t, "answer": a} for i, (q, t, a) in enumerate(questions)
    ]
    quiz_file.write_text(json.dumps({"questions": entries}))
    return dict(folder=folder, cache=tmp, problems=problems, quiz=quiz_file)


@pytest.fixture(scope="module")
def asked(run):
    """``python -m experiments.cot quiz`` on the tiny run with the test's quiz file."""
    flags = ["quiz", "--run.dir", str(run["folder"]), "--eval.quiz", str(run["quiz"])]
    return experiment.run(experiment.parse(flags))


def test_the_quiz_command_saves_each_models_answers(run, asked):
    saved = exam.read_answers(run["folder"])
    assert saved == json.loads(json.dumps(asked))
    assert saved["found"] and saved["quiz"] == str(run["quiz"])
    rows = saved["questions"]
    assert [r["no"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["kind"] for r in rows] == ["rref", "nullspace", "column_space_basis", None, "rref"]
    # The study's answer as the kind's canonical answer: what linalg_cot writes for it.
    assert rows[0]["reference"] == run["problems"][0].answer
    assert rows[1]["reference"] == "s1 = [-2, 1]; N(A) is a line in R^2"
    assert rows[2]["not_asked"].startswith("not asked: the model is not trained on this kind")
    assert rows[3]["not_asked"].startswith("refused: could not parse the question: the question "
                                           "asks for an explanation in words")  # fmt: skip
    assert rows[4]["not_asked"] == "not asked: the quiz gives no rref answer to grade against"
    for name in ("sparse", "dense"):
        first = rows[0]["answers"][name]
        assert first["error"] is None and first["tokens"] > 0 and first["seconds"] > 0
        steps, final = lc.split_solution(first["text"])
        assert (first["final"], first["steps"]) == (final, len(steps))
        assert first["correct"] == (final is not None and lc.grade(final, first_ref(rows)))
        second = rows[1]["answers"][name]
        assert second["tokens"] == 0 and "this is a nullspace question" in second["error"]
        assert all(r["answers"] == {} for r in rows[2:])


def first_ref(rows) -> str:
    return rows[0]["reference"]


def test_the_table_is_recomputed_from_the_saved_answers(run, asked, capsys):
    rows = exam.read_answers(run["folder"])["questions"]
    lines = exam.quiz_lines(exam.read_answers(run["folder"]))
    cells = []
    right = {}
    for name in ("sparse", "dense"):
        a = rows[0]["answers"][name]
        ok = a["final"] is not None and lc.grade(a["final"], rows[0]["reference"])
        right[name] = int(ok)
        verdict = "right" if ok else ("wrong" if a["final"] is not None else "no answer")
        cells.append(f"{verdict} | {1e3 * a['seconds']:.1f} | {a['steps']} | {a['tokens']}")
    assert f"| 1 | rref | {' | '.join(cells)} |" in lines
    assert "| 2 | nullspace | " + " | ".join(["refused | - | - | -"] * 2) + " |" in lines
    assert "| 3 | column_space_basis | " + " | ".join(["not asked | - | - | -"] * 2) + " |" in lines
    assert "| 4 | - | " + " | ".join(["refused | - | - | -"] * 2) + " |" in lines
    assert (
        f"Right: sparse {right['sparse']} of 2, dense {right['dense']} of 2 questions graded (a "
        "model's refusal counts as wrong; the others were not asked)."
    ) in lines
    assert any(
        line.startswith("- Question 2, sparse and dense: refused: this model was trained on rref")
        for line in lines
    )
    assert any(line.startswith("- Question 4: refused: could not parse") for line in lines)
    # The command printed the same table (it was run once by the fixture).
    flags = ["quiz", "--run.dir", str(run["folder"]), "--eval.quiz", str(run["quiz"])]
    experiment.run(experiment.parse(flags))
    assert "\n".join(exam.quiz_lines(exam.read_answers(run["folder"]))) in capsys.readouterr().out


def test_every_report_ends_with_the_table(run, asked, tmp_path, monkeypatch):
    folder = run["folder"]
    experiment.run(experiment.parse(
        ["eval", "--run.dir", str(folder), "--run.cache-dir", str(run["cache"]),
         "--eval.batch-size", "1", "--eval.repeats", "1", "--eval.quiz", str(run["quiz"])]
    ))  # fmt: skip
    report = (folder / "report.md").read_text()
    table = "\n".join(exam.quiz_lines(exam.read_answers(folder)))
    assert report.endswith(table + "\n") and "| 1 | rref | " in table
    assert json.loads((folder / "summary.json").read_text())["quiz_seconds"] > 0
    # The quiz command rewrites an evaluated folder's report: here, without the quiz.
    monkeypatch.setattr(exam, "DEFAULT_QUIZ", tmp_path / "quiz.json")
    experiment.run(experiment.parse(["quiz", "--run.dir", str(folder)]))
    missing = f"The GiantRabbit study's exam was not found at {tmp_path / 'quiz.json'}"
    assert (folder / "report.md").read_text().endswith(" (--eval.quiz): no table.\n")
    assert missing in (folder / "report.md").read_text()
    experiment.run(
        experiment.parse(["quiz", "--run.dir", str(folder), "--eval.quiz", str(run["quiz"])])
    )
    table = "\n".join(exam.quiz_lines(exam.read_answers(folder)))  # decoded again
    assert (folder / "report.md").read_text().endswith(table + "\n") and "| 1 | rref | " in table


# ------------------------------------------------------------------------------------------
# A hand-made answers file: its counts are fixed here by hand, not recomputed with grade.


def _answer(final, *, error=None, correct=False, seconds=0.0125, steps=3, tokens=40):
    return {"final": final, "correct": correct, "seconds": seconds, "steps": steps,
            "tokens": tokens, "finished": True, "error": error, "text": ""}  # fmt: skip


HAND_MADE = {
    "quiz": "/somewhere/quiz.json",
    "found": True,
    "questions": [
        {"no": 1, "type": "computable", "kind": "rref", "reference": "[[1, 0], [0, 1]]",
         "not_asked": None,
         "answers": {"sparse": _answer("[[1, 0], [0, 1]]", correct=True),
                     "dense": _answer("[[1, 0], [0, 1]]]")}},  # runs past the reference
        {"no": 2, "type": "computable", "kind": "solvability",
         "reference": "always; many solutions", "not_asked": None,
         # A saved verdict is not trusted: the dense answer is right, whatever it says.
         "answers": {"sparse": _answer(None, steps=0, tokens=7),
                     "dense": _answer("always;  many solutions", correct=False)}},
        {"no": 3, "type": "computable", "kind": "column_space", "reference": "yes; x = [3, 2]",
         "not_asked": None,
         "answers": {"sparse": _answer(None, error="too long", seconds=0.0, tokens=0),
                     "dense": _answer("yes; x = [3, 2]", seconds=0.002, steps=5, tokens=61)}},
        {"no": 4, "type": "descriptive", "kind": "subspaces", "reference": None,
         "not_asked": "not asked: the model is not trained on this kind (subspaces)",
         "answers": {}},
        {"no": 5, "type": "descriptive", "kind": None, "reference": None,
         "not_asked": "refused: could not parse the question: it explains", "answers": {}},
    ],
}  # fmt: skip


def test_a_hand_made_answers_file_gives_the_counts_written_by_hand(tmp_path):
    exam.write_answers(tmp_path, HAND_MADE)
    lines = exam.quiz_lines(exam.read_answers(tmp_path))
    assert "read from /somewhere/quiz.json" in lines[0]
    assert lines[2:] == [
        "| question | kind | sparse | time ms | steps | tokens | dense | time ms | steps | "
        "tokens |",
        "|:--|:--|:--|--:|--:|--:|:--|--:|--:|--:|",
        "| 1 | rref | right | 12.5 | 3 | 40 | wrong | 12.5 | 3 | 40 |",
        "| 2 | solvability | no answer | 12.5 | 0 | 7 | right | 12.5 | 3 | 40 |",
        "| 3 | column_space | refused | - | - | - | right | 2.0 | 5 | 61 |",
        "| 4 | subspaces | not asked | - | - | - | not asked | - | - | - |",
        "| 5 | - | refused | - | - | - | refused | - | - | - |",
        "",
        "Right: sparse 1 of 3, dense 2 of 3 questions graded (a model's refusal counts as wrong; "
        "the others were not asked).",
        "",
        "- Question 3, sparse: refused: too long",
        "- Question 4: not asked: the model is not trained on this kind (subspaces)",
        "- Question 5: refused: could not parse the question: it explains",
    ]


def test_a_run_of_one_model_shows_the_other_as_dashes():
    one = {**HAND_MADE, "questions": HAND_MADE["questions"][:1]}
    lines = exam.quiz_lines(one, models=("dense",))
    assert "| 1 | rref | wrong | 12.5 | 3 | 40 |" in lines
    assert "Right: dense 0 of 1 questions graded" in lines[-1]


# ------------------------------------------------------------------------------------------
# The questions answered in words (linalg_cot.DESCRIPTIVE_KINDS), asked of a model trained on
# their kind: Solver's own reading decides what each model is asked, its answers are scripted.


class _Scripted(cot.Solver):
    """An untrained tiny solver trained (by its ``kinds``) on some kinds, whose final answer
    to each question it reads is given per kind (none: no answer line; the decoding is not what
    is tested)."""

    def __init__(self, kinds: tuple[str, ...], finals: dict[str, str]):
        cfg = EncDecConfig(vocab_size=cot.VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
        fmt = cot.CotFormat(source_len=512, target_len=8)
        super().__init__(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), fmt, kinds=kinds, chunk=8)
        self.finals = finals

    def decode(self, questions, batch_size, repeats=1):
        out = []
        for question in questions:
            ids, answer = self._read(question)  # a refusal says why, as Solver's does
            if ids is not None:  # a kind without a final answer given: no answer line
                final = self.finals.get(answer.kind)
                text = "step" if final is None else f"step\nAnswer: {final}"
                answer = cot.Answer(
                    text=text, final=final, steps=("step",), seconds=0.002, tokens=9,
                    finished=True, kind=answer.kind,
                )  # fmt: skip
            out.append((answer, None))
        return out


WORDS = [
    ("Describe the column space of A = [[1, 2], [2, 4]].", "descriptive", {"text": "a line"}),
    ("A is a 3 by 5 matrix of rank 3. Describe its column space and its nullspace.",
     "descriptive", {"text": "all of R^3; a plane in R^5"}),
    ("Explain in words why Ax = b can be solved exactly when b is in the column space of A.",
     "descriptive", {"text": "-"}),
    ("Find rref(A) for A = [[2, 4], [1, 3]].", "computable", {"R": [[1, 0], [0, 1]]}),
]  # fmt: skip


@pytest.fixture
def words_quiz(tmp_path):
    path = tmp_path / "words.json"
    entries = [
        {"no": i + 1, "text": q, "type": t, "answer": a} for i, (q, t, a) in enumerate(WORDS)
    ]
    path.write_text(json.dumps({"questions": entries}))
    return path


def _words_solvers():
    return {
        # Trained on rref and the column space of a matrix: its basis is another one of C(A).
        "sparse": _Scripted(("rref", "column_space_basis"), {
            "rref": "[[1, 0], [0, 1]]",
            "column_space_basis": "rank 1; C(A) is a line in R^2; basis [2, 4]"}),
        # Trained on both kinds in words: its rank is wrong, its subspaces right.
        "dense": _Scripted(("column_space_basis", "subspaces"), {
            "column_space_basis": "rank 2; C(A) is a line in R^2; basis [1, 2]",
            "subspaces": "C(A) is all of R^3; N(A) is a 2-dimensional subspace of R^5"}),
    }  # fmt: skip


def test_questions_in_words_are_asked_of_a_model_trained_on_their_kind(words_quiz, tmp_path):
    record = exam.ask_quiz(_words_solvers(), words_quiz)
    rows = record["questions"]
    assert [r["kind"] for r in rows] == ["column_space_basis", "subspaces", None, "rref"]
    assert [r["not_asked"] is None for r in rows] == [True, True, False, True]
    # The references, written here by hand: what linalg_cot.solve writes for the question's
    # own matrix (rank 1, pivot column [1, 2]) and size and rank (3 by 5 of rank 3).
    assert rows[0]["reference"] == "rank 1; C(A) is a line in R^2; basis [1, 2]"
    assert rows[1]["reference"] == "C(A) is all of R^3; N(A) is a plane in R^5"
    first, second = rows[0]["answers"], rows[1]["answers"]
    assert first["sparse"]["correct"] and first["sparse"]["parts"] == {
        "rank": True, "C(A) dimension": True, "C(A) space": True, "basis": True}  # fmt: skip
    assert not first["dense"]["correct"] and first["dense"]["parts"] == {
        "rank": False, "C(A) dimension": True, "C(A) space": True, "basis": True}  # fmt: skip
    assert second["dense"]["correct"] and all(second["dense"]["parts"].values())
    assert second["sparse"]["error"] == (  # not its kind
        "this model was trained on rref, column_space_basis questions only; this is a "
        "subspaces question"
    )
    assert not second["sparse"]["correct"] and second["sparse"]["tokens"] == 0
    assert "explanation in words" in rows[2]["not_asked"] and rows[2]["answers"] == {}
    assert rows[3]["answers"]["sparse"]["correct"] and rows[3]["answers"]["sparse"]["parts"] is None
    assert "this is a rref question" in rows[3]["answers"]["dense"]["error"]
    # The saved answers hold no question; the table is graded again from them, by parts.
    saved = exam.write_answers(tmp_path, record).read_text()
    assert not any(q in saved for q, _, _ in WORDS)
    lines = exam.quiz_lines(exam.read_answers(tmp_path))
    assert lines[4:11] == [
        "| 1 | column_space_basis | right | 2.0 | 1 | 9 | wrong | 2.0 | 1 | 9 |",
        "| 2 | subspaces | refused | - | - | - | right | 2.0 | 1 | 9 |",
        "| 3 | - | refused | - | - | - | refused | - | - | - |",
        "| 4 | rref | right | 2.0 | 1 | 9 | refused | - | - | - |",
        "",
        "Right: sparse 2 of 3, dense 1 of 3 questions graded (a model's refusal counts as wrong; "
        "the others were not asked).",
        "",
    ]
    assert (
        "- Question 1 (column_space_basis), graded by parts against `rank 1; C(A) is a line in "
        "R^2; basis [1, 2]`: sparse right: rank, C(A) dimension, C(A) space, basis; dense right: "
        "C(A) dimension, C(A) space, basis; wrong: rank"
    ) in lines
    assert (
        "- Question 2 (subspaces), graded by parts against `C(A) is all of R^3; N(A) is a plane "
        "in R^5`: dense right: C(A) dimension, C(A) space, N(A) dimension, N(A) space"
    ) in lines
    # Asked of the sparse model alone, the nullspace question is not asked: no model here was
    # trained on its kind.
    alone = exam.ask_quiz({"sparse": _words_solvers()["sparse"]}, words_quiz)["questions"]
    assert alone[0]["not_asked"] is None and alone[1]["answers"] == {}
    assert alone[1]["not_asked"] == (
        "not asked: the model is not trained on this kind (subspaces, answered in words; "
        "linalg_cot.parse_descriptive reads it; the models here were trained on "
        "column_space_basis)"
    )


# ------------------------------------------------------------------------------------------
# The seeds report: the study's table pooled over each seed's saved answers.


def _seed_answers(quiz: pathlib.Path, sparse_final: str, dense_error: str | None) -> dict:
    """A seed's answers to a two-question quiz: an rref question (the sparse model answers
    ``sparse_final``, the dense one right or refused) and one not asked."""
    dense = (
        _answer(None, error=dense_error, seconds=0.0, steps=0, tokens=0)
        if dense_error
        else _answer("[[1, 0], [0, 1]]", seconds=0.004, steps=2, tokens=20)
    )
    return {
        "quiz": str(quiz), "found": True,
        "questions": [
            {"no": 1, "type": "computable", "kind": "rref", "reference": "[[1, 0], [0, 1]]",
             "not_asked": None, "answers": {"sparse": _answer(sparse_final), "dense": dense}},
            {"no": 2, "type": "descriptive", "kind": None, "reference": None,
             "not_asked": "refused: could not parse the question: it explains", "answers": {}},
        ],
    }  # fmt: skip


def _seed_folder(folder: pathlib.Path, right: bool) -> None:
    """A seed's evaluated run as the seeds command leaves it (nothing to train or decode)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    kind = {"exact_match": float(right), "questions": 1}
    result = {"kinds": {"rref": kind}, "overall": {**kind, "seconds_per_question": 0.01},
              "train_seconds": 1.0}  # fmt: skip
    for name in ("sparse", "dense"):
        (folder / f"eval-{name}.json").write_text(json.dumps(result))
        row = {"question": "q", "kind": "rref", "correct": right}
        (folder / f"answers-{name}.jsonl").write_text(json.dumps(row) + "\n")


def test_the_seeds_report_ends_with_the_studys_table(words_quiz, tmp_path, monkeypatch, capsys):
    top = tmp_path / "seeds"
    _seed_folder(top / "seed-0", True)
    _seed_folder(top / "seed-1", False)
    exam.write_answers(top / "seed-0", _seed_answers(words_quiz, "[[1, 0], [0, 1]]", None))
    exam.write_answers(top / "seed-1", _seed_answers(words_quiz, "[[1, 2]]", "too long"))
    seen = []

    def prepare(data, cache_dir, quiz=None):
        seen.append(quiz)
        return types.SimpleNamespace(test=[])

    monkeypatch.setattr(seeds_command, "prepare_data", prepare)
    flags = ["seeds", "--seeds", "0", "1", "--data.kinds", "rref", "--run.dir", str(top),
             "--run.resume"]  # fmt: skip
    # Each seed is read back: nothing is trained or decoded.
    summary = experiment.run(experiment.parse([*flags, "--eval.quiz", str(words_quiz)]))
    assert summary["quiz"] == str(words_quiz)
    table = (top / "seeds.md").read_text()
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("The GiantRabbit study's"))
    assert "each asked of both models of each seed's run (0, 1)" in lines[start]
    # Fixed by hand: seed 0 both right; seed 1 sparse wrong, dense refused.
    assert lines[start + 2 :] == [
        "| question | kind | sparse right | time ms | steps | tokens | dense right | time ms | "
        "steps | tokens |",
        "|:--|:--|:--|--:|--:|--:|:--|--:|--:|--:|",
        "| 1 | rref | 1 of 2 | 12.5 | 3.0 | 40.0 | 1 of 2 (1 refused) | 4.0 | 2.0 | 20.0 |",
        "| 2 | - | refused | - | - | - | refused | - | - | - |",
        "",
        "Right per seed, of 1 questions graded: seed 0: sparse 1, dense 1; seed 1: sparse 0, "
        "dense 0; mean sparse 0.5, dense 0.5.",
        "",
        "- Question 1, dense (seeds 1): refused: too long",
        "- Question 2: refused: could not parse the question: it explains",
    ]
    assert table in capsys.readouterr().out
    # No quiz where --eval.quiz's default points: asked again (no model is loaded), one line.
    missing = tmp_path / "nowhere.json"
    monkeypatch.setattr(exam, "DEFAULT_QUIZ", missing)
    experiment.run(experiment.parse(flags))
    assert (
        (top / "seeds.md")
        .read_text()
        .endswith(
            f"The GiantRabbit study's exam was not found at {missing} (--eval.quiz): no table.\n"
        )
    )
    assert exam.read_answers(top / "seed-1") == {"quiz": str(missing), "found": False}
    # The seeds' test split was made without the quiz --eval.quiz names (--data.exclude-quiz).
    assert seen == [words_quiz, None]


# ------------------------------------------------------------------------------------------
# No quiz: one line, no table; a bad --eval.quiz or run folder refused before anything runs.


def test_a_missing_quiz_is_one_line_and_no_table(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nowhere" / "quiz.json"
    record = exam.ask_quiz({}, missing)
    assert record == {"quiz": str(missing), "found": False}
    assert exam.quiz_lines(record) == [
        f"The GiantRabbit study's exam was not found at {missing} (--eval.quiz): no table."
    ]
    # The default path, absent: the command says so without loading a model.
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / cot.RECORD).write_text("{}")  # a run folder by its record; no model is read
    monkeypatch.setattr(exam, "DEFAULT_QUIZ", missing)
    assert experiment.run(experiment.parse(["quiz", "--run.dir", str(folder)])) == record
    assert exam.read_answers(folder) == record
    assert capsys.readouterr().out.strip() == exam.quiz_lines(record)[0]
    assert exam.quiz_lines(None)[0].startswith("The GiantRabbit study's exam: no answers saved")


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["quiz"], "--run.dir is required"),
        (["quiz", "--run.dir", "/nonexistent/run"], "is not a chain-of-thought run folder"),
        (["eval", "--run.dir", "/x", "--eval.quiz", "/nonexistent/quiz.json"],
         "--eval.quiz '/nonexistent/quiz.json' is not a file"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_before_anything_runs(flags, match, capsys):
    with pytest.raises(SystemExit):
        experiment.parse(flags)
    assert match in " ".join(capsys.readouterr().err.replace("│", " ").split())


def test_a_file_that_is_not_a_quiz_is_refused_by_name(tmp_path, capsys):
    bad = tmp_path / "quiz.json"
    bad.write_text(json.dumps({"questions": [{"no": 1, "text": 3}]}))
    with pytest.raises(SystemExit):
        experiment.parse(["all", "--eval.quiz", str(bad)])
    printed = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert "must have an int `no`, a str `text` and an object `answer`" in printed


def test_a_folder_without_a_trained_model_is_refused(run, tmp_path):
    (tmp_path / cot.RECORD).write_text((run["folder"] / cot.RECORD).read_text())
    with pytest.raises(ValueError, match="holds no trained model"):
        experiment.run(
            experiment.parse(["quiz", "--run.dir", str(tmp_path), "--eval.quiz", str(run["quiz"])])
        )


# ------------------------------------------------------------------------------------------
# The study's own exam (skipped when the shared folder is absent).


@pytest.fixture(scope="module")
def study():
    path = STUDY / "quiz.json"
    if not path.is_file():
        pytest.skip(f"the GiantRabbit quiz is not at {path} (shared data, never in the repository)")
    return path


def test_the_default_quiz_is_the_studys(study):
    assert exam.DEFAULT_QUIZ == study and exam.quiz_path(None) == study


def test_the_studys_exam_asked_of_the_tiny_run(run, study, tmp_path):
    solvers = {name: cot.Solver.load(run["folder"], name, batch_size=1) for name in ("dense",)}
    record = exam.ask_quiz(solvers, study)
    rows = {r["no"]: r for r in record["questions"]}
    assert sorted(rows) == list(range(1, 10))
    entries = {q["no"]: q for q in exam.read_quiz(study)}
    graded = [no for no, r in rows.items() if r["not_asked"] is None]
    assert graded == [1, 2, 3, 5, 6, 9]
    for no in graded:  # the study's answers are what linalg_cot solves
        assert rows[no]["reference"] == lc.solve(lc.parse_question(entries[no]["text"])).answer
    assert (rows[4]["kind"], rows[7]["kind"]) == ("column_space_basis", "subspaces")
    for no in (4, 7):
        assert rows[no]["not_asked"].startswith("not asked: the model is not trained on this kind")
    assert rows[8]["kind"] is None and "explanation in words" in rows[8]["not_asked"]
    # The saved answers never hold the questions (CC BY-NC-SA).
    saved = exam.write_answers(tmp_path, record).read_text()
    assert not any(q["question"] in saved for q in entries.values())
    lines = exam.quiz_lines(exam.read_answers(tmp_path), models=("dense",))
    for no in (4, 7, 8):
        assert f"- Question {no}: {rows[no]['not_asked']}" in lines
    assert any(line.startswith("Right: dense ") and " of 6 " in line for line in lines)


def test_the_studys_questions_in_words_are_asked_of_a_model_trained_on_them(study, tmp_path):
    entries = {q["no"]: q for q in exam.read_quiz(study)}
    words = {no: lc.parse_descriptive(entries[no]["text"]) for no in (4, 7)}
    # A model trained on every kind, whose answers in words are linalg_cot.solve's.
    finals = {p.kind: lc.solve(p).answer for p in words.values()}
    record = exam.ask_quiz({"dense": _Scripted(lc.KINDS + lc.DESCRIPTIVE_KINDS, finals)}, study)
    rows = {r["no"]: r for r in record["questions"]}
    assert [no for no, r in rows.items() if r["not_asked"] is None] == [1, 2, 3, 4, 5, 6, 7, 9]
    assert (rows[4]["kind"], rows[7]["kind"]) == ("column_space_basis", "subspaces")
    for no in (4, 7):
        assert rows[no]["reference"] == lc.solve(words[no]).answer
        answer = rows[no]["answers"]["dense"]
        assert answer["correct"] and answer["parts"] and all(answer["parts"].values())
    # The graded parts say what the study's answer in words says (read here, never copied).
    four, text = lc.answer_parts(rows[4]["reference"]), entries[4]["answer"]["text"]
    assert f"rank {four['rank']}" in text and f"plane in {four['C(A) space']}" in text
    assert four["C(A) dimension"] == "2"
    assert all(f"[{v}]" in text for v in four["basis"].strip("[]").split("], ["))
    seven, text = lc.answer_parts(rows[7]["reference"]), entries[7]["answer"]["text"]
    assert f"all of {seven['C(A) space']}" in text
    assert seven["C(A) dimension"] == seven["C(A) space"].removeprefix("R^")
    assert f"{seven['N(A) dimension']}-dimensional subspace of {seven['N(A) space']}" in text
    # Question 8 stays refused, with its reason.
    assert rows[8]["kind"] is None and "explanation in words" in rows[8]["not_asked"]
    saved = exam.write_answers(tmp_path, record).read_text()
    assert not any(q["question"] in saved or q["text"] in saved for q in entries.values())
    lines = exam.quiz_lines(exam.read_answers(tmp_path), models=("dense",))
    assert "| 4 | column_space_basis | right | 2.0 | 1 | 9 |" in lines
    assert "| 7 | subspaces | right | 2.0 | 1 | 9 |" in lines
    assert any(line.startswith("Right: dense 2 of 8 questions graded") for line in lines)
    assert f"- Question 8: {rows[8]['not_asked']}" in lines
