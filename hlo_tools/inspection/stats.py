"""What an HLO module is made of, and what XLA says it costs.

Two parts, so that the first never needs XLA:

* :func:`module_stats` reads the IR alone: opcode histogram (whole module and
  per computation), fusions by kind, collectives by kind with their bytes and
  replica groups, entry parameter / output bytes and constant bytes.
* :func:`xla_cost` compiles the module with XLA on CPU and returns XLA's cost
  analysis (flops, transcendentals, bytes accessed) and the compiled memory
  stats (argument, output, alias, temp and generated-code bytes).  XLA aborts
  the process on some modules, so by default it compiles in a child process
  and any failure, a crash included, is an :class:`XlaCostError` of one line.

Counts are static: an instruction in a while body counts once, whatever the
trip count.  Byte sizes are those of the shapes as written (per device for a
partitioned module, global for one that XLA still has to partition); sub-byte
types are packed.

Collectives: the kinds are XLA's collective opcodes (``all-reduce``,
``all-gather``, ``reduce-scatter``, ``all-to-all``, ``ragged-all-to-all``,
``collective-permute``, ``collective-broadcast``).  An async pair counts once,
as its ``-start``; its result is what the matching ``-done`` delivers.  A
combined collective (several operands, a tuple result) counts once, with one
buffer per operand.  ``bytes_moved`` is the larger of the operand and result
bytes: the size of the collective's full data on one device, the convention of
nccl-tests' "size" (the whole all-reduced buffer, the gathered all-gather
output, the reduce-scatter input, the all-to-all or permuted buffer).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from hlo_tools.ir import attributes
from hlo_tools.ir.hlo import HloInstruction, HloModule
from hlo_tools.ir.opcodes import COLLECTIVES

__all__ = ["ModuleStats", "ComputationStats", "CollectiveOp", "CollectiveSummary", "XlaCost",
           "XlaCostError", "module_stats", "xla_cost", "collective_kind"]

# The collective kinds: XLA's collective opcodes without their async `-start` spellings.
COLLECTIVE_KINDS = frozenset(op for op in COLLECTIVES if not op.endswith("-start"))


def collective_kind(instr: HloInstruction) -> str | None:
    """The collective ``instr`` performs (``all-reduce`` for ``all-reduce-start`` too).

    None for everything else, ``-done`` and ``-update`` halves included, so that
    an async pair counts once.
    """
    opcode = instr.opcode
    if opcode in COLLECTIVE_KINDS:
        return opcode
    if opcode.endswith("-start") and opcode[:-len("-start")] in COLLECTIVE_KINDS:
        return opcode[:-len("-start")]
    return None


def _delivered_shape(start: HloInstruction):
    """The shape an async collective delivers: its ``-done``'s (the ``-start``'s own shape
    also holds the operands and context), else the start's when there is no done."""
    stem = start.opcode[:-len("-start")]
    current = start
    while True:
        follower = next((u for u in current.users
                         if u.opcode in (f"{stem}-update", f"{stem}-done")), None)
        if follower is None:
            return start.shape
        if follower.opcode.endswith("-done"):
            return follower.shape
        current = follower


def _groups_text(instr: HloInstruction) -> str | None:
    """The instruction's replica groups (source-target pairs for a permute) as written."""
    groups = instr.attrs.get("replica_groups")
    if isinstance(groups, attributes.ReplicaGroups):
        return str(groups)
    pairs = instr.attrs.get("source_target_pairs")
    if isinstance(pairs, tuple):
        return attributes.print_source_target_pairs(pairs)
    return None


