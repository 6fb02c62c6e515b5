"""distributed-batch-norm: per-replica batch norm becomes batch norm over groups of k replicas.

The differential check: a Flax (linen) convnet whose `nn.BatchNorm` has `axis_name=None` (each
replica's own statistics) trains data parallel over 8 devices (`shard_map`), compiled with
`xla_passes.jax.jit(step, passes="distributed-batch-norm{group_size=2}")`. Its loss, gradients
(averaged and per device) and updated batch statistics (per device) must equal JAX's own grouped
batch norm: the same step over a (4, 2) mesh ('groups', 'members') whose BatchNorm has
`axis_name="members"`, the batch split over both axes in the same order. Without the pass the two
differ (checked too, so the comparison means something).

At the flag (`xla_passes.jax.enable`, the fused module XLA hands its hook), the same comparison for
the `shard_map` step and the zoo's ResNet, and jit steps with a sharded batch (batch norm that
XLA's partitioner synchronized, regrouped) through sgd and adam; the hook's forms are pinned in
distributed_batch_norm_hook.hlo.
"""
from __future__ import annotations

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import hlo_tools
from xla_passes.analysis.replica_groups import written_groups
import xla_passes
import xla_passes.jax
from few_compiles import initial_state, optimizer_step, per_device_copies
from hlo_tools.xla import runner, xla_bridge
from xla_passes.passes.distributed_batch_norm import DistributedBatchNorm

RTOL, ATOL = 1e-5, 1e-6


class ConvNet(nn.Module):
    """Two Conv + BatchNorm + relu layers, a spatial mean and a Dense head."""

    axis_name: str | None = None
    classes: int = 5
    fast_variance: bool = True   # False: the variance as the mean of (x - mean)^2
    axis_index_groups: object = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 axis_name=self.axis_name if train else None,
                                 use_fast_variance=self.fast_variance, axis_index_groups=self.axis_index_groups)
        x = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        x = nn.relu(norm()(nn.Conv(8, (3, 3), strides=(2, 2), use_bias=False)(x)))
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


BATCH_PER_DEVICE, IMAGE = 3, (8, 8, 3)


def _step(model, axes):
    """Loss, averaged gradients, per-device gradients and per-device new batch statistics."""
    def step(params, stats, images, labels):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": stats}, images, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates["batch_stats"]

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        stack = functools.partial(jax.tree.map, lambda a: a[None])
        return jax.lax.pmean(loss, axes), jax.lax.pmean(grads, axes), stack(grads), stack(new_stats)
    return step


def _data(mesh, spec):
    rng = np.random.default_rng(0)
    images = rng.standard_normal((8 * BATCH_PER_DEVICE, *IMAGE)).astype(np.float32) * 2 + 0.5
    labels = rng.integers(0, 5, (8 * BATCH_PER_DEVICE,)).astype(np.int32)
    return jax.device_put((images, labels), NamedSharding(mesh, spec))


def _variables():
    variables = jax.jit(functools.partial(ConvNet().init, train=False))(jax.random.key(0), jnp.zeros((1, *IMAGE)))
    stats = jax.tree.map(lambda a: np.asarray(a) + 0.25, variables["batch_stats"])  # running stats away from 0 and 1
    return variables["params"], stats


def per_replica_step(fast_variance: bool = True):
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    batch = P("data")
    step = jax.shard_map(_step(ConvNet(axis_name=None, fast_variance=fast_variance), "data"), mesh=mesh,
                         in_specs=(P(), P(), batch, batch), out_specs=(P(), P(), batch, batch), check_vma=False)
    return step, (*_variables(), *_data(mesh, batch))


