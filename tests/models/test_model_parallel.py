"""Model parallelism beside data parallelism (issue 15 item 3, the MLPerf v0.7 seed), and WUS on the model zoo.

`models.model_parallel_step`: the test-size Transformer (2 layers, width 32, 4 heads, MLP 64,
vocabulary 64) on a 2x4 `(data, model)` mesh with `jax.jit` + `NamedSharding`, Megatron-style
(QKV and the MLP's first Dense split by column over "model", the attention output and the MLP's
second Dense by row; embeddings, LayerNorms, biases after a row split and the vocabulary
projection replicated; the batch split over "data"), adamw. Device `4 * d + m` holds data shard
`d` and model shard `m`: data groups {0,4},{1,5},{2,6},{3,7}, model groups {0,1,2,3},{4,5,6,7}.

What XLA's partitioner makes of it (the module the pass hook sees, `before_xla_passes`): one
combined all-reduce over the data groups of 39 elements (38 gradients and the loss; XLA's CPU
combiner has already merged them) and 8 all-reduces over the model groups (12 elements: the
Megatron all-reduces of activations and of their gradients, each on the critical path of the
next). Every gradient, the replicated weights' included, is summed over "data" only: the
replicated weights see activations that are already the same on every model shard.

The runs of a program, plain and with each pass setting, train one after another in one worker process
(tests/workers/model_parallel_worker.py; the passes run at the hook XLA_PASSES uses, strict); the losses
and every parameter and optimizer-state array of 3 steps are compared.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from functools import partial

import numpy as np
import pytest

import hlo_tools
from support import xla_flags_for_tests
from xla_passes.analysis.replica_groups import written_groups

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(TESTS_DIR)
WORKER = os.path.join(TESTS_DIR, "workers", "model_parallel_worker.py")
DATA = ((0, 4), (1, 5), (2, 6), (3, 7))
MODEL = ((0, 1, 2, 3), (4, 5, 6, 7))
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")


def run_worker(tmp_path, program, runs):
    """Runs the worker once for `runs`, {name: (optimizer, precision, passes or "")}, each trained anew in
    that one process; returns {name: (the saved arrays, the pass report lines in order, the dump folder)}."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_for_tests(),
           "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, base.get("PYTHONPATH")]))}
    argv = [sys.executable, WORKER, program, str(tmp_path)]
    for name, (optimizer, precision, passes) in runs.items():
        argv += ["--run", name, optimizer, precision, passes]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"worker failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return {name: (np.load(tmp_path / f"{name}.npz"), (tmp_path / f"{name}.report").read_text().splitlines(),
                   tmp_path / f"dump_{name}") for name in runs}


def pass_report(lines):
    """The weight-update-sharding entries of a run's report, each once, in order."""
    return list(dict.fromkeys(line for line in lines if line.startswith("weight-update-sharding: ")))


# The attention key bias: its exact gradient is 0 (softmax is the same when every score of a query
# grows by that query's dot product with the bias) and adamw's decay keeps its zero start at 0, so
# in exact arithmetic it never moves; what a run shows there is rounding noise that adam scales to
# up to the learning rate per step, differently in every summation order (plain XLA moves it by
# 1.6e-4 in 3 steps on jax 0.12). It is held to that bound instead of to the plain run's noise.
NOISE_ONLY = re.compile(r"^param\[.*\['key'\]\['bias'\]$")
NOISE_BOUND = 3 * 1e-3  # steps x adamw's learning rate


def assert_equal(got, expected, rtol=1e-5, atol=1e-6):
    assert sorted(got.files) == sorted(expected.files)
    assert len(expected["losses"]) == 3
    for name in expected.files:
        if NOISE_ONLY.match(name):
            assert np.max(np.abs(got[name])) <= NOISE_BOUND and np.max(np.abs(expected[name])) <= NOISE_BOUND, name
            continue
        np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


def collectives(path) -> dict[tuple[str, tuple], list[tuple[str, int]]]:
    """(opcode, replica groups) -> [(name, array elements)] of a dumped module's collectives."""
    module = hlo_tools.parse_module(path.read_text())
    found = collections.defaultdict(list)
    for comp in module.computations:
        for instr in comp.instructions:
            if instr.opcode in COLLECTIVES:
                groups = tuple(tuple(g) for g in written_groups(instr))
                count = len(instr.shape.tuple_shapes) if instr.shape.is_tuple else 1
                found[instr.opcode, groups].append((instr.name, count))
    return dict(found)


