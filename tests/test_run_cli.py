"""``hlo-tools run``: real runs through the command line, and every documented error as one line."""

import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from hlo_tools import xla_bridge
from support import REPO_ROOT
from test_runner import CRASHING, PER_DEVICE_4, PER_DEVICE_8, SINGLE_DEVICE, per_device_8_expected

ERROR_LINE = re.compile(r"hlo-tools: error: [^\n]+\n")

# Runs for ages: 2^62 steps of a loop XLA cannot shortcut.
ENDLESS = """HloModule endless

cond {
  c = (s64[], f32[]) parameter(0)
  i = s64[] get-tuple-element(c), index=0
  limit = s64[] constant(4611686018427387904)
  ROOT lt = pred[] compare(i, limit), direction=LT
}

body {
  b = (s64[], f32[]) parameter(0)
  i = s64[] get-tuple-element(b), index=0
  x = f32[] get-tuple-element(b), index=1
  one = s64[] constant(1)
  next = s64[] add(i, one)
  y = f32[] sine(x)
  ROOT t = (s64[], f32[]) tuple(next, y)
}

ENTRY main {
  start = s64[] parameter(0)
  x0 = f32[] parameter(1)
  init = (s64[], f32[]) tuple(start, x0)
  w = (s64[], f32[]) while(init), condition=cond, body=body
  ROOT r = f32[] get-tuple-element(w), index=1
}
"""


