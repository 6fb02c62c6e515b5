"""The dataflow engine (`xla_passes.analysis.dataflow`) and the replication analysis built on it.

The engine's tests use a lattice whose state is the set of entry parameters a value is computed
from: tuples, calls, loops and conditionals show in which parameters each leaf ends up reading.
The backward engine's tests use a lattice whose state is the set of outputs a value ends up in.
The replication tests check what the engine adds to the analysis that answered before it: loops,
conditionals and calls are followed leaf by leaf, so that what a device-dependent body computes
from its operands alone, or a loop counter, is known to be the same on every device.
"""
import pytest

import hlo_tools
from xla_passes import PassContext
from xla_passes.analysis.dataflow import BackwardDataflow, BackwardLattice, ForwardDataflow, ForwardLattice
from xla_passes.analysis.replication_analysis import (DEVICE_IDS, REPLICA_IDS, ReplicationAnalysis,
                                                      cached_replication_analysis)
from xla_passes.passes import weight_update_sharding
from xla_passes.registry import pass_class


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


# -- the replication analysis on the engine -----------------------------------------------------------

class EndsInOutputs(BackwardLattice):
    """Which elements of the root tuple a value is computed into (a frozenset of numbers)."""

    def join(self, a, b):
        return a | b

    def unused(self, instr):
        return frozenset()

    def transfer(self, user, operand_number, user_state):
        return frozenset({operand_number}) if user is user.parent.root else user_state


def test_a_value_ends_where_each_of_its_users_ends():
    """Users come before the values they read: every way to the root counts, and a value read
    twice by one user is read as each of those operands."""
    module = hlo_tools.parse_module("""
HloModule m
ENTRY e {
  a = f32[2] parameter(0)
  b = f32[2] parameter(1)
  n = f32[2] negate(a)
  s = f32[2] add(n, b)
  d = f32[2] multiply(b, b)
  unused = f32[2] abs(a)
  ROOT t = (f32[2], f32[2], f32[2]) tuple(n, s, d)
}
""")
    flow = BackwardDataflow(EndsInOutputs(), module.entry)
    ends = {name: flow.value(module.entry.get(name)) for name in ("a", "b", "n", "s", "d", "unused")}
    assert ends == {"a": reads(0, 1), "b": reads(1, 2), "n": reads(0, 1), "s": reads(1), "d": reads(2),
                    "unused": reads()}


def test_the_backward_engine_leaves_called_computations_to_the_client():
    """A call is a user like any other: what it makes of its operand is the client's `transfer`."""
    module = hlo_tools.parse_module("""
HloModule m
f {
  x = f32[2] parameter(0)
  ROOT y = f32[2] negate(x)
}
ENTRY e {
  a = f32[2] parameter(0)
  c = f32[2] call(a), to_apply=f
  ROOT t = (f32[2], f32[2]) tuple(a, c)
}
""")
    flow = BackwardDataflow(EndsInOutputs(), module.entry)
    assert flow.value(module.entry.get("a")) == reads(0, 1)
    assert flow.value(module.entry.get("c")) == reads(1)
    assert flow.comp is module.entry


REPLICAS = "HloModule m, replica_count=8\n"
REDUCER = """
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
"""


def replication(text: str, comp: str | None = None, space=REPLICA_IDS, groups=None, **options):
    module = hlo_tools.parse_module(text)
    target = module.computation(comp) if comp else module.entry
    analysis = ReplicationAnalysis(target, groups or [list(range(8))], space, **options)
    return analysis, target


def replicated(analysis, comp, *names) -> dict[str, bool]:
    return {name: analysis.is_replicated(comp.get(name)) for name in names}


def test_a_loop_counter_is_replicated_while_what_a_device_adds_is_not():
    """The counter starts at a constant and grows by one, under a condition that reads only it:
    every device runs the same trips and holds the same counter, while the sum of replica ids
    differs. A condition that reads the replica id lets devices run different trips: nothing
    the loop carries is the same then, not even the counter."""
    text = """
HloModule m, replica_count=8
cond {
  s = (s32[], u32[]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(4)
  LIMIT
  ROOT lt = pred[] compare(i, limit), direction=LT
}
body {
  s = (s32[], u32[]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  one = s32[] constant(1)
  j = s32[] add(i, one)
  acc = u32[] get-tuple-element(s), index=1
  id = u32[] replica-id()
  sum = u32[] add(acc, id)
  ROOT r = (s32[], u32[]) tuple(j, sum)
}
ENTRY e {
  zero = s32[] constant(0)
  nothing = u32[] constant(0)
  init = (s32[], u32[]) tuple(zero, nothing)
  loop = (s32[], u32[]) while(init), condition=cond, body=body
  trips = s32[] get-tuple-element(loop), index=0
  total = u32[] get-tuple-element(loop), index=1
  ROOT t = (s32[], u32[]) tuple(trips, total)
}
"""
    analysis, entry = replication(text.replace("LIMIT", "limit = s32[] copy(n)"))
    assert replicated(analysis, entry, "trips", "total", "loop") == {"trips": True, "total": False, "loop": False}
    analysis, entry = replication(text.replace("LIMIT", "id = u32[] replica-id()\n  c = s32[] convert(id)\n"
                                                        "  limit = s32[] add(n, c)"))
    assert replicated(analysis, entry, "trips", "total") == {"trips": False, "total": False}


