"""sparse_jax.data.linalg_cot: the generated linear-algebra problems checked against sympy (an
independent computation: the test reads the questions, answers and steps with its own code), the
steps replayed, the parser on every phrasing and on malformed text, canonical numbers, the
splits and the TFDS builder.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_jax.data import linalg_cot as lc
from sparse_jax.data.linalg_cot.algebra import counted
from sparse_jax.data.linalg_cot.generator import format_block
from sparse_jax.data.linalg_cot.grading import step_parts

sympy = pytest.importorskip("sympy", reason="sympy checks the generator (pip install sympy)")

ROOT = Path(__file__).resolve().parents[1]
# Problems per kind checked against sympy with the default sizes, and with the largest sizes
# the issue allows (6 x 8 rref, 4 x 6 nullspaces).
PER_KIND = 1000
PER_KIND_MAXIMA = 150
MAXIMA = lc.GeneratorConfig(
    rref_shape=(6, 8),
    nullspace_shape=(4, 6),
    column_space_shape=(6, 6),
    elimination_shape=(4, 6),
    elimination_ops=12,
    unknowns=5,
    complete_solution_rows=5,
    max_steps=48,
    max_number=200,
)

# ------------------------------------------------------------------------------------------
# The test's own readers of the text (independent of the module's parser).

_LITERAL = re.compile(r"\[\[[^A-Za-z]*?\]\]|\[[^\[\]A-Za-z]*\]")


def literal(text: str) -> sympy.Matrix:
    """A matrix ``[[..], ..]`` or a vector ``[..]`` (a column) as an exact sympy Matrix."""
    quoted = json.loads(re.sub(r"(-?\d+(?:/\d+)?)", r'"\1"', text))
    if quoted and isinstance(quoted[0], list):
        return sympy.Matrix([[sympy.Rational(x) for x in row] for row in quoted])
    return sympy.Matrix([sympy.Rational(x) for x in quoted])


def literals(text: str) -> list[sympy.Matrix]:
    return [literal(m.group(0)) for m in _LITERAL.finditer(text)]


def vec(values) -> sympy.Matrix:
    return sympy.Matrix(list(values))


_SWAP = re.compile(r"^([Rs])(\d+) <-> \1(\d+)$")
_SCALE = re.compile(r"^([Rs])(\d+) = \((-?\d+(?:/\d+)?)\)\*\1(\d+)$")
_ADD = re.compile(r"^([Rs])(\d+) = \1(\d+) ([+-]) (\d+(?:/\d+)?)\*\1(\d+)$")


def apply_op(text: str, matrix: sympy.Matrix) -> sympy.Matrix:
    """One written row operation applied with sympy's own elementary row operations."""
    if m := _SWAP.match(text):
        return matrix.elementary_row_op("n<->m", row1=int(m[2]) - 1, row2=int(m[3]) - 1)
    if m := _SCALE.match(text):
        assert m[2] == m[4], text
        assert sympy.Rational(m[3]) != 0, text
        return matrix.elementary_row_op("n->kn", row=int(m[2]) - 1, k=sympy.Rational(m[3]))
    if m := _ADD.match(text):
        assert m[2] == m[3] != m[6], text
        k = sympy.Rational(m[5]) * (-1 if m[4] == "-" else 1)
        assert k != 0, text
        return matrix.elementary_row_op("n->n+km", row=int(m[2]) - 1, k=k, row2=int(m[6]) - 1)
    raise AssertionError(f"not a row operation: {text!r}")


def replay(steps, start: sympy.Matrix) -> tuple[sympy.Matrix, list[str]]:
    """Replays the leading ``<op> -> <matrix>`` steps from ``start``, checking each stated
    state; returns the last state and the remaining steps."""
    state = start
    rest = list(steps)
    while rest and " -> [[" in rest[0] and re.match(r"^(undo .*?: )?[Rs]\d+ ", rest[0]):
        op_text, stated = rest.pop(0).split(" -> ")
        op_text = op_text.split(": ")[-1]
        state = apply_op(op_text, state)
        assert state == literal(stated), (op_text, state, stated)
    return state, rest


def block_matrix(a: sympy.Matrix, pattern: str) -> sympy.Matrix:
    rows = re.findall(r"\[([^\[\]]*)\]", pattern[1:-1])
    blocks = []
    for row in rows:
        pieces = []
        for entry in row.split(","):
            entry = entry.strip()
            coefficient = {"A": 1, "-A": -1, "0": 0}.get(entry)
            if coefficient is None:
                coefficient = int(entry.rstrip("A").rstrip("*"))
            pieces.append(coefficient * a)
        blocks.append(sympy.Matrix.hstack(*pieces))
    return sympy.Matrix.vstack(*blocks)


def nullspace_words(dimension: int, n: int) -> str:
    named = {1: f"a line in R^{n}", 2: f"a plane in R^{n}"}
    if dimension == 0:
        return f"only the zero vector in R^{n}"
    if dimension == n:
        return f"all of R^{n}"
    return named.get(dimension, f"a {dimension}-dimensional subspace of R^{n}")


# ------------------------------------------------------------------------------------------
# Per kind: the answer and the steps against sympy.


def check_rref(p: lc.Problem) -> None:
    (a,) = literals(p.question.split(" B = ")[0])
    steps = list(p.steps)
    block = re.search(r"B = (\[\[[^.?]*?\]\])", p.question)
    if block:
        a = block_matrix(a, block.group(1))
        assert literal(steps.pop(0).removeprefix("B = ")) == a
    reference = a.rref()[0]
    assert literal(p.answer) == reference
    if steps == ["the matrix is already in reduced row echelon form"]:
        assert a == reference
        return
    final, rest = replay(steps, a)
    assert final == reference and rest == []


def check_nullspace(p: lc.Problem) -> None:
    (a,) = literals(p.question)
    final, rest = replay(p.steps, a)
    assert final == a.rref()[0]
    pivots = a.rref()[1]
    free = [j for j in range(a.cols) if j not in pivots]
    if rest[0] == "the matrix is already in reduced row echelon form":
        assert a == a.rref()[0]
        rest.pop(0)
    line = rest.pop(0)
    assert re.findall(r"\d+", line.split(";")[0]) == [str(j + 1) for j in pivots], line
    assert re.findall(r"\d+", line.split(";")[1]) == [str(j + 1) for j in free], line
    basis = a.nullspace()  # sympy: free variable 1, the others 0: the special solutions
    assert len(rest) == len(basis) + 1
    for k, (step, s) in enumerate(zip(rest, basis, strict=False)):
        assert step.split(" -> ")[1] == f"s{k + 1} = " + lc.format_vector(
            [Fraction(int(x.p), int(x.q)) for x in s]
        )
        assert a * literal(step.split(" = ")[-1]) == sympy.zeros(a.rows, 1)
    words = nullspace_words(len(basis), a.cols)
    assert rest[-1].endswith(f"N(A) is {words}")
    listed, stated_words = p.answer.split("; ")
    assert stated_words == f"N(A) is {words}"
    if basis:
        vectors = [literal(v) for v in re.findall(r"\[[^\]]*\]", listed)]
        assert vectors == basis
    else:
        assert listed == "no special solutions"


