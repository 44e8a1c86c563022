"""sparse_jax.data.tokenizers: the byte tokenizer, GPT-2 BPE built from local files in both
layouts (checked against tiktoken's own construction), the offline errors and get_tokenizer.

No test touches the network: every test runs offline (SPARSE_JAX_OFFLINE=1, an empty tiktoken
cache) with socket connections refused.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_jax.data.tokenizers import (
    GPT2_FILE_URLS,
    GPT2_PATTERN,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    TokenizerFilesError,
    bytes_to_unicode,
    get_tokenizer,
)


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in tests")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("SPARSE_JAX_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken_cache")))
    monkeypatch.setattr(socket, "getaddrinfo", _no_network)
    monkeypatch.setattr(socket.socket, "connect", _no_network)


# --------------------------------------------------------------------------------------------
# ByteTokenizer


@pytest.mark.parametrize(
    "text",
    ["", "hello world", "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 flags 🇫🇷", "\x00\n\t\r"],
)
def test_byte_round_trip_examples(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(isinstance(i, int) and 0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_property(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.eos_id, *tok.encode(text), tok.eos_id]) == text


def test_byte_eos_and_sizes():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
    assert isinstance(tok, Tokenizer)
    assert tok.decode([104, 256, 105, 256]) == "hi"
    assert tok.decode([256]) == ""
    assert tok.decode([]) == ""
    assert tok.eos_id not in tok.encode("<|endoftext|>")  # never emitted by encode


def test_byte_invalid_utf8_is_replaced():
    tok = ByteTokenizer()
    euro = tok.encode("€")
    assert tok.decode(euro[:2]) == "\ufffd"
    assert tok.decode([0xFF, 97]) == "\ufffda"


def test_byte_lone_surrogate_becomes_replacement_char():
    assert ByteTokenizer().decode(ByteTokenizer().encode("a\ud800b")) == "a\ufffdb"


def test_byte_encode_batch():
    tok = ByteTokenizer()
    assert tok.encode_batch(["ab", "", "é"]) == [[97, 98], [], [195, 169]]
    with pytest.raises(TypeError, match="texts must be a sequence of str"):
        tok.encode_batch("ab")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        tok.encode_batch(["a", 3])


def test_byte_argument_errors():
    tok = ByteTokenizer()
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(ValueError, match=r"ids\[1\] = 257 .*\[0, 257\)"):
        tok.decode([1, 257])
    with pytest.raises(ValueError, match=r"ids\[0\] = -1"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="ids must be integers, got dtype float"):
        tok.decode([1.0, 2.0])
    with pytest.raises(ValueError, match=r"ids must be 1-D, got an array of shape \(1, 2\)"):
        tok.decode([[1, 2]])
    with pytest.raises(TypeError, match="ids must be a sequence of ints"):
        tok.decode("abc")


def test_byte_is_frozen():
    tok = ByteTokenizer()
    with pytest.raises(AttributeError):
        tok.eos_id = 3
    assert ByteTokenizer() == tok


# --------------------------------------------------------------------------------------------
# A tiny but valid GPT-2-style vocabulary: the 256 byte tokens in GPT-2's order and six merges.

MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("l", "l"), ("he", "ll"), ("hell", "o")]
HE, G_T, G_THE, LL, HELL, HELLO = range(256, 262)
EOS = 262


def _tiny_vocab() -> dict[str, int]:
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def _byte_id(b: int) -> int:
    return list(bytes_to_unicode()).index(b)


def write_openai_layout(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES)
    (folder / "vocab.bpe").write_text(merges, encoding="utf-8")
    (folder / "encoder.json").write_text(json.dumps(_tiny_vocab()), encoding="utf-8")
    return folder


def write_hf_layout(folder: Path) -> Path:
    """Same content as OpenAI's layout, formatted differently (Windows line ends, no final
    newline, indented and reordered JSON)."""
    folder.mkdir(parents=True, exist_ok=True)
    merges = "#version: 0.2\r\n" + "\r\n".join(f"{a} {b}" for a, b in MERGES)
    (folder / "merges.txt").write_text(merges, encoding="utf-8", newline="")
    vocab = dict(sorted(_tiny_vocab().items(), key=lambda kv: -kv[1]))
    (folder / "vocab.json").write_text(
        json.dumps(vocab, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    return folder


@pytest.fixture
def openai_dir(tmp_path):
    return write_openai_layout(tmp_path / "openai")


@pytest.fixture
def hf_dir(tmp_path):
    return write_hf_layout(tmp_path / "hf")


def test_bytes_to_unicode_matches_tiktoken_data_gym_order():
    # tiktoken.load.data_gym_to_mergeable_bpe_ranks orders the one-byte tokens like this.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    order = printable + [b for b in range(256) if b not in printable]
    table = bytes_to_unicode()
    assert list(table) == order
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_pattern_is_tiktokens_gpt2_pattern():
    from tiktoken_ext import openai_public

    assert GPT2_PATTERN == openai_public.r50k_pat_str


@pytest.mark.parametrize("layout", ["openai", "hf"])
def test_gpt2_tiny_vocabulary_merges(layout, openai_dir, hf_dir):
    tok = GPT2Tokenizer.from_files(openai_dir if layout == "openai" else hf_dir)
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id) == (263, EOS)
    assert tok.name == f"bpe:{layout}"
    assert tok.encode("hello the") == [HELLO, G_THE]
    assert tok.encode("he") == [HE]
    assert tok.encode(" t") == [G_T]
    assert tok.encode("hell") == [HELL]
    assert tok.encode("ll") == [LL]
    assert tok.encode("x") == [_byte_id(ord("x"))] == [87]
    assert tok.encode("é") == [_byte_id(0xC3), _byte_id(0xA9)]
    assert tok.encode("") == []
    assert tok.decode([HELLO, G_THE]) == "hello the"
    assert tok.decode([HELLO, EOS]) == "hello<|endoftext|>"
    # the literal special-token string is plain text for encode
    assert EOS not in tok.encode("<|endoftext|>")
    assert tok.decode(tok.encode("<|endoftext|>")) == "<|endoftext|>"
    assert tok.encode_batch(["hello", " the", ""]) == [[HELLO], [G_THE], []]


def test_gpt2_both_layouts_identical(openai_dir, hf_dir):
    a, b = GPT2Tokenizer.from_files(openai_dir), GPT2Tokenizer.from_files(hf_dir)
    texts = ["hello the hell", "Hello, world! 123 'll've\n\n  x", "日本 🙂", "the the the"]
    assert [a.encode(t) for t in texts] == [b.encode(t) for t in texts]
    for i in range(a.vocab_size):
        assert a.encoding.decode_single_token_bytes(i) == b.encoding.decode_single_token_bytes(i)


def test_gpt2_matches_tiktoken_construction(openai_dir, monkeypatch):
    """Same ranks and ids as tiktoken's own GPT-2 loader (data_gym_to_mergeable_bpe_ranks with
    local paths; its cache disabled) and pattern, so real GPT-2 files give tiktoken's ids."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's cache is keyed by path: bypass it
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        str(openai_dir / "vocab.bpe"), str(openai_dir / "encoder.json")
    )
    reference = tiktoken.Encoding(
        name="ref",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOS},
    )
    tok = GPT2Tokenizer.from_files(openai_dir)
    assert tok.vocab_size == reference.n_vocab
    for token, rank in ranks.items():
        assert tok.encoding.decode_single_token_bytes(rank) == token
    texts = ["hello the hell", " the  the\n\nthe", "héllo 'll 12 3.5 ??", "\t hello\u00a0the"]
    for text in texts:
        assert tok.encode(text) == reference.encode_ordinary(text)


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_gpt2_round_trip_property(text):
    # Files written once per process (a hypothesis test cannot take a function-scoped fixture).
    tok = _tiny_tokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text]) == [tok.encode(text)]


