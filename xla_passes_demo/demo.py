"""The main job: train a small Flax model data parallel on 8 CPU devices, five ways, and compare.

    python -m xla_passes_demo [--out DIR] [--small] [--steps N] [--rounds N] [--json FILE]

The same training step (a Flax MLP, optax adam, synthetic data, shard_map over
8 CPU devices with `check_vma=True`, one `pmean` per gradient, the parameters and
optimizer state donated) is compiled five ways, all at XLA's defaults (its own
all-reduce combiner on, donation asked for), what a user has:

  plain                        no passes. JAX's transpose of shard_map all-reduces each
                               gradient of a replicated parameter (psum_invariant) and
                               the pmean all-reduces it again; each second all-reduce
                               reads the first, so XLA's combiner leaves a chain of them;
  hook: collective-fusion      our passes run inside XLA's compile by the JAX plugin
                               (`xla_passes.jax.enable`, what `XLA_PASSES=...` does): the
                               simplifier removes the redundant all-reduces, the
                               combiners merge the rest into one;
  hook: weight-update-sharding reduce-scatter the gradients, update 1/8 of the weights
                               and optimizer state per device, all-gather;
  jit: collective-fusion       the pass on JAX's lowering, in
                               `xla_passes.jax.jit(step, passes=...)`: donation kept;
  jit: weight-update-sharding{persistent=true}
                               the same, adam's moments kept sharded between steps.

XLA of jaxlib 0.10.2 drops the buffer donation of every module a pass hook hands
back, so there the two hook runs allocate fresh outputs each step; from jaxlib 0.11.1
on XLA keeps it (jax-ml/jax#40280), and the hook runs donate what the plain run
donates. The jit runs keep it on every version.
The plugin dumps each module before and after the hook's passes. The runs then
train from the same start on the same data, their steps interleaved (in rounds,
their order rotating) so that the machine's load hits all alike. The table
(stdout) shows: the losses, and the weights after the first step and the last,
against the plain run's (within float rounding, not bit-equal: the simplifier
turns a sum of 8 equal values into a product with 8, a flat buffer or a
reduce-scatter adds in other chunks or another order), the collectives in the compiled step, XLA's per-device flops of the
update (the step's flops minus those of the local forward and backward pass),
temp and peak memory (arguments + outputs + temp - donated), the donated bytes,
and the median step time.

When `spatial-partitioning` is registered, the gradients of a small conv model,
lowered by JAX for one device, are split by rows over 4 devices by that pass and
run against the one-device program (`hlo_tools.xla.runner`). Last, `hlo-tools
report` turns the dumps into one HTML page. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import statistics
import sys
import time

import jax
import numpy as np

import hlo_tools
import xla_passes
import xla_passes.jax
from hlo_tools import cli
from hlo_tools.inspection import report
from hlo_tools.xla import runner, xla_bridge
from hlo_tools.inspection.stats import module_stats, xla_cost

PROG = "python -m xla_passes_demo"

try:
    from . import training
except ImportError as missing:  # flax/optax: the demo extra; as a command, one line and exit status 1
    if __name__ == "__main__":
        sys.exit(f"{PROG}: error: {missing}")
    raise

PLAIN = "plain"
FUSION, WUS = "collective-fusion", "weight-update-sharding"
PERSISTENT = "weight-update-sharding{persistent=true}"
HOOK, JIT = "hook", "jit"  # the JAX plugin inside XLA's compile; xla_passes.jax.jit on JAX's lowering
# name: (pipeline, where it runs); every run at XLA's defaults
RUNS = {PLAIN: (None, None),
        f"{HOOK}: {FUSION}": (FUSION, HOOK), f"{HOOK}: {WUS}": (WUS, HOOK),
        f"{JIT}: {FUSION}": (FUSION, JIT), f"{JIT}: {PERSISTENT}": (PERSISTENT, JIT)}
HOOK_RUNS = tuple(name for name, (_, where) in RUNS.items() if where == HOOK)
JIT_RUNS = tuple(name for name, (_, where) in RUNS.items() if where == JIT)
FUSION_RUNS = tuple(name for name, (passes, _) in RUNS.items() if passes == FUSION)
WUS_RUNS = tuple(name for name, (passes, _) in RUNS.items() if passes in (WUS, PERSISTENT))
SPATIAL = "spatial-partitioning"
# (Dense widths, batch per device): the default model, and the one of --small (for tests).
MODELS = {"default": ((1024, 1024, 1024, 10), 32), "small": ((256, 256, 10), 8)}
SPATIAL_DEVICES = 4
DUMP_NUMBER = re.compile(r"module_(\d+)\.")  # the NNNN of the plugin's and the pipeline's dump files
SPATIAL_IMAGE_SIZE = {"default": 64, "small": 16}
# The largest differences from the plain run's losses (at every step) and weights (after the first
# step) that a pass may make: float rounding, nothing more (the simplifier multiplies an all-reduced
# value by 8 where the plain step sums 8 equal values; a flat buffer or a reduce-scatter adds in
# other chunks or another order than separate all-reduces). The final weights are only shown: over
# many steps adam amplifies rounding where a gradient is near zero (each step moves a weight by up
# to its learning rate, 1e-3, whatever the gradient's size).
LOSS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-6
SPATIAL_ERROR_BOUND = 1e-4  # f32 sums of the split rows may add in another order


class Progress:
    """Progress lines on stderr, with the seconds since the demo started."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def fresh_dump_dir(path: str) -> str:
    """`path`, created, without the dump files an earlier demo left there (nothing else is removed)."""
    os.makedirs(path, exist_ok=True)
    for old in glob.glob(os.path.join(path, "module_*.txt")):
        os.remove(old)
    return path


