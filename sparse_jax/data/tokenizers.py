"""Tokenizers with one small interface: GPT-2's byte-level BPE (through ``tiktoken``) and a
byte-level tokenizer that needs no files at all.

Every tokenizer here satisfies the :class:`Tokenizer` protocol:

* ``encode(text) -> list[int]``: token ids as a plain Python list (``tiktoken``'s native form;
  ``np.asarray(ids, np.int32)`` makes an array). ``encode`` never emits the end-of-text id, even
  for text that contains the literal string ``"<|endoftext|>"`` (it is encoded as ordinary text):
  a data pipeline appends ``eos_id`` itself where a document ends.
* ``encode_batch(texts) -> list[list[int]]``: ``encode`` over a sequence of strings.
* ``decode(ids) -> str``: ids may be a list/tuple of ints or a 1-D integer NumPy/JAX array; an id
  outside ``[0, vocab_size)`` raises ``ValueError``. Bytes that are not valid UTF-8 (a prefix cut
  in the middle of a character) decode to U+FFFD, never an error.
* ``vocab_size``, ``eos_id``, ``name``: the number of ids (embedding rows), the end-of-text id and
  a short name (``"byte"``, ``"gpt2"``, ``"bpe:<folder>"``).

``decode(encode(s)) == s`` for every string ``s`` that is valid Unicode. Lone surrogates (which
cannot be UTF-8 encoded) become U+FFFD, as in ``tiktoken``.

The GPT-2 vocabulary is read from local files, never fetched behind the user's back:

* :meth:`GPT2Tokenizer.from_files` takes a folder holding either OpenAI's files
  (``vocab.bpe`` + ``encoder.json``) or Hugging Face's (``merges.txt`` + ``vocab.json``) and builds
  the same ``tiktoken.Encoding`` as ``tiktoken.get_encoding("gpt2")`` (GPT-2's split pattern, its
  byte-to-unicode table, merge ranks, ``<|endoftext|>`` = 50256).
* :meth:`GPT2Tokenizer.load` uses, in order: the files in ``cache_dir``; ``tiktoken``'s own cache
  (``TIKTOKEN_CACHE_DIR``); and, unless offline, a download with a time limit. Offline
  (``offline=True``, or ``SPARSE_JAX_OFFLINE`` / ``HF_HUB_OFFLINE`` set to ``1``) and with no files
  it raises :class:`TokenizerFilesError`, whose message names the missing files, the folder to put
  them in and the URLs to fetch them from on a machine with network.

Example:

>>> tok = get_tokenizer("byte")
>>> ids = tok.encode("héllo")
>>> ids
[104, 195, 169, 108, 108, 111]
>>> tok.decode(ids + [tok.eos_id])
'héllo'
>>> tok.vocab_size, tok.eos_id, tok.name
(257, 256, 'byte')
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np
import tiktoken

from sparse_jax.files import replace_atomically

__all__ = [
    "GPT2_FILE_URLS",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "TokenizerFilesError",
    "bytes_to_unicode",
    "get_tokenizer",
]

ENDOFTEXT = "<|endoftext|>"

# GPT-2's pre-tokenization pattern exactly as tiktoken writes it for its "gpt2" encoding
# (tiktoken_ext/openai_public.py, ``r50k_pat_str``): equivalent to the original release's
# r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+" but faster.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)

# Where the GPT-2 vocabulary files can be fetched on a machine with network, and the SHA-256 of
# OpenAI's two files (the hashes tiktoken checks).
GPT2_FILE_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "merges.txt": "https://huggingface.co/openai-community/gpt2/resolve/main/merges.txt",
    "vocab.json": "https://huggingface.co/openai-community/gpt2/resolve/main/vocab.json",
}
_GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# A folder holds one merges file and one vocabulary file; either name of each role is accepted
# (OpenAI's name first, which wins when both are present).
_MERGES_NAMES = ("vocab.bpe", "merges.txt")
_VOCAB_NAMES = ("encoder.json", "vocab.json")

_GPT2_N_RANKS = 50256  # mergeable tokens of GPT-2: 256 bytes + 50000 merges
_OFFLINE_ENV = ("SPARSE_JAX_OFFLINE", "HF_HUB_OFFLINE")


class TokenizerFilesError(FileNotFoundError):
    """The files a tokenizer needs are not where it looked; ``missing`` names them.

    The message says which files are missing, where to put them and where to fetch them.
    """

    def __init__(self, message: str, missing: Sequence[str] = ()):
        super().__init__(message)
        self.missing = tuple(missing)


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer of the project provides (see the module docstring for the contract).

    >>> isinstance(ByteTokenizer(), Tokenizer)
    True
    """

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


