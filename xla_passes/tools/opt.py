"""`xla-opt`: run a pass pipeline on HLO text, like XLA's `hlo-opt`.

    xla-opt IN.hlo --passes=all-reduce-combiner,dce -o OUT.hlo
    xla-opt --list-passes
    cat IN.hlo | xla-opt --passes=cse          # stdin to stdout
    xla-opt cases.hlo --split-input-file --passes=dce   # `// -----` separates modules
    xla-opt step.hlo --passes=weight-update-sharding --check -o out.hlo   # run both, compare

The output is written atomically and never over the input. Every failure is one
line on stderr (`xla-opt: error: ...`) and exit status 1; usage errors exit 2.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import hlo_tools
from hlo_tools import cli
from hlo_tools.inspection import cost_model
from hlo_tools.cli.cost_command import add_machine_options, machine

from . import validation
from ..core import PassError
from ..frontends.configuration import check_requested
from ..pipeline import LAYOUTS_FINAL_NOTE, Pipeline
from ..registry import registered_passes

PROG = "xla-opt"
SPLIT_MARKER = "// -----"
_HEADER = re.compile(r"^HloModule\b", re.M)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run xla_passes passes on an HLO module, like XLA's hlo-opt.")
    parser.add_argument("input", nargs="?", default="-", help="HLO text file, or - for stdin (default)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {cli.package_version()}")
    parser.add_argument("--passes", default="",
                        help="pipeline, e.g. 'all-reduce-combiner{threshold_bytes=1048576},dce' "
                             "(empty: parse, verify and print)")
    parser.add_argument("-o", "--output", metavar="OUT",
                        help="write to OUT (atomically; never the input file) instead of stdout")
    parser.add_argument("--list-passes", action="store_true", help="list the passes and their options, then exit")
    parser.add_argument("--split-input-file", action="store_true",
                        help=f"treat each '{SPLIT_MARKER}'-separated chunk as its own module")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the verifier on the input and after each pass")
    parser.add_argument("--dump-to", metavar="DIR",
                        help="write the module before the pipeline and after each pass into DIR")
    parser.add_argument("--report", action="store_true",
                        help="print what passes that keep a report (weight-update-sharding) did, on stderr; "
                             "with --topology also each step's estimated time on that machine")
    add_machine_options(parser, topology_required=False)
    parser.add_argument("--layouts-final", action="store_true",
                        help="the input comes after XLA's layout assignment (a dump from the JAX hook, whose "
                             "header says so): new collectives must have layouts XLA can run as they are")
    parser.add_argument("--check", action="store_true",
                        help="run the module before and after the passes on the same random inputs (hlo-tools "
                             "run's devices and conventions) and fail, writing nothing, when they differ "
                             "(default: on when XLA_PASSES_CHECK is set to a yes value)")
    parser.add_argument("--regenerate", action="store_true",
                        help="print every instruction from the IR in XLA's style, not only the changed ones")
    return parser


def list_passes() -> str:
    lines = []
    for name, cls in registered_passes().items():
        lines.append(f"{name:28} {cls.description()}")
        for field in cls.option_fields():
            kind = str(getattr(field.type, "__name__", field.type)).removesuffix(" | None")
            default = "the platform's default" if field.default is None else repr(field.default)
            lines.append(f"{'':30}{field.name}: {kind} = {default}")
    lines.append(f"{'fixed-point(...)':28} Repeat the passes in parentheses until none changes the module.")
    lines.append(f"{'':30}max_iterations: int = 25")
    return "\n".join(lines) + "\n"


def _chunks(text: str, split: bool) -> list[tuple[str, int]]:
    """(module text, number of lines before it in the file) for each module of the input."""
    if not split:
        return [(text, 0)]
    chunks, current, start = [], [], 0
    in_string = in_block_comment = False
    # Only '\n' ends a line, as in the parser: str.splitlines would also end one at a '\f', '\r' or
    # U+2028 inside a `//` comment, and take the rest of the comment for a separator.
    for number, line in enumerate(re.findall(r"[^\n]*\n|[^\n]+$", text)):
        if not (in_string or in_block_comment) and line.strip() == SPLIT_MARKER:
            chunks.append(("".join(current), start))
            current, start = [], number + 1
        else:
            current.append(line)
            in_string, in_block_comment = _open_at_line_end(line, in_string, in_block_comment)
    chunks.append(("".join(current), start))
    return chunks


def _open_at_line_end(line: str, in_string: bool, in_block_comment: bool) -> tuple[bool, bool]:
    """Whether a string literal or a `/* */` comment is still open after `line`, given what was
    open before it (a `// -----` line inside one is text, not a separator)."""
    i = 0
    while i < len(line):
        if in_string:
            if line[i] == "\\":
                i += 1
            elif line[i] == '"':
                in_string = False
        elif in_block_comment:
            if line.startswith("*/", i):
                in_block_comment, i = False, i + 1
        elif line[i] == '"':
            in_string = True
        elif line.startswith("//", i):
            break  # a line comment: quotes in it open nothing
        elif line.startswith("/*", i):
            in_block_comment, i = True, i + 1
        i += 1
    return in_string, in_block_comment


def _shifted(exc, offset: int):
    if exc.line is not None:
        exc.line += offset
    return exc


def _without_leading_comments(text: str) -> str:
    """The module text from its `HloModule` line on: comments before it (a test's RUN and
    CHECK lines) are not part of the output, as with XLA's hlo-opt."""
    match = _HEADER.search(text)
    return text[match.start():] if match else text


