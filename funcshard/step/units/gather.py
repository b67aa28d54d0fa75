"""The gather and its transpose: a bucket's full params in forward, the reduce-scatter of
their gradient in backward (:class:`GatherFn`), and where full buffers come from
(:class:`Gatherer`: all-gathers with prefetch under ZeRO-3, the replicated buffers under
ZeRO-2)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from funcshard.comm import params as params_lib
from funcshard.distributed import ops
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.step.units.phase import Phase

__all__ = ["GatherFn", "Gatherer"]


class GatherFn(torch.autograd.Function):
    """Forward: a bucket's full params (views of ``source.graph_full``). Backward: the
    reduce-scatter of their gradient, and the post-backward phase of ``source``."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, source: Any, bucket: int):  # noqa: ARG004
        ctx.source, ctx.bucket = source, bucket
        run = source.run
        if run.phase is Phase.FORWARD:  # not a recomputation in backward
            run.reducer.entries[bucket] += 1
        full = source.graph_full(bucket)
        b = run.layout.buckets[bucket]
        specs, S = run.layout.bucket_leaves(b), run.layout.over(b).shard_size
        return tuple(shard_lib.full_view(full, s, S) for s in specs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        out = ctx.source.run.reducer.reduce(ctx.bucket, grads)
        ctx.source.post_backward(ctx.bucket)
        return out, None, None


class Gatherer:
    """Full buffers of buckets: all-gathered under ZeRO-3 from ``buffers``, the compute
    shards (packed on the param wire under HFSDP: :func:`funcshard.comm.params.packs_shard`), at
    most one gather in flight per bucket (a prefetch); the replicated full buffer itself
    under ZeRO-2."""

    def __init__(
        self,
        layout: Layout,
        buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
        replicated: bool,
    ) -> None:
        self.layout = layout
        self.buffers = buffers
        self.replicated = replicated
        self._pending: dict[int, ops.Pending] = {}

    def prefetch(self, buckets: Iterator[int] | list[int]) -> None:
        """Starts gathering ``buckets`` (those not in flight already)."""
        if self.replicated:
            return
        for b in buckets:
            if b not in self._pending:
                self._pending[b] = params_lib.all_gather_params(
                    self.layout, self.layout.buckets[b], self.buffers[b]
                )

    def full(self, bucket: int) -> torch.Tensor:
        """The bucket's full buffer, from a prefetch if one is in flight."""
        if self.replicated:
            return self.buffers[bucket].detach()  # outputs alias it, not autograd views of it
        self.prefetch([bucket])
        full = self._pending.pop(bucket).wait()
        # with one shard the "full" buffer is the shard itself
        if self.layout.over(self.layout.buckets[bucket]).shard_size > 1:
            ops.track_gathered(full)
        return full

    def drop_prefetches(self) -> None:
        """Forgets gathers started for a unit that did not run (once they are done: every
        rank started them)."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.discard()

    def close(self) -> None:
        """Forgets the prefetches and the shards (the run is over)."""
        self.drop_prefetches()
        self.buffers = ()