def check_column_space(p: lc.Problem) -> None:
    a = literal(re.search(r"A (?:=|is the matrix) (\[\[.*?\]\])", p.question)[1])
    b = literal(re.search(r"b = (\[[^\[\]]*\])", p.question)[1])
    augmented = a.row_join(b)
    assert literal(p.steps[0].removeprefix("[A | b] = ")) == augmented
    final, rest = replay(p.steps[1:], augmented)
    assert final[:, : a.cols] == a.rref()[0]
    in_column_space = augmented.rank() == a.rank()
    if not in_column_space:
        assert p.answer == "no"
        row = int(re.match(r"row (\d+) reads 0 = ", rest[0]).group(1)) - 1
        assert all(x == 0 for x in final[row, : a.cols]) and final[row, a.cols] != 0
        assert rest[0].endswith("b is not in C(A)") and len(rest) == 1
        return
    assert p.answer.startswith("yes; x = ")
    x = literal(p.answer.removeprefix("yes; x = "))
    assert a * x == b
    solution, params = a.gauss_jordan_solve(b)
    assert solution.subs(dict.fromkeys(params, 0)) == x  # free variables 0
    assert rest[-1].endswith(f"x = {lc.format_vector([Fraction(str(v)) for v in x])}")


def _count_solutions(a: sympy.Matrix, b: sympy.Matrix) -> str:
    try:
        _, params = a.gauss_jordan_solve(b)
    except ValueError:  # sympy: "Linear system has no solution"
        return "none"
    return "many" if params.shape[0] else "unique"


_FREQUENCY_CACHE: dict[tuple[int, int, int], dict[str, str]] = {}


def solvability_reference(m: int, n: int, r: int) -> dict[str, str]:
    """always / sometimes but not always / never for each property, found by solving Ax = b
    with sympy for a random m x n matrix of rank r and b in {0, e_1, ..., e_m} (when r < m
    some e_i is outside C(A), and b = 0 always has a solution: these b decide every case)."""
    if (m, n, r) not in _FREQUENCY_CACHE:
        rng = random.Random(m * 100 + n * 10 + r)
        while True:
            left = sympy.Matrix(m, r, lambda i, j: rng.randint(-3, 3))
            right = sympy.Matrix(r, n, lambda i, j: rng.randint(-3, 3))
            a = left * right
            if a.rank() == r:
                break
        outcomes = [_count_solutions(a, sympy.zeros(m, 1))]
        outcomes += [_count_solutions(a, sympy.eye(m)[:, i]) for i in range(m)]
        frequency = {}
        for prop in ("unique", "many", "none"):
            hits = sum(o == prop for o in outcomes)
            frequency[prop] = (
                "always"
                if hits == len(outcomes)
                else "never"
                if hits == 0
                else "sometimes but not always"
            )
        _FREQUENCY_CACHE[m, n, r] = frequency
    return _FREQUENCY_CACHE[m, n, r]


def check_solvability(p: lc.Problem) -> None:
    q = p.question
    m, n = (
        map(int, re.search(r"(\d+) by (\d+)", q).groups())
        if re.search(r"\d+ by \d+", q)
        else (int(re.search(r"m = (\d+)", q)[1]), int(re.search(r"n = (\d+)", q)[1]))
    )
    r = int(re.search(r"rank (?:r = )?(\d+)", q)[1])
    prop = next(
        key for key, words in lc.PROPERTIES.items() if f"has {words}" in q or f"have {words}" in q
    )
    assert p.answer == solvability_reference(m, n, r)[prop]
    assert p.steps[0].startswith(f"r = m = {m}:" if r == m else f"r = {r} < m = {m}:")
    assert p.steps[1].startswith(f"r = n = {n}:" if r == n else f"r = {r} < n = {n}:")
    assert p.steps[2] == f"so Ax = b has {lc.PROPERTIES[prop]}: {p.answer}"


def check_complete_solution(p: lc.Problem) -> None:
    vectors = literals(p.question)
    x_p, special = vectors[0], vectors[1:]
    rows = re.search(r"(\d+) by \d+|(\d+) rows?\b", p.question)
    m = int(rows[1] or rows[2])
    r_text, d_text = p.answer.removeprefix("R = ").split("; d = ")
    r, d = literal(r_text), literal(d_text)
    n, k = x_p.rows, len(special)
    assert r.shape == (m, n) and r.rref()[0] == r  # R is in reduced row echelon form
    assert r * x_p == d
    assert sympy.Matrix.hstack(*special).rank() == k
    for s in special:
        assert r * s == sympy.zeros(m, 1)
    assert r.rank() == n - k  # so the solutions of Rx = d are exactly x_p + span(s1, ...)
    steps = list(p.steps)
    if k:
        s_matrix = sympy.Matrix.vstack(*[s.T for s in special])
        reduced, steps = replay(steps, s_matrix)
        # Special form: the special solutions of R (sympy's nullspace basis), in order.
        assert reduced == sympy.Matrix.vstack(*[v.T for v in r.nullspace()])
    pivots = r.rref()[1]
    free = [j for j in range(n) if j not in pivots]
    assert steps[0].startswith("free variables " + (", ".join(f"x{j + 1}" for j in free) or "none"))
    for i, pivot in enumerate(pivots):
        assert steps[1 + i] == f"pivot x{pivot + 1}: row {i + 1} of R = " + lc.format_vector(
            [Fraction(str(v)) for v in r.row(i)]
        )
    assert steps[-2].endswith(f"R = {r_text}") and steps[-1] == f"d = R x_p = {d_text}"
    assert len(steps) == 1 + len(pivots) + 2


_OPS_IN_QUESTION = re.compile(
    r"R\d+ <-> R\d+|R\d+ = \(-?[\d/]+\)\*R\d+|R\d+ = R\d+ [+-] [\d/]+\*R\d+"
)


def check_elimination(p: lc.Problem) -> None:
    r = literal(re.search(r"R = (\[\[.*?\]\])", p.question)[1])
    d = literal(re.search(r"d = (\[[^\[\]]*\])", p.question)[1])
    ops = _OPS_IN_QUESTION.findall(p.question)
    assert ops
    parts = dict(part.split(" = ", 1) for part in p.answer.split("; "))
    e_inverse, a, b = literal(parts["E^-1"]), literal(parts["A"]), literal(parts["b"])
    m = r.rows
    # E from the question's steps: the product of their elementary matrices, last on the left.
    e = sympy.eye(m)
    for op in ops:
        e = apply_op(op, sympy.eye(m)) * e
    assert e * e_inverse == sympy.eye(m)
    assert e_inverse * r == a and e_inverse * d == b
    assert e * a == r and e * b == d
    assert a.rref()[0] == r  # the steps were Gauss-Jordan elimination of A
    start = sympy.eye(m).row_join(r).row_join(d)
    assert literal(p.steps[0].removeprefix("start from [I | R | d] = ")) == start
    final, rest = replay(p.steps[1:], start)
    assert rest == [] and final == e_inverse.row_join(a).row_join(b)
    undone = [re.match(r"undo (.*?): ", step)[1] for step in p.steps[1:]]
    assert undone == ops[::-1]


