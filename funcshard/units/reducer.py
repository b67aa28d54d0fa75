"""The backward half of the params: reduce-scatter into the gradient accumulator."""

from __future__ import annotations

import collections

import torch

from funcshard import collectives, determinism
from funcshard import reduce as reduce_lib
from funcshard import sharding as shard_lib
from funcshard.layout import Layout
from funcshard.reduction import reduction_of

__all__ = ["Reducer"]


class Reducer:
    """The backward half of the params: each bucket's gradient, reduced over "shard" and
    accumulated into ``acc`` (this rank's shards, in main-grads dtype) as backward goes.

    A bucket's reduce-scatter starts as soon as backward has its gradient and overlaps the
    rest of backward; at most one is in flight, so about one unit's unreduced gradient waits
    beside the one being computed. The result goes straight into the accumulator, not through
    autograd: the carrier only receives a zero-stride zero, so no second copy of the gradients
    is alive at the end of a microbatch, and a bucket that entered the graph twice is simply
    reduced twice (the reduction is linear). ``backward`` waits for everything it started.

    A deterministic layout must sum a bucket's uses before the ranks' contributions (as
    autograd does for ZeRO-0/1), so when forward took a bucket into the graph more than once
    (``params[name]`` beside its unit) the whole backward keeps unreduced sections and reduces
    each bucket once after it.
    """

    def __init__(
        self,
        layout: Layout,
        acc: list[torch.Tensor | None] | None = None,
        *,
        local: bool = False,
        complete: determinism.PairwiseSum | None = None,
    ) -> None:
        self.layout = layout
        self.local = local  # keep the unreduced rank sections (a deterministic step's subtrees)
        self.acc: list[torch.Tensor | None] = (
            acc if acc is not None else [None] * len(layout.buckets)
        )
        # A deterministic step's last microbatch: once a bucket's every use has given its
        # sections, the earlier microbatches' tree is completed with them and the bucket's
        # reduce-scatter starts, overlapping the rest of backward.
        self.complete = complete
        self._sections: dict[int, torch.Tensor] = {}
        self._arrived: collections.Counter[int] = collections.Counter()
        self._completed: set[int] = set()
        zero = {
            b.dtypes.grad: torch.zeros(1, dtype=b.dtypes.grad, device=layout.device)
            for b in layout.buckets
        }
        self._zeros = [zero[b.dtypes.grad].expand(b.numel) for b in layout.buckets]
        self.carriers = tuple(z.detach().requires_grad_() for z in self._zeros)
        self._in_flight: list[tuple[int, collectives.Pending]] = []
        self.entries: collections.Counter[int] = collections.Counter()  # uses in forward

    def reduce(self, bucket: int, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """Starts reducing a bucket's full gradients; returns the carrier's (dummy) gradient."""
        b = self.layout.buckets[bucket]
        specs = self.layout.bucket_leaves(b)
        S = self.layout.shard_size
        if self.complete is not None and bucket not in self._completed:
            # (a use beyond those counted in forward, e.g. taken inside a recomputation, comes
            # after its bucket's reduction started: it is reduced on its own and added, below)
            mine = self._sections.get(bucket)
            if mine is None:
                self._sections[bucket] = shard_lib.to_rank_sections(
                    list(grads), specs, S, b.dtypes.grad, self.layout.device
                )
            else:  # another use of the bucket, summed in arrival order as autograd would
                shard_lib.add_to_rank_sections(mine, list(grads), specs, S)
            self._arrived[bucket] += 1
            if self._arrived[bucket] >= self.entries[bucket]:
                self._complete(bucket)
            return self._zeros[bucket]
        # With one data-parallel rank the reduction is the identity: a later microbatch (or
        # use) adds its gradient straight into the accumulator, as the unreduced sections do.
        # (With replicas but one shard it is a division by their count, left to the wire.)
        direct = self.local or (self.layout.dp_size == 1 and b.dtypes.comm == b.dtypes.grad)
        if direct and self.acc[bucket] is not None:
            self.finish()  # an earlier use of the bucket lands first
            shard_lib.add_to_rank_sections(self.acc[bucket], list(grads), specs, S)
            return self._zeros[bucket]
        if self.local:
            self.acc[bucket] = shard_lib.to_rank_sections(
                list(grads), specs, S, b.dtypes.grad, self.layout.device
            )
            return self._zeros[bucket]
        self._start(
            bucket,
            shard_lib.to_rank_sections(list(grads), specs, S, b.dtypes.comm, self.layout.device),
        )
        return self._zeros[bucket]

    def _complete(self, bucket: int) -> None:
        """Completes a bucket's microbatch tree and starts reducing it (once per bucket)."""
        if bucket in self._completed:
            return
        self._completed.add(bucket)
        total = self.complete.total(bucket, self._sections.pop(bucket, None))
        if total is not None:
            self._start(bucket, total)

    def _start(self, bucket: int, sections: torch.Tensor) -> None:
        """Waits for the reduction in flight, then starts reducing ``sections``."""
        self.finish()
        self._in_flight.append(
            (
                bucket,
                reduce_lib.start_reduce_shard_axis(
                    self.layout, self.layout.buckets[bucket], sections
                ),
            )
        )

    def finish(self) -> None:
        """Waits for the reductions started so far and adds them to the accumulator."""
        for bucket, pending in self._in_flight:
            shard = pending.wait()
            if self.acc[bucket] is None:
                self.acc[bucket] = shard.to(self.layout.buckets[bucket].dtypes.grad)
            else:
                self.acc[bucket].add_(shard)
        self._in_flight.clear()

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        """Backpropagates ``loss``; returns the accumulator (None: no gradient reached yet)."""
        deferred = (
            reduction_of(self.layout).sums_uses_first
            and not self.local
            and self.complete is None
            and any(n > 1 for n in self.entries.values())
        )
        if deferred:
            reduced, self.acc, self.local = self.acc, [None] * len(self.acc), True
        try:
            torch.autograd.grad(loss, self.carriers, allow_unused=True)
            if self.complete is not None:  # buckets this microbatch did not (fully) reach
                for bucket in range(len(self.layout.buckets)):
                    self._complete(bucket)
        finally:
            self.finish()
        if deferred:
            sections, self.acc, self.local = self.acc, reduced, False
            for bucket, value in enumerate(sections):
                if value is not None:
                    self._start(bucket, value)
            self.finish()
        return self.acc
