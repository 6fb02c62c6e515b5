"""spatial-partitioning on keras.applications ResNet50 and EfficientNetB0 (TF backend) through the front end.

Each model (ResNet50's and EfficientNetB0's blocks at test size, tests/helpers/keras_applications.py;
weights=None, 64x64 images, batch 2, 10 classes, in float64) runs its forward pass
and one training step's gradients (the loss and every trainable variable's, BatchNorm in training
mode: batch statistics over the split rows), dropout rates set to 0, through
`xla_passes.tensorflow.function(step, passes="spatial-partitioning{num_partitions=4,split=0:1}")`
on 4 CPU devices, against TF's own `tf.function(jit_compile=True)`:

- the logits (forward, BatchNorm in inference mode), the loss and every gradient equal TF's within
  RTOL of the output's largest magnitude plus FLOOR of the step's largest output;
- every convolution with rows to split (its image operand taller than one row) is split.

Why float64: in float32 no fixed tolerance fits a training step at batch 2. ResNet50's last
stage is 2x2 at 64x64, so its BatchNorm statistics span 8 values and TF's own XLA and eager
steps differ by up to 2% of a BatchNorm gamma's gradient, and the gradients of a bias or beta
that a training-mode BatchNorm follows are 0 in exact arithmetic, so rounding noise. A bound
taken from that noise (how far TF's XLA step is from its eager step) moves with the CPU: on
ResNet50 ours was 9.2 times it on an AMD EPYC with AVX2 and no AVX-512, 2.6 times on one with
AVX-512 and 9.0 times there with XLA's code limited to AVX. In float64 the same steps of the full
models differed from TF's by at most 9.5e-13 of an output's scale (ResNet50's conv1 kernel), the
outputs that are 0 in exact arithmetic by at most 3.4e-16 of the step's largest output
(EfficientNetB0's project BatchNorm betas); with XLA's code limited to AVX2 or AVX they stay as far inside the bounds,
while a wrong halo or split moves an output by far more than RTOL.

Keras 3 picks its backend when it is imported, so the models run in a child process with
KERAS_BACKEND=tensorflow (this file, run as a script), which writes its results as JSON.
`measure` is also what benchmarks/keras_models.py times.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import pytest
from support import run_keras_tf_child, xla_flags_for_tests

# keras.applications ResNet50 and EfficientNetB0 at test size through the TF front end, against TF.
pytestmark = pytest.mark.slow

PASSES = "spatial-partitioning{num_partitions=4,split=0:1}"
MODELS = ("resnet", "efficientnet")  # keras_applications.BUILDERS
IMAGE_SIZE = 64
# |ours - TF| of an output must stay within RTOL of its own largest magnitude plus FLOOR of the
# largest magnitude of any output of the step (for the outputs that are 0 in exact arithmetic).
RTOL = 1e-9
FLOOR = 1e-12


def _run_child(models: list[str], target) -> dict:
    # XLA's default level: -O0 slows these float64 convolutions more than it speeds their compiles.
    return run_keras_tf_child(__file__, target, *models, timeout=600, JAX_PLATFORMS="cpu",
                              XLA_FLAGS=xla_flags_for_tests(fast_compile=False))


@pytest.mark.parametrize("model", MODELS)
def test_forward_and_training_gradients_match_tf_and_every_convolution_with_rows_splits(model, tmp_path):
    for package in ("tensorflow", "keras"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    results = _run_child([model], tmp_path / "results.json")[model]
    for what, run in results.items():
        print(f"{model} {what}: {run}")
        assert run["split"] == run["splittable"] > 0, (what, run)
        assert run["outside_tolerance"] == [], (what, run)
        assert run["collectives"]["collective-permute"] > 0, (what, run)   # halos exchanged
        assert run["collectives"]["all-gather"] == 0, (what, run)


# --- the child process ----------------------------------------------------------------------------------

def _convolutions(path: str) -> dict[str, list]:
    """The module's convolutions by TF op (metadata): [(image operand dims, result dims, rows of the image)]."""
    import hlo_tools  # noqa: PLC0415

    with open(path, encoding="utf-8") as f:
        module = hlo_tools.parse_module(f.read())
    found = collections.defaultdict(list)
    for instr in module.instructions():
        if instr.opcode != "convolution":
            continue
        labels = instr.attrs["dim_labels"].input_labels
        dims = instr.operand(0).shape.dims
        found[str(instr.attrs.get("metadata"))].append((dims, instr.shape.dims, dims[labels.index("0")]))
    return found


def _collectives(path: str) -> dict[str, int]:
    import hlo_tools  # noqa: PLC0415
    from hlo_tools.inspection.stats import module_stats  # noqa: PLC0415

    with open(path, encoding="utf-8") as f:
        stats = module_stats(hlo_tools.parse_module(f.read()))
    counts = {s.kind: s.count for s in stats.collective_summary()}
    return {kind: counts.get(kind, 0) for kind in ("collective-permute", "all-gather", "all-reduce")}