@dataclasses.dataclass
class CollectiveOp:
    """One collective instruction (an async pair counts as its ``-start``)."""

    name: str
    computation: str
    kind: str
    opcode: str
    buffers: int          # arrays among the operands: more than 1 for a combined collective
    operand_bytes: int
    result_bytes: int
    dtypes: list[str]     # element types of the operands, sorted
    groups: str | None    # replica_groups / source_target_pairs as written; None when absent

    @property
    def bytes_moved(self) -> int:
        """The collective's full data on one device (see the module docstring)."""
        return max(self.operand_bytes, self.result_bytes)

    @staticmethod
    def of(instr: HloInstruction, kind: str) -> "CollectiveOp":
        result = _delivered_shape(instr) if instr.opcode != kind else instr.shape
        arrays = [leaf for op in instr.operands for _, leaf in op.shape.leaves() if leaf.is_array]
        return CollectiveOp(
            name=instr.name, computation=instr.parent.name, kind=kind, opcode=instr.opcode,
            buffers=len(arrays), operand_bytes=sum(leaf.byte_size for leaf in arrays),
            result_bytes=result.byte_size, dtypes=sorted({leaf.dtype for leaf in arrays}),
            groups=_groups_text(instr))

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        fields["bytes_moved"] = self.bytes_moved
        return fields


@dataclasses.dataclass
class CollectiveSummary:
    """The collectives of one kind, added up."""

    kind: str
    count: int
    buffers: int
    operand_bytes: int
    result_bytes: int
    bytes_moved: int
    dtypes: list[str]
    groups: list[str]  # distinct replica groups, in order of first appearance ("-": none given)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ComputationStats:
    name: str
    is_entry: bool
    opcodes: collections.Counter

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    def to_json(self) -> dict:
        return {"name": self.name, "entry": self.is_entry, "instructions": self.instructions,
                "opcodes": dict(sorted(self.opcodes.items()))}


@dataclasses.dataclass
class XlaCost:
    """What XLA reports for the module it compiled (per device: XLA compiles one program
    that every replica or partition runs)."""

    platform: str
    num_replicas: int
    num_partitions: int
    partitioner: str              # as hlo_tools.xla.runner picks it: none, shardy, gspmd, prepartitioned
    cost_analysis: dict[str, float]  # XLA's keys as it spells them ("bytes accessed", "flops", ...)
    memory: dict[str, int]        # argument/output/alias/temp/generated_code/peak bytes
    stage: str | None = None      # the stage of XLA's pipeline it was compiled from (None: the start)

    def to_json(self) -> dict:
        cost = self.cost_analysis
        return {"platform": self.platform, "num_replicas": self.num_replicas,
                "num_partitions": self.num_partitions, "partitioner": self.partitioner,
                "stage": self.stage,
                "flops": cost.get("flops"), "transcendentals": cost.get("transcendentals"),
                "bytes_accessed": cost.get("bytes accessed"),
                "cost_analysis": dict(sorted(cost.items())), "memory": dict(self.memory)}


class XlaCostError(Exception):
    """XLA could not compile the module (or crashed doing so); one line."""


@dataclasses.dataclass
class ModuleStats:
    """Everything :func:`module_stats` counts, plus XLA's view once :func:`xla_cost` filled it in."""

    module: str
    replica_count: int | None   # as the header says; None when it does not
    num_partitions: int | None
    computations: list[ComputationStats]
    fusion_kinds: collections.Counter
    collectives: list[CollectiveOp]
    parameter_count: int
    parameter_bytes: int
    output_count: int     # leaves of the entry result (a tuple's elements, flattened)
    output_bytes: int
    constant_count: int
    constant_bytes: int
    xla: XlaCost | None = None
    xla_error: str | None = None  # why XLA's numbers are missing, when they were asked for

    @property
    def entry(self) -> ComputationStats:
        return next(c for c in self.computations if c.is_entry)

    @property
    def opcodes(self) -> collections.Counter:
        """Instructions per opcode over every computation (fused ones included)."""
        total = collections.Counter()
        for comp in self.computations:
            total.update(comp.opcodes)
        return total

    @property
    def instructions(self) -> int:
        return sum(c.instructions for c in self.computations)

    @property
    def fusions(self) -> int:
        return sum(self.fusion_kinds.values())

    def collective_summary(self) -> list[CollectiveSummary]:
        """One line per collective kind present, in alphabetical order."""
        by_kind: dict[str, list[CollectiveOp]] = collections.defaultdict(list)
        for op in self.collectives:
            by_kind[op.kind].append(op)
        summary = []
        for kind, ops in sorted(by_kind.items()):
            groups = list(dict.fromkeys("-" if op.groups is None else op.groups for op in ops))
            summary.append(CollectiveSummary(
                kind=kind, count=len(ops), buffers=sum(op.buffers for op in ops),
                operand_bytes=sum(op.operand_bytes for op in ops),
                result_bytes=sum(op.result_bytes for op in ops),
                bytes_moved=sum(op.bytes_moved for op in ops),
                dtypes=sorted({d for op in ops for d in op.dtypes}), groups=groups))
        return summary

    def to_json(self) -> dict:
        """The ``--json`` report; its keys are listed in docs/stats.md."""
        return {
            "module": self.module,
            "replica_count": self.replica_count,
            "num_partitions": self.num_partitions,
            "computations": len(self.computations),
            "instructions": self.instructions,
            "opcodes": dict(sorted(self.opcodes.items())),
            "entry_opcodes": dict(sorted(self.entry.opcodes.items())),
            "per_computation": [c.to_json() for c in self.computations],
            "fusions": {"count": self.fusions, "kinds": dict(sorted(self.fusion_kinds.items()))},
            "collectives": {s.kind: s.to_json() for s in self.collective_summary()},
            "collective_instructions": [op.to_json() for op in self.collectives],
            "parameters": {"count": self.parameter_count, "bytes": self.parameter_bytes},
            "outputs": {"count": self.output_count, "bytes": self.output_bytes},
            "constants": {"count": self.constant_count, "bytes": self.constant_bytes},
            "xla": None if self.xla is None else self.xla.to_json(),
            "xla_error": self.xla_error,
        }

    def format(self) -> str:
        """The terminal report: aligned tables, one section per topic."""
        return _format(self)


