"""Tests of sparse_jax.masks: builders against explicit loops, algebra laws, block layouts,
splash conversion and argument errors."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from sparse_jax import masks
from sparse_jax.masks import (
    causal,
    chunked,
    dilated,
    fixed,
    from_array,
    full,
    global_tokens,
    local,
    padding,
    per_head,
    random_blocks,
    segments,
    sink,
    strided,
)

HYP = settings(max_examples=60, deadline=None)


# ----------------------------------------------------------------------------------------------
# References: explicit loops over (i, j), with i the absolute query position.


def _lowbias32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _random_keep(density: float, block: int, seed: int, i: int, j: int) -> bool:
    x = _lowbias32(_lowbias32(_lowbias32(seed % 2**32) ^ (i // block)) ^ (j // block))
    return (x >> 8) < round(density * 2**24)


EYEISH = np.random.default_rng(0).random((11, 13)) < 0.4

# (mask, reference predicate on (absolute i, j))
CASES = {
    "full": (full(), lambda i, j: True),
    "causal": (causal(), lambda i, j: j <= i),
    "local(2,1)": (local(2, 1), lambda i, j: i - 2 <= j <= i + 1),
    "local(0,0)": (local(0, 0), lambda i, j: i == j),
    "local(None,1)": (local(None, 1), lambda i, j: j <= i + 1),
    "local(3,None)": (local(3, None), lambda i, j: j >= i - 3),
    "local(None,None)": (local(None, None), lambda i, j: True),
    "dilated(2,3)": (dilated(2, 3), lambda i, j: 0 <= i - j <= 6 and (i - j) % 3 == 0),
    "dilated(0,2)": (dilated(0, 2), lambda i, j: i == j),
    "dilated(3,1)": (dilated(3, 1), lambda i, j: 0 <= i - j <= 3),
    "strided(3)": (strided(3), lambda i, j: j <= i and (i - j < 3 or (i - j) % 3 == 0)),
    "strided(1)": (strided(1), lambda i, j: j <= i),
    "fixed(4,1)": (fixed(4, 1), lambda i, j: j <= i and (j // 4 == i // 4 or j % 4 == 3)),
    "fixed(3,0)": (fixed(3, 0), lambda i, j: j <= i and j // 3 == i // 3),
    "fixed(3,3)": (fixed(3, 3), lambda i, j: j <= i),
    "sink(2)": (sink(2), lambda i, j: j < 2),
    "sink(0)": (sink(0), lambda i, j: False),
    "global_tokens": (global_tokens([5, 1, 1]), lambda i, j: i in (1, 5) or j in (1, 5)),
    "global_tokens([])": (global_tokens([]), lambda i, j: False),
    "chunked(3)": (chunked(3), lambda i, j: i // 3 == j // 3),
    "random_blocks": (
        random_blocks(0.4, 2, seed=7),
        lambda i, j: _random_keep(0.4, 2, 7, i, j),
    ),
    "random_blocks(1.0)": (random_blocks(1.0, 3, seed=-5), lambda i, j: True),
    "from_array": (
        from_array(EYEISH),
        lambda i, j: i < 11 and j < 13 and bool(EYEISH[i, j]),
    ),
    "sliding+sinks": (
        causal() & (local(2, 0) | sink(1)),
        lambda i, j: j <= i and (i - j <= 2 or j < 1),
    ),
    "not_chunked_causal": (
        ~(chunked(4) & causal()),
        lambda i, j: not (i // 4 == j // 4 and j <= i),
    ),
}
SHAPES = [(5, 7), (7, 5), (9, 9), (1, 6)]


def _loop(fn, q_len, kv_len, offset=0):
    return np.array(
        [[bool(fn(i + offset, j)) for j in range(kv_len)] for i in range(q_len)], dtype=bool
    ).reshape(q_len, kv_len)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("offset", [0, 3])
def test_builders_match_loops(name, offset):
    mask, fn = CASES[name]
    m = mask.with_offset(offset)
    for q_len, kv_len in SHAPES:
        if m.shape is not None:
            q_len, kv_len = min(q_len, m.shape[0]), min(kv_len, m.shape[1])
        got = m.dense(q_len, kv_len)
        assert isinstance(got, np.ndarray) and got.dtype == np.bool_
        np.testing.assert_array_equal(got, _loop(fn, q_len, kv_len, offset), err_msg=name)


def test_predicate_scalars_and_broadcasting():
    m = causal() & local(2, 0)
    assert m.predicate(3, 1).shape == ()
    assert bool(m.predicate(3, 1)) and not bool(m.predicate(3, 0))
    q, kv = np.arange(4)[:, None, None], np.arange(5)[None, :, None]
    assert m.predicate(q, kv).shape == (4, 5, 1)


def test_dilated_one_is_local():
    np.testing.assert_array_equal(dilated(4, 1).dense(9, 11), local(4, 0).dense(9, 11))


def test_with_offset_collapses_and_decodes():
    m = causal().with_offset(2).with_offset(3)
    assert isinstance(m, masks.Shifted) and m.offset == 5 and m.mask == causal()
    assert causal().with_offset(0) == causal()
    # One decoding step with a cache of 6 tokens: the last row of the full mask.
    pattern = causal() & (local(2, 0) | sink(1))
    np.testing.assert_array_equal(pattern.with_offset(6).dense(1, 7), pattern.dense(7, 7)[6:])


def test_random_blocks_density_and_structure():
    m = random_blocks(0.3, 4, seed=1)
    grid = m.dense(256, 256)[::4, ::4]  # one entry per pattern block
    assert abs(grid.mean() - 0.3) < 0.05
    blocks = m.dense(256, 256).reshape(64, 4, 64, 4)
    assert (blocks.all(axis=(1, 3)) == blocks.any(axis=(1, 3))).all()  # constant per block
    other = random_blocks(0.3, 4, seed=2).dense(256, 256)[::4, ::4]
    assert (grid != other).any()
    # A shorter sequence sees a prefix of the longer pattern.
    np.testing.assert_array_equal(m.dense(30, 17), m.dense(256, 256)[:30, :17])


def test_from_array_fits_and_is_zero_outside():
    arr = np.ones((4, 6), bool)
    m = from_array(arr)
    assert m.shape == (4, 6)
    np.testing.assert_array_equal(m.dense(3, 5), np.ones((3, 5), bool))
    assert not m.predicate(np.array([4, 0, -1]), np.array([0, 6, 0])).any()
    arr[0, 0] = False  # the mask holds a copy
    assert m.dense(1, 1)[0, 0]


# ----------------------------------------------------------------------------------------------
# Per-head and run-time masks.


def test_per_head_dense_and_combination():
    ph = per_head([causal(), local(1, 1), full()])
    assert ph.num_heads == 3
    d = ph.dense(4, 5)
    assert d.shape == (3, 4, 5)
    for h, m in enumerate([causal(), local(1, 1), full()]):
        np.testing.assert_array_equal(d[h], m.dense(4, 5))
        assert ph.for_head(h) == m
    both = ph & sink(2)
    np.testing.assert_array_equal(both.dense(4, 5), d & sink(2).dense(4, 5)[None])
    arr = np.random.default_rng(1).random((3, 4, 5)) < 0.5
    np.testing.assert_array_equal((ph | from_array(arr)).dense(4, 5), d | arr)
    # head= selects per element
    got = ph.predicate(np.arange(4)[:, None], np.arange(5)[None, :], head=np.array(1))
    np.testing.assert_array_equal(got, d[1])


def test_padding_dense_and_predicate():
    lengths = np.array([2, 5, 0])
    m = causal() & padding(lengths)
    assert m.is_dynamic and m.batch_size == 3
    d = m.dense(4, 5)
    assert d.shape == (3, 4, 5)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(d[b], causal().dense(4, 5) & (np.arange(5) < n))
    ph = per_head([causal(), full()]) | ~padding(lengths)
    d = ph.dense(4, 5)
    assert d.shape == (3, 2, 4, 5)
    np.testing.assert_array_equal(d[1, 0], causal().dense(4, 5) | (np.arange(5) >= 5))
    got = ph.predicate(np.arange(4)[:, None], np.arange(5)[None, :], head=1, batch=0)
    np.testing.assert_array_equal(got, d[0, 1])
    # jax lengths give a jax array
    d = padding(jnp.array([1, 3])).dense(2, 4)
    assert isinstance(d, jax.Array)
    np.testing.assert_array_equal(np.asarray(d)[:, 0], [[1, 0, 0, 0], [1, 1, 1, 0]])


def test_segments_dense_predicate_and_traced_ids():
    q_ids = np.array([[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]])
    kv_ids = np.array([[0, 1, 1, 1, 3, 3], [2, 2, 0, 2, 2, 2]])
    m = causal() & segments(q_ids, kv_ids)
    assert m.is_dynamic and m.batch_size == 2 and m.shape == (5, 6)
    d = m.dense(5, 6)
    want = causal().dense(5, 6)[None] & (q_ids[:, :, None] == kv_ids[:, None, :])
    np.testing.assert_array_equal(d, want)
    # self-attention: kv_ids defaults to q_ids
    np.testing.assert_array_equal(
        segments(q_ids).dense(5, 5), q_ids[:, :, None] == q_ids[:, None, :]
    )
    got = m.predicate(np.arange(5)[:, None], np.arange(6)[None, :], batch=1)
    np.testing.assert_array_equal(got, want[1])

    @jax.jit
    def traced(q_ids, kv_ids):  # ids known only at run time
        return (causal() & segments(q_ids, kv_ids)).dense(5, 6)

    np.testing.assert_array_equal(np.asarray(traced(q_ids, kv_ids)), want)
    # a layout of a segments mask is a static bound: every kept entry lies in a kept block
    layout = m.blocks(5, 6, 2, 2)
    assert layout.dynamic and not layout.block_is_full.any()
    upper = _reconstruct(layout)[0]
    assert not (want & ~upper[None, :5, :6]).any()


def test_predicate_inside_jit_matches_dense():
    lengths = jnp.array([3, 7])
    arr = np.random.default_rng(2).random((2, 9, 9)) < 0.5
    m = (
        (
            (causal() & (local(3, 0) | sink(2) | global_tokens([4])))
            | (random_blocks(0.5, 2, seed=3) & chunked(4))
            | strided(3)
            | fixed(3, 1)
            | dilated(2, 2)
        ).with_offset(1)
        & ~from_array(arr[:, :8])
        & padding(np.asarray(lengths))  # numpy lengths: dense() below is a numpy reference
    )
    q, kv = np.arange(6)[:, None], np.arange(8)[None, :]

    @jax.jit
    def f(q, kv, lengths):
        mm = m & padding(lengths)  # also a traced run-time mask
        return mm.predicate(q, kv)

    got = f(jnp.asarray(q), jnp.asarray(kv), lengths)
    want = np.asarray(m.dense(6, 8))
    assert got.shape == want.shape == (2, 2, 6, 8)
    np.testing.assert_array_equal(np.asarray(got), want)
    # One head and one batch element at a time, as a kernel would do.
    g = jax.jit(lambda h, b: m.predicate(jnp.asarray(q), jnp.asarray(kv), head=h, batch=b))
    np.testing.assert_array_equal(np.asarray(g(1, 0)), want[0, 1])


# ----------------------------------------------------------------------------------------------
# Algebra laws (hypothesis).

N = 12  # every generated mask fits [N, N]


def _leaves():
    opt = st.none() | st.integers(0, 4)
    return st.one_of(
        st.just(full()),
        st.just(causal()),
        st.builds(local, opt, opt),
        st.builds(dilated, st.integers(0, 3), st.integers(1, 3)),
        st.builds(strided, st.integers(1, 4)),
        st.integers(1, 4).flatmap(lambda b: st.builds(fixed, st.just(b), st.integers(0, b))),
        st.builds(sink, st.integers(0, 3)),
        st.builds(global_tokens, st.lists(st.integers(0, N), max_size=3)),
        st.builds(chunked, st.integers(1, 5)),
        st.builds(random_blocks, st.floats(0.05, 1.0), st.integers(1, 3), st.integers(-100, 100)),
        st.integers(0, 2**32 - 1).map(
            lambda s: from_array(np.random.default_rng(s).random((N, N)) < 0.5)
        ),
    )


MASKS = st.recursive(
    _leaves(),
    lambda ch: st.one_of(
        st.tuples(ch, ch).map(lambda t: t[0] & t[1]),
        st.tuples(ch, ch).map(lambda t: t[0] | t[1]),
        ch.map(lambda m: ~m),
        # Offsets only on length-free parts, so that every fixed shape stays (N, N).
        st.tuples(ch.filter(lambda m: m.shape is None), st.integers(0, 2)).map(
            lambda t: t[0].with_offset(t[1])
        ),
    ),
    max_leaves=5,
)
LENGTHS = st.tuples(st.integers(1, 8), st.integers(1, N))


def _fit(m, q_len, kv_len):
    if m.shape is not None:
        return min(q_len, m.shape[0]), min(kv_len, m.shape[1])
    return q_len, kv_len


@HYP
@given(MASKS, LENGTHS)
def test_complement_laws(a, lengths):
    q_len, kv_len = _fit(a, *lengths)
    assert not (a & ~a).dense(q_len, kv_len).any()
    assert (a | ~a).dense(q_len, kv_len).all()
    np.testing.assert_array_equal((~~a).dense(q_len, kv_len), a.dense(q_len, kv_len))


@HYP
@given(MASKS, MASKS, LENGTHS)
def test_commutativity_and_de_morgan(a, b, lengths):
    q_len, kv_len = _fit(a & b, *lengths)
    da, db = a.dense(q_len, kv_len), b.dense(q_len, kv_len)
    np.testing.assert_array_equal((a & b).dense(q_len, kv_len), da & db)
    np.testing.assert_array_equal((a & b).dense(q_len, kv_len), (b & a).dense(q_len, kv_len))
    np.testing.assert_array_equal((a | b).dense(q_len, kv_len), (b | a).dense(q_len, kv_len))
    np.testing.assert_array_equal((~(a & b)).dense(q_len, kv_len), (~a | ~b).dense(q_len, kv_len))
    np.testing.assert_array_equal((~(a | b)).dense(q_len, kv_len), (~a & ~b).dense(q_len, kv_len))


@HYP
@given(MASKS, st.integers(0, 3), LENGTHS)
def test_offset_is_a_row_shift(a, offset, lengths):
    q_len, kv_len = _fit(a.with_offset(offset), *lengths)
    big = a.dense(q_len + offset, kv_len)
    np.testing.assert_array_equal(a.with_offset(offset).dense(q_len, kv_len), big[offset:])


# ----------------------------------------------------------------------------------------------
# Block layouts.


def _reconstruct(layout):
    """Dense [H, q, kv] from the layout, written independently of BlockLayout.to_dense."""
    h_count, nq, _ = layout.kv_block_indices.shape
    bq, bk = layout.block_q, layout.block_kv
    nk = -(-layout.kv_len // bk)
    out = np.zeros((h_count, nq * bq, nk * bk), bool)
    for h, r in itertools.product(range(h_count), range(nq)):
        count = layout.kv_block_counts[h, r]
        assert (layout.kv_block_indices[h, r, count:] == masks.SENTINEL).all()
        assert not layout.block_is_full[h, r, count:].any()
        assert (layout.partial_mask_index[h, r, count:] == masks.SENTINEL).all()
        cols = layout.kv_block_indices[h, r, :count]
        assert (np.diff(cols) > 0).all() and (cols >= 0).all() and (cols < nk).all()
        for s in range(count):
            c = layout.kv_block_indices[h, r, s]
            tile = out[h, r * bq : (r + 1) * bq, c * bk : (c + 1) * bk]
            if layout.block_is_full[h, r, s]:
                assert layout.partial_mask_index[h, r, s] == masks.SENTINEL
                tile[...] = True
            else:
                tile[...] = layout.partial_masks[layout.partial_mask_index[h, r, s]]
    return out[:, : layout.q_len, : layout.kv_len]


def _check_layout(mask, q_len, kv_len, bq, bk):
    layout = mask.blocks(q_len, kv_len, bq, bk)
    dense = mask.dense(q_len, kv_len)
    dense3 = dense if mask.num_heads is not None else dense[None]
    h_count = dense3.shape[0]
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    assert layout.kv_block_indices.shape == (h_count, nq, layout.max_count)
    assert layout.kv_block_counts.shape == (h_count, nq)
    assert layout.partial_masks.shape[1:] == (bq, bk)
    assert layout.num_q_blocks == nq and layout.num_kv_blocks == nk
    assert (layout.q_len, layout.kv_len, layout.num_heads) == (q_len, kv_len, mask.num_heads)
    np.testing.assert_array_equal(_reconstruct(layout), dense3)
    np.testing.assert_array_equal(layout.to_dense(), dense)
    # Tight: kept <=> non-empty, full <=> all True (positions beyond the lengths count as False).
    padded = np.zeros((h_count, nq * bq, nk * bk), bool)
    padded[:, :q_len, :kv_len] = dense3
    tiles = padded.reshape(h_count, nq, bq, nk, bk)
    kind = np.where(tiles.all(axis=(2, 4)), 2, np.where(tiles.any(axis=(2, 4)), 1, 0))
    np.testing.assert_array_equal(layout.block_mask(), kind)
    # Partial masks are deduplicated, and every one of them is used.
    flat = layout.partial_masks.reshape(layout.partial_masks.shape[0], bq * bk)
    assert len({row.tobytes() for row in flat}) == flat.shape[0]
    used = layout.partial_mask_index[layout.partial_mask_index >= 0]
    assert set(used.tolist()) == set(range(flat.shape[0]))
    assert layout.density == pytest.approx(dense3.mean())
    assert layout.block_density == pytest.approx((kind > 0).mean())
    assert not layout.dynamic
    return layout


BLOCK_SIZES = [(1, 1), (2, 3), (4, 4), (3, 8), (16, 16)]


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_match_dense(name):
    mask, _ = CASES[name]
    for (q_len, kv_len), (bq, bk), offset in itertools.product(
        [(9, 9), (10, 7), (4, 13)], BLOCK_SIZES, [0, 2]
    ):
        m = mask.with_offset(offset)
        _check_layout(m, *_fit(m, q_len, kv_len), bq, bk)


@HYP
@given(MASKS, LENGTHS, st.integers(1, 5), st.integers(1, 5))
def test_blocks_match_dense_random_masks(mask, lengths, bq, bk):
    _check_layout(mask, *_fit(mask, *lengths), bq, bk)


def test_blocks_per_head():
    arr = np.random.default_rng(3).random((2, 20, 20)) < 0.3
    heads = [causal(), causal() & local(3, 0), strided(4), causal()]
    for mask in [
        per_head(heads),
        per_head(heads) & sink(2).with_offset(1),
        from_array(arr),
        per_head([full(), chunked(4)]) | from_array(arr),
        per_head([causal(), full()]) & from_array(arr[0]),  # 2-D array with per-head
    ]:
        for bq, bk in [(4, 4), (3, 7), (8, 2)]:
            layout = _check_layout(mask, 19, 17, bq, bk)
            assert layout.num_heads == mask.num_heads


def test_blocks_examples():
    layout = causal().blocks(8, 8, 4, 4)
    assert layout.kv_block_indices.tolist() == [[[0, -1], [0, 1]]]
    assert layout.block_is_full.tolist() == [[[False, False], [True, False]]]
    assert layout.partial_mask_index.tolist() == [[[0, -1], [-1, 0]]]
    np.testing.assert_array_equal(layout.partial_masks[0], np.tril(np.ones((4, 4), bool)))
    assert layout.density == pytest.approx(36 / 64)
    assert layout.block_density == pytest.approx(3 / 4)
    # Non-divisible lengths: the edge blocks are partial, even when the mask is full.
    layout = full().blocks(5, 3, 4, 2)
    assert layout.block_mask().tolist() == [[[2, 1], [1, 1]]]
    # An empty mask keeps no block but still has one (sentinel) slot per row.
    layout = sink(0).blocks(4, 4, 2, 2)
    assert layout.kv_block_counts.tolist() == [[0, 0]] and layout.max_count == 1
    assert layout.density == 0.0


def test_blocks_cached_and_read_only():
    a = (causal() & local(5, 0)).blocks(64, 64, 8, 8)
    b = (causal() & local(5, 0)).blocks(64, 64, 8, 8)
    assert a is b
    with pytest.raises(ValueError):
        a.kv_block_indices[0, 0, 0] = 3


def test_blocks_of_a_long_sequence():
    # (How long this takes is a benchmark's question, not a test's: no timing here.)
    m = causal() & (local(1024, 0) | sink(4) | global_tokens([0, 4000]))
    layout = m.blocks(8192, 8192, 128, 128)
    assert layout.kv_block_counts[0, -1] == 1 + 9 + 1  # sink/global column + window + global
    assert layout.kv_block_counts[0, 31] == 32  # global row 4000 (block 31) sees everything


def test_blocks_dynamic_is_conservative():
    kv_len = 11
    for static, build in [
        (causal(), lambda s, p: s & p),
        (causal(), lambda s, p: s | p),
        (local(2, 1), lambda s, p: s & ~p),
        (per_head([causal(), sink(3)]), lambda s, p: s & p),
    ]:
        # all possible lengths at once: padding(lengths) with batch = kv_len + 1
        lengths = np.arange(kv_len + 1)
        mask = build(static, padding(lengths))
        layout = mask.blocks(9, kv_len, 4, 3)
        assert layout.dynamic
        upper = _reconstruct(layout)  # [H, q, kv]
        dense = mask.dense(9, kv_len)  # [B, H?, q, kv]
        dense = dense if mask.num_heads is not None else dense[:, None]
        assert not (dense & ~upper[None]).any()  # the layout covers every batch element
        # Blocks marked full are full for every batch element; empty are empty for all.
        kind = layout.block_mask()
        tiles = np.zeros((len(lengths), upper.shape[0], 12, 12), bool)
        tiles[:, :, :9, :kv_len] = dense
        tiles = tiles.reshape(len(lengths), upper.shape[0], 3, 4, 4, 3)
        assert tiles.all(axis=(3, 5))[:, kind == 2].all()
        assert not tiles.any(axis=(3, 5))[:, kind == 0].any()
    # causal & padding: kept/full are those of causal alone, except that no block is full.
    layout = (causal() & padding(np.array([3]))).blocks(8, 8, 4, 4)
    assert layout.kv_block_indices.tolist() == [[[0, -1], [0, 1]]]
    assert not layout.block_is_full.any()


def test_blocks_dynamic_with_traced_lengths():
    @jax.jit
    def f(lengths):
        layout = (causal() & padding(lengths)).blocks(8, 8, 4, 4)
        return jnp.asarray(layout.kv_block_counts) + lengths.sum()

    np.testing.assert_array_equal(f(jnp.array([1, 2])), [[4, 5]])


# ----------------------------------------------------------------------------------------------
# Splash attention masks.


def _splash_dense(sp, shape):
    return np.asarray(sp[tuple(slice(0, n) for n in shape)])


@pytest.mark.parametrize(
    ("mask", "kind"),
    [
        (full(), sm.FullMask),
        (causal(), sm.CausalMask),
        (causal().with_offset(3), sm.CausalMask),
        (local(3, 1), sm.LocalMask),
        (local(None, 0).with_offset(2), sm.LocalMask),
        (chunked(4) & causal(), sm.ChunkedCausalMask),
        (causal() & local(4, 0), sm.LogicalAnd),
        ((causal() | local(2, 2)).with_offset(1), sm.LogicalOr),
        (causal() & (local(3, 0) | sink(2)), sm.NumpyMask),
        (~causal(), sm.NumpyMask),
        (strided(3), sm.NumpyMask),
        (from_array(EYEISH), sm.NumpyMask),
    ],
)
def test_to_splash_matches_dense(mask, kind):
    q_len, kv_len = _fit(mask, 10, 12)
    sp = mask.to_splash(q_len, kv_len)
    assert isinstance(sp, kind)
    assert sp.shape == (q_len, kv_len)
    np.testing.assert_array_equal(_splash_dense(sp, (q_len, kv_len)), mask.dense(q_len, kv_len))
    multi = mask.to_splash(q_len, kv_len, num_heads=2)
    assert isinstance(multi, sm.MultiHeadMask) and multi.shape == (2, q_len, kv_len)
    np.testing.assert_array_equal(
        _splash_dense(multi, (2, q_len, kv_len)), np.stack([mask.dense(q_len, kv_len)] * 2)
    )
    hash(sp)  # splash uniquifies masks through hashing


def test_to_splash_per_head():
    mask = per_head([causal(), local(2, 0), strided(2)]) & sink(5)
    sp = mask.to_splash(8, 8)
    assert isinstance(sp, sm.MultiHeadMask) and sp.shape == (3, 8, 8)
    np.testing.assert_array_equal(_splash_dense(sp, (3, 8, 8)), mask.dense(8, 8))
    assert isinstance(per_head([causal(), causal()]).to_splash(8, 8).masks[0], sm.CausalMask)


def test_splash_kernel_runs_with_converted_mask():
    """The converted mask drives the real splash kernel (interpret mode on CPU)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    t, d = 256, 32
    mask = per_head([causal(), causal() & (local(40, 0) | sink(4))])
    names = "block_q block_kv block_kv_compute block_q_dkv block_kv_dkv block_kv_dkv_compute"
    sizes = dict.fromkeys([*names.split(), "block_q_dq", "block_kv_dq"], 128)
    kernel = sa.make_splash_mha(
        mask.to_splash(t, t),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sa.BlockSizes(**sizes),
        interpret=True,
    )
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, t, d))
    scores = jnp.where(mask.dense(t, t), jnp.einsum("htd,hsd->hts", q, k), -jnp.inf)
    want = jnp.einsum("hts,hsd->htd", jax.nn.softmax(scores, axis=-1), v)
    np.testing.assert_allclose(kernel(q, k, v), want, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: local(-1, 0), ValueError, r"local: `left` must be .*\[0, .*got -1"),
        (lambda: local(0, 1.5), TypeError, r"local: `right` must be an int.*got 1\.5"),
        (lambda: dilated(2, 0), ValueError, r"dilated: `dilation` must be .*\[1, .*got 0"),
        (lambda: dilated(-3, 1), ValueError, r"dilated: `window` .*got -3"),
        (lambda: strided(0), ValueError, r"strided: `stride` must be an int in \[1, .*got 0"),
        (lambda: fixed(4, 5), ValueError, r"fixed: `summary` must be an int in \[0, 4\]; got 5"),
        (lambda: fixed(0, 0), ValueError, r"fixed: `block` .*got 0"),
        (lambda: sink(True), TypeError, r"sink: `n` must be an int.*got True"),
        (lambda: chunked(0), ValueError, r"chunked: `size` must be .*got 0"),
        (lambda: global_tokens([1, -2]), ValueError, r"global_tokens: `indices\[1\]`.*got -2"),
        (lambda: global_tokens("ab"), TypeError, r"global_tokens: indices must be"),
        (lambda: random_blocks(0.0, 2, 0), ValueError, r"density must be .*\(0, 1\], got 0\.0"),
        (lambda: random_blocks(1.5, 2, 0), ValueError, r"density .*got 1\.5"),
        (lambda: random_blocks(0.5, 0, 0), ValueError, r"random_blocks: `block` .*got 0"),
        (lambda: random_blocks(0.5, 2, 1.0), TypeError, r"random_blocks: seed must be an int"),
        (lambda: from_array(np.ones((3, 3))), TypeError, r"from_array: array must have dtype"),
        (lambda: from_array(np.ones(3, bool)), ValueError, r"shape \[q, kv\].*got shape \(3,\)"),
        (lambda: padding(np.array([1.0])), TypeError, r"padding: lengths must be integers"),
        (lambda: padding(np.array([2, -1])), ValueError, r"padding: lengths must be >= 0"),
        (lambda: padding(np.ones((2, 2), int)), ValueError, r"padding: lengths must be a 1-D"),
        (lambda: segments([[0.0, 1.0]]), TypeError, r"segments: q_ids must be integers"),
        (lambda: segments([0, 1]), ValueError, r"segments: q_ids must be a 2-D .*shape \(2,\)"),
        (
            lambda: segments([[0, 1]], [[0, 1], [1, 1]]),
            ValueError,
            r"segments: q_ids and kv_ids must have the same batch size",
        ),
        (
            lambda: (causal() & segments([[0, 1, 1]])).dense(4, 4),
            ValueError,
            r"does not fit this mask of fixed shape \(3, 3\) \(from_array or segments\)",
        ),
        (lambda: per_head([]), ValueError, r"per_head: masks must be a non-empty"),
        (lambda: per_head([causal(), 3]), TypeError, r"per_head: masks\[1\] must be a "),
        (
            lambda: per_head([causal(), from_array(np.ones((4, 4), bool))]),
            ValueError,
            r"per_head: masks\[1\] has shape \(4, 4\)",
        ),
        (
            lambda: per_head([per_head([causal()])]),
            ValueError,
            r"masks\[0\] is already per-head",
        ),
        (
            lambda: per_head([causal(), full()]) & per_head([causal()] * 3),
            ValueError,
            r"&: operands have mismatched num_heads: 2 and 3",
        ),
        (
            lambda: from_array(np.ones((2, 3), bool)) | from_array(np.ones((3, 3), bool)),
            ValueError,
            r"\|: operands have mismatched shapes",
        ),
        (
            lambda: padding([1, 2]) & padding([1, 2, 3]),
            ValueError,
            r"mismatched batch sizes: 2 and 3",
        ),
        (lambda: causal() & 1, TypeError, r"&: right operand must be a sparse_jax.masks.Mask"),
        (lambda: bool(causal()), TypeError, r"no truth value"),
        (lambda: causal().with_offset(-1), ValueError, r"with_offset: `offset` .*got -1"),
        (
            lambda: from_array(np.ones((2, 3), bool)).with_offset(2),
            ValueError,
            r"offset=2 leaves no query row.*allowed: offset < 2",
        ),
        (lambda: causal().dense(0, 3), ValueError, r"dense: `q_len` must be .*got 0"),
        (
            lambda: from_array(np.ones((2, 3), bool)).dense(2, 4),
            ValueError,
            r"dense: \(q_len, kv_len\) = \(2, 4\) does not fit .*kv_len <= 3",
        ),
        (
            lambda: from_array(np.ones((2, 3), bool)).blocks(3, 3, 2, 2),
            ValueError,
            r"blocks: .*does not fit",
        ),
        (lambda: causal().blocks(4, 4, 0, 2), ValueError, r"blocks: `block_q` .*got 0"),
        (lambda: per_head([causal()]).for_head(1), ValueError, r"for_head: `head` .*got 1"),
        (
            lambda: (causal() & padding([3])).to_splash(4, 4),
            ValueError,
            r"to_splash: run-time masks \(padding, segments\)",
        ),
        (
            lambda: per_head([causal()] * 2).to_splash(4, 4, num_heads=3),
            ValueError,
            r"num_heads=3 does not match .* 2 heads",
        ),
        (
            lambda: causal().predicate(np.array([0.5]), np.array([0])),
            TypeError,
            r"predicate: q_idx must be an integer array",
        ),
    ],
)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_from_array_rejects_traced():
    with pytest.raises(TypeError, match="from_array: array must be concrete"):
        jax.jit(lambda a: from_array(a).dense(2, 2))(jnp.ones((2, 2), bool))


