"""Differential execution for pass tests: the rewritten module must compute what the original did."""
from __future__ import annotations

import hlo_tools
import xla_passes
from hlo_tools import runner


def run_and_compare(text: str, passes: str, *, num_replicas: int | None = None,
                    num_partitions: int | None = None, exact: bool = True,
                    abs_error_bound: float = 1e-5, rel_error_bound: float = 1e-5,
                    expect_change: bool | None = True, inputs=None, seed: int = 0) -> hlo_tools.HloModule:
    """Run `passes` on `text`, execute both modules on the same inputs, assert equal outputs.

    `expect_change` is what the pipeline must report (None: either).
    `exact` demands bit-equal outputs (combining collectives must not change a
    single bit); otherwise the error bounds apply (float reassociation).
    Returns the rewritten module for structural checks.
    """
    module = hlo_tools.parse_module(text)
    changed = xla_passes.run_passes(module, passes)
    if expect_change is not None:
        assert changed == expect_change, f"{passes} changed={changed}, expected {expect_change}"
    after = module.to_text()
    bounds = (0.0, 0.0) if exact else (abs_error_bound, rel_error_bound)
    result, reference, comparison = runner.compare_modules(
        after, text, inputs, num_replicas=num_replicas, num_partitions=num_partitions,
        reference_num_replicas=num_replicas, reference_num_partitions=num_partitions,
        abs_error_bound=bounds[0], rel_error_bound=bounds[1], seed=seed)
    assert comparison.ok, f"{passes} changed the results:\n{comparison.format()}\n--- rewritten:\n{after}"
    return module
