"""The physical form of `all-reduce-2d`: an all-reduce over the healthy chips of a 2-D mesh or
torus with failed chips, sent only between physical neighbours.

When chips of a TPU pod's 2-D mesh fail, the rows and columns of the logical 2-D algorithm
have holes, and a collective over a group that is not a full row or column would be routed by
the interconnect over chips it does not own. Here the gradient sum runs on a spanning tree of
the healthy chips instead, every edge of which is one physical link, so it detours around any
set of holes that leaves the healthy chips connected (`hlo_tools.inspection.topology`: device i is the
i-th healthy chip in row-major order).

The tree. The root is a centre of the healthy chips (the smallest distance to the farthest
one; the smallest device id among equals); every other chip's parent is a neighbour one hop
closer to the root (the one with the fewest children so far, then the smallest id), so the
tree's depth D is the radius of the healthy chips and no chip has more than 4 children.

The schedule: a pipelined reduce-then-broadcast. The flat buffer (tuples flattened, as in
`all-reduce-decomposer`) is cut into K = min(N, elements) chunks of ceil(L/K) elements, N the
number of healthy chips. In round t (t = 0 .. K + 2D - 2):
  * up: a chip at depth d sends chunk t - D + d, the reduction of it over its subtree, to its
    parent, which reduces it into its own copy (the deepest chips start at round 0, so chunk k
    is complete at the root after round k + D - 1);
  * down: the root sends finished chunk t - D, a chip at depth d finished chunk t - D - d, to
    each child, which keeps it (so chunk k is everywhere after round k + 2D - 1).
Only pairs whose chunk index lies in [0, K) are in a round's permutes. Each round is at most
2B `collective-permute`s, B the largest number of children of a chip (a chip receives at most
one value per permute, so a parent's children are numbered and child j's edge goes in permute
j); every tree link carries at most one chunk each way per round.

Cost: K + 2D - 1 rounds, each moving ceil(L/K) elements over every busy tree link in each
direction; over the whole all-reduce every tree link carries the K chunks (the padded buffer,
~L) once each way. A ring all-reduce over the same chips takes 2(N-1) steps of L/N (~2L per
link) and needs a Hamiltonian cycle, which a 4x4 mesh with one failed chip does not have (it is
bipartite with 15 chips). With K = N:

    machine                      N   D  rounds  permutes  ring steps
    4x4 mesh or torus           16   4    23      136        30
    4x4 mesh, failed 1:2        15   4    22       98        28
    4x4 mesh, failed 0:0        15   3    20      126        28
    4x4 torus, failed 1:2       15   3    20      126        28
    4x4 mesh, failed 1:2;3:0    14   4    21       92        26
    4x4 mesh, failed 1:1;2:2    14   6    25       70        26
    16x16 torus                256  16   287     2092       510

(The logical form on a full 4x4 takes 12 steps, 3 + 3 of L/4 and 6 of L/16: fewer, larger
steps, ~1.9L per link against the tree's 23 * L/16 ~ 1.4L.)

One program serves every device. A device at depth d keeps its partial sums in "slots"
rotated by d (slot i holds chunk i - D + d) and its finished chunks rotated the other way
(slot i holds chunk i - D - d), so whatever its depth, a device sends slot t in round t and
receives into slot t + 1: the rotation is one dynamic-slice at the start (the depth read from
a constant table indexed by replica-id or partition-id) and one at the end. A device that no
pair of a permute targets receives zeros, so selects (masks from the same tables) decide
whether a received chunk is reduced in or kept; a slot outside [0, K) carries no chunk and is
never read. `torus=1x3` (device 0 is the root, 1 and 2 its children, D = 1; an f32[3]
all-reduce is K = 3 chunks of 1 element, 4 rounds)::

    ar = f32[3] all-reduce(p), replica_groups={}, to_apply=add
  =>
    ar.pad = f32[5]{0} pad(p, ar.zero), padding=1_1
    ar.device = s32[] convert(ar.replica-id)
    ar.depth.table = s32[3]{0} constant({0, 1, 1})
    ar.depth = s32[] reshape(dynamic-slice(ar.depth.table, ar.device))
    ar.window = f32[4]{0} dynamic-slice(ar.pad, ar.offset)         # offset = depth * chunk size
    ar.slot0 = f32[1]{0} slice(ar.window), slice={[0:1]}
    ar.t0.up0 = f32[1]{0} collective-permute(ar.slot0), source_target_pairs={{1,0}}
    ar.t0.up1 = f32[1]{0} collective-permute(ar.slot0), source_target_pairs={{2,0}}
    ar.t0.up0.add = f32[1]{0} add(ar.slot1, ar.t0.up0)
    ar.t0.slot1 = f32[1]{0} select(ar.has-child0.chunk, ar.t0.up0.add, ar.slot1)
    ...
    ar.t1.down0 = f32[1]{0} collective-permute(ar.t0.slot1.1), source_target_pairs={{0,1}}
    ar.t1.down1 = f32[1]{0} collective-permute(ar.t0.slot1.1), source_target_pairs={{0,2}}
    ar.t1.finished2 = f32[1]{0} select(ar.is-child1.chunk, ar.t1.down1, ar.t1.down0)
    ...
    ROOT ar.reduced = f32[3]{0} select(ar.is-root.result, ar.root-result, ar.device-result)

Addressing (`xla_passes.analysis.topology_fit.permute_space`): in a replica program (no
channel_id), or a channel all-reduce of a module with one partition, the permutes have no
channel_id and pair replica ids, as XLA's cross-replica collective-permute does; otherwise
they get fresh channel ids and pair partition ids (XLA's cross-partition collective-permute),
which are the all-reduce's global device ids only when there is one replica.

Numerics: the reducer is applied along the tree instead of in XLA's order, so integer results
and min/max are exact, and float sums and products differ by reassociation only (the tests'
bound for f32: 1e-5 + 1e-5 * |expected|; bit-exact on integer-valued inputs).
"""
from __future__ import annotations

