"""Exact numbers, vectors and matrices (:class:`fractions.Fraction`), their text, elementary
row operations and Gauss-Jordan elimination with every operation recorded.

The lowest module of :mod:`sparse_jax.data.linalg_cot`: the solver, the parser and the generator
build on it. Matrices are tuples of rows (:data:`Matrix`), written row-major like
``[[1, 2], [3, 4/3]]`` (:func:`format_matrix`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from sparse_jax.validation import check_bool, check_int

__all__ = [
    "Matrix",
    "RowOp",
    "Vector",
    "format_matrix",
    "format_number",
    "format_vector",
    "row_arithmetic",
]

Matrix = tuple[tuple[Fraction, ...], ...]
Vector = tuple[Fraction, ...]


# -------------------------------------------------------------------------------------------
# Numbers, vectors, matrices.


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless the count is 1: ``1 row``, ``0 rows``, ``3 rows``.

    Example:

    >>> counted(1, "row"), counted(3, "free variable")
    ('1 row', '3 free variables')
    """
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


def as_matrix(rows: Sequence[Sequence[Fraction | int]]) -> Matrix:
    """Rows of ints or Fractions as a :data:`Matrix` (a tuple of tuples of Fractions).

    Example:

    >>> as_matrix([[1, 2]])
    ((Fraction(1, 1), Fraction(2, 1)),)
    """
    return tuple(tuple(Fraction(x) for x in row) for row in rows)


def zeros(m: int, n: int) -> list[list[Fraction]]:
    """An m x n matrix of zeros as lists (to fill in, then :func:`as_matrix`).

    Example:

    >>> format_matrix(zeros(2, 3))
    '[[0, 0, 0], [0, 0, 0]]'
    """
    return [[Fraction(0)] * n for _ in range(m)]


def identity(m: int) -> Matrix:
    """The m x m identity matrix.

    Example:

    >>> format_matrix(identity(2))
    '[[1, 0], [0, 1]]'
    """
    return tuple(tuple(Fraction(int(i == j)) for j in range(m)) for i in range(m))


def matmul(a: Matrix, b: Matrix) -> Matrix:
    """The product ``a @ b``, exactly.

    Example:

    >>> format_matrix(matmul(as_matrix([[1, 2], [0, 1]]), as_matrix([[1, 0], [3, 1]])))
    '[[7, 2], [3, 1]]'
    """
    return tuple(
        tuple(
            sum((a[i][k] * b[k][j] for k in range(len(b))), Fraction(0)) for j in range(len(b[0]))
        )
        for i in range(len(a))
    )


def matvec(a: Matrix, x: Vector) -> Vector:
    """The product ``a @ x``, exactly.

    Example:

    >>> format_vector(matvec(as_matrix([[1, 2], [3, 4]]), (Fraction(1), Fraction(-1, 2))))
    '[0, 1]'
    """
    return tuple(
        sum((a_ij * x_j for a_ij, x_j in zip(row, x, strict=True)), Fraction(0)) for row in a
    )


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
    >>> format_matrix(op.apply(as_matrix([[1, 2], [2, 5]])))
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
        return as_matrix(rows)

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
class Reduction:
    """A Gauss-Jordan elimination (:func:`row_reduce`) with every operation and state recorded.

    Example:

    >>> reduction = row_reduce(as_matrix([[2, 4], [1, 3]]))
    >>> [op.text() for op in reduction.ops], reduction.pivots
    (['R1 = (1/2)*R1', 'R2 = R2 - 1*R1', 'R1 = R1 - 2*R2'], (0, 1))
    >>> format_matrix(reduction.befores()[1]), format_matrix(reduction.matrix)
    ('[[1, 2], [1, 3]]', '[[1, 0], [0, 1]]')
    """

    matrix: Matrix  # the reduced matrix
    ops: tuple[RowOp, ...]  # the operations, in order
    states: tuple[Matrix, ...]  # the matrix after each operation
    pivots: tuple[int, ...]  # the pivot column of row 0, 1, ... (in the order they were found)
    start: Matrix  # the matrix before the first operation

    def befores(self) -> tuple[Matrix, ...]:
        """The matrix before each operation (``start``, then each state but the last)."""
        return (self.start, *self.states)[: len(self.ops)]


