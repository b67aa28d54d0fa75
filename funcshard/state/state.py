"""TrainState: the immutable training state, and ``init`` which builds it.

The one source of truth per weight is the master flat buffer of its bucket (on the device, or
on the CPU for an offloaded bucket). Everything else is derived from it by
:func:`derive_compute`: the full compute params of ZeRO 0-2, the device compute shard of an
offloaded ZeRO-3 bucket. ZeRO-3 buckets on the device keep no compute copy at all: their shard
is cast from the master at gather time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import mesh as mesh_lib
from funcshard.fault import replicas as fault_lib
from funcshard.layout import sharding as shard_lib
from funcshard.layout.buckets import NAMESPACE, map_parts
from funcshard.layout.build import build_layout
from funcshard.layout.layout import Layout, UnitsArg
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.optim import Optimizer
from funcshard.parallel import tensor as tp_lib
from funcshard.state import donation, replica_check
from funcshard.state.derive import derive_compute, pack_masters
from funcshard.state.donation import ConsumedStateError
from funcshard.step.compiling import (
    Backend,
    backend_of,
    check_units,
    unwrapped,
)

__all__ = [
    "TrainState",
    "Donation",
    "ConsumedStateError",
    "LossScale",
    "init",
    "derive_compute",
    "tree",
    "heal",
    "identity",
]

tree = optree.pytree.reexport(namespace=NAMESPACE, module="funcshard.tree")


class LossScale(NamedTuple):
    """Dynamic loss scale for fp16 compute: the scale and finite steps since it last changed."""

    scale: float
    good_steps: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    layout: Layout
    optimizer: Optimizer
    compile: Backend = None  # fs.init's compile: the torch.compile backend of the unit modules
    replicas: fault_lib.Replicas | None = None
    check_replicas_every: int = 0  # train_step compares replicas' bits every N steps (0: never)


@dataclasses.dataclass(frozen=True, slots=True)
class Donation:
    """What a consuming function gets of the state it consumed: the leaves (whose buffers it
    may now reuse) and the static metadata, to build the state it returns."""

    master: tuple[torch.Tensor, ...]
    compute: tuple[torch.Tensor | None, ...]
    opt_state: Any
    step: int
    loss_scale: LossScale | None
    static: _Static

    @property
    def layout(self) -> Layout:
        return self.static.layout

    @property
    def optimizer(self) -> Optimizer:
        return self.static.optimizer

    def state(self, **changes: Any) -> TrainState:
        """A new state with this one's static metadata and leaves, ``changes`` replaced."""
        return TrainState(**{**_leaves(self), **changes}, static=self.static)


_LEAVES = ("master", "compute", "opt_state", "step", "loss_scale")


