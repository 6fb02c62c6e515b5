"""`all-reduce-rings{rings=k,topology=T}`: an all-reduce as k concurrent rings over disjoint links.

A ring all-reduce over N devices sends 2(N-1)/N of the buffer over one outgoing link of every
chip and leaves the others idle. PowerAI DDL (arXiv 1708.02188) cuts the buffer in k parts and
reduces each on its own ring, the rings running at once over links no other ring uses, so a
chip with k usable links moves k times as much per step. Here each ring is a Hamiltonian cycle
of the machine's chips (`hlo_tools.inspection.topology`: device i is the i-th chip row-major) along which
consecutive devices are physical neighbours, and no directed link belongs to two rings:

  * `ring:N`: the ring itself and its reverse (k <= 2; a 2-chip ring has one link, k = 1);
  * `torus:RxC`: the diagonal decomposition: with g = gcd(R, C), a chip whose anti-diagonal
    (r + c) mod g is in a set T steps down, every other chip steps right. Where T and its
    complement both give one cycle through all chips (every square torus, 4x8, 6x4, ...),
    the two cycles and their reverses use every directed link once (k <= 4; on a 2-row torus,
    whose up and down links are one, k <= 2). Where no T does (gcd 1, as in 3x4), the mesh
    snake below and its reverse (k <= 2). The row-major and column-major snakes cannot give
    four: they use no wrap-around link, and chip 0:0 has two other links;
  * `mesh:RxC` (R*C even, R, C >= 2): the snake that goes right along row 0, back and forth
    over columns 1..C-1 in the rows below, and up column 0 (column-major when R is odd), and
    its reverse (k <= 2: a corner chip has two links).
Every ring is checked when the pass is built: all devices once, each hop between neighbours,
no directed link used twice; a `rings=k` the topology cannot give is an error saying how many
it gives.

With N devices and k rings, the operand is flattened, zero-padded to a multiple of k*N and cut
in k parts of N chunks. Ring j reduces part j with the standard ring algorithm: in step s of
the reduce-scatter phase (s = 0..N-2) the device at ring position p sends chunk (p - s) mod N
to its successor, which adds it to its own copy; after N-1 steps position p holds the full
reduction of chunk (p + 1) mod N, and N-1 all-gather steps pass the finished chunks on. Every
step is one `collective-permute` per ring carrying one chunk (1/(kN) of the padded buffer);
the k rings' permutes of a step do not depend on each other, so XLA can run them at once.

One program serves every device: each device first rotates its part by its ring position
(looked up in a constant table indexed by its replica-id or partition-id), so that the chunk it
sends or adds in a step has the same index on every device; at the end it rotates back. For
`ring:4`, k = 1 (positions are device ids; chunk c of f32[8] is 2 elements)::

    ar = f32[8] all-reduce(p), replica_groups={}, to_apply=add
  =>
    ar.device = s32[] convert(replica-id())
    ar.ring0.rotated = f32[8] dynamic-slice(concatenate(p, p), table[ar.device])   # chunks p, p+1, ...
    ar.ring0.chunk.k = f32[2] slice(ar.ring0.rotated), slice={[2k:2k+2]}
    ar.ring0.rs0 = f32[2] collective-permute(ar.ring0.chunk), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
    ar.ring0.rs0.sum = f32[2] add(ar.ring0.chunk.3, ar.ring0.rs0)
    ...                                  # 3 reduce-scatter steps, then 3 all-gather steps
    ar.ring0.result = f32[8] dynamic-slice(concatenate(chunks, chunks), other_table[ar.device])

Addressing: XLA's collective-permute without a channel_id pairs replica ids (each partition
permutes among its replicas), with one it pairs partition ids (each replica among its
partitions). A cross-replica all-reduce (no channel_id) becomes permutes without a channel_id
over replica-id; one with a channel_id names global device ids, replica * partitions +
partition, so it becomes permutes with fresh channel ids over partition-id when the module has
one replica (one that states no replica count has one, as every JAX program does), or without
a channel_id over replica-id when it states one partition; with several of both it is left
alone.

Rewritten: synchronous all-reduces (as `all-reduce-decomposer` takes them) of at least
`min_bytes` whose reducer is one elementwise add, multiply, maximum, minimum, and, or or xor
(not a sum or product of pred) and whose participants are one group of exactly the topology's
devices (`{}` where the header gives the count): `xla_passes.analysis.topology_fit`, which the
tree of `all-reduce-2d{failed=...}` shares. Anything else is left unchanged, or with
`strict=true` is an error naming the all-reduce and why. Numerics: integer results are exact;
float sums are added in ring order instead of XLA's, so they differ by reassociation only
(bit-exact on integer-valued inputs).
"""
from __future__ import annotations

from math import gcd

from hlo_tools import HloInstruction, HloModule
from hlo_tools.inspection.topology import Coordinate, Topology

