"""The ST-MoE seed: xla_passes_demo.models' top-2 mixture of experts, expert parallel over 8 CPU devices.

Checked, each against something computed another way:

* the routing (top-2, gates renormalized, capacity with top-1 choices first, drops, the
  load-balancing and z-losses) against a per-token NumPy loop;
* the expert-parallel step (two all-to-alls forward, two backward) against the same step on one
  device with every expert local and no collectives, for 3 adam steps in float64;
* hlo_tools on the step's HLO (JAX's lowering and XLA's optimized per-device module): print is
  byte-identical, verify, `stats` counts and sizes the all-to-alls, `graph` draws them, `cost`
  prices them on a 2x4 torus, `run` computes what JAX computes;
* collective-fusion and weight-update-sharding, at the flag (JAX plugin, a subprocess: this file
  is its own worker) and through `xla_passes.jax.jit`: 3 steps give the plain step's losses and
  parameters (rtol 1e-5, atol 1e-6), with what the passes did recorded from their reports.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from support import HELPERS_DIR, xla_flags_for_tests

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
DEVICES_FLAG = xla_flags_for_tests()  # 8 devices, -O0
NO_XLA_COMBINER_FLAGS = f"{DEVICES_FLAG} --xla_disable_hlo_passes=all-reduce-combiner,cpu-all-reduce-combiner"


def train(step, args, steps=STEPS):
    """`steps` steps of `step` from `args`; the losses and every final leaf (global arrays) by path."""
    import jax

    params, opt_state, tokens, labels = args
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens, labels)
        losses.append(float(loss))
    result = {"losses": np.asarray(losses)}
    for name, tree in (("params", params), ("opt_state", opt_state)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            result[name + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return result


def worker(out: str, plain_out: str) -> None:
    """Train the MoE step 3 times in this process with the passes off (saved to `plain_out`), then 3 times
    from the start again with the passes that XLA_PASSES (read by the JAX plugin) chose (saved to `out`)."""
    import logging

    import jax

    from plain_first import without_the_passes
    from xla_passes_demo import models

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("xla_passes").addHandler(handler)
    logging.getLogger("xla_passes").setLevel(logging.INFO)
    mesh = jax.make_mesh((8,), ("data",))
    np.savez(plain_out, **without_the_passes(lambda: train(*models.moe_step(mesh, donate=True))))
    np.savez(out, **train(*models.moe_step(mesh, donate=True)))


# --- the model ---------------------------------------------------------------------------------


def _numpy_moe(x, router, w_in, w_out, capacity):
    """MoEBlock by hand, token by token: (output, balance loss, z-loss, kept choices)."""
    def gelu(v):  # flax's nn.gelu is the tanh approximation
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))

    x = x.astype(np.float64)
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = router.shape[1]
    first = probs.argmax(-1)
    masked = probs.copy()
    masked[np.arange(len(x)), first] = -1
    second = masked.argmax(-1)
    load = [0] * experts
    kept = []  # (token, expert, gate)
    for choice in (first, second):  # every token's top-1 before any top-2
        for t, e in enumerate(choice):
            if load[e] < capacity:
                load[e] += 1
                gate = probs[t, e] / (probs[t, first[t]] + probs[t, second[t]])
                kept.append((t, e, gate))
    out = np.zeros_like(x)
    for t, e, gate in kept:
        out[t] += gate * (gelu(x[t] @ w_in[e]) @ w_out[e])
    fraction = np.bincount(first, minlength=experts) / len(x)
    balance = experts * np.sum(fraction * probs.mean(0))
    z = np.mean((np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)) ** 2)
    return out, balance, z, len(kept)


def test_routing_top2_capacity_and_auxiliary_losses_match_a_per_token_loop():
    import jax
    import jax.numpy as jnp

    from xla_passes_demo import models

    rng = np.random.default_rng(3)
    x = rng.standard_normal((48, 16)).astype(np.float32)
    for factor in (0.5, 0.9, 4.0):  # every expert full; some full, some not; no drops
        block = models.MoEBlock(num_experts=4, mlp_width=8, capacity_factor=factor)
        params = jax.jit(block.init)(jax.random.key(1), jnp.asarray(x))["params"]
        params = jax.tree.map(lambda a: np.asarray(a) * np.float32(3), params)  # a sharper router: uneven loads
        with jax.default_matmul_precision("highest"):
            out, aux = jax.jit(block.apply)({"params": params}, jnp.asarray(x))
        capacity = block.capacity(len(x))
        assert capacity == int(np.ceil(2 * 48 * factor / 4))
        weights = [np.asarray(w, np.float64) for w in (params["router"]["kernel"], params["w_in"], params["w_out"])]
        expected, balance, z, kept = _numpy_moe(x, *weights, capacity)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(aux["balance"]), balance, rtol=1e-5)
        np.testing.assert_allclose(float(aux["z_loss"]), z, rtol=1e-5)
        assert float(aux["dropped"]) == pytest.approx(1 - kept / (2 * len(x)), abs=1e-6)
        if factor == 0.5:
            assert kept == 4 * capacity  # every expert full, the rest dropped
        if factor == 0.9:
            assert kept < 2 * len(x) and kept < 4 * capacity
        if factor == 4.0:
            assert kept == 2 * len(x)


@pytest.fixture(scope="module")
def mesh():
    import jax

    return jax.make_mesh((8,), ("data",))


# In float32 adam turns the rounding noise of another summation order into differences of up to
# 5e-6 in w_in, as large between two runs of the one-device step compiled for AVX-512 and for SSE4.2
# as between the two steps, so no float32 tolerance fits every CPU. In float64 the two steps differ
# by at most 5.5e-15 (code for AVX-512, AVX2, AVX and SSE4.2); 1e-9 is a millionth of one step's
# learning rate.
FLOAT64_TOLERANCE = 1e-9


@pytest.mark.slow
def test_expert_parallel_step_equals_the_one_device_step_with_every_expert_local(mesh):
    """8 experts, one per device, tokens sent by all-to-all; against one device, no collectives, both
    in float64. Capacity factor 1.0 so that some tokens are dropped (checked)."""
    import jax

    from xla_passes_demo import models

    model = models.MoEModel(capacity_factor=1.0)
    with jax.enable_x64(True):
        step, args = models.moe_step(mesh, model=model, donate=False)
        # in one program, which keeps each array's sharding
        args = jax.jit(functools.partial(jax.tree.map, lambda a: a.astype(np.float64)
                                         if np.issubdtype(a.dtype, np.floating) else a))(args)
        params = args[0]
        assert params["MoEBlock_0"]["w_in"].shape == (8, 32, 64) and params["MoEBlock_0"]["w_in"].dtype == "float64"
        assert params["MoEBlock_0"]["w_in"].addressable_shards[0].data.shape == (1, 32, 64)  # one expert a device
        assert params["MoEBlock_0"]["router"]["kernel"].addressable_shards[0].data.shape == (32, 8)  # replicated
        host = jax.tree.map(np.asarray, args)
        groups = host[2].reshape(8, 4, 16), host[3].reshape(8, 4, 16)
        loss = jax.jit(functools.partial(models.moe_loss, model))
        dropped = [float(loss(host[0], t, y)[1]["dropped"]) for t, y in zip(*groups)]
        assert max(dropped) > 0, dropped
        reference = models.moe_reference_step(model, 8)
        got = train(step, args)
        expected = train(reference, host)
    assert got["losses"][-1] < got["losses"][0]
    worst = assert_same_training(got, expected, rtol=FLOAT64_TOLERANCE, atol=FLOAT64_TOLERANCE)
    print(f"MoE expert parallel vs one device: dropped choices per group {min(dropped):.3f}..{max(dropped):.3f}, "
          f"losses {got['losses']}, max abs difference {worst}")


# --- hlo_tools on the step's HLO ---------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_modules(mesh, tmp_path_factory):
    """JAX's lowering of the step (shard_map: a Shardy module XLA partitions) and XLA's optimized
    per-device module, as files; and the step with its host inputs."""
    import jax

    from hlo_tools.xla import xla_bridge
    from xla_passes_demo import models

    step, args = models.moe_step(mesh, donate=False)
    lowered = step.lower(*args)
    directory = tmp_path_factory.mktemp("moe")
    (directory / "lowered.hlo").write_text(xla_bridge.lowered_module_text(lowered))
    (directory / "optimized.hlo").write_text(lowered.compile().as_text())
    return directory, step, args


def hlo_tools_cli(*argv, check=True):
    result = subprocess.run([sys.executable, "-m", "hlo_tools", *argv], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("name", ["lowered", "optimized"])
def test_print_is_byte_identical_and_verify_accepts(moe_modules, name):
    import hlo_tools
    from hlo_tools.xla import xla_bridge

    text = (moe_modules[0] / f"{name}.hlo").read_text()
    module = hlo_tools.parse_module(text)
    assert module.to_text() == text
    assert xla_bridge.same_meaning(module.to_text(regenerate=True), text)  # and printed in XLA's style
    hlo_tools.verify(module)
    all_to_alls = [i for i in module.instructions() if i.opcode == "all-to-all"]
    assert len(all_to_alls) == 4
    if name == "optimized":  # XLA rewrites each into its array-per-peer form: 8 operands [1, 20, 32]
        assert all(len(i.operands) == 8 for i in all_to_alls)
    assert "OK: jit_train_step" in hlo_tools_cli("verify", str(moe_modules[0] / f"{name}.hlo")).stdout


@pytest.mark.parametrize("name, buffers", [("lowered", 4), ("optimized", 32)])
def test_stats_counts_the_all_to_alls_with_their_bytes(moe_modules, name, buffers):
    from hlo_tools.ir.attributes import ReplicaGroups

    stats = json.loads(hlo_tools_cli("stats", "--json", "--no-compile", str(moe_modules[0] / f"{name}.hlo")).stdout)
    all_to_all = stats["collectives"]["all-to-all"]
    # 4 all-to-alls (dispatch and return, forward and backward) of [experts 8, capacity 20, width 32] f32
    # on each device: 8 * 20 * 32 * 4 = 20,480 bytes each.
    capacity = int(np.ceil(2 * 64 * 1.25 / 8))
    assert capacity == 20
    assert all_to_all["count"] == 4 and all_to_all["buffers"] == buffers
    assert all_to_all["operand_bytes"] == all_to_all["bytes_moved"] == 4 * 8 * capacity * 32 * 4
    # the groups as written: `{{0,...,7}}`, or (jaxlib 0.12) over the mesh axis, `mesh['data'=8] {'data'}`
    (groups,) = all_to_all["groups"]
    assert ReplicaGroups.parse(groups).groups == [list(range(8))]


def test_graph_draws_the_all_to_alls_as_collectives(moe_modules):
    svg = hlo_tools_cli("graph", str(moe_modules[0] / "optimized.hlo"), "--focus", "all-to-all",
                        "--layout", "builtin").stdout
    assert svg.startswith("<svg") or "<svg" in svg[:500]
    assert 'class="node collective"' in svg and "all-to-all" in svg


def _torus_all_to_all_seconds(nbytes, rows=2, columns=4, latency=1e-6, bandwidth=100e9):
    """An all-to-all of `nbytes` per device on a rows x columns torus, by hand: n - 1 rounds, in round s
    device i sends nbytes / n to device i + s, along its row then its column, the short way round (ties
    forward); a round takes its slowest message: hops * latency + share * (most messages on one of its
    links) / bandwidth."""
    n = rows * columns
    total = 0.0
    for shift in range(1, n):
        routes = []
        for source in range(n):
            (r, c), target = divmod(source, columns), (source + shift) % n
            tr, tc = divmod(target, columns)
            links = []
            for size, axis, goal in ((columns, 1, tc), (rows, 0, tr)):
                here = [r, c]
                step = 1 if (goal - here[axis]) % size <= (here[axis] - goal) % size else -1
                while here[axis] != goal:
                    before = (r, c)
                    here[axis] = (here[axis] + step) % size
                    r, c = here
                    links.append((before, (r, c)))
            routes.append(links)
        load = {}
        for route in routes:
            for link in route:
                load[link] = load.get(link, 0) + 1
        total += max(len(route) * latency + nbytes / n * max(load[link] for link in route) / bandwidth
                     for route in routes)
    return total


def test_cost_prices_the_all_to_alls_on_a_2x4_torus(moe_modules):
    cost = json.loads(hlo_tools_cli("cost", str(moe_modules[0] / "optimized.hlo"), "--topology", "torus:2x4",
                                    "--chip", "tpu-v3", "--json").stdout)
    all_to_alls = [c for c in cost["collectives"] if c["opcode"] == "all-to-all"]
    assert len(all_to_alls) == 4
    expected = _torus_all_to_all_seconds(20480, latency=cost["link_latency_s"],
                                         bandwidth=cost["link_bandwidth_bytes_per_s"])
    # 15 hops of latency over the 7 rounds (2+3+2+1+2+3+2) and 9 shares' worth of link time
    assert expected == pytest.approx(15e-6 + 9 * 2560 / 100e9)
    for c in all_to_alls:
        assert (c["bytes"], c["group_size"], c["algorithm"]) == (20480, 8, "7 rounds of direct sends")
        assert c["time_s"] == pytest.approx(expected, rel=1e-9)


def _flat_inputs(args):
    import jax

    return [np.asarray(leaf) for leaf in jax.tree.leaves(args)]


def test_run_computes_what_jax_computes(moe_modules, tmp_path):
    """`hlo-tools run` on JAX's lowering (XLA partitions it over 8 devices) with the step's real inputs
    gives JAX's outputs; against itself as --reference it matches."""
    import jax

    directory, step, args = moe_modules
    inputs = _flat_inputs(args)
    np.savez(tmp_path / "in.npz", **{f"arg{i}": a for i, a in enumerate(inputs)})
    result = hlo_tools_cli("run", str(directory / "lowered.hlo"), "--num_partitions", "8",
                           "--inputs", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz"),
                           "--reference", str(directory / "lowered.hlo"))
    assert "all 35 outputs match the reference" in result.stdout
    outputs = np.load(tmp_path / "out.npz")
    expected = [np.asarray(leaf) for leaf in jax.tree.leaves(step(*args))]
    assert len(outputs.files) == len(expected) == 35
    for i, want in enumerate(expected):
        np.testing.assert_allclose(outputs[f"out{i}"], want, rtol=RTOL, atol=ATOL, err_msg=f"out{i}")


