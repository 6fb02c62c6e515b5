"""The HLO IR: modules, computations and instructions, with an editing API that keeps use-def
lists consistent and a printer that reproduces unmodified source text byte for byte.

Reading:  `module.entry.root`, `comp.instructions`, `instr.operands`, `instr.users`, `instr.attrs`,
          `module.callers_of(comp)` (an index that edits keep current).
Editing:  `comp.add_instruction(...)`, `instr.replace_all_uses_with(other)`, `instr.set_operand(i, x)`,
          `instr.attrs[name] = value`, `comp.remove_instruction(instr)`, `comp.remove_instructions(batch)`,
          `comp.remove_dead_code()`, `module.clone_computation(comp)`. Every edit marks what it touched;
          printing regenerates exactly those parts in XLA's style and copies everything else from the
          source text.
Undoing:  `saved = module.checkpoint()` ... `saved.restore()` puts back every computation and
          instruction as it was, the same objects, without printing or parsing anything;
          `module.replace_contents(other)` makes a module hold another (a reparsed text).

A module parsed with `parse_module(text, lazy_bodies=True)` keeps the bodies of its non-entry
computations as source text until something reads them (`comp.instructions`, `comp.root`, ...),
which parses them then; `comp.parsed` and `comp.unparsed_text` tell without parsing.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterable

from hlo_tools.ir.attributes import COMPUTATION_ATTRS, CONTROL_PREDECESSORS, Named, Raw
from hlo_tools.ir.printer import entry_computation_layout, print_instruction, print_module
from hlo_tools.ir.shape import Shape

__all__ = ["HloInstruction", "HloComputation", "HloModule", "ModuleCheckpoint", "COMPUTATION_ATTRS",
           "CONTROL_PREDECESSORS", "defined_names"]

# Lines of a computation's body (which starts with a line break) that define an instruction:
# `[ROOT] [%]name =`. The leading `\n` lets the regex engine jump from line to line.
_DEFINED_NAME = re.compile(r"\n[ \t]*(?:ROOT[ \t]+)?%?([A-Za-z_][\w.\-]*)[ \t]*=")


def defined_names(body_text: str) -> list[str]:
    """The names of the instructions a computation body's text defines, one per line (nested
    anonymous instructions get fresh names when parsed, so they claim none)."""
    return _DEFINED_NAME.findall(body_text)


class _AttrDict(dict):
    """An instruction's attributes: every write marks the instruction modified (and keeps its
    computation's index of control successors current)."""

    __slots__ = ("_instr",)

    def __init__(self, instr, items=()):
        super().__init__(items)
        self._instr = instr

    def __setitem__(self, key, value):
        if key == CONTROL_PREDECESSORS:
            old = self.get(key, ())
            super().__setitem__(key, value)
            self._instr._control_predecessors_changed(old)
        elif key in COMPUTATION_ATTRS:
            with self._instr._callees_changing():
                super().__setitem__(key, value)
        else:
            super().__setitem__(key, value)
        self._instr._touch()

    def __delitem__(self, key):
        old = self.get(CONTROL_PREDECESSORS, ())
        with self._instr._callees_changing() if key in COMPUTATION_ATTRS else contextlib.nullcontext():
            super().__delitem__(key)
        if key == CONTROL_PREDECESSORS:
            self._instr._control_predecessors_changed(old)
        self._instr._touch()

    def pop(self, key, *default):
        had = key in self
        old = self.get(CONTROL_PREDECESSORS, ())
        with self._instr._callees_changing() if key in COMPUTATION_ATTRS else contextlib.nullcontext():
            value = super().pop(key, *default)
        if had:
            if key == CONTROL_PREDECESSORS:
                self._instr._control_predecessors_changed(old)
            self._instr._touch()
        return value

    def update(self, *args, **kwargs):
        old = self.get(CONTROL_PREDECESSORS, ())
        with self._instr._callees_changing():
            super().update(*args, **kwargs)
        if self.get(CONTROL_PREDECESSORS, ()) is not old:
            self._instr._control_predecessors_changed(old)
        self._instr._touch()

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


def _index_calls(index: dict, instr) -> None:
    """Enter `instr` in a callers index (computation -> {calling instruction: None}) for each callee."""
    for callee in instr.called_computations:
        index.setdefault(callee, {})[instr] = None


def _unindex_calls(index: dict, instr) -> None:
    for callee in instr.called_computations:
        calls = index.get(callee)
        if calls is not None:
            calls.pop(instr, None)


