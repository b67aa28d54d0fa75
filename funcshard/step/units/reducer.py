"""The backward half of the params: each bucket's gradient, reduced over "shard" and added to
the accumulator (this rank's shards, in main-grads dtype) as backward goes.

:class:`Reducer` is what the gather's transpose calls; where a bucket's gradient goes is one
of three paths, fixed when backward starts:

* :class:`Reducing`: a bucket's reduce-scatter starts as soon as backward has its gradient and
  overlaps the rest of backward; at most one is in flight, so about one unit's unreduced
  gradient waits beside the one being computed. The result goes straight into the
  accumulator, not through autograd (the carrier only receives a zero-stride zero), so no
  second copy of the gradients is alive at the end of a microbatch, and a bucket that entered
  the graph twice is simply reduced twice (the reduction is linear).
* :class:`Sections`: the unreduced rank sections are kept (a deterministic step's microbatch,
  summed by the step's tree before any rank's contribution).
* :class:`Completing`: a deterministic step's last microbatch: once a bucket's every use has
  given its sections, the earlier microbatches' tree is completed with them and the bucket's
  reduce-scatter starts, overlapping the rest of backward.

In the step's last microbatch (``replicate`` given), a bucket whose every use counted in
forward has landed in the accumulator has its final sum: :class:`Reducing` hands it to
``replicate`` (:class:`funcshard.comm.grads.ReplicateAxis`), which issues its replicate-axis
reduction in its turn, overlapping the rest of backward too. A use beyond those counted
(taken inside a recomputation) tells ``replicate`` that the sum was not final: the bucket is
reduced after backward instead.

A reduction that sums a bucket's uses before the ranks' contributions (the deterministic
tree, as autograd does for ZeRO-0/1) keeps sections for the whole backward when forward took
a bucket into the graph more than once (``params[name]`` beside its unit), and reduces each
bucket once after it.
"""

from __future__ import annotations

import collections
from typing import Protocol

import torch

from funcshard.comm import grads as grads_lib
from funcshard.comm.wires import wire_for
from funcshard.distributed.ops import Pending
from funcshard.layout import determinism
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.step.reduction import AddInto, CompleteTree, KeepSections, Sink

__all__ = ["Reducer", "Reducing", "Sections", "Completing", "ExpertsAfter"]

Acc = list[torch.Tensor | None]


class _Path(Protocol):
    def take(self, bucket: int, grads: list[torch.Tensor | None]) -> None:
        """A use of ``bucket`` gave these full gradients (one per leaf)."""

    def drain(self) -> None:
        """Backward is over: start whatever waits for it."""

    def finish(self) -> None:
        """Wait for everything started (also after an error)."""


class Sections:
    """Keeps the unreduced rank sections in ``acc``: new, or added into those it holds."""

    def __init__(self, layout: Layout, acc: Acc) -> None:
        self.layout, self.acc = layout, acc

    def take(self, bucket: int, grads: list[torch.Tensor | None]) -> None:
        b = self.layout.buckets[bucket]
        layout = self.layout.over(b)
        specs, S = layout.bucket_leaves(b), layout.shard_size
        if self.acc[bucket] is None:
            dtype = b.dtypes.grad
            self.acc[bucket] = shard_lib.to_rank_sections(grads, specs, S, dtype, layout.device)
        else:
            shard_lib.add_to_rank_sections(self.acc[bucket], grads, specs, S)

    def drain(self) -> None:
        pass

    def finish(self) -> None:
        pass


