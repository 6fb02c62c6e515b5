"""spatial-partitioning on Keras models (TF backend) through `xla_passes.tensorflow.function`.

Keras's ZeroPadding2D puts an explicit pad before VALID convolutions (ResNet's stem,
MobileNetV2's and EfficientNet's stride-2 blocks); the pass turns it into window padding and
exchanges halos instead of all-gathering. Keras 3 picks its backend when it is imported, so
the models run in a child process with KERAS_BACKEND=tensorflow (this file, run as a
script), which compares the front end's step with TF's own `tf.function(jit_compile=True)`
and writes the results as JSON.
"""
import importlib.util
import json
import sys

import pytest
from support import run_keras_tf_child

# keras.applications MobileNetV2 (and a small net) on the TF backend through the TF front end.
pytestmark = pytest.mark.slow

PASSES = "spatial-partitioning{num_partitions=4,split=0:1}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    for package in ("tensorflow", "keras"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    return run_keras_tf_child(__file__, tmp_path_factory.mktemp("keras") / "results.json", timeout=600)


def test_small_keras_net_trains_as_in_tf(results):
    """ZeroPadding2D + Conv2D VALID, BatchNormalization (training), ReLU, ZeroPadding2D(0_1) +
    stride-2 DepthwiseConv2D, global pooling, Dense: three SGD steps, losses and variables
    (moving statistics included) as TF's, halos and no all-gather."""
    small = results["small"]
    assert small["max_diff"] < 1e-5, small
    assert small["all_gathers"] == 0 and small["collective_permutes"] > 0, small
    assert small["pads"] == 0, small   # both ZeroPadding2D became window padding
    assert small["losses"][-1] < small["losses"][0]


@pytest.mark.parametrize("what", ["forward", "gradient"])
def test_mobilenet_v2_stays_split(results, what):
    """keras.applications.MobileNetV2 (64x64, random weights): every convolution split, the
    same logits, feature maps and gradients as TF."""
    run = results[f"mobilenet_{what}"]
    assert run["split"] == run["convolutions"], run
    assert run["gathers_before_root"] == 0, run
    assert run["max_diff"] < 1e-5 * max(1.0, run["max_ref"]), run
    assert run["max_relative_diff"] < 1e-4, run


# --- the child process ----------------------------------------------------------------------------------

def _small(tf, keras, np, xla_passes, hlo_tools) -> dict:
    def make_model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16, 16, 3))
        y = keras.layers.ZeroPadding2D(1)(inputs)
        y = keras.layers.Conv2D(8, 3, padding="valid", use_bias=False)(y)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.ReLU()(y)
        y = keras.layers.ZeroPadding2D(((0, 1), (0, 1)))(y)
        y = keras.layers.DepthwiseConv2D(3, strides=2, padding="valid")(y)
        y = keras.layers.ReLU(6.0)(y)
        y = keras.layers.GlobalAveragePooling2D()(y)
        return keras.Model(inputs, keras.layers.Dense(5)(y))

    def make_step(model):
        def step(x, labels):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
            for variable, grad in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
                variable.assign_sub(0.1 * grad)
            return loss
        return step

    ours_model, tf_model = make_model(), make_model()
    ours = xla_passes.tensorflow.function(make_step(ours_model), passes=PASSES)
    reference = tf.function(make_step(tf_model), jit_compile=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 16, 3)).astype(np.float32)
    labels = np.array([1, 3], np.int32)
    losses, diff = [], 0.0
    for _ in range(3):
        loss, want = ours(x, labels), reference(x, labels)
        diff = max(diff, abs(float(loss) - float(want)))
        for a, b in zip(ours_model.variables, tf_model.variables):
            diff = max(diff, float(np.max(np.abs(a.numpy() - b.numpy()))))
        losses.append(float(loss))
    module = hlo_tools.parse_module(ours.module_text(x, labels))
    opcodes = [i.opcode for i in module.instructions()]
    return {"losses": losses, "max_diff": diff, "all_gathers": opcodes.count("all-gather"),
            "collective_permutes": opcodes.count("collective-permute"), "pads": opcodes.count("pad")}


def _mobilenet(tf, keras, np, xla_passes, hlo_tools, gradient: bool) -> dict:
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10,
                                          classifier_activation=None)
    model = keras.Model(base.inputs, [base.output, base.get_layer("block_6_expand_relu").output,
                                      base.get_layer("out_relu").output])
    rng = np.random.default_rng(1)
    for variable in model.variables:   # batch norm that is not an identity
        if "moving_mean" in variable.path:
            variable.assign(0.1 * rng.standard_normal(variable.shape))
        if "moving_variance" in variable.path:
            variable.assign(0.5 + rng.random(variable.shape))
    x = rng.standard_normal((2, 64, 64, 3)).astype(np.float32)
    if gradient:
        def fn(x, labels):
            with tf.GradientTape() as tape:
                logits = model(x, training=False)[0]
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
            return [loss] + tape.gradient(loss, model.trainable_variables)
        args = (x, np.array([1, 7], np.int32))
    else:
        def fn(x):
            return model(x, training=False)
        args = (x,)
    reference = tf.function(fn, jit_compile=True)
    module = hlo_tools.parse_module(reference.experimental_get_compiler_ir(*args)(stage="hlo"))

    def convolutions():   # by TF op: (input dims, output dims); a split one has slab-sized ones
        return {str(i.attrs.get("metadata")): (i.operand(0).shape.dims, i.shape.dims)
                for i in module.entry.instructions if i.opcode == "convolution"}
    before = convolutions()
    pipeline = xla_passes.Pipeline(PASSES)
    pipeline.run(module)
    after = convolutions()
    ours = xla_passes.tensorflow.function(fn, passes=PASSES)
    got = [a.numpy() for a in tf.nest.flatten(ours(*args))]
    want = [b.numpy() for b in tf.nest.flatten(reference(*args))]
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(got, want)]
    scales = [float(np.max(np.abs(b))) for b in want]
    return {"convolutions": len(after),   # live ones (TF also computes the unused input gradient)
            "split": sum(after[k] != before[k] for k in after),
            "gathers_before_root": sum(" all-gather " in line and "at the result" not in line
                                       for line in pipeline.reports()),
            "max_diff": max(diffs), "max_ref": max(scales),
            # each output against its own scale: the first layers' gradients are around 1e-11
            "max_relative_diff": max(d / max(scale, 1e-30) for d, scale in zip(diffs, scales))}


def main(target: str) -> None:
    import numpy as np
    import tensorflow as tf
    import keras

    import hlo_tools
    import xla_passes
    import xla_passes.tensorflow
    assert keras.backend.backend() == "tensorflow"
    modules = (tf, keras, np, xla_passes, hlo_tools)
    results = {"small": _small(*modules),
               "mobilenet_forward": _mobilenet(*modules, gradient=False),
               "mobilenet_gradient": _mobilenet(*modules, gradient=True)}
    with open(target, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
