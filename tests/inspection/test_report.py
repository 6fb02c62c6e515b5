"""`hlo_tools.inspection.report` and `hlo-tools report`: the HTML page of a dump directory.

The dumps are made at test time: by the xla_passes pipeline (weight-update-sharding
on a momentum step, so the page carries its per-weight report lines) and by XLA's
own --xla_dump_to with per-pass dumps of a real JAX step. The browser test is
tests/inspection/test_report_browser.py.
"""
from __future__ import annotations

import base64
import collections
import difflib
import hashlib
import html
import os
import random
import re
import stat
import time

import pytest

import hlo_tools
import real_programs
import xla_passes
from hlo_tools.inspection import graph, report
from hlo_tools.inspection.report import classify
from support import run_hlo_tools as run

MOMENTUM = """HloModule momentum, replica_count=8

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY step {
  w = f32[64,16] parameter(0), parameter_replication={true}
  m = f32[64,16] parameter(1), parameter_replication={true}
  grad = f32[64,16] parameter(2)
  g = f32[64,16] all-reduce(grad), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
  beta = f32[] constant(0.9)
  betas = f32[64,16] broadcast(beta), dimensions={}
  decayed = f32[64,16] multiply(m, betas)
  m1 = f32[64,16] add(decayed, g)
  lr = f32[] constant(0.1)
  lrs = f32[64,16] broadcast(lr), dimensions={}
  step = f32[64,16] multiply(m1, lrs)
  w1 = f32[64,16] subtract(w, step)
  ROOT out = (f32[64,16], f32[64,16]) tuple(w1, m1)
}
"""

@pytest.fixture
def wus_dump(tmp_path):
    """A pipeline dump: weight-update-sharding (with its report lines), then dce, which changes nothing."""
    dump = tmp_path / "dump"
    wus = xla_passes.pass_class("weight-update-sharding")()
    xla_passes.Pipeline([wus, xla_passes.pass_class("dce")()], dump_to=str(dump), module_number=3).run(
        hlo_tools.parse_module(MOMENTUM))
    assert wus.report
    return dump, [str(entry) for entry in wus.report]


@pytest.fixture(scope="module")
def xla_dump(tmp_path_factory):
    """XLA's --xla_dump_to of the shard_map step and a small program, with a file per pass."""
    dump = tmp_path_factory.mktemp("xla_dump")
    real_programs.xla_dump_programs(str(dump))
    return dump


def test_file_names_of_both_kinds_of_dump():
    def fields(name):
        found = classify(name)
        return found and (found.number, found.name, found.source, found.stage, found.step, found.label)

    assert fields("module_0003.jit_step.before_xla_passes.txt") == (3, "jit_step", "xla_passes", "before", None,
                                                                    "before_xla_passes")
    assert fields("module_0003.jit_step.0002.after_all-reduce-combiner.txt") == (
        3, "jit_step", "xla_passes", "pass", 2, "all-reduce-combiner")
    assert fields("module_0012.a_inference_f_13__.1.before_optimizations.txt")[:4] == (
        12, "a_inference_f_13__.1", "xla", "before")
    assert fields("module_0012.a_inference_f_13__.1.cpu_after_optimizations.txt")[1:] == (
        "a_inference_f_13__.1", "xla", "after", None, "cpu_after_optimizations")
    assert fields("module_0000.jit_step.sm_9.0_gpu_after_optimizations.txt")[1:] == (
        "jit_step", "xla", "after", None, "sm_9.0_gpu_after_optimizations")
    # XLA's pipeline called after_layout_assignment is a pipeline, not part of a pass name.
    assert fields("module_0000.jit_step.0023.after_layout_assignment.after_pipeline-start.before_pipeline-end.txt") \
        == (0, "jit_step", "xla", "pass", 23, "after_layout_assignment: pipeline-start")
    assert fields("module_0000.jit_step.0031.copy-insertion.after_adding_copies.txt")[3:] == (
        "pass", 31, "copy-insertion: adding_copies")
    for other in ("module_0000.jit_step.cpu_after_optimizations-buffer-assignment.txt",
                  "module_0000.jit_step.ir-no-opt.ll", "module_0000.jit_step.debug_options", "notes.txt"):
        assert classify(other) is None, other


