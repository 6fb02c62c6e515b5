"""The one module that calls into jaxlib's XLA bindings.

jaxlib moves these APIs between releases, so every call into XLA goes through
this module and nothing else in the project imports ``jax._src``.  Supported and
tested: jax/jaxlib 0.10.2 (Python 3.11) to 0.12 (Python 3.13); where the two differ, the
difference is handled here (``JAXLIB_VERSION``).

Safety: XLA's C++ HLO parser recurses once per nesting level and crashes the
whole process (a segfault, not an exception) on input nested about ten thousand
levels deep.  Never hand untrusted text to this module directly: parse it with
``hlo_tools.parse_module`` first, which rejects such input with an ordinary
``HloParseError``.

Sections, in order: errors; HLO text and proto conversion.  New groups of
functions (compiling, executing) go in their own section at the end.
"""

from __future__ import annotations

import re as _re
import threading as _threading

import jaxlib as _jaxlib
from jax._src.lib import xla_client as _xc

# (major, minor, patch) of the jaxlib in this process: 0.12.0.1 reads (0, 12, 0).
JAXLIB_VERSION: tuple[int, int, int] = tuple(int(n) for n in _re.findall(r"\d+", _jaxlib.__version__)[:3])



def jaxlib_version_text() -> str:
    return _jaxlib.__version__


# --- Errors -----------------------------------------------------------------


class XlaBridgeError(Exception):
    """XLA refused an operation; the message is XLA's own."""


def _xla_message(exc: Exception) -> str:
    """XLA's error text without jaxlib's wrapper noise."""
    return str(exc).strip() or type(exc).__name__


# --- HLO text and proto conversion ------------------------------------------


def xla_parse(text: str):
    """Parse HLO module text with XLA's own parser and return XLA's module.

    Raises:
      XlaBridgeError: XLA rejected the text; the message is XLA's.
    """
    if not isinstance(text, str):
        raise TypeError(f"HLO text must be str, not {type(text).__name__}")
    try:
        return _xc.hlo.hlo_module_from_text(text)
    except RuntimeError as exc:
        raise XlaBridgeError(f"XLA could not parse the module: {_xla_message(exc)}") from exc


def xla_print(module, canonical: bool = False, *, large_constants: bool = False) -> str:
    """Print a module from ``xla_parse``, in XLA's default style or its canonical form.

    Both elide the values of constants with more than a few elements
    (``constant({...})``), and XLA reads such text back as a constant of
    arbitrary values: ``large_constants=True`` prints every value.
    """
    options = _xc.hlo.HloPrintOptions.canonical() if canonical else _xc.hlo.HloPrintOptions()
    options.print_large_constants = large_constants
    return module.to_string(options)


def canonical_text(text: str) -> str:
    """XLA's canonical print of ``text``: names, metadata and layout noise normalized.

    Two modules with equal canonical text mean the same computation.
    """
    return xla_print(xla_parse(text), canonical=True)


def text_to_proto(text: str) -> bytes:
    """Serialize HLO text to XLA's ``HloModuleProto`` bytes."""
    return xla_parse(text).as_serialized_hlo_module_proto()


def proto_to_text(data: bytes, canonical: bool = False) -> str:
    """Print serialized ``HloModuleProto`` bytes as HLO text (every constant value in the default style).

    Args:
      data: the serialized proto, e.g. what an XLA pass hook receives.
      canonical: print XLA's canonical form instead of its default style.

    Raises:
      XlaBridgeError: the bytes are not a valid module proto.
    """
    try:
        module = _xc.hlo.HloModule.from_serialized_hlo_module_proto(bytes(data))
    except RuntimeError as exc:
        raise XlaBridgeError(f"XLA could not read the module proto: {_xla_message(exc)}") from exc
    return xla_print(module, canonical, large_constants=not canonical)


_ENTRY_HEAD = _re.compile(r"^ENTRY ", _re.MULTILINE)
_PARAMETER_LINE = _re.compile(r"^(\s*(?:ROOT )?%?[^\s=]+ = .*? parameter\((\d+)\))(.*)$", _re.MULTILINE)


