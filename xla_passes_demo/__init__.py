"""xla_passes_demo: the model zoo and the main job, beside the library.

- `models`: the seeds' model families (ResNet, a Transformer encoder) as Flax modules and
  data-parallel training steps;
- `training`: the Flax + Optax data-parallel step that the demo, the plugin tests and the
  benchmarks train, and the compile-and-measure steps they share;
- `demo`: the main job, `python -m xla_passes_demo`;
- `dependencies`: the one import guard for flax and optax (the `demo` extra).

This package imports `xla_passes`; `xla_passes` never imports it. Importing the package
imports none of its modules (nor flax or optax).
"""