class HloInstruction(Named):
    """One HLO instruction. Create through `HloComputation.add_instruction`."""

    # Defaults shared by every instruction until one sets its own (keeps creation cheap: parsing
    # a large module creates tens of thousands of instructions).
    parent: "HloComputation | None" = None
    parameter_number: int | None = None
    literal = None
    line: int | None = None   # 1-based source line, for error messages
    _span = None              # (start, end) of the source text while unmodified
    _name_start = None        # where the name starts inside the span (after `ROOT`)
    _owner = None             # the instruction whose source text holds this nested one
    _compact = False          # a get-tuple-element its users write `%tuple#index` (XLA's dumps)
    _shape_set = False        # set_shape was called: users may no longer fit (the verifier checks them)
    _edited_operands_only = False  # every edit since parsing set operands (see hlo_tools.xla.proto_patch)

    def __init__(self, name: str, opcode: str, shape: Shape, operands=(), attrs=None,
                 parameter_number: int | None = None, literal=None):
        self.name = name
        self.opcode = opcode
        self.shape = shape
        self._operands = list(operands)
        self.users: list[HloInstruction] = []
        self.attrs = _AttrDict(self, attrs) if attrs else _AttrDict(self)
        if parameter_number is not None:
            self.parameter_number = parameter_number
        if literal is not None:
            self.literal = literal

    # -- reading ----------------------------------------------------------------------------------
    @property
    def operands(self) -> tuple["HloInstruction", ...]:
        return tuple(self._operands)

    def operand(self, i: int) -> "HloInstruction":
        return self._operands[i]

    @property
    def operand_count(self) -> int:
        return len(self._operands)

    @property
    def is_root(self) -> bool:
        return self.parent is not None and self.parent.root is self

    @property
    def called_computations(self) -> list["HloComputation"]:
        """Computations this instruction calls, in attribute order."""
        out = []
        for key, value in self.attrs.items():
            if key in COMPUTATION_ATTRS:
                out.extend(value if isinstance(value, tuple) else (value,))
        return out

    @property
    def control_predecessors(self) -> tuple["HloInstruction", ...]:
        return self.attrs.get(CONTROL_PREDECESSORS, ())

    @property
    def control_successors(self) -> tuple["HloInstruction", ...]:
        """The instructions of this computation that name this one as a control predecessor."""
        if self.parent is None:
            return ()
        return tuple(self.parent._control_successor_index().get(self, ()))

    def __repr__(self):
        return f"<HloInstruction {self.name} = {self.shape} {self.opcode}>"

    # -- editing ----------------------------------------------------------------------------------
    def _touch(self, operands_only: bool = False):
        """Mark this instruction's text stale so the printer regenerates it (`operands_only`: the
        edit set operands, nothing else)."""
        if self._span is not None:
            self._span = None
            self._edited_operands_only = operands_only
        elif not operands_only:
            self._edited_operands_only = False
        owner = self._owner
        if owner is not None:
            self._owner = None
            owner._touch()
        if self._compact:  # its users' text spells it
            for user in self.users:
                user._touch(operands_only=True)
        if self.parent is not None:
            self.parent._dirty = True

    @contextlib.contextmanager
    def _callees_changing(self):
        """Around an edit that may change the computations this instruction calls: moves its
        entries in the module's callers index, when the module keeps one."""
        index = self._callers_index()
        if index is None:
            yield
            return
        _unindex_calls(index, self)
        try:
            yield
        finally:
            _index_calls(index, self)

    def _callers_index(self):
        """The module's callers index when this instruction is in a module that keeps one."""
        comp = self.parent
        module = comp.parent if comp is not None else None
        return module._callers if module is not None else None

    def _control_predecessors_changed(self, old):
        """Move this instruction's entries in its computation's control-successor index from `old`."""
        comp = self.parent
        if comp is not None and comp._control_successors is not None:
            comp._unindex_control_edges(self, old)
            comp._index_control_edges(self, self.control_predecessors)

    def set_shape(self, shape: Shape):
        self.shape = shape
        self._shape_set = True
        self._touch()
        if self.opcode == "parameter" and self.parent is not None:
            self.parent._signature_changed()

    def set_operand(self, index: int, new: "HloInstruction"):
        old = self._operands[index]
        if old is new:
            return
        self._operands[index] = new
        if all(o is not old for o in self._operands) and self in old.users:
            old.users.remove(self)
        if self not in new.users:
            new.users.append(self)
        self._touch(operands_only=True)

    def set_operands(self, operands: Iterable["HloInstruction"]):
        for old in self._operands:
            if self in old.users:
                old.users.remove(self)
        self._operands = list(operands)
        for new in self._operands:
            if self not in new.users:
                new.users.append(self)
        self._touch(operands_only=True)

    def replace_operand_with(self, old: "HloInstruction", new: "HloInstruction"):
        """Replace every occurrence of `old` among this instruction's operands by `new`."""
        for i, op in enumerate(self._operands):
            if op is old:
                self.set_operand(i, new)

    def replace_all_uses_with(self, new: "HloInstruction", *, include_root: bool = True):
        """Make every user of this instruction use `new` instead (and `new` the root if this was)."""
        if new is self:
            return
        for user in list(self.users):
            if user is new:
                continue  # `new` may consume `self` (e.g. a convert wrapped around it)
            user.replace_operand_with(self, new)
        if include_root and self.parent is not None and self.parent.root is self:
            self.parent.set_root(new)

    def rename(self, name: str):
        """Rename (the module keeps names unique) and mark every text that spells the old name."""
        if self.parent is not None and self.parent.parent is not None:
            module = self.parent.parent
            module._release_name(self.name)
            name = module.unique_name(name)
        self.name = name
        self._touch()
        for user in self.users:
            user._touch()
        if self.parent is not None:
            for instr in self.control_successors:
                instr._touch()
            if self.opcode == "parameter":
                self.parent._signature_changed()

    def add_control_predecessor(self, pred: "HloInstruction"):
        preds = self.control_predecessors
        if pred not in preds:
            self.attrs[CONTROL_PREDECESSORS] = preds + (pred,)

    # -- edit state (what printing, the verifier and hlo_tools.xla.proto_patch read) --------------
    @property
    def source_span(self) -> tuple[int, int] | None:
        """(start, end) of this instruction's text in its module's `source_text` while it is
        unedited; None once edited, and for an instruction the parser did not make."""
        return self._span

    @property
    def edited_operands_only(self) -> bool:
        """Whether every edit since parsing set operands (nothing else about it changed)."""
        return self._edited_operands_only

    @property
    def shape_was_set(self) -> bool:
        """Whether `set_shape` was called (its users may no longer fit it)."""
        return self._shape_set

    # -- printing ---------------------------------------------------------------------------------
    def to_text(self, *, sigils: bool = True, operand_shapes: bool = True) -> str:
        """This instruction in XLA's syntax (no `ROOT`), regenerated from the IR."""
        return print_instruction(self, sigils=sigils, operand_shapes=operand_shapes)


