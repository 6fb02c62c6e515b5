"""all-reduce-decomposer and all-reduce-2d: the group algebra, and same results through XLA on 8 devices.

The FileCheck files (all_reduce_decomposer.hlo, all_reduce_2d.hlo) pin the rewritten text; here
the rewritten modules run next to the originals: bit-exact on the default small-integer inputs
(every partial sum is exact, so the order of additions cannot show), within float reassociation
on random normal inputs.
"""

import ml_dtypes
import numpy as np
import pytest

import hlo_tools
import xla_passes
import xla_passes.jax
from hlo_tools.xla import xla_bridge
from pass_testing import (normal_inputs, per_device_input_shapes, per_device_program, replica_input_shapes,
                          replica_program, run_and_compare, shard_map_step_outputs)
from xla_passes.analysis.replica_groups import (DeviceCounts, GroupMode, group_mode, mesh_rows_and_columns,
                                                parse_mesh, participant_groups)

ALL = "{{0,1,2,3,4,5,6,7}}"
HALVES = "{{0,1,2,3},{4,5,6,7}}"
STRIDED = "{{0,2,4,6},{1,3,5,7}}"

# (groups, pipeline) pairs that rewrite every all-reduce over those groups in pass_testing's
# replica_program and per_device_program on 8 devices.
REWRITES = [
    (ALL, "all-reduce-decomposer"), (ALL, "all-reduce-2d{mesh=2x4}"), (ALL, "all-reduce-2d{mesh=4x2}"),
    (HALVES, "all-reduce-decomposer"), (HALVES, "all-reduce-2d{mesh=2x2}"),
    (STRIDED, "all-reduce-decomposer"), (STRIDED, "all-reduce-2d{mesh=2x2}"),
]
FLOAT_REWRITES = [(ALL, "all-reduce-2d{mesh=2x4}"), (STRIDED, "all-reduce-2d{mesh=2x2}"),
                  (HALVES, "all-reduce-decomposer")]
# Error bounds for random normal inputs: f32 within a few ulps of reassociation; bf16 rounds
# every partial sum to 8 bits, so one ulp of a sum of 8 is up to 2**-4 below 16.
BOUNDS = {"f32": (1e-5, 1e-5), "bf16": (2.0 ** -4, 2e-2)}
NUMPY_TYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}


def collective_counts(module) -> dict[str, int]:
    counts = {}
    for instr in module.instructions():
        counts[instr.opcode] = counts.get(instr.opcode, 0) + 1
    return {op: counts.get(op, 0) for op in ("all-reduce", "reduce-scatter", "all-gather")}


# --- the group algebra ----------------------------------------------------------------------------

def test_group_modes_and_participants():
    module = hlo_tools.parse_module("""HloModule m, replica_count=2, num_partitions=4

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY main {
  p = f32[8] parameter(0)
  replicas = f32[8] all-reduce(p), replica_groups={}, to_apply=add
  both = f32[8] all-reduce(p), channel_id=1, replica_groups={{1},{0}}, to_apply=add
  flat = f32[8] all-reduce(p), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=add
  ROOT t = (f32[8], f32[8], f32[8]) tuple(replicas, both, flat)
}
""")
    counts = DeviceCounts.of(module)
    replicas, both, flat = (module.find(name) for name in ("replicas", "both", "flat"))
    assert [group_mode(i) for i in (replicas, both, flat)] == [
        GroupMode.CROSS_REPLICA, GroupMode.CROSS_REPLICA_AND_PARTITION, GroupMode.FLATTENED_ID]
    assert participant_groups(replicas, counts) == [[0, 1]]
    # Replica r with all 4 partitions: global ids r*4 .. r*4+3, replica-major, in the written order.
    assert participant_groups(both, counts) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert participant_groups(flat, counts) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    unknown = DeviceCounts(None, None)
    assert participant_groups(replicas, unknown) is None and participant_groups(both, unknown) is None
    assert participant_groups(flat, unknown) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_mesh_rows_and_columns():
    rows, columns = mesh_rows_and_columns([[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]], 2, 3)
    assert rows == [[0, 2, 4], [6, 8, 10], [1, 3, 5], [7, 9, 11]]
    assert columns == [[0, 6], [2, 8], [4, 10], [1, 7], [3, 9], [5, 11]]
    with pytest.raises(ValueError, match="do not form a 2x2 mesh"):
        mesh_rows_and_columns([[0, 1, 2]], 2, 2)
    assert parse_mesh("2x4") == (2, 4)
    for bad in ("2", "0x4", "2x4x2", "x4"):
        with pytest.raises(ValueError, match="is not ROWSxCOLUMNS"):
            parse_mesh(bad)