def train(runs: dict, steps: int, rounds: int, progress: Progress) -> None:
    """Train every run for `(rounds + 1) * steps` steps, a round of each in turn.

    The runs' order rotates from round to round, so that none always follows the same one: what
    a run leaves in the allocator (the hook runs allocate fresh outputs every step) would
    otherwise always hit the same next run.

    Adds to each run its `losses` (every step), `seconds` (steps after the
    first round, which warms up) and `first_params` (the weights after the first
    step, on the host) and leaves its final state in `state`.
    """
    for round_index in range(rounds + 1):
        progress(f"training: round {round_index + 1} of {rounds + 1} ({steps} steps of each run"
                 f"{', not timed' if round_index == 0 else ''})")
        order = list(runs.values())
        for run in order[round_index % len(order):] + order[:round_index % len(order)]:
            params, opt_state, images, labels = run["state"]
            for _ in range(steps):
                start = time.perf_counter()
                params, opt_state, loss = run["compiled"](params, opt_state, images, labels)
                jax.block_until_ready((params, opt_state, loss))
                if round_index:
                    run["seconds"].append(time.perf_counter() - start)
                if not run["losses"]:
                    run["first_params"] = jax.tree.map(np.asarray, params)  # before the next step donates them
                run["losses"].append(float(loss))
            run["state"] = (params, opt_state, images, labels)


