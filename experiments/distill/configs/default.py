"""python -m experiments.distill --config default --run.dir runs/default

The embedded default (the same as no --config): the teacher bundled with the package, a student
that searches each head's candidate masks on the KL and the block price, hardened to each
head's strongest candidate. What it reaches (perplexity, KL, density, FLOPs, speed, the time
from a fresh clone), with command and machine: docs/results.md, "The embedded default"."""

from experiments.distill.config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
