"""Cases and programs for tests/properties/test_collective_fusion_properties.py.

A `FusionCase` is one data-parallel training step on 8 CPU devices: a small MLP, convnet or
Transformer whose stacked layers run unrolled, in a `lax.scan` (optionally of a
`jax.checkpoint`ed body), in a `fori_loop` that indexes the stack, or each in a `lax.cond`; the
loss in float32, bfloat16 or float16 from float32 master weights; optionally int32, bool,
gathered and reduce-scattered metrics beside it; written as `shard_map` + `pmean`, `jax.jit` +
`NamedSharding` or `jax.pmap`. Every layer centres its activations over the devices (a synced
batch norm's mean), so that collectives run inside loop bodies and branches too.

The runs (`run_at_the_flag`, `run_through_jit`, `run_offline`) go to the worker process of
`wus_properties.Worker`, started with `XLA_FLAGS`: XLA's own CPU all-reduce combiner off, so
that the passes find the all-reduces one by one at the flag.
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from few_compiles import initial_state, per_device_copies
import hlo_tools
import xla_passes
import xla_passes.jax
from hlo_tools.xla import runner, xla_bridge

GROUP_SIZE = 8
PER_DEVICE_BATCH = 2
CLASSES = 4
FEATURES = 8      # of an MLP input and of a Transformer token; a convnet's images are IMAGE x IMAGE x 3
IMAGE = 4
TOKENS = 4
XLA_FLAGS = "--xla_disable_hlo_passes=cpu-all-reduce-combiner"

# Hypothesis starts from the first value of each: the ones the issues are about come first.
MODELS = ("convnet", "transformer", "mlp")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
CONTROLS = ("scan", "checkpointed scan", "fori_loop", "cond", "none")
OPTIMIZERS = ("adamw", "sgd", "momentum")
# The combiners add every sum's terms as the separate collectives do; the simplifier makes a sum
# of equal values a product (float rounding).
EXACT_PASSES = ("all-reduce-combiner", "collective-fusion{simplify=false}",
                "all-gather-combiner,reduce-scatter-combiner,all-reduce-combiner{threshold_bytes=64}")
ROUNDING_PASSES = ("collective-fusion", "all-reduce-simplifier")
# Equal up to float rounding in the loss's precision: within `atol` or, relative to the plain
# program's value, `rtol` (bfloat16 and float16: one unit in the last place).
TOLERANCE = {"float32": {"atol": 1e-6, "rtol": 1e-5}, "bfloat16": {"atol": 1e-6, "rtol": 2.0 ** -7},
             "float16": {"atol": 1e-6, "rtol": 2.0 ** -10}}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class FusionCase:
    """One training step; `metrics`: beside the loss the step returns how many examples the
    model got right (an int32 sum) and whether every logit is finite (a bool min), and in the
    shard_map and pmap styles the gathered per-example losses and predictions and the
    reduce-scattered gradients of the head and the layers' scales in the loss's dtype."""

    style: str
    model: str
    compute: str
    control: str
    layers: int
    width: int
    optimizer: str
    metrics: bool
    passes: str
    seed: int

    @property
    def exact(self) -> bool:
        return self.passes in EXACT_PASSES


@st.composite
def fusion_cases(draw, style: str) -> FusionCase:
    return FusionCase(style, draw(st.sampled_from(MODELS)), draw(st.sampled_from(COMPUTE_DTYPES)),
                      draw(st.sampled_from(CONTROLS)), draw(st.integers(2, 3)), 8 * draw(st.integers(1, 2)),
                      draw(st.sampled_from(OPTIMIZERS)), draw(st.booleans()),
                      draw(st.sampled_from(EXACT_PASSES + ROUNDING_PASSES)), draw(st.integers(0, 2**16)))


# --- the model --------------------------------------------------------------------------------------

def _init(case: FusionCase) -> dict:
    """Float32 master weights; the layers' stacked along a leading dimension."""
    rng = np.random.default_rng(case.seed)
    w, layers = case.width, case.layers

    def normal(fan_in, *shape):  # unit-scale outputs from unit-scale inputs
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    if case.model == "convnet":
        stem, block = normal(27, 3, 3, 3, w), {"w": normal(9 * w, layers, 3, 3, w, w)}
    elif case.model == "mlp":
        stem, block = normal(FEATURES, FEATURES, w), {"w": normal(w, layers, w, w)}
    else:
        stem, block = normal(FEATURES, FEATURES, w), {"qkv": normal(w, layers, w, 3 * w), "w": normal(w, layers, w, w)}
    block["b"] = rng.uniform(-0.1, 0.1, (layers, w)).astype(np.float32)
    block["scale"] = rng.uniform(0.5, 1.5, (layers, w)).astype(np.float32)
    return {"stem": stem, "block": block, "head": normal(w, w, CLASSES)}


