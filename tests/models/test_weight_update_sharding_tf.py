"""weight-update-sharding on Keras training steps, made data-parallel in our IR.

TensorFlow on CPU cannot emit cross-replica collectives, so the data-parallel program is
built here: a worker (this file run as a script, which keeps TF's own copy of XLA out of the
test process) writes the HLO (`experimental_get_compiler_ir(...)(stage="hlo")`) of Keras
training steps: a small Dense model, `tf.GradientTape`, and `optimizer.apply_gradients` of
each Keras optimizer form on the model's resource variables (the variables, the learning
rate, the iteration counter and the optimizer's slots are parameters of the module, their
new values outputs). `data_parallel` then makes each step the program that every replica
of MirroredStrategy runs: variables the same on every replica (`parameter_replication`),
a batch of its own, and each gradient (the tape's result, which TF names
`gradient_tape/...`, where the optimizer reads it) all-reduced over the 8 replicas and
divided by 8. The pass must compute what that program computes, on 8 CPU devices.
"""
from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from support import run_keras_tf_child

import hlo_tools
import xla_passes
from hlo_tools import HloComputation, Shape
from hlo_tools.xla import runner
from hlo_tools.ir.attributes import Raw, ReplicaGroups
from hlo_tools.ir.literal import Literal, numpy_dtype

REPLICAS = 8
BATCH_ARGUMENTS = 2  # the step's own arguments (images, labels) come first; variables follow
PASS = "weight-update-sharding{threshold_bytes=0}"
# The Keras optimizer forms, and how many optimizer slots per weight are all-gathered besides it.
OPTIMIZERS = {
    "sgd": lambda keras: keras.optimizers.SGD(0.1),
    "momentum": lambda keras: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda keras: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda keras: keras.optimizers.Adam(1e-3),
    "adamw": lambda keras: keras.optimizers.AdamW(1e-3, weight_decay=1e-2),
    "adam_global_clipnorm": lambda keras: keras.optimizers.Adam(1e-3, global_clipnorm=1.0),
    "momentum_clipnorm": lambda keras: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=1.0),
}
SLOTS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2, "adam_global_clipnorm": 2,
         "momentum_clipnorm": 1}
# Dense(16 -> 32, tanh), Dense(32 -> 4): kernels split along dimension 0, the 4-wide bias is padded.
WEIGHTS = 4


def _write_keras_steps(target: str) -> None:
    """Worker: the HLO of one Keras training step per optimizer, as JSON."""
    import tensorflow as tf

    def compiled_step(optimizer):
        model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(32, activation="tanh"),
                                     tf.keras.layers.Dense(4)])
        optimizer.build(model.trainable_variables)  # slots exist before tracing

        @tf.function(jit_compile=True)
        def train_step(images, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(images) - labels))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        return train_step.experimental_get_compiler_ir(tf.ones([8, 16]), tf.ones([8, 4]))(stage="hlo")

    texts = {name: compiled_step(make_optimizer(tf.keras)) for name, make_optimizer in OPTIMIZERS.items()}
    with open(target, "w", encoding="utf-8") as f:
        json.dump(texts, f)


@pytest.fixture(scope="module")
def keras_steps(tmp_path_factory) -> dict[str, str]:
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed (pip install -e '.[tensorflow]')")
    return run_keras_tf_child(__file__, tmp_path_factory.mktemp("keras") / "steps.json", timeout=300)


# --- the data-parallel program --------------------------------------------------------------------------

def _on_tape(instr) -> bool:
    metadata = instr.attrs.get("metadata")
    op_name = metadata.get("op_name") if metadata is not None else None
    return isinstance(op_name, str) and op_name.startswith("gradient_tape/")


def _sum_computation(module, dtype: str):
    comp = HloComputation(f"sum_{dtype}")
    a, b = (comp.add_parameter(Shape.array(dtype, ()), name) for name in ("a", "b"))
    comp.set_root(comp.add_instruction("add", [a, b], name="a_plus_b"))
    return module.add_computation(comp)