_CACHE: dict[str, GPT2Tokenizer] = {}


def _tiny_tokenizer() -> GPT2Tokenizer:
    if "tok" not in _CACHE:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            _CACHE["tok"] = GPT2Tokenizer.from_files(write_openai_layout(Path(tmp)))
    return _CACHE["tok"]


def test_gpt2_decode_checks_ids(openai_dir):
    tok = GPT2Tokenizer.from_files(openai_dir)
    with pytest.raises(ValueError, match=r"ids\[0\] = 263 .*\[0, 263\)"):
        tok.decode([263])
    assert tok.decode(np.asarray([HELLO], np.int64)) == "hello"


def test_gpt2_folder_can_be_str_and_mixed_names(tmp_path):
    folder = tmp_path / "mixed"
    write_openai_layout(folder)
    (folder / "encoder.json").rename(folder / "vocab.json")  # vocab.bpe + vocab.json
    tok = GPT2Tokenizer.from_files(str(folder))
    assert tok.encode("hello") == [HELLO]


# --------------------------------------------------------------------------------------------
# Missing and malformed files


def _all_names():
    return ["vocab.bpe", "merges.txt", "encoder.json", "vocab.json"]


def test_missing_everything_names_each_file_and_where(tmp_path):
    with pytest.raises(TokenizerFilesError) as info:
        GPT2Tokenizer.from_files(tmp_path)
    message = str(info.value)
    for name in _all_names():
        assert repr(name) in message or name in message
    assert str(tmp_path) in message
    for url in GPT2_FILE_URLS.values():
        assert url in message
    assert set(info.value.missing) == set(_all_names())
    assert isinstance(info.value, FileNotFoundError)


