"""The chain-of-thought model as an API: ``Solver.load(run).answer(question)``.

The linear-algebra task (:mod:`sparse_jax.data.linalg_cot`) for the encoder–decoder
(:mod:`sparse_jax.models.encdec`) as tokens: the question's tokens are the encoder's input
(``source [B, S]``, padded with :data:`PAD_ID`, with ``source_lengths [B]``), and the worked
solution (:meth:`~sparse_jax.data.linalg_cot.Problem.solution_text`: the steps, then
``Answer: ...``) is the decoder's, between :data:`BOS_ID` and :data:`EOS_ID` (the byte
tokenizer's end-of-text id). A token is a UTF-8 byte, or with :attr:`CotFormat.numbers` a
whole number. :class:`CotFormat` fixes that and ``S`` and ``T`` (the longest question and
solution, plus the EOS, that a model reads and writes); nothing is cut to fit it: a problem
that does not fit is refused by :func:`pack` and by the :class:`Solver`.

* :func:`pack` writes problems as rows ``[S + T + 1]`` (question, then ``BOS, solution, EOS``,
  padded): one int array per batch for :class:`sparse_jax.training.loop.Trainer`;
  :func:`split_rows` takes a batch of rows apart again (pure, jittable) and :func:`loss_fn` is
  the trainer's loss (:func:`~sparse_jax.models.encdec.sequence_loss`).
* :class:`GreedyDecoder` is :func:`~sparse_jax.models.encdec.greedy_decode` (the same steps
  on the model's key/value cache) run ``chunk`` positions at a time, stopping once every row
  has emitted EOS, compiled ahead of time per batch shape: its wall time is the decoding's,
  proportional to the chain of thought it writes, without compilation.
* :class:`Solver` answers questions with a trained model (never the symbolic solver) as
  :class:`Answer`; :meth:`Solver.load` restores one from a run folder that
  ``python -m experiments.cot`` wrote (its :data:`RECORD` file and Orbax checkpoints).
* :func:`evaluate` decodes a split and measures, per kind, exact match of the final answer
  (:func:`~sparse_jax.data.linalg_cot.grade`), the chain of thought's length in steps and
  tokens, decoding seconds per question, attention density and FLOPs.

Example:
  >>> from flax import nnx
  >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
  >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=16, num_heads=2, d_ff=32, cot_steps=0)
  >>> solver = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), CotFormat(96, 64))
  >>> print(solver.answer("What is 2 + 2?").text)  # not a linear-algebra question
  Cannot answer: could not parse the question: could not tell what the question asks: ...
  >>> answer = solver.answer("Find the reduced row echelon form R of A = [[2, 4], [1, 3]].")
  >>> answer.kind, answer.error, 1 <= answer.tokens <= 64  # an untrained model's guess
  ('rref', None, True)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.data import linalg_cot
from sparse_jax.data.tokenizers import ByteTokenizer
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder, sequence_loss
from sparse_jax.training.checkpoint import Checkpointer
from sparse_jax.training.loop import TrainConfig, Trainer
from sparse_jax.validation import check_bool, check_int

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "LITERAL_TOKENS",
    "MAX_NUMBERS",
    "NUMBER_BASE",
    "PAD_ID",
    "RECORD",
    "VOCAB_SIZE",
    "Answer",
    "Batch",
    "CotFormat",
    "GreedyDecoder",
    "Solver",
    "decode_tokens",
    "encode_question",
    "encode_solution",
    "evaluate",
    "fit_format",
    "length_buckets",
    "loss_fn",
    "most_frequent_answers",
    "number_token",
    "pack",
    "read_record",
    "reference_accuracy",
    "source_lengths",
    "split_rows",
    "write_record",
]

EOS_ID = ByteTokenizer.eos_id  # 256: ends a solution (the byte tokenizer's end of text)
BOS_ID = 257  # the decoder's first input
PAD_ID = 258  # fills rows after a question or a solution
VOCAB_SIZE = 259  # bytes 0..255 and the three above (EncDecConfig's default 260 holds them)
# With CotFormat.numbers, the integer n is the one token number_token(n), from NUMBER_BASE on.
NUMBER_BASE = VOCAB_SIZE
MAX_NUMBERS = 100_000  # the largest CotFormat.numbers
# A decimal number, with its minus sign unless that follows what a subtraction follows (a
# digit, a letter or a closing bracket: "3-2" and "R2-1" subtract, "[-1" and "=-5" do not).
_NUMBER = re.compile(rb"(?:(?<![0-9A-Za-z)\]])-)?[0-9]+")
RECORD = "cot.json"  # the run folder's file that Solver.load reads (format, model configs)
# The ids of "[", "]" and "," (bytes): EncDecConfig.literal_tokens for matrices and vectors.
LITERAL_TOKENS = tuple(b"[],")


@dataclasses.dataclass(frozen=True)
class CotFormat:
    """How the token rows are written: how long they are, what a model reads and writes at
    most, and whether a number is one token.

    With ``numbers = N > 0`` every integer ``-N < n < N`` written in decimal (digits without a
    leading zero, after a minus sign unless the minus subtracts: ``7``, ``-12``, the ``1`` of
    ``R1``; the ``-`` of ``3-2`` or ``R2-1`` stays a byte) is one token instead of its bytes,
    so that a model writes a computed entry in one choice (:func:`number_token`). Larger
    numbers, and digits with a leading zero, stay bytes; a fraction ``p/q`` is two numbers and
    its ``/``. ``N = 0`` (the default): every byte a token.

    Example:
      >>> CotFormat(source_len=152, target_len=272).row_len  # S + T + 1
      425
      >>> fmt = CotFormat(numbers=100)
      >>> fmt.vocab_size, fmt.encode("-12/7").tolist()  # -12, "/", 7
      (458, [282, 47, 273])
      >>> fmt.encode("3-2").tolist()  # 3, "-", 2: a subtraction
      [265, 45, 263]
    """

    source_len: int = 192  # S: question tokens the encoder reads at most
    target_len: int = 320  # T: solution tokens plus the EOS the decoder writes at most
    numbers: int = 0  # N: each integer -N < n < N one token (0: every byte a token)

    def __post_init__(self):
        check_int(self.source_len, "source_len", "CotFormat")
        check_int(self.target_len, "target_len", "CotFormat", low=2)
        check_int(self.numbers, "numbers", "CotFormat", low=0, high=MAX_NUMBERS)

    @property
    def row_len(self) -> int:
        """``S + T + 1``: a packed row (question, then BOS, solution and EOS)."""
        return self.source_len + self.target_len + 1

    @property
    def vocab_size(self) -> int:
        """The ids a model of this format reads and writes: bytes, specials and numbers."""
        return VOCAB_SIZE + max(2 * self.numbers - 1, 0)

    def tokens(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [n], starts [n])``: ``text``'s token ids (no specials) and the offset of the
        UTF-8 byte each starts at (a number's first digit; otherwise the byte itself).

        Example:
          >>> ids, starts = CotFormat(numbers=10).tokens("R2 = -1, 15")
          >>> ids.tolist()  # R, 2, " = ", -1, ", ", then 15's digits (15 is not below 10)
          [82, 263, 32, 61, 32, 260, 44, 32, 49, 53]
          >>> starts.tolist()  # -1 starts at its sign
          [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
        """
        if not isinstance(text, str):
            raise TypeError(f"CotFormat.tokens: `text` must be a str; got {type(text).__name__}")
        data = text.encode("utf-8")
        ids = np.frombuffer(data, np.uint8).astype(np.int32)
        starts = np.arange(len(data), dtype=np.int32)
        if not self.numbers:
            return ids, starts
        keep = np.ones(len(data), bool)
        widest = len(str(self.numbers - 1))
        for run in _NUMBER.finditer(data):
            first, signed = run.start(), run.group()[:1] == b"-"
            digits = run.group()[1:] if signed else run.group()
            if len(digits) > widest or (len(digits) > 1 and digits[:1] == b"0"):
                continue  # too long, or a leading zero: bytes
            value = int(digits)
            if value >= self.numbers:
                continue
            if signed and value == 0:  # "-0": the minus a byte, then the number 0
                first += 1
            ids[first] = number_token(-value if signed else value)
            keep[first + 1 : run.end()] = False
        return ids[keep], starts[keep]

    def encode(self, text: str) -> np.ndarray:
        """``text``'s token ids, int32 ``[len]`` (no specials): a question as the encoder
        reads it.

        Example:
          >>> CotFormat().encode("A = [[1]]").tolist()[:3]
          [65, 32, 61]
        """
        return self.tokens(text)[0]


