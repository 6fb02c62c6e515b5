"""Run xla_passes pipelines inside JAX's own XLA compiles, with no change to the program.

    import xla_passes.jax
    xla_passes.jax.enable("collective-fusion")      # every later jax.jit compile
    with xla_passes.jax.enable("cse,dce", dump_to="/tmp/dump"):
        ...                                         # only inside the block

XLA hands the module of every compile to a hook registered with
`jax.extend.xla.register_hlo_module_transformation` (at the PRE_SCHEDULER stage
by default: the per-device module after SPMD partitioning and fusion). The hook
turns the serialized `HloModuleProto` into text, runs the pipeline on the
`hlo_tools` IR, and hands XLA the new module, or nothing when no pass changed
it. The IR parses the entry computation at once and every other computation
(fusion bodies, mostly) only when a pass or the verifier reads it
(`hlo_tools.parse_module(..., lazy_bodies=True)`). When the passes changed
only instructions of the entry computation, XLA gets its own proto back with
just those instructions replaced (`hlo_tools.xla.proto_patch`), so that it parses
the edits rather than the whole module; otherwise it gets the whole module
printed, unread bodies as the text XLA printed. A module in which no pass of
the pipeline finds what it acts on (see `HloPass.opcodes`: e.g. fewer than two
all-reduces for a combiner) is handed back at once, unparsed, unless dumps are
asked for. The installed JAX plugin (`xla_passes.frontends.jax_plugin`) switches passes
on from the `XLA_PASSES` environment variable (or `--xla_passes`, see
`xla_passes.flags`) when JAX starts its backends.

Failures never break a user's compile: a pass that fails is logged as one
warning on the "xla_passes" logger and XLA compiles the original module, unless
`strict` asks for the compile to fail instead.

XLA may compile several modules at once on its own threads. The hook keeps no
state between modules except a process-wide module counter (under a lock); the
settings it reads are an immutable object swapped in one assignment.

JAX caches compiled functions: switching passes on or off affects compiles that
happen afterwards, not functions already compiled (`jax.clear_caches()` forgets
those). JAX's persistent compilation cache keys an executable on the module
before the hook rewrites it, so the settings in force are added to its key: compiles
under passes get their own entries, and compiles without passes keep JAX's keys.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence

import hlo_tools
from hlo_tools.xla import proto_patch, xla_bridge
from hlo_tools.ir import sdy
from hlo_tools.ir.attributes import parse_buffer_donor
from hlo_tools.ir.errors import one_line
from hlo_tools.garbage_collection import garbage_collection_paused

from ..analysis.replica_groups import inferred_device_counts
from ..core import PassError
from ..pipeline import Pipeline, computations_run_on_their_own
from ..rewrites.inlining import is_shardy_body_call, wrap_in_fusions
from ..tools import validation
from .configuration import (ALL_PLATFORMS, CHECK_VARIABLE, DUMP_VARIABLE, POST_SCHEDULER, PRE_SCHEDULER,
                            STRICT_VARIABLE, ConfigurationError, Settings, check_requested, configured_settings)

logger = logging.getLogger("xla_passes")

HOOK_NAME = "xla_passes"

# The settings every hook reads; replaced whole, never changed in place.
_active: Settings | None = None
# A configuration error that `strict` turns into a failure of every compile.
_refusal: PassError | None = None
# Whether this process chose its settings itself (enable/disable/absl flag), which the
# environment read at JAX's backend start must then not override.
_configured_in_process = False
_switch_lock = threading.Lock()
# (stage, platform) pairs where XLA calls our hook.
_installed: set[tuple[str, str]] = set()

_module_numbers = itertools.count()
_module_number_lock = threading.Lock()


def next_module_number() -> int:
    """The NNNN of `module_NNNN.*` dump files: unique in the process, whatever thread compiles."""
    with _module_number_lock:
        return next(_module_numbers)


class _PreviousSettings:
    """What `enable` returns: in a `with` statement, the settings before it come back on exit."""

    def __init__(self, previous: Settings | None):
        self._previous = previous

    def __enter__(self) -> Settings | None:
        return _active

    def __exit__(self, *exc_info) -> None:
        _switch(self._previous)


def enable(passes: str, *, stage: str = PRE_SCHEDULER, dump_to: str | None = None,
           strict: bool = False, platforms: str | Sequence[str] | None = None,
           check: bool = False) -> _PreviousSettings:
    """Run `passes` in every XLA compile from now on, replacing any earlier settings.

    Args:
      passes: pipeline text, e.g. "collective-fusion,dce" (checked now).
      stage: "pre_scheduler" (after SPMD partitioning and fusion) or
        "post_scheduler" (after XLA scheduled the module).
      dump_to: directory for `module_NNNN.<name>.before_xla_passes.txt` and
        `module_NNNN.<name>.KKKK.after_<pass>.txt` of every compiled module.
      strict: make a failing pass fail the compile instead of logging a warning.
      platforms: a platform name or names ("cpu", "cuda", "rocm", "tpu");
        None means all of them.
      check: run every module the passes changed against the original on
        random inputs before XLA gets it (CPU compiles; `xla_passes.tools.validation`),
        and keep the original, with a warning, when they differ.

    Returns:
      A context manager that puts the previous settings back on exit; ignore it
      to keep the passes on.

    Raises:
      PassError: bad pipeline text (the message lists the valid passes) or stage, or a pass that
        cannot run in JAX's compile (`HloPass.runs_at_jax_hook`, e.g. spatial-partitioning).
    """
    settings = Settings(passes, stage=stage, dump_to=dump_to, strict=strict, platforms=platforms, check=check)
    check_hook_passes(settings)
    previous = _active
    _switch(settings)
    return _PreviousSettings(previous)


def disable() -> None:
    """Stop running passes in XLA compiles (a no-op when none are on)."""
    _switch(None)


def enabled() -> Settings | None:
    """The settings in force, or None when no passes run."""
    return _active


def enable_configured() -> None:
    """Apply the `XLA_PASSES*` variables and `--xla_passes*` flags, unless this process chose its own settings.

    The JAX plugin calls this when JAX starts its backends, which must never
    fail because of us: a bad value logs one warning and switches nothing on.
    With `XLA_PASSES_STRICT=1` it raises instead, and every later compile fails
    with the same error (JAX logs and ignores exceptions from plugins, and a
    strict user wants the program stopped, not run without the passes).
    """
    global _refusal
    with _switch_lock:
        if _configured_in_process:
            return
    try:
        settings = configured_settings()
        if settings is not None:
            check_hook_passes(settings)
    except ConfigurationError as exc:
        if not exc.strict:
            logger.warning("xla_passes: %s; no passes enabled", exc)
            return
        with _switch_lock:
            _refusal = exc
            _install(PRE_SCHEDULER, ALL_PLATFORMS)
        raise
    if settings is not None:
        _switch(settings, explicit=False)


def check_hook_passes(settings: Settings) -> None:
    """Refuse, once and up front, a pipeline with a pass that cannot run in JAX's compile.

    Raises:
      ConfigurationError: names the passes and where they can run instead.
    """
    refused = sorted({p.name for p in settings.pipeline.all_passes() if not p.runs_at_jax_hook})
    if refused:
        raise ConfigurationError(
            f"{settings.passes!r}: {', '.join(refused)} cannot run inside JAX's compile (the modules "
            f"XLA hands the hook are already per device, with a signature JAX has fixed); run it on "
            f"single-device HLO with xla-opt or through xla_passes.tensorflow.function", settings.strict)


def apply(settings: Settings | None) -> None:
    """Make `settings` the ones in force (None: no passes), as `enable` and `disable` do."""
    _switch(settings)


def _switch(settings: Settings | None, explicit: bool = True) -> None:
    """Make `settings` the ones every hook reads, and have XLA call the hook where they need it."""
    global _active, _refusal, _configured_in_process
    with _switch_lock:
        _refusal = None
        if settings is None:
            _uninstall_cpu()
        else:
            _install(settings.stage, settings.platforms)
        _active = settings
        _configured_in_process |= explicit


def _install(stage: str, platforms: tuple[str, ...]) -> None:
    """Register the hook for `stage` on `platforms` where it is not yet registered.

    Registering starts nothing (`xla_bridge.register_pass_hook`), so the JAX plugin can do it
    while JAX starts its backends; a platform this process has no backend for gets the hook
    only if its backend starts. The CPU hook is removed when passes go off or move to the other
    stage. Hooks on other platforms cannot always be taken back, so they stay for the life of
    the process and return "unchanged" whenever the settings do not ask for them. Registering a
    name twice would run the hook twice, hence the bookkeeping in `_installed`. The settings in
    force go into JAX's persistent compilation cache keys from the first install on.
    """
    xla_bridge.add_cache_key_part(_cache_key_part)
    for other_stage in {s for s, p in _installed if p == "cpu" and s != stage}:
        xla_bridge.clear_pass_hook(HOOK_NAME, other_stage, "cpu")
        _installed.discard((other_stage, "cpu"))
    if "cpu" not in platforms:
        _uninstall_cpu()
    for platform in platforms:
        if (stage, platform) not in _installed:
            xla_bridge.register_pass_hook(functools.partial(_transform, stage, platform), name=HOOK_NAME,
                                          stage=stage, platform=platform)
            _installed.add((stage, platform))


def _cache_key_part() -> str:
    """The settings in force, for JAX's persistent compilation cache key ("" without passes): JAX
    takes the key before the hook runs, and a compile must not get an executable made under other
    settings."""
    settings = _active
    return "" if settings is None else f"xla_passes:{settings.executable_key()}"


def _uninstall_cpu() -> None:
    """Take the CPU hook away at every stage, so that compiles without passes pay nothing."""
    for stage in {s for s, p in _installed if p == "cpu"}:
        xla_bridge.clear_pass_hook(HOOK_NAME, stage, "cpu")
        _installed.discard((stage, "cpu"))


def _transform(stage: str, platform: str, module_proto: bytes) -> bytes | None:
    """The hook XLA calls with each module: new module bytes, or None for "unchanged"."""
    if _refusal is not None:
        raise PassError(f"{_refusal} (compiles fail because {STRICT_VARIABLE} is set)")
    settings = _active
    if settings is None or settings.stage != stage or platform not in settings.platforms:
        return None
    return rewrite_module(module_proto, settings, platform)


def rewrite_module(module_proto: bytes, settings: Settings, platform: str = "cpu") -> bytes | None:
    """Run the pipeline of `settings` on one serialized module; None when nothing changed.

    A failure returns None after one warning, so that XLA compiles the original
    module, or raises when `settings.strict`. With `settings.check`, so does a
    rewritten module that computes something else than the original
    (`xla_passes.tools.validation`; CPU compiles only). A pass that refuses the whole module
    (`Pipeline.refusals`) says why in a warning; XLA then compiles what the other passes made,
    strict or not (a module the pass does not fit is no failure of the compile).
    """
    number = next_module_number()
    name = "<unparsed>"
    start = time.perf_counter()
    try:
        pipeline = settings.pipeline.clone(  # fresh passes, the text parsed once (in `settings`)
            dump_to=settings.dump_to, module_number=number, layouts_final=True, on_dump_error=_dump_failed,
            after_pass=_wrap_in_fusions if settings.stage == POST_SCHEDULER else None, platform=platform)
        if not settings.dump_to and not pipeline.could_change(functools.partial(proto_patch.opcode_count, module_proto)):
            logger.info("xla_passes: module_%04d %s: skipped, nothing the passes act on, in %.1f ms", number,
                        proto_patch.module_name(module_proto), 1e3 * (time.perf_counter() - start))
            return None
        with garbage_collection_paused():  # the IR becomes garbage only once the hook returns
            # Bodies other than the entry's (mostly fusions, which few passes read) are parsed when read.
            module = hlo_tools.parse_module(xla_bridge.hook_module_text(module_proto), lazy_bodies=True)
            name = module.name
            signature = _entry_signature(module)
            changed = pipeline.run(module)
            if changed and _entry_signature(module) != signature:
                raise PassError("the passes changed the entry computation's parameter or result shapes, which "
                                "XLA fixed before calling the hook (e.g. weight-update-sharding{persistent=true}, "
                                "which applies to offline modules only)")
            result = None
            if changed:  # XLA re-parses only the entry's edits when nothing else changed
                result = (proto_patch.patched_module_proto(module_proto, module, xla_bridge.text_to_proto)
                          or xla_bridge.text_to_proto(module.to_text()))
            if changed and settings.check:
                _check(module_proto, result, module, pipeline, settings, platform)
            if changed and not xla_bridge.hook_keeps_donation() and (
                    "input_output_alias" in module.attrs or "buffer_donor" in module.attrs):
                _warn_once(f"XLA of jaxlib {'.'.join(map(str, xla_bridge.JAXLIB_VERSION))} drops the buffer "
                           "donation of every module a pass hook hands back (jaxlib 0.11.1 and newer keep it): "
                           "donated arguments are copied and the step's peak memory grows by their size; "
                           "xla_passes.jax.jit(fun, passes=..., donate_argnums=...) runs the passes before XLA's "
                           "optimizations and keeps it")
    except Exception as exc:
        if settings.strict:
            raise
        logger.warning("xla_passes: module_%04d %s: %s: %s; XLA compiles the module unchanged "
                       "(%s=1 makes this an error)", number, name, type(exc).__name__, exc, STRICT_VARIABLE)
        return None
    changed_by = [run.name for run in pipeline.log if run.changed]
    logger.info("xla_passes: module_%04d %s: %s in %.1f ms", number, name,
                f"changed by {', '.join(changed_by)}" if changed_by else "unchanged",
                1e3 * (time.perf_counter() - start))
    for line in pipeline.refusals():   # a pass that refused the whole module says why
        logger.warning("xla_passes: module_%04d %s: %s", number, name, line)
    return result


def _wrap_in_fusions(_pass_name: str, module) -> None:
    """After XLA's scheduling nothing fuses what the passes added: XLA:CPU (jaxlib 0.11+) runs
    elementwise and reduction instructions only inside fusions, so each goes in a kLoop fusion of
    its own, in every computation that runs on its own."""
    for comp in computations_run_on_their_own(module):
        wrap_in_fusions(comp)


def _check(original: bytes, rewritten: bytes, module, pipeline: Pipeline, settings: Settings,
           platform: str) -> None:
    """Translation validation of one rewrite (`xla_passes.tools.validation`).

    Raises:
      PassError: the modules differ, or the check could not tell; names the first pass whose
        output differs and the first differing output.
    """
    if platform != "cpu":
        _warn_once(f"{CHECK_VARIABLE} checks CPU compiles only; {platform} modules go unchecked")
        return
    counts = inferred_device_counts(module)
    if counts is None:
        raise PassError(f"{CHECK_VARIABLE}: cannot tell how many devices the module runs on, so it cannot be "
                        f"checked")
    replicated = validation.replicated_parameters(hlo_tools.parse_module(xla_bridge.hook_module_text(original),
                                                                         lazy_bodies=True), pipeline.all_passes())

    def check(candidate: bytes) -> validation.Verdict:
        return validation.check_rewrite(original, candidate, counts=counts, replicated=replicated,
                                        stage=settings.stage)

    verdict = check(rewritten)
    if verdict.ok:
        logger.info("xla_passes: %s: checked in %.1f s: %s", module.name, verdict.seconds, verdict.detail)
        return
    if not verdict.checked:
        raise PassError(f"{CHECK_VARIABLE}: could not check the rewrite: {verdict.detail}")
    culprit, verdict = _first_wrong_pass(original, settings, check) or (None, verdict)
    raise PassError(f"{CHECK_VARIABLE}: the rewritten module computes something else than XLA's: "
                    f"{verdict.detail}", culprit)


def _first_wrong_pass(original: bytes, settings: Settings, check) -> tuple[str, "validation.Verdict"] | None:
    """The first top-level item of the pipeline after which the module differs, and that verdict."""
    module = hlo_tools.parse_module(xla_bridge.hook_module_text(original), lazy_bodies=True)
    pipeline = settings.pipeline.clone()
    for item in pipeline.passes:   # the check runs CPU compiles only
        if Pipeline([item], layouts_final=True, platform="cpu").run(module):
            verdict = check(xla_bridge.text_to_proto(module.to_text()))
            if not verdict.ok:
                return str(item), verdict
    return None


_warned: set[str] = set()
_dump_failure_warned = False
_dump_failure_lock = threading.Lock()


def _dump_failed(error: OSError) -> None:
    """A dump could not be written: one warning per process, and the passes go on without it."""
    global _dump_failure_warned
    with _dump_failure_lock:
        if _dump_failure_warned:
            return
        _dump_failure_warned = True
    where = f"{error.filename}: " if error.filename else ""
    logger.warning("xla_passes: cannot write the dumps (%s%s); the passes go on without them, and this "
                   "warning is not repeated (check %s)", where, error.strerror or error, DUMP_VARIABLE)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("xla_passes: %s", message)


def _entry_signature(module) -> list[str]:
    """The entry's parameter and result shapes, which a module handed back to XLA must keep."""
    parameters, result = module.entry.program_shape
    return [shape.to_text(print_layout=False) for shape in [*parameters, result]]


