"""Pausing Python's garbage collector while an IR is built or rewritten."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def garbage_collection_paused():
    """No garbage collection inside the block (unless it was already off).

    Building or rewriting an IR allocates tens of thousands of objects that stay alive, and each
    collection midway walks all of them (and everything else the process holds) for nothing.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
