"""The expert axis as the data-parallel layers see it: experts stacked on dim 0 of a parameter
``(num_experts, ...)`` made ``Shard(0)`` DTensors on ``mesh["expert"]`` (by
``fs.ExpertParallel`` or any style that places them so) before ``fs.init``.

funcshard keeps an expert parameter GLOBAL in its layout, the ``(num_experts, ...)`` tensor
sharded over the data-parallel axes ("replicate" x "shard") like a dense one, and hands the
model this rank's experts as the DTensor it had (:meth:`ExpertAxis.wrap`: rows
``[e * n / E, (e + 1) * n / E)`` of the gathered tensor). The gradient of the other experts'
rows is zero on this rank, so the step's sum over every data-parallel rank divided by
``R * S`` is the one-process mean over the global batch (every token's gradient of an expert
reaches the rank holding it by the model's own all-to-all): the divide factor is that of a
dense weight, never ``R * S / E`` (torchtitan #1324). Norms, the optimizer, ``full_params`` and
checkpoints then see each expert once, in global shapes, whatever ``E``.

What this design does not do yet: move only an expert rank's own experts. Its gathers
(ZeRO-3) and gradient reductions carry the whole ``(num_experts, ...)`` tensor over "shard"
and "replicate" (as the same model without expert parallelism does), where sharding the experts
over the ``S / E x R`` ranks of one expert index would move ``1 / E`` of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from funcshard.distributed import mesh as mesh_lib
from funcshard.distributed.dims import EXPERT
from funcshard.parallel.axis import NO_AXIS, BatchCheck, ModelAxis
from funcshard.parallel.tensor import read_model as read_tensor_axis

__all__ = ["ExpertLeaf", "ExpertAxis", "read_axes", "layout_params"]


@dataclasses.dataclass(frozen=True)
class ExpertLeaf:
    """One expert parameter: its global shape ``(num_experts, ...)`` and stride."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertAxis:
    """The expert axis of a state over ``inner``, the model's other axis (the tensor axis, or
    :data:`~funcshard.parallel.axis.NO_AXIS`): every question of the protocol is ``inner``'s
    (an expert leaf is whole in the layout, replicated over "tensor"), but the wrap of an
    expert leaf for the forward."""

    mesh: DeviceMesh
    experts: Mapping[str, ExpertLeaf]
    inner: ModelAxis = NO_AXIS

    @property
    def leaves(self) -> Mapping[str, Any]:
        return self.inner.leaves

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def group(self) -> Any:
        return self.inner.group

    def local_rows(self, name: str) -> tuple[int, int]:
        """``(start, rows)``: this expert rank's experts in ``name``'s global dim 0."""
        rows = self.experts[name].shape[0] // self.mesh.size()
        return self.mesh.get_local_rank() * rows, rows

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """An expert leaf as the model holds it: this expert rank's rows of the global tensor
        ``local`` as a ``Shard(0)`` DTensor on ``mesh["expert"]`` (differentiable: the other
        rows' gradient is zero here); any other leaf as ``inner`` wraps it."""
        leaf = self.experts.get(name)
        if leaf is None:
            return self.inner.wrap(name, local)
        start, rows = self.local_rows(name)
        return DTensor.from_local(
            local.narrow(0, start, rows),
            self.mesh,
            (Shard(0),),
            run_check=False,
            shape=torch.Size(leaf.shape),
            stride=leaf.stride,
        )

    # --- the rest is the inner axis's: an expert leaf is whole in the layout --------------
    def sharded(self, name: str) -> bool:
        return self.inner.sharded(name)

    def splits(self, name: str) -> bool:
        return self.inner.splits(name)

    def counts(self, name: str) -> bool:
        return self.inner.counts(name)

    def span(self, name: str) -> tuple[int, int, int]:
        return self.inner.span(name)

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return self.inner.full_shape(name, local)

    def agreed_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return self.inner.agreed_shape(name, local)

    def rule_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return self.inner.rule_shape(name, local)

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return self.inner.full(name, local)

    def gather_whole(self, name: str, local: torch.Tensor, *, kind: str) -> torch.Tensor:
        return self.inner.gather_whole(name, local, kind=kind)

    def part_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return self.inner.part_of(name, full)

    def counted_parts(self, flats: Sequence[torch.Tensor], specs: Sequence) -> list[torch.Tensor]:
        return self.inner.counted_parts(flats, specs)

    def sum_square(self, square: torch.Tensor) -> torch.Tensor:
        return self.inner.sum_square(square)

    def squares_in_order(self, square: torch.Tensor) -> torch.Tensor:
        return self.inner.squares_in_order(square)

    def replica_groups(self, labels: list[str]) -> list[tuple[str, Any, list[str]]]:
        return self.inner.replica_groups(labels)

    def batch_check(self, batch: Any, device: torch.device) -> BatchCheck:
        return self.inner.batch_check(batch, device)

    def __repr__(self) -> str:
        return f"ExpertAxis({sorted(self.experts)}, E={self.mesh.size()}, inner={self.inner!r})"


def _where(name: str, p: DTensor) -> str:
    return f"parameter {name!r} (a DTensor on {p.device_mesh}, placements {p.placements})"


def _expert_leaf(name: str, p: DTensor, expert_mesh: DeviceMesh) -> ExpertLeaf:
    """The :class:`ExpertLeaf` of a DTensor on ``mesh["expert"]``, checked."""
    if tuple(p.placements) != (Shard(0),):
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
    if not isinstance(p, DTensor):
        return False
    if expert_mesh is not None and p.device_mesh == expert_mesh:
        return True
    return EXPERT in (p.device_mesh.mesh_dim_names or ())


def read_axes(model: nn.Module, mesh: DeviceMesh) -> ModelAxis:
    """The model-parallel axis of ``model`` on ``mesh``: its experts (DTensors ``Shard(0)`` on
    ``mesh["expert"]``) over its tensor axis (:func:`funcshard.parallel.tensor.read_model`).

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
    inner = read_tensor_axis(model, mesh_lib.tensor_axis(mesh), skip=experts)
    return ExpertAxis(expert_mesh, experts, inner) if experts else inner


def layout_params(model: nn.Module, axis: ModelAxis) -> dict[str, torch.Tensor]:
    """``model.named_parameters()`` as the layout holds them: an expert leaf's global tensor
    (a collective over "expert", every rank in the same order), a tensor-parallel DTensor's
    local shard."""
    experts = axis.experts if isinstance(axis, ExpertAxis) else {}
    out = {}
    for name, p in model.named_parameters():
        if name in experts:
            with torch.no_grad():
                out[name] = p.full_tensor()
        else:
            out[name] = p.to_local() if isinstance(p, DTensor) else p
    return out
