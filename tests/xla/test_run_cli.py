"""``hlo-tools run``: real runs through the command line, and every documented error as one line."""

import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from hlo_tools.xla import xla_bridge
from support import REPO_ROOT, alive_in_session, kill_session, process_stats
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


# --- Replicated parameters, output files, signals ----------------------------------------------

ALL_REDUCE_8 = """HloModule sum_of_replicas, replica_count=8

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY main {
  w = f32[4] parameter(0)
  ROOT r = f32[4] all-reduce(w), replica_groups={}, to_apply=add
}
"""
# What a rewrite assuming replicated parameters makes of it: right only when w is equal everywhere.
TIMES_8 = """HloModule times_replicas, replica_count=8

ENTRY main {
  w = f32[4] parameter(0)
  eight = f32[] constant(8)
  b = f32[4] broadcast(eight), dimensions={}
  ROOT r = f32[4] multiply(w, b)
}
"""


@pytest.fixture
def replica_files(tmp_path):
    (tmp_path / "sum.hlo").write_text(ALL_REDUCE_8)
    (tmp_path / "times8.hlo").write_text(TIMES_8)
    return tmp_path


def test_replicated_parameters_get_one_value_on_every_device(replica_files):
    status, out, err = hlo_tools("sum.hlo", "--reference", "times8.hlo", cwd=replica_files)
    assert status == 1 and "1 of 1 outputs differ from the reference" in err  # random per replica
    for name in ("0", "w"):
        status, out, err = hlo_tools("sum.hlo", "--reference", "times8.hlo", "--replicated", name,
                                     "--save_inputs", "in.npz", cwd=replica_files)
        assert (status, err) == (0, ""), err
        assert "the output matches the reference" in out
        with np.load(replica_files / "in.npz") as data:
            w = data["arg0"]
        assert w.shape == (8, 4) and (w == w[0]).all() and len(np.unique(w)) > 1


def test_replicated_given_inputs_must_be_replicated(replica_files):
    np.savez(replica_files / "differ.npz", arg0=np.arange(32, dtype=np.float32).reshape(8, 4))
    np.savez(replica_files / "same.npz", arg0=np.tile(np.arange(4, dtype=np.float32), (8, 1)))
    status, _, err = hlo_tools("sum.hlo", "--inputs", "differ.npz", "--replicated", "0",
                               cwd=replica_files)
    assert status == 1 and ERROR_LINE.fullmatch(err), err
    assert "input arg0 holds other values on other devices than on device 0" in err
    status, _, err = hlo_tools("sum.hlo", "--reference", "times8.hlo", "--inputs", "same.npz",
                               "--replicated", "w", cwd=replica_files)
    assert (status, err) == (0, ""), err


@pytest.mark.parametrize("name, message", [
    ("1", r"replicated parameter 1 does not exist \(the entry has 1 parameter\)"),
    ("v", r"replicated parameter 'v' is neither an entry parameter number nor name "
          r"\(the entry's parameters: w\)"),
])
def test_unknown_replicated_parameters_are_one_line_errors(replica_files, name, message):
    status, _, err = hlo_tools("sum.hlo", "--replicated", name, cwd=replica_files)
    assert status == 1 and ERROR_LINE.fullmatch(err), err
    assert re.search(message, err), err


def test_outputs_to_dev_null_and_to_one_file(files):
    status, out, err = hlo_tools("per4.hlo", "--output", os.devnull, "--save_inputs", os.devnull,
                                 cwd=files)
    assert (status, err) == (0, ""), err
    status, _, err = hlo_tools("per4.hlo", "--output", "x.npz", "--save_inputs", "./x.npz", cwd=files)
    assert status == 1 and ERROR_LINE.fullmatch(err), err
    assert "--output and --save_inputs name the same file" in err and not (files / "x.npz").exists()


def test_outputs_are_written_atomically_with_the_old_permissions(files):
    (files / "out.npz").write_bytes(b"old")
    os.chmod(files / "out.npz", 0o640)
    status, _, err = hlo_tools("per4.hlo", "--output", "out.npz", cwd=files)
    assert (status, err) == (0, ""), err
    with np.load(files / "out.npz") as data:
        assert data["out0"].shape == (2, 3)
    assert os.stat(files / "out.npz").st_mode & 0o777 == 0o640
    assert not [p for p in os.listdir(files) if p.endswith(".tmp")]


