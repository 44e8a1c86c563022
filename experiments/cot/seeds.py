"""``python -m experiments.cot seeds``: the chosen models trained and evaluated at several seeds
(initial weights and batches; the data stay the same), each seed's run in
``<run.dir>/seed-<s>``; their exact match side by side with its mean and range, and sparse minus
dense pooled over the seeds' answers, in ``seeds.json`` and ``seeds.md``, which ends with the
GiantRabbit study's exam asked of each seed's models (:mod:`experiments.cot.exam`: each seed's
``quiz-answers.json``, the table pooled over the seeds).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

import numpy as np

from experiments.common import stats
from experiments.common.phase import RunStopped
from experiments.common.run_folder import RunFolderError
from experiments.cot.config import MODELS, AllCommand, SeedsCommand, TrainCommand
from experiments.cot.exam import ask_quiz, quiz_path, read_answers, seeds_quiz_lines, write_answers
from experiments.cot.report import (
    DIVERGENCES_TEXT,
    ROLES_TEXT,
    divergence_table,
    kind_figures,
    pct,
    roles_table,
)
from experiments.cot.run_folder import (
    decode_test,
    load_solver,
    log,
    prepare_data,
    recorded_quiz,
    train,
)
from sparse_jax import cot
from sparse_jax.files import write_text_atomically
from sparse_jax.models.encdec import describe
from sparse_jax.training.stopping import StopRequest

__all__ = ["seeds"]


def seeds(cmd: SeedsCommand, stop: StopRequest | None = None) -> dict:
    """Trains and evaluates ``cmd.models`` at each of ``cmd.seeds`` (one run folder per seed,
    ``<run.dir>/seed-<s>``, with ``answers-<model>.jsonl``, ``eval-<model>.json`` and the
    answers to the study's exam, ``quiz-answers.json``: ``--eval.quiz``); writes ``seeds.json``
    and ``seeds.md`` and prints the table. With ``--run.resume`` a model already evaluated at a
    seed is read back (and the seed's answers to the same quiz file), one whose training stopped
    continues from its checkpoint."""
    stamp = time.strftime("cot-seeds-%Y%m%d-%H%M%S")
    top = pathlib.Path(cmd.run.dir or pathlib.Path("runs") / stamp)
    held = sorted(p.name for p in top.glob("seed-*"))
    if held and not cmd.run.resume:
        raise RunFolderError(
            f"--run.dir {str(top)!r} already holds runs ({', '.join(held)}); continue them "
            "with --run.resume or pass another --run.dir"
        )
    # Each seed's command, without a run folder yet (each seed's is checked as it is set below);
    # its evaluation flags name the quiz that --data.exclude-quiz keeps out of the splits (when
    # resumed without --eval.quiz: the one the seeds' runs were made without).
    fields = {f.name: getattr(cmd, f.name) for f in dataclasses.fields(TrainCommand)}
    run = dataclasses.replace(cmd.run, dir=None, resume=False)
    ev = cmd.eval
    if ev.quiz is None and held and cmd.run.resume:
        if (had := recorded_quiz(top / held[0])) is not None:
            ev = dataclasses.replace(ev, quiz=had)
    base = AllCommand(**{**fields, "run": run}, eval=ev)
    data = prepare_data(cmd.data, cmd.run.cache_dir, ev.quiz)
    quiz = quiz_path(ev.quiz)  # the exam asked of each seed's models
    test = list(data.test)
    rows = []
    quizzes: dict[int, dict | None] = {}
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
        solvers = {}
        for name in cmd.models:
            path = folder / f"eval-{name}.json"
            if name in pending:
                solvers[name], result, _ = decode_test(folder, name, test, cmd.eval)
                result["train_seconds"] = trained[f"train_{name}"]
                write_text_atomically(path, json.dumps(result, indent=2) + "\n")
            rows.append({"seed": seed, "model": name, **json.loads(path.read_text())})
        quizzes[seed] = _quiz(folder, cmd.models, solvers, quiz, asked_again=bool(pending))
    kinds = list(cmd.data.kinds)
    summary = {
        "kinds": kinds,
        "seeds": list(cmd.seeds),
        "models": list(cmd.models),
        "switches": describe(cmd.model.config(0)),
        "runs": rows,
        "exact_match": _seed_spread(rows, cmd.models, [*kinds, "overall"]),
        "quiz": str(quiz),
    }
    if set(cmd.models) == set(MODELS):
        summary["pooled"] = _pooled(top, cmd.seeds, [*kinds, "overall"])
    write_text_atomically(top / "seeds.json", json.dumps(summary, indent=2) + "\n")
    table = _seeds_table(summary, quizzes)
    write_text_atomically(top / "seeds.md", table)
    print(table)
    log(f"table: {top / 'seeds.md'}")
    return summary


def _quiz(
    folder: pathlib.Path,
    models: tuple[str, ...],
    solvers: dict[str, cot.Solver],
    quiz: pathlib.Path,
    *,
    asked_again: bool,
) -> dict:
    """One seed's answers to the study's exam (the quiz file ``quiz``), saved in its run
    folder (:func:`experiments.cot.exam.write_answers`): those already saved there for the
    same file when no model of the seed was trained or evaluated again (``asked_again``), else
    asked of ``models`` now (``solvers``: those already loaded; the others are loaded)."""
    saved = read_answers(folder)
    if (
        not asked_again
        and saved is not None
        and saved.get("quiz") == str(quiz)
        and bool(saved.get("found")) == quiz.is_file()
    ):
        return saved
    if quiz.is_file():
        for name in models:
            if name not in solvers:
                solvers[name] = load_solver(folder, name, batch_size=1)
    log(f"{folder.name}: the study's exam ({quiz})")
    record = ask_quiz({name: solvers[name] for name in models if name in solvers}, quiz)
    write_answers(folder, record)
    return record


def _pooled(top: pathlib.Path, seed_list, kinds: list[str]) -> dict:
    """Per kind (and ``overall``): sparse minus dense over every seed's answers, the questions
    resampled with their answers in every seed
    (:func:`experiments.common.stats.clustered_difference`), read from each seed's
    ``answers-<model>.jsonl``."""
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
    return kind_figures(row, kind)["exact_match"]


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


def _seeds_table(s: dict, quizzes: dict[int, dict | None] | None = None) -> str:
    """``seeds.md`` from the summary ``s``, ending with the study's exam pooled over the seeds
    (:func:`experiments.cot.exam.seeds_quiz_lines` of each seed's saved answers, ``quizzes``;
    None: a summary without them, no exam lines)."""
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
            + " | ".join(pct(_exact(r, k)) for k in kinds)
            + f" | {'n/a' if chain is None else pct(chain)}"
            + f" | {1e3 * r['overall']['seconds_per_question']:.2f} | {r['train_seconds']:.0f} |"
        )
    spread = s["exact_match"]
    for name in s["models"]:
        cells = [spread[name][k] for k in kinds]
        chains = [r["overall"].get("chain_match") for r in s["runs"] if r["model"] == name]
        chain = "" if None in chains else pct(float(np.mean(chains)))
        lines.append(
            f"| mean | {name} | " + " | ".join(pct(c["mean"]) for c in cells) + f" | {chain} | | |"
        )
        lines.append(
            f"| range | {name} | "
            + " | ".join(f"{pct(c['min'])}-{pct(c['max'])}" for c in cells)
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
            "experiments.common.stats.clustered_difference), and the answers only one model got "
            "right:",
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
    divergences = divergence_table(by_model, s["kinds"])
    if divergences:
        lines += ["", DIVERGENCES_TEXT.replace("per kind", "per kind over the seeds"), ""]
        lines += divergences
    roles = roles_table(by_model, kinds)
    if roles:
        models = " / ".join(s["models"]) + ", the mean over the seeds"
        lines += ["", ROLES_TEXT.format(models=models), "", *roles]
    if quizzes is not None:
        lines += ["", *seeds_quiz_lines(quizzes, tuple(s["models"]))]
    return "\n".join(lines) + "\n"
