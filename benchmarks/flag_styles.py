"""The flag (`XLA_PASSES=...`, the JAX plugin's hook) against XLA's defaults, in the three program styles.

The same Flax MLP step (optax adam, 8 CPU devices, parameters and optimizer state donated, as a
training loop compiles it) written three ways:

  shard_map  `jax.jit(jax.shard_map(step))`, a `lax.pmean` per gradient, `check_vma=True`;
  jit        `jax.jit` of the global step, the batch split by `NamedSharding`: XLA's partitioner
             makes the gradient all-reduces;
  pmap       `jax.pmap` with `lax.pmean`: every argument has a leading device dimension, so the
             pass is told that the weights are the same on every device
             (`assume_replicated_parameters=true`).

For each style: plain (XLA's defaults), `collective-fusion` at the hook and `weight-update-sharding`
at the hook (`threshold_bytes=0` so that every weight is sharded), each compiled in this one
process. Per device: the donated bytes XLA aliases (`memory_analysis().alias_size_in_bytes`),
the peak (arguments + outputs + temp - aliased), the collectives of the compiled step, and the
median step time, the configurations interleaved in rounds (their order rotating) so that the
machine's load hits all alike; one more round first, not counted. The losses after the timed
steps are compared with plain's.

Where XLA keeps the donation of a module a hook hands back (jaxlib 0.11.1 and newer), the hooked
steps alias as many bytes as plain; jaxlib 0.10.2 drops it (`hlo_tools.xla.xla_bridge.hook_keeps_donation`).

Run from the repository root: ``.venv/bin/python benchmarks/flag_styles.py [--steps N] [--rounds N]
[--styles shard_map,...] [--extra PIPELINE ...]`` (`--extra`: more runs at the hook, each with its own
pipeline, e.g. `all-reduce-simplifier` or `collective-fusion{threshold_bytes=...}`).
"""
import argparse
import statistics
import sys
import time

from xla_passes_demo.training import use_cpu_devices

use_cpu_devices(8)

import jax  # noqa: E402 - after choosing the device count
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from hlo_tools.xla import xla_bridge  # noqa: E402
from xla_passes_demo.training import MLP, collective_counts, compile_step  # noqa: E402

STYLES = ("shard_map", "jit", "pmap")
WIDTHS = (512, 512, 512, 10)
INPUT_WIDTH = 256
BATCH_PER_DEVICE = 32


def passes_for(style: str) -> dict[str, str | None]:
    wus = "weight-update-sharding{threshold_bytes=0" + (",assume_replicated_parameters=true" if style == "pmap"
                                                         else "") + "}"
    return {"plain": None, "collective-fusion": "collective-fusion", "weight-update-sharding": wus}


def build(style: str):
    """(step, args) of one style; every step donates its parameters and optimizer state."""
    model, tx = MLP(WIDTHS), optax.adam(1e-3)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def local_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, opt_state = update(params, opt_state, jax.lax.pmean(grads, "data"))
        return params, opt_state, jax.lax.pmean(loss, "data")

    def global_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return (*update(params, opt_state, grads), loss)

    params = model.init(jax.random.key(0), jnp.zeros((1, INPUT_WIDTH)))
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * BATCH_PER_DEVICE, INPUT_WIDTH), dtype=np.float32)
    y = rng.integers(0, WIDTHS[-1], 8 * BATCH_PER_DEVICE).astype(np.int32)
    if style == "pmap":
        step = jax.pmap(local_step, axis_name="data", donate_argnums=(0, 1))
        copies = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (8, *np.shape(a))), (params, opt_state))
        return step, (*copies, x.reshape(8, BATCH_PER_DEVICE, -1), y.reshape(8, BATCH_PER_DEVICE))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    if style == "jit":
        step = jax.jit(global_step, donate_argnums=(0, 1))
    else:
        step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                     out_specs=(P(), P(), P()), check_vma=True), donate_argnums=(0, 1))
    return step, (*jax.device_put((params, opt_state), replicated), jax.device_put(x, batch),
                  jax.device_put(y, batch))


def fresh(args):
    return jax.tree.map(lambda a: a.copy() if hasattr(a, "copy") else a, args)


def measure(style: str, steps: int, rounds: int, extra: list[str]) -> dict[str, dict]:
    runs = {}
    for name, passes in {**passes_for(style), **{pipeline: pipeline for pipeline in extra}}.items():
        step, args = build(style)
        compiled, _ = compile_step(step, args, passes, strict=True)
        memory = compiled.memory_analysis()
        runs[name] = {"compiled": compiled, "state": fresh(args), "seconds": [],
                      "collectives": collective_counts(compiled),
                      "aliased": memory.alias_size_in_bytes,
                      "peak": (memory.argument_size_in_bytes + memory.output_size_in_bytes
                               - memory.alias_size_in_bytes + memory.temp_size_in_bytes)}
    order = list(runs)
    for round_number in range(rounds + 1):
        for name in order[round_number % len(order):] + order[:round_number % len(order)]:
            run = runs[name]
            params, opt_state, x, y = run["state"]
            for _ in range(steps):
                start = time.perf_counter()
                params, opt_state, loss = run["compiled"](params, opt_state, x, y)
                jax.block_until_ready(loss)
                if round_number:
                    run["seconds"].append(time.perf_counter() - start)
            run["state"], run["loss"] = (params, opt_state, x, y), float(np.ravel(loss)[0])
    return runs


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| style | run | all-reduce / reduce-scatter / all-gather | donated MB | peak MB | peak vs plain "
             "| median step ms | step vs plain | loss vs plain |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for style, runs in results.items():
        plain = runs["plain"]
        for name, run in runs.items():
            counts = " / ".join(str(run["collectives"].get(k, 0)) for k in ("all-reduce", "reduce-scatter", "all-gather"))
            median, plain_median = statistics.median(run["seconds"]), statistics.median(plain["seconds"])
            lines.append(f"| {style} | {name} | {counts} | {run['aliased'] / 1e6:.2f} | {run['peak'] / 1e6:.2f} "
                         f"| {run['peak'] / plain['peak']:.3f} | {1e3 * median:.2f} | {median / plain_median:.2f} "
                         f"| {abs(run['loss'] - plain['loss']):.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one more runs first, untimed)")
    parser.add_argument("--styles", default=",".join(STYLES), help="comma-separated subset of " + ", ".join(STYLES))
    parser.add_argument("--extra", action="append", default=[], metavar="PIPELINE",
                        help="one more run at the hook with this pipeline (repeatable), e.g. all-reduce-simplifier")
    args = parser.parse_args(argv)
    results = {}
    for style in args.styles.split(","):
        print(f"[{style}] compiling and timing", file=sys.stderr, flush=True)
        results[style] = measure(style, args.steps, args.rounds, args.extra)
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {sys.version.split()[0]}; XLA keeps a "
          f"hooked module's donation: {xla_bridge.hook_keeps_donation()}; MLP {WIDTHS} on {INPUT_WIDTH} inputs, "
          f"adam, batch {BATCH_PER_DEVICE} per device, 8 CPU devices, {args.rounds} rounds of {args.steps} steps")
    print(table(results))


if __name__ == "__main__":
    main()
