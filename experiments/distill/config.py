"""The configuration of ``python -m experiments.distill``: frozen dataclasses, one per concern.

Each group is a flag prefix on the command line (``--data.seq-len 512``, ``--train.steps 500``);
``--config <name>`` starts from a named study config in ``experiments/distill/configs/`` instead
of the defaults below. Every field is checked when the config is built, so that a bad flag fails
with a message naming it, its value and what is allowed, before anything is compiled or trained.

The command line is read, and a config written back as a command, by
:mod:`experiments.distill.cli` (which knows the named studies; this module only lists them).

Example::

    from experiments.distill.config import DistillConfig, TrainConfig

    config = DistillConfig(train=TrainConfig(steps=10))
    config.flags()["train.steps"]  # 10
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import pathlib
import re
from typing import Any, ClassVar, Literal

from experiments.common import teachers
from experiments.common.flags import check_max_minutes, flag_name, is_int, set_ints_at_least
from experiments.distill import configs
from sparse_jax.data.recall import shortest_length
from sparse_jax.models.gpt2 import POSITIONS, PRESETS, GPT2Config
from sparse_jax.models.hf import (
    PretrainedFileError,
    check_weights_file,
    from_pretrained,
    read_config,
)

__all__ = [
    "FINETUNE_AT_FULL_RATE",
    "HARDEN_BEFORE_REVIVING",
    "OLD_FLAGS",
    "RAMP_BEFORE_SEARCH",
    "STUDENT_BEFORE_REVIVING",
    "TRAIN_BEFORE_SEARCH",
    "DataConfig",
    "DistillConfig",
    "HardenConfig",
    "LossConfig",
    "MeasureConfig",
    "RunConfig",
    "StudentConfig",
    "TeacherConfig",
    "TrainConfig",
]

# The presets of sparse_jax.models.gpt2 (GPT2Config.preset(name)), as command-line choices.
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
# The study configs in experiments/distill/configs/ (one module each).
ConfigName = Literal[configs.NAMES]  # type: ignore[valid-type]


class _Group:
    """Checks shared by the groups; ``group`` is the field (and flag prefix) holding it."""

    group: ClassVar[str]

    def flag(self, name: str) -> str:
        return flag_name(f"{self.group}.{name}")

    def number(self, name: str, *, positive: bool) -> None:
        value = getattr(self, name)
        ok = value > 0 if positive else value >= 0
        if isinstance(value, bool) or not (ok and math.isfinite(value)):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(f"{self.flag(name)} must be a number {bound}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig(_Group):
    """The corpus, its tokens and the batches of windows."""

    group: ClassVar[str] = "data"

    source: str = "default"
    """'default' (CPython's bundled pydoc topics: no network, no files), a .txt file or folder,
    a WikiText-2 folder (trains on valid.txt, evaluates on test.txt) or 'tfds:<name>'."""
    tokenizer: str = "byte"
    """'byte' (257 ids, needs nothing), 'gpt2' (tiktoken files) or a folder of vocabulary files."""
    seq_len: int = 128
    """Tokens per training sequence (<= the teacher's positions; speed is also measured at 4x)."""
    batch_size: int = 8
    """Global batch (sequences per update, every phase); must divide over the mesh's data axis."""

    def __post_init__(self):
        set_ints_at_least(self, self.group, seq_len=1, batch_size=1)
        if self.source != "default" and not self.source.startswith("tfds:"):
            if not pathlib.Path(self.source).exists():
                raise ValueError(f"{self.flag('source')} path {self.source!r} does not exist")
        if self.tokenizer not in ("byte", "gpt2") and not pathlib.Path(self.tokenizer).is_dir():
            raise ValueError(
                f"{self.flag('tokenizer')} must be 'byte', 'gpt2' or a folder of GPT-2 "
                f"vocabulary files; got {self.tokenizer!r} (no such folder)"
            )


@dataclasses.dataclass(frozen=True)
class TeacherConfig(_Group):
    """The dense teacher: trained here (and cached) or loaded."""

    group: ClassVar[str] = "teacher"

    source: str = "bundled"
    """'bundled': the teacher shipped with the package (experiments/distill/teachers: what 'train'
    gives with the default flags, trained by `python -m experiments.bundle_teacher`, weights
    rounded to float16); 'train': a GPT-2 of --teacher.size trained here (cached in
    --run.cache-dir); 'planted': the same trained with a known candidate mask per head (the
    test of whether the student finds them); a folder holding a Hugging Face GPT-2
    (config.json + model.safetensors); or a hub name such as 'gpt2' (network)."""
    size: PresetName = "cpu-small"
    """Size of the trained teacher: a GPT2Config.preset name (vocabulary from the tokenizer)."""
    steps: int = 800
    """Updates of the trained teacher."""
    lr: float = 3e-3
    """Peak learning rate of the trained teacher."""
    smear_keys: bool = True
    """The trained teacher smears its keys (GPT2Config.smear_keys: each key mixed with the
    previous positions' by weights per head), which lets it learn to retrieve (induction)."""
    smear_width: int = 3
    """With --teacher.smear-keys, how many previous positions' keys each key mixes in
    (GPT2Config.smear_width: a weight per head and position back), so that a head can match the
    few tokens before a key, not only the last one; 1 with --teacher.no-smear-keys."""
    positions: Literal["learned", "rotary"] = "rotary"
    """How the trained teacher (and so its students) knows positions (GPT2Config.positions):
    'learned' embeddings, one per position, or 'rotary' (queries and keys turned by their
    positions, so that a score sees only distances: what the model learns at short lengths
    holds at later positions)."""
    recall_steps: int = 3000
    """Updates of the trained teacher after its --teacher.steps on text, on a mixture of text and
    passkey sequences (sparse_jax.data.recall.RecallMixture), so that it retrieves a key stated
    far back; 0: none (text alone)."""
    recall_fraction: float = 0.5
    """Share of passkey sequences in those updates."""
    recall_lengths: tuple[int, ...] = ()
    """Sequence lengths of those updates, cycled (empty: 1x, 2x and 4x --data.seq-len, the lengths
    the report asks at, as far as they fit the teacher's positions; each <= its positions)."""
    recall_tokens: int = 2048
    """Tokens per update of those updates (tokens // length sequences)."""
    recall_lr: float = 2e-3
    """Peak learning rate of those updates."""
    recall_long_steps: int = 4000
    """Updates after those, on the same mixture at the longest of the recall lengths alone (a
    phase of its own, teacher_recall_long, with its own warm-up and decay): retrieval learned
    at the shorter lengths first, then practised where it is hardest; 0: none, and none
    without --teacher.recall-steps (0 turns every recall update off)."""
    recall_long_lr: float = 2e-3
    """Peak learning rate of the --teacher.recall-long-steps updates (each phase warms up to its
    peak and decays: a peak as high as the first phase's undoes part of what it learned)."""
    answer_weight: float = 5.0
    """The loss of those updates: next-token cross entropy plus this times its mean over the
    answers' tokens."""

    TRAINED: ClassVar[tuple[str, ...]] = ("train", "planted")  # sources trained here
    # The flags a trained teacher depends on (besides the data's): bundled teachers record them.
    TRAINING: ClassVar[tuple[str, ...]] = (
        "size", "steps", "lr", "smear_keys", "smear_width", "positions", "recall_steps",
        "recall_fraction",
        "recall_lengths", "recall_tokens", "recall_lr", "answer_weight", "recall_long_steps",
        "recall_long_lr",
    )  # fmt: skip

    def __post_init__(self):
        set_ints_at_least(
            self, self.group, steps=1, smear_width=1, recall_steps=0, recall_tokens=1,
            recall_long_steps=0,
        )  # fmt: skip
        if not self.recall_steps:  # 0 turns every recall update off, the long ones too
            object.__setattr__(self, "recall_long_steps", 0)
        self.number("lr", positive=True)
        self.number("recall_lr", positive=True)
        self.number("recall_long_lr", positive=True)
        self.number("answer_weight", positive=False)
        fraction = self.recall_fraction
        if isinstance(fraction, bool) or not (0.0 <= fraction <= 1.0):
            raise ValueError(f"{self.flag('recall_fraction')} must be in [0, 1]; got {fraction!r}")
        if not isinstance(self.smear_keys, bool):
            raise ValueError(f"{self.flag('smear_keys')} must be true or false; got "
                             f"{self.smear_keys!r}")  # fmt: skip
        if self.smear_width != 1 and not self.smear_keys:
            raise ValueError(
                f"{self.flag('smear_width')} {self.smear_width} mixes keys over the previous "
                "positions: add --teacher.smear-keys, or --teacher.smear-width 1 for plain keys"
            )
        lengths = self.recall_lengths
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
            raise ValueError(f"{self.flag('recall_lengths')} must be ints >= 1; got {lengths!r}")
        lengths = tuple(lengths)
        if any(not is_int(n) or n < 1 for n in lengths):
            raise ValueError(f"{self.flag('recall_lengths')} must be ints >= 1; got {lengths!r}")
        object.__setattr__(self, "recall_lengths", tuple(int(n) for n in lengths))
        if self.positions not in POSITIONS:
            raise ValueError(
                f"{self.flag('positions')} must be one of {list(POSITIONS)}; got {self.positions!r}"
            )
        if self.size not in PRESETS:
            raise ValueError(
                f"{self.flag('size')} {self.size!r} is not a preset; allowed: {list(PRESETS)}"
            )
        if self.source == "bundled":
            return  # checked with the data flags (DistillConfig), from the files shipped
        if self.source not in self.TRAINED and not pathlib.Path(self.source).is_dir():
            if "/" in self.source or self.source.startswith("."):
                raise ValueError(f"{self.flag('source')} folder {self.source!r} does not exist")
        self.hf_config()  # a local folder's files are checked now, before anything is written

    def check_bundled(self, seq_len: int) -> None:
        """For --teacher.source bundled: the files are there and readable, the teacher flags
        are those it was trained with, and ``seq_len`` is no longer than its training windows."""
        trained = teachers.record()["flags"]
        for name in self.TRAINING:
            value = getattr(self, name)
            used = trained.get(f"teacher.{name}", getattr(TeacherConfig, name))
            if isinstance(value, tuple):
                used = tuple(used)
            if value != used:
                raise ValueError(
                    f"{self.flag(name)} {value!r} applies to a teacher trained here, but "
                    f"--teacher.source is 'bundled' (trained with {self.flag(name)} {used!r}): "
                    "add --teacher.source train"
                )
        if seq_len > trained["data.seq_len"]:
            raise ValueError(
                f"--data.seq-len {seq_len} is longer than the {trained['data.seq_len']} tokens "
                "the bundled teacher was trained on: add --teacher.source train (trains a "
                "teacher at this length)"
            )
        self.hf_config()

    def folder(self) -> pathlib.Path | None:
        """The local folder the teacher is loaded from (the bundled one, or --teacher.source
        when it is a folder); None when it is trained here or fetched from the hub."""
        if self.source == "bundled":
            return teachers.BUNDLED
        if self.source in self.TRAINED or not pathlib.Path(self.source).is_dir():
            return None
        return pathlib.Path(self.source)

    def hf_config(self) -> GPT2Config | None:
        """The GPT2Config of the teacher's local folder (None: trained here, or a hub name);
        a folder whose config.json or model.safetensors cannot be used is refused."""
        folder = self.folder()
        if folder is None:
            return None
        flag = f"{self.flag('source')} {self.source!r}"
        if not all((folder / name).is_file() for name in ("config.json", "model.safetensors")):
            try:  # says which files are missing, or how to convert a pickled checkpoint
                from_pretrained(folder)
            except (FileNotFoundError, ValueError) as err:
                raise ValueError(f"{flag}: {err}") from err
        try:
            config = read_config(folder / "config.json")
            check_weights_file(folder / "model.safetensors")
        except PretrainedFileError as err:
            raise ValueError(
                f"{flag}: {err.path} {err.problem}. Pass a folder "
                "holding a Hugging Face GPT-2 (config.json and model.safetensors; download it "
                "again if it was cut short)"
            ) from err
        return config

    def n_positions(self) -> int | None:
        """The teacher's n_positions, known before anything is built (None for a hub name)."""
        if self.source in self.TRAINED:
            return GPT2Config.preset(self.size).n_positions
        config = self.hf_config()
        return None if config is None else config.n_positions


@dataclasses.dataclass(frozen=True)
class StudentConfig(_Group):
    """The sparse student built from the teacher's weights."""

    group: ClassVar[str] = "student"

    kind: Literal["candidates", "gated", "fixed"] = "candidates"
    """Learned candidate masks per head, gated heads/FFN units, or a fixed sparse mask."""
    normalizer: str = "softmax"
    """Attention normalizer: softmax, sparsemax, entmax15 or a float alpha >= 1 (1 is softmax)."""
    combine: Literal["soft_union", "soft_mask", "mixture"] = "mixture"
    """How candidate masks combine (see sparse_jax.models.layers): 'mixture' runs each
    candidate's attention on its own and mixes the outputs by the weights (a candidate that lets
    hidden keys in is visibly wrong at any weight); 'soft_union' adds log(noisy-OR of the
    weights) to the scores (docs/results.md, "Planted masks", on why the default changed)."""
    anchor_self: bool = False
    """Candidates: keep each query's own position at weight 1, so that the penalty cannot
    shrink all candidate weights together at no cost (see CandidateMaskAttention)."""
    granularity: Literal["layer", "head"] = "head"
    """Candidate weights per layer or per head."""
    weighting: Literal["sigmoid", "sparsemax", "entmax15", "softmax", "reviving_sparsemax"] = (
        "reviving_sparsemax"
    )
    """How candidate logits become weights: a distribution over each head's candidates with
    exact zeros (sparsemax/entmax15: no penalty can shrink every weight together, and hardening
    keeps each head's support; reviving_sparsemax: sparsemax whose backward pass lets a dropped
    candidate return when the loss would gain from it), softmax (no zeros: a dropped candidate
    keeps its gradient; hardening keeps each head's strongest), or independent sigmoids (the
    published form, which collapses: docs/results.md)."""
    serve_len_factor: int = 4
    """The serving length, as a multiple of --data.seq-len, at which --loss.mask-expected-cost
    prices each candidate by the key blocks the block-sparse kernel computes."""
    windows: tuple[int, ...] = (8, 16, 32)
    """Causal window sizes of the candidate bank (besides sink(4), strided and full causal)."""
    select_blocks: int = 0
    """Add a data-dependent candidate to the bank: each query token's own key block and the
    --student.select-blocks earlier blocks whose mean key scores highest against it
    (sparse_jax.dynamic.BlockSelection, MoBA's gate); 0: none. A head that keeps it keeps it
    hardened (on the XLA engine)."""
    select_block: int = 16
    """Keys per block of --student.select-blocks."""
    select_gate: Literal["pooled", "learned"] = "pooled"
    """How --student.select-blocks ranks the earlier blocks: 'pooled', the mean key's score
    (MoBA's gate, free), or 'learned', a small gate per head and layer
    (sparse_jax.block_gate.LearnedBlockSelection, SeerAttention's idea) that starts as the
    pooled score and is trained by --loss.selector-kl to predict where the layer's own full
    causal attention goes, block by block (before the search: --train.selector-steps); a head
    that keeps it keeps its gate hardened."""
    select_pool: Literal["sum", "max"] = "sum"
    """With --student.select-gate learned: how the gates' target pools the layer's attention
    per key block, 'sum' (the block's share) or 'max' (its largest weight, SeerAttention's)."""
    fixed_window: int = 32
    """Window of the 'fixed' student (causal window | sink(4))."""
    block_size: int = 64
    """Block size of the block-sparse kernel in the students (64 ran fastest on CPU; 128 on TPU)."""
    gate: Literal["sigmoid_ste", "hard_concrete", "sigmoid"] = "sigmoid_ste"
    """Gate kind of the 'gated' student."""

    def __post_init__(self):
        set_ints_at_least(self, self.group, block_size=1, fixed_window=1, serve_len_factor=1)
        set_ints_at_least(self, self.group, select_blocks=0, select_block=1)
        windows = self.windows
        if isinstance(windows, (str, bytes)) or not hasattr(windows, "__iter__"):
            raise ValueError(f"{self.flag('windows')} must be ints >= 1; got {windows!r}")
        windows = tuple(windows)
        if not windows or any(not is_int(w) or w < 1 for w in windows):
            raise ValueError(f"{self.flag('windows')} must be ints >= 1; got {windows!r}")
        object.__setattr__(self, "windows", tuple(int(w) for w in windows))
        if self.anchor_self and self.combine == "mixture":
            raise ValueError(
                f"{self.flag('anchor_self')} needs {self.flag('combine')} soft_union or "
                "soft_mask; got mixture"
            )
        if self.weighting == "reviving_sparsemax" and self.combine != "mixture":
            raise ValueError(
                f"{self.flag('weighting')} reviving_sparsemax needs {self.flag('combine')} "
                f"mixture; got {self.combine}"
            )
        if self.normalizer not in ("softmax", "sparsemax", "entmax15"):
            try:
                alpha = float(self.normalizer)
            except ValueError:
                alpha = 0.0
            if not (alpha >= 1 and math.isfinite(alpha)):
                raise ValueError(
                    f"{self.flag('normalizer')} must be softmax, sparsemax, entmax15 or a finite "
                    f"float alpha >= 1 (1 is softmax); got {self.normalizer!r}"
                )

    def normalizer_value(self) -> str | float:
        """The normalizer as AttentionSpec takes it (a name or the float alpha)."""
        if self.normalizer in ("softmax", "sparsemax", "entmax15"):
            return self.normalizer
        return float(self.normalizer)


@dataclasses.dataclass(frozen=True)
class LossConfig(_Group):
    """The distillation objective: KL to the teacher plus the sparsity penalties."""

    group: ClassVar[str] = "loss"

    temperature: float = 1.0
    """Distillation temperature T (the loss is scaled by T^2)."""
    direction: Literal["forward", "reverse", "jsd"] = "forward"
    """forward = KL(teacher || student), reverse, or Jensen-Shannon."""
    mask_l1: float = 0.0
    """Weight of the L1 penalty on candidate weights (sum of the weights, per block; constant
    for sparsemax/entmax15 weights: use it with --student.weighting sigmoid)."""
    mask_density: float = 0.0
    """Weight of the density-weighted penalty on candidate weights (Σ weight x the candidate's
    share of the causal entries, per block): prices each candidate by what it costs."""
    mask_expected_density: float = 0.0
    """Weight of the scale-free density penalty (per block, the mean over heads of Σ π_c x
    share_c with π = weights / their sum): only the weights' ratios count, as under softmax.
    It prices score entries, not kernel blocks: see docs/results.md before using it."""
    mask_expected_cost: float = 0.015
    """Weight of the block-priced penalty (per block, the mean over heads of Σ π_c x cost_c,
    cost_c = the key blocks the kernel computes for candidate c at the serving length, causal
    = 1; see --student.serve-len-factor)."""
    gate_l1: float = 0.0005
    """Weight of the head/FFN gate penalties."""
    selector_kl: float = 1.0
    """Weight of the learned block selectors' loss (--student.select-gate learned: per layer,
    the KL from the layer's own causal attention, summed per key block, to its gate's softmax
    over the blocks; it trains the gates only and is not ramped)."""
    penalty_ramp: tuple[float, float] = (0.5, 0.75)
    """START END, fractions of the student's updates: the mask penalties are off before START,
    grow linearly from 0 at START to their weights at END ((0, 0): at full weight from the
    first update). Off at first, the KL alone decides which candidates a head needs; the price
    then chooses among those it is indifferent to (at full weight from the start, its steady
    gradient pushes needed candidates out of the sparsemax support before the KL's gradient,
    small near uniform weights, can keep them: docs/archive/results-history.md, "Planted
    masks")."""

    def __post_init__(self):
        self.number("temperature", positive=True)
        for name in (
            "mask_l1",
            "mask_density",
            "mask_expected_density",
            "mask_expected_cost",
            "gate_l1",
            "selector_kl",
        ):
            self.number(name, positive=False)
        ramp = self.penalty_ramp
        ok = len(ramp) == 2 and all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in ramp
        )
        if not (ok and 0 <= ramp[0] <= ramp[1] <= 1):
            raise ValueError(
                f"{self.flag('penalty_ramp')} must be two fractions START <= END in [0, 1]; "
                f"got {ramp!r}"
            )
        object.__setattr__(self, "penalty_ramp", (float(ramp[0]), float(ramp[1])))

    def ramp_steps(self, steps: int) -> tuple[int, int]:
        """--loss.penalty-ramp in updates of a phase of ``steps``."""
        return round(self.penalty_ramp[0] * steps), round(self.penalty_ramp[1] * steps)

    def penalty_weights(self) -> dict[str, float]:
        """The penalty weights by the names of the models' aux outputs."""
        return {
            "mask_l1": self.mask_l1,
            "mask_density": self.mask_density,
            "mask_expected_density": self.mask_expected_density,
            "mask_expected_cost": self.mask_expected_cost,
            "head_gate": self.gate_l1,
            "ffn_gate": self.gate_l1,
            "mask_selector_kl": self.selector_kl,
        }


# The student phase before the search defaults (all weights trained with the candidate logits,
# Adam's usual epsilon, logits at 10x the rate, penalties at full weight from the first update):
# the study configs recorded with it pin these, so that their commands mean what they meant.
TRAIN_BEFORE_SEARCH = {"trainable": ".*", "fast_lr_multiplier": 10.0, "fast_eps": 1e-8}
RAMP_BEFORE_SEARCH = (0.0, 0.0)
# The hardened fine-tune before it had its own rate (the student's, no warm-up): pinned by the
# configs whose figures were recorded with it.
FINETUNE_AT_FULL_RATE = {"finetune_lr": 3e-3, "finetune_warmup": 0}
# The candidate choice before the reviving mixture: the soft union of sparsemax weights,
# hardened by each head's support. Pinned by the configs recorded with it.
STUDENT_BEFORE_REVIVING = {"combine": "soft_union", "weighting": "sparsemax"}
HARDEN_BEFORE_REVIVING = {"threshold": None}
# The text-only trained teacher (learned positions, plain keys, no recall updates) that the
# figures of these configs were recorded with: pinned, so that a teacher default that retrieves
# leaves their commands meaning what they meant.
TEACHER_TEXT_ONLY = {
    "smear_keys": False,
    "smear_width": 1,
    "positions": "learned",
    "recall_steps": 0,
    "recall_long_steps": 0,
}


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Group):
    """The student's distillation updates (the hardened fine-tune: --harden.finetune-lr)."""

    group: ClassVar[str] = "train"

    steps: int = 400
    """Distillation updates of the student."""
    lr: float = 3e-3
    """Peak learning rate of the student."""
    trainable: str = "auto"
    """Regex of the student parameters trained, or 'auto': for --student.kind candidates only
    the candidate logits ('core/logits': the student searches where to attend on the teacher's
    own weights, which the hardened fine-tune then adapts; trained together, the weights absorb
    the masks' differences and the search finds the cheapest masks, not the needed ones) and,
    with --student.select-gate learned and --train.selector-steps 0, the selectors' gates
    ('core/selector_gates'); for the other kinds everything ('.*')."""
    fast_params: str = "core/logits|gate/logits|alpha_logit"
    """Regex of parameters trained at --train.fast-lr-multiplier x the rate (mask weights,
    gates)."""
    fast_lr_multiplier: float = 50.0
    """Learning-rate multiplier of --train.fast-params."""
    fast_eps: float = 1e-4
    """Adam's epsilon for --train.fast-params: above the size of their gradients, so that each
    step follows the gradient's size instead of moving every logit at the full rate (1e-8, the
    usual value, makes the logits random-walk on batch noise)."""
    selector_steps: int = 200
    """With --student.select-gate learned: updates of the selectors' gates alone, before the
    search, on sequences of the serving length (--student.serve-len-factor x --data.seq-len,
    within the teacher's positions; the student's share of passkeys), by --loss.selector-kl;
    the search then trains the candidate logits with the gates held. 0: no such phase, the
    gates train in the search beside the logits, on its sequences."""
    recall_fraction: float | None = None
    """Share of passkey sequences (sparse_jax.data.recall.RecallMixture, --data.seq-len long) in
    the student's and the hardened fine-tune's batches, the rest text of the corpus's train
    split: a head that retrieves then pays its price in the KL. None: the teacher's own
    mixture, --teacher.recall-fraction, for a teacher trained with recall updates (the bundled
    one is; --teacher.recall-steps > 0) when a passkey fits in --data.seq-len, else 0 (the
    corpus's windows only)."""

    def __post_init__(self):
        set_ints_at_least(self, self.group, steps=1, selector_steps=0)
        self.number("lr", positive=True)
        self.number("fast_lr_multiplier", positive=True)
        self.number("fast_eps", positive=True)
        fraction = self.recall_fraction
        if fraction is not None and (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not (0.0 <= fraction <= 1.0)
        ):
            raise ValueError(
                f"{self.flag('recall_fraction')} must be None or in [0, 1]; got {fraction!r}"
            )
        for name in ("trainable", "fast_params"):
            if name == "trainable" and self.trainable == "auto":
                continue
            try:
                re.compile(getattr(self, name))
            except re.error as err:
                raise ValueError(
                    f"{self.flag(name)} {getattr(self, name)!r} is not a regex: {err}"
                ) from None