def row_reduce(matrix: Matrix, columns: Sequence[int] | None = None) -> Reduction:
    """Gauss-Jordan elimination over ``columns`` (default: all, left to right), recording every
    operation: per column, the first row at or below the current pivot row with a nonzero entry
    is swapped up, scaled to a pivot of 1, and the column is cleared in every other row.

    Example (the columns of A only, as for an augmented matrix ``[A | b]``):

    >>> reduction = row_reduce(as_matrix([[0, 1, 5], [2, 4, 6]]), columns=range(2))
    >>> [op.text() for op in reduction.ops]
    ['R1 <-> R2', 'R1 = (1/2)*R1', 'R1 = R1 - 2*R2']
    >>> format_matrix(reduction.matrix), reduction.pivots
    ('[[1, 0, -7], [0, 1, 5]]', (0, 1))
    """
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
    return Reduction(matrix, tuple(ops), tuple(states), tuple(pivots), start)


def rotate(matrix: Matrix) -> Matrix:
    """The matrix turned by 180 degrees (rows and columns reversed).

    Example:

    >>> format_matrix(rotate(as_matrix([[1, 2], [3, 4]])))
    '[[4, 3], [2, 1]]'
    """
    return tuple(row[::-1] for row in reversed(matrix))


class Arithmetic(enum.Enum):
    """How the worked solutions write row operations (:func:`solve`'s two switches).

    Example:

    >>> Arithmetic.of(True, False, "solve"), Arithmetic.of(True, True, "solve")
    (<Arithmetic.TERMS: 'terms'>, <Arithmetic.PRODUCTS: 'products'>)
    """

    OFF = "off"  # the operation and the matrix after it
    TERMS = "terms"  # with the changed row's entries computed (row_arithmetic)
    PRODUCTS = "products"  # ... each combination's product written before its sum

    @classmethod
    def of(cls, arithmetic: bool, products: bool, caller: str) -> Arithmetic:
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

    >>> a = as_matrix([[1, -1], [2, 1]])
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


def row_op_step(
    op: RowOp, before: Matrix, after: Matrix, arithmetic: Arithmetic, label: str = "R"
) -> str:
    """``R2 = R2 - 2*R1 -> [[...]]``, with :func:`row_arithmetic` of ``op`` on ``before``
    after a colon when ``arithmetic`` asks for it (``after``: the matrix after the arrow).

    Example:

    >>> op, before = RowOp("add", target=1, source=0, factor=Fraction(-2)), as_matrix([[1], [3]])
    >>> row_op_step(op, before, op.apply(before), Arithmetic.OFF)
    'R2 = R2 - 2*R1 -> [[1], [1]]'
    >>> row_op_step(op, before, op.apply(before), Arithmetic.TERMS)
    'R2 = R2 - 2*R1: [3-2*1=1] -> [[1], [1]]'
    """
    worked = (
        row_arithmetic(op, before, products=arithmetic is Arithmetic.PRODUCTS)
        if arithmetic is not Arithmetic.OFF
        else ""
    )
    return f"{op.text(label)}{': ' + worked if worked else ''} -> {format_matrix(after)}"


def op_steps(reduction: Reduction, arithmetic: Arithmetic, label: str = "R") -> list[str]:
    """One :func:`row_op_step` per operation of ``reduction``: the worked steps of an
    elimination (rows named ``label`` + number).

    Example:

    >>> op_steps(row_reduce(as_matrix([[2, 4]])), Arithmetic.OFF)
    ['R1 = (1/2)*R1 -> [[1, 2]]']
    """
    return [
        row_op_step(op, before, state, arithmetic, label)
        for op, before, state in zip(
            reduction.ops, reduction.befores(), reduction.states, strict=True
        )
    ]
