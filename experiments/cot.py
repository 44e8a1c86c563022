"""python -m experiments.cot — chain-of-thought linear algebra: a sparse encoder–decoder against
its dense baseline of the same size, data, steps and seed (issue 16, the GiantRabbit study).

    python -m experiments.cot                        # train both, then evaluate: 8-25 min, 2 cores
    python -m experiments.cot --preset study         # all six kinds, bigger (a GPU): `study()`
    python -m experiments.cot train --run.dir R      # train only (--run.resume continues R)
    python -m experiments.cot eval --run.dir R       # evaluate R's models on its test split
    python -m experiments.cot ask "What is rref(A) for A = [[2, 4], [1, 3]]?" --run.dir R
    python -m experiments.cot seeds --seeds 0 1 2    # each model at each seed: the spread
    python -m experiments.cot roles --run.dir R      # teacher-forced accuracy per number

The task is :mod:`sparse_jax.data.linalg_cot` (the question as tokens into the encoder, the worked
solution and its ``Answer:`` line out of the decoder; :mod:`sparse_jax.cot`). ``train`` trains
the sparse model (:class:`~sparse_jax.models.encdec.EncDecConfig`'s sparse switches: sparsemax
attention, its scores scaled by a learned factor per head that starts at 0.125, sparsemax
outputs, sparse embeddings, chain-of-thought feature masks, a decoder window of the 64 most
recent tokens and 4 sinks) and then its dense baseline (``config.dense()``) with
the project's trainer, each phase checkpointed under ``<run>/checkpoints/<model>``; both models
embed where each token sits in a matrix or vector (``--model.literals``), take positions as
rotations in their self-attentions (``--model.positions rotary``) and form their decoder's
cross-attention queries from what its self-attention found (``--model.cross-queries self``).
``eval`` decodes the test split greedily with each trained model (restored by
``sparse_jax.cot.Solver.load``) and reports, per question kind, exact match of the final
answer beside what answering the most frequent training answer scores, whether the chain of
thought is the reference's (all of it, its first step, the share of its steps), its length in
steps and tokens, decoding time per question, attention density and FLOPs. ``ask`` answers
one question with the trained models. ``seeds`` trains and evaluates the chosen models at
several seeds (the same data) and prints each one's exact match beside their mean and range: at
the default's size one kind moves by up to 24 points between seeds (docs/results.md), so a
difference between two single runs says little.

The default fits a 2-core CPU: three of the six kinds (rref, solvability, column space) at small
sizes (matrices up to 2 x 3, entries up to 3, solvability's m and n up to 9), whose solutions are
at most ~270 bytes, and a small model; ``--data.kinds`` with all six trains the other three at the
same sizes. The run folder holds ``config.json``, ``cot.json`` (what ``Solver.load`` reads),
``metrics.jsonl``, ``checkpoints/``, ``answers-<model>.jsonl``, ``summary.json``, ``report.md``
and its plots.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import pathlib
import re
import sys
import time
from typing import Annotated, Any, Literal, Union

import jax
import numpy as np
import tyro
from flax import nnx

from experiments import stats
from experiments.distill_run import write_text_atomically
from experiments.flags import (
    check_max_minutes,
    check_resume,
    flag_name,
    int_at_least,
    set_ints_at_least,
)
from experiments.phase import RunStopped, main_of, stop_request, train_phase
from sparse_jax import cot
from sparse_jax.data import linalg_cot
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder, describe
from sparse_jax.training.loop import TrainConfig
from sparse_jax.training.stopping import StopRequest

MODELS = ("sparse", "dense")
# The flags newer than a resumed run's config.json take these values (how its code ran).
BEFORE_NEWER_FLAGS = {
    "train": {"buckets": [1, 1]},
    "data": {"arithmetic": False, "products": False},
    "model": {"numbers": 0},
}
# Problem sizes (--data.sizes): linalg_cot.GeneratorConfig fields besides the kinds.
SIZES: dict[str, dict[str, Any]] = {
    # 2 x 2 and 2 x 3 matrices, entries in [-3, 3], no fractions in questions, at most 6 steps:
    # solutions of at most ~310 bytes (rref <= 214, column space <= 258, solvability <= 263).
    "small": dict(
        rref_shape=(2, 3),
        nullspace_shape=(2, 3),
        column_space_shape=(2, 2),
        elimination_shape=(2, 3),
        elimination_ops=2,
        unknowns=2,
        complete_solution_rows=2,
        # m, n up to 9 (as GeneratorConfig's): 855 distinct questions; the evaluation splits take
        # 66 and 1,000 training problems hold 504 others (up to 4: 90 in all, 24 to train on).
        solvability_dim=9,
        block_rate=0.0,
        fraction_rate=0.0,
        max_entry=3,
        max_number=9,
        max_steps=6,
    ),
    # GeneratorConfig's defaults (matrices up to 4 x 5, entries up to 9, <= 16 steps).
    "default": {},
}


@dataclasses.dataclass(frozen=True)
class Data:
    kinds: tuple[str, ...] = ("rref", "solvability", "column_space")
    """Question kinds trained and evaluated (of complete_solution, elimination, nullspace, rref,
    solvability, column_space); the splits hold them in turn."""
    sizes: Literal["small", "default"] = "small"
    """Problem sizes: 'small' (2 x 3 matrices, entries up to 3, short solutions) or 'default'
    (linalg_cot.GeneratorConfig's: up to 4 x 5, entries up to 9, up to 16 steps)."""
    train: int = 3000
    """Training problems."""
    validation: int = 48
    """Validation problems (their loss is logged at each checkpoint)."""
    test: int = 150
    """Test problems (the evaluation)."""
    seed: int = 0
    """Seed of the generated splits."""
    arithmetic: bool = False
    """Row scalings and combinations compute the entries of the row they change in the chain,
    one by one, before the matrix after them (linalg_cot.GeneratorConfig.arithmetic)."""
    products: bool = False
    """With --data.arithmetic: each row combination's term writes its product before its sum,
    a-k*b=a-p=c (linalg_cot.GeneratorConfig.products)."""

    def __post_init__(self):
        if self.products and not self.arithmetic:
            raise ValueError(
                "--data.products writes the products of the row arithmetic: it needs "
                "--data.arithmetic"
            )
        kinds = self.kinds
        if not kinds or len(set(kinds)) != len(kinds) or set(kinds) - set(linalg_cot.KINDS):
            raise ValueError(
                f"--data.kinds must be distinct kinds of {list(linalg_cot.KINDS)}; got "
                f"{list(kinds)}"
            )
        set_ints_at_least(self, "data", train=1, validation=1, test=1, seed=0)

    def generator(self) -> linalg_cot.GeneratorConfig:
        return linalg_cot.GeneratorConfig(
            kinds=tuple(self.kinds),
            arithmetic=self.arithmetic,
            products=self.products,
            **SIZES[self.sizes],
        )


@dataclasses.dataclass(frozen=True)
class Model:
    d_model: int = 64
    """Width D of every layer (both models)."""
    num_heads: int = 4
    """Attention heads (must divide --model.d-model)."""
    d_ff: int = 256
    """FFN inner width."""
    encoder_layers: int = 1
    """Encoder layers."""
    decoder_layers: int = 1
    """Decoder layers."""
    cot_steps: int = 1
    """Chain-of-thought steps T_c of the reasoning module (both models: they are layers)."""
    normalizer: Literal["softmax", "sparsemax", "entmax15"] = "sparsemax"
    """The sparse model's attention normalizer (the dense one's: softmax)."""
    logit_scale: float | None = 0.125
    """The sparse model's attention: a learned per-head factor on QKᵀ/√d, starting at this value
    (None: none; docs/results.md compares starts)."""
    learn_alpha: bool = False
    """The sparse model's attention: α-entmax with one α learned per head, starting at
    --model.normalizer's (sparsemax 2, entmax15 1.5; EncDecConfig.learn_alpha)."""
    output: Literal["softmax", "sparsemax"] = "sparsemax"
    """The sparse model's output distribution and loss (the dense one's: softmax)."""
    embed_keep: float = EncDecConfig.embed_keep
    """SparseEmbed: kept fraction of embedding dimensions, (0, 1]."""
    embed_mask: Literal["random", "magnitude"] = "magnitude"
    """SparseEmbed: which dimensions it keeps, each token's largest by magnitude (the default:
    over seeds 0-2 the sparse model then reads the question as a fixed random set does not,
    first steps right 16.2% against 9.8%, at the same exact match; docs/results.md) or a fixed
    random set (``random``: the embedding table shrinks; EncDecConfig's default)."""
    cot_keep: float = EncDecConfig.cot_keep
    """Kept fraction of features at each chain-of-thought step, (0, 1]."""
    decoder_keep: float = EncDecConfig.decoder_keep
    """Kept fraction of each decoder FFN output, (0, 1]."""
    encoder_window: int | None = None
    """Encoder keys within this distance either side (None: all)."""
    decoder_window: int | None = 64
    """The sparse model's decoder self-attention: recent keys kept (None: causal; then also
    --model.decoder-sinks 0). Its decoding cache holds only these and the sinks."""
    decoder_sinks: int = 4
    """With --model.decoder-window: the first tokens every query also sees."""
    decoder_block: int = 16
    """With --model.decoder-window: the block size of the decoder self-attention's mask, with
    which `impl="auto"` chooses the block-sparse kernel or the dense one (docs/results.md)."""
    cross_queries: Literal["input", "self"] = "self"
    """Both models' decoder cross-attention queries: what the self-attention found ('self', the
    default: EncDecConfig.cross_queries) or the layer's input, in parallel with its
    self-attention ('input', the study's form). With rotary positions over seeds 0-2, 'self'
    read the question right in the first step for 73.8% against 65.8% (sparse) and 83.3%
    against 74.9% (dense), at the same exact match: docs/results.md."""
    positions: Literal["sinusoid", "rotary"] = "rotary"
    """Both models' positions: rotary (RoPE) in every self-attention (the default: over seeds
    0-2 it took the chains of thought right from 4.9% to 22.9-25.8% (sparse) and 7.3% to
    24.7-29.1% (dense); docs/results.md) or sinusoids added to the embeddings
    (EncDecConfig.positions)."""
    literals: bool = True
    """Both models: learned embeddings of where each token sits in a matrix or vector
    literal (depth, row, column: EncDecConfig.literal_tokens), in the question and the
    solution (--model.no-literals: none; docs/results.md compares)."""
    numbers: int = 0
    """Both models: each integer n with |n| < this many one token, its minus sign included
    unless the minus subtracts (sparse_jax.cot.CotFormat.numbers); 0: every byte a token."""

    def __post_init__(self):
        try:
            self.config(0)
        except (ValueError, TypeError) as err:
            names = {f.name for f in dataclasses.fields(self)}
            bad = next((n for n in re.findall(r"`(\w+)`", str(err)) if n in names), "d_model")
            raise ValueError(f"{flag_name(f'model.{bad}')}: {err}") from err

    def config(self, seed: int) -> EncDecConfig:
        """The sparse model's config (its baseline: ``.dense()``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        literal_tokens = cot.LITERAL_TOKENS if fields.pop("literals") else None
        vocab_size = cot.CotFormat(numbers=fields.pop("numbers")).vocab_size
        return EncDecConfig(
            vocab_size=vocab_size, seed=seed, literal_tokens=literal_tokens, **fields
        )


@dataclasses.dataclass(frozen=True)
class Train:
    steps: int = 3600
    """Updates of each model (docs/results.md compares the default's 3,600 with 2,400 over
    seeds 0-2, and times the default on 2-core CPUs of different speeds)."""
    batch_size: int = 12
    """Problems per update (the default's 12 is sized to the issue's time budget on a 2-core
    CPU: docs/results.md)."""
    lr: float = 3e-3
    """Peak learning rate (linear warm-up, cosine decay to 10%)."""
    warmup: int = 50
    """Warm-up updates."""
    buckets: tuple[int, int] = (2, 3)
    """Length buckets: the training problems' question lengths cut at this many quantiles and
    their solution lengths at that many, each batch drawn from one cell of that grid (cells of
    under 5% of the problems merged into larger ones) and padded only to its longest
    (sparse_jax.cot.length_buckets; each cell compiles once). ``1 1``: every batch padded to
    the longest problem of all. docs/results.md compares them."""

    def __post_init__(self):
        set_ints_at_least(self, "train", steps=1, batch_size=1, warmup=0)
        buckets = self.buckets
        if (
            not isinstance(buckets, tuple)
            or len(buckets) != 2
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in buckets)
        ):
            raise ValueError(
                f"--train.buckets must be two ints >= 1 (question cuts, solution cuts); got "
                f"{buckets!r}"
            )
        if isinstance(self.lr, bool) or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--train.lr must be a number > 0; got {self.lr!r}")

    def config(self, seed: int) -> TrainConfig:
        return TrainConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            learning_rate=self.lr,
            warmup_steps=min(self.warmup, self.steps // 2),
            seed=seed,
        )


@dataclasses.dataclass(frozen=True)
class Run:
    dir: pathlib.Path | None = None
    """Run folder (default: runs/cot-<date>-<time>)."""
    resume: bool = False
    """Continue the run in --run.dir from its last checkpoints."""
    seed: int = 0
    """Seed of both models' initial weights and of the batches."""
    checkpoint_every: int = 300
    """Updates between checkpoints (and validation losses)."""
    cache_dir: pathlib.Path = pathlib.Path("~/.cache/sparse_jax")
    """Where the generated splits are written once (TFDS array_record files)."""
    max_minutes: float | None = None
    """Stop training after this many minutes of the command, with a checkpoint of the step
    reached (as on SIGTERM or Ctrl-C), and exit with status 75: the same command with
    --run.resume continues (e.g. within a session's time limit)."""

    def __post_init__(self):
        set_ints_at_least(self, "run", seed=0, checkpoint_every=1)
        if self.resume and self.dir is None:
            raise ValueError("--run.resume needs the --run.dir of the run to continue")
        check_max_minutes(self.max_minutes)


@dataclasses.dataclass(frozen=True)
class Eval:
    batch_size: int = 50
    """Test questions decoded together (one kind per batch)."""
    chunk: int = 32
    """Decoded positions per compiled call (decoding stops after the chunk where all ended)."""
    repeats: int = 3
    """Decodings of each batch; its time is their median."""

    def __post_init__(self):
        set_ints_at_least(self, "eval", batch_size=1, chunk=1, repeats=1)


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """Train the sparse model and its dense baseline (same size, data, steps and seed)."""

    preset: Literal["default", "study"] = "default"
    """Named settings the other flags start from ('study': all six kinds, bigger; see
    experiments.cot.study)."""
    data: Data = Data()
    model: Model = Model()
    train: Train = Train()
    run: Run = Run()

    def __post_init__(self):
        if self.train.batch_size > self.data.train:
            raise ValueError(
                f"--train.batch-size {self.train.batch_size} is more than the --data.train "
                f"{self.data.train} problems"
            )
        if (
            self.run.dir is not None
            and not self.run.resume
            and (pathlib.Path(self.run.dir) / cot.RECORD).exists()
        ):
            raise ValueError(
                f"--run.dir {str(self.run.dir)!r} already holds a run; continue it with "
                "--run.resume or pass another --run.dir"
            )


@dataclasses.dataclass(frozen=True)
class AllCommand(TrainCommand):
    """Train both models, then evaluate them on the test split (the default)."""

    eval: Eval = Eval()


@dataclasses.dataclass(frozen=True)
class SeedsCommand(TrainCommand):
    """Train and evaluate the chosen models at several seeds (initial weights and batches; the
    data stay the same): each seed's run in <run.dir>/seed-<s>, the table in <run.dir>/seeds.md."""

    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds, each one run's --run.seed."""
    models: tuple[Literal["sparse", "dense"], ...] = MODELS
    """The models trained and evaluated at each seed."""
    eval: Eval = Eval()

    def __post_init__(self):
        super().__post_init__()
        seeds = self.seeds
        if (
            not seeds
            or len(set(seeds)) != len(seeds)
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)
        ):
            raise ValueError(f"--seeds must be distinct ints >= 0; got {list(seeds)}")
        if not self.models or len(set(self.models)) != len(self.models):
            raise ValueError(f"--models must be distinct models of {list(MODELS)}")
        if self.run.seed != 0:
            raise ValueError(
                f"--run.seed {self.run.seed}: the seeds command takes its seeds from --seeds"
            )
        if self.run.dir is not None and not self.run.resume:
            held = sorted(p.name for p in pathlib.Path(self.run.dir).glob("seed-*"))
            if held:
                raise ValueError(
                    f"--run.dir {str(self.run.dir)!r} already holds runs ({', '.join(held)}); "
                    "continue them with --run.resume or pass another --run.dir"
                )


