"""The symbolic solver: the worked solution and canonical answer of a :class:`ParsedQuestion`
of each kind (:func:`solve`). It makes the data and the reference answers; it is never a
model's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from sparse_jax.data.linalg_cot.algebra import (
    Arithmetic,
    Matrix,
    Reduction,
    RowOp,
    Vector,
    as_matrix,
    counted,
    format_matrix,
    format_number,
    format_vector,
    identity,
    matvec,
    op_steps,
    rotate,
    row_op_step,
    row_reduce,
    zeros,
)
from sparse_jax.data.linalg_cot.problems import (
    ALREADY_REDUCED,
    DESCRIPTIVE_KINDS,
    KINDS,
    PROPERTIES,
    ParsedQuestion,
    Problem,
    read_option,
)
from sparse_jax.validation import check_int

__all__ = [
    "solve",
]


# -------------------------------------------------------------------------------------------
# The solver.


def _variables(indices: Sequence[int]) -> str:
    """``x1, x3`` for the 0-based indices (0, 2); ``none`` for none."""
    return ", ".join(f"x{j + 1}" for j in indices) or "none"


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


def _reduction_steps(reduction: Reduction, arithmetic: Arithmetic) -> list[str]:
    return op_steps(reduction, arithmetic) or [ALREADY_REDUCED]


def _expand_block(a: Matrix, block: Matrix) -> Matrix:
    return tuple(
        tuple(c * x for c in block_row for x in a_row) for block_row in block for a_row in a
    )


def _solve_rref(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    steps = []
    matrix = p.A
    if p.block is not None:
        matrix = _expand_block(p.A, p.block)
        steps.append(f"B = {format_matrix(matrix)}")
    reduction = row_reduce(matrix)
    steps += _reduction_steps(reduction, arithmetic)
    return steps, format_matrix(reduction.matrix)


def _solve_nullspace(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    reduction = row_reduce(p.A)
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
    steps.append(f"{counted(len(free), 'special solution')} -> N(A) is {words}")
    listed = ", ".join(solutions) if solutions else "no special solutions"
    return steps, f"{listed}; N(A) is {words}"


def _solve_column_space(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    n = len(p.A[0])
    augmented = tuple((*row, b_i) for row, b_i in zip(p.A, p.b, strict=True))
    steps = [f"[A | b] = {format_matrix(augmented)}"]
    reduction = row_reduce(augmented, columns=range(n))
    steps += op_steps(reduction, arithmetic)
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


def _rank_steps(m: int, n: int, r: int) -> list[str]:
    """What the rank says about C(A) (against m) and about uniqueness (against n)."""
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
        free_variables = counted(n - r, "free variable")
        second = f"r = {r} < n = {n}: {free_variables}, so a solution is never unique"
    return [first, second]


def _solve_solvability(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    del arithmetic  # no row operations
    m, n, r = p.rows, p.cols, p.rank
    steps = _rank_steps(m, n, r)
    if p.choices:
        # A multiple choice: how often each offered property holds, then the offered
        # combinations that are true, in the question's order of groups and options.
        read = [[read_option(o) for o in group] for group in p.choices]
        frequencies_first = read[0][0][0] == "frequency"
        frequencies, properties = (0, 1) if frequencies_first else (1, 0)
        chosen = []
        for option, (_, prop) in zip(p.choices[properties], read[properties], strict=True):
            how_often = _solvability_answer(m, n, r, prop)
            steps.append(f"so Ax = b has {option}: {how_often}")
            for word, (_, frequency) in zip(p.choices[frequencies], read[frequencies], strict=True):
                if frequency == how_often:
                    chosen.append(f"{word}; {option}" if frequencies_first else f"{option}; {word}")
        return steps, " or ".join(chosen) or "none of the options"
    answer = _solvability_answer(m, n, r, p.solutions)
    return [*steps, f"so Ax = b has {PROPERTIES[p.solutions]}: {answer}"], answer


def _subspace_words(dimension: int, n: int) -> str:
    return _nullspace_words(dimension, n)


def _solve_subspaces(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    del arithmetic  # no row operations
    m, n, r = p.rows, p.cols, p.rank
    column, null = _subspace_words(r, m), _subspace_words(n - r, n)
    steps = [
        f"r = m = {m}: C(A) is {column}" if r == m else f"r = {r} < m = {m}: C(A) is {column}",
        f"r = n = {n}: no free variables -> N(A) is {null}"
        if r == n
        else f"r = {r} < n = {n}: {counted(n - r, 'free variable')} -> N(A) is {null}",
    ]
    return steps, f"C(A) is {column}; N(A) is {null}"


def _solve_column_space_basis(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    reduction = row_reduce(p.A)
    steps = _reduction_steps(reduction, arithmetic)
    m, r = len(p.A), len(reduction.pivots)
    pivots = sorted(reduction.pivots)
    columns = ", ".join(format_vector(tuple(row[j] for row in p.A)) for j in pivots)
    numbers = ", ".join(str(j + 1) for j in pivots)
    if pivots:
        steps.append(f"pivot columns {numbers} of A: basis {columns}")
    else:
        steps.append("no pivot columns: the basis is empty")
    words = _subspace_words(r, m)
    steps.append(
        f"r = m = {m}: C(A) is {words}" if r == m else f"r = {r} < m = {m}: C(A) is {words}"
    )
    return steps, f"rank {r}; C(A) is {words}; basis {columns or 'none'}"


def _solve_complete_solution(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    n, m = len(p.x_p), p.rows
    steps = []
    special_of: dict[int, Vector] = {}
    if p.special:
        # Putting s1, s2, ... in special form (1 on its own free variable, 0 on the others) is
        # Gauss-Jordan on the matrix of their rows turned by 180 degrees: free variables are
        # those that can be the last nonzero entry of a nullspace vector, and special solutions
        # listed in the order of their free variables need no operation at all.
        reduction = row_reduce(rotate(as_matrix(p.special)))
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
            steps.append(row_op_step(turned, rotate(before), rotate(state), arithmetic, "s"))
        special_of = {
            n - 1 - col: row[::-1]
            for col, row in zip(reduction.pivots, reduction.matrix, strict=False)
        }
    free = sorted(special_of)
    pivots = [j for j in range(n) if j not in special_of]
    if m < len(pivots):
        raise ValueError(
            f"solve: A has {counted(m, 'row')} but the complete solution needs rank "
            f"{len(pivots)} ({n} unknowns, {len(free)} special solutions): `rows` must be >= "
            f"{len(pivots)}"
        )
    names = ", ".join(f"s{k + 1}" for k in range(len(free)))
    source = f" (the 1s of {names})" if free else ""
    steps.append(f"free variables {_variables(free)}{source}; pivot variables {_variables(pivots)}")
    r = zeros(m, n)
    for i, pivot in enumerate(pivots):
        r[i][pivot] = Fraction(1)
        for f in free:
            r[i][f] = -special_of[f][pivot]
        steps.append(f"pivot x{pivot + 1}: row {i + 1} of R = {format_vector(r[i])}")
    r_matrix = as_matrix(r)
    zero_rows = m - len(pivots)
    if zero_rows == 1:
        steps.append(f"row {m} of R is zero -> R = {format_matrix(r_matrix)}")
    elif zero_rows > 1:
        steps.append(
            f"rows {len(pivots) + 1} to {m} of R are zero -> R = {format_matrix(r_matrix)}"
        )
    else:
        steps.append(f"R = {format_matrix(r_matrix)}")
    d = matvec(r_matrix, p.x_p)
    steps.append(f"d = R x_p = {format_vector(d)}")
    return steps, f"R = {format_matrix(r_matrix)}; d = {format_vector(d)}"


def _solve_elimination(p: ParsedQuestion, arithmetic: Arithmetic) -> tuple[list[str], str]:
    m, n = len(p.R), len(p.R[0])
    steps = []
    if p.x_p is not None:  # R and d come from the complete solution the question states
        steps += _solve_complete_solution(p, arithmetic)[0]
    state = tuple((*e, *row, d_i) for e, row, d_i in zip(identity(m), p.R, p.d, strict=True))
    steps.append(f"start from [I | R | d] = {format_matrix(state)}")
    for op in reversed(p.operations):
        undo = op.inverse()
        before, state = state, undo.apply(state)
        steps.append(f"undo {op.text()}: {row_op_step(undo, before, state, arithmetic)}")
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
    "column_space_basis": _solve_column_space_basis,
    "subspaces": _solve_subspaces,
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
    if kind in ("rref", "nullspace", "column_space", "column_space_basis"):
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
    elif kind in ("solvability", "subspaces"):
        m = check_int(p.rows, "rows", "solve")
        n = check_int(p.cols, "cols", "solve")
        check_int(p.rank, "rank", "solve", low=0, high=min(m, n))
        if kind == "subspaces":
            return
        if p.choices:
            _check_choices(p.choices)
        elif p.solutions not in PROPERTIES:
            raise ValueError(
                f"solve: `solutions` must be one of {sorted(PROPERTIES)}; got {p.solutions!r}"
            )
    else:
        raise ValueError(f"solve: `kind` must be one of {KINDS + DESCRIPTIVE_KINDS}; got {kind!r}")
    if kind == "elimination" and p.x_p is not None:
        _check_vector(p.x_p, "x_p", kind)
        check_int(p.rows, "rows", "solve")


def _check_choices(choices: Any) -> None:
    """Two groups of options: one of frequencies, one of solution properties."""
    ok = isinstance(choices, tuple) and len(choices) == 2
    ok = ok and all(
        isinstance(g, tuple) and g and all(isinstance(o, str) for o in g) for g in choices
    )
    read = [[read_option(o) for o in group] for group in choices] if ok else []
    sorts = [{r[0] if r else "?" for r in group} for group in read]
    if not ok or sorted(map(tuple, sorts)) != [("frequency",), ("property",)]:
        raise ValueError(
            "solve: `choices` must be two groups of options, one of frequencies (always / "
            "sometimes but not always / never) and one of solutions (exactly one solution / "
            f"infinitely many solutions / no solution); got {choices!r:.160}"
        )


def solve(parsed: ParsedQuestion, *, arithmetic: bool = False, products: bool = False) -> Problem:
    """The worked solution and canonical answer of a parsed question (the symbolic solver).

    It makes the data and the reference answers for grading; it is never a model's answer.
    With ``arithmetic``, each row scaling or combination also writes the entries of the row it
    changes, computed one by one (:func:`row_arithmetic`), between the operation and the
    matrix after it (:attr:`GeneratorConfig.arithmetic`); with ``products`` too, each
    combination's term writes its product before its sum (:attr:`GeneratorConfig.products`).

    Example:

    >>> from sparse_jax.data.linalg_cot import parse_question
    >>> problem = solve(parse_question(
    ...     "A is a 3 by 5 matrix of rank 3. Does Ax = b have exactly one solution always, "
    ...     "sometimes but not always, or never?"))
    >>> problem.steps[1], problem.answer
    ('r = 3 < n = 5: 2 free variables, so a solution is never unique', 'never')
    """
    if not isinstance(parsed, ParsedQuestion):
        raise TypeError(f"solve: `parsed` must be a ParsedQuestion; got {type(parsed).__name__}")
    worked = Arithmetic.of(arithmetic, products, "solve")
    _check_parsed(parsed)
    steps, answer = _SOLVERS[parsed.kind](parsed, worked)
    return Problem(parsed.kind, parsed.question, tuple(steps), answer)
