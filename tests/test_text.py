"""sparse_jax.data.text: sources (embedded, file, folder, WikiText-2, TFDS), token windows,
the TFDS array_record cache (written once, reused, rebuilt on change) and the batch iterator.

Everything runs offline (socket connections refused) and writes only under pytest's tmp_path.
"""

from __future__ import annotations

import collections
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from sparse_jax.data import text as text_module
from sparse_jax.data.text import (
    BatchIterator,
    BucketIterator,
    PreparedData,
    TextSource,
    make_windows,
    prepare,
    resolve_source,
    token_stream,
)
from sparse_jax.data.tokenizers import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2"
needs_wikitext = pytest.mark.skipif(
    not (WIKITEXT / "valid.txt").is_file() or not (WIKITEXT / "test.txt").is_file(),
    reason=f"WikiText-2 is not at {WIKITEXT} (valid.txt + test.txt; see DESIGN.md)",
)
BYTE = ByteTokenizer()


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in tests")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("SPARSE_JAX_OFFLINE", "1")
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path_factory.mktemp("tfds_default")))
    monkeypatch.setenv("SPARSE_JAX_DATA_DIR", str(tmp_path_factory.mktemp("sj_default")))
    monkeypatch.setattr(socket, "getaddrinfo", _no_network)
    monkeypatch.setattr(socket.socket, "connect", _no_network)


@pytest.fixture(scope="module")
def default_data(tmp_path_factory) -> PreparedData:
    return prepare("default", BYTE, 256, data_dir=tmp_path_factory.mktemp("cache"))


def _stream(source: TextSource, split: str) -> np.ndarray:
    return token_stream([d for d in source.documents(split) if d.strip()], BYTE)


def _lines(n: int, prefix: str = "line") -> str:
    return "".join(
        f"{prefix} {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(n)
    )


