"""Small helpers shared by the benchmarks: timing, compiled memory, markdown tables.

Example::

    import jax.numpy as jnp
    from experiments.common import timing

    stats = timing.time_fn(lambda x: x @ x.T, jnp.ones((512, 512)), repeats=5)
    print(timing.markdown_table(["op", "ms"], [["matmul", f"{stats.median_ms:.2f}"]]))
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Wall-clock figures of one timed function.

    Compilation is measured but excluded from ``times_s``; so is the first (warm-up) call,
    except for a slow function (see ``time_fn``).
    """

    times_s: tuple[float, ...]  # seconds of each timed call, in order
    requested: int  # how many timed calls were asked for (may exceed len(times_s))
    compile_s: float  # seconds spent in `lower(...).compile()`
    warmup_s: float  # seconds of the first call of the compiled function (see `time_fn`)
    peak_bytes: int | None  # compiled memory need (see `peak_memory_bytes`), None if unknown

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median_s

    @property
    def min_ms(self) -> float:
        return 1e3 * self.min_s

    @property
    def truncated(self) -> bool:
        """True when fewer calls than requested were timed (a slow function)."""
        return len(self.times_s) < self.requested


def peak_memory_bytes(compiled: Any) -> int | None:
    """Memory a compiled JAX executable needs, from XLA's buffer assignment.

    Returns arguments + outputs + temporaries - aliased bytes of ``memory_analysis()``: a
    compile-time figure (temporaries are one arena with buffer reuse already applied), not a
    measured resident size. ``peak_memory_in_bytes`` is not used because on XLA:CPU (jax 0.10.2)
    it counts only arguments and outputs. Returns None where a backend reports nothing.

    Example::

        compiled = jax.jit(f).lower(x).compile()
        mib = peak_memory_bytes(compiled) / 2**20
    """
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    parts = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    if stats is None or not all(hasattr(stats, p) for p in parts):
        return None
    total = sum(int(getattr(stats, p)) for p in parts)
    return total - int(getattr(stats, "alias_size_in_bytes", 0))


def _compile_and_warm(fn: Callable[..., Any], args: tuple[Any, ...]):
    """``(executable, compile_s, warmup_s, peak_bytes)``: ``fn`` jitted (unless it already has
    ``.lower``), lowered and compiled ahead of time, then called once (the warm-up), each step
    timed."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    warmup_s = time.perf_counter() - start
    return compiled, compile_s, warmup_s, peak_memory_bytes(compiled)


def time_fn(
    fn: Callable[..., Any],
    *args: Any,
    repeats: int = 5,
    slow_s: float | None = None,
    budget_s: float | None = None,
) -> TimingStats:
    """Times ``fn(*args)`` under ``jax.jit``, compilation excluded.

    ``fn`` is jitted (unless it already has ``.lower``), lowered and compiled ahead of time;
    the compiled executable is called once as a warm-up (excluded) and then up to ``repeats``
    times, each call followed by ``jax.block_until_ready`` on its outputs. Two optional limits
    keep slow functions affordable; ``stats.truncated`` tells when they cut timing short:

    - ``slow_s``: if the warm-up call takes longer than this, it becomes the only sample (no
      further calls). Compilation is already excluded and, at that duration, first-call costs
      are a negligible part of the call.
    - ``budget_s``: stop repeating once the timed calls have used this many seconds (at least
      one timed call is always made).

    Example::

        stats = time_fn(lambda x: jnp.sort(x, axis=-1), x, repeats=5, slow_s=10.0)
        print(f"{stats.median_ms:.1f} ms (min {stats.min_ms:.1f}), compile {stats.compile_s:.1f} s")
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    compiled, compile_s, warmup_s, peak = _compile_and_warm(fn, args)
    if slow_s is not None and warmup_s > slow_s:
        return TimingStats((warmup_s,), repeats, compile_s, warmup_s, peak)

    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        del out
        if budget_s is not None and sum(times) >= budget_s:
            break
    return TimingStats(tuple(times), repeats, compile_s, warmup_s, peak)


