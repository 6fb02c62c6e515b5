"""The README's commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The single-line commands in the README's ``sh`` code blocks."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", readme, flags=re.S)]


def test_readme_has_main_job_and_test_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in command for command in commands)
    main_job, tests = commands
    assert main_job.endswith(".venv/bin/python examples/roundtrip.py")
    assert tests.endswith(".venv/bin/python -m pytest -q")


def test_ci_runs_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert readme_commands()[1] in ci_lines
    assert "set -euo pipefail" in ci_lines


def test_ci_script_is_executable():
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111
