"""Compile HLO modules with XLA (PJRT) and run them on N devices; compare two modules' outputs.

This is how every pass of the project is checked: run the module before and
after the pass on the same global inputs and compare the outputs
(:func:`compare_modules`).  The ``hlo-tools run`` command
(:mod:`hlo_tools.cli.run_command`) is a thin layer over this module.

Modes, chosen from the device counts (arguments, else the module header's
``replica_count=`` / ``num_partitions=``, else 1):

* single device: inputs and outputs are the arrays as they are;
* replica programs (``num_replicas=N``): every parameter gets a leading axis of
  size N (slice i goes to replica i); every output is stacked the same way;
* partitioned programs (``num_partitions=N``): inputs and outputs are GLOBAL
  arrays, split and assembled as the shardings say.  Two kinds of module:

  - ``spmd``: a module still to be partitioned (JAX/GSPMD/Shardy dump before
    optimization); its shapes are global and XLA's partitioner decides the
    per-device layout (read back from the compiled executable);
  - ``per_device``: a module that is already partitioned (what a pass
    produces): its shapes are per-device shapes, and ``sharding=`` on the
    entry parameters and ROOT says how the global arrays map to partitions
    (no sharding means replicated).  XLA compiles it as written.

  ``partition_mode="auto"`` picks ``spmd`` for modules whose instructions carry
  Shardy attributes (``xla.sdy.sharding``, ``xla.sdy.*`` custom calls: what JAX
  emits by default; shardings over named mesh axes, ``sharding={mesh[...], ...}``,
  in jaxlib 0.12's dumps) or GSPMD's ``Sharding``/``SPMDFullToShardShape``/
  ``SPMDShardToFullShape`` custom calls, and ``per_device`` otherwise (the
  header is not looked at).  A GSPMD-style module with nothing but ``sharding=``
  attributes needs ``partition_mode="spmd"``.

A module XLA already optimized (laid out and fused, perhaps scheduled: JAX's
pass hook's modules and their ``XLA_PASSES_DUMP_TO`` dumps, XLA's optimized
dumps) is compiled from the stage of XLA's pipeline it was taken at
(:func:`optimized_stage`), as a per-device module.

Robustness: XLA aborts the process on some CHECK failures and its parser
crashes on pathological nesting.  ``isolate=True`` compiles and runs in a
child process so such a crash becomes a :class:`RunError`; input text is
first parsed with :func:`hlo_tools.parse_module` (when available), which
refuses the input that crashes XLA's parser.

Multi-process: ``num_processes=P`` starts P local worker processes that join a
``jax.distributed`` run on a loopback address with gloo CPU collectives; each
has 1/P of the devices, and process 0 gathers the outputs.  One process of
such a run can also be started by hand with ``coordinator=`` and ``process_id=``.

Every jaxlib call is in :mod:`hlo_tools.xla.xla_bridge`; this module only imports
it inside the functions that compile or run, so that the parent of an
isolated run never starts XLA.
"""

from __future__ import annotations

import dataclasses
import io
import ipaddress
import json
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence

import numpy as np

from hlo_tools.atomic_files import write_through_temp_file

__all__ = [
    "RunError", "RunResult", "OutputComparison", "Comparison", "ModuleRef",
    "run_module", "compare_modules", "compare_outputs", "random_inputs",
    "load_inputs", "save_arrays", "DEFAULT_ABS_ERROR_BOUND", "DEFAULT_REL_ERROR_BOUND",
]

DEFAULT_ABS_ERROR_BOUND = 1e-3  # as in XLA's run_hlo_module
DEFAULT_REL_ERROR_BOUND = 1e-3
MAX_CPU_DEVICES = 512
_INT64_MAX = 2**63 - 1
RANDOM_HIGH = 5  # random inputs are integers in [0, RANDOM_HIGH): float sums stay exact

PARTITION_MODES = ("auto", "spmd", "per_device")
INPUT_FORMATS = ("hlo", "pb")
# Instruction-level signs of a module that still has to be partitioned (the module header
# is not looked at: per-device modules keep JAX's header attributes and Shardy meshes).
# Shardings over named mesh axes (`sharding={mesh['x'=8], [{'x'}]}`) are Shardy's: jaxlib 0.12's XLA
# writes them, instead of `xla.sdy.sharding` attributes, on modules it has not partitioned yet.
_SHARDY_MARKERS = re.compile(
    r'custom_call_target="xla\.sdy\.|xla\.sdy\.sharding|\bsharding=\{+\s*(?:mesh|single_device|maximal_mesh)\[')
_GSPMD_MARKERS = re.compile(
    r'custom_call_target="(?:Sharding|SPMDFullToShardShape|SPMDShardToFullShape)"')


def _body(text: str) -> str:
    """The module text without its ``HloModule`` header line."""
    match = re.search(r"^\s*HloModule\b[^\n]*", text, re.M)
    return text[match.end():] if match else text


def partitioner_for(text: str) -> str | None:
    """``"shardy"`` or ``"gspmd"`` for a module with that partitioner's markers, else None."""
    body = _body(text)
    if _SHARDY_MARKERS.search(body):
        return "shardy"
    if _GSPMD_MARKERS.search(body):
        return "gspmd"
    return None


# --- Modules XLA already optimized ---------------------------------------------------------------
#
# A module from late in XLA's pipeline (laid out, fused, perhaps scheduled: what JAX's pass hook
# hands over, xla_passes' dumps of it, `compile().as_text()`) no longer compiles from the start:
# it is compiled from the stage it was taken at (xla_bridge.compile_optimized_module).

OPTIMIZED_STAGES = ("pre_scheduler", "post_scheduler")  # XLA's pass hook stages, as JAX names them
_STAGE_NOTE = re.compile(rf"^\s*//[^\n]*\bXLA stage ({'|'.join(OPTIMIZED_STAGES)})\b", re.M)
_SCHEDULED = re.compile(r"^\s*HloModule\b[^\n]*\bis_scheduled=true", re.M)
_FUSION_WITH_KIND = re.compile(r"\bfusion\([^\n]*\bkind=k\w+")


def stage_note(stage: str) -> str:
    """What a comment line before the ``HloModule`` line says of a module taken at ``stage`` of
    XLA's pipeline (hook dumps say it): :func:`optimized_stage` reads it back."""
    return f"XLA stage {stage}"


def optimized_stage(text: str) -> str | None:
    """The stage of XLA's pipeline a module XLA already optimized was taken at: its note (see
    :func:`stage_note`), else ``post_scheduler`` for a scheduled module and ``pre_scheduler`` for
    one with fusions; None for a module from before XLA's optimizations."""
    header = re.search(r"^\s*HloModule\b", text, re.M)
    note = _STAGE_NOTE.search(text, 0, header.start() if header else len(text))
    if note:
        return note.group(1)
    if _SCHEDULED.search(text):
        return "post_scheduler"
    if _FUSION_WITH_KIND.search(_body(text)):
        return "pre_scheduler"
    return None


def optimized_note(stage: str) -> str:
    """How a module XLA optimized is compiled, and what to run where XLA cannot compile it again."""
    return (f"a module XLA optimized up to its {stage} stage, compiled from there on; run the module "
            f"from before XLA's optimizations instead, which hlo-tools dump writes")


def with_header_counts(text: str, replicas: int, partitions: int) -> str:
    """``text`` with ``replica_count=`` and ``num_partitions=`` on its ``HloModule`` line (where it
    states neither), which XLA's parser reads; modules from a pass hook lack them."""
    if _header_counts(text) != (None, None):
        return text
    return re.sub(r"^\s*HloModule\b[^\n]*", lambda header: f"{header.group(0)}, replica_count={replicas}, "
                  f"num_partitions={partitions}", text, count=1, flags=re.M)


def compile_executable(module, platform: str, devices: list, process_index: int, *, num_replicas: int,
                       num_partitions: int, partitioner: str, stage: str | None):
    """XLA's executable of ``module`` (an XLA module) for ``devices``: from ``stage`` on for a
    module XLA already optimized up to it, else from the start with ``partitioner``.

    Raises:
      xla_bridge.XlaBridgeError: XLA could not compile it.
    """
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    if stage:
        return xla_bridge.compile_optimized_module(
            xla_bridge.module_proto(module), platform, devices, process_index,
            num_replicas=num_replicas, num_partitions=num_partitions, stage=stage)
    return xla_bridge.compile_module(module, platform, devices, process_index, num_replicas=num_replicas,
                                     num_partitions=num_partitions, partitioner=partitioner)


class RunError(Exception):
    """A module could not be run (one line: what failed and where)."""


