"""Shared machinery of the collective passes: what makes two collectives combinable, in which
groups they may be combined without creating a cycle, and how a group becomes one
collective.

The combiners (`all-reduce-combiner`, `all-gather-combiner`, `reduce-scatter-combiner`) are
built from three pieces, each usable on its own:

* keys: `replica_groups_key`, `reducer_key` and `collective_key` say when two collectives do
  the same communication (same participants, mode and reduction, same `collective_group_key`
  frontend attribute), so one op can do both; `domain_metadata` says which sharding domain an
  instruction is in (XLA combines only within one);
* grouping: `combine_by_key` is XLA's `CombineInstructionsByKey`: walk a computation in post
  order and collect instructions of one key into a group until a size or count threshold is
  reached, skipping those that depend on the group (`reachability.DependencyTracker`), which a
  later group takes;
* rewriting: `combine_collectives` replaces a group by one collective whose operands are all
  of the group's operands, and every member by the matching `get-tuple-element`s of it
  (`replace_with_elements`); `combine_all_reduces_flat` does it for all-reduces with one flat
  buffer instead, for where XLA cannot take a tuple-shaped one (Shardy `shard_map` bodies).

Only synchronous collectives are combined, and none with control dependencies (XLA's
`DoNotCombineWithControlDependencies`). XLA's combiners run before its async conversion,
and XLA itself cannot lower a tuple-shaped `all-reduce-start` or `all-gather-start` to
StableHLO (so such a result could not even be executed here); `*-start`/`*-done` pairs and
`async-start` wrappers are left as they are, and they still count as dependencies.
"""
from __future__ import annotations

import dataclasses
import os
import weakref
from collections import Counter
from typing import Callable, Hashable, Iterable, Sequence

from hlo_tools import HloComputation, HloInstruction, HloModule, SliceSpec
from hlo_tools.ir.attributes import (AttrError, FrontendAttributes, Metadata, Raw, Sharding, attr_bool, attr_ints,
                                     split_top_level)
from hlo_tools.ir.opcodes import async_wrapped_opcode
from hlo_tools.ir.printer import format_value
from hlo_tools.ir.shape import Layout, Shape

from .reachability import DependencyTracker

# Binary opcodes whose operands may be swapped: `add(b, a)` reduces exactly like `add(a, b)`.
COMMUTATIVE_OPCODES = frozenset({"add", "multiply", "maximum", "minimum", "and", "or", "xor"})

# Attributes of a collective that describe its communication; a combined op copies them from
# the first member (they are part of the key, so all members agree on what they mean).
_COMMUNICATION_ATTRS = ("channel_id", "replica_groups", "use_global_device_ids", "dimensions", "to_apply")


# -- keys ---------------------------------------------------------------------------------------------

