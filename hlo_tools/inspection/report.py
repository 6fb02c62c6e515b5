"""One self-contained HTML page for a dump directory: what every pass did to every module.

    from hlo_tools.inspection import report
    page = report.build_report("dump_dir")          # ReportError when nothing in it is usable
    html_text = report.render_html(page)

A dump directory is what ``XLA_PASSES_DUMP_TO`` (the xla_passes pipeline),
XLA's ``--xla_dump_to`` (with or without ``--xla_dump_hlo_pass_re``) or
``hlo-tools dump`` wrote.  Its HLO files form one timeline per module:

* xla_passes: ``module_NNNN.<name>.before_xla_passes.txt``, then
  ``module_NNNN.<name>.KKKK.after_<pass>.txt`` for each pass that ran, with the
  pass's report lines (weight-update-sharding's per-weight lines) as ``// ``
  comments at the top;
* XLA: ``module_NNNN.<name>.before_optimizations.txt``, then
  ``module_NNNN.<name>.KKKK.<pipeline>.after_<pass>[.before_<next>].txt`` for
  each pass that changed the module, then
  ``module_NNNN.<name>.<compiler>_after_optimizations.txt``.

Every other file (buffer assignments, LLVM IR, ...) is ignored.  Each step is
compared with the step before it through :func:`hlo_tools.inspection.diff.diff_modules`;
a step that changed something gets the counts that moved, side-by-side SVG
graphs of the neighbourhood that changed (:mod:`hlo_tools.inspection.graph`), the diff as
text, and the report lines.  Each module also gets IR statistics
(:func:`hlo_tools.inspection.stats.module_stats`) of its first and last step; nothing is
compiled, so any dump, however large, reports quickly.

The page lists the modules that some step changed (or that have an unreadable
file) first; the others are folded into one line at the end.  ``module_pattern``
keeps only the modules whose name or a file name matches it.  Each graph opens
scrolled to what changed (a small inline script, allowed by its hash in the
page's Content-Security-Policy), and each changing step has a side panel of its
changed instructions with links to their nodes and to their lines in the diff.

A file that does not parse becomes a warning on the page and the timeline
skips it; a directory where nothing parses is a :class:`ReportError`.
Durations are not recorded in dumps; the timeline shows the time between a
step's file and the previous one (file modification times), which bounds
what the pass took from above.
"""

from __future__ import annotations

import base64
import bisect
import collections
import dataclasses
import difflib
import hashlib
import html
import os
import re

from hlo_tools.inspection import cost_model, graph
from hlo_tools.inspection.cost_model import Machine
from hlo_tools.inspection.diff import ComputationDiff, ModuleDiff, diff_modules
from hlo_tools.ir.errors import HloParseError, one_line
from hlo_tools.ir.hlo import HloModule
from hlo_tools.ir.parser import parse_module
from hlo_tools.inspection.stats import ModuleStats, module_stats

__all__ = ["ReportError", "DumpFile", "ModuleTimeline", "Step", "GraphPair", "Change", "Snapshot", "Report",
           "classify", "scan_dump", "select_modules", "build_report", "render_html", "unified_diff", "plural"]

DEFAULT_HOPS = 1
DEFAULT_MAX_NODES = 60          # per graph; a pass gets a before and an after graph per computation
MAX_GRAPHED_COMPUTATIONS = 3    # per pass: the entry first, then the most changed
MAX_DIFF_LINES = 400            # per text diff; the rest is counted
MAX_NOTES_IN_TIMELINE = 3
MAX_LISTED_CHANGES = 40         # per computation in a step's side panel; the rest is counted
MAX_FOLDED_NAMES = 12           # module names in the line that folds the unchanged modules

XLA_PASSES, XLA = "xla_passes", "xla"

_NUMBER = r"module_(?P<number>\d+)\.(?P<name>.+)"
_DUMP_PATTERNS = (
    # XLA's between-pass dumps first: XLA has a pipeline called after_layout_assignment, whose
    # files the xla_passes pattern below would also read (with a pass name full of dots).
    (XLA, "pass", re.compile(_NUMBER + r"\.(?P<step>\d{4,})\.(?P<pipeline>[^.]+)\.after_(?P<pass_name>[^.]+)"
                             r"(?:\.before_[^.]+)?\.txt")),
    (XLA, "before", re.compile(_NUMBER + r"\.before_optimizations\.txt")),
    # The compiler prefix: cpu_, or the GPU's name such as sm_9.0_gpu_.
    # The name is the shortest that leaves a valid prefix, as a GPU's name has dots of its own.
    (XLA, "after", re.compile(r"module_(?P<number>\d+)\.(?P<name>.+?)\.(?P<compiler>[\w.]*gpu_|[A-Za-z]\w*_)?"
                              r"after_optimizations\.txt")),
    (XLA_PASSES, "before", re.compile(_NUMBER + r"\.before_xla_passes\.txt")),
    (XLA_PASSES, "pass", re.compile(_NUMBER + r"\.(?P<step>\d{4,})\.after_(?P<pass_name>.+)\.txt")),
)
_STAGE_ORDER = {"before": 0, "pass": 1, "after": 2}


class ReportError(Exception):
    """The directory cannot give a report (missing, or nothing in it is a readable HLO dump)."""


