"""Training batches that mix plain text with recall sequences, for a model that must retrieve.

A :class:`RecallMixture` yields, per update, an int32 array ``[B, 2, T + 1]``: row 0 of each
sequence is its ids (inputs ``[:-1]``, next-token targets ``[1:]``), row 1 marks with 1 the ids
that are a recall answer (0 elsewhere), so that a loss can weight the answers (e.g.
:func:`~sparse_jax.training.losses.cross_entropy_loss` with ``mask=batch[:, 1, 1:] == 1``). The
first ``round(B * recall_fraction)`` sequences of a batch are
recall sequences, the rest windows of the text stream.

**Where the answer stands varies**: a recall sequence is an example of :func:`make_examples`
``T + 1 - r`` tokens long followed by ``r`` tokens of text, ``r`` drawn uniformly in ``[0, T +
1 - m]`` (``m`` the example's shortest length), so that its answer ends anywhere from ``m`` to
``T + 1`` tokens in. With learned positions, a model trained on answers at one place learns a
circuit bound to that place; this spreads the answers over the positions the model will be
asked at.

**Lengths** are cycled per update (``lengths[step % len(lengths)]``) with ``tokens // T``
sequences each, so that every update costs about the same and each length compiles once.

Deterministic: update ``g`` depends only on ``(seed, g)`` and the arguments, so :meth:`state`
is just the next update's index and a resumed run sees the batches it would have seen.

Example (bytes, the embedded corpus, half recall sequences of 128 tokens):

>>> mix = RecallMixture("byte", lengths=(128,), tokens=512, recall_fraction=0.5, seed=0)
>>> batch = next(mix)
>>> batch.shape, batch.dtype  # [B, 2, T + 1]: ids, then the answer marks
((4, 2, 129), dtype('int32'))
>>> batch[:, 1].sum(axis=1).tolist()  # two recall sequences: a space and 5 digits each
[6, 6, 0, 0]
>>> bytes(batch[0, 0][batch[0, 1] == 1].tolist())  # the answer of the first
b' 91363'
>>> again = RecallMixture.from_state("byte", mix.state(), lengths=(128,), tokens=512,
...                                  recall_fraction=0.5, seed=0)
>>> bool((next(again) == next(mix)).all())  # a resumed stream goes on alike
True
"""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sparse_jax.data.recall.generator import (
    MQARTask,
    PasskeyTask,
    as_filler,
    as_task,
    make_examples,
)
from sparse_jax.data.recall.sources import Filler, as_tokenizer, default_filler
from sparse_jax.data.text import TextSource
from sparse_jax.data.tokenizers import Tokenizer
from sparse_jax.validation import check_int

__all__ = ["RecallMixture", "shortest_length"]


