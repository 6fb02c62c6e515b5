"""Draw one computation of an HLO module as an SVG graph, in pure Python.

    from hlo_tools.inspection import graph
    g = graph.computation_graph(module.entry, focus=["all-reduce.3"], hops=2, max_nodes=80)
    svg = graph.render_svg(g)

Nodes are instructions (name, opcode and shape), edges run from an operand to
its user.  A fusion is one node (its fused computation is summarised by the
opcodes inside, not drawn).  Collectives and instructions carrying a
``sharding=`` are highlighted, and so are the instructions a diff marks
``added``, ``removed`` or ``changed``; a legend says which colour is which.

Big computations stay readable because a graph never holds more than
``max_nodes`` instructions: with ``focus`` it is the focus plus ``hops`` steps
of neighbours (operands and users), else the neighbourhood of the ROOT, taken
nearest first.  The note "N more not shown" counts the rest, and every node
whose neighbours were left out says how many ("+3").

Two layouts place the nodes (``layout=``): Graphviz's ``dot`` when it is
installed (``auto``, the default, or ``dot``), which orders layers to cross
few edges and routes edges as splines; we read its positions (``-Tplain``) and
draw the SVG ourselves, so both layouts look alike and carry the same classes.
Without Graphviz (or with ``builtin``) a layered drawing in Python: longest-path
layering from the operands down, then barycenter ordering within each layer, a
few sweeps down and up; a layer wider than 10 nodes wraps onto more rows.
Either way only the kept nodes are laid out, so the cost is bounded by
``max_nodes`` whatever the size of the computation.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import shutil
import subprocess
from collections.abc import Iterable, Mapping

from hlo_tools.inspection.diff import instruction_text
from hlo_tools.ir.hlo import HloComputation, HloInstruction
from hlo_tools.inspection.stats import COLLECTIVE_KINDS, collective_kind

__all__ = ["Graph", "GraphNode", "LayoutError", "computation_graph", "render_svg", "resolve_layout", "node_id",
           "is_collective", "DEFAULT_MAX_NODES", "STATUSES", "LAYOUTS"]

DEFAULT_MAX_NODES = 150
STATUSES = ("added", "removed", "changed")
LAYOUTS = ("auto", "dot", "builtin")  # auto: dot when Graphviz is installed, else builtin
_DOT_TIMEOUT_SECONDS = 60

# Drawing constants (pixels). Text widths are estimated from the character count.
_NODE_HEIGHT = 34
_LAYER_GAP = 46
_NODE_GAP = 14
_CHAR_WIDTH = 6.6
_LABEL_CHARS = 34          # longer names and details are clipped with an ellipsis
_MARGIN = 12
_LEGEND_HEIGHT = 26
_LEGEND_WIDTH = 460
_ORDERING_SWEEPS = 4
_ROW_NODES = 10            # a wider layer wraps onto several rows, so that wide graphs stay readable

_FILL = {"collective": "#ffd8a8", "fusion": "#e5dbff", "parameter": "#d3f9d8", "constant": "#f1f3f5",
         "other": "#ffffff"}
_STATUS_STROKE = {"added": "#2b8a3e", "removed": "#c92a2a", "changed": "#e67700"}
_SHARDED_STROKE = "#1971c2"
_PLAIN_STROKE = "#868e96"
_LEGEND = (("collective", _FILL["collective"], _PLAIN_STROKE, ""),
           ("sharded", "#ffffff", _SHARDED_STROKE, "4 2"),
           ("fusion", _FILL["fusion"], _PLAIN_STROKE, ""),
           ("added", "#ffffff", _STATUS_STROKE["added"], ""),
           ("removed", "#ffffff", _STATUS_STROKE["removed"], ""),
           ("changed", "#ffffff", _STATUS_STROKE["changed"], ""))


class LayoutError(Exception):
    """Graphviz's dot was asked for but is not installed, or it failed on a graph."""


@dataclasses.dataclass
class GraphNode:
    """One instruction as drawn."""

    name: str
    opcode: str
    detail: str             # second line: opcode and shape, or a fusion's kind and fused opcodes
    tooltip: str            # the instruction as XLA writes it (no metadata)
    kind: str               # collective, fusion, parameter, constant or other: the fill colour
    sharded: bool           # has a sharding= attribute
    status: str | None      # added, removed, changed (from a diff), or None
    hidden_neighbours: int  # operands and users left out of the graph


@dataclasses.dataclass
class Graph:
    """The part of a computation to draw: nodes in program order, edges operand -> user."""

    title: str
    nodes: list[GraphNode]
    edges: list[tuple[str, str]]
    hidden: int  # instructions of the computation not shown