# -- xla_passes.jax.jit: passes before XLA's optimizations, donation kept ----------------------------

def jit(fun, *, passes: str, strict: bool = False, check: bool | None = None, **jit_kwargs) -> "PassJitted":
    """`jax.jit(fun, **jit_kwargs)` with the pipeline `passes` run on each program before XLA's
    optimizations, where it may still change the program's signature and keeps its donation.

    The hook (`enable`, `XLA_PASSES`) sees the per-device module after XLA's partitioning,
    layout assignment and fusion, with a signature JAX has fixed, and XLA of jaxlib 0.10.2 drops
    the buffer donation of every module a hook hands back. Here JAX lowers `fun`, the passes
    rewrite the lowered module, and JAX compiles the result with its own options: donated
    arguments stay donated, and `weight-update-sharding{persistent=true}` can hand the
    optimizer state back sharded (each device keeps 1/N of it), which the next call accepts.
    The passes see the collectives the program itself has (shard_map and pmap-style steps);
    a `jax.jit` + `NamedSharding` program gets its collectives only from XLA's partitioner,
    after this point, so there `weight-update-sharding{persistent=true}` annotates the
    optimizer state and its update as split over the data axes, for the partitioner to split.

    As at the hook, the passes never break the program: when a pass fails, or XLA cannot
    compile the rewritten module, or (with `check`) the rewritten module computes something
    else than JAX's lowering on the same random inputs (`validation.check_offline_rewrite`),
    one warning on the "xla_passes" logger names the passes and why, and JAX compiles its own
    lowering. A pass that cannot apply to the program at all (`Pipeline.refusals`) says why in
    a warning too. `strict=True` raises instead. `check` defaults to `XLA_PASSES_CHECK`.
    `static_argnums` and `static_argnames` are taken as `jax.jit` takes them.

    Returns an object called like the jitted function, with `.lower(*args)` as JAX's.
    """
    return PassJitted(fun, Pipeline(passes), jit_kwargs, strict=strict,
                      check=check_requested() if check is None else check)


