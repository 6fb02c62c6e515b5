"""`parse_module(text, lazy_bodies=True)` (what the JAX plugin's hook uses): computations other
than the entry stay source text until read, print as that text while unread, parse on first
read to the same IR as an eager parse, and report their parse errors when read. Also the
O(degree) removal API and the control-successor index the combiners rely on."""
import pytest

import hlo_tools
from hlo_tools import HloParseError, HloVerifyError
from hlo_tools.xla import xla_bridge
from hlo_tools.ir.parser import parse_shape
from hlo_tools.ir.verifier import verify_edits
from xla_passes import Pipeline

from sample_modules import FUSIONS_AND_ALL_REDUCES as MODULE


def _comp(module, name):
    return next(c for c in module.computations if c.name == name)


def test_unread_bodies_stay_text_and_print_verbatim():
    module = hlo_tools.parse_module(MODULE, lazy_bodies=True)
    assert [c.parsed for c in module.computations] == [False, False, False, True]
    assert module.to_text() == MODULE
    fused = _comp(module, "fused_computation")
    assert "multiply" in fused.unparsed_text
    params, result = fused.unparsed_program_shape
    assert [p.to_text(False) for p in params] == ["f32[8]", "f32[8]"] and result.to_text(False) == "f32[8]"
    assert not fused.parsed and module.to_text() == MODULE  # asking about the text parses nothing


def test_a_body_parses_on_first_read_as_an_eager_parse_would():
    lazy = hlo_tools.parse_module(MODULE, lazy_bodies=True)
    eager = hlo_tools.parse_module(MODULE)
    fused = _comp(lazy, "fused_computation.1")
    assert fused.root.name == "add.2"  # the first read parses the body
    assert fused.parsed and fused.unparsed_text is None and fused.unparsed_program_shape is None
    assert [i.name for i in fused.instructions] == ["param_0.1", "constant.1", "broadcast.1", "add.2"]
    assert fused.root.operands[1].operands[0].literal.text == "2"
    assert lazy.to_text() == MODULE
    assert [i.name for i in lazy.instructions()] == [i.name for i in eager.instructions()]
    assert lazy.to_text(regenerate=True) == eager.to_text(regenerate=True)
    assert all(c.parsed for c in lazy.computations)


def test_edits_print_like_an_eager_module_and_new_names_avoid_unread_bodies():
    lazy = hlo_tools.parse_module(MODULE, lazy_bodies=True)
    eager = hlo_tools.parse_module(MODULE)
    for module in (lazy, eager):
        entry = module.entry
        negate = entry.add_instruction("negate", [entry.get("p0")], name="multiply.1", after=entry.get("p1"))
        entry.get("fusion").set_operand(0, negate)
    assert lazy.entry.get("multiply.2").opcode == "negate"  # multiply.1 is taken, in an unread body
    assert not _comp(lazy, "fused_computation").parsed
    assert lazy.to_text() == eager.to_text()
    assert xla_bridge.same_meaning(lazy.to_text(), MODULE.replace(
        "%p1 = f32[8]{0} parameter(1)\n", "%p1 = f32[8]{0} parameter(1)\n"
        "  %multiply.2 = f32[8]{0} negate(%p0)\n").replace("fusion(%p0, %p1)", "fusion(%multiply.2, %p1)"))


def test_collective_fusion_reads_no_fusion_body():
    lazy = hlo_tools.parse_module(MODULE, lazy_bodies=True)
    eager = hlo_tools.parse_module(MODULE)
    for module in (lazy, eager):
        assert Pipeline("collective-fusion").run(module)  # verify_edits included
    assert [c.name for c in lazy.computations if not c.parsed] == ["fused_computation", "fused_computation.1"]
    assert lazy.to_text() == eager.to_text()
    assert lazy.to_text().count("all-reduce(") == 1


def test_verify_edits_checks_fusion_operands_against_an_unread_body():
    module = hlo_tools.parse_module(MODULE, lazy_bodies=True)
    entry = module.entry
    wrong = entry.add_instruction("convert", [entry.get("p0")], parse_shape("s32[8]{0}"), after=entry.get("p1"))
    entry.get("fusion").set_operand(0, wrong)
    with pytest.raises(HloVerifyError, match="Shape mismatch between parameter number 0"):
        verify_edits(module)
    assert not _comp(module, "fused_computation").parsed


