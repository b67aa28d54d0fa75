"""The degrees of a mesh's axes, validated in one place (torchtitan's ``ParallelDims``).

``fs.make_mesh`` builds its DeviceMesh from a :class:`MeshDims`, and ``fs.plan`` describes
the mesh it plans for by the same value, so both accept and refuse the same shapes with the
same words.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MeshDims", "DATA_AXES", "TENSOR", "EXPERT", "SHARD_OUTER"]

DATA_AXES = ("replicate", "shard")
TENSOR = "tensor"
EXPERT = "expert"
SHARD_OUTER = "shard_outer"  # the shard ranks of one expert index: "shard" = shard_outer x expert


@dataclasses.dataclass(frozen=True, slots=True)
class MeshDims:
    """``replicate x shard x tensor`` ranks: the data-parallel axes outermost, the tensor axis
    innermost (rank ``(r * S + s) * T + t``: a tensor group is ``T`` consecutive ranks).

    >>> dims = MeshDims.resolve(8, shard=-1, replicate=2, tensor=2)
    >>> dims.shard, dims.dp_size, dims.names, dims.shape
    (2, 4, ('replicate', 'shard', 'tensor'), (2, 2, 2))
    >>> MeshDims.resolve(4).has_tensor, MeshDims.resolve(4).names
    (False, ('replicate', 'shard'))

    ``expert = E > 1`` carves the expert axis out of "shard", innermost within it (shard rank
    ``s = s_outer * E + e``): the DeviceMesh is then ``(R, S / E, E[, T])`` named
    ``("replicate", "shard_outer", "expert"[, "tensor"])``, "shard" their flattened pair, the
    global rank the same as without it.

    >>> dims = MeshDims.resolve(8, shard=4, replicate=2, expert=2)
    >>> dims.names, dims.shape, dims.expert_dp_size
    (('replicate', 'shard_outer', 'expert'), (2, 2, 2), 4)
    """

    replicate: int
    shard: int
    tensor: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for axis in ("replicate", "shard", "tensor", "expert"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be >= 1, got {getattr(self, axis)}")
        if self.shard % self.expert:
            raise ValueError(
                f"expert={self.expert} must divide shard={self.shard}: the expert axis is "
                "carved out of the shard axis"
            )

    @classmethod
    def resolve(
        cls,
        world: int,
        *,
        shard: int = -1,
        replicate: int = 1,
        tensor: int = 1,
        expert: int = 1,
        who: str = "mesh",
    ) -> MeshDims:
        """The dims of a world of ``world`` ranks; ``shard=-1``: what the other axes leave.

        Raises:
          ValueError: a degree below 1, a world not divisible by ``replicate x tensor``, or
            degrees whose product is not the world size (``who`` names the caller).
        """
        if replicate < 1:
            raise ValueError(f"{who}: replicate must be >= 1, got {replicate}")
        if tensor < 1:
            raise ValueError(f"{who}: tensor must be >= 1, got {tensor}")
        if shard == -1:
            if world % (replicate * tensor):
                raise ValueError(
                    f"{who}: world size {world} is not divisible by replicate={replicate} x "
                    f"tensor={tensor}"
                )
            shard = world // (replicate * tensor)
        if shard < 1 or shard * replicate * tensor != world:
            raise ValueError(
                f"{who}: shard ({shard}) x replicate ({replicate}) x tensor ({tensor}) must "
                f"equal the world size {world}"
            )
        if expert < 1 or shard % expert:
            raise ValueError(
                f"{who}: expert={expert} must be >= 1 and divide shard={shard} (the expert axis "
                "is carved out of the shard axis: shard rank s = s_outer * expert + e)"
            )
        return cls(replicate, shard, tensor, expert)

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.tensor

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: each steps its own batch (a tensor group shares one)."""
        return self.replicate * self.shard

    @property
    def has_replicas(self) -> bool:
        """HSDP / HFSDP: more than one replica of the shard group."""
        return self.replicate > 1

    @property
    def has_tensor(self) -> bool:
        return self.tensor > 1

    @property
    def has_experts(self) -> bool:
        return self.expert > 1

    @property
    def expert_dp_size(self) -> int:
        """The ranks holding one expert index: the data-parallel ranks of an expert weight."""
        return self.replicate * self.shard // self.expert

    @property
    def names(self) -> tuple[str, ...]:
        """The DeviceMesh's axis names, outermost first."""
        data = ("replicate", SHARD_OUTER, EXPERT) if self.has_experts else DATA_AXES
        return (*data, TENSOR) if self.has_tensor else data

    @property
    def shape(self) -> tuple[int, ...]:
        if self.has_experts:
            data = (self.replicate, self.shard // self.expert, self.expert)
        else:
            data = (self.replicate, self.shard)
        return (*data, self.tensor) if self.has_tensor else data