from ..analysis.replica_groups import DeviceCounts
from ..analysis.topology_fit import REPLICAS, all_reduce_misfit, permute_space
from ..core import HloPass, register_pass
from ..rewrites.all_reduce import AllReduceReplacementBuilder, decomposable_all_reduces
from ..rewrites.channel_ids import ChannelIds

# Devices in ring order: ring[i] sends to ring[(i + 1) % len(ring)].
Ring = tuple[int, ...]

# -- rings over disjoint links ---------------------------------------------------------------------------

def ring_pairs(ring: Ring) -> tuple[tuple[int, int], ...]:
    """(sender, receiver) of each hop along `ring`, in ring order: a permute's source_target_pairs."""
    return tuple((ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring)))


def directed_links(ring: Ring) -> set[tuple[int, int]]:
    """The (sender, receiver) links a ring sends over."""
    return set(ring_pairs(ring))


def ring_problem(topology: Topology, ring: Ring) -> str:
    """Why `ring` is not a Hamiltonian cycle of `topology`'s neighbour links ("" when it is)."""
    if sorted(ring) != list(range(topology.num_devices)):
        return f"ring {list(ring)} does not visit each of the {topology.num_devices} devices once"
    for sender, receiver in sorted(directed_links(ring)):
        if not topology.are_neighbours(sender, receiver):
            return f"devices {sender} and {receiver} of ring {list(ring)} are not neighbours in {topology}"
    return ""


def diagonal_cycle(topology: Topology, south_classes: frozenset[int]) -> Ring | None:
    """The walk on a torus in which a chip whose anti-diagonal (r + c) mod gcd(R, C) is in
    `south_classes` steps down and any other steps right; None unless it is one cycle of all chips.

    Both steps go to the next anti-diagonal, so the two chips stepping into a chip are on one
    anti-diagonal and exactly one of them does: the walk is a permutation, and the chips taking
    the other step make a permutation too (the two together use every link once)."""
    rows, columns = topology.rows, topology.columns
    classes = gcd(rows, columns)
    walk, (r, c) = [], (0, 0)
    for _ in range(topology.num_devices):
        walk.append(topology.device_at((r, c)))
        r, c = ((r + 1) % rows, c) if (r + c) % classes in south_classes else (r, (c + 1) % columns)
    return tuple(walk) if (r, c) == (0, 0) and len(set(walk)) == len(walk) else None


def snake_cycle(rows: int, columns: int, transpose: bool) -> list[Coordinate] | None:
    """The mesh's Hamiltonian cycle for an even number of rows (columns with `transpose`): right
    along row 0, back and forth over columns 1..C-1 in the rows below, up column 0. None when
    that count is odd or a side is shorter than 2."""
    if transpose:
        cycle = snake_cycle(columns, rows, transpose=False)
        return None if cycle is None else [(r, c) for c, r in cycle]
    if rows % 2 or rows < 2 or columns < 2:
        return None
    cycle = [(0, c) for c in range(columns)]
    for r in range(1, rows):
        cycle += [(r, c) for c in (range(columns - 1, 0, -1) if r % 2 else range(1, columns))]
    return cycle + [(r, 0) for r in range(rows - 1, 0, -1)]


def candidate_cycles(topology: Topology) -> list[Ring]:
    """Hamiltonian cycles of `topology` to draw rings from (each also runs reversed), those that
    can share the links best first; unchecked."""
    found: list[Ring] = []
    if topology.num_devices == 2:
        found.append((0, 1))
    if topology.wraps:
        classes = gcd(topology.rows, topology.columns)
        for south in range(classes + 1):
            for chosen in (frozenset(range(south)), frozenset(range(south, classes))):
                cycle = diagonal_cycle(topology, chosen)
                if cycle is not None:
                    found.append(cycle)
    for transpose in (False, True):
        cycle = snake_cycle(topology.rows, topology.columns, transpose)
        if cycle is not None:
            found.append(tuple(topology.device_at(coordinate) for coordinate in cycle))
    return found


def disjoint_rings(topology: Topology, count: int) -> list[Ring]:
    """`count` rings of `topology` that share no directed link, each checked (`ring_problem`);
    ValueError saying how many it gives when it gives fewer."""
    if topology.failed:
        raise ValueError(f"{topology.describe()}: rings around failed chips are not constructed")
    if topology.num_devices < 2:
        raise ValueError(f"{topology} has one chip: there is no ring to reduce over")
    chosen: list[Ring] = []
    used: set[tuple[int, int]] = set()
    for cycle in candidate_cycles(topology):
        for ring in (cycle, (cycle[0],) + cycle[:0:-1]):  # forwards, then backwards from the same device
            problem = ring_problem(topology, ring)
            if problem:
                raise AssertionError(problem)  # a construction above is wrong
            links = directed_links(ring)
            if len(chosen) < count and not links & used:
                chosen.append(ring)
                used |= links
    if len(chosen) < count:
        fewest_links = min(len(topology.neighbours(device)) for device in range(topology.num_devices))
        if not chosen:
            why = ("a mesh with an odd number of chips has no Hamiltonian cycle"
                   if topology.kind == "mesh" and topology.num_devices % 2 else "no Hamiltonian cycle is constructed")
        elif fewest_links < count:
            why = f"every ring leaves each chip by a link of its own, and a chip has {fewest_links}"
        else:
            why = "the diagonal and snake constructions give no more here"
        rings = f"{len(chosen)} ring{'' if len(chosen) == 1 else 's'}"
        raise ValueError(f"{topology} gives {rings} over disjoint links, not rings={count} ({why})")
    return chosen