def hlo_tools(*argv, cwd, timeout=180):
    """``python -m hlo_tools run ARGV`` in a fresh process: (status, stdout, stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "hlo_tools", "run", *map(str, argv)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def files(tmp_path):
    """Modules and input files in tmp_path (the working directory of the runs)."""
    (tmp_path / "per4.hlo").write_text(PER_DEVICE_4)
    (tmp_path / "per8.hlo").write_text(PER_DEVICE_8)
    (tmp_path / "single.hlo").write_text(SINGLE_DEVICE)
    (tmp_path / "changed.hlo").write_text(SINGLE_DEVICE.replace("constant(0)", "constant(1)"))
    (tmp_path / "crash.hlo").write_text(CRASHING)
    (tmp_path / "endless.hlo").write_text(ENDLESS)
    (tmp_path / "bad.hlo").write_text(
        "HloModule bad\n\nENTRY main {\n  p = f32[4] parameter(0)\n  ROOT a = f32[4] addd(p, p)\n}\n")
    n = 10000
    (tmp_path / "deep.hlo").write_text(
        f"HloModule deep\nENTRY main {{\n  ROOT p = {'(' * n}f32[]{')' * n} parameter(0)\n}}\n")
    (tmp_path / "per4.pb").write_bytes(xla_bridge.text_to_proto(PER_DEVICE_4))
    (tmp_path / "junk.npz").write_text("not an npz file\n")
    np.savez(tmp_path / "good.npz", arg0=np.arange(24, dtype=np.float32).reshape(8, 3))
    np.savez(tmp_path / "wrong_shape.npz", arg0=np.zeros((4, 3), np.float32))
    np.savez(tmp_path / "wrong_dtype.npz", arg0=np.zeros((8, 3), np.float64))
    np.savez(tmp_path / "two.npz", arg0=np.zeros((8, 3), np.float32), arg1=np.zeros(3, np.float32))
    np.savez(tmp_path / "named.npz", x=np.zeros((8, 3), np.float32))
    return tmp_path


def test_run_writes_global_outputs(files):
    status, out, err = hlo_tools("per4.hlo", "--inputs", "good.npz", "--output", "out.npz",
                                 "--print_literals", cwd=files)
    assert (status, err) == (0, ""), err
    assert "per4.hlo: 4 partitions, per-device module" in out and "out0: f32[2,3]" in out
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    with np.load(files / "out.npz") as data:
        assert data.files == ["out0"]
        np.testing.assert_array_equal(data["out0"], (x * x).reshape(4, 2, 3).sum(0))


def test_reference_identical_modules_pass(files):
    status, out, err = hlo_tools("per4.hlo", "--reference", "single.hlo", cwd=files)
    assert (status, err) == (0, ""), err
    assert "out0: f32[2,3] OK" in out and "the output matches the reference" in out
    status, out, err = hlo_tools("single.hlo", "--reference", "single.hlo", cwd=files)
    assert (status, err) == (0, ""), err


def test_reference_with_a_changed_constant_fails(files):
    status, out, err = hlo_tools("per4.hlo", "--reference", "changed.hlo", cwd=files)
    assert status == 1
    assert ERROR_LINE.fullmatch(err), err
    assert "1 of 1 outputs differ from the reference (out0)" in err
    assert re.search(r"out0: f32\[2,3\] MISMATCH: 6 of 6 elements differ; max abs error 1 at \[0, 0\], "
                     r"max rel error \S+ at \[\d, \d\]; first mismatch at \[0, 0\]: ", out), out


def test_iterations_report_timing_and_progress(files):
    status, out, err = hlo_tools("single.hlo", "--iterations", "20", "--progress", cwd=files)
    assert status == 0
    assert re.search(r"timing: 20 iterations: median [\d.]+ ms, min [\d.]+ ms, max [\d.]+ ms", out), out
    assert "20/20" in err and "error" not in err


def test_serialized_proto_with_partition_count(files):
    status, out, err = hlo_tools("per4.pb", "--num_partitions", "4", "--reference", "single.hlo",
                                 cwd=files)
    assert (status, err) == (0, ""), err


def test_two_processes_equal_one_process(files):
    status, _, err = hlo_tools("per8.hlo", "--output", "one.npz", "--save_inputs", "in.npz", cwd=files)
    assert (status, err) == (0, ""), err
    status, out, err = hlo_tools("per8.hlo", "--num_processes", "2", "--output", "two.npz", cwd=files)
    assert (status, err) == (0, ""), err
    assert "8 partitions, per-device module, 2 processes x 4 devices" in out
    with np.load(files / "one.npz") as one, np.load(files / "two.npz") as two, \
            np.load(files / "in.npz") as inputs:
        summed, swapped = per_device_8_expected(inputs["arg0"])
        np.testing.assert_array_equal(one["out0"], summed)
        np.testing.assert_array_equal(one["out1"], swapped)
        for name in ("out0", "out1"):
            np.testing.assert_array_equal(one[name], two[name])


def test_processes_started_by_hand(files):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "hlo_tools", "run", "per8.hlo", "--num_processes", "2",
         "--process_id", str(i), "--coordinator", f"127.0.0.1:{port}", "--output", f"p{i}.npz",
         "--timeout", "120"],
        cwd=files, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 processes x 4 devices" in outs[0][0]
    assert outs[1][0].strip() == "process 1 of 2: done" and not (files / "p1.npz").exists()
    with np.load(files / "p0.npz") as data:
        assert data["out0"].shape == (2, 6) and data["out1"].shape == (8, 6)


# Every documented failure: (arguments, what the one stderr line says).
ERRORS = [
    (["missing.hlo"], r"missing\.hlo: No such file or directory"),
    (["per4.hlo", "--inputs", "missing.npz"], r"missing\.npz: No such file or directory"),
    (["per4.hlo", "--reference", "missing.hlo"], r"missing\.hlo: No such file or directory"),
    (["bad.hlo"], r"bad\.hlo:5:\d+: .*opcode"),
    (["deep.hlo"], r"deep\.hlo:3:\d+: .*nested too deeply"),
    (["bad.hlo", "--input_format", "pb"], r"bad\.hlo: XLA could not read the module proto"),
    (["per4.hlo", "--num_partitions", "8"],
     r"per4\.hlo: parameter 0: sharding \{devices=\[4,1\]<=\[4\]\} is for 4 devices \(0\.\.3\), "
     r"but the module runs on 8 partitions"),
    (["per4.hlo", "--num_partitions", "100000"],
     r"per4\.hlo: 100000 devices do not fit this machine \(at most 512 CPU devices\)"),
    (["per4.hlo", "--platform", "nosuchplatform"], r"platform 'nosuchplatform' is not available"),
    (["per4.hlo", "--num_replicas", "0"], r"per4\.hlo: num_replicas must be a positive integer, not 0"),
    (["per4.hlo", "--num_replicas", "2"], r"running replicas and partitions together is not supported"),
    (["single.hlo", "--num_replicas", "3", "--num_processes", "2"],
     r"3 devices cannot be split evenly over 2 processes"),
    (["per4.hlo", "--inputs", "wrong_shape.npz"], r"input arg0 is f32\[4,3\], but per4\.hlo expects f32\[8,3\]"),
    (["per4.hlo", "--inputs", "wrong_dtype.npz"], r"input arg0 is f64\[8,3\], but per4\.hlo expects f32\[8,3\]"),
    (["per4.hlo", "--inputs", "two.npz"], r"per4\.hlo takes 1 parameter, but 2 input arrays were given"),
    (["per4.hlo", "--inputs", "named.npz"], r"named\.npz: unexpected array 'x' \(inputs are named arg0\.\.argK\)"),
    (["per4.hlo", "--inputs", "junk.npz"], r"junk\.npz: not an \.npz file"),
    (["single.hlo", "--reference", "per4.hlo", "--reference_num_partitions", "2"],
     r"per4\.hlo: parameter 0: sharding .* but the module runs on 2 partitions"),
    (["crash.hlo", "--partition_mode", "spmd"],
     r"XLA crashed while compiling crash\.hlo \(SIGABRT\): Check failed: .*"),
    (["endless.hlo", "--timeout", "2"], r"the run took longer than 2 s and was stopped"),
    (["endless.hlo", "--timeout", "2", "--in_process"], r"--timeout needs a child process"),
    (["single.hlo", "--timeout", "0"], r"timeout must be a positive number of seconds, not 0"),
    (["per4.hlo", "--iterations", "0"], r"iterations must be a positive integer, not 0"),
    (["per4.hlo", "--output", "no/such/dir/out.npz"], r"no/such/dir: No such directory"),
    (["per4.hlo", "--output", "per4.hlo"], r"per4\.hlo: refusing to overwrite an input file with --output"),
    (["single.hlo", "--reference", "per4.hlo", "--save_inputs", "./per4.hlo"],
     r"\./per4\.hlo: refusing to overwrite an input file with --save_inputs"),
    (["per4.hlo", "--num_processes", "2", "--process_id", "0", "--coordinator", "10.1.2.3:1234"],
     r"coordinator address '10\.1\.2\.3:1234' is not a loopback address"),
    (["per4.hlo", "--process_id", "1"], r"--process_id needs --num_processes of 2 or more"),
    (["per4.hlo", "--coordinator", "127.0.0.1:1234"], r"--coordinator needs --process_id"),
    (["per4.hlo", "--in_process", "--inputs", "wrong_shape.npz"],
     r"input arg0 is f32\[4,3\], but per4\.hlo expects f32\[8,3\]"),
]


@pytest.mark.parametrize("argv,message", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_every_error_is_one_line(files, argv, message):
    status, _, err = hlo_tools(*argv, cwd=files)
    assert status != 0
    assert ERROR_LINE.fullmatch(err), f"not exactly one error line: {err!r}"
    assert re.search(message, err[len("hlo-tools: error: "):]), err


def test_outputs_never_overwrite_the_modules(files):
    before = (files / "per4.hlo").read_bytes()
    assert hlo_tools("per4.hlo", "--output", "per4.hlo", cwd=files)[0] != 0
    assert (files / "per4.hlo").read_bytes() == before
