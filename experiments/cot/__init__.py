"""python -m experiments.cot — chain-of-thought linear algebra: a sparse encoder–decoder against
its dense baseline of the same size, data, steps and seed (issue 16, the GiantRabbit study).

    python -m experiments.cot                        # train both, then evaluate: minutes on a CPU
    python -m experiments.cot --preset study         # all six kinds, bigger (a GPU): `study()`
    python -m experiments.cot train --run.dir R      # train only (--run.resume continues R)
    python -m experiments.cot eval --run.dir R       # evaluate R's models on its test split
    python -m experiments.cot ask "What is rref(A) for A = [[2, 4], [1, 3]]?" --run.dir R
    python -m experiments.cot seeds --seeds 0 1 2    # each model at each seed: the spread
    python -m experiments.cot roles --run.dir R      # teacher-forced accuracy per number
    python -m experiments.cot quiz --run.dir R       # the GiantRabbit study's exam (issue 59)

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
several seeds (the same data) and prints each one's exact match beside their mean and range,
then, when the quiz file is there, the study's table pooled over the seeds (per question and
model: how many seeds answered it right, mean reasoning time, steps and tokens; each seed's
``quiz-answers.json`` kept in its folder). At the default's size a kind's exact match moves by
many points between seeds (docs/archive/results-history.md, "The window through the
block-sparse kernel, and how much the default moves between seeds"), so a difference between
two single runs says little. ``quiz`` asks the trained models the study's
own exam (the nine questions of its Table 1 as it entered them, read from ``--eval.quiz``,
default ``../shared/data/giantrabbit-quiz/quiz.json`` beside the repository): per question right
or not against the study's answer, reasoning time, chain steps and tokens, sparse beside dense;
``eval`` (and the default) ends every report with that table.

The default fits a 2-core CPU: three of the six kinds (rref, solvability, column space) at small
sizes (matrices up to 2 x 3, entries up to 3, solvability's m and n up to 9), whose solutions are
at most ~270 bytes, and a small model; ``--data.kinds`` with all six trains the other three at the
same sizes. The run folder holds ``config.json``, ``cot.json`` (what ``Solver.load`` reads),
``metrics.jsonl``, ``checkpoints/``, ``answers-<model>.jsonl``, ``quiz-answers.json``,
``summary.json``, ``report.md`` and its plots.

The package, bottom up: :mod:`.config` (the flag groups, the subcommands, :func:`parse`),
:mod:`.exam` (the study's exam: its answers and table), :mod:`.report` (``report.md``, its plots
and tables), :mod:`.run_folder` (data, training and
evaluation of one run folder), :mod:`.seeds` (the seeds command), :mod:`.job` (:func:`run` of a
parsed command, ``ask``, ``roles``, :func:`main`).
"""

from experiments.cot.config import (
    MODELS,
    PRESETS,
    SIZES,
    AllCommand,
    AskCommand,
    Command,
    Data,
    Eval,
    EvalCommand,
    Model,
    QuizCommand,
    QuizFlags,
    RolesCommand,
    Run,
    RunDir,
    SeedsCommand,
    Train,
    TrainCommand,
    parse,
    study,
)
from experiments.cot.job import ask, main, quiz, roles, run
from experiments.cot.run_folder import evaluate_run, train

__all__ = [
    "MODELS",
    "PRESETS",
    "SIZES",
    "AllCommand",
    "AskCommand",
    "Command",
    "Data",
    "Eval",
    "EvalCommand",
    "Model",
    "QuizCommand",
    "QuizFlags",
    "RolesCommand",
    "Run",
    "RunDir",
    "SeedsCommand",
    "Train",
    "TrainCommand",
    "ask",
    "evaluate_run",
    "main",
    "parse",
    "quiz",
    "roles",
    "run",
    "study",
    "train",
]
