"""weight-update-sharding: same results through XLA, the expected structure, and the report.

Every differential test runs the module before and after the pass on 8 CPU devices with
random float inputs that differ in every element (so a shard taken at the wrong offset, or
a weight that is not the same on every device, changes the results), weights and
optimizer state being the same on every device as data parallelism has them. The JAX
programs are data-parallel training steps lowered at test time; the hand-written modules
are the ones of `weight_update_sharding.hlo`, whose FileCheck lines show the rewrite.
"""
import contextlib
import io
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_tools
import real_programs
import xla_passes
import xla_passes.jax
from hlo_tools.xla import runner, xla_bridge
from hlo_tools.ir.literal import Literal
from hlo_tools.inspection.stats import xla_cost
from pass_testing import run_and_compare

HERE = os.path.dirname(os.path.abspath(__file__))
PASS = "weight-update-sharding"
ALL_SIZES = f"{PASS}{{threshold_bytes=0}}"
BOUNDS = {"abs_error_bound": 1e-5, "rel_error_bound": 1e-5}

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "clipped_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
}
# Full-size optimizer state per weight: what is all-gathered besides the weight itself.
STATE_PER_WEIGHT = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2, "clipped_adam": 2}
# A 16x13 / 13 / 13x4 MLP: w1 splits along a dimension, b1 and w2 are flattened and padded.
PARAM_SHAPES = {"w1": (16, 13), "b1": (13,), "w2": (13, 4)}
# Gradients that arrive as an all-reduce of their own shape, which the pass reduce-scatters: w1's
# and w2's; b1's too from jax 0.11 on, which sums it over the batch before its all-reduce (jax
# 0.10 all-reduces the per-example rows and sums them after, so b1's shard is sliced from that sum).
REDUCE_SCATTERED = 3 if xla_bridge.JAXLIB_VERSION >= (0, 11) else 2


# --- programs and inputs ------------------------------------------------------------------------------

def _mlp_loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


def _step_function(optimizer, axis: str):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
        grads = jax.lax.pmean(grads, axis)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, axis)
    return step


def _shard_map_step(optimizer, donate: bool = False, shapes=PARAM_SHAPES):
    """A jitted shard_map data-parallel step over 8 devices and its abstract arguments; `donate`
    donates the parameters and optimizer state, as training loops do."""
    mesh = jax.make_mesh((8,), ("data",))
    params = {name: jnp.zeros(shape) for name, shape in shapes.items()}
    state = jax.eval_shape(optimizer.init, params)

    def spec(value, partition=P()):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, partition))

    fn = jax.jit(jax.shard_map(_step_function(optimizer, "data"), mesh=mesh,
                               in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P())),
                 donate_argnums=(0, 1) if donate else ())
    args = (jax.tree.map(spec, params), jax.tree.map(spec, state),
            spec(jnp.zeros((64, shapes["w1"][0])), P("data")), spec(jnp.zeros((64, shapes["w2"][1])), P("data")))
    return fn, args


def _lowered_text(fn, args) -> str:
    return fn.lower(*args).compiler_ir("hlo").as_hlo_text()


def _uniform(rng, shape):
    return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)