CHECKS = {
    "complete_solution": check_complete_solution,
    "elimination": check_elimination,
    "nullspace": check_nullspace,
    "rref": check_rref,
    "solvability": check_solvability,
    "column_space": check_column_space,
}


def _problems(kind: str, seed: int, count: int, config: lc.GeneratorConfig | None = None):
    rng = random.Random(seed)
    return [lc.generate(kind, rng, config) for _ in range(count)]


@pytest.mark.parametrize("kind", lc.KINDS)
def test_generator_against_sympy(kind):
    problems = _problems(kind, 1, PER_KIND) + _problems(kind, 2, PER_KIND_MAXIMA, MAXIMA)
    for p in problems:
        assert p.kind == kind
        try:
            CHECKS[kind](p)
        except AssertionError as e:
            raise AssertionError(f"{p.text()}\n{e}") from None
    # Every phrasing came up, and the problems are varied.
    used = {t for p in problems for t, text in enumerate(lc.TEMPLATES[kind]) if _fits(p, text)}
    assert used == set(range(len(lc.TEMPLATES[kind])))
    assert len({p.question for p in problems}) > 0.5 * len(problems)


def _fits(problem: lc.Problem, template: str) -> bool:
    pattern = re.escape(template)
    pattern = re.sub(r"\\\{\w+\\\}", ".+?", pattern)
    return re.fullmatch(pattern, problem.question) is not None


def test_generated_sizes_and_bounds():
    cfg = lc.GeneratorConfig()
    for kind in lc.KINDS:
        for p in _problems(kind, 3, 200):
            assert len(p.steps) <= cfg.max_steps
            numbers = [int(x) for x in re.findall(r"\d+", " ".join(p.steps) + p.answer)]
            assert max(numbers, default=0) <= cfg.max_number
            assert all("\n" not in line for line in (p.question, p.answer, *p.steps))
            question_numbers = [int(x) for x in re.findall(r"-?\d+", p.question)]
            if kind in ("rref", "nullspace", "column_space"):
                assert max(abs(x) for x in question_numbers) <= cfg.max_entry
    blocks = [p for p in _problems("rref", 4, 300) if "B = [[" in p.question]
    assert 0.1 < len(blocks) / 300 < 0.4
    # The issue's largest shapes do come up (6 x 8 rref, 4 x 6 nullspace).
    for kind, largest in (("rref", (6, 8)), ("nullspace", (4, 6))):
        shapes = {
            literal(re.search(r"\[\[.*?\]\]", p.question)[0]).shape
            for p in _problems(kind, 5, 300, MAXIMA)
            if "B = " not in p.question
        }
        assert largest in shapes and max(shapes) <= largest, (kind, shapes)
    answers = {p.answer for p in _problems("solvability", 6, 300)}
    assert answers == set(lc.FREQUENCIES)
    answers = {p.answer.split(";")[0] for p in _problems("column_space", 7, 200)}
    assert answers == {"yes", "no"}


# ------------------------------------------------------------------------------------------
# Canonical numbers.


def test_numbers_are_canonical():
    fractions = 0
    for kind in lc.KINDS:
        for p in _problems(kind, 8, 300, MAXIMA if kind in ("rref", "nullspace") else None):
            text = "\n".join((p.question, *p.steps, p.answer))
            for numerator, denominator in re.findall(r"(-?\d+)/(\d+)", text):
                fractions += 1
                assert int(denominator) >= 2 and math.gcd(int(numerator), int(denominator)) == 1
            assert not re.search(r"-0\b|--|\+ -|- -|\b0\d", text), text
    assert fractions > 100  # fractions do occur


@settings(max_examples=200, deadline=None)
@given(st.integers(-(10**6), 10**6), st.integers(1, 10**6))
def test_format_number_is_lowest_terms(p, q):
    text = lc.format_number(Fraction(p, q))
    assert Fraction(text) == Fraction(p, q)
    if "/" in text:
        numerator, denominator = map(int, text.split("/"))
        assert denominator > 1 and math.gcd(numerator, denominator) == 1
    else:
        assert Fraction(p, q).denominator == 1 and text == str(p // q)


# ------------------------------------------------------------------------------------------
# The solver on arbitrary matrices (not only generated ones).

small_matrices = st.integers(1, 4).flatmap(
    lambda m: st.integers(1, 5).flatmap(
        lambda n: st.lists(
            st.lists(st.integers(-4, 4), min_size=n, max_size=n), min_size=m, max_size=m
        )
    )
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_matrices)
def test_rref_and_nullspace_of_any_matrix(rows):
    a = lc.format_matrix(rows)
    rref = lc.solve(lc.parse_question(f"Find the reduced row echelon form R of A = {a}."))
    check_rref(rref)
    nullspace = lc.solve(lc.parse_question(f"Find the special solutions of Ax = 0 for A = {a}."))
    check_nullspace(nullspace)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_matrices, st.data())
def test_column_space_of_any_matrix(rows, data):
    b = data.draw(st.lists(st.integers(-5, 5), min_size=len(rows), max_size=len(rows)))
    q = f"Let A = {lc.format_matrix(rows)} and b = {lc.format_vector(b)}. Is b in C(A)?"
    p = lc.solve(lc.parse_question(q))
    a = literal(lc.format_matrix(rows))
    if p.answer == "no":
        assert a.row_join(vec(b)).rank() > a.rank()
    else:
        x = literal(p.answer.removeprefix("yes; x = "))
        assert a * x == vec(b)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.data())
def test_solvability_of_any_shape(m, n, data):
    r = data.draw(st.integers(0, min(m, n)))
    for prop, words in lc.PROPERTIES.items():
        q = f"A is a {m} by {n} matrix of rank {r}. Does Ax = b have {words} always, sometimes "
        q += "but not always, or never?"
        if r == 0:
            expected = {"unique": "never", "many": "sometimes but not always"}.get(
                prop, "sometimes but not always"
            )
        else:
            expected = solvability_reference(m, n, r)[prop]
        assert lc.solve(lc.parse_question(q)).answer == expected


def test_complete_solution_with_vectors_not_in_special_form():
    q = (
        "The complete solution of Ax = b is x = [1, 2, 3] + c1 * [1, 1, 1] + c2 * [2, 1, 0], "
        "and A is 2 by 3. Find R and d."
    )
    p = lc.solve(lc.parse_question(q))
    check_complete_solution(p)
    assert p.answer == "R = [[1, -2, 1], [0, 0, 0]]; d = [0, 0]"
    assert p.steps[0].startswith("s1 ") or p.steps[0].startswith("s2 ")


