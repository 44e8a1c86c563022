"""Reliability of the public entry points' arguments (issue 18, class 3): errors that name the
argument, raised before anything is traced, and numpy integers accepted wherever ints are.

* Token ids outside ``[0, vocab_size)``: refused by ``GPT2.__call__`` and ``generate`` when the
  ids are concrete (naming the id and its place); under ``jit`` (tracers, no host sync) such an
  id embeds as NaN, so its logits are NaN and a negative id never wraps around to a real token.
* GPT2Config: every field checked at construction (``layer_norm_epsilon`` finite and > 0,
  counts as ints, numpy integers stored as python ints).
* The normalizers: empty arrays and α of a wrong type are refused naming the argument (the
  normalizers' own tests cover the rest of their arguments).
* The main job's config: numpy integers accepted as counts.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sparse_jax as sj
from experiments.distill import config as distill_config
from sparse_jax.models.gpt2 import GPT2, GPT2Config, generate
from sparse_jax.validation import check_int


@pytest.fixture(scope="module")
def tiny():
    return GPT2(GPT2Config.preset("tiny"), rngs=nnx.Rngs(0))  # vocab 101


# ---------------------------------------------------------------------------------------------
# Token ids.


@pytest.mark.parametrize("bad", [101, 5000, -1, -101])
@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_concrete_ids_outside_the_vocabulary_are_refused(tiny, bad, kind):
    ids = np.array([[1, 2, bad, 3]], np.int32)
    ids = jnp.asarray(ids) if kind == "jax" else ids
    message = rf"`ids` must be token ids in \[0, vocab_size\) = \[0, 101\); got {bad} at index"
    with pytest.raises(ValueError, match=rf"GPT2: {message} \(0, 2\)"):
        tiny(ids)
    with pytest.raises(ValueError, match=rf"generate: `prompt_ids` .* got {bad} at index \(0, 2\)"):
        generate(tiny, ids, 2, temperature=0.0)


def test_traced_ids_outside_the_vocabulary_give_nan_never_another_token(tiny):
    forward = nnx.jit(lambda model, ids: model(ids))
    for bad in (101, -1):
        logits = np.asarray(forward(tiny, jnp.array([[1, 2, bad, 3]])))
        # The bad position and every later one (they attend to it) are NaN; earlier ones not.
        assert np.isnan(logits[0, 2:]).all() and np.isfinite(logits[0, :2]).all(), bad
    # In-range ids of any integer dtype are untouched by the guard (int8, uint8 included).
    ref = np.asarray(forward(tiny, jnp.array([[1, 2, 3]], jnp.int32)))
    for dtype in (jnp.int8, jnp.uint8, jnp.int16):
        np.testing.assert_array_equal(np.asarray(forward(tiny, jnp.array([[1, 2, 3]], dtype))), ref)


def test_ids_that_are_not_integers_are_refused_traced_or_not(tiny):
    ids = np.array([[1.0, 2.0]], np.float32)
    with pytest.raises(TypeError, match=r"GPT2: `ids` must be integer token ids; got dtype float"):
        tiny(ids)
    with pytest.raises(TypeError, match=r"GPT2: `ids` must be integer token ids; got dtype bool"):
        nnx.jit(lambda model, x: model(x))(tiny, jnp.ones((1, 2), bool))


def test_ids_at_the_edges_of_the_vocabulary_are_fine(tiny):
    assert np.isfinite(np.asarray(tiny(np.array([[0, 100]])))).all()


def test_generate_accepts_numpy_scalars_and_names_bad_arguments(tiny):
    ids = np.zeros((1, 2), np.int64)
    out = generate(tiny, ids, np.int64(2), temperature=np.float32(0.0), top_k=np.int32(5))
    assert out.shape == (1, 4)
    cases = [
        (dict(max_new_tokens=0), ValueError, "`max_new_tokens` must be an int >= 1; got 0"),
        (dict(max_new_tokens=2.0), TypeError, "`max_new_tokens` must be an int >= 1; got 2.0"),
        (dict(temperature="0"), TypeError, "`temperature` must be a float >= 0; got '0'"),
        (dict(temperature=float("nan")), ValueError, "`temperature` must be a finite float"),
        (dict(temperature=-1.0), ValueError, "`temperature` must be a finite float >= 0"),
        (dict(top_k=0), ValueError, r"`top_k` must be an int in \[1, 101\]; got 0"),
        (dict(top_k=102), ValueError, r"`top_k` must be an int in \[1, 101\]; got 102"),
    ]
    for kwargs, error, match in cases:
        kwargs = {"max_new_tokens": 2, "temperature": 0.0, **kwargs}
        with pytest.raises(error, match="generate: " + match):
            generate(tiny, ids, **kwargs)


# ---------------------------------------------------------------------------------------------
# GPT2Config.


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        (
            "layer_norm_epsilon",
            -1e-5,
            ValueError,
            "`layer_norm_epsilon` must be a finite float > 0",
        ),
        ("layer_norm_epsilon", 0.0, ValueError, "`layer_norm_epsilon` must be a finite float > 0"),
        (
            "layer_norm_epsilon",
            float("nan"),
            ValueError,
            "`layer_norm_epsilon` must be a finite float > 0",
        ),
        (
            "layer_norm_epsilon",
            float("inf"),
            ValueError,
            "`layer_norm_epsilon` must be a finite float > 0",
        ),
        (
            "layer_norm_epsilon",
            "1e-5",
            TypeError,
            "`layer_norm_epsilon` must be a finite float > 0; got '1e-5'",
        ),
        (
            "layer_norm_epsilon",
            True,
            TypeError,
            "`layer_norm_epsilon` must be a finite float > 0; got True",
        ),
        ("n_layer", 0, ValueError, "`n_layer` must be an int >= 1; got 0"),
        ("n_layer", 2.0, TypeError, "`n_layer` must be an int >= 1; got 2.0"),
        ("n_head", True, TypeError, "`n_head` must be an int >= 1; got True"),
        ("vocab_size", "101", TypeError, "`vocab_size` must be an int >= 1; got '101'"),
        ("n_inner", 0, ValueError, "`n_inner` must be an int >= 1; got 0"),
        ("heads_per_layer", (3,), ValueError, "`heads_per_layer` must be 2 ints >= 0"),
        ("heads_per_layer", (3, -1), ValueError, "`heads_per_layer` must be 2 ints >= 0"),
        ("heads_per_layer", 3, TypeError, "`heads_per_layer` must be None or 2 ints >= 0"),
        ("dtype", "float16", ValueError, "`dtype` must be 'float32' or 'bfloat16'"),
    ],
)
def test_config_fields_are_checked_at_construction(field, value, error, match):
    with pytest.raises(error, match="GPT2Config: " + re.escape(match)):
        GPT2Config.preset("tiny", **{field: value})


def test_config_takes_numpy_integers_and_stores_python_ints():
    config = GPT2Config.preset(
        "tiny",
        n_layer=np.int64(2),
        vocab_size=np.int32(101),
        n_inner=np.uint16(8),
        heads_per_layer=np.array([3, 0]),
        layer_norm_epsilon=np.float32(1e-5),
    )
    assert config == GPT2Config.preset(
        "tiny", n_inner=8, heads_per_layer=(3, 0), layer_norm_epsilon=float(np.float32(1e-5))
    )
    for value in (config.n_layer, config.vocab_size, config.n_inner, *config.heads_per_layer):
        assert type(value) is int
    assert type(config.layer_norm_epsilon) is float
    # Configs from numpy counts are hashable and equal to those from ints (jit static args).
    assert hash(config) == hash(GPT2Config.preset("tiny", **config.__dict__))


def test_numpy_counts_are_ints_for_the_shared_check():
    assert check_int(np.int64(3), "n", "caller") == 3
    assert check_int(np.uint8(3), "n", "caller") == 3
    with pytest.raises(TypeError, match=r"caller: `n` must be an int >= 1; got np.True_"):
        check_int(np.bool_(True), "n", "caller")


# ---------------------------------------------------------------------------------------------
# The normalizers (what was left of class 3 there).


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_normalizers_refuse_an_empty_normalized_axis_by_name(name):
    fn = getattr(sj.normalizers, name)
    with pytest.raises(ValueError, match=rf"{name}: `x` with shape \(3, 0\) has an empty axis 1"):
        fn(jnp.zeros((3, 0)))
    assert fn(jnp.zeros((0, 3))).shape == (0, 3)  # an empty batch is fine


def test_entmax_refuses_alpha_as_a_string():
    with pytest.raises(TypeError, match="entmax: `alpha` must be a finite float >= 1"):
        sj.normalizers.entmax(jnp.zeros(3), "1.5")


# ---------------------------------------------------------------------------------------------
# The main job's config.


def test_distill_config_takes_numpy_integers():
    student = distill_config.StudentConfig(windows=np.array([4, 8]), block_size=np.int64(16))
    assert student.windows == (4, 8) and type(student.block_size) is int
    assert all(type(w) is int for w in student.windows)
    run = distill_config.RunConfig(seed=np.int32(3), checkpoint_every=np.uint8(2))
    assert (run.seed, run.checkpoint_every) == (3, 2) and type(run.seed) is int
    with pytest.raises(ValueError, match=r"--student.windows must be ints >= 1; got \(4, 0\)"):
        distill_config.StudentConfig(windows=(4, 0))
    with pytest.raises(ValueError, match=r"--run.seed must be an int; got np.True_"):
        distill_config.RunConfig(seed=np.bool_(True))
