"""flax and optax belong to the `demo` extra: every library module imports without them, and the
model zoo and the demo (`xla_passes_demo`, beside the library) say, in one line, which extra to
install.

Each check runs in a child process that makes `import flax` and `import optax` fail
(`sys.modules[name] = None`), whatever this environment has installed.
"""

import os
import subprocess
import sys

import pytest

from test_architecture import ROOT, module_files

DEMO_PACKAGE = "xla_passes_demo"
# Every module of the demo package but its __init__ (which imports none of them).
ZOO = tuple(name for name in module_files() if name.startswith(DEMO_PACKAGE + "."))
NOT_IMPORTED = {"hlo_tools.__main__"}  # runs the command line when imported
WITHOUT_FLAX = "import sys\nsys.modules['flax'] = sys.modules['optax'] = None\n"
INSTALL = "pip install 'xla-passes[demo]'"


def run_without_flax(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", WITHOUT_FLAX + code], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


def test_every_library_module_imports_without_flax_and_optax():
    library = sorted(set(module_files()) - set(ZOO) - NOT_IMPORTED)
    assert {"xla_passes.jax", "xla_passes.frontends.jax", "xla_passes.tools.opt", "hlo_tools.ir.parser",
            DEMO_PACKAGE} <= set(library)
    assert {"xla_passes_demo.models", "xla_passes_demo.training", "xla_passes_demo.demo",
            "xla_passes_demo.dependencies", "xla_passes_demo.__main__"} <= set(ZOO)
    done = run_without_flax(f"import importlib\nfor name in {library!r}:\n    importlib.import_module(name)\n"
                            "assert sys.modules['flax'] is None and sys.modules['optax'] is None\n")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("module", ZOO)
def test_zoo_and_demo_say_which_extra_to_install(module):
    done = run_without_flax(f"import {module}\n")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: xla_passes_demo ") and "flax and optax" in last and INSTALL in last, done.stderr


@pytest.mark.parametrize("module", [DEMO_PACKAGE, DEMO_PACKAGE + ".demo"])
def test_demo_command_fails_with_one_line(module):
    """`python -m xla_passes_demo` and `python -m xla_passes_demo.demo`."""
    done = run_without_flax(f"import runpy\nrunpy.run_module({module!r}, run_name='__main__')\n")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("python -m xla_passes_demo: error: "), done.stderr
    assert "demo extra" in done.stderr and INSTALL in done.stderr
