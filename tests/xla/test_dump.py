"""hlo_tools.xla.dump and ``hlo-tools dump``: JAX, TF and script dumps named as XLA names them.

JAX dumps through the API run in this process (8 CPU devices, see conftest);
the command line, TensorFlow and script runs each run in a fresh process.
"""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_tools
import real_programs
from hlo_tools.xla import dump, runner
from support import REPO_ROOT, alive_in_session, kill_session, read_exact

ERROR_LINE = re.compile(r"hlo-tools: error: [^\n]+\n")
BEFORE = re.compile(r"module_(\d{4})\.(.+)\.before_optimizations\.txt")
AFTER = re.compile(r"module_(\d{4})\.(.+)\.cpu_after_optimizations\.txt")

JAX_FILE = """import jax.numpy as jnp

def predict(w, x):
    return jnp.tanh(x @ w)
"""

TF_FILE = """import tensorflow as tf

w = tf.Variable(tf.ones([16, 4]))

@tf.function(jit_compile=True)
def predict(x):
    return tf.tanh(tf.matmul(x, w))


@tf.function
def without_xla(x):
    return x + 1
"""

# Compiles a jitted function, prints the device count it got, exits with status argv[1].
SCRIPT = """import sys
import jax
import jax.numpy as jnp

@jax.jit
def train_step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

print("devices:", jax.device_count(), "sum:", float(train_step(jnp.ones((4, 2)), jnp.ones((3, 4))).sum()))
sys.exit(int(sys.argv[1]))
"""


def hlo_tools_cli(*argv, cwd, env=None, timeout=180):
    """``python -m hlo_tools ARGV`` in a fresh process: (status, stdout, stderr).

    The process gets this one's environment without the test's XLA_FLAGS (8 devices),
    updated with ``env``.
    """
    child_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child_env.update(env or {}, TF_CPP_MIN_LOG_LEVEL="2")
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "hlo_tools", *map(str, argv)], cwd=cwd, env=child_env,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def check_module_file(path) -> hlo_tools.HloModule:
    """Parse and verify a dumped file; the name in the file name is the module's, sanitized."""
    text = read_exact(path)
    module = hlo_tools.parse_module(text)
    hlo_tools.verify(module)
    name = (BEFORE.fullmatch(os.path.basename(path)) or AFTER.fullmatch(os.path.basename(path))).group(2)
    assert name == dump.sanitize_file_name(module.name)
    return module


def names(paths) -> list[str]:
    return [os.path.basename(p) for p in paths]


# --- Names ----------------------------------------------------------------------------------------


def test_file_names_follow_xla():
    assert dump.sanitize_file_name("jit_f/a b[1]\\c") == "jit_f_a_b_1__c"
    assert dump.module_file_name(3, "jit_step", "before_optimizations.txt") == \
        "module_0003.jit_step.before_optimizations.txt"
    assert dump.module_file_name(12345, "m", "x") == "module_12345.m.x"
    assert dump.xla_flags_for_dump("/d", "--xla_force_host_platform_device_count=2") == (
        '--xla_dump_large_constants --xla_force_host_platform_device_count=2 '
        '--xla_dump_to="/d" --xla_dump_hlo_as_text')


# --- JAX, through the API -------------------------------------------------------------------------


def test_jax_dump_before_and_after(tmp_path):
    def predict(w, x):
        return jnp.tanh(x @ w)

    f32 = jnp.float32
    files = dump.dump_jax(predict, jax.ShapeDtypeStruct((16, 4), f32), jnp.ones((8, 16)),
                          out_dir=str(tmp_path / "new"))
    assert names(files) == ["module_0000.jit_predict.before_optimizations.txt",
                            "module_0000.jit_predict.cpu_after_optimizations.txt"]
    before, after = map(check_module_file, files)
    assert "is_scheduled=true" in after.to_text() and "is_scheduled" not in before.to_text()
    assert sorted(os.listdir(tmp_path / "new")) == names(files)  # nothing else, no staging left


