"""The documentation site (docs/, Sphinx with MyST and autodoc) builds without a warning, its API
reference shows every public name with its docstring's example, and every command that README.md
and the docs write for the four programs parses against the program's flags."""

from __future__ import annotations

import html
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cascade, cot, distill
from experiments.bench import cli as bench
from tests import script_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# The modules whose exports the API reference documents (their __all__, modules left out).
DOCUMENTED = ("sparse_jax", "sparse_jax.models", "sparse_jax.masks", "sparse_jax.gates",
              "sparse_jax.cot")  # fmt: skip
PROGRAMS = {
    "experiments.distill": distill.parse,
    "experiments.cascade": cascade.parse,
    "experiments.cot": cot.parse,
    "experiments.bench": bench.parse,
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(out)],
        capture_output=True, text=True, env=script_env(), cwd=ROOT,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    assert build.stderr.strip() == "", build.stderr[-4000:]  # not one warning
    return out


def _public(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = [n for n in module.__all__ if not isinstance(getattr(module, n), type(module))]
    return [n for n in names if callable(getattr(module, n))]


@pytest.mark.parametrize("module_name", DOCUMENTED)
def test_the_api_reference_shows_every_public_name_with_its_example(site, module_name):
    pages = {p: p.read_text() for p in (site / "api").glob("*.html")}
    missing, without_example = [], []
    for name in _public(module_name):
        anchor = f'id="{module_name}.{name}"'
        page = next((text for text in pages.values() if anchor in text), None)
        if page is None:
            missing.append(name)
            continue
        # The object's own entry: from its anchor to the next top-level object of the page.
        entry = page.split(anchor, 1)[1]
        entry = re.split(
            r'<dl class="py (?:function|class|data)">\s*<dt class="sig sig-object py" id="'
            + re.escape(module_name)
            + r"\.",
            entry,
        )[0]
        if "&gt;&gt;&gt;" not in entry:
            without_example.append(name)
    assert not missing, f"{module_name}: not in the API reference: {missing}"
    assert not without_example, f"{module_name}: shown without their example: {without_example}"


def test_the_site_has_its_pages_and_links_resolve(site):
    for page in ("index", "getting-started", "results", "benchmarks", "api/index",
                 "guides/normalizers", "guides/attention", "guides/sparsity",
                 "guides/experiments", "guides/multihost", "archive/index"):  # fmt: skip
        assert (site / f"{page}.html").is_file(), page
    # Links between the pages point at pages that were built.
    for page in site.rglob("*.html"):
        for target in re.findall(r'href="([^"#:]+\.html)', page.read_text()):
            assert (page.parent / html.unescape(target)).resolve().is_file(), (page, target)


def _slugs(page: Path) -> set[str]:
    """The anchors of ``page``'s headings, as GitHub and MyST (``myst_heading_anchors``) make
    them."""
    from myst_parser.slugs import github_slugify

    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    titles = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {github_slugify(title.replace("`", "").strip()) for title in titles}


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md", "docs/guides"])
def test_links_between_the_markdown_pages_lead_to_a_page_and_heading(page):
    pages = [ROOT / page] if page.endswith(".md") else sorted((ROOT / page).glob("*.md"))
    for source in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (source.parent / path).resolve() if path else source
            assert linked.is_file(), f"{source.name}: {target} leads to no file"
            if anchor:
                assert anchor in _slugs(linked), f"{source.name}: {target} names no heading"


def _documented_commands():
    """Every ``python -m experiments.<program> ...`` command of README.md and docs/**/*.md (but
    docs/archive/, whose history keeps the commands of its time): the lines of code blocks
    (backslash continuations joined, comments dropped) and inline code spans (which may wrap),
    with the docs' shell variables expanded."""
    out = []
    docs = [doc for doc in sorted(DOCS.rglob("*.md")) if "archive" not in doc.parts]
    for doc in (ROOT / "README.md", *docs):
        text = doc.read_text()
        variables = dict(re.findall(r'(?:^|`)(\w+)="([^"]*)"', text, flags=re.M))
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        lines = [
            line.split("#", 1)[0]
            for block in blocks
            for line in block.replace("\\\n", " ").splitlines()
        ]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]*)`", prose)]
        name = str(doc.relative_to(ROOT))
        for line in lines:
            for command in re.findall(r"python -m experiments\.\w+\b.*", line):
                # Longest names first: $OLD must not replace the start of $OLD2.
                for key, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
                    command = command.replace(f"${key}", value)
                out.append((name, command.strip()))
    return out


def test_the_docs_write_commands_of_every_program():
    programs = {shlex.split(c)[2] for _, c in _documented_commands()}
    assert set(PROGRAMS) <= programs, programs


@pytest.mark.parametrize(("doc", "command"), _documented_commands())
def test_documented_commands_parse(doc, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    program, args = words[2], words[3:]
    if program not in PROGRAMS:
        pytest.skip(f"{doc}: {program} is not one of the programs parsed here")
    if any("<" in a or a.endswith(">") or "|" in a or a.startswith("[") for a in args):
        pytest.skip(f"{doc}: a pattern, not a command: {command}")
    if "..." in args:
        pytest.skip(f"{doc}: a pattern, not a command: {command}")
    if any("{" in a for a in args):
        pytest.skip(f"{doc}: a choice of subcommands, not a command: {command}")
    data = next((a for a in args if "shared/data" in a), None)
    if data is not None and not (ROOT / data).exists():
        pytest.skip(f"{doc}: {data} is absent")
    parse = PROGRAMS[program]
    if "--help" in args:
        with pytest.raises(SystemExit) as info:
            parse(args)
        assert info.value.code == 0
        return
    try:
        parse(args)
    except ValueError as err:  # a named config's data (e.g. --config wikitext2_study)
        if "shared/data" in str(err) and not (ROOT.parent / "shared" / "data").exists():
            pytest.skip(f"{doc}: the shared data beside the checkout is absent: {err}")
        raise