def _leaves(obj: Any) -> dict[str, Any]:
    """The leaves of a state (or of a donation) by name."""
    return {name: getattr(obj, name) for name in _LEAVES}


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

    __slots__ = ("_master", "_compute", "_opt_state", "_step", "_loss_scale", "_static", "_live")

    def __init__(
        self,
        master: tuple[torch.Tensor, ...],
        compute: tuple[torch.Tensor | None, ...],
        opt_state: Any,
        step: int,
        loss_scale: LossScale | None,
        static: _Static,
    ) -> None:
        for name, value in (
            ("_master", tuple(master)),
            ("_compute", tuple(compute)),
            ("_opt_state", opt_state),
            ("_step", int(step)),
            ("_loss_scale", loss_scale),
            ("_static", static),
        ):
            object.__setattr__(self, name, value)
        opt_leaves = optree.tree_leaves(opt_state, none_is_leaf=True, namespace=NAMESPACE)
        buffers = (*self._master, *self._compute, *opt_leaves)
        object.__setattr__(self, "_live", donation.liveness(buffers))

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
        d = Donation(
            self._master, self._compute, self._opt_state, self._step, self._loss_scale, self._static
        )
        if release:
            for name in ("_master", "_compute"):
                object.__setattr__(self, name, ())
            object.__setattr__(self, "_opt_state", None)
        return d

    def spoil(self, by: str) -> None:
        """Records that the function this state was donated to failed after writing into its
        buffers: it (and every state sharing them) refuses use, naming ``by``, since the
        buffers hold neither its values nor a result's."""
        donation.spoil(self._live, by)

    @property
    def consumed(self) -> bool:
        return any(live.consumed_by is not None for live in self._live)

    # --- leaves -------------------------------------------------------------------------
    @property
    def master(self) -> tuple[torch.Tensor, ...]:
        self.check()
        return self._master

    @property
    def compute(self) -> tuple[torch.Tensor | None, ...]:
        self.check()
        return self._compute

    @property
    def opt_state(self) -> Any:
        self.check()
        return self._opt_state

    @property
    def step(self) -> int:
        self.check()
        return self._step

    @property
    def loss_scale(self) -> LossScale | None:
        self.check()
        return self._loss_scale

    # --- static -------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._static.layout

    @property
    def optimizer(self) -> Optimizer:
        return self._static.optimizer

    @property
    def compile(self) -> Backend:
        """The ``torch.compile`` backend ``fs.init(compile=...)`` chose (None: eager)."""
        return self._static.compile

    @property
    def check_replicas_every(self) -> int:
        return self._static.check_replicas_every  # fs.init's; 0: never

    @property
    def mesh(self) -> DeviceMesh:
        return self.layout.mesh

    @property
    def replicas(self) -> fault_lib.Replicas | None:
        """The replica groups of a fault-tolerant state (``fs.init(fault_tolerance=...)``)."""
        return self._static.replicas

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
        layout, r = self.layout, self.layout.shard_rank
        blocks = getattr(flats, "blocks", None)  # BlockScales: one scale per block of a row
        views = {}
        for i, (bucket, flat) in enumerate(zip(layout.buckets, flats, strict=True)):
            if flat is None:
                continue
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
        return TrainState(**{**_leaves(self), **changes}, static=self._static)

    def __repr__(self) -> str:
        if self.consumed:
            return "TrainState(<consumed>)"
        return (
            f"TrainState(step={self._step}, strategy={self.strategy!r}, "
            + (f"outer_strategy={self.outer_strategy!r}, " if self.layout.hierarchical else "")
            + f"params={len(self.layout.leaves)}, buckets={len(self.layout.buckets)})"
        )


def _to_children(state: TrainState):
    state.check()
    children = (state._master, state._compute, state._opt_state, state._step, state._loss_scale)
    return children, state._static, ("master", "compute", "opt_state", "step", "loss_scale")


def _from_children(static: _Static, children) -> TrainState:
    return TrainState(*children, static=static)


tree.register_node(TrainState, _to_children, _from_children)


