"""Gradient reduction: reduce-scatter over "shard", then all-reduce over "replicate" (HSDP)
or reduce-scatter over it into the masters (HFSDP).

The reduced result REPLACES a gradient; it is never added to the local unreduced one (the
``g_i + sum(g)`` bug of seed 003 cannot be written with these functions: the only input of the
accumulator is a reduce-scatter output). Gradients reach the wire in ``grad_comm_dtype``,
pre-divided by the data-parallel size so the sum is the mean, and come back in
``main_grads_dtype``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from funcshard import collectives
from funcshard import sharding as shard_lib
from funcshard import wire as wire_lib
from funcshard.layout import Bucket, Layout, build_layout
from funcshard.policy import MixedPrecisionPolicy
from funcshard.reduction import reduction_of
from funcshard.strategy import Strategy

__all__ = [
    "reduce_scatter_grads",
    "reduce_shard_axis",
    "start_reduce_shard_axis",
    "reduce_replicate_axis",
    "start_reduce_replicate_axis",
    "reduce_step_grads",
    "global_norm",
]


def reduce_shard_axis(layout: Layout, bucket: Bucket, sections: torch.Tensor) -> torch.Tensor:
    """Rank-section gradients -> this rank's shard of their mean over "shard".

    ``sections`` is consumed (it may be scaled in place). The divisor is the whole
    data-parallel size; ``reduce_replicate_axis`` only sums.
    """
    return start_reduce_shard_axis(layout, bucket, sections).wait().to(bucket.dtypes.grad)


def start_reduce_shard_axis(
    layout: Layout, bucket: Bucket, sections: torch.Tensor
) -> collectives.Pending:
    """``reduce_shard_axis`` without waiting and without the final cast: ``wait()`` gives this
    rank's shard of the mean in ``grad_comm_dtype`` (summed in tree order when the layout is
    deterministic); a low-precision wire (:func:`funcshard.wire.reduces_in_fp32`) gives it in
    fp32 instead, summed there."""
    if wire_lib.reduces_in_fp32(bucket.dtypes):
        return wire_lib.start_reduce_shard_axis(layout, bucket, sections)
    wire = sections.to(bucket.dtypes.comm)
    if layout.dp_size > 1:  # a division by one would be a pass over the gradient for nothing
        wire.div_(layout.dp_size)
    if layout.shard_size == 1:
        return collectives.Pending(None, wire)
    return reduction_of(layout).start_reduce_scatter(wire, layout.shard_group, axis="shard")


def reduce_replicate_axis(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """Sums a gradient shard over the replicas (the whole world under ``no_shard``).

    HFSDP: ``local`` is the inner shard (:attr:`Layout.inner`), reduce-scattered over
    "replicate" into this rank's master shard.
    """
    return start_reduce_replicate_axis(layout, bucket, local).wait()


def start_reduce_replicate_axis(
    layout: Layout, bucket: Bucket, local: torch.Tensor
) -> collectives.Pending:
    """``reduce_replicate_axis`` without waiting for HFSDP's reduce-scatter (the all-reduce
    of HSDP is done when this returns)."""
    group = layout.replicate_group
    reduction = reduction_of(layout)
    grad = bucket.dtypes.grad
    if layout.hierarchical:
        specs, replicas = layout.bucket_leaves(bucket), layout.replicas
        in_fp32 = wire_lib.reduces_in_fp32(bucket.dtypes)
        dtype = wire_lib.sections_dtype(bucket.dtypes)
        sections = shard_lib.to_sections(local, specs, replicas, dtype)
        if replicas == 1:
            return collectives.Pending(None, sections.to(grad))
        if in_fp32:  # each replica's part rounded to the wire once, summed in fp32
            comm = bucket.dtypes.comm
            pending = wire_lib.start_reduce_scatter(
                sections,
                group,
                axis="replicate",
                dtype=comm,
                layout=wire_lib.blocks_of(layout, bucket) if comm in wire_lib.EIGHT_BIT else None,
            )
        else:
            pending = reduction.start_reduce_scatter(sections, group, axis="replicate")
        return collectives.Pending.then(pending, lambda shard: shard.to(grad))
    if torch.distributed.get_world_size(group) == 1:
        return collectives.Pending(None, local)
    if wire_lib.reduces_in_fp32(bucket.dtypes):
        return collectives.Pending(None, wire_lib.reduce_replicate_axis(layout, bucket, local))
    wire = local.to(bucket.dtypes.comm)
    summed = reduction.all_reduce(wire, group, axis=layout.replicate_axis)
    return collectives.Pending(None, summed.to(grad))


def reduce_step_grads(
    layout: Layout, grads: list[torch.Tensor | None], *, shard_reduced: bool
) -> list[torch.Tensor]:
    """A step's summed microbatch gradients -> this rank's shards of their global mean.

    Args:
      layout: the state's layout.
      grads: per bucket, the microbatches' sum, in the inner layout (:attr:`Layout.inner`,
        the layout itself but under HFSDP): this rank's shard already reduced over "shard"
        (``shard_reduced``, ZeRO-2/3) or the unreduced rank sections (ZeRO-0/1); None where
        no gradient reached the bucket (it counts as zeros).
      shard_reduced: whether the shard-axis reduction already ran.

    Returns:
      Per bucket, this rank's master shard of the mean in main-grads dtype (summed over
      "replicate", or reduce-scattered over it under HFSDP: every bucket's reduce-scatter is
      started before the first is waited for).
    """
    inner = layout.inner
    pending = []
    for bucket, part, g in zip(layout.buckets, inner.buckets, grads, strict=True):
        if g is None:
            numel = part.numel * (1 if shard_reduced else inner.shard_size)
            g = torch.zeros(numel, dtype=part.dtypes.grad, device=layout.device)
        if not shard_reduced:
            g = reduce_shard_axis(inner, part, g)
        pending.append(start_reduce_replicate_axis(layout, bucket, g))
    return [p.wait() for p in pending]


def reduce_scatter_grads(
    grads: dict[str, torch.Tensor],
    mesh: DeviceMesh,
    policy: MixedPrecisionPolicy,
    /,
    *,
    strategy: str | Strategy = "optim_grads_params",
) -> dict[str, torch.Tensor]:
    """Full local gradients -> this rank's shard of their data-parallel mean.

    Args:
      grads: ``{name: full gradient}`` of this rank (its own microbatch), in the compute dtype.
      mesh: the ("replicate", "shard") mesh.
      policy: decides the wire dtype and the returned (main grads) dtype.
      strategy: where the result is sharded; ``no_shard`` returns full tensors.

    Returns:
      ``{name: reduced shard}`` (rows as ``fs.shard`` places them) in ``main_grads_dtype``.
    """
    layout = build_layout(
        {n: (tuple(g.shape), g.dtype) for n, g in grads.items()},
        model=None,
        mesh=mesh,
        policy=policy,
        strategy=strategy,
    )
    out = {}
    for bucket in layout.buckets:
        specs = layout.bucket_leaves(bucket)
        sections = shard_lib.to_rank_sections(
            [grads[s.name] for s in specs],
            specs,
            layout.shard_size,
            wire_lib.sections_dtype(bucket.dtypes),
        )
        local = reduce_replicate_axis(layout, bucket, reduce_shard_axis(layout, bucket, sections))
        out.update({s.name: shard_lib.local_view(local, s, layout.shard_rank) for s in specs})
    return {n: out[n] for n in grads}


def global_norm(layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of the averaged gradient over all ranks (0-d fp64), by the layout's reduction
    (:meth:`funcshard.reduction.Reduction.global_norm`); padding holds zeros and adds nothing."""
    return reduction_of(layout).global_norm(layout, grads)
