"""weight-update-sharding in a real client with no code change.

An unmodified Flax + Optax data-parallel training loop (tests/workers/wus_worker.py: a
small MLP, shard_map under jit over 8 CPU devices, `lax.pmean` of the
gradients) runs 5 steps in a subprocess with
`XLA_PASSES=weight-update-sharding XLA_PASSES_STRICT=1 XLA_PASSES_DUMP_TO=...`
and once without: the losses and the final parameters must agree, and the dump
of the training step must show the gradient all-reduces before the pass and a
reduce-scatter / all-gather pair around the sharded update after it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import hlo_tools
from support import xla_flags_for_tests

pytest.importorskip("flax")
pytest.importorskip("optax")

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
WORKER = os.path.join(TESTS_DIR, "workers", "wus_worker.py")
PASS = "weight-update-sharding"
# The Dense kernels of the worker's MLP (64 -> 128 -> 128 -> 10). The biases (at most 512 bytes)
# are below the pass's default threshold_bytes=1024 and stay replicated.
KERNELS = [(64, 128), (128, 128), (128, 10)]
STATE_PER_WEIGHT = {"adam": 2, "momentum": 1}  # optimizer state all-gathered besides the weight


def run_worker(optimizer: str, out, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    full_env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_for_tests(),
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, base.get("PYTHONPATH")])),
                **(env or {})}
    result = subprocess.run([sys.executable, WORKER, optimizer, str(out), "--steps", "5"], env=full_env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"worker failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return result


def collectives(path) -> dict[str, list[tuple[int, ...]]]:
    """Shapes of the all-reduces, reduce-scatters and all-gathers of a dumped module (array results only)."""
    with open(path, encoding="utf-8") as f:
        module = hlo_tools.parse_module(f.read())
    found: dict[str, list[tuple[int, ...]]] = {"all-reduce": [], "reduce-scatter": [], "all-gather": []}
    for instr in module.instructions():
        if instr.opcode in found:
            shapes = instr.shape.tuple_shapes if instr.shape.is_tuple else [instr.shape]
            found[instr.opcode].extend(tuple(s.dims) for s in shapes)
    return found


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_flax_training_with_weight_update_sharding_tracks_the_plain_run(optimizer, tmp_path):
    dump = tmp_path / "dump"
    run_worker(optimizer, tmp_path / "plain.npz")
    run_worker(optimizer, tmp_path / "sharded.npz",
               env={"XLA_PASSES": PASS, "XLA_PASSES_STRICT": "1", "XLA_PASSES_DUMP_TO": str(dump)})
    plain, sharded = np.load(tmp_path / "plain.npz"), np.load(tmp_path / "sharded.npz")
    assert sorted(plain.files) == sorted(sharded.files)
    assert len(plain["losses"]) == 5 and plain["losses"][-1] < plain["losses"][0]  # it trains
    for name in plain.files:
        np.testing.assert_allclose(sharded[name], plain[name], rtol=1e-5, atol=1e-6, err_msg=name)

    [before] = dump.glob("module_*.jit_train_step.before_xla_passes.txt")
    [after] = dump.glob(f"module_*.jit_train_step.0001.after_{PASS}.txt")
    before, after = collectives(before), collectives(after)
    # Before: every kernel's gradient is all-reduced in full; nothing is scattered or gathered.
    for kernel in KERNELS:
        assert kernel in before["all-reduce"], (kernel, before)
    assert before["reduce-scatter"] == [] and before["all-gather"] == []
    # After: each kernel's gradient is reduce-scattered to a 1/8 slice along dimension 0, the update
    # runs on that slice, and the new weight and optimizer state are all-gathered back to full size.
    for rows, cols in KERNELS:
        assert (rows, cols) not in after["all-reduce"], ((rows, cols), after)
        assert (rows // 8, cols) in after["reduce-scatter"], ((rows, cols), after)
        assert after["all-gather"].count((rows, cols)) == 1 + STATE_PER_WEIGHT[optimizer], ((rows, cols), after)
    assert len(after["reduce-scatter"]) == len(KERNELS)
