"""``report.md`` and its plots for a distillation run folder (``python -m experiments.distill.report
<run-dir>`` rewrites them from ``metrics.jsonl`` and ``summary.json``)."""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
from matplotlib.patches import Rectangle

from sparse_jax.files import replace_atomically

__all__ = ["write_report"]


def _flops(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}"


def _seconds(summary) -> str:
    parts = summary.get("phase_seconds") or {}
    if not parts:
        return ""
    return " (" + ", ".join(f"{k} {v:.0f} s" for k, v in parts.items()) + ")"


def _read_metrics(run_dir: pathlib.Path) -> dict[str, list[dict]]:
    phases: dict[str, list[dict]] = collections.defaultdict(list)
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                phases[record.get("phase", "?")].append(record)
    return phases


def _plot_curves(phases, out: pathlib.Path) -> bool:
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    drawn = False
    offset = 0
    for phase in ("teacher", "student", "hardened"):
        rows = [r for r in phases.get(phase, []) if "loss" in r]
        if not rows:
            continue
        steps = [offset + r["step"] for r in rows]
        axes[0].plot(steps, [r["loss"] for r in rows], label=f"{phase} loss", lw=1)
        if phase != "teacher":
            axes[1].plot(steps, [r.get("kl", float("nan")) for r in rows], label=f"{phase} KL")
            evals = [r for r in rows if "eval_kl" in r]
            axes[1].plot(
                [offset + r["step"] for r in evals],
                [r["eval_kl"] for r in evals],
                "o",
                label=f"{phase} eval KL",
            )
        offset = steps[-1] if phase != "teacher" else 0
        drawn = True
    axes[0].set_xlabel("update")
    axes[0].set_title("training loss (teacher: cross-entropy; students: KL + penalties)")
    axes[1].set_xlabel("update (student, then hardened fine-tune)")
    axes[1].set_title("KL(teacher || student), nats/token")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return drawn


def _plot_weights(phases, candidates, out: pathlib.Path) -> bool:
    rows = [r for r in phases.get("student", []) if any(k.startswith("w/") for k in r)]
    if not rows:
        return False
    blocks = sorted({k.split("/")[1] for k in rows[0] if k.startswith("w/")})
    fig = Figure(figsize=(3.2 * len(blocks), 3.2))
    axes = fig.subplots(1, len(blocks), squeeze=False)
    for ax, block in zip(axes[0], blocks, strict=True):
        keys = sorted(
            (k for k in rows[0] if k.startswith(f"w/{block}/")), key=lambda k: int(k[-1:])
        )
        for j, key in enumerate(keys):
            label = _short(candidates[j]) if j < len(candidates) else key
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=label, lw=1)
        ax.set_title(block)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("candidate weight, mean over heads")
    axes[0][-1].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return True


def _short(mask: str) -> str:
    """A mask's repr shortened for a label: causal windows as ``window(w)`` (w keys), causal
    sinks as ``sink(n)``, unions with ``|``.

    Example: ``_short("((Sink(n=4) & Causal()) | (Causal() & Local(left=7, right=0)))")`` is
    ``"sink(4) | window(8)"``."""
    text = re.sub(r"\(Sink\(n=(\d+)\) & Causal\(\)\)", r"sink<\1>", mask)
    text = re.sub(
        r"\(Causal\(\) & Local\(left=(\d+), right=0\)\)",
        lambda m: f"window<{int(m.group(1)) + 1}>",
        text,
    )
    text = re.sub(r"Strided\(stride=(\d+)\)", r"strided<\1>", text)
    text = text.replace("Causal()", "causal")
    if re.fullmatch(r"[()a-z<>\d |]+", text):  # a union of the names above: drop its grouping
        text = text.replace("(", "").replace(")", "")
    return text.replace("<", "(").replace(">", ")")


