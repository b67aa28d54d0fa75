"""``train_step``: gather, grad, ``reduce_scatter_grads``, ``offload_step``, in that order."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch

from funcshard import collectives, determinism
from funcshard import mesh as mesh_lib
from funcshard import offload as offload_lib
from funcshard import reduce as reduce_lib
from funcshard import sharding as shard_lib
from funcshard.functional import StepParams
from funcshard.layout import Layout
from funcshard.state import LossScale, TrainState
from funcshard.units import UnitRun

__all__ = ["train_step", "full_params", "split_microbatches"]

LossFn = Callable[[Any, Any], Any]


def split_microbatches(batch: Any, microbatches: int) -> list[Any]:
    """Splits every tensor of ``batch`` on dim 0 into ``microbatches`` nearly equal parts."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    leaves, treedef = optree.tree_flatten(batch)
    for path, leaf in zip(optree.tree_paths(batch), leaves, strict=True):
        path = "/".join(map(str, path)) or "<batch>"
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


def _loss_and_aux(out: Any) -> tuple[torch.Tensor, Any]:
    loss, aux = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor or (loss, aux); got {type(loss)}")
    return loss.reshape(()), aux


def _compute_shards(layout: Layout, state: TrainState) -> list[torch.Tensor]:
    """ZeRO-3: the compute-dtype shards to gather, cast from the masters once per step."""
    return [
        c if c is not None else m.to(layout.device, b.dtypes.compute)
        for b, m, c in zip(layout.buckets, state.master, state.compute, strict=True)
    ]


def _sharded_grads(
    layout: Layout,
    buffers: Any,
    batch: Any,
    loss_fn: LossFn,
    scale: float,
    acc: list[torch.Tensor | None] | None,
    *,
    local: bool = False,
    complete: determinism.PairwiseSum | None = None,
):
    """ZeRO-2/3: adds this rank's gradient shards, reduced over "shard", into ``acc``; with
    ``local`` its unreduced rank sections instead (a deterministic step's microbatch); with
    ``complete`` (a deterministic step's last microbatch) the shards of the microbatches' tree
    completed bucket by bucket as backward goes."""
    run = UnitRun(
        layout,
        buffers,
        replicated=layout.strategy == "optim_grads",
        acc=acc,
        local=local,
        complete=complete,
    )
    try:
        loss, aux = _loss_and_aux(loss_fn(run.params, batch))
        return loss.detach(), aux, run.reducer.backward(loss * scale)
    finally:
        run.close()


def _replicated_grads(
    layout: Layout,
    compute: tuple[torch.Tensor, ...],
    batch: Any,
    loss_fn: LossFn,
    scale: float,
    acc: list[torch.Tensor] | None,
):
    """ZeRO-0/1: adds this rank's unreduced full gradients (rank sections) into ``acc``."""
    S = layout.shard_size
    params, order = {}, []
    for bucket, full in zip(layout.buckets, compute, strict=True):
        for spec in layout.bucket_leaves(bucket):
            params[spec.name] = shard_lib.full_view(full, spec, S).detach().requires_grad_()
            order.append(spec.name)
    step_params = StepParams((n, params[n]) for n in layout.names)
    try:
        loss, aux = _loss_and_aux(loss_fn(step_params, batch))
        grads = dict(
            zip(
                order,
                torch.autograd.grad(loss * scale, [params[n] for n in order], allow_unused=True),
                strict=True,
            )
        )
    finally:
        step_params.close()
    out = []
    for i, bucket in enumerate(layout.buckets):
        specs = layout.bucket_leaves(bucket)
        bucket_grads = [grads[s.name] for s in specs]
        if acc is None:
            out.append(
                shard_lib.to_rank_sections(
                    bucket_grads, specs, S, bucket.dtypes.grad, layout.device
                )
            )
        else:  # a later microbatch: straight into the accumulator, no sections built
            shard_lib.add_to_rank_sections(acc[i], bucket_grads, specs, S)
            out.append(acc[i])
    return loss.detach(), aux, out


def _mean_loss(layout: Layout, losses: list[torch.Tensor]) -> float:
    """The mean over every rank's microbatch losses."""
    world = mesh_lib.world_group(layout.mesh)
    if layout.deterministic:
        return determinism.mean_loss(layout, losses, world)
    total = torch.stack([loss.double() for loss in losses]).sum()
    return float(collectives.all_reduce(total, world, kind="metrics")) / (
        len(losses) * layout.dp_size
    )