def grouped_reference(k: int = 2, fast_variance: bool = True):
    """JAX's own grouped batch norm: BatchNorm(axis_name='members') over a (8/k, k) mesh."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // k, k), ("groups", "members"))
    axes, batch = ("groups", "members"), P(("groups", "members"))
    step = jax.shard_map(_step(ConvNet(axis_name="members", fast_variance=fast_variance), axes), mesh=mesh,
                         in_specs=(P(), P(), batch, batch), out_specs=(P(), P(), batch, batch), check_vma=False)
    return jax.jit(step)(*_variables(), *_data(mesh, batch))


def _max_differences(got, want) -> dict[str, float]:
    names = ["loss", "grads", "per-device grads", "per-device batch stats"]
    out = {}
    for name, a, b in zip(names, got, want):
        leaves = list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        assert jax.tree.structure(a) == jax.tree.structure(b)
        out[name] = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in leaves)
    return out


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def reference():
    return grouped_reference(2)


def test_flax_step_equals_jax_grouped_batch_norm(reference):
    step, args = per_replica_step()
    ours = xla_passes.jax.jit(step, passes="distributed-batch-norm{group_size=2}")
    got = ours(*args)
    differences = _max_differences(got, reference)
    print("max abs differences against BatchNorm(axis_name='members') on a (4, 2) mesh:", differences)
    _assert_close(got, reference)
    # the comparison has teeth: the per-replica step itself is far from the grouped one
    plain = jax.jit(step)(*args)
    assert max(_max_differences(plain, reference).values()) > 1e-2
    # two layers: 2 statistics and 2 gradients each
    grouped = [line for line in ours.reports if "summed over {{0,1},{2,3},{4,5},{6,7}}" in line]
    assert sum("statistic (mean" in line for line in grouped) == 4
    assert sum("gradient through a statistic" in line for line in grouped) == 4


def test_groups_of_four():
    reference = grouped_reference(4)
    step, args = per_replica_step()
    got = xla_passes.jax.jit(step, passes="distributed-batch-norm{group_size=4}")(*args)
    _assert_close(got, reference)


def test_centered_variance():
    """use_fast_variance=False: var = mean((x - mean)^2), a statistic that reads another one."""
    reference = grouped_reference(2, fast_variance=False)
    step, args = per_replica_step(fast_variance=False)
    ours = xla_passes.jax.jit(step, passes="distributed-batch-norm{group_size=2}")
    got = ours(*args)
    print("centered variance, max abs differences:", _max_differences(got, reference))
    _assert_close(got, reference)
    assert sum("gradient through a statistic" in line for line in ours.reports) == 4


def test_explicit_groups_equal_group_size():
    step, args = per_replica_step()
    text = xla_bridge.lowered_module_text(jax.jit(step).lower(*args))
    a, b = hlo_tools.parse_module(text), hlo_tools.parse_module(text)
    assert xla_passes.run_passes(a, "distributed-batch-norm{group_size=2}")
    assert xla_passes.run_passes(b, "distributed-batch-norm{groups=0:1;2:3;4:5;6:7}")
    assert a.to_text() == b.to_text()


def _lowered_text():
    step, args = per_replica_step()
    return xla_bridge.lowered_module_text(jax.jit(step).lower(*args))


def test_report_says_what_it_grouped_and_why_it_kept_the_rest():
    module = hlo_tools.parse_module(_lowered_text())
    pipeline = xla_passes.Pipeline("distributed-batch-norm{group_size=2}")
    assert pipeline.run(module)
    report = pipeline.reports()
    print("\n".join(report))
    kept = [line for line in report if ": kept: " in line]
    # the loss (a scalar mean), the BN bias/scale gradients and the Dense bias gradient (sums, not means)
    assert any("a mean over every dimension" in line for line in kept)
    assert any("is not divided by its" in line for line in kept)
    assert any("users besides its mean" in line for line in kept)   # dy*(x-mean): scale gradient and var
    statistics = [line for line in report if "statistic (mean over dims {0,1,2}" in line]
    assert len(statistics) == 4 and all("divisor" in line for line in statistics)
    # every new all-reduce sums over pairs; the step's own all-reduces (over all 8) are untouched
    groups = {str(written_groups(i)) for i in module.instructions() if i.opcode == "all-reduce"}
    assert groups == {"[[0, 1], [2, 3], [4, 5], [6, 7]]", "[[0, 1, 2, 3, 4, 5, 6, 7]]"}


# -- refusals ----------------------------------------------------------------------------------------

def _report(text: str, passes: str) -> tuple[bool, list[str]]:
    module = hlo_tools.parse_module(text)
    pipeline = xla_passes.Pipeline(passes)
    changed = pipeline.run(module)
    return changed, pipeline.reports()


def test_refuses_when_a_statistic_has_no_gradient():
    """Hide one gradient's count (divide by maximum(count, count), which the pass does not fold): the
    local sums of the backward pass would reach the examples ungrouped, so nothing changes."""
    text = _lowered_text()
    module = hlo_tools.parse_module(text)
    p = DistributedBatchNorm(group_size=2)
    assert p.run(module)
    gradient = next(line for line in p.report if "gradient through" in line).split(":")[0].lstrip("%")
    original = hlo_tools.parse_module(text)
    divide = original.find(gradient)
    hidden = divide.parent.add_instruction("maximum", [divide.operand(1), divide.operand(1)], before=divide)
    divide.set_operand(1, hidden)   # the same value, but not a constant count any more
    changed, report = _report(original.to_text(), "distributed-batch-norm{group_size=2}")
    assert not changed
    assert report[-1].startswith("unchanged: %") and "flows back into the examples ungrouped" in report[-1]


def test_refuses_group_size_that_does_not_divide():
    changed, report = _report(_lowered_text(), "distributed-batch-norm{group_size=3}")
    assert not changed and report == ["unchanged: group_size=3 does not divide the 8 devices along the batch axis"]


def test_refuses_a_batch_split_over_a_sub_axis():
    """Shardy's `"data":(1)2` is a part of the axis: the devices that share a batch are not those
    along the axis, so the pass refuses (it read the sub-axis as the whole axis before)."""
    text = _lowered_text().replace('<@mesh, [{\\"data\\"}, {}, {}, {}]>', '<@mesh, [{\\"data\\":(1)2}, {}, {}, {}]>')
    assert '{\\"data\\":(1)2}' in text
    changed, report = _report(text, "distributed-batch-norm{group_size=2}")
    assert not changed
    assert report == ['unchanged: shard_map operand 12 is split by something else than whole mesh axes (a sub-axis, '
                      'an open dimension or a priority): {"data":(1)2}, {}, {}, {}']


def test_refuses_a_module_without_a_batch():
    text = """HloModule nobatch, replica_count=2

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY main {
  x = f32[4,3] parameter(0)
  zero = f32[] constant(0)
  ROOT s = f32[3] reduce(x, zero), dimensions={0}, to_apply=add
}
"""
    changed, report = _report(text, "distributed-batch-norm{group_size=2}")
    assert not changed and "no per-device batch" in report[0]


def test_a_fused_module_it_refuses_is_left_as_it_was():
    """At the hook the pass inlines fusions to see the dataflow; refusing, it restores them."""
    text = """HloModule fused, replica_count=2

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

