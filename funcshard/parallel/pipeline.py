"""``fs.Pipeline``: which of torch.distributed.pipelining's schedules runs the stages, and
where each stage lives.

The schedules are torch's own (``torch.distributed.pipelining.schedules``), chosen by name
and run unchanged by :mod:`funcshard.step.pipelined`. A schedule places stages in one of
three ways (torch's ``stage_index_to_group_rank``):

* single: one stage per pipeline rank, stage ``p`` on rank ``p`` ("GPipe", "1F1B");
* loop: ``v`` stages per rank, stage ``i`` on rank ``i % P`` ("Interleaved1F1B",
  "LoopedBFS", "InterleavedZeroBubble");
* V-shaped: two stages per rank, rank ``p`` holds ``p`` and ``2P - 1 - p`` ("ZBVZeroBubble",
  "DualPipeV").

>>> Pipeline("1F1B", microbatches=4).stages_of(rank=1, pipeline=2, stages=2)
(1,)
>>> Pipeline("ZBVZeroBubble", microbatches=4).stages_of(rank=0, pipeline=2, stages=4)
(0, 3)
>>> Pipeline("Interleaved1F1B", microbatches=4).stages_of(rank=1, pipeline=2, stages=4)
(1, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from funcshard.parallel.pipeline_split import split

__all__ = ["Pipeline", "SCHEDULES", "split", "check_stages"]

# name -> (torch's class in torch.distributed.pipelining.schedules, placement)
SCHEDULES: dict[str, tuple[str, str]] = {
    "GPipe": ("ScheduleGPipe", "single"),
    "1F1B": ("Schedule1F1B", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Pipeline:
    """A pipeline schedule by torch's name, over ``microbatches`` microbatches a step.

    Args:
      schedule: one of :data:`SCHEDULES`.
      microbatches: the microbatches of every step (the batch is split on dim 0 into them);
        what the schedule cannot take (torch's own checks, e.g. 1F1B's ``microbatches >=
        stages``) is refused at ``fs.init``, where the stage count is known.
      regather: ZeRO-3: gather a stage's parameters per microbatch in forward and again in
        its backward (True), instead of once a step (False, the default; torchtitan's
        ``reshard_after_forward=False``). No effect under the other strategies (their
        compute parameters are whole on every rank).

    Raises:
      ValueError: an unknown schedule, microbatches below 1 or not an int.
    """

    schedule: str
    microbatches: int = 1
    regather: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Pipeline: unknown schedule {self.schedule!r}; expected one of {sorted(SCHEDULES)}"
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(
                f"Pipeline(schedule={self.schedule!r}): microbatches must be an int >= 1, "
                f"got {self.microbatches!r}"
            )

    @property
    def placement(self) -> str:
        """ "single", "loop" or "v" (see the module's docstring)."""
        return SCHEDULES[self.schedule][1]

    @property
    def torch_class(self) -> str:
        return SCHEDULES[self.schedule][0]

    def stages_per_rank(self, pipeline: int, stages: int) -> int:
        """The stages each rank holds for ``stages`` stages on ``pipeline`` ranks.

        Raises:
          ValueError: a count the schedule cannot place (naming the schedule, P and count).
        """
        want = {"single": "P", "v": "2 x P"}.get(self.placement, "a multiple of P")
        per_rank = stages // pipeline if stages % pipeline == 0 else 0
        ok = {"single": per_rank == 1, "v": per_rank == 2}.get(self.placement, per_rank >= 1)
        if not ok:
            raise ValueError(
                f"Pipeline(schedule={self.schedule!r}): {stages} stage(s) on pipeline={pipeline} "
                f"ranks; this schedule takes {want} stages"
            )
        return per_rank

    def stages_of(self, rank: int, pipeline: int, stages: int) -> tuple[int, ...]:
        """The stage indices pipeline rank ``rank`` holds, in model order."""
        per_rank = self.stages_per_rank(pipeline, stages)
        if self.placement == "v":
            return (rank, 2 * pipeline - 1 - rank)
        return tuple(rank + k * pipeline for k in range(per_rank))


def check_stages(stages: Sequence[nn.Module], pipe: Pipeline, pipeline: int) -> None:
    """Refuses, before any collective, a list of stages that cannot run: not modules, a count
    the schedule cannot place, a parameter name (or parameter) in two stages.

    Raises:
      ValueError: naming the stages and the name.
      TypeError: a stage that is not an ``nn.Module``.
    """
    for i, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise TypeError(f"pipeline: stage {i} is a {type(stage).__name__}, not an nn.Module")
    pipe.stages_per_rank(pipeline, len(stages))
    names: dict[str, int] = {}
    objects: dict[int, tuple[int, str]] = {}
    for i, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if name in names:
                raise ValueError(
                    f"pipeline: parameter {name!r} is in stage {names[name]} and stage {i}; "
                    "every parameter name must be in one stage only"
                )
            names[name] = i
            if id(p) in objects and objects[id(p)][0] != i:
                j, other = objects[id(p)]
                raise ValueError(
                    f"pipeline: stage {j}'s {other!r} and stage {i}'s {name!r} are one "
                    "parameter (weights tied across stages are not supported yet)"
                )
            objects[id(p)] = (i, name)
