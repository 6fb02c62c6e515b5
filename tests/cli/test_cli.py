"""The hlo-tools command line: subcommands, output files and one-line errors."""

import argparse
import importlib
import io
import os
import re
import subprocess
import sys

import pytest

import hlo_tools
from hlo_tools import cli
from hlo_tools.xla import xla_bridge
from support import REPO_ROOT, kill_session, run_hlo_tools as run

# Irregular spacing and a comment-free blank line: the faithful print must keep them.
MODULE = """HloModule cli_test, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY main {
  p  = f32[4]{0} parameter(0)
  ROOT r = f32[4]{0} all-reduce(p), replica_groups={{0,1}}, to_apply=add
}
"""

# Parses, but the add's result shape contradicts its operands.
MISTYPED = """HloModule mistyped

ENTRY main {
  p = f32[4]{0} parameter(0)
  ROOT a = f32[8]{0} add(p, p)
}
"""

ERROR_LINE = re.compile(r"hlo-tools: error: [^\n]+\n")


@pytest.fixture
def module_file(tmp_path):
    path = tmp_path / "module.hlo"
    path.write_text(MODULE, encoding="utf-8")
    return path

def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers registered on ``parser``."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_help_lists_every_subcommand(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0
    names = subcommands(cli.build_parser())
    assert {"print", "verify"} <= set(names)
    for name in names:
        assert re.search(rf"^\s+{re.escape(name)}\s", out, flags=re.M), name


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"hlo-tools \d+\.\d+\.\d+\n", capsys.readouterr().out)


@pytest.mark.parametrize("module_name", cli.COMMAND_MODULES)
def test_command_module_registers_runnable_subcommands(module_name):
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).register(parser.add_subparsers())
    registered = subcommands(parser)
    assert registered
    for subparser in registered.values():
        assert callable(subparser.get_default("func"))


def test_print_is_byte_exact(capsys, module_file):
    assert run(capsys, "print", module_file) == (0, MODULE, "")


def test_print_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MODULE.encode())))
    assert run(capsys, "print", "-") == (0, MODULE, "")


def test_print_regenerate_reprints_in_xla_style(capsys, module_file):
    status, out, _ = run(capsys, "print", "--regenerate", module_file)
    assert status == 0
    assert out == hlo_tools.parse_module(MODULE).to_text(regenerate=True)
    assert "p  =" not in out
    assert xla_bridge.same_meaning(out, MODULE)


def test_print_to_output_file(capsys, module_file, tmp_path):
    out_path = tmp_path / "out" / "printed.hlo"
    out_path.parent.mkdir()
    assert run(capsys, "print", module_file, "-o", out_path) == (0, "", "")
    assert out_path.read_bytes() == MODULE.encode()
    assert os.listdir(out_path.parent) == ["printed.hlo"]  # no temp file left behind


def test_print_replaces_existing_output_file(capsys, module_file, tmp_path):
    out_path = tmp_path / "old.hlo"
    out_path.write_text("old contents")
    assert run(capsys, "print", module_file, "--regenerate", "-o", out_path)[0] == 0
    assert out_path.read_text() == hlo_tools.parse_module(MODULE).to_text(regenerate=True)


def test_output_file_keeps_permissions_of_replaced_file(capsys, module_file, tmp_path):
    out_path = tmp_path / "shared.hlo"
    out_path.write_text("old contents")
    out_path.chmod(0o640)
    assert run(capsys, "print", module_file, "-o", out_path)[0] == 0
    assert out_path.stat().st_mode & 0o777 == 0o640


def test_new_output_file_gets_default_permissions(capsys, module_file, tmp_path):
    out_path = tmp_path / "new.hlo"
    umask = os.umask(0o022)
    try:
        assert run(capsys, "print", module_file, "-o", out_path)[0] == 0
    finally:
        os.umask(umask)
    assert out_path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("via_link", [False, True])
def test_print_refuses_to_overwrite_input(capsys, module_file, tmp_path, via_link):
    target = module_file
    if via_link:
        target = tmp_path / "link.hlo"
        target.symlink_to(module_file)
    status, out, err = run(capsys, "print", module_file, "--regenerate", "-o", target)
    assert status == 1
    assert err == f"hlo-tools: error: {target}: refusing to overwrite the input file\n"
    assert module_file.read_text() == MODULE


def test_verify_reports_module_size(capsys, module_file):
    status, out, err = run(capsys, "verify", module_file)
    assert (status, err) == (0, "")
    assert out == "OK: cli_test (2 computations, 5 instructions)\n"


