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
>>> data.stats["train"]["tokens"] > 300_000  # about 430,000 bytes of text on CPython 3.11
True
>>> it = BatchIterator(data.train, batch_size=4, seed=0)
>>> next(it).shape, it.state()["step"]
((4, 257), 1)
>>> prepare("default", "byte", seq_len=256, data_dir=tmp.name).built  # written once
False
>>> tmp.cleanup()
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sparse_jax.data.tfds_store import default_data_dir, prepare_once, quiet_tfds
from sparse_jax.data.tokenizers import Tokenizer, get_tokenizer
from sparse_jax.validation import check_bool, check_int

__all__ = [
    "BUILDER_NAME",
    "BatchIterator",
    "BucketIterator",
    "PreparedData",
    "RandomAccess",
    "SparseJaxText",  # noqa: F822 (defined on first use by __getattr__)
    "SparseJaxTextConfig",  # noqa: F822
    "TextSource",
    "WindowSource",
    "default_data_dir",
    "make_windows",
    "prepare",
    "resolve_source",
    "token_stream",
]

# Bumped when the layout of the prepared datasets changes (it is part of every dataset's hash).
_FORMAT = 1
BUILDER_NAME = "sparse_jax_text"
_BUILDER_VERSION = "1.0.0"  # SparseJaxText.VERSION
DEFAULT_EVAL_FRACTION = 0.1
_KINDS = ("default", "file", "folder", "wikitext2", "tfds")
# WikiText-2 file names: (train, eval, unused official train split), this release's then the
# original one's.
_WIKITEXT_NAMES = (
    ("valid.txt", "test.txt", "train.txt"),
    ("wiki.valid.tokens", "wiki.test.tokens", "wiki.train.tokens"),
)
_TFDS_EVAL_SPLITS = ("validation", "valid", "eval", "dev", "test")
_WIKITEXT_HEADING = re.compile(r"^ = [^=].* = $")
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")


