"""``fs.init``: a model's parameters sharded into a fresh TrainState (collective).

The composition, as ``train_step`` is the step's: the model read (its model-parallel axis,
its local parameters), the layout built, the masters packed and the compute copies derived
from them, the optimizer state initialized, and the state handed to its fault-tolerance guard
(which may heal it from live peers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import mesh as mesh_lib
from funcshard.fault import seam as fault_lib
from funcshard.fault.replicas import FaultTolerance, check_init
from funcshard.layout.build import build_layout
from funcshard.layout.layout import Layout, UnitsArg
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.same_model import InitAgreement
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.optim import Optimizer
from funcshard.parallel import context as context_lib
from funcshard.parallel import expert_axis as expert_lib
from funcshard.parallel.axis import ModelAxis
from funcshard.parallel.context import ContextParallel
from funcshard.parallel.pipeline import Pipeline
from funcshard.state import buffers as buffer_lib
from funcshard.state import replica_check
from funcshard.state.buffers import ModelBuffers
from funcshard.state.derive import derive_compute, pack_masters
from funcshard.state.state import LossScale, Static, TrainState
from funcshard.step import pipeline_init
from funcshard.step.compiling import backend_of, check_units, compile_settings, unwrapped

__all__ = ["init"]


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
    fault_tolerance: FaultTolerance | None = None,
    check_replicas_every: int = 0,
    cuda_graphs: bool = False,
    overlap: bool = True,
    check_tensor_batch: bool = True,
    buffers: str = "broadcast",
    context: ContextParallel | None = None,
    pipeline: Pipeline | None = None,
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
      overlap: under ``compile=`` with inductor, the captured step's graphs compiled with
        inductor's passes that reorder collectives to overlap compute
        (``reorder_for_compute_comm_overlap`` and its passes), keeping the collectives'
        relative order, so that ranks whose shapes differ (uneven rows) issue them in the
        same order. On by default; False leaves inductor's defaults (each gather and
        reduce by sends one blocking op, in the graph's order on every rank), but for
        the record of the graph's collectives, run first, that a failure drains.
      check_tensor_batch: with a tensor axis, ``train_step`` checks that every rank of a
        tensor group passes the same batch (a fingerprint of it, all-gathered over "tensor"
        with the loss: docs/tensor-parallel.md); False skips it, for a data loader known to
        follow torch TP's rule.
      buffers: what keeps the model's persistent buffers (which checkpoints carry from one
        rank) agreeing across the data-parallel ranks: "broadcast" (DDP's rule) sets them to
        the first rank's values after every applied step, and ``check_replicas`` compares
        them; "local" leaves each rank's own. A step that changes nothing (nonfinite,
        not committed) puts back their values from before it either way
        (:mod:`funcshard.state.buffers`).
      context: ``fs.ContextParallel``: sequences split over the mesh's "context" axis
        (``fs.make_mesh(context=C)``); every rank of a context group passes the same batch
        and ``train_step`` keeps its part of each sequence (:mod:`funcshard.parallel.context`).
      pipeline: ``fs.Pipeline``: ``model`` is then the list of stages (``fs.pipeline.split``)
        and ``mesh`` has a "pipeline" axis (``fs.make_mesh(pipeline=P)``); this rank keeps
        its stages (the schedule's placement) and shards their parameters over its
        data-parallel sub-world; ``train_step`` runs torch's schedule
        (:mod:`funcshard.step.pipelined`), the tensor and expert axes inside each stage. Not
        yet with the context axis, ``compile``, ``fault_tolerance``, ``regather=True`` beside
        the tensor or expert axis, or HFSDP on a pipeline rank whose data-parallel ranks are
        both replicated and sharded.

    Raises:
      ValueError: ``deterministic=True`` on a data-parallel size that is not a power of two,
        or with a ``grad_comm_dtype`` other than ``main_grads_dtype``; ``outer_strategy=
        "optim"`` with ``strategy="no_shard"``; ``compile`` with ``deterministic=True``; under
        ZeRO-2/3, a model compiled as a whole around its gather units (compile the units);
        ``fault_tolerance`` with an ``outer_strategy`` other than "no_shard" or a meta model;
        ``buffers`` neither "broadcast" nor "local"; ``context`` with ``compile``, or naming
        a buffer the model lacks; a parameter of ``requires_grad=False`` (named: the step
        trains every parameter; freezing is a zero learning rate of its own label); on every
        rank, where the ranks of the mesh built models of
        other parameter names, shapes or dtypes, or asked for other strategies, units,
        policies, offload fractions, ``deterministic``, ``compile=`` backends or (under
        inductor) ``overlap``, or gave meshes of other shapes
        (naming the first setting or parameter that differs, or the mesh, and the rank:
        :mod:`funcshard.layout.same_model`); on every other rank of the mesh, where one
        rank raised any error before ``fs.init``'s collectives (a bad ``units=``,
        ``offload_fraction``, strategy, policy or ``compile=`` given to it alone): that
        rank raises its own error, the others a ValueError naming it and its error (one
        line), agreed in the same-model check's all-reduce
        (:class:`~funcshard.layout.same_model.InitAgreement`). Not agreed on: an error from
        ``mesh=`` itself (no group to agree over yet) or a KeyboardInterrupt.
      TypeError: ``opt`` not an ``fs.optim`` optimizer; ``policy`` not a
        ``MixedPrecisionPolicy``; ``compile`` neither a bool, a backend name nor a
        callable; ``overlap`` not a bool; a persistent buffer of a dtype no checkpoint
        holds (named, with its dtype).
      ImportError: ``fault_tolerance`` without torchft (``pip install "funcshard[ft]"``).
      TimeoutError: ``fault_tolerance``'s first quorum did not form in time (naming the
        replica group and the lighthouse); the group's torchft manager is shut down, as on
        any error after it was made.
    """
    with InitAgreement(mesh) as agreement:  # what fails on one rank alone fails on every rank
        _check_types(opt, policy)
        _check_trainable(unwrapped(model))
        every = replica_check.period(check_replicas_every)
        hfsdp = OuterStrategy.parse(outer_strategy).shards_optim and outer_strategy
        refused = dict(compile=compile, context=context, fault_tolerance=fault_tolerance)
        refused.update(outer_strategy=hfsdp)  # refused only on a 2-D data-parallel sub-world
        model, mesh, run = pipeline_init.prepare(model, mesh, pipeline, refused)
        backend = backend_of(
            compile, deterministic=deterministic, cuda_graphs=cuda_graphs, mesh=mesh
        )
        settings = compile_settings(backend, overlap)  # compared by the agreement below
        if context is not None and backend is not None:
            raise ValueError("init: context parallel does not run under compile= yet")
        given, model = model, unwrapped(model)  # torch.compile(model): the plain model's names
        tensor, named = _read_model(model, mesh, strategy, check_tensor_batch)
        stages = () if run is None else tuple(run.stages[i] for i in run.mine)
        carried = ModelBuffers.of(model, buffer_lib.mode(buffers), stages)  # before a group joins
        check_init(fault_tolerance, outer_strategy, named)  # its manager is made after the check
        layout = build_layout(
            {n: (tuple(p.shape), p.dtype) for n, p in named.items()},
            model=model,
            mesh=mesh,
            policy=policy or MixedPrecisionPolicy(),
            strategy=strategy,
            offload_fraction=offload_fraction,
            units=units,
            partition=opt.partition,
            deterministic=deterministic,
            outer_strategy=outer_strategy,
            tensor=tensor,
        )
        check_units(given, layout, backend, overlap=overlap)
        bound = context_lib.bind(context, mesh, model)
        agreement.check(layout, named, settings)  # the one collective above; a failure: named
    guard = fault_lib.guard_for(fault_tolerance, mesh_lib.local_device(mesh))
    with guard.shut_down_on_error():  # a failed fs.init leaves no manager asking for quorums
        static = Static(layout, opt, backend, guard, every, carried, bound, pipeline=run)
        return guard.join(_first_state(static, named))


