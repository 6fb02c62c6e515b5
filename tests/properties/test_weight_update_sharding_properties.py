"""weight-update-sharding, property-based: the rewritten step computes what the plain one does.

Hypothesis draws training steps and modules (tests/helpers/wus_properties.py); every example runs
one with and without the pass on 8 CPU devices and compares every output (new weights,
optimizer state, loss):

* at the flag: a JAX step compiled with the pass at JAX's hook
  (`xla_passes.jax.enable(..., strict=True)`, so a pass error fails the example) against the
  same step compiled plainly;
* through `xla_passes.jax.jit(..., strict=True)` against `jax.jit` (`jax.pmap` for the pmap
  style), with the optimizer state handed back sharded (`persistent=true`) or not;
* offline: the step lowered to HLO before XLA's optimizations, rewritten with `run_passes`,
  both run by `hlo_tools.xla.runner.compare_modules` (here and through `xla_passes.jax.jit`,
  jit + NamedSharding steps are left out: before XLA's SPMD partitioner runs they have no
  all-reduce for the pass to rewrite);
* laid out: per-device modules as the hook receives them (one to three weights, gradients
  all-reduced one by one or by one combined all-reduce, updates inline or as kLoop fusions),
  whose gradients, updates and results have layouts that hypothesis chooses, rewritten as the
  hook does (`Pipeline(..., layouts_final=True)`) and compiled from XLA's pre-scheduler stage
  on. The pass must give equal numbers or leave the module (the pipeline may refuse it).

The JAX steps cover one to three weights of rank 1 to 4 in every split situation (the
leading dimension divisible by 8, only a later one as in 3x3xCxK conv kernels, none:
flattened and padded, dimensions of size 1, tiny ones), read by the loss three ways (see
`wus_properties.USES`), float32 and bfloat16, the loss computed in the weights' dtype or in
another (bfloat16 or float16 from float32 master weights, float32 from bfloat16 weights), with
or without 2 or 3 stacked layers run in a `lax.scan` (its body `jax.checkpoint`ed or not), a
`fori_loop` or a `lax.cond` per layer, sgd, momentum, adam, adamw and adam after
global-norm clipping, with and without donated weights, and shard_map + pmean,
jit + NamedSharding and pmap + pmean (with assume_replicated_parameters=true: the inputs give
every device the same weights). Every gradient below the pass's threshold_bytes must stay
replicated, for that reason. (At the flag, XLA's CPU compiler has already made bfloat16
all-reduces float32 ones: the pass sees float32 gradients there.)

Equal means equal up to the noise of a reordered float sum: each element within an absolute
error of 1e-6 or a relative error of 1e-5 (float32), 2**-7 (bfloat16: one unit in the last
place) of the plain program's.

Run: `pytest tests/properties/test_weight_update_sharding_properties.py` (profile `ci`: the example counts
below, derandomized, no example database). `HYPOTHESIS_PROFILE=long` tries 10 times as many,
randomly; `--hypothesis-show-statistics` shows how often each situation, control flow, dtype
and outcome came up.
The examples run in a worker process, so that an XLA crash is a failing example that
hypothesis shrinks, not the end of the session.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
from hypothesis import event, example, given, strategies as st

from hlo_tools.xla import runner
from wus_properties import (GROUP_SIZE, STYLES, THRESHOLD_BYTES, TOLERANCE, LaidOutCase, LaidOutWeight, StepCase,
                            Weight, Worker, examples, laid_out_cases, laid_out_reference, run_at_the_flag, run_laid_out,
                            run_offline, run_through_jit, situation, step_cases)

WORKER = Worker()
HLO_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


@pytest.fixture(scope="module", autouse=True)
def stop_the_worker():
    """The worker holds 8 CPU devices' worth of XLA state: stop it when the module is done."""
    yield
    WORKER.close()


def _assert_same(actual, expected, dtype: str, what: str) -> None:
    comparison = runner.compare_outputs(actual, expected, abs_error_bound=TOLERANCE[dtype]["atol"],
                                        rel_error_bound=TOLERANCE[dtype]["rtol"])
    assert comparison.ok, f"{what}:\n{comparison.format()}"


def _record_case(case: StepCase) -> None:
    for weight in case.weights:
        event(f"weight: {situation(weight.shape, case.dtype)}")
    event(f"control flow: {case.control}")
    event(f"loss in {case.compute} from {case.dtype} weights")


def _outcome(sharded: bool, dimension, padding: int, reason: str) -> str:
    if not sharded:
        return "kept: " + reason.split(":")[0]
    if dimension is not None:
        return f"sharded along dimension {dimension}"
    return "flattened with padding" if padding else "flattened"


_REPORT_LINE = re.compile(r"^weight-update-sharding: (kept|sharded) .*? (\w+\[[\d,]*\])")


def _report_bytes(shape_text: str) -> int:
    dtype, dims = re.fullmatch(r"(\w+)\[([\d,]*)\]", shape_text).groups()
    return math.prod(int(d) for d in dims.split(",") if d) * HLO_DTYPE_BYTES[dtype]


def _assert_small_gradients_kept(reports: list[tuple[bool, int, str]]) -> None:
    """(sharded, gradient bytes, reason) of each weight: below threshold_bytes, kept as tiny."""
    for sharded, size, reason in reports:
        if size < THRESHOLD_BYTES:
            assert not sharded and reason.startswith("tiny: "), (size, reason)