# --- Modules -------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModuleRef:
    """A module to run: HLO text, serialized ``HloModuleProto`` bytes, or a file.

    ``name`` is what error messages call it (the file's path for files).
    """

    text: str | None = None
    proto: bytes | None = None
    path: str | None = None
    input_format: str | None = None  # "hlo" or "pb"; for files, default from the extension
    display: str | None = None       # the name in messages, when not the path

    @property
    def name(self) -> str:
        if self.display is not None:
            return self.display
        return self.path if self.path is not None else "<module>"

    @classmethod
    def of(cls, module, input_format: str | None = None) -> "ModuleRef":
        """A ModuleRef from text (str), proto bytes, a path (``pathlib.Path``) or a ModuleRef."""
        if isinstance(module, ModuleRef):
            return module
        if isinstance(module, (bytes, bytearray)):
            return cls(proto=bytes(module))
        if isinstance(module, os.PathLike):
            return cls(path=os.fspath(module), input_format=input_format)
        if isinstance(module, str):
            return cls(text=module)
        raise TypeError(f"a module is HLO text, proto bytes or a pathlib.Path, not {type(module).__name__}")

    def format(self) -> str:
        if self.input_format is not None:
            if self.input_format not in INPUT_FORMATS:
                raise RunError(f"unknown input format '{self.input_format}' (expected one of "
                               f"{', '.join(INPUT_FORMATS)})")
            return self.input_format
        if self.proto is not None:
            return "pb"
        if self.path is not None and self.path.endswith(".pb"):
            return "pb"
        return "hlo"

    def read(self):
        """The module's text (str) or proto (bytes), read from its file when needed."""
        if self.text is not None:
            return self.text
        if self.proto is not None:
            return self.proto
        fmt = self.format()
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise RunError(f"{self.path}: {exc.strerror or exc}") from exc
        if fmt == "pb":
            return data
        try:
            return data.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is no HLO
        except UnicodeDecodeError as exc:
            raise RunError(f"{self.path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                           f"use --input_format pb for a serialized HloModuleProto") from exc


def _precheck(ref: ModuleRef, content) -> None:
    """Parse text with the project's own parser first: it refuses what crashes XLA's parser."""
    if not isinstance(content, str):
        return
    try:
        import hlo_tools  # noqa: PLC0415
        parse = getattr(hlo_tools, "parse_module", None)
        parse_error = getattr(hlo_tools, "HloParseError", None)
    except ImportError:  # the package's __init__ is not there (partial checkout)
        return
    if parse is None or parse_error is None:
        return
    try:
        parse(content)
    except parse_error as exc:
        message = (getattr(exc, "message", None) or str(exc)).strip().splitlines()
        raise RunError(f"{ref.name}:{getattr(exc, 'line', 1)}:{getattr(exc, 'column', 1)}: "
                       f"{message[0] if message else 'syntax error'}") from exc


def device_counts(text: str, printed: str, num_replicas: int | None = None,
                  num_partitions: int | None = None) -> tuple[int, int]:
    """(replicas, partitions) to compile a module with: the counts given, else the header's,
    else (no count anywhere, e.g. JAX's compiler_ir("hlo") text) as many partitions as the
    entry shardings of XLA's print ``printed`` name; 1 for what none of them says."""
    header_replicas, header_partitions = _header_counts(text)
    replicas = num_replicas or header_replicas or 1
    partitions = num_partitions or header_partitions or 1
    if not (num_replicas or num_partitions or header_replicas or header_partitions):
        param_shardings, root_sharding = _entry_shardings(printed)
        partitions = _sharding_device_count(list(param_shardings.values()) + [root_sharding])
    return replicas, partitions


def _header_counts(text: str) -> tuple[int | None, int | None]:
    """``replica_count=`` and ``num_partitions=`` of the ``HloModule`` header line, when present."""
    match = re.search(r"^\s*HloModule\b([^\n]*)", text, re.M)
    if not match:
        return None, None
    header = match.group(1)
    replicas = re.search(r"\breplica_count=(\d+)", header)
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    return (int(replicas.group(1)) if replicas else None,
            int(partitions.group(1)) if partitions else None)


# --- Shardings: how global arrays map to devices -----------------------------------------------

_DTYPE_NAMES = {
    "bool": "pred", "int8": "s8", "int16": "s16", "int32": "s32", "int64": "s64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
    "complex64": "c64", "complex128": "c128", "int4": "s4", "uint4": "u4",
    "float8_e5m2": "f8e5m2", "float8_e4m3fn": "f8e4m3fn", "float8_e4m3": "f8e4m3",
    "float8_e4m3b11fnuz": "f8e4m3b11fnuz", "float8_e5m2fnuz": "f8e5m2fnuz",
    "float8_e4m3fnuz": "f8e4m3fnuz", "float8_e3m4": "f8e3m4", "float8_e8m0fnu": "f8e8m0fnu",
    "float4_e2m1fn": "f4e2m1fn",
}


def shape_str(shape: Sequence[int], dtype) -> str:
    """XLA's spelling of an array shape, e.g. ``f32[8,3]``."""
    name = _DTYPE_NAMES.get(np.dtype(dtype).name, np.dtype(dtype).name)
    return f"{name}[{','.join(str(d) for d in shape)}]"


@dataclasses.dataclass
class _Placement:
    """Where each logical device's piece of one global array is.

    ``slices[i]`` is device i's index into the global array (a tuple of
    slices); ``primary[i]`` says device i's copy is the one used to assemble
    outputs (the first device holding each piece).  ``local_shape`` is the
    per-device shape (pieces at the ragged end are zero-padded to it).
    ``text`` is the sharding as written; None where none was (replicated).
    """

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    slices: list[tuple]
    primary: list[bool]
    text: str | None = "{replicated}"


def _replicated(shape, n, text: str | None = "{replicated}") -> _Placement:
    full = tuple(slice(0, d) for d in shape)
    return _Placement(tuple(shape), tuple(shape), [full] * n, [i == 0 for i in range(n)], text)


def _placement(desc, text: str, shape: tuple[int, ...], n: int, *, per_device: bool,
               what: str, global_shape: tuple[int, ...] | None = None) -> _Placement:
    """The placement of an array under a sharding (XLA's description, see xla_bridge).

    ``shape`` is the per-device shape when ``per_device`` (a per-device module),
    else the global shape (a module XLA partitions). ``global_shape`` is a per-device
    module's declared global shape, when its split is uneven.
    """
    kind = desc[0]
    if kind == "replicated":
        return _replicated(shape, n, text)
    if kind == "maximal":
        device = desc[1]
        if not 0 <= device < n:
            raise RunError(f"{what}: sharding {text} names device {device}, but the module "
                           f"runs on {n} partitions")
        p = _replicated(shape, n, text)
        p.primary = [i == device for i in range(n)]
        return p
    if kind == "tiled":
        dims, devices, extra = desc[1], desc[2], desc[3]
        data_dims = dims[:len(dims) - extra]
        if len(data_dims) != len(shape):
            raise RunError(f"{what}: sharding {text} has {len(data_dims)} tile dimensions for a "
                           f"rank-{len(shape)} array")
        if sorted(devices) != list(range(n)):
            raise RunError(f"{what}: sharding {text} is for {len(devices)} devices "
                           f"({min(devices)}..{max(devices)}), but the module runs on {n} partitions")
        if per_device:
            local = tuple(shape)
            if global_shape is None:
                global_shape = tuple(s * t for s, t in zip(shape, data_dims))
            elif (len(global_shape) != len(shape)
                  or any(-(-g // t) != s for g, s, t in zip(global_shape, shape, data_dims))):
                raise RunError(f"{what}: global shape {list(global_shape)} does not split into "
                               f"{list(shape)} pieces under {text}")
        else:
            global_shape = tuple(shape)
            local = tuple(-(-s // t) for s, t in zip(shape, data_dims))
        slices: list = [None] * n
        primary = [False] * n
        seen = set()
        for pos, device in enumerate(devices):
            index = np.unravel_index(pos, dims)[:len(data_dims)]
            slices[device] = tuple(slice(min(i * l, g), min((i + 1) * l, g))
                                   for i, l, g in zip(index, local, global_shape))
            key = tuple(int(i) for i in index)
            if key not in seen:
                seen.add(key)
                primary[device] = True
        return _Placement(global_shape, local, slices, primary, text)
    if kind == "manual":
        raise RunError(f"{what}: sharding {{manual}} does not say how the global array maps "
                       f"to devices; give the per-device module tiled or replicated shardings")
    raise RunError(f"{what}: unsupported sharding {text}")


def _split(array: np.ndarray, placement: _Placement) -> list[np.ndarray]:
    """Each device's piece of a global array, zero-padded to the per-device shape."""
    pieces = []
    for sl in placement.slices:
        piece = array[sl]
        if piece.shape != placement.local_shape:
            padded = np.zeros(placement.local_shape, array.dtype)
            padded[tuple(slice(0, s) for s in piece.shape)] = piece
            piece = padded
        pieces.append(np.ascontiguousarray(piece))
    return pieces


def _assemble(pieces: dict[int, np.ndarray], placement: _Placement, dtype,
              what: str, warnings: list[str], unsharded_hint: str = "") -> np.ndarray:
    """The global array from each device's piece; copies of a piece must agree (one warning per
    piece whose copies do not; ``unsharded_hint`` ends it where no sharding was written)."""
    out = np.zeros(placement.global_shape, dtype)
    first: dict[tuple, int] = {}
    differing: dict[int, list[int]] = {}  # the first device holding a piece -> devices that disagree
    for device, sl in enumerate(placement.slices):
        piece = pieces[device]
        valid = piece[tuple(slice(0, s.stop - s.start) for s in sl)]
        key = tuple((s.start, s.stop) for s in sl)
        if placement.primary[device]:
            out[sl] = valid
        if key in first:
            other = pieces[first[key]][tuple(slice(0, s.stop - s.start) for s in sl)]
            if not _same_bits(valid, other):
                differing.setdefault(first[key], []).append(device)
        else:
            first[key] = device
    for holder, devices in differing.items():
        if len(warnings) < 20:
            claim = (f", though sharding {placement.text} says they hold the same piece" if placement.text
                     else f"; with no sharding written the output is taken as replicated, and is device "
                          f"{holder}'s{unsharded_hint}")
            warnings.append(f"{what}: device{'s' if len(devices) > 1 else ''} {', '.join(map(str, devices))} "
                            f"hold other values than device {holder}{claim}")
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def _sharding_attr(line: str) -> str | None:
    """The value of the top-level ``sharding=`` attribute of one printed instruction."""
    depth, quote, i = 0, False, 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and line.startswith("sharding={", i) and line[i - 2:i] == ", ":
            start = j = i + len("sharding=")
            level = 0
            while j < len(line):
                if line[j] == "{":
                    level += 1
                elif line[j] == "}":
                    level -= 1
                    if level == 0:
                        return line[start:j + 1]
                j += 1
            return None
        i += 1
    return None


_PARAMETER_LINE = re.compile(
    r"^(?:ROOT\s+)?%?[^\s=]+\s*=\s*(?:\([^=]*?\)|[^\s(]+)\s+parameter\((\d+)\)")


_GLOBAL_SHAPE = re.compile(r'frontend_attributes=\{[^}]*\bglobal_shape="[a-z0-9]+\[([\d,]*)\]')


def _entry_global_shapes(printed: str) -> dict[int, tuple[int, ...]]:
    """Entry parameters of a per-device module whose global shape is not the per-device shape
    times the tile counts (an uneven split): `frontend_attributes={global_shape="f32[10,4]"}`."""
    shapes = {}
    for line in printed.split("ENTRY ", 1)[-1].splitlines():
        match, found = _PARAMETER_LINE.match(line.strip()), _GLOBAL_SHAPE.search(line)
        if match and found:
            shapes[int(match.group(1))] = tuple(int(d) for d in found.group(1).split(",") if d)
    return shapes


def _entry_shardings(printed: str) -> tuple[dict[int, str], str | None]:
    """Shardings of the entry parameters (by number) and of the ROOT, from XLA's print."""
    params: dict[int, str] = {}
    root = None
    in_entry = False
    for line in printed.splitlines():
        stripped = line.strip()
        if stripped.startswith("ENTRY "):
            in_entry = True
            continue
        if not in_entry:
            continue
        if stripped == "}":
            break
        sharding = _sharding_attr(stripped)
        match = _PARAMETER_LINE.match(stripped)
        if match and sharding is not None:
            params[int(match.group(1))] = sharding
        if stripped.startswith("ROOT "):
            root = sharding
    return params, root


# --- Inputs --------------------------------------------------------------------------------------


def random_inputs(shapes: Sequence[tuple[tuple[int, ...], object]], seed: int = 0) -> list[np.ndarray]:
    """Seeded random arrays: integers in [0, RANDOM_HIGH) (0/1 for pred), in each dtype."""
    rng = np.random.default_rng(seed)
    arrays = []
    for shape, dtype in shapes:
        dtype = np.dtype(dtype)
        if math.prod(shape) == 0:  # no int64 draw first: numpy may hold f32[0,2**61] but not s64[0,2**61]
            arrays.append(np.zeros(shape, dtype))
        elif dtype == np.bool_:
            arrays.append(rng.integers(0, 2, size=shape).astype(np.bool_))
        elif dtype.kind == "c":
            real = rng.integers(0, RANDOM_HIGH, size=shape)
            imag = rng.integers(0, RANDOM_HIGH, size=shape)
            arrays.append((real + 1j * imag).astype(dtype))
        else:
            arrays.append(rng.integers(0, RANDOM_HIGH, size=shape).astype(dtype))
    return arrays


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def byte_count(count: int) -> str:
    """``4000000000000`` -> ``4000000000000 bytes (3.6 TiB)``."""
    size, unit = float(count), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{count} bytes" + (f" ({size:.1f} {unit})" if unit != "bytes" else "")


def check_numpy_holds(signature: Sequence[tuple[tuple[int, ...], object]], what: str) -> None:
    """A RunError naming the array when numpy cannot make one of ``signature``'s shapes: it refuses
    any array, an empty one too, whose non-zero dimensions multiply to more bytes than int64 holds
    (XLA's verifier takes ``f32[0,9223372036854775807]``)."""
    for number, (shape, dtype) in enumerate(signature):
        size = math.prod(d for d in shape if d) * np.dtype(dtype).itemsize
        if size > _INT64_MAX:
            raise RunError(f"{what} {number} ({shape_str(shape, dtype)}) cannot be a numpy array: its "
                           f"non-zero dimensions take {size} bytes, more than int64 holds ({_INT64_MAX})")


def check_memory_for(signature: Sequence[tuple[tuple[int, ...], object]], what: str) -> None:
    """A RunError naming the parameter when the global arrays of ``signature`` cannot fit in
    this machine's memory (checked before any is allocated)."""
    limit = memory_bytes()
    if limit is None:
        return
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in signature]
    for number, ((shape, dtype), size) in enumerate(zip(signature, sizes)):
        if size > limit:
            raise RunError(f"{what}: parameter {number} ({shape_str(shape, dtype)}) takes "
                           f"{byte_count(size)}, more than this machine's memory "
                           f"({byte_count(limit)})")
    if sum(sizes) > limit:
        raise RunError(f"{what}: the inputs take {byte_count(sum(sizes))} together, more than "
                       f"this machine's memory ({byte_count(limit)})")


@dataclasses.dataclass
class _NpzInputs:
    """The arrays ``arg0..argK`` of an ``.npz`` file, known by their ``.npy`` headers until
    :meth:`load`: a run checks their count, shapes and dtypes against the module first, so that
    nothing is inflated for a module that cannot take it."""

    path: str
    signature: list[tuple[tuple[int, ...], np.dtype]]

    @classmethod
    def read(cls, path: str) -> "_NpzInputs":
        """The headers of ``path``'s arrays, checked (see :func:`_npz_headers`)."""
        if not os.path.exists(path):
            raise RunError(f"{path}: No such file or directory")
        if os.path.isfile(path) and not zipfile.is_zipfile(path):
            raise RunError(f"{path}: not an .npz file (expected arrays arg0..argK saved with numpy.savez)")
        headers = _npz_headers(path)
        names = [f"arg{i}" for i in range(len(headers))]
        unexpected = sorted(set(headers) - set(names))
        if unexpected:
            raise RunError(f"{path}: unexpected array '{unexpected[0]}' (inputs are named arg0..argK)")
        return cls(path, [headers[n] for n in names])

    def load(self) -> list[np.ndarray]:
        """The arrays, each read up to the size its header gives."""
        try:
            with np.load(self.path, allow_pickle=False) as data:
                return [data[f"arg{i}"] for i in range(len(self.signature))]
        except OSError as exc:
            raise RunError(f"{self.path}: {exc.strerror or exc}") from exc
        except Exception as exc:  # noqa: BLE001 - zipfile/pickle/format errors
            raise RunError(f"{self.path}: not a readable .npz file ({type(exc).__name__}: "
                           f"{first_line(str(exc))})") from exc


def load_inputs(path: str) -> list[np.ndarray]:
    """The arrays ``arg0..argK`` of an ``.npz`` file, in order."""
    return _NpzInputs.read(path).load()


def _npz_headers(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of every array of an ``.npz``, read from its ``.npy`` header before
    loading any: an array whose data the file does not hold (a small, compressed file that would
    inflate to more than it says, a truncated one), an object array, or arrays that do not fit in
    this machine's memory are refused with one line."""
    headers, total, limit = {}, 0, memory_bytes()
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                name = member.filename.removesuffix(".npy")
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        shape, _, dtype = np.lib.format._read_array_header(f, version)
                    header_size = f.tell()
                if dtype.hasobject:
                    raise RunError(f"{path}: array '{name}' holds Python objects (dtype {dtype}); "
                                   f"inputs are numeric arrays")
                size = math.prod(shape) * dtype.itemsize
                if size > member.file_size - header_size:
                    raise RunError(f"{path}: array '{name}' says it is {shape_str(shape, dtype)} "
                                   f"({byte_count(size)}), but the file holds "
                                   f"{byte_count(max(member.file_size - header_size, 0))} of data for it")
                headers[name] = (tuple(shape), dtype)
                total += size
                if limit is not None and total > limit:
                    raise RunError(f"{path}: array '{name}' ({shape_str(shape, dtype)}, "
                                   f"{byte_count(size)}) brings the inputs to {byte_count(total)}, "
                                   f"more than this machine's memory ({byte_count(limit)})")
    except RunError:
        raise
    except OSError as exc:
        raise RunError(f"{path}: {exc.strerror or exc}") from exc
    except Exception as exc:  # noqa: BLE001 - zipfile/format errors: one line
        raise RunError(f"{path}: not a readable .npz file ({type(exc).__name__}: "
                       f"{first_line(str(exc))})") from exc
    return headers


def save_arrays(path: str, arrays: Sequence[np.ndarray], prefix: str = "out") -> None:
    """Write ``arrays`` to ``path`` (.npz) as ``{prefix}0..{prefix}M``.

    A regular file is written atomically (a temporary file in its directory, then a
    rename), so that a reader never sees half of it and an interrupted write leaves
    nothing behind; a path that is not a regular file (``/dev/null``, a FIFO) gets the
    archive written in place, since renaming over it would replace the device.
    """
    named = {f"{prefix}{i}": a for i, a in enumerate(arrays)}
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            if os.path.isdir(path):
                raise RunError(f"{path}: Is a directory")
            archive = io.BytesIO()  # zipfile seeks back, which a device or FIFO cannot do
            np.savez(archive, **named)
            with open(path, "wb") as f:
                f.write(archive.getbuffer())
            return
        write_through_temp_file(path, lambda f: np.savez(f, **named), binary=True, suffix=".npz.tmp")
    except OSError as exc:
        raise RunError(f"{path}: {exc.strerror or exc}") from exc


def _check_signature(given, expected, what: str) -> None:
    """A RunError unless the ``(shape, dtype)`` of each input, ``given``, is what the module
    expects (an array of raw bytes, as .npz keeps bfloat16, passes for a dtype of its size)."""
    if len(given) != len(expected):
        raise RunError(f"{what} takes {len(expected)} parameter{'s' if len(expected) != 1 else ''}, "
                       f"but {len(given)} input array{'s were' if len(given) != 1 else ' was'} given")
    for i, ((shape, dtype), (want_shape, want_dtype)) in enumerate(zip(given, expected)):
        dtype, want_dtype = np.dtype(dtype), np.dtype(want_dtype)
        raw = dtype.kind == "V" and dtype.itemsize == want_dtype.itemsize
        if (dtype != want_dtype and not raw) or tuple(shape) != tuple(want_shape):
            raise RunError(f"input arg{i} is {shape_str(shape, dtype)}, but {what} "
                           f"expects {shape_str(want_shape, want_dtype)}")


def _check_inputs(inputs: Sequence[np.ndarray], expected, what: str) -> list[np.ndarray]:
    """Inputs matching the expected global shapes and dtypes (raw-byte arrays are viewed)."""
    arrays = [np.asarray(a) for a in inputs]
    _check_signature([(a.shape, a.dtype) for a in arrays], expected, what)
    return [a if a.dtype == np.dtype(dtype) else a.view(dtype) for a, (_, dtype) in zip(arrays, expected)]


# --- Results -------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    """What one run produced.

    ``outputs``: one array per result leaf (tuples flattened), global arrays
    in partition mode, stacked per replica in replica mode.  ``inputs``: the
    arrays the module ran on, in the same convention.  ``seconds``: one wall
    time per iteration (execution only).
    """

    outputs: list[np.ndarray]
    inputs: list[np.ndarray]
    mode: str  # "single", "replica" or "partition"
    num_replicas: int
    num_partitions: int
    partitioning: str  # "none", "spmd" or "per_device"
    seconds: list[float]
    warnings: list[str] = dataclasses.field(default_factory=list)
    num_processes: int = 1  # processes that ran the module
    local_devices: int = 1  # devices of process 0 that ran it
    cost: dict = dataclasses.field(default_factory=dict)  # XLA's cost analysis (flops, bytes...)
    stage: str | None = None  # the stage of XLA's pipeline it was compiled from (None: the start)

    def timing(self) -> dict[str, float]:
        """Median, min and max execution time in seconds."""
        s = sorted(self.seconds)
        return {"median": float(np.median(s)), "min": s[0], "max": s[-1], "iterations": len(s)}

    def describe(self) -> str:
        if self.mode == "replica":
            what = f"{self.num_replicas} replicas"
        elif self.mode == "partition":
            what = f"{self.num_partitions} partitions, {self.partitioning.replace('_', '-')} module"
        else:
            what = "1 device"
        if self.stage:
            what += f", compiled from XLA's {self.stage} stage"
        if self.num_processes > 1:
            what += f", {self.num_processes} processes x {self.local_devices} devices"
        return what


@dataclasses.dataclass
class OutputComparison:
    """How one output compares with the reference's."""

    index: int
    shape: str
    reference_shape: str
    count: int = 0          # elements
    mismatches: int = 0     # elements outside both bounds
    max_abs_error: float = 0.0
    max_abs_index: tuple | None = None
    max_rel_error: float = 0.0
    max_rel_index: tuple | None = None
    first_mismatch: tuple | None = None
    first_values: tuple | None = None  # (actual, reference) at first_mismatch

    @property
    def ok(self) -> bool:
        return self.shape == self.reference_shape and self.mismatches == 0

    def format(self) -> str:
        head = f"out{self.index}: {self.shape}"
        if self.shape != self.reference_shape:
            return f"{head} MISMATCH: the reference's out{self.index} is {self.reference_shape}"
        errors = (f"max abs error {self.max_abs_error:.6g}"
                  + (f" at {list(self.max_abs_index)}" if self.max_abs_error and self.max_abs_index else "")
                  + f", max rel error {self.max_rel_error:.6g}"
                  + (f" at {list(self.max_rel_index)}" if self.max_rel_error and self.max_rel_index else ""))
        if self.ok:
            return f"{head} OK ({errors})"
        actual, expected = self.first_values
        return (f"{head} MISMATCH: {self.mismatches} of {self.count} elements differ; {errors}; "
                f"first mismatch at {list(self.first_mismatch)}: {actual} vs reference {expected}")


@dataclasses.dataclass
class Comparison:
    """Every output compared; ``ok`` when all match and the output counts are equal."""

    outputs: list[OutputComparison]
    num_outputs: int
    num_reference_outputs: int
    abs_error_bound: float
    rel_error_bound: float

    @property
    def ok(self) -> bool:
        return (self.num_outputs == self.num_reference_outputs
                and all(o.ok for o in self.outputs))

    @property
    def mismatched(self) -> list[OutputComparison]:
        return [o for o in self.outputs if not o.ok]

    def format(self) -> str:
        lines = [o.format() for o in self.outputs]
        if self.num_outputs != self.num_reference_outputs:
            lines.append(f"MISMATCH: the module has {self.num_outputs} outputs, the reference "
                         f"{self.num_reference_outputs}")
        return "\n".join(lines)

    def summary(self) -> str:
        if self.ok:
            if self.num_outputs == 1:
                return "the output matches the reference"
            return f"all {self.num_outputs} outputs match the reference"
        if self.num_outputs != self.num_reference_outputs:
            return (f"the module has {self.num_outputs} outputs, the reference "
                    f"{self.num_reference_outputs}")
        bad = self.mismatched
        return (f"{len(bad)} of {self.num_outputs} outputs differ from the reference "
                f"({', '.join(f'out{o.index}' for o in bad)})")


def _compare_one(index: int, actual: np.ndarray, expected: np.ndarray,
                 abs_bound: float, rel_bound: float) -> OutputComparison:
    actual, expected = np.asarray(actual), np.asarray(expected)
    result = OutputComparison(index, shape_str(actual.shape, actual.dtype),
                              shape_str(expected.shape, expected.dtype), count=int(actual.size))
    if result.shape != result.reference_shape or actual.size == 0:
        return result
    kind, name = actual.dtype.kind, actual.dtype.name
    if kind in "fc" or name.startswith(("bfloat", "float")):
        # numpy's and ml_dtypes' floating types, and complex: bounds apply; NaN equals NaN.
        wide = np.complex128 if kind == "c" else np.float64
        a, e = actual.astype(wide), expected.astype(wide)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            same = (a == e) | (np.isnan(a) & np.isnan(e))  # equal infinities are equal
            diff = np.where(same, 0.0, np.abs(a - e))
            diff = np.where(np.isnan(diff), np.inf, diff)
            denom = np.abs(e)
            rel = np.where(same, 0.0, np.where(denom > 0, diff / np.where(denom > 0, denom, 1), np.inf))
            rel = np.where(np.isnan(rel), np.inf, rel)
        bad = ~same & (diff > abs_bound) & (rel > rel_bound)
    elif kind in "biu" or name.startswith(("int", "uint")):
        # integers and predicates: exact
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        diff = np.abs(a - e)
        denom = np.abs(e)
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.where(diff == 0, 0.0, np.where(denom > 0, diff / np.where(denom > 0, denom, 1), np.inf))
        bad = diff != 0
    else:
        # anything else: byte for byte
        width = actual.dtype.itemsize
        a = actual.view(np.uint8).reshape(actual.shape + (width,))
        e = expected.view(np.uint8).reshape(expected.shape + (width,))
        bad = np.any(a != e, axis=-1)
        diff = bad.astype(np.float64)
        rel = np.where(bad, np.inf, 0.0)
    return _fill(result, actual, expected, diff, rel, bad)


def _fill(result, actual, expected, diff, rel, bad) -> OutputComparison:
    result.mismatches = int(np.count_nonzero(bad))
    flat_abs = int(np.argmax(diff))
    flat_rel = int(np.argmax(rel))
    result.max_abs_error = float(diff.flat[flat_abs])
    result.max_rel_error = float(rel.flat[flat_rel])
    result.max_abs_index = tuple(int(i) for i in np.unravel_index(flat_abs, diff.shape))
    result.max_rel_index = tuple(int(i) for i in np.unravel_index(flat_rel, rel.shape))
    if result.mismatches:
        first = int(np.argmax(bad))
        index = tuple(int(i) for i in np.unravel_index(first, bad.shape))
        result.first_mismatch = index
        result.first_values = (actual[index].item() if actual.ndim else actual.item(),
                               expected[index].item() if expected.ndim else expected.item())
    return result


def compare_outputs(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray],
                    abs_error_bound: float = DEFAULT_ABS_ERROR_BOUND,
                    rel_error_bound: float = DEFAULT_REL_ERROR_BOUND) -> Comparison:
    """Compare outputs element by element.

    An element matches when both are NaN, when they are equal, or when its
    absolute error is within ``abs_error_bound`` or its relative error (to the
    reference) within ``rel_error_bound``.  Integers and predicates must be
    equal.  Shapes and dtypes must be equal.
    """
    compared = [_compare_one(i, a, e, abs_error_bound, rel_error_bound)
                for i, (a, e) in enumerate(zip(outputs, reference))]
    return Comparison(compared, len(outputs), len(reference), abs_error_bound, rel_error_bound)


# --- Progress ------------------------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on a text stream (rewritten in place, at most 10 times a second)."""

    def __init__(self, stream, total: int, label: str):
        self.stream, self.total, self.label = stream, total, label
        self.last = 0.0
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = width * done // self.total
        rate = done / max(now - self.start, 1e-9)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                          f"{done}/{self.total} ({rate:.1f}/s)")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


# --- The job: load, compile and run modules (in this process, a child, or each worker) ------------


@dataclasses.dataclass
class _RunSpec:
    ref: ModuleRef
    num_replicas: int | None = None
    num_partitions: int | None = None
    partition_mode: str = "auto"


@dataclasses.dataclass
class _Job:
    runs: list[_RunSpec]
    inputs: list[np.ndarray] | _NpzInputs | None = None
    seed: int = 0
    iterations: int = 1
    platform: str = "cpu"
    progress: bool = False
    # multi-process
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # entry parameters (numbers or names) that hold the same value on every device
    replicated: list[str] = dataclasses.field(default_factory=list)


def _validate_counts(num_replicas, num_partitions, what: str):
    for name, value in (("num_replicas", num_replicas), ("num_partitions", num_partitions)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise RunError(f"{what}: {name} must be a positive integer, not {value}")


class LoadedModule:
    """One module read by XLA, with its device counts, mode and placements resolved."""

    def __init__(self, spec: _RunSpec, status):
        from hlo_tools.xla import xla_bridge  # noqa: PLC0415

        self.spec = spec
        ref = spec.ref
        status(f"reading {ref.name}")
        content = ref.read()
        try:
            if isinstance(content, bytes):
                self.module = xla_bridge.module_from_proto(content)
            else:
                self.module = xla_bridge.xla_parse(content)
        except xla_bridge.XlaBridgeError as exc:
            raise RunError(_xla_parse_message(ref.name, str(exc))) from exc
        self.printed = xla_bridge.module_text(self.module)
        source = content if isinstance(content, str) else self.printed
        self.stage = optimized_stage(source)  # None: from before XLA's optimizations
        self.param_shardings, self.root_sharding = _entry_shardings(self.printed)
        self.param_global_shapes = _entry_global_shapes(self.printed)
        self.num_replicas, self.num_partitions = device_counts(
            source, self.printed, spec.num_replicas, spec.num_partitions)
        _validate_counts(self.num_replicas, self.num_partitions, ref.name)
        self.num_devices = self.num_replicas * self.num_partitions
        if self.num_replicas > 1 and self.num_partitions > 1:
            raise RunError(f"{ref.name}: {self.num_replicas} replicas x {self.num_partitions} "
                           f"partitions: running replicas and partitions together is not supported")
        if self.num_partitions > 1:
            self.mode = "partition"
            mode = spec.partition_mode
            if mode not in PARTITION_MODES:
                raise RunError(f"unknown partition mode '{mode}' (expected one of "
                               f"{', '.join(PARTITION_MODES)})")
            if mode == "spmd" and self.stage:
                raise RunError(f"{ref.name}: XLA already optimized the module (up to its {self.stage} "
                               f"stage), so it is partitioned: partition mode spmd does not apply")
            if mode == "auto":
                mode = "spmd" if partitioner_for(self.printed) and not self.stage else "per_device"
            self.partitioning = mode
        else:
            self.mode = "replica" if self.num_replicas > 1 else "single"
            self.partitioning = "none"
        params, results, is_tuple = xla_bridge.program_signature(self.module)
        for k, (param, tup) in enumerate(zip(params, is_tuple)):
            if tup:
                raise RunError(f"{ref.name}: entry parameter {k} is a tuple; tuple-shaped "
                               f"parameters are not supported")
            if param[1] == "token":
                raise RunError(f"{ref.name}: entry parameter {k} is a token; token parameters "
                               f"are not supported")
        if any(dtype == "token" for _, dtype in results):
            raise RunError(f"{ref.name}: the result holds a token; token results are not supported")
        self.params = params          # [(dims, dtype)] as written in the module
        self.results = results        # [(dims, dtype)] per result leaf, as written

    def placements(self, executable=None) -> tuple[list[_Placement], list[_Placement]]:
        """How each parameter and output maps to partitions (partition mode).

        A per-device module says it with its own ``sharding=`` attributes; for
        a module that XLA partitions, XLA's choice is read from the compiled
        ``executable``.
        """
        n = self.num_partitions
        name = self.spec.ref.name
        if self.partitioning == "spmd":
            param_texts = executable.parameter_shardings() or [None] * len(self.params)
            out_texts = executable.output_shardings() or [None] * len(self.results)
            if len(out_texts) == 1 and len(self.results) > 1:
                out_texts = out_texts * len(self.results)
            per_device = False
        else:
            param_texts = [self.param_shardings.get(k) for k in range(len(self.params))]
            per_device = True
            out_texts = [None] * len(self.results)
            if self.root_sharding is not None:
                desc = _describe(self.root_sharding, name, "ROOT")
                if desc[0] == "tuple":
                    flat = _flatten_tuple_sharding(desc)
                    if len(flat) != len(self.results):
                        raise RunError(f"{name}: the ROOT sharding has {len(flat)} elements for "
                                       f"{len(self.results)} outputs")
                    out_texts = flat
                else:
                    out_texts = [self.root_sharding] * len(self.results)

        def place(text, shape, what, global_shape=None):
            if text is None:
                return _replicated(shape, n, None)
            desc = text if isinstance(text, tuple) else _describe(text, name, what)
            label = text if isinstance(text, str) else _desc_text(desc)
            return _placement(desc, label, tuple(shape), n, per_device=per_device,
                              what=f"{name}: {what}", global_shape=global_shape)

        declared = self.param_global_shapes if per_device else {}
        params = [place(t, shape, f"parameter {k}", declared.get(k))
                  for k, (t, (shape, _)) in enumerate(zip(param_texts, self.params))]
        outs = [place(t, shape, f"output {j}")
                for j, (t, (shape, _)) in enumerate(zip(out_texts, self.results))]
        return params, outs

    def partitioner(self) -> str:
        """The partitioner XLA compiles this module with (see xla_bridge.compile_module)."""
        if self.partitioning == "per_device":
            return "prepartitioned"
        if self.partitioning == "spmd":
            return partitioner_for(self.printed) or "gspmd"
        # like JAX: a module with sharding markers goes through its partitioner
        return partitioner_for(self.printed) or "none"

    def compile(self, devices, process_index: int = 0, platform: str = "cpu") -> "CompiledModule":
        """Compile for `devices` (one per replica or partition)."""
        from hlo_tools.xla import xla_bridge  # noqa: PLC0415

        try:
            executable = compile_executable(
                self.module, platform, devices, process_index, num_replicas=self.num_replicas,
                num_partitions=self.num_partitions, partitioner=self.partitioner(), stage=self.stage)
        except xla_bridge.XlaBridgeError as exc:
            raise RunError(f"{self.spec.ref.name}: {first_line(str(exc))}"
                           + (f" ({optimized_note(self.stage)})" if self.stage else "")) from exc
        return CompiledModule(self, executable)

    def global_signature(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """The global arrays the module takes, in its mode's convention (no compiling needed)."""
        if self.mode == "replica":
            return [((self.num_replicas,) + tuple(shape), dtype) for shape, dtype in self.params]
        if self.mode == "partition" and self.partitioning == "per_device":
            params, _ = self.placements()
            return [(p.global_shape, dtype) for p, (_, dtype) in zip(params, self.params)]
        return [(tuple(shape), dtype) for shape, dtype in self.params]


class CompiledModule:
    """A module compiled in this process: run it many times on global arrays.

    What `run_module` does per call (split global inputs over the devices,
    execute, assemble global outputs), without compiling again: for callers
    that run one module step after step (the TF front end, benchmarks).
    """

    def __init__(self, loaded: LoadedModule, executable):
        self.loaded = loaded
        self.executable = executable
        self.parameter_places, self.output_places = (
            loaded.placements(executable) if loaded.mode == "partition" else (None, None))

    def global_outputs(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """The global arrays `run` returns: (shape, dtype) per output leaf."""
        if self.output_places is None:
            return list(self.loaded.results)
        return [(tuple(p.global_shape), dtype)
                for p, (_, dtype) in zip(self.output_places, self.loaded.results)]

    def device_inputs(self, inputs: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        """Global `inputs`, checked against the module's signature, split per device."""
        inputs = _check_inputs(inputs, self.loaded.global_signature(), self.loaded.spec.ref.name)
        return _per_device_inputs(self.loaded, self.parameter_places, inputs)

    def execute(self, device_inputs, iterations: int = 1, progress=None):
        """Run on inputs already split per device: (per-output pieces by device, seconds)."""
        from hlo_tools.xla import xla_bridge  # noqa: PLC0415

        try:
            return self.executable.execute(device_inputs, iterations, progress)
        except xla_bridge.XlaBridgeError as exc:
            raise RunError(f"{self.loaded.spec.ref.name}: {first_line(str(exc))}") from exc

    def assemble(self, pieces, warnings: list[str]) -> list[np.ndarray]:
        """Global outputs from `execute`'s pieces; notes on replicas that disagree go to `warnings`."""
        return _assemble_outputs(self.loaded, self.output_places, pieces, warnings)

    def run(self, inputs: Sequence[np.ndarray], warnings: list[str] | None = None) -> list[np.ndarray]:
        """The module's global outputs for global `inputs`."""
        pieces, _ = self.execute(self.device_inputs(inputs))
        return self.assemble(pieces, [] if warnings is None else warnings)


def load_module(text: str, name: str = "<module>", num_replicas: int | None = None,
                num_partitions: int | None = None, partition_mode: str = "auto") -> LoadedModule:
    """XLA's reading of module `text`, with its device counts and mode as `run_module` resolves them."""
    spec = _RunSpec(ModuleRef(text=text, display=name), num_replicas, num_partitions, partition_mode)
    return LoadedModule(spec, lambda _: None)


def _describe(text: str, module_name: str, what: str):
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    try:
        return xla_bridge.describe_sharding(text)
    except xla_bridge.XlaBridgeError as exc:
        raise RunError(f"{module_name}: {what}: {exc}") from exc


def _sharding_device_count(texts) -> int:
    """How many devices the tiled and maximal shardings among ``texts`` name (at least 1)."""
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    count = 1
    for text in texts:
        if text is None:
            continue
        try:
            desc = xla_bridge.describe_sharding(text)
        except xla_bridge.XlaBridgeError:
            continue
        for leaf in _flatten_tuple_sharding(desc):
            if leaf[0] == "tiled":
                count = max(count, len(leaf[2]))
            elif leaf[0] == "maximal":
                count = max(count, leaf[1] + 1)
    return count


def _flatten_tuple_sharding(desc) -> list:
    if desc[0] != "tuple":
        return [desc]
    return [leaf for element in desc[1] for leaf in _flatten_tuple_sharding(element)]


def _desc_text(desc) -> str:
    kind = desc[0]
    if kind == "replicated":
        return "{replicated}"
    if kind == "manual":
        return "{manual}"
    if kind == "maximal":
        return f"{{maximal device={desc[1]}}}"
    if kind == "tiled":
        return f"{{devices=[{','.join(map(str, desc[1]))}]{','.join(map(str, desc[2]))}}}"
    return str(desc)


def _xla_parse_message(name: str, message: str) -> str:
    match = re.search(r"was parsing (\d+):(\d+): error: ([^\n]*)", message)
    if match:
        return f"{name}:{match.group(1)}:{match.group(2)}: {match.group(3)}"
    return f"{name}: {first_line(message)}"


def first_line(message: str) -> str:
    """The first line of an error message (with the next one when the first ends in ':')."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return str(message).strip()
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def _entry_parameter_names(printed: str) -> dict[str, int]:
    """The entry parameters of XLA's print, by instruction name."""
    names = {}
    for line in printed.split("\nENTRY ", 1)[-1].splitlines()[1:]:
        stripped = line.strip()
        if stripped == "}":
            break
        match = _PARAMETER_LINE.match(stripped)
        if match:
            name = stripped.removeprefix("ROOT ").split("=", 1)[0].strip().lstrip("%")
            names[name] = int(match.group(1))
    return names


def _replicated_parameter_numbers(loaded: LoadedModule, wanted: Sequence[str]) -> list[int]:
    """Entry parameter numbers for `wanted` (numbers or names of entry parameters)."""
    names = _entry_parameter_names(loaded.printed)
    count = len(loaded.params)
    numbers = []
    for item in wanted:
        if item.isdigit():
            number = int(item)
            if number >= count:
                raise RunError(f"{loaded.spec.ref.name}: replicated parameter {number} does not "
                               f"exist (the entry has {count} parameter{'s' if count != 1 else ''})")
        elif item in names:
            number = names[item]
        else:
            known = ", ".join(sorted(names, key=names.get)) or "none"
            raise RunError(f"{loaded.spec.ref.name}: replicated parameter '{item}' is neither an "
                           f"entry parameter number nor name (the entry's parameters: {known})")
        numbers.append(number)
    return numbers


def _replicate_parameters(loaded: LoadedModule, inputs: list[np.ndarray], wanted: Sequence[str],
                          given: bool) -> list[np.ndarray]:
    """`inputs` with the `wanted` parameters holding device 0's value on every device.

    Generated inputs are changed; `given` inputs must already be so (else a RunError).
    """
    numbers = _replicated_parameter_numbers(loaded, wanted)
    if loaded.mode == "partition" and loaded.partitioning == "spmd":
        raise RunError(f"{loaded.spec.ref.name}: replicated parameters apply to replica programs "
                       f"and per-device modules; in a module XLA partitions, its shardings say "
                       f"what each device holds")
    placements = loaded.placements()[0] if loaded.mode == "partition" else None
    inputs = list(inputs)
    for number in numbers:
        array = inputs[number]
        if loaded.mode == "replica":
            same = np.ascontiguousarray(np.broadcast_to(array[:1], array.shape))
        elif loaded.mode == "partition":
            placement = placements[number]
            first_piece = _split(array, placement)[0]
            same = _assemble(dict.fromkeys(range(loaded.num_partitions), first_piece), placement,
                             array.dtype, "", [])
        else:
            continue  # one device: nothing to make equal
        if given and not _same_bits(same, array):
            raise RunError(f"input arg{number} holds other values on other devices than on "
                           f"device 0, but parameter {number} is listed as replicated")
        inputs[number] = same
    return inputs


def unwritten_gather_warnings(printed: str, num_devices: int, name: str) -> list[str]:
    """Notes on the all-gathers of a one-device run whose output is bigger than their operand.

    On one device every replica group has one member, so an all-gather's output is its operand;
    XLA's verifier skips its shard-count check then (a module's counts default to 1), and the
    rest of the output is memory nothing wrote: it differs from run to run.
    """
    if num_devices != 1 or "all-gather" not in printed:
        return []
    import hlo_tools  # noqa: PLC0415
    from hlo_tools.ir.attributes import attr_ints  # noqa: PLC0415

    try:
        module = hlo_tools.parse_module(printed)
    except hlo_tools.HloParseError:
        return []
    notes = []
    for computation in module.computations:
        for instr in computation.instructions:
            if instr.opcode not in ("all-gather", "all-gather-start"):
                continue
            out = instr.shape.tuple_shapes[1] if instr.opcode == "all-gather-start" else instr.shape
            outs = [out] if len(instr.operands) == 1 else list(out.tuple_shapes or ())
            dim = (attr_ints(instr.attrs, "dimensions") or (None,))[0]
            for operand, result in zip(instr.operands, outs):
                if dim is None or dim >= min(operand.shape.rank, result.rank):
                    continue
                if result.dims[dim] != operand.shape.dims[dim]:
                    notes.append(f"{name}: {instr.name}: an all-gather on one device gathers "
                                 f"{_shape_text(operand.shape)} into {_shape_text(result)}; only the "
                                 f"first {operand.shape.dims[dim]} of {result.dims[dim]} along "
                                 f"dimension {dim} are written, the rest is uninitialized memory "
                                 f"(XLA checks the shard count only for more than one device)")
                    break
    return notes


def _shape_text(shape) -> str:
    return shape.to_text(print_layout=False)


def _per_device_inputs(loaded: LoadedModule, placements, inputs) -> list[list[np.ndarray]]:
    if loaded.mode == "partition":
        return [_split(x, p) for x, p in zip(inputs, placements)]
    if loaded.mode == "replica":
        return [[np.ascontiguousarray(x[i]) for i in range(loaded.num_replicas)] for x in inputs]
    return [[np.ascontiguousarray(x)] for x in inputs]


def _assemble_outputs(loaded: LoadedModule, placements, pieces, warnings) -> list[np.ndarray]:
    outputs = []
    for j, (by_device, (shape, dtype)) in enumerate(zip(pieces, loaded.results)):
        if loaded.mode == "partition":
            outputs.append(_assemble(by_device, placements[j], dtype,
                                     f"{loaded.spec.ref.name}: output {j}", warnings,
                                     " (XLA keeps no output shardings in a module it optimized)"
                                     if loaded.stage else ""))
        elif loaded.mode == "replica":
            outputs.append(np.stack([by_device[i] for i in range(loaded.num_replicas)]))
        else:
            outputs.append(by_device[0])
    return outputs


def _execute_job(job: _Job, status=lambda _: None, progress_stream=None) -> list[RunResult] | None:
    """Run every module of ``job`` on the same inputs (generated for the first).

    Returns the results (None on processes other than 0 of a multi-process run).
    """
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    loaded = [LoadedModule(spec, status) for spec in job.runs]
    biggest = max(loaded, key=lambda m: m.num_devices)
    needed = biggest.num_devices
    processes = job.num_processes
    if job.platform == "cpu":
        if needed > MAX_CPU_DEVICES:
            raise RunError(f"{biggest.spec.ref.name}: {needed} devices do not fit this machine "
                           f"(at most {MAX_CPU_DEVICES} CPU devices)")
        if processes > 1:
            if needed % processes:
                raise RunError(f"{biggest.spec.ref.name}: {needed} devices cannot be split "
                               f"evenly over {processes} processes")
            xla_bridge.configure_cpu_devices(needed // processes)
        else:
            ensure_cpu_devices(needed, max(needed, 8))

    # Every size is checked before XLA's client starts or an input is read or made.
    signature, name = loaded[0].global_signature(), loaded[0].spec.ref.name
    for m in loaded:
        check_numpy_holds(m.global_signature(), f"{m.spec.ref.name}: parameter")
        check_numpy_holds(m.results, f"{m.spec.ref.name}: output")
    if isinstance(job.inputs, list):  # in memory already
        _check_signature([(a.shape, a.dtype) for a in job.inputs], signature, name)
    else:  # to be read from a file, or made
        if job.inputs is not None:
            _check_signature(job.inputs.signature, signature, name)
        check_memory_for(signature, name)
    for m in loaded[1:]:
        _check_signature(signature, m.global_signature(), f"{m.spec.ref.name} (the reference)")

    if processes > 1:
        status("joining the distributed run")
        try:
            xla_bridge.initialize_distributed(job.coordinator, processes, job.process_id)
        except xla_bridge.XlaBridgeError as exc:
            raise RunError(str(exc)) from exc
    try:
        devices, process_index = xla_bridge.platform_devices(job.platform)
    except xla_bridge.XlaBridgeError as exc:
        raise RunError(first_line(str(exc))) from exc
    if needed > len(devices):
        hint = ""
        if job.platform == "cpu":
            hint = (f" (jax started with {len(devices)} CPU devices: set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={needed} before importing jax, "
                    f"or run isolated)")
        raise RunError(f"{biggest.spec.ref.name}: {needed} devices are needed, but platform "
                       f"'{job.platform}' has {len(devices)}{hint}")

    # Inputs: given for, or generated for, the first module; every module runs on them.
    if job.inputs is None:
        inputs = random_inputs(signature, job.seed)
    else:
        inputs = _check_inputs(job.inputs.load() if isinstance(job.inputs, _NpzInputs) else job.inputs,
                               signature, name)
    if job.replicated:
        inputs = _replicate_parameters(loaded[0], inputs, job.replicated, given=job.inputs is not None)

    results = []
    for index, m in enumerate(loaded):
        name = m.spec.ref.name
        run_devices = devices[:m.num_devices]
        owners = {xla_bridge.device_process(d) for d in run_devices}
        spans = len(owners) > 1
        if spans and len(run_devices) != len(devices):
            raise RunError(f"{name}: in a {processes}-process run a module must use all "
                           f"{len(devices)} devices or fit in process 0's")
        if not (spans or process_index in owners):
            continue  # another process runs this module alone
        status(f"compiling {name}" + (f" ({optimized_note(m.stage)})" if m.stage else ""))
        compiled = m.compile(run_devices, process_index, job.platform)
        executable = compiled.executable
        out_places = compiled.output_places
        per_device = _per_device_inputs(m, compiled.parameter_places, inputs)
        status(f"running {name}")
        bar = None
        if job.progress and progress_stream is not None and job.iterations > 1 and index == 0:
            bar = _Progress(progress_stream, job.iterations, f"running {os.path.basename(name)}")
        try:
            pieces, seconds = executable.execute(per_device, job.iterations if index == 0 else 1,
                                                 bar.update if bar else None)
        except xla_bridge.XlaBridgeError as exc:
            raise RunError(f"{name}: {first_line(str(exc))}") from exc
        if spans:
            status(f"gathering the outputs of {name}")
            pieces = [xla_bridge.gather_from_processes(p, run_devices, process_index) for p in pieces]
        if process_index == 0:
            warnings: list[str] = unwritten_gather_warnings(m.printed, m.num_devices, name)
            outputs = _assemble_outputs(m, out_places, pieces, warnings)
            results.append(RunResult(outputs, list(inputs), m.mode, m.num_replicas,
                                     m.num_partitions, m.partitioning, seconds, warnings,
                                     len(owners), len(executable.local),
                                     {k: float(v) for k, v in executable.cost_analysis().items()
                                      if isinstance(v, (int, float))}, m.stage))
    return results if process_index == 0 else None


# --- Isolation: a child process per job ----------------------------------------------------------

_STATUS_FILE = "status"
_RESULT_FILE = "result.json"


def _job_to_dir(job: _Job, directory: str) -> dict:
    runs = []
    for i, spec in enumerate(job.runs):
        ref = spec.ref
        entry = {"num_replicas": spec.num_replicas, "num_partitions": spec.num_partitions,
                 "partition_mode": spec.partition_mode, "name": ref.name}
        if ref.path is not None:
            entry["path"] = os.path.abspath(ref.path)
            entry["input_format"] = ref.format()
        else:
            content = ref.read()
            suffix = ".pb" if isinstance(content, bytes) else ".hlo"
            path = os.path.join(directory, f"module{i}{suffix}")
            with open(path, "wb") as f:
                f.write(content if isinstance(content, bytes) else content.encode("utf-8"))
            entry["path"] = path
            entry["input_format"] = "pb" if isinstance(content, bytes) else "hlo"
        runs.append(entry)
    inputs_path = None
    if isinstance(job.inputs, _NpzInputs):
        inputs_path = os.path.abspath(job.inputs.path)
    elif job.inputs is not None:
        inputs_path = os.path.join(directory, "inputs.npz")
        np.savez(inputs_path, **{f"arg{i}": np.asarray(a) for i, a in enumerate(job.inputs)})
    return {"runs": runs, "inputs": inputs_path, "seed": job.seed, "iterations": job.iterations,
            "platform": job.platform, "progress": job.progress, "replicated": list(job.replicated)}


def _job_from_dict(d: dict) -> _Job:
    runs = []
    for entry in d["runs"]:
        ref = ModuleRef(path=entry["path"], input_format=entry["input_format"],
                        display=entry["name"])
        runs.append(_RunSpec(ref, entry["num_replicas"], entry["num_partitions"],
                             entry["partition_mode"]))
    inputs = _NpzInputs.read(d["inputs"]) if d.get("inputs") else None
    return _Job(runs, inputs, d["seed"], d["iterations"], d["platform"], d["progress"],
                d.get("coordinator"), d.get("num_processes", 1), d.get("process_id", 0),
                list(d.get("replicated", [])))


def _write_results(results: list[RunResult], directory: str) -> None:
    meta = []
    for i, r in enumerate(results):
        np.savez(os.path.join(directory, f"outputs{i}.npz"),
                 **{f"out{j}": a for j, a in enumerate(r.outputs)})
        if i == 0:
            np.savez(os.path.join(directory, "used_inputs.npz"),
                     **{f"arg{j}": a for j, a in enumerate(r.inputs)})
        fields = dataclasses.asdict(r)
        fields.pop("outputs")
        fields.pop("inputs")
        fields["dtypes"] = [a.dtype.name for a in r.outputs]
        fields["input_dtypes"] = [a.dtype.name for a in r.inputs]
        meta.append(fields)
    _atomic_write(os.path.join(directory, _RESULT_FILE), json.dumps({"results": meta}))


def _read_results(directory: str) -> list[RunResult]:
    with open(os.path.join(directory, _RESULT_FILE)) as f:
        payload = json.load(f)
    if "error" in payload:
        raise RunError(payload["error"])
    if not payload["results"]:
        return []  # a process other than 0 of a multi-process run
    import ml_dtypes  # noqa: PLC0415 - restores bf16/fp8 dtypes that .npz keeps as raw bytes

    input_dtypes = payload["results"][0]["input_dtypes"]
    with np.load(os.path.join(directory, "used_inputs.npz")) as data:
        inputs = [_restore_dtype(data[f"arg{j}"], input_dtypes[j], ml_dtypes)
                  for j in range(len(data.files))]
    results = []
    for i, fields in enumerate(payload["results"]):
        dtypes = fields.pop("dtypes")
        fields.pop("input_dtypes")
        with np.load(os.path.join(directory, f"outputs{i}.npz")) as data:
            outputs = [_restore_dtype(data[f"out{j}"], dtypes[j], ml_dtypes)
                       for j in range(len(data.files))]
        results.append(RunResult(outputs=outputs, inputs=inputs, **fields))
    return results


def _restore_dtype(array: np.ndarray, name: str, ml_dtypes) -> np.ndarray:
    if array.dtype.name == name:
        return array
    dtype = getattr(ml_dtypes, name, None)
    return array.view(dtype) if dtype is not None else array


def _atomic_write(path: str, text: str) -> None:
    """The worker's status and result files: the parent never reads half of one."""
    write_through_temp_file(path, lambda f: f.write(text), binary=False)


def _worker_main(job_path: str) -> None:
    """Entry point of a child process: run the job in ``job_path``, write the results beside it.

    Exits 0 after writing the results, 3 after writing an error; a crash leaves
    no result file, and the parent reads the status file and stderr instead.
    """
    directory = os.path.dirname(job_path)
    status_path = os.path.join(directory, _STATUS_FILE)
    distributed = False

    def status(text: str) -> None:
        _atomic_write(status_path, text)

    try:
        with open(job_path) as f:
            d = json.load(f)
        distributed = d.get("num_processes", 1) > 1
        progress_stream = None
        if d.get("progress_fd") is not None:
            try:
                progress_stream = io.TextIOWrapper(os.fdopen(d["progress_fd"], "wb", buffering=0),
                                                   write_through=True)
            except OSError:
                progress_stream = None
        job = _job_from_dict(d)
        results = _execute_job(job, status, progress_stream)
        if results is not None:
            status("writing the outputs")
            _write_results(results, directory)
        else:
            _atomic_write(os.path.join(directory, _RESULT_FILE), json.dumps({"results": []}))
        if distributed:
            status("leaving the distributed run")
            from hlo_tools.xla import xla_bridge  # noqa: PLC0415

            xla_bridge.shutdown_distributed()  # a barrier: only after a success
        status("done")
        code = 0
    except RunError as exc:
        _atomic_write(os.path.join(directory, _RESULT_FILE), json.dumps({"error": str(exc)}))
        code = 3
    except Exception as exc:  # noqa: BLE001 - still one line for the parent
        _atomic_write(os.path.join(directory, _RESULT_FILE),
                      json.dumps({"error": f"internal error: {type(exc).__name__}: "
                                           f"{first_line(str(exc))}"}))
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: nothing is left to clean up, and XLA's static destructors
    # and a distributed run's background threads only make exiting slow or noisy.
    os._exit(code)


# glog/absl fatal lines: "F1121 07:53:27.395452    5540 hlo_sharding.h:617] Check failed: ..."
_FATAL_LINE = re.compile(r"^F\d{4} [\d:.]+\s+\d+ ([^\]\s]+)\] (.+)$")
_CRASH_LINE = re.compile(r"(Check failed.*|RET_CHECK.*|Fatal Python error.*|Segmentation fault.*"
                         r"|terminate called.*)")


def crash_message(returncode: int, stderr: str, phase: str) -> str:
    if returncode < 0:
        try:
            how = signal.Signals(-returncode).name
        except ValueError:
            how = f"signal {-returncode}"
    else:
        how = f"exit status {returncode}"
    detail = ""
    lines = stderr.splitlines()
    for line in lines:
        match = _FATAL_LINE.match(line.strip())
        if match:
            detail = f"{match.group(2).strip()} ({match.group(1)})"
            break
    if not detail:
        for line in lines:
            match = _CRASH_LINE.search(line)
            if match:
                detail = match.group(1).strip()
                break
    if not detail:
        tail = [ln.strip() for ln in lines if ln.strip()]
        detail = tail[-1][:300] if tail else ""
    where = f" while {phase}" if phase else ""
    return f"XLA crashed{where} ({how})" + (f": {detail}" if detail else "")


def child_env() -> dict:
    env = dict(os.environ)
    package_root = str(pathlib.Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def _spawn(job_dict: dict, directory: str, progress_fd: int | None):
    job_path = os.path.join(directory, "job.json")
    d = dict(job_dict)
    d["progress_fd"] = progress_fd
    with open(job_path, "w") as f:
        json.dump(d, f)
    stderr_path = os.path.join(directory, "stderr.txt")
    stderr_file = open(stderr_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hlo_tools.xla.runner import _worker_main; "
                               "_worker_main(sys.argv[1])", job_path],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr_file,
        env=child_env(), pass_fds=(progress_fd,) if progress_fd is not None else (),
        start_new_session=False)
    stderr_file.close()
    return proc


def _collect(proc, directory: str) -> list[RunResult]:
    """The results of a finished child, or the RunError describing its failure."""
    result_path = os.path.join(directory, _RESULT_FILE)
    if os.path.exists(result_path):
        return _read_results(directory)
    try:
        with open(os.path.join(directory, _STATUS_FILE)) as f:
            phase = f.read().strip()
    except OSError:
        phase = "starting"
    try:
        with open(os.path.join(directory, "stderr.txt"), errors="replace") as f:
            stderr = f.read()
    except OSError:
        stderr = ""
    raise RunError(crash_message(proc.returncode, stderr, phase))


def _progress_fd(progress: bool) -> int | None:
    if not progress:
        return None
    try:
        sys.stderr.flush()
        return os.dup(sys.stderr.fileno())
    except (OSError, AttributeError, ValueError):
        return None


def _run_isolated(job: _Job, timeout: float | None, **distributed) -> list[RunResult]:
    """Run ``job`` in a child process (``distributed``: its place in a multi-process run)."""
    with tempfile.TemporaryDirectory(prefix="hlo-tools-run-") as directory:
        job_dict = _job_to_dir(job, directory)
        job_dict.update(distributed)
        fd = _progress_fd(job.progress)
        try:
            proc = _spawn(job_dict, directory, fd)
        finally:
            if fd is not None:
                os.close(fd)
        try:
            wait_for_child(proc, timeout)
        except subprocess.TimeoutExpired:
            raise RunError(f"the run took longer than {timeout:g} s and was stopped") from None
        return _collect(proc, directory)


def ensure_cpu_devices(needed: int, count: int) -> None:
    """Before jax starts its CPU backend: give it ``count`` devices when XLA_FLAGS would give
    fewer than ``needed`` (once the backend runs, its device count is fixed)."""
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    if xla_bridge.backend_initialized():
        return
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if needed > (int(flag.group(1)) if flag else 1):
        xla_bridge.configure_cpu_devices(count)


def wait_for_child(proc, timeout: float | None) -> None:
    """Wait for a child process; on a timeout (``subprocess.TimeoutExpired`` is raised) or an
    interruption, kill it first, so that no child outlives its caller."""
    try:
        proc.wait(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback(address: str) -> str:
    """``address`` (host:port) if its host is a loopback address, else a RunError."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise RunError(f"coordinator address '{address}' is not HOST:PORT")
    if host != "localhost":
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
        if not ok:
            raise RunError(f"coordinator address '{address}' is not a loopback address "
                           f"(only 127.0.0.1, ::1 or localhost are allowed)")
    return address


def _run_processes(job: _Job, timeout: float | None) -> list[RunResult]:
    """Start ``job.num_processes`` local workers of one distributed run; process 0's results."""
    coordinator = job.coordinator or f"127.0.0.1:{_free_loopback_port()}"
    check_loopback(coordinator)
    with tempfile.TemporaryDirectory(prefix="hlo-tools-run-") as root:
        procs = []
        try:
            for pid in range(job.num_processes):
                directory = os.path.join(root, f"process{pid}")
                os.mkdir(directory)
                job_dict = _job_to_dir(job, directory)
                job_dict.update(coordinator=coordinator, num_processes=job.num_processes,
                                process_id=pid)
                if pid:
                    job_dict["progress"] = False
                fd = _progress_fd(job.progress) if pid == 0 else None
                try:
                    procs.append((_spawn(job_dict, directory, fd), directory))
                finally:
                    if fd is not None:
                        os.close(fd)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                codes = [p.poll() for p, _ in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    # Give the others a moment to report their own error first.
                    time.sleep(0.5)
                    first = failed[0]
                    for i, (p, d) in enumerate(procs):
                        if p.poll() not in (None, 0) and os.path.exists(os.path.join(d, _RESULT_FILE)):
                            first = i
                            break
                    p, d = procs[first]
                    try:
                        _collect(p, d)
                        message = "failed"
                    except RunError as exc:
                        message = str(exc)
                    raise RunError(f"process {first} of {job.num_processes}: {message}")
                if all(c == 0 for c in codes):
                    return _collect(*procs[0])
                if deadline is not None and time.monotonic() > deadline:
                    raise RunError(f"the run took longer than {timeout:g} s and was stopped")
                time.sleep(0.05)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


# --- The API -------------------------------------------------------------------------------------


def _make_job(modules, inputs, seed, iterations, platform, progress,
              num_processes, process_id, coordinator, replicated_parameters=()) -> _Job:
    if not isinstance(iterations, int) or iterations < 1:
        raise RunError(f"iterations must be a positive integer, not {iterations}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise RunError(f"num_processes must be a positive integer, not {num_processes}")
    if process_id is not None and not (isinstance(process_id, int) and 0 <= process_id < num_processes):
        raise RunError(f"process_id must be in 0..{num_processes - 1}, not {process_id}")
    if coordinator is not None:
        check_loopback(coordinator)
    if process_id is not None and coordinator is None:
        raise RunError("process_id needs a coordinator address (HOST:PORT of process 0)")
    specs = []
    for module, replicas, partitions, mode in modules:
        ref = ModuleRef.of(module)
        _validate_counts(replicas, partitions, ref.name)
        if mode not in PARTITION_MODES:
            raise RunError(f"unknown partition mode '{mode}' (expected one of "
                           f"{', '.join(PARTITION_MODES)})")
        _precheck(ref, ref.read())
        specs.append(_RunSpec(ref, replicas, partitions, mode))
    if isinstance(inputs, (str, os.PathLike)):
        inputs = _NpzInputs.read(os.fspath(inputs))
    elif inputs is not None:
        inputs = [np.asarray(a) for a in inputs]
    replicated = [str(p).strip() for p in replicated_parameters]
    if any(not p for p in replicated):
        raise RunError("an empty name in the replicated parameters (give entry parameter numbers "
                       "or names, e.g. 0,w)")
    return _Job(specs, inputs, int(seed), iterations, platform, bool(progress), coordinator, num_processes,
                process_id if process_id is not None else 0, replicated)


def _run_job(job: _Job, isolate: bool, timeout, process_id, num_processes) -> list[RunResult] | None:
    if timeout is not None and not timeout > 0:
        raise RunError(f"timeout must be a positive number of seconds, not {timeout}")
    if timeout is not None and not isolate and num_processes == 1:
        raise RunError("a timeout needs a child process: run isolated")
    if num_processes > 1 and process_id is None:
        return _run_processes(job, timeout)
    if num_processes > 1:
        # One process of a run started by hand: always in a child, since jax.distributed
        # holds the process for good.
        results = _run_isolated(job, timeout, coordinator=job.coordinator,
                                num_processes=num_processes, process_id=process_id)
        return results if process_id == 0 else None
    if isolate:
        return _run_isolated(job, timeout)
    return _execute_job(job, progress_stream=sys.stderr if job.progress else None)


def run_module(module, inputs=None, *, num_replicas: int | None = None,
               num_partitions: int | None = None, partition_mode: str = "auto",
               seed: int = 0, iterations: int = 1, platform: str = "cpu",
               progress: bool = False, isolate: bool = False, timeout: float | None = None,
               num_processes: int = 1, process_id: int | None = None,
               coordinator: str | None = None,
               replicated_parameters: Sequence[int | str] = ()) -> RunResult | None:
    """Compile ``module`` with XLA and run it.

    Args:
      module: HLO text (str), serialized ``HloModuleProto`` (bytes), a file
        (``pathlib.Path``; ``.pb`` files are protos) or a :class:`ModuleRef`.
      inputs: the global input arrays (see the module docstring for each
        mode's convention) or an ``.npz`` path with ``arg0..argK``; default:
        :func:`random_inputs` with ``seed``.
      num_replicas, num_partitions: device counts; default from the module's
        header, else 1.
      partition_mode: ``auto``, ``spmd`` or ``per_device`` (partitioned programs).
      iterations: runs to time (``RunResult.seconds``); outputs are the first run's.
      platform: ``cpu``, or ``gpu``/``cuda``/``rocm``/``tpu`` where one is present.
      progress: draw a progress bar on stderr while iterating.
      isolate: compile and run in a child process, so that an XLA crash is a RunError.
      timeout: seconds before an isolated or multi-process run is stopped.
      num_processes: run over this many local processes (jax.distributed, gloo).
      process_id, coordinator: be one process of a run started by hand
        (``coordinator`` is process 0's loopback HOST:PORT); returns None on
        processes other than 0.
      replicated_parameters: entry parameters (numbers or names) that hold the same
        value on every device, as a pmap program's weights do: their random inputs are
        device 0's value everywhere (given inputs must already be so).

    Raises:
      RunError: anything that kept the module from running, as one line.
    """
    job = _make_job([(module, num_replicas, num_partitions, partition_mode)], inputs, seed,
                    iterations, platform, progress, num_processes, process_id, coordinator,
                    replicated_parameters)
    results = _run_job(job, isolate, timeout, process_id, num_processes)
    return None if results is None else results[0]


def compare_modules(module, reference, inputs=None, *, num_replicas: int | None = None,
                    num_partitions: int | None = None, partition_mode: str = "auto",
                    reference_num_replicas: int | None = None,
                    reference_num_partitions: int | None = None,
                    reference_partition_mode: str = "auto",
                    abs_error_bound: float = DEFAULT_ABS_ERROR_BOUND,
                    rel_error_bound: float = DEFAULT_REL_ERROR_BOUND,
                    seed: int = 0, iterations: int = 1, platform: str = "cpu",
                    progress: bool = False, isolate: bool = False, timeout: float | None = None,
                    num_processes: int = 1, process_id: int | None = None,
                    coordinator: str | None = None,
                    replicated_parameters: Sequence[int | str] = (),
                    ) -> tuple[RunResult, RunResult, Comparison] | None:
    """Run ``module`` and ``reference`` on the same global inputs and compare every output.

    The inputs are generated (or checked) for ``module``; the reference must
    take the same global shapes (e.g. a single-device module and the
    per-device module a pass made from it).  See :func:`run_module` for the
    other arguments and :func:`compare_outputs` for what matching means.

    Returns ``(result, reference_result, comparison)`` (None on processes
    other than 0 of a multi-process run).
    """
    job = _make_job([(module, num_replicas, num_partitions, partition_mode),
                     (reference, reference_num_replicas, reference_num_partitions,
                      reference_partition_mode)],
                    inputs, seed, iterations, platform, progress, num_processes, process_id,
                    coordinator, replicated_parameters)
    results = _run_job(job, isolate, timeout, process_id, num_processes)
    if results is None:
        return None
    result, ref_result = results
    return result, ref_result, compare_outputs(result.outputs, ref_result.outputs,
                                               abs_error_bound, rel_error_bound)
