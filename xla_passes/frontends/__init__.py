"""The front ends: what switches the passes on inside a program's own compiles.

- `jax`: the pass hook in JAX's XLA compiles (`enable`, `disable`, `enabled`) and
  `jit(fun, passes=...)` on JAX's lowering;
- `jax_plugin`: the `jax_plugins` entry point, which applies `XLA_PASSES` when JAX starts;
- `flags`: the absl flags `--xla_passes` and friends;
- `configuration`: the settings those read, from the environment and the flags;
- `tensorflow`: `function(fn, passes=...)`, a TF step through a pipeline.

Users import the public modules `xla_passes.jax`, `xla_passes.flags` and
`xla_passes.tensorflow`, which re-export the public names of these. Importing this
package imports none of its modules (nor JAX or TensorFlow).
"""
