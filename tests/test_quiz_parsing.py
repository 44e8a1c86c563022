"""Questions as people write them: the GiantRabbit study's nine exam questions, read from the
shared data folder at run time (they are CC BY-NC-SA: never copied here), and paraphrases of
each form they use (LaTeX matrices with and without commas, ``$...$``, ``^T``, ``c_1``, block
matrices, multiple choice, elimination in words) in this file's own words.
"""

from __future__ import annotations

import json
import pathlib
import re
from fractions import Fraction

import pytest

from sparse_jax.data import linalg_cot as lc
from sparse_jax.data.linalg_cot.parsing import choice_answers

QUIZ = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "giantrabbit-quiz"


def _matrix(rows) -> tuple[tuple[Fraction, ...], ...]:
    return tuple(tuple(Fraction(str(x)) for x in row) for row in rows)


def _vector(values) -> tuple[Fraction, ...]:
    return tuple(Fraction(str(x)) for x in values)


# ------------------------------------------------------------------------------------------
# The nine questions of the study.


@pytest.fixture(scope="module")
def quiz() -> dict[int, dict]:
    path = QUIZ / "quiz.json"
    if not path.is_file():
        pytest.skip(f"the GiantRabbit quiz is not at {path} (shared data, never in the repository)")
    return {q["no"]: q for q in json.loads(path.read_text())["questions"]}


# What each question parses to, or the words of its refusal.
KIND_OF = {
    1: "complete_solution",
    2: "elimination",
    3: "nullspace",
    5: "rref",
    6: "solvability",
    9: "column_space",
}
REFUSED = {
    4: "asks to describe the column space",
    7: "asks to describe the column space",
    8: "asks for an explanation in words",
}


def test_the_quiz_holds_nine_questions(quiz):
    assert sorted(quiz) == list(range(1, 10))
    assert sorted([*KIND_OF, *REFUSED]) == list(range(1, 10))


@pytest.mark.parametrize("no", sorted(KIND_OF))
def test_each_computable_question_parses_to_its_kind_and_solves_to_the_study_answer(quiz, no):
    entry = quiz[no]
    parsed = lc.parse_question(entry["text"])
    assert parsed.kind == KIND_OF[no]
    assert parsed.question == entry["text"].strip()
    expected = entry["answer"]
    if no == 1:
        assert (parsed.rows, len(parsed.x_p), len(parsed.special)) == (3, 3, 2)
        answer = f"R = {lc.format_matrix(_matrix(expected['R']))}; d = "
        assert lc.solve(parsed).answer == answer + lc.format_vector(_vector(expected["d"]))
    elif no == 2:
        # R and d come from the context's complete solution (question 1's answer).
        first = quiz[1]["answer"]
        assert (parsed.R, parsed.d) == (_matrix(first["R"]), _vector(first["d"]))
        # Its steps each subtract a multiple of row 1: E^-1 holds the multiples below its 1.
        multiples = [row[0] for row in expected["E_inverse"][1:]]
        steps = [f"R{i + 2} = R{i + 2} - {k}*R1" for i, k in enumerate(multiples) if k]
        assert len(steps) == 2 and [op.text() for op in parsed.operations] == steps
        answer = lc.solve(parsed).answer
        assert answer == (
            f"E^-1 = {lc.format_matrix(_matrix(expected['E_inverse']))}; "
            f"A = {lc.format_matrix(_matrix(expected['A']))}; "
            f"b = {lc.format_vector(_vector(expected['b']))}"
        )
    elif no == 3:
        assert (len(parsed.A), len(parsed.A[0])) == (3, 4)
        special = ", ".join(
            f"s{k + 1} = {lc.format_vector(_vector(s))}"
            for k, s in enumerate(expected["special_solutions"])
        )
        assert lc.solve(parsed).answer == f"{special}; N(A) is a plane in R^4"
    elif no == 5:
        assert parsed.A == lc.parse_question(quiz[3]["text"]).A  # "the same A"
        assert parsed.block == ((1, 1), (1, 1))
        assert lc.solve(parsed).answer == lc.format_matrix(_matrix(expected["R"]))
    elif no == 6:
        assert (parsed.rows, parsed.cols, parsed.rank, parsed.solutions) == (3, 5, 3, None)
        assert [len(group) for group in parsed.choices] == [2, 3]
        assert choice_answers(parsed) == ("; ".join(expected["choice"]),)
        assert lc.grade("; ".join(expected["choice"]), choice_answers(parsed)[0])
    else:
        assert (len(parsed.A), len(parsed.A[0]), len(parsed.b)) == (3, 2, 3)
        assert expected["in_column_space"]
        answer = "yes; x = " + lc.format_vector(_vector(expected["x"]))
        assert lc.solve(parsed).answer == answer


