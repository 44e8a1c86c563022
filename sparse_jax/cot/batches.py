"""Problems as training batches: :func:`fit_format` sizes a :class:`~.format.CotFormat` to them,
:func:`pack` writes them as rows ``[N, S + T + 1]`` (the question, then ``BOS``, the solution and
``EOS``), :func:`length_buckets` groups them by length so that a batch is padded only to its
own longest, :func:`split_rows` takes a batch of rows apart again (:class:`Batch`) and
:func:`loss_fn` is the trainer's loss of a batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.cot.format import (
    BOS_ID,
    PAD_ID,
    CotFormat,
    encode_question,
    encode_solution,
    round_up,
)
from sparse_jax.data import linalg_cot
from sparse_jax.models.encdec import EncoderDecoder, sequence_loss
from sparse_jax.validation import check_int

__all__ = [
    "Batch",
    "fit_format",
    "length_buckets",
    "loss_fn",
    "pack",
    "source_lengths",
    "split_rows",
]


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
        check_problem(p, "fit_format")
        s = max(s, encode_question(p.question, sizing).size)
        t = max(t, encode_solution(p.solution_text(), sizing).size)
    if not s:
        raise ValueError("fit_format: `problems` is empty (nothing to size the format by)")
    return CotFormat(round_up(s, multiple), round_up(t, multiple), numbers)


def check_problem(p: Any, caller: str) -> linalg_cot.Problem:
    """``p`` when it is a :class:`~sparse_jax.data.linalg_cot.Problem`; a ``TypeError`` naming
    ``caller`` otherwise.

    Example:
      >>> check_problem("What is rref(A)?", "pack")
      Traceback (most recent call last):
      ...
      TypeError: pack: problems must be linalg_cot.Problem; got str
    """
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
      >>> from sparse_jax.cot import decode_tokens
      >>> decode_tokens(rows[0, 25:])[0] == p.solution_text()
      True
    """
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"pack: `fmt` must be a CotFormat; got {type(fmt).__name__}")
    problems = [check_problem(p, "pack") for p in problems]
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
    problems = [check_problem(p, "length_buckets") for p in problems]
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
        return sorted({round_up(int(e), multiple) for e in edges})

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
        s, x = round_up(int(q[idx].max()), multiple), round_up(int(t[idx].max()), multiple)
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
      >>> from sparse_jax.cot import EOS_ID
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

      >>> import functools
      >>> from flax import nnx
      >>> from sparse_jax.cot import VOCAB_SIZE
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
