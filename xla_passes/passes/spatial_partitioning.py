"""`spatial-partitioning`: split images across devices by rows (and columns).

Detection and segmentation models have huge activations and small batches, so the TPU-pod
papers (arXiv 1909.09756, 2011.03641) split each image spatially: every device computes a
slab of rows and exchanges halo rows with its neighbours for each convolution. This pass
turns a single-device program into that per-device program. A 3x3 SAME convolution over
`f32[1,16,16,3]` split 4 ways along H (scalar broadcasts written inline)::

    x    = f32[1,16,16,3] parameter(0)
    conv = f32[1,16,16,8] convolution(x, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
    ROOT s = f32[8] reduce(conv, zero), dimensions={0,1,2}, to_apply=add

becomes (each device holds 4 rows; one row comes from each neighbour, zeros at the edges)::

    x    = f32[1,4,16,3] parameter(0), sharding={devices=[1,4,1,1]0,1,2,3}
    up   = f32[1,1,16,3] collective-permute(slice(x) [3:4]), source_target_pairs={{0,1},{1,2},{2,3}}
    down = f32[1,1,16,3] collective-permute(slice(x) [0:1]), source_target_pairs={{1,0},{2,1},{3,2}}
    halo = f32[1,6,16,3] concatenate(up, x, down), dimensions={1}
    conv = f32[1,4,16,8] convolution(halo, k), window={size=3x3 pad=0_0x1_1}, dim_labels=b01f_01io->b01f
    s    = f32[8] reduce(conv, zero), dimensions={0,1,2}, to_apply=add
    ROOT s.1 = f32[8] all-reduce(s), replica_groups={{0,1,2,3}}, to_apply=add, sharding={replicated}

Values follow the slab through elementwise ops, broadcasts, transposes and reshapes that
keep the split dimension; convolutions, reduce-window and select-and-scatter exchange halos
sized from their windows (`xla_passes.spatial.windows`); reductions over split dimensions
and convolutions whose window is split (weight gradients) reduce locally and all-reduce;
explicit pads and slices along a split dimension become window padding of the convolution
they feed or are fed by (Keras's ZeroPadding2D and its gradient), or run on slabs of their
new size with per-device row fetches; anything else (a flatten into a dense layer, a strided
slice across the split) all-gathers its operand first, and the report says where and why.
Uneven splits pad the last slab and mask it; windows whose output slabs do not line up with
the input slabs (10 rows over 4 devices into a stride-2 window) fetch the widest halo any
device needs and dynamic-slice each device's rows at an offset from a partition-id table,
as GSPMD does; `halo_fusion=k` exchanges a k-convolution-deep halo once and recomputes the
overlap.
docs/spatial_partitioning.md has the options, the report and the limits.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from hlo_tools import HloInstruction, HloModule, Shape
from hlo_tools.ir.attributes import FrontendAttributes, Sharding
from hlo_tools.ir.opcodes import ELEMENTWISE
from hlo_tools.ir.shape import FLOAT_DTYPES

from ..analysis.collectives import reducer_opcode
from ..analysis.reachability import reachable_from
from ..core import HloPass, register_pass
from ..rewrites.inlining import inline_calls
from ..spatial.builder import SlabBuilder
from ..spatial.layout import REPLICATED, Layout, Mesh, Split, local_dims, slab_rows, split_of
from ..spatial.windows import (RowRange, aligned_output_rows, needed_rows, plan_row_fetch, plan_select_and_scatter,
                               plan_window, scatter_row_ranges, window_row_range)

logger = logging.getLogger("xla_passes")

# Reducers whose partial results combine with an all-reduce of the same computation.
_COMBINABLE_REDUCERS = frozenset({"add", "multiply", "maximum", "minimum", "and", "or"})
_MAX_SELECT = {"GE": -math.inf, "GT": -math.inf, "LE": math.inf, "LT": math.inf}


@dataclasses.dataclass
class SpatialReport:
    """One thing the pass did: a split input, a halo exchange, a forced all-gather, an all-reduce."""

    kind: str          # split | halo | fused-halo | all-gather | all-reduce
    instruction: str
    detail: str

    def __str__(self) -> str:
        return f"spatial-partitioning: {self.kind} %{self.instruction}: {self.detail}"


@register_pass
class SpatialPartitioning(HloPass):
    """Split images over devices by rows (mesh=RxC: rows and columns), exchanging halos."""

    name = "spatial-partitioning"
    runs_at_jax_hook = False  # it partitions single-device programs; the hook's are per device
    num_partitions: int = 4   # devices along H (ignored when `mesh` is given)
    mesh: str = ""            # "2x2": H over the first axis, W over the second
    split: str = ""           # "P:D" (or "P:D0:D1" for a 2-D mesh) per split parameter, ';'-separated
    halo_fusion: int = 1      # exchange one halo deep enough for this many stride-1 convolutions

    def __post_init__(self):
        self.report: list[SpatialReport] = []
        if self.halo_fusion < 1:
            raise ValueError("halo_fusion must be at least 1")
        self.device_mesh()

    def device_mesh(self) -> Mesh:
        if self.mesh:
            try:
                axes = tuple(int(a) for a in self.mesh.lower().split("x"))
            except ValueError:
                raise ValueError(f"mesh={self.mesh!r} is not like 2x2") from None
            if len(axes) > 2 or min(axes) < 1:
                raise ValueError(f"mesh={self.mesh!r}: one or two axes of at least 1 device")
        else:
            axes = (self.num_partitions,)
        if math.prod(axes) < 2:
            raise ValueError("spatial partitioning needs at least 2 devices")
        return Mesh(axes)

    def run(self, module: HloModule) -> bool:
        self.report = []
        if module.num_partitions > 1 or module.replica_count > 1:
            raise self.fail("expects a single-device module (no num_partitions or replica_count)")
        inline_calls(module)
        _fold_tuple_lookups(module.entry)
        _fold_padded_select_and_scatter(module.entry)
        folds, refused_pads = _fold_pads_into_convolutions(module.entry)
        folds += _fold_slices_into_convolutions(module.entry)
        mesh = self.device_mesh()
        splits = self._parameter_splits(module, mesh)
        partitioner = _Partitioner(self, module, mesh)
        partitioner.refused_pads = refused_pads
        partitioner.run(splits)
        module.set_attr("num_partitions", mesh.size)
        self.report = folds + partitioner.report
        for entry in self.report:
            logger.info("%s", entry)
        return True

    def _parameter_splits(self, module: HloModule, mesh: Mesh) -> dict[int, tuple[int, ...]]:
        """Entry parameter number -> the dimension split along each mesh axis."""
        entry = module.entry
        rank = len(mesh.axes)
        if self.split:
            splits = {}
            for item in self.split.split(";"):
                parts = item.strip().split(":")
                try:
                    number, dims = int(parts[0]), tuple(int(p) for p in parts[1:])
                except ValueError:
                    raise self.fail(f"split={self.split!r}: expected P:D entries") from None
                if len(dims) != rank:
                    raise self.fail(f"split={self.split!r}: {item!r} needs {rank} dimension(s) for mesh {mesh.axes}")
                if not 0 <= number < entry.num_parameters:
                    raise self.fail(f"split={self.split!r}: the entry has no parameter {number}")
                shape = entry.parameter(number).shape
                if not shape.is_array or any(not 0 <= d < shape.rank for d in dims) or len(set(dims)) != rank:
                    raise self.fail(f"split={self.split!r}: parameter {number} ({shape}) has no such dimensions")
                splits[number] = dims
            return splits
        for conv in entry.instructions:
            if conv.opcode != "convolution":
                continue
            source = _image_source(conv.operand(0))
            shape = source.shape
            if (source.opcode == "parameter" and shape.is_array and shape.rank == 4
                    and shape.dtype in FLOAT_DTYPES):
                spatial = conv.attrs["dim_labels"].input_spatial
                return {source.parameter_number: tuple(spatial[:rank])}
        raise self.fail("no rank-4 floating-point entry parameter feeds a convolution; "
                        "say which to split with split=P:D")


class _Gather(Exception):
    """An instruction that cannot stay partitioned; the message says why."""


@dataclasses.dataclass(frozen=True)
class _Unaligned:
    """A split dimension of a windowed op's operand whose output slabs do not line up with
    the input slabs: each device reads `rows` of the input (dilated by `base_dilation`, which
    the device then applies itself) and runs the window without padding."""

    rows: RowRange
    base_dilation: int = 1


class _Partitioner:
    """Rewrites the entry computation into the per-device program, instruction by instruction."""

    def __init__(self, owner: SpatialPartitioning, module: HloModule, mesh: Mesh):
        self.owner = owner
        self.module = module
        self.comp = module.entry
        self.mesh = mesh
        self.b = SlabBuilder(module, module.entry, mesh)
        self.values: dict[HloInstruction, tuple[HloInstruction, Layout]] = {}
        self._gathered: dict[HloInstruction, HloInstruction] = {}
        self._pieces: dict[tuple, HloInstruction] = {}
        self._exchanged: dict[tuple, HloInstruction] = {}   # (slab, dim, low, high) -> with its halo
        self._parameter_shapes: dict[HloInstruction, Shape] = {}  # split parameters' global shapes
        self.report: list[SpatialReport] = []

    # -- driver ------------------------------------------------------------------------------------
    def run(self, splits: dict[int, tuple[int, ...]]):
        self.splits = splits
        old_root = self.comp.root
        order = self.comp.post_order()
        self.from_inputs = reachable_from([self.comp.parameter(n) for n in splits], order)
        for instr in order:
            if instr is not old_root or instr.opcode != "tuple":
                self.values[instr] = self.visit(instr)
        self.comp.set_root(self.finish_root(old_root))
        self.comp.remove_dead_code()
        self.comp.sort_topologically()

    def visit(self, instr: HloInstruction) -> tuple[HloInstruction, Layout]:
        if instr.opcode == "parameter":
            return self.parameter(instr)
        if not any(self.values[o][1] for o in instr.operands):
            return self.keep(instr, None)
        handler = self.elementwise if instr.opcode in ELEMENTWISE else getattr(
            self, "visit_" + instr.opcode.replace("-", "_"), None)
        if handler is None:
            return self.keep(instr, f"{instr.opcode} is not partitioned")
        try:
            return handler(instr)
        except _Gather as reason:
            return self.keep(instr, str(reason))

    def keep(self, instr: HloInstruction, reason: str | None) -> tuple[HloInstruction, Layout]:
        """`instr` on whole (replicated) operands: itself when they are its own operands."""
        operands = [self.whole(o, instr, reason) for o in instr.operands]
        if all(new is old for new, old in zip(operands, instr.operands)):
            return instr, REPLICATED
        return self.clone(instr, operands, instr.shape), REPLICATED

    def clone(self, instr: HloInstruction, operands, shape: Shape, **changes) -> HloInstruction:
        attrs = {k: v for k, v in instr.attrs.items() if k not in ("control-predecessors", "sharding")}
        attrs.update(changes)
        return self.comp.add_instruction(instr.opcode, operands, shape, name=instr.name, attrs=attrs,
                                         literal=instr.literal)

    def note(self, kind: str, instr: HloInstruction, detail: str):
        self.report.append(SpatialReport(kind, instr.name, detail))

    # -- values in the layouts consumers need --------------------------------------------------------
    def whole(self, old: HloInstruction, user: HloInstruction | None, reason: str | None) -> HloInstruction:
        """The whole array of `old` on every device (all-gathered when it is split); `user`
        is who needs it (None: the result)."""
        new, layout = self.values[old]
        if not layout:
            return new
        if old not in self._gathered:
            value = self.trim(new, layout, tuple(s.slab() for s in layout))
            for split in layout:
                value = self.b.all_gather(value, split.slab())
            self._gathered[old] = value
            where = f"before %{user.name} ({user.opcode})" if user is not None else "at the result"
            self.note("all-gather", old, f"{where}: {reason or 'needs the whole array'}")
        return self._gathered[old]

    def trim(self, value: HloInstruction, have: Layout, want: Layout) -> HloInstruction:
        """Drop ghost rows: `have` and `want` split the same dimensions, `want` with fewer ghosts."""
        for split, target in zip(have, want):
            if (split.low, split.high) != (target.low, target.high):
                start = split.low - target.low
                value = self.b.slice_dim(value, split.dim, start, start + target.extent)
        return value

    def local(self, old: HloInstruction, target: Layout) -> HloInstruction:
        """`old` laid out as `target`."""
        new, layout = self.values[old]
        if layout == target:
            return new
        if not layout:
            return self.piece(new, target)
        if ([s.dim for s in layout] == [t.dim for t in target]
                and all(s.same_slabs(t) and s.low >= t.low and s.high >= t.high for s, t in zip(layout, target))):
            return self.trim(new, layout, target)
        return self.piece(self.whole(old, old, "split differently from its use"), target)

    def piece(self, value: HloInstruction, target: Layout) -> HloInstruction:
        """A device's piece of the replicated `value`: broadcasts and iotas are rebuilt at the
        piece's size, anything else is dynamic-sliced at the device's offset."""
        key = (value, target)
        if key in self._pieces:
            return self._pieces[key]
        dims = local_dims(value.shape.dims, target)
        if value.opcode == "broadcast":
            mapping = value.attrs["dimensions"]
            operand_layout = tuple(s.moved(mapping.index(s.dim)) for s in target if s.dim in mapping)
            operand = self.piece(value.operand(0), operand_layout) if operand_layout else value.operand(0)
            result = self.b.add("broadcast", [operand], value.shape.with_dims(dims), dimensions=mapping)
        elif value.opcode == "iota" and split_of(target, value.attrs["iota_dimension"]) is None:
            result = self.b.add("iota", [], value.shape.with_dims(dims), iota_dimension=value.attrs["iota_dimension"])
        else:
            result = self.b.dynamic_slab(value, target, self.b.constant(0, value.shape.dtype))
        self._pieces[key] = result
        return result

    # -- parameters and the result ------------------------------------------------------------------
    def parameter(self, instr: HloInstruction) -> tuple[HloInstruction, Layout]:
        dims = self.splits.get(instr.parameter_number)
        if dims is None:
            return instr, REPLICATED
        shape = instr.shape
        self._parameter_shapes[instr] = shape
        layout = tuple(sorted((Split(d, axis, shape.dims[d], slab_rows(shape.dims[d], self.mesh.axes[axis]))
                               for axis, d in enumerate(dims)), key=lambda s: s.dim))
        instr.set_shape(shape.with_dims(local_dims(shape.dims, layout)))
        instr.attrs["sharding"] = self.sharding(shape.rank, layout)
        if any(self.uneven(s) for s in layout):  # the runner reads the global shape from here
            existing = instr.attrs.get("frontend_attributes")
            items = tuple(kv for kv in (existing.items if existing else ()) if kv[0] != "global_shape")
            instr.attrs["frontend_attributes"] = FrontendAttributes(
                items + (("global_shape", shape.without_layout().to_text()),))
        self.note("split", instr, ", ".join(
            f"dimension {s.dim} ({s.size} rows) over {self.mesh.axes[s.axis]} devices, {s.local} per device"
            + (f" (the last holds {max(s.size - s.local * (self.mesh.axes[s.axis] - 1), 0)})"
               if s.local * self.mesh.axes[s.axis] != s.size else "")
            for s in layout))
        return instr, layout

    def global_dims(self, old: HloInstruction) -> tuple[int, ...]:
        """The dimensions of an original instruction (split parameters now have per-device shapes)."""
        return self._parameter_shapes.get(old, old.shape).dims

    def sharding(self, rank: int, layout: Layout) -> Sharding:
        if not layout:
            return Sharding.replicated()
        tiles = self.mesh.tile_dims(rank, layout)
        replicas = self.mesh.size // math.prod(tiles)
        if replicas > 1:
            return Sharding.tiled(tiles + (replicas,), self.mesh.device_order(layout), last_tile_dim_replicate=True)
        return Sharding.tiled(tiles, self.mesh.device_order(layout))

    def output(self, old: HloInstruction) -> tuple[HloInstruction, Layout]:
        """A result leaf as the runner reads it: whole slabs, or the whole array when uneven."""
        new, layout = self.values[old]
        if any(s.local * self.mesh.axes[s.axis] != s.size for s in layout):
            return self.whole(old, None, "an uneven split cannot leave the program"), REPLICATED
        slabs = tuple(s.slab() for s in layout)
        return self.trim(new, layout, slabs), slabs

    def finish_root(self, root: HloInstruction) -> HloInstruction:
        if root.opcode == "tuple":
            leaves = [self.output(o) for o in root.operands]
            new = self.b.add("tuple", [v for v, _ in leaves], name=root.name)
            sharding = Sharding.tuple_of([self.sharding(o.shape.rank if o.shape.is_array else 0, layout)
                                          for o, (_, layout) in zip(root.operands, leaves)])
        else:
            new, layout = self.output(root)
            if new is root:
                new = self.clone(root, root.operands, root.shape)
            sharding = (Sharding.tuple_of([Sharding.replicated()] * len(root.shape.tuple_shapes))
                        if root.shape.is_tuple else self.sharding(root.shape.rank, layout))
        new.attrs["sharding"] = sharding
        return new

    # -- layout-preserving instructions -------------------------------------------------------------
    def merged_layout(self, instr: HloInstruction) -> Layout:
        """The layout an elementwise op computes in: its split operands' slabs, with the ghost
        rows they all have."""
        by_dim: dict[int, Split] = {}
        for operand in instr.operands:
            for split in self.values[operand][1]:
                seen = by_dim.get(split.dim)
                if seen is None:
                    by_dim[split.dim] = split
                elif not seen.same_slabs(split):
                    raise _Gather(f"operands split differently along dimension {split.dim}")
                else:
                    by_dim[split.dim] = seen.with_ghosts(min(seen.low, split.low), min(seen.high, split.high))
        for operand in instr.operands:
            layout = self.values[operand][1]
            if layout and [s.dim for s in layout] != sorted(by_dim):
                by_dim = {d: s.slab() for d, s in by_dim.items()}
        return tuple(by_dim[d] for d in sorted(by_dim))

    def elementwise(self, instr: HloInstruction):
        layout = self.merged_layout(instr)
        operands = [self.local(o, layout) if o.shape.rank else self.values[o][0] for o in instr.operands]
        return self.clone(instr, operands, instr.shape.with_dims(local_dims(instr.shape.dims, layout))), layout

    def moved(self, instr: HloInstruction, layout: Layout, operands=None, **changes):
        new = self.clone(instr, operands or [self.values[o][0] for o in instr.operands],
                         instr.shape.with_dims(local_dims(instr.shape.dims, layout)), **changes)
        return new, tuple(sorted(layout, key=lambda s: s.dim))

    def visit_broadcast(self, instr: HloInstruction):
        mapping = instr.attrs["dimensions"]
        return self.moved(instr, tuple(s.moved(mapping[s.dim]) for s in self.values[instr.operand(0)][1]))

    def visit_transpose(self, instr: HloInstruction):
        perm = instr.attrs["dimensions"]
        return self.moved(instr, tuple(s.moved(perm.index(s.dim)) for s in self.values[instr.operand(0)][1]))

    def visit_reshape(self, instr: HloInstruction):
        before, after = self.global_dims(instr.operand(0)), instr.shape.dims
        layout = []
        for split in self.values[instr.operand(0)][1]:
            major = math.prod(before[:split.dim])
            dim = next((e for e in range(len(after)) if math.prod(after[:e]) == major
                        and after[e] == before[split.dim]), None)
            if dim is None:
                raise _Gather(f"the reshape merges or splits dimension {split.dim}, which is split")
            layout.append(split.moved(dim))
        return self.moved(instr, tuple(layout))

    def visit_copy(self, instr: HloInstruction):
        return self.elementwise(instr)

    def visit_reverse(self, instr: HloInstruction):
        layout = self.values[instr.operand(0)][1]
        if any(s.dim in instr.attrs["dimensions"] for s in layout):
            raise _Gather("the reverse runs along a split dimension")
        return self.moved(instr, layout)

    def visit_slice(self, instr: HloInstruction):
        layout = self.values[instr.operand(0)][1]
        spec = instr.attrs["slice"]
        shifted = {}
        for split in layout:
            start, limit, stride = spec.dims[split.dim]
            if (start, limit, stride) == (0, split.size, 1):
                continue
            if stride != 1:
                raise _Gather(f"the slice strides split dimension {split.dim}")
            shifted[split.dim] = (start, limit - start)
        if shifted:
            return self.shift_rows(instr, shifted, self.b.constant(0, instr.shape.dtype))
        dims = tuple((0, s.extent, 1) if split_of(layout, d) and (s := split_of(layout, d)) else spec.dims[d]
                     for d in range(instr.shape.rank))
        return self.moved(instr, layout, slice=type(spec)(dims))

    def visit_pad(self, instr: HloInstruction):
        layout = self.values[instr.operand(0)][1]
        if self.values[instr.operand(1)][1]:
            raise _Gather("the padding value is split")
        config = instr.attrs["padding"]
        shifted = {}
        for split in layout:
            low, high, interior = config.dims[split.dim]
            if (low, high, interior) == (0, 0, 0):
                continue
            if interior:
                raise _Gather(f"the pad has interior padding along split dimension {split.dim}")
            shifted[split.dim] = (-low, split.size + low + high)
        if any(size < 1 for _, size in shifted.values()):
            raise _Gather("the pad leaves no rows of a split dimension")
        if shifted:
            return self.shift_rows(instr, shifted, self.values[instr.operand(1)][0])
        return self.moved(instr, layout)

    def shift_rows(self, instr: HloInstruction, shifted: dict, fill: HloInstruction):
        """A pad or a slice that moves the rows of split dimensions: `shifted[dim] = (offset,
        size)` says that row r of the result is row r + offset of the operand (a pad: -low; a
        slice: its start) and that the result has `size` rows. The result is split into slabs
        of ceil(size/N) rows, each device fetching the operand rows its slab holds (the
        unaligned-window fetch: the widest halo any device needs, a per-device dynamic-slice)
        with the rows outside the operand set to `fill`, the padding value: the first and last
        slabs get the edge padding, the inner ones none. The op then runs on the dimensions
        that are not split."""
        operand = instr.operand(0)
        halos, layout = {}, []
        for split in self.values[operand][1]:
            if split.dim not in shifted:
                halos[split.dim] = (0, 0)
                layout.append(split.slab())
                continue
            offset, size = shifted[split.dim]
            parts = self.mesh.axes[split.axis]
            local = slab_rows(size, parts)
            halos[split.dim] = _Unaligned(RowRange(tuple(c * local + offset for c in range(parts)), local))
            layout.append(Split(split.dim, split.axis, size, local))
        value = self.halo_input(operand, instr, halos, fill, False)
        why = self.refused_pads.get(instr.name)
        self.note(instr.opcode, instr, ", ".join(
            f"dimension {d}: rows [{offset}, {offset + size}) of %{operand.name} ({size} rows), fetched per device"
            for d, (offset, size) in sorted(shifted.items()))
            + (f" (not window padding of a convolution: {why})" if why else ""))
        layout = tuple(layout)
        if instr.opcode == "pad":
            config = instr.attrs["padding"]
            dims = tuple((0, 0, 0) if split_of(layout, d) else config.dims[d] for d in range(instr.shape.rank))
            if all(d == (0, 0, 0) for d in dims):
                return value, layout
            return self.moved(instr, layout, [value, fill], padding=type(config)(dims))
        spec = instr.attrs["slice"]
        dims = tuple((0, s.local, 1) if (s := split_of(layout, d)) else spec.dims[d] for d in range(instr.shape.rank))
        if all(d == (0, n, 1) for d, n in zip(dims, value.shape.dims)):
            return value, layout
        return self.moved(instr, layout, [value], slice=type(spec)(dims))

    def visit_concatenate(self, instr: HloInstruction):
        layout = self.merged_layout(instr)
        if split_of(layout, instr.attrs["dimensions"][0]):
            raise _Gather("the concatenation runs along a split dimension")
        return self.moved(instr, layout, [self.local(o, layout) for o in instr.operands])

    def visit_dot(self, instr: HloInstruction):
        lhs, rhs = (self.values[o][1] for o in instr.operands)
        attrs = instr.attrs
        lhs_batch, rhs_batch = attrs.get("lhs_batch_dims", ()), attrs.get("rhs_batch_dims", ())
        lhs_free = [d for d in range(instr.operand(0).shape.rank)
                    if d not in lhs_batch and d not in attrs.get("lhs_contracting_dims", ())]
        rhs_free = [d for d in range(instr.operand(1).shape.rank)
                    if d not in rhs_batch and d not in attrs.get("rhs_contracting_dims", ())]
        if lhs and rhs:
            return self.contracted_dot(instr, lhs, rhs)
        free, offset = (lhs_free, len(lhs_batch)) if lhs else (rhs_free, len(lhs_batch) + len(lhs_free))
        layout = []
        for split in lhs or rhs:
            if split.dim not in free:
                raise _Gather(f"the dot contracts or batches split dimension {split.dim}")
            layout.append(split.moved(offset + free.index(split.dim)))
        return self.moved(instr, tuple(layout))

    def contracted_dot(self, instr: HloInstruction, lhs: Layout, rhs: Layout):
        """Both operands split along the same contracting dimension (a dense layer's weight
        gradient over split examples): local dot, then an all-reduce of the partial sums."""
        lhs_contracting = instr.attrs.get("lhs_contracting_dims", ())
        rhs_contracting = instr.attrs.get("rhs_contracting_dims", ())
        if (len(lhs) != 1 or len(rhs) != 1 or lhs[0].dim not in lhs_contracting
                or rhs_contracting[lhs_contracting.index(lhs[0].dim)] != rhs[0].dim or not lhs[0].same_slabs(rhs[0])):
            raise _Gather("both dot operands are split, not along one contracting dimension")
        return self.partial_sums(instr, list(zip(instr.operands, (lhs[0], rhs[0]))),
                                 f"partial sums of a dot over split contracting dimension {lhs[0].dim}")

    # -- reductions --------------------------------------------------------------------------------
    def visit_reduce(self, instr: HloInstruction):
        if instr.operand_count != 2:
            raise _Gather("a variadic reduce is not partitioned")
        data, init = instr.operands
        layout = self.values[data][1]
        reduced = instr.attrs["dimensions"]
        across = [s for s in layout if s.dim in reduced]
        reducer = instr.attrs["to_apply"]
        if across and reducer_opcode(reducer) not in _COMBINABLE_REDUCERS:
            raise _Gather("its reducer does not combine partial results")
        want = tuple(s.slab() if s.dim in reduced else s for s in layout)
        value = self.local(data, want)
        init_value = self.whole(init, instr, "the initial value is split")
        uneven = [s for s in want if s.dim in reduced and self.uneven(s)]
        value = self.b.mask(value, uneven, init_value)
        kept = [d for d in range(data.shape.rank) if d not in reduced]
        out_layout = tuple(s.moved(kept.index(s.dim)) for s in want if s.dim not in reduced)
        new = self.clone(instr, [value, init_value], instr.shape.with_dims(local_dims(instr.shape.dims, out_layout)))
        if across:
            new = self.b.all_reduce(new, [s.axis for s in across], reducer)
            self.note("all-reduce", instr, f"partial {reducer_opcode(reducer)} over split dimension(s) "
                      f"{', '.join(str(s.dim) for s in across)}")
        return new, out_layout

    def uneven(self, split: Split) -> bool:
        return split.local * self.mesh.axes[split.axis] != split.size

    # -- windowed instructions ------------------------------------------------------------------------
    def halo_input(self, old: HloInstruction, instr: HloInstruction, halos: dict, pad: HloInstruction,
                   pad_is_zero: bool) -> HloInstruction:
        """The operand `old` with `halos[dim] = (rows before, rows after)` its slab along each
        split dimension (exchanged, or the ghost rows it has), rows outside the array set to `pad`."""
        new, layout = self.values[old]
        mask, unaligned_rows, slice_starts = [], [], {}
        for split in layout:
            if split.dim not in halos:
                raise _Gather(f"operand %{old.name} is split along dimension {split.dim}, outside the window")
            if isinstance(halos[split.dim], _Unaligned):
                new, start, first_row, size = self.fetch_rows(old, instr, new, split, halos[split.dim], pad)
                slice_starts[split.dim] = (start, halos[split.dim].rows.count)
                unaligned_rows.append((split.dim, first_row, size))
                continue
            low, high = halos[split.dim]
            if (low or high) and split.low >= low and split.high >= high:
                wanted = split.with_ghosts(low, high)
                new = self.trim(new, (split,), (wanted,))
                mask.append(wanted)
                continue
            new = self.trim(new, (split,), (split.slab(),))
            wider = next(((k, v) for k, v in self._exchanged.items() if k[:2] == (new, split.dim)
                          and k[2] >= low and k[3] >= high), None)
            if wider is not None and (low or high):
                (_, _, have_low, have_high), extended = wider
                wanted = split.with_ghosts(low, high)
                new = self.trim(extended, (split.with_ghosts(have_low, have_high),), (wanted,))
                if self.uneven(split) or not pad_is_zero:
                    mask.append(wanted)
                continue
            if max(low, high) > split.local * (self.mesh.axes[split.axis] - 1):
                raise _Gather(f"its halo ({low}+{high} rows) is wider than the other devices' rows")
            if low or high:
                new = self.exchanged(old, instr, new, split, low, high)
            if self.uneven(split) or (not pad_is_zero and (low or high)):
                mask.append(split.with_ghosts(low, high))
        if slice_starts:
            zero = self.b.constant(0)
            starts = [slice_starts[d][0] if d in slice_starts else zero for d in range(new.shape.rank)]
            sizes = tuple(slice_starts[d][1] if d in slice_starts else n for d, n in enumerate(new.shape.dims))
            new = self.b.add("dynamic-slice", [new, *starts], new.shape.with_dims(sizes), dynamic_slice_sizes=sizes)
        new = self.b.mask(new, mask, pad)
        return self.b.mask_rows(new, unaligned_rows, pad)

    def exchanged(self, old: HloInstruction, instr: HloInstruction, slab: HloInstruction, split: Split,
                  low: int, high: int, detail: str = "") -> HloInstruction:
        """`slab` with `low`/`high` rows of its neighbours along `split` (one exchange per value and width)."""
        key = (slab, split.dim, low, high)
        if key not in self._exchanged:
            before = self.b.collective_permutes
            self._exchanged[key] = self.b.exchange(slab, split.slab(), low, high)
            self.note("halo", instr, f"{low}+{high} rows of %{old.name} along dimension {split.dim}{detail} "
                      f"({self.b.collective_permutes - before} collective-permutes)")
        return self._exchanged[key]

    def fetch_rows(self, old: HloInstruction, instr: HloInstruction, value: HloInstruction, split: Split,
                   unaligned: _Unaligned, pad: HloInstruction):
        """Along an unaligned `split`: `value` (the device's slab, dilated here if the window
        dilates its base) with the widest halo any device needs and local padding, plus the
        device's dynamic-slice start into it, the global index of its first row and the
        dilated size (the rows outside [0, size) are masked to `pad` after the slice)."""
        value = self.trim(value, (split,), (split.slab(),))
        ld = unaligned.base_dilation
        rows = split.slab()
        if ld > 1:
            value = self.b.pad_dim(value, split.dim, 0, ld - 1, pad, interior=ld - 1)
            rows = Split(split.dim, split.axis, (split.size - 1) * ld + 1, split.local * ld)
        fetch = plan_row_fetch(unaligned.rows, rows.local, rows.size)
        if fetch.low or fetch.high:
            value = self.exchanged(old, instr, value, rows, fetch.low, fetch.high,
                                   (f" (dilated {ld}x)" if ld > 1 else "")
                                   + f", then {unaligned.rows.count} rows at a per-device offset")
        else:
            self.note("halo", instr, f"0+0 rows of %{old.name} along dimension {split.dim}, "
                      f"then {unaligned.rows.count} rows at a per-device offset")
        if fetch.pad_low or fetch.pad_high:
            value = self.b.pad_dim(value, split.dim, fetch.pad_low, fetch.pad_high, pad)
        start = self.b.coordinate_table(fetch.offsets, split.axis)
        first_row = self.b.coordinate_table(unaligned.rows.starts, split.axis)
        return value, start, first_row, rows.size

    def window_plans(self, instr: HloInstruction, operand: HloInstruction, window, dims_map, out_dims,
                     fusable: bool) -> dict:
        """dim -> (output split, WindowPlan or _Unaligned) for each split dimension of a windowed
        op's operand.

        `dims_map[d]` is the window dimension of operand dimension d; `out_dims[d]` the output
        dimension it becomes."""
        plans = {}
        for split in self.values[operand][1]:
            if split.dim not in dims_map:
                raise _Gather(f"operand dimension {split.dim} is split but not windowed")
            wd = window.dimensions[dims_map[split.dim]]
            parts = self.mesh.axes[split.axis]
            out_dim = out_dims[split.dim]
            out_size = instr.shape.dims[out_dim]
            # Outputs are always split evenly (ceil(size/parts) rows per device), so that they
            # combine with any other value split along the same dimension.
            out_rows = slab_rows(out_size, parts)
            geometry = dict(in_rows=split.local, padding_low=wd.padding_low, base_dilation=wd.base_dilation,
                            stride=wd.stride, window_dilation=wd.window_dilation, window=wd.size, out_rows=out_rows)
            need_low, need_high = needed_rows(**geometry)
            if (aligned_output_rows(split.local, wd.base_dilation, wd.stride) != out_rows
                    or max(need_low, need_high) > split.local * (parts - 1)):   # or beyond the neighbours
                rows = window_row_range(parts=parts, out_rows=out_rows, padding_low=wd.padding_low,
                                        stride=wd.stride, window_dilation=wd.window_dilation, window=wd.size)
                plans[split.dim] = (Split(out_dim, split.axis, out_size, out_rows), _Unaligned(rows, wd.base_dilation))
                continue
            unit = fusable and wd.stride == 1 and wd.base_dilation == 1
            if unit and (split.low or split.high) and split.low >= need_low and split.high >= need_high:
                plan = plan_window(**geometry, have_low=split.low, have_high=split.high,
                                   out_low=split.low - max(need_low, 0), out_high=split.high - max(need_high, 0))
                self.note("fused-halo", instr, f"uses ghost rows {split.low}+{split.high} of "
                          f"%{operand.name} along dimension {split.dim}: no exchange")
            else:
                extra_low, extra_high = (self.fusion_depth(instr, out_dim, split.local - max(need_low, 0),
                                                           split.local - max(need_high, 0)) if unit else (0, 0))
                plan = plan_window(**geometry, out_low=extra_low, out_high=extra_high)
            plans[split.dim] = (Split(out_dim, split.axis, out_size, out_rows, plan.out_low, plan.out_high), plan)
        return plans

    def fusion_depth(self, conv: HloInstruction, out_dim: int, room_low: int, room_high: int) -> tuple[int, int]:
        """Ghost rows `conv` should compute so that the next `halo_fusion - 1` stride-1
        convolutions fed (through elementwise ops) by its output need no exchange; at most
        `room_low`/`room_high`, what one hop from each neighbour brings beyond `conv`'s own halo."""
        low = high = 0
        current, dim = conv, out_dim
        for _ in range(self.owner.halo_fusion - 1):
            nxt = _next_convolution(current, self.from_inputs)
            if nxt is None:
                break
            dn = nxt.attrs["dim_labels"]
            if dim not in dn.input_spatial:
                break
            index = dn.input_spatial.index(dim)
            wd = nxt.attrs["window"].dimensions[index]
            if wd.stride != 1 or wd.base_dilation != 1:
                break
            need_low, need_high = needed_rows(in_rows=1, padding_low=wd.padding_low, base_dilation=1, stride=1,
                                              window_dilation=wd.window_dilation, window=wd.size, out_rows=1)
            if low + max(need_low, 0) > room_low or high + max(need_high, 0) > room_high:
                break
            low += max(need_low, 0)
            high += max(need_high, 0)
            current, dim = nxt, dn.output_spatial[index]
        return low, high

    def visit_convolution(self, instr: HloInstruction):
        lhs, rhs = instr.operands
        dn = instr.attrs["dim_labels"]
        window = instr.attrs["window"]
        lhs_layout, rhs_layout = self.values[lhs][1], self.values[rhs][1]
        if split_of(lhs_layout, dn.input_batch) is not None or split_of(lhs_layout, dn.input_feature) is not None:
            return self.batch_convolution(instr)
        spatial = {d: i for i, d in enumerate(dn.input_spatial)}
        contracted = {}
        for split in rhs_layout:
            if split.dim not in dn.kernel_spatial:
                raise _Gather(f"the kernel is split along non-spatial dimension {split.dim}")
            index = dn.kernel_spatial.index(split.dim)
            partner = split_of(lhs_layout, dn.input_spatial[index])
            if partner is None or partner.axis != split.axis:
                raise _Gather("the kernel is split along a window dimension the input is not")
            contracted[partner.dim] = (index, split)
        if not contracted:
            plans = self.window_plans(instr, lhs, window, spatial,
                                      {d: dn.output_spatial[i] for d, i in spatial.items()}, fusable=True)
            dims = list(window.dimensions)
            for d, (_, plan) in plans.items():
                dims[spatial[d]] = _local_window_dimension(dims[spatial[d]], plan)
            value = self.halo_input(lhs, instr, _halos(plans), self.b.constant(0, lhs.shape.dtype), True)
            layout = tuple(sorted((out for out, _ in plans.values()), key=lambda s: s.dim))
            new = self.clone(instr, [value, self.values[rhs][0]],
                             instr.shape.with_dims(local_dims(instr.shape.dims, layout)),
                             window=type(window)(tuple(dims)))
            return new, layout
        return self.weight_gradient(instr, contracted)

    def batch_convolution(self, instr: HloInstruction):
        """A convolution over a split batch (`split=P:0` makes the step data-parallel): examples
        convolve on their own device, and a weight gradient, which contracts the examples (TF's
        and JAX's `conv(x, dy)` with the batch as input feature), adds its partial kernels."""
        lhs, rhs = instr.operands
        dn = instr.attrs["dim_labels"]
        lhs_layout, rhs_layout = self.values[lhs][1], self.values[rhs][1]
        if len(lhs_layout) != 1:
            raise _Gather("the batch and another dimension of the input are split")
        split = lhs_layout[0]
        if instr.attrs.get("batch_group_count", 1) != 1:
            raise _Gather("a batch-grouped convolution (a depthwise weight gradient) over a split dimension")
        if split.dim == dn.input_batch and not rhs_layout:
            out = Split(dn.output_batch, split.axis, instr.shape.dims[dn.output_batch], split.local)
            new = self.clone(instr, [self.local(lhs, (split.slab(),)), self.values[rhs][0]],
                             instr.shape.with_dims(local_dims(instr.shape.dims, (out,))))
            return new, (out,)
        partner = split_of(rhs_layout, dn.kernel_input_feature)
        if (split.dim != dn.input_feature or len(rhs_layout) != 1 or partner is None or not split.same_slabs(partner)
                or instr.attrs.get("feature_group_count", 1) != 1):
            raise _Gather("the convolution's input is split along its batch or feature dimension, and the kernel "
                          "is not split the same way")
        return self.partial_sums(instr, [(lhs, split), (rhs, partner)],
                                 "partial sums of a convolution over split examples (a weight gradient)")

    def partial_sums(self, instr: HloInstruction, operands, why: str):
        """`instr` on each device's slabs of its contracted operands (rows past an uneven end
        zeroed), then an all-reduce that adds the partial results."""
        values = []
        for operand, split in operands:
            value = self.local(operand, (split.slab(),))
            if self.uneven(split):
                value = self.b.mask(value, [split.slab()], self.b.constant(0, operand.shape.dtype))
            values.append(value)
        new = self.clone(instr, values, instr.shape)
        new = self.b.all_reduce(new, [operands[0][1].axis], self.b.reducer("add", instr.shape.dtype))
        self.note("all-reduce", instr, why)
        return new, REPLICATED

    def weight_gradient(self, instr: HloInstruction, contracted: dict):
        """A convolution whose window is split with its input (output = kernel): each device
        convolves its rows, and an all-reduce adds the partial kernels."""
        lhs, rhs = instr.operands
        dn = instr.attrs["dim_labels"]
        window = instr.attrs["window"]
        lhs_layout = self.values[lhs][1]
        if len(contracted) != len(lhs_layout):
            raise _Gather("the input is split along a dimension the kernel is not")
        plans, dims, kernel_layout = {}, list(window.dimensions), []
        for split in lhs_layout:
            index, kernel_split = contracted[split.dim]
            wd = window.dimensions[index]
            if wd.window_reversal:
                raise _Gather("a reversed window dimension is split")
            out_rows = instr.shape.dims[dn.output_spatial[index]]
            plan = None
            if kernel_split.local * wd.window_dilation == split.local * wd.base_dilation:
                plan = plan_window(in_rows=split.local, padding_low=wd.padding_low, base_dilation=wd.base_dilation,
                                   stride=wd.stride, window_dilation=wd.window_dilation, window=kernel_split.local,
                                   out_rows=out_rows)
            if plan is None or max(plan.have_low, plan.have_high) > split.local * (self.mesh.axes[split.axis] - 1):
                # The window rows do not line up with the input slabs: each device reads the
                # rows its window rows meet (the roles of stride and window dilation swap).
                rows = window_row_range(parts=self.mesh.axes[split.axis], out_rows=kernel_split.local,
                                        padding_low=wd.padding_low, stride=wd.window_dilation,
                                        window_dilation=wd.stride, window=out_rows)
                plan = _Unaligned(rows, wd.base_dilation)
            plans[split.dim] = (None, plan)
            dims[index] = dataclasses.replace(_local_window_dimension(wd, plan), size=kernel_split.local)
            kernel_layout.append(kernel_split.slab())
        zero = self.b.constant(0, lhs.shape.dtype)
        value = self.halo_input(lhs, instr, _halos(plans), zero, True)
        kernel_layout = tuple(sorted(kernel_layout, key=lambda s: s.dim))
        kernel = self.local(rhs, kernel_layout)
        kernel = self.b.mask(kernel, [s for s in kernel_layout if self.uneven(s)], self.b.constant(0, rhs.shape.dtype))
        new = self.clone(instr, [value, kernel], instr.shape, window=type(window)(tuple(dims)))
        axes = [s.axis for s in lhs_layout]
        new = self.b.all_reduce(new, axes, self.b.reducer("add", instr.shape.dtype))
        self.note("all-reduce", instr, "partial sums of a convolution over split window rows (a weight gradient)")
        return new, REPLICATED

    def visit_reduce_window(self, instr: HloInstruction):
        if instr.operand_count != 2:
            raise _Gather("a variadic reduce-window is not partitioned")
        data, init = instr.operands
        rank = data.shape.rank
        window = instr.attrs["window"]
        plans = self.window_plans(instr, data, window, {d: d for d in range(rank)}, {d: d for d in range(rank)},
                                  fusable=False)
        init_value = self.whole(init, instr, "the initial value is split")
        zero = init.opcode == "constant" and not np.any(init.literal.to_numpy())
        dims = list(window.dimensions)
        for d, (_, plan) in plans.items():
            dims[d] = _local_window_dimension(dims[d], plan)
        value = self.halo_input(data, instr, _halos(plans), init_value, zero)
        layout = tuple(sorted((out for out, _ in plans.values()), key=lambda s: s.dim))
        new = self.clone(instr, [value, init_value], instr.shape.with_dims(local_dims(instr.shape.dims, layout)),
                         window=type(window)(tuple(dims)))
        return new, layout

    def visit_select_and_scatter(self, instr: HloInstruction):
        operand, source, init = instr.operands
        window = instr.attrs["window"]
        select_root = instr.attrs["select"].root
        direction = select_root.attrs.get("direction") if select_root.opcode == "compare" else None
        if direction not in _MAX_SELECT or reducer_opcode(instr.attrs["scatter"]) != "add":
            raise _Gather("only max/min selection with an adding scatter is partitioned")
        operand_layout = self.values[operand][1]
        source_layout = self.values[source][1]
        if [s.dim for s in operand_layout] != [s.dim for s in source_layout]:
            raise _Gather("the operand and the source are split along different dimensions")
        dims = list(window.dimensions)
        operand_halos, source_halos = {}, {}
        for split, source_split in zip(operand_layout, source_layout):
            wd = window.dimensions[split.dim]
            if source_split.axis != split.axis:
                raise _Gather("the operand and the source are split over different mesh axes")
            plan = plan_select_and_scatter(operand_rows=split.local, source_rows=source_split.local,
                                           window=wd.size, stride=wd.stride, padding_low=wd.padding_low)
            parts = self.mesh.axes[split.axis]
            if (plan is None or max(plan.operand_low, plan.operand_high) > split.local * (parts - 1)
                    or max(plan.source_low, plan.source_high) > source_split.local * (parts - 1)):
                # Windows that do not line up with the slabs: every device fetches the windows
                # touching its rows (GSPMD's windowed-input resharding) and keeps its own rows.
                source_rows, operand_rows = scatter_row_ranges(parts=parts, operand_rows=split.local,
                                                               window=wd.size, stride=wd.stride,
                                                               padding_low=wd.padding_low)
                operand_halos[split.dim], source_halos[split.dim] = _Unaligned(operand_rows), _Unaligned(source_rows)
            else:
                operand_halos[split.dim] = (plan.operand_low, plan.operand_high)
                source_halos[split.dim] = (plan.source_low, plan.source_high)
            dims[split.dim] = dataclasses.replace(wd, padding_low=0, padding_high=0)
        fill = self.b.constant(_MAX_SELECT[direction], operand.shape.dtype)
        operand_value = self.halo_input(operand, instr, operand_halos, fill, False)
        source_value = self.halo_input(source, instr, source_halos, self.b.constant(0, source.shape.dtype), True)
        init_value = self.whole(init, instr, "the initial value is split")
        scattered = self.clone(instr, [operand_value, source_value, init_value], operand_value.shape,
                               window=type(window)(tuple(dims)))
        slabs = tuple(s.slab() for s in operand_layout)
        zero = self.b.constant(0, scattered.shape.dtype)
        for split in slabs:
            halo = operand_halos[split.dim]
            if isinstance(halo, _Unaligned):
                scattered = self.own_rows(scattered, split, halo.rows, zero)
            else:
                scattered = self.b.slice_dim(scattered, split.dim, halo[0], halo[0] + split.local)
        return scattered, slabs

    def own_rows(self, value: HloInstruction, split: Split, rows: RowRange, zero: HloInstruction) -> HloInstruction:
        """The device's slab along `split` out of `value`, which holds global rows
        `rows.starts[c]...` (rows it lacks, which no window touched, are zero)."""
        starts = [c * split.local - start for c, start in enumerate(rows.starts)]
        pad_low = max([0] + [-s for s in starts])
        pad_high = max([0] + [s + split.local - rows.count for s in starts])
        if pad_low or pad_high:
            value = self.b.pad_dim(value, split.dim, pad_low, pad_high, zero)
        start = self.b.coordinate_table([s + pad_low for s in starts], split.axis)
        zero_index = self.b.constant(0)
        sizes = tuple(split.local if d == split.dim else n for d, n in enumerate(value.shape.dims))
        return self.b.add("dynamic-slice", [value, *(start if d == split.dim else zero_index
                                                      for d in range(value.shape.rank))],
                          value.shape.with_dims(sizes), dynamic_slice_sizes=sizes)


