"""python -m experiments.bundle_teacher

Makes the bundled teacher, ``experiments/distill/teachers/default`` (what
``--teacher.source bundled``, the main job's default, loads): the teacher that ``--teacher.source
train`` trains with the default config's flags (taken from ``--run.cache-dir`` when a run has
trained it already), written with its weights rounded to float16, then read back and evaluated on
the default evaluation windows. ``teacher.json`` records the command, the teacher and data flags,
the corpus, and the evaluation loss before and after the rounding;
``tests/test_bundled_teacher.py`` reproduces the loss of the shipped weights.

Extra flags are those of ``python -m experiments.distill`` (``--run.cache-dir``, say); flags
that change what is trained (``--teacher.*``, ``--data.*``, ``--run.seed``) make another
teacher than the default, and are refused.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile

import jax

from experiments import distill
from experiments.common import measure, teachers
from experiments.distill import phases as distill_phases
from experiments.distill.run_folder import Run, log
from sparse_jax.files import write_text_atomically
from sparse_jax.models import from_pretrained, save_pretrained

__all__ = ["main"]

# The flags the bundled teacher's training depends on (recorded in teacher.json).
RECORDED = (
    "teacher.size",
    "teacher.steps",
    "teacher.lr",
    "data.source",
    "data.tokenizer",
    "data.seq_len",
    "data.batch_size",
    "run.seed",
)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    changed = [a for a in argv if a.startswith(("--teacher.", "--data.", "--run.seed", "--config"))]
    if changed:
        raise ValueError(
            f"bundle_teacher makes the default config's teacher; {changed} would change it"
        )
    with tempfile.TemporaryDirectory() as tmp:
        config = distill.parse(["--teacher.source", "train", "--run.dir", f"{tmp}/run", *argv])
        run = Run(config)
        model = distill_phases.teacher(run)
        nll_float32, _ = measure.evaluate_lm(model, run.eval_windows)
        staged = save_pretrained(model, f"{tmp}/teacher", dtype="float16")
        nll, _ = measure.evaluate_lm(from_pretrained(staged), run.eval_windows)
        flags = config.flags()
        record = {
            "command": "python -m experiments.bundle_teacher",
            "flags": {key: flags[key] for key in RECORDED},
            "teacher_key": distill_phases.teacher_key(config, run.data),
            "dataset": run.data.dataset_name,
            "eval_windows": len(run.eval_windows),
            "eval_nll": nll,
            "eval_nll_float32": nll_float32,
            "weights": "float16",
            "python": platform.python_version(),
            "jax": jax.__version__,
        }
        write_text_atomically(staged / "teacher.json", json.dumps(record, indent=2) + "\n")
        shutil.rmtree(teachers.BUNDLED, ignore_errors=True)
        shutil.copytree(staged, teachers.BUNDLED)
    log(
        f"bundled teacher: {teachers.BUNDLED} (evaluation NLL {nll:.5f}, float32 {nll_float32:.5f})"
    )
    return record


if __name__ == "__main__":
    main()
