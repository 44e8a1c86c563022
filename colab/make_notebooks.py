"""Writes the notebooks of this folder: ``python colab/make_notebooks.py``.

The notebooks are committed exactly as this script writes them: no outputs, no execution counts,
fixed cell ids. ``tests/test_notebooks.py`` checks that, runs every notebook in its ``SMALL``
setting and checks that this script still writes the committed files (edit the cells here, then
run the script).

Every notebook opens with the same two cells: :data:`INSTALL` (installs sparse_jax from the
checkout the notebook sits in, else from ``REPO_URL``) and a setup cell that starts with
:data:`SETUP` (the ``SMALL`` switch, the folder runs are written to, the accelerator).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------
# Cells every notebook shares.

INSTALL = r'''
# Installs sparse_jax: from the checkout this notebook sits in when there is one, else from
# REPO_URL. Safe to run again.
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

# The project's git repository, used when the notebook is not inside a checkout (e.g. opened
# from GitHub in Colab). The project has no public URL yet: set it to the URL you clone from.
REPO_URL = ""


def find_checkout(start: Path) -> Path | None:
    """The nearest folder at or above `start` whose pyproject.toml is the sparse_jax project."""
    for folder in (start, *start.parents):
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            for line in pyproject.read_text().splitlines():  # the first `name = ...`: [project]'s
                key, _, value = line.partition("=")
                if key.strip() == "name":
                    if value.strip().strip("\"'").lower().replace("-", "_") == "sparse_jax":
                        return folder
                    break
    return None


def installed_location() -> Path | None:
    """The package folder `import sparse_jax` loads now (None: not importable)."""
    spec = importlib.util.find_spec("sparse_jax")
    return Path(spec.origin).resolve().parent if spec is not None and spec.origin else None


def install_plan(start: Path, repo_url: str, installed: Path | None) -> tuple[str, str]:
    """What this cell does, as (action, where):

    ("ready", checkout): sparse_jax already imports from the checkout; nothing to install.
    ("prefer", checkout): it is installed, but not from the checkout (e.g. `pip install .`):
        the checkout's code is put first on sys.path.
    ("editable", checkout): `pip install -e` the checkout.
    ("installed", package): no checkout around; the installed sparse_jax is used.
    ("url", repo_url): no checkout and nothing installed: `pip install git+REPO_URL`.
    Raises RuntimeError when there is no checkout, nothing installed and no REPO_URL.
    """
    root = find_checkout(start)
    if root is not None:
        if installed is not None and root in installed.parents:
            return "ready", str(root)
        return ("prefer" if installed is not None else "editable"), str(root)
    if installed is not None:
        return "installed", str(installed)
    if repo_url:
        return "url", repo_url
    raise RuntimeError(
        "sparse_jax is not installed, this notebook is not inside a checkout of the project (no "
        f"pyproject.toml of sparse_jax in {start} or above it) and REPO_URL is empty. Set "
        "REPO_URL at the top of this cell to the git URL of the sparse_jax repository (the "
        "project has no public URL yet), or open the notebook from a clone of the repository, "
        "then run this cell again."
    )


action, where = install_plan(Path.cwd().resolve(), REPO_URL, installed_location())
if action == "editable":
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", where], check=True)
elif action == "url":
    url = where if where.startswith("git+") else f"git+{where}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", url], check=True)
if action in ("editable", "prefer") and where not in sys.path:
    sys.path.insert(0, where)  # an editable install takes effect at the kernel's next start
importlib.invalidate_caches()
sparse_jax = importlib.import_module("sparse_jax")
print(f"sparse_jax {sparse_jax.__version__} from {Path(sparse_jax.__file__).parent} ({action})")'''

SETUP = r"""
import os
from pathlib import Path

import jax