import dataclasses
from collections import deque

from hlo_tools import HloInstruction, Literal, Shape
from hlo_tools.inspection.topology import Topology

from ..analysis.collectives import flat_vector
from .all_reduce import AllReduceReplacementBuilder
from .channel_ids import ChannelIds

Pairs = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ReductionTree:
    """A breadth-first spanning tree of the healthy chips whose edges are physical links."""

    root: int
    parent: tuple[int | None, ...]  # per device; None for the root
    depth: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(topology: Topology) -> ReductionTree:
        """The tree rooted at a centre of the healthy chips (ValueError when they are cut apart)."""
        distances = [_distances(topology, device) for device in range(topology.num_devices)]
        parts = {tuple(d is not None for d in row) for row in distances}
        if len(parts) > 1:
            counts = sorted((sum(part) for part in parts), reverse=True)
            sizes = f"{', '.join(map(str, counts[:-1]))} and {counts[-1]}"
            stranded = distances[0].index(None)
            raise ValueError(f"the failed chips cut the healthy chips of {topology.describe()} into {len(parts)} parts "
                             f"({sizes} chips): no route from {_chip(topology, 0)} to {_chip(topology, stranded)}")
        root = min(range(topology.num_devices), key=lambda device: (max(distances[device]), device))
        depth = tuple(distances[root])
        parent: list[int | None] = [None] * topology.num_devices
        children: list[list[int]] = [[] for _ in range(topology.num_devices)]
        for device in sorted(range(topology.num_devices), key=lambda d: (depth[d], d)):
            if device == root:
                continue
            closer = [n for n in topology.neighbours(device) if depth[n] == depth[device] - 1]
            chosen = min(closer, key=lambda n: (len(children[n]), n))
            parent[device] = chosen
            children[chosen].append(device)
        return ReductionTree(root, tuple(parent), depth, tuple(tuple(sorted(c)) for c in children))

    @property
    def height(self) -> int:
        return max(self.depth)

    @property
    def branching(self) -> int:
        """The most children of any chip: how many permutes a round needs in each direction."""
        return max(len(c) for c in self.children)

    def child_number(self, device: int) -> int:
        """The device's position among its parent's children (-1 for the root)."""
        up = self.parent[device]
        return -1 if up is None else self.children[up].index(device)


