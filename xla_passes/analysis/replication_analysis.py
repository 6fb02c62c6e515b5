"""Which values of a computation are the same on every device of each replica group.

Weight-update sharding may compute a value on a slice and all-gather the slices only
when every device of the group holds the same full value: the all-gather puts device
k's slice at position k, so a value that differs between devices would come back as a
patchwork. This module answers that question for one computation and one set of
groups (the groups of the gradient all-reduce), the way XLA's HloReplicationAnalysis
does, with what the text of a module says about its parameters:

* entry parameters: `parameter_replication={true}` (replica programs), `sharding=`
  (partitioned programs: devices holding the same tile hold the same value);
* parameters of a Shardy manual-computation body (`shard_map`): the operand's
  `xla.sdy.in_shardings` entry and the mesh in the module's `xla.sdy.meshes`: a value
  split over a mesh axis differs along that axis;
* parameters of a computation called by one `call`: what that caller passes.

A device-dependent source (replica-id, partition-id, rng, infeed, recv) makes a value
differ; an all-reduce or all-gather over groups that contain each of ours makes it the
same; everything else is the same when all its operands are. The dataflow engine
(`xla_passes.analysis.dataflow`) follows values leaf by leaf through tuples and into calls,
loops and conditionals, as XLA's analysis does: a loop's carried value is the same where
its init and the body keep it so and every device runs the same trips.
"""
from __future__ import annotations

import re

from hlo_tools import HloComputation, HloInstruction
from hlo_tools.ir import sdy
from hlo_tools.ir.attributes import Sharding

from .dataflow import ForwardDataflow, ForwardLattice
from .replica_groups import DeviceCounts, GroupMode, group_mode, participant_groups

# Instructions whose result may differ between devices whatever their operands.
DEVICE_DEPENDENT = frozenset({
    "replica-id", "partition-id", "rng", "rng-bit-generator", "rng-get-and-update-state", "infeed",
    "recv", "recv-done", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
    "collective-permute-start", "collective-permute-done", "collective-broadcast",
})
_DEVICE_DEPENDENT_WORDS = tuple(sorted(DEVICE_DEPENDENT))
_GROUP_UNIFORM_COLLECTIVES = frozenset({"all-reduce", "all-gather"})

# The kind of `ReplicationAnalysis` in a `PassContext`'s cache (`cached_replication_analysis`).
REPLICATION = "replication"

REPLICA_IDS = "replica"   # groups of replica ids (cross-replica collectives)
DEVICE_IDS = "device"     # groups of global device ids (collectives with a channel)


def participants(instr: HloInstruction) -> tuple[str, list[list[int]]] | None:
    """(REPLICA_IDS or DEVICE_IDS, the groups' members in rank order) of an all-reduce,
    all-gather or reduce-scatter; None when the module does not say enough."""
    groups = participant_groups(instr, DeviceCounts.of(instr.parent.parent))
    if groups is None:
        return None
    return (REPLICA_IDS if group_mode(instr) is GroupMode.CROSS_REPLICA else DEVICE_IDS), groups


def groups_within(inner: list[list[int]], outer: list[list[int]]) -> bool:
    """Whether every group of `inner` lies inside one group of `outer`."""
    where = {device: index for index, group in enumerate(outer) for device in group}
    return all(len({where.get(device, -1 - device) for device in group}) == 1 for group in inner)


