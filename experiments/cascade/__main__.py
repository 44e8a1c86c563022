"""``python -m experiments.cascade``: see :mod:`experiments.cascade.job`."""

from experiments.cascade.job import main

main()