class RandomAccess(Protocol):
    """What :class:`BatchIterator` draws from: a length and integer indexing.

    Example (a :class:`WindowSource`, an array ``[n, seq_len + 1]``, or any object like this):
      >>> class Squares:
      ...     def __len__(self):
      ...         return 4
      ...
      ...     def __getitem__(self, index):
      ...         return np.full(3, index * index, np.int32)
      >>> next(BatchIterator(Squares(), batch_size=2, shuffle=False)).tolist()  # [2, 3]
      [[0, 0, 0], [1, 1, 1]]
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


# --------------------------------------------------------------------------------------------
# Sources.


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_text(path: Path) -> str:
    # newline="" keeps the file's line endings, so documents are the file's exact text; bytes
    # that are not UTF-8 become U+FFFD (as the tokenizers decode them).
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        return f.read()


def _split_lines(text: str, eval_fraction: float, what: str) -> tuple[str, str]:
    """``text`` cut at the line boundary nearest to ``1 - eval_fraction`` of its characters."""
    lines = text.splitlines(keepends=True)
    nonblank = [i for i, line in enumerate(lines) if line.strip()]
    if not nonblank:
        raise ValueError(f"source {what} is empty: it holds no text (only whitespace)")
    if len(nonblank) < 2:
        raise ValueError(
            f"source {what} has {len(nonblank)} non-blank line(s): a single file is split into "
            "train and eval at a line boundary and needs at least 2 lines of text; give a folder "
            "of files or a longer file"
        )
    ends = np.cumsum([len(line) for line in lines])
    target = (1.0 - eval_fraction) * ends[-1]
    # Cut after line `cut`, keeping at least one non-blank line on each side.
    cut = int(np.argmin(np.abs(ends - target)))
    cut = min(max(cut, nonblank[0]), nonblank[-1] - 1)
    return "".join(lines[: cut + 1]), "".join(lines[cut + 1 :])


def _wikitext_articles(text: str) -> list[str]:
    """WikiText text split before each top-level `` = Title = `` heading (verbatim pieces)."""
    articles: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        if _WIKITEXT_HEADING.match(line.rstrip("\r\n")) and any(s.strip() for s in articles[-1]):
            articles.append([])
        articles[-1].append(line)
    return ["".join(a) for a in articles if any(s.strip() for s in a)]


def _n_eval(n: int, eval_fraction: float) -> int:
    return min(n - 1, max(1, round(n * eval_fraction)))


def _find_wikitext(folder: Path) -> tuple[str, str, str] | None:
    for names in _WIKITEXT_NAMES:
        if (folder / names[0]).is_file() and (folder / names[1]).is_file():
            return names
    return None


def _open_tfds(name: str, data_dir: str | None) -> Any:
    """A read-only TFDS builder of the prepared dataset ``name``, or a clear error."""
    import tensorflow_datasets as tfds

    where = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    how = (
        "sparse_jax reads TFDS datasets with tfds.data_source and never downloads them: on a "
        f"machine with network run `tfds build {name} --data_dir {where}` (or "
        f"tfds.builder({name!r}, data_dir=...).download_and_prepare()) and copy the folder here"
    )
    with quiet_tfds(False):
        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except Exception as e:  # unknown names, unreadable files: TFDS raises several kinds
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(
                f"source 'tfds:{name}': TFDS cannot open the dataset {name!r} in data_dir "
                f"'{where}' ({type(e).__name__}: {first}); {how}"
            ) from None
        prepared = builder.is_prepared()
    if not prepared:
        raise ValueError(
            f"source 'tfds:{name}': the dataset {name!r} is not prepared in data_dir '{where}' "
            f"(looked for '{builder.data_dir}/dataset_info.json'); {how}"
        )
    return builder


@dataclass(frozen=True)
class TextSource:
    """Where a corpus lies and how it splits into train and eval documents.

    Build it with :func:`resolve_source`. ``documents(split)`` reads the text; ``fingerprint()``
    hashes what the documents depend on (file contents, not paths); ``describe()`` says in words
    what trains and what evaluates.

    >>> src = resolve_source("default")
    >>> src.kind, src.location
    ('default', 'pydoc_data.topics')
    >>> train, evaluation = src.documents("train"), src.documents("eval")
    >>> n = len(train) + len(evaluation)  # 79 topics on CPython 3.11
    >>> n > 50, len(evaluation) == round(0.1 * n)
    (True, True)
    """

    # "default", "file", "folder", "wikitext2" or "tfds".
    kind: str
    # The module of the embedded corpus, the resolved path, or the TFDS dataset name.
    location: str
    # Files of each split, relative to `location` (folders; for "file", the file itself).
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    # Fraction of the documents (lines for one file) held out for eval where the corpus has no
    # eval split of its own.
    eval_fraction: float = DEFAULT_EVAL_FRACTION
    # TFDS only: the text feature, the splits read for train and eval ("train[:90%]"-style
    # slices when the dataset has a train split only) and the TFDS data_dir (None: TFDS's).
    feature: str | None = None
    train_split: str | None = None
    eval_split: str | None = None
    data_dir: str | None = None
    # Notes for describe(), e.g. that WikiText's train.txt exists but is not used.
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must lie in (0, 1), got {self.eval_fraction!r}")

    # -- reading ---------------------------------------------------------------------------

    def documents(self, split: str) -> list[str]:
        """The documents of ``split`` (``"train"`` or ``"eval"``), each a string, in order."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        is_eval = split == "eval"
        if self.kind == "default":
            topics = _default_topics()
            n_eval = _n_eval(len(topics), self.eval_fraction)
            chosen = topics[-n_eval:] if is_eval else topics[:-n_eval]
            return [text for _, text in chosen]
        if self.kind == "tfds":
            return list(self._tfds_documents(self.eval_split if is_eval else self.train_split))
        root = Path(self.location)
        if self.kind == "file" or (self.kind == "folder" and not self.eval_files):
            path = root if self.kind == "file" else root / self.train_files[0]
            train, evaluation = _split_lines(_read_text(path), self.eval_fraction, f"'{path}'")
            return [evaluation if is_eval else train]
        files = self.eval_files if is_eval else self.train_files
        if self.kind == "wikitext2":
            return _wikitext_articles(_read_text(root / files[0]))
        return [_read_text(root / f) for f in files]

    def _tfds_documents(self, split: str | None) -> Iterator[str]:
        import tensorflow_datasets as tfds

        source = tfds.data_source(
            self.location, split=split, data_dir=self.data_dir, download=False
        )
        for start in range(0, len(source), 1024):
            keys = list(range(start, min(start + 1024, len(source))))
            for example in source.__getitems__(keys):
                value = example[self.feature]
                yield value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

    # -- identity --------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """SHA-256 of everything the documents depend on (contents, not paths)."""
        h = hashlib.sha256()
        h.update(f"{self.kind}|{self.eval_fraction!r}|".encode())
        if self.kind == "default":
            for name, text in _default_topics():
                h.update(f"{name}\0{len(text)}\0".encode())
                h.update(text.encode("utf-8", "surrogatepass"))
        elif self.kind == "tfds":
            builder = _open_tfds(self.location, self.data_dir)
            splits = {k: v.num_examples for k, v in builder.info.splits.items()}
            h.update(
                json.dumps(
                    [
                        builder.info.full_name,
                        self.feature,
                        self.train_split,
                        self.eval_split,
                        sorted(splits.items()),
                    ]
                ).encode()
            )
        else:
            root = Path(self.location)
            for tag, files in (("train", self.train_files), ("eval", self.eval_files)):
                for f in files:
                    path = root if self.kind == "file" else root / f
                    h.update(f"{tag}\0{f}\0{_sha256_file(path)}\0".encode())
        return h.hexdigest()

    def describe(self) -> str:
        """One or two sentences saying what trains and what evaluates."""
        if self.kind == "default":
            topics = _default_topics()
            n_eval = _n_eval(len(topics), self.eval_fraction)
            return (
                f"embedded corpus: CPython's documentation topics (pydoc_data.topics, "
                f"{len(topics)} topics); train on the first {len(topics) - n_eval} topics in "
                f"sorted order, evaluate on the last {n_eval}"
            )
        if self.kind == "wikitext2":
            text = (
                f"WikiText-2 at '{self.location}': train on {self.train_files[0]}, evaluate on "
                f"{self.eval_files[0]}"
            )
            return text + (f" ({self.note})" if self.note else "")
        if self.kind == "file":
            pct = round(100 * (1 - self.eval_fraction))
            return (
                f"text file '{self.location}': train on its first ~{pct}% (cut at a line "
                "boundary), evaluate on the rest"
            )
        if self.kind == "folder":
            if not self.eval_files:
                return (
                    f"text folder '{self.location}' with one file ({self.train_files[0]}): train "
                    f"on its first ~{round(100 * (1 - self.eval_fraction))}% (cut at a line "
                    "boundary), evaluate on the rest"
                )
            return (
                f"text folder '{self.location}': train on {len(self.train_files)} .txt files, "
                f"evaluate on the last {len(self.eval_files)} in path order "
                f"({', '.join(self.eval_files[:3])}{', ...' if len(self.eval_files) > 3 else ''})"
            )
        return (
            f"TFDS dataset {self.location!r} (feature {self.feature!r}): train on split "
            f"{self.train_split!r}, evaluate on split {self.eval_split!r}"
        )


def _default_topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics  # part of every CPython installation

    return sorted((k, v) for k, v in topics.items() if v.strip())


def _check_fraction(eval_fraction: object) -> float:
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)):
        raise TypeError(f"eval_fraction must be a float in (0, 1), got {eval_fraction!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie strictly between 0 and 1, got {eval_fraction!r}")
    return float(eval_fraction)


