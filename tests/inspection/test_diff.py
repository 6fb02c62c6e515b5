"""hlo-tools diff: matching by name and structure, exact reports of IR edits, diff(1) exit codes."""

import io
import json
import pathlib
import re
import sys

import pytest

import hlo_tools
from hlo_tools.inspection import diff
from hlo_tools.inspection.diff import InstructionChange
from hlo_tools.ir.literal import Literal
from support import run_hlo_tools as run

SMALL = """HloModule small, replica_count=2

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY main {
  p = f32[8]{0} parameter(0)
  c = f32[] constant(1)
  b = f32[8]{0} broadcast(c), dimensions={}
  m = f32[8]{0} multiply(p, b)
  n = f32[8]{0} negate(m)
  r = f32[8]{0} all-reduce(n), replica_groups={{0,1}}, to_apply=add
  ROOT t = (f32[8]{0}, f32[8]{0}) tuple(r, m)
}
"""

ERROR_LINE = re.compile(r"hlo-tools: error: [^\n]+\n")
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "diff.md"

def reparsed(module: hlo_tools.HloModule) -> hlo_tools.HloModule:
    """The module as another tool would read it: printed and parsed again."""
    return hlo_tools.parse_module(module.to_text())


def change_constant(module, name, value):
    """Replace constant ``name`` by one with another value and the same name; the new one."""
    comp = module.find(name).parent
    old = comp.get(name)
    new = comp.add_instruction("constant", literal=Literal.parse(old.shape, value), after=old)
    old.replace_all_uses_with(new)
    comp.remove_instruction(old)
    new.rename(name)
    return new


def rename_everything(module) -> tuple[int, int]:
    """Give every instruction and non-entry computation a fresh name; (instructions, computations).

    Entry parameters keep theirs: renaming one rewrites the header's entry_computation_layout.
    """
    instructions = computations = 0
    for index, comp in enumerate(module.computations):
        for instr in list(comp.instructions):
            if not (comp.is_entry and instr.opcode == "parameter"):
                instr.rename(f"renamed_{instructions}")
                instructions += 1
        if not comp.is_entry:
            comp.name = f"renamed_computation_{index}"
            computations += 1
    return instructions, computations


# --- Matching ----------------------------------------------------------------------------------------


def test_module_against_itself_is_identical(jax_modules):
    for name, text in jax_modules.items():
        found = diff.diff_modules(hlo_tools.parse_module(text), hlo_tools.parse_module(text))
        assert found.identical and not found.computations and not found.opcodes, name


def test_regenerated_print_is_identical(jax_modules):
    for name, text in jax_modules.items():
        module = hlo_tools.parse_module(text)
        regenerated = hlo_tools.parse_module(module.to_text(regenerate=True))
        found = diff.diff_modules(module, regenerated)
        assert found.identical and not found.computations, name


@pytest.mark.parametrize("name", ["jax.flax_cnn_adam.before", "jax.flax_cnn_adam.after",
                                  "jax.scan_while.before", "jax.conditional.after"])
def test_renamed_module_is_identical_with_every_rename_reported(jax_modules, name):
    module = hlo_tools.parse_module(jax_modules[name])
    renamed = hlo_tools.parse_module(jax_modules[name])
    instructions, computations = rename_everything(renamed)
    found = diff.diff_modules(module, hlo_tools.parse_module(renamed.to_text(regenerate=True)))
    assert found.identical
    summary = found.summary()
    assert (summary["instructions_renamed"], summary["computations_renamed"]) == (instructions, computations)
    assert not any(summary[k] for k in summary if not k.endswith("_renamed"))


