"""TrainState: the immutable training state (``fs.init`` builds it: :mod:`funcshard.step.init`).

The one source of truth per weight is the master flat buffer of its bucket (on the device, or
on the CPU for an offloaded bucket). Everything else is derived from it by
:func:`derive_compute`: the full compute params of ZeRO 0-2, the device compute shard of an
offloaded ZeRO-3 bucket. ZeRO-3 buckets on the device keep no compute copy at all: their shard
is cast from the master at gather time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh

from funcshard.layout import sharding as shard_lib
from funcshard.layout.buckets import NAMESPACE, map_parts
from funcshard.layout.layout import Layout
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.optim import Optimizer
from funcshard.parallel.context import NO_CONTEXT
from funcshard.state import donation
from funcshard.state.buffers import NO_BUFFERS, ModelBuffers
from funcshard.state.derive import derive_compute
from funcshard.state.donation import ConsumedStateError

__all__ = [
    "TrainState",
    "Donation",
    "ConsumedStateError",
    "LossScale",
    "derive_compute",
    "tree",
]

tree = optree.pytree.reexport(namespace=NAMESPACE, module="funcshard.tree")


class LossScale(NamedTuple):
    """Dynamic loss scale for fp16 compute: the scale and finite steps since it last changed."""

    scale: float
    good_steps: int


@dataclasses.dataclass(frozen=True, eq=False)
class Static:
    layout: Layout
    optimizer: Optimizer
    compile: Any = None  # fs.init's compile: the torch.compile backend of the unit modules
    guard: Any = None  # fault tolerance's seam (funcshard.fault.seam): SOLO or a Group
    check_replicas_every: int = 0  # train_step compares replicas' bits every N steps (0: never)
    buffers: ModelBuffers = NO_BUFFERS  # the model's persistent buffers, which checkpoints carry
    context: Any = NO_CONTEXT  # fs.init's context: funcshard.parallel.context's seam
    pipeline: Any = None  # fs.init's pipeline: funcshard.step.pipelined.PipelineRun, or None


class Leaves(NamedTuple):
    """A state's leaves, declared once (the pytree children, in this order): the master flat
    buffer of every bucket, their derived compute copies, the optimizer state, the step and
    fp16's loss scale. Everything else of a state is static metadata (:class:`Static`)."""

    master: tuple[torch.Tensor, ...]
    compute: tuple[torch.Tensor | None, ...]
    opt_state: Any
    step: int
    loss_scale: LossScale | None

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> Leaves:
        """The leaves given by position or name, normalized (tuples of buffers, an int step)."""
        leaves = cls(*args, **kwargs)
        return leaves._replace(
            master=tuple(leaves.master), compute=tuple(leaves.compute), step=int(leaves.step)
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Donation:
    """What a consuming function gets of the state it consumed: the leaves (whose buffers it
    may now reuse) and the static metadata, to build the state it returns. Each leaf reads
    as an attribute (``d.master``, ``d.step``, ...)."""

    leaves: Leaves
    static: Static

    def __getattr__(self, name: str) -> Any:  # a leaf by its name (Leaves' fields)
        if name in Leaves._fields:
            return getattr(self.leaves, name)
        raise AttributeError(name)

    @property
    def layout(self) -> Layout:
        return self.static.layout

    @property
    def optimizer(self) -> Optimizer:
        return self.static.optimizer

    def replace(self, **changes: Any) -> Donation:
        """The same donation with some leaves changed."""
        return Donation(self.leaves._replace(**changes), self.static)

    def state(self, **changes: Any) -> TrainState:
        """A new state with this one's static metadata and leaves, ``changes`` replaced."""
        return TrainState(*self.leaves._replace(**changes), static=self.static)


class TrainState:
    """Params (master shards), optimizer state, step and loss scale, as an optree pytree.

    Leaves: ``master`` (one flat buffer per bucket), ``compute`` (derived, per bucket, None
    where not kept), ``opt_state`` (the optimizer's state over the master buffers), ``step``,
    ``loss_scale``. Static (off the leaves): layout (mesh, policy, strategy, shard layout) and
    the optimizer.

    Donation: ``train_step``, ``offload_step`` and ``restore(like=...)`` donate their input
    state (like JAX's ``donate_argnums``): they reuse its buffers; ``restore`` donates
    ``like`` only once every rank has checked the checkpoint (a failed check leaves it), and
    a restore that fails after that leaves it refusing use, naming the failure.
    Liveness is per buffer: every state that shares a buffer with a donated one (made by
    ``replace``, ``fs.tree.map``, unflatten, ...) raises :class:`ConsumedStateError` on any use
    afterwards; a copy whose tensors are new
    (``fs.tree.map(lambda x: x.clone() if torch.is_tensor(x) else x, state)``: ``step`` is an
    int leaf) is independent. Tensors read out of a state (``state.master``, ``state.params``,
    ...) are views of its buffers, which a later donation overwrites; ``fs.full_params``
    returns fresh tensors.
    """

    __slots__ = ("_leaves", "_static", "_live")

    def __init__(self, *leaves: Any, static: Static, **named: Any) -> None:
        """``leaves``: those of :class:`Leaves`, by position or name."""
        object.__setattr__(self, "_leaves", Leaves.of(*leaves, **named))
        object.__setattr__(self, "_static", static)
        master, compute, opt_state = self._leaves[:3]
        opt_leaves = optree.tree_leaves(opt_state, none_is_leaf=True, namespace=NAMESPACE)
        object.__setattr__(self, "_live", donation.liveness((*master, *compute, *opt_leaves)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TrainState is immutable; functions return a new one")

    def check(self) -> None:
        """Raises :class:`ConsumedStateError` if this state (or one sharing a buffer with it)
        was donated."""
        donation.check(self._live)

    def donate(self, by: str, *, release: bool = False) -> Donation:
        """Consumes this state for the function ``by``: this state and every state sharing a
        buffer with it refuse use from now on; the caller gets the leaves to reuse.
        ``release``: this state drops its leaves too, so that the caller alone holds them
        (a buffer the caller does not reuse is then freed once it drops it).

        Raises:
          ConsumedStateError: the state was consumed already.
        """
        donation.consume(self._live, by)
        d = Donation(self._leaves, self._static)
        if release:
            object.__setattr__(
                self, "_leaves", self._leaves._replace(master=(), compute=(), opt_state=None)
            )
        return d

    @property
    def identity(self) -> tuple[Any, ...]:
        """What tells this state from every other one, a state restored in place into its
        buffers included: its buffers' liveness tokens (a donation hands the buffers on with
        fresh ones), compared by ``is``."""
        return self._live

    def spoil(self, by: str) -> None:
        """Records that the function this state was donated to failed after writing into its
        buffers: it (and every state sharing them) refuses use, naming ``by``, since the
        buffers hold neither its values nor a result's."""
        donation.spoil(self._live, by)

    @property
    def consumed(self) -> bool:
        return any(live.consumed_by is not None for live in self._live)

    # --- leaves: each a checked read of Leaves' field of its name (added below the class) ---
    master: tuple[torch.Tensor, ...]
    compute: tuple[torch.Tensor | None, ...]
    opt_state: Any
    step: int
    loss_scale: LossScale | None

    # --- static -------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._static.layout

    @property
    def optimizer(self) -> Optimizer:
        return self._static.optimizer

    @property
    def compile(self) -> Any:
        """The ``torch.compile`` backend ``fs.init(compile=...)`` chose (None: eager)."""
        return self._static.compile

    @property
    def check_replicas_every(self) -> int:
        return self._static.check_replicas_every  # fs.init's; 0: never

    @property
    def buffers(self) -> ModelBuffers:
        """The model's persistent buffers (read from the model itself) that ``fs.save`` writes
        and ``fs.restore`` copies back (:mod:`funcshard.state.buffers`)."""
        return self._static.buffers

    @property
    def context(self) -> Any:
        """How ``train_step`` splits sequences over the context axis (``fs.init``'s
        ``context``: :mod:`funcshard.parallel.context`; ``NO_CONTEXT`` without one)."""
        return self._static.context

    @property
    def pipeline(self) -> Any:
        """This pipeline rank's stages under torch's schedule (``fs.init``'s ``pipeline``:
        :class:`funcshard.step.pipelined.PipelineRun`), or None without a pipeline. The
        layout (``state.mesh`` included) is then this pipeline rank's: its stages'
        parameters over its data-parallel sub-world."""
        return self._static.pipeline

    @property
    def mesh(self) -> DeviceMesh:
        return self.layout.mesh

    @property
    def guard(self) -> Any:
        """How the state's steps start and end across replica groups (``fs.init``'s
        ``fault_tolerance``: :mod:`funcshard.fault.seam`)."""
        return self._static.guard

    @property
    def replicas(self) -> Any:
        """The replica groups of a fault-tolerant state (None without fault tolerance)."""
        return self._static.guard.across

    @property
    def policy(self) -> MixedPrecisionPolicy:
        return self.layout.policy

    @property
    def strategy(self) -> Strategy:
        return self.layout.strategy

    @property
    def outer_strategy(self) -> OuterStrategy:
        return self.layout.outer

    # --- views by parameter name ----------------------------------------------------------
    @property
    def params(self) -> dict[str, torch.Tensor]:
        """This rank's master weights by parameter name (real rows only, no padding)."""
        return self._by_name(self.master)

    def _by_name(self, flats: tuple[torch.Tensor | None, ...]) -> dict[str, torch.Tensor]:
        layout = self.layout
        blocks = getattr(flats, "blocks", None)  # BlockScales: one scale per block of a row
        views = {}
        for i, (bucket, flat) in enumerate(zip(layout.buckets, flats, strict=True)):
            if flat is None:
                continue
            r = layout.over(bucket).shard_rank
            for spec in layout.bucket_leaves(bucket):
                spec = spec if blocks is None else spec.scales(blocks[i])
                views[spec.name] = shard_lib.local_view(flat, spec, r)
        return {n: views[n] for n in layout.names if n in views}

    def opt_state_by_name(self) -> Any:
        """The optimizer state with every per-bucket part keyed by parameter name.

        A bucket the part has no value for (a ``multi_transform`` optimizer that does not own
        it) contributes no names.
        """
        return map_parts(self.opt_state, lambda path, x: self._by_name(x))

    @property
    def filled(self) -> bool:
        """False for a state built from a meta-device model and not yet restored."""
        return not any(t.is_meta for t in self.master)

    def replace(self, **changes: Any) -> TrainState:
        """A new state with some leaves changed; this one stays valid (nothing is donated).

        The two share the buffers they have in common: donating either (``train_step``, ...)
        refuses both.
        """
        return TrainState(*self._leaves._replace(**changes), static=self._static)

    def __repr__(self) -> str:
        if self.consumed:
            return "TrainState(<consumed>)"
        return (
            f"TrainState(step={self._leaves.step}, strategy={self.strategy!r}, "
            + (f"outer_strategy={self.outer_strategy!r}, " if self.layout.hierarchical else "")
            + f"params={len(self.layout.leaves)}, buckets={len(self.layout.buckets)})"
        )


def _leaf_property(index: int, name: str) -> property:
    def read(self: TrainState) -> Any:
        self.check()
        return self._leaves[index]

    return property(read, doc=f"The state's {name} (raises ConsumedStateError once donated).")


for _index, _name in enumerate(Leaves._fields):
    setattr(TrainState, _name, _leaf_property(_index, _name))


def _to_children(state: TrainState):
    state.check()
    return tuple(state._leaves), state._static, Leaves._fields


def _from_children(static: Static, children) -> TrainState:
    return TrainState(*children, static=static)


tree.register_node(TrainState, _to_children, _from_children)
