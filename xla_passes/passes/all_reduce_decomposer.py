"""`all-reduce-decomposer`: all-reduce -> reduce-scatter + all-gather over the same groups.

An all-reduce moves its data twice over the links of a ring anyway (reduce-scatter phase, then
all-gather phase); writing the two phases as separate collectives lets later passes schedule,
combine or re-group them apart (the TPU-pod papers, arXiv 1909.09756 and 2011.03641, build
their 2-D gradient summation from them; `all-reduce-2d` does that). The operand is flattened to
1-D so that any shape splits into one shard per group member, and zero-padded to a multiple of
the group size when its element count does not divide (the padding is reduced among itself
only, then sliced off, so its value never matters)::

    ar = f32[5,3] all-reduce(p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add
  =>
    ar.flat = f32[15]{0} reshape(p)
    ar.zero = f32[] constant(0)
    ar.pad = f32[16]{0} pad(ar.flat, ar.zero), padding=0_1
    ar.reduce-scatter = f32[4]{0} reduce-scatter(ar.pad), replica_groups={{0,1,2,3},{4,5,6,7}},
        dimensions={0}, to_apply=add
    ar.all-gather = f32[16]{0} all-gather(ar.reduce-scatter), replica_groups={{0,1,2,3},{4,5,6,7}},
        dimensions={0}
    ar.slice = f32[15]{0} slice(ar.all-gather), slice={[0:15]}
    ar.reshape = f32[5,3] reshape(ar.slice)

Groups and their meaning stay as written (see `xla_passes.analysis.replica_groups`): no channel_id
stays cross-replica; with a channel_id both new collectives get fresh channel ids (unique in the
module, above the largest one used) and keep `use_global_device_ids`. A tuple (combined)
all-reduce becomes one reduce-scatter and one all-gather, as few collectives as the combiner
left: its elements are flattened and concatenated into one buffer, padded once, and sliced
apart afterwards into a tuple.

Left alone, on purpose:
  * all-reduce-start/done (and all-reduce wrapped in async-start): the decomposition targets
    the synchronous op; turning collectives asynchronous is a later, scheduling decision;
  * all-reduces smaller than `min_bytes` (result bytes, summed over a tuple), over groups of one
    device, or over groups of different sizes (XLA allows that for all-reduce only);
  * ones whose group size depends on a count the module header does not give (empty
    `replica_groups={}`, or a channel_id without use_global_device_ids, which counts every
    partition: text from a pass hook has no `num_partitions=`);
  * ones with control dependencies, `constrain_layout=true`, dynamic or zero-element shapes,
    or a tuple of several element types (one reduction computation cannot serve two types;
    XLA refuses such an all-reduce when it compiles).
Metadata (and frontend attributes) of the all-reduce go to every new instruction; its sharding
goes to the instruction that replaces it.
"""
from __future__ import annotations

from hlo_tools import HloModule

from ..analysis.replica_groups import DeviceCounts, participant_groups, uniform_group_size
from ..core import HloPass, register_pass
from ..rewrites.all_reduce import Addressing, decomposable_all_reduces, replace_by_shard_reduction
from ..rewrites.channel_ids import ChannelIds


@register_pass
class AllReduceDecomposer(HloPass):
    """Rewrite all-reduce as reduce-scatter then all-gather over the same replica groups."""

    name = "all-reduce-decomposer"
    opcodes = {"all-reduce"}
    min_bytes: int = 0

    def run(self, module: HloModule) -> bool:
        counts = DeviceCounts.of(module)
        channel_ids = ChannelIds(module)
        changed = False
        for all_reduce in decomposable_all_reduces(module, self.min_bytes):
            groups = participant_groups(all_reduce, counts)
            group_size = uniform_group_size(groups) if groups else None
            if group_size is None or group_size == 1:
                continue
            same_groups = Addressing.of(all_reduce)
            replace_by_shard_reduction(all_reduce, group_size, same_groups, None, channel_ids)
            changed = True
        return changed
