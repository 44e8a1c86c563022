"""Linear-algebra exam problems with worked chain-of-thought solutions, computed exactly.

The task of the chain-of-thought experiment (MIT 18.06 style, Strang's quiz of 1 March 2010):
a generator of questions in plain text, each with a step-by-step worked solution (one elementary
row operation or one deduction per step, each step stating the state after it) and a canonical
final answer, all computed with :class:`fractions.Fraction` (no floats). Six kinds, in the order
of issue 16:

1. ``complete_solution``: R and d (``Rx = d``) from the complete solution
   ``x = x_p + c1 * s1 + c2 * s2`` of ``Ax = b`` (3 unknowns by default);
2. ``elimination``: E^-1, A and b from R, d and the elimination steps that produced them;
3. ``nullspace``: the special solutions of ``Ax = 0`` and the nullspace N(A) in words;
4. ``rref``: the reduced row echelon form, block matrices like ``[[A, A], [A, A]]`` included;
5. ``solvability``: does ``Ax = b`` have exactly one / infinitely many / no solution always,
   sometimes but not always, or never, for an m by n matrix of rank r;
6. ``column_space``: is b in the column space of A, and if so the x with ``Ax = b``.

Each kind has at least three phrasings (:data:`TEMPLATES`). Matrices are written row-major like
``[[1, 2, 0, 3], [2, 4, 1, 7], [0, 0, 2, 2]]``, vectors like ``[5, 11, 17]``, numbers as integers
or ``p/q`` in lowest terms (never ``2/1`` or ``2/4``).

**Steps.** Gauss-Jordan elimination goes column by column, the pivot row being the first row
at or below the current one with a nonzero entry (a fixed rule a model can learn): swap it up if
needed, scale it so the pivot is 1, then clear the column in every other row, top to bottom.
A row operation is written ``R1 <-> R2``, ``R2 = (1/3)*R2`` or ``R2 = R2 - 2*R1`` (the factor
always written), followed by `` -> `` and the whole matrix after it, e.g.
``R2 = R2 - 2*R1 -> [[1, 2, 0, 3], [0, 0, 1, 1], [0, 0, 2, 2]]``. With
:attr:`GeneratorConfig.arithmetic` a scaling or combination also computes the entries of the row
it changes, one by one, before the arrow: ``R2 = R2 - 2*R1: [2-2*1=0, 4-2*2=0, 1-2*0=1,
7-2*3=1] -> [[...]]`` (:func:`row_arithmetic`), and with :attr:`GeneratorConfig.products` each
combination's product before its sum: ``[2-2*1=2-2=0, ...]``.

**Training text** (:meth:`Problem.text`): the question on one line, then one line per step,
then ``Answer: <answer>``; :meth:`Problem.solution_text` is the same without the question (the
decoder's target when the question is the encoder's input), and :func:`split_solution` takes a
decoded solution apart again. No line holds a newline of its own.

**Answers** (:func:`grade` compares them exactly, whitespace aside):

* ``complete_solution``: ``R = [[...]]; d = [...]``
* ``elimination``: ``E^-1 = [[...]]; A = [[...]]; b = [...]``
* ``nullspace``: ``s1 = [...], s2 = [...]; N(A) is a plane in R^4`` (``no special solutions; ...``;
  the words are ``only the zero vector in R^n``, ``a line in R^n``, ``a plane in R^n``,
  ``a k-dimensional subspace of R^n``, ``all of R^n``)
* ``rref``: ``[[...]]``
* ``solvability``: ``always``, ``sometimes but not always`` or ``never``
* ``column_space``: ``yes; x = [...]`` or ``no`` (x with its free variables, if any, set to 0)

**Data.** :func:`generate` draws one problem, :func:`make_splits` fixed train / validation /
test splits (no test or validation question appears in training, compared by content, whatever
the phrasing), and :func:`prepare` writes them once as a TFDS ``array_record`` dataset through
the builder ``SparseJaxLinalgCot`` (features ``question``, ``steps``, ``answer``, ``kind``) and
reads them back with ``builder.as_data_source()``, without TensorFlow. Sizes are set by
:class:`GeneratorConfig`; its defaults are small enough for a small model (matrices up to 4 x 5
for rref, 3 x 5 for nullspaces, 4 x 3 for column spaces, 3 x 4 for elimination, entries in
[-9, 9], at most 16 steps and no number above 30 in a solution), and the issue's maxima (6 x 8
for rref, 4 x 6 for nullspaces) are allowed.

**Parsing.** :func:`parse_question` reads a question in any of the phrasings, and reasonable
user phrasings, into a :class:`ParsedQuestion`; malformed text raises ``ValueError`` naming what
could not be read. :func:`solve` is the symbolic solver that makes the data and the reference
answers; it is never the model's answer.

Example:

>>> q = ("Suppose A is the matrix [[1, 2], [3, 4], [5, 6]]. "
...      "Is b = [5, 11, 17] in the column space of A?")
>>> problem = solve(parse_question(q))
>>> print(problem.solution_text())
[A | b] = [[1, 2, 5], [3, 4, 11], [5, 6, 17]]
R2 = R2 - 3*R1 -> [[1, 2, 5], [0, -2, -4], [5, 6, 17]]
R3 = R3 - 5*R1 -> [[1, 2, 5], [0, -2, -4], [0, -4, -8]]
R2 = (-1/2)*R2 -> [[1, 2, 5], [0, 1, 2], [0, -4, -8]]
R1 = R1 - 2*R2 -> [[1, 0, 1], [0, 1, 2], [0, -4, -8]]
R3 = R3 + 4*R2 -> [[1, 0, 1], [0, 1, 2], [0, 0, 0]]
no row reads 0 = c with c != 0 -> b is in C(A)
x = [1, 2]
Answer: yes; x = [1, 2]
>>> grade("yes;  x = [1,2]", problem.answer), grade("yes; x = [2, 1]", problem.answer)
(True, False)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
import numbers
import os
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from sparse_jax.validation import check_bool, check_int

__all__ = [
    "ANSWER_PREFIX",
    "BUILDER_NAME",
    "FREQUENCIES",
    "KINDS",
    "PROPERTIES",
    "ROLES",
    "SPLITS",
    "STEP_TYPES",
    "TEMPLATES",
    "GeneratorConfig",
    "LinalgCotData",
    "ParsedQuestion",
    "Problem",
    "ProblemSource",
    "RowOp",
    "SparseJaxLinalgCot",  # noqa: F822 (defined on first use by __getattr__)
    "SparseJaxLinalgCotConfig",  # noqa: F822
    "distinct_questions",
    "first_divergence",
    "format_matrix",
    "format_number",
    "format_vector",
    "generate",
    "grade",
    "make_splits",
    "parse_question",
    "prepare",
    "row_arithmetic",
    "solution_roles",
    "solve",
    "split_solution",
    "step_type",
]

Matrix = tuple[tuple[Fraction, ...], ...]
Vector = tuple[Fraction, ...]

KINDS = ("complete_solution", "elimination", "nullspace", "rref", "solvability", "column_space")
# Properties of the solutions of Ax = b asked about by `solvability` questions, with their words.
PROPERTIES = {
    "unique": "exactly one solution",
    "many": "infinitely many solutions",
    "none": "no solution",
}
FREQUENCIES = ("always", "sometimes but not always", "never")
ANSWER_PREFIX = "Answer: "
_ALREADY_REDUCED = "the matrix is already in reduced row echelon form"

BUILDER_NAME = "sparse_jax_linalg_cot"
_BUILDER_VERSION = "1.0.0"
# Bumped when the generator's output changes for the same seed (part of every dataset's hash).
_FORMAT = 2

# -------------------------------------------------------------------------------------------
# Numbers, vectors, matrices.


def _counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless the count is 1: ``1 row``, ``0 rows``, ``3 rows``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def format_number(value: Fraction | int) -> str:
    """An exact number as text: an integer, or ``p/q`` in lowest terms with the sign on p.

    Example:

    >>> format_number(Fraction(6, -4)), format_number(Fraction(4, 2)), format_number(0)
    ('-3/2', '2', '0')
    """
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)):
        raise TypeError(f"format_number: `value` must be an int or a Fraction; got {value!r}")
    return str(Fraction(value))


def format_vector(vector: Sequence[Fraction | int]) -> str:
    """``[1, -1/2, 0]``.

    Example:

    >>> format_vector([Fraction(1), Fraction(-1, 2), 0])
    '[1, -1/2, 0]'
    """
    return "[" + ", ".join(format_number(x) for x in vector) + "]"


def format_matrix(matrix: Sequence[Sequence[Fraction | int]]) -> str:
    """Row-major ``[[1, 2], [3, 4]]``.

    Example:

    >>> format_matrix([[1, 2], [3, Fraction(4, 3)]])
    '[[1, 2], [3, 4/3]]'
    """
    return "[" + ", ".join(format_vector(row) for row in matrix) + "]"


def _as_matrix(rows: Sequence[Sequence[Fraction | int]]) -> Matrix:
    return tuple(tuple(Fraction(x) for x in row) for row in rows)


def _zeros(m: int, n: int) -> list[list[Fraction]]:
    return [[Fraction(0)] * n for _ in range(m)]


def _identity(m: int) -> Matrix:
    return tuple(tuple(Fraction(int(i == j)) for j in range(m)) for i in range(m))


def _matmul(a: Matrix, b: Matrix) -> Matrix:
    return tuple(
        tuple(
            sum((a[i][k] * b[k][j] for k in range(len(b))), Fraction(0)) for j in range(len(b[0]))
        )
        for i in range(len(a))
    )


def _matvec(a: Matrix, x: Vector) -> Vector:
    return tuple(
        sum((a_ij * x_j for a_ij, x_j in zip(row, x, strict=True)), Fraction(0)) for row in a
    )


def _variables(indices: Sequence[int]) -> str:
    """``x1, x3`` for the 0-based indices (0, 2); ``none`` for none."""
    return ", ".join(f"x{j + 1}" for j in indices) or "none"


# -------------------------------------------------------------------------------------------
# Row operations and Gauss-Jordan elimination.


@dataclass(frozen=True)
class RowOp:
    """One elementary row operation on rows numbered from 0 (written from 1 in text).

    ``kind`` is ``"swap"`` (exchange rows ``target`` and ``source``), ``"scale"`` (multiply row
    ``target`` by ``factor``, nonzero) or ``"add"`` (add ``factor`` times row ``source`` to row
    ``target``).

    Example:

    >>> op = RowOp("add", target=1, source=0, factor=Fraction(-2))
    >>> op.text(), op.inverse().text()
    ('R2 = R2 - 2*R1', 'R2 = R2 + 2*R1')
    >>> format_matrix(op.apply(_as_matrix([[1, 2], [2, 5]])))
    '[[1, 2], [0, 1]]'
    """

    kind: str
    target: int
    source: int = -1
    factor: Fraction = Fraction(1)

    def __post_init__(self) -> None:
        if self.kind not in ("swap", "scale", "add"):
            raise ValueError(f"RowOp: `kind` must be 'swap', 'scale' or 'add'; got {self.kind!r}")
        check_int(self.target, "target", "RowOp", low=0)
        if self.kind != "scale":
            check_int(self.source, "source", "RowOp", low=0)
            if self.source == self.target:
                raise ValueError(
                    f"RowOp: a {self.kind} needs two different rows; got target = source = "
                    f"{self.target}"
                )
        if not isinstance(self.factor, (int, Fraction)) or isinstance(self.factor, bool):
            raise TypeError(f"RowOp: `factor` must be a Fraction or an int; got {self.factor!r}")
        object.__setattr__(self, "factor", Fraction(self.factor))
        if self.kind == "scale" and self.factor == 0:
            raise ValueError("RowOp: a scale by 0 is not an elementary row operation (factor 0)")

    def rows_needed(self) -> int:
        """The number of rows a matrix needs for this operation."""
        return max(self.target, self.source) + 1

    def apply(self, matrix: Matrix) -> Matrix:
        """The matrix after this operation."""
        rows = [list(row) for row in matrix]
        if self.kind == "swap":
            rows[self.target], rows[self.source] = rows[self.source], rows[self.target]
        elif self.kind == "scale":
            rows[self.target] = [self.factor * x for x in rows[self.target]]
        else:
            source = rows[self.source]
            rows[self.target] = [
                x + self.factor * y for x, y in zip(rows[self.target], source, strict=True)
            ]
        return _as_matrix(rows)

    def inverse(self) -> RowOp:
        """The operation that undoes this one."""
        if self.kind == "swap":
            return self
        if self.kind == "scale":
            return RowOp("scale", self.target, factor=1 / self.factor)
        return RowOp("add", self.target, self.source, -self.factor)

    def text(self, label: str = "R") -> str:
        """``R1 <-> R2``, ``R2 = (1/3)*R2`` or ``R2 = R2 - 2*R1`` (rows: ``label`` + number)."""
        i = f"{label}{self.target + 1}"
        if self.kind == "swap":
            return f"{i} <-> {label}{self.source + 1}"
        if self.kind == "scale":
            return f"{i} = ({format_number(self.factor)})*{i}"
        sign = "-" if self.factor < 0 else "+"
        return f"{i} = {i} {sign} {format_number(abs(self.factor))}*{label}{self.source + 1}"


@dataclass(frozen=True)
class _Reduction:
    matrix: Matrix  # the reduced matrix
    ops: tuple[RowOp, ...]  # the operations, in order
    states: tuple[Matrix, ...]  # the matrix after each operation
    pivots: tuple[int, ...]  # the pivot column of row 0, 1, ... (in the order they were found)
    start: Matrix  # the matrix before the first operation

    def befores(self) -> tuple[Matrix, ...]:
        """The matrix before each operation (``start``, then each state but the last)."""
        return (self.start, *self.states)[: len(self.ops)]


def _reduce(matrix: Matrix, columns: Sequence[int] | None = None) -> _Reduction:
    """Gauss-Jordan elimination over ``columns`` (default: all, left to right), recording every
    operation: per column, the first row at or below the current pivot row with a nonzero entry
    is swapped up, scaled to a pivot of 1, and the column is cleared in every other row."""
    m = len(matrix)
    start = matrix
    columns = range(len(matrix[0])) if columns is None else columns
    ops: list[RowOp] = []
    states: list[Matrix] = []
    pivots: list[int] = []

    def record(op: RowOp) -> None:
        nonlocal matrix
        matrix = op.apply(matrix)
        ops.append(op)
        states.append(matrix)

    row = 0
    for col in columns:
        if row == m:
            break
        found = next((i for i in range(row, m) if matrix[i][col] != 0), None)
        if found is None:
            continue
        if found != row:
            record(RowOp("swap", row, found))
        if matrix[row][col] != 1:
            record(RowOp("scale", row, factor=1 / matrix[row][col]))
        for i in range(m):
            if i != row and matrix[i][col] != 0:
                record(RowOp("add", i, row, -matrix[i][col]))
        pivots.append(col)
        row += 1
    return _Reduction(matrix, tuple(ops), tuple(states), tuple(pivots), start)


def _rotate(matrix: Matrix) -> Matrix:
    """The matrix turned by 180 degrees (rows and columns reversed)."""
    return tuple(row[::-1] for row in reversed(matrix))


class _Arithmetic(enum.Enum):
    """How the worked solutions write row operations (:func:`solve`'s two switches)."""

    OFF = "off"  # the operation and the matrix after it
    TERMS = "terms"  # with the changed row's entries computed (row_arithmetic)
    PRODUCTS = "products"  # ... each combination's product written before its sum

    @classmethod
    def of(cls, arithmetic: bool, products: bool, caller: str) -> _Arithmetic:
        arithmetic = check_bool(arithmetic, "arithmetic", caller)
        if check_bool(products, "products", caller) and not arithmetic:
            raise ValueError(
                f"{caller}: `products`=True writes the products of the row arithmetic; it "
                "needs `arithmetic`=True"
            )
        return cls.PRODUCTS if products else cls.TERMS if arithmetic else cls.OFF


def _operand(x: Fraction) -> str:
    """A number as the right operand of ``*``: in parentheses when negative or a fraction."""
    text = format_number(x)
    return f"({text})" if x < 0 or x.denominator != 1 else text


def row_arithmetic(op: RowOp, matrix: Matrix, *, products: bool = False) -> str:
    """Each entry of the row ``op`` changes, computed from ``matrix`` (the matrix before it):
    ``a-k*b=c`` for ``Ri = Ri - k*Rj``, ``(k)*a=c`` for ``Ri = (k)*Ri``, one per column, in
    brackets like a vector (so that a model that reads literals, such as the encoder-decoder's
    ``literal_tokens``, knows each term's column); no spaces inside a term (they would lengthen
    the chains by a third); empty for a row exchange (nothing is computed). With ``products``,
    a combination's term writes its product before the sum, ``a-k*b=a-p=c`` with ``p = k*b``
    signed into the sum (``3-2*(-1)=3+2=5``), so that no single token computes both.

    The worked solutions write it between the operation and the matrix after it when
    :attr:`GeneratorConfig.arithmetic` is on, so that each new entry follows its operands.

    Example:

    >>> a = _as_matrix([[1, -1], [2, 1]])
    >>> row_arithmetic(RowOp("add", target=1, source=0, factor=Fraction(-2)), a)
    '[2-2*1=0, 1-2*(-1)=3]'
    >>> row_arithmetic(RowOp("add", target=1, source=0, factor=Fraction(-2)), a, products=True)
    '[2-2*1=2-2=0, 1-2*(-1)=1+2=3]'
    >>> row_arithmetic(RowOp("scale", target=1, factor=Fraction(1, 2)), a)
    '[(1/2)*2=1, (1/2)*1=1/2]'
    """
    if op.kind == "swap":
        return ""
    after = op.apply(matrix)[op.target]
    if op.kind == "scale":
        factor = format_number(op.factor)
        terms = [f"({factor})*{_operand(a)}" for a in matrix[op.target]]
    else:
        sign = "-" if op.factor < 0 else "+"
        factor = format_number(abs(op.factor))
        terms = []
        for a, b in zip(matrix[op.target], matrix[op.source], strict=True):
            term = f"{format_number(a)}{sign}{factor}*{_operand(b)}"
            if products:
                added = op.factor * b
                term += f"={format_number(a)}{'-' if added < 0 else '+'}{format_number(abs(added))}"
            terms.append(term)
    worked = (f"{term}={format_number(c)}" for term, c in zip(terms, after, strict=True))
    return f"[{', '.join(worked)}]"


def _row_op_step(
    op: RowOp, before: Matrix, after: Matrix, arithmetic: _Arithmetic, label: str = "R"
) -> str:
    """``R2 = R2 - 2*R1 -> [[...]]``, with :func:`row_arithmetic` of ``op`` on ``before``
    after a colon when ``arithmetic`` asks for it (``after``: the matrix after the arrow)."""
    worked = (
        row_arithmetic(op, before, products=arithmetic is _Arithmetic.PRODUCTS)
        if arithmetic is not _Arithmetic.OFF
        else ""
    )
    return f"{op.text(label)}{': ' + worked if worked else ''} -> {format_matrix(after)}"


def _op_steps(reduction: _Reduction, arithmetic: _Arithmetic, label: str = "R") -> list[str]:
    return [
        _row_op_step(op, before, state, arithmetic, label)
        for op, before, state in zip(
            reduction.ops, reduction.befores(), reduction.states, strict=True
        )
    ]


# -------------------------------------------------------------------------------------------
# Problems and parsed questions.


@dataclass(frozen=True)
class Problem:
    """A question, its worked solution (one step per item) and its canonical final answer.

    Example:

    >>> p = Problem("rref", "Find the reduced row echelon form R of A = [[2, 4]].",
    ...             ("R1 = (1/2)*R1 -> [[1, 2]]",), "[[1, 2]]")
    >>> print(p.text())
    Find the reduced row echelon form R of A = [[2, 4]].
    R1 = (1/2)*R1 -> [[1, 2]]
    Answer: [[1, 2]]
    >>> split_solution(p.solution_text()) == (p.steps, p.answer)
    True
    """

    # One of KINDS.
    kind: str
    # The question, one line.
    question: str
    # The chain of thought: one operation or deduction per step, each one line.
    steps: tuple[str, ...]
    # The canonical final answer (see the module docstring), one line.
    answer: str

    def solution_text(self) -> str:
        """The steps, one per line, then ``Answer: <answer>`` (the decoder's target)."""
        return "\n".join((*self.steps, ANSWER_PREFIX + self.answer))

    def text(self) -> str:
        """The question, a newline, then :meth:`solution_text` (one training example)."""
        return self.question + "\n" + self.solution_text()


def split_solution(text: str) -> tuple[tuple[str, ...], str | None]:
    """``(steps, answer)`` of a solution text as :meth:`Problem.solution_text` writes it.

    The answer is what follows the last line starting with ``Answer:`` (None when there is
    none, e.g. a decoded text cut short); steps are the non-empty lines before it.

    Example:

    >>> split_solution("R1 = (1/2)*R1 -> [[1, 2]]\\nAnswer: [[1, 2]]")
    (('R1 = (1/2)*R1 -> [[1, 2]]',), '[[1, 2]]')
    >>> split_solution("R1 = (1/2)*R1 -> [[1")
    (('R1 = (1/2)*R1 -> [[1',), None)
    """
    if not isinstance(text, str):
        raise TypeError(f"split_solution: `text` must be a str; got {type(text).__name__}")
    lines = [line.strip() for line in text.splitlines()]
    answer_at = [i for i, line in enumerate(lines) if line.startswith(ANSWER_PREFIX.strip())]
    if not answer_at:
        return tuple(line for line in lines if line), None
    last = answer_at[-1]
    answer = lines[last][len(ANSWER_PREFIX.strip()) :].strip()
    return tuple(line for line in lines[:last] if line), answer


# What each step of a worked solution does (step_type), tried in order on the step with an
# elimination's "undo <operation>: " taken off. [Rs]: rows of a matrix or of the special
# solutions (complete_solution puts those in special form with row operations on s1, s2, ...).
_STEP_PATTERNS = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("row exchange", r"([Rs]\d+) <-> [Rs]\d+ ->"),
        ("row scaling", r"([Rs]\d+) = \(-?\d+(?:/\d+)?\)\*\1(?: ->|: )"),
        ("row combination", r"([Rs]\d+) = \1 [-+] \d+(?:/\d+)?\*[Rs]\d+(?: ->|: )"),
        ("augmented matrix", r"(\[A \| b\]|start from \[I \| R \| d\]) = \["),
        ("block matrix", r"B = \["),
        ("already reduced", re.escape(_ALREADY_REDUCED)),
        ("pivot columns", r"(no pivot columns|pivot columns \d)"),
        ("special solution", r"x\d+ = [01](, x\d+ = [01])*(: .*)? -> s\d+ = \["),
        ("nullspace", r"\d+ special solutions? -> N\(A\) is "),
        ("rank and m", r"r = (m|\d+ < m) = \d+: "),
        ("rank and n", r"r = (n|\d+ < n) = \d+: "),
        ("conclusion", r"so Ax = b has "),
        ("consistency", r"(no row|row \d+) reads 0 = "),
        ("solution x", r"(free .* = 0: )?x = \["),
        ("free and pivot variables", r"free variables "),
        ("pivot row", r"pivot x\d+: row \d+ of R = \["),
        ("R", r"((rows? \d+ (to \d+ )?of R (is|are) zero) -> )?R = \["),
        ("d", r"d = R x_p = \["),
    )
)
STEP_TYPES = tuple(name for name, _ in _STEP_PATTERNS)
_UNDO = re.compile(r"undo [^:]*: ")


