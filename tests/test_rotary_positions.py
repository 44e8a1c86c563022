"""Rotary positions in GPT-2 (``GPT2Config.positions="rotary"``): scores see distances only,
decoding, files, students and hardening keep them, bad settings are refused."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.masks import causal, local
from sparse_jax.models import (
    GPT2,
    AttentionSpec,
    GPT2Config,
    from_pretrained,
    harden,
    save_pretrained,
    student_from_teacher,
)
from sparse_jax.models.cascade import CascadeConfig
from sparse_jax.models.positions import rotate
from tests.decoding import check_cached_decoding


def _rotary(spec: AttentionSpec | None = None, **overrides) -> GPT2:
    config = GPT2Config.preset("tiny", positions="rotary", **overrides)
    return GPT2(config, spec or AttentionSpec(), rngs=nnx.Rngs(0))


def _ids(batch=2, length=11, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 101)


def test_a_rotary_model_has_no_position_table_and_its_scores_see_only_distances():
    model = _rotary()
    assert model.wpe is None
    assert "wpe" not in {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    attn = model.h[0].attn
    x = jax.random.normal(jax.random.key(2), (1, 6, 48))
    q, k, _ = attn.project_qkv(x)
    raw = attn.c_attn(x).reshape(1, 6, 3, 3, 16)
    positions = jnp.arange(6)
    np.testing.assert_allclose(q, rotate(raw[:, :, 0], positions), atol=1e-6)
    np.testing.assert_allclose(k, rotate(raw[:, :, 1], positions), atol=1e-6)
    # The same inputs 7 positions later: every query-key score is unchanged.
    q7, k7, _ = attn.project_qkv(x, positions + 7)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k)
    np.testing.assert_allclose(jnp.einsum("bqnh,bknh->bnqk", q7, k7), scores, atol=1e-4)
    # Other weights than a learned-position model of the same seed: other logits.
    learned = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    ids = _ids()
    assert np.abs(np.asarray(learned(ids)) - np.asarray(model(ids))).max() > 1e-3


@pytest.mark.parametrize(
    "spec, smear",
    [
        (AttentionSpec(), False),
        (AttentionSpec(mask=causal() & local(3, 0), normalizer="entmax15"), True),
    ],
    ids=["causal-softmax", "window-entmax15-smeared"],
)
def test_cached_decoding_in_chunks_equals_the_full_pass(spec, smear):
    check_cached_decoding(_rotary(spec, smear_keys=smear), _ids(2, 12))


def test_files_round_trip_rotary_positions(tmp_path):
    model = _rotary(smear_keys=True)
    folder = save_pretrained(model, tmp_path / "rotary")
    hf = json.loads((folder / "config.json").read_text())
    assert hf["positions"] == "rotary"
    loaded = from_pretrained(folder)
    assert loaded.config.positions == "rotary" and loaded.wpe is None
    ids = _ids()
    np.testing.assert_array_equal(loaded(ids), model(ids))
    plain = save_pretrained(GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0)), tmp_path / "p")
    assert "positions" not in json.loads((plain / "config.json").read_text())
    # Learned-position weights read as rotary would drop their table: refused by name.
    hf_plain = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**hf_plain, "positions": "rotary"}))
    with pytest.raises(ValueError, match=r"wpe\.weight"):
        from_pretrained(plain)


def test_students_and_hardened_models_keep_rotary_positions():
    teacher = _rotary()
    spec = AttentionSpec(mask=causal() & local(4, 0), head_gate="sigmoid_ste")
    student = student_from_teacher(teacher, spec)
    assert student.config.positions == "rotary"
    student.h[0].attn.head_gate.logits[...] = jnp.array([2.0, -1.0, 0.5])  # head 1 pruned
    hard = harden(student)
    assert hard.config.heads_per_layer == (2, 3) and hard.config.positions == "rotary"
    ids = _ids(2, 20)
    np.testing.assert_allclose(hard(ids), student(ids), atol=1e-5)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown `positions`='alibi'; allowed: \('learned'"):
        GPT2Config.preset("tiny", positions="alibi")
    with pytest.raises(ValueError, match=r"head size n_embd // n_head = 15 must be even"):
        GPT2Config(vocab_size=11, n_positions=8, n_embd=30, n_layer=1, n_head=2,
                   positions="rotary")  # fmt: skip
    with pytest.raises(ValueError, match=r"`gpt2.positions` must be 'learned'"):
        CascadeConfig(gpt2=GPT2Config.preset("tiny", positions="rotary"))
