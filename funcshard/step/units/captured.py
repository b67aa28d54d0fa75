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
is this rank's reduced shard. On CPU the two take the eager step's gloo forms, chosen as
eagerly: on a gloo group the gather is
:func:`funcshard.distributed.graph_ops.all_gather_sections` (each peer's section received in
place; gloo's functional all-gather copies it twice), and on CPU the reduce-scatter is
:func:`funcshard.distributed.graph_ops.reduce_scatter_sections` (each rank's section sent to it and
summed as the eager wire sums its all-to-all: gloo's reduce-scatter is an all-reduce, twice
the bytes).
AOTAutograd splits the result into one forward and one backward graph, collectives inside
each, for the compiler to fuse, bucket and reorder.

Every wire runs in the graphs as it runs eagerly, the same ops on the same values (so
aot_eager trains bitwise as eager): a param wire (``param_comm_dtype``, :class:`ParamWire`)
packs the shard (a cast, or :mod:`funcshard.comm.codec`'s 8-bit blocks), all-gathers the
packed bytes and decodes them once; HFSDP's inner shard (the layout the step runs is
:attr:`Layout.inner`) arrives packed already. A narrow or 8-bit gradient wire
(:class:`GradWire`) rounds each rank's sections once, exchanges them (on a CPU gloo group by
sends in the reduces' chain, :func:`_exchanged`; else ``_c10d_functional.all_to_all_single``)
and sums what arrives in fp32.

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
for a param used outside its unit). Code that runs eagerly between the graphs of a step dynamo
broke finds placeholders in the model's slots, which raise the same error on use
(:mod:`funcshard.step.units.eager_reads`).

A tensor-parallel model's gathered local params reach ``loss_fn`` as its DTensors
(``layout.tensor.wrap``: ``DTensor.from_local`` traced in the graph), as eager hands them.