def number_token(n: int) -> int:
    """The token of the integer ``n`` when numbers are tokens (:attr:`CotFormat.numbers`):
    ``NUMBER_BASE + 2n`` for ``n >= 0``, ``NUMBER_BASE - 2n - 1`` for ``n < 0``, so that the
    numbers ``-N < n < N`` fill the ``2N - 1`` ids after the bytes and specials and any
    format's ids decode alike (:func:`decode_tokens`).

    Example:
      >>> [number_token(n) - NUMBER_BASE for n in (0, -1, 1, -2, 2)]
      [0, 1, 2, 3, 4]
    """
    n = int(n)
    return NUMBER_BASE + (2 * n if n >= 0 else -2 * n - 1)


def encode_question(question: str, fmt: CotFormat | None = None) -> np.ndarray:
    """The question's token ids in ``fmt`` (default: ``CotFormat()``, its UTF-8 bytes) as int32
    ``[len]`` (no specials).

    Example:
      >>> encode_question("A = [[1]]").tolist()[:3]
      [65, 32, 61]
    """
    if not isinstance(question, str):
        raise TypeError(f"encode_question: `question` must be a str; got {type(question).__name__}")
    return _format(fmt, "encode_question").encode(question)


def encode_solution(solution: str, fmt: CotFormat | None = None) -> np.ndarray:
    """The solution's token ids in ``fmt`` (default: its bytes) then :data:`EOS_ID`, int32
    ``[len + 1]`` (the decoder's target; its input is ``BOS`` and all but the last).

    Example:
      >>> encode_solution("Answer: no").tolist()[-3:]
      [110, 111, 256]
      >>> encode_solution("x = 12", CotFormat(numbers=16)).tolist()  # 12 is one token
      [120, 32, 61, 32, 283, 256]
    """
    if not isinstance(solution, str):
        raise TypeError(f"encode_solution: `solution` must be a str; got {type(solution).__name__}")
    ids = _format(fmt, "encode_solution").encode(solution)
    return np.append(ids, np.int32(EOS_ID)).astype(np.int32)


def _format(fmt: Any, caller: str) -> CotFormat:
    if fmt is None:
        return _BYTES
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"{caller}: `fmt` must be a CotFormat or None; got {type(fmt).__name__}")
    return fmt


_BYTES = CotFormat()


def decode_tokens(ids: Sequence[int] | np.ndarray) -> tuple[str, int, bool]:
    """``(text, tokens, finished)`` of decoded ids: the text before the first EOS (bytes, and
    the numbers of ids from :data:`NUMBER_BASE` on written in decimal; BOS and PAD dropped,
    invalid UTF-8 as U+FFFD), the tokens up to and including that EOS (all of them without
    one), and whether there was one. Any format's ids decode so.

    Example:
      >>> decode_tokens(np.append(encode_solution("Answer: no"), [EOS_ID, EOS_ID]))
      ('Answer: no', 11, True)
      >>> decode_tokens([65, 110, 115])  # cut short: no EOS
      ('Ans', 3, False)
      >>> decode_tokens(encode_solution("x = -12", CotFormat(numbers=16)))
      ('x = -12', 6, True)
    """
    arr = np.asarray(ids).reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"decode_tokens: `ids` must be integers; got dtype {arr.dtype}")
    ends = np.flatnonzero(arr == EOS_ID)
    finished = bool(ends.size)
    body = arr[: ends[0]] if finished else arr
    data = bytearray()
    for i in body[(body >= 0) & ((body < EOS_ID) | (body >= NUMBER_BASE))].tolist():
        if i < NUMBER_BASE:
            data.append(i)
        else:  # number_token's inverse
            k = i - NUMBER_BASE
            data += str(k // 2 if k % 2 == 0 else -(k + 1) // 2).encode()
    count = int(ends[0] + 1 if finished else arr.size)
    return data.decode("utf-8", errors="replace"), count, finished


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fit_format(
    problems: Iterable[linalg_cot.Problem], *, multiple: int = 8, numbers: int = 0
) -> CotFormat:
    """The smallest :class:`CotFormat` (lengths rounded up to ``multiple``) that holds every
    problem's question and solution written with ``numbers`` (:attr:`CotFormat.numbers`):
    sizing, never truncating.

    Example:
      >>> p = linalg_cot.generate("rref", 0)
      >>> fmt = fit_format([p])
      >>> fmt.source_len >= len(p.question) and fmt.target_len > len(p.solution_text())
      True
      >>> fit_format([p], multiple=1)
      CotFormat(source_len=80, target_len=148, numbers=0)
      >>> fit_format([p], multiple=1, numbers=10)  # each "-1" one token
      CotFormat(source_len=78, target_len=146, numbers=10)
    """
    multiple = check_int(multiple, "multiple", "fit_format")
    sizing = CotFormat(numbers=numbers)
    s = t = 0
    for p in problems:
        _check_problem(p, "fit_format")
        s = max(s, encode_question(p.question, sizing).size)
        t = max(t, encode_solution(p.solution_text(), sizing).size)
    if not s:
        raise ValueError("fit_format: `problems` is empty (nothing to size the format by)")
    return CotFormat(_round_up(s, multiple), _round_up(t, multiple), numbers)


def _check_problem(p: Any, caller: str) -> linalg_cot.Problem:
    if not isinstance(p, linalg_cot.Problem):
        raise TypeError(f"{caller}: problems must be linalg_cot.Problem; got {type(p).__name__}")
    return p


def pack(problems: Iterable[linalg_cot.Problem], fmt: CotFormat) -> np.ndarray:
    """Rows ``[N, S + T + 1]`` int32: the question's tokens padded to ``S``, then ``BOS``, the
    solution's tokens and ``EOS``, padded to ``T + 1`` (tokens as ``fmt`` writes them). A
    problem that does not fit ``fmt`` raises ``ValueError`` (nothing is truncated).

    Example:
      >>> p = linalg_cot.Problem("rref", "rref of A = [[2]]?", ("R1 = (1/2)*R1 -> [[1]]",), "[[1]]")
      >>> rows = pack([p], CotFormat(24, 40))
      >>> rows.shape, int(rows[0, 24]) == BOS_ID
      ((1, 65), True)
      >>> decode_tokens(rows[0, 25:])[0] == p.solution_text()
      True
    """
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"pack: `fmt` must be a CotFormat; got {type(fmt).__name__}")
    problems = [_check_problem(p, "pack") for p in problems]
    s, t = fmt.source_len, fmt.target_len
    rows = np.full((len(problems), fmt.row_len), PAD_ID, np.int32)
    for i, p in enumerate(problems):
        q, a = encode_question(p.question, fmt), encode_solution(p.solution_text(), fmt)
        if q.size > s or a.size > t:
            raise ValueError(
                f"pack: problem {i} ({p.kind}) has a {q.size}-token question and a {a.size}-token "
                f"solution (with EOS); `fmt` holds at most source_len={s} and target_len={t}: "
                "size the format with fit_format(problems) or leave such problems out"
            )
        rows[i, : q.size] = q
        rows[i, s] = BOS_ID
        rows[i, s + 1 : s + 1 + a.size] = a
    return rows


