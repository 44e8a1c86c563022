"""The sparse encoder–decoder: each switch changes only what it names (all off: a plain dense
softmax encoder–decoder), cached greedy decoding equals the full forward pass, padding is
ignored, FLOPs by hand, and bad configurations rejected."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax import entmax, sparsemax, sparsemax_loss
from sparse_jax.models.encdec import (
    Attention,
    EncDecConfig,
    EncoderDecoder,
    describe,
    greedy_decode,
    literal_coordinates,
    sequence_loss,
)
from sparse_jax.models.positions import rotate
from tests.engines import engines_used

SMALL = dict(vocab_size=13, d_model=16, num_heads=2, d_ff=32, encoder_layers=1, decoder_layers=2)
SPARSE = EncDecConfig(**SMALL, cot_steps=2, decoder_keep=0.5, decoder_window=3, decoder_sinks=1)
DENSE = SPARSE.dense()


def _model(cfg):
    return EncoderDecoder(cfg, rngs=nnx.Rngs(0))


def _shapes(model):
    """The shapes of ``model``'s parameters, as a tree."""
    return jax.tree.map(jnp.shape, nnx.state(model, nnx.Param))


def _batch(seed=0, b=2, s=7, t=6):
    rng = np.random.default_rng(seed)
    src = jnp.asarray(rng.integers(3, 13, (b, s)), jnp.int32)
    tgt = jnp.asarray(rng.integers(3, 13, (b, t)), jnp.int32)
    return src, jnp.array([s, s - 3])[:b], tgt


def test_dense_baseline_has_every_switch_off_and_the_same_parameters():
    assert describe(DENSE) == {}
    assert set(describe(SPARSE)) == {
        "normalizer", "output", "embed_keep", "embed_mask", "cot_keep", "decoder_keep",
        "decoder_window", "decoder_sinks",
    }  # fmt: skip
    assert _shapes(_model(SPARSE)) == _shapes(_model(DENSE))
    # The dense baseline is a plain encoder-decoder: softmax attention everywhere (no zero
    # weight in any allowed entry), full causal decoder attention.
    src, lengths, tgt = _batch()
    _, stats = _model(DENSE)(src, lengths, tgt, return_stats=True)
    for kind in ("encoder", "decoder_self", "decoder_cross"):
        assert float(stats[f"{kind}_nonzero"]) == pytest.approx(float(stats[f"{kind}_allowed"]))
    causal_share = np.mean([(i + 1) / 6 for i in range(6)])
    assert float(stats["decoder_self_allowed"]) == pytest.approx(causal_share)


@pytest.mark.parametrize(
    "switch, value",
    [
        ("normalizer", "sparsemax"),
        ("embed_keep", 0.5),
        ("encoder_window", 1),
        ("cot_keep", 0.25),
        ("decoder_keep", 0.5),
        ("decoder_window", 2),
        ("logit_scale", 0.5),
    ],
)
def test_each_switch_changes_the_forward_pass_and_only_what_it_names(switch, value):
    base = dataclasses.replace(DENSE, cot_steps=1)
    cfg = dataclasses.replace(base, **{switch: value})
    qualified = {"embed_mask": "random"} if switch == "embed_keep" else {}  # which dims
    assert describe(cfg) == {switch: value, **qualified}
    src, lengths, tgt = _batch()
    dense_model, model = _model(base), _model(cfg)
    dense_logits, dense_stats = dense_model(src, lengths, tgt, return_stats=True)
    logits, stats = model(src, lengths, tgt, return_stats=True)
    assert not np.allclose(logits, dense_logits, atol=1e-5)
    kinds = ("encoder", "decoder_self", "decoder_cross")
    if switch == "normalizer":  # sparsemax leaves allowed keys at exactly zero weight
        for kind in kinds:
            assert float(stats[f"{kind}_nonzero"]) < float(stats[f"{kind}_allowed"])
    elif switch == "encoder_window":  # keys within 1 either side, inside the source's length
        s = src.shape[1]
        shares = [
            np.mean([min(i + 2, n) - max(i - 1, 0) for i in range(n)]) / s for n in (s, s - 3)
        ]
        assert float(stats["encoder_allowed"]) == pytest.approx(
            (shares[0] * s + shares[1] * (s - 3)) / (2 * s - 3)
        )
    elif switch == "decoder_window":
        t = tgt.shape[1]
        assert float(stats["decoder_self_allowed"]) == pytest.approx(
            np.mean([min(i + 1, 2) / t for i in range(t)])
        )
    else:  # a feature mask or the scores' factor: the masks of attention are untouched
        for kind in kinds:
            assert float(stats[f"{kind}_allowed"]) == pytest.approx(
                float(dense_stats[f"{kind}_allowed"])
            )
    if switch == "embed_keep":  # one fixed set of half the dimensions for every token
        e = np.asarray(model.sparse_embed(src))
        kept = np.abs(e).sum(axis=(0, 1)) > 0
        assert kept.sum() == 8 and ((e != 0) == kept).all()
    if switch == "cot_keep":  # each position keeps its 4 largest features
        memory = np.asarray(model.encode(src, lengths))
        np.testing.assert_array_equal((memory != 0).sum(-1), 4)


