"""Measuring a :class:`~.decode.Solver` on a split: :func:`evaluate` (exact match, how much of
the chain of thought is the reference's, its length, decoding time, attention density and
FLOPs, per kind), :func:`reference_accuracy` (teacher-forced accuracy per role of the token)
and :func:`most_frequent_answers` (the floor of answering without reading the question).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from sparse_jax.cot.batches import check_problem, pack, split_rows
from sparse_jax.cot.decode import Solver
from sparse_jax.cot.format import (
    BOS_ID,
    PAD_ID,
    CotFormat,
    check_format,
    encode_question,
    encode_solution,
    round_up,
)
from sparse_jax.data import linalg_cot
from sparse_jax.validation import check_int

__all__ = ["evaluate", "most_frequent_answers", "reference_accuracy"]


# Rows of one attention-statistics pass: it holds every layer's weights [B, N, T, T] at once.
_STATS_ROWS = 16


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def _steps_matched(written: Sequence[str], reference: Sequence[str]) -> int:
    """How many of the reference's step lines were written, in order, before the first line
    that differs from it."""
    matched = 0
    for mine, theirs in zip(written, reference, strict=False):
        if mine.strip() != theirs.strip():
            break
        matched += 1
    return matched


def _first_step_right(record: Mapping[str, Any]) -> bool:
    if record["reference_steps"] == 0:  # nothing to read: right when nothing was written
        return record["steps"] == 0
    return record["steps_matched"] >= 1


def reference_accuracy(
    solver: Solver,
    problems: Iterable[linalg_cot.Problem],
    *,
    batch_size: int | None = None,
    units: CotFormat | None = None,
    group: Callable[[str, str], str] | None = None,
) -> dict[str, dict[str, int]]:
    """Teacher-forced next-token accuracy on the reference solutions, by what each token
    writes: ``{role: {"right": n, "tokens": m}}`` over the roles of
    :func:`~sparse_jax.data.linalg_cot.solution_roles` (EOS counted with ``answer``), where
    ``right`` counts the tokens the model's most likely next token gets right given the
    reference before it. Exact match grades whole chains; this says which part of a step a
    model cannot write even from a right start (the row operation, the operands it copies, the
    entries it computes, the state after). Problems that do not fit ``solver.fmt`` are left
    out.

    ``units`` counts the tokens of another format instead of the model's own (e.g.
    ``CotFormat(numbers=100)``: each number once, so that models with and without numbers as
    tokens compare alike): a unit is right when every model token that overlaps it is.
    ``group(role, text)`` names the count a unit goes to (default: its role; e.g. the terms'
    negative results apart); the groups come in the order of their units' roles in ``ROLES``
    (groups of one role in the order first met).

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.cot import VOCAB_SIZE, fit_format
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> problems = [linalg_cot.generate("rref", seed) for seed in range(2)]
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> untrained = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), fit_format(problems))
      >>> counts = reference_accuracy(untrained, problems)
      >>> sum(c["tokens"] for c in counts.values()) == sum(
      ...     encode_solution(p.solution_text()).size for p in problems)
      True
      >>> def sign(role, text):  # the entries that are negative numbers, apart
      ...     return f"{role}, negative" if text.startswith("-") else role
      >>> per_number = reference_accuracy(untrained, problems, units=CotFormat(numbers=10),
      ...                                 group=sign)
      >>> per_number["state, negative"]["tokens"] < counts["state"]["tokens"]
      True
    """
    if not isinstance(solver, Solver):
        raise TypeError(
            f"reference_accuracy: `solver` must be a Solver; got {type(solver).__name__}"
        )
    problems = [check_problem(p, "reference_accuracy") for p in problems]
    size = check_int(
        solver.batch_size if batch_size is None else batch_size, "batch_size", "reference_accuracy"
    )
    if group is not None and not callable(group):
        raise TypeError(f"reference_accuracy: `group` must be callable; got {type(group).__name__}")
    fmt = solver.fmt
    units = fmt if units is None else check_format(units, "reference_accuracy")
    fits = [
        p
        for p in problems
        if encode_question(p.question, fmt).size <= fmt.source_len
        and encode_solution(p.solution_text(), fmt).size <= fmt.target_len
    ]
    counts: dict[str, dict[str, int]] = {}
    roles: dict[str, int] = {}  # each group's role, as its place in ROLES
    for start in range(0, len(fits), size):
        part = fits[start : start + size]
        rows = pack([part[r % len(part)] for r in range(size)], fmt)  # one compiled shape
        batch = split_rows(jnp.asarray(rows), fmt.source_len)
        predicted = solver.next_tokens(batch.source, batch.source_lengths, batch.target_in)
        target = np.asarray(batch.target_out)
        for r, p in enumerate(part):
            text = p.solution_text()
            data, written = text.encode("utf-8"), linalg_cot.solution_roles(text)
            own = fmt.tokens(text)[1]
            right = predicted[r, : own.size + 1] == target[r, : own.size + 1]  # EOS last
            starts = own if units == fmt else units.tokens(text)[1]
            ends = np.append(starts[1:], len(data))
            # The model tokens that overlap each unit: from the last starting at or before
            # its first byte to the last starting before its end.
            first = np.searchsorted(own, starts, side="right") - 1
            last = np.searchsorted(own, ends, side="left") - 1
            found = [
                (written[a], data[a:b].decode("utf-8", errors="replace"), right[i : j + 1].all())
                for a, b, i, j in zip(starts, ends, first, last, strict=True)
            ]
            # A unit writes what its first byte does (a number's first digit).
            for role, piece, ok in [*found, ("answer", "", right[own.size])]:
                name = role if group is None else str(group(role, piece))
                entry = counts.setdefault(name, {"right": 0, "tokens": 0})
                entry["right"] += bool(ok)
                entry["tokens"] += 1
                roles.setdefault(name, linalg_cot.ROLES.index(role))
    return {name: counts[name] for name in sorted(counts, key=roles.__getitem__)}


# Computed answers first, then answers in words (each in linalg_cot's order).
_ALL_KINDS = linalg_cot.KINDS + linalg_cot.DESCRIPTIVE_KINDS


def _parts(final: str | None, problem: linalg_cot.Problem) -> dict[str, bool] | None:
    """A descriptive problem's answer graded by parts (linalg_cot.grade_parts; every part
    wrong when there is no final answer); None for a computed answer (graded whole)."""
    if problem.kind not in linalg_cot.DESCRIPTIVE_KINDS:
        return None
    parts = linalg_cot.grade_parts(final or "", problem.answer)
    return parts if final is not None else dict.fromkeys(parts, False)


def _correct(final: str, problem: linalg_cot.Problem) -> bool:
    """Whether ``final`` answers ``problem``: every part right (an answer in words), else
    linalg_cot.grade."""
    parts = _parts(final, problem)
    return all(parts.values()) if parts is not None else linalg_cot.grade(final, problem.answer)


def evaluate(
    solver: Solver,
    problems: Iterable[linalg_cot.Problem],
    *,
    batch_size: int | None = None,
    stats_multiple: int = 64,
    repeats: int = 1,
) -> dict[str, Any]:
    """Decodes ``problems`` with ``solver`` (batches of one kind) and measures its answers.

    Returns a JSON-ready dict: ``records`` (per problem, in order: kind, question, reference
    and predicted final answer, ``correct`` = :func:`~sparse_jax.data.linalg_cot.grade` (for
    an answer in words, ``linalg_cot.DESCRIPTIVE_KINDS``: every part right, and ``parts`` the
    verdict per part of :func:`~sparse_jax.data.linalg_cot.grade_parts`; None otherwise),
    ``first_divergence``, the decoded text, steps and tokens and the reference's, finished,
    seconds, flops, error),
    ``kinds`` (per kind, in :data:`~sparse_jax.data.linalg_cot.KINDS` order, then the
    descriptive kinds) and ``overall``
    (all problems), each with:

    * ``questions``, ``exact_match`` (fraction correct), ``answered`` (fraction with an
      ``Answer:`` line), ``finished`` (fraction that ended with EOS);
    * ``chain_match`` (fraction whose whole solution is the reference's: every step line and
      the final answer), ``first_step`` (fraction whose first step line is the reference's: the
      question read right) and ``steps_matched`` (mean fraction of the reference's step lines
      written before the first that differs): whether the model reasons, beside whether its
      final answer is right (an answer can be right after wrong steps, or guessed);
    * ``divergences``: where the chains that differ from the reference first leave it, the
      number of chains per :func:`~sparse_jax.data.linalg_cot.first_divergence` (such as
      ``"row combination: result"``), most frequent first;
    * ``steps`` / ``reference_steps``, ``tokens`` / ``reference_tokens``: mean chain-of-thought
      length in step lines (the ``Answer:`` line not counted) and in tokens (EOS included);
    * ``seconds_per_question``: the decoding's wall time over the questions (each batch's time
      the median of ``repeats`` decodings);
    * ``flops_per_question``: mean ``model.flops(question tokens, decoded tokens)["total"]``
      (a teacher-forced pass over the question and the chain of thought written; every entry
      a mask allows is counted);
    * ``attention``: ``model(..., return_stats=True)`` on what the decoder read (BOS and the
      chain of thought it wrote, teacher-forced; a batch padded to the next multiple of
      ``stats_multiple`` tokens, whose padding rows count too), the mean over questions of
      each statistic (``*_nonzero``: fraction of keys with a non-zero weight; ``*_allowed``:
      fraction the masks allow);
    * ``reference_roles``: :func:`reference_accuracy` on the reference solutions, per role
      ``{"accuracy": fraction right, "tokens": count}``.

    A problem the solver cannot read (too long for its format) is counted as wrong, with its
    ``error``.

    Example:
      >>> from flax import nnx
      >>> from sparse_jax.cot import VOCAB_SIZE, fit_format
      >>> from sparse_jax.models.encdec import EncDecConfig, EncoderDecoder
      >>> problems = [linalg_cot.generate("rref", seed) for seed in range(2)]
      >>> cfg = EncDecConfig(vocab_size=VOCAB_SIZE, d_model=8, num_heads=2, d_ff=16, cot_steps=0)
      >>> untrained = Solver(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), fit_format(problems))
      >>> result = evaluate(untrained, problems)
      >>> result["kinds"]["rref"]["questions"], result["overall"]["exact_match"]
      (2, 0.0)
    """
    if not isinstance(solver, Solver):
        raise TypeError(f"evaluate: `solver` must be a Solver; got {type(solver).__name__}")
    problems = [check_problem(p, "evaluate") for p in problems]
    size = solver.batch_size if batch_size is None else batch_size
    size = check_int(size, "batch_size", "evaluate")
    multiple = check_int(stats_multiple, "stats_multiple", "evaluate")
    repeats = check_int(repeats, "repeats", "evaluate")
    model, fmt = solver.model, solver.fmt
    flops = functools.cache(lambda s, t: model.flops(s, t)["total"])
    records: list[dict[str, Any] | None] = [None] * len(problems)
    weighted: dict[str, dict[str, list[tuple[float, int]]]] = {}
    roles: dict[str, dict[str, dict[str, int]]] = {}
    order = [k for k in _ALL_KINDS if any(p.kind == k for p in problems)]
    order += sorted({p.kind for p in problems} - set(order))
    for kind in order:
        index = [i for i, p in enumerate(problems) if p.kind == kind]
        roles[kind] = reference_accuracy(solver, [problems[i] for i in index], batch_size=size)
        for start in range(0, len(index), size):
            part = index[start : start + size]
            decoded = solver.decode([problems[i].question for i in part], size, repeats)
            for i, (answer, _) in zip(part, decoded, strict=True):
                p = problems[i]
                ref = encode_solution(p.solution_text(), fmt)
                parts = _parts(answer.final, p)
                correct = (
                    all(parts.values())
                    if parts is not None
                    else answer.final is not None and linalg_cot.grade(answer.final, p.answer)
                )
                matched = _steps_matched(answer.steps, p.steps)
                records[i] = {
                    "kind": p.kind,
                    "question": p.question,
                    "reference": p.answer,
                    "final": answer.final,
                    "correct": correct,
                    "parts": parts,
                    "chain_correct": correct and tuple(answer.steps) == tuple(p.steps),
                    "steps_matched": matched,
                    "first_divergence": linalg_cot.first_divergence(answer.steps, p.steps),
                    "text": answer.text,
                    "steps": len(answer.steps),
                    "reference_steps": len(p.steps),
                    "tokens": answer.tokens,
                    "reference_tokens": int(ref.size),
                    "finished": answer.finished,
                    "seconds": answer.seconds,
                    "flops": (
                        None
                        if answer.error
                        else flops(
                            encode_question(p.question.strip(), fmt).size, max(answer.tokens, 1)
                        )
                    ),
                    "error": answer.error,
                }
            ok = [(i, ids) for i, (_, ids) in zip(part, decoded, strict=True) if ids is not None]
            if not ok:
                continue
            # The inputs the decoder read: BOS, then all it wrote but the last token.
            longest = max(ids.size for _, ids in ok)
            t = min(round_up(longest, multiple), fmt.target_len)
            for first in range(0, len(ok), _STATS_ROWS):
                rows = ok[first : first + _STATS_ROWS]
                source = np.full((_STATS_ROWS, fmt.source_len), PAD_ID, np.int32)
                lengths = np.ones((_STATS_ROWS,), np.int32)
                target_in = np.full((_STATS_ROWS, t), PAD_ID, np.int32)
                for r in range(_STATS_ROWS):  # padding rows repeat the real ones
                    i, ids = rows[r % len(rows)]
                    q = encode_question(problems[i].question.strip(), fmt)
                    source[r, : q.size], lengths[r] = q, q.size
                    target_in[r, 0] = BOS_ID
                    target_in[r, 1 : ids.size] = ids[:-1]
                stats = solver.attention_stats(source, lengths, target_in)
                for name, value in stats.items():
                    weighted.setdefault(kind, {}).setdefault(name, []).append((value, len(rows)))

    def summary(rows: list[dict[str, Any]], kinds: Sequence[str]) -> dict[str, Any]:
        decoded = [r for r in rows if r["error"] is None]
        attention: dict[str, float] = {}
        names = sorted({n for k in kinds for n in weighted.get(k, {})})
        for name in names:
            pairs = [pair for k in kinds for pair in weighted.get(k, {}).get(name, [])]
            attention[name] = sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1)
        counts = {
            role: [
                sum(roles[k].get(role, {}).get(n, 0) for k in kinds) for n in ("right", "tokens")
            ]
            for role in linalg_cot.ROLES
        }
        return {
            "questions": len(rows),
            "exact_match": _mean([float(r["correct"]) for r in rows]),
            "chain_match": _mean([float(r["chain_correct"]) for r in rows]),
            "first_step": _mean([float(_first_step_right(r)) for r in rows]),
            "steps_matched": _mean(
                [
                    r["steps_matched"] / r["reference_steps"]
                    if r["reference_steps"]
                    else float(r["steps"] == 0)
                    for r in rows
                ]
            ),
            "divergences": dict(
                collections.Counter(
                    r["first_divergence"] for r in rows if r["first_divergence"] is not None
                ).most_common()
            ),
            "answered": _mean([float(r["final"] is not None) for r in rows]),
            "finished": _mean([float(r["finished"]) for r in rows]),
            "steps": _mean([r["steps"] for r in rows]),
            "reference_steps": _mean([r["reference_steps"] for r in rows]),
            "tokens": _mean([r["tokens"] for r in rows]),
            "reference_tokens": _mean([r["reference_tokens"] for r in rows]),
            "seconds_per_question": sum(r["seconds"] for r in rows) / max(len(rows), 1),
            "flops_per_question": _mean([r["flops"] for r in decoded]),
            "errors": len(rows) - len(decoded),
            "attention": attention,
            "reference_roles": {
                role: {"accuracy": right / tokens, "tokens": tokens}
                for role, (right, tokens) in counts.items()
                if tokens
            },
        }

    done = [r for r in records if r is not None]
    return {
        "model": solver.name,
        "kinds": {k: summary([r for r in done if r["kind"] == k], [k]) for k in order},
        "overall": summary(done, order),
        "records": done,
    }


def most_frequent_answers(
    train: Iterable[linalg_cot.Problem], test: Iterable[linalg_cot.Problem]
) -> dict[str, dict[str, Any]]:
    """Exact match without reading the question: per kind, the final answer most frequent among
    the ``train`` problems (ties: the one seen first), graded against each ``test`` problem of
    that kind. A floor for :func:`evaluate`'s exact match: a model that scores it has learned
    the answers' frequencies, not to solve (a kind asking "always, sometimes or never" has
    three answers; a small rref's is often the identity).

    Returns per kind of ``test`` (in :data:`~sparse_jax.data.linalg_cot.KINDS` order, then the
    descriptive kinds; an answer in words right when every part is) and for
    ``"overall"``: ``answer`` (None for the overall, and for a kind with no training problem,
    which then scores 0), ``questions`` and ``exact_match``.

    Example:
      >>> train = [linalg_cot.generate("solvability", seed) for seed in range(40)]
      >>> test = [linalg_cot.generate("solvability", seed) for seed in range(40, 60)]
      >>> prior = most_frequent_answers(train, test)
      >>> prior["solvability"]["answer"] in ("always", "sometimes but not always", "never")
      True
      >>> prior["overall"]["questions"], 0 < prior["overall"]["exact_match"] < 1
      (20, True)
    """
    train = [check_problem(p, "most_frequent_answers") for p in train]
    test = [check_problem(p, "most_frequent_answers") for p in test]
    counts: dict[str, collections.Counter] = {}
    for p in train:
        counts.setdefault(p.kind, collections.Counter())[p.answer] += 1
    kinds = [k for k in _ALL_KINDS if any(p.kind == k for p in test)]
    result: dict[str, dict[str, Any]] = {}
    hits: list[float] = []
    for kind in kinds:
        answer = counts[kind].most_common(1)[0][0] if kind in counts else None
        right = [float(answer is not None and _correct(answer, p)) for p in test if p.kind == kind]
        hits += right
        result[kind] = {"answer": answer, "questions": len(right), "exact_match": _mean(right)}
    result["overall"] = {"answer": None, "questions": len(hits), "exact_match": _mean(hits)}
    return result