def optimize(text: str, passes: str, *, path: str, split: bool = False, verify: bool = True,
             dump_to: str | None = None, regenerate: bool = False, report: bool = False,
             check: bool = False, layouts_final: bool = False,
             machine: cost_model.Machine | None = None) -> str:
    """The text of the module(s) in `text` after `passes` (CommandError on any failure).

    With `report` and a `machine`, the estimated step time of the module
    before the passes and after each pass that changed it goes to stderr."""
    outputs = []
    for number, (chunk, offset) in enumerate(_chunks(text, split)):
        try:
            module = hlo_tools.parse_module(chunk)
            if verify:
                hlo_tools.verify(module)
        except (hlo_tools.HloParseError, hlo_tools.HloVerifyError) as exc:
            raise cli.located(_shifted(exc, offset), path) from exc
        if passes:
            priced = _step_times(module.name, machine) if report and machine else None
            if priced:
                priced("input", module)
            pipeline = Pipeline(passes, verify=verify, dump_to=dump_to, module_number=number,
                                layouts_final=layouts_final or LAYOUTS_FINAL_NOTE in chunk, after_pass=priced)
            changed = pipeline.run(module)
            if not changed:
                print(f"{PROG}: {module.name}: no pass changed the module", file=sys.stderr)
            if check and changed:
                _check(chunk, module, pipeline)
            if report:
                for line in pipeline.reports():
                    print(f"{module.name}: {line}", file=sys.stderr)
            else:
                for line in pipeline.refusals():  # a pass that could not apply says why, --report or not
                    print(f"{PROG}: {module.name}: {line}", file=sys.stderr)
        outputs.append(_without_leading_comments(module.to_text(regenerate=regenerate)))
    return f"\n{SPLIT_MARKER}\n".join(out.rstrip("\n") + "\n" for out in outputs) if split else outputs[0]


def _step_times(module_name: str, machine: cost_model.Machine):
    """A `Pipeline.after_pass` that prints the module's estimated step time (the cost model's IR
    estimate) after each pass, with its ratio to the input's."""
    first = []

    def price(step: str, module: hlo_tools.HloModule) -> None:
        where = f"estimated step on {machine.describe()}{'' if step == 'input' else ' after ' + step}"
        try:
            seconds = machine.step_time_s(module)
        except cost_model.CostModelError as exc:
            print(f"{module_name}: {where}: not priced: {exc}", file=sys.stderr)
            return
        if step == "input":
            first.append(seconds)
        ratio = f" ({seconds / first[0]:.2f}x the input's)" if step != "input" and first and first[0] else ""
        print(f"{module_name}: {where}: {seconds * 1e3:.4g} ms{ratio}", file=sys.stderr)

    return price


def _check(original: str, module: hlo_tools.HloModule, pipeline: Pipeline) -> None:
    """Translation validation of an offline rewrite (`validation.check_offline_rewrite`)."""
    verdict = validation.check_offline_rewrite(original, module.to_text(), pipeline.all_passes())
    if not verdict.checked:
        raise cli.CommandError(f"--check: {module.name}: {verdict.detail}")
    if not verdict.ok:
        raise cli.CommandError(f"--check: {module.name} after {pipeline} computes something else than before: "
                               f"{verdict.detail}")
    print(f"{PROG}: check: {module.name}: {verdict.detail.replace('the original module', 'the input module')}",
          file=sys.stderr)


def _machine(args: argparse.Namespace) -> cost_model.Machine | None:
    chosen = machine(args)
    if chosen is not None and not args.report:
        raise cli.CommandError("--topology prices the steps of --report: add --report")
    return chosen


def main(argv: list[str] | None = None) -> int:
    """Run `xla-opt` with `argv` (default: `sys.argv[1:]`); returns the exit status."""
    def body() -> int:
        args = build_parser().parse_args(argv)
        if args.list_passes:
            sys.stdout.write(list_passes())
            return 0
        if args.passes:
            Pipeline(args.passes)  # report a bad pipeline before reading any input
        if args.dump_to is not None and os.path.exists(args.dump_to) and not os.path.isdir(args.dump_to):
            raise cli.CommandError("--dump-to names a file, not a directory", args.dump_to)
        path = "<stdin>" if args.input == "-" else args.input
        text = cli.read_text(args.input)
        result = optimize(text, args.passes, path=path, split=args.split_input_file,
                          verify=args.verify, dump_to=args.dump_to, regenerate=args.regenerate,
                          report=args.report, check=args.check or check_requested(),
                          layouts_final=args.layouts_final,
                          machine=_machine(args))
        cli.write_output(result, args.output, args.input)
        return 0
    return cli.report_failures(PROG, body, (PassError,), exit_on_signal=True)


if __name__ == "__main__":
    sys.exit(main())
