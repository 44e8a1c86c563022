"""The exam's forms and sizes in the generator (opt-in: GeneratorConfig.exam_rate, latex_rate,
GeneratorConfig.exam()), the descriptive kinds with their graded parts, and the GiantRabbit
exam's own questions (read from the shared data folder at run time, never copied here: CC
BY-NC-SA) kept out of every generated split.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
from fractions import Fraction

import pytest

from sparse_jax.data import linalg_cot as lc

QUIZ = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "giantrabbit-quiz"

# `python -m experiments.cot`'s default data (--data.sizes small, three kinds).
SMALL = lc.GeneratorConfig(
    kinds=("rref", "solvability", "column_space"),
    rref_shape=(2, 3),
    nullspace_shape=(2, 3),
    column_space_shape=(2, 2),
    elimination_shape=(2, 3),
    elimination_ops=2,
    unknowns=2,
    complete_solution_rows=2,
    block_rate=0.0,
    fraction_rate=0.0,
    max_entry=3,
    max_number=9,
    max_steps=6,
)
ALL_KINDS = lc.KINDS + lc.DESCRIPTIVE_KINDS


def _parse(problem: lc.Problem) -> lc.ParsedQuestion:
    if problem.kind in lc.DESCRIPTIVE_KINDS:
        return lc.parse_descriptive(problem.question)
    return lc.parse_question(problem.question)


def _fits(question: str, template: str) -> bool:
    pattern = ".+".join(re.escape(part) for part in re.split(r"\{\w+\}", template))
    return re.fullmatch(pattern, question) is not None


def _fingerprint(splits) -> str:
    text = "\n\n".join(p.text() for split in lc.SPLITS for p in splits[split])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# The default data stay as they were.


def test_the_default_data_are_the_ones_written_before_the_exam_forms():
    # Fingerprints of splits the generator wrote before the exam's forms existed: the new
    # options draw nothing when they are off.
    for config, expected in (
        (lc.GeneratorConfig(), "fdbfd559ff0e942e"),
        (SMALL, "f54059b5513cdda5"),
    ):
        assert _fingerprint(lc.make_splits(30, 12, 12, seed=0, config=config)) == expected
    off = lc.GeneratorConfig(exam_rate=0.0, latex_rate=0.0)
    assert _fingerprint(lc.make_splits(30, 12, 12, seed=0, config=off)) == "fdbfd559ff0e942e"


def test_the_exam_options_are_checked():
    for name in ("exam_rate", "latex_rate"):
        with pytest.raises(ValueError, match=f"`{name}` must be in"):
            lc.GeneratorConfig(**{name: 1.5})
    with pytest.raises(ValueError, match="`kinds` must be"):
        lc.GeneratorConfig(kinds=("explanation",))
    assert lc.GeneratorConfig.exam().rref_shape == (6, 8)


# ------------------------------------------------------------------------------------------
# The exam's forms.


@pytest.mark.parametrize("kind", sorted(lc.EXAM_TEMPLATES))
def test_every_exam_form_is_generated_read_back_and_solved(kind):
    config = lc.GeneratorConfig.exam(kinds=(kind,), exam_rate=1.0, block_rate=1.0, latex_rate=0.0)
    problems = [lc.generate(kind, seed, config) for seed in range(60)]
    used = {t for t in lc.EXAM_TEMPLATES[kind] for p in problems if _fits(p.question, t)}
    assert used == set(lc.EXAM_TEMPLATES[kind])
    for seed, p in enumerate(problems[:20]):
        assert lc.generate(kind, seed, config) == p  # deterministic given the seed
        assert lc.solve(lc.parse_question(p.question)) == p


def test_elimination_in_words_and_from_a_complete_solution():
    config = lc.GeneratorConfig.exam(kinds=("elimination",), exam_rate=1.0, latex_rate=0.0)
    problems = [lc.generate("elimination", seed, config) for seed in range(40)]
    worded = [
        p for p in problems if re.search(r"subtracted (\d+ times |twice )?row \d", p.question)
    ]
    assert worded
    stated = [
        p for p in problems if "complete solution" in p.question or "Every solution" in p.question
    ]
    assert stated
    for p in stated:
        # The chain derives R and d from the complete solution before undoing the steps.
        types = [lc.step_type(s) for s in p.steps]
        assert "free and pivot variables" in types and "d" in types
        assert types.index("d") == types.index("augmented matrix") - 1


def test_block_matrices_up_to_6_by_8_with_their_size_stated():
    config = lc.GeneratorConfig.exam(kinds=("rref",))
    shapes = set()
    for seed in range(400):
        p = lc.generate("rref", seed, config)
        parsed = lc.parse_question(p.question)
        if parsed.block == ((1, 1), (1, 1)):
            shape = (2 * len(parsed.A), 2 * len(parsed.A[0]))
            shapes.add(shape)
            stated = re.search(r"the (\d+) by (\d+) (?:block )?matrix", p.question)
            if stated:
                assert (int(stated.group(1)), int(stated.group(2))) == shape
    assert (6, 8) in shapes
    assert max(r for r, _ in shapes) <= 6 and max(c for _, c in shapes) <= 8


def test_multiple_choices_on_m_by_n_matrices_answer_with_the_chosen_words():
    config = lc.GeneratorConfig.exam(kinds=("solvability",), exam_rate=1.0, latex_rate=0.0)
    for seed in range(30):
        p = lc.generate("solvability", seed, config)
        parsed = lc.parse_question(p.question)
        assert parsed.choices and parsed.solutions is None
        assert re.search(r"\d+x\d+ matrix|\d+ by \d+", p.question)
        assert (p.answer,) == lc.choice_answers(parsed)


def test_a_multiple_choice_with_several_or_no_true_options_says_so():
    both = lc.parse_question(
        "A is 2 by 4 with rank 2. Ax = b has (exactly one solution / infinitely many "
        "solutions) (always / never)."
    )
    assert lc.solve(both).answer == (
        "exactly one solution; never or infinitely many solutions; always"
    )
    none = lc.parse_question(
        "A is 2 by 4 with rank 2. Ax = b (always / sometimes) has (exactly one solution / no "
        "solution)."
    )
    assert lc.solve(none).answer == "none of the options"
    bad = lc.ParsedQuestion(
        "solvability", "q", rows=2, cols=4, rank=2, choices=(("always", "never"), ("maybe",))
    )
    with pytest.raises(ValueError, match="`choices` must be two groups"):
        lc.solve(bad)


@pytest.mark.parametrize("kind", lc.KINDS)
def test_latex_questions_read_as_their_values(kind):
    config = lc.GeneratorConfig.exam(kinds=(kind,), latex_rate=1.0)
    for seed in range(12):
        p = lc.generate(kind, seed, config)
        if kind != "solvability":
            assert "\\begin{bmatrix}" in p.question or "]^T" in p.question, p.question
        assert lc.solve(lc.parse_question(p.question)) == p


def test_every_question_of_exam_splits_reads_back_as_generated():
    config = lc.GeneratorConfig.exam(kinds=ALL_KINDS)
    splits = lc.make_splits(480, 40, 40, seed=3, config=config)
    for split in lc.SPLITS:
        for problem in splits[split]:
            assert lc.solve(_parse(problem)) == problem, problem.question


# ------------------------------------------------------------------------------------------
# The descriptive kinds.


@pytest.mark.parametrize("kind", lc.DESCRIPTIVE_KINDS)
def test_descriptive_kinds_are_generated_read_back_and_graded_by_parts(kind):
    config = lc.GeneratorConfig.exam(kinds=(kind,))
    problems = [lc.generate(kind, seed, config) for seed in range(30)]
    used = {t for t in lc.TEMPLATES[kind] for p in problems if _fits(p.question, t)}
    assert used == set(lc.TEMPLATES[kind])
    for p in problems:
        assert lc.solve(lc.parse_descriptive(p.question)) == p
        assert all(lc.step_type(s) != "other" for s in p.steps)
        parts = lc.grade_parts(p.answer, p.answer)
        assert parts and all(parts.values())
    splits = lc.make_splits(12, 6, 6, config=config)
    assert set(lc.distinct_questions(splits["train"])) == {kind}


def test_column_space_answer_parts_by_hand():
    q = lc.parse_descriptive("Describe the column space of A = [[1, 2, 3], [2, 4, 7], [0, 0, 1]].")
    answer = lc.solve(q).answer
    assert answer == "rank 2; C(A) is a plane in R^3; basis [1, 2, 0], [3, 7, 1]"
    assert lc.answer_parts(answer) == {
        "rank": "2",
        "C(A) dimension": "2",
        "C(A) space": "R^3",
        "basis": "[1, 2, 0], [3, 7, 1]",
    }
    # Another basis of the same plane is right; a vector outside it, or one too few, is not.
    assert lc.grade_parts("rank 2; C(A) is a plane in R^3; basis [4, 9, 1], [1, 2, 0]", answer)[
        "basis"
    ]
    wrong = lc.grade_parts("rank 3; C(A) is all of R^3; basis [1, 0, 0], [3, 7, 1]", answer)
    assert wrong == {"rank": False, "C(A) dimension": False, "C(A) space": True, "basis": False}
    assert not lc.grade_parts("basis [1, 2, 0]", answer)["basis"]
    assert lc.grade_parts("", answer) == dict.fromkeys(wrong, False)
    with pytest.raises(ValueError, match="has no parts"):
        lc.grade_parts("yes", "no")


def test_subspace_answer_parts_by_hand():
    q = lc.parse_descriptive("A is a 4 by 6 matrix of rank 3. Describe C(A) and N(A).")
    assert (
        lc.solve(q).answer
        == "C(A) is a 3-dimensional subspace of R^4; N(A) is a 3-dimensional subspace of R^6"
    )
    parts = lc.answer_parts("C(A) is all of R^2; N(A) is only the zero vector in R^2")
    assert parts == {
        "C(A) dimension": "2",
        "C(A) space": "R^2",
        "N(A) dimension": "0",
        "N(A) space": "R^2",
    }


def test_parse_descriptive_refuses_what_it_does_not_read():
    for text, reason in (
        ("Explain in words how the solutions of Ax = b decide if b is in C(A).", "same sentence"),
        ("Find rref(A) for A = [[1, 2], [3, 4]].", "neither the column space nor"),
        ("Is b = [1, 2] in the column space of A = [[1, 2], [3, 4]]?", "gives a vector"),
        ("What is the column space of A?", "could not find a matrix A"),
    ):
        with pytest.raises(ValueError, match=reason):
            lc.parse_descriptive(text)


# ------------------------------------------------------------------------------------------
# Questions kept out of the splits.


def test_excluded_content_never_enters_a_split(tmp_path):
    config = lc.GeneratorConfig(kinds=("subspaces",), solvability_dim=5)
    exam = lc.ParsedQuestion("subspaces", "an exam's question", rows=3, cols=5, rank=3)

    def triples(splits):
        return {(q.rows, q.cols, q.rank) for s in lc.SPLITS for q in map(_parse, splits[s])}

    assert (3, 5, 3) in triples(lc.make_splits(300, 10, 10, config=config))
    assert (3, 5, 3) not in triples(lc.make_splits(300, 10, 10, config=config, exclude=[exam]))
    with pytest.raises(TypeError, match="exclude"):
        lc.make_splits(3, 3, 3, exclude=["a question"])
    with pytest.raises(TypeError, match="exclude"):
        lc.prepare(tmp_path, train=3, validation=3, test=3, exclude=["a question"])
    assert not any(tmp_path.iterdir())  # refused before anything is written


# The quiz's questions, read at run time.


@pytest.fixture(scope="module")
def quiz() -> dict[int, dict]:
    path = QUIZ / "quiz.json"
    if not path.is_file():
        pytest.skip(f"the GiantRabbit quiz is not at {path} (shared data, never in the repository)")
    return {q["no"]: q for q in json.loads(path.read_text())["questions"]}


def _values(q: lc.ParsedQuestion) -> dict[str, str]:
    """What a question gives, normalized (the phrasing aside): its matrices and vectors
    written canonically, its sizes and rank, its steps, its choices."""
    out = {}
    for name in ("A", "R", "block"):
        if getattr(q, name) is not None:
            out[name] = lc.format_matrix(getattr(q, name))
    for name in ("b", "d", "x_p"):
        if getattr(q, name) is not None:
            out[name] = lc.format_vector(getattr(q, name))
    if q.special:
        out["special"] = " ".join(lc.format_vector(s) for s in q.special)
    for name in ("rows", "cols", "rank", "solutions"):
        if getattr(q, name) is not None:
            out[name] = str(getattr(q, name))
    if q.operations:
        out["operations"] = "; ".join(op.text() for op in q.operations)
    return out


def _quiz_questions(quiz) -> list[lc.ParsedQuestion]:
    read = []
    for entry in quiz.values():
        for parse in (lc.parse_question, lc.parse_descriptive):
            try:
                read.append(parse(entry["text"]))
                break
            except ValueError:
                continue
    return read


def test_no_quiz_question_is_in_any_split(quiz):
    exam = _quiz_questions(quiz)
    assert len(exam) == 8  # all but the explanation in words
    matrices = {_values(q).get("A") for q in exam} - {None}
    solutions = {(_values(q)["x_p"], _values(q).get("special")) for q in exam if q.x_p}
    exam_sizes = {(q.rows, q.cols, q.rank) for q in exam if q.cols is not None}
    configs = (
        (SMALL, 3000, 48, 150, ()),
        (lc.GeneratorConfig(), 600, 60, 60, ()),
        (lc.GeneratorConfig.exam(kinds=ALL_KINDS), 1600, 80, 80, exam),
    )
    for config, train, validation, test, exclude in configs:
        splits = lc.make_splits(train, validation, test, config=config, exclude=exclude)
        for split in lc.SPLITS:
            for problem in splits[split]:
                values = _values(_parse(problem))
                for q in exam:  # the question itself, whatever its phrasing
                    assert not (q.kind == problem.kind and _values(q) == values), problem.question
                if exclude:  # nor its matrix, its complete solution, its m, n and rank
                    assert values.get("A") not in matrices, problem.question
                    solution = (values.get("x_p"), values.get("special"))
                    assert solution not in solutions, problem.question
                    size = tuple(
                        int(values[k]) if k in values else None for k in ("rows", "cols", "rank")
                    )
                    assert size not in exam_sizes, problem.question


def test_the_check_finds_a_quiz_question_in_other_words(quiz):
    # A quiz question rewritten in a generator phrasing has the same values: the test above
    # would see it.
    q9 = lc.parse_question(quiz[9]["text"])
    rewritten = lc.TEMPLATES["column_space"][2].format(
        A=lc.format_matrix(q9.A), b=lc.format_vector(q9.b)
    )
    assert _values(lc.parse_question(rewritten)) == _values(q9)


def test_the_quiz_in_the_exam_forms(quiz):
    # Question 2: the chain derives R and d from question 1's complete solution first.
    steps = lc.solve(lc.parse_question(quiz[2]["text"])).steps
    types = [lc.step_type(s) for s in steps]
    assert types[:2] == ["free and pivot variables", "pivot row"]
    assert types.index("d") == types.index("augmented matrix") - 1
    # Question 6: the chosen words, as the study gives them.
    assert lc.solve(lc.parse_question(quiz[6]["text"])).answer == "; ".join(
        quiz[6]["answer"]["choice"]
    )
    # Questions 4 and 7: the parts the study's reference names.
    four = lc.answer_parts(lc.solve(lc.parse_descriptive(quiz[4]["text"])).answer)
    reference = quiz[4]["answer"]["text"]
    assert f"rank {four['rank']}" in reference and four["C(A) space"] in reference
    basis = [
        tuple(Fraction(x) for x in v.split(",")) for v in re.findall(r"\[([^\]]*)\]", reference)
    ]
    written = ", ".join(lc.format_vector(v) for v in basis)
    assert lc.grade_parts(f"basis {written}", f"basis {four['basis']}")["basis"]
    seven = lc.answer_parts(lc.solve(lc.parse_descriptive(quiz[7]["text"])).answer)
    reference = quiz[7]["answer"]["text"]
    assert f"all of {seven['C(A) space']}" in reference
    assert f"{seven['N(A) dimension']}-dimensional subspace of {seven['N(A) space']}" in reference
    # Question 8: refused, with the reason.
    with pytest.raises(ValueError, match="same sentence for every A and b"):
        lc.parse_descriptive(quiz[8]["text"])


def test_the_quiz_fits_the_exam_sizes_and_bounds(quiz):
    cfg = lc.GeneratorConfig.exam()
    for q in _quiz_questions(quiz):
        if q.kind in ("rref", "nullspace", "column_space", "column_space_basis"):
            rows, cols = len(q.A), len(q.A[0])
            if q.block is not None:
                rows, cols = rows * len(q.block), cols * len(q.block[0])
            shape = cfg.nullspace_shape if q.kind == "column_space_basis" else None
            limit = shape or getattr(cfg, f"{q.kind}_shape")
            assert rows <= limit[0] and cols <= limit[1], q.question
        elif q.kind == "elimination":
            assert len(q.R) <= cfg.elimination_shape[0] and len(q.R[0]) <= cfg.elimination_shape[1]
            assert len(q.operations) <= cfg.elimination_ops
        elif q.kind == "complete_solution":
            assert len(q.x_p) == cfg.unknowns and q.rows <= cfg.complete_solution_rows
        else:
            assert max(q.rows, q.cols) <= cfg.solvability_dim
        given = [x for m in (q.A, q.R) if m for row in m for x in row] + list(q.b or ())
        assert all(abs(x) <= cfg.max_entry for x in given), q.question
        problem = lc.solve(q)
        assert len(problem.steps) <= cfg.max_steps
        numbers = re.findall(r"\d+", " ".join(problem.steps) + problem.answer)
        assert max(int(x) for x in numbers) <= cfg.max_number
    # Its complete solution's special solutions are drawn at these bounds: free entries of R
    # (their negatives) up to free_entry.
    q1 = lc.parse_question(quiz[1]["text"])
    assert max(abs(x) for s in q1.special for x in s) <= cfg.free_entry
    assert lc.GeneratorConfig().free_entry < max(abs(x) for s in q1.special for x in s)
