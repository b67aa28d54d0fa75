"""Gradient reduction: reduce-scatter over "shard", then all-reduce over "replicate" (HSDP)
or reduce-scatter over it into the masters (HFSDP), each on the bucket's wire
(:func:`funcshard.comm.wires.wire_for`).

Under ZeRO-2/3 the replicate-axis reduction of a bucket starts in the step's last backward,
as soon as the bucket's sum is final (:class:`ReplicateAxis`), so the slow link between nodes
carries it while backward computes the earlier units; :func:`reduce_step_grads` waits for
those and reduces the rest.

The reduced result REPLACES a gradient; it is never added to the local unreduced one (the
``g_i + sum(g)`` bug of seed 003 cannot be written with these functions: the only input of the
accumulator is a reduce-scatter output). Gradients reach the wire in ``grad_comm_dtype``,
pre-divided by the data-parallel size so the sum is the mean, and come back in
``main_grads_dtype``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from funcshard.comm.codec import EIGHT_BIT
from funcshard.comm.wires import wire_for
from funcshard.distributed.ops import Axis, Pending
from funcshard.layout import sharding as shard_lib
from funcshard.layout.build import build_layout
from funcshard.layout.layout import Bucket, Layout
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.strategy import Strategy

__all__ = [
    "reduce_scatter_grads",
    "reduce_shard_axis",
    "start_reduce_shard_axis",
    "reduce_replicate_axis",
    "start_reduce_replicate_axis",
    "ReplicateAxis",
    "Across",
    "reduce_step_grads",
]


class Across(Protocol):
    """The replica groups of a fault-tolerant run (:class:`funcshard.fault.replicas.Replicas`): the
    mean of a tensor over the groups of the step's quorum."""

    def start_all_reduce(self, tensor: torch.Tensor) -> Pending:
        """The groups' mean of ``tensor`` (read before this returns)."""
        ...


def reduce_shard_axis(layout: Layout, bucket: Bucket, sections: torch.Tensor) -> torch.Tensor:
    """Rank-section gradients -> this rank's shard of their mean over "shard".

    ``sections`` is consumed (it may be scaled in place). The divisor is the whole
    data-parallel size; ``reduce_replicate_axis`` only sums.
    """
    return start_reduce_shard_axis(layout, bucket, sections).wait().to(bucket.dtypes.grad)


def start_reduce_shard_axis(layout: Layout, bucket: Bucket, sections: torch.Tensor) -> Pending:
    """``reduce_shard_axis`` without waiting and without the final cast: ``wait()`` gives this
    rank's shard of the mean as the bucket's wire (:func:`funcshard.comm.wires.wire_for`) sums
    it: in ``grad_comm_dtype``, or in fp32 on a narrow wire."""
    layout = layout.over(bucket)  # an expert bucket: over the ranks of its expert index
    wire = wire_for(layout, bucket)
    x = sections.to(wire.scale_dtype)
    if layout.dp_size > 1:  # a division by one would be a pass over the gradient for nothing
        x.div_(layout.dp_size)
    group = layout.shard_group if layout.shard_size > 1 else None
    return wire.start_reduce_scatter(x, group, axis=Axis.SHARD)


def reduce_replicate_axis(layout: Layout, bucket: Bucket, local: torch.Tensor) -> torch.Tensor:
    """Sums a gradient shard over the replicas (the whole world under ``no_shard``).

    HFSDP: ``local`` is the inner shard (:attr:`Layout.inner`), reduce-scattered over
    "replicate" into this rank's master shard.
    """
    return start_reduce_replicate_axis(layout, bucket, local).wait()


