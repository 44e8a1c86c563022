"""RecallMixture: text and recall sequences for a teacher that must retrieve."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sparse_jax.data.recall import RecallMixture, make_filler

FILLER_TEXT = " ".join(f"word{i % 97} and more text" for i in range(3000))


def _mixture(**kwargs):
    args = {
        "lengths": (128, 256),
        "tokens": 1024,
        "recall_fraction": 0.5,
        "seed": 3,
        "filler": make_filler(FILLER_TEXT, "byte"),
    } | kwargs
    return RecallMixture("byte", args.pop("filler"), **args)


def test_recall_rows_hold_one_stated_key_answered_where_marked():
    mix = _mixture()
    ends = []
    for _ in range(6):
        batch = next(mix)
        t = batch.shape[2] - 1
        assert batch.shape == (1024 // t, 2, t + 1) and batch.dtype == np.int32
        rows = batch.shape[0] // 2
        assert (batch[rows:, 1] == 0).all()  # text rows mark nothing
        for ids, marks in batch[:rows]:
            text = bytes(ids.tolist()).decode("latin-1")
            (key,) = re.findall(r"The pass key is (\d{5})\. Remember it\.", text)
            where = np.nonzero(marks)[0]
            assert len(where) == 6 and (np.diff(where) == 1).all()  # one contiguous answer
            assert bytes(ids[where].tolist()).decode() == " " + key
            assert text[: where[0]].endswith("What is the pass key? The pass key is")
            assert text.count(key) == 2  # stated once, answered once
            ends.append(where[-1] / t)
    # The answers end at many places, not only at the end of the sequence.
    assert min(ends) < 0.8 and max(ends) > 0.95 and len(set(ends)) > 8


def test_batches_are_a_function_of_seed_and_step_and_resume_alike():
    first, second = _mixture(), _mixture()
    batches = [next(first) for _ in range(3)]
    for b in batches:
        np.testing.assert_array_equal(b, next(second))
    assert not np.array_equal(batches[0][:, 0, :50], next(_mixture(seed=4))[:, 0, :50])
    state = first.state()
    assert state == {"step": 3}
    resumed = RecallMixture.from_state(
        "byte",
        state,
        make_filler(FILLER_TEXT, "byte"),
        lengths=(128, 256),
        tokens=1024,
        recall_fraction=0.5,
        seed=3,
    )
    np.testing.assert_array_equal(next(resumed), next(first))


def test_processes_split_each_global_batch_by_rows():
    whole = next(_mixture())
    parts = [next(_mixture(process_index=p, process_count=2)) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_fractions_zero_and_one():
    assert next(_mixture(recall_fraction=0.0))[:, 1].sum() == 0
    assert (next(_mixture(recall_fraction=1.0))[:, 1].sum(axis=1) == 6).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"lengths": (40,)}, ValueError, r"`length` must be at least"),
        ({"lengths": ()}, TypeError, r"`lengths` must be a non-empty sequence"),
        ({"recall_fraction": 1.5}, ValueError, r"`recall_fraction` must be a float in \[0, 1\]"),
        ({"recall_fraction": "half"}, TypeError, r"`recall_fraction` must be a float"),
        ({"tokens": 0}, ValueError, r"`tokens`"),
        ({"process_count": 3}, ValueError, r"cannot be split evenly over `process_count`=3"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        _mixture(**kwargs)
