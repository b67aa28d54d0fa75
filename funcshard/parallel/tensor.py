"""Tensor parallelism as torch gives it: a model parallelized with ``parallelize_module`` on
``mesh["tensor"]`` holds DTensor parameters; funcshard shards each one's LOCAL tensor over the
data-parallel axes as it shards a plain parameter, and hands the model DTensors again where it
had them (:meth:`TensorParallel.wrap`).

What the full model's math needs of the tensor axis is here too: which buckets count in the
norm on this rank (a parameter sharded over "tensor" on every rank, one replicated over it on
tensor rank 0 only: every element once) and the full tensors of a local shard.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import dtensor as dt
from funcshard.distributed import ops
from funcshard.parallel.axis import NO_AXIS, NO_CHECK, BatchCheck, GlobalShape, ModelAxis
from funcshard.parallel.batch import TensorBatchCheck

__all__ = [
    "TensorLeaf",
    "TensorParallel",
    "read_model",
    "local_params",
    "leaf_of",
    "planned_leaves",
    "chunk_sizes",
    "local_shape",
    "gather_numel",
]


def chunk_sizes(n: int, size: int) -> tuple[int, ...]:
    """Every tensor rank's length of a dim of ``n`` split over ``size`` ranks, as ``Shard``
    places it (``torch.chunk``'s sizes: ``ceil(n / size)`` each, the last ones shorter or empty).

    >>> chunk_sizes(10, 4), chunk_sizes(44, 4)
    ((3, 3, 3, 1), (11, 11, 11, 11))
    """
    step = -(-n // size)
    return tuple(max(0, min(n, (t + 1) * step) - t * step) for t in range(size))


def local_shape(shape: Sequence[int], dim: int | None, size: int, rank: int) -> tuple[int, ...]:
    """Tensor rank ``rank``'s shard of a global ``shape`` split on ``dim`` (None: replicated)."""
    shape = tuple(shape)
    if dim is None:
        return shape
    return (*shape[:dim], chunk_sizes(shape[dim], size)[rank], *shape[dim + 1 :])


def gather_numel(shape: Sequence[int], dim: int, size: int) -> int:
    """Elements of the all-gather over "tensor" that rebuilds a global ``shape`` split on
    ``dim`` (every rank's piece padded to the largest: ``size * ceil(n / size) * the rest``)."""
    return size * max(chunk_sizes(shape[dim], size)) * math.prod(shape) // max(shape[dim], 1)


@dataclasses.dataclass(frozen=True)
class TensorLeaf:
    """One DTensor parameter: its placement on the tensor mesh and its global geometry."""

    placement: dt.Shard | dt.Replicate
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dim(self) -> int | None:
        """The dim sharded over "tensor"; None when replicated."""
        return self.placement.dim if isinstance(self.placement, dt.Shard) else None


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel:
    """The tensor axis of a state: its 1-D mesh and every DTensor parameter's placement.

    Plain parameters of the model are replicated over "tensor" (each tensor rank holds and
    trains the same values). ``check_batch``: ``train_step`` checks that every rank of a
    tensor group passes the same batch (``fs.init(check_tensor_batch=...)``)."""

    mesh: DeviceMesh
    leaves: Mapping[str, TensorLeaf]
    check_batch: bool = True

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def capture_refusal(self) -> str | None:
        # captured: the step wraps each gathered local param as its DTensor (wrap) in the
        # graph, and torch's DTensor ops trace through dynamo
        return None

    def sharded(self, name: str) -> bool:
        """Whether ``name``'s elements are split over the tensor ranks."""
        leaf = self.leaves.get(name)
        return leaf is not None and leaf.dim is not None

    def on_experts(self, name: str) -> bool:
        return False

    def expert_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(1, -1)

    def counts(self, name: str) -> bool:
        """Whether this rank counts ``name``'s local elements in a sum over the full model:
        a sharded one on every tensor rank, a replicated one on tensor rank 0 only."""
        return self.sharded(name) or self.rank == 0

    def span(self, name: str) -> tuple[int, int, int]:
        """``(dim, start, stop)``: where this rank's shard of split ``name`` lies along its
        split dim in the global tensor (:func:`chunk_sizes`, as ``Shard`` places it)."""
        leaf = self.leaves[name]
        assert leaf.dim is not None, f"{name!r} is not split over 'tensor'"
        sizes = chunk_sizes(leaf.shape[leaf.dim], self.size)
        start = sum(sizes[: self.rank])
        return leaf.dim, start, start + sizes[self.rank]

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        leaf = self.leaves.get(name)
        return leaf.shape if leaf is not None else local

    def agreed_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """A shape of ``name`` every tensor rank derives alike, for choices that must agree
        over "tensor" (which leaves are offloaded): tensor rank 0's shard of a split leaf (the
        largest, as ``Shard`` places it), ``local`` for one replicated over "tensor"."""
        leaf = self.leaves.get(name)
        if leaf is None or leaf.dim is None:
            return local
        return local_shape(leaf.shape, leaf.dim, self.size, 0)

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the parallelized model holds ``name``: a DTensor (differentiable: its
        gradient comes back as the local shard's, torch's redistribution of a partial one
        included) or, for a plain parameter, ``local`` itself."""
        leaf = self.leaves.get(name)
        if leaf is None:
            return local
        return dt.DTensor.from_local(
            local,
            self.mesh,
            (leaf.placement,),
            run_check=False,
            shape=torch.Size(leaf.shape),
            stride=leaf.stride,
        )

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The global tensor of a local shard (a collective over "tensor" for a sharded one)."""
        leaf = self.leaves.get(name)
        if leaf is None or leaf.dim is None:
            return local
        with torch.no_grad():
            return self.wrap(name, local).full_tensor()

    def gather_whole(self, name: str, local: torch.Tensor, *, kind: str) -> torch.Tensor:
        """The global tensor of ``local``, this tensor rank's shard of ``name`` (split over
        "tensor"), in ``local``'s dtype: one all-gather over "tensor" (counted under ``kind``
        and the "tensor" axis) of every rank's piece padded to the largest, the pieces then
        concatenated along the split dim. Every tensor rank gets the same bits."""
        leaf = self.leaves[name]
        shapes = [local_shape(leaf.shape, leaf.dim, self.size, t) for t in range(self.size)]
        if tuple(local.shape) != shapes[self.rank]:
            raise ValueError(
                f"tensor parallel: parameter {name!r}: expected this tensor rank's shard of "
                f"shape {shapes[self.rank]} (global {leaf.shape}, {leaf.placement}), got "
                f"{tuple(local.shape)}"
            )
        width = gather_numel(leaf.shape, leaf.dim, self.size) // self.size
        buffer = torch.zeros(width, dtype=local.dtype, device=local.device)
        buffer[: local.numel()].copy_(local.reshape(-1))
        rows = ops.all_gather(buffer, self.group, axis=ops.Axis.TENSOR, kind=kind)
        rows = rows.view(self.size, width)
        parts = [rows[t, : math.prod(s)].view(s) for t, s in enumerate(shapes)]
        return torch.cat(parts, dim=leaf.dim)

    def splits(self, name: str) -> bool:
        return self.size > 1 and self.sharded(name)

    def rule_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape, carrying ``local`` (:class:`~funcshard.parallel.axis.GlobalShape`):
        leaves split over "tensor" share buckets with replicated ones."""
        return GlobalShape(self.full_shape(name, local), local)

    def counted_parts(self, flats: Sequence[torch.Tensor], specs: Sequence) -> list[torch.Tensor]:
        """All of them on tensor rank 0; on the others only the segments of leaves split over
        "tensor" (a replicated leaf is the same on every tensor rank: counted once)."""
        if self.rank == 0:
            return list(flats)
        return [
            g[s.offset : s.offset + s.shard_numel]
            for g, leaves in zip(flats, specs, strict=True)
            for s in leaves
            if self.sharded(s.name)
        ]

    def sum_square(self, square: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return square
        return ops.all_reduce(square, self.group, axis=ops.Axis.TENSOR, kind="metrics")

    def squares_in_order(self, square: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return square.reshape(1)
        return ops.all_gather(square.reshape(1), self.group, axis=ops.Axis.TENSOR, kind="metrics")

    def replica_groups(self, labels: list[str]) -> list[tuple[str, Any, list[str]]]:
        """A tensor group's replicated leaves: the same bits on every tensor rank."""
        same = [label for label in labels if not self.sharded(label.rsplit("/", 1)[-1])]
        if self.size == 1 or not same:
            return []
        return [(ops.Axis.TENSOR.value, self.group, same)]

    def batch_check(self, batch: Any, device: torch.device) -> BatchCheck:
        """Torch TP's rule, checked: every rank of a tensor group steps on the same batch
        (:class:`funcshard.parallel.batch.TensorBatchCheck`)."""
        if self.size == 1 or not self.check_batch:
            return NO_CHECK
        return TensorBatchCheck(self, batch, device)

    def part_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This tensor rank's shard of ``name``'s global tensor ``full`` (a contiguous copy)."""
        leaf = self.leaves[name]
        pieces = chunk_sizes(leaf.shape[leaf.dim], self.size)
        start = sum(pieces[: self.rank])
        return full.narrow(leaf.dim, start, pieces[self.rank]).contiguous()


def read_model(
    model: nn.Module,
    tensor_mesh: DeviceMesh | None,
    *,
    skip: Collection[str] = (),
    check_batch: bool = True,
) -> ModelAxis:
    """The tensor axis of ``model``'s DTensor parameters (None for a plain model on a mesh
    without one); ``skip``: parameters another axis has taken (experts); ``check_batch``:
    :attr:`TensorParallel.check_batch`.

    Raises:
      ValueError: a DTensor on a mesh other than ``tensor_mesh`` (or on a mesh without a tensor
        axis), or with a placement funcshard cannot shard (a partial one, or one over several
        mesh dims), naming the parameter and its placement.
    """
    leaves = {}
    for name, p in model.named_parameters():
        if not dt.is_dtensor(p) or name in skip:
            continue
        if tensor_mesh is None:
            raise ValueError(
                f"{_where(name, p)}: the mesh has no tensor axis; build it with "
                "fs.make_mesh(..., tensor=T) and parallelize the model on mesh['tensor']"
            )
        if p.device_mesh != tensor_mesh:
            raise ValueError(
                f"{_where(name, p)}: expected a DTensor on mesh['tensor'] of the mesh given to "
                f"fs.init ({tensor_mesh}); parallelize the model on that mesh"
            )
        leaves[name] = leaf_of(name, p)
    if tensor_mesh is None:
        return NO_AXIS
    return TensorParallel(tensor_mesh, leaves, check_batch)


def _where(name: str, p: dt.DTensor) -> str:
    return f"parameter {name!r} (a DTensor on {p.device_mesh}, placements {p.placements})"


def leaf_of(name: str, p: dt.DTensor) -> TensorLeaf:
    """The :class:`TensorLeaf` of DTensor parameter ``name``.

    Raises:
      ValueError: a placement funcshard cannot shard (a partial one, or one over several mesh
        dims), naming the parameter and its placement.
    """
    if len(p.placements) != 1:
        raise ValueError(f"{_where(name, p)}: expected a DTensor on a 1-D tensor mesh")
    (placement,) = p.placements
    if not (type(placement) is dt.Shard or isinstance(placement, dt.Replicate)):
        raise ValueError(
            f"{_where(name, p)}: funcshard shards Shard(dim) and Replicate placements over the "
            "data-parallel axes; a partial or strided parameter is not a weight it can own"
        )
    if isinstance(placement, dt.Shard) and placement.dim < 0:
        placement = dt.Shard(placement.dim + p.dim())
    return TensorLeaf(placement, tuple(p.shape), tuple(p.stride()))


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.named_parameters()`` with each DTensor as its local shard."""
    return {n: (p.to_local() if dt.is_dtensor(p) else p) for n, p in model.named_parameters()}