def summary(found) -> dict[tuple[str, str], tuple[int, int]]:
    """(opcode, "data"/"model") -> (ops, elements); any other groups fail."""
    names = {DATA: "data", MODEL: "model"}
    result = {}
    for (opcode, groups), members in found.items():
        assert groups in names, (opcode, groups)  # nothing mixes or invents groups
        result[opcode, names[groups]] = (len(members), sum(n for _, n in members))
    return result


def train_step_dumps(dump):
    before = next(dump.glob("module_*.jit_train_step.before_xla_passes.txt"))
    after = sorted(dump.glob("module_*.jit_train_step.*.after_*.txt"))
    return before, after


# -- model parallelism beside data parallelism ---------------------------------------------------


MEGATRON_RUNS = {"plain": "", "wus": "weight-update-sharding", "wus0": "weight-update-sharding{threshold_bytes=0}",
                 "cf": "collective-fusion", "wuscf": "weight-update-sharding,collective-fusion"}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """{name: (arrays, report, dump)} of the Megatron step's MEGATRON_RUNS, with adamw in float32."""
    return run_worker(tmp_path_factory.mktemp("megatron"), "megatron",
                      {name: ("adamw", "float32", passes) for name, passes in MEGATRON_RUNS.items()})


@pytest.fixture(scope="module")
def megatron_plain(megatron):
    return megatron["plain"][0]


@pytest.mark.slow
def test_weight_update_sharding_splits_over_the_data_axis_only(megatron, megatron_plain):
    got, lines, dump = megatron["wus"]
    report = pass_report(lines)
    assert_equal(got, megatron_plain)
    before, [after] = train_step_dumps(dump)
    found = collectives(before)
    assert summary(found) == {("all-reduce", "data"): (1, 39), ("all-reduce", "model"): (8, 12)}
    data_names = {name for (_, groups), members in found.items() if groups == DATA for name, _ in members}
    # "weight-update-sharding: sharded %all-reduce.51[1] f32[...] ...": the all-reduce's name
    gradient = [line for line in report if line.split()[2].lstrip("%").split("[")[0] in data_names]
    activation = [line for line in report if line not in gradient]
    # 38 gradients (the loss is a scalar, not one): 15 sharded over the 2 data replicas of each
    # model shard, 23 kept because they are below threshold_bytes (biases, LayerNorms: 64 to 256
    # bytes per device).
    sharded = [line for line in gradient if ": sharded " in line]
    kept = [line for line in gradient if ": kept " in line]
    assert (len(gradient), len(sharded), len(kept)) == (38, 15, 23), "\n".join(report)
    assert all(" over 2 devices" in line for line in sharded)
    assert all("tiny: " in line for line in kept)
    # A weight split over "model" is updated as its model shard, which WUS splits again over "data".
    per_device = {"['query']['kernel']": "f32[32,1,8]", "['out']['kernel']": "f32[1,8,32]",
                  "['TransformerLayer_0']['Dense_0']['kernel']": "f32[32,16]",
                  "['TransformerLayer_0']['Dense_1']['kernel']": "f32[16,32]",
                  "params['Embed_0']['embedding']": "f32[64,32]", "params['Dense_0']['kernel']": "f32[32,64]"}
    for weight, shape in per_device.items():
        assert any(weight in line and f" {shape} " in line for line in sharded), (weight, "\n".join(sharded))
    # The 12 model-axis all-reduces are Megatron's activation sums: the pass looks at them (float
    # sums) and leaves them, since their results feed the next layer, not an elementwise update.
    assert len(activation) == 12 and all("non-elementwise use" in line for line in activation), activation
    # After: the gradients are reduce-scattered and the 15 weights and their 30 moments all-gathered,
    # over the data groups only; the model-axis all-reduces are untouched.
    assert summary(collectives(after)) == {
        ("all-reduce", "data"): (1, 24), ("reduce-scatter", "data"): (2, 15), ("all-gather", "data"): (45, 45),
        ("all-reduce", "model"): (8, 12)}