def is_collective(instr: HloInstruction) -> bool:
    """A collective, or any part of an async one (``-start``, ``-update``, ``-done``)."""
    if collective_kind(instr) is not None:
        return True
    return any(instr.opcode.endswith(suffix) and instr.opcode[:-len(suffix)] in COLLECTIVE_KINDS
               for suffix in ("-update", "-done"))


def _kind(instr: HloInstruction) -> str:
    if is_collective(instr):
        return "collective"
    if instr.opcode in ("fusion", "parameter", "constant"):
        return instr.opcode
    return "other"


def _detail(instr: HloInstruction) -> str:
    if instr.opcode == "fusion":
        opcodes = collections.Counter(i.opcode for c in instr.called_computations for i in c.instructions
                                      if i.opcode != "parameter")
        inside = ",".join(op for op, _ in opcodes.most_common(3))
        return " ".join(part for part in ("fusion", str(instr.attrs.get("kind", "")), inside) if part)
    shape = instr.shape
    return f"{instr.opcode} {f'({len(shape.tuple_shapes)}-tuple)' if shape.is_tuple else shape.without_layout()}"


def _neighbours(instr: HloInstruction) -> list[HloInstruction]:
    return list(dict.fromkeys([*instr.operands, *instr.users]))


def _select(focus: list[HloInstruction], hops: int | None, max_nodes: int) -> list[HloInstruction]:
    """Breadth first from ``focus`` (nearest first) up to ``hops`` steps and ``max_nodes`` nodes."""
    chosen: dict[HloInstruction, int] = {}
    queue: collections.deque = collections.deque()
    for instr in focus:
        if instr not in chosen and len(chosen) < max_nodes:
            chosen[instr] = 0
            queue.append(instr)
    while queue and len(chosen) < max_nodes:
        instr = queue.popleft()
        distance = chosen[instr]
        if hops is not None and distance >= hops:
            continue
        for other in _neighbours(instr):
            if other not in chosen:
                chosen[other] = distance + 1
                queue.append(other)
                if len(chosen) >= max_nodes:
                    break
    return list(chosen)


def computation_graph(comp: HloComputation, *, focus: Iterable[str] | None = None, hops: int = 1,
                      max_nodes: int = DEFAULT_MAX_NODES, status: Mapping[str, str] | None = None,
                      title: str | None = None) -> Graph:
    """The graph of ``comp``: all of it when it fits in ``max_nodes``, else the nearest part.

    ``focus``: names of instructions to centre on, with ``hops`` steps of neighbours
    (unknown names raise ``KeyError``); without it the whole computation, or when that
    is too big the ROOT's neighbourhood.  ``status``: instruction name -> added,
    removed or changed, as a diff says.
    """
    if max_nodes < 1:
        raise ValueError("max_nodes must be at least 1")
    status = dict(status or {})
    if focus is not None:
        by_name = {instr.name: instr for instr in comp.instructions}
        kept = _select([by_name[name] for name in focus], hops, max_nodes)
    elif len(comp.instructions) <= max_nodes:
        kept = list(comp.instructions)
    else:
        kept = _select([comp.root], None, max_nodes)
    kept_set = set(kept)
    order = [instr for instr in comp.post_order() if instr in kept_set]
    nodes = [GraphNode(name=instr.name, opcode=instr.opcode, detail=_detail(instr),
                       tooltip=instruction_text(instr), kind=_kind(instr),
                       sharded="sharding" in instr.attrs, status=status.get(instr.name),
                       hidden_neighbours=sum(1 for n in _neighbours(instr) if n not in kept_set))
             for instr in order]
    edges = [(operand.name, instr.name) for instr in order
             for operand in dict.fromkeys(instr.operands) if operand in kept_set]
    return Graph(title=title or f"computation {comp.name}", nodes=nodes, edges=edges,
                 hidden=len(comp.instructions) - len(kept))


# --- layout ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Placement:
    """Where a layout put things, in pixels from the top left of the drawing area."""

    centre: dict[str, tuple[float, float]]
    edges: list[list[tuple[float, float]]]  # per edge of the graph: a cubic Bezier path's points, 1 + 3k of them
    width: float
    height: float