def length_buckets(
    problems: Sequence[linalg_cot.Problem],
    fmt: CotFormat,
    *,
    source_cuts: int,
    target_cuts: int,
    min_size: int,
    multiple: int = 8,
) -> list[tuple[CotFormat, list[int]]]:
    """Problems grouped by length, each group with the smallest format that holds it, so that
    a batch of one group is padded only to its own longest question and solution (with
    :class:`~sparse_jax.data.text.BucketIterator`; a short problem then costs less than the
    longest one). Returns ``[(format, problem indices)]``, the formats in increasing order.

    The question lengths are cut at their ``source_cuts`` quantiles ``1/m, ..., 1`` and the
    solution lengths at their ``target_cuts`` ones (rounded up to ``multiple``); each problem
    goes to the smallest cell of that grid that holds it, and a cell of fewer than ``min_size``
    problems (e.g. the batch size) is merged into a larger one. Every format fits within
    ``fmt`` and their row lengths ``S + T + 1`` differ from each other and from ``fmt``'s
    unless their ``S`` is the same (a target is lengthened by ``multiple`` where needed), so
    that a row's length tells its source length: :func:`loss_fn`'s ``source_len`` mapping,
    :func:`source_lengths`.

    Example (8 problems whose solutions are 2 or 60 steps long, cut in two by solution length):
      >>> short = [linalg_cot.Problem("rref", "A = [[1]]?", ("x",) * 2, "[[1]]")] * 4
      >>> long = [linalg_cot.Problem("rref", "A = [[1]]?", ("x",) * 60, "[[1]]")] * 4
      >>> fmt = fit_format(short + long)
      >>> buckets = length_buckets(short + long, fmt, source_cuts=1, target_cuts=2, min_size=2)
      >>> [(f.source_len, f.target_len, idx) for f, idx in buckets]
      [(16, 24, [0, 1, 2, 3]), (16, 136, [4, 5, 6, 7])]
    """
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"length_buckets: `fmt` must be a CotFormat; got {type(fmt).__name__}")
    source_cuts = check_int(source_cuts, "source_cuts", "length_buckets")
    target_cuts = check_int(target_cuts, "target_cuts", "length_buckets")
    min_size = check_int(min_size, "min_size", "length_buckets")
    multiple = check_int(multiple, "multiple", "length_buckets")
    problems = [_check_problem(p, "length_buckets") for p in problems]
    if not problems:
        raise ValueError("length_buckets: `problems` is empty")
    q = np.array([encode_question(p.question, fmt).size for p in problems])
    t = np.array([encode_solution(p.solution_text(), fmt).size for p in problems])
    if q.max() > fmt.source_len or t.max() > fmt.target_len:
        raise ValueError(
            f"length_buckets: `problems` hold a {q.max()}-token question and a {t.max()}-token "
            f"solution; `fmt` holds {fmt.source_len} and {fmt.target_len}: size it with "
            "fit_format(problems)"
        )

    def cuts(lengths, count):
        edges = np.quantile(lengths, np.arange(1, count + 1) / count, method="inverted_cdf")
        return sorted({_round_up(int(e), multiple) for e in edges})

    s_cuts, t_cuts = cuts(q, source_cuts), cuts(t, target_cuts)
    cells: dict[tuple[int, int], list[int]] = {}
    for i, (a, b) in enumerate(zip(q, t, strict=True)):
        cell = (next(s for s in s_cuts if s >= a), next(x for x in t_cuts if x >= b))
        cells.setdefault(cell, []).append(i)
    # A cell too small for a batch goes to the nearest cell at least as large on both sides
    # (its problems fit there); the largest cell, if small, takes in the largest other ones.
    grid = sorted(((s, x) for s in s_cuts for x in t_cuts), key=lambda c: (sum(c), c))
    for cell in grid[:-1]:
        if 0 < len(cells.get(cell, ())) < min_size:
            up = next(c for c in grid if c != cell and c[0] >= cell[0] and c[1] >= cell[1])
            cells.setdefault(up, []).extend(cells.pop(cell))
    top = grid[-1]
    while 0 < len(cells.get(top, ())) < min_size and len(cells) > 1:
        below = max((c for c in cells if c != top), key=lambda c: (sum(c), c))
        cells[top].extend(cells.pop(below))
    out = []
    used = {fmt.row_len: fmt.source_len}
    for idx in sorted(cells.values(), key=lambda idx: (q[idx].max(), t[idx].max())):
        idx = sorted(idx)
        s, x = _round_up(int(q[idx].max()), multiple), _round_up(int(t[idx].max()), multiple)
        while used.setdefault(s + x + 1, s) != s:
            x += multiple
        out.append((CotFormat(s, x, fmt.numbers), idx))
    return sorted(out, key=lambda bucket: (bucket[0].source_len, bucket[0].target_len))


def source_lengths(formats: Iterable[CotFormat]) -> dict[int, int]:
    """``{row length S + T + 1: S}`` of ``formats``: :func:`loss_fn`'s ``source_len`` when
    batches come in several formats (:func:`length_buckets`). Raises ``ValueError`` when two
    formats of different ``S`` have the same row length.

    Example:
      >>> source_lengths([CotFormat(16, 24), CotFormat(32, 64)])
      {41: 16, 97: 32}
    """
    out: dict[int, int] = {}
    for f in formats:
        if not isinstance(f, CotFormat):
            raise TypeError(f"source_lengths: formats must be CotFormat; got {type(f).__name__}")
        if out.setdefault(f.row_len, f.source_len) != f.source_len:
            raise ValueError(
                f"source_lengths: rows of length {f.row_len} would have a source of "
                f"{out[f.row_len]} and of {f.source_len} tokens: formats must differ in S + T + 1"
            )
    return out


class Batch(NamedTuple):
    """A batch of packed rows taken apart: what the model and its loss read.

    Example (:func:`split_rows` of rows ``[B, S + T + 1]`` gives ``source [B, S]``,
    ``source_lengths [B]`` and ``target_in``, ``target_out``, ``where`` each ``[B, T]``):
      >>> p = linalg_cot.Problem("rref", "rref of A = [[2]]?", ("R1 = (1/2)*R1 -> [[1]]",), "[[1]]")
      >>> batch = split_rows(jnp.asarray(pack([p, p], CotFormat(24, 40))), 24)
      >>> [tuple(x.shape) for x in batch]
      [(2, 24), (2,), (2, 40), (2, 40), (2, 40)]
      >>> n = int(batch.where[0].sum())  # solution tokens, EOS included
      >>> int(batch.target_in[0, 0]) == BOS_ID, int(batch.target_out[0, n - 1]) == EOS_ID
      (True, True)
    """

    source: jax.Array  # [B, S] question tokens, PAD after them
    source_lengths: jax.Array  # [B] question lengths
    target_in: jax.Array  # [B, T] BOS then the solution (the decoder's input)
    target_out: jax.Array  # [B, T] the solution then EOS (what it should write)
    where: jax.Array  # [B, T] bool: target_out is not padding


def split_rows(rows: jax.Array, source_len: int) -> Batch:
    """:class:`Batch` of packed ``rows [B, S + T + 1]`` (pure, jittable; ``source_len`` static).

    Example:
      >>> p = linalg_cot.Problem("rref", "rref of A = [[2]]?", ("R1 = (1/2)*R1 -> [[1]]",), "[[1]]")
      >>> b = split_rows(jnp.asarray(pack([p], CotFormat(24, 40))), 24)
      >>> int(b.source_lengths[0]), int(b.where.sum()), b.target_in.shape
      (18, 37, (1, 40))
    """
    source = rows[:, :source_len]
    target = rows[:, source_len:]
    target_out = target[:, 1:]
    return Batch(
        source=source,
        source_lengths=jnp.sum(source != PAD_ID, axis=1).astype(jnp.int32),
        target_in=target[:, :-1],
        target_out=target_out,
        where=target_out != PAD_ID,
    )


