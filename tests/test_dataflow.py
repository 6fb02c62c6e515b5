"""The dataflow engine (`xla_passes.analysis.dataflow`).

The engine's tests use a lattice whose state is the set of entry parameters a value is computed
from: tuples, calls, loops and conditionals show in which parameters each leaf ends up reading.
"""
import hlo_tools
from xla_passes.analysis.dataflow import ForwardDataflow, ForwardLattice


class ReadsParameters(ForwardLattice):
    """Which parameters of the analysed computation a value reads (a frozenset of numbers)."""

    def __init__(self, *, into_fusions: bool = False):
        self.into_fusions = into_fusions
        self.transferred: list[str] = []

    def join(self, a, b):
        return a | b

    def parameter(self, param):
        return frozenset({param.parameter_number})

    def transfer(self, instr, operands):
        self.transferred.append(instr.name)
        return frozenset().union(*(_leaves(o) for o in operands))

    def descends(self, instr, operands):
        return self.into_fusions or instr.opcode != "fusion"

    def through_control(self, result, control):
        return _with(result, _leaves(control))


def _leaves(state) -> frozenset:
    return frozenset().union(*map(_leaves, state)) if isinstance(state, tuple) else state


def _with(state, extra: frozenset):
    return tuple(_with(s, extra) for s in state) if isinstance(state, tuple) else state | extra


def analyse(text: str, lattice=None, **parse_options):
    module = hlo_tools.parse_module(text, **parse_options)
    return module, ForwardDataflow(lattice or ReadsParameters(), module.entry)


def reads(*numbers):
    return frozenset(numbers)


def test_tuple_elements_keep_their_own_states():
    module, flow = analyse("""
HloModule m
ENTRY e {
  a = f32[2] parameter(0)
  b = f32[2] parameter(1)
  t = (f32[2], (f32[2], f32[2])) tuple(a, (f32[2], f32[2]) tuple(b, a))
  inner = (f32[2], f32[2]) get-tuple-element(t), index=1
  ROOT x = f32[2] get-tuple-element(inner), index=0
}
""")
    assert flow.value(module.entry.get("t")) == (reads(0), (reads(1), reads(0)))
    assert flow.value(module.entry.root) == reads(1)


def test_each_call_site_is_analysed_with_its_own_operands():
    """Context-sensitive: `second` reads what its caller passes there, not what every caller passes;
    an instruction of the callee holds the join over its call sites."""
    module, flow = analyse("""
HloModule m
pick {
  p = f32[2] parameter(0)
  q = f32[2] parameter(1)
  ROOT r = (f32[2], f32[2]) tuple(q, p)
}
ENTRY e {
  a = f32[2] parameter(0)
  b = f32[2] parameter(1)
  c = f32[2] constant({1, 2})
  first = (f32[2], f32[2]) call(a, b), to_apply=pick
  second = (f32[2], f32[2]) call(c, a), to_apply=pick
  ROOT t = ((f32[2], f32[2]), (f32[2], f32[2])) tuple(first, second)
}
""")
    assert flow.value(module.entry.get("first")) == (reads(1), reads(0))
    assert flow.value(module.entry.get("second")) == (reads(0), reads())
    assert flow.value(module.computation("pick").get("q")) == reads(0, 1)