def resolve_layout(layout: str) -> str:
    """``dot`` or ``builtin``: what ``layout`` means on this machine (``auto``: dot when installed)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if layout == "auto":
        return "dot" if shutil.which("dot") else "builtin"
    if layout == "dot" and not shutil.which("dot"):
        raise LayoutError("Graphviz's dot is not installed (apt-get install graphviz)")
    return layout


def _layers(graph: Graph) -> list[list[str]]:
    """Longest-path layering (a node sits one layer below its deepest operand), then
    barycenter ordering within the layers."""
    operands: dict[str, list[str]] = collections.defaultdict(list)
    users: dict[str, list[str]] = collections.defaultdict(list)
    for src, dst in graph.edges:
        operands[dst].append(src)
        users[src].append(dst)
    layer: dict[str, int] = {}
    for node in graph.nodes:  # program order: operands first
        layer[node.name] = 1 + max((layer[o] for o in operands[node.name]), default=-1)
    rows: list[list[str]] = [[] for _ in range(1 + max(layer.values(), default=-1))]
    for node in graph.nodes:
        rows[layer[node.name]].append(node.name)
    position = {name: i for row in rows for i, name in enumerate(row)}

    def reorder(row: list[str], neighbours: dict[str, list[str]]) -> None:
        def barycenter(name: str) -> float:
            placed = [position[n] for n in neighbours[name]]
            return sum(placed) / len(placed) if placed else position[name]
        row.sort(key=barycenter)
        for i, name in enumerate(row):
            position[name] = i

    for _ in range(_ORDERING_SWEEPS):
        for row in rows[1:]:
            reorder(row, operands)
        for row in reversed(rows[:-1]):
            reorder(row, users)
    return rows


def _clip(text: str) -> str:
    return text if len(text) <= _LABEL_CHARS else text[:_LABEL_CHARS - 1] + "\u2026"


def _node_width(node: GraphNode) -> float:
    chars = max(len(_clip(node.name)), len(_clip(node.detail)))
    return round(chars * _CHAR_WIDTH + 16 + (18 if node.hidden_neighbours else 0), 1)


def _place_rows(rows: list[list[str]], widths: dict[str, float],
                edges: list[tuple[str, str]]) -> dict[str, float]:
    """The left x of every node: the first row packed, each later row's nodes as close as
    they fit (in order, without overlaps) to above their operands, so edges run mostly down."""
    operands: dict[str, list[str]] = collections.defaultdict(list)
    for src, dst in edges:
        operands[dst].append(src)
    left: dict[str, float] = {}
    for row in rows:
        wanted = []
        for name in row:
            placed = [left[o] + widths[o] / 2 for o in operands[name] if o in left]
            wanted.append(sum(placed) / len(placed) - widths[name] / 2 if placed else None)
        xs: list[float] = []
        cursor = None  # the right edge (plus the gap) of the node placed last
        for name, want in zip(row, wanted):
            start = want if want is not None else (cursor or 0.0)  # no operands above: packed
            if cursor is not None:
                start = max(start, cursor)
            xs.append(start)
            cursor = start + widths[name] + _NODE_GAP
        moved = [want - got for want, got in zip(wanted, xs) if want is not None]
        correction = min(sum(moved) / len(moved), 0.0) if moved else 0.0  # overlaps only push right
        for name, x_left in zip(row, xs):
            left[name] = x_left + correction
    return left


def _s_curve(source: tuple[float, float], target: tuple[float, float]) -> list[tuple[float, float]]:
    """A vertical S-curve from the bottom of the node centred at ``source`` to the top of ``target``'s."""
    (x1, y1), (x2, y2) = source, target
    y1 += _NODE_HEIGHT / 2
    y2 -= _NODE_HEIGHT / 2
    bend = (y2 - y1) / 2
    return [(x1, y1), (x1, y1 + bend), (x2, y2 - bend), (x2, y2)]


def _builtin_layout(graph: Graph, widths: dict[str, float]) -> _Placement:
    """The layered drawing in Python: wrapped layers as rows, edges as S-curves from the
    bottom of the operand to the top of the user."""
    rows = [layer[i:i + _ROW_NODES] for layer in _layers(graph) for i in range(0, len(layer), _ROW_NODES)]
    left = _place_rows(rows, widths, graph.edges)
    shift = -min(left.values(), default=0)
    centre = {name: (left[name] + shift + widths[name] / 2, depth * (_NODE_HEIGHT + _LAYER_GAP) + _NODE_HEIGHT / 2)
              for depth, row in enumerate(rows) for name in row}
    edges = [_s_curve(centre[src], centre[dst]) for src, dst in graph.edges]
    width = max((left[name] + shift + widths[name] for name in left), default=0)
    return _Placement(centre, edges, width, max(len(rows) * (_NODE_HEIGHT + _LAYER_GAP) - _LAYER_GAP, 0))