def step_type(step: str) -> str:
    """What one step of a worked solution does: a name of :data:`STEP_TYPES` (``row exchange``,
    ``row scaling``, ``row combination`` for the row operations of every kind, elimination's
    undone ones included; the other names for each kind's deductions, such as ``rank and n``
    or ``consistency``), or ``other`` for a line no solver writes. Every step :func:`solve`
    writes has a type (a test holds it to that), so a decoded chain can be told apart by
    where it goes wrong.

    Example:

    >>> step_type("R2 = R2 - 2*R1 -> [[1, 2], [0, 1]]"), step_type("r = 1 < n = 8: 7 free")
    ('row combination', 'rank and n')
    >>> step_type("undo R1 = (1/2)*R1: R1 = (2)*R1 -> [[2, 0]]"), step_type("hello")
    ('row scaling', 'other')
    """
    if not isinstance(step, str):
        raise TypeError(f"step_type: `step` must be a str; got {type(step).__name__}")
    text = step.strip()
    if text.startswith("undo "):
        text = _UNDO.sub("", text, count=1)
    return next((name for name, pattern in _STEP_PATTERNS if pattern.match(text)), "other")


# A row operation followed by its arithmetic (GeneratorConfig.arithmetic), elimination's
# "undo <operation>: " included: (operation, arithmetic, matrix after).
_WORKED_ROW_OP = re.compile(r"((?:undo [^:]*: )?[Rs]\d+ = [^:>]*?): (.*) -> (.*)")


