"""``hlo-tools graph MODULE``: one computation of a module as an SVG graph.

See docs/report.md; the drawing is :mod:`hlo_tools.inspection.graph`.
"""

from __future__ import annotations

import argparse

from hlo_tools import cli
from hlo_tools.inspection import graph


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``graph`` subcommand."""
    p = subparsers.add_parser(
        "graph", help="draw a computation of an HLO module as an SVG graph",
        description="Draw one computation (default: the entry) as a layered SVG graph: "
                    "instructions with their opcodes and shapes, edges from operand to user, "
                    "collectives and sharded instructions highlighted, fusions as one node. "
                    "Big computations are cut to --max-nodes around the ROOT, or around "
                    "--focus; a note says how many instructions are not shown.")
    p.add_argument("input", help="HLO text file, or - for stdin")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the SVG to OUT (atomically; never the input file) instead of stdout")
    p.add_argument("--computation", metavar="NAME", help="the computation to draw (default: the entry)")
    p.add_argument("--focus", metavar="INSTR", action="append",
                   help="centre on this instruction (repeatable): it and --hops steps of neighbours")
    p.add_argument("--hops", type=int, default=2, metavar="K",
                   help="steps of operands and users around --focus (default: 2)")
    p.add_argument("--max-nodes", type=int, default=graph.DEFAULT_MAX_NODES, metavar="N",
                   help=f"draw at most N instructions (default: {graph.DEFAULT_MAX_NODES})")
    add_layout_option(p)
    p.set_defaults(func=run_graph)


def add_layout_option(parser: argparse.ArgumentParser) -> None:
    """``--layout`` (shared with `report`)."""
    parser.add_argument("--layout", choices=graph.LAYOUTS, default="auto",
                        help="who places the nodes: Graphviz's dot, our builtin layered layout, or auto "
                             "(dot when it is installed; default)")


def check_drawing_options(args: argparse.Namespace) -> None:
    """Refuse --max-nodes below 1, negative --hops and --layout dot without dot (shared with `report`),
    before any work."""
    if args.max_nodes < 1:
        raise cli.CommandError(f"--max-nodes must be at least 1, not {args.max_nodes}")
    if args.hops < 0:
        raise cli.CommandError(f"--hops must be 0 or more, not {args.hops}")
    try:
        graph.resolve_layout(args.layout)
    except graph.LayoutError as exc:
        raise cli.CommandError(f"--layout {args.layout}: {exc}") from exc


def run_graph(args: argparse.Namespace) -> int:
    """Write the SVG of the chosen computation of ``args.input``."""
    check_drawing_options(args)
    module = cli.load_module(args.input)
    if args.computation is None:
        comp = module.entry
    else:
        try:
            comp = module.computation(args.computation)
        except KeyError:
            raise cli.CommandError(f"no computation named {args.computation!r} in module {module.name}",
                                   args.input) from None
    known = {instr.name for instr in comp.instructions}
    for name in args.focus or ():
        if name not in known:
            raise cli.CommandError(f"no instruction named {name!r} in computation {comp.name}", args.input)
    drawn = graph.computation_graph(comp, focus=args.focus, hops=args.hops, max_nodes=args.max_nodes,
                                    title=f"{module.name}: computation {comp.name}")
    try:
        svg = graph.render_svg(drawn, layout=args.layout)
    except graph.LayoutError as exc:
        raise cli.CommandError(str(exc), args.input) from exc
    cli.write_output(svg, args.output, args.input)
    return 0
