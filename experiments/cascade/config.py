"""The flags of ``python -m experiments.cascade`` (``--help`` lists them): frozen dataclasses,
one per group, each checked when built so that a bad value is refused naming its flag.

>>> parse(["--train.steps", "10"]).train.steps
10
>>> linear_schedule(0.4, 4)
(1.0, 0.8, 0.6000000000000001, 0.4)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

import tyro

from experiments.common.flags import RunFlags, flag_name, set_ints_at_least
from sparse_jax.data.text import resolve_source
from sparse_jax.models import GPT2Config
from sparse_jax.models.cascade import CascadeConfig
from sparse_jax.models.gpt2 import PRESETS

__all__ = ["CascadeExperiment", "Data", "Model", "Run", "Train", "linear_schedule", "parse"]


@dataclasses.dataclass(frozen=True)
class Data:
    source: str = "default"
    """Corpus: 'default' (the embedded CPython documentation topics), a WikiText-2 folder, a
    .txt file or folder, or tfds:<name> (as the main job reads them)."""
    seq_len: int = 128
    """Training length T (the speed is also measured at 4 T)."""
    batch_size: int = 8
    """Sequences per update."""


@dataclasses.dataclass(frozen=True)
class Model:
    size: str = "cpu-small"
    """GPT-2 size preset of both models (sparse_jax.models.gpt2.PRESETS)."""
    keep_ratios: tuple[float, ...] | None = None
    """Target kept fraction of tokens, heads and units per block, r_1 = 1 >= r_2 >= ... (None:
    from 1 down to --model.final-keep, linearly)."""
    final_keep: float = 0.4
    """The last block's target when --model.keep-ratios is not given (how it was chosen:
    docs/results.md, the cascade)."""
    gate: Literal["hard_concrete", "sigmoid_ste"] = "hard_concrete"
    """Gate kind: Hard Concrete L0 gates, or the published sigmoid with a straight-through
    estimator."""
    penalty: Literal["lagrangian", "l1"] = "lagrangian"
    """How the targets are pursued: CoFi's Lagrangian, or the published λ Σ sigmoid(z)."""
    l1_weight: float = 0.01
    """λ of --model.penalty l1."""
    head_keep: tuple[float, ...] | None = None
    """Target kept fraction of heads per block (None: --model.keep-ratios)."""
    unit_keep: tuple[float, ...] | None = None
    """Target kept fraction of FFN units per block (None: --model.keep-ratios)."""
    nested_heads: bool = True
    """A head closed in block l stays closed in every later block (SpAtten's cascade)."""
    capacity_slack: float = 0.0625
    """The pruned model's token slots per block: its keep target plus this fraction of T (at
    most T), one compiled call; a block that keeps more runs on more slots, chosen in that
    call, and the batch is counted."""
    score_scaling: bool = False
    """The CANDS code's module instead (head gates scale the attention scores): prunes nothing."""


@dataclasses.dataclass(frozen=True)
class Train:
    steps: int = 400
    """Updates of each model."""
    lr: float = 3e-3
    """Peak learning rate (warm-up, cosine decay)."""
    gate_lr_multiplier: float = 1.0
    """Learning-rate multiplier of the gates, routers and Lagrange multipliers (faster
    multipliers oscillate: docs/results.md, the cascade)."""


@dataclasses.dataclass(frozen=True)
class Run(RunFlags):
    eval_batches: int = 8
    """Evaluation batches of --data.batch-size windows."""

    def __post_init__(self):
        super().__post_init__()
        set_ints_at_least(self, "run", eval_batches=1)


