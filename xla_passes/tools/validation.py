"""Translation validation: run a module before and after the passes on the same inputs, compare.

`XLA_PASSES_CHECK=1` (or `xla_passes.jax.enable(..., check=True)`) makes the JAX hook check
every module its passes changed before handing it to XLA: the module XLA gave the hook and
the rewritten one are compiled the way XLA compiles them after the hook
(`hlo_tools.xla.xla_bridge.compile_optimized_module`: layouts, fusions and all) and run on the
same random inputs on as many CPU devices as the module runs on. Inputs respect what the
passes may assume: a parameter declared replicated (`sharding={replicated}`,
`parameter_replication`), or every parameter when a pass was told to assume it
(`assume_replicated_parameters=true`), gets the same value on every device. A wrong rewrite
is then caught before it computes anything for the user, whatever pass made it.

The check compiles and runs in a child process: XLA cannot compile from inside its own pass
hook, and a module XLA aborts on must not take the user's program down. It costs a Python
start, one compile of each module and one run: a few seconds per changed module, paid once
per compile (JAX caches the result). Worth it while bringing up a new model; off by default.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hlo_tools import HloModule

from ..analysis.replica_groups import DeviceCounts

# An element matches when it is within either bound of the original's (float noise of a
# reduction done in another order; integers and predicates must be equal).
ABS_ERROR_BOUND = 1e-5
REL_ERROR_BOUND = 1e-5
DEFAULT_TIMEOUT_S = 600

_JOB, _ORIGINAL, _REWRITTEN, _RESULT = "job.json", "original.pb", "rewritten.pb", "result.json"


@dataclasses.dataclass
class Verdict:
    """The outcome of one check: `ok` with what was compared, or the first differing output."""

    ok: bool
    detail: str
    seconds: float = 0.0
    checked: bool = True   # False: the check could not run (detail says why)


def replicated_parameters(module: HloModule, passes) -> list[int]:
    """The entry parameters every device must hold the same value of, for `module` before the
    pipeline items `passes` ran: all of them when a pass was told to assume so."""
    assume_all = any(getattr(p, "assume_replicated_parameters", False) for p in passes)
    replicated = []
    for parameter in module.entry.parameters:
        sharding = parameter.attrs.get("sharding")
        flags = parameter.attrs.get("parameter_replication")
        if assume_all or (sharding is not None and sharding.kind == "replicated") or \
                (flags is not None and all(part.strip() == "true" for part in str(flags).strip("{}").split(","))):
            replicated.append(parameter.parameter_number)
    return replicated


def check_rewrite(original: bytes, rewritten: bytes, *, counts: DeviceCounts, replicated: list[int],
                  stage: str = "pre_scheduler", seed: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Run `original` and `rewritten` (serialized modules XLA optimized up to `stage`) on the same
    inputs on `counts` CPU devices, in a child process, and compare every output on every device."""
    start = time.perf_counter()
    devices = (counts.replicas or 1) * (counts.partitions or 1)
    with tempfile.TemporaryDirectory(prefix="xla-passes-check-") as directory:
        for name, data in ((_ORIGINAL, original), (_REWRITTEN, rewritten)):
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
        with open(os.path.join(directory, _JOB), "w") as f:
            json.dump({"replicas": counts.replicas or 1, "partitions": counts.partitions or 1,
                       "replicated": list(replicated), "stage": stage, "seed": seed}, f)
        try:
            child = subprocess.run([sys.executable, "-m", "xla_passes.tools.validation", directory],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   env=_child_env(devices), timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return Verdict(False, f"the check took more than {timeout:.0f} s", time.perf_counter() - start,
                           checked=False)
        result_path = os.path.join(directory, _RESULT)
        if not os.path.exists(result_path):
            from hlo_tools.xla.runner import crash_message  # noqa: PLC0415 - only on failure

            return Verdict(False, crash_message(child.returncode, child.stderr.decode(errors="replace"),
                                                "checking"), time.perf_counter() - start, checked=False)
        with open(result_path) as f:
            result = json.load(f)
    return Verdict(result["ok"], result["detail"], time.perf_counter() - start, result.get("checked", True))


def check_inputs(text: str, original: str, passes=()) -> list[np.ndarray]:
    """Random global inputs for the module `text`, as the offline check feeds it: in a replica
    program the parameters `original` declares replicated (all, when one of `passes` assumes so)
    get the same slice on every replica, since a pass may rely on that.

    Raises:
      runner.RunError: XLA cannot load `text`.
    """
    from hlo_tools import parse_module  # noqa: PLC0415
    from hlo_tools.xla import runner  # noqa: PLC0415 - compiles with XLA

    loaded = runner.load_module(text, "check")
    inputs = runner.random_inputs(loaded.global_signature())
    if loaded.mode == "replica":  # slice i goes to replica i: replicated parameters get equal slices
        for number in replicated_parameters(parse_module(original), passes):
            inputs[number] = np.broadcast_to(inputs[number][:1], inputs[number].shape).copy()
    return inputs


def check_offline_rewrite(original: str, rewritten: str, passes=()) -> Verdict:
    """Translation validation of a rewrite before XLA's optimizations (`xla-opt --check`,
    `xla_passes.jax.jit(..., check=True)`): both modules on the same random global inputs
    (`check_inputs`), in a child process, compared within this module's bounds."""
    from hlo_tools.xla import runner  # noqa: PLC0415 - compiles with XLA

    start = time.perf_counter()
    try:
        comparison = runner.compare_modules(rewritten, original, check_inputs(rewritten, original, passes),
                                            isolate=True, abs_error_bound=ABS_ERROR_BOUND,
                                            rel_error_bound=REL_ERROR_BOUND)[2]
    except runner.RunError as exc:
        return Verdict(False, f"could not run the modules: {exc}", time.perf_counter() - start, checked=False)
    if comparison.ok:
        return Verdict(True, comparison.summary().replace("the reference", "the original module"),
                       time.perf_counter() - start)
    first = comparison.mismatched[0].format() if comparison.mismatched else comparison.summary()
    return Verdict(False, first, time.perf_counter() - start)


def _child_env(devices: int) -> dict:
    """The user's environment without the passes (the child must compile modules as given) and
    with `devices` CPU devices."""
    from hlo_tools.xla.runner import child_env  # noqa: PLC0415

    env = {k: v for k, v in child_env().items() if not k.startswith("XLA_PASSES")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


# -- the child process ----------------------------------------------------------------------------------

def _per_device_inputs(signature, devices: int, replicated: set[int], seed: int) -> list[list[np.ndarray]]:
    """Random inputs for each parameter on each device: one value for a replicated parameter,
    one per device otherwise (integers, as `hlo_tools.xla.runner.random_inputs` makes them, so that
    sums are exact in any order)."""
    from hlo_tools.xla.runner import random_inputs  # noqa: PLC0415

    inputs = []
    for number, leaf in enumerate(signature):
        if isinstance(leaf, list):
            raise ValueError(f"parameter {number} is a tuple, which the check does not feed")
        if number in replicated:
            inputs.append(random_inputs([leaf], seed=seed * 1000 + number) * devices)
        else:
            inputs.append([random_inputs([leaf], seed=(seed * 1000 + number) * 1000 + d + 1)[0]
                           for d in range(devices)])
    return inputs


def _compare(original, rewritten, devices: int) -> tuple[bool, str]:
    from hlo_tools.xla.runner import compare_outputs  # noqa: PLC0415

    count = len(original)
    for device in range(devices):
        comparison = compare_outputs([o[device] for o in rewritten], [o[device] for o in original],
                                     ABS_ERROR_BOUND, REL_ERROR_BOUND)
        if not comparison.ok:
            first = comparison.mismatched[0]
            return False, f"output {first.index} of {count} on device {device}: {first.format()}"
    return True, (f"{count} outputs equal on {devices} devices (within {ABS_ERROR_BOUND:g} absolute or "
                  f"{REL_ERROR_BOUND:g} relative error)")


def _worker(directory: str) -> None:
    from hlo_tools.xla import xla_bridge  # noqa: PLC0415

    with open(os.path.join(directory, _JOB)) as f:
        job = json.load(f)
    protos = []
    for name in (_ORIGINAL, _REWRITTEN):
        with open(os.path.join(directory, name), "rb") as f:
            protos.append(f.read())
    replicas, partitions = job["replicas"], job["partitions"]
    count = replicas * partitions
    try:
        devices, process_index = xla_bridge.platform_devices("cpu")
        signature, _, _ = xla_bridge.program_signature(xla_bridge.module_from_proto(protos[0]))
        inputs = _per_device_inputs(signature, count, set(job["replicated"]), job["seed"])
        outputs = []
        for proto in protos:
            executable = xla_bridge.compile_optimized_module(
                proto, "cpu", devices[:count], process_index, num_replicas=replicas, num_partitions=partitions,
                stage=job["stage"])
            by_output, _ = executable.execute(inputs)
            outputs.append([[by_device[d] for d in range(count)] for by_device in by_output])
        ok, detail = _compare(outputs[0], outputs[1], count)
        result = {"ok": ok, "detail": detail}
    except (xla_bridge.XlaBridgeError, ValueError) as exc:
        result = {"ok": False, "checked": False, "detail": str(exc).splitlines()[0]}
    with open(os.path.join(directory, _RESULT), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip XLA's slow static destructors


if __name__ == "__main__":
    _worker(sys.argv[1])