# What a lazily parsed computation lacks until its body is parsed (see HloComputation.__getattr__).
_BODY_ATTRS = frozenset({"instructions", "root", "_gaps", "_tail_span"})


class HloComputation(Named):
    """A computation: parameters, instructions in order, one root."""

    # Set on a computation whose body is still source text: called once, it parses the body
    # (setting `instructions`, `root`, `_gaps` and `_tail_span`) and clears itself.
    _parse_body = None
    _unparsed_text = None
    _unparsed_signature = None

    def __init__(self, name: str, is_entry: bool = False):
        self.name = name
        self.is_entry = is_entry
        self.instructions: list[HloInstruction] = []
        self.root: HloInstruction | None = None
        self.parent: HloModule | None = None
        self.execution_thread: str | None = None
        self.line: int | None = None
        self._dirty = False          # instruction list or an instruction changed since parsing
        self._span = None            # (start, end) of the whole computation's source text
        self._head_span = None       # (start, end) of `ENTRY name (sig) -> shape {`, None when stale
        self._tail_span = None       # (start, end) of `}` and any trailing attributes
        self._gaps = {}              # instruction -> source text between it and its predecessor
        self._control_successors = None  # instruction -> instructions naming it a control predecessor
        self._last_insert = None     # (instruction, its index) of the last insert before/after another

    @classmethod
    def unparsed(cls, name: str, text: str, parse_body, read_signature=None) -> "HloComputation":
        """A computation whose body `text` is parsed by `parse_body(comp)` when first read;
        `read_signature()` gives what its header declares, ([(name, shape) of each parameter],
        result shape); None when it declares nothing."""
        comp = cls(name)
        del comp.instructions, comp.root, comp._gaps, comp._tail_span
        comp._unparsed_text = text
        comp._parse_body = parse_body
        comp._unparsed_signature = read_signature
        return comp

    def __getattr__(self, name):
        # Python calls this only for attributes not set: the body of a computation not parsed yet.
        parse_body = self.__dict__.get("_parse_body")
        if parse_body is None or name not in _BODY_ATTRS:
            raise AttributeError(f"'HloComputation' object has no attribute {name!r}")
        parse_body(self)  # raises HloParseError for a bad body, which stays unparsed
        del self._parse_body, self._unparsed_text, self._unparsed_signature
        return self.__dict__[name]

    @property
    def parsed(self) -> bool:
        """False while the body is still source text (a lazily parsed module); reading it parses it."""
        return self._parse_body is None

    @property
    def unparsed_text(self) -> str | None:
        """The body's source text while it is not parsed (for cheap substring tests), else None."""
        return self._unparsed_text

    def may_contain_text(self, words: tuple[str, ...]) -> bool:
        """Whether this computation's text may contain one of `words`: True once parsed; for one not
        parsed yet, whether its source does (remembered, since that text never changes)."""
        text = self._unparsed_text
        if text is None:
            return True
        answers = self.__dict__.setdefault("_text_contains", {})
        answer = answers.get(words)
        if answer is None:
            answer = answers[words] = any(word in text for word in words)
        return answer

    @property
    def unparsed_program_shape(self) -> tuple[list[Shape], Shape] | None:
        """(parameter shapes, result shape) as the header of a computation not parsed yet declares
        them (`(p: f32[2]) -> f32[2]`, no layouts; parsing checks them against the body); None once
        parsed or when the header declares none."""
        read_signature = self._unparsed_signature
        if read_signature is None:
            return None
        declared = self.__dict__.get("_declared_program_shape")
        if declared is None:
            params, result = read_signature()
            declared = self._declared_program_shape = ([shape for _, shape in params], result)
        return list(declared[0]), declared[1]

    # -- reading ----------------------------------------------------------------------------------
    @property
    def edited(self) -> bool:
        """Whether its instruction list or an instruction of it changed since parsing."""
        return self._dirty

    @property
    def source_span(self) -> tuple[int, int] | None:
        """(start, end) of the computation's text in its module's `source_text` (None for one the
        parser did not make); the text still holds it where it is not `edited`."""
        return self._span

    @property
    def head_source_span(self) -> tuple[int, int] | None:
        """(start, end) of its first line, `ENTRY name (sig) -> shape {`, in its module's
        `source_text`; None once the signature changed, and for one the parser did not make."""
        return self._head_span

    @property
    def parameters(self) -> list[HloInstruction]:
        params = [i for i in self.instructions if i.opcode == "parameter"]
        params.sort(key=lambda p: p.parameter_number)
        return params

    def parameter(self, number: int) -> HloInstruction:
        for i in self.instructions:
            if i.opcode == "parameter" and i.parameter_number == number:
                return i
        raise IndexError(f"{self.name} has no parameter {number}")

    @property
    def num_parameters(self) -> int:
        return sum(1 for i in self.instructions if i.opcode == "parameter")

    def get(self, name: str) -> HloInstruction:
        for i in self.instructions:
            if i.name == name:
                return i
        raise KeyError(f"no instruction {name!r} in computation {self.name}")

    def __iter__(self):
        return iter(self.instructions)

    def __len__(self):
        return len(self.instructions)

    def __repr__(self):
        if not self.parsed:
            return f"<HloComputation {self.name}: not parsed yet>"
        return f"<HloComputation {self.name}: {len(self.instructions)} instructions>"

    @property
    def program_shape(self) -> tuple[list[Shape], Shape]:
        return [p.shape for p in self.parameters], self.root.shape

    def post_order(self) -> list[HloInstruction]:
        """Instructions with every operand (and control predecessor) before its users."""
        order, state = [], {}
        for start in self.instructions:
            if start in state:
                continue
            stack = [(start, False)]
            while stack:
                instr, expanded = stack.pop()
                if expanded:
                    state[instr] = 2
                    order.append(instr)
                    continue
                if instr in state:
                    continue
                state[instr] = 1
                stack.append((instr, True))
                for dep in reversed(instr._operands + list(instr.control_predecessors)):
                    if dep not in state:
                        stack.append((dep, False))
        return order

    # -- editing ----------------------------------------------------------------------------------
    def _signature_changed(self):
        self._head_span = None
        self._dirty = True
        module = self.parent
        if module is not None and self.is_entry:
            module._header_stale = True
            if "entry_computation_layout" in module.attrs and self.root is not None:
                module.attrs["entry_computation_layout"] = Raw(entry_computation_layout(self))

    def add_instruction(self, opcode: str, operands: Iterable[HloInstruction] = (), shape: Shape | None = None,
                        *, name: str | None = None, attrs: dict | None = None, before: HloInstruction | None = None,
                        after: HloInstruction | None = None, parameter_number: int | None = None,
                        literal=None) -> HloInstruction:
        """Create an instruction and insert it (at the end unless `before`/`after` is given).

        Without `shape`, the shape is inferred from the operands and attributes as XLA would.
        """
        operands = list(operands)
        if shape is None:
            from hlo_tools.ir.shape_inference import infer_shape
            shape = infer_shape(opcode, [o.shape for o in operands], attrs or {}, literal=literal)
        module = self.parent
        base = name or opcode
        name = module.unique_name(base) if module is not None else base
        instr = HloInstruction(name, opcode, shape, operands, attrs, parameter_number, literal)
        for op in operands:
            if instr not in op.users:
                op.users.append(instr)
        self._insert(instr, before=before, after=after)
        if opcode == "parameter":
            self._signature_changed()
        return instr

    def add_parameter(self, shape: Shape, name: str | None = None) -> HloInstruction:
        """Add a parameter with the next parameter number, placed after the existing parameters."""
        params = self.parameters
        anchor = {"after": params[-1]} if params else ({"before": self.instructions[0]} if self.instructions else {})
        return self.add_instruction("parameter", (), shape, name=name or f"param_{len(params)}",
                                    parameter_number=len(params), **anchor)

    def remove_parameter(self, parameter: HloInstruction):
        """Remove an unused parameter; the later ones move down a number (a fused computation's
        caller then drops that operand)."""
        number = parameter.parameter_number
        self.remove_instruction(parameter)
        for later in self.parameters:
            if later.parameter_number > number:
                later.parameter_number -= 1
                later._touch()
        self._signature_changed()

    def _insert(self, instr: HloInstruction, before=None, after=None):
        instr.parent = self
        instructions = self.instructions
        if before is not None:
            index = self._index_of(before)
            instructions.insert(index, instr)
            self._last_insert = (instr, index)
        elif after is not None:
            index = self._index_of(after) + 1
            instructions.insert(index, instr)
            self._last_insert = (instr, index)
        else:
            instructions.append(instr)
        if self._control_successors is not None:
            self._index_control_edges(instr, instr.control_predecessors)
        if (index := instr._callers_index()) is not None:
            _index_calls(index, instr)
        self._dirty = True

    def _index_of(self, instr: HloInstruction) -> int:
        """The position of `instr`: O(1) right after inserting it or just before it (a pass that
        inserts a run of instructions, each after the one before or each before the same one, does
        not scan the list each time)."""
        last = self._last_insert
        if last is not None:
            index = last[1] + (last[0] is not instr)
            if index < len(self.instructions) and self.instructions[index] is instr:
                return index
        return self.instructions.index(instr)

    def _control_successor_index(self) -> dict:
        """Control predecessor -> the instructions naming it, built on first use and then kept current."""
        if self._control_successors is None:
            self._control_successors = {}
            for instr in self.instructions:
                self._index_control_edges(instr, instr.control_predecessors)
        return self._control_successors

    def _index_control_edges(self, instr: HloInstruction, preds):
        for pred in preds if isinstance(preds, tuple) else ():
            self._control_successors.setdefault(pred, []).append(instr)

    def _unindex_control_edges(self, instr: HloInstruction, preds):
        for pred in preds if isinstance(preds, tuple) else ():
            successors = self._control_successors.get(pred)
            if successors is not None and instr in successors:
                successors.remove(instr)

    def set_root(self, instr: HloInstruction):
        if self.root is instr:
            return
        old = self.root
        self.root = instr
        self._dirty = True
        if old is not None and old.shape != instr.shape:
            self._signature_changed()

    def remove_instruction(self, instr: HloInstruction):
        """Remove an instruction that has no users and is not the root.

        Costs the instruction's edges plus one C-level pass over the instruction list; to remove
        many at once, `remove_instructions` makes that one pass for all of them.
        """
        self._detach(instr, ())
        self.instructions.remove(instr)

    def remove_instructions(self, instrs: Iterable[HloInstruction]):
        """Remove several instructions, each unused but by others of `instrs` and none the root,
        in one pass over the instruction list (the others keep their order)."""
        batch = list(dict.fromkeys(instrs))
        removing = set(batch)
        for instr in batch:
            self._detach(instr, removing)
        self.instructions = [i for i in self.instructions if i not in removing]

    def _detach(self, instr: HloInstruction, removing):
        """Everything `remove_instruction` does but taking `instr` out of the instruction list."""
        if instr.parent is not self:
            raise ValueError(f"cannot remove {instr.name}: it is not in {self.name}")
        if any(user not in removing for user in instr.users):
            users = ", ".join(u.name for u in instr.users if u not in removing)
            raise ValueError(f"cannot remove {instr.name}: it is used by {users}")
        if instr is self.root:
            raise ValueError(f"cannot remove {instr.name}: it is the root of {self.name}")
        index = self._control_successor_index()
        for other in list(index.get(instr, ())):
            other.attrs[CONTROL_PREDECESSORS] = tuple(p for p in other.control_predecessors if p is not instr)
        self._unindex_control_edges(instr, instr.control_predecessors)
        index.pop(instr, None)
        for op in set(instr._operands):
            if instr in op.users:
                op.users.remove(instr)
        self._gaps.pop(instr, None)
        if instr._owner is not None:
            instr._owner._touch()
        self._release_nested(instr)
        if (callers := instr._callers_index()) is not None:
            _unindex_calls(callers, instr)
        instr.parent = None
        self._dirty = True
        if instr.opcode == "parameter":
            self._signature_changed()
        if self.parent is not None:
            self.parent._release_name(instr.name)

    @staticmethod
    def _release_nested(owner: HloInstruction):
        """Nested instructions printed inside `owner`'s text (its operands, transitively) print on their own now.

        Only an untouched owner still has its text, and then none of its nested ones was touched.
        """
        if owner._span is None:
            return
        stack = list(owner._operands)
        while stack:
            op = stack.pop()
            if op._owner is owner:
                op._owner = None
                stack.extend(op._operands)

    def remove_dead_code(self, keep_side_effects: bool = True) -> bool:
        """Remove instructions whose results nobody uses; returns whether anything was removed."""
        from hlo_tools.ir.opcodes import has_side_effect
        live = set()
        stack = [self.root] + [i for i in self.instructions if i.opcode == "parameter"]
        if keep_side_effects:
            stack += [i for i in self.instructions if has_side_effect(i)]
        while stack:
            instr = stack.pop()
            if instr in live:
                continue
            live.add(instr)
            stack.extend(instr._operands)
            stack.extend(instr.control_predecessors)
        dead = [i for i in reversed(self.post_order()) if i not in live]
        self.remove_instructions(dead)
        return bool(dead)

    def sort_topologically(self):
        """Reorder instructions so that definitions come before uses (needed after out-of-order inserts)."""
        order = self.post_order()
        if order != self.instructions:
            self.instructions = order
            self._dirty = True


