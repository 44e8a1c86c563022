"""What the project's TFDS datasets share: where they are cached, writing one once, quiet TFDS.

:mod:`sparse_jax.data.text` and :mod:`sparse_jax.data.linalg_cot` each write their data once as
a TFDS ``array_record`` dataset through a builder of their own; both cache it under
:func:`default_data_dir`, write it with :func:`prepare_once` (safe when two processes prepare
the same dataset together) and keep TFDS's progress bars and log lines out of the way with
:func:`quiet_tfds`. Importing this module does not import ``tensorflow_datasets``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from absl import logging as absl_logging

__all__ = ["default_data_dir", "prepare_once", "quiet_tfds"]


def default_data_dir() -> Path:
    """``$SPARSE_JAX_DATA_DIR`` if set, else ``~/.cache/sparse_jax/tfds``.

    Example:
      >>> from unittest import mock
      >>> with mock.patch.dict(os.environ, {"SPARSE_JAX_DATA_DIR": "/data/tfds"}):
      ...     print(default_data_dir())
      /data/tfds
      >>> unset = {k: v for k, v in os.environ.items() if k != "SPARSE_JAX_DATA_DIR"}
      >>> with mock.patch.dict(os.environ, unset, clear=True):
      ...     default_data_dir() == Path.home() / ".cache" / "sparse_jax" / "tfds"
      True
    """
    env = os.environ.get("SPARSE_JAX_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparse_jax" / "tfds"


def prepare_once(builder: Any) -> None:
    """``builder.download_and_prepare()`` (local files only), tolerating a process that prepared
    the same dataset meanwhile: two runs started together on one cache both build it, and TFDS's
    final rename then fails in the later one with ``FileExistsError`` although the folder it
    wanted is there, complete. Any other failure, or that error without a prepared dataset,
    propagates.

    Example (a builder whose dataset another process finished first):

    >>> class PreparedMeanwhile:
    ...     def download_and_prepare(self, download_config):
    ...         raise FileExistsError("the other process renamed its folder first")
    ...
    ...     def is_prepared(self):
    ...         return True
    >>> prepare_once(PreparedMeanwhile())  # no error: the dataset is there
    """
    import tensorflow_datasets as tfds

    try:
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False)
        )
    except FileExistsError:
        if not builder.is_prepared():
            raise


@contextlib.contextmanager
def quiet_tfds(verbose: bool) -> Iterator[None]:
    """TFDS's progress bars on (``verbose``) or off, and off its log lines below errors (e.g.
    its warning about a config the builder class does not list) while the block runs.

    Through TFDS's public switch, which has no getter: the bars stay as set after the block
    (``tfds.enable_progress_bar()`` turns them on again). The two lines TFDS prints on stdout
    when it writes a dataset (preparing..., prepared...) are printed in either case.

    Example:

    >>> before = absl_logging.get_verbosity()
    >>> with quiet_tfds(False):
    ...     absl_logging.get_verbosity() == absl_logging.ERROR
    True
    >>> absl_logging.get_verbosity() == before
    True
    """
    import tensorflow_datasets as tfds

    if verbose:
        tfds.enable_progress_bar()
        yield
        return
    tfds.disable_progress_bar()
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)
