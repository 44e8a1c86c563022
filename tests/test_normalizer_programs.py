"""The programs the normalizers compile to: the non-finite policy's +inf clamp runs only in the
branch that needs it (masked softmax's too: docs/benchmarks.md, "The block-sparse engine against
`2228944`"), and on CPU sparsemax attention's reverse pass leaves its matmuls
alone (docs/benchmarks.md, "The non-finite policy behind one conditional"). Structure, not
timings: the timings are ``python -m experiments.bench normalizers``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import sparse_jax
from sparse_jax.masks import causal
from sparse_jax.normalizers import masked_softmax

_BIG = float(jnp.finfo(jnp.float32).max)

_NORMALIZERS = {
    "softmax": lambda x, axis=-1: masked_softmax(x, jnp.bool_(True)),
    "sparsemax": sparse_jax.sparsemax,
    "entmax15": sparse_jax.entmax15,
    "entmax α=1.3": lambda x, axis=-1: sparse_jax.entmax(x, 1.3, axis),
}


def _clamps(jaxpr, in_branch: bool = False):
    """(clamps outside any cond branch, clamps inside one): `min` with the largest float."""
    outside, inside = 0, 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "min" and any(
            isinstance(v, jex_core.Literal) and float(np.asarray(v.val)) == _BIG for v in eqn.invars
        ):
            inside, outside = (inside + 1, outside) if in_branch else (inside, outside + 1)
        branch = in_branch or eqn.primitive.name == "cond"
        for sub in jex_core.jaxprs_in_params(eqn.params):
            o, i = _clamps(sub, branch)
            outside, inside = outside + o, inside + i
    return outside, inside


@pytest.mark.parametrize("name", list(_NORMALIZERS))
def test_inf_clamp_only_in_a_conditional_branch(name):
    f = _NORMALIZERS[name]
    x = jnp.zeros((2, 3, 16))
    for fn in (f, jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(16.0)))):
        outside, inside = _clamps(jax.make_jaxpr(fn)(x).jaxpr)
        assert outside == 0, f"{name}: the +inf clamp runs on every entry, outside a branch"
        assert inside >= 1, f"{name}: no branch holds the +inf clamp (the policy for +inf)"


@pytest.mark.parametrize("name", list(_NORMALIZERS))
def test_inf_rows_still_take_the_policy(name):
    # The branch is taken by rows that need it: +inf entries share the row's weight, finite
    # rows in the same call are untouched, values and gradients finite, under jit too.
    f = _NORMALIZERS[name]
    x = jnp.array([[1.0, jnp.inf, 0.5, jnp.inf], [1.0, 0.8, -1.0, 0.0]])
    for fn in (f, jax.jit(f)):
        p = np.asarray(fn(x))
        np.testing.assert_allclose(p[0], [0.0, 0.5, 0.0, 0.5])
        np.testing.assert_allclose(p[1], np.asarray(f(x[1:]))[0], rtol=1e-6)
    g = jax.jit(jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(4.0))))(x)
    assert np.isfinite(np.asarray(g)).all()


def _fusions_with_dot_and_reduce(hlo: str) -> list[str]:
    comps = re.split(r"\n(?=%\S+ \()", hlo)
    return [
        c.split(" ", 1)[0]
        for c in comps
        if c.startswith("%fused") and " dot(" in c and re.search(r" reduce\(", c)
    ]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion decisions")
@pytest.mark.parametrize("normalizer", ["sparsemax", "entmax15"])
def test_reverse_pass_keeps_matmuls_alone_on_cpu(normalizer):
    # XLA:CPU fused sparsemax's Jacobian-product row sum into the matmul dp = g vᵀ, a fusion
    # that ran over twice as long as the matmul alone; with s outside the parentheses (as in
    # softmax's derivative) no fusion holds both a matmul and a reduction.
    x = jax.ShapeDtypeStruct((1, 512, 8, 64), jnp.float32)

    def loss(q, k, v, g):
        out = sparse_jax.attention(q, k, v, mask=causal(), normalizer=normalizer, impl="xla")
        return jnp.sum(out * g)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, x).compile().as_text()
    assert " dot(" in hlo
    assert _fusions_with_dot_and_reduce(hlo) == []
