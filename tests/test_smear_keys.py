"""Smeared keys (``GPT2Config.smear_keys``): the formula, decoding, files, students, hardening."""

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
from tests.decoding import check_cached_decoding

# The attentions cached decoding is checked under: dense softmax, and a window under entmax15.
DECODING_SPECS = [
    AttentionSpec(),
    AttentionSpec(mask=causal() & local(3, 0), normalizer="entmax15"),
]
SMEAR_LOGITS = ([-1.5, 0.0, 2.0], [1.0, -3.0, 0.5])  # per block, per head: w = sigmoid(logit)


def _smeared(spec: AttentionSpec | None = None) -> GPT2:
    config = GPT2Config.preset("tiny", smear_keys=True)
    model = GPT2(config, spec or AttentionSpec(), rngs=nnx.Rngs(0))
    for block, logits in zip(model.h, SMEAR_LOGITS, strict=True):
        block.attn.smear_logit[...] = jnp.array(logits)
    return model


def _ids(batch=2, length=11, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 101)


def test_keys_are_mixed_with_the_previous_positions_key_per_head():
    model = _smeared()
    attn = model.h[0].attn
    x = jax.random.normal(jax.random.key(2), (2, 6, 48))
    _, k, _ = attn.project_qkv(x)
    raw = attn.c_attn(x).reshape(2, 6, 3, 3, 16)[:, :, 1]  # [B, T, N, H]
    w = 1 / (1 + np.exp(-np.array(SMEAR_LOGITS[0])))
    expected = np.array(raw)
    expected[:, 1:] = (1 - w)[None, None, :, None] * raw[:, 1:] + w[None, None, :, None] * raw[
        :, :-1
    ]
    expected[:, 0] = (1 - w)[None, :, None] * raw[:, 0]  # zeros before the first position
    np.testing.assert_allclose(k, expected, rtol=1e-5, atol=1e-6)
    # The smear changes the model: the same weights without it give other logits.
    plain = GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))
    ids = _ids()
    assert np.abs(np.asarray(plain(ids)) - np.asarray(model(ids))).max() > 1e-3


def test_a_fully_smeared_head_attends_with_the_previous_positions_keys():
    # w -> 1: each key is the previous position's, so position j's score is the unsmeared
    # model's score of key j - 1 (what lets a query find the token after a match).
    model = _smeared()
    attn = model.h[0].attn
    attn.smear_logit[...] = jnp.full((3,), 30.0)
    x = jax.random.normal(jax.random.key(3), (1, 5, 48))
    _, k, _ = attn.project_qkv(x)
    raw = attn.c_attn(x).reshape(1, 5, 3, 3, 16)[:, :, 1]
    np.testing.assert_allclose(k[:, 1:], raw[:, :-1], atol=1e-6)
    np.testing.assert_allclose(k[:, 0], 0.0, atol=1e-6)


@pytest.mark.parametrize("spec", DECODING_SPECS, ids=["causal-softmax", "window-entmax15"])
def test_cached_decoding_in_chunks_equals_the_full_pass(spec):
    model = _smeared(spec)
    assert model.init_cache(2, 12)[0]["k_last"].shape == (2, 3, 16)  # each head's last raw key
    check_cached_decoding(model, _ids(2, 12))


def test_files_round_trip_the_smear_and_plain_files_stay_gpt2(tmp_path):
    model = _smeared()
    folder = save_pretrained(model, tmp_path / "smeared")
    hf = json.loads((folder / "config.json").read_text())
    assert hf["smear_keys"] is True
    loaded = from_pretrained(folder)
    assert loaded.config.smear_keys
    np.testing.assert_array_equal(loaded.h[1].attn.smear_logit[...], SMEAR_LOGITS[1])
    ids = _ids()
    np.testing.assert_array_equal(loaded(ids), model(ids))
    plain = save_pretrained(GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0)), tmp_path / "p")
    assert "smear_keys" not in json.loads((plain / "config.json").read_text())
    # A config that asks for smeared keys over weights without them is refused by name.
    hf_plain = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**hf_plain, "smear_keys": True}))
    with pytest.raises(ValueError, match=r"missing \['h.0.attn.smear_logit'"):
        from_pretrained(plain)