def _fold_tuple_lookups(comp) -> None:
    """`get-tuple-element(tuple(a, b), 0)` becomes `a` (TF's single-output steps end in
    `ROOT get-tuple-element(tuple(x))`; the tuple would gather `x`)."""
    for lookup in list(comp.instructions):
        if lookup.opcode == "get-tuple-element" and lookup.operand(0).opcode == "tuple":
            lookup.replace_all_uses_with(lookup.operand(0).operand(lookup.attrs["index"]))
    comp.remove_dead_code()


def _fold_padded_select_and_scatter(comp) -> None:
    """`slice(select-and-scatter(pad(x, -inf), s))` that slices the padding off (how JAX writes
    the gradient of SAME max pooling) becomes `select-and-scatter(x, s)` with the padding in
    its window: padding is never selected, so the results agree, and the window arithmetic
    then sees the real rows (the explicit pad would widen the split dimension)."""
    for sliced in list(comp.instructions):
        scatter = sliced.operand(0) if sliced.opcode == "slice" else None
        if scatter is None or scatter.opcode != "select-and-scatter" or scatter.users != [sliced]:
            continue
        padded = scatter.operand(0)
        root = scatter.attrs["select"].root
        fill = _MAX_SELECT.get(root.attrs.get("direction")) if root.opcode == "compare" else None
        if padded.opcode != "pad" or fill is None or padded.operand(1).opcode != "constant":
            continue
        if padded.operand(1).literal.to_numpy() != fill:
            continue
        config = padded.attrs["padding"].dims
        window = scatter.attrs["window"]
        expected = tuple((lo, lo + n, 1) for (lo, _, _), n in zip(config, padded.operand(0).shape.dims))
        if any(interior for _, _, interior in config) or sliced.attrs["slice"].dims != expected:
            continue
        if any(d.padding_low or d.padding_high for d in window.dimensions):
            continue
        dims = tuple(dataclasses.replace(d, padding_low=lo, padding_high=hi)
                     for d, (lo, hi, _) in zip(window.dimensions, config))
        attrs = {k: v for k, v in scatter.attrs.items() if k != "control-predecessors"}
        attrs["window"] = type(window)(dims)
        folded = comp.add_instruction("select-and-scatter", [padded.operand(0), *scatter.operands[1:]],
                                      sliced.shape, name=scatter.name, attrs=attrs, after=sliced)
        sliced.replace_all_uses_with(folded)
    comp.remove_dead_code()


