"""`distributed-batch-norm{group_size=k}`: batch-norm statistics over groups of k replicas.

The distributed batch norm of the ResNet-50 and EfficientNet pod runs (arXiv 1811.06992): in a
data-parallel step each replica normalises with the mean and variance of its own examples; with
this pass every group of k consecutive replicas along the batch axis shares them, as if the group's
examples were one batch. The pass works on a per-device program before XLA's optimizations: JAX's
lowering of a `shard_map` (or pmap-style) step, where `jnp.mean` is a reduce and a divide by the
element count (`xla_passes.jax.jit(step, passes="distributed-batch-norm{group_size=2}")`,
`xla-opt` on `hlo-tools dump`'s modules), or a replica program whose batch parameters are named
with `batch_parameters=`.

Forward, each statistic's local sum is summed over the group and divided by k times the count;
backward, the gradient through each statistic's mean (JAX's transpose of the divide, broadcast
back over the batch) is summed over the group the same way, which is what JAX's own transpose of
`lax.pmean(..., axis_name)` inside `nn.BatchNorm(axis_name=...)` does::

    s    = f32[4] reduce(x, zero), dimensions={0,1,2}, to_apply=add       x: f32[2,6,6,4], per device
    mean = f32[4] divide(s, f32[4] broadcast(f32[] constant(72)))
    ...
    ct   = f32[4] divide(g, f32[4] broadcast(f32[] constant(72)))        g: gradient of the mean
    ctx  = f32[2,6,6,4] broadcast(ct), dimensions={3}
                                  =>
    s.group  = f32[4] all-reduce(s), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}},
               use_global_device_ids=true, to_apply=add
    mean     = f32[4] divide(s.group, f32[4] broadcast(f32[] constant(144)))
    g.group  = f32[4] all-reduce(g), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, ...
    ct       = f32[4] divide(g.group, f32[4] broadcast(f32[] constant(144)))

How the reductions are identified (one line each in `report`; docs/distributed_batch_norm.md):

* the batch: the per-device batch is the dimension of a `shard_map` operand that its
  `in_shardings` split over one mesh axis (the groups are k consecutive positions along that
  axis), or dimension 0 of the entry parameters `batch_parameters=` names in a replica program
  (the groups are k consecutive replicas); every value's batch dimension is followed through the
  program (elementwise ops, broadcast, reshape, transpose, convolution, dot, reduce, gather,
  scatter, slicing and pooling that leave the batch alone, calls);
* a statistic is a `reduce` with an add reducer and a zero init of a floating-point value, over
  dimensions that include the batch, whose sum (through reshapes of unit dimensions only) is
  divided by exactly the number of elements it summed (a constant expression; or multiplied by
  its reciprocal), keeps at least one dimension (per-feature statistics; a scalar mean is a loss),
  and whose mean flows back into per-example values (the normalisation);
* a statistic's gradient is a divide by the same count whose result, through reshapes of unit
  dimensions (and sums over dimensions of size 1), is broadcast back over the same dimensions of
  an activation of the same shape; per (shape, dimensions, count) there may be no more gradients
  than statistics (a backward sum of the form reduce -> divide -> broadcast, the gradient of a
  centring, reads as a statistic and is grouped the same way either way);
* soundness: every other value that sums over the batch (reduce, dot, convolution) must reach the
  examples only through a grouped divide; otherwise a statistic or a gradient went unrecognised
  and the module is left unchanged, naming that sum.

Left alone, with the reason in the report: sums over the batch that are not divided by their
element count (parameter gradients, the bias and scale gradients of batch norm, which the step's
own all-reduce averages over every replica), scalar means (the loss), means that do not flow back
into the examples, non-add reducers. The module is refused (unchanged, the reason in the report)
by the soundness check, when a statistic is already all-reduced across devices (batch norm with
`axis_name`; all-reduces over single devices do not count), when it cannot pair gradients with
statistics, when a called computation reduces over the batch (run `call-inliner` first), when the
batch is split over several mesh axes, when the module holds `batch-norm-training`/`-grad`
instructions.

At JAX's compile hook the module is fused and simplified; there the pass inlines the fusions and
groups every sum over the batch whose readers it proves read it as a mean (`_hook_plan`). Statistics
XLA's partitioner sums over the whole batch axis (a `jit` step with a sharded batch, Keras's
DataParallel, or spatial-partitioning's split of the batch) are regrouped, and what leaves the
groups is averaged over them; a `jax.pmap` step's `BatchNorm(axis_name=...)` sums are regrouped
too, each device keeping its outputs, which are proven to be means. With one example per device
XLA drops the batch dimension, and only those sums over the devices are grouped. Where the
rewrites lie between XLA's fusions (an all-reduce of the partitioner, a fusion whose value is a
device's own sum, a value a fusion computes, which then gets a loop fusion of its own), they are
made on XLA's fused module, whose fusions stay (`_Plan.onto`); otherwise the inlined module is
handed back, each instruction in a fusion of its own.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from fractions import Fraction

import numpy as np

import hlo_tools
from hlo_tools.ir import sdy
from hlo_tools import HloComputation, HloInstruction, HloModule, Literal, ReplicaGroups, Shape, Sharding
from hlo_tools.ir.opcodes import ELEMENTWISE
from hlo_tools.ir.shape import FLOAT_DTYPES

from ..analysis.collectives import reducer_opcode
from ..analysis.constants import UNIT_SHAPE_OPS, folded_scalar_constant
from ..analysis.dataflow import BackwardDataflow, BackwardLattice, ForwardDataflow, ForwardLattice
from ..core import HloPass, register_pass, restore
from ..rewrites.channel_ids import ChannelIds
from ..rewrites.cse import eliminate_common_subexpressions
from ..rewrites.inlining import inline_fusions, wrap_in_fusions

OPAQUE = -1  # a per-example value whose batch dimension the analysis cannot name
WHOLE = -2   # one example per device: the value is that example's, wherever its unit batch dimension went


class Refusal(Exception):
    """The module cannot be rewritten safely; the message says why."""


class NoBatch(Refusal):
    """The module has no per-device batch (a jit of initializers, say): nothing for the pass."""


@dataclasses.dataclass
class _Statistic:
    reduce: HloInstruction
    divide: HloInstruction   # the mean: divide(sum, count) or multiply(sum, 1/count)
    signature: tuple
    count: int


@dataclasses.dataclass
class _Gradient:
    divide: HloInstruction
    broadcast: HloInstruction
    signature: tuple
    count: int


@dataclasses.dataclass
class _BatchSum:
    """At JAX's hook: a sum over the batch that flows back into the examples."""
    value: HloInstruction    # what the program reads: the device's own sum, or its all-reduce over the batch axis
    local: HloInstruction    # the device's own sum
    count: int               # the elements `value` sums
    backward: bool           # a sum of JAX's backward pass
    reducer: HloComputation  # an add computation of its type
    scale: int = 1           # the devices of the batch axis when `value` is all-reduced over it


@dataclasses.dataclass
class _Target:
    comp: HloComputation
    params: dict[int, int]        # parameter number -> its batch dimension
    groups: list[list[int]]       # the new groups (device ids, or replica ids)
    mode: str                     # "devices" (flattened ids) or "replicas"
    axis: list[list[int]]         # the devices along the batch axis, a line for each position on the other axes
    partitioned: bool = False     # the entry of an SPMD-partitioned program (JAX's hook)
    per_device: bool = False      # a pmap step: its outputs are each device's own


