"""What a step costs through `xla_passes.tensorflow.function`, and why it compiles once per signature.

The step is the conv training step of tests/frontends/test_tensorflow_frontend.py
(Conv2D + relu + global pooling + dense + cross-entropy, SGD with momentum,
batch 4 of 16x16x2 images). It is timed, median of ``--steps`` calls, as:

a. TF's own ``tf.function(jit_compile=True)`` step;
b. the front end with no passes (TF's module on 1 device), executable cached;
c. the front end with ``spatial-partitioning`` on 4 devices (when registered);
d. the same module as b, run with ``hlo_tools.xla.runner.run_module`` each step:
   XLA compiles it again every time (what the front end would cost without its cache);
e. as d, with ``isolate=True``: a child process per step (what a non-persistent
   child would cost).

plus the first call of b and c: tracing, TF's HLO, the pipeline and the compile.

Run from the repository root: ``.venv/bin/python benchmarks/tensorflow_frontend.py``.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["JAX_PLATFORMS"] = "cpu"
for _variable in [name for name in os.environ if name.startswith("XLA_PASSES")]:
    del os.environ[_variable]  # the passes are given per configuration

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import tensorflow as tf  # noqa: E402

import xla_passes  # noqa: E402
from hlo_tools.xla import runner  # noqa: E402
from xla_passes.tensorflow import function  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "frontends"))
from test_tensorflow_frontend import SPATIAL_PASSES, conv_batch, conv_model, conv_step  # noqa: E402


def median_ms(call, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def first_call_ms(step, batch) -> float:
    start = time.perf_counter()
    step(*batch)
    return 1e3 * (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=30, help="calls timed per cached configuration")
    parser.add_argument("--compiling_steps", type=int, default=5,
                        help="calls timed per configuration that compiles every step")
    args = parser.parse_args()
    batch = conv_batch()
    rows = []

    reference = tf.function(conv_step(conv_model()), jit_compile=True)
    reference(*batch)
    rows.append(("a", "TF tf.function(jit_compile=True)", median_ms(lambda: reference(*batch), args.steps)))

    plain = function(conv_step(conv_model()))
    first_plain = first_call_ms(plain, batch)
    rows.append(("b", "front end, no passes, 1 device", median_ms(lambda: plain(*batch), args.steps)))
    if "spatial-partitioning" in xla_passes.registered_passes():
        spatial = function(conv_step(conv_model()), passes=SPATIAL_PASSES)
        first_spatial = first_call_ms(spatial, batch)
        rows.append(("c", f"front end, {SPATIAL_PASSES}", median_ms(lambda: spatial(*batch), args.steps)))

    text = plain.module_text(*batch)
    inputs = runner.run_module(text).inputs  # seeded inputs of the module's own signature
    rows.append(("d", "run_module per step (compiles each time)",
                 median_ms(lambda: runner.run_module(text, inputs), args.compiling_steps)))
    rows.append(("e", "run_module(isolate=True) per step",
                 median_ms(lambda: runner.run_module(text, inputs, isolate=True), args.compiling_steps)))

    print(f"{'':2} {'configuration':60} {'median ms/step':>15}")
    for key, label, ms in rows:
        print(f"{key:2} {label:60} {ms:15.2f}")
    print(f"first call (trace, HLO, passes, compile): no passes {first_plain:.0f} ms", end="")
    if "spatial-partitioning" in xla_passes.registered_passes():
        print(f", {SPATIAL_PASSES} {first_spatial:.0f} ms", end="")
    print()


if __name__ == "__main__":
    main()