fused_reduce {
  p = f32[4,3] parameter(0)
  zero = f32[] constant(0)
  ROOT s = f32[3] reduce(p, zero), dimensions={0}, to_apply=add
}

ENTRY main {
  x = f32[4,3] parameter(0)
  ROOT f = f32[3] fusion(x), kind=kLoop, calls=fused_reduce
}
"""
    module = hlo_tools.parse_module(text)
    before = module.to_text()
    pipeline = xla_passes.Pipeline("distributed-batch-norm{group_size=2}")
    assert not pipeline.run(module)
    assert module.to_text() == before
    assert "no per-device batch" in pipeline.reports()[-1]


def test_bad_options():
    for text, message in [("distributed-batch-norm", "give group_size=k or groups="),
                          ("distributed-batch-norm{group_size=2,groups=0:1}", "give one of"),
                          ("distributed-batch-norm{groups=0:1;2}", "groups of the same size")]:
        with pytest.raises(xla_passes.PassError, match=message):
            xla_passes.Pipeline(text)


# -- the hand-written replica program of distributed_batch_norm.hlo, run on 8 replicas ---------------

def _filecheck_module(label: str) -> str:
    import pathlib  # noqa: PLC0415
    text = (pathlib.Path(__file__).parent / "distributed_batch_norm.hlo").read_text()
    chunk = next(c for c in text.split("// -----") if f"HloModule {label}," in c)
    return chunk[chunk.index(f"HloModule {label},"):]


def _batch_norm_and_gradient(x, dy):
    """y = (x - mean) * rsqrt(var + 1e-5) over dims (0, 1), and its gradient along dy (JAX's vjp)."""
    def bn(x):
        mean = x.mean(axis=(0, 1))
        var = (x * x).mean(axis=(0, 1)) - mean * mean
        return (x - mean) * jax.lax.rsqrt(var + 1e-5), mean, var

    (y, mean, var), vjp = jax.vjp(bn, x)
    (dx,) = vjp((dy, jnp.zeros_like(mean), jnp.zeros_like(var)))
    return y, dx, mean, var


@pytest.mark.parametrize("groups", [None, [[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1, 2, 3, 4, 5, 6, 7]]])
def test_replica_program_equals_batch_norm_of_each_groups_batch(groups):
    text = _filecheck_module("batch_norm_step")
    if groups is None:
        passes, groups = "distributed-batch-norm{group_size=2,batch_parameters=0:1}", [[0, 1], [2, 3], [4, 5], [6, 7]]
    else:
        spelled = ";".join(":".join(map(str, g)) for g in groups)
        passes = f"distributed-batch-norm{{groups={spelled},batch_parameters=0:1}}"
    module = hlo_tools.parse_module(text)
    assert xla_passes.run_passes(module, passes)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 2, 3, 4)) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal((8, 2, 3, 4)).astype(np.float32)
    got = runner.run_module(module.to_text(), [x, dy], num_replicas=8).outputs
    worst = 0.0
    for group in groups:
        y, dx, mean, var = (np.asarray(a) for a in _batch_norm_and_gradient(
            jnp.concatenate(list(x[group])), jnp.concatenate(list(dy[group]))))
        for position, replica in enumerate(group):
            rows = slice(2 * position, 2 * position + 2)
            for out, want in zip(got, (y[rows], dx[rows], mean, var)):
                np.testing.assert_allclose(out[replica], want, rtol=RTOL, atol=1e-5)
                worst = max(worst, float(np.max(np.abs(out[replica] - want))))
    print(f"groups {groups}: max abs difference {worst:.2e}")
    # and the original program is each replica's own batch norm
    plain = runner.run_module(text, [x, dy], num_replicas=8).outputs
    y, dx, mean, var = (np.asarray(a) for a in _batch_norm_and_gradient(jnp.asarray(x[5]), jnp.asarray(dy[5])))
    np.testing.assert_allclose(plain[1][5], dx, rtol=RTOL, atol=1e-5)


def test_refuses_a_batch_norm_already_synchronized_over_the_replicas():
    """xla_passes_demo.models' ResNet: BatchNorm(axis_name="data") already averages over all 8 devices."""
    from xla_passes_demo import models  # noqa: PLC0415

    mesh = jax.make_mesh((8,), ("data",))
    step, args = models.data_parallel_step(models.small_resnet(), mesh)
    text = xla_bridge.lowered_module_text(step.lower(*args))
    changed, report = _report(text, "distributed-batch-norm{group_size=2}")
    assert not changed
    assert report[-1].startswith("unchanged: the mean of %") and "already all-reduced across devices" in report[-1]


# -- Keras 3 BatchNormalization on the JAX backend -------------------------------------------------------

def _keras():
    """Keras on JAX in this process; the variable is put back so child processes choose their own backend."""
    before = os.environ.get("KERAS_BACKEND")
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        keras = pytest.importorskip("keras")
    finally:
        if before is None:
            del os.environ["KERAS_BACKEND"]
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras runs on {keras.backend.backend()} in this process, not JAX")
    return keras


