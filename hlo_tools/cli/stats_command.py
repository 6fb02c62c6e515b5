"""``hlo-tools stats MODULE``: what a module is made of, and what XLA says it costs.

The IR part (opcodes, fusions, collectives, sizes) never needs XLA; XLA's cost
analysis and memory stats come from compiling the module in a child process,
and a module XLA cannot compile only turns that section into a warning line.
See docs/stats.md.
"""

from __future__ import annotations

import argparse
import json

from hlo_tools import cli
from hlo_tools.inspection import stats


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``stats`` subcommand."""
    p = subparsers.add_parser(
        "stats", help="opcode histogram, collectives, sizes and XLA's cost analysis of a module",
        description="Count what an HLO module holds: opcodes (whole module and entry), fusions "
                    "by kind, collectives by kind with their bytes and replica groups, entry "
                    "parameter/output bytes and constant bytes. Unless --no-compile, also "
                    "compile it with XLA on CPU (in a child process) and report XLA's cost "
                    "analysis and compiled memory stats; when XLA cannot compile the module "
                    "that section is a warning line and the command still succeeds.")
    p.add_argument("input", help="HLO text file, or - for stdin")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys in docs/stats.md) instead of tables")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip XLA: report only what the IR says")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop compiling after this many seconds (the XLA section then says so)")
    p.set_defaults(func=run_stats)


def run_stats(args: argparse.Namespace) -> int:
    """Print the statistics of ``args.input``; 0 whenever the module parses."""
    if args.timeout is not None and not args.timeout > 0:
        raise cli.CommandError(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    module = cli.load_module(args.input, check_sizes=True)
    report = stats.module_stats(module)
    if args.compile:
        try:
            report.xla = stats.xla_cost(module, timeout=args.timeout)
        except stats.XlaCostError as exc:
            report.xla_error = str(exc)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.format(), end="")
    return 0
