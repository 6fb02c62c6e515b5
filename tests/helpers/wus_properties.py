"""Cases, programs and a crash-proof executor for tests/properties/test_weight_update_sharding_properties.py.

Three kinds of case, each a frozen dataclass that hypothesis draws and a spawned worker
process runs (so that an XLA crash on a rewritten module fails one example, which
hypothesis then shrinks, instead of ending the test session):

* `StepCase`: a JAX data-parallel training step (shard_map + pmean, jit with NamedSharding,
  or pmap + pmean) with optax, its loss computed in the weights' dtype or another (bfloat16 or
  float16 from float32 weights: mixed precision), with or without stacked layers run in a
  `lax.scan`, a `jax.checkpoint`ed scan, a `fori_loop` or `lax.cond`s; run at the flag
  (`run_at_the_flag`), through `xla_passes.jax.jit` (`run_through_jit`) or lowered and
  rewritten offline (`run_offline`).
* `LaidOutCase`: a per-device module as JAX's pass hook receives it (laid out, optionally
  fused and with a combined all-reduce), whose gradients, updates and outputs have layouts
  hypothesis chooses (`run_laid_out`).

Hypothesis profiles: `ci` (the default: few examples, derandomized, no example database, so
every CI run tries the same cases) and `long` (10 times as many examples, random), chosen
with the HYPOTHESIS_PROFILE environment variable.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import os
import sys
import tempfile
import traceback
from concurrent.futures.process import BrokenProcessPool

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from hypothesis import HealthCheck, assume, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from few_compiles import per_device_copies
import hlo_tools
import xla_passes
import xla_passes.jax
from hlo_tools.xla import runner, xla_bridge
from xla_passes.pipeline import Pipeline

GROUP_SIZE = 8              # the data-parallel devices of every case
THRESHOLD_BYTES = 1024      # the pass's default threshold_bytes: smaller gradients stay replicated
PASS = "weight-update-sharding"
MAX_ELEMENTS = 4096         # compile time, not the pass, bounds the weights
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16"}
# Equal up to the float noise of a reordered sum: an element matches when its absolute error
# is within `atol` or its error relative to the plain program's within `rtol`. bfloat16: one
# unit in the last place (the update rounds sums that differ in float32's last bits).
TOLERANCE = {"float32": {"atol": 1e-6, "rtol": 1e-5}, "bfloat16": {"atol": 1e-6, "rtol": 2.0 ** -7}}
WORKER_TIMEOUT_S = 300         # a case that runs longer is stuck (a collective that never completes)

settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_EXAMPLE_SCALE = {"ci": 1, "long": 10}


def examples(ci_count: int) -> settings:
    """Settings of a test that tries `ci_count` examples in the ci profile (more in long)."""
    return settings(settings.get_profile(PROFILE), max_examples=ci_count * _EXAMPLE_SCALE[PROFILE])


# --- weight shapes ----------------------------------------------------------------------------------

SITUATIONS = ("leading dimension divisible", "only a later dimension divisible", "no dimension divisible",
              "dimensions of size 1", "tiny")


def situation(dims: tuple[int, ...], dtype: str) -> str:
    """How the pass can split a weight of `dims` over the group (one of SITUATIONS)."""
    if math.prod(dims) * DTYPE_BYTES[dtype] < THRESHOLD_BYTES:
        return "tiny"
    if 1 in dims:
        return "dimensions of size 1"
    divisible = [d % GROUP_SIZE == 0 for d in dims]
    if divisible[0]:
        return "leading dimension divisible"
    return "only a later dimension divisible" if any(divisible) else "no dimension divisible"


# Dimension ranges per rank that make weights of about 256 to 4096 elements.
_DIM_RANGES = {1: (256, 2048), 2: (8, 64), 3: (4, 16), 4: (2, 10)}


def _grown(dims: list[int], least: int) -> tuple[int, ...]:
    """`dims` with its most minor dimension other than 1 multiplied until the weight has at
    least `least` elements, whether that dimension divides by the group unchanged."""
    position = max(i for i, d in enumerate(dims) if d != 1)
    size = dims[position]
    factor = -(-least // math.prod(dims))
    while factor > 1 and (size * factor % GROUP_SIZE == 0) != (size % GROUP_SIZE == 0):
        factor += 1
    return tuple(d * factor if i == position else d for i, d in enumerate(dims))


@st.composite
def weight_shapes(draw, dtype: str) -> tuple[int, ...]:
    """A weight shape in one of SITUATIONS: unless tiny, big enough to be sharded and at most
    MAX_ELEMENTS elements."""
    wanted = draw(st.sampled_from(SITUATIONS))
    least = THRESHOLD_BYTES // DTYPE_BYTES[dtype]
    if wanted == "tiny":  # at most 6**3 = 216 elements
        return tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    if wanted == "only a later dimension divisible" and draw(st.booleans()):  # a 3x3xCxK conv kernel
        window = st.sampled_from([1, 3, 5])
        dims = [draw(window), draw(window), draw(st.integers(2, 12)), GROUP_SIZE * draw(st.integers(1, 4))]
    else:
        ones = draw(st.integers(1, 2)) if wanted == "dimensions of size 1" else 0
        rank = draw(st.integers(2 if wanted == "only a later dimension divisible" else 1, 4 - ones))
        low, high = _DIM_RANGES[rank]
        any_size = st.integers(low, high)
        divisible = st.integers(-(-low // GROUP_SIZE), high // GROUP_SIZE).map(lambda k: GROUP_SIZE * k)
        indivisible = any_size.map(lambda d: d if d % GROUP_SIZE else d + 1)
        if wanted == "leading dimension divisible":
            dims = [draw(divisible)] + [draw(any_size) for _ in range(rank - 1)]
        elif wanted == "only a later dimension divisible":
            dims = [draw(indivisible)] + [draw(any_size) for _ in range(rank - 1)]
            dims[draw(st.integers(1, rank - 1))] = draw(divisible)
        elif wanted == "no dimension divisible":
            dims = [draw(indivisible) for _ in range(rank)]
        else:
            dims = [draw(any_size) for _ in range(rank)]
            for _ in range(ones):
                dims.insert(draw(st.integers(0, len(dims))), 1)
    dims = _grown(dims, least)
    assume(math.prod(dims) <= MAX_ELEMENTS)
    return dims


# --- JAX training steps -------------------------------------------------------------------------------

STYLES = ("shard_map", "named_sharding", "pmap")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "clipped_adam", "lamb", "lars", "adafactor")
DTYPES = ("float32", "bfloat16")
# The loss's dtype: float32 weights are cast to any of these, bfloat16 ones to the first two
# (hypothesis starts from the first).
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
# How the stacked layers run (a case without control flow has none).
CONTROLS = ("scan", "checkpointed scan", "fori_loop", "cond", "none")
PER_DEVICE_BATCH = 2


# How the loss reads a weight, which decides how XLA computes its gradient (and its layouts):
# "scaled": y = sum over the batch of data * weight, element by element (a multiply and a reduce);
# "contracted": one output per example, the data contracted with every dimension of the weight;
# "matmul": a linear layer, data @ weight over the weight's leading dimension (XLA's dot often
# makes the gradient a transposed one);
# "stacked": L x d x d, layers of a residual-free MLP applied in turn in the case's control flow
# (its gradient is built in the loop, where shard_map's transpose all-reduces each layer's).
USES = ("scaled", "contracted", "matmul", "stacked")


@dataclasses.dataclass(frozen=True)
class Weight:
    shape: tuple[int, ...]
    use: str  # one of USES

    @property
    def example_shape(self) -> tuple[int, ...]:
        """The shape of one example of the data this weight reads."""
        return {"matmul": self.shape[:1], "stacked": self.shape[-1:]}.get(self.use, self.shape)


@dataclasses.dataclass(frozen=True)
class StepCase:
    """A training step; `donate`: the step donates the weights and optimizer state, as
    training loops do (XLA then aliases them to the new values); `compute`: the loss's dtype;
    `control`: how the stacked weight's layers run ("none": there is none)."""

    style: str
    optimizer: str
    dtype: str
    weights: tuple[Weight, ...]
    donate: bool
    seed: int
    compute: str
    control: str

    def pass_text(self, persistent: bool = False) -> str:
        """The pass, told in the pmap style that every device has the same weights (pmap hands
        each its own copy; the inputs make the copies equal); `persistent`: the optimizer state
        stays sharded between steps (`xla_passes.jax.jit` only)."""
        options = ["assume_replicated_parameters=true"] * (self.style == "pmap") + ["persistent=true"] * persistent
        return f"{PASS}{{{','.join(options)}}}" if options else PASS