def test_a_loop_iterates_until_the_carried_state_is_stable():
    """The body rotates three elements: after two trips each may hold any of them; the result is
    the join with the init (a loop may run zero times), and the counter stays on its own."""
    module, flow = analyse("""
HloModule m
cond {
  s = (s32[], f32[], f32[], f32[]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(5)
  ROOT lt = pred[] compare(i, n), direction=LT
}
body {
  s = (s32[], f32[], f32[], f32[]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  one = s32[] constant(1)
  j = s32[] add(i, one)
  x = f32[] get-tuple-element(s), index=1
  y = f32[] get-tuple-element(s), index=2
  z = f32[] get-tuple-element(s), index=3
  ROOT r = (s32[], f32[], f32[], f32[]) tuple(j, y, z, x)
}
ENTRY e {
  zero = s32[] constant(0)
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = f32[] parameter(2)
  d = f32[] parameter(3)
  init = (s32[], f32[], f32[], f32[]) tuple(zero, a, b, c)
  loop = (s32[], f32[], f32[], f32[]) while(init), condition=cond, body=body
  ROOT out = f32[] get-tuple-element(loop), index=1
}
""")
    assert flow.value(module.entry.get("loop")) == (reads(), reads(0, 1, 2), reads(0, 1, 2), reads(0, 1, 2))
    assert flow.value(module.computation("body").get("j")) == reads()
    assert flow.value(module.computation("cond").root) == reads()


def test_what_decides_a_loop_or_a_branch_reaches_its_result():
    """`through_control`: the condition of the loop reads parameter 1, the predicate parameter 2."""
    module, flow = analyse("""
HloModule m
cond {
  s = (f32[], f32[]) parameter(0)
  limit = f32[] get-tuple-element(s), index=1
  zero = f32[] constant(0)
  ROOT lt = pred[] compare(limit, zero), direction=GT
}
body {
  s = (f32[], f32[]) parameter(0)
  x = f32[] get-tuple-element(s), index=0
  limit = f32[] get-tuple-element(s), index=1
  ROOT r = (f32[], f32[]) tuple(x, limit)
}
double {
  p = f32[] parameter(0)
  ROOT d = f32[] add(p, p)
}
keep {
  p = f32[] parameter(0)
  ROOT k = f32[] constant(0)
}
ENTRY e {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  which = pred[] parameter(2)
  init = (f32[], f32[]) tuple(a, b)
  loop = (f32[], f32[]) while(init), condition=cond, body=body
  branch = f32[] conditional(which, a, b), true_computation=double, false_computation=keep
  ROOT t = ((f32[], f32[]), f32[]) tuple(loop, branch)
}
""")
    assert flow.value(module.entry.get("loop")) == (reads(0, 1), reads(1))
    assert flow.value(module.entry.get("branch")) == reads(0, 2)
    assert flow.value(module.computation("double").root) == reads(0)


def test_branch_computations_get_their_own_operands():
    module, flow = analyse("""
HloModule m
first {
  p = f32[] parameter(0)
  ROOT n = f32[] negate(p)
}
second {
  p = (f32[], f32[]) parameter(0)
  ROOT x = f32[] get-tuple-element(p), index=1
}
ENTRY e {
  i = s32[] constant(1)
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = f32[] parameter(2)
  pair = (f32[], f32[]) tuple(b, c)
  ROOT r = f32[] conditional(i, a, pair), branch_computations={first, second}
}
""")
    assert flow.value(module.entry.root) == reads(0, 2)


FUSED = """
HloModule m
fused {
  p = f32[2] parameter(0)
  q = f32[2] parameter(1)
  n = f32[2] negate(p)
  ROOT t = (f32[2], f32[2]) tuple(n, q)
}
ENTRY e {
  a = f32[2] parameter(0)
  b = f32[2] parameter(1)
  ROOT f = (f32[2], f32[2]) fusion(a, b), kind=kLoop, calls=fused
}
"""


def test_fusion_bodies_are_followed_only_for_clients_that_ask():
    """A client that does not look into fusions gets one `transfer` for the fusion, and a body
    left unparsed stays unparsed; one that does gets the body's outputs leaf by leaf."""
    lattice = ReadsParameters()
    module, flow = analyse(FUSED, lattice, lazy_bodies=True)
    assert flow.value(module.entry.root) == reads(0, 1)
    assert lattice.transferred == ["f"]
    assert not module.computation("fused").parsed
    module, flow = analyse(FUSED, ReadsParameters(into_fusions=True))
    assert flow.value(module.entry.root) == (reads(0), reads(1))
