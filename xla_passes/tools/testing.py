"""FileCheck regression tests in XLA's style, and the pytest plugin that collects them.

A test is an `.hlo` file with `// RUN:` lines and FileCheck directives::

    // RUN: xla-opt %s --passes=dce | FileCheck %s
    // CHECK-LABEL: ENTRY %e
    // CHECK-NOT: negate
    HloModule m
    ...

A RUN line is `[not] xla-opt ARGS [2>&1] | FileCheck %s [FILECHECK-ARGS]`;
`%s` is the test file. `not` expects xla-opt to fail (its error line goes to
FileCheck with `2>&1`). Both tools run in-process, and FileCheck is the
`filecheck` package from PyPI (a maintained port of LLVM's).

In a conftest.py: `from xla_passes.tools.testing import pytest_collect_file  # noqa: F401`.
"""
from __future__ import annotations

import contextlib
import io
import os
import shlex
import tempfile

import pytest

RUN_PREFIX = "// RUN:"


class RunLineError(Exception):
    """A RUN line this runner does not understand."""


def run_lines(text: str) -> list[str]:
    """The RUN commands of a test file (a trailing `\\` continues one onto the next line)."""
    commands, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith(RUN_PREFIX):
            continue
        body = stripped[len(RUN_PREFIX):].strip()
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        commands.append(pending + body)
        pending = ""
    if pending:
        commands.append(pending.strip())
    return commands


def _split_command(command: str, path: str) -> tuple[bool, list[str], bool, list[str]]:
    """(expect failure, xla-opt args, stderr into the pipe, FileCheck args) of one RUN line."""
    if command.count("|") != 1:
        raise RunLineError(f"expected 'xla-opt ... | FileCheck %s ...', got {command!r}")
    left, right = (shlex.split(part) for part in command.split("|"))
    expect_failure = bool(left) and left[0] == "not"
    if expect_failure:
        left = left[1:]
    merge_stderr = "2>&1" in left
    left = [arg for arg in left if arg != "2>&1"]
    if not left or left[0] != "xla-opt":
        raise RunLineError(f"the command must be xla-opt, got {command!r}")
    if not right or right[0] != "FileCheck":
        raise RunLineError(f"the pipe must go to FileCheck, got {command!r}")
    def substitute(args):
        return [path if arg == "%s" else arg for arg in args]
    return expect_failure, substitute(left[1:]), merge_stderr, substitute(right[1:])


def run_command(command: str, path: str) -> tuple[bool, str]:
    """Run one RUN line on the test file `path`; returns (passed, explanation when not)."""
    from .opt import main as xla_opt  # noqa: PLC0415 - keeps this module light to import

    expect_failure, opt_args, merge_stderr, check_args = _split_command(command, path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = xla_opt(opt_args)
    if (status != 0) != expect_failure:
        want = "fail" if expect_failure else "succeed"
        return False, f"xla-opt was expected to {want} (exit status {status}): {err.getvalue().strip()}"
    piped = out.getvalue() + (err.getvalue() if merge_stderr else "")
    return filecheck(piped, check_args)


def filecheck(text: str, args: list[str]) -> tuple[bool, str]:
    """Check `text` against FileCheck's check file and options in `args`; (passed, report)."""
    from filecheck.matcher import Matcher  # noqa: PLC0415
    from filecheck.options import parse_argv_options  # noqa: PLC0415

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        input_path = f.name
    try:
        options = parse_argv_options(["FileCheck", *args, "--input-file", input_path])
        report = io.StringIO()
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
            status = Matcher.from_opts(options).run()
        return status == 0, report.getvalue()
    finally:
        os.unlink(input_path)


# --- pytest plugin ---------------------------------------------------------------------------------

def pytest_collect_file(parent, file_path):
    """Collect every `.hlo` file with a RUN line as a test file (one test per RUN line)."""
    if file_path.suffix == ".hlo" and RUN_PREFIX in file_path.read_text(encoding="utf-8"):
        return HloTestFile.from_parent(parent, path=file_path)
    return None


class HloTestFile(pytest.File):
    def collect(self):
        commands = run_lines(self.path.read_text(encoding="utf-8"))
        for number, command in enumerate(commands, start=1):
            name = "RUN" if len(commands) == 1 else f"RUN{number}"
            yield HloTestItem.from_parent(self, name=name, command=command)


class HloTestItem(pytest.Item):
    def __init__(self, *, command: str, **kwargs):
        super().__init__(**kwargs)
        self.command = command

    def runtest(self):
        passed, report = run_command(self.command, str(self.path))
        if not passed:
            raise FileCheckFailure(report)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, (FileCheckFailure, RunLineError)):
            return f"{self.path}: {self.command}\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.path.name}::{self.name}"


class FileCheckFailure(Exception):
    """The output did not match the CHECK lines (the message is FileCheck's report)."""
