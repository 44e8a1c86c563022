"""Recall data: does a model find one fact far back in its context? Generated, deterministic by
seed, for the byte tokenizer and GPT-2 BPE alike, graded by exact match of the greedy answer.

Two tasks (issue 58, "Recall data"):

* **passkey** (:class:`PasskeyTask`): a key of ``digits`` decimal digits stated once, at a chosen
  depth, inside filler text, and asked for at the end (one sequence, shown on two lines)::

      <filler> The pass key is 48213. Remember it.<filler>
       What is the pass key? The pass key is 48213

  The answer is `` 48213`` (its tokens), the last tokens of the sequence.
* **multi-query associative recall** (:class:`MQARTask`): key-value pairs (`` kx: 371.``)
  scattered through the filler (or together as a dense list at one depth), then several of them
  queried: `` Recall: kx: 371, mb: 802``; each answer is a value, right after its ``key:``.

**Sequences.** :func:`make_examples` builds ``count`` examples at an exact length ``T`` in tokens
of the given tokenizer: the pieces (statement, question, answer) take what they need and the
filler the rest, a window of a :class:`Filler` (a corpus tokenized in small units, whitespace plus
a word; the embedded corpus by default, any text or :class:`~sparse_jax.data.text.TextSource`
such as WikiText-2 otherwise). A statement goes at the unit boundary nearest to ``depth`` times
the filler's length (so within one unit of the requested depth). The filler of an example never
holds its key (nor the phrase "pass key"; for MQAR none of its keys or values as words), so the
key occurs in the statement and the answer only. **Ids are built piecewise**: every piece is
tokenized on its own and the ids concatenated, so at the seams between pieces they may differ
from the tokenization of the decoded text (with GPT-2 BPE; never with bytes); the answer's ids
are exactly the tokens the model must write after the prompt (checked: the tokenizer does not
merge the question's end with the answer, GPT-2's pattern splits numbers from words).

**Arrays.** A :class:`RecallBatch` holds ``ids`` int32 ``[N, T]`` and, per query, where the
answer starts, its ids (``[N, Q, A]``, padded with -1), its text, the key, the depth and where
the statement is; ``batch[i]`` is a :class:`RecallExample`.

**Grading** (:mod:`~sparse_jax.data.recall.grading`): :func:`grade` one continuation (ids or
text; right when it starts with the answer, extra tokens after it ignored), :func:`grade_batch`
all of a batch, :func:`continuations_from_argmax` the answers one teacher-forced pass predicts
(equal to greedy decoding for exact match), :func:`score` accuracy per ``(length, depth)``.

**Training** (:mod:`~sparse_jax.data.recall.mixture`): :class:`RecallMixture` yields batches of
text and recall sequences (answers at varied positions, marked for a weighted loss), the
mixture a model that must retrieve is trained on.

**Storage**: :func:`prepare` writes a set once as a TFDS ``array_record`` dataset through the
builder ``SparseJaxRecall`` and reads it back (:class:`RecallData`); importing this package
does not import ``tensorflow_datasets``.

Example (passkey at depth 0.5 in 100 byte tokens; a model that copies the key is right):

>>> batch = make_examples("passkey", "byte", "one two three four five six seven eight",
...                       length=100, count=2, depths=0.5)
>>> batch.ids.shape, batch.key[0], batch.answer_text[0]
((2, 100), ('86556',), (' 86556',))
>>> bytes(batch[0].prompt().tolist()).decode()
' two three The pass key is 86556. Remember it. four five What is the pass key? The pass key is'
>>> score(batch, [" 86556", " 12345"])  # {(length, depth): accuracy}
{(100, 0.5): 0.5}

**Modules** (each imports only those before it): :mod:`~sparse_jax.data.recall.sources`
(:class:`Filler`, :func:`make_filler`, :func:`default_filler`),
:mod:`~sparse_jax.data.recall.generator` (the tasks, :class:`RecallExample`,
:class:`RecallBatch`, :func:`make_examples`), :mod:`~sparse_jax.data.recall.grading`,
:mod:`~sparse_jax.data.recall.mixture` and :mod:`~sparse_jax.data.recall.storage`.
"""

from __future__ import annotations

from typing import Any

from sparse_jax.data.recall import storage
from sparse_jax.data.recall.generator import (
    DEFAULT_KEYS,
    DEFAULT_VALUES,
    LAYOUTS,
    MAX_TRIES,
    TASKS,
    MQARTask,
    PasskeyTask,
    RecallBatch,
    RecallExample,
    make_examples,
)
from sparse_jax.data.recall.grading import continuations_from_argmax, grade, grade_batch, score
from sparse_jax.data.recall.mixture import RecallMixture, shortest_length
from sparse_jax.data.recall.sources import MAX_UNIT_CHARS, Filler, default_filler, make_filler
from sparse_jax.data.recall.storage import BUILDER_NAME, RecallData, prepare

__all__ = [
    "BUILDER_NAME",
    "DEFAULT_KEYS",
    "DEFAULT_VALUES",
    "LAYOUTS",
    "MAX_TRIES",
    "MAX_UNIT_CHARS",
    "TASKS",
    "Filler",
    "MQARTask",
    "PasskeyTask",
    "RecallBatch",
    "RecallData",
    "RecallExample",
    "RecallMixture",
    "SparseJaxRecall",  # defined on first use by __getattr__
    "SparseJaxRecallConfig",
    "continuations_from_argmax",
    "default_filler",
    "grade",
    "grade_batch",
    "make_examples",
    "make_filler",
    "prepare",
    "score",
    "shortest_length",
]


def __getattr__(name: str) -> Any:
    # The TFDS builder classes, defined on first use (importing the package does not import
    # tensorflow_datasets).
    if name in ("SparseJaxRecall", "SparseJaxRecallConfig"):
        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