def test_a_call_is_followed_into_its_body_leaf_by_leaf():
    """The body reads the replica id, but its first output is a sum over all replicas and its
    second passes the replicated parameter on: both the same everywhere; the third differs."""
    analysis, entry = replication(REPLICAS + REDUCER + """
body {
  p = f32[4] parameter(0)
  w = f32[4] parameter(1)
  id = u32[] replica-id()
  c = f32[] convert(id)
  b = f32[4] broadcast(c), dimensions={}
  x = f32[4] add(p, b)
  s = f32[4] all-reduce(x), replica_groups={}, to_apply=add
  ROOT t = (f32[4], f32[4], f32[4]) tuple(s, w, x)
}
ENTRY e {
  p = f32[4] parameter(0)
  w = f32[4] parameter(1), parameter_replication={true}
  call = (f32[4], f32[4], f32[4]) call(p, w), to_apply=body
  s = f32[4] get-tuple-element(call), index=0
  w2 = f32[4] get-tuple-element(call), index=1
  x = f32[4] get-tuple-element(call), index=2
  ROOT t = (f32[4], f32[4], f32[4]) tuple(s, w2, x)
}
""")
    assert replicated(analysis, entry, "s", "w2", "x") == {"s": True, "w2": True, "x": False}


def test_a_branch_taken_by_every_device_alike_keeps_what_each_branch_keeps():
    analysis, entry = replication("""
HloModule m, replica_count=8
yes {
  p = (f32[], f32[]) parameter(0)
  ROOT a = f32[] get-tuple-element(p), index=0
}
no {
  p = (f32[], f32[]) parameter(0)
  id = u32[] replica-id()
  ROOT c = f32[] convert(id)
}
ENTRY e {
  w = f32[] parameter(0), parameter_replication={true}
  v = f32[] parameter(1)
  flag = pred[] parameter(2), parameter_replication={true}
  pair = (f32[], f32[]) tuple(w, v)
  same = f32[] conditional(flag, pair, pair), true_computation=yes, false_computation=yes
  differs = f32[] conditional(flag, pair, pair), true_computation=yes, false_computation=no
  id = u32[] replica-id()
  odd = pred[] convert(id)
  split = f32[] conditional(odd, pair, pair), true_computation=yes, false_computation=yes
  ROOT t = (f32[], f32[], f32[]) tuple(same, differs, split)
}
""")
    assert replicated(analysis, entry, "same", "differs", "split") == {"same": True, "differs": False, "split": False}


def test_tuple_parameters_are_replicated_leaf_by_leaf():
    analysis, entry = replication("""
HloModule m, replica_count=8
ENTRY e {
  p = (f32[2], f32[2]) parameter(0), parameter_replication={true,false}
  a = f32[2] get-tuple-element(p), index=0
  b = f32[2] get-tuple-element(p), index=1
  ROOT t = (f32[2], f32[2]) tuple(a, b)
}
""")
    assert replicated(analysis, entry, "a", "b", "p") == {"a": True, "b": False, "p": False}


CALLED_BODY = """
HloModule m, replica_count=8
body {
  p = (f32[2], f32[2]) parameter(0)
  a = f32[2] get-tuple-element(p), index=0
  b = f32[2] get-tuple-element(p), index=1
  ROOT s = f32[2] add(a, b)
}
ENTRY e {
  w = f32[2] parameter(0), parameter_replication={true}
  v = f32[2] parameter(1)
  pair = (f32[2], f32[2]) tuple(w, v)
  ROOT c = f32[2] call(pair), to_apply=body
}
"""