def hook_module_text(data: bytes) -> str:
    """The text of a module proto that a pass hook got (`proto_to_text`), its entry parameters
    annotated with the shardings XLA's partitioner gave them, as jaxlib 0.10.2 prints them.

    From jaxlib 0.11 on the partitioned module's parameters carry no `sharding=`, and which of
    them every device holds whole (the weights of a data-parallel step) is kept only in the
    module's config (`entry_parameter_shardings`); the passes read it from the text.
    """
    text = proto_to_text(data)
    shardings = entry_parameter_shardings(data)
    entry = _ENTRY_HEAD.search(text)
    if not shardings or entry is None:
        return text
    end = text.find("\n}", entry.start())
    end = len(text) if end < 0 else end

    def annotate(match) -> str:
        number = int(match.group(2))
        if "sharding=" in match.group(3) or number >= len(shardings):
            return match.group(0)
        return f"{match.group(1)}, sharding={shardings[number]}{match.group(3)}"

    return text[:entry.start()] + _PARAMETER_LINE.sub(annotate, text[entry.start():end]) + text[end:]


def same_meaning(text_a: str, text_b: str) -> bool:
    """Whether XLA reads both texts as the same module (equal canonical forms).

    Raises:
      XlaBridgeError: XLA could not parse one of the texts.
    """
    return canonical_text(text_a) == canonical_text(text_b)


# --- Compiling and executing (hlo_tools.xla.runner) ------------------------------
#
# Everything the runner needs from jax/jaxlib, in plain Python and numpy terms:
# devices are jax device objects only inside this section; callers see indices.
#
# Compile options that work on jaxlib 0.10.2 (see docs/run.md):
#   * replica programs: num_replicas=N, num_partitions=1, a N x 1 device
#     assignment, use_spmd_partitioning=False (True, as JAX does, when the
#     module carries Shardy/GSPMD markers);
#   * modules still to be partitioned (JAX/GSPMD/Shardy dumps before
#     optimization): num_partitions=N, a 1 x N device assignment,
#     use_spmd_partitioning=True, use_shardy_partitioner=True exactly when the
#     module carries Shardy (``xla.sdy``) attributes (XLA's GSPMD partitioner
#     RET_CHECK-fails on Shardy custom calls);
#   * per-device modules (already partitioned): XLA refuses num_partitions>1
#     without SPMD partitioning, so partitioning stays enabled but its passes
#     are switched off through DebugOptions.xla_disable_hlo_passes; XLA then
#     compiles the module as written, once per partition.

import itertools as _itertools
import threading as _threading

import numpy as _np

# XLA passes that partition a module; switched off for per-device modules.
_PARTITIONING_PASSES = ("sharding-propagation", "spmd-partitioning", "shardy-xla")


def _jax():
    import jax  # noqa: PLC0415 - heavy; only the runner needs it

    return jax


def backend_initialized() -> bool:
    """Whether jax has already created its backends (device counts are then fixed)."""
    from jax._src import xla_bridge as _xb  # noqa: PLC0415

    return _xb.backends_are_initialized()


def configure_cpu_devices(count: int) -> bool:
    """Ask for ``count`` CPU devices before jax's backends start.

    Returns False (and changes nothing) when the backends already started.
    """
    if backend_initialized():
        return False
    _jax().config.update("jax_num_cpu_devices", int(count))
    return True


def initialize_distributed(coordinator: str, num_processes: int, process_id: int,
                           timeout_s: int = 120) -> None:
    """Join a multi-process run: jax.distributed with gloo CPU collectives.

    Must run before any backend starts.  Each process sees all processes'
    devices; collectives between processes go over gloo TCP.
    """
    jax = _jax()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=int(num_processes),
            process_id=int(process_id), initialization_timeout=int(timeout_s),
            heartbeat_timeout_seconds=30)
    except Exception as exc:  # noqa: BLE001 - jax raises several types here
        raise XlaBridgeError(f"could not join the distributed run at {coordinator}: "
                             f"{_xla_message(exc)}") from exc


def shutdown_distributed() -> None:
    """Leave the multi-process run (no-op outside one)."""
    try:
        _jax().distributed.shutdown()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def platform_devices(platform: str) -> tuple[list, int]:
    """All devices of ``platform`` (every process's, sorted by id) and this process's index."""
    from jax._src import xla_bridge as _xb  # noqa: PLC0415

    try:
        backend = _xb.get_backend(platform)
    except Exception as exc:  # noqa: BLE001 - RuntimeError and friends
        raise XlaBridgeError(f"platform '{platform}' is not available: {_xla_message(exc)}") from exc
    return sorted(backend.devices(), key=lambda d: d.id), backend.process_index()


