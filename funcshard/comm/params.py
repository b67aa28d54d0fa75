"""The params' wire and every gather of params.

A rank encodes (packs) its compute shard once, on the sending side; the gathers move the
packed bytes and decode exactly once, into the full compute params, by the blocks of the
master sections. HFSDP packs each master where it is updated: the outer gather over
"replicate" moves the packed masters into the inner shard, which stays packed (ZeRO-3 keeps it
so between steps, ``Layout.packed_sections``), and the gather over "shard" moves those bytes
again, unchanged. Blocks never cross a row and rows are never split, so the decoded params are
a function of the masters alone, the same bits on every layout.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from funcshard.comm import codec
from funcshard.comm.codec import EIGHT_BIT
from funcshard.distributed import ops
from funcshard.layout import sharding as shard_lib

if TYPE_CHECKING:
    from funcshard.layout.layout import Bucket, Layout, LeafSpec

__all__ = [
    "param_wire",
    "section_leaves",
    "section_blocks",
    "packs_shard",
    "packed_nbytes",
    "empty_packed",
    "pack_params",
    "gather_replicas",
    "all_gather_params",
    "gather_full",
    "gather_shards",
    "all_gather_nbytes",
]


def param_wire(layout: Layout, bucket: Bucket) -> torch.dtype | None:
    """The dtype a bucket's compute params travel in, None when it is the compute dtype."""
    wire = layout.policy.param_comm_dtype
    return None if wire is None or wire == bucket.dtypes.compute else wire


def _sections(layout: Layout) -> int:
    """Master sections per shard of ``layout`` (R for HFSDP's inner layout, else 1)."""
    return max(1, layout.packed_sections)


def _sizes(layout: Layout, bucket: Bucket) -> list[int]:
    """Each leaf's numel in a bucket's shard: the pieces of :func:`ops.all_gather_pieces`."""
    return [s.shard_numel for s in layout.bucket_leaves(bucket)]


