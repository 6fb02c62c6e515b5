"""`xla-opt`: pipelines from the command line, split input files, atomic output, one-line errors."""

import io
import os
import re
import subprocess
import sys

import pytest

from xla_passes.tools import opt

MODULE = """HloModule opt_test

ENTRY main {
  p = f32[8] parameter(0)
  dead = f32[8] negate(p)
  ROOT r = f32[8] add(p, p)
}
"""


def run_opt(capsys, *argv):
    status = opt.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("xla-opt: error: "), err
    return lines[0][len("xla-opt: error: "):]


def test_runs_passes_and_writes_the_output_file(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(MODULE)
    out = tmp_path / "out.hlo"
    status, stdout, _ = run_opt(capsys, str(src), "--passes=dce", "-o", str(out))
    assert status == 0 and stdout == ""
    assert out.read_text() == MODULE.replace("  dead = f32[8] negate(p)\n", "")
    assert src.read_text() == MODULE
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_without_passes_prints_the_module_unchanged(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(MODULE)
    assert run_opt(capsys, str(src)) == (0, MODULE, "")


def test_says_when_no_pass_changed_the_module(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(MODULE.replace("  dead = f32[8] negate(p)\n", ""))
    status, out, err = run_opt(capsys, str(src), "--passes=dce")
    assert status == 0 and out == src.read_text()
    assert err == "xla-opt: opt_test: no pass changed the module\n"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        opt.main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"xla-opt \d+\.\d+\.\d+\n", capsys.readouterr().out)


def test_stdin_to_stdout(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MODULE.encode())))
    status, out, _ = run_opt(capsys, "--passes", "dce")
    assert status == 0 and "negate" not in out and out.startswith("HloModule opt_test")


def test_split_input_file_keeps_each_module_separate(tmp_path, capsys):
    src = tmp_path / "cases.hlo"
    src.write_text(MODULE + "// -----\n" + MODULE.replace("opt_test", "second"))
    status, out, _ = run_opt(capsys, str(src), "--split-input-file", "--passes=dce")
    assert status == 0
    first, second = out.split("// -----\n")
    assert first.startswith("HloModule opt_test") and second.startswith("HloModule second")
    assert "negate" not in out


def test_list_passes_shows_every_pass_with_its_options(capsys):
    import xla_passes

    status, out, _ = run_opt(capsys, "--list-passes")
    assert status == 0
    for name, cls in xla_passes.registered_passes().items():
        assert f"\n{name} " in "\n" + out
        for field in cls.option_fields():
            assert f"{field.name}: " in out
    assert "fixed-point(...)" in out


