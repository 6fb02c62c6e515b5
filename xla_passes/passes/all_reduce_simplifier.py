"""`all-reduce-simplifier`: remove all-reduces of values already the same on every device.

As XLA's AllReduceSimplifier: when the operand of an all-reduce is the same on every device of
each of its groups (`xla_passes.analysis.replication_analysis`), the reduction needs no
communication. A sum over groups of k devices is the value times k (in the element type, so
integers wrap as the sum would); a min, max, and or or is the value itself; a mean (the sum
divided by k, or times 1/k) is the value::

    g = f32[128] all-reduce(x), replica_groups={{0,1,2,3}}, to_apply=add     (x: a local gradient)
    s = f32[128] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=add     (g: the same everywhere)
    four = f32[128] broadcast(f32[] constant(4)), dimensions={}
    mean = f32[128] divide(s, four)
    m = f32[128] all-reduce(g), replica_groups={{0,1,2,3}}, to_apply=max
                                  =>
    g = f32[128] all-reduce(x), replica_groups={{0,1,2,3}}, to_apply=add
    s.count = f32[] constant(4)
    s.count.broadcast = f32[128] broadcast(s.count), dimensions={}
    s = f32[128] multiply(g, s.count.broadcast)      (only where a use is not the mean)
    ... uses of `mean` read g, uses of `m` read g

This is what a `shard_map` training step needs: JAX's transpose emits one all-reduce per
gradient of a replicated parameter (`psum_invariant`), and `lax.pmean(grads)` then reduces the
already reduced gradient again, each all-reduce reading the one before, so that no combiner can
merge them; `collective-fusion` runs this pass first.

A tuple (combined) all-reduce is simplified leaf by leaf: the replicated leaves leave it, the
others stay in an all-reduce of their own (an array all-reduce when one is left). Groups of one
device give the operand back, whatever the reducer. Left alone, with the reason in `report`
where the operand is replicated: sums of `pred` (XLA backends disagree on whether that sum is
`or` or `xor`) and of complex numbers, reducers other than one add, minimum, maximum, and or or
(`multiply`, `xor`, multi-op reducers). Left alone too: groups of different sizes or that the
module does not determine, and all-reduces with control dependencies or `constrain_layout=true`.
After XLA's layout assignment (JAX's hook) a value whose layout is not the result's goes through
a `copy` to it. Async
`all-reduce-start`/`-done` pairs are not all-reduces here. Every computation but fusion and
async-wrapped bodies is visited.
"""
from __future__ import annotations

import dataclasses

from hlo_tools import HloComputation, HloInstruction, HloModule, Literal, Shape
from hlo_tools.ir.attributes import Sharding
from hlo_tools.ir.shape import FLOAT_DTYPES, INTEGRAL_DTYPES, SIGNED_DTYPES, DTYPE_BITS
from hlo_tools.ir.attributes import attr_bool

from ..analysis.collectives import (combinable_computations, leaf_shardings, reducer_opcode, replace_with_elements,
                                   result_shapes)
from ..analysis.constants import scalar_constant
from ..analysis.replica_groups import uniform_group_size
from ..analysis.replication_analysis import cached_replication_analysis, participants
from ..core import HloPass, PassContext, register_pass

# Reducers whose result over equal values is that value.
_IDEMPOTENT_REDUCERS = frozenset({"minimum", "maximum", "and", "or"})
# Attributes a smaller all-reduce keeps from the one it replaces (sharding is per leaf).
_KEPT_ATTRS = ("channel_id", "replica_groups", "use_global_device_ids", "to_apply", "metadata",
               "frontend_attributes", "backend_config")


@register_pass
class AllReduceSimplifier(HloPass):
    """Replace all-reduces of values the same on every device by the value (times the group size for a sum)."""

    name = "all-reduce-simplifier"
    opcodes = {"all-reduce"}

    def __post_init__(self):
        self.report: list[str] = []

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        self.report = []
        context = context or PassContext()
        changed = False
        for comp in combinable_computations(module):
            if comp.may_contain_text(("all-reduce",)):
                changed |= self._simplify(comp, context)
        return changed

    def _simplify(self, comp: HloComputation, context: PassContext) -> bool:
        """Decide for every all-reduce of `comp` first (the replication analysis reads the
        computation as it is), then rewrite."""
        plans = []
        for instr in comp.instructions:
            if instr.opcode != "all-reduce":
                continue
            plan = self._plan(instr, context)
            if plan is not None:
                plans.append(plan)
        for plan in plans:
            plan.apply()
        return bool(plans)

    def _plan(self, all_reduce: HloInstruction, context: PassContext) -> "_Plan | None":
        """Which leaves of `all_reduce` to replace and how; None when none (a reason in the report
        when a replicated leaf stays)."""
        if all_reduce.control_predecessors or all_reduce.control_successors:
            return None
        if attr_bool(all_reduce.attrs, "constrain_layout"):
            return None
        found = participants(all_reduce)
        size = uniform_group_size(found[1]) if found and found[1] else None
        if size is None:
            return None
        if size == 1:
            return _Plan(all_reduce, size, "identity", list(range(all_reduce.operand_count)))
        analysis = cached_replication_analysis(context, all_reduce.parent, found[1], found[0])
        replicated = [i for i, operand in enumerate(all_reduce.operands) if analysis.is_replicated(operand)]
        if not replicated:
            return None
        reducer = reducer_opcode(all_reduce.attrs["to_apply"])
        why = _why_kept(reducer, all_reduce.operand(0).shape.dtype)
        operands = f"%{all_reduce.name}: operand{'s' if len(replicated) > 1 else ''} {', '.join(map(str, replicated))}"
        if why:
            self.report.append(f"{operands} the same on every device, kept: {why}")
            return None
        kind = "identity" if reducer in _IDEMPOTENT_REDUCERS else "sum"
        self.report.append(f"{operands} the same on the {size} devices of each group: "
                           f"{'the value' if kind == 'identity' else f'times {size}'}")
        return _Plan(all_reduce, size, kind, replicated)


