"""XLA's compact get-tuple-elements: jaxlib 0.12's dumps (`xla_dump_compact_gte`) print no
get-tuple-element lines; a user names element i of tuple %t as `%t#i` (`%t#1#0` nested).

XLA's parser makes one get-tuple-element, named `t_i` (made unique), per tuple and index in a
computation, just before its first user (found with jaxlib 0.12's XLA; 0.10.2's cannot read `#`).
The IR does the same, prints untouched text back byte for byte, and prints the compact form for
those get-tuple-elements while nothing else names them.
"""

import pytest

import hlo_tools
from hlo_tools import Metadata
from hlo_tools.xla import xla_bridge

COMPACT = """HloModule gtes

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%body (s: (s32[], (f32[4], f32[]))) -> (s32[], (f32[4], f32[])) {
  %s = (s32[], (f32[4]{0}, f32[])) parameter(0)
  %one = s32[] constant(1)
  %i = s32[] add(%s#0, %one)
  %x = f32[4]{0} negate(%s#1#0)
  %pair = (f32[4]{0}, f32[]) tuple(%x, %s#1#1)
  ROOT %next = (s32[], (f32[4]{0}, f32[])) tuple(%i, %pair)
}

%cond (c: (s32[], (f32[4], f32[]))) -> pred[] {
  %c = (s32[], (f32[4]{0}, f32[])) parameter(0)
  %ten = s32[] constant(10)
  ROOT %lt = pred[] compare(%c#0, %ten), direction=LT
}

ENTRY %main (p: f32[4], q: f32[]) -> (f32[4], f32[], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %q = f32[] parameter(1)
  %ar = (f32[4]{0}, f32[]) all-reduce(%p, %q), replica_groups={}, to_apply=%add
  %n = f32[4]{0} negate(%ar#0)
  %m = f32[4]{0} multiply(%ar#0, %n)
  %ar_0 = f32[] negate(%ar#1)
  %zero = s32[] constant(0)
  %init = (s32[], (f32[4]{0}, f32[])) tuple(%zero, %ar)
  %w = (s32[], (f32[4]{0}, f32[])) while(%init), condition=%cond, body=%body
  ROOT %t = (f32[4]{0}, f32[], f32[4]{0}) tuple(%m, %ar_0, %w#1#0)
}
"""

# The same module with the get-tuple-elements written out, named as the IR names them: the text names
# a later instruction `ar_0`, so `%ar#0` is `ar_0.1` (XLA renames that instruction instead: the IR
# keeps the names the text gives).
EXPANDED = """HloModule gtes

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%body (s: (s32[], (f32[4], f32[]))) -> (s32[], (f32[4], f32[])) {
  %s = (s32[], (f32[4]{0}, f32[])) parameter(0)
  %one = s32[] constant(1)
  %s_0 = s32[] get-tuple-element(%s), index=0
  %i = s32[] add(%s_0, %one)
  %s_1 = (f32[4]{0}, f32[]) get-tuple-element(%s), index=1
  %s_1_0 = f32[4]{0} get-tuple-element(%s_1), index=0
  %x = f32[4]{0} negate(%s_1_0)
  %s_1_1 = f32[] get-tuple-element(%s_1), index=1
  %pair = (f32[4]{0}, f32[]) tuple(%x, %s_1_1)
  ROOT %next = (s32[], (f32[4]{0}, f32[])) tuple(%i, %pair)
}

%cond (c: (s32[], (f32[4], f32[]))) -> pred[] {
  %c = (s32[], (f32[4]{0}, f32[])) parameter(0)
  %ten = s32[] constant(10)
  %c_0 = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%c_0, %ten), direction=LT
}

ENTRY %main (p: f32[4], q: f32[]) -> (f32[4], f32[], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %q = f32[] parameter(1)
  %ar = (f32[4]{0}, f32[]) all-reduce(%p, %q), replica_groups={}, to_apply=%add
  %ar_0.1 = f32[4]{0} get-tuple-element(%ar), index=0
  %n = f32[4]{0} negate(%ar_0.1)
  %m = f32[4]{0} multiply(%ar_0.1, %n)
  %ar_1 = f32[] get-tuple-element(%ar), index=1
  %ar_0 = f32[] negate(%ar_1)
  %zero = s32[] constant(0)
  %init = (s32[], (f32[4]{0}, f32[])) tuple(%zero, %ar)
  %w = (s32[], (f32[4]{0}, f32[])) while(%init), condition=%cond, body=%body
  %w_1 = (f32[4]{0}, f32[]) get-tuple-element(%w), index=1
  %w_1_0 = f32[4]{0} get-tuple-element(%w_1), index=0
  ROOT %t = (f32[4]{0}, f32[], f32[4]{0}) tuple(%m, %ar_0, %w_1_0)
}
"""


