"""The scaffolding every rewrite of an all-reduce into other collectives shares: which
all-reduces may be rewritten (`decomposable_all_reduces`), how new collectives name their
participants (`Addressing`), the builder that adds the replacement next to the all-reduce and
puts it in its place (`AllReduceReplacementBuilder`), and the shard reduction
reduce-scatter -> [all-reduce] -> all-gather (`replace_by_shard_reduction`) that
`all-reduce-decomposer` and `all-reduce-2d` build.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from hlo_tools import HloInstruction, HloModule, Literal, PaddingConfig, ReplicaGroups, Shape, SliceSpec
from hlo_tools.ir.attributes import attr_bool
from hlo_tools.ir.shape import COMPLEX_DTYPES

from ..analysis.collectives import (combinable_computations, flat_buffer, flat_vector, reducer_opcode, result_shapes,
                                    split_flat_buffer)
from ..analysis.replica_groups import GroupMode, group_mode
from .channel_ids import ChannelIds

# Attributes that describe where an instruction came from; every derived instruction keeps them.
_PROVENANCE_ATTRS = ("metadata", "frontend_attributes")
# The padding value's literal where it is not `0` (padding is only ever reduced with padding).
_ZERO = {"pred": "false", **{dtype: "(0, 0)" for dtype in COMPLEX_DTYPES}}


@dataclasses.dataclass(frozen=True)
class Addressing:
    """How a new collective names its participants: the groups and the mode they are read in."""

    replica_groups: ReplicaGroups | None
    mode: GroupMode

    @staticmethod
    def of(instr: HloInstruction) -> "Addressing":
        """The addressing of an existing collective, groups exactly as written."""
        return Addressing(instr.attrs.get("replica_groups"), group_mode(instr))

    def attrs(self, opcode: str, channel_ids: ChannelIds) -> dict:
        """The attributes of a new `opcode` (all-reduce, or reduce-scatter/all-gather along
        dimension 0) that name its participants, with a fresh channel id, in XLA's printing order."""
        attrs = {}
        if self.mode is not GroupMode.CROSS_REPLICA:
            attrs["channel_id"] = channel_ids.fresh()
        if self.replica_groups is not None:
            attrs["replica_groups"] = self.replica_groups
        global_ids = {"use_global_device_ids": True} if self.mode is GroupMode.FLATTENED_ID else {}
        if opcode == "all-gather":
            return {**attrs, "dimensions": (0,), **global_ids}
        if opcode == "reduce-scatter":
            return {**attrs, **global_ids, "dimensions": (0,)}
        return {**attrs, **global_ids}


def decomposable_all_reduces(module: HloModule, min_bytes: int) -> list[HloInstruction]:
    """The synchronous all-reduces a shard-wise rewrite may replace, in every computation but
    fusion bodies and async-wrapped ones (`all-reduce-decomposer`'s docstring says which are
    left alone)."""
    controlled = {pred for instr in module.instructions() for pred in instr.control_predecessors}
    found = []
    for comp in combinable_computations(module):
        for instr in comp.instructions:
            if (instr.opcode == "all-reduce" and instr.shape.byte_size >= min_bytes
                    and not instr.control_predecessors and instr not in controlled
                    and not attr_bool(instr.attrs, "constrain_layout")
                    and all(op.shape.is_array and not op.shape.is_dynamic and op.shape.element_count
                            for op in instr.operands)
                    and len({op.shape.dtype for op in instr.operands}) == 1):
                found.append(instr)
    return found