def module_stats(module: HloModule) -> ModuleStats:
    """Count what ``module`` holds (the IR only; no XLA)."""
    computations, collectives = [], []
    fusion_kinds: collections.Counter = collections.Counter()
    constant_count = constant_bytes = 0
    for comp in module.computations:
        opcodes: collections.Counter = collections.Counter()
        for instr in comp.instructions:
            opcodes[instr.opcode] += 1
            if instr.opcode == "fusion":
                fusion_kinds[str(instr.attrs.get("kind", "unknown"))] += 1
            elif instr.opcode == "constant":
                constant_count += 1
                constant_bytes += instr.shape.byte_size
            kind = collective_kind(instr)
            if kind is not None:
                collectives.append(CollectiveOp.of(instr, kind))
        computations.append(ComputationStats(comp.name, comp is module.entry, opcodes))
    entry = module.entry
    params = entry.parameters
    outputs = [leaf for _, leaf in entry.root.shape.leaves() if leaf.is_array]
    return ModuleStats(
        module=module.name, replica_count=_header_count(module, "replica_count"),
        num_partitions=_header_count(module, "num_partitions"), computations=computations,
        fusion_kinds=fusion_kinds, collectives=collectives, parameter_count=len(params),
        parameter_bytes=sum(p.shape.byte_size for p in params), output_count=len(outputs),
        output_bytes=sum(leaf.byte_size for leaf in outputs), constant_count=constant_count,
        constant_bytes=constant_bytes)


def _header_count(module: HloModule, key: str) -> int | None:
    return int(module.attrs[key]) if key in module.attrs else None


# --- XLA's cost analysis and memory stats --------------------------------------------------------


