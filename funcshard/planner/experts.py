"""What an expert-parallel step moves beside the data-parallel collectives: the tokens'
all-to-all to their experts and back, for balanced routing (``fs.plan(..., expert=E,
routing=...)``)."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Routing", "add_all_to_all"]


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

    >>> Routing(rows=8, width=4).bytes
    512
    """

    rows: int
    width: int
    dtype: torch.dtype = torch.float32
    layers: int = 1

    def __post_init__(self) -> None:
        if self.rows < 0 or self.width < 0 or self.layers < 1:
            raise ValueError(f"plan: routing {self}: rows, width >= 0 and layers >= 1 expected")

    @property
    def bytes(self) -> int:
        """Bytes this rank sends by all-to-all per step when routing is balanced (each rank
        then receives as many rows as it sends): every row out and back, forward and backward."""
        return 4 * self.rows * self.width * self.dtype.itemsize


def add_all_to_all(
    expert: int,
    routing: Routing | None,
    microbatches: int,
    comm: dict[str, int],
    calls: dict[str, int],
    by_axis: dict[str, int],
) -> None:
    """Adds the all-to-alls of ``routing`` over an expert axis of ``expert`` ranks (none on
    one rank, as ``funcshard.distributed.ops`` skips a group of one)."""
    if expert == 1 or routing is None:
        return
    comm["all_to_all"] = comm.get("all_to_all", 0) + routing.bytes
    calls["all_to_all"] = calls.get("all_to_all", 0) + 4 * routing.layers * microbatches
    by_axis["expert"] = by_axis.get("expert", 0) + routing.bytes