def test_keras_batch_normalization_equals_batch_norm_of_each_groups_batch():
    """Keras' moments on JAX: jnp.mean, and jnp.var (a jitted call: call-inliner first) whose count is
    computed as `108 - 0`. The reference runs the same layers on each group's 6 examples on one device."""
    keras = _keras()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(IMAGE), keras.layers.Conv2D(8, 3, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(),
                              keras.layers.Conv2D(8, 3, strides=2, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5)])
    trainable = [v.value for v in model.trainable_variables]
    statistics = [v.value for v in model.non_trainable_variables]

    def local(trainable, statistics, images, labels):
        def loss_fn(trainable):
            logits, new_statistics = model.stateless_call(trainable, statistics, images, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True).mean()
            return loss, new_statistics
        (loss, new_statistics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        return loss, grads, new_statistics

    def step(trainable, statistics, images, labels):
        loss, grads, new_statistics = local(trainable, statistics, images, labels)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data"), [a[None] for a in new_statistics]

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                         out_specs=(P(), P(), P("data")), check_vma=False)
    images, labels = _data(mesh, P("data"))
    ours = xla_passes.jax.jit(step, passes="call-inliner,distributed-batch-norm{group_size=2}")
    loss, grads, new_statistics = ours(trainable, statistics, images, labels)
    assert sum("summed over {{0,1},{2,3},{4,5},{6,7}}" in line for line in ours.reports) >= 12

    images, labels = np.asarray(images), np.asarray(labels)
    per_group = [jax.jit(local)(trainable, statistics, images[6 * g:6 * g + 6], labels[6 * g:6 * g + 6])
                 for g in range(4)]
    want_loss = np.mean([float(r[0]) for r in per_group])
    want_grads = [np.mean([np.asarray(r[1][i]) for r in per_group], axis=0) for i in range(len(trainable))]
    worst = {"loss": abs(float(loss) - want_loss)}
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
    worst["grads"] = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(grads, want_grads))
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=ATOL)
    worst["batch stats"] = 0.0
    for i, stacked in enumerate(new_statistics):
        for device in range(8):
            want = np.asarray(per_group[device // 2][2][i])
            np.testing.assert_allclose(np.asarray(stacked)[device], want, rtol=RTOL, atol=ATOL)
            worst["batch stats"] = max(worst["batch stats"], float(np.max(np.abs(np.asarray(stacked)[device] - want))))
    print("Keras, max abs differences against each group's batch on one device:", worst)


# -- xla_passes_demo.models' ResNet (bottleneck blocks, residuals, strides, max pool) ---------------------------

def _resnet_step(k: int):
    """The ResNet's BatchNorm averages over the mesh axis "data": on a (8, 1) mesh ('replicas', 'data')
    that is each device's own batch (a pmean over one device), on a (8/k, k) mesh a group of k."""
    from xla_passes_demo import models  # noqa: PLC0415

    spec = models.small_resnet()
    variables = jax.jit(functools.partial(spec.model.init, train=False))(jax.random.key(0),
                                                                        jnp.zeros((1, *spec.example_shape)))
    params, state = variables["params"], {key: v for key, v in variables.items() if key != "params"}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // k, k), ("replicas", "data"))
    axes = ("replicas", "data")

    def step(params, state, images, labels):
        loss, grads, updates = models.loss_and_gradients(spec, params, state, images, labels)
        stack = functools.partial(jax.tree.map, lambda a: a[None])
        return jax.lax.pmean(loss, axes), jax.lax.pmean(grads, axes), stack(grads), stack(updates)

    batch = P(axes) if k > 1 else P("replicas")
    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), batch, batch), out_specs=(P(), P(), batch, batch),
                         check_vma=False)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((16, *spec.example_shape)).astype(np.float32)
    labels = rng.integers(0, spec.classes, (16,)).astype(np.int32)
    return step, (params, state, *jax.device_put((images, labels), NamedSharding(mesh, batch)))


def test_resnet_equals_jax_grouped_batch_norm():
    step, args = _resnet_step(1)
    ours = xla_passes.jax.jit(step, passes="distributed-batch-norm{group_size=2}")
    got = ours(*args)
    reference_step, reference_args = _resnet_step(2)
    reference = jax.jit(reference_step)(*reference_args)
    print("ResNet, max abs differences against BatchNorm over a 2-device axis:", _max_differences(got, reference))
    _assert_close(got, reference)
    layers = 1 + 4 * 2   # the stem and two bottleneck blocks with projections
    assert sum("statistic (mean" in line for line in ours.reports) == 2 * layers
    assert sum("gradient through a statistic" in line for line in ours.reports) == 2 * layers


def _at_the_hook(step, args, passes="distributed-batch-norm{group_size=2}"):
    """`step` compiled by jax.jit with the passes at JAX's compile hook (post-fusion modules);
    the reports of the module XLA compiled."""
    with xla_passes.jax.enable(passes, strict=True, dump_to=None):
        compiled = jax.jit(lambda *a: step(*a)).lower(*args).compile()
    return compiled(*args)


@pytest.mark.parametrize("fast_variance", [True, False])
def test_at_the_jax_hook_equals_jax_grouped_batch_norm(fast_variance):
    """XLA_PASSES: the hook's module is fused and simplified (divides folded into other constants);
    the pass inlines it, groups every sum over the batch that the examples read as a mean, and the
    step equals JAX's own grouped batch norm."""
    step, args = per_replica_step(fast_variance)
    got = _at_the_hook(step, args)
    reference = grouped_reference(2, fast_variance)
    print("at the hook, max abs differences against BatchNorm(axis_name='members'):",
          _max_differences(got, reference))
    _assert_close(got, reference)
    plain = jax.jit(step)(*args)
    assert max(_max_differences(plain, reference).values()) > 1e-2