def _compile_and_measure(text: str, platform: str) -> dict:
    """Compile ``text`` as ``hlo-tools run`` would, and read XLA's numbers (this process).

    The device counts and the partitioner are chosen with the runner's rules
    (header counts, else the devices the entry shardings name; Shardy/GSPMD
    markers pick the partitioner; a module XLA already optimized compiles from
    its stage on), so both commands compile the same program.
    Tuple and token parameters, which the runner cannot feed, are fine here.
    """
    from hlo_tools.xla import runner, xla_bridge  # noqa: PLC0415 - starts XLA

    try:
        module = xla_bridge.xla_parse(text)
    except xla_bridge.XlaBridgeError as exc:
        raise XlaCostError(runner.first_line(str(exc))) from exc
    printed = xla_bridge.module_text(module)
    replicas, partitions = runner.device_counts(text, printed)
    stage = runner.optimized_stage(text)
    marked = None if stage else runner.partitioner_for(printed)
    partitioner = marked or ("prepartitioned" if partitions > 1 else "none")
    needed = replicas * partitions
    if platform == "cpu" and needed > runner.MAX_CPU_DEVICES:
        raise XlaCostError(f"{needed} devices do not fit this machine (at most "
                           f"{runner.MAX_CPU_DEVICES} CPU devices)")
    if platform == "cpu":
        runner.ensure_cpu_devices(needed, needed)
    try:
        devices, process_index = xla_bridge.platform_devices(platform)
    except xla_bridge.XlaBridgeError as exc:
        raise XlaCostError(runner.first_line(str(exc))) from exc
    if needed > len(devices):
        raise XlaCostError(f"{needed} devices are needed, platform '{platform}' has {len(devices)}")
    try:
        executable = runner.compile_executable(
            module, platform, devices[:needed], process_index, num_replicas=replicas,
            num_partitions=partitions, partitioner=partitioner, stage=stage)
    except xla_bridge.XlaBridgeError as exc:
        hint = f" ({runner.optimized_note(stage)})" if stage else ""
        raise XlaCostError(runner.first_line(str(exc)) + hint) from exc
    cost = {key: float(value) for key, value in executable.cost_analysis().items()
            if isinstance(value, (int, float))}
    return {"platform": platform, "num_replicas": replicas, "num_partitions": partitions,
            "partitioner": partitioner, "cost_analysis": cost, "memory": executable.memory_stats(),
            "stage": stage}


def _worker_main(module_path: str, result_path: str, platform: str) -> None:
    """Entry point of the child process: measure the module in ``module_path``.

    Writes ``{"cost": ...}`` or ``{"error": ...}`` to ``result_path``; a crash
    leaves no result, and the parent reads the child's stderr instead.
    """
    try:
        with open(module_path, encoding="utf-8") as f:
            payload = {"cost": _compile_and_measure(f.read(), platform)}
    except XlaCostError as exc:
        payload = {"error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - still one line for the parent
        payload = {"error": f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]}
    with open(result_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip XLA's static destructors: nothing is left to clean up


def _measure_isolated(text: str, platform: str, timeout: float | None) -> dict:
    """:func:`_compile_and_measure` in a child process; a crash or timeout is an XlaCostError."""
    from hlo_tools.xla import runner  # noqa: PLC0415 - its isolation helpers (no XLA in this process)

    with tempfile.TemporaryDirectory(prefix="hlo-tools-stats-") as directory:
        module_path = os.path.join(directory, "module.hlo")
        result_path = os.path.join(directory, "result.json")
        stderr_path = os.path.join(directory, "stderr.txt")
        with open(module_path, "w", encoding="utf-8") as f:
            f.write(text)
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from hlo_tools.inspection.stats import _worker_main; "
                                       "_worker_main(*sys.argv[1:])",
                 module_path, result_path, platform],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                env=runner.child_env())
        try:
            runner.wait_for_child(proc, timeout)
        except subprocess.TimeoutExpired:
            raise XlaCostError(f"compiling took longer than {timeout:g} s and was stopped") from None
        if not os.path.exists(result_path):
            with open(stderr_path, errors="replace") as f:
                raise XlaCostError(runner.crash_message(proc.returncode, f.read(), "compiling"))
        with open(result_path, encoding="utf-8") as f:
            payload = json.load(f)
    if "error" in payload:
        raise XlaCostError(payload["error"])
    return payload["cost"]


def xla_cost(module: HloModule | str, *, platform: str = "cpu", isolate: bool = True,
             timeout: float | None = None) -> XlaCost:
    """Compile ``module`` (an HloModule or HLO text) with XLA and return its numbers.

    Args:
      platform: where to compile (``cpu`` by default; the numbers are that backend's).
      isolate: compile in a child process, so that an XLA crash is an XlaCostError.
        In this process, once jax has started its device count is fixed: the module
        must not need more devices than it has.
      timeout: seconds before the child is stopped (isolated only).

    Raises:
      XlaCostError: XLA refused or crashed on the module, in one line.
    """
    text = module if isinstance(module, str) else module.to_text()
    measured = (_measure_isolated(text, platform, timeout) if isolate
                else _compile_and_measure(text, platform))
    return XlaCost(**measured)


