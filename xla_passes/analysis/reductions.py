"""Reductions whose partial results combine: what reduces a value in full, block by block,
or along some of its dimensions, with a reducer from its identity.

A sum (product, maximum, ...) of the elements of a value may be computed as the same reduction
of partial results, in any order: what a sharded computation relies on when each device reduces
its slice and an all-reduce combines the slices' results. These questions recognise such
reductions as XLA emits them: plain reduces, XLA:CPU's reduce-windows of partial sums
(`block_reduction_opcode`), and fusions that compute norms or row and column statistics.
"""
from __future__ import annotations

import math

import numpy as np

from hlo_tools import HloComputation, HloInstruction
from hlo_tools.ir.opcodes import ELEMENTWISE

from .collectives import reducer_opcode
from .constants import constant_array
from .elementwise import is_scalar_broadcast

# Reducers whose partial results combine with an all-reduce, with their identity element.
REDUCER_IDENTITY = {"add": 0.0, "multiply": 1.0, "maximum": -math.inf, "minimum": math.inf,
                    "and": True, "or": False}


def reduces_from_identity(reduce: HloInstruction) -> bool:
    """A reduce whose reducer's partial results combine, from the reducer's identity."""
    opcode = reducer_opcode(reduce.attrs["to_apply"])
    return opcode in REDUCER_IDENTITY and is_identity(reduce.operand(1), opcode)


def full_reduction_of(user: HloInstruction, member: HloInstruction, fusion: HloInstruction | None = None) -> bool:
    """A reduce of all dimensions of `member` with a reducer whose partial results combine, from
    its identity (inside the fused computation of `fusion`, the identity may come in as a
    parameter that `fusion` binds to a constant)."""
    if user.opcode != "reduce" or user.operand_count != 2 or user.operand(0) is not member:
        return False
    if tuple(sorted(user.attrs.get("dimensions", ()))) != tuple(range(member.shape.rank)):
        return False
    opcode = reducer_opcode(user.attrs["to_apply"])
    if opcode not in REDUCER_IDENTITY:
        return False
    init = user.operand(1)
    if fusion is not None and init.opcode == "parameter" and init.parent is fusion.attrs["calls"]:
        init = fusion.operand(init.parameter_number)
    return is_identity(init, opcode)


def is_identity(instr: HloInstruction, opcode: str) -> bool:
    """Whether `instr` is a constant that holds the identity of the reducer `opcode` everywhere."""
    value = constant_array(instr)
    return value is not None and bool(np.asarray(value == REDUCER_IDENTITY[opcode]).all())