@dataclasses.dataclass
class DumpFile:
    """One HLO file of a dump, as its name describes it."""

    path: str
    number: int
    name: str                 # the module name as in the file name (XLA-sanitized)
    source: str               # xla_passes or xla
    stage: str                # before, pass or after
    step: int | None = None   # KKKK of a pass dump
    pass_name: str | None = None
    pipeline: str | None = None
    compiler: str | None = None

    @property
    def label(self) -> str:
        """What the file holds, in a few words."""
        if self.stage == "before":
            return "before_xla_passes" if self.source == XLA_PASSES else "before_optimizations"
        if self.stage == "after":
            return f"{self.compiler or ''}after_optimizations"
        return f"{self.pipeline}: {self.pass_name}" if self.pipeline else str(self.pass_name)


def classify(path: str) -> DumpFile | None:
    """The dump file ``path`` names, or None when it is not an HLO dump of a known kind."""
    base = os.path.basename(path)
    for source, stage, pattern in _DUMP_PATTERNS:
        match = pattern.fullmatch(base)
        if match:
            fields = match.groupdict()
            step = fields.get("step")
            return DumpFile(path=path, number=int(fields["number"]), name=fields["name"], source=source,
                            stage=stage, step=int(step) if step else None, pass_name=fields.get("pass_name"),
                            pipeline=fields.get("pipeline"), compiler=fields.get("compiler"))
    return None


def scan_dump(directory: str) -> dict[tuple[int, str, str], list[DumpFile]]:
    """The HLO files of ``directory`` by module (number, name, source), each list in timeline order."""
    if not os.path.exists(directory):
        raise ReportError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise ReportError(f"{directory}: not a directory")
    modules: dict[tuple[int, str, str], list[DumpFile]] = collections.defaultdict(list)
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        found = classify(path)
        if found is not None and os.path.isfile(path):
            modules[(found.number, found.name, found.source)].append(found)
    for files in modules.values():
        files.sort(key=lambda f: (_STAGE_ORDER[f.stage], f.step or 0))
    return dict(sorted(modules.items(), key=lambda item: (item[0][0], item[0][2], item[0][1])))


# --- analysis ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Snapshot:
    """One dump file read: its module (until the next step no longer needs it), or why it
    could not be read."""

    file: DumpFile
    text: str | None
    module: HloModule | None
    notes: list[str]          # the `// ` report lines at the top of the file
    error: str | None
    mtime: float
    instructions: int | None = None  # in every computation, when it parsed
    estimated_step_s: float | None = None  # on the report's machine, when asked and priced
    estimate_note: str | None = None       # why it could not be priced

    def release(self) -> None:
        """Drop the text and the IR: a dump of a big module holds dozens of steps."""
        self.text = self.module = None


@dataclasses.dataclass
class Change:
    """One instruction a diff marks, by its name on each side (None where it is not there)."""

    status: str               # added, removed or changed
    before: str | None
    after: str | None

    @property
    def name(self) -> str:
        return self.after or self.before


@dataclasses.dataclass
class GraphPair:
    """Before and after SVGs of one computation a pass changed, and what changed in it."""

    title: str
    before_svg: str | None
    after_svg: str | None
    before_nodes: list[str]   # in drawing order: the i-th is graph.node_id(before_id, i)
    after_nodes: list[str]
    before_id: str            # the id prefix of each side's SVG
    after_id: str
    changes: list[Change]


@dataclasses.dataclass
class Step:
    """One step of a timeline, compared with the last step before it that parsed."""

    snapshot: Snapshot
    previous: Snapshot | None
    diff: ModuleDiff | None = None       # None: first step, unparsable, or the text did not change
    graphs: list[GraphPair] = dataclasses.field(default_factory=list)
    graph_notes: list[str] = dataclasses.field(default_factory=list)
    text_diff: list[str] = dataclasses.field(default_factory=list)
    text_diff_hidden: int = 0

    @property
    def changed(self) -> bool:
        return self.diff is not None and not self.diff.identical

    @property
    def seconds(self) -> float | None:
        """Time since the previous dump file was written, when that moved forward."""
        if self.previous is None:
            return None
        delta = self.snapshot.mtime - self.previous.mtime
        return delta if delta >= 0 else None


@dataclasses.dataclass
class ModuleTimeline:
    number: int
    name: str
    source: str
    steps: list[Step]
    first_stats: ModuleStats | None
    last_stats: ModuleStats | None
    overview_svg: str | None  # the entry of the last step, when no step changed anything

    @property
    def title(self) -> str:
        return f"module_{self.number:04d} {self.name} ({self.source})"

    @property
    def changed(self) -> bool:
        return any(step.changed for step in self.steps)

    @property
    def unreadable(self) -> bool:
        return any(step.snapshot.error for step in self.steps)


@dataclasses.dataclass
class Report:
    directory: str
    modules: list[ModuleTimeline]
    warnings: list[str]
    ignored_files: int
    module_pattern: str | None = None
    unselected_modules: int = 0  # modules of the dump that module_pattern left out
    machine: Machine | None = None