def _plot_head_weights(summary, out: pathlib.Path) -> bool:
    """The student's final candidate weights, one row per head (all blocks), one column per
    candidate; a planted teacher's candidates are outlined."""
    weights = summary.get("candidate_weights") or {}
    rows, labels, planted = [], [], []
    for block, per_head in weights.items():
        for h, w in enumerate(per_head):
            rows.append(w)
            labels.append(f"{block} h{h}" if len(per_head) > 1 else block)
            pairs = (summary.get("planted") or {}).get(block)
            planted.append(pairs[h][0] if pairs and h < len(pairs) else None)
    if not rows:
        return False
    candidates = summary.get("candidates") or [f"c{j}" for j in range(len(rows[0]))]
    fig = Figure(figsize=(1.1 * len(candidates) + 2.5, 0.28 * len(rows) + 1.6))
    ax = fig.subplots()
    image = ax.imshow(rows, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for r, c in enumerate(planted):
        if c is not None:
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.set_xticks(range(len(candidates)), [_short(c) for c in candidates], fontsize=6)
    ax.tick_params(axis="x", labelrotation=30)
    fig.colorbar(image, ax=ax, label="weight")
    fig.tight_layout()
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return True


def _plot_block_maps(summary, out: pathlib.Path) -> bool:
    """Each hardened head's block map at the serving length: the key blocks (columns) the
    kernel computes for each query block (rows); dark = skipped."""
    maps = summary.get("hardened_block_maps") or {}
    blocks = maps.get("blocks") or []
    width = max((len(heads) for heads in blocks), default=0)
    if not width:
        return False
    fig = Figure(figsize=(1.7 * width, 1.8 * len(blocks)))
    axes = fig.subplots(len(blocks), width, squeeze=False)
    for i, heads in enumerate(blocks):
        for h in range(width):
            ax = axes[i][h]
            ax.set_xticks([])
            ax.set_yticks([])
            if h >= len(heads):
                ax.axis("off")
                continue
            ax.imshow(heads[h]["map"], vmin=0, vmax=2, cmap="Greys")
            computed = sum(v > 0 for row in heads[h]["map"] for v in row)
            size = heads[h].get("block_size", ["?"])[0]
            ax.set_title(f"{_short(heads[h]['mask'])}\n{computed} blocks of {size}", fontsize=6)
            if h == 0:
                ax.set_ylabel(f"block {i}", fontsize=7)
    fig.suptitle(
        f"kept blocks per head at n = {maps['seq_len']} (grey: partial, black: full)", fontsize=8
    )
    fig.tight_layout()
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return True


def _planted_lines(summary) -> list[str]:
    """The planted-teacher section: per head the planted and the picked candidate."""
    if "planted" not in summary:
        return []
    names = summary.get("candidates") or []

    def name(j):
        return f"`{_short(names[j])}`" if 0 <= j < len(names) else str(j)

    lines = ["## Planted masks: did the student find them?", ""]
    lines += [
        f"The teacher was trained with one candidate mask per head; the student, starting from "
        f"its weights with every candidate open, learned exactly the planted mask (the union "
        f"of the candidates its weights keep at --harden.threshold) in "
        f"**{summary['planted_recovered']:.0%}** of the heads, put its largest weight on the "
        f"planted candidate in {summary['planted_strongest']:.0%}, and hardening by threshold "
        f"gave exactly the planted mask in {summary['planted_hardened']:.0%}.",
        "",
    ]
    swap_kl = summary.get("planted_swap_kl")
    head = "| block | head | planted | picked (kept candidates) | weight of the planted |"
    rule = "|:--|--:|:--|:--|--:|"
    if swap_kl is not None:
        tol = summary["planted_tolerance"]
        lines += [
            f"Counting as equivalent a picked candidate that costs no more kernel blocks than "
            f"the planted one and, swapped into the teacher in place of the planted mask, "
            f"changes the teacher's output by at most {tol:g} nats/token (the *swap KL*): "
            f"**{summary['planted_equivalent']:.0%}** of the heads picked the planted candidate "
            f"or an equivalent one. *Nearest* is the smallest swap KL of any other candidate: "
            f"where it is below the tolerance, the data cannot tell the planted mask apart.",
            "",
        ]
        head += " swap KL of the picked | nearest other |"
        rule += "--:|--:|"
    excess = summary.get("planted_score_excess")
    if excess is not None:
        lines += [
            "*Excess* is how far the teacher's scores on the keys a head's planted mask excludes "
            "rise above the ones it attends to (median over queries of the largest excluded "
            "scaled score minus the log-sum-exp of the allowed ones, nats; – for causal heads): "
            "a log-bias on the scores (`soft_union`, `soft_mask`) silences those keys only with "
            "a weight of about exp(-excess), so where it is large the KL stays flat in the "
            "weights until they reach exactly 0.",
            "",
        ]
        head += " excess |"
        rule += "--:|"
    lines += [head, rule]
    weights = summary.get("candidate_weights") or {}
    support = summary.get("planted_support") or {}
    swaps = summary.get("planted_swaps")
    for i, (block, pairs) in enumerate(summary["planted"].items()):
        for h, (want, got) in enumerate(pairs):
            w = weights.get(block, [[]])
            w = w[h] if h < len(w) else w[0]
            share = f"{w[want]:.3f}" if want < len(w) else "?"
            mark = "" if want == got else " ✗"
            kept = support.get(block, [])
            kept = " ∪ ".join(name(c) for c in kept[h]) if h < len(kept) else ""
            picked = name(got) if got >= 0 else "no single candidate"
            if kept and kept != picked:
                picked += f" ({kept})"
            row = f"| {block} | {h} | {name(want)} | {picked}{mark} | {share} |"
            if swap_kl is not None:
                others = [kl for c, kl in enumerate(swaps[i][h]) if c != want]
                kl = swap_kl[block][h]
                row += f" {'–' if kl is None else f'{kl:.4f}'} | {min(others):.4f} |"
            if excess is not None:
                e = excess[block][h]
                row += f" {'–' if e is None else f'{e:.1f}'} |"
            lines.append(row)
    return [*lines, ""]


def _hardening_lines(summary) -> list[str]:
    """Threshold against budget hardening (a run with --harden.budget), before fine-tuning."""
    h = summary.get("hardening")
    if not h:
        return []
    b, t = h["budget"], h["threshold"]
    ratio = t["kl"] / b["kl"] if b["kl"] > 0 else float("inf")
    n = summary.get("serve_len", "?")
    return [
        "### Hardening by threshold against hardening by the budget",
        "",
        "The same student hardened both ways, before any fine-tune: does its learned ranking "
        "alone (threshold, no budget) give the budget's quality?",
        "",
        f"| hardened by | KL(teacher ‖ ·), nats/token | attention FLOPs at n={n} |",
        "|:--|--:|--:|",
        f"| --harden.budget | {b['kl']:.4f} | {_flops(b['attention_flops'])} |",
        f"| threshold (no budget) | {t['kl']:.4f} | {_flops(t['attention_flops'])} |",
        "",
        f"Threshold KL / budget KL: {ratio:.2f}.",
        "",
    ]


def _plot_density(summary, out: pathlib.Path) -> bool:
    density = summary.get("hardened_layer_density")
    if not density:
        return False
    speed = next(iter(summary["speed"].values()))
    fig = Figure(figsize=(5, 3))
    ax = fig.subplots()
    x = range(len(density))
    ax.bar([i - 0.2 for i in x], [speed["teacher_density"]] * len(density), 0.4, label="teacher")
    ax.bar([i + 0.2 for i in x], density, 0.4, label="hardened student")
    ax.set_xlabel("block")
    ax.set_ylabel("attention density")
    ax.set_xticks(list(x))
    ax.legend(fontsize=8)
    fig.tight_layout()
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return True


def _plot_recall(summary, out: pathlib.Path) -> bool:
    """A needle heat-map per model: passkey exact match by length (rows) and depth (columns)."""
    table = summary.get("recall") or {}
    models, lengths = table.get("models") or {}, table.get("lengths") or []
    if not models:
        return False
    depths = sorted({key.split("@")[1] for scores in models.values() for key in scores})
    fig = Figure(figsize=(2.2 * len(models) + 0.8, 0.5 * len(lengths) + 1.4))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, (name, scores) in zip(axes, models.items(), strict=True):
        grid = [[scores[f"{n}@{d}"] for d in depths] for n in lengths]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7,
                        color="black" if value > 0.5 else "white")  # fmt: skip
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(depths)), depths, fontsize=7)
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_xlabel("depth", fontsize=8)
    axes[0].set_ylabel("length (tokens)", fontsize=8)
    fig.colorbar(image, ax=list(axes), fraction=0.05)
    replace_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return True


