"""Instructions that address slabs and move them between devices.

Every helper appends to one computation of a per-device program: the device's coordinate
along a mesh axis (from `partition-id`), masks of the rows a slab really holds, halo
exchanges (`collective-permute` from the neighbours, several hops when the halo is wider
than a slab), `all-gather` of a split value and `all-reduce` of partial results.
"""
from __future__ import annotations

import numpy as np

from hlo_tools import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.ir.attributes import PaddingConfig, ReplicaGroups, SliceSpec
from hlo_tools.ir.literal import Literal, numpy_dtype

from ..rewrites.channel_ids import ChannelIds
from .layout import Layout, Mesh, Split


class SlabBuilder:
    """Builds the per-device instructions of one computation over `mesh`."""

    def __init__(self, module: HloModule, comp: HloComputation, mesh: Mesh):
        self.module = module
        self.comp = comp
        self.mesh = mesh
        self.channel_ids = ChannelIds(module)
        self._coordinates: dict[int, HloInstruction] = {}
        self._partition_index: HloInstruction | None = None
        self._reducers: dict[tuple[str, str], HloComputation] = {}
        self.collective_permutes = 0

    def add(self, opcode: str, operands=(), shape: Shape | None = None, **attrs) -> HloInstruction:
        literal = attrs.pop("literal", None)
        name = attrs.pop("name", None)
        return self.comp.add_instruction(opcode, operands, shape, attrs=attrs or None, literal=literal,
                                         name=name)

    def constant(self, value, dtype: str = "s32") -> HloInstruction:
        literal = Literal.from_numpy(np.asarray(value, dtype=numpy_dtype(dtype)))
        return self.add("constant", literal=literal)

    def broadcast(self, scalar: HloInstruction, dims) -> HloInstruction:
        shape = Shape.array(scalar.shape.dtype, tuple(dims))
        return self.add("broadcast", [scalar], shape, dimensions=())

    # -- where a device is ----------------------------------------------------------------------
    def coordinate(self, axis: int) -> HloInstruction:
        """The device's coordinate along `axis`, an s32 scalar."""
        if axis not in self._coordinates:
            value = self.partition_index()
            stride = self.mesh.stride(axis)
            if stride > 1:
                value = self.add("divide", [value, self.constant(stride)])
            if self.mesh.axes[axis] * stride < self.mesh.size:
                value = self.add("remainder", [value, self.constant(self.mesh.axes[axis])])
            self._coordinates[axis] = value
        return self._coordinates[axis]

    def first_row(self, split: Split) -> HloInstruction:
        """The global index of the device's first local row along `split` (ghost rows included)."""
        start = self.add("multiply", [self.coordinate(split.axis), self.constant(split.local)])
        if split.low:
            start = self.add("subtract", [start, self.constant(split.low)])
        return start

    def partition_index(self) -> HloInstruction:
        """The device's partition-id as an s32 scalar."""
        if self._partition_index is None:
            pid = self.add("partition-id", shape=Shape.array("u32", ()))
            self._partition_index = self.add("convert", [pid], Shape.array("s32", ()))
        return self._partition_index

    def partition_table(self, values) -> HloInstruction:
        """An s32 scalar: `values[partition-id]`, read from a constant table (as GSPMD does
        for offsets that are not affine in the device's coordinate)."""
        if len(set(values)) == 1:
            return self.constant(values[0])
        entry = self.add("dynamic-slice", [self.constant(list(values)), self.partition_index()],
                         Shape.array("s32", (1,)), dynamic_slice_sizes=(1,))
        return self.add("reshape", [entry], Shape.array("s32", ()))

    def coordinate_table(self, values, axis: int) -> HloInstruction:
        """An s32 scalar: `values[c]` for the device's coordinate c along `axis`."""
        return self.partition_table([values[self.mesh.coordinate(d, axis)] for d in range(self.mesh.size)])

    def mask(self, value: HloInstruction, splits, pad: HloInstruction) -> HloInstruction:
        """`value` with the rows outside the global array (per split) replaced by scalar `pad`."""
        return self.mask_rows(value, [(s.dim, self.first_row(s), s.size) for s in splits], pad)

    def mask_rows(self, value: HloInstruction, ranges, pad: HloInstruction) -> HloInstruction:
        """`value` with rows outside [0, size) replaced by scalar `pad`, per (dim, global index
        of the first local row (an s32 scalar), size) in `ranges`."""
        dims = value.shape.dims
        valid = None
        for dim, first_row, size in ranges:
            index_shape = Shape.array("s32", dims)
            rows = self.add("iota", [], index_shape, iota_dimension=dim)
            rows = self.add("add", [rows, self.broadcast(first_row, dims)])
            low = self.add("compare", [rows, self.broadcast(self.constant(0), dims)], direction="GE")
            high = self.add("compare", [rows, self.broadcast(self.constant(size), dims)],
                            direction="LT")
            inside = self.add("and", [low, high])
            valid = inside if valid is None else self.add("and", [valid, inside])
        if valid is None:
            return value
        return self.add("select", [valid, value, self.broadcast(pad, dims)], value.shape)

    # -- moving slabs ---------------------------------------------------------------------------------
    def slice_dim(self, value: HloInstruction, dim: int, start: int, stop: int) -> HloInstruction:
        spec = SliceSpec(tuple((start, stop, 1) if d == dim else (0, n, 1)
                               for d, n in enumerate(value.shape.dims)))
        return self.add("slice", [value], slice=spec)

    def pad_dim(self, value: HloInstruction, dim: int, low: int, high: int, pad: HloInstruction,
                interior: int = 0) -> HloInstruction:
        config = PaddingConfig(tuple((low, high, interior) if d == dim else (0, 0, 0)
                                     for d in range(value.shape.rank)))
        return self.add("pad", [value, pad], padding=config)

    def rows(self, value: HloInstruction, split: Split, start: int, stop: int) -> HloInstruction:
        """Rows [start, stop) of a slab (the slab itself when that is all of it)."""
        return value if (start, stop) == (0, split.local) else self.slice_dim(value, split.dim, start, stop)

    def collective_permute(self, value: HloInstruction, pairs) -> HloInstruction:
        self.collective_permutes += 1
        return self.add("collective-permute", [value], value.shape, channel_id=self.channel_ids.fresh(),
                        source_target_pairs=tuple(pairs))

    def exchange(self, value: HloInstruction, split: Split, low: int, high: int) -> HloInstruction:
        """The slab `value` (no ghost rows) with `low` rows of the previous devices' slabs
        before it and `high` rows of the next ones' after it (zeros where there is none)."""
        assert split.low == split.high == 0
        local, pieces = split.local, []
        for hops in range(-(-low // local), 0, -1):
            piece = self.rows(value, split, max(0, hops * local - low), local)
            pieces.append(self.collective_permute(piece, self.mesh.shift_pairs(split.axis, hops)))
        pieces.append(value)
        for hops in range(1, -(-high // local) + 1):
            piece = self.rows(value, split, 0, min(local, high - (hops - 1) * local))
            pieces.append(self.collective_permute(piece, self.mesh.shift_pairs(split.axis, -hops)))
        if len(pieces) == 1:
            return value
        return self.add("concatenate", pieces, dimensions=(split.dim,))

    def all_gather(self, value: HloInstruction, split: Split) -> HloInstruction:
        """The whole array along `split` (a slab without ghost rows) on every device."""
        dims = list(value.shape.dims)
        dims[split.dim] *= self.mesh.axes[split.axis]
        gathered = self.add("all-gather", [value], value.shape.with_dims(dims),
                            channel_id=self.channel_ids.fresh(),
                            replica_groups=ReplicaGroups.of(self.mesh.groups([split.axis])),
                            dimensions=(split.dim,), use_global_device_ids=True)
        if dims[split.dim] != split.size:
            gathered = self.slice_dim(gathered, split.dim, 0, split.size)
        return gathered

    def all_reduce(self, value: HloInstruction, axes, reducer: HloComputation) -> HloInstruction:
        return self.add("all-reduce", [value], value.shape, channel_id=self.channel_ids.fresh(),
                        replica_groups=ReplicaGroups.of(self.mesh.groups(axes)),
                        use_global_device_ids=True, to_apply=reducer)

    def reducer(self, opcode: str, dtype: str) -> HloComputation:
        """A scalar `opcode` computation (`add`: sums of partial results)."""
        key = (opcode, dtype)
        if key not in self._reducers:
            comp = HloComputation(f"{opcode}.{dtype}")
            scalar = Shape.array(dtype, ())
            a = comp.add_instruction("parameter", [], scalar, name="a", parameter_number=0)
            b = comp.add_instruction("parameter", [], scalar, name="b", parameter_number=1)
            comp.set_root(comp.add_instruction(opcode, [a, b], scalar, name=opcode))
            self._reducers[key] = self.module.add_computation(comp)
        return self._reducers[key]

    def dynamic_slab(self, value: HloInstruction, layout: Layout, pad: HloInstruction) -> HloInstruction:
        """Each device's piece (ghost rows included) of a replicated array."""
        for split in layout:
            padded_rows = split.local * self.mesh.axes[split.axis]
            if split.low or split.high or padded_rows != split.size:
                value = self.pad_dim(value, split.dim, split.low, padded_rows - split.size + split.high, pad)
        starts, sizes = [], list(value.shape.dims)
        zero = None
        for dim in range(value.shape.rank):
            split = next((s for s in layout if s.dim == dim), None)
            if split is None:
                zero = zero or self.constant(0)
                starts.append(zero)
            else:
                starts.append(self.add("multiply", [self.coordinate(split.axis), self.constant(split.local)]))
                sizes[dim] = split.extent
        return self.add("dynamic-slice", [value, *starts], value.shape.with_dims(sizes),
                        dynamic_slice_sizes=tuple(sizes))