def _read(file: DumpFile) -> Snapshot:
    base = os.path.basename(file.path)
    try:
        mtime = os.stat(file.path).st_mtime
        with open(file.path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        return Snapshot(file, None, None, [], f"{base}: not UTF-8 text ({exc.reason} at byte {exc.start})", 0.0)
    except OSError as exc:
        return Snapshot(file, None, None, [], f"{base}: {exc.strerror or one_line(str(exc))}", 0.0)
    notes = [line[2:].strip() for line in text[:_REPORT_LINES.match(text).end()].splitlines()]
    try:
        module = parse_module(text)
    except HloParseError as exc:
        return Snapshot(file, text, None, notes, f"{base}:{exc.line}:{exc.column}: {one_line(exc.message)}",
                        mtime)
    except Exception as exc:  # noqa: BLE001 - a parser bug on one file must not lose the whole report
        return Snapshot(file, text, None, notes, f"{base}: {type(exc).__name__}: {one_line(str(exc))}", mtime)
    return Snapshot(file, text, module, notes, None, mtime,
                    instructions=sum(len(c.instructions) for c in module.computations))


_REPORT_LINES = re.compile(r"(?://[^\n]*\n)*")


def _module_body(text: str) -> str:
    """The text without the report lines at the top, for a quick 'nothing changed' check."""
    return text[_REPORT_LINES.match(text).end():]


def select_modules(groups: dict[tuple[int, str, str], list[DumpFile]],
                   pattern: str) -> dict[tuple[int, str, str], list[DumpFile]]:
    """The modules whose name, or the name of one of whose files, ``pattern`` (a regular
    expression) finds; a ReportError when it is not one or finds none, so that a typo never
    gives an empty page."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ReportError(f"--module {pattern!r}: not a regular expression ({exc})") from None
    chosen = {key: files for key, files in groups.items()
              if regex.search(key[1]) or any(regex.search(os.path.basename(f.path)) for f in files)}
    if not chosen:
        names = list(dict.fromkeys(name for _, name, _ in groups))
        shown = ", ".join(names[:MAX_FOLDED_NAMES]) + (", ..." if len(names) > MAX_FOLDED_NAMES else "")
        raise ReportError(f"--module {pattern!r} matches none of the {plural(len(groups), 'module')} "
                          f"(by name or file name): {shown}")
    return chosen


def build_report(directory: str, *, hops: int = DEFAULT_HOPS, max_nodes: int = DEFAULT_MAX_NODES,
                 layout: str = "auto", module_pattern: str | None = None, machine: Machine | None = None) -> Report:
    """Read the HLO dumps in ``directory`` (of the modules ``module_pattern`` selects, or all)
    and compare each step with the one before; ``layout`` is :data:`hlo_tools.inspection.graph.LAYOUTS`'s.
    With a ``machine``, every step of a per-device module gets its estimated step time there
    (the cost model's IR estimate: compiling every step with XLA would take minutes)."""
    groups = scan_dump(directory)
    if not groups:
        raise ReportError(f"{directory}: no HLO dumps (module_NNNN.<name>.before_optimizations.txt, "
                          f"..._after_optimizations.txt, before_xla_passes.txt or per-pass files)")
    dump_files = sum(len(files) for files in groups.values())
    selected = groups if module_pattern is None else select_modules(groups, module_pattern)
    layout = graph.resolve_layout(layout)  # LayoutError now, not after reading the dump
    warnings: list[str] = []
    modules = []
    parsed_any = False
    for (number, name, source), files in selected.items():
        timeline = _timeline(number, name, source, files, hops, max_nodes, layout, machine)
        warnings += [step.snapshot.error for step in timeline.steps if step.snapshot.error]
        parsed_any |= timeline.last_stats is not None
        modules.append(timeline)
    if not parsed_any:
        raise ReportError(f"{directory}: none of the {sum(map(len, selected.values()))} HLO dumps could be read "
                          f"(first: {warnings[0]})")
    return Report(directory, modules, warnings, ignored_files=len(os.listdir(directory)) - dump_files,
                  module_pattern=module_pattern, unselected_modules=len(groups) - len(selected), machine=machine)


def _price(snapshot: Snapshot, machine: Machine) -> None:
    try:
        snapshot.estimated_step_s = machine.step_time_s(snapshot.module)
    except cost_model.CostModelError as exc:
        snapshot.estimate_note = one_line(str(exc))


def _timeline(number: int, name: str, source: str, files: list[DumpFile], hops: int,
              max_nodes: int, layout: str, machine: Machine | None = None) -> ModuleTimeline:
    steps: list[Step] = []
    previous: Snapshot | None = None  # the last step that parsed
    first_stats = last_stats = overview = None
    for file in files:
        snapshot = _read(file)
        step = Step(snapshot, previous)
        if snapshot.module is not None and machine is not None:
            _price(snapshot, machine)
        if snapshot.module is not None:
            if previous is None:
                first_stats = module_stats(snapshot.module)
            else:
                if _module_body(previous.text) != _module_body(snapshot.text):
                    _compare(step, hops, max_nodes, layout)
                previous.release()
            previous = snapshot
        steps.append(step)
    if previous is not None:
        last_stats = module_stats(previous.module)
        if not any(step.changed for step in steps):
            overview = graph.render_svg(graph.computation_graph(previous.module.entry, max_nodes=max_nodes * 2),
                                        id_prefix=f"m{number}-{source}-overview", layout=layout)
        previous.release()
    return ModuleTimeline(number, name, source, steps, first_stats, last_stats, overview)


def _compare(step: Step, hops: int, max_nodes: int, layout: str) -> None:
    old, new = step.previous.module, step.snapshot.module
    step.diff = diff_modules(old, new)
    if step.diff.identical:
        return
    changed = [c for c in step.diff.computations if c.status == "changed"]
    changed.sort(key=lambda c: (not c.is_entry, -(len(c.added) + len(c.removed) + len(c.changed))))
    prefix = re.sub(r"\W", "-", f"m{step.snapshot.file.number}-{step.snapshot.file.source}-"
                                f"{step.snapshot.file.step or step.snapshot.file.stage}")
    for index, comp in enumerate(changed[:MAX_GRAPHED_COMPUTATIONS]):
        step.graphs.append(_graph_pair(old, new, comp, hops, max_nodes, f"{prefix}-{index}", layout))
    if len(changed) > MAX_GRAPHED_COMPUTATIONS:
        step.graph_notes.append(f"{len(changed) - MAX_GRAPHED_COMPUTATIONS} more changed computations "
                                f"not drawn: {', '.join(c.new for c in changed[MAX_GRAPHED_COMPUTATIONS:])}")
    for status in ("added", "removed"):
        comps = [c for c in step.diff.computations if c.status == status]
        if comps:
            listed = ", ".join(f"{c.new or c.old} ({c.instructions})" for c in comps)
            step.graph_notes.append(f"{plural(len(comps), 'computation')} {status} (instructions): {listed}")
    lines = unified_diff(_module_body(step.previous.text).splitlines(), _module_body(step.snapshot.text).splitlines(),
                         os.path.basename(step.previous.file.path), os.path.basename(step.snapshot.file.path))
    step.text_diff = lines[:MAX_DIFF_LINES]
    step.text_diff_hidden = max(len(lines) - MAX_DIFF_LINES, 0)


def unified_diff(old: list[str], new: list[str], old_label: str, new_label: str, context: int = 2) -> list[str]:
    """``difflib.unified_diff``'s lines, matched as patience diff does: the lines that occur once
    in each side anchor the match (their longest run in the same order), difflib matches what lies
    between anchors.  difflib alone takes seconds on a 10,000-line module that a pass rewrote all
    over; anchored, the gaps it sees are short."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    matcher.matching_blocks = _anchored_blocks(old, new)  # what get_opcodes() reads
    out = []
    for group in matcher.get_grouped_opcodes(context):
        if not out:
            out += [f"--- {old_label}", f"+++ {new_label}"]
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{_hunk_range(i1, i2)} +{_hunk_range(j1, j2)} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in old[a1:a2]]
                continue
            out += ["-" + line for line in old[a1:a2]]
            out += ["+" + line for line in new[b1:b2]]
    return out


def _hunk_range(start: int, stop: int) -> str:
    """A hunk's line range as unified diffs write it: 1-based, ``start,count``, an empty one before its line."""
    count = stop - start
    if count == 1:
        return str(start + 1)
    return f"{start + 1 if count else start},{count}"


def _anchored_blocks(old: list[str], new: list[str]) -> list[tuple[int, int, int]]:
    """Matching blocks (i, j, size) in order, adjacent ones merged, ending with (len(old), len(new), 0)."""
    counts = collections.Counter(old)
    in_new = collections.Counter(new)
    where_new = {line: j for j, line in enumerate(new) if in_new[line] == 1}
    pairs = [(i, where_new[line]) for i, line in enumerate(old) if counts[line] == 1 and line in where_new]
    # The longest run of pairs increasing in j (pairs already increase in i): patience sorting.
    tail_js: list[int] = []  # tail_js[k]: the smallest j that ends an increasing run of length k + 1
    tails: list[int] = []    # tails[k]: that pair's index
    previous = [-1] * len(pairs)
    for index, (_, j) in enumerate(pairs):
        k = bisect.bisect_left(tail_js, j)
        previous[index] = tails[k - 1] if k else -1
        tails[k:k + 1], tail_js[k:k + 1] = [index], [j]
    anchors = []
    at = tails[-1] if tails else -1
    while at >= 0:
        anchors.append(pairs[at])
        at = previous[at]
    blocks: list[tuple[int, int, int]] = []
    i0 = j0 = 0
    for i, j in [*reversed(anchors), (len(old), len(new))]:
        gap = difflib.SequenceMatcher(None, old[i0:i], new[j0:j], autojunk=False).get_matching_blocks()
        blocks += [(i0 + a, j0 + b, size) for a, b, size in gap if size]
        if i < len(old):
            blocks.append((i, j, 1))
        i0, j0 = i + 1, j + 1
    merged: list[tuple[int, int, int]] = []
    for i, j, size in blocks:
        if merged and merged[-1][0] + merged[-1][2] == i and merged[-1][1] + merged[-1][2] == j:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + size)
        else:
            merged.append((i, j, size))
    return merged + [(len(old), len(new), 0)]


def _graph_pair(old: HloModule, new: HloModule, comp: ComputationDiff, hops: int, max_nodes: int,
                id_prefix: str, layout: str) -> GraphPair:
    """Each side's changes (and what the other side changed, where that name exists here)
    plus ``hops`` of context."""
    old_comp, new_comp = old.computation(comp.old), new.computation(comp.new)
    old_status = {name: "removed" for name, _ in comp.removed}
    old_status.update({c.old: "changed" for c in comp.changed})
    new_status = {name: "added" for name, _ in comp.added}
    new_status.update({c.new: "changed" for c in comp.changed})
    old_names = {i.name for i in old_comp.instructions}
    new_names = {i.name for i in new_comp.instructions}
    old_focus = list(old_status) + [n for n in new_status if n in old_names and n not in old_status]
    new_focus = list(new_status) + [n for n in old_status if n in new_names and n not in new_status]
    title = comp.new if comp.old == comp.new else f"{comp.old} -> {comp.new}"
    changes = ([Change("removed", name, None) for name, _ in comp.removed]
               + [Change("added", None, name) for name, _ in comp.added]
               + [Change("changed", c.old, c.new) for c in comp.changed])
    pair = GraphPair(title, None, None, [], [], f"{id_prefix}-b", f"{id_prefix}-a", changes)
    if old_focus:
        g = graph.computation_graph(old_comp, focus=old_focus, hops=hops, max_nodes=max_nodes,
                                    status=old_status, title=f"before: {comp.old}")
        pair.before_svg = graph.render_svg(g, pair.before_id, layout)
        pair.before_nodes = [n.name for n in g.nodes]
    if new_focus:
        g = graph.computation_graph(new_comp, focus=new_focus, hops=hops, max_nodes=max_nodes,
                                    status=new_status, title=f"after: {comp.new}")
        pair.after_svg = graph.render_svg(g, pair.after_id, layout)
        pair.after_nodes = [n.name for n in g.nodes]
    return pair


# --- HTML ---------------------------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1500px; padding: 0 20px 40px;
       color: #212529; }
h1 { font-size: 22px; } h2 { font-size: 18px; border-bottom: 2px solid #dee2e6; padding-top: 12px; }
h3 { font-size: 15px; margin-bottom: 4px; }
code, pre { font-family: ui-monospace, monospace; font-size: 12px; }
pre { background: #f8f9fa; padding: 8px; overflow: auto; max-height: 480px; }
table { border-collapse: collapse; margin: 6px 0 12px; }
th, td { border: 1px solid #dee2e6; padding: 2px 8px; text-align: left; vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.changed td { background: #fff9db; }
.warnings { background: #fff5f5; border: 1px solid #ffc9c9; padding: 6px 12px; }
ol.timeline { display: flex; flex-wrap: wrap; gap: 4px; list-style: none; padding: 0; }
ol.timeline li { border: 1px solid #ced4da; border-radius: 4px; padding: 1px 6px; font-size: 12px; }
ol.timeline li.changed { background: #ffe8cc; border-color: #e67700; }
ol.timeline li.error { background: #ffe3e3; border-color: #c92a2a; }
ol.timeline li.unchanged { color: #868e96; }
.pass-body { display: grid; grid-template-columns: minmax(0, 1fr) 250px; gap: 10px; align-items: start; }
aside.changes { position: sticky; top: 36px; max-height: 85vh; overflow: auto; font-size: 12px;
                border: 1px solid #dee2e6; padding: 4px 8px; background: #f8f9fa; }
aside.changes h5 { margin: 6px 0 2px; font-size: 12px; }
aside.changes ul { list-style: none; padding: 0; margin: 0; }
aside.changes li { margin: 2px 0; overflow-wrap: anywhere; }
aside.changes .added { color: #2b8a3e; } aside.changes .removed { color: #c92a2a; }
aside.changes .changed { color: #e67700; }
g.node:target > rect { stroke: #1c7ed6; stroke-width: 5; }
pre span:target { background: #ffec99; }
.pair { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 10px; }
.side { border: 1px solid #dee2e6; overflow: auto; max-height: 720px; background: #fff; }
.side h4 { margin: 0; padding: 4px 8px; font-size: 13px; position: sticky; top: 0; left: 0;
           background: #fff; z-index: 1; width: fit-content; }
.notes { color: #495057; font-size: 12px; margin: 0; }
.delta-pos { color: #2b8a3e; } .delta-neg { color: #c92a2a; }
label.fit { position: sticky; top: 0; display: inline-block; background: #fff; padding: 4px 8px;
            border: 1px solid #dee2e6; border-radius: 4px; z-index: 1; font-size: 13px; }
#fit:checked ~ section svg.hlo-graph { max-width: 100%; height: auto; }
"""


# Scrolls every graph box to what changed in it at load, so that the graphs stay at 100% (readable)
# and still open on the change: the centre of the marked nodes when they fit in the box, else the
# first of them. And opens the text diff before a side panel's diff link goes to a line in it (not
# every browser opens a closed <details> for a link into it). The page's Content-Security-Policy
# allows this script by its hash, and no other.
_SCRIPT = """
for (const box of document.querySelectorAll('.side')) {
  const rects = [...box.querySelectorAll('g.node.added, g.node.removed, g.node.changed')]
    .map(node => node.getBoundingClientRect());
  if (!rects.length) continue;
  const union = rects.reduce((u, r) => ({left: Math.min(u.left, r.left), top: Math.min(u.top, r.top),
                                         right: Math.max(u.right, r.right), bottom: Math.max(u.bottom, r.bottom)}));
  const fits = union.right - union.left <= box.clientWidth && union.bottom - union.top <= box.clientHeight;
  const target = fits ? union : rects[0];
  const origin = box.getBoundingClientRect();
  box.scrollLeft += (target.left + target.right) / 2 - origin.left - box.clientLeft - box.clientWidth / 2;
  box.scrollTop += (target.top + target.bottom) / 2 - origin.top - box.clientTop - box.clientHeight / 2;
}
for (const link of document.querySelectorAll('aside.changes a.diff')) {
  link.addEventListener('click', () => { document.getElementById(link.hash.slice(1)).closest('details').open = true; });
}
"""
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()


def plural(count: int, noun: str) -> str:
    """``1 module``, ``2 modules``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _num(value) -> str:
    return f"{value:,}" if isinstance(value, int) else _esc(value)


def _delta(old: int, new: int) -> str:
    if old == new:
        return f"{new:,}"
    cls = "delta-pos" if new > old else "delta-neg"
    return f'{old:,} &rarr; {new:,} <span class="{cls}">({new - old:+,})</span>'


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset(),
           row_classes: list[str] | None = None) -> str:
    """A table of cells that are already HTML."""
    head = "".join(f'<th{" class=num" if i in numeric else ""}>{_esc(h)}</th>' for i, h in enumerate(header))
    body = []
    for r, row in enumerate(rows):
        cls = f' class="{row_classes[r]}"' if row_classes and row_classes[r] else ""
        cells = "".join(f'<td{" class=num" if i in numeric else ""}>{cell}</td>' for i, cell in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(report: Report) -> str:
    """The report as one HTML page: inline CSS, SVG and one script, nothing fetched.

    Modules that changed (or have an unreadable file) come first, in dump order; the others
    are folded into one ``<details>`` at the end, its summary naming them (open when there is
    nothing else to show)."""
    title = f"HLO dump report: {report.directory}"
    anchored = [(f"module-{index}", m) for index, m in enumerate(report.modules)]
    shown = [(anchor, m) for anchor, m in anchored if m.changed or m.unreadable]
    folded = [(anchor, m) for anchor, m in anchored if not (m.changed or m.unreadable)]
    selection = (f" matching --module <code>{_esc(report.module_pattern)}</code> "
                 f"({report.unselected_modules:,} more not selected)" if report.module_pattern else "")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
           f"style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{_SCRIPT_HASH}'\">",
           f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{_esc(title)}</h1>",
           f"<p>{plural(len(report.modules), 'module')}{selection}, "
           f"{sum(m.changed for m in report.modules):,} changed; "
           f"{plural(report.ignored_files, 'other file')} in the directory ignored "
           f"(buffer assignments, LLVM IR, ...). Graphs show each changed computation's changed "
           f"instructions and their neighbours, scrolled to the change; hover a node for its instruction.</p>"]
    if report.machine is not None:
        out.append(f"<p>Estimated step times are for {_esc(report.machine.describe())}: the cost model's IR "
                   f"estimate (docs/cost_model.md), per-device modules only.</p>")
    if report.warnings:
        out.append('<div class="warnings"><strong>Warnings</strong><ul>')
        out += [f"<li>{_esc(w)}</li>" for w in report.warnings]
        out.append("</ul></div>")
    out.append("<h2>Modules</h2>")
    if shown:
        out.append(_contents(shown))
    if folded:
        out.append(f'<p><a href="#unchanged-modules">{_esc(_folded_line(folded))}</a> (folded at the end)</p>')
    # A checkbox and CSS, no script: shrink every graph to its box, or show it at full size.
    out.append('<input type="checkbox" id="fit"><label class="fit" for="fit">fit graphs to width</label>')
    out += [_module_html(module, anchor) for anchor, module in shown]
    if folded:
        out.append(f'<details id="unchanged-modules"{"" if shown else " open"}>'
                   f'<summary>{_esc(_folded_line(folded))}</summary>')
        out.append(_contents(folded))
        out += [_module_html(module, anchor) for anchor, module in folded]
        out.append("</details>")
    out.append(f"<script>{_SCRIPT}</script>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _folded_line(modules: list[tuple[str, ModuleTimeline]]) -> str:
    """``21 unchanged modules: jit__normal, jit_broadcast_in_dim, ...``"""
    names = list(dict.fromkeys(m.name for _, m in modules))
    listed = ", ".join(names[:MAX_FOLDED_NAMES]) + (", ..." if len(names) > MAX_FOLDED_NAMES else "")
    return f"{plural(len(modules), 'unchanged module')}: {listed}"


def _contents(modules: list[tuple[str, ModuleTimeline]]) -> str:
    """The table of contents of (anchor, module)s."""
    rows = []
    for anchor, m in modules:
        changed = sum(1 for s in m.steps if s.changed)
        first, last = m.first_stats, m.last_stats
        rows.append([f'<a href="#{anchor}">{_esc(m.title)}</a>', _num(len(m.steps)), _num(changed),
                     _delta(first.instructions, last.instructions) if first else "-",
                     _delta(len(first.collectives), len(last.collectives)) if first else "-"])
    return _table(["module", "steps", "changed", "instructions", "collectives"], rows, numeric={1, 2, 3, 4})


def _module_html(m: ModuleTimeline, anchor: str) -> str:
    out = [f'<section class="module" id="{anchor}"><h2>{_esc(m.title)}</h2>']
    out.append('<ol class="timeline">')
    for j, step in enumerate(m.steps):
        cls = "error" if step.snapshot.error else "changed" if step.changed else "unchanged"
        label = _esc(step.snapshot.file.label)
        link = f'<a href="#{anchor}-step-{j}">{label}</a>' if step.changed else label
        out.append(f'<li class="{cls}">{link}</li>')
    out.append("</ol>")
    out.append(_timeline_table(m, anchor))
    out.append(_stats_html(m))
    if m.overview_svg:
        out.append("<h3>Entry computation (no step changed the module)</h3>")
        out.append(f'<div class="side">{m.overview_svg}</div>')
    for j, step in enumerate(m.steps):
        if step.changed:
            out.append(_step_html(step, f"{anchor}-step-{j}"))
    out.append("</section>")
    return "\n".join(out)


def _timeline_table(m: ModuleTimeline, anchor: str) -> str:
    rows, classes = [], []
    for j, step in enumerate(m.steps):
        snap = step.snapshot
        file = snap.file
        label = f'<span title="{_esc(os.path.basename(file.path))}">{_esc(file.label)}</span>'
        name = f'<a href="#{anchor}-step-{j}">{label}</a>' if step.changed else label
        if snap.error:
            what = f'<span class="delta-neg">unreadable: {_esc(snap.error)}</span>'
        elif step.previous is None:
            what = "start"
        elif not step.changed:
            what = "unchanged"
        else:
            s = step.diff.summary()
            what = (f"+{s['instructions_added']} &minus;{s['instructions_removed']} "
                    f"~{s['instructions_changed']} instructions")
            if s["computations_added"] or s["computations_removed"]:
                what += f"; +{s['computations_added']} &minus;{s['computations_removed']} computations"
            if step.diff.header:
                what += "; header: " + _esc(", ".join(key for key, _, _ in step.diff.header))
        sizes = "-"
        if snap.instructions is not None:
            sizes = (_delta(step.previous.instructions, snap.instructions) if step.previous
                     else f"{snap.instructions:,}")
        seconds = "-" if step.seconds is None else f"{step.seconds * 1000:.0f} ms"
        notes = snap.notes[:MAX_NOTES_IN_TIMELINE]
        notes_html = "".join(f'<div class="notes">{_esc(n)}</div>' for n in notes)
        if len(snap.notes) > len(notes):
            notes_html += f'<div class="notes">... {len(snap.notes) - len(notes)} more</div>'
        rows.append([str(file.step) if file.step is not None else "", name, what, sizes, seconds, notes_html])
        classes.append("changed" if step.changed else "")
    header = ["step", "pass", "what changed", "instructions", "since previous dump", "report"]
    numeric = {0, 3, 4}
    if any(step.snapshot.estimated_step_s is not None or step.snapshot.estimate_note for step in m.steps):
        first = next((step.snapshot.estimated_step_s for step in m.steps
                      if step.snapshot.estimated_step_s is not None), None)
        header.insert(4, "estimated step")
        for row, step in zip(rows, m.steps):
            row.insert(4, _estimate_cell(step.snapshot, first))
        numeric.add(5)
    return _table(header, rows, numeric=numeric, row_classes=classes)


def _estimate_cell(snapshot: Snapshot, first: float | None) -> str:
    """A step's estimated time, with its ratio to the first priced step's."""
    if snapshot.estimated_step_s is None:
        return f'<span title="{_esc(snapshot.estimate_note or "")}">-</span>'
    ratio = f" ({snapshot.estimated_step_s / first:.2f}x)" if first else ""
    return f"{snapshot.estimated_step_s * 1e3:.3g} ms{ratio}"


def _stats_html(m: ModuleTimeline) -> str:
    first, last = m.first_stats, m.last_stats
    if first is None:
        return "<p>No step of this module could be read.</p>"
    out = ["<h3>Statistics: first step &rarr; last step</h3>"]
    overview = [("computations", len(first.computations), len(last.computations)),
                ("instructions", first.instructions, last.instructions),
                ("entry instructions", first.entry.instructions, last.entry.instructions),
                ("fusions", first.fusions, last.fusions),
                ("collectives", len(first.collectives), len(last.collectives)),
                ("collective bytes moved", sum(c.bytes_moved for c in first.collectives),
                 sum(c.bytes_moved for c in last.collectives)),
                ("entry parameter bytes", first.parameter_bytes, last.parameter_bytes),
                ("entry output bytes", first.output_bytes, last.output_bytes),
                ("constant bytes", first.constant_bytes, last.constant_bytes)]
    out.append(_table(["", "first", "last"], [[_esc(k), _num(a), _num(b)] for k, a, b in overview],
                      numeric={1, 2}, row_classes=["changed" if a != b else "" for _, a, b in overview]))
    before = {s.kind: s for s in first.collective_summary()}
    after = {s.kind: s for s in last.collective_summary()}
    if before or after:
        rows, classes = [], []
        for kind in sorted(before.keys() | after.keys()):
            a, b = before.get(kind), after.get(kind)
            pairs = [(getattr(a, field, 0), getattr(b, field, 0)) for field in ("count", "buffers", "bytes_moved")]
            groups = list(dict.fromkeys((a.groups if a else []) + (b.groups if b else [])))
            rows.append([_esc(kind), *(_delta(x, y) for x, y in pairs), _esc(", ".join(groups)[:200])])
            classes.append("changed" if any(x != y for x, y in pairs) else "")
        out.append(_table(["collective", "count", "buffers", "bytes moved", "replica groups"], rows,
                          numeric={1, 2, 3}, row_classes=classes))
    else:
        out.append("<p>No collectives.</p>")
    a_ops, b_ops = first.opcodes, last.opcodes
    ops = sorted(a_ops.keys() | b_ops.keys(), key=lambda op: (a_ops[op] == b_ops[op], -b_ops[op], op))
    rows = [[_esc(op), _num(a_ops[op]), _num(b_ops[op]), f"{b_ops[op] - a_ops[op]:+,}" if a_ops[op] != b_ops[op]
             else ""] for op in ops]
    out.append(f"<details{' open' if len(ops) <= 15 else ''}><summary>Opcodes ({len(ops)})</summary>")
    out.append(_table(["opcode", "first", "last", "change"], rows, numeric={1, 2, 3},
                      row_classes=["changed" if a_ops[op] != b_ops[op] else "" for op in ops]))
    out.append("</details>")
    return "\n".join(out)


def _step_html(step: Step, anchor: str) -> str:
    file = step.snapshot.file
    out = [f'<section class="pass" id="{anchor}"><h3>{_esc(file.label)}'
           f'{f" (step {file.step})" if file.step is not None else ""}</h3>',
           f"<p>compared with <code>{_esc(os.path.basename(step.previous.file.path))}</code></p>"]
    if step.diff.opcodes:
        out.append("<p>opcodes: " + ", ".join(f"{_esc(op)} {_delta(a, b)}" for op, (a, b)
                                              in step.diff.opcodes.items()) + "</p>")
    if step.snapshot.notes:
        out.append(f"<pre class=\"report-lines\">{_esc(chr(10).join(step.snapshot.notes))}</pre>")
    diff_html, diff_lines = _text_diff_html(step.text_diff, f"{anchor}-diff")
    if step.graphs:
        out.append('<div class="pass-body"><div>')
    for pair in step.graphs:
        out.append(f"<h4>computation {_esc(pair.title)}</h4><div class=\"pair\">")
        for side, svg in (("before", pair.before_svg), ("after", pair.after_svg)):
            body = svg or f"<p>nothing of this computation changed on the {side} side</p>"
            out.append(f'<div class="side {side}"><h4>{side}</h4>{body}</div>')
        out.append("</div>")
    if step.graphs:
        out.append(f"</div>{_changes_panel(step.graphs, diff_lines)}</div>")
    out += [f'<p class="notes">{_esc(n)}</p>' for n in step.graph_notes]
    structural = step.diff.format(os.path.basename(step.previous.file.path),
                                  os.path.basename(file.path)).splitlines()
    shown = structural[:MAX_DIFF_LINES]
    more = f"\n... {len(structural) - len(shown)} more lines" if len(structural) > len(shown) else ""
    out.append(f"<details><summary>structural diff (hlo-tools diff)</summary>"
               f"<pre>{_esc(chr(10).join(shown) + more)}</pre></details>")
    more = f"\n... {step.text_diff_hidden} more lines" if step.text_diff_hidden else ""
    out.append(f"<details><summary>text diff</summary><pre>{diff_html}{more}</pre></details>")
    out.append("</section>")
    return "\n".join(out)


_DEFINITION = re.compile(r"([-+])\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s")


def _text_diff_html(lines: list[str], id_prefix: str) -> tuple[str, dict[tuple[str, str], str]]:
    """The text diff as HTML, each removed or added instruction's first line an anchor; and
    (sign, name) -> that anchor's id."""
    anchors: dict[tuple[str, str], str] = {}
    out = []
    for number, line in enumerate(lines):
        match = _DEFINITION.match(line) if not line.startswith(("---", "+++")) else None
        if match and match.groups() not in anchors:
            anchors[match.groups()] = f"{id_prefix}-{number}"
            out.append(f'<span id="{anchors[match.groups()]}">{_esc(line)}</span>')
        else:
            out.append(_esc(line))
    return "\n".join(out), anchors


def _changes_panel(pairs: list[GraphPair], diff_lines: dict[tuple[str, str], str]) -> str:
    """The side panel: per graphed computation, its changed instructions, each linking to its
    node in the before and after graphs (CSS outlines the target) and to its line in the text diff."""
    out = ['<aside class="changes"><strong>Changed instructions</strong>']
    for pair in pairs:
        before = {name: graph.node_id(pair.before_id, i) for i, name in enumerate(pair.before_nodes)}
        after = {name: graph.node_id(pair.after_id, i) for i, name in enumerate(pair.after_nodes)}
        out.append(f"<h5>{_esc(pair.title)}</h5><ul>")
        for change in pair.changes[:MAX_LISTED_CHANGES]:
            links = [f'<a class="focus" href="#{ids[name]}">{side}</a>'
                     for side, ids, name in (("before", before, change.before), ("after", after, change.after))
                     if name in ids]
            line = diff_lines.get(("-", change.before)) or diff_lines.get(("+", change.after))
            if line:
                links.append(f'<a class="diff" href="#{line}">diff</a>')
            out.append(f'<li class="{change.status}" data-name="{_esc(change.name)}">'
                       f'<span class="{change.status}" title="{change.status}">{change.status[0].upper()}</span> '
                       f'{_esc(change.name)} '
                       f'{" ".join(links)}</li>')
        if len(pair.changes) > MAX_LISTED_CHANGES:
            out.append(f"<li>... {len(pair.changes) - MAX_LISTED_CHANGES:,} more</li>")
        out.append("</ul>")
    out.append("</aside>")
    return "".join(out)
