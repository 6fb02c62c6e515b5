"""`distributed-batch-norm{group_size=2}` at the flag, in the three program styles (8 CPU devices).

A Flax convnet (`--blocks` Conv + BatchNorm + relu blocks of `--channels` channels, a spatial mean
and a Dense head) trained with adam, batch `--batch` per device, `--image` px images, written as
its users write it:

  shard_map  per-device BatchNorm (`axis_name=None`), gradients `pmean`ed;
  jit        `jax.jit` with the batch sharded by `NamedSharding` (XLA's partitioner synchronizes
             BatchNorm over every device);
  pmap       `jax.pmap` with `BatchNorm(axis_name="batch")`, flax's imagenet example.

Three configurations of each, compiled from the same step:

  plain      XLA's defaults, the step donating its state;
  hook       a pass hook that hands XLA's module back unchanged: what the hook alone costs (jaxlib
             0.10.2 drops the buffer donation of every module a hook returns);
  dbn        `distributed-batch-norm{group_size=2}` at the hook (what `XLA_PASSES` does), which
             changes the numbers on purpose: pairs of devices share their statistics;
  dbn+cf     the same followed by `collective-fusion`, which combines the pairs' all-reduces.

For each: the all-reduces, XLA's per-device bytes accessed, the peak memory, whether the pass kept
XLA's fusions (its report), and the step time: the median of `--rounds` rounds of `--steps`
steps, the configurations interleaved so that the machine's load hits all alike, one more round
first, not counted.

Run from the repository root: ``.venv/bin/python benchmarks/distributed_batch_norm.py``.
"""
import argparse
import functools
import pathlib
import statistics
import sys
import tempfile
import time

from xla_passes_demo.training import use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import xla_passes.jax  # noqa: E402
from xla_passes_demo.training import collective_counts, compile_step, compiled_costs, hand_back_hook  # noqa: E402

PASSES = "distributed-batch-norm{group_size=2}"
CONFIGURATIONS = {"plain": None, "hook": None, "dbn": PASSES, "dbn+cf": f"{PASSES},collective-fusion"}
CLASSES = 10
STYLES = ("shard_map", "jit", "pmap")


class ConvNet(nn.Module):
    blocks: int
    channels: int
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        for block in range(self.blocks):
            x = nn.Conv(self.channels, (3, 3), strides=(2, 2) if block % 2 else (1, 1), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x))
        return nn.Dense(CLASSES)(x.mean(axis=(1, 2)))


def _loss(model, params, stats, images, labels):
    logits, updates = model.apply({"params": params, "batch_stats": stats}, images, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates["batch_stats"]


def build(style: str, args, tx):
    """The step of `style` and its arguments (params, stats, optimizer state, images, labels)."""
    devices = jax.devices()[:8]
    model = ConvNet(args.blocks, args.channels, axis_name="batch" if style == "pmap" else None)
    variables = model.init(jax.random.key(0), np.zeros((1, args.image, args.image, 3), np.float32))
    params, stats = variables["params"], variables["batch_stats"]
    rng = np.random.default_rng(0)
    images = rng.standard_normal((8 * args.batch, args.image, args.image, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES, 8 * args.batch).astype(np.int32)
    grad = jax.value_and_grad(functools.partial(_loss, model), has_aux=True)

    def update(grads, opt_state, params):
        changes, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, changes), opt_state

    if style == "pmap":
        def step(params, stats, opt_state, images, labels):
            (loss, stats), grads = grad(params, stats, images, labels)
            params, opt_state = update(jax.lax.pmean(grads, "batch"), opt_state, params)
            return params, stats, opt_state, jax.lax.pmean(loss, "batch")

        replicated = functools.partial(jax.tree.map, lambda a: np.stack([np.asarray(a)] * 8))
        return (jax.pmap(step, axis_name="batch", donate_argnums=(0, 1, 2)),
                (*replicated((params, stats, tx.init(params))), images.reshape(8, args.batch, *images.shape[1:]),
                 labels.reshape(8, args.batch)))
    mesh = Mesh(np.array(devices), ("data",))
    batch = jax.device_put((images, labels), NamedSharding(mesh, P("data")))
    if style == "jit":
        def step(params, stats, opt_state, images, labels):
            (loss, stats), grads = grad(params, stats, images, labels)
            params, opt_state = update(grads, opt_state, params)
            return params, stats, opt_state, loss
    else:
        def per_device(params, stats, opt_state, images, labels):
            (loss, stats), grads = grad(params, stats, images, labels)
            params, opt_state = update(jax.lax.pmean(grads, "data"), opt_state, params)
            return params, jax.lax.pmean(stats, "data"), opt_state, jax.lax.pmean(loss, "data")

        step = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), P("data"), P("data")),
                             out_specs=P(), check_vma=False)
    return jax.jit(step, donate_argnums=(0, 1, 2)), (params, stats, tx.init(params), *batch)


