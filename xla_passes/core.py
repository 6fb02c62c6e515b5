"""The pass API: `HloPass`, typed options, `register_pass`, and `PassError`.

A pass is a dataclass whose fields are its options::

    @register_pass
    class MyPass(HloPass):
        \"\"\"One line that `xla-opt --list-passes` shows.\"\"\"
        name = "my-pass"
        opcodes = {"all-reduce"}   # optional: what it acts on (see HloPass)
        threshold_bytes: int = 1 << 20

        def run(self, module, context=None) -> bool:
            ...   # edit the module in place; return whether anything changed

`register_pass` makes the class a dataclass and files it under `name`, so that
pipelines written as text (`"my-pass{threshold_bytes=1024},dce"`) can build it
(`xla_passes.registry` looks passes up; this module imports no pass).

The pass contract: a pipeline calls `run(module, context)` with the `PassContext` of the run (the
platform's combiner thresholds, whether layouts are final, a cache of analyses), or `run(module)`
for a pass whose `run` takes no context. `run` returns whether it changed the module, as a bool or
as a `PassResult(changed, findings)`. A composite pass is a `PassPipeline`: options and the
pipeline text of the passes it stands for, which the pipeline runs as one step under its name.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any, ClassVar

import hlo_tools
from hlo_tools import HloModule


class PassError(Exception):
    """A pass or pipeline failed; names the pass and, when known, the instruction.

    Raised for bad pipeline text and options too (`pass_name` is then the pass
    being configured, or None).
    """

    def __init__(self, message: str, pass_name: str | None = None, instruction: str | None = None):
        super().__init__(message)
        self.message = message
        self.pass_name = pass_name
        self.instruction = instruction

    def __str__(self) -> str:
        where = []
        if self.pass_name:
            where.append(f"pass {self.pass_name}")
        if self.instruction:
            where.append(f"at %{self.instruction}")
        return f"{' '.join(where)}: {self.message}" if where else self.message


@dataclasses.dataclass
class PassContext:
    """What a pipeline run hands every pass besides the module, in place of options set on pass objects.

    combiner_thresholds: (bytes, operand count) a combiner uses where its own options are unset:
      the platform's that the JAX hook compiles for (`Pipeline(platform=...)`,
      `xla_passes.analysis.collectives.PLATFORM_THRESHOLDS`; bytes None: the largest collective
      of the kind present); None: the offline defaults (`collectives.combiner_thresholds`).
    layouts_final: the module's layouts are XLA's final ones (JAX's hook; see `Pipeline`).
    platform: the platform compiled for, None offline.
    """

    combiner_thresholds: tuple[int | None, int] | None = None
    layouts_final: bool = False
    platform: str | None = None
    _analyses: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def analysis(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The analysis cached under `key` (e.g. `("combiner-scope", id(module))`), computed by
        `compute()` when absent. The pipeline drops every entry after a pass that changed the
        module, but those whose kind (`key[0]`) the pass names in `HloPass.preserves`."""
        if key not in self._analyses:
            self._analyses[key] = compute()
        return self._analyses[key]

    def forget(self, kind: Hashable) -> None:
        """Forget the cached analyses of one kind: a pass that rewrites between its questions
        asks again after a rewrite, and leaves no answer about the module as it was."""
        self._analyses = {key: value for key, value in self._analyses.items() if _kind(key) != kind}

    def invalidate(self, keep: Collection[Hashable] = ()) -> None:
        """Forget every cached analysis but those whose kind (`key[0]`, or the key) is in `keep`."""
        self._analyses = {key: value for key, value in self._analyses.items() if _kind(key) in keep}


def _kind(key: Hashable) -> Hashable:
    """The kind of a cached analysis: its key's first element (`("replication", ...)`), or the key."""
    return key[0] if isinstance(key, tuple) else key


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass's `run` may return instead of a bool: whether it changed the module, and what it
    found (report lines: the pipeline makes them the pass's `report`). True when `changed`."""

    changed: bool
    findings: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.changed)


def run_pass(hlo_pass: "HloPass", module: HloModule, context: PassContext | None = None) -> PassResult:
    """Run one pass with `context` when its `run` takes one; its result as a `PassResult`."""
    result = hlo_pass.run(module, context) if _takes_context(type(hlo_pass)) else hlo_pass.run(module)
    return result if isinstance(result, PassResult) else PassResult(bool(result))


@functools.cache
def _takes_context(cls: type) -> bool:
    """Whether `cls.run` accepts a context as its second argument (passes written before the
    contract define `run(self, module)`)."""
    try:
        parameters = list(inspect.signature(cls.run).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 and positional[2].name == "context"


class HloPass:
    """Base class of passes: subclasses set `name`, declare options as fields, define `run`.

    `opcodes` says which modules the pass can change at all, so that the JAX hook can hand a
    module back to XLA without parsing it when no pass of the pipeline could change it: the
    opcodes whose instructions the pass rewrites (`{"call"}`), or how many instructions of one
    opcode a module needs (`{"all-reduce": 2}` for a combiner). None, the default: any module.
    """

    name: ClassVar[str] = ""
    opcodes: ClassVar[Collection[str] | Mapping[str, int] | None] = None
    # Whether the pass can run in JAX's compile: False for a pass that needs a single-device
    # program or a new program signature (the hook's modules are already per device, with a
    # signature JAX has fixed); the plugin then refuses the pipeline once, when it is switched on.
    runs_at_jax_hook: ClassVar[bool] = True
    # Whether the pass reasons about what plain `call`s compute (`jnp.linalg.norm` lowers to one):
    # the pipeline inlines them first, and takes the inlining back when the pass changes nothing.
    sees_into_calls: ClassVar[bool] = False
    # The analyses (`PassContext.analysis` kinds) the pass leaves valid when it changes the module.
    preserves: ClassVar[Collection[str]] = ()

    def run(self, module: HloModule, context: PassContext | None = None) -> bool | PassResult:
        """Rewrite `module` in place; return whether it changed (a bool, or a `PassResult`).
        `context`: the run's `PassContext`, None when run on its own."""
        raise NotImplementedError

    def could_change(self, count_of: Callable[[str], int]) -> bool:
        """Whether the pass could change a module that has at most `count_of(opcode)` instructions of each opcode."""
        if self.opcodes is None:
            return True
        minimums = self.opcodes if isinstance(self.opcodes, Mapping) else dict.fromkeys(self.opcodes, 1)
        return any(count_of(opcode) >= least for opcode, least in minimums.items())

    def fail(self, message: str, instruction=None) -> PassError:
        """An error of this pass about `instruction` (an HloInstruction or a name), to raise."""
        name = getattr(instruction, "name", instruction)
        return PassError(message, self.name, name)

    @classmethod
    def description(cls) -> str:
        """The first line of the pass's docstring."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: dict[str, str]) -> "HloPass":
        """Build the pass from option text (`{"threshold_bytes": "1024"}`), checking names and types."""
        fields = {f.name: f for f in cls.option_fields()}
        hints = typing.get_type_hints(cls)
        values = {}
        for key, text in options.items():
            if key not in fields:
                valid = ", ".join(sorted(fields)) or "none"
                raise PassError(f"unknown option {key!r} (valid options: {valid})", cls.name)
            values[key] = _convert(text, hints[key], key, cls.name)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise PassError(str(exc), cls.name) from exc

    def options_text(self) -> str:
        """The options that differ from their defaults, as `{k=v,...}` (empty when none)."""
        parts = []
        for f in self.option_fields():
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            if value != default:
                parts.append(f"{f.name}={_format_option(value)}")
        return "{" + ",".join(parts) + "}" if parts else ""

    def __str__(self) -> str:
        return self.name + self.options_text()


def _format_option(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _convert(text: str, kind, key: str, pass_name: str):
    """Option text -> the field's type (int, float, bool, str; `int | None` converts as int: None is
    only ever a default, meaning the pass decides)."""
    kind = next((k for k in typing.get_args(kind) if k is not type(None)), kind)
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:  # every integer option is a size, a count or a threshold
            value = int(text, 0)
            if value < 0:
                raise PassError(f"option {key}={text!r} must not be negative", pass_name)
            return value
        if kind is float:
            return float(text)
        return text
    except ValueError:
        type_name = getattr(kind, "__name__", str(kind))
        raise PassError(f"option {key}={text!r} is not a valid {type_name}", pass_name) from None


class PassPipeline(HloPass):
    """A composite pass: a registered name and options that stand for a pipeline of other passes.

    Subclasses set `name`, declare options as fields (as a pass does) and define `pipeline_text()`,
    the passes it runs given its options. `passes` are those passes, built on first use (fresh
    objects for each instance); a `Pipeline` runs them as one step: one entry in its log, one dump,
    rolled back together, reported under the composite's name. No pass file imports another.
    """

    # How text becomes passes and how a composite runs on its own: `xla_passes.pipeline` sets them
    # when imported (it sits above this module and the passes, which must not import it).
    parse_text: ClassVar[Callable[[str, tuple[str, ...]], list] | None] = None
    run_on_its_own: ClassVar[Callable[["PassPipeline", HloModule, "PassContext | None"], bool] | None] = None

    def pipeline_text(self) -> str:
        raise NotImplementedError

    @property
    def passes(self) -> list:
        """The passes `pipeline_text()` names, built for this instance on first use."""
        built = self.__dict__.get("_passes")
        if built is None:
            built = self.__dict__["_passes"] = type(self).parse_text(self.pipeline_text(), (self.name,))
        return built

    def build(self, enclosing: tuple[str, ...]) -> None:
        """Build `passes` now, inside the composites named `enclosing` (which it must not name)."""
        self.__dict__["_passes"] = type(self).parse_text(self.pipeline_text(), enclosing + (self.name,))

    @property
    def opcodes(self):  # type: ignore[override]
        """The fewest instructions of each opcode that one of its passes acts on (None: any module)."""
        merged: dict[str, int] = {}
        for hlo_pass in self.all_passes():
            if hlo_pass.opcodes is None:
                return None
            least = hlo_pass.opcodes if isinstance(hlo_pass.opcodes, Mapping) else dict.fromkeys(hlo_pass.opcodes, 1)
            for opcode, count in least.items():
                merged[opcode] = min(count, merged.get(opcode, count))
        return merged

    def all_passes(self) -> list[HloPass]:
        """The passes it stands for, composites and groups opened up."""
        return _opened(self.passes)

    @property
    def report(self) -> list[str]:
        return [line for hlo_pass in self.all_passes() for line in getattr(hlo_pass, "report", None) or ()]

    @property
    def runs_at_jax_hook(self) -> bool:  # type: ignore[override]
        return all(p.runs_at_jax_hook for p in self.all_passes())

    @property
    def sees_into_calls(self) -> bool:  # type: ignore[override]
        return False   # each of its passes inlines what it needs

    def could_change(self, count_of: Callable[[str], int]) -> bool:
        return any(p.could_change(count_of) for p in self.all_passes())

    def run(self, module: HloModule, context: PassContext | None = None) -> bool:
        """Run it on its own: a `Pipeline` of this one step."""
        return type(self).run_on_its_own(self, module, context)


def _opened(items) -> list[HloPass]:
    """Passes in order, with composites and fixed-point groups (anything else with `passes`) opened up."""
    out = []
    for item in items:
        if isinstance(item, PassPipeline):
            out.extend(item.all_passes())
        elif isinstance(item, HloPass):
            out.append(item)
        else:
            out.extend(_opened(item.passes))
    return out


_REGISTRY: dict[str, type[HloPass]] = {}


def register_pass(cls: type[HloPass]) -> type[HloPass]:
    """Class decorator: make `cls` a dataclass and register it under `cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no pass name")
    if "__dataclass_fields__" not in cls.__dict__:
        cls = dataclasses.dataclass(cls)
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"two passes named {cls.name!r}: {existing.__qualname__} and {cls.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def passes_registered_so_far() -> dict[str, type[HloPass]]:
    """The passes registered until now by name (the built-in ones once their modules were
    imported: `xla_passes.registry.registered_passes` imports them first)."""
    return dict(_REGISTRY)


def restore(module: HloModule, text: str) -> None:
    """Make `module` (the same object) hold the module printed as `text` again (a pipeline takes
    back a step with `HloModule.checkpoint`, without text)."""
    fresh = hlo_tools.parse_module(text)
    fresh.layouts_final = module.layouts_final  # not in the text
    module.replace_contents(fresh)