# Shardy's export writes the sharding of a function's result as this custom call.
_SHARDY_RESULT_SHARDING = "xla.sdy.FuncResultSharding"


def _constraints_in_callees(module: hlo_tools.HloModule) -> bool:
    """Whether a function the entry calls (not a shard_map body) holds a sharding constraint
    (`Sharding` custom call; `jnp.where` lowers to such functions). Converted back to StableHLO
    for JAX, such a module is partitioned by GSPMD, not Shardy, and GSPMD refuses Shardy's
    result shardings (`_result_shardings_as_constraints`)."""
    callees = {instr.attrs["to_apply"] for comp in module.computations for instr in comp.instructions
               if instr.opcode == "call" and not is_shardy_body_call(instr)}
    return any(instr.opcode == "custom-call" and instr.attrs.get("custom_call_target") == "Sharding"
               for callee in callees for instr in callee.instructions)


def _result_shardings_as_constraints(module: hlo_tools.HloModule) -> None:
    """Every Shardy result sharding in `module`'s entry (not those of shard_map results, which
    GSPMD reads) as the sharding constraint it is for its value: the same Shardy sharding, with
    its HloSharding. One that names no mesh of the module (or a sub-axis) is dropped: a
    constraint only guides the partitioner, the values stay."""
    module_attributes = module.attrs.get("frontend_attributes")
    meshes = sdy.meshes(module_attributes.get("xla.sdy.meshes") or "") if module_attributes is not None else {}
    entry = module.entry
    for instr in list(entry.instructions):
        if instr.opcode != "custom-call" or instr.attrs.get("custom_call_target") != _SHARDY_RESULT_SHARDING:
            continue
        source = instr.operand(0)
        while source.opcode == "get-tuple-element" or (
                source.opcode == "custom-call" and source.attrs.get("custom_call_target") == "Sharding"):
            source = source.operand(0)
        if source.opcode == "custom-call" and source.attrs.get("custom_call_target", "").startswith("xla.sdy.") \
                or source.opcode == "call" and is_shardy_body_call(source):
            continue
        frontend = instr.attrs.get("frontend_attributes")
        found = sdy.values(frontend.get("xla.sdy.sharding") or "") if frontend is not None else []
        mesh = meshes.get(found[0].mesh) if len(found) == 1 else None
        per_dim = sdy.dims(found[0].dims_text) if mesh is not None else None
        if per_dim is None:
            instr.replace_all_uses_with(instr.operand(0))
            entry.remove_instruction(instr)
            continue
        instr.attrs["custom_call_target"] = "Sharding"
        instr.attrs.pop("custom_call_has_side_effect", None)
        instr.attrs["sharding"] = mesh.hlo_sharding(per_dim)