class HloModule:
    """An HLO module: header attributes, computations (callees before callers), one entry."""

    def __init__(self, name: str):
        self.name = name
        self.attrs: dict = {}                  # header attributes, e.g. replica_count, num_partitions
        self.computations: list[HloComputation] = []
        self.entry: HloComputation | None = None
        self.stack_frames = None               # the FileNames/.../StackFrames tables, when present
        self.stack_frames_text = ""            # ... and their source text
        # How regenerated text is spelled; the parser sets these from the source (JAX's short form
        # has none of them, XLA's and TF's long form all three).
        self.sigils = True                     # names printed with `%`
        self.operand_shapes = True             # operands printed with their shapes
        self.signatures = True                 # computations printed with `(params) -> shape`
        # Whether the layouts are XLA's final ones (a module from after its layout assignment, as
        # JAX's pass hook hands it over): new instructions must then have layouts XLA runs as they
        # are. Text does not say it (XLA keeps it in the module's config); whoever knows sets it.
        self.layouts_final = False
        self._names: set[str] = set()
        self._suffixes: dict[str, int] = {}   # base -> a suffix n such that `base.1` ... `base.{n-1}` are taken
        self._unclaimed: list[HloComputation] = []  # unparsed computations whose names _names lacks
        self._callers = None                  # computation -> {instruction calling it: None}, once asked
        self._source = None
        self._header_span = None
        self._header_stale = False
        self._dirty = False                    # computation list changed since parsing
        self._gaps = {}                        # computation -> source text before it
        self._trailing = ""

    # -- reading ----------------------------------------------------------------------------------
    @property
    def source_text(self) -> str | None:
        """The text the module was parsed from (None for a module built without parsing)."""
        return self._source

    @property
    def computations_edited(self) -> bool:
        """Whether computations were added to or removed from the module since parsing."""
        return self._dirty

    @property
    def header_edited(self) -> bool:
        """Whether the header line (`HloModule name, attrs...`) changed since parsing."""
        return self._header_stale

    @property
    def replica_count(self) -> int:
        return int(self.attrs.get("replica_count", 1))

    @property
    def num_partitions(self) -> int:
        return int(self.attrs.get("num_partitions", 1))

    def computation(self, name: str) -> HloComputation:
        for c in self.computations:
            if c.name == name:
                return c
        raise KeyError(f"no computation {name!r} in module {self.name}")

    def instructions(self):
        """Every instruction of every computation (parsing any computation not parsed yet)."""
        for comp in self.computations:
            yield from comp.instructions

    def instructions_mentioning(self, words: Iterable[str]):
        """Every instruction, but for computations not parsed yet whose source text contains none of
        `words`: a superset of the instructions whose text contains one, that leaves computations
        which cannot hold any (e.g. fusion bodies when looking for collectives) unparsed."""
        words = tuple(words)
        for comp in self.computations:
            if comp.may_contain_text(words):
                yield from comp.instructions

    def find(self, name: str) -> HloInstruction:
        for instr in self.instructions():
            if instr.name == name:
                return instr
        raise KeyError(f"no instruction {name!r} in module {self.name}")

    def callers(self) -> dict[HloComputation, list[HloInstruction]]:
        """For every computation, the instructions that call it (a snapshot: later edits do not change it)."""
        index = self._callers_index()
        out = {c: list(index.get(c, ())) for c in self.computations}
        out.update((c, list(calls)) for c, calls in index.items() if calls and c not in out)
        return out

    def callers_of(self, comp: HloComputation) -> list[HloInstruction]:
        """The instructions that call `comp`."""
        return list(self._callers_index().get(comp, ()))

    def _callers_index(self) -> dict:
        """Computation -> the instructions calling it: built on first use (parsing every body), then kept
        current by every edit (attribute writes, inserts, removals, added and removed computations)."""
        if self._callers is None:
            index = {}
            for instr in self.instructions():
                _index_calls(index, instr)
            self._callers = index
        return self._callers

    def computations_post_order(self) -> list[HloComputation]:
        """Computations with every callee before its callers (the order XLA prints)."""
        order, seen = [], set()

        def visit(comp):
            stack = [(comp, iter([c for i in comp.instructions for c in i.called_computations]))]
            seen.add(comp)
            while stack:
                current, callees = stack[-1]
                for callee in callees:
                    if callee not in seen:
                        seen.add(callee)
                        stack.append((callee, iter([c for i in callee.instructions for c in i.called_computations])))
                        break
                else:
                    stack.pop()
                    order.append(current)
        for comp in self.computations:
            if comp not in seen and comp is not self.entry:
                visit(comp)
        if self.entry is not None and self.entry not in seen:
            visit(self.entry)
        return order

    def __repr__(self):
        return f"<HloModule {self.name}: {len(self.computations)} computations>"

    # -- editing ----------------------------------------------------------------------------------
    def unique_name(self, base: str) -> str:
        """A name not used yet in this module (XLA style: `base`, `base.1`, `base.2`, ...)."""
        if base.startswith("%"):
            base = base[1:]
        names = self._claimed_names()
        if base not in names:
            names.add(base)
            return base
        stem, dot, suffix = base.rpartition(".")
        if dot and suffix.isdigit():
            base = stem
        n = self._suffixes.get(base, 1)   # the lowest free suffix, without probing the taken ones again
        while f"{base}.{n}" in names:
            n += 1
        name = f"{base}.{n}"
        names.add(name)
        self._suffixes[base] = n + 1
        return name

    def _release_name(self, name: str) -> None:
        """`name` is free again (and so the lowest free suffix of its base may be lower)."""
        self._names.discard(name)
        stem, dot, suffix = name.rpartition(".")
        if dot and suffix.isdigit() and int(suffix) < self._suffixes.get(stem, 1):
            self._suffixes[stem] = int(suffix)

    def _claimed_names(self) -> set[str]:
        """Every name in the module, those in bodies not parsed yet included (read from their text)."""
        if self._unclaimed:
            self._names.update(defined_names("".join(c.unparsed_text for c in self._unclaimed if not c.parsed)))
            self._unclaimed = []
        return self._names

    def add_computation(self, comp: HloComputation, *, before: HloComputation | None = None) -> HloComputation:
        """Add a computation (before `before`, else just before the entry) and claim its names."""
        self._claimed_names()
        comp.parent = self
        comp.name = self.unique_name(comp.name)
        for instr in comp.instructions:
            if instr.name in self._names:
                instr.name = self.unique_name(instr.name)
                instr._touch()
            else:
                self._names.add(instr.name)
        anchor = before or (self.entry if self.entry in self.computations else None)
        if anchor is not None:
            self.computations.insert(self.computations.index(anchor), comp)
        else:
            self.computations.append(comp)
        if comp.is_entry:
            self.entry = comp
        if self._callers is not None:
            for instr in comp.instructions:
                _index_calls(self._callers, instr)
        self._dirty = True
        return comp

    def remove_computation(self, comp: HloComputation):
        if comp is self.entry:
            raise ValueError("cannot remove the entry computation")
        callers = self.callers_of(comp)
        if callers:
            raise ValueError(f"cannot remove {comp.name}: called by {', '.join(i.name for i in callers)}")
        self.computations.remove(comp)
        self._gaps.pop(comp, None)
        self._forget_calls_of(comp)
        for instr in comp.instructions:
            self._release_name(instr.name)
        self._release_name(comp.name)
        comp.parent = None
        self._dirty = True

    def _forget_calls_of(self, comp: HloComputation) -> None:
        """Take the calls that `comp` (leaving the module) makes out of the callers index."""
        if self._callers is not None:
            self._callers.pop(comp, None)
            for instr in comp.instructions:
                _unindex_calls(self._callers, instr)

    def clone_computation(self, comp: HloComputation, suffix: str = "clone",
                          replacements: dict | None = None) -> HloComputation:
        """Deep-copy `comp` (fresh names, same callees) into this module, before the entry."""
        clone = HloComputation(f"{comp.name}.{suffix}")
        mapping = dict(replacements or {})
        for instr in comp.post_order():
            if instr in mapping:
                continue
            new = HloInstruction(instr.name, instr.opcode, instr.shape, [mapping[o] for o in instr._operands],
                                 None, instr.parameter_number, instr.literal)
            attrs = {}
            for key, value in instr.attrs.items():
                if key == "control-predecessors":
                    value = tuple(mapping[p] for p in value)
                attrs[key] = value
            dict.update(new.attrs, attrs)
            if instr._compact:
                new._compact = True
            for op in new._operands:
                if new not in op.users:
                    op.users.append(new)
            new.parent = clone
            clone.instructions.append(new)
            mapping[instr] = new
        clone.root = mapping[comp.root]
        clone.execution_thread = comp.execution_thread
        clone._dirty = True
        return self.add_computation(clone)

    def remove_dead_computations(self) -> bool:
        """Drop computations that nothing reachable from the entry calls."""
        reachable, stack = set(), [self.entry]
        while stack:
            comp = stack.pop()
            if comp in reachable:
                continue
            reachable.add(comp)
            for instr in comp.instructions:
                stack.extend(instr.called_computations)
        dead = [c for c in self.computations if c not in reachable]
        for comp in dead:
            self.computations.remove(comp)
            self._gaps.pop(comp, None)
            self._forget_calls_of(comp)
            comp.parent = None
        if dead:
            self._dirty = True
        return bool(dead)

    def checkpoint(self) -> "ModuleCheckpoint":
        """What the module holds now, to put back with `restore()` (a pass that failed, a rewrite
        taken back): one shallow copy of each object's state, no text printed or parsed. A
        computation still unparsed (`lazy_bodies`) is saved as its source text and stays unparsed."""
        return ModuleCheckpoint(self)

    def replace_contents(self, other: "HloModule") -> None:
        """Make this module (the same object) hold what `other` holds: its header, computations and
        source text. `other` is used up (its computations now belong here)."""
        self.__dict__.clear()
        self.__dict__.update(other.__dict__)
        for comp in self.computations:
            comp.parent = self
        self._callers = None

    def set_attr(self, key: str, value):
        """Set a header attribute (e.g. `replica_count`)."""
        self.attrs[key] = value
        self._header_stale = True

    # -- printing ---------------------------------------------------------------------------------
    def to_text(self, regenerate: bool = False) -> str:
        """The module as HLO text: unmodified parts verbatim, edited parts in XLA's style.

        `regenerate=True` prints everything from the IR, reusing no source text.
        """
        return print_module(self, regenerate=regenerate)

    def __str__(self):
        return self.to_text()


