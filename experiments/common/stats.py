"""How sure a measured accuracy is: intervals for a proportion and for the difference of two
models graded on the same questions (paired), for the experiments' reports.

Example::

    from experiments.common import stats

    stats.proportion(41, 50)  # rate 0.82, ci95 (0.692, 0.902)
    stats.paired([True, False, True], [True, True, False])  # sparse vs dense, question by question
    stats.clustered_difference(a, b, questions)  # over several seeds' runs: questions resampled
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats as scipy_stats


def proportion(right: int, n: int) -> dict:
    """``right`` of ``n`` with its 95% Wilson score interval (``ci95``: fractions; ``(0, 1)``
    when ``n`` is 0, ``rate`` then NaN).

    Example:
      >>> p = proportion(41, 50)
      >>> p["rate"], [round(x, 3) for x in p["ci95"]]
      (0.82, [0.692, 0.902])
    """
    if not (isinstance(n, int) and isinstance(right, int) and 0 <= right <= n):
        raise ValueError(f"proportion: need ints 0 <= `right` <= `n`; got right={right!r}, n={n!r}")
    if n == 0:
        return {"right": 0, "n": 0, "rate": math.nan, "ci95": (0.0, 1.0)}
    ci = scipy_stats.binomtest(right, n).proportion_ci(confidence_level=0.95, method="wilson")
    return {"right": right, "n": n, "rate": right / n, "ci95": (float(ci.low), float(ci.high))}


def paired(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """Model ``a`` against model ``b`` on the same questions (``a[i]``, ``b[i]``: question i
    right): the difference of their rates with its 95% interval (Newcombe's hybrid score
    interval for paired proportions, his method 10 with the plain correlation φ of the two
    models' answers: each rate's Wilson interval, combined; it stays within [-1, 1] and keeps
    its coverage at small counts), and McNemar's exact test of the questions only one of them
    answers right (two-sided ``p_value``: how often a fair coin would split them at least this
    unevenly; 1 when the models never disagree). The two are different methods: near
    ``p = 0.05`` the interval may exclude 0 while the test does not reject, or the reverse.

    Returns ``{"n", "a_only", "b_only", "difference", "ci95", "p_value"}``, the difference and
    its interval as fractions (``a`` minus ``b``).

    Example:
      >>> r = paired([True] * 30 + [False] * 20, [True] * 22 + [False] * 28)
      >>> r["a_only"], r["b_only"], r["difference"], round(r["p_value"], 4)
      (8, 0, 0.16, 0.0078)
      >>> [round(x, 3) for x in r["ci95"]]
      [0.058, 0.254]
    """
    if len(a) != len(b):
        raise ValueError(f"paired: `a` and `b` grade the same questions; got {len(a)} and {len(b)}")
    n = len(a)
    both = sum(1 for x, y in zip(a, b, strict=True) if x and y)
    a_only = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    b_only = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    neither = n - both - a_only - b_only
    if n == 0:
        return {"n": 0, "a_only": 0, "b_only": 0, "difference": math.nan,
                "ci95": (math.nan, math.nan), "p_value": 1.0}  # fmt: skip
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, u1 = proportion(both + a_only, n)["ci95"]
    l2, u2 = proportion(both + b_only, n)["ci95"]
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = 0.0 if margins == 0 else (both * neither - a_only * b_only) / math.sqrt(margins)
    difference = (a_only - b_only) / n  # p1 - p2, without its rounding
    below = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    above = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    disagree = a_only + b_only
    p_value = 1.0 if disagree == 0 else float(scipy_stats.binomtest(a_only, disagree).pvalue)
    return {
        "n": n,
        "a_only": a_only,
        "b_only": b_only,
        "difference": difference,
        "ci95": (difference - math.sqrt(max(below, 0.0)), difference + math.sqrt(max(above, 0.0))),
        "p_value": p_value,
    }


def clustered_difference(
    a: Sequence[bool],
    b: Sequence[bool],
    clusters: Sequence[Any],
    *,
    resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """Model ``a`` against model ``b`` over several runs on the same questions: ``a[i]``,
    ``b[i]`` grade one answer each (one run's pair of models on one question) and
    ``clusters[i]`` names the question, so that a question answered in several runs counts as
    one draw. The difference of the rates over all answers, with a 95% percentile interval from
    resampling the questions (with their answers in every run) ``resamples`` times (numpy's
    generator seeded by ``seed``: the same answers give the same interval).

    Returns ``{"n", "clusters", "a_only", "b_only", "difference", "ci95"}`` (fractions).

    Example:
      >>> a = [True, True, False, True, True, True]  # two runs on questions q1, q2, q3
      >>> b = [True, False, False, True, False, True]
      >>> r = clustered_difference(a, b, ["q1", "q2", "q3"] * 2, resamples=2000)
      >>> r["difference"], r["a_only"], r["b_only"], r["clusters"]
      (0.3333333333333333, 2, 0, 3)
    """
    if not (len(a) == len(b) == len(clusters)):
        raise ValueError(
            f"clustered_difference: `a`, `b` and `clusters` grade the same answers; got lengths "
            f"{len(a)}, {len(b)} and {len(clusters)}"
        )
    if not (isinstance(resamples, int) and resamples >= 1):
        raise ValueError(
            f"clustered_difference: `resamples` must be an int >= 1; got {resamples!r}"
        )
    n = len(a)
    a_only = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    b_only = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    names = sorted(set(clusters), key=list(clusters).index)
    if n == 0:
        return {"n": 0, "clusters": 0, "a_only": 0, "b_only": 0, "difference": math.nan,
                "ci95": (math.nan, math.nan)}  # fmt: skip
    index = {name: i for i, name in enumerate(names)}
    # per question: the sum of (a - b) over its answers, and how many answers it has
    gain = np.zeros(len(names))
    count = np.zeros(len(names))
    for x, y, c in zip(a, b, clusters, strict=True):
        gain[index[c]] += int(bool(x)) - int(bool(y))
        count[index[c]] += 1
    draws = np.random.default_rng(seed).integers(0, len(names), size=(resamples, len(names)))
    differences = gain[draws].sum(axis=1) / count[draws].sum(axis=1)
    low, high = np.quantile(differences, [0.025, 0.975])
    return {
        "n": n,
        "clusters": len(names),
        "a_only": a_only,
        "b_only": b_only,
        "difference": (a_only - b_only) / n,
        "ci95": (float(low), float(high)),
    }