def _step_parts(step: str) -> tuple[str, str, str]:
    """A step's operation, its arithmetic (``""`` unless a row operation writes it) and the
    state or deduction after it: split at its last `` -> ``, else at its first ``: ``
    (``r = 1 < n = 8: 7 free variables, ...``), else all result."""
    step = step.strip()
    worked = _WORKED_ROW_OP.fullmatch(step)
    if worked:
        operation, arithmetic, result = worked.groups()
        return operation.strip(), arithmetic.strip(), result.strip()
    if " -> " in step:
        operation, result = step.rsplit(" -> ", 1)
    elif ": " in step:
        operation, result = step.split(": ", 1)
    else:
        operation, result = "", step
    return operation.strip(), "", result.strip()


def first_divergence(written: Sequence[str], reference: Sequence[str]) -> str | None:
    """Where a written chain of thought first leaves the reference's steps, or None when every
    step is the reference's (the final answer is not looked at).

    ``"<step type>: operation"`` when the first differing step does something else (another
    row operation, another comparison), ``"<step type>: arithmetic"`` when it does the same
    but computes the changed row's entries wrong (:attr:`GeneratorConfig.arithmetic`),
    ``"<step type>: result"`` when it gets the state or deduction after it wrong (the text
    after `` -> `` or ``: ``), ``"<step type>: missing"`` when the chain stops before the
    reference's step, and ``"extra steps"`` when it goes on after the reference's last; the
    step type (:func:`step_type`) is the reference's. Steps are compared whitespace aside at
    both ends.

    Example:

    >>> ref = ["R2 = R2 - 2*R1 -> [[1, 2], [0, 1]]", "R1 = R1 - 2*R2 -> [[1, 0], [0, 1]]"]
    >>> first_divergence(["R2 = R2 - 2*R1 -> [[1, 2], [0, 3]]"], ref)
    'row combination: result'
    >>> first_divergence(ref[:1], ref), first_divergence(ref, ref)
    ('row combination: missing', None)
    >>> first_divergence(["R2 = R2 - 2*R1: [2-2*1=0, 5-2*2=3] -> [[1, 2], [0, 3]]"],
    ...                  ["R2 = R2 - 2*R1: [2-2*1=0, 5-2*2=1] -> [[1, 2], [0, 1]]"])
    'row combination: arithmetic'
    """
    for name, steps in (("written", written), ("reference", reference)):
        if (
            not isinstance(steps, Sequence)
            or isinstance(steps, str)
            or not all(isinstance(x, str) for x in steps)
        ):
            raise TypeError(f"first_divergence: `{name}` must be a sequence of str; got {steps!r}")
    for mine, theirs in zip(written, reference, strict=False):
        if mine.strip() == theirs.strip():
            continue
        my_parts, their_parts = _step_parts(mine), _step_parts(theirs)
        if my_parts[0] != their_parts[0]:
            part = "operation"
        elif my_parts[1] != their_parts[1]:
            part = "arithmetic"
        else:
            part = "result"
        return f"{step_type(theirs)}: {part}"
    if len(written) > len(reference):
        return "extra steps"
    if len(written) < len(reference):
        return f"{step_type(reference[len(written)])}: missing"
    return None


# What each byte of a worked solution writes (solution_roles), in the order of the line.
ROLES = (
    "operation",
    "operand",
    "factor",
    "product",
    "term result",
    "arithmetic",
    "state",
    "answer",
)
_NUMBER = r"-?\d+(?:/\d+)?"
_UNSIGNED = r"\d+(?:/\d+)?"
# One term of row_arithmetic: a+k*b=c (a combination; a+k*b=a+p=c with its product) or
# (k)*a=c (a scaling).
_TERM = re.compile(
    rf"(?:(?P<a>{_NUMBER})[-+](?P<k>{_UNSIGNED})\*(?P<b>{_NUMBER}|\({_NUMBER}\))"
    rf"(?:=(?P<again>{_NUMBER})[-+](?P<p>{_UNSIGNED}))?"
    rf"|\((?P<scale>{_NUMBER})\)\*(?P<x>{_NUMBER}|\({_NUMBER}\)))=(?P<c>{_NUMBER})"
)
_TERM_ROLES = {
    "a": "operand",
    "b": "operand",
    "x": "operand",
    "again": "operand",
    "k": "factor",
    "scale": "factor",
    "p": "product",
    "c": "term result",
}


def _line_roles(line: str) -> list[str]:
    """The role of each character of one line of a worked solution (see :func:`solution_roles`)."""
    if line.startswith(ANSWER_PREFIX.strip()):
        return ["answer"] * len(line)
    roles = ["state"] * len(line)
    worked = _WORKED_ROW_OP.fullmatch(line)
    if worked:
        roles[: worked.end(1)] = ["operation"] * worked.end(1)
        start, end = worked.span(2)
        roles[worked.end(1) : end] = ["arithmetic"] * (end - worked.end(1))
        for term in _TERM.finditer(line, start, end):
            for group, role in _TERM_ROLES.items():
                if term.group(group) is not None:
                    lo, hi = term.span(group)
                    roles[lo:hi] = [role] * (hi - lo)
        return roles
    operation = line.rfind(" -> ") if " -> " in line else line.find(": ")
    if operation > 0:
        roles[:operation] = ["operation"] * operation
    return roles


def solution_roles(solution: str) -> tuple[str, ...]:
    """What each UTF-8 byte of a worked solution (:meth:`Problem.solution_text`) writes, one
    name of :data:`ROLES` per byte, so that a model's next-token accuracy on the reference can
    be told apart by the part of a step it writes:

    * ``operation``: what a step does (``R2 = R2 - 2*R1``, ``r = 1 < n = 8``), the text
      before its `` -> `` or, without one, its first ``: `` (:func:`first_divergence`'s
      operation);
    * with :attr:`GeneratorConfig.arithmetic`, each term of :func:`row_arithmetic`: its
      ``operand`` entries (read from the matrix before; with :attr:`GeneratorConfig.products`
      also the first one again before the product), its ``factor``, its ``product`` (with
      products), its ``term result`` (the new entry computed), and ``arithmetic`` for the
      brackets, signs and separators between them;
    * ``state``: the state or deduction after the operation (`` -> [[...]]``, ``: 7 free``),
      the newline that ends the line included, and every line with no operation;
    * ``answer``: the ``Answer:`` line.

    Example:

    >>> text = "R2 = R2 - 2*R1: [5-2*2=1] -> [[1, 2], [0, 1]]\\nAnswer: [[1, 2], [0, 1]]"
    >>> roles = solution_roles(text)
    >>> len(roles) == len(text.encode()), roles[:2], roles[17:22]
    (True, ('operation', 'operation'), ('operand', 'arithmetic', 'factor', 'arithmetic', 'operand'))
    >>> roles[22:25], roles[-1]
    (('arithmetic', 'term result', 'arithmetic'), 'answer')
    """
    if not isinstance(solution, str):
        raise TypeError(f"solution_roles: `solution` must be a str; got {type(solution).__name__}")
    roles: list[str] = []
    lines = solution.split("\n")
    for i, line in enumerate(lines):
        end = ["state"] if i < len(lines) - 1 else []  # the newline after the line
        for char, role in zip(line + "\n" * len(end), _line_roles(line) + end, strict=True):
            roles += [role] * len(char.encode("utf-8"))
    return tuple(roles)


def _canonical_answer(answer: str) -> str:
    text = answer.strip()
    if text.startswith(ANSWER_PREFIX.strip()):
        text = text[len(ANSWER_PREFIX.strip()) :]
    return "".join(text.split())


def grade(predicted_answer: str, reference_answer: str) -> bool:
    """Whether a predicted final answer equals the reference exactly, whitespace aside.

    A leading ``Answer:`` is ignored; nothing else is forgiven (``2/4`` is not ``1/2``, ``Yes``
    is not ``yes``): the answers are canonical so that exact match is the grade.

    Example:

    >>> grade("Answer: [[1, 0],[0, 1]]", "[[1, 0], [0, 1]]"), grade("[2/4]", "[1/2]")
    (True, False)
    """
    for name, value in (
        ("predicted_answer", predicted_answer),
        ("reference_answer", reference_answer),
    ):
        if not isinstance(value, str):
            raise TypeError(f"grade: `{name}` must be a str; got {type(value).__name__}")
    return _canonical_answer(predicted_answer) == _canonical_answer(reference_answer)


@dataclass(frozen=True)
class ParsedQuestion:
    """What a question asks, as exact values; :func:`parse_question` makes it, :func:`solve`
    answers it. Each kind uses some of the fields (the others keep their defaults):

    * ``complete_solution``: ``x_p``, ``special`` (s1, s2, ...), ``rows`` (m, the rows of A);
    * ``elimination``: ``R``, ``d``, ``operations`` (the elimination steps, in order);
    * ``nullspace``: ``A``;
    * ``rref``: ``A`` and, for a block matrix, ``block`` (the multiple of A in each block,
      e.g. ``((1, 1), (1, 1))`` for ``[[A, A], [A, A]]``; 0 is a zero block);
    * ``solvability``: ``rows``, ``cols``, ``rank``, ``solutions`` (what is asked of the
      solutions of Ax = b: a key of ``PROPERTIES``);
    * ``column_space``: ``A``, ``b``.

    Example:

    >>> parsed = parse_question("What is rref(A) for the matrix A = [[2, 4], [1, 3]]?")
    >>> parsed.kind, format_matrix(parsed.A)
    ('rref', '[[2, 4], [1, 3]]')
    """

    kind: str
    question: str
    A: Matrix | None = None
    b: Vector | None = None
    R: Matrix | None = None
    d: Vector | None = None
    block: Matrix | None = None
    x_p: Vector | None = None
    special: tuple[Vector, ...] = ()
    rows: int | None = None
    cols: int | None = None
    rank: int | None = None
    solutions: str | None = None
    operations: tuple[RowOp, ...] = ()

    @property
    def key(self) -> str:
        """The question's content, whatever its phrasing (splits are disjoint in it)."""
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "question" and getattr(self, f.name) not in (None, ())
        }

        def text(value: Any) -> Any:
            if isinstance(value, Fraction):
                return format_number(value)
            if isinstance(value, RowOp):
                return value.text()
            if isinstance(value, tuple):
                return [text(v) for v in value]
            return value

        return json.dumps({name: text(value) for name, value in fields.items()}, sort_keys=True)


# -------------------------------------------------------------------------------------------
# The solver.


def _nullspace_words(dimension: int, n: int) -> str:
    if dimension == 0:
        return f"only the zero vector in R^{n}"
    if dimension == n:
        return f"all of R^{n}"
    if dimension == 1:
        return f"a line in R^{n}"
    if dimension == 2:
        return f"a plane in R^{n}"
    return f"a {dimension}-dimensional subspace of R^{n}"


def _reduction_steps(reduction: _Reduction, arithmetic: _Arithmetic) -> list[str]:
    return _op_steps(reduction, arithmetic) or [_ALREADY_REDUCED]


def _expand_block(a: Matrix, block: Matrix) -> Matrix:
    return tuple(
        tuple(c * x for c in block_row for x in a_row) for block_row in block for a_row in a
    )


def _solve_rref(p: ParsedQuestion, arithmetic: _Arithmetic) -> tuple[list[str], str]:
    steps = []
    matrix = p.A
    if p.block is not None:
        matrix = _expand_block(p.A, p.block)
        steps.append(f"B = {format_matrix(matrix)}")
    reduction = _reduce(matrix)
    steps += _reduction_steps(reduction, arithmetic)
    return steps, format_matrix(reduction.matrix)


