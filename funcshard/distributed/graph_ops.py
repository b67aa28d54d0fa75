"""Collectives as torch custom ops, for compiled graphs that run on gloo.

A graph's collectives are torch's functional ones (``_c10d_functional``) where they cost
what the eager ones cost (NCCL). On a CPU gloo group the functional all-gather goes through
gloo's coalesced all-gather, which gathers into a buffer of its own and copies each rank's
section out of it: two copies of the gathered bytes a call that the eager step does not make
(:func:`funcshard.distributed.ops.all_gather_pieces` receives each peer's section in place).
:func:`all_gather_sections` is that eager gather as one op a graph holds (dynamo and
AOTAutograd trace it, inductor calls it as an extern kernel): the same values, the bytes
received where they belong. It returns when the sections have arrived (no separate wait: the
compiler's overlap passes, which move only functional collectives, do not see it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from funcshard.distributed.ops import gather_in_place

__all__ = ["all_gather_sections", "ALL_GATHER_SECTIONS"]


@torch.library.custom_op("funcshard::all_gather_sections", mutates_args=())
def all_gather_sections(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's 1-D ``shard`` of the group named ``group_name`` (``group_size`` ranks),
    concatenated in group rank order: what ``_c10d_functional.all_gather_into_tensor``
    returns, received in place by point-to-point sends (gloo)."""
    group = _resolve_process_group(group_name)
    assert dist.get_world_size(group) == group_size, (group_name, group_size)
    out = shard.new_empty(group_size * shard.numel())
    return gather_in_place(out, shard.contiguous(), group)


@all_gather_sections.register_fake
def _(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:  # noqa: ARG001
    return shard.new_empty(group_size * shard.numel())


# the op as a graph node's target
ALL_GATHER_SECTIONS = torch.ops.funcshard.all_gather_sections.default
