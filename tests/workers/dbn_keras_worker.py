"""Worker for tests/models/test_distributed_batch_norm_keras.py: a Keras 3 BatchNorm model, data parallel, and its reference.

    python tests/workers/dbn_keras_worker.py MODE OUT.npz [--steps 3] [--group-size K ...]
        [--model small|resnet|efficientnet] [--optimizer momentum|adam] [--plain-first PLAIN.npz]

MODE `data-parallel`: Keras 3 on JAX, `DataParallel` over every device (the
caller sets XLA_FLAGS=--xla_force_host_platform_device_count=8), `model.fit`
one batch of GLOBAL_BATCH seeded images per step. Whether a pass runs is up to
the XLA_PASSES environment variable alone, which the JAX plugin reads: nothing
here imports `xla_passes`. Plain, BatchNorm normalises with the statistics of
the whole global batch; with `distributed-batch-norm{group_size=K}`, with those
of each group of K consecutive devices.

MODE `reference`: the same model and data on one device, no distribution, with
what the grouped step should compute written out: device d holds examples
[4d, 4d+4) (checked in data-parallel mode: that is how `DataParallel` splits
the batch), group g the examples of devices [Kg, K(g+1)). Each group runs
`stateless_call(training=True)` on its examples alone, so its BatchNorm
normalises with the group's statistics; the step's loss and gradients are the
means over the groups (the global batch's mean loss, groups being of equal
size), the new BatchNorm moving statistics the mean over the groups of each
group's, and `optimizer.stateless_apply` applies the mean gradients. With K = 8
(one group) this is the plain data-parallel step. Several --group-size values
train one reference each, in this one process, OUT naming each file with
`{group_size}` in it.

With --plain-first (data-parallel mode), the worker first trains with the
passes that XLA_PASSES switched on turned off and saves that plain run to
PLAIN.npz (tests/helpers/plain_first.py), then trains with them.

Both modes use the optimizer that --optimizer names: `momentum`, SGD(0.1,
momentum=0.9), or `adam`, Adam(1e-3), whose update is not linear in the
gradients: the grouped step is right only if the gradients are averaged over
the groups before the optimizer sees them.

Both modes save to OUT.npz the per-step losses ("losses"), the initial value
of every model variable ("init/<path>"; both modes draw them from the same
seed, and the caller's comparison checks that they agree) and the final value
of every model variable (trainable and BatchNorm moving statistics) and
optimizer variable, keyed by its Keras path. The "xla_passes" logger goes to
stderr at INFO, so that the caller can see which modules a pass changed.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
# tests/helpers, where keras_applications.py and plain_first.py are (the caller puts only the repository on the path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import keras_applications  # noqa: E402
import numpy as np  # noqa: E402
from plain_first import without_the_passes  # noqa: E402

PER_DEVICE_BATCH = 4
DEVICES = 8
GLOBAL_BATCH = DEVICES * PER_DEVICE_BATCH
STEP_TIMES_PREFIX = "dbn_keras_worker: step seconds:"


def small_model() -> keras.Model:
    """Two convolutions with BatchNorm and a Dense classifier on 16x16 images; 5 logits."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        layers.Conv2D(8, 3, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.Conv2D(8, 3, strides=2, use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dense(5),
    ])


def resnet() -> keras.Model:
    """ResNet50's blocks at test size (keras_applications.resnet) at 32x32 and 10 classes (its head is a softmax:
    probabilities, not logits)."""
    return keras_applications.build("resnet", (32, 32, 3), 10)


def efficientnet() -> keras.Model:
    """EfficientNetB0's blocks at test size (keras_applications.efficientnet) at 32x32 and 10 classes (softmax
    head), its Dropout layers turned off.

    Depthwise convolutions, squeeze-and-excitation, swish and BatchNormalization after every convolution. Its
    Dropout layers (stochastic depth before each residual add, and before the classifier) get rate 0, which
    their `call` treats as the identity: the masks they would draw depend on the shape of the batch they see
    (the global batch under DataParallel, a group's examples in the reference), so no reference could
    reproduce them. Their seed generators stay, unused, among the non-trainable variables.
    """
    net = keras_applications.build("efficientnet", (32, 32, 3), 10)
    for layer in net._flatten_layers():
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return net