@dataclasses.dataclass(frozen=True)
class HardenConfig(_Group):
    """harden(): the learned weights become fixed masks, then a short fine-tune."""

    group: ClassVar[str] = "harden"

    budget: float | None = None
    """Mean cost per head the hardened model may have, in --harden.price (None: keep weights >=
    --harden.threshold)."""
    price: Literal["blocks", "density"] = "blocks"
    """What --harden.budget bounds: 'blocks', the kernel's key blocks at the serving length
    relative to causal attention's (as --loss.mask-expected-cost prices them), or 'density',
    the fraction of the score matrix at --data.seq-len (the sigmoid studies)."""
    threshold: float | None = 0.5
    """Candidate weight kept by hardening when --harden.budget is None: the candidates at or
    above it and always the head's strongest (0.5: for a distribution, the strongest alone;
    None: 0.5 for sigmoid and softmax weights, each head's support for sparsemax, entmax15 and
    reviving_sparsemax weights)."""
    finetune_steps: int = 200
    """KL fine-tuning updates of the hardened model (0: none)."""
    finetune_lr: float = 3e-4
    """Peak learning rate of the fine-tune (a tenth of --train.lr: the hardened model starts
    near the teacher, and at the full rate without a warm-up the fine-tune's noise raised the
    KL of students that already matched it)."""
    finetune_warmup: int = 20
    """Updates of linear warm-up to --harden.finetune-lr (then cosine decay)."""

    def __post_init__(self):
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"{self.flag('budget')} must be in (0, 1] or None; got {self.budget}")
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise ValueError(f"{self.flag('threshold')} must be in (0, 1); got {self.threshold}")
        set_ints_at_least(self, self.group, finetune_steps=0, finetune_warmup=0)
        self.number("finetune_lr", positive=True)


