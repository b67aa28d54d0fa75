"""What :func:`funcshard.planner.plan.plan` reads: a mesh known by its shape, the table of parameter
shapes and dtypes (of a model, or given), the units a shape table implies, and the local shapes
of a tensor-parallel model."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from funcshard.distributed import dtensor as dt
from funcshard.distributed.dims import EXPERT, MeshDims
from funcshard.parallel.axis import NO_AXIS, ModelAxis
from funcshard.parallel.tensor import (
    TensorLeaf,
    TensorParallel,
    leaf_of,
    local_shape,
    planned_leaves,
)

__all__ = [
    "transformer_shapes",
    "ShapeMesh",
    "ShapesArg",
    "param_table",
    "units_from_names",
    "mesh_dims",
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


def mesh_dims(
    world_size: int,
    shard: int,
    replicate: int,
    microbatches: int,
    tensor: int = 1,
    expert: int = 1,
    context: int = 1,
) -> MeshDims:
    """The mesh of a ``plan`` call (``shard=-1``: the world over replicas x tensor)."""
    if world_size < 1 or microbatches < 1:  # the mesh's degrees: MeshDims checks them
        raise ValueError(
            f"plan: world_size ({world_size}) and microbatches ({microbatches}) must be >= 1"
        )
    return MeshDims.resolve(
        world_size,
        shard=shard,
        replicate=replicate,
        tensor=tensor,
        expert=expert,
        context=context,
        who="plan",
    )


def _expert(p: dt.DTensor) -> bool:
    """An expert DTensor (on an expert mesh): planned global, as ``fs.init`` holds it."""
    return EXPERT in (p.device_mesh.mesh_dim_names or ())


def tensor_table(
    params: ShapesArg,
    table: dict,
    tensor: int,
    tensor_plan: Mapping[str, dt.ParallelStyle] | None = None,
) -> tuple[dict, ModelAxis]:
    """Tensor rank 0's local shapes (the largest shards) of a model after
    ``parallelize_module`` on a tensor mesh of ``tensor`` ranks, or of a plain model under
    ``tensor_plan`` (``parallelize_module``'s plan), and its tensor axis."""
    if tensor_plan is not None and tensor == 1:
        raise ValueError("plan: tensor_plan splits over the tensor axis; pass tensor=T > 1")
    if tensor == 1:
        if isinstance(params, nn.Module) and any(
            dt.is_dtensor(p) and not _expert(p) for p in params.parameters()
        ):
            raise ValueError(
                "plan: the model holds DTensor parameters (parallelize_module); pass "
                "tensor=T, the size of the tensor mesh they live on"
            )
        return table, NO_AXIS
    if not isinstance(params, nn.Module):
        raise ValueError(
            f"plan: tensor={tensor} needs the model after parallelize_module (its DTensor "
            "placements) or the plain model with tensor_plan=, not a table of shapes"
        )
    dtensors = {n: p for n, p in params.named_parameters() if dt.is_dtensor(p) and not _expert(p)}
    if tensor_plan is not None and dtensors:
        raise ValueError(
            f"plan: tensor_plan given for a model already parallelized (parameter "
            f"{next(iter(dtensors))!r} is a DTensor); pass one or the other"
        )
    if tensor_plan is None and not dtensors:
        raise ValueError(
            f"plan: tensor={tensor}, but no parameter of the model is a DTensor: every one "
            "would be planned as replicated over 'tensor'. Apply the tensor-parallel plan first "
            "(parallelize_module(model, mesh['tensor'], plan)), or pass the plain model with "
            "tensor_plan=plan"
        )
    leaves: dict[str, TensorLeaf] = {}
    for name, p in dtensors.items():
        if p.device_mesh.size() != tensor:
            raise ValueError(
                f"plan: parameter {name!r} is a DTensor on {p.device_mesh}; expected a tensor "
                f"mesh of tensor={tensor} ranks"
            )
        leaves[name] = leaf_of(name, p)
    if tensor_plan is not None:
        leaves = planned_leaves(params, tensor_plan)
    for name, leaf in leaves.items():
        table[name] = (local_shape(leaf.shape, leaf.dim, tensor, 0), table[name][1])
    return table, TensorParallel(ShapeMesh(1, tensor), leaves)  # type: ignore[arg-type]


def transformer_shapes(
    *,
    n_layers: int = 80,
    dim: int = 8192,
    ffn_dim: int = 28672,
    n_heads: int = 64,
    n_kv_heads: int = 8,
    vocab: int = 32000,
) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-style decoder (defaults: Llama-2-70B, 69.0B params).

    >>> round(sum(math.prod(s) for s in transformer_shapes().values()) / 1e9, 2)
    68.98
    """
    kv = dim // n_heads * n_kv_heads
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(n_layers):
        p = f"layers.{i}"
        shapes.update(
            {
                f"{p}.attention.wq.weight": (dim, dim),
                f"{p}.attention.wk.weight": (kv, dim),
                f"{p}.attention.wv.weight": (kv, dim),
                f"{p}.attention.wo.weight": (dim, dim),
                f"{p}.feed_forward.w1.weight": (ffn_dim, dim),
                f"{p}.feed_forward.w2.weight": (dim, ffn_dim),
                f"{p}.feed_forward.w3.weight": (ffn_dim, dim),
                f"{p}.attention_norm.weight": (dim,),
                f"{p}.ffn_norm.weight": (dim,),
            }
        )
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (vocab, dim)
    return shapes
