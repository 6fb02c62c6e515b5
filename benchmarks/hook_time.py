"""How long the JAX plugin's passes take inside XLA's compile of real training steps, against XLA's own compile.

Each Keras 3 application of ``--models`` (weights=None, 32x32 images, DataParallel over 8 CPU devices,
``train_on_batch``; tests/workers/real_model_worker.py) trains one step in a fresh process: plain, and with
``XLA_PASSES`` set to each pass of ``--passes``. From the plugin's log line for the training step
("changed by ... in N ms") comes the time the passes took in the hook; from the worker's step times, the
first step of the plain run, which is XLA's compile of the step (and one step). With ``--baseline DIR``
(another checkout of this repository, e.g. ``git worktree add /tmp/base <rev>``) every run is made with that
checkout's code too, the two interleaved round by round, so that the ratio of their hook times comes from
one run of this script on one machine state.

Run from the repository root: ``.venv/bin/python benchmarks/hook_time.py [--baseline DIR]``.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK_LINE = re.compile(r"xla_passes: module_\d+ jit_train_step: (?P<outcome>.*) in (?P<ms>[\d.]+) ms$", re.MULTILINE)
STEP_LINE = re.compile(r"step seconds: (?P<first>[\d.]+)")


def run(checkout: str, model: str, passes: str | None) -> tuple[float | None, float, str]:
    """(hook ms or None, first step s, outcome) of one step of `model` with `checkout`'s code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=checkout)
    if passes:
        env["XLA_PASSES"] = passes
    worker = os.path.join(checkout, "tests", "workers", "real_model_worker.py")
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([sys.executable, worker, model, os.path.join(out, "w.npz"), "--steps", "1"],
                                env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        sys.exit(f"hook_time: {model} {passes or 'plain'} failed:\n{result.stderr[-2000:]}")
    first = float(STEP_LINE.search(result.stderr)["first"])
    hook = HOOK_LINE.search(result.stderr)
    return (float(hook["ms"]) if hook else None), first, (hook["outcome"] if hook else "plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="keras-efficientnetb0,keras-resnet50")
    parser.add_argument("--passes", default="weight-update-sharding;distributed-batch-norm{group_size=2};collective-fusion",
                        help="pipelines, separated by ';'")
    parser.add_argument("--baseline", help="another checkout of this repository to compare with")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    checkouts = {"this": REPO_ROOT, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    hooks, firsts = {}, {}
    for _ in range(args.rounds):
        for model in args.models.split(","):
            firsts.setdefault(model, []).append(run(REPO_ROOT, model, None)[1])
            for passes in args.passes.split(";"):
                for name, checkout in checkouts.items():
                    ms, _, outcome = run(checkout, model, passes)
                    hooks.setdefault((model, passes, name), []).append((ms, outcome))
    header = ["model", "passes", "plain first step s"] + [f"hook ms ({name})" for name in checkouts]
    if args.baseline:
        header.append("this / baseline")
    header.append("hook / plain first step (this)")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * 2 + " ---: |" * (len(header) - 2))
    for model in args.models.split(","):
        first = statistics.median(firsts[model])
        for passes in args.passes.split(";"):
            medians = {name: statistics.median(ms for ms, _ in hooks[(model, passes, name)]) for name in checkouts}
            row = [model, f"`{passes}` ({hooks[(model, passes, 'this')][0][1]})", f"{first:.1f}"]
            row += [f"{medians[name]:.0f}" for name in checkouts]
            if args.baseline:
                row.append(f"{medians['this'] / medians['baseline']:.2f}")
            row.append(f"{medians['this'] / 1000 / first:.2f}")
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