@register_pass
class DistributedBatchNorm(HloPass):
    """Batch-norm statistics (and their gradients) over groups of k replicas instead of each replica's own batch."""

    name = "distributed-batch-norm"
    opcodes = {"reduce"}
    group_size: int = 0
    groups: str = ""            # positions along the batch axis, e.g. 0:1;2:3;4:5;6:7
    batch_parameters: str = ""  # replica programs: entry parameter numbers whose dimension 0 is the batch

    def __post_init__(self):
        self.report: list[str] = []
        if self.group_size and self.groups:
            raise ValueError("give one of group_size=k and groups=a:b;c:d")
        if not self.group_size and not self.groups:
            raise ValueError("give group_size=k or groups=a:b;c:d (positions along the batch axis)")
        self._explicit = _parse_groups(self.groups) if self.groups else None
        try:
            self._batch_numbers = [int(x) for x in re.split(r"[\s:;]+", self.batch_parameters.strip()) if x]
        except ValueError:
            raise ValueError(f"batch_parameters={self.batch_parameters!r} is not parameter numbers "
                             f"separated by ':'") from None

    # -- driver ------------------------------------------------------------------------------------

    def run(self, module: HloModule) -> bool:
        self.report = []
        original = None
        if any(i.opcode == "fusion" for i in module.entry.instructions):
            # JAX's compile hook: XLA has fused the module, so a statistic's sum, its divide and its
            # gradient sit in different fusions (each recomputing shared producers). Inlined and
            # deduplicated, the dataflow is whole again.
            original = module.to_text()
            origins, merged = {}, {}
            inline_fusions(module.entry, origins)
            between = {instr.name: instr for instr in module.entry.instructions if instr not in origins}
            eliminate_common_subexpressions(module.entry, merged)
            module.entry.remove_dead_code()
            twins = _Twins(origins, between, merged)
        try:
            targets = self._targets(module)
            plans = [self._hook_plan(module, t) if t.partitioned else self._plan(module, t) for t in targets]
        except Refusal as exc:
            self.report.append(f"{'not applicable' if isinstance(exc, NoBatch) else 'unchanged'}: {exc}")
            plans = []
        if original is not None and self._apply_to_fused(module, original, plans, twins):
            return True
        changed = False
        channel_ids = ChannelIds(module)
        for plan in plans:
            changed |= plan.apply(module, channel_ids)
        if changed:
            module.entry.remove_dead_code()   # the partitioner's all-reduces the groups' sums replace
        if original is not None:
            if changed:
                wrap_in_fusions(module.entry)
                self.report.insert(0, "the module was fused (JAX's compile hook): its fusions are inlined so that "
                                      "each statistic meets its gradient, and each instruction is then wrapped in a "
                                      "fusion of its own, as XLA's CPU runtime needs")
            else:
                restore(module, original)
        return changed

    def _apply_to_fused(self, module: HloModule, original: str, plans: list["_Plan"], twins: "_Twins") -> bool:
        """Apply the plans of the inlined module to XLA's fused one, keeping its fusions, when they
        touch only what lies between fusions: in a jit step the sums to regroup are the all-reduces
        XLA's partitioner put there, and what leaves the groups is an output, or a value a fusion
        computes linearly from operands of the fusion that vary with the groups. Those operands
        then become their means over the groups for the whole fusion, whose other readers of them
        are linear too or leave the groups themselves, and nothing in it flows back into the
        examples. Otherwise the pass keeps the inlined module."""
        fused = hlo_tools.parse_module(original)
        mapped = [_Plan.onto(plan, fused.entry, twins) for plan in plans]
        if not plans or None in mapped:
            return False
        channel_ids = ChannelIds(fused)
        if not any([plan.apply(fused, channel_ids) for plan in mapped]):
            return False
        fused.entry.remove_dead_code()   # the partitioner's all-reduces the groups' sums replace
        fused.remove_dead_computations()   # the fused computations of fusions copied with a mean read in
        wrap_in_fusions(fused.entry)     # the group sums' scaling: each in a fusion of its own
        restore(module, fused.to_text())
        where = ("at the all-reduces between XLA's fusions" if any(s.scale > 1 for plan in mapped for s in plan.sums)
                 else "after XLA's fusions that compute each device's sums")
        self.report.insert(0, f"the module was fused (JAX's compile hook): its fusions are inlined to find the "
                              f"statistics; the rewrite is {where}, which stay")
        return True

    def _targets(self, module: HloModule):
        """(computation, {parameter number: batch dim}, device groups, 'devices'|'replicas') to rewrite."""
        if any(i.opcode in ("batch-norm-training", "batch-norm-grad") for i in module.instructions()):
            raise Refusal("the module has batch-norm-training/batch-norm-grad instructions (TF's FusedBatchNorm); "
                          "only batch norm written as reduce and divide is handled")
        targets = []
        for call in module.entry.instructions:
            found = self._shard_map_body(module, call)
            if found is not None:
                targets.append(found)
        if targets and self._batch_numbers:
            raise Refusal("batch_parameters= is for replica and pmap programs; this module is a shard_map program")
        if not targets:
            found = self._partitioned_entry(module)
            if found is not None:
                targets.append(found)
        if not targets:
            if not self._batch_numbers:
                raise NoBatch("no per-device batch: no shard_map operand and no entry parameter is split over "
                              "the devices; in a replica program name the batch parameters with batch_parameters=")
            replicas = module.attrs.get("replica_count")
            if replicas is None:
                raise Refusal("batch_parameters= needs the module's replica_count")
            entry = module.entry
            for number in self._batch_numbers:
                if number >= entry.num_parameters or entry.parameter(number).shape.is_tuple:
                    raise Refusal(f"batch_parameters: the entry has no array parameter {number}")
            groups = self._position_groups(int(replicas))
            targets.append(_Target(entry, {n: 0 for n in self._batch_numbers}, groups, "replicas",
                                   [list(range(int(replicas)))]))
        return targets

    def _position_groups(self, size: int) -> list[list[int]]:
        if self._explicit is not None:
            flat = sorted(p for g in self._explicit for p in g)
            if flat != list(range(size)):
                raise Refusal(f"groups={self.groups} do not cover the {size} positions along the batch axis once each")
            return [list(g) for g in self._explicit]
        k = self.group_size
        if k < 1 or size % k:
            raise Refusal(f"group_size={k} does not divide the {size} devices along the batch axis")
        return [list(range(start, start + k)) for start in range(0, size, k)]

    def _shard_map_body(self, module: HloModule, call: HloInstruction):
        """A Shardy manual computation: its body, the batch dims of its parameters, the device groups."""
        if call.opcode != "call":
            return None
        sources = {}
        for number, operand in enumerate(call.operands):
            if operand.opcode != "get-tuple-element":
                continue
            g2l = operand.operand(0)
            if g2l.opcode != "custom-call" or g2l.attrs.get("custom_call_target") != "xla.sdy.GlobalToLocalShape":
                continue
            attributes = g2l.attrs.get("frontend_attributes")
            in_shardings = attributes.get("xla.sdy.in_shardings") if attributes is not None else None
            values = sdy.values(in_shardings or "")
            index = operand.attrs["index"]
            if index >= len(values):
                raise Refusal(f"cannot read the in_shardings of shard_map operand {index}")
            mesh_name, per_dim = values[index].mesh, sdy.dims(values[index].dims_text)
            if per_dim is None:  # a sub-axis's groups are not the axis's: the statistics would mix
                raise Refusal(f"shard_map operand {index} is split by something else than whole mesh axes "
                              f"(a sub-axis, an open dimension or a priority): {values[index].dims_text}")
            split = [(d, axes) for d, axes in enumerate(per_dim) if axes]
            if not split:
                continue
            if len(split) > 1 or len(split[0][1]) > 1:
                raise Refusal(f"shard_map operand {index} is split over several mesh axes or dimensions; only a "
                              f"batch split over one axis is handled")
            sources[number] = (split[0][0], split[0][1][0], mesh_name)
        if not sources:
            return None
        if len({(axis, mesh) for _, axis, mesh in sources.values()}) != 1:
            raise Refusal("shard_map operands are split over different mesh axes")
        _, axis, mesh_name = next(iter(sources.values()))
        attributes = module.attrs.get("frontend_attributes")
        meshes = sdy.meshes(attributes.get("xla.sdy.meshes") or "") if attributes is not None else {}
        if mesh_name not in meshes:
            raise Refusal(f"the module does not define mesh {mesh_name!r}")
        axis_names, coordinates = meshes[mesh_name].axes, meshes[mesh_name].coordinates
        if axis not in axis_names or not coordinates:
            raise Refusal(f"mesh {mesh_name!r} has no axis {axis!r}")
        body = call.attrs["to_apply"]
        if len(module.callers_of(body)) != 1:
            raise Refusal(f"the shard_map body %{body.name} is called more than once")
        lines = _axis_lines(coordinates, axis_names.index(axis))
        return _Target(body, {number: dim for number, (dim, _, _) in sources.items()}, self._device_groups(lines),
                       "devices", lines)

    def _partitioned_entry(self, module: HloModule) -> _Target | None:
        """The entry of an SPMD-partitioned program (JAX's hook): the batch is the dimension that its
        tiled entry parameters split (images and labels of a `jit` with `NamedSharding`, or of a
        `shard_map` whose body XLA has inlined)."""
        entry = module.entry
        split: dict[int, int] = {}
        axes = {}
        for param in entry.parameters:
            sharding = param.attrs.get("sharding")
            if not isinstance(sharding, Sharding) or sharding.kind != "tiled" or sharding.last_tile_dims:
                continue
            data_dims = sharding.tile_dims[:-1] if sharding.last_tile_dim_replicate else sharding.tile_dims
            dims = [d for d, n in enumerate(data_dims) if n > 1]
            if not dims:
                continue
            if len(dims) > 1:
                raise Refusal(f"entry parameter {param.parameter_number} is split over several dimensions; only a "
                              f"batch split over one axis is handled")
            tiles = np.asarray(sharding.device_list()).reshape(sharding.tile_dims)
            coordinates = {int(tiles[index]): index for index in np.ndindex(tiles.shape)}
            axes[param.parameter_number] = _axis_lines(coordinates, dims[0])
            split[param.parameter_number] = dims[0]
        if not split:
            return None
        lines = next(iter(axes.values()))
        self._axis = {frozenset(line) for line in lines}
        if not module.layouts_final and not any(i.opcode == "all-reduce" and self._over_axis(i)
                                                for i in entry.instructions):
            # A per-device program sums over the devices that split its batch; a global one
            # (a jit program before SPMD partitioning) has nothing to sum.
            raise Refusal("a jit program before SPMD partitioning (its sums over the batch are global): "
                          "the pass runs on per-device programs (a shard_map step, JAX's compile hook, or "
                          "spatial-partitioning's split of the batch)")
        if any(other != lines for other in axes.values()):
            raise Refusal("the entry parameters are split over different device axes (a model-parallel weight "
                          "beside the batch?): cannot tell which is the batch; run the pass on JAX's lowering "
                          "with xla_passes.jax.jit")
        per_device = _pmap_style(entry, split)
        if per_device:
            split = self._pmap_examples(entry, split)
        elif self._batch_numbers:
            raise Refusal("batch_parameters= is for replica and pmap programs; this module's sharding splits "
                          "its batch")
        return _Target(entry, split, self._device_groups(lines), "devices", lines, partitioned=True,
                       per_device=per_device)

    def _pmap_examples(self, entry: HloComputation, split: dict[int, int]) -> dict[int, int]:
        """A pmap step maps every argument, weights included, over the devices, a slice each: the
        examples are the leading dimension of the slice in the images (entry parameters that feed the
        input of a forward convolution), or in the parameters `batch_parameters=` names."""
        if self._batch_numbers:
            missing = [n for n in self._batch_numbers if n not in split]
            if missing:
                raise Refusal(f"batch_parameters: entry parameter {missing[0]} is not mapped over the devices")
            chosen = set(self._batch_numbers)
        else:
            chosen = {source.parameter_number for instr in entry.instructions
                      if instr.opcode == "convolution" and not _is_backward(instr)   # a kernel's transpose reads
                      for source in [_image_source(instr.operand(0))]             # weights as its input
                      if source is not None and source.parameter_number in split
                      and source.shape.rank > instr.operand(0).shape.rank}   # a batch of images, and the mapped axis
        if not chosen:
            communicates = any(i.opcode == "all-reduce" and self._over_axis(i) for i in entry.instructions)
            raise (Refusal if communicates else NoBatch)(
                "a pmap step (every argument mapped over the devices) with no entry parameter feeding a "
                "convolution's input: name its batch parameters with batch_parameters=")
        return {n: 1 if split[n] == 0 else 0 for n in sorted(chosen)}

    def _device_groups(self, lines: list[list[int]]) -> list[list[int]]:
        positions = self._position_groups(len(lines[0]))
        return sorted([line[p] for p in group] for line in lines for group in positions)

    # -- analysis ----------------------------------------------------------------------------------

    def _plan(self, module, target: _Target) -> "_Plan":
        comp, groups = target.comp, target.groups
        info = _BatchDims(module).analyse(comp, target.params)
        k = len(groups[0])
        if any(len(g) != k for g in groups):
            raise Refusal("the groups are not all of the same size")
        self._kept_means: dict[tuple, HloInstruction] = {}
        statistics: list[_Statistic] = []
        # a mean passed on in a tuple beside examples counts as flowing back
        reaching = BackwardDataflow(_ReachesExamples(lambda user, _: not _none(info.get(user))), comp)
        for instr in comp.instructions:
            if instr.opcode == "reduce":
                stat = self._statistic(instr, info, reaching)
                if stat is not None:
                    statistics.append(stat)
        lost = [i for i in comp.instructions if i.opcode == "reduce" and info.get(i.operand(0)) == OPAQUE]
        if lost:
            raise Refusal(f"the analysis lost the batch dimension of what %{lost[0].name} reduces (through "
                          f"%{lost[0].operand(0).name}), so it cannot tell whether it is a statistic")
        means = {s.divide for s in statistics}
        for stat in statistics:
            if "all-reduce" in _reaches(stat.divide, info, means):
                raise Refusal(f"the mean of %{stat.reduce.name} is already all-reduced across devices (a batch norm "
                              f"with axis_name, synchronized over the replicas): nothing to group")
        signatures = {s.signature for s in statistics}
        gradients: list[_Gradient] = []
        for instr in comp.instructions:
            if instr.opcode == "broadcast" and info.get(instr.operand(0)) is None:
                found = _gradient(instr, means, signatures | set(self._kept_means))
                if found is not None:
                    gradients.append(found)
        # A sum of JAX's backward pass of the form reduce -> divide -> broadcast (the gradient of a
        # centring, which is a centring) reads as a statistic; it is grouped the same way either way.
        # So: no more gradients than statistics, and none that may belong to a mean left alone.
        for signature in sorted({g.signature for g in gradients}, key=str):
            forward = [st for st in statistics if st.signature == signature]
            backward = [g for g in gradients if g.signature == signature]
            if signature in self._kept_means:
                raise Refusal(f"%{backward[0].divide.name} may be the gradient of the mean of "
                              f"%{self._kept_means[signature].name}, which is not a statistic, over "
                              f"{_describe(signature)}: cannot tell the statistics' gradients from it")
            if len(backward) > len(forward):
                raise Refusal(f"{len(backward)} gradients ({', '.join('%' + g.divide.name for g in backward)}) but "
                              f"{len(forward)} statistics over {_describe(signature)}: cannot pair them")
        # Soundness: every other sum over the batch (and dot or convolution contracting it) reaches the
        # examples only through a grouped divide. A statistic or a gradient that the patterns above
        # miss (a count computed at run time, another form of the gradient) makes the module refused.
        grouped = means | {g.divide for g in gradients}
        own = {st.reduce for st in statistics}
        for instr in comp.instructions:
            if (instr in own or instr.opcode in ("get-tuple-element", "tuple") or not _none(info.get(instr))
                    or all(_none(info.get(o)) for o in instr.operands)):
                continue
            how = _reaches(instr, info, grouped)
            if how:
                raise Refusal(f"%{instr.name} sums over the batch and its result flows back into the examples "
                              f"{'through an all-reduce' if 'all-reduce' in how else 'ungrouped'}: a statistic "
                              f"or a statistic's gradient the pass does not recognise (a mean is a divide by "
                              f"its element count as a constant); grouping the others alone would mix "
                              f"per-replica and per-group statistics")
        if statistics and not gradients:
            self.report.append("no gradient through the statistics: taken as a forward-only program")
        return _Plan(self, statistics, gradients, groups, target.mode, k)

    def _hook_plan(self, module, target: _Target) -> "_Plan":
        """A per-device program after XLA's optimizations (JAX's hook), where its simplifier has folded
        the divides by the count into other constants (`s * 0.0104` for `2 * s / 192`). Every sum over
        the batch that flows back into the examples is a batch statistic or its gradient; it becomes
        the group's sum divided by k, for every reader, which is the group's statistic wherever the
        program reads the sum scaled by 1/count. `_check_means` proves it does."""
        comp = target.comp
        self._axis = {frozenset(line) for line in target.axis}
        analysis = _BatchDims(module, self._over_axis)
        info = analysis.analyse(comp, target.params)
        one_example = analysis.batch_size == 1
        lost = [i for i in comp.instructions if i.opcode == "reduce" and info.get(i.operand(0)) == OPAQUE]
        if lost:
            raise Refusal(f"the analysis lost the batch dimension of what %{lost[0].name} reduces (through "
                          f"%{lost[0].operand(0).name}), so it cannot tell whether it is a statistic")
        sources: dict[HloInstruction, int] = {}   # the devices' own sums over the batch, and their counts
        sums: list[_BatchSum] = []
        for instr in comp.instructions:
            if (instr.opcode in ("get-tuple-element", "tuple") or not _none(info.get(instr))
                    or all(_none(info.get(o)) for o in instr.operands)):
                continue
            how = _reaches(instr, info, set())
            if not how:
                self.report.append(f"%{instr.name}: kept: sums over the batch and does not flow back into the "
                                   f"examples (a gradient, a loss or a total)")
                continue
            if one_example and instr.opcode == "all-reduce":
                continue   # a sum over the devices' examples: _synchronized_sums
            reducer = instr.attrs.get("to_apply")
            if (instr.opcode != "reduce" or instr.shape.is_tuple or instr.shape.dtype not in FLOAT_DTYPES
                    or not isinstance(reducer, HloComputation) or reducer_opcode(reducer) != "add"
                    or folded_scalar_constant(instr.operand(1)) != 0.0):
                raise Refusal(f"%{instr.name} ({instr.opcode}) sums over the batch and flows back into the "
                              f"examples, but is not a floating-point sum: not a statistic the pass can group")
            sources[instr] = math.prod(instr.operand(0).shape.dims[d] for d in instr.attrs.get("dimensions", ()))
            if "direct" in how:
                sums.append(_BatchSum(instr, instr, sources[instr], _is_backward(instr), reducer))
        synchronized = self._synchronized_sums(comp, info, len(target.axis[0]), target.per_device)
        if one_example and not synchronized:
            raise Refusal("one example per device: XLA has dropped its unit batch dimension, and a sum over the "
                          "example's pixels is then the same computation as a per-example pooling; the pass "
                          "groups statistics of one example only where batch norm sums them over the devices "
                          "(a jit step with a sharded batch, jax.pmap with axis_name)")
        if synchronized and sums:
            raise Refusal(f"%{synchronized[0].value.name} sums statistics over the whole batch axis while "
                          f"%{sums[0].value.name} is a device's own: a mix the pass does not group")
        sums += synchronized
        if not sums:
            return _Plan(self, [], [], target.groups, target.mode, len(target.groups[0]))
        leaving = self._leaving_the_groups(comp, info, synchronized, target.per_device) if synchronized else []
        exits = leaving if target.per_device else []
        _check_means(comp, info, sources, sums, self._over_axis, exits,
                     axis_size=len(target.axis[0]) if synchronized else 0)
        if target.per_device:
            self.report.append(f"a pmap step: each device's outputs are its own, so each keeps its group's values; "
                               f"the {len(exits)} values computed from the group statistics that leave them "
                               f"(outputs, or read by what does not flow back into the examples) are means")
            leaving = []
        return _Plan(self, [], [], target.groups, target.mode, len(target.groups[0]), sums, info, leaving,
                     [line for line in target.axis])

    def _synchronized_sums(self, comp: HloComputation, info: dict, axis_size: int,
                           per_device: bool) -> list[_BatchSum]:
        """XLA's partitioner sums a jit program's statistics over the whole batch, and a pmap step's
        `BatchNorm(axis_name=...)` does: all-reduces over the batch axis whose results flow back into
        the examples."""
        found = []
        for instr in comp.instructions:
            if instr.opcode != "all-reduce" or not self._over_axis(instr):
                continue
            elements = ([(instr, instr.operand(0))] if not instr.shape.is_tuple else
                        [(u, instr.operand(u.attrs["index"])) for u in instr.users if u.opcode == "get-tuple-element"])
            for value, local in elements:
                if not _reaches(value, info, set()):
                    continue
                if _in_shard_map(instr) and not per_device:
                    raise Refusal(f"%{instr.name} sums statistics over the whole batch axis in a shard_map step "
                                  f"(batch norm with axis_name): use axis_name=None and let the pass group them")
                if value.shape.dtype not in FLOAT_DTYPES or reducer_opcode(instr.attrs["to_apply"]) != "add":
                    raise Refusal(f"%{instr.name} all-reduces over the batch axis with something other than a "
                                  f"floating-point sum a value that flows back into the examples")
                found.append(_BatchSum(value, local, 0, _is_backward(local), instr.attrs["to_apply"], axis_size))
        return found

    def _leaving_the_groups(self, comp: HloComputation, info: dict, synchronized: list[_BatchSum],
                            per_device: bool = False) -> list:
        """Where values computed from the group statistics leave for the rest of a jit step, which
        needs what JAX's grouped batch norm gives there: the mean over the groups.

        Each group computes with its own statistics, and a backward sum is its group's sum times
        the groups along the axis. A value linear in the backward sums (a gradient, with the
        statistics as coefficients) has as its mean over the groups the grouped step's value; one
        made of the statistics alone (a moving average) has the mean of each group's. So the mean
        is taken where linearity ends: at an output, or on the way into a nonlinear instruction
        that does not flow back into the examples (adam's square of a gradient). Returns
        ("edge", value, reader): `reader` reads the mean of `value`; and ("output", number).

        In a pmap step (`per_device`) every value leaving the groups is returned: each device keeps
        its own, which `_check_means` proves is its group's value."""
        seeds = {s.value: (1 if s.backward else 0) for s in synchronized}
        reaching = _reaching_examples(comp, info)

        linear: dict[HloInstruction, int | None] = dict(seeds)   # the varying values: how they are linear
        leaving = []
        for instr in comp.post_order():
            if instr in seeds or not _none(info.get(instr)) or instr.opcode == "tuple" or (
                    instr.opcode == "all-reduce" and self._over_axis(instr)):
                continue   # per-example values are each device's own, sums of them partial sums; outputs below
            ins = [linear.get(o) if o in linear else 0 for o in instr.operands]
            if not any(o in linear for o in instr.operands):
                continue
            found = _combined_linearity(instr, ins)
            if found is None and not _per_example(instr, info) and not reaching.value(instr):
                varying = [o for o in instr.operands if o in linear]
                if per_device:
                    leaving += [("edge", o, instr) for o in dict.fromkeys(varying)]
                    continue
                if any(linear[o] == 0 for o in varying) or any(linear[o] is None for o in varying):
                    raise Refusal(f"%{instr.name} takes the group statistics out of their groups, not linearly in "
                                  f"the backward sums: the mean of its groups' values is not the grouped step's")
                for operand in dict.fromkeys(varying):   # gradients: the mean before the nonlinear reader
                    if operand.shape.is_tuple or operand.shape.dtype not in FLOAT_DTYPES:
                        raise Refusal(f"%{operand.name} takes the group statistics out of their groups and is not "
                                      f"a floating-point array: its groups' values cannot be averaged")
                    leaving.append(("edge", operand, instr))
                continue
            linear[instr] = found
        root = comp.root
        for number, output in enumerate(root.operands if root.opcode == "tuple" else [root]):
            if output in linear:
                if per_device:
                    leaving.append(("output", number))
                    continue
                if linear[output] is None or output.shape.is_tuple or output.shape.dtype not in FLOAT_DTYPES:
                    raise Refusal(f"output {number} (%{output.name}) is computed from the group statistics and "
                                  f"cannot be averaged over the groups")
                leaving.append(("output", number))
        return leaving

    def _over_axis(self, all_reduce: HloInstruction) -> bool:
        """Whether every group of `all_reduce` holds a whole line of the batch axis."""
        groups = all_reduce.attrs.get("replica_groups")
        return (isinstance(groups, ReplicaGroups) and bool(groups.groups)
                and all(any(line <= set(g) for line in self._axis) for g in groups.groups))

    def _statistic(self, reduce: HloInstruction, info: dict, reaching: BackwardDataflow) -> _Statistic | None:
        """The statistic `reduce` computes, or None (with a report line when it sums over the batch);
        `reaching`: which values flow back into the examples."""
        if reduce.operand_count != 2 or reduce.shape.is_tuple:
            return None
        operand = reduce.operand(0)
        batch = info.get(operand)
        dims = tuple(reduce.attrs.get("dimensions", ()))
        if batch is None or batch == OPAQUE or isinstance(batch, tuple) or batch not in dims:
            if batch == OPAQUE:
                self.report.append(f"%{reduce.name}: kept: reduces a per-example value whose batch dimension "
                                   f"the analysis lost")
            return None
        name = f"%{reduce.name}"
        reducer = reduce.attrs.get("to_apply")
        if not isinstance(reducer, HloComputation) or reducer_opcode(reducer) != "add":
            self.report.append(f"{name}: kept: sums over the batch with a reducer other than add")
            return None
        if reduce.shape.dtype not in FLOAT_DTYPES:
            self.report.append(f"{name}: kept: not floating point")
            return None
        if folded_scalar_constant(reduce.operand(1)) != 0.0:
            self.report.append(f"{name}: kept: its init is not zero")
            return None
        count = math.prod(operand.shape.dims[d] for d in dims)
        kept = [s for i, s in enumerate(operand.shape.dims) if i not in dims and s != 1]
        signature = (tuple(operand.shape.dims), tuple(sorted(dims)), count)
        value = _through_unit_reshapes(reduce)
        if value is None:
            self.report.append(f"{name}: kept: its sum has users besides its mean (not a statistic)")
            return None
        if not _divides_by(value.users[0] if len(value.users) == 1 else None, value, count):
            self.report.append(f"{name}: kept: its sum is not divided by its {count} elements "
                               f"(a gradient or a total, not a mean)")
            return None
        divide = value.users[0]
        if not kept:
            self.report.append(f"{name}: kept: a mean over every dimension (a loss or a global value, "
                               f"not a per-feature statistic)")
            return None
        if not reaching.value(divide):
            self._kept_means[signature] = reduce
            self.report.append(f"{name}: kept: its mean does not flow back into the examples (not a "
                               f"normalisation statistic)")
            return None
        return _Statistic(reduce, divide, signature, count)