def _solve_nullspace(p: ParsedQuestion, arithmetic: _Arithmetic) -> tuple[list[str], str]:
    reduction = _reduce(p.A)
    steps = _reduction_steps(reduction, arithmetic)
    n = len(p.A[0])
    pivots = sorted(reduction.pivots)
    free = [j for j in range(n) if j not in pivots]
    pivot_text = ", ".join(str(j + 1) for j in pivots)
    free_text = ", ".join(str(j + 1) for j in free)
    steps.append(
        (f"pivot columns {pivot_text}" if pivots else "no pivot columns")
        + (f"; free columns {free_text}" if free else "; no free columns")
    )
    r = reduction.matrix
    solutions = []
    for k, f in enumerate(free):
        s = [Fraction(0)] * n
        s[f] = Fraction(1)
        for i, pivot in enumerate(pivots):
            s[pivot] = -r[i][f]
        set_free = ", ".join(f"x{j + 1} = {int(j == f)}" for j in free)
        solved = ", ".join(f"x{pivot + 1} = {format_number(s[pivot])}" for pivot in pivots)
        steps.append(
            f"{set_free}{': ' + solved if solved else ''} -> s{k + 1} = {format_vector(s)}"
        )
        solutions.append(f"s{k + 1} = {format_vector(s)}")
    words = _nullspace_words(len(free), n)
    steps.append(f"{_counted(len(free), 'special solution')} -> N(A) is {words}")
    listed = ", ".join(solutions) if solutions else "no special solutions"
    return steps, f"{listed}; N(A) is {words}"


def _solve_column_space(p: ParsedQuestion, arithmetic: _Arithmetic) -> tuple[list[str], str]:
    n = len(p.A[0])
    augmented = tuple((*row, b_i) for row, b_i in zip(p.A, p.b, strict=True))
    steps = [f"[A | b] = {format_matrix(augmented)}"]
    reduction = _reduce(augmented, columns=range(n))
    steps += _op_steps(reduction, arithmetic)
    r = reduction.matrix
    for i, row in enumerate(r):
        if all(x == 0 for x in row[:n]) and row[n] != 0:
            steps.append(f"row {i + 1} reads 0 = {format_number(row[n])} -> b is not in C(A)")
            return steps, "no"
    steps.append("no row reads 0 = c with c != 0 -> b is in C(A)")
    x = [Fraction(0)] * n
    for i, pivot in enumerate(reduction.pivots):
        x[pivot] = r[i][n]
    free = [j for j in range(n) if j not in reduction.pivots]
    prefix = f"free {_variables(free)} = 0: " if free else ""
    steps.append(f"{prefix}x = {format_vector(x)}")
    return steps, f"yes; x = {format_vector(x)}"


def _solvability_answer(m: int, n: int, r: int, prop: str) -> str:
    every_b = r == m  # C(A) is all of R^m
    unique = r == n  # no free variables
    if prop == "none":
        return "never" if every_b else "sometimes but not always"
    has_it = unique if prop == "unique" else not unique
    if not has_it:
        return "never"
    return "always" if every_b else "sometimes but not always"


def _solve_solvability(p: ParsedQuestion, arithmetic: _Arithmetic) -> tuple[list[str], str]:
    del arithmetic  # no row operations
    m, n, r = p.rows, p.cols, p.rank
    if r == m:
        first = f"r = m = {m}: C(A) is all of R^{m}, so Ax = b has a solution for every b"
    else:
        first = (
            f"r = {r} < m = {m}: C(A) is not all of R^{m}, so Ax = b has a solution for some b "
            "(b = 0) but not for others"
        )
    if r == n:
        second = f"r = n = {n}: no free variables, so a solution is unique"
    else:
        free_variables = _counted(n - r, "free variable")
        second = f"r = {r} < n = {n}: {free_variables}, so a solution is never unique"
    answer = _solvability_answer(m, n, r, p.solutions)
    return [first, second, f"so Ax = b has {PROPERTIES[p.solutions]}: {answer}"], answer


def _solve_complete_solution(p: ParsedQuestion, arithmetic: _Arithmetic) -> tuple[list[str], str]:
    n, m = len(p.x_p), p.rows
    steps = []
    special_of: dict[int, Vector] = {}
    if p.special:
        # Putting s1, s2, ... in special form (1 on its own free variable, 0 on the others) is
        # Gauss-Jordan on the matrix of their rows turned by 180 degrees: free variables are
        # those that can be the last nonzero entry of a nullspace vector, and special solutions
        # listed in the order of their free variables need no operation at all.
        reduction = _reduce(_rotate(_as_matrix(p.special)))
        if len(reduction.pivots) < len(p.special):
            raise ValueError(
                "solve: the vectors of the complete solution after c1, c2, ... must be "
                f"independent; got {', '.join(format_vector(s) for s in p.special)}"
            )
        k = len(p.special)
        steps_of = zip(reduction.ops, reduction.befores(), reduction.states, strict=True)
        for op, before, state in steps_of:
            turned = RowOp(op.kind, k - 1 - op.target, k - 1 - op.source, op.factor)
            if op.kind == "scale":
                turned = RowOp("scale", k - 1 - op.target, factor=op.factor)
            steps.append(_row_op_step(turned, _rotate(before), _rotate(state), arithmetic, "s"))
        special_of = {
            n - 1 - col: row[::-1]
            for col, row in zip(reduction.pivots, reduction.matrix, strict=False)
        }
    free = sorted(special_of)
    pivots = [j for j in range(n) if j not in special_of]
    if m < len(pivots):
        raise ValueError(
            f"solve: A has {_counted(m, 'row')} but the complete solution needs rank "
            f"{len(pivots)} ({n} unknowns, {len(free)} special solutions): `rows` must be >= "
            f"{len(pivots)}"
        )
    names = ", ".join(f"s{k + 1}" for k in range(len(free)))
    source = f" (the 1s of {names})" if free else ""
    steps.append(f"free variables {_variables(free)}{source}; pivot variables {_variables(pivots)}")
    r = _zeros(m, n)
    for i, pivot in enumerate(pivots):
        r[i][pivot] = Fraction(1)
        for f in free:
            r[i][f] = -special_of[f][pivot]
        steps.append(f"pivot x{pivot + 1}: row {i + 1} of R = {format_vector(r[i])}")
    r_matrix = _as_matrix(r)
    zero_rows = m - len(pivots)
    if zero_rows == 1:
        steps.append(f"row {m} of R is zero -> R = {format_matrix(r_matrix)}")
    elif zero_rows > 1:
        steps.append(
            f"rows {len(pivots) + 1} to {m} of R are zero -> R = {format_matrix(r_matrix)}"
        )
    else:
        steps.append(f"R = {format_matrix(r_matrix)}")
    d = _matvec(r_matrix, p.x_p)
    steps.append(f"d = R x_p = {format_vector(d)}")
    return steps, f"R = {format_matrix(r_matrix)}; d = {format_vector(d)}"


def _solve_elimination(p: ParsedQuestion, arithmetic: _Arithmetic) -> tuple[list[str], str]:
    m, n = len(p.R), len(p.R[0])
    state = tuple((*e, *row, d_i) for e, row, d_i in zip(_identity(m), p.R, p.d, strict=True))
    steps = [f"start from [I | R | d] = {format_matrix(state)}"]
    for op in reversed(p.operations):
        undo = op.inverse()
        before, state = state, undo.apply(state)
        steps.append(f"undo {op.text()}: {_row_op_step(undo, before, state, arithmetic)}")
    e_inverse = tuple(row[:m] for row in state)
    a = tuple(row[m : m + n] for row in state)
    b = tuple(row[-1] for row in state)
    answer = f"E^-1 = {format_matrix(e_inverse)}; A = {format_matrix(a)}; b = {format_vector(b)}"
    return steps, answer


_SOLVERS = {
    "complete_solution": _solve_complete_solution,
    "elimination": _solve_elimination,
    "nullspace": _solve_nullspace,
    "rref": _solve_rref,
    "solvability": _solve_solvability,
    "column_space": _solve_column_space,
}


def _check_matrix(value: Any, name: str, kind: str) -> Matrix:
    if not (
        isinstance(value, tuple)
        and value
        and all(isinstance(row, tuple) and row for row in value)
        and all(isinstance(x, Fraction) for row in value for x in row)
    ):
        raise TypeError(
            f"solve: a {kind} question needs `{name}` as a non-empty tuple of non-empty tuples of "
            f"Fractions; got {value!r:.120}"
        )
    if len({len(row) for row in value}) != 1:
        raise ValueError(
            f"solve: the rows of `{name}` must have equal lengths; got {[len(r) for r in value]}"
        )
    return value


def _check_vector(value: Any, name: str, kind: str, length: int | None = None) -> Vector:
    if not (isinstance(value, tuple) and value and all(isinstance(x, Fraction) for x in value)):
        raise TypeError(
            f"solve: a {kind} question needs `{name}` as a non-empty tuple of Fractions; got "
            f"{value!r:.120}"
        )
    if length is not None and len(value) != length:
        raise ValueError(f"solve: `{name}` must have {length} entries; got {format_vector(value)}")
    return value


def _check_parsed(p: ParsedQuestion) -> None:
    """The fields each kind needs, with consistent shapes."""
    kind = p.kind
    if kind in ("rref", "nullspace", "column_space"):
        a = _check_matrix(p.A, "A", kind)
        if kind == "column_space":
            _check_vector(p.b, "b", kind, len(a))
        if kind == "rref" and p.block is not None:
            _check_matrix(p.block, "block", kind)
    elif kind == "elimination":
        r = _check_matrix(p.R, "R", kind)
        _check_vector(p.d, "d", kind, len(r))
        for op in p.operations:
            if not isinstance(op, RowOp):
                raise TypeError(f"solve: `operations` must hold RowOps; got {op!r:.80}")
            if op.rows_needed() > len(r):
                raise ValueError(
                    f"solve: the row operation {op.text()} needs {op.rows_needed()} rows, but R "
                    f"has {len(r)}"
                )
    elif kind == "complete_solution":
        x_p = _check_vector(p.x_p, "x_p", kind)
        for k, s in enumerate(p.special):
            _check_vector(s, f"special[{k}]", kind, len(x_p))
        check_int(p.rows, "rows", "solve")
    elif kind == "solvability":
        m = check_int(p.rows, "rows", "solve")
        n = check_int(p.cols, "cols", "solve")
        check_int(p.rank, "rank", "solve", low=0, high=min(m, n))
        if p.solutions not in PROPERTIES:
            raise ValueError(
                f"solve: `solutions` must be one of {sorted(PROPERTIES)}; got {p.solutions!r}"
            )
    else:
        raise ValueError(f"solve: `kind` must be one of {KINDS}; got {kind!r}")


def solve(parsed: ParsedQuestion, *, arithmetic: bool = False, products: bool = False) -> Problem:
    """The worked solution and canonical answer of a parsed question (the symbolic solver).

    It makes the data and the reference answers for grading; it is never a model's answer.
    With ``arithmetic``, each row scaling or combination also writes the entries of the row it
    changes, computed one by one (:func:`row_arithmetic`), between the operation and the
    matrix after it (:attr:`GeneratorConfig.arithmetic`); with ``products`` too, each
    combination's term writes its product before its sum (:attr:`GeneratorConfig.products`).

    Example:

    >>> problem = solve(parse_question(
    ...     "A is a 3 by 5 matrix of rank 3. Does Ax = b have exactly one solution always, "
    ...     "sometimes but not always, or never?"))
    >>> problem.steps[1], problem.answer
    ('r = 3 < n = 5: 2 free variables, so a solution is never unique', 'never')
    """
    if not isinstance(parsed, ParsedQuestion):
        raise TypeError(f"solve: `parsed` must be a ParsedQuestion; got {type(parsed).__name__}")
    worked = _Arithmetic.of(arithmetic, products, "solve")
    _check_parsed(parsed)
    steps, answer = _SOLVERS[parsed.kind](parsed, worked)
    return Problem(parsed.kind, parsed.question, tuple(steps), answer)


# -------------------------------------------------------------------------------------------
# Phrasings. Fields: {A}, {b}, {R}, {d}, {x}, {block} (a block pattern such as [[A, A], [A, A]]),
# {ops} (row operations joined by "; "), {m}, {n}, {r}, {rows} ("1 row", "3 rows"), {property}
# (words of PROPERTIES).

