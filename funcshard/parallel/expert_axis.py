"""The expert axis as the data-parallel layers see it: experts stacked on dim 0 of a parameter
``(num_experts, ...)`` made ``Shard(0)`` DTensors on ``mesh["expert"]`` (by
``fs.ExpertParallel`` or any style that places them so) before ``fs.init``.

An expert parameter is held in the layout as this expert rank's rows, ``(num_experts / E,
...)``, the DTensor's local shard, and those rows are data-parallel over the ranks of the
same expert index only: the ``S / E`` shard ranks of "shard_outer" and the replicas
(:meth:`funcshard.layout.layout.Layout.over`), so a ZeRO-3 gather or a gradient reduction
moves ``1 / E`` of the expert tensor, as torchtitan's ``dp_shard_in_ep`` mesh does. Every
token's gradient of an expert reaches the rank holding it by the model's own all-to-all, so
the sum over the ranks of one expert index, divided by ``R * S``, is the one-process mean
over the global batch: the divide factor is that of a dense weight, never ``R * S / E``
(torchtitan #1324). Norms count each expert once (summed over "shard", which holds every
expert index; under ``no_shard`` over "expert", a dense leaf counted on expert rank 0), and
the optimizer's rules, ``full_params`` and checkpoints see global shapes ``(num_experts,
...)``, whatever ``E``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import dtensor as dt
from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed import ops
from funcshard.distributed.dims import EXPERT
from funcshard.parallel.axis import NO_AXIS, BatchCheck, GlobalShape, ModelAxis
from funcshard.parallel.tensor import read_model as read_tensor_axis

__all__ = ["ExpertLeaf", "ExpertAxis", "read_axes", "layout_params"]


@dataclasses.dataclass(frozen=True)
class ExpertLeaf:
    """One expert parameter: its global shape ``(num_experts, ...)`` and stride, split along
    dim 0 (``Shard(0)``) as a tensor-parallel leaf is along its ``dim``."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dim: int = 0

    @property
    def placement(self) -> dt.Shard:
        return dt.Shard(0)


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertAxis:
    """The expert axis of a state over ``inner``, the model's other axis (the tensor axis, or
    :data:`~funcshard.parallel.axis.NO_AXIS`): an expert leaf is split over "expert" (and
    replicated over "tensor"); every other leaf is ``inner``'s.

    ``over_shard``: whether the layout's shard group holds every expert index (a sharded
    strategy: "shard" is "shard_outer" x "expert"); under ``no_shard`` it does not, and a sum
    over the full model adds the expert ranks' parts over "expert"."""

    mesh: DeviceMesh
    experts: Mapping[str, ExpertLeaf]
    inner: ModelAxis = NO_AXIS
    over_shard: bool = True

    @property
    def leaves(self) -> Mapping[str, Any]:
        return {**self.inner.leaves, **self.experts}

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def group(self) -> Any:
        return self.inner.group

    @property
    def expert_size(self) -> int:
        return self.mesh.size()

    @property
    def capture_refusal(self) -> str | None:
        if self.experts:
            return "expert parallel (its token all-to-all is not traced yet)"
        return self.inner.capture_refusal

    def local_rows(self, name: str) -> tuple[int, int]:
        """``(start, rows)``: this expert rank's experts in ``name``'s global dim 0."""
        rows = self.experts[name].shape[0] // self.expert_size
        return self.mesh.get_local_rank() * rows, rows

    def on_experts(self, name: str) -> bool:
        return name in self.experts

    def sharded(self, name: str) -> bool:
        return name in self.experts or self.inner.sharded(name)

    def splits(self, name: str) -> bool:
        if name in self.experts:
            return self.expert_size > 1
        return self.inner.splits(name)

    def counts(self, name: str) -> bool:
        """``inner``'s: an expert leaf is split over "expert" (each rank counts its experts)
        and replicated over "tensor" (counted on tensor rank 0)."""
        return self.inner.counts(name)

    def expert_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every expert rank's ``rows`` (a 1-D tensor of one length on each), stacked in expert
        rank order: ``(E, n)`` (one all-gather over "expert", counted under "metrics")."""
        if self.expert_size == 1:
            return rows.reshape(1, -1)
        group = self.mesh.get_group()
        gathered = ops.all_gather(rows, group, axis=ops.Axis.EXPERT, kind="metrics")
        return gathered.view(self.expert_size, -1)

    def span(self, name: str) -> tuple[int, int, int]:
        if name not in self.experts:
            return self.inner.span(name)
        start, rows = self.local_rows(name)
        return 0, start, start + rows

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        leaf = self.experts.get(name)
        return leaf.shape if leaf is not None else self.inner.full_shape(name, local)

    def agreed_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return local if name in self.experts else self.inner.agreed_shape(name, local)

    def rule_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        if name in self.experts:
            return GlobalShape(self.experts[name].shape, local)
        return self.inner.rule_shape(name, local)

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """An expert leaf as the model holds it: this expert rank's rows ``local`` as a
        ``Shard(0)`` DTensor on ``mesh["expert"]``; any other leaf as ``inner`` wraps it."""
        leaf = self.experts.get(name)
        if leaf is None:
            return self.inner.wrap(name, local)
        return dt.DTensor.from_local(
            local,
            self.mesh,
            (dt.Shard(0),),
            run_check=False,
            shape=torch.Size(leaf.shape),
            stride=leaf.stride,
        )

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if name not in self.experts:
            return self.inner.full(name, local)
        return self.gather_whole(name, local, kind="params")

    def gather_whole(self, name: str, local: torch.Tensor, *, kind: str) -> torch.Tensor:
        """The global ``(num_experts, ...)`` tensor of this expert rank's rows (one all-gather
        over "expert", counted under ``kind``); every expert rank gets the same bits."""
        if name not in self.experts:
            return self.inner.gather_whole(name, local, kind=kind)
        if self.expert_size == 1:
            return local
        rows = ops.all_gather(
            local.contiguous().reshape(-1), self.mesh.get_group(), axis=ops.Axis.EXPERT, kind=kind
        )
        return rows.view(self.experts[name].shape)

    def part_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name not in self.experts:
            return self.inner.part_of(name, full)
        start, rows = self.local_rows(name)
        return full.narrow(0, start, rows).contiguous()

    def counted_parts(self, flats: Sequence[torch.Tensor], specs: Sequence) -> list[torch.Tensor]:
        """``inner``'s; under ``no_shard`` (:attr:`over_shard` False) with experts split, a
        dense leaf only on expert rank 0 (the sum adds the expert ranks' parts)."""
        if self.over_shard or self.expert_size == 1 or self.mesh.get_local_rank() == 0:
            return self.inner.counted_parts(flats, specs)
        if self.inner.size > 1 and self.inner.rank != 0:  # experts: replicated over "tensor"
            return []
        return [
            g[s.offset : s.offset + s.shard_numel]
            for g, leaves in zip(flats, specs, strict=True)
            for s in leaves
            if s.name in self.experts
        ]

    def sum_square(self, square: torch.Tensor) -> torch.Tensor:
        if not self.over_shard and self.expert_size > 1:
            square = ops.all_reduce(
                square, self.mesh.get_group(), axis=ops.Axis.EXPERT, kind="metrics"
            )
        return self.inner.sum_square(square)

    def squares_in_order(self, square: torch.Tensor) -> torch.Tensor:
        return self.inner.squares_in_order(square)

    def replica_groups(self, labels: list[str]) -> list[tuple[str, Any, list[str]]]:
        return self.inner.replica_groups(labels)

    def batch_check(self, batch: Any, device: torch.device) -> BatchCheck:
        return self.inner.batch_check(batch, device)

    def __repr__(self) -> str:
        return f"ExpertAxis({sorted(self.experts)}, E={self.expert_size}, inner={self.inner!r})"


def _where(name: str, p: dt.DTensor) -> str:
    return f"parameter {name!r} (a DTensor on {p.device_mesh}, placements {p.placements})"


def _expert_leaf(name: str, p: dt.DTensor, expert_mesh: DeviceMesh) -> ExpertLeaf:
    """The :class:`ExpertLeaf` of a DTensor on ``mesh["expert"]``, checked."""
    if tuple(p.placements) != (dt.Shard(0),):
        raise ValueError(
            f"{_where(name, p)}: expert parallel takes experts stacked on dim 0 as Shard(0) on "
            "mesh['expert']"
        )
    size = expert_mesh.size()
    if p.dim() == 0 or p.shape[0] % size:
        raise ValueError(
            f"{_where(name, p)}: expert={size} must divide the number of experts "
            f"(dim 0 of {tuple(p.shape)})"
        )
    return ExpertLeaf(tuple(p.shape), tuple(p.stride()))


def _on_expert_axis(p: torch.Tensor, expert_mesh: DeviceMesh | None) -> bool:
    """Whether ``p`` is a DTensor meant for an expert axis (``mesh["expert"]`` or another)."""
    if not dt.is_dtensor(p):
        return False
    if expert_mesh is not None and p.device_mesh == expert_mesh:
        return True
    return EXPERT in (p.device_mesh.mesh_dim_names or ())


def read_axes(
    model: nn.Module, mesh: DeviceMesh, *, over_shard: bool = True, check_batch: bool = True
) -> ModelAxis:
    """The model-parallel axis of ``model`` on ``mesh``: its experts (DTensors ``Shard(0)`` on
    ``mesh["expert"]``) over its tensor axis (:func:`funcshard.parallel.tensor.read_model`).
    ``over_shard``: the strategy shards over "shard" (:attr:`ExpertAxis.over_shard`);
    ``check_batch``: the tensor axis checks the batch (``fs.init(check_tensor_batch=...)``).

    Raises:
      ValueError: an expert DTensor on a mesh other than ``mesh["expert"]`` (or on a mesh
        without one), placed other than ``Shard(0)``, or whose number of experts ``E`` does
        not divide; or what the tensor axis refuses. Each names the parameter.
    """
    expert_mesh = mesh_lib.expert_axis(mesh)
    experts = {}
    for name, p in model.named_parameters():
        if not _on_expert_axis(p, expert_mesh):
            continue
        if expert_mesh is None or p.device_mesh != expert_mesh:
            raise ValueError(
                f"{_where(name, p)}: expected experts on mesh['expert'] of the mesh given to "
                f"fs.init ({expert_mesh}); build it with fs.make_mesh(..., expert=E) and put "
                "the experts on that mesh"
            )
        experts[name] = _expert_leaf(name, p, expert_mesh)
    inner = read_tensor_axis(
        model, mesh_lib.tensor_axis(mesh), skip=experts, check_batch=check_batch
    )
    return ExpertAxis(expert_mesh, experts, inner, over_shard) if experts else inner


def layout_params(model: nn.Module, axis: ModelAxis) -> dict[str, torch.Tensor]:
    """``model.named_parameters()`` as the layout holds them: a DTensor's local shard (an
    expert leaf's: this expert rank's experts)."""
    del axis
    return {n: (p.to_local() if dt.is_dtensor(p) else p) for n, p in model.named_parameters()}
