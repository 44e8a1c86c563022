"""``python -m experiments.cascade``: CANDS, a language model whose later blocks see fewer
heads, FFN units and tokens, against a dense GPT-2 of the same shape, data, steps and seed
(:mod:`.job` says what a run does and writes).

The package, bottom up: :mod:`.config` (the flags), :mod:`.report` (report.md and plots),
:mod:`.job` (the run from end to end).

Example::

    from experiments import cascade

    summary = cascade.run(cascade.parse(["--train.steps", "10", "--run.dir", "/tmp/cascade"]))
"""

from experiments.cascade.config import (
    CascadeExperiment,
    Data,
    Model,
    Run,
    Train,
    linear_schedule,
    parse,
)
from experiments.cascade.job import main, run

__all__ = [
    "CascadeExperiment",
    "Data",
    "Model",
    "Run",
    "Train",
    "linear_schedule",
    "main",
    "parse",
    "run",
]
