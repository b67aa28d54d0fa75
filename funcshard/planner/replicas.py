"""The collectives a fault-tolerant step adds across replica groups, in a plan
(``fs.plan(..., replica_groups=G)``)."""

from __future__ import annotations

import torch

from funcshard.comm.codec import EIGHT_BIT
from funcshard.layout.layout import Layout

__all__ = ["add_replica_groups"]

_METRIC_BYTES = 8  # one float64 scalar per reduction


def add_replica_groups(
    layout: Layout, groups: int, world: int, nbytes: dict, calls: dict, by_axis: dict
) -> None:
    """Adds a fault-tolerant step's collectives across ``groups`` replica groups (none for
    one): :class:`funcshard.fault.replicas.Replicas`' all-reduces and its heal agreement."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"plan: replica_groups must be an int >= 1, got {groups!r}")
    if groups == 1:
        return

    def add(kind: str, size: int, axis: str) -> None:
        nbytes[kind] += size
        calls[kind] += 1
        by_axis[axis] += size

    for b in layout.buckets:
        grad, comm = b.dtypes.grad, b.dtypes.comm
        wire = grad if comm in EIGHT_BIT else comm
        add("all_reduce", b.numel * wire.itemsize, "replicas")
    add("metrics", _METRIC_BYTES, "replicas")  # the loss
    if world > 1:  # the group's ranks agree whether one of them healed (2 fp32 flags)
        add("metrics", 2 * torch.float32.itemsize, "world")