def data_parallel(text: str, replicas: int = REPLICAS, batch_arguments: int = BATCH_ARGUMENTS):
    """The step as every replica of a data-parallel run executes it: the variables replicated,
    each gradient replaced, where values off the tape read it, by its mean over the replicas."""
    module = hlo_tools.parse_module(text)
    entry = module.entry
    module.set_attr("replica_count", replicas)
    for param in entry.parameters[batch_arguments:]:
        param.attrs["parameter_replication"] = Raw("{true}")
    reducers = {}
    gradients = [i for i in entry.instructions if _on_tape(i) and i.shape.is_array and i.shape.rank > 0
                 and any(not _on_tape(u) for u in i.users)]
    for grad in gradients:
        dtype = grad.shape.dtype
        if dtype not in reducers:
            reducers[dtype] = _sum_computation(module, dtype)
        readers = [u for u in grad.users if not _on_tape(u)]
        total = entry.add_instruction(
            "all-reduce", [grad], grad.shape, after=grad, name=f"{grad.name}.sum",
            attrs={"replica_groups": ReplicaGroups.of([list(range(replicas))]), "to_apply": reducers[dtype]})
        count = entry.add_instruction("constant", literal=Literal.from_numpy(np.array(replicas, numpy_dtype(dtype))),
                                      after=total, name="replicas")
        counts = entry.add_instruction("broadcast", [count], grad.shape, attrs={"dimensions": ()}, after=count)
        mean = entry.add_instruction("divide", [total, counts], after=counts, name=f"{grad.name}.mean")
        for reader in readers:
            reader.replace_operand_with(grad, mean)
    return module, gradients


def _replica_inputs(module, seed: int = 0) -> list[np.ndarray]:
    """Per replica (leading axis): its own batch; the same variables, rate and iteration count."""
    rng = np.random.default_rng(seed)
    arrays = []
    for param in module.entry.parameters:
        dims = param.shape.dims
        if param.shape.dtype in ("s64", "s32"):
            value = np.full(dims, 3, dtype=np.int64 if param.shape.dtype == "s64" else np.int32)
            arrays.append(np.stack([value] * REPLICAS))
        elif param.parameter_number < BATCH_ARGUMENTS:
            arrays.append(rng.uniform(0.5, 1.5, (REPLICAS, *dims)).astype(np.float32))
        else:
            arrays.append(np.stack([rng.uniform(0.5, 1.5, dims).astype(np.float32)] * REPLICAS))
    return arrays


def test_data_parallel_finds_each_gradient_where_the_optimizer_reads_it(keras_steps):
    module, gradients = data_parallel(keras_steps["adam"])
    assert sorted(g.shape.dims for g in gradients) == sorted([(16, 32), (32,), (32, 4), (4,)])
    for grad in gradients:
        (total,) = [u for u in grad.users if u.opcode == "all-reduce"]
        (mean,) = total.users
        assert mean.opcode == "divide" and mean.users and not any(_on_tape(u) for u in mean.users)


# --- weight-update sharding --------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_keras_steps_compute_the_same_when_sharded(keras_steps, optimizer):
    module, _ = data_parallel(keras_steps[optimizer])
    text = module.to_text()
    passes = xla_passes.parse_pipeline(PASS)
    assert xla_passes.run_passes(module, passes)
    report = passes[0].report
    assert len(report) == WEIGHTS and all(r.sharded for r in report), [str(r) for r in report]

    result, reference, comparison = runner.compare_modules(
        module.to_text(), text, _replica_inputs(hlo_tools.parse_module(text)),
        abs_error_bound=1e-5, rel_error_bound=1e-5)
    assert comparison.ok, comparison.format()
    # It is a data-parallel step: each replica's loss is its own batch's, while the new
    # variables, slots and iteration count are the same on every replica (outputs stacked per replica).
    losses = reference.outputs[0]
    assert len(np.unique(losses)) == REPLICAS
    for output in result.outputs[1:]:
        assert all(np.array_equal(output[0], output[k]) for k in range(1, REPLICAS))

    opcodes = [i.opcode for i in module.entry.instructions]
    slots = SLOTS[optimizer]
    assert opcodes.count("reduce-scatter") == WEIGHTS
    assert opcodes.count("all-gather") == WEIGHTS * (1 + slots)
    remaining = [i for i in module.entry.instructions if i.opcode == "all-reduce"]
    # what stays an all-reduce: the partial sums of squares of clipping (one scalar per weight)
    assert all(i.shape.rank == 0 and i.operand(0).opcode == "reduce" for i in remaining)
    assert len(remaining) == (WEIGHTS if "clipnorm" in optimizer else 0)
    root_shapes = [s.to_text(print_layout=False) for s in module.entry.root.shape.tuple_shapes]
    assert "s64[]" in root_shapes  # Keras's iteration counter is returned unsharded


if __name__ == "__main__":
    _write_keras_steps(sys.argv[1])
