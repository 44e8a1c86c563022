"""python -m experiments.distill --config default --run.dir runs/default

The embedded default (the same as no --config; 8 min 06 s on 2 cores from a fresh clone, the
teacher trained in 227 s of it). Should reach (docs/results.md, "The embedded default"):
perplexity per byte teacher 8.120, student 8.288, hardened 8.205; KL(teacher || .) student
0.0567, hardened 0.0490; hardened attention density 9.2% / 4.7% at n = 128 / 512 (teacher
50.4% / 50.1%); attention FLOPs at n = 512 738 M -> 226 M; in every head a largest weight >= 0.5
and a smallest of 0.
"""

from experiments.distill_config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
