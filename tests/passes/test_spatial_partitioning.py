"""spatial-partitioning: the per-device program computes what the single-device one did.

Every differential test lowers a real program (JAX, or a TF `tf.function(jit_compile=True)`
training step) for one device at test time, runs the pass, and runs both modules through
the runner on the same global inputs: the original on 1 device, the rewritten one on 4
partitions (the runner splits the inputs as the `sharding=` annotations say and assembles
the outputs). Inputs are standard-normal floats: integer inputs make max-pooling windows
with equal maxima, where XLA's choice of the selected element depends on the array's shape
(test_max_pool_gradient_ties). `spatial_partitioning.hlo` and
`spatial_partitioning_unaligned.hlo` have the FileCheck tests of the halo arithmetic.
"""
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_tools
import xla_passes
from hlo_tools.xla import runner
from xla_passes.spatial.windows import (RowRange, aligned_output_rows, plan_row_fetch, plan_select_and_scatter,
                                        plan_window, scatter_row_ranges, window_row_range)

BOUNDS = {"abs_error_bound": 1e-4, "rel_error_bound": 1e-3}
NHWC = ("NHWC", "HWIO", "NHWC")


def _partition(text: str, passes: str):
    module = hlo_tools.parse_module(text)
    pipeline = xla_passes.Pipeline(passes)
    assert pipeline.run(module)
    return module, pipeline.reports()


def _compare(text: str, passes: str = "spatial-partitioning", seed: int = 0):
    """Run the pass, compare both modules on float inputs; the rewritten module and report."""
    module, report = _partition(text, passes)
    rng = np.random.default_rng(seed)
    shapes = [p.shape for p in hlo_tools.parse_module(text).entry.parameters]
    inputs = [rng.standard_normal(s.dims).astype(np.float32) for s in shapes]
    after = module.to_text()
    result, _, comparison = runner.compare_modules(after, text, inputs, **BOUNDS)
    assert result.num_partitions == module.num_partitions > 1
    assert comparison.ok, f"{passes}:\n{comparison.format()}\n{after}"
    return module, report


def _lower(f, *shapes) -> str:
    return jax.jit(f).lower(*(jnp.zeros(s, jnp.float32) for s in shapes)).as_text(dialect="hlo")


def _conv(x, k, stride=1, padding="SAME", lhs_dilation=None, rhs_dilation=None):
    return jax.lax.conv_general_dilated(x, k, (stride, stride), padding, lhs_dilation=lhs_dilation,
                                        rhs_dilation=rhs_dilation, dimension_numbers=NHWC)


def _count(module, opcode: str) -> int:
    return sum(i.opcode == opcode for i in module.entry.instructions)


# --- the halo arithmetic against a direct simulation ------------------------------------------------