def test_pipeline_dump_timeline_graphs_report_lines_and_stats(wus_dump):
    dump, report_lines = wus_dump
    page = report.build_report(str(dump))
    assert page.warnings == [] and page.ignored_files == 0
    (module,) = page.modules
    assert (module.number, module.name, module.source) == (3, "momentum", "xla_passes")
    assert [s.snapshot.file.label for s in module.steps] == ["before_xla_passes", "weight-update-sharding", "dce"]
    start, wus, dce = module.steps
    assert (start.changed, wus.changed, dce.changed) == (False, True, False)
    assert wus.snapshot.notes == report_lines
    assert wus.diff.opcodes["all-reduce"] == (1, 0)

    (pair,) = wus.graphs
    assert pair.title == "step"
    assert "g" in pair.before_nodes and "g" not in pair.after_nodes  # the all-reduce, replaced
    assert 'class="node collective removed" data-name="g"' in pair.before_svg
    sharded = hlo_tools.parse_module(open(wus.snapshot.file.path).read()).entry
    new_collectives = collections.Counter(i.opcode for i in sharded.instructions
                                          if i.opcode in ("reduce-scatter", "all-gather"))
    assert set(new_collectives) == {"reduce-scatter", "all-gather"}
    for instr in sharded.instructions:
        if instr.opcode in new_collectives:
            assert f'class="node collective added" data-name="{instr.name}"' in pair.after_svg

    assert {s.kind: s.count for s in module.first_stats.collective_summary()} == {"all-reduce": 1}
    assert {s.kind: s.count for s in module.last_stats.collective_summary()} == new_collectives
    text = report.render_html(page)
    for line in report_lines:
        assert html.escape(line) in text
    assert text.count("<svg ") == 2
    assert "module_0003 momentum (xla_passes)" in text
    assert "all-reduce 1 &rarr; 0" in text  # the pass's opcode changes


def test_xla_dump_with_per_pass_files(xla_dump):
    start = time.perf_counter()
    page = report.build_report(str(xla_dump))
    text = report.render_html(page)
    seconds = time.perf_counter() - start
    assert seconds < 20, seconds
    hlo_files = {name for name in os.listdir(xla_dump) if name.endswith(".txt")
                 and (xla_dump / name).read_text().startswith("HloModule ")}
    read = {os.path.basename(s.snapshot.file.path) for m in page.modules for s in m.steps}
    assert read == hlo_files  # every HLO file of the dump is on a timeline, nothing else is
    assert page.warnings == []
    step = next(m for m in page.modules if m.name == "jit_step")
    labels = [s.snapshot.file.label for s in step.steps]
    assert labels[0] == "before_optimizations" and labels[-1] == "cpu_after_optimizations"
    assert [s.snapshot.file.step for s in step.steps[1:-1]] == sorted(s.snapshot.file.step for s in step.steps[1:-1])
    (combiner,) = [s for s in step.steps if s.snapshot.file.pass_name == "cpu-all-reduce-combiner"]
    assert combiner.changed and combiner.diff.opcodes["all-reduce"][1] < combiner.diff.opcodes["all-reduce"][0]
    combined = [t for _, t in combiner.diff.computations[0].added if re.search(r"= \(.*\) all-reduce\(", t)]
    assert combined
    assert any(f'data-name="{t.split()[0][1:]}"' in pair.after_svg for t in combined for pair in combiner.graphs)
    assert text.count('<section class="pass"') == sum(s.changed for m in page.modules for s in m.steps)


def test_unparsable_file_is_a_warning_and_the_timeline_skips_it(wus_dump):
    dump, _ = wus_dump
    (wus_file,) = dump.glob("*.0001.after_weight-update-sharding.txt")
    wus_file.write_text("HloModule broken\n\nENTRY main {\n  ROOT x = f32[] negate(<nope>)\n}\n")
    page = report.build_report(str(dump))
    (warning,) = page.warnings
    assert warning.startswith(f"{wus_file.name}:4:") and "\n" not in warning
    start, broken, dce = page.modules[0].steps
    assert broken.snapshot.error == warning and not broken.changed
    assert dce.previous is start.snapshot and dce.changed  # dce compared with the last readable step
    text = report.render_html(page)
    assert html.escape(warning) in text and "<nope>" not in text


def test_a_module_no_step_changed_gets_a_graph_of_its_entry(tmp_path):
    (tmp_path / "module_0007.momentum.before_optimizations.txt").write_text(MOMENTUM)
    (tmp_path / "module_0007.momentum.cpu_after_optimizations.txt").write_text(MOMENTUM)
    page = report.build_report(str(tmp_path))
    (module,) = page.modules
    assert [s.changed for s in module.steps] == [False, False]
    assert module.overview_svg.count('<g class="node ') == len(hlo_tools.parse_module(MOMENTUM).entry.instructions)
    text = report.render_html(page)
    assert text.count("<svg ") == 1
    assert '<details id="unchanged-modules" open><summary>1 unchanged module: momentum</summary>' in text


