"""all-reduce-2d with failed chips and on a torus: neighbour-only permutes, same sums through XLA.

The rewritten modules run next to the originals on 14 to 16 CPU devices, each pair in a child
process that sets its own device count (this process has 8). Float sums and products of random
values agree within 1e-5 + 1e-5 * |expected| (only the order of the reductions differs),
maxima and integer sums exactly. all_reduce_2d_failed.hlo pins the rewritten text.
"""

import collections
import re
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hlo_tools
import xla_passes
from hlo_tools.xla import runner
from hlo_tools.inspection.topology import Topology
from pass_testing import reducer
from xla_passes import PassError
from xla_passes.rewrites.reduction_tree import ReductionTree, TreeSchedule

FLOAT_BOUND = 1e-5

REDUCERS = (reducer("add", "f32", "add") + reducer("max", "f32", "maximum") + reducer("mul", "f32", "multiply")
            + reducer("iadd", "s32", "add"))

# 35 elements need padding for every chip count here; the tuple is one buffer of 33; the while
# body reduces three times; max checks that no padding or zero from a non-target is reduced in.
REPLICA_PROGRAM = string.Template("""HloModule replica_sums, replica_count=$n
""" + REDUCERS + """
cond {
  s = (s32[], f32[3]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}

body {
  s = (s32[], f32[3]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[3] get-tuple-element(s), index=1
  one = s32[] constant(1)
  next = s32[] add(i, one)
  sum = f32[3] all-reduce(x), replica_groups={}, to_apply=add
  ROOT t = (s32[], f32[3]) tuple(next, sum)
}

ENTRY main {
  p = f32[5,7] parameter(0)
  q = f32[4,8] parameter(1)
  s = f32[] parameter(2)
  m = f32[9] parameter(3)
  i = s32[40] parameter(4)
  ar = f32[5,7] all-reduce(p), replica_groups={}, to_apply=add
  pair = (f32[4,8], f32[]) all-reduce(q, s), replica_groups=$group, to_apply=add
  q_sum = f32[4,8] get-tuple-element(pair), index=0
  s_sum = f32[] get-tuple-element(pair), index=1
  largest = f32[9] all-reduce(m), replica_groups=$group, to_apply=max
  ints = s32[40] all-reduce(i), replica_groups={}, to_apply=iadd
  zero = s32[] constant(0)
  m3 = f32[3] slice(m), slice={[0:3]}
  init = (s32[], f32[3]) tuple(zero, m3)
  w = (s32[], f32[3]) while(init), condition=cond, body=body
  looped = f32[3] get-tuple-element(w), index=1
  ROOT out = (f32[5,7], f32[4,8], f32[], f32[9], s32[40], f32[3]) tuple(ar, q_sum, s_sum, largest, ints, looped)
}
""")
REPLICA_SHAPES = [(5, 7), (4, 8), (), (9,), (40,)]
REPLICA_INTEGER_OUTPUTS = (4,)

# Per-device partitions: `flat` over global device ids, `every` a channel without
# use_global_device_ids (replica 0 with all partitions), multiplied.
PARTITION_PROGRAM = string.Template("""HloModule per_device, num_partitions=$n
""" + REDUCERS + """
ENTRY main {
  p = f32[5,3] parameter(0), sharding={devices=[$n,1]<=[$n]}
  h = f32[6] parameter(1), sharding={devices=[$n]<=[$n]}
  flat = f32[5,3] all-reduce(p), channel_id=1, replica_groups=$group, use_global_device_ids=true, to_apply=add
  every = f32[6] all-reduce(h), channel_id=2, replica_groups={{0}}, to_apply=mul
  ROOT out = (f32[5,3], f32[6]) tuple(flat, every), sharding={{devices=[$n,1]<=[$n]}, {devices=[$n]<=[$n]}}
}
""")

SMALL_PROGRAM = string.Template("""HloModule small, replica_count=$n
""" + REDUCERS + """
ENTRY main {
  p = f32[20] parameter(0)
  ROOT ar = f32[20] all-reduce(p), replica_groups={}, to_apply=add
}
""")


