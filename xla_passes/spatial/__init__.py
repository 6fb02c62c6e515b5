"""Building blocks of the `spatial-partitioning` pass (xla_passes/passes/spatial_partitioning.py).

`windows`: the halo arithmetic of one split dimension of a windowed op; `layout`: how a
value is split over the device mesh; `builder`: the instructions that move slabs between
devices (halo exchange, all-gather, all-reduce) and address them (partition offsets, masks).
"""