def test_text_from_modules_is_escaped(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    sneaky = MOMENTUM.replace("grad = f32[64,16] parameter(2)",
                              'grad = f32[64,16] parameter(2), metadata={op_name="</pre><script>alert(1)</script>"}')
    (dump / "module_0000.momentum.before_xla_passes.txt").write_text(MOMENTUM)
    (dump / "module_0000.momentum.0001.after_edit.txt").write_text(
        "// <img src=x onerror=alert(2)> & more\n" + sneaky.replace("beta = f32[] constant(0.9)",
                                                                   "beta = f32[] constant(0.8)"))
    text = report.render_html(report.build_report(str(dump)))
    (script,) = re.findall(r"<script>(.*?)</script>", text, re.DOTALL)  # only the page's own script
    assert "alert" not in script and "<img" not in text
    assert "&lt;img src=x onerror=alert(2)&gt; &amp; more" in text
    assert "&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in text  # in the text diff
    # And the page may not load anything, nor run any script but that one (allowed by its hash).
    (policy,) = re.findall(r'http-equiv="Content-Security-Policy" content="([^"]*)"', text)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert policy.startswith("default-src 'none';") and f"script-src 'sha256-{digest}'" in policy
    assert "unsafe" not in policy.split("script-src")[1]


def test_a_few_thousand_instructions_report_is_bounded(tmp_path):
    chains = 800
    lines = ["HloModule wide, replica_count=4", "", "add {", "  a = f32[] parameter(0)",
             "  b = f32[] parameter(1)", "  ROOT c = f32[] add(a, b)", "}", "", "ENTRY main {"]
    for i in range(chains):
        lines += [f"  p{i} = f32[8]{{0}} parameter({i})",
                  f"  r{i} = f32[8]{{0}} all-reduce(p{i}), replica_groups={{{{0,1,2,3}}}}, to_apply=add",
                  f"  e{i} = f32[8]{{0}} exponential(r{i})"]
    lines += [f"  ROOT t = ({', '.join(['f32[8]{0}'] * chains)}) tuple({', '.join(f'e{i}' for i in range(chains))})",
              "}", ""]
    dump = tmp_path / "dump"
    xla_passes.Pipeline("all-reduce-combiner", dump_to=str(dump)).run(hlo_tools.parse_module("\n".join(lines)))
    start = time.perf_counter()
    page = report.build_report(str(dump), max_nodes=40)
    text = report.render_html(page)
    seconds = time.perf_counter() - start
    assert seconds < 10, seconds
    (step,) = [s for s in page.modules[0].steps if s.changed]
    (pair,) = step.graphs
    assert len(pair.before_nodes) == len(pair.after_nodes) == 40
    assert len(text) < 400_000, len(text)
    assert re.search(r"40 instructions shown, [\d,]+ more not shown", text)
    assert f"... {step.text_diff_hidden} more lines" in text and step.text_diff_hidden > 0


# --- hlo-tools report ------------------------------------------------------------------------------


def test_report_command_writes_the_page_atomically(capsys, wus_dump, tmp_path):
    dump, _ = wus_dump
    target = tmp_path / "report.html"
    status, out, err = run(capsys, "report", str(dump), "-o", str(target))
    assert (status, err) == (0, "")
    assert out == f"{target}: 1 module, 3 steps\n"
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hlo-tools-")] == []
    status, out, _ = run(capsys, "report", str(dump), "-o", str(target), "--hops", "0", "--max-nodes", "3")
    assert status == 0 and "3 instructions shown" in target.read_text()
    status, _, _ = run(capsys, "report", str(dump), "-o", os.devnull)  # written to, not replaced
    assert status == 0 and stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_report_command_errors_are_one_line(capsys, wus_dump, tmp_path):
    dump, _ = wus_dump
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a dump\n")
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "module_0000.m.before_optimizations.txt").write_text("HloModule m\n\nENTRY {\n")
    dump_file = next(dump.iterdir())
    before = dump_file.read_text()
    cases = [
        ([str(tmp_path / "missing")], "missing: no such directory"),
        ([str(dump_file)], "not a directory"),
        ([str(empty)], "empty: no HLO dumps"),
        ([str(unreadable)], "none of the 1 HLO dumps could be read (first: module_0000.m.before_optimizations.txt:"),
        ([str(dump), "--max-nodes", "0"], "--max-nodes must be at least 1, not 0"),
        ([str(dump), "-o", str(tmp_path / "no" / "out.html")], "no/out.html: the output's directory does not exist"),
    ]
    for argv, message in cases:
        status, out, err = run(capsys, "report", "-o", str(tmp_path / "out.html"), *argv)  # a later -o wins
        assert status == 1 and out == "", argv
        assert len(err.splitlines()) == 1 and message in err, err
    status, _, err = run(capsys, "report", str(dump), "-o", str(dump_file))
    assert status == 1 and "refusing to overwrite a file of the dump" in err
    assert dump_file.read_text() == before
    status, _, err = run(capsys, "report", str(dump), "-o", str(tmp_path))
    assert status == 1 and "is a directory" in err
    assert not (tmp_path / "out.html").exists()