What stays outside the graphs: the replicate-axis reduction of HSDP and HFSDP (an all-reduce,
or HFSDP's reduce-scatter into the masters, issued per bucket once backward is over, as the
step's :class:`~funcshard.comm.grads.ReplicateAxis` orders it), the optimizer update and the
metrics.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol

from funcshard.comm import codec
from funcshard.comm import params as params_lib
from funcshard.comm.grads import ReplicateAxis
from funcshard.comm.wires import NarrowWire, reduces_by_all_to_all, wire_for
from funcshard.distributed import graph_ops, ops
from funcshard.layout.layout import Bucket, Layout
from funcshard.step.compiling import (
    Backend,
    CudaGraphs,
    by_inductor,
    compile_fn,
    model_of,
    overlap_config,
    overlaps,
)
from funcshard.step.reduction import AddInto, Grads, Sink
from funcshard.step.units import prefetch
from funcshard.step.units.backend import joint_backend
from funcshard.step.units.eager_reads import EagerReads
from funcshard.step.units.losses import copied_out, dtensor_backward, loss_and_aux, reported
from funcshard.step.units.mutation_order import mutation_renames_kept
from funcshard.step.units.placeholders import read_in_capture
from funcshard.step.units.schedule import Placed, compile_key, joint_pass
from funcshard.step.units.traced import traced_error, unwrapped_error, warn_graph_breaks

__all__ = ["CapturedGrads"]


class ParamWire(NamedTuple):
    """How ZeRO-3's gather of a bucket decodes a param wire (``param_comm_dtype``) in the
    graph, as :func:`funcshard.comm.params.all_gather_params` does eagerly: the shard packed
    (unless ``packed``: HFSDP's inner shard, kept packed), all-gathered as bytes, decoded once
    into ``count`` sections of ``sizes`` (each leaf's numel in one master section)."""

    wire: torch.dtype
    blocks: codec.Blocks | None  # one section's blocks (an 8-bit wire)
    count: int
    sizes: tuple[int, ...]
    packed: bool
    compute: torch.dtype


class GradWire(NamedTuple):
    """How a bucket's gradient crosses the shard axis in the graph, as
    :func:`funcshard.comm.wires.wire_for` says eagerly: ``narrow`` False, a reduce-scatter in
    ``wire`` (the ring); True, each rank's sections rounded to ``wire`` once (8-bit: encoded
    by ``blocks``), exchanged by an all-to-all and summed in ``acc`` (fp32 or wider)."""

    wire: torch.dtype
    narrow: bool
    sections: torch.dtype
    acc: torch.dtype
    blocks: codec.Blocks | None


class _Gather(torch.autograd.Function):
    """Forward: a bucket's full params, one tensor per leaf (``leaves``: each one's numel,
    shape and shard numel). Backward: this rank's shard of the mean of their gradients over
    the data-parallel ranks, in the carrier's dtype.

    One output per leaf, not the full flat buffer sliced after: the gradients then meet in one
    concatenation into rank sections, where slices of one flat output would each be scattered
    into a bucket-sized zero buffer and summed (a fused kernel that reads every leaf's
    gradient for every element of the bucket)."""

    @staticmethod
    def forward(ctx, buffer, carrier, group, in_place, S, leaves, gather, dp, wire, pwire):
        ctx.group, ctx.S, ctx.leaves, ctx.dp, ctx.wire = group, S, leaves, dp, wire
        ctx.dtype = carrier.dtype
        if gather and pwire is not None:
            return _decoded(buffer, group, in_place, S, leaves, pwire)
        if gather and S > 1:
            gathered = _all_gather(buffer, S, group, in_place).view(S, -1)
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
            flat = _scaled(flat, ctx.dp, ctx.wire)
            if S * n > numel:  # the leaf's padding rows
                flat = torch.cat([flat, flat.new_zeros(S * n - numel)])
            flats.append(flat.view(S, n))
        # rank sections: section r holds every leaf's piece r
        x = torch.cat(flats, dim=1).view(-1)
        x = _reduced(x, ctx.group, S, ctx.wire)
        return None, x.to(ctx.dtype), *([None] * 9)


def _decoded(buffer, group, in_place: bool, S: int, leaves: tuple, pwire: ParamWire) -> tuple:
    """ZeRO-3's params through a param wire: packed, gathered, decoded once, per leaf."""
    x = buffer if pwire.packed else codec.pack(buffer, pwire.wire, pwire.blocks)
    if S > 1:
        x = _all_gather(x, S, group, in_place)
    full = codec.unpack(x, pwire.wire, pwire.blocks, pwire.count, pwire.compute)
    pieces = full.view(pwire.count, -1).split(list(pwire.sizes), dim=1)
    return tuple(
        p.reshape(-1)[:numel].view(shape)
        for p, (numel, shape, _) in zip(pieces, leaves, strict=True)
    )


def _all_gather(x: torch.Tensor, S: int, group: str, in_place: bool) -> torch.Tensor:
    """Every shard-axis rank's ``x`` in rank order: where the eager gather sends the sections
    to their place (``in_place``: a CPU gloo group), funcshard's op doing the same
    (:mod:`funcshard.distributed.graph_ops`: gloo's functional all-gather copies them twice),
    else torch's functional all-gather."""
    if in_place:
        return graph_ops.all_gather_sections(x, S, group, None)
    return funcol.all_gather_tensor(x, 0, group)


def _scaled(x: torch.Tensor, dp: int, wire: GradWire) -> torch.Tensor:
    """A leaf's gradient as the eager wire scales its sections (:mod:`funcshard.comm.grads`):
    cast to the wire (a narrow wire's rounded, then widened to its sum's dtype) and divided by
    the data-parallel size. Elementwise, so done per leaf it is fused into the leaf's copy
    into the rank sections, on the same values; on the concatenated sections it cost inductor
    one more pass over the whole bucket."""
    x = x.to(wire.sections).to(wire.acc) if wire.narrow else x.to(wire.wire)
    return x / dp if dp > 1 else x


def _reduced(x: torch.Tensor, group, S: int, wire: GradWire) -> torch.Tensor:
    """Rank sections ``x`` (:func:`_scaled`) -> this rank's shard of their sum over the shard
    axis, as the bucket's eager wire sums it (:mod:`funcshard.comm.wires`)."""
    if not wire.narrow:
        if S == 1:
            return x
        if reduces_by_all_to_all(x.device):  # as the eager RingWire sums it
            return graph_ops.reduce_scatter_sections(x, None, S, group)  # chained: units/schedule
        return funcol.reduce_scatter_tensor(x, "sum", 0, group)
    if S == 1:
        return x
    if wire.blocks is None:  # rounded once going out, summed in fp32 coming in
        return _exchanged(x.to(wire.wire), S, group).view(S, -1).sum(0, dtype=wire.acc)
    section = x.numel() // S
    send = torch.empty(S, wire.blocks.nbytes, dtype=torch.uint8, device=x.device)
    codec.encode(x.view(S, section), wire.wire, wire.blocks, send)
    recv = _exchanged(send.view(-1), S, group).view(S, -1)
    out = torch.empty(S, section, dtype=wire.acc, device=x.device)
    return codec.decode(recv, wire.wire, wire.blocks, out).sum(0)


def _exchanged(x: torch.Tensor, S: int, group) -> torch.Tensor:
    """An all-to-all of ``x``'s rank sections; on a CPU gloo group by sends in the reduces'
    chain (inductor put a functional one where each rank's own costs said: a deadlock)."""
    if reduces_by_all_to_all(x.device):
        return graph_ops.reduce_scatter_sections(x, None, S, group, False)
    return funcol.all_to_all_single(x, None, None, group)


def carrier_zeros(numel: int, grads: tuple) -> torch.Tensor:
    """Zeros standing for a leaf's absent gradient, like the others'."""
    ref = next(g for g in grads if g is not None)
    return ref.new_zeros(numel)


def _captured(layout: Layout) -> Callable[..., Any]:
    """The function the compiler traces: the buckets' gathers, then ``loss_fn`` (an argument:
    dynamo guards on its code and closure, so a loss made anew each step reuses the graphs)."""
    S, gather = layout.shard_size, layout.strategy.shards_params
    group = layout.shard_group.group_name if S > 1 else None
    in_place = S > 1 and ops.gathers_by_sends(layout.device, layout.shard_group)
    plan = []
    for b in layout.buckets:
        specs = layout.bucket_leaves(b)
        offsets = [sum(s.shard_numel for s in specs[:i]) for i in range(len(specs))]
        assert [s.offset for s in specs] == offsets, "a bucket's leaves packed in order"
        leaves = tuple((s.numel, tuple(s.shape), s.shard_numel) for s in specs)
        meta = (group, in_place, S, leaves, gather, layout.dp_size, _grad_wire(layout, b))
        meta += (_param_wire(layout, b) if gather else None,)
        plan.append((tuple(s.name for s in specs), meta))

    wrap = layout.tensor.wrap  # a tensor-parallel leaf: its DTensor, made in the graph

    def step(loss_fn, buffers, carriers, batch):
        params = {}
        for (names, meta), buffer, carrier in zip(plan, buffers, carriers, strict=True):
            full = _Gather.apply(buffer, carrier, *meta)
            params.update((n, wrap(n, p)) for n, p in zip(names, full, strict=True))
        return loss_and_aux(loss_fn(params, batch))

    return step


def _param_wire(layout: Layout, b: Bucket) -> ParamWire | None:
    """The param wire of ZeRO-3's gather of bucket ``b``, None without one."""
    wire = params_lib.param_wire(layout, b)
    if wire is None:
        return None
    blocks = params_lib.section_blocks(layout, b) if wire in codec.EIGHT_BIT else None
    sizes = tuple(s.shard_numel for s in params_lib.section_leaves(layout, b))
    count = layout.shard_size * max(1, layout.packed_sections)
    packed = params_lib.packs_shard(layout, b)
    return ParamWire(wire, blocks, count, sizes, packed, b.dtypes.compute)


def _grad_wire(layout: Layout, b: Bucket) -> GradWire:
    """The shard axis' wire of bucket ``b``'s gradient (:func:`wire_for`'s choice)."""
    wire = wire_for(layout, b)
    if isinstance(wire, NarrowWire):
        return GradWire(wire.dtype, True, wire.sections_dtype, wire.scale_dtype, wire.blocks)
    return GradWire(b.dtypes.comm, False, b.dtypes.comm, b.dtypes.comm, None)


# layout -> backend -> the compiled step; weak on the layout, so that a state let go takes
# its graphs with it. Each layout's compile keeps its own entries (``compile_fn``'s
# ``constants``): the guards on its plan are dropped, so no other layout may share them.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(layout: Layout, backend: Backend) -> tuple[Callable, Placed, EagerReads]:
    """The compiled step of ``layout``, what the joint pass placed in its graphs, started
    for a new call (:meth:`Placed.start`: no graph of it has run yet), and its cover of the
    model's own params (:mod:`funcshard.step.units.eager_reads`). Keyed by the user's
    ``backend``; one that does not go through AOTAutograd compiles AOTAutograd's graphs
    (:func:`~funcshard.step.units.backend.joint_backend`), so that the joint pass runs for it."""
    by_backend = _CACHE.setdefault(layout, {})
    key = id(backend) if callable(backend) else backend
    if key not in by_backend:
        placed, reads = Placed(), EagerReads(layout)
        compiled = compile_fn(
            _captured(layout),
            joint_backend(backend),
            constants="plan",
            check=_model_reads(layout),
            # each graph, as it runs, says which compile of its frame ran (a frame compiled
            # again for another loss_fn keeps both: dynamo runs whichever one's guards pass)
            on_compiled=lambda gm: reads.on_run(gm, functools.partial(placed.ran, compile_key())),
        )
        by_backend[key] = (compiled, placed, reads)
    by_backend[key][1].start()
    return by_backend[key]


def _count(layout: Layout, kind: str, buckets: list[int]) -> None:
    """Counts in ``fs.comm_stats`` what the graphs moved over the shard axis, as eager counts
    it: each bucket's all-gather (its wire bytes: :func:`~funcshard.comm.params.all_gather_nbytes`)
    or its reduce-scatter (its gradient wire's full buffer)."""
    S = layout.shard_size
    if S > 1:
        for i in buckets:
            b = layout.buckets[i]
            if kind == "all_gather":
                nbytes = params_lib.all_gather_nbytes(layout, b)
            else:
                nbytes = wire_for(layout, b).reduce_scatter_nbytes(S)
            _record(kind, nbytes, layout)


def _record(kind: str, nbytes: int, layout: Layout) -> None:
    ops.record(kind, torch.empty((), dtype=torch.uint8).expand(nbytes), layout.shard_axis)


def _count_regathers(layout: Layout, placed: Placed) -> None:
    """Counts the all-gathers the backward graph runs again (ZeRO-3's params re-gathered, not
    saved: :mod:`funcshard.step.units.schedule`) and the graphs' gathered peak."""
    for numel, dtype in placed.regathered:
        _record("all_gather", numel * dtype.itemsize, layout)
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
    their collective's wait (:mod:`funcshard.step.units.mutation_order`); a graph raising
    on this rank drains its collectives by sends
    (:func:`~funcshard.distributed.graph_ops.drain_failed_graph`)."""
    stack = contextlib.ExitStack()
    stack.enter_context(overlap_config(layout, backend))
    if by_inductor(backend):  # overlap: a CPU gloo group's gathers one bucket ahead; else
        # one order of its whole collectives on every rank
        stack.enter_context(prefetch.installed(overlaps(layout, backend)))
        stack.enter_context(graph_ops.drained_on_failure())
    stack.enter_context(mutation_renames_kept())
    return stack


class CapturedGrads:
    """ZeRO-2/3 with the microbatch in the compiled graphs (the module docstring)."""

    shard_reduced = True

    def __init__(self, layout: Layout, buffers: list[torch.Tensor] | tuple, backend: Backend):
        self.layout = layout
        self.buffers = tuple(buffers)
        self.backend = backend

    def _call(
        self,
        step: Callable,
        placed: Placed,
        loss_fn: Callable,
        carriers: list[torch.Tensor],
        batch: Any,
    ) -> Any:
        """The compiled step's forward; an error dynamo wraps as the backend or the op raised
        it (:mod:`funcshard.step.units.traced`)."""
        try:
            with (
                torch._functorch.config.patch(
                    joint_custom_pass=joint_pass(placed), enable_autograd_cache=False
                ),
                _compiling(self.layout, self.backend),
            ):
                return step(loss_fn, self.buffers, carriers, batch)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise unwrapped_error(e) from None
        except torch._dynamo.exc.TorchRuntimeError as e:  # an op failed on fake tensors
            raise traced_error(e, batch, self.backend) from None

    def _grads(
        self,
        step: Callable,
        placed: Placed,
        loss_fn: Callable,
        carriers: list[torch.Tensor],
        batch: Any,
        scale: float,
    ) -> tuple[torch.Tensor, Any, tuple]:
        """The microbatch's forward and backward through the compiled step: its loss, aux
        and the carriers' gradients (each bucket's reduced shard, None where none reached)."""
        layout = self.layout
        buckets = list(range(len(layout.buckets)))
        replayed = isinstance(self.backend, CudaGraphs)
        if replayed:  # a new microbatch: the last replay's outputs may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        loss, aux = self._call(step, placed, loss_fn, carriers, batch)
        warn_graph_breaks(layout, breaks)
        if layout.strategy.shards_params:
            _count(layout, "all_gather", buckets)
            _count_regathers(layout, placed)
        if replayed:  # a replay's outputs live in the graph's static buffers: keep copies
            loss, aux = loss.clone(), copied_out(aux)
        with dtensor_backward(loss), _compiling(layout, self.backend):
            grads = torch.autograd.grad(loss * scale, carriers, allow_unused=True)
        return loss, aux, grads

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
        step, placed, reads = _compiled(layout, self.backend)
        try:  # the model's own params back where a graph ending at a break covered them
            loss, aux, grads = self._grads(step, placed, loss_fn, carriers, batch, scale)
        finally:
            reads.uncover()
        replayed = isinstance(self.backend, CudaGraphs)
        reached = [i for i, g in enumerate(grads) if g is not None]
        _count(layout, "reduce_scatter", reached)
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