# SMALL: tiny sizes, a smoke run in well under a minute on a CPU. Set it to True to try the
# notebook quickly; the test suite sets SPARSE_JAX_NOTEBOOK_SMALL=1.
SMALL = False
SMALL = SMALL or os.environ.get("SPARSE_JAX_NOTEBOOK_SMALL") == "1"
# Where runs are written (a relative path is relative to the notebook's working directory).
WORK_DIR = Path(os.environ.get("SPARSE_JAX_NOTEBOOK_DIR", "runs")).expanduser()
BACKEND = jax.default_backend()  # "cpu", "gpu" or "tpu"
DEVICES = jax.devices()
print(f"{BACKEND}: {len(DEVICES)} x {DEVICES[0].device_kind}; SMALL = {SMALL}")"""

# Shows a run folder's report.md with its pictures (a notebook resolves the report's image
# links against its own folder, not the run folder's).
SHOW_REPORT = r'''
import re

from IPython.display import Image, Markdown, display


def show_report(folder: Path) -> None:
    """The run's report.md, its pictures shown where the report links them."""
    parts = re.split(r"!\[[^\]]*\]\(([^)\s]+)\)", (folder / "report.md").read_text())
    for i, part in enumerate(parts):
        if i % 2:  # an image link
            display(Image(filename=str(folder / part)))
        elif part.strip():
            display(Markdown(part))'''

INSTALL_NOTE = """**Install.** In a clone of the repository the next cell installs that checkout
(`pip install -e`, skipped when sparse_jax already imports from it); elsewhere (e.g. Colab opened
from GitHub) it installs from `REPO_URL`, which you set first. If the install changes jax on a
GPU or TPU runtime and `jax.devices()` then shows only a CPU, install the matching build
(`pip install -U "jax[cuda12]"` or `"jax[tpu]"`) and restart the runtime."""

COLAB_RUNTIME = (
    "In Colab, pick the accelerator first (*Runtime > Change runtime type*: a GPU or a TPU); "
    "the notebook also runs on a CPU, with smaller sizes."
)


def opening(title: str, setup: str) -> list[tuple[str, str]]:
    """The cells every notebook opens with: its ``title`` (markdown, then :data:`COLAB_RUNTIME`),
    :data:`INSTALL_NOTE` and :data:`INSTALL`, ``setup`` (a line of markdown) and :data:`SETUP`."""
    return [
        ("md", title + COLAB_RUNTIME),
        ("md", INSTALL_NOTE),
        ("code", INSTALL),
        ("md", setup),
        ("code", SETUP),
    ]


def summary_cell(run: str, then: str) -> str:
    """The cell that trains and measures: a finished run's summary is read back (not run again),
    else ``summary = <run>`` (the program's ``run``); then ``then``, which prints from it."""
    return (
        r"""
import json

if FINISHED:
    print(f"{RUN_DIR} holds a finished run: its report follows")
    summary = json.loads((RUN_DIR / "summary.json").read_text())
else:
    summary = """
        + run
        + "\n"
        + then
    )


# ----------------------------------------------------------------------------------------------
# quickstart.ipynb

QUICKSTART = [
    *opening(
        """# sparse_jax quickstart: sparse normalizers, masks and attention engines

The functional API in a few cells: **sparsemax** and **1.5-entmax** against softmax on one row of
scores, a mask built with the **mask algebra** and the **block layout** it compiles to, then
`sparse_jax.attention` under each normalizer with each **engine** that applies on this runtime,
timed against dense attention.

""",
        "Set-up: the accelerator this kernel found, and sizes that fit it (`SMALL`: a smoke run).",
    ),
    (
        "code",
        r"""
import functools
import time

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import sparse_jax as sj
from sparse_jax import masks
from sparse_jax.dispatch import IMPLS

# The timing section: sequence length, heads, head dim, kernel block size, local window.
if SMALL:
    SEQ, HEADS, DIM, BLOCK, WINDOW, REPEATS = 256, 2, 32, 64, 64, 2
elif BACKEND == "cpu":
    SEQ, HEADS, DIM, BLOCK, WINDOW, REPEATS = 2048, 8, 64, 128, 256, 5
else:
    SEQ, HEADS, DIM, BLOCK, WINDOW, REPEATS = 8192, 8, 64, 128, 512, 10
DTYPE = jnp.float32 if BACKEND == "cpu" else jnp.bfloat16
print(f"attention timed at n = {SEQ}, {HEADS} heads of {DIM}, {jnp.dtype(DTYPE).name}")""",
    ),
    (
        "md",
        """## Sparse normalizers

Softmax gives every score some weight. **sparsemax** (α = 2) and **1.5-entmax** map scores to
probabilities too, but with exact zeros: scores far enough below the largest get weight 0.
Left: the first probability of the row `[t, 0]` as `t` moves (softmax is the logistic
function; sparsemax reaches 0 and 1 at finite `t`). Right: one row of eight scores.""",
    ),
    (
        "code",
        r"""
normalizers = {"softmax": jax.nn.softmax, "1.5-entmax": sj.entmax15, "sparsemax": sj.sparsemax}
t = jnp.linspace(-3, 3, 301)
pairs = jnp.stack([t, jnp.zeros_like(t)], axis=-1)  # rows [t, 0]
row = jnp.array([2.0, 1.4, 1.1, 0.6, 0.2, -0.3, -0.8, -1.5])

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.5))
for i, (name, normalize) in enumerate(normalizers.items()):
    left.plot(t, normalize(pairs)[:, 0], label=name)
    p = np.asarray(normalize(row))
    label = f"{name}: {int((p > 0).sum())} of {p.size} nonzero"
    right.bar(np.arange(p.size) + (i - 1) * 0.27, p, 0.27, label=label)
    print(f"{name:>10}: {np.round(p, 3)}")
left.set(xlabel="t", ylabel="first probability of [t, 0]", title="two scores")
right.set(xlabel="entry", ylabel="probability", title=f"scores {np.round(row, 2).tolist()}")
left.legend()
right.legend()
plt.show()""",
    ),
    (
        "md",
        """## The mask algebra

A mask is a description (a predicate on query and key positions), combined with `&`, `|` and `~`
and evaluated only when a consumer asks: here a causal sliding window with attention sinks,
`causal() & (local(32, 0) | sink(4))`, drawn as a dense array (white: may attend).""",
    ),
    (
        "code",
        r"""
n = 256
window = masks.causal() & (masks.local(32, 0) | masks.sink(4))
parts = {
    "causal()": masks.causal(),
    "local(32, 0)": masks.local(32, 0),
    "sink(4)": masks.sink(4),
    "causal() & (local(32, 0) | sink(4))": window,
}
fig, axes = plt.subplots(1, len(parts), figsize=(15, 4), layout="constrained")
for ax, (name, mask) in zip(axes, parts.items(), strict=True):
    ax.imshow(mask.dense(n, n), cmap="gray", interpolation="none")
    ax.set(title=name, xlabel="key")
axes[0].set_ylabel("query")
plt.show()
print(f"{window}: {window.dense(n, n).mean():.1%} of the {n} x {n} entries")""",
    ),
    (
        "md",
        """## Its block layout

Kernels work on blocks: `mask.blocks(q_len, kv_len, block_q, block_kv)` lists, for each query
block, the key blocks that hold an allowed entry, and which of those are full (no masking inside).
The block-sparse engines compute only those blocks, so their work follows the mask.""",
    ),
    (
        "code",
        r"""
layout = window.blocks(n, n, 16, 16)
kinds = layout.block_mask()[0]  # 0 = empty, 1 = partial, 2 = full
fig, ax = plt.subplots(figsize=(4.5, 4))
image = ax.imshow(kinds, cmap=plt.get_cmap("viridis", 3), vmin=-0.5, vmax=2.5)
fig.colorbar(image, ticks=[0, 1, 2]).ax.set_yticklabels(["empty", "partial", "full"])
ax.set(title="blocks of 16 x 16", xlabel="key block", ylabel="query block")
plt.show()
print(
    f"{layout.block_density:.1%} of the blocks kept ({(kinds == 2).sum()} full, "
    f"{(kinds == 1).sum()} partial) for {layout.density:.1%} of the entries"
)""",
    ),
    (
        "md",
        """## Attention, each normalizer, each engine

`sparse_jax.attention(q, k, v, mask=, normalizer=, impl=)` takes `[batch, seq, heads, dim]` as
`jax.nn.dot_product_attention` does. `impl` picks the engine: `"xla"` (the dense reference,
chunked over queries), `"blocksparse"` (plain XLA over the kept blocks, every normalizer),
`"pallas"` (fused kernel, GPU), `"splash"` (TPU, softmax) and `"cudnn"` (NVIDIA GPU, softmax,
half precision); `"auto"` chooses, and `attention_impl` says which engine and why without
computing anything. The engines listed here are those the dispatcher picks on this runtime
(off their hardware the Pallas kernels would run in interpret mode: a test path, not a timing).""",
    ),
    (
        "code",
        r'''
