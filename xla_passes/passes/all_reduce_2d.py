"""`all-reduce-2d{mesh=RxC}`: the 2-D torus all-reduce of the TPU-pod papers.

A ring all-reduce over N devices takes N-1 steps in each phase; on a 2-D torus the TPU-v3 pod
work (arXiv 1909.09756, 2011.03641) sums gradients in two dimensions instead: reduce-scatter
along one mesh axis, all-reduce of the 1/C-sized shard along the other, all-gather along the
first, so every phase runs on short rings at once. Each group of the all-reduce (R*C devices)
is laid out row-major as an R x C mesh: device k of the group sits at row k // C, column k % C.
With `mesh=2x4` and the group {0,...,7}, rows are {0,1,2,3},{4,5,6,7} and columns
{0,4},{1,5},{2,6},{3,7}::

    ar = f32[16] all-reduce(p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}},
        use_global_device_ids=true, to_apply=add
  =>
    ar.reduce-scatter = f32[4]{0} reduce-scatter(p), channel_id=2,
        replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=add
    ar.all-reduce = f32[4]{0} all-reduce(ar.reduce-scatter), channel_id=3,
        replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=add
    ar.all-gather = f32[16]{0} all-gather(ar.all-reduce), channel_id=4,
        replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true

After the reduce-scatter, the device in column c holds shard c of its row's sum; every device
of column c holds shard c, so the all-reduce within columns completes shard c's sum, and the
all-gather within rows puts the shards back together. Flattening, padding (to a multiple of C)
and tuple all-reduces work as in `all-reduce-decomposer`, which also lists the all-reduces left
alone (async forms, control dependencies, ...).

The new groups are derived from the participants (see `xla_passes.analysis.replica_groups`):
  * no channel_id (replica programs): groups of replica ids, and the new collectives have no
    channel_id either; empty `replica_groups={}` means all `replica_count` replicas;
  * channel_id with use_global_device_ids=true: groups of global device ids, kept so;
  * channel_id without use_global_device_ids: the groups name replicas and every partition of
    them takes part; their devices (replica-major, from the header's `num_partitions`) become
    global-device-id groups of new flattened-id collectives.

An all-reduce whose groups do not have R*C devices each (or whose participants the module
does not determine) is left unchanged, and the report says why, or with `strict=true` is an
error naming it. With C = 1 the rows are single devices and the all-reduce already is the
column reduction: unchanged too. When every all-reduce was left alone, the report's last line
says `unchanged:` and why, which xla-opt and the JAX adapters show (`Pipeline.refusals`).

The physical form, `all-reduce-2d{mesh=RxC,failed=r:c;r:c}` or `all-reduce-2d{torus=RxC}`
(wrap-around links; `failed=` optional): the machine has failed chips, and the all-reduce, over
one group of all its healthy chips (device i is the i-th healthy chip row-major), becomes a
pipelined reduce-and-broadcast on a spanning tree of physical links, `collective-permute`s
between neighbours only (`xla_passes.rewrites.reduction_tree` has the algorithm and its cost). What
it leaves alone, and why, is in the pass's report (`xla-opt --report`); with `strict=true` that
is an error naming the all-reduce. Healthy chips that the failed ones cut apart have no route.
"""
from __future__ import annotations

from hlo_tools import HloModule, ReplicaGroups
from hlo_tools.inspection.topology import Topology

from ..analysis.replica_groups import (DeviceCounts, GroupMode, group_mode, mesh_rows_and_columns, parse_mesh,
                                      participant_groups)
from ..analysis.topology_fit import REPLICAS, all_reduce_misfit, permute_space
from ..core import HloPass, register_pass
from ..rewrites.all_reduce import Addressing, decomposable_all_reduces, replace_by_shard_reduction
from ..rewrites.channel_ids import ChannelIds
from ..rewrites.reduction_tree import ReductionTree, TreeAllReduceBuilder


