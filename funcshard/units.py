"""ZeRO-2/3 unit by unit: each unit's params enter the autograd graph when the unit runs.

One :class:`UnitRun` serves one forward/backward of ``train_step``. It owns a :class:`Unit` per
gather unit of the layout (the root, then every unit module), a :class:`Gatherer` (the
collectives and prefetches), the :class:`Reducer` (the backward half: reduce-scatter into the
gradient accumulator) and, under ZeRO-3, :class:`SavedParams` (the saved-tensor codec). The
Mapping that ``loss_fn`` reads, :class:`~funcshard.functional.GatheredParams`, only points at
it.

A unit goes through FSDP2's phases, on hooks installed with handles (removed at ``close``):

* pre-forward (``register_forward_pre_hook``): gather the unit (from the prefetch in flight),
  put its params into the module, prefetch the next unit;
* post-forward (``register_forward_hook``): ZeRO-3 drops the gathered params (what autograd
  saved of them is a token, see :class:`SavedParams`) and puts placeholders back; it hooks the
  unit's outputs for pre-backward;
* pre-backward (the outputs' gradient is ready): re-gather the unit and put it into the module
  again, prefetch the unit that ran before it in forward;
* recompute: a forward inside backward (activation checkpointing, around the unit or inside
  its own forward, as Hugging Face's ``gradient_checkpointing_enable`` does) runs on the
  re-gathered params of the unit's backward, with no collective of its own;
* post-backward (the gather's transpose, one per bucket): the bucket's gradient starts its
  reduce-scatter; once nothing saved needs the re-gathered bucket it is dropped and the
  module gets its placeholders back.

The gather is an autograd function whose transpose is the reduce-scatter: its backward sums
the bucket's gradient over the shard axis, in ``grad_comm_dtype`` on the wire, and adds this
rank's shard, in ``main_grads_dtype``, to the accumulator. Under ZeRO-2 (``replicated``) the
"gather" hands out the replicated full buffers with no collective and the module keeps them
until backward is over; what the unit adds is that backward starts the unit's reduce-scatter
as soon as it is done with it, so the full gradients of only about one unit are alive at a
time.

Outside of its unit a param is a placeholder: any use raises :class:`UnitParamsError`, naming
it, instead of silently taking the module's own (stale) weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from funcshard import collectives, determinism
from funcshard import reduce as reduce_lib
from funcshard import sharding as shard_lib
from funcshard.functional import GatheredParams, _Swap
from funcshard.layout import ROOT_UNIT, Layout

__all__ = ["UnitRun", "Unit", "Gatherer", "Reducer", "SavedParams", "UnitParamsError"]


class UnitParamsError(RuntimeError):
    """A unit's parameter was used where the unit was not running (ZeRO-2/3)."""


# Metadata reads a placeholder answers; any other use raises.
_METADATA = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.__repr__,
        torch.Tensor.__format__,
        torch.Tensor.__hash__,
    }
)


class _Absent(torch.Tensor):
    """A meta tensor standing in for a parameter outside the unit that holds it."""

    _why: str

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, why: str) -> _Absent:
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t._why = why
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA or getattr(func, "__name__", None) == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        absent = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Absent))
        raise UnitParamsError(absent._why)


def _absent(layout: Layout, names: list[str]) -> dict[str, _Absent]:
    out = {}
    for name in names:
        spec = layout.leaf(name)
        if spec.unit == ROOT_UNIT:
            why = (
                f"parameter {name!r} (root unit) was used after forward: under "
                f"{layout.strategy} the root's params are gathered for forward only, so "
                "code outside the units cannot be recomputed in backward (activation "
                "checkpointing); checkpoint units, or code inside them, instead"
            )
        else:
            why = (
                f"parameter {name!r} of unit {layout.units[spec.unit]!r} was used where "
                f"that unit was not running: under {layout.strategy} a unit's params exist "
                "only inside its forward (and its backward). Take a param outside of its "
                "unit through params[name] in loss_fn"
            )
        out[name] = _Absent(spec.shape, spec.dtypes.compute, why)
    return out


