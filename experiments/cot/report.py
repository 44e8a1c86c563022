"""``report.md`` and its plots for a chain-of-thought run folder, from its ``summary.json``
(:func:`write_report`), and the tables the seeds command's ``seeds.md`` shares with it
(:func:`divergence_table`, :func:`roles_table`).
"""

from __future__ import annotations

import collections
import json
import pathlib
from collections.abc import Iterator

import numpy as np

from experiments.cot.config import MODELS
from experiments.cot.exam import quiz_lines, read_answers
from sparse_jax.data import linalg_cot
from sparse_jax.files import replace_atomically, write_text_atomically
from sparse_jax.models.encdec import EncDecConfig

__all__ = [
    "DIVERGENCES_TEXT",
    "ROLES_TEXT",
    "alpha_lines",
    "divergence_table",
    "kind_figures",
    "pct",
    "roles_table",
    "write_report",
]


_COMPARISON_TEXT = (
    "Sparse against dense on the same test questions (experiments.common.stats). Exact match "
    "with its 95% interval (Wilson); sparse minus dense in points with its 95% interval "
    "(Newcombe's interval for paired proportions); the questions that only one of the two "
    "answers right, each way, and McNemar's exact p-value on them: how often a fair coin would "
    "split them at least this unevenly (small when one model is really the better); the ratio "
    "of decoding times per question."
)


def _comparison_lines(cmp: dict) -> list[str]:
    """The report's paragraph and table comparing the two models (``summary.json``'s
    ``comparison``: :func:`experiments.cot.run_folder.evaluate_run`)."""
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


def alpha_lines(alphas: dict[str, list[float]] | None) -> list[str]:
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


def kind_figures(result: dict, kind: str) -> dict:
    """One kind's figures of a ``cot.evaluate`` result, or the whole split's (``"overall"``)."""
    return result["overall"] if kind == "overall" else result["kinds"][kind]


