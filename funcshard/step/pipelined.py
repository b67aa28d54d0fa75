"""The gradients of a pipelined step, by torch.distributed.pipelining's own schedules.

:class:`PipelineRun` (made by ``fs.init(..., pipeline=)``, kept in the state's static
metadata) holds, for this pipeline rank, one :class:`StageModule` per stage it runs, torch's
``PipelineStage`` over each (:class:`CountingStage`: its sends counted under "pipeline") and
torch's schedule over them. A step (:meth:`PipelineRun.grads`):

1. the step's compute params: every bucket's full buffer (ZeRO-3: gathered once, here),
   each parameter a view of it detached into a leaf requiring grad; each StageModule's
   ``parameters()`` are those leaves, so torch's schedule accumulates ``.grad`` into them
   over the microbatches (zero-bubble schedules compute input and weight gradients apart
   through the same ``parameters()``);
2. torch's ``schedule.step(inputs, target=)``: each microbatch's loss (``loss_fn(output,
   target)`` on the last stage) is scaled by ``1 / microbatches`` (``scale_grads=False``:
   torch scales nothing), so the leaves hold the mean over microbatches of the gradients,
   as ``train_step`` sums them without a pipeline;
3. the leaves' gradients as unreduced rank sections, for the step's reduction over this
   pipeline rank's data-parallel sub-world.

A stage that raises in its forward (or ``loss_fn`` raising on the last stage) does not stop
the schedule halfway (its peers would wait on its sends until the collective timeout): it
hands on zeros of the output's shape (known from running every stage on the meta device
first) and the step's agreement raises on every rank, naming the rank, stage and error.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from funcshard.distributed import ops
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.parallel.pipeline import Pipeline
from funcshard.step.pipeline_regather import Regather
from funcshard.step.units.gather import Gatherer

__all__ = ["PipelineRun", "StageModule", "CountingStage"]


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _sendable(out: Any, meta: Any, index: int) -> Any:
    """``out`` as torch's stage sends it: contiguous (gloo sends and receives contiguous
    buffers only; the gradients received for it are made like it), and of the shapes and
    dtypes the stage has on the meta device (ValueError otherwise: the receiving stage sized
    its buffers by them)."""
    out = optree.tree_map(lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, out)
    if meta is not None:
        got = [(tuple(t.shape), t.dtype) for t in optree.tree_leaves(out)]
        want = [(tuple(m.shape), m.dtype) for m in optree.tree_leaves(meta)]
        if got != want:
            raise ValueError(
                f"pipeline stage {index}: its output (shapes, dtypes) {got} differs from "
                f"what it gives on the meta device, {want}, by which the next stage sized "
                "its buffers"
            )
    return out


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: torch's stage sends a
    stage's input gradients as autograd gives them and the previous stage receives them into
    buffers strided as the first step's were (gloo takes contiguous buffers only; an expanded
    zero gradient, e.g. of an input a stage ignores, is not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad.contiguous()


def _stage_inputs(args: tuple, dtype: torch.dtype | None) -> tuple:
    """A stage's inputs as its forward sees them: floating-point ones cast to ``dtype`` (the
    policy's compute dtype, FSDP2's ``cast_forward_inputs``; None: as given), every input
    that requires grad giving back a contiguous gradient (:class:`ContiguousGrad`)."""
    out = []
    for t in args:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t = ContiguousGrad.apply(t)
        if isinstance(t, torch.Tensor) and dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out.append(t)
    return tuple(out)


class StageModule(nn.Module):
    """A stage as torch's ``PipelineStage`` runs it: the user's stage module called with the
    step's leaves (``torch.func.functional_call``); ``parameters()`` are those leaves; its
    floating-point inputs cast to the policy's compute dtype (``cast``, set per step)."""

    def __init__(self, stage: nn.Module, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "stage", stage)  # not a child: its parameters are not ours
        self.index = index
        self.names = [n for n, _ in stage.named_parameters()]
        self.leaves: dict[str, torch.Tensor] = {}
        self.error: str | None = None
        self.out_meta: Any = None  # one microbatch's output as meta tensors (None: unknown)
        self.cast: torch.dtype | None = None  # the policy's param_dtype
        self.regather: Regather | None = None  # ZeRO-3 per microbatch (the step's)

    def parameters(self, recurse: bool = True):  # noqa: ARG002
        return iter([self.leaves[n] for n in self.names if n in self.leaves])  # none off a step

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        del recurse, remove_duplicate
        return iter([(prefix + n, self.leaves[n]) for n in self.names if n in self.leaves])

    def forward(self, *args: Any) -> Any:
        if self.error is None:
            try:
                inputs = _stage_inputs(args, self.cast)
                call = lambda p: torch.func.functional_call(self.stage, p, inputs)  # noqa: E731
                if self.regather is not None:
                    out = self.regather.call(self.names, call)
                else:
                    out = call({n: self.leaves[n] for n in self.names})
                return _sendable(out, self.out_meta, self.index)
            except Exception:  # noqa: BLE001 (every rank is told, at the step's agreement)
                self.error = traceback.format_exc(limit=-3)
                if self.out_meta is None:
                    raise
        return self._stand_in(args)

    def _stand_in(self, args: tuple) -> Any:
        """Zeros of the output's shape, in the graph of the inputs and leaves (so that the
        schedule's backward runs and sends zeros back, contiguous: not the expanded zeros
        of a sum's gradient, by which torch would size the previous stage's buffers)."""
        args = _stage_inputs(args, None)
        anchor = sum(
            (t.sum() * 0 for t in [*args, *self.leaves.values()] if _differentiable(t)),
            torch.zeros((), device=_device(args, self.leaves)),
        )
        return optree.tree_map(
            lambda m: (
                torch.zeros(m.shape, dtype=m.dtype, device=anchor.device) + anchor.to(m.dtype)
                if m.is_floating_point()
                else torch.zeros(m.shape, dtype=m.dtype, device=anchor.device)
            ),
            self.out_meta,
        )


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _device(args: tuple, leaves: dict[str, torch.Tensor]) -> torch.device:
    for t in [*args, *leaves.values()]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