def device_process(device) -> int:
    """The index of the process that owns ``device``."""
    return device.process_index


def module_from_proto(data: bytes):
    """XLA's module from serialized ``HloModuleProto`` bytes."""
    try:
        return _xc.hlo.HloModule.from_serialized_hlo_module_proto(bytes(data))
    except RuntimeError as exc:
        raise XlaBridgeError(f"XLA could not read the module proto: {_xla_message(exc)}") from exc


def module_text(module) -> str:
    """XLA's (default-style) print of one of its modules."""
    return xla_print(module, canonical=False)


def module_proto(module) -> bytes:
    """Serialized ``HloModuleProto`` bytes of one of XLA's modules."""
    return module.as_serialized_hlo_module_proto()


def _shape_leaves(shape) -> list[tuple[tuple[int, ...], object]]:
    if shape.is_tuple():
        return [leaf for element in shape.tuple_shapes() for leaf in _shape_leaves(element)]
    if shape.is_token():
        return [((), "token")]
    return [(tuple(shape.dimensions()), _np.dtype(shape.numpy_dtype()))]


def program_signature(module) -> tuple[list, list, list[bool]]:
    """Entry parameters and result leaves of an XLA module, as (dims, numpy dtype) pairs.

    Returns ``(parameters, result_leaves, parameter_is_tuple)``; tuples in the
    result are flattened depth first; a token is ``((), "token")``.
    """
    shape = _xc.XlaComputation(module.as_serialized_hlo_module_proto()).program_shape()
    params, is_tuple = [], []
    for p in shape.parameter_shapes():
        leaves = _shape_leaves(p)
        is_tuple.append(bool(p.is_tuple()))
        params.append(leaves[0] if len(leaves) == 1 and not p.is_tuple() else leaves)
    return params, _shape_leaves(shape.result_shape()), is_tuple


def describe_sharding(text: str):
    """XLA's reading of an HLO sharding attribute, as plain data.

    Returns one of ``("replicated",)``, ``("manual",)``, ``("maximal", device)``,
    ``("tiled", tile_dims, devices, replicated_dims)`` where ``tile_dims`` covers
    every tile dimension (data dimensions first, then the replicated/subgroup
    ones counted by ``replicated_dims``) and ``devices`` is the tile assignment
    flattened in row-major order; or ``("tuple", [elements])`` and
    ``("unknown", text)``.
    """
    try:
        sharding = _tiled_form(_xc.HloSharding.from_string(text))
    except RuntimeError as exc:
        raise XlaBridgeError(f"XLA could not read the sharding {text}: {_xla_message(exc)}") from exc
    return _describe(sharding)


def _tiled_form(sharding):
    """`sharding` as a tile assignment: jaxlib 0.12's XLA writes shardings over named mesh axes
    (`{mesh['d'=8], [{'d'}, {}]}`, "HloShardingV3"), whose tile queries abort the process."""
    convert = getattr(_xc.HloSharding, "v3_to_v2_sharding", None)
    return sharding if convert is None else convert(sharding)


def entry_parameter_shardings(data: bytes) -> list[str] | None:
    """The sharding XLA's partitioner gave each entry parameter of a partitioned module, as
    tile-assignment text (`{devices=[8,1]<=[8]}`); None when the module proto has none.

    jaxlib 0.10.2 also writes them on the parameters (`sharding=`); from 0.11 on the
    partitioned module's text has none, and only its config (`spmd_parameters_shardings`) keeps them.
    """
    shardings = list(module_from_proto(data).spmd_parameters_shardings or ())
    if not shardings:
        return None
    return [str(_tiled_form(_xc.HloSharding.from_proto(s))) for s in shardings]