def test_importing_the_package_does_not_import_tfds():
    # TFDS (and array_record) are imported by the functions that build and read datasets only.
    code = (
        "import sparse_jax, sparse_jax.data.text, sparse_jax.data.tokenizers, "
        "sparse_jax.training.loop, sparse_jax.training.checkpoint; import sys; "
        "loaded = [m for m in ('tensorflow_datasets', 'array_record') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# Sources.


def test_default_source_is_embedded_and_non_trivial(default_data):
    src = resolve_source("default")
    assert src.kind == "default" and "pydoc_data" in src.describe()
    train, evaluation = src.documents("train"), src.documents("eval")
    n = len(train) + len(evaluation)
    assert n > 50 and len(evaluation) == round(0.1 * n)
    assert not set(train) & set(evaluation)
    # Byte tokens of the embedded corpus (about 428k train / 38k eval on CPython 3.11).
    stats = default_data.stats
    print(
        f"default corpus, byte tokens: train {stats['train']['tokens']:,}, "
        f"eval {stats['eval']['tokens']:,}"
    )
    assert stats["train"]["tokens"] > 300_000 and stats["eval"]["tokens"] > 10_000
    assert stats["train"]["documents"] == len(train)
    assert stats["train"]["tokens"] == sum(len(d.encode()) + 1 for d in train)
    text = default_data.describe()
    assert "pydoc_data" in text and "train" in text and "eval" in text and "array_record" in text


def test_text_file_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(_lines(100), encoding="utf-8")
    src = resolve_source(path)
    assert src.kind == "file" and "first ~90%" in src.describe()
    train, evaluation = src.documents("train"), src.documents("eval")
    assert len(train) == len(evaluation) == 1
    assert train[0] + evaluation[0] == path.read_text()  # cut at a line boundary, nothing lost
    assert train[0].endswith("\n") and evaluation[0].startswith("line 90:")
    data = prepare(path, "byte", 64, data_dir=tmp_path / "cache")
    assert data.stats["train"]["tokens"] == len(train[0]) + 1
    assert len(data.train) == (len(train[0]) + 1 - 1) // 64


def test_folder_source(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i in range(10):
        (folder / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(_lines(20, f"doc{i}"))
    (folder / "notes.md").write_text("not a .txt file")
    src = resolve_source(folder)
    assert src.kind == "folder"
    assert len(src.train_files) == 9 and src.eval_files == ("sub/doc9.txt",)  # path order
    assert src.documents("eval") == [(folder / "sub" / "doc9.txt").read_text()]
    data = prepare(folder, "byte", 128, data_dir=tmp_path / "cache")
    assert data.stats["train"]["documents"] == 9 and data.stats["eval"]["documents"] == 1
    stream = _stream(src, "train")
    np.testing.assert_array_equal(data.train[0], stream[:129])
    assert np.count_nonzero(stream == BYTE.eos_id) == 9  # one EOS after each document

    single = tmp_path / "single"
    single.mkdir()
    (single / "only.txt").write_text(_lines(50))
    one = resolve_source(single)
    assert one.kind == "folder" and not one.eval_files and "one file" in one.describe()
    assert "".join(one.documents("train") + one.documents("eval")) == _lines(50)


@needs_wikitext
def test_wikitext2_trains_on_valid_and_evaluates_on_test(tmp_path):
    src = resolve_source(WIKITEXT)
    assert src.kind == "wikitext2"
    assert src.train_files == ("valid.txt",) and src.eval_files == ("test.txt",)
    assert "train on valid.txt, evaluate on test.txt" in src.describe()
    valid = (WIKITEXT / "valid.txt").read_text(encoding="utf-8")
    test = (WIKITEXT / "test.txt").read_text(encoding="utf-8")
    train_docs, eval_docs = src.documents("train"), src.documents("eval")
    assert "".join(train_docs).strip() == valid.strip()  # articles, verbatim
    assert "".join(eval_docs).strip() == test.strip()
    assert all(d.lstrip(" \n").startswith("= ") for d in train_docs)
    data = prepare(src, "byte", 2048, data_dir=tmp_path / "cache")
    s = data.stats
    print(
        f"WikiText-2, byte tokens: valid.txt (train) {s['train']['tokens']:,} in "
        f"{s['train']['documents']} articles, test.txt (eval) {s['eval']['tokens']:,} in "
        f"{s['eval']['documents']} articles"
    )
    assert s["train"]["tokens"] == sum(len(d.encode()) for d in train_docs) + len(train_docs)
    assert s["eval"]["tokens"] == sum(len(d.encode()) for d in eval_docs) + len(eval_docs)
    assert 1_100_000 < s["train"]["tokens"] < 1_150_000
    assert 1_250_000 < s["eval"]["tokens"] < 1_300_000
    assert BYTE.decode(data.train[0]).startswith(" \n = Homarus gammarus = ")
    assert BYTE.decode(data.eval[0]).lstrip().startswith("= Robert <unk> =")
    assert "train on valid.txt, evaluate on test.txt" in data.describe()


@needs_wikitext
def test_wikitext2_with_train_txt_still_trains_on_valid(tmp_path):
    folder = tmp_path / "wt2"
    folder.mkdir()
    for name in ("valid.txt", "test.txt"):  # links, not copies
        (folder / name).symlink_to(WIKITEXT / name)
    (folder / "train.txt").write_text(" = A = \n text \n")
    src = resolve_source(folder)
    assert src.train_files == ("valid.txt",) and src.eval_files == ("test.txt",)
    assert "train.txt is present but not used" in src.describe()


class SparseJaxTestCorpus(tfds.core.GeneratorBasedBuilder):
    """A tiny TFDS text dataset (array_record) standing in for any TFDS text dataset."""

    VERSION = tfds.core.Version("1.0.0")
    SPLITS = ("train", "test")

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "label": tfds.features.ClassLabel(num_classes=2)}
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in self.SPLITS}

    def _generate_examples(self, split):
        for i in range(20 if split == "train" else 5):
            yield i, {"text": f"{split} document {i}: " + "lorem ipsum dolor " * 5, "label": i % 2}


class SparseJaxTestTrainOnly(SparseJaxTestCorpus):
    SPLITS = ("train",)


def _prepare_tfds(cls, data_dir: Path) -> None:
    builder = cls(data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )


def test_tfds_text_source(tmp_path):
    tfds_dir = tmp_path / "tfds"
    _prepare_tfds(SparseJaxTestCorpus, tfds_dir)
    src = resolve_source("tfds:sparse_jax_test_corpus", tfds_data_dir=tfds_dir)
    assert (src.kind, src.feature, src.train_split, src.eval_split) == (
        "tfds",
        "text",
        "train",
        "test",
    )
    assert src.documents("train")[3] == "train document 3: " + "lorem ipsum dolor " * 5
    assert len(src.documents("eval")) == 5
    same = resolve_source("tfds:sparse_jax_test_corpus:text", tfds_data_dir=tfds_dir)
    assert same == src
    data = prepare(src, "byte", 32, data_dir=tmp_path / "cache")
    assert data.stats["train"]["documents"] == 20
    np.testing.assert_array_equal(data.train[0], _stream(src, "train")[:33])

    _prepare_tfds(SparseJaxTestTrainOnly, tfds_dir)
    cut = resolve_source("tfds:sparse_jax_test_train_only", tfds_data_dir=tfds_dir)
    assert (cut.train_split, cut.eval_split) == ("train[:18]", "train[18:]")
    assert cut.documents("eval")[0].startswith("train document 18:")

    with pytest.raises(ValueError, match=r"no feature 'title'.*'label', 'text'"):
        resolve_source("tfds:sparse_jax_test_corpus:title", tfds_data_dir=tfds_dir)
    with pytest.raises(ValueError, match="'label' is not text"):
        resolve_source("tfds:sparse_jax_test_corpus:label", tfds_data_dir=tfds_dir)


def test_tfds_source_not_prepared_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    with pytest.raises(ValueError, match=r"not prepared in data_dir.*tfds build"):
        resolve_source("tfds:sparse_jax_test_corpus", tfds_data_dir=empty)
    with pytest.raises(ValueError, match=r"cannot open the dataset 'no_such_dataset_xyz'"):
        resolve_source("tfds:no_such_dataset_xyz", tfds_data_dir=empty)


# --------------------------------------------------------------------------------------------
# Windows and the cache.


def test_windows_are_contiguous_slices_of_the_stream(default_data):
    src = resolve_source("default")
    for split, windows in (("train", default_data.train), ("eval", default_data.eval)):
        stream = _stream(src, split)
        n = len(windows)
        assert n == (stream.shape[0] - 1) // 256 == default_data.stats[split]["windows"]
        np.testing.assert_array_equal(windows[0], stream[:257])  # the first seq_len + 1 tokens
        for i in (1, n // 2, n - 1):
            np.testing.assert_array_equal(windows[i], stream[i * 256 : i * 256 + 257])
        assert windows[0].dtype == np.int32 and windows[0].shape == (257,)
        assert windows[[0, n - 1]].shape == (2, 257)
        np.testing.assert_array_equal(windows[-1], windows[n - 1])
    with pytest.raises(IndexError, match="out of range"):
        default_data.train[len(default_data.train)]
    np.testing.assert_array_equal(make_windows(np.arange(7), 2), [[0, 1, 2], [2, 3, 4], [4, 5, 6]])


def test_cache_is_written_once_and_rebuilt_on_change(tmp_path):
    cache = tmp_path / "cache"
    path = tmp_path / "corpus.txt"
    path.write_text(_lines(200))
    first = prepare(path, "byte", 64, data_dir=cache)
    assert first.built
    records = sorted(first.dataset_dir.glob("*.array_record*"))
    assert {p.name.split(".")[0] for p in records} == {
        "sparse_jax_text-train",
        "sparse_jax_text-eval",
    }
    assert json.loads((first.dataset_dir / "dataset_info.json").read_text())["fileFormat"] == (
        "array_record"
    )
    mtimes = {p: p.stat().st_mtime_ns for p in records}

    again = prepare(path, "byte", 64, data_dir=cache)
    assert not again.built and again.dataset_dir == first.dataset_dir
    assert {p: p.stat().st_mtime_ns for p in records} == mtimes
    assert again.stats == first.stats
    np.testing.assert_array_equal(again.train[5], first.train[5])

    longer = prepare(path, "byte", 96, data_dir=cache)  # another seq_len: another dataset
    assert longer.built and longer.dataset_dir != first.dataset_dir
    path.write_text(_lines(201))  # other contents: another dataset
    changed = prepare(path, "byte", 64, data_dir=cache)
    assert changed.built and changed.dataset_dir not in (first.dataset_dir, longer.dataset_dir)
    assert {p.stat().st_mtime_ns for p in records} == set(mtimes.values())
    assert len(list((cache / "sparse_jax_text").iterdir())) == 3


def test_two_runs_preparing_one_dataset_at_once(tmp_path, monkeypatch):
    # Two runs started together on one cache both build the dataset; the later one's final
    # rename finds the folder the other wrote. Played here deterministically: while this
    # process writes, "the other" finishes (its folder copied into place).
    path = tmp_path / "corpus.txt"
    path.write_text(_lines(200))
    other = prepare(path, "byte", 64, data_dir=tmp_path / "other")
    cache = tmp_path / "cache"
    written = cache / other.dataset_dir.relative_to(tmp_path / "other")
    real = text_module.SparseJaxText._download_and_prepare

    def meanwhile_the_other_finishes(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        shutil.copytree(other.dataset_dir, written)
        return out

    monkeypatch.setattr(
        text_module.SparseJaxText, "_download_and_prepare", meanwhile_the_other_finishes
    )
    data = prepare(path, "byte", 64, data_dir=cache)
    assert data.dataset_dir == written and data.stats == other.stats
    np.testing.assert_array_equal(data.train[3], other.train[3])
    assert [p.name for p in written.parent.iterdir()] == [written.name]  # no leftover


def test_default_data_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_JAX_DATA_DIR", str(tmp_path / "env_cache"))
    path = tmp_path / "c.txt"
    path.write_text(_lines(30))
    data = prepare(path, "byte", 32)
    assert data.dataset_dir.is_relative_to(tmp_path / "env_cache")


# --------------------------------------------------------------------------------------------
# Batches.


def _ids(batch: np.ndarray) -> list[int]:
    return batch[:, 0].tolist()


@pytest.fixture
def rows() -> np.ndarray:
    """23 examples whose first token is their index."""
    return np.arange(23, dtype=np.int32)[:, None] + np.zeros((1, 5), np.int32)


def _take(it: BatchIterator, n: int) -> list[list[int]]:
    return [_ids(next(it)) for _ in range(n)]


def test_iterator_is_deterministic_and_seeded(rows):
    a = _take(BatchIterator(rows, 4, seed=3), 12)
    assert a == _take(BatchIterator(rows, 4, seed=3), 12)
    assert a != _take(BatchIterator(rows, 4, seed=4), 12)
    # 23 // 4 = 5 steps per epoch; each epoch is a fresh permutation, remainder dropped.
    epoch0, epoch1 = np.concatenate(a[:5]).tolist(), np.concatenate(a[5:10]).tolist()
    assert len(set(epoch0)) == len(set(epoch1)) == 20
    assert epoch0 != epoch1
    it = BatchIterator(rows, 4, seed=0, shuffle=False, drop_remainder=False, num_epochs=1)
    batches = list(it)
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 3]
    assert np.concatenate([_ids(b) for b in batches]).tolist() == list(range(23))


def test_iterator_resumes_exactly(rows):
    full = _take(BatchIterator(rows, 4, seed=7), 14)
    it = BatchIterator(rows, 4, seed=7)
    head = _take(it, 7)  # mid-epoch 1
    state = json.loads(json.dumps(it.state()))  # survives a checkpoint as JSON
    assert (state["epoch"], state["step"], state["global_step"]) == (1, 2, 7)
    resumed = BatchIterator.from_state(rows, state)
    assert head + _take(resumed, 7) == full
    assert _take(BatchIterator(rows, 4, seed=7, start_step=7), 7) == full[7:]
    with pytest.raises(ValueError, match="source of 23 examples, but source has 22"):
        BatchIterator.from_state(rows[:22], state)


def test_iterator_on_prepared_windows(default_data):
    it = BatchIterator(default_data.train, 8, seed=0)
    batch = next(it)
    assert batch.shape == (8, 257) and batch.dtype == np.int32
    idx = it.indices(0)
    np.testing.assert_array_equal(batch, np.stack([default_data.train[int(i)] for i in idx]))


@pytest.mark.parametrize("count", [2, 4])
def test_processes_partition_the_global_batch(rows, count):
    glob = BatchIterator(rows, 8, seed=1)
    parts = [
        BatchIterator(rows, 8, seed=1, process_index=p, process_count=count) for p in range(count)
    ]
    for _ in range(6):
        expected = next(glob)
        local = [next(p) for p in parts]
        assert all(b.shape == (8 // count, 5) for b in local)
        np.testing.assert_array_equal(np.concatenate(local), expected)
    # The state does not depend on the process layout: a 4-process state resumes on 1 process.
    np.testing.assert_array_equal(
        next(BatchIterator.from_state(rows, parts[0].state())), next(glob)
    )


def _buckets() -> list[np.ndarray]:
    """Three buckets of widths 3, 5, 7 (7, 9, 4 rows); a row's first entry is 100 * bucket +
    its index there."""
    return [
        100 * b + np.arange(n, dtype=np.int32)[:, None] + np.zeros((1, w), np.int32)
        for b, (n, w) in enumerate([(7, 3), (9, 5), (4, 7)])
    ]


def test_bucket_iterator_draws_whole_batches_of_one_bucket_each():
    buckets = _buckets()
    it = BucketIterator(buckets, 2, seed=3)
    assert it.steps_per_epoch == 3 + 4 + 2 and it.bucket_sizes == [7, 9, 4]
    epochs = []
    for _ in range(3):
        seen = collections.Counter()
        rows = []
        for _ in range(it.steps_per_epoch):
            batch = next(it)
            bucket = int(batch[0, 0]) // 100
            assert batch.shape == (2, buckets[bucket].shape[1]) and batch.dtype == np.int32
            assert {int(x) // 100 for x in batch[:, 0]} == {bucket}  # one bucket per batch
            np.testing.assert_array_equal(batch, buckets[bucket][batch[:, 0] % 100])
            seen[bucket] += 1
            rows += batch[:, 0].tolist()
        assert seen == {0: 3, 1: 4, 2: 2}  # every whole batch of every bucket, once an epoch
        assert len(set(rows)) == len(rows) == 18  # no row twice; one of 7 and of 9 left out
        epochs.append(rows)
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh order each epoch
    same = BucketIterator(buckets, 2, seed=3)
    other = BucketIterator(buckets, 2, seed=4)
    a = [next(same)[:, 0].tolist() for _ in range(9)]
    assert a == [list(p) for p in zip(epochs[0][::2], epochs[0][1::2], strict=True)]
    assert a != [next(other)[:, 0].tolist() for _ in range(9)]


def test_bucket_iterator_resumes_exactly():
    buckets = _buckets()
    whole = BucketIterator(buckets, 2, seed=7)
    full = [next(whole)[:, 0].tolist() for _ in range(20)]
    it = BucketIterator(buckets, 2, seed=7)
    head = [next(it)[:, 0].tolist() for _ in range(11)]  # mid-epoch 1
    state = json.loads(json.dumps(it.state()))  # survives a checkpoint as JSON
    assert (state["epoch"], state["step"], state["global_step"]) == (1, 2, 11)
    resumed = BucketIterator.from_state(buckets, state)
    assert head + [next(resumed)[:, 0].tolist() for _ in range(9)] == full
    with pytest.raises(ValueError, match=r"taken on buckets of \[7, 9, 4\] rows, but buckets hold"):
        BucketIterator.from_state(buckets[:2], state)
    with pytest.raises(ValueError, match=r"state lacks the keys \['bucket_sizes'\]"):
        BucketIterator.from_state(buckets, {k: v for k, v in state.items() if k != "bucket_sizes"})


def test_bucket_iterator_refuses_bad_buckets():
    buckets = _buckets()
    with pytest.raises(ValueError, match=r"buckets \[2\] hold \[4\] rows, fewer than batch_size 5"):
        BucketIterator(buckets, 5)
    with pytest.raises(TypeError, match="`buckets` must be a non-empty list of arrays"):
        BucketIterator(buckets[0], 2)
    with pytest.raises(TypeError, match="`buckets` must be a non-empty list"):
        BucketIterator([], 2)
    with pytest.raises(TypeError, match=r"bucket 1 must be a 2-D array \[n_b, L_b\]; got \(9,\)"):
        BucketIterator([buckets[0], buckets[1][:, 0]], 2)
    with pytest.raises(ValueError, match="BucketIterator: `batch_size` must be an int >= 1"):
        BucketIterator(buckets, 0)


# --------------------------------------------------------------------------------------------
# Errors.


def test_errors_name_the_argument(tmp_path, rows):
    missing = tmp_path / "nowhere" / "corpus.txt"
    with pytest.raises(ValueError, match=r"no such file or folder \(looked for '.*nowhere"):
        resolve_source(missing)
    with pytest.raises(ValueError, match=r"spec must be 'default'.*got 'wikipedia'"):
        resolve_source("wikipedia")
    with pytest.raises(TypeError, match="spec must be"):
        resolve_source(3)
    (tmp_path / "empty.txt").write_text(" \n\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_source(tmp_path / "empty.txt").documents("train")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("\n")
    with pytest.raises(ValueError, match="source is empty: the train split"):
        prepare(tmp_path / "blank", "byte", 8, data_dir=tmp_path / "cache")
    (tmp_path / "nofiles").mkdir()
    with pytest.raises(ValueError, match=r"holds no \.txt file \(looked for '\*\*/\*\.txt'"):
        resolve_source(tmp_path / "nofiles")
    (tmp_path / "a.md").write_text("x")
    with pytest.raises(ValueError, match=r"not a \.txt file"):
        resolve_source(tmp_path / "a.md")
    short = tmp_path / "short.txt"
    short.write_text("hello\nworld\n")
    with pytest.raises(ValueError, match=r"seq_len 100 is too long.*has 7 tokens"):
        prepare(short, "byte", 100, data_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="prepare: `seq_len` must be an int >= 1; got 0"):
        prepare("default", "byte", 0, data_dir=tmp_path / "cache")
    with pytest.raises(TypeError, match="prepare: `seq_len` must be an int"):
        prepare("default", "byte", 8.0, data_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="eval_fraction must lie"):
        resolve_source("default", eval_fraction=1.0)
    with pytest.raises(
        ValueError, match=r"batch_size 24 is larger than the number of examples \(23"
    ):
        BatchIterator(rows, 24)
    with pytest.raises(ValueError, match="must be divisible by process_count 3"):
        BatchIterator(rows, 4, process_count=3)
    with pytest.raises(ValueError, match=r"process_index must lie in \[0, process_count = 2\)"):
        BatchIterator(rows, 4, process_index=2, process_count=2)
    with pytest.raises(TypeError, match="`seed` must be an int"):
        BatchIterator(rows, 4, seed=1.5)
    with pytest.raises(TypeError, match="`shuffle` must be a bool"):
        BatchIterator(rows, 4, shuffle="yes")
    with pytest.raises(TypeError, match="tokenizer must be a Tokenizer"):
        prepare("default", 3, 8, data_dir=tmp_path / "cache")
    # The failed calls wrote no dataset.
    written = tmp_path / "cache" / "sparse_jax_text"
    assert not written.exists() or not any(written.glob("*/*/dataset_info.json"))
