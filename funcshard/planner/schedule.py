"""A pipeline schedule's order and its timeline, for a plan (:mod:`funcshard.planner.pipeline`).

* the order torch's schedule runs (:func:`schedule_order`): the single-stage schedules
  ("GPipe", "1F1B") recorded from their own ``_step_microbatches`` over a stage that only
  notes each forward and backward; the others from the ``pipeline_order`` torch builds (its
  ``OVERLAP_F_B`` actions as their forward and backward in turn). From it:
* in flight (:func:`simulate`): per rank, the most microbatches whose forward has run and
  whose backward (the weight gradient's, ``W``, under the zero-bubble schedules: the graph
  is kept until then) has not, over all its stages at once;
* the bubble: the order run with each action taking its stage's cost, each action starting
  when its rank is free and its inputs are there (the forward of the previous stage, the
  input gradient of the next), sends taking no time; a rank's bubble is its idle time over
  the step's, ``1 - busy / makespan``. The costs: equal stages (``COST``: a forward 1, a
  full backward 2, an input or weight gradient 1, the zero-bubble paper's ``T_F = T_B =
  T_W``), where GPipe and 1F1B give ``(P - 1) / (M + P - 1)``; or each stage's own
  (:mod:`funcshard.planner.stage_cost`: its FLOPs). Neither the boundary transfers nor the
  optimizer step are part of it.

>>> order = schedule_order("GPipe", 2, 8)
>>> s = simulate(order, 2)
>>> round(s.bubble, 4), s.in_flight
(0.1111, (8, 8))
>>> simulate(schedule_order("1F1B", 2, 8), 2).in_flight
(2, 1)
>>> round(simulate(schedule_order("GPipe", 2, 8), 2, [(1, 2, 1, 1), (2, 4, 2, 2)]).bubble, 4)
0.2941
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, NamedTuple

from funcshard.parallel.pipeline import Pipeline

__all__ = ["COST", "Action", "Timeline", "schedule_order", "simulate"]

COST = {"F": 1, "B": 2, "I": 1, "W": 1}  # the zero-bubble paper's T_F = T_B = T_W


class Action(NamedTuple):
    """One computation of a schedule: ``kind`` "F", "B" (full backward), "I" (input
    gradient) or "W" (weight gradient) of ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


class Timeline(NamedTuple):
    """What :func:`simulate` finds: the makespan, each rank's busy time, the bubble (idle
    over all ranks' time), each rank's bubble and peak microbatches in flight."""

    makespan: float
    busy: tuple[float, ...]
    bubble: float
    bubble_by_rank: tuple[float, ...]
    in_flight: tuple[int, ...]


class _Recorder:
    """A stage for torch's single-stage schedules that notes each forward and backward (and
    sends nothing): what ``_step_microbatches`` runs, in its order."""

    def __init__(self, index: int, stages: int) -> None:
        self.stage_index, self.num_stages = index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod, self.has_backward, self.device = None, True, "cpu"
        self.actions: list[Action] = []

    def clear_runtime_states(self) -> None:
        pass

    def _no_ops(self, chunk: int) -> list:  # noqa: ARG002
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops

    def forward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        self.actions.append(Action("F", self.stage_index, chunk))

    def backward_one_chunk(self, chunk: int, *args: Any, **kwargs: Any) -> None:
        self.actions.append(Action("B", self.stage_index, chunk))

    def perform_reduce_grad(self, *args: Any) -> None:
        pass


def _fake(index: int, stages: int, pipeline: int, rank: int) -> types.SimpleNamespace:
    """What torch's multi-stage schedules read of a stage to build their order."""
    return types.SimpleNamespace(
        num_stages=stages,
        group_size=pipeline,
        group_rank=rank,
        stage_index=index,
        is_first=index == 0,
        is_last=index == stages - 1,
        submod=None,
    )


