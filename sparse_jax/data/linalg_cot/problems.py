"""What a problem of the task is: its kinds, a :class:`Problem` (question, worked steps,
canonical answer) and its text, and a :class:`ParsedQuestion` (what a question asks, as exact
values), with the fixed words the solutions write.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from sparse_jax.data.linalg_cot.algebra import (
    Matrix,
    RowOp,
    Vector,
    format_matrix,
    format_number,
    format_vector,
)

__all__ = [
    "ANSWER_PREFIX",
    "DESCRIPTIVE_KINDS",
    "FREQUENCIES",
    "KINDS",
    "PROPERTIES",
    "ParsedQuestion",
    "Problem",
    "read_option",
    "split_solution",
]

KINDS = ("complete_solution", "elimination", "nullspace", "rref", "solvability", "column_space")
# Questions answered in words whose parts can be graded (grading.answer_parts): the column space
# of a given matrix (its rank, the space it lies in, a basis: the pivot columns), and the column
# space and nullspace of an m by n matrix of rank r (each one's dimension and space). Not in
# KINDS: GeneratorConfig and parse_descriptive take them on request.
DESCRIPTIVE_KINDS = ("column_space_basis", "subspaces")
# Properties of the solutions of Ax = b asked about by `solvability` questions, with their words.
PROPERTIES = {
    "unique": "exactly one solution",
    "many": "infinitely many solutions",
    "none": "no solution",
}
FREQUENCIES = ("always", "sometimes but not always", "never")
ANSWER_PREFIX = "Answer: "
ALREADY_REDUCED = "the matrix is already in reduced row echelon form"


# The words a multiple choice on the solutions of Ax = b may offer (read_option).
_OPTION_FREQUENCIES = {"always": "always", "sometimes": "sometimes but not always"}
_OPTION_FREQUENCIES |= {f: f for f in FREQUENCIES}
_OPTION_PROPERTIES = {
    "unique": re.compile(r"\b(?:exactly one|a unique|unique|one and only one) solutions?\b"),
    "many": re.compile(r"\b(?:infinitely many|many|more than one) solutions\b"),
    "none": re.compile(r"\bno solutions?\b"),
}


def read_option(option: str) -> tuple[str, str] | None:
    """What one option of a multiple choice on the solutions of Ax = b names:
    ``("frequency", <one of FREQUENCIES>)``, ``("property", <a key of PROPERTIES>)``, or None.

    Example:

    >>> read_option("Sometimes"), read_option("a unique solution"), read_option("maybe")
    (('frequency', 'sometimes but not always'), ('property', 'unique'), None)
    """
    if not isinstance(option, str):
        raise TypeError(f"read_option: `option` must be a str; got {type(option).__name__}")
    words = " ".join(option.lower().split())
    if words in _OPTION_FREQUENCIES:
        return "frequency", _OPTION_FREQUENCIES[words]
    found = [key for key, pattern in _OPTION_PROPERTIES.items() if pattern.search(words)]
    return ("property", found[0]) if len(found) == 1 else None


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


@dataclass(frozen=True)
class ParsedQuestion:
    """What a question asks, as exact values; :func:`parse_question` makes it, :func:`solve`
    answers it. Each kind uses some of the fields (the others keep their defaults):

    * ``complete_solution``: ``x_p``, ``special`` (s1, s2, ...), ``rows`` (m, the rows of A);
    * ``elimination``: ``R``, ``d``, ``operations`` (the elimination steps, in order), and
      ``x_p``, ``special``, ``rows`` when R and d come from a complete solution the question
      states (its chain derives them first);
    * ``nullspace``: ``A``;
    * ``rref``: ``A`` and, for a block matrix, ``block`` (the multiple of A in each block,
      e.g. ``((1, 1), (1, 1))`` for ``[[A, A], [A, A]]``; 0 is a zero block);
    * ``solvability``: ``rows``, ``cols``, ``rank``, ``solutions`` (what is asked of the
      solutions of Ax = b: a key of ``PROPERTIES``), or, for a multiple choice, ``choices``
      instead of ``solutions`` (the option groups as the question writes them, e.g.
      ``(("always", "never"), ("exactly one solution", "no solution"))``;
      :func:`~sparse_jax.data.linalg_cot.parsing.choice_answers` gives the chosen words);
    * ``column_space``: ``A``, ``b``;
    * ``column_space_basis`` (:data:`DESCRIPTIVE_KINDS`): ``A``; ``subspaces``: ``rows``,
      ``cols``, ``rank``.

    Example:

    >>> from sparse_jax.data.linalg_cot import format_matrix, parse_question
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
    choices: tuple[tuple[str, ...], ...] = ()

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

    @property
    def contents(self) -> frozenset[str]:
        """What a question shares with another that asks about the same things, whatever it
        asks of them: its :attr:`key`, the matrix A it gives, its complete solution (x_p and
        s1, s2, ...), and its m, n and rank (make_splits' ``exclude`` compares them).

        Example:

        >>> a = ParsedQuestion("nullspace", "q", A=((Fraction(1), Fraction(2)),))
        >>> b = ParsedQuestion("rref", "another q", A=a.A)
        >>> sorted(a.contents & b.contents)
        ['A = [[1, 2]]']
        """
        out = {self.key}
        if self.A is not None:
            out.add(f"A = {format_matrix(self.A)}")
        if self.x_p is not None:
            vectors = [self.x_p, *self.special]
            out.add("x = " + " + ".join(format_vector(v) for v in vectors))
        if None not in (self.rows, self.cols, self.rank):
            out.add(f"m, n, r = {self.rows}, {self.cols}, {self.rank}")
        return frozenset(out)
