"""The question parser: :func:`parse_question` reads a question in any phrasing of
:data:`~sparse_jax.data.linalg_cot.TEMPLATES`, and questions as people write them (LaTeX,
multiple choice, elimination in words), into a :class:`ParsedQuestion`; malformed text, and a
question no kind answers, raise ``ValueError`` saying why. :func:`choice_answers` gives the
chosen words of a multiple-choice question.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from fractions import Fraction

from sparse_jax.data.linalg_cot.algebra import Matrix, RowOp, Vector, format_vector
from sparse_jax.data.linalg_cot.problems import FREQUENCIES, PROPERTIES, ParsedQuestion
from sparse_jax.data.linalg_cot.solver import solve

__all__ = [
    "choice_answers",
    "parse_descriptive",
    "parse_question",
]


# -------------------------------------------------------------------------------------------
# Questions as people write them, normalized to the generator's notation before parsing:
# LaTeX matrices -> [[..], [..]], math delimiters and text commands dropped, elimination in
# words -> R2 = R2 - 3*R1.

_LATEX_TEXT = re.compile(
    r"\\(?:text|textrm|textit|textbf|mathrm|mathbf|mathit|mathbb|operatorname|boldsymbol|vec|bm)"
    r"\s*\{([^{}]*)\}"
)
_LATEX_FRAC = re.compile(r"(-?)\s*\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_LATEX_WORDS = (
    (re.compile(r"\\(?:cdot|ast)(?![A-Za-z])"), "*"),
    (re.compile(r"\\times(?![A-Za-z])"), " x "),
    (re.compile(r"\\(?:[,;:! ]|quad(?![A-Za-z])|qquad(?![A-Za-z]))"), " "),
    (re.compile(r"_\{\s*(\w+)\s*\}"), r"_\1"),
    (re.compile(r"\$\$?|\\\(|\\\)|\\\[|\\\]"), " "),  # math delimiters
    (re.compile(r"\\\\"), " "),  # a line break outside a matrix
    (re.compile("[\u2212\u2013]"), "-"),  # minus and en dash
)
_TRANSPOSE = re.compile(r"\^\s*(?:\{\s*(?:T|\\top)\s*\}|\\top(?![A-Za-z])|T\b)")
_ENV_BEGIN = re.compile(r"(?:\\left\s*[\[(]\s*)?\\begin\s*\{\s*([bBpvV]?matrix|array)\s*\}")
_MATH_ENV = re.compile(r"\\(?:begin|end)\s*\{\s*(?:equation|align|gather|displaymath|math)\*?\s*\}")
_ENV_ANY = re.compile(r"\\(begin|end)\s*\{\s*([^{}]*?)\s*\}")
_ROW_BREAK = re.compile(r"\\\\(?:\s*\[[^\]]*\])?")
_LAST_NAME = re.compile(r"([A-Za-z]\w*)\s*(?:=|:|is the matrix|is the vector|is)\s*$")
_TRANSPOSED = re.compile(r"\s*\^T\b")


def _latex_cells(row: str, where: str) -> list[str]:
    """The entries of one row of a LaTeX matrix: separated by ``&``, by commas, or both."""
    cells = row.split("&")
    if len(cells) == 1:
        cells = row.split(",")
    cells = [cell.strip() for cell in cells]
    cells = [cell[:-1].strip() if cell.endswith(",") else cell for cell in cells]
    if cells and not cells[-1]:
        cells.pop()  # a trailing separator
    if any(not cell for cell in cells):
        raise ValueError(f"an empty entry in the row {row.strip()!r} of the LaTeX matrix {where}")
    return cells


def _latex_matrices(text: str) -> str:
    """``text`` with every ``\\begin{bmatrix} .. \\end{bmatrix}`` (also pmatrix, matrix, array,
    ``\\left[ .. \\right]`` around it) written ``[[.., ..], [.., ..]]``, or ``[.., ..]`` where it
    is a vector: one column, or one row transposed (``^T``), unless its name is upper case."""
    out = []
    i = 0
    while True:
        begin = _ENV_BEGIN.search(text, i)
        if begin is None:
            stray = _ENV_ANY.search(text, i)
            if stray:
                raise ValueError(
                    f"unsupported LaTeX \\{stray.group(1)}{{{stray.group(2)}}} at character "
                    f"{stray.start()} (matrices are read from bmatrix, pmatrix, matrix or array)"
                )
            out.append(text[i:])
            return "".join(out)
        env = begin.group(1)
        body_start = begin.end()
        if env == "array":  # its column specification, e.g. {ccc}
            spec = re.match(r"\s*\{[^{}]*\}", text[body_start:])
            body_start += spec.end() if spec else 0
        end = _ENV_ANY.search(text, body_start)
        where = f"at character {begin.start()} ({text[begin.start() : begin.start() + 40]!r}...)"
        if end is None or end.group(1) != "end" or end.group(2) != env:
            raise ValueError(
                f"the LaTeX matrix {where} is not closed by \\end{{{env}}}"
                + (f" (found \\{end.group(1)}{{{end.group(2)}}})" if end else "")
            )
        after = end.end()
        right = re.match(r"\s*\\right\s*[\])]", text[after:])
        after += right.end() if right else 0
        rows = [
            row.replace("\\hline", "") for row in _ROW_BREAK.split(text[body_start : end.start()])
        ]
        cells = [_latex_cells(row, where) for row in rows if row.strip()]
        if not cells:
            raise ValueError(f"the LaTeX matrix {where} is empty")
        before = "".join(out) + text[i : begin.start()]
        name = _LAST_NAME.search(before[-60:])
        upper = name is not None and name.group(1)[0].isupper()
        transposed = _TRANSPOSED.match(text, after) is not None
        column = len(cells) > 1 and all(len(row) == 1 for row in cells)
        if not upper and (column or (len(cells) == 1 and (transposed or name is not None))):
            literal = "[" + ", ".join(cell for row in cells for cell in row) + "]"
        else:
            literal = "[" + ", ".join("[" + ", ".join(row) + "]" for row in cells) + "]"
        out.append(text[i : begin.start()] + literal)
        i = after


_K = r"-?\d+(?:/\d+)?"
_IN_WORDS = (
    # "subtracted 2 times row 1 from row 3", "(then) 4 times row 2 from row 3",
    # "added 2 times row 1 to row 3", "subtract row 1 from row 2"
    (
        re.compile(
            rf"\b(?:(?P<verb>subtract|add)\w*\s+)?(?:(?P<k>{_K})\s*(?:times|\*|x)\s*"
            r"|(?P<twice>twice)\s+)?(?:the\s+)?row\s+(?P<i>\d+)\s+(?P<prep>from|to)\s+"
            r"(?:the\s+)?row\s+(?P<j>\d+)",
            re.IGNORECASE,
        ),
        "add",
    ),
    (
        re.compile(
            r"\b(?:exchang|swap|interchang)\w*\s+(?:the\s+)?rows?\s+(?P<i>\d+)\s+and\s+"
            r"(?:row\s+)?(?P<j>\d+)",
            re.IGNORECASE,
        ),
        "swap",
    ),
    (
        re.compile(
            rf"\b(?P<verb>multipl|divid)\w*\s+(?:the\s+)?row\s+(?P<i>\d+)\s+by\s+(?P<k>{_K})",
            re.IGNORECASE,
        ),
        "scale",
    ),
)


def _operation_in_words(match: re.Match, kind: str) -> str:
    """One row operation written in words, in the notation of the templates."""
    i, j = match.group("i"), match.group("j") if kind != "scale" else None
    if kind == "swap":
        return f"R{i} <-> R{j}"
    k = match.group("k")
    if kind == "scale":
        if match.group("verb").lower().startswith("divid"):
            value = _number(k, f"the row operation {match.group(0)!r}")
            if value == 0:
                raise ValueError(f"the row operation {match.group(0)!r} divides by zero")
            k = str(1 / value)
        return f"R{i} = ({k})*R{i}"
    verb, prep = (match.group("verb") or "").lower(), match.group("prep").lower()
    if not verb and k is None and not match.group("twice"):
        return match.group(0)  # "row 1 from row 2" alone is no operation
    if verb and (verb == "add") != (prep == "to"):
        raise ValueError(
            f"could not read the row operation {match.group(0)!r} (allowed: 'subtracted 2 "
            "times row 1 from row 3', 'added 2 times row 1 to row 3')"
        )
    factor = "2" if match.group("twice") else (k or "1")
    return f"R{j} = R{j} {'-' if prep == 'from' else '+'} ({factor})*R{i}"


def _normalize(text: str) -> str:
    """A question as people write it in the notation the templates use (see the section)."""
    for _ in range(3):  # nested \text{\mathbf{..}}
        text = _LATEX_TEXT.sub(r"\1", text)
    text = _LATEX_FRAC.sub(
        lambda m: (
            ("-" if (m.group(1) == "-") != m.group(2).startswith("-") else "")
            + f"{m.group(2).lstrip('-')}/{m.group(3)}"
        ),
        text,
    )
    text = _MATH_ENV.sub(" ", _TRANSPOSE.sub("^T", text))
    text = _latex_matrices(text)
    for pattern, replacement in _LATEX_WORDS:
        text = pattern.sub(replacement, text)
    for pattern, kind in _IN_WORDS:
        text = pattern.sub(lambda m, kind=kind: _operation_in_words(m, kind), text)
    return text


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
        transposed = _TRANSPOSED.match(text, i)
        if transposed:  # a vector's ^T changes nothing; a matrix's is its transpose
            if all(nested) and len({len(row) for row in value}) == 1:
                value = [list(column) for column in zip(*value, strict=True)]
            i = transposed.end()
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


_ABOUT_A_MATRIX = {
    "the column space": re.compile(r"\bcolumn space\b|\bc\(a\)"),
    "the nullspace": re.compile(r"\bnull ?space\b|\bn\(a\)"),
    "how often Ax = b has a solution": re.compile(r"\b(?:always|sometimes|never)\b"),
}
_EXPLAIN = re.compile(r"\bexplain\b(?:\s+in\s+words)?\s+(?:how|why|what|whether)\b")
_DESCRIBE_COLUMN_SPACE = re.compile(
    r"\b(?:describe|what\s+is|what's|find|give)\s+(?:in\s+words\s+)?the\s+column\s+space\b"
)
_KINDS_IN_WORDS = (
    "the complete solution (x = x_p + c1 * s1 ...), elimination steps (R2 = R2 - 2*R1, or "
    "'subtracted 2 times row 1 from row 2'), special solutions / nullspace, reduced row echelon "
    "form (rref), always / sometimes / never, or whether b is in the column space"
)


def _states_complete_solution(t: str) -> bool:
    return re.search(r"\+\s*[a-z]\w*\s*\*?\s*\[", t) is not None or "complete solution" in t


def _detect_kind(text: str) -> str:
    """The kind a (normalized) question asks, or ``ValueError`` saying why none answers it."""
    t = " ".join(text.lower().split())
    if not t:
        raise ValueError("could not tell what the question asks: the question is empty")
    if _EXPLAIN.search(t):
        raise ValueError(
            f"the question asks for an explanation in words ({_EXPLAIN.search(t).group(0)!r} ...), "
            "which no kind answers: they compute " + _KINDS_IN_WORDS
        )
    if _OP_START.search(text):
        return "elimination"
    if _states_complete_solution(t):
        asked = [what for what, pattern in _ABOUT_A_MATRIX.items() if pattern.search(t)]
        if asked:
            raise ValueError(
                f"the question states a complete solution of Ax = b and asks about {asked[0]}, "
                "which is not supported: from a complete solution the library finds R and d "
                "(Rx = d), or, given the elimination steps, E^-1, A and b"
            )
        return "complete_solution"
    if any(w in t for w in ("always", "sometimes", "never")) and any(
        w in t for w in ("rank", "solution", "solvable")
    ):
        return "solvability"
    if "rank" in t and "solution" in t and _CHOICE_GROUP.search(t):
        return "solvability"  # a multiple choice that offers no frequencies
    if "column space" in t or "c(a)" in t:
        return "column_space"
    if re.search(r"special solution|null ?space|\bn\(a\)|\bax\s*=\s*0\b", t):
        return "nullspace"
    if any(w in t for w in ("echelon", "rref", "row reduce", "reduce")):
        return "rref"
    raise ValueError("could not tell what the question asks: it names none of " + _KINDS_IN_WORDS)


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


def _parse_operations(text: str, rows: int | None) -> tuple[RowOp, ...]:
    """The row operations of ``text`` in order, on rows R1..R{rows} (None: up to R1000)."""
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
        if not all(1 <= k <= (rows or 1000) for k in indices):
            raise ValueError(
                f"the row operation {match.group(0)!r} names a row outside R1..R{rows or 1000}"
                + (f" (R has {rows} rows)" if rows else "")
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


_CHOICE_GROUP = re.compile(r"\(([^()]*/[^()]*)\)")
# The words a multiple choice may offer for each frequency (the canonical ones of FREQUENCIES).
_FREQUENCY_WORDS = {"always": "always", "sometimes": "sometimes but not always", "never": "never"}
_FREQUENCY_WORDS |= {f: f for f in FREQUENCIES}


def _frequency(option: str) -> str | None:
    return _FREQUENCY_WORDS.get(" ".join(option.lower().split()))


def _property(option: str) -> str | None:
    """The key of PROPERTIES an option such as 'a unique solution' names (None: not one)."""
    lowered = " ".join(option.lower().split())
    found = [p for p, pattern in _PROPERTY_PATTERNS.items() if pattern.search(lowered)]
    return found[0] if len(found) == 1 else None


def _choice_groups(text: str) -> tuple[tuple[str, ...], ...]:
    """The multiple-choice groups of a solvability question, in order: each a parenthesized
    list of options separated by '/' that are all frequencies or all properties."""
    groups = []
    for match in _CHOICE_GROUP.finditer(text):
        options = tuple(" ".join(o.split()) for o in match.group(1).split("/"))
        if len(options) < 2 or not all(re.search("[A-Za-z]", o) for o in options):
            continue
        for read in (_frequency, _property):
            keys = [read(o) for o in options]
            if all(keys):
                if len(set(keys)) != len(keys):
                    raise ValueError(f"the choice {match.group(0)!r} offers an option twice")
                groups.append(options)
                break
        else:
            raise ValueError(
                f"could not read the choice {match.group(0)!r}: its options must all be "
                "frequencies (always / sometimes but not always / never) or all solutions (a "
                "exactly one solution / infinitely many solutions / no solution)"
            )
    return tuple(groups)


def _parse_solvability(text: str, question: str) -> ParsedQuestion:
    shape = _parse_shape(text)
    if shape is None:
        raise ValueError("could not read the size of A (write e.g. 'a 3 by 5 matrix')")
    m, n = (_positive(v, f"the {w} of A") for v, w in zip(shape, ("rows", "columns"), strict=True))
    rank_match = _RANK.search(text)
    if rank_match is None:
        raise ValueError("could not read the rank of A (write e.g. 'rank 3' or 'r = 3')")
    r = int(rank_match.group(1) or rank_match.group(2))
    if r > min(m, n):
        raise ValueError(f"the rank {r} of a {m} by {n} matrix must be at most {min(m, n)}")
    choices = _choice_groups(text)
    if choices:
        kinds = [_frequency(group[0]) is not None for group in choices]
        if kinds.count(True) != 1 or kinds.count(False) != 1:
            raise ValueError(
                "a multiple choice must offer one group of frequencies (always / sometimes but "
                "not always / never) and one group of solutions (exactly one solution / many "
                f"solutions / no solution); got {len(choices)} groups: {choices}"
            )
        return ParsedQuestion("solvability", question, rows=m, cols=n, rank=r, choices=choices)
    lowered = " ".join(text.lower().split())
    found = [p for p, pattern in _PROPERTY_PATTERNS.items() if pattern.search(lowered)]
    if len(found) != 1:
        raise ValueError(
            "could not tell which property of the solutions is asked ("
            + (
                "the question names " + " and ".join(PROPERTIES[p] for p in found)
                if found
                else "none of 'exactly one solution', 'infinitely many solutions', 'no solution'"
            )
            + "; a multiple choice writes its options in parentheses separated by '/')"
        )
    return ParsedQuestion("solvability", question, rows=m, cols=n, rank=r, solutions=found[0])


def _parse_complete_solution(
    text: str, question: str, literals: list[_Literal], rows: int | None = None
) -> ParsedQuestion:
    """A complete_solution question; A's rows as the text states them, else ``rows`` (at least
    the rank), else ``ValueError``."""
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
    stated = re.search(r"\b(\d+)\s+rows?\b", text)
    if shape is not None:
        m = _positive(shape[0], "the rows of A")
        if shape[1] != len(x_p):
            raise ValueError(f"A is {shape[0]} by {shape[1]} but x has {len(x_p)} entries")
    elif stated is not None:
        m = _positive(int(stated.group(1)), "the rows of A")
    elif rows is not None:
        m = max(rows, len(x_p) - len(special))
    else:
        raise ValueError(
            "could not read how many rows A has (write e.g. 'A is 3 by 3' or 'A has 3 rows')"
        )
    return ParsedQuestion("complete_solution", question, x_p=x_p, special=special, rows=m)


def _parse_elimination(text: str, question: str, literals: list[_Literal]) -> ParsedQuestion:
    matrices = [lit for lit in literals if lit.depth == 2 and _is_numeric(lit)]
    if not matrices and _states_complete_solution(" ".join(text.lower().split())):
        # R and d from the complete solution the question states (the rref of A and R x_p);
        # A has as many rows as the text says, else as the elimination steps name.
        ops = _parse_operations(text, None)
        named = max((op.rows_needed() for op in ops), default=1)
        context = _parse_complete_solution(text, question, literals, rows=named)
        derived = _scan_literals(solve(context).answer)  # "R = [[..]]; d = [..]"
        r, d = _to_matrix(derived[0], "R"), _to_vector(derived[1], "d")
        # The complete solution stays with the question: its chain derives R and d first.
        stated = {"x_p": context.x_p, "special": context.special, "rows": context.rows}
    else:
        stated = {}
        r = _to_matrix(_one(literals, 2, "R"), "R")
        d = _to_vector(_one(literals, 1, "d"), "d")
    if len(d) != len(r):
        raise ValueError(f"d has {len(d)} entries but R has {len(r)} rows")
    operations = _parse_operations(text, len(r))
    return ParsedQuestion("elimination", question, R=r, d=d, operations=operations, **stated)


def _parse_rref(text: str, question: str, literals: list[_Literal]) -> ParsedQuestion:
    lit = _one(literals, 2, "A")
    a = _to_matrix(lit, "A")
    blocks = [x for x in literals if _is_block(x)]
    if len(blocks) > 1:
        raise ValueError(f"found {len(blocks)} block matrices: {[x.text for x in blocks]}")
    block = _parse_block(blocks[0], lit.name or "A") if blocks else None
    stated = re.search(r"\b(\d+)\s*(?:by|x)\s*(\d+)\s+block\s+matrix\b", text, re.IGNORECASE)
    if block is not None and stated is not None:
        shape = (len(block) * len(a), len(block[0]) * len(a[0]))
        if (int(stated.group(1)), int(stated.group(2))) != shape:
            raise ValueError(
                f"the question calls the block matrix {stated.group(1)} by {stated.group(2)}, but "
                f"{blocks[0].text} with A {len(a)} by {len(a[0])} is {shape[0]} by {shape[1]}"
            )
    return ParsedQuestion("rref", question, A=a, block=block)


def _parse_column_space(text: str, question: str, literals: list[_Literal]) -> ParsedQuestion:
    vectors = [lit for lit in literals if lit.depth == 1 and _is_numeric(lit)]
    described = _DESCRIBE_COLUMN_SPACE.search(" ".join(text.lower().split()))
    if not vectors and described:
        raise ValueError(
            f"the question asks to describe the column space ({described.group(0)!r}), which "
            "no kind answers: the column_space kind decides whether a given vector b is in C(A) "
            "of a given matrix A (and finds x with Ax = b)"
        )
    a = _to_matrix(_one(literals, 2, "A"), "A")
    b = _to_vector(_one(literals, 1, "b"), "b")
    if len(b) != len(a):
        raise ValueError(f"b has {len(b)} entries but A has {len(a)} rows")
    return ParsedQuestion("column_space", question, A=a, b=b)


def _parse(question: str) -> ParsedQuestion:
    text = _normalize(question)
    kind = _detect_kind(text)
    literals = _scan_literals(text)
    if kind == "solvability":
        return _parse_solvability(text, question)
    if kind == "column_space":
        return _parse_column_space(text, question, literals)
    if kind == "nullspace":
        return ParsedQuestion(kind, question, A=_to_matrix(_one(literals, 2, "A"), "A"))
    if kind == "rref":
        return _parse_rref(text, question, literals)
    if kind == "elimination":
        return _parse_elimination(text, question, literals)
    return _parse_complete_solution(text, question, literals)


def _check_text(text: object, caller: str) -> None:
    """A question is a str of at most ``_MAX_QUESTION_CHARS`` characters."""
    if not isinstance(text, str):
        raise TypeError(f"{caller}: `text` must be a str; got {type(text).__name__}")
    if len(text) > _MAX_QUESTION_CHARS:
        raise ValueError(
            f"could not parse the question: it has {len(text)} characters, more than the "
            f"{_MAX_QUESTION_CHARS} allowed"
        )


def parse_question(text: str) -> ParsedQuestion:
    """The kind and the matrices, vectors and numbers of a question, exactly.

    Reads every phrasing of :data:`TEMPLATES` and questions as people write them: matrices
    named or not (``A = [[..]]``, ``A is the matrix [[..]]``, ``the matrix [[..]]``), entries as
    integers, ``p/q`` or decimals, sizes as ``3 by 5`` or ``3x5``; LaTeX (``$...$``,
    ``\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}`` with or without commas, pmatrix,
    array, ``\\frac{1}{2}``, ``\\text{rref}(B)``, ``c_1``, ``c_{1}``), transposed vectors
    ``[1, 2, 0]^T`` (a matrix's ``^T`` transposes it), block matrices written in LaTeX, row
    operations in words ("subtracted 2 times row 1 from row 3, then 4 times row 2 from row
    3", "added 2 times row 1 to row 3", "exchanged rows 2 and 3", "multiplied row 2 by 3",
    "divided row 2 by 4"), and:

    * a multiple choice on solutions such as "Ax = b (always / never) has (exactly one
      solution / infinitely many solutions)": a ``solvability`` question whose
      ``choices`` are the option groups (:func:`choice_answers` gives the chosen words);
    * elimination steps with a stated complete solution instead of R and d: an
      ``elimination`` question whose R and d are derived from it (R = rref(A), d = R x_p; A
      has as many rows as the text says, else as the steps name, at least the rank).

    Malformed text, and a question no kind answers (an explanation in words, a description of
    the column space, a complete solution with a question about something else), raise
    ``ValueError`` saying why (never another exception type).

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
    _check_text(text, "parse_question")
    try:
        return _parse(text.strip())
    except ValueError as e:
        raise ValueError(f"could not parse the question: {e}") from None
    except (ArithmeticError, IndexError, KeyError, TypeError) as e:  # a parser bug: still clear
        raise ValueError(f"could not parse the question ({type(e).__name__}: {e})") from None


