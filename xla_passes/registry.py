"""Passes by name: the built-in ones (`xla_passes.passes`, imported on first use) and every
other class given to `register_pass`.

The passes import `xla_passes.core` to register themselves; this module sits above both, so
neither `core` nor a pass imports the list of passes.
"""
from __future__ import annotations

from .core import HloPass, PassError, passes_registered_so_far


def registered_passes() -> dict[str, type[HloPass]]:
    """Every registered pass by name (the built-in passes load on first use)."""
    from . import passes  # noqa: F401, PLC0415 - registers the built-in passes, once they are asked for
    return dict(sorted(passes_registered_so_far().items()))


def pass_class(name: str) -> type[HloPass]:
    """The pass registered as `name`; PassError listing the valid names otherwise."""
    passes = registered_passes()
    if name not in passes:
        raise PassError(f"unknown pass {name!r} (valid passes: {', '.join(passes)})")
    return passes[name]