def _describe(sharding):
    # Order matters: tile_assignment_* CHECK-fail (abort the process) on tuples.
    elements = sharding.tuple_elements()
    if elements:
        return ("tuple", [_describe(e) for e in elements])
    if sharding.is_manual():
        return ("manual",)
    if sharding.is_replicated():
        return ("replicated",)
    if sharding.is_maximal():
        return ("maximal", int(sharding.tile_assignment_devices()[0]))
    if sharding.is_tiled():
        dims = [int(d) for d in sharding.tile_assignment_dimensions()]
        extra = int(bool(sharding.replicate_on_last_tile_dim())) + len(sharding.subgroup_types())
        return ("tiled", dims, [int(d) for d in sharding.tile_assignment_devices()], extra)
    return ("unknown", str(sharding))


def _op_sharding_text(op_sharding) -> str:
    return str(_xc.HloSharding.from_proto(op_sharding))


class Executable:
    """A module compiled for a list of devices (all of them, every process's).

    ``logical_devices[i]`` runs logical device ``i``: replica ``i`` of a
    replica program, partition ``i`` of a partitioned one.
    """

    def __init__(self, loaded, devices, process_index):
        self._loaded = loaded
        self.devices = list(devices)
        self.local = [i for i, d in enumerate(self.devices) if d.process_index == process_index]

    def parameter_shardings(self) -> list[str] | None:
        """XLA's shardings of the entry parameters (partitioned modules only), as text."""
        shardings = self._loaded.get_parameter_shardings()
        return None if shardings is None else [_op_sharding_text(s) for s in shardings]

    def output_shardings(self) -> list[str] | None:
        """XLA's shardings of the result leaves (partitioned modules only), as text."""
        shardings = self._loaded.get_output_shardings()
        return None if shardings is None else [_op_sharding_text(s) for s in shardings]

    def optimized_text(self) -> str:
        """The module XLA compiled, after its optimizations (per device)."""
        return self._loaded.hlo_modules()[0].to_string()

    def cost_analysis(self) -> dict:
        try:
            return dict(self._loaded.cost_analysis())
        except Exception:  # noqa: BLE001 - not every backend has one
            return {}

    def memory_stats(self) -> dict[str, int]:
        """XLA's compiled memory stats of one device's program, in bytes.

        Keys: ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs
        that reuse an argument's buffer), ``temp_bytes``, ``generated_code_bytes``
        (0 on CPU, whose code is not counted there) and ``peak_bytes``; empty
        where the backend has no such stats.
        """
        try:
            stats = self._loaded.get_compiled_memory_stats()
        except Exception:  # noqa: BLE001 - not every backend has them
            return {}
        return {"argument_bytes": int(stats.argument_size_in_bytes),
                "output_bytes": int(stats.output_size_in_bytes),
                "alias_bytes": int(stats.alias_size_in_bytes),
                "temp_bytes": int(stats.temp_size_in_bytes),
                "generated_code_bytes": int(stats.generated_code_size_in_bytes),
                "peak_bytes": int(stats.peak_memory_in_bytes)}

    def _device_arrays(self, per_device: list[list]) -> list:
        """One jax Array per parameter, holding each local device's own numpy data.

        The array claims to be replicated over the run's devices with the
        per-device shape, which is what XLA expects of each device's buffer;
        the data may differ between devices (jax never checks, XLA never cares).
        """
        jax = _jax()
        from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

        sharding = NamedSharding(Mesh(_np.array(self.devices), ("d",)), PartitionSpec())
        arrays = []
        with jax.enable_x64(True):  # keep 64-bit inputs 64-bit (jax narrows them by default)
            for shards in per_device:
                buffers = [jax.device_put(shards[i], self.devices[i]) for i in self.local]
                shape = _np.shape(shards[self.local[0]]) if self.local else ()
                arrays.append(jax.make_array_from_single_device_arrays(shape, sharding, buffers))
        return arrays

    def execute(self, per_device: list[list], iterations: int = 1, on_iteration=None):
        """Run the executable ``iterations`` times on each device's own inputs.

        Args:
          per_device: ``per_device[k][i]`` is parameter ``k``'s numpy array on
            logical device ``i`` (only this process's devices are read).
          iterations: how many times to run; inputs are re-sent before each
            run (outside the timing) so that donated buffers stay valid.
          on_iteration: called with the iteration number after each run.

        Returns:
          ``(outputs, seconds)``: ``outputs[j]`` maps each local logical device
          to result leaf ``j`` of the first run; ``seconds`` has one wall time
          per run.
        """
        import time  # noqa: PLC0415

        jax = _jax()

        def run(arrays):
            start = time.perf_counter()
            with jax.enable_x64(True):
                leaves = self._loaded.execute_sharded(arrays).disassemble_into_single_device_arrays()
                jax.block_until_ready(leaves)
            return leaves, time.perf_counter() - start

        outputs, seconds = None, []
        for it in range(max(1, int(iterations))):
            arrays = self._device_arrays(per_device)
            jax.block_until_ready(arrays)
            try:
                leaves, elapsed = _interruptible(run, arrays)
            except Exception as exc:  # noqa: BLE001 - XlaRuntimeError and friends
                raise XlaBridgeError(f"XLA could not run the module: {_xla_message(exc)}") from exc
            seconds.append(elapsed)
            if outputs is None:
                outputs = []
                for leaf in leaves:
                    by_device = {self.devices.index(b.device): _np.asarray(b) for b in
                                 (x for x in leaf)}
                    outputs.append(by_device)
            if on_iteration is not None:
                on_iteration(it + 1)
        return outputs, seconds


