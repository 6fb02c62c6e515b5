"""What one step of a per-device module costs on a machine of a given shape (docs/cost_model.md).

The step is priced in two parts, added (no overlap of compute and communication):

* compute: a roofline of the chip, ``max(flops / peak_flops, bytes / hbm_bandwidth)``, with the
  flops and bytes of XLA's cost analysis (:func:`hlo_tools.inspection.stats.xla_cost`, compiled in a child
  process) or, when XLA cannot compile the module or is not asked, of the IR alone: the flops of
  every dot and convolution and the operand and result bytes of every instruction.
* collectives: each one at the time of the algorithm it would use on the topology
  (:mod:`hlo_tools.inspection.topology`), in the alpha-beta model: every step of a ring pays the link
  latency per hop of its longest route, and its bytes over the link bandwidth times the number
  of routes that share its busiest link.

The analytic helpers (:func:`ring_all_reduce_time`, :func:`torus_2d_all_reduce_time`, ...) and
:func:`collective_time` price a collective without a module, so a benchmark can price a
4096-chip pod without building one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import sys

from hlo_tools.ir import attributes
from hlo_tools.inspection import stats
from hlo_tools.ir.hlo import HloInstruction, HloModule
from hlo_tools.ir.attributes import attr_bool
from hlo_tools.inspection.topology import Topology

__all__ = ["Chip", "CHIPS", "CollectiveEstimate", "CollectivePlan", "StepEstimate", "CostModelError",
           "estimate", "collective_time", "plan_collective", "ring_all_reduce_time",
           "ring_all_gather_time", "ring_reduce_scatter_time", "torus_2d_all_reduce_time",
           "tree_all_reduce_time",
           "module_device_groups", "ir_compute_cost", "Claim", "claims", "format_claims"]


class CostModelError(ValueError):
    """The module and the machine do not fit together (one line)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """What the model needs to know about one chip and its links (sources: docs/cost_model.md)."""

    name: str
    peak_flops: float        # FLOP/s
    hbm_bandwidth: float     # bytes/s between the chip and its memory
    link_bandwidth: float    # bytes/s per link, per direction
    link_latency: float      # seconds per hop of one step of a collective
    description: str = ""


CHIPS: dict[str, Chip] = {chip.name: chip for chip in (
    Chip("tpu-v3", peak_flops=123e12, hbm_bandwidth=900e9, link_bandwidth=100e9, link_latency=1e-6,
         description="TPU v3: 123 TFLOP/s bf16, 900 GB/s HBM; ICI link from the pod's 6.4 TB/s bisection"),
    Chip("tpu-v4", peak_flops=275e12, hbm_bandwidth=1200e9, link_bandwidth=50e9, link_latency=1e-6,
         description="TPU v4: 275 TFLOP/s bf16, 1200 GB/s HBM, ICI 50 GB/s per link"),
    Chip("h100-nvlink", peak_flops=989.5e12, hbm_bandwidth=3.35e12, link_bandwidth=225e9,
         link_latency=2e-6,
         description="H100 SXM in an 8-GPU NVLink/NVSwitch node, as ring:8: 989.5 TFLOP/s bf16 "
                     "dense, 3.35 TB/s HBM3, 9 of its 18 NVLinks (25 GB/s each way) per ring link"),
    Chip("cpu", peak_flops=332.8e9, hbm_bandwidth=20e9, link_bandwidth=10e9, link_latency=10e-6,
         description="this 2-core AMD EPYC (Zen 5) host: 2 x 2.6 GHz x 64 f32 flop/cycle; "
                     "memory and device-to-device copies assumed"),
)}


# --- Analytic formulas (one group, every step on direct links) ------------------------------------


def _ring_time(steps: int, nbytes: float, n: int, chip: Chip, *, bidirectional: bool,
               hops: int = 1, sharing: int = 1) -> float:
    """``steps`` ring steps, each moving ``nbytes / n`` (half of it each way when bidirectional)."""
    chunk = nbytes / n / (2 if bidirectional else 1)
    return steps * (hops * chip.link_latency + chunk * sharing / chip.link_bandwidth)


