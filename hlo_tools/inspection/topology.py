"""The physical shape of a machine: chips on a ring, a 2-D torus or a 2-D mesh, some of them failed.

``ring:N`` is one row of N chips with a wrap-around link; ``torus:RxC`` is R rows of C chips with
wrap-around links in both dimensions; ``mesh:RxC`` has no wrap-around links. Failed chips are
coordinates ``r:c`` (``ring:N`` chips are ``0:c``); their links are gone. Devices are numbered
over the healthy chips only: device i is the i-th healthy coordinate in row-major order, which is
how the cost model (`hlo-tools cost --failed`) and the fault-tolerant `all-reduce-2d` agree on
what a replica group means physically.

Sizes are checked before anything is built: a spec's numbers are ASCII digits (as in XLA's
flags; Python's ``int`` would take other scripts' digits too), a machine has at most
``MAX_CHIPS`` chips, and ``num_devices`` is counted, not enumerated, so that a caller can
compare it with a module's device count first.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from functools import cached_property

Coordinate = tuple[int, int]

_SPEC = re.compile(r"(ring):([0-9]+)|(torus|mesh):([0-9]+)x([0-9]+)")
_COORDINATE = re.compile(r"([0-9]+):([0-9]+)")

# The most chips a topology may have: more than a TPU pod slice has (v5p: 8960), few enough that
# the cost model and the passes can enumerate them.
MAX_CHIPS = 1 << 14


class TopologyError(ValueError):
    """A topology or failed-chip list that does not describe a machine; the message is one line."""


def parse_coordinates(text: str) -> list[Coordinate]:
    """``r:c`` coordinates separated by commas or semicolons (';' inside pass options)."""
    coordinates = []
    for item in filter(None, (part.strip() for part in re.split(r"[,;]", text or ""))):
        match = _COORDINATE.fullmatch(item)
        if not match:
            raise TopologyError(f"failed chip {item!r} is not ROW:COLUMN, e.g. 1:2")
        coordinates.append((int(match.group(1)), int(match.group(2))))
    return coordinates


@dataclass(frozen=True)
class Topology:
    kind: str  # "ring", "torus" or "mesh"
    rows: int
    columns: int
    failed: frozenset[Coordinate] = frozenset()

    @classmethod
    def parse(cls, spec: str, failed: str | list[Coordinate] = "") -> Topology:
        match = _SPEC.fullmatch(spec.strip())
        if not match:
            raise TopologyError(f"topology {spec!r} is not ring:N, torus:RxC or mesh:RxC")
        if match.group(1):
            kind, rows, columns = "ring", 1, int(match.group(2))
        else:
            kind, rows, columns = match.group(3), int(match.group(4)), int(match.group(5))
        if rows < 1 or columns < 1:
            raise TopologyError(f"topology {spec!r} needs at least one chip in each dimension")
        if rows * columns > MAX_CHIPS:
            raise TopologyError(f"topology {spec!r} has {rows * columns} chips, more than the {MAX_CHIPS} "
                                f"a topology may have")
        holes = parse_coordinates(failed) if isinstance(failed, str) else list(failed)
        for r, c in holes:
            if not (0 <= r < rows and 0 <= c < columns):
                raise TopologyError(f"failed chip {r}:{c} is outside {spec} ({rows}x{columns})")
        if len(set(holes)) >= rows * columns:
            raise TopologyError(f"every chip of {spec} is failed")
        return cls(kind, rows, columns, frozenset(holes))

    def __str__(self) -> str:
        shape = f"{self.columns}" if self.kind == "ring" else f"{self.rows}x{self.columns}"
        return f"{self.kind}:{shape}"

    def describe(self) -> str:
        """The spec plus the failed chips, e.g. ``torus:4x4 failed 1:2``."""
        holes = ",".join(f"{r}:{c}" for r, c in sorted(self.failed))
        return f"{self}{' failed ' + holes if holes else ''}"

    @property
    def wraps(self) -> bool:
        return self.kind in ("ring", "torus")

    @cached_property
    def coordinates(self) -> tuple[Coordinate, ...]:
        """The healthy chips, row-major: device i sits at ``coordinates[i]``."""
        return tuple((r, c) for r in range(self.rows) for c in range(self.columns) if (r, c) not in self.failed)

    @cached_property
    def _device_of(self) -> dict[Coordinate, int]:
        return {coordinate: device for device, coordinate in enumerate(self.coordinates)}

    @property
    def num_devices(self) -> int:
        """The healthy chips, counted without building them (``failed`` lies inside the machine)."""
        return self.rows * self.columns - len(self.failed)

    def coordinate(self, device: int) -> Coordinate:
        return self.coordinates[device]

    def device_at(self, coordinate: Coordinate) -> int | None:
        """The device on a chip, or None for a failed chip."""
        return self._device_of.get(coordinate)

    def neighbour_coordinates(self, coordinate: Coordinate) -> list[Coordinate]:
        """Healthy chips one link away (each once, even where a wrap-around doubles a link)."""
        r, c = coordinate
        found: list[Coordinate] = []
        for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            nr, nc = r + dr, c + dc
            if self.wraps:
                nr, nc = nr % self.rows, nc % self.columns
            elif not (0 <= nr < self.rows and 0 <= nc < self.columns):
                continue
            if (nr, nc) != (r, c) and (nr, nc) not in self.failed and (nr, nc) not in found:
                found.append((nr, nc))
        return found

    def neighbours(self, device: int) -> list[int]:
        return [self._device_of[n] for n in self.neighbour_coordinates(self.coordinate(device))]

    def are_neighbours(self, a: int, b: int) -> bool:
        return b in self.neighbours(a)

    @cached_property
    def links(self) -> frozenset[frozenset[int]]:
        """Undirected links between healthy chips, as pairs of devices."""
        return frozenset(frozenset((a, b)) for a in range(self.num_devices) for b in self.neighbours(a))

    def path(self, source: int, target: int) -> list[int] | None:
        """A shortest route over healthy chips, both ends included; None when cut off."""
        previous: dict[int, int | None] = {source: None}
        queue = deque([source])
        while queue:
            device = queue.popleft()
            if device == target:
                route = [device]
                while previous[route[-1]] is not None:
                    route.append(previous[route[-1]])
                return route[::-1]
            for n in self.neighbours(device):
                if n not in previous:
                    previous[n] = device
                    queue.append(n)
        return None

    def hops(self, source: int, target: int) -> int | None:
        route = self.path(source, target)
        return None if route is None else len(route) - 1
