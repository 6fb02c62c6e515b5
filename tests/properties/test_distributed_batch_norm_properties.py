"""distributed-batch-norm at the flag, property-based: the step equals JAX's own grouped batch norm.

Hypothesis draws Flax convnets (one to three Conv + BatchNorm layers, optionally two more of the
last one's channels and kernel stacked in an `nn.scan` (a `lax.scan`), its body `nn.remat`ed
(`jax.checkpoint`) or not, optionally a Dense + BatchNorm, 1 to 6 channels, 1x1 to 3x3 kernels,
strides 1 and 2, 2x2 to 7x7 images, one to three examples per device, both variance forms) and
runs each one step at JAX's compile hook
(`xla_passes.jax.enable("distributed-batch-norm{group_size=k}", strict=True)`) on 8 CPU devices,
with k of 2 or 4, in three program styles:

* `shard_map`, per-device batch norm (`axis_name=None`): the loss and gradients averaged over the
  devices, each device's own gradients and new batch statistics;
* `jit` with `NamedSharding` (XLA's partitioner synchronizes batch norm over every device), a full
  sgd+momentum or adam step: the loss, the new parameters and optimizer state, the moving averages;
* `jax.pmap` with `BatchNorm(axis_name="batch")` over all 8 devices (flax's imagenet example), the
  same optimizer step on the pmeaned gradients, every output per device.

The reference is JAX's grouped batch norm: the same model with `BatchNorm(axis_name="members")`
in a `shard_map` over a (8/k, k) mesh, its gradients put through the same optimizer and its
per-device statistics averaged over the groups for the jit style (each device keeps its group's
in the pmap style). Small counts (one example of
2x2 pixels: 4 elements) make the hook's folded constants ambiguous (0.5 is both a number and
2/4), which the pass must solve, not guess.

Equal means within rtol 1e-4 and atol 1e-5 of the reference computed in float64, plus four times
the float32 reference's own error there: the grouped sums are added in another order than JAX's,
and where a statistic has four elements `rsqrt(var + eps)` magnifies that (one such case, found by
the long profile, is pinned with `@example`). The pass may
refuse a step (XLA's own then runs): the plugin must log the reason, and the step must then
equal the plain one. It may refuse any step with a scan (whose batch norms run in a while body).
It refuses one example per device in the shard_map style (XLA drops the
unit batch dimension at the hook, and a statistic over one example's pixels is then a per-example
pooling), which hypothesis draws too; in the jit and pmap styles batch norm sums the statistics
over the devices, and those it groups. In the pmap style the images are the arguments a
convolution reads, and XLA computes a 1x1 one as a dot: with a 1x1 first layer it may refuse.

Run: `pytest tests/properties/test_distributed_batch_norm_properties.py` (profile `ci`: derandomized, the
example counts below); `HYPOTHESIS_PROFILE=long` tries 10 times as many, randomly.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import event, example, given, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from few_compiles import initial_state, optimizer_step, per_device_copies
import xla_passes.jax
from wus_properties import examples

RTOL, ATOL = 1e-4, 1e-5
CLASSES = 3
STACKED_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Case:
    layers: tuple[tuple[int, int, int], ...]   # (features, kernel size, stride) of each Conv + BatchNorm
    dense_norm: bool                            # a Dense + BatchNorm after the pooling
    fast_variance: bool
    image: int
    batch_per_device: int
    group_size: int
    style: str                                  # "shard_map", "jit" or "pmap"
    optimizer: str                              # the jit and pmap styles': "sgd" or "adam"
    stack: str                                  # "none", or the stacked layers': "scan", "checkpointed scan"


@st.composite
def cases(draw, stacks=("none",)) -> Case:
    layers = tuple(draw(st.tuples(st.integers(1, 6), st.integers(1, 3), st.sampled_from([1, 2])))
                   for _ in range(draw(st.integers(1, 3))))
    return Case(layers, draw(st.booleans()), draw(st.booleans()), draw(st.integers(2, 7)), draw(st.integers(1, 3)),
                draw(st.sampled_from([2, 4])), draw(st.sampled_from(["shard_map", "jit", "pmap"])),
                draw(st.sampled_from(["sgd", "adam"])), draw(st.sampled_from(stacks)))


def _batch_norm(case: Case, axis_name: str | None) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=axis_name,
                        use_fast_variance=case.fast_variance)


class StackedLayer(nn.Module):
    """A Conv + BatchNorm layer that keeps its input's shape, as `nn.scan` runs it."""

    case: Case
    axis_name: str | None

    @nn.compact
    def __call__(self, x, _):
        kernel = self.case.layers[-1][1]
        conv = nn.Conv(x.shape[-1], (kernel, kernel), use_bias=False)
        return nn.relu(_batch_norm(self.case, self.axis_name)(conv(x))), None


