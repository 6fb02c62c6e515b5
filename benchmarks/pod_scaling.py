"""Pod-scale estimates: what each collective pass is worth from 8 to 4096 chips (the cost model).

Two data-parallel training steps at the seeds' sizes, from `xla_passes_demo.models`: ResNet-50
(25.6M parameters, 161 arrays; 32 images of 224x224 per chip) and a BERT-large-sized
Transformer encoder (365M parameters, 390 arrays; 8 sequences of 512 tokens per chip), adam,
f32 gradients. Nothing is run at that size: JAX lowers each step at one chip's batch and XLA's
cost analysis of the lowered program gives its flops, and the parameter shapes give the bytes.

For each torus:RxC (2x4 to 64x64), with no failed chip and with one failed chip in the middle,
the cost model (`hlo_tools.inspection.cost_model`, docs/cost_model.md; TPU v3 chips by default) prices:

  plain             one all-reduce per gradient (XLA with its combiner off), each with the
                    fastest algorithm the model knows for it on that topology (a topology-
                    aware runtime's choice): the baseline of the ratios
  plain, 1-D ring   the same all-reduces as one 1-D ring each (a runtime that only has rings)
  collective-fusion the gradients in one all-reduce, a 1-D ring
  all-reduce-2d     that all-reduce as reduce-scatter in rows, all-reduce in columns,
                    all-gather in rows (with failed chips: `all-reduce-2d{failed=...}`'s
                    pipelined tree over physical links, or the 2-D form around the hole,
                    whichever the model finds faster)
  all-reduce-rings  that all-reduce as 4 concurrent rings over disjoint links (2 on a
                    2-row torus; no rings around failed chips)
  weight-update-sharding  reduce-scatter + all-gather in the 2-D form, and each chip
                    updates 1/N of the weights

A step is compute (gradients, on the chip's roofline: flops over peak), the update (adam reads
weights, gradient and two moments and writes three: 28 bytes per parameter over HBM bandwidth,
or its flops, whichever is longer) and the gradient summation, without overlap (the model's
limit, docs/cost_model.md). Every pass that the table prices is also run on this machine by the
tests (differential execution on 8-16 CPU devices); this benchmark prices what their output is
worth where they exist for.

Run from the repository root:
``.venv/bin/python benchmarks/pod_scaling.py [--chip tpu-v3] [--svg-dir docs]``.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time

from hlo_tools import cli
from hlo_tools.inspection import cost_model, plot
from hlo_tools.inspection.topology import Topology

TORI = ((2, 4), (8, 8), (16, 16), (32, 32), (64, 64))
VARIANTS = ("plain", "plain, 1-D ring", "collective-fusion", "all-reduce-2d", "all-reduce-rings", "weight-update-sharding")
ADAM_BYTES_PER_PARAMETER = 28  # f32: read weight, gradient, two moments; write weight, two moments


def _model_numbers(spec, batch: int) -> dict:
    from xla_passes_demo import models  # JAX only here: the pricing needs none

    shapes = models.parameter_shapes(spec)
    flops = models.step_flops(spec, batch)
    return {"name": spec.name, "batch": batch, "gradient_bytes": [4 * math.prod(shape) for _, shape in shapes],
            "parameters": sum(math.prod(shape) for _, shape in shapes), **flops}


def _summation(variant: str, sizes: list[int], topology: Topology, chip: cost_model.Chip) -> float | None:
    """Seconds to sum the gradients of `sizes` bytes over every chip, as `variant` does."""
    everyone = [list(range(topology.num_devices))]
    total = float(sum(sizes))
    if variant in ("plain", "plain, 1-D ring"):
        algorithms = {"ring"} if variant == "plain, 1-D ring" else None
        return sum(count * cost_model.plan_collective("all-reduce", size, everyone, topology, chip,
                                                      algorithms=algorithms).time_s
                   for size, count in collections.Counter(sizes).items())
    if variant == "collective-fusion":
        return cost_model.plan_collective("all-reduce", total, everyone, topology, chip, algorithms={"ring"}).time_s
    if variant == "all-reduce-2d":
        allowed = {"2-D", "tree"} if topology.failed else {"2-D"}
        return cost_model.plan_collective("all-reduce", total, everyone, topology, chip, algorithms=allowed).time_s
    if variant == "all-reduce-rings":
        if topology.failed:
            return None
        rings = 2 if topology.rows == 2 else 4
        return cost_model.ring_all_reduce_time(total / rings, topology.num_devices, chip)
    if variant == "weight-update-sharding":
        return sum(cost_model.plan_collective(opcode, total, everyone, topology, chip, algorithms={"2-D"}).time_s
                   for opcode in ("reduce-scatter", "all-gather"))
    raise ValueError(variant)


def estimates(model: dict, chip: cost_model.Chip, failed: bool) -> list[dict]:
    rows = []
    compute = model["gradients"] / chip.peak_flops
    update = max(model["update"] / chip.peak_flops,
                 ADAM_BYTES_PER_PARAMETER * model["parameters"] / chip.hbm_bandwidth)
    for r, c in TORI:
        holes = f"{r // 2}:{c // 2}" if failed else ""
        topology = Topology.parse(f"torus:{r}x{c}", failed=holes)
        row = {"topology": topology.describe(), "chips": topology.num_devices, "compute_s": compute,
               "update_s": update, "steps": {}}
        for variant in VARIANTS:
            summation = _summation(variant, model["gradient_bytes"], topology, chip)
            if summation is None:
                row["steps"][variant] = None
                continue
            own_update = update / topology.num_devices if variant == "weight-update-sharding" else update
            row["steps"][variant] = compute + own_update + summation
        rows.append(row)
    return rows


def _table(model: dict, rows: list[dict]) -> str:
    lines = [f"{model['name']}: {model['parameters'] / 1e6:.1f}M parameters in {len(model['gradient_bytes'])} "
             f"arrays ({sum(model['gradient_bytes']) / 1e6:.0f} MB f32 gradient), batch {model['batch']} per chip; "
             f"gradients {rows[0]['compute_s'] * 1e3:.1f} ms, adam update {rows[0]['update_s'] * 1e3:.2f} ms replicated",
             "",
             "| chips | topology | " + " | ".join(VARIANTS) + " |",
             "| ---: | --- | " + " | ".join("---:" for _ in VARIANTS) + " |"]
    for row in rows:
        plain = row["steps"]["plain"]
        cells = []
        for variant in VARIANTS:
            step = row["steps"][variant]
            cells.append("n/a" if step is None else f"{step * 1e3:.1f} ms" + (
                "" if variant == "plain" else f" ({step / plain:.2f}x)"))
        lines.append(f"| {row['chips']} | {row['topology']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chip", default="tpu-v3", choices=sorted(cost_model.CHIPS))
    parser.add_argument("--svg-dir", help="also draw each model's step time against chips as an SVG plot, "
                                          "pod_scaling_<model>.svg in this directory")
    args = parser.parse_args(argv)
    from xla_passes_demo import models

    chip = cost_model.CHIPS[args.chip]
    start = time.perf_counter()
    for spec, batch in ((models.resnet50(), 32), (models.bert_large(), 8)):
        model = _model_numbers(spec, batch)
        series = {}
        for failed in (False, True):
            rows = estimates(model, chip, failed)
            print(_table(model, rows) + ("\n(one failed chip in the middle of each torus)" if failed else ""), end="\n\n")
            for variant in VARIANTS:
                series[variant + (", a failed chip" if failed else "")] = [
                    (row["chips"], row["steps"][variant]) for row in rows if row["steps"][variant] is not None]
        if args.svg_dir:
            name = spec.name.split(" ")[0].lower().replace("-", "")
            cli.write_atomically(os.path.join(args.svg_dir, f"pod_scaling_{name}.svg"), plot.line_chart_svg(
                series, title=f"{spec.name}: estimated step time on {chip.name} tori", x_label="chips",
                y_label="step time (ms)", y_scale=1e3))
    print(f"chip {chip.name}: {chip.description}; priced in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
