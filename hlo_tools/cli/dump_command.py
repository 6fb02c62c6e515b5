"""``hlo-tools dump``: capture HLO modules before and after XLA's optimizations.

Two modes, both a thin layer over :mod:`hlo_tools.xla.dump` (see docs/dump.md):

* ``hlo-tools dump -o DIR -- CMD ARGS...`` runs CMD with XLA's dump flags and
  moves what XLA wrote into DIR; the exit status is CMD's.
* ``hlo-tools dump -o DIR --function FILE.py:NAME --args 'f32[8,16]' ...``
  imports FILE.py and dumps NAME for arguments of those shapes: through TF when
  NAME is a ``tf.function``, through ``jax.jit`` otherwise.  TensorFlow is only
  imported by FILE.py itself, so the JAX path works where TF is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

import hlo_tools
from hlo_tools import cli
from hlo_tools.xla import dump
from hlo_tools.ir.errors import one_line

# HLO element types whose numpy (ml_dtypes) name does not follow from the HLO name by the rules below.
_DTYPE_EXCEPTIONS = {"pred": "bool", "bf16": "bfloat16"}
_DTYPE_RULES = ((re.compile(r"s(\d+)"), r"int\1"), (re.compile(r"u(\d+)"), r"uint\1"),
                (re.compile(r"f(\d+)"), r"float\1"), (re.compile(r"c(\d+)"), r"complex\1"),
                (re.compile(r"f(\d)(e.+)"), r"float\1_\2"))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``dump`` subcommand."""
    p = subparsers.add_parser(
        "dump", help="capture HLO modules before and after XLA's optimizations",
        description="Capture HLO modules before and after XLA's optimizations into a directory, "
                    "named as XLA names its dumps (module_NNNN.<name>.before_optimizations.txt, "
                    "module_NNNN.<name>.cpu_after_optimizations.txt); NNNN continues after the "
                    "files already there, and no file is ever overwritten. Either run a command "
                    "with XLA's dump flags (hlo-tools dump -o DIR -- python train.py; the exit "
                    "status is the command's), or dump one JAX or TF function "
                    "(--function FILE.py:NAME --args SHAPE...).")
    p.add_argument("-o", "--output_dir", required=True, metavar="DIR",
                   help="the directory to write to (created if missing)")
    p.add_argument("--function", metavar="FILE.py:NAME",
                   help="import FILE.py and dump its NAME: a tf.function(jit_compile=True) "
                        "through TensorFlow, any other function through jax.jit")
    p.add_argument("--args", nargs="+", default=[], metavar="SHAPE",
                   help="the arguments of --function as HLO shapes, e.g. 'f32[8,16]' 's32[]'")
    p.add_argument("--stage", choices=dump.STAGES,
                   help="with --function: the module before optimizations, after, or both "
                        "(default both)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="run CMD with XLA_FLAGS extended by --xla_dump_to and --xla_dump_hlo_as_text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Dump a command's modules or one function's; the exit status is the command's, else 0."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command and args.function is not None:
        raise cli.CommandError("give either a command (after --) or --function, not both")
    if not command and args.function is None:
        raise cli.CommandError("nothing to dump: give a command after -- or --function FILE.py:NAME")
    if command and (args.args or args.stage is not None):
        raise cli.CommandError("--args and --stage go with --function (a command run keeps every "
                               "file XLA dumps)")
    try:
        if command:
            return _dump_command(command, args.output_dir)
        return _dump_function(args.function, args.args, args.stage or "both", args.output_dir)
    except dump.DumpError as exc:
        raise cli.CommandError(str(exc)) from exc


def _dump_command(command: list[str], out_dir: str) -> int:
    """Run ``command`` dumping to ``out_dir``; list the modules; return its exit status."""
    files, returncode = dump.dump_script(command, out_dir)
    modules = [path for path in files if dump.is_hlo_dump(path)]
    for path in modules:
        print(path)
    module_count = len({os.path.basename(path).split(".", 1)[0] for path in modules})
    print(f"{module_count} module{'' if module_count == 1 else 's'} in {out_dir}: "
          f"{len(modules)} HLO files and {len(files) - len(modules)} other files XLA wrote")
    return returncode if returncode >= 0 else 128 - returncode  # killed by signal N: 128+N, as shells say


def _dump_function(spec: str, shapes: list[str], stage: str, out_dir: str) -> int:
    """Dump the function ``FILE.py:NAME`` for arguments of ``shapes``; print the files written."""
    path, name = _split_spec(spec)
    arg_types = [_parse_arg(text) for text in shapes]
    fn = _load_function(path, name)
    tf = sys.modules.get("tensorflow")  # loaded only if FILE.py imported it
    is_tf = tf is not None and isinstance(fn, tf.types.experimental.PolymorphicFunction)
    try:
        if is_tf:
            specs = [tf.TensorSpec(dims, tf.as_dtype(dtype)) for dims, dtype in arg_types]
            files = dump.dump_tf(fn, *specs, out_dir=out_dir, stage=stage)
        else:
            import jax  # noqa: PLC0415 - heavy; only this path needs it

            structs = [jax.ShapeDtypeStruct(dims, dtype) for dims, dtype in arg_types]
            files = dump.dump_jax(fn, *structs, out_dir=out_dir, stage=stage)
    except dump.DumpError:
        raise
    except Exception as exc:  # tracing, lowering or compiling the user's function failed
        raise cli.CommandError(f"{name}: {_describe(exc)}", path) from exc
    for written in files:
        print(written)
    return 0


def _split_spec(spec: str) -> tuple[str, str]:
    """(FILE.py, NAME) of ``--function FILE.py:NAME``; the file must exist."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise cli.CommandError(f"--function takes FILE.py:NAME, not {spec!r}")
    if not os.path.isfile(path):
        raise cli.CommandError("No such file or directory" if not os.path.exists(path)
                               else "not a regular file", path)
    return path, name


def _load_function(path: str, name: str):
    """Import ``path`` as a module (its directory first on ``sys.path``) and return its ``name``.

    ``name`` may be dotted (``model.apply``).  The module is imported under its
    file's stem, not ``__main__``, so a ``if __name__ == "__main__":`` block
    does not run.
    """
    stem = os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(stem, path)
    if module_spec is None:
        raise cli.CommandError("not a Python file", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.modules[stem] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise cli.CommandError(f"importing it failed: {type(exc).__name__}: {one_line(str(exc))}",
                               path) from exc
    target = module
    for part in name.split("."):
        if not hasattr(target, part):
            raise cli.CommandError(f"no function named {name!r}", path)
        target = getattr(target, part)
    if not callable(target):
        raise cli.CommandError(f"{name} is not a function ({type(target).__name__})", path)
    return target


def _parse_arg(text: str) -> tuple[tuple[int, ...], str]:
    """(dimensions, numpy dtype name) of an argument shape such as ``f32[8,16]``.

    The shape must be an array with static dimensions and the default layout:
    that is all a ``jax.ShapeDtypeStruct`` or ``tf.TensorSpec`` says.
    """
    try:
        shape = hlo_tools.parse_shape(text)
    except hlo_tools.HloParseError as exc:
        raise cli.CommandError(f"--args {text!r}: {one_line(exc.message)}") from exc
    if not shape.is_array:
        raise cli.CommandError(f"--args {text!r}: an argument is an array shape, "
                               "not a tuple or token (give each array)")
    if shape.is_dynamic:
        raise cli.CommandError(f"--args {text!r}: dynamic dimensions are not supported")
    if shape.layout is not None and shape.layout != shape.with_default_layout().layout:
        raise cli.CommandError(f"--args {text!r}: only the default layout is supported")
    return shape.dims, _dtype_name(shape.dtype)


def _dtype_name(hlo_type: str) -> str:
    """The numpy / ml_dtypes name of an HLO element type (``f32`` -> ``float32``, ``f8e4m3fn`` ->
    ``float8_e4m3fn``), which jax and TensorFlow both accept."""
    if hlo_type in _DTYPE_EXCEPTIONS:
        return _DTYPE_EXCEPTIONS[hlo_type]
    for pattern, replacement in _DTYPE_RULES:
        if pattern.fullmatch(hlo_type):
            return pattern.sub(replacement, hlo_type)
    raise cli.CommandError(f"--args: no numpy type for the element type {hlo_type}")


def _describe(exc: Exception) -> str:
    """``Type: message`` in one line, for an error raised by the user's function.

    TF's tracing errors start with ``in user code:`` and a stack, and end with
    ``Type: message`` of the error itself; everything else (jax, XLA) says
    what went wrong on the first line.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0] == "in user code:":
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
