"""Worker process of test_collective_fusion: the combiners where they run in production.

XLA hands every compiled module to a PRE_SCHEDULER pass hook: the per-device module after
SPMD partitioning, layout assignment and fusion. This worker compiles JAX data-parallel
programs with XLA's own all-reduce combiner switched off (`cpu-all-reduce-combiner`, the one
XLA's CPU pipeline runs before the hook), runs a pipeline on the module inside the hook,
lets XLA finish compiling what the pipeline returned, and runs it. XLA executes the
rewritten module directly, so tuple-shaped reduce-scatters run too (XLA's StableHLO bridge,
which `hlo_tools.xla.runner` compiles through, rejects them).

XLA reads XLA_FLAGS once per process, hence a process of its own::

    python collective_hook_worker.py OUT.json PIPELINE [PIPELINE ...]

OUT.json maps pipeline -> program -> {"before": {opcode: count}, "after": {opcode: count},
"same_outputs": bool}: the collectives of the hooked module before and after the pipeline,
and whether the outputs are bit for bit those of the same program compiled without it.
"""
from __future__ import annotations

import json
import os
import sys

N_DEVICES = 8
LAYERS = 12
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")
# The caller's flags (the tests': -O0) first, then this worker's.
os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={N_DEVICES} "
                           "--xla_disable_hlo_passes=cpu-all-reduce-combiner").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend import xla as jex_xla  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hlo_tools  # noqa: E402
import xla_passes  # noqa: E402
from hlo_tools.xla import xla_bridge  # noqa: E402

HOOK_NAME = "tests.collective_fusion"
STAGE = jex_xla.PipelineStage.PRE_SCHEDULER


def mlp_pmap():
    """A pmap training step of a 12-layer MLP that psums every gradient on its own (24 psums)
    and the loss: what XLA's combiner would otherwise merge."""
    def loss(params, x, y):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "batch"), grads)
        new = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
        return new, jax.lax.psum(value, "batch")

    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal((N_DEVICES, *shape)).astype(np.float32)

    params = [(normal(16, 16), normal(16)) for _ in range(LAYERS)]
    return jax.pmap(step, axis_name="batch"), (params, normal(4, 16), normal(4, 16))


def sharded_collectives():
    """shard_map with reduce-scatters (f32 of two shapes and two dimensions, s32),
    all-gathers (mixed dtypes, two dimensions) and psums (f32, s32): several kinds at once."""
    mesh = jax.make_mesh((N_DEVICES,), ("d",))

    def program(a, b, i, x, k):
        return (jax.lax.psum_scatter(a, "d", scatter_dimension=0, tiled=True),
                jax.lax.psum_scatter(b, "d", scatter_dimension=0, tiled=True),
                jax.lax.psum_scatter(i, "d", scatter_dimension=0, tiled=True),
                jax.lax.psum_scatter(a.T, "d", scatter_dimension=1, tiled=True),
                jax.lax.all_gather(x, "d", axis=0, tiled=True),
                jax.lax.all_gather(k, "d", axis=0, tiled=True),
                jax.lax.all_gather(x, "d", axis=1, tiled=True),
                jax.lax.psum(x, "d"), jax.lax.psum(k, "d"), jax.lax.psum(a, "d"))

    specs = (P(), P(), P(), P("d"), P("d"))
    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=specs, check_vma=False,
                               out_specs=(P("d"), P("d"), P("d"), P(None, "d"), P(), P(), P(), P(), P(), P())))
    rng = np.random.default_rng(1)
    arrays = (rng.standard_normal((16, 3)).astype(np.float32), rng.standard_normal((8,)).astype(np.float32),
              rng.integers(-9, 9, (32, 2)).astype(np.int32), rng.standard_normal((16, 3)).astype(np.float32),
              rng.integers(-9, 9, (8,)).astype(np.int32))
    return fn, tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))


def scan_psums():
    """shard_map around a scan whose body psums two values per step (a while body)."""
    mesh = jax.make_mesh((N_DEVICES,), ("d",))

    def program(h, xs):
        def cell(carry, x):
            u = jax.lax.psum(jnp.tanh(carry + x), "d")
            v = jax.lax.psum(carry * x, "d")
            return u * 0.5 - v * 0.25, u.sum()
        return jax.lax.scan(cell, h, xs)

    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P(), P(None, "d")), out_specs=(P(), P())))
    rng = np.random.default_rng(2)
    h = rng.standard_normal((8,)).astype(np.float32)
    xs = rng.standard_normal((5, 8 * N_DEVICES)).astype(np.float32)
    return fn, (jax.device_put(h, NamedSharding(mesh, P())), jax.device_put(xs, NamedSharding(mesh, P(None, "d"))))


PROGRAMS = {"mlp_pmap": mlp_pmap, "sharded_collectives": sharded_collectives, "scan_psums": scan_psums}


def collective_counts(module) -> dict[str, int]:
    return {op: sum(1 for i in module.instructions() if i.opcode == op) for op in COLLECTIVES}


def compile_and_run(build, pipeline: str | None) -> tuple[list[np.ndarray], list[tuple[dict, dict]]]:
    """Outputs of the program compiled with `pipeline` run in the hook (None: no hook), and
    the (before, after) collective counts of each module the hook saw."""
    seen = []

    def hook(proto: bytes) -> bytes | None:
        module = hlo_tools.parse_module(xla_bridge.hook_module_text(proto))
        before = collective_counts(module)
        changed = xla_passes.run_passes(module, pipeline)
        seen.append((before, collective_counts(module)))
        return xla_bridge.text_to_proto(module.to_text()) if changed else None

    jax.clear_caches()
    fn, args = build()
    if pipeline is not None:
        jex_xla.register_hlo_module_transformation(hook, name=HOOK_NAME, stage=STAGE, platforms="cpu")
    try:
        outputs = fn(*args)
    finally:
        if pipeline is not None:
            jex_xla.clear_hlo_module_transformation(HOOK_NAME, STAGE, platforms="cpu")
    return [np.asarray(leaf) for leaf in jax.tree.leaves(outputs)], seen


def main(argv: list[str]) -> None:
    target, pipelines = argv[0], argv[1:]
    report = {}
    baselines = {name: compile_and_run(build, None)[0] for name, build in PROGRAMS.items()}
    for pipeline in pipelines:
        report[pipeline] = {}
        for name, build in PROGRAMS.items():
            outputs, seen = compile_and_run(build, pipeline)
            (before, after), = [counts for counts in seen if any(counts[0].values())]
            same = len(outputs) == len(baselines[name]) and all(
                a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                for a, b in zip(outputs, baselines[name]))
            report[pipeline][name] = {"before": before, "after": after, "same_outputs": same}
    with open(target, "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1:])
