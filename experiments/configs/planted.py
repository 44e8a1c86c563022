"""python -m experiments.distill --config planted --run.dir runs/planted-found

Does the student find where the teacher attends? The teacher of the default (cpu-small, 800
updates on the embedded corpus) trained with one candidate mask per head (--teacher.source
planted); the student starts from its weights with every candidate open and trains only its
candidate logits (sparsemax weights per head) on the KL alone, with Adam's epsilon (1e-4) above
the logits' gradients so that each step follows the KL's gradient instead of moving every logit
at the full rate (--train.fast-eps 1e-4, --train.fast-lr-multiplier 50). 133 s on 2 cores with
the planted teacher and its swap table cached (the first run makes both). Should reach
(docs/results.md, "Planted masks"): the planted candidate has the largest weight in 15 of 16
heads (`planted_recovered` 0.94; the 16th, a sink(4) head that causal replaces within 0.0018
nats/token, picked causal), 14 of 16 hardened by support to exactly the planted mask, KL
0.0023 nats/token.
"""

from experiments.distill_config import (
    DistillConfig,
    HardenConfig,
    LossConfig,
    TeacherConfig,
    TrainConfig,
)


def get_config() -> DistillConfig:
    return DistillConfig(
        config="planted",
        teacher=TeacherConfig(source="planted"),
        train=TrainConfig(trainable="core/logits", fast_lr_multiplier=50.0, fast_eps=1e-4),
        loss=LossConfig(mask_expected_cost=0.0),
        harden=HardenConfig(finetune_steps=0),
    )