@st.composite
def step_cases(draw, style: str, mixed_precision: bool = True, control_flow: bool = True) -> StepCase:
    """A training step; without `mixed_precision` the loss is in the weights' dtype, without
    `control_flow` the step has no stacked layers (and neither is drawn)."""
    dtype = draw(st.sampled_from(DTYPES))
    uses = st.sampled_from(USES[:-1])
    weights = draw(st.lists(st.builds(Weight, weight_shapes(dtype), uses), min_size=1, max_size=3))
    control = draw(st.sampled_from(CONTROLS)) if control_flow else "none"
    if control != "none":  # 2 or 3 layers of 8 to 32 features: tiny, only a later dimension divisible, or none
        width = draw(st.sampled_from([8, 12, 16, 24, 32]))
        weights.append(Weight((draw(st.integers(2, 3)), width, width), "stacked"))
    compute = (draw(st.sampled_from(COMPUTE_DTYPES if dtype == "float32" else COMPUTE_DTYPES[:2]))
               if mixed_precision else dtype)
    return StepCase(style, draw(st.sampled_from(OPTIMIZERS)), dtype, tuple(weights), draw(st.booleans()),
                    draw(st.integers(0, 2**16)), compute, control)


def _optimizer(name: str):
    return {"sgd": lambda: optax.sgd(0.1),
            "momentum": lambda: optax.sgd(0.1, momentum=0.9),
            "adam": lambda: optax.adam(1e-2),
            "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
            "clipped_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
            # The seeds' large-batch optimizers: per-tensor trust ratios (norms in calls of
            # jnp.linalg.norm) and Adafactor's factored second moments (row and column means).
            "lamb": lambda: optax.lamb(1e-2),
            "lars": lambda: optax.lars(1e-2),
            "adafactor": lambda: optax.adafactor(1e-2)}[name]()


