"""Which instructions compute element i of their result from element i of their operands alone.

Such an instruction computes a slice of its result from the same slice of its full-size operands
(scalars and scalar broadcasts aside): what lets a value be computed on shards.
"""
from __future__ import annotations

from hlo_tools import HloComputation, HloInstruction
from hlo_tools.ir.opcodes import ELEMENTWISE


def is_scalar_broadcast(instr: HloInstruction) -> bool:
    """A broadcast of a scalar: the same value at every position of any slice."""
    return instr.opcode == "broadcast" and instr.operand(0).shape.rank == 0


def elementwise_like(instr: HloInstruction, full_dims: tuple[int, ...]) -> bool:
    """An instruction whose element i depends only on element i of its full-size operands."""
    shape = instr.shape
    if not shape.is_array or shape.dims != full_dims or shape.is_dynamic:
        return False
    if instr.opcode in ELEMENTWISE:
        return not instr.control_predecessors and instr.opcode != "rng"
    if instr.opcode == "fusion" and instr.attrs.get("kind") == "kLoop":
        return elementwise_fused_computation(instr.attrs["calls"], full_dims)
    return False


def elementwise_fused_computation(fused: HloComputation, full_dims) -> bool:
    """A fused computation of elementwise instructions on full-size arrays and scalars."""
    for instr in fused.instructions:
        shape = instr.shape
        if not shape.is_array or shape.dims not in (full_dims, ()):
            return False
        if instr.opcode == "parameter" or instr.opcode in ELEMENTWISE:
            continue
        if instr.opcode == "constant" and shape.rank == 0:
            continue
        if is_scalar_broadcast(instr):
            continue
        return False
    return True
