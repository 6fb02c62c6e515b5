"""The built-in passes; importing this package registers them all."""
from . import call_inliner, cse, dce, tuple_simplifier  # noqa: F401
from . import all_reduce_2d, all_reduce_decomposer, all_reduce_rings  # noqa: F401
from . import all_gather_combiner, all_reduce_combiner, all_reduce_simplifier, collective_fusion  # noqa: F401
from . import reduce_scatter_combiner  # noqa: F401
from . import weight_update_sharding  # noqa: F401
from . import spatial_partitioning  # noqa: F401
from . import distributed_batch_norm  # noqa: F401