# model -> (constructor, image shape, classes, from_logits)
MODELS = {"small": (small_model, (16, 16, 3), 5, True), "resnet": (resnet, (32, 32, 3), 10, False),
          "efficientnet": (efficientnet, (32, 32, 3), 10, False)}
# optimizer -> constructor
OPTIMIZERS = {"momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(1e-3)}


def data(model: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps` seeded batches of GLOBAL_BATCH images and labels."""
    _, image_shape, classes, _ = MODELS[model]
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((GLOBAL_BATCH, *image_shape), dtype=np.float32),
             rng.integers(0, classes, size=GLOBAL_BATCH, dtype=np.int32)) for _ in range(steps)]


def build(model: str, optimizer: str) -> tuple[keras.Model, dict[str, np.ndarray]]:
    """The model, compiled and with its optimizer built, and the initial value of each variable by "init/<path>".

    Call after `keras_applications.set_random_seed(0)` (and after `set_distribution`, where there is one): both modes
    draw the same initial values from the seed.
    """
    make, _, _, from_logits = MODELS[model]
    net = make()
    net.compile(optimizer=OPTIMIZERS[optimizer](),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits))
    net.optimizer.build(net.trainable_variables)
    return net, {f"init/{v.path}": np.asarray(v.value) for v in net.weights}


def final_weights(net: keras.Model) -> dict[str, np.ndarray]:
    """Every model variable (trainable and not) and every optimizer variable, by path."""
    result = {}
    for variable in [*net.weights, *net.optimizer.variables]:
        assert variable.path not in result, f"two variables at {variable.path}"
        result[variable.path] = np.asarray(variable.value)
    return result


def check_batch_split(distribution) -> None:
    """DataParallel gives device jax.devices()[d] the examples [4d, 4d+4) of a global batch, as the reference assumes.

    Through the function that `fit` distributes its batches with (keras' JAX backend, `_distribute_data`).
    """
    from keras.src.backend.jax.distribution_lib import distribute_data_input

    index = np.arange(GLOBAL_BATCH, dtype=np.int32)
    array = distribute_data_input(index, distribution.get_data_layout(index.shape), distribution.batch_dim_name)
    held = {shard.device: np.asarray(shard.data).tolist() for shard in array.addressable_shards}
    for d, device in enumerate(jax.devices()):
        expected = list(range(PER_DEVICE_BATCH * d, PER_DEVICE_BATCH * (d + 1)))
        assert held[device] == expected, f"device {d} ({device}) holds examples {held[device]}, not {expected}"


def train_data_parallel(model: str, optimizer: str, steps: int) -> dict[str, np.ndarray]:
    """`model.fit` under DataParallel over every device, one step per batch of `data`."""
    assert jax.device_count() == DEVICES, f"{jax.device_count()} devices; set XLA_FLAGS=" \
                                          f"--xla_force_host_platform_device_count={DEVICES}"
    # A second model in the process names its layers and variables as the first did (this also takes away the
    # distribution an earlier run set).
    keras.backend.clear_session()
    keras_applications.set_random_seed(0)  # not TensorFlow's: the worker trains without it
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    keras.distribution.set_distribution(distribution)
    check_batch_split(distribution)
    net, result = build(model, optimizer)
    losses, seconds = [], []
    for images, labels in data(model, steps):
        # One fit per batch: its logged loss is that batch's (over an epoch of several, Keras logs their running
        # mean). The train function is built once and kept, and so are the variables and the optimizer's state.
        start = time.perf_counter()
        history = net.fit(images, labels, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        seconds.append(time.perf_counter() - start)
        [loss] = history.history["loss"]
        losses.append(loss)
    print(STEP_TIMES_PREFIX, *(f"{s:.2f}" for s in seconds), file=sys.stderr)
    return {"losses": np.asarray(losses), **result, **final_weights(net)}


def train_reference(model: str, optimizer: str, steps: int, group_size: int) -> dict[str, np.ndarray]:
    """The grouped step written out on one device (the module docstring)."""
    assert DEVICES % group_size == 0, f"group size {group_size} does not divide {DEVICES} devices"
    keras.backend.clear_session()
    keras_applications.set_random_seed(0)  # not TensorFlow's: the worker trains without it
    net, result = build(model, optimizer)
    loss_fn = net.loss
    optimizer = net.optimizer

    def group_loss(trainable, non_trainable, images, labels):
        y_pred, non_trainable, losses = net.stateless_call(trainable, non_trainable, images, training=True,
                                                           return_losses=True)
        loss = loss_fn(labels, y_pred)  # mean over the group's examples
        if losses:  # weight regularizers (none in these models), as Keras' compute_loss adds them
            loss = loss + sum(losses)
        return loss, non_trainable

    group_step = jax.jit(jax.value_and_grad(group_loss, has_aux=True))

    @jax.jit
    def apply(optimizer_variables, grads, trainable):
        return optimizer.stateless_apply(optimizer_variables, grads, trainable)

    trainable = [v.value for v in net.trainable_variables]
    non_trainable = [v.value for v in net.non_trainable_variables]
    optimizer_variables = [v.value for v in optimizer.variables]
    group_examples = group_size * PER_DEVICE_BATCH
    groups = GLOBAL_BATCH // group_examples

    def mean(*values):
        if not jnp.issubdtype(values[0].dtype, jnp.inexact):  # seed generator states: the same in every group
            assert all((v == values[0]).all() for v in values), "an integer variable differs between groups"
            return values[0]
        return sum(values) / groups

    losses, seconds = [], []
    for images, labels in data(model, steps):
        start = time.perf_counter()
        outcomes = [group_step(trainable, non_trainable, images[g * group_examples:(g + 1) * group_examples],
                               labels[g * group_examples:(g + 1) * group_examples]) for g in range(groups)]
        loss = mean(*(loss for (loss, _), _ in outcomes))
        grads = jax.tree.map(mean, *(grads for _, grads in outcomes))
        non_trainable = jax.tree.map(mean, *(updated for (_, updated), _ in outcomes))
        trainable, optimizer_variables = apply(optimizer_variables, grads, trainable)
        losses.append(float(loss))
        seconds.append(time.perf_counter() - start)
    print(STEP_TIMES_PREFIX, *(f"{s:.2f}" for s in seconds), file=sys.stderr)
    for variable, value in zip(net.trainable_variables, trainable):
        variable.assign(value)
    for variable, value in zip(net.non_trainable_variables, non_trainable):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_variables):
        variable.assign(value)
    return {"losses": np.asarray(losses), **result, **final_weights(net)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("data-parallel", "reference"))
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, action="append",
                        help=f"reference mode: devices per group (default {DEVICES}); several: a reference each")
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="momentum")
    parser.add_argument("--plain-first", metavar="PLAIN.npz", help="data-parallel mode: first train without the "
                        "passes, saved here")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("xla_passes").addHandler(handler)
    logging.getLogger("xla_passes").setLevel(logging.INFO)
    if args.mode == "data-parallel":
        if args.plain_first:
            np.savez(args.plain_first, **without_the_passes(
                lambda: train_data_parallel(args.model, args.optimizer, args.steps)))
        np.savez(args.out, **train_data_parallel(args.model, args.optimizer, args.steps))
        return
    group_sizes = args.group_size or [DEVICES]
    if len(group_sizes) > 1 and "{group_size}" not in args.out:
        parser.error("several --group-size values need {group_size} in OUT")
    for group_size in group_sizes:
        np.savez(args.out.replace("{group_size}", str(group_size)),
                 **train_reference(args.model, args.optimizer, args.steps, group_size))


if __name__ == "__main__":
    main(sys.argv[1:])