@pytest.mark.slow
def test_weight_update_sharding_of_every_gradient(megatron, megatron_plain):
    """threshold_bytes=0: the 23 small gradients too, the replicated LayerNorms' over the data groups."""
    got, lines, dump = megatron["wus0"]
    report = pass_report(lines)
    assert_equal(got, megatron_plain)
    sharded = [line for line in report if ": sharded " in line]
    assert len(sharded) == 38 and all(" over 2 devices" in line for line in sharded), "\n".join(report)
    assert any("params['LayerNorm_0']['scale']" in line for line in sharded)
    _, [after] = train_step_dumps(dump)
    counts = summary(collectives(after))
    assert counts[("all-gather", "data")] == (114, 114) and counts[("all-reduce", "model")] == (8, 12)
    assert not any(opcode != "all-reduce" and axis == "model" for opcode, axis in counts)


@pytest.mark.slow
def test_collective_fusion_combines_within_matching_groups(megatron, megatron_plain):
    # Alone: nothing to do at the hook. XLA's CPU combiner has merged the data-axis all-reduces,
    # and each model-axis all-reduce depends on the one before it.
    got, _, dump = megatron["cf"]
    assert_equal(got, megatron_plain)
    before, [after] = train_step_dumps(dump)
    assert summary(collectives(before)) == summary(collectives(after)) == {
        ("all-reduce", "data"): (1, 39), ("all-reduce", "model"): (8, 12)}
    # After weight-update-sharding: its 45 data-axis all-gathers become 2 (one per gather
    # dimension: 0, and 1 for the `[1,8,32]` attention-output shards), its 2 reduce-scatters
    # (one per dimension) stay, and no model-axis collective joins a data-axis one.
    got, _, dump = megatron["wuscf"]
    assert_equal(got, megatron_plain)
    _, [wus, fused] = train_step_dumps(dump)
    assert summary(collectives(wus))[("all-gather", "data")] == (45, 45)
    assert summary(collectives(fused)) == {
        ("all-reduce", "data"): (1, 24), ("reduce-scatter", "data"): (2, 15), ("all-gather", "data"): (2, 45),
        ("all-reduce", "model"): (8, 12)}