def structure(module):
    """Every computation's instructions in order: name, opcode, shape, operands, attributes."""
    return {comp.name: [(i.name, i.opcode, str(i.shape), [o.name for o in i.operands],
                         {k: str(getattr(v, "name", v)) for k, v in i.attrs.items()}) for i in comp.instructions]
            for comp in module.computations}


@pytest.mark.parametrize("lazy", [False, True])
def test_compact_operands_are_the_get_tuple_elements_xla_makes_of_them(lazy):
    module = hlo_tools.parse_module(COMPACT, lazy_bodies=lazy)
    assert module.to_text() == COMPACT
    assert structure(module) == structure(hlo_tools.parse_module(EXPANDED))
    hlo_tools.verify(module)
    n, m = module.find("n"), module.find("m")
    assert n.operand(0) is m.operand(0) and n.operand(0).users == [n, m]  # one per tuple and index
    assert module.find("lt").operand(0).line == 21
    assert module.to_text(regenerate=True) == COMPACT  # printed as XLA prints it


def test_xla_reads_them_as_the_get_tuple_elements_written_out():
    """Each gets an attribute, so that it prints on its own line (and XLA, 0.10.2's too, reads it)."""
    module = hlo_tools.parse_module(COMPACT)
    for gte in [i for i in module.instructions() if i.opcode == "get-tuple-element"]:  # all from `#`
        gte.attrs["metadata"] = Metadata([("op_name", "gte")])
    text = module.to_text()
    assert "#" not in text and '%ar_0.1 = f32[4]{0} get-tuple-element(%ar), index=0, metadata={op_name="gte"}' in text
    assert xla_bridge.same_meaning(text, EXPANDED)


def test_edits_print_the_compact_form_as_long_as_nothing_else_names_them():
    module = hlo_tools.parse_module(COMPACT)
    module.find("ar").rename("sum")
    text = module.to_text()
    assert "  %n = f32[4]{0} negate(%sum#0)\n  %m = f32[4]{0} multiply(%sum#0, %n)\n" in text
    assert "  %ar_0 = f32[] negate(%sum#1)\n" in text
    assert text.replace("%sum", "%ar") == COMPACT  # nothing else changed

    main = module.entry
    swapped = main.add_instruction("tuple", [main.get("p"), main.get("q")], after=main.get("q"))
    gte = main.get("ar_0.1")
    gte.set_operand(0, swapped)
    assert "  %n = f32[4]{0} negate(%tuple#0)\n  %m = f32[4]{0} multiply(%tuple#0, %n)\n" in module.to_text()

    main.set_root(gte)
    main.remove_dead_code()
    hlo_tools.verify(module)
    assert module.to_text().endswith("\n  ROOT %ar_0.1 = f32[4]{0} get-tuple-element(%tuple), index=0\n}\n")


def test_a_compact_one_another_instruction_waits_for_prints_on_its_own_line():
    module = hlo_tools.parse_module(COMPACT)
    module.find("ar_0").add_control_predecessor(module.find("ar_1"))
    text = module.to_text()
    assert "  %ar_1 = f32[] get-tuple-element(%ar), index=1\n" in text
    assert "  %ar_0 = f32[] negate(%ar_1), control-predecessors={%ar_1}\n" in text
    assert "%ar#0" in text  # the others stay compact
    hlo_tools.verify(hlo_tools.parse_module(text))


@pytest.mark.parametrize("operand, says", [
    ("%ar#2", "GTE index 2 out of bounds for shape: (f32[4]{0}, f32[])"),
    ("%ar#0#0", "GTE operand must be tuple, but has shape: f32[4]{0}"),
    ("%ar#", "expects integer"),
])
def test_bad_compact_operands_are_parse_errors(operand, says):
    with pytest.raises(hlo_tools.HloParseError) as error:
        hlo_tools.parse_module(COMPACT.replace("negate(%ar#0)", f"negate({operand})"))
    assert (error.value.line, error.value.message) == (28, says)


def test_an_operand_list_with_index_comments_reads_them_too():
    """XLA marks every fifth operand `/*index=5*/`, also in its dumps' short form."""
    text = """HloModule long

ENTRY %main (p: (f32[], s32[])) -> (f32[], f32[], f32[], f32[], f32[], s32[]) {
  %p = (f32[], s32[]) parameter(0)
  ROOT %t = (f32[], f32[], f32[], f32[], f32[], s32[]) tuple(%p#0, %p#0, %p#0, %p#0, %p#0, /*index=5*/%p#1)
}
"""
    module = hlo_tools.parse_module(text)
    assert module.to_text() == text
    assert [o.name for o in module.entry.root.operands] == ["p_0"] * 5 + ["p_1"]
    hlo_tools.verify(module)