BROKEN = MODULE.replace("ROOT %multiply.1 = f32[8]{0} multiply(%param_0, %param_1)",
                        "ROOT %multiply.1 = f32[8]{0} multiply(%param_0, %param_9)")


def test_a_parse_error_in_an_unread_body_surfaces_when_it_is_read():
    with pytest.raises(HloParseError) as eager_error:
        hlo_tools.parse_module(BROKEN)
    module = hlo_tools.parse_module(BROKEN, lazy_bodies=True)
    fused = _comp(module, "fused_computation")
    for _ in range(2):  # it stays unparsed, so every read reports it
        with pytest.raises(HloParseError) as lazy_error:
            fused.instructions
        assert (lazy_error.value.line, lazy_error.value.column, str(lazy_error.value)) == \
            (eager_error.value.line, eager_error.value.column, str(eager_error.value))
    assert not fused.parsed and module.to_text() == BROKEN
    with pytest.raises(HloParseError, match="param_9"):
        list(module.instructions())


def test_removal_keeps_order_and_control_edges():
    module = hlo_tools.parse_module(MODULE)
    entry = module.entry
    p0, p1 = entry.get("p0"), entry.get("p1")
    a = entry.add_instruction("negate", [p0], name="a", after=p1)
    b = entry.add_instruction("abs", [p0], name="b", after=a, attrs={"control-predecessors": (a,)})
    c = entry.add_instruction("exponential", [p0], name="c", after=b)
    c.add_control_predecessor(b)
    assert a.control_successors == (b,) and b.control_successors == (c,)
    entry.remove_instruction(b)
    assert c.control_predecessors == () and a.control_successors == () and "%b = " not in module.to_text()
    names = [i.name for i in entry.instructions]
    assert names[:4] == ["p0", "p1", "a", "c"]
    c.attrs["control-predecessors"] = (a,)
    assert a.control_successors == (c,)
    d = entry.add_instruction("negate", [a], name="d", after=c)
    entry.remove_instructions([d, a, c])  # a is used by d, which goes too
    assert [i.name for i in entry.instructions] == [n for n in names if n not in ("a", "c")]
    assert p0.users == [entry.get("fusion")] and module.to_text() == MODULE
    with pytest.raises(ValueError, match="used by fusion"):
        entry.remove_instructions([p0])


ODD = """HloModule odd

%c (p: f32[]) -> f32[] {
  %p = f32[] parameter(0), frontend_attributes={
}
  ROOT %n = f32[] negate(%p)
}

%t {
  %q = f32[] parameter(0)
  ROOT %a = f32[] abs(%q)
}, execution_thread="host"

ENTRY %e (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %r = f32[] call(%x), to_apply=%c
}
"""


def test_headers_and_tails_off_the_common_form_stay_lazy():
    text = ODD.replace("frontend_attributes={\n}", "frontend_attributes={}")
    module = hlo_tools.parse_module(text, lazy_bodies=True)
    threaded = _comp(module, "t")
    assert not threaded.parsed and threaded.execution_thread == "host" and threaded.unparsed_program_shape is None
    assert module.to_text() == text
    assert threaded.root.opcode == "abs" and module.to_text() == text


def test_text_not_cut_where_xla_ends_bodies_is_parsed_eagerly():
    module = hlo_tools.parse_module(ODD, lazy_bodies=True)  # `}` starts a line inside %c's body
    assert all(c.parsed for c in module.computations) and module.to_text() == ODD
    with pytest.raises(HloParseError, match="not defined") as lazy:
        hlo_tools.parse_module(ODD.replace("negate(%p)", "negate(%z)"), lazy_bodies=True)
    with pytest.raises(HloParseError) as eager:
        hlo_tools.parse_module(ODD.replace("negate(%p)", "negate(%z)"))
    assert str(lazy.value) == str(eager.value)
