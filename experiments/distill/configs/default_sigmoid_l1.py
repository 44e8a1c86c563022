"""python -m experiments.distill --config default_sigmoid_l1 --run.dir runs/default_sigmoid_l1

The embedded default as it was before the candidate weights became a distribution: independent
sigmoid weights, 0.02 x their L1, harden(budget=0.3). Kept to compare with the default; its
weights collapse (every head's candidates nearly equal). Compared with: docs/results.md,
"The embedded default"; what it reached: docs/archive/results-history.md, "Before: independent
sigmoid weights, L1, a density budget".
"""

from experiments.distill.config import (
    FINETUNE_AT_FULL_RATE,
    RAMP_BEFORE_SEARCH,
    TRAIN_BEFORE_SEARCH,
    DistillConfig,
    HardenConfig,
    LossConfig,
    StudentConfig,
    TrainConfig,
)


def get_config() -> DistillConfig:
    return DistillConfig(
        config="default_sigmoid_l1",
        student=StudentConfig(weighting="sigmoid", combine="soft_union"),
        loss=LossConfig(mask_l1=0.02, mask_expected_cost=0.0, penalty_ramp=RAMP_BEFORE_SEARCH),
        train=TrainConfig(**TRAIN_BEFORE_SEARCH, recall_fraction=0.0),  # text alone, as then
        harden=HardenConfig(budget=0.3, price="density", **FINETUNE_AT_FULL_RATE),
    )
