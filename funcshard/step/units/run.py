"""The run and its units: each unit's params enter the autograd graph when the unit runs.

One :class:`UnitRun` serves one forward/backward of ``train_step``. It owns a :class:`Unit` per
gather unit of the layout (the root, then every unit module), a :class:`Gatherer` (the
collectives and prefetches), the :class:`Reducer` (the backward half: reduce-scatter into the
gradient accumulator) and, under ZeRO-3, :class:`SavedParams` (the saved-tensor codec). The
Mapping that ``loss_fn`` reads, :class:`~funcshard.step.functional.GatheredParams`, only points at
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

A unit module the user compiled in place (``module.compile()``, which compiles ``_call_impl``
with its hooks), or that ``fs.init(compile=...)`` compiles (:mod:`funcshard.step.compiling`), gets
the pre/post-forward phases around its compiled call instead of as module hooks
(:func:`_around`): as FSDP2's hooks, they stay out of dynamo's trace.

Outside of its unit a param is a placeholder: any use raises :class:`UnitParamsError`, naming
it, instead of silently taking the module's own (stale) weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor
from torch.utils.hooks import RemovableHandle

from funcshard.comm.grads import ReplicateAxis
from funcshard.layout.layout import ROOT_UNIT, Layout
from funcshard.step.compiling import Backend, check_not_compiled_around_units, compiled_call
from funcshard.step.functional import GatheredParams, Swap
from funcshard.step.reduction import Sink
from funcshard.step.units.gather import Gatherer, GatherFn
from funcshard.step.units.phase import Phase, UnitState
from funcshard.step.units.placeholders import absent
from funcshard.step.units.reducer import Reducer
from funcshard.step.units.saved import SavedParams

__all__ = ["UnitRun", "Unit"]


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors requiring grad in a module's output (tensors, tuples, lists, mappings)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _grad_tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in _grad_tensors(o)]
    return []


def _relative(aliases: tuple[tuple[str, str], ...], prefix: str) -> tuple[tuple[str, str], ...]:
    """The tied (alias, name) pairs of the module at ``prefix``, relative to it (the root: all
    of them)."""
    if not prefix:
        return aliases
    head = prefix + "."
    n = len(head)
    return tuple((a[n:], p[n:]) for a, p in aliases if a.startswith(head) and p.startswith(head))


def _around(unit: Unit, module: nn.Module, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A compiled module's call with the unit's pre/post-forward around it, not inside it.

    ``module.compile()`` compiles ``_call_impl``, forward hooks included: hooks registered on
    the module would be traced (gathers, swaps, placeholders, saved-tensor bookkeeping: graph
    breaks, then a placeholder read by dynamo). As FSDP2 keeps its hooks out of dynamo, the
    unit's phases run here, eagerly, and the compiled call sees only the gathered params (graph
    inputs, so a new gather each step compiles nothing new)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        unit.pre_forward(module, args)
        try:
            output = compiled(*args, **kwargs)
        except BaseException:
            unit.post_forward(module, args, None)
            raise
        unit.post_forward(module, args, output)
        return output

    return call


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
        self.aliases = _relative(run.layout.aliases, self.prefix)  # tied names in the module
        self._lookups: NamedMemberAccessor | None = None  # the module's submodule lookups
        self._forward_swap: Swap | None = None  # the root's, kept until close
        self.buckets = run.buckets_of.get(index, [])
        self.held: dict[int, torch.Tensor] = {}
        self._swap: Swap | None = None  # the module's params while gathered in backward
        self.state = UnitState.IDLE
        self._awaiting_post: set[int] = set()  # buckets re-gathered whose backward is due
        self._reduced: set[int] = set()  # buckets whose post-backward has run

    def _accessor(self, module: nn.Module) -> NamedMemberAccessor:
        """The module's submodule lookups, kept for the run's swaps of this unit."""
        if self._lookups is None or self._lookups.module is not module:
            self._lookups = NamedMemberAccessor(module)
        return self._lookups

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
            views = GatherFn.apply(self.run.reducer.carriers[b], self, b)
            params.update(
                {
                    s.name[strip:]: self.run.as_model(s.name, v)
                    for s, v in zip(specs, views, strict=True)
                }
            )
        return params

    def _gather(self, buckets: list[int]) -> None:
        for b in buckets:
            if b not in self.held:
                self.held[b] = self.run.full(b)

    # --- forward -----------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        if not self.buckets:
            return
        if self.run.phase is Phase.BACKWARD:  # recompute (activation checkpointing)
            self.enter_backward(module)
            return
        self.state = UnitState.FORWARD
        self.run.order.append(self.index)
        self._gather(self.buckets)
        params = self._views()
        self.run.prefetch_forward(self.index + 1)
        swap = Swap(module, params, aliases=self.aliases, accessor=self._accessor(module))
        if self.run.replicated:
            # ZeRO-2 params are views of persistent buffers: the unit keeps them until
            # backward is over, so a recomputation sees this step's weights, and they are the
            # very tensors of the graph.
            self.run.stack.callback(swap.restore)
        else:
            self._swap = swap

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG002
        if not self.buckets or self.run.replicated or self.run.phase is Phase.BACKWARD:
            return
        self.state = UnitState.IDLE
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
        if self.state is UnitState.BACKWARD:
            return
        self.state = UnitState.BACKWARD
        self._gather(self.buckets)
        self.run.prefetch_backward(self.index)
        # Backward runs without grad mode; the recomputation must see params that require
        # grad, as forward's did, or autograd saves other tensors than it saved in forward.
        with torch.enable_grad():
            self._swap = Swap(
                module, self._views(), aliases=self.aliases, accessor=self._accessor(module)
            )

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
        self._reduced.add(bucket)
        self._awaiting_post.discard(bucket)
        self.maybe_release(bucket)

    def maybe_release(self, bucket: int) -> None:
        """Drops a re-gathered bucket once backward is done with it (and with the tokens)."""
        if bucket in self._awaiting_post:
            return
        if self.run.saved is not None and self.run.saved.refs.get(bucket, 0) > 0:
            return
        self.held.pop(bucket, None)
        if not self.held and self.state is UnitState.BACKWARD:
            self._swap.restore()
            self._swap = None
            self.state = UnitState.IDLE

    def close(self) -> None:
        if self._swap is not None:
            self._swap.restore()
            self._swap = None
        self.state = UnitState.IDLE
        self.held.clear()
        self._awaiting_post.clear()
        self._reduced.clear()


class _RootUnit(Unit):
    """The root: gathered before the model runs, kept to the end of forward. Backward
    re-gathers it when it first needs a param the root saved (a token), not before: it is not
    hooked for a recomputation, which would keep the root gathered through all of backward."""

    def pre_forward(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        layout = self.run.layout
        self.run.order.append(ROOT_UNIT)
        self._gather(self.buckets)
        params = self._views()
        # Unit params stand in as placeholders until the unit runs: a use outside of it fails
        # loudly instead of silently taking the module's stale weights.
        params.update(absent(layout, [s.name for s in layout.leaves if s.unit != ROOT_UNIT]))
        self.run.prefetch_forward(ROOT_UNIT + 1)
        self._forward_swap = Swap(
            module, params, aliases=self.aliases, accessor=self._accessor(module)
        )
        self.run.stack.callback(self._forward_swap.restore)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG002
        self.run.gatherer.drop_prefetches()  # a prefetch of a unit forward did not run
        if self.run.replicated:
            return
        # The gathered root goes with forward (backward re-gathers what it saved).
        names = [s.name for s in self.run.layout.leaves if s.unit == ROOT_UNIT]
        self._forward_swap.replace(absent(self.run.layout, names))
        self.held.clear()

    def backward_full(self, bucket: int) -> torch.Tensor:
        """The re-gathered bucket for a saved token. The first one re-gathers the root whole
        (every bucket whose backward is still due), as pre-backward does a unit: what moves
        depends on the units, not on how optimizer rules, dtypes or offload split a unit into
        buckets (a bucket of the first layer's weight saves nothing, its input needing no
        gradient, yet moves with the rest), so ``fs.plan`` counts it from shapes alone."""
        if bucket not in self.held:
            due = self.due()  # holds ``bucket``: its token is being unpacked
            self._awaiting_post.update(b for b in due if b not in self._reduced)
            self._gather(due)
            self.run.prefetch_backward(self.index)
        return self.held[bucket]

    def due(self) -> list[int]:
        """What a re-gather of the root brings: nothing while no token of a bucket not held
        waits (none will be unpacked), else every bucket not held whose backward is still due
        or whose tokens wait."""
        refs = self.run.saved.refs
        if not any(refs.get(b, 0) > 0 for b in self.buckets if b not in self.held):
            return []
        return [
            b
            for b in self.buckets
            if b not in self.held and (b not in self._reduced or refs.get(b, 0) > 0)
        ]


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
            views = GatherFn.apply(self.run.reducer.carriers[spec.bucket], self, spec.bucket)
            self.views[spec.bucket] = views
        specs = layout.bucket_leaves(layout.buckets[spec.bucket])
        return self.run.as_model(name, views[[s.name for s in specs].index(name)])


class UnitRun:
    """One forward/backward of ``train_step`` under ZeRO-2/3: the units, their hooks, the
    gathers and the reduce-scatters.

    ZeRO-3 (``optim_grads_params``): ``buffers`` are this rank's compute shards, each unit is
    gathered just before it runs. ZeRO-2 (``replicated=True``): ``buffers`` are the replicated
    full compute buffers, used as they are. ``run.backward(loss)`` adds, per bucket,
    the microbatch's gradients to ``sink`` (:mod:`funcshard.step.reduction`): this rank's shard
    reduced over the shard axis added into an accumulator (``AddInto``), in the bucket's
    main-grads dtype; the unreduced rank sections (``KeepSections``: a deterministic step
    reduces its microbatches' sum once); or the earlier microbatches' tree completed and
    reduced (``CompleteTree``); with ``replicate`` (the step's last
    microbatch) it starts each bucket's replicate-axis reduction once the bucket's sum is
    final. ``run.params`` is what ``loss_fn`` gets.
    """

    def __init__(
        self,
        layout: Layout,
        buffers: list[torch.Tensor] | tuple[torch.Tensor, ...],
        sink: Sink | None = None,
        *,
        replicated: bool = False,
        replicate: ReplicateAxis | None = None,
        backend: Backend = None,
    ) -> None:
        self.layout = layout
        self.backend = backend  # fs.init's compile: unit modules the user did not compile
        self.replicated = replicated
        self.phase = Phase.FORWARD
        self.gatherer = Gatherer(layout, buffers, replicated)
        self.reducer = Reducer(layout, sink, replicate)
        self.saved = None if replicated else SavedParams(self.holder_of)
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

    def as_model(self, name: str, view: torch.Tensor) -> torch.Tensor:
        """A gathered param as the model holds it (a DTensor for a tensor-parallel one)."""
        tensor = self.layout.tensor
        return tensor.wrap(name, view)

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
        check_not_compiled_around_units(
            model, [u.prefix for u in self.units[1:]], self.layout.strategy
        )
        self._hooked.add(id(model))
        for unit in self.units[1:]:
            module = model.get_submodule(unit.prefix)
            # the user's module.compile(), else funcshard's compile=, else None (eager)
            compiled = compiled_call(module, self.backend)
            if compiled is not None:
                user = getattr(module, "_compiled_call_impl", None)
                module._compiled_call_impl = _around(unit, module, compiled)
                self.stack.callback(setattr, module, "_compiled_call_impl", user)
                continue
            handles: list[RemovableHandle] = [
                module.register_forward_pre_hook(unit.pre_forward),
                module.register_forward_hook(unit.post_forward, always_call=True),
            ]
            for handle in handles:
                self.stack.callback(handle.remove)

    # --- scheduling -----------------------------------------------------------------------
    def holder_of(self, bucket: int) -> Unit:
        """The unit whose params ``bucket`` packs."""
        return self.units[self.layout.buckets[bucket].unit]

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
        the root where its backward is still due (see ``_RootUnit.backward_full``).
        """
        if self.replicated or not self.order:
            return
        i = self.order.index(unit) if unit in self.order else 0
        previous = self.order[-1] if i == 0 else self.order[i - 1]
        if previous == unit:
            return
        source = self.units[previous]
        if isinstance(source, _RootUnit):
            self.gatherer.prefetch(source.due())
        else:
            self.gatherer.prefetch(b for b in source.buckets if b not in source.held)

    def backward(self, loss: torch.Tensor) -> list[torch.Tensor | None]:
        """The run's backward: backpropagates ``loss`` and returns the reducer's accumulator
        (None where no gradient reached a bucket)."""
        if self.phase is not Phase.FORWARD:
            raise RuntimeError(f"UnitRun.backward: the run is in phase {self.phase.value}")
        self.phase = Phase.BACKWARD
        try:
            return self.reducer.backward(loss)
        finally:
            self.phase = Phase.DONE

    def close(self) -> None:
        """Removes the hooks and gives the model its own parameters back (after backward)."""
        self.closed = True
        self.gatherer.drop_prefetches()
        for unit in reversed(self.units):
            unit.close()
        self.stack.close()
        # What the run held goes now, not when the run does: the params loss_fn got keep
        # the run alive as long as a caller keeps them. And the references between the run's
        # objects go, so that no cycle is left for Python's cycle collector.
        self.gatherer.close()
        self.reducer.close()
        self.units, self.saved, self._outside, self.params = [], None, None, None
