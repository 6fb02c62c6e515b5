"""hlo-tools stats: the IR's counts (exact, on hand-written and real modules) and XLA's numbers."""

import json
import math
import pathlib
import re

import pytest

import hlo_tools
import real_programs
from hlo_tools.inspection import stats
from hlo_tools.ir.attributes import ReplicaGroups
from support import run_hlo_tools as run

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "stats.md"
ERROR_LINE = re.compile(r"hlo-tools: error: [^\n]+\n")

# Every collective kind in its sync or async form, a combined (tuple) all-reduce, a fusion and
# a constant; replica_count=4.
COLLECTIVES_MODULE = """HloModule collectives, replica_count=4

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

fused_negate {
  a = f32[8]{0} parameter(0)
  ROOT n = f32[8]{0} negate(a)
}

ENTRY main {
  p = f32[8]{0} parameter(0)
  k = bf16[3]{0} constant({1, 2, 3})
  f = f32[8]{0} fusion(p), kind=kLoop, calls=fused_negate
  ags = (f32[8]{0}, f32[32]{0}) all-gather-start(f), replica_groups={{0,1,2,3}}, dimensions={0}
  agd = f32[32]{0} all-gather-done(ags)
  rss = ((f32[32]{0}), f32[8]{0}) reduce-scatter-start(agd), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=add
  rsd = f32[8]{0} reduce-scatter-done(rss)
  cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(rsd), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  cpd = f32[8]{0} collective-permute-done(cps)
  ars = f32[8]{0} all-reduce-start(cpd), replica_groups={}, to_apply=add
  ard = f32[8]{0} all-reduce-done(ars)
  ROOT t = (f32[8]{0}, f32[8]{0}) all-reduce(ard, p), replica_groups={{0,1},{2,3}}, to_apply=add
}
"""

DOT_MODULE = """HloModule dot

ENTRY main {
  x = f32[8,16]{1,0} parameter(0)
  w = f32[16,4]{1,0} parameter(1)
  ROOT d = f32[8,4]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""

# Parses and verifies, but XLA has no such custom call: compiling fails with an error.
UNKNOWN_CUSTOM_CALL = """HloModule unknown_target

ENTRY main {
  x = f32[8]{0} parameter(0)
  ROOT y = f32[8]{0} custom-call(x), custom_call_target="no_such_target"
}
"""

# XLA's GSPMD partitioner CHECK-fails (aborts the process) on a manual parameter feeding a tiled
# instruction; the `Sharding` custom call makes stats pick that partitioner, as the runner does.
CRASHING = """HloModule careless_manual, num_partitions=4