@dataclasses.dataclass
class _Plan:
    owner: DistributedBatchNorm
    statistics: list[_Statistic]
    gradients: list[_Gradient]
    groups: list[list[int]]
    mode: str
    k: int
    sums: list[_BatchSum] = dataclasses.field(default_factory=list)   # at JAX's hook
    info: dict = dataclasses.field(default_factory=dict)              # the batch dimensions, at JAX's hook
    leaving: list = dataclasses.field(default_factory=list)           # values averaged over the groups
    axis: list[list[int]] = dataclasses.field(default_factory=list)   # the devices along the batch axis
    reads: object = None   # (user, operand) -> whether user reads operand into the examples; default: per example

    @staticmethod
    def onto(plan: "_Plan", entry: HloComputation, twins: "_Twins") -> "_Plan | None":
        """The plan for `entry`, XLA's fused form of the entry it was made for (`twins` maps one to
        the other); None unless every sum is an all-reduce over the batch axis between fusions, or
        a device's own sum that each fusion computing it has as its value, and each value leaving
        the groups is an output, or a linear function of what a fusion reads."""
        if plan.statistics or plan.gradients or not plan.sums:
            return None
        if all(s.scale == 1 for s in plan.sums):
            return _Plan._onto_own_sums(plan, entry, twins)
        if any(s.scale == 1 for s in plan.sums):
            return None
        named = {i.name: i for i in entry.instructions}
        sums = []
        for batch_sum in plan.sums:
            value = named.get(batch_sum.value.name)
            if value is None or twins.of(None, value) is not batch_sum.value:
                return None
            if value.opcode == "get-tuple-element" and value.operand(0).opcode == "all-reduce":
                local = value.operand(0).operand(value.attrs["index"])
            elif value.opcode == "all-reduce" and not value.shape.is_tuple:
                local = value.operand(0)
            else:
                return None
            sums.append(dataclasses.replace(batch_sum, value=value, local=local))
        varying = _users_closure([s.value for s in plan.sums])
        leaving = []
        for item in plan.leaving:
            if item[0] == "output":
                found = [item]
            else:
                found = twins.fused_edges(item[1], item[2], entry, varying, plan.info)
                if found is None:
                    return None
            leaving += [edge for edge in found if edge not in leaving]
        return dataclasses.replace(plan, sums=sums, leaving=leaving, info={})

    @staticmethod
    def _onto_own_sums(plan: "_Plan", entry: HloComputation, twins: "_Twins") -> "_Plan | None":
        """A shard_map step's plan on XLA's fused entry: each device's own sum is the value of the
        fusions that compute it (XLA's CPU reductions are fusion roots), and those values are
        grouped as `_group_sum` groups the sum, on the batch dimensions of the fused instructions'
        inlined twins. None if a copy of a sum sits inside a fusion that reads it, or if a reader
        that decides between the group's sum and the device's own has no twin."""
        decided: dict[tuple, bool | None] = {}

        def reads(user: HloInstruction, operand: HloInstruction) -> bool | None:
            if (user, operand) not in decided:
                decided[(user, operand)] = _reads_into_examples(user, operand, twins, plan.info)
            return decided[(user, operand)]

        def may_read(user: HloInstruction, operand: HloInstruction) -> bool:
            return reads(user, operand) is not False   # undecided ones are checked where they decide

        sums = []
        for batch_sum in plan.sums:
            copies = twins.copies(entry).get(batch_sum.value, [])
            if not copies or any(fusion is not None and not _is_value_of(copy, fusion) for fusion, copy in copies):
                return None
            for fusion, copy in copies:
                value = fusion if fusion is not None else copy
                if not value.users:
                    continue
                deciding = {value} | (_ways_back(value, may_read) if batch_sum.backward else set())
                if any(reads(user, instr) is None for instr in deciding for user in instr.users):
                    return None
                sums.append(dataclasses.replace(batch_sum, value=value, local=value))
        return dataclasses.replace(plan, sums=sums, reads=may_read)

    def apply(self, module: HloModule, channel_ids: ChannelIds) -> bool:
        found = self.statistics or self.sums
        if self.k == 1 or not found:
            if found:
                self.owner.report.append("groups of one device: nothing to share")
            return False
        reducers: dict[str, HloComputation] = {}
        self._regrouped: dict[HloInstruction, HloInstruction] = {}   # a regrouped sum -> what its readers read
        adds = [(s.reduce.shape.dtype, s.reduce.attrs["to_apply"], s.reduce.parent) for s in self.statistics]
        adds += [(s.value.shape.dtype, s.reducer, s.value.parent) for s in self.sums]
        for dtype, reducer, comp in adds:
            if dtype not in reducers:
                clone = module.clone_computation(reducer, suffix="group_sum")
                module.remove_computation(clone)  # defined before the computation that calls it
                reducers[dtype] = module.add_computation(clone, before=comp)
        where = _groups_text(self.groups)
        for batch_sum in self.sums:
            self._group_sum(batch_sum, reducers, channel_ids)
            over = "over the whole batch axis " if batch_sum.scale > 1 else ""
            self.owner.report.append(
                f"%{batch_sum.value.name}: a {'backward ' if batch_sum.backward else ''}sum {over}that flows back "
                f"into the examples, read only as a mean (a statistic or its gradient): summed over {where}, "
                f"count {batch_sum.count} -> {batch_sum.count // batch_sum.scale * self.k}")
        self._average_leaving(reducers, channel_ids)
        for stat in self.statistics:
            self._group(stat.divide, stat.count, reducers, channel_ids)
            self.owner.report.append(
                f"%{stat.reduce.name}: statistic (mean over dims {{{','.join(map(str, stat.signature[1]))}}} of "
                f"{_dims_text(stat.signature[0])}): summed over {where}, divisor {stat.count} -> "
                f"{stat.count * self.k}")
        for grad in self.gradients:
            if grad.divide.operand(0).shape.dtype not in reducers:
                raise self.owner.fail(f"no add reducer of {grad.divide.operand(0).shape.dtype}", grad.divide)
            self._group(grad.divide, grad.count, reducers, channel_ids)
            self.owner.report.append(
                f"%{grad.divide.name}: gradient through a statistic (broadcast back over the batch by "
                f"%{grad.broadcast.name}): summed over {where}, divisor {grad.count} -> {grad.count * self.k}")
        return True

    def _group_sum(self, batch_sum: _BatchSum, reducers, channel_ids: ChannelIds) -> None:
        """Readers of the device's sum read the group's sum divided by k instead: every reader of a
        statistic (the forward pass), as JAX's grouped batch norm does. A backward sum may also make a
        parameter's gradient (`sum(dy * (x - mean))` gives the scale's gradient and the variance's
        cotangent): the values that carry it back into the examples are computed a second time from
        the group's sum, and the parameter's gradient keeps the device's own.

        A sum over the whole batch axis (a jit program) is the group's sum times the groups along the
        axis for every reader; what leaves the groups is averaged over them (`_average_leaving`)."""
        value = batch_sum.value
        comp = value.parent
        order = {instr: i for i, instr in enumerate(comp.instructions)}
        first = min(value.users, key=order.__getitem__)
        summed = self._all_reduce(batch_sum.local, self.groups, reducers, channel_ids, first)
        scalar = Shape.array(value.shape.dtype, ())
        factor = comp.add_instruction("constant", (), scalar, name=f"{value.name}.share", before=first,
                                      literal=Literal.parse(scalar, repr(batch_sum.scale / self.k)))
        factors = factor if not value.shape.dims else comp.add_instruction(
            "broadcast", [factor], value.shape, name=f"{value.name}.shares", attrs={"dimensions": ()},
            before=first)
        scaled = comp.add_instruction("multiply", [summed, factors], value.shape, name=f"{value.name}.group_mean",
                                      before=first)
        self._regrouped[value] = scaled
        if not batch_sum.backward or batch_sum.scale > 1:
            for user in [u for u in value.users if u is not summed]:
                user.replace_operand_with(value, scaled)
            return
        reads = self.reads or (lambda user, operand: _per_example(user, self.info))
        copies = {value: scaled}
        for instr in sorted(_ways_back(value, reads), key=order.__getitem__):
            attrs = {key: v for key, v in instr.attrs.items() if key != "control-predecessors"}
            if instr.opcode == "fusion":   # XLA's fusions: a computation each
                attrs["calls"] = comp.parent.clone_computation(instr.attrs["calls"], suffix="group")
            copies[instr] = comp.add_instruction(
                instr.opcode, [copies.get(o, o) for o in instr.operands], instr.shape, name=f"{instr.name}.group",
                attrs=attrs, literal=instr.literal, after=instr)
        made = {summed, *copies.values()}
        for instr in list(copies):
            for user in list(instr.users):
                if user not in made and reads(user, instr):
                    user.replace_operand_with(instr, copies[instr])

    def _average_leaving(self, reducers, channel_ids: ChannelIds) -> None:
        """Each value that leaves the groups becomes the mean of its groups' values."""
        if not self.leaving:
            return
        comp = self.sums[0].value.parent
        root = comp.root
        across = [[group[j] for group in self.groups if set(group) <= set(line)]
                  for line in self.axis for j in range(self.k)]
        means: dict[HloInstruction, HloInstruction] = {}
        splits: dict[HloInstruction, list] = {}
        for leaving in self.leaving:
            if leaving[0] == "split":
                splits.setdefault(leaving[2], []).append(leaving[1])
                continue
            value = root.operand(leaving[1]) if leaving[0] == "output" else self._regrouped.get(leaving[1], leaving[1])
            if value not in means:
                order = {instr: i for i, instr in enumerate(comp.instructions)}
                before = root if leaving[0] == "output" else min(value.users, key=order.__getitem__)
                means[value] = self._mean_across(value, across, reducers, channel_ids, before)
            if leaving[0] == "output":
                root.set_operand(leaving[1], means[value])
                where = f"output {leaving[1]}"
            else:
                leaving[2].replace_operand_with(value, means[value])
                where = f"%{leaving[2].name}"
            self.owner.report.append(f"%{value.name}: computed from the group statistics: {where} reads its mean "
                                     f"over the groups ({_groups_text(across)})")
        for fusion, inners in splits.items():
            self._split_leaving(fusion, inners, across, reducers, channel_ids)

    def _mean_across(self, value: HloInstruction, across, reducers, channel_ids: ChannelIds,
                     before: HloInstruction) -> HloInstruction:
        """The mean of `value` over the groups: its all-reduce over `across` times 1/len(group)."""
        comp = value.parent
        total = self._all_reduce(value, across, reducers, channel_ids, before)
        total.rename(f"{value.name}.across")
        scalar = Shape.array(value.shape.dtype, ())
        share = comp.add_instruction("constant", (), scalar, name=f"{value.name}.share", before=before,
                                     literal=Literal.parse(scalar, repr(1 / len(across[0]))))
        shares = share if not value.shape.dims else comp.add_instruction(
            "broadcast", [share], value.shape, name=f"{value.name}.shares", attrs={"dimensions": ()}, before=before)
        return comp.add_instruction("multiply", [total, shares], value.shape, name=f"{value.name}.groups_mean",
                                    before=before)

    def _split_leaving(self, fusion: HloInstruction, inners: list, across, reducers, channel_ids: ChannelIds) -> None:
        """`fusion` reads the means over the groups of the values `inners` of its computation: each
        is computed by a loop fusion of its own from `fusion`'s operands and averaged, and a copy of
        `fusion` takes the means as new operands in their place."""
        comp, module = fusion.parent, fusion.parent.parent
        body = fusion.attrs["calls"]
        order = list(body.post_order())
        new_body = module.clone_computation(body, suffix="groups_mean")
        twin = dict(zip(order, new_body.instructions))
        operands = list(fusion.operands)
        for inner in dict.fromkeys(inners):
            part = module.clone_computation(body, suffix="leaving")
            part.set_root(dict(zip(order, part.instructions))[inner])
            part.remove_dead_code()
            value = comp.add_instruction("fusion", _used_parameters(part, fusion.operands), inner.shape,
                                         name=f"{fusion.name}.leaving", attrs={"kind": "kLoop", "calls": part},
                                         before=fusion)
            operands.append(self._mean_across(value, across, reducers, channel_ids, fusion))
            parameter = new_body.add_parameter(inner.shape)
            twin[inner].replace_all_uses_with(parameter)
            self.owner.report.append(f"%{fusion.name}: computed from the group statistics: %{inner.name} in it "
                                     f"reads its mean over the groups ({_groups_text(across)}), computed by a fusion "
                                     f"of its own")
        new_body.remove_dead_code()
        replacement = comp.add_instruction("fusion", _used_parameters(new_body, operands), fusion.shape,
                                           attrs={**fusion.attrs, "calls": new_body}, before=fusion)
        fusion.replace_all_uses_with(replacement)
        comp.remove_instruction(fusion)
        replacement.rename(fusion.name)

    def _all_reduce(self, value: HloInstruction, groups, reducers, channel_ids: ChannelIds,
                    before: HloInstruction) -> HloInstruction:
        attrs = {"replica_groups": ReplicaGroups.of(groups)}
        if self.mode == "devices":
            attrs = {"channel_id": channel_ids.fresh(), **attrs, "use_global_device_ids": True}
        attrs["to_apply"] = reducers[value.shape.dtype]
        return value.parent.add_instruction("all-reduce", [value], value.shape, name=f"{value.name}.group",
                                            attrs=attrs, before=before)

    def _group(self, divide: HloInstruction, count: int, reducers, channel_ids: ChannelIds) -> None:
        """`divide(n, count)` -> `divide(all-reduce(n) over the groups, count * k)`, for every user."""
        comp = divide.parent
        numerator = divide.operand(0)
        summed = self._all_reduce(numerator, self.groups, reducers, channel_ids, divide)
        scalar = Shape.array(divide.shape.dtype, ())
        total = count * self.k
        value = str(total) if divide.opcode == "divide" else repr(float(np.array(1.0 / total, dtype=np.float64)))
        constant = comp.add_instruction("constant", (), scalar, name=f"{divide.name}.count", before=divide,
                                        literal=Literal.parse(scalar, value))
        counts = constant if not divide.shape.dims else comp.add_instruction(
            "broadcast", [constant], divide.shape, name=f"{divide.name}.counts", attrs={"dimensions": ()},
            before=divide)
        keep = {key: v for key, v in divide.attrs.items() if key == "metadata"}
        new = comp.add_instruction(divide.opcode, [summed, counts], divide.shape, attrs=keep, before=divide)
        divide.replace_all_uses_with(new)
        comp.remove_instruction(divide)
        new.rename(divide.name)