def measure(style: str, args) -> dict:
    tx = optax.adam(1e-3)
    step, state = build(style, args, tx)
    fresh = functools.partial(jax.tree.map, lambda leaf: leaf.copy())
    runs = {}
    for label, passes in CONFIGURATIONS.items():
        print(f"  {style}: compiling {label}", file=sys.stderr, flush=True)
        reports = []
        if label == "hook":
            with hand_back_hook():
                compiled, _ = compile_step(step, fresh(state), None)
        else:
            with tempfile.TemporaryDirectory() as dump:   # the pass's report heads each module it wrote
                compiled, _ = compile_step(step, fresh(state), passes, strict=True, dump_to=dump if passes else None)
                reports = [line for path in pathlib.Path(dump).glob("*after_distributed-batch-norm.txt")
                           for line in path.read_text().splitlines() if line.startswith("// ")]
        xla_passes.jax.disable()
        runs[label] = {"compiled": compiled, "state": fresh(state), "seconds": [], **compiled_costs(compiled),
                       "all-reduces": collective_counts(compiled).get("all-reduce", 0),
                       "peak": compiled.memory_analysis().peak_memory_in_bytes,
                       "fusions kept": any("which stay" in line for line in reports),
                       "changed": any(": summed over" in line for line in reports)}
    for round_number in range(args.rounds + 1):
        for run in runs.values():
            for _ in range(args.steps):
                start = time.perf_counter()
                *rest, loss = run["compiled"](*run["state"][:3], *state[3:])
                jax.block_until_ready(loss)
                run["state"] = (*rest, *state[3:])
                if round_number:
                    run["seconds"].append(time.perf_counter() - start)
    for run in runs.values():
        run["median_s"] = statistics.median(run["seconds"])
        del run["compiled"], run["state"]
    return runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="examples per device")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--styles", nargs="+", default=list(STYLES), choices=STYLES)
    args = parser.parse_args(argv)
    print(f"Flax convnet, {args.blocks} Conv + BatchNorm blocks of {args.channels} channels, {args.image}x"
          f"{args.image} images, batch {args.batch} per device, adam, 8 CPU devices; `{PASSES}` at the hook; "
          f"time: median of {args.rounds} interleaved rounds x {args.steps} steps (one more round warms up)")
    print()
    print("| style | configuration | all-reduces | bytes accessed (MB) | vs plain | peak (MB) | median step (ms) "
          "| vs plain | vs hook |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for style in args.styles:
        runs = measure(style, args)
        plain, hook = runs["plain"], runs["hook"]
        for label, run in runs.items():
            name = {"plain": "XLA's defaults", "hook": "hook alone (module unchanged)"}.get(label)
            if name is None:
                kept = "XLA's fusions kept" if run["fusions kept"] else "module unfused"
                name = f"{CONFIGURATIONS[label]} ({kept if run['changed'] else 'refused'})"
            print(f"| {style} | {name} | {run['all-reduces']} | {run['bytes accessed'] / 1e6:.1f} | "
                  f"{run['bytes accessed'] / plain['bytes accessed']:.3f} | {run['peak'] / 1e6:.1f} | "
                  f"{1e3 * run['median_s']:.2f} | {run['median_s'] / plain['median_s']:.3f} | "
                  f"{run['median_s'] / hook['median_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