def _stacked_layers(w, x, control: str):
    """x through the layers w[0], w[1], ... in turn, each a tanh of a matmul, run by `control`."""
    def layer(h, w_layer):
        return jnp.tanh(h @ w_layer / math.sqrt(w.shape[-1]))

    if control in ("scan", "checkpointed scan"):
        body = jax.checkpoint(layer) if control == "checkpointed scan" else layer
        return jax.lax.scan(lambda h, w_layer: (body(h, w_layer), None), x, w)[0]
    if control == "fori_loop":
        return jax.lax.fori_loop(0, w.shape[0], lambda i, h: layer(h, w[i]), x)
    for w_layer in w:  # "cond": the weights alone decide, so every device takes the same branch
        x = jax.lax.cond(jnp.mean(w_layer) > 1, layer, lambda h, w_layer: -layer(h, w_layer), x, w_layer)
    return x


def _loss(params, xs, case: StepCase):
    """The loss in the case's compute dtype (summed in float32)."""
    total = 0.0
    for w, x, weight in zip(params, xs, case.weights):
        w, x = w.astype(case.compute), x.astype(case.compute)
        if weight.use == "scaled":
            y = jnp.einsum("b...,...->...", x, w)
        elif weight.use == "contracted":  # scaled down to stay off tanh's flat tails
            y = jnp.einsum("b...,...->b", x, w) / math.sqrt(math.prod(weight.shape))
        elif weight.use == "matmul":
            y = jnp.einsum("bi,i...->b...", x, w) / math.sqrt(weight.shape[0])
        else:
            y = _stacked_layers(w, x, case.control)
        total = total + jnp.sum(jnp.tanh(y.astype(jnp.float32)) ** 2)
    return total


def _step_function(case: StepCase):
    """The training step: gradients (averaged over the data axis where the program says so),
    the optimizer's update, the new weights, state and loss."""
    optimizer = _optimizer(case.optimizer)
    axis = None if case.style == "named_sharding" else "data"

    def step(params, state, xs):
        loss, grads = jax.value_and_grad(_loss)(params, xs, case)
        if axis is not None:
            grads, loss = jax.lax.pmean((grads, loss), axis)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def _mesh():
    """The devices in one "data" axis that XLA's partitioner shards by (jax 0.12's default,
    explicit axes, would make a fori_loop's indexing of replicated weights say its sharding)."""
    return jax.make_mesh((GROUP_SIZE,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _compiled_step(case: StepCase, jit=jax.jit, **jit_kwargs):
    """A fresh jitted (or pmapped) step, so that JAX compiles it again; `jit` is `jax.jit` or
    `xla_passes.jax.jit` (which takes `jit_kwargs`, and a pmap step inside it)."""
    step = _step_function(case)
    donated = (0, 1) if case.donate else ()
    if case.style == "pmap":
        if jit is jax.jit:
            return jax.pmap(step, axis_name="data", donate_argnums=donated)
        return jit(jax.pmap(step, axis_name="data"), donate_argnums=donated, **jit_kwargs)
    mesh = _mesh()
    if case.style == "shard_map":
        return jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())),
                   keep_unused=True, donate_argnums=donated, **jit_kwargs)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jit(step, in_shardings=(replicated, replicated, batch), out_shardings=(replicated, replicated, replicated),
               keep_unused=True, donate_argnums=donated, **jit_kwargs)