def _example_shape(case: FusionCase) -> tuple[int, ...]:
    return {"mlp": (FEATURES,), "convnet": (IMAGE, IMAGE, 3), "transformer": (TOKENS, FEATURES)}[case.model]


def _conv(x, kernel):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _layer(case: FusionCase, h, p, axis: str | None):
    """One residual layer; its pre-activations centred by their mean over the devices' examples
    (the whole batch's in the named_sharding style, which XLA's partitioner all-reduces)."""
    if case.model == "convnet":
        z = _conv(h, p["w"])
    elif case.model == "mlp":
        z = h @ p["w"]
    else:
        q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
        attention = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / math.sqrt(case.width))
        z = jnp.einsum("bts,bsd->btd", attention, v) @ p["w"]
    mean = jnp.mean(z, axis=0)
    z = z - (mean if axis is None else jax.lax.pmean(mean, axis))
    return h + jnp.tanh(z * p["scale"] + p["b"])


def _layers(case: FusionCase, h, block: dict, axis: str | None):
    """The stacked layers applied in turn, in the case's control flow."""
    def layer(h, p):
        return _layer(case, h, p, axis)

    if case.control in ("scan", "checkpointed scan"):
        body = jax.checkpoint(layer) if case.control == "checkpointed scan" else layer
        return jax.lax.scan(lambda h, p: (body(h, p), None), h, block)[0]
    if case.control == "fori_loop":
        return jax.lax.fori_loop(0, case.layers, lambda i, h: layer(h, jax.tree.map(lambda a: a[i], block)), h)
    for i in range(case.layers):
        p = jax.tree.map(lambda a, i=i: a[i], block)
        if case.control == "cond":  # the weights alone decide: every device takes the same branch
            h = jax.lax.cond(jnp.sum(p["b"]) > 0, layer, lambda h, p: 2 * h - layer(h, p), h, p)
        else:
            h = layer(h, p)
    return h


def _logits(case: FusionCase, params: dict, x, axis: str | None):
    """The model in the case's compute dtype; float32 logits."""
    dtype = jnp.dtype(case.compute)
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    x = x.astype(dtype)
    h = jnp.tanh(_conv(x, params["stem"]) if case.model == "convnet" else x @ params["stem"])
    h = _layers(case, h, params["block"], axis)
    if case.model != "mlp":  # pool over pixels or tokens
        h = jnp.mean(h, axis=tuple(range(1, h.ndim - 1)))
    return (h @ params["head"]).astype(jnp.float32)


def _optimizer(name: str):
    return {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9),
            "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2)}[name]()