def choice_answers(parsed: ParsedQuestion) -> tuple[str, ...]:
    """The chosen words of a multiple-choice question (``parsed.choices``): every combination
    of one option per group that is true, each written ``"<option>; <option>"`` in the
    question's order and words (usually one; empty when none is true). The ``solvability``
    kind decides each: an offered solution property holds with the frequency :func:`solve`
    gives it.

    Example:

    >>> parsed = parse_question("Let A be 2 by 4 of rank 2. Then Ax = b has (exactly one "
    ...                         "solution / infinitely many solutions) (always / never).")
    >>> parsed.kind, parsed.solutions, choice_answers(parsed)
    ('solvability', None, ('exactly one solution; never', 'infinitely many solutions; always'))
    """
    if not isinstance(parsed, ParsedQuestion):
        raise TypeError(
            f"choice_answers: `parsed` must be a ParsedQuestion; got {type(parsed).__name__}"
        )
    if parsed.kind != "solvability" or len(parsed.choices) != 2:
        raise ValueError(
            "choice_answers: `parsed` must be a multiple-choice solvability question (two groups "
            f"of choices); got a {parsed.kind} question with {len(parsed.choices)} groups"
        )
    frequencies_first = _frequency(parsed.choices[0][0]) is not None
    frequencies, properties = parsed.choices if frequencies_first else parsed.choices[::-1]
    chosen = []
    for option in properties:
        single = dataclasses.replace(parsed, solutions=_property(option), choices=())
        how_often = solve(single).answer
        for frequency in frequencies:
            if _frequency(frequency) == how_often:
                pair = (frequency, option) if frequencies_first else (option, frequency)
                chosen.append("; ".join(pair))
    return tuple(chosen)


