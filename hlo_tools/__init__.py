"""hlo_tools: a faithful Python IR for XLA HLO text.

    import hlo_tools
    module = hlo_tools.parse_module(text)      # HloParseError(.line, .column) on bad text
    hlo_tools.verify(module)                   # HloVerifyError on what XLA's verifier refuses
    for instr in module.entry.instructions: ...
    text == module.to_text()                   # unmodified modules print back byte for byte
"""
from hlo_tools.ir.attributes import (ConvDimensionNumbers, FrontendAttributes, Metadata, PaddingConfig, Raw,
                                     ReplicaGroups, Sharding, SliceSpec, Window, WindowDimension)
from hlo_tools.ir.errors import HloError, HloParseError, HloVerifyError
from hlo_tools.ir.hlo import HloComputation, HloInstruction, HloModule
from hlo_tools.ir.literal import Literal
from hlo_tools.ir.parser import parse_module, parse_shape
from hlo_tools.ir.shape import Layout, Shape

__all__ = [
    "parse_module", "parse_shape", "verify", "HloModule", "HloComputation", "HloInstruction", "Shape", "Layout",
    "Literal", "HloError", "HloParseError", "HloVerifyError", "ConvDimensionNumbers", "FrontendAttributes",
    "Metadata", "PaddingConfig", "Raw", "ReplicaGroups", "Sharding", "SliceSpec", "Window", "WindowDimension",
]


def verify(module: HloModule) -> None:
    """Check `module` as XLA's HloVerifier would; raise HloVerifyError on the first problem."""
    from hlo_tools.ir.verifier import verify_module
    verify_module(module)


# Where the flat modules of earlier versions live now, so that `from hlo_tools import runner`
# (and every other old `from hlo_tools import MODULE`) keeps working.
_MOVED_MODULES = {
    "attributes": "hlo_tools.ir.attributes",
    "cost_command": "hlo_tools.cli.cost_command",
    "cost_model": "hlo_tools.inspection.cost_model",
    "diff": "hlo_tools.inspection.diff",
    "diff_command": "hlo_tools.cli.diff_command",
    "dump": "hlo_tools.xla.dump",
    "dump_command": "hlo_tools.cli.dump_command",
    "errors": "hlo_tools.ir.errors",
    "graph": "hlo_tools.inspection.graph",
    "graph_command": "hlo_tools.cli.graph_command",
    "inspect_commands": "hlo_tools.cli.inspect_commands",
    "literal": "hlo_tools.ir.literal",
    "opcodes": "hlo_tools.ir.opcodes",
    "parser": "hlo_tools.ir.parser",
    "plot": "hlo_tools.inspection.plot",
    "printer": "hlo_tools.ir.printer",
    "proto_patch": "hlo_tools.xla.proto_patch",
    "report": "hlo_tools.inspection.report",
    "report_command": "hlo_tools.cli.report_command",
    "run_command": "hlo_tools.cli.run_command",
    "runner": "hlo_tools.xla.runner",
    "shape": "hlo_tools.ir.shape",
    "shape_inference": "hlo_tools.ir.shape_inference",
    "stats": "hlo_tools.inspection.stats",
    "stats_command": "hlo_tools.cli.stats_command",
    "topology": "hlo_tools.inspection.topology",
    "verifier": "hlo_tools.ir.verifier",
    "xla_bridge": "hlo_tools.xla.xla_bridge",
}


def __getattr__(name: str):
    if name in _MOVED_MODULES:
        import importlib
        return importlib.import_module(_MOVED_MODULES[name])
    raise AttributeError(f"module 'hlo_tools' has no attribute {name!r}")
