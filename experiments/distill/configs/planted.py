"""python -m experiments.distill --config planted --run.dir runs/planted-found

Does the KL alone point at the planted masks? The teacher of the default (cpu-small on the
embedded corpus) trained with one candidate mask per head (--teacher.source planted); the
student starts from its weights with every candidate open and, as in the default, trains only
its candidate logits (sparsemax weights per head, Adam's epsilon 1e-4 at 50x the rate), here on
the KL alone (no block price) and with no fine-tune, under the soft union of sparsemax weights
hardened by support (the candidate choice before the reviving mixture). The default objective
on the same teacher is `--teacher.source planted` alone. The first run also trains the planted
teacher and its swap table, later runs take both from the cache. What it reached (the heads
whose planted candidate won, and hardened to it): docs/results.md, "Planted masks" (the runs
of this config: docs/archive/results-history.md, "Before `7034391`: the KL alone on fixed
weights, and the old default objective").
"""

from experiments.distill.config import (
    HARDEN_BEFORE_REVIVING,
    STUDENT_BEFORE_REVIVING,
    TEACHER_TEXT_ONLY,
    DistillConfig,
    HardenConfig,
    LossConfig,
    StudentConfig,
    TeacherConfig,
)


def get_config() -> DistillConfig:
    return DistillConfig(
        config="planted",
        teacher=TeacherConfig(source="planted", **TEACHER_TEXT_ONLY),
        student=StudentConfig(**STUDENT_BEFORE_REVIVING),
        loss=LossConfig(mask_expected_cost=0.0),
        harden=HardenConfig(finetune_steps=0, **HARDEN_BEFORE_REVIVING),
    )
