"""python -m experiments.distill --config default --run.dir runs/default

The embedded default (the same as no --config; 2 min 37 s on 2 cores from a fresh clone of
0c61fb1, the teacher loaded from the package). Should reach (docs/results.md, "The embedded
default"): perplexity per byte teacher 8.120, student 8.369, hardened 8.208 (+1.08%);
KL(teacher || .) student 0.0322, hardened 0.0131; hardened attention density 20.5% / 16.9% at
n = 128 / 512 (teacher 50.4% / 50.1%); attention FLOPs at n = 512 738 M -> 331 M; in 16 of 16
heads a largest weight >= 0.5 and a smallest <= 0.1."""

from experiments.distill_config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