# --------------------------------------------------------------------------------------------
# Argument checks shared by the tokenizers.


def _check_text(text: object, arg: str = "text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{arg} must be a str, got {type(text).__name__}: {text!r:.80}")
    return text


def _check_texts(texts: object) -> Sequence[str]:
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(
            "texts must be a sequence of str (a list or tuple), got "
            f"{type(texts).__name__}: {texts!r:.80}; for one string use encode(text)"
        )
    for i, text in enumerate(texts):
        _check_text(text, f"texts[{i}]")
    return texts


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates cannot be encoded; replace them with U+FFFD as tiktoken does.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def _check_ids(ids: object, vocab_size: int) -> np.ndarray:
    """``ids`` as a 1-D int64 array with every value in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(
            f"ids must be a sequence of ints or a 1-D integer array, got {type(ids).__name__}"
        )
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got an array of shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"ids[{i}] = {int(arr[i])} is not a token id: ids must lie in [0, {vocab_size}) "
            f"(vocab_size = {vocab_size}); {bad.size} id(s) are out of range"
        )
    return arr


# --------------------------------------------------------------------------------------------
# Byte-level tokenizer.


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and end-of-text as id 256 (``vocab_size`` 257); needs no files.

    ``decode`` drops every ``eos_id`` and replaces invalid UTF-8 with U+FFFD.

    >>> tok = ByteTokenizer()
    >>> tok.encode("a€")
    [97, 226, 130, 172]
    >>> tok.decode([97, 256, 226, 130])  # EOS dropped, the cut '€' becomes U+FFFD
    'a�'
    >>> tok.encode_batch(["hi", ""])
    [[104, 105], []]
    """

    name: ClassVar[str] = "byte"
    vocab_size: ClassVar[int] = 257
    eos_id: ClassVar[int] = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ints (no EOS appended)."""
        return list(_utf8(_check_text(text)))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``."""
        return [list(_utf8(t)) for t in _check_texts(texts)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``: EOS ids dropped, invalid UTF-8 replaced by U+FFFD."""
        arr = _check_ids(ids, self.vocab_size)
        data = arr[arr != self.eos_id].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# GPT-2 BPE through tiktoken.


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to the printable character that stands for it in its files.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are mapped to
    chr(256), chr(257), ... in byte order. The table's order is also the order of the ids of the
    256 one-byte tokens in GPT-2's vocabulary.

    >>> table = bytes_to_unicode()
    >>> table[ord("a")], table[ord(" ")], table[0], list(table.values()).index("a")
    ('a', 'Ġ', 'Ā', 64)
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _find_files(folder: Path) -> tuple[Path | None, Path | None]:
    merges = next((folder / n for n in _MERGES_NAMES if (folder / n).is_file()), None)
    vocab = next((folder / n for n in _VOCAB_NAMES if (folder / n).is_file()), None)
    return merges, vocab


def _where_to_get_them() -> str:
    urls = GPT2_FILE_URLS
    return (
        "On a machine with network, fetch OpenAI's files\n"
        f"    {urls['vocab.bpe']}\n    {urls['encoder.json']}\n"
        "or Hugging Face's (the 'openai-community/gpt2' repository, formerly 'gpt2')\n"
        f"    {urls['merges.txt']}\n    {urls['vocab.json']}"
    )


def _missing_files_error(
    folder: Path, merges: Path | None, vocab: Path | None, extra: str = ""
) -> TokenizerFilesError:
    roles = (("merges file", _MERGES_NAMES, merges), ("vocabulary file", _VOCAB_NAMES, vocab))
    groups = [(role, names) for role, names, found in roles if found is None]
    lacks = " and ".join(
        f"the {role} ({' or '.join(repr(n) for n in names)})" for role, names in groups
    )
    state = "does not exist" if not folder.exists() else "lacks them"
    return TokenizerFilesError(
        f"GPT-2 tokenizer files missing: {lacks}. The folder '{folder}' {state}. Put into it "
        "either OpenAI's vocab.bpe + encoder.json or Hugging Face's merges.txt + vocab.json "
        f"(one merges file and one vocabulary file).{extra}\n" + _where_to_get_them(),
        missing=[n for _, names in groups for n in names],
    )


def _read_gpt2_files(merges_path: Path, vocab_path: Path) -> tuple[dict[bytes, int], int]:
    """GPT-2-style files -> (tiktoken mergeable ranks, id of ``<|endoftext|>``).

    Mirrors ``tiktoken.load.data_gym_to_mergeable_bpe_ranks`` (which tiktoken's "gpt2" encoding
    uses) without its download cache, which is keyed by path and would return a stale copy when a
    local file changes: the 256 one-byte tokens take ranks 0..255 in ``bytes_to_unicode`` order,
    merge ``i`` (in file order) makes the token of rank 256 + i, and the vocabulary file must agree
    with these ranks.
    """
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}

    def to_bytes(token: str, where: str) -> bytes:
        try:
            return bytes(char_to_byte[c] for c in token)
        except KeyError as e:
            raise ValueError(
                f"{where}: token {token!r} has the character {e.args[0]!r}, which is not in "
                "GPT-2's byte-to-unicode table: this is not a byte-level BPE file"
            ) from None

    ranks = {bytes([b]): i for i, b in enumerate(bytes_to_unicode())}
    lines = merges_path.read_text(encoding="utf-8").split("\n")
    for lineno, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split()
        where = f"{merges_path}:{lineno}"
        if len(parts) != 2:
            raise ValueError(
                f"{where}: a merge line must be two tokens separated by a space, got {line!r}"
            )
        merged = to_bytes(parts[0], where) + to_bytes(parts[1], where)
        if merged in ranks:
            raise ValueError(
                f"{where}: the merge {line!r} makes {parts[0] + parts[1]!r}, which already has "
                f"rank {ranks[merged]}"
            )
        ranks[merged] = len(ranks)

    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{vocab_path} is not valid JSON: {e}") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"{vocab_path} must be a JSON object mapping tokens to integer ids")
    eos_id = vocab.pop(ENDOFTEXT, len(ranks))
    vocab.pop("<|startoftext|>", None)  # as tiktoken: not a mergeable token
    loaded = {to_bytes(k, str(vocab_path)): v for k, v in vocab.items()}
    if loaded != ranks:
        diff = sorted(set(loaded.items()) ^ set(ranks.items()), key=lambda kv: kv[1])
        examples = ", ".join(f"{k!r}: {v}" for k, v in diff[:4])
        raise ValueError(
            f"{vocab_path} ({len(loaded)} tokens) does not match the merges in {merges_path} "
            f"(256 bytes + {len(ranks) - 256} merges): BPE ids must equal merge ranks; "
            f"{len(diff)} (token, id) pairs differ, e.g. {examples}"
        )
    if eos_id in ranks.values() or eos_id < 0:
        raise ValueError(
            f"{vocab_path}: {ENDOFTEXT!r} has id {eos_id}, which must be >= {len(ranks)} "
            "(after every mergeable token)"
        )
    return ranks, eos_id


def _env_offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in _OFFLINE_ENV
    )


def _tiktoken_cache_dir() -> str:
    """The folder tiktoken caches downloads in ('' when its cache is disabled)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _tiktoken_has_gpt2() -> bool:
    """Whether tiktoken's cache holds both GPT-2 files intact (then no network is needed)."""
    cache = _tiktoken_cache_dir()
    if not cache:
        return False
    for name, sha in _GPT2_SHA256.items():
        path = Path(cache) / hashlib.sha1(GPT2_FILE_URLS[name].encode()).hexdigest()
        try:
            if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
                return False
        except OSError:
            return False
    return True


_T = TypeVar("_T")


def _with_time_limit(fn: Callable[[], _T], seconds: float, what: str) -> _T:
    """Runs ``fn`` in a daemon thread and gives up after ``seconds`` (DNS look-ups ignore socket
    timeouts, so a plain timeout argument cannot bound them)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=target, name=f"sparse_jax: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {seconds} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _download_gpt2(folder: Path, timeout: float) -> None:
    """Fetches OpenAI's vocab.bpe and encoder.json into ``folder``, checking their SHA-256."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, sha in _GPT2_SHA256.items():
        url = GPT2_FILE_URLS[name]

        def fetch(url: str = url) -> bytes:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.read()

        data = _with_time_limit(fetch, timeout, f"downloading {url}")
        if hashlib.sha256(data).hexdigest() != sha:
            raise ValueError(f"the download of {url} is corrupt (its SHA-256 is not {sha})")
        replace_atomically(folder / name, lambda tmp, data=data: tmp.write_bytes(data))


def _as_path(value: object, arg: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{arg} must be a str or os.PathLike folder, got {type(value).__name__}")
    return Path(value)


@dataclass(frozen=True)
class GPT2Tokenizer:
    """GPT-2's byte-level BPE: a thin wrapper of a ``tiktoken.Encoding``.

    Build it with :meth:`from_files` (a folder with the vocabulary files, never the network) or
    :meth:`load` (cache folder, tiktoken's cache, then a download unless offline). ``encode`` is
    tiktoken's ``encode_ordinary`` (``"<|endoftext|>"`` in the text is plain text); ``decode``
    renders ``eos_id`` as ``"<|endoftext|>"``, as tiktoken and Hugging Face do.

    With the real GPT-2 files, ``encode("Hello world") == [15496, 995]``, ``vocab_size == 50257``
    and ``eos_id == 50256``. The example below builds a tiny vocabulary (the 256 bytes and one
    merge, "h" + "e") in Hugging Face's layout:

    >>> import json, pathlib, tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> folder = pathlib.Path(tmp.name)
    >>> vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    >>> vocab.update({"he": 256, "<|endoftext|>": 257})
    >>> _ = (folder / "vocab.json").write_text(json.dumps(vocab))
    >>> _ = (folder / "merges.txt").write_text("#version: 0.2\\nh e\\n")
    >>> tok = GPT2Tokenizer.from_files(folder)
    >>> tok.encode("hehe!"), tok.vocab_size, tok.eos_id
    ([256, 256, 0], 258, 257)
    >>> tok.decode([256, 0, 257])
    'he!<|endoftext|>'
    >>> tmp.cleanup()
    """

    # The tiktoken encoding; it must have the special token "<|endoftext|>".
    encoding: tiktoken.Encoding
    # Short name: "gpt2" for GPT-2's own vocabulary, "bpe:<folder name>" for another one.
    name: str = "gpt2"

    def __post_init__(self) -> None:
        if not isinstance(self.encoding, tiktoken.Encoding):
            raise TypeError(
                f"encoding must be a tiktoken.Encoding, got {type(self.encoding).__name__}"
            )
        if ENDOFTEXT not in self.encoding.special_tokens_set:
            raise ValueError(
                f"encoding {self.encoding.name!r} has no {ENDOFTEXT!r} special token; it has "
                f"{sorted(self.encoding.special_tokens_set)}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (50257 for GPT-2)."""
        return self.encoding.n_vocab

    @property
    def eos_id(self) -> int:
        """The id of ``<|endoftext|>`` (50256 for GPT-2)."""
        return self.encoding.eot_token

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text``; special-token strings in it are encoded as plain text."""
        return self.encoding.encode_ordinary(_check_text(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, computed by tiktoken's thread pool."""
        return self.encoding.encode_ordinary_batch(list(_check_texts(texts)))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``; invalid UTF-8 becomes U+FFFD, ``eos_id`` ``"<|endoftext|>"``."""
        return self.encoding.decode(_check_ids(ids, self.vocab_size).tolist(), errors="replace")

    @classmethod
    def from_files(cls, folder: str | os.PathLike) -> GPT2Tokenizer:
        """The tokenizer of the GPT-2-style vocabulary in ``folder``; never touches the network.

        ``folder`` holds one merges file (``vocab.bpe`` or ``merges.txt``) and one vocabulary
        file (``encoder.json`` or ``vocab.json``): OpenAI's and Hugging Face's layouts, whose
        contents are the same. Raises :class:`TokenizerFilesError` naming the missing files, and
        ``ValueError`` when the files are malformed or disagree with each other.
        """
        path = _as_path(folder, "folder")
        if path.exists() and not path.is_dir():
            raise ValueError(
                f"folder must be a folder holding the GPT-2 vocabulary files, got the file '{path}'"
            )
        merges, vocab = _find_files(path)
        if merges is None or vocab is None:
            raise _missing_files_error(path, merges, vocab)
        ranks, eos_id = _read_gpt2_files(merges, vocab)
        is_gpt2 = len(ranks) == _GPT2_N_RANKS and eos_id == _GPT2_N_RANKS
        name = "gpt2" if is_gpt2 else f"bpe:{path.resolve().name}"
        encoding = tiktoken.Encoding(
            name=name,
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={ENDOFTEXT: eos_id},
        )
        return cls(encoding=encoding, name=name)

    @classmethod
    def load(
        cls,
        cache_dir: str | os.PathLike | None = None,
        *,
        offline: bool | None = None,
        timeout: float = 30.0,
    ) -> GPT2Tokenizer:
        """GPT-2's tokenizer from the first source that has it.

        1. ``cache_dir``, when given and holding the files (either layout, see :meth:`from_files`);
        2. tiktoken's cache (``TIKTOKEN_CACHE_DIR``, else ``$TMPDIR/data-gym-cache``), when it
           holds both GPT-2 files intact: ``tiktoken.get_encoding("gpt2")``, no network;
        3. unless ``offline``: a download, limited to ``timeout`` seconds per file: OpenAI's
           ``vocab.bpe`` and ``encoder.json`` into ``cache_dir`` when given (checked against their
           SHA-256), else ``tiktoken.get_encoding("gpt2")`` (which caches them itself).

        ``offline`` defaults to True when ``SPARSE_JAX_OFFLINE`` or ``HF_HUB_OFFLINE`` is
        ``1``/``true``/``yes``/``on``. When no source has the files, raises
        :class:`TokenizerFilesError` naming the missing files, where to put them and where to
        fetch them.
        """
        explicit_offline = offline is not None
        if offline is None:
            offline = _env_offline()
        if not isinstance(offline, bool):
            raise TypeError(f"offline must be a bool or None, got {offline!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        folder = None if cache_dir is None else _as_path(cache_dir, "cache_dir")

        if folder is not None and all(_find_files(folder)):
            return cls.from_files(folder)
        if _tiktoken_has_gpt2():
            return cls(encoding=tiktoken.get_encoding("gpt2"), name="gpt2")

        reason = None
        if offline:
            from_env = [f"{v}={os.environ[v]!r}" for v in _OFFLINE_ENV if v in os.environ]
            why = "offline=True" if explicit_offline else " and ".join(from_env)
            reason = f"nothing was downloaded: offline ({why})"
        else:
            try:
                if folder is not None:
                    _download_gpt2(folder, float(timeout))
                    return cls.from_files(folder)
                encoding = _with_time_limit(
                    lambda: tiktoken.get_encoding("gpt2"), float(timeout), "tiktoken's download"
                )
                return cls(encoding=encoding, name="gpt2")
            except (OSError, ValueError) as e:  # URLError and TimeoutError are OSErrors
                reason = f"the download failed ({type(e).__name__}: {e})"

        cache = _tiktoken_cache_dir() or "(disabled: TIKTOKEN_CACHE_DIR='')"
        if folder is not None:
            merges, vocab = _find_files(folder)
            extra = f" They are not in tiktoken's cache '{cache}' either, and {reason}."
            raise _missing_files_error(folder, merges, vocab, extra)
        raise TokenizerFilesError(
            f"GPT-2 tokenizer files missing: no cache_dir was given, tiktoken's cache '{cache}' "
            f"does not hold 'vocab.bpe' and 'encoder.json', and {reason}. Put either OpenAI's "
            "vocab.bpe + encoder.json or Hugging Face's merges.txt + vocab.json into a folder and "
            "call GPT2Tokenizer.load(cache_dir=folder) or GPT2Tokenizer.from_files(folder) (or "
            "get_tokenizer(folder)).\n" + _where_to_get_them(),
            missing=("vocab.bpe", "encoder.json"),
        )


# --------------------------------------------------------------------------------------------


_NAMES = ("byte", "gpt2")


def get_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    offline: bool | None = None,
) -> ByteTokenizer | GPT2Tokenizer:
    """A tokenizer by name or folder.

    ``"byte"``: :class:`ByteTokenizer`; ``"gpt2"``: :meth:`GPT2Tokenizer.load` with ``cache_dir``
    and ``offline``; an existing folder: :meth:`GPT2Tokenizer.from_files` (the names win over a
    folder of the same name in the working directory).

    >>> get_tokenizer("byte").name
    'byte'
    >>> get_tokenizer("bert")
    Traceback (most recent call last):
    ...
    ValueError: name_or_path must be one of 'byte', 'gpt2' or an existing folder with GPT-2 \
vocabulary files, got 'bert'
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"name_or_path must be a str or os.PathLike, got {type(name_or_path).__name__}"
        )
    if isinstance(name_or_path, str):
        if name_or_path == "byte":
            return ByteTokenizer()
        if name_or_path == "gpt2":
            return GPT2Tokenizer.load(cache_dir, offline=offline)
    if Path(name_or_path).is_dir():
        return GPT2Tokenizer.from_files(name_or_path)
    raise ValueError(
        "name_or_path must be one of "
        + ", ".join(repr(n) for n in _NAMES)
        + f" or an existing folder with GPT-2 vocabulary files, got {os.fspath(name_or_path)!r}"
    )
