"""The pass API and pipelines: text, options, fixed points, verification, rollback, dumps."""

import collections
import glob
import os
import re

import pytest

import hlo_tools
import xla_passes
from xla_passes import HloPass, PassError, Pipeline, parse_pipeline

MODULE = """HloModule pipeline_test

ENTRY main {
  p = f32[8] parameter(0)
  a = f32[8] multiply(p, p)
  b = f32[8] multiply(p, p)
  dead = f32[8] negate(p)
  ROOT r = f32[8] add(a, b)
}
"""


class _EditThenRaise(HloPass):
    """Test pass: changes the module, then fails."""

    name = "test-edit-then-raise"

    def run(self, module):
        root = module.entry.root
        root.parent.add_instruction("negate", [root])
        root.attrs["metadata"] = hlo_tools.Metadata.parse('{op_name="edited"}')
        raise self.fail("boom", root)


class _BreakShape(HloPass):
    """Test pass: gives the root a wrong shape, which the verifier must catch."""

    name = "test-break-shape"

    def run(self, module):
        module.entry.root.set_shape(hlo_tools.parse_shape("f32[9]"))
        return True


class _Crash(HloPass):
    """Test pass: an unexpected exception."""

    name = "test-crash"

    def run(self, module):
        module.entry.remove_instruction(module.entry.get("dead"))
        return {}["missing"]


def test_pipeline_text_round_trips_through_str():
    text = "fixed-point{max_iterations=3}(cse,dce{remove_computations=false}),tuple-simplifier"
    assert str(Pipeline(text)) == text
    assert str(Pipeline("dce{remove_computations=true}")) == "dce"  # defaults are not printed