def _nonfinite_leaves(layout: Layout, grads: list[torch.Tensor]) -> list[str]:
    """Names of the params whose reduced gradient holds a NaN or Inf on any rank."""
    flags = torch.zeros(len(layout.leaves), dtype=torch.float32, device=layout.device)
    for bucket, g in zip(layout.buckets, grads, strict=True):
        for index in bucket.leaves:
            spec = layout.leaves[index]
            part = g[spec.offset : spec.offset + spec.shard_numel]
            flags[index] = float(not bool(torch.isfinite(part).all()))
    if layout.shard_size > 1:
        flags = collectives.all_reduce(flags, layout.shard_group, kind="metrics")
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
    the fp16 loss scale.

    Returns:
      ``(new_state, metrics)`` with "loss" (global mean), "grad_norm" (global L2 norm of the
      averaged gradient), "nonfinite" (0 or 1), "nonfinite_params" (names, when nonfinite),
      "loss_scale" (fp16 only) and "aux" (the last microbatch's aux, if ``loss_fn`` gives one).
    """
    layout = state.layout
    state._check()
    if not state.filled:
        raise RuntimeError(
            "train_step: the state holds no values (built from a meta-device "
            "model); fill it with fs.restore(..., model_only=True) first"
        )
    zero3 = layout.strategy == "optim_grads_params"
    det = layout.deterministic
    if det:
        determinism.check_microbatches(layout.dp_size, microbatches)
    units = layout.strategy in ("optim_grads", "optim_grads_params")
    ls = state.loss_scale
    scale = (ls.scale if ls is not None else 1.0) / microbatches
    if units:
        params = _compute_shards(layout, state) if zero3 else state.compute
    else:
        params = state.compute

    # A deterministic step sums a rank's microbatches before any rank's (the chunk tree's
    # lowest levels): microbatches keep their unreduced sections in a pairwise tree. Under
    # ZeRO-2/3 the last one completes the tree bucket by bucket and starts each bucket's
    # reduce-scatter as backward goes; under ZeRO-0/1 the tree is reduced after it.
    tree = determinism.PairwiseSum() if det and microbatches > 1 else None
    acc, losses, aux = None, [], None
    parts = split_microbatches(batch, microbatches)
    for k, mb in enumerate(parts):
        if not units:
            loss, aux, out = _replicated_grads(
                layout, params, mb, loss_fn, scale, None if tree is not None else acc
            )
        elif tree is None:
            loss, aux, out = _sharded_grads(layout, params, mb, loss_fn, scale, acc)
        elif k < len(parts) - 1:
            loss, aux, out = _sharded_grads(layout, params, mb, loss_fn, scale, None, local=True)
        else:
            loss, aux, out = _sharded_grads(layout, params, mb, loss_fn, scale, None, complete=tree)
            tree = None  # consumed: out holds the reduced shards
        if tree is not None:
            tree.add(out)
        else:
            acc = out
        losses.append(loss)
    if tree is not None:
        acc = tree.result()
    # ZeRO-2/3 reduced over the shard axis as backward went; ZeRO-0/1 hold rank sections.
    reduced = units
    acc = [
        g
        if g is not None
        # no gradient reached the bucket
        else torch.zeros(
            b.numel * (1 if reduced else layout.shard_size),
            dtype=b.dtypes.grad,
            device=layout.device,
        )
        for g, b in zip(acc, layout.buckets, strict=True)
    ]
    if not reduced:
        acc = [
            reduce_lib.reduce_shard_axis(layout, b, g)
            for b, g in zip(layout.buckets, acc, strict=True)
        ]
    acc = [
        reduce_lib.reduce_replicate_axis(layout, b, g)
        for b, g in zip(layout.buckets, acc, strict=True)
    ]
    if ls is not None:
        torch._foreach_mul_(acc, 1.0 / ls.scale)

    norm = float(reduce_lib.global_norm(layout, acc))
    finite = math.isfinite(norm)
    metrics: dict[str, Any] = {
        "loss": _mean_loss(layout, losses),
        "grad_norm": norm,
        "nonfinite": int(not finite),
    }
    new_ls = _next_loss_scale(ls, finite, layout.policy.loss_scale_growth_interval)
    if new_ls is not None:
        metrics["loss_scale"] = new_ls.scale
    if aux is not None:
        metrics["aux"] = aux
    if not finite:
        metrics["nonfinite_params"] = _nonfinite_leaves(layout, acc)
        return state._donate("train_step", loss_scale=new_ls), metrics
    new_state = offload_lib.step_donating(
        state, tuple(acc), threads=None, grad_norm=norm, consumer="train_step"
    )
    return new_state.replace(loss_scale=new_ls), metrics


def full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor in the model's dtype, on every rank (a collective).

    Tied weights appear under each of their names (as in ``model.state_dict()``), as the
    same tensor.
    """
    layout = state.layout
    if not state.filled:
        raise RuntimeError("full_params: the state holds no values; restore it first")
    out = {}
    for bucket, m in zip(layout.buckets, state.master, strict=True):
        local = m.to(layout.device, bucket.dtypes.model)
        if local.data_ptr() == m.data_ptr():
            local = local.clone()
        full = shard_lib.gather_full(layout, bucket, local)
        for spec in layout.bucket_leaves(bucket):
            out[spec.name] = shard_lib.full_view(full, spec, layout.shard_size)
    named = {n: out[n] for n in layout.names}
    named.update({alias: out[name] for alias, name in layout.aliases})
    return named