class PassJitted:
    """What `jit` returns: compiles once per argument signature, then calls the executable."""

    def __init__(self, fun, pipeline: Pipeline, jit_kwargs: dict, *, strict: bool = False, check: bool = False):
        import jax  # noqa: PLC0415

        self._jitted = jax.jit(fun, **jit_kwargs)
        self._pipeline = pipeline   # parsed once; each lowering runs a clone (fresh pass objects)
        self._strict = strict
        self._check = check
        self._static = _static_arguments(fun, jit_kwargs.get("static_argnums"), jit_kwargs.get("static_argnames"))
        self._compiled: dict = {}
        self.reports: list[str] = []   # what the passes said about the last program they rewrote

    def lower(self, *args, **kwargs) -> "PassLowered":
        """JAX's lowering of `fun` for these arguments, with the passes applied to it (JAX's own
        lowering, after one warning, where the passes fail or the check finds a difference)."""
        lowered = self._jitted.lower(*args, **kwargs)
        text = xla_bridge.lowered_module_text(lowered)
        module = hlo_tools.parse_module(text)
        before = _entry_shardings(module)
        partitioned_by_gspmd = _constraints_in_callees(module)
        pipeline = self._pipeline.clone()
        try:
            changed = pipeline.run(module)
            if self._strict and pipeline.refusals():
                raise PassError(pipeline.refusals()[0])
            if changed and self._check:
                verdict = validation.check_offline_rewrite(text, module.to_text(), pipeline.all_passes())
                if not verdict.ok:
                    what = "could not check the rewrite" if not verdict.checked else \
                        "the rewritten module computes something else than JAX's lowering"
                    raise PassError(f"{CHECK_VARIABLE}: {what}: {verdict.detail}")
                logger.info("xla_passes.jax.jit: %s: checked in %.1f s: %s", module.name, verdict.seconds,
                            verdict.detail)
            rewritten = lowered
            if changed:
                if partitioned_by_gspmd:
                    _result_shardings_as_constraints(module)
                after = _entry_shardings(module)
                rewritten = xla_bridge.with_lowered_module(
                    lowered, module.to_text(),
                    resharded_parameters=[i for i, s in enumerate(after[0]) if s != before[0][i]],
                    resharded_outputs=[i for i, s in enumerate(after[1]) if s != before[1][i]],
                    buffer_donors=_buffer_donors(module))
        except Exception as exc:
            self._refuse(module.name, exc)
            self.reports = []
            return PassLowered(lowered, lowered, module.name)
        self.reports = pipeline.reports()
        for line in self.reports:
            logger.info("xla_passes.jax.jit: %s", line)
        for line in pipeline.refusals():   # a pass that refused the whole module says why
            logger.warning("xla_passes.jax.jit: %s: %s", module.name, line)
        return PassLowered(rewritten, lowered, module.name)

    def _refuse(self, name: str, exc: Exception) -> None:
        """The passes' result cannot be used: raise under `strict`, else one warning."""
        if self._strict:
            raise exc
        logger.warning("xla_passes.jax.jit: %s: %s: %s: %s; JAX compiles its own lowering (strict=True makes "
                       "this an error)", name, self._pipeline, type(exc).__name__, one_line(str(exc)))

    def _compile(self, *args, **kwargs):
        lowered = self.lower(*args, **kwargs)
        try:
            return lowered.compile()
        except Exception as exc:  # XLA refused the rewritten module
            if lowered.original is lowered._lowered:  # JAX's own lowering: not ours to hide
                raise
            self._refuse(lowered.module_name, exc)
            return lowered.original.compile()

    def __call__(self, *args, **kwargs):
        import jax  # noqa: PLC0415

        dynamic_args, dynamic_kwargs = self._dynamic(args, kwargs)
        key = self._key(args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(*args, **kwargs)
            self._compiled[key] = compiled
            # the arguments it takes back: its own outputs (state the passes left sharded)
            self._compiled[self._key(args, kwargs, compiled)] = compiled
        leaves, tree = jax.tree.flatten((dynamic_args, dynamic_kwargs))
        for position, sharding in _taken_shardings(compiled, len(leaves)).items():  # sharded state goes in sharded
            leaf = leaves[position]
            if _sharding_of(leaf) is not None and not _sharding_of(leaf).is_equivalent_to(sharding, leaf.ndim):
                leaves[position] = jax.device_put(leaf, sharding)
        dynamic_args, dynamic_kwargs = jax.tree.unflatten(tree, leaves)
        return compiled(*dynamic_args, **dynamic_kwargs)

    def _static_numbers(self, args) -> set[int]:
        """The positions of the static arguments among `args`; a negative one counts from the
        last argument given, as `jax.jit` counts it."""
        return {n + len(args) if n < 0 else n for n in self._static[0]}

    def _dynamic(self, args, kwargs):
        numbers, names = self._static_numbers(args), self._static[1]
        return ([a for i, a in enumerate(args) if i not in numbers],
                {k: v for k, v in kwargs.items() if k not in names})

    def _key(self, args, kwargs, compiled=None):
        """Static values, and every dynamic leaf's shape, dtype and sharding (or the one `compiled`
        takes it in)."""
        import jax  # noqa: PLC0415

        numbers, names = self._static_numbers(args), self._static[1]
        static = (tuple(a for i, a in enumerate(args) if i in numbers),
                  tuple(sorted((k, v) for k, v in kwargs.items() if k in names)))
        leaves, tree = jax.tree.flatten(self._dynamic(args, kwargs))
        taken = _taken_shardings(compiled, len(leaves)) if compiled is not None else {}
        given = [taken.get(position, _sharding_of(leaf)) for position, leaf in enumerate(leaves)]
        return static, tree, tuple((jax.numpy.shape(leaf), str(jax.numpy.result_type(leaf)),
                                    xla_bridge.sharding_key(sharding, jax.numpy.ndim(leaf)))
                                   for leaf, sharding in zip(leaves, given))


def _taken_shardings(compiled, count: int) -> dict:
    """Position among the `count` flattened dynamic arguments -> the sharding `compiled` takes
    that argument in (JAX drops arguments the program does not use)."""
    import jax  # noqa: PLC0415

    wanted = jax.tree.leaves(compiled.input_shardings[0])
    positions = range(count) if len(wanted) == count else xla_bridge.kept_argument_positions(compiled)
    if positions is None or len(positions) != len(wanted):
        return {}
    return dict(zip(positions, wanted))


class PassLowered:
    """JAX's `Lowered` of the rewritten program, plus `memory_analysis()` of its compiled form;
    `original` is JAX's own lowering."""

    def __init__(self, lowered, original, module_name: str):
        self._lowered = lowered
        self.original = original
        self.module_name = module_name

    def __getattr__(self, name):
        return getattr(self._lowered, name)

    def memory_analysis(self):
        return self._lowered.compile().memory_analysis()


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) or not isinstance(value, Iterable) else tuple(value)


