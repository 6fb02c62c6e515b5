"""What weight-update-sharding does to an Adam data-parallel step (8 CPU devices), and JAX's ZeRO-1 peer.

Configurations of the same Flax MLP step (optax.adam), all compiled in this one process:

  a. plain data-parallel step: shard_map under jit, batch split over the "data" axis,
     gradients averaged with ``lax.pmean``, the whole Adam update on every device;
  b. the same step compiled with ``xla_passes.jax.enable("weight-update-sharding", strict=True)``
     (what ``XLA_PASSES=weight-update-sharding`` does): the pass rewrites the fused,
     partitioned module at XLA's PRE_SCHEDULER hook;
  c. JAX's own ZeRO-1-style alternative, no shard_map: a plain ``jax.jit`` of the global step
     with the parameters replicated, the Adam state sharded along the data axis (dimension 0
     of every moment) and the batch sharded, all by ``NamedSharding``; XLA's SPMD partitioner
     decides the collectives.

  d. the step a through ``xla_passes.jax.jit(step, passes="weight-update-sharding{persistent=true}",
     donate_argnums=(0, 1))``: the pass rewrites JAX's lowering before XLA's optimizations, so
     donation is kept and the Adam state stays sharded between steps (ZeRO-1, automatically).

Two more programs are only compiled: h, program a through a pass hook that hands XLA's
module back unchanged (it shows that XLA of jaxlib 0.10.2 drops the aliasing of donated
buffers, ``input_output_alias``, of every module a hook hands back, rewritten or not: b's
aliased bytes are 0 for that reason alone), and g (forward and backward on the local batch
alone: no pmean, no update), so that ``flops(step) - flops(g)`` shows the flops of the gradient
averaging and the update. The shard_map programs use ``check_vma=False`` (as
tests/workers/jax_plugin_worker.py does), so that each gradient is all-reduced once, by its pmean.

For each: per-device flops and bytes accessed (``compiled.cost_analysis()``), argument,
output and temp bytes (``compiled.memory_analysis()``), the collectives of the optimized HLO
(``compiled.as_text()``) with their full array bytes (the all-reduced array; the operand of a
reduce-scatter; the result of an all-gather) and the bytes a ring implementation sends per
device ((N-1)/N of the full array for a reduce-scatter or an all-gather, twice that for an
all-reduce), and the median step time over interleaved rounds (``--rounds`` rounds of
``--steps`` steps each, the first round not counted).

Physical limits to compare with: the update's work falls to 1/N per device; a ring
all-reduce sends as many bytes as a reduce-scatter followed by an all-gather of the same
array, so sharding the update costs no extra wire bytes as long as only the weight is
all-gathered (all-gathering Adam's two moments as well triples the all-gather's bytes).

Run from the repository root: ``.venv/bin/python benchmarks/weight_update_sharding.py``.
"""
import argparse
import os
import platform
import re
import shlex
import statistics
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_passes.jax
from xla_passes_demo.training import MLP, compile_step, compiled_costs, hand_back_hook, use_cpu_devices

PASS = "weight-update-sharding"
N = 8
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8}
ARRAY = re.compile(r"\b(f32|f16|bf16|f64|s32|u32|s8|u8|pred|s64)\[([\d,]*)\]")
COLLECTIVE_LINE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+(?P<op>all-reduce|reduce-scatter|all-gather)"
    r"(?:-start)?\((?P<operands>[^)]*)\)")


def array_bytes(text: str) -> int:
    total = 0
    for dtype, dims in ARRAY.findall(text):
        total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def collective_stats(hlo_text: str) -> dict[str, tuple[int, int]]:
    """(count, full array bytes) of each collective in an optimized module's text."""
    stats = {op: [0, 0] for op in COLLECTIVES}
    for match in COLLECTIVE_LINE.finditer(re.sub(r"/\*.*?\*/", "", hlo_text)):  # drop /*index=5*/
        op = match.group("op")
        result = array_bytes(match.group("shape"))
        stats[op][0] += 1
        # The optimized text names operands without their shapes: a reduce-scatter's operand is
        # its result times the group size (every collective here spans the N devices).
        stats[op][1] += result * N if op == "reduce-scatter" else result
    return {op: tuple(v) for op, v in stats.items()}