def test_edits_of_a_renamed_module_are_found_by_structure(jax_modules):
    """Every name differs, yet exactly the three edits are reported."""
    text = jax_modules["jax.flax_cnn_adam.before"]
    module, edited = hlo_tools.parse_module(text), hlo_tools.parse_module(text)
    body = max(edited.computations, key=len)  # the shard_map body: the model and optimizer
    dot = next(i for i in body.instructions if i.opcode == "dot")
    dot_user = dot.users[0]
    constant = next(i for i in body.instructions
                    if i.opcode == "constant" and i.shape.is_scalar and i.literal.text != "42")
    old_names = {"constant": constant.name, "dot_user": dot_user.name}
    new_constant = change_constant(edited, constant.name, "42")
    negate = body.add_instruction("negate", [dot], after=dot)
    dot_user.replace_operand_with(dot, negate)
    rename_everything(edited)
    found = diff.diff_modules(module, reparsed(edited))

    (comp,) = [c for c in found.computations if c.status != "renamed"]
    assert (comp.old, comp.status) == (module.computations[edited.computations.index(body)].name, "changed")
    assert ([name for name, _ in comp.added], comp.removed) == ([negate.name], [])
    assert {(c.old, c.new): c.fields for c in comp.changed} == {
        (old_names["constant"], new_constant.name): {"literal": (constant.literal.text, "42")},
        (old_names["dot_user"], dot_user.name): {
            "operands": (operand_list(module.find(old_names["dot_user"])), operand_list(dot_user))},
    }
    negates = sum(1 for i in module.instructions() if i.opcode == "negate")
    assert found.opcodes == {"negate": (negates, negates + 1)}


def operand_list(instr) -> str:
    return "(" + ", ".join(f"%{o.name}" for o in instr.operands) + ")"


# --- Exact reports of IR edits ------------------------------------------------------------------------


def test_changed_constant():
    edited = hlo_tools.parse_module(SMALL)
    change_constant(edited, "c", "2")
    found = diff.diff_modules(hlo_tools.parse_module(SMALL), reparsed(edited))
    (comp,) = found.computations
    assert (comp.old, comp.new, comp.added, comp.removed, comp.renamed) == ("main", "main", [], [], [])
    assert comp.changed == [InstructionChange("c", "c", "constant", {"literal": ("1", "2")})]
    assert found.opcodes == {} and not found.identical


def test_added_instruction():
    edited = hlo_tools.parse_module(SMALL)
    main = edited.entry
    n, r = main.get("n"), main.get("r")
    e = main.add_instruction("exponential", [n], after=n, name="e")
    r.set_operand(0, e)
    found = diff.diff_modules(hlo_tools.parse_module(SMALL), reparsed(edited))
    (comp,) = found.computations
    assert comp.added == [("e", "%e = f32[8]{0} exponential(%n)")]
    assert comp.removed == []
    assert comp.changed == [InstructionChange("r", "r", "all-reduce", {"operands": ("(%n)", "(%e)")})]
    assert found.opcodes == {"exponential": (0, 1)}


def test_removed_instruction():
    edited = hlo_tools.parse_module(SMALL)
    main = edited.entry
    main.get("r").set_operand(0, main.get("m"))
    main.remove_instruction(main.get("n"))
    found = diff.diff_modules(hlo_tools.parse_module(SMALL), reparsed(edited))
    (comp,) = found.computations
    assert comp.removed == [("n", "%n = f32[8]{0} negate(%m)")]
    assert comp.added == []
    assert comp.changed == [InstructionChange("r", "r", "all-reduce", {"operands": ("(%n)", "(%m)")})]
    assert found.opcodes == {"negate": (1, 0)}


def test_changed_attribute_and_header():
    edited = hlo_tools.parse_module(SMALL)
    edited.find("r").attrs["replica_groups"] = hlo_tools.ReplicaGroups.of([[0], [1]])
    edited.set_attr("replica_count", 1)
    found = diff.diff_modules(hlo_tools.parse_module(SMALL), reparsed(edited))
    assert found.header == [("replica_count", "2", "1")]
    (comp,) = found.computations
    assert comp.changed == [InstructionChange("r", "r", "all-reduce",
                                              {"replica_groups": ("{{0,1}}", "{{0},{1}}")})]


