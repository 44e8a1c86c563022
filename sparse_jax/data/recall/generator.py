"""The two recall tasks (:class:`PasskeyTask`, :class:`MQARTask`) and :func:`make_examples`,
which builds ``count`` examples of one task at one exact token length as a :class:`RecallBatch`.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np

from sparse_jax.data.recall.sources import (
    Filler,
    as_tokenizer,
    default_filler,
    make_filler,
    tokenizer_fingerprint,
)
from sparse_jax.data.text.corpora import TextSource
from sparse_jax.data.tokenizers import Tokenizer
from sparse_jax.validation import check_choice, check_int

__all__ = [
    "DEFAULT_KEYS",
    "DEFAULT_VALUES",
    "LAYOUTS",
    "MAX_TRIES",
    "TASKS",
    "MQARTask",
    "PasskeyTask",
    "RecallBatch",
    "RecallExample",
    "make_examples",
]

TASKS = ("passkey", "mqar")
LAYOUTS = ("scattered", "dense")
# Windows of filler drawn per example before giving up on one free of the example's keys.
MAX_TRIES = 256

# MQAR's default vocabularies: two consonants (400 keys that are rarely words), 3-digit numbers.
_CONSONANTS = "bcdfghjklmnpqrstvwxz"
DEFAULT_KEYS = tuple(a + b for a in _CONSONANTS for b in _CONSONANTS)
DEFAULT_VALUES = tuple(str(v) for v in range(100, 1000))

# The texts of the tasks. Every piece starts with a space or a comma and ends with a word or a
# full stop, so that filler (whose units start with whitespace) joins them as text would.
PASSKEY_STATEMENT = " The pass key is {key}. Remember it."
PASSKEY_QUESTION = " What is the pass key? The pass key is"
MQAR_PAIR = " {key}: {value}."
MQAR_FIRST_QUERY = " Recall: {key}:"
MQAR_QUERY = ", {key}:"
ANSWER = " {value}"

_WORD = re.compile(r"[A-Za-z0-9_]+")
_NOT_WORD = "A-Za-z0-9_"


# --------------------------------------------------------------------------------------------
# The tasks.


@dataclass(frozen=True)
class PasskeyTask:
    """A key of ``digits`` decimal digits (no leading zero) stated once inside filler, asked
    for at the end; the answer is ``" " + key``.

    The sequence is ``filler[:b] + " The pass key is 48213. Remember it." + filler[b:] +
    " What is the pass key? The pass key is" + " 48213"``, ``b`` the unit boundary of the filler
    nearest to ``depth * len(filler)``.

    Example:

    >>> PasskeyTask(digits=3)
    PasskeyTask(digits=3)
    >>> PasskeyTask(digits=0)
    Traceback (most recent call last):
    ...
    ValueError: PasskeyTask: `digits` must be an int in [1, 18]; got 0
    """

    digits: int = 5
    name: ClassVar[str] = "passkey"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "digits", check_int(self.digits, "digits", "PasskeyTask", low=1, high=18)
        )


@dataclass(frozen=True)
class MQARTask:
    """Multi-query associative recall: ``num_pairs`` key-value pairs (``" kx: 371."``), then
    ``num_queries`` of them asked for (``" Recall: kx: 371, mb: 802"``); the answers are the
    values (``" 371"``, ``" 802"``), each right after its ``"key:"``.

    Keys and values of one example are distinct, drawn from ``keys`` and ``values`` (words of
    ASCII letters, digits and ``_``); the queried pairs are drawn without replacement, in random
    order. ``layout="scattered"`` puts each pair at its own uniformly drawn depth in the filler;
    ``"dense"`` puts them all together, as a list, at one depth.

    Example:

    >>> task = MQARTask(num_pairs=4, num_queries=2, keys=("ab", "cd", "ef", "gh"))
    >>> task.num_pairs, task.keys, len(task.values), task.layout
    (4, ('ab', 'cd', 'ef', 'gh'), 900, 'scattered')
    >>> MQARTask(num_pairs=2, num_queries=3)
    Traceback (most recent call last):
    ...
    ValueError: MQARTask: `num_queries` must be at most `num_pairs` (2); got 3
    """

    num_pairs: int = 8
    num_queries: int = 4
    keys: tuple[str, ...] = field(default=DEFAULT_KEYS, repr=False)
    values: tuple[str, ...] = field(default=DEFAULT_VALUES, repr=False)
    layout: str = "scattered"
    name: ClassVar[str] = "mqar"

    def __post_init__(self) -> None:
        caller = "MQARTask"
        pairs = check_int(self.num_pairs, "num_pairs", caller)
        queries = check_int(self.num_queries, "num_queries", caller)
        if queries > pairs:
            raise ValueError(
                f"{caller}: `num_queries` must be at most `num_pairs` ({pairs}); got {queries}"
            )
        object.__setattr__(self, "num_pairs", pairs)
        object.__setattr__(self, "num_queries", queries)
        for name in ("keys", "values"):
            words = _check_words(getattr(self, name), name, caller)
            if len(words) < pairs:
                raise ValueError(
                    f"{caller}: `{name}` must hold at least `num_pairs` ({pairs}) words; got "
                    f"{len(words)}"
                )
            object.__setattr__(self, name, words)
        check_choice(self.layout, "layout", LAYOUTS, caller)


def _check_words(words: object, name: str, caller: str) -> tuple[str, ...]:
    if isinstance(words, (str, bytes)) or not isinstance(words, Sequence):
        raise TypeError(
            f"{caller}: `{name}` must be a sequence of words (str); got {type(words).__name__}"
        )
    for i, word in enumerate(words):
        if not isinstance(word, str) or not _WORD.fullmatch(word):
            raise ValueError(
                f"{caller}: `{name}` must be words of ASCII letters, digits and '_'; got "
                f"{word!r} at index {i}"
            )
    if len(set(words)) != len(words):
        repeated = next(w for w in words if list(words).count(w) > 1)
        raise ValueError(f"{caller}: `{name}` must be distinct; {repeated!r} repeats")
    return tuple(words)


def as_task(task: object, caller: str) -> PasskeyTask | MQARTask:
    """A task by name (its defaults) or the task itself (package-internal)."""
    if isinstance(task, (PasskeyTask, MQARTask)):
        return task
    if not isinstance(task, str):
        raise TypeError(
            f"{caller}: `task` must be one of {TASKS}, a PasskeyTask or an MQARTask; got "
            f"{type(task).__name__}"
        )
    name = check_choice(task, "task", TASKS, caller)
    return PasskeyTask() if name == "passkey" else MQARTask()


# --------------------------------------------------------------------------------------------
# The examples.


@dataclass(frozen=True, eq=False)
class RecallExample:
    """One example of a :class:`RecallBatch` (``batch[i]``), with ``Q`` queries (1 for passkey).

    ``ids`` is int32 ``[T]``, prompt and answers; query ``q``'s answer is
    ``ids[answer_start[q]:answer_start[q] + len(answer[q])]`` and its prompt
    ``ids[:answer_start[q]]`` (:meth:`prompt`).

    Example:

    >>> batch = make_examples("passkey", "byte", "one two three four five six", length=100,
    ...                       count=2)
    >>> example = batch[1]
    >>> example.key, example.answer_text, example.prompt_len + len(example.answer[0])
    (('56994',), (' 56994',), 100)
    >>> bytes(example.prompt().tolist())[-16:]
    b' The pass key is'
    """

    task: str
    tokenizer: str
    # Prompt and answers: int32 [T].
    ids: np.ndarray
    # Per query: the first answer token's index, the answer's ids and text, the key (passkey:
    # the key's digits; MQAR: the queried key), the depth of its statement in the filler (the
    # requested or drawn one) and where its statement starts in `ids`.
    answer_start: tuple[int, ...]
    answer: tuple[tuple[int, ...], ...]
    answer_text: tuple[str, ...]
    key: tuple[str, ...]
    depth: tuple[float, ...]
    position: tuple[int, ...]
    # Filler tokens in the sequence.
    filler_len: int

    @property
    def prompt_len(self) -> int:
        """Tokens before the first answer (passkey: the prompt's length)."""
        return self.answer_start[0]

    def prompt(self, query: int = 0) -> np.ndarray:
        """The ids a model reads before it answers query ``query``: int32 ``[answer_start[q]]``."""
        query = check_int(query, "query", "RecallExample.prompt", low=0, high=len(self.key) - 1)
        return self.ids[: self.answer_start[query]]


@dataclass(frozen=True, eq=False)
class RecallBatch:
    """``N`` examples of one task at one length ``T``, with ``Q`` queries each.

    Arrays: ``ids`` int32 ``[N, T]`` (each row exactly ``T`` tokens: prompt then answers, no
    padding); ``answer_start`` int32 ``[N, Q]`` (the first answer token of each query; a model
    reading ``ids[:, :-1]`` predicts answer token ``j`` of query ``q`` at position
    ``answer_start[n, q] - 1 + j``); ``answer_len`` int32 ``[N, Q]``; ``answer`` int32
    ``[N, Q, A]`` (the answer ids, padded with -1 to the longest, ``A``); ``depth`` float32
    ``[N, Q]`` (the depth asked for, or drawn, of each queried statement: a fraction of the
    filler before it); ``position`` int32 ``[N, Q]`` (where that statement starts in ``ids``);
    ``filler_len`` int32 ``[N]``. Texts: ``answer_text`` and ``key`` (``N`` tuples of ``Q``
    strings). ``batch[i]`` is a :class:`RecallExample`.

    Example:

    >>> batch = make_examples("mqar", "byte", "one two three four five six", length=160,
    ...                       count=3)
    >>> batch.ids.shape, batch.answer.shape, batch.prompt_len.shape  # N=3, T=160, Q=4, A=4
    ((3, 160), (3, 4, 4), (3,))
    >>> batch.key[0], batch.answer_text[0]  # the queried keys and their values
    (('vs', 'bv', 'cn', 'jd'), (' 601', ' 586', ' 665', ' 833'))
    """

    task: str
    tokenizer: str
    seed: int
    ids: np.ndarray
    answer_start: np.ndarray
    answer_len: np.ndarray
    answer: np.ndarray
    depth: np.ndarray
    position: np.ndarray
    filler_len: np.ndarray
    answer_text: tuple[tuple[str, ...], ...]
    key: tuple[tuple[str, ...], ...]

    @property
    def length(self) -> int:
        """``T``, the tokens of every sequence."""
        return int(self.ids.shape[1])

    @property
    def num_queries(self) -> int:
        """``Q``, the queries per example."""
        return int(self.answer_start.shape[1])

    @property
    def prompt_len(self) -> np.ndarray:
        """int32 ``[N]``: tokens before the first answer (passkey: the prompt's length)."""
        return self.answer_start[:, 0]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, index: int) -> RecallExample:
        n = len(self)
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"index must be an int, got {type(index).__name__}: {index!r}")
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for {n} examples")
        i = int(index) % n
        return RecallExample(
            task=self.task,
            tokenizer=self.tokenizer,
            ids=self.ids[i],
            answer_start=tuple(int(s) for s in self.answer_start[i]),
            answer=tuple(
                tuple(int(t) for t in row[:m])
                for row, m in zip(self.answer[i], self.answer_len[i], strict=True)
            ),
            answer_text=self.answer_text[i],
            key=self.key[i],
            depth=tuple(float(d) for d in self.depth[i]),
            position=tuple(int(p) for p in self.position[i]),
            filler_len=int(self.filler_len[i]),
        )


