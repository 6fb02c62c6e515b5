"""HloModule -> HLO text.

Unmodified parts are copied from the source text (byte-for-byte round trips); modified or new
parts are printed in XLA's style, following the source's choices of `%` sigils, operand shapes and
computation signatures so that edited modules read like their originals.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hlo_tools.ir import attributes as A
from hlo_tools.ir.attributes import COMPUTATION_ATTRS

if TYPE_CHECKING:  # the printer reads the IR; the IR's `to_text` calls the printer
    from hlo_tools.ir.hlo import HloComputation, HloInstruction, HloModule
    from hlo_tools.ir.shape import Shape


def print_module(module: HloModule, regenerate: bool = False) -> str:
    src = module._source
    if not regenerate and src is not None and _module_clean(module):
        return src
    style = _Style(module, regenerate)
    out = []
    if not regenerate and module._header_span is not None and not module._header_stale:
        out.append(src[:module._header_span[1]])
    else:
        out.append(_module_header(module, style))
    for comp in module.computations:
        gap = None if regenerate else module._gaps.get(comp)
        out.append(gap if gap is not None else "\n\n")
        out.append(print_computation(comp, style))
    out.append("\n" if regenerate or src is None else module._trailing)
    return "".join(out)


def _module_clean(module: HloModule) -> bool:
    if module._dirty or module._header_stale:
        return False
    return all(not c._dirty and c._span is not None for c in module.computations)


class _Style:
    """How to print regenerated parts: the source's conventions, or XLA's defaults."""

    def __init__(self, module: HloModule, regenerate: bool):
        self.sigils = module.sigils
        self.operand_shapes = module.operand_shapes
        self.regenerate = regenerate
        self.source = module._source
        self.signatures = module.signatures


def print_computation(comp: HloComputation, style: _Style) -> str:
    src = style.source
    if not style.regenerate and comp._span is not None and not comp._dirty:
        return src[comp._span[0]:comp._span[1]]
    out = []
    if not style.regenerate and comp._head_span is not None:
        out.append(src[comp._head_span[0]:comp._head_span[1]])
    else:
        out.append(_computation_head(comp, style))
    for instr in comp.instructions:
        if instr._compact and prints_compact(instr):
            continue  # its users print it
        owner = instr._owner
        if not style.regenerate and owner is not None and owner._span is not None:
            continue  # printed inside its owner's source text
        gap = None if style.regenerate else comp._gaps.get(instr)
        out.append(gap if gap is not None else "\n  ")
        out.append(_instruction_text(instr, style))
    if not style.regenerate and comp._tail_span is not None:
        out.append(src[comp._tail_span[0]:comp._tail_span[1]])
    else:
        out.append("\n}")
        if comp.execution_thread is not None:
            out.append(f", execution_thread={A.quote(comp.execution_thread)}")
    return "".join(out)


def _instruction_text(instr: HloInstruction, style: _Style) -> str:
    is_root = instr.parent is not None and instr.parent.root is instr
    span = instr._span
    if not style.regenerate and span is not None:
        was_root = instr._name_start != span[0]
        if was_root == is_root:
            return style.source[span[0]:span[1]]
        body = style.source[instr._name_start:span[1]]
        return "ROOT " + body if is_root else body
    text = print_instruction(instr, sigils=style.sigils, operand_shapes=style.operand_shapes)
    return "ROOT " + text if is_root else text


def instruction_line(instr: HloInstruction) -> str:
    """The instruction's line as its module's `to_text()` prints it, without the indent: its
    source text while unedited, else printed in the module's style; with `ROOT` for the root."""
    module = instr.parent.parent if instr.parent is not None else None
    if module is None:
        return instr.to_text()
    return _instruction_text(instr, _Style(module, regenerate=False))


def _computation_head(comp: HloComputation, style: _Style) -> str:
    pfx = "%" if style.sigils else ""
    head = ("ENTRY " if comp.is_entry else "") + pfx + comp.name
    if style.signatures and comp.root is not None:
        params = ", ".join(f"{p.name}: {p.shape.to_text(print_layout=False)}" for p in comp.parameters)
        head += f" ({params}) -> {comp.root.shape.to_text(print_layout=False)}"
    return head + " {"