def _median_ms(calls: dict, rounds: int, steps: int) -> dict[str, float]:
    """Interleaved rounds (the first one not counted) of `steps` calls of each; median ms per call."""
    import tensorflow as tf  # noqa: PLC0415

    seconds = {key: [] for key in calls}
    for round_index in range(rounds + 1):
        for key, call in calls.items():
            for _ in range(steps):
                start = time.perf_counter()
                tf.nest.map_structure(lambda t: t.numpy(), call())
                if round_index:
                    seconds[key].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(values) for key, values in seconds.items()}


def measure(name: str, what: str, *, image_size: int = IMAGE_SIZE, rounds: int = 0, steps: int = 0,
            float64: bool = False) -> dict:
    """The forward or training gradients of `name`, a model of keras.applications (benchmarks/keras_models.py) or
    a test-size one (keras_applications.BUILDERS), through the front end with PASSES vs TF.

    With `float64`, the model's weights, its input and every computation are float64 (Keras's
    floatx). `outside_tolerance` lists the outputs beyond the test's RTOL and FLOOR. With `rounds`,
    the median ms per call of TF's step, the front end without passes and with PASSES, in
    interleaved rounds (`_median_ms`).
    """
    import keras  # noqa: PLC0415
    import keras_applications  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    import xla_passes.tensorflow  # noqa: PLC0415

    assert keras.backend.backend() == "tensorflow"
    keras.config.set_floatx("float64" if float64 else "float32")
    keras.utils.set_random_seed(0)
    model = keras_applications.build(name, (image_size, image_size, 3), 10, classifier_activation=None)
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.Dropout):   # the same step in every run
            layer.rate = 0.0
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, image_size, image_size, 3)).astype(keras.config.floatx())
    labels = np.array([1, 7], np.int32)
    if what == "gradient":
        def fn(x, labels):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
            return [loss] + tape.gradient(loss, model.trainable_variables)
        args = (x, labels)
        names = ["loss"] + [v.path for v in model.trainable_variables]
    else:
        def fn(x):
            return [model(x, training=False)]
        args = (x,)
        names = ["logits"]

    reference = tf.function(fn, jit_compile=True)
    plain = xla_passes.tensorflow.function(fn) if rounds else None
    with tempfile.TemporaryDirectory() as dump:
        ours = xla_passes.tensorflow.function(fn, passes=PASSES, dump_to=dump)
        got = [t.numpy() for t in ours(*args)]
        [before] = [os.path.join(dump, f) for f in os.listdir(dump) if f.endswith(".before_xla_passes.txt")]
        [after] = [os.path.join(dump, f) for f in os.listdir(dump) if ".after_" in f]
        convolutions_before, convolutions_after = _convolutions(before), _convolutions(after)
        collectives = _collectives(after)
    want = [t.numpy() for t in reference(*args)]
    eager = [t.numpy() for t in fn(*args)]

    def diff(a, b):
        return [float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b)]

    diffs, scales = diff(got, want), [float(np.max(np.abs(w))) for w in want]
    noise = diff(want, eager)
    if rounds:   # also the front end without passes: TF's module compiled by jaxlib's XLA
        unpassed = [t.numpy() for t in plain(*args)]
        noise = [max(n) for n in zip(noise, diff(unpassed, want), diff(unpassed, eager))]
    outside = [f"{n}: |ours - TF| {d:.3g}, noise {e:.3g}, scale {s:.3g}"
               for n, d, e, s in zip(names, diffs, noise, scales) if d > RTOL * s + FLOOR * max(scales)]
    split = splittable = total = 0
    for key, after in convolutions_after.items():
        for (dims, out, rows), (dims0, out0, rows0) in zip(sorted(after), sorted(convolutions_before[key])):
            total += 1
            splittable += rows0 > 1
            split += (dims, out) != (dims0, out0)
    result = {"convolutions": total, "split": split, "splittable": splittable, "collectives": collectives,
              "max_diff": max(diffs), "max_ref": max(scales),
              "max_relative_diff": max(d / max(s, 1e-30) for d, s in zip(diffs, scales)),
              "noise_relative_diff": max(e / max(s, 1e-30) for e, s in zip(noise, scales)),
              "max_over_noise": max(d / max(e, 1e-30) for d, e in zip(diffs, noise)),
              "outside_tolerance": outside}
    if rounds:
        result.update({f"{key}_ms": ms for key, ms in _median_ms(
            {"tf": lambda: reference(*args), "plain": lambda: plain(*args), "ours": lambda: ours(*args)},
            rounds, steps).items()})
    return result


def main(target: str, models: list[str]) -> None:
    results = {}
    for name in models:
        results[name] = {}
        for what in ("forward", "gradient"):
            start = time.perf_counter()
            results[name][what] = measure(name, what, float64=True)
            results[name][what]["seconds"] = time.perf_counter() - start
            print(f"{name} {what}: {results[name][what]}", file=sys.stderr, flush=True)
    with open(target, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
