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

A registered pipeline (`PassPipeline`): it names the four passes, which the pipeline builds and
runs as one step called collective-fusion (one log entry, one dump, rolled back together); the
combiners share one `combiner_scope` through the run's `PassContext`.
"""
from __future__ import annotations

from ..core import PassPipeline, register_pass


@register_pass
class CollectiveFusion(PassPipeline):
    """Remove redundant all-reduces, then combine all-gathers, all-reduces and reduce-scatters."""

    name = "collective-fusion"
    threshold_bytes: int | None = None
    threshold_count: int | None = None
    combine_by_dim: bool = True
    simplify: bool = True

    def pipeline_text(self) -> str:
        thresholds = [f"{option}={value}" for option, value in (("threshold_bytes", self.threshold_bytes),
                                                                 ("threshold_count", self.threshold_count))
                      if value is not None]
        by_dim = thresholds + ([] if self.combine_by_dim else ["combine_by_dim=false"])
        passes = ["all-reduce-simplifier"] if self.simplify else []
        passes += [_with_options("all-gather-combiner", by_dim), _with_options("all-reduce-combiner", thresholds),
                   _with_options("reduce-scatter-combiner", by_dim)]
        return ",".join(passes)


def _with_options(name: str, options: list[str]) -> str:
    return f"{name}{{{','.join(options)}}}" if options else name