def test_parse_error_is_one_located_line(capsys, tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text(MODULE.replace("parameter(0)\n  ROOT r", "parameter(0\n  ROOT r"))
    status, out, err = run(capsys, "print", bad)
    assert (status, out) == (1, "")
    assert ERROR_LINE.fullmatch(err)
    assert re.match(rf"hlo-tools: error: {re.escape(str(bad))}:\d+:\d+: \S", err)


def test_verify_error_is_one_line(capsys, tmp_path):
    bad = tmp_path / "mistyped.hlo"
    bad.write_text(MISTYPED)
    status, out, err = run(capsys, "verify", bad)
    assert (status, out) == (1, "")
    assert ERROR_LINE.fullmatch(err)
    assert err.startswith(f"hlo-tools: error: {bad}:")


def test_missing_file_is_one_line(capsys, tmp_path):
    missing = tmp_path / "missing.hlo"
    status, _, err = run(capsys, "verify", missing)
    assert status == 1
    assert err == f"hlo-tools: error: {missing}: No such file or directory\n"


def test_non_utf8_file_is_one_line(capsys, tmp_path):
    binary = tmp_path / "binary.hlo"
    binary.write_bytes(b"HloModule m\xff\xfe\n")
    status, _, err = run(capsys, "print", binary)
    assert status == 1
    assert err.startswith(f"hlo-tools: error: {binary}: not UTF-8 text")


def test_unexpected_exception_is_one_line(capsys, module_file, monkeypatch):
    def broken(text):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(hlo_tools, "parse_module", broken)
    status, _, err = run(capsys, "print", module_file)
    assert status == 1
    assert err == "hlo-tools: error: internal error: ValueError: boom\n"


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["print"], ["print", "a", "--bogus"]])
def test_usage_errors_exit_2(capsys, argv):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert "usage: hlo-tools" in err


