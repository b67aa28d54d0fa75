"""The pipeline axis in a plan (``fs.plan(..., pipeline=P, schedule=, microbatches=, split=)``).

A plan under a pipeline is one pipeline rank's (``pipeline_rank``, 0 by default): its stages
(the schedule's placement, as ``fs.init`` keeps them) merged and planned over its
data-parallel sub-world of ``world_size / P`` ranks, plus what the schedule adds:

* bytes under "pipeline" (kind "send"), as ``fs.comm_stats`` counts them: per stage of this
  rank, one step's boundary tensor (``boundary=``, the local batch's rows) to the next stage
  and its gradient back to the previous one, where that stage is on another rank; a
  boundary inside one rank counts nothing. Calls: one per microbatch and crossing.
* the schedule's order, in flight microbatches and bubble (:mod:`funcshard.planner.schedule`),
  the bubble with each stage's FLOPs where ``inputs=`` is given
  (:mod:`funcshard.planner.stage_cost`), else with equal stages.

The step's own collectives are those of a ZeRO-0/1 step of one microbatch over the
sub-world (the gradients reduced once a step, ZeRO-3's parameters gathered once a step, or
per microbatch under ``regather=True``: :mod:`funcshard.planner.regather`;
``deterministic=True``: the norm's row sums all-gathered as without a pipeline; HFSDP: the
reduce-scatter over "replicate" and the masters' all-gather), and the step's agreements
over every rank ("world", kind "metrics"): before the schedule one all-reduce of 5 float64
(a rank refused its batch; the batch's shapes alike on every rank), after it one of 3
float64 (the loss, the squared norm, a failure flag).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from funcshard.comm import params as params_lib
from funcshard.layout.strategy import OuterStrategy
from funcshard.parallel.pipeline import Pipeline, check_stages
from funcshard.parallel.pipeline_split import merge, split
from funcshard.planner.regather import regathers
from funcshard.planner.report import PipelinePlan
from funcshard.planner.schedule import Action, Timeline, schedule_order, simulate
from funcshard.planner.stage_cost import StageCost, stage_costs

__all__ = [
    "Action",
    "Timeline",
    "schedule_order",
    "simulate",
    "rank_model",
    "add_pipeline_step",
    "AGREEMENT_BYTES",
    "BATCH_CHECK_BYTES",
    "Setup",
    "setup",
    "finish",
    "edge_bytes",
    "check_hfsdp",
]

AGREEMENT_BYTES = 3 * 8  # the step's agreement: loss, squared norm, failure flag (float64)
BATCH_CHECK_BYTES = 5 * 8  # before the schedule (max): a refusal, the shapes' digest, negated


def rank_model(
    params: Any, split_points: Sequence[str] | None, pipe: Pipeline, pipeline: int, rank: int
) -> tuple[nn.Module, list[nn.Module], tuple[int, ...]]:
    """``(this rank's stages merged, every stage, its stage indices)`` for a model and split
    points, or a list of stages.

    Raises:
      ValueError: no split for a model, a split with a list of stages, a rank outside ``[0,
        P)``, a stage count the schedule cannot place, a name in two stages.
    """
    if not 0 <= rank < pipeline:
        raise ValueError(f"plan: pipeline_rank={rank} is not in [0, pipeline={pipeline})")
    if isinstance(params, (list, tuple)):
        if split_points is not None:
            raise ValueError("plan: split= with a list of stages; pass the model or the stages")
        stages = list(params)
    elif isinstance(params, nn.Module):
        if split_points is None:
            raise ValueError(
                f"plan: pipeline={pipeline} needs split= (fs.pipeline.split's split points) "
                "or the list of stages"
            )
        stages = split(params, list(split_points))
    else:
        raise ValueError("plan: pipeline= needs a model (with split=) or its list of stages")
    check_stages(stages, pipe, pipeline)
    mine = pipe.stages_of(rank, pipeline, len(stages))
    return merge([stages[i] for i in mine]), stages, mine


def add_pipeline_step(
    pipe: Pipeline,
    mine: tuple[int, ...],
    stages: int,
    pipeline: int,
    boundary_bytes: int,
    dp_size: int,
    comm: dict[str, int],
    calls: dict[str, int],
    by_axis: dict[str, int],
) -> None:
    """Adds this rank's sends under "pipeline" (``boundary_bytes``: one microbatch's
    boundary tensor) and the step's agreement over "world" (which a data-parallel step of
    one rank does not already count)."""
    rank_of = {i: r for r in range(pipeline) for i in pipe.stages_of(r, pipeline, stages)}
    crossings = sum(
        (i + 1 < stages and rank_of[i + 1] != rank_of[i]) + (i > 0 and rank_of[i - 1] != rank_of[i])
        for i in mine
    )
    M = pipe.microbatches
    comm["send"] = comm.get("send", 0) + crossings * M * boundary_bytes
    calls["send"] = calls.get("send", 0) + crossings * M * bool(boundary_bytes)
    by_axis["pipeline"] = by_axis.get("pipeline", 0) + crossings * M * boundary_bytes
    if dp_size == 1:  # a data-parallel world of several ranks counts its loss's 24 bytes
        comm["metrics"] += AGREEMENT_BYTES
        calls["metrics"] += 1
        by_axis["world"] += AGREEMENT_BYTES
    comm["metrics"] += BATCH_CHECK_BYTES
    calls["metrics"] += 1
    by_axis["world"] += BATCH_CHECK_BYTES


class Setup(NamedTuple):
    """A plan's pipeline, read before its layout: this rank's stages merged (the model to
    plan), the schedule, every stage and this rank's indices, and ``inputs=`` (what
    ``regather=True`` runs the stages on)."""

    model: nn.Module
    pipe: Pipeline
    stages: list[nn.Module]
    mine: tuple[int, ...]
    rank: int
    size: int
    inputs: Any = None


def setup(
    params: Any,
    split_points: Sequence[str] | None,
    pipeline: int,
    schedule: str,
    microbatches: int,
    rank: int,
    world_size: int,
    refused: tuple,
    regather: tuple[bool, Any] = (False, None),
) -> Setup | None:
    """The plan's :class:`Setup` (None for ``pipeline=1``); ``regather``: ``fs.Pipeline``'s
    ``regather`` and ``inputs=``.

    Raises:
      ValueError: ``world_size`` not a multiple of ``pipeline``; an argument ``fs.init``
        refuses under a pipeline (``refused``: :func:`_refused`'s arguments); what
        :func:`rank_model` refuses; microbatches torch's schedule refuses.
    """
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1:
        raise ValueError(f"plan: pipeline must be an int >= 1, got {pipeline!r}")
    if pipeline == 1:
        for name, value in (("split", split_points), ("regather", regather[0] or None)):
            if value is not None:
                raise ValueError(f"plan: {name}= without pipeline=P > 1")
        return None
    if world_size % pipeline:
        raise ValueError(f"plan: world_size={world_size} is not a multiple of pipeline={pipeline}")
    for name, value in _refused(*refused).items():
        if value:
            raise ValueError(
                f"plan: pipeline={pipeline} with {name}={value!r} is not supported (fs.init "
                "refuses it under a pipeline)"
            )
    pipe = Pipeline(schedule, microbatches=microbatches, regather=bool(regather[0]))
    model, stages, mine = rank_model(params, split_points, pipe, pipeline, rank)
    schedule_order(schedule, pipeline, microbatches, len(stages) // pipeline)  # torch's checks
    return Setup(model, pipe, stages, mine, rank, pipeline, regather[1])


def finish(
    s: Setup | None, layout: Any, memory: Any, boundary: tuple, traffic: dict
) -> tuple[Any, PipelinePlan | None]:
    """``(memory, pipeline plan)`` (``(memory, None)`` without a pipeline); ``boundary``:
    ``(plan's boundary=, the compute dtype's itemsize)``. The step's sends and agreement
    added to the bytes, the memory made a pipeline rank's (:func:`_rank_memory`), the
    bubble that of each stage's FLOPs where ``inputs=`` is given (:func:`_timeline`)."""
    if s is None:
        return memory, None
    boundary_bytes = edge_bytes(boundary[0], s.pipe.microbatches, boundary[1])
    n = len(s.stages)
    comm, calls, by_axis = traffic["comm"], traffic["calls"], traffic["comm_by_axis"]
    dp_size = layout.dp_size
    add_pipeline_step(s.pipe, s.mine, n, s.size, boundary_bytes, dp_size, comm, calls, by_axis)
    order = schedule_order(s.pipe.schedule, s.size, s.pipe.microbatches, n // s.size)
    timeline, costs, why = _timeline(s, order, layout.policy)
    active = timeline.in_flight[s.rank] * boundary_bytes
    memory, note = _rank_memory(s, layout, memory, order[s.rank], traffic, active)
    return memory, PipelinePlan(
        s.pipe.schedule,
        s.size,
        s.rank,
        s.mine,
        s.pipe.microbatches,
        timeline.bubble,
        timeline.bubble_by_rank,
        timeline.in_flight,
        boundary_bytes,
        s.pipe.regather,
        not note,
        note,
        "flops" if costs else "equal",
        costs,
        why,
    )


def _timeline(
    s: Setup, order: dict[int, list[Action]], policy: Any
) -> tuple[Timeline, tuple[StageCost, ...], str]:
    """``order`` simulated with each stage's FLOPs where ``inputs=`` is given
    (:func:`~funcshard.planner.stage_cost.stage_costs`), else with equal stages: ``(its
    timeline, the stages' costs (() for equal ones), why equal ones stand in for inputs=)``."""
    costs, why = (), ""
    if s.inputs is not None:
        split = any(a.kind in "IW" for actions in order.values() for a in actions)
        costs, why = stage_costs(s.stages, policy, s.inputs, s.pipe.microbatches, split)
    return simulate(order, len(s.stages), costs or None), costs, why


def _rank_memory(
    s: Setup, layout: Any, memory: Any, actions: list[Action], traffic: dict, active: int
) -> tuple[Any, str]:
    """``(memory, regather's note)``: the memory's gradients (every bucket's full unreduced
    sections: the stages' leaves hold the step's sum), ZeRO-3's gathered peak (every bucket
    at once: gathered once a step; the largest stage's under ``regather=True``, its gathers
    counted by :func:`_regather`) and the in-flight activations (``active``: this rank's
    peak microbatches in flight x one microbatch's boundary bytes)."""
    inner = layout.inner
    full = [inner.over(p).shard_size * p.numel for p in inner.buckets]
    grads = sum(f * b.dtypes.grad.itemsize for f, b in zip(full, layout.buckets, strict=True))
    gathered, note = memory.gathered_peak, ""
    if layout.strategy.shards_params and inner.shard_size > 1:
        gathered = sum(
            f * b.dtypes.compute.itemsize for f, b in zip(full, layout.buckets, strict=True)
        )
        if s.pipe.regather:
            gathered, note = _regather(s, inner, actions, traffic)
    memory = dataclasses.replace(memory, grads=grads, gathered_peak=gathered, activations=active)
    return memory, note


def _regather(s: Setup, inner: Any, actions: list[Action], traffic: dict) -> tuple[int, str]:
    """ZeRO-3 under ``regather=True``: each bucket's once-a-step all-gather (counted by the
    step's collectives) made the steady step's count of them
    (:func:`funcshard.planner.regather.regathers`, which raises where ``inputs=`` is
    missing or wrong); ``(gathered peak, note)``."""
    rg = regathers(s.stages, s.mine, inner, s.inputs, s.pipe.microbatches, actions)
    for index, bucket in enumerate(inner.buckets):
        if inner.over(bucket).shard_size > 1:
            more = rg.counts[index] - 1
            nbytes = more * params_lib.all_gather_nbytes(inner, bucket)
            traffic["comm"]["all_gather"] += nbytes
            traffic["calls"]["all_gather"] += more
            traffic["comm_by_axis"]["shard"] += nbytes
    return rg.peak, rg.note


def edge_bytes(boundary: Sequence[int] | None, microbatches: int, itemsize: int) -> int:
    """One microbatch's boundary tensor in bytes (0 without ``boundary``).

    Raises:
      ValueError: a shape that is not ints >= 0, or rows not a multiple of ``microbatches``
        (torch's schedules take even microbatches only).
    """
    if boundary is None:
        return 0
    shape = tuple(boundary)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"plan: boundary must be a shape of ints >= 0, got {boundary!r}")
    if shape[0] % microbatches:
        raise ValueError(
            f"plan: boundary has {shape[0]} rows, not a multiple of microbatches={microbatches}"
        )
    return math.prod(shape) // microbatches * itemsize


def _refused(context: int, replica_groups: int) -> dict:
    """``plan``'s arguments that ``fs.init`` refuses under a pipeline, by name."""
    return {
        "context": context if context != 1 else 0,
        "replica_groups": replica_groups if replica_groups != 1 else 0,
    }


def check_hfsdp(s: Setup | None, outer_strategy: Any, replicate: int, shard: int) -> None:
    """Raises ValueError where ``fs.init`` refuses HFSDP under a pipeline: a pipeline rank's
    data-parallel ranks both replicated and sharded (its master groups would span pipeline
    ranks)."""
    if s is not None and OuterStrategy.parse(outer_strategy).shards_optim:
        if replicate > 1 and shard > 1:
            raise ValueError(
                f"plan: pipeline={s.size} with outer_strategy={str(outer_strategy)!r} on "
                f"replicate={replicate} x shard={shard} ranks per pipeline rank is not "
                "supported (fs.init refuses it: HFSDP under a pipeline needs replicate or "
                "shard to be 1)"
            )
