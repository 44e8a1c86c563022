"""Every public function and class of ``sparse_jax`` has a docstring with an example.

The examples themselves run as doctests (``--doctest-modules`` in pyproject.toml collects
``sparse_jax/``); this test checks that none is missing, so a new public name without one
fails the suite, and runs the examples of the names pytest's collection cannot see: classes a
module builds on first access (its ``__getattr__``: the TFDS builders, defined only when
``tensorflow_datasets`` is imported).

Public: a name without a leading underscore that a module of the package defines (not one it
imports), listed in the module's ``__all__`` when it has one. Exceptions are exempt: their
docstrings say when they are raised, and the examples of the functions that raise them show it.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import sparse_jax


def _public_names() -> list[tuple[str, object]]:
    """``(module.name, object)`` of every public function and class, exceptions excepted."""
    found = []
    for info in pkgutil.walk_packages(sparse_jax.__path__, "sparse_jax."):
        module = importlib.import_module(info.name)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # imported from elsewhere: checked where it is defined
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            found.append((f"{module.__name__}.{name}", obj))
    return found


def test_the_walk_finds_the_public_api():
    names = {name for name, _ in _public_names()}
    # A few names that must be among them (the walk is what the next test trusts).
    for expected in (
        "sparse_jax.dispatch.attention",
        "sparse_jax.masks.kinds.causal",
        "sparse_jax.masks.kinds.Causal",
        "sparse_jax.cot.decode.Solver",
        "sparse_jax.models.encdec.EncoderDecoder",
        "sparse_jax.validation.check_int",
    ):
        assert expected in names, expected
    assert len(names) > 150


def test_every_public_function_and_class_has_an_example():
    missing = [name for name, obj in _public_names() if ">>>" not in (inspect.getdoc(obj) or "")]
    assert not missing, f"public names whose docstring has no `>>>` example: {missing}"


def test_the_examples_of_names_built_on_first_access_run():
    lazy = []
    for name, obj in _public_names():
        module_name, attr = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
        if attr not in vars(module):  # made by the module's __getattr__: not collected
            lazy.append((name, obj, module))
    assert {name.rsplit(".", 1)[1] for name, _, _ in lazy} >= {
        "SparseJaxText", "SparseJaxTextConfig", "SparseJaxLinalgCot", "SparseJaxLinalgCotConfig",
    }  # fmt: skip
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for name, obj, module in lazy:
        finder = doctest.DocTestFinder(recurse=False)
        tests = finder.find(obj, name, module=module, globs=dict(vars(module)))
        assert tests and tests[0].examples, name
        runner = doctest.DocTestRunner(optionflags=flags)
        for test in tests:
            runner.run(test)
        result = runner.summarize(verbose=False)
        assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
