"""TFDS storage: :func:`prepare` writes :func:`make_splits` once as a TFDS ``array_record``
dataset through the builder ``SparseJaxLinalgCot`` and reads it back without TensorFlow
(:class:`LinalgCotData`, one :class:`ProblemSource` per split). Importing this module does not
import ``tensorflow_datasets``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_jax.data.linalg_cot.generator import SPLITS, GeneratorConfig, make_splits
from sparse_jax.data.linalg_cot.problems import ParsedQuestion, Problem
from sparse_jax.data.tfds_store import default_data_dir, prepare_once, quiet_tfds
from sparse_jax.validation import check_bool, check_int

__all__ = [
    "BUILDER_NAME",
    "LinalgCotData",
    "ProblemSource",
    "SparseJaxLinalgCot",  # noqa: F822 (defined on first use by __getattr__)
    "SparseJaxLinalgCotConfig",  # noqa: F822
    "prepare",
]

BUILDER_NAME = "sparse_jax_linalg_cot"
_BUILDER_VERSION = "1.0.0"
# Bumped when the generator's output changes for the same seed (part of every dataset's hash).
_FORMAT = 2


# -------------------------------------------------------------------------------------------
# The TFDS builder.
#
# Defined on first use, as in sparse_jax.data.text, so that importing this module does not import
# tensorflow_datasets; `linalg_cot.SparseJaxLinalgCot` still names the class (module __getattr__).


@functools.cache
def _builder_classes() -> tuple[type, type]:
    """``(SparseJaxLinalgCot, SparseJaxLinalgCotConfig)``, defined once (TFDS registers
    builders by name)."""
    import tensorflow_datasets as tfds

    @dataclasses.dataclass(eq=False)
    class SparseJaxLinalgCotConfig(tfds.core.BuilderConfig):
        """Generated splits: the name is ``s<seed>_<hash of the sizes and GeneratorConfig>``.

        Example (a config like those :func:`prepare` makes, not built):

        >>> import json
        >>> from sparse_jax.data.linalg_cot import SparseJaxLinalgCotConfig
        >>> details = {"seed": 0, "sizes": {"train": 12, "validation": 6, "test": 6}}
        >>> config = SparseJaxLinalgCotConfig("s0_0123456789abcdef", details=json.dumps(details))
        >>> config.name, json.loads(config.details)["sizes"]["train"]
        ('s0_0123456789abcdef', 12)
        """

        # JSON with the seed, split sizes and GeneratorConfig (stored as dataset metadata).
        details: str = "{}"

    class SparseJaxLinalgCot(tfds.core.GeneratorBasedBuilder):
        """Linear-algebra problems with worked solutions: ``question``, ``steps`` (a sequence of
        lines), ``answer`` and ``kind``, splits train / validation / test.

        Written in ``array_record`` format by :func:`prepare` (which passes the problems to the
        constructor); read back with ``builder.as_data_source()``.

        Example (a dataset :func:`prepare` wrote, read back by name: one dict per problem):

        >>> import tempfile
        >>> import tensorflow_datasets as tfds
        >>> from sparse_jax.data.linalg_cot import SparseJaxLinalgCot
        >>> tmp = tempfile.TemporaryDirectory()
        >>> data = prepare(tmp.name, train=6, validation=6, test=6)  # TFDS prints 2 lines
        Downloading and preparing dataset ...
        Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
        >>> SparseJaxLinalgCot.name, data.dataset_name
        ('sparse_jax_linalg_cot', 'sparse_jax_linalg_cot/s0_...:1.0.0')
        >>> test = tfds.data_source(data.dataset_name, data_dir=tmp.name)["test"]
        >>> sorted(test[0]), test[0]["kind"]
        (['answer', 'kind', 'question', 'steps'], b'complete_solution')
        >>> tmp.cleanup()
        """

        VERSION = tfds.core.Version(_BUILDER_VERSION)
        RELEASE_NOTES = {"1.0.0": "The six kinds of issue 16."}  # noqa: RUF012

        def __init__(
            self, *, problems: Mapping[str, Sequence[Problem]] | None = None, **kwargs: Any
        ):
            self._problems = problems
            super().__init__(**kwargs)

        def _info(self) -> tfds.core.DatasetInfo:
            return self.dataset_info_from_configs(
                description="Linear-algebra exam problems with chain-of-thought solutions.",
                features=tfds.features.FeaturesDict(
                    {
                        "question": tfds.features.Text(),
                        "steps": tfds.features.Sequence(tfds.features.Text()),
                        "answer": tfds.features.Text(),
                        "kind": tfds.features.Text(),
                    }
                ),
                metadata=tfds.core.MetadataDict(json.loads(self.builder_config.details)),
                # Example i is problem i: keep generation order (TFDS shuffles by default).
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
            if self._problems is None:
                raise RuntimeError(
                    "SparseJaxLinalgCot is written by sparse_jax.data.linalg_cot.prepare()"
                )
            return {split: self._generate_examples(split) for split in self._problems}

        def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
            for i, problem in enumerate(self._problems[split]):
                yield (
                    i,
                    {
                        "question": problem.question,
                        "steps": list(problem.steps),
                        "answer": problem.answer,
                        "kind": problem.kind,
                    },
                )

    for cls in (SparseJaxLinalgCot, SparseJaxLinalgCotConfig):
        cls.__qualname__ = cls.__name__
    return SparseJaxLinalgCot, SparseJaxLinalgCotConfig


def __getattr__(name: str) -> Any:
    if name == "SparseJaxLinalgCot":
        return _builder_classes()[0]
    if name == "SparseJaxLinalgCotConfig":
        return _builder_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class ProblemSource:
    """Random access to one prepared split: ``len``, ``[i]`` -> :class:`Problem`, iteration.

    Example:

    >>> import tempfile
    >>> from sparse_jax.data.linalg_cot import KINDS
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare(tmp.name, train=6, validation=6, test=6)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
    >>> data.test, [p.kind for p in data.test] == list(KINDS)
    (ProblemSource(split='test', problems=6), True)
    >>> data.test[-1] == make_splits(6, 6, 6)["test"][-1]  # the problem written, read back
    True
    >>> tmp.cleanup()
    """

    def __init__(self, data_source: Any, split: str):
        self._source = data_source
        self.split = split

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Problem:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"index must be an int, got {type(index).__name__}: {index!r}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for {n} {self.split} problems")
        record = self._source[int(index) % n]
        return Problem(
            kind=_text(record["kind"]),
            question=_text(record["question"]),
            steps=tuple(_text(s) for s in record["steps"]),
            answer=_text(record["answer"]),
        )

    def __iter__(self) -> Iterator[Problem]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"ProblemSource(split={self.split!r}, problems={len(self)})"


@dataclass(frozen=True)
class LinalgCotData:
    """The prepared splits, read back from the TFDS ``array_record`` files.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare(tmp.name, train=6, validation=6, test=6)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
    >>> [len(data.train), len(data.validation), len(data.test)], data.built
    ([6, 6, 6], True)
    >>> data.dataset_name  # the config name: s<seed>_<hash of the request>
    'sparse_jax_linalg_cot/s0_...:1.0.0'
    >>> (data.dataset_dir / "dataset_info.json").is_file()
    True
    >>> tmp.cleanup()
    """

    train: ProblemSource
    validation: ProblemSource
    test: ProblemSource
    # The TFDS dataset ("sparse_jax_linalg_cot/<config>:<version>") and its folder.
    dataset_name: str
    dataset_dir: Path
    # Whether this call wrote the dataset (False: it was already there).
    built: bool


# GeneratorConfig fields that leave a dataset's name as it was when they keep their default
# (added after datasets were named: a cached dataset of the same request stays valid).
_NAMED_WHEN_SET = ("exam_rate", "latex_rate", "free_entry")


def _contents_hash(questions: Sequence[ParsedQuestion]) -> str:
    if isinstance(questions, str) or not all(isinstance(q, ParsedQuestion) for q in questions):
        raise TypeError(f"prepare: `exclude` must hold ParsedQuestions; got {questions!r:.80}")
    contents = sorted(set().union(*(q.contents for q in questions)))
    return hashlib.sha256(json.dumps(contents).encode()).hexdigest()[:16]


def _config_details(cfg: GeneratorConfig) -> dict[str, Any]:
    details = json.loads(json.dumps(dataclasses.asdict(cfg)))
    default = GeneratorConfig()
    for name in _NAMED_WHEN_SET:
        if getattr(cfg, name) == getattr(default, name):
            del details[name]
    return details


def prepare(
    data_dir: str | os.PathLike | None = None,
    *,
    train: int = 12_000,
    validation: int = 600,
    test: int = 600,
    seed: int = 0,
    config: GeneratorConfig | None = None,
    exclude: Sequence[ParsedQuestion] = (),
    verbose: bool = False,
) -> LinalgCotData:
    """:func:`make_splits` written once as a TFDS ``array_record`` dataset and read back.

    ``exclude``: questions whose content no split may share (:func:`make_splits`), such as an
    exam's own, read at run time; only a hash of their contents is stored. The dataset's
    config name carries a hash of (format, seed, sizes, config, exclude): the same request
    reuses the files (``built`` False), any change writes a new dataset beside. ``data_dir``
    defaults to ``$SPARSE_JAX_DATA_DIR``, else ``~/.cache/sparse_jax/tfds``.

    Example:

    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory()
    >>> data = prepare(tmp.name, train=12, validation=6, test=6)  # TFDS prints 2 lines
    Downloading and preparing dataset ...
    Dataset sparse_jax_linalg_cot downloaded and prepared to ... reuse this data.
    >>> len(data.train), data.test[0] == make_splits(12, 6, 6)["test"][0], data.built
    (12, True, True)
    >>> prepare(tmp.name, train=12, validation=6, test=6).built  # written once
    False
    >>> tmp.cleanup()
    """
    sizes = {
        name: check_int(value, name, "prepare", low=1)
        for name, value in (("train", train), ("validation", validation), ("test", test))
    }
    seed = check_int(seed, "seed", "prepare", low=0)
    verbose = check_bool(verbose, "verbose", "prepare")
    cfg = GeneratorConfig() if config is None else config
    if not isinstance(cfg, GeneratorConfig):
        raise TypeError(f"prepare: `config` must be a GeneratorConfig; got {type(cfg).__name__}")
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(
            f"prepare: `data_dir` must be a str or os.PathLike; got {type(data_dir).__name__}"
        )
    root = (Path(data_dir).expanduser() if data_dir is not None else default_data_dir()).absolute()
    details = {
        "format": _FORMAT,
        "seed": seed,
        "sizes": sizes,
        "config": _config_details(cfg),
        # A hash of the excluded questions' contents: the dataset is told apart by them
        # without writing them down.
        **({"exclude": _contents_hash(exclude)} if exclude else {}),
    }
    key = hashlib.sha256(json.dumps(details, sort_keys=True).encode()).hexdigest()
    config_name = f"s{seed}_{key[:16]}"
    SparseJaxLinalgCot, SparseJaxLinalgCotConfig = _builder_classes()
    builder_config = SparseJaxLinalgCotConfig(name=config_name, details=json.dumps(details))
    with quiet_tfds(verbose):
        builder = SparseJaxLinalgCot(
            config=builder_config, data_dir=root, file_format="array_record"
        )
        built = not builder.is_prepared()
        if built:
            builder = SparseJaxLinalgCot(
                config=builder_config,
                data_dir=root,
                file_format="array_record",
                problems=make_splits(**sizes, seed=seed, config=cfg, exclude=exclude),
            )
            prepare_once(builder)
        sources = builder.as_data_source()
    return LinalgCotData(
        **{split: ProblemSource(sources[split], split) for split in SPLITS},
        dataset_name=f"{BUILDER_NAME}/{config_name}:{_BUILDER_VERSION}",
        dataset_dir=root / BUILDER_NAME / config_name / _BUILDER_VERSION,
        built=built,
    )
