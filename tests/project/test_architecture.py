"""The shape of the packages, read from their source (nothing is imported or run).

- No import cycle among the modules of `hlo_tools`, `xla_passes` and `xla_passes_demo`: the
  module import graph has no strongly connected component of more than one module (nor a module
  importing itself).
- Imports point one way between the packages: `xla_passes_demo` (the model zoo and the demo,
  beside the library) may import `xla_passes` and `hlo_tools`, `xla_passes` may import
  `hlo_tools`, never back.
- Inside `xla_passes`, the pass manager, the shared modules and the passes never import the
  front ends or the tools (`xla_passes.frontends`, `xla_passes.tools`, the public modules
  `xla_passes.jax`, `xla_passes.flags`, `xla_passes.tensorflow` that re-export the front ends).
- No file in `xla_passes/passes/` imports another file of `xla_passes/passes/`: shared code lives
  in shared modules (`xla_passes.analysis`, `xla_passes.rewrites`), passes hold passes.

The graph counts every import statement wherever it runs (module level, in functions, in `try`;
not under `if TYPE_CHECKING:`, which never runs), `from . import x` as an import of the module `x`, `from package import name` as an import of the
package (of its `__init__`) unless `name` is a module of it, and `importlib.import_module("...")`
with a literal name. Importing `a.b.c` is an edge to `a.b.c` only (not to the packages `a` and
`a.b` whose `__init__` Python runs first: those hold no code that imports back, which the first
test checks for them as for any module).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("hlo_tools", "xla_passes", "xla_passes_demo")
# Each package with the packages it may import (besides itself): imports point one way.
MAY_IMPORT = {"hlo_tools": set(), "xla_passes": {"hlo_tools"}, "xla_passes_demo": {"hlo_tools", "xla_passes"}}
# The top layers of xla_passes, which nothing below them imports.
FRONT_ENDS_AND_TOOLS = ("xla_passes.frontends", "xla_passes.tools", "xla_passes.jax", "xla_passes.flags",
                        "xla_passes.tensorflow")
PASSES = "xla_passes.passes"

# Pass files that still import another pass, each with what it imports and why. Empty is the goal;
# the test fails when an entry here no longer imports what it says (so that it is taken out).
KNOWN_PASS_IMPORTS: dict[str, set[str]] = {}


def module_files() -> dict[str, pathlib.Path]:
    """Every module of the packages by dotted name (a package by its own name, for its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: dict[str, pathlib.Path]) -> bool:
    return modules[name].name == "__init__.py"


def _known_prefix(name: str, modules) -> str | None:
    """`name`, or the longest dotted prefix of it that is one of our modules (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(name: str, modules: dict[str, pathlib.Path]) -> dict[str, int]:
    """The modules of the packages that module `name` imports, each with the line of its first import."""
    path = modules[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None:  # (a module importing itself is a cycle of one)
            found.setdefault(target, line)

    for node in _executed_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known_prefix(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else _known_prefix(base, modules), node.lineno)
        elif isinstance(node, ast.Call) and _is_import_module_call(node):
            add(_known_prefix(node.args[0].value, modules), node.lineno)
    return found


def _executed_nodes(tree: ast.AST):
    """Every node of `tree` but those in the body of an `if TYPE_CHECKING:` (annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module"
             and isinstance(func.value, ast.Name) and func.value.id == "importlib") or (
        isinstance(func, ast.Name) and func.id == "import_module")
    return named and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)


def import_graph() -> tuple[dict[str, dict[str, int]], dict[str, pathlib.Path]]:
    modules = module_files()
    return {name: imports_of(name, modules) for name in modules}, modules


def strongly_connected_components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components of more than one module, or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in graph:
                    continue
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        components.append(sorted(component))
    return sorted(components)


