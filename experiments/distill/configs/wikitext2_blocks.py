"""python -m experiments.distill --config wikitext2_blocks --run.dir runs/wikitext2-blocks

The WikiText-2 study with the main job's objective: candidate weights as a sparsemax
distribution per head, priced by the kernel's key blocks at the serving length 4 x 512 = 2048
(--loss.mask-expected-cost 0.003, no density penalty), hardened by support (no budget). What it
reached: docs/results.md, "WikiText-2 with the block price".
"""

import dataclasses

from experiments.distill.config import (
    FINETUNE_AT_FULL_RATE,
    HARDEN_BEFORE_REVIVING,
    RAMP_BEFORE_SEARCH,
    DistillConfig,
    HardenConfig,
    LossConfig,
)
from experiments.distill.configs import wikitext2_study


def get_config() -> DistillConfig:
    study = wikitext2_study.get_config()
    return dataclasses.replace(
        study,
        config="wikitext2_blocks",
        student=dataclasses.replace(study.student, weighting="sparsemax"),
        loss=LossConfig(
            mask_l1=0.0,
            mask_density=0.0,
            mask_expected_cost=0.003,
            penalty_ramp=RAMP_BEFORE_SEARCH,
        ),
        harden=HardenConfig(
            budget=None,
            price="blocks",
            finetune_steps=200,
            **FINETUNE_AT_FULL_RATE,
            **HARDEN_BEFORE_REVIVING,
        ),
    )