class _Query(NamedTuple):
    prompt: list[int]  # the prompt's last piece
    answer: list[int]
    answer_text: str
    key: str
    statement: int  # the index of the queried statement


class _Plan(NamedTuple):
    statements: list[tuple[list[int], float]]  # ids and depth, in order of depth
    queries: list[_Query]
    forbidden: re.Pattern[str]  # what the filler window must not hold
    what: str  # the same, in words
    rng: np.random.Generator


def check_depths(depths: object, task: PasskeyTask | MQARTask, caller: str) -> tuple[float, ...]:
    """``depths`` as a tuple of floats in [0, 1] (None: ``()``) (package-internal)."""
    if depths is None:
        return ()
    if isinstance(task, MQARTask) and task.layout == "scattered":
        raise ValueError(
            f"{caller}: `depths` must be None for MQAR's scattered layout (each pair draws its "
            f"own depth; depths apply to passkey and to MQARTask(layout='dense')); got {depths!r}"
        )
    if isinstance(depths, np.ndarray) and depths.ndim == 0:
        depths = depths.item()
    one = isinstance(depths, str) or not isinstance(depths, (Sequence, np.ndarray))
    values = (depths,) if one else depths
    if len(values) == 0:
        raise ValueError(
            f"{caller}: `depths` must be None, a number or a non-empty sequence; got {depths!r}"
        )
    out = []
    for i, d in enumerate(values):
        where = "" if one else f" at index {i}"
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, numbers.Real):
            raise TypeError(f"{caller}: `depths` must be numbers in [0, 1]; got {d!r}{where}")
        if not (math.isfinite(d) and 0.0 <= d <= 1.0):
            raise ValueError(f"{caller}: `depths` must be numbers in [0, 1]; got {d!r}{where}")
        out.append(float(d))
    return tuple(out)


