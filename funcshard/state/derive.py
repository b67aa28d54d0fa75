"""The copies of the weights derived from the masters: packing the model's weights into the
master flats (``fs.init``), and the compute copies every step and restore derives from them.

The one source of truth per weight is the master flat buffer of its bucket; :func:`derive_compute`
gives every other copy (ZeRO 0-2's full compute params, an offloaded ZeRO-3 bucket's device
shard, HFSDP's inner shard) as a function of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcshard.comm import params as params_lib
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout

__all__ = ["derive_compute", "pack_masters"]


def derive_compute(
    layout: Layout,
    master: tuple[torch.Tensor, ...],
    local: Sequence[torch.Tensor | None] | None = None,
    *,
    into: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The compute copies implied by the master buffers (a collective under ZeRO 1-2).

    ZeRO 0-2: per bucket the full compute params (full layout, compute dtype, on the device),
    the master itself when no cast or move is needed. ZeRO-3: only offloaded buckets keep a
    device compute shard; the others are cast at gather time. HFSDP first all-gathers the
    replicas' masters over "replicate" into the inner shard (:attr:`Layout.inner`), which
    ZeRO-3 keeps for every bucket: in the compute dtype, or with a param wire as the ``R``
    masters packed on it (each encoded once by its owner:
    :func:`funcshard.comm.params.gather_replicas`).

    Args:
      layout: the state's layout.
      master: one master flat per bucket.
      local: optional, per bucket, the master already cast to the compute dtype on the device
        (``offload_step`` writes it during the CPU step); None entries are cast here.
      into: optional, per bucket, a donated compute copy of the same layout to write each
        new one into (``restore``): one bucket's new copy at a time is alive, not all.
    """
    out = []
    for i, m in enumerate(master):
        old = None if into is None or into[i] is None or into[i].is_meta else into[i]
        c = _derive_one(layout, i, m, None if local is None else local[i], old)
        if c is not None and old is not None and not _same_buffer(c, old):
            assert old.shape == c.shape and old.dtype == c.dtype, "a compute copy of the layout"
            old.copy_(c)
            c = old
        out.append(c)
    return tuple(out)


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device == b.device


def _derive_one(
    layout: Layout, i: int, m: torch.Tensor, given: torch.Tensor | None, into: torch.Tensor | None
) -> torch.Tensor | None:
    """Bucket ``i``'s compute copy of master ``m`` (``derive_compute``'s, one bucket); ZeRO
    0-2's full params gathered into ``into`` where the gather can write there."""
    inner = layout.inner
    bucket = layout.buckets[i]
    dtype, part = bucket.dtypes.compute, inner.buckets[i]
    sharded = layout.strategy.shards_params
    # ZeRO-3 keeps a compute shard where it cannot be cast from the master at gather
    # time: an offloaded master, or (HFSDP) a master that is 1/R of the shard
    keep = sharded and (bucket.offload or layout.hierarchical)
    if m.is_meta:
        if keep and params_lib.packs_shard(inner, part):
            return params_lib.empty_packed(inner, part, "meta")
        size = part.numel * (1 if sharded else inner.over(part).shard_size)
        kept = keep or not sharded
        return torch.empty(size, dtype=dtype, device="meta") if kept else None
    if given is not None:
        assert given.dtype == dtype and given.numel() == m.numel(), "a derived shard"
    local_i = (
        given
        if given is not None
        else m.to(device=layout.device, dtype=dtype, non_blocking=bucket.offload)
    )
    if layout.hierarchical:  # the updated masters of every replica: the inner shard
        local_i = params_lib.gather_replicas(layout, bucket, local_i)
    if sharded:
        return local_i if keep else None
    return params_lib.gather_full(inner, part, local_i, into)


def pack_masters(layout: Layout, named: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """This rank's master flat of every bucket, packed from the model's weights (pinned on the
    host when offloaded beside a CUDA device)."""
    master = []
    for bucket in layout.buckets:
        specs = layout.bucket_leaves(bucket)
        device = "cpu" if bucket.offload else layout.device
        flat = shard_lib.pack_local(
            [named[s.name] for s in specs],
            specs,
            layout.over(bucket).shard_rank,
            dtype=bucket.dtypes.master,
            device=device,
        )
        if bucket.offload and flat.device.type == "cpu" and layout.device.type == "cuda":
            flat = flat.pin_memory()
        master.append(flat)
    return tuple(master)
