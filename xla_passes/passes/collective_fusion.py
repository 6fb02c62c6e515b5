"""`collective-fusion`: remove redundant all-reduces, then combine the collectives left.

Runs `all-reduce-simplifier` (all-reduces of values already the same on every device become the
value, or the value times the group size), then `all-gather-combiner`, `all-reduce-combiner` and
`reduce-scatter-combiner` (in the order XLA's GPU pipeline runs them) with the same thresholds
(unset: the platform's)::

    ag1 = f32[8] all-gather(a), replica_groups={{0,1}}, dimensions={0}
    ag2 = f32[8] all-gather(b), replica_groups={{0,1}}, dimensions={0}
    ar1 = f32[4] all-reduce(c), replica_groups={{0,1}}, to_apply=add
    ar2 = f32[4] all-reduce(d), replica_groups={{0,1}}, to_apply=add
    ar3 = f32[4] all-reduce(ar2), replica_groups={{0,1}}, to_apply=add     (ar2: the same on both)
    rs1 = f32[2] reduce-scatter(e), replica_groups={{0,1}}, dimensions={0}, to_apply=add
    rs2 = f32[2] reduce-scatter(f), replica_groups={{0,1}}, dimensions={0}, to_apply=add
                                  =>
    all-gather = (f32[8], f32[8]) all-gather(a, b), replica_groups={{0,1}}, dimensions={0}
    all-reduce = (f32[4], f32[4]) all-reduce(c, d), replica_groups={{0,1}}, to_apply=add
    ar3.count = f32[] constant(2)
    ar3.count.broadcast = f32[4] broadcast(ar3.count), dimensions={}
    ar3 = f32[4] multiply(get-tuple-element.3, ar3.count.broadcast)
    reduce-scatter = (f32[2], f32[2]) reduce-scatter(e, f), replica_groups={{0,1}}, dimensions={0}, to_apply=add
    ... get-tuple-element of each for the uses of ag1, ag2, ar1, ar2, rs1, rs2

Simplifying first is what lets a `shard_map` + `pmean` step combine: each gradient's second
all-reduce reads its first, and the chain of them would otherwise keep every group at one
member. `simplify=false` runs the combiners alone.
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..analysis.collectives import combiner_scope
from ..core import HloPass, register_pass
from .all_gather_combiner import AllGatherCombiner
from .all_reduce_combiner import AllReduceCombiner
from .all_reduce_simplifier import AllReduceSimplifier
from .reduce_scatter_combiner import ReduceScatterCombiner


@register_pass
class CollectiveFusion(HloPass):
    """Remove redundant all-reduces, then combine all-gathers, all-reduces and reduce-scatters."""

    name = "collective-fusion"
    opcodes = {"all-gather": 2, "all-reduce": 1, "reduce-scatter": 2}
    threshold_bytes: int | None = None
    threshold_count: int | None = None
    combine_by_dim: bool = True
    simplify: bool = True

    def __post_init__(self):
        self.report: list[str] = []

    def run(self, module: HloModule) -> bool:
        simplifier = AllReduceSimplifier()
        changed = simplifier.run(module) if self.simplify else False
        self.report = simplifier.report
        thresholds = {"threshold_bytes": self.threshold_bytes, "threshold_count": self.threshold_count}
        scope = combiner_scope(module)  # the combiners change no fusion or async op: one walk for all three
        changed |= AllGatherCombiner(**thresholds, combine_by_dim=self.combine_by_dim).run(module, scope)
        changed |= AllReduceCombiner(**thresholds).run(module, scope)
        changed |= ReduceScatterCombiner(**thresholds, combine_by_dim=self.combine_by_dim).run(module, scope)
        return changed
