"""sparse_jax.files: a file is replaced whole or not at all, and what a writer killed midway left
beside it is removed by the next write, unless its process still runs or ran on another host."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from sparse_jax import files
from tests import dead_sibling, script_env


def _killed_midway(path: pathlib.Path) -> pathlib.Path:
    """A child process starts ``write_text_atomically(path, ...)`` and is killed by SIGKILL
    after writing half of its temporary file, before the rename: returns what it left."""
    code = (
        "import os, signal, sys\n"
        "from sparse_jax import files\n"
        "def half(tmp):\n"
        "    tmp.write_text('half')\n"
        "    print(tmp, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"files.replace_atomically({str(path)!r}, half)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=script_env()
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftover = pathlib.Path(proc.stdout.strip())
    assert leftover.read_text() == "half" and leftover.parent == path.parent
    return leftover


def test_a_killed_writers_leftover_is_removed_by_the_next_write(tmp_path):
    path = tmp_path / "summary.json"
    files.write_text_atomically(path, "old")
    leftover = _killed_midway(path)
    assert path.read_text() == "old"  # the kill came before the rename
    assert sorted(os.listdir(tmp_path)) == sorted(["summary.json", leftover.name])
    assert files.write_text_atomically(path, "new") == path
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["summary.json"]


def test_leftovers_of_live_writers_other_hosts_and_other_files_are_kept(tmp_path):
    path = tmp_path / "summary.json"
    live = files.sibling(path)  # this process still runs
    live.write_text("being written")
    dead_pid = dead_sibling(path, "tmp").name.split("-")[2]
    other_host = tmp_path / f".summary.json.tmp-elsewhere-{dead_pid}-0123abcd"
    other_host.write_text("another host's write")
    other_file = _killed_midway(tmp_path / "report.md")
    other_tag = dead_sibling(path, "partial")
    other_tag.mkdir()
    (other_tag / "model.safetensors").write_text("half")
    files.write_text_atomically(path, "new")
    kept = ["summary.json", live.name, other_host.name, other_file.name, other_tag.name]
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert files.remove_dead_leftovers(tmp_path / "report.md") == [other_file]
    assert files.remove_dead_leftovers(path, "partial") == [other_tag]
    assert sorted(os.listdir(tmp_path)) == sorted(kept[:3])


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    files.write_text_atomically(path, "old")

    def fails(tmp):
        tmp.write_text("partly")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.replace_atomically(path, fails)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]


def test_sibling_names_this_host_and_process():
    tmp = files.sibling("/some/folder/model", "partial")
    prefix, host, pid, tail = tmp.name.split("-")
    assert prefix == ".model.partial" and tmp.parent == pathlib.Path("/some/folder")
    assert host == socket.gethostname().replace("-", "_") and pid == str(os.getpid())
    assert len(tail) == 8 and tmp != files.sibling("/some/folder/model", "partial")