def block_reduction_opcode(instr: HloInstruction, fused: HloComputation | None = None,
                           fusion: HloInstruction | None = None) -> str | None:
    """For a reduce-window whose windows partition its operand with a reducer whose partial
    results combine, from its identity: the reducer's opcode, else None. A full reduction of its
    result with the same reducer is then a full reduction of its operand (in another order).

    The windows partition the operand when, in every dimension, the stride equals the window
    size, nothing is dilated or reversed, and the padded dimension is a whole number of windows;
    padding may not be negative (that drops elements). Padding takes the initial value (XLA's
    CPU backend pads `f32[40,9]` to 64 rows for windows of 32), which is the identity here: a
    padded position adds nothing. In a fused computation (`fused`) the initial value may be a
    parameter of it: a constant operand of `fusion` when given, else accepted
    (`reduced_fully` checks it)."""
    if instr.opcode != "reduce-window" or instr.operand_count != 2 or not instr.shape.is_array:
        return None
    operand, window = instr.operand(0), instr.attrs.get("window")
    dims = window.dimensions if window is not None else ()
    if not operand.shape.is_array or len(dims) != operand.shape.rank or operand.shape.is_dynamic:
        return None
    windows = []
    for d, size in zip(dims, operand.shape.dims):
        padded = d.padding_low + size + d.padding_high
        if (d.size < 1 or d.size != d.stride or d.padding_low < 0 or d.padding_high < 0 or padded % d.size
                or d.window_dilation != 1 or d.base_dilation != 1 or d.window_reversal):
            return None
        windows.append(padded // d.size)
    if instr.shape.dims != tuple(windows):
        return None
    opcode = reducer_opcode(instr.attrs["to_apply"])
    if opcode not in REDUCER_IDENTITY:
        return None
    init = instr.operand(1)
    if fused is not None and init.opcode == "parameter" and init.parent is fused:
        if fusion is None:
            return opcode
        init = fusion.operand(init.parameter_number)
    return opcode if is_identity(init, opcode) else None


def reduced_fully(value: HloInstruction, opcode: str) -> bool:
    """Whether every use of `value` reduces all of it with the reducer `opcode` from its identity:
    a reduce, or a scalar norm fusion whose parameters bound to `value` are only so reduced; and
    whether the initial value of a block reduce-window at the root of the fusion `value` is one."""
    if value.opcode == "fusion":
        fused = value.attrs["calls"]
        if block_reduction_opcode(fused.root, fused, value) != opcode:
            return False
    if not value.users or value.is_root:
        return False
    for user in value.users:
        if user.opcode == "reduce":
            if not (full_reduction_of(user, value) and reducer_opcode(user.attrs["to_apply"]) == opcode):
                return False
        elif user.opcode == "fusion" and user.shape.rank == 0 and is_norm_fusion(user):
            fused = user.attrs["calls"]
            for number, operand in enumerate(user.operands):
                if operand is not value:
                    continue
                parameter = fused.parameter(number)
                if not parameter.users or parameter.is_root or not all(
                        full_reduction_of(u, parameter, user) and reducer_opcode(u.attrs["to_apply"]) == opcode
                        for u in parameter.users):
                    return False
        else:
            return False
    return True


def partials_reduced(value: HloInstruction, window, opcode: str) -> bool:
    """Whether every use of `value`, the partial results of a block reduce-window with `window`
    and the reducer `opcode`, reduces them further (`reduces_blocks`): a reduce, or a fusion
    that inlining would take apart (`is_statistics_fusion`, `is_norm_fusion`) whose parameters
    bound to `value` are only so reduced."""
    if not value.users or value.is_root:
        return False
    for user in value.users:
        if user.opcode == "fusion" and (is_statistics_fusion(user) or is_norm_fusion(user)):
            fused = user.attrs["calls"]
            for number, operand in enumerate(user.operands):
                parameter = fused.parameter(number)
                if operand is value and (not parameter.users or parameter.is_root or not all(
                        reduces_blocks(u, parameter, window, opcode, user) for u in parameter.users)):
                    return False
        elif not reduces_blocks(user, value, window, opcode):
            return False
    return True


def reduces_blocks(reduce: HloInstruction, value: HloInstruction, window, opcode: str,
                    fusion: HloInstruction | None = None) -> bool:
    """Whether `reduce` reduces `value`, the partial results of a block reduce-window with `window`
    and the reducer `opcode`, with that reducer from its identity along every dimension in which a
    window holds more than one element (or is padded): it then reduces the reduce-window's operand
    along the same dimensions (in another order). Inside the fused computation of `fusion`, the
    identity may come in as a parameter that `fusion` binds to a constant."""
    if reduce.opcode != "reduce" or reduce.operand_count != 2 or reduce.operand(0) is not value:
        return False
    init = reduce.operand(1)
    if fusion is not None and init.opcode == "parameter" and init.parent is fusion.attrs["calls"]:
        init = fusion.operand(init.parameter_number)
    if reducer_opcode(reduce.attrs["to_apply"]) != opcode or not is_identity(init, opcode):
        return False
    reduced = set(reduce.attrs.get("dimensions", ()))
    return all(d.size == 1 and d.padding_low == 0 and d.padding_high == 0
               for dim, d in enumerate(window.dimensions) if dim not in reduced)


def is_norm_fusion(instr: HloInstruction) -> bool:
    """A fusion that reduces full-size values (a global or per-tensor norm): once inlined, its
    reductions become reductions of shards and an all-reduce of the results.

    Its fused computation holds only elementwise instructions, scalar broadcasts, constants,
    reduces and block reduce-windows (`block_reduction_opcode`), whatever its kind: a fusion
    means its computation, and XLA's CPU backend computes the sums of squares of global-norm
    clipping in `kCustom` fusions (`__ynn_fusion`). Its result is a scalar, or the partial
    results of a block reduce-window at its root that its users all reduce in full with the same
    reducer (`reduced_fully`): XLA:CPU reduces `f32[256,16]` to a scalar as a reduce-window
    to `f32[8,1]` partial sums and a reduce of those, in two fusions.
    """
    if instr.opcode != "fusion" or instr.attrs.get("kind") not in ("kLoop", "kInput", "kCustom"):
        return False
    fused = instr.attrs["calls"]
    if not any(i.opcode in ("reduce", "reduce-window") for i in fused.instructions):
        return False
    if not all(i.opcode in ("parameter", "constant", "reduce") or i.opcode in ELEMENTWISE or is_scalar_broadcast(i)
               or block_reduction_opcode(i, fused) is not None for i in fused.instructions):
        return False
    if instr.shape.rank == 0:
        return True
    opcode = block_reduction_opcode(fused.root, fused)
    return opcode is not None and not instr.is_root and reduced_fully(instr, opcode)


def is_statistics_fusion(instr: HloInstruction) -> bool:
    """A fusion that reduces or broadcasts arrays along some of their dimensions, with elementwise
    instructions between (Adafactor's row and column statistics, and the update that broadcasts
    them back): once inlined, its reduces and broadcasts act on the arrays themselves; its
    bitcasts and reshapes (a pmap step's `[1, ...]` weights) only pass values in or out. Partial
    sums of block reduce-windows that leave it must only be reduced further."""
    if instr.opcode != "fusion" or instr.attrs.get("kind") not in ("kLoop", "kInput", "kCustom") or \
            not instr.shape.is_array:
        return False
    fused = instr.attrs["calls"]
    if fused.root.opcode == "reduce-window":
        opcode = block_reduction_opcode(fused.root, fused, instr)
        if opcode is None or not partials_reduced(instr, fused.root.attrs["window"], opcode):
            return False
    if not any(i.opcode in ("reduce", "reduce-window", "bitcast", "reshape")
               or (i.opcode == "broadcast" and not is_scalar_broadcast(i)) for i in fused.instructions):
        return False
    return all(i.opcode in ("parameter", "constant", "reduce", "broadcast", "bitcast", "reshape")
               or i.opcode in ELEMENTWISE or block_reduction_opcode(i, fused) is not None for i in fused.instructions)


def is_collapsible_block_reduction(instr: HloInstruction) -> bool:
    """A block reduce-window whose partial results are only reduced in full with its reducer, or
    only reduced further along the dimensions it reduces (`partials_reduced`), also once the
    fusions that read them are inlined."""
    opcode = block_reduction_opcode(instr)
    if opcode is None:
        return False
    return reduced_fully(instr, opcode) or partials_reduced(instr, instr.attrs["window"], opcode)
