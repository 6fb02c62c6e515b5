"""Shared helpers for pass tests: differential execution (the rewritten module must compute what
the original did), and the all-reduce programs and inputs that the all-reduce rewrites are run on."""
from __future__ import annotations

import string

import jax
import numpy as np

import hlo_tools
import real_programs
import xla_passes
from hlo_tools.xla import runner


def run_and_compare(text: str, passes: str, *, num_replicas: int | None = None,
                    num_partitions: int | None = None, exact: bool = True,
                    abs_error_bound: float = 1e-5, rel_error_bound: float = 1e-5,
                    expect_change: bool | None = True, inputs=None, seed: int = 0,
                    isolate: bool = False) -> hlo_tools.HloModule:
    """Run `passes` on `text`, execute both modules on the same inputs, assert equal outputs.

    `expect_change` is what the pipeline must report (None: either).
    `exact` demands bit-equal outputs (combining collectives must not change a
    single bit); otherwise the error bounds apply (float reassociation).
    `isolate` runs both in a child process, which starts as many CPU devices as they need
    (this process has 8).
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
        abs_error_bound=bounds[0], rel_error_bound=bounds[1], seed=seed, isolate=isolate)
    assert comparison.ok, f"{passes} changed the results:\n{comparison.format()}\n--- rewritten:\n{after}"
    return module


# --- all-reduce programs ---------------------------------------------------------------------------

def reducer(name: str, dtype: str, opcode: str) -> str:
    """HLO text of the computation `name` that reduces two `dtype` scalars with `opcode`, after a
    blank line (concatenated reducers read as a module's computations)."""
    return f"""
{name} {{
  a = {dtype}[] parameter(0)
  b = {dtype}[] parameter(1)
  ROOT c = {dtype}[] {opcode}(a, b)
}}
"""


# add and max over element type $t.
REDUCERS = reducer("add", "$t", "add") + reducer("max", "$t", "maximum")

# 15 and 7 elements need padding for every group size above 1, the tuple is 33 elements in one
# buffer, the while body sums three times, and maximum checks that the padding never meets real
# values.
_REPLICA_PROGRAM = string.Template("""HloModule replica_sums, replica_count=$n
""" + REDUCERS + """
cond {
  s = (s32[], $t[3]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}

body {
  s = (s32[], $t[3]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = $t[3] get-tuple-element(s), index=1
  one = s32[] constant(1)
  next = s32[] add(i, one)
  sum = $t[3] all-reduce(x), replica_groups=$groups, to_apply=add
  ROOT t = (s32[], $t[3]) tuple(next, sum)
}

ENTRY main {
  p = $t[5,3] parameter(0)
  q = $t[4,8] parameter(1)
  s = $t[] parameter(2)
  m = $t[7] parameter(3)
  ar = $t[5,3] all-reduce(p), replica_groups=$groups, to_apply=add
  pair = ($t[4,8], $t[]) all-reduce(q, s), replica_groups=$groups, to_apply=add
  q_sum = $t[4,8] get-tuple-element(pair), index=0
  s_sum = $t[] get-tuple-element(pair), index=1
  largest = $t[7] all-reduce(m), replica_groups=$groups, to_apply=max
  zero = s32[] constant(0)
  m3 = $t[3] slice(m), slice={[0:3]}
  init = (s32[], $t[3]) tuple(zero, m3)
  w = (s32[], $t[3]) while(init), condition=cond, body=body
  looped = $t[3] get-tuple-element(w), index=1
  ROOT out = ($t[5,3], $t[4,8], $t[], $t[7], $t[3]) tuple(ar, q_sum, s_sum, largest, looped)
}
""")
REPLICA_PROGRAM_ALL_REDUCES = 4


def replica_program(dtype: str, replicas: int, groups: str = "{}") -> str:
    """A module of `replicas` replicas whose four all-reduces of `dtype` values run over `groups`
    (see `_REPLICA_PROGRAM`)."""
    return _REPLICA_PROGRAM.substitute(t=dtype, n=replicas, groups=groups)


def replica_input_shapes(replicas: int) -> list[tuple[int, ...]]:
    """The shapes of `replica_program`'s inputs: one slice per replica."""
    return [(replicas, 5, 3), (replicas, 4, 8), (replicas,), (replicas, 7)]


# `flat` sums over global device ids; `every` has a channel but no use_global_device_ids, so
# {{0}} is replica 0 with all partitions. The outputs are tiled, so every device's result is
# compared.
_PER_DEVICE_PROGRAM = string.Template("""HloModule per_device_sums, num_partitions=$n
""" + REDUCERS + """
ENTRY main {
  p = $t[5,3] parameter(0), sharding={devices=[$n,1]<=[$n]}
  h = $t[6] parameter(1), sharding={devices=[$n]<=[$n]}
  flat = $t[5,3] all-reduce(p), channel_id=1, replica_groups=$groups, use_global_device_ids=true, to_apply=add
  every = $t[6] all-reduce(h), channel_id=2, replica_groups={{0}}, to_apply=max
  ROOT out = ($t[5,3], $t[6]) tuple(flat, every), sharding={{devices=[$n,1]<=[$n]}, {devices=[$n]<=[$n]}}
}
""")
PER_DEVICE_PROGRAM_ALL_REDUCES = 2


def per_device_program(dtype: str, partitions: int, groups: str | None = None) -> str:
    """A per-device module of `partitions` partitions with two all-reduces of `dtype` values, `flat`
    over `groups` of global device ids (all of them by default; see `_PER_DEVICE_PROGRAM`)."""
    groups = f"[1,{partitions}]<=[{partitions}]" if groups is None else groups
    return _PER_DEVICE_PROGRAM.substitute(t=dtype, n=partitions, groups=groups)


def per_device_input_shapes(partitions: int) -> list[tuple[int, ...]]:
    """The shapes of `per_device_program`'s inputs: global arrays."""
    return [(5 * partitions, 3), (6 * partitions,)]


def normal_inputs(shapes, dtype=np.float32) -> list[np.ndarray]:
    """Random normal arrays of `shapes` and numpy `dtype` (the same on every call)."""
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def shard_map_step_outputs() -> list[np.ndarray]:
    """The data-parallel shard_map MLP step (psum of gradients) on fixed random inputs; a fresh
    function each time, so XLA compiles it again (under whatever passes are enabled)."""
    fn, args = real_programs.shard_map_mlp_step()
    leaves, tree = jax.tree.flatten(args)
    rng = np.random.default_rng(0)
    placed = [jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding) for a in leaves]
    return [np.asarray(o) for o in jax.tree.leaves(fn(*jax.tree.unflatten(tree, placed)))]
