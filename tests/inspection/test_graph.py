"""`hlo_tools.inspection.graph` and `hlo-tools graph`: SVG drawings of computations.

Both layouts are tested: builtin always, dot where Graphviz is installed (.ci/run
installs it; without it those tests skip, except under CI=true, where they fail).
"""
from __future__ import annotations

import os
import re
import shutil
import time
import xml.etree.ElementTree as ET

import pytest

import hlo_tools
import real_programs
from hlo_tools.inspection import graph
from support import run_hlo_tools as run

SVG = "{http://www.w3.org/2000/svg}"

SMALL = """HloModule small, replica_count=2

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

fused_scale {
  fp = f32[8]{0} parameter(0)
  fc = f32[] constant(2)
  fb = f32[8]{0} broadcast(fc), dimensions={}
  ROOT fm = f32[8]{0} multiply(fp, fb)
}

ENTRY main {
  p = f32[8]{0} parameter(0), sharding={replicated}
  scaled = f32[8]{0} fusion(p), kind=kLoop, calls=fused_scale
  n = f32[8]{0} negate(scaled)
  r = f32[8]{0} all-reduce(n), replica_groups={{0,1}}, to_apply=add
  cc = f32[8]{0} custom-call(r), custom_call_target="a<b>&\\"c\\""
  ROOT t = (f32[8]{0}, f32[8]{0}) tuple(cc, scaled)
}
"""


def chain_module(length: int) -> hlo_tools.HloModule:
    """p -> n1 -> n2 -> ... -> n<length> (ROOT)."""
    lines = ["HloModule chain", "", "ENTRY main {", "  n0 = f32[4]{0} parameter(0)"]
    lines += [f"  {'ROOT ' if i == length else ''}n{i} = f32[4]{{0}} negate(n{i - 1})" for i in range(1, length + 1)]
    return hlo_tools.parse_module("\n".join(lines + ["}", ""]))


def wide_module(chains: int) -> hlo_tools.HloModule:
    """`chains` independent parameter -> negate -> all-reduce -> exponential chains, all in one tuple:
    4 * chains + 1 instructions in the entry."""
    lines = ["HloModule wide, replica_count=4", "", "add {", "  a = f32[] parameter(0)",
             "  b = f32[] parameter(1)", "  ROOT c = f32[] add(a, b)", "}", "", "ENTRY main {"]
    for i in range(chains):
        lines += [f"  p{i} = f32[8]{{0}} parameter({i})", f"  n{i} = f32[8]{{0}} negate(p{i})",
                  f"  r{i} = f32[8]{{0}} all-reduce(n{i}), replica_groups={{{{0,1,2,3}}}}, to_apply=add",
                  f"  e{i} = f32[8]{{0}} exponential(r{i})"]
    shapes = ", ".join(["f32[8]{0}"] * chains)
    lines += [f"  ROOT t = ({shapes}) tuple({', '.join(f'e{i}' for i in range(chains))})", "}", ""]
    return hlo_tools.parse_module("\n".join(lines))


def layout_or_skip(layout: str) -> str:
    """``layout``, when this machine can draw it: dot needs Graphviz (a failure under CI=true)."""
    if layout == "dot" and shutil.which("dot") is None:
        message = "Graphviz's dot is not installed (apt-get install graphviz)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test the dot layout: {message}")
        pytest.skip(message)
    return layout


BOTH_LAYOUTS = pytest.mark.parametrize("layout", ["builtin", "dot"])


def drawn_nodes(svg: str) -> dict[str, dict]:
    """Each node of a rendered SVG: its classes, box (x, y, width, height) and texts; the SVG must be valid XML."""
    root = ET.fromstring(svg)
    nodes = {}
    for g in root.iter(f"{SVG}g"):
        if "node" not in g.get("class", "").split():
            continue
        rect = g.find(f"{SVG}rect")
        nodes[g.get("data-name")] = {
            "classes": set(g.get("class").split()), "opcode": g.get("data-opcode"),
            "box": tuple(float(rect.get(k)) for k in ("x", "y", "width", "height")),
            "texts": [t.text for t in g.findall(f"{SVG}text")], "title": g.find(f"{SVG}title").text}
    return nodes