# The containers each object's checkpoint copies (the rest of its state is immutable values or
# references to objects that the checkpoint saves on their own).
_MODULE_CONTAINERS = {"attrs": dict, "computations": list, "_names": set, "_suffixes": dict, "_unclaimed": list,
                      "_gaps": dict}
_COMPUTATION_CONTAINERS = {"instructions": list, "_gaps": dict}
_INSTRUCTION_CONTAINERS = {"_operands": list, "users": list}


def _saved_state(obj, containers: dict) -> dict:
    state = dict(obj.__dict__)
    for key, kind in containers.items():
        if key in state:
            state[key] = kind(state[key])
    return state


def _load_state(obj, state: dict, containers: dict) -> None:
    obj.__dict__.clear()
    obj.__dict__.update(state)
    for key, kind in containers.items():
        if key in state:
            obj.__dict__[key] = kind(state[key])


class ModuleCheckpoint:
    """A module's state as `HloModule.checkpoint` took it; `restore()` puts it back (any number of
    times). Attribute values (shapes, literals, parsed attributes) are shared, not copied: edits
    replace them, never change them in place."""

    __slots__ = ("module", "_module_state", "_computations", "_instructions")

    def __init__(self, module: HloModule):
        self.module = module
        self._module_state = _saved_state(module, _MODULE_CONTAINERS)
        self._module_state.update(_callers=None, _suffixes={})   # indexes, rebuilt on first use
        self._computations = []
        self._instructions = []
        for comp in module.computations:
            state = _saved_state(comp, _COMPUTATION_CONTAINERS)
            state.pop("_control_successors", None)   # indexes, rebuilt on first use
            state.pop("_last_insert", None)
            self._computations.append((comp, state))
            if comp.parsed:
                for instr in comp.instructions:
                    state = _saved_state(instr, _INSTRUCTION_CONTAINERS)
                    state["attrs"] = dict(instr.attrs)
                    self._instructions.append((instr, state))

    def restore(self) -> None:
        """Make the module hold again exactly what it held at the checkpoint (the same objects: its
        computations and instructions; whatever was added since is dropped)."""
        _load_state(self.module, self._module_state, _MODULE_CONTAINERS)
        for comp, state in self._computations:
            _load_state(comp, state, _COMPUTATION_CONTAINERS)
            comp._control_successors = None
            comp._last_insert = None
        for instr, state in self._instructions:
            _load_state(instr, state, _INSTRUCTION_CONTAINERS)
            instr.attrs = _AttrDict(instr, state["attrs"])