def section_leaves(layout: Layout, bucket: Bucket) -> list[LeafSpec]:
    """The leaves of one master section of a bucket's shard, as a master flat packs them (the
    bucket's own specs; 1/R of the rows and offsets of each under HFSDP's inner layout)."""
    specs, k = layout.bucket_leaves(bucket), _sections(layout)
    if k == 1:
        return specs
    return [
        dataclasses.replace(s, rows_per_shard=s.rows_per_shard // k, offset=s.offset // k)
        for s in specs
    ]


def section_blocks(layout: Layout, bucket: Bucket) -> codec.Blocks:
    """The blocks of one master section of a bucket's shard (what a param wire packs)."""
    return codec.blocks(
        tuple((s.rows_per_shard, s.row_numel) for s in section_leaves(layout, bucket))
    )


def packs_shard(layout: Layout, bucket: Bucket) -> bool:
    """Whether a bucket's compute shard is kept packed: HFSDP's inner layout with a param
    wire (its ``packed_sections`` master sections, as they crossed "replicate")."""
    return layout.packed_sections > 0 and param_wire(layout, bucket) is not None


def packed_nbytes(layout: Layout, bucket: Bucket) -> int:
    """Bytes of one master section of a bucket's shard on its param wire (the compute dtype
    when there is none)."""
    wire = param_wire(layout, bucket) or bucket.dtypes.compute
    if wire in EIGHT_BIT:
        return section_blocks(layout, bucket).nbytes
    return bucket.numel // _sections(layout) * wire.itemsize


def empty_packed(layout: Layout, bucket: Bucket, device: torch.device | str) -> torch.Tensor:
    """An uninitialized packed shard of a bucket (its ``packed_sections`` sections)."""
    wire = param_wire(layout, bucket)
    dtype = torch.uint8 if wire in EIGHT_BIT else wire
    numel = _sections(layout) * packed_nbytes(layout, bucket) // dtype.itemsize
    return torch.empty(numel, dtype=dtype, device=device)


def pack_params(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """A bucket's compute shard (one master section) packed on its param wire."""
    wire = param_wire(layout, bucket)
    assert wire is not None, "a param wire"
    return codec.pack(local, wire, section_blocks(layout, bucket) if wire in EIGHT_BIT else None)


def gather_replicas(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """HFSDP: this rank's inner shard of a bucket from every replica's updated master
    (``local``: this rank's, in the compute dtype). With a param wire each master is packed
    once, here, and the inner shard is the ``R`` packed sections in replica order: they
    cross "replicate" and stay packed (:func:`packs_shard`); else the compute-dtype shard
    gathered over "replicate" from the replicas' master flats."""
    layout = layout.over(bucket)  # an expert bucket: over the ranks of its expert index
    replicas = layout.replicas
    if param_wire(layout, bucket) is None:
        if replicas == 1:
            return local
        group = layout.replicate_group
        return ops.all_gather_pieces(local, _sizes(layout, bucket), group, axis=ops.Axis.REPLICATE)
    packed = pack_params(layout, bucket, local)
    if replicas == 1:
        return packed
    return ops.all_gather(packed, layout.replicate_group, axis=ops.Axis.REPLICATE)


def all_gather_params(layout: Layout, bucket: Bucket, local: torch.Tensor) -> ops.Pending:
    """A bucket's full compute params (the full layout, compute dtype) gathered over the
    layout's shard group from this rank's compute shard (asynchronous; ZeRO-3's gathers,
    ZeRO 0-2's compute copies).

    Without a param wire the compute-dtype shards move. With one, the packed shards do
    (``local`` packed here, or already packed under :func:`packs_shard`), and the result is
    decoded once, section by section, on arrival."""
    layout = layout.over(bucket)
    S, wire = layout.shard_size, param_wire(layout, bucket)
    if wire is None:
        if S == 1:
            return ops.Pending(None, local)
        group, axis = layout.shard_group, layout.shard_axis
        return ops.all_gather_pieces(local, _sizes(layout, bucket), group, axis=axis, async_op=True)
    count, sections = S * _sections(layout), section_leaves(layout, bucket)
    eight_bit = section_blocks(layout, bucket) if wire in EIGHT_BIT else None
    packed = local if packs_shard(layout, bucket) else pack_params(layout, bucket, local)
    compute = bucket.dtypes.compute
    finish = lambda r: codec.unpack(r, wire, eight_bit, count, compute)  # noqa: E731
    if S == 1:
        pending = ops.Pending(None, packed)
    else:
        pending = ops.all_gather(packed, layout.shard_group, axis=layout.shard_axis, async_op=True)
    return ops.Pending.then(
        pending, lambda r: shard_lib.from_rank_sections(finish(r), sections, count)
    )


def gather_full(
    layout: Layout, bucket: Bucket, local: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """ZeRO 0-2's full compute params of a bucket from this rank's compute shard, through
    ``param_comm_dtype`` when it differs from the compute dtype (also with one shard, so the
    compute params are the same function of the masters on every layout). ``out``: where
    the gather without a param wire writes (a donated copy, ``restore``'s); may be unused."""
    if param_wire(layout, bucket) is None:
        return gather_shards(layout, bucket, local, out)
    return all_gather_params(layout, bucket, local).wait()


def gather_shards(
    layout: Layout, bucket: Bucket, local: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A bucket's local flat all-gathered over the shard axis into the full layout, as it is
    (no param wire); into ``out`` when given (with one shard, ``local`` is the result)."""
    layout = layout.over(bucket)
    if layout.shard_size == 1:
        return local
    group, axis = layout.shard_group, layout.shard_axis
    return ops.all_gather_pieces(local, _sizes(layout, bucket), group, axis=axis, out=out)


def all_gather_nbytes(layout: Layout, bucket: Bucket) -> int:
    """Bytes counted for one shard-axis all-gather of a bucket's compute params."""
    return layout.over(bucket).shard_size * _sections(layout) * packed_nbytes(layout, bucket)
