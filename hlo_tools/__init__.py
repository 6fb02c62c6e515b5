"""hlo_tools: a faithful Python IR for XLA HLO text.

    import hlo_tools
    module = hlo_tools.parse_module(text)      # HloParseError(.line, .column) on bad text
    hlo_tools.verify(module)                   # HloVerifyError on what XLA's verifier refuses
    for instr in module.entry.instructions: ...
    text == module.to_text()                   # unmodified modules print back byte for byte
"""
from .attributes import (ConvDimensionNumbers, FrontendAttributes, Metadata, PaddingConfig, Raw, ReplicaGroups,
                         Sharding, SliceSpec, Window, WindowDimension)
from .errors import HloError, HloParseError, HloVerifyError
from .ir import HloComputation, HloInstruction, HloModule
from .literal import Literal
from .parser import parse_module, parse_shape
from .shape import Layout, Shape

__all__ = [
    "parse_module", "parse_shape", "verify", "HloModule", "HloComputation", "HloInstruction", "Shape", "Layout",
    "Literal", "HloError", "HloParseError", "HloVerifyError", "ConvDimensionNumbers", "FrontendAttributes",
    "Metadata", "PaddingConfig", "Raw", "ReplicaGroups", "Sharding", "SliceSpec", "Window", "WindowDimension",
]


def verify(module: HloModule) -> None:
    """Check `module` as XLA's HloVerifier would; raise HloVerifyError on the first problem."""
    from .verifier import verify_module
    verify_module(module)