def test_resnet_at_the_jax_hook_equals_jax_grouped_batch_norm():
    """The zoo's ResNet at the flag: XLA's layout bitcasts merge the batch with the spatial
    dimensions, its max pool's backward pass is a scatter whose indices carry each row's example
    number, and its simplifier turns -0.5 and 1/count into look-alike constants (count 8 here)."""
    step, args = _resnet_step(1)
    got = _at_the_hook(step, args)
    reference_step, reference_args = _resnet_step(2)
    reference = jax.jit(reference_step)(*reference_args)
    print("ResNet at the hook, max abs differences:", _max_differences(got, reference))
    _assert_close(got, reference)


def _jit_step(model, tx):
    """A jit training step: loss, new parameters, new batch statistics, new optimizer state."""
    def step(params, stats, opt_state, images, labels):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": stats}, images, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        changes, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, changes), updates["batch_stats"], opt_state
    return step


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_jit_with_a_sharded_batch_at_the_jax_hook_equals_jax_grouped_batch_norm(optimizer):
    """jit with NamedSharding: XLA's partitioner sums the statistics over every device. The pass
    regroups them, and the values that leave the groups (gradients built from the statistics, the
    moving averages) get the mean over the groups before the optimizer reads them, so that a
    nonlinear optimizer (adam) updates with the grouped step's gradient."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    tx = optax.sgd(0.1, momentum=0.9) if optimizer == "sgd" else optax.adam(1e-2)
    step = _jit_step(ConvNet(axis_name=None), tx)
    params, stats = _variables()
    args = (params, stats, initial_state(tx, params), *_data(mesh, P("data")))
    got = _at_the_hook(step, args)
    # JAX's grouped batch norm: each group of 2 devices' statistics, gradients averaged over every
    # device, and the moving averages averaged over the groups (each group has its own)
    loss, grads, _, device_stats = grouped_reference(2)
    new_params, opt_state = optimizer_step(tx, grads, args[2], params)
    want = (loss, new_params, jax.tree.map(lambda a: np.asarray(a).mean(axis=0), device_stats), opt_state)
    for name, a, b in zip(("loss", "params", "batch stats", "optimizer state"), got, want):
        worst = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        print(f"jit at the hook, {optimizer}, {name}: max abs difference {worst:.2e}")
    _assert_close(got, want)
    plain = jax.jit(step)(*args)
    assert max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(want[1]))) > 1e-3


def test_dropout_drawn_inside_the_step_at_the_jax_hook(tmp_path):
    """Dropout's random bits drawn inside the step, as Keras's Dropout layers draw them (in
    EfficientNetB0): XLA computes them in a loop, whose values are not per example (the key and
    counters), so the pass follows the masked images into the statistics and groups them; the step
    equals JAX's grouped batch norm of the same masked images (JAX's random bits do not depend on
    the sharding)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    model = ConvNet(axis_name=None)
    keep = 0.75

    def masked(images, key):
        return images * jax.random.bernoulli(key, keep, (images.shape[0], 1, 1, 1)) / keep

    def step(params, stats, images, labels, key):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": stats}, masked(images, key),
                                          mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, grads, updates["batch_stats"]

    params, stats = _variables()
    images, labels = _data(mesh, P("data"))
    key = jax.random.key(7)
    args = (params, stats, images, labels, key)
    with xla_passes.jax.enable("distributed-batch-norm{group_size=2}", strict=True, dump_to=str(tmp_path)):
        compiled = jax.jit(lambda *a: step(*a)).lower(*args).compile()   # its own cache entry
    got = compiled(*args)
    hook_modules = [f.read_text() for f in tmp_path.glob("*jit__lambda.before_xla_passes*")]
    assert hook_modules and all(" while(" in text for text in hook_modules)   # the random bits' loop

    k = 2
    group_mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // k, k), ("groups", "members"))
    axes, batch = ("groups", "members"), P(("groups", "members"))
    reference = jax.shard_map(_step(ConvNet(axis_name="members"), axes), mesh=group_mesh,
                              in_specs=(P(), P(), batch, batch), out_specs=(P(), P(), batch, batch), check_vma=False)
    masked_images = jax.device_put(masked(np.asarray(images), key), NamedSharding(group_mesh, batch))
    loss, grads, _, device_stats = jax.jit(reference)(params, stats, masked_images,
                                                      jax.device_put(np.asarray(labels), NamedSharding(group_mesh, batch)))
    want = (loss, grads, jax.tree.map(lambda a: a.mean(axis=0), device_stats))
    _assert_close(got, want)
    plain = jax.jit(step)(*args)
    assert max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(want[1]))) > 1e-3


def _pmap_step(model, tx):
    """A `jax.pmap` training step as flax's imagenet example writes it: per-device loss, gradients
    averaged with `pmean`, every output per device."""
    def step(params, stats, opt_state, images, labels):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": stats}, images, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        changes, opt_state = tx.update(jax.lax.pmean(grads, "batch"), opt_state, params)
        return (jax.lax.pmean(loss, "batch"), optax.apply_updates(params, changes), updates["batch_stats"],
                opt_state)
    return step