class RecallMixture:
    """Deterministic, resumable batches of text and recall sequences (see the module docstring).

    Args:
      tokenizer: a :class:`~sparse_jax.data.tokenizers.Tokenizer` or a name (``"byte"``,
        ``"gpt2"``, a folder).
      filler: the text, for the windows and inside the recall sequences: a :class:`Filler` of
        ``tokenizer`` (e.g. :func:`~sparse_jax.data.recall.make_filler` of a corpus's train
        split), text, a :class:`~sparse_jax.data.text.TextSource`, or None (the embedded
        corpus's train split).
      lengths: ``T`` of the updates, cycled (each ``>=`` what a recall example needs).
      tokens: tokens per update: ``B = max(1, tokens // T)`` sequences of ``T + 1`` ids.
      recall_fraction: the share of recall sequences in a batch, in ``[0, 1]``.
      task: ``"passkey"``, ``"mqar"``, or a :class:`PasskeyTask` / :class:`MQARTask`.
      seed: the stream of batches (``>= 0``).
      start_step: the first update's index (:meth:`from_state` sets it).
      process_index, process_count: this process's rows ``p * b : (p + 1) * b`` of each global
        batch of ``B`` rows (``b = B // process_count``; ``B`` must divide evenly).

    Raises ``ValueError``/``TypeError`` naming the argument before any batch is made: a length
    shorter than the task's sequences need, a fraction outside ``[0, 1]``, a count below 1.

    Example (lengths 128 and 256 cycled at 1,024 tokens an update):

    >>> mix = RecallMixture("byte", lengths=(128, 256), tokens=1024, recall_fraction=0.25)
    >>> [next(mix).shape for _ in range(3)], mix.state()  # [B, 2, T + 1] per update
    ([(8, 2, 129), (4, 2, 257), (8, 2, 129)], {'step': 3})
    >>> RecallMixture("byte", lengths=(64,), tokens=64, recall_fraction=1.0)
    Traceback (most recent call last):
    ...
    ValueError: make_examples: `length` must be at least 80 ...
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike = "byte",
        filler: Filler | str | TextSource | None = None,
        *,
        lengths: Sequence[int],
        tokens: int,
        recall_fraction: float,
        task: str | PasskeyTask | MQARTask = "passkey",
        seed: int = 0,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        caller = "RecallMixture"
        self.task = as_task(task, caller)
        self.tokenizer = as_tokenizer(tokenizer, caller)
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
            raise TypeError(f"{caller}: `lengths` must be a non-empty sequence of ints; got "
                            f"{lengths!r:.80}")  # fmt: skip
        self.lengths = tuple(check_int(n, "lengths", caller, low=2) for n in lengths)
        self.tokens = check_int(tokens, "tokens", caller)
        fraction = recall_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
            raise TypeError(f"{caller}: `recall_fraction` must be a float in [0, 1]; got "
                            f"{fraction!r}")  # fmt: skip
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(
                f"{caller}: `recall_fraction` must be a float in [0, 1]; got {fraction!r}"
            )
        self.recall_fraction = float(fraction)
        self.seed = check_int(seed, "seed", caller, low=0)
        self.step = check_int(start_step, "start_step", caller, low=0)
        self.process_count = check_int(process_count, "process_count", caller)
        self.process_index = check_int(
            process_index, "process_index", caller, low=0, high=self.process_count - 1
        )
        for t in self.lengths:
            rows = self.rows(t)
            if rows % self.process_count:
                raise ValueError(
                    f"{caller}: `tokens` // {t} = {rows} sequences cannot be split evenly over "
                    f"`process_count`={self.process_count} processes"
                )
            if self.recall_rows(t):  # a recall example must fit: make_examples says so by name
                make_examples(self.task, self.tokenizer, "x", length=t + 1, count=1, seed=0)
        if filler is None:
            filler = default_filler(self.tokenizer)
        elif not isinstance(filler, Filler):
            filler = as_filler(filler, self.tokenizer)
        self.filler = filler

    @classmethod
    def from_state(
        cls, tokenizer, state: Mapping[str, Any], filler=None, **kwargs
    ) -> RecallMixture:
        """Continues at ``state["step"]`` (from :meth:`state`); other arguments as the original."""
        return cls(tokenizer, filler, start_step=state["step"], **kwargs)

    def state(self) -> dict[str, int]:
        """The next update's index (JSON-serializable)."""
        return {"step": self.step}

    def rows(self, length: int) -> int:
        """Sequences of an update of ``length`` tokens (all processes)."""
        return max(1, self.tokens // length)

    def recall_rows(self, length: int) -> int:
        """Recall sequences among them."""
        return round(self.rows(length) * self.recall_fraction)

    def batch(self, step: int) -> np.ndarray:
        """Update ``step``'s global batch, int32 ``[B, 2, T + 1]`` (all processes' rows)."""
        t = self.lengths[step % len(self.lengths)]
        rows, recall_rows = self.rows(t), self.recall_rows(t)
        rng = np.random.default_rng([self.seed, step])
        out = np.zeros((rows, 2, t + 1), np.int32)
        stream = self.filler.ids
        starts = rng.integers(0, len(stream), rows)
        for i, start in enumerate(starts):  # text windows, read cyclically
            out[i, 0] = np.take(stream, np.arange(start, start + t + 1), mode="wrap")
        if recall_rows:
            shortest = shortest_length(self.task, self.tokenizer)
            tails = rng.integers(0, t + 2 - shortest, recall_rows)
            for i, tail in enumerate(tails):
                seed = int(rng.integers(0, 2**31 - 1))
                try:
                    example = make_examples(
                        self.task,
                        self.tokenizer,
                        self.filler,
                        length=t + 1 - int(tail),
                        count=1,
                        seed=seed,
                    )
                except ValueError:  # this example's pieces are longer: no text after it
                    example = make_examples(self.task, self.tokenizer, self.filler,
                                            length=t + 1, count=1, seed=seed)  # fmt: skip
                n = example.ids.shape[1]
                out[i, 0, :n] = example.ids[0]  # the text window's start stays after it
                for start, size in zip(example.answer_start[0], example.answer_len[0], strict=True):
                    if size > 0:
                        out[i, 1, start : start + size] = 1
        return out

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        full = self.batch(self.step)
        self.step += 1
        b = full.shape[0] // self.process_count
        return full[self.process_index * b : (self.process_index + 1) * b]


def shortest_length(
    task: str | PasskeyTask | MQARTask = "passkey",
    tokenizer: Tokenizer | str | os.PathLike = "byte",
    examples: int = 16,
) -> int:
    """The fewest tokens that hold the pieces (statements, questions, answers) of the first
    ``examples`` examples of ``task`` (seed 0), so that :func:`make_examples` accepts any length
    from it on for them; found by doubling then bisection, and kept per arguments.

    Example:
      >>> shortest_length("passkey", "byte")  # the statement, question and answer of a 5-digit key
      80
    """
    spec = as_task(task, "shortest_length")
    tok = as_tokenizer(tokenizer, "shortest_length")
    return _shortest(spec, tok, check_int(examples, "examples", "shortest_length"))


@functools.lru_cache(maxsize=64)
def _shortest(task, tokenizer, examples: int) -> int:
    def fits(length: int) -> bool:  # make_examples refuses a length its pieces do not fit in
        try:
            make_examples(task, tokenizer, "x", length=length, count=examples, seed=0)
        except ValueError:
            return False
        return True

    # Double up to the first length that fits, then bisect below it: a bisection from 2**20
    # would build examples of hundreds of thousands of tokens on the way down.
    lo, hi = 2, 2
    while hi < 1 << 20 and not fits(hi):
        lo, hi = hi + 1, min(2 * hi, 1 << 20)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