def _read_model(
    model: nn.Module, mesh: DeviceMesh, strategy: str | Strategy, check_batch: bool
) -> tuple[ModelAxis, dict[str, torch.Tensor]]:
    """The model's model-parallel axis on ``mesh`` and its parameters as the layout holds
    them (:func:`funcshard.parallel.expert_axis.read_axes`)."""
    over_shard = Strategy.parse(strategy).shards_optim
    tensor = expert_lib.read_axes(model, mesh, over_shard=over_shard, check_batch=check_batch)
    return tensor, expert_lib.layout_params(model, tensor)


def _check_types(opt: Any, policy: Any) -> None:
    if not isinstance(opt, Optimizer):
        raise TypeError(
            f"init: opt must be an fs.optim optimizer, got {type(opt).__name__} "
            "(a gradient transformation goes before one: fs.optim.chain(clip, adamw))"
        )
    if policy is not None and not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"init: policy must be an fs.MixedPrecisionPolicy or None, got "
            f"{type(policy).__name__} {policy!r} (e.g. fs.MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16))"
        )


def _check_trainable(model: nn.Module | Sequence[nn.Module]) -> None:
    """ValueError naming a parameter of ``requires_grad=False`` (of the model, or of a pipeline's
    stages): the step would train it (every leaf of the state is trained; before, such a
    parameter moved under every strategy, where torch's optimizers and FSDP2 leave it)."""
    given = model if isinstance(model, (list, tuple)) else [model]
    modules = [m for m in given if isinstance(m, nn.Module)]
    frozen = [n for m in modules for n, p in m.named_parameters() if not p.requires_grad]
    if frozen:
        more = f" (and {len(frozen) - 1} more)" if len(frozen) > 1 else ""
        raise ValueError(
            f"init: parameter {frozen[0]!r}{more} has requires_grad=False, and funcshard "
            "trains every parameter of the model; to keep parameters fixed, give them a label "
            "of their own with a learning rate of 0: fs.optim.multi_transform({'train': opt, "
            "'frozen': fs.optim.sgd(0.0)}, labels) (their gradients still count in a clip's "
            "norm), or hold them as buffers"
        )


def _first_state(static: Static, named: dict[str, torch.Tensor]) -> TrainState:
    """The state at step 0: masters packed from the model's parameters, every other copy
    derived from them, the optimizer's state made from the masters."""
    layout = static.layout
    if layout.hierarchical:
        mesh_lib.master_group(layout.mesh)  # made here, where every rank is: a collective
    if layout.expert_mesh is not None:
        _ = layout.experts_view.placement  # its groups too (HFSDP's, no_shard's flattened one)
    master = pack_masters(layout, named)
    return TrainState(
        master=master,
        compute=derive_compute(layout, master),
        opt_state=static.optimizer.init(layout.per_bucket(master)),
        step=0,
        loss_scale=_initial_loss_scale(layout),
        static=static,
    )


def _initial_loss_scale(layout: Layout) -> LossScale | None:
    """fp16 compute's dynamic loss scale at its start (None: no fp16 bucket)."""
    fp16 = any(b.dtypes.compute == torch.float16 for b in layout.buckets)
    return LossScale(float(layout.policy.loss_scale_init), 0) if fp16 else None