def test_logit_scale_is_a_learned_factor_on_each_heads_scores():
    # A factor c_h on head h's scores QKᵀ/√d is the same as c_h on its query projection.
    scaled = _model(dataclasses.replace(SPARSE, logit_scale=0.5))
    plain = _model(SPARSE)  # the same draws: the factors take no random numbers
    factors = jnp.array([0.5, 3.0])  # N = 2 heads of 8 dimensions
    per_column = jnp.repeat(factors, SPARSE.head_dim)
    attentions = [m for _, m in nnx.iter_graph(scaled) if isinstance(m, Attention)]
    assert len(attentions) == 1 + 2 + 2 * 2  # encoder, 2 CoT steps, 2 decoders x (self, cross)
    for m in attentions:
        np.testing.assert_allclose(np.exp(m.log_scale[...]), [0.5, 0.5], rtol=1e-6)
        m.log_scale[...] = jnp.log(factors)
    for _, m in nnx.iter_graph(plain):
        if isinstance(m, Attention):
            assert m.log_scale is None
            m.q.kernel[...] = m.q.kernel[...] * per_column
            m.q.bias[...] = m.q.bias[...] * per_column
    src, lengths, tgt = _batch()
    np.testing.assert_allclose(
        scaled(src, lengths, tgt), plain(src, lengths, tgt), rtol=1e-5, atol=1e-5
    )
    # learned: every factor gets a gradient
    where = jnp.ones(tgt.shape, bool)
    grads = nnx.grad(lambda m: sequence_loss(m, src, lengths, tgt, tgt, where))(scaled)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    scale_grads = [np.asarray(g) for path, g in leaves if "log_scale" in jax.tree_util.keystr(path)]
    assert len(scale_grads) == len(attentions)
    assert all(np.all(g != 0) for g in scale_grads)


