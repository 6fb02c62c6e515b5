"""The ``hlo-tools`` command line.

Each subcommand lives in a command module listed in ``COMMAND_MODULES``; a
module exposes ``register(subparsers)``, which adds its subparser and sets the
``func(args) -> int`` default.  Adding a command is one line in that tuple.

Every failure is reported as a single line on stderr,
``hlo-tools: error: <file>:<line>:<col>: <message>``, with exit status 1
(argparse's usage errors keep their status 2); no traceback is ever shown.
SIGTERM and SIGHUP end a command as Ctrl-C does (child processes stopped,
temporary files removed), with exit status 128 + the signal's number; the
process then exits at once, as the signal's default action would, instead of
waiting in the interpreter's teardown for a computation XLA still runs.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import os
import signal
import sys
import threading
from contextlib import contextmanager

import hlo_tools
from hlo_tools.atomic_files import write_through_temp_file
from hlo_tools.ir.errors import one_line
from hlo_tools.ir.verifier import verify_shape_sizes

PROG = "hlo-tools"

COMMAND_MODULES = (
    "hlo_tools.cli.inspect_commands",
    "hlo_tools.cli.run_command",
    "hlo_tools.cli.dump_command",
    "hlo_tools.cli.stats_command",
    "hlo_tools.cli.diff_command",
    "hlo_tools.cli.graph_command",
    "hlo_tools.cli.report_command",
    "hlo_tools.cli.cost_command",
)


class CommandError(Exception):
    """A failure to report as one line, optionally located in a file."""

    def __init__(self, message: str, path: str | None = None,
                 line: int | None = None, column: int | None = None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.column = column

    def __str__(self) -> str:
        location = ":".join(str(part) for part in (self.path, self.line, self.column) if part is not None)
        return f"{location}: {self.message}" if location else self.message


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so that ``finally`` blocks stop child
    processes and remove temporary files and directories on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Signals that end a command the way Ctrl-C (SIGINT, KeyboardInterrupt) does.
TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum, _frame):
    raise Terminated(signum)


@contextmanager
def termination_unwinds():
    """While inside: SIGTERM and SIGHUP raise :class:`Terminated` in the main thread.

    Only signals left at their default action are taken over (one ignored under ``nohup``
    stays ignored, a caller's own handler stays); the previous handlers come back on exit.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in TERMINATION_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _display_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def read_text(path: str) -> str:
    """The exact text of ``path`` (``-`` is stdin); line endings are kept as they are, and a
    UTF-8 byte order mark at the start is dropped."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8").removeprefix("\ufeff")
        with open(path, encoding="utf-8", newline="") as f:
            return f.read().removeprefix("\ufeff")  # a byte order mark (Windows editors) is no text
    except UnicodeDecodeError as exc:
        raise CommandError(f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                           _display_name(path)) from exc


def located(exc: hlo_tools.HloParseError | hlo_tools.HloVerifyError,
            path: str | None) -> CommandError:
    """The one-line report of a parse or verify error found in the file ``path``."""
    if isinstance(exc, hlo_tools.HloParseError):
        return CommandError(one_line(exc.message), path, exc.line, exc.column)
    who = f"{exc.instruction}: " if exc.instruction else ""
    return CommandError(one_line(who + exc.message), path, exc.line)


def load_module(path: str, *, check_sizes: bool = False) -> hlo_tools.HloModule:
    """Read and parse the module in ``path``; parse errors carry the file's name.

    ``check_sizes``: refuse, as the verifier does, a shape whose dimensions or byte size int64 does
    not hold (for commands that multiply sizes out without verifying the module).
    """
    text = read_text(path)
    try:
        module = hlo_tools.parse_module(text)
        if check_sizes:
            verify_shape_sizes(module)
        return module
    except (hlo_tools.HloParseError, hlo_tools.HloVerifyError) as exc:
        raise located(exc, _display_name(path)) from exc


def verify_module(module: hlo_tools.HloModule, path: str) -> None:
    """Run the verifier; its errors carry the file's name and, when known, the line."""
    try:
        hlo_tools.verify(module)
    except hlo_tools.HloVerifyError as exc:
        raise located(exc, _display_name(path)) from exc


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (same path, or links to the same inode)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def write_output(text: str, out_path: str | None, input_path: str) -> None:
    """Write ``text`` to stdout, or atomically to ``out_path`` (temp file + rename).

    Refuses to overwrite the input file, so a failed run never loses the source.
    """
    if out_path is None or out_path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if input_path != "-" and _same_file(out_path, input_path):
        raise CommandError("refusing to overwrite the input file", out_path)
    write_atomically(out_path, text)


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory and a rename,
    so that readers never see a half-written file.

    A path that exists and is not a regular file (``/dev/null``, a FIFO) is written
    in place: a rename would replace the device itself.
    """
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), directory)
    write_through_temp_file(path, lambda f: f.write(text), binary=False)


def package_version() -> str:
    """The installed distribution's version (both CLIs print it with --version)."""
    try:
        return importlib.metadata.version("xla-passes")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command module's subcommand registered."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect and transform XLA HLO modules.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def report_failures(prog: str, body, expected_errors: tuple[type[Exception], ...] = (),
                    exit_on_signal: bool = False) -> int:
    """Run ``body()`` (returns the exit status); turn any failure into one line on stderr.

    ``expected_errors`` are the caller's own exception types whose ``str`` is the
    message to show (``CommandError`` and parse/verify errors always are).
    ``exit_on_signal``: after Ctrl-C, SIGTERM or SIGHUP (and the cleanup they unwind
    through), end the process with the status instead of returning it (a command's ``main``).
    """
    def error(message: str) -> int:
        print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
        return 1

    try:
        with termination_unwinds():
            return body()
    except CommandError as exc:
        return error(str(exc))
    except (hlo_tools.HloParseError, hlo_tools.HloVerifyError) as exc:
        return error(str(located(exc, None)))
    except expected_errors as exc:
        return error(str(exc))
    except BrokenPipeError:
        # Whoever read stdout stopped (`hlo-tools print x | head`): end quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return error(f"{where}{exc.strerror or one_line(str(exc))}")
    except Terminated as exc:
        error(f"terminated by {signal.Signals(exc.signum).name}")
        return _ended_by_signal(128 + exc.signum, exit_on_signal)  # as a shell reports a command a signal ended
    except KeyboardInterrupt:
        return _ended_by_signal(error("interrupted"), exit_on_signal)
    except Exception as exc:  # the last resort: still one line, never a traceback
        return error(f"internal error: {type(exc).__name__}: {one_line(str(exc))}")


def _ended_by_signal(status: int, exit_now: bool) -> int:
    """``status``, or the end of the process with it: an in-process run leaves its computation to
    XLA's threads, and the interpreter's teardown would wait for it to finish (forever, for a loop)."""
    if not exit_now:
        return status
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """Run ``hlo-tools`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    def body() -> int:
        args = build_parser().parse_args(argv)
        return args.func(args)
    return report_failures(PROG, body, exit_on_signal=True)
