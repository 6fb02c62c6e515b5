"""What depends on what inside one computation, through operands (and control edges)."""
from __future__ import annotations

from collections.abc import Iterable

from hlo_tools import HloComputation, HloInstruction


class DependencyTracker:
    """Which instructions of one computation depend on any of a growing set of sources.

    Dependencies follow operands and control predecessors, transitively. Adding a source
    marks everything downstream of it once, so a whole group costs one walk of the
    computation (control edges come from the IR's index, `HloInstruction.control_successors`).
    """

    def __init__(self, comp: HloComputation):
        self.computation = comp
        self._downstream: set[HloInstruction] = set()

    def add_source(self, source: HloInstruction) -> None:
        stack = [source]
        while stack:
            instr = stack.pop()
            for nxt in (*instr.users, *instr.control_successors):
                if nxt not in self._downstream:
                    self._downstream.add(nxt)
                    stack.append(nxt)

    def depends_on_sources(self, instr: HloInstruction) -> bool:
        return instr in self._downstream


def reachable_from(sources: Iterable[HloInstruction], order: Iterable[HloInstruction]) -> set[HloInstruction]:
    """The instructions of `order` (operands first) that depend on any of `sources` through
    operands, and the sources themselves."""
    found = set(sources)
    for instr in order:
        if any(o in found for o in instr.operands):
            found.add(instr)
    return found


def operand_connected_components(members: set) -> list[set]:
    """The sets of `members` that operand edges between members connect (directions ignored)."""
    parent = {m: m for m in members}

    def find(x):
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for member in members:
        for operand in member.operands:
            if operand in members:
                parent[find(operand)] = find(member)
    components: dict = {}
    for member in members:
        components.setdefault(find(member), set()).add(member)
    return list(components.values())
