"""The structure of the code (README, "Layout"), read from the imports of every module:

- the dependency direction is one way: normalizers, masks and gates <- the attention engines <-
  data <- models <- training <- the solver API (cot) <- what the experiments share <- the
  experiments, each its own package <- the programs built on an experiment;
- no circle of imports between modules, at any depth (a package's ``__init__`` counts as a
  module: a submodule that imports a name from its own package's ``__init__`` closes a circle);
- no module imports another module's private (``_``) names;
- an experiment imports what the experiments share, never another experiment;
- no module is shadowed by a name its package exports, at any depth;
- no source file is longer than a concept needs.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("sparse_jax", "experiments")

# Lower numbers are lower in the stack; a module may import modules of its own level or below.
LEVELS = {
    "sparse_jax.normalizers": 0,
    "sparse_jax.validation": 1,
    "sparse_jax.files": 1,  # files written whole (run folders, caches, saved models)
    "sparse_jax.masks": 2,
    "sparse_jax.gates": 2,
    "sparse_jax.blocksparse": 3,
    "sparse_jax.fused": 3,
    "sparse_jax.dynamic": 3,
    "sparse_jax.block_gate": 3,  # a learned selector for sparse_jax.dynamic's block selection
    "sparse_jax.kernels": 3,
    "sparse_jax.dispatch": 4,
    "sparse_jax.data": 5,
    "sparse_jax.models": 6,
    "sparse_jax.training": 7,
    "sparse_jax.cot": 8,  # the chain-of-thought model as an API: a trained model answers
    "experiments.common": 9,  # what the experiments share
    "experiments.distill": 10,
    "experiments.cascade": 10,
    "experiments.cot": 10,
    "experiments.bench": 10,
    "experiments.bundle_teacher": 11,  # makes the main job's bundled teacher
}
# The experiments' own packages: each imports experiments.common and itself, no other.
EXPERIMENTS = ("experiments.distill", "experiments.cascade", "experiments.cot", "experiments.bench")

# Source files allowed above MAX_LINES, each with the reason one concept needs the length.
MAX_LINES = 1000
LONG_FILES: dict[str, str] = {}


def _level(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        level = LEVELS.get(".".join(parts[:n]))
        if level is not None:
            return level
    return None


def _sources() -> list[tuple[str, pathlib.Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found.append((name.removesuffix(".__init__"), path))
    return found


SOURCES = _sources()
MODULES = {name for name, _ in SOURCES}
IS_PACKAGE = {name for name, path in SOURCES if path.name == "__init__.py"}


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if module in IS_PACKAGE else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, str | None]]:
    """``(target module, imported name or None)`` of every import of ``path`` (at any depth in
    the file) that names a module of the project: ``from P import m`` is an import of module
    ``P.m`` when ``P.m`` is a module, else of ``P`` (its ``__init__``) for the name ``m``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    found.append((f"{source}.{alias.name}", None))
                else:
                    found.append((source, alias.name))
    return [(m, name) for m, name in found if m.split(".")[0] in PACKAGES]


IMPORTS = {module: _imports(module, path) for module, path in SOURCES}


@pytest.mark.parametrize(("module", "path"), SOURCES, ids=lambda x: str(x))
def test_imports_point_down_the_stack(module, path):
    own = _level(module)
    if own is None:  # the packages' roots re-export the public API from every level
        assert module in PACKAGES, f"{module} has no level in LEVELS"
        return
    upward = sorted({m for m, _ in IMPORTS[module] if (_level(m) or 0) > own})
    assert not upward, f"{module} (level {own}) imports from higher levels: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    private = sorted(
        f"{m}.{name}"
        for m, name in IMPORTS[module]
        if name is not None and name.startswith("_") and not name.startswith("__")
    )
    assert not private, f"{module} imports private names of other modules: {private}"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiment_imports_no_other_experiment(experiment):
    others = sorted(
        {
            m
            for module in MODULES
            if module == experiment or module.startswith(experiment + ".")
            for m, _ in IMPORTS[module]
            if m.startswith("experiments.")
            and not m.startswith(("experiments.common", experiment))
            and m != "experiments"
        }
    )
    assert not others, f"{experiment} imports other experiments: {others}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or with a self-edge
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return out


def test_circles_are_found():
    # the detector itself: a -> b -> c -> a is one circle, d -> d another, e alone none
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d"]]


def test_no_import_circle_between_modules():
    graph = {m: {t for t, _ in IMPORTS[m] if t in MODULES and t != m} for m in MODULES}
    assert _circles(graph) == []


def _packages():
    for package in PACKAGES:
        yield package
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.ispkg:
                yield info.name


@pytest.mark.parametrize("package", sorted(p for p in IS_PACKAGE))
def test_module_names_are_not_shadowed_at_any_depth(package):
    imported = importlib.import_module(package)
    for info in pkgutil.iter_modules(imported.__path__):
        if info.name == "__main__":
            continue
        attribute = getattr(imported, info.name, None)
        if attribute is None:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        assert attribute is module, (
            f"{package}.{info.name} is shadowed by {package}'s name {info.name!r} "
            f"({type(attribute).__name__})"
        )


def test_every_package_is_checked():
    assert set(_packages()) == IS_PACKAGE


@pytest.mark.parametrize(("module", "path"), SOURCES, ids=lambda x: str(x))
def test_source_files_stay_short(module, path):
    lines = len(path.read_text().splitlines())
    relative = str(path.relative_to(ROOT))
    if relative in LONG_FILES:
        assert lines > MAX_LINES, f"{relative} is short now: take it off LONG_FILES"
        return
    assert lines <= MAX_LINES, f"{relative} has {lines} lines (at most {MAX_LINES})"


def test_models_have_no_import_cycle():
    # gpt2 is the model; loading and saving Hugging Face checkpoints (hf) builds on it.
    gpt2 = {m for m, _ in IMPORTS["sparse_jax.models.gpt2"]}
    assert not any(m.startswith("sparse_jax.models.hf") for m in gpt2)
