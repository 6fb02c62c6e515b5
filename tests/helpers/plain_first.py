"""A plain run before the passes' run in one worker process (the workers' --plain-first).

Why: a worker process that trains a model plain and another that trains it with XLA_PASSES each pay for
their imports and for compiling the model's initializers; one process can do both. The passes stay chosen
by XLA_PASSES, which the JAX plugin applies when JAX starts its backends: the plain run turns them off and
then back on (`xla_passes.jax.disable` and `apply`), as a program that wants a compile without them would.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def without_the_passes(train: Callable[[], T]) -> T:
    """`train()` with the passes that XLA_PASSES switched on turned off, then back on.

    What the plain run compiled stays in JAX's caches, and a later run reuses the programs that it shares (the
    model's initializers), but not a training step that it traces anew: such a step is compiled with the passes,
    and the callers check in the log that the passes changed it.
    """
    import jax  # noqa: PLC0415 - after the worker chose its backends and flags

    import xla_passes.jax  # noqa: PLC0415

    jax.devices()  # starts the backends, and with them the plugin that applies XLA_PASSES
    settings = xla_passes.jax.enabled()
    xla_passes.jax.disable()
    try:
        return train()
    finally:
        xla_passes.jax.apply(settings)
