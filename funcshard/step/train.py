"""``train_step``: split -> produce -> reduce -> norm/metrics -> update.

The parts: a gradient producer per way params are held (:mod:`funcshard.step.produce`), a
reduction per summation rule (:mod:`funcshard.step.reduction`: microbatch sums, norm,
loss), the reduction of the step's gradients over the mesh (:mod:`funcshard.comm.grads`) and the
optimizer update (:func:`funcshard.step.update.apply_update`).
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch
import torch.distributed as dist

from funcshard.comm import grads as grads_lib
from funcshard.comm import params as params_lib
from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed import ops
from funcshard.layout import sharding as shard_lib
from funcshard.layout.layout import Layout
from funcshard.parallel.axis import BatchCheck
from funcshard.parallel.batch import leaf_paths
from funcshard.state.replica_check import check_replicas
from funcshard.state.state import LossScale, TrainState
from funcshard.step import summed as summed_lib
from funcshard.step import update as offload_lib
from funcshard.step.produce import LossFn, producer_for
from funcshard.step.reduction import Reduction, reduction_of

__all__ = ["train_step", "full_params", "split_microbatches"]


def split_microbatches(batch: Any, microbatches: int) -> list[Any]:
    """Splits every tensor of ``batch`` on dim 0 into ``microbatches`` nearly equal parts."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    leaves, treedef = optree.tree_flatten(batch)
    for path, leaf in zip(leaf_paths(batch), leaves, strict=True):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            raise TypeError(
                f"batch leaf {path!r}: expected a tensor with a batch dim, got {leaf!r}"
            )
        if leaf.shape[0] < microbatches:
            raise ValueError(
                f"batch leaf {path!r}: {leaf.shape[0]} rows cannot split into "
                f"{microbatches} microbatches"
            )
    parts = [torch.tensor_split(leaf, microbatches) for leaf in leaves]
    return [optree.tree_unflatten(treedef, [p[i] for p in parts]) for i in range(microbatches)]


# A refused batch's weight in the flag the step's loss carries over the world: above any
# count of tensor groups whose batches were apart (the other flag summed there).
_REFUSED = float(1 << 24)


class _Split:
    """This rank's microbatches, or where its batch has fewer rows than ``microbatches`` (a
    ragged last batch) a stand-in: the whole batch as every microbatch. Raised at once, the
    refusal left its peers waiting in the step's first gather or reduce by sends (point-to-
    point messages, which gloo cannot see as mismatched). Run on the stand-in, this rank
    meets each of the step's collectives; the refusal travels with the loss
    (:meth:`flag`) and every rank raises it (:meth:`raise_if`) before anything is
    donated or applied."""

    def __init__(self, batch: Any, microbatches: int, check: BatchCheck) -> None:
        self.check = check  # the model axis's check of the batch (a tensor group's)
        self.why: str | None = None
        try:
            self.parts = split_microbatches(batch, microbatches)
        except ValueError as e:  # too few rows (a leaf without a batch dim: TypeError)
            if microbatches < 1:  # the same on every rank: raised at once
                raise
            self.why = str(e)
            self.parts = [batch] * microbatches

    def flag(self, losses: list[torch.Tensor]) -> float:
        """The check's flag (see :class:`~funcshard.parallel.axis.BatchCheck`) with this
        rank's refusal added: what rides with the loss, summed over the world."""
        other = self.check.flag(losses)
        return (other or 0.0) + (_REFUSED if self.why is not None else 0.0)

    def raise_if(self, flags: float, group: Any) -> None:
        """ValueError on every rank of ``group`` where any rank refused its batch, naming
        each with why (one all-gather of them, only then); else the check's verdict
        (``flags``, the world's sum of :meth:`flag`)."""
        if flags < _REFUSED:
            self.check.raise_if(flags)
            return
        told: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(told, (dist.get_rank(), self.why), group=group)
        lines = "; ".join(f"rank {rank}: {why}" for rank, why in told if why is not None)
        raise ValueError(
            f"train_step: a batch could not be split into microbatches ({lines}); every "
            "rank raises it and nothing was applied (give every rank at least as many rows "
            "as microbatches, e.g. drop a ragged last batch)"
        )


