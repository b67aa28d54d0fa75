"""What :func:`funcshard.plan.plan` reads: a mesh known by its shape, the table of parameter
shapes and dtypes (of a model, or given), the units a shape table implies, and the local shapes
of a tensor-parallel model."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from funcshard.tensor_parallel import TensorParallel, leaf_of, local_shape

__all__ = [
    "ShapeMesh",
    "ShapesArg",
    "param_table",
    "units_from_names",
    "shard_size",
    "tensor_table",
]


class ShapeMesh:
    """A mesh known only by its shape: enough for ``build_layout`` (no process group)."""

    device_type = "meta"

    def __init__(self, replicate: int, shard: int) -> None:
        self.shape = (replicate, shard)

    def size(self, dim: int | None = None) -> int:
        return math.prod(self.shape) if dim is None else self.shape[dim]


ShapesArg = Mapping[str, Sequence[int] | tuple[Sequence[int], torch.dtype]] | nn.Module


def param_table(
    params: ShapesArg, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(params, nn.Module):
        return {n: (tuple(p.shape), p.dtype) for n, p in params.named_parameters()}
    out = {}
    for name, entry in params.items():
        if len(entry) == 2 and isinstance(entry[1], torch.dtype):
            out[name] = (tuple(entry[0]), entry[1])
        else:
            out[name] = (tuple(entry), dtype)
        if any(not isinstance(d, int) or d < 0 for d in out[name][0]):
            raise ValueError(
                f"plan: parameter {name!r}: expected a shape of ints >= 0, got {entry!r}"
            )
    return out


def units_from_names(names: Sequence[str]) -> list[str]:
    """Units as ``default_units`` would find them: a prefix ending in a numeric component."""
    units: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                units[".".join(parts[: i + 1])] = None
                break
    return list(units)


def shard_size(
    world_size: int, shard: int, replicate: int, microbatches: int, tensor: int = 1
) -> int:
    """The shard group size of a ``plan`` call (``-1``: the world over replicas x tensor)."""
    if world_size < 1 or replicate < 1 or microbatches < 1 or tensor < 1:
        raise ValueError(
            f"plan: world_size ({world_size}), replicate ({replicate}), tensor ({tensor}) and "
            f"microbatches ({microbatches}) must be >= 1"
        )
    if shard == -1:
        if world_size % (replicate * tensor):
            raise ValueError(
                f"plan: world size {world_size} is not divisible by replicate={replicate} x "
                f"tensor={tensor}"
            )
        shard = world_size // (replicate * tensor)
    if shard * replicate * tensor != world_size:
        raise ValueError(
            f"plan: shard ({shard}) x replicate ({replicate}) x tensor ({tensor}) must equal "
            f"the world size {world_size}"
        )
    return shard


def tensor_table(params: ShapesArg, table: dict, tensor: int) -> tuple[dict, TensorParallel | None]:
    """Tensor rank 0's local shapes (the largest shards) of a model after
    ``parallelize_module`` on a tensor mesh of ``tensor`` ranks, and its tensor axis."""
    if tensor == 1:
        if isinstance(params, nn.Module) and any(
            isinstance(p, DTensor) for p in params.parameters()
        ):
            raise ValueError(
                "plan: the model holds DTensor parameters (parallelize_module); pass "
                "tensor=T, the size of the tensor mesh they live on"
            )
        return table, None
    if not isinstance(params, nn.Module):
        raise ValueError(
            f"plan: tensor={tensor} needs the model after parallelize_module (its DTensor "
            "placements), not a table of shapes"
        )
    leaves = {}
    for name, p in params.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if p.device_mesh.size() != tensor:
            raise ValueError(
                f"plan: parameter {name!r} is a DTensor on {p.device_mesh}; expected a tensor "
                f"mesh of tensor={tensor} ranks"
            )
        leaves[name] = leaf = leaf_of(name, p)
        table[name] = (local_shape(leaf.shape, leaf.dim, tensor, 0), table[name][1])
    return table, TensorParallel(ShapeMesh(1, tensor), leaves)  # type: ignore[arg-type]
