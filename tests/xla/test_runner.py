"""hlo_tools.xla.runner: real compilation and execution with XLA on 8 CPU devices (no mocks)."""

import pathlib

import jax
import numpy as np
import pytest

import real_programs
from hlo_tools.xla import runner, xla_bridge

ADD = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}
"""

# Every replica collective, with replica groups, on 8 replicas.
REPLICA_PROGRAM = """HloModule replica_collectives, replica_count=8
""" + ADD + """
ENTRY main {
  p = f32[8] parameter(0)
  rs = f32[2] reduce-scatter(p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=add
  ag = f32[8] all-gather(rs), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  cp = f32[8] collective-permute(ag), source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  id = u32[] replica-id()
  idf = f32[] convert(id)
  b = f32[8] broadcast(idf), dimensions={}
  s = f32[8] add(cp, b)
  ar = f32[8] all-reduce(s), replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=add
  ROOT t = (f32[8], f32[2], u32[]) tuple(ar, rs, id)
}
"""

# A per-device module for 4 partitions: rows of x are split over the partitions, each squares
# its rows and the all-reduce sums the 4 blocks; the result is replicated.
PER_DEVICE_4 = """HloModule square_sum_per_device, num_partitions=4
""" + ADD + """
ENTRY main {
  p = f32[2,3] parameter(0), sharding={devices=[4,1]<=[4]}
  m = f32[2,3] multiply(p, p)
  ROOT ar = f32[2,3] all-reduce(m), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add, sharding={replicated}
}
"""

# The same global function on one device.
SINGLE_DEVICE = """HloModule square_sum
""" + ADD + """
ENTRY main {
  x = f32[8,3] parameter(0)
  m = f32[8,3] multiply(x, x)
  r = f32[4,2,3] reshape(m)
  zero = f32[] constant(0)
  ROOT s = f32[2,3] reduce(r, zero), dimensions={0}, to_apply=add
}
"""

# 8 partitions on a 4x2 grid: partition-id, an all-reduce over grid columns, a
# collective-permute within rows, a tuple ROOT whose first element is replicated over rows.
PER_DEVICE_8 = """HloModule grid_per_device, num_partitions=8
""" + ADD + """
ENTRY main {
  p = f32[2,3] parameter(0), sharding={devices=[4,2]<=[8]}
  pid = u32[] partition-id()
  pf = f32[] convert(pid)
  pb = f32[2,3] broadcast(pf), dimensions={}
  m = f32[2,3] multiply(p, pb)
  ar = f32[2,3] all-reduce(m), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=add
  cp = f32[2,3] collective-permute(p), channel_id=2, source_target_pairs={{0,1},{1,0},{2,3},{3,2},{4,5},{5,4},{6,7},{7,6}}
  ROOT t = (f32[2,3], f32[2,3]) tuple(ar, cp), sharding={{devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}, {devices=[4,2]<=[8]}}
}
"""


def per_device_8_expected(x):
    """numpy's PER_DEVICE_8: device d = 2*r + c holds block (r, c) of the 8x6 global array."""
    block = lambda r, c: x[2 * r:2 * r + 2, 3 * c:3 * c + 3]  # noqa: E731
    summed = np.concatenate([sum(block(r, c) * (2 * r + c) for r in range(4)) for c in range(2)], axis=1)
    swapped = np.block([[block(r, 1), block(r, 0)] for r in range(4)])
    return summed, swapped


def test_replica_program_matches_numpy():
    result = runner.run_module(REPLICA_PROGRAM)
    assert (result.mode, result.num_replicas) == ("replica", 8)
    (x,) = result.inputs
    assert x.shape == (8, 8)  # one row per replica
    rs = np.stack([x[4 * (i // 4):4 * (i // 4) + 4].sum(0)[2 * (i % 4):2 * (i % 4) + 2]
                   for i in range(8)])
    ag = np.stack([np.concatenate([rs[4 * (i // 4) + j] for j in range(4)]) for i in range(8)])
    cp = np.stack([ag[(i - 1) % 8] for i in range(8)])
    s = cp + np.arange(8, dtype=np.float32)[:, None]
    ar = np.stack([s[i % 2::2].sum(0) for i in range(8)])
    np.testing.assert_array_equal(result.outputs[0], ar)
    np.testing.assert_array_equal(result.outputs[1], rs)
    np.testing.assert_array_equal(result.outputs[2], np.arange(8, dtype=np.uint32))


def test_replica_inputs_are_stacked_per_replica():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    result = runner.run_module(REPLICA_PROGRAM, [x])
    np.testing.assert_array_equal(result.inputs[0], x)
    with pytest.raises(runner.RunError, match=r"input arg0 is f32\[8\], but .* expects f32\[8,8\]"):
        runner.run_module(REPLICA_PROGRAM, [x[0]])


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
@pytest.mark.parametrize("program", ["shard_map_mlp_step", "jit_named_sharding_step", "pmap_psum_step"])
def test_jax_modules_match_jax(program, partitioner):
    """HLO of JAX programs before optimization, run in partition mode, equals JAX's own run.

    (jax 0.10 lowers pmap to a partitioned program too, with the mapped axis global.)
    """
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    try:
        fn, args = getattr(real_programs, program)()
        text = fn.lower(*args).compiler_ir("hlo").as_hlo_text()
        # compiler_ir("hlo") has no num_partitions=: the count comes from the shardings.  JAX's
        # GSPMD-style text of a plain jit carries no partitioner markers: say "spmd" for it.
        result = runner.run_module(text, partition_mode="auto" if partitioner == "shardy" else "spmd")
        leaves, tree = jax.tree.flatten(args)
        placed = [jax.device_put(x, getattr(a, "sharding", None)) for x, a in zip(result.inputs, leaves)]
        expected = [np.asarray(o) for o in jax.tree.leaves(fn(*jax.tree.unflatten(tree, placed)))]
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    assert (result.mode, result.partitioning, result.num_partitions) == ("partition", "spmd", 8)
    comparison = runner.compare_outputs(result.outputs, expected, 1e-6, 1e-6)
    assert comparison.ok, comparison.format()
    if partitioner == "shardy":
        assert runner.partitioner_for(text) == "shardy"


def test_per_device_module_matches_numpy():
    result = runner.run_module(PER_DEVICE_8)
    assert (result.mode, result.partitioning, result.num_partitions) == ("partition", "per_device", 8)
    (x,) = result.inputs
    assert x.shape == (8, 6)  # global: 4x2 tiles of the per-device f32[2,3]
    summed, swapped = per_device_8_expected(x)
    np.testing.assert_array_equal(result.outputs[0], summed)
    np.testing.assert_array_equal(result.outputs[1], swapped)
    assert result.warnings == []


def test_single_device_vs_per_device_reference():
    result, reference, comparison = runner.compare_modules(PER_DEVICE_4, SINGLE_DEVICE, seed=3)
    assert comparison.ok, comparison.format()
    assert (result.num_partitions, reference.mode) == (4, "single")
    np.testing.assert_array_equal(reference.inputs[0], result.inputs[0])
    x = result.inputs[0]
    np.testing.assert_array_equal(result.outputs[0], (x * x).reshape(4, 2, 3).sum(0))
    # and the other way round: the single-device module is the one under test
    assert runner.compare_modules(SINGLE_DEVICE, PER_DEVICE_4)[2].ok


def test_reference_detects_a_changed_constant():
    assert runner.compare_modules(SINGLE_DEVICE, SINGLE_DEVICE)[2].ok
    changed = SINGLE_DEVICE.replace("constant(0)", "constant(1)")
    _, _, comparison = runner.compare_modules(PER_DEVICE_4, changed)
    assert not comparison.ok
    (bad,) = comparison.mismatched
    assert bad.mismatches == 6 and bad.max_abs_error == 1.0 and bad.first_mismatch == (0, 0)
    assert "out0: f32[2,3] MISMATCH: 6 of 6 elements differ" in comparison.format()
    assert comparison.summary() == "1 of 1 outputs differ from the reference (out0)"


def test_replicated_outputs_that_disagree_are_reported():
    # The ROOT claims to be replicated, but each partition returns its own rows.
    lying = PER_DEVICE_4.replace("ROOT ar = f32[2,3] all-reduce(m), channel_id=1, replica_groups={{0,1,2,3}}, "
                                 "use_global_device_ids=true, to_apply=add, sharding={replicated}",
                                 "ROOT m2 = f32[2,3] add(m, m), sharding={replicated}")
    result = runner.run_module(lying)
    assert result.warnings == ["<module>: output 0: devices 1, 2, 3 hold other values than device 0, though "
                               "sharding {replicated} says they hold the same piece"]


def test_two_processes_equal_one_process():
    one = runner.run_module(PER_DEVICE_8, seed=7)
    two = runner.run_module(PER_DEVICE_8, seed=7, num_processes=2, timeout=120)
    assert (two.num_processes, two.local_devices) == (2, 4)
    comparison = runner.compare_outputs(two.outputs, one.outputs, 0, 0)
    assert comparison.ok, comparison.format()


# XLA's GSPMD partitioner CHECK-fails (aborts the process) on a manual parameter feeding a
# tiled instruction with no conversion in between.
CRASHING = """HloModule careless_manual, num_partitions=4

ENTRY main {
  p = f32[8,3] parameter(0), sharding={manual}
  ROOT c = f32[8,3] copy(p), sharding={devices=[4,1]<=[4]}
}
"""


def test_isolated_xla_crash_is_one_line_error():
    with pytest.raises(runner.RunError) as info:
        runner.run_module(CRASHING, partition_mode="spmd", isolate=True)
    message = str(info.value)
    assert message.startswith("XLA crashed while compiling <module> (SIGABRT): Check failed: ")
    assert "\n" not in message


def test_isolated_run_returns_the_same_outputs(tmp_path):
    path = tmp_path / "m.hlo"
    path.write_text(PER_DEVICE_8)
    isolated = runner.run_module(pathlib.Path(path), isolate=True, seed=2)
    in_process = runner.run_module(PER_DEVICE_8, seed=2)
    assert runner.compare_outputs(isolated.outputs, in_process.outputs, 0, 0).ok


def test_serialized_proto_input():
    proto = xla_bridge.text_to_proto(PER_DEVICE_4)
    # A proto has no header: give the partition count.
    result = runner.run_module(proto, num_partitions=4)
    x = result.inputs[0]
    np.testing.assert_array_equal(result.outputs[0], (x * x).reshape(4, 2, 3).sum(0))


def test_iterations_are_timed():
    result = runner.run_module(SINGLE_DEVICE, iterations=5)
    assert len(result.seconds) == 5
    timing = result.timing()
    assert timing["min"] <= timing["median"] <= timing["max"]


def test_64_bit_types_stay_64_bit():
    module = """HloModule wide

ENTRY main {
  i = s64[4] parameter(0)
  u = u64[4] parameter(1)
  f = f64[4] parameter(2)
  big = s64[] constant(4294967296)
  b = s64[4] broadcast(big), dimensions={}
  i2 = s64[4] add(i, b)
  f2 = f64[4] multiply(f, f)
  ROOT t = (s64[4], u64[4], f64[4]) tuple(i2, u, f2)
}
"""
    inputs = [np.arange(4, dtype=np.int64), np.arange(4, dtype=np.uint64) + 2**40,
              np.arange(4, dtype=np.float64) + 1e-12]
    result = runner.run_module(module, inputs)
    np.testing.assert_array_equal(result.outputs[0], inputs[0] + 2**32)
    np.testing.assert_array_equal(result.outputs[1], inputs[1])
    np.testing.assert_array_equal(result.outputs[2], inputs[2] * inputs[2])
    assert [o.dtype for o in result.outputs] == [np.int64, np.uint64, np.float64]


def test_bf16_through_a_child_and_npz(tmp_path):
    import ml_dtypes

    module = """HloModule bf16_double

ENTRY main {
  x = bf16[4] parameter(0)
  ROOT y = bf16[4] add(x, x)
}
"""
    result = runner.run_module(module, isolate=True)
    assert result.inputs[0].dtype == result.outputs[0].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(result.outputs[0], result.inputs[0] * 2)
    # numpy.savez keeps bf16 as raw 2-byte values: accepted as inputs by size
    path = tmp_path / "in.npz"
    np.savez(path, arg0=result.inputs[0])
    again = runner.run_module(module, path)
    np.testing.assert_array_equal(again.outputs[0], result.outputs[0])


def test_random_inputs_are_small_non_negative_integers():
    a, b, c = runner.random_inputs([((100,), np.float32), ((100,), np.int32), ((100,), np.bool_)], seed=1)
    assert a.dtype == np.float32 and np.all(a == np.round(a)) and a.min() >= 0 and a.max() < runner.RANDOM_HIGH
    assert b.dtype == np.int32 and c.dtype == np.bool_
    again = runner.random_inputs([((100,), np.float32)], seed=1)[0]
    np.testing.assert_array_equal(a, again)


def test_input_errors():
    with pytest.raises(runner.RunError, match=r"takes 1 parameter, but 2 input arrays were given"):
        runner.run_module(SINGLE_DEVICE, [np.zeros((8, 3), np.float32)] * 2)
    with pytest.raises(runner.RunError, match=r"input arg0 is f64\[8,3\], but .* expects f32\[8,3\]"):
        runner.run_module(SINGLE_DEVICE, [np.zeros((8, 3))])
    with pytest.raises(runner.RunError, match=r"parameter 0: sharding \{devices=\[4,1\]<=\[4\]\} is for 4 devices"):
        runner.run_module(PER_DEVICE_4, num_partitions=8)
    with pytest.raises(runner.RunError, match=r"<module>:4:\d+: "):
        runner.run_module("HloModule m\nENTRY e {\n  p = f32[4] parameter(0)\n  ROOT a = f32[4] addd(p, p)\n}\n")


def test_compare_outputs_bounds_nan_and_integers():
    nan = np.float32("nan")
    a = np.array([1.0, nan, np.inf, 100.0], np.float32)
    assert runner.compare_outputs([a], [a.copy()], 0, 0).ok
    close = np.array([1.0005, nan, np.inf, 100.05], np.float32)
    assert runner.compare_outputs([close], [a], 1e-3, 1e-3).ok  # abs within, or rel within
    far = np.array([1.0, 0.0, np.inf, 100.0], np.float32)
    report = runner.compare_outputs([far], [a], 1e-3, 1e-3).outputs[0]
    assert (report.mismatches, report.first_mismatch) == (1, (1,))
    ints = runner.compare_outputs([np.array([1, 2, 3])], [np.array([1, 2, 4])], 10, 10).outputs[0]
    assert not ints.ok and ints.first_mismatch == (2,)
    shapes = runner.compare_outputs([np.zeros(3)], [np.zeros(4)])
    assert not shapes.ok and "the reference's out0 is f64[4]" in shapes.format()


def test_sharding_placements():
    # {devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}: dim 0 in 2 halves, 4 copies each.
    desc = xla_bridge.describe_sharding("{devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}")
    placement = runner._placement(desc, "s", (8, 4), 8, per_device=False, what="p")
    assert placement.local_shape == (4, 4)
    halves = [placement.slices[d][0].start for d in range(8)]
    assert halves == [0, 4, 0, 4, 0, 4, 0, 4]  # devices 0,2,4,6 hold the first half
    assert sum(placement.primary) == 2
    # A module XLA partitions may split unevenly: pieces are zero-padded, outputs cut back.
    ragged = runner._placement(xla_bridge.describe_sharding("{devices=[4]<=[4]}"), "s", (10,), 4,
                               per_device=False, what="p")
    x = np.arange(10, dtype=np.float32)
    pieces = runner._split(x, ragged)
    assert [p.shape for p in pieces] == [(3,)] * 4
    np.testing.assert_array_equal(pieces[3], [9, 0, 0])
    back = runner._assemble(dict(enumerate(pieces)), ragged, np.float32, "o", [])
    np.testing.assert_array_equal(back, x)
