"""The GiantRabbit study's exam (its Table 1: the nine questions of the 18.06 quiz of March 1,
2010, as the study entered them) asked of a run folder's trained models: :func:`ask_quiz` answers
each question with each model and grades its final answer against the study's, the answers are
saved in ``<run>/quiz-answers.json`` (:data:`ANSWERS`), and :func:`quiz_lines` makes the report's
table from them, per question right or not, reasoning time, chain steps and tokens, sparse beside
dense (the study's Figure 3).

The questions are CC BY-NC-SA: they are read at run time from ``--eval.quiz`` (default
:data:`DEFAULT_QUIZ`, ``../shared/data/giantrabbit-quiz/quiz.json`` beside the repository) and
never copied into the repository; the saved answers hold the models' answers and the study's
final answers, not the questions.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from experiments.common.files import write_text_atomically
from sparse_jax import cot
from sparse_jax.data import linalg_cot

__all__ = [
    "ANSWERS",
    "DEFAULT_QUIZ",
    "ask_quiz",
    "quiz_lines",
    "quiz_path",
    "read_answers",
    "read_quiz",
    "study_answer",
    "write_answers",
]

# The study's exam: the shared data folder beside the repository (never in it).
DEFAULT_QUIZ = (
    pathlib.Path(__file__).resolve().parents[3]
    / "shared"
    / "data"
    / "giantrabbit-quiz"
    / "quiz.json"
)
# The models' answers to it, in the run folder.
ANSWERS = "quiz-answers.json"


def quiz_path(flag: pathlib.Path | str | None) -> pathlib.Path:
    """The quiz file ``--eval.quiz`` names (None: :data:`DEFAULT_QUIZ`)."""
    return DEFAULT_QUIZ if flag is None else pathlib.Path(flag)


def read_quiz(path: pathlib.Path | str) -> list[dict]:
    """The questions of a quiz file (``{"questions": [{"no", "text", "type", "answer"}, ...]}``),
    in its order. Raises ``ValueError`` naming the file and what is wrong."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--eval.quiz {str(path)!r}: cannot be read as JSON: {err}") from None
    questions = data.get("questions") if isinstance(data, dict) else None
    if not isinstance(questions, list) or not questions:
        raise ValueError(
            f"--eval.quiz {str(path)!r}: must be a JSON object with a non-empty list `questions`"
        )
    for i, q in enumerate(questions):
        if (
            not isinstance(q, dict)
            or not isinstance(q.get("no"), int)
            or not isinstance(q.get("text"), str)
            or not isinstance(q.get("answer"), dict)
        ):
            raise ValueError(
                f"--eval.quiz {str(path)!r}: question {i} must have an int `no`, a str `text` "
                "and an object `answer`"
            )
    return questions


def _matrix(rows) -> str:
    return linalg_cot.format_matrix([[Fraction(str(x)) for x in row] for row in rows])


def _vector(values) -> str:
    return linalg_cot.format_vector([Fraction(str(x)) for x in values])


def _subspace_words(dimension: int, n: int) -> str:
    """How linalg_cot's answers name a subspace of R^n of this dimension."""
    if dimension == 0:
        return f"only the zero vector in R^{n}"
    if dimension == n:
        return f"all of R^{n}"
    if dimension in (1, 2):
        return f"a {('line', 'plane')[dimension - 1]} in R^{n}"
    return f"a {dimension}-dimensional subspace of R^{n}"


