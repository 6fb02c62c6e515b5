"""How a value of the partitioned program is laid out over the device mesh.

A mesh is a tuple of axis sizes (`(4,)`, or `(2, 2)` for `mesh=2x2`); device ids are the
row-major positions in it, as in `devices=[1,2,2,1]<=[4]`. A value is either replicated
(every device holds all of it) or split along one dimension per mesh axis: device
coordinate c along the axis holds global rows [c*local, (c+1)*local) of that dimension,
plus `low`/`high` ghost rows of its neighbours' slabs (halo fusion). Rows at or past the
global size (an uneven split's last slab) and ghost rows outside the array hold garbage
that the consumers mask or drop.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Split:
    """One split dimension of a value."""

    dim: int
    axis: int
    size: int        # global rows
    local: int       # slab rows per device
    low: int = 0     # ghost rows before the slab
    high: int = 0    # ghost rows after the slab

    @property
    def extent(self) -> int:
        """Rows the device holds: its slab and the ghost rows."""
        return self.local + self.low + self.high

    def slab(self) -> "Split":
        return dataclasses.replace(self, low=0, high=0)

    def with_ghosts(self, low: int, high: int) -> "Split":
        return dataclasses.replace(self, low=low, high=high)

    def moved(self, dim: int) -> "Split":
        return dataclasses.replace(self, dim=dim)

    def same_slabs(self, other: "Split") -> bool:
        return (self.axis, self.size, self.local) == (other.axis, other.size, other.local)


Layout = tuple[Split, ...]   # sorted by dimension; () is replicated
REPLICATED: Layout = ()


def slab_rows(size: int, parts: int) -> int:
    """Rows per device when `size` rows split over `parts` devices (the last slab may be short)."""
    return -(-size // parts)


def local_dims(dims, layout: Layout) -> tuple[int, ...]:
    """A device's dimensions of a global array of `dims` laid out as `layout`."""
    out = list(dims)
    for split in layout:
        out[split.dim] = split.extent
    return tuple(out)


def split_of(layout: Layout, dim: int) -> Split | None:
    return next((s for s in layout if s.dim == dim), None)


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The device mesh: axis sizes, devices numbered row-major."""

    axes: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.axes)

    def stride(self, axis: int) -> int:
        return math.prod(self.axes[axis + 1:])

    def coordinate(self, device: int, axis: int) -> int:
        return device // self.stride(axis) % self.axes[axis]

    def shift_pairs(self, axis: int, hops: int) -> tuple[tuple[int, int], ...]:
        """(source, target) pairs that send each device's data `hops` places along `axis`
        (negative: backwards); devices at the ends receive nothing."""
        pairs = []
        for device in range(self.size):
            target = self.coordinate(device, axis) + hops
            if 0 <= target < self.axes[axis]:
                pairs.append((device, device + hops * self.stride(axis)))
        return tuple(pairs)

    def groups(self, axes) -> list[list[int]]:
        """Devices that differ only in their coordinates along `axes`, in coordinate order."""
        axes = set(axes)
        groups: dict[tuple, list[int]] = {}
        for device in range(self.size):
            key = tuple(self.coordinate(device, a) for a in range(len(self.axes)) if a not in axes)
            groups.setdefault(key, []).append(device)
        return list(groups.values())

    def tile_dims(self, rank: int, layout: Layout) -> tuple[int, ...]:
        """The `devices=[...]` tile shape of an array laid out as `layout` (slabs only)."""
        tiles = [1] * rank
        for split in layout:
            tiles[split.dim] = self.axes[split.axis]
        return tuple(tiles)

    def device_order(self, layout: Layout) -> list[int]:
        """Devices in the row-major order of the tile shape (split dimensions ordered by dim)."""
        axes = [s.axis for s in sorted(layout, key=lambda s: s.dim)]
        rest = [a for a in range(len(self.axes)) if a not in axes]
        order = axes + rest
        devices = []
        for index in range(self.size):
            coords, remainder = {}, index
            for axis in reversed(order):
                coords[axis] = remainder % self.axes[axis]
                remainder //= self.axes[axis]
            devices.append(sum(coords[a] * self.stride(a) for a in range(len(self.axes))))
        return devices
