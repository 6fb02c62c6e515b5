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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .dependencies import nn, optax


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


def loss_and_gradients(spec: ModelSpec, params, state, inputs, labels):
    """The mean cross-entropy of one device's examples, its gradient, and the updated model state
    (batch-norm statistics): the per-device half of every step built here."""
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
        with_axis = jax.vmap(lambda p, s, x, y: loss_and_gradients(spec, p, s, x, y),
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
        loss, grads, updates = loss_and_gradients(spec, params, state, inputs, labels)
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


# --- Mixture of experts (the ST-MoE seed) -------------------------------------------------------


class MoEBlock(nn.Module):
    """A top-2 mixture-of-experts MLP (ST-MoE / GShard routing) over `[tokens, width]`.

    The router (a bias-free Dense to `num_experts` logits, computed in float32) sends each token to
    its two most probable experts with gates renormalized to sum to 1. Every expert takes at most
    `capacity = ceil(2 * tokens * capacity_factor / num_experts)` tokens of this call: top-1
    choices are placed first, in token order, then the top-2 choices; a choice over capacity is
    dropped (a token with both choices dropped passes through the residual only).

    Expert weights are `w_in [E, width, mlp_width]` and `w_out [E, mlp_width, width]`. With
    `expert_axis=None` all E experts are local. Inside `shard_map` with `expert_axis="data"` and
    `expert_shards=n`, each device holds `E / n` experts (parameters of leading dimension `E / n`):
    its `[E, capacity, width]` dispatched tokens go to the experts' devices with one
    `lax.all_to_all` and come back with another.

    Returns `(output [tokens, width], aux)`, `aux` holding the Switch load-balancing loss
    (`E * sum_e f_e * P_e`, f_e the fraction of tokens whose top-1 is e, P_e the mean router
    probability of e) and the router z-loss (`mean(logsumexp(logits) ** 2)`), and `dropped`, the
    fraction of the 2 * tokens choices over capacity.
    """

    num_experts: int = 8
    mlp_width: int = 64
    capacity_factor: float = 1.25
    expert_axis: str | None = None
    expert_shards: int = 1

    def capacity(self, tokens: int) -> int:
        return int(np.ceil(2 * tokens * self.capacity_factor / self.num_experts))

    @nn.compact
    def __call__(self, x):
        tokens, width = x.shape
        experts, capacity = self.num_experts, self.capacity(x.shape[0])
        logits = nn.Dense(experts, use_bias=False, name="router")(x.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        first = jnp.argmax(probs, axis=-1)
        mask1 = jax.nn.one_hot(first, experts, dtype=jnp.float32)
        second = jnp.argmax(probs * (1.0 - mask1), axis=-1)
        mask2 = jax.nn.one_hot(second, experts, dtype=jnp.float32)
        gate1, gate2 = (probs * mask1).sum(-1), (probs * mask2).sum(-1)
        gate1, gate2 = gate1 / (gate1 + gate2), gate2 / (gate1 + gate2)
        # Positions in each expert's buffer: top-1 choices first, then top-2 after every kept top-1.
        position1 = jnp.cumsum(mask1, axis=0) * mask1 - mask1
        mask1 = mask1 * (position1 < capacity)
        position2 = (jnp.cumsum(mask2, axis=0) - mask2 + mask1.sum(axis=0, keepdims=True)) * mask2
        mask2 = mask2 * (position2 < capacity)
        slot1 = jax.nn.one_hot((position1 * mask1).sum(-1).astype(jnp.int32), capacity, dtype=jnp.float32)
        slot2 = jax.nn.one_hot((position2 * mask2).sum(-1).astype(jnp.int32), capacity, dtype=jnp.float32)
        dispatch = mask1[:, :, None] * slot1[:, None, :] + mask2[:, :, None] * slot2[:, None, :]  # [T, E, C]
        combine = (gate1[:, None, None] * mask1[:, :, None] * slot1[:, None, :]
                   + gate2[:, None, None] * mask2[:, :, None] * slot2[:, None, :])
        expert_inputs = jnp.einsum("tec,td->ecd", dispatch, x)  # [E, C, width]

        local = experts // self.expert_shards
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (local, width, self.mlp_width))
        w_out = self.param("w_out", init, (local, self.mlp_width, width))
        if self.expert_axis is not None:
            # [E, C, w] -> each device gets its experts' slice from every device: [n * local, C, w],
            # ordered (source device, local expert).
            expert_inputs = jax.lax.all_to_all(expert_inputs, self.expert_axis, 0, 0, tiled=True)
            expert_inputs = expert_inputs.reshape(self.expert_shards, local, capacity, width)
            expert_inputs = expert_inputs.transpose(1, 0, 2, 3).reshape(local, self.expert_shards * capacity, width)
        hidden = nn.gelu(jnp.einsum("lsd,ldh->lsh", expert_inputs, w_in))
        expert_outputs = jnp.einsum("lsh,lhd->lsd", hidden, w_out)
        if self.expert_axis is not None:
            expert_outputs = expert_outputs.reshape(local, self.expert_shards, capacity, width).transpose(1, 0, 2, 3)
            expert_outputs = jax.lax.all_to_all(expert_outputs.reshape(experts, capacity, width),
                                                self.expert_axis, 0, 0, tiled=True)
        output = jnp.einsum("tec,ecd->td", combine, expert_outputs)

        balance = experts * jnp.sum(jax.nn.one_hot(first, experts).mean(axis=0) * probs.mean(axis=0))
        z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        dropped = 1.0 - (mask1.sum() + mask2.sum()) / (2 * tokens)
        return output, {"balance": balance, "z_loss": z_loss, "dropped": dropped}


class MoEModel(nn.Module):
    """Token classifier: embedding (+ learned positions), one pre-norm MoE block, LayerNorm, vocabulary head.

    `__call__(tokens [batch, length])` returns `(logits [batch, length, vocabulary], aux)`.
    """

    vocabulary: int = 64
    width: int = 32
    max_length: int = 16
    num_experts: int = 8
    mlp_width: int = 64
    capacity_factor: float = 1.25
    expert_axis: str | None = None
    expert_shards: int = 1

    @nn.compact
    def __call__(self, tokens):
        batch, length = tokens.shape
        x = nn.Embed(self.vocabulary, self.width)(tokens)
        x = x + self.param("positions", nn.initializers.normal(0.02), (self.max_length, self.width))[:length]
        x = x.reshape(batch * length, self.width)
        y, aux = MoEBlock(self.num_experts, self.mlp_width, self.capacity_factor, self.expert_axis,
                          self.expert_shards)(nn.LayerNorm()(x))
        x = x + y
        logits = nn.Dense(self.vocabulary)(nn.LayerNorm()(x))
        return logits.reshape(batch, length, self.vocabulary), aux


MOE_EXPERT_WEIGHTS = ("w_in", "w_out")
BALANCE_LOSS_WEIGHT = 1e-2  # ST-MoE's load-balancing coefficient
Z_LOSS_WEIGHT = 1e-3  # ST-MoE's router z-loss coefficient


def moe_loss(model: MoEModel, params, tokens, labels):
    """One group's loss: mean cross-entropy + 1e-2 * load balancing + 1e-3 * router z-loss; and `aux`."""
    logits, aux = model.apply({"params": params}, tokens)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss = cross_entropy + BALANCE_LOSS_WEIGHT * aux["balance"] + Z_LOSS_WEIGHT * aux["z_loss"]
    return loss, {**aux, "cross_entropy": cross_entropy}


def _is_expert_weight(path) -> bool:
    """Whether a pytree path (of params, grads or optimizer state) leads to an expert's weight."""
    return any(getattr(key, "key", None) in MOE_EXPERT_WEIGHTS for key in path)


def moe_partition_specs(tree):
    """`P("data")` for the experts' weights (and their optimizer state), `P()` for everything else."""
    return jax.tree_util.tree_map_with_path(lambda path, _: P("data") if _is_expert_weight(path) else P(), tree)


def moe_step(mesh: jax.sharding.Mesh, *, model: MoEModel | None = None, batch_per_device: int = 4,
             optimizer=None, donate: bool = True, jit=jax.jit, seed: int = 0):
    """An expert-parallel + data-parallel MoE training step over the mesh's "data" axis, with its inputs.

    Every device takes `batch_per_device` sequences (its routing group) and holds
    `num_experts / devices` experts; dispatched tokens travel to their expert's device and back
    by `all_to_all`. The loss and gradients are the mean over devices of each group's `moe_loss`:
    the replicated weights' gradients (embedding, positions, router, norms, head) are averaged
    with `lax.pmean`; an expert's gradient already sums every device's tokens (the backward
    all-to-all brings them), so it is divided by the device count and stays on its device.
    Adam (unless given) updates both. Returns `(step, (params, opt_state, tokens, labels))`;
    the step returns the new params and opt_state and the mean loss, donating the first two
    when `donate`.
    """
    model = model or MoEModel()
    optimizer = optimizer or optax.adam(1e-3)
    devices = mesh.shape["data"]
    local_model = model.clone(expert_axis="data", expert_shards=devices)

    def train_step(params, opt_state, tokens, labels):
        (loss, _), grads = jax.value_and_grad(partial(moe_loss, local_model), has_aux=True)(params, tokens, labels)
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g / devices if _is_expert_weight(path) else jax.lax.pmean(g, "data"), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, model.max_length), jnp.int32))["params"]
    param_specs = moe_partition_specs(params)
    opt_state = jax.jit(optimizer.init)(params)
    opt_specs = moe_partition_specs(opt_state)
    step = jit(jax.shard_map(train_step, mesh=mesh, in_specs=(param_specs, opt_specs, P("data"), P("data")),
                             out_specs=(param_specs, opt_specs, P()), check_vma=False),
               donate_argnums=(0, 1) if donate else ())
    shardings = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                           is_leaf=lambda s: isinstance(s, P))
    params = jax.device_put(params, shardings(param_specs))
    opt_state = jax.device_put(opt_state, shardings(opt_specs))
    rng = np.random.default_rng(seed)
    shape = (devices * batch_per_device, model.max_length)
    tokens = rng.integers(0, model.vocabulary, shape).astype(np.int32)
    labels = rng.integers(0, model.vocabulary, shape).astype(np.int32)
    tokens, labels = jax.device_put((tokens, labels), NamedSharding(mesh, P("data")))
    return step, (params, opt_state, tokens, labels)


