"""Questions written as an exam writes them, in this project's words: the phrasings of the
exam's forms (:data:`EXAM_TEMPLATES`), row operations in words (:func:`operations_in_words`),
multiple choices on the solutions of Ax = b (:func:`choice_text`) and LaTeX notation
(:func:`latex_question`). The generator uses them when :attr:`GeneratorConfig.exam_rate` or
:attr:`GeneratorConfig.latex_rate` asks; :func:`parse_question` reads everything they write.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

from sparse_jax.data.linalg_cot.algebra import RowOp, format_number
from sparse_jax.data.linalg_cot.problems import PROPERTIES

__all__ = [
    "EXAM_TEMPLATES",
    "choice_text",
    "latex_question",
    "operations_in_words",
]

# Fields as in TEMPLATES, and {steps} (row operations in words), {shape} (a block matrix's
# size, "6 by 8"), {choices} (the option groups of a multiple choice, with the verb "has").
EXAM_TEMPLATES: Mapping[str, tuple[str, ...]] = {
    "complete_solution": (
        "Elimination turns Ax = b into Rx = d, and the complete solution is x = {x}. Find the "
        "{m} by {n} reduced row echelon matrix R and the vector d.",
        "After row reduction Ax = b reads Rx = d, with complete solution x = {x}. What are the "
        "{m} by {n} matrix R and the right side d?",
    ),
    "nullspace": (
        "Suppose A = {A}. Find every special solution of Ax = 0 and describe the whole nullspace "
        "of A in words.",
        "Take the matrix A = {A}. List all special solutions to Ax = 0 and say in words what "
        "the nullspace N(A) is.",
    ),
    "column_space": (
        "Suppose that A = {A}. Is the vector b = {b} in the column space of A?",
        "A is the matrix {A}. Does the vector b = {b} lie in the column space of A? If so, "
        "give x with Ax = b.",
    ),
    "elimination": (
        "Elimination took A to R = {R} and b to d = {d}: it {steps}. Which matrix E^-1 gives "
        "A = E^-1 R, and what are A and b?",
        "To reach R = {R} and d = {d}, elimination {steps}. Find the matrix that connects R and "
        "d to A and b, then A and b themselves.",
        "Every solution of Ax = b is x = {x}. On the way to Rx = d, elimination {steps}. Find "
        "E^-1 (so that A = E^-1 R), A and b.",
        "Ax = b reduces to Rx = d, and its complete solution is x = {x}. If elimination {steps}, "
        "which matrix takes R and d back to A and b? Use it to find A and b.",
        "A is {m} by {n} and the complete solution of Ax = b is x = {x}. Elimination {steps}. "
        "Recover E^-1, A and b.",
    ),
    "rref": (
        "Let A = {A}. B is the {shape} block matrix {block}. Find rref(B).",
        "With A = {A}, what is the reduced row echelon form of the {shape} block matrix "
        "B = {block}?",
        "Take A = {A} and build the {shape} matrix B = {block} from it. Reduce B to reduced row "
        "echelon form.",
    ),
    "solvability": (
        "A {m}x{n} matrix A has rank r = {r}. Then Ax = b {choices}. Pick the true options.",
        "Suppose A is {m} by {n} with rank {r}. Choose the right words: the system Ax = b "
        "{choices}.",
        "For a {m}x{n} matrix of rank r = {r}, which options are true? Ax = b {choices}.",
    ),
}

# How a multiple choice may word each frequency and each property of the solutions.
_FREQUENCY_WORDS = {
    "always": ("always",),
    "sometimes but not always": ("sometimes but not always", "sometimes"),
    "never": ("never",),
}
_PROPERTY_WORDS = {
    "unique": ("exactly one solution", "a unique solution"),
    "many": ("infinitely many solutions", "many solutions"),
    "none": ("no solution",),
}


def _factor_words(k: Fraction) -> str:
    return "twice" if k == 2 else f"{format_number(k)} times"


def operations_in_words(ops: Sequence[RowOp], rng: random.Random) -> str:
    """Row operations as a sentence after "elimination" ("subtracted 3 times row 1 from row 2,
    then 5 times row 1 from row 3"), in order, with varied words; the parser reads each back
    as the same :class:`RowOp`.

    Example:

    >>> ops = [RowOp("add", 1, 0, Fraction(-3)), RowOp("add", 2, 0, Fraction(-5))]
    >>> operations_in_words(ops, random.Random(1))
    'subtracted 3 times row 1 from row 2, then 5 times row 1 from row 3'
    """
    parts, last_verb = [], None
    for op in ops:
        i, j = op.source + 1, op.target + 1
        if op.kind == "swap":
            verb, text = "swap", f"exchanged rows {j} and {i}"
        elif op.kind == "scale":
            verb, k = "scale", op.factor
            if k.numerator == 1 and k.denominator > 1:
                text = f"divided row {j} by {k.denominator}"
            else:
                text = f"multiplied row {j} by {format_number(k)}"
        else:
            verb = "subtract" if op.factor < 0 else "add"
            k = abs(op.factor)
            amount = "" if k == 1 else _factor_words(k) + " "
            where = f"row {i} from row {j}" if verb == "subtract" else f"row {i} to row {j}"
            # The verb may be left out when it repeats the one before ("then 5 times row 1 ...").
            if verb == last_verb and amount and rng.random() < 0.6:
                text = f"{amount}{where}"
            else:
                text = f"{'subtracted' if verb == 'subtract' else 'added'} {amount}{where}"
        parts.append(text)
        last_verb = verb
    if len(parts) == 1:
        return parts[0]
    joins = [rng.choice((", then ", " and then ", "; then ")) for _ in parts[1:]]
    return parts[0] + "".join(join + part for join, part in zip(joins, parts[1:], strict=True))


def choice_text(
    frequencies: Sequence[str], properties: Sequence[str], rng: random.Random
) -> tuple[str, tuple[tuple[str, ...], ...]]:
    """A multiple choice offering ``frequencies`` (of FREQUENCIES) and ``properties`` (keys of
    PROPERTIES) in varied words: the text (``"(always / never) has (exactly one solution / no
    solution)"``, or the properties first) and the option groups as the parser reads them.

    Example:

    >>> choice_text(["always", "never"], ["unique", "none"], random.Random(1))[0]
    '(always / never) has (a unique solution / no solution)'
    """
    freq = tuple(rng.choice(_FREQUENCY_WORDS[f]) for f in frequencies)
    props = tuple(rng.choice(_PROPERTY_WORDS[p]) for p in properties)
    freq_text, prop_text = (f"({' / '.join(group)})" for group in (freq, props))
    if rng.random() < 0.75:
        return f"{freq_text} has {prop_text}", (freq, props)
    return f"has {prop_text} {freq_text}", (props, freq)


assert set(_PROPERTY_WORDS) == set(PROPERTIES)


# -------------------------------------------------------------------------------------------
# LaTeX.

_LITERAL_START = re.compile(r"\[")
_NAME = re.compile(r"([A-Za-z]\w*) = $")


def _closing(text: str, i: int) -> int:
    """The index after the bracket literal opening at ``text[i]``."""
    depth = 0
    for k in range(i, len(text)):
        depth += {"[": 1, "]": -1}.get(text[k], 0)
        if depth == 0:
            return k + 1
    raise ValueError(f"latex_question: unbalanced brackets in {text!r:.80}")


def _latex_entry(atom: str) -> str:
    atom = atom.strip()
    match = re.fullmatch(r"(-?)(\d+)/(\d+)", atom)
    return f"{match.group(1)}\\frac{{{match.group(2)}}}{{{match.group(3)}}}" if match else atom


def _latex_literal(literal: str, commas: bool, column: bool) -> str:
    inner = literal[1:-1].strip()
    if inner.startswith("["):  # a matrix (or a block pattern)
        rows = [r.strip().strip("[]") for r in re.split(r"\]\s*,\s*\[", inner)]
        sep = ", & " if commas else " & "
        cells = [sep.join(_latex_entry(x) for x in row.split(",")) for row in rows]
        return (
            "\\begin{bmatrix} "
            + (", \\\\ " if commas else " \\\\ ").join(cells)
            + (" \\end{bmatrix}")
        )
    entries = [_latex_entry(x) for x in inner.split(",")]
    if column:
        return "\\begin{bmatrix} " + " \\\\ ".join(entries) + " \\end{bmatrix}"
    return "[" + ", ".join(entries) + "]^T"


def latex_question(text: str, rng: random.Random) -> str:
    """``text`` with its matrices written as LaTeX ``bmatrix`` (with or without commas, one
    choice per question), its vectors as ``[..]^T`` or one-column matrices, ``p/q`` as
    ``\\frac{p}{q}``, ``c1 * `` as ``c_1 ``, named literals and ``Ax = b`` inside ``$...$``.
    :func:`parse_question` reads it as ``text``.

    Example:

    >>> print(latex_question("Is b = [1, 2] in C(A) for A = [[1, 0], [0, 2]]?", random.Random(0)))
    Is $b = [1, 2]^T$ in C(A) for $A = \\begin{bmatrix} 1 & 0 \\\\ 0 & 2 \\end{bmatrix}$?
    """
    commas = rng.random() < 0.5
    out, i = [], 0
    for match in _LITERAL_START.finditer(text):
        if match.start() < i:
            continue  # inside the literal just written
        end = _closing(text, match.start())
        literal = text[match.start() : end]
        before = text[i : match.start()]
        name = _NAME.search(before)
        one_column = re.fullmatch(r"\[(\[[^\[\],]*\],?\s*)+\]", literal) is not None
        if one_column and (name is None or not name.group(1)[0].isupper()):
            # LaTeX reads a one-column matrix without a capital name as a vector: kept as is.
            out.append(before + literal)
            i = end
            continue
        latex = _latex_literal(literal, commas, rng.random() < 0.3)
        if name is not None:
            before = before[: name.start()] + "$" + name.group(0)
            latex += "$"
        out.append(before + latex)
        i = end
    written = "".join(out) + text[i:]
    written = re.sub(
        r"\bc(\d+) \* ", lambda m: f"c_{m.group(1)} " if commas else f"c_{m.group(1)} * ", written
    )
    return re.sub(r"(?<![$\w])([AR]x = [bd0])\b", r"$\1$", written)