TEMPLATES: Mapping[str, tuple[str, ...]] = {
    "complete_solution": (
        "The complete solution of Ax = b is x = {x}, and A is {m} by {n}. Find the reduced row "
        "echelon form R of A and the vector d in Rx = d.",
        "Suppose the {m} by {n} matrix A has the complete solution x = {x} to Ax = b. What are "
        "R = rref(A) and d, where Ax = b reduces to Rx = d?",
        "A has {rows} and every solution of Ax = b is x = {x}. Give R and d for the reduced "
        "system Rx = d.",
    ),
    "elimination": (
        "Elimination took [A b] to [R d] with R = {R} and d = {d} by the steps {ops}, in this "
        "order. Find E^-1 (so that A = E^-1 R), A and b.",
        "The row operations {ops} reduce A to R = {R} and b to d = {d}. Undo them: what are "
        "E^-1, A and b?",
        "From R = {R}, d = {d} and the elimination steps {ops}, recover the matrix E^-1 that "
        "connects them (A = E^-1 R) and find A and b.",
    ),
    "nullspace": (
        "Find the special solutions of Ax = 0 for A = {A} and describe the nullspace N(A) in "
        "words.",
        "For A = {A}, what are the special solutions to Ax = 0, and what is N(A)?",
        "Let A = {A}. Compute the special solutions of Ax = 0 and say what the nullspace of A is.",
        "Describe the null space of the matrix {A} and give its special solutions.",
    ),
    "rref": (
        "Find the reduced row echelon form R of A = {A}.",
        "Reduce A = {A} to its reduced row echelon form R = rref(A).",
        "What is rref(A) for the matrix A = {A}?",
        "Row reduce the matrix {A} all the way to reduced row echelon form.",
        "Let A = {A}. Find the reduced row echelon form of the block matrix B = {block}.",
        "For A = {A}, what is rref(B) where B = {block}?",
        "A = {A}. Row reduce B = {block} to reduced row echelon form.",
    ),
    "solvability": (
        "The matrix A is {m} by {n} with rank {r}. Does Ax = b have {property} always, sometimes "
        "but not always, or never?",
        "Suppose the {m} by {n} matrix A has rank r = {r}. Is it always, sometimes but not "
        "always, or never true that Ax = b has {property}?",
        "For an m by n matrix A with m = {m}, n = {n} and rank r = {r}: does Ax = b have "
        "{property} always, sometimes but not always, or never?",
    ),
    "column_space": (
        "Suppose A is the matrix {A}. Is b = {b} in the column space of A?",
        "Is b = {b} in the column space C(A) of A = {A}? If so, find x with Ax = b.",
        "Let A = {A} and b = {b}. Decide whether b is in C(A), and if it is, solve Ax = b.",
        "Can Ax = b be solved for A = {A} and b = {b}? Say whether b is in the column space and "
        "give x.",
    ),
}
# Block patterns of rref questions: the multiple of A in each block (0: a zero block).
_BLOCKS = (
    ((1, 1), (1, 1)),
    ((1, 1),),
    ((1,), (1,)),
    ((1, 0), (0, 1)),
    ((1, 2),),
)


def _format_block(block: Matrix) -> str:
    def entry(c: Fraction) -> str:
        if c == 0:
            return "0"
        if c == 1:
            return "A"
        if c == -1:
            return "-A"
        return f"{format_number(c)}A"

    return "[" + ", ".join("[" + ", ".join(entry(c) for c in row) + "]" for row in block) + "]"


# -------------------------------------------------------------------------------------------
# The parser.

_ATOM = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_BLOCK_ATOM = re.compile(r"(-?\d+(?:/\d+)?)?\s*\*?\s*([A-Za-z])|(-)\s*([A-Za-z])|(0)")
_NAME_BEFORE = re.compile(
    r"(?:^|[^\w^])([A-Za-z]\w*)\s*(?:=|:|is the matrix|is the vector|is the column vector|is)\s*$"
)
_COEFFICIENT_BEFORE = re.compile(r"\+\s*([A-Za-z]\w*)\s*\*?\s*$")
_OP_START = re.compile(r"\bR(\d+)\s*(?:=|<->|↔)")
_NUM = r"(-?\d+(?:/\d+)?)"
_SWAP = re.compile(r"R(\d+)\s*(?:<->|↔)\s*R(\d+)")
_SCALE = re.compile(rf"R(\d+)\s*=\s*\(?\s*{_NUM}\s*\)?\s*\*?\s*R(\d+)(?!\s*[-+]\s*\d*\s*\*?\s*R)")
_ADD = re.compile(rf"R(\d+)\s*=\s*R(\d+)\s*([-+])\s*(?:\(?\s*{_NUM}\s*\)?\s*\*?\s*)?R(\d+)")
_DIMS = re.compile(r"\b(\d+)\s*(?:by|x|×)\s*(\d+)\b")
_RANK = re.compile(
    r"\brank\s*(?:\(a\)\s*)?(?:r\s*=\s*|of\s+|=\s*|is\s+|r\s+)?(\d+)\b|\br\s*=\s*(\d+)\b",
    re.IGNORECASE,
)
_PROPERTY_PATTERNS = {
    "unique": re.compile(r"\b(?:exactly one|a unique|unique|one and only one) solutions?\b"),
    "many": re.compile(r"\b(?:infinitely many|many|more than one) solutions\b"),
    "none": re.compile(r"\bno solutions?\b"),
}
_MAX_QUESTION_CHARS = 4000
_MAX_ATOM_CHARS = 24


@dataclass(frozen=True)
class _Literal:
    start: int  # where it starts in the question
    value: list  # a vector: a list of atoms (strings); a matrix: a list of such lists
    depth: int  # 1 (vector) or 2 (matrix)
    name: str | None  # the name written before it, None when unnamed
    text: str


_ATOM_TEXT = re.compile(r"[^\[\],]*")


def _read_list(text: str, i: int, start: int, depth: int = 1) -> tuple[list, int]:
    """The list opening at ``text[i] == "["`` (items: atoms or lists) and the index after it."""
    if depth > 2:
        raise ValueError(f"lists nested more than two deep in {text[start : i + 1]!r}...")
    items: list = []
    i += 1
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        item_start = i
        if i < len(text) and text[i] == "[":
            item, i = _read_list(text, i, start, depth + 1)
        else:
            match = _ATOM_TEXT.match(text, i)
            item, i = match.group(0).strip(), match.end()
            if not item:
                raise ValueError(f"an empty entry in {text[start : i + 1]!r}")
        items.append(item)
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            raise ValueError(
                f"unbalanced brackets: the '[' at character {start} is never closed "
                f"({text[start : start + 40]!r}...)"
            )
        if text[i] == "]":
            return items, i + 1
        if text[i] != ",":
            raise ValueError(
                f"expected ',' or ']' after {text[item_start:i].strip()!r} in "
                f"{text[start : i + 1]!r}"
            )
        i += 1


def _scan_literals(text: str) -> list[_Literal]:
    """Every top-level bracketed literal ``[...]`` of ``text`` with the name written before it
    (``A = [[...]]``, ``A is the matrix [[...]]``, ``+ c1 * [...]``; None when unnamed)."""
    literals = []
    i = 0
    while i < len(text):
        if text[i] == "]":
            raise ValueError(f"unbalanced brackets: the ']' at character {i} closes nothing")
        if text[i] != "[":
            i += 1
            continue
        start = i
        value, i = _read_list(text, i, start)
        nested = [isinstance(item, list) for item in value]
        if any(nested) and not all(nested):
            raise ValueError(
                f"{text[start:i]!r} is neither a vector [..] nor a matrix [[..], [..]] (it mixes "
                "numbers and lists)"
            )
        before = text[max(0, start - 60) : start]
        named = _NAME_BEFORE.search(before) or _COEFFICIENT_BEFORE.search(before)
        literals.append(
            _Literal(start, value, 2 if all(nested) else 1, named and named.group(1), text[start:i])
        )
    return literals


def _number(atom: str, where: str) -> Fraction:
    if len(atom) > _MAX_ATOM_CHARS or not _ATOM.fullmatch(atom):
        raise ValueError(
            f"the entry {atom[:_MAX_ATOM_CHARS]!r} of {where} is not a number (allowed: integers, "
            "fractions p/q, decimals such as 1.5)"
        )
    numerator, _, denominator = atom.partition("/")
    if denominator and int(denominator) == 0:
        raise ValueError(f"the entry {atom!r} of {where} divides by zero")
    return Fraction(numerator) / (Fraction(denominator) if denominator else 1)


def _to_matrix(lit: _Literal, name: str) -> Matrix:
    if lit.depth != 2:
        raise ValueError(f"{name} must be a matrix [[..], [..]]; got {lit.text!r:.120}")
    lengths = [len(row) for row in lit.value]
    if len(set(lengths)) != 1:
        raise ValueError(
            f"the rows of the matrix {name} = {lit.text:.120} have different lengths {lengths}"
        )
    return tuple(tuple(_number(x, f"the matrix {name}") for x in row) for row in lit.value)


def _to_vector(lit: _Literal, name: str) -> Vector:
    if lit.depth != 1:
        raise ValueError(f"{name} must be a vector [..]; got {lit.text!r:.120}")
    return tuple(_number(x, f"the vector {name}") for x in lit.value)


def _atoms(lit: _Literal) -> list[str]:
    return [x for row in lit.value for x in row] if lit.depth == 2 else list(lit.value)


def _is_block(lit: _Literal) -> bool:
    """A block pattern such as ``[[A, A], [0, 2A]]``: multiples of a letter and zeros."""
    atoms = _atoms(lit)
    return all(_BLOCK_ATOM.fullmatch(x) for x in atoms) and any(
        re.search("[A-Za-z]", x) for x in atoms
    )


def _is_numeric(lit: _Literal) -> bool:
    """Meant as numbers: not a block pattern, and some entry is a number (``[A b]`` is prose)."""
    return not _is_block(lit) and any(_ATOM.fullmatch(x) for x in _atoms(lit))


def _one(literals: list[_Literal], depth: int, what: str) -> _Literal:
    """The only numeric matrix (``depth`` 2) or vector (1) of the question."""
    found = [lit for lit in literals if lit.depth == depth and _is_numeric(lit)]
    shape = "matrix" if depth == 2 else "vector"
    if not found:
        example = "[[1, 2], [3, 4]]" if depth == 2 else "[1, 2, 3]"
        raise ValueError(f"could not find the {shape} {what} (written like {example})")
    if len(found) > 1:
        listed = ", ".join(lit.text for lit in found)
        plural = "matrices" if depth == 2 else "vectors"
        raise ValueError(
            f"found {len(found)} {plural} where one {shape} ({what}) was expected: {listed:.200}"
        )
    return found[0]


def _detect_kind(text: str) -> str:
    t = " ".join(text.lower().split())
    if _OP_START.search(text):
        return "elimination"
    if re.search(r"\+\s*[a-z]\w*\s*\*?\s*\[", t) or "complete solution" in t:
        return "complete_solution"
    if any(w in t for w in ("always", "sometimes", "never")) and any(
        w in t for w in ("rank", "solution", "solvable")
    ):
        return "solvability"
    if "column space" in t or "c(a)" in t:
        return "column_space"
    if any(w in t for w in ("special solution", "nullspace", "null space", "n(a)", "ax = 0")):
        return "nullspace"
    if any(w in t for w in ("echelon", "rref", "row reduce", "reduce")):
        return "rref"
    raise ValueError(
        "could not tell what the question asks: it names none of the complete solution "
        "(x = x_p + c1 * s1 ...), elimination steps (R2 = R2 - 2*R1), special solutions / "
        "nullspace, reduced row echelon form (rref), always / sometimes / never, or the column "
        "space"
    )


def _parse_block(lit: _Literal, letter: str) -> Matrix:
    rows = lit.value if lit.depth == 2 else [lit.value]
    if len({len(row) for row in rows}) != 1:
        raise ValueError(f"the block matrix {lit.text!r} must be a rectangle of blocks")
    out = []
    for row in rows:
        coefficients = []
        for atom in row:
            match = _BLOCK_ATOM.fullmatch(atom)  # _is_block(lit) holds
            if match.group(5):
                coefficients.append(Fraction(0))
                continue
            number, name = (
                (match.group(1), match.group(2)) if match.group(2) else (None, match.group(4))
            )
            if name != letter:
                raise ValueError(f"the block {atom!r} of {lit.text!r} names {name}, not {letter}")
            value = _number(number, lit.text) if number else Fraction(1)
            coefficients.append(-value if match.group(3) else value)
        out.append(tuple(coefficients))
    return tuple(out)


