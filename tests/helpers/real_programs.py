"""Real HLO modules, generated at test time from JAX, Flax/optax, XLA dumps, pass hooks and TF.

Every generator returns a dict ``name -> HLO text``.  The JAX generators run in
the calling process, which must have 8 CPU devices (``tests/conftest.py`` sets
``XLA_FLAGS`` before jax is imported).  XLA reads ``XLA_FLAGS`` once per
process, so the XLA dump generator runs its program in a subprocess; the
TensorFlow generator does too, to keep TF's own copy of XLA out of the test
process.  Run this file as a script to start those workers (see ``_worker``).

jax 0.10.2 APIs used:
  * HLO before optimization: ``jit(f).lower(*args).compiler_ir("hlo").as_hlo_text()``
    and, with source-location tables and metadata,
    ``jit(f).lower(*args).as_text(dialect="hlo", debug_info=True)``.
  * HLO after optimization: ``jit(f).lower(*args).compile().as_text()``.
  * Pass hook: ``jax.extend.xla.register_hlo_module_transformation(callback, name=...,
    stage=PipelineStage.PRE_SCHEDULER, platforms="cpu")``, removed with
    ``jax.extend.xla.clear_hlo_module_transformation(name, stage, platforms="cpu")``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from hlo_tools.xla import xla_bridge
from support import xla_flags_for_tests

N_DEVICES = 8
MAX_DUMP_MODULES = 120
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # from tests/helpers/

# --- JAX programs: each builder returns (jitted function, abstract arguments) ---


def _sharded(mesh, shape, spec, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _mlp_loss(params, x, y):
    w1, w2 = params
    return jnp.mean((jnp.tanh(x @ w1) @ w2 - y) ** 2)


def shard_map_mlp_step():
    """Data-parallel MLP training step: shard_map over 8 devices, gradients averaged with pmean."""
    mesh = jax.make_mesh((N_DEVICES,), ("data",))

    def step(params, x, y):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
        grads = jax.lax.pmean(grads, "data")
        new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new_params, jax.lax.pmean(loss, "data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                               out_specs=(P(), P())))
    params = (_sharded(mesh, (16, 32), P()), _sharded(mesh, (32, 4), P()))
    return fn, (params, _sharded(mesh, (64, 16), P("data")), _sharded(mesh, (64, 4), P("data")))


def pmap_psum_step():
    """pmap-style data-parallel linear regression step, gradients summed with psum."""
    def step(w, x, y):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        grad = jax.lax.psum(grad, "batch") / N_DEVICES
        return w - 0.01 * grad, jax.lax.psum(loss, "batch")

    fn = jax.pmap(step, axis_name="batch")
    f32 = jnp.float32
    return fn, (jax.ShapeDtypeStruct((N_DEVICES, 16, 4), f32),
                jax.ShapeDtypeStruct((N_DEVICES, 32, 16), f32),
                jax.ShapeDtypeStruct((N_DEVICES, 32, 4), f32))


def jit_named_sharding_step():
    """pjit-style step: jit with NamedSharding in/out shardings on a 2x4 (data, model) mesh."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def step(w1, w2, x, y):
        loss, (g1, g2) = jax.value_and_grad(_mlp_loss)((w1, w2), x, y)
        return w1 - 0.1 * g1, w2 - 0.1 * g2, loss

    def sharding(*spec):
        return NamedSharding(mesh, P(*spec))

    fn = jax.jit(step,
                 in_shardings=(sharding(None, "model"), sharding("model", None),
                               sharding("data", None), sharding("data", None)),
                 out_shardings=(sharding(None, "model"), sharding("model", None), sharding()))
    f32 = jnp.float32
    return fn, (jax.ShapeDtypeStruct((16, 64), f32), jax.ShapeDtypeStruct((64, 8), f32),
                jax.ShapeDtypeStruct((32, 16), f32), jax.ShapeDtypeStruct((32, 8), f32))


def flax_cnn_adam_step():
    """Flax linen CNN trained with optax adam, data parallel under shard_map with pmean."""
    import flax.linen as nn
    import optax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    model = CNN()
    optimizer = optax.adam(1e-3)
    mesh = jax.make_mesh((N_DEVICES,), ("data",))

    def step(params, opt_state, images, labels):
        def loss_fn(p):
            logits = model.apply(p, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=(P(), P(), P())))
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
    opt_state = jax.eval_shape(optimizer.init, params)

    def replicated(leaf):
        return _sharded(mesh, leaf.shape, P(), leaf.dtype)

    return fn, (jax.tree.map(replicated, params), jax.tree.map(replicated, opt_state),
                _sharded(mesh, (32, 8, 8, 1), P("data")),
                _sharded(mesh, (32,), P("data"), jnp.int32))


