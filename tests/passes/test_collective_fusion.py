"""The collective combiners: keys, grouping without cycles, and same results through XLA.

Hand-written replica and per-device programs run through `hlo_tools.xla.runner` (bit-exact);
JAX programs run where the passes run in production, inside XLA's pass hook, in a worker
process (`collective_hook_worker.py`) with XLA's own combiner switched off.
"""
import json
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_tools
import xla_passes
from hlo_tools.xla import xla_bridge
from pass_testing import run_and_compare
from xla_passes.analysis import collectives, reachability

HERE = os.path.dirname(os.path.abspath(__file__))
HOOK_WORKER = os.path.join(os.path.dirname(HERE), "workers", "collective_hook_worker.py")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")

REDUCERS = """
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

add.swapped {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(y, x)
}

max {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT m = f32[] maximum(x, y)
}

add.bf16 {
  x = bf16[] parameter(0)
  y = bf16[] parameter(1)
  ROOT s = bf16[] add(x, y)
}

add.s32 {
  x = s32[] parameter(0)
  y = s32[] parameter(1)
  ROOT s = s32[] add(x, y)
}

min.s32 {
  x = s32[] parameter(0)
  y = s32[] parameter(1)
  ROOT m = s32[] minimum(x, y)
}
"""


def counts(module) -> dict[str, int]:
    return {op: sum(1 for i in module.instructions() if i.opcode == op) for op in COLLECTIVES}


def replica_program() -> str:
    """8 replicas, 19 all-reduces (f32, bf16, s32; add, max, min; two kinds of groups; one
    depending on another) and 6 all-gathers (f32, s32, bf16; dimensions 0 and 1).

    No bf16 all-gather along dimension 1: XLA's CPU compiler miscomputes a tuple-shaped one
    compiled from HLO without layouts (jaxlib 0.10.2: it converts to f32 around it and
    gathers along the minor dimension). JAX programs never hand it one: at the pass hook
    bf16 all-gathers are f32 already, with the gathered dimension major.
    """
    lines = ["p = f32[6,4] parameter(0)", "i = s32[10] parameter(1)", "h = bf16[3,8] parameter(2)",
             "j = s32[2,5] parameter(3)"]
    outputs = []

    def emit(name, text, shape):
        lines.append(f"{name} = {shape} {text}")
        outputs.append((name, shape))

    for k in range(6):
        emit(f"ar_f{k}", f"all-reduce(p), replica_groups={{}}, to_apply={'add' if k % 2 else 'add.swapped'}",
             "f32[6,4]")
        emit(f"ar_i{k}", "all-reduce(i), replica_groups={{0,1,2,3},{4,5,6,7}}, "
                         f"to_apply={'add.s32' if k < 4 else 'min.s32'}", "s32[10]")
    for k in range(3):
        emit(f"ar_h{k}", "all-reduce(h), replica_groups={}, to_apply=add.bf16", "bf16[3,8]")
        emit(f"ar_m{k}", "all-reduce(p), replica_groups={}, to_apply=max", "f32[6,4]")
    lines.append("dep = f32[6,4] negate(ar_f0)")
    emit("ar_dep", "all-reduce(dep), replica_groups={}, to_apply=add", "f32[6,4]")
    emit("ag0", "all-gather(p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}", "f32[12,4]")
    emit("ag1", "all-gather(i), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}", "s32[20]")
    emit("ag2", "all-gather(j), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={1}", "s32[2,10]")
    emit("ag3", "all-gather(p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={1}", "f32[6,8]")
    emit("ag4", "all-gather(h), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}", "bf16[6,8]")
    emit("ag5", "all-gather(ag0), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}", "f32[24,4]")
    root = (f"ROOT t = ({', '.join(shape for _, shape in outputs)}) "
            f"tuple({', '.join(name for name, _ in outputs)})")
    body = "\n  ".join(lines + [root])
    return f"HloModule replica_collectives, replica_count=8\n{REDUCERS}\nENTRY main {{\n  {body}\n}}\n"


