"""Steps that scan over stacked layers: a flax `nn.scan(nn.remat(Block))` Transformer in a shard_map
step, through every pass that rewrites collectives, at the flag and through `xla_passes.jax.jit`.

The scanned block's gradients are all-reduced inside a `while` body that the Shardy manual
computation calls (before XLA's optimizations) or that the partitioned module runs (at the hook).
Before the fix, `xla_passes.jax.jit` with `collective-fusion` handed XLA a tuple-shaped all-reduce
there, which it refuses ("Sharding is tuple-shaped but validation shape is not"). Every run here
must compile (strict: no fallback) and train as `jax.jit` does: 3 adamw steps, every parameter,
optimizer-state array and loss within float noise of a reordered sum (rtol 1e-5, atol 1e-6).
"""
from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_passes.jax
from few_compiles import initial_state

LAYERS, WIDTH, HEADS, VOCABULARY, SEQUENCE = 3, 32, 4, 64, 8
STEPS = 3
# collective-fusion runs the simplifier and every combiner
HOOK_PASSES = ["collective-fusion", "weight-update-sharding{threshold_bytes=0}"]
JIT_PASSES = ["collective-fusion", "weight-update-sharding{persistent=true,threshold_bytes=0}"]


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        # no projection biases: the key bias's exact gradient is 0 (softmax is the same when every
        # score of a query grows alike), so adam would turn rounding noise into lr-sized steps
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, use_bias=False)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x)))), None


class ScannedTransformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCABULARY, WIDTH)(tokens)
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                         length=LAYERS)
        x, _ = blocks()(x, None)
        return nn.Dense(VOCABULARY)(nn.LayerNorm()(x))


def _program(jit):
    """(step, arguments) of a data-parallel shard_map training step over 8 devices, compiled by `jit`."""
    model, tx = ScannedTransformer(), optax.adamw(1e-3)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss_fn(params, tokens, labels):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, tokens), labels).mean()

    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        updates, opt_state = tx.update(jax.lax.pmean(grads, "data"), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                             out_specs=(P(), P(), P())))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCABULARY, (16, SEQUENCE)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens[:1])
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return step, (*jax.device_put((params, initial_state(tx, params)), replicated), jax.device_put(tokens, batch),
                  jax.device_put(np.roll(tokens, -1, axis=1), batch))


def _train(step, args) -> list[np.ndarray]:
    params, opt_state, tokens, labels = args
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state, tokens, labels)
        losses.append(loss)
    return [np.asarray(leaf) for leaf in jax.tree.leaves((params, opt_state, losses))]


@pytest.fixture(scope="module")
def plain():
    jax.clear_caches()
    return _train(*_program(jax.jit))


def _assert_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("passes", HOOK_PASSES)
def test_at_the_flag(plain, passes):
    jax.clear_caches()
    with xla_passes.jax.enable(passes, strict=True):
        step, args = _program(jax.jit)
        assert "while" in step.lower(*args).compile().as_text()
        _assert_equal(_train(step, args), plain)
    jax.clear_caches()


@pytest.mark.parametrize("passes", JIT_PASSES)
def test_through_xla_passes_jax_jit(plain, passes):
    step, args = _program(partial(xla_passes.jax.jit, passes=passes, strict=True))
    lowered = step.lower(*args)
    assert "while" in lowered.as_text()
    assert step.reports or "weight-update-sharding" not in passes  # the pass saw the step
    _assert_equal(_train(step, args), plain)