@dataclasses.dataclass(frozen=True)
class RunDir:
    dir: pathlib.Path | None = None
    """The run folder (required)."""
    cache_dir: pathlib.Path = pathlib.Path("~/.cache/sparse_jax")
    """Where the generated splits are cached."""


def _check_run_dir(run: RunDir) -> None:
    if run.dir is None:
        raise ValueError("--run.dir is required: the run folder to read")
    if not (pathlib.Path(run.dir) / cot.RECORD).is_file():
        raise ValueError(
            f"--run.dir {str(run.dir)!r} is not a chain-of-thought run folder (no {cot.RECORD})"
        )


@dataclasses.dataclass(frozen=True)
class EvalCommand:
    """Evaluate the trained models of a run folder on its test split (rewrites the report)."""

    run: RunDir = RunDir()
    eval: Eval = Eval()

    def __post_init__(self):
        _check_run_dir(self.run)


@dataclasses.dataclass(frozen=True)
class AskCommand:
    """Answer one question with the trained models of a run folder."""

    question: tyro.conf.Positional[str]
    """The question, e.g. "Find the reduced row echelon form R of A = [[2, 4], [1, 3]]."."""
    run: RunDir = RunDir()
    model: Literal["both", "sparse", "dense"] = "both"
    """Which trained model answers."""

    def __post_init__(self):
        _check_run_dir(self.run)