NORMALIZERS = ["softmax", "sparsemax", "entmax15", 1.25]  # 1.25: α-entmax with α = 1.25


def label(normalizer) -> str:
    return normalizer if isinstance(normalizer, str) else f"{normalizer}-entmax"


MASK = masks.causal() & (masks.local(WINDOW, 0) | masks.sink(4))
BLOCKS = (BLOCK, BLOCK)


def engines_here() -> list[str]:
    """The engines impl="auto" picks on this runtime, over the calls it tells apart."""
    picked = set()
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.ShapeDtypeStruct((1, SEQ, HEADS, DIM), dtype)
        for normalizer in NORMALIZERS:
            for mask in (None, masks.causal(), masks.causal() & masks.local(WINDOW, 0), MASK):
                call = dict(mask=mask, normalizer=normalizer, block_size=BLOCKS)
                picked.add(sj.attention_impl(x, x, x, **call).impl)
    return [impl for impl in IMPLS if impl in picked]


ENGINES = engines_here()
x = jax.ShapeDtypeStruct((1, SEQ, HEADS, DIM), DTYPE)
print(f"engines on {BACKEND}: {ENGINES}")
for normalizer in NORMALIZERS:
    choice = sj.attention_impl(x, x, x, mask=MASK, normalizer=normalizer, block_size=BLOCKS)
    print(f"{label(normalizer)}: {choice.reason}")''',
    ),
    (
        "md",
        """Each engine applies where it can compute the call (`attention_impl(..., impl=engine)`
raises otherwise, naming the obstacle). Forward time, median of repeated calls after compilation,
against dense softmax attention (`jax.nn.dot_product_attention` given the mask as an array), and
the largest difference from the `"xla"` reference.""",
    ),
    (
        "code",
        r'''
