"""The cascade run's ``report.md`` and its plots (``gates.png``; ``pareto.png`` with a sweep),
from the run's ``summary.json``."""

from __future__ import annotations

import pathlib

import numpy as np

from sparse_jax.files import replace_atomically, write_text_atomically

__all__ = ["write_report"]


def write_report(folder: pathlib.Path, s: dict) -> None:
    """Writes ``report.md``, ``gates.png`` and (with a sweep) ``pareto.png`` into ``folder``
    from the summary ``s``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = len(s["keep_ratio"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    axes[0].plot(range(1, blocks + 1), s["keep_ratio"], "o-", label="kept (evaluation text)")
    axes[0].plot(range(1, blocks + 1), s["target_keep_ratio"], "k--", label="target")
    axes[0].set(xlabel="block", ylabel="kept fraction of tokens", ylim=(0, 1.05))
    axes[0].legend()
    for ax, key, title in (
        (axes[1], "head_values", "head gates at evaluation (0: closed)"),
        (axes[2], "unit_values", "FFN unit gates at evaluation (first 64)"),
    ):
        grid = np.array([row[:64] for row in s[key]])
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="none")
        ax.set(title=title, xlabel="head" if key == "head_values" else "unit", ylabel="block")
        ax.set_yticks(range(blocks), [str(i) for i in range(1, blocks + 1)])
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    replace_atomically(folder / "gates.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    if s["sweep"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        pts = [(p["flops_per_token"], p["ppl"]) for p in s["sweep"]]
        ax.plot(*zip(*sorted(pts), strict=True), "o-", label="cascade (sweep)")
        ax.plot([s["dense"]["flops_per_token"]], [s["dense"]["ppl"]], "k*", ms=12, label="dense")
        ax.set(xlabel="FLOPs per token", ylabel="perplexity")
        ax.legend()
        fig.tight_layout()
        replace_atomically(
            folder / "pareto.png", lambda tmp: fig.savefig(tmp, dpi=90, format="png")
        )
        plt.close(fig)
    d, p = s["dense"], s["pruned"]
    mflops = lambda x: f"{x / 1e6:.2f} M"
    rows = [
        ("perplexity (per byte, evaluation split)", d["ppl"], p["ppl"], "{:.3f}".format),
        ("FLOPs per token", d["flops_per_token"], p["flops_per_token"], mflops),
    ]
    for length, v in s["speed"].items():
        rows.append(
            (
                f"forward tokens/s at n={length}",
                v["dense_tokens_per_s"],
                v["pruned_tokens_per_s"],
                "{:.0f}".format,
            )
        )
        if "pruned_run_flops_per_token" in v:  # (runs measured before it have no such figure)
            rows.append(
                (
                    f"FLOPs per token at n={length}, as run (pruned: every slot of each block)",
                    v["dense_flops_per_token"],
                    v["pruned_run_flops_per_token"],
                    mflops,
                )
            )
    lines = ["# CANDS cascade against the dense baseline", "", s["data"], ""]
    lines += ["| | dense | pruned cascade | pruned / dense |", "|:--|--:|--:|--:|"]
    lines += [f"| {n} | {f(a)} | {f(b)} | {b / a:.3f} |" for n, a, b, f in rows]
    kept = [round(r, 3) for r in s["keep_ratio"]]
    target = [round(r, 3) for r in s["target_keep_ratio"]]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in s["phase_seconds"].items())
    lines += [
        "",
        f"Kept fraction of tokens per block (evaluation text): {kept}, target {target}; heads "
        f"kept {s['heads_kept']}; FFN units kept {s['units_kept']}. Device {s['device']}; wall "
        f"time {s['wall_time_s']:.0f} s ({phases}). The pruned model is the cascade with hard "
        "gates, its closed heads and units cut from the weights and each block run on its kept "
        f"tokens only, in {s['capacity']} x T slots per block (batches in which a block kept "
        f"more and ran on more slots: {s['overflows']}); FLOPs: "
        "sparse_jax.models.flops.kept_flops (causal attention among kept tokens); tokens/s: "
        "one sequence of evaluation text, median of 7 rounds after warm-up, each round calling "
        "the dense and the pruned model in turn, routing included. FLOPs as run: those of the "
        "timed sequence, each pruned block counted over all the slots it ran on, empty ones "
        "included (PrunedCascadeLM.flops_as_run); dense over pruned is the speed-up a machine "
        "bound by its FLOPs would give, beside the measured tokens/s.",
        "",
        "![gates and kept tokens](gates.png)",
        "",
    ]
    if s["sweep"]:
        dense_4x = s["speed"][str(4 * int(next(iter(s["speed"]))))]["dense_tokens_per_s"]
        lines += [
            "| final keep ratio | perplexity | FLOPs per token | tokens/s at 4T over dense |",
            "|--:|--:|--:|--:|",
        ]
        lines += [
            f"| {p['final_keep']:g} | {p['ppl']:.3f} | {p['flops_per_token'] / 1e6:.2f} M | "
            f"{p['tokens_per_s_4x'] / dense_4x:.2f}x |"
            for p in s["sweep"]
        ]
        lines += ["", "![perplexity against FLOPs](pareto.png)", ""]
    write_text_atomically(folder / "report.md", "\n".join(lines) + "\n")