PER_DEVICE = """HloModule per_device_collectives, num_partitions=8
""" + REDUCERS + """
cond {
  c = (f32[4,2], s32[]) parameter(0)
  n = s32[] get-tuple-element(c), index=1
  k = s32[] constant(3)
  ROOT lt = pred[] compare(n, k), direction=LT
}

body {
  b = (f32[4,2], s32[]) parameter(0)
  v = f32[4,2] get-tuple-element(b), index=0
  n = s32[] get-tuple-element(b), index=1
  rows = f32[4,2] all-reduce(v), channel_id=10, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=add
  cols = f32[4,2] all-reduce(v), channel_id=11, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=add
  half = f32[4,2] constant({{0.5, 0.5}, {0.5, 0.5}, {0.5, 0.5}, {0.5, 0.5}})
  s = f32[4,2] add(rows, cols)
  scaled = f32[4,2] multiply(s, half)
  one = s32[] constant(1)
  m = s32[] add(n, one)
  ROOT t = (f32[4,2], s32[]) tuple(scaled, m)
}

ENTRY main {
  p = f32[4,2] parameter(0), sharding={devices=[2,4]<=[8]}
  i = s32[8] parameter(1), sharding={devices=[8]<=[8]}
  a = f32[4,2] all-reduce(p), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=add
  b = f32[4,2] all-reduce(p), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add.swapped
  c = s32[8] all-reduce(i), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=add.s32
  d = s32[8] all-reduce(i), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=add.s32
  g = f32[16,2] all-gather(p), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  h = s32[32] all-gather(i), channel_id=6, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  zero = s32[] constant(0)
  init = (f32[4,2], s32[]) tuple(p, zero)
  loop = (f32[4,2], s32[]) while(init), condition=cond, body=body
  l = f32[4,2] get-tuple-element(loop), index=0
  sum = f32[4,2] add(a, b)
  isum = s32[8] add(c, d)
  ROOT t = (f32[4,2], s32[8], f32[16,2], s32[32], f32[4,2]) tuple(sum, isum, g, h, l), sharding={{replicated}, {replicated}, {devices=[2,1,4]<=[8] last_tile_dim_replicate}, {devices=[2,4]<=[8] last_tile_dim_replicate}, {devices=[2,4]<=[8]}}
}
"""


# -- the passes and their options -------------------------------------------------------------------------

def test_pipeline_text_builds_each_combiner_with_its_options():
    text = "collective-fusion{threshold_bytes=1024,threshold_count=4,combine_by_dim=false}"
    (fusion,) = xla_passes.parse_pipeline(text)
    assert (fusion.threshold_bytes, fusion.threshold_count, fusion.combine_by_dim) == (1024, 4, False)
    assert str(fusion) == text
    passes = xla_passes.parse_pipeline("all-reduce-combiner,all-gather-combiner,reduce-scatter-combiner")
    assert [p.threshold_bytes for p in passes] == [None] * 3   # unset: the platform's
    assert [collectives.combiner_thresholds(p) for p in passes] == [
        {"threshold_bytes": 30 * 1024 * 1024, "threshold_count": 256}] * 3   # offline: GPU's
    with pytest.raises(xla_passes.PassError, match="combine_by_dim"):
        xla_passes.parse_pipeline("all-reduce-combiner{combine_by_dim=true}")


@pytest.mark.parametrize("platform, threshold_bytes", [("cpu", collectives.LARGEST_PRESENT), ("cuda", 30 << 20),
                                                       ("tpu", 30 << 20)])
def test_platform_thresholds_fill_in_only_what_is_unset(platform, threshold_bytes):
    """What the JAX hook does with the platform it compiles for: XLA's thresholds there, unless
    the pipeline gives its own. The platform's come in the run's `PassContext`; no option of a
    pass object is set (the pipeline's passes stay as parsed)."""
    passes = xla_passes.parse_pipeline("collective-fusion,all-gather-combiner{threshold_bytes=64},dce")
    context = xla_passes.PassContext(combiner_thresholds=collectives.platform_thresholds(platform))
    combiners = [*passes[0].passes[1:], passes[1]]   # collective-fusion's three, and the one given 64
    assert [collectives.combiner_thresholds(p, context) for p in combiners] == [
        {"threshold_bytes": threshold_bytes, "threshold_count": 256}] * 3 + [
        {"threshold_bytes": 64, "threshold_count": 256}]
    assert (passes[0].threshold_bytes, passes[0].threshold_count) == (None, None)
    assert [p.threshold_bytes for p in combiners] == [None, None, None, 64]


def test_the_pipeline_hands_the_platform_thresholds_to_the_combiners():
    """`Pipeline(platform=...)` puts them in the context each pass's `run(module, context)` gets."""
    seen = []

    class Spy(xla_passes.HloPass):
        name = "test-spy"

        def run(self, module, context=None):
            seen.append(context.combiner_thresholds)
            return False

    module = hlo_tools.parse_module(PER_DEVICE)
    xla_passes.Pipeline([Spy()], platform="cpu").run(module)
    xla_passes.Pipeline([Spy()]).run(module)
    assert seen == [(collectives.LARGEST_PRESENT, 256), None]   # None offline: the combiners' defaults (GPU's)


