"""What changed between two HLO modules, computation by computation.

Text diffs of HLO drown in renames: XLA's passes renumber instructions
(``add.1`` becomes ``add.3``), and a module that went through ``hlo-tools
print --regenerate`` or a renaming pass reads differently while meaning the
same.  This diff matches the two modules' computations and instructions first,
then reports what is really added, removed or changed.

Matching, in order (each step only looks at what is still unmatched):

* computations: the two entries; then equal names; then the computations
  that matched instructions call at the same place (a fusion's ``calls=``, a
  while's ``body=``...); then equal structure (same instructions, operands,
  attributes and callees, whatever the names);
* instructions of two matched computations: equal names (and opcodes); then
  parameters by number; then by structure, to a fixed point: an instruction
  with the same opcode, shape, attributes and (matched) operands as exactly one
  on the other side; the unmatched operands at the same position of two
  matched instructions when their opcodes agree (a constant whose value
  changed, or one of two look-alike constants); then the same with ties broken
  by order, and an instruction with the same opcode and matched operands whose
  shape or attributes changed; last, equal names whose opcode changed.

A matched pair is *changed* when its opcode, shape, operands (compared through
the matching), parameter number, constant value, attributes or ROOT-ness
differ.  ``metadata=`` and the order of instructions are ignored.  Renames are
reported but do not make modules differ: two modules are *identical* when no
header attribute, computation or instruction was added, removed or changed.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from hlo_tools.ir.hlo import HloComputation, HloInstruction, HloModule
from hlo_tools.ir.printer import format_value

__all__ = ["ModuleDiff", "ComputationDiff", "InstructionChange", "diff_modules"]

# Attributes that record where an instruction came from, not what it does.
IGNORED_ATTRS = frozenset({"metadata"})

LITERAL_WIDTH = 60  # constants longer than this are shown clipped

# XLA's position comments (`/*index=5*/`): printed in some places and not others, never meaningful.
_COMMENT = re.compile(r"/\*.*?\*/")


def _value_text(key: str, value) -> str:
    """An attribute value as XLA writes it, without comments: the form two sides are compared in."""
    return _COMMENT.sub("", format_value(key, value))


def _clip(text: str, width: int = LITERAL_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def instruction_text(instr: HloInstruction) -> str:
    """One instruction as XLA writes it, without metadata and with long constants clipped."""
    if instr.opcode == "parameter":
        args = str(instr.parameter_number)
    elif instr.opcode == "constant":
        args = _clip(_literal_text(instr) or "")
    else:
        args = ", ".join(f"%{op.name}" for op in instr.operands)
    attrs = "".join(f", {key}={format_value(key, value)}" for key, value in instr.attrs.items()
                    if key not in IGNORED_ATTRS)
    root = "ROOT " if instr.is_root else ""
    return f"{root}%{instr.name} = {instr.shape} {instr.opcode}({args}){attrs}"


def _literal_text(instr: HloInstruction) -> str | None:
    return instr.literal.text if instr.opcode == "constant" and instr.literal is not None else None


def _refers_to_computations(value) -> bool:
    return isinstance(value, HloComputation) or (
        isinstance(value, tuple) and bool(value) and isinstance(value[0], HloComputation))


def _refers_to_instructions(value) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], HloInstruction)


def _attribute_signature(instr: HloInstruction, computation_key, instruction_key) -> tuple:
    """The attributes as comparable values; computations and instructions they name are
    replaced by ``computation_key(c)`` / ``instruction_key(i)``."""
    items = []
    for key, value in instr.attrs.items():
        if key in IGNORED_ATTRS:
            continue
        if isinstance(value, HloComputation):
            items.append((key, computation_key(value)))
        elif _refers_to_computations(value):
            items.append((key, tuple(computation_key(c) for c in value)))
        elif _refers_to_instructions(value):
            items.append((key, tuple(instruction_key(i) for i in value)))
        else:
            items.append((key, _value_text(key, value)))
    return tuple(sorted(items, key=lambda item: item[0]))


def _fingerprints(module: HloModule) -> dict[HloComputation, int]:
    """A name-free structural hash of every computation (callees hashed first)."""
    prints: dict[HloComputation, int] = {}
    for comp in module.computations_post_order():
        order = comp.post_order()
        position = {instr: i for i, instr in enumerate(order)}
        rows = []
        for instr in order:
            attrs = _attribute_signature(instr, lambda c: prints.get(c, c.name),
                                         lambda i: position.get(i, -1))
            rows.append((instr.opcode, str(instr.shape), tuple(position[o] for o in instr.operands),
                         instr.parameter_number, _literal_text(instr), attrs))
        prints[comp] = hash((tuple(rows), position.get(comp.root)))
    return prints


@dataclasses.dataclass
class InstructionChange:
    """A matched instruction that differs; ``fields`` maps what differs to (old, new) text,
    None where one side has no such attribute."""

    old: str
    new: str
    opcode: str  # the new opcode
    fields: dict[str, tuple[str | None, str | None]]

    def to_json(self) -> dict:
        return {"old": self.old, "new": self.new, "opcode": self.opcode,
                "changes": {field: {"old": a, "new": b} for field, (a, b) in self.fields.items()}}


@dataclasses.dataclass
class ComputationDiff:
    """One computation: matched (``old`` and ``new`` names), added (no ``old``) or removed (no ``new``)."""

    old: str | None
    new: str | None
    is_entry: bool
    instructions: int                                   # of the new side (the old one if removed)
    added: list[tuple[str, str]] = dataclasses.field(default_factory=list)    # (name, text)
    removed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, text)
    changed: list[InstructionChange] = dataclasses.field(default_factory=list)
    renamed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (old, new) names

    @property
    def status(self) -> str:
        """``added``, ``removed``, ``changed``, ``renamed`` (only names differ) or ``same``."""
        if self.old is None:
            return "added"
        if self.new is None:
            return "removed"
        if self.added or self.removed or self.changed:
            return "changed"
        if self.renamed or self.old != self.new:
            return "renamed"
        return "same"

    def to_json(self) -> dict:
        return {"old": self.old, "new": self.new, "status": self.status, "entry": self.is_entry,
                "instructions": self.instructions,
                "added": [{"name": n, "text": t} for n, t in self.added],
                "removed": [{"name": n, "text": t} for n, t in self.removed],
                "changed": [c.to_json() for c in self.changed],
                "renamed": [{"old": a, "new": b} for a, b in self.renamed]}


@dataclasses.dataclass
class ModuleDiff:
    """The result of :func:`diff_modules`."""

    old_module: str
    new_module: str
    header: list[tuple[str, str | None, str | None]]  # (attribute, old, new); "name" is the module name
    computations: list[ComputationDiff]                # every computation whose status is not "same"
    opcodes: dict[str, tuple[int, int]]                # opcode -> (old count, new count), where they differ

    @property
    def identical(self) -> bool:
        """No header attribute, computation or instruction added, removed or changed (renames allowed)."""
        return not self.header and all(c.status in ("same", "renamed") for c in self.computations)

    def summary(self) -> dict[str, int]:
        by_status = collections.Counter(c.status for c in self.computations)
        return {
            "computations_added": by_status["added"],
            "computations_removed": by_status["removed"],
            "computations_changed": by_status["changed"],
            "computations_renamed": sum(1 for c in self.computations
                                        if c.old is not None and c.new is not None and c.old != c.new),
            "instructions_added": sum(len(c.added) if c.old is not None else c.instructions
                                      for c in self.computations if c.new is not None),
            "instructions_removed": sum(len(c.removed) if c.new is not None else c.instructions
                                        for c in self.computations if c.old is not None),
            "instructions_changed": sum(len(c.changed) for c in self.computations),
            "instructions_renamed": sum(len(c.renamed) for c in self.computations),
        }

    def to_json(self) -> dict:
        """The ``--json`` report; its keys are listed in docs/diff.md."""
        return {
            "identical": self.identical,
            "old_module": self.old_module,
            "new_module": self.new_module,
            "header": [{"attribute": k, "old": a, "new": b} for k, a, b in self.header],
            "computations": [c.to_json() for c in self.computations],
            "opcodes": {op: {"old": a, "new": b} for op, (a, b) in self.opcodes.items()},
            "summary": self.summary(),
        }

    def format(self, old_label: str = "old", new_label: str = "new", renames: bool = False) -> str:
        """The terminal report (``old_label``/``new_label``: what to call the two sides, e.g.
        paths); ``renames`` lists every renamed instruction, which otherwise are only counted."""
        return _format(self, old_label, new_label, renames)


class _Matcher:
    """Pairs the computations and instructions of two modules (see the module docstring)."""

    def __init__(self, old: HloModule, new: HloModule):
        self.old, self.new = old, new
        self.computation_pairs: dict[HloComputation, HloComputation] = {}
        self.computation_back: dict[HloComputation, HloComputation] = {}
        self.pairs: dict[HloInstruction, HloInstruction] = {}  # old -> new
        self.back: dict[HloInstruction, HloInstruction] = {}   # new -> old
        self.fingerprints = {**_fingerprints(old), **_fingerprints(new)}

    # -- computations ------------------------------------------------------------------------------
    def run(self) -> None:
        queue: collections.deque = collections.deque()

        def pair(a: HloComputation, b: HloComputation) -> None:
            self.computation_pairs[a] = b
            self.computation_back[b] = a
            queue.append((a, b))

        pair(self.old.entry, self.new.entry)
        new_by_name = {c.name: c for c in self.new.computations}
        for a in self.old.computations:
            b = new_by_name.get(a.name)
            if a not in self.computation_pairs and b is not None and b not in self.computation_back:
                pair(a, b)
        while queue:
            while queue:
                a, b = queue.popleft()
                self._match_instructions(a, b)
                for x in a.instructions:
                    y = self.pairs.get(x)
                    if y is None:
                        continue
                    for callee_a, callee_b in zip(x.called_computations, y.called_computations):
                        if callee_a not in self.computation_pairs and callee_b not in self.computation_back:
                            pair(callee_a, callee_b)
            waiting = collections.defaultdict(list)
            for b in self.new.computations:
                if b not in self.computation_back:
                    waiting[self.fingerprints[b]].append(b)
            for a in self.old.computations:
                candidates = waiting.get(self.fingerprints[a])
                if a not in self.computation_pairs and candidates:
                    pair(a, candidates.pop(0))

    # -- instructions -------------------------------------------------------------------------------
    def _pair(self, a: HloInstruction, b: HloInstruction) -> None:
        self.pairs[a] = b
        self.back[b] = a

    def _match_instructions(self, ca: HloComputation, cb: HloComputation) -> None:
        new_by_name = {i.name: i for i in cb.instructions}
        same_name_other_opcode = []  # paired only if nothing better turns up
        for a in ca.instructions:
            b = new_by_name.get(a.name)
            if b is None:
                continue
            if a.opcode == b.opcode:
                self._pair(a, b)
            else:
                same_name_other_opcode.append((a, b))
        new_params = {p.parameter_number: p for p in cb.parameters if p not in self.back}
        for a in ca.parameters:
            b = new_params.get(a.parameter_number)
            if a not in self.pairs and b is not None and b not in self.back:
                self._pair(a, b)
        order = cb.post_order()
        for permissive in (False, True):
            while self._bottom_up(ca, order, permissive) | self._top_down(ca, cb, order):
                pass
        for a, b in same_name_other_opcode:
            if a not in self.pairs and b not in self.back:
                self._pair(a, b)

    def _old_key(self, a: HloInstruction, loose: bool):
        """``a`` in the new module's terms: None while one of its operands is unmatched."""
        operands = tuple(self.pairs.get(o) for o in a.operands)
        if None in operands:
            return None
        if loose:
            return a.opcode, operands, str(a.shape) if not operands else None
        return (a.opcode, str(a.shape), operands, a.parameter_number, _literal_text(a),
                _attribute_signature(a, self.fingerprints.get, self.pairs.get))

    def _new_key(self, b: HloInstruction, loose: bool):
        operands = tuple(b.operands)
        if loose:
            return b.opcode, operands, str(b.shape) if not operands else None
        return (b.opcode, str(b.shape), operands, b.parameter_number, _literal_text(b),
                _attribute_signature(b, self.fingerprints.get, lambda i: i))

    def _bottom_up(self, ca: HloComputation, order: list[HloInstruction], permissive: bool) -> bool:
        """Match, operands first, each new instruction to an old one with the same key.

        Strict (not ``permissive``): only an exact key with a single candidate;
        look-alikes (two equal constants) are left for their users to tell apart
        (:meth:`_top_down`).  Permissive: the first exact candidate, else the
        first with the same opcode and operands (a changed shape or attribute).
        """
        keys = (False, True) if permissive else (False,)
        # Operand-less old instructions by key, since their keys do not depend on the matching.
        leaves = {loose: collections.defaultdict(list) for loose in keys}
        for a in ca.instructions:
            if not a.operands and a not in self.pairs:
                for loose in keys:
                    leaves[loose][self._old_key(a, loose)].append(a)
        progress = False
        for b in order:
            if b in self.back or any(o not in self.back for o in b.operands):
                continue
            if b.operands:
                first = self.back[b.operands[0]]
                pool = [a for a in dict.fromkeys(first.users) if a.parent is ca]
            for loose in keys:
                key = self._new_key(b, loose)
                if b.operands:
                    found = [a for a in pool if a not in self.pairs and self._old_key(a, loose) == key]
                else:
                    found = [a for a in leaves[loose].get(key, ()) if a not in self.pairs]
                if len(found) == 1 or (permissive and found):
                    self._pair(found[0], b)
                    progress = True
                    break
        return progress

    def _top_down(self, ca: HloComputation, cb: HloComputation, order: list[HloInstruction]) -> bool:
        """Match the unmatched operands at the same position of matched instructions (users
        first), when their opcodes agree; and the two ROOTs likewise."""
        progress = False
        if (ca.root not in self.pairs and cb.root not in self.back
                and ca.root.opcode == cb.root.opcode):
            self._pair(ca.root, cb.root)
            progress = True
        for b in reversed(order):
            a = self.back.get(b)
            if a is None:
                continue
            for x, y in zip(a.operands, b.operands):
                if x not in self.pairs and y not in self.back and x.opcode == y.opcode:
                    self._pair(x, y)
                    progress = True
        return progress

    # -- differences ------------------------------------------------------------------------------
    def _same_attribute(self, a_value, b_value, key: str) -> bool:
        if isinstance(a_value, HloComputation) or isinstance(b_value, HloComputation):
            return self.computation_pairs.get(a_value) is b_value
        if _refers_to_computations(a_value) or _refers_to_computations(b_value):
            return (isinstance(a_value, tuple) and isinstance(b_value, tuple)
                    and len(a_value) == len(b_value)
                    and all(self.computation_pairs.get(x) is y for x, y in zip(a_value, b_value)))
        if _refers_to_instructions(a_value) or _refers_to_instructions(b_value):
            return (isinstance(a_value, tuple) and isinstance(b_value, tuple)
                    and len(a_value) == len(b_value)
                    and all(self.pairs.get(x) is y for x, y in zip(a_value, b_value)))
        return _value_text(key, a_value) == _value_text(key, b_value)

    def changes(self, a: HloInstruction, b: HloInstruction) -> dict[str, tuple[str | None, str | None]]:
        """What differs between two matched instructions, as (old, new) text."""
        fields: dict[str, tuple[str | None, str | None]] = {}
        if a.opcode != b.opcode:
            fields["opcode"] = (a.opcode, b.opcode)
        if str(a.shape) != str(b.shape):
            fields["shape"] = (str(a.shape), str(b.shape))
        if a.parameter_number != b.parameter_number:
            fields["parameter_number"] = (_optional(a.parameter_number), _optional(b.parameter_number))
        if _literal_text(a) != _literal_text(b):
            fields["literal"] = (_optional_clip(_literal_text(a)), _optional_clip(_literal_text(b)))
        if (len(a.operands) != len(b.operands)
                or any(self.pairs.get(x) is not y for x, y in zip(a.operands, b.operands))):
            fields["operands"] = (_operand_list(a), _operand_list(b))
        if a.is_root != b.is_root:
            fields["root"] = ("yes" if a.is_root else "no", "yes" if b.is_root else "no")
        missing = object()
        for key in dict.fromkeys([*a.attrs, *b.attrs]):
            if key in IGNORED_ATTRS:
                continue
            a_value, b_value = a.attrs.get(key, missing), b.attrs.get(key, missing)
            if a_value is missing or b_value is missing or not self._same_attribute(a_value, b_value, key):
                fields[key] = (None if a_value is missing else _value_text(key, a_value),
                               None if b_value is missing else _value_text(key, b_value))
        return fields

    def computation_diff(self, ca: HloComputation, cb: HloComputation) -> ComputationDiff:
        result = ComputationDiff(ca.name, cb.name, cb.is_entry, len(cb.instructions))
        result.removed = [(a.name, instruction_text(a)) for a in ca.instructions if a not in self.pairs]
        for b in cb.instructions:
            a = self.back.get(b)
            if a is None:
                result.added.append((b.name, instruction_text(b)))
                continue
            if a.name != b.name:
                result.renamed.append((a.name, b.name))
            fields = self.changes(a, b)
            if fields:
                result.changed.append(InstructionChange(a.name, b.name, b.opcode, fields))
        return result


