"""``python -m experiments.bench checkouts``: one attention call timed in the library of several
commits, each in its own processes, the processes of different commits in alternation: the
check of a "no slower than at commit X" target (see CheckoutsConfig)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Literal

from experiments.common import timing

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh process whose working directory holds one commit's sparse_jax/ (first on
# sys.path under `python -c`). Only the public API that every commit since the engines landed
# has: sparse_jax.attention, masks.causal and masks.local. Prints one JSON line: the least time
# of each call.
CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
import sparse_jax
from sparse_jax import masks

a = json.loads(sys.argv[1])
extra = {"block_size": (a["block"], a["block"])} if a["impl"] == "blocksparse" else {}
mask = masks.causal()
if a["window"] is not None:
    mask = mask & masks.local(a["window"] - 1, 0)

def call(q, k, v):
    return sparse_jax.attention(q, k, v, mask=mask, normalizer=a["normalizer"],
                                impl=a["impl"], **extra)

def loss(q, k, v, g):
    return jnp.sum(call(q, k, v) * g)

fwd = jax.jit(call)
fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
shape = (1, a["length"], a["heads"], a["head_dim"])
q, k, v, g = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(0), 4))
calls = {"fwd": (fwd, (q, k, v)), "fwd+bwd": (fwd_bwd, (q, k, v, g))}
for f, args in calls.values():
    jax.block_until_ready(f(*args))
least = {name: float("inf") for name in calls}
for _ in range(a["repeats"]):
    for name, (f, args) in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        least[name] = min(least[name], time.perf_counter() - start)
print(json.dumps({"library": sparse_jax.__file__, **least}))
"""


@dataclasses.dataclass(frozen=True)
class CheckoutsConfig:
    """``sparse_jax.attention(q, k, v, mask=masks.causal(), ...)`` (or a causal sliding window)
    forward and forward+backward (``jax.grad`` to q, k, v), timed in the library of each commit
    in ``refs``: each commit's ``sparse_jax/`` is extracted from git (``git archive``: commits,
    not the working tree) and imported in a fresh process; the processes run one commit after
    the other, ``rounds`` times, in reversed order every other round, so that a machine getting
    slower moves all commits alike. Each process times ``repeats`` calls of each after one
    warm-up; a commit's figure is the least over all its calls (the machine's noise only adds
    time). Needs a git checkout (a clone of the repository).

    Example::

        python -m experiments.bench checkouts --refs 2228944 HEAD --normalizer sparsemax
    """

    refs: tuple[str, ...] = ("2228944", "HEAD")
    """Commits to compare (anything ``git rev-parse`` takes); the first is the reference of the
    ratio column."""
    impl: Literal["blocksparse", "xla"] = "blocksparse"
    """The engine ``attention`` is asked for."""
    normalizer: Literal["softmax", "sparsemax", "entmax15"] = "softmax"
    length: int = 2048
    """Queries and keys (q, k, v are ``[1, length, heads, head_dim]`` float32)."""
    heads: int = 8
    head_dim: int = 64
    block: int = 64
    """Query and key block of the block-sparse engine (unused by ``xla``)."""
    window: int | None = None
    """A causal sliding window of this many keys (the query's own and those before it) instead
    of the whole causal mask."""
    rounds: int = 3
    """Processes per commit."""
    repeats: int = 9
    """Timed calls of each function per process."""
    output: str | None = None
    """Also write the markdown to this file."""

    def __post_init__(self):
        timing.check_counts(self, "length", "heads", "head_dim", "block", "rounds", "repeats")
        if self.window is not None:
            timing.check_counts(self, "window")
        if not self.refs:
            raise ValueError("refs is empty: name at least one commit")


def resolve_commit(ref: str) -> str:
    """The full hash of ``ref`` in this checkout's git repository; ValueError naming it if git
    does not know it (or this is not a git checkout)."""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if found.returncode != 0:
        raise ValueError(
            f"bench checkouts: `refs` holds {ref!r}, which is not a commit of the git repository "
            f"at {ROOT} (this benchmark needs a clone of the repository)"
        )
    return found.stdout.strip()


def extract_library(commit: str, folder: Path) -> Path:
    """``sparse_jax/`` of ``commit`` written under ``folder`` (created); returns ``folder``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "sparse_jax"],
        cwd=ROOT, capture_output=True, check=True,
    )  # fmt: skip
    folder.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12
            tar.extractall(folder, filter="data")
        else:
            tar.extractall(folder)
    return folder


def time_commit(folder: Path, config: CheckoutsConfig) -> dict[str, float]:
    """One process importing ``folder``'s sparse_jax: the least seconds of ``fwd`` and
    ``fwd+bwd``. RuntimeError if it fails or timed another copy of the library."""
    names = ("impl", "normalizer", "length", "heads", "head_dim", "block", "window", "repeats")
    request = {name: getattr(config, name) for name in names}
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(request)],
        cwd=folder, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if child.returncode != 0:
        raise RuntimeError(f"bench checkouts: the timing process in {folder} failed:\n"
                           f"{child.stderr[-3000:]}")  # fmt: skip
    result = json.loads(child.stdout.strip().splitlines()[-1])
    library = Path(result.pop("library")).resolve()
    if not library.is_relative_to(folder.resolve()):
        raise RuntimeError(f"bench checkouts: the process in {folder} imported {library}")
    return result


def run_checkouts(config: CheckoutsConfig, command: str) -> str:
    """Times the call in each commit (see :class:`CheckoutsConfig`); returns the markdown."""
    commits = [resolve_commit(ref) for ref in config.refs]
    times: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(commits))}
    with tempfile.TemporaryDirectory(prefix="sparse_jax-checkouts-") as tmp:
        folders = [extract_library(c, Path(tmp) / str(i)) for i, c in enumerate(commits)]
        order = list(range(len(commits)))
        for round_ in range(config.rounds):
            for i in order if round_ % 2 == 0 else order[::-1]:
                timing.log(f"round {round_ + 1}/{config.rounds}: {config.refs[i]}")
                times[i].append(time_commit(folders[i], config))
    least = [{name: min(t[name] for t in times[i]) for name in ("fwd", "fwd+bwd")} for i in order]
    rows = []
    for i in order:
        per_round = " / ".join(timing.ms_text(1e3 * t["fwd+bwd"]) for t in times[i])
        ratio, fwd_ratio = (least[i][name] / least[0][name] for name in ("fwd+bwd", "fwd"))
        fwd, both = (timing.ms_text(1e3 * least[i][name]) for name in ("fwd", "fwd+bwd"))
        rows.append([config.refs[i], commits[i][:10], fwd, both, f"{ratio:.2f}x",
                     f"{fwd_ratio:.2f}x", per_round])  # fmt: skip
    headers = ["ref", "commit", "fwd ms", "fwd+bwd ms", f"fwd+bwd vs {config.refs[0]}",
               f"fwd vs {config.refs[0]}", "fwd+bwd ms per process"]  # fmt: skip
    mask = "causal" if config.window is None else f"causal & local({config.window - 1}, 0)"
    setting = (
        f"`attention(q, k, v, mask={mask}, normalizer={config.normalizer!r}, impl="
        f"{config.impl!r})`, q, k, v [1, {config.length}, {config.heads}, {config.head_dim}] "
        f"float32"
        + (f", blocks {config.block}" if config.impl == "blocksparse" else "")
        + f"; least of {config.rounds} processes x {config.repeats} calls per commit"
    )
    return (
        f"{timing.environment_line(command)}\n\n{setting}\n\n"
        f"{timing.markdown_table(headers, rows, 'llrrrrl')}\n"
    )
