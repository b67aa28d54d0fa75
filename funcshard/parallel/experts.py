"""``fs.ExpertParallel``: a torch ParallelStyle for an experts module stacked on dim 0.

The module's parameters stack its experts on dim 0, ``(num_experts, ...)``, and its forward is
``experts(x, num_tokens_per_expert)`` with the rows of ``x`` sorted by expert (torchtitan's
``GroupedExperts`` convention); it reads its weights' local parts (``w.to_local()`` where a
weight is a DTensor). Applied with ``parallelize_module(experts, mesh["expert"],
fs.ExpertParallel())``, each of the E expert-parallel ranks holds ``num_experts / E``
consecutive experts (DTensor ``Shard(0)`` on the expert mesh). Around the module's own
forward, every rank's tokens travel to the ranks of their experts and back by all-to-all with
uneven counts (torch's functional ``all_to_all_single_autograd``: the backward is the reverse
all-to-all), so a token's output and every expert's gradient are those of the unparallelized
module over all ranks' tokens.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from funcshard.distributed import ops
from funcshard.distributed.dims import EXPERT

__all__ = ["ExpertParallel", "route", "routed_experts"]

KIND = "all_to_all"  # what fs.comm_stats counts the routing under (axis "expert")


def route(counts: torch.Tensor, group: Any, size: int) -> tuple[list[int], list[int], torch.Tensor]:
    """``(input_splits, output_splits, received)`` of one dispatch: the tokens this rank sends
    to each expert rank, those it receives from each, and ``received[src, j]``, the tokens of
    rank ``src`` for this rank's local expert ``j`` (one all-to-all of the counts)."""
    local = counts.numel() // size
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    ops.record(KIND, counts, ops.Axis.EXPERT)
    grid = received.view(size, local)
    return counts.view(size, local).sum(1).tolist(), grid.sum(1).tolist(), grid


