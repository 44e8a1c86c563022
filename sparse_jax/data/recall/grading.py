"""Grading recall by exact match of the greedy answer: one continuation (:func:`grade`), a
batch of them (:func:`grade_batch`), the continuations a teacher-forced pass predicts
(:func:`continuations_from_argmax`) and accuracy per (length, depth) (:func:`score`).

The rule: a continuation (what a model writes after the prompt of one query) is right when its
first ``len(answer)`` tokens are the answer's ids (or, as text, when it starts with the answer's
text, leading space included). What follows the answer is ignored (a model asked for more tokens
than the answer has is not penalised for them); a continuation shorter than the answer, or
different in any of its tokens, is wrong; an id that is no token (-1 padding, a negative or
out-of-range id) never matches, and text with undecodable bytes (U+FFFD) does not match.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparse_jax.data.recall.generator import RecallBatch, RecallExample
from sparse_jax.validation import check_int

__all__ = ["continuations_from_argmax", "grade", "grade_batch", "score"]


def _as_ids(predicted: object, caller: str, name: str) -> np.ndarray:
    arr = np.asarray(predicted)
    if arr.size == 0:  # empty continuations: any shape, no dtype to check
        return np.zeros(arr.shape, np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{caller}: `{name}` must be text (str) or token ids (ints); got dtype {arr.dtype}"
        )
    return arr.astype(np.int64)


def grade(
    predicted: str | Sequence[int] | np.ndarray, example: RecallExample, query: int = 0
) -> bool:
    """Whether ``predicted``, a model's continuation of ``example.prompt(query)``, is the answer.

    ``predicted`` is token ids (a list or 1-D int array, any length) or text. Right: its first
    ``len(example.answer[query])`` ids are the answer's (text: it starts with
    ``example.answer_text[query]``); anything after the answer is ignored. A partial answer,
    a wrong token or an invalid id is wrong.

    Example:

    >>> from sparse_jax.data.recall import make_examples
    >>> batch = make_examples("passkey", "byte", "one two three four", length=100, count=1)
    >>> example = batch[0]
    >>> example.answer_text
    (' 86556',)
    >>> answer = list(example.answer[0])
    >>> grade(answer, example), grade(answer + [46, 10], example)  # extra tokens are ignored
    (True, True)
    >>> grade(answer[:3], example), grade([32, 56, 54, 53, 53, 55], example)  # partial, wrong
    (False, False)
    >>> grade(" 86556.", example), grade("86556", example), grade(" 86\\ufffd56", example)
    (True, False, False)
    """
    caller = "grade"
    if not isinstance(example, RecallExample):
        raise TypeError(
            f"{caller}: `example` must be a RecallExample (batch[i]); got {type(example).__name__}"
        )
    query = check_int(query, "query", caller, low=0, high=len(example.answer) - 1)
    if isinstance(predicted, str):
        return predicted.startswith(example.answer_text[query])
    if isinstance(predicted, bytes):
        raise TypeError(f"{caller}: `predicted` must be text (str) or token ids; got bytes")
    ids = _as_ids(predicted, caller, "predicted")
    if ids.ndim != 1:
        raise ValueError(f"{caller}: `predicted` must be 1-D token ids; got shape {ids.shape}")
    answer = example.answer[query]
    return len(ids) >= len(answer) and ids[: len(answer)].tolist() == list(answer)


def _texts(continuations: Sequence, n: int, q: int, caller: str) -> list[tuple[str, ...]]:
    rows = []
    for i, row in enumerate(continuations):
        row = (row,) if isinstance(row, str) else tuple(row)
        if len(row) != q or not all(isinstance(t, str) for t in row):
            raise ValueError(
                f"{caller}: `continuations` as text must hold one str per example (one query) "
                f"or {q} per example; row {i} is {row!r:.80}"
            )
        rows.append(row)
    if len(rows) != n:
        raise ValueError(f"{caller}: `continuations` must hold {n} rows (one per example)")
    return rows


def grade_batch(
    batch: RecallBatch, continuations: np.ndarray | Sequence[str] | Sequence[Sequence[str]]
) -> np.ndarray:
    """:func:`grade` of every query of every example: bool ``[N, Q]``.

    ``continuations``: ids int ``[N, Q, L]`` (``[N, L]`` when ``Q`` is 1), e.g. greedy
    continuations of ``L`` tokens or :func:`continuations_from_argmax`; or text: ``N`` strings
    (``Q`` = 1) or ``N`` sequences of ``Q`` strings.

    Example:

    >>> from sparse_jax.data.recall import make_examples
    >>> batch = make_examples("passkey", "byte", "one two three four", length=100, count=3)
    >>> guesses = batch.answer[:, 0].copy()  # [N, A]: the answers themselves
    >>> guesses[1, -1] += 1  # the last digit of example 1 wrong
    >>> grade_batch(batch, guesses).tolist()
    [[True], [False], [True]]
    >>> grade_batch(batch, [" 86556", "", " 12345"]).tolist()
    [[True], [False], [False]]
    """
    caller = "grade_batch"
    if not isinstance(batch, RecallBatch):
        raise TypeError(f"{caller}: `batch` must be a RecallBatch; got {type(batch).__name__}")
    n, q = len(batch), batch.num_queries
    if isinstance(continuations, Sequence) and any(
        isinstance(c, str) or (isinstance(c, Sequence) and c and isinstance(c[0], str))
        for c in continuations
    ):
        rows = _texts(continuations, n, q, caller)
        return np.asarray(
            [
                [row[j].startswith(batch.answer_text[i][j]) for j in range(q)]
                for i, row in enumerate(rows)
            ],
            bool,
        ).reshape(n, q)
    ids = _as_ids(continuations, caller, "continuations")
    if ids.ndim == 2 and q == 1:
        ids = ids[:, None, :]
    if ids.ndim != 3 or ids.shape[:2] != (n, q):
        raise ValueError(
            f"{caller}: `continuations` must be ids [N, Q, L] = [{n}, {q}, L]"
            + (f" or [N, L] = [{n}, L]" if q == 1 else "")
            + f"; got shape {np.shape(continuations)}"
        )
    width = batch.answer.shape[2]
    if ids.shape[2] < width:  # a continuation shorter than an answer: padded, never matches
        ids = np.concatenate([ids, np.full((n, q, width - ids.shape[2]), -1, np.int64)], axis=2)
    ids = ids[:, :, :width]
    inside = np.arange(width) < batch.answer_len[:, :, None]
    return np.all((ids == batch.answer) | ~inside, axis=2)


def continuations_from_argmax(batch: RecallBatch, argmax: np.ndarray) -> np.ndarray:
    """The answer tokens a model predicts in one teacher-forced pass: int32 ``[N, Q, A]``.

    ``argmax``: int ``[N, T - 1]`` (or ``[N, T]``, the last column unused), the argmax of the
    logits of a model reading ``batch.ids[:, :-1]``: ``argmax[n, t]`` is its prediction for
    ``ids[n, t + 1]``. Entry ``[n, q, j]`` is its prediction for answer token ``j`` of query
    ``q``, -1 past the answer. All of an answer's tokens are right in this pass exactly when
    greedy decoding from the prompt writes the answer (each greedy step then sees the same
    prefix), so :func:`grade_batch` of the result is the exact-match grade of greedy answers,
    from one forward pass.

    Example:

    >>> from sparse_jax.data.recall import make_examples
    >>> batch = make_examples("passkey", "byte", "one two three four", length=100, count=2)
    >>> perfect = batch.ids[:, 1:]  # a model that predicts every next token
    >>> continuations_from_argmax(batch, perfect)[:, 0].tolist() == batch.answer[:, 0].tolist()
    True
    >>> grade_batch(batch, continuations_from_argmax(batch, perfect)).tolist()
    [[True], [True]]
    """
    caller = "continuations_from_argmax"
    if not isinstance(batch, RecallBatch):
        raise TypeError(f"{caller}: `batch` must be a RecallBatch; got {type(batch).__name__}")
    pred = _as_ids(argmax, caller, "argmax")
    n, t = len(batch), batch.length
    if pred.ndim != 2 or pred.shape[0] != n or pred.shape[1] not in (t - 1, t):
        raise ValueError(
            f"{caller}: `argmax` must be [N, T - 1] = [{n}, {t - 1}] (or [N, T]); got shape "
            f"{np.shape(argmax)}"
        )
    width = batch.answer.shape[2]
    j = np.arange(width)
    cols = batch.answer_start[:, :, None].astype(np.int64) - 1 + j  # [N, Q, A]
    inside = j < batch.answer_len[:, :, None]
    rows = np.arange(n)[:, None, None]
    taken = pred[rows, np.where(inside, cols, 0)]
    return np.where(inside, taken, -1).astype(np.int32)


def score(
    batches: RecallBatch | Sequence[RecallBatch],
    continuations: np.ndarray | Sequence,
    *,
    depth_bins: int | None = None,
) -> dict[tuple[int, float], float]:
    """Accuracy of the greedy answers per ``(length, depth)``: ``{(T, depth): fraction right}``.

    ``batches``: a :class:`RecallBatch` or several (e.g. one per length), and ``continuations``
    the matching continuations (one array or list per batch, as :func:`grade_batch` takes).
    Every query of every example counts once. ``depth_bins``: None groups by the depths
    themselves (a grid given to :func:`make_examples`); ``k`` groups depths in ``k`` equal bins
    of ``[0, 1]``, each named by its centre (random depths, MQAR's scattered pairs). Keys are
    sorted; depths rounded to 6 decimals.

    Example (two depths at one length; example 1, at depth 0.9, answered wrong):

    >>> from sparse_jax.data.recall import make_examples
    >>> batch = make_examples("passkey", "byte", "one two three four", length=100, count=4,
    ...                       depths=(0.1, 0.9))
    >>> guesses = batch.answer[:, 0].copy()
    >>> guesses[1, 1] = 0
    >>> score(batch, guesses)
    {(100, 0.1): 1.0, (100, 0.9): 0.5}
    >>> score(batch, guesses, depth_bins=1)
    {(100, 0.5): 0.75}
    """
    caller = "score"
    if depth_bins is not None:
        depth_bins = check_int(depth_bins, "depth_bins", caller)
    if isinstance(batches, RecallBatch):
        batches, continuations = [batches], [continuations]
    if not isinstance(batches, Sequence) or not all(isinstance(b, RecallBatch) for b in batches):
        raise TypeError(f"{caller}: `batches` must be a RecallBatch or a sequence of them")
    if not isinstance(continuations, (Sequence, np.ndarray)) or len(continuations) != len(batches):
        raise ValueError(
            f"{caller}: `continuations` must hold one entry per batch ({len(batches)})"
        )
    right: dict[tuple[int, float], list[int]] = {}
    for batch, cont in zip(batches, continuations, strict=True):
        correct = grade_batch(batch, cont)
        depth = batch.depth.astype(np.float64)
        if depth_bins is not None:
            index = np.minimum(np.floor(depth * depth_bins), depth_bins - 1)
            depth = (index + 0.5) / depth_bins
        for d, ok in zip(depth.reshape(-1).tolist(), correct.reshape(-1).tolist(), strict=True):
            tally = right.setdefault((batch.length, round(d, 6)), [0, 0])
            tally[0] += int(ok)
            tally[1] += 1
    return {key: right[key][0] / right[key][1] for key in sorted(right)}