def _per_kind(s: dict, kinds: list[str]) -> Iterator[tuple[str, dict, dict]]:
    """Each kind, then ``"overall"``, with the sparse and the dense model's figures for it: the
    rows of the report's tables."""
    sp, dn = s["evaluation"]["sparse"], s["evaluation"]["dense"]
    for k in [*kinds, "overall"]:
        yield k, kind_figures(sp, k), kind_figures(dn, k)


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal: ``0.4567`` is ``45.7%``."""
    return f"{100 * x:.1f}%"


DIVERGENCES_TEXT = (
    "Where the chains of thought first leave the reference's steps "
    "(linalg_cot.first_divergence: the reference's step type, and whether the model did another "
    "operation there, got the state or deduction after it wrong, or stopped), the three most "
    "frequent per kind, with how many chains differ:"
)


ROLES_TEXT = (
    "Teacher-forced next-token accuracy on the reference chains of the test split "
    "(cot.reference_accuracy: the model's most likely next token given the reference before "
    "it), by what the token writes (linalg_cot.solution_roles: the operation, the state or "
    "deduction after it, the answer line; in chains that write their row arithmetic, the "
    "terms' operands, factors, products and results), {models}:"
)


def roles_table(results: dict[str, list[dict]], kinds: list[str]) -> list[str]:
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
                figures = [kind_figures(r, k)["reference_roles"] for r in rs]
                means.append(
                    "-"
                    if not figures or any(role not in f for f in figures)
                    else f"{100 * np.mean([f[role]['accuracy'] for f in figures]):.1f}"
                )
            cells.append(" / ".join(means))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def divergence_table(results: dict[str, list[dict]], kinds: list[str], most: int = 3) -> list:
    """Markdown lines: per kind, each model's most frequent first divergences from the reference
    (``cot.evaluate``'s ``divergences``) summed over its ``results``; [] when none has them
    (evaluations from before they were counted)."""
    if not any(
        "divergences" in kind_figures(r, k) for rs in results.values() for r in rs for k in kinds
    ):
        return []
    lines = ["| kind | " + " | ".join(results) + " |", "|:--|" + ":--|" * len(results)]
    for k in kinds:
        cells = []
        for rs in results.values():
            total: collections.Counter = collections.Counter()
            for r in rs:
                total.update(kind_figures(r, k).get("divergences", {}))
            questions = sum(kind_figures(r, k)["questions"] for r in rs)
            top = sorted(total.items(), key=lambda item: (-item[1], item[0]))[:most]
            cells.append(
                f"{sum(total.values())} of {questions} differ"
                + "".join(f"{', ' if i else ': '}{label} ({n})" for i, (label, n) in enumerate(top))
            )
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def write_report(folder: pathlib.Path, s: dict) -> None:
    """Writes ``report.md``, ``figure3.png`` and ``loss.png`` in ``folder`` from its summary
    ``s`` (``summary.json``: :func:`experiments.cot.run_folder.evaluate_run`), ending with the
    table of the study's exam from the folder's saved answers (:mod:`experiments.cot.exam`)."""
    ev = s["evaluation"]
    kinds = list(ev["sparse"]["kinds"])
    _plots(folder, s, kinds)
    both = {"sparse": [ev["sparse"]], "dense": [ev["dense"]]}
    lines = [*_data_lines(s, kinds), "", *_correctness_table(s, kinds)]
    divergences = divergence_table(both, kinds)
    if divergences:
        lines += ["", DIVERGENCES_TEXT, "", *divergences]
    if roles := roles_table(both, [*kinds, "overall"]):
        lines += ["", ROLES_TEXT.format(models="sparse / dense"), "", *roles]
    lines += ["", *_cost_table(s, kinds)]
    lines += ["", *_comparison_lines(s["comparison"])]
    lines += ["", *_density_table(s, kinds)]
    lines += ["", *_model_lines(s)]
    lines += [*quiz_lines(read_answers(folder)), ""]
    write_text_atomically(folder / "report.md", "\n".join(lines))


def _plots(folder: pathlib.Path, s: dict, kinds: list[str]) -> None:
    """``figure3.png`` (per kind: exact match, chain-of-thought length, decoding time, decoder
    self-attention density, both models) and, when ``metrics.jsonl`` exists, ``loss.png``."""
    from matplotlib.figure import Figure

    ev = s["evaluation"]
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
    replace_atomically(folder / "figure3.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
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
        replace_atomically(folder / "loss.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png"))


# Every kind a run may train: the computed ones and those answered in words.
ALL_KINDS = (*linalg_cot.KINDS, *linalg_cot.DESCRIPTIVE_KINDS)


def _data_lines(s: dict, kinds: list[str]) -> list[str]:
    """The report's title and what was trained and tested: kinds, sizes, splits, the format,
    the distinct training questions."""
    fmt = s["format"]
    return [
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
            if set(kinds) >= set(ALL_KINDS)
            else f": {len(kinds)} of the {len(ALL_KINDS)} kinds (--data.kinds), the "
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
    ]


def _correctness_table(s: dict, kinds: list[str]) -> list[str]:
    """What the correctness figures mean, and per kind both models' exact match beside the most
    frequent answer's, chains right, first steps right and steps matched."""
    lines = [
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
    for k, a, b in _per_kind(s, kinds):
        lines.append(
            f"| {k} | {pct(a['exact_match'])} | {pct(b['exact_match'])} | "
            f"{pct(prior[k]['exact_match'])} | "
            + " | ".join(
                pct(r[name])
                for name in ("chain_match", "first_step", "steps_matched")
                for r in (a, b)
            )
            + " |"
        )
    return lines


def _cost_table(s: dict, kinds: list[str]) -> list[str]:
    """What the cost figures mean, and per kind both models' chain-of-thought steps and tokens
    beside the reference's, decoding time and FLOPs per question."""
    lines = [
        "Cost. Steps: the chain of thought's step lines (the answer line not counted). "
        "Decoding: greedy with the key/value cache on one batch per kind, stopping when every "
        "question has ended; time per question = the batch's wall time (median of "
        f"{s['eval_repeats']}) / its questions (compilation excluded).",
        "",
        "| kind | steps sparse / dense / ref | tokens sparse / dense / ref | decode ms/question "
        "sparse | dense | GFLOPs/question sparse | dense |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for k, a, b in _per_kind(s, kinds):
        lines.append(
            f"| {k} | "
            f"{a['steps']:.1f} / {b['steps']:.1f} / {a['reference_steps']:.1f} | "
            f"{a['tokens']:.0f} / {b['tokens']:.0f} / {a['reference_tokens']:.0f} | "
            f"{1e3 * a['seconds_per_question']:.2f} | {1e3 * b['seconds_per_question']:.2f} | "
            f"{a['flops_per_question'] / 1e9:.3f} | {b['flops_per_question'] / 1e9:.3f} |"
        )
    return lines


def _density_table(s: dict, kinds: list[str]) -> list[str]:
    """Per kind, both models' fraction of allowed keys with a non-zero weight in each kind of
    attention."""
    lines = [
        "Attention density: the fraction of keys with a non-zero weight (of those the masks "
        "allow) in the decoded chains of thought, teacher-forced:",
        "",
        "| kind | encoder sparse | dense | decoder self sparse | dense | cross sparse | dense |",
        "|:--|--:|--:|--:|--:|--:|--:|",
    ]
    for k, a, b in _per_kind(s, kinds):
        cells = [
            f"{_density(r, part):.3f}"
            for part in ("encoder", "decoder_self", "decoder_cross")
            for r in (a, b)
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _model_lines(s: dict) -> list[str]:
    """The models (switches, parameters, sizes, updates), how FLOPs are counted, the device and
    wall times, the learned α, the longest question and solution per kind, and the plots."""
    models, lengths = s["models"], s["lengths"]
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
    return [
        f"Sparse switches: {models['sparse']['switches']}; {parameters} (d_model "
        f"{config.d_model}, {config.encoder_layers} + {config.decoder_layers} layers, "
        f"{config.cot_steps} CoT steps; both models: {config.positions} positions, "
        f"cross-attention queries from {queries[config.cross_queries]}), trained "
        f"{models['sparse']['trained_steps']} / {models['dense']['trained_steps']} updates. "
        "FLOPs: model.flops(question tokens, decoded tokens), a teacher-forced pass counting every "
        "entry the masks allow (sparsemax's zero weights are not subtracted). Device "
        f"{s['device']}; this command's wall time {s['wall_time_s']:.0f} s; phases: {phases}.",
        *alpha_lines(models["sparse"].get("learned_alphas")),
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
