"""all-reduce-rings: its rings over disjoint links, and the same results through XLA on 8 and 16 devices.

all_reduce_rings.hlo pins the rewritten text. Here: every ring the pass builds is a cycle of
physical neighbours through all devices and no two share a directed link; the permutes of a
rewritten module use exactly such rings; and the rewritten modules run next to the originals,
bit-exact on the default small-integer inputs (every partial sum is exact, so the ring's order
of additions cannot show; integers are exact anyway) and within 1e-5 absolute or relative
error (f32 reassociation) on random normal inputs. 16-device runs go to a child process
(`isolate=True`), which starts its own 16 CPU devices.
"""

import re
import string
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import hlo_tools
import xla_passes
import xla_passes.jax
from hlo_tools.xla import runner
from hlo_tools.inspection.topology import Topology
from pass_testing import (PER_DEVICE_PROGRAM_ALL_REDUCES, REDUCERS, REPLICA_PROGRAM_ALL_REDUCES, normal_inputs,
                          per_device_input_shapes, per_device_program, reducer, replica_input_shapes, replica_program,
                          run_and_compare, shard_map_step_outputs)
from xla_passes.passes.all_reduce_rings import directed_links, disjoint_rings

# (topology, the most rings over disjoint links it gives) for the constructions in the pass.
MOST_RINGS = [("ring:2", 1), ("ring:3", 2), ("ring:8", 2), ("torus:2x2", 2), ("torus:2x4", 2), ("torus:3x3", 4),
              ("torus:4x4", 4), ("torus:4x8", 4), ("torus:6x4", 4), ("torus:3x4", 2), ("mesh:1x2", 1),
              ("mesh:2x2", 2), ("mesh:2x3", 2), ("mesh:3x4", 2), ("mesh:4x4", 2)]
F32_BOUND = 1e-5  # f32 sums of 8 or 16 normal values added in another order: a few ulps


def rewrite_and_compare(text: str, passes: str, devices: int, *, replicas: bool, inputs=None,
                        exact: bool = True) -> hlo_tools.HloModule:
    """Run `passes` on `text` (it must change it), run both modules on `devices` CPU devices (in
    a child process above the 8 this process has) and assert the same outputs."""
    counts = {"num_replicas": devices} if replicas else {"num_partitions": devices}
    return run_and_compare(text, passes, **counts, inputs=inputs, exact=exact, abs_error_bound=F32_BOUND,
                           rel_error_bound=F32_BOUND, isolate=devices > 8)


def assert_permutes_ride_the_rings(module: hlo_tools.HloModule, topology_spec: str, rings: int, all_reduces: int):
    """Every collective-permute goes one hop along one of `rings` rings: cycles through all the
    topology's devices, each pair physical neighbours, no directed link in two rings; each ring
    carries 2(N-1) permutes per rewritten all-reduce."""
    topology = Topology.parse(topology_spec)
    devices = topology.num_devices
    uses = Counter(i.attrs["source_target_pairs"] for i in module.instructions() if i.opcode == "collective-permute")
    assert len(uses) == rings
    links = set()
    for pairs, count in uses.items():
        assert count == 2 * (devices - 1) * all_reduces
        assert all(topology.are_neighbours(a, b) for a, b in pairs), pairs
        successor = dict(pairs)
        assert len(successor) == devices and sorted(successor.values()) == list(range(devices))
        cycle = [0]
        while successor[cycle[-1]] != 0:
            cycle.append(successor[cycle[-1]])
        assert len(cycle) == devices, f"{pairs} is not one cycle through all devices"
        assert not links & set(pairs), f"{pairs} shares a link with another ring"
        links |= set(pairs)


# --- the rings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,most", MOST_RINGS)
def test_rings_are_neighbour_cycles_over_disjoint_links(spec, most):
    topology = Topology.parse(spec)
    rings = disjoint_rings(topology, most)
    used = set()
    for ring in rings:
        assert sorted(ring) == list(range(topology.num_devices))
        links = directed_links(ring)
        assert all(topology.are_neighbours(a, b) for a, b in links)
        assert not links & used
        used |= links
    with pytest.raises(ValueError, match=f"{spec} gives {most} rings? over disjoint links, not rings={most + 1}"):
        disjoint_rings(topology, most + 1)