def test_small_module_every_instruction_with_highlights_and_a_legend():
    module = hlo_tools.parse_module(SMALL)
    drawn = graph.computation_graph(module.entry)
    assert [n.name for n in drawn.nodes] == ["p", "scaled", "n", "r", "cc", "t"]
    assert sorted(drawn.edges) == sorted([("p", "scaled"), ("scaled", "n"), ("n", "r"), ("r", "cc"),
                                          ("cc", "t"), ("scaled", "t")])
    assert drawn.hidden == 0
    svg = graph.render_svg(drawn)
    nodes = drawn_nodes(svg)
    assert set(nodes) == {"p", "scaled", "n", "r", "cc", "t"}  # the fused computation is not drawn
    assert "collective" in nodes["r"]["classes"] and nodes["r"]["texts"][:2] == ["r", "all-reduce f32[8]"]
    assert "sharded" in nodes["p"]["classes"] and "sharded" not in nodes["n"]["classes"]
    assert nodes["scaled"]["classes"] >= {"fusion"}
    fusion = next(n for n in drawn.nodes if n.name == "scaled")
    assert fusion.detail == "fusion kLoop constant,broadcast,multiply"  # what it fuses, clipped when drawn
    assert nodes["scaled"]["texts"][1] == fusion.detail[:33] + "\u2026"
    assert nodes["cc"]["title"] == 'cc = f32[8]{0} custom-call(%r), custom_call_target="a<b>&\\"c\\""'.replace(
        "cc =", "%cc =")  # text from the module is escaped: the SVG parsed as XML
    legend = ET.fromstring(svg).find(f"{SVG}g[@class='legend']")
    assert [t.text for t in legend.iter(f"{SVG}text")] == ["collective", "sharded", "fusion", "added",
                                                            "removed", "changed"]
    assert "6 instructions shown" in svg and "not shown" not in svg


@pytest.fixture(scope="module")
def shard_map_body():
    step, args = real_programs.shard_map_mlp_step()
    hlo = hlo_tools.parse_module(step.lower(*args).compiler_ir("hlo").as_hlo_text())
    return max(hlo.computations, key=lambda c: len(c.instructions))


@BOTH_LAYOUTS
def test_layout_operands_above_users_and_no_overlaps(shard_map_body, layout):
    comp = shard_map_body
    drawn = graph.computation_graph(comp, max_nodes=500)
    svg = graph.render_svg(drawn, layout=layout_or_skip(layout))
    nodes = drawn_nodes(svg)
    assert len(nodes) == len(comp.instructions) > 20
    for src, dst in drawn.edges:
        assert nodes[src]["box"][1] + nodes[src]["box"][3] < nodes[dst]["box"][1], (src, dst)
    boxes = sorted(node["box"] for node in nodes.values())
    for i, (x1, y1, w1, h1) in enumerate(boxes):  # no two nodes overlap
        for x2, y2, w2, h2 in boxes[i + 1:]:
            assert x1 + w1 <= x2 or y1 + h1 <= y2 or y2 + h2 <= y1, ((x1, y1), (x2, y2))
    assert any("collective" in n["classes"] and n["opcode"] == "all-reduce" for n in nodes.values())
    root = ET.fromstring(svg)
    width, height = float(root.get("width")), float(root.get("height"))
    assert all(0 <= x and x + w <= width and 0 <= y and y + h <= height for x, y, w, h in boxes)
    paths = root.findall(f"{SVG}g[@class='edges']/{SVG}path")
    assert len(paths) == len(drawn.edges)
    def on_outline(point, box) -> bool:
        (px, py), (x, y, w, h) = point, box
        inside = x - 2 <= px <= x + w + 2 and y - 2 <= py <= y + h + 2
        return inside and min(abs(px - x), abs(px - x - w), abs(py - y), abs(py - y - h)) < 2

    for path, (src, dst) in zip(paths, drawn.edges):  # each edge from its operand's outline to its user's
        points = [tuple(map(float, p.split(","))) for p in re.findall(r"-?[\d.]+,-?[\d.]+", path.get("d"))]
        assert len(points) % 3 == 1  # a start and cubic Bezier segments
        assert on_outline(points[0], nodes[src]["box"]), (src, dst, points[0])
        assert on_outline(points[-1], nodes[dst]["box"]), (src, dst, points[-1])