def _by_expert(grid: torch.Tensor) -> torch.Tensor:
    """The order that takes received rows (source rank major) to local-expert major."""
    starts = torch.cumsum(grid.reshape(-1), 0) - grid.reshape(-1)
    starts = starts.view_as(grid)
    pieces = [
        torch.arange(int(starts[s, j]), int(starts[s, j] + grid[s, j]))
        for j in range(grid.shape[1])
        for s in range(grid.shape[0])
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class ExpertParallel(ParallelStyle):
    """Experts stacked on dim 0, sharded over a 1-D expert mesh; tokens routed by all-to-all
    (see the module's docstring).

    Raises (at ``parallelize_module``):
      ValueError: a mesh other than a 1-D one named "expert" (``mesh["expert"]``); a module
        with transformers' experts signature (``forward(hidden_states, top_k_index,
        top_k_weights)``); a parameter of a submodule (a ``ModuleList`` of experts), one whose
        dim 0 is not the number of experts the others stack (a weight shared by every
        expert), or whose dim 0 the mesh's size does not divide, naming it.

    Raises (in the forward, on every rank of the expert group):
      ValueError: a rank's ``num_tokens_per_expert`` not of one entry per expert (a router
        index out of range), negative, or not summing to its rows; the offending rank names
        it, its peers learn of it at the exchange of the counts (which carries -1s) instead
        of waiting in the all-to-all of the rows.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1 or device_mesh.mesh_dim_names != (EXPERT,):
            raise ValueError(
                f"ExpertParallel on {type(module).__name__}: expected the 1-D expert mesh "
                f"(mesh['expert'] of fs.make_mesh(..., expert=E)), got a mesh of dims "
                f"{device_mesh.mesh_dim_names}"
            )
        _check_signature(module)
        _check_stacked(module, device_mesh.size())
        # what fs.plan reads: the experts whose counts each forward exchanges
        module._fs_routed_experts = next((p.shape[0] for p in module.parameters()), 0)

        def partition(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for n, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

        return distribute_module(
            module, device_mesh, partition, input_fn=self._dispatch, output_fn=self._combine
        )

    @staticmethod
    def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs[0], inputs[1]
        size, group = mesh.size(), mesh.get_group()
        # the count fixed at parallelize_module: the module's parameters may be placeholders
        # of another shape here (a recomputation in backward outside fs's gather)
        experts = module._fs_routed_experts
        counts = counts.to("cpu", torch.int64)
        problem = _bad_counts(counts, experts, x.shape[0])
        # a bad rank sends -1 counts: every rank of the group learns of it at the exchange,
        # and raises, instead of the others waiting in the all-to-all of the rows
        sent = torch.full((experts,), -1, dtype=torch.int64) if problem else counts
        sends, recvs, grid = route(sent, group, size)
        if problem or bool((grid < 0).any()):
            where = f"this rank's: {problem}" if problem else "another expert rank's"
            raise ValueError(f"ExpertParallel: bad num_tokens_per_expert ({where})")
        routed = _a2a(x, recvs, sends, group)
        order = _by_expert(grid).to(x.device)
        module._fs_route = (order, sends, recvs, group, routed)
        return (routed.index_select(0, order), grid.sum(0).to(inputs[1].device), *inputs[2:])

    @staticmethod
    def _combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        order, sends, recvs, group, routed = module._fs_route
        del module._fs_route  # the dispatched rows: not held past the layer's forward
        if routed.requires_grad:
            # every rank runs both backward all-to-alls its peers wait for, also when the
            # module's output does not depend on its input (an empty-input path returning
            # torch.zeros_like(x), cut off from autograd)
            out = _Tied.apply(out, routed)
        back = torch.empty_like(out).index_copy(0, order, out)  # back to source-rank major
        return _a2a(back, sends, recvs, group)


def _check_signature(module: nn.Module) -> None:
    """Refuses transformers' experts, ``forward(hidden_states, top_k_index, top_k_weights)``
    (e.g. ``Qwen3MoeExperts``), which this style's ``experts(x, num_tokens_per_expert)`` is
    not."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return
    if "top_k_index" in names:
        raise ValueError(
            f"ExpertParallel on {type(module).__name__}: its forward{tuple(names)} is "
            "transformers' experts signature; fs.ExpertParallel takes experts(x, "
            "num_tokens_per_expert) with x's rows sorted by expert (torchtitan's "
            "GroupedExperts). Parallelize a transformers model with its own expert "
            "parallelism (transformers.distributed.expert_parallel.apply_expert_parallelism "
            "with the model's ep plan on mesh['expert']), then fs.init it: see "
            "docs/expert-parallel.md"
        )


def _check_stacked(module: nn.Module, size: int) -> None:
    """Every parameter of ``module`` its own (not a submodule's: a ``ModuleList`` of experts is
    not stacked) with one number of experts on dim 0, a multiple of ``size``."""
    params = dict(module.named_parameters())
    where = f"ExpertParallel on {type(module).__name__}"
    for name in params:
        if "." in name:
            raise ValueError(
                f"{where}: parameter {name!r} belongs to a submodule; expected the experts "
                "stacked on dim 0 of the module's own parameters, (num_experts, ...) (a "
                "ModuleList of experts: stack each weight into one parameter)"
            )
    for name, p in params.items():
        if p.dim() == 0 or p.shape[0] % size:
            raise ValueError(
                f"{where}: parameter {name!r} of shape {tuple(p.shape)}: expected experts "
                f"stacked on dim 0, a multiple of the expert mesh's {size} ranks"
            )
    dims = [p.shape[0] for p in params.values()]
    experts = max(set(dims), key=dims.count) if dims else None
    for (name, p), dim in zip(params.items(), dims, strict=True):
        if dim != experts:
            raise ValueError(
                f"{where}: parameter {name!r} of shape {tuple(p.shape)}: expected experts "
                f"stacked on dim 0 as the module's other parameters stack {experts}; a weight "
                "shared by every expert belongs outside the experts module"
            )


def _bad_counts(counts: torch.Tensor, experts: int, rows: int) -> str:
    """What is wrong with one rank's ``num_tokens_per_expert`` ("" when nothing)."""
    if counts.dim() != 1 or counts.numel() != experts:
        return (
            f"{tuple(counts.shape)} for the module's {experts} experts; a router index out of "
            f"range [0, {experts}) makes torch.bincount(idx, minlength={experts}) longer"
        )
    if bool((counts < 0).any()):
        return f"a negative count in {counts.tolist()}"
    if int(counts.sum()) != rows:
        return (
            f"they sum to {int(counts.sum())}, but x has {rows} rows (sorted by expert, every "
            "row routed once)"
        )
    return ""


class _Tied(torch.autograd.Function):
    """``out`` as it is, in the graph of ``anchor`` (the dispatched rows): backward gives
    ``anchor`` a zero gradient, so that the dispatch's backward all-to-all runs whatever the
    experts did with their rows."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros((), dtype=dtype, device=device).expand(shape)


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """torch's differentiable all-to-all, its bytes counted both ways: those this rank sends
    forward, and in backward the gradient it sends back (the rows it received)."""
    row = math.prod(x.shape[1:]) * x.element_size()  # also with no rows to send forward
    for stats in ops.active():
        stats.record(KIND, sum(in_splits) * row, ops.Axis.EXPERT)
    y = all_to_all_single_autograd(x, out_splits, in_splits, group)
    if y.requires_grad:
        y.register_hook(lambda g: _count_back(g, out_splits, row))
    return y


def _count_back(grad: torch.Tensor, out_splits: list[int], row: int) -> None:
    for stats in ops.active():
        stats.record(KIND, sum(out_splits) * row, ops.Axis.EXPERT)


def routed_experts(model: nn.Module) -> list[int]:
    """The number of experts each ``fs.ExpertParallel`` module of ``model`` routes to (set
    when it was parallelized), in module order."""
    return [m._fs_routed_experts for m in model.modules() if hasattr(m, "_fs_routed_experts")]
