"""Dumps of the JAX hook (`XLA_PASSES_DUMP_TO`) run with `hlo-tools run` and `hlo-tools stats`.

A hook module is per-device, laid out and fused (scheduled too at `post_scheduler`): XLA no
longer compiles it from the start, so hlo-tools compiles it from the stage its dump names
(`hlo_tools.xla.xla_bridge.compile_optimized_module`), on the device counts its header gives.
The dumps are made here, by an unmodified data-parallel step run with
`XLA_PASSES=weight-update-sharding` on 8 CPU devices, and used through the CLI as a user would.
"""
from __future__ import annotations

import pathlib
import re

import pytest

import hlo_tools
from hlo_tools.xla import runner, xla_bridge
from support import run_hlo_tools as run
from test_jax_plugin import run_worker

PASS = "weight-update-sharding"
ERROR_LINE = re.compile(r"hlo-tools: error: [^\n]+\n")

# A fused module as a hook hands it over, with a fusion XLA's CPU backend cannot compile.
UNCOMPILABLE = """// xla_passes: layouts final (after XLA's layout assignment), XLA stage pre_scheduler
HloModule no_backend_config, entry_computation_layout={(f32[8]{0})->f32[8]{0}}, replica_count=1, num_partitions=1

fused {
  a = f32[8]{0} parameter(0)
  ROOT n = f32[8]{0} negate(a)
}

ENTRY main {
  x = f32[8]{0} parameter(0)
  ROOT y = f32[8]{0} fusion(x), kind=kCustom, calls=fused
}
"""


def dump_step(directory: pathlib.Path, stage: str) -> tuple[pathlib.Path, pathlib.Path]:
    """The step's dumps before and after the pass, taken at `stage` of XLA's pipeline."""
    run_worker("momentum", env={"XLA_PASSES": PASS, "XLA_PASSES_STRICT": "1", "XLA_PASSES_STAGE": stage,
                                "XLA_PASSES_DUMP_TO": str(directory)})
    [before] = directory.glob("module_*.jit_step.before_xla_passes.txt")
    [after] = directory.glob(f"module_*.jit_step.0001.after_{PASS}.txt")
    return before, after