def timed(fn, *args):
    """(output, median milliseconds of REPEATS calls) of jax.jit(fn), compiled and warmed up."""
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return out, 1e3 * float(np.median(times))


keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(key, (1, SEQ, HEADS, DIM)).astype(DTYPE) for key in keys)
dense_mask = jnp.asarray(MASK.dense(SEQ, SEQ))
dense = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)
_, dense_ms = timed(dense, q, k, v, dense_mask)

results, skipped = [], []
for normalizer in NORMALIZERS:
    auto = sj.attention_impl(q, k, v, mask=MASK, normalizer=normalizer, block_size=BLOCKS).impl
    reference = None
    for engine in ENGINES:
        call = dict(mask=MASK, normalizer=normalizer, impl=engine, block_size=BLOCKS)
        try:
            sj.attention_impl(q, k, v, **call)
        except ValueError as err:
            skipped.append(f"{label(normalizer)} on {engine}: {str(err).split('. ')[0]}")
            continue
        out, ms = timed(functools.partial(sj.attention, **call), q, k, v)
        reference = out if reference is None else reference
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
        name = engine + (" (auto)" if engine == auto else "")
        results.append((label(normalizer), name, ms, diff))

lines = [
    f"dense softmax (jax.nn.dot_product_attention, mask as an array): {dense_ms:.2f} ms",
    "",
    "| normalizer | engine | forward ms | dense softmax ms / this | max abs diff from xla |",
    "|:--|:--|--:|--:|--:|",
]
lines += [f"| {a} | {e} | {ms:.2f} | {dense_ms / ms:.2f}x | {d:.1e} |" for a, e, ms, d in results]
print("\n".join(lines))
if skipped:
    print("\n".join(["", "not applicable here:", *skipped]))''',
    ),
    (
        "code",
        r"""
fig, ax = plt.subplots(figsize=(9, 3.5))
labels = [label(normalizer) for normalizer in NORMALIZERS]
engines = list(dict.fromkeys(engine.split()[0] for _, engine, _, _ in results))
width = 0.8 / len(engines)
for j, engine in enumerate(engines):
    times = {a: ms for a, e, ms, _ in results if e.split()[0] == engine}
    xs = [i + (j - (len(engines) - 1) / 2) * width for i, a in enumerate(labels) if a in times]
    ax.bar(xs, [times[a] for a in labels if a in times], width, label=engine)
ax.axhline(dense_ms, color="k", linestyle="--", label="dense softmax (jax.nn)")
ax.set_xticks(range(len(labels)), labels)
ax.set(ylabel="forward ms", title=f"{MASK} at n = {SEQ} on {BACKEND}")
ax.legend()
plt.show()""",
    ),
    (
        "md",
        """Next: `distill_gpt2.ipynb` distils GPT-2 into a student that learns which of these masks
each head needs, `cascade.ipynb` prunes heads, FFN units and tokens block by block, and `cot.ipynb`
trains a sparse encoder–decoder that reasons step by step.""",
    ),
]

# ----------------------------------------------------------------------------------------------
# distill_gpt2.ipynb

DISTILL = [
    *opening(
        """# Distil GPT-2 into a sparse-attention student

The project's main job, `python -m experiments.distill`, called through its Python API: a dense
**teacher** (GPT-2 from the Hugging Face hub), a **student** with the teacher's weights whose heads
each learn a distribution over candidate masks (local windows, sinks, strided, causal), trained on
KL(teacher ‖ student) plus a penalty priced in the kernel blocks each mask costs, then
**hardened** into fixed block-sparse masks, fine-tuned, and **measured** against the teacher:
perplexity, KL, attention density, FLOPs and tokens/s, in a run folder with `report.md` and its
plots.

With a network (Colab), the teacher is GPT-2 (124M) and the text WikiText-2, both fetched here.
Offline or with `SMALL`, it falls back to what the job embeds: a small byte-level GPT-2 shipped
with the package and CPython's documentation as the corpus. Checkpoints go to `RUN_DIR`; after a
runtime restart, run the notebook again with the same settings and the run resumes.

""",
        "Set-up and settings.",
    ),
    (
        "code",
        r'''
