"""Serialized `HloModuleProto`s at the wire level: opcode counts without a parse, and XLA's own
module proto handed back with only the entry computation's edits applied.

The JAX plugin's hook gets a serialized `HloModuleProto`, and must return one. Printing the
whole edited module and letting XLA parse it back costs XLA's parser the whole module, fusion
bodies and all, though a pass like `collective-fusion` only edits a few instructions of the
entry. `patched_module_proto` instead copies the original proto and changes only the entry
computation's instruction list:

* unchanged instructions keep their bytes;
* instructions whose only edit was new operands keep their bytes with new `operand_ids`;
* new and otherwise edited instructions are printed into a small module (stand-in parameters
  for the instructions they use, the computations they call), which XLA parses; their protos
  are copied over with ids, operand ids, control predecessor ids and called computation ids
  renumbered to the original module's (by name);
* removed instructions are left out, and the root id follows the IR's root.

It applies only when nothing else changed: the same computations, none but the entry edited,
the header untouched, the entry's signature and parameters kept, and no schedule (whose instruction ids XLA
would find stale; a scheduled module is printed with `is_scheduled=true`, from which XLA's
parser rebuilds it). Otherwise (None) the caller prints the whole module. Field numbers are
those of xla/service/hlo.proto.
"""
from __future__ import annotations

from hlo_tools.ir.hlo import HloComputation, HloModule
from hlo_tools.ir.printer import instruction_line

# HloModuleProto / HloComputationProto / HloInstructionProto fields used here.
_MODULE_COMPUTATIONS = 3
_MODULE_ENTRY_ID = 6
_MODULE_SCHEDULE = 7
_COMPUTATION_NAME, _COMPUTATION_INSTRUCTIONS, _COMPUTATION_ID, _COMPUTATION_ROOT_ID = 1, 2, 5, 6
_INSTRUCTION_NAME, _INSTRUCTION_ID = 1, 35
_OPERAND_IDS, _CONTROL_PREDECESSOR_IDS, _CALLED_COMPUTATION_IDS = 36, 37, 38
_LENGTH_DELIMITED, _VARINT = 2, 0
_SMALL_ENTRY = "xla_passes_patch"


class _Field:
    __slots__ = ("number", "wire_type", "start", "value_start", "end", "value")

    def __init__(self, number, wire_type, start, value_start, end, value):
        self.number, self.wire_type, self.start = number, wire_type, start
        self.value_start, self.end, self.value = value_start, end, value


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, i


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(data: bytes, start: int = 0, end: int | None = None):
    """The top-level fields of the message in `data[start:end]`, in wire order."""
    i, end = start, len(data) if end is None else end
    while i < end:
        field_start = i
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, j = _varint(data, i)
            yield _Field(number, wire_type, field_start, i, j, value)
        elif wire_type == _LENGTH_DELIMITED:
            length, j = _varint(data, i)
            yield _Field(number, wire_type, field_start, j, j + length, None)
            j += length
        elif wire_type == 1:
            j = i + 8
            yield _Field(number, wire_type, field_start, i, j, None)
        elif wire_type == 5:
            j = i + 4
            yield _Field(number, wire_type, field_start, i, j, None)
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        i = j


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LENGTH_DELIMITED) + _encode_varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _encode_varint(number << 3 | _VARINT) + _encode_varint(value)


def _ints(data: bytes, field: _Field) -> list[int]:
    if field.wire_type == _VARINT:
        return [field.value]
    values, i = [], field.value_start
    while i < field.end:
        value, i = _varint(data, i)
        values.append(value)
    return values


def _instruction_summary(data: bytes, start: int, end: int) -> tuple[str, int]:
    """(name, id) of the instruction message `data[start:end]` (hot: one tight loop over its fields)."""
    name, ident, i = None, 0, start  # proto3 leaves zeros out
    while i < end:
        key = data[i]
        i += 1
        if key >= 0x80:
            key, i = _varint(data, i - 1)
        number, wire_type = key >> 3, key & 7
        if wire_type == _LENGTH_DELIMITED:
            length = data[i]
            i += 1
            if length >= 0x80:
                length, i = _varint(data, i - 1)
            if number == _INSTRUCTION_NAME:
                name = data[i:i + length].decode()
            i += length
        elif wire_type == _VARINT:
            if number == _INSTRUCTION_ID:
                ident, i = _varint(data, i)
                if name is not None:
                    return name, ident
            else:
                while data[i] >= 0x80:
                    i += 1
                i += 1
        else:
            i += 8 if wire_type == 1 else 4
    return name, ident


