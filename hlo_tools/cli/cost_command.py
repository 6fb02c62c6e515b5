"""``hlo-tools cost MODULE --topology T``: one step of a per-device module on a machine of that shape.

Compute from XLA's cost analysis (or the IR when XLA cannot compile the module) on the chip's
roofline, plus every collective at the time of the algorithm it would use on the topology.
See docs/cost_model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from hlo_tools import cli
from hlo_tools.inspection import cost_model
from hlo_tools.inspection.topology import Topology, TopologyError

# The chip constants a flag can override: (flag, Chip field, what it is).
_OVERRIDES = (("--peak_flops", "peak_flops", "FLOP/s"),
              ("--hbm_bandwidth", "hbm_bandwidth", "bytes/s between a chip and its memory"),
              ("--link_bandwidth", "link_bandwidth", "bytes/s per link, per direction"),
              ("--link_latency", "link_latency", "seconds per hop of one step of a collective"))
# The range of an override (a latency may also be 0): far enough from 0 and from the largest float
# that every sum of the model stays finite (JSON has no Infinity) and no product of two constants
# rounds to 0.
_SMALLEST, _LARGEST = 1e-30, 1e30


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``cost`` subcommand."""
    p = subparsers.add_parser(
        "cost", help="estimate one step of a per-device module on a ring, torus or mesh of chips",
        description="Estimate one step of a per-device module on a ring:N, torus:RxC or mesh:RxC "
                    "of chips: compute on the chip's roofline (XLA's flops and bytes, or the IR's "
                    "when XLA cannot compile the module) plus each collective at the time of the "
                    "algorithm it would use there (alpha-beta per link, link sharing counted). "
                    "Compute and communication do not overlap.")
    p.add_argument("input", help="HLO text file, or - for stdin")
    add_machine_options(p, topology_required=True)
    p.add_argument("--num_partitions", type=int, metavar="N",
                   help="the module's partition count (default: its header's)")
    p.add_argument("--num_replicas", type=int, metavar="N",
                   help="the module's replica count (default: its header's)")
    p.add_argument("--no_xla", dest="use_xla", action="store_false",
                   help="skip compiling: compute from the IR's dots, convolutions and sizes")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop compiling after this long (then the IR's numbers are used)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=run_cost)


def add_machine_options(p: argparse.ArgumentParser, *, topology_required: bool) -> None:
    """--topology, --failed, --chip and the chip's overrides (`cost`, `report`, `xla-opt --report`)."""
    p.add_argument("--topology", required=topology_required, metavar="T",
                   help="ring:N, torus:RxC or mesh:RxC" + ("" if topology_required else
                                                          ": also estimate each step's time there (docs/cost_model.md)"))
    p.add_argument("--failed", default="", metavar="COORDS",
                   help="failed chips as ROW:COLUMN,... (devices are the healthy chips, row-major)")
    p.add_argument("--chip", default="tpu-v3", choices=sorted(cost_model.CHIPS),
                   help="the chip's constants (default tpu-v3; sources in docs/cost_model.md)")
    for flag, _, meaning in _OVERRIDES:
        p.add_argument(flag, type=float, metavar="X", help=f"override the chip's {meaning}")


def machine(args: argparse.Namespace) -> cost_model.Machine | None:
    """The machine the options describe; None when --topology is not given."""
    chip = _chip(args)
    if args.topology is None:
        if args.failed:
            raise cli.CommandError("--failed needs --topology")
        return None
    try:
        return cost_model.Machine(Topology.parse(args.topology, failed=args.failed), chip)
    except TopologyError as exc:
        raise cli.CommandError(str(exc)) from exc


def _chip(args: argparse.Namespace) -> cost_model.Chip:
    """The chip named by --chip with the overriding flags applied."""
    chip = cost_model.CHIPS[args.chip]
    overrides = {}
    for flag, field, _ in _OVERRIDES:
        value = getattr(args, field)
        if value is not None:
            if not (_SMALLEST <= value <= _LARGEST or (field == "link_latency" and value == 0)):
                zero = "0 or " if field == "link_latency" else ""
                raise cli.CommandError(f"{flag} must be {zero}a number from {_SMALLEST:g} to {_LARGEST:g}, "
                                       f"not {value:g}")
            overrides[field] = value
    if not overrides:
        return chip
    return dataclasses.replace(chip, name=f"{chip.name} ({', '.join(overrides)} overridden)", **overrides)


def run_cost(args: argparse.Namespace) -> int:
    """Print the estimate for ``args.input``."""
    for flag, value in (("--num_partitions", args.num_partitions), ("--num_replicas", args.num_replicas)):
        if value is not None and value < 1:
            raise cli.CommandError(f"{flag} must be at least 1, not {value}")
    if args.timeout is not None and not args.timeout > 0:
        raise cli.CommandError(f"--timeout must be a positive number of seconds, not {args.timeout:g}")
    chosen = machine(args)
    module = cli.load_module(args.input, check_sizes=True)
    try:
        step = cost_model.estimate(module, chosen.topology, chosen.chip, num_replicas=args.num_replicas,
                                   num_partitions=args.num_partitions, use_xla=args.use_xla,
                                   timeout=args.timeout)
    except cost_model.CostModelError as exc:
        raise cli.CommandError(str(exc), args.input) from exc
    print(json.dumps(step.to_json(), indent=2) if args.json else step.format(), end="\n" if args.json else "")
    return 0