def _image_source(value: HloInstruction) -> HloInstruction:
    """Where a convolution's input comes from, seen through what keeps its dimensions in
    order: identity reshapes, converts and copies (TF reshapes its arguments), an edge pad
    (Keras's ZeroPadding2D) and elementwise ops whose other operands are broadcasts or
    constants (Keras's Rescaling and Normalization). Only picks which parameter to split."""
    while True:
        if (value.opcode in ("convert", "copy", "reshape", "bitcast")
                and value.operand(0).shape.dims == value.shape.dims):
            value = value.operand(0)
        elif value.opcode == "pad" and not any(interior for _, _, interior in value.attrs["padding"].dims):
            value = value.operand(0)
        elif value.opcode in ELEMENTWISE:
            arrays = [o for o in value.operands if o.opcode not in ("broadcast", "constant")]
            if len(arrays) != 1 or arrays[0].shape.dims != value.shape.dims:
                return value
            value = arrays[0]
        else:
            return value


def _is_zero_scalar(instr: HloInstruction) -> bool:
    """A scalar constant 0 (through converts and copies)."""
    while instr.opcode in ("convert", "copy", "reshape", "bitcast") and not instr.operand(0).shape.dims:
        instr = instr.operand(0)
    return (instr.opcode == "constant" and instr.shape.is_array and not instr.shape.dims
            and instr.literal is not None and not np.any(instr.literal.to_numpy()))


