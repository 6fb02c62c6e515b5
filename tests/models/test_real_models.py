"""weight-update-sharding and collective-fusion on real library models give the plain run's numbers.

Each model of tests/workers/real_model_worker.py (a Flax BatchNorm ResNet with AdamW, and
Keras 3 applications at test size, tests/helpers/keras_applications.py: ResNet50's blocks with
Adam, EfficientNetB0's with momentum SGD, MobileNetV3Small's and ConvNeXtTiny's with LAMB)
trains 3 steps data parallel over 8 CPU devices in subprocesses: plain, with
XLA_PASSES=weight-update-sharding and (but for the LAMB models) with
XLA_PASSES=collective-fusion, with XLA_PASSES_STRICT=1, so that a failing pass fails the run.
The plain run shares the weight-update-sharding run's process (the worker's --plain-first:
the passes turned off for it), and so its imports and the model's initializer programs.
The losses and every final weight, BatchNorm statistic and optimizer state must equal the
plain run's up to the rounding of a reordered sum, and the training step must show that the
pass did its work:

- The MobileNetV3 trains in float64. In float32 the full MobileNetV3Small put 24 of its 497
  arrays further from plain than TOLERANCE after 3 steps with the pass (up to 2.5e-5), and
  that is rounding: the plain run alone, compiled for AVX2 instead of AVX-512
  (`--xla_cpu_max_isa=AVX2`), put 45 arrays beyond it (up to 1.3e-3). Its `project_bn/beta`s
  feed a 1x1 convolution and then a BatchNorm, so their exact gradient is 0, and LAMB scales
  the rounding left in it (and in the moments and statistics downstream) to steps of
  learning-rate size. In float64 the pass's run equals plain's to within FLOAT64_TOLERANCE;
  a wrong rewrite moves weights by the learning rate.

- weight-update-sharding shards the update of every convolution kernel, the
  depthwise ones too (XLA all-reduces their gradient as [h, w, 1, C] and the
  update's fusion bitcasts it to the kernel's [h, w, C, 1], which the pass
  moves before the all-reduce). Convnet
  kernels are where splitting a dimension whose slices are not contiguous in
  XLA's layout used to give wrong numbers at the JAX hook (each of the three
  full models caught it), EfficientNet's squeeze-excitation (1, 1, C, K) kernels
  among them.
- collective-fusion runs with XLA's own CPU all-reduce combiner switched off.
  With it on, XLA has already combined every independent all-reduce (the
  weight gradients, into tuples) and what is left is a chain, each all-reduce
  depending on the one before: BatchNorm statistics forward, and backward the
  BatchNorm gradients that backpropagation reads; the pass changes nothing.
  With it off, the pass must do that combining itself, and at least halves the
  training step's all-reduces.

Every worker prints the time of each step (the first one compiles); the test
prints them with the wall time of each run (pytest -rA or -s shows them).
"""
from __future__ import annotations

import collections
import importlib.util
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import hlo_tools
from real_model_worker import STEP_TIMES_PREFIX
from support import xla_flags_for_tests
from xla_passes_demo.training import NO_XLA_COMBINER

# Keras 3 applications and a Flax ResNet trained in subprocesses, plain and with each pass: minutes each.
pytestmark = pytest.mark.slow

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
WORKER = os.path.join(TESTS_DIR, "workers", "real_model_worker.py")
STEPS = 3
TRAIN_STEP = "jit_train_step"  # the module name of every model's training step
# The plain and the transformed runs must agree up to the rounding of a reordered reduction.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
FLOAT64_TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}
NO_XLA_COMBINER_FLAG = " ".join(f"--{flag}={value}" for flag, value in NO_XLA_COMBINER.items())
REQUIRED_MODULES = {"flax-resnet": ("flax", "optax"), "keras-resnet": ("keras",), "keras-efficientnet": ("keras",),
                    "keras-mobilenetv3-lamb": ("keras",), "keras-convnext-lamb": ("keras",)}
