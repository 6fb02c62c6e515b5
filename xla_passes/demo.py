"""The main job: train a small Flax model data parallel on 8 CPU devices, three ways, and compare.

    python -m xla_passes.demo [--out DIR] [--small] [--steps N] [--rounds N] [--json FILE]

The same training step (a Flax MLP, optax adam, synthetic data, shard_map over
8 CPU devices, one `pmean` per gradient) is compiled three times, with XLA's
own all-reduce combiner off so that the passes have the work it would do:

  plain                   no passes: one all-reduce per gradient, the whole
                          update on every device;
  collective-fusion       our combiners: the gradients' all-reduces become one;
  weight-update-sharding  reduce-scatter the gradients, update 1/8 of the
                          weights and optimizer state per device, all-gather.

The passes run inside XLA's compile through the JAX plugin
(`xla_passes.jax.enable`, what `XLA_PASSES=...` does), and dump each module
before and after them. A fourth run compiles the step with
`xla_passes.jax.jit(..., passes="weight-update-sharding{persistent=true}")`
at XLA's defaults: the pass on JAX's lowering, donation kept, adam's moments
sharded between steps. The three runs then train from the same start on the
same data, their steps interleaved so that the machine's load hits all alike.
The table (stdout) shows: the losses against the plain run's (collective-fusion
adds the same numbers, so its losses are bit-equal; weight-update-sharding may
add in another order, so the largest difference is shown), the collectives in
the compiled step, XLA's per-device flops of the update (the step's flops minus
those of the local forward and backward pass) and temp memory, and the median
step time.

When `spatial-partitioning` is registered, the gradients of a small conv model,
lowered by JAX for one device, are split by rows over 4 devices by that pass and
run against the one-device program (`hlo_tools.runner`). Last, `hlo-tools
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
from hlo_tools import cli, report, runner
from hlo_tools.stats import module_stats, xla_cost
from xla_passes import training

PROG = "python -m xla_passes.demo"
PLAIN = "plain"
RUNS = (PLAIN, "collective-fusion", "weight-update-sharding")  # each is also the pipeline it runs
PERSISTENT = "weight-update-sharding{persistent=true}"
JIT_RUN = "xla_passes.jax.jit"  # the step compiled by xla_passes.jax.jit with PERSISTENT
SPATIAL = "spatial-partitioning"
# (Dense widths, batch per device): the default model, and the one of --small (for tests).
MODELS = {"default": ((1024, 1024, 1024, 10), 32), "small": ((256, 256, 10), 8)}
SPATIAL_DEVICES = 4
DUMP_NUMBER = re.compile(r"module_(\d+)\.")  # the NNNN of the plugin's and the pipeline's dump files
SPATIAL_IMAGE_SIZE = {"default": 64, "small": 16}
# The largest difference from the plain run's losses and weights that weight-update-sharding may
# make: it sums gradients in another order (reduce-scatter vs all-reduce), nothing more.
WUS_TOLERANCE = 1e-4
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

    Adds to each run its `losses` (every step) and `seconds` (steps after the
    first round, which warms up) and leaves its final state in `state`.
    """
    for round_index in range(rounds + 1):
        progress(f"training: round {round_index + 1} of {rounds + 1} ({steps} steps of each run"
                 f"{', not timed' if round_index == 0 else ''})")
        for run in runs.values():
            params, opt_state, images, labels = run["state"]
            for _ in range(steps):
                start = time.perf_counter()
                params, opt_state, loss = run["compiled"](params, opt_state, images, labels)
                jax.block_until_ready((params, opt_state, loss))
                if round_index:
                    run["seconds"].append(time.perf_counter() - start)
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


