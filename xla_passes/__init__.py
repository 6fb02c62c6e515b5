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
import importlib

# Where each public name lives. They are imported on first use (PEP 562): JAX imports this package
# in every process, to reach the plugin (xla_passes.frontends.jax_plugin), and a process without
# XLA_PASSES should not pay for the pass manager and the IR.
_EXPORTS = {
    "HloPass": "core", "PassContext": "core", "PassResult": "core", "PassPipeline": "core", "PassError": "core",
    "register_pass": "core", "registered_passes": "registry", "pass_class": "registry",
    "Pipeline": "pipeline", "FixedPoint": "pipeline", "parse_pipeline": "pipeline", "run_passes": "pipeline",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
