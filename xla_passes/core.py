"""The pass API: `HloPass`, typed options, `register_pass`, and `PassError`.

A pass is a dataclass whose fields are its options::

    @register_pass
    class MyPass(HloPass):
        \"\"\"One line that `xla-opt --list-passes` shows.\"\"\"
        name = "my-pass"
        opcodes = {"all-reduce"}   # optional: what it acts on (see HloPass)
        threshold_bytes: int = 1 << 20

        def run(self, module) -> bool:
            ...   # edit the module in place; return whether anything changed

`register_pass` makes the class a dataclass and files it under `name`, so that
pipelines written as text (`"my-pass{threshold_bytes=1024},dce"`) can build it
(`xla_passes.registry` looks passes up; this module imports no pass).
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Collection, Mapping
from typing import ClassVar

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

    def run(self, module: HloModule) -> bool:
        """Rewrite `module` in place; return whether it changed."""
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
    """Make `module` (the same object) hold the module printed as `text` again."""
    fresh = hlo_tools.parse_module(text)
    fresh.layouts_final = module.layouts_final  # not in the text
    module.__dict__.clear()
    module.__dict__.update(fresh.__dict__)
    for comp in module.computations:
        comp.parent = module
