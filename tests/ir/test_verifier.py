"""hlo_tools.verify: each rule of XLA's parser and HloVerifier, on a valid module and a broken one.

Every broken module must raise HloVerifyError naming the offending instruction and its line; every
valid module of XLA's own tests must pass, every invalid one must be refused, and so must real JAX
programs before and after XLA's optimizations.
"""
import glob
import os
import re

import pytest

import hlo_tools
from hlo_tools import HloParseError, HloVerifyError
from hlo_tools.ir.verifier import verify_edits, verify_module
from support import CORPUS_DIR, needs_corpus, read_exact


def verify(text: str):
    module = hlo_tools.parse_module(text)
    hlo_tools.verify(module)
    return module


def line_of(text: str, name: str) -> int:
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*(ROOT\s+)?%?{re.escape(name)}\s*=", line):
            return number
    raise AssertionError(f"{name} not in text")


def refused(text: str, instruction: str | None, match: str):
    """Parse `text`, expect verify to refuse it at `instruction` (on its source line)."""
    module = hlo_tools.parse_module(text)
    with pytest.raises(HloVerifyError, match=match) as info:
        hlo_tools.verify(module)
    if instruction is not None:
        assert info.value.instruction == instruction
        assert info.value.line == line_of(text, instruction)
    return info.value


def pair(valid: str, broken: str, instruction: str | None, match: str):
    verify(valid)
    return refused(broken, instruction, match)


def entry(body: str, head: str = "HloModule m", computations: str = "") -> str:
    return f"{head}\n{computations}\nENTRY e {{\n{body}\n}}\n"


ADD = """
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
"""


# -- structure ----------------------------------------------------------------------------------------
def test_operand_from_another_computation():
    text = entry("  a = f32[4] parameter(0)\n  ROOT n = f32[4] negate(a)", computations="""
other {
  p = f32[4] parameter(0)
  ROOT c = f32[4] copy(p)
}
""")
    module = verify(text)
    foreign = module.computation("other").get("p")
    module.entry.root.set_operand(0, foreign)
    with pytest.raises(HloVerifyError, match="different computation") as info:
        hlo_tools.verify(module)
    assert info.value.instruction == "n"


def test_duplicate_instruction_names():
    module = verify(entry("  a = f32[4] parameter(0)\n  b = f32[4] negate(a)\n  ROOT c = f32[4] abs(b)"))
    module.entry.get("b").name = "a"
    with pytest.raises(HloVerifyError, match="already exists") as info:
        hlo_tools.verify(module)
    assert info.value.instruction == "a" and info.value.line == 5


def test_operands_defined_before_use():
    module = verify(entry("  a = f32[4] parameter(0)\n  ROOT n = f32[4] negate(a)"))
    comp = module.entry
    late = comp.add_instruction("abs", [comp.parameter(0)])
    comp.root.set_operand(0, late)          # the root now uses an instruction placed after it
    with pytest.raises(HloVerifyError, match="defined after"):
        hlo_tools.verify(module)
    comp.sort_topologically()
    hlo_tools.verify(module)


def test_parameters_numbered_without_gaps():
    valid = entry("  a = f32[4] parameter(0)\n  b = f32[4] parameter(1)\n  ROOT c = f32[4] add(a, b)")
    broken = valid.replace("parameter(1)", "parameter(2)")
    verify(valid)
    with pytest.raises(HloVerifyError, match="no parameter 1") as info:
        verify(broken)
    assert info.value.line == 3 and info.value.instruction is None  # the computation's line


def test_computation_called_before_it_is_defined():
    callee = "\nneg {\n  p = f32[2] parameter(0)\n  ROOT n = f32[2] negate(p)\n}\n"
    body = "  a = f32[2] parameter(0)\n  ROOT c = f32[2] call(a), to_apply=neg"
    valid = entry(body, computations=callee)
    broken = f"HloModule m\nENTRY e {{\n{body}\n}}\n{callee}"
    pair(valid, broken, "c", "computation does not exist: neg")


def test_control_predecessors_defined_earlier():
    valid = entry("  a = f32[2] parameter(0)\n  b = f32[2] abs(a)\n  ROOT c = f32[2] negate(a), "
                  "control-predecessors={b}")
    broken = entry("  a = f32[2] parameter(0)\n  b = f32[2] negate(a), control-predecessors={c}\n"
                   "  ROOT c = f32[2] abs(a)")
    pair(valid, broken, "b", "instruction 'c' is not defined")


def test_control_predecessor_in_another_computation():
    module = verify(entry("  a = f32[2] parameter(0)\n  ROOT c = f32[2] negate(a)", computations="""
other {
  p = f32[2] parameter(0)
  ROOT q = f32[2] copy(p)
}
"""))
    module.entry.root.add_control_predecessor(module.computation("other").root)
    with pytest.raises(HloVerifyError, match="not in computation e") as info:
        hlo_tools.verify(module)
    assert info.value.instruction == "c"


