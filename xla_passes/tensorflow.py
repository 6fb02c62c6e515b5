"""TensorFlow front end: run a TF step through an xla_passes pipeline on N devices.

    import xla_passes.tensorflow
    step = xla_passes.tensorflow.function(train_step, passes="weight-update-sharding")

This module is the public face of the TensorFlow front end: it re-exports the public names
of `xla_passes.frontends.tensorflow`, where the implementation lives. Importing it imports
neither TensorFlow nor JAX; `function` does.
"""
from .frontends.tensorflow import Function, UnsupportedFunctionError, configured_pipeline, function

__all__ = ["function", "Function", "UnsupportedFunctionError", "configured_pipeline"]
