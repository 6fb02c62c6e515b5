"""Worker for tests/models/test_weight_update_sharding_jax.py: an unmodified Flax + Optax data-parallel loop.

    python tests/workers/wus_worker.py OPTIMIZER OUT.npz [--steps N]

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

WIDTHS = (128, 128, 10)  # Dense layers; input width 64

OPTIMIZERS = {
    "adam": lambda optax: optax.adam(1e-3),
    "momentum": lambda optax: optax.sgd(0.05, momentum=0.9),
}


def train(optimizer_name: str, steps: int) -> dict[str, np.ndarray]:
    import jax
    import optax

    from xla_passes_demo.training import build_flax_training

    step, (params, opt_state, images, labels) = build_flax_training(
        WIDTHS, optimizer=OPTIMIZERS[optimizer_name](optax), pmean_each_gradient=False,
        check_vma=True, donate=False, batch_per_device=16)
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
