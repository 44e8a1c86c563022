"""Named study configs of ``python -m experiments.distill --config <name>``.

One module per study; its ``get_config()`` returns an ``experiments.distill.config.DistillConfig``
(built when asked for, so that a study's data paths are checked only when it runs), and its
docstring opens with the command that runs it, then what the study is and the section of
docs/results.md that holds what it reached. Flags given after ``--config <name>`` override
the study's values.
"""

from __future__ import annotations

import pkgutil

# The study names, found without importing the studies (they import the config module).
NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