def ring_bytes(stats) -> float:
    """Bytes a ring implementation sends per device for these collectives."""
    share = (N - 1) / N
    return (2 * share * stats["all-reduce"][1] + share * stats["reduce-scatter"][1]
            + share * stats["all-gather"][1])


def build(width: int, layers: int, batch_per_device: int):
    model = MLP(widths=(width,) * layers + (16,))
    optimizer = optax.adam(1e-3)
    mesh = jax.make_mesh((N,), ("data",))

    def loss_fn(params, images, labels):
        logits = model.apply(params, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def dp_step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    def local_grads(params, images, labels):
        return jax.value_and_grad(loss_fn)(params, images, labels)

    def global_step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, width)))
    opt_state = jax.jit(optimizer.init)(params)

    def zero1_sharding(leaf):  # Adam's moments split along dimension 0; the step count replicated
        return batch if leaf.ndim and leaf.shape[0] % N == 0 else replicated

    state_shardings = jax.tree.map(zero1_sharding, opt_state)
    rng = np.random.default_rng(0)
    images = jax.device_put(rng.standard_normal((N * batch_per_device, width), dtype=np.float32), batch)
    labels = jax.device_put(rng.integers(0, 16, N * batch_per_device).astype(np.int32), batch)

    dp = jax.jit(jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=(P(), P(), P()), check_vma=False), donate_argnums=(0, 1))
    grads_only = jax.jit(jax.shard_map(local_grads, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                       out_specs=(P(), P()), check_vma=False))
    zero1 = jax.jit(global_step, in_shardings=(replicated, state_shardings, batch, batch),
                    out_shardings=(replicated, state_shardings, replicated), donate_argnums=(0, 1))
    dp_args = (jax.device_put(params, replicated), jax.device_put(opt_state, replicated), images, labels)
    zero1_args = (jax.device_put(params, replicated), jax.device_put(opt_state, state_shardings), images, labels)
    dp_with_passes = xla_passes.jax.jit(jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                                      out_specs=(P(), P(), P()), check_vma=False),
                                        passes=PERSISTENT, donate_argnums=(0, 1))
    return {"a": (dp, dp_args, None), "b": (dp, dp_args, PASS), "c": (zero1, zero1_args, None),
            "d": (dp_with_passes, dp_args, JIT), "h": (dp, dp_args, HAND_BACK),
            "g": (grads_only, (dp_args[0], images, labels), None)}


HAND_BACK = "hand back unchanged"  # config h: a hook that returns the module it was given
JIT = "xla_passes.jax.jit"  # config d: the passes on JAX's lowering
PERSISTENT = f"{PASS}{{persistent=true}}"
LABELS = {"a": "data-parallel, plain", "b": f"data-parallel + {PASS}", "c": "ZeRO-1 via jit shardings (peer)",
          "d": f"xla_passes.jax.jit + {PERSISTENT}",
          "h": "a through a hook that hands the module back unchanged",
          "g": "local gradients only (no pmean, no update; reference)"}


def compile_config(fn, args, passes):
    """`compile_step`; for HAND_BACK a compile with a hook that returns the module it gets; for
    JIT the compile of `xla_passes.jax.jit`'s lowering."""
    if passes == JIT:
        return fn.lower(*args).compile()
    if passes != HAND_BACK:
        return compile_step(fn, args, passes, strict=True)[0]
    with hand_back_hook():
        return compile_step(fn, args, None)[0]


def static_numbers(compiled) -> dict:
    collectives = collective_stats(compiled.as_text())
    return {**compiled_costs(compiled), "peak": compiled.memory_analysis().peak_memory_in_bytes,
            "collectives": collectives, "ring": ring_bytes(collectives)}


