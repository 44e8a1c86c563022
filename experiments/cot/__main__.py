"""``python -m experiments.cot``: see :mod:`experiments.cot`."""

from experiments.cot.job import main

main()