def run_demo(args: argparse.Namespace, progress: Progress) -> dict:
    """Compile, train and measure the three runs (and the spatial one); what the table and --json show."""
    size = "small" if args.small else "default"
    widths, batch_per_device = MODELS[size]
    progress(f"building a Flax MLP {' x '.join(map(str, widths))} (adam, batch {batch_per_device} per device, "
             f"{training.N_DEVICES} CPU devices, data parallel)")
    step, state = training.build_flax_training(widths, batch_per_device=batch_per_device)
    params, _, images, labels = state
    progress("compiling the local forward and backward pass alone (to count the update's flops)")
    local_gradients, _ = training.compile_step(training.build_local_gradients(widths), (params, images, labels), None)
    gradient_flops = training.compiled_costs(local_gradients)["flops"]
    dumps = fresh_dump_dir(os.path.join(args.out, "dumps"))
    runs = {}
    for name in RUNS:
        passes = None if name == PLAIN else name
        progress(f"compiling the step: {name}" + ("" if passes is None else f" (dumps in {dumps})"))
        compiled, compile_seconds = training.compile_step(step, state, passes, dump_to=dumps, strict=True,
                                                          compiler_options=training.NO_XLA_COMBINER)
        costs = training.compiled_costs(compiled)
        runs[name] = {"compiled": compiled, "compile_s": compile_seconds,
                      "collectives": training.collective_counts(compiled),
                      "update_flops": costs["flops"] - gradient_flops, "temp_bytes": costs["temp"],
                      "aliased_bytes": costs["alias"],
                      "state": jax.tree.map(lambda leaf: leaf.copy(), state),  # each run donates its own
                      "losses": [], "seconds": []}
    progress(f"compiling the step: {JIT_RUN} with {PERSISTENT} (XLA's defaults)")
    jit_step, jit_state = training.build_flax_training(
        widths, batch_per_device=batch_per_device, jit=functools.partial(xla_passes.jax.jit, passes=PERSISTENT))
    start = time.perf_counter()
    compiled = jit_step.lower(*jit_state).compile()
    costs = training.compiled_costs(compiled)
    runs[JIT_RUN] = {"compiled": jit_step, "compile_s": time.perf_counter() - start,  # calls reshard the state
                     "collectives": training.collective_counts(compiled),
                     "update_flops": costs["flops"] - gradient_flops, "temp_bytes": costs["temp"],
                     "aliased_bytes": costs["alias"], "state": jit_state, "losses": [], "seconds": []}
    train(runs, args.steps, args.rounds, progress)
    plain = runs[PLAIN]
    results = {"model": {"widths": list(widths), "batch_per_device": batch_per_device,
                         "devices": training.N_DEVICES, "steps": len(plain["losses"])},
               "dumps": dumps, "runs": {}}
    for name, run in runs.items():
        results["runs"][name] = {
            "losses": run["losses"], "final_loss": run["losses"][-1],
            "max_loss_difference": max_difference(run["losses"], plain["losses"]),
            "max_parameter_difference": max_difference(run["state"][0], plain["state"][0]),
            "collectives": run["collectives"], "update_flops": run["update_flops"],
            "temp_bytes": run["temp_bytes"], "aliased_bytes": run["aliased_bytes"], "compile_s": run["compile_s"],
            "median_step_s": statistics.median(run["seconds"])}
    registered = SPATIAL in xla_passes.registered_passes()
    results["spatial"] = spatial_run(SPATIAL_IMAGE_SIZE[size], dumps, progress) if registered else None
    progress("writing the HTML report of the dumps (hlo-tools report)")
    results["report"] = write_report(dumps, os.path.join(args.out, "report.html"))
    return results


def compared_with_plain(run: dict) -> str:
    """How far a run's losses and final weights are from the plain run's."""
    if run["max_loss_difference"] == run["max_parameter_difference"] == 0:
        return "bit-equal"
    return f"max diff {run['max_loss_difference']:.2g}; {run['max_parameter_difference']:.2g}"


