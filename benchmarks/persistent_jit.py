"""weight-update-sharding{persistent=true} on a `jax.jit` + `NamedSharding` step, against `jax.jit`.

A Flax MLP step (optax adam, 8 CPU devices, the batch split by `NamedSharding`, parameters and
optimizer state donated, as a training loop compiles it), on a mesh whose axis is `Auto` (JAX
leaves the outputs' shardings to XLA) and one whose axis is `Explicit` (JAX annotates every
value). For each: plain `jax.jit` (XLA's defaults) and
`xla_passes.jax.jit(step, passes="weight-update-sharding{persistent=true,threshold_bytes=0}")`,
which annotates the optimizer state and its update as split over the data axis for XLA's
partitioner. Per device: the optimizer state's bytes between steps, XLA's aliased (donated)
bytes, the peak (arguments + outputs + temp - aliased), the collectives of the compiled step,
and the median step time, the runs interleaved in rounds (their order alternating) after one
untimed round. The losses after the timed steps are compared with plain's.

Run from the repository root: ``.venv/bin/python benchmarks/persistent_jit.py [--steps N] [--rounds N]``.
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

import xla_passes.jax  # noqa: E402
from xla_passes_demo.training import MLP, collective_counts  # noqa: E402

WIDTHS = (512, 512, 512, 10)
INPUT_WIDTH = 256
BATCH = 256
PASSES = "weight-update-sharding{persistent=true,threshold_bytes=0}"


def build(axis_type):
    """(step, fresh arguments) of the adam step on an 8-device mesh with `axis_type`."""
    model, tx = MLP(WIDTHS), optax.adam(1e-3)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))

    def step(params, opt_state, x, y):
        def loss_fn(p):   # one-hot labels: jax 0.12 takes no integer-label scatter under an Explicit axis
            return optax.softmax_cross_entropy(model.apply(p, x), jax.nn.one_hot(y, WIDTHS[-1])).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = model.init(jax.random.key(0), jnp.zeros((1, INPUT_WIDTH)))
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P("data"))
    x = jax.device_put(rng.standard_normal((BATCH, INPUT_WIDTH), dtype=np.float32), batch)
    y = jax.device_put(rng.integers(0, WIDTHS[-1], BATCH).astype(np.int32), batch)

    def fresh():
        state = jax.tree.map(np.asarray, (params, tx.init(params)))
        return (*jax.device_put(state, NamedSharding(mesh, P())), x, y)
    return step, fresh


def measure(axis_type, steps: int, rounds: int) -> dict[str, dict]:
    step, fresh = build(axis_type)
    runs = {}
    for name, jitted in (("jax.jit", jax.jit(step, donate_argnums=(0, 1))),
                         ("persistent", xla_passes.jax.jit(step, passes=PASSES, strict=True, donate_argnums=(0, 1)))):
        args = fresh()
        compiled = jitted.lower(*args).compile()
        memory = compiled.memory_analysis()
        runs[name] = {"call": jitted, "state": fresh(), "seconds": [], "collectives": collective_counts(compiled),
                      "aliased": memory.alias_size_in_bytes,
                      "peak": (memory.argument_size_in_bytes + memory.output_size_in_bytes
                               - memory.alias_size_in_bytes + memory.temp_size_in_bytes)}
    order = list(runs)
    for round_number in range(rounds + 1):
        for name in order if round_number % 2 else order[::-1]:
            run = runs[name]
            params, opt_state, x, y = run["state"]
            for _ in range(steps):
                start = time.perf_counter()
                params, opt_state, loss = run["call"](params, opt_state, x, y)
                jax.block_until_ready(loss)
                if round_number:
                    run["seconds"].append(time.perf_counter() - start)
            run["state"], run["loss"] = (params, opt_state, x, y), float(loss)
            run["state_bytes"] = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(opt_state))
    return runs


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| mesh axis | run | state MB per device | all-reduce / reduce-scatter / all-gather | donated MB "
             "| peak MB | peak vs jax.jit | median step ms | step vs jax.jit | loss vs jax.jit |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for axis, runs in results.items():
        plain = runs["jax.jit"]
        for name, run in runs.items():
            counts = " / ".join(str(run["collectives"].get(k, 0)) for k in ("all-reduce", "reduce-scatter", "all-gather"))
            median, plain_median = statistics.median(run["seconds"]), statistics.median(plain["seconds"])
            lines.append(f"| {axis} | {name} | {run['state_bytes'] / 1e6:.2f} | {counts} | {run['aliased'] / 1e6:.2f} "
                         f"| {run['peak'] / 1e6:.2f} | {run['peak'] / plain['peak']:.3f} | {1e3 * median:.2f} "
                         f"| {median / plain_median:.2f} | {abs(run['loss'] - plain['loss']):.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run and round")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (one more runs first, untimed)")
    args = parser.parse_args(argv)
    results = {}
    for axis_type in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
        print(f"[{axis_type.name}] compiling and timing", file=sys.stderr, flush=True)
        results[axis_type.name] = measure(axis_type, args.steps, args.rounds)
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {sys.version.split()[0]}; MLP {WIDTHS} on "
          f"{INPUT_WIDTH} inputs, adam, batch {BATCH} split over 8 CPU devices, {args.rounds} rounds of "
          f"{args.steps} steps:\n")
    print(table(results))


if __name__ == "__main__":
    main()