def loss_fn(
    model: EncoderDecoder, rows: jax.Array, rng: Any = None, *, source_len: int | Mapping[int, int]
):
    """The trainer's loss of packed rows: ``(sequence_loss, {"target_tokens": count})``
    (``rng`` unused: the model has no random parts). Bind ``source_len`` with
    ``functools.partial`` for :class:`~sparse_jax.training.loop.Trainer`: the rows' ``S``, or
    ``{row length: S}`` (:func:`source_lengths`) when batches come in several formats
    (:func:`length_buckets`; each compiles once).

    Example (2 problems packed as ``rows [2, 24 + 40 + 1]`` and a tiny model; ``jax.eval_shape``
    traces the loss without compiling it, ``jax.jit`` of the same partial, as the trainer runs
    it, computes it):
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
      >>> problems = [linalg_cot.Problem("rref", f"rref of A = [[{k}]]?",
      ...                                (f"R1 = (1/{k})*R1 -> [[1]]",), "[[1]]") for k in (2, 3)]
      >>> rows = jnp.asarray(pack(problems, CotFormat(24, 40)))
      >>> loss, metrics = jax.eval_shape(functools.partial(loss_fn, source_len=24), model, rows)
      >>> loss.shape, loss.dtype, list(metrics)  # a scalar loss; the targets' count beside it
      ((), dtype('float32'), ['target_tokens'])
    """
    if isinstance(source_len, Mapping):
        if rows.shape[-1] not in source_len:
            raise ValueError(
                f"loss_fn: rows of length {rows.shape[-1]} are not in `source_len` (row lengths "
                f"{sorted(source_len)}): pack them in one of its formats"
            )
        source_len = source_len[rows.shape[-1]]
    b = split_rows(rows, source_len)
    loss = sequence_loss(model, b.source, b.source_lengths, b.target_in, b.target_out, b.where)
    return loss, {"target_tokens": jnp.sum(b.where).astype(jnp.float32)}


# ---------------------------------------------------------------------------------------------
# Decoding.


def _start(graphdef, state, source, source_lengths, cache_len: int):
    model = nnx.merge(graphdef, state)
    memory = model.encode(source, source_lengths)
    return model.init_cache(memory, source_lengths, cache_len)


