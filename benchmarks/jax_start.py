"""What the installed plugin costs a JAX program that does not ask for passes: `import jax; jax.devices()`.

JAX imports `xla_passes.frontends.jax_plugin` in every process that starts a backend. Each round starts
a fresh Python for every checkout (this one, and `--baseline DIR`'s), interleaved, with that checkout first
on PYTHONPATH and no XLA_PASSES, and times `import jax; jax.devices()` inside it; the medians are printed.
DIR can also be any directory of packages to put first instead, such as other versions of JAX's
dependencies (`pip install --no-deps --target DIR ml_dtypes==0.7.0`) against the installed ones.

    python benchmarks/jax_start.py --baseline /path/to/another/checkout [--rounds 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = "import time; t = time.perf_counter(); import jax; jax.devices(); print(time.perf_counter() - t)"


def start_seconds(checkout: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PASSES")}
    env.update(PYTHONPATH=checkout, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(checkout))
    return float(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="another checkout of this repository, or a directory of other package "
                                           "versions, to put first on PYTHONPATH and compare with")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    checkouts = {"this checkout": REPO_ROOT, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    seconds = {name: [] for name in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            seconds[name].append(start_seconds(path))
    for name, values in seconds.items():
        print(f"{name}: import jax; jax.devices() median {1e3 * statistics.median(values):.0f} ms "
              f"over {args.rounds} processes")


if __name__ == "__main__":
    main()
