"""``Agreement``: the group checkpoint collectives run on, and how its ranks agree that a
step of a save or a restore succeeded everywhere (every rank raises the real cause)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from funcshard.checkpoint.checksums import ChecksumError
from funcshard.distributed import mesh as mesh_lib
from funcshard.layout.layout import Layout

__all__ = ["Agreement"]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The group (and the device of its tensors) checkpoint collectives run on."""

    group: dist.ProcessGroup
    device: torch.device

    @classmethod
    def of(cls, layout: Layout) -> Agreement:
        """The state's world: every rank of its mesh (and of its tensor axis: the layout's
        mesh is then this tensor rank's data-parallel submesh, the world all of them)."""
        if not dist.is_initialized():
            raise RuntimeError("checkpoints are collective: torch.distributed must be initialized")
        if layout.tensor.size > 1:
            size = layout.mesh.size() * layout.tensor.size
            if size != dist.get_world_size():
                raise ValueError(
                    f"checkpoints of a tensor-parallel state need its mesh to span the world "
                    f"({size} of {dist.get_world_size()} ranks)"
                )
            return cls(dist.group.WORLD, layout.device)
        return cls(mesh_lib.world_group(layout.mesh), layout.device)

    @classmethod
    def of_state(cls, state: Any) -> Agreement:
        """``of(state.layout)``; for a pipelined state (whose layout is its pipeline rank's
        sub-world) every rank of the mesh, so that all pipeline ranks agree as one."""
        if state.pipeline is None:
            return cls.of(state.layout)
        return cls(state.pipeline.world, state.layout.device)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def failed_ranks(self, ok: bool) -> list[int]:
        """All-reduces one success flag per rank; the ranks that failed (all ranks agree)."""
        flags = torch.zeros(dist.get_world_size(self.group), dtype=torch.int32, device=self.device)
        flags[self.rank] = 0 if ok else 1
        dist.all_reduce(flags, group=self.group)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def raise_if_failed(self, what: str, error: BaseException | None) -> None:
        """Raises ``error`` here, and on the other ranks an error quoting every failed rank's
        (a ``ChecksumError`` when that is what they all raised, else a RuntimeError)."""
        failed = self.failed_ranks(error is None)
        if not failed:
            return
        mine = None if error is None else (type(error).__name__, str(error))
        errors: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, mine, group=self.group)  # only on failure: rare
        if error is not None:
            raise error
        quoted = "\n  ".join(f"rank {r}: {errors[r][0]}: {errors[r][1]}" for r in failed)
        message = f"{what} failed on rank(s) {failed}:\n  {quoted}"
        if all(errors[r][0] == ChecksumError.__name__ for r in failed):
            raise ChecksumError(message)
        raise RuntimeError(message)

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` in rank order on rank 0; None on the others."""
        out: list[Any] | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(value, out, group=self.group, group_dst=0)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        msg = [value]
        dist.broadcast_object_list(
            msg,
            group_src=0,
            group=self.group,
            device=self.device if self.device.type != "cpu" else None,
        )
        return msg[0]
