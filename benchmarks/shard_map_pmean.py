"""`collective-fusion` against XLA's own combiner on a Flax `shard_map` + `pmean` step (8 CPU devices).

The step of `xla_passes_demo.training.build_flax_training` with `check_vma=True` and one `lax.pmean`
per gradient: JAX's transpose of shard_map all-reduces each gradient of a replicated parameter
(`psum_invariant`), the `pmean` all-reduces it again, and each second all-reduce reads its first,
so XLA's combiner (on, at XLA's defaults) cannot merge them. Four configurations, all at XLA's
defaults:

  a. no passes;
  b. `collective-fusion` run by the JAX plugin inside XLA's compile (what `XLA_PASSES` does);
  c. `collective-fusion` on JAX's lowering, before XLA's optimizations
     (`xla_passes.jax.jit(step, passes="collective-fusion")`), which keeps the donation; in the
     shard_map body its all-reduces combine into one flat buffer (a concatenate, slices back);
  d. `all-reduce-simplifier` alone there, XLA's own combiner combining what is left (a tuple).

For each: the all-reduces in the compiled step; the loss and the weights after one step from the
same state against a's (the simplifier turns a sum of 8 equal values into a product with 8, and a
flat buffer is summed in other chunks than the separate gradients, so they agree within float
rounding, not bit for bit; over many steps adam on this memorizing model amplifies such
differences); and the step time: `--steps` steps per round, `--rounds` rounds, the
configurations interleaved so that the machine's load hits all alike; one more round first,
not counted. Both donate the parameters and the optimizer state, as the
step is built; the hook drops that donation in b (jaxlib 0.10.2, docs/weight_update_sharding.md),
so `--no-donate` compares the two without it.

Run from the repository root: ``.venv/bin/python benchmarks/shard_map_pmean.py``.
"""
import argparse
import functools
import statistics
import time

import jax
import numpy as np

import xla_passes.jax
from xla_passes_demo.training import build_flax_training, collective_counts, compile_step, use_cpu_devices

PASSES = "collective-fusion"
# (key, label, passes at the hook, passes on JAX's lowering)
CONFIGURATIONS = [("a", "XLA defaults", None, None),
                  ("b", f"XLA defaults + {PASSES} at the hook", PASSES, None),
                  ("c", f"XLA defaults + {PASSES} in xla_passes.jax.jit", None, PASSES),
                  ("d", "XLA defaults + all-reduce-simplifier in xla_passes.jax.jit", None, "all-reduce-simplifier")]


def measure(widths: tuple[int, ...], steps: int, rounds: int, donate: bool) -> str:
    runs = {}
    for key, _, hook_passes, lowering_passes in CONFIGURATIONS:
        jit = functools.partial(xla_passes.jax.jit, passes=lowering_passes) if lowering_passes else jax.jit
        step, args = build_flax_training(widths, check_vma=True, pmean_each_gradient=True, donate=donate, jit=jit)
        compiled, _ = compile_step(step, args, hook_passes, strict=True)
        first_params, _, first_loss = compiled(*jax.tree.map(lambda leaf: leaf.copy(), args))
        runs[key] = {"compiled": compiled, "state": jax.tree.map(lambda leaf: leaf.copy(), args), "seconds": [],
                     "all_reduces": collective_counts(compiled).get("all-reduce", 0),
                     "first": (float(first_loss), jax.tree.leaves(first_params))}
    for round_number in range(rounds + 1):
        for run in runs.values():
            params, opt_state, images, labels = run["state"]
            for _ in range(steps):
                start = time.perf_counter()
                params, opt_state, loss = run["compiled"](params, opt_state, images, labels)
                jax.block_until_ready(loss)
                if round_number:
                    run["seconds"].append(time.perf_counter() - start)
            run["state"] = (params, opt_state, images, labels)
    reference_loss, reference = runs["a"]["first"]
    lines = [f"Flax MLP {' x '.join(map(str, widths))}, adam, shard_map + pmean per gradient (check_vma=True), "
             f"8 CPU devices, donation {'on' if donate else 'off'}; {rounds} rounds x {steps} steps, interleaved",
             "",
             "| config | | all-reduces compiled | step 1: loss - a's | step 1: max abs weight - a's | "
             "median step (ms) | vs a |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, label, _, _ in CONFIGURATIONS:
        run = runs[key]
        loss, weights = run["first"]
        difference = max(float(np.max(np.abs(np.asarray(w) - np.asarray(r)))) for w, r in zip(weights, reference))
        median = statistics.median(run["seconds"])
        lines.append(f"| {key} | {label} | {run['all_reduces']} | {loss - reference_loss:.3g} | {difference:.3g} | "
                     f"{1e3 * median:.2f} | {median / statistics.median(runs['a']['seconds']):.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1024,1024,1024,10", help="Dense layer widths (the demo's model)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-donate", action="store_true", help="build the step without buffer donation")
    args = parser.parse_args()
    if not use_cpu_devices(8):
        raise SystemExit("JAX's backends started before the device count could be set")
    widths = tuple(int(w) for w in args.widths.split(","))
    print(measure(widths, args.steps, args.rounds, donate=not args.no_donate))


if __name__ == "__main__":
    main()
