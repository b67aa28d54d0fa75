"""The captured step (``fs.init(compile=...)`` under ZeRO-2/3): a microbatch's gathers, its
forward (the whole ``loss_fn``) and, in backward, its reduce-scatters, in the compiled graphs.

SimpleFSDP's shape on funcshard's buckets: one compiled function takes every bucket's
compute shard (ZeRO-3) or replicated full buffer (ZeRO-2) and a *carrier* per bucket (a
zero-stride zero in the bucket's main-grads dtype, of its shard's size, the only input that
requires grad), and runs :class:`_Gather` per bucket, then ``loss_fn`` on plain
``{name: view}`` params. ``_Gather`` is an autograd function dynamo traces whole: its forward
all-gathers the shard over the shard axis with torch's functional collectives
(``_c10d_functional.all_gather_into_tensor``, ZeRO-3) and hands out each leaf's full param;
its backward concatenates their gradients into rank sections, casts them to the wire
(``grad_comm_dtype``), divides by the data-parallel size and reduce-scatters it
(``_c10d_functional.reduce_scatter_tensor``), in the main-grads dtype: the carrier's gradient
is this rank's reduced shard. AOTAutograd splits the result into one forward and one backward
graph, collectives inside each, for the compiler to fuse, bucket and reorder.

With ``cuda_graphs=True`` the two graphs are inductor's CUDA graph trees
(``mode="reduce-overhead"``): each microbatch marks a new step, and the loss and the reduced
shards a replay returns, and the tensors of ``aux``, are copied out of the graphs' static
buffers before the next replay.
NCCL collectives are captured inside the graphs as torchtitan captures them. Unverified on
hardware: written where no GPU was lent; ``tests/test_compile.py``'s CUDA test checks it.

Where the collectives sit is funcshard's choice, made on AOTAutograd's joint graph before any
partitioner sees it (:mod:`funcshard.step.units.schedule`): under ZeRO-3 each all-gather is
recomputed in backward, not saved (SimpleFSDP's policy), and placed at its first use; each
reduce-scatter runs as soon as its bucket's gradients are complete. ``fs.comm_stats`` counts
what the graphs move, per call: each bucket's all-gather in forward (ZeRO-3), the all-gathers
the pass found the backward runs again, and a reduce-scatter of each bucket that got a
gradient; ``gathered_peak`` is the graphs' most gathered bytes at once as placed.

A ``loss_fn`` that reads a parameter from the model itself, not from its params, would read
the model's initial weights: each graph is checked before its backend gets it, and a model
parameter among its inputs raises :class:`UnitParamsError` naming it (as eager ZeRO-3 raises
for a param used outside its unit).

What stays outside the graphs: the replicate-axis reduction of HSDP (issued per bucket once
backward is over, as the step's :class:`~funcshard.comm.grads.ReplicateAxis` orders it), the
optimizer update and the metrics.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed._functional_collectives as funcol

from funcshard.comm.grads import ReplicateAxis
from funcshard.distributed import ops
from funcshard.layout.layout import Layout
from funcshard.step.compiling import (
    Backend,
    CudaGraphs,
    compile_fn,
    model_of,
    overlap_config,
)
from funcshard.step.reduction import AddInto, Grads, Sink
from funcshard.step.summed import Summed
from funcshard.step.units.losses import dtensor_backward, loss_and_aux, reported
from funcshard.step.units.mutation_order import mutation_renames_kept
from funcshard.step.units.placeholders import UnitParamsError, read_in_capture
from funcshard.step.units.schedule import Placed, joint_pass

__all__ = ["CapturedGrads", "copied_out"]


class _Gather(torch.autograd.Function):
    """Forward: a bucket's full params, one tensor per leaf (``leaves``: each one's numel,
    shape and shard numel). Backward: this rank's shard of the mean of their gradients over
    the data-parallel ranks, in the carrier's dtype.

    One output per leaf, not the full flat buffer sliced after: the gradients then meet in one
    concatenation into rank sections, where slices of one flat output would each be scattered
    into a bucket-sized zero buffer and summed (a fused kernel that reads every leaf's
    gradient for every element of the bucket)."""

    @staticmethod
    def forward(ctx, buffer, carrier, group, S, leaves, gather, dp, wire):
        ctx.group, ctx.S, ctx.leaves, ctx.dp, ctx.wire = group, S, leaves, dp, wire
        ctx.dtype = carrier.dtype
        if gather and S > 1:
            gathered = funcol.all_gather_tensor(buffer, 0, group).view(S, -1)
            pieces = gathered.split([n for _, _, n in leaves], dim=1)
            return tuple(
                p.reshape(-1)[:numel].view(shape)
                for p, (numel, shape, _) in zip(pieces, leaves, strict=True)
            )
        # ZeRO-2's replicated full buffer (each leaf's rank pieces adjacent), or one shard
        outs, start = [], 0
        for numel, shape, n in leaves:
            outs.append(buffer[start : start + numel].view(shape))
            start += S * n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        S, flats = ctx.S, []
        for g, (numel, _, n) in zip(grads, ctx.leaves, strict=True):
            flat = g.reshape(-1) if g is not None else carrier_zeros(numel, grads)
            if S * n > numel:  # the leaf's padding rows
                flat = torch.cat([flat, flat.new_zeros(S * n - numel)])
            flats.append(flat.view(S, n))
        # rank sections: section r holds every leaf's piece r
        x = torch.cat(flats, dim=1).view(-1).to(ctx.wire)
        if ctx.dp > 1:
            x = x / ctx.dp
        if S > 1:
            x = funcol.reduce_scatter_tensor(x, "sum", 0, ctx.group)
        return None, x.to(ctx.dtype), None, None, None, None, None, None


def copied_out(aux: Any) -> Any:
    """``aux`` with each tensor leaf (an ``fs.summed``'s value too) a copy: a CUDA graph's
    replay overwrites the static buffers its outputs live in."""

    def copy(x: Any) -> Any:
        if isinstance(x, Summed):
            return Summed(x.value.clone())
        return x.clone() if isinstance(x, torch.Tensor) else x

    return optree.tree_map(copy, aux, is_leaf=lambda x: isinstance(x, Summed), none_is_leaf=True)


def carrier_zeros(numel: int, grads: tuple) -> torch.Tensor:
    """Zeros standing for a leaf's absent gradient, like the others'."""
    ref = next(g for g in grads if g is not None)
    return ref.new_zeros(numel)


def _captured(layout: Layout) -> Callable[..., Any]:
    """The function the compiler traces: the buckets' gathers, then ``loss_fn`` (an argument:
    dynamo guards on its code and closure, so a loss made anew each step reuses the graphs)."""
    S, gather = layout.shard_size, layout.strategy.shards_params
    group = layout.shard_group.group_name if S > 1 else None
    plan = []
    for b in layout.buckets:
        specs = layout.bucket_leaves(b)
        offsets = [sum(s.shard_numel for s in specs[:i]) for i in range(len(specs))]
        assert [s.offset for s in specs] == offsets, "a bucket's leaves packed in order"
        leaves = tuple((s.numel, tuple(s.shape), s.shard_numel) for s in specs)
        meta = (group, S, leaves, gather, layout.dp_size, b.dtypes.comm)
        plan.append((tuple(s.name for s in specs), meta))

    def step(loss_fn, buffers, carriers, batch):
        params = {}
        for (names, meta), buffer, carrier in zip(plan, buffers, carriers, strict=True):
            params.update(zip(names, _Gather.apply(buffer, carrier, *meta), strict=True))
        return loss_and_aux(loss_fn(params, batch))

    return step


# layout -> backend -> the compiled step; weak on the layout, so that a state let go takes
# its graphs with it. Each layout's compile keeps its own entries (``compile_fn``'s
# ``constants``): the guards on its plan are dropped, so no other layout may share them.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(layout: Layout, backend: Backend) -> tuple[Callable, Placed]:
    """The compiled step of ``layout`` and what the joint pass placed in its graphs."""
    by_backend = _CACHE.setdefault(layout, {})
    key = id(backend) if callable(backend) else backend
    if key not in by_backend:
        compiled = compile_fn(
            _captured(layout), backend, constants="plan", check=_model_reads(layout)
        )
        by_backend[key] = (compiled, Placed())
    return by_backend[key]


def _count(layout: Layout, kind: str, buckets: list[int], dtype_of: Callable) -> None:
    """Counts in ``fs.comm_stats`` what the graphs moved over the shard axis: each bucket's
    full buffer (an all-gather's output, a reduce-scatter's input)."""
    if layout.shard_size > 1:
        for i in buckets:
            b = layout.buckets[i]
            _record(kind, layout.shard_size * b.numel, dtype_of(b), layout)


def _record(kind: str, numel: int, dtype: torch.dtype, layout: Layout) -> None:
    ops.record(kind, torch.empty((), dtype=dtype).expand(numel), layout.shard_axis)


def _count_regathers(layout: Layout, placed: Placed) -> None:
    """Counts the all-gathers the backward graph runs again (ZeRO-3's params re-gathered, not
    saved: :mod:`funcshard.step.units.schedule`) and the graphs' gathered peak."""
    for numel, dtype in placed.regathered:
        _record("all_gather", numel, dtype, layout)
    ops.note_gathered_peak(placed.gathered_peak)


