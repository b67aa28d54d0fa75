"""Each pipeline stage's cost in FLOPs, by which a plan weights its schedule's bubble.

Without ``inputs=`` a plan's bubble is that of equal stages (:mod:`funcshard.planner.schedule`:
a forward costs 1, a full backward 2, an input or weight backward 1). With ``inputs=`` (this
rank's local batch inputs, meta-device ones do) the plan runs one microbatch of EVERY stage
(the bubble involves every rank, not only the one planned) on the meta device through the
step's own code, as :mod:`funcshard.planner.regather` runs this rank's stages
(:func:`~funcshard.planner.regather.run_phases`: a
:class:`~funcshard.step.pipeline_stage.StageModule` on meta parameters in their compute
dtypes, its input the output of the stage before it, its backward torch's own
``stage_backward``), and counts what each phase runs under
``torch.utils.flop_counter.FlopCounterMode``: the forward, the full backward and, for the
zero-bubble schedules, torch's ``stage_backward_input`` and ``stage_backward_weight`` apart.
As torch's stage runs them, the first stage computes no gradient of its inputs (the batch's):
its full backward lacks its first matrix product's input gradient, and under the zero-bubble
schedules its input backward runs nothing and its weight backward the whole backward. The
costs are normalized to the mean forward over the stages.

What the FLOPs leave out: FlopCounterMode counts matrix products, convolutions and attention
only, so norms, activations, an embedding's gather and the loss count nothing (on a
memory-bound device they take time); the last stage's backward starts from the sum of its
outputs (the loss_fn is not the plan's to run). Where a stage does not run on the meta device
(a value check, data-dependent routing) or a stage's forward counts no FLOP (an embedding
alone: by FLOPs its rank would idle through the step), the plan keeps equal stages and says
why (``PipelinePlan.bubble_note``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.planner.regather import input_args, meta_failure, run_phases
from funcshard.step.functional import Swap
from funcshard.step.pipeline_stage import StageModule, as_meta, propagate

__all__ = ["StageCost", "stage_costs"]


class StageCost(NamedTuple):
    """One microbatch of a stage: its forward, full backward, input backward and weight
    backward (the order of ``"FBIW"``, the kinds of
    :class:`~funcshard.planner.pipeline.Action`), in FLOPs or in mean forwards."""

    forward: float
    full: float
    input: float
    weight: float


def stage_costs(
    stages: Sequence[nn.Module],
    policy: MixedPrecisionPolicy,
    inputs: Any,
    microbatches: int,
    split: bool,
) -> tuple[tuple[StageCost, ...], str]:
    """Every stage's :class:`StageCost` over the mean forward (module docstring), and ``((),
    why)`` where equal stages must stand in; ``split``: whether the schedule splits the
    backward (else input and weight are 0).

    Raises:
      ValueError: ``inputs`` not a tensor or tuple of tensors, or of rows (dim 0) that
        ``microbatches`` do not divide.
    """
    why = (
        "plan: inputs= must be this rank's local batch inputs (train_step's batch[0]: a "
        "tensor or tuple of tensors, meta-device ones do), got "
    )
    args = input_args(inputs, microbatches, why)
    mb = tuple(torch.tensor_split(as_meta(t), microbatches)[0] for t in args)
    outs = propagate(list(stages), mb, policy)
    flops = []
    for i, stage in enumerate(stages):
        given = mb if i == 0 else outs[i - 1]
        if given is None:
            return (), f"stage {i}'s input is not known: a stage before it does not run"
        x = given if isinstance(given, tuple) else (given,)
        module = StageModule(stage, i)
        try:
            flops.append(_counted(module, x, policy, (i == 0, i == len(stages) - 1), split))
        except Exception as e:  # noqa: BLE001 (the plan says so, and keeps equal stages)
            return (), meta_failure(i, module, e, x)
    idle = [i for i, f in enumerate(flops) if not f.forward]
    if len(idle) == len(flops):
        return (), "no stage's forward counts a FLOP (a matrix product, convolution, attention)"
    if idle:  # weighted by FLOPs its rank would idle through the step: a bubble of 1
        return (), (
            f"stage {idle[0]}'s forward counts no FLOP (a matrix product, convolution, "
            "attention): an embedding, norms or activations alone weigh nothing by FLOPs"
        )
    mean = sum(f.forward for f in flops) / len(flops)
    return tuple(StageCost(*(v / mean for v in f)) for f in flops), ""


class _Untracked:
    """``FlopCounterMode``'s module tracker, tracking nothing: every count is "Global" (its
    totals are all the plan reads). The ``ModuleTracker`` it replaces hooks the gradients of
    each module's inputs, and that hook raises under torch's ``stage_backward_input`` on a
    stage whose input is a leaf ("A leaf node was passed to _will_engine_execute_node but we
    are currently running autograd.grad()")."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _Untracked:
        return self

    def __exit__(self, *args: object) -> None:
        pass


def _counted(
    module: StageModule,
    x: tuple,
    policy: MixedPrecisionPolicy,
    place: tuple[bool, bool],
    split: bool,
) -> StageCost:
    """The FLOPs of each phase of one microbatch of ``module``'s stage on input ``x``, on
    the meta device; ``place``: (first stage, last stage)."""
    stage = module.stage
    module.cast = policy.param_dtype
    module.leaves = {
        n: as_meta(p).to(policy.resolve(p.dtype).compute).requires_grad_()
        for n, p in stage.named_parameters()
    }
    buffers = Swap(stage, {n: as_meta(b) for n, b in stage.named_buffers()})
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _Untracked()

    def noted() -> int:
        """The FLOPs since the last call."""
        total = counter.get_total_flops()
        counter.flop_counts.clear()
        return total

    try:
        with counter:
            f, b, i, w = run_phases(module, x, place, split, noted)
    finally:
        module.release()
        buffers.restore()
    return StageCost(f, b, i, w) if split else StageCost(f, b, 0, 0)