def test_missing_one_file_names_only_it(openai_dir):
    (openai_dir / "encoder.json").unlink()
    with pytest.raises(TokenizerFilesError, match=r"'encoder.json' or 'vocab.json'") as info:
        GPT2Tokenizer.from_files(openai_dir)
    assert info.value.missing == ("encoder.json", "vocab.json")
    assert str(info.value).startswith(
        "GPT-2 tokenizer files missing: the vocabulary file ('encoder.json' or 'vocab.json'). "
    )


def test_missing_folder(tmp_path):
    with pytest.raises(TokenizerFilesError, match="does not exist"):
        GPT2Tokenizer.from_files(tmp_path / "nope")


def test_folder_argument_errors(tmp_path):
    with pytest.raises(TypeError, match=r"folder must be a str or os.PathLike"):
        GPT2Tokenizer.from_files(3)
    file = tmp_path / "f.txt"
    file.write_text("x")
    with pytest.raises(ValueError, match="folder must be a folder"):
        GPT2Tokenizer.from_files(file)


def test_vocab_disagreeing_with_merges(openai_dir):
    vocab = _tiny_vocab()
    vocab["he"], vocab["Ġt"] = vocab["Ġt"], vocab["he"]
    (openai_dir / "encoder.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="does not match the merges"):
        GPT2Tokenizer.from_files(openai_dir)


def test_malformed_merge_line(openai_dir):
    (openai_dir / "vocab.bpe").write_text("#version: 0.2\nh e x\n")
    with pytest.raises(ValueError, match=r"vocab.bpe:2: a merge line must be two tokens"):
        GPT2Tokenizer.from_files(openai_dir)


def test_non_byte_level_token(openai_dir):
    (openai_dir / "vocab.bpe").write_text("#version: 0.2\nh \u4e00\n")
    with pytest.raises(ValueError, match="not in GPT-2's byte-to-unicode table"):
        GPT2Tokenizer.from_files(openai_dir)


# --------------------------------------------------------------------------------------------
# GPT2Tokenizer.load and get_tokenizer


def test_load_offline_without_files_explains(tmp_path):
    with pytest.raises(TokenizerFilesError) as info:
        GPT2Tokenizer.load()
    message = str(info.value)
    assert "vocab.bpe" in message and "encoder.json" in message
    assert "offline" in message and "SPARSE_JAX_OFFLINE='1'" in message
    assert GPT2_FILE_URLS["vocab.bpe"] in message and GPT2_FILE_URLS["vocab.json"] in message
    assert "cache_dir" in message

    with pytest.raises(TokenizerFilesError) as info:
        GPT2Tokenizer.load(tmp_path / "cache")
    assert str(tmp_path / "cache") in str(info.value)
    assert "offline" in str(info.value)

    with pytest.raises(TokenizerFilesError, match=r"offline \(offline=True\)"):
        GPT2Tokenizer.load(offline=True)


def test_load_offline_from_env_hf(monkeypatch):
    monkeypatch.delenv("SPARSE_JAX_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerFilesError, match="nothing was downloaded"):
        GPT2Tokenizer.load()


def test_load_online_but_no_network_fails_quickly(tmp_path):
    # Sockets are blocked by the autouse fixture: the download fails at once, with the same help.
    with pytest.raises(TokenizerFilesError) as info:
        GPT2Tokenizer.load(tmp_path / "cache", offline=False, timeout=5)
    assert "the download failed" in str(info.value)
    assert info.value.missing == ("vocab.bpe", "merges.txt", "encoder.json", "vocab.json")
    assert not any((tmp_path / "cache").glob("*.tmp"))


def test_load_from_cache_dir(hf_dir):
    tok = GPT2Tokenizer.load(cache_dir=hf_dir)
    assert tok.encode("hello the") == [HELLO, G_THE]


def test_load_argument_errors():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        GPT2Tokenizer.load(timeout=0)
    with pytest.raises(TypeError, match="offline must be a bool"):
        GPT2Tokenizer.load(offline="yes")
    with pytest.raises(TypeError, match=r"cache_dir must be a str or os.PathLike"):
        GPT2Tokenizer.load(cache_dir=1)


def test_gpt2_tokenizer_checks_encoding():
    with pytest.raises(TypeError, match=r"encoding must be a tiktoken.Encoding"):
        GPT2Tokenizer(encoding="gpt2")
    no_eos = tiktoken.Encoding(
        name="x",
        pat_str=GPT2_PATTERN,
        mergeable_ranks={bytes([b]): b for b in range(256)},
        special_tokens={},
    )
    with pytest.raises(ValueError, match="has no '<\\|endoftext\\|>' special token"):
        GPT2Tokenizer(encoding=no_eos)


def test_get_tokenizer_dispatch(openai_dir):
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    for arg in (openai_dir, str(openai_dir)):
        tok = get_tokenizer(arg)
        assert isinstance(tok, GPT2Tokenizer) and tok.encode("hello") == [HELLO]
    with pytest.raises(TokenizerFilesError, match="offline"):
        get_tokenizer("gpt2")
    tok = get_tokenizer("gpt2", cache_dir=openai_dir)
    assert tok.encode("the") == [_byte_id(ord("t")), HE]


def test_get_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"one of 'byte', 'gpt2' or an existing folder.*'bert'"):
        get_tokenizer("bert")
    with pytest.raises(ValueError, match="got 'nope'"):
        get_tokenizer("nope")
    with pytest.raises(ValueError, match="existing folder"):
        get_tokenizer(tmp_path / "nope")
    with pytest.raises(TypeError, match=r"name_or_path must be a str or os.PathLike, got int"):
        get_tokenizer(3)
    with pytest.raises(TokenizerFilesError):  # an existing folder without the files
        get_tokenizer(tmp_path)


# --------------------------------------------------------------------------------------------
# Golden ids with the real GPT-2 files, where a folder holding them is named.

_REAL = os.environ.get("SPARSE_JAX_GPT2_DIR")


@pytest.mark.skipif(
    not _REAL, reason="set SPARSE_JAX_GPT2_DIR to a folder with GPT-2's vocabulary files"
)
def test_real_gpt2_files_golden_ids():
    tok = GPT2Tokenizer.from_files(_REAL)
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    assert tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
