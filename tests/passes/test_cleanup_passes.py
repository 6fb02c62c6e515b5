"""dce, cse, tuple-simplifier and call-inliner on real JAX programs: same results through XLA."""

import pytest

import hlo_tools
import xla_passes
from hlo_tools.xla import xla_bridge
from pass_testing import run_and_compare

CLEANUP = "fixed-point(call-inliner,tuple-simplifier,cse,dce)"

PROGRAMS = ["shard_map_mlp", "pmap_psum", "jit_named_sharding_2x4", "flax_cnn_adam", "scan_while",
            "conditional"]


@pytest.mark.parametrize("program", PROGRAMS)
def test_cleanup_keeps_results_of_real_programs(program, jax_modules):
    text = jax_modules[f"jax.{program}.before"]
    module = run_and_compare(text, CLEANUP, expect_change=None)
    hlo_tools.verify(module)
    before = hlo_tools.parse_module(text)
    count = sum(len(c.instructions) for c in module.computations)
    assert count <= sum(len(c.instructions) for c in before.computations)


def test_cleanup_shrinks_the_flax_step(jax_modules):
    """JAX's flax step has nested calls and tuple plumbing that the cleanup removes."""
    text = jax_modules["jax.flax_cnn_adam.before"]
    module = run_and_compare(text, CLEANUP)
    before = hlo_tools.parse_module(text)
    calls = [i for i in module.instructions() if i.opcode == "call"]
    assert len(calls) < sum(1 for i in before.instructions() if i.opcode == "call")
    assert all(c.attrs["to_apply"].name.startswith("xla.sdy.") for c in calls)


def test_cleanup_of_the_per_device_modules_xla_hands_to_passes(pass_hook_modules):
    """XLA cannot compile these again (they already have layouts), so: verified and accepted by XLA."""
    for text in pass_hook_modules.values():
        module = hlo_tools.parse_module(text)
        xla_passes.run_passes(module, CLEANUP)
        hlo_tools.verify(module)
        xla_bridge.xla_parse(module.to_text())
