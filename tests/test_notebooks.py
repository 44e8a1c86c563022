"""The Colab notebooks (``colab/*.ipynb``) run from top to bottom in their small setting, and are
committed clean: no outputs, no execution counts, as ``colab/make_notebooks.py`` writes them.

Each notebook runs in a fresh Jupyter kernel of this interpreter, from its own folder (as Jupyter
and Colab start it), with ``SPARSE_JAX_NOTEBOOK_SMALL=1`` (tiny sizes), the Hugging Face offline
variables (no network: the notebooks fall back to the embedded teacher and corpus) and
``SPARSE_JAX_NOTEBOOK_DIR`` pointing at a temporary folder, where the runs and their caches go.
The kernel compiles with the suite's cheap XLA options (``tests/conftest.py``): the same
computation, less optimised, about half the compile time of these tiny runs.
"""

from __future__ import annotations

import ast
import json
import runpy
import sys
from pathlib import Path

import pytest

# The notebook tools come with the dev extras (CI has them); an image without them, such as the
# lent GPU machine's, skips this module rather than failing to collect it.
nbformat = pytest.importorskip("nbformat")
KernelSpecManager = pytest.importorskip("jupyter_client.kernelspec").KernelSpecManager
KernelManager = pytest.importorskip("jupyter_client.manager").KernelManager
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
# The notebook that runs no experiment; the others run one end to end (tiny, but the whole job),
# and `-m "not slow"` skips them, as it skips the experiments' own end-to-end tests.
QUICK = {"quickstart.ipynb"}
# The notebooks that write a run folder with report.md.
RUN_JOBS = {"distill_gpt2.ipynb", "cascade.ipynb", "cot.ipynb"}


def _load(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _code_cells(nb) -> list[str]:
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def _params(paths):
    for path in paths:
        marks = [] if path.name in QUICK else [pytest.mark.slow]
        yield pytest.param(path, id=path.stem, marks=marks)


def test_there_are_notebooks():
    assert {*QUICK, *RUN_JOBS} <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nb = _load(path)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs or execution counts; clear them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_with_the_install_cell_and_has_a_small_switch(path):
    code = _code_cells(_load(path))
    install = _code_cells(_load(COLAB / "quickstart.ipynb"))[0]
    assert code[0] == install, f"{path.name}: the first code cell is not the shared install cell"
    assert 'REPO_URL = ""' in install  # no public URL yet: no made-up one
    switch = 'SMALL = SMALL or os.environ.get("SPARSE_JAX_NOTEBOOK_SMALL") == "1"'
    assert any(switch in source for source in code), f"{path.name}: no SMALL switch"


def test_generator_writes_the_committed_notebooks():
    make = runpy.run_path(str(COLAB / "make_notebooks.py"))  # no bytecode left in colab/
    for name in make["NOTEBOOKS"]:
        committed = json.loads((COLAB / f"{name}.ipynb").read_text())
        written = json.loads(nbformat.writes(make["build"](name)))
        assert committed == written, (
            f"colab/{name}.ipynb differs: run python colab/make_notebooks.py"
        )


# ----------------------------------------------------------------------------------------------
# The install cell's helpers, taken from the notebook (its definitions only: nothing installed).


@pytest.fixture(scope="module")
def install():
    source = _code_cells(_load(COLAB / "quickstart.ipynb"))[0]
    tree = ast.parse(source)
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef)
    tree.body = [node for node in tree.body if isinstance(node, kept)]
    namespace = {}
    exec(compile(tree, "install cell", "exec"), namespace)
    return namespace


def _checkout(folder: Path, name: str = "sparse-jax") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(f'[build-system]\n\n[project]\nname = "{name}"\n')
    return folder


def test_install_without_checkout_package_or_url_says_to_set_repo_url(install, tmp_path):
    _checkout(tmp_path / "other", name="other-project")  # not a checkout of sparse_jax
    with pytest.raises(RuntimeError, match="REPO_URL is empty") as err:
        install["install_plan"](tmp_path / "other", "", None)
    assert "Set REPO_URL" in str(err.value) and "clone of the repository" in str(err.value)


def test_install_plan_prefers_the_checkout_it_sits_in(install, tmp_path):
    plan = install["install_plan"]
    root = _checkout(tmp_path / "sparse_jax")
    inside = root / "colab"
    inside.mkdir()
    url = "https://example.invalid/sparse_jax.git"
    assert plan(inside, url, None) == ("editable", str(root))
    assert plan(inside, url, root / "sparse_jax") == ("ready", str(root))
    assert plan(inside, url, tmp_path / "site-packages" / "sparse_jax") == ("prefer", str(root))
    assert plan(tmp_path, url, None) == ("url", url)
    elsewhere = tmp_path / "site-packages" / "sparse_jax"
    assert plan(tmp_path, "", elsewhere) == ("installed", str(elsewhere))


def test_this_checkout_is_found_from_the_notebooks_folder(install):
    assert install["find_checkout"](COLAB) == ROOT


# ----------------------------------------------------------------------------------------------
# Running them.


def _execute(path: Path) -> nbformat.NotebookNode:
    """``path`` run in a fresh kernel of this interpreter, from its own folder; raises
    CellExecutionError (with the cell and its traceback) on an error."""
    nb = _load(path)
    # ipykernel's own spec (this interpreter), not a `python3` kernelspec installed elsewhere.
    manager = KernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )
    assert manager.kernel_spec.argv[0] == sys.executable
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(nb, km=manager, timeout=600, resources=resources).execute()
    return nb


def _text(nb) -> str:
    return "".join(
        output.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )


@pytest.mark.parametrize("path", list(_params(NOTEBOOKS)))
def test_notebook_runs_in_its_small_setting(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("SPARSE_JAX_NOTEBOOK_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    before = sorted(p.name for p in COLAB.iterdir())
    nb = _execute(path)
    assert "(ready)" in _text(nb) or "(prefer)" in _text(nb)  # this checkout, nothing installed
    if path.name in RUN_JOBS:
        assert list(tmp_path.glob("*/report.md")), f"{path.name} wrote no report in {tmp_path}"
        # Run again (as after a runtime restart): the finished run is shown, not run again.
        assert "holds a finished run" in _text(_execute(path))
    assert sorted(p.name for p in COLAB.iterdir()) == before, "the notebook wrote into colab/"
