"""The IR: HLO text parsed into modules, computations and instructions, printed back, verified."""
from hlo_tools.ir.hlo import HloComputation, HloInstruction, HloModule  # noqa: F401
