"""Checks of the experiments' flags, shared by the main job, the cascade and the chain-of-thought
experiment: a bad value is refused naming its flag, the value and what is allowed, and a resumed
run is refused when its flags would change what its checkpoints hold.

>>> flag_name("train.fast_eps")
'--train.fast-eps'
>>> int_at_least(np.int64(3), "--train.steps", 1)
3
>>> @dataclasses.dataclass(frozen=True)
... class Train:
...     steps: int = 8
...     def __post_init__(self):
...         set_ints_at_least(self, "train", steps=1)
>>> type(Train(np.int64(4)).steps)
<class 'int'>
>>> Train(0)
Traceback (most recent call last):
ValueError: --train.steps must be an int >= 1; got 0
>>> changed_flags({"train": {"lr": 0.1, "steps": 8}}, {"train": {"lr": 0.2, "steps": 8}})
['--train.lr (run: 0.1, now: 0.2)']
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import pathlib
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def flag_name(field: str) -> str:
    """The command-line flag of a dotted config field (``"train.fast_eps"`` ->
    ``"--train.fast-eps"``)."""
    return "--" + field.replace("_", "-")


def is_int(value: Any) -> bool:
    """A python or numpy integer (bools refused)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def int_at_least(value: Any, flag: str, low: int) -> int:
    """``value`` as a python int >= ``low``, else ``ValueError`` naming ``flag`` (numpy integers
    accepted; bools, floats and strings refused)."""
    if not is_int(value) or value < low:
        raise ValueError(f"{flag} must be an int >= {low}; got {value!r}")
    return int(value)


def set_ints_at_least(config: Any, group: str, **lows: int) -> None:
    """Checks the int fields ``lows`` names of the frozen dataclass ``config``, whose flags are
    ``--group.name`` (each >= its low), and stores each as a python int."""
    for name, low in lows.items():
        value = int_at_least(getattr(config, name), flag_name(f"{group}.{name}"), low)
        object.__setattr__(config, name, value)


def check_max_minutes(value: Any, flag: str = "--run.max-minutes") -> None:
    """Refuses a time limit that is not None or a finite number of minutes > 0 (``ValueError``
    naming ``flag``)."""
    if value is None:
        return
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{flag} must be a number of minutes > 0 or None; got {value!r}")


def resume_command(module: str, argv: Sequence[str], folder: str | pathlib.Path) -> str:
    """The shell command that continues a stopped run: ``python -m <module>`` with ``argv`` (the
    stopped command's arguments), its run folder set to ``folder`` and ``--run.resume`` added.

    >>> resume_command("experiments.cot", ["train", "--run.dir=a b", "--train.steps", "9"], "a b")
    "python -m experiments.cot train --train.steps 9 --run.dir 'a b' --run.resume"
    """
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--run.dir":
            skip = True  # its value follows
        elif not arg.startswith("--run.dir=") and arg not in ("--run.resume", "--run.no-resume"):
            kept.append(arg)
    return shlex.join(["python", "-m", module, *kept, "--run.dir", str(folder), "--run.resume"])


def flat(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config record (a config.json) as ``{"group.name": value}``."""
    out = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_flags(
    saved: Mapping[str, Any],
    given: Mapping[str, Any],
    *,
    only: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """The flags whose values differ between a run's record ``saved`` and this command's
    ``given`` (nested or dotted records), each as ``"--group.name (run: X, now: Y)"``, sorted.

    ``only``: compare just the keys under these prefixes (what decides the checkpoints);
    ``ignore``: keys that may change on resumption. A key the run's (older) record lacks takes
    its value from ``defaults``, and is skipped when ``defaults`` is None or lacks it.
    """
    saved, given = flat(saved), flat(given)
    only = None if only is None else tuple(only)
    ignore = frozenset(ignore)
    defaults = {} if defaults is None else flat(defaults)
    changed = []
    for key in sorted(set(saved) | set(given)):
        if key in ignore or (only is not None and not _under(key, only)):
            continue
        if key in saved:
            before = saved[key]
        elif key in defaults:
            before = defaults[key]
        else:
            continue
        now = given.get(key)
        if before != now:
            changed.append(f"{flag_name(key)} (run: {before!r}, now: {now!r})")
    return changed


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """The ``--run.*`` flags of an experiment laid out as data / model / train / run (the
    cascade, the chain of thought): its run folder, resumption, seed, checkpoints, cache and
    time limit. An experiment subclasses it to change a default or add a flag.

    >>> RunFlags(resume=True)
    Traceback (most recent call last):
    ValueError: --run.resume needs the --run.dir of the run to continue
    """

    dir: pathlib.Path | None = None
    """Run folder (default: runs/<experiment>-<date>-<time>)."""
    resume: bool = False
    """Continue the run in --run.dir from its last checkpoints."""
    seed: int = 0
    """Seed of the models' initial weights, of the batches and of any sampling in training."""
    checkpoint_every: int = 100
    """Updates between checkpoints (and evaluations)."""
    cache_dir: pathlib.Path = pathlib.Path("~/.cache/sparse_jax")
    """Where prepared data is cached."""
    max_minutes: float | None = None
    """Stop training after this many minutes of the command, with a checkpoint of the step
    reached (as on SIGTERM or Ctrl-C), and exit with status 75: the same command with
    --run.resume continues (e.g. within a session's time limit)."""

    def __post_init__(self):
        set_ints_at_least(self, "run", seed=0, checkpoint_every=1)
        if self.resume and self.dir is None:
            raise ValueError("--run.resume needs the --run.dir of the run to continue")
        check_max_minutes(self.max_minutes)


# The flags that decide what the checkpoints of an experiment laid out as data / model / train /
# run (the cascade, the chain of thought) hold: a resumed run must keep them.
CHECKPOINT_FLAGS = ("data", "model", "train", "run.seed", "run.checkpoint_every")


def check_resume(
    config: Any,
    folder: str | pathlib.Path,
    *,
    kind: str,
    only: Iterable[str] = CHECKPOINT_FLAGS,
    defaults: Mapping[str, Any] | None = None,
):
    """Refuses ``--run.resume`` of ``folder`` (``ValueError``) when it holds no ``config.json``
    or when the flags under ``only`` (those that decide what the checkpoints hold; default
    :data:`CHECKPOINT_FLAGS`) differ from those of ``config``, a dataclass of the experiment's
    flags; the message names each. ``defaults``: the values of flags newer than the run's
    record, as its code ran them (:func:`changed_flags`)."""
    record = pathlib.Path(folder) / "config.json"
    if not record.is_file():
        raise ValueError(
            f"--run.resume: {str(folder)!r} holds no {kind} run (no config.json); start one "
            "without --run.resume"
        )
    have = json.loads(record.read_text())
    want = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    changed = changed_flags(have, want, only=only, defaults=defaults)
    if changed:
        raise ValueError(
            f"--run.resume: the flags differ from those of the run in {str(folder)!r} "
            f"({'; '.join(changed)}); resume with the run's own flags (its config.json), or "
            "start another --run.dir"
        )


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)
