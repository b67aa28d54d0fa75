"""ZeRO-3 under ``fs.Pipeline(regather=True)`` in a plan: how often a steady step gathers each
bucket, and the most gathered parameters alive at once.

A stage's forward gathers every bucket it uses, once a microbatch; its backward gathers again
the buckets its forward saved a gathered tensor of (a model's own choice: a linear layer's
weight, not an embedding's, nor that of a first layer whose input needs no gradient); under
the zero-bubble schedules the input backward and the weight backward each gather what they
read (on the first stage torch's input backward runs nothing and its weight backward the
whole backward). Which buckets: found by running each stage of this rank on the meta device
through the step's own code, :class:`~funcshard.step.pipeline_stage.StageModule` over a
:class:`~funcshard.step.pipeline_regather.Regather` whose gathers make meta buffers (and are
noted), its backward by torch's own ``stage_backward`` / ``stage_backward_input`` /
``stage_backward_weight``, released after each as the step's stage releases them; the inputs
are one microbatch of ``inputs=`` and the stages' outputs on the meta device before it
(``propagate``, as the step sizes its buffers). Each phase then counts once per action of
the schedule's order on this rank (:func:`funcshard.planner.pipeline.schedule_order`).

This is a steady step's: torch's shape inference on a schedule's first step (and on a batch
of new shapes) runs each stage's forward and backward once more. A stage the meta device
cannot run (a value check, data-dependent routing) is counted gathering every bucket it uses
in each phase, which is at most what it gathers, and the plan says so
(``PipelinePlan.exact`` False, ``PipelinePlan.note`` naming the stage and its error).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import nn

from funcshard.layout.layout import Layout
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.step.functional import Swap
from funcshard.step.pipeline_regather import Regather
from funcshard.step.pipeline_stage import StageModule, as_meta, propagate
from funcshard.step.units.placeholders import UnitParamsError

__all__ = [
    "Phases",
    "Regathers",
    "regathers",
    "run_phases",
    "meta_error",
    "meta_failure",
    "input_args",
]


class Phases(NamedTuple):
    """The buckets one microbatch of a stage gathers in each phase: its forward, its full
    backward, and the zero-bubble schedules' input and weight backward."""

    forward: tuple[int, ...]
    full: tuple[int, ...]
    input: tuple[int, ...]
    weight: tuple[int, ...]


class Regathers(NamedTuple):
    """A steady step's gathers per bucket, the most gathered bytes alive at once, and why
    they are an upper bound ("" where every stage of this rank ran on the meta device)."""

    counts: dict[int, int]
    peak: int
    note: str


class _MetaRegather(Regather):
    """The step's :class:`Regather`, its gathers meta buffers of the full size, noted."""

    def __init__(self, layout: Layout) -> None:
        shards = [
            torch.empty(b.numel, dtype=b.dtypes.compute, device="meta") for b in layout.buckets
        ]
        super().__init__(layout, shards, shards)
        self.gathered: list[int] = []

    def gather(self, bucket: int) -> torch.Tensor:
        self.gathered.append(bucket)
        b = self.layout.buckets[bucket]
        n = self.layout.over(b).shard_size * b.numel
        return torch.empty(n, dtype=b.dtypes.compute, device="meta")

    def noted(self) -> tuple[int, ...]:
        """The buckets gathered since the last call, in order; the backward's buffers freed
        (the stage's phase is over)."""
        self.release()
        out, self.gathered = tuple(self.gathered), []
        return out


def _forward(module: StageModule, args: tuple, first: bool) -> tuple[tuple, list]:
    """The stage's outputs and inputs as torch's stage keeps them for its backward: a
    stage's floating-point inputs require grad but the first stage's (the batch's)."""
    inputs = [
        as_meta(t).requires_grad_(not first and t.is_floating_point())
        if isinstance(t, torch.Tensor)
        else t
        for t in args
    ]
    out = module(*inputs)
    if module.error is not None:  # it raised, and handed on its stand-in
        raise RuntimeError(module.error)
    return tuple(optree.tree_leaves(out)), inputs