def test_solve_refuses_impossible_questions():
    dependent = (
        "The complete solution of Ax = b is x = [1, 2] + c1 * [1, 1] + c2 * [2, 2], A is 1 by 2."
    )
    with pytest.raises(ValueError, match="independent"):
        lc.solve(lc.parse_question(dependent))
    too_few_rows = "A has 1 row and the complete solution of Ax = b is x = [1, 2, 3]."
    with pytest.raises(ValueError, match="A has 1 row but the complete solution needs rank 3"):
        lc.solve(lc.parse_question(too_few_rows))
    with pytest.raises(TypeError, match="ParsedQuestion"):
        lc.solve("Find rref of [[1]]")
    with pytest.raises(ValueError, match="kind"):
        lc.solve(lc.ParsedQuestion("eigenvalues", "?"))
    with pytest.raises(TypeError, match="`A`"):
        lc.solve(lc.ParsedQuestion("rref", "?", A=[[1, 2]]))


# ------------------------------------------------------------------------------------------
# The parser.


@pytest.mark.parametrize("kind", lc.KINDS)
def test_every_phrasing_round_trips(kind):
    for template in range(len(lc.TEMPLATES[kind])):
        rng = random.Random(template)
        for _ in range(40):
            p = lc.generate(kind, rng, template=template)
            assert _fits(p, lc.TEMPLATES[kind][template])
            parsed = lc.parse_question(p.question)
            assert parsed.kind == kind
            assert lc.solve(parsed) == p
            # The key ignores the phrasing.
            other = (template + 1) % len(lc.TEMPLATES[kind])
            values = _template_values(parsed)
            if kind == "rref" and ("{block}" in lc.TEMPLATES[kind][other]) != (
                parsed.block is not None
            ):
                continue
            rephrased = lc.parse_question(lc.TEMPLATES[kind][other].format(**values))
            assert rephrased.key == parsed.key


def _template_values(p: lc.ParsedQuestion) -> dict[str, str]:
    values = {}
    if p.A is not None:
        values["A"] = lc.format_matrix(p.A)
    if p.b is not None:
        values["b"] = lc.format_vector(p.b)
    if p.R is not None:
        values |= {"R": lc.format_matrix(p.R), "d": lc.format_vector(p.d)}
        values["ops"] = "; ".join(op.text() for op in p.operations)
    if p.block is not None:
        values["block"] = format_block(p.block)
    if p.x_p is not None:
        terms = [lc.format_vector(p.x_p)]
        terms += [f"c{k + 1} * {lc.format_vector(s)}" for k, s in enumerate(p.special)]
        values |= {"x": " + ".join(terms), "m": str(p.rows), "n": str(len(p.x_p))}
        values["rows"] = counted(p.rows, "row")
    if p.solutions is not None:
        values |= {"m": p.rows, "n": p.cols, "r": p.rank}
        values["property"] = lc.PROPERTIES[p.solutions]
    return values


USER_PHRASINGS = [
    (
        "Suppose A is the matrix [[1, 2], [3, 4], [5, 6]]. Is b = [5, 11, 17] in the column "
        "space of A?",
        "column_space",
        "yes; x = [1, 2]",
    ),
    ("Is [1, 0, 0] in the column space of [[1, 2], [3, 4], [5, 6]]?", "column_space", "no"),
    (
        "rref of A = [[1, 2, 0, 3], [2, 4, 1, 7], [0, 0, 2, 2]]?",
        "rref",
        "[[1, 2, 0, 3], [0, 0, 1, 1], [0, 0, 0, 0]]",
    ),
    ("Row reduce [[2, 4], [1.5, 3]].", "rref", "[[1, 2], [0, 0]]"),
    (
        "What is the rref of [[A, A], [A, A]] when A = [[1, 2], [3, 4]]?",
        "rref",
        "[[1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]",
    ),
    (
        "Let A=[[1,2],[2,4]]. Find rref(B) for B = [[A, 2A]].",
        "rref",
        "[[1, 2, 2, 4], [0, 0, 0, 0]]",
    ),
    (
        "What is the nullspace of A = [[1, 1, 1]]?",
        "nullspace",
        "s1 = [-1, 1, 0], s2 = [-1, 0, 1]; N(A) is a plane in R^3",
    ),
    (
        "A 3x5 matrix has rank 3. Does Ax = b always, sometimes or never have a unique solution?",
        "solvability",
        "never",
    ),
    (
        "If A is 4 by 4 with rank(A) = 4, is it always, sometimes or never that Ax = b has no "
        "solution?",
        "solvability",
        "never",
    ),
    (
        "x = [1, 0, 0] + c * [-2, 1, 0] is the complete solution of Ax = b with A 2 by 3. "
        "Find R and d.",
        "complete_solution",
        "R = [[1, 2, 0], [0, 0, 1]]; d = [1, 0]",
    ),
    (
        "The steps R2 = R2 - 2R1 and R1 <-> R2 took A to R = [[1, 0], [0, 1]] and b to "
        "d = [1, 2]. Find A and b.",
        "elimination",
        "E^-1 = [[0, 1], [1, 2]]; A = [[0, 1], [1, 2]]; b = [2, 5]",
    ),
]


@pytest.mark.parametrize(("question", "kind", "answer"), USER_PHRASINGS)
def test_user_phrasings(question, kind, answer):
    parsed = lc.parse_question(question)
    assert parsed.kind == kind
    problem = lc.solve(parsed)
    assert problem.answer == answer
    if kind == "rref" and "[[A, A], [A, A]]" in question:
        assert parsed.block == ((1, 1), (1, 1))
    if kind == "elimination":
        assert [op.text() for op in parsed.operations] == ["R2 = R2 - 2*R1", "R1 <-> R2"]


