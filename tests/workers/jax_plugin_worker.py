"""Worker processes for tests/frontends/test_jax_plugin.py.

JAX reads `XLA_PASSES` (and XLA reads `XLA_FLAGS`) once, when its backend
starts, so each configuration runs in a fresh process:

    python tests/workers/jax_plugin_worker.py SCENARIO [--test-passes] [--log-info]

prints one line of JSON (the scenario's report) as the last line of stdout.
The scenarios are ordinary, unmodified JAX programs: nothing here imports
`xla_passes` unless `--test-passes` asks for the test passes below (which a
real user's program would not have), an absl-* scenario imports
`xla_passes.flags` (as an absl program using the flag would) or the flax
scenario takes its model from `xla_passes_demo.training` (which switches nothing on).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

import numpy as np


def register_test_passes() -> None:
    """Passes that exist only in these tests: one that changes every module harmlessly, one that fails."""
    from xla_passes import HloPass, register_pass

    @register_pass
    class CopyRoot(HloPass):
        """Make the entry's array root a copy of itself: same values, a module XLA must accept anew."""

        name = "test-copy-root"

        def run(self, module) -> bool:
            root = module.entry.root
            if root.shape.is_tuple or root.opcode == "copy":
                return False
            module.entry.set_root(module.entry.add_instruction("copy", [root], root.shape))
            return True

    @register_pass
    class Explode(HloPass):
        """Fail on the module of `program` (the scenarios' jitted function), pass others through."""

        name = "test-explode"

        def run(self, module) -> bool:
            if "program" in module.name:
                raise RuntimeError("deliberate failure in a test pass")
            return False


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((8, 16), dtype=np.float32), rng.standard_normal((16, 4), dtype=np.float32)


def _expected(x, y):
    return np.tanh(x @ y).sum(axis=0) + 1.0


def program_scenario() -> dict:
    """One jitted function, run once: its result and whether xla_passes was switched on."""
    import jax
    import jax.numpy as jnp

    def program(x, y):
        return jnp.tanh(x @ y).sum(axis=0) + 1.0

    x, y = _inputs()
    result = np.asarray(jax.jit(program)(x, y))
    adapter = sys.modules.get("xla_passes.frontends.jax")
    return {"correct": bool(np.allclose(result, _expected(x, y), atol=1e-5)),
            "adapter_imported": adapter is not None,
            "enabled": None if adapter is None or adapter.enabled() is None else adapter.enabled().passes}


def threads_scenario(threads: int = 8) -> dict:
    """Compile `threads` different jitted functions at the same time, one per Python thread."""
    import jax
    import jax.numpy as jnp

    x, y = _inputs()
    barrier = threading.Barrier(threads)
    results, errors = {}, []

    def compile_and_run(k: int) -> None:
        def program(a, b):
            return jnp.tanh(a @ b).sum(axis=0) + float(k)

        try:
            compiled = jax.jit(program).lower(x, y)
            barrier.wait()
            results[k] = np.asarray(compiled.compile()(x, y))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=compile_and_run, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    expected = np.tanh(x @ y).sum(axis=0)
    correct = [bool(np.allclose(results[k], expected + k, atol=1e-5)) for k in sorted(results)]
    return {"correct": correct, "errors": errors}


def flax_training(steps: int) -> dict:
    """The losses of `steps` training steps of `build_flax_training`'s model."""
    from xla_passes_demo.training import build_flax_training

    step, (params, opt_state, images, labels) = build_flax_training()
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, images, labels)
        losses.append(float(loss))
    return {"losses": losses}


def flax_scenario() -> dict:
    return flax_training(steps=5)


def momentum_scenario() -> dict:
    """One compile of a data-parallel momentum step: weights and momentum replicated, the batch
    split over the devices, weights big enough for weight-update-sharding to shard them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))

    def step(w, m, x):
        grad = jax.grad(lambda w: jnp.sum(jnp.einsum("b...,...->...", x, w) ** 2))(w)
        m = 0.9 * m + grad
        return w - 0.01 * m, m

    rng = np.random.default_rng(0)
    w, m = (rng.standard_normal((32, 16), dtype=np.float32) for _ in range(2))
    x = rng.standard_normal((len(jax.devices()), 32, 16), dtype=np.float32)
    new_w, _ = jax.jit(step, in_shardings=(replicated, replicated, batch), out_shardings=(replicated, replicated))(w, m, x)
    return {"weight_sum": float(np.asarray(new_w).sum())}


def psums_scenario() -> dict:
    """One compile of a shard_map step with two psums: how many all-reduces the executable JAX
    runs has (a combiner at the hook leaves one), and whether it computes the sums."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def step(a, b):
        return jax.lax.psum(a * 2.0, "data"), jax.lax.psum(jnp.tanh(b), "data")

    shards = len(jax.devices())
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((shards, 4), dtype=np.float32), rng.standard_normal((shards, 8), dtype=np.float32)
    compiled = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=PartitionSpec("data"),
                                     out_specs=PartitionSpec())).lower(a, b).compile()
    sum_a, sum_b = compiled(a, b)
    correct = np.allclose(sum_a, 2.0 * a.sum(axis=0, keepdims=True), atol=1e-5) and \
        np.allclose(sum_b, np.tanh(b).sum(axis=0, keepdims=True), atol=1e-5)
    return {"all_reduces": compiled.as_text().count(" all-reduce("), "correct": bool(correct)}


def absl_app(absl_argv: list[str], import_jax_first: bool) -> None:
    """An absl program that imports `xla_passes.flags` and runs `program_scenario` in main.

    Flax examples import JAX at the top, before absl parses flags; other
    programs import it only in main, after.
    """
    from absl import app

    import xla_passes.flags  # noqa: F401 - defines --xla_passes and friends

    if import_jax_first:
        import jax  # noqa: F401

    def main(argv):
        del argv
        print(json.dumps(program_scenario()))

    app.run(main, argv=absl_argv)


SCENARIOS = {"program": program_scenario, "threads": threads_scenario, "flax": flax_scenario,
             "momentum": momentum_scenario, "psums": psums_scenario}
ABSL_SCENARIOS = {"absl-jax-imported-first": True, "absl-jax-imported-in-main": False}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(epilog="Arguments after the scenario go to absl in the absl-* scenarios.")
    parser.add_argument("scenario", choices=sorted(SCENARIOS) + sorted(ABSL_SCENARIOS))
    parser.add_argument("--test-passes", action="store_true", help="register the test passes first")
    parser.add_argument("--log-info", action="store_true", help="show the 'xla_passes' logger's INFO lines")
    args, absl_args = parser.parse_known_args(argv)
    if args.log_info:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        logging.getLogger("xla_passes").addHandler(handler)
        logging.getLogger("xla_passes").setLevel(logging.INFO)
    if args.test_passes:
        register_test_passes()
    if args.scenario in ABSL_SCENARIOS:
        absl_app([args.scenario] + absl_args, import_jax_first=ABSL_SCENARIOS[args.scenario])
    else:
        print(json.dumps(SCENARIOS[args.scenario]()))


if __name__ == "__main__":
    main(sys.argv[1:])
