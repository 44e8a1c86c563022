"""The run folder's record, :data:`RECORD` (``cot.json``): the format and, per model, its
configs and checkpoint folder, what :meth:`~sparse_jax.cot.Solver.load` reads
(:func:`write_record`, :func:`read_record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparse_jax.cot.format import BOS_ID, EOS_ID, PAD_ID, CotFormat
from sparse_jax.models.encdec import EncDecConfig

__all__ = ["RECORD", "read_record", "write_record"]

RECORD = "cot.json"  # the run folder's file that Solver.load reads (format, model configs)


def write_record(
    folder: str | os.PathLike,
    fmt: CotFormat,
    models: Mapping[str, tuple[EncDecConfig, Any]],
    *,
    kinds: Sequence[str] | None = None,
) -> Path:
    """Writes ``folder/cot.json``: the format, and per model name its ``EncDecConfig``, its
    ``TrainConfig`` and checkpoint folder (``checkpoints/<name>``), what :meth:`Solver.load`
    needs. Written atomically (a temporary file, then a rename); returns its path.

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
        "tokens": {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID, "vocab_size": fmt.vocab_size},
    }
    path = Path(folder) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
    try:
        record = json.loads(path.read_text())
        tokens = record["tokens"]
        if (tokens["bos"], tokens["eos"], tokens["pad"]) != (BOS_ID, EOS_ID, PAD_ID):
            raise ValueError(f"its special tokens {tokens} are not this version's")
        for name, entry in record["models"].items():
            missing = {"model", "train", "checkpoint"} - set(entry)
            if missing:
                raise ValueError(f"model {name!r} lacks {sorted(missing)}")
        CotFormat(**record["format"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} cannot be read as a chain-of-thought run record: {err}") from err
    return record
