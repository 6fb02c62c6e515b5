"""all-reduce-simplifier: the rewritten programs compute what the originals did, on 8 CPU devices.

Replica programs get the same value of every parameter declared replicated on every replica
(what the pass relies on, and what `xla-opt --check` feeds); a sum of k equal values and their
product with k may differ in the last bit, so float results are compared within 1e-6 and
integer results exactly.
"""
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_tools
import xla_passes
from pass_testing import run_and_compare
from hlo_tools.xla import runner
from xla_passes.tools.validation import check_inputs

REDUCERS = """
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

max {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT m = f32[] maximum(x, y)
}

add.s32 {
  x = s32[] parameter(0)
  y = s32[] parameter(1)
  ROOT s = s32[] add(x, y)
}

add.u8 {
  x = u8[] parameter(0)
  y = u8[] parameter(1)
  ROOT s = u8[] add(x, y)
}

min.s32 {
  x = s32[] parameter(0)
  y = s32[] parameter(1)
  ROOT m = s32[] minimum(x, y)
}

add.pred {
  x = pred[] parameter(0)
  y = pred[] parameter(1)
  ROOT s = pred[] add(x, y)
}
"""

# 8 replicas: gradient chains with their means, a tuple all-reduce mixing replicated and
# differing leaves, other reducers, integer sums (u8 wraps), groups of 4, a kept pred sum.
REPLICA_PROGRAM = """HloModule replicas, replica_count=8
""" + REDUCERS + """
ENTRY main {
  g = f32[6,4] parameter(0)
  w = f32[6,4] parameter(1), parameter_replication={true}
  i = s32[5] parameter(2), parameter_replication={true}
  u = u8[5] parameter(3), parameter_replication={true}
  p = pred[3] parameter(4), parameter_replication={true}
  local = f32[6,4] all-reduce(g), replica_groups={}, to_apply=add
  again = f32[6,4] all-reduce(local), replica_groups={}, to_apply=add
  eight = f32[] constant(8)
  eights = f32[6,4] broadcast(eight), dimensions={}
  mean = f32[6,4] divide(again, eights)
  eighth = f32[] constant(0.125)
  eighths = f32[6,4] broadcast(eighth), dimensions={}
  scaled = f32[6,4] multiply(eighths, again)
  both = (f32[6,4], f32[6,4], f32[6,4]) all-reduce(g, w, local), replica_groups={}, to_apply=add
  b0 = f32[6,4] get-tuple-element(both), index=0
  b1 = f32[6,4] get-tuple-element(both), index=1
  b2 = f32[6,4] get-tuple-element(both), index=2
  halves = f32[6,4] all-reduce(w), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add
  mx = f32[6,4] all-reduce(local), replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=max
  isum = s32[5] all-reduce(i), replica_groups={}, to_apply=add.s32
  usum = u8[5] all-reduce(u), replica_groups={}, to_apply=add.u8
  imin = s32[5] all-reduce(i), replica_groups={}, to_apply=min.s32
  psum = pred[3] all-reduce(p), replica_groups={}, to_apply=add.pred
  ROOT t = (f32[6,4], f32[6,4], f32[6,4], f32[6,4], f32[6,4], f32[6,4], f32[6,4], f32[6,4], s32[5], u8[5], s32[5], pred[3]) tuple(mean, scaled, again, b0, b1, b2, halves, mx, isum, usum, imin, psum)
}
"""


def count(module, opcode: str) -> int:
    return sum(1 for instr in module.instructions() if instr.opcode == opcode)


def test_replica_program_keeps_results():
    """Integer results compare exactly (1e-6 of an integer is none of it)."""
    assert count(hlo_tools.parse_module(REPLICA_PROGRAM), "all-reduce") == 9
    inputs = check_inputs(REPLICA_PROGRAM, REPLICA_PROGRAM)
    module = run_and_compare(REPLICA_PROGRAM, "all-reduce-simplifier", num_replicas=8, exact=False,
                             abs_error_bound=1e-6, rel_error_bound=1e-6, inputs=inputs)
    # left: `local`, the `g` leaf of `both` and the pred sum
    assert [i.name for i in module.instructions() if i.opcode == "all-reduce"] == ["local", "both", "psum"]
    assert count(module, "divide") == 0
    assert module.entry.root.operand(0) is module.entry.root.operand(1) is module.entry.get("local")