def planned_leaves(model: nn.Module, plan: Mapping[str, dt.ParallelStyle]) -> dict[str, TensorLeaf]:
    """The :class:`TensorLeaf` each parameter of plain ``model`` would get from
    ``parallelize_module(model, mesh["tensor"], plan)`` (keys relative to ``model``, ``*``
    wildcards per name component as torch matches them), without a mesh: torch's placements
    of its styles (``ColwiseParallel``: a Linear's weight and bias Shard(0), an Embedding's
    weight Shard(1); ``RowwiseParallel``: a Linear's weight Shard(1) and bias Replicate, an
    Embedding's weight Shard(0); ``SequenceParallel``: Replicate; ``PrepareModule*``: none).
    A key naming an ``nn.Identity`` (a module ``fs.pipeline.split`` removed from a stage)
    places nothing.

    Raises:
      ValueError: a key that names no submodule, a style on a module it cannot split, or a
        style whose placements funcshard does not know (naming the key and the style).
    """
    modules = dict(model.named_modules())
    named = {id(p): n for n, p in model.named_parameters()}  # a tied weight: its first name
    leaves: dict[str, TensorLeaf] = {}
    for key, style in plan.items():
        matched = [name for name in modules if _matches(name, key)]
        if not matched:
            raise ValueError(f"tensor plan: key {key!r} names no submodule of the model")
        for name in matched:
            if isinstance(modules[name], nn.Identity):  # a module a pipeline stage cut out
                continue
            for local, placement in _style_placements(key, style, modules[name]).items():
                p = modules[name].get_parameter(local)
                leaves[named[id(p)]] = TensorLeaf(placement, tuple(p.shape), tuple(p.stride()))
    return leaves