def test_students_copy_the_smear_and_hardening_keeps_the_kept_heads_weights():
    teacher = _smeared()
    spec = AttentionSpec(mask=causal() & local(4, 0), head_gate="sigmoid_ste")
    student = student_from_teacher(teacher, spec)
    np.testing.assert_array_equal(student.h[0].attn.smear_logit[...], SMEAR_LOGITS[0])
    student.h[0].attn.head_gate.logits[...] = jnp.array([2.0, -1.0, 0.5])  # head 1 pruned
    hard = harden(student)
    assert hard.config.heads_per_layer == (2, 3) and hard.config.smear_keys
    np.testing.assert_array_equal(
        hard.h[0].attn.smear_logit[...], np.array(SMEAR_LOGITS[0])[[0, 2]]
    )
    ids = _ids(2, 20)
    np.testing.assert_allclose(hard(ids), student(ids), atol=1e-5)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(TypeError, match=r"`smear_keys` must be True or False; got 'yes'"):
        GPT2Config.preset("tiny", smear_keys="yes")
    with pytest.raises(ValueError, match=r"`gpt2.smear_keys` must be False"):
        CascadeConfig(gpt2=GPT2Config.preset("tiny", smear_keys=True))


# smear_width 3: per block, per head, the logits of the keys 1, 2 and 3 positions back.
WIDE_LOGITS = (
    [[0.5, -1.0, 0.0], [-2.0, 1.5, 0.3], [1.0, 1.0, -0.5]],
    [[0.0, 0.0, 0.0], [2.0, -2.0, 1.0], [-1.0, 0.5, 2.5]],
)


def _wide(spec: AttentionSpec | None = None) -> GPT2:
    config = GPT2Config.preset("tiny", smear_keys=True, smear_width=3)
    model = GPT2(config, spec or AttentionSpec(), rngs=nnx.Rngs(0))
    for block, logits in zip(model.h, WIDE_LOGITS, strict=True):
        block.attn.smear_logit[...] = jnp.array(logits)
    return model


def test_a_wide_smear_mixes_each_key_with_the_keys_before_it_by_a_softmax_per_head():
    attn = _wide().h[1].attn
    k = jax.random.normal(jax.random.key(3), (2, 7, 3, 16))
    got = np.asarray(attn.smear(k))
    for n, logits in enumerate(WIDE_LOGITS[1]):
        z = np.array([0.0, *logits])
        a = np.exp(z) / np.exp(z).sum()  # tap i weighs the key i positions back (zeros before 0)
        kn = np.asarray(k[:, :, n])
        want = sum(a[i] * np.pad(kn, ((0, 0), (i, 0), (0, 0)))[:, :7] for i in range(4))
        np.testing.assert_allclose(got[:, :, n], want, rtol=1e-5, atol=1e-6)
    # width 1 keeps its [N] weights and is the same formula: softmax([0, l]) = [1 - w, w]
    one = _smeared().h[0].attn
    assert one.smear_logit[...].shape == (3,)
    w = 1 / (1 + np.exp(-np.array(SMEAR_LOGITS[0])))
    kk = np.asarray(k)
    before = np.pad(kk, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :7]
    np.testing.assert_allclose(one.smear(k), (1 - w)[:, None] * kk + w[:, None] * before,
                               rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("spec", DECODING_SPECS, ids=["causal-softmax", "window-entmax15"])
def test_a_wide_smear_decodes_in_chunks_as_the_full_pass(spec):
    model = _wide(spec)
    assert model.init_cache(2, 12)[0]["k_last"].shape == (2, 3, 3, 16)  # each head's last 3 keys
    check_cached_decoding(model, _ids(2, 12))


def test_a_wide_smear_round_trips_files_students_and_hardening(tmp_path):
    model = _wide()
    folder = save_pretrained(model, tmp_path / "wide")
    assert json.loads((folder / "config.json").read_text())["smear_width"] == 3
    loaded = from_pretrained(folder)
    assert loaded.config.smear_width == 3
    np.testing.assert_array_equal(loaded.h[1].attn.smear_logit[...], WIDE_LOGITS[1])
    ids = _ids()
    np.testing.assert_array_equal(loaded(ids), model(ids))
    spec = AttentionSpec(mask=causal() & local(4, 0), head_gate="sigmoid_ste")
    student = student_from_teacher(model, spec)
    student.h[0].attn.head_gate.logits[...] = jnp.array([2.0, -1.0, 0.5])  # head 1 pruned
    hard = harden(student)
    assert hard.config.smear_width == 3
    np.testing.assert_array_equal(hard.h[0].attn.smear_logit[...], np.array(WIDE_LOGITS[0])[[0, 2]])
    np.testing.assert_allclose(hard(_ids(2, 20)), student(_ids(2, 20)), atol=1e-5)


def test_bad_smear_widths_are_refused_by_name():
    with pytest.raises(ValueError, match=r"`smear_width`=2 mixes keys .* needs `smear_keys`=True"):
        GPT2Config.preset("tiny", smear_width=2)
    with pytest.raises(ValueError, match=r"smear_width"):
        GPT2Config.preset("tiny", smear_keys=True, smear_width=0)