# -- what XLA's parser refuses ------------------------------------------------------------------------------
def test_operand_count():
    valid = entry("  x = f32[] parameter(0)\n  ROOT eq = pred[] compare(x, x), direction=EQ")
    pair(valid, valid.replace("compare(x, x)", "compare(x)"), "eq", "expects 2 operands, but has 1")
    pair(valid, valid.replace("compare(x, x)", "compare(x, x, x)"), "eq", "expects 2 operands")


def test_unexpected_attribute():
    comps = "\nneg {\n  p = f32[2] parameter(0)\n  ROOT n = f32[2] negate(p)\n}\n"
    send = entry("  t = token[] after-all()\n  a = f32[2] parameter(0)\n"
                 "  s = (f32[2], u32[], token[]) send(a, t), channel_id=1\n"
                 "  ROOT d = token[] send-done(s), channel_id=1", computations=comps)
    pair(send, send.replace("send(a, t), channel_id=1", "send(a, t), channel_id=1, calls=neg"), "s",
         'unexpected attribute "calls"')
    valid = entry("  a = f32[2] parameter(0)\n  ROOT e = f32[2] exponential(a), result_accuracy={mode=highest}")
    pair(valid, valid.replace("exponential(a)", "add(a, a)"), "e", 'unexpected attribute "result_accuracy"')
    pair(valid, valid.replace("mode=highest", "mode=high"), "e", "Unknown accuracy mode")
    pair(valid, valid.replace("mode=highest", "foo=1"), "e", "invalid attribute name: foo")


def test_required_attribute():
    valid = entry("  a = f32[2,3] parameter(0)\n  ROOT t = f32[3,2] transpose(a), dimensions={1,0}")
    pair(valid, valid.replace(", dimensions={1,0}", ""), "t", "attribute dimensions is expected")


@needs_corpus
def test_broadcast_of_non_scalar_needs_dimensions():
    valid = entry("  ROOT r = f32[10,10] sqrt(f32[10,10] broadcast(f32[] parameter(0)))")
    verify(valid)
    broken = read_exact(CORPUS_DIR / "parser_invalid" / "NestedBroadcastWithoutDimensionsAttribute.hlo")
    err = refused(broken, None, "attribute dimensions is expected")
    assert err.instruction.startswith("broadcast") and err.line == 4


def test_enumerations():
    valid = entry("  a = f32[2] parameter(0)\n  ROOT c = pred[2] compare(a, a), direction=LT")
    pair(valid, valid.replace("LT", "LESS"), "c", "expects direction")
    cc = entry("  a = f32[2] parameter(0)\n  ROOT cc = f32[2] custom-call(a), custom_call_target=\"foo\", "
               "api_version=API_VERSION_STATUS_RETURNING")
    pair(cc, cc.replace("API_VERSION_STATUS_RETURNING", "API_VERSION_UNSPECIFIED"), "cc", "Invalid API version")
    pair(cc, cc.replace("API_VERSION_STATUS_RETURNING", "API_VERSION_NONE"), "cc", "Unknown API version")


def test_conditional_branch_index():
    comps = """
b0 {
  p = f32[4] parameter(0)
  ROOT c = f32[4] ceil(p)
}
b1 {
  p = f32[4] parameter(0)
  ROOT f = f32[4] floor(p)
}
"""
    valid = entry("  p0 = f32[4] parameter(0)\n  i = s32[] parameter(1)\n"
                  "  ROOT cond = f32[4] conditional(i, p0, p0), branch_computations={b0, b1}", computations=comps)
    pair(valid, valid.replace("s32[] parameter(1)", "s32[2] parameter(1)"), "cond", "must be a scalar")
    pair(valid, valid.replace("s32[] parameter(1)", "f32[] parameter(1)"), "cond", "scalar of PRED or S32")
    refused(valid.replace("s32[] parameter(1)", "pred[] parameter(1)"), "cond",
            'unexpected attribute "branch_computations"')
    predicated = valid.replace("s32[] parameter(1)", "pred[] parameter(1)").replace(
        "branch_computations={b0, b1}", "true_computation=b0, false_computation=b1")
    verify(predicated)
    refused(valid.replace("(i, p0, p0)", "(i, p0)"), "cond", "expects 3 operands")


def test_infeed_needs_a_tuple_shape():
    valid = entry("  t = token[] after-all()\n  ROOT infeed = (pred[], token[]) infeed(t)")
    pair(valid, valid.replace("(pred[], token[]) infeed", "pred[] infeed"), "infeed", "non-empty tuple shape")


