"""Analyses the passes share: questions about a module that change nothing in it.

- `collectives`: when two collectives do the same communication (keys), in which groups and
  scopes they may be combined, and the combining itself that the combiners share;
- `replica_groups`: which devices a collective's `replica_groups` name (`DeviceCounts`,
  `participant_groups`, `inferred_device_counts`);
- `dataflow`: the forward dataflow engine that analyses of values are clients of (a lattice,
  transfer functions; tuples, calls, loops and conditionals followed by the engine);
- `replication_analysis`: which values are the same on every device of a group;
- `reachability`: what depends on what (`DependencyTracker`, `reachable_from`,
  `operand_connected_components`);
- `elementwise`: which instructions compute each element from the same element of their operands;
- `reductions`: reductions whose partial results combine (full, blockwise, along some dimensions;
  norm and statistics fusions);
- `reorderings`: instructions that only move elements, and reads of a value through them or in
  any order;
- `constants`: the value of a constant operand (`scalar_constant`, `folded_scalar_constant`);
- `topology_fit`: whether an all-reduce can be rewritten onto a topology's devices
  (`all_reduce_misfit`, `permute_space`).
"""