def test_the_two_layouts_differ_and_auto_means_dot_when_installed(shard_map_body, monkeypatch):
    drawn = graph.computation_graph(shard_map_body, max_nodes=500)
    dot, builtin = (graph.render_svg(drawn, layout=layout) for layout in (layout_or_skip("dot"), "builtin"))
    boxes = {svg: {name: n["box"] for name, n in drawn_nodes(svg).items()} for svg in (dot, builtin)}
    assert boxes[dot] != boxes[builtin] and boxes[dot].keys() == boxes[builtin].keys()
    assert graph.render_svg(drawn) == dot
    monkeypatch.setattr(graph.shutil, "which", lambda name: None)  # no Graphviz
    assert graph.render_svg(drawn) == builtin
    with pytest.raises(graph.LayoutError, match="dot is not installed"):
        graph.render_svg(drawn, layout="dot")


def test_focus_takes_hops_of_neighbours_and_counts_the_rest():
    module = chain_module(20)
    drawn = graph.computation_graph(module.entry, focus=["n10"], hops=2)
    assert [n.name for n in drawn.nodes] == ["n8", "n9", "n10", "n11", "n12"]
    assert drawn.hidden == 16
    assert {n.name: n.hidden_neighbours for n in drawn.nodes} == {"n8": 1, "n9": 0, "n10": 0, "n11": 0, "n12": 1}
    svg = graph.render_svg(drawn)
    assert "5 instructions shown, 16 more not shown" in svg
    assert drawn_nodes(svg)["n8"]["texts"][-1] == "+1"
    assert [n.name for n in graph.computation_graph(module.entry, focus=["n10"], hops=0).nodes] == ["n10"]
    with pytest.raises(KeyError):
        graph.computation_graph(module.entry, focus=["nope"])


def test_status_marks_nodes_for_diffs():
    module = chain_module(4)
    drawn = graph.computation_graph(module.entry, status={"n2": "added", "n3": "changed"})
    nodes = drawn_nodes(graph.render_svg(drawn))
    assert "added" in nodes["n2"]["classes"] and "changed" in nodes["n3"]["classes"]
    assert not nodes["n1"]["classes"] & set(graph.STATUSES)


def test_async_collective_halves_are_collectives():
    module = hlo_tools.parse_module(SMALL.replace(
        "r = f32[8]{0} all-reduce(n), replica_groups={{0,1}}, to_apply=add",
        "start = f32[8]{0} all-reduce-start(n), replica_groups={{0,1}}, to_apply=add\n"
        "  r = f32[8]{0} all-reduce-done(start)"))
    kinds = {n.name: n.kind for n in graph.computation_graph(module.entry).nodes}
    assert (kinds["start"], kinds["r"], kinds["n"]) == ("collective", "collective", "other")


@BOTH_LAYOUTS
def test_a_few_thousand_instructions_stay_bounded_in_time_and_size(layout):
    module = wide_module(1000)  # 4,001 instructions in the entry
    start = time.perf_counter()
    drawn = graph.computation_graph(module.entry)
    svg = graph.render_svg(drawn, layout=layout_or_skip(layout))
    seconds = time.perf_counter() - start
    assert seconds < 2.0, seconds
    assert len(drawn.nodes) == graph.DEFAULT_MAX_NODES and drawn.hidden == 4001 - graph.DEFAULT_MAX_NODES
    assert f"{4001 - graph.DEFAULT_MAX_NODES:,} more not shown" in svg
    assert len(svg) < 150_000, len(svg)
    width = float(ET.fromstring(svg).get("width"))
    assert width < 3000, width  # the ROOT's 1000 operands wrap onto rows instead of one endless line
    focused = graph.computation_graph(module.entry, focus=["r500"], hops=1)
    assert [n.name for n in focused.nodes] == ["n500", "r500", "e500"]


