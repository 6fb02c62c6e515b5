"""`all-reduce-combiner`: combine independent all-reduces into one tuple-shaped all-reduce.

As XLA's AllReduceCombiner: each all-reduce has a fixed latency, so one op moving all the
bytes is faster than many small ones::

    a = f32[8] all-reduce(x), replica_groups={}, to_apply=add
    b = f32[4] all-reduce(y), replica_groups={}, to_apply=add
    ROOT r = (f32[8], f32[4]) tuple(a, b)
                                  =>
    all-reduce = (f32[8], f32[4]) all-reduce(x, y), replica_groups={}, to_apply=add
    get-tuple-element = f32[8] get-tuple-element(all-reduce), index=0
    get-tuple-element.1 = f32[4] get-tuple-element(all-reduce), index=1
    ROOT r = (f32[8], f32[4]) tuple(get-tuple-element, get-tuple-element.1)

All-reduces combine when they have the same replica groups, channel-id presence,
`use_global_device_ids`, reduction computation (structurally equal reducers count as the
same, so the element types match too) and `collective_group_key`, are in one sharding domain,
have no control dependencies, and neither depends on the other. Groups are formed in post
order up to `threshold_bytes` of results and `threshold_count` operands; an all-reduce that
depends on the group is left for a later group. Unset thresholds are the platform's defaults
(`xla_passes.analysis.collectives.PLATFORM_THRESHOLDS`; GPU's offline). The combined op's metadata
merges the members' `op_name`s and frontend attributes as XLA does.

In a Shardy `shard_map` body (`xla.sdy.manual_computation_body*`, a module before XLA's
optimizations) XLA refuses a tuple-shaped all-reduce, so there the group becomes one
all-reduce of a flat buffer (`combine_all_reduces_flat`)::

    a = f32[8,4] all-reduce(x), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add
    b = f32[4] all-reduce(y), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add
                                  =>
    all-reduce.flat = f32[32]{0} reshape(x)
    all-reduce.concatenate = f32[36]{0} concatenate(all-reduce.flat, y), dimensions={0}
    all-reduce = f32[36]{0} all-reduce(all-reduce.concatenate), channel_id=1, replica_groups={{0,1,2,3}}, ...
    all-reduce.slice = f32[32]{0} slice(all-reduce), slice={[0:32]}
    all-reduce.reshape = f32[8,4] reshape(all-reduce.slice)
    all-reduce.slice.1 = f32[4]{0} slice(all-reduce), slice={[32:36]}

XLA computes an all-reduce of floats narrower than 32 bits (bf16, f16, f8) in f32 and, with
its default `xla_allow_excess_precision`, then drops the rounding of an operand that was itself
rounded from f32 (`convert(convert(x, bf16), f32)` becomes `x`). Through a flat buffer's
reshape and concatenate it does not see that pair, so the combined op would add the rounded
operands where the separate ones add the exact ones (0.3% of a mixed-precision gradient).
Such all-reduces are therefore not combined into a flat buffer; in the tuple form XLA
promotes each element as it promotes a single all-reduce, and the sums are the same. Nor are
float32 all-reduces of values converted from narrow floats (mixed precision's gradients of
float32 master weights): XLA fuses the narrow-float reduction or dot that computes such a value
into the buffer's concatenate, where its CPU code rounds other partial sums than in the
separate op's fusion (up to 0.6% of an f16 bias gradient).

Differences from XLA: already combined (tuple) all-reduces are combined further, flattened,
and count with all their operands; structurally equal non-trivial reducers combine (XLA only
combines reducers of one binary op). Async `all-reduce-start`/`-done` pairs and
layout-constrained modules are left alone (see `xla_passes.analysis.collectives`). Every computation
but fusion and async-wrapped bodies is visited: entry, while bodies, shard_map bodies, called
computations.
"""
from __future__ import annotations

from collections.abc import Sequence

from hlo_tools import HloInstruction, HloModule
from hlo_tools.ir.shape import DTYPE_BITS, FLOAT_DTYPES

from ..analysis.collectives import (COMBINER_SCOPE, cached_combiner_scope, collective_key, combine_all_reduces_flat,
                                    combine_collectives, combiner_thresholds, in_shardy_body, run_combiner)
from ..core import HloPass, PassContext, register_pass


# Float element types XLA sums in a wider type (and may skip a rounding of, see above).
NARROW_FLOATS = frozenset(t for t in FLOAT_DTYPES if DTYPE_BITS[t] < 32)


@register_pass
class AllReduceCombiner(HloPass):
    """Combine independent all-reduces of one kind into tuple-shaped all-reduces."""

    name = "all-reduce-combiner"
    opcodes = {"all-reduce": 2}
    threshold_bytes: int | None = None
    threshold_count: int | None = None

    preserves = (COMBINER_SCOPE,)   # no fusion or async op added or removed

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        """Thresholds left unset are the context's (the platform's), else the offline defaults."""
        return run_combiner(module, "all-reduce", all_reduce_key, combine_all_reduces,
                            **combiner_thresholds(self, context),
                            scope=cached_combiner_scope(module, context))


def all_reduce_key(instr: HloInstruction) -> tuple | None:
    """`collective_key`, or None for an all-reduce of narrow floats, or of values converted from
    them, that would go into a flat buffer (see the module docstring: XLA would compute other
    values)."""
    if in_shardy_body(instr) and (any(leaf.dtype in NARROW_FLOATS for _, leaf in instr.shape.leaves())
                                  or any(_converted_from_narrow_floats(op) for op in instr.operands)):
        return None
    return collective_key(instr)


def _converted_from_narrow_floats(value: HloInstruction) -> bool:
    """Whether `value` is, up to reshapes, transposes and copies, a convert from a narrow float."""
    while value.opcode in ("reshape", "bitcast", "transpose", "copy"):
        value = value.operand(0)
    return value.opcode == "convert" and value.operand(0).shape.dtype in NARROW_FLOATS


def combine_all_reduces(members: Sequence[HloInstruction]) -> HloInstruction:
    """One tuple-shaped all-reduce, or one of a flat buffer where XLA refuses the tuple."""
    return (combine_all_reduces_flat if in_shardy_body(members[0]) else combine_collectives)(members)