def _spmd_inputs(module: hlo_tools.HloModule, same_along_axis0=(), seed=0) -> list[np.ndarray]:
    """Global inputs of a JAX module; the parameters named in `same_along_axis0` hold one
    copy per device (pmap's replicated weights)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for param in module.entry.parameters:
        dims = param.shape.dims
        if param.shape.dtype == "s32":
            arrays.append(np.full(dims, 3, np.int32))
        elif param.name in same_along_axis0:
            arrays.append(np.stack([_uniform(rng, dims[1:])] * dims[0]))
        else:
            arrays.append(_uniform(rng, dims))
    return arrays


def _replica_inputs(module: hlo_tools.HloModule, seed=0) -> list[np.ndarray]:
    """Per-replica inputs (leading axis: replica): `parameter_replication={true}` ones equal;
    integers (step counters) 3 everywhere."""
    rng = np.random.default_rng(seed)
    n = module.replica_count
    arrays = []
    for param in module.entry.parameters:
        dims = param.shape.dims
        if param.shape.dtype in ("s32", "s64"):
            arrays.append(np.full((n, *dims), 3, np.int32 if param.shape.dtype == "s32" else np.int64))
        elif "parameter_replication" in param.attrs:
            arrays.append(np.stack([_uniform(rng, dims)] * n))
        else:
            arrays.append(_uniform(rng, (n, *dims)))
    return arrays


def _per_device_inputs(module: hlo_tools.HloModule, seed=0) -> list[np.ndarray]:
    """Global inputs of a per-device module: tiled parameters are per-device shape x tiles."""
    rng = np.random.default_rng(seed)
    arrays = []
    for param in module.entry.parameters:
        dims = list(param.shape.dims)
        sharding = param.attrs.get("sharding")
        if sharding is not None and sharding.is_tiled:
            dims = [d * t for d, t in zip(dims, sharding.tile_dims)]
        arrays.append(np.full(dims, 3, np.int32) if param.shape.dtype == "s32" else _uniform(rng, dims))
    return arrays


def _shard_map_body(module: hlo_tools.HloModule) -> hlo_tools.HloComputation:
    return next(c for c in module.computations if c.name.startswith("xla.sdy.manual_computation_body"))


def _opcodes(comp) -> list[str]:
    return [i.opcode for i in comp.instructions]


def _run_pass(module: hlo_tools.HloModule, pipeline: str = ALL_SIZES):
    """Run `pipeline` on `module`; return its weight-update-sharding pass, which holds the report."""
    passes = xla_passes.parse_pipeline(pipeline)
    xla_passes.run_passes(module, passes)
    return next(p for p in passes if p.name == PASS)


# --- JAX data-parallel steps (shard_map + pmean) --------------------------------------------------------

@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_shard_map_steps_compute_the_same(optimizer):
    text = _lowered_text(*_shard_map_step(OPTIMIZERS[optimizer]()))
    before = hlo_tools.parse_module(text)
    module = run_and_compare(text, ALL_SIZES, exact=False, inputs=_spmd_inputs(before), **BOUNDS)
    body = _shard_map_body(module)
    opcodes = _opcodes(body)
    # the gradients are reduce-scattered (see REDUCE_SCATTERED), every weight and state is gathered.
    assert opcodes.count("reduce-scatter") == REDUCE_SCATTERED
    assert opcodes.count("all-gather") == 3 * (1 + STATE_PER_WEIGHT[optimizer])
    remaining = {i.shape.to_text(print_layout=False) for i in body.instructions if i.opcode == "all-reduce"}
    assert remaining <= {"f32[]", "f32[1,13]"}, remaining
    offset = body.get("shard_index")
    assert offset.opcode == "convert" and offset.operand(0).opcode == "partition-id"
    assert any(i.opcode == "dynamic-slice" and "shard_offset" in {o.name for o in i.operands}
               for i in body.instructions)


def test_clipped_adam_sums_partial_norms_across_the_group():
    text = _lowered_text(*_shard_map_step(OPTIMIZERS["clipped_adam"]()))
    module = hlo_tools.parse_module(text)
    report = _run_pass(module).report
    assert [r.sharded for r in report].count(True) == 3
    body = _shard_map_body(module)
    partial_sums = [i for i in body.instructions if i.opcode == "all-reduce" and i.name.endswith(".sum")]
    assert len(partial_sums) == 3 and all(i.operand(0).opcode == "reduce" for i in partial_sums)
    # the padded weights mask their padding out of the sum of squares
    assert sum(1 for i in body.instructions if i.name.endswith(".masked")) == 2


def test_the_report_says_how_each_weight_was_split():
    module = hlo_tools.parse_module(_lowered_text(*_shard_map_step(OPTIMIZERS["adam"]())))
    report = {r.weights[-1]: r for r in _run_pass(module).report if r.weights}
    w1, b1, w2 = report["params__w1__.1"], report["params__b1__.1"], report["params__w2__.1"]
    assert (w1.sharded, w1.dimension, w1.padding, w1.shard_bytes) == (True, 0, 0, 2 * 13 * 4)
    assert (w2.sharded, w2.dimension, w2.padding, w2.shard_bytes) == (True, None, 4, 7 * 4)
    assert (b1.sharded, b1.dimension, b1.padding, b1.shard_bytes) == (True, None, 3, 2 * 4)
    assert w1.weights == ("state_0__mu__w1__.1", "state_0__nu__w1__.1", "params__w1__.1")
    assert str(w1).endswith("params__w1__.1) over 8 devices, dimension 0: 104 bytes per device")
    assert str(w2).endswith("over 8 devices, flattened with 4 elements of padding: 28 bytes per device")


def test_default_threshold_keeps_small_weights_replicated():
    module = hlo_tools.parse_module(_lowered_text(*_shard_map_step(OPTIMIZERS["momentum"]())))
    report = _run_pass(module, PASS).report  # threshold_bytes=1024: every gradient here is smaller
    assert not any(r.sharded for r in report)
    assert all(r.reason.startswith("tiny: ") for r in report)


@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_trust_ratios_in_calls(optimizer):
    """LAMB's and LARS's per-tensor norms sit in called computations (jnp.linalg.norm): the pass
    inlines plain calls first, so the norms of update values become partial sums and an
    all-reduce of them, with no call-inliner in the pipeline."""
    text = _lowered_text(*_shard_map_step(getattr(optax, optimizer)(1e-3)))
    before = hlo_tools.parse_module(text)
    assert any(i.opcode == "call" and not i.attrs["to_apply"].name.startswith("xla.sdy")
               for c in before.computations for i in c.instructions)
    module = run_and_compare(text, ALL_SIZES, exact=False, inputs=_spmd_inputs(before), **BOUNDS)
    body = _shard_map_body(module)
    assert _opcodes(body).count("reduce-scatter") == REDUCE_SCATTERED
    partial_sums = [i for i in body.instructions if i.opcode == "all-reduce" and i.name.endswith(".sum")]
    assert partial_sums and all(i.shape.rank == 0 and i.operand(0).opcode == "reduce" for i in partial_sums)


def test_calls_come_back_when_the_pass_changes_nothing():
    """The inlining is part of the pass: a module it leaves unchanged keeps its calls."""
    text = _lowered_text(*_shard_map_step(optax.lamb(1e-3)))
    module = hlo_tools.parse_module(text)
    assert not xla_passes.run_passes(module, f"{PASS}{{threshold_bytes=1000000000}}")
    assert module.to_text() == hlo_tools.parse_module(text).to_text()


@pytest.mark.parametrize("program", ["shard_map_mlp", "flax_cnn_adam"])
def test_the_projects_real_training_steps(program):
    """The shard_map steps of tests/helpers/real_programs.py: SGD on an MLP, a Flax CNN with adam."""
    text = _lowered_text(*real_programs.JAX_PROGRAMS[program]())
    before = hlo_tools.parse_module(text)
    module = run_and_compare(text, ALL_SIZES, exact=False, inputs=_spmd_inputs(before), **BOUNDS)
    assert "reduce-scatter" in _opcodes(_shard_map_body(module))


# --- pmap style and a 2-D mesh ---------------------------------------------------------------------------

def _pmap_step():
    optimizer = optax.sgd(0.1, momentum=0.9)
    params = {"w1": jnp.zeros((16, 32)), "w2": jnp.zeros((32, 4))}
    state = jax.eval_shape(optimizer.init, params)

    def per_device(value):
        return jax.ShapeDtypeStruct((8, *value.shape), value.dtype)

    def loss(params, x, y):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        grads = jax.lax.pmean(grads, "batch")
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(value, "batch")

    fn = jax.pmap(step, axis_name="batch")
    return fn, (jax.tree.map(per_device, params), jax.tree.map(per_device, state),
                jax.ShapeDtypeStruct((8, 8, 16), jnp.float32), jax.ShapeDtypeStruct((8, 8, 4), jnp.float32))


def test_pmap_step_needs_the_replicated_parameters_assumption():
    """pmap hands every device its own copy of the weights: nothing in the module says the
    copies are equal, so the pass keeps them unless told that they are."""
    text = _lowered_text(*_pmap_step())
    kept = _run_pass(hlo_tools.parse_module(text)).report
    assert kept and not any(r.sharded for r in kept)
    assert all("not known to be the same on every device" in r.reason for r in kept)

    before = hlo_tools.parse_module(text)
    weights_and_state = [p.name for p in before.entry.parameters[:4]]
    module = run_and_compare(text, f"{PASS}{{threshold_bytes=0,assume_replicated_parameters=true}}",
                             exact=False, inputs=_spmd_inputs(before, same_along_axis0=weights_and_state),
                             **BOUNDS)
    opcodes = _opcodes(_shard_map_body(module))
    assert opcodes.count("reduce-scatter") == 2 and opcodes.count("all-gather") == 4


def _two_dimensional_mesh_step() -> str:
    """Adam on a 4x2 ("data", "model") mesh: the weight and its moments split over "model",
    gradients averaged over "data" (groups {0,2,4,6},{1,3,5,7}); the lowered module's text."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    optimizer = optax.adam(1e-3)

    def loss(w, x, y):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

    def step(w, state, x, y):
        value, grad = jax.value_and_grad(loss)(w, x, y)
        updates, state = optimizer.update(jax.lax.pmean(grad, "data"), state, w)
        return optax.apply_updates(w, updates), state, jax.lax.pmean(jax.lax.psum(value, "model"), "data")

    state = jax.eval_shape(optimizer.init, jnp.zeros((6, 32)))  # 4 does not divide dimension 0
    state_specs = jax.tree.map(lambda a: P() if a.ndim == 0 else P(None, "model"), state)
    fn = jax.jit(jax.shard_map(step, mesh=mesh,
                               in_specs=(P(None, "model"), state_specs, P("data"), P("data", "model")),
                               out_specs=(P(None, "model"), state_specs, P())))

    def spec(shape, partition, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, partition))

    args = (spec((6, 32), P(None, "model")), jax.tree.map(lambda a, s: spec(a.shape, s, a.dtype), state, state_specs),
            spec((64, 6), P("data")), spec((64, 32), P("data", "model")))
    return _lowered_text(fn, args)