def _nonfinite_flags(layout: Layout, grads: list[torch.Tensor]) -> torch.Tensor:
    """Per leaf of the layout, 1.0 where this rank's part of its reduced gradient holds a
    NaN or Inf."""
    flags = torch.zeros(len(layout.leaves), dtype=torch.float32, device=layout.device)
    for bucket, g in zip(layout.buckets, grads, strict=True):
        for index in bucket.leaves:
            spec = layout.leaves[index]
            part = g[spec.offset : spec.offset + spec.shard_numel]
            flags[index] = float(not bool(torch.isfinite(part).all()))
    return flags


def _nonfinite_leaves(layout: Layout, grads: list[torch.Tensor]) -> list[str]:
    """Names of the params whose reduced gradient holds a NaN or Inf on any rank."""
    flags = _nonfinite_flags(layout, grads)
    if layout.dp_size > 1:  # over the world: an expert leaf's rows are not on every shard rank
        world = mesh_lib.world_group(layout.mesh)
        flags = ops.all_reduce(flags, world, axis=ops.Axis.WORLD, kind="metrics")
    return [spec.name for spec, f in zip(layout.leaves, flags.tolist(), strict=True) if f > 0]


def _next_loss_scale(ls: LossScale | None, finite: bool, interval: int) -> LossScale | None:
    if ls is None:
        return None
    if not finite:
        return LossScale(ls.scale / 2, 0)
    if ls.good_steps + 1 >= interval:
        return LossScale(ls.scale * 2, 0)
    return LossScale(ls.scale, ls.good_steps + 1)


