"""Corpora: where the text lies and how it splits into train and eval documents.

:func:`resolve_source` turns a spec (``"default"``, a ``.txt`` file, a folder of ``.txt`` files, a
WikiText-2 folder or ``"tfds:<name>[:<feature>]"``; see :mod:`sparse_jax.data.text`) into a
:class:`TextSource`, whose ``documents(split)`` reads the text. Importing this module does not
import ``tensorflow_datasets`` (only reading a TFDS source does).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparse_jax.data.tfds_store import quiet_tfds

__all__ = ["DEFAULT_EVAL_FRACTION", "TextSource", "resolve_source"]

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
    >>> n = len(train) + len(evaluation)  # one document per non-empty topic
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