def _rewrite_instruction(data: bytes, start: int, end: int, ident: int | None, id_lists: dict) -> bytes:
    """The instruction message `data[start:end]` with its id (unless None) and the id lists of
    `id_lists` (field number -> new values; an empty list drops the field) replaced."""
    out, written = [], set()
    for field in _fields(data, start, end):
        if field.number == _INSTRUCTION_ID and ident is not None:
            out.append(_int_field(_INSTRUCTION_ID, ident))
        elif field.number in id_lists:
            if field.number not in written:
                written.add(field.number)
                values = id_lists[field.number]
                if values:
                    out.append(_length_delimited(field.number, b"".join(map(_encode_varint, values))))
        else:
            out.append(data[field.start:field.end])
    for number, values in id_lists.items():
        if number not in written and values:
            out.append(_length_delimited(number, b"".join(map(_encode_varint, values))))
    return b"".join(out)


def _applicable(module: HloModule) -> bool:
    if module.computations_edited or module.header_edited or module.source_text is None:
        return False
    entry = module.entry
    if entry is None or not entry.parsed or entry.head_source_span is None or entry.root.shape_was_set:
        return False
    return all(comp is entry or (not comp.edited and comp.source_span is not None) for comp in module.computations)


def _operands_only(instr) -> bool:
    return instr.source_span is None and instr.edited_operands_only


def patched_module_proto(original: bytes, module: HloModule, text_to_proto) -> bytes | None:
    """`original` (the proto `module` was printed from) with the entry's edits of `module`
    applied; None when more than the entry's instructions changed (print the whole module).
    `text_to_proto` is `xla_bridge.text_to_proto` (kept out of this module's imports)."""
    if not _applicable(module):
        return None
    entry = module.entry
    regenerated = [i for i in entry.instructions if i.source_span is None and not _operands_only(i)]
    if any(instr.opcode == "parameter" for instr in regenerated):
        return None  # the small module's parameters stand in for other instructions
    callees = _callees(regenerated)
    wanted = {entry.name.encode()} | {comp.name.encode() for comp in callees}
    top = list(_fields(original))
    if any(f.number == _MODULE_SCHEDULE for f in top):
        return None  # a schedule lists instruction ids: printing the module rebuilds it
    computation_ids, entry_field = {}, None
    entry_id = next((f.value for f in top if f.number == _MODULE_ENTRY_ID), 0)  # proto3 leaves zeros out
    for field in top:
        if field.number != _MODULE_COMPUTATIONS:
            continue
        head = next(_fields(original, field.value_start, field.end))  # its name, which XLA writes first
        name = original[head.value_start:head.end]
        if head.number != _COMPUTATION_NAME or name not in wanted:
            continue
        if name == entry.name.encode():
            entry_field = field
            continue
        computation_ids[name.decode()] = next((sub.value for sub in _fields(original, field.value_start, field.end)
                                               if sub.number == _COMPUTATION_ID), 0)
    if entry_field is None or len(computation_ids) != len(wanted) - 1:
        return None
    # The entry's fields; its instructions in the original proto: name -> (id, start, end).
    entry_fields = list(_fields(original, entry_field.value_start, entry_field.end))
    if next((f.value for f in entry_fields if f.number == _COMPUTATION_ID), 0) != entry_id:
        return None
    computation_ids[entry.name] = entry_id
    originals = {}
    for field in entry_fields:
        if field.number == _COMPUTATION_INSTRUCTIONS:
            name, ident = _instruction_summary(original, field.value_start, field.end)
            originals[name] = (ident, field.value_start, field.end)
    if any(instr.source_span is not None and instr.name not in originals for instr in entry.instructions):
        return None

    new_ids = {name: ident for name, (ident, _, _) in originals.items()}
    next_local = max((ident & 0xFFFFFFFF for ident in new_ids.values()), default=0) + 1
    for instr in regenerated:
        if instr.name not in new_ids:
            new_ids[instr.name] = (entry_id << 32) | next_local
            next_local += 1

    small_data, small_instructions, small_names = (_small_module_proto(module, regenerated, callees, text_to_proto)
                                                   if regenerated else (b"", {}, {}))

    instructions = []
    for instr in entry.instructions:
        if instr in small_instructions:
            start, end = small_instructions[instr]
            lists = {}
            for field in _fields(small_data, start, end):
                if field.number in (_OPERAND_IDS, _CONTROL_PREDECESSOR_IDS):
                    lists.setdefault(field.number, []).extend(new_ids[small_names["i", v]]
                                                              for v in _ints(small_data, field))
                elif field.number == _CALLED_COMPUTATION_IDS:
                    lists.setdefault(field.number, []).extend(computation_ids[small_names["c", v]]
                                                              for v in _ints(small_data, field))
            message = _rewrite_instruction(small_data, start, end, new_ids[instr.name], lists)
        else:
            _, start, end = originals[instr.name]
            if _operands_only(instr):
                lists = {_OPERAND_IDS: [new_ids[o.name] for o in instr.operands],
                         _CONTROL_PREDECESSOR_IDS: [new_ids[p.name] for p in instr.control_predecessors]}
                message = _rewrite_instruction(original, start, end, None, lists)
            else:
                message = original[start:end]
        instructions.append(_length_delimited(_COMPUTATION_INSTRUCTIONS, message))

    parts, placed = [], False
    for field in entry_fields:
        if field.number == _COMPUTATION_INSTRUCTIONS:
            if not placed:
                parts.extend(instructions)
                placed = True
        elif field.number != _COMPUTATION_ROOT_ID:
            parts.append(original[field.start:field.end])
    parts.append(_int_field(_COMPUTATION_ROOT_ID, new_ids[entry.root.name]))  # fields may come in any order
    new_entry = _length_delimited(_MODULE_COMPUTATIONS, b"".join(parts))
    return original[:entry_field.start] + new_entry + original[entry_field.end:]


