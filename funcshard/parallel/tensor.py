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
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from funcshard.distributed import ops

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
    "batch_fingerprint",
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

    placement: Shard | Replicate
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dim(self) -> int | None:
        """The dim sharded over "tensor"; None when replicated."""
        return self.placement.dim if isinstance(self.placement, Shard) else None


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel:
    """The tensor axis of a state: its 1-D mesh and every DTensor parameter's placement.

    Plain parameters of the model are replicated over "tensor" (each tensor rank holds and
    trains the same values)."""

    mesh: DeviceMesh
    leaves: Mapping[str, TensorLeaf]

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def group(self):
        return self.mesh.get_group()

    def sharded(self, name: str) -> bool:
        """Whether ``name``'s elements are split over the tensor ranks."""
        leaf = self.leaves.get(name)
        return leaf is not None and leaf.dim is not None

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
        return DTensor.from_local(
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

    def batch_apart(
        self, paths: tuple[str, ...], fingerprint: torch.Tensor, loss: torch.Tensor
    ) -> str | None:
        """Why this tensor group's ranks did not run on the same batch, or None.

        One all-gather over "tensor" (counted under "metrics") of four words whatever the
        batch: a digest of this rank's :func:`batch_fingerprint` (its leaves' rows summed with
        odd weights, modulo 2^64) and its loss. Only where the digests differ, a second one
        of every leaf's fingerprint names the batch leaves that differ from tensor rank 0's,
        with the ranks; the same bytes but losses apart (1e-3 relative: the model's
        reductions may round apart) say the model draws other random numbers per tensor
        rank."""
        odd = torch.arange(1, 2 * fingerprint.shape[0], 2, dtype=torch.int64)
        digest = (fingerprint * odd.to(fingerprint.device).unsqueeze(1)).sum(dim=0)
        local = torch.cat([digest.reshape(-1), loss.double().reshape(1).view(torch.int64)])
        every = ops.all_gather(local, self.group, axis=ops.Axis.TENSOR, kind="metrics")
        rows = every.view(self.size, -1).tolist()  # one sync; the rest is Python on ints
        losses = [struct.unpack("<d", struct.pack("<q", row[-1]))[0] for row in rows]
        if any(row[:-1] != rows[0][:-1] for row in rows):
            return self._batch_leaves_apart(paths, fingerprint)
        if not all(math.isfinite(v) for v in losses):
            return None  # a nonfinite loss: the step is skipped as any other
        if max(losses) - min(losses) > 1e-3 * max(abs(v) for v in losses):
            ranks = dist.get_process_group_ranks(self.group)
            return (
                f"the tensor group of ranks {ranks} passed the same bytes but their losses "
                f"differ ({losses}): the model draws other random numbers per tensor rank "
                "(dropout seeded by rank?)"
            )
        return None

    def _batch_leaves_apart(self, paths: tuple[str, ...], fingerprint: torch.Tensor) -> str:
        """The batch leaves whose fingerprint differs from tensor rank 0's, with the ranks (an
        all-gather of every leaf's fingerprint: only once the digests differ)."""
        every = ops.all_gather(
            fingerprint.reshape(-1), self.group, axis=ops.Axis.TENSOR, kind="metrics"
        )
        prints = every.view(self.size, len(paths), -1).tolist()
        ranks = dist.get_process_group_ranks(self.group)
        apart = [
            [ranks[t] for t in range(self.size) if prints[t][i] != prints[0][i]]
            for i in range(len(paths))
        ]
        named = ", ".join(f"{p!r} on ranks {r}" for p, r in zip(paths, apart, strict=True) if r)
        return (
            f"the tensor group of ranks {ranks} passed different batches: batch leaf "
            f"{named or '(every leaf alike, their order or count not)'} differs from rank "
            f"{ranks[0]}'s"
        )

    def part_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This tensor rank's shard of ``name``'s global tensor ``full`` (a contiguous copy)."""
        leaf = self.leaves[name]
        pieces = chunk_sizes(leaf.shape[leaf.dim], self.size)
        start = sum(pieces[: self.rank])
        return full.narrow(leaf.dim, start, pieces[self.rank]).contiguous()


# the integer word of each element size: a leaf's bytes read as integers, exactly
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def batch_fingerprint(batch: Any, device: torch.device) -> tuple[tuple[str, ...], torch.Tensor]:
    """``(paths, fingerprint)``: per batch leaf (by its path), three int64 that change with
    any change of its bytes, shape or dtype: a CRC of shape and dtype, the sum of its
    elements read as integers and their sum weighted by odd position factors (modulo 2^64,
    so the same bits give the same sums in any order; rows swapped change the weighted one).
    Computed on the leaf's device, no copy of the batch; ``fingerprint`` is ``(leaves, 3)``
    on ``device``.

    >>> paths, fp = batch_fingerprint({"x": torch.arange(4)}, torch.device("cpu"))
    >>> paths, fp[0, 1:].tolist()
    (('x',), [6, 34])
    """
    leaves = optree.tree_leaves(batch)
    paths = tuple("/".join(map(str, p)) or "<batch>" for p in optree.tree_paths(batch))
    rows = []
    for leaf in leaves:
        words = _words(leaf.detach())
        odd = torch.arange(1, 2 * words.numel(), 2, dtype=torch.int64, device=words.device)
        head = zlib.crc32(f"{tuple(leaf.shape)} {leaf.dtype}".encode())
        sums = torch.stack([words.sum(), (words * odd).sum()]).to(device)
        rows.append(torch.cat([sums.new_tensor([head]), sums]))
    if not rows:
        return paths, torch.zeros(0, 3, dtype=torch.int64, device=device)
    return paths, torch.stack(rows)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as int64 of the same bits (an integer word per element; bytes for
    element sizes without one), flattened."""
    word = _WORDS.get(t.element_size())
    if word is None:
        t, word = t.contiguous().reshape(-1).view(torch.uint8), torch.uint8
    return t.view(word).reshape(-1).to(torch.int64)


def read_model(model: nn.Module, tensor_mesh: DeviceMesh | None) -> TensorParallel | None:
    """The tensor axis of ``model``'s DTensor parameters (None for a plain model on a mesh
    without one).

    Raises:
      ValueError: a DTensor on a mesh other than ``tensor_mesh`` (or on a mesh without a tensor
        axis), or with a placement funcshard cannot shard (a partial one, or one over several
        mesh dims), naming the parameter and its placement.
    """
    leaves = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
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
        return None
    return TensorParallel(tensor_mesh, leaves)


def _where(name: str, p: DTensor) -> str:
    return f"parameter {name!r} (a DTensor on {p.device_mesh}, placements {p.placements})"


def leaf_of(name: str, p: DTensor) -> TensorLeaf:
    """The :class:`TensorLeaf` of DTensor parameter ``name``.

    Raises:
      ValueError: a placement funcshard cannot shard (a partial one, or one over several mesh
        dims), naming the parameter and its placement.
    """
    if len(p.placements) != 1:
        raise ValueError(f"{_where(name, p)}: expected a DTensor on a 1-D tensor mesh")
    (placement,) = p.placements
    if not (type(placement) is Shard or isinstance(placement, Replicate)):
        raise ValueError(
            f"{_where(name, p)}: funcshard shards Shard(dim) and Replicate placements over the "
            "data-parallel axes; a partial or strided parameter is not a weight it can own"
        )
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim + p.dim())
    return TensorLeaf(placement, tuple(p.shape), tuple(p.stride()))


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.named_parameters()`` with each DTensor as its local shard."""
    return {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}


def planned_leaves(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, TensorLeaf]:
    """The :class:`TensorLeaf` each parameter of plain ``model`` would get from
    ``parallelize_module(model, mesh["tensor"], plan)`` (keys relative to ``model``, ``*``
    wildcards per name component as torch matches them), without a mesh: torch's placements
    of its styles (``ColwiseParallel``: a Linear's weight and bias Shard(0), an Embedding's
    weight Shard(1); ``RowwiseParallel``: a Linear's weight Shard(1) and bias Replicate, an
    Embedding's weight Shard(0); ``SequenceParallel``: Replicate; ``PrepareModule*``: none).

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
    key: str, style: ParallelStyle, module: nn.Module
) -> dict[str, Shard | Replicate]:
    """``{parameter name in module: placement}`` that ``style`` gives ``module``'s parameters."""
    if isinstance(style, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)):
        return {}
    if isinstance(style, SequenceParallel):
        return {n: Replicate() for n, _ in module.named_parameters()}
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(
        module, (nn.Linear, nn.Embedding)
    ):
        colwise = isinstance(style, ColwiseParallel)
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1 if colwise else 0)}
        bias = Shard(0) if colwise else Replicate()
        placements = {"weight": Shard(0 if colwise else 1)}
        return placements | ({"bias": bias} if module.bias is not None else {})
    raise ValueError(
        f"tensor plan: key {key!r}: funcshard cannot plan {type(style).__name__} on "
        f"{type(module).__name__} (ColwiseParallel and RowwiseParallel on nn.Linear and "
        "nn.Embedding, SequenceParallel and PrepareModule* are known); parallelize the model "
        "and pass it instead"
    )
