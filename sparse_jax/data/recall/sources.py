"""Filler text for the recall tasks: a corpus cut into small units and tokenized unit by unit.

A :class:`Filler` holds the token ids of a corpus as one flat stream and the offset of every
*unit* in it: a unit is a run of whitespace followed by at most :data:`MAX_UNIT_CHARS`
non-whitespace characters (a word, or a piece of a longer word), so that units joined give the
text back (its trailing whitespace aside, and with a newline before the first unit when the text
starts without whitespace: the stream is read cyclically, its end running on into its start as
into a new line) and a statement inserted between two units never cuts a character or, mostly,
a word.
Each unit is tokenized on its own (piecewise, see :mod:`sparse_jax.data.recall`): the ids of a
window are the concatenation of its units' ids.

:func:`make_filler` builds one from text or a :class:`~sparse_jax.data.text.TextSource`;
:func:`default_filler` caches the embedded corpus's, one per tokenizer and split.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from sparse_jax.data.text.corpora import TextSource, resolve_source
from sparse_jax.data.tokenizers import Tokenizer, get_tokenizer
from sparse_jax.validation import check_choice

__all__ = ["MAX_UNIT_CHARS", "Filler", "default_filler", "make_filler"]

# The longest run of non-whitespace characters in one unit (longer words span several units).
MAX_UNIT_CHARS = 16
_UNIT = re.compile(r"\s*\S{1," + str(MAX_UNIT_CHARS) + "}")
_SPLITS = ("train", "eval")


def as_tokenizer(tokenizer: object, caller: str) -> Tokenizer:
    """``tokenizer`` itself, or :func:`get_tokenizer` of a name or folder (package-internal)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        return get_tokenizer(tokenizer)
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"{caller}: `tokenizer` must be a Tokenizer (see sparse_jax.data.tokenizers) or a "
            f"name for get_tokenizer ('byte', 'gpt2', a folder); got {type(tokenizer).__name__}"
        )
    return tokenizer


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """What ``tok`` does to a probe text, hashed: equal for equal tokenizers (package-internal)."""
    probe = (
        "The pass key is 48213. Remember it. kx: 371, mb: 802. 0123456789 <|endoftext|>\n\t"
        "def f(x): return x ** 2  # héllo wörld, 日本語, emoji 🙂, Ελληνικά, русский"
    )
    text = f"{tok.name}|{tok.vocab_size}|{tok.eos_id}|{tok.encode(probe)}"
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class Filler:
    """A corpus as a flat stream of token ids cut into units; windows end on a unit boundary.

    Build it with :func:`make_filler` (or :func:`default_filler`). ``ids`` is int32 ``[L]``;
    ``starts`` is int64 ``[U + 1]``, the offset of each of the ``U`` units in ``ids`` followed
    by ``L``. :meth:`window` reads the stream cyclically (a corpus shorter than a window is
    repeated).

    Example (units are whitespace + a word; ids are bytes with the byte tokenizer; the first
    unit gets a newline in front, so that the stream's end runs on into its start as a line):

    >>> filler = make_filler("one two  three", "byte")
    >>> filler.num_tokens, filler.num_units, filler.starts.tolist()
    (15, 3, [0, 4, 8, 15])
    >>> ids, boundaries = filler.window(end_unit=2, n=9)  # 9 tokens ending where unit 2 starts
    >>> bytes(ids.tolist()), boundaries.tolist()  # the first unit is cut: windows start mid-text
    (b'e\\none two', [0, 1, 5, 9])
    """

    # The token ids of the units, concatenated: int32 [L].
    ids: np.ndarray
    # Where each unit starts in `ids`, then L: int64 [U + 1].
    starts: np.ndarray
    # The name of the tokenizer that made `ids`, and a hash of what it does (see make_examples).
    tokenizer_name: str
    tokenizer_hash: str
    # A hash of the ids, the unit offsets and the tokenizer (part of a prepared dataset's name).
    fingerprint: str

    @property
    def num_tokens(self) -> int:
        """``L``, the tokens of the stream."""
        return int(self.ids.shape[0])

    @property
    def num_units(self) -> int:
        """``U``, the units of the stream."""
        return int(self.starts.shape[0]) - 1

    def window(self, end_unit: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` tokens ending where unit ``end_unit`` starts (read cyclically): int32
        ``[n]``, and the unit boundaries inside it: sorted int64 offsets in ``[0, n]``, 0 and
        ``n`` included (0 also where the window starts inside a unit)."""
        size = self.num_tokens
        end = int(self.starts[end_unit]) + size * math.ceil(n / size)  # >= n
        first = end - n
        ids = self.ids[np.arange(first, end) % size]
        starts = self.starts[:-1]
        laps = range(first // size, end // size + 1)
        every = np.concatenate([starts + lap * size for lap in laps])
        inside = every[(every >= first) & (every <= end)] - first
        boundaries = np.unique(np.concatenate([[0, n], inside]))
        return ids.astype(np.int32), boundaries.astype(np.int64)


def make_filler(
    text: str | TextSource, tokenizer: Tokenizer | str | os.PathLike, *, split: str = "train"
) -> Filler:
    """The :class:`Filler` of ``text`` for ``tokenizer``.

    Args:
      text: the corpus itself (a ``str``, used as is, never read as a path), or a
        :class:`~sparse_jax.data.text.TextSource` whose ``split`` documents are joined with
        blank lines (e.g. ``resolve_source("default")``, or a WikiText-2 folder's source).
      tokenizer: a :class:`~sparse_jax.data.tokenizers.Tokenizer` or a name for
        :func:`~sparse_jax.data.tokenizers.get_tokenizer` (``"byte"``, ``"gpt2"``, a folder).
      split: ``"train"`` or ``"eval"`` (a ``TextSource`` only).

    Raises ``ValueError`` for text without a non-whitespace character, ``TypeError`` for
    anything but a ``str`` or a ``TextSource``.

    Example:

    >>> filler = make_filler("The quick brown fox jumps over the lazy dog.", "byte")
    >>> filler.num_units, filler.num_tokens, filler.tokenizer_name  # a newline before "The"
    (9, 45, 'byte')
    >>> make_filler("  \\n", "byte")
    Traceback (most recent call last):
    ...
    ValueError: make_filler: `text` must hold text (a non-whitespace character); got '  \\n'
    """
    split = check_choice(split, "split", _SPLITS, "make_filler")
    if isinstance(text, TextSource):
        text = "\n\n".join(d for d in text.documents(split) if d.strip())
    elif not isinstance(text, str):
        raise TypeError(
            "make_filler: `text` must be a str (the corpus itself) or a TextSource; got "
            f"{type(text).__name__}"
        )
    tok = as_tokenizer(tokenizer, "make_filler")
    units = _UNIT.findall(text)
    if not units:
        raise ValueError(
            f"make_filler: `text` must hold text (a non-whitespace character); got {text!r:.80}"
        )
    if not units[0][0].isspace():
        # The stream is read cyclically: its end runs on into its start as into a new line.
        units[0] = "\n" + units[0]
    encoded = tok.encode_batch(units)
    lengths = np.fromiter((len(e) for e in encoded), np.int64, len(encoded))
    ids = np.fromiter((i for e in encoded for i in e), np.int32, int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tok_hash = tokenizer_fingerprint(tok)
    digest = hashlib.sha256(tok_hash.encode())
    digest.update(ids.tobytes())
    digest.update(starts.tobytes())
    return Filler(
        ids=ids,
        starts=starts,
        tokenizer_name=tok.name,
        tokenizer_hash=tok_hash,
        fingerprint=digest.hexdigest(),
    )


_DEFAULT: dict[tuple[str, str], Filler] = {}


def default_filler(tokenizer: Tokenizer | str | os.PathLike, split: str = "train") -> Filler:
    """The :class:`Filler` of the embedded corpus (CPython's documentation topics, see
    :mod:`sparse_jax.data.text`), made once per tokenizer and split and kept for the process.

    Example:

    >>> filler = default_filler("byte")
    >>> filler.num_tokens > 300_000, default_filler("byte") is filler  # made once
    (True, True)
    """
    split = check_choice(split, "split", _SPLITS, "default_filler")
    tok = as_tokenizer(tokenizer, "default_filler")
    key = (tokenizer_fingerprint(tok), split)
    if key not in _DEFAULT:
        _DEFAULT[key] = make_filler(resolve_source("default"), tok, split=split)
    return _DEFAULT[key]
