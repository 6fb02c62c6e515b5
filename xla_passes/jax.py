"""Run xla_passes pipelines inside JAX's own XLA compiles, with no change to the program.

    import xla_passes.jax
    xla_passes.jax.enable("collective-fusion")      # every later jax.jit compile
    step = xla_passes.jax.jit(train_step, passes="weight-update-sharding{persistent=true}")

This module is the public face of the JAX front end: it re-exports the public names of
`xla_passes.frontends.jax`, where the implementation (the pass hook, `jit`, their state)
lives and what code that reaches internals or patches them imports (docs/enabling.md).
"""
from .frontends.jax import (HOOK_NAME, PassJitted, PassLowered, apply, check_hook_passes, disable, enable,
                            enable_configured, enabled, jit, next_module_number, rewrite_module)

__all__ = ["enable", "disable", "enabled", "enable_configured", "apply", "check_hook_passes", "jit",
           "PassJitted", "PassLowered", "rewrite_module", "next_module_number", "HOOK_NAME"]