def time_interleaved(
    calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]],
    *,
    rounds: int = 30,
    min_rounds: int = 5,
    budget_s: float | None = None,
) -> list[TimingStats]:
    """Times several functions against each other: each ``(fn, args)`` is compiled ahead and
    warmed up once (both excluded), then every round calls each of them once, in turn, until
    ``rounds`` rounds are done or, after ``min_rounds``, the timed calls have used ``budget_s``
    seconds. Every function gets the same number of samples, taken over the same stretch of
    time, so that a machine getting faster or slower during the measurement (another process,
    frequency scaling) moves all of them alike: the way to compare two models in one run.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((64, 64))
    >>> a, b = time_interleaved([(lambda x: x @ x, (x,)), (lambda x: x + 1, (x,))], rounds=6)
    >>> len(a.times_s), len(b.times_s)
    (6, 6)
    """
    if not is_count(rounds) or not is_count(min_rounds) or min_rounds > rounds:
        raise ValueError(
            f"time_interleaved: `rounds` and `min_rounds` must be ints with 1 <= min_rounds <= "
            f"rounds; got rounds={rounds!r}, min_rounds={min_rounds!r}"
        )
    compiled, stats = [], []
    for fn, args in calls:
        executable, *figures = _compile_and_warm(fn, args)
        compiled.append((executable, args))
        stats.append(figures)
    times: list[list[float]] = [[] for _ in calls]
    spent = 0.0
    for done in range(rounds):
        if budget_s is not None and done >= min_rounds and spent >= budget_s:
            break
        for samples, (executable, args) in zip(times, compiled, strict=True):
            start = time.perf_counter()
            out = executable(*args)
            jax.block_until_ready(out)
            samples.append(time.perf_counter() - start)
            spent += samples[-1]
            del out
    return [
        TimingStats(tuple(samples), rounds, compile_s, warmup_s, peak)
        for samples, (compile_s, warmup_s, peak) in zip(times, stats, strict=True)
    ]


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None
) -> str:
    """Formats ``rows`` as a GitHub markdown table with padded columns.

    ``align`` has one character per column, ``"l"`` or ``"r"`` (default: first column left,
    the others right). Cells are converted with ``str``; a ``|`` inside a cell is escaped as
    ``\\|`` so that it does not split the cell.

    Example::

        >>> print(markdown_table(["x", "y"], [["a", 1.5]]))
        | x   |   y |
        |:----|----:|
        | a   | 1.5 |
    """
    ncol = len(headers)
    if align is None:
        align = "l" + "r" * (ncol - 1)
    if len(align) != ncol or set(align) - {"l", "r"}:
        raise ValueError(f"align must have {ncol} characters from 'l'/'r', got {align!r}")
    cells = [[str(h).replace("|", "\\|") for h in headers]]
    for row in rows:
        if len(row) != ncol:
            raise ValueError(f"row {row!r} has {len(row)} cells, expected {ncol}")
        cells.append([str(c).replace("|", "\\|") for c in row])
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(ncol)]

    def line(row: list[str]) -> str:
        padded = (
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = (
        ":" + "-" * (w + 1) if a == "l" else "-" * (w + 1) + ":"
        for w, a in zip(widths, align, strict=True)
    )
    sep = "|" + "|".join(rule) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def environment_line(command: str) -> str:
    """One line describing where and when a benchmark ran, for the top of its table.

    Example::

        print(environment_line("python -m experiments.bench normalizers"))
    """
    device = jax.devices()[0]
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return (
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"device {device.device_kind} x{jax.device_count()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), load average {load_average()}, {now}; "
        f"command: `{command}`"
    )


def load_average() -> str:
    """The 1/5/15-minute load averages as text, e.g. ``"1.02/0.80/0.55"`` (other processes
    competing for the CPUs make timings unreliable)."""
    try:
        return "{:.2f}/{:.2f}/{:.2f}".format(*os.getloadavg())
    except OSError:
        return "unknown"


def ms_text(ms: float) -> str:
    """Milliseconds to 3 significant digits (no decimals from 100 ms on).

    >>> [ms_text(x) for x in (0.123, 2.471, 24.71, 247.1)]
    ['0.123', '2.47', '24.7', '247']
    """
    if ms >= 100:
        return f"{ms:.0f}"
    decimals = 2 - math.floor(math.log10(ms)) if ms > 0 else 2
    return f"{ms:.{decimals}f}"


def format_ms(stats: TimingStats) -> str:
    """The median in ms with 3 significant digits (:func:`ms_text`); ``†k`` when only k calls
    were timed (:meth:`TimingFlags.dagger_note` says why)."""
    return ms_text(stats.median_ms) + (f"†{len(stats.times_s)}" if stats.truncated else "")


def log(message: str) -> None:
    """Progress of a benchmark, to stderr (stdout holds its table)."""
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class TimingFlags:
    """The timing flags every benchmark that times cells shares (a cell: compiled, one warm-up
    call, then timed calls). A benchmark's config subclasses it, changing a default by
    declaring the field again, and calls ``super().__post_init__()``.

    >>> TimingFlags(repeats=0)
    Traceback (most recent call last):
    ValueError: repeats must be a positive integer, got 0
    """

    repeats: int = 5
    """Timed calls per cell; the median is reported. One extra warm-up call after
    compilation is excluded."""
    slow_s: float = 10.0
    """If the first call after compilation (the warm-up) takes longer than this many seconds,
    that call is the cell's only sample."""
    budget_s: float = 15.0
    """Stop repeating a cell once its timed calls have used this many seconds (at least one
    call). Cells timed fewer than --repeats times are marked with a dagger and the count."""
    output: pathlib.Path | None = None
    """Also write the markdown (header, table, notes) to this file."""

    def __post_init__(self) -> None:
        check_counts(self, "repeats")
        check_seconds(self, "slow_s", "budget_s")

    def dagger_note(self) -> str:
        """What a table's times are, and what its daggers (:func:`format_ms`) mean.

        >>> TimingFlags(repeats=3, slow_s=2.0, budget_s=5.0).dagger_note()[:60]
        'ms = median of 3 calls after compilation and one warm-up cal'
        """
        return (
            f"ms = median of {self.repeats} calls after compilation and one warm-up call; †k = "
            f"median of only k calls: the cell's timed calls passed {self.budget_s:g} s, or †1: "
            f"its warm-up call took > {self.slow_s:g} s and is the one sample."
        )


def is_count(value: Any) -> bool:
    """True for an integer >= 1 (python or numpy; not a bool): the benchmarks' sizes."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_counts(config: Any, *names: str) -> None:
    """Raises ValueError naming the first field of ``config`` among ``names`` that is not an
    integer >= 1 (:func:`is_count`): a benchmark config's sizes, checked in ``__post_init__``."""
    for name in names:
        value = getattr(config, name)
        if not is_count(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_count_tuples(config: Any, *names: str, optional: bool = False) -> None:
    """Raises ValueError naming the first field among ``names`` that is not a non-empty tuple
    of integers >= 1; with ``optional``, None passes (a default chosen at run time)."""
    for name in names:
        values = getattr(config, name)
        if optional and values is None:
            continue
        if not values or any(not is_count(x) for x in values):
            raise ValueError(f"{name} must be positive integers, got {values!r}")


def check_seconds(config: Any, *names: str) -> None:
    """Raises ValueError naming the first field among ``names`` that is not > 0 (seconds)."""
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {getattr(config, name)!r}")