def test_xla_passes_jax_jit_has_nothing_to_rewrite():
    """`xla_passes.jax.jit` runs the passes on JAX's lowering, before XLA's partitioner makes the
    collectives of a jit + NamedSharding program: the passes find none, report nothing, and the
    numbers stay those of `jax.jit`."""
    import xla_passes.jax
    from xla_passes_demo import models

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
    results = []
    for jit in (jax.jit, partial(xla_passes.jax.jit, passes="weight-update-sharding,collective-fusion")):
        step, (params, state, tokens, labels) = models.model_parallel_step(models.small_transformer(), mesh, jit=jit)
        lowered = step.lower(params, state, tokens, labels).as_text()
        assert not re.search(r"all_reduce|all_gather|reduce_scatter", lowered)
        losses = []
        for _ in range(3):
            params, state, loss = step(params, state, tokens, labels)
            losses.append(float(loss))
        results.append((losses, params, state))
    assert step.reports == []
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(results[1][1:]), jax.tree.leaves(results[0][1:])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the per-device blocks stay Megatron's: the query kernel [32,4,8] is [32,1,8] on each device
    kernel = results[1][1]["TransformerLayer_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (32, 1, 8)


# -- the model zoo's data-parallel steps (flax's imagenet ResNet and lm1b Transformer) -----------

# What the pass did is read from its report on the float32 step (the sizes it weighs against
# threshold_bytes are float32's); the numbers are compared on the same steps run in float64. In
# float32, clipping's global norm, summed per shard and then across devices, can move the clipping
# scale by an ulp, and adam turns gradients that are 0 in exact arithmetic, so float noise (the
# attention key biases: softmax ignores a constant added to every key; the stem's batch-norm bias
# of a channel the ReLU never cuts: the next batch norms remove a shift), into steps of +-lr: those
# arrays move by ~1e-4 whichever way the noise goes, by how much depends on the CPU (plain runs of
# the same ResNet step compiled for AVX-512 and for AVX differ by 8.5e-4). In float64 that noise
# is far below adam's eps: the largest difference to plain measured is 8.8e-13, so every array is
# held to ZOO_TOLERANCE, a millionth of one step's learning rate.
ZOO_TOLERANCE = 1e-9
# The weights (parameters) of each test-size model, and how many of them the pass shards with the
# default threshold_bytes=1024 and with threshold_bytes=0. ResNet: the 9 conv kernels but one
# (`BottleneckBlock_0/Conv_0`, 1x1x8x8, 256 bytes) and the Dense kernel, then with no threshold every
# batch-norm scale and bias and the Dense bias too (the two blocks' BatchNorm_2 and BatchNorm_3 biases
# share one gradient: both outputs are summed into the residual, XLA computes it once). Transformer:
# every kernel, the embedding and the positions, then every bias and LayerNorm.
ZOO = {"resnet": (29, {"weight-update-sharding": 9, "weight-update-sharding{threshold_bytes=0}": 29}),
       "transformer": (38, {"weight-update-sharding": 15, "weight-update-sharding{threshold_bytes=0}": 38})}
# Report entries: one per floating-point sum the pass looked at; gradient entries are those that
# update optimizer state. ResNet: 27 gradients (29 weights: each block's BatchNorm_2 and BatchNorm_3
# biases share one) and 36 sums of batch norm's statistics, 18 in the forward and backward passes and
# 18 the pmean of the 9 running means and variances.
ENTRIES = {"resnet": (63, 27), "transformer": (38, 38)}
# The pass settings of the zoo runs, by their short names in the runs' names.
ZOO_PASSES = {"weight-update-sharding": "wus", "weight-update-sharding{threshold_bytes=0}": "wus0"}
OPTIMIZERS = ("adamw", "clip_adamw")


def weights_named(lines):
    """The parameters named in report lines (`params['x']`, not the optimizer state's `.mu['x']`)."""
    return {name for line in lines for name in re.findall(r"(?<![.\w])params(\[[^ ,)]*\])", line)}


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    """`run(program)`: {name: (arrays, report, dump)} of a program's runs, one worker process per program: for
    each optimizer `<optimizer>-<setting>-float32` for each setting of ZOO_PASSES, whose reports are read, and
    `<optimizer>-plain-float64` and `<optimizer>-<setting>-float64`, whose numbers are compared."""
    cache = {}

    def run(program):
        if program not in cache:
            runs = {}
            for optimizer in OPTIMIZERS:
                for precision, settings in (("float32", ZOO_PASSES), ("float64", {"": "plain", **ZOO_PASSES})):
                    runs.update({f"{optimizer}-{setting}-{precision}": (optimizer, precision, passes)
                                 for passes, setting in settings.items()})
            cache[program] = run_worker(tmp_path_factory.mktemp(program), program, runs)
        return cache[program]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("passes", sorted(ZOO_PASSES))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("program", sorted(ZOO))
def test_model_zoo_data_parallel_steps(program, optimizer, passes, zoo_runs):
    runs, setting = zoo_runs(program), ZOO_PASSES[passes]
    report = pass_report(runs[f"{optimizer}-{setting}-float32"][1])
    weights, sharded = ZOO[program][0], ZOO[program][1][passes]
    gradients = [line for line in report if "opt_state" in line]
    assert (len(report), len(gradients)) == ENTRIES[program], "\n".join(report)
    assert len(weights_named(gradients)) == weights
    assert len(weights_named(line for line in report if ": sharded " in line)) == sharded, "\n".join(report)
    assert all(" over 8 devices" in line for line in report if ": sharded " in line)
    kept = [line for line in report if ": kept " in line]
    if passes == "weight-update-sharding":
        assert all("tiny: " in line for line in kept), "\n".join(kept)
    else:  # every gradient is sharded; only batch norm's statistics, which update no weight, stay
        assert not any("opt_state" in line for line in kept), "\n".join(kept)
        assert all("non-elementwise use" in line or "no update" in line for line in kept), "\n".join(kept)
    plain = runs[f"{optimizer}-plain-float64"][0]
    got, lines, _ = runs[f"{optimizer}-{setting}-float64"]
    # the float64 step was compiled anew, with the pass (no executable of the plain run's was reused)
    assert any("jit_train_step: changed by weight-update-sharding" in line for line in lines), "\n".join(lines)
    assert sorted(got.files) == sorted(plain.files)
    assert not any(plain[name].dtype == np.float32 for name in plain.files)  # the worker ran in float64
    for name in plain.files:
        np.testing.assert_allclose(got[name], plain[name], rtol=ZOO_TOLERANCE, atol=ZOO_TOLERANCE, err_msg=name)
