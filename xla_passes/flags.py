"""absl flags: `--xla_passes`, `--xla_passes_stage`, `--xla_passes_dump_to`, `--xla_passes_strict`,
`--xla_passes_check`; importing this module defines them::

    from absl import app
    import xla_passes.flags  # noqa: F401 - defines --xla_passes and friends

This module is the public face of the flags: it re-exports the public names of
`xla_passes.frontends.flags`, where the implementation lives (importing that module
defines the flags and registers their check, which applies them to JAX).
"""
from .frontends.flags import (XLA_PASSES, XLA_PASSES_CHECK, XLA_PASSES_DUMP_TO, XLA_PASSES_STAGE,
                              XLA_PASSES_STRICT, given_values)

__all__ = ["XLA_PASSES", "XLA_PASSES_STAGE", "XLA_PASSES_DUMP_TO", "XLA_PASSES_STRICT", "XLA_PASSES_CHECK",
           "given_values"]