def _why_kept(reducer: str | None, dtype: str) -> str:
    """Why a replicated all-reduce with this reducer and element type stays ("" when it need not)."""
    if reducer in _IDEMPOTENT_REDUCERS:
        return ""
    if reducer != "add":
        return f"its reducer is {reducer or 'not one binary op'}, not add, min, max, and or or"
    if dtype == "pred":
        return "a sum of pred is `or` on some XLA backends and `xor` on others"
    if dtype not in FLOAT_DTYPES | INTEGRAL_DTYPES:
        return f"sums of {dtype} are not simplified"
    return ""


@dataclasses.dataclass
class _Plan:
    """How one all-reduce changes: `leaves` (operand numbers) become their operand (`identity`)
    or their operand times `group_size` (`sum`); the other leaves stay reduced."""

    all_reduce: HloInstruction
    group_size: int
    kind: str
    leaves: list[int]

    def apply(self) -> None:
        all_reduce, comp = self.all_reduce, self.all_reduce.parent
        shapes = result_shapes(all_reduce)
        shardings = leaf_shardings(all_reduce)
        kept = [i for i in range(all_reduce.operand_count) if i not in self.leaves]
        elements: list[HloInstruction | None] = [None] * len(shapes)
        scaled = []
        for i in self.leaves:
            value = _with_layout_of(all_reduce.operand(i), shapes[i], all_reduce)
            if self.kind == "sum":
                elements[i] = self._times_group_size(value, shapes[i], shardings[i] if shardings else None)
                scaled.append((elements[i], value))
            else:
                elements[i] = value
        name = all_reduce.name
        reduced = None
        if kept:
            shape = shapes[kept[0]] if len(kept) == 1 else Shape.tuple([shapes[i] for i in kept])
            attrs = {key: value for key, value in all_reduce.attrs.items() if key in _KEPT_ATTRS}
            if shardings:
                attrs["sharding"] = (shardings[kept[0]] if len(kept) == 1
                                     else Sharding.tuple_of([shardings[i] for i in kept]))
            reduced = comp.add_instruction("all-reduce", [all_reduce.operand(i) for i in kept], shape, attrs=attrs,
                                           before=all_reduce)
            for position, i in enumerate(kept):
                elements[i] = reduced if len(kept) == 1 else comp.add_instruction(
                    "get-tuple-element", [reduced], shapes[i], attrs={"index": position}, before=all_reduce)
        replace_with_elements(all_reduce, elements)
        if reduced is not None:
            reduced.rename(name)
        elif len(scaled) == 1 and not all_reduce.shape.is_tuple:
            scaled[0][0].rename(name)
        for product, value in scaled:
            _fold_means(product, value, self.group_size)
            if product.parent is not None and product.opcode == "fusion":
                _fold_into_fusions(product, value, self.group_size)

    def _times_group_size(self, value: HloInstruction, shape: Shape, sharding) -> HloInstruction:
        """`value * group_size` in `value`'s element type, where the all-reduce was.

        After XLA's fusion (JAX's hook) nothing fuses the product any more, and XLA would give
        the broadcast count a buffer of the gradient's size: there the product is one kLoop
        fusion (the constant, its broadcast and the multiply), like those XLA makes.
        """
        comp, name = self.all_reduce.parent, self.all_reduce.name
        attrs = {key: value for key, value in self.all_reduce.attrs.items() if key == "metadata"}
        if sharding is not None:
            attrs["sharding"] = sharding
        if not comp.parent.layouts_final:
            return _times(comp, value, self.group_size, shape, name, attrs, before=self.all_reduce)
        body = HloComputation(comp.parent.unique_name(f"{name}.times_computation"))
        _times(body, body.add_parameter(value.shape, name="param_0"), self.group_size, shape, f"{name}.times", {},
               before=None, root=True)
        comp.parent.add_computation(body, before=comp)
        return comp.add_instruction("fusion", [value], shape, name=name, before=self.all_reduce,
                                    attrs={"kind": "kLoop", "calls": body, **attrs})