def main(argv=None) -> None:
    use_cpu_devices(N)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="width of the Dense layers")
    parser.add_argument("--layers", type=int, default=4, help="Dense layers of width x width (plus a 16-class head)")
    parser.add_argument("--batch-per-device", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (one more warms up)")
    args = parser.parse_args(argv)
    print("$ " + " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/weight_update_sharding.py",
                                                      *(sys.argv[1:] if argv is None else argv)]))
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, jax {jax.__version__}, "
          f"{N} CPU devices; MLP {args.layers} x Dense({args.width}) + Dense(16), adam, "
          f"batch {args.batch_per_device}/device; {args.rounds} rounds x {args.steps} steps, interleaved")
    configs = build(args.width, args.layers, args.batch_per_device)
    runs = {}
    for key, (fn, fn_args, passes) in configs.items():
        compiled = compile_config(fn, fn_args, passes)
        runs[key] = {"compiled": fn if passes == JIT else compiled, **static_numbers(compiled), "seconds": []}
        if key in ("a", "b", "c", "d"):
            runs[key]["state"] = jax.tree.map(lambda leaf: leaf.copy(), fn_args)  # each donates its own buffers
    timed = ["a", "b", "c", "d"]
    for round_index in range(args.rounds + 1):
        for key in timed:
            run = runs[key]
            params, opt_state, images, labels = run["state"]
            for _ in range(args.steps):
                start = time.perf_counter()
                params, opt_state, loss = run["compiled"](params, opt_state, images, labels)
                jax.block_until_ready((params, opt_state, loss))
                if round_index:
                    run["seconds"].append(time.perf_counter() - start)
            run["state"] = (params, opt_state, images, labels)
            run["loss"] = float(loss)
    for key in timed:
        runs[key]["median_s"] = statistics.median(runs[key]["seconds"])
        runs[key]["min_s"] = min(runs[key]["seconds"])
    grad_flops = runs["g"]["flops"]
    a = runs["a"]

    def ratio(x, y):
        return f"{x / y:.3f}" if y else "-"

    print()
    print("Per device (XLA's cost and memory analysis of the compiled program); ratios vs a")
    print()
    print("| config | | flops (M) | vs a | update flops (M) = step - g | vs a | bytes accessed (MB) | vs a "
          "| temp (MB) | vs a | arguments (MB) | outputs (MB) | aliased (MB) | peak (MB) | vs a |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for key in ["a", "b", "c", "d", "h", "g"]:
        r = runs[key]
        update = r["flops"] - grad_flops
        update_cols = (f"{update / 1e6:.2f} | {ratio(update, a['flops'] - grad_flops)}" if key != "g" else "- | -")
        print(f"| {key} | {LABELS[key]} | {r['flops'] / 1e6:.2f} | {ratio(r['flops'], a['flops'])} | {update_cols} | "
              f"{r['bytes accessed'] / 1e6:.2f} | {ratio(r['bytes accessed'], a['bytes accessed'])} | "
              f"{r['temp'] / 1e6:.2f} | {ratio(r['temp'], a['temp'])} | {r['argument'] / 1e6:.2f} | "
              f"{r['output'] / 1e6:.2f} | {r['alias'] / 1e6:.2f} | {r['peak'] / 1e6:.2f} | "
              f"{ratio(r['peak'], a['peak'])} |")
    print()
    print("Collectives of the optimized HLO: count / full array MB; ring MB sent per device; ratios vs a")
    print()
    print("| config | all-reduce | reduce-scatter | all-gather | ring MB sent per device | vs a |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for key in ["a", "b", "c", "d", "g"]:
        r = runs[key]
        cells = " | ".join(f"{r['collectives'][op][0]} / {r['collectives'][op][1] / 1e6:.2f}" for op in COLLECTIVES)
        print(f"| {key} | {cells} | {r['ring'] / 1e6:.2f} | {ratio(r['ring'], a['ring'])} |")
    print()
    print("Step time (all 8 devices on this machine's cores); ratios vs a")
    print()
    print("| config | | median step (ms) | vs a | min step (ms) | vs a | loss after all steps |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for key in timed:
        r = runs[key]
        print(f"| {key} | {LABELS[key]} | {1e3 * r['median_s']:.2f} | {ratio(r['median_s'], a['median_s'])} | "
              f"{1e3 * r['min_s']:.2f} | {ratio(r['min_s'], a['min_s'])} | {r['loss']:.6g} |")


if __name__ == "__main__":
    main()
