"""The editing API keeps use-def lists consistent, and printing after an edit keeps untouched
text verbatim while XLA reads the edited module with the intended meaning."""
import hypothesis
import pytest

import hlo_tools
from hlo_tools import Shape
from hlo_tools.xla import xla_bridge

SHORT = """HloModule step, entry_computation_layout={(f32[8]{0}, f32[8]{0})->f32[8]{0}}

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT sum = f32[] add(x, y)
}

ENTRY main {
  p0 = f32[8]{0} parameter(0)
  p1 = f32[8]{0} parameter(1)
  // the gradient
  mul = f32[8]{0} multiply(p0, p1)
  ar = f32[8]{0} all-reduce(mul), replica_groups={{0,1,2,3}}, to_apply=add
  ROOT out = f32[8]{0} add(ar, p0)
}
"""

LONG = """HloModule long, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %neg = f32[4]{0} negate(f32[4]{0} %p)
  ROOT %abs = f32[4]{0} abs(f32[4]{0} %neg)
}
"""


def test_use_lists_follow_edits():
    m = hlo_tools.parse_module(SHORT)
    entry = m.entry
    p0, mul, ar, out = (entry.get(n) for n in ("p0", "mul", "ar", "out"))
    assert p0.users == [mul, out] and ar.operands == (mul,)
    two = entry.add_instruction("constant", (), Shape.array("f32", ()), literal=hlo_tools.Literal.parse(
        Shape.array("f32", ()), "2"))
    bcast = entry.add_instruction("broadcast", [two], Shape.array("f32", (8,)), attrs={"dimensions": ()})
    scaled = entry.add_instruction("multiply", [mul, bcast], before=ar)  # shape inferred
    assert scaled.shape.dims == (8,) and scaled.shape.dtype == "f32"
    mul.replace_all_uses_with(scaled)
    assert ar.operands == (scaled,) and mul.users == [scaled]
    assert scaled.users == [ar]
    entry.sort_topologically()
    hlo_tools.verify(m)
    names = [i.name for i in entry.instructions]
    assert names.index("bcast" if "bcast" in names else bcast.name) < names.index(scaled.name)


def test_replace_all_uses_moves_the_root():
    m = hlo_tools.parse_module(SHORT)
    entry = m.entry
    out = entry.root
    neg = entry.add_instruction("negate", [out])
    out.replace_all_uses_with(neg)
    assert entry.root is neg and neg.operands == (out,)  # the new user keeps its operand
    hlo_tools.verify(m)


def test_remove_dead_code_and_refusals():
    m = hlo_tools.parse_module(SHORT)
    entry = m.entry
    dead = entry.add_instruction("negate", [entry.get("p1")])
    entry.add_instruction("abs", [dead])
    with pytest.raises(ValueError, match="used by"):
        entry.remove_instruction(dead)
    with pytest.raises(ValueError, match="root"):
        entry.remove_instruction(entry.root)
    assert entry.remove_dead_code()
    assert dead.parent is None and dead not in entry.get("p1").users
    assert not entry.remove_dead_code()
    hlo_tools.verify(m)


def test_unique_names_and_rename():
    m = hlo_tools.parse_module(SHORT)
    a = m.entry.add_instruction("negate", [m.entry.get("p0")], name="mul")
    assert a.name == "mul.1"
    m.entry.get("p0").rename("input")
    text = m.to_text()
    assert "input = f32[8]{0} parameter(0)" in text and "multiply(input, p1)" in text
    assert xla_bridge.same_meaning(text, text)  # XLA accepts the renamed module


def test_print_after_edit_keeps_untouched_text():
    m = hlo_tools.parse_module(SHORT)
    entry = m.entry
    ar = entry.get("ar")
    ar.attrs["replica_groups"] = hlo_tools.ReplicaGroups.of([[0, 1], [2, 3]])
    text = m.to_text()
    original_lines = SHORT.splitlines()
    printed_lines = text.splitlines()
    changed = [(a, b) for a, b in zip(original_lines, printed_lines) if a != b]
    assert changed == [(
        "  ar = f32[8]{0} all-reduce(mul), replica_groups={{0,1,2,3}}, to_apply=add",
        "  ar = f32[8]{0} all-reduce(mul), replica_groups={{0,1},{2,3}}, to_apply=add")]
    assert "// the gradient" in text
    expected = SHORT.replace("{{0,1,2,3}}", "{{0,1},{2,3}}")
    assert xla_bridge.same_meaning(text, expected)


