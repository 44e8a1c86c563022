"""``python -m experiments.bench <what>``: benchmarks of sparse_jax against references measured
in the same run, one markdown table each (:mod:`.cli` lists the subcommands).

The package: :mod:`.normalizers` (a normalizer alone and in attention), :mod:`.attention` (the
block-sparse kernel against dense, the dense engine's query chunks, and a block selection's
gather engine against its dense mask), :mod:`.hardening` (a
hardened GPT against the dense one), :mod:`.kernels` (the fused Pallas kernels, their tiles and
threshold passes, and the PyTorch peers through :mod:`.peers`, run in its own process),
:mod:`.cli` (the subcommands).
"""

from experiments.bench.cli import BENCHMARKS, main, parse

__all__ = ["BENCHMARKS", "main", "parse"]