def ring_all_reduce_time(nbytes: float, n: int, chip: Chip, *, bidirectional: bool = False) -> float:
    """Ring all-reduce of ``nbytes`` on ``n`` chips: 2(n-1)/n B/bw + 2(n-1) latency, the
    bandwidth term halved when half the data goes each way round."""
    return _ring_time(2 * (n - 1), nbytes, n, chip, bidirectional=bidirectional)


def ring_all_gather_time(nbytes: float, n: int, chip: Chip, *, bidirectional: bool = False) -> float:
    """Ring all-gather to ``nbytes`` (the gathered size) on ``n`` chips: (n-1)/n B/bw + (n-1) latency."""
    return _ring_time(n - 1, nbytes, n, chip, bidirectional=bidirectional)


def ring_reduce_scatter_time(nbytes: float, n: int, chip: Chip, *, bidirectional: bool = False) -> float:
    """Ring reduce-scatter of ``nbytes`` (the input size): the all-gather's time, run backwards."""
    return ring_all_gather_time(nbytes, n, chip, bidirectional=bidirectional)


def torus_2d_all_reduce_time(nbytes: float, rows: int, columns: int, chip: Chip, *,
                             wraps: bool = True) -> float:
    """2-D all-reduce on a full rows x columns torus (``wraps``) or mesh: reduce-scatter in the
    rows, all-reduce of the 1/columns shard in the columns, all-gather in the rows.

    On a torus every row and column is a physical ring (bidirectional); on a mesh each is a line,
    run as a one-way ring whose closing step crosses the whole line back.
    """
    def phase(steps, size, n):
        if n < 2:
            return 0.0
        if wraps and n > 2:
            return _ring_time(steps, size, n, chip, bidirectional=True)
        return _ring_time(steps, size, n, chip, bidirectional=False, hops=n - 1 if n > 2 else 1)
    in_rows = phase(columns - 1, nbytes, columns)
    in_columns = phase(2 * (rows - 1), nbytes / columns, rows)
    return 2 * in_rows + in_columns


def tree_all_reduce_time(nbytes: float, depth: int, chip: Chip, *, chunks: int | None = None) -> float:
    """Pipelined reduce-then-broadcast on a spanning tree of physical links, ``depth`` hops from
    its root to its deepest chip (``all-reduce-2d``'s form for failed chips): the buffer in K
    chunks, K + 2 depth - 1 rounds of one chunk over one hop, every tree link carrying one chunk
    each way per round: (K + 2D - 1) (latency + B/K / bw).

    ``chunks`` None: the K that minimises it, near sqrt((2D - 1) B / (bw latency)).
    """
    if depth == 0:
        return 0.0
    k = chunks if chunks is not None else _best_chunks(nbytes, depth, chip)
    return (k + 2 * depth - 1) * (chip.link_latency + nbytes / k / chip.link_bandwidth)


def _best_chunks(nbytes: float, depth: int, chip: Chip) -> int:
    """The chunk count that minimises :func:`tree_all_reduce_time` (at most one per byte)."""
    most = max(1, int(nbytes))
    if chip.link_latency == 0:
        return most
    ideal = math.sqrt((2 * depth - 1) * nbytes / (chip.link_bandwidth * chip.link_latency))
    candidates = {min(most, max(1, k)) for k in (math.floor(ideal), math.ceil(ideal))}
    return min(candidates, key=lambda k: (tree_all_reduce_time(nbytes, depth, chip, chunks=k), k))


# --- Routes and link sharing on a topology -------------------------------------------------------


@functools.lru_cache(maxsize=1 << 16)
def _route(topology: Topology, source: int, target: int) -> tuple[tuple[int, int], ...]:
    """The directed links from ``source`` to ``target``: along the row first, then the column,
    the short way round; :meth:`Topology.path`'s detour where that meets a failed chip."""
    (r, c), (target_r, target_c) = topology.coordinate(source), topology.coordinate(target)
    chips = [(r, c)]
    for axis, size, goal in ((1, topology.columns, target_c), (0, topology.rows, target_r)):
        here = chips[-1][axis]
        if topology.wraps:
            step = 1 if (goal - here) % size <= (here - goal) % size else -1
        else:
            step = 1 if goal > here else -1
        while chips[-1][axis] != goal:
            moved = list(chips[-1])
            moved[axis] = (moved[axis] + step) % size
            chips.append(tuple(moved))
    devices = [topology.device_at(chip) for chip in chips]
    if None in devices:
        devices = topology.path(source, target)
        if devices is None:
            raise CostModelError(f"devices {source} and {target} are cut off from each other "
                                 f"on {topology.describe()}")
    return tuple(zip(devices, devices[1:]))


