"""weight-update-sharding{persistent=true} on `jax.jit` + `NamedSharding` steps, through `xla_passes.jax.jit`.

Such a step has no collective when the passes see it: XLA's SPMD partitioner makes them later.
The pass annotates the optimizer state, and the update that reads it, as split over the data
axis, and the partitioner computes the update on 1/8 of each array. Each case trains three
donated steps with and without the pass and asserts: the state comes back split (1/8 per
device) and the next call takes it as it is; the weights stay replicated and donated; the peak
drops by at least half the state; the numbers equal plain's. Both kinds of mesh axes JAX has
(`Explicit`, which annotates every value, and `Auto`, which leaves the outputs to XLA and
donates through buffer donors), and a data x model mesh whose model axis splits the weights.

Adam divides by the root of its second moment: where a gradient is near 0, the partitioner's
other order of summation moves it by rounding and Adam turns that into a step of the learning
rate's size. The adam cases use `eps=1e-3`, which bounds that amplification; sgd with momentum
compares at float32 rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_passes.jax

PASSES = "weight-update-sharding{persistent=true,threshold_bytes=0}"
OPTIMIZERS = {"adam": lambda: optax.adam(1e-3, eps=1e-3), "momentum": lambda: optax.sgd(0.1, momentum=0.9),
              "lamb": lambda: optax.lamb(1e-3, eps=1e-3)}
SHAPES = {"w1": (32, 256), "b1": (256,), "w2": (256, 16)}


def _loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


def _setup(optimizer, axis_type, mesh_shape=(8,), weight_spec=P()):
    axes = ("data", "model")[:len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, axes, axis_types=(axis_type,) * len(axes))

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(0)
    weights = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
    spec_of = {s: weight_spec if len(s) == 2 else P() for s in SHAPES.values()}   # state arrays like weights

    def fresh():
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a), NamedSharding(mesh, spec_of.get(a.shape, P()))),
                            (weights, optimizer.init(weights)))

    batch = NamedSharding(mesh, P("data"))
    x = jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), batch)
    y = jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), batch)
    return step, fresh, x, y


def _train(compiled_call, fresh, x, y):
    params, state = fresh()
    for _ in range(3):
        params, state, loss = compiled_call(params, state, x, y)
    return params, state, loss


def _peak(compiled) -> int:
    memory = compiled.memory_analysis()
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def _per_device_bytes(tree) -> int:
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto],
                         ids=["explicit", "auto"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_is_split_and_the_numbers_are_equal(name, axis_type):
    optimizer = OPTIMIZERS[name]()
    step, fresh, x, y = _setup(optimizer, axis_type)
    plain = jax.jit(step, donate_argnums=(0, 1))
    ours = xla_passes.jax.jit(step, passes=PASSES, strict=True, donate_argnums=(0, 1))
    expected, got = _train(plain, fresh, x, y), _train(ours, fresh, x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    state_arrays = [a for a in jax.tree.leaves(got[1]) if a.ndim]
    assert state_arrays and all(a.sharding.spec == P("data") for a in state_arrays)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(got[0]))
    assert _per_device_bytes(got[1]) * 8 <= _per_device_bytes(expected[1]) + 8 * 4  # the step count stays whole
    reports = [line for line in ours.reports if ": sharded " in line]
    assert len(reports) == len(state_arrays), "\n".join(ours.reports)

    params, state = fresh()
    compiled_plain, compiled_ours = plain.lower(params, state, x, y).compile(), ours.lower(params, state, x, y).compile()
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state))
    assert _peak(compiled_ours) <= _peak(compiled_plain) - state_bytes // 2
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    assert compiled_ours.memory_analysis().alias_size_in_bytes >= weight_bytes + state_bytes // 8  # donation kept


def test_a_model_axis_stays_where_it_is():
    """On a data x model mesh whose model axis splits the kernels' second dimension, the state
    is split over the data axis as well, on the first dimension; the model axis stays."""
    optimizer = optax.sgd(0.1, momentum=0.9)
    step, fresh, x, y = _setup(optimizer, jax.sharding.AxisType.Explicit, (4, 2), P(None, "model"))
    plain = jax.jit(step, donate_argnums=(0, 1))
    ours = xla_passes.jax.jit(step, passes=PASSES, strict=True, donate_argnums=(0, 1))
    expected, got = _train(plain, fresh, x, y), _train(ours, fresh, x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    specs = {tuple(a.shape): a.sharding.spec for a in jax.tree.leaves(got[1]) if a.ndim}
    assert specs[(32, 256)] == P("data", "model") and specs[(256, 16)] == P("data", "model")
    assert specs[(256,)] == P("data")
    assert [a.sharding for a in jax.tree.leaves(got[0])] == [a.sharding for a in jax.tree.leaves(expected[0])]


def test_a_step_without_state_is_left_as_it_is():
    """Plain SGD has no optimizer state: nothing to keep split, and the module is not changed."""
    step, fresh, x, y = _setup(optax.sgd(0.1), jax.sharding.AxisType.Explicit)
    ours = xla_passes.jax.jit(step, passes=PASSES, strict=True, donate_argnums=(0, 1))
    params, state = fresh()
    lowered = ours.lower(params, state, x, y)
    assert lowered._lowered is lowered.original
    assert not [line for line in ours.reports if ": sharded " in line]