def test_a_called_computation_s_parameters_are_what_its_one_caller_passes():
    """Analysed on its own, a body called once by `call` starts from its caller's operands, leaf
    by leaf; a computation with no caller that says, from values that may differ; and with
    `assume_replicated_parameters` from replicated ones."""
    analysis, body = replication(CALLED_BODY, "body")
    assert replicated(analysis, body, "a", "b", "s") == {"a": True, "b": False, "s": False}
    analysis, body = replication(CALLED_BODY.replace("ROOT c = f32[2] call(pair), to_apply=body",
                                                     "c = f32[2] call(pair), to_apply=body\n"
                                                     "  ROOT d = f32[2] call(pair), to_apply=body"), "body")
    assert replicated(analysis, body, "a", "b") == {"a": False, "b": False}
    analysis, body = replication(CALLED_BODY, "body", assume_replicated_parameters=True)
    assert replicated(analysis, body, "a", "b", "s") == {"a": True, "b": True, "s": True}


SHARD_MAP = """
HloModule m, num_partitions=4, frontend_attributes={xla.sdy.meshes={mesh = #sdy.mesh<["x"=2, "y"=2]>}}
xla.sdy.manual_computation_body {
  split = f32[2,8] parameter(0)
  whole = f32[4,8] parameter(1)
  ROOT t = (f32[2,8], f32[4,8]) tuple(split, whole)
}
ENTRY e {
  a = f32[4,8] parameter(0), sharding={replicated}
  b = f32[4,8] parameter(1), sharding={replicated}
  g2l = (f32[2,8], f32[4,8]) custom-call(a, b), custom_call_target="xla.sdy.GlobalToLocalShape", frontend_attributes={xla.sdy.in_shardings="#sdy.sharding_per_value<[<@mesh, [{\\"x\\"}, {}]>, <@mesh, [{}, {}]>]>",xla.sdy.manual_axes="#sdy<manual_axes{\\"x\\", \\"y\\"}>"}
  a_local = f32[2,8] get-tuple-element(g2l), index=0
  b_local = f32[4,8] get-tuple-element(g2l), index=1
  ROOT c = (f32[2,8], f32[4,8]) call(a_local, b_local), to_apply=xla.sdy.manual_computation_body
}
"""


def test_shard_map_body_parameters_differ_along_the_axes_that_split_them():
    """Devices 0 and 1 differ on axis "y" only, 0 and 2 on "x", which splits the first operand."""
    along_y = [[0, 1], [2, 3]]
    along_x = [[0, 2], [1, 3]]
    analysis, body = replication(SHARD_MAP, "xla.sdy.manual_computation_body", DEVICE_IDS, along_y)
    assert replicated(analysis, body, "split", "whole") == {"split": True, "whole": True}
    analysis, body = replication(SHARD_MAP, "xla.sdy.manual_computation_body", DEVICE_IDS, along_x)
    assert replicated(analysis, body, "split", "whole") == {"split": False, "whole": True}


def test_device_dependent_sources_differ_unless_a_collective_makes_them_the_same():
    """A replica id differs, also read in a called reducer or fusion; an all-reduce over groups
    that hold each of ours makes it the same again, one over smaller groups does not."""
    analysis, entry = replication(REPLICAS + REDUCER + """
fused {
  p = u32[] parameter(0)
  id = u32[] replica-id()
  ROOT s = u32[] add(p, id)
}
ENTRY e {
  id = u32[] replica-id()
  c = f32[] convert(id)
  whole = f32[] all-reduce(c), replica_groups={}, to_apply=add
  halves = f32[] all-reduce(c), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add
  k = u32[] constant(1)
  f = u32[] fusion(k), kind=kLoop, calls=fused
  ROOT t = (f32[], f32[], u32[]) tuple(whole, halves, f)
}
""")
    assert replicated(analysis, entry, "c", "whole", "halves", "f") == {
        "c": False, "whole": True, "halves": False, "f": False}
    analysis, entry = replication(REPLICAS + REDUCER + """
ENTRY e {
  id = u32[] replica-id()
  c = f32[] convert(id)
  halves = f32[] all-reduce(c), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add
  ROOT n = f32[] negate(halves)
}
""", groups=[[0, 1], [6, 7]])
    assert replicated(analysis, entry, "halves", "n") == {"halves": True, "n": True}


def test_a_pass_run_computes_each_replication_analysis_once():
    """In a `PassContext`, until the pipeline drops it after a pass that changed the module: a
    simplifier that finds nothing to change reuses the analysis of its first run."""
    module = hlo_tools.parse_module(REPLICAS + REDUCER + """
ENTRY e {
  p = f32[4] parameter(0)
  ROOT s = f32[4] all-reduce(p), replica_groups={}, to_apply=add
}
""")
    context = PassContext()
    simplifier = pass_class("all-reduce-simplifier")()
    assert not simplifier.run(module, context)
    first = cached_replication_analysis(context, module.entry, [list(range(8))], REPLICA_IDS)
    assert not simplifier.run(module, context)
    assert cached_replication_analysis(context, module.entry, [list(range(8))], REPLICA_IDS) is first
    context.invalidate()
    assert cached_replication_analysis(context, module.entry, [list(range(8))], REPLICA_IDS) is not first