def _seed(outputs: tuple, last: bool) -> tuple[list, list | None]:
    """What a backward starts from: a loss on the last stage (torch: ``output_grads`` None),
    else the outputs and a gradient of each."""
    grad = [t for t in outputs if t.requires_grad]
    if last:
        return [sum((t.float().sum() for t in grad), torch.zeros((), device="meta"))], None
    return grad, [torch.ones_like(t) for t in grad]


def run_phases(
    module: StageModule, args: tuple, place: tuple[bool, bool], split: bool, noted: Callable
) -> tuple[Any, Any, Any, Any]:
    """One microbatch of the stage through the step's code (module docstring), ``noted()``
    called at the end of each phase, what it returns the phase's: ``(forward, full backward,
    input backward, weight backward)``; ``place``: (first stage, last stage); ``split``:
    whether the schedule splits its backward (else the last two are the full one's and
    ``noted()`` after nothing). :mod:`funcshard.planner.stage_cost` counts FLOPs so."""
    from torch.distributed.pipelining import _backward as torch_backward  # loads pipelining

    first, last = place
    outputs, inputs = _forward(module, args, first)
    forward = noted()
    seed, grads = _seed(outputs, last)
    torch_backward.stage_backward(seed[0] if last else seed, grads, inputs)  # torch: the loss
    full = noted()
    if not split or first:  # torch's first stage: no input backward, a full weight one
        return forward, full, noted(), full
    outputs, inputs = _forward(module, args, first)
    noted()
    seed, grads = _seed(outputs, last)
    _, groups = torch_backward.stage_backward_input(seed, grads, inputs, module.parameters())
    input_ = noted()
    torch_backward.stage_backward_weight(module.parameters(), groups)
    return forward, full, input_, noted()


def stage_phases(
    stages: Sequence[nn.Module],
    mine: tuple[int, ...],
    layout: Layout,
    inputs: Any,
    microbatches: int,
    split: bool,
) -> tuple[dict[int, Phases], str]:
    """Each of this rank's stages' :class:`Phases` (its every bucket in each phase where the
    meta device cannot run it), and what could not run ("" where all did)."""
    policy: MixedPrecisionPolicy = layout.policy
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    mb = tuple(torch.tensor_split(as_meta(t), microbatches)[0] for t in args)
    outs = propagate(list(stages), mb, policy)
    rg = _MetaRegather(layout)
    found, notes = {}, []
    for i in mine:
        module = StageModule(stages[i], i)
        module.cast, module.regather = policy.param_dtype, rg
        module.leaves = {n: rg.leaves[n] for n in module.names}
        given = mb if i == 0 else outs[i - 1]
        x = None if given is None else (given if isinstance(given, tuple) else (given,))
        buffers = Swap(stages[i], {n: as_meta(b) for n, b in stages[i].named_buffers()})
        try:
            if x is None:
                raise RuntimeError("its input is not known: a stage before it does not run")
            place = (i == 0, i == len(stages) - 1)
            found[i] = Phases(*run_phases(module, x, place, split, rg.noted))
        except Exception as e:  # noqa: BLE001 (the plan says so, and counts at most)
            _refuse_refused(e, i)
            every = tuple(sorted({rg.bucket_of[n] for n in module.names}))
            found[i] = Phases(every, every, every, every)
            notes.append(meta_failure(i, module, e, x))
        finally:
            module.release()
            buffers.restore()
            rg.gathered = []
            rg.release()
    return found, "; ".join(notes)


def meta_failure(index: int, module: StageModule, e: BaseException, given: tuple | None) -> str:
    """Why stage ``index`` did not run on the meta device; for the first stage, with the
    microbatch of ``inputs=`` it was given (inputs of the wrong shape fail there, and the
    model is not to blame)."""
    why = f"stage {index} does not run on the meta device: {meta_error(module, e)}"
    if index == 0 and given is not None:
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in given)
        why += f" (on a microbatch of inputs=: {shapes}; is it train_step's batch[0]?)"
    return why