# -- the batch dimension of every value ----------------------------------------------------------------

class _BatchDims(ForwardLattice):
    """Which dimension of each value is the per-device batch: an int, None (no batch: a parameter, a
    constant, a statistic), OPAQUE (per-example, dimension unknown), a tuple for tuples.

    A client of `ForwardDataflow`, which follows the examples through tuples and into calls (one
    context per call site); loops, conditionals and fusions hold their examples at OPAQUE."""

    def __init__(self, module: HloModule, over_axis=None):
        self.module = module
        self.batch_size: int | None = None   # the examples on one device; 0 when the batch operands disagree
        self.over_axis = over_axis           # at the hook: whether an all-reduce sums over the batch axis
        self._params: dict[int, int] = {}
        self._comp: HloComputation | None = None
        self._call_sites: dict[HloComputation, HloInstruction] = {}   # callee -> the call analysed last

    def analyse(self, comp: HloComputation, params: dict[int, int]) -> dict:
        """The batch dimension of every instruction of `comp`, whose parameter n holds the examples
        along dimension `params[n]`."""
        if self.batch_size is None and params:
            sizes = {comp.parameter(n).shape.dims[d] for n, d in params.items()
                     if n < comp.num_parameters and comp.parameter(n).shape.is_array}
            self.batch_size = sizes.pop() if len(sizes) == 1 else 0
        self._comp, self._params = comp, params
        flow = ForwardDataflow(self, comp)
        return {instr: flow.value(instr) for instr in comp.post_order()}

    @property
    def _one_example(self) -> bool:
        return self.batch_size == 1 and self.over_axis is not None

    def join(self, a, b):
        return a if b is None or a == b else b if a is None else OPAQUE

    def parameter(self, param: HloInstruction):
        if self._one_example:
            return WHOLE if param.parameter_number in self._params else None
        return self._params.get(param.parameter_number)

    def descends(self, instr: HloInstruction, operands: list) -> bool:
        """Into calls only, where every example the call passes is an array's."""
        if instr.opcode != "call" or self._one_example:
            return False
        callee = instr.attrs["to_apply"]
        if any(not _none(x) and not isinstance(x, int) for x in operands):
            raise Refusal(f"%{instr.name} passes a tuple or opaque per-example value to %{callee.name}")
        self._call_sites[callee] = instr
        return True

    def transfer(self, instr: HloInstruction, operands: list):
        return self._whole(instr, operands) if self._one_example else self._of(instr, operands)

    def _whole(self, instr: HloInstruction, ins: list):
        """One example per device, at the hook: XLA drops or merges its unit batch dimension at will,
        so only which values are the device's example's is followed (WHOLE): whatever reads one is,
        except an all-reduce over the batch axis, which sums over the devices' examples."""
        op = instr.opcode
        if all(_none(x) for x in ins):
            return None if not instr.shape.is_tuple else _nones(instr.shape)
        if op == "all-reduce":
            elements = tuple(None if self.over_axis(instr) else x for x in ins)
            return elements if instr.shape.is_tuple else elements[0]
        if op in ("call", "while", "conditional"):
            raise Refusal(f"%{instr.name} passes the device's example to a {op}: with one example per device "
                          f"the pass follows it only through the entry computation")
        return WHOLE if not instr.shape.is_tuple else tuple(WHOLE for _ in instr.shape.tuple_shapes)

    def _of(self, instr: HloInstruction, ins: list):
        op = instr.opcode
        if all(_none(x) for x in ins):
            return None if not instr.shape.is_tuple else _nones(instr.shape)
        if op == "all-reduce" and instr.shape.is_tuple:   # XLA's combined all-reduces: element by element
            return tuple(ins)
        if op in ELEMENTWISE or op in ("all-reduce", "copy", "opt-barrier") and not instr.shape.is_tuple:
            known = {x for x in ins if x is not None}
            return known.pop() if len(known) == 1 else OPAQUE
        if op == "broadcast":
            b = ins[0]
            return instr.attrs["dimensions"][b] if isinstance(b, int) and b >= 0 else OPAQUE
        if op in UNIT_SHAPE_OPS:
            return _reshaped(ins[0], instr.operand(0).shape.dims, instr.shape.dims, self.batch_size)
        if op == "transpose":
            b = ins[0]
            return list(instr.attrs["dimensions"]).index(b) if isinstance(b, int) and b >= 0 else OPAQUE
        if op == "reduce" and instr.parent is not self._comp and _reduces_batch(instr, ins[0]):
            raise Refusal(f"%{instr.name} in %{instr.parent.name} (called by %{self._call_sites[instr.parent].name}) "
                          f"reduces over the batch; run call-inliner first")
        if op == "reduce" and instr.operand_count == 2 and not instr.shape.is_tuple:
            b = ins[0]
            dims = tuple(instr.attrs.get("dimensions", ()))
            if not isinstance(b, int) or b < 0:
                return OPAQUE
            return None if b in dims else b - sum(1 for d in dims if d < b)
        if op == "convolution":
            return _convolution(instr, ins)
        if op == "dot":
            return _dot(instr, ins)
        if op in _BATCH_PRESERVING:
            return _preserving(instr, ins)
        if op == "gather":
            return _gather(instr, ins, self.batch_size)
        if op == "scatter" and instr.operand_count == 3:
            return _scatter(instr, ins, self.batch_size)
        if instr.shape.is_tuple:
            return tuple(OPAQUE for _ in instr.shape.tuple_shapes)
        return OPAQUE