# -- the pass ------------------------------------------------------------------------------------------

@register_pass
class AllReduceRings(HloPass):
    """Rewrite all-reduce as k ring all-reduces over disjoint links (collective-permute steps)."""

    name = "all-reduce-rings"
    opcodes = {"all-reduce"}
    rings: int = 2
    topology: str = ""
    min_bytes: int = 0
    strict: bool = False

    def __post_init__(self):
        # A topology that cannot carry the rings fails when the pass is built, not when it runs.
        if not self.topology:
            raise ValueError("topology is required: ring:N, torus:RxC or mesh:RxC")
        if self.rings < 1:
            raise ValueError("rings must be at least 1")
        self._machine = Topology.parse(self.topology)
        self._rings = disjoint_rings(self._machine, self.rings)

    def run(self, module: HloModule) -> bool:
        counts = DeviceCounts.of(module)
        channel_ids = ChannelIds(module)
        changed = False
        for all_reduce in decomposable_all_reduces(module, self.min_bytes):
            problem = all_reduce_misfit(all_reduce, self._machine, counts)
            if problem:
                if self.strict:
                    raise self.fail(problem, all_reduce)
                continue
            RingBuilder(all_reduce, self._rings, permute_space(all_reduce, counts), channel_ids).replace()
            changed = True
        return changed


class RingBuilder(AllReduceReplacementBuilder):
    """Builds the ring form of one all-reduce next to it and puts it in the all-reduce's place."""

    def __init__(self, all_reduce: HloInstruction, rings: list[Ring], space: str, channel_ids: ChannelIds):
        super().__init__(all_reduce, channel_ids, by_replica=space == REPLICAS)
        self.rings = rings

    def replace(self) -> None:
        """Put the rings in the all-reduce's place."""
        devices, ring_count = len(self.rings[0]), len(self.rings)
        buffer = self.flat_buffer()
        size = buffer.shape.dims[0]
        padded_size = -(-size // (ring_count * devices)) * ring_count * devices
        if padded_size != size:
            buffer = self.pad(buffer, 0, padded_size - size)
        part_size = padded_size // ring_count
        chunk_size = part_size // devices
        device = self.device_id()

        chunks = []  # per ring: its part's chunks in the device's rotated order
        for j, ring in enumerate(self.rings):
            part = buffer if ring_count == 1 else self.slice(buffer, j * part_size, part_size, f"ring{j}.part")
            position = {d: p for p, d in enumerate(ring)}
            rotated = self.rotate(part, device, [position[d] * chunk_size for d in range(devices)],
                                  f"ring{j}.rotated")
            chunks.append([self.slice(rotated, i * chunk_size, chunk_size, f"ring{j}.chunk") for i in range(devices)])
        # Rotated chunk i of the device at ring position p is chunk (p + i) mod N of its part, so
        # the chunk it sends in step s, (p - s), is index -s on every device, and the chunk it
        # adds the predecessor's into, (p - 1 - s), is index -1-s.
        for step in range(devices - 1):
            for j, ring in enumerate(self.rings):
                received = self.permute(chunks[j][-step % devices], ring_pairs(ring), f"ring{j}.rs{step}")
                target = (-1 - step) % devices
                chunks[j][target] = self.add(self.reducer, [chunks[j][target], received], role=f"ring{j}.rs{step}.sum")
        for step in range(devices - 1):  # position p holds the finished chunk p + 1: index 1
            for j, ring in enumerate(self.rings):
                chunks[j][-step % devices] = self.permute(chunks[j][(1 - step) % devices], ring_pairs(ring),
                                                          f"ring{j}.ag{step}")
        parts = []
        for j, ring in enumerate(self.rings):
            position = {d: p for p, d in enumerate(ring)}
            gathered = self.concatenate(chunks[j], f"ring{j}.gathered")
            back = [(devices - position[d]) % devices * chunk_size for d in range(devices)]
            parts.append(self.rotate(gathered, device, back, f"ring{j}.result"))
        self.put_in_place(self.concatenate(parts, "reduced"))

    def rotate(self, vector: HloInstruction, device: HloInstruction, offsets: list[int], role: str) -> HloInstruction:
        """`vector` rotated left by `offsets[device]` elements (read from a constant table)."""
        offset = self.lookup(device, offsets, role, table="offsets", result="offset")
        twice = self.concatenate([vector, vector], f"{role}.twice")
        return self.add("dynamic-slice", [twice, offset], vector.shape, role=role,
                        dynamic_slice_sizes=vector.shape.dims)
