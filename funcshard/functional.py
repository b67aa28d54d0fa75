"""``functional_call``, and ZeRO-3 per-unit gathering as a differentiable function.

Under ``optim_grads_params`` the params handed to ``loss_fn`` are a :class:`GatheredParams`:
shards plus the recipe to gather them. ``functional_call`` then runs the model with

* the root unit gathered before the model runs (kept to the end of forward);
* every other unit gathered just before it runs, freed when it returns, the next unit's
  gather already in flight (prefetch);
* the gather an autograd function whose transpose is the reduce-scatter: its backward sums the
  unit's gradient over the shard axis, in ``grad_comm_dtype`` on the wire, and returns this
  rank's shard in ``main_grads_dtype``;
* saved-tensor hooks that store a gathered param saved for backward as a token and re-gather
  the unit when backward unpacks it (previous unit prefetched), so full params are not kept
  alive between forward and backward and the unit is not recomputed.

Under ``optim_grads`` (ZeRO-2) the same :class:`GatheredParams` hands out the replicated full
buffers unit by unit, with no gathering and no hooks: what it adds is that each unit's params
enter the autograd graph when the unit runs, so that backward starts the unit's reduce-scatter
as soon as it is done with it (autograd runs later-created nodes first) and the full gradients
of only about one unit are alive at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless
from torch.nn.utils._named_member_accessor import NamedMemberAccessor

from funcshard import collectives
from funcshard import reduce as reduce_lib
from funcshard import sharding as shard_lib
from funcshard.layout import ROOT_UNIT, Layout

__all__ = ["functional_call", "GatheredParams", "StepParams"]


def functional_call(
    model: nn.Module,
    params: Any,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    strict: bool = False,
) -> Any:
    """Calls ``model`` with ``params`` in place of its parameters.

    Like ``torch.func.functional_call``; ``params`` may also be what ``train_step`` hands to
    ``loss_fn`` (a :class:`StepParams` dict, or :class:`GatheredParams` under ZeRO-2/3). The
    model then keeps those params until the step's backward is over, so that activation
    checkpointing (``torch.utils.checkpoint``, non-reentrant) recomputes with the weights of
    this step, not with the module's own stale ones.
    """
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = kwargs or {}
    if isinstance(params, (GatheredParams, StepParams)) and params.closed:
        raise RuntimeError("functional_call: these params belong to a train_step that has "
                           "finished; use them only inside loss_fn")
    if isinstance(params, GatheredParams):
        return params._call(model, args, kwargs)
    if isinstance(params, StepParams):
        params.stack.callback(_Swap(model, params, strict=strict).restore)
        return model(*args, **kwargs)
    return torch.func.functional_call(model, params, args, kwargs, strict=strict)


class _Swap:
    """The model's tensors swapped for given ones (tied names included) until ``restore``.

    The one way funcshard puts params into a module; unlike a context manager it can stay
    past the call that made it (until backward is over) and be ``replace``d meanwhile.
    """

    def __init__(self, module: nn.Module, tensors: Mapping[str, torch.Tensor], *,
                 strict: bool = False) -> None:
        self._module = module
        self._accessor = NamedMemberAccessor(module)
        untied = stateless._untie_named_tensors_map(module, tensors)
        if strict:
            missing, unexpected = self._accessor.check_keys(untied)
            if missing or unexpected:
                raise RuntimeError(f"functional_call: missing keys {missing}, unexpected keys "
                                   f"{unexpected} for {type(module).__name__}")
        self._orig, _ = self._accessor.swap_tensors_dict(untied, allow_missing=True)

    def replace(self, tensors: dict[str, torch.Tensor]) -> None:
        """Swaps in other tensors, dropping the current ones (the originals stay kept)."""
        self._accessor.swap_tensors_dict(
            stateless._untie_named_tensors_map(self._module, tensors), allow_missing=True)

    def restore(self) -> None:
        self._accessor.swap_tensors_dict(self._orig, allow_missing=True)


class StepParams(dict):
    """``{name: param}`` that ``train_step`` hands to ``loss_fn`` under ZeRO-0/1.

    ``functional_call`` swaps them into the model until ``close()``, which ``train_step``
    calls after backward.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stack = contextlib.ExitStack()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.stack.close()