def test_console_entry_point_never_prints_a_traceback(tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\nENTRY e {\n  ROOT p = f32[ parameter(0)\n}\n")
    result = subprocess.run([sys.executable, "-m", "hlo_tools", "verify", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stdout == ""
    assert ERROR_LINE.fullmatch(result.stderr)



def test_closed_stdout_pipe_ends_quietly(monkeypatch, capsys, module_file, tmp_path):
    class ClosedPipe:
        """A stdout whose reader went away (`hlo-tools print x | head`)."""

        def __init__(self):
            self.fd = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)

        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return self.fd

    stdout = ClosedPipe()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert cli.main(["print", str(module_file)]) == 1
    assert capsys.readouterr().err == ""
    assert os.path.samefile(f"/proc/self/fd/{stdout.fd}", os.devnull)  # later flushes go nowhere
    os.close(stdout.fd)


def test_termination_signals_unwind_like_ctrl_c(tmp_path, monkeypatch, capsys):
    import signal

    def terminated_while_writing(*_):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises cli.Terminated here

    def body() -> int:
        monkeypatch.setattr(os, "replace", terminated_while_writing)
        cli.write_atomically(str(tmp_path / "out.hlo"), MODULE)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert cli.report_failures("hlo-tools", body) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "hlo-tools: error: terminated by SIGTERM\n"
    assert os.listdir(tmp_path) == []  # the temporary file is gone, and no out.hlo appeared
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_an_ignored_hangup_stays_ignored(monkeypatch):
    import signal

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        def body() -> int:
            os.kill(os.getpid(), signal.SIGHUP)
            return 0
        assert cli.report_failures("hlo-tools", body) == 0
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.hlo"
    path.write_bytes(b"\xef\xbb\xbf" + MODULE.encode())
    assert cli.read_text(str(path)) == MODULE
    assert hlo_tools.parse_module("\ufeff" + MODULE).name == "cli_test"


# --- Every size a user can type, refused in bounded memory (issue 24) ---------------------------

ADD = "add {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT c = f32[] add(a, b)\n}\n"
SIZE_MODULES = {
    "single.hlo": "HloModule single\n\nENTRY main {\n  p = f32[8,3] parameter(0)\n"
                  "  ROOT n = f32[8,3] negate(p)\n}\n",
    # verify takes it (XLA multiplies the dimensions out to 0), numpy makes no array of it
    "empty.hlo": "HloModule empty\n\nENTRY main {\n  p = f32[0,9223372036854775807] parameter(0)\n"
                 "  ROOT n = f32[0,9223372036854775807] negate(p)\n}\n",
    "huge.hlo": "HloModule huge\n\nENTRY main {\n  p = f32[4294967296,4294967296] parameter(0)\n"
                "  ROOT n = f32[4294967296,4294967296] negate(p)\n}\n",
    "sum16.hlo": f"HloModule sum16, replica_count=16\n\n{ADD}\nENTRY main {{\n  p = f32[1024] parameter(0)\n"
                 "  ROOT r = f32[1024] all-reduce(p), replica_groups={}, to_apply=add\n}\n",
}
INFLATED_BYTES = 1_100_000_000  # more than the address space the commands get


def _write_inflating_npz(path) -> None:
    """An honest .npz of a few MB whose arg1 inflates to INFLATED_BYTES (written in chunks)."""
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        archive.writestr("arg0.npy", _npy(np.zeros((8, 3), np.float32)))
        with archive.open("arg1.npy", "w") as f:
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                          "shape": (INFLATED_BYTES // 4,)})
            f.write(header.getvalue())
            chunk = bytes(1 << 24)
            for start in range(0, INFLATED_BYTES, len(chunk)):
                f.write(chunk[:INFLATED_BYTES - start])


def _npy(array) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# (command line, what the one error line says); hlo-tools, or xla-opt where the first word says so.
SIZE_CASES = [
    (["run", "empty.hlo"], r"empty\.hlo: parameter 0 \(f32\[0,9223372036854775807\]\) cannot be a numpy array"),
    (["run", "empty.hlo", "--in_process"], r"parameter 0 \(f32\[0,9223372036854775807\]\) cannot be a numpy array"),
    (["run", "single.hlo", "--inputs", "inflating.npz"],
     r"single\.hlo takes 1 parameter, but 2 input arrays were given"),
    (["cost", "huge.hlo", "--topology", "ring:1", "--no_xla"],
     r"huge\.hlo:4: p: shape f32\[4294967296,4294967296\] takes 73786976294838206464 bytes, more than int64"),
    (["stats", "huge.hlo", "--no-compile"], r"huge\.hlo:4: p: shape f32\[4294967296,4294967296\] takes"),
    (["cost", "sum16.hlo", "--topology", "torus:100000x100000", "--no_xla"],
     r"topology 'torus:100000x100000' has 10000000000 chips, more than the 16384 a topology may have"),
    (["cost", "sum16.hlo", "--topology", "ring:99999999999999999999", "--no_xla"],
     r"'ring:99999999999999999999' has 99999999999999999999 chips"),
    (["cost", "sum16.hlo", "--topology", "torus:4x4", "--no_xla", "--json", "--link_latency", "inf"],
     r"--link_latency must be 0 or a number from 1e-30 to 1e\+30, not inf"),
    (["cost", "sum16.hlo", "--topology", "torus:4x4", "--no_xla", "--json", "--link_latency", "1e308"],
     r"--link_latency must be 0 or a number from 1e-30 to 1e\+30, not 1e\+308"),
    (["cost", "sum16.hlo", "--topology", "torus:4x4", "--no_xla", "--link_bandwidth", "1e-320"],
     r"--link_bandwidth must be a number from 1e-30 to 1e\+30, not 9\.99989e-321"),
    (["xla-opt", "sum16.hlo", "--passes", "all-reduce-rings{rings=2,topology=ring:100000000000}"],
     r"ring:100000000000' has 100000000000 chips, more than the 16384"),
    (["xla-opt", "sum16.hlo", "--passes", "all-reduce-2d{torus=100000x100000}"],
     r"torus:100000x100000' has 10000000000 chips"),
]
SIZE_DEADLINE_S = 10
ADDRESS_SPACE = 1 << 30


# The limit is set between fork and exec (preexec_fn), where JAX, if a test imported it, warns of threads.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
@pytest.mark.parametrize("argv,message", SIZE_CASES, ids=[" ".join(argv) for argv, _ in SIZE_CASES])
def test_every_size_a_user_can_type_is_refused_in_bounded_memory(tmp_path, argv, message):
    """Under a 1 GB address space, within 10 s: exactly one error line, no traceback."""
    import resource

    for name, text in SIZE_MODULES.items():
        (tmp_path / name).write_text(text)
    if "inflating.npz" in argv:
        _write_inflating_npz(tmp_path / "inflating.npz")

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    prog, module = ("xla_passes.tools.opt", argv[1:]) if argv[0] == "xla-opt" else ("hlo_tools", argv)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", prog, *module], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=limit_memory, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=SIZE_DEADLINE_S)
    finally:
        kill_session(proc)
    name = "xla-opt" if argv[0] == "xla-opt" else "hlo-tools"
    assert proc.returncode != 0
    assert re.fullmatch(rf"{name}: error: [^\n]+\n", err), err[-2000:]
    assert re.search(message, err), err