def moe_reference_step(model: MoEModel, devices: int, optimizer=None):
    """The same training step on one device, no collectives: all experts local, the batch cut into
    `devices` routing groups, the loss their mean. Called as `(params, opt_state, tokens, labels)`
    with full (global) arrays; returns the new params, opt_state and the loss."""
    optimizer = optimizer or optax.adam(1e-3)
    model = model.clone(expert_axis=None, expert_shards=1)

    def loss_fn(params, tokens, labels):
        groups = lambda a: a.reshape(devices, -1, *a.shape[1:])  # noqa: E731
        losses = [moe_loss(model, params, t, y)[0] for t, y in zip(groups(tokens), groups(labels))]
        return sum(losses) / devices

    @jax.jit
    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# --- Model parallelism beside data parallelism (the MLPerf v0.7 seed) ---------------------------


def megatron_partition_spec(path, leaf) -> P:
    """The Megatron split of a `Transformer` array (a parameter or its optimizer state) over "model".

    In each `TransformerLayer`: the attention's query, key and value kernels `[width, heads,
    head_dim]` and biases `[heads, head_dim]` and the MLP's first Dense (kernel `[width, mlp]`,
    bias `[mlp]`) are split column-wise (by head, by hidden unit); the attention's output kernel
    `[heads, head_dim, width]` and the MLP's second Dense kernel `[mlp, width]` row-wise. Their
    output biases, the LayerNorms, the embeddings and the vocabulary projection stay replicated
    (`P()`), as do scalars (Adam's step count).
    """
    keys = [getattr(key, "key", None) for key in path]
    if not any(isinstance(k, str) and k.startswith("TransformerLayer_") for k in keys) or np.ndim(leaf) == 0:
        return P()
    name = keys[-1]
    if any(k in ("query", "key", "value") for k in keys):
        return P(None, "model", None) if name == "kernel" else P("model", None)
    if "out" in keys:
        return P("model", None, None) if name == "kernel" else P()
    if "Dense_0" in keys:
        return P(None, "model") if name == "kernel" else P("model")
    if "Dense_1" in keys:
        return P("model", None) if name == "kernel" else P()
    return P()


