"""Pipelines: passes built from text, run in order, verified, dumped, rolled back on failure.

Pipeline text is a comma-separated list of passes, each with optional options in
braces; `fixed-point(...)` repeats a group until no pass in it changes the module::

    all-reduce-combiner{threshold_bytes=1048576,threshold_count=256},dce
    fixed-point{max_iterations=10}(tuple-simplifier,cse,dce)

Running a pipeline runs each pass on the module in place. After a pass that
changed the module, the verifier checks what was edited since the module was
parsed (`hlo_tools.ir.verifier.verify_edits`; `verify="full"` checks the whole
module, `verify=False` nothing). A pass that raises, or that leaves a module
the verifier refuses, leaves the module exactly as it was before that pass and
raises `PassError` naming the pass (and the instruction, when known): the pipeline takes a
`HloModule.checkpoint` before each pass (copies of the objects' state, no text) and restores it.

Each pass gets the run's `PassContext` (`run(module, context)`): the platform's combiner
thresholds, whether layouts are final, and analyses cached between passes that keep them valid.
A composite pass (`PassPipeline`, e.g. `collective-fusion`) runs its passes as one step.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import time

import hlo_tools
from hlo_tools import HloModule
from hlo_tools.xla.dump import module_file_name, sanitize_file_name, write_new, write_numbered
from hlo_tools.ir.verifier import verify_edits, verify_module

from .analysis.collectives import DIMENSIONED_COLLECTIVES, layout_problem, platform_thresholds
from .analysis.replica_groups import inferred_device_counts
from .core import HloPass, PassContext, PassError, PassPipeline, run_pass
from .rewrites.inlining import inline_calls
from .registry import pass_class

FIXED_POINT = "fixed-point"
# How deep fixed-point groups may nest in pipeline text (deeper text is refused, not recursed into).
MAX_FIXED_POINT_NESTING = 16
# The first line of every dump of a module whose layouts are final; xla-opt reads it back, and
# hlo-tools the stage of XLA's pipeline the module was taken at, which that line goes on to name.
LAYOUTS_FINAL_NOTE = "xla_passes: layouts final (after XLA's layout assignment)"

# Pipeline(verify=...): every edit since parsing (True), the whole module (FULL), nothing (False).
FULL = "full"
VERIFY_CHOICES = (True, FULL, False)


@dataclasses.dataclass
class PassRun:
    """What one pass did in a pipeline run."""

    name: str
    changed: bool
    seconds: float


class FixedPoint:
    """A group of passes run again and again until none of them changes the module."""

    def __init__(self, passes: list, max_iterations: int = 25):
        if max_iterations < 1:
            raise PassError("max_iterations must be at least 1", FIXED_POINT)
        self.passes = passes
        self.max_iterations = max_iterations

    def __str__(self) -> str:
        options = f"{{max_iterations={self.max_iterations}}}" if self.max_iterations != 25 else ""
        return f"{FIXED_POINT}{options}({','.join(str(p) for p in self.passes)})"


class Pipeline:
    """Passes (and fixed-point groups) to run in order on a module.

    Args:
      passes: pipeline text, or a list of `HloPass`/`FixedPoint` objects.
      verify: after every pass that changed the module, True checks every edit
        since parsing (and all of a module built without parsing), "full" the
        whole module, False nothing.
      dump_to: directory for `module_NNNN.<name>.before_xla_passes.txt` and one
        `module_NNNN.<name>.KKKK.after_<pass>.txt` per pass that ran. No file there is
        replaced: when NNNN is taken (a directory used before, another process dumping
        into it), the module's files take the next free number.
      module_number: the NNNN tried first for the dump file names.
      on_dump_error: called with the OSError when a dump cannot be written, after which the
        pipeline goes on; default: the error is raised.
      layouts_final: the module comes after XLA's layout assignment (JAX's pass hook), so the
        layouts of new collectives are what XLA runs: a pass that leaves a gather or scatter
        along a dimension its layout does not make most major fails (`layout_problem`); and
        in a module XLA has fused, a reshape a pass leaves that moves no element becomes a
        `bitcast`, as XLA's simplifier makes them once layouts are set (none runs after the
        hook; XLA:CPU would run the reshape as a fusion that copies the whole array).
      after_pass: called as `after_pass(pass_name, module)` after every pass that changed the
        module (`xla-opt --report --topology` prices each step there).
      platform: the platform compiled for (JAX's hook: cpu, cuda, ...): combiners whose thresholds
        are unset use XLA's there (`PassContext.combiner_thresholds`); None: offline defaults.
    """

    def __init__(self, passes, *, verify: bool | str = True, dump_to: str | None = None, module_number: int = 0,
                 layouts_final: bool = False, on_dump_error=None, after_pass=None, platform: str | None = None):
        if verify not in VERIFY_CHOICES:
            raise PassError(f"verify={verify!r}: expected True, {FULL!r} or False")
        self.passes = parse_pipeline(passes) if isinstance(passes, str) else list(passes)
        self.platform = platform
        self.verify = verify
        self.dump_to = dump_to
        self.module_number = module_number
        self.layouts_final = layouts_final
        self.on_dump_error = on_dump_error
        self.after_pass = after_pass
        self.log: list[PassRun] = []

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.passes)

    def clone(self, **options) -> "Pipeline":
        """A pipeline of fresh pass objects (passes keep state from their last run: one module's run
        each), with these options and `options` changed, without parsing its text again."""
        fresh = copy.copy(self)
        fresh.passes = copy.deepcopy(self.passes)
        fresh.log = []
        for key, value in options.items():
            if not hasattr(self, key) or key == "passes":
                raise TypeError(f"Pipeline.clone() got an unexpected option {key!r}")
            setattr(fresh, key, value)
        return fresh

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        """Run every pass on `module` in place; return whether any changed it. `context`: the
        `PassContext` every pass gets (default: one for this run, from `platform` and the module)."""
        self.log = []
        self._dump_count = 0
        self.dump_number = self.module_number  # the NNNN the dumps got (see `dump_to`)
        module.layouts_final |= self.layouts_final
        if context is None:
            context = PassContext(combiner_thresholds=platform_thresholds(self.platform),
                                  layouts_final=module.layouts_final, platform=self.platform)
        self.context = context
        if self.dump_to:
            self._dump(module, "before_xla_passes")
        return self._run_list(self.passes, module)

    def _run_list(self, passes, module: HloModule) -> bool:
        changed = False
        for item in passes:
            if isinstance(item, FixedPoint):
                changed |= self._run_fixed_point(item, module)
            else:
                changed |= self._run_pass(item, module)
        return changed

    def _run_fixed_point(self, group: FixedPoint, module: HloModule) -> bool:
        changed = False
        for _ in range(group.max_iterations):
            if not self._run_list(group.passes, module):
                break
            changed = True
        return changed

    def _run_pass(self, hlo_pass: HloPass, module: HloModule) -> bool:
        checkpoint = module.checkpoint()   # no text: the walk to XLA prints a changed module once
        start = time.perf_counter()
        try:
            changed = self._apply(hlo_pass, module, checkpoint)
            if changed and self.verify:
                _verify_after(hlo_pass, module, full=self.verify == FULL)
            if changed and module.layouts_final:
                _check_collective_layouts(hlo_pass, module)
                _bitcasts_for_reshapes(module)
        except BaseException as exc:
            checkpoint.restore()
            self.context.invalidate()
            if isinstance(exc, PassError):
                if exc.pass_name is None:
                    exc.pass_name = hlo_pass.name
                raise
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends pass through, module restored
            raise PassError(f"{type(exc).__name__}: {exc}", hlo_pass.name) from exc
        self.log.append(PassRun(hlo_pass.name, changed, time.perf_counter() - start))
        if changed and self.after_pass is not None:
            self.after_pass(hlo_pass.name, module)
        if self.dump_to:
            self._dump(module, f"after_{hlo_pass.name}", numbered=True, notes=pass_report(hlo_pass))
        return changed

    def _apply(self, item, module: HloModule, checkpoint=None) -> bool:
        """Run one pass, or each pass of a composite (`PassPipeline`) in turn, with the run's
        context; whether any changed the module. `checkpoint`: the module as it is now, if taken."""
        if isinstance(item, PassPipeline):
            changed = False
            for inner in item.passes:
                if isinstance(inner, FixedPoint):
                    for _ in range(inner.max_iterations):
                        if not any([self._apply(p, module) for p in inner.passes]):
                            break
                        changed = True
                else:
                    changed |= self._apply(inner, module)
            return changed
        context = self.context
        inlined = False
        if item.sees_into_calls:
            checkpoint = checkpoint or module.checkpoint()
            inlined = inline_calls(module)
        result = run_pass(item, module, context)
        if result.findings:
            item.report = list(result.findings)
        if inlined and not result.changed:
            checkpoint.restore()   # the calls back as they were: the module is unchanged
            context.invalidate()
        elif result.changed or inlined:
            context.invalidate(keep=() if inlined else item.preserves)
        return bool(result.changed)

    def could_change(self, count_of) -> bool:
        """Whether some pass could change a module with at most `count_of(opcode)` instructions of each opcode.

        When no pass could change the module as it is, none changes it, so every later pass sees
        it as it is too: the whole pipeline leaves it alone.
        """
        return any(hlo_pass.could_change(count_of) for hlo_pass in _flatten(self.passes))

    def all_passes(self) -> list[HloPass]:
        """Every pass of the pipeline, in order, with fixed-point groups opened up."""
        return _flatten(self.passes)

    def reports(self) -> list[str]:
        """The report lines of every pass in the pipeline that keeps one (see `pass_report`)."""
        return [line for item in _flatten(self.passes) for line in pass_report(item)]

    def refusals(self) -> list[str]:
        """Why passes of the pipeline could not apply to the module at all, as `<pass>: unchanged:
        <why>`: the report lines that say `unchanged: `. A pass the user named that refuses says
        so where the user looks (a warning, xla-opt's stderr); `xla_passes.jax.jit(strict=True)`
        raises it."""
        return [f"{item.name}: {line}" for item in _flatten(self.passes) for line in pass_report(item)
                if line.startswith(REFUSAL)]

    def _dump(self, module: HloModule, what: str, numbered: bool = False, notes=()) -> None:
        step = ""
        if numbered:
            self._dump_count += 1
            step = f"{self._dump_count:04d}."
        text = module.to_text()
        if module.layouts_final:
            from hlo_tools.xla.runner import stage_note, with_header_counts  # noqa: PLC0415 - numpy; dumps only

            # What hlo-tools needs to compile the module again: the stage of XLA's pipeline it was
            # taken at (only the post-scheduler hook sees scheduled modules) and the device counts,
            # which XLA keeps out of the text. The counts are the compile's: read once, off the
            # module as XLA handed it over.
            stage = "post_scheduler" if module.attrs.get("is_scheduled") else "pre_scheduler"
            notes = [f"{LAYOUTS_FINAL_NOTE}, {stage_note(stage)}", *notes]
            if not numbered:
                self._device_counts = inferred_device_counts(module)
            if self._device_counts is not None:
                text = with_header_counts(text, self._device_counts.replicas, self._device_counts.partitions)
        header = "".join(f"// {line}\n" for line in notes)
        rest = f"{sanitize_file_name(module.name)}.{step}{what}.txt"
        try:
            os.makedirs(self.dump_to, exist_ok=True)
            if numbered:  # the module's number is claimed: its first file holds it
                write_new(os.path.join(self.dump_to, module_file_name(self.dump_number, module.name,
                                                                      f"{step}{what}.txt")), header + text)
            else:
                self.dump_number = write_numbered(self.dump_to, self.module_number, rest, header + text)
        except OSError as exc:
            if self.on_dump_error is None:
                raise
            self.on_dump_error(exc)


# How a report line of a pass that refused the whole module begins (see `Pipeline.refusals`).
REFUSAL = "unchanged: "


def pass_report(hlo_pass) -> list[str]:
    """What a pass says about its last run: one line per entry of its `report` list, if it has one."""
    return [str(entry) for entry in getattr(hlo_pass, "report", None) or ()]


def _flatten(items) -> list:
    out = []
    for item in items:
        out.extend(_flatten(item.passes) if isinstance(item, FixedPoint) else [item])
    return out


def _verify_after(hlo_pass: HloPass, module: HloModule, full: bool) -> None:
    try:
        (verify_module if full else verify_edits)(module)
    except hlo_tools.HloVerifyError as exc:
        raise PassError(f"produced an invalid module: {exc.message}", hlo_pass.name, exc.instruction) from exc


def _check_collective_layouts(hlo_pass: HloPass, module: HloModule) -> None:
    for instr in module.instructions_mentioning(DIMENSIONED_COLLECTIVES):
        problem = layout_problem(instr)
        if problem:
            raise PassError(f"produced a collective XLA would run wrongly: {problem}", hlo_pass.name, instr.name)


def run_passes(module: HloModule, passes, **options) -> bool:
    """Run pipeline text (or pass objects) on `module` in place; return whether it changed
    (`options`: those of `Pipeline`, e.g. `platform="cpu"`)."""
    return Pipeline(passes, **options).run(module)


# --- pipeline text ---------------------------------------------------------------------------------

_PASS_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def abbreviated(text: str, limit: int = 100) -> str:
    """``repr(text)``, its middle cut out when it is longer than ``limit`` characters (error messages
    quote pipeline text, which may be anything a user or a script put in a variable)."""
    if len(text) <= limit:
        return repr(text)
    keep = limit // 2
    return f"{text[:keep]!r}...({len(text) - 2 * keep} characters)...{text[-keep:]!r}"


def parse_pipeline(text: str, _composites: tuple[str, ...] = ()) -> list:
    """Pipeline text -> a list of `HloPass` and `FixedPoint` objects (PassError when malformed).

    A composite pass (`PassPipeline`) comes with its passes built from its `pipeline_text()`."""
    if not text.strip():
        raise PassError("empty pipeline: name at least one pass")
    return _PipelineParser(text, _composites).items(closing=None)


class _PipelineParser:
    def __init__(self, text: str, composites: tuple[str, ...] = ()):
        self.text = text
        self.pos = 0
        self.depth = 0  # fixed-point groups open at `pos`
        self.composites = composites  # the composite passes whose text this is, outermost first

    def error(self, message: str) -> PassError:
        return PassError(f"pipeline {abbreviated(self.text)}, column {self.pos + 1}: {message}")

    def skip_space(self):
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def items(self, closing: str | None) -> list:
        items = []
        while True:
            items.append(self.item())
            char = self.peek()
            if char == ",":
                self.pos += 1
                continue
            if char == (closing or ""):
                if closing:
                    self.pos += 1
                return items
            raise self.error(f"expected ',' or {closing!r}" if closing else "expected ',' or the end")

    def item(self):
        self.skip_space()
        match = _PASS_NAME.match(self.text, self.pos)
        if not match:
            raise self.error("expected a pass name")
        name = match.group(0)
        self.pos = match.end()
        options = self.options() if self.peek() == "{" else {}
        if name == FIXED_POINT:
            if self.peek() != "(":
                raise self.error("fixed-point needs a group of passes in parentheses")
            if self.depth == MAX_FIXED_POINT_NESTING:
                raise self.error(f"fixed-point groups nest more than {MAX_FIXED_POINT_NESTING} deep")
            self.pos += 1
            unknown = set(options) - {"max_iterations"}
            if unknown:
                raise PassError(f"unknown option {sorted(unknown)[0]!r} (valid options: max_iterations)", FIXED_POINT)
            try:
                limit = int(options.get("max_iterations", "25"))
            except ValueError:
                raise PassError(f"option max_iterations={options['max_iterations']!r} is not a valid int",
                                FIXED_POINT) from None
            self.depth += 1
            group = self.items(closing=")")
            self.depth -= 1
            return FixedPoint(group, limit)
        hlo_pass = pass_class(name).from_options(options)
        if isinstance(hlo_pass, PassPipeline):
            if name in self.composites or len(self.composites) == MAX_FIXED_POINT_NESTING:
                raise PassError(f"composite pass {name} names itself (through {', '.join(self.composites)})"
                                if name in self.composites else "composite passes nest too deep", name)
            hlo_pass.build(self.composites)
        return hlo_pass

    def options(self) -> dict[str, str]:
        self.pos += 1  # '{'
        end = self.text.find("}", self.pos)
        if end < 0:
            raise self.error("unclosed '{'")
        options = {}
        body = self.text[self.pos:end]
        for part in body.split(","):
            if not part.strip():
                continue
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                raise self.error(f"option {part.strip()!r} is not key=value")
            if key.strip() in options:
                raise self.error(f"option {key.strip()!r} is given twice")
            options[key.strip()] = value.strip()
        self.pos = end + 1
        return options


def computations_run_on_their_own(module: HloModule):
    """The computations of `module` that run as a sequence of their own: the entry and the bodies
    of its while, conditional and call instructions, transitively (not fusion bodies or reducers).
    A body left unread (`lazy_bodies`) is XLA's own, which no pass changed, and is left out."""
    stack, seen = [module.entry], set()
    while stack:
        comp = stack.pop()
        if comp in seen or not comp.parsed:
            continue
        seen.add(comp)
        yield comp
        stack.extend(callee for instr in comp.instructions if instr.opcode in ("while", "conditional", "call")
                     for callee in instr.called_computations)


def _bitcasts_for_reshapes(module: HloModule) -> None:
    """Every reshape outside fusions that moves no element in memory becomes a `bitcast`, in a
    module XLA has fused (what its hook hands over): XLA runs no simplifier after that point. A
    module with final layouts but no fusion yet is compiled from the start (a hand-written
    one run offline), where XLA's layout assignment would not take a bitcast."""
    if not any(instr.opcode == "fusion" for instr in module.entry.instructions):
        return
    for comp in computations_run_on_their_own(module):
        for instr in list(comp.instructions):
            if (instr.opcode == "reshape" and instr.operands[0].shape.reshape_is_bitcast(instr.shape)
                    and not instr.control_predecessors and not instr.control_successors):
                attrs = {key: value for key, value in instr.attrs.items() if key == "metadata"}
                bitcast = comp.add_instruction("bitcast", instr.operands, instr.shape, before=instr, attrs=attrs)
                instr.replace_all_uses_with(bitcast)
                comp.remove_instruction(instr)
                bitcast.rename(instr.name)


def _run_composite_on_its_own(composite: PassPipeline, module: HloModule, context: PassContext | None) -> bool:
    return Pipeline([composite]).run(module, context)


PassPipeline.parse_text = staticmethod(parse_pipeline)
PassPipeline.run_on_its_own = staticmethod(_run_composite_on_its_own)
