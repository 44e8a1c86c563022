"""TFDS storage: :func:`prepare` writes :func:`make_examples` once as a TFDS ``array_record``
dataset through the builder ``SparseJaxRecall`` (one config per task, tokenizer, length, depths,
count, seed and filler) and reads it back, without TensorFlow, as a :class:`RecallData`.
Importing this module does not import ``tensorflow_datasets``.
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

from sparse_jax.data.recall.generator import (
    MQARTask,
    PasskeyTask,
    RecallBatch,
    as_filler,
    check_request,
    make_examples,
)
from sparse_jax.data.recall.sources import Filler, tokenizer_fingerprint
from sparse_jax.data.text.corpora import TextSource
from sparse_jax.data.tfds_store import default_data_dir, prepare_once, quiet_tfds
from sparse_jax.data.tokenizers import Tokenizer
from sparse_jax.validation import check_bool

__all__ = [
    "BUILDER_NAME",
    "RecallData",
    "SparseJaxRecall",  # noqa: F822 (defined on first use by __getattr__)
    "SparseJaxRecallConfig",  # noqa: F822
    "prepare",
]

BUILDER_NAME = "sparse_jax_recall"
_BUILDER_VERSION = "1.0.0"
# Bumped when the generator's output changes for the same arguments (part of every name's hash).
_FORMAT = 1
_SPLIT = "test"
_ARRAYS = ("ids", "answer_start", "answer_len", "answer", "depth", "position", "filler_len")


# -------------------------------------------------------------------------------------------
# The TFDS builder, defined on first use (as in sparse_jax.data.text) so that importing this
# module does not import tensorflow_datasets.


@functools.cache
def _builder_classes() -> tuple[type, type]:
    """``(SparseJaxRecall, SparseJaxRecallConfig)``, defined once (TFDS registers builders by
    name)."""
    import tensorflow_datasets as tfds

    @dataclasses.dataclass(eq=False)
    class SparseJaxRecallConfig(tfds.core.BuilderConfig):
        """One prepared set: ``<task>_<tokenizer>_l<length>_n<count>_s<seed>_<hash>``, with the
        shapes of its features (``length`` T, ``queries`` Q, ``answer_width`` A).

        Example (a config like those :func:`prepare` makes, not built):

        >>> from sparse_jax.data.recall import SparseJaxRecallConfig
        >>> config = SparseJaxRecallConfig(
        ...     "passkey_byte_l64_n4_s0_0123456789abcdef", length=64, queries=1, answer_width=6)
        >>> config.name, config.length, config.details
        ('passkey_byte_l64_n4_s0_0123456789abcdef', 64, '{}')
        """

        length: int = 0
        queries: int = 1
        answer_width: int = 1
        # JSON with the request (task, tokenizer, length, count, seed, depths, filler).
        details: str = "{}"

    class SparseJaxRecall(tfds.core.GeneratorBasedBuilder):
        """Recall examples (:class:`RecallBatch` rows): ``ids`` int32 ``[T]``, per query
        ``answer_start``, ``answer_len``, ``answer`` ``[Q, A]``, ``depth``, ``position``,
        ``key`` and ``answer_text``, and ``filler_len``; one split, ``test``.

        Written in ``array_record`` format by :func:`prepare` (which passes the examples to
        the constructor); read back with ``tfds.data_source(name, data_dir=...)``.

        Example (a set :func:`prepare` wrote, read back by name):

        >>> import tempfile
        >>> import tensorflow_datasets as tfds
        >>> from sparse_jax.data.recall import SparseJaxRecall
        >>> tmp = tempfile.TemporaryDirectory()
        >>> data = prepare("passkey", "byte", "one two three", length=100, count=2,
        ...                data_dir=tmp.name)  # TFDS prints 2 lines
        Downloading and preparing dataset ...
        Dataset sparse_jax_recall downloaded and prepared to ... reuse this data.
        >>> SparseJaxRecall.name, data.dataset_name
        ('sparse_jax_recall', 'sparse_jax_recall/passkey_byte_l100_n2_s0_...:1.0.0')
        >>> test = tfds.data_source(data.dataset_name, data_dir=tmp.name)["test"]
        >>> len(test), test[0]["ids"].shape, test[0]["answer"].shape  # [T], [Q, A]
        (2, (100,), (1, 6))
        >>> tmp.cleanup()
        """

        VERSION = tfds.core.Version(_BUILDER_VERSION)
        RELEASE_NOTES = {"1.0.0": "Passkey and MQAR examples of issue 58."}  # noqa: RUF012

        def __init__(self, *, batch: RecallBatch | None = None, **kwargs: Any):
            self._batch = batch
            super().__init__(**kwargs)

        def _info(self) -> tfds.core.DatasetInfo:
            config = self.builder_config
            t, q, a = config.length, config.queries, config.answer_width

            def tensor(shape: tuple[int, ...], dtype: Any = np.int32) -> Any:
                encoding = tfds.features.Encoding.BYTES
                return tfds.features.Tensor(shape=shape, dtype=dtype, encoding=encoding)

            return self.dataset_info_from_configs(
                description="Passkey and multi-query associative recall, made by sparse_jax.",
                features=tfds.features.FeaturesDict(
                    {
                        "ids": tensor((t,)),
                        "answer_start": tensor((q,)),
                        "answer_len": tensor((q,)),
                        "answer": tensor((q, a)),
                        "depth": tensor((q,), np.float32),
                        "position": tensor((q,)),
                        "filler_len": tensor(()),
                        "key": tfds.features.Sequence(tfds.features.Text(), length=q),
                        "answer_text": tfds.features.Sequence(tfds.features.Text(), length=q),
                    }
                ),
                metadata=tfds.core.MetadataDict(json.loads(config.details)),
                # Example i is example i of make_examples: keep the order (TFDS shuffles).
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
            if self._batch is None:
                raise RuntimeError("SparseJaxRecall is written by sparse_jax.data.recall.prepare()")
            return {_SPLIT: self._generate_examples()}

        def _generate_examples(self) -> Iterator[tuple[int, dict[str, Any]]]:
            batch = self._batch
            for i in range(len(batch)):
                record = {name: np.array(getattr(batch, name)[i]) for name in _ARRAYS}
                record["key"] = list(batch.key[i])
                record["answer_text"] = list(batch.answer_text[i])
                yield i, record

    for cls in (SparseJaxRecall, SparseJaxRecallConfig):
        cls.__qualname__ = cls.__name__
    return SparseJaxRecall, SparseJaxRecallConfig


def __getattr__(name: str) -> Any:
    if name == "SparseJaxRecall":
        return _builder_classes()[0]
    if name == "SparseJaxRecallConfig":
        return _builder_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class RecallData:
    """A prepared set, read back from its TFDS ``array_record`` files: ``batch`` holds the
    examples as :func:`make_examples` made them.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare("mqar", "byte", "one two three", length=160, count=2, data_dir=tmp.name)
    Downloading and preparing dataset ...
    Dataset sparse_jax_recall downloaded and prepared to ... reuse this data.
    >>> data.batch.ids.shape, data.batch.key[0], data.built
    ((2, 160), ('vs', 'bv', 'cn', 'jd'), True)
    >>> (data.dataset_dir / "dataset_info.json").is_file()
    True
    >>> tmp.cleanup()
    """

    batch: RecallBatch
    # The TFDS dataset ("sparse_jax_recall/<config>:<version>") and its folder.
    dataset_name: str
    dataset_dir: Path
    # Whether this call wrote the dataset (False: it was already there).
    built: bool


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:24] or "tok"


def prepare(
    task: str | PasskeyTask | MQARTask,
    tokenizer: Tokenizer | str | os.PathLike = "byte",
    filler: Filler | str | TextSource | None = None,
    *,
    length: int,
    count: int,
    depths: float | Sequence[float] | None = None,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    verbose: bool = False,
) -> RecallData:
    """:func:`make_examples` with these arguments, written once as a TFDS ``array_record``
    dataset and read back.

    The dataset's config name carries a hash of (format, task and its parameters, tokenizer,
    length, count, seed, depths, filler): the same request reuses the files (``built`` False),
    any change writes a new dataset beside. ``data_dir`` defaults to ``$SPARSE_JAX_DATA_DIR``,
    else ``~/.cache/sparse_jax/tfds``. Arguments are checked as :func:`make_examples` checks
    them, before anything is written.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare("passkey", "byte", "one two three", length=100, count=3, depths=0.5,
    ...                data_dir=tmp.name)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_recall downloaded and prepared to ... reuse this data.
    >>> made = make_examples("passkey", "byte", "one two three", length=100, count=3, depths=0.5)
    >>> bool((data.batch.ids == made.ids).all()), data.batch.key == made.key, data.built
    (True, True, True)
    >>> prepare("passkey", "byte", "one two three", length=100, count=3, depths=0.5,
    ...         data_dir=tmp.name).built  # written once
    False
    >>> tmp.cleanup()
    """
    import tensorflow_datasets as tfds

    caller = "prepare"
    spec, length, count, seed, requested, tok = check_request(
        task, tokenizer, filler, length, count, depths, seed, caller
    )
    verbose = check_bool(verbose, "verbose", caller)
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(
            f"{caller}: `data_dir` must be a str or os.PathLike; got {type(data_dir).__name__}"
        )
    root = (Path(data_dir).expanduser() if data_dir is not None else default_data_dir()).absolute()
    source = as_filler(filler, tok)

    request = {
        "format": _FORMAT,
        "task": spec.name,
        "params": dataclasses.asdict(spec),
        "tokenizer": tok.name,
        "tokenizer_hash": tokenizer_fingerprint(tok),
        "length": length,
        "count": count,
        "seed": seed,
        "depths": list(requested) if requested else None,
        "filler": source.fingerprint,
    }
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
    config_name = f"{spec.name}_{_slug(tok.name)}_l{length}_n{count}_s{seed}_{key[:16]}"
    name = f"{BUILDER_NAME}/{config_name}:{_BUILDER_VERSION}"
    SparseJaxRecall, SparseJaxRecallConfig = _builder_classes()

    with quiet_tfds(verbose):
        probe = SparseJaxRecall(
            config=SparseJaxRecallConfig(name=config_name, length=length),
            data_dir=root,
            file_format="array_record",
        )
        built = not probe.is_prepared()
        if built:
            batch = make_examples(
                spec, tok, source, length=length, count=count, depths=depths, seed=seed
            )
            details = {**request, "key": key, "params": _short_params(request["params"])}
            config = SparseJaxRecallConfig(
                name=config_name,
                length=length,
                queries=batch.num_queries,
                answer_width=int(batch.answer.shape[2]),
                details=json.dumps(details),
            )
            builder = SparseJaxRecall(
                config=config, data_dir=root, file_format="array_record", batch=batch
            )
            prepare_once(builder)
        # Read back by name: TFDS opens the dataset from its files (the class lists no config).
        records = tfds.data_source(name, data_dir=root, download=False)[_SPLIT]
        meta = dict(records.dataset_info.metadata)
    return RecallData(
        batch=_read_batch(records, meta),
        dataset_name=name,
        dataset_dir=root / BUILDER_NAME / config_name / _BUILDER_VERSION,
        built=built,
    )


def _short_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The task's parameters for the dataset's metadata, long vocabularies as a count and hash
    (the full lists are in the config name's hash)."""
    short = {}
    for k, v in params.items():
        if isinstance(v, (list, tuple)) and len(v) > 16:
            digest = hashlib.sha256(json.dumps(list(v)).encode()).hexdigest()[:16]
            v = {"count": len(v), "first": list(v[:4]), "sha256": digest}
        short[k] = v
    return short


def _read_batch(records: Any, meta: Mapping[str, Any]) -> RecallBatch:
    rows = []
    for start in range(0, len(records), 1024):
        rows += records.__getitems__(list(range(start, min(start + 1024, len(records)))))
    arrays = {name: np.stack([np.asarray(r[name]) for r in rows]) for name in _ARRAYS}
    texts = {
        name: tuple(tuple(_text(t) for t in r[name]) for r in rows)
        for name in ("key", "answer_text")
    }
    return RecallBatch(
        task=str(meta["task"]), tokenizer=str(meta["tokenizer"]), seed=int(meta["seed"]),
        **arrays, **texts,
    )  # fmt: skip