def replica_groups_key(instr: HloInstruction) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups of a collective as explicit tuples (iota and explicit forms compare
    equal; `()` is XLA's "one group of everyone"), or None when they are malformed (`Raw`)."""
    groups = instr.attrs.get("replica_groups")
    if groups is None:
        return ()
    if isinstance(groups, Raw):
        return None
    return tuple(tuple(group) for group in groups.groups)


def computation_key(comp: HloComputation) -> tuple:
    """What `comp` computes, without names or metadata: equal keys mean equal functions.

    Parameters are referred to by number and commutative binary operands are sorted, so
    `add(x, y)` and `add(y, x)` of two differently named reducers have one key.
    """
    refs: dict[HloInstruction, tuple] = {}
    body = []
    for instr in comp.post_order():
        if instr.opcode == "parameter":
            refs[instr] = ("parameter", instr.parameter_number, instr.shape.without_layout())
            continue
        refs[instr] = ("value", len(body))
        operands = [refs[o] for o in instr.operands]
        if instr.opcode in COMMUTATIVE_OPCODES and len(operands) == 2:
            operands.sort()
        attrs = tuple(sorted((key, _attr_key(key, value)) for key, value in instr.attrs.items()
                             if key != "metadata"))
        literal = instr.literal.text if instr.literal is not None else None
        body.append((instr.opcode, instr.shape.without_layout(), tuple(operands), literal, attrs))
    params = tuple(sorted(ref for instr, ref in refs.items() if instr.opcode == "parameter"))
    return params, tuple(body), refs[comp.root]


def _attr_key(key: str, value) -> Hashable:
    if isinstance(value, HloComputation):
        return computation_key(value)
    if isinstance(value, tuple) and value and isinstance(value[0], HloComputation):
        return tuple(computation_key(c) for c in value)
    return format_value(key, value)


def reducer_key(instr: HloInstruction) -> tuple | None:
    """The key of a collective's reduction computation (`to_apply`), None when it has none."""
    reducer = instr.attrs.get("to_apply")
    return computation_key(reducer) if isinstance(reducer, HloComputation) else None


# Reducers that are one associative, commutative elementwise op: an all-reduce rewritten into
# steps that sum in another order (rings, trees) gives the same result, floats up to rounding.
ORDER_FREE_REDUCERS = ("add", "multiply", "maximum", "minimum", "and", "or", "xor")


def reducer_opcode(reducer: HloComputation) -> str | None:
    """`add` for `ROOT add(p0, p1)` over two scalar parameters, and so on; None otherwise."""
    root = reducer.root
    if reducer.num_parameters != 2 or root.operand_count != 2:
        return None
    if {o.opcode for o in root.operands} != {"parameter"} or root.operand(0) is root.operand(1):
        return None
    return root.opcode


def collective_dimension(instr: HloInstruction) -> int:
    """The gather or scatter dimension of an all-gather or reduce-scatter."""
    return attr_ints(instr.attrs, "dimensions")[0]


# The frontend attribute that puts collectives in launch groups; different values never combine.
COLLECTIVE_GROUP_KEY = "collective_group_key"

# Collectives that cut their operand, or assemble their result, along one dimension.
DIMENSIONED_COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all")


def slices_are_contiguous(shape: Shape, dimension: int) -> bool:
    """Whether the slices of `shape` along `dimension` are contiguous runs of its buffer.

    XLA's CPU and GPU runtimes reduce-scatter, all-gather and all-to-all a buffer in contiguous
    chunks, one per device, so a collective along `dimension` means what HLO says only when its
    layout puts `dimension` (after dimensions of size 1) most major. XLA's layout assignment
    gives every collective such a layout (JAX's reduce-scatter of `f32[3,3,16,16]` along 2 gets
    `{3,1,0,2}`); a collective added after layout assignment, as at JAX's pass hook, must have
    one already. A shape without a layout gets one from layout assignment later: always True.
    """
    if shape.layout is None:
        return True
    for major in reversed(shape.layout.minor_to_major):
        if major == dimension:
            return True
        if shape.dims[major] != 1:
            return False
    return True


def layout_problem(instr: HloInstruction) -> str:
    """Why a dimensioned collective of a laid-out module would move the wrong elements ("" if
    it would not): an operand or result whose slices along its dimension are not contiguous."""
    if instr.opcode not in DIMENSIONED_COLLECTIVES or "dimensions" not in instr.attrs:
        return ""
    dimension = collective_dimension(instr)
    for shape in [o.shape for o in instr.operands] + result_shapes(instr):
        if shape.is_array and dimension < shape.rank and not slices_are_contiguous(shape, dimension):
            return (f"%{instr.name} ({instr.opcode}) works along dimension {dimension}, which the layout of "
                    f"{shape} does not make most major; after layout assignment XLA would move contiguous "
                    f"chunks of the buffer instead of slices along that dimension")
    return ""


def collective_key(instr: HloInstruction, *, by_dimension: bool = True) -> tuple | None:
    """A key that is equal for collectives of one opcode that one op can do together, or None
    when `instr` must not be combined at all.

    Equal keys mean: same opcode, replica groups, channel-id presence (cross-replica and
    cross-partition collectives differ in what the groups number), `use_global_device_ids`,
    reduction computation (by structure, which covers the element type of reducing
    collectives) and `collective_group_key` frontend attribute (collectives a frontend put in
    different launch groups stay apart, as in XLA); the gather/scatter dimension when
    `by_dimension`. Element types of all-gathers do not count (XLA's default).
    Layout-constrained collectives, malformed replica groups and results that are not arrays
    give None.
    """
    if attr_bool(instr.attrs, "constrain_layout"):
        return None
    if not all(leaf.is_array for _, leaf in instr.shape.leaves()) or not instr.operands:
        return None
    groups = replica_groups_key(instr)
    if groups is None:
        return None
    frontend = instr.attrs.get("frontend_attributes")
    group_key = frontend.get(COLLECTIVE_GROUP_KEY) if isinstance(frontend, FrontendAttributes) else None
    key = (instr.opcode, groups, "channel_id" in instr.attrs, attr_bool(instr.attrs, "use_global_device_ids"),
           reducer_key(instr), group_key)
    if by_dimension and "dimensions" in instr.attrs:
        key += (collective_dimension(instr),)
    return key


# -- thresholds ----------------------------------------------------------------------------------------

# The combiners' thresholds (bytes, operand count) on each platform:
# * cpu: no more bytes than the largest collective of the kind the computation already has, or
#   1 MiB where all are smaller (`LARGEST_PRESENT`, `SMALL_BYTES`), 256 operands. XLA's own CPU limits are no byte limit and 256 operands
#   (`CpuAllReduceCombiner(kCombineBytes, kCombineCount)`, `kCombineBytes =
#   std::numeric_limits<int64_t>::max()`, xla/service/cpu/cpu_compiler.cc), but its combiner rarely
#   finds independent all-reduces at the hook, and ours does (after `all-reduce-simplifier`): an
#   XLA:CPU collective writes its results out of place, so one op of every gradient holds every
#   sum at once beside every gradient, 1.67x the temporary memory of a shard_map step's separate
#   all-reduces (docs/benchmarks.md). Groups no bigger than the largest op hold no more at once
#   than that op did, and still cut the count of small ops, which is where a collective's fixed
#   cost shows; below a megabyte the memory is not worth keeping ops apart for. XLA's CPU pipeline has no all-gather or reduce-scatter combiner; ours use the same
#   limits there.
# * cuda, rocm: 30 MiB, 256 operands: `xla_gpu_all_reduce_combine_threshold_bytes`,
#   `..._all_gather_...` and `..._reduce_scatter_...` default to 30 * 1024 * 1024
#   (xla/debug_options_flags.cc, kDefault*CombineThreshold), count 256 (xla/service/gpu/gpu_compiler.cc,
#   RunPostFusionPasses);
# * tpu: libtpu's compiler is not open source and states no default; GPU's are used.
# Offline (xla-opt, the Python API), where no platform is known, the default is GPU's.
LARGEST_PRESENT = None
SMALL_BYTES = 1 << 20
GPU_THRESHOLDS = (30 * 1024 * 1024, 256)
PLATFORM_THRESHOLDS = {"cpu": (LARGEST_PRESENT, 256), "cuda": GPU_THRESHOLDS, "rocm": GPU_THRESHOLDS,
                       "tpu": GPU_THRESHOLDS}
OFFLINE_THRESHOLDS = GPU_THRESHOLDS
THRESHOLD_OPTIONS = ("threshold_bytes", "threshold_count")


def combiner_thresholds(hlo_pass, context=None) -> dict[str, int | None]:
    """A combiner pass's `threshold_bytes` and `threshold_count`, where unset (None) the run's
    (`PassContext.combiner_thresholds`: the platform's at the JAX hook), else the offline defaults.
    A `threshold_bytes` of `LARGEST_PRESENT` (None) is the largest collective of the kind in each
    computation, at least `SMALL_BYTES` (`combine_by_key`)."""
    defaults = getattr(context, "combiner_thresholds", None) or OFFLINE_THRESHOLDS
    return {option: default if getattr(hlo_pass, option) is None else getattr(hlo_pass, option)
            for option, default in zip(THRESHOLD_OPTIONS, defaults)}


def platform_thresholds(platform: str | None) -> tuple[int, int] | None:
    """XLA's combiner thresholds on `platform` (what the JAX hook compiles for; see
    `PLATFORM_THRESHOLDS`); None offline (no platform), where the combiners use `OFFLINE_THRESHOLDS`."""
    return PLATFORM_THRESHOLDS.get(platform, OFFLINE_THRESHOLDS) if platform else None


# -- grouping ------------------------------------------------------------------------------------------

def combine_by_key(comp: HloComputation, key_of: Callable[[HloInstruction], Hashable | None],
                   combine: Callable[[list[HloInstruction]], object], *, threshold_bytes: int | None,
                   threshold_count: int) -> bool:
    """Combine instructions of `comp` with equal keys, as XLA's `CombineInstructionsByKey`.

    Each round walks the computation in post order. The first instruction that still has a
    key opens a group; later ones of the same key join it until adding one would pass
    `threshold_bytes` (bytes of the results) or `threshold_count` (operands of the combined
    op). One that depends on a member is passed over and left for a later round, and the walk
    goes on: two independent chains `a2(a1)`, `b2(b1)` become the groups `a1+b1` and `a2+b2`
    (XLA's `IndependentBlocksWithDependentStages`). A group of two members or more goes to
    `combine`, and the next round starts from what is left. An instruction that is over a
    threshold on its own is never combined. Members are in post order, so the result does not
    depend on dictionary order.

    Passing over a dependent instruction cannot make a cycle: whatever joins later comes after
    it in post order, so it is either downstream of it (and so of a member: passed over too) or
    independent of it.

    `threshold_bytes` `LARGEST_PRESENT` (None) is the bytes of the largest instruction with a key,
    at least `SMALL_BYTES`.

    `combine(members)` rewrites the members away; returns whether anything was combined.
    """
    keys = {}
    for instr in comp.instructions:
        key = key_of(instr)
        if key is not None:
            keys[instr] = key
    if threshold_bytes is LARGEST_PRESENT:
        threshold_bytes = max([SMALL_BYTES, *(instr.shape.byte_size for instr in keys)])
    if threshold_bytes <= 0 or threshold_count <= 0:
        return False
    changed = False
    while keys:
        group, group_key, group_bytes, group_count = [], None, 0, 0
        tracker = DependencyTracker(comp)
        for instr in comp.post_order():
            key = keys.get(instr)
            if key is None or (group and key != group_key):
                continue
            size, count = instr.shape.byte_size, instr.operand_count
            if size > threshold_bytes or count > threshold_count:
                del keys[instr]  # can never be combined with anything
                continue
            if tracker.depends_on_sources(instr):
                continue  # a later group takes it
            if group_bytes + size > threshold_bytes or group_count + count > threshold_count:
                break
            group.append(instr)
            group_key, group_bytes, group_count = key, group_bytes + size, group_count + count
            tracker.add_source(instr)
            del keys[instr]
            if group_count >= threshold_count:
                break
        if len(group) > 1:
            combine(group)
            changed = True
    return changed


def domain_metadata(comp: HloComputation) -> dict[HloInstruction, Hashable] | None:
    """Which sharding domain each instruction of `comp` is in, as XLA's `HloDomainMap` says it:
    None when `comp` has no `domain` instruction.

    The `domain` instructions cut the computation into regions (instructions connected through
    operands without crossing one). A region that reads a `domain` takes that domain's user
    side (`entry=`); one that only feeds a `domain`, its operand side (`exit=`); one with no
    `domain` around it, None. Regions with equal metadata count as one domain (XLA's
    `CombineFromTwoDomainsWithSameMetadata`).
    """
    instructions = comp.instructions
    if not any(instr.opcode == "domain" for instr in instructions):
        return None
    region_of: dict[HloInstruction, int] = {}
    metadata: list[Hashable] = []
    for start in instructions:
        if start.opcode == "domain" or start in region_of:
            continue
        region, entered, exited, stack = len(metadata), None, None, [start]
        region_of[start] = region
        while stack:
            instr = stack.pop()
            for neighbour in (*instr.operands, *instr.users):
                if neighbour.opcode == "domain":
                    if neighbour in instr.operands and entered is None:
                        entered = _domain_side(neighbour, "entry")
                    elif neighbour in instr.users and exited is None:
                        exited = _domain_side(neighbour, "exit")
                elif neighbour not in region_of:
                    region_of[neighbour] = region
                    stack.append(neighbour)
        metadata.append(entered if entered is not None else exited)
    return {instr: metadata[region] for instr, region in region_of.items()}


def _domain_side(domain: HloInstruction, side: str) -> str:
    """The `entry=` (user side) or `exit=` (operand side) metadata of a `domain`, normalized."""
    text = str(domain.attrs.get("domain", ""))
    for piece in split_top_level(text.strip()[1:-1]):
        key, _, value = piece.partition("=")
        if key.strip() == side:
            value = " ".join(value.split())
            try:
                return str(Sharding.parse(value))
            except AttrError:
                return value
    return ""


# Text that every instruction wrapping a computation (fusion, async op) has in its opcode: an
# unparsed computation whose source lacks all of them calls nothing that must stay whole.
_WRAPPER_WORDS = ("fusion", "async-", "-start", "-update", "-done")
_CONSTRAIN_LAYOUT = "constrain_layout"


@dataclasses.dataclass
class CombinerScope:
    """Where the combiners may work in a module, found in one walk (collective-fusion runs three
    combiners on one module; none of them adds or removes fusions or async ops).

    `computations`: every computation but fusion bodies and async-wrapped computations (those
    must keep their single op). `layout_constrained`: the collective opcodes of which some op
    (or its async start) has `constrain_layout=true`; XLA's combiners then leave the module
    alone, since such ops promise their operand layouts.
    """

    computations: list[HloComputation]
    layout_constrained: set[str]


def combiner_scope(module: HloModule) -> CombinerScope:
    """The `CombinerScope` of `module`. Computations not parsed yet are read only when their text
    could hold a wrapper or a layout constraint (`HloModule.instructions_mentioning`)."""
    wrapped, constrained = set(), set()
    for instr in module.instructions_mentioning(_WRAPPER_WORDS + (_CONSTRAIN_LAYOUT,)):
        opcode = instr.opcode
        if opcode == "fusion" or opcode.startswith("async-") or async_wrapped_opcode(opcode):
            wrapped.update(instr.called_computations)
        if _CONSTRAIN_LAYOUT in instr.attrs and attr_bool(instr.attrs, _CONSTRAIN_LAYOUT):
            constrained.add(opcode.removesuffix("-start"))
    return CombinerScope([c for c in module.computations if c not in wrapped], constrained)


# The kind of `combiner_scope` in a `PassContext`'s cache (combiners keep it valid: `HloPass.preserves`).
COMBINER_SCOPE = "combiner-scope"


def cached_combiner_scope(module: HloModule, context=None) -> CombinerScope:
    """`combiner_scope(module)`, computed once for the passes of a pipeline run that keep it valid
    (the combiners of collective-fusion: one walk for all three)."""
    if context is None:
        return combiner_scope(module)
    return context.analysis((COMBINER_SCOPE, id(module)), lambda: combiner_scope(module))


def combinable_computations(module: HloModule) -> list[HloComputation]:
    """The computations whose collectives a pass may rewrite (`CombinerScope.computations`)."""
    return combiner_scope(module).computations


def run_combiner(module: HloModule, opcode: str, key_of: Callable[[HloInstruction], Hashable | None],
                 combine: Callable[[list[HloInstruction]], object], *, threshold_bytes: int | None,
                 threshold_count: int, scope: CombinerScope | None = None) -> bool:
    """Combine the `opcode` collectives of every combinable computation of `module`.

    `key_of` is only asked about instructions of `opcode` without control dependencies.
    Where a computation has `domain` instructions, only collectives of one domain combine
    (`domain_metadata`). Computations that changed are put back in an order where definitions
    come before uses (a combined op sits where its first member's users need it). `scope` is
    `combiner_scope(module)` when the caller has it already.
    """
    scope = scope or combiner_scope(module)
    if opcode in scope.layout_constrained:
        return False

    changed = False
    for comp in scope.computations:
        if not comp.may_contain_text((opcode,)):
            continue  # left unparsed: it has no `opcode` collective
        domains = domain_metadata(comp)

        def key(instr):
            if instr.opcode != opcode or instr.control_predecessors or instr.control_successors:
                return None
            own = key_of(instr)
            return own if own is None or domains is None else (domains[instr], own)

        if combine_by_key(comp, key, combine, threshold_bytes=threshold_bytes, threshold_count=threshold_count):
            comp.sort_topologically()
            changed = True
    return changed


# -- rewriting -------------------------------------------------------------------------------------------

def result_shapes(instr: HloInstruction) -> list[Shape]:
    """One result shape per operand of a synchronous collective (its tuple elements, or its shape)."""
    return list(instr.shape.tuple_shapes) if instr.shape.is_tuple else [instr.shape]


def flat_vector(dtype: str, size: int) -> Shape:
    """The 1-D shape of a flat buffer (row-major)."""
    return Shape.array(dtype, (size,), layout=(0,))


def flat_buffer(operands: Sequence[HloInstruction], add: Callable[..., HloInstruction]) -> HloInstruction:
    """`operands` (of one element type) flattened to 1-D and concatenated into one buffer.

    `add(opcode, operands, shape=None, *, role=None, **attrs)` creates each instruction
    (`role` names it where the opcode alone would not)."""
    dtype = operands[0].shape.dtype
    pieces = [op if op.shape.rank == 1 else add("reshape", [op], flat_vector(dtype, op.shape.element_count),
                                                 role="flat")
              for op in operands]
    return pieces[0] if len(pieces) == 1 else add("concatenate", pieces, dimensions=(0,))


def split_flat_buffer(buffer: HloInstruction, shapes: Sequence[Shape],
                      add: Callable[..., HloInstruction]) -> list[HloInstruction]:
    """The pieces of a flat buffer (the inverse of `flat_buffer`), reshaped to `shapes`; the
    buffer may be longer than they need (padding at its end)."""
    pieces, offset = [], 0
    for shape in shapes:
        count = shape.element_count
        piece = buffer
        if count != buffer.shape.dims[0]:
            piece = add("slice", [buffer], slice=SliceSpec(((offset, offset + count, 1),)))
        pieces.append(piece if shape.rank == 1 else add("reshape", [piece], shape))
        offset += count
    return pieces


def swap_permutation(rank: int, a: int, b: int) -> tuple[int, ...]:
    """The permutation of `range(rank)` that swaps `a` and `b` (its own inverse)."""
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    return tuple(perm)


def permuted_shape(shape: Shape, perm: Sequence[int]) -> Shape:
    """The shape of `transpose(x), dimensions=perm` that keeps `x`'s bytes where they are (a
    layout-preserving transpose, which XLA turns into a bitcast), as XLA's PermuteDimensions."""
    dims = [shape.dims[p] for p in perm]
    dynamic = [shape.is_dynamic_dim(p) for p in perm]
    layout = None
    if shape.layout is not None:
        position = {old: new for new, old in enumerate(perm)}
        layout = Layout((position[d] for d in shape.layout.minor_to_major), shape.layout.extra)
    return Shape(shape.dtype, dims, dynamic, layout)


def leaf_shardings(instr: HloInstruction) -> list[Sharding] | None:
    """The sharding of each result element of `instr` (a single sharding on a tuple applies
    to every element), None when it has no sharding."""
    sharding = instr.attrs.get("sharding")
    if not isinstance(sharding, Sharding):
        return None
    count = len(instr.shape.tuple_shapes) if instr.shape.is_tuple else 1
    if sharding.kind == "tuple":
        return list(sharding.elements) if len(sharding.elements) == count else None
    return [sharding] * count


def combined_sharding(members: Sequence[HloInstruction]) -> Sharding | None:
    """The tuple sharding of a combined op, as XLA's CreateTupleSharding: each element keeps
    its member's sharding, replicated where a member has none; None when no member has one."""
    per_member = [leaf_shardings(m) for m in members]
    if all(s is None for s in per_member):
        return None
    elements = []
    for member, shardings in zip(members, per_member):
        elements += shardings or [Sharding.replicated()] * member.operand_count
    return Sharding.tuple_of(elements)


def merged_frontend_attributes(members: Sequence[HloInstruction]) -> FrontendAttributes | None:
    """The members' frontend attributes in one, as XLA merges them: a value all members that
    have the key agree on as it is, differing values sorted and comma-joined
    (`color="blue,red"`); None when no member has any."""
    values: dict[str, list[str]] = {}
    for member in members:
        attrs = member.attrs.get("frontend_attributes")
        for key, value in (attrs.items if isinstance(attrs, FrontendAttributes) else ()):
            values.setdefault(key, []).append(value)
    if not values:
        return None
    return FrontendAttributes(tuple((key, ",".join(sorted(set(vals)))) for key, vals in values.items()))


def merged_metadata(members: Sequence[HloInstruction]) -> Metadata | None:
    """The first member's metadata with every member's `op_name` in it, as XLA merges them:
    the common prefix up to a `/` once, then the rest of each name, `:`-joined in parentheses
    (`model/layer/ag_0` and `model/layer/ag_1` give `model/layer/(ag_0:ag_1)`)."""
    first = members[0].attrs.get("metadata")
    names = [m.attrs["metadata"].get("op_name") for m in members if isinstance(m.attrs.get("metadata"), Metadata)]
    names = list(dict.fromkeys(name for name in names if name))
    if not isinstance(first, Metadata) or len(names) < 2:
        return first
    prefix = os.path.commonprefix(names)
    prefix = prefix[:prefix.rfind("/") + 1]
    return first.replace(op_name=f"{prefix}({':'.join(name[len(prefix):] for name in names)})")


def combined_attributes(members: Sequence[HloInstruction], dimension: int | None) -> dict:
    """The attributes of the op that replaces `members`: the first member's communication
    attributes, `dimension` as gather/scatter dimension, the tuple of the members' shardings,
    their merged frontend attributes and metadata, and the backend config when all have the
    same one, in XLA's printing order. Anything else (e.g. statistics) is dropped."""
    first = members[0]
    attrs = {key: value for key, value in first.attrs.items() if key in _COMMUNICATION_ATTRS}
    if dimension is not None:
        attrs["dimensions"] = (dimension,)
    sharding = combined_sharding(members)
    if sharding is not None:
        attrs["sharding"] = sharding
    frontend = merged_frontend_attributes(members)
    if frontend is not None:
        attrs["frontend_attributes"] = frontend
    metadata = merged_metadata(members)
    if metadata is not None:
        attrs["metadata"] = metadata
    config = first.attrs.get("backend_config")
    if config is not None and all(_same_attr("backend_config", config, m.attrs.get("backend_config"))
                                  for m in members):
        attrs["backend_config"] = config
    return attrs


def _same_attr(key: str, a, b) -> bool:
    return b is not None and format_value(key, a) == format_value(key, b)


def replace_with_elements(old: HloInstruction, elements: Sequence[HloInstruction],
                          unused: list[HloInstruction] | None = None) -> HloInstruction | None:
    """Make every use of `old` use `elements` instead, and remove `old`.

    An array-shaped `old` has one element, which takes its place. For a tuple-shaped `old`,
    `get-tuple-element` users are replaced by the element they read; any other use (and the
    root) gets a new `tuple` of the elements. Control successors of `old` wait for the
    elements instead; its control predecessors are the caller's to place (they belong before
    whatever computes the elements). Returns the instruction that took `old`'s place: the
    element, the new tuple, or None when only `get-tuple-element`s used it. With `unused`,
    `old` and its replaced `get-tuple-element`s are appended there instead of removed, for the
    caller to remove many at once (`HloComputation.remove_instructions`).
    """
    comp = old.parent
    doomed = []
    replacement = None
    if not old.shape.is_tuple:
        replacement = elements[0]
        old.replace_all_uses_with(replacement)
    else:
        for user in list(old.users):
            if user.opcode == "get-tuple-element":
                element = elements[int(user.attrs["index"])]
                user.replace_all_uses_with(element)
                for pred in user.control_predecessors:
                    element.add_control_predecessor(pred)
                _move_control_successors(user, [element])
                user.set_operands(())
                doomed.append(user)
        if old.users or old.is_root:
            replacement = comp.add_instruction("tuple", elements, old.shape, after=elements[-1])
            old.replace_all_uses_with(replacement)
    _move_control_successors(old, elements)
    doomed.append(old)
    if unused is None:
        comp.remove_instructions(doomed)
    else:
        unused.extend(doomed)
    return replacement


def _move_control_successors(old: HloInstruction, new: Sequence[HloInstruction]) -> None:
    """Make whatever had to wait for `old` wait for all of `new` instead."""
    for instr in old.control_successors:
        kept = tuple(p for p in instr.control_predecessors if p is not old)
        instr.attrs["control-predecessors"] = kept + tuple(n for n in new if n not in kept)


def combine_collectives(members: Sequence[HloInstruction], dimension: int | None = None) -> HloInstruction:
    """Replace `members` (collectives of one opcode and one key, none depending on another)
    by one collective of all their operands, in order, and return it.

    Its shape is the tuple of the members' result elements; each member's uses read the
    matching `get-tuple-element`s (`replace_with_elements`). For all-gather and
    reduce-scatter, `dimension` is the combined op's gather/scatter dimension: an operand of
    a member that works on another dimension `d` is transposed (swapping `d` and
    `dimension`) on the way in and its result transposed back, as XLA's combiners do with
    bitcasts. The combined op waits for every member's control predecessors and keeps the
    first member's metadata; a member's sharding and metadata stay on its replacement.
    """
    comp = members[0].parent
    position = {instr: i for i, instr in enumerate(comp.instructions)}
    anchor = max(members, key=position.__getitem__)
    created = []

    def add(opcode, operands, shape, **kwargs):
        nonlocal anchor
        anchor = comp.add_instruction(opcode, operands, shape, after=anchor, **kwargs)
        created.append(anchor)
        return anchor

    operands, shapes, back_permutations, unused = [], [], [], []
    for member in members:
        for operand, result in zip(member.operands, result_shapes(member)):
            perm = None
            if dimension is not None and collective_dimension(member) != dimension:
                perm = swap_permutation(operand.shape.rank, collective_dimension(member), dimension)
                operand = add("transpose", [operand], permuted_shape(operand.shape, perm), attrs={"dimensions": perm})
                result = permuted_shape(result, perm)
            operands.append(operand)
            shapes.append(result)
            back_permutations.append(perm)

    combined = add(members[0].opcode, operands, Shape.tuple(shapes), attrs=combined_attributes(members, dimension))
    predecessors = [p for m in members for p in m.control_predecessors]
    if predecessors:
        combined.attrs["control-predecessors"] = tuple(dict.fromkeys(predecessors))

    index = 0
    for member in members:
        elements = []
        for _ in range(member.operand_count):
            element = add("get-tuple-element", [combined], shapes[index], attrs={"index": index})
            perm = back_permutations[index]
            if perm is not None:
                element = add("transpose", [element], permuted_shape(element.shape, perm), attrs={"dimensions": perm})
            elements.append(element)
            index += 1
        own_attrs = {key: member.attrs[key] for key in ("sharding", "metadata") if key in member.attrs}
        replacement = replace_with_elements(member, elements, unused)
        if replacement is not None and own_attrs:
            replacement.attrs.update(own_attrs)
    unread = {}
    for instr in reversed(created):  # elements of tuple members that nothing reads (users first)
        if (all(user in unread for user in instr.users) and not instr.is_root and instr is not combined
                and not instr.control_successors):
            unread[instr] = None
    comp.remove_instructions([*unused, *unread])  # one pass over the instruction list
    return combined


def combine_all_reduces_flat(members: Sequence[HloInstruction]) -> HloInstruction:
    """Replace all-reduces `members` (of one key, none depending on another) by one all-reduce
    of a flat buffer, and return it: every operand flattened and concatenated, the sums sliced
    apart and reshaped back (what TPU runtimes do with fused gradients)::

        a = f32[8,4] all-reduce(x), ...
        b = f32[4] all-reduce(y), ...
                                  =>
        all-reduce.flat = f32[32]{0} reshape(x)
        all-reduce.concatenate = f32[36]{0} concatenate(all-reduce.flat, y), dimensions={0}
        all-reduce = f32[36]{0} all-reduce(all-reduce.concatenate), ...
        all-reduce.slice = f32[32]{0} slice(all-reduce), slice={[0:32]}
        all-reduce.reshape = f32[8,4] reshape(all-reduce.slice)
        all-reduce.slice.1 = f32[4]{0} slice(all-reduce), slice={[32:36]}

    The same sums as the members' (XLA's CPU runtime may add an element's contributions in
    another order in a longer buffer: the last bit may differ). It is the form XLA takes where
    it refuses a tuple-shaped all-reduce: inside a Shardy `shard_map` body before XLA's
    optimizations (jaxlib 0.10.2: "Sharding is tuple-shaped but validation shape is not").
    The flat op keeps a sharding only when every member has the same one.
    """
    tupled = combine_collectives(members)
    comp = tupled.parent

    def add(opcode, operands, shape=None, *, role=None, **attrs):
        return comp.add_instruction(opcode, operands, shape, name=f"{tupled.name}.{role or opcode}", attrs=attrs,
                                    before=tupled)

    buffer = flat_buffer(tupled.operands, add)
    attrs = {key: value for key, value in tupled.attrs.items() if key != "sharding"}
    shardings = leaf_shardings(tupled)
    if shardings and len(set(map(str, shardings))) == 1:
        attrs["sharding"] = shardings[0]
    flat = comp.add_instruction("all-reduce", [buffer], buffer.shape, attrs=attrs, before=tupled)
    name = tupled.name
    replace_with_elements(tupled, split_flat_buffer(flat, result_shapes(tupled), add))
    flat.rename(name)
    return flat


SHARDY_BODY_PREFIX = "xla.sdy.manual_computation_body"


def in_shardy_body(instr: HloInstruction) -> bool:
    """Whether `instr` runs inside the body of a Shardy `shard_map` (`xla.sdy.manual_computation_body*`),
    directly or in a computation that body calls (a `while` body of a `lax.scan`, a `conditional`
    branch, a `call`): a per-device computation inside a module XLA has yet to partition, where
    XLA of jaxlib 0.10.2 refuses tuple-shaped all-reduces and reduce-scatters and aborts on
    tuple-shaped all-gathers when it compiles the module."""
    comp = instr.parent
    return comp.name.startswith(SHARDY_BODY_PREFIX) or comp in shardy_computations(comp.parent)


_shardy_computations: "weakref.WeakKeyDictionary[HloModule, tuple[tuple, frozenset]]" = weakref.WeakKeyDictionary()


def shardy_computations(module: HloModule) -> frozenset:
    """The Shardy `shard_map` bodies of `module` and every computation they call, transitively
    (cached until the module's computations change)."""
    computations = tuple(module.computations)
    cached = _shardy_computations.get(module)
    if cached is not None and cached[0] == computations:
        return cached[1]
    inside, stack = set(), [c for c in computations if c.name.startswith(SHARDY_BODY_PREFIX)]
    while stack:
        comp = stack.pop()
        if comp in inside:
            continue
        inside.add(comp)
        stack.extend(callee for instr in comp.instructions for callee in instr.called_computations
                     if instr.opcode != "fusion")
    result = frozenset(inside)
    _shardy_computations[module] = (computations, result)
    return result


def tuple_combinable_key(instr: HloInstruction, *, by_dimension: bool = True) -> tuple | None:
    """`collective_key` for collectives whose combined form is tuple-shaped (all-gather,
    reduce-scatter): None in a Shardy body, where XLA cannot compile that form (`in_shardy_body`)."""
    return None if in_shardy_body(instr) else collective_key(instr, by_dimension=by_dimension)


def most_frequent_dimension(members: Iterable[HloInstruction]) -> int:
    """The gather/scatter dimension most operands of `members` use (the smallest on a tie), as
    XLA picks the dimension of a combined op (XLA counts members; a tuple-shaped member
    counts once per operand here); 0 when some operand has too few dimensions."""
    members = list(members)
    counts = Counter()
    for member in members:
        counts[collective_dimension(member)] += member.operand_count
    best = min(counts, key=lambda d: (-counts[d], d))
    min_rank = min(operand.shape.rank for member in members for operand in member.operands)
    return best if best < min_rank else 0


def combine_along_most_frequent_dimension(members: Sequence[HloInstruction]) -> HloInstruction:
    """Combine all-gathers or reduce-scatters along the dimension most of their operands use,
    transposing the others there and back (`combine_collectives`)."""
    return combine_collectives(members, dimension=most_frequent_dimension(members))
