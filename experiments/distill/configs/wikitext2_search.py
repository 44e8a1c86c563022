"""python -m experiments.distill --config wikitext2_search --run.dir runs/wikitext2-search

The WikiText-2 study (the data, teacher, candidates and measurements of wikitext2_study) with
the main job's objective: the student searches where to attend on the teacher's own weights
(only the candidate logits train; each head mixes its candidates' attentions by
reviving-sparsemax weights), on the KL alone for the first half of its 500 updates, then with
the block price at the serving length 4 x 512 = 2048 ramped in to 0.03 by three quarters;
hardened to each head's strongest candidate (--harden.threshold 0.5, no budget), then 200
updates of fine-tuning of every weight. What it reached: docs/results.md, "WikiText-2 with the
default objective"."""

import dataclasses

from experiments.distill.config import (
    DistillConfig,
    HardenConfig,
    LossConfig,
    StudentConfig,
    TrainConfig,
)
from experiments.distill.configs import wikitext2_study


def get_config() -> DistillConfig:
    study = wikitext2_study.get_config()
    return dataclasses.replace(
        study,
        config="wikitext2_search",
        student=StudentConfig(windows=study.student.windows),
        loss=LossConfig(mask_expected_cost=0.03),
        train=TrainConfig(steps=study.train.steps),
        harden=HardenConfig(finetune_steps=study.harden.finetune_steps),
    )
