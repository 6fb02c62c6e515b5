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
control dependencies. A callee that no caller is left for is removed. The rewrite is
`xla_passes.rewrites.inlining.inline_calls`.
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..core import HloPass, register_pass
from ..rewrites.inlining import inline_calls


@register_pass
class CallInliner(HloPass):
    """Inline `call` instructions (not Shardy bodies or composites) into their callers."""

    name = "call-inliner"
    opcodes = {"call"}

    def run(self, module: HloModule) -> bool:
        return inline_calls(module)
