"""The generated real modules are what they claim to be, independent of hlo_tools' parser."""

import re

import jax
import jax.numpy as jnp
import pytest

import real_programs
from hlo_tools.xla import xla_bridge

SOURCES = ["jax_modules", "pass_hook_modules", "xla_dump_modules", "tf_modules"]


@pytest.mark.parametrize("source", SOURCES)
def test_xla_accepts_every_generated_module(source, request):
    modules = request.getfixturevalue(source)
    assert modules
    for name, text in modules.items():
        assert text.startswith("HloModule "), name
        assert xla_bridge.canonical_text(text).startswith("HloModule "), name


def test_jax_programs_have_every_stage(jax_modules):
    expected = {f"jax.{program}.{stage}" for program in real_programs.JAX_PROGRAMS
                for stage in ("before", "before_debug", "after")}
    assert set(jax_modules) == expected


@pytest.mark.parametrize("program", ["shard_map_mlp", "pmap_psum", "flax_cnn_adam"])
def test_data_parallel_steps_reduce_gradients_across_8_devices(jax_modules, program):
    for stage in ("before", "after"):
        text = jax_modules[f"jax.{program}.{stage}"]
        assert " all-reduce(" in text
        # one group of the 8 devices: {{0,...,7}} (jax 0.10), or the 8-device mesh axis (jax 0.12)
        assert re.search(r"replica_groups=(\{\{0,1,2,3,4,5,6,7\}\}|mesh\['\w+'=8\] \{'\w+'\})", text)


def test_named_sharding_step_is_partitioned_for_2x4_mesh(jax_modules):
    before = jax_modules["jax.jit_named_sharding_2x4.before"]
    after = jax_modules["jax.jit_named_sharding_2x4.after"]
    assert "sharding={devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}" in before  # w1: P(None, "model")
    assert "num_partitions=8" in after
    assert " all-reduce(" in after or " all-gather(" in after


def test_flax_step_has_convolution_and_adam_state(jax_modules):
    before = jax_modules["jax.flax_cnn_adam.before"]
    assert " convolution(" in before
    assert " sqrt(" in before or " rsqrt(" in before  # adam's second-moment normalization


def test_control_flow_programs(jax_modules):
    assert " while(" in jax_modules["jax.scan_while.before"]
    assert " while(" in jax_modules["jax.scan_while.after"]
    assert " conditional(" in jax_modules["jax.conditional.before"]


def test_debug_info_adds_source_tables(jax_modules):
    assert "\nStackFrames\n" in jax_modules["jax.shard_map_mlp.before_debug"]
    assert "\nStackFrames\n" not in jax_modules["jax.shard_map_mlp.before"]


def test_pass_hook_sees_both_stages(pass_hook_modules):
    stages = {name.split(".")[1] for name in pass_hook_modules}
    assert stages == {"pre_scheduler", "post_scheduler"}
    assert all(" all-reduce(" in text for text in pass_hook_modules.values())


def test_pass_hook_is_removed_on_exit():
    with real_programs.recording_pass_hook() as received:
        jax.jit(lambda x: jnp.cos(x) + 3.0).lower(jnp.ones(5)).compile()
    seen = len(received)
    assert seen >= 1
    jax.jit(lambda x: jnp.cos(x) - 4.0).lower(jnp.ones(5)).compile()
    assert len(received) == seen


def test_xla_dump_has_before_after_and_per_pass_modules(xla_dump_modules):
    names = list(xla_dump_modules)
    assert len(names) <= real_programs.MAX_DUMP_MODULES
    for program in ("jit_step", "jit_small_program"):
        assert any(program in n and n.endswith(".before_optimizations") for n in names)
        assert any(program in n and n.endswith("_after_optimizations") for n in names)
        assert sum(program in n and ".after_" in n for n in names) >= 5


def test_tf_modules_before_and_after_optimization(tf_modules):
    for program in ("dense_train_step", "conv_net_forward"):
        before = tf_modules[f"tf.{program}.hlo"]
        after = tf_modules[f"tf.{program}.optimized_hlo"]
        assert before != after
        assert "is_scheduled=true" in after
    assert " convolution(" in tf_modules["tf.conv_net_forward.hlo"]