def test_learn_alpha_runs_alpha_entmax_with_each_heads_learned_alpha():
    cfg = dataclasses.replace(SPARSE, learn_alpha=True)
    assert describe(cfg)["learn_alpha"] is True and cfg.dense() == DENSE  # the baseline: none
    with pytest.raises(TypeError, match="`learn_alpha` must be a bool; got 1"):
        dataclasses.replace(cfg, learn_alpha=1)
    model = _model(cfg)
    attentions = [m for _, m in nnx.iter_graph(model) if isinstance(m, Attention)]
    assert len(attentions) == 1 + 2 + 2 * 2  # encoder, 2 CoT steps, 2 decoders x (self, cross)
    for m in attentions:  # from sparsemax's α = 2; entmax15 starts at 1.5
        np.testing.assert_allclose(m.alpha(), [2.0, 2.0], rtol=1e-6)
    entmax15 = _model(dataclasses.replace(cfg, normalizer="entmax15"))
    starts = [m.alpha() for _, m in nnx.iter_graph(entmax15) if isinstance(m, Attention)]
    np.testing.assert_allclose(np.stack(starts), 1.5, rtol=1e-6)
    # At α = 2 α-entmax is sparsemax: the same function as the model without the switch.
    src, lengths, tgt = _batch()
    np.testing.assert_allclose(
        model(src, lengths, tgt), _model(SPARSE)(src, lengths, tgt), rtol=1e-4, atol=1e-4
    )
    # Each head's weights are α-entmax of its scores with that head's own α.
    attn = attentions[0]
    alphas = jnp.array([1.25, 3.0])
    attn.alpha_logit[...] = jnp.log(jnp.expm1(alphas - 1.0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    k, v = attn.keys_values(x)
    _, w = attn(x, k, v, jnp.ones((1, 1, 5, 5), bool), weights=True)  # [B, N, Tq, Tk]
    q = attn.heads(attn.q(x))
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(cfg.head_dim)
    np.testing.assert_allclose(w, entmax(scores, alphas[:, None]), atol=1e-5)
    assert not np.allclose(w, entmax(scores, 2.0), atol=1e-3)  # not the start's α
    # learned: every attention's α gets a gradient
    where = jnp.ones(tgt.shape, bool)
    grads = nnx.grad(lambda m: sequence_loss(m, src, lengths, tgt, tgt, where))(model)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    alpha_grads = [np.asarray(g) for p, g in leaves if "alpha_logit" in jax.tree_util.keystr(p)]
    assert len(alpha_grads) == len(attentions)
    assert all(np.isfinite(g).all() for g in alpha_grads)
    assert sum(np.count_nonzero(g) for g in alpha_grads) > len(attentions)


def test_magnitude_embedding_keeps_each_tokens_largest_entries():
    cfg = dataclasses.replace(DENSE, embed_keep=0.25, embed_mask="magnitude")
    model = _model(cfg)
    ids = jnp.arange(13, dtype=jnp.int32)[None]
    full = np.asarray(model.embed(ids))[0]
    kept = np.asarray(model.sparse_embed(ids))[0]
    for row, out in zip(full, kept, strict=True):
        top = np.argsort(-np.abs(row))[:4]
        np.testing.assert_array_equal(np.nonzero(out)[0], np.sort(top))
        np.testing.assert_array_equal(out[top], row[top])


def test_output_switch_changes_only_the_loss():
    src, lengths, tgt = _batch()
    sparse_out = dataclasses.replace(DENSE, output="sparsemax")
    np.testing.assert_array_equal(
        _model(sparse_out)(src, lengths, tgt), _model(DENSE)(src, lengths, tgt)
    )
    where = jnp.ones(tgt.shape, bool).at[1, 4:].set(False)
    logits = _model(sparse_out)(src, lengths, tgt)
    want = jnp.sum(sparsemax_loss(logits, tgt, where=where)) / jnp.sum(where)
    got = sequence_loss(_model(sparse_out), src, lengths, tgt, tgt, where)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    ce = -jax.nn.log_softmax(logits)[jnp.arange(2)[:, None], jnp.arange(6)[None], tgt]
    want_ce = jnp.sum(jnp.where(where, ce, 0)) / jnp.sum(where)
    got_ce = sequence_loss(_model(DENSE), src, lengths, tgt, tgt, where)
    assert float(got_ce) == pytest.approx(float(want_ce), rel=1e-6)
    assert float(got) != pytest.approx(float(got_ce))
    # The sparse output distribution has exact zeros.
    assert float(jnp.mean(sparsemax(logits, axis=-1) == 0)) > 0


@pytest.mark.parametrize(
    "cfg",
    [
        SPARSE,
        DENSE,
        dataclasses.replace(SPARSE, cross_queries="self"),
        dataclasses.replace(SPARSE, positions="rotary"),  # keys rotated into a ring of slots
        dataclasses.replace(DENSE, positions="rotary"),
    ],
    ids=["sparse", "dense", "sparse-cross-queries-self", "sparse-rotary", "dense-rotary"],
)
def test_cached_greedy_decoding_equals_the_full_forward_pass(cfg):
    model = _model(cfg)
    src, lengths, _ = _batch(1)
    tokens, logits = greedy_decode(model, src, lengths, bos=1, eos=2, max_len=8)
    assert tokens.shape == (2, 8) and logits.shape == (2, 8, 13)
    target_in = jnp.concatenate([jnp.ones((2, 1), jnp.int32), tokens[:, :-1]], axis=1)
    full = model(src, lengths, target_in)
    np.testing.assert_allclose(logits, full, atol=2e-5, rtol=1e-5)
    done = np.cumsum(np.asarray(tokens) == 2, axis=1) > 0
    want = np.where(done, 2, np.argmax(np.asarray(full), -1))
    first_eos = np.argmax(np.asarray(tokens) == 2, axis=1)
    for b in range(2):  # up to and including the first EOS the tokens are the argmax
        stop = first_eos[b] if done[b].any() else 8
        np.testing.assert_array_equal(tokens[b, :stop], np.argmax(full[b, :stop], -1))
        np.testing.assert_array_equal(tokens[b, stop:], want[b, stop:])


def _literal_paths(text: str) -> dict[int, tuple[int, ...]]:
    """Each digit's index path in the bracketed literals of ``text`` (``[[1, 2], [3]]``: 1 at
    (0, 0), 3 at (1, 0)), by recursive descent: the parser the model's scan must agree with."""
    paths: dict[int, tuple[int, ...]] = {}

    def parse(i: int, path: tuple[int, ...]) -> int:  # text[i] == "["; returns after "]"
        i, index = i + 1, 0
        while text[i] != "]":
            if text[i] == "[":
                i = parse(i, (*path, index))
            elif text[i] == ",":
                index += 1
                i += 1
            else:
                if text[i].isdigit():
                    paths[i] = (*path, index)
                i += 1
        return i + 1

    i = 0
    while i < len(text):
        i = parse(i, ()) if text[i] == "[" else i + 1
    return paths


def test_literal_coordinates_agree_with_a_parser_on_every_kind_of_problem():
    from sparse_jax.data import linalg_cot as lc

    problems = [lc.generate(kind, seed) for kind in lc.KINDS for seed in range(8)]
    texts = [p.text() for p in problems]
    width = max(len(t) for t in texts)
    ids = np.full((len(texts), width), ord(" "), np.int32)
    for row, text in enumerate(texts):
        ids[row, : len(text)] = np.frombuffer(text.encode(), np.uint8)
    got = np.asarray(literal_coordinates(jnp.asarray(ids), tuple(b"[],")))
    checked = 0
    for row, text in enumerate(texts):
        for i, path in _literal_paths(text).items():
            # A matrix entry (row, column) at depth 2; a vector's entries are its rows.
            want = (2, *path) if len(path) == 2 else (1, path[0], 0)
            assert tuple(got[row, i]) == want, (text, i)
            checked += 1
        outside = [i for i, ch in enumerate(text) if ch.isdigit() and i not in _literal_paths(text)]
        assert all(got[row, i, 0] == 0 for i in outside)  # "3 by 4 with rank 2": no literal
    assert checked > 1000


def test_literal_embeddings_are_in_both_models_and_fed_token_by_token_when_decoding():
    cfg = dataclasses.replace(SPARSE, literal_tokens=[3, 4, 5])  # a list, as read from JSON
    assert cfg.literal_tokens == (3, 4, 5) and cfg.dense().literal_tokens == (3, 4, 5)
    assert "literal_tokens" not in describe(cfg)  # not a sparsity switch: the baseline has it
    assert _shapes(_model(cfg)) == _shapes(_model(cfg.dense()))
    assert _shapes(_model(cfg))["literal_embed"]["embedding"] == (36, 16)
    src, lengths, _ = _batch(2)
    # A target that opens and closes literals ([[a, b], [c]], [d, e]) fed one token at a time
    # through the cache gives the full pass' logits; without the coordinates they differ.
    target_in = jnp.array([[1, 3, 3, 6, 5, 7, 4, 5, 3, 8, 4, 4, 5, 3, 9, 5, 6, 4]] * 2)
    for config in (cfg, cfg.dense()):
        model = _model(config)
        full = model(src, lengths, target_in)
        cache = model.init_cache(model.encode(src, lengths), lengths, target_in.shape[1])
        steps = []
        for t in range(target_in.shape[1]):
            logits, cache = model.decode_step(target_in[:, t], cache)
            steps.append(logits)
        np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=2e-5, rtol=1e-5)
        assert cache["literal"].tolist() == [[0, 1, 0]] * 2  # after "[d, e]": row 1, depth 0
        # The table is the only difference from the model without it (drawn last, so the
        # other weights are the same draws): zeroed, the logits are that model's.
        plain = _model(dataclasses.replace(config, literal_tokens=None))(src, lengths, target_in)
        assert not np.allclose(plain, full, atol=1e-4)
        model.literal_embed.embedding[...] = 0.0
        np.testing.assert_allclose(model(src, lengths, target_in), plain, atol=1e-6)


def test_cross_queries_from_what_the_self_attention_found_in_both_models():
    cfg = dataclasses.replace(SPARSE, cross_queries="self")
    assert "cross_queries" not in describe(cfg)  # not a sparsity switch: the baseline has it
    assert cfg.dense().cross_queries == "self"
    assert _shapes(_model(cfg)) == _shapes(_model(cfg.dense()))
    assert "ln_query" in _shapes(_model(cfg))["decoder"][0]
    assert "ln_query" not in _shapes(_model(SPARSE))["decoder"][0]
    layer = _model(cfg.dense()).decoder[0]
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)  # [B, T, D] decoder input
    memory = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)  # [B, S, D] context
    self_mask, cross_mask = jnp.tril(jnp.ones((6, 6), bool)), jnp.ones((2, 1, 1, 7), bool)
    self_kv = layer.self_attn.keys_values(y)
    cross_kv = layer.cross_attn.keys_values(memory)
    a = layer.self_attn(y, *self_kv, self_mask)
    c = layer.cross_attn(layer.ln_query(y + a), *cross_kv, cross_mask)
    h = layer.ln1(y + a + c)  # H_d = FFN(A_self V + A_cross C), Add & Norm
    got = layer(y, self_kv, self_mask, cross_kv, cross_mask)
    np.testing.assert_allclose(got, layer.ln2(h + layer.ffn(h)), atol=1e-5)
    # The same weights with the study's queries (the layer's input) give another output.
    c_input = layer.cross_attn(y, *cross_kv, cross_mask)
    h_input = layer.ln1(y + a + c_input)
    assert not np.allclose(got, layer.ln2(h_input + layer.ffn(h_input)), atol=1e-3)