def test_four_rings_of_a_torus_use_every_directed_link_once():
    topology = Topology.parse("torus:4x4")
    used = [link for ring in disjoint_rings(topology, 4) for link in directed_links(ring)]
    assert len(used) == len(set(used)) == 2 * len(topology.links) == 64


@pytest.mark.parametrize("passes,message", [
    ("all-reduce-rings{rings=3,topology=mesh:4x4}",
     "mesh:4x4 gives 2 rings over disjoint links, not rings=3 (every ring leaves each chip by a link of its own, "
     "and a chip has 2)"),
    ("all-reduce-rings{rings=4,topology=torus:2x4}", "torus:2x4 gives 2 rings over disjoint links, not rings=4"),
    ("all-reduce-rings{rings=2,topology=ring:2}", "ring:2 gives 1 ring over disjoint links, not rings=2"),
    ("all-reduce-rings{rings=1,topology=mesh:3x3}",
     "mesh:3x3 gives 0 rings over disjoint links, not rings=1 (a mesh with an odd number of chips has no "
     "Hamiltonian cycle)"),
    ("all-reduce-rings{rings=1,topology=ring:1}", "ring:1 has one chip"),
    ("all-reduce-rings{rings=0,topology=ring:8}", "rings must be at least 1"),
    ("all-reduce-rings{rings=2}", "topology is required"),
    ("all-reduce-rings{topology=cube:2x2x2}", "topology 'cube:2x2x2' is not ring:N, torus:RxC or mesh:RxC"),
])
def test_impossible_rings_fail_when_the_pass_is_built(passes, message):
    with pytest.raises(xla_passes.PassError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        xla_passes.parse_pipeline(passes)
    assert info.value.pass_name == "all-reduce-rings"


# --- same results through XLA --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "s32", "bf16"])
@pytest.mark.parametrize("topology,rings", [("ring:8", 1), ("ring:8", 2), ("torus:2x4", 2), ("mesh:2x4", 2)])
def test_replica_program_on_8_devices(topology, rings, dtype):
    passes = f"all-reduce-rings{{rings={rings},topology={topology}}}"
    module = rewrite_and_compare(replica_program(dtype, 8), passes, 8, replicas=True)
    assert not any(i.opcode == "all-reduce" for i in module.instructions())
    assert_permutes_ride_the_rings(module, topology, rings, REPLICA_PROGRAM_ALL_REDUCES)
    assert all("channel_id" not in i.attrs for i in module.instructions() if i.opcode == "collective-permute")


@pytest.mark.parametrize("dtype", ["f32", "s32"])
@pytest.mark.parametrize("topology,rings", [("ring:8", 2), ("torus:2x4", 1)])
def test_per_device_program_on_8_devices(topology, rings, dtype):
    passes = f"all-reduce-rings{{rings={rings},topology={topology}}}"
    module = rewrite_and_compare(per_device_program(dtype, 8), passes, 8, replicas=False)
    assert_permutes_ride_the_rings(module, topology, rings, PER_DEVICE_PROGRAM_ALL_REDUCES)
    channels = [i.attrs["channel_id"] for i in module.instructions() if i.opcode == "collective-permute"]
    assert sorted(channels) == list(range(3, 3 + len(channels)))  # fresh, above the module's 1 and 2


@pytest.mark.parametrize("use_global_device_ids", [", use_global_device_ids=true", ""])
def test_replica_program_with_a_channel(use_global_device_ids):
    """With one partition the global device ids of a channel all-reduce are replica ids: the
    permutes go without a channel_id, over replica-id."""
    text = f"""HloModule channel_sums, replica_count=8, num_partitions=1
{string.Template(REDUCERS).substitute(t="f32")}
ENTRY main {{
  p = f32[5,3] parameter(0)
  ROOT ar = f32[5,3] all-reduce(p), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}{use_global_device_ids}, to_apply=add
}}
"""
    module = rewrite_and_compare(text, "all-reduce-rings{rings=2,topology=torus:2x4}", 8, replicas=True)
    assert_permutes_ride_the_rings(module, "torus:2x4", 2, 1)
    permutes = [i for i in module.instructions() if i.opcode == "collective-permute"]
    assert all("channel_id" not in i.attrs for i in permutes)
    assert any(i.opcode == "replica-id" for i in module.instructions())


@pytest.mark.parametrize("topology", ["ring:8", "torus:2x4"])
def test_float_inputs_within_reassociation(topology):
    passes = f"all-reduce-rings{{rings=2,topology={topology}}}"
    rewrite_and_compare(replica_program("f32", 8), passes, 8, replicas=True,
                        inputs=normal_inputs(replica_input_shapes(8)), exact=False)
    rewrite_and_compare(per_device_program("f32", 8), passes, 8, replicas=False,
                        inputs=normal_inputs(per_device_input_shapes(8)), exact=False)


@pytest.mark.parametrize("dtype", ["f32", "s32"])
@pytest.mark.parametrize("topology,rings", [("torus:4x4", 2), ("torus:4x4", 4), ("mesh:4x4", 2)])
def test_16_devices(topology, rings, dtype):
    passes = f"all-reduce-rings{{rings={rings},topology={topology}}}"
    module = rewrite_and_compare(replica_program(dtype, 16), passes, 16, replicas=True)
    assert_permutes_ride_the_rings(module, topology, rings, REPLICA_PROGRAM_ALL_REDUCES)
    module = rewrite_and_compare(per_device_program(dtype, 16), passes, 16, replicas=False)
    assert_permutes_ride_the_rings(module, topology, rings, PER_DEVICE_PROGRAM_ALL_REDUCES)


def test_16_devices_float_inputs():
    passes = "all-reduce-rings{rings=4,topology=torus:4x4}"
    rewrite_and_compare(per_device_program("f32", 16), passes, 16, replicas=False,
                        inputs=normal_inputs(per_device_input_shapes(16)), exact=False)


# Topologies of up to 8 devices with every ring count they give.
SMALL_TOPOLOGIES = [(spec, rings) for spec, most in MOST_RINGS if Topology.parse(spec).num_devices <= 8
                    for rings in range(1, most + 1)]


@settings(max_examples=20, deadline=None)
@given(topology=st.sampled_from(SMALL_TOPOLOGIES), dtype=st.sampled_from(["f32", "s32", "bf16"]),
       reducer=st.sampled_from(["add", "max"]),
       shapes=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3), min_size=1, max_size=3))
