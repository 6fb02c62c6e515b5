"""Worker for tests/models/test_model_parallel.py: train a model-zoo step for a few steps, save the numbers.

    python tests/workers/model_parallel_worker.py PROGRAM OPTIMIZER OUT.npz [--steps N] [--float64]
        [--plain-first PLAIN.npz]

PROGRAM is `megatron` (`models.model_parallel_step` of the test-size Transformer on a 2x4
`(data, model)` mesh, `jax.jit` + `NamedSharding`), `resnet` or `transformer`
(`models.data_parallel_step` of the test-size model on an 8-device "data" mesh, shard_map).
OPTIMIZER is `adamw` (`optax.adamw(1e-3)`) or `clip_adamw`
(`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))`). `--float64` trains in
float64 (jax_enable_x64, the initial parameters, optimizer state and inputs cast). Saves the
losses and every final parameter to OUT.npz. Whether passes run is decided by XLA_PASSES alone;
the worker only routes the `xla_passes` logger's INFO lines (the passes' reports) to stderr.
With --plain-first it first trains with those passes turned off and saves that plain run to
PLAIN.npz (tests/helpers/plain_first.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

# tests/helpers, where plain_first.py is (the caller puts only the repository on the path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from plain_first import without_the_passes  # noqa: E402


def optimizer(name: str):
    import optax

    if name == "adamw":
        return optax.adamw(1e-3)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def float64(tree):
    """`tree` with its floating-point arrays cast to float64, each keeping its sharding."""
    import jax

    return jax.tree.map(lambda a: a.astype(np.float64) if np.issubdtype(a.dtype, np.floating) else a, tree)


def train(program: str, optimizer_name: str, steps: int, x64: bool = False) -> dict[str, np.ndarray]:
    import jax

    from xla_passes_demo import models

    jax.config.update("jax_enable_x64", x64)
    if program == "megatron":
        # device 4 * d + m holds data shard d and model shard m: data groups {0,4},{1,5},{2,6},{3,7}
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
        step, args = models.model_parallel_step(models.small_transformer(), mesh, optimizer=optimizer(optimizer_name))
        params, opt_state, tokens, labels = float64(args) if x64 else args
        run = lambda p, s: step(p, s, tokens, labels)  # noqa: E731
        state = opt_state
    else:
        mesh = jax.make_mesh((8,), ("data",))
        spec = models.small_resnet() if program == "resnet" else models.small_transformer()
        step, args = models.data_parallel_step(spec, mesh, optimizer=optimizer(optimizer_name))
        params, model_state, opt_state, inputs, labels = float64(args) if x64 else args
        state = (model_state, opt_state)
        run = lambda p, s: (lambda r: (r[0], (r[1], r[2]), r[3]))(step(p, *s, inputs, labels))  # noqa: E731
    losses = []
    for _ in range(steps):
        params, state, loss = run(params, state)
        losses.append(float(loss))
    result = {"losses": np.asarray(losses)}
    for prefix, tree in (("param", params), ("state", state)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            result[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program", choices=["megatron", "resnet", "transformer"])
    parser.add_argument("optimizer", choices=["adamw", "clip_adamw"])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--plain-first", metavar="PLAIN.npz", help="first train without the passes, saved here")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("REPORT %(message)s"))
    logger = logging.getLogger("xla_passes")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if args.plain_first:
        np.savez(args.plain_first, **without_the_passes(
            lambda: train(args.program, args.optimizer, args.steps, args.float64)))
    np.savez(args.out, **train(args.program, args.optimizer, args.steps, args.float64))


if __name__ == "__main__":
    main(sys.argv[1:])
