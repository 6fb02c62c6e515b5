"""Where `halo_fusion` could win on CPU: exchange latency against bytes, and many small slabs.

Two measurements on `--devices` CPU devices (default 8):

1. One collective-permute's cost against its size: a program that shifts an `f32[n]` one
   device along a ring `--chain` times in a row (each shift feeds the next, so they cannot
   overlap) is timed against the same program with one shift; the difference over
   `chain - 1` is the time per exchange, for sizes from 64 bytes to 4 MiB.
2. A chain of `--convs` 3x3 SAME convolutions with ReLU (and its SGD step) on
   `--size`x`--size` images with `--channels` channels, split along H over the devices by
   `spatial-partitioning{halo_fusion=k}` for k = 1, 2, 4, ...: collective-permutes in the
   compiled program, their bytes, and the median step time.

Times are medians over `--steps` runs taken in turn (round by round, so load changes hit all
alike). Run from the repository root: ``.venv/bin/python benchmarks/spatial_halo_fusion.py``.
"""
import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import hlo_tools
import xla_passes
from hlo_tools.xla import runner
from xla_passes_demo.training import use_cpu_devices

sys.path.insert(0, os.path.dirname(__file__))
from spatial_partitioning import permutes  # noqa: E402

_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--devices", type=int, default=8)
DEVICES = _pre.parse_known_args()[0].devices


def ring_shifts(elements: int, chain: int) -> str:
    """A per-device program that sends an f32[elements] to the next device `chain` times in a row."""
    pairs = ",".join(f"{{{d},{(d + 1) % DEVICES}}}" for d in range(DEVICES))
    lines = [f"HloModule shifts_{chain}, num_partitions={DEVICES}", "", "ENTRY e {",
             f"  x0 = f32[{elements}] parameter(0), sharding={{replicated}}"]
    for i in range(chain):
        lines.append(f"  x{i + 1} = f32[{elements}] collective-permute(x{i}), channel_id={i + 1}, "
                     f"source_target_pairs={{{pairs}}}")
    lines[-1] = lines[-1].replace(f"  x{chain} =", f"  ROOT x{chain} =") + ", sharding={replicated}"
    return "\n".join(lines + ["}", ""])


def timed(programs: dict, steps: int) -> dict:
    """label -> median seconds of one run, the programs run in turn `steps` times."""
    times = {label: [] for label in programs}
    for _ in range(steps):
        for label, run in programs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def compiled_program(text: str, inputs):
    compiled = runner.load_module(text).compile(jax.devices()[:DEVICES])
    per_device = compiled.device_inputs(inputs)
    return compiled, (lambda: compiled.execute(per_device))


def exchange_latency(chain: int, steps: int):
    print(f"collective-permute on {DEVICES} CPU devices: time per exchange against its size "
          f"({chain} chained shifts minus 1, medians of {steps})")
    print(f"{'bytes':>10} {'1 shift':>10} {f'{chain} shifts':>10} {'per exchange':>13} {'GB/s':>7}")
    for elements in (16, 256, 4096, 65536, 1 << 20):
        data = [np.ones(elements, np.float32)]
        programs = {n: compiled_program(ring_shifts(elements, n), data)[1] for n in (1, chain)}
        median = timed(programs, steps)
        per = (median[chain] - median[1]) / (chain - 1)
        rate = elements * 4 / per / 1e9 if per > 0 else float("nan")
        print(f"{elements * 4:>10,} {median[1] * 1e6:>8.0f}us {median[chain] * 1e6:>8.0f}us "
              f"{per * 1e6:>11.1f}us {rate:>7.2f}")


def conv_chain(depth: int, train: bool):
    def net(kernels, x):
        for k in kernels:
            x = jax.nn.relu(jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return x

    def step(kernels, x):
        loss, grads = jax.value_and_grad(lambda ks: jnp.mean(net(ks, x) ** 2))(kernels)
        return loss, [k - 0.01 * g for k, g in zip(kernels, grads)]
    return step if train else net


def fusion_sweep(args):
    c, rows = args.channels, args.size // DEVICES
    kernels = [jnp.asarray(np.random.default_rng(i).standard_normal((3, 3, c, c)) * 0.2, jnp.float32)
               for i in range(args.convs)]
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, args.size, args.size, c)), jnp.float32)
    inputs = [np.asarray(a) for a in [*kernels, x]]
    depths = [k for k in (1, 2, 4, 8) if k <= args.convs]
    for train in (False, True):
        f = conv_chain(args.convs, train)
        reference = [np.asarray(a) for a in jax.tree.leaves(jax.jit(f)(kernels, x))]
        single = jax.jit(f).lower(kernels, x).as_text(dialect="hlo")
        programs, stats = {}, {}
        for k in depths:
            module = hlo_tools.parse_module(single)
            xla_passes.run_passes(module, f"spatial-partitioning{{num_partitions={DEVICES},halo_fusion={k}}}")
            text = module.to_text()
            compiled, run = compiled_program(text, inputs)
            result = runner.run_module(text, inputs)
            error = max(float(np.max(np.abs(a - b))) for a, b in zip(result.outputs, reference))
            programs[k] = run
            stats[k] = (*permutes(compiled.executable.optimized_text()), error)
        median = timed(programs, args.steps)
        kind = "SGD step" if train else "forward"
        print(f"\n{args.convs} chained 3x3 convolutions ({kind}), 1x{args.size}x{args.size}x{c}, "
              f"{DEVICES} CPU devices ({rows} rows each), medians of {args.steps}")
        print(f"{'halo_fusion':>11} {'permutes':>9} {'permute bytes':>14} {'median step':>12} {'vs 1':>6} {'max |err|':>10}")
        for k in depths:
            count, size, error = stats[k]
            print(f"{k:>11} {count:>9} {size:>14,} {median[k] * 1e3:>10.3f}ms {median[k] / median[1]:>5.2f}x "
                  f"{error:>10.2e}")


def main():
    use_cpu_devices(DEVICES)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[_pre])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--convs", type=int, default=8)
    parser.add_argument("--chain", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    exchange_latency(args.chain, args.steps)
    fusion_sweep(args)


if __name__ == "__main__":
    main()
