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
    if not os.environ.get("XLA_PASSES", "").strip() and "xla_passes.frontends.flags" not in sys.modules:
        return
    from . import jax as jax_adapter  # noqa: PLC0415 - pay for the passes only when they are asked for
    from .configuration import STRICT_VARIABLE, ConfigurationError, strict_requested  # noqa: PLC0415

    try:
        jax_adapter.enable_configured()
    except ConfigurationError as exc:  # raised only when strict
        _stop(str(exc), STRICT_VARIABLE)
    except Exception as exc:
        if not strict_requested():
            raise  # JAX logs it and starts without the passes, as a non-strict run asks
        _stop(f"{type(exc).__name__}: {exc}", STRICT_VARIABLE)


def _stop(message: str, strict_variable: str) -> None:
    """End the program with one line on stderr and exit status 1.

    JAX catches whatever a plugin's `initialize()` raises (SystemExit included), logs it
    with a traceback and starts without the plugin, which a strict run must not do; so
    the process ends here, from whatever thread started JAX's backends.
    """
    first_line = next((line.strip() for line in message.splitlines() if line.strip()), message)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    sys.stderr.write(f"xla_passes: error: {first_line}; the program stops because {strict_variable} "
                     f"is set (fix the value, or unset {strict_variable} to run without the passes)\n")
    sys.stderr.flush()
    os._exit(1)