def test_run_of_the_optimized_per_device_module_computes_what_jax_computes(moe_modules, tmp_path):
    """XLA's optimized module, with its parameters' shardings (the experts' `devices=[8,1,1]`, which
    only jaxlib 0.10.2's `as_text()` prints: `compiled_module_text` adds them), takes the same global
    inputs. Its outputs have none: the runner gives device 0's, which for the
    6 expert arrays (w_in, w_out and their adam moments) is expert 0's slice, with one warning each
    that the devices disagree (each holds another expert)."""
    import jax

    from hlo_tools.xla import xla_bridge

    _, step, args = moe_modules
    optimized = tmp_path / "optimized.hlo"
    optimized.write_text(xla_bridge.compiled_module_text(step.lower(*args).compile()))
    assert "sharding={devices=[8,1,1]<=[8]}" in optimized.read_text()
    np.savez(tmp_path / "in.npz", **{f"arg{i}": a for i, a in enumerate(_flat_inputs(args))})
    result = hlo_tools_cli("run", str(optimized), "--inputs", str(tmp_path / "in.npz"),
                           "--output", str(tmp_path / "out.npz"), "--reference", str(optimized))
    assert "all 35 outputs match the reference" in result.stdout
    outputs = np.load(tmp_path / "out.npz")
    expected = [np.asarray(leaf) for leaf in jax.tree.leaves(step(*args))]
    experts = [i for i, want in enumerate(expected) if want.shape[:1] == (8,) and want.ndim == 3]
    assert len(experts) == 6
    for i, want in enumerate(expected):
        want = want[:1] if i in experts else want
        np.testing.assert_allclose(outputs[f"out{i}"], want, rtol=RTOL, atol=ATOL, err_msg=f"out{i}")
    disagree = re.compile(r"output (\d+): devices 1, 2, 3, 4, 5, 6, 7 hold other values than device 0")
    warned = {int(n) for n in disagree.findall(result.stdout + result.stderr)}
    assert warned == set(experts), result.stdout + result.stderr


