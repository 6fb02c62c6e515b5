"""`hlo_tools.xla.proto_patch`: the JAX plugin's hook hands XLA its own module proto with only the
entry's edits applied. The patched proto must mean what printing the whole module means (XLA's
canonical print of both, computation by computation) and compute what the original computed
(differential execution on 2 CPU devices); edits outside the entry fall back to printing."""
import hlo_tools
from hlo_tools.xla import runner, xla_bridge
from hlo_tools.xla.proto_patch import patched_module_proto
import xla_passes.jax
from xla_passes import Pipeline
from xla_passes.frontends.configuration import Settings

from sample_modules import FUSIONS_AND_ALL_REDUCES as MODULE


def _rewritten(proto: bytes, passes: str = "collective-fusion"):
    module = hlo_tools.parse_module(xla_bridge.proto_to_text(proto), lazy_bodies=True)
    assert Pipeline(passes).run(module)
    return module


def _computations(proto: bytes) -> list[str]:
    """XLA's canonical print of each computation (their order in a proto is not part of the meaning)."""
    return sorted(xla_bridge.proto_to_text(proto, canonical=True).split("\n\n"))


def test_a_patched_proto_means_and_computes_what_the_printed_module_does():
    proto = xla_bridge.text_to_proto(MODULE)
    module = _rewritten(proto)
    assert {c.name for c in module.computations if not c.parsed} == {"fused_computation", "fused_computation.1"}
    patched = patched_module_proto(proto, module, xla_bridge.text_to_proto)
    assert patched is not None
    assert _computations(patched) == _computations(xla_bridge.text_to_proto(module.to_text()))
    text = xla_bridge.proto_to_text(patched)
    assert text.count("all-reduce(") == 1 and 'metadata={op_name="mul"}' in text
    _, _, comparison = runner.compare_modules(text, MODULE, None, num_replicas=2, reference_num_replicas=2,
                                              abs_error_bound=0.0, rel_error_bound=0.0)
    assert comparison.ok, comparison.format()


def test_the_plugin_hook_hands_back_the_patched_proto():
    proto = xla_bridge.text_to_proto(MODULE)
    expected = patched_module_proto(proto, _rewritten(proto), xla_bridge.text_to_proto)
    assert xla_passes.jax.rewrite_module(proto, Settings("collective-fusion")) == expected


def test_edits_beyond_operands_are_reparsed():
    proto = xla_bridge.text_to_proto(MODULE)
    module = _rewritten(proto)
    module.entry.get("fusion.1").attrs["metadata"] = hlo_tools.Metadata([("op_name", "renamed")])
    patched = patched_module_proto(proto, module, xla_bridge.text_to_proto)
    assert 'op_name="renamed"' in xla_bridge.proto_to_text(patched)
    assert _computations(patched) == _computations(xla_bridge.text_to_proto(module.to_text()))


def test_edits_outside_the_entry_or_of_a_scheduled_module_print_the_whole_module():
    proto = xla_bridge.text_to_proto(MODULE)
    module = hlo_tools.parse_module(xla_bridge.proto_to_text(proto), lazy_bodies=True)
    fused = next(c for c in module.computations if c.name == "fused_computation")
    fused.root.attrs["metadata"] = hlo_tools.Metadata([("op_name", "inside")])
    assert patched_module_proto(proto, module, xla_bridge.text_to_proto) is None
    module = _rewritten(proto)
    module.clone_computation(module.computations[0])  # a new computation
    assert patched_module_proto(proto, module, xla_bridge.text_to_proto) is None
    scheduled = xla_bridge.text_to_proto(MODULE.replace("HloModule step,", "HloModule step, is_scheduled=true,"))
    assert patched_module_proto(scheduled, _rewritten(scheduled), xla_bridge.text_to_proto) is None
