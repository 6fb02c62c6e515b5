"""Regression: weight-update-sharding at the JAX flag on weights whose first dimension that 8
divides is not their most major one (conv kernels `[kh, kw, cin, cout]`, embeddings `[100, 64]`).

At the hook XLA has laid the module out, and its runtime reduce-scatters and all-gathers
contiguous chunks of a buffer; a split of such a dimension moved the wrong elements (Keras
ResNet50's 3x3 and 7x7 kernels came out about twice their size after one step). Each case is
the issue's reproduction: the step with the pass must give the plain step's numbers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import xla_passes.jax

SHAPES = [(3, 3, 16, 16), (7, 7, 3, 64), (3, 3, 3, 64), (1, 1, 8, 40), (1, 1, 16, 16), (5, 5, 16, 8),
          (100, 64), (16, 16, 8, 8)]


def _step(w, m, x):
    grad = jax.grad(lambda w: jnp.sum(jnp.einsum("b...,...->...", x, w) ** 2))(w)
    m = 0.9 * m + grad
    return w - 0.01 * m, m


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_momentum_step_equals_the_plain_one(shape, caplog):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    w, m = (jax.device_put(rng.standard_normal(shape).astype(np.float32), replicated) for _ in range(2))
    x = jax.device_put(rng.standard_normal((8,) + shape).astype(np.float32), batch)

    def compiled():
        return jax.jit(_step, in_shardings=(replicated, replicated, batch), out_shardings=(replicated, replicated))

    expected = compiled()(w, m, x)
    jax.clear_caches()
    with caplog.at_level("INFO", logger="xla_passes"), xla_passes.jax.enable("weight-update-sharding", strict=True):
        got = compiled()(w, m, x)
    jax.clear_caches()
    assert any("weight-update-sharding: sharded" in r.getMessage() for r in caplog.records), caplog.text
    for a, b in zip(got, expected):  # the update is elementwise: the rewrite changes no arithmetic
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
