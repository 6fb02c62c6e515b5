"""weight-update-sharding at the flag shards every weight of a Dense model in each program style.

With `jax.jit` + `NamedSharding`, XLA partitions the program itself: it computes a Dense
kernel's gradient transposed and fuses the transpose into the update, which the pass undoes by
transposing the local gradient before its all-reduce. Each case trains three donated steps with
and without the pass (XLA's defaults otherwise: its own combiner on) and asserts that the
numbers are equal and that the pass sharded every weight.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_passes.jax
from few_compiles import initial_state, per_device_copies

OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "momentum": lambda: optax.sgd(0.1, momentum=0.9),
              "adam": lambda: optax.adam(1e-3), "adamw": lambda: optax.adamw(1e-3),
              # Per-tensor norms (LAMB's trust ratios through calls of jnp.linalg.norm) and a global one.
              "lamb": lambda: optax.lamb(1e-3), "lars": lambda: optax.lars(1e-3),
              "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
              # Factored second moments: every kernel is at least 16 in both dimensions.
              "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=16)}
SHAPES = {"w1": (32, 256), "b1": (256,), "w2": (256, 16)}


def _loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


def _steps(optimizer, style, loss=_loss):
    mesh = jax.make_mesh((8,), ("data",))

    def update(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def global_step(params, state, x, y):
        return update(params, state, jax.grad(loss)(params, x, y))

    def local_step(params, state, x, y):
        return update(params, state, jax.lax.pmean(jax.grad(loss)(params, x, y), "data"))

    if style == "jit_named_sharding":
        return mesh, global_step
    return mesh, jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=(P(), P()), check_vma=style == "shard_map")


def _train(step, mesh, optimizer, passes, caplog):
    rng = np.random.default_rng(0)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
    # The state is made from the unplaced parameters: adafactor's init broadcasts zeros like them,
    # which JAX refuses for arrays on an explicit mesh outside a mesh context.
    params, state = jax.device_put((params, initial_state(optimizer, params)), replicated)
    x = jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), batch)
    y = jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), batch)
    jax.clear_caches()
    caplog.clear()
    with xla_passes.jax.enable(passes or "dce", strict=True):
        compiled = jax.jit(step, donate_argnums=(0, 1))
        for _ in range(3):
            params, state = compiled(params, state, x, y)
    jax.clear_caches()
    return params, state, [r.getMessage() for r in caplog.records if "weight-update-sharding: " in r.getMessage()]


@pytest.mark.parametrize("style", ["jit_named_sharding", "shard_map", "pmap_style"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_weight_is_sharded_and_the_numbers_are_equal(name, style, caplog):
    caplog.set_level("INFO", logger="xla_passes")
    optimizer = OPTIMIZERS[name]()
    mesh, step = _steps(optimizer, style)
    expected = _train(step, mesh, optimizer, None, caplog)
    got = _train(step, mesh, optimizer, "weight-update-sharding", caplog)
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(expected[:2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    sharded = [line for line in got[2] if ": sharded " in line]
    assert len(sharded) == len(SHAPES), "\n".join(got[2])
    assert all(f"params['{k}']" in " ".join(sharded) for k in SHAPES)  # the report names each weight


def _mixed_precision_loss(params, x, y):
    """The loss computed in bfloat16 from float32 master weights (the gradients come back float32)."""
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    out = jnp.tanh(x.astype(jnp.bfloat16) @ low["w1"] + low["b1"]) @ low["w2"]
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _multisteps(**options):
    return optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2, **options)


def _sharded_and_equal(optimizer, style, loss, caplog):
    """Train plainly and with the pass; assert equal numbers; return the pass's report lines."""
    caplog.set_level("INFO", logger="xla_passes")
    mesh, step = _steps(optimizer, style, loss)
    expected = _train(step, mesh, optimizer, None, caplog)
    got = _train(step, mesh, optimizer, "weight-update-sharding", caplog)
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(expected[:2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    return got[2]


@pytest.mark.parametrize("style", ["jit_named_sharding", "shard_map", "pmap_style"])
@pytest.mark.parametrize("loss", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["adam", "multisteps"])
def test_gradient_accumulation_and_mixed_precision(name, loss, style, caplog):
    """optax.MultiSteps computes the inner update every step and selects it (`jnp.where`) on the
    last micro-step, the accumulator elementwise in the gradient: every weight shards (its
    accumulator too). A bfloat16 loss from float32 master weights hands the all-reduce float32
    gradients (XLA:CPU promotes a bfloat16 all-reduce): every weight shards, Adam's kernels under
    jit + NamedSharding too, whose gradients XLA converts to bfloat16 after the all-reduce and
    transposes inside the update's fusions (the pass moves the transpose before the all-reduce,
    through the convert). The runs below give identical numbers with and without the pass, so
    the float32 bounds hold for the bfloat16 loss too."""
    optimizer = _multisteps() if name == "multisteps" else OPTIMIZERS[name]()
    report = _sharded_and_equal(optimizer, style, _mixed_precision_loss if loss == "bfloat16" else _loss, caplog)
    sharded = [line for line in report if ": sharded " in line]
    assert len(sharded) == len(SHAPES), "\n".join(report)
    if name == "multisteps":
        assert all("state.acc_grads[" in line for line in sharded)  # the accumulator is sharded with the weight


@pytest.mark.parametrize("style", ["jit_named_sharding", "shard_map", "pmap_style"])
def test_multisteps_skipping_updates_keeps_weights_whose_update_is_in_a_conditional(style, caplog):
    """With a `should_skip_update_fn` MultiSteps runs its update in a `lax.cond` on whether the
    gradients are finite, which XLA keeps: the gradient is handed to the conditional in a tuple with
    the whole optimizer state, and the update runs in its branch computations, which the pass does
    not enter. Every weight stays replicated, the report names the conditional (under jit +
    NamedSharding with jax 0.10 the kernels' transposed gradients stop at the transposes first),
    and the numbers are equal."""
    report = _sharded_and_equal(_multisteps(should_skip_update_fn=optax.skip_not_finite), style, _loss, caplog)
    assert not [line for line in report if ": sharded " in line], "\n".join(report)
    entering = [line for line in report if "enters %conditional" in line]
    transposed = [line for line in report if "with transpose" in line]
    assert len(entering) == len(SHAPES) - len(transposed) > 0, "\n".join(report)


@pytest.mark.parametrize("name", ["momentum", "adam", "lamb", "lars", "clip_adamw", "adafactor"])
def test_jax_pmap_with_replicated_parameters(name, caplog):
    """`jax.pmap` hands each device `[1, ...]` parameters: XLA's update fusion reshapes the state
    to the gradient's shape and back, which the pass moves out of the fusion (also out of the
    fusion after a norm's, which adds LAMB's and LARS's scaled update to the weight). Nothing in a
    pmap module says the parameters are equal on every device: `assume_replicated_parameters=true`."""
    caplog.set_level("INFO", logger="xla_passes")
    optimizer = OPTIMIZERS[name]()

    def step(params, state, x, y):
        grads = jax.lax.pmean(jax.grad(_loss)(params, x, y), "i")
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
    state = initial_state(optimizer, params)
    x = rng.standard_normal((8, 8, 32)).astype(np.float32)
    y = rng.standard_normal((8, 8, 16)).astype(np.float32)
    results = []
    for passes in ("dce", "weight-update-sharding{assume_replicated_parameters=true}"):
        jax.clear_caches()
        caplog.clear()
        with xla_passes.jax.enable(passes, strict=True):
            pmapped = jax.pmap(step, axis_name="i", donate_argnums=(0, 1))
            p, s = per_device_copies(params), per_device_copies(state)
            for _ in range(3):
                p, s = pmapped(p, s, x, y)
        results.append((p, s))
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    sharded = {r.getMessage() for r in caplog.records if "weight-update-sharding: sharded" in r.getMessage()}
    assert len(sharded) == len(SHAPES), caplog.text  # pmap compiles the step again for its own outputs


@pytest.mark.parametrize("style", ["jit_named_sharding", "shard_map", "pmap_style"])
@pytest.mark.parametrize("name", ["lamb", "lars", "adafactor", "clip_adamw"])
def test_through_xla_passes_jit_every_weight_is_sharded(name, style):
    """The same steps through `xla_passes.jax.jit`, which runs the pass on JAX's lowering: no
    `call-inliner` in the pipeline (LAMB's and LARS's norms are calls of `jnp.linalg.norm`), and
    Adafactor's row and column statistics as JAX lowers them (unit-dimension reshapes that XLA's
    simplifier would fold). In shard_map steps every weight is sharded; in jit + NamedSharding
    steps the pass annotates the optimizer state for XLA's partitioner (`persistent=true`), which
    the step hands back sharded and takes back so: every state array is split."""
    optimizer = OPTIMIZERS[name]()
    mesh, step = _steps(optimizer, style)
    persistent = style == "jit_named_sharding"
    passes = f"weight-update-sharding{{threshold_bytes=0{',persistent=true' if persistent else ''}}}"
    rng = np.random.default_rng(0)
    host = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}  # never donated
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    x = jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), batch)
    y = jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), batch)
    results = []
    for jitted in (jax.jit(step, donate_argnums=(0, 1)),
                   xla_passes.jax.jit(step, passes=passes, strict=True, donate_argnums=(0, 1))):
        jax.clear_caches()
        params, state = jax.device_put((host, initial_state(optimizer, host)), replicated)
        for _ in range(3):
            params, state = jitted(params, state, x, y)
        results.append((params, state))
    for a, b in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    report = [line for line in jitted.reports if line.startswith("weight-update-sharding: ")]
    sharded = " ".join(line for line in report if ": sharded " in line)
    if persistent:
        assert sharded and not [line for line in report if ": kept " in line], "\n".join(report)
        split = [leaf for leaf in jax.tree.leaves(results[1][1]) if not leaf.sharding.is_fully_replicated]
        assert len(split) == sharded.count(": sharded "), "\n".join(report)
    else:
        assert all(f"params['{k}']" in sharded for k in SHAPES), "\n".join(report)