def _step_arguments(case: StepCase):
    """Weights and optimizer state equal on every device, data different on each; every float
    element different (a shard taken at the wrong offset changes the results), the step counter 3.
    Made in NumPy, the state from the shapes of the optimizer's (`jax.eval_shape`): made with JAX
    operations, each would be a program to compile, for every case again (the cases clear JAX's caches)."""
    rng = np.random.default_rng(case.seed)
    dtype = jnp.dtype(case.dtype)
    params = [rng.uniform(0.5, 1.5, w.shape).astype(dtype) for w in case.weights]
    state = jax.tree.map(lambda leaf: np.full(leaf.shape, 3, leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.integer)
                         else rng.uniform(0.5, 1.5, leaf.shape).astype(leaf.dtype),
                         jax.eval_shape(_optimizer(case.optimizer).init, params))
    xs = [rng.uniform(-1, 1, (GROUP_SIZE * PER_DEVICE_BATCH, *w.example_shape)).astype(dtype) for w in case.weights]
    if case.style == "pmap":  # one copy of the weights and state per device
        params, state = per_device_copies((params, state), GROUP_SIZE)
        return params, state, [x.reshape(GROUP_SIZE, PER_DEVICE_BATCH, *x.shape[1:]) for x in xs]
    mesh = _mesh()
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.device_put(params, replicated), jax.device_put(state, replicated), jax.device_put(xs, batch)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