class Net(nn.Module):
    case: Case
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        for features, kernel, stride in self.case.layers:
            conv = nn.Conv(features, (kernel, kernel), strides=(stride, stride), use_bias=False)
            x = nn.relu(_batch_norm(self.case, self.axis_name)(conv(x)))
        if self.case.stack != "none":
            layer = nn.remat(StackedLayer) if self.case.stack == "checkpointed scan" else StackedLayer
            stacked = nn.scan(layer, variable_axes={"params": 0, "batch_stats": 0}, split_rngs={"params": True},
                              length=STACKED_LAYERS)
            x, _ = stacked(self.case, self.axis_name)(x, None)
        x = x.mean(axis=(1, 2))
        if self.case.dense_norm:   # no bias before a batch norm: its gradient is 0 up to float noise, which adam
            # would turn into steps of its learning rate
            x = nn.relu(_batch_norm(self.case, self.axis_name)(nn.Dense(4, use_bias=False)(x)))
        return nn.Dense(CLASSES)(x)


def _loss(model, params, stats, images, labels):
    logits, updates = model.apply({"params": params, "batch_stats": stats}, images, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates["batch_stats"]


def _inputs(case: Case):
    model = Net(case)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, case.image, case.image, 3)))
    rng = np.random.default_rng(0)
    images = rng.standard_normal((8 * case.batch_per_device, case.image, case.image, 3)).astype(np.float32) * 2 + 0.5
    labels = rng.integers(0, CLASSES, 8 * case.batch_per_device).astype(np.int32)
    return variables["params"], variables["batch_stats"], images, labels


def _grouped_reference(case: Case, params, stats, images, labels):
    """JAX's grouped batch norm: loss and gradients averaged over the devices, per-device statistics."""
    k = case.group_size
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // k, k), ("groups", "members"))
    axes, batch = ("groups", "members"), P(("groups", "members"))
    model = Net(case, axis_name="members")

    def step(params, stats, images, labels):
        (loss, new_stats), grads = jax.value_and_grad(functools.partial(_loss, model), has_aux=True)(
            params, stats, images, labels)
        stack = functools.partial(jax.tree.map, lambda a: a[None])
        return jax.lax.pmean(loss, axes), jax.lax.pmean(grads, axes), stack(grads), stack(new_stats)

    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), batch, batch), out_specs=(P(), P(), batch, batch),
                         check_vma=False)
    return jax.jit(step)(params, stats, *jax.device_put((images, labels), NamedSharding(mesh, batch)))


def _shard_map_step(case: Case):
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    model = Net(case)

    def step(params, stats, images, labels):
        (loss, new_stats), grads = jax.value_and_grad(functools.partial(_loss, model), has_aux=True)(
            params, stats, images, labels)
        stack = functools.partial(jax.tree.map, lambda a: a[None])
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data"), stack(grads), stack(new_stats)

    return mesh, jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=(P(), P(), P("data"), P("data")), check_vma=False)


def _optimizer(case: Case):
    # adam's eps at 1e-4: a gradient that is zero in exact arithmetic (the scale of a BatchNorm that
    # another BatchNorm follows) is float noise, which adam's first step turns into a step of the
    # learning rate's size at the default eps, whatever computes it
    return optax.sgd(0.1, momentum=0.9) if case.optimizer == "sgd" else optax.adam(1e-2, eps=1e-4)


def _jit_step(case: Case):
    model, tx = Net(case), _optimizer(case)

    def step(params, stats, opt_state, images, labels):
        (loss, new_stats), grads = jax.value_and_grad(functools.partial(_loss, model), has_aux=True)(
            params, stats, images, labels)
        changes, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, changes), new_stats, opt_state

    return step


def _pmap_step(case: Case):
    model, tx = Net(case, axis_name="batch"), _optimizer(case)

    def step(params, stats, opt_state, images, labels):
        (loss, new_stats), grads = jax.value_and_grad(functools.partial(_loss, model), has_aux=True)(
            params, stats, images, labels)
        changes, opt_state = tx.update(jax.lax.pmean(grads, "batch"), opt_state, params)
        return jax.lax.pmean(loss, "batch"), optax.apply_updates(params, changes), new_stats, opt_state

    return step