def _zero_pad_refusal(padded: HloInstruction, spatial) -> str | None:
    """Why `padded` (a pad) cannot become window padding of a convolution whose input
    spatial dimensions are `spatial`; None when it can."""
    config = padded.attrs["padding"].dims
    if not _is_zero_scalar(padded.operand(1)):
        return "its padding value is not a constant 0"
    if any(config[d] != (0, 0, 0) for d in range(len(config)) if d not in spatial):
        return "it pads a batch or feature dimension"
    if any(config[d][2] for d in spatial):
        return "it has interior padding"
    return None


def _fold_pads_into_convolutions(comp) -> tuple[list[SpatialReport], dict[str, str]]:
    """`convolution(pad(x, 0), k)` with edge padding of the input's spatial dimensions only
    (Keras's ZeroPadding2D before a VALID convolution) becomes `convolution(x, k)` with that
    padding added to the window's: a window reads zeros there either way (`lo` explicit rows
    sit `lo*lhs_dilate` positions deep in the dilated base; negative padding crops the same
    rows). The explicit pad would widen the split dimension and force an all-gather; window
    padding is what the halo arithmetic handles. Returns report lines and, per pad it could
    not fold, why."""
    notes, refused = [], {}
    for conv in list(comp.instructions):
        if conv.opcode != "convolution" or conv.operand(0).opcode != "pad" or conv.operand(1) is conv.operand(0):
            continue
        padded = conv.operand(0)
        dn = conv.attrs["dim_labels"]
        spatial = dn.input_spatial
        reason = _zero_pad_refusal(padded, spatial)
        if reason is not None:
            refused[padded.name] = reason
            continue
        config = padded.attrs["padding"].dims
        window = conv.attrs["window"]
        dims = list(window.dimensions)
        for index, d in enumerate(spatial):
            lo, hi, _ = config[d]
            wd = dims[index]
            dims[index] = dataclasses.replace(wd, padding_low=wd.padding_low + lo * wd.base_dilation,
                                              padding_high=wd.padding_high + hi * wd.base_dilation)
        attrs = {k: v for k, v in conv.attrs.items() if k != "control-predecessors"}
        attrs["window"] = type(window)(tuple(dims))
        folded = comp.add_instruction("convolution", [padded.operand(0), conv.operand(1)], conv.shape,
                                      name=conv.name, attrs=attrs, after=conv)
        conv.replace_all_uses_with(folded)
        padding = ", ".join(f"{config[d][0]}_{config[d][1]} of dimension {d}"
                            for d in spatial if config[d] != (0, 0, 0))
        notes.append(SpatialReport("fold", padded.name, f"zero padding {padding or 'none'} becomes window padding "
                                   f"of %{folded.name}"))
    comp.remove_dead_code()
    return notes, refused