def check_filler(filler: object, tok: Tokenizer, caller: str) -> None:
    """Refuses filler that is empty, of another type, or made for another tokenizer, before any
    is made (package-internal)."""
    if isinstance(filler, str) and not filler.strip():
        raise ValueError(
            f"{caller}: `filler` must hold text (a non-whitespace character); got {filler!r:.80}"
        )
    if not isinstance(filler, (Filler, str, TextSource, type(None))):
        raise TypeError(
            f"{caller}: `filler` must be a Filler, a str (the corpus itself), a TextSource or "
            f"None (the embedded corpus); got {type(filler).__name__}"
        )
    if isinstance(filler, Filler) and filler.tokenizer_hash != tokenizer_fingerprint(tok):
        raise ValueError(
            f"{caller}: `filler` was made for tokenizer {filler.tokenizer_name!r}, not for "
            f"`tokenizer` {tok.name!r}; make it with make_filler(text, tokenizer)"
        )


def check_request(
    task: object,
    tokenizer: object,
    filler: object,
    length: object,
    count: object,
    depths: object,
    seed: object,
    caller: str,
) -> tuple[PasskeyTask | MQARTask, int, int, int, tuple[float, ...], Tokenizer]:
    """The checks :func:`make_examples` and ``prepare`` share, in ``caller``'s name: ``(task,
    length, count, seed, depths, tokenizer)`` as the task spec, ints, a tuple of depths and a
    :class:`Tokenizer`; ``filler`` is refused if it cannot serve (package-internal)."""
    spec = as_task(task, caller)
    length = check_int(length, "length", caller)
    count = check_int(count, "count", caller)
    seed = check_int(seed, "seed", caller, low=0)
    requested = check_depths(depths, spec, caller)
    tok = as_tokenizer(tokenizer, caller)
    check_filler(filler, tok, caller)
    return spec, length, count, seed, requested, tok