def _per_example(instr: HloInstruction, info: dict) -> bool:
    """Whether `instr` holds examples (a tuple only passes its elements on)."""
    return not _none(info.get(instr)) and instr.opcode != "tuple"


def _none(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(_none(e) for e in x))


def _nones(shape: Shape):
    return tuple(_nones(s) if s.is_tuple else None for s in shape.tuple_shapes)


def _reduces_batch(reduce: HloInstruction, b) -> bool:
    """Whether `reduce`, whose operand holds the examples along `b`, sums over them."""
    return b == OPAQUE or (isinstance(b, int) and b in tuple(reduce.attrs.get("dimensions", ())))


def _reshaped(b, before: tuple, after: tuple, batch_size: int | None = None):
    """The batch dim `b` of `before` in the reshaped `after`: the dimension whose major part the
    examples are. A batch dimension holds the examples whole, or (XLA's layout bitcasts, such as
    `[2,4,4,8] -> [32,8]`) merged with minor dimensions; a reshape that splits the examples is OPAQUE."""
    if not isinstance(b, int) or b < 0:
        return OPAQUE
    leading, product, j = math.prod(before[:b]), 1, 0
    while j < len(after) and product < leading:
        product *= after[j]
        j += 1
    size = before[b]
    while j < len(after) and after[j] == 1 and size != 1:
        j += 1
    if product != leading or j >= len(after):
        return OPAQUE
    if after[j] == size:
        return j
    if not batch_size:
        return OPAQUE
    if after[j] > size:   # merged with the dimensions after it
        merged = size
        for m in range(b + 1, len(before)):
            merged *= before[m]
            if merged == after[j]:
                return j
        return OPAQUE
    # split: the examples stay in the major part when it is a whole number of examples
    return j if after[j] % batch_size == 0 and size % after[j] == 0 and size % batch_size == 0 else OPAQUE


def _convolution(instr: HloInstruction, ins: list):
    dn = instr.attrs["dim_labels"]
    lhs, rhs = ins[0], ins[1]
    if any(x is not None and (not isinstance(x, int) or x < 0) for x in (lhs, rhs)):
        return OPAQUE
    # Grouped convolutions (depthwise ones): feature groups leave the batch alone; batch groups
    # (depthwise filter gradients) split the input batch dimension, which then holds no examples.
    feature_groups = instr.attrs.get("feature_group_count") or 1
    batch_groups = instr.attrs.get("batch_group_count") or 1
    out = set()
    if lhs is not None:
        if lhs == dn.input_batch and batch_groups == 1:
            out.add(dn.output_batch)
        elif lhs == dn.input_feature and feature_groups == 1:
            out.add(None)   # contracted: a sum over the batch (a weight gradient)
        else:
            return OPAQUE
    if rhs is not None:
        if rhs == dn.kernel_output_feature and feature_groups == 1 and batch_groups == 1:
            out.add(dn.output_feature)
        elif rhs == dn.kernel_input_feature and feature_groups == 1:
            out.add(None)
        else:
            return OPAQUE
    return out.pop() if len(out) == 1 else OPAQUE


def _dot(instr: HloInstruction, ins: list):
    attrs = instr.attrs
    lb, rb = tuple(attrs.get("lhs_batch_dims", ())), tuple(attrs.get("rhs_batch_dims", ()))
    lc, rc = tuple(attrs.get("lhs_contracting_dims", ())), tuple(attrs.get("rhs_contracting_dims", ()))
    lrank, rrank = instr.operand(0).shape.rank, instr.operand(1).shape.rank
    lfree = [d for d in range(lrank) if d not in lb and d not in lc]
    rfree = [d for d in range(rrank) if d not in rb and d not in rc]
    out = set()
    for x, batch, contracting, free, offset in ((ins[0], lb, lc, lfree, len(lb)),
                                                 (ins[1], rb, rc, rfree, len(lb) + len(lfree))):
        if x is None:
            continue
        if not isinstance(x, int) or x < 0:
            return OPAQUE
        if x in batch:
            out.add(batch.index(x))
        elif x in contracting:
            out.add(None)
        else:
            out.add(offset + free.index(x))
    return out.pop() if len(out) == 1 else OPAQUE


_BATCH_PRESERVING = frozenset({"slice", "pad", "dynamic-slice", "dynamic-update-slice", "reverse", "concatenate",
                               "reduce-window", "select-and-scatter"})


def _preserving(instr: HloInstruction, ins: list):
    """Ops that keep every example where it is when they leave the batch dimension alone."""
    if instr.opcode == "reduce-window" and instr.shape.is_tuple:   # variadic (a max pool with its argmax)
        arrays = len(instr.shape.tuple_shapes)
        element = _preserving_window(instr, ins[:arrays], instr.operand(0))
        return tuple(element for _ in range(arrays))
    known = {x for x in ins if x is not None}
    if len(known) != 1 or instr.shape.is_tuple:
        return OPAQUE
    b = known.pop()
    if not isinstance(b, int) or b < 0:
        return OPAQUE
    source = next(o for o, x in zip(instr.operands, ins) if x is not None)
    if b >= instr.shape.rank or instr.shape.dims[b] != source.shape.dims[b]:
        return OPAQUE
    op, attrs = instr.opcode, instr.attrs
    if op in ("reduce-window", "select-and-scatter") and _window_touches(instr, b):
        return OPAQUE
    if op == "reverse" and b in tuple(attrs.get("dimensions", ())):
        return OPAQUE
    if op == "concatenate" and b in tuple(attrs.get("dimensions", ())):
        return OPAQUE
    if op == "dynamic-update-slice" and (ins[0] != b or instr.operand(1).shape.dims[b] != instr.shape.dims[b]):
        return OPAQUE
    if op == "select-and-scatter" and ins[0] != b:
        return OPAQUE
    return b


def _window_touches(instr: HloInstruction, b: int) -> bool:
    """Whether the window of a reduce-window or select-and-scatter moves along dimension `b`."""
    dims = getattr(instr.attrs.get("window"), "dimensions", None)
    return not dims or len(dims) <= b or (dims[b].size, dims[b].stride, dims[b].padding_low, dims[b].padding_high,
                                          dims[b].window_dilation, dims[b].base_dilation) != (1, 1, 0, 0, 1, 1)


def _preserving_window(instr: HloInstruction, ins: list, source: HloInstruction):
    known = {x for x in ins if x is not None}
    if len(known) != 1:
        return None if not known else OPAQUE
    b = known.pop()
    if not isinstance(b, int) or b < 0 or _window_touches(instr, b):
        return OPAQUE
    return b if instr.shape.tuple_shapes[0].dims[b] == source.shape.dims[b] else OPAQUE


def _agree(found: set):
    return found.pop() if len(found) == 1 else OPAQUE


def _gather(instr: HloInstruction, ins: list, batch_size):
    """Gather: the batch of the indices (or of an operand dimension batched with them, or sliced whole)."""
    a = instr.attrs
    operand, indices = ins
    offset = tuple(a.get("offset_dims", ()))
    collapsed = tuple(a.get("collapsed_slice_dims", ()))
    operand_batching = tuple(a.get("operand_batching_dims", ()))
    indices_batching = tuple(a.get("start_indices_batching_dims", ()))
    vector_dim = a.get("index_vector_dim")
    indices_rank = instr.operand(1).shape.rank
    batch_positions = [d for d in range(instr.shape.rank) if d not in offset]
    indices_dims = [d for d in range(indices_rank) if d != vector_dim]
    found = set()
    for x, is_operand in ((operand, True), (indices, False)):
        if x is None:
            continue
        if not isinstance(x, int) or x < 0:
            return OPAQUE
        if is_operand:
            if x in operand_batching:
                x = indices_batching[operand_batching.index(x)]
            elif x not in collapsed and a.get("slice_sizes", ())[x] == instr.operand(0).shape.dims[x]:
                window = [d for d in range(instr.operand(0).shape.rank)
                          if d not in collapsed and d not in operand_batching]
                found.add(offset[window.index(x)])
                continue
            elif a.get("slice_sizes", ())[x] == 1 and x in a.get("start_index_map", ()):
                # XLA's form of a batched gather: the index of the batch is an iota along the indices' batch
                x = _coordinate_dimension(instr.operand(1), a["start_index_map"].index(x), vector_dim, batch_size)
                if x is None:
                    return OPAQUE
            else:
                return OPAQUE
        if x not in indices_dims:
            return OPAQUE
        found.add(batch_positions[indices_dims.index(x)])
    return _agree(found)


