"""Test setup and references that compile one program each, not one per operation.

JAX runs an operation outside `jit` as a program of its own, compiled for each operation, shape and dtype, and
again after `jax.clear_caches()`, which the tests that switch passes call between runs. An optimizer's `init` or
`update` run op by op compiles a program per kind of state leaf, and copies of a tree per device one per leaf:
together more compiles than the training step the test is about. Here each is one jitted program, and the copies
are NumPy's.
"""
from __future__ import annotations

import jax
import numpy as np
import optax

from support import DEVICES


def initial_state(optimizer, params):
    """`optimizer.init(params)`."""
    return jax.jit(optimizer.init)(params)


def optimizer_step(optimizer, grads, state, params):
    """(new params, new state): `optimizer.update(grads, state, params)` applied to `params`."""
    def step(grads, state, params):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)(grads, state, params)


def per_device_copies(tree, devices: int = DEVICES):
    """Every array of `tree` stacked `devices` times along a new leading axis, on the host (a pmap's replicated
    arguments)."""
    return jax.tree.map(lambda a: np.stack([np.asarray(a)] * devices), tree)