def _recall_lines(summary) -> list[str]:
    """The recall table: per model and length, the passkey exact match at each depth."""
    table = summary.get("recall") or {}
    if not table.get("models"):
        return []
    depths = sorted({key.split("@")[1] for scores in table["models"].values() for key in scores})
    lines = ["## Recall (passkey in held-out text, exact match of the greedy answer)", ""]
    lines += ["| model | n | " + " | ".join(f"depth {d}" for d in depths) + " | mean |"]
    lines += ["|:--|--:|" + "--:|" * (len(depths) + 1)]
    for name, scores in table["models"].items():
        for n in table["lengths"]:
            cells = [scores[f"{n}@{d}"] for d in depths]
            row = " | ".join(f"{x:.0%}" for x in cells)
            lines.append(f"| {name} | {n} | {row} | {sum(cells) / len(cells):.0%} |")
    lines += ["", "Depth: where the key is stated, as a fraction of the text around it."]
    if table.get("sequences"):  # runs of before the count was recorded lack it
        each = table["sequences"] / len(depths)
        lines += [f"{table['sequences']} sequences per length, {each:.3g} at each depth "
                  "(--measure.recall-sequences)."]  # fmt: skip
    fraction = summary.get("student_recall_fraction")
    if fraction is not None:
        lines += [f"The student's batches held {fraction:.0%} passkey sequences "
                  "(--train.recall-fraction)."]  # fmt: skip
    return [*lines, ""]


