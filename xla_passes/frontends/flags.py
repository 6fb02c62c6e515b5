"""absl flags: `--xla_passes`, `--xla_passes_stage`, `--xla_passes_dump_to`, `--xla_passes_strict`,
`--xla_passes_check`.

An absl program (a Flax example's `main.py`, say) imports this module beside
its own flags and changes nothing else::

    from absl import app
    import xla_passes.flags  # noqa: F401 - defines --xla_passes and friends

    def main(argv):
        ...  # the unmodified training program

    if __name__ == "__main__":
        app.run(main)

    $ python main.py --xla_passes=collective-fusion --xla_passes_dump_to=/tmp/dump

absl checks flag values right after it parses the command line, and this
module's check also applies them: a bad `--xla_passes` stops the program with
absl's usage error (naming the valid passes), a good one switches the passes on
for every later `jax.jit` compile (`xla_passes.jax.enable`). A flag given on
the command line wins over its `XLA_PASSES*` environment variable; flags not
given leave the variables in charge, so `--xla_passes=` (empty) switches off
passes that `XLA_PASSES` asked for.

When JAX is not imported yet at parse time, the JAX plugin applies the flags
when JAX starts its backends; TensorFlow reads them through
`xla_passes.tensorflow.configured_pipeline()`.
"""
from __future__ import annotations

import sys

from absl import flags

from . import configuration

XLA_PASSES = flags.DEFINE_string(
    "xla_passes", None,
    "xla_passes pipeline to run in every XLA compile, e.g. 'collective-fusion,dce' "
    "(default: the XLA_PASSES environment variable; empty: none).")
XLA_PASSES_STAGE = flags.DEFINE_enum(
    "xla_passes_stage", None, list(configuration.STAGES),
    "Where in XLA's pipeline the passes run (default: XLA_PASSES_STAGE, else pre_scheduler).")
XLA_PASSES_DUMP_TO = flags.DEFINE_string(
    "xla_passes_dump_to", None,
    "Directory for each compiled module before and after every pass (default: XLA_PASSES_DUMP_TO).")
XLA_PASSES_STRICT = flags.DEFINE_bool(
    "xla_passes_strict", None,
    "Fail the compile when a pass fails, instead of compiling the original module "
    "(default: XLA_PASSES_STRICT).")

XLA_PASSES_CHECK = flags.DEFINE_bool(
    "xla_passes_check", None,
    "Run every module the passes changed against the original on random inputs before XLA gets "
    "it, and keep the original when they differ (default: XLA_PASSES_CHECK).")

_HOLDERS = {"passes": XLA_PASSES, "stage": XLA_PASSES_STAGE, "dump_to": XLA_PASSES_DUMP_TO,
            "strict": XLA_PASSES_STRICT, "check": XLA_PASSES_CHECK}


def _given(value_of) -> dict[str, tuple[object, str]]:
    """`{setting: (value, "--flag")}` for the flags whose value (`value_of(holder)`) is not None."""
    return {setting: (value_of(holder), f"--{holder.name}")
            for setting, holder in _HOLDERS.items() if value_of(holder) is not None}


def given_values() -> dict[str, tuple[object, str]]:
    """The flags given, as `{setting: (value, "--flag")}`, once absl has parsed the command line."""
    return _given(lambda holder: holder.value) if flags.FLAGS.is_parsed() else {}


def _apply_flags(values: dict) -> bool:
    """absl's check of the flags: refuse bad values, and switch the passes in JAX.

    Runs after absl parsed the command line and whenever one of the flags is
    assigned. JAX's settings change only when a flag is given and JAX is
    already imported; otherwise the JAX plugin reads the flags when JAX starts.
    """
    given = _given(lambda holder: values[holder.name])
    if not given:
        return True
    try:
        settings = configuration.settings_from({**configuration.environment_values(), **given})
    except configuration.ConfigurationError as exc:
        raise flags.ValidationError(str(exc)) from exc
    if "jax" in sys.modules:
        from . import jax as jax_adapter  # noqa: PLC0415 - JAX programs only

        jax_adapter.apply(settings)
    return True


flags.register_multi_flags_validator([holder.name for holder in _HOLDERS.values()], _apply_flags)