def _pmap_args(variables, tx, batch_per_device=BATCH_PER_DEVICE):
    params, stats = variables["params"], variables.get("batch_stats", {})
    rng = np.random.default_rng(1)
    images = rng.standard_normal((8, batch_per_device, *IMAGE)).astype(np.float32) * 2 + 0.5
    labels = rng.integers(0, 5, (8, batch_per_device)).astype(np.int32)
    return (per_device_copies(params), per_device_copies(stats), per_device_copies(initial_state(tx, params)), images,
            labels)


def _pmap_at_the_hook(step, args, passes):
    with xla_passes.jax.enable(passes, strict=True, dump_to=None):
        return jax.pmap(lambda *a: step(*a), axis_name="batch")(*args)


def _assert_step_close(got, want, plain, label):
    for name, a, b in zip(("loss", "params", "batch stats", "optimizer state"), got, want):
        worst = max((float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                     for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))), default=0.0)
        print(f"at the hook, {label}, {name}: max abs difference {worst:.2e}")
    _assert_close(got, want)
    assert max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(plain[1:3]), jax.tree.leaves(want[1:3]))) > 1e-3


GROUPS_OF_TWO = [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_pmap_step_at_the_jax_hook_equals_jax_grouped_batch_norm(optimizer):
    """jax.pmap with `BatchNorm(axis_name="batch")`, flax's imagenet example: the statistics are
    pmeaned over all 8 devices (one all-reduce of the devices' means; JAX's transpose divides by
    the devices before its all-reduce). The pass regroups them, and every output stays each
    device's own: equal to `BatchNorm(axis_index_groups=...)`, each device with its group's
    moving averages."""
    tx = optax.sgd(0.1, momentum=0.9) if optimizer == "sgd" else optax.adam(1e-2)
    params, stats = _variables()
    args = _pmap_args({"params": params, "batch_stats": stats}, tx)
    got = _pmap_at_the_hook(_pmap_step(ConvNet(axis_name="batch"), tx), args, "distributed-batch-norm{group_size=2}")
    grouped = ConvNet(axis_name="batch", axis_index_groups=GROUPS_OF_TWO)
    want = jax.pmap(_pmap_step(grouped, tx), axis_name="batch")(*args)
    plain = jax.pmap(_pmap_step(ConvNet(axis_name="batch"), tx), axis_name="batch")(*args)
    _assert_step_close(got, want, plain, f"pmap, {optimizer}")


def test_resnet_pmap_step_at_the_jax_hook_equals_jax_grouped_batch_norm():
    """The zoo's ResNet (flax's imagenet example: `BatchNorm(axis_name="data")`) in a `jax.pmap`
    step with adam: equal to the ResNet whose BatchNorm averages over groups of 2 devices (a (4, 2)
    mesh), each device keeping its group's statistics."""
    from xla_passes_demo import models  # noqa: PLC0415

    spec = models.small_resnet()
    tx = optax.adam(1e-2)
    reference_step, (params, state, images, labels) = _resnet_step(2)

    def step(params, state, opt_state, images, labels):
        loss, grads, updates = models.loss_and_gradients(spec, params, state, images, labels)
        changes, opt_state = tx.update(jax.lax.pmean(grads, "data"), opt_state, params)
        return jax.lax.pmean(loss, "data"), optax.apply_updates(params, changes), updates, opt_state

    per_device = functools.partial(jax.tree.map, lambda a: np.asarray(a).reshape(8, -1, *np.shape(a)[1:]))
    args = (*per_device_copies((params, state, initial_state(tx, params))), *per_device((images, labels)))
    with xla_passes.jax.enable("distributed-batch-norm{group_size=2}", strict=True, dump_to=None):
        got = jax.pmap(lambda *a: step(*a), axis_name="data")(*args)
    loss, grads, _, device_updates = jax.jit(reference_step)(params, state, images, labels)
    new_params, opt_state = optimizer_step(tx, grads, initial_state(tx, params), params)
    want = (loss, new_params, device_updates, opt_state)
    want = (*per_device_copies((want[0], want[1])), want[2], per_device_copies(want[3]))
    plain = jax.pmap(step, axis_name="data")(*args)
    _assert_step_close(got, want, plain, "pmap, ResNet, adam")


@pytest.mark.parametrize("style", ["pmap", "jit", "shard_map"])
def test_one_example_per_device(style, caplog):
    """One example per device, where grouping matters most: XLA drops the unit batch dimension at
    the hook, so the pass follows only which values are the device's example's. Where batch norm
    sums the statistics over the devices (jax.pmap with axis_name, a jit step with a sharded batch)
    those sums are the statistics, regrouped as with more examples; in a shard_map step with
    per-device batch norm a sum over the example's pixels is also what a pooling computes, and
    the pass refuses."""
    tx = optax.adam(1e-2)
    params, stats = _variables()
    args = _pmap_args({"params": params, "batch_stats": stats}, tx, batch_per_device=1)
    want = jax.pmap(_pmap_step(ConvNet(axis_name="batch", axis_index_groups=GROUPS_OF_TWO), tx),
                    axis_name="batch")(*args)
    if style == "pmap":
        got = _pmap_at_the_hook(_pmap_step(ConvNet(axis_name="batch"), tx), args,
                                "distributed-batch-norm{group_size=2}")
        plain = jax.pmap(_pmap_step(ConvNet(axis_name="batch"), tx), axis_name="batch")(*args)
        _assert_step_close(got, want, plain, "pmap, one example per device")
        return
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    images, labels = jax.device_put((args[3].reshape(8, *IMAGE), args[4].reshape(8)), NamedSharding(mesh, P("data")))
    if style == "jit":
        jit_args = (params, stats, initial_state(tx, params), images, labels)
        got = _at_the_hook(_jit_step(ConvNet(axis_name=None), tx), jit_args)
        first = functools.partial(jax.tree.map, lambda a: np.asarray(a)[0])
        grouped = (*first((want[0], want[1])), jax.tree.map(lambda a: np.asarray(a).mean(axis=0), want[2]),
                   first(want[3]))   # the moving averages: the mean over the groups
        plain = (None, *jax.jit(_jit_step(ConvNet(axis_name=None), tx))(*jit_args)[1:])
        _assert_step_close(got, grouped, plain, "jit, one example per device")
        return
    step = jax.shard_map(_step(ConvNet(axis_name=None), "data"), mesh=mesh,
                         in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P("data"), P("data")),
                         check_vma=False)
    with caplog.at_level("INFO", logger="xla_passes"):
        got = _at_the_hook(step, (params, stats, images, labels))
    _assert_close(got, jax.jit(step)(params, stats, images, labels))
    assert any("unchanged: one example per device" in r.getMessage() for r in caplog.records)


