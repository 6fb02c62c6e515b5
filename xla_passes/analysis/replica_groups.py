"""Device-id algebra for collectives: who takes part in one, and how to cut a group into a mesh.

An all-reduce, reduce-scatter or all-gather names its participants with `replica_groups`,
and what the numbers in them mean depends on two attributes (XLA's CollectiveOpGroupMode,
docs/operation_semantics.md):

    channel_id  use_global_device_ids  mode                        the numbers are
    ----------  ---------------------  --------------------------  ------------------------------
    absent      false / absent         cross-replica               replica ids; each partition
                                                                   reduces among its own replicas
    present     false / absent         cross-replica-and-partition replica ids; every partition
                                                                   of those replicas takes part
    present     true                   flattened-id                global device ids,
                                                                   replica * num_partitions + partition

(collective-permute and all-to-all, which have no use_global_device_ids, read a channel as
cross-partition instead; nothing here is about them.) So `channel_id=1, replica_groups={{0}}`
in a program of 1 replica and 8 partitions is one group of all 8 partitions, while
`{{0,1,2,3},{4,5,6,7}}` there names replicas that do not exist (XLA fails). A participant's
rank (the shard a reduce-scatter gives it) is its position in the group: replica-major, then
partition, in the cross-replica-and-partition mode. Empty `replica_groups={}` means one group
of every replica (of every device in the cross-replica-and-partition mode); XLA refuses it in
the flattened-id mode.

The functions here turn a collective's groups into explicit participant lists (`None` where
the module does not say enough, e.g. a partition count its header leaves out: a module that a
pass hook receives has no `num_partitions=` line, so only explicit flattened-id groups are
self-describing there), and cut each group into the rows and columns of a mesh.
"""
from __future__ import annotations

import dataclasses
import enum
import re

from hlo_tools import HloInstruction, HloModule, ReplicaGroups
from hlo_tools.ir.attributes import attr_bool


class GroupMode(enum.Enum):
    """What the ids in `replica_groups` of an all-reduce, reduce-scatter or all-gather mean."""

    CROSS_REPLICA = "cross-replica"
    CROSS_REPLICA_AND_PARTITION = "cross-replica-and-partition"
    FLATTENED_ID = "flattened-id"


def group_mode(instr: HloInstruction) -> GroupMode:
    """The mode that `instr`'s channel_id and use_global_device_ids select (table above)."""
    if instr.attrs.get("channel_id") is None:
        return GroupMode.CROSS_REPLICA
    if attr_bool(instr.attrs, "use_global_device_ids"):
        return GroupMode.FLATTENED_ID
    return GroupMode.CROSS_REPLICA_AND_PARTITION


@dataclasses.dataclass(frozen=True)
class DeviceCounts:
    """The replica and partition counts a module's header states (None where it says nothing).

    A missing count is unknown rather than 1: XLA keeps the counts in the module's config,
    which HLO text from a pass hook does not carry.
    """

    replicas: int | None
    partitions: int | None

    @staticmethod
    def of(module: HloModule) -> "DeviceCounts":
        def count(key):
            return int(module.attrs[key]) if key in module.attrs else None
        return DeviceCounts(count("replica_count"), count("num_partitions"))


# Collectives whose ids tell how many devices a module runs on (see `inferred_device_counts`).
_ID_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                   "collective-broadcast")


