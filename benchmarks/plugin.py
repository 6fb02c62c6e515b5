"""What the JAX plugin costs and gains on a Flax data-parallel training step (8 CPU devices).

1. Step time in three configurations of the same step:

   a. XLA's all-reduce combiner off, no passes: one all-reduce per gradient;
   b. XLA's combiner off, ``collective-fusion`` on: our pass combines them;
   c. XLA's defaults: its own combiner on, no passes.

   All three are compiled in this one process and their steps are timed in
   turn, ``--steps`` at a time for ``--rounds`` rounds, so that changes in the
   machine's load hit all of them alike; the table shows the median and the
   minimum of all steps. XLA's combiner is switched off per compile
   (``compiler_options={"xla_disable_hlo_passes": ...}``, the same as
   ``XLA_FLAGS=--xla_disable_hlo_passes=...``), and the passes with
   ``xla_passes.jax.enable``, which is what ``XLA_PASSES`` does when JAX starts.

2. Compile time of the step with ``collective-fusion`` on and off (XLA's
   combiner off, so that the pass has work to do): the median of
   ``--compiles`` fresh compiles each (``jax.clear_caches()`` and a new
   ``lower`` before every compile; only ``compile()`` is timed), and the time
   spent inside the plugin's hook. The target is an overhead of at most 10% of
   XLA's own compile time.

3. Where the hook's time goes, on the module XLA hands it for each
   ``--phase-layers`` model (default: the largest ``--compile-layers`` one;
   taken from a dump, turned back into a proto): each step of
   ``xla_passes.jax.rewrite_module`` timed on its own (garbage collection
   paused, as in the hook), the steps interleaved, median of ``--compiles``
   runs.

The model is the one tests/frontends/test_jax_plugin.py and the demo train (xla_passes_demo/training.py):
an MLP of Dense layers with one all-reduce per gradient.

Run from the repository root: ``.venv/bin/python benchmarks/plugin.py``.
"""
import argparse
import glob
import logging
import os
import platform
import statistics
import tempfile
import time

import jax

import hlo_tools
import xla_passes.jax
from hlo_tools.xla import proto_patch, xla_bridge
from hlo_tools.garbage_collection import garbage_collection_paused
from hlo_tools.ir.verifier import verify_edits, verify_module
from xla_passes import Pipeline
from xla_passes.frontends.configuration import Settings
from xla_passes_demo.training import (NO_XLA_COMBINER, build_flax_training, compile_step, hand_back_hook,
                                 use_cpu_devices)

PASSES = "collective-fusion"

# (key, label, compiler options, passes)
STEP_CONFIGURATIONS = [
    ("a", "XLA combiner off, no passes", NO_XLA_COMBINER, None),
    ("b", f"XLA combiner off, {PASSES}", NO_XLA_COMBINER, PASSES),
    ("c", "XLA defaults (its combiner on)", None, None),
]


def widths(layers: int) -> tuple[int, ...]:
    """Dense layer widths: `layers - 2` of 256, then 128 and the 10 classes."""
    return (256,) * (layers - 2) + (128, 10)