def a_cycle(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if successor in members and successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def describe(cycle: list[str], graph, modules) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        where = modules[a].relative_to(ROOT)
        steps.append(f"    {a} -> {b}  ({where}:{graph[a][b]})")
    return "\n".join(steps)


def test_import_graph_sees_the_packages():
    graph, modules = import_graph()
    assert "hlo_tools.ir.hlo" in graph and "xla_passes.core" in graph
    assert "xla_passes.passes" in graph and _is_package("xla_passes.passes", modules)
    # Relative imports of both spellings resolve to the modules they name.
    assert "xla_passes.core" in graph["xla_passes.passes.dce"]
    assert "xla_passes.passes.dce" in graph["xla_passes.passes"]


def test_imports_seen_wherever_they_run(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import typing\nif typing.TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                      "def f():\n    from c import d\n    importlib.import_module('e')\n")
    modules = {"m": source, "a": source, "b": source, "c": source, "c.d": source, "e": source}
    assert sorted(imports_of("m", modules)) == ["b", "c.d", "e"]


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"d": 4}, "e": {"a": 5}}
    assert strongly_connected_components(graph) == [["a", "b", "c"], ["d"]]
    assert a_cycle(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    assert a_cycle(["d"], graph) == ["d", "d"]


def test_no_import_cycles():
    graph, modules = import_graph()
    components = strongly_connected_components(graph)
    report = []
    for component in components:
        report.append(f"  {len(component)} modules: {', '.join(component)}\n  for example:\n"
                      + describe(a_cycle(component, graph), graph, modules))
    assert not components, "import cycles:\n" + "\n".join(report)


def test_passes_import_no_other_pass():
    graph, modules = import_graph()
    found = {}
    for name, targets in graph.items():
        if name.startswith(PASSES + ".") and name.count(".") == PASSES.count(".") + 1:
            others = {t for t in targets if t.startswith(PASSES + ".") or t == PASSES}
            if others:
                found[name] = others
    for name, expected in KNOWN_PASS_IMPORTS.items():
        assert found.pop(name, set()) == expected, f"{name} no longer imports just {sorted(expected)}: update KNOWN_PASS_IMPORTS"
    lines = [f"  {modules[name].relative_to(ROOT)}:{graph[name][t]} imports {t}"
             for name in sorted(found) for t in sorted(found[name])]
    assert not found, "pass files that import other pass files:\n" + "\n".join(lines)



def _package_of(name: str) -> str:
    return name.partition(".")[0]


def _in(name: str, prefixes) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def test_imports_point_one_way_between_the_packages():
    graph, modules = import_graph()
    assert {_package_of(name) for name in graph} == set(MAY_IMPORT)
    found = [f"  {modules[name].relative_to(ROOT)}:{line} imports {target}"
             for name in sorted(graph) for target, line in sorted(graph[name].items())
             if _package_of(target) != _package_of(name) and _package_of(target) not in MAY_IMPORT[_package_of(name)]]
    assert not found, "imports against the packages' order (xla_passes_demo -> xla_passes -> hlo_tools):\n" + "\n".join(found)


def test_below_the_front_ends_nothing_imports_them():
    graph, modules = import_graph()
    assert "xla_passes.frontends.jax" in graph and "xla_passes.tools.opt" in graph
    found = [f"  {modules[name].relative_to(ROOT)}:{line} imports {target}"
             for name in sorted(graph) if _package_of(name) == "xla_passes" and not _in(name, FRONT_ENDS_AND_TOOLS)
             for target, line in sorted(graph[name].items()) if _in(target, FRONT_ENDS_AND_TOOLS)]
    assert not found, "the pass manager, shared modules and passes import the front ends or tools:\n" + "\n".join(found)


# The IR's edit state, which only hlo_tools.ir reads directly; others use the public accessors
# (`source_text`, `source_span`, `edited`, `computations_edited`, `header_edited`, ...).
IR_PRIVATE_STATE = frozenset({"_span", "_dirty", "_source", "_header_stale", "_shape_set", "_edited_operands_only",
                              "_head_span", "_tail_span", "_header_span", "_gaps", "_trailing"})
IR = "hlo_tools.ir"

# Imports of a command module of hlo_tools.cli from outside it, each with why it stays.
KNOWN_CLI_IMPORTS: dict[str, set[str]] = {
    # xla-opt takes hlo-tools cost's machine options; `add_machine_options` moves out of
    # hlo_tools.cli.cost_command when that package is free to edit (issue 22).
    "xla_passes.tools.opt": {"hlo_tools.cli.cost_command"},
}


def test_no_private_names_imported_across_modules():
    graph, modules = import_graph()
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _executed_nodes(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                targets = [t for t, line in graph[name].items() if line == node.lineno]
                if private and targets:
                    found.append(f"  {path.relative_to(ROOT)}:{node.lineno} imports {', '.join(private)}")
            elif (isinstance(node, ast.Attribute) and node.attr in IR_PRIVATE_STATE
                  and not (name == IR or name.startswith(IR + "."))):
                found.append(f"  {path.relative_to(ROOT)}:{node.lineno} reads .{node.attr} of the IR")
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_command_module_imported_from_outside_the_cli():
    """`hlo_tools.cli` (the package) is the command lines' shared toolkit; its command modules
    (`hlo_tools.cli.cost_command`, ...) are the commands themselves, no one else's to import."""
    graph, modules = import_graph()
    found = {}
    for name, targets in graph.items():
        if name.startswith("hlo_tools.cli"):
            continue
        commands = {t for t in targets if t.startswith("hlo_tools.cli.")}
        if commands:
            found[name] = commands
    for name, expected in KNOWN_CLI_IMPORTS.items():
        assert found.pop(name, set()) == expected, f"{name} no longer imports just {sorted(expected)}: update KNOWN_CLI_IMPORTS"
    assert not found, f"modules outside hlo_tools.cli that import its command modules: {found}"


def test_every_package_is_installed():
    """pyproject.toml lists the packages setuptools installs: every package of the two is there."""
    import tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    _, modules = import_graph()
    packages = {name for name in modules if _is_package(name, modules)}
    assert packages == listed, f"not installed: {sorted(packages - listed)}; not packages: {sorted(listed - packages)}"
