"""What each pass changes on Keras 3 models: keras.applications ResNet50 and EfficientNetB0.

Two parts, each in its own child process because Keras 3 picks its backend when it is imported:

jax (KERAS_BACKEND=jax, 8 CPU devices): the model (weights=None, ``--image-size`` square
   images, 10 classes) under ``keras.distribution.DataParallel`` over the 8 devices, compiled
   with adam and sparse categorical cross-entropy. Its training step is Keras's own: the jit
   of ``model.train_step`` with ``donate_argnums=0`` and the variables' shardings as output
   shardings, exactly as ``make_train_function`` builds it, on the state and batch
   ``train_on_batch`` passes it (the batch split over the devices by the distribution). It is
   compiled four times at XLA's defaults (its all-reduce combiner on): plain, with
   ``collective-fusion``, with ``weight-update-sharding`` and with
   ``distributed-batch-norm{group_size=2}`` (whose numbers differ from plain's by design), the passes run by the JAX
   plugin inside XLA's compile (``xla_passes.jax.enable(..., strict=True)``, what
   ``XLA_PASSES=...`` does). For each: the losses of ``--steps`` steps from the same initial
   state and the largest difference of every final variable (weights, BatchNorm statistics,
   adam state) to plain's; the collectives of the compiled step (count and the bytes each
   moves on one device, as ``hlo-tools stats`` counts them); XLA's per-device flops, bytes
   accessed, temp and peak memory of the compiled step; and the median step time over
   interleaved rounds: each round runs every configuration for ``--steps`` steps in turn, on
   one chain of training state (each configuration continues from the state the one before
   left), the first round not counted. One more program is only compiled: plain through a pass
   hook that hands XLA's module back unchanged, which shows what the hook alone does to
   memory (XLA of jaxlib 0.10.2 drops the buffer donation of every module a hook hands back).

tensorflow (KERAS_BACKEND=tensorflow): ResNet50, EfficientNetB0 and MobileNetV2 (weights=None,
   ``--tf-image-size`` images, batch 2), forward (inference) and training gradients (loss and
   every trainable variable's gradient, BatchNorm in training mode, dropout rates set to 0),
   through ``xla_passes.tensorflow.function(step, passes=SPATIAL)`` on 4 devices against TF's
   own ``tf.function(jit_compile=True)`` (tests/models/test_keras_spatial_models.py's ``measure``):
   convolutions split by the pass, collectives of the rewritten module, the largest
   difference to TF's output relative to each output's own scale, the same for the float
   noise (how far TF's eager step and the front end without passes, TF's module compiled by
   jaxlib's XLA, are from TF's XLA step), the largest ratio of difference to noise over the
   outputs, and the median step time of TF, of the front end without passes
   (TF's module on 1 device) and of the front end with the pass, timed in interleaved rounds.

Run from the repository root: ``.venv/bin/python benchmarks/keras_models.py`` (both parts;
``--part jax`` or ``--part tensorflow`` for one).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 8
# The models and optimizers of tests/models/test_real_models.py's Keras runs (LAMB: per-layer trust ratios).
JAX_MODELS = {"ResNet50": "adam", "EfficientNetB0": "momentum", "MobileNetV3Small": "lamb", "ConvNeXtTiny": "lamb"}
OPTIMIZERS = {"adam": lambda keras: keras.optimizers.Adam(1e-3),
              "momentum": lambda keras: keras.optimizers.SGD(0.01, momentum=0.9),
              "lamb": lambda keras: keras.optimizers.Lamb(1e-3)}
WUS = "weight-update-sharding"
WUS_THRESHOLD_BYTES = 1024  # the pass's default threshold_bytes: smaller gradients stay replicated
# "weight-update-sharding: sharded %all-reduce.5[3] f32[3,3,16,1] (state[0][5], state[2][10]) over 8 ..."
WUS_REPORT_LINE = re.compile(r"weight-update-sharding: (?P<verdict>sharded|kept) \S+ \S+ \((?P<names>[^)]*)\)"
                             r"(?:.*?: (?P<reason>.*))?$")
TRAINABLE = re.compile(r"^state\[0\]\[(\d+)\]$")  # train_step(state, data): state[0] holds the trainable variables
TF_MODELS = ("ResNet50", "EfficientNetB0", "MobileNetV2")
JAX_CONFIGS = {"plain": None, "collective-fusion": "collective-fusion",
               "weight-update-sharding": "weight-update-sharding",
               # changes the numbers on purpose (statistics over pairs of devices): its difference to
               # plain is the grouping's; tests/models/test_distributed_batch_norm_keras.py checks it against its reference
               "distributed-batch-norm{group_size=2}": "distributed-batch-norm{group_size=2}",
               # the same, with the regrouped all-reduces combined (the pass leaves one per statistic)
               "distributed-batch-norm{group_size=2},collective-fusion":
                   "distributed-batch-norm{group_size=2},collective-fusion"}
# --xla-combiner-off: XLA's own all-reduce combiners switched off (xla_passes_demo.training.NO_XLA_COMBINER)
COMBINER_OFF_CONFIGS = {"plain, XLA's combiner off": None, "collective-fusion, XLA's combiner off": "collective-fusion"}
SPATIAL = "spatial-partitioning{num_partitions=4,split=0:1}"
# plain through a pass hook that hands XLA's module back unchanged (what the hook alone does to
# memory and time: jaxlib 0.10.2 drops the donation of every module a hook hands back)
HAND_BACK = "plain through a hook that hands the module back unchanged"
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute")
BATCH_PER_DEVICE = 2
CLASSES = 10


def optimizer_of(model: str) -> str:
    return JAX_MODELS.get(model, "adam")


def ratio(x: float, y: float) -> str:
    return f"{x / y:.3f}" if y else "-"


# --- the JAX part -----------------------------------------------------------------------------------------

def collectives_of(hlo_text: str) -> dict[str, tuple[int, int]]:
    """(count, bytes moved on one device) of each collective kind of a compiled module."""
    import hlo_tools  # noqa: PLC0415
    from hlo_tools.inspection.stats import module_stats  # noqa: PLC0415

    summary = module_stats(hlo_tools.parse_module(hlo_text)).collective_summary()
    found = {s.kind: (s.count, s.bytes_moved) for s in summary}
    return {kind: found.get(kind, (0, 0)) for kind in COLLECTIVES}


def ring_bytes(collectives: dict[str, tuple[int, int]]) -> float:
    """Bytes a ring implementation sends per device: 2(N-1)/N of an all-reduced array, (N-1)/N of a
    reduce-scattered or all-gathered one."""
    share = (N - 1) / N
    return share * (2 * collectives["all-reduce"][1] + collectives["reduce-scatter"][1]
                    + collectives["all-gather"][1])


@contextlib.contextmanager
def wus_report():
    """The lines weight-update-sharding logs (one per all-reduced value: sharded, or kept and why)."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("xla_passes")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def wus_coverage(lines: list[str], trainable_bytes: list[int]) -> dict:
    """Trainable variables whose update weight-update-sharding sharded, of those eligible (gradient
    of at least WUS_THRESHOLD_BYTES), and why the other eligible ones were kept."""
    sharded, reasons = set(), collections.defaultdict(set)
    for line in lines:
        if not (found := WUS_REPORT_LINE.search(line)):
            continue
        indices = {int(m[1]) for name in found["names"].split(", ") if (m := TRAINABLE.match(name))}
        if found["verdict"] == "sharded":
            sharded |= indices
        else:
            for index in indices:
                reasons[index].add(re.sub(r"%[\w.-]+", "%x", found["reason"] or ""))
    eligible = {i for i, size in enumerate(trainable_bytes) if size >= WUS_THRESHOLD_BYTES}
    kept = collections.Counter(reason for i in eligible - sharded for reason in reasons.get(i, {"not reported"}))
    return {"sharded": len(sharded & eligible), "eligible": len(eligible), "kept": kept}


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` under `shardings`."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    return sum(int(np.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
               for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def jax_model(name: str, image_size: int, steps: int, rounds: int, combiner_off: bool,
              labels: list[str] | None = None) -> dict:
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from keras.src.backend.jax.trainer import _distribute_data  # noqa: PLC0415 - what train_on_batch calls

    from xla_passes_demo.training import NO_XLA_COMBINER, compile_step, compiled_costs, hand_back_hook  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    model = getattr(keras.applications, name)(weights=None, input_shape=(image_size, image_size, 3),
                                              classes=CLASSES)
    model.compile(optimizer=OPTIMIZERS[optimizer_of(name)](keras), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    batches = [_distribute_data((rng.standard_normal((N * BATCH_PER_DEVICE, image_size, image_size, 3),
                                                     dtype=np.float32),
                                 rng.integers(0, CLASSES, N * BATCH_PER_DEVICE).astype(np.int32), None))
               for _ in range(steps)]
    model._symbolic_build(data_batch=batches[0])
    shardings = model._get_state_sharding_spec()
    # make_train_function's jit of the training step
    train_step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, shardings))

    def initial_state():
        state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                     optimizer_variables=True, metrics_variables=True)
        return jax.tree.map(lambda leaf: leaf.copy(), state)   # the step donates it

    host_start = jax.tree.map(np.asarray, initial_state())
    fresh_metrics = host_start[3]  # the loss tracker: zeroed every step, so that logs["loss"] is the step's loss

    def with_fresh_metrics(state):
        return (*state[:3], jax.tree.map(lambda v, s: jax.device_put(v, s), fresh_metrics, shardings[3]))

    runs = {}
    configs = [(label, passes, None) for label, passes in JAX_CONFIGS.items()
               if not labels or label == "plain" or label in labels]
    if combiner_off:
        configs += [(label, passes, NO_XLA_COMBINER) for label, passes in COMBINER_OFF_CONFIGS.items()]
    configs.append((HAND_BACK, HAND_BACK, None))
    for label, passes, options in configs:
        print(f"  {name}: compiling {label}", file=sys.stderr, flush=True)
        with wus_report() as lines:
            if passes == HAND_BACK:
                with hand_back_hook():
                    compiled, seconds = compile_step(train_step, (initial_state(), batches[0]), None)
            else:
                compiled, seconds = compile_step(train_step, (initial_state(), batches[0]), passes,
                                                 strict=passes is not None, compiler_options=options)
        cost = compiled_costs(compiled)
        state_shardings = compiled.input_shardings[0][0][2]  # (state, data) -> state's optimizer variables
        coverage = (wus_coverage(lines, [leaf.nbytes for leaf in host_start[0]])
                    if passes is not None and WUS in passes else None)
        collectives = collectives_of(compiled.as_text())
        runs[label] = {"compiled": compiled, "compile_s": seconds, **cost,
                       "peak": compiled.memory_analysis().peak_memory_in_bytes,
                       "collectives": collectives, "ring": ring_bytes(collectives), "seconds": [],
                       "optimizer_state": per_device_bytes(host_start[2], state_shardings), "coverage": coverage}

    # Numbers: `steps` steps of each configuration from the same initial state.
    finals = {}
    for label, run in runs.items():
        state, losses = initial_state(), []
        for batch in batches:
            logs, state = run["compiled"](with_fresh_metrics(state), batch)
            losses.append(float(logs["loss"]))
        run["losses"] = losses
        finals[label] = [np.asarray(leaf) for leaf in jax.tree.leaves(state[:3])]
        del state
    for label, run in runs.items():
        diffs = [float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0))
                 for a, b in zip(finals[label], finals["plain"])]
        scales = [float(np.max(np.abs(b), initial=0.0)) for b in finals["plain"]]
        run["max_abs"] = max(diffs)
        run["max_rel"] = max(d / s for d, s in zip(diffs, scales) if s)
    del finals

    # Time: interleaved rounds on one chain of state.
    state = initial_state()
    for round_index in range(rounds + 1):
        for run in runs.values():
            for batch in batches:
                start = time.perf_counter()
                logs, state = run["compiled"](with_fresh_metrics(state), batch)
                jax.block_until_ready((logs, state))
                if round_index:
                    run["seconds"].append(time.perf_counter() - start)
    del state
    for run in runs.values():
        run["median_s"] = statistics.median(run["seconds"])
        del run["compiled"]
    return runs



def print_jax_tables(results: dict[str, dict], args) -> None:
    print(f"Keras 3 (JAX backend), DataParallel over {N} CPU devices, {args.image_size}x{args.image_size}x3 images, "
          f"{CLASSES} classes, batch {BATCH_PER_DEVICE} per device, optimizers "
          f"{', '.join(f'{model} {optimizer_of(model)}' for model in results)}; "
          f"{args.steps} steps from the same state; "
          f"time: median of {args.rounds} interleaved rounds x {args.steps} steps (one more round warms up)")
    print()
    print("| model | configuration | losses | max abs diff of final variables vs plain | / scale | "
          "flops (G) | vs plain | bytes accessed (MB) | vs plain | temp (MB) | vs plain | peak (MB) | vs plain "
          "| median step (ms) | vs plain |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, runs in results.items():
        plain = runs["plain"]
        for label, r in runs.items():
            losses = " ".join(f"{loss:.6f}" for loss in r["losses"])
            line = (f"| {model} | {label} | {losses} | {r['max_abs']:.3g} | {r['max_rel']:.3g} | "
                    f"{r['flops'] / 1e9:.3f} | {ratio(r['flops'], plain['flops'])} | "
                    f"{r['bytes accessed'] / 1e6:.1f} | {ratio(r['bytes accessed'], plain['bytes accessed'])} | "
                    f"{r['temp'] / 1e6:.1f} | {ratio(r['temp'], plain['temp'])} | "
                    f"{r['peak'] / 1e6:.1f} | {ratio(r['peak'], plain['peak'])} | "
                    f"{1e3 * r['median_s']:.1f} | {ratio(r['median_s'], plain['median_s'])} |")
            print(line.replace("nan", "-"))
    print()
    print("Collectives of the compiled training step: count / MB moved per device")
    print()
    print("| model | configuration | " + " | ".join(COLLECTIVES[:3])
          + " | ring MB sent per device | vs plain | compile (s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, runs in results.items():
        for label, r in runs.items():
            cells = " | ".join(f"{r['collectives'][kind][0]} / {r['collectives'][kind][1] / 1e6:.2f}"
                               for kind in COLLECTIVES[:3])
            print(f"| {model} | {label} | {cells} | {r['ring'] / 1e6:.2f} | {ratio(r['ring'], runs['plain']['ring'])} "
                  f"| {r['compile_s']:.1f} |")
    coverage = {model: runs for model, runs in results.items() if any(r["coverage"] for r in runs.values())}
    if not coverage:
        return
    print()
    print(f"weight-update-sharding coverage: trainable variables whose update it sharded, of those whose gradient "
          f"has at least threshold_bytes={WUS_THRESHOLD_BYTES}; optimizer state held per device; why the others "
          f"were kept")
    print()
    print("| model | optimizer | configuration | sharded / eligible | optimizer state MB per device | vs plain "
          "| peak vs plain | step vs plain | kept |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for model, runs in coverage.items():
        plain = runs["plain"]
        for label, r in runs.items():
            if not (c := r["coverage"]):
                continue
            kept = "; ".join(f"{count} x {reason}" for reason, count in c["kept"].most_common()) or "-"
            print(f"| {model} | {optimizer_of(model)} | {label} | {c['sharded']} / {c['eligible']} | "
                  f"{r['optimizer_state'] / 1e6:.2f} | {ratio(r['optimizer_state'], plain['optimizer_state'])} | "
                  f"{ratio(r['peak'], plain['peak'])} | {ratio(r['median_s'], plain['median_s'])} | {kept} |")


def jax_part(args) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    from xla_passes_demo.training import use_cpu_devices  # noqa: PLC0415

    if not use_cpu_devices(N):
        raise SystemExit("JAX started before the device count could be set")
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415

    assert keras.backend.backend() == "jax" and jax.device_count() == N
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, jax {jax.__version__}, "
          f"keras {keras.__version__}")
    results = {}
    for name in args.models or list(JAX_MODELS):
        start = time.perf_counter()
        results[name] = jax_model(name, args.image_size, args.steps, args.rounds, args.xla_combiner_off,
                                  args.configs)
        print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print_jax_tables(results, args)


# --- the TensorFlow part ----------------------------------------------------------------------------------

def tf_part(args) -> None:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    # tests/models/test_keras_spatial_models.py imports tests/helpers/support.py.
    sys.path[:0] = [os.path.join(REPO_ROOT, "tests", "models"), os.path.join(REPO_ROOT, "tests", "helpers")]
    from test_keras_spatial_models import measure  # noqa: PLC0415

    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print(f"Keras 3 (TF backend), {args.tf_image_size}x{args.tf_image_size}x3 images, batch 2, {CLASSES} classes; "
          f"{SPATIAL} on 4 CPU devices; time: median of {args.tf_rounds} interleaved rounds x "
          f"{args.tf_steps} calls (one more round warms up)")
    print()
    print("| model | step | convolutions split | collectives (permute / all-gather / all-reduce) | "
          "diff / scale | noise / scale | diff / noise | TF (ms) | front end, no passes (ms) "
          "| front end + pass (ms) | vs TF | vs no passes |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.tf_models or TF_MODELS:
        for what in ("forward", "gradient"):
            start = time.perf_counter()
            r = measure(name, what, image_size=args.tf_image_size, rounds=args.tf_rounds, steps=args.tf_steps)
            print(f"  {name} {what}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            c = r["collectives"]
            print(f"| {name} | {what} | {r['split']} of {r['convolutions']} ({r['splittable']} with rows to split) | "
                  f"{c['collective-permute']} / {c['all-gather']} / {c['all-reduce']} | "
                  f"{r['max_relative_diff']:.2g} | {r['noise_relative_diff']:.2g} | {r['max_over_noise']:.2f} | "
                  f"{r['tf_ms']:.1f} | {r['plain_ms']:.1f} | {r['ours_ms']:.1f} | "
                  f"{ratio(r['ours_ms'], r['tf_ms'])} | {ratio(r['ours_ms'], r['plain_ms'])} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "jax", "tensorflow"), default="all")
    parser.add_argument("--models", nargs="*", help=f"JAX part: models of keras.applications (default {', '.join(JAX_MODELS)}; "
                        f"optimizers {JAX_MODELS}, adam for others)")
    parser.add_argument("--image-size", type=int, default=32, help="JAX part: image height and width")
    parser.add_argument("--steps", type=int, default=3, help="JAX part: steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="JAX part: counted rounds")
    parser.add_argument("--configs", nargs="*", choices=list(JAX_CONFIGS),
                        help="JAX part: these configurations only, besides plain (default: all)")
    parser.add_argument("--xla-combiner-off", action="store_true",
                        help="JAX part: also plain and collective-fusion with XLA's all-reduce combiners off")
    parser.add_argument("--tf-models", nargs="*", help=f"TF part: models (default {TF_MODELS})")
    parser.add_argument("--tf-image-size", type=int, default=64)
    parser.add_argument("--tf-steps", type=int, default=3, help="TF part: calls per configuration and round")
    parser.add_argument("--tf-rounds", type=int, default=3, help="TF part: counted rounds")
    args, _ = parser.parse_known_args(argv)
    if args.part == "jax":
        return jax_part(args)
    if args.part == "tensorflow":
        return tf_part(args)
    argv = sys.argv[1:] if argv is None else list(argv)
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    for part, env in (("jax", {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
                               "XLA_FLAGS": f"--xla_force_host_platform_device_count={N}"}),
                      ("tensorflow", {"KERAS_BACKEND": "tensorflow", "JAX_PLATFORMS": "cpu"})):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--part", part],
                              env={**base, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join(
                                  filter(None, [REPO_ROOT, base.get("PYTHONPATH")])), **env})
        print(f"({part} part: {time.perf_counter() - start:.0f} s)\n", flush=True)
        if done.returncode:
            raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