def test_numbering_continues_and_nothing_is_overwritten(tmp_path, monkeypatch):
    (tmp_path / "module_0041.other.before_optimizations.txt").write_text("not mine\n")
    (tmp_path / "notes.txt").write_text("mine\n")

    def double(x):
        return x * 2

    files = dump.dump_jax(jax.jit(double), jnp.ones(4), out_dir=str(tmp_path), stage="before")
    assert names(files) == ["module_0042.jit_double.before_optimizations.txt"]
    files = dump.dump_jax(double, jnp.ones(4), out_dir=str(tmp_path), stage="after")
    assert names(files) == ["module_0043.jit_double.cpu_after_optimizations.txt"]

    # Another dump takes the number this one picked: it moves on instead of replacing the file.
    monkeypatch.setattr(dump, "next_module_number", lambda out_dir: 43)
    (tmp_path / "module_0043.jit_double.before_optimizations.txt").write_text("raced\n")
    files = dump.dump_jax(double, jnp.ones(4), out_dir=str(tmp_path))
    assert names(files)[0].startswith("module_0044.jit_double.")
    assert (tmp_path / "module_0043.jit_double.before_optimizations.txt").read_text() == "raced\n"
    assert (tmp_path / "module_0041.other.before_optimizations.txt").read_text() == "not mine\n"
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left behind


def test_sharded_jax_dump_runs_like_jax(tmp_path):
    """A dump of an 8-device jit step is complete: it runs and gives jax's own results."""
    fn, args = real_programs.jit_named_sharding_step()
    before_path, after_path = dump.dump_jax(fn, *args, out_dir=str(tmp_path))
    before = check_module_file(before_path).to_text()
    check_module_file(after_path)
    assert "num_partitions=8" in before.splitlines()[0]
    result = runner.run_module(before, seed=1)
    expected = jax.tree.leaves(fn(*result.inputs))
    assert result.mode == "partition"
    for got, want in zip(result.outputs, expected):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_large_constants_are_dumped_in_full(tmp_path):
    table = np.arange(100, dtype=np.float32)
    (path,) = dump.dump_jax(lambda x: x + table, jnp.ones(100), out_dir=str(tmp_path), stage="before")
    text = check_module_file(path).to_text()
    assert "{...}" not in text
    (out,) = runner.run_module(text, [np.ones(100, np.float32)]).outputs
    np.testing.assert_array_equal(out, table + 1)


def test_bad_stage_and_output_file(tmp_path):
    with pytest.raises(dump.DumpError, match="stage must be one of before, after, both"):
        dump.dump_jax(jnp.sin, jnp.ones(2), out_dir=str(tmp_path), stage="middle")
    (tmp_path / "file").write_text("")
    with pytest.raises(dump.DumpError, match="file: not a directory"):
        dump.dump_jax(jnp.sin, jnp.ones(2), out_dir=str(tmp_path / "file"))