def inferred_device_counts(module: HloModule) -> DeviceCounts | None:
    """The replica and partition counts of a per-device module: its header's, else what its
    shardings and collectives show; None when they show nothing.

    A module from JAX's pass hook has no header counts. Partitions: a tiled sharding names every
    device; ids in flattened-id groups are global device ids; all-to-all, collective-permute and
    collective-broadcast with a channel number partitions. Replicas: the ids of those without a
    channel, and of the other collectives' groups in the two modes that number replicas. A
    module without either runs on one device as it runs on each, unless it reads its device id.
    """
    stated = DeviceCounts.of(module)
    if stated.replicas is not None and stated.partitions is not None:
        return stated
    most = {"replicas": 0, "partitions": 0, "devices": 0}
    for instr in [*module.entry.parameters, module.entry.root]:
        sharding = instr.attrs.get("sharding")
        for leaf in (sharding.elements if sharding is not None and sharding.kind == "tuple" else [sharding]):
            if leaf is not None and leaf.is_tiled:
                most["partitions"] = max(most["partitions"], len(leaf.device_list()))
    for instr in module.instructions_mentioning(_ID_COLLECTIVES):
        if instr.opcode not in _ID_COLLECTIVES:
            continue
        if "source_target_pairs" in instr.attrs:
            ids = [i for pair in instr.attrs["source_target_pairs"] for i in pair]
        else:
            ids = [i for group in (written_groups(instr) or []) for i in group]
        if not ids:
            continue
        if instr.opcode in ("all-to-all", "collective-permute", "collective-broadcast"):
            kind = "partitions" if instr.attrs.get("channel_id") is not None else "replicas"
        else:
            kind = "devices" if group_mode(instr) is GroupMode.FLATTENED_ID else "replicas"
        most[kind] = max(most[kind], max(ids) + 1)
    if not any(most.values()):  # devices that never talk: one runs what each runs, unless it asks who it is
        ids = module.instructions_mentioning(("replica-id", "partition-id"))
        return None if any(i.opcode in ("replica-id", "partition-id") for i in ids) else DeviceCounts(1, 1)
    replicas = stated.replicas or max(most["replicas"], 1)
    partitions = stated.partitions or max(most["partitions"], most["devices"] // replicas, 1)
    return DeviceCounts(replicas, partitions)


def written_groups(instr: HloInstruction) -> list[list[int]] | None:
    """The groups as written (iota form expanded): empty for `replica_groups={}` or none, None
    when the attribute is text the parser could not read."""
    groups = instr.attrs.get("replica_groups")
    if groups is None:
        return []
    return groups.groups if isinstance(groups, ReplicaGroups) else None


def participant_groups(instr: HloInstruction, counts: DeviceCounts) -> list[list[int]] | None:
    """Every group's participants in rank order, None when the module does not determine them.

    The ids are replica ids in the cross-replica mode and global device ids in the two modes
    with a channel, so the result can address new collectives of the cross-replica mode or the
    flattened-id mode respectively.
    """
    mode = group_mode(instr)
    groups = written_groups(instr)
    if groups is None:
        return None
    if not groups:
        if mode is GroupMode.FLATTENED_ID or counts.replicas is None:
            return None
        groups = [list(range(counts.replicas))]
    if mode is not GroupMode.CROSS_REPLICA_AND_PARTITION:
        return groups
    if counts.partitions is None:
        return None
    return [[replica * counts.partitions + partition for replica in group for partition in range(counts.partitions)]
            for group in groups]


def uniform_group_size(groups: list[list[int]]) -> int | None:
    """The size every group has; None when they differ (XLA allows that for all-reduce only)."""
    sizes = {len(group) for group in groups}
    return sizes.pop() if len(sizes) == 1 else None


def parse_mesh(text: str) -> tuple[int, int]:
    """`"2x4"` -> (2, 4): rows x columns, each at least 1 (ValueError otherwise)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*x\s*([0-9]+)\s*", text)  # ASCII digits only, as in XLA's flags
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"mesh {text!r} is not ROWSxCOLUMNS with positive sizes, e.g. mesh=2x4")
    return int(match.group(1)), int(match.group(2))


def mesh_rows_and_columns(groups: list[list[int]], rows: int, columns: int) -> tuple[list[list[int]], list[list[int]]]:
    """Lay every group out row-major as a rows x columns mesh; return all rows and all columns.

    Device k of a group sits at (k // columns, k % columns). A device's rank in its row is its
    column index, so after a reduce-scatter within rows every device of a column holds the same
    shard, which is what lets an all-reduce within columns finish the reduction of that shard.
    """
    if any(len(group) != rows * columns for group in groups):
        raise ValueError(f"groups of sizes {sorted({len(g) for g in groups})} do not form a {rows}x{columns} mesh")
    row_groups = [group[r * columns:(r + 1) * columns] for group in groups for r in range(rows)]
    column_groups = [group[c::columns] for group in groups for c in range(columns)]
    return row_groups, column_groups