@dataclasses.dataclass(frozen=True)
class MeasureConfig(_Group):
    """What is measured for the summary and the report."""

    group: ClassVar[str] = "measure"

    eval_batches: int = 8
    """Evaluation batches (of --data.batch-size windows of the evaluation split)."""
    report_prompts: int = 3
    """Evaluation prompts continued by teacher and hardened student for the report."""
    recall_sequences: int = 24
    """Passkey sequences per length (1x, 2x and 4x --data.seq-len, those within the teacher's
    positions that hold a passkey) in the recall table of teacher, student and hardened student,
    stated at depths 0.1, 0.5 and 0.9 of held-out text; 0: no table. A finished run resumed
    with another value measures the table again (``--resume`` allows it: it trains nothing)."""
    planted_tolerance: float = 0.002
    """--teacher.source planted: a head that picked another candidate than its planted one
    counts as equivalent when that candidate costs no more kernel blocks and swapping it into
    the teacher changes the teacher's output by at most this KL (nats/token)."""

    def __post_init__(self):
        set_ints_at_least(self, self.group, eval_batches=1, report_prompts=0, recall_sequences=0)
        if not (math.isfinite(self.planted_tolerance) and self.planted_tolerance >= 0):
            raise ValueError(
                f"{self.flag('planted_tolerance')} must be a finite KL >= 0; "
                f"got {self.planted_tolerance}"
            )