def machine_of(options: str) -> Topology:
    """The Topology that pass options `mesh=RxC,failed=...` or `torus=RxC...` describe."""
    fields = dict(item.split("=", 1) for item in options.split(","))
    kind = "torus" if "torus" in fields else "mesh"
    return Topology.parse(f"{kind}:{fields[kind]}", fields.get("failed", ""))


def rewrite(text: str, options: str) -> tuple[hlo_tools.HloModule, list[str]]:
    module = hlo_tools.parse_module(text)
    pipeline = xla_passes.pipeline.Pipeline(f"all-reduce-2d{{{options}}}")
    pipeline.run(module)
    return module, pipeline.reports()


def assert_neighbour_permutes_only(module: hlo_tools.HloModule, machine: Topology) -> int:
    """Every collective is a collective-permute between physical neighbours, each device at most
    once a source and once a target; returns how many there are."""
    permutes = 0
    for instr in module.instructions():
        assert instr.opcode not in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all"), instr.name
        if instr.opcode != "collective-permute":
            continue
        permutes += 1
        pairs = instr.attrs["source_target_pairs"]
        for source, target in pairs:
            assert machine.are_neighbours(source, target), f"{instr.name}: {source}->{target} on {machine.describe()}"
        assert len({s for s, _ in pairs}) == len(pairs) == len({t for _, t in pairs}), instr.name
    return permutes


def normal_inputs(shapes, devices: int, integer_outputs=()):
    rng = np.random.default_rng(0)
    return [rng.integers(-1000, 1000, (devices, *shape)).astype(np.int32) if index in integer_outputs
            else rng.standard_normal((devices, *shape)).astype(np.float32)
            for index, shape in enumerate(shapes)]


def run_both(rewritten: str, original: str, inputs=None):
    """Outputs of both modules on the same inputs, in a child process with enough CPU devices."""
    result, reference, _ = runner.compare_modules(rewritten, original, inputs, isolate=True, timeout=300)
    return result.outputs, reference.outputs


def assert_same_results(outputs, references, exact: tuple[int, ...]):
    for index, (got, want) in enumerate(zip(outputs, references)):
        if index in exact:
            np.testing.assert_array_equal(got, want, err_msg=f"out{index}")
        else:
            np.testing.assert_allclose(got, want, rtol=FLOAT_BOUND, atol=FLOAT_BOUND, err_msg=f"out{index}")


# --- differential execution --------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    "mesh=4x4,failed=1:2",          # 15 chips
    "mesh=4x4,failed=1:2;3:0",      # 14 chips
    "torus=4x4,failed=2:1",         # 15 chips, wrap-around links
    "torus=4x4",                    # 16 chips, no failure
])
def test_replica_program_sums_as_before(options):
    machine = machine_of(options)
    devices = machine.num_devices
    group = "{{" + ",".join(map(str, reversed(range(devices)))) + "}}"  # any order of all chips
    text = REPLICA_PROGRAM.substitute(n=devices, group=group)
    module, report = rewrite(text, options)
    assert len(report) == 5 and all("tree of depth" in line for line in report), report
    assert assert_neighbour_permutes_only(module, machine) > 0
    inputs = normal_inputs(REPLICA_SHAPES, devices, REPLICA_INTEGER_OUTPUTS)
    outputs, references = run_both(module.to_text(), text, inputs)
    # maximum (out3) and s32 sums (out4) are exact; the loop's float sums (out5) are normal-sized.
    assert_same_results(outputs, references, exact=(3, 4))