MALFORMED = [
    ("", "could not tell what the question asks"),
    ("What is the determinant of [[1, 2], [3, 4]]?", "could not tell what the question asks"),
    ("Find the rref of A = [[1, 2], [3]].", "different lengths"),
    ("Find the rref of A = [[1, 2], [3, x]].", "'x' of the matrix A is not a number"),
    ("Find the rref of A = [[1, 2], [3, 4]", "never closed"),
    ("Find the rref of A = [[1, 2], [3, 4].", "expected ',' or ']' after '\\[3, 4\\]'"),
    ("Find the rref of A = [[1, 2]]].", "closes nothing"),
    ("Find the rref of A = [[1, 2], [3, 1/0]].", "divides by zero"),
    ("Find the rref of A = [[[1]]].", "nested more than two deep"),
    ("Find the rref of A = [[1, 2], 3].", "neither a vector"),
    ("Find the rref of A = [[1, , 2]].", "empty entry"),
    ("Find the rref of A = [].", "empty entry"),
    ("Find the rref of A.", "could not find the matrix A"),
    ("Find the rref of A = [[1, 2]] and of C = [[3, 4]].", "found 2 matrices"),
    ("Is b = [1, 2] in the column space of A = [[1, 2], [3, 4], [5, 6]]?", "b has 2 entries"),
    ("Is b in the column space of A = [[1, 2], [3, 4]]?", "could not find the vector b"),
    ("Is b = [1, 2] in the column space of A?", "could not find the matrix A"),
    (
        "A is a 3 by 5 matrix of rank 4. Does Ax = b have no solution always, sometimes or never?",
        "at most 3",
    ),
    ("A has rank 2. Does Ax = b always have no solution?", "size of A"),
    ("A is a 3 by 5 matrix. Is Ax = b always, sometimes or never solvable?", "rank"),
    ("A is 3 by 5 of rank 2. Does Ax = b always, sometimes or never work?", "which property"),
    (
        "A is 3 by 5 of rank 2. Always, sometimes or never: no solution or a unique solution?",
        "which property",
    ),
    ("A is 0 by 5 of rank 0. Always, sometimes or never: no solution?", "at least 1"),
    ("R2 = R2 - 2*R1 took A to R = [[1, 0]] and b to d = [1].", "outside R1..R1"),
    ("R2 = R2 * R1 took A to R = [[1], [0]] and b to d = [1, 0].", "could not read the row"),
    (
        "R2 = R1 - 2*R1 took A to R = [[1], [0]] and b to d = [1, 0].",
        re.escape("must read Ri = Ri + c*Rj with i != j"),
    ),
    ("R2 = (0)*R2 took A to R = [[1], [0]] and b to d = [1, 0].", "scales by 0"),
    ("R1 <-> R1 took A to R = [[1], [0]] and b to d = [1, 0].", "swaps a row with itself"),
    ("R1 <-> R2 took A to R = [[1], [0]] and b to d = [1].", "d has 1 entries"),
    ("The complete solution is x = [1, 2] + c1 * [1, 2, 3], A is 2 by 2.", "has 3 entries"),
    ("The complete solution is x = [1, 2] + c1 * [1, 1].", "how many rows"),
    ("The complete solution is x = [1, 2] + c1 * [1, 1], A is 2 by 3.", "x has 2 entries"),
    ("Let A = [[1, 2]]. Find the rref of B = [[A, C]].", "names C, not A"),
    ("Let A = [[1, 2]]. Find the rref of B = [[A, A], [A]].", "rectangle of blocks"),
    ("Find the rref of A = [[1, 2]] and B = [[A, 2]].", "found 2 matrices"),
    ("x" * 5000, "more than the 4000 allowed"),
]


@pytest.mark.parametrize(("question", "message"), MALFORMED)
def test_malformed_questions_raise_a_clear_value_error(question, message):
    with pytest.raises(ValueError, match=message):
        lc.parse_question(question)


def test_parse_question_refuses_non_text():
    with pytest.raises(TypeError, match="`text` must be a str"):
        lc.parse_question(b"Find rref of [[1]]")


_fragments = st.sampled_from(
    [
        "A = ",
        "b = ",
        "R = ",
        "d = ",
        "[[",
        "]]",
        "[",
        "]",
        ", ",
        "1",
        "-2",
        "3/4",
        "0",
        "1/0",
        "x",
        "rref",
        "column space",
        "special solutions",
        "always",
        "never",
        "rank ",
        "3 by 5",
        "R2 = R2 - 2*R1",
        "R1 <-> R2",
        "R2 = (1/2)*R2",
        "+ c1 * ",
        "complete solution",
        "unique solution",
        "no solution",
        "A has 2 rows",
        "[[A, A]]",
        " ",
        ".",
        "?",
        "é",
        "\n",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_fragments, max_size=25).map("".join))
def test_parser_on_random_text_raises_only_value_error(text):
    try:
        parsed = lc.parse_question(text)
    except ValueError as e:
        assert str(e).startswith("could not parse the question")
        return
    try:
        lc.solve(parsed)
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(lc.KINDS), st.integers(0, 10**6), st.data())
def test_parser_on_mutated_questions_raises_only_value_error(kind, seed, data):
    question = lc.generate(kind, seed).question
    i = data.draw(st.integers(0, len(question)))
    mutation = data.draw(st.sampled_from(["delete", "insert", "replace"]))
    char = data.draw(st.sampled_from(list("[],0123456789-/ xAbR=*+.")))
    if mutation == "delete":
        question = question[:i] + question[i + 1 :]
    elif mutation == "insert":
        question = question[:i] + char + question[i:]
    else:
        question = question[:i] + char + question[i + 1 :]
    try:
        parsed = lc.parse_question(question)
    except ValueError:
        return
    try:
        lc.solve(parsed)
    except ValueError:
        pass


# ------------------------------------------------------------------------------------------
# Text format and grading.


def test_text_format_and_split_solution():
    p = lc.generate("nullspace", 5, template=0)
    lines = p.text().split("\n")
    assert lines[0] == p.question
    assert lines[1:-1] == list(p.steps)
    assert lines[-1] == "Answer: " + p.answer
    assert lc.split_solution(p.solution_text()) == (p.steps, p.answer)
    assert lc.split_solution("step\n\nAnswer: x\nAnswer: no") == (("step", "Answer: x"), "no")
    with pytest.raises(TypeError, match="`text` must be a str"):
        lc.split_solution(None)


def test_grade():
    assert lc.grade("yes; x = [1, 2]", "yes; x = [1, 2]")
    assert lc.grade(" Answer:  yes;x=[1,2] ", "yes; x = [1, 2]")
    assert not lc.grade("yes; x = [2/4, 2]", "yes; x = [1/2, 2]")
    assert not lc.grade("Yes", "yes")
    assert not lc.grade("sometimes", "sometimes but not always")
    with pytest.raises(TypeError, match="predicted_answer"):
        lc.grade(None, "yes")
    with pytest.raises(TypeError, match="reference_answer"):
        lc.grade("yes", 1)


# Step types each kind's solutions are made of (at the default sizes and the issue's maxima).
STEP_TYPES_OF = {
    "complete_solution": {"row scaling", "free and pivot variables", "pivot row", "R", "d"},
    "elimination": {"augmented matrix", "row exchange", "row scaling", "row combination"},
    "nullspace": {"row exchange", "row scaling", "row combination", "pivot columns",
                  "special solution", "nullspace"},
    "rref": {"block matrix", "row exchange", "row scaling", "row combination"},
    "solvability": {"rank and m", "rank and n", "conclusion"},
    "column_space": {"augmented matrix", "row exchange", "row scaling", "row combination",
                     "consistency", "solution x"},
}  # fmt: skip


