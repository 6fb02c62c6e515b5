"""`call-inliner`: replace `call` instructions by the body of the computation they call.

    f {                                       ENTRY e {
      x = f32[8] parameter(0)                   p = f32[8] parameter(0)
      ROOT n = f32[8] negate(x)         =>      ROOT n = f32[8] negate(p)
    }                                         }
    ENTRY e {
      p = f32[8] parameter(0)
      ROOT c = f32[8] call(p), to_apply=f
    }

Calls that mean more than a call are kept: Shardy's manual-computation bodies
(`xla.sdy.*` computations and frontend attributes), composites, and calls with
control dependencies. A callee that no caller is left for is removed.
"""
from __future__ import annotations

from hlo_tools import HloComputation, HloInstruction, HloModule

from ..core import HloPass, register_pass


@register_pass
class CallInliner(HloPass):
    """Inline `call` instructions (not Shardy bodies or composites) into their callers."""

    name = "call-inliner"
    opcodes = {"call"}

    def run(self, module: HloModule) -> bool:
        changed = False
        # Callers after callees, so a body is already flat when it is inlined into its caller.
        for comp in module.computations_post_order():
            for instr in list(comp.instructions):
                if instr.opcode == "call" and _inlinable(instr):
                    _inline(instr)
                    changed = True
        if changed:
            callers = module.callers()
            for comp in list(module.computations):
                if comp is not module.entry and not callers.get(comp):
                    module.remove_computation(comp)
        return changed


def _inlinable(call: HloInstruction) -> bool:
    callee = call.attrs["to_apply"]
    if callee.name.startswith("xla.sdy."):
        return False
    frontend = call.attrs.get("frontend_attributes")
    if frontend is not None and any(key.startswith(("xla.sdy", "composite")) for key, _ in frontend.items):
        return False
    has_control = bool(call.control_predecessors) or any(
        call in other.control_predecessors for other in call.parent.instructions)
    return not has_control and callee.execution_thread in (None, call.parent.execution_thread)


def _inline(call: HloInstruction) -> None:
    comp: HloComputation = call.parent
    callee: HloComputation = call.attrs["to_apply"]
    mapping = {callee.parameter(i): operand for i, operand in enumerate(call.operands)}
    for instr in callee.post_order():
        if instr in mapping:
            continue
        attrs = dict(instr.attrs)
        if "control-predecessors" in attrs:
            attrs["control-predecessors"] = tuple(mapping[p] for p in attrs["control-predecessors"])
        mapping[instr] = comp.add_instruction(
            instr.opcode, [mapping[o] for o in instr.operands], instr.shape, name=instr.name,
            attrs=attrs, before=call, literal=instr.literal)
    call.replace_all_uses_with(mapping[callee.root])
    comp.remove_instruction(call)