def write_report(run_dir: str | pathlib.Path) -> pathlib.Path:
    """Writes ``report.md`` (+ ``curves.png``, ``weights.png``, ``head_weights.png``,
    ``block_maps.png``, ``density.png``, ``recall.png``) in
    ``run_dir`` from its ``config.json``, ``metrics.jsonl`` and ``summary.json``."""
    run_dir = pathlib.Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    phases = _read_metrics(run_dir)
    lines = ["# Distillation run", ""]
    shown = {k: v for k, v in config.items() if k != "data_description"}
    lines += ["```", f"config: {json.dumps(shown)}", "```", ""]
    lines += ["## Data", "", config.get("data_description", "?"), ""]
    lines += ["## Results (evaluation split, measured in this run)", ""]
    lines += ["| | teacher (dense) | student (soft) | hardened student |", "|:--|--:|--:|--:|"]
    lines.append(
        f"| perplexity | {summary['teacher_ppl']:.3f} | {summary['student_ppl']:.3f} | "
        f"{summary['hardened_ppl']:.3f} |"
    )
    lines.append(
        f"| KL(teacher ‖ ·), nats/token | 0 | {summary['student_kl']:.4f} | "
        f"{summary['hardened_kl']:.4f} |"
    )
    for length, s in summary["speed"].items():
        lines.append(
            f"| attention density at n={length} | {s['teacher_density']:.1%} | – | "
            f"{s['hardened_density']:.1%} |"
        )
        lines.append(
            f"| FLOPs/token at n={length} | {_flops(s['teacher_flops_per_token'])} | – | "
            f"{_flops(s['hardened_flops_per_token'])} |"
        )
        lines.append(
            f"| attention FLOPs at n={length} | {_flops(s['teacher_attention_flops'])} | – | "
            f"{_flops(s['hardened_attention_flops'])} |"
        )
        if "teacher_attention_ms" in s:
            lines.append(
                f"| attention time (forward, all blocks) at n={length}, ms | "
                f"{s['teacher_attention_ms']:.1f} | – | {s['hardened_attention_ms']:.1f} |"
            )
        lines.append(
            f"| forward tokens/s at n={length} | {s['teacher_tokens_per_s']:.0f} | – | "
            f"{s['hardened_tokens_per_s']:.0f} |"
        )
    lines += [
        "",
        f"Hardened heads per block: {summary['hardened_heads']}; FFN units per block: "
        f"{summary['hardened_ffn_units']}. Device: {summary['device']}; wall time "
        f"{summary['wall_time_s']:.0f} s{_seconds(summary)}. tokens/s: one sequence, jitted "
        "forward, median of repeated calls; attention time: each block's attention core "
        "alone (no projections) on random q, k, v, jitted, median of repeated calls, summed "
        "over blocks; "
        "density: allowed fraction of the full n x n score matrix (causal = 50%); "
        "FLOPs: sparse_jax.models.flops (matmuls over the score entries each "
        "implementation forms).",
        "",
    ]
    lines += _recall_lines(summary)
    if _plot_recall(summary, run_dir / "recall.png"):
        lines += ["![recall by length and depth](recall.png)", ""]
    lines += _hardening_lines(summary)
    if summary.get("hardened_masks"):
        lines += ["Hardened masks per block:", ""]
        lines += [f"- block {i}: `{m}`" for i, m in enumerate(summary["hardened_masks"])]
        lines.append("")
    if _plot_curves(phases, run_dir / "curves.png"):
        lines += ["## Training curves", "", "![loss and KL](curves.png)", ""]
    if _plot_weights(phases, summary.get("candidates", []), run_dir / "weights.png"):
        lines += ["## Candidate weights (one line per candidate, per block)", ""]
        lines += ["![candidate weights](weights.png)", ""]
    if _plot_head_weights(summary, run_dir / "head_weights.png"):
        lines += ["## Candidate weights per head at the end of the student phase", ""]
        lines += ["![weights per head](head_weights.png)", ""]
    lines += _planted_lines(summary)
    if _plot_block_maps(summary, run_dir / "block_maps.png"):
        lines += ["## What the hardened heads compute (kernel blocks)", ""]
        lines += ["![kept blocks per head](block_maps.png)", ""]
    if _plot_density(summary, run_dir / "density.png"):
        lines += ["## Attention density per block", "", "![density](density.png)", ""]
    if summary.get("samples"):
        lines += ["## Teacher vs hardened student (evaluation prompts)", ""]
        for i, sample in enumerate(summary["samples"]):
            cell = {k: repr(v).replace("|", "\\|") for k, v in sample.items()}
            lines += [f"**Prompt {i + 1}:** `{cell['prompt']}`", ""]
            lines += ["| | teacher | hardened student |", "|:--|:--|:--|"]
            lines.append(f"| greedy | `{cell['teacher']}` | `{cell['hardened']}` |")
            if "teacher_sampled" in cell:
                lines.append(
                    f"| sampled (T = {sample['temperature']}, same key) | "
                    f"`{cell['teacher_sampled']}` | `{cell['hardened_sampled']}` |"
                )
            lines.append("")
    path = run_dir / "report.md"
    replace_atomically(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    return path


if __name__ == "__main__":
    print(write_report(sys.argv[1]))
