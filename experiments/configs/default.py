"""python -m experiments.distill --config default --run.dir runs/default

The embedded default (the same as no --config; 5 min 15 s on 2 cores from a fresh clone, the
teacher loaded from the package). Should reach (docs/results.md, "The embedded default"):
perplexity per byte teacher 8.120, student 8.234, hardened 8.269; KL(teacher || .) student
0.0267, hardened 0.0273; hardened attention density 13.3% / 10.4% at n = 128 / 512 (teacher
50.4% / 50.1%); attention FLOPs at n = 512 738 M -> 250 M; in 15 of 16 heads a largest weight
>= 0.5 and a smallest <= 0.1.
"""

from experiments.distill_config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