def as_filler(filler: Filler | str | TextSource | None, tok: Tokenizer) -> Filler:
    """The :class:`Filler` that ``filler`` names, made for ``tok`` (package-internal)."""
    if filler is None:
        return default_filler(tok)
    if isinstance(filler, Filler):
        return filler
    return make_filler(filler, tok)


def _plan(
    task: PasskeyTask | MQARTask, tok: Tokenizer, depth: float | None, rng: np.random.Generator
) -> _Plan:
    """What example needs but the filler: its statements and queries, as ids."""
    if isinstance(task, PasskeyTask):
        key = str(int(rng.integers(10 ** (task.digits - 1), 10**task.digits)))
        depth = float(rng.random()) if depth is None else depth
        statement = tok.encode(PASSKEY_STATEMENT.format(key=key))
        answer = ANSWER.format(value=key)
        query = _Query(tok.encode(PASSKEY_QUESTION), tok.encode(answer), answer, key, 0)
        forbidden = re.compile(rf"pass\s*key|(?<!\d){key}(?!\d)", re.IGNORECASE)
        what = f"the key {key!r} and the phrase 'pass key'"
        return _Plan([(statement, depth)], [query], forbidden, what, rng)

    keys = [task.keys[k] for k in rng.choice(len(task.keys), task.num_pairs, replace=False)]
    values = [task.values[v] for v in rng.choice(len(task.values), task.num_pairs, replace=False)]
    queried = rng.choice(task.num_pairs, task.num_queries, replace=False)
    if task.layout == "dense":
        d = float(rng.random()) if depth is None else depth
        depths = [d] * task.num_pairs
    else:
        depths = np.sort(rng.random(task.num_pairs)).tolist()
    statements = [
        (tok.encode(MQAR_PAIR.format(key=k, value=v)), d)
        for k, v, d in zip(keys, values, depths, strict=True)
    ]
    queries = []
    for q, j in enumerate(queried.tolist()):
        prompt = (MQAR_FIRST_QUERY if q == 0 else MQAR_QUERY).format(key=keys[j])
        answer = ANSWER.format(value=values[j])
        queries.append(_Query(tok.encode(prompt), tok.encode(answer), answer, keys[j], j))
    words = "|".join(re.escape(w) for w in keys + values)
    forbidden = re.compile(rf"(?<![{_NOT_WORD}])(?:{words})(?![{_NOT_WORD}])")
    what = "the example's keys and values as words"
    return _Plan(statements, queries, forbidden, what, rng)