def init(
    model: nn.Module,
    opt: Optimizer,
    *,
    mesh: DeviceMesh,
    policy: MixedPrecisionPolicy | None = None,
    strategy: str | Strategy = "optim_grads_params",
    offload_fraction: float = 0.0,
    units: UnitsArg = None,
    deterministic: bool = False,
    outer_strategy: str | OuterStrategy = "no_shard",
    compile: bool | str | Callable[..., Any] = False,
    fault_tolerance: fault_lib.FaultTolerance | None = None,
    check_replicas_every: int = 0,
    cuda_graphs: bool = False,
) -> TrainState:
    """Shards ``model``'s parameters into a fresh TrainState (collective: call on every rank).

    Args:
      model: holds the initial weights, identical on every rank; a meta-device model gives a
        state without values that ``restore`` must fill. A ``torch.compile(model)`` wrapper
        is read as the model inside it: parameter names, checkpoints and exports are the plain
        model's (``fs.functional_call`` on the wrapper still runs it compiled).
      opt: a pure optimizer from ``funcshard.optim``.
      mesh: from ``make_mesh``; with a tensor axis, DTensor params on ``mesh["tensor"]``
        have their local shards sharded over the data-parallel axes (docs/tensor-parallel.md).
      policy: mixed precision; default fp32 masters and grads, the model's compute dtype.
      strategy: "no_shard" | "optim" | "optim_grads" | "optim_grads_params".
      offload_fraction: share of this rank's optimizer numel stepped on the CPU.
      units: gather units: submodule names or a predicate ``(name, module) -> bool``; None =
        the children of every ``nn.ModuleList``. The remaining params form the root unit.
      deterministic: params, optimizer state and metrics bitwise identical on every world
        size, mesh, strategy and offload fraction that splits the same global batch into the
        same number G = dp_size * microbatches of equal chunks (G a power of two), and across
        save/restore between such layouts (see :mod:`funcshard.layout.determinism` for the cost).
        On CUDA the offload fraction must match too (offloaded buckets step with the CPU
        kernel, which may round differently from the CUDA one).
      outer_strategy: what is sharded over the mesh's "replicate" axis. "no_shard" (HSDP):
        each replica keeps its shard group's masters and optimizer state whole, gradient
        shards are all-reduced over "replicate". "optim" (HFSDP): masters and optimizer
        state are sharded over replicate x shard (1/(R*S) per rank); gradient shards are
        reduce-scattered over "replicate" once per step, after the last microbatch, and the
        updated compute params all-gathered over it once per step.
      compile: True ("inductor"), a ``torch.compile`` backend name or callable: under
        ZeRO-2/3 a microbatch's gathers, ``loss_fn`` and reduce-scatters in one forward and
        one backward graph (where the layout allows; else, with a warning, and under ZeRO-0/1
        each unit's module call: :mod:`funcshard.step.compiling`); recorded in the state's
        static metadata (``state.compile``).
      fault_tolerance: this rank's replica group joins the others through torchft
        (:mod:`funcshard.fault.replicas`): every step averages the gradients over the groups of its
        quorum. A group behind its peers (one that restarts) heals from a live peer here: the
        state returned, step included, is bitwise theirs. Pass the state returned, or a state
        restored after it (its first step then asks for a quorum of its own, and heals it
        from the peers when it is behind them).
      check_replicas_every: N > 0: ``train_step`` runs :func:`funcshard.check_replicas` on
        an input state whose step is a positive multiple of N, before donating it; 0: never.
      cuda_graphs: inductor's ``mode="reduce-overhead"`` (CUDA graph trees); off CUDA, ValueError.

    Raises:
      ValueError: ``deterministic=True`` on a data-parallel size that is not a power of two,
        or with a ``grad_comm_dtype`` other than ``main_grads_dtype``; ``outer_strategy=
        "optim"`` with ``strategy="no_shard"``; ``compile`` with ``deterministic=True``; under
        ZeRO-2/3, a model compiled as a whole around its gather units (compile the units);
        ``fault_tolerance`` with an ``outer_strategy`` other than "no_shard" or a meta model.
      TypeError: ``compile`` neither a bool, a backend name nor a callable.
      ImportError: ``fault_tolerance`` without torchft (``pip install "funcshard[ft]"``).
    """
    if not isinstance(opt, Optimizer):
        raise TypeError(
            f"init: opt must be an fs.optim optimizer, got {type(opt).__name__} "
            "(a gradient transformation goes before one: fs.optim.chain(clip, adamw))"
        )
    every = replica_check.period(check_replicas_every)
    backend = backend_of(compile, deterministic=deterministic, cuda_graphs=cuda_graphs, mesh=mesh)
    policy = policy or MixedPrecisionPolicy()
    given, model = model, unwrapped(model)  # torch.compile(model): the plain model's names
    tensor = tp_lib.read_model(model, mesh_lib.tensor_axis(mesh))
    named = tp_lib.local_params(model)
    fault_lib.check_init(fault_tolerance, outer_strategy, named)
    layout = build_layout(
        {n: (tuple(p.shape), p.dtype) for n, p in named.items()},
        model=model,
        mesh=mesh,
        policy=policy,
        strategy=strategy,
        offload_fraction=offload_fraction,
        units=units,
        partition=opt.partition,
        deterministic=deterministic,
        outer_strategy=outer_strategy,
        tensor=tensor,
    )
    check_units(given, layout, backend)
    if layout.hierarchical:
        mesh_lib.master_group(layout.mesh)  # made here, where every rank is: a collective
    master = pack_masters(layout, named)
    replicas = fault_tolerance and fault_lib.Replicas(fault_tolerance, layout.device)
    state = TrainState(
        master=master,
        compute=derive_compute(layout, master),
        opt_state=opt.init(layout.per_bucket(master)),
        step=0,
        loss_scale=_initial_loss_scale(layout),
        static=_Static(layout, opt, backend, replicas, every),
    )
    if replicas is None:
        return state
    state, _ = heal(state, replicas.join(lambda: state_dict(state), step=0))
    replicas.joined(identity(state))
    return state