class Reducing:
    """Reduce-scatters each gradient as it comes, at most one in flight, adding into ``acc``.

    With ``replicate``, a bucket whose reduced uses reach ``entries`` (forward's count) is
    final when the last of them lands in ``acc``, which it does at once, and is handed to
    ``replicate`` then.
    """

    def __init__(
        self,
        layout: Layout,
        acc: Acc,
        entries: collections.Counter[int] | None = None,
        replicate: grads_lib.ReplicateAxis | None = None,
    ) -> None:
        self.layout, self.acc = layout, acc
        self.entries = entries if entries is not None else collections.Counter()
        self.replicate = replicate
        self._uses: collections.Counter[int] = collections.Counter()  # landed or in flight
        self._in_flight: list[tuple[int, Pending]] = []

    def take(self, bucket: int, grads: list[torch.Tensor | None]) -> None:
        b = self.layout.buckets[bucket]
        layout = self.layout.over(b)
        specs, S = layout.bucket_leaves(b), layout.shard_size
        # With one data-parallel rank the reduction is the identity: a later microbatch (or
        # use) adds its gradient straight into the accumulator. (With replicas but one shard
        # it is a division by their count, left to the wire.)
        if layout.dp_size == 1 and b.dtypes.comm == b.dtypes.grad and self.acc[bucket] is not None:
            self.finish()  # an earlier use of the bucket lands first
            shard_lib.add_to_rank_sections(self.acc[bucket], grads, specs, S)
            return
        dtype = wire_for(layout, b).sections_dtype
        sections = shard_lib.to_rank_sections(grads, specs, S, dtype, layout.device)
        self.start(bucket, sections)

    def start(self, bucket: int, sections: torch.Tensor, uses: int = 1) -> None:
        """Waits for the reduction in flight, then starts reducing ``sections`` (the sum of
        ``uses`` uses of ``bucket``)."""
        if self.replicate is not None and self._uses[bucket] + uses > self.entries[bucket]:
            self.replicate.late(bucket)  # before the use in flight lands as if final
        self.finish()
        self._uses[bucket] += uses
        b = self.layout.buckets[bucket]
        self._in_flight.append(
            (bucket, grads_lib.start_reduce_shard_axis(self.layout, b, sections))
        )
        if self.replicate is not None and self._uses[bucket] == self.entries[bucket]:
            # The bucket's sum is final once this lands: wait for the reduction over "shard"
            # (the fast link) now rather than at the next bucket, so that the one over
            # "replicate" (the slow link) goes on the wire a unit's backward earlier.
            self.finish()

    def drain(self) -> None:
        pass

    def finish(self) -> None:
        """Waits for the reductions started so far and adds them to the accumulator."""
        for bucket, pending in self._in_flight:
            shard = pending.wait()
            if self.acc[bucket] is None:
                self.acc[bucket] = shard.to(self.layout.buckets[bucket].dtypes.grad)
            else:
                self.acc[bucket].add_(shard)
            if self.replicate is not None and self._uses[bucket] == self.entries[bucket]:
                self.replicate.start(bucket, self.acc[bucket])
        self._in_flight.clear()


class ExpertsAfter:
    """Expert buckets' uses kept as rank sections during backward and reduced once it is
    over, in descending bucket order (the replicate axis's); the other buckets as ``inner``
    reduces them. A rank whose experts got no token reaches no gradient of them, so the
    order of their reductions over the ranks of an expert index cannot follow backward's."""

    def __init__(
        self,
        layout: Layout,
        inner: _Path,
        reducing: Reducing,
        tree: determinism.PairwiseSum | None = None,
    ) -> None:
        self.layout, self.inner, self.reducing, self.tree = layout, inner, reducing, tree
        self._sections = Sections(layout, [None] * len(layout.buckets))
        if isinstance(inner, Completing):  # the expert buckets are completed here
            inner._completed.update(b.index for b in layout.buckets if b.expert)

    def take(self, bucket: int, grads: list[torch.Tensor | None]) -> None:
        if self.layout.buckets[bucket].expert:
            self._sections.take(bucket, grads)
        else:
            self.inner.take(bucket, grads)

    def drain(self) -> None:
        self.inner.drain()
        for b in reversed(self.layout.buckets):
            if not b.expert:
                continue
            sections = self._sections.acc[b.index]
            if self.tree is not None:  # the earlier microbatches' sums first (deterministic)
                sections = self.tree.total(b.index, sections)
            if sections is None:  # no token reached this rank's experts: zeros
                sections = _zero_sections(self.layout, b)
            self._sections.acc[b.index] = None
            self.reducing.start(b.index, sections, uses=max(self.reducing.entries[b.index], 1))

    def finish(self) -> None:
        self.inner.finish()


def _zero_sections(layout: Layout, bucket) -> torch.Tensor:
    """A bucket's rank sections of zeros (a rank no gradient of it reached)."""
    size = layout.over(bucket).shard_size * bucket.numel
    return torch.zeros(size, dtype=bucket.dtypes.grad, device=layout.device)


class Completing:
    """The last microbatch of a tree sum: each bucket's uses are gathered into sections; when
    the last use counted in forward arrives, ``tree`` is completed with them and the bucket's
    reduce-scatter starts (through ``reducing``, told how many uses it sums). A use beyond
    those counted (taken inside a recomputation) comes after its bucket's reduction started:
    it is reduced on its own and added."""

    def __init__(
        self,
        layout: Layout,
        tree: determinism.PairwiseSum,
        entries: collections.Counter[int],
        reducing: Reducing,
    ) -> None:
        self.layout, self.tree, self.entries, self.reducing = layout, tree, entries, reducing
        self._sections = Sections(layout, [None] * len(layout.buckets))
        self._arrived: collections.Counter[int] = collections.Counter()
        self._completed: set[int] = set()

    def take(self, bucket: int, grads: list[torch.Tensor | None]) -> None:
        if bucket in self._completed:
            self.reducing.take(bucket, grads)
            return
        self._sections.take(bucket, grads)  # several uses: summed in arrival order
        self._arrived[bucket] += 1
        if self._arrived[bucket] >= self.entries[bucket]:
            self._complete(bucket)

    def _complete(self, bucket: int) -> None:
        if bucket in self._completed:
            return
        self._completed.add(bucket)
        mine, self._sections.acc[bucket] = self._sections.acc[bucket], None
        total = self.tree.total(bucket, mine)
        if total is not None:
            self.reducing.start(bucket, total, uses=self._arrived[bucket])

    def drain(self) -> None:
        for bucket in range(len(self.layout.buckets)):  # buckets not (fully) reached
            self._complete(bucket)

    def finish(self) -> None:
        self.reducing.finish()