def test_data_axis_of_a_two_dimensional_mesh():
    text = _two_dimensional_mesh_step()
    module = run_and_compare(text, ALL_SIZES, exact=False, inputs=_spmd_inputs(hlo_tools.parse_module(text)),
                             **BOUNDS)
    body = _shard_map_body(module)
    table = body.get("group_positions")
    assert table.literal.to_numpy().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    scatter = next(i for i in body.instructions if i.opcode == "reduce-scatter")
    assert scatter.attrs["replica_groups"].groups == [[0, 2, 4, 6], [1, 3, 5, 7]]


# --- fused modules: the pass inside XLA's PRE_SCHEDULER hook -----------------------------------------------

@pytest.mark.parametrize("optimizer", ["adam", "clipped_adam"])
def test_pass_hook_on_fused_modules(optimizer, tmp_path):
    """XLA hands the hook the partitioned, fused module; the loop fusions of the update are
    cloned at the shard shape (the global-norm fusion of clipping is inlined first)."""
    fn, args = _shard_map_step(OPTIMIZERS[optimizer]())
    rng = np.random.default_rng(0)
    concrete = jax.tree.map(
        lambda a: jax.device_put(np.full(a.shape, 3, a.dtype) if a.dtype == jnp.int32 else _uniform(rng, a.shape),
                                 a.sharding), args)
    expected = fn(*concrete)
    jax.clear_caches()  # compile the step again, this time through the hook
    with xla_passes.jax.enable(ALL_SIZES, dump_to=str(tmp_path), strict=True):
        fn, _ = _shard_map_step(OPTIMIZERS[optimizer]())
        actual = fn(*concrete)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    after = [f for f in os.listdir(tmp_path) if ".jit_step." in f and f.endswith(f"after_{PASS}.txt")]
    assert len(after) == 1
    module = hlo_tools.parse_module(open(os.path.join(tmp_path, after[0]), encoding="utf-8").read())
    assert _opcodes(module.entry).count("reduce-scatter") == REDUCE_SCATTERED
    # w1's update fusions now compute a [2,13] shard, and so do their fused computations
    fusions = [i for i in module.entry.instructions if i.opcode == "fusion" and i.shape.dims == (2, 13)]
    assert fusions and all(p.shape.dims in ((2, 13), ()) for f in fusions for p in f.attrs["calls"].parameters)