def _chunk(graphdef, state, token, cache, done, steps: int):
    """``steps`` greedy positions: the step of ``encdec.greedy_decode``, on the same cache."""
    model = nnx.merge(graphdef, state)

    def step(carry, _):
        token, cache, done = carry
        logits, cache = model.decode_step(token, cache)
        nxt = jnp.where(done, EOS_ID, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return (nxt, cache, done | (nxt == EOS_ID)), nxt

    (token, cache, done), out = jax.lax.scan(step, (token, cache, done), None, length=steps)
    return token, cache, done, out.T


class GreedyDecoder:
    """Greedy decoding of ``max_len`` tokens at most with the model's key/value cache, ``chunk``
    positions per compiled call, stopping after the call in which every row has emitted EOS.

    The tokens equal :func:`sparse_jax.models.encdec.greedy_decode`'s up to each row's EOS
    (after it: EOS). Each batch shape ``(B, S)`` is compiled ahead of time, on its first use,
    so the seconds returned are the decoding's only.

    Example:
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> decoder = GreedyDecoder(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), max_len=20, chunk=8)
      >>> tokens, seconds = decoder(np.full((2, 5), 65, np.int32), np.array([5, 3]))
      >>> tokens.shape[0], tokens.shape[1] in (8, 16, 20), seconds > 0
      (2, True, True)
    """

    def __init__(self, model: EncoderDecoder, *, max_len: int, chunk: int = 32):
        if not isinstance(model, EncoderDecoder):
            raise TypeError(f"GreedyDecoder: `model` must be an EncoderDecoder; got {model!r}")
        self.max_len = check_int(max_len, "max_len", "GreedyDecoder")
        self.chunk = min(check_int(chunk, "chunk", "GreedyDecoder"), self.max_len)
        if model.config.vocab_size <= max(EOS_ID, BOS_ID):
            raise ValueError(
                f"GreedyDecoder: the model's vocab_size={model.config.vocab_size} must hold the "
                f"byte ids and BOS/EOS (at least {max(EOS_ID, BOS_ID) + 1})"
            )
        self.model = model
        self.graphdef, self.state = nnx.split(model)
        self._cache_len = _round_up(self.max_len, self.chunk)
        self._compiled: dict[tuple[int, int], tuple[Any, Any]] = {}

    def _executables(self, b: int, s: int):
        key = (b, s)
        if key not in self._compiled:
            src = jax.ShapeDtypeStruct((b, s), jnp.int32)
            lens = jax.ShapeDtypeStruct((b,), jnp.int32)
            start = jax.jit(functools.partial(_start, self.graphdef, cache_len=self._cache_len))
            start = start.lower(self.state, src, lens).compile()
            cache = jax.eval_shape(
                functools.partial(_start, self.graphdef, cache_len=self._cache_len),
                self.state,
                src,
                lens,
            )
            token = jax.ShapeDtypeStruct((b,), jnp.int32)
            done = jax.ShapeDtypeStruct((b,), jnp.bool_)
            step = jax.jit(functools.partial(_chunk, self.graphdef, steps=self.chunk))
            step = step.lower(self.state, token, cache, done).compile()
            # One untimed call: the first run of an executable pays one-time costs.
            ids = np.zeros((b, s), np.int32)
            cache = start(self.state, ids, np.ones((b,), np.int32))
            jax.block_until_ready(step(self.state, ids[:, 0], cache, np.zeros((b,), bool)))
            self._compiled[key] = (start, step)
        return self._compiled[key]

    def __call__(self, source, source_lengths) -> tuple[np.ndarray, float]:
        """``(tokens [B, n], seconds)``: ``n <= max_len`` decoded positions (a multiple of
        ``chunk``, or ``max_len``) and the wall time of the decoding (compilation excluded)."""
        source = np.asarray(source, np.int32)
        lengths = np.asarray(source_lengths, np.int32)
        if source.ndim != 2 or lengths.shape != source.shape[:1]:
            raise ValueError(
                f"GreedyDecoder: `source` must be [B, S] and `source_lengths` [B]; got "
                f"{source.shape} and {lengths.shape}"
            )
        b, s = source.shape
        start, step = self._executables(b, s)
        began = time.perf_counter()
        cache = start(self.state, source, lengths)
        token = jnp.full((b,), BOS_ID, jnp.int32)
        done = jnp.zeros((b,), bool)
        pieces, position = [], 0
        while position < self.max_len:
            token, cache, done, out = step(self.state, token, cache, done)
            pieces.append(out)
            position += self.chunk
            if bool(jnp.all(done)):
                break
        tokens = np.concatenate(jax.device_get(pieces), axis=1)[:, : self.max_len]
        return tokens, time.perf_counter() - began


# ---------------------------------------------------------------------------------------------
# The solver.


@dataclasses.dataclass(frozen=True)
class Answer:
    """A model's answer to one question.

    ``text`` is the decoded chain of thought and answer line (or, when the question could not
    be answered, a message that starts with ``Cannot answer:`` and says why); ``final`` and
    ``steps`` are :func:`~sparse_jax.data.linalg_cot.split_solution` of it (``final`` None when
    the model wrote no ``Answer:`` line, and for questions it could not answer).

    Example (what :meth:`Solver.answer` returns for a decoded text; the numbers are made up):
      >>> text = "R1 = (1/2)*R1 -> [[1, 2]]\\nAnswer: [[1, 2]]"
      >>> steps, final = linalg_cot.split_solution(text)
      >>> answer = Answer(text, final, steps, seconds=0.01, tokens=42, finished=True, kind="rref")
      >>> answer.final, answer.steps, answer.error is None
      ('[[1, 2]]', ('R1 = (1/2)*R1 -> [[1, 2]]',), True)
    """

    text: str  # the decoded solution (steps, then "Answer: ..."), or "Cannot answer: <why>"
    final: str | None  # the final answer (what follows the last "Answer:"), None if none
    steps: tuple[str, ...]  # the chain of thought's step lines, in order
    seconds: float  # decoding wall time (a batch's time divided among its questions)
    tokens: int = 0  # tokens decoded, EOS included (0: nothing decoded)
    finished: bool = False  # whether the model ended with EOS within its length
    kind: str | None = None  # the question's kind as linalg_cot.parse_question reads it
    error: str | None = None  # why the question was not answered (None: it was decoded)


def _refusal(why: str, kind: str | None = None) -> Answer:
    text = f"Cannot answer: {why}"
    return Answer(text=text, final=None, steps=(), seconds=0.0, kind=kind, error=why)


class Solver:
    """Answers linear-algebra questions with a trained encoder–decoder (greedy decoding; never
    :func:`~sparse_jax.data.linalg_cot.solve`).

    A question is decoded only when :func:`~sparse_jax.data.linalg_cot.parse_question` reads
    it and its tokens fit ``fmt.source_len``; otherwise its :class:`Answer` says why (a non-str
    question raises ``TypeError``).

    Args:
      model: the trained :class:`~sparse_jax.models.encdec.EncoderDecoder`.
      fmt: the :class:`CotFormat` it was trained with (``target_len`` bounds the decoding).
      name: a label (e.g. ``"sparse"``).
      batch_size: questions decoded together by :meth:`answer_batch`.
      chunk: positions per compiled decoding call (:class:`GreedyDecoder`).
      kinds: the kinds it was trained on (informative; None: unknown).
      step: the training step its weights are from (None: unknown).

    Example (an untrained tiny model; a question that fits ``fmt`` is decoded, compiling the
    decoder once per batch shape, as in the module's example; this one is refused before any
    decoding, being longer than ``fmt.source_len``):
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> solver = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), CotFormat(48, 64), name="tiny")
      >>> answer = solver.answer("Find the reduced row echelon form R of A = [[1, 2], [3, 4]].")
      >>> answer.kind, answer.final, answer.tokens
      ('rref', None, 0)
      >>> print(answer.text)
      Cannot answer: the question is 60 tokens long; this model reads at most 48 (the longest ...)
    """

    def __init__(
        self,
        model: EncoderDecoder,
        fmt: CotFormat,
        *,
        name: str = "model",
        batch_size: int = 32,
        chunk: int = 32,
        kinds: Sequence[str] | None = None,
        step: int | None = None,
    ):
        if not isinstance(fmt, CotFormat):
            raise TypeError(f"Solver: `fmt` must be a CotFormat; got {type(fmt).__name__}")
        self.model, self.fmt, self.name = model, fmt, str(name)
        self.batch_size = check_int(batch_size, "batch_size", "Solver")
        self.decoder = GreedyDecoder(model, max_len=fmt.target_len, chunk=chunk)  # checks model
        if model.config.vocab_size < fmt.vocab_size:
            raise ValueError(
                f"Solver: the model has a vocabulary of {model.config.vocab_size} ids; `fmt` "
                f"(numbers={fmt.numbers}) writes {fmt.vocab_size}: pass the format it was "
                "trained with"
            )
        self.kinds = None if kinds is None else tuple(kinds)
        self.step = step
        self._stats_fn = self._next_fn = None

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        run_folder: str | os.PathLike,
        model: str = "sparse",
        *,
        partial: bool = False,
        batch_size: int = 32,
        chunk: int = 32,
    ) -> Solver:
        """The ``model`` (``"sparse"`` or ``"dense"``) that ``python -m experiments.cot``
        trained in ``run_folder``, restored from its Orbax checkpoint.

        Raises:
          FileNotFoundError: the folder has no :data:`RECORD` (not a run folder) or no
            checkpoint of that model (it was never trained).
          ValueError: ``model`` is not one of the run's models, or its latest checkpoint is
            from before the end of its training (``partial=True`` loads it anyway; not while
            that training runs: opening its checkpoints removes unfinished writes).
        """
        partial = check_bool(partial, "partial", "Solver.load")
        folder = Path(run_folder)
        record = read_record(folder)
        if model not in record["models"]:
            raise ValueError(
                f"Solver.load: `model`={model!r} is not a model of {folder}; allowed: "
                f"{sorted(record['models'])}"
            )
        entry = record["models"][model]
        config = EncDecConfig(**entry["model"])
        train = TrainConfig(**entry["train"])
        fmt = CotFormat(**record["format"])
        directory = folder / entry["checkpoint"]
        steps = (
            sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())
            if directory.is_dir()
            else []
        )
        if not steps:
            raise FileNotFoundError(
                f"Solver.load: no trained checkpoint of the {model!r} model in {directory}: it "
                f"has not been trained (python -m experiments.cot train --run.dir {folder}, "
                "with --run.resume to continue a run)"
            )

        def unfinished(step: int) -> ValueError:
            return ValueError(
                f"Solver.load: the {model!r} model of {folder} is trained to step {step} of "
                f"{train.steps} only (an interrupted run: continue it with python -m "
                f"experiments.cot train --run.dir {folder} --run.resume, or pass partial=True)"
            )

        # Checked before the checkpoints are opened (opening them clears unfinished writes,
        # which may be a running training's).
        if steps[-1] < train.steps and not partial:
            raise unfinished(steps[-1])
        net = EncoderDecoder(config, rngs=nnx.Rngs(0))
        loss = functools.partial(loss_fn, source_len=fmt.source_len)
        with Checkpointer(directory, save_every=max(train.steps, 1)) as ckpt:
            trainer = Trainer(net, loss, train, checkpointer=ckpt)
            trainer.restore()  # the latest readable checkpoint
        if trainer.step < train.steps and not partial:
            raise unfinished(trainer.step)
        return cls(
            trainer.sync_model(),
            fmt,
            name=model,
            batch_size=batch_size,
            chunk=chunk,
            kinds=record.get("kinds"),
            step=trainer.step,
        )

    # -- answering ---------------------------------------------------------------------------

    def _read(self, question: Any) -> tuple[np.ndarray | None, Answer | None]:
        """The question's ids, or the refusal that says why it is not decoded."""
        if not isinstance(question, str):
            raise TypeError(f"Solver: a question must be a str; got {type(question).__name__}")
        text = question.strip()
        if not text:
            return None, _refusal("could not parse the question: it is empty")
        try:
            kind = linalg_cot.parse_question(text).kind
        except ValueError as err:
            return None, _refusal(str(err))
        ids = encode_question(text, self.fmt)
        if ids.size > self.fmt.source_len:
            why = (
                f"the question is {ids.size} tokens long; this model reads at most "
                f"{self.fmt.source_len} (the longest question it was trained for)"
            )
            return None, _refusal(why, kind)
        return ids, Answer(text="", final=None, steps=(), seconds=0.0, kind=kind)

    def _decode(self, questions: Sequence[Any], batch_size: int, repeats: int = 1):
        """``[(answer, token ids or None)]`` of ``questions``, in order; each batch decoded
        ``repeats`` times, its time the median (the tokens are the same each time)."""
        read = [self._read(q) for q in questions]
        out: list[tuple[Answer, np.ndarray | None]] = [(a, None) for _, a in read]
        todo = [i for i, (ids, _) in enumerate(read) if ids is not None]
        s = self.fmt.source_len
        for start in range(0, len(todo), batch_size):
            part = todo[start : start + batch_size]
            rows = min(batch_size, 1 << (len(part) - 1).bit_length())  # few batch shapes
            source = np.full((rows, s), PAD_ID, np.int32)
            lengths = np.ones((rows,), np.int32)
            for r in range(rows):  # padding rows repeat the real ones
                ids = read[part[r % len(part)]][0]
                source[r, : ids.size], lengths[r] = ids, ids.size
            runs = [self.decoder(source, lengths) for _ in range(repeats)]
            tokens = runs[0][0]
            seconds = float(np.median([t for _, t in runs]))
            for r, i in enumerate(part):
                text, count, finished = decode_tokens(tokens[r])
                steps, final = linalg_cot.split_solution(text)
                answer = dataclasses.replace(
                    read[i][1],
                    text=text,
                    final=final,
                    steps=steps,
                    seconds=seconds / len(part),
                    tokens=count,
                    finished=finished,
                )
                out[i] = (answer, tokens[r, :count])
        return out

    def answer(self, question: str) -> Answer:
        """The model's chain of thought and final answer for one question (see :class:`Answer`;
        an unreadable question gets an answer that says why, a non-str one a TypeError)."""
        return self._decode([question], 1)[0][0]

    def answer_batch(self, questions: Sequence[str], *, batch_size: int | None = None):
        """:meth:`answer` of each question, decoded ``batch_size`` at a time (default: the
        solver's); each answer's ``seconds`` is its batch's time divided among its questions."""
        if isinstance(questions, str) or not isinstance(questions, Sequence):
            raise TypeError(
                "Solver.answer_batch: `questions` must be a sequence of str; got "
                f"{type(questions).__name__}"
            )
        size = self.batch_size if batch_size is None else batch_size
        size = check_int(size, "batch_size", "Solver.answer_batch")
        return [answer for answer, _ in self._decode(list(questions), size)]

    def next_tokens(self, source, source_lengths, target_in) -> np.ndarray:
        """The most likely next token ``[B, T]`` after each prefix of ``target_in [B, T]``
        given ``source [B, S]`` and ``source_lengths [B]`` (teacher-forced, jitted)."""
        if self._next_fn is None:
            graphdef = self.decoder.graphdef

            def next_tokens(state, src, lens, tgt):
                return jnp.argmax(nnx.merge(graphdef, state)(src, lens, tgt), axis=-1)

            self._next_fn = jax.jit(next_tokens)
        out = self._next_fn(self.decoder.state, source, source_lengths, target_in)
        return np.asarray(jax.device_get(out))

    def attention_stats(self, source, source_lengths, target_in) -> dict[str, float]:
        """The model's attention statistics (``return_stats=True``) on a teacher-forced batch:
        per kind of attention the mean non-zero and allowed fractions of keys (jitted)."""
        if self._stats_fn is None:
            graphdef = self.decoder.graphdef

            def stats(state, src, lens, tgt):
                return nnx.merge(graphdef, state)(src, lens, tgt, return_stats=True)[1]

            self._stats_fn = jax.jit(stats)
        out = self._stats_fn(self.decoder.state, source, source_lengths, target_in)
        return {k: float(v) for k, v in jax.device_get(out).items()}


