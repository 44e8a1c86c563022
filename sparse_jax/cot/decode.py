"""Decoding with a trained model: :class:`GreedyDecoder` (greedy steps on the model's key/value
cache, ``chunk`` positions per compiled call) and :class:`Solver`, which answers questions as
:class:`Answer` and restores a trained model from a run folder (:meth:`Solver.load`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
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
from sparse_jax.cot.record import RECORD, generator_of, inside, read_record
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
    kind: str | None = None  # the question's kind as linalg_cot's parsers read it
    error: str | None = None  # why the question was not answered (None: it was decoded)


def _article(word: str) -> str:
    """The indefinite article before ``word`` (by its first letter: "an elimination")."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def _refusal(why: str, kind: str | None = None) -> Answer:
    text = f"Cannot answer: {why}"
    return Answer(text=text, final=None, steps=(), seconds=0.0, kind=kind, error=why)


def _from_record(cls, fields: Mapping[str, Any], path: Path, field: str):
    """``cls(**fields)``, a ``ValueError`` naming the record's file and field when refused."""
    try:
        return cls(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"Solver.load: {path}: `{field}` is not a {cls.__name__}: {err}") from None


def _check_links(folder: Path, directory: Path, field: str) -> None:
    """Refuses a symbolic link under ``directory`` that leads outside the run ``folder``."""
    root = folder.resolve()
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            entry = Path(parent) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(root):
                raise ValueError(
                    f"{field}: {entry} is a link to {entry.resolve()}, outside the run folder "
                    f"{root}: refused (a run folder only names files inside itself)"
                )


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"encoder/0/attn/q/kernel": shape}`` of a state's arrays (``value`` wrappers dropped)."""
    out = {}
    for keys, leaf in jax.tree_util.tree_leaves_with_path(tree):
        names = [_key_name(k) for k in keys]
        out["/".join(n for n in names if n != "value")] = tuple(getattr(leaf, "shape", ()))
    return out


def _model_shapes(config: EncDecConfig) -> dict[str, tuple[int, ...]]:
    abstract = nnx.eval_shape(lambda: EncoderDecoder(config, rngs=nnx.Rngs(0)))
    return _shapes(nnx.state(abstract))


def _saved_shapes(step_dir: Path) -> dict[str, tuple[int, ...]] | None:
    """The model state's shapes in a checkpoint's metadata (None: it cannot be read)."""
    try:
        with ocp.StandardCheckpointer() as reader:
            meta = reader.metadata(step_dir / "state")  # the Checkpointer's state item
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        return {**_shapes(tree["params"]), **_shapes(tree["rest"])}  # Trainer.state's split
    except Exception:  # unreadable: Checkpointer.restore skips it with a warning
        return None


def _culprit(config: EncDecConfig, saved, candidates) -> tuple[str, int, int] | None:
    """``(field, value, size)``: the first of ``candidates`` (``(field, sizes)`` pairs) whose
    size gives the model the ``saved`` shapes (None: no single field does)."""
    for name, sizes in candidates:
        value = getattr(config, name)
        for size in sorted(set(sizes) - {value}):
            try:
                other = dataclasses.replace(config, **{name: size})
            except (TypeError, ValueError):
                continue
            if _model_shapes(other) == saved:
                return name, value, size
    return None


_LAYER_FIELDS = ("encoder_layers", "decoder_layers", "cot_steps")  # change the parameters' tree


def _check_shapes(
    net: EncoderDecoder, config: EncDecConfig, directory: Path, steps, path: Path, field: str
) -> None:
    """Raises ``ValueError`` naming ``field``'s size that disagrees with the newest readable
    checkpoint's parameter shapes, with both shapes (before Orbax would refuse them without
    naming the config's field)."""
    for step in reversed(steps):
        saved = _saved_shapes(directory / str(step))
        if saved is not None:
            break
    else:
        return
    checkpoint = directory / str(step)
    want = _shapes(nnx.state(net))
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    wrong = [(k, want[k], saved[k]) for k in want if k in saved and want[k] != saved[k]]
    if missing or extra:
        candidates = [(name, range(13)) for name in _LAYER_FIELDS]
        parts = [f"the config has parameters it lacks: {missing[:3]}"] if missing else []
        parts += [f"it has parameters the config lacks: {extra[:3]}"] if extra else []
        what = f"checkpoint {checkpoint}: " + "; ".join(parts)
    elif wrong:
        name, config_shape, saved_shape = wrong[0]
        candidates = []
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if type(value) is int and f.name != "seed":
                sizes = {
                    s for _, w, got in wrong for c, s in zip(w, got, strict=False) if c == value
                }
                candidates.append((f.name, sizes))
        what = (
            f"parameter {name} has shape {saved_shape} in checkpoint {checkpoint} and "
            f"{config_shape} under the record's config ({len(wrong)} parameters differ)"
        )
    else:
        return
    culprit = _culprit(config, saved, candidates)
    if culprit is None:
        raise ValueError(f"Solver.load: {path}: `{field}` does not match the checkpoint: {what}")
    name, value, size = culprit
    raise ValueError(
        f"Solver.load: {path}: `{field}.{name}`={value} does not match the checkpoint, trained "
        f"with {name}={size}: {what}"
    )