@dataclasses.dataclass(frozen=True)
class _Token:
    """A gathered param saved for backward, as a recipe to re-gather it."""

    bucket: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Gather(torch.autograd.Function):
    """Forward: a bucket's full params (all-gathered under ZeRO-3, the replicated buffer under
    ZeRO-2). Backward: reduce-scatter its gradient."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, gp: GatheredParams, bucket: int):  # noqa: ARG004
        ctx.gp, ctx.bucket = gp, bucket
        full = gp._full(bucket)
        specs = gp.layout.bucket_leaves(gp.layout.buckets[bucket])
        return tuple(shard_lib.full_view(full, s, gp.layout.shard_size) for s in specs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return ctx.gp.reducer.reduce(ctx.bucket, grads), None, None


class Reducer:
    """The backward half of the params: each bucket's gradient, reduced over "shard" and
    accumulated into ``acc`` (this rank's shards, in main-grads dtype) as backward goes.

    A bucket's reduce-scatter starts as soon as backward has its gradient and overlaps the
    rest of backward; at most one is in flight, so about one unit's unreduced gradient waits
    beside the one being computed. The result goes straight into the accumulator, not through
    autograd: the carrier only receives a zero-stride zero, so no second copy of the gradients
    is alive at the end of a microbatch, and a bucket that entered the graph twice is simply
    reduced twice (the reduction is linear). ``backward`` waits for everything it started.
    """

    def __init__(self, layout: Layout, acc: list[torch.Tensor | None] | None = None) -> None:
        self.layout = layout
        self.acc: list[torch.Tensor | None] = acc if acc is not None else [None] * len(
            layout.buckets)
        zero = {b.dtypes.grad: torch.zeros(1, dtype=b.dtypes.grad, device=layout.device)
                for b in layout.buckets}
        self._zeros = [zero[b.dtypes.grad].expand(b.numel) for b in layout.buckets]
        self.carriers = tuple(z.detach().requires_grad_() for z in self._zeros)
        self._in_flight: list[tuple[int, collectives.Pending]] = []

    def reduce(self, bucket: int, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """Starts reducing a bucket's full gradients; returns the carrier's (dummy) gradient."""
        b = self.layout.buckets[bucket]
        specs = self.layout.bucket_leaves(b)
        sections = shard_lib.to_rank_sections(list(grads), specs, self.layout.shard_size,
                                              b.dtypes.comm)
        self.finish()
        self._in_flight.append((bucket, reduce_lib.start_reduce_shard_axis(self.layout, b,
                                                                           sections)))
        return self._zeros[bucket]

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
        try:
            torch.autograd.grad(loss, self.carriers, allow_unused=True)
        finally:
            self.finish()
        return self.acc


class GatheredParams(Mapping):
    """Params for one forward/backward, entering the graph unit by unit as the model runs.

    ZeRO-3 (``optim_grads_params``): ``buffers`` are this rank's compute shards, each unit is
    gathered just before it runs. ZeRO-2 (``optim_grads``, ``replicated=True``): ``buffers``
    are the replicated full compute buffers, used as they are. Either way the unit's params
    enter the autograd graph when it runs, so backward reaches their reduce-scatter as soon as
    it is done with the unit; ``gp.reducer.backward(loss)`` adds, per bucket, this rank's shard
    of the gradient reduced over the shard axis to ``acc``, in the bucket's main-grads dtype.

    It is also a read-only mapping from parameter name to the full parameter, for a
    ``loss_fn`` that uses a parameter outside the model call (a penalty, a tied head):
    ``params[name]`` brings in its bucket (gathering it under ZeRO-3) as one more use in the
    graph, and its gradient is reduced and accumulated like the model's. Every rank must take
    the same params by name: each one is a collective (the reduce-scatter in backward).
    """

    def __init__(self, layout: Layout, buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
                 *, replicated: bool = False, acc: list[torch.Tensor | None] | None = None
                 ) -> None:
        self.layout = layout
        self.shards = buffers
        self.replicated = replicated
        self.reducer = Reducer(layout, acc)
        self._by_unit: dict[int, list[int]] = {}
        for b in layout.buckets:
            self._by_unit.setdefault(b.unit, []).append(b.index)
        self._order: list[int] = []  # units in the order forward ran them
        self._outside: dict[int, tuple[torch.Tensor, ...]] = {}  # buckets taken by name
        self._stack = contextlib.ExitStack()  # what stays until backward is over
        self.closed = False
        self._names = frozenset(layout.names)
        self._pending: dict[int, collectives.Pending] = {}
        self._storages: dict[int, tuple[int, weakref.ref]] = {}  # data_ptr -> (bucket, buffer)
        self._saved_refs: dict[int, int] = {}
        self._regathered: dict[int, torch.Tensor] = {}

    # --- mapping ----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if self.closed:
            raise RuntimeError(f"params[{name!r}]: these params belong to a train_step that "
                               "has finished; use them only inside loss_fn")
        spec = self.layout.leaf(name)  # KeyError naming the param when unknown
        views = self._outside.get(spec.bucket)
        if views is None:
            views = _Gather.apply(self.reducer.carriers[spec.bucket], self, spec.bucket)
            self._outside[spec.bucket] = views
        specs = self.layout.bucket_leaves(self.layout.buckets[spec.bucket])
        return views[[s.name for s in specs].index(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __contains__(self, name: object) -> bool:  # a membership test gathers nothing
        return name in self._names

    def __len__(self) -> int:
        return len(self.layout.names)

    # --- gathering --------------------------------------------------------------------------
    def _prefetch(self, unit: int) -> None:
        if self.replicated:
            return
        for b in self._by_unit.get(unit, ()):
            if b not in self._pending:
                self._pending[b] = collectives.all_gather(
                    self.shards[b], self.layout.shard_group, async_op=True
                )

    def _full(self, bucket: int) -> torch.Tensor:
        """The bucket's full buffer, from a prefetch if one is in flight."""
        if self.replicated:
            return self.shards[bucket].detach()  # outputs alias it, not autograd views of it
        pending = self._pending.pop(bucket, None)
        if pending is None:
            pending = collectives.all_gather(self.shards[bucket], self.layout.shard_group,
                                             async_op=True)
        specs = self.layout.bucket_leaves(self.layout.buckets[bucket])
        full = shard_lib.from_rank_sections(pending.wait(), specs, self.layout.shard_size)
        del pending
        if self.layout.shard_size > 1:  # with one shard the "full" buffer is the shard itself
            collectives.track_gathered(full)
        self._storages[full.untyped_storage().data_ptr()] = (bucket, weakref.ref(full))
        return full

    def _unit_params(self, unit: int, prefix: str) -> dict[str, torch.Tensor]:
        strip = len(prefix) + 1 if prefix else 0
        params = {}
        for b in self._by_unit.get(unit, ()):
            specs = self.layout.bucket_leaves(self.layout.buckets[b])
            views = _Gather.apply(self.reducer.carriers[b], self, b)
            params.update({s.name[strip:]: v for s, v in zip(specs, views, strict=True)})
        return params

    # --- saved tensors ------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self._storages.get(ptr)
        if entry is None or entry[1]() is None:
            return t
        bucket = entry[0]
        self._saved_refs[bucket] = self._saved_refs.get(bucket, 0) + 1
        return _Token(bucket, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Token):
            return x
        full = self._regathered.get(x.bucket)
        if full is None:
            unit = self.layout.buckets[x.bucket].unit
            for b in self._by_unit[unit]:
                if b not in self._regathered and self._saved_refs.get(b, 0) > 0:
                    self._regathered[b] = self._full(b)
            self._prefetch_backward(unit)
            full = self._regathered[x.bucket]
        self._saved_refs[x.bucket] -= 1
        if self._saved_refs[x.bucket] <= 0:
            self._regathered.pop(x.bucket, None)
        return full.as_strided(x.size, x.stride, x.offset)

    def _prefetch_backward(self, unit: int) -> None:
        """Starts gathering the unit that ran before ``unit`` in forward, if backward needs it.

        The root unit spans the whole forward; backward reaches it first (the head), so after
        the root comes the unit that ran last.
        """
        i = self._order.index(unit) if unit in self._order else 0
        previous = self._order[-1] if i == 0 else self._order[i - 1]
        if previous == unit:
            return
        for b in self._by_unit.get(previous, ()):
            needed = self._saved_refs.get(b, 0) > 0 and b not in self._regathered
            if needed and b not in self._pending:
                self._pending[b] = collectives.all_gather(
                    self.shards[b], self.layout.shard_group, async_op=True)

    # --- running the model ----------------------------------------------------------------
    def _call(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Runs the model with the units patched to bring their params in; the patches and
        the root's params stay until ``close()`` (after backward), for recomputation."""
        hooks = (contextlib.nullcontext() if self.replicated else
                 torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        with hooks:
            root = self._stack.enter_context(self._running(model))
            swap = _Swap(model, root)
            self._stack.callback(swap.restore)
            try:
                out = model(*args, **kwargs)
            finally:
                self._pending.clear()  # a prefetch of a unit forward did not run
        if not self.replicated:
            # The gathered root goes with forward (backward re-gathers what it saved); a later
            # use, such as a recomputation inside a unit, finds meta tensors and fails loudly.
            swap.replace({n: torch.empty(t.shape, dtype=t.dtype, device="meta")
                          for n, t in root.items()})
            root.clear()
        return out

    def close(self) -> None:
        """Gives the model its own parameters back (after backward)."""
        self.closed = True
        self._stack.close()

    @contextlib.contextmanager
    def _running(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        units = self.layout.units
        modules = [model.get_submodule(prefix) if prefix else model for prefix in units]
        patched = []
        for unit in range(1, len(units)):
            module = modules[unit]
            if "forward" in module.__dict__:
                raise RuntimeError(f"unit {units[unit]!r} already has an instance forward")
            module.forward = self._unit_forward(unit, units[unit], module)
            patched.append(module)
        try:
            self._order.append(ROOT_UNIT)
            root = self._unit_params(ROOT_UNIT, "")
            # Unit params stand in as meta tensors until the unit runs: a use outside of it
            # fails loudly instead of silently taking the module's stale weights.
            for spec in self.layout.leaves:
                if spec.unit != ROOT_UNIT:
                    root[spec.name] = torch.empty(spec.shape, dtype=spec.dtypes.compute,
                                                  device="meta")
            self._prefetch(1)
            yield root
        finally:
            for module in patched:
                del module.forward
            self._pending.clear()

    def _unit_forward(self, unit: int, prefix: str, module: nn.Module):
        original = type(module).forward.__get__(module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            # in backward this is a recomputation (activation checkpointing): no prefetch
            recompute = torch._C._current_graph_task_id() != -1
            if not recompute:
                self._order.append(unit)
            params = self._unit_params(unit, prefix)
            if unit + 1 < len(self.layout.units) and not recompute:
                self._prefetch(unit + 1)
            swap = _Swap(module, params)
            if self.replicated:
                # ZeRO-2 params are views of persistent buffers: the unit keeps them until
                # backward is over, so a recomputation inside the unit sees this step's
                # weights, and they are the very tensors of the graph.
                self._stack.callback(swap.restore)
                return original(*args, **kwargs)
            try:  # ZeRO-3: the gathered params go when the unit returns
                return original(*args, **kwargs)
            finally:
                swap.restore()

        return forward