def schedule_order(
    schedule: str, pipeline: int, microbatches: int, per_rank: int | None = None
) -> dict[int, list[Action]]:
    """Each pipeline rank's computations in the order torch's schedule runs them (module
    docstring); ``per_rank``: stages per rank (1 for single-stage schedules, else 2).

    Raises:
      ValueError: microbatches torch's schedule refuses (its own words).
    """
    pipe = Pipeline(schedule, microbatches=microbatches)
    from torch.distributed.pipelining import schedules as torch_schedules  # loads dynamo

    cls = getattr(torch_schedules, pipe.torch_class)
    per_rank = per_rank or (1 if pipe.placement == "single" else 2)
    n = pipeline * per_rank
    try:
        if pipe.placement == "single":
            return {rank: _recorded(cls, rank, n, microbatches) for rank in range(pipeline)}
        fakes = [_fake(i, n, pipeline, 0) for i in pipe.stages_of(0, pipeline, n)]
        order = cls(fakes, microbatches).pipeline_order
    except ValueError as e:
        raise ValueError(
            f"plan: Pipeline(schedule={schedule!r}, microbatches={microbatches}) on {n} "
            f"stages: torch's {cls.__name__} refuses it: {e}"
        ) from e
    return {rank: _computations(order[rank]) for rank in range(pipeline)}


def _recorded(cls: type, rank: int, stages: int, microbatches: int) -> list[Action]:
    """What torch's single-stage schedule ``cls`` runs on ``rank``, in its order."""
    rec = _Recorder(rank, stages)
    sched = cls(rec, microbatches)
    sched._has_backward = True  # as with a loss_fn; its stage counts as set up
    sched._stage_forward_initialized = sched._stage_backward_initialized = True
    sched._step_microbatches()
    return rec.actions


def _computations(actions: Sequence[Any]) -> list[Action]:
    out = []
    for a in actions:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I"}.get(
                sub.computation_type.name,
                "W" if sub.computation_type.name == "BACKWARD_WEIGHT" else None,
            )
            if kind is not None:
                out.append(Action(kind, sub.stage_index, sub.microbatch_index))
    return out


def _deps(a: Action, stages: int) -> list[tuple]:
    if a.kind == "F":
        return [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [("G", a.stage, a.microbatch)]
    grad = [("G", a.stage + 1, a.microbatch)] if a.stage < stages - 1 else []
    return [("F", a.stage, a.microbatch), *grad]


def simulate(
    order: dict[int, list[Action]],
    stages: int,
    costs: Sequence[Sequence[float]] | None = None,
) -> Timeline:
    """Runs ``order`` (module docstring): the makespan, bubble and microbatches in flight;
    ``costs``: each stage's forward, full, input and weight backward
    (:class:`~funcshard.planner.stage_cost.StageCost`), None for equal stages (``COST``).

    Raises:
      ValueError: an order that cannot finish (an action waiting on one never run).
    """

    def cost(a: Action) -> float:
        return COST[a.kind] if costs is None else costs[a.stage]["FBIW".index(a.kind)]

    done: dict[tuple, float] = {}
    clock: dict[int, float] = dict.fromkeys(order, 0)
    nxt = dict.fromkeys(order, 0)
    pending = sum(len(v) for v in order.values())
    while pending:
        progress = False
        for rank, actions in order.items():
            while nxt[rank] < len(actions):
                a = actions[nxt[rank]]
                deps = _deps(a, stages)
                if any(d not in done for d in deps):
                    break
                end = max([clock[rank], *(done[d] for d in deps)]) + cost(a)
                clock[rank] = end
                done["G" if a.kind in "BI" else a.kind, a.stage, a.microbatch] = end
                nxt[rank], pending, progress = nxt[rank] + 1, pending - 1, True
        if not progress:
            stuck = {r: order[r][nxt[r]] for r in order if nxt[r] < len(order[r])}
            raise ValueError(f"pipeline plan: the schedule's order cannot finish: {stuck}")
    makespan = max(clock.values())
    busy = tuple(sum(cost(a) for a in order[r]) for r in sorted(order))
    return Timeline(
        makespan,
        busy,
        1 - sum(busy) / (len(busy) * makespan),
        tuple(1 - b / makespan for b in busy),
        tuple(_peak(order[r]) for r in sorted(order)),
    )


def _peak(actions: list[Action]) -> int:
    """The most microbatches whose forward ran and whose activations are not freed yet."""
    live = peak = 0
    zero_bubble = any(a.kind == "W" for a in actions)
    for a in actions:
        if a.kind == "F":
            live += 1
        elif a.kind == "B" or (a.kind == "W" and zero_bubble):
            live -= 1
        peak = max(peak, live)
    return peak