def test_renamed_and_changed_callee_is_matched_through_its_caller():
    edited = hlo_tools.parse_module(SMALL)
    reducer = edited.computation("add")
    reducer.name = "maximum_reducer"
    x, y = reducer.parameters
    biggest = reducer.add_instruction("maximum", [x, y], name="biggest")
    old_root = reducer.root
    reducer.set_root(biggest)
    reducer.remove_instruction(old_root)
    found = diff.diff_modules(hlo_tools.parse_module(SMALL),
                              hlo_tools.parse_module(edited.to_text(regenerate=True)))
    (comp,) = found.computations  # main's all-reduce still calls the matched reducer: no change
    assert (comp.old, comp.new, comp.status) == ("add", "maximum_reducer", "changed")
    assert comp.removed == [("s", "ROOT %s = f32[] add(%x, %y)")]
    assert comp.added == [("biggest", "ROOT %biggest = f32[] maximum(%x, %y)")]
    assert found.opcodes == {"add": (1, 0), "maximum": (0, 1)}


def test_changed_opcode_and_added_or_removed_computation():
    multiplying = hlo_tools.parse_module(SMALL.replace("ROOT s = f32[] add", "ROOT s = f32[] multiply"))
    with_spare = hlo_tools.parse_module(SMALL)
    with_spare.clone_computation(with_spare.computation("add"), suffix="spare")
    with_spare = reparsed(with_spare)

    found = diff.diff_modules(multiplying, with_spare)
    changed, added = found.computations
    assert (changed.old, changed.new, changed.status) == ("add", "add", "changed")
    assert changed.changed == [InstructionChange("s", "s", "add", {"opcode": ("multiply", "add")})]
    assert (added.old, added.new, added.status, added.instructions) == (None, "add.spare", "added", 3)
    assert found.opcodes == {"add": (0, 2), "multiply": (2, 1), "parameter": (3, 5)}

    (_, removed) = diff.diff_modules(with_spare, multiplying).computations
    assert (removed.old, removed.new, removed.status) == ("add.spare", None, "removed")
    assert diff.diff_modules(with_spare, multiplying).summary()["instructions_removed"] == 3


def test_all_reduce_combiner_pass_in_an_xla_dump(xla_dump_modules):
    """XLA's CPU all-reduce combiner: all-reduces become tuple all-reduces and get-tuple-elements."""
    (before,) = [t for k, t in xla_dump_modules.items() if k.endswith("before_cpu-all-reduce-combiner")]
    (after,) = [t for k, t in xla_dump_modules.items() if ".after_cpu-all-reduce-combiner." in k]
    found = diff.diff_modules(hlo_tools.parse_module(before), hlo_tools.parse_module(after))
    (comp,) = found.computations
    assert comp.is_entry and comp.status == "changed"
    assert comp.removed and all(" all-reduce(" in text for _, text in comp.removed)
    combined = [text for _, text in comp.added if " all-reduce(" in text]
    assert combined and all(re.search(r"= \(f32\[.*\) all-reduce\(%[^,)]+, %", t) for t in combined)
    assert {re.search(r" ([a-z-]+)\(", text).group(1) for _, text in comp.added} == {
        "all-reduce", "get-tuple-element"}
    assert comp.changed and all(set(c.fields) == {"operands"} for c in comp.changed)
    old_count, new_count = found.opcodes["all-reduce"]
    assert old_count - new_count == len(comp.removed) - len(combined)
    assert found.opcodes["get-tuple-element"][1] - found.opcodes["get-tuple-element"][0] == \
        len(comp.added) - len(combined)


# --- The command -------------------------------------------------------------------------------------


@pytest.fixture
def small_files(tmp_path):
    """SMALL, and SMALL with its constant changed and an exponential added."""
    old = tmp_path / "old.hlo"
    old.write_text(SMALL)
    edited = hlo_tools.parse_module(SMALL)
    change_constant(edited, "c", "2")
    n = edited.find("n")
    e = n.parent.add_instruction("exponential", [n], after=n, name="e")
    edited.find("r").set_operand(0, e)
    new = tmp_path / "new.hlo"
    new.write_text(edited.to_text())
    return old, new


def test_identical_files_exit_0(capsys, small_files):
    old, _ = small_files
    status, out, err = run(capsys, "diff", old, old)
    assert (status, err) == (0, "")
    assert out == f"--- {old}: module small\n+++ {old}: module small\n\nidentical\n"