def _callees(instrs: list) -> list[HloComputation]:
    """The computations `instrs` call, transitively (parsing those not parsed yet)."""
    callees, stack = [], [c for instr in instrs for c in instr.called_computations]
    while stack:
        comp = stack.pop()
        if comp not in callees:
            callees.append(comp)
            stack.extend(c for i in comp.instructions for c in i.called_computations)
    return callees


def _small_module_proto(module: HloModule, regenerated: list, callees: list, text_to_proto):
    """XLA's protos of `regenerated` (new or edited entry instructions): a module holding them,
    parameters standing in for the other instructions they use, and the computations they call.

    Returns (proto bytes, instr -> (start, end) of its message, ("i"|"c", small id) -> name).
    """
    chosen = set(regenerated)
    used = []
    for instr in regenerated:
        for op in (*instr.operands, *instr.control_predecessors):
            if op not in chosen and op not in used:
                used.append(op)
    order = [c for c in module.computations if c in callees]
    source = module.source_text
    lines = [f"HloModule {_SMALL_ENTRY}", "", module.stack_frames_text] if module.stack_frames_text else \
        [f"HloModule {_SMALL_ENTRY}"]
    for comp in order:
        lines.append("")
        start, end = comp.source_span
        lines.append(source[start:end])
    lines += ["", f"ENTRY %{_SMALL_ENTRY} {{"]
    sigil = "%" if module.sigils else ""
    for number, op in enumerate(used):
        lines.append(f"  {sigil}{op.name} = {op.shape.to_text()} parameter({number})")
    root = module.entry.root
    for instr in regenerated:
        lines.append("  " + instruction_line(instr))  # with `ROOT` when it is the root
    if root not in chosen:
        lines.append(f"  ROOT {sigil}{_SMALL_ENTRY}.root = () tuple()")
    lines += ["}", ""]
    data = text_to_proto("\n".join(lines))

    instructions, names = {}, {}
    by_name = {instr.name: instr for instr in regenerated}
    for field in _fields(data):
        if field.number != _MODULE_COMPUTATIONS:
            continue
        comp_name, comp_id, inner = None, 0, []
        for sub in _fields(data, field.value_start, field.end):
            if sub.number == _COMPUTATION_NAME:
                comp_name = data[sub.value_start:sub.end].decode()
            elif sub.number == _COMPUTATION_ID:
                comp_id = sub.value
            elif sub.number == _COMPUTATION_INSTRUCTIONS:
                inner.append((sub.value_start, sub.end))
        names["c", comp_id] = comp_name
        if comp_name == _SMALL_ENTRY:
            for start, end in inner:
                name, ident = _instruction_summary(data, start, end)
                names["i", ident] = name
                if name in by_name:
                    instructions[by_name[name]] = (start, end)
    return data, instructions, names


# An HloInstructionProto's opcode is its field 2, a string: on the wire the tag byte 0x12, the
# length as a varint, then the name. Searching the serialized module for those bytes counts every
# instruction of the opcode (and, rarely, another field that happens to hold the same bytes), so
# the count is never too low: enough to prove that a module has no instruction a pass acts on.
_OPCODE_FIELD_TAG = b"\x12"


def opcode_count(module_proto: bytes, opcode: str) -> int:
    """At least the number of `opcode` instructions in a serialized `HloModuleProto`."""
    return module_proto.count(_OPCODE_FIELD_TAG + _encode_varint(len(opcode)) + opcode.encode())


def module_name(module_proto: bytes) -> str:
    """The module's name (HloModuleProto field 1, which XLA serializes first), for log lines."""
    if len(module_proto) < 2 or module_proto[0] != 0x0A or module_proto[1] >= 0x80:
        return "<unnamed>"
    return module_proto[2:2 + module_proto[1]].decode("utf-8", "replace")