def _static_arguments(fun, numbers, names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`static_argnums` and `static_argnames` as `jax.jit` completes them from `fun`'s signature
    (`jax._src.api_util.infer_argnums_and_argnames`): given only numbers, the names of those
    positional-or-keyword parameters are static too, and given only names, their positions, so
    that a static argument is taken out however it is passed."""
    numbers, names = _as_tuple(numbers), _as_tuple(names)
    if bool(numbers) == bool(names):
        return numbers, names
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: jax infers nothing either
        return numbers, names
    named = [(i, p.name) for i, p in enumerate(parameters) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if names:
        return tuple(i for i, name in named if name in names), names
    return numbers, tuple(name for i, name in named if i in numbers)


def _sharding_of(leaf):
    return getattr(leaf, "sharding", None)


def _buffer_donors(module) -> list[int]:
    """The entry parameters that the module's `buffer_donor` attribute donates whole."""
    donors = module.attrs.get("buffer_donor")
    return [number for number, index in parse_buffer_donor(str(donors)) if not index] if donors is not None else []


def _entry_shardings(module) -> tuple[list[str], list[str]]:
    """The sharding text of each entry parameter and each result leaf ("" where none)."""
    entry = module.entry
    parameters = [str(p.attrs.get("sharding") or "") for p in entry.parameters]
    root = entry.root.attrs.get("sharding")
    count = len(entry.root.shape.tuple_shapes) if entry.root.shape.is_tuple else 1
    if root is not None and root.kind == "tuple":
        results = [str(e) for e in root.elements]
    else:
        results = [str(root or "")] * count
    return parameters, results
