"""Calls and fusions replaced by the instructions of the computations they call, and the reverse
for XLA's CPU runtime: instructions put in fusions of their own."""
from __future__ import annotations

from hlo_tools import HloComputation, HloInstruction, HloModule


def inline_calls(module: HloModule) -> bool:
    """Replace every `call` of `module` that means no more than a call by its callee's body
    (Shardy's manual-computation bodies, composites and calls with control dependencies stay);
    remove callees no caller is left for. Returns whether anything was inlined."""
    changed = False
    # Callers after callees, so a body is already flat when it is inlined into its caller.
    for comp in module.computations_post_order():
        for instr in list(comp.instructions):
            if instr.opcode == "call" and inlinable_call(instr):
                inline(instr, instr.attrs["to_apply"])
                changed = True
    if changed:
        callers = module.callers()
        for comp in list(module.computations):
            if comp is not module.entry and not callers.get(comp):
                module.remove_computation(comp)
    return changed


def is_shardy_body_call(call: HloInstruction) -> bool:
    """A call of a shard_map's body, as Shardy exports it."""
    frontend = call.attrs.get("frontend_attributes")
    return call.attrs["to_apply"].name.startswith("xla.sdy.") or (
        frontend is not None and any(key.startswith("xla.sdy") for key, _ in frontend.items))


def inlinable_call(call: HloInstruction) -> bool:
    """Whether `call` means no more than a call: not a Shardy body or a composite, no control
    dependencies, a callee on the caller's execution thread."""
    if is_shardy_body_call(call):
        return False
    frontend = call.attrs.get("frontend_attributes")
    if frontend is not None and any(key.startswith("composite") for key, _ in frontend.items):
        return False
    callee = call.attrs["to_apply"]
    has_control = bool(call.control_predecessors) or any(
        call in other.control_predecessors for other in call.parent.instructions)
    return not has_control and callee.execution_thread in (None, call.parent.execution_thread)


def inline_fusions(comp: HloComputation, origins: dict | None = None) -> bool:
    """Replace every fusion in `comp` by the instructions of its fused computation.

    XLA's fusions hide the dataflow a pass may need to see whole (distributed-batch-norm
    pairs a statistic with its gradient across them). Fusions recompute shared producers, so
    `cse` after this merges the copies. Fused computations no caller is left for are removed.
    `origins`, if given, gets (fusion name, fused instruction name) for each inlined instruction.
    """
    fusions = [instr for instr in comp.instructions if instr.opcode == "fusion"]
    for fusion in fusions:
        inline(fusion, fusion.attrs["calls"], origins)
    if fusions:
        comp.parent.remove_dead_computations()
    return bool(fusions)


# What XLA's CPU runtime runs outside a fusion; after its fusion pass everything else is in one.
_RUN_UNFUSED = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "convolution", "dot", "fusion",
    "call", "custom-call", "while", "conditional", "after-all", "partition-id", "replica-id", "all-reduce",
    "all-gather", "reduce-scatter", "all-to-all", "collective-permute"})


def wrap_in_fusions(comp: HloComputation) -> None:
    """Put each instruction of `comp` that XLA's CPU runtime runs only inside a fusion in a kLoop
    fusion of its own (XLA's `wrapped_*` fusions), for a module handed back after XLA's fusion."""
    module = comp.parent
    for instr in list(comp.instructions):
        if instr.opcode in _RUN_UNFUSED:
            continue
        fused = HloComputation(module.unique_name(f"wrapped_{instr.opcode}_computation"))
        parameters = [fused.add_parameter(o.shape, name=f"param_{i}") for i, o in enumerate(instr.operands)]
        attrs = {key: value for key, value in instr.attrs.items() if key not in ("metadata", "sharding")}
        fused.set_root(fused.add_instruction(instr.opcode, parameters, instr.shape, attrs=attrs, literal=instr.literal))
        module.add_computation(fused, before=comp)
        attrs = {"kind": "kLoop", "calls": fused}
        if "metadata" in instr.attrs:
            attrs["metadata"] = instr.attrs["metadata"]
        fusion = comp.add_instruction("fusion", instr.operands, instr.shape, before=instr, attrs=attrs)
        instr.replace_all_uses_with(fusion)
        comp.remove_instruction(instr)
        fusion.rename(instr.name)


def inline(call: HloInstruction, callee: HloComputation, origins: dict | None = None) -> None:
    """Replace `call` (a call or a fusion) by the instructions of `callee`, which it calls;
    `origins`, if given, gets (call's name, callee instruction's name) for each new instruction."""
    comp: HloComputation = call.parent
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
        if origins is not None:
            origins[mapping[instr]] = (call.name, instr.name)
    call.replace_all_uses_with(mapping[callee.root])
    comp.remove_instruction(call)
