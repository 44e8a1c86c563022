"""Reading a worked solution against the reference: what each step does (:func:`step_type`),
where a chain first leaves the reference (:func:`first_divergence`), what each byte writes
(:func:`solution_roles`) and the exact grade of a final answer (:func:`grade`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from sparse_jax.data.linalg_cot.algebra import row_reduce
from sparse_jax.data.linalg_cot.problems import ALREADY_REDUCED, ANSWER_PREFIX

__all__ = [
    "ROLES",
    "STEP_TYPES",
    "answer_parts",
    "first_divergence",
    "grade",
    "grade_parts",
    "solution_roles",
    "step_type",
]


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
        ("already reduced", re.escape(ALREADY_REDUCED)),
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


def step_parts(step: str) -> tuple[str, str, str]:
    """A step's operation, its arithmetic (``""`` unless a row operation writes it) and the
    state or deduction after it: split at its last ``->``, else at its first colon
    (``r = 1 < n = 8: 7 free variables, ...``), else all result.

    Example:

    >>> step_parts("R2 = R2 - 2*R1: [5-2*2=1] -> [[1, 2], [0, 1]]")
    ('R2 = R2 - 2*R1', '[5-2*2=1]', '[[1, 2], [0, 1]]')
    >>> step_parts("r = 1 < n = 8: 7 free variables")
    ('r = 1 < n = 8', '', '7 free variables')
    """
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
    after ``->`` or a colon), ``"<step type>: missing"`` when the chain stops before the
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
        my_parts, their_parts = step_parts(mine), step_parts(theirs)
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
      before its ``->`` or, without one, its first colon (:func:`first_divergence`'s
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
    is not ``yes``, and a prediction that runs on past the reference, a bracket or a clause
    more, is wrong): the answers are canonical so that exact match is the grade.

    Example:

    >>> grade("Answer: [[1, 0],[0, 1]]", "[[1, 0], [0, 1]]"), grade("[2/4]", "[1/2]")
    (True, False)
    >>> grade("[[1, 0], [0, 1]]]", "[[1, 0], [0, 1]]"), grade("never; x = [1]", "never")
    (False, False)
    """
    for name, value in (
        ("predicted_answer", predicted_answer),
        ("reference_answer", reference_answer),
    ):
        if not isinstance(value, str):
            raise TypeError(f"grade: `{name}` must be a str; got {type(value).__name__}")
    return _canonical_answer(predicted_answer) == _canonical_answer(reference_answer)


# -------------------------------------------------------------------------------------------
# The parts of an answer in words (DESCRIPTIVE_KINDS).

_SUBSPACE = re.compile(
    r"(?P<name>C\(A\)|N\(A\)) is (?:(?P<zero>only the zero vector in)|(?P<all>all of)"
    r"|(?P<line>a line in)|(?P<plane>a plane in)|a (?P<k>\d+)-dimensional subspace of) "
    r"R\^(?P<n>\d+)"
)
_RANK_PART = re.compile(r"(?:^|;)\s*rank (\d+)\s*(?:;|$)")
_BASIS_PART = re.compile(r"(?:^|;)\s*basis (.*?)\s*(?:;|$)")
_VECTOR = re.compile(r"\[([^\[\]]*)\]")


