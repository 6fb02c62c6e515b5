"""`xla_passes.jax.jit`: passes before XLA's optimizations, in a real training loop with donation.

Each program style trains a small Flax-free MLP step (adam) for three steps twice, with
`jax.jit` and with `xla_passes.jax.jit(passes="weight-update-sharding{persistent=true}")`,
donating parameters and optimizer state. Checked: the losses and parameters (float noise of
a reduction in another order: 1e-6), that donated arguments are consumed and aliased, and
that each device keeps 1/8 of the optimizer state between steps (in the jit + NamedSharding
style through XLA's partitioner, which the pass's annotations ask to split it).
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_passes.jax
from xla_passes import HloPass, register_pass

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


STYLES = {"shard_map": shard_map_step, "jit_named_sharding": named_sharding_step, "pmap_style": pmap_style_step}


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
    build = STYLES[style]
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
    # The large state lives 1/8 per device; the parameters stay as the user gave them. With
    # jit + NamedSharding the pass annotates the state for XLA's partitioner, which splits it.
    assert per_device["w1"] == (8, 256) and per_device["w2"] == (32, 16)
    assert got[1]["w1"].addressable_shards[0].data.shape == SHAPES["w1"]
    assert sum("sharded" in line for line in ours.reports) >= 2


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


# -- when the passes' module cannot be used: one warning and JAX's own lowering, or an error under strict ------

@register_pass
class _Explode(HloPass):
    """Fails on every module."""

    name = "test-jit-explode"

    def run(self, module) -> bool:
        raise RuntimeError("deliberate failure in a test pass")


@register_pass
class _UnknownCustomCall(HloPass):
    """Hands back a module XLA cannot compile: the root goes through a custom call no backend has."""

    name = "test-jit-uncompilable"

    def run(self, module) -> bool:
        root = module.entry.root
        module.entry.set_root(module.entry.add_instruction(
            "custom-call", [root], root.shape, attrs={"custom_call_target": "xla_passes_test_no_such_target"}))
        return True


@register_pass
class _NegateRoot(HloPass):
    """A wrong rewrite that XLA compiles: the (array) root negated."""

    name = "test-jit-negate-root"

    def run(self, module) -> bool:
        root = module.entry.root
        module.entry.set_root(module.entry.add_instruction("negate", [root], root.shape))
        return True


def _double(x):
    return 2.0 * x + 1.0


@pytest.mark.parametrize("passes, message", [
    ("test-jit-explode", "RuntimeError: deliberate failure in a test pass"),
    ("test-jit-uncompilable", "xla_passes_test_no_such_target"),
])
def test_a_pass_that_fails_or_a_module_xla_refuses_falls_back_to_jax_s_lowering(caplog, passes, message):
    x = jnp.arange(8.0)
    with caplog.at_level("WARNING", logger="xla_passes"):
        np.testing.assert_array_equal(xla_passes.jax.jit(_double, passes=passes)(x), _double(x))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and passes in warnings[0] and message in warnings[0], warnings
    assert "JAX compiles its own lowering" in warnings[0]
    with pytest.raises(Exception, match=message):
        xla_passes.jax.jit(_double, passes=passes, strict=True)(x)


def test_check_catches_a_wrong_rewrite_and_keeps_jax_s_result(caplog, monkeypatch):
    x = jnp.arange(8.0)
    with caplog.at_level("WARNING", logger="xla_passes"):
        np.testing.assert_array_equal(xla_passes.jax.jit(_double, passes="test-jit-negate-root", check=True)(x),
                                      _double(x))
    assert any("computes something else than JAX's lowering" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("XLA_PASSES_CHECK", "1")  # the variable asks for it as at the hook
    with pytest.raises(xla_passes.PassError, match="computes something else"):
        xla_passes.jax.jit(_double, passes="test-jit-negate-root", strict=True)(x)
    monkeypatch.delenv("XLA_PASSES_CHECK")
    np.testing.assert_array_equal(xla_passes.jax.jit(_double, passes="test-jit-negate-root")(x), -_double(x))


def _batch_norm_step(mesh):
    """A shard_map step whose loss normalizes each device's batch: what distributed-batch-norm groups."""
    def step(w, x):
        def loss(w):
            h = x @ w
            mean = jnp.mean(h, axis=0)
            variance = jnp.mean((h - mean) ** 2, axis=0)
            return jnp.mean(((h - mean) * jax.lax.rsqrt(variance + 1e-5)) ** 2)
        value, grads = jax.value_and_grad(loss)(w)
        return jax.lax.pmean(value, "data"), jax.lax.pmean(grads, "data")

    return jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))


@pytest.mark.parametrize("options, reason", [
    ("group_size=3", "group_size=3 does not divide the 8 devices"),
    ("group_size=16", "group_size=16 does not divide the 8 devices"),
    ("group_size=99999999999999999999", "group_size=99999999999999999999 does not divide the 8 devices"),
    ("groups=0:0;1:1;2:2;3:3;4:4;5:5;6:6;7:7", "do not cover the 8 positions along the batch axis once each"),
    ("groups=0:1;2:3;4:5;6:9", "groups=0:1;2:3;4:5;6:9 do not cover the 8 positions"),
])
def test_a_named_pass_that_cannot_apply_warns_why_and_fails_under_strict(caplog, options, reason):
    """The reason is on the logger at the default level, not only in `.reports` (issue 24)."""
    mesh = _mesh()
    batch = jax.device_put(jnp.arange(256.0).reshape(64, 4) / 100, NamedSharding(mesh, P("data")))
    step, args = _batch_norm_step(mesh), (jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P())), batch)
    passes = f"distributed-batch-norm{{{options}}}"
    with caplog.at_level("WARNING", logger="xla_passes"):
        got = xla_passes.jax.jit(step, passes=passes)(*args)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "distributed-batch-norm: unchanged: " in warnings[0] and reason in warnings[0]
    np.testing.assert_array_equal(got[0], jax.jit(step)(*args)[0])
    with pytest.raises(xla_passes.PassError, match=reason):
        xla_passes.jax.jit(step, passes=passes, strict=True)(*args)


