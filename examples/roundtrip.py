"""Round-trip a real JAX data-parallel training step through hlo_tools.

Lowers an MLP training step that runs data parallel over 8 CPU devices
(shard_map, gradients averaged with pmean), takes its HLO before XLA's
optimizations and the module XLA hands back after them, and for each one:
parses it with hlo_tools, verifies it, checks that the print is byte-for-byte
the input and that XLA reads the regenerated print as the same module.
Prints a short summary; exits with status 1 if any check fails.
"""

import os

  # XLA reads XLA_FLAGS once, when its CPU backend starts: set it before importing jax.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import collections  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hlo_tools  # noqa: E402
from hlo_tools.xla import xla_bridge  # noqa: E402

COLLECTIVES = {
    "all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter",
    "all-to-all", "ragged-all-to-all", "collective-permute", "collective-permute-start",
    "collective-broadcast",
}


def training_step_hlo() -> dict[str, str]:
    """HLO text of a data-parallel MLP training step, before and after XLA's optimizations."""
    mesh = jax.make_mesh((8,), ("data",))

    def loss_fn(params, x, y):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = params[-1]
        return jnp.mean((x @ w + b - y) ** 2)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "data")
        params = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
        return params, jax.lax.pmean(loss, "data")

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    sizes = [32, 128, 128, 10]
    params = [(arg((m, n), P()), arg((n,), P())) for m, n in zip(sizes, sizes[1:])]
    train = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                  out_specs=(P(), P())))
    lowered = train.lower(params, arg((256, 32), P("data")), arg((256, 10), P("data")))
    return {"before optimizations": lowered.compiler_ir("hlo").as_hlo_text(),
            "after optimizations": lowered.compile().as_text()}


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def check(label: str, text: str) -> bool:
    """Parse, verify and round-trip one module; print its summary. True if every check passes."""
    module, parse_s = timed(hlo_tools.parse_module, text)
    hlo_tools.verify(module)
    printed, print_s = timed(module.to_text)
    regenerated, regenerate_s = timed(module.to_text, regenerate=True)
    byte_exact = printed == text
    same_meaning = xla_bridge.same_meaning(regenerated, text)

    instructions = [instr for comp in module.computations for instr in comp.instructions]
    collectives = collections.Counter(i.opcode for i in instructions if i.opcode in COLLECTIVES)
    print(f"{label}: module {module.name}")
    print(f"  {len(text.splitlines())} lines, {len(module.computations)} computations, "
          f"{len(instructions)} instructions")
    print("  collectives: " + (", ".join(f"{n} x {op}" for op, n in sorted(collectives.items()))
                               or "none"))
    print(f"  parse {parse_s * 1e3:.2f} ms, print {print_s * 1e3:.2f} ms, "
          f"regenerate {regenerate_s * 1e3:.2f} ms")
    print(f"  verified; byte-exact round trip: {byte_exact}; XLA agrees on meaning: {same_meaning}")
    return byte_exact and same_meaning and bool(collectives)


def main() -> int:
    results = [check(label, text) for label, text in training_step_hlo().items()]
    print("OK" if all(results) else "FAILED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
