"""What the optimizer holds per bucket and what Muon exchanges, for ``fs.plan``: the state
from a meta-device init of the optimizer itself, the exchange from Muon's own plan."""

from __future__ import annotations

import optree
import torch

from funcshard.layout.buckets import NAMESPACE, per_bucket_parts
from funcshard.layout.layout import Layout
from funcshard.optim import MuonState, Optimizer
from funcshard.optim.matrices import exchange_plan
from funcshard.parallel.tensor import gather_numel

__all__ = ["optimizer_state_bytes", "muon_exchange"]

_OPTIMIZER_STATES = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}


def optimizer_state_bytes(optimizer: str | Optimizer, layout: Layout) -> list[int]:
    """Optimizer-state bytes per bucket: every tensor of every per-bucket part (moments in
    their stored dtype, 8-bit scales), from a meta-device init (an optimizer of
    ``multi_transform`` keeps its own parts)."""
    if isinstance(optimizer, str):
        if optimizer not in _OPTIMIZER_STATES:
            raise ValueError(
                f"plan: unknown optimizer {optimizer!r}; expected one of "
                f"{sorted(_OPTIMIZER_STATES)} or an fs.optim optimizer"
            )
        n = _OPTIMIZER_STATES[optimizer]
        return [n * b.numel * b.dtypes.master.itemsize for b in layout.buckets]
    nbytes = [0] * len(layout.buckets)
    for part in per_bucket_parts(_meta_init(optimizer, layout)):
        for i, x in enumerate(part):
            if isinstance(x, torch.Tensor):
                nbytes[i] += x.numel() * x.element_size()
    return nbytes


def _meta_init(optimizer: Optimizer, layout: Layout):
    """The optimizer's initial state over meta buffers of the layout (nothing allocated)."""
    return optimizer.init(
        layout.per_bucket(
            [torch.empty(b.numel, dtype=b.dtypes.master, device="meta") for b in layout.buckets]
        )
    )


def muon_exchange(
    optimizer: str | Optimizer, layout: Layout
) -> tuple[int, int, int, dict[str, int]]:
    """``(bytes, calls, owner bytes, bytes by axis)`` of Muon's exchange on the busiest rank
    (per axis: the busiest rank on that axis)."""
    S = layout.shard_size
    R = layout.dp_size // S  # replicas, each working on its share of the matrices
    T = layout.tensor.size
    if isinstance(optimizer, str) or S * R * T == 1:
        return 0, 0, 0, {}
    owned: set[int] = set()
    muon_states = [
        x
        for x in optree.tree_leaves(
            _meta_init(optimizer, layout),
            is_leaf=lambda x: isinstance(x, MuonState),
            none_is_leaf=False,
            namespace=NAMESPACE,
        )
        if isinstance(x, MuonState)
    ]
    for st in muon_states:
        for part in per_bucket_parts(st.momentum):
            owned |= {i for i, x in enumerate(part) if x is not None}
    groups = [[b.index for b in layout.buckets if not b.offload and b.index in owned]]
    groups += [[b.index] for b in layout.buckets if b.offload and b.index in owned]
    sent, calls, held, gathered, within, tensor = ([0] * S for _ in range(6))
    calls = 0
    add = lambda acc, part: [a + b for a, b in zip(acc, part or [0] * S, strict=True)]
    for group in groups:
        specs = [s for i in group for s in layout.bucket_leaves(layout.buckets[i])]
        if not specs:
            continue
        ex = exchange_plan([_planned(layout, s, S, T) for s in specs], S, replicas=R)
        sent, gathered = add(sent, ex.sent_bytes), add(gathered, ex.gather_bytes)
        within, tensor = add(within, ex.shard_bytes), add(tensor, ex.tensor_bytes)
        held = [max(a, b) for a, b in zip(held, ex.owner_bytes, strict=True)]
        calls += ex.calls
    by_axis = {layout.shard_axis: max(within), "tensor": max(tensor)}
    if R > 1:
        by_axis[layout.replicate_axis] = max(gathered)
    return max(sent), calls, max(held), by_axis


def _planned(layout: Layout, spec, S: int, T: int) -> tuple:
    """One matrix as :func:`exchange_plan` reads it: local shape, rows per shard rank, the
    model's shape, the elements of its all-gather over "tensor" (0 when not split)."""
    rows = [spec.row_range(r) for r in range(S)]
    if not layout.tensor.splits(spec.name):
        return spec.shape, rows, spec.shape, 0
    leaf = layout.tensor.leaves[spec.name]
    return spec.shape, rows, leaf.shape, gather_numel(leaf.shape, leaf.dim, T)