def _module_header(module: HloModule, style: _Style) -> str:
    parts = [f"HloModule {module.name}"]
    for key, value in module.attrs.items():
        parts.append(f"{key}={format_value(key, value)}")
    header = ", ".join(parts)
    if module.stack_frames is not None:
        header += "\n\n" + module.stack_frames_text
    return header


def entry_computation_layout(entry: HloComputation) -> str:
    """`{(f32[8]{0}, ...)->f32[8]{0}}`: the entry signature with layouts, as XLA prints in the header."""
    params = ", ".join(str(p.shape.with_default_layout() if p.shape.layout is None and p.shape.is_array
                           else p.shape) for p in entry.parameters)
    root = entry.root.shape
    if root.is_array and root.layout is None:
        root = root.with_default_layout()
    return "{(" + params + ")->" + str(root) + "}"


def format_value(key: str, value) -> str:
    """An attribute value in XLA's syntax."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if key in A.QUOTED_ATTRS or key == "backend_config":
            return A.quote(value)
        return value
    if isinstance(value, A.Named):  # a computation
        return "%" + value.name
    if isinstance(value, tuple):
        if key in A.INT_LIST_ATTRS:
            return A.print_int_list(value)
        if key == "source_target_pairs":
            return A.print_source_target_pairs(value)
        if key in COMPUTATION_ATTRS or key in A.INSTRUCTION_LIST_ATTRS:
            return "{" + ", ".join("%" + v.name for v in value) + "}"
        if key == "operand_layout_constraints":
            return "{" + ", ".join(str(s) for s in value) + "}"
        if key == "operand_precision":
            return "{" + ",".join(value) + "}"
        return "{" + ",".join(str(v) for v in value) + "}"
    if isinstance(value, A.Raw):
        return value.text
    if key == "literal":
        return f"{value.shape} {value.text}"
    return str(value)


def print_instruction(instr: HloInstruction, *, sigils: bool = True, operand_shapes: bool = True) -> str:
    pfx = "%" if sigils else ""
    parts = [f"{pfx}{instr.name} = {instr.shape} {instr.opcode}("]
    if instr.opcode == "parameter":
        parts.append(str(instr.parameter_number))
    elif instr.opcode == "constant":
        parts.append(instr.literal.text)
    else:
        ops = []
        for i, op in enumerate(instr._operands):
            note = f"/*index={i}*/" if operand_shapes and i and i % 5 == 0 else ""
            ref = operand_reference(op)
            ops.append(f"{note}{op.shape} {pfx}{ref}" if operand_shapes else f"{pfx}{ref}")
        parts.append(", ".join(ops))
    parts.append(")")
    for key, value in instr.attrs.items():
        if isinstance(value, A.Named) and not sigils:
            parts.append(f", {key}={value.name}")
        elif not sigils and isinstance(value, tuple) and value and isinstance(value[0], A.Named):
            parts.append(f", {key}={{{', '.join(v.name for v in value)}}}")
        else:
            parts.append(f", {key}={format_value(key, value)}")
    return "".join(parts)


def prints_compact(instr: HloInstruction) -> bool:
    """Whether a get-tuple-element parsed from XLA's compact `%tuple#index` still prints that way,
    in its users, rather than on a line of its own: it must still be one that nothing else names."""
    return (instr._compact and instr.opcode == "get-tuple-element" and list(instr.attrs) == ["index"]
            and bool(instr.users) and not instr.is_root and not instr.control_successors)


def operand_reference(op: HloInstruction) -> str:
    """How a user names its operand `op` (without `%`): its name, or `tuple#index` for a compact one."""
    if op._compact and prints_compact(op):
        return f"{operand_reference(op._operands[0])}#{op.attrs['index']}"
    return op.name


def shape_text(shape: Shape) -> str:
    return shape.to_text()
