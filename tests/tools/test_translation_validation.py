"""Translation validation (`XLA_PASSES_CHECK=1`, `enable(check=True)`, `xla-opt --check`) catches a
wrong rewrite and keeps the original module.

The wrong rewrite comes from `test-perturb-constant` (tests/workers/translation_validation_worker.py),
which changes one constant: the verifier cannot see it, only running the module can. The
worker runs a weight-update-sharding step on 8 CPU devices in a subprocess, since the JAX
plugin reads the variables when JAX starts its backend.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hlo_tools
import xla_passes.jax
from xla_passes.frontends.configuration import ConfigurationError, settings_from_environment
from xla_passes.analysis.replica_groups import DeviceCounts, inferred_device_counts

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(TESTS_DIR, "workers", "translation_validation_worker.py")
WRONG = "weight-update-sharding,test-perturb-constant"


def run_worker(tmp_path, name: str, **variables) -> tuple[np.ndarray, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    env.update(variables)
    out = tmp_path / f"{name}.npz"
    result = subprocess.run([sys.executable, WORKER, str(out)], env=env, capture_output=True, text=True,
                            timeout=300)
    return (np.load(out)["w"] if result.returncode == 0 else None), result


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> np.ndarray:
    weights, result = run_worker(tmp_path_factory.mktemp("plain"), "plain")
    assert result.returncode == 0, result.stderr
    return weights


def test_the_perturbing_pass_really_changes_the_numbers(plain, tmp_path):
    weights, result = run_worker(tmp_path, "wrong", XLA_PASSES=WRONG)
    assert result.returncode == 0, result.stderr
    assert np.abs(weights - plain).max() > 1e-4


def test_check_catches_the_wrong_rewrite_and_keeps_the_original(plain, tmp_path):
    weights, result = run_worker(tmp_path, "checked", XLA_PASSES=WRONG, XLA_PASSES_CHECK="1")
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(weights, plain)
    warnings = [line for line in result.stderr.splitlines() if "XLA_PASSES_CHECK" in line]
    assert len(warnings) == 1, result.stderr
    # weight-update-sharding alone passed its check; the perturbation is named, with the output
    assert "pass test-perturb-constant" in warnings[0]
    assert "output 0 of 1 on device 0" in warnings[0] and "MISMATCH" in warnings[0]
    assert "XLA compiles the module unchanged" in warnings[0]


def test_strict_check_fails_the_compile(tmp_path):
    weights, result = run_worker(tmp_path, "strict", XLA_PASSES=WRONG, XLA_PASSES_CHECK="1", XLA_PASSES_STRICT="1")
    assert weights is None and result.returncode != 0
    assert "pass test-perturb-constant: XLA_PASSES_CHECK: the rewritten module computes something else" \
        in result.stderr


def test_a_correct_rewrite_passes_the_check_in_process(caplog):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(w, m, x):
        grad = jax.grad(lambda w: jnp.sum(jnp.einsum("b...,...->...", x, w) ** 2))(w)
        m = 0.9 * m + grad
        return w - 0.01 * m, m

    rng = np.random.default_rng(1)
    w, m = (jax.device_put(rng.standard_normal((3, 3, 16, 16)).astype(np.float32), replicated) for _ in range(2))
    x = jax.device_put(rng.standard_normal((8, 3, 3, 16, 16)).astype(np.float32), batch)
    compiled = jax.jit(step, in_shardings=(replicated, replicated, batch), out_shardings=(replicated, replicated))
    expected = compiled(w, m, x)
    jax.clear_caches()
    with caplog.at_level(logging.INFO, logger="xla_passes"), \
            xla_passes.jax.enable("weight-update-sharding", check=True, strict=True):
        got = jax.jit(step, in_shardings=(replicated, replicated, batch), out_shardings=(replicated, replicated))(
            w, m, x)
    jax.clear_caches()
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert any("checked in" in r.getMessage() and "2 outputs equal on 8 devices" in r.getMessage()
               for r in caplog.records), caplog.text
    assert any("weight-update-sharding: sharded" in r.getMessage() for r in caplog.records)


def test_xla_opt_check_refuses_a_wrong_rewrite_and_writes_nothing(tmp_path):
    text = jax.jit(lambda x: jnp.tanh(x) * 3.0).lower(jnp.ones((8, 8))).compiler_ir("hlo").as_hlo_text()
    source, out = tmp_path / "in.hlo", tmp_path / "out.hlo"
    source.write_text(text)
    program = ("import runpy, sys; runpy.run_path(sys.argv[1]);"  # registers test-perturb-constant
               "from xla_passes.tools.opt import main; sys.exit(main(sys.argv[2:]))")
    result = subprocess.run([sys.executable, "-c", program, WORKER, str(source), "--passes=test-perturb-constant",
                             "--check", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and not out.exists()
    assert result.stderr.startswith("xla-opt: error: --check: ") and result.stderr.count("\n") == 1
    assert "computes something else than before: out0: f32[8,8] MISMATCH" in result.stderr


def test_xla_opt_check_passes_a_correct_rewrite(tmp_path):
    text = jax.jit(lambda x, y: (x + y) * 2.0).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compiler_ir(
        "hlo").as_hlo_text()
    source, out = tmp_path / "in.hlo", tmp_path / "out.hlo"
    source.write_text(text)
    result = subprocess.run([sys.executable, "-m", "xla_passes.tools.opt", str(source), "--passes=cse,dce", "--check",
                             "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert out.exists()


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_check_variable(value, expected):
    settings = settings_from_environment({"XLA_PASSES": "dce", "XLA_PASSES_CHECK": value})
    assert settings.check is expected


def test_a_bad_check_value_is_an_error():
    with pytest.raises(ConfigurationError, match="XLA_PASSES_CHECK='maybe' is not a yes/no value"):
        settings_from_environment({"XLA_PASSES": "dce", "XLA_PASSES_CHECK": "maybe"})


DEVICE_COUNT_CASES = {
    "flattened ids, as jit and shard_map modules at the hook": (
        "p = f32[8] parameter(0)\n  ROOT r = f32[8] all-reduce(p), channel_id=1, replica_groups={{0,1,2,3}}, "
        "use_global_device_ids=true, to_apply=add", DeviceCounts(1, 4)),
    "cross-replica groups, as pmap": (
        "p = f32[8] parameter(0)\n  ROOT r = f32[8] all-reduce(p), replica_groups={{0,1},{2,3},{4,5}}, "
        "to_apply=add", DeviceCounts(6, 1)),
    "a tiled parameter sharding": (
        "p = f32[8] parameter(0), sharding={devices=[2]<=[2]}\n  ROOT r = f32[8] negate(p)", DeviceCounts(1, 2)),
    "devices that never talk": ("p = f32[8] parameter(0)\n  ROOT r = f32[8] negate(p)", DeviceCounts(1, 1)),
    "a device id read with nothing else to go by": (
        "ROOT r = u32[] partition-id()", None),
}


@pytest.mark.parametrize("case", sorted(DEVICE_COUNT_CASES))
def test_device_counts_of_hook_modules(case):
    body, expected = DEVICE_COUNT_CASES[case]
    text = (f"HloModule m\n\nadd {{\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT s = f32[] add(a, b)\n}}"
            f"\n\nENTRY e {{\n  {body}\n}}\n")
    assert inferred_device_counts(hlo_tools.parse_module(text)) == expected
