"""The command line of ``python -m experiments.distill``: a command read into a
:class:`~experiments.distill.config.DistillConfig` (``--config <name>`` starts from a study in
``experiments/distill/configs/``, the other flags apply over it), and a config written back as
the command that runs it (what a stopped or refused run tells the user to type).

Example:
  >>> from experiments.distill.config import TrainConfig
  >>> config = parse(["--config", "planted", "--train.steps", "10"])
  >>> config.flags()["train.steps"]
  10
  >>> command(DistillConfig(train=TrainConfig(steps=9)), resume=True, run_dir="runs/a")
  'python -m experiments.distill --resume --train.steps 9 --run.dir runs/a'
"""

from __future__ import annotations

import importlib
import shlex
import sys
from typing import Any

import tyro

from experiments.common.flags import flag_name
from experiments.distill import configs
from experiments.distill.config import DistillConfig

__all__ = ["command", "command_line", "named", "parse"]


def command(config: DistillConfig, *, resume: bool | None = None, run_dir: Any = None) -> str:
    """The shell command that runs ``config`` (the flags that differ from its --config's
    values), with --resume and --run.dir set as given."""
    flags = config.flags()
    if resume is not None:
        flags["resume"] = resume
    if run_dir is not None:
        flags["run.dir"] = str(run_dir)
    return command_line(flags)


def command_line(flags: dict[str, Any]) -> str:
    """``python -m experiments.distill ...`` for dotted flag values (as :meth:`DistillConfig.flags`
    gives them): the flags that differ from the values of their ``--config`` study. Flags that
    no longer exist are left out."""
    name = flags.get("config", "default")
    name = name if name in configs.NAMES else "default"
    base = named(name).flags()
    args = ["python", "-m", "experiments.distill"]
    if name != "default":
        args += ["--config", name]
    for key, value in flags.items():
        if key == "config" or key not in base or value == base[key]:
            continue
        flag = flag_name(key)
        if isinstance(value, bool):  # tyro's --x / --no-x, --group.x / --group.no-x
            group, _, field = flag[2:].rpartition(".")
            off = f"--{group}.no-{field}" if group else f"--no-{field}"
            args.append(flag if value else off)
        elif isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return shlex.join(args)


def named(name: str) -> DistillConfig:
    """The study config ``experiments/distill/configs/<name>.py`` (what its ``get_config()``
    returns)."""
    if name not in configs.NAMES:
        raise ValueError(f"--config {name!r} is unknown; allowed: {configs.NAMES}")
    config = importlib.import_module(f"{configs.__name__}.{name}").get_config()
    if not isinstance(config, DistillConfig) or config.config != name:
        raise TypeError(
            f"experiments/distill/configs/{name}.py: get_config() must return a DistillConfig with "
            f"config={name!r}"
        )
    return config


def _config_name(args: list[str]) -> str | None:
    """The value of ``--config`` in ``args`` (None when absent)."""
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse(args: list[str] | None = None, description: str | None = None) -> DistillConfig:
    """The config of a command line: the named study config (``--config``, default 'default')
    with the other flags applied over it."""
    args = list(sys.argv[1:] if args is None else args)
    name = _config_name(args)
    base = named(name) if name in configs.NAMES else None  # an unknown name: tyro says why
    return tyro.cli(DistillConfig, args=args, default=base, description=description)
