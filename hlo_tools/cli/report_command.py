"""``hlo-tools report DIR -o report.html``: one HTML page for a dump directory.

See docs/report.md; the analysis and the page are :mod:`hlo_tools.inspection.report`.
"""

from __future__ import annotations

import argparse
import os

from hlo_tools import cli
from hlo_tools.inspection import graph, report
from hlo_tools.cli.cost_command import add_machine_options, machine
from hlo_tools.cli.graph_command import add_layout_option, check_drawing_options


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` subcommand."""
    p = subparsers.add_parser(
        "report", help="an HTML report of a dump directory: every pass, what it changed, graphs",
        description="Read the HLO files of an XLA_PASSES_DUMP_TO, --xla_dump_to or hlo-tools dump "
                    "directory and write one self-contained HTML page (no network): per module a "
                    "timeline of its passes with what each changed and its report lines, before/after "
                    "SVG graphs of the changed neighbourhood (opened on the change), a list of the changed "
                    "instructions, the diff as text, and IR statistics. Modules that changed come first; "
                    "the others are folded into one line. Files that do not parse are listed as warnings "
                    "in the page.")
    p.add_argument("directory", help="the dump directory")
    p.add_argument("-o", "--output", metavar="OUT", required=True,
                   help="the HTML file to write (atomically; never one of the dump's files)")
    p.add_argument("--hops", type=int, default=report.DEFAULT_HOPS, metavar="K",
                   help=f"steps of unchanged neighbours drawn around each change (default: "
                        f"{report.DEFAULT_HOPS})")
    p.add_argument("--max-nodes", type=int, default=report.DEFAULT_MAX_NODES, metavar="N",
                   help=f"draw at most N instructions per graph (default: {report.DEFAULT_MAX_NODES})")
    p.add_argument("--module", metavar="REGEX",
                   help="only the modules whose name or a file name REGEX finds (re.search), e.g. "
                        "'jit_step' or 'module_0016'")
    add_layout_option(p)
    add_machine_options(p, topology_required=False)
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Write the report of ``args.directory`` to ``args.output``; say where, and what was skipped."""
    check_drawing_options(args)
    priced_on = machine(args)
    if os.path.isdir(args.output):
        raise cli.CommandError("is a directory; give the HTML file to write", args.output)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise cli.CommandError("the output's directory does not exist", args.output)
    try:
        for files in report.scan_dump(args.directory).values():
            if any(cli._same_file(args.output, file.path) for file in files):
                raise cli.CommandError("refusing to overwrite a file of the dump", args.output)
        page = report.build_report(args.directory, hops=args.hops, max_nodes=args.max_nodes,
                                   layout=args.layout, module_pattern=args.module,
                                   machine=priced_on)
    except (report.ReportError, graph.LayoutError) as exc:
        raise cli.CommandError(str(exc)) from exc
    cli.write_atomically(args.output, report.render_html(page))
    steps = sum(len(m.steps) for m in page.modules)
    warnings = (f", {report.plural(len(page.warnings), 'unreadable file')} (listed in the page)"
                if page.warnings else "")
    print(f"{args.output}: {report.plural(len(page.modules), 'module')}, {report.plural(steps, 'step')}{warnings}")
    return 0