def test_every_step_the_solver_writes_has_a_type():
    big = lc.GeneratorConfig(
        rref_shape=(6, 8), nullspace_shape=(4, 6), block_rate=0.5, fraction_rate=0.5
    )
    seen = collections.defaultdict(set)
    for config in (lc.GeneratorConfig(), big):
        for kind in lc.KINDS:
            for seed in range(150):
                for step in lc.generate(kind, seed, config).steps:
                    seen[kind].add(lc.step_type(step))
    assert dict(seen) == STEP_TYPES_OF  # none is "other"; each kind's types all occur
    assert set().union(*STEP_TYPES_OF.values()) | {"already reduced"} == set(lc.STEP_TYPES)
    identity = lc.parse_question("Find the reduced row echelon form R of A = [[1, 0], [0, 1]].")
    assert [lc.step_type(s) for s in lc.solve(identity).steps] == ["already reduced"]
    examples = {
        "s1 = s1 - 1/2*s2 -> [[1, 0, 2]]": "row combination",
        "s2 <-> s1 -> [[1, 0, 2]]": "row exchange",
        "undo R1 <-> R2: R1 <-> R2 -> [[0, 1]]": "row exchange",
        "row 2 reads 0 = 1 -> b is not in C(A)": "consistency",
        "free x2 = 0: x = [1, 0]": "solution x",
        "rows 2 to 3 of R are zero -> R = [[1, 0], [0, 0], [0, 0]]": "R",
        "no pivot columns; free columns 1, 2": "pivot columns",
        "R2 = R2 - 2*R1": "other",  # no state after it
        "R2 = R1 - 2*R1 -> [[1]]": "other",  # not an elementary operation on R2
        "x = 3": "other",
        "": "other",
    }
    assert {step: lc.step_type(step) for step in examples} == examples
    with pytest.raises(TypeError, match="`step` must be a str; got int"):
        lc.step_type(3)


_WORKED = re.compile(r"^((?:undo [^:]*: )?[Rs]\d+ = [^:>]*?): \[(.*)\] -> (\[\[.*\]\])$")
_ADD_TERM = re.compile(
    r"^(-?\d+(?:/\d+)?)([+-])(\d+(?:/\d+)?)\*\(?(-?\d+(?:/\d+)?)\)?"
    r"(?:=(-?\d+(?:/\d+)?)([+-])(\d+(?:/\d+)?))?=(-?\d+(?:/\d+)?)$"
)
_SCALE_TERM = re.compile(r"^\((-?\d+(?:/\d+)?)\)\*\(?(-?\d+(?:/\d+)?)\)?=(-?\d+(?:/\d+)?)$")


def _check_arithmetic(
    op_text: str, terms: str, before, after: sympy.Matrix, products: bool = False
) -> None:
    """Each written term ``a-k*b=c`` (``a-k*b=a-p=c`` with ``products``) / ``(k)*a=c`` is
    right, its a (and b) are the entries of ``before`` (None: unknown), and its c are the
    target row of ``after``."""
    op = op_text.split(": ")[-1]
    target = int(re.match(r"[Rs](\d+)", op)[1]) - 1
    results = []
    for term in terms.split(", "):
        if m := _ADD_TERM.match(term):
            a, k, b, c = (sympy.Rational(m[i]) for i in (1, 3, 4, 8))
            k = -k if m[2] == "-" else k
            assert _ADD.match(op) and sympy.Rational(_ADD.match(op)[5]) == abs(k), (op, term)
            assert a + k * b == c, term
            assert (m[5] is not None) == products, term
            if products:  # the first operand again, then the product signed into the sum
                product = sympy.Rational(m[7]) * (-1 if m[6] == "-" else 1)
                assert (sympy.Rational(m[5]), product) == (a, k * b), term
            results.append((a, b, c))
        else:
            m = _SCALE_TERM.match(term)
            assert m, term
            k, a, c = (sympy.Rational(m[i]) for i in (1, 2, 3))
            assert _SCALE.match(op) and sympy.Rational(_SCALE.match(op)[3]) == k, (op, term)
            assert k * a == c, term
            results.append((a, None, c))
    assert [c for _, _, c in results] == list(after.row(target)), (op, terms)
    if before is not None:
        assert [a for a, _, _ in results] == list(before.row(target)), (op, terms)
        if _ADD.match(op):
            source = int(_ADD.match(op)[6]) - 1
            assert [b for _, b, _ in results] == list(before.row(source)), (op, terms)


@pytest.mark.parametrize("kind", lc.KINDS)
def test_arithmetic_changes_only_the_row_operation_steps(kind):
    # GeneratorConfig.arithmetic: the same questions and answers, and each row scaling or
    # combination the same step with the changed row's entries computed before the arrow.
    worked_steps = 0
    for config in (lc.GeneratorConfig(), MAXIMA):
        worked_config = dataclasses.replace(config, arithmetic=True)
        for seed in range(60):
            plain, worked = lc.generate(kind, seed, config), lc.generate(kind, seed, worked_config)
            assert (worked.question, worked.answer) == (plain.question, plain.answer)
            assert len(worked.steps) == len(plain.steps)
            # The matrix before the first operation, where the text states one.
            stated = literals(plain.question) if kind in ("rref", "nullspace") else []
            before = stated[0] if len(stated) == 1 and "B = " not in plain.steps[0] else None
            for mine, theirs in zip(worked.steps, plain.steps, strict=True):
                assert lc.step_type(mine) == lc.step_type(theirs) != "other", mine
                m = _WORKED.match(mine)
                if not m:
                    assert mine == theirs
                else:
                    worked_steps += 1
                    assert lc.step_type(mine) in ("row scaling", "row combination"), mine
                    assert f"{m[1]} -> {m[3]}" == theirs
                    _check_arithmetic(m[1], m[2], before, literal(m[3]))
                if state := re.search(r"\[\[[^A-Za-z]*\]\]$", theirs):
                    before = literal(state[0])  # the state the next operation starts from
            assert worked == lc.solve(lc.parse_question(plain.question), arithmetic=True)
    assert worked_steps == 0 if kind == "solvability" else worked_steps >= 30


@pytest.mark.parametrize("kind", ["rref", "nullspace", "column_space", "elimination"])
def test_products_change_only_the_combinations_terms(kind):
    # GeneratorConfig.products: the same problems as with the arithmetic alone, each
    # combination's term with its product written before its sum, every term right.
    combinations = 0
    for config in (
        lc.GeneratorConfig(arithmetic=True),
        dataclasses.replace(MAXIMA, arithmetic=True),
    ):
        for seed in range(30):
            terms = lc.generate(kind, seed, config)
            mine = lc.generate(kind, seed, dataclasses.replace(config, products=True))
            assert (mine.question, mine.answer, len(mine.steps)) == (
                terms.question, terms.answer, len(terms.steps))  # fmt: skip
            for step, plain in zip(mine.steps, terms.steps, strict=True):
                m = _WORKED.match(step)
                if not m or lc.step_type(step) != "row combination":
                    assert step == plain
                    continue
                combinations += 1
                assert step != plain and lc.step_type(plain) == "row combination"
                # Dropping each "=a+p" gives the term without its product.
                assert re.sub(r"=-?[\d/]+[+-][\d/]+(?==)", "", step) == plain
                _check_arithmetic(m[1], m[2], None, literal(m[3]), products=True)
            problem = lc.solve(lc.parse_question(terms.question), arithmetic=True, products=True)
            assert mine == problem
    assert combinations >= 20


