"""python -m experiments.distill --config default --run.dir runs/default

The embedded default (the same as no --config; 2 min 52 s on 2 cores from a fresh clone of
31665af, the teacher loaded from the package). Should reach (docs/results.md, "The embedded
default"): perplexity per byte teacher 8.120, student 8.103, hardened 8.087 (-0.41%);
KL(teacher || .) student 0.0092, hardened 0.0075; hardened attention density 24.9% / 13.7% at
n = 128 / 512 (teacher 50.4% / 50.1%); attention FLOPs at n = 512 738 M -> 327 M; in 16 of 16
heads a largest weight >= 0.5 and a smallest <= 0.1."""

from experiments.distill.config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
