"""`xla-opt`: run a pass pipeline on HLO text, like XLA's `hlo-opt`.

    xla-opt IN.hlo --passes=all-reduce-combiner,dce -o OUT.hlo
    xla-opt --list-passes
    cat IN.hlo | xla-opt --passes=cse          # stdin to stdout
    xla-opt cases.hlo --split-input-file --passes=dce   # `// -----` separates modules

The output is written atomically and never over the input. Every failure is one
line on stderr (`xla-opt: error: ...`) and exit status 1; usage errors exit 2.
"""
from __future__ import annotations

import argparse
import re
import sys

import hlo_tools
from hlo_tools import cli

from .core import PassError, registered_passes
from .pipeline import Pipeline

PROG = "xla-opt"
SPLIT_MARKER = "// -----"
_HEADER = re.compile(r"^HloModule\b", re.M)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run xla_passes passes on an HLO module, like XLA's hlo-opt.")
    parser.add_argument("input", nargs="?", default="-", help="HLO text file, or - for stdin (default)")
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
                        help="print what passes that keep a report (weight-update-sharding) did, on stderr")
    parser.add_argument("--regenerate", action="store_true",
                        help="print every instruction from the IR in XLA's style, not only the changed ones")
    return parser


def list_passes() -> str:
    lines = []
    for name, cls in registered_passes().items():
        lines.append(f"{name:28} {cls.description()}")
        for field in cls.option_fields():
            kind = getattr(field.type, "__name__", field.type)
            lines.append(f"{'':30}{field.name}: {kind} = {field.default!r}")
    lines.append(f"{'fixed-point(...)':28} Repeat the passes in parentheses until none changes the module.")
    lines.append(f"{'':30}max_iterations: int = 25")
    return "\n".join(lines) + "\n"


def _chunks(text: str, split: bool) -> list[tuple[str, int]]:
    """(module text, number of lines before it in the file) for each module of the input."""
    if not split:
        return [(text, 0)]
    chunks, current, start = [], [], 0
    for number, line in enumerate(text.splitlines(keepends=True)):
        if line.strip() == SPLIT_MARKER:
            chunks.append(("".join(current), start))
            current, start = [], number + 1
        else:
            current.append(line)
    chunks.append(("".join(current), start))
    return chunks


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
             dump_to: str | None = None, regenerate: bool = False, report: bool = False) -> str:
    """The text of the module(s) in `text` after `passes` (CommandError on any failure)."""
    outputs = []
    for number, (chunk, offset) in enumerate(_chunks(text, split)):
        try:
            module = hlo_tools.parse_module(chunk)
            if verify:
                hlo_tools.verify(module)
        except (hlo_tools.HloParseError, hlo_tools.HloVerifyError) as exc:
            raise cli.located(_shifted(exc, offset), path) from exc
        if passes:
            pipeline = Pipeline(passes, verify=verify, dump_to=dump_to, module_number=number)
            pipeline.run(module)
            if report:
                for line in pipeline.reports():
                    print(f"{module.name}: {line}", file=sys.stderr)
        outputs.append(_without_leading_comments(module.to_text(regenerate=regenerate)))
    return f"\n{SPLIT_MARKER}\n".join(out.rstrip("\n") + "\n" for out in outputs) if split else outputs[0]


def main(argv: list[str] | None = None) -> int:
    """Run `xla-opt` with `argv` (default: `sys.argv[1:]`); returns the exit status."""
    def body() -> int:
        args = build_parser().parse_args(argv)
        if args.list_passes:
            sys.stdout.write(list_passes())
            return 0
        if args.passes:
            Pipeline(args.passes)  # report a bad pipeline before reading any input
        path = "<stdin>" if args.input == "-" else args.input
        text = cli.read_text(args.input)
        result = optimize(text, args.passes, path=path, split=args.split_input_file,
                          verify=args.verify, dump_to=args.dump_to, regenerate=args.regenerate,
                          report=args.report)
        cli.write_output(result, args.output, args.input)
        return 0
    return cli.report_failures(PROG, body, (PassError,))


if __name__ == "__main__":
    sys.exit(main())