# --- buffer donation ---------------------------------------------------------------------------------------

def test_donation_survives_the_rewrite():
    """A donated step aliases its new weights and state to the old ones (input_output_alias):
    the rewritten module keeps that aliasing, and XLA compiles it with as many aliased bytes."""
    text = _lowered_text(*_shard_map_step(OPTIMIZERS["adam"](), donate=True))
    module = hlo_tools.parse_module(text)
    assert _run_pass(module).report
    assert str(module.attrs["input_output_alias"]) == str(hlo_tools.parse_module(text).attrs["input_output_alias"])
    before, after = xla_cost(text, isolate=False).memory, xla_cost(module, isolate=False).memory
    assert after["alias_bytes"] == before["alias_bytes"] > 0
    assert after["temp_bytes"] < before["temp_bytes"]


def _hook_modules_keep_their_aliasing() -> bool:
    """Whether XLA keeps a module's aliasing when a pass hook hands the module back.

    jaxlib 0.10.2's XLA does not, whatever the hook returns (even the bytes it was given):
    `UpdateHloModuleFromProto` (xla/service/xla_transform.cc) installs the new entry
    computation with `ReplaceEntryComputation`, which resets the module's input_output_alias
    and buffer-donor configs. Upstream XLA restores both (its test PreservesAliasAndDonorConfigs).
    """
    from jax.extend import xla as jax_xla

    stage, name = jax_xla.PipelineStage.PRE_SCHEDULER, "tests.hand_back_unchanged"
    jax_xla.register_hlo_module_transformation(bytes, name=name, stage=stage, platforms="cpu")
    try:
        compiled = jax.jit(lambda x: x + 1, donate_argnums=0).lower(jnp.zeros(256)).compile()
    finally:
        jax_xla.clear_hlo_module_transformation(name, stage, platforms="cpu")
    return compiled.memory_analysis().alias_size_in_bytes > 0