def _at_the_flag(step, args, passes: str, style: str):
    """The step compiled with the pass at the hook, and what the plugin logged about it."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("xla_passes")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with xla_passes.jax.enable(passes, strict=True):
            if style == "pmap":
                got = jax.pmap(lambda *a: step(*a), axis_name="batch")(*args)
            else:
                got = jax.jit(lambda *a: step(*a)).lower(*args).compile()(*args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return got, [line for line in lines if "jit__lambda" in line or (style == "pmap" and "jit__fun" in line)]


def _expected(case: Case, params, stats, opt_state, images, labels):
    """What the step must give: JAX's grouped batch norm, through the same optimizer (jit style)."""
    loss, grads, device_grads, device_stats = _grouped_reference(case, params, stats, images, labels)
    if case.style == "shard_map":
        return loss, grads, device_grads, device_stats
    new_params, new_opt_state = optimizer_step(_optimizer(case), grads, opt_state, params)
    if case.style == "pmap":
        return (*per_device_copies((loss, new_params)), device_stats, per_device_copies(new_opt_state))
    return loss, new_params, jax.tree.map(lambda a: np.asarray(a).mean(axis=0), device_stats), new_opt_state


def _assert_close(got, want32, want64, what: str) -> None:
    """Within RTOL/ATOL of the float64 reference, plus four times the float32 reference's own error:
    as accurate as JAX's grouped batch norm in float32 (whose error grows large where a statistic
    has four elements)."""
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want32), jax.tree.leaves(want64), strict=True):
        a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
        bound = ATOL + RTOL * np.abs(c) + 4 * np.abs(b - c)
        worst = np.max(np.abs(a - c) - bound, initial=-1.0)
        assert worst <= 0, f"{what}: {np.sum(np.abs(a - c) > bound)} of {a.size} elements beyond the bound, " \
                           f"by up to {worst:.3g}"


def _in_float64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(np.asarray(a).dtype, np.floating)
                        else np.asarray(a), tree)


@examples(12)
@given(case=cases())
@example(case=Case(layers=((1, 1, 1), (1, 1, 1)), dense_norm=True, fast_variance=True, image=6, batch_per_device=2,
                   group_size=2, style="shard_map", optimizer="sgd", stack="none"))
def test_at_the_flag_equals_jax_grouped_batch_norm(case):
    _check_at_the_flag(case)


@examples(3)
@given(case=cases(stacks=("scan", "checkpointed scan")))
def test_scanned_layers_at_the_flag_equal_jax_grouped_batch_norm_or_plain(case):
    """Batch norms in a `lax.scan` body: grouped like the others, or the step refused whole."""
    event(f"stacked layers: {case.stack}")
    _check_at_the_flag(case)


def _check_at_the_flag(case: Case) -> None:
    params, stats, images, labels = _inputs(case)
    passes = f"distributed-batch-norm{{group_size={case.group_size}}}"
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    opt_state = initial_state(_optimizer(case), params)
    want32 = _expected(case, params, stats, opt_state, images, labels)
    with jax.enable_x64(True):
        want64 = _in_float64(_expected(case, *_in_float64((params, stats, opt_state, images)), labels))
    batch = jax.device_put((images, labels), NamedSharding(mesh, P("data")))
    if case.style == "shard_map":
        step = _shard_map_step(case)[1]
        args = (params, stats, *batch)
    elif case.style == "pmap":
        step = _pmap_step(case)
        args = (*per_device_copies((params, stats, opt_state)),
                *(np.reshape(a, (8, case.batch_per_device, *np.shape(a)[1:])) for a in (images, labels)))
    else:
        step = _jit_step(case)
        args = (params, stats, opt_state, *batch)
    got, outcomes = _at_the_flag(step, args, passes, case.style)
    changed = any("changed by distributed-batch-norm" in line for line in outcomes)
    if changed:
        event(f"{case.style}: grouped")
        _assert_close(got, want32, want64, f"{case}: at the flag against JAX's grouped batch norm")
    else:
        reasons = [line.split("unchanged: ", 1)[1] for line in outcomes if ": unchanged: " in line]
        assert reasons, outcomes   # a refusal says why
        one_example = case.batch_per_device == 1 and case.style == "shard_map"
        # XLA computes a 1x1 convolution as a dot: then no convolution reads a pmap step's images
        no_convolution = case.style == "pmap" and case.layers[0][1] == 1 and "no entry parameter feeding a " \
            "convolution's input" in reasons[0]
        assert one_example or no_convolution or case.stack != "none", f"{case}: refused: {reasons[0]}"
        event(f"{case.style}: refused: {reasons[0].split(':')[0]}")
        plain = jax.pmap(step, axis_name="batch")(*args) if case.style == "pmap" else jax.jit(step)(*args)
        _assert_close(got, plain, plain, f"{case}: refused, so XLA's own step")