def _interruptible(fn, *args):
    """``fn(*args)`` on a helper thread, waited for on a lock, where Python still runs its signal
    handlers: XLA:CPU runs a computation inline, in C++, which would hold off Ctrl-C and SIGTERM
    until the computation ends. A signal's exception leaves the computation behind, to end with
    the process (`hlo_tools.cli` exits at once after one)."""
    if _threading.current_thread() is not _threading.main_thread():
        return fn(*args)  # only the main thread runs signal handlers
    outcome = {}

    def target():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    helper = _threading.Thread(target=target, name="xla-execute", daemon=True)
    helper.start()
    helper.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def compile_module(module, platform: str, devices: list, process_index: int, *,
                   num_replicas: int, num_partitions: int, partitioner: str) -> Executable:
    """Compile an XLA module with PJRT for ``devices`` (logical device i -> devices[i]).

    Args:
      partitioner: ``"none"`` (replica or single-device programs),
        ``"gspmd"`` / ``"shardy"`` (partition the module with that partitioner),
        or ``"prepartitioned"`` (a per-device module: compile as written).
    """
    from jax._src import xla_bridge as _xb  # noqa: PLC0415

    n = num_replicas * num_partitions
    if len(devices) != n:
        raise XlaBridgeError(f"{n} devices are needed, {len(devices)} were given")
    options = _xc.CompileOptions()
    options.num_replicas = num_replicas
    options.num_partitions = num_partitions
    ids = _np.array([d.id for d in devices]).reshape(num_replicas, num_partitions)
    options.device_assignment = _xc.DeviceAssignment.create(ids)
    build = options.executable_build_options
    build.use_spmd_partitioning = partitioner != "none"
    build.use_shardy_partitioner = partitioner == "shardy"
    if partitioner == "prepartitioned":
        build.debug_options.xla_disable_hlo_passes = ",".join(_PARTITIONING_PASSES)
    try:
        computation = _xc.XlaComputation(module.as_serialized_hlo_module_proto())
        mlir = _xc._xla.mlir.xla_computation_to_mlir_module(computation)
        loaded = _xb.get_backend(platform).compile_and_load(
            mlir, _xc.DeviceList(tuple(devices)), options)
    except Exception as exc:  # noqa: BLE001 - XlaRuntimeError, ValueError, ...
        raise XlaBridgeError(f"XLA could not compile the module: {_xla_message(exc)}") from exc
    return Executable(loaded, devices, process_index)


# --- XLA's pass hooks (xla_passes.jax) ----------------------------------------------------------
#
# XLA calls a registered callback with each module it compiles, at a stage of its pipeline, and
# compiles what the callback returns. `jax.extend.xla.register_hlo_module_transformation` starts
# JAX's backends first from jax 0.11 on, which re-enters JAX's plugin discovery (and hangs) when it
# is called from a plugin's `initialize()`, and asks every named platform for its PJRT plugin,
# which fails for a platform the process does not have. The functions here register the same
# callbacks without starting anything: CPU hooks directly, other platforms' hooks when (and if)
# their plugin is discovered or their backend starts.

STAGES = ("pre_scheduler", "post_scheduler")   # XLA's PipelineStage, in its numbering


