"""Tests of sparse_jax.dynamic.BlockSelection, the data-dependent candidate mask: its dense mask
against a numpy ranking of each query's mean block scores, its count against ``entries`` (the
same for every input), its attention against ``sparse_jax.attention`` under the dense mask
(values and gradients, grouped-query heads, lengths that are not multiples of the block), the
selection read token by token into a cache equal to the whole-sequence one, strict causality
(changing a later token changes no earlier row), and argument errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.dispatch import attention
from sparse_jax.dynamic import BlockSelection
from sparse_jax.models.selections import gathers
from tests.engines import engine_trace, engines_used

TOL = {"rtol": 1e-5, "atol": 1e-5}


def inputs(t=11, n=4, kh=2, d=8, b=2, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, n, d))
    k = jax.random.normal(kk, (b, t, kh, d))
    v = jax.random.normal(kv, (b, t, kh, d))
    return q, k, v


def reference_mask(sel, q, k):
    """numpy, loop by loop: per (batch, head, query) the own block and the local_blocks - 1
    before it, plus the keep_blocks earlier blocks of highest scale·q·mean(k_block) (ties to the
    lower block), then causal."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, t, n, d = q.shape
    g = n // k.shape[2]
    out = np.zeros((b, n, t, t), bool)
    for bi in range(b):
        for h in range(n):
            for i in range(t):
                own = i // sel.block
                blocks = {c for c in range(own - sel.local_blocks + 1, own + 1) if c >= 0}
                earlier = list(range(0, own - sel.local_blocks + 1))
                means = [
                    k[bi, c * sel.block : (c + 1) * sel.block, h // g].mean(0) for c in earlier
                ]
                score = [d**-0.5 * q[bi, i, h] @ m for m in means]
                order = sorted(range(len(earlier)), key=lambda j: (-score[j], j))
                blocks |= {earlier[j] for j in order[: sel.keep_blocks]}
                for c in blocks:
                    out[bi, h, i, c * sel.block : min((c + 1) * sel.block, i + 1)] = True
    return out


@pytest.mark.parametrize(
    "keep, block, local", [(0, 3, 1), (1, 3, 1), (2, 2, 1), (1, 2, 2), (5, 3, 1)]
)
def test_the_dense_mask_is_the_ranking_of_mean_block_scores_and_counts_entries(keep, block, local):
    sel = BlockSelection(keep_blocks=keep, block=block, local_blocks=local)
    q, k, _ = inputs()
    m = np.asarray(sel.dense(q, k))
    assert m.dtype == np.bool_ and m.shape == (2, 4, 11, 11)
    np.testing.assert_array_equal(m, reference_mask(sel, q, k))
    # The count is data-independent: every batch element and head allows `entries` scores.
    np.testing.assert_array_equal(m.sum((-1, -2)), sel.entries(11, 11))


def test_entries_and_formed_by_position():
    sel = BlockSelection(keep_blocks=1, block=4)
    # Query p keeps its own block up to p, plus one earlier block of 4 from p = 4 on.
    per_query = [p % 4 + 1 + (4 if p >= 4 else 0) for p in range(10)]
    assert sel.entries(10, 10) == sum(per_query)
    assert sel.entries(3, 10) == sum(per_query[-3:])  # the last 3 of 10 positions
    # Formed: whole blocks, one for p < 4 and two after.
    assert sel.formed(10) == 4 * (4 * 1 + 6 * 2)
    assert BlockSelection(keep_blocks=0, block=4).formed(10) == 40


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_attention_is_attention_under_the_dense_mask_values_and_gradients(normalizer):
    sel = BlockSelection(keep_blocks=1, block=3)
    q, k, v = inputs()
    mask = sel.dense(q, k)

    def ours(q, k, v):
        return sel.attention(q, k, v, normalizer=normalizer)

    def reference(q, k, v):
        return attention(q, k, v, mask=mask, normalizer=normalizer, impl="xla")

    np.testing.assert_allclose(ours(q, k, v), reference(q, k, v), **TOL)

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)

    for ga, gb in zip(grads(ours), grads(reference), strict=True):
        np.testing.assert_allclose(ga, gb, **TOL)


