"""python -m experiments.distill --config default --run.dir runs/default_l1

The embedded default (the same as no --config; ~410 s on 2 cores with the teacher trained, 211 s
with it cached). Should reach (docs/results.md, "The embedded default"): perplexity per byte
teacher 8.145, student 8.143, hardened 8.114; KL(teacher || .) student 0.0083, hardened 0.0260;
hardened attention density 28.8% / 21.7% at n = 128 / 512 (teacher 50.4% / 50.1%); attention
FLOPs at n = 512 738 M -> 445 M.

Data: CPython's bundled documentation topics as bytes. Teacher: the cpu-small GPT-2 (4 blocks,
width 256, 512 positions), 800 updates of 8 x 128 tokens, cached. Student: soft_union of
sink(4), windows 8/16/32, strided(11) and causal per head, 400 updates of KL + 0.02 x L1;
harden(budget=0.3), then 200 updates of fine-tuning.
"""

from experiments.distill_config import DistillConfig


def get_config() -> DistillConfig:
    return DistillConfig(config="default")
