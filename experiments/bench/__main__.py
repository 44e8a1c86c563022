"""``python -m experiments.bench``: see :mod:`experiments.bench.cli`."""

from experiments.bench.cli import main

main()
