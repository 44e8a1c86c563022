"""python -m experiments.distill --config default --run.dir runs/default_l1

The embedded default (the same as no --config; 7 min 42 s on 2 cores from a fresh clone, the
teacher trained in 195 s of it). Should reach (docs/results.md, "The embedded default"):
perplexity per byte teacher 8.120, student 8.136, hardened 8.062; KL(teacher || .) student
0.0109, hardened 0.0316; hardened attention density 29.4% / 24.3% at n = 128 / 512 (teacher
50.4% / 50.1%); attention FLOPs at n = 512 738 M -> 487 M.
"""

from experiments.distill_config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
