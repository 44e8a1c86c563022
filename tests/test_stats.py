"""experiments.common.stats: the intervals and the paired test, against closed forms and edge
cases."""

from __future__ import annotations

import math

import pytest
import scipy.stats

from experiments.common import stats


@pytest.mark.parametrize(("right", "n"), [(0, 10), (3, 10), (10, 10), (41, 50), (1, 1)])
def test_the_proportion_interval_is_wilsons(right, n):
    z = scipy.stats.norm.ppf(0.975)
    centre = (right + z * z / 2) / (n + z * z)
    half = z / (n + z * z) * math.sqrt(right * (n - right) / n + z * z / 4)
    got = stats.proportion(right, n)
    assert got["rate"] == right / n and got["right"] == right and got["n"] == n
    assert got["ci95"] == pytest.approx((centre - half, centre + half))
    assert 0 <= got["ci95"][0] <= right / n <= got["ci95"][1] <= 1


def test_a_proportion_of_nothing_is_unknown_and_bad_counts_are_refused():
    nothing = stats.proportion(0, 0)
    assert math.isnan(nothing["rate"]) and nothing["ci95"] == (0.0, 1.0)
    for right, n in ((3, 2), (-1, 2), (1.0, 2)):
        with pytest.raises(ValueError, match=r"proportion: need ints 0 <= `right` <= `n`"):
            stats.proportion(right, n)


@pytest.mark.parametrize(
    ("a_only", "b_only", "both", "neither"),
    [(8, 0, 22, 20), (3, 5, 30, 12), (0, 5, 40, 5), (7, 7, 1, 0)],
)
def test_paired_counts_disagreements_and_tests_them_exactly(a_only, b_only, both, neither):
    a = [True] * a_only + [False] * b_only + [True] * both + [False] * neither
    b = [False] * a_only + [True] * b_only + [True] * both + [False] * neither
    got = stats.paired(a, b)
    n, disagree = len(a), a_only + b_only
    assert (got["n"], got["a_only"], got["b_only"]) == (n, a_only, b_only)
    assert got["difference"] == pytest.approx((sum(a) - sum(b)) / n)
    # McNemar's exact test: twice the smaller binomial tail of a fair coin, at most 1
    tail = sum(math.comb(disagree, i) for i in range(min(a_only, b_only) + 1)) / 2**disagree
    assert got["p_value"] == pytest.approx(min(1.0, 2 * tail))
    # Newcombe's hybrid score interval (method 10, plain φ), from the 2 x 2 table
    wilson = [stats.proportion(k, n)["ci95"] for k in (a_only + both, b_only + both)]
    rates = [(a_only + both) / n, (b_only + both) / n]
    cells = (both * neither - a_only * b_only, (a_only + both) * (b_only + neither)
             * (b_only + both) * (a_only + neither))  # fmt: skip
    phi = cells[0] / math.sqrt(cells[1]) if cells[1] else 0.0
    (l1, u1), (l2, u2) = wilson
    d1, d2 = rates[0] - l1, u2 - rates[1]
    e1, e2 = u1 - rates[0], rates[1] - l2
    want = (
        rates[0] - rates[1] - math.sqrt(d1 * d1 - 2 * phi * d1 * d2 + d2 * d2),
        rates[0] - rates[1] + math.sqrt(e1 * e1 - 2 * phi * e1 * e2 + e2 * e2),
    )
    assert got["ci95"] == pytest.approx(want)
    assert -1 <= got["ci95"][0] <= got["difference"] <= got["ci95"][1] <= 1


def test_paired_models_that_never_disagree_or_grade_different_questions():
    same = stats.paired([True] * 40 + [False] * 10, [True] * 40 + [False] * 10)
    assert same["difference"] == 0.0 and same["p_value"] == 1.0
    assert same["ci95"][0] < 0 < same["ci95"][1]  # agreeing on 50 does not prove them equal
    empty = stats.paired([], [])
    assert empty["n"] == 0 and math.isnan(empty["difference"]) and empty["p_value"] == 1.0
    with pytest.raises(
        ValueError, match=r"paired: `a` and `b` grade the same questions; got 2 and 3"
    ):
        stats.paired([True, False], [True, False, True])


def test_the_clustered_interval_resamples_whole_questions():
    # three runs of two models on four questions; question q0 decides everything
    a = [True, False, True, True] * 3
    b = [False, False, True, True] * 3
    questions = ["q0", "q1", "q2", "q3"] * 3
    got = stats.clustered_difference(a, b, questions, resamples=4000, seed=1)
    assert (got["n"], got["clusters"], got["a_only"], got["b_only"]) == (12, 4, 3, 0)
    assert got["difference"] == pytest.approx(0.25)
    # by hand: a resample of 4 questions holds q0 k times (k ~ Binomial(4, 1/4)): its
    # difference is k / 4, whatever the seeds; the 2.5% and 97.5% points of k / 4 are 0 and 0.75
    assert got["ci95"] == (0.0, 0.75)
    assert stats.clustered_difference(a, b, questions, resamples=4000, seed=1) == got
    same = stats.clustered_difference(a, a, questions)
    assert same["difference"] == 0.0 and same["ci95"] == (0.0, 0.0)
    # answers counted one by one (each its own cluster) give a narrower interval here
    single = stats.clustered_difference(a, b, list(range(12)), resamples=4000, seed=1)
    assert single["ci95"][1] - single["ci95"][0] < got["ci95"][1] - got["ci95"][0]


def test_bad_clustered_arguments_are_refused():
    with pytest.raises(ValueError, match=r"`a`, `b` and `clusters` grade the same answers"):
        stats.clustered_difference([True], [True, False], [0, 1])
    with pytest.raises(ValueError, match=r"`resamples` must be an int >= 1; got 0"):
        stats.clustered_difference([True], [False], [0], resamples=0)
    empty = stats.clustered_difference([], [], [])
    assert empty["n"] == 0 and math.isnan(empty["difference"])