def _initial_loss_scale(layout: Layout) -> LossScale | None:
    """fp16 compute's dynamic loss scale at its start (None: no fp16 bucket)."""
    fp16 = any(b.dtypes.compute == torch.float16 for b in layout.buckets)
    return LossScale(float(layout.policy.loss_scale_init), 0) if fp16 else None


def identity(state: TrainState) -> tuple[Any, ...]:
    """What tells a state from every other one, a state restored in place into its buffers
    included: its buffers' liveness tokens (a donation hands the buffers on with fresh
    ones), compared by ``is``."""
    return state._live


def state_dict(state: TrainState) -> dict[str, Any]:
    """What a healing replica group receives: every value of ``state`` but the derived
    compute copies (masters, optimizer state, step, loss scale; offloaded parts included)."""
    leaves = optree.tree_leaves(state.opt_state, none_is_leaf=True, namespace=NAMESPACE)
    ls = state.loss_scale
    return {
        "master": list(state.master),
        "opt_state": list(leaves),
        "step": state.step,
        "loss_scale": None if ls is None else [ls.scale, ls.good_steps],
    }


def heal(state: TrainState, received: dict[str, Any] | None) -> tuple[TrainState, bool]:
    """A fault-tolerant state after its group's quorum: ``state`` itself when no rank of the
    group healed, else (donated) with the peer's values where this rank received them
    (``received``, from :meth:`funcshard.fault.replicas.Replicas.quorum`) and every rank's compute
    copies derived again (the ranks of a group agree first: torchft may heal one rank of a
    group and not the other, and under ZeRO-1/2 deriving is an all-gather over the group).

    Returns:
      ``(state, moved)``: ``moved`` when the heal changed the group's step (the caller's
      batch, built for the old step, is then not this state's).
    """
    replicas = state.replicas
    assert replicas is not None, "a fault-tolerant state"
    moved = received is not None and int(received["step"]) != state.step
    healed, moved = replicas.agree(received is not None, moved)
    if not healed:
        return state, False
    return load_state_dict(state, received), moved


def load_state_dict(state: TrainState, received: dict[str, Any] | None) -> TrainState:
    """``state`` (donated) with a peer's values (:func:`state_dict`) copied into its buffers
    (None: its own values) and the compute copies derived from them (a collective)."""
    d = state.donate("heal")
    if received is None:
        return d.state(compute=derive_compute(d.layout, d.master))
    leaves, treedef = optree.tree_flatten(d.opt_state, none_is_leaf=True, namespace=NAMESPACE)
    pairs = enumerate(fault_lib.pairs(d.master, received, "master"))
    master = tuple(fault_lib.copy_into(m, r, f"master[{i}]") for i, (m, r) in pairs)
    opt = [
        fault_lib.copy_into(x, r, f"opt_state leaf {i}") if isinstance(x, torch.Tensor) else r
        for i, (x, r) in enumerate(fault_lib.pairs(leaves, received, "opt_state"))
    ]
    ls = received["loss_scale"]
    return TrainState(
        master=master,
        compute=derive_compute(d.layout, master),
        opt_state=optree.tree_unflatten(treedef, opt),
        step=int(received["step"]),
        loss_scale=None if ls is None else LossScale(float(ls[0]), int(ls[1])),
        static=d.static,
    )