def test_any_sizes_and_rings_give_the_same_sums(topology, dtype, reducer, shapes):
    """All-reduces of any shapes (scalars, sizes that divide by k*N or need padding) on any
    topology and ring count up to 8 devices: the same results, bit for bit."""
    spec, rings = topology
    devices = Topology.parse(spec).num_devices
    lines, names = [], []
    for index, dims in enumerate(shapes):
        shape = f"{dtype}[{','.join(map(str, dims))}]"
        lines.append(f"  p{index} = {shape} parameter({index})")
        lines.append(f"  r{index} = {shape} all-reduce(p{index}), replica_groups={{}}, to_apply={reducer}")
        names.append(f"r{index}")
    root_shape = ", ".join(f"{dtype}[{','.join(map(str, dims))}]" for dims in shapes)
    text = (string.Template(f"HloModule sums, replica_count={devices}\n" + REDUCERS).substitute(t=dtype)
            + "\nENTRY main {\n" + "\n".join(lines)
            + f"\n  ROOT out = ({root_shape}) tuple({', '.join(names)})\n}}\n")
    module = rewrite_and_compare(text, f"all-reduce-rings{{rings={rings},topology={spec}}}", devices, replicas=True)
    assert_permutes_ride_the_rings(module, spec, rings, len(shapes))


# --- what is left alone ---------------------------------------------------------------------------------

HEADER = "HloModule m$header\n" + reducer("add", "f32", "add") + reducer("sub", "f32", "subtract") + """
ENTRY main {
  p = f32[16] parameter(0)
  ROOT ar = f32[16] all-reduce(p), $attrs
}
"""


