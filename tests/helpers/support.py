"""Helpers shared by the test modules."""

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

HELPERS_DIR = pathlib.Path(__file__).resolve().parent  # tests/helpers: the modules the tests import
REPO_ROOT = HELPERS_DIR.parent.parent
CORPUS_DIR = REPO_ROOT.parent / "shared" / "corpus" / "xla_tests"

# XLA's flags in every JAX and TF process of the tests: 8 CPU devices, and XLA's LLVM backend at -O0.
# The tests check what XLA and the passes compute, not how fast XLA's code runs: at -O0 a small
# program compiles 2.7 times faster (a truncated-normal initializer: 239 ms against 653 ms) and a
# Flax ResNet's 83 programs 40% faster, while the module XLA hands the pass hook is the same byte for
# byte (166 dumped modules of the Flax ResNet's training, before and after the passes). Benchmarks,
# the demo and users run at XLA's default level, and so do the Keras spatial test's float64 runs:
# XLA:CPU emits depthwise and float64 convolutions as loops of its own, which run slower at -O0 (the
# full EfficientNetB0's float64 spatial test: 215 s at the default level, 572 s at -O0). The
# test-size Keras applications (keras_applications.py) train faster at -O0 in float32: 10-14 s a
# plain run against 14-18 s at the default level, the ResNet, EfficientNet, MobileNetV3 and ConvNeXt
# alike.
DEVICES = 8
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def xla_flags_for_tests(*extra: str, devices: int = DEVICES, fast_compile: bool = True) -> str:
    """XLA_FLAGS for a test's JAX or TF process: `devices` CPU devices, -O0 unless not
    `fast_compile`, then `extra`."""
    return " ".join([f"--xla_force_host_platform_device_count={devices}",
                     *([FAST_COMPILE_FLAG] if fast_compile else []), *extra])


# OpenXLA's test modules are there on the development machines only (users and CI lack them).
needs_corpus = pytest.mark.skipif(not CORPUS_DIR.is_dir(), reason=f"no corpus at {CORPUS_DIR}")


@contextlib.contextmanager
def unless_xla_dropped_the_opcode():
    """Skips the rest of a test where this jaxlib's XLA refuses an opcode that it has dropped and hlo_tools keeps
    for older modules (`domain`: jaxlib 0.12's parser no longer knows it)."""
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    try:
        yield
    except xla_bridge.XlaBridgeError as exc:
        dropped = re.search(r"Unknown opcode: ([\w-]+)", str(exc))
        if not dropped:
            raise
        pytest.skip(f"this jaxlib's XLA no longer knows the {dropped.group(1)} opcode (hlo_tools keeps it for older "
                    f"modules)")


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


def run_keras_tf_child(script: str, target: pathlib.Path, *args: str, timeout: int, **env: str) -> dict:
    """Run `script TARGET ARGS...` in a child process with Keras on its TF backend (Keras picks its
    backend when it is imported), the repository and tests/helpers (the script imports this module)
    on its path and no XLA_PASSES* settings of the caller's, plus `env`; the JSON it wrote to TARGET.
    A failing child fails the test with its stderr."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    path = [str(REPO_ROOT), str(HELPERS_DIR), os.environ.get("PYTHONPATH")]
    full_env.update(TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
                    PYTHONPATH=os.pathsep.join(filter(None, path)), **env)
    done = subprocess.run([sys.executable, os.path.abspath(script), str(target), *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(pathlib.Path(target).read_text(encoding="utf-8"))


def process_stats():
    """(pid, the fields of /proc/pid/stat after the command name: state, parent, group, session...)
    of every process still there."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    yield int(entry), f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue


def alive_in_session(sid: int) -> list[int]:
    """The processes of session `sid` that have not ended (a zombie has), from /proc: a command
    started with `start_new_session=True` leads session `proc.pid`, and so does all it starts."""
    return [pid for pid, fields in process_stats() if int(fields[3]) == sid and fields[0] != "Z"]


def kill_session(proc: subprocess.Popen) -> None:
    """Kill what is left of the process group of `proc`, started with `start_new_session=True`."""
    import signal  # noqa: PLC0415

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