def _fold_slices_into_convolutions(comp) -> list[SpatialReport]:
    """`slice(convolution(x, k))` cutting only output spatial dimensions, with stride 1 (TF's
    gradient of a pad: the input gradient of the padded input, sliced) becomes one
    convolution whose window padding skips the cut rows: output row `o+a` reads positions
    `(o+a)*stride + j*rd - pad_lo`, so `pad_lo` drops by `a*stride`, and `pad_hi` is what
    makes `b-a` rows. The convolution must have no other user."""
    notes = []
    for sliced in list(comp.instructions):
        conv = sliced.operand(0) if sliced.opcode == "slice" else None
        if conv is None or conv.opcode != "convolution" or conv.users != [sliced] or comp.root is conv:
            continue
        spec = sliced.attrs["slice"].dims
        dn = conv.attrs["dim_labels"]
        spatial = dn.output_spatial
        if any(stride != 1 for _, _, stride in spec):
            continue
        if any(spec[d] != (0, n, 1) for d, n in enumerate(conv.shape.dims) if d not in spatial):
            continue
        if all(spec[d] == (0, conv.shape.dims[d], 1) for d in spatial) or any(a >= b for a, b, _ in spec):
            continue
        window = conv.attrs["window"]
        dims = list(window.dimensions)
        for index, d in enumerate(spatial):
            start, limit, _ = spec[d]
            wd = dims[index]
            span = (wd.size - 1) * wd.window_dilation + 1
            base = (conv.operand(0).shape.dims[dn.input_spatial[index]] - 1) * wd.base_dilation + 1
            low = wd.padding_low - start * wd.stride
            high = (limit - start - 1) * wd.stride + span - low - base
            dims[index] = dataclasses.replace(wd, padding_low=low, padding_high=high)
        attrs = {k: v for k, v in conv.attrs.items() if k != "control-predecessors"}
        attrs["window"] = type(window)(tuple(dims))
        folded = comp.add_instruction("convolution", list(conv.operands), sliced.shape, name=conv.name,
                                      attrs=attrs, after=sliced)
        sliced.replace_all_uses_with(folded)
        cut = ", ".join(f"[{spec[d][0]}:{spec[d][1]}] of dimension {d}" for d in spatial
                        if spec[d] != (0, conv.shape.dims[d], 1))
        notes.append(SpatialReport("fold", sliced.name, f"the slice {cut} becomes window padding of %{folded.name}"))
    comp.remove_dead_code()
    return notes


