"""ZeRO-3 under ``fs.Pipeline(regather=True)``: a stage's parameters gathered per microbatch
in forward and again in backward, never held between.

:class:`Regather` gives each parameter of this rank's stages a leaf of its full shape that
holds no values (zeros expanded from one element; torch's schedule accumulates ``.grad``
into it as into the once-a-step leaves). A stage's forward (:meth:`Regather.call`) gathers
each bucket it touches (:class:`Gathered`: the all-gather in forward, the gradient passed
through to the leaves in backward) and runs under ``saved_tensors_hooks`` that save, in
place of a tensor living in a gathered buffer, where it lives; backward gathers the bucket
again on the first unpack and keeps it until the stage's backward of that microbatch ends
(:meth:`Regather.release`, called by the stage after each backward and weight backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.step.units.gather import Gatherer

__all__ = ["Regather", "Gathered"]


def _storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` lives in, while that storage is alive: the same for every view of
    it, on any device (the meta device included, where every data pointer is 0: a plan runs
    :class:`Regather` there)."""
    return t.untyped_storage()._cdata


class _Saved(NamedTuple):
    """Where a saved tensor lives in a bucket's full buffer."""

    bucket: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class Gathered(torch.autograd.Function):
    """The bucket's parameters (``leaves``) as views of its gathered full buffer; their
    gradients pass through to the leaves."""

    @staticmethod
    def forward(ctx: Any, regather: Regather, bucket: int, *leaves: torch.Tensor) -> Any:
        full = regather.gather(bucket)
        return tuple(regather.views(bucket, full))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *grads)


class Regather:
    """This rank's stages' parameters, gathered per use (see the module's docstring).

    Args:
      layout: the inner layout (ZeRO-3).
      master: the masters, per bucket.
      compute: the compute shards, per bucket (None: cast from the master).
    """

    def __init__(
        self,
        layout: Layout,
        master: Sequence[torch.Tensor],
        compute: Sequence[torch.Tensor | None],
    ) -> None:
        self.layout = layout
        self.shards = [
            c if c is not None else m.to(layout.device, b.dtypes.compute)
            for b, m, c in zip(layout.buckets, master, compute, strict=True)
        ]
        self.bucket_of: dict[str, int] = {}
        self.leaves: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(layout.buckets):
            for spec in layout.bucket_leaves(bucket):
                self.bucket_of[spec.name] = index
                zero = torch.zeros((), dtype=bucket.dtypes.compute, device=layout.device)
                self.leaves[spec.name] = zero.expand(spec.shape).requires_grad_()
        # a gathered buffer's storage -> its bucket, while the forward runs
        self._gathered_now: dict[int, int] = {}
        self.saved: set[int] = set()  # the buckets the running forward saved for backward
        self._again: dict[int, torch.Tensor] = {}  # bucket -> its buffer gathered in backward

    def gather(self, bucket: int) -> torch.Tensor:
        """The bucket's full compute buffer, all-gathered now."""
        gatherer = Gatherer(self.layout, self.shards, replicated=False)
        full = gatherer.full(bucket)
        gatherer.close()
        return full

    def views(self, bucket: int, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter of ``bucket`` inside its full buffer ``full``."""
        S = self.layout.over(self.layout.buckets[bucket]).shard_size
        self._gathered_now[_storage_key(full)] = bucket
        return [
            shard_lib.full_view(full, spec, S)
            for spec in self.layout.bucket_leaves(self.layout.buckets[bucket])
        ]

    def call(self, names: Sequence[str], run: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
        """``run(params)`` with ``names``'s parameters gathered, saving for backward where a
        gathered tensor lives instead of the tensor."""
        buckets = sorted({self.bucket_of[n] for n in names})
        self.saved = set()
        params: dict[str, torch.Tensor] = {}
        for b in buckets:
            specs = self.layout.bucket_leaves(self.layout.buckets[b])
            views = Gathered.apply(self, b, *[self.leaves[s.name] for s in specs])
            params.update({s.name: v for s, v in zip(specs, views, strict=True)})
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return run({n: params[n] for n in names})
        finally:
            self._gathered_now.clear()  # the forward's buffers are freed with their last view

    def _pack(self, t: torch.Tensor) -> Any:
        bucket = self._gathered_now.get(_storage_key(t))
        if bucket is None:
            return t
        self.saved.add(bucket)
        return _Saved(bucket, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        full = self._again.get(saved.bucket)
        if full is None:
            full = self._again[saved.bucket] = self.gather(saved.bucket)
        return full.as_strided(saved.shape, saved.stride, saved.offset)

    def gather_rest(self, buckets: Sequence[int]) -> None:
        """After a backward that raised midway: gathers again, last bucket first (the order
        a stage using its buckets in order unpacks them), each of ``buckets`` (those its
        forward saved from) its backward did not reach, as its data-parallel peers'
        backward does."""
        for b in sorted(buckets, reverse=True):
            if b not in self._again:
                self._again[b] = self.gather(b)

    def release(self) -> None:
        """Frees the buffers gathered again for a backward (the stage's backward of one
        microbatch, or its weight backward, is over)."""
        self._again.clear()