def _wide_fans(graph: Graph) -> list[tuple[bool, list[tuple[str, str]]]]:
    """(leaves above the hub?, edges) of each node with more than a row of leaf operands (or
    leaf users): wide fans that dot would lay out on one endless rank."""
    degree = collections.Counter(name for edge in graph.edges for name in edge)
    fans = []
    for leaf_end in (0, 1):  # leaf operands of a user, then leaf users of an operand
        by_hub = collections.defaultdict(list)
        for edge in graph.edges:
            if degree[edge[leaf_end]] == 1:
                by_hub[edge[1 - leaf_end]].append(edge)
        fans += [(leaf_end == 0, edges) for edges in by_hub.values() if len(edges) > _ROW_NODES]
    return fans


def _dot_source(graph: Graph, widths: dict[str, float]) -> str:
    """The graph for dot.

    Boxes have our sizes, edges no arrowheads (they end on the node, where our marker goes).
    A wide fan wraps onto rows of 10 leaves: invisible edges stack each leaf on the one a row
    nearer the hub, and only the nearest row's edges go to dot (the others would each add a
    dummy node to every rank they cross, making the rows as wide as the fan)."""
    index = {node.name: f"n{i}" for i, node in enumerate(graph.nodes)}
    stacked: list[tuple[str, str]] = []
    left_out: set[tuple[str, str]] = set()
    for above, fan in _wide_fans(graph):
        if not above:  # leaf users: the row nearest the hub is the first
            fan = fan[::-1]
        leaves = [src if above else dst for src, dst in fan]
        for k in range(len(fan) - _ROW_NODES):
            left_out.add(fan[k])
            stacked.append((leaves[k], leaves[k + _ROW_NODES]) if above else (leaves[k + _ROW_NODES], leaves[k]))
    lines = ["digraph hlo {",
             f"graph [rankdir=TB, nodesep={_NODE_GAP / 72:.3f}, ranksep={_LAYER_GAP / 72:.3f}];",
             f'node [shape=box, fixedsize=true, label="", height={_NODE_HEIGHT / 72:.4f}];',
             "edge [arrowhead=none];"]
    lines += [f"{index[node.name]} [width={widths[node.name] / 72:.4f}];" for node in graph.nodes]
    lines += [f"{index[src]} -> {index[dst]};" for src, dst in graph.edges if (src, dst) not in left_out]
    lines += [f"{index[src]} -> {index[dst]} [style=invis];" for src, dst in stacked]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_layout(graph: Graph, widths: dict[str, float]) -> _Placement:
    """Positions and edge splines from ``dot -Tplain`` (inches, y up), in our pixels (y down)."""
    try:
        result = subprocess.run(["dot", "-Tplain"], input=_dot_source(graph, widths), capture_output=True,
                                text=True, timeout=_DOT_TIMEOUT_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LayoutError(f"dot failed on {graph.title}: {exc}") from exc
    if result.returncode != 0:
        first = (result.stderr.strip().splitlines() or ["no message"])[0]
        raise LayoutError(f"dot failed on {graph.title} (exit status {result.returncode}): {first}")
    names = [node.name for node in graph.nodes]
    centre: dict[str, tuple[float, float]] = {}
    splines: dict[tuple[str, str], list[tuple[float, float]]] = {}
    width = height = 0.0
    for line in result.stdout.splitlines():
        fields = line.split()
        if fields[0] == "graph":
            width, height = float(fields[2]) * 72, float(fields[3]) * 72
        elif fields[0] == "node":
            centre[names[int(fields[1][1:])]] = (float(fields[2]) * 72, height - float(fields[3]) * 72)
        elif fields[0] == "edge":
            count = int(fields[3])
            coords = [float(v) * 72 for v in fields[4:4 + 2 * count]]
            splines[(names[int(fields[1][1:])], names[int(fields[2][1:])])] = [
                (x, height - y) for x, y in zip(coords[::2], coords[1::2])]
    # The edges of wide fans that dot did not see: S-curves, as in the builtin layout.
    return _Placement(centre, [splines.get(edge) or _s_curve(centre[edge[0]], centre[edge[1]])
                               for edge in graph.edges], width, height)


# --- SVG -------------------------------------------------------------------------------------------


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def node_id(id_prefix: str, index: int) -> str:
    """The element id of the ``index``-th node of a graph rendered with ``id_prefix``, for links to it."""
    return f"{id_prefix}-node-{index}"


def render_svg(graph: Graph, id_prefix: str = "hlo", layout: str = "auto") -> str:
    """The graph as a standalone SVG document (also valid inline in HTML).

    ``id_prefix`` keeps element ids unique when several graphs share a page; ``layout``
    is one of :data:`LAYOUTS` (``LayoutError`` when ``dot`` is asked for and missing).
    """
    widths = {node.name: _node_width(node) for node in graph.nodes}
    place = _dot_layout if resolve_layout(layout) == "dot" else _builtin_layout
    placement = place(graph, widths)
    left, top = _MARGIN, _MARGIN + _LEGEND_HEIGHT + 18
    width = round(max(placement.width + 2 * _MARGIN, _LEGEND_WIDTH))
    height = round(top + placement.height + _MARGIN)
    marker = f"{id_prefix}-arrow"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="hlo-graph" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
           f"<title>{_esc(graph.title)}</title>",
           f'<defs><marker id="{_esc(marker)}" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" '
           f'markerHeight="7" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="{_PLAIN_STROKE}"/></marker></defs>']
    out.extend(_legend(graph))
    out.append('<g class="edges" fill="none" stroke="#adb5bd" stroke-width="1.2">')
    for points in placement.edges:
        (x0, y0), *rest = [(x + left, y + top) for x, y in points]
        curves = " ".join(f"C{' '.join(f'{x:.1f},{y:.1f}' for x, y in rest[i:i + 3])}" for i in range(0, len(rest), 3))
        out.append(f'<path d="M{x0:.1f},{y0:.1f} {curves}" marker-end="url(#{_esc(marker)})"/>')
    out.append("</g>")
    out.append('<g class="nodes">')
    for index, node in enumerate(graph.nodes):
        x, y = placement.centre[node.name]
        out.append(_node_svg(node, (x + left, y + top), widths[node.name], node_id(id_prefix, index)))
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


