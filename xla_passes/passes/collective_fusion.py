"""`collective-fusion`: the three collective combiners in one pass.

Runs `all-gather-combiner`, `all-reduce-combiner` and `reduce-scatter-combiner` (in the
order XLA's GPU pipeline runs them) with the same thresholds::

    ag1 = f32[8] all-gather(a), replica_groups={{0,1}}, dimensions={0}
    ag2 = f32[8] all-gather(b), replica_groups={{0,1}}, dimensions={0}
    ar1 = f32[4] all-reduce(c), replica_groups={}, to_apply=add
    ar2 = f32[4] all-reduce(d), replica_groups={}, to_apply=add
    rs1 = f32[2] reduce-scatter(e), replica_groups={{0,1}}, dimensions={0}, to_apply=add
    rs2 = f32[2] reduce-scatter(f), replica_groups={{0,1}}, dimensions={0}, to_apply=add
                                  =>
    all-gather = (f32[8], f32[8]) all-gather(a, b), replica_groups={{0,1}}, dimensions={0}
    all-reduce = (f32[4], f32[4]) all-reduce(c, d), replica_groups={}, to_apply=add
    reduce-scatter = (f32[2], f32[2]) reduce-scatter(e, f), replica_groups={{0,1}}, dimensions={0}, to_apply=add
    ... get-tuple-element of each for the uses of ag1, ag2, ar1, ar2, rs1, rs2
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..collectives import combiner_scope
from ..core import HloPass, register_pass
from .all_gather_combiner import AllGatherCombiner
from .all_reduce_combiner import DEFAULT_THRESHOLD_BYTES, DEFAULT_THRESHOLD_COUNT, AllReduceCombiner
from .reduce_scatter_combiner import ReduceScatterCombiner


@register_pass
class CollectiveFusion(HloPass):
    """Combine all-gathers, then all-reduces, then reduce-scatters (the three combiners)."""

    name = "collective-fusion"
    opcodes = {"all-gather": 2, "all-reduce": 2, "reduce-scatter": 2}
    threshold_bytes: int = DEFAULT_THRESHOLD_BYTES
    threshold_count: int = DEFAULT_THRESHOLD_COUNT
    combine_by_dim: bool = True

    def run(self, module: HloModule) -> bool:
        thresholds = {"threshold_bytes": self.threshold_bytes, "threshold_count": self.threshold_count}
        scope = combiner_scope(module)  # the combiners change no fusion or async op: one walk for all three
        changed = AllGatherCombiner(**thresholds, combine_by_dim=self.combine_by_dim).run(module, scope)
        changed |= AllReduceCombiner(**thresholds).run(module, scope)
        changed |= ReduceScatterCombiner(**thresholds, combine_by_dim=self.combine_by_dim).run(module, scope)
        return changed