def answer_parts(answer: str) -> dict[str, str]:
    """The parts of an answer in words that :func:`grade_parts` grades, each as written: the
    ``rank``; for each subspace named (``C(A)``, ``N(A)``) its dimension and the space it lies
    in (``C(A) dimension``, ``C(A) space``: ``a plane in R^3`` gives ``2`` and ``R^3``); the
    ``basis`` (the vectors after ``basis``, or ``none``). A part the answer does not write is
    left out.

    Example:

    >>> answer_parts("rank 2; C(A) is a plane in R^3; basis [1, 3, 0], [2, 8, 4]")
    {'rank': '2', 'C(A) dimension': '2', 'C(A) space': 'R^3', 'basis': '[1, 3, 0], [2, 8, 4]'}
    >>> answer_parts("C(A) is all of R^3; N(A) is a 2-dimensional subspace of R^5")
    {'C(A) dimension': '3', 'C(A) space': 'R^3', 'N(A) dimension': '2', 'N(A) space': 'R^5'}
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer_parts: `answer` must be a str; got {type(answer).__name__}")
    text = " ".join(answer.split())
    if text.startswith(ANSWER_PREFIX.strip()):
        text = text[len(ANSWER_PREFIX.strip()) :].strip()
    parts: dict[str, str] = {}
    rank = _RANK_PART.search(text)
    if rank:
        parts["rank"] = rank.group(1)
    for match in _SUBSPACE.finditer(text):
        name, n = match.group("name"), match.group("n")
        if match.group("zero"):
            dimension = "0"
        elif match.group("all"):
            dimension = n
        elif match.group("line"):
            dimension = "1"
        elif match.group("plane"):
            dimension = "2"
        else:
            dimension = match.group("k")
        parts.setdefault(f"{name} dimension", dimension)
        parts.setdefault(f"{name} space", f"R^{n}")
    basis = _BASIS_PART.search(text)
    if basis:
        parts["basis"] = basis.group(1)
    return parts


def _vectors(text: str) -> list[tuple[Fraction, ...]] | None:
    """The vectors ``[..], [..]`` of a written basis (``[]`` for ``none``; None: unreadable)."""
    if text.strip() == "none":
        return []
    found = _VECTOR.findall(text)
    if not found or _VECTOR.sub("", text).replace(",", "").strip():
        return None
    try:
        return [tuple(Fraction(x.strip()) for x in v.split(",")) for v in found]
    except (ValueError, ZeroDivisionError):
        return None


def _same_span(predicted: str, reference: str) -> bool:
    """Whether two written bases are bases of the same subspace: as many independent vectors,
    of the same length, spanning together no more than each alone."""
    mine, theirs = _vectors(predicted), _vectors(reference)
    if mine is None or theirs is None or len(mine) != len(theirs):
        return False
    if not theirs:
        return True
    if len({len(v) for v in mine + theirs}) != 1:
        return False
    rank = len(row_reduce(tuple(mine)).pivots)
    return rank == len(mine) == len(row_reduce(tuple(mine + theirs)).pivots)


def grade_parts(predicted_answer: str, reference_answer: str) -> dict[str, bool]:
    """Each part of the reference answer in words (:func:`answer_parts`) graded against the
    prediction's: numbers and spaces exactly; the basis right when it spans the same subspace
    with as many independent vectors (any basis, not only the pivot columns). A part the
    prediction does not write is wrong.

    Example:

    >>> ref = "rank 2; C(A) is a plane in R^3; basis [1, 3, 0], [2, 8, 4]"
    >>> grade_parts("rank 2; C(A) is a line in R^3; basis [1, 3, 0], [3, 11, 4]", ref)
    {'rank': True, 'C(A) dimension': False, 'C(A) space': True, 'basis': True}
    """
    for name, value in (
        ("predicted_answer", predicted_answer),
        ("reference_answer", reference_answer),
    ):
        if not isinstance(value, str):
            raise TypeError(f"grade_parts: `{name}` must be a str; got {type(value).__name__}")
    reference = answer_parts(reference_answer)
    if not reference:
        raise ValueError(
            "grade_parts: `reference_answer` has no parts (rank, C(A) / N(A) is ..., basis); "
            f"got {reference_answer!r:.120}"
        )
    predicted = answer_parts(predicted_answer)
    out = {}
    for part, value in reference.items():
        if part not in predicted:
            out[part] = False
        elif part == "basis":
            out[part] = _same_span(predicted[part], value)
        else:
            out[part] = predicted[part] == value
    return out