def test_donation_at_the_pass_hook():
    """The step compiled with the pass at XLA's hook aliases as many bytes as without it, where
    XLA keeps the aliasing of modules that hooks hand back (not jaxlib 0.10.2's: see above)."""
    fn, args = _shard_map_step(OPTIMIZERS["adam"](), donate=True)
    plain = fn.lower(*args).compile().memory_analysis().alias_size_in_bytes
    jax.clear_caches()
    with xla_passes.jax.enable(ALL_SIZES, strict=True):
        fn, _ = _shard_map_step(OPTIMIZERS["adam"](), donate=True)
        sharded = fn.lower(*args).compile().memory_analysis().alias_size_in_bytes
    assert plain > 0
    if sharded == 0 and not _hook_modules_keep_their_aliasing():
        pytest.xfail("this jaxlib's XLA drops input_output_alias of every module a pass hook hands back")
    assert sharded == plain


def test_persistent_is_refused_at_the_pass_hook(caplog):
    """XLA fixes the program's signature before it calls the hook: persistent=true there would
    hand back parameters of other shapes, so the hook keeps the module and says why."""
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="xla_passes"), \
            xla_passes.jax.enable(f"{PASS}{{threshold_bytes=0,persistent=true}}"):
        fn, args = _shard_map_step(OPTIMIZERS["adam"]())
        compiled = fn.lower(*args).compile()
    assert "reduce-scatter" not in compiled.as_text()
    assert any("changed the entry computation's parameter or result shapes" in r.getMessage()
               for r in caplog.records)


# --- hand-written modules (the FileCheck cases) ------------------------------------------------------------

def _hlo_cases() -> dict[str, str]:
    with open(os.path.join(HERE, "weight_update_sharding.hlo"), encoding="utf-8") as f:
        chunks = f.read().split("// -----")
    return {re.search(r"^HloModule (\w+)", chunk, re.M).group(1): chunk for chunk in chunks}


CASES = _hlo_cases()
SHARDED_CASES = ["sgd", "momentum", "nesterov", "adamw", "subset_groups", "iota_groups", "padded", "clipped",
                 "combined", "chained", "fused", "adam", "keras_adamw", "keras_clipnorm", "lamb", "per_row_norm"]


def _inputs_for(text: str) -> list[np.ndarray]:
    module = hlo_tools.parse_module(text)
    return _replica_inputs(module) if module.replica_count > 1 else _per_device_inputs(module)


@pytest.mark.parametrize("case", SHARDED_CASES)
def test_hand_written_modules_compute_the_same(case):
    text = CASES[case]
    module = run_and_compare(text, f"{PASS}{{threshold_bytes=256}}", exact=False, inputs=_inputs_for(text),
                             **BOUNDS)
    opcodes = _opcodes(module.entry)
    assert "all-gather" in opcodes
    assert "reduce-scatter" in opcodes
    big_all_reduces = [i for i in module.entry.instructions
                       if i.opcode == "all-reduce" and i.shape.byte_size >= 256]
    assert not big_all_reduces


def test_adafactor_factored_moments_compute_the_same():
    """The hook's Adafactor kernel update (weight_update_sharding_adafactor.hlo): row statistics
    of the shard, column sums all-reduced from partial sums, on 8 partitions."""
    with open(os.path.join(HERE, "weight_update_sharding_adafactor.hlo"), encoding="utf-8") as f:
        text = f.read()
    checked = run_and_compare(text, PASS, exact=False, inputs=_per_device_inputs(hlo_tools.parse_module(text)),
                              **BOUNDS)
    assert "reduce-scatter" in _opcodes(checked.entry)


def _sharded_hook_case_computes_the_same(filename: str, case: str) -> None:
    """Module `case` of the FileCheck file `filename`: the pass shards its one weight, and the
    outputs stay those of the original on 8 replicas."""
    with open(os.path.join(HERE, filename), encoding="utf-8") as f:
        chunks = [c[re.search(r"^HloModule", c, re.M).start():] for c in f.read().split("// -----")]
    text = next(c for c in chunks if c.startswith(f"HloModule {case},"))
    module = hlo_tools.parse_module(text)
    module.layouts_final = True
    hlo_pass = xla_passes.pass_class(PASS)()
    assert xla_passes.run_passes(module, [hlo_pass])
    assert [report.sharded for report in hlo_pass.report] == [True], [str(r) for r in hlo_pass.report]
    _, _, comparison = runner.compare_modules(module.to_text(), text, _inputs_for(text), **BOUNDS)
    assert comparison.ok, comparison.format()


@pytest.mark.parametrize("case", ["hook_lars", "diamond"])
def test_lars_at_the_hook_computes_the_same(case):
    """weight_update_sharding_lars.hlo: after the rewrite the norms that read the gradient as XLA
    computed it (transposed) read the transposed-back one, on shards."""
    _sharded_hook_case_computes_the_same("weight_update_sharding_lars.hlo", case)