def _stage_number(stage: str) -> int:
    return STAGES.index(stage)


def hook_keeps_donation() -> bool:
    """Whether XLA keeps the buffer donation (`input_output_alias`, `buffer_donor`) of a module a
    hook hands back: from jaxlib 0.11.1 on (jax-ml/jax#40280); 0.10.2 resets both."""
    return JAXLIB_VERSION >= (0, 11, 1)


def register_pass_hook(callback, *, name: str, stage: str, platform: str) -> None:
    """Have XLA call `callback(module_proto) -> bytes | None` on every `platform` compile at `stage`.

    Safe to call while JAX starts its backends (from a JAX plugin's `initialize()`): nothing is
    started. A platform without a backend in this process gets the hook if one starts later.
    """
    from jax._src import xla_bridge as _xb  # noqa: PLC0415
    from jax._src.lib import _xla  # noqa: PLC0415

    number = _stage_number(stage)
    if platform == "cpu":   # XLA:CPU is in jaxlib itself, not a PJRT plugin
        _xla.register_xla_transform(name, number, callback)
        return
    if JAXLIB_VERSION >= (0, 11):   # hooks go on a plugin's C API, once plugins are discovered
        def on_plugin(c_api):
            if any(f.c_api is c_api for p, f in list(_xb._backend_factories.items()) if p == platform):
                _xla.register_xla_transform_c_api(c_api, name, number, callback)

        _xb.register_plugin_callbacks(on_plugin)
        return

    def on_backend(client):   # jaxlib 0.10: on a started client
        if client.platform in (platform, _PLATFORM_ALIASES.get(platform)):
            try:
                _xla.register_xla_transform_c_api(client, name, number, callback)
            except RuntimeError:
                pass   # a backend that takes no hooks compiles without them

    _xb.register_backend_initialization_hook(on_backend)


_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def clear_pass_hook(name: str, stage: str, platform: str) -> bool:
    """Take the hook `name` at `stage` away from `platform`; whether there was one.

    A non-CPU hook can be taken away only once its backend has started: callers keep the
    others and have them return None.
    """
    from jax._src import xla_bridge as _xb  # noqa: PLC0415
    from jax._src.lib import _xla  # noqa: PLC0415

    number = _stage_number(stage)
    if platform == "cpu":
        return bool(_xla.clear_xla_transform(name, number))
    if not _xb.backends_are_initialized() or platform not in _xb.backends():
        return False
    if JAXLIB_VERSION >= (0, 11):
        from jax._src.lib import _jax  # noqa: PLC0415

        return bool(_xla.clear_xla_transform_c_api(_jax.get_pjrt_plugin(platform), name, number))
    return bool(_xla.clear_xla_transform_c_api(_xb.backends()[platform], name, number))


# Parts added to JAX's persistent compilation cache key (`add_cache_key_part`).
_cache_key_parts: set = set()


def add_cache_key_part(part) -> None:
    """Append `part()` (a string, read at each key computation) to the key of every executable
    JAX's persistent compilation cache stores or looks up, after any `custom_hook` set before.

    JAX keys an executable on the module before XLA's pass hooks run, so whatever decides what a
    hook does must be in the key, or a compile gets another's executable from the cache. A part
    that returns "" leaves the key as JAX computes it; adding the same part again changes nothing.
    """
    from jax._src import cache_key as _cache_key  # noqa: PLC0415

    if part in _cache_key_parts:
        return
    previous = _cache_key.custom_hook
    _cache_key.custom_hook = lambda: previous() + part()
    _cache_key_parts.add(part)


# --- Compiling a module XLA has already optimized ---------------------------------------------
#
# jaxlib 0.10.2 compiles only from StableHLO, and the conversion from HLO drops what a module
# gets late in XLA's pipeline (layouts, fusion kinds and backend configs, the schedule). A
# module that a pass hook receives is compiled the way XLA compiles it after that hook: a
# stand-in with the same entry signature goes through XLA's pipeline, and a hook at the same
# stage replaces it by the module's own bytes, from which XLA continues (scheduling, buffer
# assignment, code generation). Compiling from inside another hook deadlocks (XLA holds its
# compile locks there): callers in a hook run this in a child process.

_swap_lock = _threading.Lock()