def test_token_by_token_selection_equals_the_whole_sequence():
    sel = BlockSelection(keep_blocks=2, block=2)
    q, k, _ = inputs(t=9)
    whole = sel.dense(q, k)
    step = jax.jit(lambda q, k, i: sel.dense(q, k, q_offset=i))
    for i in range(9):
        # A cache of 9 slots written up to i; later slots hold junk the selection must not see.
        cache = k.at[:, i + 1 :].set(1e3)
        row = step(q[:, i : i + 1], cache, i)
        np.testing.assert_array_equal(row[:, :, 0], whole[:, :, i])


def test_a_later_token_changes_no_earlier_row():
    sel = BlockSelection(keep_blocks=1, block=2)
    q, k, v = inputs(t=10)
    out = sel.attention(q, k, v)
    later = 7
    k2 = k.at[:, later:].multiply(-3.0)
    v2 = v.at[:, later:].add(5.0)
    out2 = sel.attention(q, k2, v2)
    np.testing.assert_allclose(out2[:, :later], out[:, :later], **TOL)
    assert not np.allclose(out2[:, later:], out[:, later:])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"keep_blocks": -1}, "keep_blocks"),
        ({"keep_blocks": 1.5}, "keep_blocks"),
        ({"keep_blocks": 1, "block": 0}, "block"),
        ({"keep_blocks": 1, "local_blocks": 0}, "local_blocks"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        BlockSelection(**kwargs)


# ---------------------------------------------------------------------------------------------
# A selection as a candidate of CandidateMaskAttention (the learned search offers it).


def _selection_work(fn, *args):
    """The primitives ``fn(*args)`` runs under the scope of BlockSelection.attention (its gather
    engine; empty when the selection only made a dense mask)."""
    return {p for stack, p in engine_trace(fn, *args) if "sparse_jax/block_selection" in stack}


def _layer(cands, logits, **kw):
    from sparse_jax.models.layers import CandidateMaskAttention

    layer = CandidateMaskAttention(2, cands, granularity="head", **kw)
    layer.logits[...] = jnp.asarray(logits, jnp.float32)
    return layer


def _window(w):
    from sparse_jax import masks

    return masks.causal() & masks.local(w - 1, 0)


@pytest.mark.parametrize("combine", ["soft_union", "soft_mask"])
def test_a_selection_enters_the_soft_combine_as_its_chosen_blocks(combine):
    """The log-bias of each head recomputed in numpy from the selection's reference mask and a
    2-key window: noisy-OR ``1 - Π(1 - w M)`` or sum ``Σ w M``, per batch element and head."""
    sel = BlockSelection(keep_blocks=1, block=3)
    layer = _layer([sel, _window(2)], [[0.7, -1.2], [-0.4, 2.0]], combine=combine)
    q, k, v = inputs(n=2, kh=2)
    out, _ = layer(q, k, v)
    w = np.asarray(layer.weights(), np.float64)[None, :, None, None, :]  # [1, N, 1, 1, C]
    window = np.tri(11, dtype=bool) & ~np.tri(11, k=-2, dtype=bool)
    m = np.stack(np.broadcast_arrays(reference_mask(sel, q, k), window), axis=-1)  # [B,N,T,T,C]
    if combine == "soft_union":
        a = 1.0 - np.prod(np.where(m, 1.0 - w * (1 - 1e-7), 1.0), axis=-1)
    else:
        a = np.sum(w * m, axis=-1)
    allowed = m.any(-1)
    bias = np.where(allowed, np.log(np.where(allowed, a, 1.0)), -np.inf).astype(np.float32)
    np.testing.assert_allclose(out, attention(q, k, v, mask=allowed, bias=bias), **TOL)


def test_a_kept_selection_is_attention_under_its_chosen_blocks():
    """Weights exactly 0/1 (sparsemax rows): head 0 keeps the selection, head 1 the window."""
    sel = BlockSelection(keep_blocks=1, block=3)
    layer = _layer([sel, _window(2)], [[5.0, -5.0], [-5.0, 5.0]], weighting="sparsemax")
    np.testing.assert_array_equal(np.asarray(layer.weights()), [[1.0, 0.0], [0.0, 1.0]])
    q, k, v = inputs(n=2, kh=2)
    window = np.tri(11, dtype=bool) & ~np.tri(11, k=-2, dtype=bool)
    chosen = reference_mask(sel, q, k)
    want = np.stack(np.broadcast_arrays(chosen[:, 0], window), axis=1)
    np.testing.assert_allclose(layer(q, k, v)[0], attention(q, k, v, mask=want), **TOL)


def test_the_selections_weight_learns_from_the_loss():
    sel = BlockSelection(keep_blocks=1, block=3)
    layer = _layer([sel, _window(2), _window(11)], [[0.5, 0.2, -0.3]] * 2)
    q, k, v = inputs(n=2, kh=2)

    def loss(layer):
        return jnp.sum(layer(q, k, v)[0] ** 2)

    grad = nnx.grad(loss)(layer).logits[...]
    assert np.all(np.abs(np.asarray(grad[:, 0])) > 1e-6), grad


def test_mixture_runs_the_selection_engine_and_decodes_token_by_token():
    sel = BlockSelection(keep_blocks=1, block=3)
    layer = _layer([sel, _window(3)], [[1.0, -1.0], [0.0, 2.0]], combine="mixture")
    q, k, v = inputs(n=2, kh=2)
    out, _ = layer(q, k, v)
    pi = np.asarray(layer.weights())
    pi = pi / pi.sum(axis=1, keepdims=True)
    parts = [sel.attention(q, k, v), attention(q, k, v, mask=_window(3))]
    want = sum(p * pi[None, None, :, c, None] for c, p in enumerate(parts))
    np.testing.assert_allclose(out, want, **TOL)
    # The whole call runs the selection's gather engine, not a dense mask.
    # At 11 tokens it runs the dense mask; at 1024 (its blocks under 1/64 of the scores) the
    # selection's gather engine.
    assert not gathers(sel, 11) and gathers(sel, 1024)
    assert not _selection_work(lambda q, k, v: layer(q, k, v)[0], q, k, v)
    long = inputs(t=1024, n=2, kh=2, b=1)
    assert "gather" in _selection_work(lambda q, k, v: layer(q, k, v)[0], *long)
    # Token by token into a cache of 11 slots, unwritten slots junk: the same rows.
    junk = 1e3 * jnp.ones_like(k)
    rows = []
    for t in range(11):
        kc = jnp.where(jnp.arange(11)[None, :, None, None] <= t, k, junk)
        vc = jnp.where(jnp.arange(11)[None, :, None, None] <= t, v, junk)
        rows.append(layer(q[:, t : t + 1], kc, vc, q_offset=jnp.int32(t))[0])
    np.testing.assert_allclose(jnp.concatenate(rows, axis=1), out, **TOL)


def test_soft_union_decodes_token_by_token():
    sel = BlockSelection(keep_blocks=1, block=2, local_blocks=2)
    layer = _layer([sel, _window(2)], [[0.3, 1.0], [-0.5, 0.2]])
    q, k, v = inputs(n=2, kh=2)
    whole, _ = layer(q, k, v)
    junk = -7.0 * jnp.ones_like(k)
    rows = []
    for t in range(11):
        kc = jnp.where(jnp.arange(11)[None, :, None, None] <= t, k, junk)
        rows.append(layer(q[:, t : t + 1], kc, v, q_offset=jnp.int32(t))[0])
    np.testing.assert_allclose(jnp.concatenate(rows, axis=1), whole, **TOL)


def test_a_selections_prices_are_its_counts():
    from sparse_jax.blocksparse import blocksparse_cost
    from sparse_jax.masks import causal
    from sparse_jax.models.flops import attention_scores

    sel, win = BlockSelection(keep_blocks=2, block=4), _window(4)
    layer = _layer([sel, win, causal()], [[1.0, 1.0, 1.0]] * 2, block_size=(4, 4))
    q, k, _ = inputs(t=16, n=2, kh=2, b=1)
    counted = int(np.sum(reference_mask(sel, q, k)[0, 0]))  # one input's entries
    causal_entries = 16 * 17 // 2
    np.testing.assert_allclose(layer.causal_shares(16, 16)[0], counted / causal_entries)
    np.testing.assert_allclose(layer.candidate_densities(16)[0], counted / 256)
    # Its engine forms whole blocks: own block + min(2, earlier) blocks of 4 per query.
    formed = sum(4 * (1 + min(2, p // 4)) for p in range(16))
    causal_formed = blocksparse_cost(causal().blocks(16, 16, 4, 4), batch=1, num_heads=1,
                                     head_dim=1).computed_scores  # fmt: skip
    np.testing.assert_allclose(layer.block_costs(16)[0], formed / causal_formed)
    mixture = _layer([sel, causal()], [[1.0, 1.0]] * 2, combine="mixture")
    assert mixture.scores_formed(16, batch=3, head_dim=8) == 3 * 2 * (16 * 16 + 16 * 16)
    gathered = sum(4 * (1 + min(2, p // 4)) for p in range(1024))  # the gather engine's blocks
    causal_scores = attention_scores(causal(), 1024, batch=3, num_heads=2, head_dim=8)[0]
    assert mixture.scores_formed(1024, batch=3, head_dim=8) == 3 * 2 * gathered + causal_scores
    from sparse_jax.models.layers import mask_at

    only = _layer([sel, win], [[1.0, 1.0]] * 2)  # a selection may choose any earlier block
    np.testing.assert_array_equal(mask_at(only.allowed_mask(), 16, 16), np.tri(16, dtype=bool))


def test_head_densities_count_a_selection_and_bound_a_union():
    sel, win = BlockSelection(keep_blocks=1, block=4), _window(3)
    # Head 0 keeps the selection alone (exact: its count), head 1 the selection and the window.
    layer = _layer([sel, win], [[5.0, -5.0], [5.0, 5.0]])
    dens = np.asarray(layer.head_densities(16))
    np.testing.assert_allclose(dens[0], sel.entries(16, 16) / 256, rtol=1e-6)
    window = np.tri(16, dtype=bool) & ~np.tri(16, k=-3, dtype=bool)
    for seed in range(3):  # an upper bound of every input's union, at least the selection's
        q, k, _ = inputs(t=16, n=2, kh=2, b=1, seed=seed)
        union = reference_mask(sel, q, k)[0, 1] | window
        assert dens[0] <= union.mean() <= dens[1] + 1e-7
    # The bound: the fixed local part and window unioned, plus 4 chosen entries per row from 4 on.
    own = np.arange(16) // 4
    fixed = (own[None, :] == own[:, None]) & np.tri(16, dtype=bool) | window
    rows = np.minimum(fixed.sum(1) + 4 * (own >= 1), np.arange(1, 17))
    np.testing.assert_allclose(dens[1], rows.sum() / 256, rtol=1e-6)


def test_head_masks_of_a_kept_selection_point_to_head_parts():
    sel = BlockSelection(keep_blocks=1, block=4)
    layer = _layer([sel, _window(3)], [[5.0, -5.0], [-5.0, 5.0]])
    with pytest.raises(ValueError, match=r"heads \[0\] keep a BlockSelection .* head_parts"):
        layer.head_masks()
    assert layer.head_masks([[False, True], [False, True]]) == (_window(3), _window(3))
    masks, selected = layer.head_parts([[True, True], [False, True]])
    assert masks == (_window(3), _window(3)) and selected.tolist() == [[True], [False]]


def _student_with_a_selection():
    """A tiny GPT-2 student (3 heads a block) whose sigmoid weights are 1 or e^-30: head 0
    keeps the selection alone, head 1 the selection and a 3-key window, head 2 the window; the
    noisy-OR of such weights is the union (up to e^-30), so hardening is exact."""
    from sparse_jax.models.gpt2 import GPT2, AttentionSpec, GPT2Config

    sel = BlockSelection(keep_blocks=1, block=4)
    spec = AttentionSpec(kind="candidates", candidates=(sel, _window(3)), granularity="head",
                         combine="soft_union")  # fmt: skip
    student = GPT2(GPT2Config.preset("tiny"), spec, rngs=nnx.Rngs(0))
    for block in student.h:
        block.attn.core.logits[...] = jnp.array([[30.0, -30.0], [30.0, 30.0], [-30.0, 30.0]])
    return student, sel


def test_a_hardened_selection_head_computes_the_students_function():
    from sparse_jax.models import harden
    from sparse_jax.models.gpt2 import generate
    from sparse_jax.models.hardening import harden_plan
    from sparse_jax.models.layers import SELF, FixedAttention, mask_at
    from sparse_jax.models.selections import union_density_bound

    student, sel = _student_with_a_selection()
    plan = harden_plan(student, length=16, price="blocks")
    assert plan.head_masks[0] == (SELF, _window(3), _window(3))
    assert plan.selections[0] == (sel,)
    assert plan.head_selections[0].tolist() == [[True], [True], [False]]
    bounds = [union_density_bound(SELF, [sel], 16), union_density_bound(_window(3), [sel], 16)]
    window = float(np.tri(16, dtype=bool)[np.triu_indices(16, -2)].sum()) / 256
    np.testing.assert_allclose(plan.density, np.mean([*bounds, window]), rtol=1e-6)
    hard = harden(student)
    core = hard.h[1].attn.core
    assert isinstance(core, FixedAttention) and core.selections == (sel,)
    assert core.selected == ((True,), (True,), (False,))
    # FLOPs: head 0 forms its selection's blocks (gather engine), heads 1 and 2 every entry;
    # the layer may attend to any causal pair.
    assert core.scores_formed(16, batch=2, head_dim=16) == 2 * 3 * 256  # 16: dense masks
    assert core.scores_formed(1024, batch=1, head_dim=16) == sel.formed(1024) + 2 * 1024**2
    assert np.all(mask_at(core.allowed_mask(), 16, 16) == np.tri(16, dtype=bool))  # every head
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, student.config.vocab_size)
    np.testing.assert_allclose(hard(ids), student(ids), rtol=1e-4, atol=1e-4)
    # Decoding into a cache selects the same blocks as the whole sequence.
    out, logits = generate(hard, ids[:, :9], 6, temperature=0.0, return_logits=True)
    np.testing.assert_allclose(logits, hard(out)[:, 8:-1], rtol=1e-4, atol=1e-4)
    # Head 0 (the selection alone) runs the selection's gather engine, heads 1 and 2 the XLA
    # engine on their dense masks; decoding runs every head on dense masks.
    assert engines_used(hard, ids) == {"xla"} and not _selection_work(hard, ids)
    core = hard.h[0].attn.core
    q, k, v = inputs(t=16, n=3, kh=3, d=16, b=1)
    assert not _selection_work(lambda q, k, v: core(q, k, v, q_offset=jnp.int32(15))[0],
                               q[:, -1:], k, v)  # fmt: skip
    q, k, v = inputs(t=1024, n=3, kh=3, d=16, b=1)  # long enough for the gather engine
    assert "gather" in _selection_work(lambda q, k, v: core(q, k, v)[0], q, k, v)
    everyone = FixedAttention(3, mask=SELF, selections=[sel])  # every head on the selection
    np.testing.assert_allclose(everyone(q, k, v)[0], sel.attention(q, k, v), **TOL)
    np.testing.assert_allclose(everyone(q, k, v)[0], attention(q, k, v, mask=sel.dense(q, k)),
                               **TOL)  # fmt: skip


def test_fixed_attention_refuses_bad_selections():
    from sparse_jax.models.layers import FixedAttention

    with pytest.raises(TypeError, match=r"selections\[0\] must be a sparse_jax.dynamic"):
        FixedAttention(2, selections=[_window(2)])
    with pytest.raises(ValueError, match=r"`selected` must be a bool array of shape \(2, 1\)"):
        FixedAttention(2, selections=[BlockSelection(1, 4)], selected=[[True]])
    with pytest.raises(ValueError, match=r"`impl` must be 'auto' or 'xla'; got 'pallas'"):
        FixedAttention(2, selections=[BlockSelection(1, 4)], impl="pallas")


def test_a_candidate_that_is_neither_is_a_type_error():
    from sparse_jax.models.layers import CandidateMaskAttention

    with pytest.raises(TypeError, match=r"candidates\[1\] must be a static head-agnostic Mask "
                       "or a sparse_jax.dynamic.BlockSelection; got 3"):  # fmt: skip
        CandidateMaskAttention(2, [_window(2), 3])
