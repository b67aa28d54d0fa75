"""How a step sums: one :class:`Reduction` per summation rule, behind one protocol.

A step sums three things across microbatches and ranks: the gradients (microbatches, then
the "shard" axis, then "replicate"), the squares of the norm, and the losses. A reduction
fixes the order of those sums:

* :data:`RING`: eager ring collectives, microbatches added into one accumulator in arrival
  order (the default; each microbatch is reduce-scattered as backward ends with it).
* :data:`TREE`: the layout-independent pairwise tree of :mod:`funcshard.determinism`
  (``deterministic=True``): a rank's microbatches are summed in a tree before any rank's
  contribution, so with several microbatches the shard-axis reduction runs once per step.

Both move the same bytes per collective. A new summation rule is one more class with these
methods; ``train_step`` does not change. A low-precision wire summed in fp32 is not one: its
format (8-bit blocks follow a bucket's rows) is a bucket's, so :mod:`funcshard.reduce` hands
such buckets to :mod:`funcshard.wire`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from funcshard import collectives, determinism
from funcshard import mesh as mesh_lib

if TYPE_CHECKING:
    from funcshard.layout import Layout
    from funcshard.reduce import ReplicateAxis

__all__ = [
    "Reduction",
    "MicrobatchSum",
    "Sink",
    "Fold",
    "Tree",
    "RingReduction",
    "TreeReduction",
    "RING",
    "TREE",
    "reduction_of",
]

Grads = list[torch.Tensor | None]


@dataclasses.dataclass(frozen=True, slots=True)
class Sink:
    """Where one microbatch's gradients go (what a gradient producer is told).

    Attributes:
      acc: per bucket, the buffers to add into (arrival order); None: start new ones.
      local: keep the unreduced rank sections (no reduce-scatter in backward).
      complete: the earlier microbatches' tree, which this (last) microbatch completes bucket
        by bucket and then reduces, overlapped with the rest of backward.
      replicate: given to the step's last microbatch only: the step's replicate-axis
        reductions, told of each bucket whose sum over microbatches and "shard" is final, so
        that they overlap the rest of backward (those not issued by then follow it).
    """

    acc: Grads | None = None
    local: bool = False
    complete: determinism.PairwiseSum | None = None
    replicate: ReplicateAxis | None = None


class MicrobatchSum(Protocol):
    """The running sum of one step's microbatch gradients."""

    def sink(
        self, *, last: bool, in_backward: bool, replicate: ReplicateAxis | None = None
    ) -> Sink:
        """Where the next microbatch goes; ``in_backward``: its producer reduces per bucket
        as backward goes (ZeRO-2/3) rather than handing back unreduced sections; then the
        ``last`` microbatch's sink carries ``replicate``, for backward to issue from."""
        ...

    def add(self, grads: Grads) -> None:
        """Takes what the producer returned for the microbatch ``sink`` was asked for."""
        ...

    def result(self) -> Grads:
        """The sum over the step's microbatches (None: a bucket no gradient reached)."""
        ...


class Fold:
    """Microbatches added into one accumulator in arrival order (a left fold)."""

    def __init__(self) -> None:
        self._acc: Grads | None = None

    def sink(
        self, *, last: bool, in_backward: bool, replicate: ReplicateAxis | None = None
    ) -> Sink:
        return Sink(acc=self._acc, replicate=replicate if last and in_backward else None)

    def add(self, grads: Grads) -> None:
        self._acc = grads  # the producer added into the sink's buffers (or made them)

    def result(self) -> Grads:
        assert self._acc is not None, "Fold.result before any microbatch"
        return self._acc


class Tree:
    """Microbatches summed by the adjacent pairwise tree (:class:`determinism.PairwiseSum`).

    Every microbatch keeps its unreduced rank sections; under ZeRO-2/3 the last one completes
    the tree bucket by bucket as backward goes and hands back the reduced shards.
    """

    def __init__(self) -> None:
        self._tree = determinism.PairwiseSum()
        self._done: Grads | None = None
        self._completing = False

    def sink(
        self, *, last: bool, in_backward: bool, replicate: ReplicateAxis | None = None
    ) -> Sink:
        if not in_backward:
            return Sink()
        if last:
            self._completing = True
            return Sink(complete=self._tree, replicate=replicate)
        return Sink(local=True)

    def add(self, grads: Grads) -> None:
        if self._completing:
            self._done = grads
        else:
            self._tree.add(grads)

    def result(self) -> Grads:
        return self._done if self._completing else self._tree.result()