def meta_error(module: StageModule, e: BaseException) -> str:
    """The last line of why ``module`` did not run on the meta device (``e``: what it
    raised)."""
    error = module.error or "".join(traceback.format_exception_only(_innermost(e)))
    return _last_line(error)


def _innermost(e: BaseException) -> BaseException:
    """The exception ``e`` was raised from, innermost (torch's ``stage_backward`` wraps the
    stage's error in a RuntimeError whose last line names its inputs, not the error)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _refuse_refused(e: BaseException, index: int) -> None:
    """Raises ValueError where stage ``index`` raised what ``fs.train_step`` raises on every
    step too, not what only the meta device cannot run: a parameter read outside the
    stage's forward (activation checkpointing's recomputation in backward)."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, UnitParamsError):
        cause = cause.__cause__
    if cause is not None:
        raise ValueError(
            f"plan: regather=True: pipeline stage {index} cannot run under it, as "
            f"fs.train_step would raise UnitParamsError on every step: {cause}"
        ) from e


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "?"


def regathers(
    stages: Sequence[nn.Module],
    mine: tuple[int, ...],
    layout: Layout,
    inputs: Any,
    microbatches: int,
    actions: Sequence[Any],
) -> Regathers:
    """A steady step's gathers per bucket of ``layout`` (the inner layout: ZeRO-3's), for
    this rank's ``actions`` (:class:`~funcshard.planner.pipeline.Action`) of its stages
    ``mine`` (module docstring), and the most gathered bytes alive at once: a stage's forward
    holds every bucket it uses at once (its backward a part of them).

    Raises:
      ValueError: ``inputs`` missing, not a tensor or tuple of tensors, or of rows not a
        multiple of ``microbatches``; a stage the step refuses under ``regather=True`` (its
        backward reads a parameter outside its forward: activation checkpointing).
    """
    _check_inputs(inputs, microbatches)
    split = any(a.kind in "IW" for a in actions)
    phases, note = stage_phases(stages, mine, layout, inputs, microbatches, split)
    counts = dict.fromkeys(range(len(layout.buckets)), 0)
    for a in actions:
        p = phases[a.stage]
        for b in {"F": p.forward, "B": p.full, "I": p.input, "W": p.weight}[a.kind]:
            counts[b] += 1

    def full(b: int) -> int:
        bucket = layout.buckets[b]
        return layout.over(bucket).shard_size * bucket.numel * bucket.dtypes.compute.itemsize

    peak = max(sum(full(b) for b in set(bs)) for p in phases.values() for bs in p)
    return Regathers(counts, peak, note)


def _check_inputs(inputs: Any, microbatches: int) -> None:
    """Raises ValueError where ``inputs`` cannot be run as ``train_step``'s inputs."""
    input_args(
        inputs,
        microbatches,
        "plan: regather=True under ZeRO-3 needs inputs= (this rank's local batch inputs, "
        "train_step's batch[0]: a tensor or tuple of tensors, meta-device ones do): the plan "
        "runs the stages on the meta device to find which buckets their backward gathers "
        "again; got ",
    )


def input_args(inputs: Any, microbatches: int, why: str) -> tuple[torch.Tensor, ...]:
    """``inputs`` (``fs.plan``'s ``inputs=``) as a tuple of tensors.

    Raises:
      ValueError: ``why`` and ``inputs`` where it is not a tensor or tuple of tensors; a
        tensor of no rows (dim 0) or of rows that ``microbatches`` do not divide.
    """
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not args or not all(isinstance(t, torch.Tensor) for t in args):
        raise ValueError(why + repr(inputs))
    _check_rows(args, microbatches)
    return args


def _check_rows(args: Sequence[torch.Tensor], microbatches: int) -> None:
    """Raises ValueError where a tensor of ``args`` (``inputs=``) has no rows (dim 0) or
    rows that ``microbatches`` do not divide: ``train_step`` refuses it."""
    for t in args:
        if t.dim() == 0 or t.shape[0] % microbatches:
            raise ValueError(
                f"plan: inputs= of shape {tuple(t.shape)}: its rows (dim 0) are not a multiple "
                f"of microbatches={microbatches} (train_step refuses it)"
            )
