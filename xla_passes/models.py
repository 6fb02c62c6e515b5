"""The seeds' model families as Flax modules and data-parallel training steps.

ResNet (the bottleneck ResNet of flax's imagenet example; ResNet-50 is `stage_sizes=(3, 4, 6, 3)`,
`width=64`) and a pre-norm Transformer encoder (BERT-large is 24 layers of width 1024 with 16
heads). One definition serves two uses:

* at test size, a step that compiles in seconds on 8 CPU devices (`data_parallel_step`), so that
  passes are checked on the seeds' model families and not only on MLPs;
* at the seeds' size, without materializing anything (`parameter_shapes`, `step_flops`), so that
  the cost model prices what a pass is worth on a pod (benchmarks/pod_scaling.py).

Batch norm uses `axis_name="data"`: inside the shard_map step its statistics are averaged over
every replica, as in the seeds' distributed batch norm with a group of all replicas.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P


class BottleneckBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, axis_name="data" if train else None)
        residual = x
        y = nn.relu(norm()(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
        y = nn.relu(norm()(nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(y)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(4 * self.features, (1, 1), use_bias=False)(y))
        if residual.shape != y.shape:
            residual = norm()(nn.Conv(4 * self.features, (1, 1), (self.strides, self.strides),
                                      use_bias=False)(residual))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    classes: int = 1000

    @nn.compact
    def __call__(self, images, train: bool = True):
        x = nn.Conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(images)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                 axis_name="data" if train else None)(x))
        x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for stage, blocks in enumerate(self.stage_sizes):
            for block in range(blocks):
                x = BottleneckBlock(self.width * 2 ** stage, 2 if stage > 0 and block == 0 else 1)(x, train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


class TransformerLayer(nn.Module):
    heads: int
    mlp_width: int

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
        y = nn.Dense(self.mlp_width)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(y))


class Transformer(nn.Module):
    """A token classifier: embedding, pre-norm encoder layers, a projection back to the vocabulary."""

    layers: int = 24
    width: int = 1024
    heads: int = 16
    mlp_width: int = 4096
    vocabulary: int = 30522
    max_length: int = 512

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(self.vocabulary, self.width)(tokens)
        x = x + self.param("positions", nn.initializers.normal(0.02), (self.max_length, self.width))[:tokens.shape[1]]
        for _ in range(self.layers):
            x = TransformerLayer(self.heads, self.mlp_width)(x)
        return nn.Dense(self.vocabulary)(nn.LayerNorm()(x))


@dataclass(frozen=True)
class ModelSpec:
    """A model and the shape of one device's batch."""

    name: str
    model: nn.Module
    example_shape: tuple[int, ...]  # one example, e.g. (224, 224, 3) or (512,) tokens
    classes: int

    @property
    def is_image_model(self) -> bool:
        return len(self.example_shape) == 3

    def inputs(self, batch: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        if self.is_image_model:
            return (jax.ShapeDtypeStruct((batch, *self.example_shape), jnp.float32),
                    jax.ShapeDtypeStruct((batch,), jnp.int32))
        tokens = jax.ShapeDtypeStruct((batch, *self.example_shape), jnp.int32)
        return tokens, tokens


def resnet50() -> ModelSpec:
    return ModelSpec("ResNet-50", ResNet(), (224, 224, 3), 1000)


def bert_large() -> ModelSpec:
    return ModelSpec("BERT-large (Transformer encoder)", Transformer(), (512,), 30522)


def small_resnet() -> ModelSpec:
    """ResNet with two stages of one bottleneck block at width 8 on 16x16 images: compiles in seconds."""
    return ModelSpec("ResNet (test size)", ResNet(stage_sizes=(1, 1), width=8, classes=10), (16, 16, 3), 10)


def small_transformer() -> ModelSpec:
    """Two encoder layers of width 32 over 16 tokens of a 64-word vocabulary: compiles in seconds."""
    return ModelSpec("Transformer (test size)",
                     Transformer(layers=2, width=32, heads=4, mlp_width=64, vocabulary=64, max_length=16), (16,), 64)


def _variables(spec: ModelSpec, abstract: bool):
    init = partial(spec.model.init, train=False)
    example = jnp.zeros((1, *spec.example_shape), jnp.float32 if spec.is_image_model else jnp.int32)
    return jax.eval_shape(init, jax.random.key(0), example) if abstract else jax.jit(init)(jax.random.key(0), example)


def parameter_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every trainable array's path and shape, without allocating it (works at BERT-large size)."""
    params = _variables(spec, abstract=True)["params"]
    return [(jax.tree_util.keystr(path), leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]


def _loss_and_gradients(spec: ModelSpec, params, state, inputs, labels):
    def loss_fn(p):
        logits, updates = spec.model.apply({"params": p, **state}, inputs, mutable=list(state))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, grads, updates


def step_flops(spec: ModelSpec, batch: int, optimizer=None) -> dict[str, float]:
    """XLA's flop estimate of one device's training step at `batch` examples, from the lowered
    (not compiled) program: `gradients` (forward and backward) and `update` (the optimizer's)."""
    optimizer = optimizer or optax.adam(1e-3)
    variables = _variables(spec, abstract=True)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}

    def gradients(params, state, inputs, labels):
        with_axis = jax.vmap(lambda p, s, x, y: _loss_and_gradients(spec, p, s, x, y),
                             in_axes=(None, None, None, None), axis_size=1, axis_name="data")
        return with_axis(params, state, inputs, labels)

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.eval_shape(optimizer.init, params)
    forward_backward = jax.jit(gradients).lower(params, state, *spec.inputs(batch)).cost_analysis()
    update_cost = jax.jit(update).lower(params, opt_state, params).cost_analysis()
    return {"gradients": float(forward_backward.get("flops", 0.0)), "update": float(update_cost.get("flops", 0.0))}


def data_parallel_step(spec: ModelSpec, mesh: jax.sharding.Mesh, *, batch_per_device: int = 2, optimizer=None,
                       donate: bool = True, jit=jax.jit, seed: int = 0):
    """A shard_map data-parallel training step of `spec` over the mesh's "data" axis, with its inputs.

    Each device computes the loss and gradients of its examples; `lax.pmean` averages the
    gradients (one all-reduce each, unless a combiner merges them) and the batch-norm state;
    the optimizer (adam unless given) updates the replicated parameters. Returns
    `(step, (params, state, opt_state, inputs, labels))`; the step returns the new params,
    state and opt_state and the mean loss, donating the first three when `donate`.
    """
    optimizer = optimizer or optax.adam(1e-3)
    devices = mesh.shape["data"]

    def train_step(params, state, opt_state, inputs, labels):
        loss, grads, updates = _loss_and_gradients(spec, params, state, inputs, labels)
        grads = jax.lax.pmean(grads, "data")
        updates = jax.lax.pmean(updates, "data")
        new_updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, new_updates), updates, opt_state, jax.lax.pmean(loss, "data")

    replicated, split = P(), P("data")
    step = jit(jax.shard_map(train_step, mesh=mesh, in_specs=(replicated, replicated, replicated, split, split),
                             out_specs=(replicated, replicated, replicated, replicated), check_vma=False),
               donate_argnums=(0, 1, 2) if donate else ())
    variables = _variables(spec, abstract=False)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    opt_state = jax.jit(optimizer.init)(params)
    params, state, opt_state = jax.device_put((params, state, opt_state), NamedSharding(mesh, replicated))
    rng = np.random.default_rng(seed)
    inputs_shape, labels_shape = spec.inputs(devices * batch_per_device)
    if spec.is_image_model:
        inputs = rng.standard_normal(inputs_shape.shape).astype(np.float32)
    else:
        inputs = rng.integers(0, spec.classes, inputs_shape.shape).astype(np.int32)
    labels = rng.integers(0, spec.classes, labels_shape.shape).astype(np.int32)
    inputs, labels = jax.device_put((inputs, labels), NamedSharding(mesh, split))
    return step, (params, state, opt_state, inputs, labels)
