"""What the test modules share beyond conftest.py: the environment of the scripts they run, and
starting a program in a child process and killing it (SIGKILL) at a chosen moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def script_env(**variables: str) -> dict[str, str]:
    """This process's environment for a child Python process that runs a script written outside
    the repository and imports from it: the repository first on ``PYTHONPATH``, the caller's
    entries after it (a GPU image brings packages through them: ``.ci/gpu-check``), and
    ``variables`` on top."""
    path = os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **variables}


def dead_sibling(path: Path, tag: str) -> Path:
    """``sparse_jax.files.sibling(path, tag)`` as a child process names it, the child having
    ended when this returns: the name a writer killed midway leaves behind."""
    code = f"from sparse_jax import files; print(files.sibling({str(path)!r}, {tag!r}))"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=script_env(), check=True
    )
    return Path(child.stdout.strip())


def start_logged(cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
    """``cmd`` started in the repository root, its stderr written to the file ``log`` (a file,
    not a pipe nobody reads: the child never blocks on it); ``kwargs`` go to ``Popen``."""
    with open(log, "w") as err:
        return subprocess.Popen(cmd, cwd=_ROOT, stderr=err, **kwargs)


def kill_when(
    proc: subprocess.Popen,
    ready: Callable[[], bool],
    log: Path,
    timeout: float = 240,
    poll: float = 0.2,
) -> None:
    """SIGKILL to ``proc`` once ``ready()`` (asked every ``poll`` seconds, for ``timeout``
    seconds at most), then waits for it to end. The child must still be running then: one that
    ended first fails the test with the end of its ``log``."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(poll)
    assert proc.poll() is None, log.read_text()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