def _check_answer_seams(tok: Tokenizer, caller: str) -> None:
    """The answer's ids must be the tokens of the answer after the prompt's text: a tokenizer
    must not merge a prompt's end with its answer (GPT-2's pattern splits numbers off)."""
    for prompt, answer in (
        (PASSKEY_QUESTION, ANSWER.format(value="48213")),
        (MQAR_FIRST_QUERY.format(key="kx"), ANSWER.format(value="371")),
        (MQAR_QUERY.format(key="kx"), ANSWER.format(value="w7")),
    ):
        if tok.encode(prompt + answer) != tok.encode(prompt) + tok.encode(answer):
            raise ValueError(
                f"{caller}: tokenizer {tok.name!r} merges the answer {answer!r} with the prompt "
                f"before it ({prompt!r}): the answer's ids would not be the tokens a model "
                "writes after the prompt; use a tokenizer that splits words from numbers "
                "(GPT-2's pattern does)"
            )


def _nearest(boundaries: np.ndarray, target: float) -> int:
    """The boundary nearest to ``target`` (the lower one on a tie)."""
    i = int(np.searchsorted(boundaries, target))
    if i == 0:
        return int(boundaries[0])
    if i == len(boundaries):
        return int(boundaries[-1])
    lo, hi = int(boundaries[i - 1]), int(boundaries[i])
    return lo if target - lo <= hi - target else hi


def _build(plan: _Plan, filler: Filler, tok: Tokenizer, n: int, index: int, caller: str):
    """One example's ids and where its pieces went."""
    for _ in range(MAX_TRIES):
        window, boundaries = filler.window(int(plan.rng.integers(filler.num_units)), n)
        if not plan.forbidden.search(tok.decode(window)):
            break
    else:
        raise ValueError(
            f"{caller}: found no window of {n} tokens of `filler` free of {plan.what} for "
            f"example {index} in {MAX_TRIES} draws: the filler holds them too often (use more "
            "`digits`, other keys or values, or other filler)"
        )
    parts, positions, starts = [], [], []
    cursor = size = 0
    for ids, depth in plan.statements:
        b = _nearest(boundaries, depth * n)
        parts += [window[cursor:b], ids]
        size += b - cursor
        positions.append(size)
        size += len(ids)
        cursor = b
    parts.append(window[cursor:])
    size += n - cursor
    for query in plan.queries:
        parts.append(query.prompt)
        size += len(query.prompt)
        starts.append(size)
        parts.append(query.answer)
        size += len(query.answer)
    ids = np.concatenate([np.asarray(p, np.int32) for p in parts])
    return ids, starts, [positions[q.statement] for q in plan.queries]