def _scatter(instr: HloInstruction, ins: list, batch_size):
    """Scatter: the operand's batch, or the updates' batch where it is a window or batching dimension."""
    a = instr.attrs
    operand, indices, updates = ins
    window_dims = tuple(a.get("update_window_dims", ()))
    inserted = tuple(a.get("inserted_window_dims", ()))
    input_batching = tuple(a.get("input_batching_dims", ()))
    indices_batching = tuple(a.get("scatter_indices_batching_dims", ()))
    vector_dim = a.get("index_vector_dim")
    rank = instr.shape.rank
    found = set()
    if operand is not None:
        if not isinstance(operand, int) or operand < 0:
            return OPAQUE
        found.add(operand)
    operand_window = [d for d in range(rank) if d not in inserted and d not in input_batching]
    indices_dims = [d for d in range(instr.operand(1).shape.rank) if d != vector_dim]
    to_operand = tuple(a.get("scatter_dims_to_operand_dims", ()))
    update_scatter = [d for d in range(instr.operand(2).shape.rank) if d not in window_dims]
    for x, is_updates in ((updates, True), (indices, False)):
        if x is None:
            continue
        if not isinstance(x, int) or x < 0:
            return OPAQUE
        if is_updates:
            if x in window_dims:
                found.add(operand_window[window_dims.index(x)])
                continue
            x = indices_dims[update_scatter.index(x)]
        if x in indices_batching:
            found.add(input_batching[indices_batching.index(x)])
        else:   # XLA's form of a batched scatter: an index component is each row's example number
            targets = [to_operand[c] for c in range(len(to_operand)) if _coordinate_dimension(
                instr.operand(1), c, vector_dim, batch_size) == x and instr.shape.dims[to_operand[c]] == batch_size
                and _window_extent(instr, to_operand[c], operand_window, window_dims) == 1]
            if len(targets) != 1:
                return OPAQUE
            found.add(targets[0])
    return _agree(found)


def _window_extent(scatter: HloInstruction, dim: int, operand_window: list, window_dims: tuple) -> int:
    """How many positions along operand dimension `dim` each update of `scatter` writes."""
    if dim not in operand_window:
        return 1
    return scatter.operand(2).shape.dims[window_dims[operand_window.index(dim)]]


def _coordinate_dimension(indices: HloInstruction, component: int, vector_dim: int, batch_size) -> int | None:
    """The dimension of `indices` along which component `component` of the index vectors is each
    row's example number (an iota over the batch, concatenated with the other components), or None.
    XLA writes batched gathers and scatters, and max pooling's backward pass, this way."""
    chain = [indices]
    while chain[-1].opcode in UNIT_SHAPE_OPS:
        chain.append(chain[-1].operand(0))
    vectors = chain.pop()
    if vectors.opcode != "concatenate" or vector_dim >= indices.shape.rank:
        return None
    along = vectors.attrs["dimensions"][0]
    start = 0
    for piece in vectors.operands:
        size = piece.shape.dims[along]
        if start <= component < start + size:
            break
        start += size
    else:
        return None
    counting = _counting_dimension(piece, batch_size) if size == 1 else None
    if counting is None or counting == along:
        return None
    for before, after in zip([vectors] + chain[::-1], chain[::-1] + [indices]):
        if before is after:
            continue
        along = _reshaped(along, before.shape.dims, after.shape.dims)
        counting = _reshaped(counting, before.shape.dims, after.shape.dims, batch_size)
        if along == OPAQUE or counting == OPAQUE:
            return None
    return counting if along == vector_dim else None


def _counting_dimension(value: HloInstruction, batch_size) -> int | None:
    """The dimension along which `value` holds the example number of each position: an iota over a
    dimension of the batch's size, carried through converts, reshapes and pooling windows."""
    if value.opcode in ("convert", "copy"):
        return _counting_dimension(value.operand(0), batch_size)
    if value.opcode in UNIT_SHAPE_OPS:
        inner = _counting_dimension(value.operand(0), batch_size)
        found = None if inner is None else _reshaped(inner, value.operand(0).shape.dims, value.shape.dims, batch_size)
        return None if found in (None, OPAQUE) else found
    if value.opcode == "iota":
        d = value.attrs["iota_dimension"]
        return d if value.shape.dims[d] == batch_size else None
    if value.opcode == "broadcast" and value.operand(0).opcode == "iota" and value.operand(0).shape.rank == 1:
        d = value.attrs["dimensions"][0]
        return d if value.shape.dims[d] == batch_size else None
    if value.opcode == "get-tuple-element" and value.operand(0).opcode == "reduce-window":
        window = value.operand(0)   # a variadic reduce-window picks whole positions of its inputs
        inner = _counting_dimension(window.operand(value.attrs["index"]), batch_size)
        if inner is not None and not _window_touches(window, inner):
            return inner
    return None


# -- patterns ------------------------------------------------------------------------------------------

def _is_unit_reshape(instr: HloInstruction) -> bool:
    """A reshape that only adds or removes dimensions of size 1, a broadcast to its own shape, or a
    sum over dimensions of size 1 (JAX's transpose of a keepdims broadcast)."""
    if instr.opcode == "reduce" and instr.operand_count == 2 and not instr.shape.is_tuple:
        reducer = instr.attrs.get("to_apply")
        return (isinstance(reducer, HloComputation) and reducer_opcode(reducer) == "add"
                and folded_scalar_constant(instr.operand(1)) == 0.0
                and all(instr.operand(0).shape.dims[d] == 1 for d in instr.attrs.get("dimensions", ())))
    if instr.opcode in UNIT_SHAPE_OPS:
        return ([d for d in instr.shape.dims if d != 1] == [d for d in instr.operand(0).shape.dims if d != 1])
    if instr.opcode == "broadcast":
        return (instr.shape.dims == instr.operand(0).shape.dims
                and tuple(instr.attrs["dimensions"]) == tuple(range(instr.shape.rank)))
    return False


def _through_unit_reshapes(instr: HloInstruction) -> HloInstruction | None:
    """The last of the single-user chain of unit reshapes from `instr`; None when a link has other users."""
    while True:
        if len(instr.users) != 1 or instr.is_root:
            return None
        user = instr.users[0]
        if not _is_unit_reshape(user):
            return instr
        instr = user


def _divides_by(instr: HloInstruction | None, value: HloInstruction, count: int) -> bool:
    """Whether `instr` is value / count or value * (1/count) (the constant exactly that, in its type)."""
    if instr is None or instr.operand_count != 2 or instr.control_predecessors or instr.control_successors:
        return False
    if instr.opcode == "divide" and instr.operand(0) is value and instr.operand(1) is not value:
        return folded_scalar_constant(instr.operand(1)) == float(count)
    if instr.opcode == "multiply" and instr.operand(0) is value and instr.operand(1) is not value:
        c = folded_scalar_constant(instr.operand(1))
        dtype = np.dtype(np.float32) if instr.shape.dtype == "f32" else np.dtype(np.float64)
        return c is not None and c == float(np.array(1.0, dtype) / np.array(count, dtype))
    return False


def _reaches(value: HloInstruction, info: dict, stops: set) -> set[str]:
    """How `value`, through values with no batch dimension and not through `stops`, reaches
    per-example values: a set of "direct" and "all-reduce" (after an all-reduce); empty: it does not."""
    found, seen, stack = set(), set(), [(value, False)]
    while stack:
        current, reduced = stack.pop()
        for user in current.users:
            now = reduced or (user.opcode == "all-reduce" and not _over_single_devices(user))
            if user in stops or (user, now) in seen:
                continue
            seen.add((user, now))
            if user.shape.is_tuple and user.opcode in ("tuple", "all-reduce"):  # follow the element alone
                indices = {i for i, o in enumerate(user.operands) if o is current}
                for reader in user.users:
                    if reader.opcode == "get-tuple-element" and reader.attrs["index"] in indices:
                        stack.append((reader, now)) if _none(info.get(reader)) else found.add(
                            "all-reduce" if now else "direct")
                    elif reader.opcode != "get-tuple-element":
                        found.add("all-reduce" if now else "direct")   # passed on whole: assume the worst
                continue
            if not _none(info.get(user)):
                found.add("all-reduce" if now else "direct")
                continue
            stack.append((user, now))
    return found


_LOCAL_ARITHMETIC = frozenset({"add", "subtract", "negate", "multiply", "divide", "bitcast", "reshape", "pad", "slice",
                               "concatenate", "convert", "copy", "transpose", "get-tuple-element"})
_SAME_DEGREE = frozenset({"add", "subtract", "maximum", "minimum", "clamp"})
_PASS_THROUGH = frozenset({"negate", "abs", "convert", "copy", "bitcast", "reshape", "broadcast", "transpose",
                           "slice", "reduce", "concatenate", "pad"})
_POWERS = {"rsqrt": Fraction(-1, 2), "sqrt": Fraction(1, 2)}


def _check_means(comp: HloComputation, info: dict, sources: dict[HloInstruction, int], sums: list[_BatchSum],
                 over_axis, exits: list = (), axis_size: int = 0) -> None:
    """Prove that the examples read each sum over the batch only as a mean.

    Count degrees in the count n (dimensional analysis with n as the unit): a sum has degree 1, a
    divide by n or a multiply by 1/n degree -1; every value that carries a sum into a per-example
    instruction must have degree 0 (a mean, a variance, `rsqrt(var + eps)`, the gradient through
    them), and whatever is added, subtracted or selected together must agree. Then the group's sum
    divided by k in place of each sum gives the group's statistics, and their gradients, exactly.
    XLA has folded the 1/n into other constants (`2/n`, `0.1/n`): a constant c with c * n a small
    integer may be either a number or m/n, so each such constant is an unknown, 0 or -1, and the
    constraints are solved as a linear system; no consistent choice refuses the module.

    Sums all-reduced over the whole batch axis of `axis_size` devices D (a jit or pmap step) are
    regrouped instead, and the count that changes is D: a device's own sum has degree 0, an
    all-reduce adds 1, a constant may be m/D (a `pmean`, as `BatchNorm(axis_name=...)` takes, which
    JAX's transpose divides before its all-reduce) or, after an all-reduce of sums of c elements,
    m/(c·D) (the partitioner's mean).

    `exits` (`_leaving_the_groups`' items, in a pmap step) must have degree 0 too: a mean is the same
    whether the group's sum divided by k or the group's own divisor makes it, so each device's
    output is its group's."""
    degrees = _Degrees(comp, info, sources, over_axis, axis_size)
    system = degrees.system
    for batch_sum in sums:
        found = degrees.demand(batch_sum.value)
        if not found:
            raise Refusal(f"%{batch_sum.value.name} all-reduces over the batch axis what is not a sum over the batch")
        if not degrees.across_devices:
            system.equal(found[0].expression, system.number(1), batch_sum.value)
        batch_sum.count = max(found[0].elements) * batch_sum.scale
    for instr in comp.instructions:
        if _none(info.get(instr)) or instr.opcode == "tuple":   # a tuple only passes its elements on
            continue
        for operand in instr.operands:
            if _none(info.get(operand)):
                for found in degrees.demand(operand):
                    system.equal(found.expression, system.number(0), operand, into=instr)
    root = comp.root
    for item in exits:
        value, into = ((root.operand(item[1]) if root.opcode == "tuple" else root, root) if item[0] == "output"
                       else item[1:])
        for found in degrees.demand(value):
            system.equal(found.expression, system.number(0), value, into=into)
    system.solve()


@dataclasses.dataclass
class _Degree:
    """A value the sums reach: its degree (a `_DegreeSystem` expression), the counts its constants
    may divide by, the elements its devices' own sums sum."""
    expression: dict
    counts: frozenset
    elements: frozenset

    def __hash__(self):   # the engine keys states
        return hash((frozenset(self.expression.items()), self.counts, self.elements))