import socket

USE_HUB = True  # GPT-2 and WikiText-2 from the Hugging Face hub when online
USE_DRIVE = False  # Colab: keep the run folder on Google Drive, so it outlives the runtime
WIKITEXT_DIR = None  # a folder already holding WikiText-2's valid.txt and test.txt: no download


def online(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether the hub answers (never when HF_HUB_OFFLINE=1)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


HUB = USE_HUB and not SMALL and online()
print("teacher and data:", "GPT-2 and WikiText-2 (hub)" if HUB else "the embedded default")''',
    ),
    (
        "md",
        """## The run folder

`RUN_DIR` holds the run: `config.json`, `metrics.jsonl`, `checkpoints/`, `summary.json`,
`report.md` and its plots. On Colab, `USE_DRIVE = True` puts it on Google Drive, where it survives
a disconnected runtime. Prepared data and tokenizer files are cached beside it.""",
    ),
    (
        "code",
        r"""
if USE_DRIVE:
    from google.colab import drive

    drive.mount("/content/drive")
    WORK_DIR = Path("/content/drive/MyDrive/sparse_jax")
if SMALL:
    RUN_DIR = WORK_DIR / "distill-small"
else:
    RUN_DIR = WORK_DIR / ("distill-gpt2" if HUB else "distill-embedded")
CACHE_DIR = WORK_DIR / "cache"
print(f"run folder {RUN_DIR.resolve()}")""",
    ),
    (
        "md",
        """## WikiText-2

Online, the tokenized WikiText-2 (`wikitext-2-v1`) is fetched from the hub and written as
`valid.txt` and `test.txt`, the layout the job reads: it trains on the validation split and
evaluates on the test split (its convention for WikiText-2, as in the project's own study).""",
    ),
    (
        "code",
        r'''
def fetch_wikitext2(folder: Path) -> Path:
    """WikiText-2's validation and test splits from the hub, as folder/valid.txt and test.txt."""
    import pyarrow.parquet as pq
    from huggingface_hub import hf_hub_download

    folder.mkdir(parents=True, exist_ok=True)
    for split, name in (("validation", "valid.txt"), ("test", "test.txt")):
        if (folder / name).is_file():
            continue
        parquet = f"wikitext-2-v1/{split}-00000-of-00001.parquet"
        path = hf_hub_download("Salesforce/wikitext", parquet, repo_type="dataset")
        lines = pq.read_table(path, columns=["text"]).column("text").to_pylist()
        part = folder / f".{name}.part"
        part.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
        part.replace(folder / name)  # whole or absent, if the download is interrupted
    return folder


if HUB:
    DATA = Path(WIKITEXT_DIR) if WIKITEXT_DIR else fetch_wikitext2(CACHE_DIR / "wikitext-2")
    sizes = [f"{p.name} {p.stat().st_size:,} bytes" for p in sorted(DATA.glob("*.txt"))]
    print(f"WikiText-2 in {DATA}: {', '.join(sizes)}")
else:
    print("no hub: the job's embedded corpus (CPython's documentation topics)")''',
    ),
    (
        "md",
        """## The mesh

The job shards its training step over a `("data", "model")` mesh of the accelerator's devices
(`jax.jit` with `NamedSharding`s): each device takes its rows of every batch. Here all devices go
on the data axis (`--run.data-axis`), and the batch is a multiple of their number.""",
    ),
    (
        "code",
        r'''
from sparse_jax.training import sharding

mesh = sharding.make_mesh(data=len(DEVICES), model=1)
print(dict(mesh.shape), mesh.devices.ravel().tolist())


def batch_for(rows: int) -> int:
    """At least `rows` sequences per update, a multiple of the data axis."""
    return -(-rows // len(DEVICES)) * len(DEVICES)''',
    ),
    (
        "md",
        """## The configuration

The job's flags (`python -m experiments.distill --help` lists them all), parsed into its config.
GPT-2: sequences of 512 tokens on an accelerator, candidate windows of 16 to 128 tokens, speed
also measured at GPT-2's 1024 positions. The embedded default: the job's own defaults. `SMALL`:
two updates at 16 tokens, no fine-tune, measured at that length only, no sample texts. If
`RUN_DIR` holds a run that did not finish, `--resume` continues it from its last checkpoints
(with the run's flags: change them and the job refuses, by name).""",
    ),
    (
        "code",
        r"""
from experiments import distill

if SMALL:
    args = [
        "--data.seq-len", "16", "--data.batch-size", str(batch_for(2)),
        "--train.steps", "2", "--harden.finetune-steps", "0", "--run.checkpoint-every", "2",
        "--measure.eval-batches", "1", "--measure.report-prompts", "0",
        "--student.serve-len-factor", "1",
    ]  # fmt: skip
elif HUB:
    accelerator = BACKEND != "cpu"
    if not accelerator:
        print("GPT-2 on a CPU is slow: a GPU or TPU runtime runs this study in minutes")
    args = [
        "--teacher.source", "gpt2", "--data.tokenizer", "gpt2", "--data.source", str(DATA),
        "--data.seq-len", "512" if accelerator else "128",
        "--data.batch-size", str(batch_for(8)),
        "--student.windows", "16", "32", "64", "128",
        "--student.serve-len-factor", "2" if accelerator else "4",
        "--student.block-size", "128" if BACKEND == "tpu" else "64",
        "--train.steps", "500" if accelerator else "100",
        "--harden.finetune-steps", "200" if accelerator else "50",
        "--measure.eval-batches", "16" if accelerator else "4",
    ]  # fmt: skip
else:
    args = ["--data.batch-size", str(batch_for(8))]
args += ["--run.dir", str(RUN_DIR), "--run.cache-dir", str(CACHE_DIR)]
args += ["--run.data-axis", str(len(DEVICES))]
FINISHED = (RUN_DIR / "summary.json").is_file()
if (RUN_DIR / "config.json").is_file() and not FINISHED:
    args.append("--resume")
config = distill.parse(args)
shell = distill.command(config, resume="--resume" in args, run_dir=RUN_DIR)
print("the same run from a shell:", shell)""",
    ),
    (
        "md",
        """## Distil, harden, measure

`distill.run(config)` runs the three phases (teacher, student, hardened student), each
checkpointed every `--run.checkpoint-every` updates, then measures both models on the evaluation
split and writes the report. A finished run is not run again: its report is shown (delete
`RUN_DIR`, or choose another, to start afresh). The stop button (or the runtime's SIGTERM)
ends training at the next update with a checkpoint of it (`RunStopped` says where); run the
cells again to continue from there.""",
    ),
    (
        "code",
        summary_cell(
            "distill.run(config)",
            r"""print(
    f"perplexity: teacher {summary['teacher_ppl']:.3f}, student {summary['student_ppl']:.3f}, "
    f"hardened {summary['hardened_ppl']:.3f}; KL(teacher || hardened) "
    f"{summary['hardened_kl']:.4f} nats/token; {summary['wall_time_s']:.0f} s on "
    f"{summary['device']}"
)""",
        ),
    ),
    (
        "md",
        """## The report

The run's `report.md` with its plots: quality and cost side by side, the training curves, the
candidate weights each head learned, the blocks each hardened head computes, and continuations
by the teacher and the hardened student.""",
    ),
    ("code", SHOW_REPORT + "\n\n\nshow_report(RUN_DIR)"),
]

