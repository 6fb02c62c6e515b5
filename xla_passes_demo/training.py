"""Flax + Optax data-parallel training steps, and what their compiled programs cost.

One home for the model that the demo (`python -m xla_passes_demo`), the JAX
plugin tests (tests/workers/jax_plugin_worker.py, tests/workers/wus_worker.py) and the
benchmarks (benchmarks/plugin.py, benchmarks/weight_update_sharding.py) train,
and for the compile-and-measure steps they share, so that their numbers come
from the same program measured the same way.

Importing this module imports JAX but does not start its backends: callers set
the device count first (`hlo_tools.xla.xla_bridge.configure_cpu_devices`, or
`XLA_FLAGS=--xla_force_host_platform_device_count=8`).
"""
from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .dependencies import nn, optax

import hlo_tools
import xla_passes.jax
from hlo_tools.xla import xla_bridge
from hlo_tools.inspection.stats import module_stats

N_DEVICES = 8
MLP_WIDTHS = (256, 256, 256, 256, 256, 256, 128, 10)
INPUT_WIDTH = 64

# XLA's own all-reduce combiners, switched off per compile so that collective-fusion has work
# to do. The CPU pipeline's is "cpu-all-reduce-combiner"; other backends call theirs
# "all-reduce-combiner". Same as XLA_FLAGS=--xla_disable_hlo_passes=....
NO_XLA_COMBINER = {"xla_disable_hlo_passes": "all-reduce-combiner,cpu-all-reduce-combiner"}


class MLP(nn.Module):
    """Dense layers of `widths` with relu between them; the last width is the class count."""

    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


def _value_and_grad(model: nn.Module, params, images, labels):
    """The mean cross-entropy loss of the local batch and its gradient."""
    def loss_fn(p):
        logits = model.apply(p, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return jax.value_and_grad(loss_fn)(params)


def build_flax_training(widths: tuple[int, ...] = MLP_WIDTHS, *, optimizer=None,
                        pmean_each_gradient: bool = True, check_vma: bool = False,
                        donate: bool = True, batch_per_device: int = 32, jit=jax.jit):
    """A Flax MLP (Dense layers of `widths`) trained data parallel over 8 CPU devices.

    The step is shard_map under jit, with optax adam(1e-3) unless `optimizer`
    is given. By default each gradient is averaged with its own `lax.pmean` (a
    `pmean` of the whole tree, `pmean_each_gradient=False`, would already be one
    variadic all-reduce): one all-reduce per parameter, 16 for the default 8
    layers, plus one for the loss, unless a combiner merges them.
    `check_vma=False` keeps shard_map from adding its own reductions of the
    replicated parameters' gradients. The data are synthetic: standard normal
    inputs of width 64 and random labels, the same for every call.

    Returns `(step, (params, opt_state, images, labels))`; `step` (donating the
    parameters and optimizer state when `donate`) returns new ones and the loss.
    `jit` compiles the step: `jax.jit`, or `functools.partial(xla_passes.jax.jit, passes=...)`.
    """
    model = MLP(tuple(widths))
    optimizer = optimizer or optax.adam(1e-3)
    mesh = jax.make_mesh((N_DEVICES,), ("data",))

    def train_step(params, opt_state, images, labels):
        loss, grads = _value_and_grad(model, params, images, labels)
        grads = (jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads) if pmean_each_gradient
                 else jax.lax.pmean(grads, "data"))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                             out_specs=(P(), P(), P()), check_vma=check_vma),
               donate_argnums=(0, 1) if donate else ())

    @jax.jit
    def init(key):
        params = model.init(key, jnp.zeros((1, INPUT_WIDTH)))
        return params, optimizer.init(params)

    params, opt_state = jax.device_put(init(jax.random.key(0)), NamedSharding(mesh, P()))
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P("data"))
    images = jax.device_put(
        rng.standard_normal((N_DEVICES * batch_per_device, INPUT_WIDTH), dtype=np.float32), batch)
    labels = jax.device_put(rng.integers(0, widths[-1], N_DEVICES * batch_per_device).astype(np.int32), batch)
    return step, (params, opt_state, images, labels)


