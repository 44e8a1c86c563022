"""GPT-2 in NNX: Hugging Face equivalence, checkpoints, generation, students and hardening."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparse_jax.masks import causal, local, per_head, sink, strided
from sparse_jax.models import (
    GPT2,
    AttentionSpec,
    GPT2Config,
    from_pretrained,
    generate,
    harden,
    harden_plan,
    save_pretrained,
    student_from_teacher,
)
from sparse_jax.models.flops import mask_block_cost
from sparse_jax.models.layers import (
    SELF,
    CandidateMaskAttention,
    FixedAttention,
    default_candidates,
    mask_at,
)
from tests.engines import assert_engine

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf_gpt2_tiny"


def _tiny(spec=None, seed=0, **overrides):
    spec = AttentionSpec() if spec is None else spec
    return GPT2(GPT2Config.preset("tiny", **overrides), spec, rngs=nnx.Rngs(seed))


def _ids(b=2, t=16, seed=0, vocab=101):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, jnp.int32)


def _perturb(model, seed=1, scale=0.1):
    """Random non-zero values in every parameter (biases and LayerNorms too)."""
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    return model


# ----------------------------------------------------------------------------------------------
# Hugging Face weights.


def test_logits_equal_hugging_face_pytorch():
    expected = np.load(FIXTURE / "expected.npz")
    model = from_pretrained(FIXTURE)
    assert model.config == GPT2Config.preset("tiny")
    logits = model(jnp.asarray(expected["input_ids"]))
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-4, rtol=0)
    prefix = model(jnp.asarray(expected["input_ids"][:, :20]))
    np.testing.assert_allclose(prefix, expected["logits_prefix20"], atol=1e-4, rtol=0)


def test_save_load_round_trip_is_exact(tmp_path):
    model = _perturb(_tiny())
    save_pretrained(model, tmp_path / "copy")
    again = from_pretrained(tmp_path / "copy")
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))
    ids = _ids()
    np.testing.assert_array_equal(model(ids), again(ids))


def test_pickled_checkpoints_are_refused_without_being_opened(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURE / "config.json").read_text())
    # Not even a valid pickle: the loader must refuse before reading it.
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(ValueError, match=r"pickled checkpoints can run arbitrary code.*Convert"):
        from_pretrained(tmp_path)


def test_missing_files_and_folders_are_named(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"lacks \['config.json', 'model.safetensors'\]"):
        from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"not a local folder.*offline mode"):
        from_pretrained("gpt2")


def test_models_the_layout_cannot_hold_are_not_saved(tmp_path):
    gated = _tiny(AttentionSpec(head_gate="sigmoid_ste"))
    with pytest.raises(ValueError, match="beyond GPT-2's"):
        save_pretrained(gated, tmp_path)
    pruned = _tiny(heads_per_layer=(3, 2))
    with pytest.raises(ValueError, match="pruned heads"):
        save_pretrained(pruned, tmp_path)


def test_gpt2_does_not_import_hf():
    """Loading and saving live in hf.py, which imports gpt2.py: never the other way round."""
    import ast

    source = pathlib.Path(importlib.import_module("sparse_jax.models.gpt2").__file__).read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    assert not [n for n in names if n.endswith(".hf") or ".hf." in n], names
    assert not hasattr(GPT2, "from_pretrained") and not hasattr(GPT2, "save_pretrained")


# ----------------------------------------------------------------------------------------------
# Generation with a cache.


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(),
        AttentionSpec(mask=causal() & local(3, 0) | sink(1), normalizer="sparsemax"),
        AttentionSpec(kind="candidates", candidates=(sink(2) & causal(), causal() & local(4, 0))),
        AttentionSpec(kind="candidates", candidates=(sink(2) & causal(),), anchor_self=True),
    ],
    ids=["teacher", "sparse-mask", "candidates", "anchored-candidates"],
)
def test_cached_decoding_equals_the_full_forward_pass(spec):
    model = _perturb(_tiny(spec))
    prompt = _ids(2, 5)
    ids, step_logits = generate(model, prompt, 8, temperature=0.0, return_logits=True)
    full = model(ids)
    # The logits that chose token P + j are the full pass's logits at position P + j - 1.
    np.testing.assert_allclose(step_logits, full[:, 4:-1], atol=2e-5)
    np.testing.assert_array_equal(ids[:, 5:], jnp.argmax(full[:, 4:-1], axis=-1))


def test_sampling_respects_top_k_and_is_reproducible():
    model = _perturb(_tiny())
    prompt = _ids(3, 4)
    key = jax.random.key(7)
    a, logits = generate(model, prompt, 6, temperature=0.8, top_k=2, rng=key, return_logits=True)
    b = generate(model, prompt, 6, temperature=0.8, top_k=2, rng=key)
    np.testing.assert_array_equal(a, b)
    top2 = jnp.argsort(logits, axis=-1)[..., -2:]
    assert bool(jnp.all(jnp.any(top2 == a[:, 4:, None], axis=-1)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 40}, "exceeds n_positions=37"),
        ({"temperature": 1.0}, "needs `rng`"),
        ({"top_k": 0, "temperature": 0.0}, "top_k"),
    ],
)
def test_generate_bad_arguments(kwargs, match):
    args = {"max_new_tokens": 3, "temperature": 0.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(_tiny(), _ids(1, 4), **args)


# ----------------------------------------------------------------------------------------------
# Students.


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(kind="candidates", candidates=(causal(),)),
        AttentionSpec(kind="candidates", candidates=(causal(),), combine="soft_mask"),
        AttentionSpec(kind="candidates", candidates=(causal(),), combine="mixture"),
        AttentionSpec(impl="blocksparse", block_size=(8, 8)),
    ],
    ids=["soft_union", "soft_mask", "mixture", "blocksparse"],
)
def test_student_with_full_causal_attention_reproduces_the_teacher(spec):
    teacher = _perturb(_tiny())
    student = student_from_teacher(teacher, spec)
    ids = _ids(2, 37)
    np.testing.assert_allclose(student(ids), teacher(ids), atol=1e-5)
    if spec.impl == "blocksparse":  # the block-sparse kernel, not the dense reference
        assert_engine("blocksparse", lambda ids: student(ids), ids)


_WINDOW = causal() & local(3, 0)  # at T = 32 with blocks of 8: 7 of 16 blocks (auto: blocksparse)


@pytest.mark.parametrize(
    "spec, engine",
    [
        (AttentionSpec(), "xla"),  # T = 32 < one block of 128: nothing to skip
        (AttentionSpec(mask=_WINDOW, block_size=(8, 8)), "blocksparse"),  # impl="auto"
        (AttentionSpec(mask=_WINDOW, impl="blocksparse", block_size=(8, 8)), "blocksparse"),
        (AttentionSpec(mask=_WINDOW, impl="xla", block_size=(8, 8)), "xla"),
        (
            AttentionSpec(mask=_WINDOW, normalizer=1.5, learn_alpha=True, block_size=(8, 8)),
            "blocksparse",
        ),
        (AttentionSpec(mask=_WINDOW, normalizer="sparsemax", block_size=(8, 8)), "blocksparse"),
        (AttentionSpec(kind="candidates", candidates=(sink(2) & causal(), _WINDOW)), "xla"),
        (
            AttentionSpec(kind="candidates", candidates=(_WINDOW,), combine="mixture"),
            "xla",  # the mixture's calls take the default blocks of 128
        ),
    ],
    ids=["teacher", "auto", "blocksparse", "xla", "learned-alpha", "sparsemax-auto",
         "candidates", "mixture"],
)  # fmt: skip
def test_models_run_the_engine_their_spec_names(spec, engine):
    """The model's forward pass and its gradient run the engine the spec selects (read from the
    traced program), with the values of the same model on the XLA reference engine."""
    model = _perturb(_tiny(spec))
    ids = _ids(2, 32)
    graphdef, state = nnx.split(model)
    forward = lambda state: nnx.merge(graphdef, state)(ids)
    assert_engine(engine, forward, state)
    loss = lambda state: jnp.sum(forward(state) ** 2)
    assert_engine(engine, jax.grad(loss), state)
    if spec.kind == "fixed" and engine != "xla":
        reference = _tiny(dataclasses.replace(spec, impl="xla"))
        nnx.update(reference, nnx.state(model, nnx.Param))
        ref_def, ref_state = nnx.split(reference)
        ref_forward = lambda state: nnx.merge(ref_def, state)(ids)
        assert_engine("xla", ref_forward, ref_state)
        np.testing.assert_allclose(
            jax.jit(forward)(state), jax.jit(ref_forward)(ref_state), atol=1e-5
        )


def test_bfloat16_forward_is_close_to_float32():
    model = _perturb(_tiny(), scale=0.05)
    low = GPT2(GPT2Config.preset("tiny", dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(low, nnx.state(model, nnx.Param))
    ids = _ids(2, 37)
    ref, got = model(ids), low(ids)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, atol=0.1)
    assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(ref, -1))) > 0.9


def test_aux_penalties_are_summed_over_blocks():
    spec = AttentionSpec(kind="candidates", head_gate="hard_concrete", ffn_gate="sigmoid_ste")
    model = _tiny(spec)
    _, aux = model(_ids(1, 8), return_aux=True)
    assert sorted(aux) == [
        "ffn_gate",
        "head_gate",
        "mask_density",
        "mask_expected_cost",
        "mask_expected_density",
        "mask_l1",
    ]
    # 2 blocks x 7 default candidates at sigmoid(3); 2 x 192 FFN gates at sigmoid(3).
    np.testing.assert_allclose(aux["mask_l1"], 14 * jax.nn.sigmoid(3.0), rtol=1e-6)
    # density-weighted: each weight times its candidate's share of the 36 causal entries
    shares = [np.sum(mask_at(c, 8, 8)) / 36 for c in default_candidates()]
    assert shares[-1] == 1.0 and min(shares) < 1.0
    np.testing.assert_allclose(aux["mask_density"], 2 * sum(shares) * jax.nn.sigmoid(3.0), 1e-6)
    # equal weights: each block's expected density is the candidates' mean share
    np.testing.assert_allclose(aux["mask_expected_density"], 2 * np.mean(shares), rtol=1e-6)
    # priced in blocks of 128 at the call's length 8: every candidate is the one block
    np.testing.assert_allclose(aux["mask_expected_cost"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(aux["ffn_gate"], 384 * jax.nn.sigmoid(3.0), rtol=1e-6)


def test_density_penalty_prices_candidates_by_their_causal_share():
    cands = (sink(1) & causal(), causal() & local(3, 0), causal())
    core = CandidateMaskAttention(2, cands, granularity="head")
    # 16 queries: sink 16 entries, window 4 wide 58, causal 136
    np.testing.assert_allclose(core.causal_shares(16, 16), [16 / 136, 58 / 136, 1.0])
    # decoding 2 queries against 10 keys: causal has 9 + 10 entries
    np.testing.assert_allclose(core.causal_shares(2, 10), [2 / 19, 8 / 19, 1.0])
    core.logits[...] = jnp.asarray([[30.0, -30.0, -30.0], [-30.0, -30.0, 30.0]])
    q = jnp.zeros((1, 16, 2, 4))
    _, aux = core(q, q, q)
    np.testing.assert_allclose(aux["density"], 16 / 136 + 1.0, rtol=1e-5)
    np.testing.assert_allclose(aux["l1"], 2.0, rtol=1e-5)
    # expected density: head 0 picks the sink, head 1 full causal; the mean over heads
    np.testing.assert_allclose(aux["expected_density"], (16 / 136 + 1.0) / 2, rtol=1e-5)


def test_expected_density_depends_only_on_the_weights_ratios():
    cands = (sink(1) & causal(), causal() & local(3, 0), causal())
    core = CandidateMaskAttention(2, cands, granularity="head")
    logits = jnp.asarray([[-6.0, -7.0, -8.0], [-7.5, -6.5, -9.0]])  # small: w ≈ exp(logit)
    q = jnp.zeros((1, 16, 2, 4))
    core.logits[...] = logits
    _, before = core(q, q, q)
    core.logits[...] = logits - 2.0  # every weight / e^2, ratios (nearly) unchanged
    _, after = core(q, q, q)
    np.testing.assert_allclose(after["expected_density"], before["expected_density"], rtol=1e-2)
    assert float(after["density"]) < float(before["density"]) / 5  # the other one falls
    w = jax.nn.sigmoid(logits)
    pi = w / w.sum(axis=1, keepdims=True)
    shares = np.array([16, 58, 136]) / 136
    np.testing.assert_allclose(before["expected_density"], np.mean(pi @ shares), rtol=1e-5)


def test_first_token_weight_falls_below_full_attention_weight():
    """The published sanity experiment: candidates {first token, full causal} + L1."""
    teacher = _perturb(_tiny(), scale=0.3)
    spec = AttentionSpec(kind="candidates", candidates=(sink(1) & causal(), causal()))
    student = student_from_teacher(teacher, spec)
    mask_weights = nnx.All(nnx.Param, nnx.PathContains("logits"))
    optimizer = nnx.Optimizer(student, optax.adam(0.1), wrt=mask_weights)
    ids = _ids(8, 32, seed=3)
    target = jax.nn.log_softmax(teacher(ids))

    def loss_fn(model):
        logits, aux = model(ids, return_aux=True)
        logp = jax.nn.log_softmax(logits)
        kl = jnp.mean(jnp.sum(jnp.exp(target) * (target - logp), axis=-1))
        return kl + 0.01 * aux["mask_l1"]

    @nnx.jit
    def step(model, optimizer):
        grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, mask_weights))(model)
        optimizer.update(model, grads)

    for _ in range(60):
        step(student, optimizer)
    for block in student.h:
        first, full = np.asarray(block.attn.core.weights())
        assert first < 0.5 * full, (first, full)


# ----------------------------------------------------------------------------------------------
# Models describe themselves: kept masks, densities, candidate weights.
#
# The three functions below are experiments/distill.py's as of commit 2228944, frozen here as
# the reference the model methods must reproduce.


def _distill_attention_density(model, seq_len):
    values = []
    for block in model.h:
        attn = block.attn
        if not attn.num_heads:
            continue
        core = attn.core
        if isinstance(core, CandidateMaskAttention):
            dense = np.stack([mask_at(c, seq_len, seq_len) for c in core.candidates])
            w = core.candidate_weights(per_head=True)
            kept = (w >= 0.5) | (w >= jnp.max(w, axis=1, keepdims=True))
            union = jnp.einsum(
                "nc,cts->nts", kept.astype(jnp.float32), jnp.asarray(dense, jnp.float32)
            )
            if core.anchor_self:
                union = union + jnp.asarray(mask_at(SELF, seq_len, seq_len), jnp.float32)
            values.append(jnp.mean(union > 0, axis=(1, 2)))
        else:
            d = float(np.mean(mask_at(core.mask, seq_len, seq_len)))
            open_ = attn.head_gate.hard_values() if attn.head_gate is not None else None
            if open_ is None or attn.head_gate.kind == "score_scaling":
                values.append(jnp.full((attn.num_heads,), d))
            else:
                values.append(d * open_)
    return jnp.mean(jnp.concatenate(values)) if values else jnp.float32(0.0)


def _distill_weight_metrics(model):
    out = {}
    for i, block in enumerate(model.h):
        core = getattr(block.attn, "core", None)
        if isinstance(core, CandidateMaskAttention):
            w = core.weights()
            w = w.mean(axis=0) if w.ndim == 2 else w
            out |= {f"w/block{i}/c{j}": w[j] for j in range(w.shape[0])}
    return out


def _distill_candidate_weights(model):
    out = {}
    for i, block in enumerate(model.h):
        core = getattr(block.attn, "core", None)
        if isinstance(core, CandidateMaskAttention):
            out[f"block{i}"] = np.atleast_2d(np.asarray(core.weights())).round(4).tolist()
    return out


_CANDS = (sink(1) & causal(), causal() & local(2, 0), causal())
# Entries of each candidate at T = 8 (of 64): the first token 8, a 3-key window 21, causal 36.
_COUNTS = np.array([8, 21, 36])


def _random_logits(model, seed=0):
    for i, block in enumerate(model.h):
        core = block.attn.core
        _set_logits(core, 2.0 * jax.random.normal(jax.random.key(seed + i), core.logits.shape))
    return model


@pytest.mark.parametrize(
    "spec, overrides",
    [
        (AttentionSpec(kind="candidates", candidates=_CANDS, granularity="head"), {}),
        (AttentionSpec(kind="candidates", candidates=_CANDS), {}),
        (AttentionSpec(kind="candidates", candidates=_CANDS, anchor_self=True), {}),
        (AttentionSpec(kind="candidates", candidates=_CANDS, combine="mixture"), {}),
        (AttentionSpec(head_gate="sigmoid_ste", mask=_CANDS[1]), {}),
        (AttentionSpec(head_gate="score_scaling"), {}),
        (AttentionSpec(mask=_CANDS[0] | _CANDS[1]), {"heads_per_layer": (3, 0)}),
    ],
    ids=["head", "layer", "anchored", "mixture", "gated", "score-scaling", "pruned"],
)
def test_model_methods_reproduce_distills_metrics_exactly(spec, overrides):
    model = _tiny(spec, **overrides)
    if spec.kind == "candidates":
        _random_logits(model)
    if spec.head_gate is not None:
        _set_logits(model.h[0].attn.head_gate, [1.0, -1.0, 2.0])
    for seq_len in (8, 37):
        np.testing.assert_array_equal(
            model.attention_density(seq_len), _distill_attention_density(model, seq_len)
        )
    weights = model.candidate_weights()
    metrics = {
        f"w/block{i}/c{j}": w.mean(axis=0)[j]
        for i, w in enumerate(weights)
        if w is not None
        for j in range(w.shape[1])
    }
    reference = _distill_weight_metrics(model)
    assert sorted(metrics) == sorted(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(metrics[key], value, err_msg=key)
    table = {
        f"block{i}": np.asarray(w).round(4).tolist() for i, w in enumerate(weights) if w is not None
    }
    assert table == _distill_candidate_weights(model)


def test_hardened_per_head_model_density_matches_distill_to_rounding():
    spec = AttentionSpec(kind="candidates", candidates=_CANDS, granularity="head")
    student = _tiny(spec)
    for block in student.h:
        _set_logits(block.attn.core, [[3, -3, -3], [-3, 3, -3], [-3, -3, 3]])
    hard = harden(student)
    assert hard.h[0].attn.core.mask.num_heads == 3  # per-head masks: heads differ
    got = hard.attention_density(8)
    # By hand: each head's density, averaged (distill averaged the per-head mask first).
    np.testing.assert_allclose(got, np.mean(_COUNTS / 64), rtol=1e-6)
    np.testing.assert_allclose(got, _distill_attention_density(hard, 8), rtol=1e-6)
    np.testing.assert_allclose(got, student.attention_density(8), rtol=1e-6)


def test_head_densities_and_kept_masks_by_hand():
    spec = AttentionSpec(kind="candidates", candidates=_CANDS, granularity="head")
    model = _tiny(spec)
    core = model.h[0].attn.core
    # weights 0.95/0.05: head 0 keeps sink + window, head 1 only causal, head 2 has every weight
    # below 0.5 and keeps its strongest (the window; the first of two equal weights).
    _set_logits(core, [[3, 3, -3], [-3, -3, 3], [-3, -1, -1]])
    np.testing.assert_array_equal(
        core.kept_candidates(), [[True, True, False], [False, False, True], [False, True, False]]
    )
    np.testing.assert_array_equal(core.kept_candidates(float("inf")).sum(axis=1), [1, 1, 1])
    assert core.head_masks() == (_CANDS[0] | _CANDS[1], _CANDS[2], _CANDS[1])
    assert core.allowed_mask() == _CANDS[0] | _CANDS[1] | _CANDS[2]
    # sink | window at T = 8: the window's 21 entries and the first column's 5 outside it
    np.testing.assert_allclose(core.head_densities(8), np.array([26, 36, 21]) / 64, rtol=1e-7)
    np.testing.assert_allclose(core.candidate_densities(8), _COUNTS / 64)
    np.testing.assert_allclose(core.causal_shares(8, 8), _COUNTS / 36)
    np.testing.assert_allclose(core.attention_density(8), (26 + 36 + 21) / (3 * 64), rtol=1e-6)
    # Head 0 keeps everything at threshold 0.01; an anchored layer adds the diagonal.
    assert bool(core.kept_candidates(0.01)[0].all())
    anchored = CandidateMaskAttention(1, _CANDS[:1], anchor_self=True)
    assert anchored.head_masks() == (_CANDS[0] | SELF,)
    np.testing.assert_allclose(anchored.head_densities(8), [(8 + 7) / 64])
    # Gates: a closed head counts 0 in the model's density; fixed layers keep their mask.
    gated = _tiny(AttentionSpec(mask=_CANDS[1], head_gate="sigmoid_ste"))
    _set_logits(gated.h[0].attn.head_gate, [1.0, -1.0, 1.0])
    np.testing.assert_allclose(gated.h[0].attn.head_densities(8), [21 / 64, 0.0, 21 / 64])
    np.testing.assert_allclose(gated.attention_density(8), 5 * 21 / (6 * 64), rtol=1e-6)
    fixed = FixedAttention(2, mask=per_head([_CANDS[0], _CANDS[2]]))
    np.testing.assert_allclose(fixed.head_densities(8), _COUNTS[[0, 2]] / 64)
    assert fixed.head_masks() == (_CANDS[0], _CANDS[2]) and fixed.allowed_mask() == fixed.mask
    assert model.allowed_masks() == (core.allowed_mask(),) * 2
    assert _tiny(heads_per_layer=(0, 3)).allowed_masks() == (None, causal())


def test_self_description_is_traceable_and_checks_its_arguments():
    spec = AttentionSpec(kind="candidates", candidates=_CANDS, granularity="head")
    model = _random_logits(_tiny(spec))
    graphdef, state = nnx.split(model)

    @jax.jit
    def density(state):
        return nnx.merge(graphdef, state).attention_density(8)

    np.testing.assert_array_equal(density(state), model.attention_density(8))
    core = model.h[0].attn.core
    with pytest.raises(ValueError, match=r"`kept` must be a bool array of shape \(3, 3\)"):
        core.head_masks(np.zeros((3, 3), bool))  # a head keeping nothing
    with pytest.raises(TypeError, match="`threshold` must be a real number"):
        core.kept_candidates("0.5")
    with pytest.raises(ValueError, match="`seq_len` must be an int >= 1; got 0"):
        model.attention_density(0)
    with pytest.raises(TypeError, match="`per_head` must be a bool"):
        core.candidate_weights(per_head=1)


def test_harden_keeps_what_the_layer_says_it_keeps():
    spec = AttentionSpec(kind="candidates", candidates=_CANDS, granularity="head")
    student = _random_logits(_tiny(spec), seed=5)
    for threshold in (0.3, 0.5, 0.7):
        plan = harden_plan(student, threshold=threshold, length=8)
        for i, block in enumerate(student.h):
            kept = plan.kept_candidates[i]
            np.testing.assert_array_equal(kept, block.attn.core.kept_candidates(threshold))
            assert plan.head_masks[i] == block.attn.core.head_masks(kept)
        hard = harden(student, threshold=threshold, length=8)
        np.testing.assert_allclose(hard.attention_density(8), plan.density, rtol=1e-6)
        np.testing.assert_allclose(
            hard.attention_density(37),
            student.attention_density(37, threshold=threshold),
            rtol=1e-6,
        )


# ----------------------------------------------------------------------------------------------
# Hardening.


def _set_logits(module, values):
    module.logits[...] = jnp.asarray(values, jnp.float32)


def test_hardened_candidates_equal_the_soft_model_at_hard_weights():
    cands = (sink(2) & causal(), causal() & local(4, 0), causal())
    spec = AttentionSpec(kind="candidates", candidates=cands, granularity="head")
    student = _perturb(_tiny(spec))
    hard_logits = [[[30, 30, -30], [30, -30, -30], [-30, -30, 30]], [[-30, 30, -30]] * 3]
    for block, logits in zip(student.h, hard_logits, strict=True):
        _set_logits(block.attn.core, logits)
    hard = harden(student)
    ids = _ids(2, 37)
    np.testing.assert_allclose(hard(ids), student(ids), atol=1e-5)
    mask0 = hard.h[0].attn.core.mask
    np.testing.assert_array_equal(
        mask0.dense(37, 37),
        per_head([cands[0] | cands[1], cands[0], cands[2]]).dense(37, 37),
    )


@pytest.mark.parametrize("combine", ["soft_union", "soft_mask"])
def test_anchored_hardening_keeps_the_diagonal_and_equals_the_soft_model(combine):
    cands = (sink(2) & causal(), causal() & local(4, 0), causal())
    spec = AttentionSpec(
        kind="candidates", candidates=cands, granularity="head", anchor_self=True, combine=combine
    )
    student = _perturb(_tiny(spec))
    hard_logits = [[[30, -30, -30], [-30, 30, -30], [-30, -30, 30]], [[30, -30, -30]] * 3]
    for block, logits in zip(student.h, hard_logits, strict=True):
        _set_logits(block.attn.core, logits)
    hard = harden(student)
    ids = _ids(2, 37)
    np.testing.assert_allclose(hard(ids), student(ids), atol=1e-5)
    diagonal = np.eye(37, dtype=bool)
    got = np.broadcast_to(hard.h[1].attn.core.mask.dense(37, 37), (3, 37, 37))
    np.testing.assert_array_equal(got, np.stack([cands[0].dense(37, 37) | diagonal] * 3))


def test_the_anchor_makes_the_size_of_the_weights_matter():
    cands = (sink(1) & causal(), causal() & local(2, 0), causal())
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 12, 2, 8)) for i in range(3))

    def out(anchor, logit):
        core = CandidateMaskAttention(2, cands, combine="soft_mask", anchor_self=anchor)
        core.logits[...] = jnp.asarray([1.0, 0.0, -1.0]) + logit
        return core(q, k, v)[0]

    # Without the anchor, Σ w·M scaled by one factor leaves softmax unchanged (up to the
    # sigmoid's curvature: logits shifted far below 0 scale every weight by about e^-shift).
    np.testing.assert_allclose(out(False, -12.0), out(False, -16.0), atol=1e-4)
    # With it, shrinking every weight moves attention onto each query's own position.
    shrunk = out(True, -16.0)
    assert float(jnp.max(jnp.abs(out(True, 0.0) - shrunk))) > 1e-2
    np.testing.assert_allclose(shrunk, v, atol=1e-3)
    with pytest.raises(ValueError, match="anchor_self"):
        CandidateMaskAttention(2, cands, combine="mixture", anchor_self=True)
    with pytest.raises(
        ValueError, match=r"'reviving_sparsemax' needs `combine`='mixture'.*'soft_union'"
    ):
        CandidateMaskAttention(2, cands, weighting="reviving_sparsemax")


def test_pruned_heads_and_units_are_removed_not_zeroed():
    spec = AttentionSpec(head_gate="sigmoid_ste", ffn_gate="sigmoid_ste")
    student = _perturb(_tiny(spec))
    _set_logits(student.h[0].attn.head_gate, [2.0, -1.0, 0.5])
    _set_logits(student.h[1].attn.head_gate, [-1.0, -2.0, -3.0])  # every head pruned
    units = np.where(np.arange(192) % 3 == 0, -1.0, 1.0)
    _set_logits(student.h[0].mlp.gate, units)
    hard = harden(student)
    assert hard.config.heads_per_layer == (2, 0)
    assert hard.config.inner_per_layer == (128, 192)
    assert hard.h[0].attn.c_attn.kernel[...].shape == (48, 3 * 2 * 16)
    assert hard.h[0].mlp.c_fc.kernel[...].shape == (48, 128)
    ids = _ids(2, 37)
    np.testing.assert_allclose(hard(ids), student(ids), atol=1e-5)


def test_score_scaling_is_folded_and_prunes_nothing():
    student = _perturb(_tiny(AttentionSpec(head_gate="score_scaling")))
    _set_logits(student.h[0].attn.head_gate, [-2.0, 0.0, 2.0])
    hard = harden(student)
    assert hard.config.heads_per_layer == (3, 3)
    ids = _ids(2, 37)
    np.testing.assert_allclose(hard(ids), student(ids), atol=1e-5)


def test_budget_picks_the_lowest_threshold_that_fits():
    cands = (sink(2) & causal(), causal() & local(4, 0), causal())
    student = _tiny(AttentionSpec(kind="candidates", candidates=cands, granularity="head"))
    for block in student.h:
        _set_logits(block.attn.core, [[2.0, 1.0, 0.0]] * 3)  # full causal is the weakest
    loose = harden(student, budget=1.0)
    tight = harden(student, budget=0.3)
    assert loose.h[0].attn.core.mask.dense(37, 37).sum() == causal().dense(37, 37).sum()
    want = (cands[0] | cands[1]).dense(37, 37)
    np.testing.assert_array_equal(tight.h[0].attn.core.mask.dense(37, 37), want)
    assert want.mean() <= 0.3
    with pytest.raises(ValueError, match="cannot be met: every head on its cheapest"):
        harden(student, budget=0.01)
    # Full causal the strongest everywhere: no threshold fits, the densest heads move to their
    # strongest cheaper candidate (the window) until the mean fits.
    for block in student.h:
        _set_logits(block.attn.core, [[0.0, 1.0, 2.0]] * 3)
    plan = harden_plan(student, budget=0.3)
    assert plan.density <= 0.3
    masks = [m for block in plan.head_masks for m in block]
    assert causal() in masks and cands[1] in masks and cands[0] not in masks
    with pytest.raises(ValueError, match=r"`budget` \(mean attention density\) must be in"):
        harden(student, budget=0.0)
    with pytest.raises(ValueError, match=r"`budget` \(mean block cost\) must be in"):
        harden(student, budget=1.5, price="blocks")
    with pytest.raises(ValueError, match="not both"):
        harden(student, budget=0.5, threshold=0.5)
    with pytest.raises(ValueError, match=r"harden: `length` must be an int >= 1; got 0"):
        harden_plan(student, budget=0.3, length=0)  # not the default length in disguise


def test_budget_in_blocks_prices_what_the_kernel_computes():
    """A strided head is cheap in density but touches every kernel block: priced in blocks it
    costs what causal costs, so a block budget drops it where a density budget keeps it."""
    cands = (causal() & local(7, 0), strided(4), causal())
    spec = AttentionSpec(kind="candidates", candidates=cands, granularity="head", block_size=(8, 8))
    student = _tiny(spec)
    for block in student.h:
        _set_logits(block.attn.core, [[1.0, 2.0, -3.0]] * 3)  # strided strongest, then window
    window_cost = mask_block_cost(cands[0], 64, (8, 8))
    assert mask_block_cost(cands[1], 64, (8, 8)) == 1.0 and window_cost < 0.5
    dense_plan = harden_plan(student, budget=0.3, length=64)  # strided alone: density ~0.13
    kept = [m for block in dense_plan.head_masks for m in block]
    assert all(mask_block_cost(m, 64, (8, 8)) == 1.0 for m in kept)  # strided kept: every block
    plan = harden_plan(student, budget=window_cost + 1e-6, length=64, price="blocks")
    assert plan.price == "blocks" and plan.cost == pytest.approx(window_cost)
    assert all(m == cands[0] for block in plan.head_masks for m in block)
    hard = harden(student, budget=window_cost + 1e-6, length=64, price="blocks")
    assert hard.h[0].attn.core.mask == cands[0]
    with pytest.raises(ValueError, match="mean block cost"):
        harden(student, budget=0.01, length=64, price="blocks")
    with pytest.raises(ValueError, match="unknown `price`='flops'"):
        harden(student, budget=0.5, price="flops")
