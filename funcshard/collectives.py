"""The old import path of :mod:`funcshard.comm.ops` (``funcshard.optim.matrices`` still uses it)."""

from funcshard.comm.ops import (  # noqa: F401
    AXES,
    Axis,
    CommStats,
    Pending,
    all_gather,
    all_reduce,
    all_to_all,
    comm_stats,
    exchange_blocks,
    record,
    reduce_scatter,
    track_gathered,
)