@pytest.mark.parametrize("platform, combined", [("cpu", 10), ("cuda", 4)])
def test_94_mb_of_gradients_combine_as_the_platform_affords(platform, combined):
    """ResNet50-sized gradients (10 of 9.4 MB): on CPU, whose all-reduce writes out of place, a
    group may hold no more than the largest one alone (none combine: two would hold 18.8 MB of
    sums at once); groups of three under GPU's 30 MiB."""
    names = [f"g{k}" for k in range(10)]
    lines = [f"{name} = f32[2457600] parameter({k})" for k, name in enumerate(names)]
    lines += [f"r{name} = f32[2457600] all-reduce({name}), replica_groups={{}}, to_apply=add" for name in names]
    lines.append(f"ROOT t = ({', '.join(['f32[2457600]'] * 10)}) tuple({', '.join('r' + n for n in names)})")
    module = hlo_tools.parse_module("HloModule resnet_sized, replica_count=8\n" + REDUCERS
                                    + "\nENTRY main {\n  " + "\n  ".join(lines) + "\n}\n")
    xla_passes.run_passes(module, "collective-fusion", platform=platform)
    assert counts(module)["all-reduce"] == combined


def test_on_cpu_all_reduces_combine_up_to_the_largest():
    """A 2 MiB, five 512 KiB and a 1 MiB all-reduce on CPU: the others fill groups of at most
    2 MiB, the largest's size (bytes of results, in post order); below 1 MiB all would combine."""
    sizes = [1 << 19, 1 << 17, 1 << 17, 1 << 17, 1 << 17, 1 << 17, 1 << 18]
    lines = [f"p{k} = f32[{size}] parameter({k})" for k, size in enumerate(sizes)]
    lines += [f"r{k} = f32[{size}] all-reduce(p{k}), replica_groups={{}}, to_apply=add" for k, size in enumerate(sizes)]
    lines.append(f"ROOT t = ({', '.join(f'f32[{size}]' for size in sizes)}) "
                 f"tuple({', '.join(f'r{k}' for k in range(len(sizes)))})")
    text = "HloModule sizes, replica_count=8\n" + REDUCERS + "\nENTRY main {\n  " + "\n  ".join(lines) + "\n}\n"
    module = hlo_tools.parse_module(text)
    xla_passes.run_passes(module, "collective-fusion", platform="cpu")
    assert sorted(instr.shape.byte_size for instr in module.instructions() if instr.opcode == "all-reduce") == [
        3 << 19, 1 << 21, 1 << 21]
    small = hlo_tools.parse_module(text.replace(f"{1 << 19}]", "1024]").replace(f"{1 << 17}]", "256]")
                                   .replace(f"{1 << 18}]", "512]"))
    xla_passes.run_passes(small, "collective-fusion", platform="cpu")
    assert counts(small)["all-reduce"] == 1


# -- keys --------------------------------------------------------------------------------------------------

def test_keys_compare_what_the_communication_means():
    module = hlo_tools.parse_module(PER_DEVICE)
    entry = module.entry
    a, b, c, d, g, h = (entry.get(name) for name in "abcdgh")
    assert collectives.replica_groups_key(a) == collectives.replica_groups_key(b) == (tuple(range(8)),)
    assert collectives.reducer_key(a) == collectives.reducer_key(b)   # add(x, y) and add(y, x)
    assert collectives.reducer_key(a) != collectives.reducer_key(c)   # f32 and s32
    assert collectives.collective_key(a) == collectives.collective_key(b)
    assert collectives.collective_key(c) == collectives.collective_key(d) != collectives.collective_key(a)
    assert collectives.collective_key(g) == collectives.collective_key(h)   # f32 and s32 gathers
    rows = module.computation("body").get("rows")
    assert collectives.replica_groups_key(rows) == ((0, 1, 2, 3), (4, 5, 6, 7))
    rows.attrs["constrain_layout"] = True
    assert collectives.collective_key(rows) is None