def test_partition_program_sums_and_multiplies_as_before():
    options = "mesh=4x4,failed=0:0;2:2"
    machine = machine_of(options)
    devices = machine.num_devices
    group = "{{" + ",".join(map(str, range(devices))) + "}}"
    text = PARTITION_PROGRAM.substitute(n=devices, group=group)
    module, report = rewrite(text, options)
    assert len(report) == 2 and all("tree of depth" in line for line in report), report
    assert_neighbour_permutes_only(module, machine)
    assert all("channel_id" in instr.attrs for instr in module.instructions() if instr.opcode == "collective-permute")
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((5 * devices, 3)).astype(np.float32),
              rng.uniform(0.5, 1.5, 6 * devices).astype(np.float32)]
    outputs, references = run_both(module.to_text(), text, inputs)
    assert_same_results(outputs, references, exact=())


@pytest.mark.parametrize("use_global_device_ids", [", use_global_device_ids=true", ""])
def test_replica_program_with_a_channel(use_global_device_ids):
    """With one partition the global device ids of a channel all-reduce are replica ids: the
    tree's permutes go without a channel_id, over replica-id, as all-reduce-rings' do (one shared
    check, `xla_passes.analysis.topology_fit`; before it, the tree refused such an all-reduce)."""
    options = "mesh=4x4,failed=1:2"
    devices = machine_of(options).num_devices
    group = "{{" + ",".join(map(str, range(devices))) + "}}"
    text = f"""HloModule channel_sums, replica_count={devices}, num_partitions=1
{REDUCERS}
ENTRY main {{
  p = f32[5,3] parameter(0)
  ROOT ar = f32[5,3] all-reduce(p), channel_id=1, replica_groups={group}{use_global_device_ids}, to_apply=add
}}
"""
    module, report = rewrite(text, options)
    assert len(report) == 1 and "tree of depth" in report[0], report
    assert_neighbour_permutes_only(module, machine_of(options))
    assert all("channel_id" not in i.attrs for i in module.instructions() if i.opcode == "collective-permute")
    assert any(i.opcode == "replica-id" for i in module.instructions())
    outputs, references = run_both(module.to_text(), text, normal_inputs([(5, 3)], devices))
    assert_same_results(outputs, references, exact=())


# --- structure on random machines --------------------------------------------------------------

@st.composite
def machines(draw):
    kind = draw(st.sampled_from(["mesh", "torus"]))
    rows, columns = draw(st.integers(1, 5)), draw(st.integers(2, 5))
    chips = [(r, c) for r in range(rows) for c in range(columns)]
    failed = draw(st.lists(st.sampled_from(chips), max_size=min(4, len(chips) - 2), unique=True))
    return kind, rows, columns, failed


def simulate(schedule: TreeSchedule) -> None:
    """Run the schedule on sets of contributors (which device's value a chunk holds, how often)
    as the module docstring states it, checking that every chunk sent is complete."""
    tree, height, chunks = schedule.tree, schedule.tree.height, schedule.chunks
    devices = len(tree.depth)
    everyone = collections.Counter(range(devices))

    def subtree(device):
        return collections.Counter([device]) + sum((subtree(c) for c in tree.children[device]), collections.Counter())

    partial = [[collections.Counter([device]) for _ in range(chunks)] for device in range(devices)]
    finished = [[None] * chunks for _ in range(devices)]
    by_round = collections.defaultdict(list)
    for round_, direction, _, pairs in schedule.permutes():
        by_round[round_].extend((direction, pair) for pair in pairs)
    for round_ in range(schedule.rounds):
        arrivals = []
        for direction, (source, target) in by_round[round_]:
            if direction == "up":
                chunk = round_ - height + tree.depth[source]
                assert partial[source][chunk] == subtree(source)
                arrivals.append((direction, target, chunk, partial[source][chunk]))
            else:
                chunk = round_ - height - tree.depth[source]
                value = partial[source][chunk] if source == tree.root else finished[source][chunk]
                assert value == everyone
                arrivals.append((direction, target, chunk, value))
        for direction, target, chunk, value in arrivals:
            if direction == "up":
                partial[target][chunk] = partial[target][chunk] + value
            else:
                finished[target][chunk] = value
    assert all(partial[tree.root][k] == everyone for k in range(chunks))
    assert all(finished[d][k] == everyone for d in range(devices) if d != tree.root for k in range(chunks))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines())