FLOAT64_MODELS = {"keras-mobilenetv3-lamb"}
# The models that test collective-fusion too (the LAMB ones are here for weight-update-sharding's norms).
COLLECTIVE_FUSION_MODELS = {"flax-resnet", "keras-resnet", "keras-efficientnet"}

# "xla_passes INFO xla_passes: module_0052 jit_train_step: changed by weight-update-sharding in 1185.5 ms"
MODULE_LINE = re.compile(r"xla_passes: module_\d+ (?P<name>\S+): (?P<outcome>.*) in [\d.]+ ms$")
# "xla_passes INFO weight-update-sharding: sharded %all-reduce.533[7] f32[256] (...) over 8 devices, ..."
WEIGHT_LINE = re.compile(r"weight-update-sharding: (?P<verdict>sharded|kept) .*?\s[a-z]+\d+\[(?P<dims>[\d,]*)\]")
STEP_TIMES_LINE = re.compile(re.escape(STEP_TIMES_PREFIX) + r" (?P<seconds>.*)")


def run_worker(model: str, out, env: dict[str, str], plain_out=None) -> tuple[str, float]:
    """Train `model` in a fresh process with `env` added (no XLA_PASSES* of the caller's), in float64 for
    FLOAT64_MODELS, after a plain run saved to `plain_out` if given; its stderr and wall time."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    full_env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_for_tests(), "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, base.get("PYTHONPATH")])), **env}
    start = time.perf_counter()
    options = (["--float64"] if model in FLOAT64_MODELS else []) + (["--plain-first", str(plain_out)] if plain_out else [])
    result = subprocess.run([sys.executable, WORKER, model, str(out), "--steps", str(STEPS), *options], env=full_env,
                            capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, f"worker failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return result.stderr, seconds


def train_step_log(stderr: str) -> tuple[str, list[tuple[str, tuple[int, ...]]]]:
    """What the plugin did with the training step ("changed by ...", "unchanged"), and the
    weight-update-sharding verdict ("sharded" or "kept") and gradient shape of each of its weights."""
    found, weights = [], []
    for line in stderr.splitlines():
        if weight := WEIGHT_LINE.search(line):
            weights.append((weight["verdict"], tuple(int(d) for d in weight["dims"].split(",") if d)))
        elif module := MODULE_LINE.search(line):
            if module["name"] == TRAIN_STEP:
                found.append((module["outcome"], weights))
            weights = []
    assert len(found) == 1, f"expected one {TRAIN_STEP} module in the log, found {len(found)}:\n{stderr[-4000:]}"
    return found[0]


def convolution_kernel_shapes(weights) -> collections.Counter:
    """Shapes of the model's 4-D kernels (depthwise ones: Keras's (h, w, channels, 1))."""
    return collections.Counter(
        weights[name].shape for name in weights.files
        if name.endswith(("/kernel", "['kernel']")) and not name.startswith("opt_state")
        and weights[name].ndim == 4)


def entry_all_reduces(path) -> int:
    """All-reduces in the entry computation of a dumped module (a combined one counts once)."""
    with open(path, encoding="utf-8") as f:
        module = hlo_tools.parse_module(f.read(), lazy_bodies=True)
    return sum(instr.opcode == "all-reduce" for instr in module.entry.instructions)


def compare(plain, other, tolerance) -> tuple[float, float, list[str]]:
    """Largest absolute and relative differences over all arrays, and a line for each array beyond `tolerance`."""
    max_abs = max_rel = 0.0
    mismatches = []
    for name in plain.files:
        expected, actual = plain[name].astype(np.float64), other[name].astype(np.float64)
        difference = np.abs(actual - expected)
        relative = difference / np.maximum(np.abs(expected), np.finfo(np.float32).tiny)
        max_abs, max_rel = max(max_abs, float(difference.max(initial=0))), max(max_rel, float(relative.max(initial=0)))
        outside = ~np.isclose(actual, expected, **tolerance)
        if outside.any():
            mismatches.append(f"{name} {expected.shape}: {outside.sum()} elements differ, max abs "
                              f"{difference.max():.3g}, max rel {relative.max():.3g}")
    return max_abs, max_rel, mismatches


@pytest.mark.parametrize("model", list(REQUIRED_MODULES))
def test_passes_give_the_plain_run_numbers(model, tmp_path, compilation_cache_env):
    missing = [name for name in REQUIRED_MODULES[model] if importlib.util.find_spec(name) is None]
    if missing:  # not importorskip: importing Keras here would load its default backend, TensorFlow
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[test]')")
    runs = {
        "weight-update-sharding": {"XLA_PASSES": "weight-update-sharding"},
        "collective-fusion": {"XLA_PASSES": "collective-fusion", "XLA_FLAGS": xla_flags_for_tests(NO_XLA_COMBINER_FLAG)},
    }
    if model not in COLLECTIVE_FUSION_MODELS:
        del runs["collective-fusion"]
    logs = {}
    for run, env in runs.items():
        env = {**compilation_cache_env, **env, "XLA_PASSES_STRICT": "1", "XLA_PASSES_DUMP_TO": str(tmp_path / f"dump-{run}")}
        plain_out = tmp_path / "plain.npz" if run == "weight-update-sharding" else None
        logs[run], seconds = run_worker(model, tmp_path / f"{run}.npz", env, plain_out)
        steps = "; ".join(m["seconds"] for m in STEP_TIMES_LINE.finditer(logs[run]))
        print(f"{model} {'plain and ' if plain_out else ''}{run}: {seconds:.1f} s wall, steps {steps} s")

    plain = np.load(tmp_path / "plain.npz")
    assert plain["losses"].shape == (STEPS,) and np.isfinite(plain["losses"]).all(), plain["losses"]
    for run in runs:
        other = np.load(tmp_path / f"{run}.npz")
        assert sorted(other.files) == sorted(plain.files)
        tolerance = FLOAT64_TOLERANCE if model in FLOAT64_MODELS else TOLERANCE
        max_abs, max_rel, mismatches = compare(plain, other, tolerance)
        print(f"{model} {run}: {len(plain.files)} arrays, max abs difference {max_abs:.3g}, max rel {max_rel:.3g}")
        assert not mismatches, (f"{run} changed the numbers of {model} (dumps in {tmp_path / f'dump-{run}'}):\n"
                                + "\n".join(mismatches))

    outcome, weights = train_step_log(logs["weight-update-sharding"])
    assert outcome == "changed by weight-update-sharding", outcome
    sharded = collections.Counter(shape for verdict, shape in weights if verdict == "sharded")
    kernels = convolution_kernel_shapes(plain)
    print(f"{model} weight-update-sharding: sharded {sum(sharded.values())} of the {len(weights)} "
          f"updates it examined, the {sum(kernels.values())} convolution kernels among them")
    assert kernels and not kernels - sharded, f"kernels left replicated: {kernels - sharded}"

    if "collective-fusion" in runs:
        outcome, _ = train_step_log(logs["collective-fusion"])
        assert outcome == "changed by collective-fusion", outcome
        dump = tmp_path / "dump-collective-fusion"
        [before] = dump.glob(f"module_*.{TRAIN_STEP}.before_xla_passes.txt")
        [after] = dump.glob(f"module_*.{TRAIN_STEP}.0001.after_collective-fusion.txt")
        before, after = entry_all_reduces(before), entry_all_reduces(after)
        print(f"{model} collective-fusion: {before} all-reduces in the training step before, {after} after")
        assert 2 * after <= before, (before, after)

    for run in ["plain", *runs]:  # keep the weights (tens of MB a run) only when a check failed
        (tmp_path / f"{run}.npz").unlink()
