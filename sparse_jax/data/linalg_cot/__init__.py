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

**The exam's forms** (opt-in, :attr:`GeneratorConfig.exam_rate` and
:attr:`GeneratorConfig.latex_rate`; :meth:`GeneratorConfig.exam` sets the exam's sizes):
elimination steps in words ("subtracted 3 times row 1 from row 2"), R and d given by a complete
solution (the chain derives them first), block matrices with their size stated, multiple
choices on m by n matrices (the answer is the chosen words, ``always; infinitely many
solutions``), LaTeX notation (:mod:`~sparse_jax.data.linalg_cot.exam`). Questions answered in
words, :data:`DESCRIPTIVE_KINDS` (not in :data:`KINDS`; generated when ``kinds`` names them,
read by :func:`parse_descriptive`): ``column_space_basis`` (``rank 2; C(A) is a plane in R^3;
basis [1, 3, 0], [2, 8, 4]``, the basis being the pivot columns of A) and ``subspaces``
(``C(A) is all of R^3; N(A) is a plane in R^5``); :func:`grade_parts` grades each part (rank,
dimensions, spaces, a basis up to its span).

**Parsing.** :func:`parse_question` reads a question in any of the phrasings, and reasonable
user phrasings (LaTeX matrices, ``^T`` vectors, row operations in words, multiple choice), into a
:class:`ParsedQuestion`; malformed text raises ``ValueError`` naming what could not be read, and
:func:`choice_answers` gives the chosen words of a multiple-choice question. :func:`solve` is
the symbolic solver that makes the data and the reference answers; it is never the model's
answer.

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

**Modules** (each imports only modules listed before it): :mod:`~sparse_jax.data.linalg_cot.algebra`
(exact numbers and matrices, row operations, Gauss-Jordan elimination),
:mod:`~sparse_jax.data.linalg_cot.problems` (the kinds, :class:`Problem`,
:class:`ParsedQuestion`), :mod:`~sparse_jax.data.linalg_cot.grading` (step types, divergence,
byte roles, the grade), :mod:`~sparse_jax.data.linalg_cot.solver` (:func:`solve`),
:mod:`~sparse_jax.data.linalg_cot.parsing` (:func:`parse_question`),
:mod:`~sparse_jax.data.linalg_cot.exam` (the exam's phrasings, row operations in words, LaTeX),
:mod:`~sparse_jax.data.linalg_cot.generator` (phrasings, :func:`generate`, :func:`make_splits`)
and :mod:`~sparse_jax.data.linalg_cot.storage` (the TFDS builder, :func:`prepare`).
"""

from __future__ import annotations

from typing import Any

from sparse_jax.data.linalg_cot import storage
from sparse_jax.data.linalg_cot.algebra import (
    RowOp,
    format_matrix,
    format_number,
    format_vector,
    row_arithmetic,
)
from sparse_jax.data.linalg_cot.exam import EXAM_TEMPLATES
from sparse_jax.data.linalg_cot.generator import (
    SPLITS,
    TEMPLATES,
    GeneratorConfig,
    distinct_questions,
    generate,
    make_splits,
)
from sparse_jax.data.linalg_cot.grading import (
    ROLES,
    STEP_TYPES,
    answer_parts,
    first_divergence,
    grade,
    grade_parts,
    solution_roles,
    step_type,
)
from sparse_jax.data.linalg_cot.parsing import choice_answers, parse_descriptive, parse_question
from sparse_jax.data.linalg_cot.problems import (
    ANSWER_PREFIX,
    DESCRIPTIVE_KINDS,
    FREQUENCIES,
    KINDS,
    PROPERTIES,
    ParsedQuestion,
    Problem,
    read_option,
    split_solution,
)
from sparse_jax.data.linalg_cot.solver import solve
from sparse_jax.data.linalg_cot.storage import BUILDER_NAME, LinalgCotData, ProblemSource, prepare

__all__ = [
    "ANSWER_PREFIX",
    "BUILDER_NAME",
    "DESCRIPTIVE_KINDS",
    "EXAM_TEMPLATES",
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
    "SparseJaxLinalgCot",
    "SparseJaxLinalgCotConfig",
    "answer_parts",
    "choice_answers",
    "distinct_questions",
    "first_divergence",
    "format_matrix",
    "format_number",
    "format_vector",
    "generate",
    "grade",
    "grade_parts",
    "make_splits",
    "parse_descriptive",
    "parse_question",
    "prepare",
    "read_option",
    "row_arithmetic",
    "solution_roles",
    "solve",
    "split_solution",
    "step_type",
]


def __getattr__(name: str) -> Any:
    # The TFDS builder classes, defined on first use (importing the package does not import
    # tensorflow_datasets).
    if name in ("SparseJaxLinalgCot", "SparseJaxLinalgCotConfig"):
        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