def test_custom_call_layout_constraints():
    valid = entry("  p0 = f32[2,3]{0,1} parameter(0)\n  p1 = f32[4]{0} parameter(1)\n"
                  "  ROOT cc = f32[1]{0} custom-call(p0, p1), custom_call_target=\"baz\", "
                  "operand_layout_constraints={f32[2,3]{1,0}, f32[4]{0}}")
    pair(valid, valid.replace(", f32[4]{0}}", "}"), "cc", "Expected 2 operand layout constraints, 1 given")
    pair(valid, valid.replace("{f32[2,3]{1,0}", "{f32[3,3]{1,0}"), "cc", "not compatible with operand shape")


def test_dynamic_slice_operand_count():
    valid = entry("  a = f32[8,4] parameter(0)\n  i = s32[] parameter(1)\n"
                  "  ROOT ds = f32[2,4] dynamic-slice(a, i, i), dynamic_slice_sizes={2,4}")
    pair(valid, valid.replace("(a, i, i)", "(a, i)"), "ds", "Wrong number of operands")


def test_parameter_replication_count():
    valid = entry("  ROOT p = (f32[2], s32[]) parameter(0), parameter_replication={true,false}")
    pair(valid, valid.replace("{true,false}", "{true}"), "p", "2 leaf buffers")


@pytest.mark.parametrize("shape, match", [
    ("f32[99999999999999999999999]", r"dimension 0 of shape f32\[99999999999999999999999\] is .* more than int64"),
    ("f32[9223372036854775807,9223372036854775807]", r"takes 340282366920938463389587631136930004996 bytes"),
    ("(f32[2], f32[2305843009213693952])", r"takes 9223372036854775808 bytes, more than int64"),
], ids=["dimension", "product", "tuple leaf"])
def test_shapes_beyond_int64_are_refused(shape, match):
    pair(entry("  ROOT p = f32[2305843009213693951] parameter(0)"),  # 2^63 - 4 bytes: still fits
         entry(f"  ROOT p = {shape} parameter(0)"), "p", match)


# -- async ops -------------------------------------------------------------------------------------------------
ASYNC_COMP = """
wrapped {
  p = f32[10] parameter(0)
  ROOT cc = f32[20] custom-call(p), custom_call_target="foo"
}
"""
ASYNC = entry("""  p0 = f32[10] parameter(0)
  start = ((f32[10]), f32[20], s32[]) async-start(p0), calls=wrapped
  update = ((f32[10]), f32[20], s32[]) async-update(start)
  ROOT done = f32[20] async-done(update)""", computations=ASYNC_COMP)
SUGAR = entry("""  p0 = f32[10] parameter(0)
  start = ((f32[10]), f32[20], s32[]) custom-call-start(p0), custom_call_target="foo"
  update = ((f32[10]), f32[20], s32[]) custom-call-update(start)
  ROOT done = f32[20] custom-call-done(update)""")


def test_async_start_shape_form():
    verify(ASYNC)
    refused(ASYNC.replace("start = ((f32[10]), f32[20], s32[])", "start = (f32[10], f32[20], s32[])"), "start",
            r"AsyncStart expects the op shape")
    refused(ASYNC.replace("update = ((f32[10]), f32[20], s32[])", "update = (f32[10], f32[20], s32[])"), "update",
            "AsyncUpdate expects the op shape")


def test_async_done_needs_an_async_operand():
    broken = entry("""  p0 = f32[10] parameter(0)
  t = ((f32[10]), f32[20], s32[]) parameter(1)
  ROOT done = f32[20] custom-call-done(t)""")
    pair(SUGAR, broken, "done", "expect a single async op")


def test_async_shorthand_wraps_the_same_opcode():
    verify(SUGAR)
    refused(SUGAR.replace("custom-call-done", "add-done"), "done", "wrapped opcode to be custom-call, but got add")


def test_async_chain_computation_and_thread():
    refused(ASYNC.replace("async-done(update)", "async-done(update), calls=other").replace(
        "ENTRY", "other {\n  q = f32[10] parameter(0)\n  ROOT r = f32[20] custom-call(q), custom_call_target=\"x\"\n}\n"
                 "ENTRY"), "done", "async_wrapped_computation to be wrapped, but got other")
    refused(SUGAR.replace("custom-call-update(start)", 'custom-call-update(start), async_execution_thread="t"'),
            "update", "async_execution_thread to be main, but got t")


def test_async_computation_called_once():
    broken = entry("""  p0 = f32[10] parameter(0)
  s0 = ((f32[10]), f32[20], s32[]) async-start(p0), calls=wrapped
  d0 = f32[20] async-done(s0)
  s1 = ((f32[10]), f32[20], s32[]) async-start(p0), calls=wrapped
  ROOT d1 = f32[20] async-done(s1)""", computations=ASYNC_COMP)
    refused(broken, "s1", "called by more than one async op")


def test_async_shapes_match_wrapped_computation():
    broken = ASYNC.replace("f32[20], s32[])", "f32[21], s32[])").replace("done = f32[20]", "done = f32[21]")
    refused(broken, "start", r"index \{1\} to match the async computation root shape")