def test_rotary_positions_make_self_attention_depend_on_distances_only():
    rng = np.random.default_rng(4)
    q, k = (jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32) for _ in range(2))
    pos = jnp.arange(5)
    scores = lambda qp, kp: jnp.einsum("blnh,bmnh->bnlm", rotate(q, qp), rotate(k, kp))
    np.testing.assert_allclose(scores(pos, pos), scores(pos + 11, pos + 11), atol=1e-4)
    assert not np.allclose(scores(pos, pos), scores(pos, pos + 1), atol=1e-2)
    np.testing.assert_allclose(  # a rotation: every pair keeps its length
        jnp.linalg.norm(rotate(q, pos + 3), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5
    )
    cfg = dataclasses.replace(SPARSE, positions="rotary")
    assert "positions" not in describe(cfg) and cfg.dense().positions == "rotary"
    assert _shapes(_model(cfg)) == _shapes(_model(SPARSE))  # no parameters of its own
    model = _model(cfg)
    src, lengths, tgt = _batch()
    assert not np.asarray(model.placement(src, jnp.arange(7))).any()  # no sinusoids added
    # A self-attention layer of the model, fed the same tokens at positions shifted by 9, gives
    # the same output; with its queries rotated at other positions than its keys, another.
    x = model.sparse_embed(src)
    layer, mask = model.encoder[0], jnp.ones((7, 7), bool)
    np.testing.assert_allclose(
        layer(x, mask, positions=jnp.arange(7)), layer(x, mask, positions=jnp.arange(7) + 9),
        atol=1e-5,
    )  # fmt: skip
    kv = layer.attn.keys_values(x, jnp.arange(7))
    same = layer.attn(x, *kv, mask, positions=jnp.arange(7))
    assert not np.allclose(same, layer.attn(x, *kv, mask, positions=jnp.arange(7) + 2), atol=1e-3)
    # The model passes them: with rotary positions the logits differ from sinusoids' (same
    # weights) and from the same model with the rotations removed.
    assert not np.allclose(model(src, lengths, tgt), _model(SPARSE)(src, lengths, tgt), atol=1e-3)


@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_a_windowed_decoder_caches_only_the_sinks_and_a_ring_of_the_window(sinks):
    # 19 positions through a ring of 3 slots (+ sinks): the logits of every position equal the
    # full forward pass's, whose mask is causal & (local(2, 0) | sink(sinks)).
    cfg = dataclasses.replace(SPARSE, decoder_window=3, decoder_sinks=sinks, decoder_layers=1)
    model = _model(cfg)
    src, lengths, _ = _batch(2)
    assert model.cache_slots(19) == 3 + sinks and model.cache_slots(2) == 2
    memory = model.encode(src, lengths)
    cache = model.init_cache(memory, lengths, 19)
    assert cache["layers"][0]["k"].shape == (2, 3 + sinks, 2, 8)
    tokens, logits = greedy_decode(model, src, lengths, bos=1, eos=2, max_len=19)
    target_in = jnp.concatenate([jnp.ones((2, 1), jnp.int32), tokens[:, :-1]], axis=1)
    full = model(src, lengths, target_in)
    np.testing.assert_allclose(logits, full, atol=2e-5, rtol=1e-5)
    # the window matters: the same tokens under a causal decoder give other logits
    causal = _model(dataclasses.replace(cfg, decoder_window=None, decoder_sinks=0))
    assert float(jnp.abs(causal(src, lengths, target_in) - full).max()) > 1e-3


def test_the_decoder_mask_reaches_the_block_sparse_kernel_with_the_dense_masks_values():
    # 24 decoder positions in blocks of 4 under causal & (local(2, 0) | sink(1)): auto takes the
    # block-sparse kernel for the decoder self-attention (the encoder and cross-attention masks
    # are arrays: xla); with blocks of 64 the same mask has one block and runs on xla. Same
    # weights, so the logits and gradients must agree. A causal decoder hands an array.
    cfg = dataclasses.replace(SPARSE, decoder_block=4, decoder_layers=1, cot_steps=0)
    src, lengths, tgt = _batch(3, t=24)
    models = {block: _model(dataclasses.replace(cfg, decoder_block=block)) for block in (4, 64)}
    assert engines_used(lambda: models[4](src, lengths, tgt)) == {"xla", "blocksparse"}
    assert engines_used(lambda: models[64](src, lengths, tgt)) == {"xla"}
    causal = _model(dataclasses.replace(cfg, decoder_window=None, decoder_sinks=0))
    assert engines_used(lambda: causal(src, lengths, tgt)) == {"xla"}  # a dense array

    @nnx.jit
    def logits_and_grads(model):
        grads = nnx.grad(lambda m: sequence_loss(m, src, lengths, tgt, tgt, tgt > 0))(model)
        return model(src, lengths, tgt), nnx.state(grads, nnx.Param)

    (got, got_grads), (want, want_grads) = (logits_and_grads(models[b]) for b in (4, 64))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), got_grads, want_grads
    )