def build_local_gradients(widths: tuple[int, ...]):
    """The forward and backward pass of `build_flax_training`'s step alone: no averaging, no update.

    `flops(step) - flops(local gradients)` is what the gradient averaging and
    the optimizer update cost a device. Called as `(params, images, labels)`.
    """
    model = MLP(tuple(widths))
    mesh = jax.make_mesh((N_DEVICES,), ("data",))

    def local_gradients(params, images, labels):
        return _value_and_grad(model, params, images, labels)

    return jax.jit(jax.shard_map(local_gradients, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P()), check_vma=False))


def compile_step(fn, args, passes: str | None, *, compiler_options: dict | None = None,
                 dump_to: str | None = None, strict: bool = False):
    """A fresh compile of the jitted `fn` for `args`, with `passes` run by the JAX plugin.

    What `XLA_PASSES=passes` does when JAX starts, limited to this one compile.
    Returns `(compiled, seconds)`, where only XLA's `compile()` (our passes
    included) is timed.
    """
    if passes:
        xla_passes.jax.enable(passes, dump_to=dump_to, strict=strict)
    else:
        xla_passes.jax.disable()
    try:
        jax.clear_caches()
        lowered = fn.lower(*args)  # a fresh Lowered: each caches its one executable
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=compiler_options)
        return compiled, time.perf_counter() - start
    finally:
        xla_passes.jax.disable()


def use_cpu_devices(count: int) -> bool:
    """Set this process up as the demo and the benchmarks need it: `count` CPU devices, CPU only,
    and passes only in the compiles that ask for them (whatever `XLA_PASSES` says).

    Returns False when JAX's backends already started (too late to choose the device count).
    """
    if not xla_bridge.configure_cpu_devices(count):
        return False
    jax.config.update("jax_platforms", "cpu")
    xla_passes.jax.disable()
    return True


@contextlib.contextmanager
def hand_back_hook():
    """A pass hook that returns the module XLA gives it, bytes unchanged: what the hook API itself costs.

    XLA rebuilds its module from whatever a hook returns, which is where jaxlib 0.10.2 drops
    the module's buffer donation (`xla_bridge.hook_keeps_donation`) and where part of the
    plugin's compile time goes.
    """
    xla_bridge.register_pass_hook(bytes, name="xla_passes.hand_back", stage="pre_scheduler", platform="cpu")
    try:
        yield
    finally:
        xla_bridge.clear_pass_hook("xla_passes.hand_back", "pre_scheduler", "cpu")


def compiled_costs(compiled) -> dict[str, float]:
    """Per-device flops and bytes (XLA's cost analysis and memory stats of the compiled program).

    Keys: `flops`, `bytes accessed`, `argument`, `output`, `alias`, `temp` (bytes).
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    memory = compiled.memory_analysis()
    return {"flops": float(cost.get("flops", 0.0)), "bytes accessed": float(cost.get("bytes accessed", 0.0)),
            "argument": memory.argument_size_in_bytes, "output": memory.output_size_in_bytes,
            "alias": memory.alias_size_in_bytes, "temp": memory.temp_size_in_bytes}


def collective_counts(compiled) -> dict[str, int]:
    """How many of each collective the optimized program holds (`hlo_tools.inspection.stats`' counting)."""
    stats = module_stats(hlo_tools.parse_module(compiled.as_text()))
    return {summary.kind: summary.count for summary in stats.collective_summary()}


class ConvNet(nn.Module):
    """Two 3x3 SAME convolutions with relu, a global mean over the image, a Dense classifier."""

    features: int = 16
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(self.features, (3, 3))(x))
        x = nn.relu(nn.Conv(self.features, (3, 3))(x))
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def conv_gradients_hlo(image_size: int, batch: int = 2) -> tuple[str, list[np.ndarray]]:
    """`ConvNet`'s loss and gradients on one device: JAX's HLO (before XLA's optimizations), and inputs.

    The inputs are the initial parameters (in the module's parameter order), synthetic
    normal images `f32[batch, image_size, image_size, 3]` and labels.
    """
    model = ConvNet()
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, image_size, image_size, 3), dtype=np.float32)
    labels = rng.integers(0, model.classes, batch).astype(np.int32)
    params = model.init(jax.random.key(0), images)

    def loss_and_gradients(params, images, labels):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, images), labels).mean()

        return jax.value_and_grad(loss_fn)(params)

    text = jax.jit(loss_and_gradients).lower(params, images, labels).compiler_ir("hlo").as_hlo_text()
    return text, [np.asarray(leaf) for leaf in jax.tree.leaves(params)] + [images, labels]