def test_random_failures_use_neighbour_links_only(machine_spec):
    kind, rows, columns, failed = machine_spec
    spec = ";".join(f"{r}:{c}" for r, c in failed)
    options = f"{kind}={rows}x{columns}" + (f",failed={spec}" if spec else "")
    assume(kind == "torus" or failed)  # a mesh without failed chips is the logical form
    machine = Topology.parse(f"{kind}:{rows}x{columns}", failed)
    text = SMALL_PROGRAM.substitute(n=machine.num_devices)
    module, report = rewrite(text, options)
    cut = any(machine.path(0, device) is None for device in range(machine.num_devices))
    if cut:
        assert module.to_text() == hlo_tools.parse_module(text).to_text()
        assert len(report) == 2 and report[1] == f"unchanged: {report[0]}"  # the pass could not apply at all
        cut_off = f"%ar left alone: the failed chips cut the healthy chips of {machine.describe()} into"
        assert report[0].startswith(cut_off)
        return
    assert assert_neighbour_permutes_only(module, machine) > 0
    tree = ReductionTree.of(machine)
    # The depth is the radius: no chip is farther from the root, and none has a smaller eccentricity.
    eccentricity = [max(machine.hops(a, b) for b in range(machine.num_devices)) for a in range(machine.num_devices)]
    assert tree.height == min(eccentricity) == eccentricity[tree.root]
    assert all(machine.hops(tree.root, d) == tree.depth[d] for d in range(machine.num_devices))
    simulate(TreeSchedule(tree, min(machine.num_devices, 20)))


# --- what is left alone ------------------------------------------------------------------------

def test_cut_off_chips_are_refused():
    text = SMALL_PROGRAM.substitute(n=14)
    options = "mesh=4x4,failed=0:1;1:0"  # chip 0:0 has no healthy neighbour left
    module, report = rewrite(text, options)
    assert module.to_text() == hlo_tools.parse_module(text).to_text()
    left_alone = ("%ar left alone: the failed chips cut the healthy chips of mesh:4x4 failed 0:1,1:0 into 2 parts "
                  "(13 and 1 chips): no route from 0:0 to 0:2")
    assert report == [left_alone, f"unchanged: {left_alone}"]
    with pytest.raises(PassError, match=r"^pass all-reduce-2d at %ar: the failed chips cut"):
        rewrite(text, options + ",strict=true")


@pytest.mark.parametrize("replicas, groups, reason", [
    (16, "{}", "the groups (1 of 16 devices) are not one group of the 15 healthy chips of mesh:4x4 failed 1:2"),
    (15, "{{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14}}",
     "the groups (2 of 8, 7 devices) are not one group of the 15 healthy chips of mesh:4x4 failed 1:2"),
    (16, "{{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14}}",
     "the module runs on 16 replicas, mesh:4x4 failed 1:2 has 15 healthy chips"),
])
def test_groups_that_are_not_the_healthy_chips_are_refused(replicas, groups, reason):
    text = SMALL_PROGRAM.substitute(n=replicas).replace("replica_groups={}", f"replica_groups={groups}")
    module, report = rewrite(text, "mesh=4x4,failed=1:2")
    assert module.to_text() == hlo_tools.parse_module(text).to_text()
    assert report == [f"%ar left alone: {reason}", f"unchanged: %ar left alone: {reason}"]
    with pytest.raises(PassError, match=f"^pass all-reduce-2d at %ar: {re.escape(reason)}$"):
        rewrite(text, "mesh=4x4,failed=1:2,strict=true")


def test_a_mesh_without_failed_chips_stays_the_logical_form():
    module, report = rewrite(SMALL_PROGRAM.substitute(n=16), "mesh=4x4")
    opcodes = collections.Counter(instr.opcode for instr in module.instructions())
    assert (opcodes["reduce-scatter"], opcodes["all-reduce"], opcodes["all-gather"]) == (1, 1, 1)
    assert opcodes["collective-permute"] == 0 and report == []