def test_report_and_exit_1(capsys, small_files):
    old, new = small_files
    status, out, err = run(capsys, "diff", old, new)
    assert (status, err) == (1, "")
    assert out == f"""--- {old}: module small
+++ {new}: module small

computation main (entry): 1 added, 2 changed
  + %e = f32[8]{{0}} exponential(%n)
  ~ %c (constant)
      literal: 1 -> 2
  ~ %r (all-reduce)
      operands: (%n) -> (%e)

opcodes: exponential 0 -> 1

summary: computations 1 changed, 0 added, 0 removed, 0 renamed; instructions 2 changed, 1 added, 0 removed, 0 renamed
"""


def test_json_report(capsys, small_files):
    old, new = small_files
    status, out, _ = run(capsys, "diff", "--json", old, new)
    assert status == 1
    report = json.loads(out)
    assert report["identical"] is False
    assert (report["old_module"], report["new_module"], report["header"]) == ("small", "small", [])
    (comp,) = report["computations"]
    assert {k: comp[k] for k in ("old", "new", "status", "entry", "removed", "renamed")} == {
        "old": "main", "new": "main", "status": "changed", "entry": True, "removed": [], "renamed": []}
    assert comp["added"] == [{"name": "e", "text": "%e = f32[8]{0} exponential(%n)"}]
    assert comp["changed"] == [
        {"old": "c", "new": "c", "opcode": "constant", "changes": {"literal": {"old": "1", "new": "2"}}},
        {"old": "r", "new": "r", "opcode": "all-reduce",
         "changes": {"operands": {"old": "(%n)", "new": "(%e)"}}}]
    assert report["opcodes"] == {"exponential": {"old": 0, "new": 1}}
    assert report["summary"]["instructions_changed"] == 2
    status, out, _ = run(capsys, "diff", "--json", old, old)
    assert status == 0 and json.loads(out)["identical"] is True


def test_json_keys_are_documented(capsys, small_files):
    old, new = small_files
    report = json.loads(run(capsys, "diff", "--json", old, new)[1])
    (comp,) = report["computations"]
    keys = (set(report) | set(report["summary"]) | set(comp) | set(comp["added"][0])
            | set(comp["changed"][0]))
    page = DOC.read_text(encoding="utf-8")
    for key in keys:
        assert f"`{key}`" in page or f'"{key}"' in page, f"docs/diff.md does not describe {key}"


def test_renames_are_listed_on_request(capsys, tmp_path, small_files):
    old, _ = small_files
    renamed = tmp_path / "renamed.hlo"
    renamed.write_text(SMALL.replace("n = ", "neg = ").replace("all-reduce(n)", "all-reduce(neg)"))
    status, out, _ = run(capsys, "diff", old, renamed)
    assert status == 0
    assert out.endswith("\ncomputation main (entry): 1 renamed\n\nidentical (1 instruction renamed)\n")
    status, out, _ = run(capsys, "diff", "--renames", old, renamed)
    assert status == 0 and "\ncomputation main (entry): 1 renamed\n  = %n -> %neg\n" in out


def test_one_module_from_stdin(capsys, monkeypatch, small_files):
    old, new = small_files
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(old.read_bytes())))
    status, out, _ = run(capsys, "diff", "-", new)
    assert status == 1 and out.startswith("--- -: module small\n")


def test_trouble_is_one_line_with_exit_2(capsys, small_files, tmp_path):
    old, _ = small_files
    missing = tmp_path / "missing.hlo"
    assert run(capsys, "diff", old, missing) == (
        2, "", f"hlo-tools: error: {missing}: No such file or directory\n")
    bad = tmp_path / "bad.hlo"
    bad.write_text(SMALL.replace("negate(m)", "negate(m"))
    status, out, err = run(capsys, "diff", bad, old)
    assert (status, out) == (2, "")
    assert err == f"hlo-tools: error: {bad}:15:3: expects ',' or ')' in the operand list\n"
    status, _, err = run(capsys, "diff", "-", "-")
    assert status == 2 and ERROR_LINE.fullmatch(err)
    status, _, err = run(capsys, "diff", old)  # usage errors keep argparse's 2
    assert status == 2 and "usage: hlo-tools diff" in err