# -- shapes --------------------------------------------------------------------------------------------------
def test_shape_against_inference():
    valid = entry("  a = f32[2,3] parameter(0)\n  b = f32[3,4] parameter(1)\n"
                  "  ROOT d = f32[2,4] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    pair(valid, valid.replace("f32[2,4] dot", "f32[2,5] dot"), "d", "Expected instruction to have shape equal to")
    pair(valid, valid.replace("rhs_contracting_dims={0}", "rhs_contracting_dims={1}"), "d",
         "Contracting dimension sizes do not match")
    s = entry("  a = f32[6,8] parameter(0)\n  ROOT s = f32[2,8] slice(a), slice={[1:5:2], [0:8]}")
    pair(s, s.replace("[1:5:2]", "[1:5]"), "s", r"shape equal to f32\[4,8\]")


def test_implicit_broadcast_is_refused():
    valid = entry("  a = f32[3] parameter(0)\n  b = f32[3] parameter(1)\n  ROOT s = f32[3] add(a, b)")
    pair(valid, valid.replace("b = f32[3]", "b = f32[]"), "s", "implicit broadcast")
    # ... but select and clamp may take scalars where XLA allows them.
    verify(entry("  p = pred[] parameter(0)\n  a = f32[3] parameter(1)\n  lo = f32[] parameter(2)\n"
                 "  c = f32[3] clamp(lo, a, lo)\n  ROOT s = f32[3] select(p, a, c)"))


def test_compare_type():
    valid = entry("  a = f32[3] parameter(0)\n  ROOT c = pred[3] compare(a, a), direction=LT, type=TOTALORDER")
    pair(valid, valid.replace("TOTALORDER", "SIGNED"), "c", "Expected comparison type FLOAT or TOTALORDER")


def test_broadcast_dimensions():
    valid = entry("  a = f32[3] parameter(0)\n  ROOT b = f32[2,3] broadcast(a), dimensions={1}")
    pair(valid, valid.replace("dimensions={1}", "dimensions={0}"), "b", "broadcast dimension 0")
    pair(valid, valid.replace("f32[2,3] broadcast", "s32[2,3] broadcast"), "b", "element type")


def test_reshape_element_count():
    valid = entry("  a = f32[2,3] parameter(0)\n  ROOT r = f32[6] reshape(a)")
    pair(valid, valid.replace("f32[6] reshape", "f32[7] reshape"), "r", "mismatched element counts")


def test_mixed_precision():
    valid = entry("  a = f32[3] parameter(0)\n  b = f32[3] parameter(1)\n  ROOT s = f32[3] add(a, b)")
    pair(valid, valid.replace("b = f32[3]", "b = bf16[3]"), "s", "mixed precision is disallowed")


def test_tuple_and_get_tuple_element():
    valid = entry("  a = f32[3] parameter(0)\n  t = (f32[3], f32[3]) tuple(a, a)\n"
                  "  ROOT g = f32[3] get-tuple-element(t), index=1")
    pair(valid, valid.replace("index=1", "index=2"), "g", "out of tuple bounds")
    pair(valid, valid.replace("(f32[3], f32[3]) tuple", "(f32[3], f32[4]) tuple"), "t", "shape equal to")


# -- called computations -------------------------------------------------------------------------------------
def test_reduce_computation():
    valid = entry("  a = f32[4,5] parameter(0)\n  z = f32[] constant(0)\n"
                  "  ROOT r = f32[5] reduce(a, z), dimensions={0}, to_apply=add", computations=ADD)
    pair(valid, valid.replace("y = f32[] parameter(1)", "y = f32[] parameter(1)\n  w = f32[] parameter(2)"), "r",
         "Reduction function must take 2 parameters")
    pair(valid, valid.replace("z = f32[] constant(0)", "z = s32[] constant(0)"), "r", "init_value shape")


def test_all_reduce_computation():
    valid = entry("  a = f32[4] parameter(0)\n  ROOT ar = f32[4] all-reduce(a), to_apply=add", computations=ADD)
    vec_add = ADD.replace("f32[]", "f32[2]")
    pair(valid, valid.replace(ADD, vec_add), "ar", "must take two scalars")


LOOP = """
cond {
  p = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(10)
  ROOT lt = pred[] compare(i, n), direction=LT
}
body {
  p = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  v = f32[4] get-tuple-element(p), index=1
  ROOT t = (s32[], f32[4]) tuple(i, v)
}
"""


def test_while_signatures():
    body = "  a = (s32[], f32[4]) parameter(0)\n  ROOT w = (s32[], f32[4]) while(a), condition=cond, body=body"
    valid = entry(body, computations=LOOP)
    pair(valid, entry(body, computations=LOOP.replace("ROOT lt = pred[] compare(i, n), direction=LT",
                                                      "ROOT lt = s32[] add(i, n)")), "w",
         "scalar predicate")
    pair(valid, entry(body.replace("a = (s32[], f32[4])", "a = (s32[], f32[5])"), computations=LOOP), "w",
         "does not match parameter")


def test_conditional_signatures():
    comps = """
t {
  p = f32[2] parameter(0)
  ROOT n = f32[2] negate(p)
}
f {
  p = f32[3] parameter(0)
  ROOT s = f32[2] slice(p), slice={[0:2]}
}
"""
    body = ("  p = pred[] parameter(0)\n  a = f32[2] parameter(1)\n  b = f32[3] parameter(2)\n"
            "  ROOT c = f32[2] conditional(p, a, b), true_computation=t, false_computation=f")
    valid = entry(body, computations=comps)
    pair(valid, entry(body.replace("(p, a, b)", "(p, a, a)"), computations=comps), "c", "does not match parameter")
    pair(valid, entry(body, computations=comps.replace("ROOT n = f32[2] negate(p)",
                                                       "ROOT n = f32[2,1] reshape(p)")), "c", "shape equal to")


def test_call_signature():
    comps = "\nneg {\n  p = f32[2] parameter(0)\n  ROOT n = f32[2] negate(p)\n}\n"
    valid = entry("  a = f32[2] parameter(0)\n  ROOT c = f32[2] call(a), to_apply=neg", computations=comps)
    pair(valid, valid.replace("call(a)", "call(a, a)"), "c", "to have 2 parameters, has 1")


FUSED = """
fused {
  p0 = f32[4] parameter(0)
  p1 = f32[4] parameter(1)
  ROOT m = f32[4] multiply(p0, p1)
}
"""


def test_fusion_invariants():
    body = "  a = f32[4] parameter(0)\n  ROOT f = f32[4] fusion(a, a), kind=kLoop, calls=fused"
    valid = entry(body, computations=FUSED)
    pair(valid, valid.replace("fusion(a, a)", "fusion(a)"), "f", "greater than the number of operands")
    pair(valid, entry(body, computations=FUSED.replace("ROOT m", "dead = f32[4] negate(p0)\n  ROOT m")), "f",
         "must have users")
    twice = entry("  a = f32[4] parameter(0)\n  f = f32[4] fusion(a, a), kind=kLoop, calls=fused\n"
                  "  ROOT g = f32[4] fusion(f, a), kind=kLoop, calls=fused", computations=FUSED)
    refused(twice, "f", "exactly one fusion")


# -- collectives -----------------------------------------------------------------------------------------------
def test_replica_groups():
    head = "HloModule m, replica_count=4"
    valid = entry("  a = f32[4] parameter(0)\n  ROOT ag = f32[8] all-gather(a), replica_groups={{0,1},{2,3}}, "
                  "dimensions={0}", head=head)
    pair(valid, valid.replace("{{0,1},{2,3}}", "{{0,1},{1,3}}"), "ag", "Replica 1 is repeated")
    pair(valid, valid.replace("{{0,1},{2,3}}", "{{0,1},{2,4}}"), "ag", "Replica 3 is not named")
    pair(valid, valid.replace("{{0,1},{2,3}}", "{{0,1,2},{3}}"), "ag", "uniform size|shard_count")
    pair(valid, valid.replace("replica_count=4", "replica_count=8"), "ag", "should contain 8 replicas")
    pair(valid, valid.replace("f32[8] all-gather", "f32[12] all-gather"), "ag", "shard_count = 3, subgroup_size = 2")
    iota = valid.replace("{{0,1},{2,3}}", "[2,2]<=[4]")
    verify(iota)


def test_reduce_scatter_shard_count():
    valid = entry("  a = f32[8] parameter(0)\n  ROOT rs = f32[2] reduce-scatter(a), replica_groups={{0,1,2,3}}, "
                  "dimensions={0}, to_apply=add", head="HloModule m, replica_count=4", computations=ADD)
    pair(valid, valid.replace("f32[2] reduce-scatter", "f32[4] reduce-scatter"), "rs", "shard_count = 2")


def test_collective_group_modes():
    valid = entry("  a = f32[4] parameter(0)\n  ROOT ar = f32[4] all-reduce(a), channel_id=1, "
                  "replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add",
                  head="HloModule m, replica_count=2, num_partitions=2", computations=ADD)
    pair(valid, valid.replace("channel_id=1, ", ""), "ar", "Invalid combination")
    pair(valid, valid.replace("channel_id=1", "channel_id=0"), "ar", "channel id must be greater than 0")
    pair(valid, valid.replace("{{0,1,2,3}}", "{{0,1}}"), "ar", "should contain 4 flattened IDs")


def test_source_target_pairs():
    valid = entry("  a = f32[4] parameter(0)\n  ROOT cp = f32[4] collective-permute(a), "
                  "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", head="HloModule m, replica_count=4")
    pair(valid, valid.replace("{2,3},{3,0}", "{2,3},{2,0}"), "cp", "Source 2 appears more than once")
    pair(valid, valid.replace("{2,3},{3,0}", "{2,3},{3,1}"), "cp", "Target 1 appears more than once")
    pair(valid, valid.replace("{3,0}", "{3,4}"), "cp", "must be < 4")


def test_asynchronous_pairs():
    valid = entry("  a = f32[4] parameter(0)\n  cs = (f32[4], f32[4], u32[]) copy-start(a)\n"
                  "  ROOT cd = f32[4] copy-done(cs)")
    pair(valid, valid.replace("ROOT cd = f32[4] copy-done(cs)", "ROOT t = ((f32[4], f32[4], u32[])) tuple(cs)"),
         "cs", "requires one consumer|needs to be one of")


def test_send_recv_pairs():
    valid = entry("""  t = token[] after-all()
  a = f32[4] parameter(0)
  s = (f32[4], u32[], token[]) send(a, t), channel_id=1
  ROOT sd = token[] send-done(s), channel_id=1""")
    pair(valid, valid.replace("send-done(s), channel_id=1", "send-done(s), channel_id=2"), "sd",
         "does not match the channel_id")


# -- module level ----------------------------------------------------------------------------------------------
def test_entry_computation_layout():
    body = "  a = f32[2,3] parameter(0)\n  ROOT n = f32[2,3] negate(a)"
    valid = entry(body, head="HloModule m, entry_computation_layout={(f32[2,3]{1,0})->f32[2,3]{0,1}}")
    pair(valid, valid.replace("->f32[2,3]", "->f32[3,2]"), "n", "entry computation layout")
    pair(valid, valid.replace("{(f32[2,3]{1,0})", "{(f32[2,4]{1,0})"), "a", "entry computation parameter 0")
    broken = valid.replace("{(f32[2,3]{1,0})", "{(f32[2,3]{1,0}, f32[])")
    with pytest.raises(HloVerifyError, match="Number of parameters"):
        verify(broken)


def test_input_output_alias_and_buffer_donor():
    body = "  a = f32[2] parameter(0)\n  b = s32[] parameter(1)\n  ROOT t = (f32[2], s32[]) tuple(a, b)"
    valid = entry(body, head="HloModule m, input_output_alias={ {0}: (0, {}, may-alias) }, "
                             "buffer_donor={ (1, {}) }")
    verify(valid)
    for broken, match in [("{0}: (2, {}", "names parameter 2"), ("{2}: (0, {}", "invalid index"),
                          ("{1}: (0, {}", "differ in size"), ("(1, {})", None), ("(3, {})", "buffer_donor")]:
        if match is None:
            text = valid.replace("{0}: (0, {}", "{1}: (1, {}")  # parameter 1 both aliased and donated
            match = "both a buffer donor and aliased"
        else:
            text = valid.replace("{0}: (0, {}", broken) if "{" in broken[:3] else valid.replace("(1, {})", broken)
        with pytest.raises(HloVerifyError, match=match):
            verify(text)


def test_sharding_rank():
    valid = entry("  ROOT a = f32[8,4] parameter(0), sharding={devices=[2,1]<=[2]}",
                  head="HloModule m, num_partitions=2")
    pair(valid, valid.replace("devices=[2,1]<=[2]", "devices=[2]<=[2]"), "a", "different than the input rank")
    pair(valid, valid.replace("num_partitions=2", "num_partitions=2").replace("devices=[2,1]<=[2]",
                                                                              "devices=[2,1]0,2"),
         "a", r"must be in \[0, 2\)")


def test_errors_come_from_hlo_tools_only():
    with pytest.raises(HloParseError):
        verify("HloModule m\nENTRY e {\n  ROOT a = f32[2] bogus(b)\n}\n")


# -- the parser's one-regex path builds what its general path builds ----------------------------------------
FAST_PATH_LINES = """HloModule fast, replica_count=2

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY main {
  %p = f32[4]{0} parameter(0)
  zero = f32[] constant(0)
  one = s32[] constant(1)
  ints = s32[3]{0} constant({1, -2, 3})
  big = f32[] constant(-inf), metadata={op_name="c" source_line=3}
  %twice = f32[4]{0} add(%p, %p), metadata={op_name="jit(f)/add"}
  b = f32[4]{0} broadcast(zero), dimensions={}
  ar = f32[4]{0} all-reduce(twice), replica_groups={{0,1}}, to_apply=add, backend_config={"a":{"b":[1]}}
  ROOT t = (f32[4]{0}, f32[4]{0}, s32[3]{0}, f32[], s32[]) tuple(ar, b, ints, big, one)
}
"""


def _instructions(module):
    return [(i.name, i.opcode, str(i.shape), [o.name for o in i.operands], [u.name for u in i.users],
             {k: str(v) for k, v in i.attrs.items()}, str(i.literal) if i.literal is not None else None, i.line)
            for i in module.instructions()]


def test_the_fast_and_the_general_parse_paths_agree():
    # A trailing comment sends every instruction line down the general path.
    general = re.sub(r"^(  .*\))(.*)$", r"\1\2 /*general*/", FAST_PATH_LINES, flags=re.M)
    assert general.count("/*general*/") == 12
    fast_module, general_module = hlo_tools.parse_module(FAST_PATH_LINES), hlo_tools.parse_module(general)
    assert _instructions(fast_module) == _instructions(general_module)
    assert fast_module.find("twice").users == [fast_module.find("ar")]  # used twice, listed once
    assert fast_module.to_text() == FAST_PATH_LINES
    for good, bad in [("constant(1)", "constant(1.5)"), ("constant({1, -2, 3})", "constant({1, 2})")]:
        errors = []
        for text in (FAST_PATH_LINES, general):
            with pytest.raises(HloParseError) as info:
                hlo_tools.parse_module(text.replace(good, bad, 1))
            errors.append((info.value.line, info.value.column, info.value.message))
        assert errors[0] == errors[1]


# -- verify_edits: the pipeline's check of what passes edited ------------------------------------------------
def both_refuse(module, instruction: str, match: str):
    """verify_module and verify_edits refuse the edited `module` at `instruction` with the same message."""
    with pytest.raises(HloVerifyError, match=match) as full:
        verify_module(module)
    with pytest.raises(HloVerifyError, match=match) as edits:
        verify_edits(module)
    assert (edits.value.instruction, edits.value.message) == (full.value.instruction, full.value.message)
    assert full.value.instruction == instruction


def test_verify_edits_checks_users_of_an_edited_instruction():
    module = hlo_tools.parse_module(entry("  a = f32[4] parameter(0)\n  n = f32[4] negate(a)\n"
                                          "  ROOT t = (f32[4]) tuple(n)"))
    module.entry.get("a").set_shape(hlo_tools.parse_shape("f32[5]"))  # `n` itself is untouched
    both_refuse(module, "n", re.escape("shape equal to f32[5]"))


def test_verify_edits_checks_the_callers_of_an_edited_computation():
    body = "  a = f32[4] parameter(0)\n  ROOT f = f32[4] fusion(a, a), kind=kLoop, calls=fused"
    module = hlo_tools.parse_module(entry(body, computations=FUSED))
    fused = module.computation("fused")
    fused.add_instruction("negate", [fused.get("p0")])  # an unused instruction in a fusion body
    both_refuse(module, "f", "must have users")
    module = hlo_tools.parse_module(entry(body, computations=FUSED))
    fused = module.computation("fused")
    fused.set_root(fused.add_instruction("broadcast", [fused.root], hlo_tools.parse_shape("f32[2,4]"),
                                         attrs={"dimensions": (1,)}))
    both_refuse(module, "f", "Fused computation shape")


def test_verify_edits_checks_pairs_in_an_edited_computation():
    module = hlo_tools.parse_module(entry("  a = f32[4] parameter(0)\n  cs = (f32[4], f32[4], u32[]) copy-start(a)\n"
                                          "  cd = f32[4] copy-done(cs)\n  ROOT t = (f32[4]) tuple(cd)"))
    comp = module.entry
    comp.get("t").replace_operand_with(comp.get("cd"), comp.get("a"))
    comp.remove_instruction(comp.get("cd"))  # copy-start, itself untouched, loses its copy-done
    both_refuse(module, "cs", "requires one consumer")


def test_verify_edits_checks_all_of_a_new_computation():
    module = hlo_tools.parse_module(entry("  a = f32[4] parameter(0)\n  ROOT n = f32[4] negate(a)"))
    clone = module.clone_computation(module.entry, suffix="copy")
    clone.root.attrs["direction"] = "LT"
    both_refuse(module, clone.root.name, 'unexpected attribute "direction"')


def test_verify_edits_trusts_what_was_not_edited():
    """The parsed module is the baseline: an unedited problem is verify_module's to report, not verify_edits'."""
    module = hlo_tools.parse_module(entry("  a = f32[4] parameter(0)\n  n = f32[5] negate(a)\n"
                                          "  ROOT t = (f32[5]) tuple(n)"))
    verify_edits(module)
    with pytest.raises(HloVerifyError, match=re.escape("shape equal to f32[4]")):
        verify_module(module)
    module.entry.get("t").attrs["sharding"] = hlo_tools.Sharding.parse("{replicated}")  # an unrelated edit
    verify_edits(module)


@needs_corpus
def test_verify_edits_agrees_with_verify_module_on_random_edits():
    """Random edits through the IR's API of every valid corpus module: both verifiers accept or both refuse."""
    import random

    rng = random.Random(4)

    def reshape(module, comp, instr):
        instr.set_shape(rng.choice(list(module.instructions())).shape)

    def rewire(module, comp, instr):
        earlier = comp.instructions[:comp.instructions.index(instr)]
        if instr.operand_count and earlier:
            instr.set_operand(rng.randrange(instr.operand_count), rng.choice(earlier))

    def reroot(module, comp, instr):
        comp.set_root(instr)

    def add_unused(module, comp, instr):
        comp.add_instruction("copy", [instr], instr.shape)

    def remove(module, comp, instr):
        if not instr.is_root and instr.opcode != "parameter" and (instr.operands or not instr.users):
            if instr.users:
                instr.replace_all_uses_with(instr.operand(0))
            comp.remove_instruction(instr)

    def copy_attribute(module, comp, instr):
        for key in [k for k in instr.attrs if k != "metadata"][:1]:
            donors = [i for i in module.instructions() if key in i.attrs and i is not instr]
            if donors:
                instr.attrs[key] = rng.choice(donors).attrs[key]

    verdicts = {True: 0, False: 0}
    for path in VALID:
        text = read_exact(path)
        for edit in (reshape, rewire, reroot, add_unused, remove, copy_attribute):
            module = hlo_tools.parse_module(text)
            comp = rng.choice(module.computations)
            edit(module, comp, rng.choice(comp.instructions))
            outcomes = []
            for check in (verify_module, verify_edits):
                try:
                    check(module)
                    outcomes.append(None)
                except HloVerifyError as exc:
                    outcomes.append(exc.message)
            assert (outcomes[0] is None) == (outcomes[1] is None), (path, edit.__name__, outcomes)
            verdicts[outcomes[0] is None] += 1
    assert verdicts[True] > 1000 and verdicts[False] > 150, verdicts


# -- calibration against reality -------------------------------------------------------------------------
VALID = sorted(p for p in glob.glob(str(CORPUS_DIR / "*" / "*.hlo")) if "parser_invalid" not in p)
INVALID = sorted(glob.glob(str(CORPUS_DIR / "parser_invalid" / "*.hlo")))


@needs_corpus
def test_every_valid_corpus_module_verifies():
    assert len(VALID) == 364
    failures = []
    for path in VALID:
        try:
            verify(read_exact(path))
        except (HloParseError, HloVerifyError) as e:
            failures.append(f"{os.path.relpath(path, CORPUS_DIR)}: {e}")
    assert not failures, "\n".join(failures)


@needs_corpus
def test_every_invalid_corpus_module_is_refused():
    accepted = []
    for path in INVALID:
        try:
            verify(read_exact(path))
            accepted.append(os.path.basename(path))
        except (HloParseError, HloVerifyError):
            pass
    assert not accepted, accepted


def _shard_map_psum():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((8,), ("i",))

    def f(x, w):
        y = jnp.tanh(x @ w)
        return jax.lax.psum(y.sum(axis=0), "i"), jax.lax.all_gather(y, "i", tiled=True)

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P()), out_specs=(P(), P()), check_vma=False))
    args = (jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("i"))),
            jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=NamedSharding(mesh, P())))
    lowered = g.lower(*args)
    return {"before": lowered.as_text(dialect="hlo"), "before_debug": lowered.as_text(dialect="hlo", debug_info=True),
            "after": lowered.compile().as_text()}


