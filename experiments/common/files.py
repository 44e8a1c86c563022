"""Files of a run folder written so that a reader, or a run resumed after a crash, never sees
half of one.

>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "report.md"
>>> write_text_atomically(path, "# report")
>>> path.read_text()
'# report'
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["write_text_atomically"]


def write_text_atomically(path: pathlib.Path, text: str) -> None:
    """Writes ``path`` through a temporary file in its folder and a rename: a reader (or a
    resumed run) sees the old content or the new one, never a part."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
