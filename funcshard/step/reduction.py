"""How a step sums: one :class:`Reduction` per summation rule, behind one protocol.

A step sums three things across microbatches and ranks: the gradients (microbatches, then
the "shard" axis, then "replicate"), the squares of the norm, and the losses. A reduction
fixes the order of those sums:

* :data:`RING`: eager ring collectives, microbatches added into one accumulator in arrival
  order (the default; each microbatch is reduce-scattered as backward ends with it).
* :data:`TREE`: the layout-independent pairwise tree of :mod:`funcshard.layout.determinism`
  (``deterministic=True``): a rank's microbatches are summed in a tree before any rank's
  contribution, so with several microbatches the shard-axis reduction runs once per step.

A new summation rule is one more class with these methods; ``train_step`` does not change.
How a bucket's gradient is summed over a group of ranks (ring, tree, or a narrow wire summed
in fp32) is its wire's (:func:`funcshard.comm.wires.wire_for`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed import ops
from funcshard.distributed.ops import Axis
from funcshard.layout import determinism

if TYPE_CHECKING:
    from funcshard.layout.layout import Layout

__all__ = [
    "Reduction",
    "MicrobatchSum",
    "Sink",
    "AddInto",
    "KeepSections",
    "CompleteTree",
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
class AddInto:
    """Add the microbatch's gradients into ``acc`` (per bucket, arrival order; None: start new
    buffers), reduced over "shard" as backward goes under ZeRO-2/3."""

    acc: Grads | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class KeepSections:
    """Keep the unreduced rank sections (no reduce-scatter in backward)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CompleteTree:
    """The last microbatch of a tree sum completes ``tree``, the earlier microbatches', bucket
    by bucket and then reduces it, overlapped with the rest of backward."""

    tree: determinism.PairwiseSum


# Where one microbatch's gradients go (what a gradient producer is told).
Sink = AddInto | KeepSections | CompleteTree


class MicrobatchSum(Protocol):
    """The running sum of one step's microbatch gradients."""

    def sink(self, *, last: bool, in_backward: bool) -> Sink:
        """Where the next microbatch goes; ``in_backward``: its producer reduces per bucket
        as backward goes (ZeRO-2/3) rather than handing back unreduced sections."""
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

    def sink(self, *, last: bool, in_backward: bool) -> Sink:
        del last, in_backward
        return AddInto(self._acc)

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

    def sink(self, *, last: bool, in_backward: bool) -> Sink:
        if not in_backward:
            return AddInto()
        if last:
            self._completing = True
            return CompleteTree(self._tree)
        return KeepSections()

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

    def global_norm(self, layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the reduced gradient over every shard (0-d, fp64)."""
        ...

    def mean_loss(
        self,
        layout: Layout,
        losses: list[torch.Tensor],
        flag: float | None = None,
        sums: torch.Tensor | None = None,
    ) -> tuple[float, float, torch.Tensor | None]:
        """The mean of every rank's microbatch losses, the sum of every rank's ``flag`` and of
        every rank's ``sums`` (a float64 vector of a size every rank shares: the step's
        ``fs.summed`` shape header), all carried with the losses over the data-parallel world
        (None: none, 0.0 / None back)."""
        ...

    def sum_over_world(self, layout: Layout, sums: torch.Tensor) -> torch.Tensor:
        """Every rank's ``sums`` (float64, the same size on every rank) summed over the
        data-parallel world: the step's ``fs.summed`` totals."""
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

    def global_norm(self, layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
        """One fp32 pass per bucket; only when a bucket's fp32 norm overflows (finite
        gradients of norm above ~1e19) or is not finite are the norms redone in fp64, so that
        a large but finite gradient is never mistaken for an overflow. Padding holds zeros.
        Tensor parallel: what this rank counts of the full model (:func:`counted`), summed
        over "tensor" too."""
        grads = counted(layout, grads)
        if not grads:
            sq = torch.zeros((), dtype=torch.float64, device=layout.device)
        else:
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
                    [
                        torch.linalg.vector_norm(g, dtype=torch.float64).to(layout.device)
                        for g in grads
                    ]
                )
            sq = norms.square().sum().to(layout.device)
        if layout.shard_size > 1:
            sq = ops.all_reduce(sq, layout.shard_group, axis=layout.shard_axis, kind="metrics")
        return layout.tensor.sum_square(sq).sqrt()

    def mean_loss(
        self,
        layout: Layout,
        losses: list[torch.Tensor],
        flag: float | None = None,
        sums: torch.Tensor | None = None,
    ) -> tuple[float, float, torch.Tensor | None]:
        total = torch.stack([loss.double() for loss in losses]).sum().to(layout.device)
        extra = [] if flag is None else [float(flag)]
        total = torch.cat([total.reshape(1), total.new_tensor(extra)] + _listed(sums))
        world = mesh_lib.world_group(layout.mesh)
        total = ops.all_reduce(total, world, axis=Axis.WORLD, kind="metrics")
        flags = float(total[1]) if flag is not None else 0.0
        summed = total[1 + len(extra) :] if sums is not None else None
        return float(total[0]) / (len(losses) * layout.dp_size), flags, summed

    def sum_over_world(self, layout: Layout, sums: torch.Tensor) -> torch.Tensor:
        world = mesh_lib.world_group(layout.mesh)
        return ops.all_reduce(sums.to(layout.device), world, axis=Axis.WORLD, kind="metrics")


