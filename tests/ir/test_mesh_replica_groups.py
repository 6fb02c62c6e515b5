"""XLA's mesh-axes replica groups (`mesh['x'=2,'y'=4] {'x'}`), which Shardy-partitioned modules print.

The IR must read them as XLA does (checked by running the collective on 8 devices), print them
back unchanged, and let the JAX hook run passes on such modules.
"""

import jax
import numpy as np
import pytest

import hlo_tools
import real_programs
import xla_passes.jax
from hlo_tools.xla import runner
from hlo_tools.ir.attributes import ReplicaGroups

# XLA's own all-reduce combiner would merge the mesh-form all-reduces into one it prints as a list.
WITHOUT_XLA_COMBINER = {"xla_disable_hlo_passes": "all-reduce-combiner,cpu-all-reduce-combiner"}

# Each device all-gathers the partition ids of its group: the result is its group, in XLA's order.
GROUP_MEMBERS = """HloModule group_members, num_partitions=8

ENTRY main {
  pid = u32[] partition-id()
  own = u32[1] reshape(pid)
  group = u32[SIZE] all-gather(own), channel_id=1, replica_groups=GROUPS, dimensions={0}, use_global_device_ids=true
  ROOT r = u32[1,SIZE] reshape(group), sharding={devices=[8,1]<=[8]}
}
"""


@pytest.mark.parametrize("groups", [
    "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}",
    "mesh['a'=2,'b'=4] {'b'}",
    "mesh['a'=2,'b'=4] {'b','a'}",
    "mesh['a'=8] {'a':(1)2}",
    "mesh['a'=8] {'a':(2)2,'a':(1)2}",
    "mesh['a'=2,'b'=4] {'a','b':(2)2}",
])
def test_mesh_groups_mean_what_xla_runs(groups):
    parsed = ReplicaGroups.parse(groups).groups
    text = GROUP_MEMBERS.replace("GROUPS", groups).replace("SIZE", str(len(parsed[0])))
    module = hlo_tools.parse_module(text)
    assert module.to_text() == text
    hlo_tools.verify(module)
    expected = np.array([next(group for group in parsed if device in group) for device in range(8)], np.uint32)
    np.testing.assert_array_equal(runner.run_module(text).outputs[0], expected)


@pytest.mark.parametrize("bad", ["mesh['a'=2] {'b'}", "mesh['a'=8] {'a':(1)3}", "mesh[a=2] {a}"])
def test_bad_mesh_groups_are_parse_errors(bad):
    with pytest.raises(hlo_tools.HloParseError, match="mesh"):
        hlo_tools.parse_module(GROUP_MEMBERS.replace("GROUPS", bad).replace("SIZE", "2"))


def _named_sharding_step(passes: str | None):
    """The 2x4-mesh jit step's outputs, compiled without XLA's combiner, with `passes` run strictly in the hook."""
    fn, shapes = real_programs.jit_named_sharding_step()
    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.standard_normal(s.shape, np.float32), s.sharding) for s in shapes]
    lowered = fn.lower(*shapes)
    if passes is None:
        return lowered.compile(WITHOUT_XLA_COMBINER), args
    with xla_passes.jax.enable(passes, strict=True):
        return lowered.compile(WITHOUT_XLA_COMBINER), args


def test_hook_runs_passes_on_shardy_modules():
    plain, args = _named_sharding_step(None)
    assert "replica_groups=mesh[" in plain.as_text()
    fused, _ = _named_sharding_step("collective-fusion")
    assert fused.as_text().count(" all-reduce(") < plain.as_text().count(" all-reduce(")
    for got, want in zip(jax.tree.leaves(fused(*args)), jax.tree.leaves(plain(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
