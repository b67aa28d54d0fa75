"""``plan``: per-rank memory and per-step communication of a configuration, from shapes alone.

The prediction runs the same :func:`funcshard.layout.build.build_layout` that ``fs.init``
runs (same padding, buckets, units and offload choice) on a mesh described by its shape, so
it needs no process group, allocates nothing, and answers for a 70B model on 1024 ranks at once.

Bytes communicated follow the accounting of :mod:`funcshard.distributed.ops`: per rank, the size of
the collective's full buffer (all-gather output, reduce-scatter input, all-reduce tensor); a
group of one rank counts nothing; the scalar reductions of the metrics count under "metrics".
Per step, with ``M`` microbatches, ``Pp`` the padded numel (rows padded to a multiple of the
shard size ``S``), ``R`` the replicate size, ``W`` the world size, ``w`` the bytes of the wire
dtype and ``c`` those of the compute dtype::

    no_shard            all_reduce Pp*w (W > 1)
    optim               reduce_scatter Pp*w, all_reduce Pp/S*w (R > 1), all_gather Pp*c
    optim_grads         reduce_scatter M*Pp*w, all_reduce Pp/S*w (R > 1), all_gather Pp*c
    optim_grads_params  all_gather 2*M*Pp*c, reduce_scatter M*Pp*w, all_reduce Pp/S*w (R > 1)

(reduce-scatter and all-gather only when ``S > 1``). Under HFSDP (``outer_strategy="optim"``,
``Pp`` padded to a multiple of ``R * S``) the all-reduce over "replicate" becomes a
reduce-scatter ``Pp/S*w`` and an all-gather ``Pp/S*c`` over it, once per step, and the norm's
metrics run over every rank ("world"). With ``deterministic=True`` and ``M > 1``
``optim_grads`` and ``optim_grads_params`` reduce-scatter once per step (``Pp*w``): a rank sums
its microbatches first; the tree collectives move and count the same bytes as the ring ones,
and the metrics are all-gathers (the norm's per-row sums, ``S * rows_per_shard * 8``; every
microbatch's loss, ``W * M * 8``). The ZeRO-3 all-gather counts a forward
gather and a backward re-gather of every bucket: a unit is re-gathered whole, the root too
(however optimizer rules, dtypes or offload split it into buckets), so this is exact when every
unit saves one of its params for backward (a Linear weight does), an upper bound otherwise.

The all-gathers move ``param_comm_dtype`` instead of ``c`` when it is set (under HFSDP both
the one over "replicate" and those over "shard": the masters are encoded once and the bytes
move on unchanged; ZeRO-3 keeps the inner shard so, in ``memory.compute``). An 8-bit wire
(grads or params, :mod:`funcshard.comm.codec`) counts its bytes instead of ``numel * w``: per
section of ``L`` elements in ``K`` blocks ``L + 4K`` (a one-element row: 4, no value byte);
its all-reduce over ``n`` ranks counts ``n`` times its largest part.

``fs.optim.muon`` adds the kind "muon" when more than one rank holds the state: per optimizer
call (the device buckets together, each offloaded bucket on its own) the matrices are shared
out between the ``R`` replicas (``W / S``; the world under ``no_shard``) by Newton-Schulz FLOPs.
Within a replica, every rank sends each matrix's owner its rows and the owner sends every rank
its rows of the result, both in bfloat16; a rank counts the inputs of both all-to-alls
(``2 * 2 * (its rows' numel + the numel of the matrices it owns)``). With ``R > 1`` one
all-gather over the replicas then brings each rank its rows of the other shares (``R * 2 *``
the largest share's rows on that rank). Owners differ in load, so the plan gives the busiest
rank's bytes and calls, and ``memory.muon_owner`` the most whole-matrix bytes an owner holds at
once (the matrix being orthogonalized, the next one arriving, the iteration's workspace).

With ``tensor=T`` (a model after ``parallelize_module`` on ``mesh["tensor"]``, or the plain model
and the plan it will be parallelized with, ``tensor_plan=``) every rank holds
its tensor rank's LOCAL shards, sharded over the data-parallel axes as plain parameters (``W``
above is then the data-parallel world, ``world_size / T``); the plan is tensor rank 0's, whose
shards are the largest (``torch.chunk``'s sizes). funcshard's own collectives over "tensor" are
the norm's (metrics: an all-reduce of 8 bytes, deterministic: an all-gather of ``T * 8``), the
batch check's (each rank's loss all-gathered, ``T * 8``; its verdict, 8 bytes, rides with the
loss over the data-parallel world) and,
under ``fs.optim.muon``, each owner's all-gather of a split matrix (its shards padded to the
largest, bfloat16: ``2 * T * ceil(n / T) * the rest``, one call each).

With ``replica_groups=G > 1`` (``fs.FaultTolerance``: G groups, each of ``world_size`` ranks)
every rank also all-reduces each bucket's reduced gradient (its master's numel on the
gradient wire) and the loss across the groups through torchft, counted under the axis
"replicas", and the group's ranks agree on a heal (8 bytes of metrics over "world").

The loss's reduction over "world" also carries ``fs.summed``'s shape header (2 float64 per
rank, every step); the totals of a step whose aux holds ``fs.summed`` leaves take one more
collective of their size (and, fault-tolerant, one across the groups), not counted here.

A model's persistent buffers (BatchNorm's statistics, a router's bias) add, under ``fs.init``'s
``buffers="broadcast"`` and more than one data-parallel rank, one broadcast of their bytes
over "world" after each applied step (kind "buffers").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from funcshard.comm import params as params_lib
from funcshard.comm.wires import wire_for
from funcshard.distributed import dtensor as dt
from funcshard.distributed.dims import MeshDims
from funcshard.distributed.ops import AXES
from funcshard.layout.build import build_layout
from funcshard.layout.layout import ROOT_UNIT, Layout, UnitsArg
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.optim import Optimizer
from funcshard.planner import pipeline as pipeline_lib
from funcshard.planner.buffers import buffer_broadcast
from funcshard.planner.context import add_context_exchange, attention_saved, check_context
from funcshard.planner.experts import (
    Routing,
    add_all_to_all,
    add_expert_row_sums,
    model_table,
    routed_experts,
)
from funcshard.planner.inputs import (
    ShapeMesh,
    ShapesArg,
    mesh_dims,
    transformer_shapes,
    units_from_names,
)
from funcshard.planner.optimizer import muon_exchange, optimizer_state_bytes
from funcshard.planner.replicas import add_replica_groups
from funcshard.planner.report import KINDS, MemoryPlan, Plan, format_bytes
from funcshard.step.compiling import backend_of, unwrapped
from funcshard.step.reduction import reduction_of

__all__ = ["Plan", "MemoryPlan", "plan", "transformer_shapes", "format_bytes"]

_METRIC_BYTES = 8  # one float64 scalar per reduction (loss sum, squared grad norm)
# fs.summed's shape header (funcshard.step.summed.header), carried with the loss every step;
# a step whose aux holds fs.summed leaves then sums them in one more collective (not planned)
SUMMED_HEADER = 2


def _memory(
    layout: Layout, opt: str | Optimizer, device_type: str, microbatches: int, muon_owner: int = 0
) -> MemoryPlan:
    state_bytes = optimizer_state_bytes(opt, layout)
    inner = layout.inner  # compute params and gradients live in it (itself but under HFSDP)
    gathered_compute = layout.hierarchical and layout.replicas > 1
    zero3 = layout.strategy.shards_params
    sharded_grads = not _accumulates_unreduced(layout, microbatches)
    # a deterministic step holds up to log2(M) partial sums of its microbatches
    partials = max(1, microbatches.bit_length() - 1) if layout.deterministic else 1
    master = compute = compute_shard = grads = opt = host = 0
    unit_full: dict[int, int] = {}
    for b, part in zip(layout.buckets, inner.buckets, strict=True):
        S = inner.over(part).shard_size  # an expert bucket's: over its expert index's ranks
        d = b.dtypes
        p_bytes, c_bytes = b.numel * d.master.itemsize, part.numel * d.compute.itemsize
        g_bytes = part.numel * d.grad.itemsize
        on_device = not b.offload or device_type == "cpu"
        # m.to(device, compute) returns m itself (not under HFSDP: a gathered copy)
        same = d.compute == d.master and on_device and not gathered_compute
        if b.offload:
            host += p_bytes + state_bytes[b.index]
        else:
            master += p_bytes
            opt += state_bytes[b.index]
        if zero3:
            if layout.hierarchical:  # the inner shard, kept as it crossed "replicate"
                packed = params_lib.packs_shard(inner, part)
                kept = layout.replicas * params_lib.packed_nbytes(layout, b)
                compute += 0 if same and not packed else kept
            elif b.offload:  # a kept compute shard
                compute += 0 if same else c_bytes
            else:
                compute_shard += 0 if same else c_bytes
            unit_full[b.unit] = unit_full.get(b.unit, 0) + S * c_bytes
        else:
            kept = same and S == 1 and params_lib.param_wire(layout, b) is None  # the master itself
            compute += 0 if kept else S * c_bytes
        grads += g_bytes if sharded_grads else partials * S * g_bytes
        if sharded_grads and b.expert:  # its unreduced sections, held to the end of backward
            grads += S * g_bytes
    gathered = 0
    if zero3 and layout.inner.shard_size > 1:
        others = [v for u, v in unit_full.items() if u != ROOT_UNIT]
        gathered = unit_full.get(ROOT_UNIT, 0) + max(others, default=0)
    return MemoryPlan(master, compute, compute_shard, grads, opt, gathered, host, muon_owner)


def _accumulates_unreduced(layout: Layout, microbatches: int) -> bool:
    """Whether a step keeps full unreduced gradients until after its last microbatch."""
    return not layout.strategy.runs_units or not reduction_of(layout).reduces_each_microbatch(
        microbatches
    )


def _comm(layout: Layout, microbatches: int, replicate: int, world: int, gathers: int = 0):
    """``gathers``: ZeRO-3's all-gathers of a bucket a step (0: a forward and a backward one
    per microbatch)."""
    inner = layout.inner  # gathers and gradients within a replica (itself but under HFSDP)
    M = microbatches
    strategy = layout.strategy
    nbytes = dict.fromkeys(KINDS, 0)
    calls = dict.fromkeys(KINDS, 0)
    by_axis = dict.fromkeys(AXES, 0)

    def add(kind: str, count: int, size: int, axis: str) -> None:
        nbytes[kind] += count * size
        calls[kind] += count
        by_axis[axis] += count * size

    for b, part in zip(layout.buckets, inner.buckets, strict=True):
        # an expert bucket's rows move among the ranks of its expert index only
        S, ranks = inner.over(part).shard_size, layout.over(b).group_mesh.size()
        if not strategy.shards_optim:
            if ranks > 1:
                add("all_reduce", 1, wire_for(layout, b).all_reduce_nbytes(ranks), "world")
            continue
        if S > 1:
            per_mb = not _accumulates_unreduced(layout, M)
            rs = wire_for(inner, part).reduce_scatter_nbytes(S)
            ag = params_lib.all_gather_nbytes(inner, part)
            add("reduce_scatter", M if per_mb else 1, rs, "shard")
            add("all_gather", (gathers or 2 * M) if strategy.shards_params else 1, ag, "shard")
        if replicate > 1 and layout.hierarchical:  # into the masters and back, once a step
            add(
                "reduce_scatter",
                1,
                wire_for(layout, b).reduce_scatter_nbytes(replicate),
                "replicate",
            )
            # the updated masters, packed on the param wire when there is one
            add("all_gather", 1, replicate * params_lib.packed_nbytes(layout, b), "replicate")
        elif replicate > 1:
            add("all_reduce", 1, wire_for(layout, b).all_reduce_nbytes(replicate), "replicate")
    _add_metrics(layout, M, world, gathers, add)
    return nbytes, calls, by_axis


def _add_metrics(layout: Layout, M: int, world: int, gathers: int, add) -> None:
    """A step's metrics (kind "metrics"): the loss, the norm's sums, the tensor group's batch
    check, as :func:`_comm` counts them (``add(kind, count, size, axis)``)."""
    # the norm's sums run over the masters' group (every rank under HFSDP), then over "tensor"
    masters, axis, T = layout.shard_size, layout.shard_axis, layout.tensor.size
    # the batch's verdicts: split or refused, and the tensor group's check (pipelined: in its
    # agreement)
    flag = int(not gathers)
    if T > 1:  # its batch digests (3 words) and losses, all-gathered over "tensor"
        add("metrics", 1, T * 4 * _METRIC_BYTES, "tensor")
    if layout.deterministic:  # all-gathers: every chunk's loss, every row's sum of squares
        if world > 1:  # pipelined: the loss is in the step's agreement (an all-reduce)
            losses = 1 + SUMMED_HEADER if gathers else world * (M + flag + SUMMED_HEADER)
            add("metrics", 1, losses * _METRIC_BYTES, "world")
        expert = lambda s: layout.buckets[s.bucket].expert  # noqa: E731
        if masters > 1:
            rows = sum(s.rows_per_shard for s in layout.leaves if not expert(s))
            add("metrics", 1, masters * rows * _METRIC_BYTES, axis)
        if any(map(expert, layout.leaves)):  # over their expert index's shards, then "expert"
            add_expert_row_sums(layout, expert, add, _METRIC_BYTES)
        if T > 1:  # every tensor rank's part of the square
            add("metrics", 1, T * _METRIC_BYTES, "tensor")
        return
    if world > 1:
        add("metrics", 1, (1 + flag + SUMMED_HEADER) * _METRIC_BYTES, "world")  # the loss
    if masters > 1:
        add("metrics", 1, _METRIC_BYTES, axis)  # the squared gradient norm
    if not layout.strategy.shards_optim and any(b.expert for b in layout.buckets):
        add("metrics", 1, _METRIC_BYTES, "expert")  # its expert ranks' parts (no "shard")
    if T > 1:
        add("metrics", 1, _METRIC_BYTES, "tensor")


def _step_comm(
    layout: Layout,
    optimizer: str | Optimizer,
    microbatches: int,
    dims: MeshDims,
    replica_groups: int,
    routing: Routing | None,
    model: nn.Module | None = None,
    pipelined: bool = False,
) -> tuple[dict[str, dict[str, int]], int]:
    """``({"comm", "calls", "comm_by_axis"}, Muon's owner bytes)``: a step's bytes and calls
    per kind and bytes per axis (in that order): the data-parallel collectives, Muon's
    exchange, the replica groups' all-reduce, the all-to-alls. ``pipelined``: a pipeline
    rank's step (reduced as one microbatch, gathered once)."""
    M, gathers = (1, 1) if pipelined else (microbatches, 0)
    comm, calls, by_axis = _comm(layout, M, dims.replicate, dims.dp_size, gathers)
    comm["muon"], calls["muon"], muon_owner, muon_by_axis = muon_exchange(optimizer, layout)
    for axis, nbytes in muon_by_axis.items():
        by_axis[axis] += nbytes
    add_replica_groups(layout, replica_groups, dims.world, comm, calls, by_axis)
    counts = routed_experts(model, routing)
    add_all_to_all(dims.expert, routing, microbatches, comm, calls, by_axis, counts)
    return dict(comm=comm, calls=calls, comm_by_axis=by_axis), muon_owner


def _traffic(step: tuple, pp: Any, ex: tuple, buffers: str) -> tuple[dict, int]:
    """:func:`_step_comm` (``step``: its arguments but ``pipelined``, which ``pp`` gives) with
    the context axis's exchange (``ex``: :func:`add_context_exchange`'s arguments) and the
    buffers' broadcast."""
    traffic, muon_owner = _step_comm(*step, bool(pp))
    dims, model = step[3], step[6]
    add_context_exchange(dims.context, *ex, *traffic.values())
    buffer_broadcast(model, buffers, dims.dp_size, *traffic.values(), pp)
    return traffic, muon_owner


def _plan_layout(
    tables,
    model,
    dims,
    replicate,
    policy,
    strategy,
    offload_fraction,
    units,
    optimizer,
    deterministic,
    outer_strategy,
) -> Layout:
    """The layout ``fs.init`` would build for these arguments, on a mesh of shapes alone
    (parameters sharded over shard x context); ``tables`` is what ``model_table`` gives."""
    table, tp, expert_mesh = tables
    return build_layout(
        table,
        model=model,
        mesh=ShapeMesh(replicate, dims.shard * dims.context),  # type: ignore[arg-type]
        policy=policy or MixedPrecisionPolicy(),
        strategy=strategy,
        offload_fraction=offload_fraction,
        units=units_from_names(list(table)) if model is None and units is None else units,
        partition=None if isinstance(optimizer, str) else optimizer.partition,
        deterministic=deterministic,
        outer_strategy=outer_strategy,
        tensor=tp,
        expert_mesh=expert_mesh,
    )


def plan(
    params: ShapesArg,
    /,
    *,
    world_size: int,
    shard: int = -1,
    replicate: int = 1,
    strategy: str | Strategy = "optim_grads_params",
    policy: MixedPrecisionPolicy | None = None,
    offload_fraction: float = 0.0,
    microbatches: int = 1,
    optimizer: str | Optimizer = "adamw",
    units: UnitsArg = None,
    dtype: torch.dtype = torch.float32,
    device_type: str = "cuda",
    deterministic: bool = False,
    outer_strategy: str | OuterStrategy = "no_shard",
    tensor: int = 1,
    tensor_plan: Mapping[str, dt.ParallelStyle] | None = None,
    replica_groups: int = 1,
    expert: int = 1,
    routing: Routing | None = None,
    context: int = 1,
    seq_len: int | None = None,
    batch_size: int | None = None,
    attention: tuple[int, int, int] | None = None,
    context_algorithm: str = "all_to_all",
    context_load_balance: bool = True,
    buffers: str = "broadcast",
    pipeline: int = 1,
    schedule: str = "1F1B",
    split: Sequence[str] | None = None,
    pipeline_rank: int = 0,
    boundary: Sequence[int] | None = None,
    compile: bool | str = False,
    regather: bool = False,
    inputs: object = None,
) -> Plan:
    """Predicts per-rank bytes and per-step communication without running anything.

    Args:
      params: ``{name: shape}`` or ``{name: (shape, dtype)}`` in ``named_parameters`` order,
        or a model (a meta-device one is fine; a ``torch.compile(model)`` wrapper is read as
        the model inside it, as ``fs.init`` reads it).
      world_size: ranks in the world (``shard * replicate * tensor``).
      shard: ranks per shard group; -1 means ``world_size // (replicate * tensor)`` (as
        ``make_mesh``).
      replicate: replicas (HSDP when > 1).
      strategy: as in ``fs.init``.
      policy: as in ``fs.init``; None = the default policy.
      offload_fraction: as in ``fs.init``.
      microbatches: as in ``fs.train_step``.
      optimizer: "adamw" (2 states), "sgd_momentum" (1), "sgd" (0), or an ``fs.optim``
        optimizer (its states are counted per bucket, its rules split buckets as in
        ``fs.init``, and Muon's exchange is predicted).
      units: as in ``fs.init``; None = the model's default units, or for a shape dict every
        name prefix that ends in a number ("layers.3").
      dtype: the model dtype of shape-only entries.
      device_type: where the state lives; on "cpu" an offloaded master is also the device's.
      deterministic: as in ``fs.init`` (its reductions and gradient accumulation).
      outer_strategy: as in ``fs.init`` ("optim": HFSDP, masters and optimizer state over
        replicate x shard, a reduce-scatter and an all-gather over "replicate" per step).
      tensor: ranks per tensor-parallel group (``make_mesh(tensor=T)``): ``params`` is then the
        model after ``parallelize_module`` on ``mesh["tensor"]``, planned with tensor rank 0's
        local shards (the module docstring), or the plain model with ``tensor_plan``.
      tensor_plan: with the plain (e.g. meta-device) model and ``tensor=T``, the plan the
        model will be parallelized with (``parallelize_module``'s dict plan, keys relative to
        the model, ``*`` per name component): planned as that model, without a process group.
      replica_groups: replica groups of a fault-tolerant run (``fs.FaultTolerance``), each
        of ``world_size`` ranks: more than one adds their all-reduce through torchft under
        the axis "replicas" (each bucket's reduced gradient shard, on ``grad_comm_dtype``,
        main grads for an 8-bit wire; the loss under "metrics") and the group's heal
        agreement (8 bytes of metrics over "world").
      expert, routing: ``make_mesh(expert=E)``'s degree (experts planned global, as ``fs.init``
        holds them); a :class:`~funcshard.planner.experts.Routing`: its all-to-alls, "expert"
        (the rows, and the counts ``fs.ExpertParallel`` exchanges before each dispatch).
      context, seq_len, batch_size, attention, context_algorithm, context_load_balance:
        ``make_mesh(context=C)``'s degree (parameters then sharded over shard x context:
        ``Plan.shard`` is that group's size), the sequence length, the rows each rank
        passes to ``train_step``, the attention ``(calls, heads, head_dim)`` of one forward
        and ``fs.ContextParallel``'s algorithm: the attention exchange under "context"
        (:mod:`funcshard.planner.context`; in the compute dtype; the ring's k, v gradients
        in fp32), and what attention keeps for the backward per rank
        (``MemoryPlan.attention``); ``context_load_balance`` as
        ``fs.ContextParallel(load_balance=)`` (seq_len divisible by 2C, else by C).
      buffers: as in ``fs.init``: under "broadcast" a model's persistent buffers add one
        broadcast of their bytes over "world" a step (kind "buffers"), with more than one
        data-parallel rank.
      pipeline, schedule, split, pipeline_rank, boundary: ``make_mesh(pipeline=P)``'s degree,
        ``fs.Pipeline``'s schedule (its microbatches are ``microbatches``), the split points
        of ``fs.pipeline.split`` (or ``params`` the list of stages), the pipeline rank to plan
        (its stages over its ``world_size / P`` data-parallel ranks) and the shape of the
        tensor a stage hands the next for one step of this rank's local batch (rows first,
        in the compute dtype): bytes under "pipeline", ``memory.activations`` and
        ``Plan.pipeline`` (:mod:`funcshard.planner.pipeline`).
      regather, inputs: ``fs.Pipeline(regather=)`` and, under ZeRO-3 with it True, this
        rank's local batch inputs (``train_step``'s ``batch[0]``: a tensor or tuple of
        tensors; meta-device ones do, only shapes and dtypes are read): a steady step's
        all-gathers (per microbatch in forward, again in backward for the buckets a stage's
        forward saved a tensor of, and in the zero-bubble schedules' weight backward) and
        ``memory.gathered_peak`` (a stage's buckets), found by running this rank's stages on
        the meta device (:mod:`funcshard.planner.regather`; ``Plan.pipeline.exact`` False
        where one cannot run there). The first step's shape inference gathers more. Under
        any strategy ``inputs=`` weighs the bubble by each stage's FLOPs, run on the meta
        device (:mod:`funcshard.planner.stage_cost`; ``Plan.pipeline.bubble_model``).
      compile: as in ``fs.init`` (checked as it checks it): under ZeRO-2/3 the captured step,
        planned as its graphs move and hold, which is eager's: each bucket's all-gather in
        forward and again in backward (recomputed, not saved), a reduce-scatter per bucket,
        and ``memory.gathered_peak`` the root unit plus the largest other unit (the graphs
        gather each unit at its first use and drop it after its last). A bucket whose params
        the backward never reads (biases alone, as an optimizer's or the offload's split of a
        unit may leave) is planned re-gathered, as eager re-gathers it; the captured backward
        does not: there the plan's bytes and ``gathered_peak`` are upper bounds of the
        captured step's. Inductor re-gathers too (docs/strategies.md);
        with a param wire the captured step's ``gathered_peak`` counts the decoded params, as
        eager's and this plan's do.

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: ``tensor=T > 1`` with a model that holds no DTensor parameter and no
        ``tensor_plan`` (it would plan every parameter as replicated), with a table of shapes,
        or with DTensors on a mesh of another size; ``tensor_plan`` with a parallelized model
        or ``tensor=1``; a mesh whose sizes do not multiply to ``world_size``; ``expert=E >
        1`` with a table of shapes or a model none of whose parameters is an expert DTensor
        (its experts would be planned as dense weights).

    >>> p = plan({"w": (10, 4)}, world_size=4, strategy="optim", optimizer="sgd")
    >>> p.padded_numel, p.memory.master, p.comm["reduce_scatter"]
    (48, 48, 192)
    """
    params = unwrapped(params)  # torch.compile(model): the plain model's names, as fs.init
    backend_of(compile, deterministic=deterministic)  # its errors, as fs.init's
    pp = pipeline_lib.setup(params, split, pipeline, schedule, microbatches, pipeline_rank,
                            world_size, (context, replica_groups), (regather, inputs))  # fmt: skip
    params, dp = (pp.model if pp else params), world_size // pipeline  # this rank's stages
    dims = mesh_dims(dp, shard, replicate, microbatches, tensor, expert, context)
    pipeline_lib.check_hfsdp(pp, outer_strategy, replicate, dims.shard)
    check_context(context, context_algorithm, seq_len, attention, context_load_balance)
    model = params if isinstance(params, nn.Module) else None
    table = model_table(params, dtype, tensor, tensor_plan, dims, strategy)
    choices = (policy, strategy, offload_fraction, units, optimizer, deterministic, outer_strategy)
    layout = _plan_layout(table, model, dims, replicate, *choices)
    ex = (context_algorithm, seq_len, batch_size, attention, _itemsize(policy, dtype), microbatches)
    step = (layout, optimizer, microbatches, dims, replica_groups, routing, model)
    traffic, muon_owner = _traffic(step, pp, ex, buffers)
    memory = _memory(layout, optimizer, device_type, microbatches, muon_owner)
    memory = dataclasses.replace(memory, attention=attention_saved(dims.context, *ex[1:]))
    memory, piped = pipeline_lib.finish(pp, layout, memory, (boundary, ex[4]), traffic)
    geometry = _geometry(layout, world_size, dims, replicate, microbatches, tensor)
    return Plan(**geometry, **traffic, memory=memory, pipeline=piped)


def _itemsize(policy: MixedPrecisionPolicy | None, dtype: torch.dtype) -> int:
    """Bytes of one element in the compute dtype."""
    return ((policy and policy.param_dtype) or dtype).itemsize


def _geometry(
    layout: Layout, world_size: int, dims: MeshDims, replicate: int, microbatches: int, tensor: int
) -> dict[str, object]:
    """The fields of a :class:`Plan` that the layout's shape alone gives."""
    return {
        "strategy": layout.strategy,
        "world_size": world_size,
        "shard": dims.shard * dims.context,
        "replicate": replicate,
        "microbatches": microbatches,
        "numel": sum(math.prod(s.shape) for s in layout.leaves),
        "padded_numel": sum(layout.over(b).shard_size * b.numel for b in layout.buckets),
        "buckets": len(layout.buckets),
        "units": len(layout.units),
        "outer_strategy": str(layout.outer),
        "tensor": tensor,
    }