def _times(comp: HloComputation, value: HloInstruction, group_size: int, shape: Shape, name: str, attrs: dict, *,
           before: HloInstruction | None, root: bool = False) -> HloInstruction:
    """`value * group_size` (a constant, its broadcast, a multiply) added to `comp` before `before`
    (at the end where None); `root`: the product becomes `comp`'s root."""
    scalar = Shape.array(shape.dtype, ())
    count = comp.add_instruction("constant", (), scalar, name=f"{name}.count", before=before,
                                 literal=Literal.parse(scalar, _in_dtype(group_size, shape.dtype)))
    counts = comp.add_instruction("broadcast", [count], shape, name=f"{name}.count.broadcast",
                                  attrs={"dimensions": ()}, before=before) if shape.rank else count
    product = comp.add_instruction("multiply", [value, counts], shape, name=name, attrs=attrs, before=before)
    if root:
        comp.set_root(product)
    return product


def _with_layout_of(value: HloInstruction, shape: Shape, before: HloInstruction) -> HloInstruction:
    """`value`, or a copy of it laid out as `shape` where XLA gave the all-reduce's operand and
    result different layouts."""
    if value.shape.layout is None or shape.layout is None or value.shape.layout == shape.layout:
        return value
    return value.parent.add_instruction("copy", [value], shape, before=before)


def _in_dtype(number: int, dtype: str) -> str:
    """`number` as a literal of `dtype`: wrapped to the integer type's width, as a sum of that many
    equal integers wraps."""
    if dtype not in INTEGRAL_DTYPES:
        return str(number)
    bits = DTYPE_BITS[dtype]
    wrapped = number % (1 << bits)
    if dtype in SIGNED_DTYPES and wrapped >= 1 << (bits - 1):
        wrapped -= 1 << bits
    return str(wrapped)


def _fold_means(product: HloInstruction, value: HloInstruction, group_size: int) -> None:
    """Make the uses of `product` (= `value` * `group_size`, floating point) that divide it by
    `group_size` again, or multiply it by 1/`group_size`, read `value`; remove what that leaves
    unused."""
    if product.shape.dtype not in FLOAT_DTYPES:
        return
    for user in list(product.users):
        if user.control_successors or user.operand_count != 2:
            continue
        other = user.operand(1) if user.operand(0) is product else user.operand(0)
        if ((user.opcode == "divide" and user.operand(0) is product and scalar_constant(other) == group_size)
                or (user.opcode == "multiply" and other is not product and scalar_constant(other) == 1 / group_size)):
            user.replace_all_uses_with(value)
            _remove_unused(user)
    _remove_unused(product)


def _fold_into_fusions(product: HloInstruction, value: HloInstruction, group_size: int) -> None:
    """After XLA's fusion: make the loop and input fusions that read `product` (the kLoop fusion of
    `value` * `group_size`) multiply `value` themselves, the same float operation in their body,
    where a mean's 1/`group_size` that XLA fused there takes it back out (`_fold_means`).

    The product then needs no buffer: a separate fusion's result lives from where XLA schedules
    it to its last reader, which XLA's all-reduce did not hold for longer than its uses (JAX's
    optimizers read a gradient twice, once per moment of adam)::

        s = f32[512] fusion(g), kind=kLoop, calls=times    (g * 8)
        m = f32[512] fusion(m0, s), kind=kLoop, calls=update    (update: p1 * 0.125, ...)
                                  =>
        m = f32[512] fusion(m0, g), kind=kLoop, calls=update    (update: p1, ...)
    """
    module = product.parent.parent
    callers = module.callers()
    for user in list(product.users):
        if user.opcode != "fusion" or user.attrs.get("kind") not in ("kLoop", "kInput"):
            continue
        body = user.attrs["calls"]
        if len(callers.get(body, ())) > 1:
            body = module.clone_computation(body, suffix="scaled")
            user.attrs["calls"] = body
        for number, operand in enumerate(user.operands):
            if operand is product:
                parameter = body.parameter(number)
                readers = sorted(parameter.users, key=body.instructions.index)
                scaled = _times(body, parameter, group_size, parameter.shape, f"{parameter.name}.times", {},
                                before=readers[0] if readers else None)
                for reader in readers:
                    reader.replace_operand_with(parameter, scaled)
                if parameter.is_root:
                    body.set_root(scaled)
                _fold_means(scaled, parameter, group_size)
                user.set_operand(number, value)
    if not product.users and not product.is_root:
        body = product.attrs["calls"]
        _remove_unused(product)
        module.remove_computation(body)


def _remove_unused(instr: HloInstruction) -> None:
    """Remove `instr` when nothing uses it, then its operands that were there for it alone
    (constants and broadcasts of them)."""
    if instr.users or instr.is_root or instr.control_successors or instr.parent is None:
        return
    operands = list(instr.operands)
    instr.parent.remove_instruction(instr)
    for operand in operands:
        if operand.opcode in ("constant", "broadcast"):
            _remove_unused(operand)
