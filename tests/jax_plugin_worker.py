"""Worker processes for tests/test_jax_plugin.py (benchmarks/plugin.py reuses its Flax model).

JAX reads `XLA_PASSES` (and XLA reads `XLA_FLAGS`) once, when its backend
starts, so each configuration runs in a fresh process:

    python tests/jax_plugin_worker.py SCENARIO [--test-passes] [--log-info]

prints one line of JSON (the scenario's report) as the last line of stdout.
The scenarios are ordinary, unmodified JAX programs: nothing here imports
`xla_passes` unless `--test-passes` asks for the test passes below (which a
real user's program would not have) or an absl-* scenario imports
`xla_passes.flags` (as an absl program using the flag would).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading

import numpy as np

N_DEVICES = 8


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
    adapter = sys.modules.get("xla_passes.jax")
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


MLP_WIDTHS = (256, 256, 256, 256, 256, 256, 128, 10)


def build_flax_training(widths: tuple[int, ...] = MLP_WIDTHS, *, optimizer=None,
                        pmean_each_gradient: bool = True, check_vma: bool = False,
                        donate: bool = True, batch_per_device: int = 32):
    """A Flax MLP (Dense layers of `widths`) trained data parallel over 8 CPU devices.

    The step is shard_map under jit, with optax adam(1e-3) unless `optimizer`
    is given. By default each gradient is averaged with its own `lax.pmean` (a
    `pmean` of the whole tree, `pmean_each_gradient=False`, would already be one
    variadic all-reduce): one all-reduce per parameter, 16 for the default 8
    layers, plus one for the loss, unless a combiner merges them.
    `check_vma=False` keeps shard_map from adding its own reductions of the
    replicated parameters' gradients.

    Returns `(step, (params, opt_state, images, labels))`; `step` (donating the
    parameters and optimizer state when `donate`) returns new ones and the loss.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in widths[:-1]:
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(widths[-1])(x)

    model = MLP()
    optimizer = optimizer or optax.adam(1e-3)
    mesh = jax.make_mesh((N_DEVICES,), ("data",))

    def train_step(params, opt_state, images, labels):
        def loss_fn(p):
            logits = model.apply(p, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = (jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads) if pmean_each_gradient
                 else jax.lax.pmean(grads, "data"))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                 out_specs=(P(), P(), P()), check_vma=check_vma),
                   donate_argnums=(0, 1) if donate else ())

    @jax.jit
    def init(key):
        params = model.init(key, jnp.zeros((1, 64)))
        return params, optimizer.init(params)

    params, opt_state = jax.device_put(init(jax.random.key(0)), NamedSharding(mesh, P()))
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P("data"))
    images = jax.device_put(rng.standard_normal((N_DEVICES * batch_per_device, 64), dtype=np.float32), batch)
    labels = jax.device_put(rng.integers(0, widths[-1], N_DEVICES * batch_per_device).astype(np.int32), batch)
    return step, (params, opt_state, images, labels)


def flax_training(steps: int) -> dict:
    """The losses of `steps` training steps of `build_flax_training`'s model."""
    step, (params, opt_state, images, labels) = build_flax_training()
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, images, labels)
        losses.append(float(loss))
    return {"losses": losses}


def flax_scenario() -> dict:
    return flax_training(steps=5)


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


SCENARIOS = {"program": program_scenario, "threads": threads_scenario, "flax": flax_scenario}
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