def train_step(
    state: TrainState, batch: Any, loss_fn: LossFn, microbatches: int = 1
) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer step on this rank's ``batch``; donates ``state``.

    Like JAX's ``donate_argnums``: the step reuses the buffers of ``state``, so ``state`` and
    every state sharing a buffer with it (``state.replace(...)``, ``fs.tree.map`` copies that
    keep its tensors) raise ``ConsumedStateError`` afterwards. Use the returned state.

    The update uses the mean over data-parallel ranks and microbatches of the gradients of
    ``loss_fn(params, microbatch)``. A step whose gradient is not finite changes nothing but
    the fp16 loss scale: the model's persistent buffers that its forward updated in place
    (BatchNorm's statistics) are put back too. After an applied step they are set to the
    first data-parallel rank's values (``fs.init``'s ``buffers="broadcast"``, the default).

    Returns:
      ``(new_state, metrics)`` with "loss" (global mean), "grad_norm" (global L2 norm of the
      averaged gradient), "nonfinite" (0 or 1), "nonfinite_params" (names, when nonfinite),
      "loss_scale" (fp16 only) and "aux" (the last microbatch's aux, if ``loss_fn`` gives one;
      each ``fs.summed(tensor)`` in it replaced by that tensor summed over the step's
      microbatches and data-parallel ranks, every token counted once, e.g. a router's tokens
      per expert: see :mod:`funcshard.step.summed`).
      A fault-tolerant state (``fs.init(fault_tolerance=...)``) adds "replicas" (the groups
      whose gradients the step averaged), "committed" (0: the quorum broke during the step,
      and the state returned holds the input's values, loss scale included; or the group
      healed) and "healed" (1: this group was behind its peers at the step's quorum, after
      a step of its own was not committed or a checkpoint was restored after ``fs.init``;
      the state returned is the peers', at their step, and nothing was computed or averaged,
      as ``batch`` was built for the step the group left; "loss" and "grad_norm" are NaN).
      Build each batch for the ``state.step`` of the state passed.

    Raises:
      TimeoutError: a fault-tolerant step's quorum did not form in time (too few groups
        alive); the state is unchanged and usable, and the next call asks again.
    """
    layout, guard = state.layout, state.guard
    _check_steppable(state)
    state, skipped = guard.begin(state)  # replica groups: the step starts together, or not
    if skipped is not None:  # the batch was built for a step this group left
        return state, skipped
    buffers = state.buffers
    kept = buffers.snapshot()  # the forward may update them in place: undone if not applied
    try:
        new, metrics, applied = _step(state, batch, loss_fn, microbatches)
    except BaseException:
        buffers.put_back(kept)
        raise
    if applied:  # the same on every rank: the global norm, torchft's commit
        buffers.broadcast(mesh_lib.world_group(layout.mesh), layout.device)
    else:
        buffers.put_back(kept)
    return new, metrics


def _step(
    state: TrainState, batch: Any, loss_fn: LossFn, microbatches: int
) -> tuple[TrainState, dict[str, Any], bool]:
    """The step after its quorum: ``(new state, metrics, whether the update was applied)``."""
    if state.pipeline is not None:
        return _pipeline_step(state, batch, loss_fn, microbatches)
    layout, guard = state.layout, state.guard
    reduction = reduction_of(layout)
    reduction.check_microbatches(layout.dp_size, microbatches)
    ls = state.loss_scale
    scale = (ls.scale if ls is not None else 1.0) / microbatches

    # split -> produce: each microbatch's gradients join the step's sum where it says; the
    # last one's backward (ZeRO-2/3) issues replicate reductions as bucket sums become final
    producer = producer_for(layout.inner, state.master, state.compute, state.compile)
    summed = reduction.microbatch_sum(microbatches)
    replicate = grads_lib.ReplicateAxis(layout, across=guard.across)
    # this rank's part of each sequence, loss_fn attending over the whole (before any collective)
    batch, loss_fn = state.context.apply(batch, loss_fn)
    # checked as passed, before loss_fn sees it; refusals raised below, on every rank
    split = _Split(batch, microbatches, layout.tensor.batch_check(batch, layout.device))
    losses, aux, aux_sums = [], None, None
    for k, mb in enumerate(split.parts):
        last = k == microbatches - 1
        sink = summed.sink(last=last, in_backward=producer.shard_reduced)
        loss, aux, grads = producer.microbatch(
            mb, loss_fn, scale, sink, replicate if last else None
        )
        summed.add(grads)
        losses.append(loss)
        aux_sums = summed_lib.add_summed(aux_sums, aux, first=k == 0)

    # reduce (the rest of it) -> norm/metrics -> update
    grads = grads_lib.reduce_step_grads(
        layout, summed.result(), shard_reduced=producer.shard_reduced, replicate=replicate
    )
    if ls is not None:
        torch._foreach_mul_(grads, 1.0 / ls.scale)
    norm = float(reduction.global_norm(layout, grads))
    finite = math.isfinite(norm)
    # the fs.summed leaves' shapes ride with the loss; their totals follow once all agree
    head = summed_lib.header(aux_sums, layout.device)
    loss, flags, head = reduction.mean_loss(layout, losses, split.flag(losses), head)
    world = mesh_lib.world_group(layout.mesh)
    split.raise_if(flags, world)  # before anything is donated
    summed_lib.check_agreed(aux_sums, head, world)
    totals = _summed_totals(layout, reduction, guard, aux_sums)
    new_ls = _next_loss_scale(ls, finite, layout.policy.loss_scale_growth_interval)
    metrics = _metrics(loss, norm, new_ls, summed_lib.with_totals(aux, aux_sums, totals))
    committed = guard.end(state, metrics)
    if not finite:
        metrics["nonfinite_params"] = _nonfinite_leaves(layout, grads)
    new, applied = _apply(state, grads, norm, new_ls, committed=committed, finite=finite)
    return new, metrics, applied


def _apply(
    state: TrainState,
    grads: list[torch.Tensor],
    norm: float,
    new_ls: LossScale | None,
    *,
    committed: bool,
    finite: bool,
) -> tuple[TrainState, bool]:
    """Donates ``state`` and returns the step's result, and whether the update was applied:
    the input's values (loss scale included) where the step was not committed, only the new
    loss scale where the gradient was not finite, else the optimizer's update."""
    donated = state.donate("train_step")
    if not committed:
        return donated.state(), False
    donated = donated.replace(loss_scale=new_ls)
    if not finite:
        return donated.state(), False
    return offload_lib.apply_update(donated, tuple(grads), threads=None, grad_norm=norm), True


def _summed_totals(
    layout: Layout, reduction: Reduction, guard: Any, aux_sums: Any
) -> torch.Tensor | None:
    """The step's ``fs.summed`` leaves summed over the world, and over the replica groups
    of a fault-tolerant step; None where ``aux`` holds none."""
    flat = summed_lib.flat_sums(aux_sums, layout.device)
    totals = None if flat is None else reduction.sum_over_world(layout, flat)
    return guard.total(totals)


