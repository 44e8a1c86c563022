"""What the tests share: cheap XLA compilation for tiny problems, and the `slow` marker.

`pytest` runs everything (CI included); `pytest -m "not slow"` skips the end-to-end runs (the
distillation job, several processes, SIGKILL and resume) for a fast inner loop. Doctests of
``sparse_jax/`` are collected by pytest itself (``--doctest-modules`` in pyproject.toml).
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

import jax

# One on-disk cache of compiled programs for the whole run, shared by the pytest-xdist workers
# and by every process the tests start (the experiments' subprocess runs, SIGKILL and resume,
# several processes, the notebooks' kernels), which compile the same programs again and again:
# a resumed run, the second process of a distributed run, a notebook's tiny experiment. Nothing
# a test checks changes (the cache is keyed by the program, its compile options and the
# backend); the process that made the folder removes it at exit. A cache the caller names in
# JAX_COMPILATION_CACHE_DIR is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparse_jax-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Every program is worth caching here: the suite's programs are tiny and compile in well under
# jax's default threshold of a second.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# jax reads these variables when it is imported, which may have happened before this file ran
# (above, or in a plugin): set them in this process's config too.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)

# XLA options for tests bound by compile time (tiny problems, a scan or the normalizers' while
# loops per case, on a 2-core CPU): the same computation, only less optimised machine code. The
# first two cut the optimisation passes; the third emits the CPU's fusions without the MLIR
# fusion emitters, whose compilation is slower (docs/benchmarks.md, "The test suite's time").
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
XLA_FAST = " ".join(f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE.items())

# On CPU every program of the suite gets them, in the test processes and in every process they
# start (whose runs must match the in-process ones bit for bit): most of the suite's time is
# compiling tiny programs (the whole suite's time with and without them: docs/benchmarks.md,
# "The test suite's time"). XLA reads XLA_FLAGS when the backend starts, below, so whether
# it will be a CPU is judged before: no accelerator plugin installed (GPU PJRT plugins live in
# the `jax_plugins` namespace, TPUs need `libtpu`), or JAX_PLATFORMS=cpu.
_cpu_only = os.environ.get("JAX_PLATFORMS", "").strip() == "cpu" or not any(
    importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu")
)
if _cpu_only:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_FAST}".strip()


def jit_fast(fn, *args):
    """``jax.jit(fn)(*args)``, compiled once with :data:`FAST_COMPILE`."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


# The tests compare float32 results at float32 tolerances (1e-5 and below). XLA's default
# float32 matmul on GPUs is TF32 (10 mantissa bits), which fails them without being wrong, and a
# TPU's default is bfloat16 passes: on accelerators the suite runs at full float32 precision,
# the precision it compares at. (On CPU the default is already full precision: nothing changes
# there.) Tests of low-precision inputs (bfloat16, float16) are unaffected: their matmuls are in
# their own dtype.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")

# Python's cyclic garbage collector: at its default thresholds it runs full collections often
# while tracing and lowering allocate millions of short-lived objects, and each full pass walks
# every object the process holds (jax, flax, tensorflow, the modules collected). Here it runs
# rarely, and never over what was there when collection ended (frozen: immortal for the
# collector). Nothing a test checks changes; a worker holds a little more memory. What the
# passes cost: docs/benchmarks.md, "The test suite's time".
gc.set_threshold(50_000, 20, 20)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


# Scripts that made the golden values and fixtures once (they import torch/transformers, which
# are never dependencies): not test modules, and not imported by --doctest-modules.
collect_ignore_glob = ["golden/make_*.py", "fixtures/make_*.py"]


def pytest_runtest_logreport(report):
    """With SPARSE_JAX_FAILURE_LOG set to a file, each failure's traceback is appended to it as
    the failure arrives, not only in pytest's summary at the end: a run cut by a time limit (a
    GPU pass' ``.ci/gpu-check suite``, whose third and fifth runs ended without a summary) keeps
    them. Under pytest-xdist the controller writes (the workers send it their reports)."""
    path = os.environ.get("SPARSE_JAX_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