# ----------------------------------------------------------------------------------------------
# cascade.ipynb

CASCADE = [
    *opening(
        """# CANDS: a cascade that prunes heads, FFN units and tokens

`python -m experiments.cascade` through its Python API: a dense GPT-2 and a cascade of the same
shape (block 1 dense; later blocks with gates on heads, FFN units and tokens, a token closed in
one block closed in all later ones, keep-ratio targets enforced by a Lagrangian), trained with the
same data, steps and seed; then perplexity, FLOPs per token and tokens/s of the pruned model
(closed heads and units cut out, kept tokens gathered) against the dense one. With a sweep of
final keep ratios, a Pareto plot of perplexity against FLOPs.

""",
        "Set-up.",
    ),
    (
        "md",
        """## The configuration

The experiment's flags (`python -m experiments.cascade --help` lists them), parsed into its
config. Full: the default model and corpus with a sweep of three more cascades for the Pareto
plot (a few minutes each on 2 CPU cores, more updates on an accelerator). `SMALL`: a tiny model,
a few updates. The run folder `RUN_DIR` is checkpointed; after a restart, run the notebook again:
`--run.resume` continues the run.""",
    ),
    (
        "code",
        r"""
import shlex

from experiments import cascade

if SMALL:
    args = [
        "--model.size", "tiny", "--data.seq-len", "8", "--data.batch-size", "4",
        "--train.steps", "2", "--run.checkpoint-every", "2", "--run.eval-batches", "1",
    ]  # fmt: skip
else:
    args = ["--sweep", "0.7", "0.5", "0.3"]
    if BACKEND != "cpu":
        args += ["--train.steps", "1000"]
RUN_DIR = WORK_DIR / ("cascade-small" if SMALL else "cascade")
args += ["--run.dir", str(RUN_DIR), "--run.cache-dir", str(WORK_DIR / "cache")]
FINISHED = (RUN_DIR / "summary.json").is_file()
if (RUN_DIR / "checkpoints").is_dir() and not FINISHED:
    args.append("--run.resume")
cfg = cascade.parse(args)
print("the same run from a shell:", shlex.join(["python", "-m", "experiments.cascade", *args]))""",
    ),
    (
        "md",
        """## Train and measure

`cascade.run(cfg)` trains both models (each phase checkpointed), measures them and writes the
report; it returns the summary. A finished run is shown, not run again. The stop button (or
the runtime's SIGTERM) ends training at the next update with a checkpoint of it (`RunStopped`
says where); run the cells again to continue from there.""",
    ),
    (
        "code",
        summary_cell(
            "cascade.run(cfg)",
            r"""dense, pruned = summary["dense"], summary["pruned"]
print(
    f"perplexity {dense['ppl']:.3f} -> {pruned['ppl']:.3f}; FLOPs per token "
    f"{dense['flops_per_token'] / 1e6:.2f} M -> {pruned['flops_per_token'] / 1e6:.2f} M; "
    f"kept fraction of tokens per block {[round(r, 3) for r in summary['keep_ratio']]}"
)""",
        ),
    ),
    (
        "md",
        """## The report

The run's `report.md` with its plots: the kept fraction of tokens per block against its
target, the head and FFN-unit gates at evaluation (`gates.png`) and, with a sweep, perplexity
against FLOPs (`pareto.png`).""",
    ),
    ("code", SHOW_REPORT + "\n\n\nshow_report(RUN_DIR)"),
]