def _model_reads(layout: Layout) -> Callable[[Any, list], None]:
    """The check each graph of ``layout``'s captured step gets before its backend: an input
    that is a parameter of the model (``loss_fn`` read it from the model, not from its
    params) raises :func:`read_in_capture`'s error naming it. Weak on the layout."""
    layout_ref = weakref.ref(layout)

    def check(gm: Any, example_inputs: list) -> None:  # noqa: ARG001
        layout = layout_ref()
        model = model_of(layout) if layout is not None else None
        if model is None:
            return
        # the model's own Parameters: inside fs.functional_call (a graph resumed after a break
        # in the model) its attributes are the state's params, plain tensors, read rightly
        names = {
            id(p): n
            for n, p in model.named_parameters(remove_duplicate=False)
            if isinstance(p, torch.nn.Parameter)
        }
        for x in example_inputs:
            if id(x) in names:
                raise read_in_capture(layout, names[id(x)])

    return check


def _compiling(layout: Layout, backend: Backend) -> contextlib.ExitStack:
    """What surrounds a captured call and its backward (where AOTAutograd compiles the
    backward graph, lazily): inductor's overlap passes where asked for
    (:func:`~funcshard.step.compiling.overlap_config`) and its scheduler's reads kept after
    their collective's wait (:mod:`funcshard.step.units.mutation_order`)."""
    stack = contextlib.ExitStack()
    stack.enter_context(overlap_config(layout, backend))
    stack.enter_context(mutation_renames_kept())
    return stack