class AllReduceReplacementBuilder:
    """Adds the instructions that replace one all-reduce, then puts them in its place.

    The scaffolding every rewrite of an all-reduce into other collectives shares (the shard
    reduction here, the tree of `all-reduce-2d{failed=...}`, the rings of `all-reduce-rings`), so
    that each spells out only its algorithm: new instructions go before the all-reduce, are named
    `<all-reduce>.<role>` and keep its metadata and frontend attributes; the operands become one
    flat buffer (zero-padded where the algorithm needs it), and the reduced buffer is split back
    into the all-reduce's shape and takes its place, with its sharding. For rewrites into
    collective-permutes: the device's id and values looked up by it in constant tables, and
    permutes that pair replica ids (no channel_id) or partition ids (a fresh channel_id each).
    """

    def __init__(self, all_reduce: HloInstruction, channel_ids: ChannelIds, *, by_replica: bool | None = None):
        self.all_reduce = all_reduce
        self.channel_ids = channel_ids
        # What the permutes pair and `device_id` reads: replica ids for a cross-replica
        # all-reduce unless told otherwise, partition ids where not.
        self.by_replica = group_mode(all_reduce) is GroupMode.CROSS_REPLICA if by_replica is None else by_replica
        self.provenance = {key: value for key, value in all_reduce.attrs.items() if key in _PROVENANCE_ATTRS}

    @functools.cached_property
    def reducer(self) -> str | None:
        """The one elementwise opcode the all-reduce reduces with (None when it is not one)."""
        return reducer_opcode(self.all_reduce.attrs["to_apply"])

    def add(self, opcode: str, operands, shape: Shape | None = None, *, role: str | None = None, literal=None,
            **attrs) -> HloInstruction:
        return self.all_reduce.parent.add_instruction(
            opcode, operands, shape, name=f"{self.all_reduce.name}.{role or opcode}",
            attrs={**attrs, **self.provenance}, literal=literal, before=self.all_reduce)

    def flat_buffer(self) -> HloInstruction:
        """The all-reduce's operands flattened and concatenated into one vector."""
        return flat_buffer(self.all_reduce.operands, self.add)

    def pad(self, vector: HloInstruction, low: int, high: int) -> HloInstruction:
        """`vector` with `low` zeros before it and `high` after."""
        scalar = Shape.array(vector.shape.dtype, ())
        zero = self.add("constant", (), scalar, role="zero",
                        literal=Literal.parse(scalar, _ZERO.get(scalar.dtype, "0")))
        return self.add("pad", [vector, zero], padding=PaddingConfig(((low, high, 0),)))

    def slice(self, vector: HloInstruction, start: int, size: int, role: str) -> HloInstruction:
        return self.add("slice", [vector], flat_vector(vector.shape.dtype, size), role=role,
                        slice=SliceSpec(((start, start + size, 1),)))

    def concatenate(self, pieces: list[HloInstruction], role: str) -> HloInstruction:
        return pieces[0] if len(pieces) == 1 else self.add("concatenate", pieces, role=role, dimensions=(0,))

    def device_id(self) -> HloInstruction:
        """This device's replica-id or partition-id (as `by_replica` says), as s32."""
        opcode = "replica-id" if self.by_replica else "partition-id"
        return self.add("convert", [self.add(opcode, [], Shape.array("u32", ()))], Shape.array("s32", ()),
                        role="device")

    def lookup(self, device: HloInstruction, values, role: str, *, table: str = "table",
               result: str | None = None) -> HloInstruction:
        """`values[device]` (s32), read from a constant table: instructions `<role>.<table>`,
        `<role>.lookup` and the result, `<role>.<result>` (`<role>` when no `result`)."""
        literal = Literal.from_numpy(np.array(values, np.int32))
        constants = self.add("constant", [], literal.shape, role=f"{role}.{table}", literal=literal)
        entry = self.add("dynamic-slice", [constants, device], flat_vector("s32", 1), role=f"{role}.lookup",
                         dynamic_slice_sizes=(1,))
        return self.add("reshape", [entry], Shape.array("s32", ()), role=role if result is None else f"{role}.{result}")

    def permute(self, value: HloInstruction, pairs: tuple[tuple[int, int], ...], role: str) -> HloInstruction:
        """A collective-permute of `value` over (source, target) `pairs` of replica or partition ids."""
        channel = {} if self.by_replica else {"channel_id": self.channel_ids.fresh()}
        return self.add("collective-permute", [value], value.shape, role=role, **channel, source_target_pairs=pairs)

    def put_in_place(self, reduced: HloInstruction) -> HloInstruction:
        """Split the reduced flat buffer into the all-reduce's shape, replace the all-reduce by it
        (its sharding goes along) and remove it; return the replacement."""
        all_reduce = self.all_reduce
        results = split_flat_buffer(reduced, result_shapes(all_reduce), self.add)
        replacement = self.add("tuple", results) if all_reduce.shape.is_tuple else results[0]
        if "sharding" in all_reduce.attrs:
            replacement.attrs["sharding"] = all_reduce.attrs["sharding"]
        all_reduce.replace_all_uses_with(replacement)
        all_reduce.parent.remove_instruction(all_reduce)
        return replacement


def replace_by_shard_reduction(all_reduce: HloInstruction, shard_count: int, scatter: Addressing,
                               middle: Addressing | None, channel_ids: ChannelIds) -> HloInstruction:
    """Replace `all_reduce` by reduce-scatter -> [all-reduce] -> all-gather of one flat buffer.

    The buffer is the operands flattened, concatenated and zero-padded to a multiple of
    `shard_count`, the size of `scatter`'s groups, which the reduce-scatter and the all-gather
    use; `middle`, when given, is an all-reduce of the shard (over other groups) between them.
    Returns the instruction that took the all-reduce's place.
    """
    builder = AllReduceReplacementBuilder(all_reduce, channel_ids)
    add = builder.add
    reducer = all_reduce.attrs["to_apply"]
    dtype = all_reduce.operand(0).shape.dtype
    buffer = builder.flat_buffer()
    size = buffer.shape.dims[0]
    padded_size = -(-size // shard_count) * shard_count
    if padded_size != size:
        buffer = builder.pad(buffer, 0, padded_size - size)
    shard_shape = flat_vector(dtype, padded_size // shard_count)
    shard = add("reduce-scatter", [buffer], shard_shape, **scatter.attrs("reduce-scatter", channel_ids),
                to_apply=reducer)
    if middle is not None:
        shard = add("all-reduce", [shard], shard_shape, **middle.attrs("all-reduce", channel_ids), to_apply=reducer)
    gathered = add("all-gather", [shard], buffer.shape, **scatter.attrs("all-gather", channel_ids))
    return builder.put_in_place(gathered)