# ---------------------------------------------------------------------------------------------
# Evaluation.


# Rows of one attention-statistics pass: it holds every layer's weights [B, N, T, T] at once.
_STATS_ROWS = 16


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def _steps_matched(written: Sequence[str], reference: Sequence[str]) -> int:
    """How many of the reference's step lines were written, in order, before the first line
    that differs from it."""
    matched = 0
    for mine, theirs in zip(written, reference, strict=False):
        if mine.strip() != theirs.strip():
            break
        matched += 1
    return matched


def _first_step_right(record: Mapping[str, Any]) -> bool:
    if record["reference_steps"] == 0:  # nothing to read: right when nothing was written
        return record["steps"] == 0
    return record["steps_matched"] >= 1


def reference_accuracy(
    solver: Solver,
    problems: Iterable[linalg_cot.Problem],
    *,
    batch_size: int | None = None,
    units: CotFormat | None = None,
    group: Callable[[str, str], str] | None = None,
) -> dict[str, dict[str, int]]:
    """Teacher-forced next-token accuracy on the reference solutions, by what each token
    writes: ``{role: {"right": n, "tokens": m}}`` over the roles of
    :func:`~sparse_jax.data.linalg_cot.solution_roles` (EOS counted with ``answer``), where
    ``right`` counts the tokens the model's most likely next token gets right given the
    reference before it. Exact match grades whole chains; this says which part of a step a
    model cannot write even from a right start (the row operation, the operands it copies, the
    entries it computes, the state after). Problems that do not fit ``solver.fmt`` are left
    out.

    ``units`` counts the tokens of another format instead of the model's own (e.g.
    ``CotFormat(numbers=100)``: each number once, so that models with and without numbers as
    tokens compare alike): a unit is right when every model token that overlaps it is.
    ``group(role, text)`` names the count a unit goes to (default: its role; e.g. the terms'
    negative results apart); the groups come in the order of their units' roles in ``ROLES``
    (groups of one role in the order first met).

    Example:
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> problems = [linalg_cot.generate("rref", seed) for seed in range(2)]
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> untrained = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), fit_format(problems))
      >>> counts = reference_accuracy(untrained, problems)
      >>> sum(c["tokens"] for c in counts.values()) == sum(
      ...     encode_solution(p.solution_text()).size for p in problems)
      True
      >>> def sign(role, text):  # the entries that are negative numbers, apart
      ...     return f"{role}, negative" if text.startswith("-") else role
      >>> per_number = reference_accuracy(untrained, problems, units=CotFormat(numbers=10),
      ...                                 group=sign)
      >>> per_number["state, negative"]["tokens"] < counts["state"]["tokens"]
      True
    """
    if not isinstance(solver, Solver):
        raise TypeError(
            f"reference_accuracy: `solver` must be a Solver; got {type(solver).__name__}"
        )
    problems = [_check_problem(p, "reference_accuracy") for p in problems]
    size = check_int(
        solver.batch_size if batch_size is None else batch_size, "batch_size", "reference_accuracy"
    )
    if group is not None and not callable(group):
        raise TypeError(f"reference_accuracy: `group` must be callable; got {type(group).__name__}")
    fmt = solver.fmt
    units = fmt if units is None else _format(units, "reference_accuracy")
    fits = [
        p
        for p in problems
        if encode_question(p.question, fmt).size <= fmt.source_len
        and encode_solution(p.solution_text(), fmt).size <= fmt.target_len
    ]
    counts: dict[str, dict[str, int]] = {}
    roles: dict[str, int] = {}  # each group's role, as its place in ROLES
    for start in range(0, len(fits), size):
        part = fits[start : start + size]
        rows = pack([part[r % len(part)] for r in range(size)], fmt)  # one compiled shape
        batch = split_rows(jnp.asarray(rows), fmt.source_len)
        predicted = solver.next_tokens(batch.source, batch.source_lengths, batch.target_in)
        target = np.asarray(batch.target_out)
        for r, p in enumerate(part):
            text = p.solution_text()
            data, written = text.encode("utf-8"), linalg_cot.solution_roles(text)
            own = fmt.tokens(text)[1]
            right = predicted[r, : own.size + 1] == target[r, : own.size + 1]  # EOS last
            starts = own if units == fmt else units.tokens(text)[1]
            ends = np.append(starts[1:], len(data))
            # The model tokens that overlap each unit: from the last starting at or before
            # its first byte to the last starting before its end.
            first = np.searchsorted(own, starts, side="right") - 1
            last = np.searchsorted(own, ends, side="left") - 1
            found = [
                (written[a], data[a:b].decode("utf-8", errors="replace"), right[i : j + 1].all())
                for a, b, i, j in zip(starts, ends, first, last, strict=True)
            ]
            # A unit writes what its first byte does (a number's first digit).
            for role, piece, ok in [*found, ("answer", "", right[own.size])]:
                name = role if group is None else str(group(role, piece))
                entry = counts.setdefault(name, {"right": 0, "tokens": 0})
                entry["right"] += bool(ok)
                entry["tokens"] += 1
                roles.setdefault(name, linalg_cot.ROLES.index(role))
    return {name: counts[name] for name in sorted(counts, key=roles.__getitem__)}


