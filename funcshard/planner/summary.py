"""``describe``: a short human-readable summary of a state on this rank."""

from __future__ import annotations

import torch

from funcshard.state.state import TrainState, tree

__all__ = ["describe"]


def describe(state: TrainState) -> str:
    """A short human-readable summary of a state's layout and memory on this rank."""
    layout = state.layout
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)
    opt_leaves = [t for t in tree.leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    lines = [
        f"strategy={layout.strategy} outer_strategy={layout.outer} "
        f"mesh={tuple(layout.mesh.shape)} shard_size={layout.shard_size}",
        f"params={len(layout.leaves)} buckets={len(layout.buckets)} units={len(layout.units)}",
        f"offload_fraction requested={layout.offload_fraction:.3f} "
        f"achieved={layout.achieved_offload_fraction():.3f} "
        f"(buckets on cpu: {sum(b.offload for b in layout.buckets)}/{len(layout.buckets)})",
        f"bytes: master={nbytes(state.master)} compute={nbytes(state.compute)} "
        f"opt_state={nbytes(opt_leaves)}",
    ]
    return "\n".join(lines)
