"""A TensorFlow training step, compiled by XLA, run through hlo_tools.xla.runner: same outputs as TF.

The step (a small dense model, ``tf.GradientTape``, an SGD update of weights
passed in as arguments, returning the new weights and the loss) is a
``tf.function(jit_compile=True)``.  TensorFlow runs in a subprocess (this file
run as a script), so TF's own copy of XLA stays out of the test process: the
worker writes the step's HLO (TF's ``hlo`` and ``optimized_hlo`` stages), the
inputs and TF's outputs; the test runs each module with ``run_module`` on one
device and compares.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

LEARNING_RATE = 0.1
# (batch, features, hidden, outputs)
SIZES = (16, 8, 32, 4)
STAGES = ("hlo", "optimized_hlo")


def _write_train_step_case(target_dir: str) -> None:
    """Worker: trace, compile and run the TF step; write HLO text, inputs and TF's outputs."""
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def train_step(w1, b1, w2, b2, x, y):
        params = [w1, b1, w2, b2]
        with tf.GradientTape() as tape:
            tape.watch(params)  # plain tensors, not variables: the tape must be told
            hidden = tf.nn.relu(tf.matmul(x, w1) + b1)
            loss = tf.reduce_mean(tf.square(tf.matmul(hidden, w2) + b2 - y))
        grads = tape.gradient(loss, params)
        return (*[p - LEARNING_RATE * g for p, g in zip(params, grads)], loss)

    batch, features, hidden, outputs = SIZES
    rng = np.random.default_rng(0)
    shapes = [(features, hidden), (hidden,), (hidden, outputs), (outputs,), (batch, features),
              (batch, outputs)]
    inputs = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    tensors = [tf.constant(a) for a in inputs]
    compiler_ir = train_step.experimental_get_compiler_ir(*tensors)
    texts = {stage: compiler_ir(stage=stage) for stage in STAGES}
    results = [r.numpy() for r in train_step(*tensors)]
    with open(os.path.join(target_dir, "modules.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f)
    np.savez(os.path.join(target_dir, "inputs.npz"), **{f"arg{i}": a for i, a in enumerate(inputs)})
    np.savez(os.path.join(target_dir, "tf_outputs.npz"),
             **{f"out{i}": a for i, a in enumerate(results)})


@pytest.fixture(scope="module")
def tf_train_step(tmp_path_factory):
    """(HLO text by TF stage, inputs, TF's outputs) of the TF training step."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed (pip install -e '.[tensorflow]')")
    work_dir = tmp_path_factory.mktemp("tf_train_step")
    done = subprocess.run([sys.executable, __file__, str(work_dir)],
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(work_dir / "modules.json", encoding="utf-8") as f:
        texts = json.load(f)
    with np.load(work_dir / "inputs.npz") as data:
        inputs = [data[f"arg{i}"] for i in range(len(data.files))]
    with np.load(work_dir / "tf_outputs.npz") as data:
        expected = [data[f"out{i}"] for i in range(len(data.files))]
    return texts, inputs, expected


@pytest.mark.parametrize("stage", STAGES)
def test_tf_train_step_runs_like_tf(tf_train_step, stage):
    from hlo_tools.xla import runner

    texts, inputs, expected = tf_train_step
    result = runner.run_module(texts[stage], inputs)
    # TF's optimized module is scheduled, so it is compiled from XLA's post-scheduler stage on
    compiled_from = {"hlo": "", "optimized_hlo": ", compiled from XLA's post_scheduler stage"}[stage]
    assert (result.mode, result.describe()) == ("single", f"1 device{compiled_from}")
    assert [a.shape for a in result.outputs] == [a.shape for a in expected]
    for index, (got, want) in enumerate(zip(result.outputs, expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"out{index}")
    # The step really trained: every weight moved, and the loss is that of the old weights.
    for old, new in zip(inputs[:4], result.outputs[:4]):
        assert not np.allclose(old, new)
    w1, b1, w2, b2, x, y = inputs
    loss = np.mean((np.maximum(x @ w1 + b1, 0) @ w2 + b2 - y) ** 2)
    np.testing.assert_allclose(result.outputs[4], loss, rtol=1e-5)


if __name__ == "__main__":
    _write_train_step_case(sys.argv[1])