@dataclasses.dataclass(frozen=True)
class CollectivePlan:
    """How a collective runs on the topology, and how long it takes."""

    algorithm: str
    time_s: float


def _ring_edges(group: list[int]) -> list[tuple[int, int]]:
    return [(group[i], group[(i + 1) % len(group)]) for i in range(len(group))]


def _ring_phase(groups: list[list[int]], steps, nbytes: float, topology: Topology,
                chip: Chip) -> tuple[float, str]:
    """Every group's ring running at once; ``steps(n)`` ring steps of ``nbytes / n`` each.

    Both directions are tried: one way round (each step's route is the group order's next
    member), and half the data each way (both routes of every edge share the links). The
    faster one is used. A group's step time is its longest route's hops times the latency plus
    its chunk over the bandwidth shared by the most routes on any link it uses.
    """
    rings = [g for g in groups if len(g) > 1]
    if not rings:
        return 0.0, "none"
    forward = [[_route(topology, a, b) for a, b in _ring_edges(g)] for g in rings]
    backward = [[_route(topology, b, a) for a, b in _ring_edges(g)] for g in rings]
    options = [(False, forward)]
    if min(len(g) for g in rings) > 2:
        options.append((True, [f + b for f, b in zip(forward, backward)]))
    best = None
    for bidirectional, routes in options:
        load = collections.Counter(link for group_routes in routes for route in group_routes
                                   for link in route)
        time, hops, sharing = 0.0, 1, 1
        for group, group_routes in zip(rings, routes):
            group_hops = max(len(route) for route in group_routes)
            group_sharing = max(load[link] for route in group_routes for link in route)
            time = max(time, _ring_time(steps(len(group)), nbytes, len(group), chip,
                                        bidirectional=bidirectional, hops=group_hops,
                                        sharing=group_sharing))
            hops, sharing = max(hops, group_hops), max(sharing, group_sharing)
        if best is None or time < best[0]:
            best = (time, bidirectional, hops, sharing)
    time, bidirectional, hops, sharing = best
    name = ("bidirectional ring" if bidirectional else "ring")
    name += f", {hops}-hop steps" if hops > 1 else ""
    name += f", links shared by {sharing}" if sharing > 1 else ""
    return time, name


def _full_grid(group: list[int], topology: Topology) -> bool:
    """Whether ``group`` is every healthy chip of a 2-D torus or mesh."""
    return (topology.kind != "ring" and topology.rows > 1 and topology.columns > 1
            and len(group) == topology.num_devices and set(group) == set(range(topology.num_devices)))


def _snake(topology: Topology) -> list[int]:
    """The healthy chips row by row, every other row backwards: a ring of direct links on a
    torus (or a mesh with an even number of rows) but where it skips a failed chip."""
    order = []
    for r in range(topology.rows):
        columns = range(topology.columns) if r % 2 == 0 else reversed(range(topology.columns))
        order += [d for d in (topology.device_at((r, c)) for c in columns) if d is not None]
    return order


def _two_d(opcode: str, nbytes: float, topology: Topology, chip: Chip) -> CollectivePlan:
    """The 2-D decomposition over the healthy chips of each row and each column."""
    def line(chips):
        return [d for d in (topology.device_at(x) for x in chips) if d is not None]
    rows = [g for g in (line((r, c) for c in range(topology.columns)) for r in range(topology.rows)) if g]
    columns = [g for g in (line((r, c) for r in range(topology.rows)) for c in range(topology.columns)) if g]
    shard = nbytes / min(len(g) for g in rows)  # a row with a hole leaves bigger shards

    def gather(n):
        return n - 1
    in_rows, _ = _ring_phase(rows, gather, nbytes, topology, chip)
    if opcode == "all-reduce":  # reduce-scatter in rows, all-reduce in columns, all-gather in rows
        time = 2 * in_rows + _ring_phase(columns, lambda n: 2 * (n - 1), shard, topology, chip)[0]
    else:  # all-gather: columns (to the shard), then rows; reduce-scatter: the reverse
        time = in_rows + _ring_phase(columns, gather, shard, topology, chip)[0]
    holes = len(topology.failed)
    around = f" around {holes} failed chip{'s' if holes > 1 else ''}" if holes else ""
    return CollectivePlan(f"2-D {topology.kind} {topology.rows}x{topology.columns}{around}", time)