class CountingStage(PipelineStage):
    """torch's ``PipelineStage``, counting what it sends (stage outputs to another rank, the
    gradients of its inputs back) under ``comm_stats``'s "pipeline" axis, kind "send". A
    boundary inside one rank sends nothing: torch passes the tensors on locally."""

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return _counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return _counted(super().get_bwd_send_ops(bwd_chunk_id))

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:  # regather=True: the buffers gathered again for it are freed
            if self.submod.regather is not None:
                self.submod.regather.release()

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            if self.submod.regather is not None:
                self.submod.regather.release()


def _counted(p2p: list[dist.P2POp]) -> list[dist.P2POp]:
    for op in p2p:
        ops.record("send", op.tensor, ops.Axis.PIPELINE)
    return p2p


class LossWrap:
    """The schedule's loss function: the user's ``loss_fn`` on the last stage, its value kept
    (unscaled) and returned times the step's ``factor``; a raising ``loss_fn`` recorded."""

    def __init__(self) -> None:
        self.reset(None, 1.0)

    def reset(self, loss_fn: Callable[[Any, Any], Any] | None, factor: float) -> None:
        self.loss_fn, self.factor = loss_fn, factor
        self.losses: list[torch.Tensor] = []
        self.error: str | None = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.error is None:
            try:
                loss = self.loss_fn(output, target)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}")
                self.losses.append(loss.detach())
                return loss * self.factor
            except Exception:  # noqa: BLE001 (every rank is told, at the step's agreement)
                self.error = traceback.format_exc(limit=-3)
        first = optree.tree_leaves(output)[0]
        return first.sum() * 0.0


