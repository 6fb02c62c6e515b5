"""``hlo-tools diff OLD NEW``: what changed between two modules.

Exit status as ``diff(1)``: 0 when the modules are identical (renames
allowed), 1 when they differ, 2 when one cannot be read or parsed (still one
``hlo-tools: error:`` line).  See docs/diff.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from hlo_tools import cli
from hlo_tools.inspection import diff

EXIT_SAME, EXIT_DIFFERENT, EXIT_TROUBLE = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``diff`` subcommand."""
    p = subparsers.add_parser(
        "diff", help="what changed between two HLO modules",
        description="Match the computations and instructions of two HLO modules by name, then "
                    "by structure (so renamed instructions still match), and report what was "
                    "added, removed or changed in each computation, with the opcode counts that "
                    "changed. Metadata and instruction order are ignored; renames are listed but "
                    "do not count as differences. Exit status: 0 identical, 1 different, "
                    "2 trouble (a file that cannot be read or parsed).")
    p.add_argument("old", help="the module before (HLO text file, or - for stdin)")
    p.add_argument("new", help="the module after (HLO text file, or - for stdin)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys in docs/diff.md) instead of the report")
    p.add_argument("--renames", action="store_true",
                   help="list every renamed instruction (by default they are only counted)")
    p.set_defaults(func=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    """Compare ``args.old`` with ``args.new``; exit status as diff(1)."""
    if args.old == "-" and args.new == "-":
        return _trouble(cli.CommandError("only one of the two modules can come from stdin"))
    try:
        old = cli.load_module(args.old)
        new = cli.load_module(args.new)
    except cli.CommandError as exc:
        return _trouble(exc)
    except OSError as exc:
        return _trouble(cli.CommandError(exc.strerror or str(exc), exc.filename))
    found = diff.diff_modules(old, new)
    if args.json:
        print(json.dumps(found.to_json(), indent=2))
    else:
        print(found.format(args.old, args.new, renames=args.renames), end="")
    return EXIT_SAME if found.identical else EXIT_DIFFERENT


def _trouble(error: cli.CommandError) -> int:
    """Report ``error`` as the CLI does, with diff(1)'s status for trouble."""
    print(f"{cli.PROG}: error: {error}", file=sys.stderr)
    return EXIT_TROUBLE