def _legend(graph: Graph) -> list[str]:
    out = ['<g class="legend" font-size="10">']
    x = _MARGIN
    y = _MARGIN
    for label, fill, stroke, dash in _LEGEND:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<rect x="{x}" y="{y}" width="14" height="12" rx="2" fill="{fill}" stroke="{stroke}" '
                   f'stroke-width="2"{dash_attr}/>'
                   f'<text x="{x + 18}" y="{y + 10}">{label}</text>')
        x += 26 + len(label) * 6.2
    out.append("</g>")
    note = f"{graph.title}: {len(graph.nodes):,} instructions shown"
    if graph.hidden:
        note += f", {graph.hidden:,} more not shown"
    out.append(f'<text class="note" x="{_MARGIN}" y="{_MARGIN + _LEGEND_HEIGHT + 4}" font-size="11" '
               f'fill="#495057">{_esc(note)}</text>')
    return out


def _node_svg(node: GraphNode, centre: tuple[float, float], width: float, element_id: str) -> str:
    cx, cy = centre
    x, y = cx - width / 2, cy - _NODE_HEIGHT / 2
    classes = ["node", node.kind]
    if node.sharded:
        classes.append("sharded")
    if node.status:
        classes.append(node.status)
    stroke, stroke_width, dash = _PLAIN_STROKE, 1, ""
    if node.sharded:
        stroke, stroke_width, dash = _SHARDED_STROKE, 2, ' stroke-dasharray="4 2"'
    if node.status:
        stroke, stroke_width = _STATUS_STROKE[node.status], 3
    tooltip = node.tooltip if not node.hidden_neighbours else (
        f"{node.tooltip}\n({node.hidden_neighbours} neighbours not shown)")
    parts = [f'<g class="{" ".join(classes)}" data-name="{_esc(node.name)}" data-opcode="{_esc(node.opcode)}" '
             f'id="{_esc(element_id)}">',
             f"<title>{_esc(tooltip)}</title>",
             f'<rect x="{x:.1f}" y="{y:.1f}" width="{width}" height="{_NODE_HEIGHT}" rx="4" '
             f'fill="{_FILL[node.kind]}" stroke="{stroke}" stroke-width="{stroke_width}"{dash}/>',
             f'<text x="{x + 8:.1f}" y="{y + 14:.1f}" font-weight="bold">{_esc(_clip(node.name))}</text>',
             f'<text x="{x + 8:.1f}" y="{y + 27:.1f}" fill="#495057">{_esc(_clip(node.detail))}</text>']
    if node.hidden_neighbours:
        parts.append(f'<text class="more" x="{x + width - 6:.1f}" y="{y + 14:.1f}" text-anchor="end" '
                     f'fill="#868e96">+{node.hidden_neighbours}</text>')
    parts.append("</g>")
    return "".join(parts)