# --- the passes --------------------------------------------------------------------------------


def run_worker(tmp_path, name, passes, xla_flags=DEVICES_FLAG):
    """The worker's training with `passes` (XLA_PASSES, strict, dumped to dump-NAME), its stderr, and the plain
    training that it ran before, in the same process with the passes off (tests/helpers/plain_first.py)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, str(HELPERS_DIR), base.get("PYTHONPATH")])),
           "XLA_PASSES": passes, "XLA_PASSES_STRICT": "1", "XLA_PASSES_DUMP_TO": str(tmp_path / f"dump-{name}")}
    out, plain = tmp_path / f"{name}.npz", tmp_path / f"{name}-plain.npz"
    result = subprocess.run([sys.executable, os.path.abspath(__file__), str(out), str(plain)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(np.load(out)), result.stderr, dict(np.load(plain))


def assert_same_training(got, expected, rtol=RTOL, atol=ATOL):
    assert sorted(got) == sorted(expected)
    worst = (0.0, "")
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=rtol, atol=atol, err_msg=key)
        worst = max(worst, (float(np.max(np.abs(got[key] - expected[key]))), key))
    return "0" if worst[0] == 0 else "%.3g (%s)" % worst


def count_opcode(path, opcode):
    import hlo_tools

    return sum(1 for i in hlo_tools.parse_module(path.read_text()).instructions() if i.opcode == opcode)


def step_dumps(directory):
    [before] = directory.glob("module_*.jit_train_step.before_xla_passes.txt")
    [after] = directory.glob("module_*.jit_train_step.0001.after_*.txt")
    return before, after


EXPERT_WEIGHTS = ("['MoEBlock_0']['w_in']", "['MoEBlock_0']['w_out']")
SHARDABLE = ("['Dense_0']['kernel']", "['Embed_0']['embedding']", "['MoEBlock_0']['router']['kernel']",
             "['positions']")  # the replicated weights of at least threshold_bytes=1024; the rest are tiny


def check_weight_update_sharding_report(lines):
    sharded = [line for line in lines if "weight-update-sharding: sharded" in line]
    kept = [line for line in lines if "weight-update-sharding: kept" in line]
    assert len(sharded) == len(SHARDABLE), "\n".join(lines)
    assert all(any(f"params{w}" in line for line in sharded) for w in SHARDABLE)
    assert len(kept) == 5 and all("tiny" in line for line in kept)  # the 4 LayerNorm vectors and the head's bias
    # the experts' weights are already split over the devices: no all-reduce, never in the report
    assert not any(w in line for line in lines for w in EXPERT_WEIGHTS)
    return len(sharded)


def run_dumps_against_each_other(before, after, args, tmp_path):
    """`hlo-tools run` of the pass's output against its input (the hook's dumps) on the step's real inputs."""
    np.savez(tmp_path / "in.npz", **{f"arg{i}": a for i, a in enumerate(_flat_inputs(args))})
    result = hlo_tools_cli("run", str(after), "--reference", str(before), "--inputs", str(tmp_path / "in.npz"))
    assert "all 35 outputs match the reference" in result.stdout, result.stdout