def resolve_source(
    spec: str | os.PathLike | TextSource,
    *,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    tfds_data_dir: str | os.PathLike | None = None,
) -> TextSource:
    """The :class:`TextSource` of ``spec`` (see the module docstring for the kinds).

    ``spec`` is ``"default"``, a path to a ``.txt`` file, a folder of ``.txt`` files, a
    WikiText-2 folder, ``"tfds:<name>[:<feature>]"`` or a :class:`TextSource` (returned as is).
    ``eval_fraction`` is the share held out for eval where the corpus has no eval split of its
    own; ``tfds_data_dir`` is where TFDS datasets are prepared (default: TFDS's).

    >>> resolve_source("wikipedia")
    Traceback (most recent call last):
    ...
    ValueError: spec must be 'default', a .txt file, a folder of .txt files, a WikiText-2 folder \
or 'tfds:<name>[:<feature>]', got 'wikipedia': no such file or folder (looked for \
'.../wikipedia')
    """
    if isinstance(spec, TextSource):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"spec must be a str, os.PathLike or TextSource, got {type(spec).__name__}: {spec!r}"
        )
    fraction = _check_fraction(eval_fraction)
    if isinstance(spec, str) and spec == "default":
        return TextSource(kind="default", location="pydoc_data.topics", eval_fraction=fraction)
    if isinstance(spec, str) and spec.startswith("tfds:"):
        return _resolve_tfds(spec, fraction, tfds_data_dir)

    path = Path(os.path.expanduser(os.fspath(spec)))
    allowed = (
        "spec must be 'default', a .txt file, a folder of .txt files, a WikiText-2 folder or "
        "'tfds:<name>[:<feature>]'"
    )
    if not path.exists():
        raise ValueError(
            f"{allowed}, got {os.fspath(spec)!r}: no such file or folder (looked for "
            f"'{path.absolute()}')"
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".txt":
            raise ValueError(f"{allowed}, got the file '{path}', which is not a .txt file")
        return TextSource(
            kind="file", location=str(path), train_files=(path.name,), eval_fraction=fraction
        )
    names = _find_wikitext(path)
    if names is not None:
        train, evaluation, official_train = names
        note = (
            f"{official_train} is present but not used: the project trains on {train} and "
            f"evaluates on {evaluation}"
            if (path / official_train).is_file()
            else ""
        )
        return TextSource(
            kind="wikitext2",
            location=str(path),
            train_files=(train,),
            eval_files=(evaluation,),
            note=note,
        )
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(
            f"{allowed}, got the folder '{path}', which holds no .txt file (looked for "
            "'**/*.txt', and for WikiText-2's valid.txt + test.txt)"
        )
    if len(files) == 1:
        return TextSource(
            kind="folder", location=str(path), train_files=tuple(files), eval_fraction=fraction
        )
    n_eval = _n_eval(len(files), fraction)
    return TextSource(
        kind="folder",
        location=str(path),
        train_files=tuple(files[:-n_eval]),
        eval_files=tuple(files[-n_eval:]),
        eval_fraction=fraction,
    )


def _resolve_tfds(spec: str, fraction: float, data_dir: str | os.PathLike | None) -> TextSource:
    import tensorflow_datasets as tfds

    rest = spec[len("tfds:") :]
    name, feature = rest, None
    if ":" in rest:
        head, tail = rest.rsplit(":", 1)
        if not _VERSION_RE.match(tail):
            name, feature = head, tail
    if not name:
        raise ValueError(f"spec must be 'tfds:<name>[:<feature>]', got {spec!r}")
    ddir = None if data_dir is None else os.fspath(data_dir)
    builder = _open_tfds(name, ddir)
    info = builder.info
    texts = [k for k, f in info.features.items() if isinstance(f, tfds.features.Text)]
    if feature is None:
        if len(texts) != 1:
            raise ValueError(
                f"spec {spec!r}: name the text feature as 'tfds:{name}:<feature>'; the dataset "
                f"has the text features {texts} among {sorted(info.features)}"
            )
        feature = texts[0]
    elif feature not in info.features:
        raise ValueError(
            f"spec {spec!r}: the dataset has no feature {feature!r}; its features are "
            f"{sorted(info.features)} (text features: {texts})"
        )
    elif feature not in texts:
        raise ValueError(
            f"spec {spec!r}: the feature {feature!r} is not text (tfds.features.Text); the text "
            f"features are {texts}"
        )
    splits = list(info.splits)
    eval_split = next((s for s in _TFDS_EVAL_SPLITS if s in splits), None)
    if "train" in splits and eval_split is not None:
        train_split = "train"
    elif "train" in splits:
        n_train = info.splits["train"].num_examples
        if n_train < 2:
            raise ValueError(
                f"spec {spec!r}: the dataset has one split ('train') with {n_train} example(s); "
                "at least 2 are needed to hold some out for eval"
            )
        n_eval = _n_eval(n_train, fraction)
        train_split, eval_split = f"train[:{n_train - n_eval}]", f"train[{n_train - n_eval}:]"
    else:
        raise ValueError(
            f"spec {spec!r}: the dataset has no 'train' split (its splits are {splits})"
        )
    return TextSource(
        kind="tfds",
        location=name,
        eval_fraction=fraction,
        feature=feature,
        train_split=train_split,
        eval_split=eval_split,
        data_dir=ddir,
    )


# --------------------------------------------------------------------------------------------
# Token streams and windows.


def token_stream(documents: Iterable[str], tokenizer: Tokenizer, *, chunk: int = 256) -> np.ndarray:
    """Every document's tokens followed by ``tokenizer.eos_id``, concatenated (int32, 1-D).

    >>> from sparse_jax.data.tokenizers import ByteTokenizer
    >>> token_stream(["ab", "c"], ByteTokenizer()).tolist()
    [97, 98, 256, 99, 256]
    """
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise ValueError(f"tokenizer.vocab_size {tokenizer.vocab_size} does not fit in int32")
    eos = np.asarray([tokenizer.eos_id], np.int32)
    pieces: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            pieces.append(np.asarray(ids, np.int32))
            pieces.append(eos)
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) >= chunk:
            flush()
    flush()
    return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def make_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of ``seq_len + 1`` tokens with stride ``seq_len`` (a read-only view).

    Window ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``; the tail that does not
    fill a window is dropped.

    >>> make_windows(np.arange(10), 3).tolist()
    [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    """
    seq_len = check_int(seq_len, "seq_len", "make_windows")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.shape[0] < seq_len + 1:
        raise ValueError(
            f"seq_len {seq_len} needs at least seq_len + 1 = {seq_len + 1} tokens for one window, "
            f"got {tokens.shape[0]}"
        )
    return np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len]


# --------------------------------------------------------------------------------------------
# The TFDS builder.
#
# Defined on first use, so that importing this module does not import tensorflow_datasets (a
# heavy import that only preparing and reading datasets needs); `text.SparseJaxText` and
# `text.SparseJaxTextConfig` still name the classes (the module's __getattr__ builds them).


@functools.cache
def _builder_classes() -> tuple[type, type]:
    """``(SparseJaxText, SparseJaxTextConfig)``, defined once (TFDS registers builders by name)."""
    import tensorflow_datasets as tfds

    @dataclasses.dataclass(eq=False)
    class SparseJaxTextConfig(tfds.core.BuilderConfig):
        """A prepared corpus: its name is ``<kind>_<tokenizer>_s<seq_len>_<hash>``.

        Example (a config like those :func:`prepare` makes, not built):
          >>> from sparse_jax.data.text import SparseJaxTextConfig
          >>> config = SparseJaxTextConfig(name="file_byte_s16_0123456789abcdef", window=17)
          >>> config.name, config.window, config.details  # windows of seq_len + 1 tokens
          ('file_byte_s16_0123456789abcdef', 17, '{}')
        """

        # Tokens per example (seq_len + 1).
        window: int = 0
        # JSON with the source description, tokenizer, token counts (stored as dataset metadata).
        details: str = "{}"

    class SparseJaxText(tfds.core.GeneratorBasedBuilder):
        """Windows of a tokenized corpus: ``{"tokens": int32[seq_len + 1]}``, splits train/eval.

        Written in ``array_record`` format by :func:`prepare` (which passes the windows to the
        constructor); read back with ``tfds.data_source("sparse_jax_text/<config>", data_dir=...)``.

        Example (a dataset :func:`prepare` wrote from a small file, read back by name):
          >>> import tempfile
          >>> import tensorflow_datasets as tfds
          >>> from sparse_jax.data.text import SparseJaxText
          >>> tmp = tempfile.TemporaryDirectory()
          >>> path = Path(tmp.name) / "corpus.txt"
          >>> _ = path.write_text("".join(f"line {i}: the quick brown fox.\\n" for i in range(20)))
          >>> data = prepare(path, "byte", seq_len=16, data_dir=tmp.name)  # TFDS prints 2 lines
          Downloading and preparing dataset ...
          Dataset sparse_jax_text downloaded and prepared to ... reuse this data.
          >>> SparseJaxText.name, data.dataset_name
          ('sparse_jax_text', 'sparse_jax_text/file_byte_s16_...:1.0.0')
          >>> train = tfds.data_source(data.dataset_name, data_dir=tmp.name)["train"]
          >>> len(train), train[0]["tokens"].shape, train[0]["tokens"].dtype  # int32 [seq_len + 1]
          (33, (17,), dtype('int32'))
          >>> tmp.cleanup()
        """

        VERSION = tfds.core.Version(_BUILDER_VERSION)
        RELEASE_NOTES = {"1.0.0": "Windows of seq_len + 1 tokens with stride seq_len."}  # noqa: RUF012

        def __init__(self, *, windows: Mapping[str, np.ndarray] | None = None, **kwargs: Any):
            self._windows = windows
            super().__init__(**kwargs)

        def _info(self) -> tfds.core.DatasetInfo:
            config = self.builder_config
            return self.dataset_info_from_configs(
                description="Token windows for next-token prediction, prepared by sparse_jax.",
                features=tfds.features.FeaturesDict(
                    {
                        "tokens": tfds.features.Tensor(
                            shape=(config.window,),
                            dtype=np.int32,
                            encoding=tfds.features.Encoding.BYTES,
                        )
                    }
                ),
                metadata=tfds.core.MetadataDict(json.loads(config.details)),
                # Example i is window i: keep generation order (TFDS shuffles by default).
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
            if self._windows is None:
                raise RuntimeError("SparseJaxText is written by sparse_jax.data.text.prepare()")
            return {split: self._generate_examples(split) for split in self._windows}

        def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
            for i, window in enumerate(self._windows[split]):
                yield i, {"tokens": np.ascontiguousarray(window)}

    for cls in (SparseJaxText, SparseJaxTextConfig):
        cls.__qualname__ = cls.__name__
    return SparseJaxText, SparseJaxTextConfig


def __getattr__(name: str) -> Any:
    if name == "SparseJaxText":
        return _builder_classes()[0]
    if name == "SparseJaxTextConfig":
        return _builder_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# Prepared data.


class WindowSource:
    """Random access to the windows of one split: ``len``, ``[i]`` -> int32 ``[seq_len + 1]``.

    ``source[[i, j, ...]]`` or ``source.__getitems__([i, j, ...])`` reads several windows at
    once as an int32 ``[n, seq_len + 1]`` array.

    Example (the train windows of a small file, ``seq_len + 1 = 17`` byte tokens each):
      >>> import tempfile
      >>> tmp = tempfile.TemporaryDirectory()
      >>> path = Path(tmp.name) / "corpus.txt"
      >>> _ = path.write_text("".join(f"line {i}: the quick brown fox.\\n" for i in range(20)))
      >>> data = prepare(path, "byte", seq_len=16, data_dir=Path(tmp.name) / "cache")
      Downloading and preparing dataset ...
      Dataset sparse_jax_text downloaded and prepared to ... Subsequent calls will reuse this data.
      >>> windows = data.train
      >>> windows, windows[0].shape, windows[[0, 1, 2]].shape  # [17], then [3, 17]
      (WindowSource(split='train', windows=33, seq_len=16), (17,), (3, 17))
      >>> bytes(windows[0][:16].tolist()), int(windows[1][0]) == int(windows[0][16])  # stride 16
      (b'line 0: the quic', True)
      >>> tmp.cleanup()
    """

    def __init__(self, data_source: Any, *, split: str, seq_len: int, num_tokens: int):
        self._source = data_source
        self.split = split
        self.seq_len = seq_len
        # Tokens of the split's stream (EOS included); the windows cover all but the tail.
        self.num_tokens = num_tokens

    def __len__(self) -> int:
        return len(self._source)

    def _index(self, index: object) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"index must be an int, got {type(index).__name__}: {index!r}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for {n} {self.split} windows")
        return int(index) % n

    def __getitem__(self, index: int | Sequence[int] | np.ndarray) -> np.ndarray:
        if isinstance(index, (Sequence, np.ndarray)) and not isinstance(index, str):
            return self.__getitems__(index)
        return np.asarray(self._source[self._index(index)]["tokens"], np.int32)

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        keys = [self._index(i) for i in np.asarray(indices).reshape(-1).tolist()]
        if not keys:
            return np.zeros((0, self.seq_len + 1), np.int32)
        records = self._source.__getitems__(keys)
        return np.stack([np.asarray(r["tokens"], np.int32) for r in records])

    def __repr__(self) -> str:
        return f"WindowSource(split={self.split!r}, windows={len(self)}, seq_len={self.seq_len})"


@dataclass(frozen=True)
class PreparedData:
    """A corpus tokenized, cut into windows and stored as a TFDS ``array_record`` dataset.

    Example (what :func:`prepare` returns for a small file):
      >>> import tempfile
      >>> tmp = tempfile.TemporaryDirectory()
      >>> path = Path(tmp.name) / "corpus.txt"
      >>> _ = path.write_text("".join(f"line {i}: the quick brown fox.\\n" for i in range(20)))
      >>> data = prepare(path, "byte", seq_len=16, data_dir=Path(tmp.name) / "cache")
      Downloading and preparing dataset ...
      Dataset sparse_jax_text downloaded and prepared to ... Subsequent calls will reuse this data.
      >>> data.tokenizer_name, data.vocab_size, data.eos_id, data.seq_len, data.built
      ('byte', 257, 256, 16, True)
      >>> data.stats["eval"]
      {'documents': 1, 'tokens': 61, 'windows': 3, 'dropped': 12}
      >>> print(data.describe().splitlines()[2])
      train: 531 tokens in 1 documents -> 33 windows (2 tail tokens dropped); eval: 61 tokens ...
      >>> tmp.cleanup()
    """

    # What was tokenized.
    source: TextSource
    # The tokenizer's name, vocabulary size and end-of-text id.
    tokenizer_name: str
    vocab_size: int
    eos_id: int
    # Tokens per window minus one: windows hold seq_len + 1 tokens.
    seq_len: int
    # Random-access windows of each split.
    train: WindowSource
    eval: WindowSource
    # Per split: documents, tokens (EOS included), windows, dropped tail tokens.
    stats: Mapping[str, Mapping[str, int]]
    # The TFDS dataset ("sparse_jax_text/<config>:<version>") and its folder.
    dataset_name: str
    dataset_dir: Path
    # Whether this call wrote the dataset (False: it was already in the cache).
    built: bool

    def describe(self) -> str:
        """What trains and evaluates, in words and numbers, for reports."""

        def split(name: str) -> str:
            s = self.stats[name]
            return (
                f"{name}: {s['tokens']:,} tokens in {s['documents']:,} documents -> "
                f"{s['windows']:,} windows ({s['dropped']} tail tokens dropped)"
            )

        return (
            f"{self.source.describe()}.\nTokenizer {self.tokenizer_name!r} (vocab "
            f"{self.vocab_size}, EOS {self.eos_id} after each document), windows of seq_len + 1 = "
            f"{self.seq_len + 1} tokens, stride {self.seq_len}.\n{split('train')}; "
            f"{split('eval')}.\nStored as TFDS {self.dataset_name} (array_record) in "
            f"'{self.dataset_dir}'."
        )


def _tokenizer_fingerprint(tok: Tokenizer) -> str:
    probe = (
        "The quick brown fox jumps over the lazy dog. 0123456789 <|endoftext|>\n\t"
        "def f(x): return x ** 2  # héllo wörld, 日本語, emoji 🙂, Ελληνικά, русский"
    )
    ids = tok.encode(probe)
    return f"{tok.name}|{tok.vocab_size}|{tok.eos_id}|{ids}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:24] or "tok"


def _as_tokenizer(tokenizer: object) -> Tokenizer:
    if isinstance(tokenizer, (str, os.PathLike)):
        return get_tokenizer(tokenizer)
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            "tokenizer must be a Tokenizer (see sparse_jax.data.tokenizers) or a name for "
            f"get_tokenizer ('byte', 'gpt2', a folder), got {type(tokenizer).__name__}"
        )
    return tokenizer


def prepare(
    source: str | os.PathLike | TextSource,
    tokenizer: Tokenizer | str | os.PathLike = "byte",
    seq_len: int = 1024,
    *,
    data_dir: str | os.PathLike | None = None,
    verbose: bool = False,
) -> PreparedData:
    """Tokenize ``source``, cut it into windows and write them once as a TFDS dataset.

    Args:
      source: a spec for :func:`resolve_source` or a :class:`TextSource`.
      tokenizer: a :class:`~sparse_jax.data.tokenizers.Tokenizer` or a name for
        :func:`~sparse_jax.data.tokenizers.get_tokenizer` (``"byte"``, ``"gpt2"``, a folder).
      seq_len: tokens a model sees per example; windows hold ``seq_len + 1`` (inputs and
        shifted targets).
      data_dir: the TFDS cache (default: :func:`default_data_dir`).
      verbose: show TFDS's progress bars and log lines while writing (False turns TFDS's
        progress bars off for the rest of the process: TFDS's switch has no getter to restore).

    Returns:
      :class:`PreparedData`, whose ``train`` / ``eval`` read the windows back through
      ``tfds.data_source``. A second call with the same source contents, tokenizer and
      ``seq_len`` reuses the files (``built`` is False).

    Raises ``ValueError`` for ``seq_len < 1``, an empty split, or a split shorter than one
    window (the message gives its number of tokens).

    Example (a small text file, windows of ``seq_len + 1 = 17`` byte tokens):
      >>> import tempfile
      >>> tmp = tempfile.TemporaryDirectory()
      >>> path = Path(tmp.name) / "corpus.txt"
      >>> _ = path.write_text("".join(f"line {i}: the quick brown fox.\\n" for i in range(20)))
      >>> data = prepare(path, "byte", seq_len=16, data_dir=Path(tmp.name) / "cache")
      Downloading and preparing dataset ...
      Dataset sparse_jax_text downloaded and prepared to ... Subsequent calls will reuse this data.
      >>> data.train[0].shape, data.train[0].dtype  # one window: int32 [seq_len + 1]
      ((17,), dtype('int32'))
      >>> data.train[[0, 1]].shape  # several windows: [n, seq_len + 1]
      (2, 17)
      >>> len(data.train), len(data.eval), data.stats["train"]["tokens"]
      (33, 3, 531)
      >>> prepare(path, "byte", seq_len=16, data_dir=Path(tmp.name) / "cache").built  # reused
      False
      >>> tmp.cleanup()
    """
    import tensorflow_datasets as tfds

    seq_len = check_int(seq_len, "seq_len", "prepare")
    src = resolve_source(source)
    tok = _as_tokenizer(tokenizer)
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(f"data_dir must be a str or os.PathLike, got {type(data_dir).__name__}")
    root = (Path(data_dir).expanduser() if data_dir is not None else default_data_dir()).absolute()

    key = hashlib.sha256(
        json.dumps([_FORMAT, src.fingerprint(), _tokenizer_fingerprint(tok), seq_len]).encode()
    ).hexdigest()
    config_name = f"{src.kind}_{_slug(tok.name)}_s{seq_len}_{key[:16]}"
    version = _BUILDER_VERSION
    SparseJaxText, SparseJaxTextConfig = _builder_classes()
    name = f"{BUILDER_NAME}/{config_name}:{version}"

    with quiet_tfds(verbose):
        probe = SparseJaxText(
            config=SparseJaxTextConfig(name=config_name, window=seq_len + 1),
            data_dir=root,
            file_format="array_record",
        )
        built = not probe.is_prepared()
        if built:
            windows, stats = _tokenize_splits(src, tok, seq_len)
            details = {
                **stats,
                "source": src.describe(),
                "tokenizer": tok.name,
                "vocab_size": int(tok.vocab_size),
                "eos_id": int(tok.eos_id),
                "seq_len": seq_len,
                "key": key,
            }
            builder = SparseJaxText(
                config=SparseJaxTextConfig(
                    name=config_name, window=seq_len + 1, details=json.dumps(details)
                ),
                data_dir=root,
                file_format="array_record",
                windows=windows,
            )
            prepare_once(builder)
        # Read back through tfds.data_source: it finds the files by name (the builder class has
        # no such config, so TFDS opens the dataset from its files).
        sources = tfds.data_source(name, data_dir=root, download=False)
    meta = dict(sources["train"].dataset_info.metadata)
    stats = {s: {k: int(v) for k, v in meta[s].items()} for s in ("train", "eval")}
    train, evaluation = (
        WindowSource(sources[s], split=s, seq_len=seq_len, num_tokens=stats[s]["tokens"])
        for s in ("train", "eval")
    )
    return PreparedData(
        source=src,
        tokenizer_name=tok.name,
        vocab_size=int(tok.vocab_size),
        eos_id=int(tok.eos_id),
        seq_len=seq_len,
        train=train,
        eval=evaluation,
        stats=stats,
        dataset_name=name,
        dataset_dir=root / BUILDER_NAME / config_name / version,
        built=built,
    )


def _tokenize_splits(
    src: TextSource, tok: Tokenizer, seq_len: int
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, int]]]:
    """The windows of each split and their counts, with the errors of empty or short splits."""
    windows, stats = {}, {}
    for split in ("train", "eval"):
        docs = [d for d in src.documents(split) if d.strip()]
        if not docs:
            raise ValueError(
                f"source is empty: the {split} split of {src.describe()} holds no text"
            )
        tokens = token_stream(docs, tok)
        if tokens.shape[0] < seq_len + 1:
            raise ValueError(
                f"seq_len {seq_len} is too long for the {split} split of {src.describe()}: it "
                f"has {tokens.shape[0]} tokens ({tok.name!r} tokenizer, EOS included) and one "
                f"window needs seq_len + 1 = {seq_len + 1}"
            )
        windows[split] = make_windows(tokens, seq_len)
        n = windows[split].shape[0]
        stats[split] = {
            "documents": len(docs),
            "tokens": int(tokens.shape[0]),
            "windows": int(n),
            "dropped": int(tokens.shape[0] - (n * seq_len + 1)),
        }
    return windows, stats


# --------------------------------------------------------------------------------------------
# Batches.


class _EpochPosition:
    """What :class:`BatchIterator` and :class:`BucketIterator` share: global step ``g`` is step
    ``g % steps_per_epoch`` of epoch ``g // steps_per_epoch``, and the state keys of that."""

    _global_step: int
    seed: int
    batch_size: int
    steps_per_epoch: int

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, step)`` of the next batch."""
        return divmod(self._global_step, self.steps_per_epoch)

    def _state(self, **more: Any) -> dict[str, Any]:
        epoch, step = self.position
        return {
            "epoch": epoch,
            "step": step,
            "global_step": self._global_step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            **more,
        }


class BatchIterator(_EpochPosition):
    """Deterministic, resumable batches of windows: int32 ``[batch_size // process_count, L]``.

    Global step ``g`` is step ``g % steps_per_epoch`` of epoch ``g // steps_per_epoch``. Epoch
    ``e`` visits the examples in the order ``np.random.default_rng([seed, e]).permutation(n)``
    (``shuffle=True``) or in order; its step ``s`` is the global batch of positions
    ``s * batch_size : (s + 1) * batch_size`` of that order. With ``drop_remainder`` the last
    incomplete batch of an epoch is skipped, otherwise it is yielded shorter.

    Multi-host: process ``p`` of ``process_count`` yields rows ``p * b : (p + 1) * b`` of each
    global batch (``b = batch_size // process_count``), so the processes together see exactly
    the single-process batch. ``state()`` does not depend on the process layout.

    The iterator runs for ``num_epochs`` epochs (None: forever). :meth:`state` is a small
    JSON-serializable dict; :meth:`from_state` continues exactly where it was taken.

    >>> data = np.arange(10)[:, None] * np.ones((1, 3), np.int32)
    >>> it = BatchIterator(data, batch_size=4, seed=1)
    >>> [b[:, 0].tolist() for b in (next(it), next(it), next(it))]
    [[8, 4, 7, 0], [1, 2, 5, 9], [7, 2, 4, 6]]
    >>> state = it.state(); state["epoch"], state["step"]
    (1, 1)
    >>> next(BatchIterator.from_state(data, state))[:, 0].tolist() == next(it)[:, 0].tolist()
    True
    """

    def __init__(
        self,
        source: RandomAccess,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_remainder: bool = True,
        start_step: int = 0,
        num_epochs: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise TypeError(
                "source must support len() and integer indexing (a WindowSource or an array "
                f"[n, seq_len + 1]), got {type(source).__name__}"
            )
        self.source = source
        self.num_examples = len(source)
        self.batch_size = check_int(batch_size, "batch_size", "BatchIterator", low=1)
        self.seed = check_int(seed, "seed", "BatchIterator", low=0)
        self.shuffle = check_bool(shuffle, "shuffle", "BatchIterator")
        self.drop_remainder = check_bool(drop_remainder, "drop_remainder", "BatchIterator")
        self.num_epochs = (
            None
            if num_epochs is None
            else check_int(num_epochs, "num_epochs", "BatchIterator", low=1)
        )
        self.process_count = check_int(process_count, "process_count", "BatchIterator", low=1)
        self.process_index = check_int(process_index, "process_index", "BatchIterator", low=0)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"process_index must lie in [0, process_count = {self.process_count}), got "
                f"{self.process_index}"
            )
        if self.num_examples == 0:
            raise ValueError("source is empty: it has no examples to batch")
        if self.batch_size > self.num_examples:
            raise ValueError(
                f"batch_size {self.batch_size} is larger than the number of examples "
                f"({self.num_examples} windows): use a smaller batch_size, a smaller seq_len or "
                "a larger corpus"
            )
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size {self.batch_size} (the global batch) must be divisible by "
                f"process_count {self.process_count}"
            )
        self._global_step = check_int(start_step, "start_step", "BatchIterator", low=0)
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        if self.drop_remainder:
            return self.num_examples // self.batch_size
        return -(-self.num_examples // self.batch_size)

    def state(self) -> dict[str, Any]:
        """Where the iterator is (the next batch) and how it draws: plain ints and bools."""
        return self._state(
            shuffle=self.shuffle,
            drop_remainder=self.drop_remainder,
            num_epochs=self.num_epochs,
            num_examples=self.num_examples,
        )

    @classmethod
    def from_state(
        cls,
        source: RandomAccess,
        state: Mapping[str, Any],
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> BatchIterator:
        """The iterator that :meth:`state` described, continuing with its next batch."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from BatchIterator.state(), got {state!r:.80}")
        missing = {"global_step", "seed", "batch_size", "shuffle", "drop_remainder"} - set(state)
        if missing:
            raise ValueError(f"state lacks the keys {sorted(missing)}: got {sorted(state)}")
        n = state.get("num_examples")
        if n is not None and n != len(source):
            raise ValueError(
                f"state was taken on a source of {n} examples, but source has {len(source)}: "
                "resume on the same prepared data"
            )
        return cls(
            source,
            state["batch_size"],
            seed=state["seed"],
            shuffle=state["shuffle"],
            drop_remainder=state["drop_remainder"],
            start_step=state["global_step"],
            num_epochs=state.get("num_epochs"),
            process_index=process_index,
            process_count=process_count,
        )

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the examples."""
        epoch = check_int(epoch, "epoch", "BatchIterator", low=0)
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(
                    self.num_examples
                )
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def indices(self, global_step: int) -> np.ndarray:
        """Example indices of this process's part of the batch at ``global_step``."""
        epoch, step = divmod(
            check_int(global_step, "global_step", "BatchIterator", low=0), self.steps_per_epoch
        )
        rows = self.epoch_order(epoch)[step * self.batch_size : (step + 1) * self.batch_size]
        if self.process_count == 1:
            return rows
        if rows.shape[0] == self.batch_size:
            b = self.batch_size // self.process_count
            return rows[self.process_index * b : (self.process_index + 1) * b]
        return np.array_split(rows, self.process_count)[self.process_index]

    def _read(self, idx: np.ndarray) -> np.ndarray:
        src = self.source
        if isinstance(src, np.ndarray):
            return np.asarray(src[idx], np.int32)
        if hasattr(src, "__getitems__"):
            out = src.__getitems__(idx.tolist())
            if not isinstance(out, np.ndarray):
                out = np.stack([np.asarray(x) for x in out])
            return out.astype(np.int32, copy=False)
        return np.stack([np.asarray(src[int(i)], np.int32) for i in idx])

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        if self.num_epochs is not None and self.position[0] >= self.num_epochs:
            raise StopIteration
        batch = self._read(self.indices(self._global_step))
        self._global_step += 1
        return batch


class BucketIterator(_EpochPosition):
    """Deterministic, resumable batches from buckets of rows of their own lengths: each batch
    is ``[batch_size, L_b]`` rows of one bucket ``b`` (e.g. examples padded only to the longest
    of their bucket, so that short ones cost less: see ``sparse_jax.cot.length_buckets``).

    Epoch ``e`` draws from ``np.random.default_rng([seed, e])``: each bucket's rows in a random
    order, cut into batches of ``batch_size`` (a bucket's last incomplete batch is skipped,
    other rows each epoch), then all buckets' batches in a random order, so that the buckets
    take turns in proportion to their sizes. Global step ``g`` is step ``g % steps_per_epoch``
    of epoch ``g // steps_per_epoch``; :meth:`state` is a small JSON-serializable dict and
    :meth:`from_state` continues exactly where it was taken. One process (the experiments that
    use it train on one).

    >>> short = np.zeros((5, 3), np.int32); long = np.ones((6, 8), np.int32)
    >>> it = BucketIterator([short, long], batch_size=2, seed=0)
    >>> it.steps_per_epoch  # 5 // 2 + 6 // 2
    5
    >>> sorted(next(it).shape[1] for _ in range(5))  # an epoch: 2 short batches, 3 long ones
    [3, 3, 8, 8, 8]
    >>> state = it.state(); state["epoch"], state["step"]
    (1, 0)
    >>> resumed = BucketIterator.from_state([short, long], state)
    >>> np.array_equal(next(resumed), next(it))
    True
    """

    def __init__(
        self,
        buckets: Sequence[np.ndarray],
        batch_size: int,
        *,
        seed: int = 0,
        start_step: int = 0,
    ):
        if isinstance(buckets, np.ndarray) or not isinstance(buckets, Sequence) or not buckets:
            raise TypeError(
                "BucketIterator: `buckets` must be a non-empty list of arrays [n_b, L_b] (one "
                f"per bucket); got {type(buckets).__name__}"
            )
        arrays = []
        for b, rows in enumerate(buckets):
            if not isinstance(rows, np.ndarray) or rows.ndim != 2:
                raise TypeError(
                    f"BucketIterator: bucket {b} must be a 2-D array [n_b, L_b]; got "
                    f"{getattr(rows, 'shape', type(rows).__name__)}"
                )
            arrays.append(rows)
        self.buckets = arrays
        self.batch_size = check_int(batch_size, "batch_size", "BucketIterator", low=1)
        self.seed = check_int(seed, "seed", "BucketIterator", low=0)
        small = [b for b, rows in enumerate(arrays) if rows.shape[0] < self.batch_size]
        if small:
            sizes = [arrays[b].shape[0] for b in small]
            raise ValueError(
                f"BucketIterator: buckets {small} hold {sizes} rows, fewer than batch_size "
                f"{self.batch_size}: they would never be drawn; merge them into others"
            )
        self._global_step = check_int(start_step, "start_step", "BucketIterator", low=0)
        self._epoch = -1
        self._order: list[tuple[int, np.ndarray]] = []

    @property
    def bucket_sizes(self) -> list[int]:
        """Rows in each bucket."""
        return [int(rows.shape[0]) for rows in self.buckets]

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch: ``sum(n_b // batch_size)``."""
        return sum(n // self.batch_size for n in self.bucket_sizes)

    def state(self) -> dict[str, Any]:
        """Where the iterator is (the next batch) and how it draws: plain ints."""
        return self._state(bucket_sizes=self.bucket_sizes)

    @classmethod
    def from_state(cls, buckets: Sequence[np.ndarray], state: Mapping[str, Any]) -> BucketIterator:
        """The iterator that :meth:`state` described, continuing with its next batch."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from BucketIterator.state(), got {state!r:.80}")
        missing = {"global_step", "seed", "batch_size", "bucket_sizes"} - set(state)
        if missing:
            raise ValueError(f"state lacks the keys {sorted(missing)}: got {sorted(state)}")
        it = cls(buckets, state["batch_size"], seed=state["seed"], start_step=state["global_step"])
        if list(state["bucket_sizes"]) != it.bucket_sizes:
            raise ValueError(
                f"state was taken on buckets of {list(state['bucket_sizes'])} rows, but buckets "
                f"hold {it.bucket_sizes}: resume on the same prepared data and buckets"
            )
        return it

    def epoch_batches(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """Epoch ``epoch``'s batches in order, each ``(bucket, row indices in that bucket)``."""
        epoch = check_int(epoch, "epoch", "BucketIterator", low=0)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            batches = []
            for b, n in enumerate(self.bucket_sizes):
                order = rng.permutation(n)
                size = self.batch_size
                batches += [(b, order[s * size : (s + 1) * size]) for s in range(n // size)]
            self._order = [batches[i] for i in rng.permutation(len(batches))]
            self._epoch = epoch
        return self._order

    def __iter__(self) -> BucketIterator:
        return self

    def __next__(self) -> np.ndarray:
        epoch, step = self.position
        bucket, idx = self.epoch_batches(epoch)[step]
        self._global_step += 1
        return np.asarray(self.buckets[bucket][idx], np.int32)