def model_parallel_step(spec: ModelSpec, mesh: jax.sharding.Mesh, *, batch_per_data_shard: int = 4,
                        optimizer=None, donate: bool = True, jit=jax.jit, seed: int = 0):
    """A `jax.jit` + `NamedSharding` training step of a `Transformer` spec on a `(data, model)` mesh.

    The batch is split over "data"; the layers' weights (and their optimizer state) are split
    over "model" as `megatron_partition_spec` says, everything else is replicated. XLA's
    partitioner makes the collectives: the Megatron all-reduces of activations (and of their
    gradients) over "model", and the gradient all-reduces over "data", the replicated weights'
    too (what they see is already the same on every model shard). The optimizer is adamw unless
    given. Returns
    `(step, (params, opt_state, tokens, labels))`; the step returns the new params and opt_state
    and the mean loss, donating the first two when `donate`.
    """
    optimizer = optimizer or optax.adamw(1e-3)
    variables = _variables(spec, abstract=False)
    params = variables["params"]
    opt_state = jax.jit(optimizer.init)(params)
    shardings = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, leaf: NamedSharding(mesh, megatron_partition_spec(path, leaf)), tree)
    param_shardings, opt_shardings = shardings(params), shardings(opt_state)
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def train_step(params, opt_state, tokens, labels):
        loss, grads, _ = loss_and_gradients(spec, params, {}, tokens, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jit(train_step, in_shardings=(param_shardings, opt_shardings, batch, batch),
               out_shardings=(param_shardings, opt_shardings, replicated),
               donate_argnums=(0, 1) if donate else ())
    params, opt_state = jax.device_put((params, opt_state), (param_shardings, opt_shardings))
    rng = np.random.default_rng(seed)
    shape = (mesh.shape["data"] * batch_per_data_shard, *spec.example_shape)
    tokens = rng.integers(0, spec.classes, shape).astype(np.int32)
    labels = rng.integers(0, spec.classes, shape).astype(np.int32)
    tokens, labels = jax.device_put((tokens, labels), batch)
    return step, (params, opt_state, tokens, labels)