def _repeat(x, n):
    for _ in range(n):  # n must be static: a Python loop
        x = 2.0 * x
    return x


@pytest.mark.parametrize("jit_kwargs, call", [
    ({"static_argnums": (-1,)}, lambda f, x, n: f(x, n)),
    ({"static_argnames": ("n",)}, lambda f, x, n: f(x, n)),
    ({"static_argnames": "n"}, lambda f, x, n: f(x, n=n)),
    ({"static_argnums": (1,)}, lambda f, x, n: f(x, n=n)),
    ({"static_argnums": 1}, lambda f, x, n: f(x, n)),
], ids=["negative number", "name given by position", "name", "number given by keyword", "number"])
def test_static_arguments_are_taken_as_jax_jit_takes_them(jit_kwargs, call):
    """Drop-in for `jax.jit` (issue 24): static_argnums and static_argnames complete each other
    from the signature, and a negative number counts from the last argument."""
    x = jnp.arange(4.0)
    jitted = xla_passes.jax.jit(_repeat, passes="dce", **jit_kwargs)
    for n in (2, 3, 2):
        np.testing.assert_array_equal(call(jitted, x, n), call(jax.jit(_repeat, **jit_kwargs), x, n))


def test_a_scan_over_stacked_layers_in_shard_map_compiles_with_collective_fusion():
    """The all-reduces of a `lax.scan` body inside a shard_map run in a while body that the
    manual computation calls, where XLA refuses tuple-shaped all-reduces: they combine into a flat
    buffer as in the shard_map body itself (before: "Sharding is tuple-shaped but validation shape
    is not"), and the steps equal `jax.jit`'s."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = {"w_in": rng.standard_normal((16, 64)).astype(np.float32) / 4,
              "layers": {"w": rng.standard_normal((4, 64, 64)).astype(np.float32) / 8,
                         "b": np.zeros((4, 64), np.float32), "g": np.ones((4, 64), np.float32)},
              "w_out": rng.standard_normal((64, 10)).astype(np.float32) / 8}

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w_in"])

        @jax.checkpoint
        def body(h, layer):
            return h + jax.nn.gelu(h @ layer["w"] + layer["b"]) * layer["g"], None

        h, _ = jax.lax.scan(body, h, p["layers"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ p["w_out"]), y[:, None], axis=1))

    tx = optax.adam(1e-3)

    def step(p, o, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, o = tx.update(jax.lax.pmean(grads, "d"), o, p)
        return optax.apply_updates(p, updates), o, jax.lax.pmean(loss, "d")

    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P(), P()))
    x = jax.device_put(rng.standard_normal((16, 16)).astype(np.float32), NamedSharding(mesh, P("d")))
    y = jax.device_put(rng.integers(0, 10, 16).astype(np.int32), NamedSharding(mesh, P("d")))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    o = tx.init(p)
    rewritten = xla_passes.jax.jit(step, passes="collective-fusion", strict=True)
    assert "while" in rewritten.lower(p, o, x, y).as_text()
    for got, want in zip(jax.tree.leaves(rewritten(p, o, x, y)), jax.tree.leaves(jax.jit(step)(p, o, x, y))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_combining_mixed_precision_gradients_changes_no_bit():
    """bf16 compute with f32 master weights: JAX all-reduces the bf16 cotangents, which XLA sums
    in f32 and, by its default excess precision, from the unrounded f32 values. In a flat buffer it
    would add the rounded ones (0.3% of a gradient): the combiner leaves those all-reduces alone,
    and every gradient is bit-equal to `jax.jit`'s."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = {"c1": rng.standard_normal((3, 3, 3, 16)).astype(np.float32) / 5, "b1": np.zeros(16, np.float32),
              "c2": rng.standard_normal((3, 3, 16, 32)).astype(np.float32) / 12,
              "d": rng.standard_normal((32, 10)).astype(np.float32) / 6}

    def loss_fn(p, x, y):
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        dn = ("NHWC", "HWIO", "NHWC")
        h = jax.nn.relu(jax.lax.conv_general_dilated(x.astype(jnp.bfloat16), p["c1"], (1, 1), "SAME",
                                                     dimension_numbers=dn) + p["b1"])
        h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn))
        logits = (jnp.mean(h, axis=(1, 2)) @ p["d"]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    grads = jax.shard_map(lambda p, x, y: jax.lax.pmean(jax.grad(loss_fn)(p, x, y), "d"), mesh=mesh,
                          in_specs=(P(), P("d"), P("d")), out_specs=P())
    x = jax.device_put(rng.standard_normal((16, 8, 8, 3)).astype(np.float32), NamedSharding(mesh, P("d")))
    y = jax.device_put(rng.integers(0, 10, 16).astype(np.int32), NamedSharding(mesh, P("d")))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    want = jax.jit(grads)(p, x, y)
    for passes in ("all-reduce-combiner", "collective-fusion"):
        got = xla_passes.jax.jit(grads, passes=passes, strict=True)(p, x, y)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{passes}: {name}")
