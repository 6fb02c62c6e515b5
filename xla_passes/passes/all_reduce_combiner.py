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
`use_global_device_ids` and reduction computation (structurally equal reducers count as the
same, so the element types match too) and neither depends on the other. Groups are formed
in post order up to `threshold_bytes` of results and `threshold_count` operands (XLA's GPU
defaults). Differences from XLA: already combined (tuple) all-reduces are combined further,
flattened, and count with all their operands; structurally equal non-trivial reducers
combine (XLA only combines reducers of one binary op); a computation with `domain`
instructions is skipped (XLA combines within each domain). Async `all-reduce-start`/`-done`
pairs and layout-constrained modules are left alone (see `xla_passes.collectives`). Every
computation but fusion and async-wrapped bodies is visited: entry, while bodies, shard_map
bodies, called computations.
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..collectives import CombinerScope, collective_key, combine_collectives, run_combiner
from ..core import HloPass, register_pass

DEFAULT_THRESHOLD_BYTES = 30 * 1024 * 1024
DEFAULT_THRESHOLD_COUNT = 256


@register_pass
class AllReduceCombiner(HloPass):
    """Combine independent all-reduces of one kind into tuple-shaped all-reduces."""

    name = "all-reduce-combiner"
    opcodes = {"all-reduce": 2}
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    threshold_count: int = DEFAULT_THRESHOLD_COUNT

    def run(self, module: HloModule, scope: CombinerScope | None = None) -> bool:
        """`scope`: `combiner_scope(module)`, when the caller (collective-fusion) has it already."""
        return run_combiner(module, "all-reduce", collective_key, combine_collectives,
                            threshold_bytes=self.threshold_bytes, threshold_count=self.threshold_count, scope=scope)