class PmapMLP(nn.Module):
    """Dense + BatchNorm(axis_name) with no convolution: the pass cannot tell the images from the
    weights, all mapped over the devices alike, without batch_parameters=."""

    axis_index_groups: object = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x.reshape(x.shape[0], -1)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name="batch",
                         axis_index_groups=self.axis_index_groups)(nn.Dense(16)(x))
        return nn.Dense(5)(nn.relu(x))


def test_pmap_step_without_a_convolution_needs_batch_parameters(caplog):
    tx = optax.sgd(0.1)
    variables = jax.jit(PmapMLP().init)(jax.random.key(0), jnp.zeros((1, *IMAGE)))
    args = _pmap_args(variables, tx)
    step = _pmap_step(PmapMLP(), tx)
    plain = jax.pmap(step, axis_name="batch")(*args)
    with caplog.at_level("INFO", logger="xla_passes"):
        unchanged = _pmap_at_the_hook(step, args, "distributed-batch-norm{group_size=2}")
    _assert_close(unchanged, plain)
    assert any("no entry parameter feeding a convolution's input: name its batch parameters with "
               "batch_parameters=" in r.getMessage() for r in caplog.records)
    images = len(jax.tree.leaves(args[:3]))   # the entry parameters are the flattened arguments
    got = _pmap_at_the_hook(step, args, f"distributed-batch-norm{{group_size=2,batch_parameters={images}}}")
    want = jax.pmap(_pmap_step(PmapMLP(axis_index_groups=GROUPS_OF_TWO), tx), axis_name="batch")(*args)
    _assert_step_close(got, want, plain, "pmap, Dense with batch_parameters=")


def test_only_a_sum_is_linear_among_reductions():
    """The mean over the groups passes through a sum of a gradient, not through its maximum: a
    max-reduce of what leaves the groups must read the mean, not give the mean of the groups' maxima."""
    from xla_passes.passes.distributed_batch_norm import _combined_linearity

    module = hlo_tools.parse_module("""HloModule reductions

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

max {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] maximum(a, b)
}

ENTRY main {
  g = f32[4]{0} parameter(0)
  zero = f32[] constant(0)
  total = f32[] reduce(g, zero), dimensions={0}, to_apply=add
  largest = f32[] reduce(g, zero), dimensions={0}, to_apply=max
  ROOT t = (f32[], f32[]) tuple(total, largest)
}
""")
    assert _combined_linearity(module.entry.get("total"), [1, 0]) == 1
    assert _combined_linearity(module.entry.get("largest"), [1, 0]) is None
    assert _combined_linearity(module.entry.get("largest"), [0, 0]) == 0


def test_refuses_a_jit_program_before_spmd_partitioning():
    """JAX's lowering of a jit step with a sharded batch is one global program: its sums over the
    batch are whole, not per device, so there is nothing to group before XLA's partitioner runs
    (at the hook, or after spatial-partitioning's split of the batch, there is)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    model = ConvNet(axis_name=None)

    def forward(params, stats, images):
        return model.apply({"params": params, "batch_stats": stats}, images, mutable=["batch_stats"])

    params, stats = _variables()
    images, _ = _data(mesh, P("data"))
    text = jax.jit(forward).lower(params, stats, images).as_text(dialect="hlo")
    changed, report = _report(text, "distributed-batch-norm{group_size=2}")
    assert not changed
    assert report[-1].startswith("unchanged: a jit program before SPMD partitioning"), report


def test_refuses_statistics_synchronized_inside_a_shard_map(caplog):
    """BatchNorm(axis_name="data") inside a shard_map: the statistics are already summed over the
    axis and the step's outputs may be per device, so the pass does not regroup them; XLA's own step."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    step = jax.shard_map(_step(ConvNet(axis_name="data"), "data"), mesh=mesh,
                         in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P("data"), P("data")),
                         check_vma=False)
    args = (*_variables(), *_data(mesh, P("data")))
    with caplog.at_level("INFO", logger="xla_passes"):
        got = _at_the_hook(step, args)
    _assert_close(got, jax.jit(step)(*args))
    assert any("unchanged" in r.getMessage() for r in caplog.records)


