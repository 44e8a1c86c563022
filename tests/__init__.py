"""What the test modules share beyond conftest.py: the environment of the scripts they run."""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def script_env(**variables: str) -> dict[str, str]:
    """This process's environment for a child Python process that runs a script written outside
    the repository and imports from it: the repository first on ``PYTHONPATH``, the caller's
    entries after it (a GPU image brings packages through them: ``.ci/gpu-check``), and
    ``variables`` on top."""
    path = os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **variables}