def _stand_in_text(program_shape) -> str:
    """HLO text of a module that takes `program_shape`'s parameters and returns zeros of its result."""
    lines, counter = [], _itertools.count()

    def value(shape) -> str:
        name = f"v{next(counter)}"
        if shape.is_tuple():
            elements = [value(e) for e in shape.tuple_shapes()]
            lines.append(f"{name} = {shape} tuple({', '.join(elements)})")
        elif shape.is_token():
            lines.append(f"{name} = token[] after-all()")
        else:
            zero, text = f"z{name}", str(shape)
            lines.append(f"{zero} = {text[:text.index('[')]}[] constant(0)")
            lines.append(f"{name} = {text} broadcast({zero}), dimensions={{}}")
        return name

    parameters = [f"p{i} = {s} parameter({i})" for i, s in enumerate(program_shape.parameter_shapes())]
    root = value(program_shape.result_shape())
    body = parameters + lines[:-1] + ["ROOT " + lines[-1]]
    return "HloModule stand_in\n\nENTRY stand_in {\n  " + "\n  ".join(body) + "\n}\n"


def compile_optimized_module(proto: bytes, platform: str, devices: list, process_index: int, *,
                             num_replicas: int, num_partitions: int, stage: str = "pre_scheduler") -> Executable:
    """Compile serialized module bytes that XLA produced at pipeline `stage` ("pre_scheduler":
    laid out and fused, as JAX's pass hook gets it; "post_scheduler": scheduled too), from that
    stage on, for ``devices`` (see the section comment)."""
    program_shape = _xc.XlaComputation(bytes(proto)).program_shape()
    for number, parameter in enumerate(program_shape.parameter_shapes()):
        # inputs go in row-major; a laid-out entry parameter would read them in its own order
        if parameter.is_array() and list(parameter.layout().minor_to_major()) != list(range(parameter.rank()))[::-1]:
            raise XlaBridgeError(f"entry parameter {number} is laid out {parameter}, and a module compiled from "
                                 f"an optimized stage takes inputs in the default layout only")
    stand_in = xla_parse(_stand_in_text(program_shape))
    name = f"hlo_tools_swap_{id(proto)}"

    def swap(_module_bytes):
        return bytes(proto)

    with _swap_lock:  # one swap hook at a time: every compile while it is registered gets `proto`
        register_pass_hook(swap, name=name, stage=stage, platform=platform)
        try:
            return compile_module(stand_in, platform, devices, process_index, num_replicas=num_replicas,
                                  num_partitions=num_partitions,
                                  partitioner="prepartitioned" if num_partitions > 1 else "none")
        finally:
            clear_pass_hook(name, stage, platform)


def gather_from_processes(per_device: dict[int, _np.ndarray], devices: list,
                          process_index: int) -> dict[int, _np.ndarray]:
    """Every process's per-device arrays, on every process (a collective call).

    ``per_device`` maps this process's logical device indices to equally shaped
    arrays; all processes must call this together with the same ``devices``.
    """
    jax = _jax()
    from jax.experimental import multihost_utils  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    local = [i for i, d in enumerate(devices) if d.process_index == process_index]
    sample = per_device[local[0]]
    sharding = NamedSharding(Mesh(_np.array(devices), ("d",)), PartitionSpec("d"))
    with jax.enable_x64(True):
        buffers = [jax.device_put(per_device[i][None], devices[i]) for i in local]
        array = jax.make_array_from_single_device_arrays(
            (len(devices),) + tuple(sample.shape), sharding, buffers)
        gathered = _np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return {i: gathered[i] for i in range(len(devices))}


# --- JAX's lowered programs (xla_passes.jax.jit) --------------------------------------------------
#
# `jax.jit(f).lower(...)` keeps the program as a StableHLO MLIR module and the arguments of its
# compile (shardings, donation, device list) beside it. Replacing that module by a rewritten one
# lets JAX compile it exactly as it compiles its own: same options, donation (the HLO's
# `input_output_alias` becomes the MLIR's `mhlo.input_output_alias`), and `jax.Array`s in and
# out. The attributes used here are JAX-internal (`Lowered._lowering`: `_hlo`, `compile_args`).


