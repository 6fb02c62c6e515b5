"""collective-fusion's passes, property-based: a step computes with them what it computes without.

Hypothesis draws data-parallel training steps (tests/helpers/collective_fusion_properties.py): an MLP,
convnet or Transformer of 2 or 3 stacked layers, run unrolled, in a `lax.scan` (its body
`jax.checkpoint`ed or not), in a `fori_loop` or each in a `lax.cond`, every layer centring its
activations over the devices (collectives inside loop bodies and branches); the loss in
float32, bfloat16 or float16 from float32 master weights; sgd, momentum or adamw; beside the
loss, optionally, int32 and bool all-reduces, all-gathers of float32 and int32 and two
reduce-scatters in the loss's dtype; in the `shard_map` + `pmean`, `jax.jit` + `NamedSharding`
and `jax.pmap` styles. Each example runs one step on 8 CPU devices with and without one of
`all-reduce-combiner`, `collective-fusion{simplify=false}`, the three combiners with a 64-byte
threshold (several groups), `collective-fusion` or `all-reduce-simplifier`, in one of three ways:

* at the flag: the step compiled with the passes at JAX's hook (`xla_passes.jax.enable(...,
  strict=True)`: a pass error fails the example), against the same step compiled plainly, in a
  worker process whose XLA has its own CPU all-reduce combiner off (the passes then find every
  all-reduce on its own; XLA has made bfloat16 and float16 all-reduces float32 ones by then);
* through `xla_passes.jax.jit(..., strict=True)` against `jax.jit` (a module XLA refuses fails
  the example);
* offline: the lowered step rewritten by `run_passes`, both modules run by
  `hlo_tools.xla.runner.compare_modules` on the same inputs.

Before XLA's partitioner (the last two ways) a jit + NamedSharding step has no collective: the
passes must leave it alone, and it is not run offline.

Equal means bit for bit for the combiners, which add every sum's terms as the separate
collectives do, except where one made an all-reduce of a flat buffer (in a shard_map body
before XLA's optimizations): XLA then fuses the reductions that compute the buffer's pieces
into its concatenate, and its CPU code adds their terms in another order (float32's last bit).
The simplifier turns a sum of equal values into a product: equal up to one unit in the last
place of the loss's dtype (`collective_fusion_properties.TOLERANCE`).

Run: `pytest tests/properties/test_collective_fusion_properties.py` (profile `ci`: the example counts
below, derandomized); `HYPOTHESIS_PROFILE=long` tries 10 times as many, randomly;
`--hypothesis-show-statistics` shows how many examples had control flow, which element types,
and what the passes did.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, strategies as st

from collective_fusion_properties import (TOLERANCE, XLA_FLAGS, FusionCase, Run, fusion_cases, run_at_the_flag,
                                          run_offline, run_through_jit)
from hlo_tools.xla import runner
from wus_properties import Worker, examples

WORKER = Worker(XLA_FLAGS)
F16_BIAS_GRADIENTS = FusionCase("pmap", "transformer", "float16", "none", 2, 8, "adamw", False,
                                "all-reduce-combiner", 501)


@pytest.fixture(scope="module", autouse=True)
def stop_the_worker():
    """The worker holds 8 CPU devices' worth of XLA state: stop it when the module is done."""
    yield
    WORKER.close()


def _record(case: FusionCase, run: Run, way: str) -> None:
    event(f"passes: {case.passes}")
    event(f"control flow: {case.control}")
    event(f"{way}: control flow in the module the passes got" if run.control_flow else
          f"{way}: no control flow in the module the passes got")
    event(f"loss in {case.compute}" + (", int32 and bool collectives" if case.metrics else ""))
    combined = [op for op in run.before if run.after[op] < run.before[op]]
    event(f"{way}: combined {', '.join(combined)}" if combined else f"{way}: nothing combined")


def _assert_same(case: FusionCase, run: Run, way: str) -> None:
    what = f"{case} {way} (collectives {run.before} -> {run.after})"
    assert len(run.rewritten) == len(run.plain), what
    if case.exact and not run.flat:
        for number, (got, want) in enumerate(zip(run.rewritten, run.plain)):
            np.testing.assert_array_equal(got, want, err_msg=f"{what}: output {number}")
        return
    bound = TOLERANCE["float32" if case.exact else case.compute]
    comparison = runner.compare_outputs(run.rewritten, run.plain, abs_error_bound=bound["atol"],
                                        rel_error_bound=bound["rtol"])
    assert comparison.ok, f"{what}:\n{comparison.format()}"


@pytest.mark.parametrize("style", ["shard_map", "named_sharding", "pmap"])
@examples(3)
@given(data=st.data())
def test_at_the_flag(style, data):
    case = data.draw(fusion_cases(style), label="case")
    run = WORKER.run(run_at_the_flag, case)
    _record(case, run, "at the flag")
    _assert_same(case, run, "at the flag")


@pytest.mark.parametrize("style", ["shard_map", "pmap"])
@examples(3)
@given(data=st.data())
def test_through_jax_jit(style, data):
    case = data.draw(fusion_cases(style), label="case")
    run = WORKER.run(run_through_jit, case)
    _record(case, run, "jit")
    _assert_same(case, run, "through xla_passes.jax.jit")


@examples(2)
@given(case=fusion_cases("named_sharding"))
def test_through_jax_jit_a_named_sharding_step_is_left_alone(case):
    """XLA's partitioner makes its collectives, after the passes."""
    run = WORKER.run(run_through_jit, case)
    _record(case, run, "jit")
    assert run.before == run.after == dict.fromkeys(run.before, 0), run
    _assert_same(case, run, "through xla_passes.jax.jit")


@pytest.mark.parametrize("style", ["shard_map", "pmap"])
@examples(3)
@given(data=st.data())
def test_offline(style, data):
    case = data.draw(fusion_cases(style), label="case")
    run = WORKER.run(run_offline, case)
    _record(case, run, "offline")
    _assert_same(case, run, "offline")


@pytest.mark.parametrize("way", [run_through_jit, run_offline])
def test_gradients_computed_in_float16_stay_out_of_flat_buffers(way):
    """Found by the properties above: the f32 all-reduces of a pmap Transformer's f16 bias and
    scale gradients (reductions), combined into a flat buffer, came out up to 0.6% off: XLA fused the
    f16 reductions into the buffer's concatenate and rounded other partial sums there."""
    _assert_same(F16_BIAS_GRADIENTS, WORKER.run(way, F16_BIAS_GRADIENTS), way.__name__)