class PipelineRun:
    """This pipeline rank's stages under torch's schedule (see the module's docstring).

    Args:
      pipe: the schedule and microbatches.
      stages: every stage of the model, in order (the others may be on the meta device).
      mine: the indices of the stages this rank runs.
      group: the "pipeline" axis's group (of this rank's other coordinates).
      device: where the stages run.
      world: a group over every rank of the mesh (the step's agreement).
      counts_norm: whether this rank is its sub-world's first (its stages' share of the
        squared norm, the same on every rank of the sub-world, is added once).

    Raises:
      ValueError: microbatches torch's schedule refuses for this stage count (its words).
    """

    def __init__(
        self,
        pipe: Pipeline,
        stages: Sequence[nn.Module],
        mine: tuple[int, ...],
        group: dist.ProcessGroup,
        device: torch.device,
        world: dist.ProcessGroup,
        counts_norm: bool,
    ) -> None:
        self.pipe, self.stages, self.mine = pipe, list(stages), mine
        self.group, self.device = group, device
        self.world, self.counts_norm = world, counts_norm
        self.modules = {i: StageModule(stages[i], i) for i in mine}
        self.loss = LossWrap()
        self._key: Any = None
        self.schedule = self._build()  # torch's checks, before any collective

    @property
    def first(self) -> bool:
        return 0 in self.mine

    @property
    def last(self) -> bool:
        return len(self.stages) - 1 in self.mine

    def _build(self) -> Any:
        cls = getattr(torch_schedules, self.pipe.torch_class)
        n = len(self.stages)
        objs = [
            CountingStage(self.modules[i], i, n, self.device, group=self.group) for i in self.mine
        ]
        kwargs = dict(loss_fn=self.loss, scale_grads=False)
        try:
            if self.pipe.placement == "single":
                return cls(objs[0], self.pipe.microbatches, **kwargs)
            return cls(objs, self.pipe.microbatches, **kwargs)
        except ValueError as e:
            raise ValueError(
                f"Pipeline(schedule={self.pipe.schedule!r}, microbatches="
                f"{self.pipe.microbatches}) on {n} stages: torch's {cls.__name__} refuses "
                f"it: {e}"
            ) from e

    def _prepare(self, inputs: tuple[torch.Tensor, ...], policy: MixedPrecisionPolicy) -> None:
        """A schedule for this batch's shapes (torch infers a stage's shapes once), and each
        stage's output shape and dtype from a meta-device run of every stage in the policy's
        compute dtypes (as the step runs them)."""
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        if key == self._key:
            return
        if self._key is not None:
            self.schedule = self._build()
        self._key = key
        mb = [torch.tensor_split(_meta(t), self.pipe.microbatches)[0] for t in inputs]
        metas = _propagate(self.stages, tuple(mb), policy)
        for i, m in self.modules.items():
            m.out_meta, m.cast = metas[i], policy.param_dtype

    def grads(
        self,
        layout: Layout,
        master: tuple[torch.Tensor, ...],
        compute: tuple[torch.Tensor | None, ...],
        batch: Any,
        loss_fn: Callable[[Any, Any], Any],
        factor: float,
    ) -> tuple[list[torch.Tensor], torch.Tensor, str | None]:
        """One step's ``(rank sections per bucket, this rank's sum of microbatch losses
        (float64, 0 off the last stage), the failure on this rank or None)``."""
        inputs, target = _split_batch(batch, self.pipe.microbatches)
        self._prepare(inputs, layout.policy)
        regather = None
        if self.pipe.regather and layout.strategy.shards_params:
            regather = Regather(layout, master, compute)
            leaves = regather.leaves
        else:
            leaves = _step_leaves(layout, master, compute)
        for m in self.modules.values():
            m.leaves, m.error, m.regather = {n: leaves[n] for n in m.names}, None, regather
        self.loss.reset(loss_fn, factor)
        try:
            args = inputs if self.first else ()
            self.schedule.step(*args, target=target if self.last else None)
        finally:
            for m in self.modules.values():
                m.leaves, m.regather = {}, None
            if regather is not None:
                regather.release()
        errors = [f"stage {i}: {m.error}" for i, m in self.modules.items() if m.error]
        if self.loss.error:
            errors.append(f"loss_fn on stage {len(self.stages) - 1}: {self.loss.error}")
        total = torch.zeros((), dtype=torch.float64, device=layout.device)
        # torch's shape inference (a schedule's first step) calls loss_fn once more, first
        for loss in self.loss.losses[-self.pipe.microbatches :] if self.last else ():
            total = total + loss.to(layout.device, torch.float64)
        grads = {n: t.grad for n, t in leaves.items()}
        return _sections(layout, grads), total, "\n".join(errors) or None

    def whole(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pipeline rank's ``named`` (its stages' full parameters), in stage order: a
        collective over "pipeline" (pickled through the group: for evaluation and export of
        models that fit one rank)."""
        told: list[Any] = [None] * dist.get_world_size(self.group)
        cpu = {n: t.detach().cpu() for n, t in named.items()}
        dist.all_gather_object(told, (self.mine, cpu), group=self.group)
        by_stage = {}
        for mine, params in told:
            for i in mine:
                names = [n for n, _ in self.stages[i].named_parameters(remove_duplicate=False)]
                by_stage[i] = {n: params[n].to(self.device) for n in names if n in params}
        return {n: t for i in sorted(by_stage) for n, t in by_stage[i].items()}

    def nonfinite(self, local: dict[str, float]) -> list[str]:
        """The whole model's parameters whose reduced gradient is not finite on any rank, in
        stage order, the same on every rank: ``local`` (this rank's flag per parameter of its
        stages, > 0 where its part is not finite) summed over the world in one all-reduce
        (kind "metrics") of a flag per parameter of every stage."""
        every = [n for stage in self.stages for n, _ in stage.named_parameters()]
        index = {n: k for k, n in enumerate(every)}
        flags = torch.zeros(len(every), dtype=torch.float32, device=self.device)
        for name, flag in local.items():
            flags[index[name]] = flag
        flags = ops.all_reduce(flags, self.world, axis=ops.Axis.WORLD, kind="metrics")
        return [n for n, f in zip(every, flags.tolist(), strict=True) if f > 0]

    def check_microbatches(self, microbatches: int) -> None:
        """``train_step``'s ``microbatches``: 1 (the default) or the pipeline's own."""
        if microbatches not in (1, self.pipe.microbatches):
            raise ValueError(
                f"train_step: microbatches={microbatches}, but the state's pipeline splits "
                f"every batch into fs.Pipeline(microbatches={self.pipe.microbatches})"
            )

    def agree(
        self, loss_sum: torch.Tensor, square: torch.Tensor, error: str | None, dp_size: int
    ) -> tuple[float, float]:
        """``(mean loss, whole model's gradient norm)``, the same bits on every rank (one
        all-reduce over the world, counted under "metrics"), or RuntimeError on every rank
        when a stage or ``loss_fn`` raised on any, naming each rank's failure."""
        square = square.to(loss_sum) if self.counts_norm else torch.zeros_like(loss_sum)
        flag = loss_sum.new_tensor(float(error is not None))
        vec = torch.stack([loss_sum, square, flag])
        vec = ops.all_reduce(vec, self.world, axis=ops.Axis.WORLD, kind="metrics")
        if float(vec[2]) > 0:
            told: list[Any] = [None] * dist.get_world_size(self.world)
            dist.all_gather_object(told, (dist.get_rank(), error), group=self.world)
            lines = [f"rank {r}: {e}" for r, e in told if e]
            raise RuntimeError(
                "train_step: the pipeline step failed (nothing was updated):\n" + "\n".join(lines)
            )
        count = self.pipe.microbatches * dp_size
        return float(vec[0]) / count, math.sqrt(float(vec[1]))