def format_table(results: dict) -> str:
    """The results as a Markdown table, with what its columns mean."""
    model, runs = results["model"], results["runs"]
    plain = runs[PLAIN]
    lines = [f"Flax MLP {' x '.join(map(str, model['widths']))}, adam, synthetic data, "
             f"{model['devices']} CPU devices data parallel, {model['steps']} steps; XLA's all-reduce combiner off "
             f"(but in {JIT_RUN}, with {PERSISTENT}, at XLA's defaults)",
             "",
             "| run | loss: first -> last | vs plain: losses; weights | all-reduce | reduce-scatter | all-gather "
             "| update MFLOP/device | vs plain | temp MB/device | vs plain | donated MB | median step ms | vs plain |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, run in runs.items():
        counts = [run["collectives"].get(kind, 0) for kind in ("all-reduce", "reduce-scatter", "all-gather")]
        lines.append(
            f"| {name} | {run['losses'][0]:.6g} -> {run['losses'][-1]:.6g} "
            f"| {'-' if name == PLAIN else compared_with_plain(run)} | {' | '.join(map(str, counts))} "
            f"| {run['update_flops'] / 1e6:.2f} | {run['update_flops'] / plain['update_flops']:.3f} "
            f"| {run['temp_bytes'] / 1e6:.2f} | {run['temp_bytes'] / plain['temp_bytes']:.3f} "
            f"| {run['aliased_bytes'] / 1e6:.2f} | {1e3 * run['median_step_s']:.1f} | {run['median_step_s'] / plain['median_step_s']:.2f} |")
    lines += ["",
              "Collectives: in the compiled step. Update flops: XLA's flops of the step minus those of the local "
              "forward and backward pass. Temp: XLA's temporary buffers of the compiled step. Donated: outputs "
              "that reuse the donated parameters' and optimizer state's buffers. Step time: median of the timed "
              "steps, the runs' steps interleaved.",
              ""]
    if plain["aliased_bytes"] and any(not run["aliased_bytes"] for run in runs.values()):
        lines += ["Donated 0 MB: XLA of jaxlib 0.10.2 drops the donation (input/output aliasing) of every "
                  "module a pass hook hands back (fixed upstream in openxla/xla, UpdateHloModuleFromProto); "
                  "see docs/weight_update_sharding.md#buffer-donation.", ""]
    lines += [format_spatial(results["spatial"]),
              f"Modules before and after each pass: {results['dumps']}",
              f"What the passes did (hlo-tools report): {results['report']}"]
    return "\n".join(lines)


def failed_checks(results: dict) -> list[str]:
    """What the numbers must show, as failures: passes that change losses or fail to change the program."""
    runs, failures = results["runs"], []
    plain, fused, sharded = runs[PLAIN], runs["collective-fusion"], runs["weight-update-sharding"]
    if fused["max_loss_difference"] or fused["max_parameter_difference"]:
        failures.append("collective-fusion changed the losses or weights (combining must not change a bit)")
    if max(sharded["max_loss_difference"], sharded["max_parameter_difference"]) > WUS_TOLERANCE:
        failures.append(f"weight-update-sharding moved the losses or weights by more than {WUS_TOLERANCE:g}")
    if fused["collectives"].get("all-reduce", 0) >= plain["collectives"].get("all-reduce", 0):
        failures.append("collective-fusion did not reduce the number of all-reduces")
    if not sharded["collectives"].get("reduce-scatter") or sharded["update_flops"] >= plain["update_flops"]:
        failures.append("weight-update-sharding did not shard the update (no reduce-scatter, or no fewer flops)")
    jitted = runs[JIT_RUN]
    if max(jitted["max_loss_difference"], jitted["max_parameter_difference"]) > WUS_TOLERANCE:
        failures.append(f"{JIT_RUN} moved the losses or weights by more than {WUS_TOLERANCE:g}")
    if not jitted["aliased_bytes"] or jitted["update_flops"] >= plain["update_flops"]:
        failures.append(f"{JIT_RUN} lost the donation or did not shard the update")
    spatial = results["spatial"]
    if spatial is not None and not spatial["outputs_match"]:
        failures.append(f"{SPATIAL}: the 4-device program disagrees with the one-device program")
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="xla_passes_demo",
                        help="directory for the dumps and report.html (default: %(default)s)")
    parser.add_argument("--small", action="store_true", help="a smaller model (for tests)")
    parser.add_argument("--steps", type=int, default=10, help="steps of each run per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4,
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
