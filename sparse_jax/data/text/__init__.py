"""Token streams for language modelling: corpora, a TFDS ``array_record`` cache and batches.

Three steps, each usable on its own:

1. :func:`resolve_source` turns a spec into a :class:`TextSource` (a frozen description of
   where the text lies and how it splits into train and eval documents):

   * ``"default"``: the embedded corpus, needing no network and no file outside the Python
     installation: CPython's bundled documentation topics (``pydoc_data.topics.topics``, the
     text ``help("topics")`` shows; every CPython carries it). One document per topic, in sorted
     order; the last 10% of the topics are the eval split.
   * a ``.txt`` file: train on its first ~90% (cut at a line boundary), evaluate on the rest.
   * a folder of ``.txt`` files (searched recursively, sorted by path): one document per file;
     the last 10% of the files are the eval split (a folder with one file splits like a file).
   * a WikiText-2 folder (``valid.txt`` + ``test.txt``, or the original release's
     ``wiki.valid.tokens`` + ``wiki.test.tokens``): **trains on ``valid.txt`` and evaluates on
     ``test.txt``** (the folder's README suggests this; its ``train.txt`` is not distributed here,
     and when present it is still not used, so that results stay comparable). One document per
     article (a `` = Title = `` heading).
   * ``"tfds:<name>[:<feature>]"``: any TFDS dataset with a text feature (``<name>`` as TFDS
     writes it, e.g. ``"imdb_reviews"`` or ``"wiki40b/en:1.3.0"``), read with
     ``tfds.data_source`` from a copy prepared beforehand (never downloaded here). Its
     ``"validation"`` (else ``"valid"``, ``"eval"``, ``"dev"``, ``"test"``) split is the eval
     split; a dataset with only ``"train"`` is cut 90/10.

2. :func:`prepare` tokenizes each split into one flat stream (documents separated by the
   tokenizer's ``eos_id``; an EOS also ends the last document), cuts it into windows of
   ``seq_len + 1`` tokens with stride ``seq_len`` (window ``i`` is
   ``stream[i * seq_len : i * seq_len + seq_len + 1]``: inputs ``w[:-1]``, targets ``w[1:]``,
   every token but the first is a target exactly once; the tail of fewer than ``seq_len`` tokens
   is dropped) and writes them **once** as a TFDS dataset in ``array_record`` format through the
   project's builder :class:`SparseJaxText`. It reads them back with ``tfds.data_source`` (no
   TensorFlow needed). The dataset's config name carries a hash of (source contents, tokenizer,
   ``seq_len``): an identical request reuses the files, any change writes a new dataset beside.
   The cache is ``data_dir``, else ``$SPARSE_JAX_DATA_DIR``, else ``~/.cache/sparse_jax/tfds``.

3. :class:`BatchIterator` draws deterministic, resumable batches of windows: its position is
   ``(epoch, step)`` (see :meth:`BatchIterator.state`); epoch ``e`` is shuffled by a permutation
   seeded with ``(seed, e)``; with ``process_count > 1`` each process gets its contiguous slice of
   the same global batch. :class:`BucketIterator` draws each batch from one of several buckets
   of rows of their own lengths (examples padded only as far as their bucket needs).

Example (the embedded corpus, byte tokenizer, windows of 257 tokens):

>>> import tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> data = prepare("default", "byte", seq_len=256, data_dir=tmp.name)  # TFDS prints 2 lines
Downloading and preparing dataset ...
Dataset sparse_jax_text downloaded and prepared to ... Subsequent calls will reuse this data.
>>> data.train[0].shape, data.train[0].dtype, data.built
((257,), dtype('int32'), True)
>>> data.stats["train"]["tokens"] > 300_000  # the topics hold a few hundred kB of text
True
>>> it = BatchIterator(data.train, batch_size=4, seed=0)
>>> next(it).shape, it.state()["step"]
((4, 257), 1)
>>> prepare("default", "byte", seq_len=256, data_dir=tmp.name).built  # written once
False
>>> tmp.cleanup()

**Modules** (each imports only modules listed before it): :mod:`~sparse_jax.data.text.corpora`
(:class:`TextSource`, :func:`resolve_source`: the corpora and how their text is read),
:mod:`~sparse_jax.data.text.batches` (:func:`token_stream`, :func:`make_windows`,
:class:`BatchIterator`, :class:`BucketIterator`) and :mod:`~sparse_jax.data.text.storage` (the TFDS
builder ``SparseJaxText``, :class:`WindowSource`, :class:`PreparedData`, :func:`prepare`).
"""

from __future__ import annotations

from typing import Any

from sparse_jax.data.text import storage
from sparse_jax.data.text.batches import (
    BatchIterator,
    BucketIterator,
    RandomAccess,
    make_windows,
    token_stream,
)
from sparse_jax.data.text.corpora import DEFAULT_EVAL_FRACTION, TextSource, resolve_source
from sparse_jax.data.text.storage import BUILDER_NAME, PreparedData, WindowSource, prepare
from sparse_jax.data.tfds_store import default_data_dir

__all__ = [
    "BUILDER_NAME",
    "DEFAULT_EVAL_FRACTION",
    "BatchIterator",
    "BucketIterator",
    "PreparedData",
    "RandomAccess",
    "SparseJaxText",  # defined on first use by __getattr__
    "SparseJaxTextConfig",
    "TextSource",
    "WindowSource",
    "default_data_dir",
    "make_windows",
    "prepare",
    "resolve_source",
    "token_stream",
]


def __getattr__(name: str) -> Any:
    # The TFDS builder classes, defined on first use (importing the package does not import
    # tensorflow_datasets).
    if name in ("SparseJaxText", "SparseJaxTextConfig"):
        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