class TreeReduction:
    """``deterministic=True``: the pairwise tree over gradient chunks (see
    :mod:`funcshard.layout.determinism`); bitwise the same on every layout with the same G."""

    sums_uses_first = True

    def check_microbatches(self, dp_size: int, microbatches: int) -> None:
        determinism.check_microbatches(dp_size, microbatches)

    def reduces_each_microbatch(self, microbatches: int) -> bool:
        return microbatches == 1

    def microbatch_sum(self, microbatches: int) -> MicrobatchSum:
        return Fold() if microbatches == 1 else Tree()

    def global_norm(self, layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
        """Each rank's row sums of squares (:func:`funcshard.layout.determinism.row_sums`), one
        all-gather over the shard axis (counted under "metrics"), then every real row summed
        in parameter order (:func:`funcshard.layout.determinism.norm_of_rows`)."""
        sums = determinism.row_sums(layout, grads)
        if sums is not None and layout.shard_size > 1:
            sums = ops.all_gather(sums, layout.shard_group, axis=layout.shard_axis, kind="metrics")
        experts = determinism.row_sums(layout, grads, experts=True)
        if experts is not None:  # over its expert index's shards, then over "expert"
            view = layout.experts_view
            if view.shard_size > 1:
                experts = ops.all_gather(
                    experts, view.shard_group, axis=view.shard_axis, kind="metrics"
                )
            experts = layout.tensor.expert_rows(experts)
        # this rank's part of the full model's square, then the parts in the axis's order
        square = determinism.norm_of_rows(
            layout, sums, counts=layout.tensor.counts, expert_sums=experts
        )
        return determinism.halving_sum(layout.tensor.squares_in_order(square)).sqrt()

    def mean_loss(
        self,
        layout: Layout,
        losses: list[torch.Tensor],
        flag: float | None = None,
        sums: torch.Tensor | None = None,
    ) -> tuple[float, float, torch.Tensor | None]:
        """Every chunk's loss all-gathered over the world, summed by one tree in chunk order
        (``flag`` and ``sums`` travel as more elements per rank, summed apart in rank order)."""
        local = torch.stack([loss.double() for loss in losses]).to(layout.device)
        n, f = local.numel(), int(flag is not None)
        local = torch.cat([local, local.new_tensor([flag] if f else [])] + _listed(sums))
        width = local.numel()
        world = mesh_lib.world_group(layout.mesh)
        if dist.get_world_size(world) > 1:
            local = ops.all_gather(local, world, axis=Axis.WORLD, kind="metrics")
        per_rank = local.view(-1, width)
        flags = float(per_rank[:, n].sum()) if f else 0.0
        summed = per_rank[:, n + f :].sum(0) if sums is not None else None
        chunks = per_rank[:, :n].reshape(-1)
        return float(determinism.halving_sum(chunks)) / chunks.numel(), flags, summed

    def sum_over_world(self, layout: Layout, sums: torch.Tensor) -> torch.Tensor:
        """All-gathered, summed in rank order (the same bits on every layout)."""
        local = sums.to(layout.device)
        world = mesh_lib.world_group(layout.mesh)
        if dist.get_world_size(world) > 1:
            local = ops.all_gather(local, world, axis=Axis.WORLD, kind="metrics")
        return local.view(-1, sums.numel()).sum(0)


def _listed(sums: torch.Tensor | None) -> list[torch.Tensor]:
    return [] if sums is None else [sums]


def counted(layout: Layout, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient shards whose elements this rank counts in a sum over the full model: all
    of them, but on a tensor rank other than 0 only the segments of leaves split over
    "tensor" (a replicated leaf is the same on every tensor rank: counted once)."""
    return layout.tensor.counted_parts(grads, [layout.bucket_leaves(b) for b in layout.buckets])


RING = RingReduction()
TREE = TreeReduction()


def reduction_of(layout: Layout) -> Reduction:
    """The summation rule a layout asks for."""
    return TREE if layout.deterministic else RING
