"""python -m experiments.distill --config wikitext2_expected --run.dir runs/wikitext2-expected

The WikiText-2 study with the scale-free expected-density penalty in place of the
density-weighted one (3,853 s on 2 cores). Should reach (docs/results.md, "On WikiText-2: better
quality, no speed-up"): perplexity on test.txt teacher 4.796, hardened 4.813 (+0.35%); KL
hardened 0.0132 (student 0.0061); hardened density 12.9% / 7.2% at n = 512 / 2048; but attention
FLOPs at n = 2048 10.1 G -> 9.83 G (1.02x lower) and attention time 0.77x as fast: strided(23)
stays in every union and touches every kernel block.
These figures were measured before e6ba44a (optax's cross-entropy): a rerun differs by its
rounding (docs/results.md, "The embedded default").
"""

import dataclasses

from experiments.distill.config import RAMP_BEFORE_SEARCH, DistillConfig, LossConfig
from experiments.distill.configs import wikitext2_study


def get_config() -> DistillConfig:
    return dataclasses.replace(
        wikitext2_study.get_config(),
        config="wikitext2_expected",
        loss=LossConfig(
            mask_l1=0.0,
            mask_density=0.0,
            mask_expected_density=0.02,
            mask_expected_cost=0.0,
            penalty_ramp=RAMP_BEFORE_SEARCH,
        ),
    )
