"""Benchmarks of sparse_jax against references measured in the same run.

Each subcommand prints one markdown table to stdout (progress goes to stderr)::

    python -m experiments.bench normalizers
    python -m experiments.bench normalizers --which softmax projection_simplex --lengths 256 512
    python -m experiments.bench normalizers --help
    python -m experiments.bench attention --lengths 1024 4096
    python -m experiments.bench hardening --lengths 1024
    python -m experiments.bench kernels    # fused kernels and, on a GPU, the PyTorch peers
    python -m experiments.bench forward_passes   # what a pass of the sparse forward costs
    python -m experiments.bench query_chunks     # impl='xla': query rows per chunk
    python -m experiments.bench selection        # BlockSelection: gather engine vs dense mask
    python -m experiments.bench block_sizes      # the block-sparse engine's blocks per mask
    python -m experiments.bench checkouts        # one attention call in several commits' library

The default ``normalizers`` run takes minutes on a CPU (docs/benchmarks.md), most of it in optax's
sort-based ``projection_simplex`` and the general-alpha entmax at n = 2048 and 4096.

Adding a benchmark: write a frozen config dataclass (a docstring per field; tyro turns them
into ``--help``) and a function ``run_<name>(config, command) -> str`` that returns the
markdown, in a module of this package, and add them to :data:`BENCHMARKS`.
"""

from __future__ import annotations

import pathlib
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

import tyro

from experiments.bench import attention, checkouts, hardening, kernels, normalizers, passes
from experiments.common import timing

__all__ = ["BENCHMARKS", "main", "parse"]

# subcommand -> (config class, runner(config, command) -> markdown)
BENCHMARKS: dict[str, tuple[type, Callable[[Any, str], str]]] = {
    "normalizers": (normalizers.NormalizersConfig, normalizers.run_normalizers),
    "query_chunks": (attention.QueryChunksConfig, attention.run_query_chunks),
    "attention": (attention.AttentionConfig, attention.run_attention),
    "selection": (attention.SelectionConfig, attention.run_selection),
    "block_sizes": (attention.BlockSizesConfig, attention.run_block_sizes),
    "hardening": (hardening.HardeningConfig, hardening.run_hardening),
    "kernels": (kernels.KernelsConfig, kernels.run_kernels),
    "pallas_tuning": (kernels.TuningConfig, kernels.run_tuning),
    "search_passes": (passes.SearchPassesConfig, passes.run_search_passes),
    "forward_passes": (kernels.ForwardPassesConfig, kernels.run_forward_passes),
    "checkouts": (checkouts.CheckoutsConfig, checkouts.run_checkouts),
}


def parse(argv: Sequence[str]) -> Any:
    """The config of a benchmark command line (``["kernels", "--lengths", "4096"]``); a bad
    flag exits with a message naming it."""
    return tyro.extras.subcommand_cli_from_dict(
        {name: config_cls for name, (config_cls, _) in BENCHMARKS.items()},
        prog="python -m experiments.bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        args=list(argv),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Parses the subcommand and its flags, runs the benchmark, prints (and writes) markdown."""
    args = list(sys.argv[1:] if argv is None else argv)
    config = parse(args)
    runner = next(r for cls, r in BENCHMARKS.values() if type(config) is cls)
    interrupted = None
    try:
        markdown = runner(config, shlex.join(["python", "-m", "experiments.bench", *args]))
    except kernels.Interrupted as stop:  # the cells measured before it are printed and written
        markdown, interrupted = stop.markdown, stop
    print(markdown, end="", flush=True)
    output = getattr(config, "output", None)
    if output is not None:
        output = pathlib.Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(markdown)
        timing.log(f"wrote {output}")
    if interrupted is not None:
        raise SystemExit(130)