def _tree(nbytes: float, topology: Topology, chip: Chip) -> CollectivePlan | None:
    """The pipelined tree all-reduce over every healthy chip, rooted at the best of the chips
    next to the middle of the machine; None when failed chips cut the healthy ones apart."""
    middle_r, middle_c = (topology.rows - 1) / 2, (topology.columns - 1) / 2
    nearest = sorted(range(topology.num_devices), key=lambda d: (
        abs(topology.coordinate(d)[0] - middle_r) + abs(topology.coordinate(d)[1] - middle_c), d))
    depths = []
    for root in nearest[:5]:
        distance = {root: 0}
        frontier = [root]
        while frontier:
            following = []
            for device in frontier:
                for neighbour in topology.neighbours(device):
                    if neighbour not in distance:
                        distance[neighbour] = distance[device] + 1
                        following.append(neighbour)
            frontier = following
        if len(distance) < topology.num_devices:
            return None
        depths.append(max(distance.values()))
    depth = min(depths)
    chunks = _best_chunks(nbytes, depth, chip)
    return CollectivePlan(f"pipelined tree, depth {depth}, {chunks} chunks",
                          tree_all_reduce_time(nbytes, depth, chip, chunks=chunks))


def _pairwise(messages: list[tuple[int, int]], nbytes: float, topology: Topology,
              chip: Chip) -> tuple[float, int, int]:
    """Messages sent at once: (time, longest route in hops, most routes on one link)."""
    routes = [_route(topology, s, t) for s, t in messages if s != t]
    if not routes:
        return 0.0, 0, 0
    load = collections.Counter(link for route in routes for link in route)
    time = max(len(route) * chip.link_latency + nbytes * max(load[link] for link in route)
               / chip.link_bandwidth for route in routes)
    return time, max(len(r) for r in routes), max(load.values())


ALGORITHMS = frozenset({"ring", "snake", "2-D", "tree"})


def plan_collective(opcode: str, nbytes: float, groups: list[list[int]], topology: Topology,
                    chip: Chip, *, algorithms: frozenset[str] | set[str] | None = None) -> CollectivePlan:
    """The algorithm and time of one collective whose groups (device ids on ``topology``) run at once.

    ``nbytes`` is the collective's full data on one device (hlo-tools stats' "bytes moved"): the
    all-reduced buffer, the gathered all-gather result, the reduce-scatter input, the
    all-to-all buffer, the permuted buffer. For ``collective-permute``, ``groups`` are the
    source-target pairs.

    ``algorithms`` limits an all-reduce, all-gather or reduce-scatter to some of ``ALGORITHMS``
    (the ring in the group's order, the snake ring, the 2-D decomposition, the pipelined tree),
    to price what a program that fixes its algorithm gets; by default the fastest is taken.
    """
    unknown = set(algorithms or ()) - ALGORITHMS
    if unknown:
        raise CostModelError(f"unknown algorithm {sorted(unknown)[0]!r}: one of {', '.join(sorted(ALGORITHMS))}")
    for group in groups:
        for device in group:
            if not 0 <= device < topology.num_devices:
                raise CostModelError(f"device {device} is not one of the {topology.num_devices} "
                                     f"healthy devices of {topology.describe()}")
    if opcode == "collective-permute":
        time, hops, sharing = _pairwise([tuple(pair) for pair in groups], nbytes, topology, chip)
        shared = f", links shared by {sharing}" if sharing > 1 else ""
        return CollectivePlan(f"direct sends, up to {_count(hops, 'hop')}{shared}", time)
    if all(len(group) < 2 for group in groups):
        return CollectivePlan("none", 0.0)
    if opcode in ("all-to-all", "ragged-all-to-all"):
        largest = max(len(g) for g in groups)
        time = 0.0
        for shift in range(1, largest):  # round k: every member sends its k-th neighbour's share
            messages = [(g[i], g[(i + shift) % len(g)]) for g in groups if shift < len(g)
                        for i in range(len(g))]
            time += _pairwise(messages, nbytes / largest, topology, chip)[0]
        return CollectivePlan(f"{largest - 1} rounds of direct sends", time)
    if opcode == "collective-broadcast":  # a pipelined chain from each group's first member
        chain = [edge for group in groups for edge in _ring_edges(group)[:-1]]
        _, hops, sharing = _pairwise(chain, nbytes, topology, chip)
        steps = max(len(group) for group in groups) - 1
        return CollectivePlan("pipelined chain", steps * hops * chip.link_latency
                              + nbytes * sharing / chip.link_bandwidth)
    if opcode not in ("all-reduce", "all-gather", "reduce-scatter"):
        raise CostModelError(f"no cost model for {opcode}")

    def steps(n):  # a ring all-reduce is a reduce-scatter and an all-gather
        return 2 * (n - 1) if opcode == "all-reduce" else n - 1
    wanted = algorithms or ALGORITHMS
    candidates = []
    if "ring" in wanted:
        time, name = _ring_phase(groups, steps, nbytes, topology, chip)
        candidates.append(CollectivePlan(name, time))
    if len(groups) == 1 and _full_grid(groups[0], topology):
        if "snake" in wanted:
            time, name = _ring_phase([_snake(topology)], steps, nbytes, topology, chip)
            candidates.append(CollectivePlan(f"snake {name}", time))
        if "2-D" in wanted:
            candidates.append(_two_d(opcode, nbytes, topology, chip))
    if "tree" in wanted and opcode == "all-reduce" and len(groups) == 1 \
            and sorted(groups[0]) == list(range(topology.num_devices)):
        candidates.append(_tree(nbytes, topology, chip))
    candidates = [plan for plan in candidates if plan is not None]
    if not candidates:
        raise CostModelError(f"none of the algorithms {', '.join(sorted(wanted))} runs {opcode} over "
                             f"these groups on {topology.describe()}")
    return min(candidates, key=lambda plan: plan.time_s)