# --- The terminal report -------------------------------------------------------------------------


def _table(header: list[str] | None, rows: list[list], indent: str = "  ") -> list[str]:
    """Aligned columns: numbers (ints; blank cells allowed) right-aligned, text left-aligned."""
    width = len(rows[0]) if header is None else len(header)
    cells = [[_cell(v) for v in row] for row in ([] if header is None else [header]) + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(width)]
    numeric = [all(isinstance(row[i], int) or row[i] == "" for row in rows) for i in range(width)]
    lines = []
    for row in cells:
        parts = [text.rjust(w) if numeric[i] else text.ljust(w)
                 for i, (text, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(parts)).rstrip())
    return lines


def _cell(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _clip(text: str, width: int = 72) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _format(stats: ModuleStats) -> str:
    entry = stats.entry
    counts = [f"{key}={value}" for key, value in
              (("replica_count", stats.replica_count), ("num_partitions", stats.num_partitions))
              if value is not None]
    lines = [f"module {stats.module}: {len(stats.computations)} computations, "
             f"{stats.instructions:,} instructions (entry {entry.name}: {entry.instructions:,}); "
             f"{', '.join(counts) or 'no device counts in the header'}", ""]
    lines += _table(["sizes", "count", "bytes"], [
        ["entry parameters", stats.parameter_count, stats.parameter_bytes],
        ["entry outputs", stats.output_count, stats.output_bytes],
        ["constants", stats.constant_count, stats.constant_bytes]], indent="")
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(stats.fusion_kinds.items()))
    lines += ["", f"fusions: {stats.fusions}" + (f" ({kinds})" if kinds else ""), ""]
    summary = stats.collective_summary()
    if summary:
        rows = []
        for s in summary:
            groups = [_clip(g) for g in s.groups]
            rows.append([s.kind, s.count, s.buffers, s.operand_bytes, s.result_bytes,
                         s.bytes_moved, ",".join(s.dtypes) or "-", groups[0]])
            rows += [["", "", "", "", "", "", "", g] for g in groups[1:]]
        lines += _table(["collectives", "count", "buffers", "operand bytes", "result bytes",
                         "bytes moved", "dtype", "replica groups"], rows, indent="")
    else:
        lines.append("collectives: none")
    lines.append("")
    module_counts, entry_counts = stats.opcodes, entry.opcodes
    lines += _table(["opcodes", "module", "entry"],
                    [[op, n, entry_counts.get(op, 0)] for op, n in
                     sorted(module_counts.items(), key=lambda item: (-item[1], item[0]))],
                    indent="")
    lines.append("")
    if stats.xla is not None:
        x = stats.xla
        origin = f"compiled from its {x.stage} stage" if x.stage else f"partitioner {x.partitioner}"
        lines.append(f"XLA ({x.platform}, {_devices(x.num_replicas, x.num_partitions)}, {origin}; "
                     f"numbers per device)")
        cost = x.cost_analysis
        rows = [[label, _number(cost[key])] for label, key in
                (("flops", "flops"), ("transcendentals", "transcendentals"),
                 ("bytes accessed", "bytes accessed"), ("optimal seconds", "optimal_seconds"))
                if key in cost]
        rows += [[name.replace("_", " "), value] for name, value in x.memory.items()]
        lines += _table(None, rows) if rows else ["  (XLA reported nothing)"]
    elif stats.xla_error is not None:
        lines.append(f"XLA cost analysis unavailable: {stats.xla_error}")
    return "\n".join(lines).rstrip("\n") + "\n"


def _devices(replicas: int, partitions: int) -> str:
    counts = [f"{n} {what}" for n, what in ((replicas, "replicas"), (partitions, "partitions")) if n > 1]
    return " x ".join(counts) or "1 device"


def _number(value: float) -> int | str:
    """Whole numbers as ints (aligned with thousands separators), others as they are."""
    return int(value) if float(value).is_integer() else f"{value:.6g}"