class Reducer:
    """Takes each bucket's gradient from the gather's transpose during :meth:`backward`.

    Args:
      layout: the state's layout.
      sink: where the microbatch's gradients go, as the step's sum says
        (:mod:`funcshard.step.reduction`; None: ``AddInto()``, new buffers). ``AddInto(acc)``:
        this rank's reduced shard added into ``acc`` per bucket (None entries: start one);
        ``KeepSections()``: the unreduced rank sections kept (a deterministic step's
        microbatch); ``CompleteTree(tree)``: the earlier microbatches' tree completed with
        this (last) one, then reduced.
      replicate: the step's replicate-axis reductions, told of each bucket whose sum this
        (last) microbatch makes final.
    """

    def __init__(
        self,
        layout: Layout,
        sink: Sink | None = None,
        replicate: grads_lib.ReplicateAxis | None = None,
    ) -> None:
        self.layout = layout
        sink = AddInto() if sink is None else sink
        self.local = isinstance(sink, KeepSections)
        self.complete = sink.tree if isinstance(sink, CompleteTree) else None
        acc = sink.acc if isinstance(sink, AddInto) else None
        self.replicate = replicate if replicate is not None and replicate.on_wire else None
        self.acc: Acc = acc if acc is not None else [None] * len(layout.buckets)
        zero = {
            b.dtypes.grad: torch.zeros(1, dtype=b.dtypes.grad, device=layout.device)
            for b in layout.buckets
        }
        self._zeros = [zero[b.dtypes.grad].expand(b.numel) for b in layout.buckets]
        self.carriers = tuple(z.detach().requires_grad_() for z in self._zeros)
        self.entries: collections.Counter[int] = collections.Counter()  # uses in forward
        self._path: _Path | None = None

    def reduce(self, bucket: int, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """A use of ``bucket`` gave its full gradients; returns the carrier's (zero) gradient."""
        if self._path is None:
            raise RuntimeError(
                "a gradient of the gathered params was taken inside loss_fn; under "
                f"{self.layout.strategy} train_step runs the one backward of the step itself"
            )
        self._path.take(bucket, list(grads))
        return self._zeros[bucket]

    def _deferred(self) -> bool:
        """Whether uses must be summed before the ranks' contributions, and some bucket was
        used more than once in forward."""
        return (
            self.layout.deterministic  # the tree sums uses first
            and not self.local
            and self.complete is None
            and any(n > 1 for n in self.entries.values())
        )

    def backward(self, loss: torch.Tensor) -> Acc:
        """Backpropagates ``loss``; returns the accumulator (None: no gradient reached yet)."""
        deferred = self._deferred()
        if self.local or deferred:
            sections = self.acc if self.local else [None] * len(self.acc)
            path: _Path = Sections(self.layout, sections)
        else:
            reducing = Reducing(self.layout, self.acc, self.entries, self.replicate)
            path = reducing
            if self.complete is not None:
                path = Completing(self.layout, self.complete, self.entries, reducing)
            if any(b.expert for b in self.layout.buckets):
                path = ExpertsAfter(self.layout, path, reducing, self.complete)
        self._path = path
        try:
            torch.autograd.grad(loss, self.carriers, allow_unused=True)
            path.drain()
        except BaseException:
            if self.replicate is not None:  # issue nothing more, leave nothing in flight
                self.replicate.abandon()
            raise
        finally:
            path.finish()
            self._path = None
        if deferred:  # each bucket's summed uses, reduced once (over "replicate" after it)
            reducing = Reducing(self.layout, self.acc)
            for bucket, value in enumerate(sections):
                if value is None and self.layout.buckets[bucket].expert:
                    value = _zero_sections(self.layout, self.layout.buckets[bucket])
                if value is not None:
                    reducing.start(bucket, value)
            reducing.finish()
        return self.acc

    def close(self) -> None:
        """Lets go of the accumulator (a step's gradients) and the carriers once the run is
        over, however long the run itself lives on."""
        self.acc = []
        self.complete = None
        self._zeros = []
        self.carriers = ()