def evaluate(
    solver: Solver,
    problems: Iterable[linalg_cot.Problem],
    *,
    batch_size: int | None = None,
    stats_multiple: int = 64,
    repeats: int = 1,
) -> dict[str, Any]:
    """Decodes ``problems`` with ``solver`` (batches of one kind) and measures its answers.

    Returns a JSON-ready dict: ``records`` (per problem, in order: kind, question, reference
    and predicted final answer, ``correct`` = :func:`~sparse_jax.data.linalg_cot.grade`,
    ``first_divergence``, the decoded text, steps and tokens and the reference's, finished,
    seconds, flops, error),
    ``kinds`` (per kind, in :data:`~sparse_jax.data.linalg_cot.KINDS` order) and ``overall``
    (all problems), each with:

    * ``questions``, ``exact_match`` (fraction correct), ``answered`` (fraction with an
      ``Answer:`` line), ``finished`` (fraction that ended with EOS);
    * ``chain_match`` (fraction whose whole solution is the reference's: every step line and
      the final answer), ``first_step`` (fraction whose first step line is the reference's: the
      question read right) and ``steps_matched`` (mean fraction of the reference's step lines
      written before the first that differs): whether the model reasons, beside whether its
      final answer is right (an answer can be right after wrong steps, or guessed);
    * ``divergences``: where the chains that differ from the reference first leave it, the
      number of chains per :func:`~sparse_jax.data.linalg_cot.first_divergence` (such as
      ``"row combination: result"``), most frequent first;
    * ``steps`` / ``reference_steps``, ``tokens`` / ``reference_tokens``: mean chain-of-thought
      length in step lines (the ``Answer:`` line not counted) and in tokens (EOS included);
    * ``seconds_per_question``: the decoding's wall time over the questions (each batch's time
      the median of ``repeats`` decodings);
    * ``flops_per_question``: mean ``model.flops(question tokens, decoded tokens)["total"]``
      (a teacher-forced pass over the question and the chain of thought written; every entry
      a mask allows is counted);
    * ``attention``: ``model(..., return_stats=True)`` on what the decoder read (BOS and the
      chain of thought it wrote, teacher-forced; a batch padded to the next multiple of
      ``stats_multiple`` tokens, whose padding rows count too), the mean over questions of
      each statistic (``*_nonzero``: fraction of keys with a non-zero weight; ``*_allowed``:
      fraction the masks allow);
    * ``reference_roles``: :func:`reference_accuracy` on the reference solutions, per role
      ``{"accuracy": fraction right, "tokens": count}``.

    A problem the solver cannot read (too long for its format) is counted as wrong, with its
    ``error``.

    Example:
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> problems = [linalg_cot.generate("rref", seed) for seed in range(2)]
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> untrained = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), fit_format(problems))
      >>> result = evaluate(untrained, problems)
      >>> result["kinds"]["rref"]["questions"], result["overall"]["exact_match"]
      (2, 0.0)
    """
    if not isinstance(solver, Solver):
        raise TypeError(f"evaluate: `solver` must be a Solver; got {type(solver).__name__}")
    problems = [_check_problem(p, "evaluate") for p in problems]
    size = solver.batch_size if batch_size is None else batch_size
    size = check_int(size, "batch_size", "evaluate")
    multiple = check_int(stats_multiple, "stats_multiple", "evaluate")
    repeats = check_int(repeats, "repeats", "evaluate")
    model, fmt = solver.model, solver.fmt
    flops = functools.cache(lambda s, t: model.flops(s, t)["total"])
    records: list[dict[str, Any] | None] = [None] * len(problems)
    weighted: dict[str, dict[str, list[tuple[float, int]]]] = {}
    roles: dict[str, dict[str, dict[str, int]]] = {}
    order = [k for k in linalg_cot.KINDS if any(p.kind == k for p in problems)]
    order += sorted({p.kind for p in problems} - set(order))
    for kind in order:
        index = [i for i, p in enumerate(problems) if p.kind == kind]
        roles[kind] = reference_accuracy(solver, [problems[i] for i in index], batch_size=size)
        for start in range(0, len(index), size):
            part = index[start : start + size]
            decoded = solver._decode([problems[i].question for i in part], size, repeats)
            for i, (answer, _) in zip(part, decoded, strict=True):
                p = problems[i]
                ref = encode_solution(p.solution_text(), fmt)
                correct = answer.final is not None and linalg_cot.grade(answer.final, p.answer)
                matched = _steps_matched(answer.steps, p.steps)
                records[i] = {
                    "kind": p.kind,
                    "question": p.question,
                    "reference": p.answer,
                    "final": answer.final,
                    "correct": correct,
                    "chain_correct": correct and tuple(answer.steps) == tuple(p.steps),
                    "steps_matched": matched,
                    "first_divergence": linalg_cot.first_divergence(answer.steps, p.steps),
                    "text": answer.text,
                    "steps": len(answer.steps),
                    "reference_steps": len(p.steps),
                    "tokens": answer.tokens,
                    "reference_tokens": int(ref.size),
                    "finished": answer.finished,
                    "seconds": answer.seconds,
                    "flops": (
                        None
                        if answer.error
                        else flops(
                            encode_question(p.question.strip(), fmt).size, max(answer.tokens, 1)
                        )
                    ),
                    "error": answer.error,
                }
            ok = [(i, ids) for i, (_, ids) in zip(part, decoded, strict=True) if ids is not None]
            if not ok:
                continue
            # The inputs the decoder read: BOS, then all it wrote but the last token.
            longest = max(ids.size for _, ids in ok)
            t = min(_round_up(longest, multiple), fmt.target_len)
            for first in range(0, len(ok), _STATS_ROWS):
                rows = ok[first : first + _STATS_ROWS]
                source = np.full((_STATS_ROWS, fmt.source_len), PAD_ID, np.int32)
                lengths = np.ones((_STATS_ROWS,), np.int32)
                target_in = np.full((_STATS_ROWS, t), PAD_ID, np.int32)
                for r in range(_STATS_ROWS):  # padding rows repeat the real ones
                    i, ids = rows[r % len(rows)]
                    q = encode_question(problems[i].question.strip(), fmt)
                    source[r, : q.size], lengths[r] = q, q.size
                    target_in[r, 0] = BOS_ID
                    target_in[r, 1 : ids.size] = ids[:-1]
                stats = solver.attention_stats(source, lengths, target_in)
                for name, value in stats.items():
                    weighted.setdefault(kind, {}).setdefault(name, []).append((value, len(rows)))

    def summary(rows: list[dict[str, Any]], kinds: Sequence[str]) -> dict[str, Any]:
        decoded = [r for r in rows if r["error"] is None]
        attention: dict[str, float] = {}
        names = sorted({n for k in kinds for n in weighted.get(k, {})})
        for name in names:
            pairs = [pair for k in kinds for pair in weighted.get(k, {}).get(name, [])]
            attention[name] = sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1)
        counts = {
            role: [
                sum(roles[k].get(role, {}).get(n, 0) for k in kinds) for n in ("right", "tokens")
            ]
            for role in linalg_cot.ROLES
        }
        return {
            "questions": len(rows),
            "exact_match": _mean([float(r["correct"]) for r in rows]),
            "chain_match": _mean([float(r["chain_correct"]) for r in rows]),
            "first_step": _mean([float(_first_step_right(r)) for r in rows]),
            "steps_matched": _mean(
                [
                    r["steps_matched"] / r["reference_steps"]
                    if r["reference_steps"]
                    else float(r["steps"] == 0)
                    for r in rows
                ]
            ),
            "divergences": dict(
                collections.Counter(
                    r["first_divergence"] for r in rows if r["first_divergence"] is not None
                ).most_common()
            ),
            "answered": _mean([float(r["final"] is not None) for r in rows]),
            "finished": _mean([float(r["finished"]) for r in rows]),
            "steps": _mean([r["steps"] for r in rows]),
            "reference_steps": _mean([r["reference_steps"] for r in rows]),
            "tokens": _mean([r["tokens"] for r in rows]),
            "reference_tokens": _mean([r["reference_tokens"] for r in rows]),
            "seconds_per_question": sum(r["seconds"] for r in rows) / max(len(rows), 1),
            "flops_per_question": _mean([r["flops"] for r in decoded]),
            "errors": len(rows) - len(decoded),
            "attention": attention,
            "reference_roles": {
                role: {"accuracy": right / tokens, "tokens": tokens}
                for role, (right, tokens) in counts.items()
                if tokens
            },
        }

    done = [r for r in records if r is not None]
    return {
        "model": solver.name,
        "kinds": {k: summary([r for r in done if r["kind"] == k], [k]) for k in order},
        "overall": summary(done, order),
        "records": done,
    }