def collective_time(opcode: str, nbytes: float, groups: list[list[int]], topology: Topology,
                    chip: Chip) -> float:
    """Seconds for one collective (see :func:`plan_collective`)."""
    return plan_collective(opcode, nbytes, groups, topology, chip).time_s


# --- Which devices a module's collectives join -----------------------------------------------------


def _counts(module: HloModule, num_devices: int, num_replicas: int | None,
            num_partitions: int | None) -> tuple[int, int]:
    """(replicas, partitions): the ones given, else the header's; a module that states neither
    runs on every device, as partitions when its collectives have channels (JAX's jit and
    shard_map), else as replicas (pmap before Shardy)."""
    replicas = num_replicas or (int(module.attrs["replica_count"]) if "replica_count" in module.attrs else None)
    partitions = num_partitions or (int(module.attrs["num_partitions"]) if "num_partitions" in module.attrs else None)
    if replicas is None and partitions is None:
        channels = any(i.attrs.get("channel_id") is not None for i in module.instructions()
                       if stats.collective_kind(i))
        return (1, num_devices) if channels else (num_devices, 1)
    replicas, partitions = replicas or 1, partitions or 1
    if replicas * partitions != num_devices:
        raise CostModelError(f"the module runs on {replicas * partitions} devices "
                             f"({_count(replicas, 'replica')} x {_count(partitions, 'partition')}) "
                             f"but the topology has {num_devices} healthy chips")
    return replicas, partitions


def module_device_groups(instr: HloInstruction, kind: str, replicas: int,
                         partitions: int) -> list[list[int]]:
    """The global device ids (replica * partitions + partition) of each group of ``instr``,
    as XLA's group modes read its ids; source-target pairs for a collective-permute."""
    has_channel = instr.attrs.get("channel_id") is not None
    if kind in ("all-to-all", "ragged-all-to-all", "collective-permute", "collective-broadcast"):
        mode = "partitions" if has_channel else "replicas"
    elif not has_channel:
        mode = "replicas"
    else:
        mode = "devices" if attr_bool(instr.attrs, "use_global_device_ids") else "replicas+partitions"
    copies, width = {"partitions": (replicas, partitions), "replicas": (partitions, replicas),
                     "devices": (1, replicas * partitions),
                     "replicas+partitions": (1, replicas)}[mode]

    def device(copy: int, index: int) -> int:
        if mode == "partitions":
            return copy * partitions + index
        if mode == "replicas":
            return index * partitions + copy
        return index

    if kind == "collective-permute":
        pairs = instr.attrs.get("source_target_pairs") or ()
        return [[device(k, s), device(k, t)] for k in range(copies) for s, t in pairs]
    written = instr.attrs.get("replica_groups")
    groups = written.groups if isinstance(written, attributes.ReplicaGroups) else []
    groups = groups or [list(range(width))]
    for group in groups:
        for index in group:
            if not 0 <= index < width:
                raise CostModelError(f"{instr.name}: id {index} in its groups is not one of the "
                                     f"{width} {mode.split('+')[0]} of the module")
    if mode == "replicas+partitions":
        return [[r * partitions + p for r in group for p in range(partitions)] for group in groups]
    return [[device(k, index) for index in group] for k in range(copies) for group in groups]