def _matches(name: str, key: str) -> bool:
    """Whether module ``name`` is what plan ``key`` names: as many components, each matching
    its pattern (``parallelize_module`` walks the children so; "" is the model itself)."""
    parts, atoms = (name.split(".") if name else []), (key.split(".") if key else [])
    return len(parts) == len(atoms) and all(
        fnmatch.fnmatch(part, atom) for part, atom in zip(parts, atoms, strict=True)
    )


def _style_placements(
    key: str, style: dt.ParallelStyle, module: nn.Module
) -> dict[str, dt.Shard | dt.Replicate]:
    """``{parameter name in module: placement}`` that ``style`` gives ``module``'s parameters."""
    if isinstance(
        style, (dt.PrepareModuleInput, dt.PrepareModuleOutput, dt.PrepareModuleInputOutput)
    ):
        return {}
    if isinstance(style, dt.SequenceParallel):
        return {n: dt.Replicate() for n, _ in module.named_parameters()}
    if isinstance(style, (dt.ColwiseParallel, dt.RowwiseParallel)) and isinstance(
        module, (nn.Linear, nn.Embedding)
    ):
        colwise = isinstance(style, dt.ColwiseParallel)
        if isinstance(module, nn.Embedding):
            return {"weight": dt.Shard(1 if colwise else 0)}
        bias = dt.Shard(0) if colwise else dt.Replicate()
        placements = {"weight": dt.Shard(0 if colwise else 1)}
        return placements | ({"bias": bias} if module.bias is not None else {})
    raise ValueError(
        f"tensor plan: key {key!r}: funcshard cannot plan {type(style).__name__} on "
        f"{type(module).__name__} (ColwiseParallel and RowwiseParallel on nn.Linear and "
        "nn.Embedding, SequenceParallel and PrepareModule* are known); parallelize the model "
        "and pass it instead"
    )