@dataclasses.dataclass(frozen=True)
class RolesCommand:
    """Teacher-forced accuracy of the trained models of a run folder on its test split by
    role, each number counted once whatever the models' tokens (runs with and without
    --model.numbers compare alike), the terms' results split by sign."""

    run: RunDir = RunDir()
    numbers: int = 100
    """The units counted: each integer |n| < this many once, other bytes one by one
    (sparse_jax.cot.CotFormat.numbers; 0: every byte)."""

    def __post_init__(self):
        _check_run_dir(self.run)
        object.__setattr__(self, "numbers", int_at_least(self.numbers, "--numbers", 0))


def study() -> AllCommand:
    """``python -m experiments.cot --preset study``: all six kinds at linalg_cot's default sizes
    (matrices up to 4 x 5, solutions up to ~1,100 bytes), 100,000 training problems, a model of
    width 256 with 3 + 3 layers and 2 chain-of-thought steps (the default's rotary positions
    and cross-attention queries from the self-attention), 20,000 updates of 64 problems
    each, for each model: hours per model on one H200 (its update time is in docs/results.md),
    days on a 2-core CPU. The problems are many so that each is seen ~13 times: at the
    default's size the dense model overfit 3,000 problems seen ~38 times, and ten times the
    problems gave both models more after 9,600 updates (docs/results.md).

    It should reach the issue's claim: at least 90% exact match on every kind, the sparse model
    within 2 points of the dense one on each, and a lower decoding time per question. It has
    not been run yet: no figure of it is recorded, and whether these sizes reach the claim is
    untested."""
    return AllCommand(
        preset="study",
        data=Data(kinds=linalg_cot.KINDS, sizes="default", train=100_000, validation=600, test=600),
        # A window of 256 keeps a step line and the one before it (up to 261 tokens at these
        # sizes). Unmeasured; at the default's small sizes 64 measured better than 128 and than
        # causal (docs/results.md). The sparse model's logit scale starts at the default's 0.125,
        # also measured at the default's sizes only. Blocks of 64 (the default's 16 suit the
        # CPU's block-sparse kernel at its window of 64): on a GPU the window goes to the fused
        # Triton kernels, which run on tiles of at most the blocks, and tiles of 64 measured the
        # fastest there, 32 up to 2.4x slower (docs/benchmarks.md, third GPU pass).
        model=Model(
            d_model=256,
            num_heads=8,
            d_ff=1024,
            encoder_layers=3,
            decoder_layers=3,
            cot_steps=2,
            decoder_window=256,
            decoder_block=64,
        ),
        train=Train(steps=20_000, batch_size=64, lr=1e-3, warmup=500),
        run=Run(checkpoint_every=1000),
        eval=Eval(batch_size=100),
    )


PRESETS = {"default": AllCommand, "study": study}