def _runs(line: str, roles, role: str) -> list[str]:
    """The maximal stretches of ``line`` whose characters have ``role``."""
    return [
        "".join(c for c, _ in group)
        for is_role, group in itertools.groupby(
            zip(line, roles, strict=True), lambda x: x[1] == role
        )
        if is_role
    ]


@pytest.mark.parametrize("kind", lc.KINDS)
def test_solution_roles_name_what_each_byte_writes(kind):
    worked_lines = 0
    for config in (lc.GeneratorConfig(), MAXIMA):
        for arithmetic, products in ((False, False), (True, False), (True, True)):
            cfg = dataclasses.replace(config, arithmetic=arithmetic, products=products)
            for seed in range(20):
                problem = lc.generate(kind, seed, cfg)
                text = problem.solution_text()
                roles = lc.solution_roles(text)
                assert len(roles) == len(text.encode()) and set(roles) <= set(lc.ROLES)
                lines, offset = text.split("\n"), 0
                for i, line in enumerate(lines):
                    mine = roles[offset : offset + len(line)]
                    if i < len(lines) - 1:
                        assert roles[offset + len(line)] == "state"  # the newline
                    offset += len(line) + 1
                    if i == len(lines) - 1:
                        assert set(mine) == {"answer"} and line.startswith("Answer: ")
                        continue
                    operation = step_parts(line)[0]
                    assert _runs(line, mine, "operation") == ([operation] if operation else [])
                    assert line.startswith(operation) and mine[-1] == "state", line
                    worked = _WORKED.match(line)
                    if not worked:
                        assert set(mine) <= {"operation", "state"}, line
                        continue
                    worked_lines += 1
                    expected = {"operand": [], "factor": [], "product": [], "term result": []}
                    for term in worked[2].split(", "):
                        multiplied = term[term.index("*") + 1 : term.index("=")]  # (-2) or 2
                        if m := _ADD_TERM.match(term):
                            expected["operand"] += [m[1], multiplied, *([m[5]] if m[5] else [])]
                            expected["factor"].append(m[3])
                            expected["product"] += [m[7]] if m[7] else []
                        else:
                            expected["operand"].append(multiplied)
                            expected["factor"].append(_SCALE_TERM.match(term)[1])
                        expected["term result"].append(term.rsplit("=", 1)[1])
                    for role, values in expected.items():
                        assert _runs(line, mine, role) == values, (line, role)
                    assert "".join(_runs(line, mine, "state")) == " -> " + worked[3]
    assert worked_lines == 0 if kind == "solvability" else worked_lines >= 10
    assert lc.solution_roles("") == ()
    assert lc.solution_roles("x = [\u00bd]") == ("state",) * 8  # bytes (the ½ takes two)
    with pytest.raises(TypeError, match="`solution` must be a str; got list"):
        lc.solution_roles(["R1 = (1/2)*R1 -> [[1]]"])


def test_first_divergence_names_where_and_how_a_chain_leaves_the_reference():
    rref = lc.generate("rref", 2).steps
    assert [lc.step_type(s) for s in rref] == ["row scaling", "row scaling", "row combination"]
    operation, state = rref[2].rsplit(" -> ", 1)
    solvability = lc.generate("solvability", 0, lc.GeneratorConfig(kinds=("solvability",))).steps
    assert solvability[1] == "r = n = 1: no free variables, so a solution is unique"
    column = lc.generate("column_space", 4).steps
    assert lc.step_type(column[-1]) == "solution x"
    cases = [
        (rref, rref, None),
        ([f"  {rref[0]} ", *rref[1:]], rref, None),  # whitespace at the ends
        ([*rref[:2], f"{operation} -> [[1, 0], [0, 2]]"], rref, "row combination: result"),
        ([*rref[:2], f"R1 = R1 + 2*R2 -> {state}"], rref, "row combination: operation"),
        ([rref[0], "the matrix is already in reduced row echelon form"], rref,
         "row scaling: operation"),
        (rref[:2], rref, "row combination: missing"),
        ([], rref, "row scaling: missing"),
        ([*rref, "R1 <-> R2 -> [[0, 1], [1, 0]]"], rref, "extra steps"),
        ([solvability[0], "r = n = 1: 1 free variable, so a solution is never unique"],
         solvability, "rank and n: result"),
        ([solvability[0], "r = 1 < n = 2: 1 free variable, so a solution is never unique"],
         solvability, "rank and n: operation"),
        ([*solvability[:2], "so Ax = b has no solution: always"], solvability,
         "conclusion: result"),
        ([*column[:-1], "x = [4, 12]"], column, "solution x: result"),
        ([*column[:-1], "free x2 = 0: x = [4, 0]"], column, "solution x: operation"),
    ]  # fmt: skip
    # With the arithmetic written (GeneratorConfig.arithmetic): a wrong term is "arithmetic",
    # right terms and a wrong matrix after them "result".
    worked = lc.generate("rref", 2, lc.GeneratorConfig(arithmetic=True)).steps
    operation, terms, state = re.fullmatch(r"(.*): (\[.*\]) -> (.*)", worked[2]).groups()
    wrong_terms = terms.replace("=", "=1", 1)
    cases += [
        (worked, worked, None),
        ([*worked[:2], f"{operation}: {wrong_terms} -> {state}"], worked,
         "row combination: arithmetic"),
        ([*worked[:2], f"{operation}: {terms} -> [[1, 0], [0, 2]]"], worked,
         "row combination: result"),
        ([*worked[:2], f"R1 = R1 + 2*R2: {terms} -> {state}"], worked,
         "row combination: operation"),
        ([*worked[:2], f"{operation} -> {state}"], worked, "row combination: arithmetic"),
    ]  # fmt: skip
    for written, reference, want in cases:
        assert lc.first_divergence(written, reference) == want, written
        assert lc.first_divergence(tuple(written), tuple(reference)) == want
    for bad in ("R1 <-> R2", [1], None):
        with pytest.raises(TypeError, match="`written` must be a sequence of str"):
            lc.first_divergence(bad, rref)
    with pytest.raises(TypeError, match="`reference` must be a sequence of str"):
        lc.first_divergence(rref, "x")


# ------------------------------------------------------------------------------------------
# Determinism, configuration, splits, the TFDS builder.