def _parse_operations(text: str, rows: int) -> tuple[RowOp, ...]:
    ops = []
    for start in _OP_START.finditer(text):
        at = start.start()
        for pattern in (_SWAP, _ADD, _SCALE):
            match = pattern.match(text, at)
            if match:
                break
        else:
            raise ValueError(
                f"could not read the row operation {text[at : at + 30]!r}... (allowed: "
                "R1 <-> R2, R2 = (1/3)*R2, R2 = R2 - 2*R1)"
            )
        numbers = [g for g in match.groups()]
        if pattern is _SWAP:
            i, j = int(numbers[0]), int(numbers[1])
            indices = (i, j)
        elif pattern is _SCALE:
            i, factor, j = int(numbers[0]), numbers[1], int(numbers[2])
            indices = (i, j)
            if i != j:
                raise ValueError(f"the row operation {match.group(0)!r} must scale R{i} itself")
        else:
            i, i2, sign, factor, j = numbers
            i, i2, j = int(i), int(i2), int(j)
            indices = (i, i2, j)
            if i != i2 or i == j:
                raise ValueError(
                    f"the row operation {match.group(0)!r} must read Ri = Ri + c*Rj with i != j"
                )
        if not all(1 <= k <= rows for k in indices):
            raise ValueError(
                f"the row operation {match.group(0)!r} names a row outside R1..R{rows} (R has "
                f"{rows} rows)"
            )
        if pattern is _SWAP:
            if i == j:
                raise ValueError(f"the row operation {match.group(0)!r} swaps a row with itself")
            ops.append(RowOp("swap", i - 1, j - 1))
        elif pattern is _SCALE:
            value = _number(factor, "the row operation " + match.group(0))
            if value == 0:
                raise ValueError(f"the row operation {match.group(0)!r} scales by 0")
            ops.append(RowOp("scale", i - 1, factor=value))
        else:
            value = _number(factor, "the row operation " + match.group(0)) if factor else 1
            ops.append(RowOp("add", i - 1, j - 1, -value if sign == "-" else Fraction(value)))
    return tuple(ops)


def _parse_shape(text: str) -> tuple[int, int] | None:
    match = _DIMS.search(text)
    if match:
        return int(match.group(1)), int(match.group(2))
    m = re.search(r"\bm\s*=\s*(\d+)\b", text)
    n = re.search(r"\bn\s*=\s*(\d+)\b", text)
    if m and n:
        return int(m.group(1)), int(n.group(1))
    return None


def _positive(value: int, what: str) -> int:
    if value < 1:
        raise ValueError(f"{what} must be at least 1; got {value}")
    if value > 1000:
        raise ValueError(f"{what} must be at most 1000; got {value}")
    return value


def _parse(text: str) -> ParsedQuestion:
    kind = _detect_kind(text)
    literals = _scan_literals(text)
    if kind == "solvability":
        shape = _parse_shape(text)
        if shape is None:
            raise ValueError("could not read the size of A (write e.g. 'a 3 by 5 matrix')")
        m, n = (
            _positive(v, f"the {w} of A") for v, w in zip(shape, ("rows", "columns"), strict=True)
        )
        rank_match = _RANK.search(text)
        if rank_match is None:
            raise ValueError("could not read the rank of A (write e.g. 'rank 3' or 'r = 3')")
        r = int(rank_match.group(1) or rank_match.group(2))
        if r > min(m, n):
            raise ValueError(f"the rank {r} of a {m} by {n} matrix must be at most {min(m, n)}")
        lowered = " ".join(text.lower().split())
        found = [p for p, pattern in _PROPERTY_PATTERNS.items() if pattern.search(lowered)]
        if len(found) != 1:
            raise ValueError(
                "could not tell which property of the solutions is asked ("
                + (
                    "the question names " + " and ".join(PROPERTIES[p] for p in found)
                    if found
                    else "none of 'exactly one solution', 'infinitely many solutions', "
                    "'no solution'"
                )
                + ")"
            )
        return ParsedQuestion(kind, text, rows=m, cols=n, rank=r, solutions=found[0])
    if kind == "column_space":
        a = _to_matrix(_one(literals, 2, "A"), "A")
        b = _to_vector(_one(literals, 1, "b"), "b")
        if len(b) != len(a):
            raise ValueError(f"b has {len(b)} entries but A has {len(a)} rows")
        return ParsedQuestion(kind, text, A=a, b=b)
    if kind == "nullspace":
        return ParsedQuestion(kind, text, A=_to_matrix(_one(literals, 2, "A"), "A"))
    if kind == "rref":
        lit = _one(literals, 2, "A")
        a = _to_matrix(lit, "A")
        blocks = [x for x in literals if _is_block(x)]
        if len(blocks) > 1:
            raise ValueError(f"found {len(blocks)} block matrices: {[x.text for x in blocks]}")
        block = _parse_block(blocks[0], lit.name or "A") if blocks else None
        return ParsedQuestion(kind, text, A=a, block=block)
    if kind == "elimination":
        r = _to_matrix(_one(literals, 2, "R"), "R")
        d = _to_vector(_one(literals, 1, "d"), "d")
        if len(d) != len(r):
            raise ValueError(f"d has {len(d)} entries but R has {len(r)} rows")
        return ParsedQuestion(kind, text, R=r, d=d, operations=_parse_operations(text, len(r)))
    # complete_solution
    vectors = [lit for lit in literals if lit.depth == 1 and _is_numeric(lit)]
    if not vectors:
        raise ValueError("could not find the complete solution x = x_p + c1 * s1 + ... ")
    named = [lit for lit in vectors if lit.name in ("x", "x_p", "xp")]
    first = named[0] if named else vectors[0]
    x_p = _to_vector(first, "x_p")
    special = tuple(
        _to_vector(lit, f"s{k + 1}")
        for k, lit in enumerate(lit for lit in vectors if lit.start > first.start)
    )
    for k, s in enumerate(special):
        if len(s) != len(x_p):
            raise ValueError(
                f"s{k + 1} = {format_vector(s)} has {len(s)} entries but x_p = "
                f"{format_vector(x_p)} has {len(x_p)}"
            )
    shape = _parse_shape(text)
    if shape is not None:
        m = _positive(shape[0], "the rows of A")
        if shape[1] != len(x_p):
            raise ValueError(f"A is {shape[0]} by {shape[1]} but x has {len(x_p)} entries")
    else:
        rows = re.search(r"\b(\d+)\s+rows?\b", text)
        if rows is None:
            raise ValueError(
                "could not read how many rows A has (write e.g. 'A is 3 by 3' or 'A has 3 rows')"
            )
        m = _positive(int(rows.group(1)), "the rows of A")
    return ParsedQuestion(kind, text, x_p=x_p, special=special, rows=m)