@pytest.fixture(scope="module")
def pre_scheduler_dumps(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    return dump_step(tmp_path_factory.mktemp("pre_scheduler"), "pre_scheduler")


def test_the_dump_names_its_stage_and_device_counts_in_a_header_both_parsers_read(pre_scheduler_dumps):
    for path in pre_scheduler_dumps:
        text = path.read_text(encoding="utf-8")
        assert text.startswith("// xla_passes: layouts final (after XLA's layout assignment), "
                               "XLA stage pre_scheduler\n")
        assert runner.optimized_stage(text) == "pre_scheduler"
        module = hlo_tools.parse_module(text)
        assert (module.replica_count, module.num_partitions) == (1, 8)
        assert ", num_partitions=8" in xla_bridge.module_text(xla_bridge.xla_parse(text))  # XLA omits counts of 1


def test_the_rewritten_step_matches_the_original_on_every_device(capsys, pre_scheduler_dumps):
    before, after = pre_scheduler_dumps
    status, out, err = run(capsys, "run", after, "--reference", before)
    assert (status, err) == (0, "")
    assert out.startswith(f"{after}: 8 partitions, per-device module, compiled from XLA's pre_scheduler stage\n"
                          f"reference {before}: 8 partitions, per-device module, compiled from XLA's "
                          f"pre_scheduler stage\n")
    assert "warning" not in out  # the outputs are replicated: every device agrees
    assert out.endswith("all 2 outputs match the reference\n")


def test_a_wrong_rewrite_is_one_mismatch_line(capsys, pre_scheduler_dumps, tmp_path):
    before, after = pre_scheduler_dumps
    wrong = tmp_path / "wrong.txt"
    wrong.write_text(after.read_text(encoding="utf-8").replace("constant(0.01)", "constant(0.02)"), encoding="utf-8")
    status, out, err = run(capsys, "run", wrong, "--reference", before)
    assert status == 1
    assert re.search(r"^out0: f32\[32,16\] MISMATCH: ", out, re.M) and "out1: f32[32,16] OK" in out
    assert err == "hlo-tools: error: 1 of 2 outputs differ from the reference (out0)\n"


def test_in_process_runs_compare_equal_to_the_child_process_ones(pre_scheduler_dumps):
    before, after = pre_scheduler_dumps
    result, reference, comparison = runner.compare_modules(after, before, seed=3)
    assert comparison.ok, comparison.format()
    assert (result.stage, result.partitioning, reference.stage) == ("pre_scheduler", "per_device", "pre_scheduler")
    # the replicated weight and momentum, and the batch split over the 8 devices, as global arrays
    assert [a.shape for a in result.inputs] == [(32, 16), (32, 16), (8, 32, 16)]


def test_stats_has_xla_s_cost_section_and_the_pass_cuts_the_update_s_flops(capsys, pre_scheduler_dumps):
    flops = []
    for path in pre_scheduler_dumps:
        status, out, err = run(capsys, "stats", path)
        assert (status, err) == (0, "")
        assert "XLA (cpu, 8 partitions, compiled from its pre_scheduler stage; numbers per device)\n" in out
        flops.append(int(re.search(r"^  flops +([\d,]+)$", out, re.M).group(1).replace(",", "")))
    before, after = flops
    assert 0 < after < before  # each device updates 1/8 of the weights


def test_post_scheduler_dumps_run_too(capsys, tmp_path):
    before, after = dump_step(tmp_path, "post_scheduler")
    assert "is_scheduled=true" in before.read_text(encoding="utf-8")
    status, out, err = run(capsys, "run", after, "--reference", before)
    assert (status, err) == (0, "")
    assert "8 partitions, per-device module, compiled from XLA's post_scheduler stage\n" in out
    assert out.endswith("all 2 outputs match the reference\n")


def test_a_module_xla_cannot_compile_again_is_one_line_with_the_alternative(capsys, tmp_path):
    path = tmp_path / "m.hlo"
    path.write_text(UNCOMPILABLE, encoding="utf-8")
    status, out, err = run(capsys, "run", path)
    assert (status, out) == (1, "") and ERROR_LINE.fullmatch(err)
    assert err.startswith(f"hlo-tools: error: {path}: XLA could not compile the module: ")
    assert "Fusion must have backend config" in err
    assert err.endswith("(a module XLA optimized up to its pre_scheduler stage, compiled from there on; run the "
                        "module from before XLA's optimizations instead, which hlo-tools dump writes)\n")
    status, out, err = run(capsys, "stats", path)
    assert (status, err) == (0, "")
    assert out.splitlines()[-1].startswith("XLA cost analysis unavailable: XLA could not compile the module: ")


def test_outputs_without_a_sharding_are_device_0_s_with_a_warning_where_devices_differ():
    # XLA keeps no output shardings in the modules it optimizes: this ROOT is split, but does not say so.
    split_output = """// xla_passes: layouts final (after XLA's layout assignment), XLA stage pre_scheduler
HloModule split_output, replica_count=1, num_partitions=4

ENTRY main {
  p = f32[2,3]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  ROOT n = f32[2,3]{1,0} negate(p)
}
"""
    result = runner.run_module(split_output)
    assert result.outputs[0].tolist() == (-result.inputs[0][:2]).tolist()
    assert result.warnings == ["<module>: output 0: devices 1, 2, 3 hold other values than device 0; with no "
                               "sharding written the output is taken as replicated, and is device 0's (XLA keeps "
                               "no output shardings in a module it optimized)"]


@pytest.mark.parametrize("text, stage", [
    ("// xla_passes: layouts final (after XLA's layout assignment), XLA stage post_scheduler\nHloModule m\n",
     "post_scheduler"),
    ("HloModule m, is_scheduled=true\n", "post_scheduler"),
    ("HloModule m\n\nENTRY e {\n  ROOT f = f32[8]{0} fusion(x), kind=kLoop, calls=c\n}\n", "pre_scheduler"),
    ("HloModule m\n\nENTRY e {\n  ROOT p = f32[8]{0} parameter(0)\n}\n", None),
    ("HloModule m\n\nENTRY e {\n  // XLA stage post_scheduler\n  ROOT p = f32[8]{0} parameter(0)\n}\n", None),
])
def test_optimized_stage(text, stage):
    assert runner.optimized_stage(text) == stage


def test_header_counts_are_added_where_the_header_has_none():
    assert runner.with_header_counts("// note\nHloModule m, is_scheduled=true\n\nENTRY e {}\n", 1, 8) == \
        "// note\nHloModule m, is_scheduled=true, replica_count=1, num_partitions=8\n\nENTRY e {}\n"
    stated = "HloModule m, num_partitions=4\n"
    assert runner.with_header_counts(stated, 1, 8) == stated
