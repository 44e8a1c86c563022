"""Runnable experiments and benchmarks: ``python -m experiments.<name>``."""