def test_source_padding_changes_nothing_and_gradients_are_finite():
    model = _model(SPARSE)
    src, lengths, tgt = _batch()
    other = src.at[1, 4:].set(5)  # row 1 is 4 tokens long: its padding changes
    forward = nnx.jit(lambda m, s: m(s, lengths, tgt))
    np.testing.assert_allclose(forward(model, src)[1], forward(model, other)[1], atol=1e-6)
    grads = nnx.jit(nnx.grad(lambda m: sequence_loss(m, src, lengths, tgt, tgt, tgt > 0)))(model)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert sum(float(jnp.abs(g).sum()) > 0 for g in leaves) > 0.9 * len(leaves)


def test_flops_by_hand():
    cfg = EncDecConfig(
        vocab_size=10, d_model=8, num_heads=2, d_ff=16, encoder_layers=1, decoder_layers=1,
        cot_steps=1, decoder_window=2,
    )  # fmt: skip
    f = _model(cfg).flops(4, 3)
    d, s, t = 8, 4, 3
    dec_pairs = 1 + 2 + 2  # window of 2 keys, causal
    scores = 2 * 2 * d * (2 * s * s + dec_pairs + t * s)
    proj = 2 * d * d * (4 * 2 * s + 6 * t + 2 * s)
    ffn = 2 * 2 * d * 16 * (2 * s + t)
    assert f == {
        "attention_scores": scores, "projections": proj, "ffn": ffn, "output": 2 * d * 10 * t,
        "total": scores + proj + ffn + 2 * d * 10 * t,
    }  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_model": 10, "num_heads": 3}, "`num_heads`=3 must divide `d_model`=10"),
        ({"normalizer": "relu"}, "unknown `normalizer`='relu'"),
        ({"embed_keep": 0.0}, r"`embed_keep` must be in \(0, 1\] \(1: off\); got 0.0"),
        ({"cot_keep": 1.5}, r"`cot_keep` must be in \(0, 1\]"),
        ({"decoder_sinks": 2}, "`decoder_sinks`=2 needs a `decoder_window`"),
        ({"output": "entmax"}, "unknown `output`='entmax'"),
        ({"embed_mask": "top"}, "unknown `embed_mask`='top'"),
        ({"positions": "learned"}, r"unknown `positions`='learned'; allowed: \('sinusoid'"),
        ({"positions": "rotary", "d_model": 18, "num_heads": 2}, "head size .* = 9 must be even"),
        ({"cross_queries": "output"}, r"unknown `cross_queries`='output'; allowed: \('input'"),
        ({"decoder_block": 0}, "decoder_block"),
        ({"logit_scale": 0}, r"`logit_scale` must be a finite number > 0 or None; got 0"),
        ({"logit_scale": float("inf")}, "`logit_scale` must be a finite number > 0"),
        ({"logit_scale": True}, "`logit_scale` must be a finite number > 0"),
        ({"learn_alpha": True, "normalizer": "softmax"}, "`learn_alpha` needs a sparse"),
        ({"literal_tokens": (3, 3, 4)}, r"`literal_tokens` must be None or 3 distinct token"),
        ({"literal_tokens": (3, 4)}, r"`literal_tokens` must be .* got \(3, 4\)"),
        ({"literal_tokens": (3, 4, 13)}, r"in \[0, vocab_size=13\); got \(3, 4, 13\)"),
        ({"literal_tokens": "[],"}, r"`literal_tokens` must be None or 3 distinct"),
    ],
)
def test_bad_configurations_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EncDecConfig(**{**SMALL, **kwargs})


def test_bad_inputs_are_rejected():
    model = _model(DENSE)
    src, lengths, tgt = _batch()
    with pytest.raises(TypeError, match="`source` must be an int array"):
        model(src.astype(jnp.float32), lengths, tgt)
    with pytest.raises(ValueError, match=r"`source_lengths` must be \[batch\]"):
        model(src, jnp.array([3]), tgt)
    with pytest.raises(ValueError, match="`eos` must be"):
        greedy_decode(model, src, lengths, bos=1, eos=99, max_len=4)
