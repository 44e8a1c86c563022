"""``python -m experiments.distill``: see :mod:`experiments.distill.job`."""

from experiments.distill.job import main

main()
