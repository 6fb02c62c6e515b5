"""`weight-update-sharding`: shard the optimizer update across data-parallel devices.

Xu et al. 2020 (arXiv 2004.13336). In data-parallel training every device all-reduces
the gradients and then runs the same optimizer update on the full weights and
optimizer state. This pass turns the all-reduce into a reduce-scatter, has each
device update only its slice of the weights and state (dynamic-slice at an offset
computed from its replica-id/partition-id and the replica groups), and all-gathers
the updated values: the same bytes on the wire, 1/N of the update's work and
temporaries per device. Momentum SGD on 8 replicas (scalar broadcasts written inline)::

    g  = f32[64,16] all-reduce(grad), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
    m1 = f32[64,16] add(multiply(m, broadcast(0.9)), g)
    w1 = f32[64,16] subtract(w, multiply(m1, broadcast(0.1)))
    ROOT out = (f32[64,16], f32[64,16]) tuple(w1, m1)

becomes (the update's instructions keep their names and now compute shards)::

    g.scatter    = f32[8,16] reduce-scatter(grad), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=add
    shard_index  = s32[] convert(replica-id())
    shard_offset = s32[] multiply(shard_index, shard_size)          // shard_size = 8
    m.shard      = f32[8,16] dynamic-slice(m, shard_offset, zero), dynamic_slice_sizes={8,16}
    w.shard      = f32[8,16] dynamic-slice(w, shard_offset, zero), dynamic_slice_sizes={8,16}
    m1           = f32[8,16] add(multiply(m.shard, broadcast(0.9)), g.scatter)
    w1           = f32[8,16] subtract(w.shard, multiply(m1, broadcast(0.1)))
    w1.gathered  = f32[64,16] all-gather(w1), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
    m1.gathered  = f32[64,16] all-gather(m1), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
    ROOT out = (f32[64,16], f32[64,16]) tuple(w1.gathered, m1.gathered)

What is sharded is found by walking the graph, not by matching optimizers: from each
all-reduce of a floating-point gradient (an array all-reduce, a leaf of a combined
tuple all-reduce, or an all-reduce of an all-reduced value as JAX emits for pmean of
an invariant gradient), the update region grows through elementwise instructions of
the gradient's shape (and `kLoop` fusions made only of such instructions), forward to
its users and backward to operands used only inside it (`analysis/dataflow.py`'s engine:
a user is judged once all its operands are). It also takes in statistics that
span some of the gradient's dimensions (Adafactor's factored second moments): a reduce
of some dimensions of a region value, elementwise instructions on such values, and their
broadcasts back to the gradient's shape. Inside the region every value becomes its shard
(in place: a new shape and new operands); scalar broadcasts stay broadcasts; other
operands, which must be the same on every device of the group (weights, optimizer
state), are dynamic-sliced. A statistic that keeps the split dimension is split too (its
state sliced, its new value gathered); a reduce along the split dimension reduces the
shard and an all-reduce of the partial results makes the whole statistic, which every
device then computes with (its state read whole); a statistic needs a split dimension,
not a flattened shard. Values leaving the step (through
the root) are all-gathered; a full reduction (global-norm clipping, LAMB/LARS trust
ratios) becomes a reduction of the shard plus an all-reduce of the partial results; a
fusion that computes such norms or statistics is inlined first, and XLA:CPU's two-step sums
(a block reduce-window of partial sums, then a reduce of those) are read as one reduction.
Anything else keeps the weight
replicated, with the reason in the report (`pass.report`, and the `xla_passes` logger).
With `persistent=true` the optimizer state stays sharded between steps: in an entry
computation its parameter and output become shards; in a Shardy shard_map body they become
shards and the split moves into the shard_map's and the entry's shardings (global shapes
unchanged). docs/weight_update_sharding.md has the options, the report and the limits.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re

import numpy as np

from hlo_tools import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.ir import sdy
from hlo_tools.ir.attributes import FrontendAttributes, PaddingConfig, ReplicaGroups, Sharding, SliceSpec
from hlo_tools.ir.literal import Literal, numpy_dtype
from hlo_tools.ir.opcodes import ELEMENTWISE, has_side_effect
from hlo_tools.ir.shape import FLOAT_DTYPES
from hlo_tools.ir.shape_inference import infer_shape

from ..analysis.collectives import reducer_opcode, slices_are_contiguous
from ..analysis.dataflow import BackwardDataflow, BackwardLattice, ForwardDataflow, ForwardLattice
from ..analysis.elementwise import elementwise_like, is_scalar_broadcast
from ..analysis.reachability import operand_connected_components
from ..analysis.reductions import (full_reduction_of, is_collapsible_block_reduction, is_norm_fusion,
                                   is_statistics_fusion, reduces_from_identity)
from ..analysis.reorderings import (is_one_element_constant, moved_dimensions, reduced_in_any_order,
                                    reordered_chain, reordering, reordering_in_fusion, statistics_broadcasts)
from ..analysis.replica_groups import DeviceCounts
from ..analysis.replication_analysis import (REPLICA_IDS, REPLICATION, ReplicationAnalysis, cached_replication_analysis,
                                             participants)
from ..core import HloPass, PassContext, register_pass
from ..rewrites.inlining import inline

logger = logging.getLogger("xla_passes")

# Instructions that pass a value on unchanged in content on its way out of the step.
_FORWARDING = frozenset({"tuple", "reshape", "bitcast", "copy"})


@dataclasses.dataclass
class WeightReport:
    """What the pass did with one weight: the update region of one gradient all-reduce.

    `weights` are the full-size values the update reads besides the gradient (the
    weight and its optimizer state), named after the parameters they come from.
    """

    computation: str
    gradient: str
    shape: str
    weights: tuple[str, ...]
    sharded: bool
    group_size: int = 0
    dimension: int | None = None   # the dimension split across the group; None when flattened
    padding: int = 0               # elements added so that the flattened weight splits evenly
    shard_bytes: int = 0           # bytes of one device's shard of the gradient
    reason: str = ""               # why the weight stayed replicated
    signature: str = ""            # persistent: the parameters and outputs that became shards

    def __str__(self) -> str:
        what = f"{self.gradient} {self.shape}"
        if self.weights:
            what += f" ({', '.join(self.weights)})"
        if not self.sharded:
            return f"weight-update-sharding: kept {what}: {self.reason}"
        how = f"dimension {self.dimension}" if self.dimension is not None else (
            f"flattened with {self.padding} elements of padding" if self.padding else "flattened")
        text = (f"weight-update-sharding: sharded {what} over {self.group_size} devices, {how}: "
                f"{self.shard_bytes} bytes per device")
        return text + (f"; {self.signature}" if self.signature else "")


@register_pass
class WeightUpdateSharding(HloPass):
    """Reduce-scatter gradients, update 1/N of the weights per device, all-gather them."""

    name = "weight-update-sharding"
    opcodes = {"all-reduce"}
    sees_into_calls = True   # LARS and LAMB norms are calls (`jnp.linalg.norm`)
    threshold_bytes: int = 1024               # gradients smaller than this stay replicated
    assume_replicated_parameters: bool = False  # pmap-style programs: parameters hold equal copies
    persistent: bool = False                  # keep optimizer state sharded between steps

    def __post_init__(self):
        self.report: list[WeightReport] = []

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        self.report = []
        context = context or PassContext()
        changed = False
        for comp in list(module.computations):
            if any(i.opcode == "all-reduce" for i in comp.instructions):
                rewriter = _ComputationSharder(self, module, comp, context)
                changed |= rewriter.run()
                self.report.extend(rewriter.reports)
        if self.persistent and not self.report and _before_partitioning(module):
            annotator = _StateShardingForPartitioner(self, module)
            changed |= annotator.run()
            self.report.extend(annotator.reports)
        for entry in self.report:
            logger.info("%s", entry)
        return changed


# -- the gradients ------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class _Leaf:
    """One array of an all-reduce (the whole all-reduce, or one element of a combined one)."""

    all_reduce: HloInstruction
    index: int | None                  # tuple index; None for an array all-reduce
    values: list[HloInstruction]       # the instructions that carry it: the all-reduce or its GTEs

    @property
    def operand(self) -> HloInstruction:
        return self.all_reduce.operand(self.index or 0)

    @property
    def shape(self) -> Shape:
        return self.operand.shape

    def describe(self) -> str:
        suffix = f"[{self.index}]" if self.index is not None else ""
        return f"%{self.all_reduce.name}{suffix}"


def _is_sum_all_reduce(instr: HloInstruction) -> bool:
    if instr.opcode != "all-reduce":
        return False
    reducer = instr.attrs.get("to_apply")
    return reducer is not None and reducer_opcode(reducer) == "add"


def _group_key(all_reduce: HloInstruction):
    """(id space, groups) of a collective, or None when the module does not say who takes part."""
    found = participants(all_reduce)
    return None if found is None else (found[0], tuple(tuple(g) for g in found[1]))


# -- the plan for one weight ------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """How a weight of `full_dims` splits over `group_size` devices."""

    full_dims: tuple[int, ...]
    group_size: int
    dimension: int | None      # None: flattened (and padded when needed)

    @property
    def elements(self) -> int:
        return math.prod(self.full_dims)

    @property
    def padded_elements(self) -> int:
        return -(-self.elements // self.group_size) * self.group_size

    @property
    def shard_dims(self) -> tuple[int, ...]:
        if self.dimension is None:
            return (self.padded_elements // self.group_size,)
        dims = list(self.full_dims)
        dims[self.dimension] //= self.group_size
        return tuple(dims)

    @property
    def split_size(self) -> int:
        """Elements of the split dimension in one shard (what a device's offset counts in)."""
        return self.shard_dims[0 if self.dimension is None else self.dimension]

    def shard_shape(self, shape: Shape) -> Shape:
        if self.dimension is not None:
            return shape.with_dims(self.shard_dims)
        return _with_layout_like(Shape.array(shape.dtype, self.shard_dims), shape)

    def projection_shard_shape(self, shape: Shape, axes: tuple[int, ...]) -> Shape:
        """One device's part of a value that spans the weight's dimensions `axes` (a row or column
        statistic): split where it spans the split dimension, else the whole value."""
        if axes == tuple(range(len(self.full_dims))):
            return self.shard_shape(shape)
        return shape.with_dims(tuple(size // self.group_size if axis == self.dimension else size
                                     for axis, size in zip(axes, shape.dims)))


def _choose_plan(shape: Shape, group_size: int, collective_shapes: list[Shape], layouts_final: bool) -> _Plan:
    """Split the most major dimension that divides evenly; else flatten.

    In a module whose layouts are final, `collective_shapes` are the laid-out shapes the
    reduce-scatter and all-gathers will read and write: a dimension qualifies only where it
    makes contiguous slices in every one of them (`slices_are_contiguous`), since after layout
    assignment nobody fixes the layout of a new collective (elsewhere pass []). A flattened
    shard is contiguous whatever the layout: reshaping a laid-out array to one dimension follows
    its logical order, which XLA does as a bitcast where it can. Layouts that are not final are
    XLA's to choose later (it makes a collective's dimension most major): dimensions are tried
    in logical order then, which for the default layouts of weights is the contiguous one.
    """
    dims = shape.dims
    major_to_minor = tuple(reversed(shape.layout.minor_to_major)) if shape.layout and layouts_final \
        else tuple(range(len(dims)))
    for dim in major_to_minor:
        if (dims[dim] >= group_size and dims[dim] % group_size == 0
                and all(slices_are_contiguous(s, dim) for s in collective_shapes)):
            return _Plan(dims, group_size, dim)
    return _Plan(dims, group_size, None)


def _with_layout_like(shape: Shape, like: Shape) -> Shape:
    """`shape` with the default layout when `like` has a layout (modules after layout assignment)."""
    return shape.with_default_layout() if like.layout is not None else shape


# -- one computation ---------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class _Region:
    """The update region of one weight: members computed at shard shape, and how values leave it."""

    key: tuple | None                                  # (id space, groups); None when unknown
    members: list[HloInstruction]                      # in post order
    tops: list[_Leaf]                                  # the gradient leaves whose values seed it
    sliced: list[HloInstruction]                       # full-size operands taken by dynamic-slice
    member_set: frozenset = frozenset()
    # (member, user) where a value leaves the step; user None when the member is the root
    outputs: list[tuple[HloInstruction, HloInstruction | None]] = dataclasses.field(default_factory=list)
    reductions: list[HloInstruction] = dataclasses.field(default_factory=list)  # full reduces of members
    # (member, user) uses that keep the weight replicated, and why the first one does
    blocking: list[tuple[HloInstruction, HloInstruction]] = dataclasses.field(default_factory=list)
    blocking_reason: str = ""
    # member -> the weight's dimensions it spans, for members that span fewer than all of them:
    # statistics reduced along some dimensions (Adafactor's row and column means), in order
    projections: dict = dataclasses.field(default_factory=dict)
    plan: _Plan | None = None
    report: WeightReport | None = None

    def axes(self, member: HloInstruction) -> tuple[int, ...]:
        return self.projections.get(member, tuple(range(len(self.tops[0].shape.dims))))

    def split(self, member: HloInstruction) -> bool:
        """Whether each device holds a part of `member` (else every device computes all of it)."""
        return self.plan.dimension is None or self.plan.dimension in self.axes(member)

    def shard_shape(self, member: HloInstruction) -> Shape:
        return self.plan.projection_shard_shape(member.shape, self.axes(member))


class _ComputationSharder:
    """Finds the update regions of one computation and rewrites those that can be sharded."""

    def __init__(self, hlo_pass: WeightUpdateSharding, module: HloModule, comp: HloComputation,
                 context: PassContext):
        self.options = hlo_pass
        self.module = module
        self.comp = comp
        self.context = context
        self.reports: list[WeightReport] = []
        self._positions: dict[tuple, HloInstruction] = {}
        self._offsets: dict[tuple, HloInstruction] = {}
        self._zero_index: HloInstruction | None = None
        self._pad_values: dict[str, HloInstruction] = {}
        self._dead: list[HloInstruction] = []
        self._callers = module.callers()
        self._op_names_of: dict[HloComputation, set[str]] = {}
        self._unhoisted: dict[HloInstruction, str] = {}  # gradient value -> why its reordering stayed

    def _shared_op_names(self, comp: HloComputation) -> set[str]:
        """The op_names that several parameters of `comp` carry."""
        if comp not in self._op_names_of:
            counts = collections.Counter(map(_parameter_op_name, comp.parameters))
            self._op_names_of[comp] = {name for name, count in counts.items() if name is not None and count > 1}
        return self._op_names_of[comp]

    # -- analysis ----------------------------------------------------------------------------------
    def run(self) -> bool:
        """Analyse (inlining the fusions that stand in the way, then again), judge, rewrite.

        Inlining a fusion unfuses what XLA fused (and may change how its float sums round), so it
        stands only where it lets a weight shard: when every region a fusion was inlined for stays
        replicated, the computation goes back to how it was and is analysed again without it."""
        checkpoint = self.module.checkpoint()
        if not self.module.layouts_final:
            _fold_unit_reshapes(self.comp)
        held_back: set[HloInstruction] = set()   # uses whose inlining let no weight shard
        looked_inside: dict[str, WeightReport] = {}   # kept with those uses inlined: the reason found there
        while True:
            self.reports, self._unhoisted = [], {}
            unfused = self._hoist_gradient_reorderings()
            regions, chains, fixed_for = self._analyse(held_back)
            for region in regions:
                self._judge(region, chains)
            sharded = {top.describe() for region in regions if region.plan is not None for top in region.tops}
            wasted = {use for use, tops in fixed_for.items() if not tops & sharded}
            if not wasted:
                break
            held_back |= wasted
            looked_inside.update((r.gradient, r) for r in self.reports if not r.sharded)
            checkpoint.restore()
        for report in self.reports:
            if not report.sharded and report.gradient in looked_inside:
                report.reason, report.weights = looked_inside[report.gradient].reason, looked_inside[report.gradient].weights
        accepted = [r for r in regions if r.plan is not None]
        if not accepted:
            checkpoint.restore()   # nothing to shard: no reordering, inlining or folding either
            self.context.forget(REPLICATION)
            return False
        self._rewrite(accepted, chains)
        self.context.forget(REPLICATION)
        return True

    def _analyse(self, held_back: set) -> tuple[list["_Region"], dict, dict]:
        """The update regions, their chains, and for each use inlined or collapsed on the way
        (`_is_fixable_use`; not those `held_back`) the gradients of the regions it stood in."""
        fixed_for: dict[HloInstruction, set[str]] = {}
        while True:
            # Folding, hoisting, inlining and restoring a checkpoint rewrite the computation: ask again.
            self.context.forget(REPLICATION)
            self._order = {instr: i for i, instr in enumerate(self.comp.post_order())}
            leaves = self._gradient_leaves()
            chains = self._chains(leaves)
            regions = self._regions(chains)
            # Uses that are reductions in disguise: fusions that compute norms or row and column
            # statistics (inlined: their reductions and broadcasts then join the region), and XLA:CPU's
            # reduce-windows of partial sums that are summed again (collapsed into one reduction);
            # then look again.
            fixable = {}
            for region in regions:
                if not self._problem(region) and all(_is_fixable_use(u) and u not in held_back
                                                     for _, u in region.blocking):
                    for _, user in region.blocking:
                        fixable.setdefault(user, set()).update(top.describe() for top in region.tops)
            if not fixable:
                return regions, chains, fixed_for
            for user in sorted(fixable, key=self._order.get):
                fixed_for.setdefault(user, set()).update(fixable[user])
                if user.parent is not self.comp:
                    continue  # inlined with a fusion that reduced it
                if user.opcode == "fusion":
                    _inline_fusion(user)
                elif is_collapsible_block_reduction(user):
                    _collapse_block_reduction(user)

    def _hoist_gradient_reorderings(self) -> bool:
        """Reorder gradients before their all-reduce where XLA fused the reordering into the update.

        XLA computes a Dense kernel's gradient transposed (`f32[256,32]` for a `[32,256]` weight)
        and, after fusion, transposes it inside each fusion of the update; in a pmap step the
        update bitcasts the gradient to the parameters' `[1, ...]` per-device shape::

            g  = f32[256,32] all-reduce(dot), ...
            mu = f32[32,256] fusion(mu0, g), calls={p1 -> multiply(b, p1) -> transpose -> copy -> add}

        A sum commutes with moving elements, so this becomes `all-reduce(transpose(dot))` (or
        `reshape`) and each fusion reads the gradient in the weight's order, at the weight's
        shape: an elementwise update that the pass can shard. The transpose moves from the
        reduced gradient, once per fusion, to the local one, once.

        With a bfloat16 loss XLA converts the gradient right after the all-reduce and the fusions
        read the converted one: the search goes on through such converts (`_converts_of`), which
        commute with a reordering exactly, and they convert the reordered gradient.

        LARS reads the gradient through the transpose (the update, one norm) and also without
        it (optax's safe norm of it). Those reads take the reordered gradient too, which is only
        correct because all that becomes of them is full reductions (`reduced_in_any_order`):
        the same elements, combined in another order. Adafactor's row and column statistics read
        it without the transpose too, reducing some of its dimensions: those reduce the moved
        dimensions of the reordered gradient, the same sums as long as the transpose keeps the
        kept dimensions in order (else the result would need a transpose of its own); and its
        update scales the gradient by the statistics broadcast along its dimensions before the
        transpose: those broadcasts follow the transpose (`statistics_broadcasts`). Where a read
        does anything else, nothing is hoisted and the report says why (`self._unhoisted`).
        """
        self._order = {instr: i for i, instr in enumerate(self.comp.post_order())}
        hoisted = False
        for leaf in self._gradient_leaves():
            if leaf.shape.byte_size < self.options.threshold_bytes or not _is_gradient_shape(leaf.shape):
                continue
            hoisted |= self._lift_update_reshapes(leaf)
            converts = _converts_of(leaf.values)
            carriers = leaf.values + converts
            if any(v.is_root for v in carriers):
                continue
            reordered, direct = {}, []
            for value in carriers:
                for user in value.users:
                    key = reordering_in_fusion(user, value)
                    if key is not None:
                        reordered[user] = key
                    elif user not in direct and user not in converts:
                        direct.append(user)
            if not reordered:
                continue
            refusal = _hoisting_refusal(carriers, reordered, direct)
            if refusal:
                self._unhoisted.update(dict.fromkeys(leaf.values, refusal))
                continue
            _hoist_reordering(self.module, leaf, converts, next(iter(reordered.values())), direct)
            hoisted = True
        return hoisted

    def _lift_update_reshapes(self, leaf: "_Leaf") -> bool:
        """`_lift_reshapes` in every fusion that the update reaches from `leaf` through values at
        its shape: the gradient's own users, and the fusions after them (LAMB's trust ratio
        scales the update in one fusion, and a second adds it to the `[1, ...]` weight of a
        pmap step, bitcasting on the way in and out)."""
        dims = leaf.shape.dims
        lifted, seen, work = False, set(), list(leaf.values)
        while work:
            for user in work.pop().users:
                if user in seen:
                    continue
                seen.add(user)
                if user.opcode == "fusion":
                    lifted |= _lift_reshapes(self.module, user, dims)
                if user.shape.is_array and user.shape.dims == dims and elementwise_like(user, dims):
                    work.append(user)
        return lifted

    def _gradient_leaves(self) -> list[_Leaf]:
        """Every used leaf of every sum all-reduce (a combined one used other than through
        get-tuple-element is left alone)."""
        leaves = []
        for instr in self._order:
            if not _is_sum_all_reduce(instr):
                continue
            if not instr.shape.is_tuple:
                leaves.append(_Leaf(instr, None, [instr]))
            elif instr.users and all(u.opcode == "get-tuple-element" for u in instr.users) and not instr.is_root:
                for index in range(instr.operand_count):
                    values = [u for u in instr.users if u.attrs["index"] == index]
                    if values:
                        leaves.append(_Leaf(instr, index, values))
        return leaves

    def _chains(self, leaves: list[_Leaf]) -> dict[_Leaf, list[_Leaf]]:
        """For each gradient leaf that is not itself summed again: its chain of all-reduces.

        JAX emits all-reduce(all-reduce(x)) for pmean of a gradient that is already summed:
        the outer sum of a group-uniform value is that value times the group size, so the
        chain becomes one reduce-scatter of x and a multiplication.
        """
        by_value = {v: leaf for leaf in leaves for v in leaf.values}
        inner = {}
        for leaf in leaves:
            users = [u for v in leaf.values for u in v.users]
            if (len(users) == 1 and _is_sum_all_reduce(users[0]) and not any(v.is_root for v in leaf.values)
                    and _group_key(users[0]) == _group_key(leaf.all_reduce)
                    and _group_key(users[0]) is not None):
                inner[leaf] = users[0]
        chains = {}
        for leaf in leaves:
            if leaf in inner or not _is_gradient_shape(leaf.shape):
                continue
            chain = [leaf]
            while chain[-1].operand in by_value and by_value[chain[-1].operand] in inner:
                chain.append(by_value[chain[-1].operand])
            chains[leaf] = chain
        return chains

    def _analysis(self, key, *, assume_replicated_parameters: bool | None = None) -> ReplicationAnalysis:
        """Replication within the groups of `key`, taking parameters as replicated when the
        option says so (or when `assume_replicated_parameters` overrides it): the context's
        analysis, which `_analyse` forgets before each look at a computation it rewrote."""
        assume = self.options.assume_replicated_parameters if assume_replicated_parameters is None \
            else assume_replicated_parameters
        space, groups = key
        return cached_replication_analysis(self.context, self.comp, [list(g) for g in groups], space,
                                           assume_replicated_parameters=assume)

    def _regions(self, chains: dict[_Leaf, list[_Leaf]]) -> list[_Region]:
        """Grow the update regions from the gradient leaves with the same groups and shape."""
        seeds_by_key: dict[tuple, list[_Leaf]] = {}
        regions = []
        for top in chains:
            key = _group_key(top.all_reduce)
            if key is None:
                regions.append(_Region(None, list(top.values), [top], []))
                continue
            seeds_by_key.setdefault((key, top.shape.dims), []).append(top)
        for (key, dims), tops in seeds_by_key.items():
            regions.extend(self._grow(key, dims, tops))
        return regions

    def _grow(self, key, full_dims, tops: list[_Leaf]) -> list[_Region]:
        """The regions of gradient leaves `tops`: forward from them (`_UpdateSpans`), then back to the
        replicated operands used only inside (`_PulledIn`); one region per connected set of members."""
        spans = _UpdateSpans(self.comp, tops, full_dims, self._analysis(key), self._order)
        pulling = _PulledIn(spans)
        grown = [v for v in spans.reached if spans.span(v) is not None]
        inside = _read_only_inside(grown, pulling.may_pull)
        candidates = sorted((v for v in inside if v in self._order), key=self._order.get)
        users = BackwardDataflow(pulling, self.comp, within=candidates, positions=self._order)
        members = {v: axes for v in candidates if (axes := pulling.span(v, users.value(v))) is not None}
        components = sorted(operand_connected_components(set(members)), key=lambda c: min(self._order[m] for m in c))
        projections = {m: axes for m, axes in members.items() if axes != spans.all_axes}
        return [self._describe_region(key, component, tops, spans.blocked, projections) for component in components]

    def _describe_region(self, key, component: set, tops: list[_Leaf], blocked, projections) -> _Region:
        """The region of one connected set of members: what it slices, where its values go."""
        order = sorted(component, key=self._order.get)
        region_tops = [t for t in tops if t.values[0] in component]
        sliced = []
        for member in order:
            if member in {v for t in region_tops for v in t.values}:
                continue
            for operand in member.operands:
                if (operand not in component and operand not in sliced and operand.shape.rank > 0
                        and not is_scalar_broadcast(operand)):
                    sliced.append(operand)
        region = _Region(key, order, region_tops, sliced, frozenset(order),
                         projections={m: a for m, a in projections.items() if m in component})
        for member in order:
            if member.is_root:
                region.outputs.append((member, None))
            for user in member.users:
                if user in component:
                    continue
                if user not in blocked and self._leaves_step(user):
                    region.outputs.append((member, user))
                elif full_reduction_of(user, member) and self._analysis(key).is_replicated(user.operand(1)):
                    region.reductions.append(user)
                else:
                    region.blocking.append((member, user))
        # The reason names a use that stops the weight: a norm fusion or a reduce-window of partial
        # sums stops it only when nothing else does (`run` takes them apart otherwise); control flow
        # that the update continues in is named first, as no other fix would let the weight shard.
        stopping = [(m, u) for m, u in region.blocking
                    if u in blocked or not _is_fixable_use(u)]
        stopping.sort(key=lambda use: _control_flow_entered(use[1]) is None)
        for member, user in stopping[:1] or region.blocking[:1]:
            region.blocking_reason = _mixed_spans_reason(user, component, projections) or _use_reason(
                member, user, blocked.get(user))
        return region

    def _leaves_step(self, user: HloInstruction) -> bool:
        """Whether `user` only passes the value on to the computation's result (the step's outputs)."""
        if user.is_root:
            return True
        return user.opcode in _FORWARDING and bool(user.users) and all(self._leaves_step(u) for u in user.users)

    def _judge(self, region: _Region, chains: dict[_Leaf, list[_Leaf]]) -> None:
        """Set the region's plan, or find why it stays replicated; record the report."""
        shape = region.tops[0].shape
        group_size = len(region.key[1][0]) if region.key else 0
        reason = self._problem(region)
        if not reason and region.blocking_reason:  # and why a reordering that stops it was not hoisted
            reason = region.blocking_reason + "".join(
                dict.fromkeys(self._unhoisted.get(v, "") for t in region.tops for v in t.values))
        if not reason and not region.sliced:
            reason = "no update: the gradient is not combined with weights or optimizer state"
        if not reason:
            collective_shapes = []
            if self.module.layouts_final:
                collective_shapes = [leaf.operand.shape for top in region.tops for leaf in chains[top]]
                collective_shapes += [member.shape for member in region.members if member not in region.projections]
            region.plan = _choose_plan(shape, group_size, collective_shapes, self.module.layouts_final)
            reason = self._projection_problem(region)
            if reason:
                region.plan = None
        plan = region.plan
        report = WeightReport(
            computation=self.comp.name, gradient=", ".join(t.describe() for t in region.tops),
            shape=shape.to_text(print_layout=False),
            weights=tuple(dict.fromkeys(_origin_name(v, self._callers, self._shared_op_names)
                                        for v in region.sliced or self._weights_beside(region))),
            sharded=plan is not None, group_size=group_size, reason=reason)
        if plan is not None:
            report.dimension = plan.dimension
            report.padding = plan.padded_elements - plan.elements if plan.dimension is None else 0
            report.shard_bytes = plan.shard_shape(shape).byte_size
        region.report = report
        self.reports.append(report)

    def _projection_problem(self, region: _Region) -> str:
        """Why the statistics that span some of the weight's dimensions cannot follow the plan
        ("" when they can): they split along the plan's dimension, which a flattened shard has not,
        in slices that the all-gather of a laid-out statistic can assemble."""
        if not region.projections:
            return ""
        first = next(iter(region.projections))
        if region.plan.dimension is None:
            return (f"%{first.name} reduces the update along some of its dimensions, and no dimension of "
                    f"{region.tops[0].shape.to_text(print_layout=False)} splits evenly over "
                    f"{region.plan.group_size} devices (a flattened shard has no rows or columns)")
        if self.module.layouts_final:
            for member, axes in region.projections.items():
                if region.split(member) and not slices_are_contiguous(
                        member.shape, axes.index(region.plan.dimension)):
                    return f"%{member.name} is not split into contiguous slices by its layout"
        return ""

    def _weights_beside(self, region: _Region) -> list[HloInstruction]:
        """For a region that stopped before reaching any weight: the parameters that the uses
        which stopped it combine with the gradient (the weight and state of an update XLA fused
        with a transpose of the gradient, say), so that the report can name the weight."""
        found = []
        for _, user in region.blocking:
            for operand in user.operands:
                source = operand
                while source.opcode in ("bitcast", "copy", "reshape", "get-tuple-element") and source.operand_count:
                    source = source.operand(0)
                if source.opcode == "parameter" and source not in found:
                    found.append(source)
        return found

    def _problem(self, region: _Region) -> str:
        """Why the region stays replicated whatever its uses: its groups or its size ("" if neither)."""
        if region.key is None:
            return ("the module does not say which devices take part in it (empty replica groups or device "
                    "counts missing)")
        size = region.tops[0].shape.byte_size
        if size < self.options.threshold_bytes:
            return f"tiny: {size} bytes is below threshold_bytes={self.options.threshold_bytes}"
        return self._addressing_problem(*region.key)

    def _addressing_problem(self, space: str, groups) -> str:
        """Why devices cannot find their shard for these groups ("" when they can)."""
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            return "its replica groups have different sizes"
        if sizes == {1}:
            return "its replica groups have one device each"
        counts = DeviceCounts.of(self.module)
        if space != REPLICA_IDS and (counts.replicas or 1) > 1 and counts.partitions is None:
            return "the module has several replicas but does not say how many partitions"
        return ""

    # -- rewrite -----------------------------------------------------------------------------------
    def _rewrite(self, regions: list[_Region], chains: dict[_Leaf, list[_Leaf]]) -> None:
        """Rewrite the accepted regions. Members become their shards in place (a new shape and
        new operands), so that the rewrite removes little: removing instructions is what costs."""
        self._next_channel = max((i.attrs.get("channel_id") or 0 for i in self.module.instructions()), default=0) + 1
        self._callers = self.module.callers()
        scattered = self._scatter_gradients(regions, chains)
        persistent = self.options.persistent and self.comp.is_entry and self.comp.root.opcode == "tuple"
        boundary = _ShardMapBoundary.of(self.module, self.comp) if self.options.persistent else None
        sharded_outputs: dict[int, _Region] = {}
        for region in regions:
            shards: dict[HloInstruction, HloInstruction] = {}  # full-size value -> its shard in this region
            for top in region.tops:
                shard = self._gradient_shard(region, chains[top], scattered)
                for value in top.values:
                    shards[value] = shard
            kept_sharded = self._keep_state_sharded(region, shards, boundary) if persistent or boundary else set()
            if self.options.persistent and not (persistent or boundary):
                region.report.signature = (f"persistent: not applied, the update is in %{self.comp.name}, neither "
                                           f"an entry computation that returns a tuple nor the body of a Shardy "
                                           f"shard_map that the entry calls")
            full_shapes = {member: member.shape for member in region.members}
            for member in region.members:
                if member not in shards:
                    self._shard_in_place(region, member, shards)
            self._route_outputs(region, shards, kept_sharded, full_shapes)
            self._route_reductions(region, shards)
            self._dead.extend(value for top in region.tops for value in top.values)
            sharded_outputs.update({index: region for index in kept_sharded})
        root_name = self.comp.root.name
        if sharded_outputs:
            self._retype_root(sharded_outputs)
            if boundary is not None:
                boundary.retype_call()
        self._remove_dead()
        if self.comp.root.name != root_name:
            self.comp.root.rename(root_name)
        self.comp.sort_topologically()

    def _keep_state_sharded(self, region: _Region, shards, boundary: "_ShardMapBoundary | None") -> set[int]:
        """`persistent`: make the parameters that only the update reads (optimizer state) shards
        of themselves, and return the output indices that hand their new value back as shards.

        An output carries the new value of the parameter that input_output_alias pairs it with,
        or, without aliasing, of the parameter with its own index (JAX returns the state in the
        order it takes it). In a shard_map body (`boundary`) the pairing is the entry's, and the
        entry parameter and output keep their global shape with a sharding split over the group.
        """
        members = set(region.members)
        root = self.comp.root
        output_of = {number: index for index, number in _output_parameters(self.module, root.operand_count).items()}
        changes, outputs, refused = [], set(), []
        for value in region.sliced:
            if value.opcode != "parameter":
                continue
            number = value.parameter_number
            index = output_of.get(number) if boundary is None else boundary.body_output_of(number)
            if index is None or root.operand(index) not in members or not all(u in members for u in value.users):
                continue  # the state must come in and go out through this update alone
            if value.shape.dims != region.plan.full_dims:
                if region.split(root.operand(index)):
                    refused.append(f"%{value.name} stays full: a statistic that spans some of the weight's "
                                   f"dimensions is gathered after each step")
                continue
            spec = None
            if boundary is not None:
                spec, problem = boundary.split_spec(number, index, region.plan, region.key)
                if spec is None:
                    refused.append(f"%{value.name} stays full: {problem}")
                    continue
            full = value.shape
            value.set_shape(region.plan.shard_shape(full))
            shards[value] = value
            outputs.add(index)
            if boundary is not None:
                changes.append(boundary.keep_sharded(number, index, spec) +
                               f" (the shard_map body takes and returns {value.shape.to_text(print_layout=False)})")
                continue
            if region.key[0] != REPLICA_IDS:
                value.attrs["sharding"] = self._tile_sharding(region, value.shape.rank)
            elif "parameter_replication" in value.attrs:
                del value.attrs["parameter_replication"]  # each replica now holds a different shard
            changes.append(f"parameter {number} (%{value.name}) {full} -> {value.shape}")
        if boundary is None:
            for index in sorted(outputs):
                full = root.operand(index).shape
                changes.append(f"output {index} {full} -> {region.plan.shard_shape(full)}")
        if changes or refused:  # a shard_map change lists an output itself: ";" between changes
            listed = (", " if boundary is None else "; ").join(changes)
            region.report.signature = "persistent: " + "; ".join(filter(None, [listed, *refused]))
        return outputs

    def _tile_sharding(self, region: _Region, rank: int) -> Sharding:
        """The sharding of a shard parameter or output: tile k of the split dimension on the
        k-th device of every group (replicated across the groups)."""
        groups = region.key[1]
        tile_dims = [1] * rank
        tile_dims[region.plan.dimension or 0] = region.plan.group_size
        devices = [group[k] for k in range(region.plan.group_size) for group in groups]
        if len(groups) == 1:
            return Sharding.tiled(tile_dims, devices)
        return Sharding.tiled(tile_dims + [len(groups)], devices, last_tile_dim_replicate=True)

    def _retype_root(self, sharded_outputs: dict[int, _Region]) -> None:
        """A new root tuple for outputs that became shards (its shape and sharding changed)."""
        root = self.comp.root
        attrs = dict(root.attrs)
        sharding = attrs.get("sharding")
        partitioned = any(r.key[0] != REPLICA_IDS for r in sharded_outputs.values())
        if self.comp.is_entry and (sharding is not None or partitioned):  # a shard_map body's are per-device
            elements = list(sharding.elements) if sharding is not None and sharding.kind == "tuple" else \
                [sharding or Sharding.replicated()] * root.operand_count
            for index, region in sharded_outputs.items():
                if region.key[0] != REPLICA_IDS:
                    elements[index] = self._tile_sharding(region, root.operand(index).shape.rank)
            attrs["sharding"] = Sharding.tuple_of(elements)
        shape = Shape.tuple([o.shape for o in root.operands])
        new_root = self._add("tuple", root.operands, shape, attrs=attrs, name=root.name)
        self.comp.set_root(new_root)
        self._dead.append(root)

    def _scatter_gradients(self, regions, chains) -> dict[_Leaf, HloInstruction]:
        """Replace the chains' all-reduce leaves: reduce-scatters for the bottom leaves whose operand
        differs between devices, and all-reduces of what is left for the other leaves."""
        removed: dict[HloInstruction, set[int | None]] = {}
        bottoms: dict[HloInstruction, list[tuple[_Leaf, _Plan]]] = {}
        for region in regions:
            for top in region.tops:
                chain = chains[top]
                for leaf in chain:
                    removed.setdefault(leaf.all_reduce, set()).add(leaf.index)
                bottom = chain[-1]
                # Only a value proven uniform may skip the reduce-scatter: the assumption about
                # parameters is about weights, and the gradient's operand derives from the data.
                proven = self._analysis(region.key, assume_replicated_parameters=False)
                if not proven.is_replicated(bottom.operand):
                    bottoms.setdefault(bottom.all_reduce, []).append((bottom, region.plan))
        scattered = {}
        for all_reduce, indices in removed.items():
            by_dimension: dict[int, list[tuple[_Leaf, _Plan]]] = {}
            for leaf, plan in bottoms.get(all_reduce, []):
                by_dimension.setdefault(plan.dimension or 0, []).append((leaf, plan))
            for dimension, entries in by_dimension.items():
                operands = [self._prepare_full(leaf.operand, plan) for leaf, plan in entries]
                shapes = [plan.shard_shape(operand.shape) for operand, (_, plan) in zip(operands, entries)]
                scatter = self._add_collective(
                    "reduce-scatter", operands, all_reduce,
                    shape=shapes[0] if len(shapes) == 1 else Shape.tuple(shapes), dimensions=(dimension,),
                    to_apply=all_reduce.attrs["to_apply"], name=f"{all_reduce.name}.scatter")
                for position, (leaf, _) in enumerate(entries):
                    scattered[leaf] = scatter if len(entries) == 1 else self._add(
                        "get-tuple-element", [scatter], attrs={"index": position})
            self._keep_remaining_leaves(all_reduce, indices)
        return scattered

    def _keep_remaining_leaves(self, all_reduce: HloInstruction, removed: set) -> None:
        """Give the leaves of a combined all-reduce that stay replicated an all-reduce of their own."""
        self._dead.append(all_reduce)
        if None in removed:
            return
        kept = [i for i in range(all_reduce.operand_count) if i not in removed]
        if not kept:
            return
        attrs = dict(all_reduce.attrs)
        shapes = [all_reduce.shape.tuple_shapes[i] for i in kept]
        smaller = self._add("all-reduce", [all_reduce.operand(i) for i in kept],
                            shapes[0] if len(kept) == 1 else Shape.tuple(shapes), attrs=attrs, name=all_reduce.name)
        for user in list(all_reduce.users):
            index = user.attrs["index"]
            if index in kept:
                position = kept.index(index)
                value = smaller if len(kept) == 1 else self._add(
                    "get-tuple-element", [smaller], attrs={"index": position}, name=user.name)
                user.replace_all_uses_with(value)
            self._dead.append(user)

    def _gradient_shard(self, region: _Region, chain: list[_Leaf], scattered) -> HloInstruction:
        """This device's shard of the chain's top value: the reduce-scatter, times the group size
        once per further sum of a group-uniform value."""
        bottom = chain[-1]
        sums_of_uniform = len(chain) - 1
        base = scattered.get(bottom)
        if base is None:  # the bottom all-reduce sums a value every device already holds
            base = self._slice(bottom.operand, region)
            sums_of_uniform += 1
        if sums_of_uniform == 0:
            return base
        factor = region.plan.group_size ** sums_of_uniform
        constant = self._constant(factor, bottom.shape.dtype, name="group_size")
        factors = self._add("broadcast", [constant], base.shape, attrs={"dimensions": ()}, name="group_sizes")
        return self._add("multiply", [base, factors], base.shape, name=f"{chain[0].values[0].name}.shard")

    def _shard_in_place(self, region: _Region, member: HloInstruction, shards) -> None:
        """Make `member` compute its shard: shard operands, shard shape (operands first: post order).
        A reduce along the split dimension reduces the shard, and an all-reduce of the partial
        results stands for it in the region (`shards`)."""
        axes = region.axes(member)
        reduces_split_dimension = (member.opcode == "reduce" and region.split(member.operand(0))
                                   and not region.split(member))
        operands = [self._shard_operand(operand, region, shards, axes) for operand in member.operands]
        if member.opcode == "fusion":
            member.attrs["calls"] = self._fused_computation_at_shard_shape(
                member.attrs["calls"], member.shape.dims, lambda shape: region.plan.projection_shard_shape(shape, axes))
        member.set_operands(operands)
        member.set_shape(region.shard_shape(member))
        shards[member] = member
        if reduces_split_dimension:
            shards[member] = self._add_collective("all-reduce", [member], region.tops[0].all_reduce,
                                                  shape=member.shape, to_apply=member.attrs["to_apply"],
                                                  name=f"{member.name}.sum")

    def _shard_operand(self, operand: HloInstruction, region: _Region, shards,
                       axes: tuple[int, ...]) -> HloInstruction:
        """The shard of an operand of a member that spans the weight's dimensions `axes`: a scalar
        stays; a scalar broadcast is made (or, when only members that span the same dimensions use
        it, becomes) a broadcast at the shard's shape; anything else is sliced (a statistic that
        does not span the split dimension is read whole)."""
        if operand in shards:
            return shards[operand]
        if operand.shape.rank == 0:
            return operand
        if (operand, axes) in shards:
            return shards[operand, axes]
        shard_shape = region.plan.projection_shard_shape(operand.shape, axes)
        only_the_region_uses_it = not operand.is_root and all(
            u in region.member_set and region.axes(u) == axes for u in operand.users)
        if is_scalar_broadcast(operand) and only_the_region_uses_it:
            operand.set_shape(shard_shape)
            shard = operand
        elif is_scalar_broadcast(operand):
            shard = self._add("broadcast", [operand.operand(0)], shard_shape, attrs={"dimensions": ()},
                              name=f"{operand.name}.shard")
        elif axes != tuple(range(len(region.plan.full_dims))):
            shard = self._slice_projection(operand, region, axes)
        else:
            shard = self._slice(operand, region)
        shards[operand, axes] = shard
        return shard

    def _fused_computation_at_shard_shape(self, fused: HloComputation, dims: tuple[int, ...],
                                          shard_shape) -> HloComputation:
        """`fused` with its arrays of `dims` (the fusion's) at `shard_shape` of them: itself when
        only one fusion calls it, else a clone."""
        if len(self._callers.get(fused, [])) != 1:
            fused = self.module.clone_computation(fused, suffix="shard")
        for instr in fused.instructions:
            if instr.shape.is_array and instr.shape.dims == dims:
                instr.set_shape(shard_shape(instr.shape))
        return fused

    def _route_outputs(self, region: _Region, shards, kept_sharded: set[int], full_shapes) -> None:
        """All-gather the values that leave the step and hand them to their users; the root's
        outputs in `kept_sharded` get the shard itself."""
        gathered = {}

        def full_value(member):
            if not region.split(member):
                return shards[member]
            if member not in gathered:
                gathered[member] = self._gather(shards[member], full_shapes[member], member.name, region,
                                                region.axes(member))
            return gathered[member]

        for member, user in region.outputs:
            if user is None:
                self.comp.set_root(full_value(member))
                continue
            for index, operand in enumerate(user.operands):
                if operand is member:
                    kept = user.is_root and index in kept_sharded
                    user.set_operand(index, shards[member] if kept else full_value(member))

    def _route_reductions(self, region: _Region, shards) -> None:
        """Each full reduction reduces the shard instead (in place), and an all-reduce of the
        partial results takes its place."""
        plan = region.plan
        for reduce in region.reductions:
            member = reduce.operand(0)
            shard = shards[member]
            init = reduce.operand(1)
            if plan.padded_elements != plan.elements and plan.dimension is None:
                shard = self._mask_padding(shard, init, region)
            reduce.set_operand(0, shard)
            reduce.attrs["dimensions"] = tuple(range(shard.shape.rank))
            if not region.split(member):
                continue  # a statistic every device holds whole: its reduction is already the total
            total = self._add_collective("all-reduce", [reduce], region.tops[0].all_reduce, shape=reduce.shape,
                                         to_apply=reduce.attrs["to_apply"], name=f"{reduce.name}.sum")
            reduce.replace_all_uses_with(total)

    def _mask_padding(self, shard: HloInstruction, fill: HloInstruction, region: _Region) -> HloInstruction:
        """`shard` with the padding elements replaced by the reduction's identity `fill`."""
        plan = region.plan
        name = shard.name.removesuffix(".shard")
        index_shape = _with_layout_like(Shape.array("s32", shard.shape.dims), shard.shape)
        local = self._add("iota", [], index_shape, attrs={"iota_dimension": 0}, name=f"{name}.local_index")
        start = self._add("broadcast", [self._offset(region)], index_shape, attrs={"dimensions": ()})
        index = self._add("add", [local, start], index_shape, name=f"{name}.index")
        count = self._constant(plan.elements, "s32", name=f"{name}.elements")
        limit = self._add("broadcast", [count], index_shape, attrs={"dimensions": ()})
        inside = self._add("compare", [index, limit], index_shape.with_dtype("pred"), attrs={"direction": "LT"},
                           name=f"{name}.in_bounds")
        padding = self._add("broadcast", [fill], shard.shape, attrs={"dimensions": ()})
        return self._add("select", [inside, shard, padding], shard.shape, name=f"{name}.masked")

    # -- building blocks -------------------------------------------------------------------------------
    def _prepare_full(self, full: HloInstruction, plan: _Plan) -> HloInstruction:
        """`full` as the array the plan splits: itself, or flattened and padded to a multiple of N."""
        if plan.dimension is not None:
            return full
        dtype = full.shape.dtype
        flat = self._add("reshape", [full], _with_layout_like(Shape.array(dtype, (plan.elements,)), full.shape),
                         name=f"{full.name}.flat")
        if plan.padded_elements == plan.elements:
            return flat
        if dtype not in self._pad_values:
            self._pad_values[dtype] = self._constant(0, dtype, name="padding")
        return self._add("pad", [flat, self._pad_values[dtype]], name=f"{full.name}.padded",
                         attrs={"padding": PaddingConfig(((0, plan.padded_elements - plan.elements, 0),))})

    def _slice(self, full: HloInstruction, region: _Region) -> HloInstruction:
        """This device's shard of a value every device of the group holds in full."""
        plan = region.plan
        prepared = self._prepare_full(full, plan)
        split = plan.dimension or 0
        indices = [self._offset(region) if d == split else self._zero() for d in range(prepared.shape.rank)]
        return self._add("dynamic-slice", [prepared, *indices], plan.shard_shape(prepared.shape),
                         attrs={"dynamic_slice_sizes": plan.shard_dims}, name=f"{full.name}.shard")

    def _slice_projection(self, full: HloInstruction, region: _Region, axes: tuple[int, ...]) -> HloInstruction:
        """This device's part of a statistic that spans the weight's dimensions `axes`, which every
        device of the group holds whole: sliced along the split dimension, or all of it."""
        plan = region.plan
        if plan.dimension not in axes:
            return full
        split = axes.index(plan.dimension)
        indices = [self._offset(region) if position == split else self._zero() for position in range(len(axes))]
        shape = plan.projection_shard_shape(full.shape, axes)
        return self._add("dynamic-slice", [full, *indices], shape,
                         attrs={"dynamic_slice_sizes": shape.dims}, name=f"{full.name}.shard")

    def _gather(self, shard: HloInstruction, full_shape: Shape, name: str, region: _Region,
                axes: tuple[int, ...]) -> HloInstruction:
        """The full value of `shard` (of a value named `name` that spans the weight's dimensions
        `axes`), assembled from every device's."""
        plan = region.plan
        source = region.tops[0].all_reduce
        if plan.dimension is not None:
            return self._add_collective("all-gather", [shard], source, shape=full_shape,
                                        dimensions=(axes.index(plan.dimension),), name=f"{name}.gathered")
        flat_shape = _with_layout_like(Shape.array(full_shape.dtype, (plan.padded_elements,)), full_shape)
        gathered = self._add_collective("all-gather", [shard], source, shape=flat_shape, dimensions=(0,),
                                        name=f"{name}.gathered_flat")
        if plan.padded_elements != plan.elements:
            gathered = self._add("slice", [gathered], attrs={"slice": SliceSpec(((0, plan.elements, 1),))},
                                 name=f"{name}.unpadded")
        return self._add("reshape", [gathered], full_shape, name=f"{name}.gathered")

    def _add_collective(self, opcode: str, operands, like: HloInstruction, *, shape=None, name=None,
                        **attrs) -> HloInstruction:
        """A collective over the groups (and in the mode) of the all-reduce `like`: the same
        replica_groups and use_global_device_ids, a channel of its own when `like` has one."""
        ordered = {}
        if like.attrs.get("channel_id") is not None:
            ordered["channel_id"] = self._next_channel
            self._next_channel += 1
        ordered["replica_groups"] = like.attrs.get("replica_groups", ReplicaGroups(explicit=()))
        if "dimensions" in attrs:
            ordered["dimensions"] = attrs.pop("dimensions")
        if like.attrs.get("use_global_device_ids"):
            ordered["use_global_device_ids"] = True
        ordered.update(attrs)
        return self._add(opcode, operands, shape, attrs=ordered, name=name)

    def _offset(self, region: _Region) -> HloInstruction:
        """`position in group * shard size`: where this device's shard starts."""
        cache_key = (region.key, region.plan.split_size)
        if cache_key not in self._offsets:
            size = self._constant(region.plan.split_size, "s32", name="shard_size")
            self._offsets[cache_key] = self._add("multiply", [self._position(region.key), size],
                                                 name="shard_offset")
        return self._offsets[cache_key]

    def _position(self, key) -> HloInstruction:
        """This device's index within its replica group (s32), from replica-id/partition-id."""
        if key not in self._positions:
            space, groups = key
            position_of = {d: i for g in groups for i, d in enumerate(g)}
            if all(position_of[d] == d for d in position_of):
                self._positions[key] = self._device_id(space, name="shard_index")
            else:  # look the position up in a table indexed by device id
                table = np.zeros(max(position_of) + 1, np.int32)
                for d, i in position_of.items():
                    table[d] = i
                positions = self._add("constant", [], literal=Literal.from_numpy(table), name="group_positions")
                entry = self._add("dynamic-slice", [positions, self._device_id(space, name="device_id")],
                                  attrs={"dynamic_slice_sizes": (1,)}, name="group_position")
                self._positions[key] = self._add("reshape", [entry], Shape.array("s32", ()), name="shard_index")
        return self._positions[key]

    def _device_id(self, space: str, name: str) -> HloInstruction:
        """This device's id in `space`, as s32: its replica id, or its global device id
        (replica * num_partitions + partition; a module that states no replica count has
        one replica, as every JAX program does)."""
        u32 = Shape.array("u32", ())
        counts = DeviceCounts.of(self.module)
        if space == REPLICA_IDS:
            device = self._add("replica-id", [], u32)
        elif (counts.replicas or 1) > 1:
            replica = self._add("replica-id", [], u32)
            partitions = self._constant(counts.partitions, "u32")
            scaled = self._add("multiply", [replica, partitions])
            device = self._add("add", [scaled, self._add("partition-id", [], u32)])
        else:
            device = self._add("partition-id", [], u32)
        return self._add("convert", [device], Shape.array("s32", ()), name=name)

    def _zero(self) -> HloInstruction:
        if self._zero_index is None:
            self._zero_index = self._constant(0, "s32", name="zero")
        return self._zero_index

    def _constant(self, value, dtype: str, name: str | None = None) -> HloInstruction:
        literal = Literal.from_numpy(np.array(value, dtype=numpy_dtype(dtype)))
        return self._add("constant", [], Shape.array(dtype, ()), literal=literal, name=name)

    def _add(self, opcode: str, operands, shape=None, *, attrs=None, name=None, literal=None) -> HloInstruction:
        """Add an instruction; an inferred shape has a layout only where the operands have one
        (text without layouts stays without them); an element of a tuple has its own."""
        if shape is None and opcode == "get-tuple-element":
            shape = operands[0].shape.tuple_shapes[attrs["index"]]
        if shape is None and operands and all(o.shape.layout is None for o in operands):
            shape = infer_shape(opcode, [o.shape for o in operands], attrs or {}).without_layout()
        return self.comp.add_instruction(opcode, operands, shape, attrs=attrs, name=name, literal=literal)

    def _remove_dead(self) -> None:
        """Remove the replaced instructions, and what only they used (never parameters or side effects)."""
        pending = list(self._dead)
        while pending:
            instr = pending.pop()
            if instr.parent is not self.comp or instr.users or instr.is_root:
                continue
            if instr.opcode == "parameter" or has_side_effect(instr):
                continue
            operands = list(instr.operands)
            self.comp.remove_instruction(instr)
            pending.extend(operands)


# -- persistent state through a shard_map boundary ------------------------------------------------------

_GLOBAL_TO_LOCAL = "xla.sdy.GlobalToLocalShape"
_LOCAL_TO_GLOBAL = "xla.sdy.LocalToGlobalShape"
_RESULT_SHARDING = "xla.sdy.FuncResultSharding"
# What an entry output passes through on its way from the shard_map: JAX 0.11+ also annotates it
# with a `Sharding` custom-call (its HloSharding and Shardy's), which must then say the new split too.
_OUTPUT_ANNOTATIONS = (_RESULT_SHARDING, "Sharding")


def _is_custom_call(instr: HloInstruction, target: str) -> bool:
    return instr.opcode == "custom-call" and instr.attrs.get("custom_call_target") == target


def _frontend_attribute(owner: HloInstruction | HloModule, key: str) -> str | None:
    attributes = owner.attrs.get("frontend_attributes")
    return attributes.get(key) if attributes is not None else None


def _set_frontend_attribute(instr: HloInstruction, key: str, value: str) -> None:
    attributes = instr.attrs.get("frontend_attributes")
    items = dict(attributes.items) if attributes is not None else {}
    items[key] = value
    instr.attrs["frontend_attributes"] = FrontendAttributes(tuple(items.items()))


@dataclasses.dataclass
class _ShardMapBoundary:
    """The entry's side of a shard_map body: GlobalToLocalShape -> call(body) -> LocalToGlobalShape.

    With `persistent`, a state parameter of the body becomes its shard, and so does the body
    output with its next value. The entry keeps the global shapes; what changes is how the
    value is split: over the mesh axes of the gradient's group, in the shard_map's in/out
    shardings, the entry parameter's and output's shardings (Shardy's and HloSharding's).
    """

    module: HloModule
    call: HloInstruction
    global_to_local: HloInstruction
    local_to_global: HloInstruction
    mesh_name: str
    axes: list[str]
    sizes: dict[str, int]
    coordinates: dict[int, tuple[int, ...]]
    manual_axes: set[str]

    @classmethod
    def of(cls, module: HloModule, body: HloComputation) -> "_ShardMapBoundary | None":
        """The boundary of `body` when it is the body of one shard_map of the entry, else None."""
        calls = module.callers_of(body)
        if body.is_entry or len(calls) != 1 or calls[0].opcode != "call" or not calls[0].parent.is_entry:
            return None
        call = calls[0]
        if body.root.opcode != "tuple" or not call.operands or not call.users or \
                any(u.opcode != "get-tuple-element" for u in call.users):
            return None
        sources = {o.operand(0) for o in call.operands if o.opcode == "get-tuple-element"}
        sinks = {u for gte in call.users for u in gte.users}
        if len(sources) != 1 or len(sinks) != 1:
            return None
        (global_to_local,), (local_to_global,) = sources, sinks
        if not (_is_custom_call(global_to_local, _GLOBAL_TO_LOCAL)
                and _is_custom_call(local_to_global, _LOCAL_TO_GLOBAL)):
            return None
        in_shardings = _frontend_attribute(global_to_local, "xla.sdy.in_shardings") or ""
        meshes_text = _frontend_attribute(module, "xla.sdy.meshes")
        values = sdy.values(in_shardings)
        if not values or meshes_text is None or values[0].mesh not in sdy.meshes(meshes_text):
            return None
        mesh_name = values[0].mesh
        mesh = sdy.meshes(meshes_text)[mesh_name]
        axes, coordinates, sizes = mesh.axes, mesh.coordinates, dict(zip(mesh.axes, mesh.sizes))
        manual_axes = set(re.findall(r'"(\w+)"', _frontend_attribute(global_to_local, "xla.sdy.manual_axes") or ""))
        return cls(module, call, global_to_local, local_to_global, mesh_name, axes, sizes, coordinates, manual_axes)

    def body_output_of(self, number: int) -> int | None:
        """The body output that carries the next value of body parameter `number`: the one that
        reaches the entry output paired with the entry parameter the shard_map passes in."""
        operand = self.call.operand(number)
        if (operand.opcode != "get-tuple-element" or operand.operand(0) is not self.global_to_local
                or operand.users != [self.call] or self.call.operands.count(operand) != 1):
            return None
        parameter = self.global_to_local.operand(operand.attrs["index"])
        if parameter.opcode != "parameter":
            return None
        entry_root = self.call.parent.root
        if entry_root.opcode != "tuple":
            return None
        for output, number_of_parameter in _output_parameters(self.module, entry_root.operand_count).items():
            if number_of_parameter == parameter.parameter_number and output < entry_root.operand_count:
                value = self._body_value_of(entry_root.operand(output))
                return None if value is None else value.attrs["index"]
        return None

    def _body_value_of(self, value: HloInstruction) -> HloInstruction | None:
        """The get-tuple-element of the call that an entry output passes on unchanged, or None."""
        while value.operand_count == 1 and value.shape.dims == value.operand(0).shape.dims and (
                value.opcode in ("reshape", "bitcast", "copy")
                or any(_is_custom_call(value, target) for target in _OUTPUT_ANNOTATIONS)):
            value = value.operand(0)
        if value.opcode != "get-tuple-element" or value.operand(0) is not self.local_to_global:
            return None
        local = self.local_to_global.operand(value.attrs["index"])
        if local.opcode != "get-tuple-element" or local.operand(0) is not self.call or \
                local.users != [self.local_to_global] or self.local_to_global.operands.count(local) != 1:
            return None
        return local

    def split_spec(self, number: int, body_output: int, plan: _Plan, key) -> tuple[list[list[str]] | None, str]:
        """The Shardy dimension spec of body parameter `number` (and of `body_output`, which
        returns its next value) once also split as `plan` says over the mesh axes of the
        group, or (None, why not)."""
        if plan.dimension is None:
            return None, "a flattened shard is not a split of one dimension that shard_map can express"
        axes = self._group_axes(key)
        if axes is None:
            return None, "its replica groups are not the devices along manual mesh axes"
        index = self.call.operand(number).attrs["index"]
        entering = sdy.values(_frontend_attribute(self.global_to_local, "xla.sdy.in_shardings") or "")
        leaving = sdy.values(_frontend_attribute(self.local_to_global, "xla.sdy.out_shardings") or "")
        same = lambda a, b: (a.mesh, a.dims_text, a.rest) == (b.mesh, b.dims_text, b.rest)  # noqa: E731
        if index >= len(entering) or body_output >= len(leaving) or not same(entering[index], leaving[body_output]):
            return None, "the shard_map's in and out shardings of the state differ"
        dims = sdy.dims(entering[index].dims_text)
        if dims is None or len(dims) != len(plan.full_dims) or entering[index].mesh != self.mesh_name \
                or entering[index].rest.strip():
            return None, "its shard_map in_sharding is not a plain split of its dimensions"
        if any(axis in used for used in dims for axis in axes):
            return None, "it is already split over the group's mesh axes"
        dims[plan.dimension] = dims[plan.dimension] + axes
        return dims, ""

    def _group_axes(self, key) -> list[str] | None:
        """The manual mesh axes along which each group's devices lie in group order, or None."""
        space, groups = key
        if space == REPLICA_IDS:
            return None
        found = None
        for group in groups:
            if any(device not in self.coordinates for device in group):
                return None
            coords = np.array([self.coordinates[device] for device in group])
            varying = [i for i in range(len(self.axes)) if len(set(coords[:, i])) > 1]
            if found is not None and varying != found:
                return None
            found = varying
            shape = [self.sizes[self.axes[i]] for i in varying]
            if not shape or math.prod(shape) != len(group) or list(np.ravel_multi_index(
                    tuple(coords[:, i] for i in varying), shape)) != list(range(len(group))):
                return None
        axes = [self.axes[i] for i in found or []]
        return axes if axes and set(axes) <= self.manual_axes else None

    def hlo_sharding(self, dims: list[list[str]]) -> Sharding:
        """The HloSharding of a Shardy dimension spec over this mesh."""
        return sdy.Mesh(self.axes, [self.sizes[a] for a in self.axes], self.coordinates).hlo_sharding(dims)

    def keep_sharded(self, number: int, body_output: int, dims: list[list[str]]) -> str:
        """Split the entry parameter that body parameter `number` comes from, and the entry output
        that body output `body_output` reaches, as `dims` says; describe the change."""
        sharding, sdy_dims = self.hlo_sharding(dims), sdy.dims_text(dims)
        gte = self.call.operand(number)
        index = gte.attrs["index"]
        parameter = self.global_to_local.operand(index)
        before = parameter.attrs.get("sharding") or Sharding.replicated()
        parameter.attrs["sharding"] = sharding
        _set_frontend_attribute(parameter, "xla.sdy.sharding", f"#sdy.sharding<@{self.mesh_name}, [{sdy_dims}]>")
        self._replace_value(self.global_to_local, "xla.sdy.in_shardings", index, sdy_dims)
        shapes = list(self.global_to_local.shape.tuple_shapes)
        shapes[index] = self.call.attrs["to_apply"].parameter(number).shape
        self.global_to_local.set_shape(Shape.tuple(shapes))
        gte.set_shape(shapes[index])
        self._replace_value(self.local_to_global, "xla.sdy.out_shardings", body_output, sdy_dims)
        entry_root = self.call.parent.root
        outputs = [i for i, o in enumerate(entry_root.operands)
                   if (v := self._body_value_of(o)) is not None and v.attrs["index"] == body_output]
        for output in outputs:
            value = entry_root.operand(output)
            while value.opcode != "get-tuple-element":
                if any(_is_custom_call(value, target) for target in _OUTPUT_ANNOTATIONS):
                    _set_frontend_attribute(value, "xla.sdy.sharding",
                                            f"#sdy.sharding_per_value<[<@{self.mesh_name}, [{sdy_dims}]>]>")
                if "sharding" in value.attrs:
                    value.attrs["sharding"] = sharding
                value = value.operand(0)
            root_sharding = entry_root.attrs.get("sharding")
            if root_sharding is not None and root_sharding.kind == "tuple":
                elements = list(root_sharding.elements)
                elements[output] = sharding
                entry_root.attrs["sharding"] = Sharding.tuple_of(elements)
        full = parameter.shape.to_text(print_layout=False)
        return (f"parameter {parameter.parameter_number} (%{parameter.name}) {full} sharding {before} -> {sharding}, "
                + ", ".join(f"output {o}" for o in outputs) + f" sharding -> {sharding}")

    def _replace_value(self, instr: HloInstruction, key: str, index: int, sdy_dims: str) -> None:
        """Entry `index` of the sharding_per_value attribute `key` of `instr`, split as `sdy_dims`."""
        text = _frontend_attribute(instr, key)
        value = sdy.values(text)[index]
        replaced = f"<@{self.mesh_name}, [{sdy_dims}]{value.rest}>"
        _set_frontend_attribute(instr, key, text[:value.start] + replaced + text[value.end:])

    def retype_call(self) -> None:
        """The call and its get-tuple-elements take the body's new result shapes."""
        body_root = self.call.attrs["to_apply"].root
        self.call.set_shape(body_root.shape)
        for gte in self.call.users:
            gte.set_shape(body_root.shape.tuple_shapes[gte.attrs["index"]])


# -- before XLA's partitioner (jax.jit + NamedSharding) -------------------------------------------------

def _before_partitioning(module: HloModule) -> bool:
    """A module that XLA's SPMD partitioner has not seen yet: Shardy's mesh, entry parameters
    that say their sharding, no collective, and no partition count in its header (JAX's lowering
    of a `jax.jit` step whose arrays carry `NamedSharding`s; the partitioner makes the collectives
    and the per-device program later). A partitioned module (the hook's) is never one."""
    entry = module.entry
    return (not module.layouts_final and module.num_partitions == 1
            and _frontend_attribute(module, "xla.sdy.meshes") is not None
            and all("sharding" in p.attrs for p in entry.parameters)
            and not any(i.opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
                        for c in module.computations for i in c.instructions))


class _StateShardingForPartitioner:
    """`persistent=true` before XLA's partitioner: the optimizer state, and the update that reads
    it, annotated as split over the mesh's data axes, so that the partitioner computes the
    update on 1/N of each array and hands the state back split (2004.13336 did this inside the
    SPMD partitioner). Nothing here can change a result: an annotation only says where values
    live, and the partitioner moves them where an instruction needs them::

        mu = f32[512,256] parameter(3), sharding={replicated}            (Shardy: [{}, {}])
        m1 = f32[512,256] custom-call(add), custom_call_target="Sharding", sharding={replicated}
      becomes
        mu = f32[512,256] parameter(3), sharding={devices=[8,1]<=[8]}    (Shardy: [{"data"}, {}])
        m1 = f32[512,256] custom-call(add), custom_call_target="Sharding", sharding={devices=[8,1]<=[8]}

    The data axes are those that split the parameters the step does not hand back (the batch).
    State is a parameter that the step hands back (`input_output_alias`, else the output of its
    own index) and reads only elementwise, whose new value depends elementwise on no parameter
    read otherwise (a weight, which the forward pass reads whole: it stays replicated, updated
    from split values and gathered by the partitioner). Model axes already in a sharding stay.
    """

    def __init__(self, hlo_pass: WeightUpdateSharding, module: HloModule):
        self.options = hlo_pass
        self.module = module
        self.entry = module.entry
        self.reports: list[WeightReport] = []

    def run(self) -> bool:
        meshes = sdy.meshes(_frontend_attribute(self.module, "xla.sdy.meshes"))
        if len(meshes) != 1:
            return False
        self.mesh_name, self.mesh = next(iter(meshes.items()))
        axes = self.mesh.axes
        root = self.entry.root
        if root.opcode != "tuple":
            return False
        self.output_of = {number: index for index, number in
                          _output_parameters(self.module, root.operand_count).items()}
        parameters = self.entry.parameters
        self.data_axes = [a for a in axes if any(
            a in sum(dims, []) for p in parameters if p.parameter_number not in self.output_of
            for dims in [self._dims(p, "xla.sdy.sharding")] if dims is not None)]
        if not self.data_axes:
            return False
        size = math.prod(self.mesh.sizes[axes.index(a)] for a in self.data_axes)
        plans = {}
        for parameter in parameters:
            plan = self._plan(parameter, size)
            if plan is not None:
                plans[parameter] = plan
        if not plans:
            return False
        split = {}   # value -> dimension split over the data axes
        for parameter, dimension in plans.items():
            for value in self._update_values(parameter):
                split[value] = dimension
        for value, dimension in split.items():
            if _is_custom_call(value, "Sharding"):
                self._split(value, "xla.sdy.sharding", dimension)
        root = self.entry.root
        elements = list(root.attrs["sharding"].elements) if "sharding" in root.attrs else None
        for parameter, dimension in plans.items():
            full = parameter.attrs["sharding"]
            self._split(parameter, "xla.sdy.sharding", dimension)
            index = self.output_of[parameter.parameter_number]
            value = root.operand(index)   # the new state, through the annotations of the step's result
            while value.opcode in ("reshape", "custom-call") and value.operand_count == 1:
                if _is_custom_call(value, _RESULT_SHARDING) or _is_custom_call(value, "Sharding"):
                    self._split(value, "xla.sdy.sharding", dimension)
                elif "sharding" in value.attrs:
                    value.attrs["sharding"] = parameter.attrs["sharding"]
                value = value.operand(0)
            if not self._annotated(root.operand(index)):
                self._pin(index, parameter)
            if elements is not None:
                elements[index] = parameter.attrs["sharding"]
            self.reports.append(WeightReport(
                computation=self.entry.name, gradient=f"%{parameter.name}",
                shape=parameter.shape.to_text(print_layout=False),
                weights=(_parameter_op_name(parameter) or parameter.name,),
                sharded=True, group_size=size, dimension=dimension,
                shard_bytes=parameter.shape.byte_size // size,
                signature=f"persistent: parameter {parameter.parameter_number} and output {index} sharding "
                          f"{full} -> {parameter.attrs['sharding']} (XLA's partitioner splits the update)"))
        # A weight whose new value comes from split values keeps its own sharding: where JAX
        # lowered its output unannotated (`AxisType.Auto`), the partitioner would split it too.
        updated = set().union(*(self._update_values(p) for p in plans))
        for number, index in self.output_of.items():
            parameter = self.entry.parameter(number)
            value = root.operand(index)
            if parameter not in plans and value in updated and not self._annotated(value):
                self._pin(index, parameter)
        if elements is not None:
            root.attrs["sharding"] = Sharding.tuple_of(elements)
        return True

    def _annotated(self, value: HloInstruction) -> bool:
        """Whether an output says its sharding on its way out (JAX's `Sharding` custom-call or
        Shardy's result annotation)."""
        return _is_custom_call(value, "Sharding") or _is_custom_call(value, _RESULT_SHARDING) or (
            value.opcode == "reshape" and self._annotated(value.operand(0)))

    def _pin(self, index: int, parameter: HloInstruction) -> None:
        """Output `index` of the entry through a `Sharding` custom-call that says `parameter`'s
        sharding (its Shardy one, as a per-value sharding, and its HloSharding)."""
        root = self.entry.root
        value = root.operand(index)
        dims = self._dims(parameter) or [[] for _ in range(parameter.shape.rank)]
        attrs = {"custom_call_target": "Sharding", "sharding": parameter.attrs["sharding"],
                 "frontend_attributes": FrontendAttributes((("xla.sdy.sharding", f"#sdy.sharding_per_value<[<@"
                                                              f"{self.mesh_name}, [{sdy.dims_text(dims)}]>]>"),))}
        pinned = self.entry.add_instruction("custom-call", [value], value.shape, attrs=attrs, before=root,
                                            name=f"{value.name}.sharding")
        root.set_operand(index, pinned)

    def _plan(self, parameter: HloInstruction, size: int) -> int | None:
        """The dimension of a state parameter to split over the data axes, else None (with a
        `kept` report for state that cannot be split)."""
        shape, number = parameter.shape, parameter.parameter_number
        dims = self._dims(parameter, "xla.sdy.sharding")
        if (number not in self.output_of or not shape.is_array or shape.rank == 0 or dims is None
                or shape.dtype not in FLOAT_DTYPES or any(a in self.data_axes for d in dims for a in d)):
            return None
        output = self.entry.root.operand(self.output_of[number])
        if not self._read_elementwise(parameter) or output not in self._update_values(parameter) \
                or not self._state_only(output):
            return None
        if shape.byte_size < self.options.threshold_bytes:
            reason = f"tiny: {shape.byte_size} bytes is below threshold_bytes={self.options.threshold_bytes}"
        else:
            for dimension, extent in enumerate(shape.dims):
                if not dims[dimension] and extent % size == 0:
                    return dimension
            reason = (f"no dimension that no axis splits yet is a multiple of the {size} devices of the data axes "
                      f"(JAX takes no unevenly split argument)")
        self.reports.append(WeightReport(
            computation=self.entry.name, gradient=f"%{parameter.name}", shape=shape.to_text(print_layout=False),
            weights=(_parameter_op_name(parameter) or parameter.name,), sharded=False, reason=reason))
        return None

    def _update_values(self, parameter: HloInstruction) -> set:
        """The values an update computes from `parameter` elementwise at its shape (through
        `Sharding` annotations and the output's reshapes); where something else reads them (a
        norm, a dot), the partitioner brings the split values together for it."""
        dims = parameter.shape.dims
        values, work = {parameter}, [parameter]
        while work:
            for user in work.pop().users:
                if user not in values and self._carries(user, dims):
                    values.add(user)
                    work.append(user)
        return values

    def _carries(self, instr: HloInstruction, dims: tuple[int, ...]) -> bool:
        """An elementwise instruction or an annotation (a `Sharding` custom-call, Shardy's result
        annotation, a reshape that keeps the shape) at `dims`."""
        if not instr.shape.is_array or instr.shape.dims != dims or instr.is_root:
            return False
        if instr.opcode in ELEMENTWISE:
            return not has_side_effect(instr)
        return instr.operand_count == 1 and (instr.opcode == "reshape" or _is_custom_call(instr, "Sharding")
                                             or _is_custom_call(instr, _RESULT_SHARDING))

    def _read_elementwise(self, parameter: HloInstruction) -> bool:
        """Whether every use of `parameter`, through its annotations, is elementwise: optimizer
        state; a weight is read by a dot or a convolution of the forward pass."""
        dims, work = parameter.shape.dims, [parameter]
        while work:
            for user in work.pop().users:
                if user is self.entry.root:
                    continue
                if not self._carries(user, dims):
                    return False
                if user.opcode not in ELEMENTWISE:   # an annotation: what reads through it counts
                    work.append(user)
        return True

    def _state_only(self, output: HloInstruction) -> bool:
        """Whether the parameters `output` depends on elementwise are all read only elementwise:
        optimizer state, not a weight (which a dot or a reduction also reads)."""
        seen, work = {output}, [output]
        while work:
            value = work.pop()
            if value.opcode == "parameter":
                if not self._read_elementwise(value):
                    return False
                continue
            if value.opcode in ELEMENTWISE or _is_custom_call(value, "Sharding") or \
                    _is_custom_call(value, _RESULT_SHARDING) or value.opcode == "reshape":
                for operand in value.operands:
                    if operand not in seen and operand.shape.is_array and operand.shape.dims == output.shape.dims:
                        seen.add(operand)
                        work.append(operand)
        return True

    def _dims(self, instr: HloInstruction, key: str = "xla.sdy.sharding") -> list[list[str]] | None:
        values = sdy.values(_frontend_attribute(instr, key))
        return sdy.dims(values[0].dims_text) if len(values) == 1 and values[0].mesh == self.mesh_name else None

    def _split(self, instr: HloInstruction, key: str, dimension: int) -> None:
        """`instr`'s Shardy sharding and HloSharding with the data axes on `dimension`."""
        dims = self._dims(instr, key)
        if dims is None or len(dims) != instr.shape.rank:
            dims = [[] for _ in range(instr.shape.rank)]
        dims[dimension] = list(self.data_axes)
        _set_frontend_attribute(instr, key, sdy.replace_value(_frontend_attribute(instr, key), 0, dims))
        instr.attrs["sharding"] = self.mesh.hlo_sharding(dims)


# -- instruction predicates ---------------------------------------------------------------------------

def _fold_unit_reshapes(comp: HloComputation) -> None:
    """Fold what JAX's lowering of `x[:, None] * y` leaves before XLA's simplifier: a broadcast
    to its operand's own shape, and a reshape back to the shape a reshape started from (Adafactor's
    row and column statistics: `f32[32]` reshaped to `f32[32,1]`, broadcast to itself, reshaped
    back and broadcast to the weight). Both move no element; the update region then reads the
    statistic's broadcast directly. Only before layout assignment, where a reshape is no more."""
    for instr in comp.post_order():
        source = None
        if (instr.opcode == "broadcast" and instr.shape == instr.operand(0).shape
                and tuple(instr.attrs.get("dimensions", ())) == tuple(range(instr.shape.rank))):
            source = instr.operand(0)
        elif (instr.opcode == "reshape" and instr.operand(0).opcode == "reshape"
              and instr.operand(0).operand(0).shape == instr.shape):
            source = instr.operand(0).operand(0)
        if source is not None and not instr.is_root and not instr.control_predecessors and not any(
                instr in user.control_predecessors for user in instr.users):
            instr.replace_all_uses_with(source)
            folded = [instr]
            while folded:   # what moved no element and is read no more goes
                dead = folded.pop()
                if dead.parent is comp and not dead.users and not dead.is_root and dead.opcode in ("broadcast", "reshape"):
                    folded.extend(dead.operands)
                    comp.remove_instruction(dead)


def _is_gradient_shape(shape: Shape) -> bool:
    return shape.is_array and shape.rank > 0 and shape.dtype in FLOAT_DTYPES and not shape.is_dynamic


class _UpdateSpans(ForwardLattice):
    """The update region grown forward from the gradient leaves `tops` (a `ForwardDataflow` client
    that enters no call, loop or conditional): a value's state is the weight's dimensions it spans
    when it is in the region, else None. A user is judged on its operands' final states, so one
    whose region operands span different dimensions stays out, whichever of them is reached first."""

    def __init__(self, comp: HloComputation, tops: list[_Leaf], full_dims: tuple[int, ...],
                 analysis: ReplicationAnalysis, positions: dict):
        self.full_dims, self.analysis = full_dims, analysis
        self.all_axes = tuple(range(len(full_dims)))
        self._seeds = {v for top in tops for v in top.values}
        self._leaf_indices: dict[HloInstruction, set] = {}   # all-reduce -> the elements that are `tops`
        for top in tops:
            self._leaf_indices.setdefault(top.all_reduce, set()).add(top.index)
        self.blocked: dict[HloInstruction, HloInstruction] = {}   # users held back, and the operand why
        self._flow = ForwardDataflow(self, comp, sources=list(self._leaf_indices), positions=positions)
        self.reached = self._flow.reached   # what the gradients reach: the region is among these

    def span(self, value: HloInstruction):
        """The dimensions `value` spans in the region, None when it is not in it."""
        return self._in_region(value, self._flow.value(value))

    def _in_region(self, value: HloInstruction, state):
        """`state` where `value` can be in the region: an array, and of get-tuple-elements only a gradient
        leaf (the engine carries spans into tuples and out of get-tuple-elements; the region does not).
        A span is a Python tuple only on arrays, which the engine never reads as a tuple's elements."""
        return state if value.shape.is_array and (value.opcode != "get-tuple-element" or value in self._seeds) \
            else None

    def join(self, a, b):
        return a if a == b else None

    def parameter(self, param: HloInstruction):
        return None

    def descends(self, instr: HloInstruction, operands: list) -> bool:
        return False

    def transfer(self, instr: HloInstruction, operands: list):
        if instr in self._leaf_indices:   # of a combined one, the elements that are leaves
            if not instr.shape.is_tuple:
                return self.all_axes
            return tuple(self.all_axes if i in self._leaf_indices[instr] else None for i in range(instr.operand_count))
        spans = [self._in_region(o, state) for o, state in zip(instr.operands, operands)]
        axes = _spanned_axes(instr, spans, self.full_dims)
        if axes is None:
            return None
        differing = [o for o, span in zip(instr.operands, spans) if span is None and not self.analysis.is_replicated(o)]
        if differing:
            self.blocked[instr] = differing[0]
            return None
        return axes


def _read_only_inside(region, may_join) -> dict:
    """`region` and the values that only it reads, transitively, of those that `may_join`: all that
    `_PulledIn` may pull in (a value with a user elsewhere, or one whose state in the region says
    nothing, stays out), so its backward run need look at nothing else."""
    inside = dict.fromkeys(region)
    stack = [o for v in inside for o in reversed(v.operands)]
    while stack:
        value = stack.pop()
        if value not in inside and value.users and all(u in inside for u in value.users) and may_join(value):
            inside[value] = None
            stack.extend(reversed(value.operands))
    return inside


class _PulledIn(BackwardLattice):
    """The replicated elementwise values used only inside the region, pulled into it (a `BackwardDataflow`
    client, users before the values they read): a value's state is the set of its users' spans."""

    def __init__(self, spans: _UpdateSpans):
        self.spans = spans

    def span(self, value: HloInstruction, user_spans: frozenset):
        """The dimensions `value` spans in the region: grown forward, or pulled in with the span that all
        its users have there."""
        own = self.spans.span(value)
        if own is not None or len(user_spans) != 1 or None in user_spans or not self.may_pull(value):
            return own
        (axes,) = user_spans
        return axes if elementwise_like(value, tuple(self.spans.full_dims[a] for a in axes)) else None

    def may_pull(self, value: HloInstruction) -> bool:
        """Whether `value` may be pulled in at all: a replicated value that is not the step's result."""
        return not value.is_root and self.spans.analysis.is_replicated(value)

    def join(self, a, b):
        return a | b

    def unused(self, instr: HloInstruction):
        return frozenset()

    def transfer(self, user: HloInstruction, operand_number: int, user_state):
        return frozenset({self.span(user, user_state)})


def _spanned_axes(user: HloInstruction, spans: list, full_dims: tuple[int, ...]) -> tuple[int, ...] | None:
    """The weight's dimensions that `user` spans when the update region can take it in, else None.

    `spans` holds the dimensions that each operand spans, None for one outside the region. The
    region takes in an elementwise instruction (or kLoop fusion of them) over values that span the
    same dimensions, a reduce of some (not all: `full_reduction_of`) of a value's dimensions with a
    reducer whose partial results combine, from its identity, and a broadcast of a value back to the
    weight's shape along the dimensions it spans (Adafactor's row and column statistics,
    `_Plan.projection_shard_shape`).
    """
    distinct = set(spans) - {None}
    if len(distinct) != 1:
        return None
    (axes,) = distinct
    if user.opcode == "reduce":
        if user.operand_count != 2 or spans[0] is None or not reduces_from_identity(user):
            return None
        reduced = set(user.attrs.get("dimensions", ()))
        kept = tuple(axis for position, axis in enumerate(axes) if position not in reduced)
        return kept or None
    if user.opcode == "broadcast":
        if user.shape.dims == full_dims and tuple(user.attrs.get("dimensions", ())) == axes and \
                not user.control_predecessors:
            return tuple(range(len(full_dims)))
        return None
    return axes if elementwise_like(user, tuple(full_dims[axis] for axis in axes)) else None


def _output_parameters(module: HloModule, outputs: int) -> dict[int, int]:
    """Output index -> the parameter number whose next value it is (see _keep_state_sharded)."""
    alias = module.attrs.get("input_output_alias")
    if alias is None:
        return {index: index for index in range(outputs)}
    pairs = re.findall(r"\{\s*(\d+)\s*\}\s*:\s*\(\s*(\d+)\s*,\s*\{\s*\}", str(alias))
    return {int(output): int(parameter) for output, parameter in pairs}


def _use_reason(member: HloInstruction, user: HloInstruction, differing: HloInstruction | None) -> str:
    """Why a use of an update value outside the region keeps the weight replicated."""
    if differing is not None:
        return (f"%{user.name} combines %{member.name} with %{differing.name}, which is not known to be the "
                f"same on every device of the group (set assume_replicated_parameters=true if the weights "
                f"and optimizer state are replicated)")
    reason = f"non-elementwise use: %{member.name} is used by %{user.name} ({user.opcode})"
    if user.opcode == "fusion":
        inside = sorted({i.opcode for i in user.attrs["calls"].instructions if i.opcode not in ELEMENTWISE
                         and i.opcode not in ("parameter", "constant", "broadcast")})
        kind = user.attrs.get("kind")
        reason = reason[:-1] + f", {kind}" + (f" with {', '.join(inside)})" if inside else ")")
    if user.opcode == "reduce-window" or (user.opcode == "fusion" and "reduce-window" in inside):
        reason += ("; a reduce-window counts as part of a full reduction only when its windows partition the "
                   "value (size = stride, no dilation, padded from its reducer's identity to whole windows) and "
                   "reduces with its reducer, from the identity, sum all of its results and are their only uses")
    if user.opcode == "call":
        reason += "; a call the pass does not inline (a Shardy body, a composite, or one with control dependencies)"
    control_flow = _control_flow_entered(user)
    if control_flow is not None:
        through = f" through %{user.name}" if control_flow is not user else ""
        reason = (f"%{member.name} enters %{control_flow.name} ({control_flow.opcode}){through}: the update "
                  f"continues inside its computations, which the pass does not shard (a lax.cond such as "
                  f"optax.MultiSteps's with should_skip_update_fn, or a loop)")
    return reason


def _mixed_spans_reason(user: HloInstruction, component: set, projections: dict) -> str:
    """Why `user` stays out when it combines region values that span different dimensions of the
    weight (a row statistic with a column one): neither's shard is a slice of the result ("" if not)."""
    spans = {o.name: projections.get(o, "all") for o in user.operands if o in component}
    if len(set(spans.values())) < 2:
        return ""
    listed = ", ".join(f"%{name} {'every dimension' if axes == 'all' else 'dimensions ' + str(list(axes))}"
                       for name, axes in spans.items())
    return (f"%{user.name} ({user.opcode}) combines update values that span different dimensions of the "
            f"weight ({listed}): no shard of it is a slice of each")


def _control_flow_entered(user: HloInstruction) -> HloInstruction | None:
    """The conditional or while loop that `user` is, or hands its tuple to: the region's values go on
    into computations that only run on some steps or several times, where the pass does not follow."""
    if user.opcode in ("conditional", "while"):
        return user
    if user.opcode == "tuple":
        return next((u for u in user.users if u.opcode in ("conditional", "while")), None)
    return None


def _lift_reshapes(module: HloModule, fusion: HloInstruction, dims: tuple[int, ...]) -> bool:
    """Move row-major reshapes at the edges of a kLoop fusion out of it, when that leaves it
    elementwise at `dims`; return whether it did.

    In a pmap step the parameters and optimizer state are `[1, ...]` per device and the
    gradient is not: XLA's update fusion computes on the state at its shape, reshapes (bitcasts)
    it to the gradient's, and reshapes the result back; scalar hyper-parameters come as `[1]`::

        fusion(mu: f32[1,64,128], g: f32[64,128], c: f32[1]) -> f32[1,64,128]
          { bitcast(multiply(mu, b)) ... g ... broadcast(bitcast(c)) ... ROOT bitcast(update) }

    becomes `reshape(fusion(reshape(mu), g, reshape(c)))` with a fusion elementwise at `dims`.
    """
    if fusion.attrs.get("kind") != "kLoop":
        return False
    fused = fusion.attrs["calls"]
    lifted = {}  # parameter -> the shape it takes
    for parameter in fused.parameters:
        if not parameter.shape.is_array or parameter.shape.dims in (dims, ()):
            continue
        found = reordered_chain([parameter], parameter.shape.dims)
        keys = {reordering(end) for end in found[1]} if found else set()
        if len(keys) != 1 or next(iter(keys)) not in (("reshape", dims), ("reshape", ())):
            return False
        lifted[parameter] = found[1][0].shape.with_dtype(parameter.shape.dtype)
    root = fused.root
    lift_root = (root.shape.dims != dims and reordering(root) == ("reshape", root.shape.dims)
                 and root.operand(0).shape.dims == dims)
    if not lifted and not lift_root:
        return False
    inside = {i for p in lifted for i in (p, *reordered_chain([p], p.shape.dims)[0])}
    inside |= {e for p in lifted for e in reordered_chain([p], p.shape.dims)[1]} | ({root} if lift_root else set())
    if any(i.shape.dims not in (dims, ()) for i in fused.instructions if i not in inside and not (
            (is_scalar_broadcast(i) or is_one_element_constant(i)) and all(u in inside for u in i.users))):
        return False
    if len(module.callers_of(fused)) != 1:
        fusion.attrs["calls"] = module.clone_computation(fused, suffix="lifted")
        return _lift_reshapes(module, fusion, dims)
    comp = fusion.parent
    for parameter, shape in lifted.items():
        number = parameter.parameter_number
        _reorder_first(fused, [parameter], parameter.shape.dims, shape)
        operand = fusion.operand(number)
        fusion.set_operand(number, comp.add_instruction("reshape", [operand], shape, before=fusion,
                                                        name=f"{operand.name}.reshaped"))
    if lift_root:
        inner = root.operand(0)
        fused.set_root(inner)
        fused.remove_instruction(root)
        full_shape = fusion.shape
        fusion.set_shape(inner.shape)
        users, was_root = list(fusion.users), fusion.is_root
        reshaped = comp.add_instruction("reshape", [fusion], full_shape, after=fusion, name=f"{fusion.name}.reshaped")
        for user in users:
            user.replace_operand_with(fusion, reshaped)
        if was_root:
            comp.set_root(reshaped)
    return True


def _hoisting_refusal(values: list[HloInstruction], reordered: dict, direct: list[HloInstruction]) -> str:
    """Why the gradient carried by `values`, read through reorderings by the fusions `reordered`
    (fusion -> `reordering`) and without one by `direct`, is not reordered before its all-reduce
    ("" when it can be: one reordering, and the direct reads only reduce it: `reduced_in_any_order`)."""
    keys = list(dict.fromkeys(reordered.values()))
    readers = ", ".join(f"%{fusion.name}" for fusion in reordered)
    if len(keys) > 1:
        return (f"; its users read it through different reorderings ({', '.join(map(str, keys))}), so it is not "
                f"reordered before its all-reduce")
    carried, _, stop = reduced_in_any_order(values, direct, values[0].shape.dims, moved_dimensions(keys[0]))
    stop = stop or next((f"%{instr.name} ({instr.opcode}) is the result" for instr in carried if instr.is_root), "")
    if not stop:
        return ""
    return (f"; it is read through a {keys[0][0]} by {readers} and without one, where {stop}: only reductions "
            f"with add, multiply, maximum, minimum, and or or may read it in another order (of some dimensions "
            f"only when the transpose keeps the others in order), so it is not reordered before its all-reduce")


def _hoist_reordering(module: HloModule, leaf: "_Leaf", converts: list[HloInstruction], key,
                      direct: list[HloInstruction]) -> None:
    """`all-reduce(x)` read through the reordering `key` (after the `converts` of it, if any)
    becomes `all-reduce(reordered x)` read directly (`_ComputationSharder._hoist_gradient_reorderings`);
    the converts convert the reordered value, and the `direct` users, which only reduce it
    (`reduced_in_any_order`), read the reordered value too (`_read_reordered`)."""
    comp, all_reduce = leaf.all_reduce.parent, leaf.all_reduce
    source, dims = leaf.operand, leaf.shape.dims
    kind, how = key
    new_dims = [dims[p] for p in how] if kind == "transpose" else how
    shape = _with_layout_like(Shape.array(source.shape.dtype, new_dims), source.shape)
    carriers, moved = leaf.values + converts, moved_dimensions(key)
    _read_reordered(module, carriers, direct, dims, shape, moved)
    reordered = comp.add_instruction(kind, [source], shape, attrs={"dimensions": how} if kind == "transpose" else None,
                                     name=f"{source.name}.{'transposed' if kind == 'transpose' else 'reshaped'}",
                                     before=all_reduce)
    all_reduce.set_operand(leaf.index or 0, reordered)
    if leaf.index is None:
        all_reduce.set_shape(shape)
    else:
        shapes = list(all_reduce.shape.tuple_shapes)
        shapes[leaf.index] = shape
        all_reduce.set_shape(Shape.tuple(shapes))
        for value in leaf.values:
            value.set_shape(shape)
    for convert in converts:
        _convert_at(module, convert, shape)
    callers = module.callers()
    for value in carriers:
        for fusion in list(value.users):
            if fusion in direct or fusion in converts:
                continue
            fused = fusion.attrs["calls"]
            if len(callers.get(fused, [])) != 1:
                fused = fusion.attrs["calls"] = module.clone_computation(fused, suffix="reordered")
            _reorder_first(fused, [fused.parameter(i) for i, o in enumerate(fusion.operands) if o is value], dims,
                           shape, moved)


def _is_convert(instr: HloInstruction) -> bool:
    """A convert, or a kLoop fusion of one convert of its parameter (XLA's `wrapped_convert`)."""
    if instr.control_predecessors or not instr.shape.is_array:
        return False
    if instr.opcode == "convert":
        return True
    if instr.opcode != "fusion" or instr.attrs.get("kind") != "kLoop" or instr.operand_count != 1:
        return False
    root = instr.attrs["calls"].root
    return root.opcode == "convert" and root.operand(0).opcode == "parameter"


def _converts_of(values: list[HloInstruction]) -> list[HloInstruction]:
    """The converts (`_is_convert`) that carry `values` on, and the converts of those: what
    the reordering search looks through, as a convert commutes with moving elements."""
    found, work = [], list(values)
    while work:
        for user in work.pop().users:
            if user not in found and _is_convert(user):
                found.append(user)
                work.append(user)
    return found


def _convert_at(module: HloModule, convert: HloInstruction, shape: Shape) -> None:
    """`convert` (`_is_convert`) converts a value of `shape` (a fused computation that other
    fusions share is cloned first)."""
    if convert.opcode == "fusion":
        fused = convert.attrs["calls"]
        if len(module.callers_of(fused)) != 1:
            fused = convert.attrs["calls"] = module.clone_computation(fused, suffix="reordered")
        fused.parameter(0).set_shape(shape.with_dtype(fused.parameter(0).shape.dtype))
        fused.root.set_shape(shape.with_dtype(fused.root.shape.dtype))
    convert.set_shape(shape.with_dtype(convert.shape.dtype))


def _read_reordered(module: HloModule, values: list[HloInstruction], users: list[HloInstruction],
                    dims: tuple[int, ...], shape: Shape, moved: dict[int, int] | None) -> None:
    """`users` of `values` (of shape `dims`), which only reduce them (`reduced_in_any_order`),
    read them at `shape`, reordered (`moved`, for a transpose): what carries them computes at
    `shape` (fused computations too, cloned when other fusions share them), a full reduction
    reduces all of its dimensions, a partial one the dimensions where `moved` put its own; the
    caller reorders `values`."""
    carried, ends, _ = reduced_in_any_order(values, users, dims, moved)
    elementwise = [instr for instr in carried if instr not in values and instr.opcode != "fusion"]
    if elementwise:
        _retype_chain(elementwise[0].parent, elementwise, dims, shape)
    for instr in carried + ends:
        if instr in values:
            continue
        if instr.opcode == "reduce":
            reduced = instr.attrs["dimensions"]
            instr.attrs["dimensions"] = tuple(range(shape.rank)) if len(reduced) == len(dims) else \
                tuple(sorted(moved[d] for d in reduced))
        elif instr.opcode == "fusion":
            fused = instr.attrs["calls"]
            if len(module.callers_of(fused)) != 1:
                fused = instr.attrs["calls"] = module.clone_computation(fused, suffix="reordered")
            parameters = [fused.parameter(i) for i, o in enumerate(instr.operands) if o in carried]
            _read_reordered(module, parameters, [u for p in parameters for u in p.users], dims, shape, moved)
            for parameter in parameters:
                parameter.set_shape(shape.with_dtype(parameter.shape.dtype))
            if instr in carried:
                instr.set_shape(shape.with_dtype(instr.shape.dtype))


def _reorder_first(fused: HloComputation, starts: list[HloInstruction], dims: tuple[int, ...], shape: Shape,
                   moved: dict[int, int] | None = None) -> None:
    """Inside `fused`: the chain from `starts` at `dims` to its reorderings (`reordered_chain`)
    computes at `shape`, the reordered shape (its statistics broadcast along the dimensions
    where the transpose `moved` puts theirs), and the reorderings go; the caller reorders what
    `starts` receive."""
    chain, ends = reordered_chain(starts, dims, statistics=moved is not None)
    _retype_chain(fused, chain, dims, shape, moved)
    for end in ends:
        end.replace_all_uses_with(end.operand(0))
        fused.remove_instruction(end)


def _retype_chain(comp: HloComputation, chain: list[HloInstruction], dims: tuple[int, ...], shape: Shape,
                  moved: dict[int, int] | None = None) -> None:
    """The elementwise instructions `chain` of `comp` compute at `shape` instead of `dims`, with
    their one-element constants, scalar broadcasts, and statistics broadcasts (along the
    dimensions where the transpose `moved` puts theirs)."""
    for operand in statistics_broadcasts(chain):
        along = tuple(moved[d] for d in operand.attrs["dimensions"])
        if all(u in chain for u in operand.users):
            operand.attrs["dimensions"] = along
            operand.set_shape(shape.with_dtype(operand.shape.dtype))
        else:
            replacement = comp.add_instruction("broadcast", [operand.operand(0)], shape.with_dtype(operand.shape.dtype),
                                               attrs={"dimensions": along}, after=operand)
            for user in [u for u in operand.users if u in chain]:
                user.replace_operand_with(operand, replacement)
    for instr in chain:
        for operand in instr.operands:
            if is_one_element_constant(operand) and operand.shape.rank and operand not in chain:
                value = operand.literal.to_numpy().reshape(shape.dims)
                instr.replace_operand_with(operand, comp.add_instruction(
                    "constant", [], shape.with_dtype(operand.shape.dtype), literal=Literal.from_numpy(value),
                    before=instr))
                if not operand.users:
                    comp.remove_instruction(operand)
            elif is_scalar_broadcast(operand) and operand.shape.dims == dims:
                if all(u in chain for u in operand.users):
                    operand.set_shape(shape.with_dtype(operand.shape.dtype))
                else:
                    instr.replace_operand_with(operand, comp.add_instruction(
                        "broadcast", [operand.operand(0)], shape.with_dtype(operand.shape.dtype),
                        attrs={"dimensions": ()}, before=instr))
        instr.set_shape(shape.with_dtype(instr.shape.dtype))  # a chain may convert


def _collapse_block_reduction(reduce_window: HloInstruction) -> None:
    """`reduce(reduce-window(x))` becomes `reduce(x)` (`block_reduction_opcode`, `reduced_fully`,
    `partials_reduced`): the fusions that reduce the partial results are inlined first."""
    source = reduce_window.operand(0)
    for fusion in list(dict.fromkeys(u for u in reduce_window.users if u.opcode == "fusion")):
        _inline_fusion(fusion)
    for reduce in list(reduce_window.users):
        reduce.set_operand(0, source)
    if not reduce_window.users:
        reduce_window.parent.remove_instruction(reduce_window)


def _is_fixable_use(instr: HloInstruction) -> bool:
    """A use that stops the update region only until `run` inlines or collapses it."""
    return is_norm_fusion(instr) or is_statistics_fusion(instr) or is_collapsible_block_reduction(instr)


def _inline_fusion(fusion: HloInstruction) -> None:
    """Replace `fusion` by the instructions of its fused computation, which goes when no other
    fusion calls it."""
    module, fused = fusion.parent.parent, fusion.attrs["calls"]
    inline(fusion, fused)
    if not module.callers_of(fused):
        module.remove_computation(fused)


def _origin_name(instr: HloInstruction, callers: dict, shared_op_names) -> str:
    """The name of the parameter a value comes from (through reshapes, tuples and shard_map bodies):
    its op_name unless `shared_op_names(computation)` has it; `callers` is the module's `callers()`."""
    seen = set()
    while instr not in seen:
        seen.add(instr)
        if instr.opcode in ("reshape", "bitcast", "copy", "convert") and instr.operand_count == 1:
            instr = instr.operand(0)
        elif instr.opcode == "get-tuple-element":
            source = instr.operand(0)
            if source.opcode == "custom-call" and source.attrs.get("custom_call_target") == \
                    "xla.sdy.GlobalToLocalShape":
                instr = source.operand(instr.attrs["index"])
            elif source.opcode == "tuple":
                instr = source.operand(instr.attrs["index"])
            else:
                break
        elif instr.opcode == "parameter" and not instr.parent.is_entry:
            calls = callers.get(instr.parent, [])
            if len(calls) != 1 or calls[0].opcode != "call":
                break
            instr = calls[0].operand(instr.parameter_number)
        else:
            break
    op_name = _parameter_op_name(instr)
    if op_name is None or op_name in shared_op_names(instr.parent):
        return instr.name  # TF names every parameter "XLA_Args": only a distinct op_name says more
    return op_name


def _parameter_op_name(instr: HloInstruction) -> str | None:
    metadata = instr.attrs.get("metadata") if instr.opcode == "parameter" else None
    op_name = metadata.get("op_name") if metadata is not None else None
    return op_name if isinstance(op_name, str) and op_name else None
