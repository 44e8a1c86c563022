"""The GiantRabbit study's exam (its Table 1: the nine questions of the 18.06 quiz of March 1,
2010, as the study entered them) asked of a run folder's trained models: :func:`ask_quiz` answers
each question with each model and grades its final answer against the study's, the answers are
saved in ``<run>/quiz-answers.json`` (:data:`ANSWERS`), and :func:`quiz_lines` makes the report's
table from them, per question right or not, reasoning time, chain steps and tokens, sparse beside
dense (the study's Figure 3); :func:`seeds_quiz_lines` pools the answers of several seeds' runs.

A question answered in words (``linalg_cot.DESCRIPTIVE_KINDS``: the column space of a given
matrix, the column space and nullspace of an m by n matrix of rank r) is asked of a model trained
on its kind and graded by parts (:func:`sparse_jax.data.linalg_cot.grade_parts`: rank,
dimensions, spaces, basis) against the answer :func:`sparse_jax.data.linalg_cot.solve` writes
for the question's own matrix (or size and rank), as :func:`sparse_jax.cot.evaluate` grades the
generated ones; the quiz's answer in words is its reference description, not parsed.

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

from sparse_jax import cot
from sparse_jax.data import linalg_cot
from sparse_jax.files import write_text_atomically

__all__ = [
    "ANSWERS",
    "DEFAULT_QUIZ",
    "ask_quiz",
    "quiz_lines",
    "quiz_path",
    "read_answers",
    "read_quiz",
    "seeds_quiz_lines",
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
    exactly; None when the answer lacks what that kind's answer writes. A question answered in
    words (``linalg_cot.DESCRIPTIVE_KINDS``, read by ``parse_descriptive``) has no exact answer
    in the quiz, only a description: its reference is the answer ``linalg_cot.solve`` writes for
    the question's own matrix (or size and rank), whose parts :func:`linalg_cot.grade_parts`
    grades, as the generated questions of that kind are graded.

    Example:
      >>> parsed = linalg_cot.parse_question("Find rref(A) for A = [[2, 4], [1, 3]].")
      >>> study_answer({"R": [[1, 0], [0, 1]]}, parsed)
      '[[1, 0], [0, 1]]'
      >>> words = linalg_cot.parse_descriptive("A is a 3 by 5 matrix of rank 3. Describe N(A).")
      >>> study_answer({"text": "a plane in R^5"}, words)
      'C(A) is all of R^3; N(A) is a plane in R^5'
    """
    kind = parsed.kind
    if kind in linalg_cot.DESCRIPTIVE_KINDS:
        return linalg_cot.solve(parsed).answer
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


def _reading(
    text: str, words: frozenset[str] = frozenset()
) -> tuple[str | None, str | None, linalg_cot.ParsedQuestion | None]:
    """``(kind, why not asked, parsed)`` of a question: parsed by linalg_cot.parse_question
    (asked), or read by parse_descriptive (asked when its kind is one of ``words``, the kinds
    answered in words that a model here was trained on; else not asked), or refused by both
    (the parser's reason)."""
    try:
        parsed = linalg_cot.parse_question(text)
    except ValueError as err:
        refusal = str(err)
    else:
        return parsed.kind, None, parsed
    try:
        parsed = linalg_cot.parse_descriptive(text)
    except ValueError:
        return None, f"refused: {refusal}", None
    if parsed.kind in words:
        return parsed.kind, None, parsed
    trained = f"; the models here were trained on {', '.join(sorted(words))}" if words else ""
    why = (
        f"not asked: the model is not trained on this kind ({parsed.kind}, answered in words; "
        f"linalg_cot.parse_descriptive reads it{trained})"
    )
    return parsed.kind, why, None


def _grade(
    final: str | None, reference: str, kind: str | None
) -> tuple[bool, dict[str, bool] | None]:
    """``(right, parts)`` of a final answer against the reference, as sparse_jax.cot.evaluate
    grades: a kind answered in words by parts (linalg_cot.grade_parts; right when every part
    is, every part wrong when there is no final answer), any other whole (linalg_cot.grade;
    ``parts`` None)."""
    if kind in linalg_cot.DESCRIPTIVE_KINDS:
        parts = linalg_cot.grade_parts(final if isinstance(final, str) else "", reference)
        if not isinstance(final, str):
            parts = dict.fromkeys(parts, False)
        return isinstance(final, str) and all(parts.values()), parts
    return isinstance(final, str) and linalg_cot.grade(final, reference), None


