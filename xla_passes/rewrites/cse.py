"""Common-subexpression elimination of one computation.

Two instructions are merged when they compute the same thing: same opcode, shape, operands
(after merging theirs), literal, called computations and attributes other than `metadata`.
Instructions with side effects, parameters, instructions with control dependencies and copies
are left alone (XLA inserts copies on purpose to keep buffers apart; merging them makes its CPU
runtime abort on duplicate buffers).
"""
from __future__ import annotations

from hlo_tools import HloComputation
from hlo_tools.ir.opcodes import has_side_effect
from hlo_tools.ir.printer import format_value

_NEVER_MERGED = frozenset({"parameter", "copy", "copy-start", "copy-done"})

# Attributes that describe where an instruction came from, not what it computes.
_IGNORED_ATTRS = frozenset({"metadata"})


def eliminate_common_subexpressions(comp: HloComputation, merged: dict | None = None) -> bool:
    """Merge the instructions of `comp` that compute the same value; whether any were. `merged`,
    if given, gets each removed instruction's replacement."""
    controlled = {p for instr in comp.instructions for p in instr.control_predecessors}
    seen = {}
    duplicates = []
    for instr in comp.post_order():
        if (instr.opcode in _NEVER_MERGED or has_side_effect(instr) or instr.control_predecessors
                or instr in controlled):
            continue
        key = _identity(instr)
        first = seen.setdefault(key, instr)
        if first is not instr:
            instr.replace_all_uses_with(first)
            duplicates.append(instr)
            if merged is not None:
                merged[instr] = first
    for instr in duplicates:
        comp.remove_instruction(instr)
    return bool(duplicates)


def _identity(instr) -> tuple:
    """What makes two instructions interchangeable (operands by identity, so post order matters)."""
    attrs = tuple(sorted((key, format_value(key, value)) for key, value in instr.attrs.items()
                         if key not in _IGNORED_ATTRS))
    literal = str(instr.literal) if instr.literal is not None else None
    return (instr.opcode, str(instr.shape), tuple(id(o) for o in instr.operands), literal, attrs)