def scan_while_program():
    """An RNN scan followed by a data-dependent while loop."""
    def program(h0, xs, w):
        def cell(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h.sum()

        h, sums = jax.lax.scan(cell, h0, xs)
        total, steps = jax.lax.while_loop(lambda s: s[0] < 1e3,
                                          lambda s: (s[0] * 2.0 + 1.0, s[1] + 1),
                                          (jnp.abs(h).sum(), 0))
        return sums, total, steps

    f32 = jnp.float32
    return jax.jit(program), (jax.ShapeDtypeStruct((4, 8), f32), jax.ShapeDtypeStruct((12, 4, 8), f32),
                              jax.ShapeDtypeStruct((8, 8), f32))


def conditional_program():
    """lax.cond on a data-dependent predicate plus a three-way lax.switch."""
    def program(x, index):
        y = jax.lax.cond(x.sum() > 0, jnp.sin, lambda v: jnp.cos(v) * 2.0, x)
        return jax.lax.switch(index, [lambda v: v + 1.0, jnp.exp, lambda v: v @ v.T], y)

    return jax.jit(program), (jax.ShapeDtypeStruct((6, 6), jnp.float32),
                              jax.ShapeDtypeStruct((), jnp.int32))


JAX_PROGRAMS: dict[str, Callable[[], tuple]] = {
    "shard_map_mlp": shard_map_mlp_step,
    "pmap_psum": pmap_psum_step,
    "jit_named_sharding_2x4": jit_named_sharding_step,
    "flax_cnn_adam": flax_cnn_adam_step,
    "scan_while": scan_while_program,
    "conditional": conditional_program,
}


def jax_programs() -> dict[str, str]:
    """For each JAX program: HLO before optimization (plain and with debug info) and after."""
    texts = {}
    for name, build in JAX_PROGRAMS.items():
        fn, args = build()
        lowered = fn.lower(*args)
        texts[f"jax.{name}.before"] = lowered.compiler_ir("hlo").as_hlo_text()
        texts[f"jax.{name}.before_debug"] = lowered.as_text(dialect="hlo", debug_info=True)
        texts[f"jax.{name}.after"] = lowered.compile().as_text()
    return texts


# --- Pass hook ----------------------------------------------------------------


@contextlib.contextmanager
def recording_pass_hook(stage_name: str = "PRE_SCHEDULER",
                        hook_name: str = "tests.record_modules") -> Iterator[list[bytes]]:
    """Register an XLA pass hook that records every module it gets and changes nothing.

    Yields the list that collects the serialized ``HloModuleProto`` bytes; the hook
    is removed on exit, so later compilations are not affected.
    """
    from jax.extend import xla as jex_xla

    stage = jex_xla.PipelineStage[stage_name]
    received: list[bytes] = []

    def record(module_proto: bytes) -> None:
        received.append(bytes(module_proto))
        return None  # None tells XLA the module is unchanged.

    jex_xla.register_hlo_module_transformation(record, name=hook_name, stage=stage, platforms="cpu")
    try:
        yield received
    finally:
        jex_xla.clear_hlo_module_transformation(hook_name, stage, platforms="cpu")


def pass_hook_programs() -> dict[str, str]:
    """Modules that XLA hands to pass hooks (pre- and post-scheduler) while compiling the shard_map step."""
    texts = {}
    for stage_name in ("PRE_SCHEDULER", "POST_SCHEDULER"):
        with recording_pass_hook(stage_name) as received:
            fn, args = shard_map_mlp_step()  # a fresh function, so XLA really compiles it
            fn.lower(*args).compile()
        if not received:
            raise RuntimeError(f"the {stage_name} pass hook was never called")
        for i, proto in enumerate(received):
            texts[f"pass_hook.{stage_name.lower()}.{i}"] = xla_bridge.hook_module_text(proto)
    return texts


# --- Subprocess generators -----------------------------------------------------


def _run_worker(kind: str, target: str, extra_xla_flags: str = "") -> None:
    """Run this file as a worker process of ``kind`` writing to ``target``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS=xla_flags_for_tests(*extra_xla_flags.split(), devices=N_DEVICES))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO_ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, os.path.abspath(__file__), kind, target],
                            env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{kind} worker failed ({result.returncode}):\n{result.stderr[-4000:]}")


def xla_dump_programs(dump_dir: str) -> dict[str, str]:
    """Every HLO module XLA dumps (``--xla_dump_to``) while running jitted programs.

    The dump holds, for the shard_map step and a small program, the module before
    and after optimization and the module between passes (``--xla_dump_hlo_pass_re=.*``).
    Dumps that are not HLO modules (buffer assignment, live ranges) are skipped, and
    so are the helper modules jax compiles on the side; at most ``MAX_DUMP_MODULES``
    modules are kept, in file-name order.
    """
    _run_worker("xla-dump", dump_dir,
                f"--xla_dump_to={dump_dir} --xla_dump_hlo_pass_re=.* "
                "--xla_dump_hlo_module_re=jit_(step|small_program)")
    texts = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.txt"))):
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
        if text.startswith("HloModule "):
            texts["xla_dump." + os.path.basename(path)[:-len(".txt")]] = text
    return dict(list(texts.items())[:MAX_DUMP_MODULES])


def tf_programs(work_dir: str) -> dict[str, str]:
    """HLO of ``tf.function(jit_compile=True)`` programs, before (``hlo``) and after (``optimized_hlo``) XLA."""
    target = os.path.join(work_dir, "tf_modules.json")
    _run_worker("tf", target)
    with open(target, encoding="utf-8") as f:
        return json.load(f)


# --- Worker entry points (run in a subprocess) -----------------------------------


def _xla_dump_worker(_dump_dir: str) -> None:
    """Run the shard_map step and a small program; XLA_FLAGS makes XLA dump them."""
    import numpy as np

    fn, args = shard_map_mlp_step()
    concrete = jax.tree.map(lambda a: jax.device_put(np.ones(a.shape, a.dtype), a.sharding), args)
    jax.block_until_ready(fn(*concrete))

    def small_program(x, y):
        return jnp.tanh(x @ y).sum(axis=0)

    small_program = jax.jit(small_program)
    jax.block_until_ready(small_program(jnp.ones((4, 4)), jnp.ones((4, 4))))


def _tf_worker(target: str) -> None:
    """Write the HLO of two TF XLA functions, before and after optimization, as JSON."""
    import tensorflow as tf

    w = tf.Variable(tf.random.stateless_normal([16, 8], seed=[1, 2]), name="w")
    b = tf.Variable(tf.zeros([8]), name="b")

    @tf.function(jit_compile=True)
    def dense_train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.nn.relu(tf.matmul(x, w) + b) - y))
        grad_w, grad_b = tape.gradient(loss, [w, b])
        w.assign_sub(0.1 * grad_w)
        b.assign_sub(0.1 * grad_b)
        return loss

    kernel = tf.random.stateless_normal([3, 3, 3, 8], seed=[3, 4])
    dense = tf.random.stateless_normal([4 * 4 * 8, 10], seed=[5, 6])

    @tf.function(jit_compile=True)
    def conv_net_forward(images):
        x = tf.nn.relu(tf.nn.conv2d(images, kernel, strides=1, padding="SAME"))
        x = tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")
        return tf.nn.softmax(tf.matmul(tf.reshape(x, [-1, 4 * 4 * 8]), dense))

    programs = {
        "dense_train_step": (dense_train_step, (tf.ones([32, 16]), tf.ones([32, 8]))),
        "conv_net_forward": (conv_net_forward, (tf.ones([4, 8, 8, 3]),)),
    }
    texts = {}
    for name, (fn, args) in programs.items():
        compiler_ir = fn.experimental_get_compiler_ir(*args)
        for stage in ("hlo", "optimized_hlo"):
            texts[f"tf.{name}.{stage}"] = compiler_ir(stage=stage)
    with open(target, "w", encoding="utf-8") as f:
        json.dump(texts, f)


_WORKERS = {"xla-dump": _xla_dump_worker, "tf": _tf_worker}


def _worker(argv: list[str]) -> None:
    kind, target = argv
    _WORKERS[kind](target)


if __name__ == "__main__":
    _worker(sys.argv[1:])