@pytest.mark.slow
def test_collective_fusion_at_the_flag(tmp_path, moe_modules):
    """XLA's all-reduce combiner off (so there is something to combine): 10 all-reduces (9 gradients
    and the loss) become 1; the all-to-alls stay; the numbers do not move."""
    fused, _, plain = run_worker(tmp_path, "fused", "collective-fusion", xla_flags=NO_XLA_COMBINER_FLAGS)
    worst = assert_same_training(fused, plain)
    before, after = step_dumps(tmp_path / "dump-fused")
    counts = [(count_opcode(p, "all-reduce"), count_opcode(p, "all-to-all")) for p in (before, after)]
    print(f"MoE collective-fusion at the flag: all-reduces {counts[0][0]} -> {counts[1][0]}, "
          f"all-to-alls {counts[0][1]} -> {counts[1][1]}, max abs difference {worst}")
    assert counts == [(10, 4), (1, 4)]
    run_dumps_against_each_other(before, after, moe_modules[2], tmp_path)


@pytest.mark.slow
def test_weight_update_sharding_at_the_flag(tmp_path, moe_modules):
    """XLA's defaults: its combiner already made one all-reduce of the 9 gradients and the loss; the pass
    shards the 4 replicated weights of 1 KiB or more (reduce-scatter, 1/8 of the adam update, all-gather
    of each weight and its two moments), keeps the 5 tiny ones, and leaves the experts alone."""
    sharded, log, plain = run_worker(tmp_path, "wus", "weight-update-sharding")
    worst = assert_same_training(sharded, plain)
    count = check_weight_update_sharding_report(log.splitlines())
    before, after = step_dumps(tmp_path / "dump-wus")
    opcodes = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
    counts = [tuple(count_opcode(p, op) for op in opcodes) for p in (before, after)]
    print(f"MoE weight-update-sharding at the flag: sharded {count} weights; (all-reduce, reduce-scatter, "
          f"all-gather, all-to-all) {counts[0]} -> {counts[1]}; max abs difference {worst}")
    assert counts == [(1, 0, 0, 4), (1, 1, 12, 4)]
    # nothing of the experts' shapes is scattered or gathered: they keep their own update
    text = after.read_text()
    for shape in ("f32[1,32,64]", "f32[1,64,32]", "f32[8,32,64]", "f32[8,64,32]"):
        assert not re.search(rf"= {re.escape(shape)}\S* (all-gather|reduce-scatter)\(", text), shape
    run_dumps_against_each_other(before, after, moe_modules[2], tmp_path)