# --- module selection, order, side panel, big computations ------------------------------------------


@pytest.fixture
def three_modules(tmp_path, wus_dump):
    """Module 3 (weight-update-sharding changed it) between two modules that nothing changed."""
    dump, _ = wus_dump
    for number, name in ((1, "jit__normal"), (7, "jit_broadcast_in_dim")):
        (dump / f"module_{number:04d}.{name}.before_xla_passes.txt").write_text(MOMENTUM)
        (dump / f"module_{number:04d}.{name}.0001.after_dce.txt").write_text(MOMENTUM)
    return dump


def test_changed_modules_first_the_unchanged_folded_into_one_line(three_modules):
    page = report.build_report(str(three_modules))
    assert [(m.number, m.changed) for m in page.modules] == [(1, False), (3, True), (7, False)]
    text = report.render_html(page)
    folded = "2 unchanged modules: jit__normal, jit_broadcast_in_dim"
    assert "3 modules, 1 changed" in text
    assert f'<a href="#unchanged-modules">{folded}</a>' in text
    details = text.index(f'<details id="unchanged-modules"><summary>{folded}</summary>')
    sections = [text.index(f'<section class="module" id="module-{i}">') for i in range(3)]
    assert sections[1] < details < sections[0] < sections[2]  # the changed module's section first
    assert text.count("<details id=") == 1


def test_module_selects_by_module_name_or_file_name(three_modules):
    page = report.build_report(str(three_modules), module_pattern="jit_")
    assert [m.name for m in page.modules] == ["jit__normal", "jit_broadcast_in_dim"]
    assert page.unselected_modules == 1 and page.ignored_files == 0
    assert "2 modules matching --module <code>jit_</code> (1 more not selected), 0 changed" in report.render_html(page)
    assert [m.number for m in report.build_report(str(three_modules), module_pattern="^module_0007").modules] == [7]
    assert [m.name for m in report.build_report(str(three_modules), module_pattern="weight-update").modules] == [
        "momentum"]  # a pass's file name
    with pytest.raises(report.ReportError, match=r"^--module 'nope' matches none of the 3 modules \(by name or file "
                                                 r"name\): jit__normal, momentum, jit_broadcast_in_dim$"):
        report.build_report(str(three_modules), module_pattern="nope")