# layouts whose captured step was warned of a graph break (once each), weak on the layout
_BROKEN: weakref.WeakSet = weakref.WeakSet()


def _first_lines(reason: str) -> str:
    """A graph break's reason as dynamo counts it, cut to its title and explanation."""
    lines = [line.strip() for line in reason.strip().splitlines()]
    why = next((line for line in lines if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {why.removeprefix('Explanation: ')}" if why else lines[0]


def _warn_graph_breaks(layout: Layout, before: dict[str, int]) -> None:
    """Warns, once per layout, where dynamo broke the captured step's graph during a call
    (``before``: its graph-break counters then), naming each reason: the graphs on either
    side of a break are compiled apart, so the forward's params cross between them, and the
    joint pass places each graph's collectives within it alone."""
    counts = torch._dynamo.utils.counters["graph_break"]
    new = {r: n - before.get(r, 0) for r, n in counts.items() if n > before.get(r, 0)}
    if not new or layout in _BROKEN:
        return
    _BROKEN.add(layout)
    short: dict[str, int] = {}
    for reason, n in new.items():
        short[_first_lines(reason)] = short.get(_first_lines(reason), 0) + n
    reasons = "; ".join(f"{r} (x{n})" for r, n in short.items())
    warnings.warn(
        f"train_step: compile= captured the {layout.strategy} step in pieces: dynamo broke the "
        f"graph inside loss_fn or the model, {sum(new.values())} time(s): {reasons}. Each "
        "piece compiles on its own: the collectives of one piece do not overlap another's, "
        "and ZeRO-3's params gathered before a break are kept for the backward past it. "
        "Remove the break (a print, a .item(), data-dependent Python) to capture the step "
        "whole; torch._dynamo.explain(fn)(...) lists each break. Warned once per state",
        stacklevel=4,
    )


def _unwrapped_error(e: Exception) -> Exception:
    """A backend's failure as dynamo reports it, or the UnitParamsError inside it."""
    inner = getattr(e, "inner_exception", None)
    return inner if isinstance(inner, UnitParamsError) else e


class CapturedGrads:
    """ZeRO-2/3 with the microbatch in the compiled graphs (the module docstring)."""

    shard_reduced = True

    def __init__(self, layout: Layout, buffers: list[torch.Tensor] | tuple, backend: Backend):
        self.layout = layout
        self.buffers = tuple(buffers)
        self.backend = backend

    def microbatch(
        self,
        batch: Any,
        loss_fn: Callable[..., Any],
        scale: float,
        sink: Sink,
        replicate: ReplicateAxis | None = None,
    ) -> tuple[torch.Tensor, Any, Grads]:
        assert isinstance(sink, AddInto), "a captured step adds into one accumulator"
        layout = self.layout
        buckets = list(range(len(layout.buckets)))
        carriers = [
            torch.zeros(1, dtype=b.dtypes.grad, device=layout.device)
            .expand(b.numel)
            .detach()
            .requires_grad_()
            for b in layout.buckets
        ]
        step, placed = _compiled(layout, self.backend)
        replayed = isinstance(self.backend, CudaGraphs)
        if replayed:  # a new microbatch: the last replay's outputs may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        try:
            with (
                torch._functorch.config.patch(
                    joint_custom_pass=joint_pass(placed), enable_autograd_cache=False
                ),
                _compiling(layout, self.backend),
            ):
                loss, aux = step(loss_fn, self.buffers, carriers, batch)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise _unwrapped_error(e) from None
        _warn_graph_breaks(layout, breaks)
        if layout.strategy.shards_params:
            _count(layout, "all_gather", buckets, lambda b: b.dtypes.compute)
            _count_regathers(layout, placed)
        if replayed:  # a replay's outputs live in the graph's static buffers: keep copies
            loss, aux = loss.clone(), copied_out(aux)
        with dtensor_backward(loss), _compiling(layout, self.backend):
            grads = torch.autograd.grad(loss * scale, carriers, allow_unused=True)
        reached = [i for i, g in enumerate(grads) if g is not None]
        _count(layout, "reduce_scatter", reached, lambda b: b.dtypes.comm)
        acc = sink.acc if sink.acc is not None else [None] * len(buckets)
        for i in reached:
            if acc[i] is None:
                grad = grads[i].to(layout.buckets[i].dtypes.grad)
                acc[i] = grad.clone() if replayed and grad is grads[i] else grad
            else:
                acc[i].add_(grads[i])
        if replicate is not None and replicate.on_wire:  # HSDP: each bucket's sum is final
            for i in buckets:
                if acc[i] is None:
                    acc[i] = torch.zeros(
                        layout.buckets[i].numel,
                        dtype=layout.buckets[i].dtypes.grad,
                        device=layout.device,
                    )
                replicate.start(i, acc[i])
        return reported(loss), aux, acc