# ----------------------------------------------------------------------------------------------
# Equality, hashing, docs.


def test_equality_and_hash():
    assert causal() & local(3, 0) == causal() & local(3, 0)
    assert hash(causal() & local(3, 0)) == hash(causal() & local(3, 0))
    assert local(3, 0) != local(3, 1)
    a = np.eye(3, dtype=bool)
    assert from_array(a) == from_array(a.copy()) and hash(from_array(a)) == hash(from_array(a))
    assert from_array(a) != from_array(~a)
    assert global_tokens([3, 1, 3]) == global_tokens((1, 3))
    assert "causal" in repr(causal() & ~sink(2)).lower()


def test_tile_expression_equals_the_mask_on_every_tile():
    """The kernels' tile expression, given a batch element's padding length and same-segment
    tile, is the mask's own predicate there, for run-time leaves under | and ~ and static
    leaves of every kind it takes (shifted ones included)."""
    lengths = np.array([3, 9])
    ids = np.array([[0] * 5 + [1] * 7, [2] * 12])
    pad, seg = masks.padding(lengths), masks.segments(ids)
    cases = [
        masks.causal() | pad,
        (masks.causal() & seg) | masks.sink(2),
        ~pad & (masks.local(3, 1) | ~seg),
        (masks.strided(3) | masks.dilated(2, 2) | masks.fixed(4, 1)) & ~(pad | seg),
        masks.chunked(4).with_offset(2) | (masks.full() & pad),
    ]
    rows, keys = np.arange(12)[:, None], np.arange(12)[None, :]
    for mask in cases:
        expr = masks.tile_expression(mask)
        assert isinstance(expr, masks.TileExpression), (mask, expr)
        assert expr.uses_padding == bool(masks.runtime_leaves(mask)[0])
        assert expr.uses_segments == bool(masks.runtime_leaves(mask)[1])
        for b in range(2):
            same = jnp.asarray(ids[b][:, None] == ids[b][None, :])
            got = expr(jnp.asarray(rows), jnp.asarray(keys), key_length=lengths[b],
                       same_segment=same)  # fmt: skip
            want = mask.predicate(rows, keys, batch=np.int32(b))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=repr(mask))


def test_tile_expression_says_why_a_mask_has_none():
    pad = masks.padding(np.array([4]))
    cases = {
        "the mask is static": masks.causal(),
        "at most one `padding` leaf": pad | masks.padding(np.array([2])),
        "at most one `segments` leaf": masks.segments([[0, 1]]) | masks.segments([[1, 1]]),
        "under with_offset": (masks.causal() | pad).with_offset(1),
        "per-head masks": masks.per_head([masks.causal(), masks.full()]) | pad,
        "global_tokens is not evaluated": masks.global_tokens([0]) | pad,
        "random_blocks is not evaluated": masks.random_blocks(0.5, 4, 0) | pad,
    }
    for why, mask in cases.items():
        got = masks.tile_expression(mask)
        assert isinstance(got, str) and why in got, (mask, got)
    with pytest.raises(TypeError, match="tile_expression"):
        masks.tile_expression("causal")