def test_a_pass_that_rewrites_between_questions_leaves_no_replication_analysis_of_what_was(monkeypatch):
    """weight-update-sharding asks the context's replication analyses and rewrites the computation
    it asked about: it forgets them (`PassContext.forget`), and only them."""
    module = hlo_tools.parse_module(REPLICAS + REDUCER + """
ENTRY step {
  w = f32[64,16] parameter(0), parameter_replication={true}
  grad = f32[64,16] parameter(1)
  sum = f32[64,16] all-reduce(grad), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=add
  lr = f32[] constant(0.1)
  lrs = f32[64,16] broadcast(lr), dimensions={}
  step = f32[64,16] multiply(sum, lrs)
  ROOT w1 = f32[64,16] subtract(w, step)
}
""")
    asked = []

    def asking(*args, **kwargs):
        asked.append(cached_replication_analysis(*args, **kwargs))
        return asked[-1]

    monkeypatch.setattr(weight_update_sharding, "cached_replication_analysis", asking)
    context = PassContext()
    other = context.analysis(("another-kind",), object)
    assert pass_class("weight-update-sharding")(threshold_bytes=256).run(module, context)
    assert any(i.opcode == "reduce-scatter" for i in module.entry.instructions)
    assert asked and cached_replication_analysis(context, module.entry, [list(range(8))], REPLICA_IDS) not in asked
    assert context.analysis(("another-kind",), object) is other


class ReadsSources(ReadsParameters):
    """Which of the parameters `sources` a value reads: a value that reads none of them is `unreached`."""

    unreached = frozenset()

    def __init__(self, sources):
        super().__init__()
        self.sources = sources

    def parameter(self, param):
        return frozenset({param.parameter_number}) if param.parameter_number in self.sources else frozenset()


SPARSE = """
HloModule m
ENTRY e {
  a = f32[2] parameter(0)
  b = f32[2] parameter(1)
  c = f32[2] parameter(2)
  na = f32[2] negate(a)
  nb = f32[2] negate(b)
  ab = f32[2] add(na, nb)
  bb = f32[2] multiply(nb, nb)
  cc = f32[2] abs(c)
  t = (f32[2], f32[2]) tuple(ab, cc)
  g = f32[2] get-tuple-element(t), index=1
  ROOT out = f32[2] add(ab, g)
}
"""


def test_a_sparse_run_transfers_only_what_its_sources_reach_and_agrees_with_the_dense_run():
    """From `sources`, the engine transfers the sources and the users of values with a state (here
    what parameter `a` reaches: not `b`'s and `c`'s own chains) and each value ends in the state the
    dense run gives it, `unreached` for the rest."""
    module = hlo_tools.parse_module(SPARSE)
    entry = module.entry
    dense = ForwardDataflow(ReadsSources({0}), entry)
    sparse_lattice = ReadsSources({0})
    sparse = ForwardDataflow(sparse_lattice, entry, sources=[entry.get("a")])
    assert sorted(sparse_lattice.transferred) == ["ab", "na", "out"]   # the engine's own: a, t, g
    assert list(sparse.reached) == [entry.get(n) for n in ("a", "na", "ab", "t", "g", "out")]
    for instr in entry.instructions:
        assert sparse.value(instr) == dense.value(instr), instr.name


def test_a_backward_run_within_values_gives_them_the_dense_run_s_states():
    """Within a set that holds every user of its values, the states are the dense run's, and
    nothing outside it gets one; a user left outside counts as unused."""
    module = hlo_tools.parse_module(SPARSE)
    entry = module.entry
    dense = BackwardDataflow(EndsInOutputs(), entry)
    inside = [entry.get(n) for n in ("a", "na", "ab", "t", "g", "out")]
    sparse = BackwardDataflow(EndsInOutputs(), entry, within=inside)
    assert [sparse.value(i) for i in inside] == [dense.value(i) for i in inside]
    assert sparse.value(entry.get("ab")) == reads(0, 1)
    with pytest.raises(KeyError):
        sparse.value(entry.get("nb"))
    without_the_tuple = BackwardDataflow(EndsInOutputs(), entry, within=[entry.get(n) for n in ("a", "na", "ab", "out")])
    assert without_the_tuple.value(entry.get("ab")) == reads(0)
