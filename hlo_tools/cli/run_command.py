"""``hlo-tools run MODULE``: compile a module with XLA, run it on N devices, compare with a reference.

Flag names follow XLA's ``run_hlo_module`` where it has one.  By default the
module is compiled and run in a child process, so that an XLA crash (a CHECK
failure, an abort, a segfault) is reported as one line; ``--in_process``
turns that off.  See docs/run.md for an example session.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from hlo_tools import cli
from hlo_tools.xla import runner


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand."""
    p = subparsers.add_parser(
        "run", help="compile an HLO module with XLA and run it on N devices",
        description="Compile an HLO module with XLA (PJRT) and run it on one or more devices: "
                    "replica programs (--num_replicas), partitioned programs (--num_partitions; "
                    "SPMD modules and per-device modules), and several local processes "
                    "(--num_processes). A module XLA already optimized (an XLA_PASSES_DUMP_TO "
                    "dump, an is_scheduled=true module) is compiled from the stage of XLA's "
                    "pipeline it was taken at. With --reference, run a second module on the same "
                    "global inputs and compare every output (exit 1 on a mismatch).")
    p.add_argument("module", help="HLO text file, or a serialized HloModuleProto (.pb)")
    p.add_argument("--input_format", choices=runner.INPUT_FORMATS,
                   help="hlo (text) or pb (serialized HloModuleProto); default: pb for .pb files")
    p.add_argument("--platform", default="cpu",
                   help="cpu (default), or gpu/cuda/rocm/tpu where one is present")
    p.add_argument("--num_replicas", type=int, metavar="N",
                   help="run as a replica program on N devices (default: the module's "
                        "replica_count, else 1)")
    p.add_argument("--num_partitions", type=int, metavar="N",
                   help="run as a partitioned program on N devices (default: the module's "
                        "num_partitions, else the devices its entry shardings name, else 1)")
    p.add_argument("--partition_mode", choices=runner.PARTITION_MODES, default="auto",
                   help="spmd: XLA partitions the module (JAX/GSPMD/Shardy dumps); per_device: "
                        "the module is already partitioned and its sharding= attributes say how "
                        "global arrays map to devices; auto (default): spmd for modules whose "
                        "instructions carry Shardy or GSPMD partitioner markers, else per_device")
    p.add_argument("--inputs", metavar="FILE.npz",
                   help="input arrays arg0..argK: global arrays in partition mode, a leading "
                        "axis of size N in replica mode (default: seeded random integers)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--replicated", metavar="ARG,...", type=_parameter_list, action="extend",
                   default=[],
                   help="entry parameters (numbers or names) that hold the same value on every "
                        "device, as a pmap program's weights do: their random inputs are device "
                        "0's value everywhere (with --inputs, they must already be so)")
    p.add_argument("--output", metavar="FILE.npz",
                   help="write the outputs out0..outM (tuples flattened; global arrays in "
                        "partition mode, stacked in replica mode)")
    p.add_argument("--save_inputs", metavar="FILE.npz",
                   help="write the inputs the module ran on, as arg0..argK")
    p.add_argument("--print_literals", action="store_true", help="print the inputs and outputs")
    p.add_argument("--reference", metavar="OTHER_MODULE",
                   help="run OTHER_MODULE on the same global inputs and compare every output")
    p.add_argument("--reference_num_replicas", type=int, metavar="N",
                   help="replicas of the reference (default: its header, else 1)")
    p.add_argument("--reference_num_partitions", type=int, metavar="N",
                   help="partitions of the reference (default: its header, else 1)")
    p.add_argument("--reference_partition_mode", choices=runner.PARTITION_MODES, default="auto",
                   help="--partition_mode of the reference")
    p.add_argument("--abs_error_bound", type=float, default=runner.DEFAULT_ABS_ERROR_BOUND,
                   help="an element matches when its absolute error is at most this "
                        f"(default {runner.DEFAULT_ABS_ERROR_BOUND:g}) ...")
    p.add_argument("--rel_error_bound", type=float, default=runner.DEFAULT_REL_ERROR_BOUND,
                   help="... or its relative error is at most this "
                        f"(default {runner.DEFAULT_REL_ERROR_BOUND:g}); NaN matches NaN")
    p.add_argument("--iterations", type=int, default=1, metavar="K",
                   help="run K times and report the median, min and max time")
    p.add_argument("--progress", action="store_true",
                   help="draw a progress bar on stderr (default: only when stderr is a terminal)")
    p.add_argument("--in_process", action="store_true",
                   help="compile and run in this process (an XLA crash then kills it)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop the run after this many seconds")
    p.add_argument("--num_processes", type=int, default=1, metavar="P",
                   help="split the devices over P local processes joined with jax.distributed "
                        "(gloo collectives on 127.0.0.1)")
    p.add_argument("--process_id", type=int, metavar="I",
                   help="be process I of a run started by hand (with --num_processes and "
                        "--coordinator; process 0 reports the outputs)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="loopback address of process 0's coordinator (with --process_id)")
    p.set_defaults(func=run)


def _parameter_list(text: str) -> list[str]:
    """``0,w`` -> ``["0", "w"]``: entry parameter numbers or names."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of entry "
                                         f"parameter numbers or names")
    return items


def _is_special_file(path: str) -> bool:
    """Whether ``path`` exists and is not a regular file (a device such as /dev/null, a FIFO)."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def _check_file(path: str | None) -> None:
    if path is not None and not os.path.isfile(path):
        raise cli.CommandError("No such file or directory" if not os.path.exists(path)
                               else "not a regular file", path)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def run(args: argparse.Namespace) -> int:
    """Run ``args.module`` (and ``args.reference``); 0 when it ran (and matched), 1 otherwise."""
    _check_file(args.module)
    _check_file(args.reference)
    _check_file(args.inputs)
    if args.process_id is not None and args.num_processes < 2:
        raise cli.CommandError("--process_id needs --num_processes of 2 or more")
    if args.coordinator is not None and args.process_id is None:
        raise cli.CommandError("--coordinator needs --process_id (without them, --num_processes "
                               "starts every process itself)")
    if args.timeout is not None and args.in_process and args.num_processes == 1:
        raise cli.CommandError("--timeout needs a child process: drop --in_process")
    for flag in ("output", "save_inputs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise cli.CommandError("No such directory", os.path.dirname(path) or ".")
        if path is not None and any(cli._same_file(path, given) for given in (args.module, args.reference, args.inputs)
                                    if given is not None):
            raise cli.CommandError(f"refusing to overwrite an input file with --{flag}", path)
    if (args.output is not None and args.save_inputs is not None
            and cli._same_file(args.output, args.save_inputs)
            and not _is_special_file(args.output)):  # /dev/null twice is fine
        raise cli.CommandError("--output and --save_inputs name the same file (one would "
                               "replace the other)", args.save_inputs)
    progress = args.progress or (args.iterations > 1 and _stderr_is_tty())
    module = runner.ModuleRef(path=args.module, input_format=args.input_format)
    common = dict(seed=args.seed, iterations=args.iterations, platform=args.platform,
                  progress=progress, isolate=not args.in_process, timeout=args.timeout,
                  num_processes=args.num_processes, process_id=args.process_id,
                  coordinator=args.coordinator, replicated_parameters=args.replicated)
    try:
        if args.reference is not None:
            reference = runner.ModuleRef(path=args.reference, input_format=args.input_format)
            done = runner.compare_modules(
                module, reference, args.inputs, num_replicas=args.num_replicas,
                num_partitions=args.num_partitions, partition_mode=args.partition_mode,
                reference_num_replicas=args.reference_num_replicas,
                reference_num_partitions=args.reference_num_partitions,
                reference_partition_mode=args.reference_partition_mode,
                abs_error_bound=args.abs_error_bound, rel_error_bound=args.rel_error_bound,
                **common)
            result, ref_result, comparison = done if done is not None else (None, None, None)
        else:
            result = runner.run_module(
                module, args.inputs, num_replicas=args.num_replicas,
                num_partitions=args.num_partitions, partition_mode=args.partition_mode, **common)
            ref_result = comparison = None
    except runner.RunError as exc:
        raise cli.CommandError(str(exc)) from exc
    if result is None:  # a process other than 0 of a run started by hand
        print(f"process {args.process_id} of {args.num_processes}: done")
        return 0

    if args.output is not None:
        _save(args.output, result.outputs, "out")
    if args.save_inputs is not None:
        _save(args.save_inputs, result.inputs, "arg")
    print(f"{args.module}: {result.describe()}")
    for warning in result.warnings + (ref_result.warnings if ref_result else []):
        print(f"warning: {warning}")
    if args.print_literals:
        for i, a in enumerate(result.inputs):
            print(f"arg{i}: {runner.shape_str(a.shape, a.dtype)}\n{_literal(a)}")
    if comparison is None:
        for j, a in enumerate(result.outputs):
            print(f"out{j}: {runner.shape_str(a.shape, a.dtype)}")
            if args.print_literals:
                print(_literal(a))
    else:
        print(f"reference {args.reference}: {ref_result.describe()}")
        print(comparison.format())
        if args.print_literals:
            for j, (a, b) in enumerate(zip(result.outputs, ref_result.outputs)):
                print(f"out{j}:\n{_literal(a)}\nreference out{j}:\n{_literal(b)}")
    if args.iterations > 1:
        t = result.timing()
        print(f"timing: {t['iterations']} iterations: median {_ms(t['median'])}, "
              f"min {_ms(t['min'])}, max {_ms(t['max'])}")
        if "flops" in result.cost:
            print(f"cost (XLA's estimate, per device): {result.cost['flops']:.6g} flops, "
                  f"{result.cost.get('bytes accessed', 0):.6g} bytes accessed")
    if comparison is not None:
        if not comparison.ok:
            sys.stdout.flush()
            raise cli.CommandError(comparison.summary())
        print(comparison.summary())
    return 0


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _literal(a: np.ndarray) -> str:
    with np.printoptions(threshold=1000, linewidth=100):
        return np.array2string(np.asarray(a), separator=", ")


def _save(path: str, arrays, prefix: str) -> None:
    try:
        runner.save_arrays(path, arrays, prefix)
    except runner.RunError as exc:
        raise cli.CommandError(str(exc)) from exc
