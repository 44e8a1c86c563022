"""python -m experiments.distill --config default --run.dir runs/default

The embedded default (the same as no --config; 2 min 33 s on 2 cores from a fresh clone of
65f1772, the teacher loaded from the package). Should reach (docs/results.md, "The embedded
default"): perplexity per byte teacher 8.120, student 8.408, hardened 8.230 (+1.35%);
KL(teacher || .) student 0.0364, hardened 0.0151; hardened attention density 16.2% / 13.5% at
n = 128 / 512 (teacher 50.4% / 50.1%); attention FLOPs at n = 512 738 M -> 283 M; in 16 of 16
heads a largest weight >= 0.5 and a smallest <= 0.1."""

from experiments.distill_config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
