"""Static shard layout: which rows of which parameter each rank owns, and how leaves bucket.

Every parameter is sharded on dim 0 over the "shard" axis, FSDP2 style: ``rows`` is padded to
``shard_size * rows_per_shard`` and shard rank ``r`` owns rows ``[r * rps, (r + 1) * rps)``,
of which only the ones below ``rows`` are real. A 0-d parameter counts as one row. ``no_shard``
is the same layout with a shard size of 1 (everything is replicated over the whole world).

HFSDP (``outer_strategy="optim"``) shards the masters and the optimizer state over every rank
of an ``R x S`` mesh: the layout's shard size is ``R * S`` and rank ``(r, s)`` holds master
index ``m = s * R + r``, so the ``R`` masters of shard rank ``s`` are consecutive rows, and
together they are exactly the rows ``s`` holds as an inner (HSDP) shard of ``R * rps`` rows
per leaf. :attr:`Layout.inner` is that inner layout: compute params, gathers and gradients
within a replica use it; what crosses "replicate" is a reduce-scatter of the inner gradient
shard into masters and an all-gather of the updated masters back into it (with a param wire,
the masters encoded once by their owners and the inner shard kept so: :mod:`funcshard.comm.params`).

Leaves of one gather unit with the same dtypes and placement form a bucket: one flat buffer,
one collective, one fused optimizer call. The layout is computed locally from parameter shapes
and the mesh shape alone, so every rank derives the same one without communicating (every
tensor rank the same buckets of its local shards: offload picks by shapes that agree).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from funcshard import mesh as mesh_lib
from funcshard.buckets import Block, GlobalShape, Members, PerBucket, scale_index
from funcshard.model_units import (
    ROOT_UNIT,
    UnitsArg,
    default_units,
    resolve_units,
    tied_aliases,
    unit_of,
)
from funcshard.offload_choice import pick_offloaded
from funcshard.policy import LeafDtypes, MixedPrecisionPolicy
from funcshard.strategy import OuterStrategy, Strategy
from funcshard.tensor_parallel import TensorParallel

__all__ = [
    "STRATEGIES",
    "LeafSpec",
    "Bucket",
    "Layout",
    "Placement",
    "build_layout",
    "ROOT_UNIT",
    "UnitsArg",
    "default_units",
    "tied_aliases",
]

STRATEGIES = tuple(s.value for s in Strategy)  # the names users pass


@dataclasses.dataclass(frozen=True, slots=True)
class LeafSpec:
    """Where one parameter lives. ``offset`` is into its bucket's local flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtypes: LeafDtypes
    unit: int
    rows: int
    rows_per_shard: int
    row_numel: int
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        """Elements of one padded shard."""
        return self.rows_per_shard * self.row_numel

    def row_range(self, shard_rank: int) -> tuple[int, int]:
        """The real rows ``[start, stop)`` owned by ``shard_rank`` (may be empty)."""
        start = min(shard_rank * self.rows_per_shard, self.rows)
        return start, min(start + self.rows_per_shard, self.rows)

    def scales(self, block: Block) -> LeafSpec:
        """The spec of this leaf's 8-bit blockwise scales (one per block of a row: ``block``
        divides the row and the leaf's offset, or cuts rows of this leaf's length, a
        :class:`~funcshard.buckets.Ragged`): shape ``(rows, blocks per row)``, placed in the
        bucket's scale buffer at the scale of its first element."""
        per_row = scale_index(block, self.row_numel)
        return dataclasses.replace(
            self,
            shape=(self.rows, per_row),
            row_numel=per_row,
            offset=scale_index(block, self.offset),
        )

    def shard_shape(self, shard_rank: int) -> tuple[int, ...]:
        start, stop = self.row_range(shard_rank)
        if not self.shape:  # a 0-d leaf is one row, held whole by the first rank
            return () if stop > start else (0,)
        return (stop - start, *self.shape[1:])


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """Leaves that move and step together: one unit, one set of dtypes, one placement."""

    index: int
    unit: int
    dtypes: LeafDtypes
    offload: bool
    leaves: tuple[int, ...]
    numel: int  # local (per-shard) flat elements, padding included


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where the rows of every parameter of a state's flat buffers live, on every shard rank.

    What an optimizer that needs whole matrices (``fs.optim.muon``) gets beside the buffers:
    the "shard" group the rows are spread over, this rank's place in it, the device of its
    collectives, per bucket (keyed by its :class:`Members`) every member's :class:`LeafSpec`
    (the same offsets and row ranges on every rank), the replicas (ranks holding the same rows:
    "replicate", every rank under ``no_shard``) that may share out the work on whole matrices,
    and the tensor axis (members split over it are local shards of larger matrices)."""

    group: object  # the "shard" axis ProcessGroup (None when size == 1)
    size: int
    rank: int
    device: torch.device
    specs: dict[Members, tuple[LeafSpec, ...]]
    replicas: object = None  # the ProcessGroup of the replicas (None when replica_count == 1)
    replicas_axis: str = "replicate"  # their mesh axis, for the accounting ("world": no_shard)
    replica_count: int = 1
    replica_rank: int = 0
    axis: str = "shard"  # the mesh axis of ``group``, for the accounting ("world": HFSDP)
    tensor: TensorParallel | None = None

    def leaves(self, members: Members) -> tuple[LeafSpec, ...]:
        """The specs of the parameters one flat buffer packs, in buffer order."""
        try:
            return self.specs[members]
        except KeyError:
            raise KeyError(
                f"Placement: no bucket packs {list(members.names)}; the buffers do "
                "not come from this state's layout"
            ) from None


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Static metadata of a TrainState: never a pytree leaf, identical on every rank."""

    mesh: DeviceMesh
    policy: MixedPrecisionPolicy
    strategy: Strategy
    leaves: tuple[LeafSpec, ...]
    buckets: tuple[Bucket, ...]
    units: tuple[str, ...]  # module prefix per unit; "" is the root unit
    device: torch.device
    offload_fraction: float
    # (alias, parameter) per tied name named_parameters() drops (GPT-2's lm_head.weight)
    aliases: tuple[tuple[str, str], ...] = ()
    # bitwise the same results on every layout with as many gradient chunks (funcshard.determinism)
    deterministic: bool = False
    # what is sharded over "replicate" (HFSDP: masters and optimizer state, see the module)
    outer: OuterStrategy = OuterStrategy.NO_SHARD
    # HFSDP's inner layout (:attr:`inner`): the R master sections a shard is made of, kept
    # encoded by a param wire as they crossed "replicate"; 0 elsewhere (one section)
    packed_sections: int = 0
    # the tensor axis of a tensor-parallel model (:mod:`funcshard.tensor_parallel`): leaves are
    # then its parameters' LOCAL shards, ``mesh`` the data-parallel submesh of this tensor rank
    tensor: TensorParallel | None = None

    def aliases_of(self, name: str) -> tuple[str, ...]:
        """The other names of parameter ``name`` in the model's state_dict (tied weights)."""
        return tuple(a for a, p in self.aliases if p == name)

    @property
    def hierarchical(self) -> bool:
        """HFSDP: masters and optimizer state sharded over "replicate" x "shard"."""
        return self.outer.shards_optim

    @functools.cached_property
    def replicas(self) -> int:
        """The size of the mesh's "replicate" axis."""
        return mesh_lib.axis_size(self.mesh, "replicate")

    @functools.cached_property
    def shard_size(self) -> int:
        """Ranks the master rows are spread over (``R * S`` under HFSDP)."""
        if not self.strategy.shards_optim:
            return 1
        size = mesh_lib.axis_size(self.mesh, "shard")
        return size * self.replicas if self.hierarchical else size

    @property
    def shard_rank(self) -> int:
        """This rank's master index (``s * R + r`` under HFSDP)."""
        if not self.strategy.shards_optim:
            return 0
        rank = mesh_lib.axis_rank(self.mesh, "shard")
        if self.hierarchical:
            return rank * self.replicas + mesh_lib.axis_rank(self.mesh, "replicate")
        return rank

    @property
    def dp_size(self) -> int:
        return self.mesh.size()

    @property
    def shard_group(self):
        """The group of ``shard_size`` ranks, its rank order that of ``shard_rank``."""
        if self.hierarchical:
            return mesh_lib.master_group(self.mesh)
        return mesh_lib.axis_group(self.mesh, "shard")

    @property
    def shard_axis(self) -> str:
        """The mesh axis of ``shard_group``, as ``fs.comm_stats`` counts it."""
        return "world" if self.hierarchical else "shard"

    @property
    def replicate_group(self):
        """The group gradient shards are all-reduced over (the world when nothing is sharded;
        under HFSDP the "replicate" axis they are reduce-scattered over)."""
        if not self.strategy.shards_optim:
            return mesh_lib.world_group(self.mesh)
        return mesh_lib.axis_group(self.mesh, "replicate")

    @property
    def replicate_axis(self) -> str:
        """The mesh axis of ``replicate_group``, as ``fs.comm_stats`` counts it."""
        return "replicate" if self.strategy.shards_optim else "world"

    @functools.cached_property
    def inner(self) -> Layout:
        """The layout within one replica: compute params, gathers and gradients over "shard".

        Itself unless HFSDP; under HFSDP the HSDP layout whose shard ``s`` holds exactly the
        rows of masters ``s * R .. s * R + R - 1`` (``R * rows_per_shard`` rows per leaf, in
        master order), so an inner shard is ``R`` master sections leaf by leaf
        (:func:`funcshard.sharding.from_rank_sections` over ``R``). With a param wire the
        shard is kept as those ``R`` sections, encoded (:attr:`packed_sections`).
        """
        if not self.hierarchical:
            return self
        r = self.replicas
        leaves = tuple(
            dataclasses.replace(s, rows_per_shard=r * s.rows_per_shard, offset=r * s.offset)
            for s in self.leaves
        )
        buckets = tuple(dataclasses.replace(b, numel=r * b.numel) for b in self.buckets)
        return dataclasses.replace(
            self, leaves=leaves, buckets=buckets, outer=OuterStrategy.NO_SHARD, packed_sections=r
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(leaf.name for leaf in self.leaves)

    def leaf(self, name: str) -> LeafSpec:
        if (spec := self._by_name.get(name)) is None:
            raise KeyError(f"no parameter named {name!r} in this state")
        return spec

    @functools.cached_property
    def _by_name(self) -> dict[str, LeafSpec]:
        return {spec.name: spec for spec in self.leaves}

    def bucket_leaves(self, bucket: Bucket) -> list[LeafSpec]:
        return [self.leaves[i] for i in bucket.leaves]

    @functools.cached_property
    def members(self) -> tuple[Members, ...]:
        """Per bucket, the names and shapes of the parameters it packs."""
        return tuple(
            Members(
                tuple(s.name for s in self.bucket_leaves(b)),
                tuple(s.shape for s in self.bucket_leaves(b)),
                None
                if self.tensor is None or not self.tensor.leaves
                else tuple(self.tensor.full_shape(s.name, s.shape) for s in self.bucket_leaves(b)),
            )
            for b in self.buckets
        )

    @functools.cached_property
    def placement(self) -> Placement:
        """Row placement of every bucket over the "shard" axis (see :class:`Placement`).
        Its groups are dropped once their world is destroyed (:func:`funcshard.mesh.hold`)."""
        size = self.shard_size
        replicas = self.dp_size // size
        mesh_lib.hold(self, _drop_groups)
        return Placement(
            group=self.shard_group if size > 1 else None,
            size=size,
            rank=self.shard_rank,
            device=self.device,
            specs={
                m: tuple(self.bucket_leaves(b))
                for m, b in zip(self.members, self.buckets, strict=True)
            },
            replicas=self.replicate_group if replicas > 1 else None,
            replica_count=replicas,
            replica_rank=dist.get_rank(self.replicate_group) if replicas > 1 else 0,
            replicas_axis=self.replicate_axis,
            axis=self.shard_axis,
            tensor=self.tensor,
        )

    def per_bucket(self, values: Sequence) -> PerBucket:
        """``values`` (one per bucket) as the PerBucket the optimizer sees."""
        return PerBucket(values, self.members)

    def achieved_offload_fraction(self) -> float:
        total = sum(b.numel for b in self.buckets)
        return sum(b.numel for b in self.buckets if b.offload) / total if total else 0.0


def _drop_groups(layout: Layout) -> None:
    """What a layout of a destroyed world keeps of its groups: its placement, its mesh's."""
    layout.__dict__.pop("placement", None)
    if layout.mesh is not None:
        mesh_lib.drop_mesh_groups(layout.mesh)


def _offload_sizes(
    params: dict[str, tuple[tuple[int, ...], torch.dtype]],
    raw: list[tuple],
    tensor: TensorParallel | None,
    policy: MixedPrecisionPolicy,
    shard_size: int,
    deterministic: bool,
) -> list[int]:
    """The shard elements per leaf the offloaded leaves are picked by. Under tensor parallelism
    every tensor rank must pick the same leaves (their buckets, hence the order of the
    collectives over "tensor", follow from it), so a leaf split unevenly over "tensor" counts
    as tensor rank 0's shard (:meth:`TensorParallel.agreed_shape`) on every rank."""
    if tensor is None:
        return [r[4] * r[5] for r in raw]
    sizes = []
    for name, (shape, dtype) in params.items():
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
    tensor: TensorParallel | None = None,
) -> tuple[list[LeafSpec], list[Bucket]]:
    """The leaf specs and buckets of ``raw`` (``_leaf_rows`` + the unit, per parameter):
    buckets in order of first appearance of (unit, dtypes, placement, rule), leaves in model
    order. Under tensor parallelism the rule is asked with the global shape (leaves split
    over "tensor" share buckets with replicated ones: one collective per unit, as without)."""
    keys: dict[tuple, list[int]] = {}
    for i, (name, shape, dtypes, *_rest, unit) in enumerate(raw):
        full = GlobalShape(tensor.full_shape(name, shape), shape) if tensor is not None else shape
        rule = partition(name, full) if partition is not None else None
        keys.setdefault((unit, dtypes, i in offloaded, rule), []).append(i)
    leaves: list[LeafSpec | None] = [None] * len(raw)
    buckets = []
    ordered = sorted(keys.items(), key=lambda kv: kv[1][0])
    for b, ((unit, dtypes, off, *_), members) in enumerate(ordered):
        offset = 0
        for i in members:
            name, shape, _, rows, rps, row_numel, _ = raw[i]
            leaves[i] = LeafSpec(name, shape, dtypes, unit, rows, rps, row_numel, b, offset)
            offset += rps * row_numel
        buckets.append(Bucket(b, unit, dtypes, off, tuple(members), offset))
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
    tensor: TensorParallel | None = None,
) -> Layout:
    """Computes the layout from ``{name: (shape, dtype)}`` in ``named_parameters`` order.

    ``tensor``: the tensor axis of a tensor-parallel model, whose ``params`` are then the local
    shards; ``mesh`` may be the 3-D mesh (the layout keeps its data-parallel submesh).

    ``partition(name, shape)`` is the optimizer's rule key (``Optimizer.partition``): leaves
    with different keys never share a bucket, so every flat buffer has one rule.
    ``deterministic`` asks for the layout-independent reductions of
    :mod:`funcshard.determinism` (it checks that the mesh and policy allow them).
    ``outer_strategy`` is what is sharded over "replicate" (``"optim"``: HFSDP).
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
    mesh = mesh_lib.data_parallel(mesh)
    prefixes = resolve_units(model, units) if model is not None else list(units or [])
    shard_size = mesh_lib.axis_size(mesh, "shard") if strategy.shards_optim else 1
    if outer.shards_optim:
        shard_size *= mesh_lib.axis_size(mesh, "replicate")

    raw = [
        _leaf_rows(name, shape, dtype, policy, shard_size, deterministic)
        + (unit_of(name, prefixes),)
        for name, (shape, dtype) in params.items()
    ]
    offloaded = pick_offloaded(
        _offload_sizes(params, raw, tensor, policy, shard_size, deterministic), offload_fraction
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
    )


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