class _Degrees(ForwardLattice):
    """The degree of each value of `comp` (`_check_means`): a `_Degree`, None where no sum reaches
    it, or the `Refusal` that reading it as a mean meets; a tuple for an all-reduce's elements.

    A client of `ForwardDataflow`, which passes each element of an all-reduce on to its
    get-tuple-element; nothing is descended into. The engine evaluates every value, so the
    equations each instruction needs and its refusal count only once `demand` asks for a value
    computed from it (what the examples read, not a moving average or the loss)."""

    def __init__(self, comp: HloComputation, info: dict, sources: dict[HloInstruction, int], over_axis,
                 axis_size: int):
        self.info, self.sources, self.over_axis, self.axis_size = info, sources, over_axis, axis_size
        self.across_devices = axis_size > 0
        self.shares = _moving_average_shares(comp, axis_size) if self.across_devices else set()
        self.system = _DegreeSystem()
        self._equations: dict[HloInstruction, list] = {}   # instr -> the pairs of degrees it needs equal
        self._demanded: set[HloInstruction] = set()
        self._flow = ForwardDataflow(self, comp)

    def demand(self, value: HloInstruction) -> list[_Degree]:
        """The degrees of `value` (of its elements) that the sums reach. Adds the equations of what it
        is computed from to the system, operands first, and raises the first refusal among them."""
        stack = [value]
        while stack:
            instr = stack.pop()
            waiting = [o for o in self._inputs(instr) if o not in self._demanded]
            if waiting:
                stack += [instr, *waiting]
            elif instr not in self._demanded:
                self._demanded.add(instr)
                for refusal in (s for s in _leaves(self._flow.value(instr)) if isinstance(s, Refusal)):
                    raise refusal
                for a, b in self._equations.get(instr, ()):
                    self.system.equal(a, b, instr)
        return [s for s in _leaves(self._flow.value(value)) if s is not None]

    def _inputs(self, instr: HloInstruction) -> list:
        """The values `instr`'s degree is computed from."""
        if instr in self.sources or self._own(instr):
            return []
        if instr.opcode == "get-tuple-element" and instr.operand(0).opcode == "all-reduce":
            return [instr.operand(0).operand(instr.attrs["index"])]
        return list(instr.operands)

    def _own(self, instr: HloInstruction) -> bool:
        """Counting in the devices: a device's own value, of degree 0 whatever it is computed from,
        unless it is the arithmetic that may scale a device's sums by 1/D before an all-reduce."""
        return self.across_devices and _per_example(instr, self.info) and instr.opcode not in _LOCAL_ARITHMETIC

    def _devices_own(self, instr: HloInstruction) -> _Degree:
        elements = (math.prod(instr.operand(0).shape.dims[d] for d in instr.attrs["dimensions"])
                    if instr.opcode == "reduce" else 1)
        return _Degree(self.system.number(0), frozenset({self.axis_size}), frozenset({elements}))

    def join(self, a, b):
        """Only for a value analysed in several contexts, which nothing descended into makes here:
        one of two degrees is not a mean the pass can prove."""
        if a == b or b is None or isinstance(a, Refusal):
            return a
        return b if a is None or isinstance(b, Refusal) else Refusal(
            "a value has two degrees in its count: not a mean the pass can prove")

    def parameter(self, param: HloInstruction):
        return self.transfer(param, [])

    def descends(self, instr: HloInstruction, operands: list) -> bool:
        return False

    def transfer(self, instr: HloInstruction, operands: list):
        if instr in self.sources:
            count = self.sources[instr]
            return _Degree(self.system.number(0 if self.across_devices else 1),
                           frozenset({self.axis_size if self.across_devices else count}), frozenset({count}))
        if instr.opcode == "all-reduce" and instr.shape.is_tuple:   # each element for its get-tuple-element
            return tuple(self._summed(instr, x) for x in operands)
        if self._own(instr):
            return self._devices_own(instr)
        if instr.opcode == "all-reduce":
            return self._summed(instr, operands[0])
        reached = [x for o in operands for x in _leaves(o) if x is not None]
        if not reached:   # a device's own value is not a function of D
            return self._devices_own(instr) if self.across_devices and _per_example(instr, self.info) else None
        refused = [x for x in reached if isinstance(x, Refusal)]
        if refused:
            return refused[0]
        counts = frozenset().union(*(d.counts for d in reached))
        if not self.across_devices and len({d.counts for d in reached}) != 1:
            return Refusal(f"%{instr.name} combines sums of different counts {sorted(counts)} before the examples "
                           f"read them: not a batch statistic the pass can prove")
        elements = frozenset().union(*(d.elements for d in reached))
        if self.across_devices and instr.opcode == "reduce" and _per_example(instr.operand(0), self.info):
            elements = frozenset(e * math.prod(instr.operand(0).shape.dims[d] for d in instr.attrs["dimensions"])
                                 for e in elements)   # a device's own sum
        return _Degree(self._degree(instr, operands, reached, counts), counts, elements)

    def _degree(self, instr: HloInstruction, ins: list, reached: list[_Degree], counts: frozenset) -> dict:
        """The degree of `instr`'s value from its operands' states `ins`, recording the equations it needs."""
        system, op = self.system, instr.opcode
        equations = self._equations.setdefault(instr, [])
        if any(isinstance(x, tuple) for x in ins):   # what reads a tuple whole reads degree 0
            equations += [(d.expression, system.number(0)) for d in reached]
            return system.number(0)
        known = [d.expression if d is not None else system.number(-1) if o in self.shares and op == "multiply" else
                 (system.constant(o, counts, op == "divide" and k == 1)
                  if op in ("multiply", "divide") else system.number(0))
                 for k, (d, o) in enumerate(zip(ins, instr.operands))]
        # what is put side by side must agree; a zero is zero in any degree (padding, relu's max)
        together = [d for d, o in zip(known, instr.operands) if folded_scalar_constant(o) != 0.0]
        if op in _PASS_THROUGH:
            if op in ("concatenate", "pad"):
                equations += [(together[0], other) for other in together[1:]]
            return known[0]
        if op in _SAME_DEGREE or op == "select":
            values = [d for d, o in zip(known, instr.operands) if folded_scalar_constant(o) != 0.0
                      and (op != "select" or o is not instr.operand(0))]
            equations += [(values[0], other) for other in values[1:]]
            return values[0] if values else known[-1]
        if op == "compare":
            equations.append((known[0], known[1]))
            return system.number(0)
        if op == "multiply":
            return system.add(known[0], known[1])
        if op == "divide":
            return system.add(known[0], system.scale(known[1], -1))
        if op in _POWERS:
            return system.scale(known[0], _POWERS[op])
        equations += [(d, system.number(0)) for d in known]
        return system.number(0)

    def _summed(self, all_reduce: HloInstruction, element):
        """An all-reduce over the batch axis sums the count elements of each of its devices."""
        if not isinstance(element, _Degree) or _over_single_devices(all_reduce):
            return element
        if not self.over_axis(all_reduce):
            return Refusal(f"%{all_reduce.name} all-reduces a sum over the batch over other devices than the "
                           f"batch axis")
        devices = len(all_reduce.attrs["replica_groups"].groups[0])
        if not self.across_devices:
            return _Degree(element.expression, frozenset(c * devices for c in element.counts), element.elements)
        return _Degree(self.system.add(element.expression, self.system.number(1)),
                       element.counts | {c * devices for c in element.elements}, element.elements)


def _leaves(state) -> list:
    """A state's leaf states: its elements', for a tuple-shaped value's."""
    return [x for s in state for x in _leaves(s)] if isinstance(state, tuple) else [state]


def _moving_average_shares(comp: HloComputation, devices: int) -> set[HloInstruction]:
    """The constants b of moving averages `a * old + b * s` with a + b * devices = 1: XLA folds
    (1 - momentum) into the 1/devices of a pmean, so b is a share per device (degree -1)."""
    def scaled(value: HloInstruction):
        while value.opcode in UNIT_SHAPE_OPS:
            value = value.operand(0)
        if value.opcode != "multiply":
            return []
        found = []
        for k, factor in enumerate(value.operands):
            c = folded_scalar_constant(factor)
            if c is not None and folded_scalar_constant(value.operand(1 - k)) is None:
                found.append((factor, c))
        return found

    shares = set()
    for instr in comp.instructions:
        if instr.opcode == "add":
            left, right = scaled(instr.operand(0)), scaled(instr.operand(1))
            for (_, keep), (factor, share) in [*itertools.product(left, right), *itertools.product(right, left)]:
                if 0 < keep < 1 and abs(keep + share * devices - 1) <= 1e-6:
                    shares.add(factor)
    return shares


