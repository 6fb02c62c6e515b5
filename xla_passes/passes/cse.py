"""`cse`: common-subexpression elimination.

Two instructions of one computation are merged when they compute the same thing:
same opcode, shape, operands (after merging theirs), literal, called
computations and attributes other than `metadata`. Instructions with side
effects, parameters, instructions with control dependencies and copies are left
alone (XLA inserts copies on purpose to keep buffers apart; merging them makes
its CPU runtime abort on duplicate buffers)::

    a = f32[8] multiply(p, p)                 a = f32[8] multiply(p, p)
    b = f32[8] multiply(p, p)         =>      ROOT r = f32[8] add(a, a)
    ROOT r = f32[8] add(a, b)

The rewrite of one computation is `xla_passes.rewrites.cse.eliminate_common_subexpressions`.
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..core import HloPass, register_pass
from ..rewrites.cse import eliminate_common_subexpressions


@register_pass
class CommonSubexpressionElimination(HloPass):
    """Merge instructions that compute the same value from the same operands."""

    name = "cse"

    def run(self, module: HloModule) -> bool:
        changed = False
        for comp in module.computations:
            changed |= eliminate_common_subexpressions(comp)
        return changed
