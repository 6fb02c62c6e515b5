"""Channel ids for new collectives."""
from __future__ import annotations

from hlo_tools import HloModule
from hlo_tools.ir.attributes import attr_int


class ChannelIds:
    """Hands out channel ids no instruction of the module uses yet (counting up from the largest)."""

    def __init__(self, module: HloModule):
        self._last = max((attr_int(instr.attrs, "channel_id") for instr in module.instructions()
                          if instr.attrs.get("channel_id") is not None), default=0)

    def fresh(self) -> int:
        self._last += 1
        return self._last
