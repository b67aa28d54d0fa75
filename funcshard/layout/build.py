"""``build_layout``: the static shard layout of a model's parameters on a mesh, computed from
shapes alone (every rank derives the same one without communicating)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import mesh as mesh_lib
from funcshard.layout.layout import Bucket, Layout, LeafSpec
from funcshard.layout.model_units import UnitsArg, resolve_units, tied_aliases, unit_of
from funcshard.layout.offload_choice import pick_offloaded
from funcshard.layout.policy import MixedPrecisionPolicy
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.parallel.axis import NO_AXIS, ModelAxis

__all__ = ["build_layout", "DETERMINISTIC_ALIGN"]


def _offload_sizes(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]],
    tensor: ModelAxis,
    policy: MixedPrecisionPolicy,
    shard_sizes: list[int],
    deterministic: bool,
) -> list[int]:
    """The shard elements per leaf the offloaded leaves are picked by. Under tensor parallelism
    every tensor rank must pick the same leaves (their buckets, hence the order of the
    collectives over "tensor", follow from it), so a leaf split unevenly over "tensor" counts
    as tensor rank 0's shard on every rank
    (:meth:`~funcshard.parallel.axis.ModelAxis.agreed_shape`)."""
    sizes = []
    for (name, (shape, dtype)), shard_size in zip(params.items(), shard_sizes, strict=True):
        agreed = tensor.agreed_shape(name, tuple(shape))
        rows = _leaf_rows(name, agreed, dtype, policy, shard_size, deterministic)
        sizes.append(rows[4] * rows[5])
    return sizes


def _leaf_rows(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    policy: MixedPrecisionPolicy,
    shard_size: int,
    deterministic: bool,
) -> tuple:
    """``(name, shape, dtypes, rows, rows_per_shard, row_numel)`` of one parameter."""
    if not dtype.is_floating_point:
        raise TypeError(f"parameter {name!r}: expected a floating dtype, got {dtype}")
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    rps = -(-rows // shard_size)
    if deterministic:  # every leaf starts 128-byte aligned in the full buffer, whatever S
        step = DETERMINISTIC_ALIGN // math.gcd(row_numel, DETERMINISTIC_ALIGN)
        rps = -(-rps // step) * step
    return (name, tuple(shape), policy.resolve(dtype), rows, rps, row_numel)


def _bucket_leaves(
    raw: list[tuple],
    offloaded: set[int],
    partition: Callable[[str, tuple], Hashable] | None,
    tensor: ModelAxis = NO_AXIS,
) -> tuple[list[LeafSpec], list[Bucket]]:
    """The leaf specs and buckets of ``raw`` (``_leaf_rows`` + the unit, per parameter):
    buckets in order of first appearance of (unit, dtypes, placement, rule), leaves in model
    order. Under tensor parallelism the rule is asked with the global shape (leaves split
    over "tensor" share buckets with replicated ones: one collective per unit, as without)."""
    keys: dict[tuple, list[int]] = {}
    for i, (name, shape, dtypes, *_rest, unit) in enumerate(raw):
        rule = partition(name, tensor.rule_shape(name, shape)) if partition is not None else None
        key = (unit, dtypes, i in offloaded, rule, tensor.on_experts(name))
        keys.setdefault(key, []).append(i)
    leaves: list[LeafSpec | None] = [None] * len(raw)
    buckets = []
    ordered = sorted(keys.items(), key=lambda kv: kv[1][0])
    for b, ((unit, dtypes, off, _, expert), members) in enumerate(ordered):
        offset = 0
        for i in members:
            name, shape, _, rows, rps, row_numel, _ = raw[i]
            leaves[i] = LeafSpec(name, shape, dtypes, unit, rows, rps, row_numel, b, offset)
            offset += rps * row_numel
        buckets.append(Bucket(b, unit, dtypes, off, tuple(members), offset, expert))
    return leaves, buckets


def build_layout(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    model: nn.Module | None,
    mesh: DeviceMesh,
    policy: MixedPrecisionPolicy,
    strategy: str | Strategy,
    offload_fraction: float = 0.0,
    units: UnitsArg = None,
    partition: Callable[[str, tuple], Hashable] | None = None,
    deterministic: bool = False,
    outer_strategy: str | OuterStrategy = OuterStrategy.NO_SHARD,
    tensor: ModelAxis = NO_AXIS,
    expert_mesh: DeviceMesh | None = None,
) -> Layout:
    """Computes the layout from ``{name: (shape, dtype)}`` in ``named_parameters`` order.

    ``tensor``: the tensor axis of a tensor-parallel model, whose ``params`` are then the local
    shards; ``mesh`` may be the 3-D mesh (the layout keeps its data-parallel submesh).

    ``partition(name, shape)`` is the optimizer's rule key (``Optimizer.partition``): leaves
    with different keys never share a bucket, so every flat buffer has one rule.
    ``deterministic`` asks for the layout-independent reductions of
    :mod:`funcshard.layout.determinism` (it checks that the mesh and policy allow them).
    ``outer_strategy`` is what is sharded over "replicate" (``"optim"``: HFSDP).
    ``expert_mesh``: the ("replicate", "shard_outer") mesh expert leaves are data-parallel
    over (default: that of ``mesh``'s expert axis, if it has one).
    """
    strategy = Strategy.parse(strategy)
    outer = OuterStrategy.parse(outer_strategy, what="outer_strategy")
    if outer.shards_optim and not strategy.shards_optim:
        raise ValueError(
            'outer_strategy="optim" shards the optimizer over "replicate" x "shard", but '
            'strategy="no_shard" shards nothing over "shard"; the same placement is '
            'strategy="optim" on a 1-D mesh (fs.make_mesh(shard=world_size))'
        )
    if not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"offload_fraction must lie in [0, 1], got {offload_fraction}")
    if expert_mesh is None:
        expert_mesh = mesh_lib.expert_data_parallel(mesh)
    mesh = mesh_lib.data_parallel(mesh)
    prefixes = resolve_units(model, units) if model is not None else list(units or [])
    shard_sizes = _shard_sizes(params, tensor, mesh, expert_mesh, strategy, outer)

    raw = [
        _leaf_rows(name, shape, dtype, policy, size, deterministic) + (unit_of(name, prefixes),)
        for (name, (shape, dtype)), size in zip(params.items(), shard_sizes, strict=True)
    ]
    offloaded = pick_offloaded(
        _offload_sizes(params, tensor, policy, shard_sizes, deterministic), offload_fraction
    )

    leaves, buckets = _bucket_leaves(raw, offloaded, partition, tensor)
    if deterministic:
        _check_deterministic(mesh.size(), buckets, [leaf.name for leaf in leaves])
    return Layout(
        mesh=mesh,
        policy=policy,
        strategy=strategy,
        leaves=tuple(leaves),
        buckets=tuple(buckets),
        units=("", *prefixes),
        device=mesh_lib.local_device(mesh),
        offload_fraction=offload_fraction,
        aliases=tuple((a, n) for a, n in tied_aliases(model) if n in params)
        if model is not None
        else (),
        deterministic=deterministic,
        outer=outer,
        tensor=tensor,
        expert_mesh=expert_mesh,
    )


def _shard_sizes(
    params: dict,
    tensor: ModelAxis,
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None,
    strategy: Strategy,
    outer: OuterStrategy,
) -> list[int]:
    """Per leaf, the ranks its master rows are spread over: an expert leaf's over the ranks of
    its expert index only (``expert_mesh``)."""
    return [
        _shard_size(expert_mesh if tensor.on_experts(name) else mesh, strategy, outer)
        for name in params
    ]


def _shard_size(mesh: DeviceMesh, strategy: Strategy, outer: OuterStrategy) -> int:
    """Ranks a leaf's master rows are spread over on ``mesh`` (a data-parallel mesh)."""
    size = mesh_lib.axis_size(mesh, "shard") if strategy.shards_optim else 1
    return size * mesh_lib.axis_size(mesh, "replicate") if outer.shards_optim else size


# Elements a deterministic layout aligns each leaf's shard (hence its full view) to. CPU kernels
# give other bits for the same values at another alignment (a (6, 5) @ (5, 1) matmul whose
# weight starts 4 bytes further on, say), and the full buffer's padding, hence a leaf's
# offset, depends on the shard count; 32 elements are 128 bytes of fp32, 64 of bf16.
DETERMINISTIC_ALIGN = 32


def _check_deterministic(dp_size: int, buckets: list[Bucket], names: list[str]) -> None:
    """What ``deterministic=True`` needs of the mesh and the policy, checked at init."""
    if dp_size & (dp_size - 1):
        raise ValueError(
            f"deterministic=True: the data-parallel size must be a power of two "
            f"(the gradient chunks form a pairwise tree), got {dp_size} ranks"
        )
    for b in buckets:
        if b.dtypes.comm != b.dtypes.grad:
            raise ValueError(
                f"deterministic=True: parameter {names[b.leaves[0]]!r} would reduce with "
                f"grad_comm_dtype={b.dtypes.comm} and accumulate in main_grads_dtype="
                f"{b.dtypes.grad}; the rounding to the wire dtype would then depend on which "
                "chunks share a rank. Use grad_comm_dtype=None (or equal to main_grads_dtype)"
            )
