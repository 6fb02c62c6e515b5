"""`xla_passes.jax.jit`: passes before XLA's optimizations, in a real training loop with donation.

Each program style trains a small Flax-free MLP step (adam) for three steps twice, with
`jax.jit` and with `xla_passes.jax.jit(passes="weight-update-sharding{persistent=true}")`,
donating parameters and optimizer state. Checked: the losses and parameters (float noise of
a reduction in another order: 1e-6), that donated arguments are consumed and aliased, and
where the passes apply (the shard_map styles) that each device keeps 1/8 of the optimizer
state between steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_passes.jax

PASSES = "weight-update-sharding{persistent=true}"
SHAPES = {"w1": (64, 256), "b1": (256,), "w2": (256, 16)}
OPTIMIZER = optax.adam(1e-3)


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def _mesh():
    return jax.make_mesh((8,), ("data",))


def _data(mesh):
    rng = np.random.default_rng(1)
    batch = NamedSharding(mesh, P("data"))
    return (jax.device_put(rng.standard_normal((64, 64)).astype(np.float32), batch),
            jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), batch))


def _init(mesh):
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    return params, jax.device_put(OPTIMIZER.init(params), replicated)


def _update(params, state, grads):
    updates, state = OPTIMIZER.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def shard_map_step(mesh):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        grads = jax.lax.pmean(grads, "data")
        return *_update(params, state, grads), jax.lax.pmean(loss, "data")

    return jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P()))


def named_sharding_step(mesh):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        return *_update(params, state, grads), loss

    return step


def pmap_style_step(mesh):
    """What `jax.pmap(step, axis_name="data")` is made of since pmap became shard_map: the
    step sees one device's batch and means over the axis."""
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        grads, loss = jax.lax.pmean((grads, loss), "data")
        return *_update(params, state, grads), loss

    return jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P()),
                         check_vma=False)


STYLES = {"shard_map": (shard_map_step, True), "jit_named_sharding": (named_sharding_step, False),
          "pmap_style": (pmap_style_step, True)}


def _train(jitted, mesh, steps=3):
    params, state = _init(mesh)
    x, y = _data(mesh)
    losses = []
    for _ in range(steps):
        donated = params["w1"]
        params, state, loss = jitted(params, state, x, y)
        assert donated.is_deleted()  # the step took the buffer over
        losses.append(float(loss))
    return losses, params, state


@pytest.mark.parametrize("style", sorted(STYLES))
def test_training_equals_jax_jit_and_keeps_donation(style):
    build, sharded = STYLES[style]
    mesh = _mesh()
    step = build(mesh)
    expected = _train(jax.jit(step, donate_argnums=(0, 1)), mesh)
    ours = xla_passes.jax.jit(step, passes=PASSES, donate_argnums=(0, 1))
    got = _train(ours, mesh)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(expected[1:])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    mu = got[2][0].mu
    per_device = {k: mu[k].addressable_shards[0].data.shape for k in SHAPES}
    if sharded:  # the large state lives 1/8 per device; the parameters stay as the user gave them
        assert per_device["w1"] == (8, 256) and per_device["w2"] == (32, 16)
        assert got[1]["w1"].addressable_shards[0].data.shape == SHAPES["w1"]
        assert sum("sharded" in line for line in ours.reports) >= 2
    else:  # XLA's partitioner makes the collectives after the passes have run: nothing to shard
        assert per_device == SHAPES and not any("sharded" in line for line in ours.reports)


def test_lower_compiles_the_rewritten_program_with_its_donation():
    mesh = _mesh()
    step = shard_map_step(mesh)
    args = (*_init(mesh), *_data(mesh))
    plain = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().memory_analysis()
    lowered = xla_passes.jax.jit(step, passes=PASSES, donate_argnums=(0, 1)).lower(*args)
    assert "reduce_scatter" in lowered.as_text()
    ours = lowered.memory_analysis()
    state_bytes = 2 * sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    # every donated byte is still aliased; the state's 7/8 that moved off each device went with it
    assert ours.alias_size_in_bytes == plain.alias_size_in_bytes - state_bytes * 7 // 8
    assert ours.argument_size_in_bytes < plain.argument_size_in_bytes
    assert lowered.cost_analysis()["flops"] > 0


def test_jax_jit_of_a_plain_jax_jit_program_is_left_alone():
    """The rewritten lowering is a copy: a later plain `jax.jit` of the same function compiles
    JAX's own program (JAX caches lowerings)."""
    mesh = _mesh()
    step = shard_map_step(mesh)
    args = (*_init(mesh), *_data(mesh))
    xla_passes.jax.jit(step, passes=PASSES).lower(*args).compile()
    text = jax.jit(step).lower(*args).as_text()
    assert "reduce_scatter" not in text
