"""The generator: the phrasings of each kind (:data:`TEMPLATES`), random problems within the
bounds of a :class:`GeneratorConfig` (:func:`generate`) and fixed train / validation / test
splits disjoint in content (:func:`make_splits`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from sparse_jax.data.linalg_cot.algebra import (
    Arithmetic,
    Matrix,
    RowOp,
    as_matrix,
    counted,
    format_matrix,
    format_number,
    format_vector,
    identity,
    matmul,
    matvec,
    row_reduce,
    zeros,
)
from sparse_jax.data.linalg_cot.exam import (
    EXAM_TEMPLATES,
    choice_text,
    latex_question,
    operations_in_words,
)
from sparse_jax.data.linalg_cot.parsing import parse_descriptive, parse_question
from sparse_jax.data.linalg_cot.problems import (
    ALREADY_REDUCED,
    DESCRIPTIVE_KINDS,
    FREQUENCIES,
    KINDS,
    PROPERTIES,
    ParsedQuestion,
    Problem,
)
from sparse_jax.data.linalg_cot.solver import solve
from sparse_jax.validation import check_int

__all__ = [
    "SPLITS",
    "TEMPLATES",
    "GeneratorConfig",
    "distinct_questions",
    "generate",
    "make_splits",
]


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
    # DESCRIPTIVE_KINDS (read by parse_descriptive).
    "column_space_basis": (
        "Describe the column space of A = {A}: its dimension, the space it lies in and a basis.",
        "What is the column space C(A) of the matrix A = {A}? Give the rank, a basis and the "
        "space R^m it is in.",
        "Let A = {A}. Say in words what the column space of A is, with a basis of pivot columns.",
    ),
    "subspaces": (
        "A is a {m} by {n} matrix of rank {r}. Describe its column space and its nullspace.",
        "Suppose the {m} by {n} matrix A has rank r = {r}. What are the column space and the "
        "nullspace of A?",
        "For an m by n matrix A with m = {m}, n = {n} and rank r = {r}, describe C(A) and N(A) "
        "in words.",
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


def format_block(block: Matrix) -> str:
    """A block pattern as a question writes it: the multiple of A in each block, 0 for a zero
    block.

    Example:

    >>> format_block(as_matrix([[1, 1], [0, -2]]))
    '[[A, A], [0, -2A]]'
    """

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
    # The integer free entries of a generated echelon form are in [-free_entry, free_entry]
    # (the special solutions' entries are their negatives).
    free_entry: int = 3
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
    # The fraction of questions written in the exam's forms (EXAM_TEMPLATES): elimination steps
    # in words ("subtracted 3 times row 1 from row 2"), R and d given by a complete solution
    # (the chain derives them first), block matrices with their size stated, multiple choices
    # on m by n matrices, and the exam's wordings of the other kinds. 0 draws nothing more: the
    # plain phrasings' data stay as they are.
    exam_rate: float = 0.0
    # The fraction of questions whose matrices and vectors are written in LaTeX (bmatrix with
    # or without commas, ``[..]^T``, ``\frac``, ``c_1``, ``$...$``: exam.latex_question).
    latex_rate: float = 0.0

    @classmethod
    def exam(cls, **changes: object) -> GeneratorConfig:
        """The sizes and forms of the 18.06 exam of 1 March 2010 (the GiantRabbit study's): all
        six kinds, block matrices up to 6 by 8 (half of the rref questions), nullspaces of 3 by
        4 matrices, elimination on 3 by 3, complete solutions in 3 unknowns, m and n up to 9,
        half the questions in the exam's forms and half in LaTeX, entries of questions up to 30
        and free entries of echelon forms up to 6; ``changes`` replace fields.

        Example:

        >>> cfg = GeneratorConfig.exam()
        >>> cfg.rref_shape, cfg.exam_rate, GeneratorConfig.exam(latex_rate=0.0).latex_rate
        ((6, 8), 0.5, 0.0)
        """
        values: dict[str, object] = dict(
            rref_shape=(6, 8),
            nullspace_shape=(3, 4),
            column_space_shape=(3, 2),
            elimination_shape=(3, 3),
            block_rate=0.5,
            free_entry=6,
            max_entry=30,
            max_number=60,
            max_steps=24,
            exam_rate=0.5,
            latex_rate=0.5,
        )
        return cls(**(values | changes))

    def __post_init__(self) -> None:
        if (
            not isinstance(self.kinds, tuple)
            or not self.kinds
            or any(k not in KINDS + DESCRIPTIVE_KINDS for k in self.kinds)
        ):
            raise ValueError(
                f"GeneratorConfig: `kinds` must be a non-empty tuple of {KINDS + DESCRIPTIVE_KINDS}"
                f"; got {self.kinds!r}"
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
        check_int(self.free_entry, "free_entry", "GeneratorConfig", low=1, high=9)
        check_int(self.max_number, "max_number", "GeneratorConfig", low=9, high=10**6)
        check_int(self.max_steps, "max_steps", "GeneratorConfig", low=4, high=128)
        Arithmetic.of(self.arithmetic, self.products, "GeneratorConfig")
        for name in ("block_rate", "fraction_rate", "exam_rate", "latex_rate"):
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
    return Fraction(rng.randint(-cfg.free_entry, cfg.free_entry))


def _random_echelon(rng: random.Random, m: int, n: int, rank: int, cfg: GeneratorConfig) -> Matrix:
    """A random m x n reduced row echelon form of the given rank."""
    pivots = sorted(rng.sample(range(n), rank))
    r = zeros(m, n)
    for i, pivot in enumerate(pivots):
        r[i][pivot] = Fraction(1)
        for j in range(pivot + 1, n):
            if j not in pivots:
                r[i][j] = _free_entry(rng, cfg)
    return as_matrix(r)


def _random_invertible(rng: random.Random, m: int) -> Matrix:
    """An integer m x m matrix made of a few random row operations on I (swaps, row + c*row
    with c in ±1, ±2, and scalings by -1, 2 or 3): what mixes an echelon form into a question."""
    matrix = identity(m)
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
    return _integer_rows(matmul(_random_invertible(rng, m), _random_echelon(rng, m, n, rank, cfg)))


def _entries_ok(values: Sequence[Fraction], cfg: GeneratorConfig) -> bool:
    return all(x.denominator == 1 and abs(x) <= cfg.max_entry for x in values)


def _draw_matrix_question(
    rng: random.Random, kind: str, cfg: GeneratorConfig, phrasing: str
) -> ParsedQuestion | None:
    """A question about one matrix A of up to ``cfg.nullspace_shape`` (nullspace,
    column_space_basis), of a random rank (None when an entry breaks a bound)."""
    rows, cols = rng.randint(2, cfg.nullspace_shape[0]), rng.randint(2, cfg.nullspace_shape[1])
    a = _random_matrix(rng, rows, cols, rng.randint(1, min(rows, cols)), cfg)
    if not _entries_ok([x for row in a for x in row], cfg):
        return None
    return ParsedQuestion(kind, phrasing.format(A=format_matrix(a)), A=a)


def _draw(
    rng: random.Random, kind: str, cfg: GeneratorConfig, phrasing: str
) -> ParsedQuestion | None:
    """One candidate question of ``kind`` (None when the draw breaks the entry bound)."""
    if phrasing in EXAM_TEMPLATES.get(kind, ()) or kind in DESCRIPTIVE_KINDS:
        return _draw_exam(rng, kind, cfg, phrasing)
    if kind == "rref":
        max_rows, max_cols = cfg.rref_shape
        if "{block}" in phrasing:
            block = as_matrix(rng.choice(_BLOCKS))
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
            values["block"] = format_block(block)
        return ParsedQuestion(kind, phrasing.format(**values), A=a, block=block)
    if kind == "nullspace":
        return _draw_matrix_question(rng, kind, cfg, phrasing)
    if kind == "column_space":
        cols = rng.randint(1, cfg.column_space_shape[1])
        rows = rng.randint(max(2, cols), cfg.column_space_shape[0])
        a = _random_matrix(rng, rows, cols, cols, cfg)
        if rows > cols and rng.random() < 0.5:
            x = tuple(Fraction(rng.randint(-3, 3)) for _ in range(cols))
            b = matvec(a, x)
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
        question = phrasing.format(x=terms, m=m, n=n, rows=counted(m, "row"))
        return ParsedQuestion(kind, question, x_p=x_p, special=tuple(special), rows=m)
    # elimination
    max_rows, max_cols = cfg.elimination_shape
    rows, cols = rng.randint(2, max_rows), rng.randint(2, max_cols)
    a = _random_matrix(rng, rows, cols, rng.randint(1, min(rows, cols)), cfg)
    reduction = row_reduce(a)
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


def _draw_exam(
    rng: random.Random, kind: str, cfg: GeneratorConfig, phrasing: str
) -> ParsedQuestion | None:
    """One candidate question of ``kind`` in an exam form or a descriptive kind (None when the
    draw breaks a bound)."""
    if kind == "subspaces":
        m, n = rng.randint(1, cfg.solvability_dim), rng.randint(1, cfg.solvability_dim)
        r = rng.randint(1, min(m, n))
        return ParsedQuestion(kind, phrasing.format(m=m, n=n, r=r), rows=m, cols=n, rank=r)
    if kind == "column_space_basis":
        return _draw_matrix_question(rng, kind, cfg, phrasing)
    if kind in ("complete_solution", "nullspace", "column_space"):  # the plain draw, reworded
        parsed = _draw(rng, kind, cfg, TEMPLATES[kind][0])
        if parsed is None:
            return None
        values: dict[str, str | int] = {}
        if parsed.A is not None:
            values["A"] = format_matrix(parsed.A)
        if parsed.b is not None:
            values["b"] = format_vector(parsed.b)
        if parsed.x_p is not None:
            values["x"] = " + ".join(
                [format_vector(parsed.x_p)]
                + [f"c{k + 1} * {format_vector(s)}" for k, s in enumerate(parsed.special)]
            )
            values |= {"m": parsed.rows, "n": len(parsed.x_p)}
        return dataclasses.replace(parsed, question=phrasing.format(**values))
    if kind == "solvability":
        # A multiple choice with exactly one true combination of a frequency and a property.
        m, n = rng.randint(1, cfg.solvability_dim), rng.randint(1, cfg.solvability_dim)
        r = rng.randint(1, min(m, n))
        frequencies = sorted(rng.sample(FREQUENCIES, rng.randint(2, 3)), key=FREQUENCIES.index)
        order = tuple(PROPERTIES)
        properties = sorted(rng.sample(order, rng.randint(2, 3)), key=order.index)
        choices, groups = choice_text(frequencies, properties, rng)
        parsed = ParsedQuestion(
            kind,
            phrasing.format(m=m, n=n, r=r, choices=choices),
            rows=m,
            cols=n,
            rank=r,
            choices=groups,
        )
        answer = solve(parsed).answer
        return None if " or " in answer or answer == "none of the options" else parsed
    if kind == "rref":
        block = ((1, 1), (1, 1)) if rng.random() < 0.5 else rng.choice(_BLOCKS)
        block = as_matrix(block)
        max_rows, max_cols = cfg.rref_shape
        rows = rng.randint(-(-2 // len(block)), max_rows // len(block))
        cols = rng.randint(-(-2 // len(block[0])), max_cols // len(block[0]))
        a = _random_matrix(rng, rows, cols, rng.randint(1, min(rows, cols)), cfg)
        if not _entries_ok([x for row in a for x in row], cfg):
            return None
        shape = f"{rows * len(block)} by {cols * len(block[0])}"
        question = phrasing.format(A=format_matrix(a), block=format_block(block), shape=shape)
        return ParsedQuestion(kind, question, A=a, block=block)
    # elimination
    if "{x}" not in phrasing:  # R and d given, the steps in words
        parsed = _draw(rng, kind, cfg, TEMPLATES[kind][0])
        if parsed is None:
            return None
        question = phrasing.format(
            R=format_matrix(parsed.R),
            d=format_vector(parsed.d),
            steps=operations_in_words(parsed.operations, rng),
        )
        return ParsedQuestion(kind, question, R=parsed.R, d=parsed.d, operations=parsed.operations)
    # R and d given by a complete solution, then steps of forward elimination (a multiple of an
    # upper row taken from a lower one, now and then an exchange) that reached them.
    context = _draw(rng, "complete_solution", cfg, TEMPLATES["complete_solution"][0])
    if context is None:
        return None
    n = len(context.x_p)
    rank = n - len(context.special)
    m = rng.randint(max(2, rank), max(rank, cfg.elimination_shape[0]))
    ops = []
    for _ in range(rng.randint(1, cfg.elimination_ops)):
        i, j = sorted(rng.sample(range(m), 2))
        if rng.random() < 0.1:
            ops.append(RowOp("swap", j, i))
        else:
            ops.append(RowOp("add", j, i, Fraction(rng.choice((-5, -4, -3, -2, -1, 1, 2, 3)))))
    named = max(op.rows_needed() for op in ops)
    if "{m}" not in phrasing and named != m:
        return None  # the rows of A are those the steps name
    terms = " + ".join(
        [format_vector(context.x_p)]
        + [f"c{k + 1} * {format_vector(s)}" for k, s in enumerate(context.special)]
    )
    question = phrasing.format(x=terms, m=m, n=n, steps=operations_in_words(ops, rng))
    parsed = parse_question(question)  # R and d derived from the complete solution
    if parsed.operations != tuple(ops):
        raise AssertionError(f"the exam form {question!r} reads back other steps")
    return parsed


_INTEGER = re.compile(r"\d+")


def _within_bounds(problem: Problem, cfg: GeneratorConfig) -> bool:
    if len(problem.steps) > cfg.max_steps:
        return False
    numbers = _INTEGER.findall(" ".join(problem.steps) + " " + problem.answer)
    return all(len(x) <= 7 and int(x) <= cfg.max_number for x in numbers)


_MAX_DRAWS = 1000


def _choose_template(kind: str, rng: random.Random, cfg: GeneratorConfig) -> str:
    # No draw at all for the exam's forms when exam_rate is 0: the plain data stay the same.
    if cfg.exam_rate and kind in EXAM_TEMPLATES and rng.random() < cfg.exam_rate:
        if kind != "rref" or rng.random() < cfg.block_rate:
            return rng.choice(EXAM_TEMPLATES[kind])
    if kind != "rref":
        return TEMPLATES[kind][rng.randrange(len(TEMPLATES[kind]))]
    block = rng.random() < cfg.block_rate
    return rng.choice([t for t in TEMPLATES[kind] if ("{block}" in t) == block])


def _generate(
    kind: str, rng: random.Random, cfg: GeneratorConfig, template: int | None
) -> tuple[ParsedQuestion, Problem]:
    for _ in range(_MAX_DRAWS):
        if template is None:
            chosen = _choose_template(kind, rng, cfg)
        else:
            chosen = TEMPLATES[kind][template]
        parsed = _draw(rng, kind, cfg, chosen)
        if parsed is None:
            continue
        if cfg.latex_rate and rng.random() < cfg.latex_rate:
            parsed = dataclasses.replace(parsed, question=latex_question(parsed.question, rng))
        problem = solve(parsed)
        if ALREADY_REDUCED in problem.steps:
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
      kind: one of :data:`KINDS` or :data:`DESCRIPTIVE_KINDS`.
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
    if kind not in KINDS + DESCRIPTIVE_KINDS:
        raise ValueError(
            f"generate: `kind` must be one of {KINDS + DESCRIPTIVE_KINDS}; got {kind!r}"
        )
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
    exclude: Iterable[ParsedQuestion] = (),
) -> dict[str, tuple[Problem, ...]]:
    """Fixed train / validation / test splits: example ``i`` of a split has kind
    ``config.kinds[i % len(kinds)]``; no split holds a question that shares content
    (:attr:`ParsedQuestion.contents`: the question, its matrix A, its complete solution, its
    m, n and rank) with one of ``exclude`` (an exam's own questions, read at run time).

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
    excluded: set[str] = set()
    for q in exclude:
        if not isinstance(q, ParsedQuestion):
            raise TypeError(
                f"make_splits: `exclude` must hold ParsedQuestions; got {type(q).__name__}"
            )
        excluded |= q.contents
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
                if excluded and parsed.contents & excluded:
                    continue
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
        parse = parse_descriptive if p.kind in DESCRIPTIVE_KINDS else parse_question
        keys.setdefault(p.kind, set()).add(parse(p.question).key)
    return {kind: len(keys[kind]) for kind in KINDS + DESCRIPTIVE_KINDS if kind in keys}
