"""What the user asked for: the pipeline, stage, dump directory and strictness.

Each setting comes from an environment variable or, in absl programs that
import `xla_passes.flags`, from a flag given on the command line (a flag wins
over its variable):

| setting | environment        | absl flag              |
| ------- | ------------------ | ---------------------- |
| passes  | XLA_PASSES         | --xla_passes           |
| stage   | XLA_PASSES_STAGE   | --xla_passes_stage     |
| dump_to | XLA_PASSES_DUMP_TO | --xla_passes_dump_to   |
| strict  | XLA_PASSES_STRICT  | --xla_passes_strict    |
| check   | XLA_PASSES_CHECK   | --xla_passes_check     |

One module reads them so that the JAX plugin and the TensorFlow adapter agree
on what a setting means. Nothing here imports JAX, TensorFlow or absl.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping

from ..core import PassError
from ..pipeline import Pipeline, abbreviated
from ..registry import registered_passes

PRE_SCHEDULER = "pre_scheduler"
POST_SCHEDULER = "post_scheduler"
STAGES = (PRE_SCHEDULER, POST_SCHEDULER)

# Where the JAX adapter hooks in when no platform is named: every backend JAX can start.
ALL_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# setting -> (environment variable, absl flag name)
SOURCES = {
    "passes": ("XLA_PASSES", "xla_passes"),
    "stage": ("XLA_PASSES_STAGE", "xla_passes_stage"),
    "dump_to": ("XLA_PASSES_DUMP_TO", "xla_passes_dump_to"),
    "strict": ("XLA_PASSES_STRICT", "xla_passes_strict"),
    "check": ("XLA_PASSES_CHECK", "xla_passes_check"),
}
STRICT_VARIABLE = SOURCES["strict"][0]
DUMP_VARIABLE = SOURCES["dump_to"][0]
CHECK_VARIABLE = SOURCES["check"][0]

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("", "0", "false", "no", "off")


class ConfigurationError(PassError):
    """A setting has a bad value; `strict` tells whether the user also asked for errors to be raised."""

    def __init__(self, message: str, strict: bool):
        super().__init__(message)
        self.strict = strict


@dataclasses.dataclass(frozen=True)
class Settings:
    """A checked configuration: building one validates the pipeline text and the stage.

    Frozen, so that a compile running in one thread never sees half of a change
    made in another. `pipeline` is the text parsed, once: each module's run takes
    `pipeline.clone()`, fresh pass objects without parsing again.
    """

    passes: str
    stage: str = PRE_SCHEDULER
    dump_to: str | None = None
    strict: bool = False
    platforms: tuple[str, ...] | str | None = ALL_PLATFORMS
    check: bool = False      # translation validation of every changed module (xla_passes.tools.validation)
    pipeline: Pipeline = dataclasses.field(init=False, repr=False, compare=False)   # `passes`, parsed

    def __post_init__(self):
        platforms = ALL_PLATFORMS if self.platforms is None else self.platforms
        object.__setattr__(self, "platforms", (platforms,) if isinstance(platforms, str) else tuple(platforms))
        object.__setattr__(self, "passes", self.passes.strip())
        object.__setattr__(self, "stage", self.stage.strip().lower())
        object.__setattr__(self, "dump_to", self.dump_to or None)
        if self.stage not in STAGES:
            raise PassError(f"stage {self.stage!r} is not one of {', '.join(STAGES)}")
        try:
            object.__setattr__(self, "pipeline", Pipeline(self.passes))
        except PassError as exc:
            message = f"{abbreviated(self.passes)} is not a valid pipeline: {exc}"
            if "valid passes" not in message:
                message += f" (valid passes: {', '.join(registered_passes())})"
            raise PassError(message) from exc  # `exc` already names its pass

    def executable_key(self) -> str:
        """What decides the executable a compile under these settings makes: every setting but the
        dump directory, which JAX's persistent cache key leaves out as it leaves out `--xla_dump_to`
        (where the dumps go changes nothing XLA compiles)."""
        kept = (field.name for field in dataclasses.fields(self) if field.repr and field.name != "dump_to")
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in kept)


def settings_from_environment(environ: Mapping[str, str] | None = None) -> Settings | None:
    """The settings the `XLA_PASSES*` variables ask for; None when `XLA_PASSES` is unset or empty.

    Raises:
      ConfigurationError: a variable has a bad value (the message names it).
    """
    return settings_from(environment_values(environ))


def configured_settings() -> Settings | None:
    """The settings in force for a new compile: the environment, overridden by given absl flags.

    The flags count only when the program imported `xla_passes.flags` and absl
    has parsed its command line.

    Raises:
      ConfigurationError: a variable or flag has a bad value (the message names it).
    """
    values = environment_values()
    flags_module = sys.modules.get("xla_passes.frontends.flags")  # (xla_passes.flags imports it)
    if flags_module is not None:
        values.update(flags_module.given_values())
    return settings_from(values)


def environment_values(environ: Mapping[str, str] | None = None) -> dict[str, tuple[object, str]]:
    """`{setting: (value, variable)}` for the `XLA_PASSES*` variables that are set and not empty."""
    environ = os.environ if environ is None else environ
    return {setting: (environ[variable], variable)
            for setting, (variable, _) in SOURCES.items() if environ.get(variable)}


def settings_from(values: Mapping[str, tuple[object, str]]) -> Settings | None:
    """Settings from `{setting: (value, where it was given)}`; None when no passes are named.

    `where` (`XLA_PASSES`, `--xla_passes`, ...) is for error messages.
    """
    strict = _yes_no(values, "strict", strict=True)
    check = _yes_no(values, "check", strict)
    passes, _ = values.get("passes", ("", ""))
    if not str(passes).strip():
        return None
    stage, _ = values.get("stage", (PRE_SCHEDULER, ""))
    dump_to, _ = values.get("dump_to", (None, ""))
    try:
        return Settings(str(passes), stage=str(stage), dump_to=dump_to, strict=strict, check=check)
    except PassError as exc:
        given = " ".join(f"{where}={abbreviated(str(value))}" for value, where in
                         (values[s] for s in ("passes", "stage") if s in values))
        raise ConfigurationError(f"{given}: {exc}", strict) from exc
    except Exception as exc:  # noqa: BLE001 - whatever the text does, strict must still see an error
        raise ConfigurationError(f"{where_passes(values)}: {type(exc).__name__}: {exc}", strict) from exc


def _yes_no(values: Mapping[str, tuple[object, str]], setting: str, strict: bool) -> bool:
    """A yes/no setting; a value that is neither is an error (raised when `strict`: a bad
    strict setting itself counts as strict)."""
    value, where = values.get(setting, (False, ""))
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in _TRUE_WORDS:
        return True
    if lowered in _FALSE_WORDS:
        return False
    raise ConfigurationError(f"{where}={abbreviated(str(value))} is not a yes/no value (use one of "
                             f"{', '.join(_TRUE_WORDS + _FALSE_WORDS[1:])}, in any case)", strict=strict)


def check_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `XLA_PASSES_CHECK` asks for translation validation, which `xla-opt` and
    `xla_passes.jax.jit` honour as the hook does.

    Raises:
      ConfigurationError: the value is not a yes/no word.
    """
    return _yes_no(environment_values(environ), "check", strict=True)


def strict_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `XLA_PASSES_STRICT` asks for errors (a value that is not yes/no counts as yes)."""
    value = (os.environ if environ is None else environ).get(STRICT_VARIABLE, "")
    return value.strip().lower() not in _FALSE_WORDS


def where_passes(values: Mapping[str, tuple[object, str]]) -> str:
    """``XLA_PASSES='...'`` (or the flag) as given, for error messages."""
    value, where = values.get("passes", ("", SOURCES["passes"][0]))
    return f"{where}={abbreviated(str(value))}"