def _optional(value) -> str | None:
    return None if value is None else str(value)


def _optional_clip(text: str | None) -> str | None:
    return None if text is None else _clip(text)


def _operand_list(instr: HloInstruction) -> str:
    return "(" + ", ".join(f"%{op.name}" for op in instr.operands) + ")"


def _header(module: HloModule) -> dict[str, str]:
    fields = {"name": module.name}
    fields.update((key, _value_text(key, value)) for key, value in module.attrs.items())
    return fields


def diff_modules(old: HloModule, new: HloModule) -> ModuleDiff:
    """Match ``old`` and ``new`` (see the module docstring) and report what differs."""
    matcher = _Matcher(old, new)
    matcher.run()
    old_header, new_header = _header(old), _header(new)
    header = [(key, old_header.get(key), new_header.get(key))
              for key in dict.fromkeys([*old_header, *new_header])
              if old_header.get(key) != new_header.get(key)]
    computations = []
    for cb in new.computations:
        ca = matcher.computation_back.get(cb)
        if ca is None:
            computations.append(ComputationDiff(None, cb.name, cb.is_entry, len(cb.instructions)))
            continue
        found = matcher.computation_diff(ca, cb)
        if found.status != "same":
            computations.append(found)
    computations += [ComputationDiff(ca.name, None, ca.is_entry, len(ca.instructions))
                     for ca in old.computations if ca not in matcher.computation_pairs]
    old_counts = collections.Counter(i.opcode for i in old.instructions())
    new_counts = collections.Counter(i.opcode for i in new.instructions())
    opcodes = {op: (old_counts[op], new_counts[op]) for op in sorted(old_counts | new_counts)
               if old_counts[op] != new_counts[op]}
    return ModuleDiff(old.name, new.name, header, computations, opcodes)


