"""Files written whole or not at all: a temporary file in the target's directory, renamed over it.

Shared by the CLI's text outputs (``cli.write_atomically``) and the runner's ``.npz``
archives (``runner.save_arrays``); standard library only, so the command line can use it
without loading the runner (numpy, XLA).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO


def new_file_mode(path: str) -> int:
    """Permissions for a file written over ``path``: those it has, else the umask's default."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_through_temp_file(path: str, write: Callable[[IO], object], *, binary: bool,
                            suffix: str = ".tmp") -> None:
    """Call ``write`` on a temporary file in ``path``'s directory (binary, or UTF-8 text with no
    newline translation), give it ``path``'s permissions (``new_file_mode``) and rename it over
    ``path``, so that a reader never sees half a file; on any failure, an interrupt included,
    the temporary file is removed and ``path`` is left as it was.

    ``path`` must be a regular file or not exist: a rename would replace a device or FIFO.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".hlo-tools-", suffix=suffix)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as f:
            write(f)
        os.chmod(tmp_path, new_file_mode(path))
        os.replace(tmp_path, path)
    except BaseException:
        os.unlink(tmp_path)
        raise
