"""``hlo-tools print`` and ``hlo-tools verify``: read a module and show or check it."""

from __future__ import annotations

import argparse

from hlo_tools import cli


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``print`` and ``verify`` subcommands."""
    print_parser = subparsers.add_parser(
        "print", help="parse an HLO module and print it",
        description="Parse an HLO module and print it. Unmodified input prints back byte for byte.")
    print_parser.add_argument("input", help="HLO text file, or - for stdin")
    print_parser.add_argument(
        "--regenerate", action="store_true",
        help="print every instruction from the IR in XLA's style instead of reusing the source text")
    print_parser.add_argument(
        "-o", "--output", metavar="OUT",
        help="write to OUT (atomically; never the input file) instead of stdout")
    print_parser.set_defaults(func=run_print)

    verify_parser = subparsers.add_parser(
        "verify", help="parse and verify an HLO module",
        description="Parse an HLO module and run the verifier on it.")
    verify_parser.add_argument("input", help="HLO text file, or - for stdin")
    verify_parser.set_defaults(func=run_verify)


def run_print(args: argparse.Namespace) -> int:
    """Parse ``args.input`` and write its print to stdout or ``args.output``."""
    module = cli.load_module(args.input)
    cli.write_output(module.to_text(regenerate=args.regenerate), args.output, args.input)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Parse and verify ``args.input``; report its size on success."""
    module = cli.load_module(args.input)
    cli.verify_module(module, args.input)
    instructions = sum(len(comp.instructions) for comp in module.computations)
    print(f"OK: {module.name} ({len(module.computations)} computations, {instructions} instructions)")
    return 0
