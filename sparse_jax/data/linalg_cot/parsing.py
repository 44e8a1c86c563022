"""The question parser: :func:`parse_question` reads a question in any phrasing of
:data:`~sparse_jax.data.linalg_cot.TEMPLATES`, and reasonable user phrasings, into a
:class:`ParsedQuestion`; malformed text raises ``ValueError`` naming what could not be read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from sparse_jax.data.linalg_cot.algebra import Matrix, RowOp, Vector, format_vector
from sparse_jax.data.linalg_cot.problems import PROPERTIES, ParsedQuestion

__all__ = [
    "parse_question",
]


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