@register_pass
class AllReduce2D(HloPass):
    """Rewrite all-reduce over RxC devices as rows, columns, rows; with failed chips or a torus, over physical links."""

    name = "all-reduce-2d"
    opcodes = {"all-reduce"}
    mesh: str = ""
    torus: str = ""
    failed: str = ""
    min_bytes: int = 0
    strict: bool = False

    def __post_init__(self):
        # A bad mesh, torus or failed chip fails when the pass is built, not when it runs.
        self.report: list[str] = []
        self._machine = self._physical_machine()
        self._tree, self._unroutable = None, ""
        if self._machine is not None and self._machine.num_devices > 1:
            try:
                self._tree = ReductionTree.of(self._machine)
            except ValueError as exc:  # every all-reduce it could have rewritten says why not
                self._unroutable = str(exc)

    def _physical_machine(self) -> Topology | None:
        """The machine the physical form routes on; None for the logical form (`mesh=` alone)."""
        if bool(self.mesh) == bool(self.torus):
            raise ValueError("give one of mesh=RxC and torus=RxC")
        if self.mesh:
            rows, columns = parse_mesh(self.mesh)
            return Topology.parse(f"mesh:{rows}x{columns}", self.failed) if self.failed else None
        return Topology.parse(f"torus:{self.torus.strip()}", self.failed)

    def run(self, module: HloModule) -> bool:
        self.report = []
        if self._machine is not None:
            return self._run_physical(module)
        rows, columns = parse_mesh(self.mesh)
        counts = DeviceCounts.of(module)
        channel_ids = ChannelIds(module)
        changed = False
        for all_reduce in decomposable_all_reduces(module, self.min_bytes):
            groups = participant_groups(all_reduce, counts)
            if groups is None or any(len(group) != rows * columns for group in groups):
                problem = self._misfit(groups, rows, columns)
                if self.strict:
                    raise self.fail(problem, all_reduce)
                self.report.append(f"%{all_reduce.name} left alone: {problem}")
                continue
            if columns == 1:
                continue
            row_groups, column_groups = mesh_rows_and_columns(groups, rows, columns)
            mode = GroupMode.CROSS_REPLICA if group_mode(all_reduce) is GroupMode.CROSS_REPLICA \
                else GroupMode.FLATTENED_ID
            within_rows = Addressing(ReplicaGroups.of(row_groups), mode)
            within_columns = Addressing(ReplicaGroups.of(column_groups), mode) if rows > 1 else None
            replace_by_shard_reduction(all_reduce, columns, within_rows, within_columns, channel_ids)
            changed = True
        return self._refused_unless(changed)

    def _run_physical(self, module: HloModule) -> bool:
        if self._machine.num_devices == 1:  # one healthy chip: nothing to send anywhere
            return False
        counts = DeviceCounts.of(module)
        channel_ids = ChannelIds(module)
        changed = False
        for all_reduce in decomposable_all_reduces(module, self.min_bytes):
            problem = self._unroutable or all_reduce_misfit(all_reduce, self._machine, counts)
            if problem:
                if self.strict:
                    raise self.fail(problem, all_reduce)
                self.report.append(f"%{all_reduce.name} left alone: {problem}")
                continue
            name, tree = all_reduce.name, self._tree
            by_replica = permute_space(all_reduce, counts) == REPLICAS
            schedule = TreeAllReduceBuilder(all_reduce, tree, channel_ids, by_replica=by_replica).replace()
            root = "{}:{}".format(*self._machine.coordinate(tree.root))
            self.report.append(
                f"%{name}: tree of depth {tree.height} rooted at chip {root} (device {tree.root}), "
                f"{schedule.chunks} chunks, {schedule.rounds} rounds, {len(schedule.permutes())} collective-permutes")
            changed = True
        return self._refused_unless(changed)

    def _refused_unless(self, changed: bool) -> bool:
        """`changed`; when nothing changed because the all-reduces were left alone, the report
        ends with `unchanged:` and why."""
        if not changed and self.report:
            more = len(self.report) - 1
            self.report.append(f"unchanged: {self.report[0]}" + (f" (and {more} more)" if more else ""))
        return changed

    @staticmethod
    def _misfit(groups, rows: int, columns: int) -> str:
        if groups is None:
            return ("the participants are not known: empty replica_groups, or a channel_id without "
                    "use_global_device_ids, need replica_count/num_partitions in the module header")
        sizes = ", ".join(str(size) for size in sorted({len(group) for group in groups}))
        return f"groups of {sizes} devices do not form a {rows}x{columns} mesh ({rows * columns} devices)"