def test_real_jax_modules_verify():
    import jax
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets XLA_FLAGS)")
    for name, text in _shard_map_psum().items():
        module = hlo_tools.parse_module(text)
        hlo_tools.verify(module)
        opcodes = {i.opcode for i in module.instructions()}
        assert opcodes & {"all-reduce", "all-gather", "all-reduce-start", "fusion"}, name


@needs_corpus
def test_mutated_modules_raise_only_hlo_errors():
    """Small deterministic mutations of XLA's test modules: verify may refuse them, never crash."""
    import random

    rng = random.Random(1234)
    mutations = [
        lambda t: re.sub(r"\d", lambda m: str(rng.randrange(10)) if rng.random() < 0.02 else m.group(0), t),
        lambda t: re.sub(r"\b(f32|s32|pred|bf16|u32)\[", lambda m: (rng.choice(["f32", "s32", "pred", "bf16"])
                                                                     if rng.random() < 0.1 else m.group(1)) + "[", t),
        lambda t: re.sub(r", [a-z_]+=(\{[^{}]*\}|[^,\s}]+)", lambda m: "" if rng.random() < 0.2 else m.group(0), t),
        lambda t: re.sub(r"\] (add|multiply|negate|copy|tuple|abs)\(",
                         lambda m: "] " + rng.choice(["add", "negate", "tuple", "copy"]) + "(", t),
    ]
    checked = 0
    for path in VALID[::3]:
        text = read_exact(path)
        for mutate in mutations:
            try:
                module = hlo_tools.parse_module(mutate(text))
            except HloParseError:
                continue
            try:
                hlo_tools.verify(module)
            except HloVerifyError:
                pass
            checked += 1
    assert checked > 200