class ReplicationAnalysis(ForwardLattice):
    """For each instruction of `comp`: is its value the same on all devices of each group?

    `groups` are the groups that the question is about, in the ids of `space` (REPLICA_IDS
    or DEVICE_IDS, as `participants` returns them).
    `assume_replicated_parameters` takes every parameter as replicated, whatever its
    annotations say: data-parallel programs written with pmap receive their weights
    split along the device axis although every device holds the same copy.

    A client of `ForwardDataflow` whose leaf state is whether the value is replicated: the
    engine follows values through tuples and into the computations of calls, loops and
    conditionals (where what a device-dependent body computes may still be the same everywhere).
    """

    def __init__(self, comp: HloComputation, groups: list[list[int]], space: str, *,
                 assume_replicated_parameters: bool = False):
        self.comp = comp
        self.module = comp.parent
        self.groups = groups
        self.space = space
        self.assume_replicated_parameters = assume_replicated_parameters
        self._pure_computations: dict[HloComputation, bool] = {}
        self._callers: list[HloInstruction] | None = None
        self._caller_analysis: ReplicationAnalysis | None = None
        self._dataflow = ForwardDataflow(self, comp)

    def is_replicated(self, instr: HloInstruction) -> bool:
        """True when every leaf of `instr`'s value is the same on the devices of each group."""
        return _all_leaves(self._dataflow.value(instr))

    # -- the lattice: True (the same on each group's devices) joins False (may differ) to False ----
    def join(self, a: bool, b: bool) -> bool:
        return a and b

    def transfer(self, instr: HloInstruction, operands: list) -> bool:
        opcode = instr.opcode
        if opcode in ("constant", "iota"):
            return True
        if opcode in DEVICE_DEPENDENT:
            return False
        if opcode in _GROUP_UNIFORM_COLLECTIVES and self._covers_our_groups(instr):
            return True
        if any(not self._pure(callee) for callee in instr.called_computations):
            return False
        return all(_all_leaves(o) for o in operands)

    def descends(self, instr: HloInstruction, operands: list) -> bool:
        """Into calls, loops and conditionals only where `transfer` cannot tell: some operand
        differs, or a callee holds a device-dependent instruction (a body that names none is
        the same everywhere for the same operands, and stays unparsed when it is)."""
        return instr.opcode != "fusion" and not (
            all(_all_leaves(o) for o in operands) and all(self._pure(c) for c in instr.called_computations))

    def through_control(self, result, control):
        """Devices that disagree on a predicate or a loop condition take different paths."""
        return result if _all_leaves(control) else False

    def _covers_our_groups(self, collective: HloInstruction) -> bool:
        theirs = participants(collective)
        return theirs is not None and theirs[0] == self.space and groups_within(self.groups, theirs[1])

    def _pure(self, comp: HloComputation) -> bool:
        """Whether `comp` (and what it calls) gives every device the same result for the same
        operands: it has no device-dependent instruction."""
        if not comp.may_contain_text(_DEVICE_DEPENDENT_WORDS):
            return True  # a body left unparsed (a fusion, at JAX's hook) that names none of them
        if comp not in self._pure_computations:
            self._pure_computations[comp] = True  # recursion guard
            self._pure_computations[comp] = all(
                i.opcode not in DEVICE_DEPENDENT and all(self._pure(c) for c in i.called_computations)
                for i in comp.instructions)
        return self._pure_computations[comp]

    # -- where the parameters of `comp` start ----------------------------------------------------
    def parameter(self, param: HloInstruction):
        if self.assume_replicated_parameters:
            return True
        comp = self.comp
        if comp.is_entry:
            return self._entry_parameter(param)
        if self._callers is None:  # read lazily: finding them parses every body of a lazily parsed module
            self._callers = self.module.callers_of(comp)
        if len(self._callers) == 1 and self._callers[0].opcode == "call":
            return self._called_parameter(self._callers[0], param.parameter_number)
        return False

    def _entry_parameter(self, param: HloInstruction):
        replication = param.attrs.get("parameter_replication")
        if replication is not None and self.space == REPLICA_IDS:
            flags = [part.strip() == "true" for part in str(replication).strip("{}").split(",")]
            elements = param.shape.tuple_shapes if param.shape.is_tuple else None
            if elements is not None and len(elements) == len(flags) and not any(e.is_tuple for e in elements):
                return tuple(flags)
            return all(flags)
        sharding = param.attrs.get("sharding")
        if isinstance(sharding, Sharding) and self.space == DEVICE_IDS:
            return _sharding_replicated(sharding, self.groups)
        return False

    def _called_parameter(self, call: HloInstruction, number: int):
        """A body parameter: a Shardy manual-computation operand, or what the caller passes."""
        operand = call.operand(number)
        if operand.opcode == "get-tuple-element" and _is_global_to_local(operand.operand(0)):
            return self._manual_operand(operand.operand(0), operand.attrs["index"])
        if self._caller_analysis is None:
            self._caller_analysis = ReplicationAnalysis(call.parent, self.groups, self.space)
        return self._caller_analysis._dataflow.value(operand)

    def _manual_operand(self, global_to_local: HloInstruction, index: int) -> bool:
        """A shard_map operand is the same on devices that agree on every axis that splits it."""
        if self.space != DEVICE_IDS:
            return False
        attributes = global_to_local.attrs.get("frontend_attributes")
        in_shardings = attributes.get("xla.sdy.in_shardings") if attributes is not None else None
        module_attributes = self.module.attrs.get("frontend_attributes")
        meshes = module_attributes.get("xla.sdy.meshes") if module_attributes is not None else None
        if in_shardings is None or meshes is None:
            return False
        values = sdy.values(in_shardings)
        if index >= len(values):
            return False
        mesh = sdy.meshes(meshes).get(values[index].mesh)
        if mesh is None:
            return False
        axis_names, coordinates = mesh.axes, mesh.coordinates
        # Every axis named, a sub-axis's whole axis too: devices that differ on it may differ.
        split_axes = set(re.findall(r'"(\w+)"', values[index].dims_text))
        split_axes |= set(re.findall(r'"(\w+)"', values[index].rest.partition("unreduced")[2]))
        if not split_axes <= set(axis_names):
            return False
        which = [axis_names.index(a) for a in sorted(split_axes)]
        for group in self.groups:
            if any(device not in coordinates for device in group):
                return False
            if len({tuple(coordinates[device][i] for i in which) for device in group}) != 1:
                return False
        return True


def cached_replication_analysis(context, comp: HloComputation, groups: list[list[int]], space: str, *,
                                assume_replicated_parameters: bool = False) -> ReplicationAnalysis:
    """`ReplicationAnalysis(comp, groups, space, ...)` from the `PassContext` of a pass run, computed
    once while the module stays as it is (the pipeline drops it after a pass that changes the module)."""
    key = (REPLICATION, id(comp), space, tuple(map(tuple, groups)), assume_replicated_parameters)
    return context.analysis(key, lambda: ReplicationAnalysis(
        comp, groups, space, assume_replicated_parameters=assume_replicated_parameters))


def _is_global_to_local(instr: HloInstruction) -> bool:
    return instr.opcode == "custom-call" and instr.attrs.get("custom_call_target") == "xla.sdy.GlobalToLocalShape"


def _sharding_replicated(sharding: Sharding, groups: list[list[int]]):
    """Whether devices of each group hold the same tile of a parameter with this sharding."""
    if sharding.kind == "tuple":
        return tuple(_sharding_replicated(element, groups) for element in sharding.elements)
    if sharding.kind == "replicated":
        return True
    if sharding.kind != "tiled" or sharding.last_tile_dims:
        return False
    devices = sharding.device_list()
    copies = sharding.tile_dims[-1] if sharding.last_tile_dim_replicate else 1
    tile_of = {device: position // copies for position, device in enumerate(devices)}
    return all(len({tile_of.get(device, -1 - device) for device in group}) == 1 for group in groups)


def _all_leaves(value) -> bool:
    if isinstance(value, tuple):
        return all(_all_leaves(v) for v in value)
    return bool(value)
