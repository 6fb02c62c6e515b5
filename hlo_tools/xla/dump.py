"""Capture HLO modules before and after XLA's optimizations, in files named as XLA names its dumps.

    from hlo_tools.xla import dump
    dump.dump_jax(step, params, batch, out_dir="dumps")          # jax.jit(step).lower(...)
    dump.dump_tf(tf_step, tf.TensorSpec([8, 16]), out_dir="dumps")  # tf.function(jit_compile=True)
    files, status = dump.dump_script(["python", "train.py"], "dumps")

Every module lands in ``out_dir`` as XLA's ``--xla_dump_to`` would write it:
``module_NNNN.<name>.before_optimizations.txt`` (the module XLA's pipeline
starts from) and ``module_NNNN.<name>.<compiler>_after_optimizations.txt``
(what the backend compiled; XLA's CPU compiler says ``cpu_``, its GPU
compiler names the GPU, e.g. ``sm_9.0_gpu_``), so a glob on
``*after_optimizations.txt`` finds both kinds.  ``<name>`` is the name on the
module's ``HloModule`` line with the characters XLA replaces in file names
(``/ \\ [ ] `` and space) turned into ``_``.

Numbering: XLA numbers a dump with the module's id in the process that
compiled it, so two runs into one directory would overwrite each other.  Here
``NNNN`` (four digits or more, as XLA prints it) continues after the highest
number already in ``out_dir``; a script run into an empty directory keeps
XLA's own numbers.  Nothing in ``out_dir`` is ever overwritten: every dump is
first written to a private staging directory inside ``out_dir`` and then
hard-linked into place, which fails rather than replace a file, so a reader
never sees a half-written file either.

How each source is captured:

* JAX: ``jit(fn).lower(*args).compile()`` with XLA's dump options passed as
  ``compiler_options``, so the files are XLA's own dump of that compilation
  (with its source-location tables and with large constants printed in full,
  so that the modules can be run).  A hit in jax's persistent compilation
  cache skips XLA's compiler and with it the dump; that is reported as a
  :class:`DumpError`.
* TensorFlow: ``fn.experimental_get_compiler_ir(*args)`` at stages ``hlo`` and
  ``optimized_hlo``: TF's print of the module it hands to XLA, and of the
  module XLA compiled for TF's default device.
* A script: the child runs with ``XLA_FLAGS`` extended by XLA's dump flags
  (``--xla_dump_to`` pointing at the staging directory, text format, large
  constants in full; the caller's own flags are kept, see
  :func:`xla_flags_for_dump`).  Every file XLA writes is
  kept (buffer assignments, LLVM IR, ...), and moved into ``out_dir`` when the
  child ends.  TensorFlow's XLA reads the same ``XLA_FLAGS``.

jax and tensorflow are imported inside the functions that use them, so the
IR never loads them and the JAX path works where TensorFlow is not installed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

STAGES = ("before", "after", "both")
BEFORE_SUFFIX = "before_optimizations.txt"
AFTER_SUFFIX = "after_optimizations.txt"

# XLA's dump options for every capture: HLO as text, large constants in full (runnable modules).
_DUMP_OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_large_constants": True}

# A numbered dump entry: XLA's ``module_<id>.<rest>`` (rest: module name and what the file holds).
_NUMBERED = re.compile(r"module_(\d+)\.(.+)", re.S)
_MODULE_NAME = re.compile(r"^\s*HloModule\s+([^\s,]+)", re.M)
_STAGING_PREFIX = ".hlo-tools-dump-"

logger = logging.getLogger(__name__)

# Seconds a writer waits for the lock on a dump directory before it numbers its files without it.
LOCK_TIMEOUT_SECONDS = 5
# Directories whose lock a writer once waited for in vain (someone holds it): no writer waits for it again.
_held_elsewhere: set[str] = set()
_held_elsewhere_lock = threading.Lock()


class DumpError(Exception):
    """A dump could not be made (one line: what failed and where)."""


class ScriptDump(NamedTuple):
    """What :func:`dump_script` captured: the paths it wrote and the child's exit status."""

    files: list[str]
    returncode: int  # negative -N when the child was killed by signal N, as in subprocess


