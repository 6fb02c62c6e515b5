"""Worker for tests/models/test_model_parallel.py: train a model-zoo step under several pass settings, one after
another in one process, and save each run's numbers, pass reports and dumps.

    python tests/workers/model_parallel_worker.py PROGRAM OUT_DIR [--steps N]
        --run NAME OPTIMIZER PRECISION PASSES [--run ...]

PROGRAM is `megatron` (`models.model_parallel_step` of the test-size Transformer on a 2x4
`(data, model)` mesh, `jax.jit` + `NamedSharding`), `resnet` or `transformer`
(`models.data_parallel_step` of the test-size model on an 8-device "data" mesh, shard_map).
Each `--run` trains the program anew (a new training step, traced and compiled) and writes
OUT_DIR/NAME.npz (the losses and every final parameter and state array), OUT_DIR/NAME.report
(the `xla_passes` logger's lines of that run) and, when PASSES is not empty, the hook's dumps to
OUT_DIR/dump_NAME. OPTIMIZER is `adamw` (`optax.adamw(1e-3)`) or `clip_adamw`
(`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))`); PRECISION is `float32` or
`float64` (jax_enable_x64, the initial parameters, optimizer state and inputs cast); PASSES is the
pipeline that `xla_passes.jax.enable(PASSES, strict=True)` runs in the run's compiles, at the hook
XLA_PASSES uses, or "" for a plain run with the passes off.

Why one process: each worker process pays for its imports and for compiling the model's
initializers, which every run of a program shares (tests/helpers/plain_first.py does the same for
one plain and one pass run).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np


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


class _Lines(logging.Handler):
    """Keeps the formatted records it is given."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program", choices=["megatron", "resnet", "transformer"])
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--run", nargs=4, action="append", required=True,
                        metavar=("NAME", "OPTIMIZER", "PRECISION", "PASSES"))
    args = parser.parse_args(argv)
    for name, optimizer_name, precision, _ in args.run:
        if optimizer_name not in ("adamw", "clip_adamw") or precision not in ("float32", "float64"):
            parser.error(f"run {name}: unknown optimizer {optimizer_name!r} or precision {precision!r}")
    import xla_passes.jax

    logger = logging.getLogger("xla_passes")
    logger.setLevel(logging.INFO)
    for name, optimizer_name, precision, passes in args.run:
        lines = _Lines()
        logger.addHandler(lines)
        if passes:
            xla_passes.jax.enable(passes, strict=True, dump_to=os.path.join(args.out_dir, f"dump_{name}"))
        else:
            xla_passes.jax.disable()
        try:
            arrays = train(args.program, optimizer_name, args.steps, precision == "float64")
        finally:
            logger.removeHandler(lines)
        np.savez(os.path.join(args.out_dir, f"{name}.npz"), **arrays)
        with open(os.path.join(args.out_dir, f"{name}.report"), "w") as report:
            report.writelines(line + "\n" for line in lines.lines)


if __name__ == "__main__":
    main(sys.argv[1:])
