"""The main job, `python -m xla_passes_demo`, end to end at reduced size, in a fresh process.

The demo trains one Flax model five ways, all at XLA's defaults; these tests check that what
it reports holds together: the same losses in all runs (within float rounding), collective
counts that moved the way each pass moves them, less update work with weight-update sharding,
donation lost at the hook and kept by xla_passes.jax.jit, the dumps it says it wrote, and a
table that shows the numbers it measured.
"""
import json
import os
import subprocess
import sys

import pytest

import xla_passes
from xla_passes_demo import demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_demo(*args: str, cwd: str, module: str = "xla_passes_demo", **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **environ)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    """One reduced run of the demo: (its process, its --json results, the directory it ran in)."""
    work = tmp_path_factory.mktemp("demo")
    # The demo chooses each compile's passes itself: XLA_PASSES from the environment must change nothing.
    result = run_demo("--small", "--steps", "2", "--rounds", "1", "--out", "out", "--json", "results.json",
                      cwd=str(work), XLA_PASSES="collective-fusion", XLA_PASSES_DUMP_TO=str(work / "ignored"))
    assert result.returncode == 0, result.stderr
    assert not (work / "ignored").exists()
    with open(work / "results.json", encoding="utf-8") as f:
        return result, json.load(f), work


HOOK_FUSION, HOOK_WUS = f"hook: {demo.FUSION}", f"hook: {demo.WUS}"
JIT_FUSION, JIT_WUS = f"jit: {demo.FUSION}", f"jit: {demo.PERSISTENT}"


def test_every_run_is_at_xlas_defaults_through_the_hook_or_xla_passes_jax_jit():
    assert list(demo.RUNS) == ["plain", HOOK_FUSION, HOOK_WUS, JIT_FUSION, JIT_WUS]
    assert demo.HOOK_RUNS == (HOOK_FUSION, HOOK_WUS) and demo.JIT_RUNS == (JIT_FUSION, JIT_WUS)
    assert demo.RUNS[JIT_WUS] == ("weight-update-sharding{persistent=true}", "jit")


def test_losses_are_those_of_the_plain_run(small_demo):
    _, results, _ = small_demo
    runs = results["runs"]
    plain = runs["plain"]["losses"]
    assert len(plain) == results["model"]["steps"] == 4
    assert plain[-1] < plain[0]  # it trains
    for name in demo.RUNS:
        run = runs[name]
        assert len(run["losses"]) == 4
        assert run["max_loss_difference"] == max(abs(a - b) for a, b in zip(run["losses"], plain))
        # float rounding only: the simplifier multiplies by 8 where plain sums 8 equal values,
        # a flat buffer or a reduce-scatter adds in other chunks or another order
        assert run["max_loss_difference"] <= 1e-6 * abs(plain[0])
        assert run["max_first_parameter_difference"] <= 1e-7
        assert run["max_parameter_difference"] <= 1e-6


def test_collectives_move_the_way_each_pass_moves_them(small_demo):
    _, results, _ = small_demo
    runs = {name: results["runs"][name]["collectives"] for name in demo.RUNS}
    # plain, at XLA's defaults: JAX's transpose of shard_map all-reduces every gradient (psum_invariant)
    # and each pmean all-reduces it again; XLA's combiner cannot merge an all-reduce with the one it
    # reads, so 7 are left (3 Dense layers: 6 gradients, and the loss)
    assert runs["plain"] == {"all-reduce": 7}
    # collective-fusion: the simplifier removes the redundant second all-reduces, the combiners merge the rest
    assert runs[HOOK_FUSION] == runs[JIT_FUSION] == {"all-reduce": 1}
    # weight-update-sharding: every gradient but the 10-class bias (40 bytes, below the pass's threshold)
    # reduce-scattered (5, in 3 reduce-scatters: XLA combines them); at the hook every sharded weight and
    # adam's two moments all-gathered (15); with persistent=true only the weights (5)
    assert runs[HOOK_WUS]["reduce-scatter"] == runs[JIT_WUS]["reduce-scatter"] == 3
    assert runs[HOOK_WUS]["all-gather"] == 15 and runs[JIT_WUS]["all-gather"] == 5
    assert set(runs[HOOK_WUS]) == set(runs[JIT_WUS]) == {"all-reduce", "reduce-scatter", "all-gather"}


