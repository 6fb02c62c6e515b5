"""The main job, `python -m xla_passes.demo`, end to end at reduced size, in a fresh process.

The demo trains one Flax model three ways; these tests check that what it reports holds
together: the same losses in all runs, collective counts that moved the way each pass moves
them, less update work with weight-update sharding, the dumps it says it wrote, and a table
that shows the numbers it measured.
"""
import json
import os
import subprocess
import sys

import pytest

import xla_passes
from xla_passes import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_demo(*args: str, cwd: str, **environ: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **environ)
    return subprocess.run([sys.executable, "-m", "xla_passes.demo", *args], cwd=cwd, env=env,
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


def test_losses_are_those_of_the_plain_run(small_demo):
    _, results, _ = small_demo
    runs = results["runs"]
    plain = runs["plain"]["losses"]
    assert len(plain) == results["model"]["steps"] == 4
    assert plain[-1] < plain[0]  # it trains
    fusion = runs["collective-fusion"]
    assert fusion["losses"] == plain  # combining all-reduces adds the same numbers: bit-equal
    assert fusion["max_loss_difference"] == fusion["max_parameter_difference"] == 0
    sharded = runs["weight-update-sharding"]
    assert sharded["max_loss_difference"] == max(abs(a - b) for a, b in zip(sharded["losses"], plain))
    assert sharded["max_loss_difference"] <= 1e-5 * abs(plain[0])  # only the order of additions may change
    assert sharded["max_parameter_difference"] <= 1e-5
    jitted = runs[demo.JIT_RUN]  # the same pass on JAX's lowering, with persistent state
    assert jitted["max_loss_difference"] <= 1e-5 * abs(plain[0]) and jitted["max_parameter_difference"] <= 1e-5


def test_collectives_move_the_way_each_pass_moves_them(small_demo):
    _, results, _ = small_demo
    plain, fusion, sharded = (results["runs"][name]["collectives"] for name in demo.RUNS)
    # plain: one all-reduce per gradient (3 Dense layers: 6) and one for the loss
    assert plain == {"all-reduce": 7}
    assert fusion == {"all-reduce": 1}
    # every gradient reduce-scattered but the 10-class bias (40 bytes, below the pass's
    # threshold), which keeps an all-reduce beside the loss's; at least every new weight
    # all-gathered (today adam's two moments too: 15)
    assert sharded["all-reduce"] == 2 and sharded["reduce-scatter"] == 5
    assert sharded["all-gather"] >= 5
    assert set(sharded) == {"all-reduce", "reduce-scatter", "all-gather"}


def test_weight_update_sharding_cuts_update_work_and_memory(small_demo):
    _, results, _ = small_demo
    plain, fusion, sharded = (results["runs"][name] for name in demo.RUNS)
    assert plain["update_flops"] > 0
    assert fusion["update_flops"] == plain["update_flops"]
    assert sharded["update_flops"] < plain["update_flops"] / 4  # the limit is 1/8 per device
    assert sharded["temp_bytes"] < plain["temp_bytes"]
    # the plain step's new parameters and optimizer state reuse the donated buffers: all its outputs but
    # the loss (XLA of jaxlib 0.10.2 drops this aliasing from every module a pass hook hands back)
    weights = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10  # --small: Dense 256, 256, 10 on 64 inputs
    assert plain["aliased_bytes"] == 4 * 3 * weights + 4  # f32 weights, adam's two moments, its s32 count
    # xla_passes.jax.jit keeps the donation: the weights, and the 1/8 of each moment every device
    # keeps (all but the 10-class bias, below the pass's threshold, which stays whole)
    jitted = results["runs"][demo.JIT_RUN]
    assert jitted["update_flops"] < plain["update_flops"] / 4
    assert jitted["aliased_bytes"] == 4 * (weights + 2 * ((weights - 10) // 8 + 10)) + 4


def test_dumps_hold_the_step_before_and_after_each_pass_and_the_report_shows_them(small_demo):
    _, results, work = small_demo
    dumps = work / results["dumps"]
    assert dumps == work / "out" / "dumps"
    files = sorted(os.listdir(dumps))
    # the plain run ran no passes, so it dumped nothing; spatial-partitioning dumps one module
    assert len(files) == (4 if results["spatial"] is None else 6), files
    for name in demo.RUNS[1:]:
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
    assert list(rows) == ["run", *demo.RUNS, demo.JIT_RUN]
    for name in demo.RUNS:
        run = results["runs"][name]
        losses, compared, all_reduce, reduce_scatter, all_gather, update_mflop = rows[name][:6]
        assert [float(loss) for loss in losses.split(" -> ")] == pytest.approx(
            [run["losses"][0], run["losses"][-1]], rel=1e-5)
        assert [int(all_reduce), int(reduce_scatter), int(all_gather)] == [
            run["collectives"].get(kind, 0) for kind in ("all-reduce", "reduce-scatter", "all-gather")]
        assert float(update_mflop) == pytest.approx(run["update_flops"] / 1e6, abs=0.01)
    assert rows["collective-fusion"][1] == "bit-equal"
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


def test_bad_arguments_are_one_line_errors(tmp_path):
    result = run_demo("--steps", "0", cwd=str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["python -m xla_passes.demo: error: --steps and --rounds must be at "
                                                  "least 1"]
    assert not os.listdir(tmp_path)


def test_the_demo_fails_when_its_numbers_disagree(small_demo):
    """A run with no failed check exits 0; each broken promise is a failed check (and exit 1)."""
    import copy

    from xla_passes import demo

    _, results, _ = small_demo
    assert results["failed_checks"] == [] == demo.failed_checks(results)
    breakages = {
        "collective-fusion changed": lambda r: r["runs"]["collective-fusion"].update(max_loss_difference=1e-9),
        "weight-update-sharding moved": lambda r: r["runs"]["weight-update-sharding"].update(
            max_parameter_difference=1.0),
        "did not reduce the number of all-reduces": lambda r: r["runs"]["collective-fusion"]["collectives"].update(
            {"all-reduce": 99}),
        "did not shard the update": lambda r: r["runs"]["weight-update-sharding"]["collectives"].pop(
            "reduce-scatter"),
        "disagrees with the one-device program": lambda r: r["spatial"].update(outputs_match=False),
    }
    for expected, breakage in breakages.items():
        broken = copy.deepcopy(results)
        breakage(broken)
        failures = demo.failed_checks(broken)
        assert len(failures) == 1 and expected in failures[0], (expected, failures)