def _beyond(q: linalg_cot.ParsedQuestion, gen: linalg_cot.GeneratorConfig) -> str | None:
    """Why question ``q`` is larger than the problems ``gen`` makes (None: it is not): its
    matrix, its m and n, its unknowns, its elimination steps; not its entries' values."""
    trained = f"this model was trained on {q.kind} questions"
    if q.kind in ("rref", "nullspace", "column_space", "elimination", "column_space_basis"):
        matrix = q.R if q.kind == "elimination" else q.A
        rows, cols = len(matrix), len(matrix[0]) if matrix else 0
        if q.kind == "rref" and q.block is not None:
            if gen.block_rate == 0:
                return f"{trained} without block matrices; this one asks about one"
            rows, cols = rows * len(q.block), cols * len(q.block[0])
        # column_space_basis draws its matrices at the nullspace questions' sizes.
        shape = "nullspace" if q.kind == "column_space_basis" else q.kind
        limit = getattr(gen, f"{shape}_shape")
        if rows > limit[0] or cols > limit[1]:
            return (
                f"{trained} of matrices up to {limit[0]} x {limit[1]}; this one is {rows} x {cols}"
            )
        if q.kind == "elimination" and len(q.operations) > gen.elimination_ops:
            return (
                f"{trained} of up to {gen.elimination_ops} elimination steps; this one has "
                f"{len(q.operations)}"
            )
    elif q.kind in ("solvability", "subspaces"):
        if max(q.rows, q.cols) > gen.solvability_dim:
            return (
                f"{trained} of m and n up to {gen.solvability_dim}; this one has m = {q.rows}, "
                f"n = {q.cols}"
            )
    elif q.kind == "complete_solution":
        if len(q.x_p) != gen.unknowns:
            return f"{trained} of {gen.unknowns} unknowns; this one has {len(q.x_p)}"
    return None