def start_reduce_replicate_axis(
    layout: Layout, bucket: Bucket, local: torch.Tensor, across: Across | None = None
) -> Pending:
    """``reduce_replicate_axis`` without waiting. ``local`` is read before this returns (it
    may change while the reduction is in flight); every rank waits for the replicate group's
    reductions in the same order (an all-reduce may all-gather at ``wait()``).

    ``across`` (a fault-tolerant run): the sum over the group's own "replicate" axis is then
    averaged over the replica groups, on the bucket's ``grad_comm_dtype`` (main grads for an
    8-bit wire); issued now when the group has no "replicate" axis of its own, else at
    ``wait()``."""
    pending = _start_replicate(layout, bucket, local)
    if across is None:
        return pending
    grad, comm = bucket.dtypes.grad, bucket.dtypes.comm
    wire = grad if comm in EIGHT_BIT else comm
    if not pending.in_flight:  # nothing in flight inside the group: on the wire now
        mean = across.start_all_reduce(pending.wait().to(wire))
        return Pending.then(mean, lambda out: out.to(grad))
    return Pending.then(pending, lambda out: across.start_all_reduce(out.to(wire)).wait().to(grad))


def _start_replicate(layout: Layout, bucket: Bucket, local: torch.Tensor) -> Pending:
    layout = layout.over(bucket)
    group, grad = layout.replicate_group, bucket.dtypes.grad
    wire = wire_for(layout, bucket)
    if layout.hierarchical:
        specs, replicas = layout.bucket_leaves(bucket), layout.replicas
        sections = shard_lib.to_sections(local, specs, replicas, wire.sections_dtype)
        if replicas == 1:
            return Pending(None, sections.to(grad))
        pending = wire.start_reduce_scatter(sections, group, axis=Axis.REPLICATE)
    elif torch.distributed.get_world_size(group) == 1:
        return Pending(None, local)
    else:
        pending = wire.start_all_reduce(local, group, axis=layout.replicate_axis)
    return Pending.then(pending, lambda out: out.to(grad))


class ReplicateAxis:
    """One step's replicate-axis reductions: issued in one fixed order, the first ones during
    the last microbatch's backward, the rest after it.

    The order is descending bucket index, the order in which backward finishes the buckets of
    a model whose units run in the order of their parameters (the last unit first, the root
    last). The step's last microbatch (ZeRO-2/3, :class:`funcshard.step.units.reducer.Reducer`)
    calls :meth:`start` for a bucket once every use forward counted has been reduced over
    "shard" into the accumulator: its sum over microbatches and "shard" is final. A final
    bucket is issued (:func:`start_reduce_replicate_axis`) as soon as every bucket before it
    in the order is, and goes on the wire while backward computes the earlier units;
    :func:`reduce_step_grads` issues the rest, in the same order, and waits for all. The data
    of each reduction is what it would be after backward: the same bits, bytes and calls.

    So every rank issues the replicate group's collectives in the same order whatever its
    backward does: a bucket that finishes out of order, or that no gradient reaches on one
    rank (a branch its data skipped), only holds the ones after it back until it is final or
    backward is over. Nothing else runs on that group during backward. The one exception to
    the order is a bucket :meth:`late` names (a recomputation gave it a use forward did not
    count, on every rank alike): it goes after backward, and does not hold the others back.
    """

    def __init__(self, layout: Layout, across: Across | None = None) -> None:
        self.layout = layout
        self.across = across
        self.order = tuple(reversed(range(len(layout.buckets))))
        self._next = 0  # the position in ``order`` of the next bucket to issue
        self._final: dict[int, torch.Tensor] = {}  # final, waiting for their turn
        self._issued: dict[int, Pending] = {}
        self._late: set[int] = set()
        self._dropped: list[Pending] = []
        self._closed = False
        # more than one replica (else there is nothing to put on the wire early)
        self.on_wire = across is not None or (
            torch.distributed.get_world_size(layout.replicate_group) > 1
        )

    def start(self, bucket: int, shard: torch.Tensor) -> None:
        """``shard``, ``bucket``'s inner shard, is final: issues its reduction once every
        bucket before it in the order is issued (``shard`` is read then)."""
        if self._closed or not self.on_wire or bucket in self._late:
            return
        self._final[bucket] = shard
        self._advance()

    def _advance(self) -> None:
        """Issues the final buckets whose turn it is (a late one's turn is after backward)."""
        while self._next < len(self.order):
            index = self.order[self._next]
            if index in self._final:
                b = self.layout.buckets[index]
                shard = self._final.pop(index)
                self._issued[index] = start_reduce_replicate_axis(
                    self.layout, b, shard, self.across
                )
            elif index not in self._late:
                return
            self._next += 1

    def late(self, bucket: int) -> None:
        """A use of ``bucket`` beyond those forward counted (a recomputation in backward) is
        on its way: its sum was not final. It is issued after backward, on its whole sum; if
        it was issued already, that reduction is dropped (one reduction of it more on the
        wire)."""
        self._late.add(bucket)
        self._final.pop(bucket, None)
        pending = self._issued.pop(bucket, None)
        if pending is not None:
            self._dropped.append(pending)
        if not self._closed:
            self._advance()

    def abandon(self) -> None:
        """Backward failed: nothing more is issued, and what was is waited for (no collective
        is left in flight) and dropped."""
        self._closed = True
        for pending in [*self._dropped, *self._issued.values()]:
            pending.discard()
        self._dropped.clear()
        self._issued.clear()
        self._final.clear()

    def rest(self) -> list[int]:
        """After backward: the buckets still to issue, in their order; nothing is issued by
        :meth:`start` from now on."""
        self._closed = True
        for pending in self._dropped:
            pending.discard()
        self._dropped.clear()
        self._final.clear()
        return [b for b in self.order if b not in self._issued]

    def issue(self, bucket: int, shard: torch.Tensor) -> None:
        """Issues ``bucket``'s reduction on ``shard`` (after backward, in :meth:`rest`'s
        order)."""
        b = self.layout.buckets[bucket]
        self._issued[bucket] = start_reduce_replicate_axis(self.layout, b, shard, self.across)

    def wait(self) -> list[torch.Tensor]:
        """Every bucket's reduced master shard, waited for in bucket order."""
        return [self._issued.pop(b).wait() for b in range(len(self.layout.buckets))]


