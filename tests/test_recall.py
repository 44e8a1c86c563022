"""sparse_jax.data.recall: passkey and MQAR sequences (determinism, exact lengths for the byte
tokenizer and a small GPT-2 BPE written here, the key once at its depth), grading, accuracy per
(length, depth), the TFDS round trip and the errors of bad arguments.

Everything runs offline (socket connections refused) and writes only under pytest's tmp_path.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparse_jax.data import recall
from sparse_jax.data.recall import (
    Filler,
    MQARTask,
    PasskeyTask,
    RecallBatch,
    continuations_from_argmax,
    grade,
    grade_batch,
    make_examples,
    make_filler,
    prepare,
    score,
)
from sparse_jax.data.recall.generator import (
    ANSWER,
    MQAR_PAIR,
    PASSKEY_QUESTION,
    PASSKEY_STATEMENT,
)
from sparse_jax.data.tokenizers import ByteTokenizer, GPT2Tokenizer, bytes_to_unicode

ROOT = Path(__file__).resolve().parents[1]
BYTE = ByteTokenizer()
# Filler of short words (a unit is at most 6 byte tokens) with numbers in it, so that keys
# collide with it now and then.
WORDS = (
    "the cat sat on a mat and saw 7 dogs run by the old red barn while 12 hens ate corn in "
    "the sun as wind blew over 3 hills to the sea where boats sail at dawn 40 days a year"
)
TEXT = " ".join([WORDS] * 3)


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in tests")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("SPARSE_JAX_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken_cache")))
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path_factory.mktemp("tfds_default")))
    monkeypatch.setenv("SPARSE_JAX_DATA_DIR", str(tmp_path_factory.mktemp("sj_default")))
    monkeypatch.setattr(socket, "getaddrinfo", _no_network)
    monkeypatch.setattr(socket.socket, "connect", _no_network)


# A small GPT-2-style vocabulary written here: the 256 byte tokens in GPT-2's order and merges
# that make numbers and the tasks' words multi-byte tokens (so that answers differ in length).
DIGITS = "0123456789"
MERGES = (
    [("Ġ", d) for d in DIGITS]
    + [(a, b) for a in DIGITS for b in DIGITS]
    + [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"), ("Ġ", "p"), ("Ġp", "a"), ("Ġpa", "s")]
    + [("Ġpas", "s"), ("Ġ", "k"), ("Ġk", "e"), ("Ġke", "y"), ("a", "t"), ("Ġ", "c")]
)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> GPT2Tokenizer:
    folder = tmp_path_factory.mktemp("bpe")
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.bpe").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES), encoding="utf-8"
    )
    (folder / "encoder.json").write_text(json.dumps(vocab), encoding="utf-8")
    tok = GPT2Tokenizer.from_files(folder)
    assert len(tok.encode(" 48213")) < 6 and len(tok.encode(" the")) == 1  # merges at work
    return tok


@pytest.fixture(params=["byte", "bpe"])
def tok(request, bpe):
    return BYTE if request.param == "byte" else bpe


def _text(tok, ids) -> str:
    return tok.decode(np.asarray(ids).tolist())


def _standalone(word: str, text: str) -> int:
    return len(re.findall(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", text))


# --------------------------------------------------------------------------------------------
# Imports.


def test_importing_the_package_does_not_import_tfds():
    code = (
        "import sparse_jax.data.recall; import sys; "
        "loaded = [m for m in ('tensorflow_datasets', 'array_record') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------
# Determinism.


@pytest.mark.parametrize("task", ["passkey", "mqar"])
def test_same_seed_same_ids_other_seed_other_keys(task, tok):
    filler = make_filler(TEXT, tok)
    a = make_examples(task, tok, filler, length=200, count=8, seed=3)
    b = make_examples(task, tok, filler, length=200, count=8, seed=3)
    np.testing.assert_array_equal(a.ids, b.ids)
    for name in ("answer_start", "answer_len", "answer", "depth", "position", "filler_len"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.key == b.key and a.answer_text == b.answer_text
    other = make_examples(task, tok, filler, length=200, count=8, seed=4)
    assert set(a.key) != set(other.key) and not np.array_equal(a.ids, other.ids)
    # Example i depends on (seed, i) only: fewer examples are a prefix.
    first = make_examples(task, tok, filler, length=200, count=3, seed=3)
    np.testing.assert_array_equal(first.ids, a.ids[:3])
    # Text, TextSource-free: a str filler gives what its Filler gives.
    np.testing.assert_array_equal(
        make_examples(task, tok, TEXT, length=200, count=8, seed=3).ids, a.ids
    )


def test_keys_have_the_requested_digits():
    batch = make_examples(PasskeyTask(digits=3), BYTE, TEXT, length=120, count=20, seed=0)
    assert all(len(k[0]) == 3 and k[0][0] != "0" and k[0].isdigit() for k in batch.key)
    assert len({k[0] for k in batch.key}) > 10


# --------------------------------------------------------------------------------------------
# Passkey: exact lengths, the key once at its depth, the decoded text.


@pytest.mark.parametrize("length", [120, 257, 600])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_sequences(tok, length, depth):
    filler = make_filler(TEXT, tok)
    unit = int(np.diff(filler.starts).max())  # the longest filler unit, in tokens
    batch = make_examples("passkey", tok, filler, length=length, count=4, depths=depth, seed=1)
    assert batch.ids.shape == (4, length) and batch.ids.dtype == np.int32
    assert batch.answer.shape[:2] == (4, 1) and batch.num_queries == 1
    cyclic = "".join(re.findall(r"\s*\S{1,16}", TEXT))
    cyclic = "\n" + cyclic  # the first unit gets a newline (the stream is read cyclically)
    for i in range(4):
        ex = batch[i]
        key = ex.key[0]
        statement = PASSKEY_STATEMENT.format(key=key)
        answer = ANSWER.format(value=key)
        s_ids = tok.encode(statement)
        q_ids = tok.encode(PASSKEY_QUESTION)
        a_ids = tok.encode(answer)
        # The answer: the last tokens, exactly the tokens of the answer after the question.
        assert ex.answer == (tuple(a_ids),) and ex.answer_text == (answer,)
        assert tok.encode(PASSKEY_QUESTION + answer) == q_ids + a_ids
        assert ex.prompt_len == length - len(a_ids) == ex.answer_start[0]
        assert ex.ids[ex.prompt_len :].tolist() == a_ids
        assert ex.ids[ex.prompt_len - len(q_ids) : ex.prompt_len].tolist() == q_ids
        # The statement at its position, at the requested depth within one filler unit.
        pos = ex.position[0]
        assert ex.ids[pos : pos + len(s_ids)].tolist() == s_ids
        n = ex.filler_len
        assert n == length - len(s_ids) - len(q_ids) - len(a_ids)
        assert abs(pos - depth * n) <= unit and 0 <= pos <= n
        assert ex.depth == (pytest.approx(depth),)
        # The text: filler, statement, filler, question, answer; the filler a window of TEXT.
        before, after = ex.ids[:pos], ex.ids[pos + len(s_ids) : ex.prompt_len - len(q_ids)]
        text = _text(tok, ex.ids)
        assert (
            text == _text(tok, before) + statement + _text(tok, after) + PASSKEY_QUESTION + answer
        )
        window = _text(tok, np.concatenate([before, after]))
        assert window in cyclic * (2 + length // len(cyclic))
        # The key stated once, asked once, answered once; nowhere in the filler.
        assert text.count(statement) == 1 and text.count(PASSKEY_QUESTION) == 1
        assert _standalone(key, text) == 2 and _standalone(key, text[: -len(answer)]) == 1
        assert text.lower().count("pass key") == 3  # statement, question twice


def test_shortest_length_has_no_filler(tok):
    filler = make_filler(TEXT, tok)
    probe = make_examples("passkey", tok, filler, length=300, count=5, seed=0)
    fixed = 300 - probe.filler_len
    assert len(set(fixed.tolist())) == 1 or tok is not BYTE  # bytes: the same for every key
    shortest = int(fixed.max())
    batch = make_examples("passkey", tok, filler, length=shortest, count=5, seed=0)
    assert batch.ids.shape == (5, shortest)
    assert batch.filler_len.min() == 0 and batch.key == probe.key
    with pytest.raises(
        ValueError, match=rf"`length` must be at least {shortest} .*got {shortest - 1}"
    ):
        make_examples("passkey", tok, filler, length=shortest - 1, count=5, seed=0)


@pytest.mark.parametrize("task, examples", [("passkey", 16), ("mqar", 16), ("mqar", 3)])
def test_shortest_length_is_the_first_length_that_fits(task, examples):
    shortest = recall.shortest_length(task, "byte", examples=examples)
    make_examples(task, BYTE, "x", length=shortest, count=examples, seed=0)
    with pytest.raises(ValueError, match="`length` must be at least"):
        make_examples(task, BYTE, "x", length=shortest - 1, count=examples, seed=0)


def test_depths_cycle_over_examples_and_draw_when_none():
    grid = (0.1, 0.5, 0.9)
    batch = make_examples("passkey", BYTE, TEXT, length=200, count=7, depths=grid)
    np.testing.assert_allclose(batch.depth[:, 0], [grid[i % 3] for i in range(7)], atol=1e-7)
    drawn = make_examples("passkey", BYTE, TEXT, length=200, count=50)
    assert 0 <= drawn.depth.min() and drawn.depth.max() < 1 and len(set(drawn.depth[:, 0])) == 50
    order = np.argsort(drawn.depth[:, 0])
    assert np.all(np.diff(drawn.position[order, 0]) >= -8)  # deeper: later (within a unit)


def test_default_filler_is_the_embedded_corpus():
    batch = make_examples("passkey", "byte", length=512, count=2, depths=0.5)
    text = BYTE.decode(batch.ids[0])
    statement = PASSKEY_STATEMENT.format(key=batch.key[0][0])
    assert batch.ids.shape == (2, 512) and text.count(statement) == 1
    assert recall.default_filler("byte") is recall.default_filler(BYTE)


def test_a_tokenizer_folder_by_name(bpe, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.bpe").write_text("#version: 0.2\n")
    (folder / "encoder.json").write_text(json.dumps(vocab))
    batch = make_examples("passkey", str(folder), TEXT, length=150, count=2)
    assert batch.tokenizer == "bpe:tok" and batch.ids.shape == (2, 150)


# --------------------------------------------------------------------------------------------
# MQAR.


@pytest.mark.parametrize("layout", ["scattered", "dense"])
def test_mqar_sequences(tok, layout):
    task = MQARTask(num_pairs=6, num_queries=3, layout=layout)
    depths = 0.5 if layout == "dense" else None
    filler = make_filler(TEXT, tok)
    batch = make_examples(task, tok, filler, length=300, count=5, depths=depths, seed=2)
    assert batch.ids.shape == (5, 300) and batch.answer_start.shape == (5, 3)
    for i in range(5):
        ex = batch[i]
        text = _text(tok, ex.ids)
        pairs = re.findall(r" ([a-z]{2}): (\d{3})\.", text)
        assert len(pairs) == 6 and len({k for k, _ in pairs}) == 6
        values = dict(pairs)
        assert len(set(values.values())) == 6
        # The queries: " Recall: k: v, k: v, k: v" at the end, answers right after "k:".
        tail = " Recall: " + ", ".join(f"{k}: {values[k]}" for k in ex.key)
        assert text.endswith(tail) and text.count(" Recall:") == 1
        assert len(set(ex.key)) == 3
        for q, key in enumerate(ex.key):
            answer = ANSWER.format(value=values[key])
            assert ex.answer_text[q] == answer and ex.answer[q] == tuple(tok.encode(answer))
            start = ex.answer_start[q]
            assert ex.ids[start : start + len(ex.answer[q])].tolist() == list(ex.answer[q])
            assert _text(tok, ex.prompt(q)).endswith(f" {key}:")
            # The queried pair's statement at its position, stated once.
            pair = tok.encode(MQAR_PAIR.format(key=key, value=values[key]))
            assert ex.ids[ex.position[q] : ex.position[q] + len(pair)].tolist() == pair
            assert text.count(MQAR_PAIR.format(key=key, value=values[key])) == 1
            assert _standalone(key, text) == 2 and _standalone(values[key], text) == 2
        if layout == "dense":
            block = "".join(MQAR_PAIR.format(key=k, value=v) for k, v in pairs)
            assert block in text and set(ex.depth) == {0.5}
        else:
            assert len(set(ex.depth)) == 3


def test_mqar_custom_vocabularies():
    task = MQARTask(num_pairs=3, num_queries=3, keys=("ab", "cd", "ef"), values=("x1", "y2", "z3"))
    batch = make_examples(task, BYTE, TEXT, length=200, count=4)
    for ex in (batch[i] for i in range(4)):
        assert sorted(ex.key) == ["ab", "cd", "ef"]
        assert sorted(ex.answer_text) == [" x1", " y2", " z3"]


# --------------------------------------------------------------------------------------------
# Grading.


def test_grade_right_wrong_and_garbled(tok):
    ex = make_examples("passkey", tok, TEXT, length=150, count=1, seed=5)[0]
    answer = list(ex.answer[0])
    text = ex.answer_text[0]
    assert grade(answer, ex) and grade(np.asarray(answer, np.int32), ex)
    assert grade(answer + tok.encode(". And more"), ex)  # extra tokens after the answer
    assert not grade(answer[:-1], ex) and not grade([], ex)  # partial answers
    wrong_key = str((int(ex.key[0]) + 1) % 10 ** len(ex.key[0])).zfill(len(ex.key[0]))
    assert not grade(tok.encode(" " + wrong_key), ex)
    assert not grade([-1] * len(answer), ex) and not grade([10**9, *answer], ex)
    assert not grade([tok.eos_id, *answer], ex)
    # Text: the answer's text, leading space included, then anything.
    assert grade(text, ex) and grade(text + "\nWhat", ex)
    assert not grade(text.strip(), ex) and not grade(text[:-1], ex) and not grade("", ex)
    assert not grade(text[:3] + "\ufffd" + text[4:], ex)  # undecodable bytes
    garbled = tok.decode([0xFF, *answer]) if tok is BYTE else "\ufffd" + text
    assert not grade(garbled, ex)


def test_grade_mqar_queries():
    task = MQARTask(num_pairs=4, num_queries=2)
    ex = make_examples(task, BYTE, TEXT, length=200, count=1)[0]
    assert grade(list(ex.answer[1]), ex, query=1) and not grade(list(ex.answer[1]), ex, query=0)
    with pytest.raises(ValueError, match=r"grade: `query` must be an int in \[0, 1\]; got 2"):
        grade("x", ex, query=2)


def test_grade_refuses_what_is_no_answer():
    ex = make_examples("passkey", BYTE, TEXT, length=150, count=1)[0]
    with pytest.raises(TypeError, match="got bytes"):
        grade(b" 123", ex)
    with pytest.raises(TypeError, match="token ids \\(ints\\); got dtype float"):
        grade([1.0, 2.0], ex)
    with pytest.raises(ValueError, match=r"1-D token ids; got shape \(1, 2\)"):
        grade([[1, 2]], ex)
    with pytest.raises(TypeError, match="`example` must be a RecallExample"):
        grade("x", "example")


def test_argmax_continuations_and_grade_batch(tok):
    task = MQARTask(num_pairs=5, num_queries=3)
    batch = make_examples(task, tok, TEXT, length=260, count=6, seed=9)
    perfect = batch.ids[:, 1:]
    cont = continuations_from_argmax(batch, perfect)
    assert cont.shape == batch.answer.shape and cont.dtype == np.int32
    np.testing.assert_array_equal(cont, batch.answer)
    assert grade_batch(batch, cont).all()
    assert not grade_batch(batch, np.zeros((6, 3, 0), np.int64)).any()  # nothing written
    # One wrong prediction inside an answer makes that query wrong, one outside changes nothing.
    wrong = perfect.copy()
    s = batch.answer_start
    wrong[2, s[2, 1] - 1 + batch.answer_len[2, 1] - 1] += 1  # last token of query 1, example 2
    wrong[4, s[4, 0] - 2] += 1  # the token before query 0's answer
    correct = grade_batch(batch, continuations_from_argmax(batch, wrong))
    expected = np.ones((6, 3), bool)
    expected[2, 1] = False
    np.testing.assert_array_equal(correct, expected)
    # The same through grade, one example at a time; and with [N, T] argmax.
    for i in range(6):
        for q in range(3):
            assert (
                grade(continuations_from_argmax(batch, wrong)[i, q], batch[i], q) == expected[i, q]
            )
    full = np.concatenate([wrong, np.zeros((6, 1), wrong.dtype)], axis=1)
    np.testing.assert_array_equal(
        grade_batch(batch, continuations_from_argmax(batch, full)), expected
    )
    # Text continuations: N sequences of Q strings.
    texts = [list(t) for t in batch.answer_text]
    texts[0][2] = " 000"
    assert grade_batch(batch, texts).sum() == 6 * 3 - 1


def test_score_is_accuracy_per_length_and_depth(tok):
    rng = np.random.default_rng(0)
    grid = (0.1, 0.5, 0.9)
    batches, conts, hand = [], [], {}
    for length in (140, 220):
        batch = make_examples(
            "passkey", tok, TEXT, length=length, count=12, depths=grid, seed=length
        )
        cont = batch.answer[:, 0].copy()
        broken = rng.random(12) < 0.4
        cont[broken, 0] = -1  # garble the first token
        batches.append(batch)
        conts.append(cont)
        for i in range(12):
            ok = grade(cont[i][cont[i] != -1] if broken[i] else cont[i], batch[i])
            assert ok == (not broken[i])
            hand.setdefault((length, grid[i % 3]), []).append(ok)
    expected = {k: sum(v) / len(v) for k, v in sorted(hand.items())}
    assert score(batches, conts) == pytest.approx(expected)
    assert list(score(batches, conts)) == sorted(expected)
    one = score(batches[0], conts[0])
    assert one == pytest.approx({k: v for k, v in expected.items() if k[0] == 140})
    binned = score(batches, conts, depth_bins=2)  # 0.1 -> bin 0 (0.25); 0.5, 0.9 -> bin 1 (0.75)
    for length in (140, 220):
        low = hand[(length, 0.1)]
        high = hand[(length, 0.5)] + hand[(length, 0.9)]
        assert binned[(length, 0.25)] == pytest.approx(sum(low) / len(low))
        assert binned[(length, 0.75)] == pytest.approx(sum(high) / len(high))


# --------------------------------------------------------------------------------------------
# TFDS.


def _same(a: RecallBatch, b: RecallBatch) -> None:
    for name in ("ids", "answer_start", "answer_len", "answer", "depth", "position", "filler_len"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    assert (a.task, a.tokenizer, a.seed, a.key, a.answer_text) == (
        b.task, b.tokenizer, b.seed, b.key, b.answer_text,
    )  # fmt: skip


def test_tfds_round_trip(tmp_path, bpe):
    cache = tmp_path / "cache"
    args = {"length": 150, "count": 5, "depths": (0.2, 0.8), "seed": 1}
    first = prepare("passkey", "byte", TEXT, data_dir=cache, **args)
    assert first.built and first.dataset_name.startswith(
        "sparse_jax_recall/passkey_byte_l150_n5_s1_"
    )
    records = sorted(first.dataset_dir.glob("*.array_record*"))
    assert {p.name.split(".")[0] for p in records} == {"sparse_jax_recall-test"}
    _same(first.batch, make_examples("passkey", "byte", TEXT, **args))
    mtimes = {p: p.stat().st_mtime_ns for p in records}
    again = prepare("passkey", "byte", TEXT, data_dir=cache, **args)
    assert not again.built and again.dataset_dir == first.dataset_dir
    assert {p: p.stat().st_mtime_ns for p in records} == mtimes
    _same(again.batch, first.batch)
    other = prepare("passkey", "byte", TEXT, data_dir=cache, **{**args, "seed": 2})
    assert other.built and other.dataset_dir != first.dataset_dir
    # MQAR with BPE: answers of several widths, Q = 2.
    task = MQARTask(num_pairs=3, num_queries=2)
    mq = prepare(task, bpe, TEXT, length=200, count=4, data_dir=cache)
    _same(mq.batch, make_examples(task, bpe, TEXT, length=200, count=4))
    meta = json.loads((mq.dataset_dir / "dataset_info.json").read_text())
    assert "fileFormat" in meta and meta["fileFormat"] == "array_record"


# --------------------------------------------------------------------------------------------
# Errors.


def test_bad_arguments_are_named_before_anything_runs(tmp_path):
    def make(**kwargs):
        args = {"task": "passkey", "tokenizer": "byte", "filler": TEXT, "length": 200, "count": 2}
        return make_examples(**{**args, **kwargs})

    with pytest.raises(
        ValueError, match=r"unknown `task`='needle'; allowed: \('passkey', 'mqar'\)"
    ):
        make(task="needle")
    with pytest.raises(TypeError, match="`task` must be one of"):
        make(task=3)
    for depth in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=rf"`depths` must be numbers in \[0, 1\]; got {depth}"):
            make(depths=depth)
    with pytest.raises(ValueError, match=r"`depths` must be numbers in \[0, 1\]; got 2 at index 1"):
        make(depths=[0.5, 2])
    with pytest.raises(TypeError, match=r"`depths` must be numbers in \[0, 1\]; got True"):
        make(depths=True)
    with pytest.raises(TypeError, match=r"`depths` must be numbers in \[0, 1\]; got '0.5'$"):
        make(depths="0.5")
    np.testing.assert_array_equal(make(depths=np.float64(0.5)).ids, make(depths=[0.5]).ids)
    with pytest.raises(ValueError, match="non-empty sequence"):
        make(depths=[])
    with pytest.raises(ValueError, match="`depths` must be None for MQAR's scattered layout"):
        make(task="mqar", depths=0.5)
    with pytest.raises(
        ValueError, match=r"`length` must be at least 80 \(the key statement, question and answer"
    ):
        make(length=79)
    with pytest.raises(ValueError, match=r"`length` must be at least .* pairs, queries and"):
        make(task="mqar", length=50)
    with pytest.raises(
        ValueError, match="PasskeyTask: `digits` must be an int in \\[1, 18\\]; got 0"
    ):
        PasskeyTask(digits=0)
    with pytest.raises(ValueError, match=r"`num_queries` must be at most `num_pairs` \(3\); got 4"):
        MQARTask(num_pairs=3, num_queries=4)
    with pytest.raises(
        ValueError, match=r"`keys` must hold at least `num_pairs` \(3\) words; got 2"
    ):
        MQARTask(num_pairs=3, num_queries=1, keys=("ab", "cd"))
    with pytest.raises(ValueError, match=r"`values` must be words of ASCII .*got 'a b' at index 1"):
        MQARTask(num_pairs=2, num_queries=1, values=("x", "a b"))
    with pytest.raises(ValueError, match="`keys` must be distinct; 'ab' repeats"):
        MQARTask(num_pairs=2, num_queries=1, keys=("ab", "cd", "ab"))
    with pytest.raises(ValueError, match="unknown `layout`='list'"):
        MQARTask(layout="list")
    for empty in ("", "  \n "):
        with pytest.raises(ValueError, match=r"`filler` must hold text .*got '"):
            make(filler=empty)
    with pytest.raises(TypeError, match="`filler` must be a Filler, a str"):
        make(filler=3)
    with pytest.raises(ValueError, match="`text` must hold text"):
        make_filler("", "byte")
    with pytest.raises(ValueError, match="make_examples: `count` must be an int >= 1; got 0"):
        make(count=0)
    with pytest.raises(ValueError, match="make_examples: `seed` must be an int >= 0; got -1"):
        make(seed=-1)
    with pytest.raises(TypeError, match="`tokenizer` must be a Tokenizer"):
        make(tokenizer=3)
    with pytest.raises(ValueError, match="unknown `split`='test'"):
        make_filler(TEXT, "byte", split="test")
    # Nothing was written by prepare's refusals.
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"`depths` must be numbers in \[0, 1\]; got 1.5"):
        prepare("passkey", "byte", TEXT, length=200, count=2, depths=1.5, data_dir=cache)
    with pytest.raises(ValueError, match="`length` must be at least 80"):
        prepare("passkey", "byte", TEXT, length=20, count=2, data_dir=cache)
    with pytest.raises(ValueError, match="unknown `task`='needle'"):
        prepare("needle", "byte", TEXT, length=200, count=2, data_dir=cache)
    assert not (cache / "sparse_jax_recall").exists() or not any(
        (cache / "sparse_jax_recall").glob("*/*/dataset_info.json")
    )


def test_filler_of_another_tokenizer(bpe):
    with pytest.raises(
        ValueError, match=r"`filler` was made for tokenizer 'bpe:.*not for `tokenizer` 'byte'"
    ):
        make_examples("passkey", "byte", make_filler(TEXT, bpe), length=200, count=1)


def test_filler_that_always_holds_the_key():
    digits = "1 2 3 4 5 6 7 8 9 " * 20  # every window holds every 1-digit key
    with pytest.raises(ValueError, match=r"found no window .* free of the key '\d' and the phrase"):
        make_examples(PasskeyTask(digits=1), "byte", digits, length=120, count=1)
    with pytest.raises(ValueError, match="found no window of 40 tokens"):
        make_examples("passkey", "byte", "the pass key " * 20, length=120, count=1)


def test_a_tokenizer_that_merges_the_answer_into_the_question():
    class Merging:
        name, vocab_size, eos_id = "merging", 257, 256

        def encode(self, text):
            return list(text.replace("is 4", "\x01").encode())

        def encode_batch(self, texts):
            return [self.encode(t) for t in texts]

        def decode(self, ids):
            return bytes(ids).decode()

    with pytest.raises(
        ValueError, match="tokenizer 'merging' merges the answer ' 48213' with the prompt"
    ):
        make_examples("passkey", Merging(), TEXT, length=200, count=1)


def test_grading_arguments():
    batch = make_examples("passkey", BYTE, TEXT, length=150, count=2)
    with pytest.raises(ValueError, match=r"`continuations` must be ids \[N, Q, L\] = \[2, 1, L\]"):
        grade_batch(batch, np.zeros((3, 6), np.int64))
    with pytest.raises(ValueError, match=r"`argmax` must be \[N, T - 1\] = \[2, 149\]"):
        continuations_from_argmax(batch, np.zeros((2, 10), np.int64))
    with pytest.raises(ValueError, match="`continuations` as text must hold one str per example"):
        grade_batch(batch, [" 1", [" 2", " 3"]])
    with pytest.raises(ValueError, match="one entry per batch"):
        score([batch, batch], [batch.answer[:, 0]])
    with pytest.raises(ValueError, match="`depth_bins` must be an int >= 1; got 0"):
        score(batch, batch.answer[:, 0], depth_bins=0)
    assert isinstance(batch[-1], recall.RecallExample) and isinstance(
        make_filler(TEXT, BYTE), Filler
    )
    with pytest.raises(IndexError, match="out of range for 2 examples"):
        batch[2]
