"""The JAX plugin: JAX imports this module and calls `initialize()` when it starts its backends.

`pyproject.toml` advertises it under the `jax_plugins` entry-point group. JAX
only imports a plugin module and calls its `initialize()`; it loads no PJRT
backend from it unless `initialize()` registers one, which this one never does.
Without `XLA_PASSES` in the environment (and no `xla_passes.flags` imported) it
returns at once and registers nothing.
"""
import os
import sys


def initialize() -> None:
    """Switch on the passes that `XLA_PASSES` or `--xla_passes` name (`xla_passes.jax.enable_configured`)."""
    if not os.environ.get("XLA_PASSES", "").strip() and "xla_passes.flags" not in sys.modules:
        return
    from . import jax as jax_adapter  # noqa: PLC0415 - pay for the passes only when they are asked for

    jax_adapter.enable_configured()