def _halos(plans: dict) -> dict:
    """dim -> (rows before, rows after) of each (output split, WindowPlan), or its _Unaligned."""
    return {dim: plan if isinstance(plan, _Unaligned) else (plan.have_low, plan.have_high)
            for dim, (_, plan) in plans.items()}


def _local_window_dimension(wd, plan):
    """The window dimension a device runs: shifted padding (aligned), or none over exactly
    the rows it fetched, whose base it dilated itself (unaligned)."""
    if isinstance(plan, _Unaligned):
        return dataclasses.replace(wd, padding_low=0, padding_high=0, base_dilation=1)
    return dataclasses.replace(wd, padding_low=plan.padding_low, padding_high=plan.padding_high)


def _next_convolution(conv: HloInstruction, from_inputs: set) -> HloInstruction | None:
    """The first convolution with a weight kernel (not computed from the split inputs) whose
    input is `conv`'s output, directly or through elementwise ops."""
    frontier, seen = [conv], {conv}
    while frontier:
        value = frontier.pop(0)
        for user in value.users:
            if user in seen:
                continue
            seen.add(user)
            if user.opcode == "convolution" and user.operand(0) is value and user.operand(1) not in from_inputs:
                return user
            if user.opcode in ELEMENTWISE and user.shape.dims == value.shape.dims:
                frontier.append(user)
    return None
