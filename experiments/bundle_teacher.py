"""python -m experiments.bundle_teacher

Makes the bundled teacher, ``experiments/distill/teachers/default`` (what
``--teacher.source bundled``, the main job's default, loads): the teacher that ``--teacher.source
train`` trains with the default config's flags (taken from ``--run.cache-dir`` when a run has
trained it already), written with its weights rounded to float16, then read back and evaluated on
the default evaluation windows. ``teacher.json`` records the command, the teacher and data flags,
the corpus, the evaluation loss before and after the rounding, and the passkey recall of the
shipped weights (:data:`RECALL_SEQUENCES` held-out sequences per length, at 1x, 2x and 4x
``--data.seq-len``, the lengths the main job's report asks at);
``tests/test_bundled_teacher.py`` reproduces the loss and the recall of the shipped weights.

Extra flags are those of ``python -m experiments.distill`` (``--run.cache-dir``, say); flags
that change what is trained (``--teacher.*``, ``--data.*``, ``--run.seed``) make another
teacher than the default, and are refused.

``python -m experiments.bundle_teacher --remeasure`` trains nothing: it measures the shipped
weights again (their evaluation loss, which must still be the recorded one, and their recall)
and rewrites ``teacher.json`` with what this code records, for a record that a newer version
measures more of. Retraining is no substitute: the same flags on another machine give other
weights (float sums in another order).
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
from experiments.distill.config import TeacherConfig
from experiments.distill.run_folder import Run, log
from sparse_jax.files import write_text_atomically
from sparse_jax.models import from_pretrained, save_pretrained

__all__ = ["main"]

# The flags the bundled teacher's training depends on (recorded in teacher.json).
RECORDED = (
    *(f"teacher.{name}" for name in TeacherConfig.TRAINING),
    "data.source",
    "data.tokenizer",
    "data.seq_len",
    "data.batch_size",
    "run.seed",
)

#: Passkey sequences per length of the recall that teacher.json records (the depths cycled).
RECALL_SEQUENCES = 96


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--remeasure" in argv:
        return remeasure([a for a in argv if a != "--remeasure"])
    changed = _teacher_flags(argv)
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
        shipped = from_pretrained(staged)
        nll, _ = measure.evaluate_lm(shipped, run.eval_windows)
        record = {
            **_described(config, run),
            "eval_nll": nll,
            "eval_nll_float32": nll_float32,
            "weights": "float16",
            "recall": recall_record(run, shipped),
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


def _teacher_flags(argv: list[str]) -> list[str]:
    """The flags of ``argv`` that would make another teacher than the default config's."""
    return [a for a in argv if a.startswith(("--teacher.", "--data.", "--run.seed", "--config"))]


def _described(config, run: Run) -> dict:
    """What teacher.json says the teacher is: the command, the recorded flags, the cache key
    and the evaluation data."""
    flags = config.flags()
    return {
        "command": "python -m experiments.bundle_teacher",
        "flags": {key: flags[key] for key in RECORDED},
        "teacher_key": distill_phases.teacher_key(config, run.data),
        "dataset": run.data.dataset_name,
        "eval_windows": len(run.eval_windows),
    }


def remeasure(argv: list[str]) -> dict:
    """``--remeasure``: the shipped weights measured again, and teacher.json rewritten with what
    this code records (training-time fields kept: the float32 loss, Python and jax). Refused
    (ValueError) when the shipped weights are not the default config's teacher (another cache
    key or corpus) or their evaluation loss is no longer the recorded one."""
    changed = _teacher_flags(argv)
    if changed:
        raise ValueError(f"bundle_teacher --remeasure takes no flags that change the teacher; "
                         f"got {changed}")  # fmt: skip
    old = teachers.record()
    with tempfile.TemporaryDirectory() as tmp:
        config = distill.parse(["--teacher.source", "train", "--run.dir", f"{tmp}/run", *argv])
        run = Run(config)
        described = _described(config, run)
        for key in ("teacher_key", "dataset", "eval_windows"):
            if described[key] != old[key]:
                raise ValueError(
                    f"the bundled teacher's {key} is {old[key]!r}, the default config's "
                    f"{described[key]!r}: it is not this config's teacher; make it again "
                    "(python -m experiments.bundle_teacher)"
                )
        shipped = from_pretrained(teachers.BUNDLED)
        nll, _ = measure.evaluate_lm(shipped, run.eval_windows)
        if abs(nll - old["eval_nll"]) > 1e-4:
            raise ValueError(
                f"the bundled teacher's evaluation loss is now {nll:.5f}, recorded "
                f"{old['eval_nll']:.5f}: the evaluation changed; make the teacher again"
            )
        record = {**old, **described, "recall": recall_record(run, shipped)}
        write_text_atomically(
            teachers.BUNDLED / "teacher.json", json.dumps(record, indent=2) + "\n"
        )
    log(f"bundled teacher remeasured: recall {record['recall']['accuracy']}")
    return record


def recall_record(run: Run, model) -> dict:
    """The passkey recall of ``model`` as teacher.json records it: ``{"sequences", "lengths",
    "accuracy": {length: mean over the depths}, "by_depth": {"length@depth": accuracy}}``,
    measured as the main job's report measures it (:func:`distill_phases.recall_table`, with
    :data:`RECALL_SEQUENCES` sequences per length)."""
    table = distill_phases.recall_table(run, {"m": model}, count=RECALL_SEQUENCES)
    by_depth = table["models"].get("m", {})
    accuracy = {
        str(n): sum(v for key, v in by_depth.items() if key.startswith(f"{n}@"))
        / sum(key.startswith(f"{n}@") for key in by_depth)
        for n in table["lengths"]
    }
    return {
        "sequences": RECALL_SEQUENCES,
        "lengths": table["lengths"],
        "accuracy": accuracy,
        "by_depth": by_depth,
    }


if __name__ == "__main__":
    main()