class _Gather(torch.autograd.Function):
    """Forward: a bucket's full params (views of ``source.graph_full``). Backward: the
    reduce-scatter of their gradient, and the post-backward phase of ``source``."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, source: Any, bucket: int):  # noqa: ARG004
        ctx.source, ctx.bucket = source, bucket
        run = source.run
        if not _in_backward():
            run.reducer.entries[bucket] += 1
        full = source.graph_full(bucket)
        specs = run.layout.bucket_leaves(run.layout.buckets[bucket])
        return tuple(shard_lib.full_view(full, s, run.layout.shard_size) for s in specs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        out = ctx.source.run.reducer.reduce(ctx.bucket, grads)
        ctx.source.post_backward(ctx.bucket)
        return out, None, None


class Reducer:
    """The backward half of the params: each bucket's gradient, reduced over "shard" and
    accumulated into ``acc`` (this rank's shards, in main-grads dtype) as backward goes.

    A bucket's reduce-scatter starts as soon as backward has its gradient and overlaps the
    rest of backward; at most one is in flight, so about one unit's unreduced gradient waits
    beside the one being computed. The result goes straight into the accumulator, not through
    autograd: the carrier only receives a zero-stride zero, so no second copy of the gradients
    is alive at the end of a microbatch, and a bucket that entered the graph twice is simply
    reduced twice (the reduction is linear). ``backward`` waits for everything it started.

    A deterministic layout must sum a bucket's uses before the ranks' contributions (as
    autograd does for ZeRO-0/1), so when forward took a bucket into the graph more than once
    (``params[name]`` beside its unit) the whole backward keeps unreduced sections and reduces
    each bucket once after it.
    """

    def __init__(
        self,
        layout: Layout,
        acc: list[torch.Tensor | None] | None = None,
        *,
        local: bool = False,
        complete: determinism.PairwiseSum | None = None,
    ) -> None:
        self.layout = layout
        self.local = local  # keep the unreduced rank sections (a deterministic step's subtrees)
        self.acc: list[torch.Tensor | None] = (
            acc if acc is not None else [None] * len(layout.buckets)
        )
        # A deterministic step's last microbatch: once a bucket's every use has given its
        # sections, the earlier microbatches' tree is completed with them and the bucket's
        # reduce-scatter starts, overlapping the rest of backward.
        self.complete = complete
        self._sections: dict[int, torch.Tensor] = {}
        self._arrived: collections.Counter[int] = collections.Counter()
        self._completed: set[int] = set()
        zero = {
            b.dtypes.grad: torch.zeros(1, dtype=b.dtypes.grad, device=layout.device)
            for b in layout.buckets
        }
        self._zeros = [zero[b.dtypes.grad].expand(b.numel) for b in layout.buckets]
        self.carriers = tuple(z.detach().requires_grad_() for z in self._zeros)
        self._in_flight: list[tuple[int, collectives.Pending]] = []
        self.entries: collections.Counter[int] = collections.Counter()  # uses in forward

    def reduce(self, bucket: int, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """Starts reducing a bucket's full gradients; returns the carrier's (dummy) gradient."""
        b = self.layout.buckets[bucket]
        specs = self.layout.bucket_leaves(b)
        S = self.layout.shard_size
        if self.complete is not None and bucket not in self._completed:
            # (a use beyond those counted in forward, e.g. taken inside a recomputation, comes
            # after its bucket's reduction started: it is reduced on its own and added, below)
            mine = self._sections.get(bucket)
            if mine is None:
                self._sections[bucket] = shard_lib.to_rank_sections(
                    list(grads), specs, S, b.dtypes.grad, self.layout.device
                )
            else:  # another use of the bucket, summed in arrival order as autograd would
                shard_lib.add_to_rank_sections(mine, list(grads), specs, S)
            self._arrived[bucket] += 1
            if self._arrived[bucket] >= self.entries[bucket]:
                self._complete(bucket)
            return self._zeros[bucket]
        # With one data-parallel rank the reduction is the identity: a later microbatch (or
        # use) adds its gradient straight into the accumulator, as the unreduced sections do.
        # (With replicas but one shard it is a division by their count, left to the wire.)
        direct = self.local or (self.layout.dp_size == 1 and b.dtypes.comm == b.dtypes.grad)
        if direct and self.acc[bucket] is not None:
            self.finish()  # an earlier use of the bucket lands first
            shard_lib.add_to_rank_sections(self.acc[bucket], list(grads), specs, S)
            return self._zeros[bucket]
        if self.local:
            self.acc[bucket] = shard_lib.to_rank_sections(
                list(grads), specs, S, b.dtypes.grad, self.layout.device
            )
            return self._zeros[bucket]
        self._start(
            bucket,
            shard_lib.to_rank_sections(list(grads), specs, S, b.dtypes.comm, self.layout.device),
        )
        return self._zeros[bucket]

    def _complete(self, bucket: int) -> None:
        """Completes a bucket's microbatch tree and starts reducing it (once per bucket)."""
        if bucket in self._completed:
            return
        self._completed.add(bucket)
        total = self.complete.total(bucket, self._sections.pop(bucket, None))
        if total is not None:
            self._start(bucket, total)

    def _start(self, bucket: int, sections: torch.Tensor) -> None:
        """Waits for the reduction in flight, then starts reducing ``sections``."""
        self.finish()
        self._in_flight.append(
            (
                bucket,
                reduce_lib.start_reduce_shard_axis(
                    self.layout, self.layout.buckets[bucket], sections
                ),
            )
        )

    def finish(self) -> None:
        """Waits for the reductions started so far and adds them to the accumulator."""
        for bucket, pending in self._in_flight:
            shard = pending.wait()
            if self.acc[bucket] is None:
                self.acc[bucket] = shard.to(self.layout.buckets[bucket].dtypes.grad)
            else:
                self.acc[bucket].add_(shard)
        self._in_flight.clear()

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        """Backpropagates ``loss``; returns the accumulator (None: no gradient reached yet)."""
        deferred = (
            self.layout.deterministic
            and not self.local
            and self.complete is None
            and any(n > 1 for n in self.entries.values())
        )
        if deferred:
            reduced, self.acc, self.local = self.acc, [None] * len(self.acc), True
        try:
            torch.autograd.grad(loss, self.carriers, allow_unused=True)
            if self.complete is not None:  # buckets this microbatch did not (fully) reach
                for bucket in range(len(self.layout.buckets)):
                    self._complete(bucket)
        finally:
            self.finish()
        if deferred:
            sections, self.acc, self.local = self.acc, reduced, False
            for bucket, value in enumerate(sections):
                if value is not None:
                    self._start(bucket, value)
            self.finish()
        return self.acc


class Gatherer:
    """Full buffers of buckets: all-gathered under ZeRO-3, at most one gather in flight per
    bucket (a prefetch); the replicated full buffer itself under ZeRO-2."""

    def __init__(
        self,
        layout: Layout,
        buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
        replicated: bool,
    ) -> None:
        self.layout = layout
        self.buffers = buffers
        self.replicated = replicated
        self._pending: dict[int, collectives.Pending] = {}

    def prefetch(self, buckets: Iterator[int] | list[int]) -> None:
        """Starts gathering ``buckets`` (those not in flight already)."""
        if self.replicated:
            return
        for b in buckets:
            if b not in self._pending:
                self._pending[b] = collectives.all_gather(
                    self.buffers[b], self.layout.shard_group, async_op=True
                )

    def full(self, bucket: int) -> torch.Tensor:
        """The bucket's full buffer, from a prefetch if one is in flight."""
        if self.replicated:
            return self.buffers[bucket].detach()  # outputs alias it, not autograd views of it
        self.prefetch([bucket])
        specs = self.layout.bucket_leaves(self.layout.buckets[bucket])
        full = shard_lib.from_rank_sections(
            self._pending.pop(bucket).wait(), specs, self.layout.shard_size
        )
        if self.layout.shard_size > 1:  # with one shard the "full" buffer is the shard itself
            collectives.track_gathered(full)
        return full

    def drop_prefetches(self) -> None:
        """Forgets gathers started for a unit that did not run."""
        self._pending.clear()


@dataclasses.dataclass(frozen=True)
class _Token:
    """A gathered param saved for backward, as a recipe to re-gather it."""

    bucket: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class SavedParams:
    """Saved-tensor hooks (ZeRO-3): a gathered param that autograd saves for backward is
    stored as a token, and backward unpacks it from its unit's re-gathered buffer, so full
    params are not kept alive between forward and backward and no unit is recomputed."""

    def __init__(self, run: UnitRun) -> None:
        self.run = run
        self._storages: dict[int, tuple[int, weakref.ref]] = {}  # data_ptr -> (bucket, buffer)
        self.refs: dict[int, int] = {}  # tokens of a bucket not unpacked yet

    def register(self, bucket: int, full: torch.Tensor) -> None:
        self._storages[full.untyped_storage().data_ptr()] = (bucket, weakref.ref(full))

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self._storages.get(ptr)
        if entry is None or entry[1]() is None:
            return t
        bucket = entry[0]
        self.refs[bucket] = self.refs.get(bucket, 0) + 1
        return _Token(bucket, t.size(), t.stride(), t.storage_offset())

    def unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Token):
            return x
        unit = self.run.units[self.run.layout.buckets[x.bucket].unit]
        full = unit.backward_full(x.bucket)
        self.refs[x.bucket] -= 1
        unit.maybe_release(x.bucket)
        return full.as_strided(x.size, x.stride, x.offset)


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors requiring grad in a module's output (tensors, tuples, lists, mappings)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _grad_tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in _grad_tensors(o)]
    return []


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One gather unit of one step, with FSDP2's phases (see the module docstring).

    ``held`` maps a bucket to the full buffer the unit holds now: from pre-forward to
    post-forward, and in backward from the re-gather until post-backward has run for the
    bucket and no saved token of it is left.
    """

    def __init__(self, run: UnitRun, index: int) -> None:
        self.run = run
        self.index = index
        self.prefix = run.layout.units[index]
        self._forward_swap: _Swap | None = None  # the root's, kept until close
        self.buckets = run.buckets_of.get(index, [])
        self.held: dict[int, torch.Tensor] = {}
        self._swap: _Swap | None = None  # the module's params while gathered in backward
        self._awaiting_post: set[int] = set()  # buckets re-gathered whose backward is due

    # --- what the gather hands out -----------------------------------------------------
    def graph_full(self, bucket: int) -> torch.Tensor:
        full = self.held.get(bucket)
        return full if full is not None else self.run.full(bucket)

    def _views(self) -> dict[str, torch.Tensor]:
        """The unit's params by name relative to its module: views of its gathered buffers,
        in the graph through one gather per bucket."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        params = {}
        for b in self.buckets:
            specs = self.run.layout.bucket_leaves(self.run.layout.buckets[b])
            views = _Gather.apply(self.run.reducer.carriers[b], self, b)
            params.update({s.name[strip:]: v for s, v in zip(specs, views, strict=True)})
        return params

    def _gather(self, buckets: list[int]) -> None:
        for b in buckets:
            if b not in self.held:
                self.held[b] = self.run.full(b)

    # --- forward -----------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        if not self.buckets:
            return
        if _in_backward():  # recompute (activation checkpointing around the unit)
            self.enter_backward(module)
            return
        self.run.order.append(self.index)
        self._gather(self.buckets)
        params = self._views()
        self.run.prefetch_forward(self.index + 1)
        swap = _Swap(module, params)
        if self.run.replicated:
            # ZeRO-2 params are views of persistent buffers: the unit keeps them until
            # backward is over, so a recomputation sees this step's weights, and they are the
            # very tensors of the graph.
            self.run.stack.callback(swap.restore)
        else:
            self._swap = swap

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG002
        if not self.buckets or self.run.replicated or _in_backward():
            return
        if self._swap is not None:
            self._swap.restore()
            self._swap = None
        self.held.clear()  # what backward needs of them is saved as tokens
        tensors = _grad_tensors(output)
        if tensors:
            handle = torch.autograd.graph.register_multi_grad_hook(
                tensors, self._pre_backward_hook(module), mode="any"
            )
            self.run.stack.callback(handle.remove)

    # --- backward ----------------------------------------------------------------------
    def _pre_backward_hook(self, module: nn.Module):
        def hook(grad: torch.Tensor | None) -> None:  # noqa: ARG001
            self.enter_backward(module)

        return hook

    def enter_backward(self, module: nn.Module) -> None:
        """Pre-backward: re-gather the unit and put it into the module (for a recomputation),
        prefetch the unit that ran before it. Idempotent while the unit is in backward."""
        self._awaiting_post.update(self.buckets)
        if self._swap is not None:
            return
        self._gather(self.buckets)
        self.run.prefetch_backward(self.index)
        # Backward runs without grad mode; the recomputation must see params that require
        # grad, as forward's did, or autograd saves other tensors than it saved in forward.
        with torch.enable_grad():
            self._swap = _Swap(module, self._views())

    def backward_full(self, bucket: int) -> torch.Tensor:
        """The re-gathered bucket for a saved token (re-gathering the unit if not held)."""
        full = self.held.get(bucket)
        if full is None:
            self._gather(
                [
                    b
                    for b in self.buckets
                    if b not in self.held and self.run.saved.refs.get(b, 0) > 0
                ]
            )
            self.run.prefetch_backward(self.index)
            full = self.held[bucket]
        return full

    def post_backward(self, bucket: int) -> None:
        self._awaiting_post.discard(bucket)
        self.maybe_release(bucket)

    def maybe_release(self, bucket: int) -> None:
        """Drops a re-gathered bucket once backward is done with it (and with the tokens)."""
        if bucket in self._awaiting_post:
            return
        if self.run.saved is not None and self.run.saved.refs.get(bucket, 0) > 0:
            return
        self.held.pop(bucket, None)
        if not self.held and self._swap is not None:
            self._swap.restore()
            self._swap = None

    def close(self) -> None:
        if self._swap is not None:
            self._swap.restore()
            self._swap = None
        self.held.clear()
        self._awaiting_post.clear()