def test_inputs_too_big_for_memory_are_refused_before_allocating(tmp_path):
    (tmp_path / "huge.hlo").write_text("HloModule huge\n\nENTRY main {\n"
                                       "  p = f32[1000000000000] parameter(0)\n"
                                       "  ROOT n = f32[1000000000000] negate(p)\n}\n")
    for extra in ([], ["--in_process"]):
        status, _, err = hlo_tools("huge.hlo", *extra, cwd=tmp_path)
        assert status == 1 and ERROR_LINE.fullmatch(err), err
        assert re.search(r"huge\.hlo: parameter 0 \(f32\[1000000000000\]\) takes 4000000000000 bytes "
                         r"\(3\.6 TiB\), more than this machine's memory", err), err


def test_npz_headers_are_checked_before_loading(tmp_path):
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (1000000000,)})
    with zipfile.ZipFile(tmp_path / "inflated.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("arg0.npy", header.getvalue() + bytes(1000))
    (tmp_path / "single.hlo").write_text(SINGLE_DEVICE)
    status, _, err = hlo_tools("single.hlo", "--inputs", "inflated.npz", cwd=tmp_path)
    assert status == 1 and ERROR_LINE.fullmatch(err), err
    assert "inflated.npz: array 'arg0' says it is f32[1000000000] (4000000000 bytes (3.7 GiB)), " \
           "but the file holds 1000 bytes of data for it" in err


def test_a_byte_order_mark_is_accepted(tmp_path):
    (tmp_path / "bom.hlo").write_bytes(b"\xef\xbb\xbf" + SINGLE_DEVICE.encode())
    status, out, err = hlo_tools("bom.hlo", cwd=tmp_path)
    assert (status, err) == (0, ""), err


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    return [child for child, fields in process_stats() if int(fields[1]) == pid]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
def test_termination_stops_the_worker_and_removes_temporary_files(files, tmp_path, signum):
    import signal
    import time

    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(private_tmp))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # The command starts with the signal at its default even where this suite runs with it ignored
    # (under nohup, say): a child keeps an ignored signal ignored, as a command should.
    proc = subprocess.Popen([sys.executable, "-m", "hlo_tools", "run", "endless.hlo"], cwd=files,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(getattr(signal, signum), signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any((d / "status").exists() and (d / "status").read_text().startswith("running")
                  for d in private_tmp.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "the worker never started running"
        time.sleep(0.1)
    workers = _children(proc.pid)
    assert workers
    proc.send_signal(getattr(signal, signum))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, signum)
    assert err == f"hlo-tools: error: terminated by {signum}\n"
    assert list(private_tmp.iterdir()) == []
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a worker outlived the command"


def test_a_one_device_all_gather_that_leaves_memory_unwritten_is_warned_about(tmp_path):
    # XLA's verifier skips the shard count when the group has one member: the module compiles,
    # and out0[4:] is whatever the buffer held.
    (tmp_path / "gather.hlo").write_text("HloModule gather\n\nENTRY main {\n"
                                         "  p = f32[4] parameter(0)\n"
                                         "  ROOT ag = f32[8] all-gather(p), dimensions={0}, replica_groups={}\n}\n")
    (tmp_path / "fine.hlo").write_text("HloModule fine\n\nENTRY main {\n"
                                       "  p = f32[4] parameter(0)\n"
                                       "  ROOT ag = f32[4] all-gather(p), dimensions={0}, replica_groups={}\n}\n")
    status, out, err = hlo_tools("gather.hlo", cwd=tmp_path)
    assert (status, err) == (0, ""), err
    assert ("warning: gather.hlo: ag: an all-gather on one device gathers f32[4] into f32[8]; only the "
            "first 4 of 8 along dimension 0 are written, the rest is uninitialized memory") in out
    status, out, err = hlo_tools("fine.hlo", cwd=tmp_path)
    assert (status, err) == (0, "") and "warning" not in out


def _cpu_seconds(pid: int) -> float:
    """User and system time of a process so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def test_terminating_an_in_process_run_ends_the_process(files, tmp_path):
    """XLA:CPU runs the endless loop inline, in C++: the signal must still end the command, and
    the process with it, not only print that it did (issue 24)."""
    import signal
    import time

    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(private_tmp))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "hlo_tools", "run", "endless.hlo", "--in_process",
                             "--output", "o.npz"], cwd=files, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # Reading the module and compiling it take about a second of CPU: then it runs the loop.
        deadline = time.monotonic() + 120
        while _cpu_seconds(proc.pid) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + signal.SIGTERM
        assert err == "hlo-tools: error: terminated by SIGTERM\n"
        assert not alive_in_session(proc.pid), "a process of the command outlived it"
        assert list(private_tmp.iterdir()) == [] and not (files / "o.npz").exists()
    finally:
        kill_session(proc)