@dataclasses.dataclass(frozen=True)
class CascadeExperiment:
    """Dense GPT-2 against CANDS, a cascade whose later blocks see fewer heads, FFN units and
    tokens (``python -m experiments.cascade``)."""

    data: Data = Data()
    model: Model = Model()
    train: Train = Train()
    run: Run = Run()
    sweep: tuple[float, ...] = ()
    """Also train cascades whose last block keeps these fractions (schedules from 1 down to
    each, linearly) for a Pareto plot of perplexity against FLOPs."""

    def __post_init__(self):
        d, t = self.data, self.train
        set_ints_at_least(d, "data", seq_len=2, batch_size=1)
        set_ints_at_least(t, "train", steps=1)
        if self.model.size not in PRESETS:
            raise ValueError(
                f"--model.size {self.model.size!r} is not a preset; allowed: {list(PRESETS)}"
            )
        for name, value in (
            ("--train.lr", t.lr),
            ("--train.gate-lr-multiplier", t.gate_lr_multiplier),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0; got {value!r}")
        slack = self.model.capacity_slack
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack <= 1:
            raise ValueError(f"--model.capacity-slack must be a number in [0, 1]; got {slack!r}")
        if not 0 < self.model.final_keep <= 1:
            raise ValueError(
                f"--model.final-keep must lie in (0, 1]; got {self.model.final_keep!r}"
            )
        for r in self.sweep:
            if not 0 < r <= 1:
                raise ValueError(f"--sweep ratios must lie in (0, 1]; got {list(self.sweep)}")
        sizes = GPT2Config.preset(self.model.size)
        if 4 * d.seq_len > sizes.n_positions:
            raise ValueError(
                f"--data.seq-len {d.seq_len}: the speed is measured at 4 x {d.seq_len} = "
                f"{4 * d.seq_len} tokens, more than --model.size {self.model.size!r}'s "
                f"{sizes.n_positions} positions"
            )
        try:  # the model's own checks, named by their flags
            self.cascade_config(vocab_size=257)
        except (ValueError, TypeError) as err:
            named = (_MODEL_FLAGS.get(n) for n in re.findall(r"`(\w+)`", str(err)))
            flag = next((f for f in named if f is not None), "--model.keep-ratios")
            raise ValueError(f"{flag}: {err}") from err
        if d.source != "default" and not d.source.startswith("tfds:"):
            try:  # the corpus is there and of a kind read (a tfds: name is checked with the data)
                resolve_source(d.source)
            except (ValueError, TypeError) as err:
                raise ValueError(f"--data.source: {err}") from err

    def cascade_config(self, vocab_size: int, keep_ratios=None) -> CascadeConfig:
        """The cascade's config; ``keep_ratios`` (a sweep point) replaces every target."""
        m = self.model
        sweep = keep_ratios is not None
        g = GPT2Config.preset(m.size, vocab_size=vocab_size)
        if not sweep:
            keep_ratios = m.keep_ratios or linear_schedule(m.final_keep, g.n_layer)
        config = CascadeConfig(
            g,
            keep_ratios=keep_ratios,
            head_keep=None if sweep else m.head_keep,
            unit_keep=None if sweep else m.unit_keep,
            gate=m.gate,
            penalty=m.penalty,
            l1_weight=m.l1_weight,
            score_scaling=m.score_scaling,
            nested_heads=m.nested_heads,
        )
        if m.score_scaling:  # no token gates: every block keeps every token
            return config
        slots = [1.0] + [min(1.0, r + m.capacity_slack) for r in config.keep_ratios[1:]]
        return dataclasses.replace(config, capacity=tuple(slots))


# The flag of each CascadeConfig field its errors name (in backquotes).
_SAME_NAME = ("keep_ratios", "head_keep", "unit_keep", "gate", "penalty", "l1_weight")
_MODEL_FLAGS = {
    **{name: flag_name(f"model.{name}") for name in _SAME_NAME},
    "score_scaling": "--model.score-scaling",
    "nested_heads": "--model.nested-heads",
    "capacity": "--model.capacity-slack",
    "gpt2": "--model.size",
}


def linear_schedule(final: float, blocks: int) -> tuple[float, ...]:
    """Keep targets from 1 (block 1) down to ``final`` (the last block), linearly."""
    return tuple(1.0 - (1.0 - final) * i / max(blocks - 1, 1) for i in range(blocks))


def parse(argv: list[str] | None = None) -> CascadeExperiment:
    """The experiment's flags (``--help`` lists them); a bad value exits with its message."""
    return tyro.cli(CascadeExperiment, args=argv, prog="python -m experiments.cascade")
