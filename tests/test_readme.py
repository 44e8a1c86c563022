"""The README's Quickstart and example stay runnable and in step with .ci/run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_has_exactly_two_commands_and_ci_runs_the_second():
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, flags=re.S)
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands), "each Quickstart step is one command line"
    assert "experiments." in commands[0] and "pytest" in commands[1]
    extracted = subprocess.run(
        ["awk", "/<!-- test-command -->/{getline; getline; print; exit}", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert extracted == commands[1]


def test_python_example_runs():
    example = re.findall(r"```python\n(.*?)\n```", README, flags=re.S)
    assert example
    for block in example:
        exec(compile(block, "README.md", "exec"), {})