def parse_question(text: str) -> ParsedQuestion:
    """The kind and the matrices, vectors and numbers of a question, exactly.

    Reads every phrasing of :data:`TEMPLATES` and reasonable variations: matrices named or not
    (``A = [[..]]``, ``A is the matrix [[..]]``, ``the matrix [[..]]``), entries as integers,
    ``p/q`` or decimals, sizes as ``3 by 5`` or ``3x5``. Malformed text raises ``ValueError``
    saying what could not be read (never another exception type).

    Example:

    >>> p = parse_question("Find the special solutions of Ax = 0 for A = [[1, 2, 0, 3], "
    ...                    "[2, 4, 1, 7], [0, 0, 2, 2]] and describe the nullspace N(A) in words.")
    >>> p.kind, len(p.A), len(p.A[0])
    ('nullspace', 3, 4)
    >>> parse_question("Is b = [1, 2] in the column space of A = [[1, 2], [3]]?")
    Traceback (most recent call last):
    ...
    ValueError: could not parse the question: the rows of the matrix A = [[1, 2], [3]] have ...
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_question: `text` must be a str; got {type(text).__name__}")
    if len(text) > _MAX_QUESTION_CHARS:
        raise ValueError(
            f"could not parse the question: it has {len(text)} characters, more than the "
            f"{_MAX_QUESTION_CHARS} allowed"
        )
    try:
        return _parse(text.strip())
    except ValueError as e:
        raise ValueError(f"could not parse the question: {e}") from None
    except (ArithmeticError, IndexError, KeyError, TypeError) as e:  # a parser bug: still clear
        raise ValueError(f"could not parse the question ({type(e).__name__}: {e})") from None


# -------------------------------------------------------------------------------------------
# The generator.


@dataclass(frozen=True)
class GeneratorConfig:
    """How big and how hard generated problems are. Shapes are ``(max rows, max columns)``.

    Example:

    >>> GeneratorConfig(rref_shape=(6, 8)).rref_shape
    (6, 8)
    >>> GeneratorConfig(nullspace_shape=(5, 6))
    Traceback (most recent call last):
    ...
    ValueError: GeneratorConfig: `nullspace_shape` must be (rows, cols) with 2 <= rows <= 4 and ...
    """

    # Which kinds to generate, in round-robin order (subset of KINDS).
    kinds: tuple[str, ...] = KINDS
    # rref: the matrix (or the whole block matrix) has 2..rows rows and 2..cols columns
    # (the maximum: 6 x 8).
    rref_shape: tuple[int, int] = (4, 5)
    # nullspace: 2..rows by 2..cols (the maximum: 4 x 6).
    nullspace_shape: tuple[int, int] = (3, 5)
    # column_space: A has cols = 1..cols independent columns and cols..rows rows, at least 2
    # (maximum 6 x 6).
    column_space_shape: tuple[int, int] = (4, 3)
    # elimination: R is 2..rows by 2..cols (maximum 4 x 6), reached by 1..elimination_ops
    # steps.
    elimination_shape: tuple[int, int] = (3, 4)
    elimination_ops: int = 5
    # complete_solution: the number of unknowns (the issue's: 3; 2..5 allowed), and A has
    # rank..complete_solution_rows rows (at most 5).
    unknowns: int = 3
    complete_solution_rows: int = 3
    # solvability: m and n are drawn from 1..solvability_dim (at most 9); the rank from 1..min.
    solvability_dim: int = 9
    # rref: the fraction of questions about a block matrix such as [[A, A], [A, A]].
    block_rate: float = 0.25
    # The fraction of the free entries of a generated echelon form that are fractions p/q
    # (q = 2 or 3) instead of integers in [-3, 3]: with them, some answers hold fractions.
    fraction_rate: float = 0.15
    # Every entry of a matrix or vector in a question is an integer in [-max_entry, max_entry].
    max_entry: int = 9
    # Every integer written in a solution (numerators, denominators) is at most this in size.
    max_number: int = 30
    # A solution has at most this many steps.
    max_steps: int = 16
    # Whether row scalings and combinations write the entries of the row they change, computed
    # one by one, between the operation and the matrix after it (:func:`row_arithmetic`):
    # ``R2 = R2 - 2*R1: [2-2*1=0, 5-2*2=1] -> [[1, 2], [0, 1]]``. Longer chains, each
    # new entry written right after its operands instead of computed inside the matrix.
    arithmetic: bool = False
    # With arithmetic: whether each combination's term writes its product before its sum,
    # ``a-k*b=a-p=c`` (:func:`row_arithmetic`'s ``products``): ``2-2*1=2-2=0``.
    products: bool = False

    def __post_init__(self) -> None:
        if (
            not isinstance(self.kinds, tuple)
            or not self.kinds
            or any(k not in KINDS for k in self.kinds)
        ):
            raise ValueError(
                f"GeneratorConfig: `kinds` must be a non-empty tuple of {KINDS}; got {self.kinds!r}"
            )
        limits = {
            "rref_shape": (6, 8),
            "nullspace_shape": (4, 6),
            "column_space_shape": (6, 6),
            "elimination_shape": (4, 6),
        }
        for name, (max_rows, max_cols) in limits.items():
            shape = getattr(self, name)
            ok = (
                isinstance(shape, tuple)
                and len(shape) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in shape)
                and 2 <= shape[0] <= max_rows
                and (1 if name == "column_space_shape" else 2) <= shape[1] <= max_cols
                and (name != "column_space_shape" or shape[1] <= shape[0])
            )
            if not ok:
                low_cols = 1 if name == "column_space_shape" else 2
                raise ValueError(
                    f"GeneratorConfig: `{name}` must be (rows, cols) with 2 <= rows <= {max_rows} "
                    f"and {low_cols} <= cols <= {max_cols}"
                    + (" and cols <= rows" if name == "column_space_shape" else "")
                    + f"; got {shape!r}"
                )
        check_int(self.elimination_ops, "elimination_ops", "GeneratorConfig", high=12)
        check_int(self.unknowns, "unknowns", "GeneratorConfig", low=2, high=5)
        check_int(self.complete_solution_rows, "complete_solution_rows", "GeneratorConfig", high=5)
        check_int(self.solvability_dim, "solvability_dim", "GeneratorConfig", high=9)
        check_int(self.max_entry, "max_entry", "GeneratorConfig", low=3, high=99)
        check_int(self.max_number, "max_number", "GeneratorConfig", low=9, high=10**6)
        check_int(self.max_steps, "max_steps", "GeneratorConfig", low=4, high=128)
        _Arithmetic.of(self.arithmetic, self.products, "GeneratorConfig")
        for name in ("block_rate", "fraction_rate"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0.0 <= value <= 1.0)
            ):
                raise ValueError(f"GeneratorConfig: `{name}` must be in [0, 1]; got {value!r}")


def _as_rng(rng: random.Random | int, caller: str) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    return random.Random(check_int(rng, "rng", caller, low=0))


def _free_entry(rng: random.Random, cfg: GeneratorConfig) -> Fraction:
    if rng.random() < cfg.fraction_rate:
        q = rng.choice((2, 3))
        return Fraction(rng.choice([p for p in range(-2 * q, 2 * q + 1) if p % q]), q)
    return Fraction(rng.randint(-3, 3))


def _random_echelon(rng: random.Random, m: int, n: int, rank: int, cfg: GeneratorConfig) -> Matrix:
    """A random m x n reduced row echelon form of the given rank."""
    pivots = sorted(rng.sample(range(n), rank))
    r = _zeros(m, n)
    for i, pivot in enumerate(pivots):
        r[i][pivot] = Fraction(1)
        for j in range(pivot + 1, n):
            if j not in pivots:
                r[i][j] = _free_entry(rng, cfg)
    return _as_matrix(r)


def _random_invertible(rng: random.Random, m: int) -> Matrix:
    """An integer m x m matrix made of a few random row operations on I (swaps, row + c*row
    with c in ±1, ±2, and scalings by -1, 2 or 3): what mixes an echelon form into a question."""
    matrix = _identity(m)
    for _ in range(rng.randint(m, 2 * m + 1)):
        i, j = rng.sample(range(m), 2) if m > 1 else (0, 0)
        choice = rng.random() if m > 1 else 0.2
        if choice < 0.15:
            op = RowOp("swap", i, j)
        elif choice < 0.3:
            op = RowOp("scale", i, factor=Fraction(rng.choice((-1, 2, 3))))
        else:
            op = RowOp("add", i, j, Fraction(rng.choice((-2, -1, 1, 2))))
        matrix = op.apply(matrix)
    return matrix


def _integer_rows(matrix: Matrix) -> Matrix:
    """Each row times the least common multiple of its denominators (the rref is unchanged)."""
    return tuple(tuple(x * math.lcm(*(y.denominator for y in row)) for x in row) for row in matrix)


def _random_matrix(rng: random.Random, m: int, n: int, rank: int, cfg: GeneratorConfig) -> Matrix:
    """An integer m x n matrix of the given rank whose reduced form has small entries."""
    return _integer_rows(_matmul(_random_invertible(rng, m), _random_echelon(rng, m, n, rank, cfg)))


def _entries_ok(values: Sequence[Fraction], cfg: GeneratorConfig) -> bool:
    return all(x.denominator == 1 and abs(x) <= cfg.max_entry for x in values)


def _draw(
    rng: random.Random, kind: str, cfg: GeneratorConfig, template: int
) -> ParsedQuestion | None:
    """One candidate question of ``kind`` (None when the draw breaks the entry bound)."""
    phrasing = TEMPLATES[kind][template]
    if kind == "rref":
        max_rows, max_cols = cfg.rref_shape
        if "{block}" in phrasing:
            block = _as_matrix(rng.choice(_BLOCKS))
            # The block matrix has at least 2 rows and 2 columns and fits the shape.
            rows = rng.randint(-(-2 // len(block)), max_rows // len(block))
            cols = rng.randint(-(-2 // len(block[0])), max_cols // len(block[0]))
        else:
            block = None
            rows, cols = rng.randint(2, max_rows), rng.randint(2, max_cols)
        a = _random_matrix(rng, rows, cols, rng.randint(1, min(rows, cols)), cfg)
        if not _entries_ok([x for row in a for x in row], cfg):
            return None
        values = {"A": format_matrix(a)}
        if block is not None:
            values["block"] = _format_block(block)
        return ParsedQuestion(kind, phrasing.format(**values), A=a, block=block)
    if kind == "nullspace":
        rows, cols = rng.randint(2, cfg.nullspace_shape[0]), rng.randint(2, cfg.nullspace_shape[1])
        a = _random_matrix(rng, rows, cols, rng.randint(1, min(rows, cols)), cfg)
        if not _entries_ok([x for row in a for x in row], cfg):
            return None
        return ParsedQuestion(kind, phrasing.format(A=format_matrix(a)), A=a)
    if kind == "column_space":
        cols = rng.randint(1, cfg.column_space_shape[1])
        rows = rng.randint(max(2, cols), cfg.column_space_shape[0])
        a = _random_matrix(rng, rows, cols, cols, cfg)
        if rows > cols and rng.random() < 0.5:
            x = tuple(Fraction(rng.randint(-3, 3)) for _ in range(cols))
            b = _matvec(a, x)
        else:
            b = tuple(Fraction(rng.randint(-cfg.max_entry, cfg.max_entry)) for _ in range(rows))
        if not _entries_ok([x for row in a for x in row] + list(b), cfg):
            return None
        question = phrasing.format(A=format_matrix(a), b=format_vector(b))
        return ParsedQuestion(kind, question, A=a, b=b)
    if kind == "solvability":
        m, n = rng.randint(1, cfg.solvability_dim), rng.randint(1, cfg.solvability_dim)
        r = rng.randint(1, min(m, n))
        prop = rng.choice(tuple(PROPERTIES))
        question = phrasing.format(m=m, n=n, r=r, property=PROPERTIES[prop])
        return ParsedQuestion(kind, question, rows=m, cols=n, rank=r, solutions=prop)
    if kind == "complete_solution":
        n = cfg.unknowns
        k = rng.randint(1, n - 1)  # special solutions
        m = rng.randint(max(n - k, 1), max(cfg.complete_solution_rows, n - k))
        r = _random_echelon(rng, n - k, n, n - k, cfg)
        pivots = [row.index(1) for row in r]
        free = [j for j in range(n) if j not in pivots]
        special = []
        for f in free:
            s = [Fraction(0)] * n
            s[f] = Fraction(1)
            for i, pivot in enumerate(pivots):
                s[pivot] = -r[i][f]
            special.append(tuple(s))
        # Special solutions with fractions scaled to integers (they span the same nullspace).
        special = [tuple(_integer_rows((s,))[0]) for s in special]
        x_p = [Fraction(0)] * n
        for pivot in pivots:
            x_p[pivot] = Fraction(rng.randint(-4, 4))
        if rng.random() < 0.3:  # a particular solution that is not the special one
            for s in special:
                c = rng.randint(-1, 1)
                x_p = [x + c * y for x, y in zip(x_p, s, strict=True)]
        x_p = tuple(x_p)
        if not _entries_ok(list(x_p) + [x for s in special for x in s], cfg):
            return None
        terms = " + ".join(
            [format_vector(x_p)] + [f"c{k + 1} * {format_vector(s)}" for k, s in enumerate(special)]
        )
        question = phrasing.format(x=terms, m=m, n=n, rows=_counted(m, "row"))
        return ParsedQuestion(kind, question, x_p=x_p, special=tuple(special), rows=m)
    # elimination
    max_rows, max_cols = cfg.elimination_shape
    rows, cols = rng.randint(2, max_rows), rng.randint(2, max_cols)
    a = _random_matrix(rng, rows, cols, rng.randint(1, min(rows, cols)), cfg)
    reduction = _reduce(a)
    if not 1 <= len(reduction.ops) <= cfg.elimination_ops:
        return None
    rank = len(reduction.pivots)
    d = tuple(Fraction(rng.randint(-4, 4)) if i < rank else Fraction(0) for i in range(rows))
    b = d
    for op in reversed(reduction.ops):
        b = tuple(row[0] for row in op.inverse().apply(tuple((x,) for x in b)))
    if not _entries_ok([x for row in a for x in row] + list(b), cfg):
        return None
    question = phrasing.format(
        R=format_matrix(reduction.matrix),
        d=format_vector(d),
        ops="; ".join(op.text() for op in reduction.ops),
    )
    return ParsedQuestion(kind, question, R=reduction.matrix, d=d, operations=reduction.ops)


_INTEGER = re.compile(r"\d+")


def _within_bounds(problem: Problem, cfg: GeneratorConfig) -> bool:
    if len(problem.steps) > cfg.max_steps:
        return False
    numbers = _INTEGER.findall(" ".join(problem.steps) + " " + problem.answer)
    return all(len(x) <= 7 and int(x) <= cfg.max_number for x in numbers)


_MAX_DRAWS = 1000


def _choose_template(kind: str, rng: random.Random, cfg: GeneratorConfig) -> int:
    if kind != "rref":
        return rng.randrange(len(TEMPLATES[kind]))
    block = rng.random() < cfg.block_rate
    return rng.choice([i for i, t in enumerate(TEMPLATES[kind]) if ("{block}" in t) == block])


def _generate(
    kind: str, rng: random.Random, cfg: GeneratorConfig, template: int | None
) -> tuple[ParsedQuestion, Problem]:
    for _ in range(_MAX_DRAWS):
        chosen = _choose_template(kind, rng, cfg) if template is None else template
        parsed = _draw(rng, kind, cfg, chosen)
        if parsed is None:
            continue
        problem = solve(parsed)
        if _ALREADY_REDUCED in problem.steps:
            continue  # nothing to practise
        if _within_bounds(problem, cfg):  # of the plain chain: the same draws with arithmetic
            if cfg.arithmetic:
                problem = solve(parsed, arithmetic=True, products=cfg.products)
            return parsed, problem
    raise ValueError(
        f"generate: no {kind} problem within the bounds of {cfg} after {_MAX_DRAWS} draws; "
        "raise max_steps, max_number or max_entry, or lower the shapes"
    )


def generate(
    kind: str,
    rng: random.Random | int,
    config: GeneratorConfig | None = None,
    *,
    template: int | None = None,
) -> Problem:
    """One random problem of ``kind`` with its worked solution.

    Args:
      kind: one of :data:`KINDS`.
      rng: a ``random.Random`` (advanced by the draw) or an int seed.
      config: sizes and bounds (default: ``GeneratorConfig()``).
      template: the phrasing, an index into ``TEMPLATES[kind]`` (default: drawn at random).

    Example:

    >>> problem = generate("rref", 0, template=0)
    >>> problem.question.startswith("Find the reduced row echelon form R of A = [[")
    True
    >>> generate("rref", 0, template=0) == problem  # deterministic given the seed
    True
    """
    if kind not in KINDS:
        raise ValueError(f"generate: `kind` must be one of {KINDS}; got {kind!r}")
    rng = _as_rng(rng, "generate")
    cfg = GeneratorConfig() if config is None else config
    if not isinstance(cfg, GeneratorConfig):
        raise TypeError(f"generate: `config` must be a GeneratorConfig; got {type(cfg).__name__}")
    if template is not None:
        check_int(template, "template", "generate", low=0, high=len(TEMPLATES[kind]) - 1)
    return _generate(kind, rng, cfg, template)[1]


# -------------------------------------------------------------------------------------------
# Splits.

SPLITS = ("train", "validation", "test")


def _split_rng(seed: int, split: str) -> random.Random:
    # Seeding with a string is stable across runs and Python versions (it hashes with SHA-512).
    return random.Random(f"sparse_jax.linalg_cot:{seed}:{split}")


def make_splits(
    train: int = 12_000,
    validation: int = 600,
    test: int = 600,
    *,
    seed: int = 0,
    config: GeneratorConfig | None = None,
) -> dict[str, tuple[Problem, ...]]:
    """Fixed train / validation / test splits: example ``i`` of a split has kind
    ``config.kinds[i % len(kinds)]``.

    The test split is drawn first, then validation, then train, each split from its own
    random stream (so a split does not change when another's size does, except that train
    skips what the others hold). Questions are compared by content (:attr:`ParsedQuestion.key`,
    whatever the phrasing): validation and test hold no duplicates, validation holds no test
    question, and train holds no validation or test question (train may repeat its own
    questions where a kind has few distinct ones, like ``solvability``).

    Example:

    >>> splits = make_splits(train=12, validation=6, test=6, seed=0)
    >>> [len(splits[s]) for s in ("train", "validation", "test")]
    [12, 6, 6]
    >>> [p.kind for p in splits["test"]] == list(KINDS)
    True
    """
    sizes = {
        name: check_int(value, name, "make_splits", low=0)
        for name, value in (("train", train), ("validation", validation), ("test", test))
    }
    seed = check_int(seed, "seed", "make_splits", low=0)
    cfg = GeneratorConfig() if config is None else config
    if not isinstance(cfg, GeneratorConfig):
        raise TypeError(
            f"make_splits: `config` must be a GeneratorConfig; got {type(cfg).__name__}"
        )
    taken: set[str] = set()
    out: dict[str, tuple[Problem, ...]] = {}
    for split in ("test", "validation", "train"):
        rng = _split_rng(seed, split)
        unique = split != "train"
        problems, keys = [], set()
        for i in range(sizes[split]):
            kind = cfg.kinds[i % len(cfg.kinds)]
            for _ in range(_MAX_DRAWS):
                parsed, problem = _generate(kind, rng, cfg, None)
                key = parsed.key
                if key not in taken and not (unique and key in keys):
                    break
            else:
                raise ValueError(
                    f"make_splits: could not draw a new {kind} question for the {split} split "
                    f"after {_MAX_DRAWS} tries ({len(keys)} drawn so far): the configuration "
                    "allows too few distinct questions of this kind; lower the split sizes or "
                    "raise the size limits of GeneratorConfig"
                )
            keys.add(key)
            problems.append(problem)
        taken |= keys
        out[split] = tuple(problems)
    return {split: out[split] for split in SPLITS}


def distinct_questions(problems: Iterable[Problem]) -> dict[str, int]:
    """Per kind (in :data:`KINDS` order, kinds present only), how many of ``problems`` differ in
    content (:attr:`ParsedQuestion.key`, whatever the phrasing): what a split teaches, where
    a kind with few distinct questions repeats them (:func:`make_splits`).

    Example:

    >>> splits = make_splits(train=300, validation=3, test=10, seed=0,
    ...                      config=GeneratorConfig(kinds=("solvability",), solvability_dim=2))
    >>> distinct_questions(splits["test"]), distinct_questions(splits["train"])
    ({'solvability': 10}, {'solvability': 2})
    """
    keys: dict[str, set[str]] = {}
    for p in problems:
        if not isinstance(p, Problem):
            raise TypeError(
                f"distinct_questions: `problems` must hold Problems; got {type(p).__name__}"
            )
        keys.setdefault(p.kind, set()).add(parse_question(p.question).key)
    return {kind: len(keys[kind]) for kind in KINDS if kind in keys}


# -------------------------------------------------------------------------------------------
# The TFDS builder.
#
# Defined on first use, as in sparse_jax.data.text, so that importing this module does not import
# tensorflow_datasets; `linalg_cot.SparseJaxLinalgCot` still names the class (module __getattr__).


@functools.cache
def _builder_classes() -> tuple[type, type]:
    """``(SparseJaxLinalgCot, SparseJaxLinalgCotConfig)``, defined once (TFDS registers
    builders by name)."""
    import tensorflow_datasets as tfds

    @dataclasses.dataclass(eq=False)
    class SparseJaxLinalgCotConfig(tfds.core.BuilderConfig):
        """Generated splits: the name is ``s<seed>_<hash of the sizes and GeneratorConfig>``.

        Example (a config like those :func:`prepare` makes, not built):

        >>> import json
        >>> from sparse_jax.data.linalg_cot import SparseJaxLinalgCotConfig
        >>> details = {"seed": 0, "sizes": {"train": 12, "validation": 6, "test": 6}}
        >>> config = SparseJaxLinalgCotConfig("s0_0123456789abcdef", details=json.dumps(details))
        >>> config.name, json.loads(config.details)["sizes"]["train"]
        ('s0_0123456789abcdef', 12)
        """

        # JSON with the seed, split sizes and GeneratorConfig (stored as dataset metadata).
        details: str = "{}"

    class SparseJaxLinalgCot(tfds.core.GeneratorBasedBuilder):
        """Linear-algebra problems with worked solutions: ``question``, ``steps`` (a sequence of
        lines), ``answer`` and ``kind``, splits train / validation / test.

        Written in ``array_record`` format by :func:`prepare` (which passes the problems to the
        constructor); read back with ``builder.as_data_source()``.

        Example (a dataset :func:`prepare` wrote, read back by name: one dict per problem):

        >>> import tempfile
        >>> import tensorflow_datasets as tfds
        >>> from sparse_jax.data.linalg_cot import SparseJaxLinalgCot
        >>> tmp = tempfile.TemporaryDirectory()
        >>> data = prepare(tmp.name, train=6, validation=6, test=6)  # TFDS prints 2 lines
        Downloading and preparing dataset ...
        Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
        >>> SparseJaxLinalgCot.name, data.dataset_name
        ('sparse_jax_linalg_cot', 'sparse_jax_linalg_cot/s0_...:1.0.0')
        >>> test = tfds.data_source(data.dataset_name, data_dir=tmp.name)["test"]
        >>> sorted(test[0]), test[0]["kind"]
        (['answer', 'kind', 'question', 'steps'], b'complete_solution')
        >>> tmp.cleanup()
        """

        VERSION = tfds.core.Version(_BUILDER_VERSION)
        RELEASE_NOTES = {"1.0.0": "The six kinds of issue 16."}  # noqa: RUF012

        def __init__(
            self, *, problems: Mapping[str, Sequence[Problem]] | None = None, **kwargs: Any
        ):
            self._problems = problems
            super().__init__(**kwargs)

        def _info(self) -> tfds.core.DatasetInfo:
            return self.dataset_info_from_configs(
                description="Linear-algebra exam problems with chain-of-thought solutions.",
                features=tfds.features.FeaturesDict(
                    {
                        "question": tfds.features.Text(),
                        "steps": tfds.features.Sequence(tfds.features.Text()),
                        "answer": tfds.features.Text(),
                        "kind": tfds.features.Text(),
                    }
                ),
                metadata=tfds.core.MetadataDict(json.loads(self.builder_config.details)),
                # Example i is problem i: keep generation order (TFDS shuffles by default).
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
            if self._problems is None:
                raise RuntimeError(
                    "SparseJaxLinalgCot is written by sparse_jax.data.linalg_cot.prepare()"
                )
            return {split: self._generate_examples(split) for split in self._problems}

        def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
            for i, problem in enumerate(self._problems[split]):
                yield (
                    i,
                    {
                        "question": problem.question,
                        "steps": list(problem.steps),
                        "answer": problem.answer,
                        "kind": problem.kind,
                    },
                )

    for cls in (SparseJaxLinalgCot, SparseJaxLinalgCotConfig):
        cls.__qualname__ = cls.__name__
    return SparseJaxLinalgCot, SparseJaxLinalgCotConfig


def __getattr__(name: str) -> Any:
    if name == "SparseJaxLinalgCot":
        return _builder_classes()[0]
    if name == "SparseJaxLinalgCotConfig":
        return _builder_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ProblemSource:
    """Random access to one prepared split: ``len``, ``[i]`` -> :class:`Problem`, iteration.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare(tmp.name, train=6, validation=6, test=6)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
    >>> data.test, [p.kind for p in data.test] == list(KINDS)
    (ProblemSource(split='test', problems=6), True)
    >>> data.test[-1] == make_splits(6, 6, 6)["test"][-1]  # the problem written, read back
    True
    >>> tmp.cleanup()
    """

    def __init__(self, data_source: Any, split: str):
        self._source = data_source
        self.split = split

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Problem:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"index must be an int, got {type(index).__name__}: {index!r}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for {n} {self.split} problems")
        record = self._source[int(index) % n]
        return Problem(
            kind=_text(record["kind"]),
            question=_text(record["question"]),
            steps=tuple(_text(s) for s in record["steps"]),
            answer=_text(record["answer"]),
        )

    def __iter__(self) -> Iterator[Problem]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"ProblemSource(split={self.split!r}, problems={len(self)})"


@dataclass(frozen=True)
class LinalgCotData:
    """The prepared splits, read back from the TFDS ``array_record`` files.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare(tmp.name, train=6, validation=6, test=6)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
    >>> [len(data.train), len(data.validation), len(data.test)], data.built
    ([6, 6, 6], True)
    >>> data.dataset_name  # the config name: s<seed>_<hash of the request>
    'sparse_jax_linalg_cot/s0_...:1.0.0'
    >>> (data.dataset_dir / "dataset_info.json").is_file()
    True
    >>> tmp.cleanup()
    """

    train: ProblemSource
    validation: ProblemSource
    test: ProblemSource
    # The TFDS dataset ("sparse_jax_linalg_cot/<config>:<version>") and its folder.
    dataset_name: str
    dataset_dir: Path
    # Whether this call wrote the dataset (False: it was already there).
    built: bool


def prepare(
    data_dir: str | os.PathLike | None = None,
    *,
    train: int = 12_000,
    validation: int = 600,
    test: int = 600,
    seed: int = 0,
    config: GeneratorConfig | None = None,
    verbose: bool = False,
) -> LinalgCotData:
    """:func:`make_splits` written once as a TFDS ``array_record`` dataset and read back.

    The dataset's config name carries a hash of (format, seed, sizes, config): the same request
    reuses the files (``built`` False), any change writes a new dataset beside. ``data_dir``
    defaults to ``$SPARSE_JAX_DATA_DIR``, else ``~/.cache/sparse_jax/tfds``.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare(tmp.name, train=12, validation=6, test=6)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
    >>> len(data.train), data.test[0] == make_splits(12, 6, 6)["test"][0], data.built
    (12, True, True)
    >>> prepare(tmp.name, train=12, validation=6, test=6).built  # written once
    False
    >>> tmp.cleanup()
    """
    from sparse_jax.data.tfds_store import default_data_dir, prepare_once, quiet_tfds

    sizes = {
        name: check_int(value, name, "prepare", low=1)
        for name, value in (("train", train), ("validation", validation), ("test", test))
    }
    seed = check_int(seed, "seed", "prepare", low=0)
    verbose = check_bool(verbose, "verbose", "prepare")
    cfg = GeneratorConfig() if config is None else config
    if not isinstance(cfg, GeneratorConfig):
        raise TypeError(f"prepare: `config` must be a GeneratorConfig; got {type(cfg).__name__}")
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(
            f"prepare: `data_dir` must be a str or os.PathLike; got {type(data_dir).__name__}"
        )
    root = (Path(data_dir).expanduser() if data_dir is not None else default_data_dir()).absolute()
    details = {
        "format": _FORMAT,
        "seed": seed,
        "sizes": sizes,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
    }
    key = hashlib.sha256(json.dumps(details, sort_keys=True).encode()).hexdigest()
    config_name = f"s{seed}_{key[:16]}"
    SparseJaxLinalgCot, SparseJaxLinalgCotConfig = _builder_classes()
    builder_config = SparseJaxLinalgCotConfig(name=config_name, details=json.dumps(details))
    with quiet_tfds(verbose):
        builder = SparseJaxLinalgCot(
            config=builder_config, data_dir=root, file_format="array_record"
        )
        built = not builder.is_prepared()
        if built:
            builder = SparseJaxLinalgCot(
                config=builder_config,
                data_dir=root,
                file_format="array_record",
                problems=make_splits(**sizes, seed=seed, config=cfg),
            )
            prepare_once(builder)
        sources = builder.as_data_source()
    return LinalgCotData(
        **{split: ProblemSource(sources[split], split) for split in SPLITS},
        dataset_name=f"{BUILDER_NAME}/{config_name}:{_BUILDER_VERSION}",
        dataset_dir=root / BUILDER_NAME / config_name / _BUILDER_VERSION,
        built=built,
    )