def test_new_instruction_follows_long_style():
    m = hlo_tools.parse_module(LONG)
    entry = m.entry
    neg = entry.get("neg")
    exp = entry.add_instruction("exponential", [neg], after=neg)
    entry.root.set_operand(0, exp)
    text = m.to_text()
    assert "  %exponential = f32[4]{0} exponential(f32[4]{0} %neg)\n" in text
    assert "ROOT %abs = f32[4]{0} abs(f32[4]{0} %exponential)" in text
    assert "  %neg = f32[4]{0} negate(f32[4]{0} %p)\n" in text  # untouched line, verbatim
    assert xla_bridge.same_meaning(text, LONG.replace(
        "ROOT %abs = f32[4]{0} abs(f32[4]{0} %neg)",
        "%e = f32[4]{0} exponential(f32[4]{0} %neg)\n  ROOT %abs = f32[4]{0} abs(f32[4]{0} %e)"))


def test_parameter_edits_regenerate_signature_and_layout():
    m = hlo_tools.parse_module(LONG)
    entry = m.entry
    q = entry.add_parameter(Shape.array("f32", (4,), layout=(0,)), name="q")
    entry.root.set_operand(0, entry.add_instruction("add", [entry.get("neg"), q], before=entry.root))
    text = m.to_text()
    assert "ENTRY %main (p: f32[4], q: f32[4]) -> f32[4] {" in text
    assert "entry_computation_layout={(f32[4]{0}, f32[4]{0})->f32[4]{0}}" in text
    hlo_tools.verify(hlo_tools.parse_module(text))
    xla_bridge.canonical_text(text)  # XLA accepts it


def test_removing_a_parameter_numbers_the_later_ones_again():
    """Parsed text is printed verbatim until edited: the later parameter's number must be redone."""
    m = hlo_tools.parse_module(SHORT)
    entry = m.entry
    entry.root.set_operand(1, entry.get("ar"))   # p0 is read by mul only
    entry.get("mul").set_operand(0, entry.get("p1"))
    entry.remove_parameter(entry.get("p0"))
    text = m.to_text()
    assert "p1 = f32[8]{0} parameter(0)" in text
    assert "entry_computation_layout={(f32[8]{0})->f32[8]{0}}" in text
    hlo_tools.verify(hlo_tools.parse_module(text))
    xla_bridge.canonical_text(text)  # XLA accepts it


def test_clone_computation_is_deep_and_independent():
    m = hlo_tools.parse_module(SHORT)
    add = m.computation("add")
    clone = m.clone_computation(add, suffix="copy")
    assert clone.name == "add.copy" and clone is not add
    assert [i.opcode for i in clone.instructions] == [i.opcode for i in add.instructions]
    assert not set(map(id, clone.instructions)) & set(map(id, add.instructions))
    assert all(op.parent is clone for i in clone.instructions for op in i.operands)
    m.entry.get("ar").attrs["to_apply"] = clone
    assert m.remove_dead_computations()
    assert [c.name for c in m.computations] == ["add.copy", "main"]
    text = m.to_text()
    hlo_tools.verify(hlo_tools.parse_module(text))
    assert xla_bridge.same_meaning(text, SHORT.replace("add {", "add.copy {").replace("=add", "=add.copy"))


def test_post_orders():
    m = hlo_tools.parse_module(SHORT)
    order = m.entry.post_order()
    for i, instr in enumerate(order):
        assert all(order.index(op) < i for op in instr.operands)
    assert [c.name for c in m.computations_post_order()] == ["add", "main"]
    assert m.callers()[m.computation("add")] == [m.entry.get("ar")]


def test_edit_state_accessors():
    """What the printer, the verifier and proto_patch read about edits, through public accessors."""
    from hlo_tools.ir.printer import instruction_line
    m = hlo_tools.parse_module(SHORT)
    entry, add = m.entry, m.computation("add")
    assert m.source_text == SHORT and not m.computations_edited and not m.header_edited
    start, end = entry.source_span
    assert SHORT[start:end].startswith("ENTRY main {") and SHORT[slice(*entry.head_source_span)] == "ENTRY main {"
    mul, out = entry.get("mul"), entry.get("out")
    assert SHORT[slice(*mul.source_span)] == "mul = f32[8]{0} multiply(p0, p1)"
    assert instruction_line(out) == "ROOT out = f32[8]{0} add(ar, p0)"
    assert not entry.edited and not mul.edited_operands_only and not mul.shape_was_set

    mul.set_operand(1, entry.get("p0"))
    assert mul.source_span is None and mul.edited_operands_only and entry.edited and not add.edited
    assert instruction_line(mul) == "mul = f32[8]{0} multiply(p0, p0)"  # in the module's short style
    mul.set_shape(mul.shape)
    assert mul.shape_was_set
    m.set_attr("replica_count", 4)
    assert m.header_edited
    built = hlo_tools.HloModule("built")
    assert built.source_text is None


