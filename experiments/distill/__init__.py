"""The main job, ``python -m experiments.distill``: distil a dense GPT-2 teacher into a sparse
student, harden it, measure both (:mod:`.job` says what a run does and writes).

The package, bottom up: :mod:`.config` (the flag groups), :mod:`.configs` (named studies),
:mod:`.cli` (command line <-> config), :mod:`.teachers` (the bundled teacher),
:mod:`.run_folder` (run folder, resumption, data, mesh, one checkpointed phase),
:mod:`.phases` (teacher, student, hardened student), :mod:`.report` (report.md and plots),
:mod:`.job` (the run from end to end).

Example::

    from experiments import distill

    summary = distill.run(distill.parse(["--train.steps", "10", "--run.dir", "/tmp/run"]))
"""

from experiments.distill.cli import command, named, parse
from experiments.distill.config import DistillConfig
from experiments.distill.job import main, run
from experiments.distill.run_folder import Run

__all__ = ["DistillConfig", "Run", "command", "main", "named", "parse", "run"]