class Solver:
    """Answers linear-algebra questions with a trained encoder–decoder (greedy decoding; never
    :func:`~sparse_jax.data.linalg_cot.solve`).

    A question is decoded only when :func:`~sparse_jax.data.linalg_cot.parse_question` reads
    it (or, for a model trained on a kind answered in words, ``linalg_cot.DESCRIPTIVE_KINDS``,
    :func:`~sparse_jax.data.linalg_cot.parse_descriptive` reads it as that kind) and its
    tokens fit ``fmt.source_len``; otherwise its :class:`Answer` says why (a non-str question
    raises ``TypeError``).

    Args:
      model: the trained :class:`~sparse_jax.models.encdec.EncoderDecoder`.
      fmt: the :class:`CotFormat` it was trained with (``target_len`` bounds the decoding).
      name: a label (e.g. ``"sparse"``).
      batch_size: questions decoded together by :meth:`answer_batch`.
      chunk: positions per compiled decoding call (:class:`GreedyDecoder`).
      kinds: the kinds it was trained on: a question of another kind is not decoded, its
        answer says why (None: unknown, every kind is decoded).
      generator: the sizes of the problems it was trained on (the training data's
        ``GeneratorConfig``): a larger question (a larger matrix, more unknowns...) is not
        decoded, its answer says why (None: unknown, not checked).
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
        generator: linalg_cot.GeneratorConfig | None = None,
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
        every = linalg_cot.KINDS + linalg_cot.DESCRIPTIVE_KINDS
        if kinds is not None and (
            isinstance(kinds, str) or not set(kinds) <= set(every) or not kinds
        ):
            raise ValueError(
                f"Solver: `kinds` must be None or kinds of {list(every)}; got {kinds!r}"
            )
        if generator is not None and not isinstance(generator, linalg_cot.GeneratorConfig):
            raise TypeError(
                f"Solver: `generator` must be a GeneratorConfig or None; got "
                f"{type(generator).__name__}"
            )
        self.kinds = None if kinds is None else tuple(kinds)
        self.generator = generator
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
        trained in ``run_folder``, restored from its Orbax checkpoint, with the kinds and sizes
        of questions it was trained on (:data:`RECORD`; questions beyond them are refused).

        A run folder may come from elsewhere: every path read from it must resolve inside it
        (symbolic links included), and what it holds is checked before it is used. A
        checkpoint that cannot be read is skipped for the newest readable earlier one, with a
        :class:`~sparse_jax.training.checkpoint.CorruptCheckpointWarning` naming it (the
        training's own mechanism, except that nothing in the folder is moved or written); that
        one may be from before the end of training (``partial`` is not asked then: the final
        checkpoint exists, it is damaged), and ``Solver.step`` says which step answers.

        Raises:
          FileNotFoundError: the folder has no :data:`RECORD` (not a run folder) or no
            checkpoint of that model (it was never trained).
          ValueError: ``model`` is not one of the run's models; its latest checkpoint is
            from before the end of its training (``partial=True`` loads it anyway; not while
            that training runs: opening its checkpoints removes unfinished writes);
            :data:`RECORD` cannot be read (naming the file and what is wrong), names a path
            outside the folder, or describes a model whose parameter shapes differ from the
            checkpoint's (naming the field and both shapes); the checkpoint restored holds NaN
            or infinite weights
            (:class:`~sparse_jax.training.checkpoint.NonFiniteCheckpointError`, naming its
            path, step and the first such parameter), which would answer with junk.
          NoReadableCheckpointError: no checkpoint of the model can be read (a
            :class:`~sparse_jax.training.checkpoint.CheckpointError`, naming each step and why).
        """
        partial = check_bool(partial, "partial", "Solver.load")
        folder = Path(run_folder)
        record = read_record(folder)
        path = folder / RECORD
        if model not in record["models"]:
            raise ValueError(
                f"Solver.load: `model`={model!r} is not a model of {folder}; allowed: "
                f"{sorted(record['models'])}"
            )
        entry, field = record["models"][model], f"models.{model}"
        config = _from_record(EncDecConfig, entry["model"], path, f"{field}.model")
        train = _from_record(TrainConfig, entry["train"], path, f"{field}.train")
        fmt = CotFormat(**record["format"])  # checked by read_record
        generator = generator_of(record)  # checked by read_record
        directory = inside(folder, entry["checkpoint"], f"Solver.load: {path}: {field}.checkpoint")
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
        _check_links(folder, directory, f"Solver.load: {path}: {field}.checkpoint")

        # Checked before the checkpoints are opened (opening them clears unfinished writes,
        # which may be a running training's).
        if steps[-1] < train.steps and not partial:
            raise ValueError(
                f"Solver.load: the {model!r} model of {folder} is trained to step {steps[-1]} "
                f"of {train.steps} only (an interrupted run: continue it with python -m "
                f"experiments.cot train --run.dir {folder} --run.resume, or pass partial=True)"
            )
        net = EncoderDecoder(config, rngs=nnx.Rngs(0))
        _check_shapes(net, config, directory, steps, path, f"{field}.model")
        loss = functools.partial(loss_fn, source_len=fmt.source_len)
        with Checkpointer(directory, save_every=max(train.steps, 1)) as ckpt:
            trainer = Trainer(net, loss, train, checkpointer=ckpt)
            # The latest readable checkpoint (the others: a warning); the folder is left as it
            # is (it may be read-only, or another person's).
            trainer.restore(quarantine=False)
        return cls(
            trainer.sync_model(),
            fmt,
            name=model,
            batch_size=batch_size,
            chunk=chunk,
            kinds=record.get("kinds"),
            generator=generator,
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
            parsed = linalg_cot.parse_question(text)
        except ValueError as err:
            # A question answered in words: read only by a model trained on its kind (the
            # refusal below names it); neither reading: the computable parser's reason.
            try:
                parsed = linalg_cot.parse_descriptive(text)
            except ValueError:
                return None, _refusal(str(err))
        kind = parsed.kind
        words = kind in linalg_cot.DESCRIPTIVE_KINDS  # read only by a model trained on it
        if (self.kinds is not None or words) and kind not in (self.kinds or ()):
            trained = (
                f"was trained on {', '.join(self.kinds)} questions only"
                if self.kinds
                else "was not trained on questions answered in words"
            )
            why = f"this model {trained}; this is {_article(kind)} {kind} question"
            return None, _refusal(why, kind)
        why = None if self.generator is None else _beyond(parsed, self.generator)
        if why is not None:
            return None, _refusal(why, kind)
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
