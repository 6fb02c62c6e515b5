"""weight-update-sharding at the flag with global-norm clipping (issue 13).

`optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(1e-3))` sums the squares of every
gradient into one global norm. At JAX's pass hook XLA:CPU computes each sum of squares as a
`reduce-window` of block partial sums (in a `kCustom` `__ynn_fusion` or a `kLoop` fusion;
padded from the identity where the windows do not divide the gradient, as for the [128,40] and
[40,10] kernels here) whose results a scalar fusion reduces again. The pass reads that as one
reduction of the full gradient: a reduction of the shard plus an all-reduce of the scalar.
Before, every weight stayed replicated (`kept ...: used by %ynn_fusion (fusion, kCustom with
reduce-window)`).

Each case trains a Flax MLP for 3 steps in a subprocess (this file is its own worker), once
plain and once with `XLA_PASSES=weight-update-sharding XLA_PASSES_STRICT=1`, and compares the
losses and parameters; the report (the `xla_passes` logger, on the worker's stderr) must show
every kernel sharded. MAX_NORM is below the gradients' global norm, so that the clip scales
every update (the test checks that it does). Adam's update hardly depends on a common scale of
the gradients, so SGD runs too: its update is proportional to the clip scale, and a norm
computed from one device's shard alone would change every number.

The hand-written modules of tests/passes/weight_update_sharding_clip.hlo (the hook's forms,
and the ones the pass refuses) run before and after the pass on 8 replicas as well.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from support import HELPERS_DIR, xla_flags_for_tests

pytest.importorskip("flax")
pytest.importorskip("optax")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
WIDTHS = (128, 40, 10)  # Dense layers on inputs of width 64: kernels [64,128], [128,40], [40,10]
INPUT_WIDTH = 64
MAX_NORM = 0.05
STEPS = 3
OPTIMIZERS = ("adam", "sgd")


def _clipped(name: str):
    import optax

    inner = {"adam": lambda: optax.adam(1e-3), "sgd": lambda: optax.sgd(0.1)}[name]()
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), inner)


# -- the worker (run as a script) ----------------------------------------------------------------------

def _train(style: str, optimizer_name: str, steps: int) -> dict[str, np.ndarray]:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from few_compiles import initial_state
    from jax.sharding import NamedSharding, PartitionSpec as P

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in WIDTHS[:-1]:
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(WIDTHS[-1])(x)

    model = MLP()
    optimizer = _clipped(optimizer_name)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))  # jax 0.12 defaults to Explicit

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    def update(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, optax.tree.norm(grads)

    def global_step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return (*update(params, state, grads), loss)

    def local_step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return (*update(params, state, jax.lax.pmean(grads, "data")), jax.lax.pmean(loss, "data"))

    if style == "jit_named_sharding":
        step = jax.jit(global_step)
    else:
        step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                     out_specs=(P(), P(), P(), P()), check_vma=style == "shard_map"))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, INPUT_WIDTH))), replicated)
    state = jax.device_put(initial_state(optimizer, params), replicated)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((8 * 16, INPUT_WIDTH), dtype=np.float32), batch)
    y = jax.device_put(rng.integers(0, WIDTHS[-1], 8 * 16).astype(np.int32), batch)
    losses, norms = [], []
    for _ in range(steps):
        params, state, norm, loss = step(params, state, x, y)
        losses.append(float(loss))
        norms.append(float(norm))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    result = {"losses": np.asarray(losses), "norms": np.asarray(norms)}
    result.update({"param" + jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat})
    return result


def _worker(argv: list[str]) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("xla_passes").setLevel(logging.INFO)  # the pass's report lines
    parser = argparse.ArgumentParser()
    parser.add_argument("style", choices=["shard_map", "jit_named_sharding", "pmap_style"])
    parser.add_argument("optimizer", choices=OPTIMIZERS)
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    np.savez(args.out, **_train(args.style, args.optimizer, args.steps))


# -- the tests -----------------------------------------------------------------------------------------

def _run_worker(style: str, optimizer: str, out, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    full_env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_for_tests(),
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, str(HELPERS_DIR), base.get("PYTHONPATH")])),
                **(env or {})}
    result = subprocess.run([sys.executable, os.path.abspath(__file__), style, optimizer, str(out)], env=full_env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"worker failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return result


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("style", ["shard_map", "jit_named_sharding", "pmap_style"])
def test_clip_by_global_norm_is_sharded_and_the_numbers_are_equal(style, optimizer, tmp_path):
    plain_run = _run_worker(style, optimizer, tmp_path / "plain.npz")
    sharded_run = _run_worker(style, optimizer, tmp_path / "sharded.npz",
                              env={"XLA_PASSES": "weight-update-sharding", "XLA_PASSES_STRICT": "1"})
    plain, sharded = np.load(tmp_path / "plain.npz"), np.load(tmp_path / "sharded.npz")
    assert sorted(plain.files) == sorted(sharded.files)
    assert len(plain["losses"]) == STEPS
    assert (plain["norms"] > 2 * MAX_NORM).all(), plain["norms"]  # the clip scales every step's update
    for name in plain.files:
        np.testing.assert_allclose(sharded[name], plain[name], rtol=1e-5, atol=1e-6, err_msg=name)

    assert "weight-update-sharding:" not in plain_run.stderr
    report = [line for line in sharded_run.stderr.splitlines() if "weight-update-sharding: " in line]
    train_step = [line for line in report if "['kernel']" in line]
    sharded_lines = [line for line in train_step if ": sharded " in line]
    assert not [line for line in train_step if ": kept " in line], "\n".join(report)
    names = {re.search(r"params\['params'\]\['(Dense_\d)'\]\['kernel'\]", line).group(1) for line in sharded_lines}
    assert names == {"Dense_0", "Dense_1", "Dense_2"}, "\n".join(report)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_jax_pmap_with_clip_by_global_norm(optimizer, caplog):
    """`jax.pmap` (in this process: conftest gives JAX 8 CPU devices), with
    assume_replicated_parameters=true as a pmap module needs (see the styles tests)."""
    import jax
    import jax.numpy as jnp
    import optax

    import xla_passes.jax
    from few_compiles import initial_state, per_device_copies

    caplog.set_level("INFO", logger="xla_passes")
    chained = _clipped(optimizer)
    shapes = {"w1": (32, 256), "b1": (256,), "w2": (256, 16)}

    def loss_fn(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)

    def step(params, state, x, y):
        grads = jax.lax.pmean(jax.grad(loss_fn)(params, x, y), "i")
        updates, state = chained.update(grads, state, params)
        return optax.apply_updates(params, updates), state, optax.tree.norm(grads)

    rng = np.random.default_rng(0)
    params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    state = initial_state(chained, params)
    x = rng.standard_normal((8, 8, 32)).astype(np.float32)
    y = rng.standard_normal((8, 8, 16)).astype(np.float32)
    results, lines = [], []
    for passes in ("dce", "weight-update-sharding{assume_replicated_parameters=true}"):
        jax.clear_caches()
        caplog.clear()
        with xla_passes.jax.enable(passes, strict=True):
            pmapped = jax.pmap(step, axis_name="i")
            p, s = per_device_copies(params), per_device_copies(state)
            for _ in range(STEPS):
                p, s, norm = pmapped(p, s, x, y)
                assert float(norm[0]) > 2 * MAX_NORM  # the clip scales the update
        results.append((p, s))
        lines = [r.getMessage() for r in caplog.records if "weight-update-sharding: " in r.getMessage()]
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    sharded = {line for line in lines if ": sharded " in line}
    assert len(sharded) == len(shapes) and not [line for line in lines if ": kept " in line], "\n".join(lines)


# -- hand-written modules ---------------------------------------------------------------------------

def _hlo_cases() -> dict[str, str]:
    with open(os.path.join(HERE, "weight_update_sharding_clip.hlo"), encoding="utf-8") as f:
        chunks = f.read().split("\n// -----\n")
    return {re.search(r"^HloModule (\w+)", c, re.M).group(1): c[re.search(r"^HloModule", c, re.M).start():]
            for c in chunks}


CASES = _hlo_cases()
SHARDED = {"offline_clip": 2, "hook_ynn": 2, "hook_padded": 1, "hook_flattened": 1}
REFUSED = ["overlapping_windows", "dropped_rows", "partials_returned", "max_of_sums"]


def _replica_inputs(module, seed=0) -> list[np.ndarray]:
    """Per-replica inputs (leading axis: replica): replicated parameters equal on every replica;
    every element differs, so a wrong shard or a partial norm shows."""
    rng = np.random.default_rng(seed)
    n = module.replica_count
    arrays = []
    for param in module.entry.parameters:
        dims = param.shape.dims
        if "parameter_replication" in param.attrs:
            arrays.append(np.stack([rng.uniform(0.5, 1.5, dims).astype(np.float32)] * n))
        else:
            arrays.append(rng.uniform(0.5, 1.5, (n, *dims)).astype(np.float32))
    return arrays


def _sharded(name: str):
    import hlo_tools
    import xla_passes

    module = hlo_tools.parse_module(CASES[name])
    module.layouts_final = name != "offline_clip"
    hlo_pass = xla_passes.pass_class("weight-update-sharding")()
    assert xla_passes.run_passes(module, [hlo_pass])
    return module, hlo_pass


def _compare(after_text: str, name: str):
    import hlo_tools
    from hlo_tools.xla import runner

    before = hlo_tools.parse_module(CASES[name])
    return runner.compare_modules(after_text, CASES[name], _replica_inputs(before),
                                  num_replicas=before.replica_count, reference_num_replicas=before.replica_count,
                                  abs_error_bound=1e-6, rel_error_bound=1e-5)


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_hand_written_clipped_steps_compute_the_same(name):
    module, hlo_pass = _sharded(name)
    assert sum(r.sharded for r in hlo_pass.report) == SHARDED[name], [str(r) for r in hlo_pass.report]
    opcodes = [i.opcode for i in module.entry.instructions]
    assert "reduce-window" not in opcodes and "reduce-scatter" in opcodes
    scalar_sums = [i for i in module.entry.instructions if i.opcode == "all-reduce" and i.shape.rank == 0]
    assert len(scalar_sums) == SHARDED[name]  # one partial sum of squares per sharded weight
    _, _, comparison = _compare(module.to_text(), name)
    assert comparison.ok, comparison.format()


@pytest.mark.parametrize("name", ["hook_ynn", "hook_flattened"])
def test_a_norm_of_the_shard_alone_is_caught(name):
    """The inputs make the norm matter: without the all-reduce of the partial sums (each device
    clipping by its own shard's norm), or without masking the padding, the results differ."""
    module, _ = _sharded(name)
    entry = module.entry
    if name == "hook_flattened":
        masked = next(i for i in entry.instructions if i.name.endswith(".masked"))
        masked.replace_all_uses_with(masked.operand(1))
    else:
        total = next(i for i in entry.instructions if i.opcode == "all-reduce" and i.shape.rank == 0)
        total.replace_all_uses_with(total.operand(0))
    _, _, comparison = _compare(module.to_text(), name)
    assert not comparison.ok


@pytest.mark.parametrize("name", REFUSED)
def test_reduce_windows_that_are_no_full_reduction_keep_the_weight(name):
    import hlo_tools
    import xla_passes

    module = hlo_tools.parse_module(CASES[name])
    module.layouts_final = True
    hlo_pass = xla_passes.pass_class("weight-update-sharding")()
    assert not xla_passes.run_passes(module, [hlo_pass])
    assert module.to_text() == hlo_tools.parse_module(CASES[name]).to_text()
    [report] = hlo_pass.report
    assert not report.sharded
    assert report.reason.startswith("non-elementwise use: %gw is used by %partial (fusion, kCustom with "
                                    "reduce-window); a reduce-window counts as part of a full reduction only when")


if __name__ == "__main__":
    _worker(sys.argv[1:])