def reduce_step_grads(
    layout: Layout,
    grads: list[torch.Tensor | None],
    *,
    shard_reduced: bool,
    replicate: ReplicateAxis | None = None,
) -> list[torch.Tensor]:
    """A step's summed microbatch gradients -> this rank's shards of their global mean.

    Args:
      layout: the state's layout.
      grads: per bucket, the microbatches' sum, in the inner layout (:attr:`Layout.inner`,
        the layout itself but under HFSDP): this rank's shard already reduced over "shard"
        (``shard_reduced``, ZeRO-2/3) or the unreduced rank sections (ZeRO-0/1); None where
        no gradient reached the bucket (it counts as zeros).
      shard_reduced: whether the shard-axis reduction already ran.
      replicate: the step's replicate-axis reductions, some of which backward may have
        issued (their buckets' ``grads`` are not read again); None: a new one.

    Returns:
      Per bucket, this rank's master shard of the mean in main-grads dtype (summed over
      "replicate", or reduce-scattered over it under HFSDP): every bucket's reduction is
      issued before the first is waited for.
    """
    inner = layout.inner
    replicate = replicate if replicate is not None else ReplicateAxis(layout)
    for index in replicate.rest():
        part, g = inner.buckets[index], grads[index]
        if g is None:
            numel = part.numel * (1 if shard_reduced else inner.over(part).shard_size)
            g = torch.zeros(numel, dtype=part.dtypes.grad, device=layout.device)
        if not shard_reduced:
            g = reduce_shard_axis(inner, part, g)
        replicate.issue(index, g)
    return replicate.wait()


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
            wire_for(layout, bucket).sections_dtype,
        )
        local = reduce_replicate_axis(layout, bucket, reduce_shard_axis(layout, bucket, sections))
        out.update({s.name: shard_lib.local_view(local, s, layout.shard_rank) for s in specs})
    return {n: out[n] for n in grads}
