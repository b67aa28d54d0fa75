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

The tensor and expert axes inside a stage: each leaf is handed to the stage as the model
holds it (the layout's model axis wraps it: the TP plan's DTensor on ``mesh["tensor"]``,
experts ``Shard(0)`` on ``mesh["expert"]``), so torch's TP collectives and the experts'
all-to-all run inside the stage, on the pipeline rank's sub-world. What a stage returns goes
to the next stage as it is: under torch's plans it is replicated over "tensor", and each
tensor rank sends its own copy to the same tensor rank of the next stage (``mesh["pipeline"]``
holds every other coordinate equal). The loss is counted on tensor rank 0 only.

A stage raising in its forward (or ``loss_fn`` on the last stage) hands on zeros of its
output's shape (from the stages' meta-device run), one raising in its backward zero input
gradients, so that no peer waits on a send: the step's agreement then raises on every rank,
naming the rank, stage and error (docs/pipeline-parallel.md).
"""

from __future__ import annotations

import hashlib
import math
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from funcshard.distributed import ops
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.parallel.pipeline import Pipeline
from funcshard.step.pipeline_regather import Regather
from funcshard.step.pipeline_stage import StageModule, as_meta, propagate
from funcshard.step.pipeline_torch_stage import CountingStage
from funcshard.step.units.gather import Gatherer
from funcshard.step.units.losses import described

__all__ = ["PipelineRun", "StageModule", "CountingStage"]

# PipelineRun._key after a failed step whose stand-in guessed a stage's output shape
# (StageModule._unsized): no batch has it, so the next step rebuilds torch's schedule and
# infers every stage's shapes again
_REINFER = ("infer the stages' shapes again",)


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
                    raise TypeError(f"loss_fn must return a scalar tensor, got {described(loss)}")
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
      counts_loss: whether this rank's losses are added to the step's: not on tensor ranks
        other than 0 (every rank of a tensor group computes the same loss).
      peers: the groups of the tensor and expert axes inside a stage (of more than one rank),
        whose collectives a failed stage's stand-in joins.

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
        counts_loss: bool = True,
        peers: Sequence[dist.ProcessGroup] = (),
    ) -> None:
        self.pipe, self.stages, self.mine = pipe, list(stages), mine
        self.group, self.device = group, device
        self.world, self.counts_norm, self.counts_loss = world, counts_norm, counts_loss
        self.modules = {i: StageModule(stages[i], i) for i in mine}
        for m in self.modules.values():
            m.peers = tuple(peers)
        self.loss = LossWrap()
        self._key: Any = None
        self.schedule = self._build()  # torch's checks, before any collective

    @property
    def leads(self) -> bool:
        """Whether this rank is its pipeline rank's sub-world's first (every data-parallel,
        tensor and expert coordinate 0)."""
        return self.counts_norm

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
        mb = [torch.tensor_split(as_meta(t), self.pipe.microbatches)[0] for t in inputs]
        metas = propagate(self.stages, tuple(mb), policy)
        for i, out in enumerate(metas):  # every rank runs every stage: all raise alike
            if out is not None and not _sendable_kind(out):
                raise ValueError(
                    f"train_step under a pipeline: stage {i} returns {type(out).__name__}; "
                    "a stage hands the next a tensor or a tuple or list of tensors"
                )
        self._key = key
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
        try:
            inputs, target = _split_batch(batch, self.pipe.microbatches)
            key, refused = _shapes_key(inputs, target), None
        except (TypeError, ValueError) as e:
            key, refused = (), f"{type(e).__name__}: {e}"
        self.agree_batch(refused, key)
        self._prepare(inputs, layout.policy)  # every rank alike: the same shapes, agreed
        regather = None
        if self.pipe.regather and layout.strategy.shards_params:
            regather = Regather(layout, master, compute)
            leaves = regather.leaves
        else:
            leaves = _step_leaves(layout, master, compute)
        for m in self.modules.values():
            m.leaves, m.error, m.regather = {n: leaves[n] for n in m.names}, None, regather
            m.guessed = False
            m.rejoin = True
            m.wrap = layout.tensor.wrap  # DTensors where the stage had them (tensor, experts)
        self.loss.reset(loss_fn, factor)
        try:
            args = inputs if self.first else ()
            self.schedule.step(*args, target=target if self.last else None)
        finally:
            for m in self.modules.values():
                m.release()
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

    def agree_batch(self, refused: str | None, key: tuple) -> None:
        """Before the schedule: ValueError on every rank where any rank refused its batch
        (its rows not a multiple of the microbatches, not a tensor, a target of other rows
        than the inputs) or the ranks' batches differ in shape or dtype (torch's schedules
        size every stage's buffers by one microbatch's shapes, and a rank whose shapes
        change rebuilds its schedule: alone, its peers would not), naming each rank and why.
        One all-reduce (max) over the world of 5 float64 (kind "metrics"): a refusal, and
        two 52-bit parts of the shapes' SHA-256 (exact in float64) with their negations (the
        same on every rank iff each max equals minus the max of its negation; crc32 let two
        batches of other shapes pass)."""
        sha = hashlib.sha256(repr(key).encode()).digest()
        digest = [float(int.from_bytes(sha[k : k + 8], "big") >> 12) for k in (0, 8)]
        vec = torch.tensor(
            [float(refused is not None), *digest, *(-d for d in digest)],
            dtype=torch.float64,
            device=self.device,
        )
        ops.record("metrics", vec, ops.Axis.WORLD)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.world)
        n = dist.get_world_size(self.world)
        if float(vec[0]) == 0 and vec[1:3].tolist() == (-vec[3:5]).tolist():
            return
        told: list[Any] = [None] * n
        dist.all_gather_object(told, (dist.get_rank(), refused, key), group=self.world)
        lines = [f"rank {r}: {e}" for r, e, _ in told if e]
        if not lines:
            lines = [f"rank {r}: (inputs, target) of shapes and dtypes {k}" for r, _, k in told]
            lines.insert(0, "the ranks' batches differ (every rank's must be alike):")
        raise ValueError(
            "train_step under a pipeline: a batch was refused (nothing ran):\n" + "\n".join(lines)
        )

    def agree(
        self,
        loss_sum: torch.Tensor,
        square: torch.Tensor,
        error: str | None,
        dp_size: int,
        apart: str | None = None,
    ) -> tuple[float, float]:
        """``(mean loss, whole model's gradient norm)``, the same bits on every rank (one
        all-reduce over the world, counted under "metrics"), or RuntimeError on every rank
        when a stage or ``loss_fn`` raised on any, naming each rank's failure; ``apart``
        (a tensor group's batch check failed) is named only where no stage failed. Where a
        failed stage's stand-in guessed its output's shape (it never gave one), every rank
        infers the stages' shapes again at its next step."""
        square = square.to(loss_sum) if self.counts_norm else torch.zeros_like(loss_sum)
        loss_sum = loss_sum if self.counts_loss else torch.zeros_like(loss_sum)
        flag = loss_sum.new_tensor(float(error is not None or apart is not None))
        vec = torch.stack([loss_sum, square, flag])
        vec = ops.all_reduce(vec, self.world, axis=ops.Axis.WORLD, kind="metrics")
        if float(vec[2]) > 0:
            told: list[Any] = [None] * dist.get_world_size(self.world)
            guessed = any(m.guessed for m in self.modules.values())
            dist.all_gather_object(told, (dist.get_rank(), error, apart, guessed), group=self.world)
            if any(g for *_, g in told):  # torch's shape inference may hold the guess
                self._key = _REINFER  # every rank, as all are told here
            lines = [f"rank {r}: {e}" for r, e, _, _ in told if e]
            lines = lines or [f"rank {r}: {a}" for r, _, a, _ in told if a]
            raise RuntimeError(
                "train_step: the pipeline step failed (nothing was updated):\n" + "\n".join(lines)
            )
        count = self.pipe.microbatches * dp_size
        return float(vec[0]) / count, math.sqrt(float(vec[1]))


def _split_batch(batch: Any, microbatches: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """``(inputs, target)``: inputs a tensor or a tuple of tensors, every one's rows a
    multiple of ``microbatches`` (checked before any collective; every rank is told, by
    :meth:`PipelineRun.agree_batch`)."""
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
        if t.shape[0] != inputs[0].shape[0]:
            raise ValueError(
                f"train_step under a pipeline: {what} has {t.shape[0]} rows, input 0 has "
                f"{inputs[0].shape[0]}: every tensor of the batch has the same rows"
            )
        if t.shape[0] % microbatches:
            raise ValueError(
                f"train_step under a pipeline: {what} has {t.shape[0]} rows, not a multiple "
                f"of microbatches={microbatches} (torch's schedules size every microbatch's "
                "buffers by the first one's: uneven microbatches are not supported)"
            )
    return inputs, target


def _shapes_key(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype)) for t in (*inputs, target))


def _sendable_kind(out: Any) -> bool:
    """Whether a stage's output is what torch's stages send: a tensor, a tuple or list of
    them."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out)


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
