"""The README's commands are the ones CI runs."""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The single-line commands in the README's ``sh`` code blocks."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", readme, flags=re.S)]


def test_readme_has_main_job_and_test_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in command for command in commands)
    main_job, tests = commands
    assert main_job == ("python3 -m venv .venv && .venv/bin/pip install -e '.[demo]' "
                        "&& .venv/bin/python -m xla_passes_demo")
    assert tests.endswith(".venv/bin/python -m pytest -q")


def _requirement_names(requirements) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_library_depends_on_jax_numpy_and_absl_alone():
    """The installed package needs jax, jaxlib, numpy, ml-dtypes and absl-py; flax and optax are
    the `demo` extra's (the model zoo and the demo), which the `test` extra includes."""
    project = _project()
    assert _requirement_names(project["dependencies"]) == {"jax", "jaxlib", "numpy", "ml-dtypes", "absl-py"}
    extras = project["optional-dependencies"]
    assert _requirement_names(extras["demo"]) == {"flax", "optax"}
    assert _requirement_names(extras["demo"]) <= _requirement_names(extras["test"])


def test_demo_install_brings_what_the_main_job_imports():
    """`pip install -e '.[demo]'` brings every package the demo and its model import."""
    imported = set()
    paths = sorted((ROOT / "xla_passes_demo").glob("*.py"))
    assert {path.name for path in paths} >= {"__main__.py", "demo.py", "training.py", "models.py", "dependencies.py"}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"hlo_tools", "xla_passes", "xla_passes_demo"}
    assert {"flax", "optax", "jax"} <= third_party
    providers = importlib.metadata.packages_distributions()
    needed = {distribution.lower() for module in third_party for distribution in providers[module]}
    project = _project()
    declared = _requirement_names(project["dependencies"] + project["optional-dependencies"]["demo"])
    assert needed <= declared


def test_ci_runs_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert readme_commands()[1] in ci_lines
    assert "set -euo pipefail" in ci_lines


def test_ci_script_is_executable():
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111