@pytest.mark.parametrize("case", ["hook_adam_bf16", "plain_convert"])
def test_converted_gradient_at_the_hook_computes_the_same(case):
    """weight_update_sharding_converted.hlo: the gradient reordered before its all-reduce is
    converted (to bfloat16, say) as XLA converted it after, and the update reads it on shards."""
    _sharded_hook_case_computes_the_same("weight_update_sharding_converted.hlo", case)


@pytest.mark.parametrize("case", ["hook_adafactor", "row_norms", "rank3_kept_in_order"])
def test_statistics_of_a_transposed_gradient_at_the_hook_compute_the_same(case):
    """weight_update_sharding_adafactor_transposed.hlo: the row and column statistics that read
    the gradient as XLA computed it (transposed) reduce the transposed-back one along the moved
    dimensions, and the statistics broadcast into the update follow the transpose, on shards."""
    _sharded_hook_case_computes_the_same("weight_update_sharding_adafactor_transposed.hlo", case)


def test_a_wrong_shard_offset_is_caught():
    """The inputs make every element count: shards taken one block off give other results."""
    text = CASES["momentum"]
    module = hlo_tools.parse_module(text)
    _run_pass(module, f"{PASS}{{threshold_bytes=256}}")
    entry = module.entry
    offset = entry.get("shard_offset")

    def constant(value):
        return entry.add_instruction("constant", literal=Literal.from_numpy(np.int32(value)))

    next_block = entry.add_instruction("remainder", [entry.add_instruction("add", [offset, constant(8)]),
                                                     constant(64)])
    for user in list(offset.users):
        if user.opcode == "dynamic-slice":
            user.replace_operand_with(offset, next_block)
    entry.sort_topologically()
    _, _, comparison = runner.compare_modules(module.to_text(), text, _inputs_for(text), **BOUNDS)
    assert not comparison.ok


def test_persistent_state_stays_sharded():
    text = CASES["persistent"]
    module = run_and_compare(text, f"{PASS}{{threshold_bytes=256,persistent=true}}", exact=False,
                             inputs=_per_device_inputs(hlo_tools.parse_module(text)), **BOUNDS)
    m = module.entry.get("m")
    assert m.shape.dims == (8, 16) and str(m.attrs["sharding"]) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert module.entry.get("w").shape.dims == (64, 16)  # the forward pass reads the full weight
    root = module.entry.root
    assert [s.dims for s in root.shape.tuple_shapes] == [(64, 16), (8, 16)]
    assert _opcodes(module.entry).count("all-gather") == 1

    report = _run_pass(hlo_tools.parse_module(text), f"{PASS}{{threshold_bytes=256,persistent=true}}").report
    assert report[0].signature == ("persistent: parameter 1 (%m) f32[64,16] -> f32[8,16], "
                                   "output 1 f32[64,16] -> f32[8,16]")


# No weight needs flattening over 8 devices: all optimizer state can stay split between steps.
SPLITTABLE_SHAPES = {"w1": (16, 32), "b1": (32,), "w2": (32, 8)}
PERSISTENT = f"{PASS}{{threshold_bytes=0,persistent=true}}"


def _run_steps(text: str, inputs: list[np.ndarray], steps: int, carried: int, seed=1) -> list[list[np.ndarray]]:
    """Run a training step `steps` times on the runner, its first `carried` outputs (weights and
    optimizer state) the next step's first inputs, fresh data each step; every step's outputs."""
    rng = np.random.default_rng(seed)
    history = []
    for _ in range(steps):
        outputs = runner.run_module(text, inputs).outputs
        history.append(outputs)
        inputs = list(outputs[:carried]) + [_uniform(rng, a.shape) for a in inputs[carried:]]
    return history


def _assert_same_steps(rewritten: str, original: str, carried: int | None = None, steps: int = 2) -> None:
    """Both modules, run `steps` steps from the same inputs with their first `carried` outputs
    (weights and state; default: all but the loss, the last) fed back, give the same outputs
    at every step."""
    before = hlo_tools.parse_module(original)
    inputs = _spmd_inputs(before)
    carried = before.entry.root.operand_count - 1 if carried is None else carried
    after, expected = (_run_steps(text, inputs, steps, carried) for text in (rewritten, original))
    for step, (got, want) in enumerate(zip(after, expected)):
        comparison = runner.compare_outputs(got, want, **BOUNDS)
        assert comparison.ok, f"step {step}:\n{comparison.format()}"