# --- Names and numbers -----------------------------------------------------------------------------


def sanitize_file_name(name: str) -> str:
    """``name`` as XLA puts it in a file name (``xla::SanitizeFileName``)."""
    return re.sub(r"[/\\\[\] ]", "_", name)


def module_file_name(number: int, module_name: str, suffix: str) -> str:
    """XLA's dump file name, e.g. ``module_0003.jit_step.before_optimizations.txt``."""
    return f"module_{number:04d}.{sanitize_file_name(module_name)}.{suffix}"


def next_module_number(out_dir: str) -> int:
    """One more than the highest ``module_NNNN.`` number in ``out_dir`` (0 when there is none)."""
    numbers = [int(m.group(1)) for m in map(_NUMBERED.fullmatch, os.listdir(out_dir)) if m]
    return max(numbers, default=-1) + 1


def is_hlo_dump(path: str) -> bool:
    """Whether ``path`` is a module before or after optimizations (not a buffer assignment, IR...)."""
    return _is_before(path) or _is_after(path)


def _is_before(path: str) -> bool:
    return os.path.basename(path).endswith("." + BEFORE_SUFFIX)


def _is_after(path: str) -> bool:
    return os.path.basename(path).endswith(AFTER_SUFFIX)


def _stage_wanted(name: str, stage: str) -> bool:
    return (_is_before(name) and stage in ("before", "both")) or (_is_after(name) and stage in ("after", "both"))


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise DumpError(f"stage must be one of {', '.join(STAGES)}, not {stage!r}")


# --- Staging and placing files without overwriting --------------------------------------------------


@contextmanager
def _staging_dir(out_dir: str) -> Iterator[str]:
    """A private directory inside ``out_dir`` (created if needed), removed afterwards.

    Inside ``out_dir`` so that finished files can be hard-linked into place.
    """
    try:
        os.makedirs(out_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise DumpError(f"{out_dir}: not a directory") from exc
    staging = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out_dir)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _claim(source: str, target: str) -> None:
    """Move ``source`` (a file or directory) to ``target``; FileExistsError when ``target`` exists.

    A file is hard-linked (atomic, never replaces); a directory first claims its
    name with ``mkdir`` and then replaces that empty directory by a rename.
    """
    if os.path.isdir(source):
        os.mkdir(target)
        os.rename(source, target)
    else:
        os.link(source, target)


def _place_group(entries: Sequence[tuple[str, str]], out_dir: str, number: int) -> list[str]:
    """Put one module's entries ``(staged path, rest of the name)`` under one number.

    ``number`` is tried first; when a file already has that number (another dump got
    there), the whole group moves on to the number after the highest one in ``out_dir``.
    The choice is made under a lock on the directory, which the JAX hook's and xla-opt's
    dumps (:func:`write_numbered`) take too.
    """
    with _directory_locked(out_dir):
        while True:
            taken = _numbers_in(out_dir)
            if number in taken:
                number = max(taken) + 1
            placed = []
            try:
                for source, rest in entries:
                    target = os.path.join(out_dir, f"module_{number:04d}.{rest}")
                    _claim(source, target)
                    placed.append(target)
                return placed
            except FileExistsError:  # a writer that takes no lock got there
                for target in placed:
                    _remove(target)
                number = max(number + 1, next_module_number(out_dir))


def _staged_text(out_dir: str, text: str) -> str:
    """A private file in ``out_dir`` holding ``text``, readable as a new file of the umask is."""
    fd, staged = tempfile.mkstemp(prefix=_STAGING_PREFIX, suffix=".tmp", dir=out_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staged, 0o666 & ~umask)
    except BaseException:
        os.unlink(staged)
        raise
    return staged


