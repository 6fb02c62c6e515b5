"""`tuple-simplifier`: remove tuple/get-tuple-element round trips.

Two rewrites, as XLA's TupleSimplifier does::

    t = (f32[8], s32[]) tuple(a, b)
    x = f32[8] get-tuple-element(t), index=0        =>   uses of x use a

    g0 = f32[8] get-tuple-element(p), index=0
    g1 = s32[] get-tuple-element(p), index=1
    t = (f32[8], s32[]) tuple(g0, g1)                =>   uses of t use p

A tuple that carries `sharding=` (a partitioned module's ROOT says how outputs
map to devices) is kept.
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..core import HloPass, register_pass


@register_pass
class TupleSimplifier(HloPass):
    """Forward get-tuple-element of a tuple; replace a tuple of all elements of x by x."""

    name = "tuple-simplifier"
    opcodes = {"get-tuple-element"}

    def run(self, module: HloModule) -> bool:
        changed = False
        for comp in module.computations:
            for instr in comp.post_order():
                replacement = _simpler(instr)
                if replacement is not None:
                    instr.replace_all_uses_with(replacement)
                    if not instr.users and not instr.is_root:
                        comp.remove_instruction(instr)
                    changed = True
        return changed


def _simpler(instr):
    """The instruction that can stand in for `instr`, or None."""
    if instr.opcode == "get-tuple-element":
        source = instr.operand(0)
        if source.opcode == "tuple" and "sharding" not in source.attrs:
            element = source.operand(int(instr.attrs["index"]))
            return element if element.shape == instr.shape else None
        return None
    if instr.opcode != "tuple" or "sharding" in instr.attrs or not instr.operands:
        return None
    first = instr.operand(0)
    if first.opcode != "get-tuple-element":
        return None
    whole = first.operand(0)
    if whole.shape != instr.shape or len(whole.shape.tuple_shapes) != instr.operand_count:
        return None
    for index, element in enumerate(instr.operands):
        if (element.opcode != "get-tuple-element" or element.operand(0) is not whole
                or int(element.attrs["index"]) != index):
            return None
    return whole