@pytest.fixture(scope="module")
def jit_baselines(mesh):
    """The plain `jax.jit` step's all-reduce count and training, and `xla_passes.jax.jit` with `dce`
    alone: a control that goes the same way through the passes' HLO text back into XLA."""
    import hlo_tools
    import xla_passes.jax
    from hlo_tools.xla import xla_bridge
    from xla_passes_demo import models

    plain_step, plain_args = models.moe_step(mesh)
    text = xla_bridge.lowered_module_text(plain_step.lower(*plain_args))
    before = sum(1 for i in hlo_tools.parse_module(text).instructions() if i.opcode == "all-reduce")
    control = models.moe_step(mesh, jit=lambda fun, **options: xla_passes.jax.jit(fun, passes="dce", **options))
    return before, train(plain_step, plain_args), train(*control)


@pytest.mark.parametrize("passes", ["collective-fusion", "weight-update-sharding",
                                    "weight-update-sharding{persistent=true}"])
@pytest.mark.slow
def test_passes_through_xla_passes_jax_jit(mesh, jit_baselines, passes):
    """The passes on JAX's lowering, before XLA's optimizations, in a donated 3-step loop: against the
    plain step within the tolerance; against the `dce` control (what the round trip of JAX's lowering
    through HLO text alone changes: one float32 ulp of a loss) printed."""
    import xla_passes.jax
    from xla_passes_demo import models

    before, expected, control = jit_baselines
    made = []

    def jit(fun, **options):
        made.append(xla_passes.jax.jit(fun, passes=passes, **options))
        return made[-1]

    step, args = models.moe_step(mesh, jit=jit)
    lowered = step.lower(*args)
    got = train(step, args)
    worst, from_control = assert_same_training(got, expected), assert_same_training(got, control)
    after = lowered.as_text().count("all_reduce")  # StableHLO's stablehlo.all_reduce
    a2a = lowered.as_text().count("all_to_all")
    print(f"MoE {passes} through xla_passes.jax.jit: all-reduces {before} -> {after}, all-to-alls {a2a}, "
          f"max abs difference {worst}; from the dce control {from_control}")
    assert before == 10 and a2a == 4
    if passes == "collective-fusion":
        assert after == 1
    else:
        assert check_weight_update_sharding_report(made[0].reports) == 4
        if "persistent" in passes:  # the sharded weights' adam moments live 1/8 per device between steps
            assert sum("; persistent: " in line for line in made[0].reports) == 4
            params, opt_state, _ = step(*models.moe_step(mesh, jit=jit)[1])
            mu = opt_state[0].mu
            assert mu["MoEBlock_0"]["router"]["kernel"].addressable_shards[0].data.shape == (4, 8)
            assert mu["Embed_0"]["embedding"].addressable_shards[0].data.shape == (8, 32)
            assert mu["LayerNorm_0"]["scale"].addressable_shards[0].data.shape == (32,)  # kept: tiny
            assert mu["MoEBlock_0"]["w_in"].addressable_shards[0].data.shape == (1, 32, 64)  # one expert
            assert params["MoEBlock_0"]["router"]["kernel"].addressable_shards[0].data.shape == (32, 8)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