# ----------------------------------------------------------------------------------------------
# cot.ipynb

COT = [
    *opening(
        """# Chain-of-thought linear algebra with a sparse encoder–decoder

`python -m experiments.cot` through its Python API: questions of an 18.06 quiz (reduced row
echelon form, solvability of `Ax = b`, column spaces, ...) generated with exact worked solutions,
one step per line; a **sparse encoder–decoder** (sparsemax attention and outputs, sparse
embeddings, a chain-of-thought module with top-k feature masks) and its **dense baseline** of the
same size, trained with the same data, steps and seed; then per question kind the exact match of
the final answer, the length of the chain of thought, the decoding time per question and the
attention density and FLOPs, sparse against dense. Last, `ask(...)`: a question of your own,
answered by the trained models (never by the symbolic solver, which only makes data and grades).

""",
        "Set-up.",
    ),
    (
        "md",
        """## The configuration

The experiment's flags (`python -m experiments.cot --help` lists them), parsed into its config.
On a CPU: the embedded default (three kinds at small sizes, a small model). On an accelerator:
the `study` preset (all six kinds, a bigger model, many more updates). `SMALL`: a tiny model, a
few updates (it answers, but not well). The run folder `RUN_DIR` is checkpointed; after a
restart, run the notebook again: `--run.resume` continues the run.""",
    ),
    (
        "code",
        r"""
import shlex

from experiments import cot as experiment

if SMALL:
    args = [
        "--data.kinds", "rref", "--data.train", "8", "--data.validation", "1",
        "--data.test", "4", "--model.d-model", "16", "--model.num-heads", "2",
        "--model.d-ff", "32", "--model.cot-steps", "0", "--train.steps", "2",
        "--train.batch-size", "4", "--train.warmup", "0", "--train.buckets", "1", "1",
        "--run.checkpoint-every", "2", "--eval.batch-size", "4", "--eval.repeats", "1",
    ]  # fmt: skip
elif BACKEND != "cpu":
    args = ["--preset", "study"]
else:
    args = []
RUN_DIR = WORK_DIR / ("cot-small" if SMALL else "cot-study" if args else "cot")
args += ["--run.dir", str(RUN_DIR), "--run.cache-dir", str(WORK_DIR / "cache")]
FINISHED = (RUN_DIR / "summary.json").is_file()
if (RUN_DIR / "cot.json").is_file():  # a run is there: continue it (a finished one trains nothing)
    args.append("--run.resume")
cmd = experiment.parse(args)
print("the same run from a shell:", shlex.join(["python", "-m", "experiments.cot", *args]))""",
    ),
    (
        "md",
        """## Train and evaluate

`experiment.run(cmd)` trains the sparse model, then the dense one (each checkpointed), decodes the
test split greedily with each (a key/value cache, one batch per kind) and writes the report; it
returns the summary. A finished run is shown, not run again. The stop button (or the runtime's
SIGTERM) ends training at the next update with a checkpoint of it (`RunStopped` says where);
run the cells again to continue from there.""",
    ),
    (
        "code",
        summary_cell(
            "experiment.run(cmd)",
            r"""for name in ("sparse", "dense"):
    overall = summary["evaluation"][name]["overall"]
    print(
        f"{name}: exact match {overall['exact_match']:.1%}, {overall['tokens']:.0f} tokens and "
        f"{1e3 * overall['seconds_per_question']:.2f} ms per question"
    )""",
        ),
    ),
    (
        "md",
        """## The report

Per question kind, as the GiantRabbit study's Figure 3: exact match, chain-of-thought length,
decoding time and attention density, sparse against dense; then the training losses.""",
    ),
    ("code", SHOW_REPORT + "\n\n\nshow_report(RUN_DIR)"),
    (
        "md",
        """## Ask

`Solver.load(RUN_DIR, model)` restores a trained model; `.answer(question)` decodes its chain of
thought and final answer. A question it cannot read gets an answer that says why. Change the
question (the trained kinds are listed in the report).""",
    ),
    (
        "code",
        r"""
from sparse_jax.cot import Solver

solvers = {name: Solver.load(RUN_DIR, name, batch_size=1) for name in ("sparse", "dense")}


def ask(question: str) -> None:
    # Each model's chain of thought, final answer and decoding time.
    for name, solver in solvers.items():
        answer = solver.answer(question)
        print(f"== {name} ({solver.step} updates) ==\n{answer.text}")
        if answer.error is None:
            print(f"final answer: {answer.final}; {answer.tokens} tokens in {answer.seconds:.3f} s")
        print()


ask("Find the reduced row echelon form R of A = [[2, 4], [1, 3]].")
ask("What is 2 + 2?")""",
    ),
]

# ----------------------------------------------------------------------------------------------

NOTEBOOKS = {
    "quickstart": (QUICKSTART, None),
    "distill_gpt2": (DISTILL, "GPU"),
    "cascade": (CASCADE, None),
    "cot": (COT, None),
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` as it is committed (no outputs, cell ids ``<name>-<index>``)."""
    cells, accelerator = NOTEBOOKS[name]
    nb = nbformat.v4.new_notebook()
    for i, (kind, source) in enumerate(cells):
        new = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(new(source.strip("\n"), id=f"{name}-{i}"))
    colab = {"name": f"{name}.ipynb", "provenance": []}
    nb.metadata = {
        "colab": colab,
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    if accelerator:
        nb.metadata["accelerator"] = accelerator
    nbformat.validate(nb)
    return nb


def main(names: list[str]) -> None:
    for name in names or NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        nbformat.write(build(name), path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
