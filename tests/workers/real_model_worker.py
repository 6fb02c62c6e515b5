"""Worker for tests/models/test_real_models.py: library models trained data parallel, with no change for the passes.

    python tests/workers/real_model_worker.py MODEL OUT.npz [--steps N] [--float64] [--plain-first PLAIN.npz]

MODEL is one of `MODELS`: Keras 3 applications at test size (tests/helpers/keras_applications.py:
ResNet50's, EfficientNetB0's, MobileNetV3Small's and ConvNeXtTiny's blocks, each kind of them, by
Keras's own builders; JAX backend, `DataParallel` over the 8 CPU devices, `train_on_batch`) and a
Flax BatchNorm ResNet (optax, `jax.jit` with `NamedSharding`: parameters replicated, batch split). Each trains
N steps on the same seeded data and saves the per-step losses and every final
weight (model variables, BatchNorm statistics, optimizer state) to OUT.npz.

Whether a pass runs is decided by the XLA_PASSES environment variable alone,
read by the JAX plugin when the backend starts. With `--plain-first`, the worker
first trains the same model with those passes turned off and saves that plain
run to PLAIN.npz (tests/helpers/plain_first.py), then turns them back on and
trains a new model from the same seed: the two runs share the process's imports
and the model's initializer programs. The caller sets XLA_FLAGS=--xla_force_host_platform_device_count=8. The
"xla_passes" logger goes to stderr at INFO, so that the caller can see which
modules a pass changed and what weight-update-sharding did with each weight,
and so does one line with the time of each step (the first one compiles).
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable

import numpy as np

# tests/helpers, where keras_applications.py and plain_first.py are (callers put only the repository on the path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from plain_first import without_the_passes  # noqa: E402

IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10
BATCH = 16  # 2 images per device
STEP_TIMES_PREFIX = "real_model_worker: step seconds:"


def train(step: Callable[[np.ndarray, np.ndarray], float], steps: int, dtype=np.float32) -> np.ndarray:
    """Run `step(images, labels) -> loss` on `steps` seeded batches; the losses, and the step times on stderr."""
    rng = np.random.default_rng(0)
    losses, seconds = [], []
    for _ in range(steps):
        images = rng.standard_normal((BATCH, *IMAGE_SHAPE), dtype=np.float32).astype(dtype)
        labels = rng.integers(0, CLASSES, size=BATCH, dtype=np.int32)
        start = time.perf_counter()
        losses.append(float(step(images, labels)))
        seconds.append(time.perf_counter() - start)
    print(STEP_TIMES_PREFIX, *(f"{s:.2f}" for s in seconds), file=sys.stderr)
    return np.asarray(losses, dtype=dtype)


def train_keras(application: str, make_optimizer, steps: int, float64: bool = False) -> dict[str, np.ndarray]:
    """A `keras.applications` model, test-size or full (keras_applications.build), at 32x32 and 10 classes;
    `make_optimizer(keras)` returns its optimizer.
    With `float64`, every variable and input is float64 (Keras's floatx, jax_enable_x64)."""
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import keras_applications

    keras.backend.clear_session()  # a second run in the process names its layers and variables as the first did
    jax.config.update("jax_enable_x64", float64)
    keras.config.set_floatx("float64" if float64 else "float32")
    keras_applications.set_random_seed(0)  # not TensorFlow's: the workers train without it
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model = keras_applications.build(application, IMAGE_SHAPE, CLASSES)
    model.compile(optimizer=make_optimizer(keras), loss="sparse_categorical_crossentropy")
    result = {"losses": train(model.train_on_batch, steps, np.float64 if float64 else np.float32)}
    for variable in [*model.weights, *model.optimizer.variables]:
        result[variable.path] = np.asarray(variable.value)
    return result


def train_flax_resnet(steps: int) -> dict[str, np.ndarray]:
    """A small BatchNorm ResNet in Flax linen, AdamW from optax, the step under `jax.jit` with shardings."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    class ResidualBlock(nn.Module):
        """Two 3x3 convolutions with BatchNorm; a 1x1 projection where the shape changes."""

        features: int
        strides: int = 1

        @nn.compact
        def __call__(self, x, train: bool):
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
            y = nn.relu(norm()(nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)))
            y = norm()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
            if x.shape != y.shape:
                x = norm()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
            return nn.relu(x + y)

    class SmallResNet(nn.Module):
        """A 3x3 stem and one residual block per stage, halving the resolution after the first."""

        stage_widths: tuple[int, ...] = (16, 32, 64)

        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(self.stage_widths[0], (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
            for stage, width in enumerate(self.stage_widths):
                x = ResidualBlock(width, strides=1 if stage == 0 else 2)(x, train)
            return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))

    model = SmallResNet()
    optimizer = optax.adamw(1e-3, weight_decay=1e-2)
    # Auto axes: with the Explicit axes that make_mesh gives by default, the step all-gathers the batch at the
    # first BatchNorm and trains replicated after it, leaving one gradient all-reduce instead of one per weight.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, batch_split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def train_step(params, batch_stats, opt_state, images, labels):
        def loss_fn(params):
            logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images, train=True,
                                          mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    jitted_step = jax.jit(train_step, in_shardings=(replicated,) * 3 + (batch_split,) * 2, out_shardings=replicated)
    variables = model.init(jax.random.key(0), jnp.zeros((1, *IMAGE_SHAPE)), train=False)
    params, batch_stats = jax.device_put((variables["params"], variables["batch_stats"]), replicated)
    state = {"params": params, "batch_stats": batch_stats,
             "opt_state": jax.device_put(optimizer.init(params), replicated)}

    def step(images, labels):
        state["params"], state["batch_stats"], state["opt_state"], loss = jitted_step(
            state["params"], state["batch_stats"], state["opt_state"], images, labels)
        return loss

    result = {"losses": train(step, steps)}
    for tree_name, tree in state.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            result[tree_name + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return result


MODELS = {
    "flax-resnet": train_flax_resnet,
    "keras-resnet": functools.partial(train_keras, "resnet", lambda keras: keras.optimizers.Adam(1e-3)),
    "keras-efficientnet": functools.partial(train_keras, "efficientnet",
                                            lambda keras: keras.optimizers.SGD(0.01, momentum=0.9)),
    "keras-mobilenetv3-lamb": functools.partial(train_keras, "mobilenetv3", lambda keras: keras.optimizers.Lamb(1e-3)),
    "keras-convnext-lamb": functools.partial(train_keras, "convnext", lambda keras: keras.optimizers.Lamb(1e-3)),
    # The full models, for benchmarks/hook_time.py:
    "keras-resnet50": functools.partial(train_keras, "ResNet50", lambda keras: keras.optimizers.Adam(1e-3)),
    "keras-efficientnetb0": functools.partial(train_keras, "EfficientNetB0",
                                              lambda keras: keras.optimizers.SGD(0.01, momentum=0.9)),
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--float64", action="store_true", help="train in float64 (Keras models)")
    parser.add_argument("--plain-first", metavar="PLAIN.npz", help="first train without the passes, saved here")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("xla_passes").addHandler(handler)
    logging.getLogger("xla_passes").setLevel(logging.INFO)
    train = functools.partial(MODELS[args.model], args.steps, **({"float64": True} if args.float64 else {}))
    if args.plain_first:
        np.savez(args.plain_first, **without_the_passes(train))
    np.savez(args.out, **train())


if __name__ == "__main__":
    main(sys.argv[1:])
