"""The commands of ``python -m experiments.cot`` run end to end: :func:`run` of a parsed command
(training and evaluation: :mod:`experiments.cot.run_folder`; seeds:
:mod:`experiments.cot.seeds`), :func:`ask`, :func:`roles` and :func:`quiz` on a trained run
folder, and :func:`main`, the program.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

from experiments.common.phase import main_of, stop_request
from experiments.cot.config import (
    MODELS,
    AllCommand,
    AskCommand,
    Command,
    EvalCommand,
    QuizCommand,
    RolesCommand,
    SeedsCommand,
    parse,
)
from experiments.cot.exam import ask_quiz, quiz_lines, quiz_path, write_answers
from experiments.cot.report import write_report
from experiments.cot.run_folder import (
    evaluate_run,
    load_solver,
    log,
    prepare_data,
    read_config,
    recorded_quiz,
    train,
)
from experiments.cot.seeds import seeds
from sparse_jax import cot

__all__ = ["ask", "main", "quiz", "roles", "run"]


def ask(cmd: AskCommand) -> dict[str, cot.Answer]:
    """Prints each chosen model's chain of thought, final answer and decoding time."""
    names = MODELS if cmd.model == "both" else (cmd.model,)
    answers = {}
    for name in names:
        solver = load_solver(cmd.run.dir, name, batch_size=1)
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


def quiz(cmd: QuizCommand) -> dict:
    """Asks the run folder's trained models the study's exam (``--eval.quiz``), saves their
    answers (:data:`experiments.cot.exam.ANSWERS`), rewrites the report when the folder has
    been evaluated (its ``summary.json``), prints the table and returns the saved record."""
    folder = pathlib.Path(cmd.run.dir)
    path = quiz_path(cmd.eval.quiz)
    solvers = {}
    if path.is_file():
        for name in MODELS:
            try:
                solvers[name] = load_solver(folder, name, batch_size=1)
            except FileNotFoundError:
                log(f"{folder}: no trained {name} model")
        if not solvers:
            raise ValueError(f"--run.dir {str(folder)!r} holds no trained model")
    record = ask_quiz(solvers, path)
    write_answers(folder, record)
    summary = folder / "summary.json"
    if summary.is_file():
        write_report(folder, json.loads(summary.read_text()))
        log(f"report: {folder / 'report.md'}")
    print("\n".join(quiz_lines(record, tuple(solvers) or MODELS)))
    return record


def _by_sign(role: str, text: str) -> str:
    if role != "term result":
        return role
    return f"{role}, {'negative' if text.startswith('-') else 'non-negative'}"


def roles(cmd: RolesCommand) -> dict[str, dict[str, dict[str, int]]]:
    """Prints, and returns per trained model, ``cot.reference_accuracy`` on the run's test
    split per unit of ``CotFormat(numbers=cmd.numbers)``, the terms' results split by sign (a
    run of `seeds --models` may hold one model)."""
    folder = pathlib.Path(cmd.run.dir)
    test = list(prepare_data(read_config(folder), cmd.run.cache_dir, recorded_quiz(folder)).test)
    units = cot.CotFormat(numbers=cmd.numbers)
    out = {}
    for name in MODELS:
        try:
            solver = load_solver(folder, name)
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
    answers (ask, quiz) or the counts (roles).

    Training stops early, with a checkpoint of the step each model reached, on SIGTERM or
    SIGINT (Ctrl-C, a notebook's interrupt) or after ``--run.max-minutes``: it raises
    :class:`experiments.common.phase.RunStopped`, whose ``folder`` the same command with
    ``--run.resume`` continues."""
    started = time.perf_counter()
    if isinstance(cmd, AskCommand):
        return ask(cmd)
    if isinstance(cmd, RolesCommand):
        return roles(cmd)
    if isinstance(cmd, QuizCommand):
        return quiz(cmd)
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
