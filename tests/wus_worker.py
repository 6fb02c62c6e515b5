"""Worker for tests/test_weight_update_sharding_jax.py: an unmodified Flax + Optax data-parallel loop.

    python tests/wus_worker.py OPTIMIZER OUT.npz [--steps N]

Trains a small Flax MLP for N steps (shard_map under jit, batch split over 8 CPU
devices, gradients averaged with `lax.pmean`) and saves the losses and the final
parameters to OUT.npz. Nothing here imports `xla_passes`: whether
`weight-update-sharding` runs is decided by the XLA_PASSES environment variable
alone, which the JAX plugin reads when the backend starts.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

N_DEVICES = 8
WIDTHS = (128, 128, 10)  # Dense layers; input width 64

OPTIMIZERS = {
    "adam": lambda optax: optax.adam(1e-3),
    "momentum": lambda optax: optax.sgd(0.05, momentum=0.9),
}


def train(optimizer_name: str, steps: int) -> dict[str, np.ndarray]:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in WIDTHS[:-1]:
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(WIDTHS[-1])(x)

    model, optimizer = MLP(), OPTIMIZERS[optimizer_name](optax)
    mesh = jax.make_mesh((N_DEVICES,), ("data",))

    def train_step(params, opt_state, images, labels):
        def loss_fn(p):
            logits = model.apply(p, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                 out_specs=(P(), P(), P())))

    @jax.jit
    def init(key):
        params = model.init(key, jnp.zeros((1, 64)))
        return params, optimizer.init(params)

    params, opt_state = jax.device_put(init(jax.random.key(0)), NamedSharding(mesh, P()))
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P("data"))
    images = jax.device_put(rng.standard_normal((N_DEVICES * 16, 64), dtype=np.float32), batch)
    labels = jax.device_put(rng.integers(0, WIDTHS[-1], N_DEVICES * 16).astype(np.int32), batch)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, images, labels)
        losses.append(float(loss))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    result = {"losses": np.asarray(losses)}
    result.update({"param" + jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat})
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("optimizer", choices=sorted(OPTIMIZERS))
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    np.savez(args.out, **train(args.optimizer, args.steps))


if __name__ == "__main__":
    main(sys.argv[1:])
