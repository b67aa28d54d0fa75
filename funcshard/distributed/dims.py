"""The degrees of a mesh's axes, validated in one place (torchtitan's ``ParallelDims``).

``fs.make_mesh`` builds its DeviceMesh from a :class:`MeshDims`, and ``fs.plan`` describes
the mesh it plans for by the same value, so both accept and refuse the same shapes with the
same words.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MeshDims", "DATA_AXES", "TENSOR", "EXPERT", "CONTEXT", "PIPELINE", "SHARD_OUTER"]

DATA_AXES = ("replicate", "shard")
TENSOR = "tensor"
EXPERT = "expert"
CONTEXT = "context"
PIPELINE = "pipeline"
# the shard ranks of one expert index ("shard" = shard_outer x expert), or of one context rank
# ("shard" = shard_outer x context)
SHARD_OUTER = "shard_outer"


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

    ``context = C > 1`` adds the context axis between "shard" and "tensor" (rank ``((r * S +
    s) * C + c) * T + t``): the DeviceMesh is ``(R, S, C[, T])`` named ``("replicate",
    "shard_outer", "context"[, "tensor"])``, "shard" their flattened "shard_outer" x "context"
    (parameters sharded and gradients reduced over both: every rank its own data-parallel rank).

    >>> dims = MeshDims.resolve(8, shard=-1, replicate=2, context=2)
    >>> dims.shard, dims.names, dims.shape, dims.dp_size
    (2, ('replicate', 'shard_outer', 'context'), (2, 2, 2), 8)

    ``pipeline = P > 1`` adds the outermost axis "pipeline" (torchtitan's order): global rank
    ``p * (world // P)`` + the rank the mesh without it gives; every other degree (and
    ``dp_size``) is that of one pipeline rank's sub-world.

    >>> dims = MeshDims.resolve(8, shard=-1, pipeline=2)
    >>> dims.shard, dims.names, dims.shape, dims.dp_size, dims.world
    (4, ('pipeline', 'replicate', 'shard'), (2, 1, 4), 4, 8)
    """

    replicate: int
    shard: int
    tensor: int = 1
    expert: int = 1
    context: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for axis in ("replicate", "shard", "tensor", "expert", "context", "pipeline"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be >= 1, got {getattr(self, axis)}")
        if self.shard % self.expert:
            raise ValueError(
                f"expert={self.expert} must divide shard={self.shard}: the expert axis is "
                "carved out of the shard axis"
            )
        if self.expert > 1 and self.context > 1:
            raise ValueError(
                f"expert={self.expert} and context={self.context}: a mesh with both the "
                "expert and the context axis is not supported yet"
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
        context: int = 1,
        who: str = "mesh",
        pipeline: int = 1,
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
        if context < 1:
            raise ValueError(f"{who}: context must be >= 1, got {context}")
        if pipeline < 1 or world % pipeline:
            raise ValueError(
                f"{who}: pipeline={pipeline} must be >= 1 and divide the world size {world}"
            )
        world //= pipeline  # every other axis lives inside one pipeline rank
        # the context factor is named only where it is asked for: the words stay v5's without
        ctx_words = f" x context={context}" if context > 1 else ""
        ctx_term = f" x context ({context})" if context > 1 else ""
        if shard == -1:
            if world % (replicate * tensor * context):
                raise ValueError(
                    f"{who}: world size {world} is not divisible by replicate={replicate} x "
                    f"tensor={tensor}{ctx_words}"
                )
            shard = world // (replicate * tensor * context)
        if shard < 1 or shard * replicate * tensor * context != world:
            raise ValueError(
                f"{who}: shard ({shard}) x replicate ({replicate}) x tensor ({tensor}){ctx_term} "
                f"must equal the world size {world}"
                + (f" / pipeline ({pipeline})" if pipeline > 1 else "")
            )
        if expert < 1 or shard % expert:
            raise ValueError(
                f"{who}: expert={expert} must be >= 1 and divide shard={shard} (the expert axis "
                "is carved out of the shard axis: shard rank s = s_outer * expert + e)"
            )
        if context > 1 and expert > 1:
            raise ValueError(
                f"{who}: expert={expert} and context={context}: a mesh with both the expert "
                "and the context axis is not supported yet"
            )
        return cls(replicate, shard, tensor, expert, context, pipeline)

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.context * self.tensor * self.pipeline

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: each steps its own batch (a tensor group shares one; a
        context group one batch, each rank its part of every sequence)."""
        return self.replicate * self.shard * self.context

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
    def has_context(self) -> bool:
        return self.context > 1

    @property
    def has_pipeline(self) -> bool:
        return self.pipeline > 1

    @property
    def inner(self) -> MeshDims:
        """The dims of one pipeline rank's sub-world (itself without a pipeline axis)."""
        return dataclasses.replace(self, pipeline=1)

    @property
    def expert_dp_size(self) -> int:
        """The ranks holding one expert index: the data-parallel ranks of an expert weight."""
        return self.replicate * self.shard // self.expert

    @property
    def names(self) -> tuple[str, ...]:
        """The DeviceMesh's axis names, outermost first."""
        if self.has_experts:
            data = ("replicate", SHARD_OUTER, EXPERT)
        elif self.has_context:
            data = ("replicate", SHARD_OUTER, CONTEXT)
        else:
            data = DATA_AXES
        names = (*data, TENSOR) if self.has_tensor else data
        return (PIPELINE, *names) if self.has_pipeline else names

    @property
    def shape(self) -> tuple[int, ...]:
        if self.has_experts:
            data = (self.replicate, self.shard // self.expert, self.expert)
        elif self.has_context:
            data = (self.replicate, self.shard, self.context)
        else:
            data = (self.replicate, self.shard)
        shape = (*data, self.tensor) if self.has_tensor else data
        return (self.pipeline, *shape) if self.has_pipeline else shape