@pytest.mark.parametrize("text, message", [
    ("dcx", "unknown pass 'dcx' (valid passes: "),
    ("dce{foo=1}", "pass dce: unknown option 'foo' (valid options: remove_computations)"),
    ("dce{remove_computations=maybe}", "option remove_computations='maybe' is not a valid bool"),
    ("dce,,cse", "column 5: expected a pass name"),
    ("dce{remove_computations", "unclosed '{'"),
    ("fixed-point(dce", "expected ',' or ')'"),
    ("fixed-point", "fixed-point needs a group of passes in parentheses"),
    ("fixed-point{max_iterations=0}(dce)", "max_iterations must be at least 1"),
    ("", "empty pipeline"),
    ("all-reduce-combiner{threshold_bytes=-5}", "option threshold_bytes='-5' must not be negative"),
    ("spatial-partitioning{num_partitions=4,num_partitions=2}", "option 'num_partitions' is given twice"),
])
def test_bad_pipeline_text_is_one_clear_error(text, message):
    with pytest.raises(PassError) as info:
        parse_pipeline(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_pass_error_lists_every_registered_pass():
    with pytest.raises(PassError) as info:
        parse_pipeline("no-such-pass")
    for name in xla_passes.registered_passes():
        assert name in str(info.value)


def test_run_reports_change_and_logs_each_pass():
    module = hlo_tools.parse_module(MODULE)
    pipeline = Pipeline("fixed-point(cse,dce),dce")
    assert pipeline.run(module)
    names = [(run.name, run.changed) for run in pipeline.log]
    # cse and dce change the module once, then a quiet round ends the fixed point.
    assert names == [("cse", True), ("dce", True), ("cse", False), ("dce", False), ("dce", False)]
    assert [i.name for i in module.entry.instructions] == ["p", "a", "r"]
    assert not Pipeline("cse,dce").run(module)


def test_fixed_point_stops_at_max_iterations():
    class AlwaysChanges(HloPass):
        name = "test-always-changes"

        def run(self, module):
            return True

    group = xla_passes.FixedPoint([AlwaysChanges()], max_iterations=4)
    pipeline = Pipeline([group], verify=False)
    assert pipeline.run(hlo_tools.parse_module(MODULE))
    assert len(pipeline.log) == 4


@pytest.mark.parametrize("bad_pass, expected", [
    (_EditThenRaise(), "pass test-edit-then-raise at %r: boom"),
    (_BreakShape(), "pass test-break-shape at %r: produced an invalid module"),
    (_Crash(), "pass test-crash: KeyError: 'missing'"),
])
def test_a_failing_pass_leaves_the_module_as_it_was(bad_pass, expected):
    module = hlo_tools.parse_module(MODULE)
    xla_passes.run_passes(module, "cse")  # an edited module, not only a freshly parsed one
    before = module.to_text()
    with pytest.raises(PassError) as info:
        Pipeline([bad_pass]).run(module)
    assert str(info.value).startswith(expected)
    assert module.to_text() == before
    hlo_tools.verify(module)
    # The restored module is still a working IR: passes run on it.
    assert xla_passes.run_passes(module, "dce")
    assert "dead" not in module.to_text()


def test_verify_false_lets_an_invalid_module_through():
    module = hlo_tools.parse_module(MODULE)
    assert Pipeline([_BreakShape()], verify=False).run(module)
    with pytest.raises(hlo_tools.HloVerifyError):
        hlo_tools.verify(module)


def test_dump_writes_the_module_before_and_after_every_pass(tmp_path):
    module = hlo_tools.parse_module(MODULE)
    Pipeline("cse,dce", dump_to=str(tmp_path), module_number=7).run(module)
    files = sorted(os.listdir(tmp_path))
    assert files == ["module_0007.pipeline_test.0001.after_cse.txt",
                     "module_0007.pipeline_test.0002.after_dce.txt",
                     "module_0007.pipeline_test.before_xla_passes.txt"]
    assert (tmp_path / files[2]).read_text() == MODULE
    after_dce = (tmp_path / files[1]).read_text()
    assert after_dce == module.to_text() and "dead" not in after_dce
    assert "dead" in (tmp_path / files[0]).read_text()  # cse alone keeps it


def test_options_are_typed_and_printed_back():
    cls = xla_passes.pass_class("dce")
    assert cls.from_options({"remove_computations": "false"}).remove_computations is False
    assert str(cls(remove_computations=False)) == "dce{remove_computations=false}"
    assert cls.description()


def test_a_pass_report_goes_into_its_dump_and_the_pipeline_reports(tmp_path):
    class Reporting(HloPass):
        name = "test-reporting"

        def run(self, module):
            self.report = ["kept %a: a reason", "sharded %b"]
            return False

    pipeline = Pipeline([Reporting()], dump_to=str(tmp_path))
    module = hlo_tools.parse_module(MODULE)
    pipeline.run(module)
    assert pipeline.reports() == ["kept %a: a reason", "sharded %b"]
    dumped = (tmp_path / "module_0000.pipeline_test.0001.after_test-reporting.txt").read_text()
    assert dumped == "// kept %a: a reason\n// sharded %b\n" + MODULE
    assert hlo_tools.parse_module(dumped).to_text() == dumped


# --- what passes declare they act on (the JAX hook's precheck) ---------------------------------------

PASS_TEST_MODULES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.hlo")))


def test_could_change_reads_the_opcodes_passes_declare():
    counts = {"all-reduce": 1}

    def count_of(opcode):
        return counts.get(opcode, 0)

    assert not Pipeline("all-reduce-combiner,call-inliner,tuple-simplifier").could_change(count_of)
    assert Pipeline("collective-fusion").could_change(count_of)  # its simplifier: one all-reduce is enough
    assert Pipeline("fixed-point(all-reduce-combiner,all-reduce-decomposer)").could_change(count_of)
    assert Pipeline("all-reduce-combiner,dce").could_change(count_of)  # dce declares none: any module
    counts["all-reduce"] = 2
    assert Pipeline("all-reduce-combiner").could_change(count_of)
    counts["all-reduce"] = 0
    assert not Pipeline("collective-fusion").could_change(count_of)
    assert Pipeline([_BreakShape()]).could_change(lambda opcode: 0)  # a pass of a user's, no opcodes


def test_a_pass_changes_no_module_it_says_it_cannot_change():
    """Every built-in pass that declares `opcodes`, on every module of the FileCheck tests: when it says
    the module's opcode counts leave it nothing to do, running it changes nothing."""
    declaring = {}
    for name, cls in xla_passes.registered_passes().items():
        if not cls.__module__.startswith("xla_passes."):
            continue  # a test's own pass
        try:
            declaring[name] = cls()
        except (PassError, TypeError, ValueError):
            continue  # a pass that needs options (all-reduce-2d: a mesh)
    declaring = {name: p for name, p in declaring.items() if p.opcodes is not None}
    assert {"collective-fusion", "all-reduce-combiner", "call-inliner", "tuple-simplifier"} <= set(declaring)
    checked = {True: 0, False: 0}
    for path in PASS_TEST_MODULES:
        with open(path, encoding="utf-8") as f:
            chunks = f.read().split("\n// -----\n")
        for chunk in chunks:
            text = chunk[re.search(r"^HloModule\b", chunk, re.M).start():]
            counts = collections.Counter(instr.opcode for instr in hlo_tools.parse_module(text).instructions())
            for name, hlo_pass in declaring.items():
                could = hlo_pass.could_change(counts.__getitem__)
                checked[could] += 1
                if not could:
                    assert not hlo_pass.run(hlo_tools.parse_module(text)), (path, name)
    assert checked[False] > 100 and checked[True] > 50, checked


def test_verify_true_checks_the_edits_and_full_the_whole_module():
    problem = MODULE.replace("dead = f32[8] negate(p)", "dead = f32[9] negate(p)")  # an unedited problem
    assert Pipeline("cse").run(hlo_tools.parse_module(problem))
    with pytest.raises(PassError, match=r"pass cse at %dead: produced an invalid module: .*f32\[9\]"):
        Pipeline("cse", verify="full").run(hlo_tools.parse_module(problem))
    module = hlo_tools.parse_module(MODULE)
    with pytest.raises(PassError, match="pass test-break-shape at %r: produced an invalid module"):
        Pipeline([_BreakShape()]).run(module)  # the edited instruction is checked
    with pytest.raises(PassError, match="verify='yes': expected True, 'full' or False"):
        Pipeline("dce", verify="yes")