def _global_rows(size, pad_lo, pad_hi, ld, stride, rd, window):
    """For each output row of a 1-D window, the input rows it reads (None: padding)."""
    dilated = (size - 1) * ld + 1
    out = (pad_lo + dilated + pad_hi - ((window - 1) * rd + 1)) // stride + 1
    rows = []
    for o in range(out):
        read = []
        for j in range(window):
            p = o * stride + j * rd - pad_lo
            read.append(p // ld if p >= 0 and p % ld == 0 and p // ld < size else None)
        rows.append(read)
    return rows


def test_plan_window_matches_a_direct_simulation():
    """For random windows, each device's local window over its slab and halo (rows outside the
    array read as padding) reads exactly what the global window reads for its output rows."""
    rng = random.Random(0)
    checked = 0
    while checked < 300:
        devices, window, stride = rng.choice([2, 3, 4]), rng.randint(1, 5), rng.randint(1, 3)
        ld, rd = rng.randint(1, 3), rng.randint(1, 3)
        pad_lo, pad_hi = rng.randint(-1, 4), rng.randint(-1, 4)
        size = rng.randint(4, 20)
        local = -(-size // devices)
        expected = _global_rows(size, pad_lo, pad_hi, ld, stride, rd, window)
        out_rows = aligned_output_rows(local, ld, stride)
        if not expected or out_rows is None or out_rows * devices < len(expected):
            continue
        plan = plan_window(in_rows=local, padding_low=pad_lo, base_dilation=ld, stride=stride,
                           window_dilation=rd, window=window, out_rows=out_rows)
        checked += 1
        for device in range(devices):
            first = device * local - plan.have_low
            extent = local + plan.have_low + plan.have_high
            local_rows = [r if 0 <= r < size else None for r in range(first, first + extent)]
            got = _global_rows(extent, plan.padding_low, plan.padding_high, ld, stride, rd, window)
            assert len(got) == out_rows
            for t, read in enumerate(got):
                o = device * out_rows + t
                if o < len(expected):
                    mapped = [local_rows[i] if i is not None else None for i in read]
                    assert mapped == expected[o], (device, t, plan)


def test_plan_select_and_scatter_covers_every_window_touching_the_slab():
    for window, stride, pad in [(2, 2, 0), (3, 2, 0), (3, 2, 1), (3, 1, 1), (5, 2, 2)]:
        for source_rows in (2, 3, 4):
            plan = plan_select_and_scatter(operand_rows=source_rows * stride, source_rows=source_rows,
                                           window=window, stride=stride, padding_low=pad)
            assert plan is not None
            rows = source_rows * stride
            touching = [o for o in range(-10, 20) if o * stride - pad <= rows - 1 and o * stride - pad + window - 1 >= 0]
            assert min(touching) == -plan.source_low and max(touching) == source_rows - 1 + plan.source_high
            assert -plan.operand_low == min(touching) * stride - pad
            assert rows - 1 + plan.operand_high == max(touching) * stride - pad + window - 1
    assert plan_select_and_scatter(operand_rows=5, source_rows=2, window=3, stride=2, padding_low=0) is None


def test_plan_row_fetch_matches_a_direct_simulation():
    """Each device's exchanged, padded and dynamic-sliced rows are the global rows it asked
    for, and every one inside the array really arrived (from its own slab or a neighbour's)."""
    rng = random.Random(1)
    for _ in range(300):
        devices, size = rng.choice([2, 3, 4, 8]), rng.randint(2, 30)
        local = -(-size // devices)
        count = rng.randint(1, 12)
        starts = tuple(sorted(rng.randint(-4, size + 2) for _ in range(devices)))
        fetch = plan_row_fetch(RowRange(starts, count), local, size)
        for c in range(devices):
            first = c * local - fetch.low - fetch.pad_low
            extent = fetch.pad_low + fetch.low + local + fetch.high + fetch.pad_high
            assert 0 <= fetch.offsets[c] and fetch.offsets[c] + count <= extent, (c, fetch)
            for k in range(count):
                row = first + fetch.offsets[c] + k
                assert row == starts[c] + k
                if 0 <= row < size:   # inside the array: exchanged or own, not local padding
                    assert c * local - fetch.low <= row < (c + 1) * local + fetch.high, (c, row, fetch)


def test_unaligned_ranges_cover_the_windows():
    """window_row_range: device c's rows are exactly what its output rows read; scatter_row_ranges:
    every window touching the device's operand rows, and every row those windows cover."""
    for out_rows, stride, dilation, window, pad in [(2, 2, 1, 3, 0), (3, 2, 1, 2, 0), (3, 1, 2, 3, 2), (2, 3, 1, 3, 1)]:
        rows = window_row_range(parts=4, out_rows=out_rows, padding_low=pad, stride=stride,
                                window_dilation=dilation, window=window)
        for c, start in enumerate(rows.starts):
            outputs = range(c * out_rows, (c + 1) * out_rows)
            read = {o * stride + j * dilation - pad for o in outputs for j in range(window)}
            assert min(read) == start and max(read) == start + rows.count - 1
    for local, window, stride, pad in [(3, 2, 2, 0), (5, 3, 2, 0), (3, 3, 2, 1), (5, 2, 3, 0)]:
        source, operand = scatter_row_ranges(parts=4, operand_rows=local, window=window, stride=stride,
                                             padding_low=pad)
        for c in range(4):
            touching = [o for o in range(-10, 40) if o * stride - pad <= (c + 1) * local - 1
                        and o * stride - pad + window - 1 >= c * local]
            assert source.starts[c] == min(touching) and max(touching) < source.starts[c] + source.count
            assert operand.starts[c] == source.starts[c] * stride - pad
            assert operand.count == (source.count - 1) * stride + window


# --- JAX programs ------------------------------------------------------------------------------------

FORWARD = {
    "same": lambda x, k: _conv(x, k),
    "stride2_same": lambda x, k: _conv(x, k, 2),
    "valid": lambda x, k: _conv(x, k, 1, "VALID"),
    "stride2_valid": lambda x, k: _conv(x, k, 2, "VALID"),
    "dilated": lambda x, k: _conv(x, k, rhs_dilation=(2, 2)),
    "lhs_dilated": lambda x, k: _conv(x, k, 1, ((2, 1), (2, 1)), lhs_dilation=(2, 2)),
    "explicit_padding": lambda x, k: _conv(x, k, 1, ((2, 0), (1, 1))),
    "max_pool": lambda x, k: jax.lax.reduce_window(_conv(x, k), -jnp.inf, jax.lax.max, (1, 3, 3, 1),
                                                   (1, 2, 2, 1), "SAME"),
    "avg_pool": lambda x, k: jax.lax.reduce_window(_conv(x, k), 0.0, jax.lax.add, (1, 2, 2, 1),
                                                   (1, 2, 2, 1), "VALID") / 4,
    "batch_norm_statistics": lambda x, k: (lambda y: (y - y.mean((0, 1, 2))) / jnp.sqrt(y.var((0, 1, 2)) + 1e-5))(
        _conv(x, k)),
    "global_pool": lambda x, k: _conv(x, k).mean((1, 2)),
    "flatten_dense": lambda x, k: _conv(x, k, 2).reshape(2, -1) @ jnp.ones((8 * 8 * 8, 5)),
}


@pytest.mark.parametrize("name", FORWARD)
def test_jax_inference(name):
    module, report = _compare(_lower(FORWARD[name], (2, 16, 16, 3), (3, 3, 3, 8)))
    gathers = [line for line in report if " all-gather " in line]
    if name == "flatten_dense":
        assert len(gathers) == 1 and "before %" in gathers[0] and "(reshape)" in gathers[0]
    elif name not in ("valid", "stride2_valid"):   # uneven results are gathered at the end
        assert not gathers, gathers


def _train_step():
    """A small conv net's SGD step: convolutions (stride 2, dilation), ReLU, max pooling,
    batch-norm statistics, flatten + dense head, mean squared error."""
    def net(params, x):
        *kernels, dense = params
        y = jax.nn.relu(_conv(x, kernels[0]))
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        y = _conv(y, kernels[1], 2)
        for k in kernels[2:]:
            y = jax.nn.relu(_conv(y, k, rhs_dilation=(2, 2)))
        mean = y.mean((0, 1, 2))
        y = (y - mean) / jnp.sqrt(((y - mean) ** 2).mean((0, 1, 2)) + 1e-5)
        return y.reshape(y.shape[0], -1) @ dense

    def step(params, x, target):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((net(p, x) - target) ** 2))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return step


def _lower_step(height: int, batch: int = 2):
    step = _train_step()
    side = -(-height // 4)
    params = [jnp.zeros((3, 3, 3, 8)), jnp.zeros((3, 3, 8, 8)), jnp.zeros((3, 3, 8, 8)),
              jnp.zeros((8 * side * side, 10))]
    return jax.jit(step).lower(params, jnp.zeros((batch, height, height, 3)),
                               jnp.zeros((batch, 10))).as_text(dialect="hlo")


@pytest.mark.parametrize("options", ["", "{mesh=2x2}", "{num_partitions=8}"])
def test_jax_training_step(options):
    module, report = _compare(_lower_step(16 if "8" not in options else 32), f"spatial-partitioning{options}")
    assert _count(module, "select-and-scatter") == 1 and _count(module, "collective-permute") > 0
    gathers = [line for line in report if " all-gather " in line]
    assert len(gathers) == 1 and "(reshape)" in gathers[0], gathers   # only the flatten
    weight_gradients = [line for line in report if "weight gradient" in line]
    assert len(weight_gradients) == 3


def test_jax_training_step_uneven():
    """18 rows over 4 devices: 5, 5, 5 and 3 (padded and masked); the runner reads the
    global shape from the parameter's frontend attribute."""
    module, report = _compare(_lower_step(18))
    x = module.entry.parameter(4)
    assert x.shape.dims == (2, 5, 18, 3)
    assert x.attrs["frontend_attributes"].get("global_shape") == "f32[2,18,18,3]"
    assert any("the last holds 3" in line for line in report)
    gathers = [line for line in report if " all-gather " in line]
    assert len(gathers) == 1 and "(reshape)" in gathers[0], gathers   # only the flatten


@pytest.mark.parametrize("batch", [8, 6])
def test_batch_split_makes_the_step_data_parallel(batch):
    """split=4:0;5:0 splits the images and targets along the batch: each device convolves its own
    examples, and what contracts the examples (the convolutions' and the dense layer's weight
    gradients, the statistics, the loss) reduces locally and all-reduces. Nothing is gathered;
    6 examples over 4 devices pad the last slab, whose rows are masked out of every sum."""
    module, report = _compare(_lower_step(8, batch), "spatial-partitioning{split=4:0;5:0}")
    assert module.entry.parameter(4).shape.dims == (-(-batch // 4), 8, 8, 3)
    assert not [line for line in report if " all-gather " in line], report
    assert _count(module, "collective-permute") == 0   # no halos: examples do not overlap
    assert sum("over split examples (a weight gradient)" in line for line in report) == 3
    assert sum("dot over split contracting dimension" in line for line in report) == 1


UNALIGNED = {
    "conv_stride2": lambda y, k: _conv(y, k, 2),
    "max_pool_2x2": lambda y, k: jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
    "max_pool_3x3": lambda y, k: jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
}


@pytest.mark.parametrize("options", ["", "{mesh=2x2}"])
@pytest.mark.parametrize("height", [10, 18])
@pytest.mark.parametrize("name", UNALIGNED)
def test_unaligned_windows_stay_partitioned(name, height, options):
    """10 or 18 rows over 4 devices (3 or 5 per device; 5 or 9 over a 2x2 mesh) into a
    stride-2 window: no output slab lines up with an input slab. The forward value and an SGD
    step's gradients (the input gradient of a stride-2 convolution is lhs-dilated, that of
    max pooling a select-and-scatter, the kernel gradients windows split with their input)
    come from halos and per-device dynamic slices, never from an all-gather."""
    def forward(kernels, x):
        return UNALIGNED[name](jax.nn.relu(_conv(x, kernels[0])), kernels[1])

    def step(kernels, x):
        loss, grads = jax.value_and_grad(lambda ks: jnp.mean(forward(ks, x) ** 2))(kernels)
        return forward(kernels, x), loss, [k - 0.1 * g for k, g in zip(kernels, grads)]
    kernels = [jnp.zeros((3, 3, 3, 4)), jnp.zeros((3, 3, 4, 4))]
    text = jax.jit(step).lower(kernels, jnp.zeros((2, height, height, 3))).as_text(dialect="hlo")
    module, report = _compare(text, f"spatial-partitioning{options}")
    gathers = [line for line in report if " all-gather " in line]
    assert len(gathers) == 1 and "at the result" in gathers[0], gathers   # the uneven forward output
    assert any("per-device offset" in line for line in report)
    assert _count(module, "dynamic-slice") > 0 and _count(module, "collective-permute") > 0
    if name != "conv_stride2":
        assert _count(module, "select-and-scatter") == 1


def _conv_chain(depth: int, train: bool, size: int = 32):
    def net(kernels, x):
        for k in kernels:
            x = jax.nn.relu(_conv(x, k))
        return x

    def step(kernels, x):
        grads = jax.grad(lambda ks: (net(ks, x) ** 2).mean())(kernels)
        return [k - 0.1 * g for k, g in zip(kernels, grads)]
    kernels = [jnp.zeros((3, 3, 4, 4))] * depth
    return jax.jit(step if train else net).lower(kernels, jnp.zeros((1, size, size, 4))).as_text(dialect="hlo")


@pytest.mark.parametrize("train", [False, True])
def test_halo_fusion_exchanges_fewer_halos(train):
    text = _conv_chain(4, train)
    plain, _ = _compare(text, "spatial-partitioning")
    fused, report = _compare(text, "spatial-partitioning{halo_fusion=4}")
    assert _count(fused, "collective-permute") < _count(plain, "collective-permute")
    if not train:
        assert _count(plain, "collective-permute") == 8 and _count(fused, "collective-permute") == 2
        assert sum("fused-halo" in line for line in report) == 3
    _compare(text, "spatial-partitioning{halo_fusion=2,mesh=2x2}")


def test_halo_fusion_stays_one_hop():
    """2-row slabs (16 rows over 8 devices): a 3x3 convolution's own halo takes one of the
    neighbour's rows, so only one more convolution fits in a one-hop exchange, whatever
    `halo_fusion` asks: 4 convolutions, 2 exchanges of one collective-permute per side."""
    text = _conv_chain(4, False, size=16)
    fused, _ = _compare(text, "spatial-partitioning{num_partitions=8,halo_fusion=4}")
    assert _count(fused, "collective-permute") == 4


# --- max-pool gradients with equal maxima -------------------------------------------------------------

TIES = """HloModule ties

ge {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = pred[] compare(a, b), direction=GE
}

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY e {
  x = f32[1,8,WIDTH,1] parameter(0)
  k = f32[1,1,1,1] parameter(1)
  y = f32[1,8,WIDTH,1] convolution(x, k), window={size=1x1}, dim_labels=b01f_01io->b01f
  s = f32[1,4,4,1] parameter(2)
  zero = f32[] constant(0)
  ROOT grad = f32[1,8,WIDTH,1] select-and-scatter(y, s, zero), window={size=1x3x3x1 stride=1x2x2x1 pad=0_0x0_1x0_1x0_0}, select=ge, scatter=add
}
"""


def _window_choices(grad: np.ndarray, operand: np.ndarray) -> dict:
    """Window (o, p) of TIES -> the element its source went to, decoded from a gradient whose
    source values are distinct powers of two; asserts each went to a maximum of its window."""
    choices = {}
    height, width = operand.shape[1:3]
    for (i, j), bits in np.ndenumerate(grad[0, :, :, 0].astype(np.int64)):
        for window in range(16):
            if bits >> window & 1:
                o, p = divmod(window, 4)
                rows, cols = range(2 * o, min(2 * o + 3, height)), range(2 * p, min(2 * p + 3, width))
                assert i in rows and j in cols
                assert operand[0, i, j, 0] == max(operand[0, r, c, 0] for r in rows for c in cols)
                choices[(o, p)] = (i, j)
    assert len(choices) == 16
    return choices


def _tie(width: int) -> np.ndarray:
    operand = np.full((1, 8, width, 1), -1, np.float32)
    operand[0, 1, 2, 0] = operand[0, 2, 1, 0] = 5          # equal maxima in window (0, 0)
    return operand


SOURCE = (2.0 ** np.arange(16, dtype=np.float32)).reshape(1, 4, 4, 1)
ONE = np.ones((1, 1, 1, 1), np.float32)


def test_xla_breaks_max_pool_ties_by_array_shape():
    """Why a partitioned max-pool gradient may pick another of equal maxima: XLA's CPU compiler
    rewrites select-and-scatter into an argmax reduce-window plus a scatter, and that
    reduce-window's order over a window (StableHLO leaves it to the implementation) depends
    on the whole padded array. The same window, in arrays 8 and 9 wide, picks different
    elements; a device's local window sits in an array of another width."""
    picks = {}
    for width in (8, 9):
        text = TIES.replace("WIDTH", str(width))
        picks[width] = _window_choices(runner.run_module(text, [_tie(width), ONE, SOURCE]).outputs[0], _tie(width))
    assert picks[8][(0, 0)] == (2, 1) and picks[9][(0, 0)] == (1, 2)


@pytest.mark.parametrize("options", ["{split=0:2,num_partitions=2}", "{split=0:1,num_partitions=2}"])
def test_max_pool_gradient_ties(options):
    """With equal maxima (integer inputs), split along W or H: each window's source goes to
    a maximum of that window, on one device and partitioned (not necessarily the same one)."""
    text = TIES.replace("WIDTH", "8")
    module, _ = _partition(text, f"spatial-partitioning{options}")
    ties = np.random.default_rng(0).integers(0, 3, (1, 8, 8, 1)).astype(np.float32)
    for operand in (_tie(8), ties):
        result, reference, _ = runner.compare_modules(module.to_text(), text, [operand, ONE, SOURCE])
        one_device = _window_choices(reference.outputs[0], operand)
        partitioned = _window_choices(result.outputs[0], operand)
        unique = [w for w, (i, j) in one_device.items()
                  if np.sum(operand[0, 2 * w[0]:2 * w[0] + 3, 2 * w[1]:2 * w[1] + 3, 0] == operand[0, i, j, 0]) == 1]
        assert all(partitioned[w] == one_device[w] for w in unique)


# --- TensorFlow ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", ["", "{mesh=2x2}"])
def test_tf_training_step(options):
    tf = pytest.importorskip("tensorflow")
    k1 = tf.Variable(tf.random.normal((3, 3, 3, 8), seed=1))
    k2 = tf.Variable(tf.random.normal((3, 3, 8, 8), seed=2))
    w = tf.Variable(tf.random.normal((4 * 4 * 8, 5), seed=3))

    @tf.function(jit_compile=True)
    def step(x, target):
        with tf.GradientTape() as tape:
            y = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
            y = tf.nn.max_pool2d(y, 3, 2, "SAME")
            y = tf.nn.conv2d(y, k2, 2, "SAME")
            mean, var = tf.nn.moments(y, axes=[0, 1, 2])
            y = (y - mean) * tf.math.rsqrt(var + 1e-5)
            loss = tf.reduce_mean((tf.reshape(y, (2, -1)) @ w - target) ** 2)
        grads = tape.gradient(loss, [k1, k2, w])
        return [loss] + [v - 0.1 * g for v, g in zip([k1, k2, w], grads)]

    text = step.experimental_get_compiler_ir(tf.zeros((2, 16, 16, 3)), tf.zeros((2, 5)))(stage="hlo")
    module, report = _compare(text, f"spatial-partitioning{options}")
    assert sum("weight gradient" in line for line in report) == 2


# --- options and errors -------------------------------------------------------------------------------

SMALL = """HloModule small

ENTRY e {
  x = f32[1,8,8,2] parameter(0)
  k = f32[3,3,2,2] parameter(1)
  ROOT conv = f32[1,8,8,2] convolution(x, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
}
"""


def test_split_option_picks_the_dimension():
    module, report = _compare(SMALL, "spatial-partitioning{split=0:2,num_partitions=2}")
    assert module.entry.parameter(0).shape.dims == (1, 8, 4, 2)
    assert "dimension 2 (8 rows) over 2 devices" in report[0]


@pytest.mark.parametrize("passes, message", [
    ("spatial-partitioning{mesh=2y2}", "is not like 2x2"),
    ("spatial-partitioning{num_partitions=1}", "at least 2 devices"),
    ("spatial-partitioning{split=0:1:2}", "needs 1 dimension(s)"),
    ("spatial-partitioning{split=5:1}", "has no parameter 5"),
    ("spatial-partitioning{halo_fusion=0}", "at least 1"),
])
def test_bad_options(passes, message):
    with pytest.raises(xla_passes.PassError, match=message.replace("(", r"\(").replace(")", r"\)")):
        xla_passes.run_passes(hlo_tools.parse_module(SMALL), passes)


def test_needs_a_convolution_input_or_a_split():
    text = "HloModule m\n\nENTRY e {\n  ROOT x = f32[4,4] parameter(0)\n}\n"
    with pytest.raises(xla_passes.PassError, match="split=P:D"):
        xla_passes.run_passes(hlo_tools.parse_module(text), "spatial-partitioning")


def test_runner_refuses_a_global_shape_that_does_not_split():
    text = SMALL.replace("HloModule small", "HloModule small, num_partitions=4")
    text = text.replace("x = f32[1,8,8,2] parameter(0)",
                        'x = f32[1,3,8,2] parameter(0), sharding={devices=[1,4,1,1]<=[4]}, '
                        'frontend_attributes={global_shape="f32[1,20,8,2]"}')
    text = text.replace("ROOT conv = f32[1,8,8,2]", "ROOT conv = f32[1,3,8,2]")
    with pytest.raises(runner.RunError, match=r"global shape \[1, 20, 8, 2\] does not split"):
        runner.run_module(text)
    assert math.prod(runner.run_module(text.replace("20", "10")).inputs[0].shape) == 160


# --- explicit pads (Keras's ZeroPadding2D) ------------------------------------------------------------

def _pad_modules() -> dict[str, str]:
    path = __file__.replace("test_spatial_partitioning.py", "spatial_partitioning_pad.hlo")
    with open(path, encoding="utf-8") as f:
        pieces = f.read().split("// -----")
    texts = ["\n".join(line for line in piece.splitlines() if not line.startswith("//")).strip() + "\n"
             for piece in pieces]
    return {text.split()[1].rstrip(","): text for text in texts}


PAD_MODULES = _pad_modules()


@pytest.mark.parametrize("options", ["", "{mesh=2x2}", "{num_partitions=3}", "{num_partitions=8}"])
@pytest.mark.parametrize("name", PAD_MODULES)
def test_pad_modules_compute_the_same(name, options):
    """Every module of spatial_partitioning_pad.hlo, 1 device against 4 (2x2), 3 and 8; only
    interior padding and uneven results gather."""
    module, report = _compare(PAD_MODULES[name], f"spatial-partitioning{options}")
    gathers = [line for line in report if " all-gather " in line and "at the result" not in line]
    assert bool(gathers) == (name == "interior"), gathers


TF_PADS = [  # (rows, window, stride, padding of H and W)
    (16, 3, 1, (1, 1)), (17, 3, 1, (1, 1)),       # ZeroPadding2D(1) + 3x3 VALID, even and odd
    (16, 3, 2, (0, 1)), (15, 3, 2, (1, 1)),       # correct_pad before a 3x3 stride-2 (MobileNet, EfficientNet)
    (32, 7, 2, (3, 3)), (31, 7, 2, (3, 3)),       # ResNet's stem
]


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
@pytest.mark.parametrize("rows, window, stride, pads", TF_PADS)
def test_tf_pad_before_valid_convolution(rows, window, stride, pads, gradient):
    """`conv2d(tf.pad(x), k, stride, "VALID")` and its gradients (TF slices the padded input's
    gradient) exchange halos like a SAME convolution: no all-gather but the uneven results'."""
    tf = pytest.importorskip("tensorflow")

    def step(x, k):
        with tf.GradientTape() as tape:
            tape.watch([x, k])
            y = tf.nn.relu(tf.nn.conv2d(tf.pad(x, [[0, 0], pads, pads, [0, 0]]), k, stride, "VALID"))
            loss = tf.reduce_sum(y * y)
        return [y, loss] + tape.gradient(loss, [x, k]) if gradient else y

    text = tf.function(step, jit_compile=True).experimental_get_compiler_ir(
        tf.zeros((2, rows, rows, 3)), tf.zeros((window, window, 3, 4)))(stage="hlo")
    module, report = _compare(text, "spatial-partitioning{split=0:1}")
    assert _count(module, "collective-permute") > 0 and _count(module, "pad") == 0
    gathers = [line for line in report if " all-gather " in line and "at the result" not in line]
    assert not gathers, gathers
    folds = [line for line in report if " fold " in line]
    assert len(folds) == (3 if gradient else 1), folds   # forward + weight gradient + the input gradient's slice
    _partition(text, "spatial-partitioning")   # finds the image without split=


@pytest.mark.parametrize("padded", [True, False], ids=["pad_valid", "same"])
def test_tf_front_end_pad_exchanges_halos_as_same_does(padded):
    """The issue's program through `xla_passes.tensorflow.function`: conv2d(tf.pad(x), k, 1,
    "VALID") exchanges halos as conv2d(x, k, 1, "SAME") does, and gives TF's numbers."""
    tf = pytest.importorskip("tensorflow")
    import xla_passes.tensorflow

    k = tf.constant(np.random.default_rng(1).standard_normal((3, 3, 3, 4)).astype(np.float32))

    def step(x):
        if padded:
            return tf.nn.conv2d(tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]]), k, 1, "VALID")
        return tf.nn.conv2d(x, k, 1, "SAME")

    ours = xla_passes.tensorflow.function(step, passes="spatial-partitioning{num_partitions=4,split=0:1}")
    x = np.random.default_rng(2).standard_normal((2, 16, 16, 3)).astype(np.float32)
    np.testing.assert_allclose(ours(x).numpy(), tf.function(step, jit_compile=True)(x).numpy(), rtol=1e-5, atol=1e-5)
    module = hlo_tools.parse_module(ours.module_text(x))
    assert _count(module, "collective-permute") == 2 and _count(module, "all-gather") == 0
