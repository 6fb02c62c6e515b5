"""`all-gather-combiner`: combine independent all-gathers into one tuple-shaped all-gather.

As XLA's AllGatherCombiner::

    a = f32[8,4] all-gather(x), replica_groups={{0,1},{2,3}}, dimensions={0}
    b = s32[2,6] all-gather(y), replica_groups={{0,1},{2,3}}, dimensions={0}
                                  =>
    all-gather = (f32[8,4], s32[2,6]) all-gather(x, y), replica_groups={{0,1},{2,3}}, dimensions={0}
    get-tuple-element = f32[8,4] get-tuple-element(all-gather), index=0
    get-tuple-element.1 = s32[2,6] get-tuple-element(all-gather), index=1

All-gathers combine when they have the same replica groups, channel-id presence and
`use_global_device_ids`, and neither depends on the other; element types may differ (XLA's
default). With `combine_by_dim` (the default) only all-gathers of one dimension combine;
without it, the combined op gathers along the dimension most operands use, and the others
are transposed there and back (XLA uses layout-preserving bitcasts; these transposes are
layout-preserving too)::

    a = f32[2,16] all-gather(x), replica_groups={{0,1,2,3}}, dimensions={1}
    b = f32[8] all-gather(y), replica_groups={{0,1,2,3}}, dimensions={0}
                                  =>   (combine_by_dim=false; a tie goes to the lower dimension)
    transpose = f32[4,2] transpose(x), dimensions={1,0}
    all-gather = (f32[16,2], f32[8]) all-gather(transpose, y), replica_groups={{0,1,2,3}}, dimensions={0}
    get-tuple-element = f32[16,2] get-tuple-element(all-gather), index=0
    transpose.1 = f32[2,16] transpose(get-tuple-element), dimensions={1,0}
    get-tuple-element.1 = f32[8] get-tuple-element(all-gather), index=1

Thresholds (unset: the platform's), grouping, domains, metadata, tuple inputs, async forms and
the computations visited are as in `all-reduce-combiner`, but for Shardy `shard_map` bodies,
which are left alone: XLA of jaxlib 0.10.2 aborts on a tuple-shaped all-gather there.
"""
from __future__ import annotations

from functools import partial

from hlo_tools import HloModule

from ..analysis.collectives import (COMBINER_SCOPE, cached_combiner_scope, combine_along_most_frequent_dimension,
                                    combiner_thresholds, run_combiner, tuple_combinable_key)
from ..core import HloPass, PassContext, register_pass


@register_pass
class AllGatherCombiner(HloPass):
    """Combine independent all-gathers into tuple-shaped all-gathers."""

    name = "all-gather-combiner"
    opcodes = {"all-gather": 2}
    threshold_bytes: int | None = None
    threshold_count: int | None = None
    combine_by_dim: bool = True

    preserves = (COMBINER_SCOPE,)   # no fusion or async op added or removed

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        """Thresholds left unset are the context's (the platform's), else the offline defaults."""
        return run_combiner(module, "all-gather", partial(tuple_combinable_key, by_dimension=self.combine_by_dim),
                            combine_along_most_frequent_dimension, **combiner_thresholds(self, context),
                            scope=cached_combiner_scope(module, context))
