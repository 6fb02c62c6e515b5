"""xla_passes: XLA's distributed-training passes in Python, on the `hlo_tools` IR.

    import hlo_tools, xla_passes
    module = hlo_tools.parse_module(text)
    xla_passes.run_passes(module, "all-reduce-combiner{threshold_bytes=1048576},dce")

`xla-opt` runs pipelines from the command line; `XLA_PASSES=...` switches them
on inside JAX without code changes (docs/passes.md, docs/enabling.md).

The layers (docs/passes.md#layout): this package's pass manager (`core`,
`pipeline`, `registry`); `analysis`, `rewrites`, `spatial`; `passes`; the front
ends (`frontends`, public as `xla_passes.jax`, `xla_passes.flags`,
`xla_passes.tensorflow`) and the tools (`tools`: `xla-opt`, translation
validation, FileCheck tests). The model zoo and the demo are the sibling package
`xla_passes_demo`, which this one never imports.
"""
from .core import HloPass, PassContext, PassError, PassPipeline, PassResult, register_pass
from .pipeline import FixedPoint, Pipeline, parse_pipeline, run_passes
from .registry import pass_class, registered_passes

__all__ = [
    "HloPass", "PassContext", "PassResult", "PassPipeline", "PassError", "register_pass", "registered_passes",
    "pass_class",
    "Pipeline", "FixedPoint", "parse_pipeline", "run_passes",
]