# --- Compute --------------------------------------------------------------------------------------

# Instructions that move no data of their own (views, control flow whose bodies are counted).
_NO_TRAFFIC = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
                         "call", "conditional", "after-all", "add-dependency", "opt-barrier",
                         "partition-id", "replica-id"})


def _dot_flops(instr: HloInstruction) -> int:
    lhs = instr.operands[0].shape
    contracted = 1
    for dim in instr.attrs.get("lhs_contracting_dims") or ():
        contracted *= lhs.dims[dim]
    return 2 * instr.shape.element_count * contracted


def _convolution_flops(instr: HloInstruction) -> int:
    """2 x output elements x (kernel elements per output feature, i.e. window x input features)."""
    kernel = instr.operands[1].shape
    labels = instr.attrs.get("dim_labels")
    output_features = kernel.dims[labels.kernel_labels.index("o")] if labels is not None else 1
    return 2 * instr.shape.element_count * kernel.element_count // max(output_features, 1)


def ir_compute_cost(module: HloModule) -> tuple[float, float]:
    """(flops, bytes) from the IR alone: the flops of every dot and convolution (fused ones
    included); the operand and result bytes of every instruction outside fused computations and
    reducers, collectives left out (they are priced on the links)."""
    inner = set()
    for instr in module.instructions():
        if instr.opcode == "fusion" or "to_apply" in instr.attrs:
            inner.update(instr.called_computations)
    flops = traffic = 0
    for comp in module.computations:
        for instr in comp.instructions:
            if instr.opcode == "dot":
                flops += _dot_flops(instr)
            elif instr.opcode == "convolution":
                flops += _convolution_flops(instr)
            if comp in inner or instr.opcode in _NO_TRAFFIC or stats.collective_kind(instr) \
                    or instr.opcode.endswith("-done"):
                continue
            traffic += instr.shape.byte_size + sum(op.shape.byte_size for op in instr.operands)
    return float(flops), float(traffic)


# --- A step ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveEstimate:
    """One collective instruction of the module, priced."""

    name: str
    opcode: str
    bytes: int
    group_size: int
    algorithm: str
    time_s: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Machine:
    """A topology of chips: where `xla-opt --report` and `hlo-tools report` price each step."""

    topology: Topology
    chip: Chip

    def describe(self) -> str:
        return f"{self.topology.describe()} of {self.chip.name}"

    def step_time_s(self, module: HloModule) -> float:
        """One step of the per-device ``module`` here, from the IR alone (fast enough to price
        every step of a pipeline; CostModelError when it does not fit the machine)."""
        return estimate(module, self.topology, self.chip, use_xla=False).step_time_s