class Reduction(Protocol):
    """One summation rule for a step's gradients, norm and loss."""

    sums_uses_first: bool
    """A bucket that enters the graph twice must have its uses summed before the ranks'
    contributions (as autograd sums them under ZeRO-0/1)."""

    def check_microbatches(self, dp_size: int, microbatches: int) -> None:
        """Raises ValueError where the rule cannot sum this many gradient chunks."""
        ...

    def reduces_each_microbatch(self, microbatches: int) -> bool:
        """Whether ZeRO-2/3 reduce-scatter every microbatch in its backward (else once)."""
        ...

    def microbatch_sum(self, microbatches: int) -> MicrobatchSum: ...

    def start_reduce_scatter(
        self, wire: torch.Tensor, group: dist.ProcessGroup, *, axis: str
    ) -> collectives.Pending:
        """The group's sum of 1-D ``wire``, this rank's contiguous 1/size of it (``axis``:
        the mesh axis of ``group``, for the accounting)."""
        ...

    def start_all_reduce(
        self, wire: torch.Tensor, group: dist.ProcessGroup, *, axis: str
    ) -> collectives.Pending:
        """The group's sum of ``wire``; ``wire`` is read before this returns (it may change
        while the sum is in flight). Every rank waits for a group's sums in the same order
        (a sum may issue another collective at ``wait()``)."""
        ...

    def global_norm(self, layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the reduced gradient over every shard (0-d, fp64)."""
        ...

    def mean_loss(self, layout: Layout, losses: list[torch.Tensor]) -> float:
        """The mean of every rank's microbatch losses."""
        ...


class RingReduction:
    """The default: ring collectives, arrival-order accumulation, per-microbatch reduction."""

    sums_uses_first = False

    def check_microbatches(self, dp_size: int, microbatches: int) -> None:
        del dp_size, microbatches  # any count sums

    def reduces_each_microbatch(self, microbatches: int) -> bool:
        del microbatches
        return True

    def microbatch_sum(self, microbatches: int) -> MicrobatchSum:
        del microbatches
        return Fold()

    def start_reduce_scatter(
        self, wire: torch.Tensor, group: dist.ProcessGroup, *, axis: str
    ) -> collectives.Pending:
        if wire.device.type == "cpu":
            # gloo (the CPU backend) reduce-scatters by an all-reduce, twice a ring
            # reduce-scatter's bytes (measured on a veth link: experiments/bench_nodes.py);
            # an all-to-all and a local sum move exactly the ring's
            return collectives.exchange_blocks(wire, group, _sum_blocks, axis=axis)
        return collectives.reduce_scatter(wire, group, axis=axis, async_op=True)

    def start_all_reduce(
        self, wire: torch.Tensor, group: dist.ProcessGroup, *, axis: str
    ) -> collectives.Pending:
        return collectives.all_reduce(wire, group, axis=axis, async_op=True)

    def global_norm(self, layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
        """One fp32 pass per bucket; only when a bucket's fp32 norm overflows (finite
        gradients of norm above ~1e19) or is not finite are the norms redone in fp64, so that
        a large but finite gradient is never mistaken for an overflow. Padding holds zeros."""
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        norms = torch.stack(
            [
                n.to(layout.device, torch.float64)
                for gs in by_device.values()
                for n in torch._foreach_norm(gs, 2, dtype=torch.float32)
            ]
        )
        if not bool(torch.isfinite(norms).all()):
            norms = torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float64).to(layout.device) for g in grads]
            )
        sq = norms.square().sum().to(layout.device)
        if layout.shard_size > 1:
            sq = collectives.all_reduce(
                sq, layout.shard_group, axis=layout.shard_axis, kind="metrics"
            )
        return sq.sqrt()

    def mean_loss(self, layout: Layout, losses: list[torch.Tensor]) -> float:
        total = torch.stack([loss.double() for loss in losses]).sum()
        world = mesh_lib.world_group(layout.mesh)
        total = collectives.all_reduce(total, world, axis="world", kind="metrics")
        return float(total) / (len(losses) * layout.dp_size)


def _sum_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The received blocks' sum in ``torch.sum``'s order (not the deterministic tree's)."""
    return blocks.sum(0)


class TreeReduction:
    """``deterministic=True``: the pairwise tree over gradient chunks (see
    :mod:`funcshard.determinism`); bitwise the same on every layout with the same G."""

    sums_uses_first = True

    def check_microbatches(self, dp_size: int, microbatches: int) -> None:
        determinism.check_microbatches(dp_size, microbatches)

    def reduces_each_microbatch(self, microbatches: int) -> bool:
        return microbatches == 1

    def microbatch_sum(self, microbatches: int) -> MicrobatchSum:
        return Fold() if microbatches == 1 else Tree()

    def start_reduce_scatter(
        self, wire: torch.Tensor, group: dist.ProcessGroup, *, axis: str
    ) -> collectives.Pending:
        return determinism.start_reduce_scatter(wire, group, axis=axis)

    def start_all_reduce(
        self, wire: torch.Tensor, group: dist.ProcessGroup, *, axis: str
    ) -> collectives.Pending:
        return determinism.start_all_reduce(wire, group, axis=axis)

    def global_norm(self, layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
        return determinism.global_norm(layout, grads)

    def mean_loss(self, layout: Layout, losses: list[torch.Tensor]) -> float:
        return determinism.mean_loss(layout, losses, mesh_lib.world_group(layout.mesh))


RING = RingReduction()
TREE = TreeReduction()


def reduction_of(layout: Layout) -> Reduction:
    """The summation rule a layout asks for."""
    return TREE if layout.deterministic else RING
