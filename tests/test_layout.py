"""The dependency direction of the code is one way (README, "Layout"): normalizers, masks and
gates <- the attention engines <- models <- training <- the solver API (cot) <- experiments.
Checked on the imports of every module, so a new import that points back up fails here."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lower numbers are lower in the stack; a module may import modules of its own level or below.
LEVELS = {
    "sparse_jax.normalizers": 0,
    "sparse_jax.validation": 1,
    "sparse_jax.masks": 2,
    "sparse_jax.gates": 2,
    "sparse_jax.blocksparse": 3,
    "sparse_jax.fused": 3,
    "sparse_jax.dynamic": 3,
    "sparse_jax.kernels": 3,
    "sparse_jax.dispatch": 4,
    "sparse_jax.data": 5,
    "sparse_jax.models": 6,
    "sparse_jax.training": 7,
    "sparse_jax.cot": 8,  # the chain-of-thought model as an API: a trained model answers
    "experiments": 9,
}


def _level(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        level = LEVELS.get(".".join(parts[:n]))
        if level is not None:
            return level
    return None


def _modules():
    for path in sorted([*ROOT.glob("sparse_jax/**/*.py"), *ROOT.glob("experiments/**/*.py")]):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {m for m in found if m.split(".")[0] in ("sparse_jax", "experiments")}


@pytest.mark.parametrize(("module", "path"), list(_modules()), ids=lambda x: str(x))
def test_imports_point_down_the_stack(module, path):
    own = _level(module)
    if own is None:  # the package's __init__ re-exports the public API from every level
        assert module == "sparse_jax", f"{module} has no level in LEVELS"
        return
    upward = sorted(m for m in _imports(path) if (_level(m) or 0) > own)
    assert not upward, f"{module} (level {own}) imports from higher levels: {upward}"


def test_models_have_no_import_cycle():
    # gpt2 is the model; loading and saving Hugging Face checkpoints (hf) builds on it.
    gpt2 = _imports(ROOT / "sparse_jax/models/gpt2.py")
    assert not any(m.startswith("sparse_jax.models.hf") for m in gpt2)


def test_module_names_are_not_shadowed_by_the_public_api():
    import importlib

    import sparse_jax

    for name, _ in _modules():
        if name.startswith("sparse_jax.") and name.count(".") == 1:
            attribute = getattr(sparse_jax, name.split(".")[1], None)
            module = importlib.import_module(name)
            assert attribute is None or attribute is module, f"sparse_jax.{name} is shadowed"