def test_deterministic_by_seed():
    for kind in lc.KINDS:
        assert lc.generate(kind, 11) == lc.generate(kind, 11)
        assert lc.generate(kind, 11) == lc.generate(kind, random.Random(11))
    first = [lc.generate(k, 12) for k in lc.KINDS]
    assert first != [lc.generate(k, 13) for k in lc.KINDS]
    assert lc.make_splits(30, 12, 12, seed=1) == lc.make_splits(30, 12, 12, seed=1)
    assert lc.make_splits(30, 12, 12, seed=1)["test"] != lc.make_splits(30, 12, 12, seed=2)["test"]
    # In a fresh interpreter too (string seeds do not depend on PYTHONHASHSEED).
    code = (
        "from sparse_jax.data import linalg_cot as lc; "
        "print(lc.make_splits(6, 6, 6, seed=3)['train'][4].text())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == lc.make_splits(6, 6, 6, seed=3)["train"][4].text()


def test_splits_are_disjoint_by_content():
    splits = lc.make_splits(train=1800, validation=240, test=240, seed=0)
    keys = {s: [lc.parse_question(p.question).key for p in ps] for s, ps in splits.items()}
    assert len(set(keys["test"])) == 240 and len(set(keys["validation"])) == 240
    assert not set(keys["test"]) & set(keys["validation"])
    assert not set(keys["train"]) & (set(keys["test"]) | set(keys["validation"]))
    questions = {s: {p.question for p in ps} for s, ps in splits.items()}
    assert not questions["train"] & questions["test"]
    for split, problems in splits.items():
        assert [p.kind for p in problems[:12]] == list(lc.KINDS) * 2, split
    # Changing the train size changes neither evaluation split.
    smaller = lc.make_splits(train=60, validation=240, test=240, seed=0)
    assert smaller["test"] == splits["test"] and smaller["validation"] == splits["validation"]


def test_a_question_with_one_row_says_row():
    cfg = lc.GeneratorConfig(complete_solution_rows=2, unknowns=2)
    questions = {}
    for seed in range(40):
        p = lc.generate("complete_solution", seed, cfg, template=2)
        questions[lc.parse_question(p.question).rows] = p.question
    assert set(questions) == {1, 2}
    assert questions[1].startswith("A has 1 row and every solution")
    assert questions[2].startswith("A has 2 rows and every solution")


def test_distinct_questions_counts_content_not_phrasing():
    same = [lc.generate("solvability", 7, template=t) for t in range(3)]
    assert len({p.question for p in same}) == 3 and len({p.answer for p in same}) == 1
    other = [lc.generate("rref", seed) for seed in range(4)]
    expected_rref = len({lc.parse_question(p.question).key for p in other})
    assert lc.distinct_questions([*other, *same, *same]) == {
        "rref": expected_rref, "solvability": 1}  # fmt: skip
    assert list(lc.distinct_questions([*same, *other])) == ["rref", "solvability"]  # KINDS order
    assert lc.distinct_questions([]) == {}
    with pytest.raises(TypeError, match="`problems` must hold Problems; got str"):
        lc.distinct_questions(["What is rref(A) for A = [[1]]?"])


def test_splits_refuse_too_few_distinct_questions():
    cfg = lc.GeneratorConfig(kinds=("solvability",), solvability_dim=1)
    with pytest.raises(ValueError, match="too few distinct questions"):
        lc.make_splits(train=1, validation=1, test=2, config=cfg)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`kind` must be one of"):
        lc.generate("eigen", 0)
    with pytest.raises(ValueError, match="`template` must be an int in \\[0, 2\\]"):
        lc.generate("solvability", 0, template=3)
    with pytest.raises(TypeError, match="`rng`"):
        lc.generate("rref", 1.5)
    with pytest.raises(TypeError, match="`config` must be a GeneratorConfig"):
        lc.generate("rref", 0, {"rref_shape": (2, 2)})
    with pytest.raises(ValueError, match=r"`rref_shape` must be .* <= 8; got \(7, 8\)"):
        lc.GeneratorConfig(rref_shape=(7, 8))
    with pytest.raises(ValueError, match="cols <= rows; got \\(2, 3\\)"):
        lc.GeneratorConfig(column_space_shape=(2, 3))
    with pytest.raises(ValueError, match="`kinds`"):
        lc.GeneratorConfig(kinds=("rref", "qr"))
    with pytest.raises(ValueError, match="`block_rate` must be in \\[0, 1\\]; got 2"):
        lc.GeneratorConfig(block_rate=2)
    with pytest.raises(ValueError, match="`unknowns` must be an int in \\[2, 5\\]; got 6"):
        lc.GeneratorConfig(unknowns=6)
    with pytest.raises(ValueError, match="`test` must be an int >= 0; got -1"):
        lc.make_splits(test=-1)
    with pytest.raises(ValueError, match="`train` must be an int >= 1; got 0"):
        lc.prepare("/nonexistent", train=0)
    with pytest.raises(TypeError, match="`data_dir`"):
        lc.prepare(3, train=1)
    with pytest.raises(ValueError, match="scale by 0"):
        lc.RowOp("scale", 0, factor=Fraction(0))
    with pytest.raises(ValueError, match="two different rows"):
        lc.RowOp("swap", 1, 1)
    with pytest.raises(TypeError, match="GeneratorConfig: `arithmetic` must be a bool; got 1"):
        lc.GeneratorConfig(arithmetic=1)
    with pytest.raises(TypeError, match="solve: `arithmetic` must be a bool; got 'yes'"):
        lc.solve(lc.parse_question("What is rref(A) for A = [[2, 4]]?"), arithmetic="yes")
    with pytest.raises(ValueError, match=r"GeneratorConfig: `products`=True .* needs `arithm"):
        lc.GeneratorConfig(products=True)
    with pytest.raises(TypeError, match="solve: `products` must be a bool; got 1"):
        lc.solve(
            lc.parse_question("What is rref(A) for A = [[2, 4]]?"), arithmetic=True, products=1
        )


def test_importing_the_module_imports_neither_tfds_nor_sympy():
    code = (
        "import sparse_jax.data.linalg_cot, sys; "
        "loaded = [m for m in ('tensorflow_datasets', 'sympy') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_tfds_builder_writes_and_reads_back(tmp_path, capsys):
    sizes = {"train": 30, "validation": 12, "test": 12}
    data = lc.prepare(tmp_path, **sizes, seed=4)
    assert data.built
    expected = lc.make_splits(**sizes, seed=4)
    for split in lc.SPLITS:
        source = getattr(data, split)
        assert len(source) == sizes[split]
        assert list(source) == list(expected[split])
        assert source[-1] == expected[split][-1]
    assert (data.dataset_dir / "dataset_info.json").is_file()
    assert data.dataset_name.startswith("sparse_jax_linalg_cot/s4_")
    again = lc.prepare(tmp_path, **sizes, seed=4)
    assert not again.built and list(again.test) == list(expected["test"])
    other = lc.prepare(tmp_path, **sizes, seed=5)
    assert other.built and other.dataset_dir != data.dataset_dir
    # The builder reads back on its own (no TensorFlow), by name.
    builder_cls = lc.SparseJaxLinalgCot
    config = lc.SparseJaxLinalgCotConfig(name=data.dataset_dir.parent.name)
    builder = builder_cls(config=config, data_dir=tmp_path, file_format="array_record")
    assert builder.is_prepared()
    record = builder.as_data_source()["validation"][0]
    assert record["question"].decode() == expected["validation"][0].question
    assert "tensorflow" not in sys.modules
    with pytest.raises(IndexError):
        data.train[30]