def test_report_command_module_and_layout_options(capsys, three_modules, tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    status, out, err = run(capsys, "report", str(three_modules), "-o", str(target), "--module", "momentum",
                           "--layout", "builtin")
    assert (status, out, err) == (0, f"{target}: 1 module, 3 steps\n", "")
    assert target.read_text().count('<section class="module"') == 1
    for argv, message in [(["--module", "nope"], "hlo-tools: error: --module 'nope' matches none of the 3 modules"),
                          (["--module", "(jit"], "hlo-tools: error: --module '(jit': not a regular expression ("),
                          (["--layout", "dot"], "hlo-tools: error: --layout dot: Graphviz's dot is not installed")]:
        monkeypatch.setattr(graph.shutil, "which", lambda name: None)  # no Graphviz
        status, out, err = run(capsys, "report", str(three_modules), "-o", str(target), *argv)
        assert status == 1 and out == "" and len(err.splitlines()) == 1 and err.startswith(message), err


def test_side_panel_links_each_change_to_its_nodes_and_its_diff_line(wus_dump):
    dump, _ = wus_dump
    page = report.build_report(str(dump))
    (pair,) = page.modules[0].steps[1].graphs
    changes = {change.name: change for change in pair.changes}
    assert changes["g"].status == "removed" and (changes["g"].before, changes["g"].after) == ("g", None)
    text = report.render_html(page)
    panel = re.search(r'<aside class="changes">.*?</aside>', text).group()
    items = dict(re.findall(r'<li class="\w+" data-name="([^"]+)">(.*?)</li>', panel))
    assert set(items) == set(changes)
    links = dict((label, target) for target, label in re.findall(r'<a class="\w+" href="#([^"]+)">(\w+)</a>',
                                                                   items["g"]))
    assert set(links) == {"before", "diff"}
    assert re.search(f'<g class="node collective removed" data-name="g" data-opcode="all-reduce" '
                     f'id="{links["before"]}">', text)
    assert re.search(f'<span id="{links["diff"]}">-  %?g = f32\\[64,16\\]({{[^}}]*}})? all-reduce\\(', text)
    added = [c for c in pair.changes if c.status == "added"]
    assert added and all(re.search(r'>after</a> <a class="diff"', items[c.name]) for c in added)


def ten_thousand_instructions() -> str:
    """2,500 parameter -> negate -> all-reduce -> exponential chains into the ROOT tuple, and two
    dead instructions: 10,003 in the entry."""
    chains = 2500
    lines = ["HloModule big, replica_count=4", "", "add {", "  a = f32[] parameter(0)", "  b = f32[] parameter(1)",
             "  ROOT c = f32[] add(a, b)", "}", "", "ENTRY main {"]
    for i in range(chains):
        lines += [f"  p{i} = f32[8]{{0}} parameter({i})", f"  n{i} = f32[8]{{0}} negate(p{i})",
                  f"  r{i} = f32[8]{{0}} all-reduce(n{i}), replica_groups={{{{0,1,2,3}}}}, to_apply=add",
                  f"  e{i} = f32[8]{{0}} exponential(r{i})"]
    lines += ["  dead = f32[8]{0} add(e5, e6)", "  dead2 = f32[8]{0} multiply(dead, e7)",
              f"  ROOT t = ({', '.join(['f32[8]{0}'] * chains)}) tuple({', '.join(f'e{i}' for i in range(chains))})",
              "}", ""]
    return "\n".join(lines)


@pytest.mark.parametrize("passes", ["dce", "all-reduce-combiner"])
def test_ten_thousand_instructions_graph_the_neighbourhood_of_the_change_quickly(tmp_path, passes):
    dump = tmp_path / "dump"
    xla_passes.Pipeline(passes, dump_to=str(dump)).run(hlo_tools.parse_module(ten_thousand_instructions()))
    start = time.perf_counter()
    page = report.build_report(str(dump))
    text = report.render_html(page)
    seconds = time.perf_counter() - start
    assert seconds < 10, seconds  # about 1 s on a loaded 2-core machine
    (step,) = [s for s in page.modules[0].steps if s.changed]
    (pair,) = step.graphs
    if passes == "dce":  # two removed: they and one hop around them
        assert sorted(pair.before_nodes) == ["dead", "dead2", "e5", "e6", "e7"] and pair.after_svg is None
        assert "before: main: 5 instructions shown, 9,998 more not shown" in text
    else:  # 2,500 all-reduces combined: every graph at its cap, the text diff cut
        assert len(pair.before_nodes) == len(pair.after_nodes) == report.DEFAULT_MAX_NODES
        assert f"{report.DEFAULT_MAX_NODES} instructions shown, 9,943 more not shown" in text
        assert step.text_diff_hidden > 10_000
    assert len(text) < 200_000


def apply_unified_diff(old: list[str], diff: list[str]) -> list[str]:
    """``old`` patched by ``diff``, checking that its context and removed lines are old's."""
    out, position = [], 0
    for line in diff[2:]:
        hunk = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@$", line)
        if hunk:
            begin = int(hunk.group(1)) - (hunk.group(2) != "0")
            out, position = out + old[position:begin], begin
        elif line[0] == "+":
            out.append(line[1:])
        else:
            assert old[position] == line[1:], (position, line)
            out += [line[1:]] if line[0] == " " else []
            position += 1
    return out + old[position:]


def test_unified_diff_patches_old_into_new_and_reads_like_difflib():
    rng = random.Random(7)
    like_difflib = 0
    for _ in range(500):
        words = [f"line {k}" for k in range(rng.randint(1, 20))]
        old = [rng.choice(words) for _ in range(rng.randint(0, 30))]
        new = list(old)
        for _ in range(rng.randint(0, 6)):
            at = rng.randint(0, len(new))
            if rng.random() < 0.5 and at < len(new):
                del new[at]
            else:
                new.insert(at, rng.choice([*words, "new"]))
        diff = report.unified_diff(old, new, "a.txt", "b.txt")
        assert apply_unified_diff(old, diff) == new and (diff == []) == (old == new)
        like_difflib += diff == list(difflib.unified_diff(old, new, "a.txt", "b.txt", n=2, lineterm=""))
    assert like_difflib > 400  # the same hunks unless lines repeat: then either is a right answer
    assert report.unified_diff(["a", "b", "c", "d"], ["a", "c", "d", "e"], "x", "y") == [
        "--- x", "+++ y", "@@ -1,4 +1,4 @@", " a", "-b", " c", " d", "+e"]