def max_difference(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays (or lists of numbers)."""
    return max((float(np.max(np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64))))
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))), default=0.0)


def write_report(dumps: str, path: str) -> str:
    """Write `hlo-tools report`'s HTML page of the dump directory `dumps` to `path`; returns `path`."""
    try:
        page = report.build_report(dumps)
    except report.ReportError as exc:
        raise cli.CommandError(str(exc)) from exc
    cli.write_atomically(path, report.render_html(page))
    return path


def spatial_run(image_size: int, dumps: str, progress: Progress) -> dict:
    """`spatial-partitioning` of a conv model's gradients over 4 devices, run against the one-device program.

    The module before and after the pass goes to `dumps`, beside the plugin's.
    """
    progress(f"{SPATIAL}: lowering a conv model's gradients on {image_size}x{image_size} images (one device)")
    text, inputs = training.conv_gradients_hlo(image_size)
    module = hlo_tools.parse_module(text)
    numbers = [int(match.group(1)) for match in map(DUMP_NUMBER.match, os.listdir(dumps)) if match]
    pipeline = xla_passes.Pipeline(f"{SPATIAL}{{num_partitions={SPATIAL_DEVICES}}}", dump_to=dumps,
                                   module_number=max(numbers, default=-1) + 1)  # after the plugin's modules
    pipeline.run(module)
    partitioned = module.to_text()
    progress(f"{SPATIAL}: running it on 1 device and split by rows over {SPATIAL_DEVICES} devices")
    _, _, comparison = runner.compare_modules(
        partitioned, text, inputs, num_partitions=SPATIAL_DEVICES, reference_num_partitions=1,
        abs_error_bound=SPATIAL_ERROR_BOUND, rel_error_bound=SPATIAL_ERROR_BOUND)
    one_device, per_device = xla_cost(text, isolate=False), xla_cost(partitioned, isolate=False)
    return {"images": list(inputs[-2].shape), "devices": SPATIAL_DEVICES, "outputs_match": comparison.ok,
            "comparison": comparison.summary(), "error_bound": SPATIAL_ERROR_BOUND,
            "max_abs_error": max(output.max_abs_error for output in comparison.outputs),
            "collectives": {s.kind: s.count for s in module_stats(module).collective_summary()},
            "flops": [one_device.cost_analysis.get("flops", 0.0), per_device.cost_analysis.get("flops", 0.0)],
            "temp_bytes": [one_device.memory.get("temp_bytes", 0), per_device.memory.get("temp_bytes", 0)]}


def format_spatial(spatial: dict | None) -> str:
    if spatial is None:
        return f"{SPATIAL} (conv model over {SPATIAL_DEVICES} devices): not available in this version"
    batch, height, width, channels = spatial["images"]
    collectives = ", ".join(f"{count} {kind}" for kind, count in sorted(spatial["collectives"].items()))
    (flops_one, flops_each), (temp_one, temp_each) = spatial["flops"], spatial["temp_bytes"]
    return (f"{SPATIAL}: the gradients of a conv model (2 x Conv 3x3, mean, Dense) on {batch} images "
            f"{height}x{width}x{channels}, their rows split over {spatial['devices']} devices\n"
            f"  against the same program on one device: {spatial['comparison']} (max abs error "
            f"{spatial['max_abs_error']:.2g}, bound {spatial['error_bound']:g}); {collectives}; "
            f"per device: flops {flops_each / flops_one:.3f}x, temp MB {temp_one / 1e6:.2f} -> {temp_each / 1e6:.2f}")


def compiled_numbers(compiled, gradient_flops: float) -> dict:
    """What the table shows of a compiled step: its collectives, update flops and memory (per device)."""
    costs = training.compiled_costs(compiled)
    return {"collectives": training.collective_counts(compiled),
            "update_flops": costs["flops"] - gradient_flops, "temp_bytes": costs["temp"],
            "aliased_bytes": costs["alias"], "argument_bytes": costs["argument"], "output_bytes": costs["output"],
            # what the step holds at once at most: its arguments, its outputs (those not written into
            # donated arguments' buffers) and its temporary buffers
            "peak_bytes": costs["argument"] + costs["output"] - costs["alias"] + costs["temp"]}


def run_demo(args: argparse.Namespace, progress: Progress) -> dict:
    """Compile, train and measure the runs (and the spatial one); what the table and --json show."""
    size = "small" if args.small else "default"
    widths, batch_per_device = MODELS[size]
    progress(f"building a Flax MLP {' x '.join(map(str, widths))} (adam, batch {batch_per_device} per device, "
             f"{training.N_DEVICES} CPU devices, data parallel: shard_map with check_vma=True, a pmean per gradient)")
    build = functools.partial(training.build_flax_training, widths, batch_per_device=batch_per_device,
                              check_vma=True, pmean_each_gradient=True)
    step, state = build()
    params, _, images, labels = state
    progress("compiling the local forward and backward pass alone (to count the update's flops)")
    local_gradients, _ = training.compile_step(training.build_local_gradients(widths), (params, images, labels), None)
    gradient_flops = training.compiled_costs(local_gradients)["flops"]
    dumps = fresh_dump_dir(os.path.join(args.out, "dumps"))
    runs = {}
    for name, (passes, where) in RUNS.items():
        if where == JIT:
            progress(f"compiling the step: {name} (xla_passes.jax.jit(step, passes={passes!r}), XLA's defaults)")
            jit_step, jit_state = build(jit=functools.partial(xla_passes.jax.jit, passes=passes))
            start = time.perf_counter()
            compiled = jit_step.lower(*jit_state).compile()
            compile_seconds = time.perf_counter() - start
            call, run_state = jit_step, jit_state  # its calls take (and reshard) the state as it comes
        else:
            progress(f"compiling the step: {name} (XLA's defaults"
                     + (")" if passes is None else f", {passes} at the hook; dumps in {dumps})"))
            compiled, compile_seconds = training.compile_step(step, state, passes, dump_to=dumps, strict=True)
            call, run_state = compiled, jax.tree.map(lambda leaf: leaf.copy(), state)  # each run donates its own
        runs[name] = {"compiled": call, "compile_s": compile_seconds, **compiled_numbers(compiled, gradient_flops),
                      "state": run_state, "losses": [], "seconds": []}
    train(runs, args.steps, args.rounds, progress)
    plain = runs[PLAIN]
    results = {"model": {"widths": list(widths), "batch_per_device": batch_per_device,
                         "devices": training.N_DEVICES, "steps": len(plain["losses"])},
               "dumps": dumps, "runs": {}, "jax": jax.__version__, "jaxlib": xla_bridge.jaxlib_version_text(),
               "hook_keeps_donation": xla_bridge.hook_keeps_donation()}
    for name, run in runs.items():
        passes, where = RUNS[name]
        results["runs"][name] = {
            "passes": passes, "where": where,
            "losses": run["losses"], "final_loss": run["losses"][-1],
            "max_loss_difference": max_difference(run["losses"], plain["losses"]),
            "max_first_parameter_difference": max_difference(run["first_params"], plain["first_params"]),
            "max_parameter_difference": max_difference(run["state"][0], plain["state"][0]),
            **{key: run[key] for key in ("collectives", "update_flops", "temp_bytes", "peak_bytes", "aliased_bytes",
                                         "argument_bytes", "output_bytes", "compile_s")},
            "median_step_s": statistics.median(run["seconds"])}
    registered = SPATIAL in xla_passes.registered_passes()
    results["spatial"] = spatial_run(SPATIAL_IMAGE_SIZE[size], dumps, progress) if registered else None
    progress("writing the HTML report of the dumps (hlo-tools report)")
    results["report"] = write_report(dumps, os.path.join(args.out, "report.html"))
    return results


def compared_with_plain(run: dict) -> str:
    """How far a run's losses and weights (after the first step, after the last) are from the plain run's."""
    differences = [run[key] for key in ("max_loss_difference", "max_first_parameter_difference",
                                        "max_parameter_difference")]
    return "bit-equal" if not any(differences) else "; ".join(f"{difference:.2g}" for difference in differences)


def format_table(results: dict) -> str:
    """The results as a Markdown table, with what its columns mean."""
    model, runs = results["model"], results["runs"]
    plain = runs[PLAIN]
    lines = [f"Flax MLP {' x '.join(map(str, model['widths']))}, adam, synthetic data, "
             f"{model['devices']} CPU devices data parallel (shard_map, check_vma=True, a pmean per gradient), "
             f"{model['steps']} steps; every run at XLA's defaults (its all-reduce combiner on, the parameters "
             f"and optimizer state donated)",
             "",
             "| run | loss: first -> last | vs plain: losses; weights after step 1; last | all-reduce "
             "| reduce-scatter | all-gather | update MFLOP/device | vs plain | temp MB/device | vs plain "
             "| peak MB/device | vs plain | donated MB | median step ms | vs plain |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, run in runs.items():
        counts = [run["collectives"].get(kind, 0) for kind in ("all-reduce", "reduce-scatter", "all-gather")]
        lines.append(
            f"| {name} | {run['losses'][0]:.6g} -> {run['losses'][-1]:.6g} "
            f"| {'-' if name == PLAIN else compared_with_plain(run)} | {' | '.join(map(str, counts))} "
            f"| {run['update_flops'] / 1e6:.2f} | {run['update_flops'] / plain['update_flops']:.3f} "
            f"| {run['temp_bytes'] / 1e6:.2f} | {run['temp_bytes'] / plain['temp_bytes']:.3f} "
            f"| {run['peak_bytes'] / 1e6:.2f} | {run['peak_bytes'] / plain['peak_bytes']:.3f} "
            f"| {run['aliased_bytes'] / 1e6:.2f} | {1e3 * run['median_step_s']:.1f} "
            f"| {run['median_step_s'] / plain['median_step_s']:.2f} |")
    lines += ["",
              f"{HOOK}: the passes run inside XLA's compile by the JAX plugin (xla_passes.jax.enable, what "
              f"XLA_PASSES does). {JIT}: xla_passes.jax.jit(step, passes=...), the passes on JAX's lowering. "
              "vs plain: the largest difference from the plain run's loss at any step (float rounding, at "
              f"most {LOSS_TOLERANCE:g}), and from its weights after the first step (at most {WEIGHT_TOLERANCE:g}) "
              "and after the last (adam amplifies rounding where a gradient is near zero). Collectives: in the "
              "compiled step. Update flops: XLA's flops of the step minus those of the local forward and "
              "backward pass. Temp: XLA's temporary buffers of the compiled step. Peak: arguments + outputs + "
              "temp - donated, what the step holds at once at most. Donated: outputs that reuse the donated "
              "parameters' and optimizer state's buffers. Step time: median of the timed steps, the runs "
              "interleaved in rounds, their order rotating.",
              ""]
    if plain["aliased_bytes"] and any(not run["aliased_bytes"] for run in runs.values()):
        lines += [f"Donated 0 MB: XLA of jaxlib {results['jaxlib']} drops the donation (input/output aliasing) of "
                  "every module a pass hook hands back (jaxlib 0.11.1 and newer keep it, jax-ml/jax#40280), so "
                  "those steps write fresh outputs and hold the old state beside them (peak memory); "
                  f"the {JIT} runs keep it. See docs/weight_update_sharding.md#buffer-donation.", ""]
    lines += [format_spatial(results["spatial"]),
              f"Modules before and after each pass at the hook: {results['dumps']}",
              f"What the passes did (hlo-tools report): {results['report']}"]
    return "\n".join(lines)


def failed_checks(results: dict) -> list[str]:
    """What the numbers must show, as failures: passes that change losses or fail to change the program."""
    runs, failures = results["runs"], []
    plain = runs[PLAIN]
    for name in RUNS:
        run = runs[name]
        if name != PLAIN and run["max_loss_difference"] > LOSS_TOLERANCE:
            failures.append(f"{name} moved the losses by more than {LOSS_TOLERANCE:g}")
        if name != PLAIN and run["max_first_parameter_difference"] > WEIGHT_TOLERANCE:
            failures.append(f"{name} moved the weights of the first step by more than {WEIGHT_TOLERANCE:g}")
    for name in FUSION_RUNS:
        if runs[name]["collectives"].get("all-reduce", 0) >= plain["collectives"].get("all-reduce", 0):
            failures.append(f"{name} did not reduce the number of all-reduces")
    for name in WUS_RUNS:
        if not runs[name]["collectives"].get("reduce-scatter") or runs[name]["update_flops"] >= plain["update_flops"]:
            failures.append(f"{name} did not shard the update (no reduce-scatter, or no fewer flops)")
    for name in JIT_RUNS:
        if runs[name]["aliased_bytes"] <= 0:
            failures.append(f"{name} lost the donation")
    persistent = runs[f"{JIT}: {PERSISTENT}"]
    if persistent["peak_bytes"] >= plain["peak_bytes"]:
        failures.append(f"{JIT}: {PERSISTENT} did not lower the peak memory")
    spatial = results["spatial"]
    if spatial is not None and not spatial["outputs_match"]:
        failures.append(f"{SPATIAL}: the 4-device program disagrees with the one-device program")
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="xla_passes_demo_out",
                        help="directory for the dumps and report.html (default: %(default)s)")
    parser.add_argument("--small", action="store_true", help="a smaller model (for tests)")
    parser.add_argument("--steps", type=int, default=5, help="steps of each run per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=9,
                        help="timed rounds; one more, untimed, comes first (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        if args.steps < 1 or args.rounds < 1:
            raise cli.CommandError("--steps and --rounds must be at least 1")
        if not training.use_cpu_devices(training.N_DEVICES):  # the demo chooses each compile's passes
            raise cli.CommandError("JAX's backends already started: run the demo in a fresh process")
        progress = Progress()
        results = run_demo(args, progress)
        print(format_table(results))
        failures = failed_checks(results)
        results["failed_checks"] = failures
        if args.json:
            cli.write_atomically(args.json, json.dumps(results, indent=1) + "\n")
        for failure in failures:
            print(f"{PROG}: check failed: {failure}", file=sys.stderr)
        progress("done" if not failures else f"done, {len(failures)} check(s) failed")
        return 1 if failures else 0

    return cli.report_failures(PROG, body, (xla_passes.PassError,))


if __name__ == "__main__":
    sys.exit(main())