@pytest.mark.parametrize("no", sorted(REFUSED))
def test_each_descriptive_question_is_refused_with_the_reason(quiz, no):
    assert quiz[no]["type"] == "descriptive"
    refusal = "could not parse the question: the question " + REFUSED[no]
    with pytest.raises(ValueError, match=refusal):
        lc.parse_question(quiz[no]["text"])


def test_a_question_of_the_quiz_alone_parses_as_with_its_context(quiz):
    # The context of questions 3, 4 and 5 alone names no question.
    with pytest.raises(ValueError, match="could not tell what the question asks"):
        lc.parse_question(quiz[3]["context"])
    # Question 2 without its context has no R and d to start from.
    with pytest.raises(ValueError, match="could not find the matrix R"):
        lc.parse_question(quiz[2]["question"])


# ------------------------------------------------------------------------------------------
# Paraphrases of each form, in this file's words.

A_COMMAS = r"\begin{bmatrix} 2, & 4, & 1, \\ 1, & 2, & 3 \end{bmatrix}"
A_PLAIN = r"\begin{bmatrix} 2 & 4 & 1 \\ 1 & 2 & 3 \end{bmatrix}"
A_VALUE = _matrix([[2, 4, 1], [1, 2, 3]])

PARAPHRASES = [
    # (question, kind, the fields its parse must hold)
    (rf"Let $M = {A_COMMAS}$. Compute $\text{{rref}}(M)$.", "rref", {"A": A_VALUE}),
    (rf"Bring $M = {A_PLAIN}$ to reduced row echelon form.", "rref", {"A": A_VALUE}),
    (
        r"Row reduce the matrix \begin{pmatrix} 1 & 3 \\ 2 & 7 \\ \end{pmatrix} completely.",
        "rref",
        {"A": _matrix([[1, 3], [2, 7]])},
    ),
    (
        r"Row reduce $\left[\begin{array}{cc} 1 & 2 \\ 3 & 4 \end{array}\right]$.",
        "rref",
        {"A": _matrix([[1, 2], [3, 4]])},
    ),
    (
        r"Reduce $A = \begin{bmatrix} \frac{1}{2} & 1 \\ -\frac{3}{4} & 0 \end{bmatrix}$ to rref.",
        "rref",
        {"A": _matrix([["1/2", 1], ["-3/4", 0]])},
    ),
    (
        "Find the reduced echelon form of $A = [[1, 2, 3], [4, 5, 6]]^T$.",
        "rref",
        {"A": _matrix([[1, 4], [2, 5], [3, 6]])},
    ),
    (
        r"Take $A = \begin{bmatrix} 1 & 2 \\ 2 & 4 \end{bmatrix}$ and the 4 by 4 block matrix "
        r"$C = \begin{bmatrix} A & 0 \\ 0 & 2A \end{bmatrix}$. What is $\text{rref}(C)$?",
        "rref",
        {"A": _matrix([[1, 2], [2, 4]]), "block": _matrix([[1, 0], [0, 2]])},
    ),
    (
        r"With $A = \begin{bmatrix} 1, & 0, & -1 \\ 0, & 1, & 2 \end{bmatrix}$, list every "
        r"special solution of $Ax=0$ and say in words what $N(A)$ is.",
        "nullspace",
        {"A": _matrix([[1, 0, -1], [0, 1, 2]])},
    ),
    (
        r"With $A = \begin{bmatrix} 1 & 0 \\ 0 & 1 \\ 1 & 1 \end{bmatrix}$, does "
        r"$b = \begin{bmatrix} 2 \\ 3 \\ 5 \end{bmatrix}$ lie in the column space of A?",
        "column_space",
        {"A": _matrix([[1, 0], [0, 1], [1, 1]]), "b": _vector([2, 3, 5])},
    ),
    (
        r"Does $b = [1, 1, 0]^T$ belong to the column space of "
        r"$A = \begin{bmatrix}1 & 1\\ 0 & 1\\ 0 & 0\end{bmatrix}$?",
        "column_space",
        {"A": _matrix([[1, 1], [0, 1], [0, 0]]), "b": _vector([1, 1, 0])},
    ),
    (
        r"\begin{equation*} A = \begin{bmatrix} 1 & 1 \\ 0 & 2 \end{bmatrix}, \quad "
        r"b = [3, 4]^{T} \end{equation*} Is b in the column space of A?",
        "column_space",
        {"A": _matrix([[1, 1], [0, 2]]), "b": _vector([3, 4])},
    ),
    (
        r"Is $b = \begin{bmatrix} 4 & 6 \end{bmatrix}^\top$ in C(A) for $A = [[2, 0], [0, 3]]$?",
        "column_space",
        {"A": _matrix([[2, 0], [0, 3]]), "b": _vector([4, 6])},
    ),
    (
        r"All solutions of $Ax = b$ read $x = [1, 0, 2]^T + c_{1} \cdot [3, 1, 0]^T$ for a "
        r"2 by 3 matrix A. Give R and d in $Rx = d$.",
        "complete_solution",
        {"x_p": _vector([1, 0, 2]), "special": (_vector([3, 1, 0]),), "rows": 2},
    ),
    (
        r"Every solution is $x = \begin{bmatrix} 0 \\ 1 \\ 0 \end{bmatrix} + c_1 "
        r"\begin{bmatrix} 1 \\ 0 \\ 0 \end{bmatrix} + c_2 \begin{bmatrix} 0 \\ -2 \\ 1 "
        r"\end{bmatrix}$, and A has 1 row. What are R and d?",
        "complete_solution",
        {
            "x_p": _vector([0, 1, 0]),
            "special": (_vector([1, 0, 0]), _vector([0, -2, 1])),
            "rows": 1,
        },
    ),
    (
        "A 4 by 6 matrix has rank $r = 4$. Pick the right words: $Ax = b$ (always / sometimes "
        "but not always) has (exactly one solution / infinitely many solutions / no solution).",
        "solvability",
        {
            "rows": 4,
            "cols": 6,
            "rank": 4,
            "solutions": None,
            "choices": (
                ("always", "sometimes but not always"),
                ("exactly one solution", "infinitely many solutions", "no solution"),
            ),
        },
    ),
    (
        "For a 5 by 3 matrix of rank 3 the system Ax = b has (a unique solution / no solution) "
        "(always / sometimes / never).",
        "solvability",
        {
            "rows": 5,
            "cols": 3,
            "rank": 3,
            "choices": (("a unique solution", "no solution"), ("always", "sometimes", "never")),
        },
    ),
    (
        "To reach R = [[1, 0], [0, 1], [0, 0]] and d = [2, 1, 0], elimination added 2 times "
        "row 1 to row 3, then swapped rows 2 and 3, then divided row 2 by 4. Find E^-1, A and b.",
        "elimination",
        {"R": _matrix([[1, 0], [0, 1], [0, 0]]), "d": _vector([2, 1, 0])},
    ),
    (
        r"Elimination turned $Ax = b$ into $Rx = d$, whose complete solution is "
        r"$x = [1, 0, 2]^T + c_1 * [-2, 1, 0]^T$. It subtracted twice row 1 from row 2, and "
        "then 4 times row 1 from row 3. Which matrix takes R and d back to A and b? Find A, b.",
        "elimination",
        {"R": _matrix([[1, 2, 0], [0, 0, 1], [0, 0, 0]]), "d": _vector([1, 2, 0])},
    ),
]
OPERATIONS = {
    16: ["R3 = R3 + 2*R1", "R2 <-> R3", "R2 = (1/4)*R2"],
    17: ["R2 = R2 - 2*R1", "R3 = R3 - 4*R1"],
}
CHOSEN = {
    14: ("always; infinitely many solutions",),
    15: ("a unique solution; sometimes", "no solution; sometimes"),
}


