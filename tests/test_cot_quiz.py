"""The GiantRabbit study's exam in every chain-of-thought report (experiments.cot.exam): the
``quiz`` command on a tiny trained run, the table recomputed from the saved answers, a hand-made
answers file whose counts are fixed by hand, the line when the quiz is not found, and the study's
own nine questions (read from the shared folder at run time, skipped when absent; never copied
here: CC BY-NC-SA).
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from experiments import cot as experiment
from experiments.cot import exam
from sparse_jax import cot
from sparse_jax.data import linalg_cot as lc

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