def test_dependency_tracker_follows_operands_and_control_edges():
    module = hlo_tools.parse_module("""HloModule deps

ENTRY main {
  p = f32[2] parameter(0)
  a = f32[2] negate(p)
  b = f32[2] exponential(a)
  c = f32[2] sine(p), control-predecessors={b}
  d = f32[2] cosine(p)
  ROOT t = (f32[2], f32[2]) tuple(c, d)
}
""")
    comp = module.entry
    tracker = reachability.DependencyTracker(comp)
    tracker.add_source(comp.get("a"))
    assert [i.name for i in comp.instructions if tracker.depends_on_sources(i)] == ["b", "c", "t"]


# -- grouping: never a cycle, whatever the dependencies and thresholds --------------------------------------

def random_module(rng: random.Random, size: int) -> str:
    """A replica program of `size` all-reduces, each reading a random mix of parameters and
    earlier all-reduce results (so groups are cut by dependencies), some with control edges."""
    lines = ["p = f32[4] parameter(0)", "q = f32[4] parameter(1)"]
    values = ["p", "q"]
    reduced = []
    for k in range(size):
        x, y = rng.choice(values), rng.choice(values)
        lines.append(f"in{k} = f32[4] add({x}, {y})")
        control = f", control-predecessors={{{rng.choice(reduced)}}}" if reduced and rng.random() < 0.15 else ""
        lines.append(f"ar{k} = f32[4] all-reduce(in{k}), replica_groups={{}}, to_apply=add{control}")
        values.append(f"ar{k}")
        reduced.append(f"ar{k}")
    root = f"ROOT t = ({', '.join(['f32[4]'] * size)}) tuple({', '.join(reduced)})"
    body = "\n  ".join(lines + [root])
    return f"HloModule random_{size}, replica_count=8\n{REDUCERS}\nENTRY main {{\n  {body}\n}}\n"


def test_random_dependencies_never_make_a_cycle():
    rng = random.Random(7)
    for trial in range(40):
        text = random_module(rng, rng.randint(2, 24))
        module = hlo_tools.parse_module(text)
        before = counts(module)["all-reduce"]
        threshold_count = rng.choice([2, 3, 5, 256])
        xla_passes.run_passes(module, f"all-reduce-combiner{{threshold_count={threshold_count}}}")
        hlo_tools.verify(module)
        position = {instr: n for n, instr in enumerate(module.entry.instructions)}
        for instr in module.entry.instructions:
            assert all(position[o] < position[instr] for o in (*instr.operands, *instr.control_predecessors))
        combined = [i for i in module.instructions() if i.opcode == "all-reduce"]
        assert sum(i.operand_count for i in combined) == before, trial
        assert all(i.operand_count <= threshold_count for i in combined if i.shape.is_tuple)


def test_random_dependencies_keep_results():
    rng = random.Random(11)
    for size in (9, 17):
        module = run_and_compare(random_module(rng, size), "all-reduce-combiner{threshold_count=4}",
                                 num_replicas=8)
        assert counts(module)["all-reduce"] < size


def test_same_input_same_output():
    text = replica_program()
    outputs = set()
    for _ in range(2):
        module = hlo_tools.parse_module(text)
        xla_passes.run_passes(module, "collective-fusion{combine_by_dim=false}")
        outputs.add(module.to_text())
    assert len(outputs) == 1


# -- same results through XLA ------------------------------------------------------------------------------

@pytest.mark.parametrize("passes, all_reduces, all_gathers", [
    # All-reduces: f32 add (6, two reducer computations of one meaning) and one that reads
    # the first of them, s32 add (4), s32 min (2), bf16 add (3), f32 max (3): 5 kinds and the
    # dependent one alone. All-gathers: dimension 0 (3 types) and one reading the first of
    # them, dimension 1 (2).
    ("all-gather-combiner,all-reduce-combiner", 6, 3),
    ("all-gather-combiner{combine_by_dim=false},all-reduce-combiner", 6, 2),
    # Two all-gathers a group; 200 bytes: two f32[6,4] (96 bytes each), four s32[10], three
    # bf16[3,8] a group.
    ("all-gather-combiner{threshold_count=2},all-reduce-combiner{threshold_bytes=200}", 9, 3),
])
def test_replica_program_keeps_results(passes, all_reduces, all_gathers):
    text = replica_program()
    before = counts(hlo_tools.parse_module(text))
    assert (before["all-reduce"], before["all-gather"]) == (19, 6)
    module = run_and_compare(text, passes, num_replicas=8)
    after = counts(module)
    assert (after["all-reduce"], after["all-gather"]) == (all_reduces, all_gathers)


