"""xla_passes.tensorflow.function: a TF step run through a pipeline and the runner behaves as TF's own.

Every test runs the same step twice from equal starting variables: through
`xla_passes.tensorflow.function` and as TF's `tf.function(jit_compile=True)`,
and compares the returned values and the variables after each of several steps.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (pip install -e '.[tensorflow]')")

import hlo_tools  # noqa: E402
import xla_passes  # noqa: E402
import xla_passes.jax  # noqa: E402
from hlo_tools import Sharding  # noqa: E402
from hlo_tools.xla import runner  # noqa: E402
from xla_passes import HloPass, PassError, register_pass  # noqa: E402
from xla_passes.tensorflow import UnsupportedFunctionError, function  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


@register_pass
class CountRuns(HloPass):
    """Test-only: count the modules it sees (one per compiled signature); changes nothing."""

    name = "tf-frontend-count"
    runs = []

    def run(self, module):
        CountRuns.runs.append(module.name)
        return False


@register_pass
class Explode(HloPass):
    """Test-only: fail on every module."""

    name = "tf-frontend-explode"

    def run(self, module):
        raise RuntimeError("deliberate failure in a test pass")


@register_pass
class SplitRows(HloPass):
    """Test-only: the per-device module of an elementwise entry whose arrays split by rows.

    Every array of rank >= 1 keeps its first 1/num_partitions rows; the entry
    parameters and the ROOT say so with `sharding=`, as a partitioning pass would.
    """

    name = "tf-frontend-split-rows"
    num_partitions: int = 4
    annotate: bool = True  # false: no sharding=, so the module's global shapes change

    def run(self, module):
        n = self.num_partitions

        def rows(shape):
            return Sharding.tiled((n,) + (1,) * (len(shape.dims) - 1), list(range(n)))

        for instr in module.entry.post_order():
            shape = instr.shape
            if not shape.is_tuple and shape.dims:
                assert instr.opcode not in ("constant", "reduce", "dot"), instr.to_text()
                instr.set_shape(shape.with_dims((shape.dims[0] // n,) + tuple(shape.dims[1:])))
            if instr.opcode == "parameter" and self.annotate:
                instr.attrs["sharding"] = rows(instr.shape)
        entry, old_root = module.entry, module.entry.root
        assert old_root.opcode == "tuple", old_root.to_text()
        root = entry.add_instruction("tuple", old_root.operands)  # the per-device result shape
        entry.set_root(root)
        entry.remove_instruction(old_root)
        if self.annotate:
            root.attrs["sharding"] = Sharding.tuple_of([rows(s) for s in root.shape.tuple_shapes])
        module.set_attr("num_partitions", n)
        return True


def assert_same(ours, reference, what):
    tf.nest.assert_same_structure(ours, reference)
    for got, want in zip(tf.nest.flatten(ours), tf.nest.flatten(reference), strict=True):
        if got is None and want is None:
            continue
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL, err_msg=what)


def dense_model():
    """Variables of a small dense model, SGD with momentum state and a step counter."""
    rng = np.random.default_rng(1)
    return {"w": tf.Variable(rng.standard_normal((8, 4)).astype(np.float32)),
            "velocity": tf.Variable(np.zeros((8, 4), np.float32)),
            "steps": tf.Variable(np.int64(0)),
            "last_loss": tf.Variable(np.float32(0))}


def dense_step(model):
    """A training step that reads and assigns captured variables and one passed as an argument."""

    def step(x, y, bias, learning_rate=0.1, momentum=0.9):
        w, velocity = model["w"], model["velocity"]
        with tf.GradientTape() as tape:
            prediction = tf.nn.relu(tf.matmul(x, w) + bias)
            loss = tf.reduce_mean(tf.square(prediction - y))
        grad_w, grad_b = tape.gradient(loss, [w, bias])
        velocity.assign(momentum * velocity + grad_w)
        w.assign_sub(learning_rate * velocity)
        bias.assign_sub(learning_rate * grad_b)
        model["steps"].assign_add(1)
        model["last_loss"].assign(loss)  # written, never read
        return {"loss": loss, "out": (prediction, None), "constant": 3}

    return step


def batches(count, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 8)).astype(np.float32),
             rng.standard_normal((batch, 4)).astype(np.float32)) for _ in range(count)]


def test_training_step_gives_tf_results_and_variables_over_steps():
    ours_model, tf_model = dense_model(), dense_model()
    ours_bias, tf_bias = tf.Variable(np.full(4, 0.5, np.float32)), tf.Variable(np.full(4, 0.5, np.float32))
    ours = function(dense_step(ours_model), passes="cse,dce")
    reference = tf.function(dense_step(tf_model), jit_compile=True)
    for number, (x, y) in enumerate(batches(3)):
        got, want = ours(x, y, ours_bias, learning_rate=0.05), reference(x, y, tf_bias, learning_rate=0.05)
        assert got["out"][1] is None and isinstance(got["loss"], tf.Tensor)
        assert_same(got, want, f"outputs of step {number}")
        for name in tf_model:
            assert_same(ours_model[name], tf_model[name], f"{name} after step {number}")
        assert_same(ours_bias, tf_bias, f"bias after step {number}")
    assert int(ours_model["steps"].numpy()) == 3
    assert float(ours_model["last_loss"].numpy()) == pytest.approx(float(got["loss"].numpy()))
    assert ours.compiled_signatures == 1


def test_compiles_once_per_input_signature():
    CountRuns.runs.clear()
    model = dense_model()
    bias = tf.Variable(np.zeros(4, np.float32))
    ours = function(dense_step(model), passes="tf-frontend-count")
    (x, y), = batches(1)
    (x8, y8), = batches(1, batch=8)
    for call, signatures in [((x, y), 1), ((x, y), 1), ((x8, y8), 2), ((x, y), 2)]:
        ours(*call, bias)
        assert ours.compiled_signatures == signatures
    ours(x, y, bias, learning_rate=0.5)  # a new Python value is a new signature, as in tf.function
    ours(x, y, bias, learning_rate=0.5)
    assert ours.compiled_signatures == 3
    assert len(CountRuns.runs) == 3  # the pipeline ran once per signature, not per call
    assert int(model["steps"].numpy()) == 6


def test_xla_passes_setting_applies_when_no_passes_are_given(monkeypatch):
    CountRuns.runs.clear()
    (x, y), = batches(1)
    monkeypatch.setenv("XLA_PASSES", "tf-frontend-count")
    function(lambda x: tf.reduce_sum(x * 2.0))(x)
    assert len(CountRuns.runs) == 1
    monkeypatch.delenv("XLA_PASSES")
    plain = function(dense_step(dense_model()))  # no passes at all: TF's module, unchanged
    reference = tf.function(dense_step(dense_model()), jit_compile=True)
    bias = tf.Variable(np.zeros(4, np.float32))
    assert_same(plain(x, y, bias), reference(x, y, tf.Variable(np.zeros(4, np.float32))), "outputs")
    assert len(CountRuns.runs) == 1
    assert plain.module_text(x, y, bias).startswith("HloModule a_inference_step")


def test_failing_setting_passes_warn_and_run_tfs_module_unless_strict(monkeypatch, caplog):
    x = np.arange(4, dtype=np.float32)
    monkeypatch.setenv("XLA_PASSES", "tf-frontend-explode")
    with caplog.at_level("WARNING", logger="xla_passes"):
        result = function(lambda x: x * 3.0)(x)
    np.testing.assert_array_equal(result.numpy(), x * 3.0)
    assert "deliberate failure" in caplog.text and "runs unchanged" in caplog.text
    monkeypatch.setenv("XLA_PASSES_STRICT", "1")
    with pytest.raises(PassError, match="deliberate failure"):
        function(lambda x: x * 3.0)(x)
    monkeypatch.delenv("XLA_PASSES_STRICT")
    with pytest.raises(PassError, match="deliberate failure"):  # passes given in code fail loudly
        function(lambda x: x * 3.0, passes="tf-frontend-explode")(x)


def test_per_device_module_runs_on_four_devices():
    def scale_rows(table):
        def step(x):
            table.assign(table * 0.5 + tf.nn.relu(x))
            return {"doubled": x * 2.0 + 1.0, "table": table.read_value()}
        return step

    start = np.arange(32, dtype=np.float32).reshape(8, 4)
    ours_table, tf_table = tf.Variable(start), tf.Variable(start)
    ours = function(scale_rows(ours_table), passes="tf-frontend-split-rows{num_partitions=4}")
    reference = tf.function(scale_rows(tf_table), jit_compile=True)
    x = np.random.default_rng(2).standard_normal((8, 4)).astype(np.float32)
    text = ours.module_text(x)
    assert "num_partitions=4" in text and "f32[2,4]" in text and "f32[8,4]" not in text.split("\n", 1)[1]
    for number in range(3):
        assert_same(ours(x), reference(x), f"outputs of step {number}")
        assert_same(ours_table, tf_table, f"table after step {number}")


def test_a_pipeline_that_changes_the_global_shapes_is_refused():
    step = function(lambda x: (x * 2.0, x + 1.0), passes="tf-frontend-split-rows{annotate=false}")
    with pytest.raises(runner.RunError, match=r"changed global input 0 from f32\[8,4\] to f32\[2,4\]"):
        step(np.ones((8, 4), np.float32))


def test_jax_plugin_passes_stay_out_of_the_front_end_compile():
    CountRuns.runs.clear()
    with xla_passes.jax.enable("tf-frontend-count"):
        function(lambda x: x + 1.0, passes="dce")(np.ones(3, np.float32))
        assert CountRuns.runs == []  # our module is not run through XLA's hook as well
        assert xla_passes.jax.enabled().passes == "tf-frontend-count"


def test_random_generator_draws_and_advances_as_in_tf():
    ours_generator, tf_generator = tf.random.Generator.from_seed(7), tf.random.Generator.from_seed(7)
    ours = function(lambda x: x + ours_generator.normal([3]))
    reference = tf.function(lambda x: x + tf_generator.normal([3]), jit_compile=True)
    x = np.zeros(3, np.float32)
    for number in range(2):
        np.testing.assert_array_equal(ours(x).numpy(), reference(x).numpy(), err_msg=f"draw {number}")
    np.testing.assert_array_equal(ours_generator.state.numpy(), tf_generator.state.numpy())


def _reshape_by(x, shape):
    return tf.reshape(x, shape)


def _draw(x):
    return x + tf.random.uniform([4])


def _make_variable(x):
    return x * tf.Variable(2.0)


def _string_length(s):
    return tf.strings.length(s)


@pytest.mark.parametrize("fn, args, message", [
    (_reshape_by, (np.ones(4, np.float32), tf.constant([2, 2])), "compile-time constants"),
    (_draw, (np.ones(4, np.float32),), "stateful random op RandomUniform"),
    (_make_variable, (np.ones(4, np.float32),), "creates a tf.Variable"),
    (_string_length, (tf.constant(["ab"]),), "is a string tensor"),
])
def test_unsupported_steps_get_one_clear_error(fn, args, message):
    with pytest.raises(UnsupportedFunctionError, match=message) as info:
        function(fn)(*args)
    assert "\n" not in str(info.value)


def test_bad_pipeline_is_refused_up_front():
    with pytest.raises(PassError, match="no-such-pass.*valid passes"):
        function(lambda x: x, passes="dce,no-such-pass")


def test_decorator_form():
    @function(passes="dce")
    def halve(x):
        return x / 2.0

    np.testing.assert_array_equal(halve(np.array([2.0, 4.0], np.float32)).numpy(), [1.0, 2.0])
    assert halve.__name__ == "halve"


# --- Done means: a TF conv training step with 4-way spatial partitioning -------------------------

SPATIAL_PASSES = "spatial-partitioning{num_partitions=4}"


def conv_model():
    rng = np.random.default_rng(3)
    return {"kernel": tf.Variable(0.3 * rng.standard_normal((3, 3, 2, 4)).astype(np.float32)),
            "bias": tf.Variable(np.zeros(4, np.float32)),
            "dense": tf.Variable(0.3 * rng.standard_normal((4, 3)).astype(np.float32)),
            "velocity": tf.Variable(np.zeros((3, 3, 2, 4), np.float32))}


def conv_step(model):
    """Conv2D + relu + global average pooling + dense + softmax cross-entropy, SGD with momentum."""

    def step(images, labels):
        params = [model["kernel"], model["bias"], model["dense"]]
        with tf.GradientTape() as tape:
            features = tf.nn.relu(tf.nn.conv2d(images, model["kernel"], 1, "SAME") + model["bias"])
            logits = tf.matmul(tf.reduce_mean(features, axis=[1, 2]), model["dense"])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        grads = tape.gradient(loss, params)
        model["velocity"].assign(0.9 * model["velocity"] + grads[0])
        model["kernel"].assign_sub(0.1 * model["velocity"])
        for param, grad in zip(params[1:], grads[1:]):
            param.assign_sub(0.1 * grad)
        return loss

    return step


def conv_batch():
    rng = np.random.default_rng(4)
    return (rng.standard_normal((4, 16, 16, 2)).astype(np.float32),
            rng.integers(0, 3, size=4).astype(np.int32))


def run_conv_steps(passes, steps):
    """Train the conv model `steps` steps through the front end and with TF; compare after each."""
    ours_model, tf_model = conv_model(), conv_model()
    ours = function(conv_step(ours_model), passes=passes)
    reference = tf.function(conv_step(tf_model), jit_compile=True)
    images, labels = conv_batch()
    losses = []
    for number in range(steps):
        loss = ours(images, labels)
        assert_same(loss, reference(images, labels), f"loss of step {number}")
        for name in tf_model:
            assert_same(ours_model[name], tf_model[name], f"{name} after step {number}")
        losses.append(float(loss.numpy()))
    assert losses[-1] < losses[0]  # it trains
    return ours


def test_conv_training_step_on_one_device_matches_tf():
    run_conv_steps("cse,dce", steps=3)


needs_spatial_partitioning = pytest.mark.skipif(
    "spatial-partitioning" not in xla_passes.registered_passes(),
    reason="the spatial-partitioning pass is not registered yet")


@needs_spatial_partitioning
def test_conv_training_step_with_spatial_partitioning_matches_tf():
    ours = run_conv_steps(SPATIAL_PASSES, steps=4)
    module = hlo_tools.parse_module(ours.module_text(*conv_batch()))
    assert module.num_partitions == 4
    images = module.entry.parameter(0)
    assert images.shape.dims == (4, 4, 16, 2) and images.attrs["sharding"].tile_dims == (1, 4, 1, 1)
    opcodes = {instr.opcode for instr in module.instructions()}
    assert "collective-permute" in opcodes and "all-gather" not in opcodes  # halos, not whole images
