"""Test setup: 8 CPU devices for JAX, and session-wide fixtures of real HLO modules."""

import os
import sys

# The test folders follow the code (ir/, xla/, inspection/, cli/, passes/, frontends/, tools/,
# models/, demo/, properties/, project/); what they share lives apart: helpers/ (modules the tests
# and workers import) and workers/ (scripts the tests run as subprocesses, some of whose constants
# the tests import).
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
for _folder in ("workers", "helpers"):
    _path = os.path.join(_TESTS_DIR, _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)

import support  # noqa: E402

# XLA reads XLA_FLAGS once, when its first backend starts: set it before anything imports jax. The
# tests' flags (support.xla_flags_for_tests: 8 devices, -O0) after the caller's, each once (xdist's
# workers inherit the flags their controller set).
_given = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_given + [f for f in support.xla_flags_for_tests().split() if f not in _given])
os.environ["JAX_PLATFORMS"] = "cpu"

import collections  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402

import real_programs  # noqa: E402
from xla_passes.tools.testing import pytest_collect_file  # noqa: E402, F401 - collects the .hlo FileCheck tests


@pytest.fixture(scope="session")
def jax_modules() -> dict[str, str]:
    """HLO of the JAX programs (shard_map, pmap, NamedSharding, Flax/optax, loops, cond)."""
    return real_programs.jax_programs()


@pytest.fixture(scope="session")
def pass_hook_modules() -> dict[str, str]:
    """Modules that XLA hands to a registered pass hook."""
    return real_programs.pass_hook_programs()


@pytest.fixture(scope="session")
def xla_dump_modules(tmp_path_factory) -> dict[str, str]:
    """HLO modules from an ``--xla_dump_to`` dump, including per-pass dumps."""
    return real_programs.xla_dump_programs(str(tmp_path_factory.mktemp("xla_dump")))


@pytest.fixture(scope="session")
def tf_modules(tmp_path_factory) -> dict[str, str]:
    """HLO of TensorFlow XLA functions; skipped where TensorFlow is not installed."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed (pip install -e '.[tensorflow]')")
    return real_programs.tf_programs(str(tmp_path_factory.mktemp("tf")))


@pytest.fixture(scope="session")
def real_modules(jax_modules, pass_hook_modules, xla_dump_modules) -> dict[str, str]:
    """Every module generated with JAX (programs, pass hook, XLA dump), by name."""
    return {**jax_modules, **pass_hook_modules, **xla_dump_modules}


@pytest.fixture(scope="session")
def compilation_cache_env(tmp_path_factory) -> dict[str, str]:
    """Environment for JAX worker processes: one persistent compilation cache per session (each
    xdist worker its own, which its tests use one process at a time), so that the hundreds of small
    programs Keras compiles to build a model compile once, not in every worker process. Runs with
    passes get their own entries (xla_passes puts its settings in the cache key), and a run with
    a dump directory of its own never meets another's."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-compilation-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}



def pytest_collection_modifyitems(items) -> None:
    """The files likely to take longest first, each file's tests in their order: those with `slow` tests, then
    those with hypothesis tests, then the others by their number of tests. pytest-xdist hands the two workers
    whole files in this order (`--dist loadfile --no-loadscope-reorder`), and a long file started last would
    leave one worker running it alone at the end (xdist's own order, by number of tests, put the real-model
    tests last)."""
    count, slow, hypothesis = collections.Counter(), set(), set()
    for item in items:
        count[item.path] += 1
        if item.get_closest_marker("slow"):
            slow.add(item.path)
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            hypothesis.add(item.path)
    items.sort(key=lambda item: (item.path not in slow, item.path not in hypothesis, -count[item.path]))
