"""`reduce-scatter-combiner`: combine independent reduce-scatters into one tuple-shaped op.

As XLA's ReduceScatterCombiner::

    a = f32[2,4] reduce-scatter(x), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=add
    b = f32[1] reduce-scatter(y), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=add
                                  =>
    reduce-scatter = (f32[2,4], f32[1]) reduce-scatter(x, y), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=add
    get-tuple-element = f32[2,4] get-tuple-element(reduce-scatter), index=0
    get-tuple-element.1 = f32[1] get-tuple-element(reduce-scatter), index=1

Reduce-scatters combine when they have the same replica groups, channel-id presence,
`use_global_device_ids` and reduction computation (structurally), and neither depends on
the other. `combine_by_dim` is as in `all-gather-combiner` (operands of other dimensions are
transposed to the shared one and back). Thresholds count result bytes (the scattered
shards), as XLA's do; unset, they are the platform's. Grouping, domains, metadata, tuple
inputs, async forms and the computations visited are as in `all-reduce-combiner`, but for
Shardy `shard_map` bodies, which are left alone: StableHLO's reduce-scatter takes one operand,
so XLA refuses a tuple-shaped one there. XLA copies the first member's sharding onto the combined op; here it
gets the tuple of every member's sharding, as the other two combiners do.
"""
from __future__ import annotations

from functools import partial

from hlo_tools import HloModule

from ..analysis.collectives import (COMBINER_SCOPE, cached_combiner_scope, combine_along_most_frequent_dimension,
                                    combiner_thresholds, run_combiner, tuple_combinable_key)
from ..core import HloPass, PassContext, register_pass


@register_pass
class ReduceScatterCombiner(HloPass):
    """Combine independent reduce-scatters of one kind into tuple-shaped reduce-scatters."""

    name = "reduce-scatter-combiner"
    opcodes = {"reduce-scatter": 2}
    threshold_bytes: int | None = None
    threshold_count: int | None = None
    combine_by_dim: bool = True

    preserves = (COMBINER_SCOPE,)   # no fusion or async op added or removed

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        """Thresholds left unset are the context's (the platform's), else the offline defaults."""
        return run_combiner(module, "reduce-scatter", partial(tuple_combinable_key, by_dimension=self.combine_by_dim),
                            combine_along_most_frequent_dimension, **combiner_thresholds(self, context),
                            scope=cached_combiner_scope(module, context))
