"""What an expert-parallel step moves beside the data-parallel collectives: the tokens'
all-to-all to their experts and back, for balanced routing (``fs.plan(..., expert=E,
routing=...)``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from funcshard.distributed import dtensor as dt
from funcshard.distributed.dims import EXPERT, MeshDims
from funcshard.layout.layout import Layout
from funcshard.layout.strategy import Strategy
from funcshard.parallel.axis import ModelAxis
from funcshard.parallel.expert_axis import ExpertAxis, ExpertLeaf
from funcshard.planner.inputs import ShapeMesh, param_table, tensor_table

__all__ = [
    "Routing",
    "add_all_to_all",
    "routed_experts",
    "add_expert_row_sums",
    "expert_table",
    "model_table",
]


class _ExpertShape:
    """An expert axis known by its size (expert rank 0's view), for ``build_layout``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return 0


def model_table(
    params: object,
    dtype: torch.dtype,
    tensor: int,
    tensor_plan: Any,
    dims: MeshDims,
    strategy: str | Strategy,
) -> tuple[dict, ModelAxis, ShapeMesh | None]:
    """The shapes ``build_layout`` takes for a plan (:func:`funcshard.planner.inputs.
    tensor_table`, then :func:`expert_table`): the table, the model's axis, the expert mesh."""
    table, axis = tensor_table(params, param_table(params, dtype), tensor, tensor_plan)
    return expert_table(params, table, axis, dims, strategy)


def expert_table(
    params: object, table: dict, axis: ModelAxis, dims: MeshDims, strategy: str | Strategy
) -> tuple[dict, ModelAxis, ShapeMesh | None]:
    """The layout's table, axis and expert mesh of a model whose experts are DTensors on an
    expert mesh: each expert leaf as expert rank 0's rows ``(num_experts / E, ...)``,
    data-parallel over the ``R x S / E`` ranks of one expert index (as ``fs.init`` holds it);
    ``table`` and ``axis`` as they are (and no expert mesh) without one.

    Raises:
      ValueError: ``expert`` does not divide a parameter's number of experts (named);
        ``expert > 1`` with a table of shapes or a model without expert DTensors (its
        experts would be planned as dense weights).
    """
    expert = dims.expert
    if not isinstance(params, nn.Module):
        if expert > 1:
            raise ValueError(
                f"plan: expert={expert} with a table of shapes, which cannot say which "
                "parameters are experts (each would be planned as a dense weight); pass the "
                "model after parallelize_module(experts, mesh['expert'], fs.ExpertParallel())"
            )
        return table, axis, None
    experts = {}
    for name, p in params.named_parameters():
        if not (dt.is_dtensor(p) and EXPERT in (p.device_mesh.mesh_dim_names or ())):
            continue
        if expert == 1:
            return table, axis, None  # planned as the same model without the axis: global experts
        if p.dim() == 0 or p.shape[0] % expert:
            raise ValueError(
                f"plan: parameter {name!r} of shape {tuple(p.shape)}: expert={expert} must "
                "divide its number of experts (dim 0)"
            )
        experts[name] = ExpertLeaf(tuple(p.shape), tuple(p.stride()))
        shape, dtype = table[name]
        table[name] = ((shape[0] // expert, *shape[1:]), dtype)
    if not experts:
        if expert > 1:
            raise ValueError(
                f"plan: expert={expert}, but no parameter of the model is an expert DTensor "
                "(Shard(0) on a mesh with an 'expert' dim): every expert would be planned as a "
                "dense weight, gathered and reduced whole. Plan the model as fs.init takes it, "
                "after parallelize_module(experts, mesh['expert'], fs.ExpertParallel()), or "
                "plan expert=1"
            )
        return table, axis, None
    sharded = Strategy.parse(strategy).shards_optim
    axis = ExpertAxis(_ExpertShape(expert), experts, axis, sharded)  # type: ignore[arg-type]
    return table, axis, ShapeMesh(dims.replicate, dims.shard // expert)


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    """A step's routed tokens on one rank, for the plan of its all-to-alls.

    Args:
      rows: rows this rank routes per step, all microbatches and MoE layers together (tokens
        x top_k x layers).
      width: elements of one row (the model dim the experts take).
      dtype: the rows' dtype on the wire.
      layers: the MoE layers (each runs 4 all-to-alls a microbatch: dispatch and combine,
        forward and backward).
      experts: the experts of each layer whose token counts (int64) ``fs.ExpertParallel``
        exchanges before each dispatch (one more all-to-all a layer and microbatch); None:
        read from the planned model's ``fs.ExpertParallel`` modules (none for a model that
        routes its tokens itself, as :attr:`bytes` counts the rows only).

    >>> Routing(rows=8, width=4).bytes
    512
    """

    rows: int
    width: int
    dtype: torch.dtype = torch.float32
    layers: int = 1
    experts: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 0 or self.width < 0 or self.layers < 1 or (self.experts or 0) < 0:
            raise ValueError(
                f"plan: routing {self}: rows, width, experts >= 0 and layers >= 1 expected"
            )

    @property
    def bytes(self) -> int:
        """Bytes this rank sends by all-to-all per step when routing is balanced (each rank
        then receives as many rows as it sends): every row out and back, forward and backward."""
        return 4 * self.rows * self.width * self.dtype.itemsize


def routed_experts(model: object, routing: Routing | None) -> list[int]:
    """The experts of each exchange of counts a microbatch makes: ``routing.experts`` for each
    of its layers, or those of ``model``'s ``fs.ExpertParallel`` modules."""
    if routing is None:
        return []
    if routing.experts is not None:
        return [routing.experts] * routing.layers if routing.experts else []
    if not isinstance(model, nn.Module):
        return []
    from funcshard.parallel import experts  # ExpertParallel's (DTensor's) import: routing only

    return experts.routed_experts(model)


def add_all_to_all(
    expert: int,
    routing: Routing | None,
    microbatches: int,
    comm: dict[str, int],
    calls: dict[str, int],
    by_axis: dict[str, int],
    counts: list[int] = (),  # type: ignore[assignment]
) -> None:
    """Adds the all-to-alls of ``routing`` over an expert axis of ``expert`` ranks (none on
    one rank, as ``funcshard.distributed.ops`` skips a group of one), and the exchanges of
    ``counts`` (:func:`routed_experts`: int64 counts, one all-to-all each a microbatch)."""
    if expert == 1 or routing is None:
        return
    nbytes = routing.bytes + microbatches * 8 * sum(counts)
    comm["all_to_all"] = comm.get("all_to_all", 0) + nbytes
    n = 4 * routing.layers * microbatches + microbatches * len(counts)
    calls["all_to_all"] = calls.get("all_to_all", 0) + n
    by_axis["expert"] = by_axis.get("expert", 0) + nbytes


def add_expert_row_sums(layout: Layout, expert, add, metric_bytes: int) -> None:
    """A deterministic norm's all-gathers of the expert leaves' row sums (``expert(spec)``:
    whether a leaf is one): over their expert index's shards, then over "expert"."""
    view = layout.experts_view
    rows = sum(s.rows_per_shard for s in layout.leaves if expert(s))
    size = view.shard_size * rows * metric_bytes
    if view.shard_size > 1:
        add("metrics", 1, size, view.shard_axis)
    experts = layout.mesh.size(1) // view.group_mesh.size(1)  # S / (S / E)
    if experts > 1:
        add("metrics", 1, experts * size, "expert")