def lowered_module_text(lowered) -> str:
    """The HLO text (every constant printed) of a `jax.stages.Lowered` program."""
    return proto_to_text(lowered.compiler_ir("hlo").as_serialized_hlo_module_proto())


def compiled_module_text(compiled) -> str:
    """The module XLA optimized for a `jax.stages.Compiled` program (every constant printed), its
    entry parameters with the shardings XLA's partitioner gave them (`hook_module_text`).

    jaxlib 0.10.2's `compiled.as_text()` has them; from 0.11 on it has none, and a per-device
    module without them reads as taking every parameter whole on each device.
    """
    module = compiled.runtime_executable().hlo_modules()[0]
    return hook_module_text(module.as_serialized_hlo_module_proto())


def kept_argument_positions(program) -> list[int] | None:
    """The positions, among a jitted function's flattened arguments, of those the program (a
    `Compiled`, or a `Lowered`: its module's parameters) takes (JAX drops arguments it does not
    use); None where jax does not say."""
    kept = getattr(getattr(program, "_executable", None), "_kept_var_idx", None)
    if kept is None:
        kept = getattr(getattr(program, "_lowering", None), "compile_args", {}).get("kept_var_idx")
    return sorted(kept) if kept is not None else None


def with_lowered_module(lowered, text: str, *, resharded_parameters=(), resharded_outputs=(), buffer_donors=()):
    """A copy of `lowered` that compiles the HLO module `text` instead of its own.

    `resharded_parameters` and `resharded_outputs` are the entry parameters and result leaves
    whose sharding the module changed: JAX then takes their shardings from the compiled
    executable instead of insisting on the ones it lowered with. `buffer_donors` are the entry
    parameters the module's `buffer_donor` donates, which the conversion to StableHLO drops
    (`_mark_buffer_donors`). `lowered` itself is left as it is: JAX caches lowerings, and a plain
    `jax.jit` of the same function may be handed it.
    """
    import copy  # noqa: PLC0415

    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.sharding_impls import UNSPECIFIED  # noqa: PLC0415

    lowered = copy.copy(lowered)
    lowering = lowered._lowering = copy.copy(lowered._lowering)
    lowering._executable = None
    lowering.compile_args = dict(lowering.compile_args)
    computation = _xc.XlaComputation(xla_parse(text).as_serialized_hlo_module_proto())
    try:
        mlir_text = _xc._xla.mlir.xla_computation_to_mlir_module(computation)
    except Exception as exc:  # noqa: BLE001 - XlaRuntimeError and friends
        raise XlaBridgeError(f"XLA could not convert the module to StableHLO: {_xla_message(exc)}") from exc
    with lowering._hlo.context:
        lowering._hlo = ir.Module.parse(mlir_text)
        _mark_buffer_donors(lowering._hlo, buffer_donors)
    args = lowering.compile_args
    for key, indices in (("in_shardings", resharded_parameters), ("out_shardings", resharded_outputs)):
        shardings = list(args[key])
        for index in indices:
            shardings[index] = UNSPECIFIED
        args[key] = tuple(shardings)
    return lowered


def _mark_buffer_donors(module, donors) -> None:
    """Give the main function's `donors` arguments `jax.buffer_donor`, which the HLO -> StableHLO
    conversion drops: JAX lowers donated arguments whose output sharding it leaves to XLA
    (`AxisType.Auto` meshes) as buffer donors, and without the mark XLA aliases none of them."""
    if not donors:
        return
    from jax._src.lib.mlir import ir  # noqa: PLC0415

    main = next(op for op in module.body.operations
                if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main")
    arguments = []
    for number, attributes in enumerate(main.arg_attrs):
        entries = {named.name: named.attr for named in ir.DictAttr(attributes)}
        if number in donors:
            entries["jax.buffer_donor"] = ir.BoolAttr.get(True)
        arguments.append(ir.DictAttr.get(entries))
    main.arg_attrs = ir.ArrayAttr.get(arguments)


def sharding_key(sharding, rank: int):
    """A hashable stand-in for how `sharding` lays out an array of `rank` dimensions: equal
    for equivalent shardings (`P()` and `P(None, None)`), which JAX's objects do not compare."""
    if sharding is None:
        return None
    return str(sharding._to_xla_hlo_sharding(rank)), tuple(d.id for d in sharding._device_assignment)