def test_per_device_program_keeps_results():
    """8 partitions, channel ids, iota and explicit groups, a while body, sharded outputs.

    Through `hlo_tools.xla.runner` (HLO -> StableHLO -> XLA) jaxlib 0.10.2 cannot compile a
    tuple-shaped all-reduce with a channel id ("LogicalBuffer ... does not have a layout";
    the module XLA's own combiner makes, from `pass_hook_modules`, fails the same way), so
    the all-reduces combined here are checked by structure; such all-reduces run in
    `test_combiners_inside_xla_pass_hook`, where XLA compiles the module it is handed.
    """
    module = run_and_compare(PER_DEVICE, "all-gather-combiner", num_partitions=8)
    assert counts(module) == {"all-reduce": 6, "all-gather": 1, "reduce-scatter": 0}
    xla_passes.run_passes(module, "all-reduce-combiner")
    hlo_tools.verify(module)
    assert counts(module) == {"all-reduce": 3, "all-gather": 1, "reduce-scatter": 0}
    (in_body,) = [i for i in module.computation("body").instructions if i.opcode == "all-reduce"]
    assert in_body.attrs["channel_id"] == 10 and in_body.operand_count == 2
    entry = sorted(i.attrs["channel_id"] for i in module.entry.instructions if i.opcode == "all-reduce")
    assert entry == [1, 3]


def pmap_mlp_step(layers: int):
    """A pmap-style training step that psums each of the 2 * `layers` gradients on its own."""
    def loss(params, x, y):
        h = x
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h - y) ** 2)

    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "batch"), grads)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((8, 16, 16), f32), jax.ShapeDtypeStruct((8, 16), f32))
              for _ in range(layers)]
    args = (params, jax.ShapeDtypeStruct((8, 4, 16), f32), jax.ShapeDtypeStruct((8, 4, 16), f32))
    return jax.pmap(step, axis_name="batch").lower(*args).compiler_ir("hlo").as_hlo_text()


@pytest.mark.parametrize("passes, expected", [
    ("collective-fusion", 1),
    ("collective-fusion{threshold_bytes=4096}", 4),   # 12 layers of 1088 bytes: 3 a group
    ("all-reduce-combiner{threshold_count=5}", 5),
])
def test_pmap_gradient_psums_combine(passes, expected):
    """JAX's module before XLA's optimizations: 24 psums in a Shardy shard_map body, all on
    channel 1. XLA refuses a tuple-shaped all-reduce there, so each group is one all-reduce of a
    flat buffer, which runs and sums bit for bit what the 24 did."""
    text = pmap_mlp_step(12)
    before = [i for i in hlo_tools.parse_module(text).instructions() if i.opcode == "all-reduce"]
    assert len(before) == 24
    module = run_and_compare(text, passes, num_partitions=8)
    combined = [i for i in module.instructions() if i.opcode == "all-reduce"]
    assert len(combined) == expected
    assert all(i.shape.is_array and i.parent.name.startswith(collectives.SHARDY_BODY_PREFIX) for i in combined)
    assert sum(i.shape.element_count for i in combined) == sum(i.shape.element_count for i in before)


@pytest.mark.parametrize("program, before, combined_alone", [
    ("shard_map_mlp", 5, 2), ("flax_cnn_adam", 13, 2), ("pmap_psum", 2, 1)])
def test_jax_shard_map_modules(program, before, combined_alone, jax_modules):
    """JAX's data-parallel steps before optimization (Shardy). Under shard_map each gradient is
    all-reduced twice (psum_invariant, then pmean), each reading the one before: the simplifier
    removes the second (its operand is the same on every device), and what is left combines
    into one flat all-reduce, whose results match the original's within float rounding (a sum of
    8 equal values against their product with 8). The combiners alone, passing over the
    dependent all-reduces, leave two groups where XLA's chain-closing grouping left 3 and 7."""
    text = jax_modules[f"jax.{program}.before"]
    assert counts(hlo_tools.parse_module(text))["all-reduce"] == before
    combined = hlo_tools.parse_module(text)
    xla_passes.run_passes(combined, "collective-fusion{simplify=false}")
    assert counts(combined)["all-reduce"] == combined_alone
    module = run_and_compare(text, "collective-fusion", exact=False)
    assert counts(module)["all-reduce"] == 1