class _DegreeSystem:
    """Linear constraints on degrees: an expression is {None: constant, unknown: coefficient}."""

    def __init__(self):
        self.equations: list[tuple[dict, HloInstruction, HloInstruction | None]] = []
        self.allowed: dict[int, set] = {}   # unknown -> the degrees it may take

    @staticmethod
    def number(value) -> dict:
        return {None: Fraction(value)}

    def constant(self, instr: HloInstruction, counts, divisor: bool) -> dict:
        """0 for a number; an unknown for a factor that may be m/count or m/count² (XLA folds
        `(s/n)²` into `s*s * (1/n²)`), or a divisor that may be m·count or m·count² (TF divides by
        the count), m a small integer, count one of `counts`: it may take 0 or those degrees."""
        value = folded_scalar_constant(instr)
        degrees = {0}
        for power, count in itertools.product((1, 2) if divisor else (-1, -2), counts):
            m = value / float(count) ** power if value else 0.0
            if value and abs(m - round(m)) <= 1e-4 * max(1.0, abs(m)) and 1 <= abs(round(m)) <= 8:
                degrees.add(power)
        if len(degrees) == 1:
            return self.number(0)
        unknown = len(self.allowed) + 1
        self.allowed[unknown] = degrees
        return {None: Fraction(0), unknown: Fraction(1)}

    @staticmethod
    def add(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            out[key] = out.get(key, Fraction(0)) + value
        return out

    @staticmethod
    def scale(a: dict, factor) -> dict:
        return {key: value * factor for key, value in a.items()}

    def equal(self, a: dict, b: dict, where: HloInstruction, into: HloInstruction | None = None) -> None:
        self.equations.append((self.add(a, self.scale(b, -1)), where, into))

    def solve(self) -> None:
        """Gaussian elimination; the unknowns left free are numbers (0). Refuse when the equations
        contradict each other, or need an unknown other than 0 or -1."""
        pivots: dict[int, dict] = {}   # unknown -> an equation solved for it

        def reduced(row: dict) -> dict:
            row = dict(row)
            for unknown, pivot in pivots.items():
                factor = row.get(unknown, Fraction(0))
                if factor:
                    row = self.add(row, self.scale(pivot, -factor))
            return {k: v for k, v in row.items() if k is None or v}

        for row, where, into in self.equations:
            row = reduced(row)
            unknowns = [k for k in row if k is not None]
            if not unknowns:
                if row.get(None, 0):
                    raise Refusal(_degree_mismatch(where, into))
                continue
            unknown = unknowns[0]
            row = self.scale(row, 1 / row[unknown])
            for other in pivots:
                factor = pivots[other].get(unknown, Fraction(0))
                if factor:
                    pivots[other] = {k: v for k, v in self.add(pivots[other], self.scale(row, -factor)).items()
                                     if k is None or v}
            pivots[unknown] = row
        for unknown, row in pivots.items():
            if -row.get(None, Fraction(0)) not in self.allowed[unknown]:   # with the free unknowns 0
                raise Refusal("the constants around a sum over the batch cannot all be read as numbers or as "
                              "1/count: not a mean the pass can prove")


def _degree_mismatch(where: HloInstruction, into: HloInstruction | None) -> str:
    if into is not None:
        return (f"%{where.name} carries a sum over the batch into %{into.name} without dividing it by its count "
                f"(or divides it twice): not a mean, so the pass cannot group it")
    return (f"%{where.name} ({where.opcode}) combines a sum over the batch with values of another degree in its "
            f"count: not a mean the pass can prove")


def _op_name(instr: HloInstruction) -> str:
    metadata = instr.attrs.get("metadata")
    return str(dict(metadata.items).get("op_name", "")) if metadata is not None else ""


def _is_backward(instr: HloInstruction) -> bool:
    """Whether `instr` belongs to the backward pass: JAX names it `transpose(...)` in op_name, TF's
    GradientTape `gradient_tape/...`."""
    name = _op_name(instr)
    return "transpose(" in name or name.startswith("gradient_tape/")


def _in_shard_map(instr: HloInstruction) -> bool:
    """Whether JAX made `instr` inside a shard_map (its op_name says `.../shard_map/...`)."""
    return "shard_map/" in _op_name(instr)


_LINEAR = frozenset({"add", "subtract", "negate", "convert", "copy", "bitcast", "reshape", "broadcast", "transpose",
                     "slice", "concatenate", "reduce", "get-tuple-element", "select", "pad"})


def _combined_linearity(instr: HloInstruction, ins: list) -> int | None:
    """How `instr` is linear in the backward sums, its operands being `ins` (0: not at all, 1:
    linearly, None: otherwise): through sums, scaling by statistics and constants, reshapes."""
    op = instr.opcode
    if None in ins:
        return None
    if op == "multiply":
        return ins[0] + ins[1] if ins[0] + ins[1] <= 1 else None
    if op == "divide":
        return ins[0] if ins[1] == 0 else None
    if op == "select":
        return max(ins[1:]) if ins[0] == 0 else None
    if op in _LINEAR and (op != "reduce" or reducer_opcode(instr.attrs["to_apply"]) == "add"):
        return max(ins)
    return 0 if max(ins) == 0 else None


def _ways_back(value: HloInstruction, reads) -> set[HloInstruction]:
    """The values without a batch dimension on a way from `value` into a per-example value;
    `reads(user, operand)`: whether `user` reads `operand` into the examples."""
    leads_back = BackwardDataflow(_ReachesExamples(reads), value.parent)
    found, stack = set(), [value]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user not in found and not reads(user, current) and leads_back.value(user):
                found.add(user)
                stack.append(user)
    return found


def _is_value_of(instr: HloInstruction, fusion: HloInstruction) -> bool:
    """Whether `fusion`'s value is `instr` of its computation, or a reshape of it (XLA's CPU dot
    fusions bitcast a reduction's result)."""
    root = fusion.attrs["calls"].root
    while instr is not root:
        if len(instr.users) != 1 or instr.users[0].opcode not in UNIT_SHAPE_OPS:
            return False
        instr = instr.users[0]
    return True


def _reads_into_examples(user: HloInstruction, operand: HloInstruction, twins: "_Twins", info: dict) -> bool | None:
    """Whether `user`, in XLA's fused entry, reads `operand` into per-example values, by the batch
    dimensions `info` of the inlined twins: True when its value is per example, or when it is a
    fusion in which every way from `operand` to its value passes a per-example instruction (a sum
    over the batch of values computed from `operand`); False when nothing it computes from
    `operand` is per example; None when neither, or a twin is missing."""
    twin = twins.of(None, user)
    if twin is None or twin not in info:
        return False if user.opcode == "tuple" else None   # the outputs; anything else unknown
    if _per_example(twin, info):
        return True
    if user.opcode != "fusion":
        return False
    body = user.attrs["calls"]
    examples: dict[HloInstruction, bool] = {}   # inner instruction -> per example
    for inner in body.post_order():
        if inner.opcode == "parameter":
            continue
        inner_twin = twins.of(user, inner)
        if inner_twin is None or inner_twin not in info:
            return None
        examples[inner] = _per_example(inner_twin, info)
    around = set()   # instructions reached from `operand` without passing a per-example one
    stack = [body.parameter(n) for n, o in enumerate(user.operands) if o is operand]
    through = False
    while stack:
        for reader in stack.pop().users:
            if examples[reader]:
                through = True
            elif reader not in around:
                around.add(reader)
                stack.append(reader)
    if body.root in around or body.root.opcode == "parameter":
        return None if through else False
    return True


def _over_single_devices(all_reduce: HloInstruction) -> bool:
    """An all-reduce whose every group is one device (a `pmean` over a mesh axis of size 1): the identity."""
    groups = all_reduce.attrs.get("replica_groups")
    return isinstance(groups, ReplicaGroups) and bool(groups.groups) and all(len(g) == 1 for g in groups.groups)


def _reaching_examples(comp: HloComputation, info: dict) -> BackwardDataflow:
    """Which values of `comp` something per example is computed from (the output tuple only passes
    its elements on)."""
    return BackwardDataflow(_ReachesExamples(lambda user, _: _per_example(user, info)), comp)


class _ReachesExamples(BackwardLattice):
    """Whether something computed from a value flows back into the examples: reaches an instruction
    that reads its operand into them, `reads_into_examples(user, operand)`."""

    def __init__(self, reads_into_examples):
        self.reads_into_examples = reads_into_examples

    def join(self, a, b):
        return a or b

    def unused(self, instr: HloInstruction):
        return False

    def transfer(self, user: HloInstruction, operand_number: int, user_state):
        return user_state or bool(self.reads_into_examples(user, user.operand(operand_number)))


class _Twins:
    """Which instruction of the inlined, deduplicated entry each instruction of XLA's fused entry
    became: (fusion name, fused instruction name) for what was inside a fusion, (None, name) for
    what was between fusions."""

    _LINEAR_IN_ONE = frozenset({"negate", "convert", "copy", "bitcast", "reshape", "broadcast", "transpose", "slice"})

    def __init__(self, origins: dict, between: dict, merged: dict):
        def resolved(instr):
            while instr in merged:
                instr = merged[instr]
            return instr
        self._twin = {origin: resolved(instr) for instr, origin in origins.items()}
        self._twin.update({(None, name): resolved(instr) for name, instr in between.items()})
        self._reaching: BackwardDataflow | None = None
        self._reaching_info: dict | None = None
        self._copies: dict[HloInstruction, list] = {}   # inlined instruction -> its (fusion, copy) in the fused entry
        self._copies_of: HloComputation | None = None

    def reaches_examples(self, value: HloInstruction, info: dict) -> bool:
        """Whether something computed from `value` (in the inlined entry) is per example; the output
        tuple only passes its elements on."""
        if self._reaching_info is not info:
            reaching = _reaching_examples(value.parent, info)
            self._reaching, self._reaching_info = reaching, info
        return self._reaching.value(value)

    def of(self, fusion: HloInstruction | None, instr: HloInstruction) -> HloInstruction | None:
        """The inlined twin of `instr`, an instruction of `fusion`'s computation (None: of the entry)."""
        if fusion is None and instr.opcode == "fusion":   # a fusion's value is its root's
            return self._twin.get((instr.name, instr.attrs["calls"].root.name))
        return self._twin.get((fusion.name if fusion is not None else None, instr.name))

    def copies(self, entry: HloComputation) -> dict:
        """Inlined instruction -> its copies (fusion, instruction) in XLA's fused `entry` (fusion None:
        between fusions)."""
        if self._copies_of is not entry:
            self._copies = {}
            for instr in entry.instructions:
                inside = instr.attrs["calls"].instructions if instr.opcode == "fusion" else ()
                for fusion, copy in [(instr, i) for i in inside if i.opcode != "parameter"] or [(None, instr)]:
                    self._copies.setdefault(self.of(fusion, copy), []).append((fusion, copy))
            self._copies_of = entry
        return self._copies

    def fused_edges(self, value: HloInstruction, reader: HloInstruction, entry: HloComputation, varying: set,
                    info: dict) -> list | None:
        """("edge", operand, reader) in the fused entry for the inlined edge `value` -> `reader`: the
        operands of the fusion holding each copy of `reader` that `value` is a linear function of
        (with coefficients that do not vary with the groups), or `value` itself between fusions;
        None if there is a copy it cannot place so."""
        copies = self.copies(entry).get(reader, [])
        if not copies:
            return None
        edges = []
        for fusion, copy in copies:
            positions = [k for k, operand in enumerate(reader.operands) if operand is value]
            for k in positions:
                if fusion is None:
                    if self.of(None, copy.operand(k)) is not value:
                        return None
                    edges.append(("edge", copy.operand(k), copy))
                    continue
                inner = copy.operand(k)
                reads = self._linear_reads(fusion, inner, varying)
                if reads is not None and all(_stays_out(fusion, operand, self, info) for operand in reads):
                    edges += [("edge", operand, fusion) for operand in reads]
                elif self._splittable(fusion, inner, info):
                    edges.append(("split", inner, fusion))
                else:
                    return None
        return edges

    def _splittable(self, fusion: HloInstruction, inner: HloInstruction, info: dict) -> bool:
        """Whether `inner` can be computed by a loop fusion of its own (elementwise work on the
        fusion's operands) and read by `fusion` as a new operand: nothing `fusion` computes from it
        is per example or flows back into the examples."""
        ancestors, stack = set(), [inner]
        while stack:
            instr = stack.pop()
            if instr in ancestors:
                continue
            ancestors.add(instr)
            if instr.opcode not in _SPLITTABLE and instr.opcode not in ELEMENTWISE:
                return False
            stack += instr.operands
        return _stays_out_of(fusion, [inner], self, info)

    def _linear_reads(self, fusion: HloInstruction, instr: HloInstruction, varying: set) -> list | None:
        """The operands of `fusion` varying with the groups that `instr` (in its computation) is a
        linear function of, the other values it combines them with not varying; None if it is not one."""
        if instr.opcode == "parameter":
            operand = fusion.operand(instr.parameter_number)
            return [operand] if self.of(None, operand) in varying else []
        if self.of(fusion, instr) not in varying:
            return []
        varies = [o for o in instr.operands if
                  (self.of(None, fusion.operand(o.parameter_number)) if o.opcode == "parameter"
                   else self.of(fusion, o)) in varying]
        op = instr.opcode
        if (op in ("add", "subtract") or op in self._LINEAR_IN_ONE
                or op == "multiply" and len(varies) == 1
                or op == "divide" and varies == [instr.operand(0)] and instr.operand(1) is not instr.operand(0)):
            reads = []
            for operand in dict.fromkeys(varies):
                found = self._linear_reads(fusion, operand, varying)
                if found is None:
                    return None
                reads += [r for r in found if r not in reads]
            return reads
        return None


def _used_parameters(body: HloComputation, operands: list) -> list:
    """Remove the parameters of fused computation `body` nothing reads (XLA refuses them), number
    the others again in order; the `operands` (one per old parameter) of the ones kept."""
    kept = [operands[p.parameter_number] for p in body.parameters if p.users or p is body.root]
    for parameter in [p for p in body.parameters if not p.users and p is not body.root]:
        body.remove_parameter(parameter)
    return kept


def _users_closure(values) -> set:
    """`values` and everything computed from them."""
    found, stack = set(values), list(values)
    while stack:
        for user in stack.pop().users:
            if user not in found:
                found.add(user)
                stack.append(user)
    return found


_SPLITTABLE = frozenset({"parameter", "constant", "broadcast", "bitcast", "reshape", "transpose", "convert", "copy"})


def _stays_out(fusion: HloInstruction, value: HloInstruction, twins: _Twins, info: dict) -> bool:
    """Whether nothing `fusion` computes from its operand `value` is per example or flows back into
    the examples, by the batch dimensions `info` of their inlined twins (one the inlined module no
    longer has answers no)."""
    body = fusion.attrs["calls"]
    return _stays_out_of(fusion, [body.parameter(n) for n, operand in enumerate(fusion.operands)
                                  if operand is value], twins, info)


def _stays_out_of(fusion: HloInstruction, stack: list, twins: _Twins, info: dict) -> bool:
    """Whether nothing `fusion` computes from the instructions `stack` of its computation is per
    example or flows back into the examples."""
    seen: set[HloInstruction] = set()
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            twin = twins.of(fusion, user)
            if twin is None or twin not in info or _per_example(twin, info) or twins.reaches_examples(twin, info):
                return False
            stack.append(user)
    return True


def _gradient(broadcast: HloInstruction, means: set, signatures: set) -> _Gradient | None:
    """A broadcast of `count`-divided value over the reduced dimensions of a statistic's signature."""
    value = broadcast.operand(0)
    while _is_unit_reshape(value) and len(value.users) == 1:
        value = value.operand(0)
    if value in means or len(value.users) != 1 or value.operand_count != 2:
        return None
    dims = tuple(broadcast.attrs["dimensions"])
    for shape, reduced, count in signatures:
        if tuple(broadcast.shape.dims) != shape:
            continue
        kept = tuple(d for d in range(len(shape)) if d not in reduced)
        if tuple(d for d in dims if shape[d] != 1) != tuple(d for d in kept if shape[d] != 1):
            continue
        if set(dims) & set(reduced) - {d for d in reduced if shape[d] == 1}:
            continue
        if _divides_by(value, value.operand(0), count):
            return _Gradient(value, broadcast, (shape, reduced, count), count)
    return None


def _pmap_style(entry: HloComputation, split: dict[int, int]) -> bool:
    """Whether the partitioned entry is a `jax.pmap` step: each mapped argument a slice of one per
    device along the split dimension, and each output one device's slice of a stacked result."""
    outputs = entry.root.operands if entry.root.opcode == "tuple" else [entry.root]
    return (all(entry.parameter(n).shape.dims[d] == 1 for n, d in split.items())
            and all(o.shape.is_array and o.shape.rank and o.shape.dims[0] == 1 for o in outputs))


_IMAGE_PATH = frozenset({"bitcast", "reshape", "copy", "convert", "transpose", "pad", "slice"})


def _image_source(value: HloInstruction) -> HloInstruction | None:
    """The entry parameter a convolution's input is made from by reshaping, converting, padding and
    elementwise ops with broadcast or constant operands (a normalization); None if there is none."""
    while value.opcode != "parameter":
        if value.opcode in _IMAGE_PATH:
            value = value.operand(0)
            continue
        whole = [o for o in value.operands if o.opcode not in ("broadcast", "constant")]
        if value.opcode not in ELEMENTWISE or len(whole) != 1:
            return None
        value = whole[0]
    return value


def _axis_lines(coordinates: dict[int, tuple], axis: int) -> list[list[int]]:
    """The devices along mesh dimension `axis`, in order, one line per position on the other dimensions."""
    lines: dict[tuple, dict[int, int]] = {}
    for device, coords in coordinates.items():
        lines.setdefault(tuple(coords[:axis]) + tuple(coords[axis + 1:]), {})[coords[axis]] = device
    return [[line[p] for p in sorted(line)] for _, line in sorted(lines.items())]


def _parse_groups(text: str) -> list[list[int]]:
    try:
        groups = [[int(x) for x in re.split(r"[\s:+]+", part.strip()) if x] for part in text.split(";") if part.strip()]
    except ValueError:
        raise ValueError(f"groups={text!r} is not groups of positions like 0:1;2:3") from None
    if not groups or any(not g for g in groups) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"groups={text!r}: give groups of the same size, like 0:1;2:3")
    return groups


def _groups_text(groups: list[list[int]]) -> str:
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def _dims_text(dims) -> str:
    return "[" + ",".join(map(str, dims)) + "]"


def _describe(signature) -> str:
    shape, reduced, count = signature
    return f"dims {{{','.join(map(str, reduced))}}} of {_dims_text(shape)} ({count} elements)"