# --- The command line -----------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    """Source files in tmp_path (the working directory of the runs)."""
    (tmp_path / "jax_fn.py").write_text(JAX_FILE)
    (tmp_path / "tf_fn.py").write_text(TF_FILE)
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "plain.py").write_text("def f(x):\n    return x\n\nvalue = 3\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
  # A tensorflow that cannot be imported: the JAX path must not need TensorFlow.
    (tmp_path / "no_tf" / "tensorflow").mkdir(parents=True)
    (tmp_path / "no_tf" / "tensorflow" / "__init__.py").write_text("raise ImportError('no TF here')\n")
    return tmp_path


def test_cli_dumps_a_jax_function_without_tensorflow(files):
    env = {"PYTHONPATH": str(files / "no_tf")}
    status, out, err = hlo_tools_cli("dump", "-o", "out", "--function", "jax_fn.py:predict",
                                     "--args", "f32[16,4]", "bf16[8,16]", cwd=files, env=env)
    assert (status, err) == (0, ""), err
    assert out.split() == ["out/module_0000.jit_predict.before_optimizations.txt",
                           "out/module_0000.jit_predict.cpu_after_optimizations.txt"]
    before = check_module_file(files / out.split()[0])
    assert [p.shape.to_text(print_layout=False) for p in before.entry.parameters] == \
        ["f32[16,4]", "bf16[8,16]"]


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")
def test_cli_dumps_a_tf_function_and_reports_tf_errors(files):
    status, out, err = hlo_tools_cli("dump", "-o", "out", "--function", "tf_fn.py:predict",
                                     "--args", "f32[8,16]", cwd=files)
    assert status == 0, err
    paths = out.split()
    assert [re.sub(r"_\d+__", "_N__", p) for p in paths] == [
        "out/module_0000.a_inference_predict_N__.1.before_optimizations.txt",
        "out/module_0000.a_inference_predict_N__.1.cpu_after_optimizations.txt"]
    for path in paths:
        check_module_file(files / path)

    # TF's C++ logging may add lines of its own; the error is still one line, and no traceback.
    status, out, err = hlo_tools_cli("dump", "-o", "out", "--function", "tf_fn.py:without_xla",
                                     "--args", "f32[8]", cwd=files)
    assert status == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [
        "hlo-tools: error: tf_fn.py: without_xla: ValueError: Compiler IR can only be returned for "
        "functions marked with 'jit_compile=True'"]


def test_cli_script_run(files):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    status, out, err = hlo_tools_cli("dump", "-o", "dumps", "--", sys.executable, "script.py", "0",
                                     cwd=files, env=env)
    assert status == 0, err
    assert "devices: 2 sum:" in out  # the user's XLA_FLAGS reached the child
    listed = [line for line in out.splitlines() if line.startswith("dumps/")]
    step = [p for p in listed if ".jit_train_step." in p]
    assert len(step) == 2 and BEFORE.fullmatch(os.path.basename(step[0])) \
        and AFTER.fullmatch(os.path.basename(step[1]))
    for path in listed:
        check_module_file(files / path)
    summary = out.splitlines()[-1]
    assert re.fullmatch(rf"\d+ modules in dumps: {len(listed)} HLO files and \d+ other files XLA wrote",
                        summary)
    first_run = set(os.listdir(files / "dumps"))

    # A failing child: its status passes through, its modules are still kept, after the first run's.
    status, out, err = hlo_tools_cli("dump", "-o", "dumps", "--", sys.executable, "script.py", "3",
                                     cwd=files)
    assert status == 3, err
    assert "devices: 1 sum:" in out
    new = set(os.listdir(files / "dumps")) - first_run
    highest_first = max(int(n[len("module_"):].split(".")[0]) for n in first_run)
    assert new and all(int(n[len("module_"):].split(".")[0]) > highest_first for n in new)
    assert first_run <= set(os.listdir(files / "dumps"))


# Every documented failure: (arguments, what the one stderr line says).
ERRORS = [
    (["dump", "-o", "out", "--function", "missing.py:f"], r"missing\.py: No such file or directory"),
    (["dump", "-o", "out", "--function", "plain.py:nope"], r"plain\.py: no function named 'nope'"),
    (["dump", "-o", "out", "--function", "plain.py:value"], r"plain\.py: value is not a function \(int\)"),
    (["dump", "-o", "out", "--function", "plain.py"], r"--function takes FILE\.py:NAME, not 'plain\.py'"),
    (["dump", "-o", "out", "--function", "broken.py:f"],
     r"broken\.py: importing it failed: SyntaxError: "),
    (["dump", "-o", "out", "--function", "jax_fn.py:predict", "--args", "f32[16,4", "f32[8,16]"],
     r"--args 'f32\[16,4': "),
    (["dump", "-o", "out", "--function", "jax_fn.py:predict", "--args", "(f32[2], f32[3])"],
     r"an argument is an array shape, not a tuple"),
    (["dump", "-o", "out", "--function", "jax_fn.py:predict", "--args", "f32[16,4]", "f32[8,15]"],
     r"jax_fn\.py: predict: TypeError: dot_general requires contracting dimensions to have the same "
     r"shape, got \(15,\) and \(16,\)\."),
    (["dump", "-o", "out", "--", "no-such-command-hlo-tools"], r"no-such-command-hlo-tools: command not found"),
    (["dump", "-o", "plain.py", "--", sys.executable, "-c", "pass"], r"plain\.py: not a directory"),
    (["dump", "-o", "out"], r"nothing to dump: give a command after -- or --function FILE\.py:NAME"),
    (["dump", "-o", "out", "--function", "plain.py:f", "--", "ls"], r"give either a command"),
    (["dump", "-o", "out", "--stage", "before", "--", "ls"], r"--args and --stage go with --function"),
]


@pytest.mark.parametrize("argv,message", ERRORS, ids=[" ".join(a[3:]) for a, _ in ERRORS])
def test_every_error_is_one_line(files, argv, message):
    status, out, err = hlo_tools_cli(*argv, cwd=files)
    assert status != 0
    assert ERROR_LINE.fullmatch(err), f"not exactly one error line: {err!r}"
    assert re.search(message, err[len("hlo-tools: error: "):]), err
    assert not (files / "out").exists() or not os.listdir(files / "out")


# A script that says it runs, writes a file as XLA's dump would, then waits to be stopped.
WAITING_SCRIPT = """import os, sys, time
dump_dir = os.environ["XLA_FLAGS"].split('--xla_dump_to="')[1].split('"')[0]
with open(os.path.join(dump_dir, "module_0000.waiting.before_optimizations.txt"), "w") as f:
    f.write("HloModule waiting\\n")
print(os.getpid(), flush=True)
time.sleep(120)
"""


def test_terminating_a_script_dump_stops_the_script_and_keeps_its_files(tmp_path):
    import signal
    import time

    (tmp_path / "waiting.py").write_text(WAITING_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "hlo_tools", "dump", "-o", "dumps", "--",
                             sys.executable, "waiting.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    script_pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err == "hlo-tools: error: terminated by SIGTERM\n"
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{script_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{script_pid}"), "the script outlived the command"
    # the staging directory is gone; what the script wrote was moved into place
    assert os.listdir(tmp_path / "dumps") == ["module_0000.waiting.before_optimizations.txt"]


# Waits to be stopped; SIGTERM does not stop it (SIGINT does, at once), and it runs under a shell
# that would start more after it: a grandchild of the command.
TRAPPING_SCRIPT = """import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_DFL)
print(os.getpid(), flush=True)
time.sleep(120)
"""



@pytest.mark.parametrize("signals, status, message", [
    (["SIGTERM", "SIGTERM"], 128 + 15, "terminated by SIGTERM"),  # the second one ends the grace period
    (["SIGINT"], 1, "interrupted"),                               # to the command alone, not its group
])
def test_a_signal_to_a_script_dump_ends_every_process_it_started(tmp_path, signals, status, message):
    import signal
    import time

    (tmp_path / "trapping.py").write_text(TRAPPING_SCRIPT)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(private_tmp))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # The command starts with SIGINT at its default even where this suite runs with it ignored (a
    # background job of a shell without job control): a child keeps an ignored signal ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "hlo_tools", "dump", "-o", "dumps", "--", "bash", "-c",
                                 f"{sys.executable} trapping.py; sleep 120"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        int(proc.stdout.readline())  # the script runs
        start = time.monotonic()
        for name in signals:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.5)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < dump.TERMINATION_GRACE_SECONDS
        assert (proc.returncode, err) == (status, f"hlo-tools: error: {message}\n")
        deadline = time.monotonic() + 10
        while alive_in_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive_in_session(proc.pid), "a process the command started outlived it"
        assert list(private_tmp.iterdir()) == [] and os.listdir(tmp_path / "dumps") == []
    finally:
        kill_session(proc)


def test_a_held_directory_lock_delays_one_dump_and_then_none(tmp_path, monkeypatch, caplog):
    """Anyone who can read a dump directory can hold its lock: a writer waits for it a bounded
    time, warns once, and it and every later one number their files without it (issue 24)."""
    import fcntl
    import threading
    import time

    monkeypatch.setattr(dump, "LOCK_TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(dump, "_held_elsewhere", set())
    (tmp_path / "module_0000.old.before_optimizations.txt").write_text("not mine\n")
    holder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    numbers, times = [], []

    def dump_three():
        for i in range(3):
            start = time.monotonic()
            numbers.append(dump.write_numbered(str(tmp_path), 0, "m.after_dce.txt", f"{i}\n"))
            times.append(time.monotonic() - start)

    try:
        with caplog.at_level("WARNING", logger="hlo_tools.xla.dump"):
            writer = threading.Thread(target=dump_three, daemon=True)
            writer.start()
            writer.join(timeout=20)
            assert not writer.is_alive(), "a dump waits for the lock for good"
    finally:
        os.close(holder)
    assert numbers == [1, 2, 3] and times[0] >= 0.5 and max(times[1:]) < 0.5
    assert [(tmp_path / f"module_000{n}.m.after_dce.txt").read_text() for n in numbers] == ["0\n", "1\n", "2\n"]
    warnings = [r.getMessage() for r in caplog.records if "lock" in r.getMessage()]
    assert len(warnings) == 1 and "numbered without it" in warnings[0]