# --- The terminal report -------------------------------------------------------------------------


def _format(diff: ModuleDiff, old_label: str, new_label: str, renames: bool) -> str:
    lines = [f"--- {old_label}: module {diff.old_module}", f"+++ {new_label}: module {diff.new_module}"]
    if diff.header:
        lines += ["", "header:"]
        lines += [f"  ~ {key}: {_shown(a)} -> {_shown(b)}" for key, a, b in diff.header]
    for comp in diff.computations:
        lines.append("")
        entry = " (entry)" if comp.is_entry else ""
        if comp.status == "added":
            lines.append(f"+ computation {comp.new}{entry}: added ({comp.instructions} instructions)")
            continue
        if comp.status == "removed":
            lines.append(f"- computation {comp.old}{entry}: removed ({comp.instructions} instructions)")
            continue
        name = comp.new if comp.old == comp.new else f"{comp.old} -> {comp.new}"
        counts = [f"{len(items)} {what}" for items, what in
                  ((comp.added, "added"), (comp.removed, "removed"), (comp.changed, "changed"),
                   (comp.renamed, "renamed")) if items]
        lines.append(f"computation {name}{entry}: {', '.join(counts) if counts else 'renamed'}")
        lines += [f"  - {text}" for _, text in comp.removed]
        lines += [f"  + {text}" for _, text in comp.added]
        if renames:
            lines += [f"  = %{a} -> %{b}" for a, b in comp.renamed]
        for change in comp.changed:
            name = change.new if change.old == change.new else f"{change.old} -> %{change.new}"
            lines.append(f"  ~ %{name} ({change.opcode})")
            lines += [f"      {field}: {_shown(a)} -> {_shown(b)}" for field, (a, b) in change.fields.items()]
    if diff.opcodes:
        lines += ["", "opcodes: " + ", ".join(f"{op} {a} -> {b}" for op, (a, b) in diff.opcodes.items())]
    s = diff.summary()
    lines.append("")
    if diff.identical:
        renamed = [f"{s[key]} {what}{'' if s[key] == 1 else 's'} renamed" for key, what in
                   (("computations_renamed", "computation"), ("instructions_renamed", "instruction"))
                   if s[key]]
        lines.append("identical" + (f" ({', '.join(renamed)})" if renamed else ""))
    else:
        lines.append(
            f"summary: computations {s['computations_changed']} changed, {s['computations_added']} "
            f"added, {s['computations_removed']} removed, {s['computations_renamed']} renamed; "
            f"instructions {s['instructions_changed']} changed, {s['instructions_added']} added, "
            f"{s['instructions_removed']} removed, {s['instructions_renamed']} renamed")
    return "\n".join(lines) + "\n"


def _shown(text: str | None) -> str:
    return "(none)" if text is None else text