def _chip(topology: Topology, device: int) -> str:
    return "{}:{}".format(*topology.coordinate(device))


def _distances(topology: Topology, source: int) -> list[int | None]:
    """Hops from `source` to every device over healthy links (None where cut off)."""
    distance: list[int | None] = [None] * topology.num_devices
    distance[source] = 0
    queue = deque([source])
    while queue:
        device = queue.popleft()
        for n in topology.neighbours(device):
            if distance[n] is None:
                distance[n] = distance[device] + 1
                queue.append(n)
    return distance


@dataclasses.dataclass(frozen=True)
class TreeSchedule:
    """Which chunk crosses which tree edge in which round (the module docstring's schedule)."""

    tree: ReductionTree
    chunks: int

    @property
    def rounds(self) -> int:
        return self.chunks + 2 * self.tree.height - 1

    def _carries(self, chunk: int) -> bool:
        return 0 <= chunk < self.chunks

    def up_pairs(self, round_: int, child: int) -> Pairs:
        """(child, parent) pairs of the `child`-th children that send their partial chunk in `round_`."""
        tree, height = self.tree, self.tree.height
        return tuple((device, tree.parent[device]) for device in range(len(tree.depth))
                     if tree.child_number(device) == child and self._carries(round_ - height + tree.depth[device]))

    def down_pairs(self, round_: int, child: int) -> Pairs:
        """(parent, its `child`-th child) pairs that pass a finished chunk down in `round_`."""
        tree, height = self.tree, self.tree.height
        return tuple((device, kids[child]) for device, kids in enumerate(tree.children)
                     if len(kids) > child and self._carries(round_ - height - tree.depth[device]))

    def permutes(self) -> list[tuple[int, str, int, Pairs]]:
        """Every collective-permute in program order: (round, "up" or "down", child number, pairs)."""
        found = []
        for round_ in range(self.rounds):
            for direction, pairs_of in (("up", self.up_pairs), ("down", self.down_pairs)):
                for child in range(self.tree.branching):
                    pairs = pairs_of(round_, child)
                    if pairs:
                        found.append((round_, direction, child, pairs))
        return found