def shard_map_module(program, shapes, out_specs) -> str:
    """JAX's HLO (before XLA's optimizations, Shardy) of `program` under shard_map over 8 devices,
    every argument split along its first dimension."""
    mesh = jax.make_mesh((8,), ("d",))
    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=tuple(P("d") for _ in shapes), out_specs=out_specs,
                               check_vma=False))
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("d"))) for shape in shapes]
    return fn.lower(*args).compiler_ir("hlo").as_hlo_text()


def test_shard_map_psums_combine_into_one_flat_all_reduce_that_xla_compiles():
    """The issue's reproduction: XLA refused the tuple all-reduce in the shard_map body ("Sharding
    is tuple-shaped but validation shape is not"); the flat buffer compiles and sums bit for bit
    what the two psums did."""
    text = shard_map_module(lambda a, b: (jax.lax.psum(jnp.tanh(a), "d"), jax.lax.psum(jnp.sin(b), "d")),
                            [(64, 4), (32,)], (P(), P()))
    module = run_and_compare(text, "all-reduce-combiner", num_partitions=8)
    (combined,) = [i for i in module.instructions() if i.opcode == "all-reduce"]
    assert combined.shape.dims == (8 * 4 + 4,) and combined.operand(0).opcode == "concatenate"


def test_shard_map_gathers_and_scatters_are_left_alone():
    """XLA of jaxlib 0.10.2 aborts on a tuple all-gather in a shard_map body and refuses a tuple
    reduce-scatter there, so neither combiner touches a Shardy body."""
    def program(a, b):
        return (jax.lax.all_gather(jnp.tanh(a), "d", tiled=True), jax.lax.all_gather(jnp.sin(b), "d", tiled=True),
                jax.lax.psum_scatter(jnp.tanh(a), "d", tiled=True), jax.lax.psum_scatter(jnp.cos(a), "d", tiled=True))

    text = shard_map_module(program, [(64, 4), (32,)], (P(), P(), P("d"), P("d")))
    module = hlo_tools.parse_module(text)
    assert not xla_passes.run_passes(module, "all-gather-combiner,reduce-scatter-combiner")


def test_pass_hook_module_only_has_dependent_all_reduces(pass_hook_modules):
    """The shard_map step at XLA's stages, after XLA's own combiner: each all-reduce left reads
    the one before it, so the combiners alone change nothing; with the simplifier first, the
    redundant halves of XLA's tuples go and the rest combine into one."""
    for name, text in pass_hook_modules.items():
        module = hlo_tools.parse_module(text)
        assert counts(module)["all-reduce"] == 3
        assert not xla_passes.run_passes(module, "collective-fusion{simplify=false}"), name
        assert xla_passes.run_passes(module, "collective-fusion"), name
        assert counts(module)["all-reduce"] == 1


def test_combiners_inside_xla_pass_hook(tmp_path):
    """Production: XLA's PRE_SCHEDULER hook runs the pipeline on the per-device module (XLA's
    own combiner off), XLA compiles and runs what it returns; outputs are bit for bit those
    without the hook. Tuple reduce-scatters only run this way."""
    report_path = tmp_path / "report.json"
    large = "collective-fusion{simplify=false}"   # bit for bit: no sum of equal values becomes a product
    small = "collective-fusion{threshold_bytes=4096,combine_by_dim=false,simplify=false}"
    paths = [os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]
    # XLA_PASSES* would switch on the installed JAX plugin's own hook in the worker too.
    env = {key: value for key, value in os.environ.items() if not key.startswith("XLA_PASSES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    result = subprocess.run([sys.executable, HOOK_WORKER, str(report_path),
                             large, small], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    for pipeline, programs in report.items():
        for program, outcome in programs.items():
            assert outcome["same_outputs"], (pipeline, program)
    large, small = report[large], report[small]
    assert large["mlp_pmap"]["before"]["all-reduce"] == 25
    assert large["mlp_pmap"]["after"]["all-reduce"] == 1
    assert small["mlp_pmap"]["after"]["all-reduce"] == 4
    assert large["sharded_collectives"]["before"] == {"all-reduce": 3, "all-gather": 3, "reduce-scatter": 4}
    # f32 and s32 reduce differently; collectives of two dimensions need combine_by_dim=false.
    assert large["sharded_collectives"]["after"] == {"all-reduce": 2, "all-gather": 2, "reduce-scatter": 3}
    assert small["sharded_collectives"]["after"] == {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 2}
    assert large["scan_psums"]["before"]["all-reduce"] == 2
    assert large["scan_psums"]["after"]["all-reduce"] == 1
