"""Offline weight-update sharding of a shard_map adam step, with and without persistent state.

A JAX shard_map data-parallel adam step of an MLP (`--layers` x `--width`, 8 CPU devices,
parameters and optimizer state donated) is lowered before XLA's optimizations and rewritten
by `xla_passes` offline, as `xla-opt --passes=...` does, three ways:

  original:    one all-reduce of the gradients, the whole update on every device;
  sharded:     `weight-update-sharding`: reduce-scatter, 1/8 of the update, all-gather of the
               new weights and of adam's two moments (the step returns them full-size);
  persistent:  `weight-update-sharding{persistent=true}`: the moments stay sharded across
               steps (their entry parameters and outputs carry a split sharding), so only the
               weights are all-gathered.

Per device, it prints the bytes of each collective in the shard_map body (all-reduce and
reduce-scatter: operand bytes; all-gather: result bytes), the bytes a ring algorithm sends
for them (all-reduce of B: 2(N-1)/N B; reduce-scatter of B and all-gather to B: (N-1)/N B
each), and XLA's compiled memory stats (argument, output, aliased and temp bytes). The
physical limit: as many ring bytes as the original's all-reduce.

Run from the repository root: ``.venv/bin/python benchmarks/weight_update_sharding_offline.py``.
"""
import argparse
import platform

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_tools
import xla_passes
from hlo_tools.inspection.stats import xla_cost
from xla_passes_demo.training import use_cpu_devices

DEVICES = 8
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
PIPELINES = {"original": None, "sharded": "weight-update-sharding",
             "persistent": "weight-update-sharding{persistent=true}"}
MEMORY = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


def adam_step_text(layers: int, width: int, batch_per_device: int) -> str:
    """The HLO, before XLA's optimizations, of a donated shard_map adam step of an MLP."""
    optimizer = optax.adam(1e-3)
    shapes = {f"w{k}": (width, width) for k in range(layers)}
    mesh = jax.make_mesh((DEVICES,), ("data",))

    def loss(params, x, y):
        h = x
        for k in range(layers):
            h = jnp.tanh(h @ params[f"w{k}"])
        return jnp.mean((h - y) ** 2)

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        grads = jax.lax.pmean(grads, "data")
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(value, "data")

    def spec(shape, partition=P()):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, partition))

    params = {name: spec(shape) for name, shape in shapes.items()}
    state = jax.tree.map(lambda leaf: spec(leaf.shape) if leaf.ndim else spec(()),
                         jax.eval_shape(optimizer.init, {n: jnp.zeros(s) for n, s in shapes.items()}))
    batch = DEVICES * batch_per_device
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=(P(), P(), P()), check_vma=False),  # one pmean per gradient, no more
                 donate_argnums=(0, 1))
    args = (params, state, spec((batch, width), P("data")), spec((batch, width), P("data")))
    return fn.lower(*args).compiler_ir("hlo").as_hlo_text()


def collective_bytes(module: hlo_tools.HloModule) -> dict[str, int]:
    """Per-device bytes of each collective in the shard_map body."""
    body = next(c for c in module.computations if c.name.startswith("xla.sdy.manual_computation_body"))
    totals = dict.fromkeys(COLLECTIVES, 0)
    for instr in body.instructions:
        if instr.opcode in totals:
            shape = instr.shape if instr.opcode == "all-gather" else instr.operand(0).shape
            totals[instr.opcode] += shape.byte_size
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-per-device", type=int, default=8)
    args = parser.parse_args()
    use_cpu_devices(DEVICES)
    text = adam_step_text(args.layers, args.width, args.batch_per_device)
    print(f"# {platform.machine()}, jax {jax.__version__}; adam MLP {args.layers} x {args.width}, "
          f"{DEVICES} CPU devices, shard_map, donated; per device, MB")
    print()
    print("| module | " + " | ".join(COLLECTIVES) + " | ring bytes sent | vs original | "
          + " | ".join(name.replace("_bytes", "") for name in MEMORY) + " |")
    print("| --- |" + " ---: |" * (len(COLLECTIVES) + 2 + len(MEMORY)))
    reference = None
    for label, pipeline in PIPELINES.items():
        module = hlo_tools.parse_module(text)
        if pipeline:
            xla_passes.run_passes(module, pipeline)
        wire = collective_bytes(module)
        ring = (DEVICES - 1) / DEVICES * (2 * wire["all-reduce"] + wire["reduce-scatter"] + wire["all-gather"])
        reference = reference or ring
        memory = xla_cost(module, isolate=False).memory
        print(f"| {label} | " + " | ".join(f"{wire[kind] / 1e6:.2f}" for kind in COLLECTIVES)
              + f" | {ring / 1e6:.2f} | {ring / reference:.2f} | "
              + " | ".join(f"{memory.get(name, 0) / 1e6:.2f}" for name in MEMORY) + " |")


if __name__ == "__main__":
    main()