def study_answer(answer: Mapping[str, Any], parsed: linalg_cot.ParsedQuestion) -> str | None:
    """The study's answer to a question (the quiz file's ``answer``) written as linalg_cot's
    canonical final answer of the question's kind, which :func:`linalg_cot.grade` compares
    exactly; None when the answer lacks what that kind's answer writes.

    Example:
      >>> parsed = linalg_cot.parse_question("Find rref(A) for A = [[2, 4], [1, 3]].")
      >>> study_answer({"R": [[1, 0], [0, 1]]}, parsed)
      '[[1, 0], [0, 1]]'
    """
    kind = parsed.kind
    try:
        if kind == "rref":
            return _matrix(answer["R"])
        if kind == "complete_solution":
            return f"R = {_matrix(answer['R'])}; d = {_vector(answer['d'])}"
        if kind == "elimination":
            return (
                f"E^-1 = {_matrix(answer['E_inverse'])}; A = {_matrix(answer['A'])}; "
                f"b = {_vector(answer['b'])}"
            )
        if kind == "nullspace":
            special = answer["special_solutions"]
            listed = ", ".join(f"s{k + 1} = {_vector(s)}" for k, s in enumerate(special))
            words = _subspace_words(len(special), len(parsed.A[0]))
            return f"{listed or 'no special solutions'}; N(A) is {words}"
        if kind == "solvability":
            return "; ".join(answer["choice"]) if "choice" in answer else str(answer["answer"])
        if kind == "column_space":
            if not answer["in_column_space"]:
                return "no"
            return f"yes; x = {_vector(answer['x'])}"
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return None


def _reading(text: str) -> tuple[str | None, str | None, linalg_cot.ParsedQuestion | None]:
    """``(kind, why not asked, parsed)`` of a question: parsed by linalg_cot.parse_question
    (asked), or read by parse_descriptive (not asked: no model here trains a descriptive kind),
    or refused by both (the parser's reason)."""
    try:
        parsed = linalg_cot.parse_question(text)
    except ValueError as err:
        refusal = str(err)
    else:
        return parsed.kind, None, parsed
    try:
        kind = linalg_cot.parse_descriptive(text).kind
    except ValueError:
        return None, f"refused: {refusal}", None
    why = (
        f"not asked: the model is not trained on this kind ({kind}, answered in words; "
        "linalg_cot.parse_descriptive reads it)"
    )
    return kind, why, None


def ask_quiz(solvers: Mapping[str, cot.Solver], path: pathlib.Path | str) -> dict:
    """Each question of the quiz file at ``path`` answered by each of ``solvers`` (one question
    at a time: its time is its own), graded against the study's answer; the JSON-ready record
    that :data:`ANSWERS` saves::

        {"quiz": path, "found": True, "questions": [{"no", "type", "kind", "reference",
         "not_asked", "answers": {model: {"final", "correct", "seconds", "steps", "tokens",
         "finished", "error", "text"}}}, ...]}

    ``kind`` is the question's kind as the parsers read it (None: refused), ``not_asked`` why
    no model was asked (the parser's refusal, or a descriptive kind), ``reference`` the study's
    answer as the kind's canonical answer (:func:`study_answer`), ``error`` why a model did not
    decode it (:class:`sparse_jax.cot.Answer`). A missing file gives ``{"quiz": path, "found":
    False}``; a file that is not a quiz raises ``ValueError``."""
    path = pathlib.Path(path)
    if not path.is_file():
        return {"quiz": str(path), "found": False}
    rows = []
    for entry in read_quiz(path):
        kind, not_asked, parsed = _reading(entry["text"])
        reference = None if parsed is None else study_answer(entry["answer"], parsed)
        if parsed is not None and reference is None:
            not_asked = f"not asked: the quiz gives no {kind} answer to grade against"
        answers = {}
        if not_asked is None:
            for name, solver in solvers.items():
                a = solver.answer(entry["text"])
                answers[name] = {
                    "final": a.final,
                    "correct": a.final is not None and linalg_cot.grade(a.final, reference),
                    "seconds": a.seconds,
                    "steps": len(a.steps),
                    "tokens": a.tokens,
                    "finished": a.finished,
                    "error": a.error,
                    "text": a.text,
                }
        rows.append(
            {
                "no": entry["no"],
                "type": entry.get("type"),
                "kind": kind,
                "reference": reference,
                "not_asked": not_asked,
                "answers": answers,
            }
        )
    return {"quiz": str(path), "found": True, "questions": rows}


