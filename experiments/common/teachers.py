"""The teacher shipped with the package: ``--teacher.source bundled``, the main job's default.

``default/`` is a Hugging Face GPT-2 folder (``config.json``, ``model.safetensors`` in float16)
plus ``teacher.json``: the command that made it (``python -m experiments.bundle_teacher``), the
teacher flags it was trained with (those of ``--teacher.source train`` with the default
config), the corpus it was trained and evaluated on, and its evaluation loss after the float16
rounding and passkey recall at 1x, 2x and 4x its training length, which
``tests/test_bundled_teacher.py`` reproduces.

Its files stay in the distill package's data (``experiments/distill/teachers/default``); this
module, shared by the experiments (the main job loads it, ``bench search_passes`` reads its
attention scores), finds them.

Example::

    from experiments.common import teachers

    teachers.record()["flags"]["teacher.steps"]  # 800
    model = from_pretrained(teachers.BUNDLED)
"""

from __future__ import annotations

import json
import pathlib

__all__ = ["BUNDLED", "record"]

BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "distill" / "teachers" / "default"


def record() -> dict:
    """``teacher.json`` of the bundled teacher; ValueError saying what to do when the
    installation lacks it."""
    path = BUNDLED / "teacher.json"
    files = [path, BUNDLED / "config.json", BUNDLED / "model.safetensors"]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ValueError(
            f"--teacher.source bundled: the installation lacks {missing}; reinstall sparse_jax, "
            "or pass --teacher.source train (trains the same teacher here)"
        )
    return json.loads(path.read_text())
