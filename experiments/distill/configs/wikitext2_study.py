"""python -m experiments.distill --config wikitext2_study --run.dir runs/wikitext2-study

The WikiText-2 study of the distillation issue. What it reached: docs/results.md, "WikiText-2".

Data: ../shared/data/wikitext-2 as bytes (trains on valid.txt, evaluates on the first 128
windows of test.txt). Teacher: cpu-long (4 blocks, width 256, 2048 positions), 1200 updates of
8 x 512 tokens. Student: soft_union of sink(4), windows 16/32/64/128, strided(23) and causal
per head, 500 updates of KL + 0.02 x the density-weighted penalty (no L1); harden(budget=0.15),
then 200 updates of fine-tuning.
"""

from experiments.distill.config import (
    FINETUNE_AT_FULL_RATE,
    RAMP_BEFORE_SEARCH,
    TEACHER_TEXT_ONLY,
    TRAIN_BEFORE_SEARCH,
    DataConfig,
    DistillConfig,
    HardenConfig,
    LossConfig,
    MeasureConfig,
    StudentConfig,
    TeacherConfig,
    TrainConfig,
)


def get_config() -> DistillConfig:
    return DistillConfig(
        config="wikitext2_study",
        data=DataConfig(source="../shared/data/wikitext-2", seq_len=512),
        teacher=TeacherConfig(source="train", size="cpu-long", steps=1200, **TEACHER_TEXT_ONLY),
        student=StudentConfig(windows=(16, 32, 64, 128), weighting="sigmoid", combine="soft_union"),
        loss=LossConfig(
            mask_l1=0.0,
            mask_density=0.02,
            mask_expected_density=0.0,
            mask_expected_cost=0.0,
            penalty_ramp=RAMP_BEFORE_SEARCH,
        ),
        train=TrainConfig(steps=500, **TRAIN_BEFORE_SEARCH),
        harden=HardenConfig(
            budget=0.15, price="density", finetune_steps=200, **FINETUNE_AT_FULL_RATE
        ),
        measure=MeasureConfig(eval_batches=16),
    )
