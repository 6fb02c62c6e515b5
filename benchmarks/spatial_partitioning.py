"""spatial-partitioning against XLA's own partitioner on the same training step (4 CPU devices).

The program: an SGD step of a conv net (four 3x3 stride-1 convolutions with ReLU, global
average pooling, a dense head, mean squared error) on `--batch` images of
`--size`x`--size`x3 (`--channels` sets the convolutions' channels). It is partitioned over 4 devices along H three ways:

* `jax`: `jax.jit` with the image sharded on H (`NamedSharding(mesh, P(None, "h"))`) and
  everything else replicated; JAX's partitioner (Shardy, the default) splits the program;
* `jax, GSPMD`: the same with `jax_use_shardy_partitioner` off for that lowering, so XLA's
  GSPMD partitioner splits it;
* `ours`: the same step lowered for one device, then `spatial-partitioning`;
* `ours+fusion`: `spatial-partitioning{halo_fusion=4}`.

For each: XLA's compiled memory stats of one device's program (peak bytes), the
collective-permutes and their bytes in the program XLA compiled (after its optimizations),
the median step time over `--steps` runs (taken in turn, round by round, so load changes hit
all alike), and the largest difference of the outputs from the single-device step.

Run from the repository root: ``.venv/bin/python benchmarks/spatial_partitioning.py``.
"""
import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_tools
import xla_passes
from hlo_tools.xla import runner
from xla_passes_demo.training import use_cpu_devices

DEVICES = 4
_PERMUTE = re.compile(r"= (\S+) collective-permute(?:-start)?\(")


def conv_step(params, x, target):
    def loss(params):
        *kernels, dense = params
        y = x
        for k in kernels:
            y = jax.nn.relu(jax.lax.conv_general_dilated(y, k, (1, 1), "SAME",
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return jnp.mean((y.mean((1, 2)) @ dense - target) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return value, [p - 0.01 * g for p, g in zip(params, grads)]


def permutes(optimized_text: str) -> tuple[int, int]:
    """Collective-permutes (sync or async starts) and the bytes they send, per device."""
    count = size = 0
    for match in _PERMUTE.finditer(optimized_text):
        count += 1
        shape = hlo_tools.parse_shape(match.group(1))
        size += sum(leaf.byte_size for _, leaf in shape.leaves()) if shape.is_tuple else shape.byte_size
    return count, size


def main():
    use_cpu_devices(DEVICES)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    c = args.channels
    params = [jnp.asarray(np.random.default_rng(i).standard_normal((3, 3, 3 if i == 0 else c, c)) * 0.2, jnp.float32)
              for i in range(4)] + [jnp.ones((c, 10), jnp.float32) * 0.01]
    x = jnp.asarray(np.random.default_rng(9).standard_normal((args.batch, args.size, args.size, 3)), jnp.float32)
    target = jnp.zeros((args.batch, 10), jnp.float32)
    flat_inputs = [np.asarray(a) for a in [*params, x, target]]
    reference = [np.asarray(a) for a in jax.tree.leaves(jax.jit(conv_step)(params, x, target))]

    rows = {}
    # XLA's partitioners from JAX shardings: the image split on H.
    mesh = jax.make_mesh((DEVICES,), ("h",))
    replicated = NamedSharding(mesh, P())
    shardings = ([replicated] * 5, NamedSharding(mesh, P(None, "h")), replicated)
    placed = jax.device_put((params, x, target), shardings)
    for label, shardy in [("jax (image sharded on H)", True), ("jax, GSPMD", False)]:
        default = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
        try:
            lowered = jax.jit(conv_step, in_shardings=shardings).lower(params, x, target)
            compiled = lowered.compile()
        finally:
            jax.config.update("jax_use_shardy_partitioner", default)
        assert ("sdy." in lowered.as_text()) == shardy, "the partitioner switch did not take"
        memory = compiled.memory_analysis()
        count, size = permutes(compiled.as_text())
        out = jax.tree.leaves(compiled(*placed))
        error = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(out, reference))

        def run_jax(compiled=compiled):
            jax.block_until_ready(compiled(*placed))
        rows[label] = dict(peak=memory.peak_memory_in_bytes, temp=memory.temp_size_in_bytes,
                           permutes=count, bytes=size, error=error, run=run_jax)

    single = jax.jit(conv_step).lower(params, x, target).as_text(dialect="hlo")
    for label, passes in [("ours", "spatial-partitioning"), ("ours, halo_fusion=4", "spatial-partitioning{halo_fusion=4}")]:
        module = hlo_tools.parse_module(single)
        xla_passes.run_passes(module, passes)
        text = module.to_text()
        compiled_ours = runner.load_module(text, label).compile(jax.devices()[:DEVICES])
        executable = compiled_ours.executable
        count, size = permutes(executable.optimized_text())
        result = runner.run_module(text, flat_inputs)
        error = max(float(np.max(np.abs(a - b))) for a, b in zip(result.outputs, reference))
        per_device = compiled_ours.device_inputs(flat_inputs)

        def run_ours(compiled_ours=compiled_ours, per_device=per_device):
            compiled_ours.execute(per_device)
        stats = executable.memory_stats()
        rows[label] = dict(peak=stats.get("peak_bytes", 0), temp=stats.get("temp_bytes", 0), permutes=count, bytes=size,
                           error=error, run=run_ours)

    times = {label: [] for label in rows}
    for _ in range(args.steps):
        for label, row in rows.items():
            start = time.perf_counter()
            row["run"]()
            times[label].append(time.perf_counter() - start)

    base = rows["jax (image sharded on H)"]
    base_time = statistics.median(times["jax (image sharded on H)"])
    print(f"conv step, batch {args.batch}, {args.size}x{args.size}x3 -> 4 convs of {c} channels, "
          f"{DEVICES} CPU devices, {args.steps} steps each")
    print(f"{'':28} {'peak bytes/device':>18} {'temp bytes':>11} {'permutes':>9} {'permute bytes':>14} {'median step':>12} "
          f"{'vs jax':>7} {'max |err|':>10}")
    for label, row in rows.items():
        median = statistics.median(times[label])
        print(f"{label:28} {row['peak']:>18,} {row['temp']:>11,} {row['permutes']:>9} {row['bytes']:>14,} "
              f"{median * 1e3:>10.2f}ms {median / base_time:>6.2f}x {row['error']:>10.2e}")
    print("peak memory vs jax: " + ", ".join(f"{label} {row['peak'] / base['peak']:.2f}x"
                                              for label, row in rows.items()))


if __name__ == "__main__":
    main()
