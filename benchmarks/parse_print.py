"""Parse and print speed of hlo_tools against XLA's own C++ parser and printer.

Builds a real module of more than 10,000 lines: the data-parallel training step
(shard_map over 8 CPU devices, optax adam) of a Flax model with many residual
MLP blocks, unrolled.  For its HLO before XLA's optimizations (with debug info)
and after them, times, as the median of several runs:

  * hlo_tools: ``parse_module`` (eager, and with ``lazy_bodies=True``: the entry
    computation only, as the JAX plugin's hook parses), ``to_text()`` and
    ``to_text(regenerate=True)``;
  * XLA (through ``hlo_tools.xla.xla_bridge``): ``hlo_module_from_text`` and ``to_string()``;

and prints a markdown table with the ratios ours / XLA. The two sides of each
operation run in turn, so that changes in the machine's load hit both alike.

Needs the test extra (Flax, optax): ``pip install -e '.[test]'``.
Run from the repository root: ``.venv/bin/python benchmarks/parse_print.py``.
"""

import argparse
import platform
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_tools
from hlo_tools.xla import xla_bridge
from xla_passes_demo.training import use_cpu_devices

MIN_LINES = 10_000


class ResidualBlock(nn.Module):
    """LayerNorm, a two-layer GELU MLP, and a residual connection."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class DeepMLP(nn.Module):
    """``layers`` residual blocks (a Python loop, so unrolled in HLO) and a classifier."""

    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = ResidualBlock()(x)
        return nn.Dense(10)(x)


def training_step_hlo(layers: int) -> dict[str, str]:
    """HLO text of the model's data-parallel adam step, before and after XLA's optimizations."""
    model = DeepMLP(layers)
    optimizer = optax.adam(1e-3)
    mesh = jax.make_mesh((8,), ("data",))

    def step(params, opt_state, x, labels):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(jax.lax.pmean(grads, "data"), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def replicated(leaf):
        return arg(leaf.shape, leaf.dtype, P())

    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32)))
    opt_state = jax.eval_shape(optimizer.init, params)
    train = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                  out_specs=(P(), P(), P())))
    lowered = train.lower(jax.tree.map(replicated, params), jax.tree.map(replicated, opt_state),
                          arg((64, 32), jnp.float32, P("data")), arg((64,), jnp.int32, P("data")))
    return {"before optimizations": lowered.as_text(dialect="hlo", debug_info=True),
            "after optimizations": lowered.compile().as_text()}


def median_seconds(fns, reps: int) -> list[float]:
    """Median wall time of each of ``fns`` over ``reps`` rounds that call each once, in turn."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, seconds in zip(fns, times):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return [statistics.median(seconds) for seconds in times]


def benchmark(label: str, text: str, reps: int) -> list[str]:
    """Markdown table rows for one module."""
    module = hlo_tools.parse_module(text)
    hlo_tools.verify(module)
    if module.to_text() != text:
        raise SystemExit(f"{label}: hlo_tools does not print the module back byte for byte")
    if hlo_tools.parse_module(text, lazy_bodies=True).to_text() != text:
        raise SystemExit(f"{label}: a lazily parsed module does not print back byte for byte")
    xla_module = xla_bridge.xla_parse(text)
    rows = [
        ("parse", lambda: hlo_tools.parse_module(text), lambda: xla_bridge.xla_parse(text)),
        ("parse, lazy_bodies=True", lambda: hlo_tools.parse_module(text, lazy_bodies=True),
         lambda: xla_bridge.xla_parse(text)),
        ("print", module.to_text, lambda: xla_bridge.xla_print(xla_module)),
        ("print, regenerate=True", lambda: module.to_text(regenerate=True),
         lambda: xla_bridge.xla_print(xla_module)),
    ]
    lines = len(text.splitlines())
    out = []
    for operation, ours, xla in rows:
        ours_s, xla_s = median_seconds([ours, xla], reps)
        out.append(f"| {label} | {lines} | {operation} | {ours_s * 1e3:.2f} | {xla_s * 1e3:.2f} "
                   f"| {ours_s / xla_s:.3g}x |")
    return out


def main() -> None:
    use_cpu_devices(8)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="residual blocks in the model")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per operation")
    args = parser.parse_args()

    texts = training_step_hlo(args.layers)
    short = [label for label, text in texts.items() if len(text.splitlines()) < MIN_LINES]
    if short:
        raise SystemExit(f"modules under {MIN_LINES} lines ({', '.join(short)}): raise --layers")

    print(f"jax {jax.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{args.layers} blocks, median of {args.reps} runs\n")
    print("| module | lines | operation | hlo_tools (ms) | XLA (ms) | ours / XLA |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for label, text in texts.items():
        print("\n".join(benchmark(label, text, args.reps)))


if __name__ == "__main__":
    main()