@dataclasses.dataclass(frozen=True)
class RunConfig(_Group):
    """Where the run lives, how it is checkpointed, its seed and its device mesh."""

    group: ClassVar[str] = "run"

    dir: pathlib.Path | None = None
    """Run folder (config.json, metrics.jsonl, checkpoints/, report.md); default a new
    runs/distill-<date>-<time>, or with --resume the newest runs/distill-* folder."""
    cache_dir: pathlib.Path = pathlib.Path("~/.cache/sparse_jax")
    """Where prepared data and trained teachers are cached."""
    seed: int = 0
    """Seed of initialisation, data order and sampling."""
    checkpoint_every: int = 50
    """Save a checkpoint (and evaluate) every this many updates, and at the end of each phase."""
    data_axis: int | None = None
    """Devices on the mesh's data axis (None: all devices / --run.model-axis)."""
    model_axis: int = 1
    """Devices on the mesh's model axis (tensor-parallel split of the projections)."""
    max_minutes: float | None = None
    """Stop training after this many minutes of the command, with a checkpoint of the step
    reached (as on SIGTERM or Ctrl-C), and exit with status 75: the same command with
    --resume continues (e.g. within a Colab session's or a job's time limit)."""

    def __post_init__(self):
        set_ints_at_least(self, self.group, checkpoint_every=1, model_axis=1)
        check_max_minutes(self.max_minutes, self.flag("max_minutes"))
        if self.data_axis is not None:
            set_ints_at_least(self, self.group, data_axis=1)
        if not is_int(self.seed):
            raise ValueError(f"{self.flag('seed')} must be an int; got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Distil a dense GPT-2 into a sparse student, harden it and report quality, FLOPs, speed."""

    config: ConfigName = "default"
    """Named study config (experiments/distill/configs/<name>.py) whose values are the defaults of
    every other flag; each file opens with its command and the result it should reach."""
    resume: bool = False
    """Continue the run in --run.dir from its last complete checkpoints (with the run's flags)."""
    data: DataConfig = DataConfig()
    teacher: TeacherConfig = TeacherConfig()
    student: StudentConfig = StudentConfig()
    loss: LossConfig = LossConfig()
    train: TrainConfig = TrainConfig()
    harden: HardenConfig = HardenConfig()
    measure: MeasureConfig = MeasureConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        if self.config not in configs.NAMES:
            raise ValueError(f"--config {self.config!r} is unknown; allowed: {configs.NAMES}")
        if self.teacher.source == "bundled":
            self.teacher.check_bundled(self.data.seq_len)
        positions = self.teacher.n_positions()
        if positions is not None and self.data.seq_len > positions:
            raise ValueError(
                f"--data.seq-len {self.data.seq_len} is longer than the teacher's {positions} "
                "positions"
            )
        if self.teacher.source in TeacherConfig.TRAINED and self.teacher.recall_steps:
            lengths = self.teacher_recall_lengths()
            if max(lengths) > positions:
                raise ValueError(
                    f"--teacher.recall-lengths {list(lengths)} reach beyond the teacher's "
                    f"{positions} positions (--teacher.size {self.teacher.size}): name shorter "
                    "ones, or --teacher.recall-steps 0 for a teacher of text alone"
                )
        fraction = self.train.recall_fraction
        # (the shortest passkey is found only for a fraction given: it tokenizes examples)
        if fraction and self.data.seq_len < (
            shortest := shortest_length("passkey", self.data.tokenizer)
        ):
            raise ValueError(
                f"--train.recall-fraction {fraction} mixes passkey sequences of --data.seq-len "
                f"{self.data.seq_len} tokens into the student's batches, but a passkey and its "
                f"question need {shortest} ({self.data.tokenizer!r} tokens): use --data.seq-len "
                f">= {shortest}, or --train.recall-fraction 0"
            )
        if self.student.select_blocks and self.student.kind != "candidates":
            raise ValueError(
                f"--student.select-blocks {self.student.select_blocks} adds a candidate: it "
                f"needs --student.kind candidates; got {self.student.kind!r}"
            )
        if self.student.select_gate == "learned" and not self.student.select_blocks:
            raise ValueError(
                "--student.select-gate learned ranks the blocks of --student.select-blocks: it "
                "needs --student.select-blocks >= 1; got 0"
            )
        if self.student.select_pool != "sum" and self.student.select_gate != "learned":
            raise ValueError(
                f"--student.select-pool {self.student.select_pool} pools the target of learned "
                f"gates: it needs --student.select-gate learned; got "
                f"{self.student.select_gate!r}"
            )
        if self.student.select_blocks and self.teacher.source == "planted":
            raise ValueError(
                "--student.select-blocks adds a data-dependent candidate, which the planted "
                "teacher cannot plant (its heads are static masks); use --student.select-blocks "
                "0 with --teacher.source planted"
            )
        if self.teacher.source == "planted" and (
            self.student.kind != "candidates" or self.student.granularity != "head"
        ):
            raise ValueError(
                "--teacher.source planted plants one candidate mask per head: it needs "
                "--student.kind candidates and --student.granularity head; got "
                f"{self.student.kind!r} and {self.student.granularity!r}"
            )

    def student_recall_fraction(self) -> float:
        """The share of passkey sequences in the student's batches: --train.recall-fraction, or
        for None the teacher's own mixture (--teacher.recall-fraction) when the teacher was
        trained with recall updates here or bundled so, and a passkey fits in --data.seq-len;
        else 0."""
        if self.train.recall_fraction is not None:
            return float(self.train.recall_fraction)
        t = self.teacher
        trained_to_retrieve = (t.source == "bundled" or t.source in t.TRAINED) and t.recall_steps
        if not trained_to_retrieve:
            return 0.0
        fits = self.data.seq_len >= shortest_length("passkey", self.data.tokenizer)
        return float(t.recall_fraction) if fits else 0.0

    def teacher_recall_lengths(self) -> tuple[int, ...]:
        """The lengths of the teacher's recall updates: --teacher.recall-lengths, or those of
        1x, 2x and 4x --data.seq-len that fit the teacher's positions."""
        if self.teacher.recall_lengths:
            return self.teacher.recall_lengths
        n, positions = self.data.seq_len, self.teacher.n_positions()
        return tuple(m for m in (n, 2 * n, 4 * n) if positions is None or m <= positions)

    def flags(self) -> dict[str, Any]:
        """Every field by its dotted flag name (``"train.steps"``), as JSON values."""
        out = {}
        for key, value in dataclasses.asdict(self).items():
            if isinstance(value, dict):
                out |= {f"{key}.{name}": v for name, v in value.items()}
            else:
                out[key] = value
        return json.loads(json.dumps(out, default=str))


# The flat flags of distill before its configuration was grouped -> the grouped field, so that
# --resume still reads a run folder written then (and as a table of old -> new flags).
OLD_FLAGS = {
    "teacher": "teacher.source",
    "teacher_size": "teacher.size",
    "teacher_steps": "teacher.steps",
    "teacher_lr": "teacher.lr",
    "data": "data.source",
    "tokenizer": "data.tokenizer",
    "seq_len": "data.seq_len",
    "batch_size": "data.batch_size",
    "student": "student.kind",
    "normalizer": "student.normalizer",
    "combine": "student.combine",
    "anchor_self": "student.anchor_self",
    "granularity": "student.granularity",
    "weighting": "student.weighting",
    "serve_len_factor": "student.serve_len_factor",
    "windows": "student.windows",
    "fixed_window": "student.fixed_window",
    "block_size": "student.block_size",
    "gate": "student.gate",
    "temperature": "loss.temperature",
    "direction": "loss.direction",
    "mask_l1": "loss.mask_l1",
    "mask_density": "loss.mask_density",
    "mask_expected_density": "loss.mask_expected_density",
    "mask_expected_cost": "loss.mask_expected_cost",
    "gate_l1": "loss.gate_l1",
    "penalty_ramp": "loss.penalty_ramp",
    "steps": "train.steps",
    "learning_rate": "train.lr",
    "trainable": "train.trainable",
    "fast_params": "train.fast_params",
    "fast_lr_multiplier": "train.fast_lr_multiplier",
    "fast_eps": "train.fast_eps",
    "budget": "harden.budget",
    "price": "harden.price",
    "threshold": "harden.threshold",
    "finetune_steps": "harden.finetune_steps",
    "finetune_lr": "harden.finetune_lr",
    "finetune_warmup": "harden.finetune_warmup",
    "eval_batches": "measure.eval_batches",
    "planted_tolerance": "measure.planted_tolerance",
    "report_prompts": "measure.report_prompts",
    "run_dir": "run.dir",
    "cache_dir": "run.cache_dir",
    "seed": "run.seed",
    "checkpoint_every": "run.checkpoint_every",
    "data_axis": "run.data_axis",
    "model_axis": "run.model_axis",
    "max_minutes": "run.max_minutes",
    "resume": "resume",
}
