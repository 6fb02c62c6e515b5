"""Round trips of real modules from JAX, Flax/optax, XLA dumps, pass hooks and TensorFlow.

For every generated module: the faithful print is byte-for-byte the input, the
verifier accepts it, and XLA reads the regenerated print as the same module.
Each test covers one source of modules and lists every module that fails.
"""

from collections.abc import Callable

import pytest

import hlo_tools
from hlo_tools.xla import xla_bridge
from support import first_difference

SOURCES = ["jax_modules", "pass_hook_modules", "xla_dump_modules", "tf_modules"]


def failures(modules: dict[str, str], check: Callable[[str], str | None]) -> str:
    """Run ``check`` on every module; '' if all pass, else one 'name: problem' line per failure."""
    found = []
    for name, text in modules.items():
        try:
            problem = check(text)
        except Exception as exc:  # report every module, not just the first to raise
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if problem:
            found.append(f"{name}: {problem}")
    return "\n".join(found)


def faithful_print(text: str) -> str | None:
    printed = hlo_tools.parse_module(text).to_text()
    return None if printed == text else first_difference(text, printed)


def verifies(text: str) -> None:
    hlo_tools.verify(hlo_tools.parse_module(text))


def regenerated_means_the_same(text: str) -> str | None:
    regenerated = hlo_tools.parse_module(text).to_text(regenerate=True)
    if xla_bridge.same_meaning(regenerated, text):
        return None
    return "XLA reads the regenerated print differently: " + first_difference(
        xla_bridge.canonical_text(text), xla_bridge.canonical_text(regenerated))


@pytest.mark.parametrize("source", SOURCES)
def test_faithful_print_is_byte_exact(source, request):
    modules = request.getfixturevalue(source)
    assert modules
    problems = failures(modules, faithful_print)
    assert not problems, problems


@pytest.mark.parametrize("source", SOURCES)
def test_verifier_accepts(source, request):
    problems = failures(request.getfixturevalue(source), verifies)
    assert not problems, problems


@pytest.mark.parametrize("source", SOURCES)
def test_regenerated_print_means_the_same_to_xla(source, request):
    problems = failures(request.getfixturevalue(source), regenerated_means_the_same)
    assert not problems, problems