def _pipeline_step(
    state: TrainState, batch: Any, loss_fn: LossFn, microbatches: int
) -> tuple[TrainState, dict[str, Any], bool]:
    """:func:`_step` under a pipeline: torch's schedule gives this rank's stages' summed
    microbatch gradients (:mod:`funcshard.step.pipelined`), reduced over its sub-world as
    ZeRO-0/1's; the loss, the whole model's norm and any stage's failure agreed over every
    rank; then the update (:func:`funcshard.step.update.apply_update`) as without one."""
    layout, run = state.layout, state.pipeline
    run.check_microbatches(microbatches)
    ls = state.loss_scale
    factor = (ls.scale if ls is not None else 1.0) / run.pipe.microbatches
    batch_check = layout.tensor.batch_check(batch, layout.device)  # a tensor group's batch
    sections, loss_sum, error = run.grads(
        layout.inner, state.master, state.compute, batch, loss_fn, factor
    )
    # the verdict travels with the step's agreement (said only where no stage failed: a
    # failed stage's stand-in gives its tensor group other losses)
    apart = f"train_step: {batch_check.why}" if batch_check.flag([loss_sum]) else None
    grads = grads_lib.reduce_step_grads(layout, sections, shard_reduced=False)
    if ls is not None:
        torch._foreach_mul_(grads, 1.0 / ls.scale)
    square = reduction_of(layout).global_norm(layout, grads).double().square()
    loss, norm = run.agree(loss_sum, square, error, layout.dp_size, apart)
    finite = math.isfinite(norm)
    new_ls = _next_loss_scale(ls, finite, layout.policy.loss_scale_growth_interval)
    metrics = _metrics(loss, norm, new_ls, None)
    donated = state.donate("train_step").replace(loss_scale=new_ls)
    if not finite:  # on every rank: the norm is the whole model's, and so are the names
        flags = _nonfinite_flags(layout, grads).tolist()
        local = {spec.name: f for spec, f in zip(layout.leaves, flags, strict=True)}
        metrics["nonfinite_params"] = run.nonfinite(local)
        return donated.state(), metrics, False
    new = offload_lib.apply_update(donated, tuple(grads), threads=None, grad_norm=norm)
    return new, metrics, True


def _check_steppable(state: TrainState) -> None:
    state.check()
    if not state.filled:
        raise RuntimeError(
            "train_step: the state holds no values (built from a meta-device "
            "model); fill it with fs.restore(..., model_only=True) first"
        )
    if meta := state.buffers.on_meta():
        raise RuntimeError(
            f"train_step: the model's buffers {', '.join(map(repr, meta))} are on the meta "
            "device (non-persistent buffers of a meta-device model: no checkpoint holds "
            "them); make them on the model's device before the first step (e.g. "
            "module.register_buffer(name, tensor, persistent=False))"
        )
    every = state.check_replicas_every
    if every and state.step and state.step % every == 0:  # before anything is donated
        check_replicas(state)


def _metrics(loss: float, norm: float, loss_scale: LossScale | None, aux: Any) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "loss": loss,
        "grad_norm": norm,
        "nonfinite": int(not math.isfinite(norm)),
    }
    if loss_scale is not None:
        metrics["loss_scale"] = loss_scale.scale
    if aux is not None:
        metrics["aux"] = aux
    return metrics


def full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor in the model's dtype, on every rank (a collective).

    Tied weights appear under each of their names (as in ``model.state_dict()``), as the
    same tensor. A tensor-parallel parameter comes as its global tensor (plain
    ``torch.Tensor``), gathered over "tensor" too. A pipelined state gives the whole model,
    every stage's parameters gathered over "pipeline" too, in stage order.
    """
    layout = state.layout
    if not state.filled:
        raise RuntimeError("full_params: the state holds no values; restore it first")
    out = {}
    for bucket, m in zip(layout.buckets, state.master, strict=True):
        local = m.to(layout.device, bucket.dtypes.model)
        if local.data_ptr() == m.data_ptr():
            local = local.clone()
        full = params_lib.gather_shards(layout, bucket, local)
        for spec in layout.bucket_leaves(bucket):
            out[spec.name] = shard_lib.full_view(full, spec, layout.over(bucket).shard_size)
    out = {n: layout.tensor.full(n, t) for n, t in out.items()}  # global tensors of local parts
    named = {n: out[n] for n in layout.names}
    named.update({alias: out[name] for alias, name in layout.aliases})
    if state.pipeline is not None:  # every stage's, from its pipeline rank
        named = state.pipeline.whole(named)
    return named
