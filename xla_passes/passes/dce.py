"""`dce`: dead-code elimination.

Removes instructions whose results nobody uses (side-effecting ones such as
send, outfeed or custom-calls with `custom_call_has_side_effect=true` stay) and
computations that nothing reachable from the entry calls::

    ENTRY e {                                 ENTRY e {
      p = f32[8] parameter(0)                   p = f32[8] parameter(0)
      unused = f32[8] negate(p)         =>      ROOT r = f32[8] add(p, p)
      ROOT r = f32[8] add(p, p)               }
    }
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..core import HloPass, register_pass


@register_pass
class DeadCodeElimination(HloPass):
    """Remove unused instructions (keeping side effects) and computations nothing calls."""

    name = "dce"
    remove_computations: bool = True

    def run(self, module: HloModule) -> bool:
        changed = False
        for comp in module.computations:
            changed |= comp.remove_dead_code()
        if self.remove_computations:
            changed |= module.remove_dead_computations()
        return changed