def test_strict_mesh_names_the_all_reduce():
    text = """HloModule hook

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY main {
  p = f32[8] parameter(0)
  ROOT psum = f32[8] all-reduce(p), channel_id=1, replica_groups={{0}}, to_apply=add
}
"""
    module = hlo_tools.parse_module(text)
    assert not xla_passes.run_passes(module, "all-reduce-2d{mesh=2x4}")
    with pytest.raises(xla_passes.PassError, match="participants are not known") as info:
        xla_passes.run_passes(module, "all-reduce-2d{mesh=2x4,strict=true}")
    assert (info.value.pass_name, info.value.instruction) == ("all-reduce-2d", "psum")
    assert module.to_text() == text


# --- same results through XLA ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("groups,passes", REWRITES + [("{}", "all-reduce-2d{mesh=2x4}")])
def test_replica_program_bit_exact(groups, passes, dtype):
    text = replica_program(dtype, 8, groups)
    module = run_and_compare(text, passes, num_replicas=8)
    middle = 0 if passes == "all-reduce-decomposer" else 4
    assert collective_counts(module) == {"all-reduce": middle, "reduce-scatter": 4, "all-gather": 4}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("groups,passes", FLOAT_REWRITES)
def test_replica_program_float_inputs(groups, passes, dtype):
    text = replica_program(dtype, 8, groups)
    abs_bound, rel_bound = BOUNDS[dtype]
    inputs = normal_inputs(replica_input_shapes(8), NUMPY_TYPES[dtype])
    run_and_compare(text, passes, num_replicas=8, inputs=inputs, exact=False, abs_error_bound=abs_bound,
                    rel_error_bound=rel_bound)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("groups,passes", REWRITES)
def test_per_device_program_bit_exact(groups, passes, dtype):
    text = per_device_program(dtype, 8, groups)
    module = run_and_compare(text, passes, num_partitions=8)
    # `every` (8 devices) does not fit a 2x2 mesh and stays.
    rewritten = 1 if passes.endswith("{mesh=2x2}") else 2
    middle = 0 if passes == "all-reduce-decomposer" else rewritten
    assert collective_counts(module) == {"all-reduce": middle + 2 - rewritten, "reduce-scatter": rewritten,
                                         "all-gather": rewritten}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("groups,passes", FLOAT_REWRITES)
def test_per_device_program_float_inputs(groups, passes, dtype):
    text = per_device_program(dtype, 8, groups)
    abs_bound, rel_bound = BOUNDS[dtype]
    inputs = normal_inputs(per_device_input_shapes(8), NUMPY_TYPES[dtype])
    run_and_compare(text, passes, num_partitions=8, inputs=inputs, exact=False, abs_error_bound=abs_bound,
                    rel_error_bound=rel_bound)


# --- a real JAX program, rewritten where XLA's pass hook hands modules over --------------------------

@pytest.mark.parametrize("passes", ["all-reduce-2d{mesh=2x4}", "all-reduce-decomposer"])
def test_shard_map_gradients_inside_xla(passes, tmp_path):
    reference = shard_map_step_outputs()
    with xla_passes.jax.enable(passes, strict=True, dump_to=str(tmp_path), platforms="cpu"):
        outputs = shard_map_step_outputs()
    pass_name = passes.partition("{")[0]
    rewritten = [p.read_text() for p in tmp_path.glob(f"*.after_{pass_name}.txt")]
    assert any(" reduce-scatter(" in text for text in rewritten)
    for out, ref in zip(outputs, reference, strict=True):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_pass_hook_module_rewritten_as_xla_accepts(pass_hook_modules):
    """The per-device module of the shard_map step: its three gradient all-reduces over
    {{0..7}} (two of them combined tuples, all on channel 1) become 2-D ones with fresh channels."""
    module = hlo_tools.parse_module(pass_hook_modules["pass_hook.pre_scheduler.0"])
    assert xla_passes.run_passes(module, "all-reduce-2d{mesh=2x4}")
    assert collective_counts(module) == {"all-reduce": 3, "reduce-scatter": 3, "all-gather": 3}
    channels = sorted(i.attrs["channel_id"] for i in module.instructions() if i.attrs.get("channel_id"))
    assert channels == list(range(2, 11))
    rows = "replica_groups={{0,1,2,3},{4,5,6,7}}"
    columns = "replica_groups={{0,4},{1,5},{2,6},{3,7}}"
    for instr in module.instructions():
        if instr.opcode in ("reduce-scatter", "all-gather", "all-reduce"):
            assert (columns if instr.opcode == "all-reduce" else rows) in instr.to_text()
    assert xla_bridge.canonical_text(module.to_text()).startswith("HloModule ")
