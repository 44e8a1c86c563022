"""The run folder's record, :data:`RECORD` (``cot.json``): the format, the question kinds and
sizes trained on and, per model, its configs and checkpoint folder, what
:meth:`~sparse_jax.cot.Solver.load` reads (:func:`write_record`, :func:`read_record`).

A run folder is data a user may have downloaded: every path it names is resolved inside it
(:func:`inside`), and a record that cannot be read is a ``ValueError`` naming the file and
what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparse_jax.cot.format import BOS_ID, EOS_ID, PAD_ID, CotFormat
from sparse_jax.data.linalg_cot import DESCRIPTIVE_KINDS, KINDS, GeneratorConfig
from sparse_jax.files import write_text_atomically
from sparse_jax.models.encdec import EncDecConfig

__all__ = ["RECORD", "generator_of", "inside", "read_record", "write_record"]

# The kinds a run may train: computed answers and answers in words.
_ALL_KINDS = KINDS + DESCRIPTIVE_KINDS
RECORD = "cot.json"  # the run folder's file that Solver.load reads (format, model configs)


def write_record(
    folder: str | os.PathLike,
    fmt: CotFormat,
    models: Mapping[str, tuple[EncDecConfig, Any]],
    *,
    kinds: Sequence[str] | None = None,
    generator: GeneratorConfig | None = None,
) -> Path:
    """Writes ``folder/cot.json``: the format, the kinds trained on, the problem sizes (the
    ``GeneratorConfig`` of the training data, None: unknown), and per model name its
    ``EncDecConfig``, its ``TrainConfig`` and checkpoint folder (``checkpoints/<name>``), what
    :meth:`Solver.load` needs. Written atomically (a temporary file, then a rename); returns
    its path.

    Example (the record of a run with a sparse model and its dense baseline):
      >>> import tempfile
      >>> from sparse_jax.cot import VOCAB_SIZE
      >>> from sparse_jax.models.encdec import EncDecConfig
      >>> from sparse_jax.training.loop import TrainConfig
      >>> tmp = tempfile.TemporaryDirectory()
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16)
      >>> models = {"sparse": (cfg, TrainConfig(steps=10)), "dense": (cfg.dense(), TrainConfig())}
      >>> path = write_record(tmp.name, CotFormat(96, 64), models, kinds=["rref"])
      >>> path.name, sorted(read_record(tmp.name)["models"])
      ('cot.json', ['dense', 'sparse'])
      >>> tmp.cleanup()
    """
    if not isinstance(fmt, CotFormat):
        raise TypeError(f"write_record: `fmt` must be a CotFormat; got {type(fmt).__name__}")
    if generator is not None and not isinstance(generator, GeneratorConfig):
        raise TypeError(
            f"write_record: `generator` must be a GeneratorConfig or None; got "
            f"{type(generator).__name__}"
        )
    entries = {}
    for name, (config, train) in models.items():
        if not isinstance(config, EncDecConfig):
            raise TypeError(f"write_record: models[{name!r}][0] must be an EncDecConfig")
        entries[name] = {
            "model": dataclasses.asdict(config),
            "train": dataclasses.asdict(train),
            "checkpoint": f"checkpoints/{name}",
        }
    record = {
        "format": dataclasses.asdict(fmt),
        "models": entries,
        "kinds": None if kinds is None else list(kinds),
        "generator": None if generator is None else dataclasses.asdict(generator),
        "tokens": {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID, "vocab_size": fmt.vocab_size},
    }
    path = Path(folder) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomically(path, json.dumps(record, indent=2) + "\n")


def read_record(folder: str | os.PathLike) -> dict[str, Any]:
    """``folder/cot.json`` as :func:`write_record` wrote it; ``FileNotFoundError`` when the
    folder holds none, ``ValueError`` when it cannot be read.

    Example (a round trip through :func:`write_record`):
      >>> import tempfile
      >>> from sparse_jax.cot import VOCAB_SIZE
      >>> from sparse_jax.models.encdec import EncDecConfig
      >>> from sparse_jax.training.loop import TrainConfig
      >>> tmp = tempfile.TemporaryDirectory()
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16)
      >>> _ = write_record(tmp.name, CotFormat(96, 64), {"sparse": (cfg, TrainConfig(steps=10))})
      >>> record = read_record(tmp.name)
      >>> CotFormat(**record["format"]), record["models"]["sparse"]["checkpoint"]
      (CotFormat(source_len=96, target_len=64, numbers=0), 'checkpoints/sparse')
      >>> EncDecConfig(**record["models"]["sparse"]["model"]) == cfg
      True
      >>> read_record(Path(tmp.name) / "elsewhere")
      Traceback (most recent call last):
      ...
      FileNotFoundError: .../elsewhere is not a chain-of-thought run folder: it has no cot.json ...
      >>> tmp.cleanup()
    """
    path = Path(folder) / RECORD
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a chain-of-thought run folder: it has no {RECORD} (python -m "
            f"experiments.cot train --run.dir {folder} makes one)"
        )
    inside(folder, RECORD, f"{path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} cannot be read as a chain-of-thought run record: it is not UTF-8 text "
            f"(byte {err.start}: {err.reason}); the file is damaged"
        ) from None
    except OSError as err:
        raise ValueError(f"{path} cannot be read as a chain-of-thought run record: {err}") from err
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        what = "it is empty" if not text.strip() else f"it is not valid JSON ({err})"
        raise ValueError(
            f"{path} cannot be read as a chain-of-thought run record: {what}"
        ) from None
    try:
        _check_record(record)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} cannot be read as a chain-of-thought run record: {err}") from err
    return record


def _check_record(record: Any) -> None:
    """Raises naming the first field of ``record`` that is not as :func:`write_record` wrote."""

    def mapping(value: Any, field: str) -> Mapping:
        if not isinstance(value, Mapping):
            raise ValueError(f"`{field}` must be a JSON object; got {type(value).__name__}")
        return value

    mapping(record, "the file")
    for key in ("format", "models", "tokens"):
        if key not in record:
            raise ValueError(f"it lacks the field `{key}`")
    tokens = mapping(record["tokens"], "tokens")
    if (tokens.get("bos"), tokens.get("eos"), tokens.get("pad")) != (BOS_ID, EOS_ID, PAD_ID):
        raise ValueError(f"its special tokens {dict(tokens)} are not this version's")
    try:
        CotFormat(**mapping(record["format"], "format"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"`format`: {err}") from None
    for name, entry in mapping(record["models"], "models").items():
        entry = mapping(entry, f"models.{name}")
        missing = {"model", "train", "checkpoint"} - set(entry)
        if missing:
            raise ValueError(f"model {name!r} lacks {sorted(missing)}")
        mapping(entry["model"], f"models.{name}.model")
        mapping(entry["train"], f"models.{name}.train")
        if not isinstance(entry["checkpoint"], str) or not entry["checkpoint"]:
            raise ValueError(
                f"`models.{name}.checkpoint` must be a folder name; got {entry['checkpoint']!r}"
            )
    kinds = record.get("kinds")
    if kinds is not None and (
        not isinstance(kinds, list) or not kinds or any(k not in _ALL_KINDS for k in kinds)
    ):
        raise ValueError(f"`kinds` must be null or a list of {list(_ALL_KINDS)}; got {kinds!r}")
    if record.get("generator") is not None:
        generator_of(record)


def generator_of(record: Mapping[str, Any]) -> GeneratorConfig | None:
    """The ``GeneratorConfig`` of a record's training data (the sizes of its problems), or None
    when the record does not say (written without ``generator``).

    Example (a record as :func:`read_record` returns it; JSON lists become tuples again):
      >>> generator_of({"generator": {"kinds": ["rref"], "rref_shape": [2, 3]}}).rref_shape
      (2, 3)
      >>> generator_of({"kinds": ["rref"]}) is None
      True
    """
    fields = record.get("generator")
    if fields is None:
        return None
    if not isinstance(fields, Mapping):
        raise ValueError(f"`generator` must be a JSON object; got {type(fields).__name__}")
    try:
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return GeneratorConfig(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`generator`: {err}") from None


def inside(folder: str | os.PathLike, name: str, field: str) -> Path:
    """``folder/name`` resolved (symbolic links followed), refused with a ``ValueError`` naming
    ``field`` (where the name was read) when it lies outside ``folder``.

    Example:
      >>> import tempfile
      >>> tmp = tempfile.TemporaryDirectory()
      >>> inside(tmp.name, "checkpoints/sparse", "cot.json: models.sparse.checkpoint").name
      'sparse'
      >>> inside(tmp.name, "../../etc", "cot.json: models.sparse.checkpoint")
      Traceback (most recent call last):
      ...
      ValueError: cot.json: models.sparse.checkpoint: the path '../../etc' resolves to ...
      >>> tmp.cleanup()
    """
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise ValueError(
            f"{field}: the path {name!r} resolves to {path}, outside the run folder {root}: "
            "refused (a run folder only names files inside itself)"
        )
    return path
