"""TFDS storage: :func:`prepare` tokenizes a corpus, cuts it into windows and writes them once
as a TFDS ``array_record`` dataset through the builder ``SparseJaxText``, then reads them back
without TensorFlow (:class:`PreparedData`, one :class:`WindowSource` per split). Importing this
module does not import ``tensorflow_datasets``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparse_jax.data.text.batches import make_windows, token_stream
from sparse_jax.data.text.corpora import TextSource, resolve_source
from sparse_jax.data.tfds_store import default_data_dir, prepare_once, quiet_tfds
from sparse_jax.data.tokenizers import Tokenizer, get_tokenizer
from sparse_jax.validation import check_int

__all__ = [
    "BUILDER_NAME",
    "PreparedData",
    "SparseJaxText",  # noqa: F822 (defined on first use by __getattr__)
    "SparseJaxTextConfig",  # noqa: F822
    "WindowSource",
    "prepare",
]

# Bumped when the layout of the prepared datasets changes (it is part of every dataset's hash).
_FORMAT = 1
BUILDER_NAME = "sparse_jax_text"
_BUILDER_VERSION = "1.0.0"  # SparseJaxText.VERSION


# --------------------------------------------------------------------------------------------
# The TFDS builder.
#
# Defined on first use, so that importing this module does not import tensorflow_datasets (a
# heavy import that only preparing and reading datasets needs); `text.SparseJaxText` and
# `text.SparseJaxTextConfig` still name the classes (this module's __getattr__ builds them, the
# package's passes them on).


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