@pytest.mark.parametrize("index", range(len(PARAPHRASES)))
def test_paraphrases_parse_to_their_kind_and_values(index):
    question, kind, fields = PARAPHRASES[index]
    parsed = lc.parse_question(question)
    assert parsed.kind == kind
    for name, value in fields.items():
        assert getattr(parsed, name) == value, name
    if index in OPERATIONS:
        assert [op.text() for op in parsed.operations] == OPERATIONS[index]
    if index in CHOSEN:
        assert choice_answers(parsed) == CHOSEN[index]
    else:
        lc.solve(parsed)  # every other paraphrase is a question the solver answers


def test_latex_with_and_without_commas_parses_as_the_bracket_notation():
    plain = lc.parse_question("Find the reduced row echelon form R of A = [[2, 4, 1], [1, 2, 3]].")
    for matrix in (A_COMMAS, A_PLAIN, r"\begin{bmatrix} 2, 4, 1 \\ 1, 2, 3 \end{bmatrix}"):
        latex = lc.parse_question(f"Find the reduced row echelon form R of $A = {matrix}$.")
        assert latex.key == plain.key
        assert lc.solve(latex).answer == lc.solve(plain).answer


def test_the_stated_rows_of_a_complete_solution_win_over_the_steps():
    question = (
        "Ax = b reduced to Rx = d, complete solution x = [1, 0, 2] + c1 * [-2, 1, 0], A has 4 "
        "rows; elimination subtracted 2 times row 1 from row 2. Find E^-1, A and b."
    )
    parsed = lc.parse_question(question)
    assert parsed.kind == "elimination" and len(parsed.R) == 4 and len(parsed.d) == 4


