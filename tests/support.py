"""Helpers shared by the test modules."""

import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS_DIR = REPO_ROOT.parent / "shared" / "corpus" / "xla_tests"

# OpenXLA's test modules are there on the development machines only (users and CI lack them).
needs_corpus = pytest.mark.skipif(not CORPUS_DIR.is_dir(), reason=f"no corpus at {CORPUS_DIR}")


def read_exact(path) -> str:
    """A file's text with its line endings and leading blank lines untouched."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def first_difference(expected: str, actual: str) -> str:
    """Where two texts first differ, as 'line N: expected ... got ...'."""
    expected_lines = expected.splitlines(keepends=True)
    actual_lines = actual.splitlines(keepends=True)
    for number, (want, got) in enumerate(zip(expected_lines, actual_lines), start=1):
        if want != got:
            return f"line {number}: expected {want[:160]!r}, got {got[:160]!r}"
    return (f"same first {min(len(expected_lines), len(actual_lines))} lines, then "
            f"{len(expected)} vs {len(actual)} characters in all")


def run_hlo_tools(capsys, *argv):
    """(exit status, stdout, stderr) of ``hlo-tools argv``, run in this process."""
    from hlo_tools import cli  # noqa: PLC0415 - only the CLI tests need it

    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err