def test_attribute_readers_take_typed_values_and_raw_text():
    from hlo_tools.ir.attributes import AttrValueError, Raw, attr_bool, attr_int, attr_ints
    from hlo_tools.ir.shape_inference import ShapeInferenceError, infer_shape
    attrs = {"channel_id": Raw("3"), "dimensions": Raw("{0,1}"), "constrain_layout": Raw("true"), "n": 2}
    assert (attr_int(attrs, "channel_id"), attr_ints(attrs, "dimensions"), attr_bool(attrs, "constrain_layout")) == (
        3, (0, 1), True)
    assert attr_int(attrs, "n") == 2 and attr_int(attrs, "missing", 7) == 7 and not attr_bool(attrs, "missing")
    with pytest.raises(AttrValueError, match="attribute iota_dimension must be an integer"):
        attr_int({"iota_dimension": Raw("x")}, "iota_dimension")
    # Shape inference still reports a bad value as ShapeInferenceError.
    with pytest.raises(ShapeInferenceError, match="attribute dimensions must be an integer list"):
        infer_shape("reverse", [Shape.array("f32", (2,))], {"dimensions": Raw("{x}")})



def test_unique_names_take_the_lowest_free_suffix_again_after_a_removal():
    """Names come as XLA's do, the lowest free suffix first, without probing the taken ones each time."""
    m = hlo_tools.parse_module(SHORT)
    entry, p0 = m.entry, m.entry.get("p0")
    added = [entry.add_instruction("negate", [p0], name="neg") for _ in range(4)]
    assert [i.name for i in added] == ["neg", "neg.1", "neg.2", "neg.3"]
    entry.remove_instruction(added[2])
    assert entry.add_instruction("negate", [p0], name="neg.1").name == "neg.2"
    assert entry.add_instruction("negate", [p0], name="neg").name == "neg.4"
    saved = m.checkpoint()
    entry.add_instruction("negate", [p0], name="neg")
    saved.restore()
    assert entry.add_instruction("negate", [p0], name="neg").name == "neg.5"


CALLS = """HloModule calls

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

body {
  p = f32[8] parameter(0)
  ROOT n = f32[8] negate(p)
}

ENTRY main {
  p0 = f32[8] parameter(0)
  ar = f32[8] all-reduce(p0), replica_groups={}, to_apply=add
  c = f32[8] call(ar), to_apply=body
  ROOT r = f32[] reduce(c, f32[] constant(0)), dimensions={0}, to_apply=add
}
"""


def _scanned_callers(module) -> dict:
    found = {}
    for instr in module.instructions():
        for callee in instr.called_computations:
            found.setdefault(callee.name, set()).add(instr.name)
    return found


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(hypothesis.strategies.lists(
    hypothesis.strategies.tuples(hypothesis.strategies.sampled_from(
        ["retarget", "add_call", "remove_call", "clone", "drop_dead", "checkpoint", "restore"]),
        hypothesis.strategies.integers(0, 7)), max_size=12))
def test_the_callers_index_follows_every_edit(edits):
    """`callers_of` answers from an index that edits keep current: after any sequence of edits it
    names exactly the instructions that call each computation, as a scan of the module does, and
    the verifier (which compares the two) accepts the module."""
    m = hlo_tools.parse_module(CALLS)
    entry = m.entry
    saved = None
    assert {c.name: {i.name for i in calls} for c, calls in m.callers().items() if calls} == _scanned_callers(m)
    for edit, pick in edits:
        reducers = [c for c in m.computations if c.num_parameters == 2]
        callers = [i for i in entry.instructions if i.opcode in ("all-reduce", "reduce") and not i.users]
        if edit == "retarget":
            users = [i for i in entry.instructions if "to_apply" in i.attrs and i.opcode != "call"]
            users[pick % len(users)].attrs["to_apply"] = reducers[pick % len(reducers)]
        elif edit == "add_call":
            entry.add_instruction("all-reduce", [entry.get("p0")], attrs={
                "to_apply": reducers[pick % len(reducers)], "replica_groups": hlo_tools.ReplicaGroups.of([])})
        elif edit == "remove_call" and callers and callers[pick % len(callers)] is not entry.root:
            entry.remove_instruction(callers[pick % len(callers)])
        elif edit == "clone":
            m.clone_computation(reducers[pick % len(reducers)], suffix=f"copy{pick}")
        elif edit == "drop_dead":
            m.remove_dead_computations()
        elif edit == "checkpoint":
            saved = m.checkpoint()
        elif edit == "restore" and saved is not None:
            saved.restore()
        for comp in m.computations:
            assert {i.name for i in m.callers_of(comp)} == _scanned_callers(m).get(comp.name, set()), (edit, comp.name)
        hlo_tools.verify(m)