def _split_batch(batch: Any, microbatches: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``(inputs, target)``: inputs a tensor or a tuple of tensors, every one's rows a
    multiple of ``microbatches`` (checked before any collective)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            "train_step under a pipeline: batch must be (inputs, target), got "
            f"{type(batch).__name__}"
        )
    inputs, target = batch
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    for k, t in enumerate((*inputs, target)):
        what = "target" if k == len(inputs) else f"input {k}"
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise TypeError(f"train_step under a pipeline: {what} is not a batch tensor: {t!r}")
        if t.shape[0] % microbatches:
            raise ValueError(
                f"train_step under a pipeline: {what} has {t.shape[0]} rows, not a multiple "
                f"of microbatches={microbatches} (torch's schedules size every microbatch's "
                "buffers by the first one's: uneven microbatches are not supported)"
            )
    return inputs, target


def _propagate(stages: list[nn.Module], x: tuple, policy: MixedPrecisionPolicy) -> list[Any]:
    """Each stage's output for one microbatch, as meta tensors (None from the first stage
    that cannot run on the meta device on): its parameters in their compute dtypes and its
    inputs cast, as :class:`StageModule` runs it."""
    out: list[Any] = []
    with torch.no_grad():
        for stage in stages:
            if x is None:
                out.append(None)
                continue
            params = {
                n: _meta(p).to(policy.resolve(p.dtype).compute) for n, p in stage.named_parameters()
            }
            params.update({n: _meta(b) for n, b in stage.named_buffers()})
            try:
                y = torch.func.functional_call(stage, params, _stage_inputs(x, policy.param_dtype))
            except Exception:  # noqa: BLE001 (no stand-in for it: the collective timeout)
                y = None
            out.append(y)
            x = None if y is None else (y if isinstance(y, tuple) else (y,))
    return out


def _step_leaves(
    layout: Layout, master: tuple[torch.Tensor, ...], compute: tuple[torch.Tensor | None, ...]
) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stages as a leaf requiring grad: a view of its bucket's
    full compute buffer (ZeRO-3: all-gathered from the compute shards, once a step)."""
    strategy = layout.strategy
    buffers: list[torch.Tensor] = list(compute)
    if strategy.shards_params:
        shards = [
            c if c is not None else m.to(layout.device, b.dtypes.compute)
            for b, m, c in zip(layout.buckets, master, compute, strict=True)
        ]
        gatherer = Gatherer(layout, shards, replicated=False)
        gatherer.prefetch(range(len(layout.buckets)))
        buffers = [gatherer.full(b) for b in range(len(layout.buckets))]
        gatherer.close()
    leaves = {}
    for bucket, full in zip(layout.buckets, buffers, strict=True):
        S = layout.over(bucket).shard_size
        for spec in layout.bucket_leaves(bucket):
            leaves[spec.name] = shard_lib.full_view(full, spec, S).detach().requires_grad_()
    return leaves


def _sections(layout: Layout, grads: dict[str, torch.Tensor | None]) -> list[torch.Tensor]:
    """Per bucket, the gradients as unreduced rank sections in main-grads dtype."""
    out = []
    for bucket in layout.buckets:
        specs, S = layout.bucket_leaves(bucket), layout.over(bucket).shard_size
        out.append(
            shard_lib.to_rank_sections(
                [grads[s.name] for s in specs], specs, S, bucket.dtypes.grad, layout.device
            )
        )
    return out