REFUSALS = [
    ("Explain why a wide matrix always has a nonzero nullspace.", "explanation in words"),
    (
        r"For $A = \begin{bmatrix}1 & 2\\ 3 & 6\end{bmatrix}$, describe the column space in words.",
        "describe the column space",
    ),
    ("A is 4 by 7 with rank 2. What is the column space of A?", "describe the column space"),
    (
        "The complete solution is $x = [1, 1]^T + c_1 [1, 0]^T$. Is $b = [1, 2]$ in the column "
        "space of A?",
        "states a complete solution of Ax = b and asks about the column space",
    ),
    (
        "A 3 by 3 matrix has rank 2; every solution is x = [1, 0, 0] + c1 * [0, 1, 1]. Does "
        "Ax = b always have a solution?",
        "asks about how often Ax = b has a solution",
    ),
]


@pytest.mark.parametrize(("question", "reason"), REFUSALS)
def test_questions_no_kind_answers_are_refused_with_the_reason(question, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        lc.parse_question(question)


MALFORMED = [
    ("", "the question is empty"),
    ("  \n ", "the question is empty"),
    ("x" * 10_000, "10000 characters, more than the 4000 allowed"),
    (r"Row reduce $\begin{bmatrix} 1 & 2 \\ 3 & 4$.", r"not closed by \\end\{bmatrix\}"),
    (r"Row reduce \begin{bmatrix} 1 & 2 \end{pmatrix}.", r"found \\end\{pmatrix\}"),
    (r"Row reduce \begin{bmatrix} 1 & & 2 \\ 3 & 4 & 5 \end{bmatrix}.", "an empty entry"),
    (r"Row reduce \begin{bmatrix} 1 & 2 \\ 3 \end{bmatrix}.", "different lengths"),
    (r"Row reduce \begin{bmatrix} \end{bmatrix}.", "LaTeX matrix .* is empty"),
    (r"Row reduce A = \begin{bmatrix} 1 & \alpha \end{bmatrix}.", "is not a number"),
    (r"Row reduce \begin{cases} 1 \end{cases}.", r"unsupported LaTeX \\begin\{cases\}"),
    (
        "R = [[1, 0], [0, 1]], d = [1, 2]; elimination added 3 times row 1 from row 2. Find A.",
        "could not read the row operation",
    ),
    ("R = [[1, 0], [0, 1]], d = [1, 2]; we divided row 2 by 0. Find A.", "divides by zero"),
    (
        "R = [[1, 0], [0, 1]], d = [1, 2]; elimination subtracted row 1 from row 3. Find A.",
        "outside R1..R2",
    ),
    (
        "A 3 by 5 matrix has rank 3: Ax = b (always / never) has (one solution / maybe).",
        "could not read the choice",
    ),
    (
        "A 3 by 5 matrix has rank 3: Ax = b (always / never) has (no solution / no solutions).",
        "offers an option twice",
    ),
    (
        "A 3 by 5 matrix has rank 3: does Ax = b have (a unique solution / no solution)?",
        "one group of frequencies",
    ),
    (
        r"Let $A = \begin{bmatrix} 1 & 2 \end{bmatrix}$. Find rref(B) for the 4 by 4 block "
        r"matrix $B = \begin{bmatrix} A & A \\ A & A \end{bmatrix}$.",
        "calls the block matrix 4 by 4",
    ),
]


@pytest.mark.parametrize(("question", "message"), MALFORMED)
def test_malformed_questions_raise_a_value_error_saying_what(question, message):
    with pytest.raises(ValueError, match="could not parse the question") as raised:
        lc.parse_question(question)
    assert re.search(message, str(raised.value)), str(raised.value)


def test_choice_answers_refuses_a_question_without_choices():
    single = lc.parse_question("A is 3 by 5 with rank 3. Does Ax = b always have no solution?")
    with pytest.raises(ValueError, match="multiple-choice solvability question"):
        choice_answers(single)
    with pytest.raises(TypeError, match="`parsed` must be a ParsedQuestion"):
        choice_answers("always")


def test_the_solver_answers_a_refused_question_with_the_reason(quiz):
    from flax import nnx

    from sparse_jax.cot import VOCAB_SIZE, CotFormat, Solver
    from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder

    cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
    solver = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), CotFormat(48, 64), name="tiny")
    for question, reason in [
        (quiz[8]["text"], "could not parse the question: the question " + REFUSED[8]),
        # A descriptive kind is read, then refused: this model was trained on none.
        (
            quiz[4]["text"],
            "this model was not trained on questions answered in words; "
            "this is a column_space_basis question",
        ),
        ("", "could not parse the question: it is empty"),
        ("y" * 10_000, "could not parse the question"),
    ]:
        answer = solver.answer(question)
        assert answer.final is None and answer.tokens == 0
        assert answer.error.startswith(reason), answer.error
    assert "more than the 4000 allowed" in solver.answer("y" * 10_000).error


# ------------------------------------------------------------------------------------------
# Grading.


def test_grade_refuses_a_prediction_that_runs_past_the_reference():
    assert lc.grade("[[1, 0], [0, 1]]", "[[1, 0], [0, 1]]")
    assert not lc.grade("[[1, 0], [0, 1]]]", "[[1, 0], [0, 1]]")
    assert not lc.grade("never; x = [1]", "never")
    assert not lc.grade("always; many solutions; no solution", "always; many solutions")
    assert not lc.grade("never", "never; x = [1]")