@dataclasses.dataclass
class StepEstimate:
    """One step: compute plus every collective, one after the other."""

    topology: Topology
    chip: Chip
    num_replicas: int
    num_partitions: int
    flops: float
    bytes_accessed: float
    compute_source: str            # "xla" (its cost analysis) or "ir" (dots, convolutions, sizes)
    compute_note: str | None       # why XLA's numbers are not used, when they are not
    collectives: list[CollectiveEstimate]

    @property
    def compute_time_s(self) -> float:
        return max(self.flops / self.chip.peak_flops, self.bytes_accessed / self.chip.hbm_bandwidth)

    @property
    def collective_time_s(self) -> float:
        return sum(c.time_s for c in self.collectives)

    @property
    def step_time_s(self) -> float:
        return self.compute_time_s + self.collective_time_s

    def to_json(self) -> dict:
        chip = self.chip
        return {
            "step_time_s": self.step_time_s, "compute_time_s": self.compute_time_s,
            "collective_time_s": self.collective_time_s, "topology": str(self.topology),
            "failed": [f"{r}:{c}" for r, c in sorted(self.topology.failed)],
            "link_bandwidth_bytes_per_s": chip.link_bandwidth, "link_latency_s": chip.link_latency,
            "chip": chip.name, "peak_flops": chip.peak_flops,
            "hbm_bandwidth_bytes_per_s": chip.hbm_bandwidth,
            "num_replicas": self.num_replicas, "num_partitions": self.num_partitions,
            "flops": self.flops, "bytes_accessed": self.bytes_accessed,
            "compute_source": self.compute_source, "compute_note": self.compute_note,
            "collectives": [c.to_json() for c in self.collectives],
        }

    def format(self) -> str:
        """The terminal report."""
        chip = self.chip
        lines = [
            f"topology  {self.topology.describe()} ({self.topology.num_devices} devices: "
            f"{_count(self.num_replicas, 'replica')} x {_count(self.num_partitions, 'partition')})",
            f"chip      {chip.name}: {_si(chip.peak_flops)}FLOP/s, HBM {_si(chip.hbm_bandwidth)}B/s, "
            f"links {_si(chip.link_bandwidth)}B/s per direction, {_si(chip.link_latency)}s per hop",
            "",
            f"step        {_si(self.step_time_s)}s  (compute + collectives, no overlap)",
            f"compute     {_si(self.compute_time_s)}s  ({_si(self.flops)}FLOP, "
            f"{_si(self.bytes_accessed)}B; from {self.compute_source}"
            + (f": {self.compute_note}" if self.compute_note else "") + ")",
            f"collectives {_si(self.collective_time_s)}s  ({len(self.collectives)})",
        ]
        if self.collectives:
            rows = [[c.name, c.opcode, f"{c.bytes:,}", str(c.group_size), _si(c.time_s) + "s",
                     c.algorithm] for c in self.collectives]
            header = ["name", "opcode", "bytes", "group", "time", "algorithm"]
            widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
            lines.append("")
            for row in [header] + rows:
                cells = [text.rjust(w) if i in (2, 3, 4) else text.ljust(w)
                         for i, (text, w) in enumerate(zip(row, widths))]
                lines.append("  ".join(cells).rstrip())
        return "\n".join(lines) + "\n"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _si(value: float) -> str:
    """``1.23 m``-style: three significant digits and an SI prefix (then the unit)."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""),
                           (1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def estimate(module: HloModule, topology: Topology, chip: Chip, *, num_replicas: int | None = None,
             num_partitions: int | None = None, use_xla: bool = True,
             timeout: float | None = None) -> StepEstimate:
    """Price one step of the per-device ``module`` on ``topology`` made of ``chip``.

    The module's device count (the counts given, else its header's) must be the topology's
    healthy chip count. XLA's cost analysis gives the compute when ``use_xla`` and it compiles
    (in a child process, at most ``timeout`` seconds); else the IR estimate does.
    """
    replicas, partitions = _counts(module, topology.num_devices, num_replicas, num_partitions)
    collectives = []
    for instr in module.instructions():
        kind = stats.collective_kind(instr)
        if kind is None:
            continue
        op = stats.CollectiveOp.of(instr, kind)
        groups = module_device_groups(instr, kind, replicas, partitions)
        plan = plan_collective(kind, op.bytes_moved, groups, topology, chip)
        size = 2 if kind == "collective-permute" else max((len(g) for g in groups), default=1)
        collectives.append(CollectiveEstimate(instr.name, instr.opcode, op.bytes_moved, size,
                                              plan.algorithm, plan.time_s))
    if use_xla:
        try:
            cost = stats.xla_cost(module, timeout=timeout).cost_analysis
            return StepEstimate(topology, chip, replicas, partitions, cost.get("flops", 0.0),
                                cost.get("bytes accessed", 0.0), "xla", None, collectives)
        except stats.XlaCostError as exc:
            note = f"XLA could not compile it: {exc}"
    else:
        note = "XLA not asked"
    flops, traffic = ir_compute_cost(module)
    return StepEstimate(topology, chip, replicas, partitions, flops, traffic, "ir", note, collectives)


# --- The papers' claims, side by side with the model ---------------------------------------------

RESNET50_PARAMETERS = 25.6e6
BERT_LARGE_PARAMETERS = 340e6


@dataclasses.dataclass(frozen=True)
class Claim:
    """A published claim, the case it is checked on, and what the model says there."""

    claim: str
    case: str
    model: str


def claims() -> list[Claim]:
    """The model's numbers for the claims docs/cost_model.md compares it with (TPU v3 chips)."""
    tpu = CHIPS["tpu-v3"]
    pod = Topology.parse("torus:32x32")
    everyone = [list(range(pod.num_devices))]
    out = []
    for label, nbytes in (("ResNet-50's bf16 gradient", 2 * RESNET50_PARAMETERS),
                          ("ResNet-50's f32 gradient", 4 * RESNET50_PARAMETERS),
                          ("a message", 1e6), ("a message", 64e3)):
        ring = ring_all_reduce_time(nbytes, 1024, tpu, bidirectional=True)
        torus = torus_2d_all_reduce_time(nbytes, 32, 32, tpu)
        out.append(Claim("(a) 2-D torus all-reduce beats a 1-D ring at 1024 chips",
                         f"{label} of {_si(nbytes)}B",
                         f"1-D bidirectional ring {_si(ring)}s, 2-D torus 32x32 {_si(torus)}s: "
                         f"{ring / torus:.1f}x faster"))
    # An update reads the weights, the gradient and the optimizer's slots and writes the weights
    # and the slots, in f32: LARS (momentum) 5 x 4 bytes per parameter, LAMB (two moments) 7 x 4.
    # Its flops per parameter are few, so HBM bandwidth bounds it on every chip of CHIPS.
    for label, parameters, flops, traffic in (("ResNet-50, LARS", RESNET50_PARAMETERS, 10, 20),
                                              ("BERT-large, LAMB", BERT_LARGE_PARAMETERS, 20, 28)):
        update = max(flops * parameters / tpu.peak_flops, traffic * parameters / tpu.hbm_bandwidth)
        gradient = 4 * parameters
        all_reduce = collective_time("all-reduce", gradient, everyone, pod, tpu)
        split = (collective_time("reduce-scatter", gradient, everyone, pod, tpu)
                 + collective_time("all-gather", gradient, everyone, pod, tpu))
        out.append(Claim("(b) weight-update sharding divides the replicated update by N",
                         f"{label} update, torus:32x32",
                         f"update replicated {_si(update)}s, sharded {_si(update / 1024)}s; "
                         f"all-reduce {_si(all_reduce)}s, reduce-scatter + all-gather {_si(split)}s"))
    for label, parameters in (("ResNet-50", RESNET50_PARAMETERS), ("BERT-large", BERT_LARGE_PARAMETERS)):
        for rows, columns in ((16, 32), (32, 32)):
            nbytes = 4 * parameters
            healthy = Topology.parse(f"torus:{rows}x{columns}")
            failed = Topology.parse(f"torus:{rows}x{columns}", failed=f"{rows // 2}:{columns // 2}")
            before = plan_collective("all-reduce", nbytes, [list(range(healthy.num_devices))], healthy, tpu)
            after = plan_collective("all-reduce", nbytes, [list(range(failed.num_devices))], failed, tpu)
            out.append(Claim("(c) a failed chip has little impact on gradient summation",
                             f"{label} f32 gradient ({_si(nbytes)}B), torus:{rows}x{columns}",
                             f"healthy {_si(before.time_s)}s, chip {rows // 2}:{columns // 2} failed "
                             f"{_si(after.time_s)}s: +{100 * (after.time_s / before.time_s - 1):.0f}% "
                             f"({after.algorithm})"))
    return out


def format_claims() -> str:
    """The claims as the Markdown table of docs/cost_model.md."""
    rows = [["claim", "case", "model"]] + [[c.claim, c.case, c.model] for c in claims()]
    return "\n".join("| " + " | ".join(row) + " |" + ("\n| --- | --- | --- |" if i == 0 else "")
                     for i, row in enumerate(rows)) + "\n"


if __name__ == "__main__":
    sys.stdout.write(format_claims())