def _check_report_lines(plain, rewritten, lines: list[str], case: StepCase, way: str) -> list[str]:
    """Assert the properties of a run with the pass; return what it did with each weight."""
    _assert_same(rewritten, plain, case.dtype, f"{case} {way}")
    reports, outcomes = [], []
    for line in lines:  # "weight-update-sharding: kept %g f32[5,16] (m, w): tiny: 320 bytes ..."
        action, shape = _REPORT_LINE.match(line).groups()
        reason = line.split(": ", 2)[2] if action == "kept" else ""
        reports.append((action == "sharded", _report_bytes(shape), reason))
        outcomes.append("sharded" if action == "sharded" else "kept: " + reason.split(":")[0])
    _assert_small_gradients_kept(reports)
    return outcomes


def _check_at_the_flag(case: StepCase) -> list[str]:
    return _check_report_lines(*WORKER.run(run_at_the_flag, case), case, "at the flag")


@pytest.mark.parametrize("style", STYLES)
@examples(9)
@given(data=st.data())
def test_training_step_at_the_flag(style, data):
    case = data.draw(step_cases(style), label="case")
    _record_case(case)
    for outcome in _check_at_the_flag(case):
        event(f"at the flag: {outcome}")


@pytest.mark.parametrize("style", ["shard_map", "pmap"])
@examples(4)
@given(data=st.data(), persistent=st.booleans())
def test_training_step_through_jax_jit(style, data, persistent):
    case = data.draw(step_cases(style, mixed_precision=False), label="case")  # see KNOWN_INVALID_MODULE
    _record_case(case)
    run = WORKER.run(functools.partial(run_through_jit, persistent=persistent), case)
    for outcome in _check_report_lines(*run, case, "through xla_passes.jax.jit"):
        event(f"jit: {outcome}")


KNOWN_INVALID_MODULE = (
    "weight-update-sharding builds a module the verifier refuses from a lowered step (before XLA's "
    "optimizations) whose float32 gradient is converted from a bfloat16 loss: pmap's reduce-scatter of "
    "it ('shard_count = 1, subgroup_size = 8'), or a padded converted gradient's reshape ('mismatched "
    "element counts'); the pass fails, and the hook and xla_passes.jax.jit then compile JAX's own "
    "module. Until it is fixed the lowered paths draw no mixed precision; at the flag they do.")


@pytest.mark.xfail(strict=True, reason=KNOWN_INVALID_MODULE)
def test_mixed_precision_lowered_pmap_step_offline():
    result = WORKER.run(run_offline, StepCase("pmap", "sgd", "float32", (Weight((256,), "scaled"),), False, 0,
                                              "bfloat16", "none"))
    assert result.comparison_ok


def test_lowered_pmap_step_whose_unused_arguments_jax_drops_offline():
    """A pmap step drops the arguments it does not use (Adafactor's placeholder factored states of
    a vector weight): the inputs go to the parameters the lowered module kept (hypothesis's find)."""
    result = WORKER.run(run_offline, StepCase("pmap", "adafactor", "float32", (Weight((256,), "scaled"),), False, 0,
                                              "float32", "none"))
    assert result.comparison_ok, result.comparison


def test_conv_kernel_at_the_flag():
    """The bug that layouts_final fixed: XLA lays this kernel's gradient out as {3,1,0,2}, and
    the pass scattered it along dimension 2, which XLA did in contiguous chunks of the buffer."""
    _check_at_the_flag(StepCase("named_sharding", "momentum", "float32", (Weight((3, 3, 16, 16), "scaled"),), False, 0,
                                "float32", "none"))


@pytest.mark.parametrize("style", ["shard_map", "pmap"])
@examples(10)
@given(data=st.data())
def test_lowered_training_step_offline(style, data):
    # see KNOWN_INVALID_MODULE; on jax 0.10.2 a pmap step's stacked layers in a `lax.cond` give
    # another module the verifier refuses (a padded shard's reshape, 36 -> 288 elements), so the
    # lowered pmap steps draw no control flow either until that is fixed (at the flag they do)
    case = data.draw(step_cases(style, mixed_precision=False, control_flow=style != "pmap"), label="case")
    _record_case(case)
    result = WORKER.run(run_offline, case)
    assert result.comparison_ok, f"{case} offline:\n{result.comparison}"
    for report in result.reports:
        event("offline: " + _outcome(report.sharded, report.dimension, report.padding, report.reason))
    _assert_small_gradients_kept([(r.sharded, _report_bytes(r.shape), r.reason) for r in result.reports])


@examples(150)
@given(case=laid_out_cases())
# The conv kernel's layout everywhere (split along dimension 2), and with default-layout results (flattened).
@example(case=LaidOutCase((LaidOutWeight((3, 3, 16, 16), *[(3, 1, 0, 2)] * 4),), "float32", "momentum", False, True, 0))
@example(case=LaidOutCase((LaidOutWeight((3, 3, 16, 16), *[(3, 1, 0, 2)] * 3, (3, 2, 1, 0)),), "float32", "momentum",
                          False, False, 0))
def test_laid_out_update_computes_the_same_or_stays(case):
    for weight in case.weights:
        event(f"weight: {situation(weight.dims, case.dtype)}")
    result = WORKER.run(run_laid_out, case)
    if case.dtype == "float32":  # the original module runs as XLA would: the harness is sound
        expected = [value[None].repeat(GROUP_SIZE, 0) for value in laid_out_reference(case)]
        _assert_same(result.original, expected, case.dtype, f"{case}: the original module against numpy")
    if result.refusal:
        event("laid out: refused by the pipeline")
        return
    for report in result.reports:
        event("laid out: " + _outcome(report.sharded, report.dimension, report.padding, report.reason))
    _assert_same(result.rewritten, result.original, case.dtype,
                 f"{case}\n--- rewritten:\n{result.rewritten_text}\n--- original:\n{result.text}")