# --- hlo-tools graph -------------------------------------------------------------------------------

@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.hlo"
    path.write_text(SMALL)
    return path


def test_graph_command_writes_svg(capsys, small_file, tmp_path):
    status, out, err = run(capsys, "graph", str(small_file))
    assert status == 0 and err == ""
    assert set(drawn_nodes(out)) == {"p", "scaled", "n", "r", "cc", "t"}
    target = tmp_path / "out.svg"
    status, out, _ = run(capsys, "graph", str(small_file), "-o", str(target), "--focus", "r", "--hops", "1")
    assert status == 0 and out == ""
    assert set(drawn_nodes(target.read_text())) == {"n", "r", "cc"}
    status, out, _ = run(capsys, "graph", str(small_file), "--computation", "fused_scale")
    assert set(drawn_nodes(out)) == {"fp", "fc", "fb", "fm"}
    status, out, _ = run(capsys, "graph", str(small_file), "--max-nodes", "2")
    assert set(drawn_nodes(out)) == {"t", "cc"} and "4 more not shown" in out
    drawings = {layout: run(capsys, "graph", str(small_file), "--layout", layout)[1] for layout in ("builtin", "dot")}
    assert drawings["builtin"] == graph.render_svg(graph.computation_graph(
        hlo_tools.parse_module(SMALL).entry, title="small: computation main"), layout="builtin")
    if shutil.which("dot"):
        assert set(drawn_nodes(drawings["dot"])) == set(drawn_nodes(drawings["builtin"]))
        assert drawings["dot"] != drawings["builtin"]


@pytest.mark.parametrize("argv, message", [
    (["--computation", "nope"], "no computation named 'nope' in module small"),
    (["--focus", "nope"], "no instruction named 'nope' in computation main"),
    (["--max-nodes", "0"], "--max-nodes must be at least 1, not 0"),
    (["--hops", "-1"], "--hops must be 0 or more, not -1"),
    (["--layout", "dot"], "--layout dot: Graphviz's dot is not installed (apt-get install graphviz)"),
])
def test_graph_command_bad_options_are_one_line(capsys, small_file, argv, message, monkeypatch):
    monkeypatch.setattr(graph.shutil, "which", lambda name: None)  # no Graphviz
    status, out, err = run(capsys, "graph", str(small_file), *argv)
    assert status == 1 and out == ""
    assert len(err.splitlines()) == 1 and message in err


def test_a_failing_dot_is_one_line(capsys, small_file, tmp_path, monkeypatch):
    fake = tmp_path / "dot"
    fake.write_text("#!/bin/sh\necho 'Error: out of memory' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    status, out, err = run(capsys, "graph", str(small_file), "--layout", "dot")
    assert status == 1 and out == ""
    assert err == (f"hlo-tools: error: {small_file}: dot failed on small: computation main (exit status 3): "
                   f"Error: out of memory\n")


def test_graph_command_bad_input_is_one_line_and_never_overwritten(capsys, small_file, tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule bad\n\nENTRY main {\n  ROOT x = f32[] negate(y)\n}\n")
    status, _, err = run(capsys, "graph", str(bad))
    assert status == 1 and re.fullmatch(r"hlo-tools: error: .*bad\.hlo:4:\d+: .*'y'.*\n", err)
    status, _, err = run(capsys, "graph", str(small_file), "-o", str(small_file))
    assert status == 1 and "refusing to overwrite the input file" in err
    assert small_file.read_text() == SMALL