def ask_quiz(solvers: Mapping[str, cot.Solver], path: pathlib.Path | str) -> dict:
    """Each question of the quiz file at ``path`` answered by each of ``solvers`` (one question
    at a time: its time is its own), graded against the study's answer; the JSON-ready record
    that :data:`ANSWERS` saves::

        {"quiz": path, "found": True, "questions": [{"no", "type", "kind", "reference",
         "not_asked", "answers": {model: {"final", "correct", "parts", "seconds", "steps",
         "tokens", "finished", "error", "text"}}}, ...]}

    ``kind`` is the question's kind as the parsers read it (None: refused), ``not_asked`` why
    no model was asked (the parser's refusal, or a kind answered in words that no model of
    ``solvers`` was trained on: ``Solver.kinds``), ``reference`` the study's answer as the
    kind's canonical answer (:func:`study_answer`), ``parts`` the verdict per part of an answer
    in words (linalg_cot.grade_parts; None for the others), ``error`` why a model did not
    decode it (:class:`sparse_jax.cot.Answer`). A missing file gives ``{"quiz": path, "found":
    False}``; a file that is not a quiz raises ``ValueError``."""
    path = pathlib.Path(path)
    if not path.is_file():
        return {"quiz": str(path), "found": False}
    words = frozenset(
        k for s in solvers.values() for k in (s.kinds or ()) if k in linalg_cot.DESCRIPTIVE_KINDS
    )
    rows = []
    for entry in read_quiz(path):
        kind, not_asked, parsed = _reading(entry["text"], words)
        reference = None if parsed is None else study_answer(entry["answer"], parsed)
        if parsed is not None and reference is None:
            not_asked = f"not asked: the quiz gives no {kind} answer to grade against"
        answers = {}
        if not_asked is None:
            for name, solver in solvers.items():
                a = solver.answer(entry["text"])
                correct, parts = _grade(a.final, reference, kind)
                answers[name] = {
                    "final": a.final,
                    "correct": correct,
                    "parts": parts,
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


_TEXT = (
    "The GiantRabbit study's exam (its Table 1: the nine questions of the 18.06 quiz of March 1, "
    "2010, as the study entered them; read from {path}, --eval.quiz), each asked of {asked} on "
    "its own: right when the final answer is the study's (linalg_cot.grade, exact; a question "
    "answered in words, asked of a model trained on its kind: when every part is right, "
    "linalg_cot.grade_parts against the answer linalg_cot.solve writes for the question's own "
    "matrix or size and rank); time: the decoding's wall time (compilation excluded); steps: "
    "the chain of thought's step lines; tokens: decoded tokens, EOS included. Answers: "
    "{answers}."
)


def _header(models: tuple[str, ...], right: str = "") -> list[str]:
    header = " | ".join(f"{m}{right} | time ms | steps | tokens" for m in models)
    return [f"| question | kind | {header} |", "|:--|:--|" + ":--|--:|--:|--:|" * len(models)]


def _parts_words(parts: Mapping[str, bool]) -> str:
    """``right: rank, C(A) space; wrong: basis`` (a verdict per part, in the reference's order)."""
    said = [
        f"{verdict}: {', '.join(p for p, ok in parts.items() if ok is want)}"
        for verdict, want in (("right", True), ("wrong", False))
        if any(ok is want for ok in parts.values())
    ]
    return "; ".join(said)


def _missing_lines(record: dict | None, where: str = f"this run folder ({ANSWERS}") -> list[str]:
    """The one line of a run without saved answers, or of a quiz that was not found."""
    if record is None:
        return [
            f"The GiantRabbit study's exam: no answers saved in {where}; python -m "
            "experiments.cot quiz --run.dir <run> asks it)."
        ]
    return [
        f"The GiantRabbit study's exam was not found at {record['quiz']} (--eval.quiz): no table."
    ]


def quiz_lines(record: dict | None, models: tuple[str, ...] = ("sparse", "dense")) -> list[str]:
    """The report's lines on the study's exam from a saved :func:`ask_quiz` record: one line
    when the quiz was not found (or no answers were saved), else the table (per question and
    model: right / wrong / refused, time, steps, tokens), the right answers counted over the
    questions graded, and why each question or answer was not graded (an answer in words: its
    verdict per part). Correctness is graded again from each saved final answer and the
    study's (the table never trusts a saved verdict)."""
    if record is None or not record.get("found"):
        return _missing_lines(record)
    lines = [
        _TEXT.format(path=record["quiz"], asked="both models", answers=ANSWERS),
        "",
        *_header(models),
    ]
    right = dict.fromkeys(models, 0)
    graded = 0
    notes = []
    for row in record["questions"]:
        cells = []
        kind = row["kind"] or "-"
        if row["not_asked"] is not None:
            cells = [row["not_asked"].split(":")[0], "-", "-", "-"] * len(models)
            notes.append(f"Question {row['no']}: {row['not_asked']}")
        else:
            graded += 1
            errors: dict[str, list[str]] = {}
            by_parts = []
            for m in models:
                a = row["answers"].get(m)
                if a is None:
                    cells += ["-", "-", "-", "-"]
                    continue
                if a.get("error") is not None:
                    cells += ["refused", "-", "-", "-"]
                    errors.setdefault(a["error"], []).append(m)
                    continue
                ok, parts = _grade(a.get("final"), row["reference"], row["kind"])
                right[m] += ok
                cells += [
                    "right" if ok else ("wrong" if a.get("final") is not None else "no answer"),
                    f"{1e3 * a['seconds']:.1f}",
                    str(a["steps"]),
                    str(a["tokens"]),
                ]
                if parts is not None and a.get("final") is not None:
                    by_parts.append(f"{m} {_parts_words(parts)}")
            if by_parts:
                notes.append(
                    f"Question {row['no']} ({kind}), graded by parts against "
                    f"`{row['reference']}`: " + "; ".join(by_parts)
                )
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


def _mean(values: list[float], digits: int = 1) -> str:
    return f"{sum(values) / len(values):.{digits}f}"


def seeds_quiz_lines(
    records: Mapping[int, dict | None], models: tuple[str, ...] = ("sparse", "dense")
) -> list[str]:
    """The seeds report's lines on the study's exam, pooled over the seeds' runs from the
    :func:`ask_quiz` record each saved (``records``: seed -> record, None where none was
    saved): one line when none was saved or the quiz was not found, else the table (per
    question and model: the seeds whose answer is right of those asked, with how many refused,
    and the mean time, steps and tokens of the answers decoded), the right answers of each seed
    and why a question or answer was not graded. Graded again from the saved final answers.

    Example (two seeds of one model, its answer right at seed 0 and wrong at seed 1):
      >>> def answer(final):
      ...     return {"final": final, "seconds": 0.01, "steps": 2, "tokens": 30, "error": None}
      >>> def record(final):
      ...     row = {"no": 1, "kind": "rref", "reference": "[[1, 0], [0, 1]]", "not_asked": None,
      ...            "answers": {"dense": answer(final)}}
      ...     return {"quiz": "quiz.json", "found": True, "questions": [row]}
      >>> lines = seeds_quiz_lines({0: record("[[1, 0], [0, 1]]"), 1: record("[[1]]")}, ("dense",))
      >>> for line in (lines[4], lines[-1]):
      ...     print(line)
      | 1 | rref | 1 of 2 | 10.0 | 2.0 | 30.0 |
      Right per seed, of 1 questions graded: seed 0: dense 1; seed 1: dense 0; mean dense 0.5.
    """
    saved = {seed: r for seed, r in records.items() if r is not None}
    if not saved:
        return _missing_lines(None, f"the seeds' run folders (seed-<s>/{ANSWERS}")
    lost = next((r for r in saved.values() if not r.get("found")), None)
    if lost is not None:
        return _missing_lines(lost)
    seeds = list(saved)
    first = saved[seeds[0]]
    text = _TEXT.format(
        path=first["quiz"],
        asked=f"both models of each seed's run ({', '.join(map(str, seeds))})",
        answers=f"seed-<s>/{ANSWERS}",
    )
    lines = [
        text + " Per model: the seeds whose answer is right, of those asked; the mean time, "
        "steps and tokens of the answers decoded.",
        "",
        *_header(models, " right"),
    ]
    right = {seed: dict.fromkeys(models, 0) for seed in seeds}
    graded = 0
    notes = []
    for row in first["questions"]:
        no, kind = row["no"], row["kind"] or "-"
        same = {
            seed: next((q for q in r["questions"] if q["no"] == no), None)
            for seed, r in saved.items()
        }
        if row["not_asked"] is not None:
            lines.append(
                f"| {no} | {kind} | "
                + " | ".join([row["not_asked"].split(":")[0], "-", "-", "-"] * len(models))
                + " |"
            )
            notes.append(f"Question {no}: {row['not_asked']}")
            continue
        graded += 1
        cells = []
        for m in models:
            asked = [
                (seed, q, q["answers"][m])
                for seed, q in same.items()
                if q is not None and q["not_asked"] is None and m in q["answers"]
            ]
            decoded = [(seed, q, a) for seed, q, a in asked if a.get("error") is None]
            errors: dict[str, list[str]] = {}
            for seed, _, a in asked:
                if a.get("error") is not None:
                    errors.setdefault(a["error"], []).append(str(seed))
            for error, which in errors.items():
                notes.append(f"Question {no}, {m} (seeds {', '.join(which)}): refused: {error}")
            if not decoded:
                cells += ["refused" if asked else "-", "-", "-", "-"]
                continue
            for seed, q, a in decoded:
                right[seed][m] += _grade(a.get("final"), q["reference"], q["kind"])[0]
            ok = sum(_grade(a.get("final"), q["reference"], q["kind"])[0] for _, q, a in decoded)
            refused = len(asked) - len(decoded)
            cells += [
                f"{ok} of {len(asked)}" + (f" ({refused} refused)" if refused else ""),
                _mean([1e3 * a["seconds"] for *_, a in decoded]),
                _mean([a["steps"] for *_, a in decoded]),
                _mean([a["tokens"] for *_, a in decoded]),
            ]
        lines.append(f"| {no} | {kind} | " + " | ".join(cells) + " |")
    per_seed = "; ".join(
        f"seed {seed}: " + ", ".join(f"{m} {right[seed][m]}" for m in models) for seed in seeds
    )
    means = ", ".join(f"{m} {_mean([right[s][m] for s in seeds])}" for m in models)
    lines += ["", f"Right per seed, of {graded} questions graded: {per_seed}; mean {means}."]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return lines
