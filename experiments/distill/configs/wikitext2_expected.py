"""python -m experiments.distill --config wikitext2_expected --run.dir runs/wikitext2-expected

The WikiText-2 study with the scale-free expected-density penalty in place of the
density-weighted one: better quality, but no speed-up, since strided(23) stays in every union
and touches every kernel block. What it reached: docs/results.md, "On WikiText-2: better
quality, no speed-up".
"""

import dataclasses

from experiments.distill.config import DistillConfig
from experiments.distill.configs import wikitext2_study


def get_config() -> DistillConfig:
    study = wikitext2_study.get_config()
    return dataclasses.replace(
        study,
        config="wikitext2_expected",
        loss=dataclasses.replace(study.loss, mask_density=0.0, mask_expected_density=0.02),
    )