class _ReportLines(logging.Handler):
    """Collects the pass's report lines that the hook logs on the "xla_passes" logger."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith(f"{PASS}: "):
            self.lines.append(message)


def run_at_the_flag(case: StepCase) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """(plain outputs, outputs with the pass at JAX's hook, the pass's report lines); each run
    gets its own copy of the arguments, which a donating step consumes."""
    jax.clear_caches()
    plain = _leaves(_compiled_step(case)(*_step_arguments(case)))
    jax.clear_caches()
    logger = logging.getLogger("xla_passes")
    handler, level = _ReportLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with xla_passes.jax.enable(case.pass_text(), strict=True):
            rewritten = _leaves(_compiled_step(case)(*_step_arguments(case)))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        jax.clear_caches()
    return plain, rewritten, handler.lines


def run_through_jit(case: StepCase, persistent: bool = False) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """(plain outputs, outputs through `xla_passes.jax.jit` with the pass, its report lines);
    strict: a pass error or a module XLA refuses raises. `persistent`: the pass hands the
    optimizer state back sharded."""
    jax.clear_caches()
    plain = _leaves(_compiled_step(case)(*_step_arguments(case)))
    jitted = _compiled_step(case, xla_passes.jax.jit, passes=case.pass_text(persistent), strict=True)
    rewritten = _leaves(jitted(*_step_arguments(case)))
    jax.clear_caches()
    return plain, rewritten, [line for line in jitted.reports if line.startswith(f"{PASS}: ")]


@dataclasses.dataclass
class OfflineResult:
    reports: list  # the pass's WeightReports
    comparison_ok: bool
    comparison: str  # the runner's report


def run_offline(case: StepCase) -> OfflineResult:
    """Lower the step to HLO before XLA's optimizations, rewrite it, run both on the same
    global inputs (pmap's weights and state: one equal copy per device)."""
    args = _step_arguments(case)
    lowered = _compiled_step(case).lower(*args)
    text = lowered.compiler_ir("hlo").as_hlo_text()
    inputs = _leaves(args)
    kept = xla_bridge.kept_argument_positions(lowered)   # pmap drops unused ones (Adafactor's dummy states)
    inputs = inputs if kept is None else [inputs[position] for position in kept]
    module = hlo_tools.parse_module(text)
    if len(module.entry.parameters) != len(inputs):
        raise AssertionError(f"the lowered step takes {len(module.entry.parameters)} parameters, "
                             f"the case has {len(inputs)} inputs")
    passes = xla_passes.parse_pipeline(case.pass_text())
    xla_passes.run_passes(module, passes)
    _, _, comparison = runner.compare_modules(module.to_text(), text, inputs,
                                              abs_error_bound=TOLERANCE[case.dtype]["atol"],
                                              rel_error_bound=TOLERANCE[case.dtype]["rtol"])
    return OfflineResult(passes[0].report, comparison.ok, comparison.format())


# --- laid-out modules as the hook receives them -----------------------------------------------------

LAID_OUT_OPTIMIZERS = ("sgd", "momentum", "clipped_sgd")
LEARNING_RATE, MOMENTUM, CLIP_NORM = 0.01, 0.9, 1.0


@dataclasses.dataclass(frozen=True)
class LaidOutWeight:
    """A weight and the layouts (minor_to_major permutations) that layout assignment gave its
    local gradient and all-reduce, its momentum update, its weight update and its results."""

    dims: tuple[int, ...]
    gradient_layout: tuple[int, ...]
    state_layout: tuple[int, ...]
    update_layout: tuple[int, ...]
    output_layout: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LaidOutCase:
    """A per-device step after XLA's layout assignment. Entry parameters keep the default layout
    (see `laid_out_module`). `combined`: one tuple all-reduce sums every gradient, as XLA's
    all-reduce combiner leaves them; `fused`: the updates are kLoop fusions, as XLA's fusion
    passes leave them; clipped_sgd clips by the global norm of all gradients."""

    weights: tuple[LaidOutWeight, ...]
    dtype: str
    optimizer: str
    combined: bool
    fused: bool
    seed: int


def _layouts(rank: int):
    """A minor_to_major layout, the default one a third of the time."""
    return st.one_of(st.just(tuple(range(rank - 1, -1, -1))), st.permutations(range(rank)).map(tuple))


@st.composite
def _laid_out_weights(draw, dtype: str) -> LaidOutWeight:
    dims = draw(weight_shapes(dtype))
    shared = draw(_layouts(len(dims)))  # layout assignment often propagates one layout through the step
    return LaidOutWeight(dims, *[draw(st.one_of(st.just(shared), _layouts(len(dims)))) for _ in range(4)])


@st.composite
def laid_out_cases(draw) -> LaidOutCase:
    dtype = draw(st.sampled_from(DTYPES))
    weights = draw(st.lists(_laid_out_weights(dtype), min_size=1, max_size=3))
    combined = len(weights) > 1 and draw(st.booleans())  # a one-operand all-reduce is an array all-reduce
    return LaidOutCase(tuple(weights), dtype, draw(st.sampled_from(LAID_OUT_OPTIMIZERS)), combined,
                       draw(st.booleans()), draw(st.integers(0, 2**16)))


def _shape(dtype: str, dims, layout) -> str:
    return f"{dtype}[{','.join(map(str, dims))}]{{{','.join(map(str, layout))}}}"


class _Stage:
    """Elementwise instructions that compute one array in one layout and dtype from `inputs`
    (name -> (value, layout, dtype); layout None for scalars): inline, each input copied to the
    stage's layout and converted to its dtype first (XLA's layout assignment gives an
    elementwise instruction operands of its own layout), or as a kLoop fusion doing that inside."""

    def __init__(self, name: str, dims, layout, dtype: str, inputs: dict, body: list[tuple[str, str]]):
        self.name, self.dims, self.layout, self.dtype = name, dims, layout, dtype
        self.inputs, self.body = inputs, body  # body: (name, "opcode(operands)"); the last one is the result

    def array(self, layout=None, dtype=None) -> str:
        return _shape(dtype or self.dtype, self.dims, layout or self.layout)

    def _adapted(self, local: str, source: str, layout, dtype: str) -> tuple[list[str], str]:
        """Lines that bring input `source` to the stage's layout and dtype, and the value they make."""
        if layout is None:  # a scalar: broadcast
            steps = ([(f"{self.dtype}[]", "convert", "")] if dtype != self.dtype else []) + \
                [(self.array(), "broadcast", ", dimensions={}")]
        else:
            steps = (([(self.array(dtype=dtype), "copy", "")] if layout != self.layout else []) +
                     ([(self.array(), "convert", "")] if dtype != self.dtype else []))
        lines, value = [], source
        for number, (shape, opcode, attributes) in enumerate(steps):
            name = local if number == len(steps) - 1 else f"{local}.{number}"
            lines.append(f"{name} = {shape} {opcode}({value}){attributes}")
            value = name
        return lines, value

    def _body_lines(self, names: dict[str, str]) -> list[str]:
        lines = []
        for result, expression in self.body:
            name = f"{self.name}.{result}"
            if expression.startswith("constant("):
                lines.append(f"{name}.scalar = {self.dtype}[] {expression}")
                lines.append(f"{name} = {self.array()} broadcast({name}.scalar), dimensions={{}}")
            else:
                lines.append(f"{name} = {self.array()} {expression.format(**names)}")
            names[result] = name
        return lines

    def inline(self) -> list[str]:
        lines, names = [], {}
        for key, (value, layout, dtype) in self.inputs.items():
            adapted, names[key] = self._adapted(f"{self.name}.{key}", value, layout, dtype)
            lines += adapted
        body = self._body_lines(names)
        body[-1] = body[-1].replace(f"{self.name}.{self.body[-1][0]} =", f"{self.name} =", 1)
        return lines + body

    def fused(self) -> tuple[str, list[str]]:
        """(the fused computation, the entry's fusion instruction)."""
        parameters, lines, names = [], [], {}
        for number, (key, (value, layout, dtype)) in enumerate(self.inputs.items()):
            kind = f"{dtype}[]" if layout is None else self.array(dtype=dtype, layout=layout)
            parameter = f"{self.name}.parameter.{key}"
            parameters.append(f"{parameter} = {kind} parameter({number})")
            adapted, names[key] = self._adapted(f"{self.name}.{key}", parameter, layout, dtype)
            lines += adapted
        body = self._body_lines(names)
        body[-1] = "ROOT " + body[-1]
        computation = f"fused_{self.name} {{\n  " + "\n  ".join(parameters + lines + body) + "\n}\n"
        operands = ", ".join(value for value, _, _ in self.inputs.values())
        return computation, [f"{self.name} = {self.array()} fusion({operands}), kind=kLoop, calls=fused_{self.name}"]


def laid_out_module(case: LaidOutCase) -> str:
    """The module's text. Parameters, per weight: the weight, its momentum (both the same on
    every device) and the device's data, whose square is the local gradient. Entry parameters
    keep the default layout: JAX's entry layouts are the default ones, and
    `compile_optimized_module` hands inputs over in that layout whatever the module's says."""
    dtype = HLO_DTYPES[case.dtype]
    parameters, stages, outputs = [], [], []
    for i, weight in enumerate(case.weights):
        rank = len(weight.dims)
        default = tuple(range(rank - 1, -1, -1))
        tiles = ",".join([str(GROUP_SIZE)] + ["1"] * (rank - 1))
        parameters += [
            f"weight{i} = {_shape(dtype, weight.dims, default)} parameter({3 * i}), sharding={{replicated}}",
            f"momentum{i} = {_shape(dtype, weight.dims, default)} parameter({3 * i + 1}), sharding={{replicated}}",
            f"data{i} = {_shape('f32', weight.dims, default)} parameter({3 * i + 2}), "
            f"sharding={{devices=[{tiles}]<=[{GROUP_SIZE}]}}"]
        stages.append(_Stage(f"local{i}", weight.dims, weight.gradient_layout, "f32",
                             {"x": (f"data{i}", default, "f32")}, [("square", "multiply({x}, {x})")]))
    lines = list(parameters)
    computations = []

    def emit(stage: _Stage) -> None:
        if case.fused:
            computation, instruction = stage.fused()
            computations.append(computation)
            lines.extend(instruction)
        else:
            lines.extend(stage.inline())

    for stage in stages:
        emit(stage)
    all_reduce = (f"replica_groups=[1,{GROUP_SIZE}]<=[{GROUP_SIZE}], use_global_device_ids=true, "
                  f"to_apply=add")
    gradient_shapes = [_shape("f32", w.dims, w.gradient_layout) for w in case.weights]
    if case.combined:
        lines.append(f"sums = ({', '.join(gradient_shapes)}) all-reduce("
                     f"{', '.join(f'local{i}' for i in range(len(case.weights)))}), channel_id=1, {all_reduce}")
        lines += [f"g{i} = {shape} get-tuple-element(sums), index={i}" for i, shape in enumerate(gradient_shapes)]
    else:
        lines += [f"g{i} = {shape} all-reduce(local{i}), channel_id={i + 1}, {all_reduce}"
                  for i, shape in enumerate(gradient_shapes)]
    if case.optimizer == "clipped_sgd":  # scale by CLIP_NORM / max(global norm, CLIP_NORM)
        lines.append("zero = f32[] constant(0)")
        total = ""
        for i, (weight, shape) in enumerate(zip(case.weights, gradient_shapes)):
            every_dimension = ",".join(map(str, range(len(weight.dims))))
            lines += [f"g{i}.squares = {shape} multiply(g{i}, g{i})",
                      f"g{i}.sum_squares = f32[] reduce(g{i}.squares, zero), dimensions={{{every_dimension}}}, "
                      f"to_apply=add"]
            if total:
                lines.append(f"sum_squares{i} = f32[] add({total}, g{i}.sum_squares)")
            total = f"sum_squares{i}" if total else f"g{i}.sum_squares"
        lines += [f"norm = f32[] sqrt({total})", f"clip = f32[] constant({CLIP_NORM})",
                  "bound = f32[] maximum(norm, clip)", "scale = f32[] divide(clip, bound)"]
    for i, weight in enumerate(case.weights):
        default = tuple(range(len(weight.dims) - 1, -1, -1))
        gradient = (f"g{i}", weight.gradient_layout, "f32")
        step_inputs, step_body = {"w": (f"weight{i}", default, dtype)}, []
        if case.optimizer == "momentum":
            emit(_Stage(f"new_momentum{i}", weight.dims, weight.state_layout, dtype,
                        {"g": gradient, "m": (f"momentum{i}", default, dtype)},
                        [("mu", f"constant({MOMENTUM})"), ("decayed", "multiply({m}, {mu})"),
                         ("sum", "add({decayed}, {g})")]))
            step_inputs["d"] = (f"new_momentum{i}", weight.state_layout, dtype)
            state = (f"new_momentum{i}", weight.state_layout)
        else:
            step_inputs["d"] = gradient
            state = (f"momentum{i}", default)
        if case.optimizer == "clipped_sgd":
            step_inputs["s"] = ("scale", None, "f32")
            step_body.append(("clipped", "multiply({d}, {s})"))
        step_body += [("lr", f"constant({LEARNING_RATE})"),
                      ("delta", "multiply({%s}, {lr})" % ("clipped" if step_body else "d")),
                      ("new", "subtract({w}, {delta})")]
        emit(_Stage(f"new_weight{i}", weight.dims, weight.update_layout, dtype, step_inputs, step_body))
        for value, layout in [(f"new_weight{i}", weight.update_layout), state]:
            if layout != weight.output_layout:
                lines.append(f"{value}.out = {_shape(dtype, weight.dims, weight.output_layout)} copy({value})")
                value = f"{value}.out"
            outputs.append((value, _shape(dtype, weight.dims, weight.output_layout)))
    lines.append(f"ROOT out = ({', '.join(shape for _, shape in outputs)}) "
                 f"tuple({', '.join(value for value, _ in outputs)})")
    return (f"HloModule laid_out_step, num_partitions={GROUP_SIZE}\n\n"
            "add {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT a_plus_b = f32[] add(a, b)\n}\n\n"
            + "\n".join(computations) + "\nENTRY step {\n  " + "\n  ".join(lines) + "\n}\n")


def laid_out_inputs(case: LaidOutCase) -> list[list[np.ndarray]]:
    """Per-device inputs, per weight: weight and momentum the same on every device, data different."""
    rng = np.random.default_rng(case.seed)
    dtype = ml_dtypes.bfloat16 if case.dtype == "bfloat16" else np.float32
    inputs = []
    for weight in case.weights:
        w, m = (rng.uniform(0.5, 1.5, weight.dims).astype(dtype) for _ in range(2))
        inputs += [[w] * GROUP_SIZE, [m] * GROUP_SIZE,
                   [rng.uniform(-1, 1, weight.dims).astype(np.float32) for _ in range(GROUP_SIZE)]]
    return inputs


def laid_out_reference(case: LaidOutCase) -> list[np.ndarray]:
    """The step's results in numpy (float32), what every device must return."""
    inputs = laid_out_inputs(case)
    gradients = [sum(x * x for x in inputs[3 * i + 2]) for i in range(len(case.weights))]
    norm = np.sqrt(sum(np.sum(g * g) for g in gradients))
    results = []
    for i, g in enumerate(gradients):
        w, m = (np.asarray(inputs[3 * i + k][0], np.float32) for k in (0, 1))
        if case.optimizer == "momentum":
            m = np.float32(MOMENTUM) * m + g
            g = m
        if case.optimizer == "clipped_sgd":
            g = g * (np.float32(CLIP_NORM) / max(norm, np.float32(CLIP_NORM)))
        results += [w - np.float32(LEARNING_RATE) * g, m]
    return results


@dataclasses.dataclass
class LaidOutResult:
    text: str
    refusal: str            # why the pipeline refused the pass's module ("" when it did not)
    rewritten_text: str     # "" when nothing changed
    reports: list           # the pass's WeightReports
    original: list          # per output, each device's array
    rewritten: list


def run_laid_out(case: LaidOutCase) -> LaidOutResult:
    """Rewrite the module as the hook does (`layouts_final`), compile both from XLA's
    pre-scheduler stage on, run them on the same per-device inputs."""
    text = laid_out_module(case)
    inputs = laid_out_inputs(case)

    def execute(module_text: str, which: str) -> list[np.ndarray]:
        print(f"run_laid_out: compiling and running the {which} module", file=sys.stderr, flush=True)  # crash reports
        executable = xla_bridge.compile_optimized_module(
            xla_bridge.text_to_proto(module_text), "cpu", jax.devices()[:GROUP_SIZE], 0,
            num_replicas=1, num_partitions=GROUP_SIZE, stage="pre_scheduler")
        outputs, _ = executable.execute(inputs)
        return [np.stack([by_device[d] for d in range(GROUP_SIZE)]) for by_device in outputs]

    module = hlo_tools.parse_module(text)
    pipeline = Pipeline(PASS, layouts_final=True)
    refusal, rewritten_text = "", ""
    try:
        if pipeline.run(module):
            rewritten_text = module.to_text()
    except xla_passes.PassError as exc:
        refusal = str(exc)
    original = execute(text, "original")
    rewritten = execute(rewritten_text, "rewritten") if rewritten_text else original
    return LaidOutResult(text, refusal, rewritten_text, pipeline.passes[0].report, original, rewritten)


# --- the worker process -------------------------------------------------------------------------------

class WorkerError(Exception):
    """An exception in the worker, with its traceback as the message."""


class WorkerCrash(Exception):
    """The worker process died (an XLA CHECK failure, an abort) or hung; the message ends with
    the tail of its stderr."""


def _start_worker(stderr_path: str, xla_flags: str) -> None:
    """Worker initializer: stderr into a file the parent reads when the worker dies; `xla_flags`
    added to XLA_FLAGS, which XLA reads when the worker's first case starts its backend."""
    descriptor = os.open(stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(descriptor, 2)
    if xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()


def _call(function, case):
    try:
        return function(case)
    except Exception:  # noqa: BLE001 - sent to the parent as text: not every exception pickles
        raise WorkerError(traceback.format_exc()) from None


class Worker:
    """One spawned child process (the test session's 8 CPU devices, inherited through XLA_FLAGS,
    plus `xla_flags`) that runs one case at a time; started on first use, started again after a
    crash."""

    def __init__(self, xla_flags: str = ""):
        self._xla_flags = xla_flags
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._directory = tempfile.TemporaryDirectory(prefix="wus_worker_")  # removed with the Worker
        self._stderr_path = os.path.join(self._directory.name, "stderr.txt")

    def run(self, function, case):
        """`function(case)` in the worker; raises WorkerError (an exception there) or WorkerCrash."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(self._stderr_path, self._xla_flags))
        open(self._stderr_path, "w").close()
        future = self._pool.submit(_call, function, case)
        try:
            return future.result(timeout=WORKER_TIMEOUT_S)
        except (BrokenProcessPool, concurrent.futures.TimeoutError) as exc:
            self.close()
            with open(self._stderr_path, encoding="utf-8", errors="replace") as f:
                lines = [line for line in f.read().splitlines() if not line.lstrip().startswith("@ ")]
            what = "hung" if isinstance(exc, concurrent.futures.TimeoutError) else "crashed"
            raise WorkerCrash(f"the worker {what} on {case}:\n" + "\n".join(lines[-15:])) from None

    def close(self) -> None:
        """Stop the worker process (killed: it may be stuck in XLA)."""
        if self._pool is None:
            return
        for process in list(self._pool._processes.values()):  # noqa: SLF001 - the executor's own children
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
