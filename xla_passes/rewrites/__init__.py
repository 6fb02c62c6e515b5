"""IR rewrites the passes share: each edits a module in place and is no pass itself.

- `inlining`: calls and fusions replaced by their bodies (`inline`, `inline_calls`,
  `inline_fusions`), and instructions put in fusions of their own (`wrap_in_fusions`);
- `cse`: common-subexpression elimination of one computation;
- `channel_ids`: fresh channel ids for new collectives (`ChannelIds`);
- `all_reduce`: the scaffolding of rewriting an all-reduce into other collectives
  (`AllReduceReplacementBuilder`, `Addressing`, `replace_by_shard_reduction`);
- `reduction_tree`: an all-reduce as a pipelined reduce-then-broadcast on a spanning tree of
  physical links (`ReductionTree`, `TreeAllReduceBuilder`).
"""