def _preset(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--preset="):
            return arg.split("=", 1)[1]
    return "default"


Command = Union[  # noqa: UP007
    AllCommand, TrainCommand, EvalCommand, AskCommand, SeedsCommand, RolesCommand
]


def parse(argv: list[str] | None = None) -> Command:
    """The command of a command line (``--help`` lists the subcommands, ``<cmd> --help`` their
    flags); no subcommand is ``all`` (train, then evaluate). A bad flag exits with a message
    naming it, before anything is prepared or trained."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["all", *argv]
    base = PRESETS.get(_preset(argv), AllCommand)()  # an unknown preset: tyro says why
    fields = dataclasses.fields(TrainCommand)
    train_base = TrainCommand(**{f.name: getattr(base, f.name) for f in fields})
    seeds_base = SeedsCommand(**{f.name: getattr(base, f.name) for f in fields}, eval=base.eval)
    spec = Union[  # noqa: UP007
        Annotated[AllCommand, tyro.conf.subcommand("all", default=base)],
        Annotated[TrainCommand, tyro.conf.subcommand("train", default=train_base)],
        Annotated[EvalCommand, tyro.conf.subcommand("eval")],
        Annotated[AskCommand, tyro.conf.subcommand("ask")],
        Annotated[SeedsCommand, tyro.conf.subcommand("seeds", default=seeds_base)],
        Annotated[RolesCommand, tyro.conf.subcommand("roles")],
    ]
    return tyro.cli(spec, args=argv, description=__doc__.split("\n\n")[0])


def log(msg: str) -> None:
    print(f"[cot] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Data.


def _data(data: Data, cache_dir: pathlib.Path):
    cache = pathlib.Path(cache_dir).expanduser()
    return linalg_cot.prepare(
        cache / "tfds",
        train=data.train,
        validation=data.validation,
        test=data.test,
        seed=data.seed,
        config=data.generator(),
    )


def _lengths(splits, fmt: cot.CotFormat) -> dict[str, dict[str, float]]:
    """Per kind over every split: the longest question and solution (tokens of ``fmt``, the
    solution's with EOS), and the mean solution length in tokens and steps."""
    out: dict[str, dict[str, list]] = {}
    for split in splits:
        for p in split:
            row = out.setdefault(p.kind, {"q": [], "t": [], "s": []})
            row["q"].append(cot.encode_question(p.question, fmt).size)
            row["t"].append(cot.encode_solution(p.solution_text(), fmt).size)
            row["s"].append(len(p.steps) + 1)
    return {
        k: {
            "question_tokens_max": max(v["q"]),
            "solution_tokens_max": max(v["t"]),
            "solution_tokens_mean": float(np.mean(v["t"])),
            "steps_mean": float(np.mean(v["s"])),
        }
        for k, v in out.items()
    }


# ---------------------------------------------------------------------------------------------
# Training.


def _configs(cfg: TrainCommand) -> dict[str, tuple[EncDecConfig, TrainConfig]]:
    sparse = cfg.model.config(cfg.run.seed)
    tc = cfg.train.config(cfg.run.seed)
    return {"sparse": (sparse, tc), "dense": (sparse.dense(), tc)}


def _phase(
    cfg: TrainCommand, folder: pathlib.Path, name: str, configs, source_len, rows, val_rows, stop
):
    """Trains (or resumes) one model (:func:`experiments.phase.train_phase`) on the buckets of
    ``rows`` (``source_len``: :func:`sparse_jax.cot.source_lengths`); its seconds."""
    model_config, tc = configs[name]
    model = EncoderDecoder(model_config, rngs=nnx.Rngs(cfg.run.seed))
    loss = functools.partial(cot.loss_fn, source_len=source_len)
    graphdef = nnx.graphdef(model)
    val_loss = jax.jit(lambda state, r: loss(nnx.merge(graphdef, state), r)[0])

    def evaluate(m):
        return {"loss": float(val_loss(nnx.state(m), val_rows))}

    _, seconds = train_phase(
        model, loss, tc, rows, folder=folder, name=name,
        checkpoint_every=cfg.run.checkpoint_every, resume=cfg.run.resume, log=log,
        evaluate=evaluate, stop=stop,
    )  # fmt: skip
    return seconds


def train(
    cfg: TrainCommand, models: tuple[str, ...] = MODELS, stop: StopRequest | None = None
) -> pathlib.Path:
    """Trains ``models`` (both by default) into the run folder; returns it. ``stop`` ends the
    training early with checkpoints (:class:`experiments.phase.RunStopped`)."""
    started = time.perf_counter()
    folder = pathlib.Path(cfg.run.dir or pathlib.Path("runs") / time.strftime("cot-%Y%m%d-%H%M%S"))
    data = _data(cfg.data, cfg.run.cache_dir)
    splits = (data.train, data.validation, data.test)
    problems = [list(s) for s in splits]
    fmt = cot.fit_format([p for split in problems for p in split], numbers=cfg.model.numbers)
    configs = _configs(cfg)
    if cfg.run.resume:
        cot.read_record(folder)  # a chain-of-thought run folder, else an error that says so
        # The flags that decide the format, the models and their updates must match
        # (flags.CHECKPOINT_FLAGS); the evaluation's may change.
        # (A run older than a flag ran it as BEFORE_NEWER_FLAGS says.)
        check_resume(cfg, folder, kind="chain-of-thought", defaults=BEFORE_NEWER_FLAGS)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        folder / "config.json", json.dumps(dataclasses.asdict(cfg), default=str, indent=2) + "\n"
    )
    cot.write_record(folder, fmt, configs, kinds=cfg.data.kinds)
    # A cell of under 5% of the problems saves less time than its compilation costs.
    buckets = cot.length_buckets(
        problems[0], fmt, source_cuts=cfg.train.buckets[0], target_cuts=cfg.train.buckets[1],
        min_size=max(cfg.train.batch_size, len(problems[0]) // 20),
    )  # fmt: skip
    if len(buckets) == 1:  # one format: the rows and batches (BatchIterator) of runs before
        buckets = [(fmt, list(range(len(problems[0]))))]
        rows = cot.pack(problems[0], fmt)
    else:
        rows = [cot.pack([problems[0][i] for i in idx], f) for f, idx in buckets]
    val_rows = cot.pack(problems[1], fmt)
    source_len = cot.source_lengths([fmt] + [f for f, _ in buckets])
    seconds = {"data": time.perf_counter() - started}
    shapes = ", ".join(f"{len(idx)} x ({f.source_len}, {f.target_len})" for f, idx in buckets)
    log(
        f"{len(problems[0])} training problems of {', '.join(cfg.data.kinds)}; questions up to "
        f"{fmt.source_len} tokens, solutions up to {fmt.target_len} tokens; batches from "
        f"buckets of (question, solution) lengths {shapes}; run folder {folder}"
    )
    for name in models:
        seconds[f"train_{name}"] = _phase(
            cfg, folder, name, configs, source_len, rows, val_rows, stop
        )
    training = {"phase_seconds": seconds, "dataset": data.dataset_name}
    write_text_atomically(folder / "training.json", json.dumps(training, indent=2) + "\n")
    return folder


# ---------------------------------------------------------------------------------------------
# Evaluation and the report.


def _read_config(folder: pathlib.Path) -> Data:
    record = json.loads((folder / "config.json").read_text())
    d = record["data"]
    return Data(**{**d, "kinds": tuple(d["kinds"])})


def evaluate_run(folder: pathlib.Path, ev: Eval, cache_dir: pathlib.Path, started: float) -> dict:
    """Evaluates both trained models of ``folder`` on its test split; writes
    ``answers-<model>.jsonl``, ``summary.json``, ``report.md`` and the plots."""
    lap = time.perf_counter()
    data_cfg = _read_config(folder)
    data = _data(data_cfg, cache_dir)
    train, test = list(data.train), list(data.test)  # read once: three summaries below
    training_file = folder / "training.json"  # written when both models have trained
    training = json.loads(training_file.read_text()) if training_file.exists() else {}
    seconds = dict(training.get("phase_seconds", {}))
    results, models, correct = {}, {}, {}
    record = cot.read_record(folder)
    for name in MODELS:
        solver, result, records = _decode_test(folder, name, test, ev)
        results[name] = result
        correct[name] = [(r["kind"], r["correct"]) for r in records]
        config = solver.model.config
        models[name] = {
            "switches": describe(config),
            "config": dataclasses.asdict(config),
            "parameters": int(
                sum(x.size for x in jax.tree.leaves(nnx.state(solver.model, nnx.Param)))
            ),
            "trained_steps": solver.step,
            "final_loss": _final_loss(folder, name),
            "learned_alphas": solver.model.learned_alphas(),
        }
        seconds[f"eval_{name}"] = time.perf_counter() - lap
        lap = time.perf_counter()
    comparison = _comparison(results, correct)
    summary = {
        "kinds": list(data_cfg.kinds),
        "most_frequent_answer": cot.most_frequent_answers(train, test),
        "distinct_training_questions": linalg_cot.distinct_questions(train),
        "format": record["format"],
        "lengths": _lengths((train, data.validation, test), cot.CotFormat(**record["format"])),
        "data": {
            **dataclasses.asdict(data_cfg),
            "generator": dataclasses.asdict(data_cfg.generator()),
            "dataset": data.dataset_name,
        },
        "models": models,
        "evaluation": results,
        "comparison": comparison,
        "phase_seconds": seconds,
        "eval_repeats": ev.repeats,
        "wall_time_s": time.perf_counter() - started,
        "device": f"{jax.default_backend()} x{jax.device_count()}",
    }
    write_text_atomically(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    _report(folder, summary)
    log(f"report: {folder / 'report.md'}")
    return summary


def _decode_test(
    folder: pathlib.Path, name: str, test: list, ev: Eval
) -> tuple[cot.Solver, dict, list[dict]]:
    """Decodes ``test`` with the trained model ``name`` of ``folder`` (``cot.evaluate``) and
    writes its ``answers-<name>.jsonl``; the solver, the result without its records, and the
    records (one per test question, in order)."""
    solver = cot.Solver.load(folder, name, batch_size=ev.batch_size, chunk=ev.chunk)
    log(f"{folder.name}, {name}: decoding {len(test)} test questions")
    result = cot.evaluate(solver, test, repeats=ev.repeats)
    records = result.pop("records")
    lines = "".join(json.dumps(r) + "\n" for r in records)
    write_text_atomically(folder / f"answers-{name}.jsonl", lines)
    return solver, result, records


def _comparison(results: dict, correct: dict[str, list[tuple[str, bool]]]) -> dict:
    """Per kind and ``overall``: sparse minus dense exact match in points, paired on the same
    questions (:func:`experiments.stats.paired`: its 95% interval in points, the questions only
    one model answered right, McNemar's p), each model's exact match with its 95% Wilson
    interval, and the ratio of their decoding times per question."""
    out = {}
    for kind in [*results["sparse"]["kinds"], "overall"]:
        right = {name: [ok for k, ok in correct[name] if kind in (k, "overall")] for name in MODELS}
        pair = stats.paired(right["sparse"], right["dense"])
        s, d = (_figures(results[name], kind) for name in MODELS)
        out[kind] = {
            "exact_match_points": 100 * (s["exact_match"] - d["exact_match"]),
            "exact_match_points_ci95": [100 * x for x in pair["ci95"]],
            "only_sparse_right": pair["a_only"],
            "only_dense_right": pair["b_only"],
            "mcnemar_p": pair["p_value"],
            "exact_match_ci95": {
                name: list(stats.proportion(sum(right[name]), len(right[name]))["ci95"])
                for name in MODELS
            },
            "seconds_ratio": s["seconds_per_question"] / d["seconds_per_question"],
        }
    return out


def _final_loss(folder: pathlib.Path, name: str) -> float | None:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("phase") == name and "loss" in r]
    return rows[-1]["loss"] if rows else None


_COMPARISON_TEXT = (
    "Sparse against dense on the same test questions (experiments.stats). Exact match with its "
    "95% interval (Wilson); sparse minus dense in points with its 95% interval (Newcombe's "
    "interval for paired proportions); the questions that only one of the two answers right, "
    "each way, and McNemar's exact p-value on them: how often a fair coin would split them at "
    "least this unevenly (small when one model is really the better); the ratio of decoding "
    "times per question."
)


def _comparison_lines(cmp: dict) -> list[str]:
    """The report's paragraph and table comparing the two models (see :func:`_comparison`)."""
    lines = [
        _COMPARISON_TEXT,
        "",
        "| kind | exact match sparse, 95% interval | dense | sparse − dense, points (95%) | "
        "right only sparse / only dense | McNemar p | decode time sparse / dense |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]

    def interval(ci: list[float]) -> str:
        return f"{100 * ci[0]:.1f}–{100 * ci[1]:.1f}"

    for k, v in cmp.items():
        lo, hi = v["exact_match_points_ci95"]
        sparse_ci, dense_ci = v["exact_match_ci95"]["sparse"], v["exact_match_ci95"]["dense"]
        lines.append(
            f"| {k} | {interval(sparse_ci)} | {interval(dense_ci)} | "
            f"{v['exact_match_points']:+.1f} ({lo:+.1f} to {hi:+.1f}) | "
            f"{v['only_sparse_right']} / {v['only_dense_right']} | {v['mcnemar_p']:.3f} | "
            f"{v['seconds_ratio']:.2f}x |"
        )
    return lines


def _alpha_lines(alphas: dict[str, list[float]] | None) -> list[str]:
    """The report's line on the sparse model's learned α per head (--model.learn-alpha)."""
    if not alphas:
        return []
    heads = "; ".join(f"{path} {', '.join(f'{a:.2f}' for a in v)}" for path, v in alphas.items())
    return ["", f"Learned α-entmax α per head (2: sparsemax, 1.5: entmax15, 1: softmax): {heads}."]


def _density(r: dict, part: str) -> float:
    """The fraction of allowed keys with a non-zero weight in one kind of attention."""
    att = r["attention"]
    allowed = att.get(f"{part}_allowed", float("nan"))
    return att.get(f"{part}_nonzero", float("nan")) / allowed if allowed else float("nan")


def _self_density(r: dict) -> float:
    return _density(r, "decoder_self")


def _figures(result: dict, kind: str) -> dict:
    """One kind's figures of a ``cot.evaluate`` result, or the whole split's (``"overall"``)."""
    return result["overall"] if kind == "overall" else result["kinds"][kind]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


_DIVERGENCES_TEXT = (
    "Where the chains of thought first leave the reference's steps "
    "(linalg_cot.first_divergence: the reference's step type, and whether the model did another "
    "operation there, got the state or deduction after it wrong, or stopped), the three most "
    "frequent per kind, with how many chains differ:"
)


_ROLES_TEXT = (
    "Teacher-forced next-token accuracy on the reference chains of the test split "
    "(cot.reference_accuracy: the model's most likely next token given the reference before "
    "it), by what the token writes (linalg_cot.solution_roles: the operation, the state or "
    "deduction after it, the answer line; in chains that write their row arithmetic, the "
    "terms' operands, factors, products and results), {models}:"
)


def _roles_table(results: dict[str, list[dict]], kinds: list[str]) -> list[str]:
    """Markdown lines: per kind and role, each model's ``reference_roles`` accuracy averaged
    over its ``results``, the models side by side in one cell (``-`` where one of its results
    lacks the role); [] when no result has them (``cot.evaluate`` of older code)."""
    results = {
        name: [r for r in rs if "reference_roles" in r["overall"]] for name, rs in results.items()
    }
    present = {
        role for rs in results.values() for r in rs for role in r["overall"]["reference_roles"]
    }
    if not present:
        return []
    roles = [r for r in linalg_cot.ROLES if r in present]
    lines = ["| kind | " + " | ".join(roles) + " |", "|:--|" + "--:|" * len(roles)]
    for k in kinds:
        cells = []
        for role in roles:
            means = []
            for rs in results.values():
                figures = [_figures(r, k)["reference_roles"] for r in rs]
                means.append(
                    "-"
                    if not figures or any(role not in f for f in figures)
                    else f"{100 * np.mean([f[role]['accuracy'] for f in figures]):.1f}"
                )
            cells.append(" / ".join(means))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _divergence_table(results: dict[str, list[dict]], kinds: list[str], most: int = 3) -> list:
    """Markdown lines: per kind, each model's most frequent first divergences from the reference
    (``cot.evaluate``'s ``divergences``) summed over its ``results``; [] when none has them
    (evaluations from before they were counted)."""
    if not any(
        "divergences" in _figures(r, k) for rs in results.values() for r in rs for k in kinds
    ):
        return []
    lines = ["| kind | " + " | ".join(results) + " |", "|:--|" + ":--|" * len(results)]
    for k in kinds:
        cells = []
        for rs in results.values():
            total: collections.Counter = collections.Counter()
            for r in rs:
                total.update(_figures(r, k).get("divergences", {}))
            questions = sum(_figures(r, k)["questions"] for r in rs)
            top = sorted(total.items(), key=lambda item: (-item[1], item[0]))[:most]
            cells.append(
                f"{sum(total.values())} of {questions} differ"
                + "".join(f"{', ' if i else ': '}{label} ({n})" for i, (label, n) in enumerate(top))
            )
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _report(folder: pathlib.Path, s: dict) -> None:
    from matplotlib.figure import Figure

    ev = s["evaluation"]
    kinds = list(ev["sparse"]["kinds"])
    panels = (
        ("exact match (%)", lambda r: 100 * r["exact_match"]),
        ("chain of thought (tokens)", lambda r: r["tokens"]),
        ("decoding ms per question", lambda r: 1e3 * r["seconds_per_question"]),
        ("decoder self-attention: allowed keys with weight > 0", _self_density),
    )
    fig = Figure(figsize=(12, 7))
    axes = fig.subplots(2, 2).ravel()
    x = np.arange(len(kinds))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for j, name in enumerate(MODELS):
            heights = [value(ev[name]["kinds"][k]) for k in kinds]
            ax.bar(x + (j - 0.5) * 0.38, heights, 0.38, label=name)
        if "tokens" in title:
            ref = [ev["dense"]["kinds"][k]["reference_tokens"] for k in kinds]
            ax.plot(x, ref, "k_", ms=30, mew=2, label="reference")
        if "exact" in title:
            prior = [100 * s["most_frequent_answer"][k]["exact_match"] for k in kinds]
            ax.plot(x, prior, "k_", ms=30, mew=2, label="most frequent answer")
        ax.set_xticks(x, [k.replace("_", "\n") for k in kinds])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "figure3.png", dpi=90)
    metrics = folder / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for name, label in (("sparse", "sparse (sparsemax loss)"), ("dense", "dense (CE)")):
            pts = [(r["step"], r["loss"]) for r in rows if r.get("phase") == name and "loss" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), lw=0.8, label=label)
        ax.set(xlabel="update", ylabel="training loss per token", yscale="log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "loss.png", dpi=90)

    fmt, lengths = s["format"], s["lengths"]
    sp, dn = ev["sparse"], ev["dense"]
    lines = [
        "# Chain-of-thought linear algebra: sparse encoder–decoder against its dense baseline",
        "",
        f"Kinds: {', '.join(kinds)} ({s['data']['sizes']} sizes; {s['data']['train']} training, "
        f"{s['data']['test']} test problems, seed {s['data']['seed']}"
        + (
            "; the chains compute each changed row's entries, --data.arithmetic"
            + (
                ", each combination's product first, --data.products)"
                if s["data"].get("products")
                else ")"
            )
            if s["data"].get("arithmetic")
            else ")"
        )
        + (
            ""
            if len(kinds) == len(linalg_cot.KINDS)
            else f": {len(kinds)} of the {len(linalg_cot.KINDS)} kinds (--data.kinds), the "
            "others neither trained nor evaluated"
        )
        + ". Every problem of these "
        f"kinds fits the models: questions up to {fmt['source_len']} tokens, solutions up to "
        f"{fmt['target_len']} tokens with EOS (nothing truncated or filtered); "
        + (
            f"a token is a byte, or an integer n with |n| < {fmt['numbers']} (--model.numbers)."
            if fmt.get("numbers")
            else "a token is a byte."
        ),
        "",
        "Distinct training questions (in content, whatever the phrasing; none is a test "
        "question): "
        + ", ".join(f"{k} {n}" for k, n in s["distinct_training_questions"].items())
        + ".",
        "",
        "Correctness. Exact match: the decoded final answer equals the reference "
        "(linalg_cot.grade). Most frequent answer: the exact match of answering every question "
        "of a kind with that kind's most frequent training answer, without reading it "
        "(cot.most_frequent_answers): the floor that answers learned by frequency reach. Chain "
        "right: every step line and the final answer are the reference's. First step right: the "
        "first step line is the reference's (the question read and copied right). Steps "
        "matched: the mean fraction of the reference's step lines written before the first "
        "that differs.",
        "",
        "| kind | exact match sparse | dense | most frequent answer | chain right sparse | "
        "dense | first step right sparse | dense | steps matched sparse | dense |",
        "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    prior = s["most_frequent_answer"]
    for k in [*kinds, "overall"]:
        a = _figures(sp, k)
        b = _figures(dn, k)
        lines.append(
            f"| {k} | {_pct(a['exact_match'])} | {_pct(b['exact_match'])} | "
            f"{_pct(prior[k]['exact_match'])} | "
            + " | ".join(
                _pct(r[name])
                for name in ("chain_match", "first_step", "steps_matched")
                for r in (a, b)
            )
            + " |"
        )
    divergences = _divergence_table({"sparse": [sp], "dense": [dn]}, list(kinds))
    if divergences:
        lines += ["", _DIVERGENCES_TEXT, "", *divergences]
    if roles := _roles_table({"sparse": [sp], "dense": [dn]}, [*kinds, "overall"]):
        lines += ["", _ROLES_TEXT.format(models="sparse / dense"), "", *roles]
    lines += [
        "",
        "Cost. Steps: the chain of thought's step lines (the answer line not counted). "
        "Decoding: greedy with the key/value cache on one batch per kind, stopping when every "
        "question has ended; time per question = the batch's wall time (median of "
        f"{s['eval_repeats']}) / its questions (compilation excluded).",
        "",
        "| kind | steps sparse / dense / ref | tokens sparse / dense / ref | decode ms/question "
        "sparse | dense | GFLOPs/question sparse | dense |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for k in [*kinds, "overall"]:
        a = _figures(sp, k)
        b = _figures(dn, k)
        lines.append(
            f"| {k} | "
            f"{a['steps']:.1f} / {b['steps']:.1f} / {a['reference_steps']:.1f} | "
            f"{a['tokens']:.0f} / {b['tokens']:.0f} / {a['reference_tokens']:.0f} | "
            f"{1e3 * a['seconds_per_question']:.2f} | {1e3 * b['seconds_per_question']:.2f} | "
            f"{a['flops_per_question'] / 1e9:.3f} | {b['flops_per_question'] / 1e9:.3f} |"
        )
    lines += ["", *_comparison_lines(s["comparison"])]
    lines += [
        "",
        "Attention density: the fraction of keys with a non-zero weight (of those the masks "
        "allow) in the decoded chains of thought, teacher-forced:",
        "",
        "| kind | encoder sparse | dense | decoder self sparse | dense | cross sparse | dense |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]

    for k in [*kinds, "overall"]:
        a = _figures(sp, k)
        b = _figures(dn, k)
        cells = [
            f"{_density(r, part):.3f}"
            for part in ("encoder", "decoder_self", "decoder_cross")
            for r in (a, b)
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    models = s["models"]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in s["phase_seconds"].items())
    sizes = {models[m]["parameters"] for m in ("sparse", "dense")}
    parameters = (  # the logit scale's factors are the sparse model's only extra parameters
        f"both models {models['sparse']['parameters']:,} parameters"
        if len(sizes) == 1
        else f"{models['sparse']['parameters']:,} parameters sparse, "
        f"{models['dense']['parameters']:,} dense"
    )
    config = EncDecConfig(**models["sparse"]["config"])  # an older record: defaults fill in
    queries = {"input": "the layer's input", "self": "the self-attention's output"}
    lines += [
        "",
        f"Sparse switches: {models['sparse']['switches']}; {parameters} (d_model "
        f"{config.d_model}, {config.encoder_layers} + {config.decoder_layers} layers, "
        f"{config.cot_steps} CoT steps; both models: {config.positions} positions, "
        f"cross-attention queries from {queries[config.cross_queries]}), trained "
        f"{models['sparse']['trained_steps']} / {models['dense']['trained_steps']} updates. "
        "FLOPs: model.flops(question tokens, decoded tokens), a teacher-forced pass counting every "
        "entry the masks allow (sparsemax's zero weights are not subtracted). Device "
        f"{s['device']}; this command's wall time {s['wall_time_s']:.0f} s; phases: {phases}.",
        *_alpha_lines(models["sparse"].get("learned_alphas")),
        "",
        "Longest question / solution per kind (tokens, all splits): "
        + "; ".join(
            f"{k} {v['question_tokens_max']} / {v['solution_tokens_max']}"
            for k, v in lengths.items()
        )
        + ".",
        "",
        "![per kind: exact match, length, decoding time, attention density](figure3.png)",
        "",
        "![training loss](loss.png)",
        "",
    ]
    write_text_atomically(folder / "report.md", "\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Seeds.


def seeds(cmd: SeedsCommand, stop: StopRequest | None = None) -> dict:
    """Trains and evaluates ``cmd.models`` at each of ``cmd.seeds`` (one run folder per seed,
    ``<run.dir>/seed-<s>``, with ``answers-<model>.jsonl`` and ``eval-<model>.json``); writes
    ``seeds.json`` and ``seeds.md`` and prints the table. With ``--run.resume`` a model already
    evaluated at a seed is read back, one whose training stopped continues from its checkpoint."""
    stamp = time.strftime("cot-seeds-%Y%m%d-%H%M%S")
    top = pathlib.Path(cmd.run.dir or pathlib.Path("runs") / stamp)
    base = TrainCommand(**{f.name: getattr(cmd, f.name) for f in dataclasses.fields(TrainCommand)})
    data = _data(cmd.data, cmd.run.cache_dir)
    test = list(data.test)
    rows = []
    for seed in cmd.seeds:
        folder = top / f"seed-{seed}"
        resume = cmd.run.resume and (folder / "config.json").is_file()
        one = dataclasses.replace(
            base, run=dataclasses.replace(cmd.run, seed=seed, dir=folder, resume=resume)
        )
        done = {m for m in cmd.models if resume and (folder / f"eval-{m}.json").is_file()}
        pending = tuple(m for m in cmd.models if m not in done)
        if pending:
            log(f"seed {seed}: training {', '.join(pending)} in {folder}")
            try:
                train(one, models=pending, stop=stop)
            except RunStopped as stopped:  # the seeds command resumes from the top folder
                stopped.folder = top
                raise
            trained = json.loads((folder / "training.json").read_text())["phase_seconds"]
        for name in cmd.models:
            path = folder / f"eval-{name}.json"
            if name in pending:
                _, result, _ = _decode_test(folder, name, test, cmd.eval)
                result["train_seconds"] = trained[f"train_{name}"]
                write_text_atomically(path, json.dumps(result, indent=2) + "\n")
            rows.append({"seed": seed, "model": name, **json.loads(path.read_text())})
    kinds = list(cmd.data.kinds)
    summary = {
        "kinds": kinds,
        "seeds": list(cmd.seeds),
        "models": list(cmd.models),
        "switches": describe(cmd.model.config(0)),
        "runs": rows,
        "exact_match": _seed_spread(rows, cmd.models, [*kinds, "overall"]),
    }
    if set(cmd.models) == set(MODELS):
        summary["pooled"] = _pooled(top, cmd.seeds, [*kinds, "overall"])
    write_text_atomically(top / "seeds.json", json.dumps(summary, indent=2) + "\n")
    table = _seeds_table(summary)
    write_text_atomically(top / "seeds.md", table)
    print(table)
    log(f"table: {top / 'seeds.md'}")
    return summary


def _pooled(top: pathlib.Path, seed_list, kinds: list[str]) -> dict:
    """Per kind (and ``overall``): sparse minus dense over every seed's answers, the questions
    resampled with their answers in every seed (:func:`experiments.stats.clustered_difference`),
    read from each seed's ``answers-<model>.jsonl``."""
    answers = {
        (seed, name): [
            json.loads(line) for line in (top / f"seed-{seed}" / f"answers-{name}.jsonl").open()
        ]
        for seed in seed_list
        for name in MODELS
    }
    out = {}
    for kind in kinds:
        a, b, questions = [], [], []
        for seed in seed_list:
            pairs = zip(answers[seed, "sparse"], answers[seed, "dense"], strict=True)
            for i, (x, y) in enumerate(pairs):
                if x["question"] != y["question"]:
                    raise ValueError(f"seed {seed}: the two models' answers are not in one order")
                if kind in (x["kind"], "overall"):
                    a.append(x["correct"])
                    b.append(y["correct"])
                    questions.append(i)
        out[kind] = stats.clustered_difference(a, b, questions)
    return out


def _exact(row: dict, kind: str) -> float:
    return _figures(row, kind)["exact_match"]


def _seed_spread(rows: list[dict], models, kinds: list[str]) -> dict:
    """Per model and kind: exact match's mean, min and max over the seeds; with both models,
    the sparse minus dense difference at each seed (points) and its mean."""
    out: dict[str, Any] = {}
    for name in models:
        mine = [r for r in rows if r["model"] == name]
        out[name] = {
            k: {
                "mean": float(np.mean([_exact(r, k) for r in mine])),
                "min": min(_exact(r, k) for r in mine),
                "max": max(_exact(r, k) for r in mine),
            }
            for k in kinds
        }
    if set(models) == set(MODELS):
        by = {(r["seed"], r["model"]): r for r in rows}
        points = {
            str(seed): 100 * (_exact(by[seed, "sparse"], "overall") - _exact(r, "overall"))
            for (seed, name), r in by.items()
            if name == "dense"
        }
        out["sparse_minus_dense_points"] = {
            "per_seed": points,
            "mean": float(np.mean(list(points.values()))),
        }
    return out


def _seeds_table(s: dict) -> str:
    kinds = [*s["kinds"], "overall"]
    lines = [
        "# Chain-of-thought linear algebra: exact match over seeds",
        "",
        f"Models: {', '.join(s['models'])}; sparse switches: {s['switches']}. Each run differs "
        "only in --run.seed (initial weights, batches); the data and the test split are the "
        "same. Exact match on the test split (linalg_cot.grade); decoding ms per question: the "
        "median of the evaluation's repeats; training s: the call that trained the model (of "
        "a resumed training, the part after the resume).",
        "",
        "| seed | model | " + " | ".join(kinds) + " | chain right | decode ms/question | "
        "training s |",
        "|--:|:--|" + "--:|" * (len(kinds) + 3),
    ]
    for r in s["runs"]:
        chain = r["overall"].get("chain_match")  # absent from evaluations before it existed
        lines.append(
            f"| {r['seed']} | {r['model']} | "
            + " | ".join(_pct(_exact(r, k)) for k in kinds)
            + f" | {'n/a' if chain is None else _pct(chain)}"
            + f" | {1e3 * r['overall']['seconds_per_question']:.2f} | {r['train_seconds']:.0f} |"
        )
    spread = s["exact_match"]
    for name in s["models"]:
        cells = [spread[name][k] for k in kinds]
        chains = [r["overall"].get("chain_match") for r in s["runs"] if r["model"] == name]
        chain = "" if None in chains else _pct(float(np.mean(chains)))
        lines.append(
            f"| mean | {name} | " + " | ".join(_pct(c["mean"]) for c in cells) + f" | {chain} | | |"
        )
        lines.append(
            f"| range | {name} | "
            + " | ".join(f"{_pct(c['min'])}-{_pct(c['max'])}" for c in cells)
            + " | | | |"
        )
    gap = spread.get("sparse_minus_dense_points")
    if gap:
        lines += [
            "",
            "Sparse minus dense, overall exact match: "
            + ", ".join(f"seed {k} {v:+.1f}" for k, v in gap["per_seed"].items())
            + f"; mean {gap['mean']:+.1f} points.",
        ]
    if pooled := s.get("pooled"):
        lines += [
            "",
            "Sparse minus dense over all the seeds' answers, in points, with a 95% interval from "
            "resampling the test questions (each with its answers at every seed, 10,000 times: "
            "experiments.stats.clustered_difference), and the answers only one model got right:",
            "",
            "| kind | sparse − dense, points (95%) | right only sparse / only dense | answers |",
            "|:--|--:|--:|--:|",
        ]
        for k, v in pooled.items():
            lo, hi = (100 * x for x in v["ci95"])
            lines.append(
                f"| {k} | {100 * v['difference']:+.1f} ({lo:+.1f} to {hi:+.1f}) | "
                f"{v['a_only']} / {v['b_only']} | {v['n']} |"
            )
    by_model = {name: [r for r in s["runs"] if r["model"] == name] for name in s["models"]}
    divergences = _divergence_table(by_model, s["kinds"])
    if divergences:
        lines += ["", _DIVERGENCES_TEXT.replace("per kind", "per kind over the seeds"), ""]
        lines += divergences
    roles = _roles_table(by_model, kinds)
    if roles:
        models = " / ".join(s["models"]) + ", the mean over the seeds"
        lines += ["", _ROLES_TEXT.format(models=models), "", *roles]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Asking.


def ask(cmd: AskCommand) -> dict[str, cot.Answer]:
    """Prints each chosen model's chain of thought, final answer and decoding time."""
    names = MODELS if cmd.model == "both" else (cmd.model,)
    answers = {}
    for name in names:
        solver = cot.Solver.load(cmd.run.dir, name, batch_size=1)
        answer = solver.answer(cmd.question)
        answers[name] = answer
        print(f"== {name} model (trained {solver.step} updates) ==")
        print(answer.text)
        if answer.error is None:
            print(f"final answer: {answer.final if answer.final is not None else '(none)'}")
            ended = "" if answer.finished else ", cut at the length limit"
            print(f"decoded {answer.tokens} tokens in {answer.seconds:.3f} s{ended}")
            if solver.kinds is not None and answer.kind not in solver.kinds:
                print(f"note: this model was not trained on {answer.kind} questions")
        print()
    return answers


def _by_sign(role: str, text: str) -> str:
    if role != "term result":
        return role
    return f"{role}, {'negative' if text.startswith('-') else 'non-negative'}"


def roles(cmd: RolesCommand) -> dict[str, dict[str, dict[str, int]]]:
    """Prints, and returns per trained model, ``cot.reference_accuracy`` on the run's test
    split per unit of ``CotFormat(numbers=cmd.numbers)``, the terms' results split by sign (a
    run of `seeds --models` may hold one model)."""
    folder = pathlib.Path(cmd.run.dir)
    test = list(_data(_read_config(folder), cmd.run.cache_dir).test)
    units = cot.CotFormat(numbers=cmd.numbers)
    out = {}
    for name in MODELS:
        try:
            solver = cot.Solver.load(folder, name)
        except FileNotFoundError:
            log(f"{folder}: no trained {name} model")
            continue
        counts = cot.reference_accuracy(solver, test, units=units, group=_by_sign)
        out[name] = {}
        for group, count in counts.items():  # the terms' results in all, then by sign
            if group.startswith("term result, ") and "term result" not in out[name]:
                out[name]["term result"] = _sum_counts(counts, "term result, ")
            out[name][group] = count
    if not out:
        raise ValueError(f"--run.dir {str(folder)!r} holds no trained model")
    unit = f"number (|n| < {cmd.numbers})" if cmd.numbers else "byte"
    print(
        f"Teacher-forced accuracy on the {len(test)} test problems of {folder}, per {unit}: "
        f"right / counted (%), {' and '.join(out)}.\n"
    )
    print(f"| what the unit writes | {' | '.join(out)} |\n|:--|{'--:|' * len(out)}")
    groups = list(dict.fromkeys(g for counts in out.values() for g in counts))
    for group in groups:
        cells = [
            f"{c['right']} / {c['tokens']} ({100 * c['right'] / c['tokens']:.1f}%)"
            if (c := counts.get(group, {})).get("tokens")
            else "-"
            for counts in out.values()
        ]
        print(f"| {group} | {' | '.join(cells)} |")
    return out


def _sum_counts(counts: dict[str, dict[str, int]], prefix: str) -> dict[str, int]:
    parts = [c for group, c in counts.items() if group.startswith(prefix)]
    return {k: sum(c[k] for c in parts) for k in ("right", "tokens")}


def run(cmd: Command) -> Any:
    """Runs a parsed command: the summary (all, eval, seeds), the run folder (train), the
    answers (ask) or the counts (roles).

    Training stops early, with a checkpoint of the step each model reached, on SIGTERM or
    SIGINT (Ctrl-C, a notebook's interrupt) or after ``--run.max-minutes``: it raises
    :class:`experiments.phase.RunStopped`, whose ``folder`` the same command with
    ``--run.resume`` continues."""
    started = time.perf_counter()
    if isinstance(cmd, AskCommand):
        return ask(cmd)
    if isinstance(cmd, RolesCommand):
        return roles(cmd)
    if isinstance(cmd, EvalCommand):
        return evaluate_run(pathlib.Path(cmd.run.dir), cmd.eval, cmd.run.cache_dir, started)
    with stop_request(cmd.run.max_minutes, log) as stop:
        if isinstance(cmd, SeedsCommand):
            return seeds(cmd, stop)
        folder = train(cmd, stop=stop)
    if isinstance(cmd, AllCommand):
        return evaluate_run(folder, cmd.eval, cmd.run.cache_dir, started)
    log(f"trained in {time.perf_counter() - started:.0f} s: {folder}")
    return folder


def main(argv: list[str] | None = None) -> None:
    main_of("experiments.cot", run, parse, argv, log)


if __name__ == "__main__":
    main()