def step_time_table(layers: int, steps: int, rounds: int) -> str:
    step, args = build_flax_training(widths(layers))
    runs = {}
    for key, _, options, passes in STEP_CONFIGURATIONS:
        compiled, _ = compile_step(step, args, passes, compiler_options=options)
        state = jax.tree.map(lambda leaf: leaf.copy(), args)  # each executable donates its own buffers
        runs[key] = {"compiled": compiled, "state": state, "seconds": [],
                     "all_reduces": compiled.as_text().count(" all-reduce(")}
    for _ in range(rounds + 1):  # the first round warms up and is not counted
        for run in runs.values():
            params, opt_state, images, labels = run["state"]
            seconds = []
            for _ in range(steps):
                start = time.perf_counter()
                params, opt_state, loss = run["compiled"](params, opt_state, images, labels)
                jax.block_until_ready(loss)
                seconds.append(time.perf_counter() - start)
            run["state"] = (params, opt_state, images, labels)
            run["loss"] = float(loss)
            run["seconds"].append(seconds)
    for run in runs.values():
        counted = [s for round_seconds in run["seconds"][1:] for s in round_seconds]
        run["median_s"], run["min_s"] = statistics.median(counted), min(counted)
    lines = [f"Step time: Flax MLP, {layers} Dense layers, adam, 8 CPU devices; "
             f"{rounds} rounds x {steps} steps per configuration, interleaved",
             "",
             "| config | | all-reduces compiled | median step (ms) | vs a | vs c | min step (ms) | vs a | vs c "
             "| final loss |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, label, _, _ in STEP_CONFIGURATIONS:
        r = runs[key]
        lines.append(f"| {key} | {label} | {r['all_reduces']} | {1e3 * r['median_s']:.2f} | "
                     f"{r['median_s'] / runs['a']['median_s']:.2f} | {r['median_s'] / runs['c']['median_s']:.2f} | "
                     f"{1e3 * r['min_s']:.2f} | {r['min_s'] / runs['a']['min_s']:.2f} | "
                     f"{r['min_s'] / runs['c']['min_s']:.2f} | {r['loss']:.6f} |")
    return "\n".join(lines)


class _HookTimes(logging.Handler):
    """Collects the milliseconds of the plugin's per-module INFO lines (their last argument)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.milliseconds: list[float] = []

    def emit(self, record):
        if record.levelno == logging.INFO:
            self.milliseconds.append(float(record.args[-1]))


def compile_time_row(layers: int, compiles: int) -> str:
    hook_times = _HookTimes()
    logger = logging.getLogger("xla_passes")
    logger.addHandler(hook_times)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        step, args = build_flax_training(widths(layers))
        compiled, _ = compile_step(step, args, None, compiler_options=NO_XLA_COMBINER)  # also warms XLA up
        lines = compiled.as_text().count("\n")
        seconds = {"off": [], "hand_back": [], "on": []}
        hook = []
        for _ in range(compiles):
            for mode in seconds:  # interleaved, so that drift in machine load hits all alike
                hook_times.milliseconds.clear()
                if mode == "hand_back":
                    with hand_back_hook():
                        _, compile_s = compile_step(step, args, None, compiler_options=NO_XLA_COMBINER)
                else:
                    _, compile_s = compile_step(step, args, PASSES if mode == "on" else None,
                                                compiler_options=NO_XLA_COMBINER)
                seconds[mode].append(compile_s)
                if mode == "on":
                    hook.append(sum(hook_times.milliseconds) / 1e3)
    finally:
        logger.removeHandler(hook_times)
    off, hand_back, on = (statistics.median(seconds[mode]) for mode in ("off", "hand_back", "on"))
    in_hook = statistics.median(hook)
    return (f"| {layers} | {lines} | {off:.3f} | {hand_back:.3f} | {100 * (hand_back / off - 1):+.1f}% | "
            f"{on:.3f} | {100 * (on / off - 1):+.1f}% | {in_hook:.3f} | {100 * in_hook / off:.1f}% |")


def compile_time_table(layer_counts: list[int], compiles: int) -> str:
    lines = [f"Compile time of the step ({PASSES} off/on, XLA combiner off), median of {compiles} fresh compiles",
             "",
             "| layers | optimized HLO lines | XLA alone (s) | hook handing the bytes back (s) | its overhead "
             "| with plugin (s) | overhead | in the hook (s) | hook / XLA |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [compile_time_row(layers, compiles) for layers in layer_counts]
    return "\n".join(lines)


def hook_phase_table(layers: int, runs: int) -> str:
    """Each step of the hook on the step's module, timed on its own (interleaved, median of `runs`)."""
    step, args = build_flax_training(widths(layers))
    with tempfile.TemporaryDirectory() as dump:
        compile_step(step, args, PASSES, compiler_options=NO_XLA_COMBINER, dump_to=dump)
        [before] = glob.glob(os.path.join(dump, "*.jit_train_step.before_xla_passes.txt"))
        with open(before, encoding="utf-8") as f:
            proto = xla_bridge.text_to_proto(f.read())
    text = xla_bridge.proto_to_text(proto)

    def parse():
        return hlo_tools.parse_module(text, lazy_bodies=True)  # as the hook parses

    def rewritten():
        module = parse()
        Pipeline(PASSES, verify=False).run(module)
        return module

    edited = rewritten()
    parse_label = "parse (hlo_tools; the entry, other bodies when read)"
    steps = [
        ("proto -> text (XLA's printer)", lambda: xla_bridge.proto_to_text(proto)),
        (parse_label, parse),
        ("for comparison: parse every body at once", lambda: hlo_tools.parse_module(text)),
        (f"{PASSES} (parse excluded; bodies it reads included)", rewritten),
        ("verify the edits (what the pipeline runs)", lambda: verify_edits(edited)),
        ("for comparison: verify the whole module", lambda: verify_module(edited)),
        ("hand back: XLA's proto with the entry's edits (XLA parses the edits)",
         lambda: proto_patch.patched_module_proto(proto, edited, xla_bridge.text_to_proto)),
        ("for comparison: print + text -> proto (XLA parses everything)",
         lambda: xla_bridge.text_to_proto(edited.to_text())),
        ("the whole hook (rewrite_module)", lambda: xla_passes.jax.rewrite_module(proto, Settings(PASSES))),
    ]
    seconds = {label: [] for label, _ in steps}
    with garbage_collection_paused():  # as in the hook
        for _ in range(runs):
            for label, run in steps:
                start = time.perf_counter()
                run()
                seconds[label].append(time.perf_counter() - start)
    parse_s = statistics.median(seconds[parse_label])
    lines = [f"The hook's steps on the {layers}-layer step's module ({text.count(chr(10))} lines), "
             f"median of {runs} interleaved runs",
             "",
             "| step | ms |",
             "| --- | ---: |"]
    for label, _ in steps:
        median = statistics.median(seconds[label])
        if label.startswith(PASSES):
            median -= parse_s
        lines.append(f"| {label} | {1e3 * median:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    use_cpu_devices(8)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="Dense layers of the step-time model")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of step timing")
    parser.add_argument("--compile-layers", default="8,32", help="model sizes for compile time, comma-separated")
    parser.add_argument("--compiles", type=int, default=7, help="fresh compiles per compile-time median")
    parser.add_argument("--phase-layers", default=None,
                        help="model sizes for the hook's per-step table, comma-separated (default: the largest "
                             "--compile-layers)")
    args = parser.parse_args(argv)
    print(f"# benchmarks/plugin.py on {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"jax {jax.__version__}")
    print()
    print(step_time_table(args.layers, args.steps, args.rounds))
    print()
    layer_counts = [int(n) for n in args.compile_layers.split(",")]
    print(compile_time_table(layer_counts, args.compiles))
    phase_counts = [int(n) for n in args.phase_layers.split(",")] if args.phase_layers else [max(layer_counts)]
    for layers in phase_counts:
        print()
        print(hook_phase_table(layers, args.compiles))


if __name__ == "__main__":
    main()
