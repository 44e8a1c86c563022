"""Files written whole or not at all: a reader, or a program resumed after a crash, sees the old
content or the new one, never a part, and what a writer killed midway left behind is removed by
the next writer of the same file.

Every write goes to a hidden sibling, ``.<name>.<tag>-<host>-<pid>-<random>``, then one rename
puts it in place. A process killed (SIGKILL, power cut) between the two leaves that sibling; the
next write of the same file removes the siblings of processes of this host that no longer run,
and leaves alone those of live processes and of other hosts (a shared file system).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import uuid
from collections.abc import Callable

__all__ = ["remove_dead_leftovers", "replace_atomically", "sibling", "write_text_atomically"]


def sibling(path: str | os.PathLike, tag: str = "tmp") -> pathlib.Path:
    """A fresh hidden name beside ``path`` for this process: ``.<name>.<tag>-<host>-<pid>-<hex>``
    (what :func:`remove_dead_leftovers` recognises).

    Example:
      >>> files = sibling("/runs/a/summary.json")
      >>> files.parent, files.name.startswith(".summary.json.tmp-")
      (PosixPath('/runs/a'), True)
    """
    path = pathlib.Path(path)
    host = socket.gethostname().replace("-", "_")
    return path.with_name(f".{path.name}.{tag}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_dead_leftovers(path: str | os.PathLike, tag: str = "tmp") -> list[pathlib.Path]:
    """Removes the :func:`sibling` files or folders of ``path`` with this ``tag`` that processes
    of this host left and that no longer run (a write killed midway); returns what it removed.
    Those of live processes (a concurrent writer) and of other hosts are left alone.

    Example (this process still runs, so its own sibling stays):
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
      >>> _ = sibling(path).write_text("being written")
      >>> remove_dead_leftovers(path)
      []
    """
    path = pathlib.Path(path)
    host = socket.gethostname().replace("-", "_")
    removed = []
    for leftover in path.parent.glob(f".{path.name}.{tag}-*"):
        parts = leftover.name.removeprefix(f".{path.name}.{tag}-").split("-")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # the writer still runs
        except ProcessLookupError:
            pass
        except OSError:  # the process exists, owned by another user
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
        removed.append(leftover)
    return removed


def replace_atomically(
    path: str | os.PathLike, write: Callable[[pathlib.Path], object]
) -> pathlib.Path:
    """``write(tmp)`` writes the new content to the temporary file ``tmp`` beside ``path``, then
    one rename puts it in place; returns ``path``. If ``write`` or the rename fails, ``path`` is
    as it was and the temporary file is gone. Leftovers of killed writers are removed first.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "weights.bin"
      >>> replace_atomically(path, lambda tmp: tmp.write_bytes(b"01")).read_bytes()
      b'01'
      >>> [p.name for p in path.parent.iterdir()]  # no temporary file beside it
      ['weights.bin']
    """
    path = pathlib.Path(path)
    remove_dead_leftovers(path)
    tmp = sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Writes ``text`` to ``path`` through :func:`replace_atomically`; returns ``path``.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "report.md"
      >>> write_text_atomically(path, "# report").read_text()
      '# report'
    """
    return replace_atomically(path, lambda tmp: tmp.write_text(text))
