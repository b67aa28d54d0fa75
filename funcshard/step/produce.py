"""Gradient producers: one microbatch's forward and backward, per way params are held.

* :class:`ReplicatedGrads` (ZeRO-0/1): the full compute params are views of persistent
  buffers; backward gives full gradients, packed into rank sections (unreduced).
* :class:`UnitGrads` (ZeRO-2/3): forward and backward run unit by unit
  (:class:`funcshard.step.units.UnitRun`); each bucket's gradient is reduce-scattered over "shard"
  as backward finishes with it (or kept unreduced, as the step's :data:`Sink` says), and in
  the step's last microbatch (given ``replicate``) its reduction over "replicate" starts as
  soon as its sum is final.

A producer returns ``(loss, aux, grads)``: grads per bucket, in main-grads dtype, where the
sink said (added into its buffers for :class:`AddInto` with ``acc``). ``shard_reduced`` says
whether they are already reduced over the shard axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from funcshard.comm.grads import ReplicateAxis
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.step.compiling import Backend, capture_refusal
from funcshard.step.functional import StepParams
from funcshard.step.reduction import AddInto, Grads, Sink
from funcshard.step.units import UnitRun
from funcshard.step.units.losses import dtensor_backward, loss_and_aux, reported

__all__ = ["GradProducer", "ReplicatedGrads", "UnitGrads", "producer_for", "loss_and_aux"]

LossFn = Callable[[Any, Any], Any]


class GradProducer(Protocol):
    """Runs one microbatch's forward and backward."""

    shard_reduced: bool
    """Whether the gradients it returns are this rank's shards, reduced over "shard"."""

    def microbatch(
        self,
        batch: Any,
        loss_fn: LossFn,
        scale: float,
        sink: Sink,
        replicate: ReplicateAxis | None = None,
    ) -> tuple[torch.Tensor, Any, Grads]:
        """``(loss, aux, grads)`` of ``loss_fn(params, batch)``, backward of ``loss * scale``
        (``replicate``: the step's replicate-axis reductions, given to its last microbatch)."""
        ...


class ReplicatedGrads:
    """ZeRO-0/1: full compute params in, unreduced rank sections out."""

    shard_reduced = False

    def __init__(
        self, layout: Layout, compute: tuple[torch.Tensor, ...], backend: Backend = None
    ) -> None:
        self.layout = layout
        self.compute = compute
        self.backend = backend

    def microbatch(
        self,
        batch: Any,
        loss_fn: LossFn,
        scale: float,
        sink: Sink,
        replicate: ReplicateAxis | None = None,
    ) -> tuple[torch.Tensor, Any, Grads]:
        del replicate  # reduced after the step's microbatches
        assert isinstance(sink, AddInto), "ZeRO-0/1 add into one accumulator"
        layout = self.layout
        params, order = {}, []
        for bucket, full in zip(layout.buckets, self.compute, strict=True):
            S = layout.over(bucket).shard_size
            for spec in layout.bucket_leaves(bucket):
                params[spec.name] = shard_lib.full_view(full, spec, S).detach().requires_grad_()
                order.append(spec.name)
        wrap = layout.tensor.wrap
        step_params = StepParams((n, wrap(n, params[n])) for n in layout.names)
        step_params.compile_units = (layout.units[1:], self.backend)
        try:
            loss, aux = loss_and_aux(loss_fn(step_params, batch))
            leaves = [params[n] for n in order]
            with dtensor_backward(loss):
                grads = torch.autograd.grad(loss * scale, leaves, allow_unused=True)
        finally:
            step_params.close()
        by_name = dict(zip(order, grads, strict=True))
        return reported(loss), aux, self._sections(by_name, sink.acc)

    def _sections(self, grads: dict[str, torch.Tensor | None], acc: Grads | None) -> Grads:
        """Per bucket, the gradients as rank sections: new, or added into ``acc``."""
        layout = self.layout
        out: Grads = []
        for i, bucket in enumerate(layout.buckets):
            specs, S = layout.bucket_leaves(bucket), layout.over(bucket).shard_size
            bucket_grads = [grads[s.name] for s in specs]
            if acc is None:
                dtype = bucket.dtypes.grad
                out.append(shard_lib.to_rank_sections(bucket_grads, specs, S, dtype, layout.device))
            else:  # a later microbatch: straight into the accumulator, no sections built
                shard_lib.add_to_rank_sections(acc[i], bucket_grads, specs, S)
                out.append(acc[i])
        return out


class UnitGrads:
    """ZeRO-2/3: unit by unit; ``buffers`` are the compute shards to gather (ZeRO-3) or the
    replicated full compute buffers (ZeRO-2)."""

    shard_reduced = True

    def __init__(
        self, layout: Layout, buffers: list[torch.Tensor] | tuple, backend: Backend = None
    ) -> None:
        self.layout = layout
        self.buffers = buffers
        self.backend = backend

    def microbatch(
        self,
        batch: Any,
        loss_fn: LossFn,
        scale: float,
        sink: Sink,
        replicate: ReplicateAxis | None = None,
    ) -> tuple[torch.Tensor, Any, Grads]:
        replicated = not self.layout.strategy.shards_params
        run = UnitRun(
            self.layout,
            self.buffers,
            sink,
            replicated=replicated,
            replicate=replicate,
            backend=self.backend,
        )
        try:
            loss, aux = loss_and_aux(loss_fn(run.params, batch))
            with dtensor_backward(loss):
                grads = run.backward(loss * scale)
            return reported(loss), aux, grads
        finally:
            run.close()


def producer_for(
    layout: Layout,
    master: tuple[torch.Tensor, ...],
    compute: tuple[torch.Tensor | None, ...],
    backend: Backend = None,
) -> GradProducer:
    """The producer of ``layout``'s strategy over a state's masters and compute copies; with
    ``backend`` (``fs.init``'s compile), ZeRO-2/3's microbatch runs captured
    (:class:`~funcshard.step.units.captured.CapturedGrads`) where the layout allows, else
    unit modules run compiled.

    ZeRO-3 casts each device bucket's shard from its master once per step (an offloaded
    bucket keeps a device compute shard, derived by ``offload_step``)."""
    if not layout.strategy.runs_units:
        return ReplicatedGrads(layout, compute, backend)
    if layout.strategy.shards_params:
        compute = [
            c if c is not None else m.to(layout.device, b.dtypes.compute)
            for b, m, c in zip(layout.buckets, master, compute, strict=True)
        ]
    if backend is not None and capture_refusal(layout) is None:
        # imported here: the captured step brings torch's compiler (0.6 s an import)
        from funcshard.step.units.captured import CapturedGrads

        return CapturedGrads(layout, compute, backend)
    return UnitGrads(layout, compute, backend)