def make_examples(
    task: str | PasskeyTask | MQARTask,
    tokenizer: Tokenizer | str | os.PathLike = "byte",
    filler: Filler | str | TextSource | None = None,
    *,
    length: int,
    count: int,
    depths: float | Sequence[float] | None = None,
    seed: int = 0,
) -> RecallBatch:
    """``count`` examples of ``task``, each exactly ``length`` tokens of ``tokenizer``.

    Args:
      task: ``"passkey"`` or ``"mqar"`` (with their defaults), or a :class:`PasskeyTask` /
        :class:`MQARTask`.
      tokenizer: a :class:`~sparse_jax.data.tokenizers.Tokenizer` or a name for
        :func:`~sparse_jax.data.tokenizers.get_tokenizer` (``"byte"``, ``"gpt2"``, a folder).
      filler: the text around the statements: a :class:`Filler` made for ``tokenizer``, text (a
        ``str``, the corpus itself), a :class:`~sparse_jax.data.text.TextSource` (its train
        split), or None for the embedded corpus's train split (:func:`default_filler`).
      length: ``T``, the tokens of every sequence: filler, statements, questions and answers.
      count: ``N``, the examples.
      depths: where the statement goes (passkey; MQAR's dense list), as a fraction of the
        filler before it: one number for all examples, a sequence cycled over the examples
        (example ``i`` gets ``depths[i % len(depths)]``), or None to draw one per example,
        uniformly in ``[0, 1)``. It is placed at the unit boundary of the filler nearest to
        ``depth * filler_len``. None for MQAR's scattered layout (each pair draws its own).
      seed: example ``i`` depends only on ``(seed, i)`` and the arguments: the same seed gives
        the same ids, and the first ``k`` of ``count`` examples are those of ``count=k``.

    Returns:
      a :class:`RecallBatch`: ``ids`` int32 ``[N, T]`` and where the answers are.

    Filler is drawn as a window of ``T`` minus the pieces' tokens, ending on a unit boundary
    (the stream read cyclically), redrawn (at most :data:`MAX_TRIES` times) while its text holds
    the example's key (passkey: also the phrase "pass key"; MQAR: any of its keys and values,
    as whole words), so that the statement and the answer are the only places the key occurs.
    Ids are built piecewise: each piece (filler unit, statement, question, answer) is tokenized
    on its own, so the ids of a whole sequence may differ from the tokenization of its text at
    the seams between pieces; the answer's ids are checked to be exactly the tokens of the
    answer after the question's text.

    Raises ``ValueError`` / ``TypeError`` naming the argument, before any filler is made: an
    unknown task, a depth outside ``[0, 1]``, a ``length`` shorter than the statement, question
    and answer, an empty ``filler``, a filler made for another tokenizer.

    Example (passkey, byte tokens, 100 tokens, the key stated at depth 0.5 of 20 filler tokens):

    >>> batch = make_examples("passkey", "byte", "one two three four five six seven eight",
    ...                       length=100, count=2, depths=0.5, seed=0)
    >>> batch.ids.shape, batch.ids.dtype, batch.key, batch.answer_text[0]
    ((2, 100), dtype('int32'), (('86556',), ('56994',)), (' 86556',))
    >>> int(batch.filler_len[0]), int(batch.position[0, 0]), int(batch.prompt_len[0])
    (20, 10, 94)
    >>> text = bytes(batch.ids[0].tolist()).decode()
    >>> text[:46]  # 10 filler tokens, then the statement
    ' two three The pass key is 86556. Remember it.'
    >>> text[46:]  # 10 more, the question and the answer
    ' four five What is the pass key? The pass key is 86556'
    >>> make_examples("passkey", "byte", "one two", length=40, count=1)
    Traceback (most recent call last):
    ...
    ValueError: make_examples: `length` must be at least 80 (the key statement, question and \
answer of example 0 take 80 tokens of tokenizer 'byte'); got 40
    """
    caller = "make_examples"
    spec, length, count, seed, requested, tok = check_request(
        task, tokenizer, filler, length, count, depths, seed, caller
    )
    _check_answer_seams(tok, caller)

    plans = []
    for i in range(count):
        depth = requested[i % len(requested)] if requested else None
        plans.append(_plan(spec, tok, depth, np.random.default_rng([seed, i])))
    fixed = [
        sum(len(ids) for ids, _ in p.statements)
        + sum(len(q.prompt) + len(q.answer) for q in p.queries)
        for p in plans
    ]
    worst = int(np.argmax(fixed))
    if fixed[worst] > length:
        what = (
            "key statement, question and answer"
            if isinstance(spec, PasskeyTask)
            else "pairs, queries and answers"
        )
        raise ValueError(
            f"{caller}: `length` must be at least {fixed[worst]} (the {what} of example "
            f"{worst} take {fixed[worst]} tokens of tokenizer {tok.name!r}); got {length}"
        )

    filler = as_filler(filler, tok)

    rows, starts, positions = [], [], []
    for i, (plan, n) in enumerate(zip(plans, fixed, strict=True)):
        ids, s, p = _build(plan, filler, tok, length - n, i, caller)
        rows.append(ids)
        starts.append(s)
        positions.append(p)
    q = len(plans[0].queries)
    answer_len = np.asarray([[len(x.answer) for x in p.queries] for p in plans], np.int32)
    answer = np.full((count, q, int(answer_len.max())), -1, np.int32)
    for i, plan in enumerate(plans):
        for j, query in enumerate(plan.queries):
            answer[i, j, : len(query.answer)] = query.answer
    return RecallBatch(
        task=spec.name,
        tokenizer=tok.name,
        seed=seed,
        ids=np.stack(rows),
        answer_start=np.asarray(starts, np.int32),
        answer_len=answer_len,
        answer=answer,
        depth=np.asarray(
            [[p.statements[x.statement][1] for x in p.queries] for p in plans], np.float32
        ),
        position=np.asarray(positions, np.int32),
        filler_len=np.asarray([length - n for n in fixed], np.int32),
        answer_text=tuple(tuple(x.answer_text for x in p.queries) for p in plans),
        key=tuple(tuple(x.key for x in p.queries) for p in plans),
    )
