"""Training and evaluating one run folder of ``python -m experiments.cot``: the data splits
(:func:`prepare_data`), the sparse model and its dense baseline trained in turn, each phase
checkpointed under ``<run>/checkpoints/<model>`` (:func:`train`), and both decoded on the test
split and compared (:func:`evaluate_run`), which writes ``answers-<model>.jsonl``, the
answers to the GiantRabbit study's exam (:mod:`experiments.cot.exam`), ``summary.json`` and the
report (:mod:`experiments.cot.report`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import time

import jax
import numpy as np
from flax import nnx

from experiments.common import stats
from experiments.common.phase import train_phase
from experiments.common.run_folder import (
    COT,
    RECORD,
    RunFolderError,
    check_folder,
    check_same_flags,
    check_writable,
    clear_failed_start,
    with_program,
)
from experiments.cot.config import BEFORE_NEWER_FLAGS, MODELS, Data, Eval, TrainCommand
from experiments.cot.exam import DEFAULT_QUIZ, ask_quiz, quiz_path, read_quiz, write_answers
from experiments.cot.report import kind_figures, write_report
from sparse_jax import cot
from sparse_jax.data import linalg_cot
from sparse_jax.files import write_text_atomically
from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder, describe
from sparse_jax.training.checkpoint import CheckpointError
from sparse_jax.training.loop import TrainConfig
from sparse_jax.training.stopping import StopRequest

__all__ = [
    "decode_test",
    "evaluate_run",
    "load_solver",
    "log",
    "prepare_data",
    "quiz_questions",
    "read_config",
    "recorded_quiz",
    "train",
]


def log(msg: str) -> None:
    print(f"[cot] {msg}", file=sys.stderr, flush=True)


def quiz_questions(path: pathlib.Path = DEFAULT_QUIZ) -> list[linalg_cot.ParsedQuestion] | None:
    """The questions of the quiz file at ``path`` as linalg_cot reads them (parse_question, else
    parse_descriptive; a question neither reads is left out: no generated question is written
    like it), or None when there is no such file."""
    path = pathlib.Path(path)
    if not path.is_file():
        return None
    out = []
    for entry in read_quiz(path):
        for parse in (linalg_cot.parse_question, linalg_cot.parse_descriptive):
            try:
                out.append(parse(entry["text"]))
                break
            except ValueError:
                continue
    return out


def prepare_data(data: Data, cache_dir: pathlib.Path, quiz: pathlib.Path | str | None = None):
    """The splits ``data`` describes, generated once into ``cache_dir`` (--run.cache-dir; a
    folder that cannot be written is refused by name first); with --data.exclude-quiz, none
    holds a question of the quiz file ``quiz`` (the one --eval.quiz names; None:
    :data:`~experiments.cot.exam.DEFAULT_QUIZ`) when it exists (a log line says so either
    way)."""
    cache = pathlib.Path(cache_dir).expanduser()
    check_writable(cache, "--run.cache-dir", existing_may_be_read_only=True)
    exclude: list[linalg_cot.ParsedQuestion] = []
    quiz = quiz_path(quiz)
    if data.exclude_quiz:
        found = quiz_questions(quiz)
        if found is None:
            log(f"--data.exclude-quiz: the quiz {quiz} was not found: nothing excluded")
        else:
            exclude = found
            log(f"--data.exclude-quiz: {len(exclude)} questions of {quiz} in no split")
    return linalg_cot.prepare(
        cache / "tfds",
        train=data.train,
        validation=data.validation,
        test=data.test,
        seed=data.seed,
        config=data.generator(),
        exclude=exclude,
    )


def recorded_quiz(folder: pathlib.Path) -> pathlib.Path | None:
    """The ``--eval.quiz`` that the run ``folder``'s config.json records: the quiz file its
    training kept out of the splits with --data.exclude-quiz (None: it names none, the default
    path then; a train command's run, or one from before the flag)."""
    path = pathlib.Path(folder) / RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    quiz = (record.get("eval") or {}).get("quiz")
    return None if quiz is None else pathlib.Path(quiz)


def _training_quiz(cfg: TrainCommand, folder: pathlib.Path, resumed: bool) -> pathlib.Path | None:
    """The --eval.quiz whose questions --data.exclude-quiz keeps out of ``cfg``'s splits: the
    one the command names (``all`` and ``seeds`` have evaluation flags; None: the default
    path), or for a resumed run that names none, the one its config.json records. A resumption
    naming another one than its run's is refused by name (its splits would differ)."""
    ev = getattr(cfg, "eval", None)
    quiz = None if ev is None else ev.quiz
    if not resumed or not cfg.data.exclude_quiz:
        return quiz
    had = recorded_quiz(folder)
    if quiz is None:
        return had
    if quiz_path(quiz) != quiz_path(had):
        raise RunFolderError(
            f"--eval.quiz {str(quiz)!r}: the run in {str(folder)!r} kept the questions of "
            f"{str(quiz_path(had))!r} out of its splits (--data.exclude-quiz); resume it with "
            "that --eval.quiz, or start another --run.dir"
        )
    return quiz


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


def _configs(cfg: TrainCommand) -> dict[str, tuple[EncDecConfig, TrainConfig]]:
    sparse = cfg.model.config(cfg.run.seed)
    tc = cfg.train.config(cfg.run.seed)
    return {"sparse": (sparse, tc), "dense": (sparse.dense(), tc)}


def _phase(
    cfg: TrainCommand, folder: pathlib.Path, name: str, configs, source_len, rows, val_rows, stop
):
    """Trains (or resumes) one model (:func:`experiments.common.phase.train_phase`) on the
    buckets of ``rows`` (``source_len``: :func:`sparse_jax.cot.source_lengths`); its seconds."""
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
    training early with checkpoints (:class:`experiments.common.phase.RunStopped`)."""
    started = time.perf_counter()
    folder = pathlib.Path(cfg.run.dir or pathlib.Path("runs") / time.strftime("cot-%Y%m%d-%H%M%S"))
    # The run folder, before any data or model work (experiments.common.run_folder).
    saved = check_folder(folder, COT, resume=cfg.run.resume)
    if saved is not None:
        # The flags that decide the format, the models and their updates must match
        # (flags.CHECKPOINT_FLAGS); the evaluation's may change.
        # (A run older than a flag ran it as BEFORE_NEWER_FLAGS says.)
        check_same_flags(cfg, folder, COT, defaults=BEFORE_NEWER_FLAGS)
    check_writable(folder, "--run.dir")
    quiz = _training_quiz(cfg, folder, resumed=saved is not None)
    data = prepare_data(cfg.data, cfg.run.cache_dir, quiz)
    splits = (data.train, data.validation, data.test)
    problems = [list(s) for s in splits]
    fmt = cot.fit_format([p for split in problems for p in split], numbers=cfg.model.numbers)
    configs = _configs(cfg)
    if saved is None:
        clear_failed_start(folder, log)
    folder.mkdir(parents=True, exist_ok=True)
    record = with_program(dataclasses.asdict(cfg), COT.name)
    if quiz is not None:  # the quiz the splits were made without (recorded_quiz reads it)
        record["eval"] = {**record.get("eval", {}), "quiz": str(quiz)}
    write_text_atomically(folder / RECORD, json.dumps(record, default=str, indent=2) + "\n")
    cot.write_record(folder, fmt, configs, kinds=cfg.data.kinds, generator=cfg.data.generator())
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


def read_config(folder: pathlib.Path) -> Data:
    record = json.loads((folder / "config.json").read_text())
    d = record["data"]
    return Data(**{**d, "kinds": tuple(d["kinds"])})


def evaluate_run(folder: pathlib.Path, ev: Eval, cache_dir: pathlib.Path, started: float) -> dict:
    """Evaluates both trained models of ``folder`` on its test split and on the study's exam
    (``ev.quiz``); writes ``answers-<model>.jsonl``, ``quiz-answers.json``, ``summary.json``,
    ``report.md`` and the plots."""
    lap = time.perf_counter()
    data_cfg = read_config(folder)
    data = prepare_data(data_cfg, cache_dir, recorded_quiz(folder))
    train, test = list(data.train), list(data.test)  # read once: three summaries below
    training_file = folder / "training.json"  # written when both models have trained
    training = json.loads(training_file.read_text()) if training_file.exists() else {}
    seconds = dict(training.get("phase_seconds", {}))
    results, models, correct, solvers = {}, {}, {}, {}
    record = cot.read_record(folder)
    for name in MODELS:
        solver, result, records = decode_test(folder, name, test, ev)
        solvers[name] = solver
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
    # The study's exam, each question alone (a batch of one: compiled once per model).
    write_answers(folder, ask_quiz(solvers, quiz_path(ev.quiz)))
    quiz_seconds = time.perf_counter() - lap
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
        "quiz_seconds": quiz_seconds,
        "eval_repeats": ev.repeats,
        "wall_time_s": time.perf_counter() - started,
        "device": f"{jax.default_backend()} x{jax.device_count()}",
    }
    write_text_atomically(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_report(folder, summary)
    log(f"report: {folder / 'report.md'}")
    return summary


def load_solver(folder: str | pathlib.Path, name: str, **options) -> cot.Solver:
    """``cot.Solver.load(folder, name, **options)`` for a command of this program: a model the
    folder holds but that cannot be loaded (a damaged ``cot.json``, a record that does not
    match its checkpoint) is a :class:`RunFolderError` naming ``--run.dir`` (one line and exit
    status 2); a folder without the model raises ``FileNotFoundError`` as ``Solver.load`` does,
    and a checkpoint that cannot be used (none readable, non-finite weights) a
    ``CheckpointError`` (one line, status 1, as the training commands' checkpoints)."""
    try:
        return cot.Solver.load(folder, name, **options)
    except CheckpointError:
        raise  # NonFiniteCheckpointError is a ValueError too: it stays a checkpoint's error
    except ValueError as err:
        raise RunFolderError(
            f"--run.dir {str(folder)!r}: its {name} model cannot be loaded: {err}"
        ) from err


def decode_test(
    folder: pathlib.Path, name: str, test: list, ev: Eval
) -> tuple[cot.Solver, dict, list[dict]]:
    """Decodes ``test`` with the trained model ``name`` of ``folder`` (``cot.evaluate``) and
    writes its ``answers-<name>.jsonl``; the solver, the result without its records, and the
    records (one per test question, in order)."""
    solver = load_solver(folder, name, batch_size=ev.batch_size, chunk=ev.chunk)
    log(f"{folder.name}, {name}: decoding {len(test)} test questions")
    result = cot.evaluate(solver, test, repeats=ev.repeats)
    records = result.pop("records")
    lines = "".join(json.dumps(r) + "\n" for r in records)
    write_text_atomically(folder / f"answers-{name}.jsonl", lines)
    return solver, result, records


def _comparison(results: dict, correct: dict[str, list[tuple[str, bool]]]) -> dict:
    """Per kind and ``overall``: sparse minus dense exact match in points, paired on the same
    questions (:func:`experiments.common.stats.paired`: its 95% interval in points, the
    questions only one model answered right, McNemar's p), each model's exact match with its 95%
    Wilson interval, and the ratio of their decoding times per question."""
    out = {}
    for kind in [*results["sparse"]["kinds"], "overall"]:
        right = {name: [ok for k, ok in correct[name] if kind in (k, "overall")] for name in MODELS}
        pair = stats.paired(right["sparse"], right["dense"])
        s, d = (kind_figures(results[name], kind) for name in MODELS)
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