class _RootUnit(Unit):
    """The root: gathered before the model runs, kept to the end of forward. Backward
    re-gathers what it saved (through tokens) and nothing else: it is not hooked for a
    recomputation, which would keep the root gathered through all of backward."""

    def pre_forward(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        layout = self.run.layout
        self.run.order.append(ROOT_UNIT)
        self._gather(self.buckets)
        params = self._views()
        # Unit params stand in as placeholders until the unit runs: a use outside of it fails
        # loudly instead of silently taking the module's stale weights.
        params.update(_absent(layout, [s.name for s in layout.leaves if s.unit != ROOT_UNIT]))
        self.run.prefetch_forward(ROOT_UNIT + 1)
        self._forward_swap = _Swap(module, params)
        self.run.stack.callback(self._forward_swap.restore)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG002
        self.run.gatherer.drop_prefetches()  # a prefetch of a unit forward did not run
        if self.run.replicated:
            return
        # The gathered root goes with forward (backward re-gathers what it saved).
        names = [s.name for s in self.run.layout.leaves if s.unit == ROOT_UNIT]
        self._forward_swap.replace(_absent(self.run.layout, names))
        self.held.clear()


class _Outside:
    """The gather source of ``params[name]``: a fresh gather per bucket, cached for the step."""

    def __init__(self, run: UnitRun) -> None:
        self.run = run
        self.views: dict[int, tuple[torch.Tensor, ...]] = {}

    def graph_full(self, bucket: int) -> torch.Tensor:
        return self.run.full(bucket)

    def post_backward(self, bucket: int) -> None:
        pass

    def param(self, name: str) -> torch.Tensor:
        layout = self.run.layout
        spec = layout.leaf(name)  # KeyError naming the param when unknown
        views = self.views.get(spec.bucket)
        if views is None:
            views = _Gather.apply(self.run.reducer.carriers[spec.bucket], self, spec.bucket)
            self.views[spec.bucket] = views
        specs = layout.bucket_leaves(layout.buckets[spec.bucket])
        return views[[s.name for s in specs].index(name)]


class UnitRun:
    """One forward/backward of ``train_step`` under ZeRO-2/3: the units, their hooks, the
    gathers and the reduce-scatters.

    ZeRO-3 (``optim_grads_params``): ``buffers`` are this rank's compute shards, each unit is
    gathered just before it runs. ZeRO-2 (``replicated=True``): ``buffers`` are the replicated
    full compute buffers, used as they are. ``run.reducer.backward(loss)`` adds, per bucket,
    this rank's shard of the gradient reduced over the shard axis to ``acc``, in the bucket's
    main-grads dtype; with ``local=True`` it adds the unreduced rank sections instead (a
    deterministic step reduces its microbatches' sum once). ``run.params`` is what ``loss_fn``
    gets.
    """

    def __init__(
        self,
        layout: Layout,
        buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
        *,
        replicated: bool = False,
        acc: list[torch.Tensor | None] | None = None,
        local: bool = False,
        complete: determinism.PairwiseSum | None = None,
    ) -> None:
        self.layout = layout
        self.replicated = replicated
        self.gatherer = Gatherer(layout, buffers, replicated)
        self.reducer = Reducer(layout, acc, local=local, complete=complete)
        self.saved = None if replicated else SavedParams(self)
        self.buckets_of: dict[int, list[int]] = {}
        for b in layout.buckets:
            self.buckets_of.setdefault(b.unit, []).append(b.index)
        self.units = [_RootUnit(self, ROOT_UNIT)] + [
            Unit(self, i) for i in range(1, len(layout.units))
        ]
        self.order: list[int] = []  # units in the order forward ran them
        self.stack = contextlib.ExitStack()  # what stays until backward is over
        self.closed = False
        self._outside = _Outside(self)
        self._hooked: set[int] = set()  # models whose unit modules carry this run's hooks
        self.params = GatheredParams(self)

    # --- what GatheredParams asks -------------------------------------------------------
    def param(self, name: str) -> torch.Tensor:
        """``params[name]`` in ``loss_fn``: its bucket enters the graph as one more use."""
        return self._outside.param(name)

    def call(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Runs the model with every unit bringing its params in as it runs."""
        if id(model) not in self._hooked:
            self._install(model)
        root = self.units[ROOT_UNIT]
        with contextlib.nullcontext() if self.saved is None else self.saved.hooks():
            root.pre_forward(model, args)
            try:
                return model(*args, **kwargs)
            finally:
                root.post_forward(model, args, None)

    def _install(self, model: nn.Module) -> None:
        self._hooked.add(id(model))
        for unit in self.units[1:]:
            module = model.get_submodule(unit.prefix)
            handles: list[RemovableHandle] = [
                module.register_forward_pre_hook(unit.pre_forward),
                module.register_forward_hook(unit.post_forward, always_call=True),
            ]
            for handle in handles:
                self.stack.callback(handle.remove)

    # --- scheduling -----------------------------------------------------------------------
    def full(self, bucket: int) -> torch.Tensor:
        full = self.gatherer.full(bucket)
        if self.saved is not None:
            self.saved.register(bucket, full)
        return full

    def prefetch_forward(self, unit: int) -> None:
        if unit < len(self.units):
            self.gatherer.prefetch(self.buckets_of.get(unit, []))

    def prefetch_backward(self, unit: int) -> None:
        """Starts gathering the unit that ran before ``unit`` in forward, if backward needs it.

        The root unit spans the whole forward; backward reaches it first (the head), so after
        the root comes the unit that ran last. A unit is re-gathered whole (its pre-backward);
        the root only where it saved tokens.
        """
        if self.replicated or not self.order:
            return
        i = self.order.index(unit) if unit in self.order else 0
        previous = self.order[-1] if i == 0 else self.order[i - 1]
        if previous == unit:
            return
        held = self.units[previous].held
        wanted = [
            b
            for b in self.buckets_of.get(previous, [])
            if b not in held and (previous != ROOT_UNIT or self.saved.refs.get(b, 0) > 0)
        ]
        self.gatherer.prefetch(wanted)

    def close(self) -> None:
        """Removes the hooks and gives the model its own parameters back (after backward)."""
        self.closed = True
        self.gatherer.drop_prefetches()
        for unit in reversed(self.units):
            unit.close()
        self.stack.close()