ENTRY main {
  p = f32[8,3] parameter(0), sharding={manual}
  c = f32[8,3] copy(p), sharding={devices=[4,1]<=[4]}
  ROOT s = f32[8,3] custom-call(c), custom_call_target="Sharding", sharding={devices=[4,1]<=[4]}
}
"""

def write(tmp_path, text, name="module.hlo"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def f32_bytes(*dims):
    return 4 * math.prod(dims)


# --- The IR part -----------------------------------------------------------------------------------


def test_collectives_by_kind_with_bytes_and_groups():
    summary = {s.kind: s for s in stats.module_stats(hlo_tools.parse_module(COLLECTIVES_MODULE))
               .collective_summary()}
    assert summary == {
        "all-gather": stats.CollectiveSummary("all-gather", 1, 1, f32_bytes(8), f32_bytes(32),
                                              f32_bytes(32), ["f32"], ["{{0,1,2,3}}"]),
        # all-reduce-start and the combined all-reduce of two buffers
        "all-reduce": stats.CollectiveSummary("all-reduce", 2, 3, 3 * f32_bytes(8), 3 * f32_bytes(8),
                                              3 * f32_bytes(8), ["f32"], ["{}", "{{0,1},{2,3}}"]),
        "collective-permute": stats.CollectiveSummary(
            "collective-permute", 1, 1, f32_bytes(8), f32_bytes(8), f32_bytes(8), ["f32"],
            ["{{0,1},{1,2},{2,3},{3,0}}"]),
        "reduce-scatter": stats.CollectiveSummary("reduce-scatter", 1, 1, f32_bytes(32), f32_bytes(8),
                                                  f32_bytes(32), ["f32"], ["[1,4]<=[4]"]),
    }


def test_async_collective_counts_once_with_what_its_done_delivers():
    ops = {op.name: op for op in stats.module_stats(hlo_tools.parse_module(COLLECTIVES_MODULE)).collectives}
    assert set(ops) == {"ags", "rss", "cps", "ars", "t"}  # no -done
    # all-gather-start's own shape also holds its operand: the result is the done's f32[32].
    assert (ops["ags"].opcode, ops["ags"].result_bytes) == ("all-gather-start", f32_bytes(32))
    assert ops["cps"].result_bytes == f32_bytes(8)  # not the start's (in, out, context) tuple


def test_sizes_fusions_and_counts():
    report = stats.module_stats(hlo_tools.parse_module(COLLECTIVES_MODULE))
    assert (report.replica_count, report.num_partitions) == (4, None)  # as the header says
    assert (len(report.computations), report.instructions, report.entry.instructions) == (3, 17, 12)
    assert (report.parameter_count, report.parameter_bytes) == (1, f32_bytes(8))
    assert (report.output_count, report.output_bytes) == (2, 2 * f32_bytes(8))
    assert (report.constant_count, report.constant_bytes) == (1, 3 * 2)  # bf16[3]
    assert (report.fusions, dict(report.fusion_kinds)) == (1, {"kLoop": 1})
    assert report.opcodes["parameter"] == 4 and report.entry.opcodes["parameter"] == 1


def test_pmap_step_all_reduce_bytes_match_its_gradient_and_loss(jax_modules):
    _, (w, _, _) = real_programs.pmap_psum_step()
    per_device_gradient = f32_bytes(*w.shape[1:])  # pmap maps the leading axis
    report = stats.module_stats(hlo_tools.parse_module(jax_modules["jax.pmap_psum.before"]))
    (summary,) = report.collective_summary()
    assert (summary.kind, summary.count, len(summary.groups)) == ("all-reduce", 2, 1)
    # as written: `{{0,...,7}}`, or (jaxlib 0.12) over the mesh axis of pmap, `mesh['batch'=8] {'batch'}`
    assert ReplicaGroups.parse(summary.groups[0]).groups == [list(range(real_programs.N_DEVICES))]
    assert summary.operand_bytes == summary.bytes_moved == per_device_gradient + f32_bytes()
    assert sorted(op.operand_bytes for op in report.collectives) == [f32_bytes(), per_device_gradient]


def test_fusions_of_an_optimized_module_match_its_text(jax_modules):
    text = jax_modules["jax.flax_cnn_adam.after"]
    report = stats.module_stats(hlo_tools.parse_module(text))
    fusion_lines = re.findall(r"= \S+ fusion\([^\n]*", text)
    assert report.fusions == len(fusion_lines) > 0
    kinds = [re.search(r"\bkind=(\w+)", line).group(1) for line in fusion_lines]
    assert dict(report.fusion_kinds) == {k: kinds.count(k) for k in set(kinds)}


# --- The command -----------------------------------------------------------------------------------


def test_text_report_has_aligned_columns(capsys, tmp_path):
    status, out, err = run(capsys, "stats", "--no-compile", write(tmp_path, COLLECTIVES_MODULE))
    assert (status, err) == (0, "")
    assert out.startswith("module collectives: 3 computations, 17 instructions (entry main: 12); "
                          "replica_count=4\n")
    assert "fusions: 1 (kLoop 1)\n" in out
    assert "XLA" not in out
    table = out.split("\n\ncollectives")[1].split("\n\n")[0].splitlines()
    header, rows = "collectives" + table[0], table[1:]
    for column in ("count", "operand bytes", "bytes moved"):
        right = header.index(column) + len(column)  # numbers are right-aligned under their title
        for row in rows:
            assert row[right - 1] in "0123456789 " and row[right:right + 1] in ("", " "), (column, row)
    assert re.search(r"^reduce-scatter +1 +1 +128 +32 +128 +f32 +\[1,4\]<=\[4\]$", out, re.M)


def test_json_report_is_parseable_and_documented(capsys, tmp_path):
    status, out, _ = run(capsys, "stats", "--json", "--no-compile", write(tmp_path, COLLECTIVES_MODULE))
    assert status == 0
    report = json.loads(out)
    assert report["collectives"]["all-reduce"] == {
        "kind": "all-reduce", "count": 2, "buffers": 3, "operand_bytes": 96, "result_bytes": 96,
        "bytes_moved": 96, "dtypes": ["f32"], "groups": ["{}", "{{0,1},{2,3}}"]}
    assert report["fusions"] == {"count": 1, "kinds": {"kLoop": 1}}
    assert report["constants"] == {"count": 1, "bytes": 6}
    assert (report["xla"], report["xla_error"]) == (None, None)
    page = DOC.read_text(encoding="utf-8")
    keys = set(report) | {f"collectives.{k}" for k in report["collectives"]["all-gather"]}
    keys |= set(report["collective_instructions"][0]) | set(report["per_computation"][0])
    for key in keys:
        assert f"`{key.rsplit('.', 1)[-1]}`" in page, f"docs/stats.md does not describe {key}"


def test_xla_cost_analysis_of_a_dot(capsys, tmp_path):
    status, out, err = run(capsys, "stats", "--json", write(tmp_path, DOT_MODULE))
    assert (status, err) == (0, "")
    xla = json.loads(out)["xla"]
    assert xla["flops"] == 2 * 8 * 16 * 4  # a multiply and an add per (i, j, k)
    assert xla["memory"]["argument_bytes"] == f32_bytes(8, 16) + f32_bytes(16, 4)
    assert xla["memory"]["output_bytes"] == f32_bytes(8, 4)
    assert (xla["num_replicas"], xla["num_partitions"], xla["partitioner"]) == (1, 1, "none")
    page = DOC.read_text(encoding="utf-8")
    for key in [*xla, *xla["memory"]]:
        assert f"`{key}`" in page, f"docs/stats.md does not describe xla.{key}"
    status, out, _ = run(capsys, "stats", write(tmp_path, DOT_MODULE))
    assert "XLA (cpu, 1 device, partitioner none; numbers per device)\n" in out
    assert re.search(r"^  flops +1,024$", out, re.M)


def test_xla_cost_of_a_partitioned_jax_step_is_per_device(jax_modules):
    cost = stats.xla_cost(jax_modules["jax.shard_map_mlp.before"], isolate=False)
    assert (cost.num_partitions, cost.partitioner) == (real_programs.N_DEVICES, "shardy")
    assert cost.cost_analysis["flops"] > 0
    _, ((w1, w2), x, y) = real_programs.shard_map_mlp_step()
    n = real_programs.N_DEVICES  # x and y are split over the devices; the weights replicated
    expected = (f32_bytes(*w1.shape) + f32_bytes(*w2.shape) + f32_bytes(*x.shape) // n
                + f32_bytes(*y.shape) // n)
    assert cost.memory["argument_bytes"] == expected


@pytest.mark.parametrize("text, reason", [
    (UNKNOWN_CUSTOM_CALL, "XLA could not compile the module: NOT_FOUND: "),
    (CRASHING, "XLA crashed while compiling (SIGABRT): Check failed: "),
])
def test_xla_failure_is_a_warning_line(capsys, tmp_path, text, reason):
    status, out, err = run(capsys, "stats", write(tmp_path, text))
    assert (status, err) == (0, "")
    last = out.splitlines()[-1]
    assert last.startswith(f"XLA cost analysis unavailable: {reason}")
    status, out, _ = run(capsys, "stats", "--json", write(tmp_path, text))
    report = json.loads(out)
    assert report["xla"] is None and report["xla_error"].startswith(reason)


def test_compile_timeout_is_a_warning_line(capsys, tmp_path):
    status, out, _ = run(capsys, "stats", "--timeout", "0.01", write(tmp_path, DOT_MODULE))
    assert status == 0
    assert out.endswith("XLA cost analysis unavailable: compiling took longer than 0.01 s and was stopped\n")


def test_errors_are_one_line(capsys, tmp_path):
    missing = tmp_path / "missing.hlo"
    status, out, err = run(capsys, "stats", missing)
    assert (status, out, err) == (1, "", f"hlo-tools: error: {missing}: No such file or directory\n")
    bad = write(tmp_path, DOT_MODULE.replace("parameter(1)", "parameter(1"), "bad.hlo")
    status, out, err = run(capsys, "stats", bad)
    assert (status, out) == (1, "")
    assert err == f"hlo-tools: error: {bad}:6:3: expects ')', saw 'ROOT d = f32'\n"
    status, _, err = run(capsys, "stats", "--timeout", "-1", write(tmp_path, DOT_MODULE))
    assert status == 1 and ERROR_LINE.fullmatch(err)