class TreeAllReduceBuilder(AllReduceReplacementBuilder):
    """Builds the tree form of one all-reduce next to it and puts it in the all-reduce's place
    (permutes over replica ids with `by_replica`, over partition ids without; unset: replica
    ids for a cross-replica all-reduce, else partition ids)."""

    def __init__(self, all_reduce: HloInstruction, tree: ReductionTree, channel_ids: ChannelIds, *,
                 by_replica: bool | None = None):
        super().__init__(all_reduce, channel_ids, by_replica=by_replica)
        self.tree = tree

    def replace(self) -> TreeSchedule:
        """Replace the all-reduce; return the schedule it now runs."""
        tree = self.tree
        dtype = self.all_reduce.operand(0).shape.dtype
        buffer = self.flat_buffer()
        size = buffer.shape.dims[0]
        schedule = TreeSchedule(tree, min(len(tree.depth), size))
        chunks, height, rounds = schedule.chunks, tree.height, schedule.rounds
        chunk = -(-size // chunks)

        # Slot i of the partial sums of a device at depth d is chunk i - D + d: a window of T slots
        # into the buffer with D chunks of padding before it and 2D - 1 (plus the rounding) after.
        padded = self.pad(buffer, height * chunk, (rounds - chunks) * chunk + chunks * chunk - size)
        device = self.device_id()
        depth = self.lookup(device, tree.depth, "depth")
        chunk_size = self.s32(chunk, "chunk-size")
        window = self.add("dynamic-slice", [padded, self.add("multiply", [depth, chunk_size], role="offset")],
                          flat_vector(dtype, rounds * chunk), role="window", dynamic_slice_sizes=(rounds * chunk,))
        partial: dict[int, HloInstruction] = {}

        def slot(i: int) -> HloInstruction:
            if i not in partial:
                partial[i] = self.slice(window, i * chunk, chunk, f"slot{i}")
            return partial[i]

        is_root = self.add("compare", [depth, self.s32(0, "zero-depth")], Shape.array("pred", ()),
                           role="is-root", direction="EQ")
        root_chunk = self.broadcast(is_root, chunk, "is-root.chunk")
        children = self.lookup(device, [len(kids) for kids in tree.children], "children")
        number = self.lookup(device, [tree.child_number(d) for d in range(len(tree.depth))], "child-number")
        has_child = [self.broadcast(self.compare(children, j, "GT", f"has-child{j}"), chunk, f"has-child{j}.chunk")
                     for j in range(tree.branching)]
        is_child = [self.broadcast(self.compare(number, j, "EQ", f"is-child{j}"), chunk, f"is-child{j}.chunk")
                    for j in range(tree.branching)]

        finished: dict[int, HloInstruction] = {}  # slot i of a non-root device: finished chunk i - D - d
        for t in range(rounds):
            up = [(j, pairs) for j in range(tree.branching) if (pairs := schedule.up_pairs(t, j))]
            down = [(j, pairs) for j in range(tree.branching) if (pairs := schedule.down_pairs(t, j))]
            # The root sends its partial slot (its chunks are finished there), the others their
            # finished slot; when nothing reached slot t yet, only the root sends this round.
            sent_down = slot(t)
            if down and t in finished:
                sent_down = self.add("select", [root_chunk, slot(t), finished[t]], role=f"t{t}.send-down")
            received_up = [(j, self.permute(slot(t), pairs, f"t{t}.up{j}")) for j, pairs in up]
            received_down = [(j, self.permute(sent_down, pairs, f"t{t}.down{j}")) for j, pairs in down]
            for j, value in received_up:
                before = slot(t + 1)
                reduced = self.add(self.reducer, [before, value], role=f"t{t}.up{j}.{self.reducer}")
                partial[t + 1] = self.add("select", [has_child[j], reduced, before], role=f"t{t}.slot{t + 1}")
            for j, value in received_down:
                finished[t + 1] = value if t + 1 not in finished else self.add(
                    "select", [is_child[j], value, finished[t + 1]], role=f"t{t}.finished{t + 1}")

        # The root's chunk k is partial slot k + D; a depth-d device's is finished slot k + D + d.
        root_result = self.concatenate([slot(i) for i in range(height, height + chunks)], "root-result")
        later = self.concatenate([finished[i] for i in range(height + 1, rounds + 1)], "finished")
        start = self.add("multiply", [self.add("subtract", [depth, self.s32(1, "one")], role="depth-1"), chunk_size],
                         role="finished-offset")
        others = self.add("dynamic-slice", [later, start], root_result.shape, role="device-result",
                          dynamic_slice_sizes=root_result.shape.dims)
        reduced = self.add("select", [self.broadcast(is_root, chunks * chunk, "is-root.result"), root_result, others],
                           role="reduced")

        self.put_in_place(reduced)
        return schedule

    def s32(self, value: int, role: str) -> HloInstruction:
        shape = Shape.array("s32", ())
        return self.add("constant", (), shape, role=role, literal=Literal.parse(shape, str(value)))

    def compare(self, value: HloInstruction, constant: int, direction: str, role: str) -> HloInstruction:
        return self.add("compare", [value, self.s32(constant, f"{role}.bound")], Shape.array("pred", ()),
                        role=role, direction=direction)

    def broadcast(self, scalar: HloInstruction, size: int, role: str) -> HloInstruction:
        return self.add("broadcast", [scalar], flat_vector(scalar.shape.dtype, size), role=role, dimensions=())