def most_frequent_answers(
    train: Iterable[linalg_cot.Problem], test: Iterable[linalg_cot.Problem]
) -> dict[str, dict[str, Any]]:
    """Exact match without reading the question: per kind, the final answer most frequent among
    the ``train`` problems (ties: the one seen first), graded against each ``test`` problem of
    that kind. A floor for :func:`evaluate`'s exact match: a model that scores it has learned
    the answers' frequencies, not to solve (a kind asking "always, sometimes or never" has
    three answers; a small rref's is often the identity).

    Returns per kind of ``test`` (in :data:`~sparse_jax.data.linalg_cot.KINDS` order) and for
    ``"overall"``: ``answer`` (None for the overall, and for a kind with no training problem,
    which then scores 0), ``questions`` and ``exact_match``.

    Example:
      >>> train = [linalg_cot.generate("solvability", seed) for seed in range(40)]
      >>> test = [linalg_cot.generate("solvability", seed) for seed in range(40, 60)]
      >>> prior = most_frequent_answers(train, test)
      >>> prior["solvability"]["answer"] in ("always", "sometimes but not always", "never")
      True
      >>> prior["overall"]["questions"], 0 < prior["overall"]["exact_match"] < 1
      (20, True)
    """
    train = [_check_problem(p, "most_frequent_answers") for p in train]
    test = [_check_problem(p, "most_frequent_answers") for p in test]
    counts: dict[str, collections.Counter] = {}
    for p in train:
        counts.setdefault(p.kind, collections.Counter())[p.answer] += 1
    kinds = [k for k in linalg_cot.KINDS if any(p.kind == k for p in test)]
    result: dict[str, dict[str, Any]] = {}
    hits: list[float] = []
    for kind in kinds:
        answer = counts[kind].most_common(1)[0][0] if kind in counts else None
        right = [
            float(answer is not None and linalg_cot.grade(answer, p.answer))
            for p in test
            if p.kind == kind
        ]
        hits += right
        result[kind] = {"answer": answer, "questions": len(right), "exact_match": _mean(right)}
    result["overall"] = {"answer": None, "questions": len(hits), "exact_match": _mean(hits)}
    return result


# ---------------------------------------------------------------------------------------------
# The run folder's record.


def write_record(
    folder: str | os.PathLike,
    fmt: CotFormat,
    models: Mapping[str, tuple[EncDecConfig, Any]],
    *,
    kinds: Sequence[str] | None = None,
) -> Path:
    """Writes ``folder/cot.json``: the format, and per model name its ``EncDecConfig``, its
    ``TrainConfig`` and checkpoint folder (``checkpoints/<name>``), what :meth:`Solver.load`
    needs. Written atomically (a temporary file, then a rename); returns its path.

    Example (the record of a run with a sparse model and its dense baseline):
      >>> import tempfile
      >>> from sparse_jax.models.encdec import EncDecConfig
      >>> from sparse_jax.training.loop import TrainConfig
      >>> tmp = tempfile.TemporaryDirectory()
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16)
      >>> models = {"sparse": (cfg, TrainConfig(steps=10)), "dense": (cfg.dense(), TrainConfig())}
      >>> path = write_record(tmp.name, CotFormat(96, 64), models, kinds=["rref"])
      >>> path.name, sorted(read_record(tmp.name)["models"])
      ('cot.json', ['dense', 'sparse'])
      >>> tmp.cleanup()
    """
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"write_record: `fmt` must be a CotFormat; got {type(fmt).__name__}")
    entries = {}
    for name, (config, train) in models.items():
        if not isinstance(config, EncDecConfig):
            raise TypeError(f"write_record: models[{name!r}][0] must be an EncDecConfig")
        entries[name] = {
            "model": dataclasses.asdict(config),
            "train": dataclasses.asdict(train),
            "checkpoint": f"checkpoints/{name}",
        }
    record = {
        "format": dataclasses.asdict(fmt),
        "models": entries,
        "kinds": None if kinds is None else list(kinds),
        "tokens": {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID, "vocab_size": fmt.vocab_size},
    }
    path = Path(folder) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_record(folder: str | os.PathLike) -> dict[str, Any]:
    """``folder/cot.json`` as :func:`write_record` wrote it; ``FileNotFoundError`` when the
    folder holds none, ``ValueError`` when it cannot be read.

    Example (a round trip through :func:`write_record`):
      >>> import tempfile
      >>> from sparse_jax.models.encdec import EncDecConfig
      >>> from sparse_jax.training.loop import TrainConfig
      >>> tmp = tempfile.TemporaryDirectory()
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16)
      >>> _ = write_record(tmp.name, CotFormat(96, 64), {"sparse": (cfg, TrainConfig(steps=10))})
      >>> record = read_record(tmp.name)
      >>> CotFormat(**record["format"]), record["models"]["sparse"]["checkpoint"]
      (CotFormat(source_len=96, target_len=64, numbers=0), 'checkpoints/sparse')
      >>> EncDecConfig(**record["models"]["sparse"]["model"]) == cfg
      True
      >>> read_record(Path(tmp.name) / "elsewhere")
      Traceback (most recent call last):
      ...
      FileNotFoundError: .../elsewhere is not a chain-of-thought run folder: it has no cot.json ...
      >>> tmp.cleanup()
    """
    path = Path(folder) / RECORD
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a chain-of-thought run folder: it has no {RECORD} (python -m "
            f"experiments.cot train --run.dir {folder} makes one)"
        )
    try:
        record = json.loads(path.read_text())
        tokens = record["tokens"]
        if (tokens["bos"], tokens["eos"], tokens["pad"]) != (BOS_ID, EOS_ID, PAD_ID):
            raise ValueError(f"its special tokens {tokens} are not this version's")
        for name, entry in record["models"].items():
            missing = {"model", "train", "checkpoint"} - set(entry)
            if missing:
                raise ValueError(f"model {name!r} lacks {sorted(missing)}")
        CotFormat(**record["format"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} cannot be read as a chain-of-thought run record: {err}") from err
    return record