_ASKS_NULLSPACE = re.compile(r"\bnull ?space\b|\bn\(a\)")
_ASKS_COLUMN_SPACE = re.compile(r"\bcolumn space\b|\bc\(a\)")


def parse_descriptive(text: str) -> ParsedQuestion:
    """A question answered in words (:data:`~sparse_jax.data.linalg_cot.DESCRIPTIVE_KINDS`),
    which :func:`parse_question` refuses: ``column_space_basis`` (describe the column space
    of a given matrix A: ``A``) or ``subspaces`` (describe the column space and the nullspace
    of an m by n matrix of rank r: ``rows``, ``cols``, ``rank``). Read in the same notations
    as :func:`parse_question`. An explanation in words (how the solutions of Ax = b decide
    whether b is in C(A)) has no graded parts that depend on the question: it raises
    ``ValueError`` saying so, as does any other question.

    Example:

    >>> p = parse_descriptive("A is a 3 by 5 matrix of rank 3. What is its column space?")
    >>> p.kind, p.rows, p.cols, p.rank
    ('subspaces', 3, 5, 3)
    >>> parse_descriptive("Describe the column space of A = [[1, 2], [2, 4]].").kind
    'column_space_basis'
    """
    _check_text(text, "parse_descriptive")
    question = text.strip()
    try:
        normalized = _normalize(question)
        t = " ".join(normalized.lower().split())
        if _EXPLAIN.search(t):
            raise ValueError(
                f"the question asks for an explanation in words ({_EXPLAIN.search(t).group(0)!r}"
                " ...): its answer (b is in C(A) exactly when Ax = b has a solution, whose x "
                "combines the columns into b) is the same sentence for every A and b, with no "
                "part to compute or grade; the column_space kind decides a given b"
            )
        if not (_ASKS_COLUMN_SPACE.search(t) or _ASKS_NULLSPACE.search(t)):
            raise ValueError("the question asks about neither the column space nor the nullspace")
        literals = _scan_literals(normalized)
        if any(lit.depth == 1 and _is_numeric(lit) for lit in literals):
            raise ValueError("the question gives a vector: parse_question reads it")
        matrices = [lit for lit in literals if lit.depth == 2 and _is_numeric(lit)]
        if matrices:
            if not _DESCRIBE_COLUMN_SPACE.search(t) and "column space" not in t:
                raise ValueError("the question does not ask to describe the column space")
            a = _to_matrix(_one(literals, 2, "A"), "A")
            return ParsedQuestion("column_space_basis", question, A=a)
        shape, rank = _parse_shape(normalized), _RANK.search(normalized)
        if shape is None or rank is None:
            raise ValueError(
                "could not find a matrix A, nor the size and rank of A (write e.g. 'a 3 by 5 "
                "matrix of rank 3')"
            )
        m, n = (
            _positive(v, f"the {w} of A") for v, w in zip(shape, ("rows", "columns"), strict=True)
        )
        r = int(rank.group(1) or rank.group(2))
        if r > min(m, n):
            raise ValueError(f"the rank {r} of a {m} by {n} matrix must be at most {min(m, n)}")
        return ParsedQuestion("subspaces", question, rows=m, cols=n, rank=r)
    except ValueError as e:
        raise ValueError(f"could not parse the question: {e}") from None