def _step_function(case: FusionCase):
    """(params, optimizer state, inputs, labels) -> (new params, new state, loss, metrics)."""
    optimizer = _optimizer(case.optimizer)
    axis = None if case.style == "named_sharding" else "data"

    def loss_fn(params, x, y):
        logits = _logits(case, params, x, axis)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.mean(losses), (logits, losses)

    def step(params, state, x, y):
        (loss, (logits, losses)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        metrics = {}
        if case.metrics:
            predictions = jnp.argmax(logits, axis=-1)
            correct, finite = jnp.sum(predictions == y), jnp.all(jnp.isfinite(logits))
            metrics = {"correct": correct, "finite": finite} if axis is None else {
                "correct": jax.lax.psum(correct, axis), "finite": jax.lax.pmin(finite, axis),
                "losses": jax.lax.all_gather(losses, axis, tiled=True),
                "predictions": jax.lax.all_gather(predictions, axis, tiled=True),
                "head": jax.lax.psum_scatter(grads["head"].astype(case.compute), axis, tiled=True),
                "scale": jax.lax.psum_scatter(grads["block"]["scale"].T.astype(case.compute), axis, tiled=True)}
        if axis is not None:
            grads, loss = jax.lax.pmean((grads, loss), axis)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, metrics

    return step


def _metric_specs(case: FusionCase) -> dict:
    """shard_map's out_specs of the metrics: each device's copy of the gathered values side by side."""
    if not case.metrics:
        return {}
    return {"correct": P(), "finite": P(), "losses": P("data"), "predictions": P("data"), "head": P("data"),
            "scale": P("data")}


def _mesh():
    """The devices in one "data" axis that XLA's partitioner shards by (jax 0.12's default,
    explicit axes, would make the step say how to shard its label gathers)."""
    return jax.make_mesh((GROUP_SIZE,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def compiled_step(case: FusionCase, jit=jax.jit, **jit_kwargs):
    """The step as its style writes it, under `jit` (`jax.jit` or `xla_passes.jax.jit`)."""
    step = _step_function(case)
    if case.style == "pmap":
        return jit(jax.pmap(step, axis_name="data"), **jit_kwargs)
    mesh = _mesh()
    if case.style == "shard_map":
        return jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                 out_specs=(P(), P(), P(), _metric_specs(case))), **jit_kwargs)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jit(step, in_shardings=(replicated, replicated, batch, batch), out_shardings=replicated, **jit_kwargs)


def step_arguments(case: FusionCase):
    """Weights and optimizer state equal on every device (pmap: one copy each), each device's
    own examples."""
    rng = np.random.default_rng(case.seed + 1)
    params = _init(case)
    state = initial_state(_optimizer(case.optimizer), params)
    x = rng.uniform(-1, 1, (GROUP_SIZE * PER_DEVICE_BATCH, *_example_shape(case))).astype(np.float32)
    y = rng.integers(0, CLASSES, GROUP_SIZE * PER_DEVICE_BATCH).astype(np.int32)
    if case.style == "pmap":
        params, state = per_device_copies((params, state), GROUP_SIZE)
        return params, state, x.reshape(GROUP_SIZE, PER_DEVICE_BATCH, *x.shape[1:]), y.reshape(GROUP_SIZE, -1)
    mesh = _mesh()
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return (*jax.device_put((params, state), replicated), *jax.device_put((x, y), batch))


# --- the three ways ---------------------------------------------------------------------------------

def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def collective_counts(text: str) -> dict[str, int]:
    """The collectives of a module's text (a combined one counts once)."""
    return {op: len(re.findall(rf" {op}(?:-start)?\(", text)) for op in COLLECTIVES}


_FLAT_ALL_REDUCE = re.compile(r" all-reduce\(%?[\w.-]*concatenate[\w.-]*\)")


@dataclasses.dataclass
class Run:
    """The step's outputs plainly and with the passes, and what the passes saw and made."""

    plain: list                # every output leaf
    rewritten: list
    before: dict[str, int]     # the collectives of the module the passes got
    after: dict[str, int]      # of the module they made
    control_flow: bool         # the module the passes got has a while loop or a conditional
    flat: bool = False         # the passes made an all-reduce of a flat buffer


def _has_control_flow(text: str) -> bool:
    return bool(re.search(r" (while|conditional)\(", text))


def run_at_the_flag(case: FusionCase) -> Run:
    """The step compiled plainly and with the passes at JAX's hook (strict: a pass error fails
    the compile); the collectives of XLA's final modules, the hook's passes having run late in
    XLA's pipeline."""
    args = step_arguments(case)
    jax.clear_caches()
    plain = compiled_step(case).lower(*args).compile()
    jax.clear_caches()
    try:
        with xla_passes.jax.enable(case.passes, strict=True):
            rewritten = compiled_step(case).lower(*args).compile()
    finally:
        jax.clear_caches()
    text = plain.as_text()
    return Run(_leaves(plain(*args)), _leaves(rewritten(*args)), collective_counts(text),
               collective_counts(rewritten.as_text()), _has_control_flow(text))


def run_through_jit(case: FusionCase) -> Run:
    """The step through `jax.jit` and through `xla_passes.jax.jit` (strict: a pass error or a
    module XLA refuses raises)."""
    args = step_arguments(case)
    jax.clear_caches()
    jitted = compiled_step(case, xla_passes.jax.jit, passes=case.passes, strict=True)
    lowered = jitted.lower(*args)
    text, rewritten = (xla_bridge.lowered_module_text(x) for x in (lowered.original, lowered))
    return Run(_leaves(compiled_step(case)(*args)), _leaves(jitted(*args)), collective_counts(text),
               collective_counts(rewritten), _has_control_flow(text), bool(_FLAT_ALL_REDUCE.search(rewritten)))


def run_offline(case: FusionCase) -> Run:
    """The lowered step rewritten by `run_passes`; both modules run by `runner.compare_modules`
    on the same global inputs, unless the passes left the module alone (no outputs then)."""
    args = step_arguments(case)
    jax.clear_caches()
    text = xla_bridge.lowered_module_text(compiled_step(case).lower(*args))
    module = hlo_tools.parse_module(text)
    changed = xla_passes.run_passes(module, xla_passes.parse_pipeline(case.passes))
    rewritten = module.to_text()
    outputs = ([], [])
    if changed:
        result, reference, _ = runner.compare_modules(rewritten, text, _leaves(args))
        outputs = (reference.outputs, result.outputs)
    return Run(*outputs, collective_counts(text), collective_counts(rewritten), _has_control_flow(text),
               bool(_FLAT_ALL_REDUCE.search(rewritten)))
