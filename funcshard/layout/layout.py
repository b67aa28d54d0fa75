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
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from funcshard.distributed import mesh as mesh_lib
from funcshard.layout.buckets import Block, Members, PerBucket, scale_index
from funcshard.layout.model_units import ROOT_UNIT, UnitsArg, default_units, tied_aliases
from funcshard.layout.policy import LeafDtypes, MixedPrecisionPolicy
from funcshard.layout.strategy import OuterStrategy, Strategy
from funcshard.parallel.axis import NO_AXIS, ModelAxis

__all__ = [
    "STRATEGIES",
    "LeafSpec",
    "Bucket",
    "Layout",
    "Placement",
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
        :class:`~funcshard.layout.buckets.Ragged`): shape ``(rows, blocks per row)``, placed in the
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
    # expert leaves: rows spread over the data-parallel ranks of one expert index
    # (:meth:`Layout.over`), not over every data-parallel rank
    expert: bool = False


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
    tensor: ModelAxis = NO_AXIS
    # the placement of the expert buckets (their own groups: Layout.over), None without
    experts: Placement | None = None

    def of(self, members: Members) -> Placement:
        """The placement of the bucket packing ``members``: this one, or the experts'."""
        if members in self.specs or self.experts is None:
            return self
        return self.experts

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
    # bitwise the same results on every layout with as many gradient chunks
    # (funcshard.layout.determinism)
    deterministic: bool = False
    # what is sharded over "replicate" (HFSDP: masters and optimizer state, see the module)
    outer: OuterStrategy = OuterStrategy.NO_SHARD
    # HFSDP's inner layout (:attr:`inner`): the R master sections a shard is made of, kept
    # encoded by a param wire as they crossed "replicate"; 0 elsewhere (one section)
    packed_sections: int = 0
    # the tensor axis of a tensor-parallel model (:mod:`funcshard.parallel.tensor`): leaves are
    # then its parameters' LOCAL shards, ``mesh`` the data-parallel submesh of this tensor rank
    tensor: ModelAxis = NO_AXIS
    # expert parallel: the ("replicate", "shard_outer") mesh of this rank's expert index, the
    # ranks an expert bucket's rows are spread over; None without an expert axis
    expert_mesh: DeviceMesh | None = None
    # the view of the expert buckets (:meth:`over`): its groups are ``expert_mesh``'s
    expert_view: bool = False

    def over(self, bucket: Bucket) -> Layout:
        """The layout whose groups a bucket's rows are spread over: this one, or for an
        expert bucket its view on ``expert_mesh`` (the ``S / E`` shard ranks and the replicas
        holding the same experts). Its ``dp_size`` stays the whole data-parallel world's,
        the mean every gradient is divided by (torchtitan #1324)."""
        return self.experts_view if bucket.expert else self

    def spec_rank(self, spec: LeafSpec) -> int:
        """The shard rank whose rows of leaf ``spec`` this rank holds (its bucket's groups)."""
        return self.over(self.buckets[spec.bucket]).shard_rank

    @functools.cached_property
    def experts_view(self) -> Layout:
        """This layout as the expert buckets' collectives see it (see :meth:`over`)."""
        if self.expert_mesh is None:
            raise ValueError("this layout has no expert axis")
        return dataclasses.replace(self, expert_view=True)

    @property
    def group_mesh(self) -> DeviceMesh:
        """The mesh this layout's groups are axes of (``expert_mesh`` in the expert view)."""
        return self.expert_mesh if self.expert_view else self.mesh

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
        return mesh_lib.axis_size(self.group_mesh, "replicate")

    @functools.cached_property
    def shard_size(self) -> int:
        """Ranks the master rows are spread over (``R * S`` under HFSDP; ``S / E`` and
        ``R * S / E`` in the expert view)."""
        if not self.strategy.shards_optim:
            return 1
        size = mesh_lib.axis_size(self.group_mesh, "shard")
        return size * self.replicas if self.hierarchical else size

    @property
    def shard_rank(self) -> int:
        """This rank's master index (``s * R + r`` under HFSDP)."""
        if not self.strategy.shards_optim:
            return 0
        rank = mesh_lib.axis_rank(self.group_mesh, "shard")
        if self.hierarchical:
            return rank * self.replicas + mesh_lib.axis_rank(self.group_mesh, "replicate")
        return rank

    @property
    def dp_size(self) -> int:
        return self.mesh.size()

    @property
    def shard_group(self):
        """The group of ``shard_size`` ranks, its rank order that of ``shard_rank``."""
        if self.hierarchical:
            return mesh_lib.master_group(self.group_mesh)
        return mesh_lib.axis_group(self.group_mesh, "shard")

    @property
    def shard_axis(self) -> str:
        """The mesh axis of ``shard_group``, as ``fs.comm_stats`` counts it."""
        return "world" if self.hierarchical else "shard"

    @property
    def replicate_group(self):
        """The group gradient shards are all-reduced over (the world when nothing is sharded;
        under HFSDP the "replicate" axis they are reduce-scattered over)."""
        if not self.strategy.shards_optim:
            return mesh_lib.world_group(self.group_mesh)
        return mesh_lib.axis_group(self.group_mesh, "replicate")

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
        (:func:`funcshard.layout.sharding.from_rank_sections` over ``R``). With a param wire the
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
                if not self.tensor.leaves
                else tuple(self.tensor.full_shape(s.name, s.shape) for s in self.bucket_leaves(b)),
            )
            for b in self.buckets
        )

    @functools.cached_property
    def placement(self) -> Placement:
        """Row placement of every bucket over the "shard" axis (see :class:`Placement`).
        Its groups are dropped once their world is destroyed
        (:func:`funcshard.distributed.mesh.hold`)."""
        size = self.shard_size
        replicas = self.group_mesh.size() // size
        mesh_lib.hold(self, _drop_groups)
        return Placement(
            group=self.shard_group if size > 1 else None,
            size=size,
            rank=self.shard_rank,
            device=self.device,
            specs={
                m: tuple(self.bucket_leaves(b))
                for m, b in zip(self.members, self.buckets, strict=True)
                if b.expert == self.expert_view
            },
            replicas=self.replicate_group if replicas > 1 else None,
            replica_count=replicas,
            replica_rank=dist.get_rank(self.replicate_group) if replicas > 1 else 0,
            replicas_axis=self.replicate_axis,
            axis=self.shard_axis,
            tensor=self.tensor,
            experts=self.experts_view.placement
            if not self.expert_view and any(b.expert for b in self.buckets)
            else None,
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
    view = layout.__dict__.pop("experts_view", None)
    if view is not None:
        view.__dict__.pop("placement", None)
    for mesh in (layout.mesh, layout.expert_mesh):
        if mesh is not None:
            mesh_lib.drop_mesh_groups(mesh)