def test_only_the_replication_the_module_states_counts():
    """Without `parameter_replication`, a parameter differs between replicas: only the all-reduces
    of sums (`again`, `mx` and the `local` leaf of `both`) go."""
    module = hlo_tools.parse_module(REPLICA_PROGRAM.replace(", parameter_replication={true}", ""))
    xla_passes.run_passes(module, "all-reduce-simplifier")
    assert [i.name for i in module.instructions() if i.opcode == "all-reduce"] == [
        "local", "both", "halves", "isum", "usum", "imin", "psum"]
    assert module.entry.get("both").operand_count == 2


def test_per_device_program_with_shardings_keeps_results():
    text = """HloModule partitions, num_partitions=8
""" + REDUCERS + """
ENTRY main {
  h = f32[4,2] parameter(0), sharding={devices=[2,1,4]<=[8] last_tile_dim_replicate}
  r = f32[4,2] parameter(1), sharding={replicated}
  s = f32[4,2] parameter(2), sharding={devices=[8,1]<=[8]}
  quads = f32[4,2] all-reduce(h), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=add
  all = f32[4,2] all-reduce(h), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=add
  whole = f32[4,2] all-reduce(r), channel_id=3, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=add
  split = f32[4,2] all-reduce(s), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=add
  ROOT t = (f32[4,2], f32[4,2], f32[4,2], f32[4,2]) tuple(quads, all, whole, split), sharding={{replicated}, {replicated}, {replicated}, {replicated}}
}
"""
    module = run_and_compare(text, "all-reduce-simplifier", num_partitions=8, exact=False,
                             abs_error_bound=1e-6, rel_error_bound=1e-6)
    assert [i.name for i in module.instructions() if i.opcode == "all-reduce"] == ["all", "split"]


def test_shard_map_step_before_xla_optimizations():
    """JAX's module (Shardy): a psum of a value varying over the mesh, its pmean again (the value),
    a pmax and a psum of a replicated parameter: three all-reduces go, the results stay."""
    mesh = jax.make_mesh((8,), ("d",))

    def program(w, x):
        g = jax.lax.psum(jnp.tanh(x) * w, "d")
        return jax.lax.pmean(g, "d"), jax.lax.pmax(w, "d"), jax.lax.psum(w, "d")

    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P(), P()),
                               check_vma=False))
    args = [jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((128,), jnp.float32, sharding=NamedSharding(mesh, P("d")))]
    text = fn.lower(*args).compiler_ir("hlo").as_hlo_text()
    assert count(hlo_tools.parse_module(text), "all-reduce") == 4
    module = run_and_compare(text, "all-reduce-simplifier", exact=False, abs_error_bound=1e-6,
                             rel_error_bound=1e-6)
    assert count(module, "all-reduce") == 1 and count(module, "divide") == 0


def test_at_the_hook_a_fusion_that_reads_the_product_computes_it():
    """After XLA's fusion: the update fusion reads the all-reduce's operand, its mean's 1/8 gone;
    the square fusion multiplies its operand by 8 in its own body; the tuple keeps the product's
    kLoop fusion; and every result is what the two all-reduces gave (on 8 partitions, the module
    as the JAX hook hands it over; a sum of 8 equal values and their product with 8 may differ in
    the last bit)."""
    text = (pathlib.Path(__file__).parent / "all_reduce_simplifier_hook.hlo").read_text()
    module = hlo_tools.parse_module(text)
    assert xla_passes.run_passes(module, "all-reduce-simplifier", layouts_final=True)
    local = module.entry.get("local")
    update, square = module.entry.get("update"), module.entry.get("square")
    assert update.operand(1) is square.operand(0) is local
    assert [i.opcode for i in update.attrs["calls"].parameter(1).users] == ["subtract"]
    assert [i.opcode for i in square.attrs["calls"].parameter(0).users] == ["multiply"]
    assert module.entry.root.operand(2).opcode == "fusion"
    result, reference, comparison = runner.compare_modules(module.to_text(), text, num_partitions=8,
                                                           reference_num_partitions=8, abs_error_bound=1e-6,
                                                           rel_error_bound=1e-6)
    assert comparison.ok, comparison.format()
