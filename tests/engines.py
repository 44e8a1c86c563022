"""Which attention engine a call ran: read from its jaxpr, not from its values.

``sparse_jax.attention`` (and everything that calls it: ``attention_fn``, the models' layers)
runs its engine under the name scope ``sparse_jax/<engine>``; the scope is recorded on every
equation of the jaxpr, including those of nested jits, scans and custom derivatives. A test of a
dispatcher asserts both the value and :func:`assert_engine`, so that a dispatcher falling back
to another engine fails the test even when the values agree.

Beside the scope, each engine must show its own work inside it (a fallback that kept the scope
name would still fail): the block-sparse kernel gathers key/value blocks (``gather``), splash and
the fused kernels are a ``pallas_call``, the XLA reference forms scores with ``dot_general``
and gathers nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import jax
from jax.extend import core as jex_core

ENGINES = ("xla", "blocksparse", "pallas", "splash", "cudnn")
# Under autodiff the scope is wrapped, e.g. "transpose(jvp(sparse_jax/blocksparse))".
_SCOPE = re.compile(r"sparse_jax/(" + "|".join(ENGINES) + r")\b")

# Primitives that only the named engine's own work contains (checked inside its scope).
_SIGNATURE = {
    "blocksparse": "gather",
    "pallas": "pallas_call",
    "splash": "pallas_call",
    "xla": "dot_general",
}


def _sub_jaxprs(value) -> Iterator[jex_core.Jaxpr]:
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def all_equations(jaxpr) -> Iterator[jex_core.JaxprEqn]:
    """Every equation of ``jaxpr``, those of its nested jaxprs (jits, scans, conditionals,
    custom derivatives) included, each before the ones nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from all_equations(sub)


def traced_equations(fn: Callable, *args, **kwargs) -> Iterator[jex_core.JaxprEqn]:
    """:func:`all_equations` of the jaxpr ``fn(*args, **kwargs)`` traces to."""
    return all_equations(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def _equations(jaxpr, outer: str = "") -> Iterator[tuple[str, str]]:
    """(name stack, primitive name) of every equation, nested jaxprs included; a nested
    jaxpr's name stack is relative to its equation's, so the outer one is prefixed."""
    for eqn in jaxpr.eqns:
        stack = "/".join(s for s in (outer, str(eqn.source_info.name_stack)) if s)
        yield stack, eqn.primitive.name
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _equations(sub, stack)


def engine_trace(fn: Callable, *args, **kwargs) -> list[tuple[str, str]]:
    """(name stack, primitive) of every equation ``fn(*args, **kwargs)`` traces to."""
    return list(_equations(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr))


def engines_used(fn: Callable, *args, **kwargs) -> set[str]:
    """The engines whose scope ``sparse_jax/<engine>`` appears in the traced program."""
    return {m for stack, _ in engine_trace(fn, *args, **kwargs) for m in _SCOPE.findall(stack)}


def assert_lowered_contains(fn: Callable, *args, needle: str) -> None:
    """Fails unless the lowered (StableHLO) text of ``fn(*args)`` contains ``needle``, e.g. the
    ``__cudnn$fmha`` custom call of cuDNN's fused attention (as jax's own nn tests check)."""
    text = jax.jit(fn).lower(*args).as_text()
    assert needle in text, f"{needle!r} is not in the lowered program"


def assert_engine(engine: str, fn: Callable, *args, **kwargs) -> None:
    """Fails unless ``fn(*args, **kwargs)`` runs ``engine`` and no other attention engine, and
    the engine's own signature primitive appears inside its scope."""
    trace = engine_trace(fn, *args, **kwargs)
    used = {m for stack, _ in trace for m in _SCOPE.findall(stack)}  # traced once, not twice
    assert used == {engine}, f"expected engine {engine!r}, the program ran {sorted(used)}"
    inside = {prim for stack, prim in trace if engine in _SCOPE.findall(stack)}
    signature = _SIGNATURE.get(engine)
    assert signature is None or signature in inside, (
        f"the {engine!r} scope holds no {signature!r}: {sorted(inside)}"
    )
    if engine == "xla":
        assert "gather" not in inside, "the XLA reference engine gathers blocks: not the reference"
