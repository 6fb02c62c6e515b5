"""Whether an all-reduce can be rewritten into collective-permutes between the devices of a
topology (the rings of `all-reduce-rings`, the tree of `all-reduce-2d{failed=...}`), and which
ids those permutes then pair.

XLA's collective-permute without a channel_id pairs replica ids (each partition permutes among
its replicas), with one it pairs partition ids (each replica among its partitions). A
cross-replica all-reduce reduces among replicas. Any other names global device ids,
replica * partitions + partition: replica ids when the module has one partition, partition ids
when it has one replica (a module that states no replica count has one, as every JAX program
does). With several of both, no permute reaches across both.
"""
from __future__ import annotations

from hlo_tools import HloInstruction
from hlo_tools.inspection.topology import Topology

from .collectives import ORDER_FREE_REDUCERS, reducer_opcode
from .replica_groups import DeviceCounts, GroupMode, group_mode, participant_groups

# What the rewritten all-reduce's collective-permutes pair (see `permute_space`).
REPLICAS, PARTITIONS = "replicas", "partitions"


def permute_space(all_reduce: HloInstruction, counts: DeviceCounts) -> str | None:
    """What collective-permutes that replace `all_reduce` pair: REPLICAS (permutes without a
    channel_id, over replica-id) or PARTITIONS (with fresh channel ids, over partition-id); None
    when the all-reduce's devices differ in both (several replicas and partitions)."""
    if group_mode(all_reduce) is GroupMode.CROSS_REPLICA or counts.partitions == 1:
        return REPLICAS
    if (counts.replicas or 1) == 1:
        return PARTITIONS
    return None


def all_reduce_misfit(all_reduce: HloInstruction, topology: Topology, counts: DeviceCounts) -> str:
    """Why `all_reduce` cannot be rewritten into permutes between `topology`'s devices (the
    healthy chips where some failed); "" when it can.

    It can when its reducer is one elementwise add, multiply, maximum, minimum, and, or or xor
    (not a sum or product of pred, which XLA's backends disagree on), its participants are
    known and are one group of exactly the topology's devices (any order), its permutes have one
    space to pair (`permute_space`), and the module states no other count of that space.
    """
    reducer = reducer_opcode(all_reduce.attrs["to_apply"])
    if reducer not in ORDER_FREE_REDUCERS:
        return f"the reducer is not one elementwise {', '.join(ORDER_FREE_REDUCERS)}"
    if reducer in ("add", "multiply") and all_reduce.operand(0).shape.dtype == "pred":
        what = "sum" if reducer == "add" else "product"
        return f"a {what} of pred (XLA backends disagree on what it is)"
    groups = participant_groups(all_reduce, counts)
    if groups is None:
        return ("the participants are not known: empty replica_groups, or a channel_id without "
                "use_global_device_ids, need replica_count/num_partitions in the module header")
    devices = topology.num_devices
    noun = "healthy chips" if topology.failed else "devices"
    if len(groups) != 1 or sorted(groups[0]) != list(range(devices)):
        sizes = ", ".join(str(len(group)) for group in groups)
        return (f"the groups ({len(groups)} of {sizes} devices) are not one group of the {devices} "
                f"{noun} of {topology.describe()}")
    space = permute_space(all_reduce, counts)
    if space is None:
        return (f"a collective-permute pairs replicas or partitions, and the module has {counts.replicas} "
                f"replicas of {counts.partitions or 'an unstated number of'} partitions")
    stated = counts.replicas if space == REPLICAS else counts.partitions
    if stated is not None and stated != devices:
        return f"the module runs on {stated} {space}, {topology.describe()} has {devices} {noun}"
    return ""
