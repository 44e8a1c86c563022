"""Decoding with a trained model: :class:`GreedyDecoder` (greedy steps on the model's key/value
cache, ``chunk`` positions per compiled call) and :class:`Solver`, which answers questions as
:class:`Answer` and restores a trained model from a run folder (:meth:`Solver.load`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.cot.batches import loss_fn
from sparse_jax.cot.format import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    CotFormat,
    decode_tokens,
    encode_question,
    round_up,
)
from sparse_jax.cot.record import read_record
from sparse_jax.data import linalg_cot
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
from sparse_jax.training.checkpoint import Checkpointer
from sparse_jax.training.loop import TrainConfig, Trainer
from sparse_jax.validation import check_bool, check_int

__all__ = ["Answer", "GreedyDecoder", "Solver"]


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
      >>> from sparse_jax.cot import VOCAB_SIZE
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
        self._cache_len = round_up(self.max_len, self.chunk)
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
      >>> from sparse_jax.cot import VOCAB_SIZE
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

    def decode(self, questions: Sequence[Any], batch_size: int, repeats: int = 1):
        """``[(answer, token ids or None)]`` of ``questions``, in order, ``batch_size`` at a time
        (the ids decoded up to and including EOS; None for a question not decoded); each batch
        decoded ``repeats`` times, its time the median (the tokens are the same each time):
        what :meth:`answer_batch` and :func:`~sparse_jax.cot.evaluate` read."""
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
        return self.decode([question], 1)[0][0]

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
        return [answer for answer, _ in self.decode(list(questions), size)]

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