def write_answers(folder: pathlib.Path, record: dict) -> pathlib.Path:
    """Saves :func:`ask_quiz`'s record as ``folder``/:data:`ANSWERS`; its path."""
    out = pathlib.Path(folder) / ANSWERS
    write_text_atomically(out, json.dumps(record, indent=2) + "\n")
    return out


def read_answers(folder: pathlib.Path) -> dict | None:
    """The record :func:`write_answers` saved in ``folder`` (None: none saved)."""
    path = pathlib.Path(folder) / ANSWERS
    return json.loads(path.read_text()) if path.is_file() else None


def _right(answer: Mapping[str, Any], reference: str) -> bool:
    """Graded again from the saved final answer: the table never trusts a saved verdict."""
    final = answer.get("final")
    return isinstance(final, str) and linalg_cot.grade(final, reference)


_TEXT = (
    "The GiantRabbit study's exam (its Table 1: the nine questions of the 18.06 quiz of March 1, "
    "2010, as the study entered them; read from {path}, --eval.quiz), each asked of both "
    "models on its own: right when the final answer is the study's (linalg_cot.grade, exact); "
    "time: the decoding's wall time (compilation excluded); steps: the chain of thought's step "
    "lines; tokens: decoded tokens, EOS included. Answers: {answers}."
)


def quiz_lines(record: dict | None, models: tuple[str, ...] = ("sparse", "dense")) -> list[str]:
    """The report's lines on the study's exam from a saved :func:`ask_quiz` record: one line
    when the quiz was not found (or no answers were saved), else the table (per question and
    model: right / wrong / refused, time, steps, tokens), the right answers counted over the
    questions graded, and why each question or answer was not graded. Correctness is graded
    again from each saved final answer and the study's."""
    if record is None:
        return [
            "The GiantRabbit study's exam: no answers saved in this run folder "
            f"({ANSWERS}; python -m experiments.cot quiz --run.dir <run> asks it)."
        ]
    if not record.get("found"):
        where = record["quiz"]
        return [f"The GiantRabbit study's exam was not found at {where} (--eval.quiz): no table."]
    rows = record["questions"]
    header = " | ".join(f"{m} | time ms | steps | tokens" for m in models)
    lines = [
        _TEXT.format(path=record["quiz"], answers=ANSWERS),
        "",
        f"| question | kind | {header} |",
        "|:--|:--|" + ":--|--:|--:|--:|" * len(models),
    ]
    right = dict.fromkeys(models, 0)
    graded = 0
    notes = []
    for row in rows:
        cells = []
        kind = row["kind"] or "-"
        if row["not_asked"] is not None:
            cells = [row["not_asked"].split(":")[0], "-", "-", "-"] * len(models)
            notes.append(f"Question {row['no']}: {row['not_asked']}")
        else:
            graded += 1
            errors: dict[str, list[str]] = {}
            for m in models:
                a = row["answers"].get(m)
                if a is None:
                    cells += ["-", "-", "-", "-"]
                    continue
                if a.get("error") is not None:
                    cells += ["refused", "-", "-", "-"]
                    errors.setdefault(a["error"], []).append(m)
                    continue
                ok = _right(a, row["reference"])
                right[m] += ok
                cells += [
                    "right" if ok else ("wrong" if a.get("final") is not None else "no answer"),
                    f"{1e3 * a['seconds']:.1f}",
                    str(a["steps"]),
                    str(a["tokens"]),
                ]
            for error, names in errors.items():
                notes.append(f"Question {row['no']}, {' and '.join(names)}: refused: {error}")
        lines.append(f"| {row['no']} | {kind} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Right: "
        + ", ".join(f"{m} {right[m]} of {graded}" for m in models)
        + " questions graded (a model's refusal counts as wrong; the others were not asked).",
    ]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return lines