def test_weight_update_sharding_cuts_update_work_and_memory_and_the_jit_runs_keep_donation(small_demo):
    _, results, _ = small_demo
    runs = results["runs"]
    plain = runs["plain"]
    assert plain["update_flops"] > 0
    # x * 8 / 8 folds away: before XLA in the jit run, in the update fusions that read it at the hook
    assert runs[HOOK_FUSION]["update_flops"] < plain["update_flops"]
    assert runs[JIT_FUSION]["update_flops"] <= plain["update_flops"]
    for name in (HOOK_WUS, JIT_WUS):
        assert runs[name]["update_flops"] < plain["update_flops"] / 4  # the limit is 1/8 per device
        assert runs[name]["temp_bytes"] < plain["temp_bytes"]
    # the plain step's new parameters and optimizer state reuse the donated buffers: all its outputs but the loss
    weights = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10  # --small: Dense 256, 256, 10 on 64 inputs
    assert plain["aliased_bytes"] == 4 * 3 * weights + 4  # f32 weights, adam's two moments, its s32 count
    if results["hook_keeps_donation"]:  # jaxlib >= 0.11.1: the hooked steps donate what the plain one does
        assert runs[HOOK_FUSION]["aliased_bytes"] == runs[HOOK_WUS]["aliased_bytes"] == plain["aliased_bytes"]
    else:  # XLA of jaxlib 0.10.2 drops the aliasing of every module a pass hook hands back
        assert runs[HOOK_FUSION]["aliased_bytes"] == runs[HOOK_WUS]["aliased_bytes"] == 0
    # xla_passes.jax.jit keeps it: everything with collective-fusion; with persistent state the weights and
    # the 1/8 of each moment every device keeps (all but the 10-class bias, below the threshold, stays whole)
    assert runs[JIT_FUSION]["aliased_bytes"] == plain["aliased_bytes"]
    assert runs[JIT_WUS]["aliased_bytes"] == 4 * (weights + 2 * ((weights - 10) // 8 + 10)) + 4
    for run in runs.values():
        assert run["peak_bytes"] == (run["argument_bytes"] + run["output_bytes"] - run["aliased_bytes"]
                                     + run["temp_bytes"])
    if results["hook_keeps_donation"]:
        # sharding the update cuts the peak; collective-fusion's one combined all-reduce holds every
        # local gradient and every sum at once, which on CPU stays within 1 MiB more than plain's
        # separate ones (docs/collective_fusion.md, Thresholds)
        assert runs[HOOK_WUS]["peak_bytes"] <= plain["peak_bytes"]
        assert runs[HOOK_FUSION]["peak_bytes"] <= plain["peak_bytes"] + (1 << 20)
    else:  # without donation a step holds its old state and its new one: more than the plain step at its peak
        for name in demo.HOOK_RUNS:
            assert runs[name]["peak_bytes"] > plain["peak_bytes"]
    assert runs[JIT_WUS]["peak_bytes"] < plain["peak_bytes"] / 2


def test_dumps_hold_the_step_before_and_after_each_pass_and_the_report_shows_them(small_demo):
    _, results, work = small_demo
    dumps = work / results["dumps"]
    assert dumps == work / "out" / "dumps"
    files = sorted(os.listdir(dumps))
    # the plain run ran no passes, so it dumped nothing; spatial-partitioning dumps one module
    assert len(files) == (4 if results["spatial"] is None else 6), files
    for name in demo.HOOK_RUNS:  # the jit runs do not dump
        name = demo.RUNS[name][0]
        after = [f for f in files if f.endswith(f"jit_train_step.0001.after_{name}.txt")]
        assert len(after) == 1, files
        number = after[0].split(".")[0]
        assert f"{number}.jit_train_step.before_xla_passes.txt" in files
        text = (dumps / after[0]).read_text(encoding="utf-8")
        if name == "collective-fusion":
            assert text.count(" all-reduce(") == 1
        else:
            assert " reduce-scatter(" in text and " all-gather(" in text
    assert results["report"] == os.path.join("out", "report.html")
    page = (work / results["report"]).read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert "after_collective-fusion" in page and "after_weight-update-sharding" in page


def test_table_shows_the_measured_numbers_and_progress_goes_to_stderr(small_demo):
    result, results, _ = small_demo
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert list(rows) == ["run", *demo.RUNS]
    assert rows["run"][9] == "peak MB/device" and rows["run"][11] == "donated MB"
    for name in demo.RUNS:
        run = results["runs"][name]
        losses, compared, all_reduce, reduce_scatter, all_gather, update_mflop = rows[name][:6]
        assert [float(loss) for loss in losses.split(" -> ")] == pytest.approx(
            [run["losses"][0], run["losses"][-1]], rel=1e-5)
        assert compared == ("-" if name == "plain" else demo.compared_with_plain(run))
        assert [int(all_reduce), int(reduce_scatter), int(all_gather)] == [
            run["collectives"].get(kind, 0) for kind in ("all-reduce", "reduce-scatter", "all-gather")]
        assert float(update_mflop) == pytest.approx(run["update_flops"] / 1e6, abs=0.01)
        assert float(rows[name][9]) == pytest.approx(run["peak_bytes"] / 1e6, abs=0.01)
        assert float(rows[name][11]) == pytest.approx(run["aliased_bytes"] / 1e6, abs=0.01)
    assert ("Donated 0 MB: XLA of jaxlib" in result.stdout) == (not results["hook_keeps_donation"])
    assert demo.format_spatial(results["spatial"]) in result.stdout
    assert (results["spatial"] is not None) == (demo.SPATIAL in xla_passes.registered_passes())
    assert "training: round 2 of 2" in result.stderr
    assert not any(line.startswith("[") for line in result.stdout.splitlines())  # progress stays off stdout


def test_spatial_partitioning_of_the_conv_model_matches_one_device(small_demo):
    _, results, work = small_demo
    spatial = results["spatial"]
    if spatial is None:
        pytest.skip("spatial-partitioning is not registered")
    assert spatial["outputs_match"], spatial["comparison"]
    assert spatial["max_abs_error"] <= spatial["error_bound"]
    assert spatial["images"] == [2, 16, 16, 3] and spatial["devices"] == 4
    # two 3x3 convolutions forward and one backward (to the first conv's output) exchange
    # a halo row up and down; the weight gradients and the mean are partial sums
    assert spatial["collectives"]["collective-permute"] == 6
    assert spatial["collectives"]["all-reduce"] >= 3
    flops_one, flops_each = spatial["flops"]
    assert flops_each < flops_one / 2  # each device computes a quarter of the rows, plus halos
    files = os.listdir(work / results["dumps"])
    assert "module_0002.jit_loss_and_gradients.before_xla_passes.txt" in files  # numbered after the plugin's
    assert "module_0002.jit_loss_and_gradients.0001.after_spatial-partitioning.txt" in files


@pytest.mark.parametrize("module", ["xla_passes_demo", "xla_passes_demo.demo"])
def test_bad_arguments_are_one_line_errors(tmp_path, module):
    result = run_demo("--steps", "0", cwd=str(tmp_path), module=module)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["python -m xla_passes_demo: error: --steps and --rounds must be at "
                                                  "least 1"]
    assert not os.listdir(tmp_path)


def test_the_demo_fails_when_its_numbers_disagree(small_demo):
    """A run with no failed check exits 0; each broken promise is a failed check (and exit 1)."""
    import copy

    from xla_passes_demo import demo

    _, results, _ = small_demo
    assert results["failed_checks"] == [] == demo.failed_checks(results)
    breakages = {
        f"{HOOK_FUSION} moved the losses": lambda r: r["runs"][HOOK_FUSION].update(max_loss_difference=1e-3),
        f"{JIT_WUS} moved the weights of the first step": lambda r: r["runs"][JIT_WUS].update(
            max_first_parameter_difference=1e-5),
        f"{HOOK_FUSION} did not reduce the number of all-reduces": lambda r: r["runs"][HOOK_FUSION][
            "collectives"].update({"all-reduce": 99}),
        f"{JIT_FUSION} did not reduce the number of all-reduces": lambda r: r["runs"][JIT_FUSION][
            "collectives"].update({"all-reduce": 7}),
        f"{HOOK_WUS} did not shard the update": lambda r: r["runs"][HOOK_WUS]["collectives"].pop("reduce-scatter"),
        f"{JIT_WUS} did not shard the update": lambda r: r["runs"][JIT_WUS].update(update_flops=1e12),
        f"{JIT_FUSION} lost the donation": lambda r: r["runs"][JIT_FUSION].update(aliased_bytes=0),
        f"{JIT_WUS} did not lower the peak memory": lambda r: r["runs"][JIT_WUS].update(peak_bytes=1e12),
        "disagrees with the one-device program": lambda r: r["spatial"].update(outputs_match=False),
    }
    for expected, breakage in breakages.items():
        broken = copy.deepcopy(results)
        breakage(broken)
        failures = demo.failed_checks(broken)
        assert len(failures) == 1 and expected in failures[0], (expected, failures)
