"""Reading a worked solution against the reference: what each step does (:func:`step_type`),
where a chain first leaves the reference (:func:`first_divergence`), what each byte writes
(:func:`solution_roles`) and the exact grade of a final answer (:func:`grade`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sparse_jax.data.linalg_cot.problems import ALREADY_REDUCED, ANSWER_PREFIX

__all__ = [
    "ROLES",
    "STEP_TYPES",
    "first_divergence",
    "grade",
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
    state or deduction after it: split at its last `` -> ``, else at its first ``: ``
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