def test_explicit_non_consecutive_groups():
    """groups=0:2;1:3;4:6;5:7 on the 8-device step equals the (4, 2)-mesh reference fed the batch shards
    in the order 0,2,1,3,4,6,5,7 (so that its pairs hold shards {0,2}, {1,3}, ...)."""
    order = [0, 2, 1, 3, 4, 6, 5, 7]
    step, args = per_replica_step()
    got = xla_passes.jax.jit(step, passes="distributed-batch-norm{groups=0:2;1:3;4:6;5:7}")(*args)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("groups", "members"))
    axes, batch = ("groups", "members"), P(("groups", "members"))
    reference_step = jax.shard_map(_step(ConvNet(axis_name="members"), axes), mesh=mesh,
                                   in_specs=(P(), P(), batch, batch), out_specs=(P(), P(), batch, batch),
                                   check_vma=False)
    images, labels = (np.asarray(a).reshape(8, BATCH_PER_DEVICE, *np.shape(a)[1:])[order].reshape(np.shape(a))
                      for a in args[2:])
    want = jax.jit(reference_step)(*args[:2], *jax.device_put((images, labels), NamedSharding(mesh, batch)))
    _assert_close(got[:2], want[:2])
    for ours, theirs in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(want[2:])):
        np.testing.assert_allclose(np.asarray(ours)[order], np.asarray(theirs), rtol=RTOL, atol=ATOL)
    plain = jax.jit(step)(*args)
    assert max(_max_differences(plain, got).values()) > 1e-2


class MLP(nn.Module):
    """Dense + BatchNorm over a rank-2 activation (statistics over dimension 0 only)."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(nn.Dense(16)(x)))
        return nn.Dense(5)(x)


def test_dense_batch_norm():
    variables = jax.jit(MLP().init)(jax.random.key(1), jnp.zeros((1, *IMAGE)))

    def run(mesh, batch, axes, axis_name, jit):
        step = jax.shard_map(_step(MLP(axis_name=axis_name), axes), mesh=mesh, in_specs=(P(), P(), batch, batch),
                             out_specs=(P(), P(), batch, batch), check_vma=False)
        return jit(step)(variables["params"], variables["batch_stats"], *_data(mesh, batch))

    devices = np.array(jax.devices()[:8])
    ours = xla_passes.jax.jit
    got = run(Mesh(devices, ("data",)), P("data"), "data", None,
              lambda f: ours(f, passes="distributed-batch-norm{group_size=2}"))
    want = run(Mesh(devices.reshape(4, 2), ("groups", "members")), P(("groups", "members")),
               ("groups", "members"), "members", jax.jit)
    print("Dense + BatchNorm, max abs differences:", _max_differences(got, want))
    _assert_close(got, want)


def test_resnet50_groups_every_batch_norm():
    """ResNet-50 at its real size (lowered, not compiled): 53 batch norms, 2 statistics and 2 gradients each."""
    from xla_passes_demo import models  # noqa: PLC0415

    spec = models.resnet50()
    variables = jax.eval_shape(functools.partial(spec.model.init, train=False), jax.random.key(0),
                               jnp.zeros((1, *spec.example_shape)))
    params, state = variables["params"], {key: v for key, v in variables.items() if key != "params"}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("replicas", "data"))
    axes = ("replicas", "data")

    def step(params, state, images, labels):
        loss, grads, updates = models.loss_and_gradients(spec, params, state, images, labels)
        return jax.lax.pmean((loss, grads, updates), axes)

    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replicas"), P("replicas")), out_specs=P(),
                         check_vma=False)
    text = xla_bridge.lowered_module_text(jax.jit(step).lower(params, state, *spec.inputs(16)))
    changed, report = _report(text, "distributed-batch-norm{group_size=4}")
    assert changed
    assert sum("statistic (mean" in line for line in report) == 106
    assert sum("gradient through a statistic" in line for line in report) == 106
    assert all("summed over {{0,1,2,3},{4,5,6,7}}" in line for line in report if ": kept: " not in line)


def test_refuses_an_unbiased_variance_it_does_not_recognise():
    """A hand-made batch norm with jnp.var(ddof=1): the variance's sum is divided by count - 1, not its
    count, so it is no statistic; grouping the mean alone would be wrong, and the module stays as it was."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def step(w, x):
        def loss(w):
            h = x @ w
            normed = (h - h.mean(axis=0)) / jnp.sqrt(jnp.var(h, axis=0, ddof=1) + 1e-5)
            return (normed ** 3).mean()
        return jax.lax.pmean(jax.value_and_grad(loss)(w), "data")

    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    args = (jnp.ones((4, 3)), jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P("data"))))
    module = hlo_tools.parse_module(xla_bridge.lowered_module_text(jax.jit(step).lower(*args)))
    assert xla_passes.run_passes(module, "call-inliner")   # jnp.var is a jitted call
    changed, report = _report(module.to_text(), "distributed-batch-norm{group_size=2}")
    assert not changed
    assert "kept: its sum is not divided by its 2 elements" in "\n".join(report)
    assert report[-1].startswith("unchanged: %") and "flows back into the examples ungrouped" in report[-1]