@pytest.mark.parametrize("header,attrs,reason", [
    (", replica_count=8", "replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add",
     "the groups (2 of 4, 4 devices) are not one group of the 8 devices of ring:8"),
    (", replica_count=8", "replica_groups={}, to_apply=sub", "the reducer is not one elementwise add"),
    ("", "replica_groups={}, to_apply=add", "the participants are not known"),
    (", replica_count=2, num_partitions=8",
     "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add",
     "a collective-permute pairs replicas or partitions, and the module has 2 replicas of 8 partitions"),
    (", num_partitions=16",
     "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add",
     "the module runs on 16 partitions, ring:8 has 8 devices"),
])
def test_what_does_not_fit_stays_or_is_a_strict_error(header, attrs, reason):
    text = string.Template(HEADER).substitute(header=header, attrs=attrs)
    module = hlo_tools.parse_module(text)
    assert not xla_passes.run_passes(module, "all-reduce-rings{rings=2,topology=ring:8}")
    assert module.to_text() == text
    with pytest.raises(xla_passes.PassError, match=re.escape(reason)) as info:
        xla_passes.run_passes(module, "all-reduce-rings{rings=2,topology=ring:8,strict=true}")
    assert (info.value.pass_name, info.value.instruction) == ("all-reduce-rings", "ar")
    assert module.to_text() == text


@pytest.mark.parametrize("opcode, reason", [("add", "a sum of pred"), ("multiply", "a product of pred"),
                                             ("maximum", None)])
def test_sums_and_products_of_pred_stay(opcode, reason):
    """XLA's backends disagree on a sum of pred (`or` on some, `xor` on others): the rings, like
    the tree of all-reduce-2d (one shared check, `xla_passes.analysis.topology_fit`), leave it."""
    text = f"""HloModule m, replica_count=8
{reducer("r", "pred", opcode)}
ENTRY main {{
  p = pred[16] parameter(0)
  ROOT ar = pred[16] all-reduce(p), replica_groups={{}}, to_apply=r
}}
"""
    module = hlo_tools.parse_module(text)
    assert xla_passes.run_passes(module, "all-reduce-rings{rings=2,topology=ring:8}") == (reason is None)
    if reason is not None:
        with pytest.raises(xla_passes.PassError, match=re.escape(f"{reason} (XLA backends disagree on what it is)")):
            xla_passes.run_passes(module, "all-reduce-rings{rings=2,topology=ring:8,strict=true}")


def test_min_bytes():
    text = string.Template(HEADER).substitute(header=", replica_count=8", attrs="replica_groups={}, to_apply=add")
    module = hlo_tools.parse_module(text)
    assert not xla_passes.run_passes(module, "all-reduce-rings{topology=ring:8,min_bytes=65,strict=true}")
    assert xla_passes.run_passes(module, "all-reduce-rings{topology=ring:8,min_bytes=64}")


# --- real JAX programs ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["jax.shard_map_mlp.before", "jax.pmap_psum.before", "jax.flax_cnn_adam.before"])
def test_jax_lowerings(jax_modules, name):
    """JAX's HLO before XLA's optimizations: psums in a Shardy shard_map body (partition ids) and
    in a pmap program (replica ids), rewritten and run against the original."""
    text = jax_modules[name]
    module = hlo_tools.parse_module(text)
    assert xla_passes.run_passes(module, "all-reduce-rings{rings=2,topology=torus:2x4}")
    assert not any(i.opcode == "all-reduce" for i in module.instructions())
    _, _, comparison = runner.compare_modules(module.to_text(), text, abs_error_bound=F32_BOUND,
                                              rel_error_bound=F32_BOUND)
    assert comparison.ok, comparison.format()


def test_shard_map_gradients_inside_xla(tmp_path):
    """The data-parallel shard_map MLP step (psum of gradients over 8 devices) compiled by XLA
    with the pass at its hook: the per-device module's all-reduces run as two rings of permutes."""
    reference = shard_map_step_outputs()
    with xla_passes.jax.enable("all-reduce-rings{rings=2,topology=torus:2x4}", strict=True, dump_to=str(tmp_path),
                               platforms="cpu"):
        outputs = shard_map_step_outputs()
    rewritten = [hlo_tools.parse_module(p.read_text()) for p in tmp_path.glob("*.after_all-reduce-rings.txt")]
    assert rewritten and all(not any(i.opcode == "all-reduce" for i in m.instructions()) for m in rewritten)
    assert any(any(i.opcode == "collective-permute" for i in m.instructions()) for m in rewritten)
    for out, ref in zip(outputs, reference, strict=True):
        np.testing.assert_allclose(out, ref, rtol=F32_BOUND, atol=F32_BOUND)