def test_persistent_state_of_a_shard_map_step():
    """Adam's moments stay split over the data axis between steps: the entry parameters and
    outputs keep their global shapes with a data-axis sharding, the shard_map passes each
    device its shard, only the weights are all-gathered, and each device holds 1/8 of them."""
    text = _lowered_text(*_shard_map_step(optax.adam(1e-3), donate=True, shapes=SPLITTABLE_SHAPES))
    module = hlo_tools.parse_module(text)
    report = _run_pass(module, PERSISTENT).report
    moments = [p for p in module.entry.parameters if "__mu__" in p.name or "__nu__" in p.name]
    assert len(moments) == 6
    for moment in moments:
        shard = _shard_map_body(module).parameter(moment.parameter_number).shape.dims
        tiles = [full // part for full, part in zip(moment.shape.dims, shard)]
        assert sorted(tiles) == [1] * (len(tiles) - 1) + [8]  # one dimension split over the 8 devices
        assert str(moment.attrs["sharding"]) == "{devices=[%s]0,1,2,3,4,5,6,7}" % ",".join(map(str, tiles))
        split = ", ".join('{"data"}' if t == 8 else "{}" for t in tiles)
        assert moment.attrs["frontend_attributes"].get("xla.sdy.sharding") == f"#sdy.sharding<@mesh, [{split}]>"
    root_shardings = module.entry.root.attrs["sharding"].elements
    assert [str(root_shardings[p.parameter_number]) for p in moments] == [str(p.attrs["sharding"]) for p in moments]
    sharded = [r for r in report if r.sharded]
    assert len(sharded) == 3 and all(r.signature.count("(the shard_map body takes and returns") == 2 for r in sharded)
    w1 = next(r for r in sharded if r.weights[-1] == "params__w1__.1")
    # layouts before XLA's optimizations are not final (the gradient's {0,1} is XLA's to change):
    # the first dimension 8 divides, the contiguous one of a weight's default layout
    assert w1.dimension == 0
    assert w1.signature == (
        "persistent: parameter 5 (%state_0__mu__w1__.1) f32[16,32] sharding {replicated} "
        "-> {devices=[8,1]0,1,2,3,4,5,6,7}, "
        "output 5 sharding -> {devices=[8,1]0,1,2,3,4,5,6,7} (the shard_map body takes and returns f32[2,32]); "
        "parameter 8 (%state_0__nu__w1__.1) f32[16,32] sharding {replicated} -> {devices=[8,1]0,1,2,3,4,5,6,7}, "
        "output 8 sharding -> {devices=[8,1]0,1,2,3,4,5,6,7} (the shard_map body takes and returns f32[2,32])")
    # only the weights are gathered: the wire bytes are the all-reduce's
    gathered = sorted(i.shape.dims for i in _shard_map_body(module).instructions if i.opcode == "all-gather")
    assert gathered == sorted(SPLITTABLE_SHAPES.values())

    _assert_same_steps(module.to_text(), text)

    # each device holds 1/8 of the moments, as argument and (donated, aliased) output
    gathered_state = hlo_tools.parse_module(text)
    _run_pass(gathered_state, ALL_SIZES)
    full, split = xla_cost(gathered_state, isolate=False).memory, xla_cost(module, isolate=False).memory
    moment_bytes = sum(p.shape.byte_size for p in moments)
    assert full["argument_bytes"] - split["argument_bytes"] == moment_bytes * 7 // 8
    assert full["alias_bytes"] - split["alias_bytes"] == moment_bytes * 7 // 8


def test_persistent_state_split_over_model_and_data():
    """On a 4x2 mesh the moments, already split over "model" along dimension 1, are split
    further over "data" along it (model-major: the body's local block of 16 columns is the
    model tile, and the data position picks 4 of them), and two steps compute the same."""
    text = _two_dimensional_mesh_step()
    module = hlo_tools.parse_module(text)
    (report,) = _run_pass(module, PERSISTENT).report
    assert report.dimension == 1 and report.signature.count("-> {devices=[1,8]0,2,4,6,1,3,5,7}") == 4
    for moment in module.entry.parameters[2:4]:
        assert moment.attrs["frontend_attributes"].get("xla.sdy.sharding") == \
            '#sdy.sharding<@mesh, [{}, {"model", "data"}]>'
        assert _shard_map_body(module).parameter(moment.parameter_number).shape.dims == (6, 4)
    _assert_same_steps(module.to_text(), text)


def test_persistent_keeps_flattened_state_full_in_a_shard_map_step():
    """A flattened (padded) shard is no split that a shard_map spec can state: that state stays
    full, and the report says so."""
    module = hlo_tools.parse_module(_lowered_text(*_shard_map_step(OPTIMIZERS["momentum"]())))
    report = {r.weights[-1]: r for r in _run_pass(module, PERSISTENT).report if r.weights}
    assert report["params__w1__.1"].signature.startswith("persistent: parameter 4 (%state_0__trace__w1__.1)")
    assert report["params__w2__.1"].signature == (
        "persistent: %shard_map.22 stays full: a flattened shard is not a split of one dimension that "
        "shard_map can express")
    assert module.entry.parameters[5].shape.dims == (13, 4) and "sharding={replicated}" in \
        module.entry.parameters[5].to_text()


def test_persistent_hand_written_shard_map_step():
    """The FileCheck case: two momentum steps, the state carried from one to the next."""
    text = CASES["persistent_shard_map"]
    module = hlo_tools.parse_module(text)
    (report,) = _run_pass(module, f"{PASS}{{threshold_bytes=256,persistent=true}}").report
    assert report.signature == (
        "persistent: parameter 1 (%m) f32[64,16] sharding {replicated} -> {devices=[8,1]0,1,2,3,4,5,6,7}, output 1 "
        "sharding -> {devices=[8,1]0,1,2,3,4,5,6,7} (the shard_map body takes and returns f32[8,16])")
    _assert_same_steps(module.to_text(), text, carried=2)  # the new weight and momentum


KEPT = {
    "non_elementwise_use": "non-elementwise use: %g is used by %gt (transpose)",
    "tiny": "tiny: 64 bytes is below threshold_bytes=256",
    "not_replicated": "%w1 combines %g with %w, which is not known to be the same on every device of the group",
    "no_update": "no update: the gradient is not combined with weights or optimizer state",
    "norm_in_composite": "non-elementwise use: %u is used by %unorm (call); a call the pass does not inline",
    "per_row_norm_flattened": "%rows reduces the update along some of its dimensions, and no dimension",
    "new_weight_read_again": "non-elementwise use: %w1 is used by %prediction (dot)",
    "unknown_devices": "the module does not say which devices take part in it",
    "no_partition_count": "the module has several replicas but does not say how many partitions",
}


@pytest.mark.parametrize("case", list(KEPT))
def test_reasons_to_keep_a_weight_replicated(case):
    module = hlo_tools.parse_module(CASES[case])
    report = _run_pass(module, f"{PASS}{{threshold_bytes=256}}").report
    assert len(report) == 1 and not report[0].sharded
    assert report[0].reason.startswith(KEPT[case])
    assert "reduce-scatter" not in _opcodes(module.entry)


def test_groups_that_cannot_address_a_shard():
    report = _run_pass(hlo_tools.parse_module(CASES["bad_groups"]), f"{PASS}{{threshold_bytes=256}}").report
    assert sorted(r.reason for r in report) == ["its replica groups have different sizes",
                                                "its replica groups have one device each"]


def test_replicated_parameters_assumption_on_a_replica_program():
    text = CASES["not_replicated"]
    inputs = _replica_inputs(hlo_tools.parse_module(text.replace("parameter(0)",
                                                                 "parameter(0), parameter_replication={true}")))
    run_and_compare(text, f"{PASS}{{assume_replicated_parameters=true}}", exact=False, inputs=inputs, **BOUNDS)


def test_report_is_logged_and_exposed(caplog):
    hlo_pass = xla_passes.pass_class(PASS)(threshold_bytes=256)
    module = hlo_tools.parse_module(CASES["combined"])
    with caplog.at_level(logging.INFO, logger="xla_passes"):
        assert xla_passes.run_passes(module, [hlo_pass])
    assert [r.sharded for r in hlo_pass.report] == [True, False]
    lines = [r.getMessage() for r in caplog.records if r.name == "xla_passes"]
    assert lines == [str(r) for r in hlo_pass.report]
    assert lines[0] == ("weight-update-sharding: sharded %sums[0] f32[64,16] (w) over 8 devices, "
                        "dimension 0: 512 bytes per device")
    assert lines[1] == "weight-update-sharding: kept %sums[1] f32[16] (b): tiny: 64 bytes is below threshold_bytes=256"


def test_options_in_pipeline_text():
    (hlo_pass,) = xla_passes.parse_pipeline(f"{PASS}{{threshold_bytes=0,persistent=true,"
                                            f"assume_replicated_parameters=true}}")
    assert (hlo_pass.threshold_bytes, hlo_pass.persistent, hlo_pass.assume_replicated_parameters) == (0, True, True)
    assert hlo_pass.report == []


def test_doc_examples_run_and_print_what_the_page_shows():
    """docs/weight_update_sharding.md, checked the way tests/project/test_docs.py checks the other pages."""
    from doc_examples import DOCS, examples

    page = DOCS / "weight_update_sharding.md"
    cases = examples(page.read_text(encoding="utf-8"))
    assert cases
    namespace = {"__name__": "docs_weight_update_sharding"}
    for source, line, expected in cases:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile("\n" * line + source, str(page), "exec"), namespace)
        if expected is not None:
            assert stdout.getvalue() == expected, f"{page}:{line}: printed output differs from the page"
