"""Shardy's sharding attributes, as XLA keeps them in an HLO module's frontend attributes
(`xla.sdy.meshes`, `xla.sdy.sharding`, `xla.sdy.in_shardings`, `xla.sdy.out_shardings`): one
reader for every pass, so that they all read a sharding the same way.

    meshes('{mesh = #sdy.mesh<["data"=2, "model"=4]>}')
        -> {"mesh": Mesh(axes=["data", "model"], sizes=[2, 4], coordinates={0: (0, 0), ...})}
    values('#sdy.sharding_per_value<[<@mesh, [{"data"}, {}]>]>')   -> [Value("mesh", '{"data"}, {}', '')]
    dims('{"data"}, {}')   -> [["data"], []]
    dims('{"x":(1)2}, {}') -> None   (a sub-axis, an open dimension or a priority: not a plain split)
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from hlo_tools.ir.attributes import Sharding

_MESH = re.compile(r'(\w+)\s*=\s*#sdy\.mesh<\[([^\]]*)\](?:\s*,\s*device_ids=\[([\d,\s]*)\])?>')
_AXIS = re.compile(r'"(\w+)"\s*=\s*(\d+)')
_VALUE = re.compile(r'<@(\w+)\s*,\s*\[([^\]]*)\]([^>]*)>')


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A named mesh: its axes (major to minor), their sizes, and each device's coordinates."""

    axes: list[str]
    sizes: list[int]
    coordinates: dict[int, tuple[int, ...]]

    def hlo_sharding(self, per_dim: list[list[str]]) -> Sharding:
        """The HloSharding of the split `per_dim` (each dimension's axes, major first) on this
        mesh: a tile per dimension, the axes no dimension names replicated in a last tile dimension."""
        size = dict(zip(self.axes, self.sizes))
        tiles = [math.prod(size[a] for a in axes) for axes in per_dim]
        rest = [a for a in self.axes if not any(a in axes for axes in per_dim)]
        copies = math.prod(size[a] for a in rest)
        if math.prod(tiles) == 1:
            return Sharding.replicated()
        shape = tiles + ([copies] if copies > 1 else [])
        table = np.zeros(shape, np.int64)
        for device, coordinates in self.coordinates.items():
            position = dict(zip(self.axes, coordinates))
            along = [*per_dim, rest] if copies > 1 else per_dim
            table[tuple(_index_along(axes, position, size) for axes in along)] = device
        return Sharding.tiled(shape, table.ravel().tolist(), last_tile_dim_replicate=copies > 1)


def _index_along(axes: list[str], position: dict[str, int], size: dict[str, int]) -> int:
    """A device's index among the tiles that `axes` (major to minor) make."""
    return int(np.ravel_multi_index([position[a] for a in axes], [size[a] for a in axes])) if axes else 0


@dataclasses.dataclass(frozen=True)
class Value:
    """One `<@mesh, [dimensions]rest>` entry of a sharding attribute, and where it is in the text."""

    mesh: str
    dims_text: str     # the per-dimension axes, as written: '{"data"}, {}'
    rest: str          # what follows the dimensions: replicated or unreduced axes
    start: int
    end: int


def meshes(text: str) -> dict[str, Mesh]:
    """The meshes of an `xla.sdy.meshes` attribute, by name."""
    found = {}
    for name, axes_text, device_ids in _MESH.findall(text or ""):
        axes = [(axis, int(size)) for axis, size in _AXIS.findall(axes_text)]
        sizes = [size for _, size in axes]
        count = int(np.prod(sizes)) if sizes else 1
        ids = [int(x) for x in device_ids.split(",")] if device_ids.strip() else list(range(count))
        coordinates = {device: tuple(int(c) for c in np.unravel_index(position, sizes)) if sizes else ()
                       for position, device in enumerate(ids)}
        found[name] = Mesh([axis for axis, _ in axes], sizes, coordinates)
    return found


def values(text: str) -> list[Value]:
    """The entries of a sharding attribute (`#sdy.sharding<...>` has one, `sharding_per_value` one
    per value), in order."""
    return [Value(m.group(1), m.group(2), m.group(3), m.start(), m.end()) for m in _VALUE.finditer(text or "")]


def dims(dims_text: str) -> list[list[str]] | None:
    """Each dimension's mesh axes, major first: `{"model"}, {}` -> [["model"], []]; None for what is
    no plain split of whole axes (open dimensions `?`, sub-axes `"x":(1)2`, priorities `p1`)."""
    found = []
    for axes_text, suffix in re.findall(r"\{([^}]*)\}([^,{]*)", dims_text):
        if suffix.strip() or not re.fullmatch(r'\s*("\w+"\s*(,\s*"\w+"\s*)*)?', axes_text):
            return None
        found.append(re.findall(r'"(\w+)"', axes_text))
    return found


def dims_text(per_dim: list[list[str]]) -> str:
    """The inverse of `dims`: [["model"], []] -> `{"model"}, {}`."""
    return ", ".join("{" + ", ".join(f'"{axis}"' for axis in axes) + "}" for axes in per_dim)


def replace_value(text: str, index: int, per_dim: list[list[str]]) -> str:
    """`text` with entry `index` split as `per_dim` (its mesh and what follows the dimensions kept)."""
    value = values(text)[index]
    return text[:value.start] + f"<@{value.mesh}, [{dims_text(per_dim)}]{value.rest}>" + text[value.end:]
