"""Instructions that only move elements (transposes, reshapes, row-major bitcasts), and what reads
a value through one: the elementwise chains that end in a reordering, and the reductions that give
the same result, up to the order in which they combine elements, from the value reordered.
"""
from __future__ import annotations

import math

from hlo_tools import HloInstruction
from hlo_tools.ir.opcodes import ELEMENTWISE

from .collectives import reducer_opcode
from .elementwise import is_scalar_broadcast
from .reductions import REDUCER_IDENTITY


def reordering(instr: HloInstruction):
    """What an instruction that only moves elements does, as a hashable key: ("transpose",
    permutation), or ("reshape", dims) for a reshape, or a bitcast that is one (both shapes
    row-major, where a bitcast reinterprets row-major order); None for anything else."""
    if instr.opcode == "transpose":
        return "transpose", tuple(instr.attrs["dimensions"])
    shapes = [instr.shape, instr.operand(0).shape] if instr.opcode in ("reshape", "bitcast") else []
    if shapes and all(s.is_array and s.is_row_major for s in shapes):
        return "reshape", instr.shape.dims
    return None


def reordered_chain(starts: list[HloInstruction], dims: tuple[int, ...], *, statistics: bool = False):
    """(the elementwise instructions of shape `dims` that `starts` reach, the reorderings where
    they end: `reordering`) when every path from `starts` is such a chain ending in a
    reordering, and the chain's other operands are scalars (with `statistics`, also broadcasts
    to `dims` of values from outside the chain: `statistics_broadcasts`); None otherwise."""
    chain, ends, work = list(starts), [], list(starts)
    while work:
        for user in work.pop().users:
            if user in chain or user in ends:
                continue
            if reordering(user) is not None:
                ends.append(user)
            elif (user.opcode in ELEMENTWISE and user.shape.is_array and user.shape.dims == dims
                  and not user.is_root and not user.control_predecessors
                  and all(o in chain or o.shape.rank == 0 or is_scalar_broadcast(o) or is_one_element_constant(o)
                          or (statistics and _is_broadcast_to(o, dims)) for o in user.operands)):
                chain.append(user)
                work.append(user)
            else:
                return None
    if any(instr.is_root for instr in chain):
        return None
    return chain, ends


def _is_broadcast_to(instr: HloInstruction, dims: tuple[int, ...]) -> bool:
    return instr.opcode == "broadcast" and instr.shape.dims == dims and not instr.control_predecessors


def statistics_broadcasts(chain: list[HloInstruction]) -> list[HloInstruction]:
    """The broadcasts of lower-rank values that the instructions of `chain` read (Adafactor's
    row and column statistics, broadcast back along the dimensions they span)."""
    return list(dict.fromkeys(o for instr in chain for o in instr.operands
                              if o.opcode == "broadcast" and o not in chain and not is_scalar_broadcast(o)))


def moved_dimensions(key) -> dict[int, int] | None:
    """Where the reordering `key` (`reordering`) puts each dimension of the value, {old: new},
    for a transpose; None for a reshape, which keeps no dimensions."""
    kind, how = key
    return {old: new for new, old in enumerate(how)} if kind == "transpose" else None


def keeps_order(dimensions, moved: dict[int, int] | None) -> bool:
    """Whether the increasing `dimensions` are still in increasing order where `moved` puts them:
    then a broadcast along them, or the result of a reduce that keeps them, needs no transpose."""
    return moved is not None and all(moved[a] < moved[b] for a, b in zip(dimensions, dimensions[1:]))


def is_one_element_constant(instr: HloInstruction) -> bool:
    """A constant of one element (`f32[1] constant({1})`), which any reordering leaves as it is."""
    return instr.opcode == "constant" and instr.shape.is_array and math.prod(instr.shape.dims) == 1


def reordering_in_fusion(user: HloInstruction, value: HloInstruction):
    """The one reordering (`reordering`) through which the kLoop fusion `user` reads `value`
    (see `reordered_chain`), or None. The statistics it broadcasts on the way must stay
    broadcasts along increasing dimensions once reordered (`keeps_order`)."""
    if user.opcode != "fusion" or user.attrs.get("kind") != "kLoop":
        return None
    fused = user.attrs["calls"]
    found = reordered_chain([fused.parameter(i) for i, o in enumerate(user.operands) if o is value],
                             value.shape.dims, statistics=True)
    if found is None or not found[1]:
        return None
    keys = {reordering(end) for end in found[1]}
    if len(keys) != 1:
        return None
    key = keys.pop()
    if not all(keeps_order(b.attrs["dimensions"], moved_dimensions(key)) for b in statistics_broadcasts(found[0])):
        return None
    return key


def reduced_in_any_order(values: list[HloInstruction], users: list[HloInstruction], dims: tuple[int, ...],
                          moved: dict[int, int] | None):
    """Follow `values` (of shape `dims`) into `users`: (the values that carry them elementwise,
    starting with `values`; the reductions and fusions where they end; "") when all that becomes of
    them is reductions with a commutative reducer (`REDUCER_IDENTITY`): full ones, or, when
    the values are to be transposed (`moved`: `moved_dimensions`), of some dimensions whose
    kept ones stay in order (Adafactor's row and column statistics). Reading them in another
    order then changes only the order in which those reductions combine the same elements (a
    partial one reducing the moved dimensions). Otherwise the third element says what does
    something else. A fusion counts by its fused computation; whether a carried value is the
    result is the caller's question (in a fused computation it makes the fusion carry them)."""
    position = {instr: n for n, instr in enumerate(values[0].parent.post_order())}
    carried, ends, work = list(values), [], set(users)
    while work:
        user = min(work, key=position.get)  # after its operands: it sees every carried one
        work.remove(user)
        if user.control_predecessors:
            return carried, ends, f"%{user.name} ({user.opcode}) has control dependencies"
        if (user.opcode == "reduce" and user.operand_count == 2 and user.operand(0) in carried
                and reducer_opcode(user.attrs["to_apply"]) in REDUCER_IDENTITY and reduces_alike(user, moved)):
            ends.append(user)
        elif (user.opcode in ELEMENTWISE and user.shape.is_array and user.shape.dims == dims
              and all(o in carried or o.shape.rank == 0 or is_scalar_broadcast(o) or is_one_element_constant(o)
                      for o in user.operands)):
            carried.append(user)
            work.update(user.users)
        elif user.opcode == "fusion":
            fused = user.attrs["calls"]
            parameters = [fused.parameter(i) for i, o in enumerate(user.operands) if o in carried]
            inside, _, stop = reduced_in_any_order(parameters, [u for p in parameters for u in p.users], dims, moved)
            if stop:
                return carried, ends, f"{stop} in %{user.name}"
            if fused.root in inside:
                carried.append(user)
                work.update(user.users)
            else:
                ends.append(user)
        else:
            return carried, ends, f"%{user.name} ({user.opcode}) reads it"
    return carried, ends, ""


def reduces_alike(reduce: HloInstruction, moved: dict[int, int] | None) -> bool:
    """Whether `reduce` gives the same result (up to the order it combines elements in) from its
    operand reordered by the transpose `moved`: it reduces all dimensions, or keeps some that
    stay in order."""
    kept = [d for d in range(reduce.operand(0).shape.rank) if d not in reduce.attrs["dimensions"]]
    return not kept or keeps_order(kept, moved)
