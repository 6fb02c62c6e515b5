"""TensorFlow side: the pipeline that `XLA_PASSES` / `--xla_passes` ask for.

The TensorFlow entry point that runs it inside TF's XLA compiles comes later;
it reads the same settings as the JAX plugin (see `xla_passes.configuration`).
Importing this module does not import TensorFlow.
"""
from __future__ import annotations

from .configuration import configured_settings
from .pipeline import Pipeline


def configured_pipeline(module_number: int = 0) -> Pipeline | None:
    """A fresh `Pipeline` for one module, as the settings ask for; None when no passes are asked for.

    Fresh, because a `Pipeline` records what happened in its run; the dump
    directory comes from the settings and `module_number` names the dump files.

    Raises:
      ConfigurationError: a variable or flag has a bad value (the message names it).
    """
    settings = configured_settings()
    if settings is None:
        return None
    return Pipeline(settings.passes, dump_to=settings.dump_to, module_number=module_number)