def write_numbered(out_dir: str, number: int, rest: str, text: str) -> int:
    """Write ``text`` to ``out_dir/module_NNNN.<rest>`` without replacing any file; returns NNNN.

    ``number`` is tried first; when a file in ``out_dir`` already has that number (another
    process dumping into the same directory, an earlier run's file), the number after the
    highest one there is taken. Writers choose under a lock on the directory, so two never
    take one number. The file appears whole or not at all (written aside, then hard-linked).
    """
    staged = _staged_text(out_dir, text)
    try:
        with _directory_locked(out_dir):
            while True:
                taken = _numbers_in(out_dir)
                if number in taken:
                    number = max(taken) + 1
                try:
                    os.link(staged, os.path.join(out_dir, f"module_{number:04d}.{rest}"))
                    return number
                except FileExistsError:  # a writer that takes no lock got there
                    number += 1
    finally:
        os.unlink(staged)


def _numbers_in(out_dir: str) -> set[int]:
    """The ``module_NNNN.`` numbers of the files in ``out_dir``."""
    return {int(m.group(1)) for m in map(_NUMBERED.fullmatch, os.listdir(out_dir)) if m}


@contextmanager
def _directory_locked(directory: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` while inside: writers of numbered files (threads
    and processes) choose a free number and take it one at a time.

    Anyone who can read the directory can hold its lock, so it is waited for at most
    ``LOCK_TIMEOUT_SECONDS``, once per directory: then one warning, and the writers go on
    without it. They stay correct, only less orderly: a file is claimed by a hard link, which
    fails rather than replace one, and a writer that loses a number moves on to the next.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        key = os.path.realpath(directory)
        deadline = time.monotonic() + (0 if key in _held_elsewhere else LOCK_TIMEOUT_SECONDS)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    _warn_held(key)
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _warn_held(directory: str) -> None:
    """Note that another process holds ``directory``'s lock: warned about once, never waited for again."""
    with _held_elsewhere_lock:
        if directory in _held_elsewhere:
            return
        _held_elsewhere.add(directory)
    logger.warning("%s: another process has held the dump directory's lock for %g s; dumps there are "
                   "numbered without it (no file is replaced) and this warning is not repeated",
                   directory, LOCK_TIMEOUT_SECONDS)


def write_new(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole, as a new file: FileExistsError when ``path`` exists."""
    staged = _staged_text(os.path.dirname(os.path.abspath(path)), text)
    try:
        os.link(staged, path)
    finally:
        os.unlink(staged)


def _remove(target: str) -> None:
    """Delete a file or a directory tree."""
    if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target)
    else:
        os.unlink(target)


def _place_unnumbered(source: str, out_dir: str) -> str:
    """Put an entry without a module number under its own name, or ``name.1``, ``name.2``... if taken."""
    name = os.path.basename(source)
    candidate, copy = name, 0
    while True:
        target = os.path.join(out_dir, candidate)
        try:
            _claim(source, target)
            return target
        except FileExistsError:
            copy += 1
            candidate = f"{name}.{copy}"


def _move_staged(staging: str, out_dir: str, keep_xla_numbers: bool) -> list[str]:
    """Move everything in ``staging`` into ``out_dir``; returns the paths, sorted.

    Modules are numbered from ``next_module_number(out_dir)`` on: consecutively,
    or (``keep_xla_numbers``) with XLA's numbers shifted by that base, so a dump
    into an empty directory keeps XLA's names exactly.
    """
    groups: dict[int, list[tuple[str, str]]] = {}
    unnumbered = []
    for name in sorted(os.listdir(staging)):
        match = _NUMBERED.fullmatch(name)
        if match:
            groups.setdefault(int(match.group(1)), []).append((os.path.join(staging, name), match.group(2)))
        else:
            unnumbered.append(os.path.join(staging, name))
    base = next_module_number(out_dir)
    placed = []
    for index, xla_number in enumerate(sorted(groups)):
        number = base + (xla_number if keep_xla_numbers else index)
        placed += _place_group(groups[xla_number], out_dir, number)
    placed += [_place_unnumbered(source, out_dir) for source in unnumbered]
    return sorted(placed)


# --- JAX ---------------------------------------------------------------------------------------------


def dump_jax(fn, *args, out_dir: str, stage: str = "both", **kwargs) -> list[str]:
    """Dump the module XLA compiles for ``fn(*args, **kwargs)``, before and/or after optimizations.

    Args:
      fn: a function, or an already jitted one (``jax.jit``, ``jax.pmap``:
        anything with ``.lower``); a plain function is wrapped in ``jax.jit``.
      args, kwargs: what ``fn.lower`` takes: arrays, or ``jax.ShapeDtypeStruct``
        (with ``sharding=`` for sharded programs), in any pytree.
      out_dir: the directory to write to (created if missing).
      stage: ``before``, ``after`` or ``both``.

    Returns:
      The paths written, sorted.

    Raises:
      DumpError: ``out_dir`` is not a directory, or the executable came from
        jax's persistent compilation cache (XLA then dumps nothing before
        optimizations). Errors while tracing, lowering or compiling ``fn``
        propagate as jax raised them.
    """
    import jax  # noqa: PLC0415 - heavy, and only this path needs it

    _check_stage(stage)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    with _staging_dir(out_dir) as staging:
        lowered.compile(compiler_options={"xla_dump_to": os.path.abspath(staging), **_DUMP_OPTIONS})
        for name in os.listdir(staging):
            if not _stage_wanted(name, stage):
                _remove(os.path.join(staging, name))
        written = os.listdir(staging)
        if not written or (stage != "after" and not any(map(_is_before, written))):
            raise DumpError("XLA did not compile the module, so it dumped nothing before optimizations: "
                            "the executable came from jax's persistent compilation cache "
                            "(jax_compilation_cache_dir)")
        return _move_staged(staging, out_dir, keep_xla_numbers=False)


# --- TensorFlow --------------------------------------------------------------------------------------


def dump_tf(fn, *args, out_dir: str, stage: str = "both", **kwargs) -> list[str]:
    """Dump the module of a ``tf.function(jit_compile=True)`` for ``args``, before and/or after XLA.

    Args:
      fn: a ``tf.function`` made with ``jit_compile=True``; a plain Python
        function is wrapped in one.
      args, kwargs: tensors, or ``tf.TensorSpec`` (all of one kind, as TF requires).
      out_dir: the directory to write to (created if missing).
      stage: ``before`` (TF's ``hlo`` stage), ``after`` (``optimized_hlo``) or ``both``.

    Returns:
      The paths written, sorted. The module after optimizations is
      ``cpu_after_optimizations.txt`` on a CPU, as XLA names it, and
      ``gpu_after_optimizations.txt`` on a GPU (XLA's own dump names the GPU
      model there, e.g. ``sm_9.0_gpu_after_optimizations.txt``).

    Raises:
      DumpError: ``out_dir`` is not a directory. TF's own errors propagate as
        TF raised them (a ValueError for a tf.function without
        ``jit_compile=True`` or with ops XLA cannot compile).
    """
    import tensorflow as tf  # noqa: PLC0415 - heavy, optional; only this path needs it

    _check_stage(stage)
    if not isinstance(fn, tf.types.experimental.PolymorphicFunction):
        fn = tf.function(fn, jit_compile=True)
    # TF places a function on a GPU when it has one (experimental_get_compiler_ir does the same).
    compiler = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    compiler_ir = fn.experimental_get_compiler_ir(*args, **kwargs)
    texts = {}
    if stage in ("before", "both"):
        texts[BEFORE_SUFFIX] = compiler_ir(stage="hlo")
    if stage in ("after", "both"):
        texts[f"{compiler}_{AFTER_SUFFIX}"] = compiler_ir(stage="optimized_hlo")
    module_name = _MODULE_NAME.search(next(iter(texts.values()))).group(1)
    with _staging_dir(out_dir) as staging:
        for suffix, text in texts.items():
            path = os.path.join(staging, module_file_name(0, module_name, suffix))
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        return _move_staged(staging, out_dir, keep_xla_numbers=False)


# --- A script run --------------------------------------------------------------------------------


def xla_flags_for_dump(dump_dir: str, user_flags: str = "") -> str:
    """``XLA_FLAGS`` for a child that dumps to ``dump_dir``, keeping ``user_flags``.

    Large constants go first, so the user's flags may turn them off; the dump
    directory and text format go last, so they win over a ``--xla_dump_to``
    the user already had (XLA keeps the last value of a repeated flag).  XLA
    splits the variable at spaces except inside double quotes, so the
    directory is quoted, and a directory with a double quote is refused.
    """
    if '"' in dump_dir:
        raise DumpError(f"{dump_dir}: XLA_FLAGS cannot carry a path with a double quote")
    return " ".join(filter(None, ["--xla_dump_large_constants", user_flags.strip(),
                                  f'--xla_dump_to="{dump_dir}"', "--xla_dump_hlo_as_text"]))


def dump_script(argv: Sequence[str], out_dir: str, env: Mapping[str, str] | None = None) -> ScriptDump:
    """Run ``argv`` with XLA's dump switched on; move what XLA wrote into ``out_dir``.

    The child shares this process's stdin, stdout and stderr, in a process group of its own,
    so that a signal this process gets reaches every process the child started (see
    :func:`_wait`; as with coreutils' ``timeout``, a child that reads the terminal is stopped).
    Its files are moved when it ends, also when it fails or is interrupted.

    Args:
      argv: the command and its arguments (looked up on ``PATH``).
      out_dir: the directory to write to (created if missing).
      env: the child's environment (default: this process's), to which
        ``XLA_FLAGS`` is added.

    Returns:
      ``ScriptDump(files, returncode)``: every path moved into ``out_dir``,
      sorted (:func:`is_hlo_dump` picks the modules among them), and the
      child's exit status.

    Raises:
      DumpError: ``argv`` is empty or its command cannot be started, or
        ``out_dir`` is not a directory.
    """
    if not argv:
        raise DumpError("no command to run")
    base_env = dict(os.environ if env is None else env)
    with _staging_dir(out_dir) as staging:
        xla_flags = xla_flags_for_dump(os.path.abspath(staging), base_env.get("XLA_FLAGS", ""))
        child_env = dict(base_env, XLA_FLAGS=xla_flags)
        try:
            child = subprocess.Popen(list(argv), env=child_env, process_group=0)
        except FileNotFoundError as exc:
            raise DumpError(f"{argv[0]}: command not found") from exc
        except OSError as exc:
            raise DumpError(f"{argv[0]}: {exc.strerror or exc}") from exc
        try:
            returncode = _wait(child)
        finally:
            files = _move_staged(staging, out_dir, keep_xla_numbers=True)
    return ScriptDump(files, returncode)


# Seconds a script has to end after SIGTERM or SIGHUP was passed on to it, before it is killed.
TERMINATION_GRACE_SECONDS = 10


def _wait(child: subprocess.Popen) -> int:
    """The child's exit status.

    Ctrl-C, SIGTERM or SIGHUP sent to this process (``KeyboardInterrupt``, or
    ``hlo_tools.cli.Terminated``, which carries the signal's number) is passed on to the
    child's whole process group, which gets a grace period to end; then, or at once on a
    second signal, whatever is left of the group is killed, so that no process the command
    started outlives it. The interruption is then raised again.
    """
    try:
        return child.wait()
    except KeyboardInterrupt as exc:
        _stop_group(child, getattr(exc, "signum", signal.SIGINT))
        raise


def _stop_group(child: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the child's process group, wait for the group to end, kill what is left."""
    try:
        _signal_group(child, signum)
        deadline = time.monotonic() + TERMINATION_GRACE_SECONDS
        while _group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass  # a second signal: no more grace
    finally:
        _signal_group(child, signal.SIGKILL)
        child.wait()


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(child.pid, signum)  # the group is the child's pid (process_group=0)
    except ProcessLookupError:
        pass  # every process of the group has ended


def _group_alive(child: subprocess.Popen) -> bool:
    """Whether a process of the child's group has not ended (the child itself is reaped first)."""
    child.poll()
    try:
        os.killpg(child.pid, 0)
    except ProcessLookupError:
        return False
    return True