def test_dump_to_writes_one_file_per_pass(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(MODULE)
    dump = tmp_path / "dump"
    assert run_opt(capsys, str(src), "--passes=cse,dce", "--dump-to", str(dump))[0] == 0
    assert sorted(os.listdir(dump)) == ["module_0000.opt_test.0001.after_cse.txt",
                                        "module_0000.opt_test.0002.after_dce.txt",
                                        "module_0000.opt_test.before_xla_passes.txt"]


def test_errors_are_one_line_with_a_nonzero_exit(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(MODULE)
    broken = tmp_path / "broken.hlo"
    broken.write_text(MODULE + "// -----\nHloModule x\n\nENTRY e {\n  p = f32[8] parameter(0)\n  ROOT r = f32[8] add(p, q)\n}\n")
    invalid = tmp_path / "invalid.hlo"
    invalid.write_text(MODULE.replace("ROOT r = f32[8] add(p, p)", "ROOT r = f32[9] add(p, p)"))

    cases = [
        ((str(tmp_path / "missing.hlo"),), "No such file or directory"),
        ((str(src), "--passes=nope"), "unknown pass 'nope' (valid passes: "),
        ((str(src), "--passes=dce{x=1}"), "pass dce: unknown option 'x'"),
        ((str(broken), "--split-input-file"), f"{broken}:13:"),
        ((str(invalid),), f"{invalid}:6: r:"),
        ((str(src), "--passes=dce", "-o", str(src)), "refusing to overwrite the input file"),
        ((str(src), "-o", str(tmp_path / "no" / "dir" / "out.hlo")), "No such file or directory"),
        ((str(src), "--passes=" + "fixed-point(" * 10000 + "dce" + ")" * 10000),
         "column 204: fixed-point groups nest more than 16 deep"),
        ((str(src), "--passes=dce", "--dump-to", str(src)), f"{src}: --dump-to names a file, not a directory"),
    ]
    for argv, message in cases:
        status, out, err = run_opt(capsys, *argv)
        assert status == 1, argv
        assert message in one_error_line(err), (argv, err)
        assert len(err) < 1000, err  # pipeline text in a message is abbreviated
    assert src.read_text() == MODULE


def test_console_script_reports_errors_without_a_traceback(tmp_path):
    src = tmp_path / "in.hlo"
    src.write_text("HloModule m\nENTRY e {\n  ROOT r = f32[8] bogus-op()\n}\n")
    result = subprocess.run([sys.executable, "-m", "xla_passes.tools.opt", str(src), "--passes=dce"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith(f"xla-opt: error: {src}:3:")
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("argv", [["--no-such-flag"], ["a.hlo", "b.hlo"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        opt.main(argv)
    assert info.value.code == 2


def test_split_input_file_does_not_split_inside_a_string(tmp_path, capsys):
    quoted = MODULE.replace("ROOT r = f32[8] add(p, p)",
                            'ROOT r = f32[8] add(p, p), metadata={op_name="a\n// -----\nb"}')
    src = tmp_path / "cases.hlo"
    src.write_text(quoted + "// -----\n" + "/* a comment\n// -----\n*/\n" + MODULE.replace("opt_test", "second"))
    status, out, _ = run_opt(capsys, str(src), "--split-input-file")
    assert status == 0
    first, second = out.rsplit("\n// -----\n", 1)  # the first module's string holds one too
    assert 'op_name="a\n// -----\nb"' in first and first.startswith("HloModule opt_test")
    assert second.startswith("HloModule second")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\f", "\v", "\r", "\x85", "\x1c"])
def test_split_input_file_ends_a_line_comment_only_at_a_newline(tmp_path, capsys, separator):
    """What str.splitlines takes for a line break is comment text to the parser (issue 24)."""
    commented = MODULE.replace("ROOT r = f32[8] add(p, p)", f"ROOT r = f32[8] add(p, p) // a{separator}// -----")
    src = tmp_path / "cases.hlo"
    with open(src, "w", encoding="utf-8", newline="") as f:
        f.write(commented + "// -----\n" + MODULE.replace("opt_test", "second"))
    status, out, _ = run_opt(capsys, str(src), "--split-input-file")
    assert status == 0
    first, second = out.split("\n// -----\n")
    assert f"// a{separator}// -----" in first and second.startswith("HloModule second")


SIXTEEN_REPLICAS = """HloModule sum16, replica_count=16

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY main {
  p = f32[1024] parameter(0)
  ROOT r = f32[1024] all-reduce(p), replica_groups={}, to_apply=add
}
"""


@pytest.mark.parametrize("passes, reason", [
    ("all-reduce-2d{mesh=4x4,failed=1:2}", "not one group of the 15 healthy chips of mesh:4x4 failed 1:2"),
    ("all-reduce-2d{mesh=4x8}", "groups of 16 devices do not form a 4x8 mesh (32 devices)"),
])
def test_a_named_pass_that_cannot_apply_says_why_without_report(tmp_path, capsys, passes, reason):
    """Not only with --report or strict=true (issue 24)."""
    src = tmp_path / "sum16.hlo"
    src.write_text(SIXTEEN_REPLICAS)
    status, out, err = run_opt(capsys, str(src), f"--passes={passes}")
    assert status == 0 and out == SIXTEEN_REPLICAS
    unchanged, why = err.splitlines()
    assert unchanged == "xla-opt: sum16: no pass changed the module"
    assert why.startswith("xla-opt: sum16: all-reduce-2d: unchanged: %r left alone: ") and why.endswith(reason)
    status, _, err = run_opt(capsys, str(src), f"--passes={passes[:-1]},strict=true}}")
    assert status == 1 and one_error_line(err).endswith(reason)


def test_dump_to_a_reused_directory_replaces_nothing(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(MODULE)
    dump = tmp_path / "dump"
    assert run_opt(capsys, str(src), "--passes=dce", "--dump-to", str(dump))[0] == 0
    first = {name: (dump / name).read_text() for name in os.listdir(dump)}
    assert run_opt(capsys, str(src), "--passes=cse", "--dump-to", str(dump))[0] == 0
    assert {name: (dump / name).read_text() for name in first} == first
    assert sorted(set(os.listdir(dump)) - set(first)) == ["module_0001.opt_test.0001.after_cse.txt",
                                                          "module_0001.opt_test.before_xla_passes.txt"]


def test_two_processes_dumping_into_one_directory_keep_every_module(tmp_path):
    modules = 12
    src = tmp_path / "cases.hlo"
    src.write_text("// -----\n".join(MODULE.replace("opt_test", f"case{k}") for k in range(modules)))
    dump = tmp_path / "dump"
    command = [sys.executable, "-m", "xla_passes.tools.opt", str(src), "--split-input-file", "--passes=dce",
               "--dump-to", str(dump)]
    procs = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    names = os.listdir(dump)
    numbers = {}
    for name in names:
        match = re.fullmatch(r"module_(\d{4})\.(case\d+)\.(before_xla_passes|0001\.after_dce)\.txt", name)
        assert match, name
        numbers.setdefault(match.group(1), set()).add((match.group(2), match.group(3)))
    # every module of both runs has its own number, with both of its files under it
    assert len(numbers) == 2 * modules
    assert all(len(files) == 2 and len({case for case, _ in files}) == 1 for files in numbers.values())
