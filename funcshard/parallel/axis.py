"""The model-parallel axis protocol: what the data-parallel layers ask of an axis that splits
the model itself (tensor parallel now; experts next).

The layers below the step (the layout, the reductions, the checkpoint's coordinates, the
planner, Muon) never test which axis a model has: a layout holds one :class:`ModelAxis`, and a
plain model's is :data:`NO_AXIS`, which splits nothing. So a new axis is a module of this
package implementing the protocol, the mesh's dimension for it, and its tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["GlobalShape", "ModelAxis", "BatchCheck", "NoAxis", "NO_AXIS", "NO_CHECK"]


class GlobalShape(tuple):
    """A tensor-parallel parameter's global shape, what the optimizer's rules are asked with,
    carrying ``local``: the shard this rank holds. It is the plain tuple to every rule (masks
    and labels compare and hash it as one); the 8-bit block rule reads ``local`` so that a
    block never crosses a row of what a rank steps (:func:`funcshard.optim.moments.block_of`).

    >>> s = GlobalShape((64, 192), (64, 96))
    >>> s == (64, 192), s.local
    (True, (64, 96))
    """

    local: tuple[int, ...]

    def __new__(cls, shape: Iterable[int], local: Iterable[int]) -> GlobalShape:
        self = super().__new__(cls, shape)
        self.local = tuple(local)
        return self

    def __reduce__(self):
        return GlobalShape, (tuple(self), self.local)


@runtime_checkable
class BatchCheck(Protocol):
    """Whether the ranks of an axis group stepped on the batch their axis asks for."""

    def flag(self, losses: Sequence[torch.Tensor]) -> float | None:
        """1.0 where this rank's group did not (0.0 where it did; None: nothing to check),
        summed over the world with the loss so that every rank learns it."""
        ...

    def raise_if(self, apart: float) -> None:
        """Raises ValueError on every rank when any group did not (``apart > 0``)."""
        ...


@runtime_checkable
class ModelAxis(Protocol):
    """A model-parallel axis as the data-parallel layers see it.

    Its leaves (``leaves``: name -> the leaf's global shape and split ``dim``) are the
    parameters it splits; every other parameter is replicated over it. ``size``, ``rank`` and
    ``group`` are the axis's 1-D mesh; size 1 splits nothing.
    """

    leaves: Mapping[str, Any]

    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def group(self) -> Any: ...

    def sharded(self, name: str) -> bool:
        """Whether ``name``'s elements are split over the axis's ranks."""
        ...

    def on_experts(self, name: str) -> bool:
        """Whether ``name`` is an expert weight: its rows data-parallel over the ranks of its
        expert index only (:meth:`funcshard.layout.layout.Layout.over`)."""
        ...

    def expert_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every expert rank's 1-D ``rows`` stacked in expert rank order, ``(E, n)``."""
        ...

    def splits(self, name: str) -> bool:
        """Whether this rank holds only part of ``name`` (sharded over more than one rank):
        a whole-matrix transform (Muon) must gather it."""
        ...

    def counts(self, name: str) -> bool:
        """Whether this rank counts ``name``'s local elements in a sum over the full model."""
        ...

    def span(self, name: str) -> tuple[int, int, int]:
        """``(dim, start, stop)`` of this rank's part of split ``name`` in the global tensor."""
        ...

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]: ...

    def agreed_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The shape every rank of the axis picks offloaded leaves by (the same on each)."""
        ...

    def rule_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The shape an optimizer's rule, mask or label is asked with: the global one."""
        ...

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the parallelized model expects it in its forward."""
        ...

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The global tensor of ``name`` from this rank's part (a collective over the axis)."""
        ...

    def gather_whole(self, name: str, local: torch.Tensor, *, kind: str) -> torch.Tensor: ...

    def part_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``name``'s global tensor ``full``."""
        ...

    def counted_parts(self, flats: Sequence[torch.Tensor], specs: Sequence) -> list[torch.Tensor]:
        """The parts of ``flats`` (one per bucket, its leaves ``specs[i]``: offset and shard
        numel) whose elements this rank counts in a sum over the full model."""
        ...

    def sum_square(self, square: torch.Tensor) -> torch.Tensor:
        """The full model's squared norm from this rank's part (summed over the axis)."""
        ...

    def squares_in_order(self, square: torch.Tensor) -> torch.Tensor:
        """Every rank's part of a squared norm, in the axis's rank order (deterministic sum)."""
        ...

    def replica_groups(self, labels: list[str]) -> list[tuple[str, Any, list[str]]]:
        """``(axis, group, labels)`` of the leaves this axis replicates over its ranks."""
        ...

    def batch_check(self, batch: Any, device: torch.device) -> BatchCheck: ...

    @property
    def capture_refusal(self) -> str | None:
        """Why the captured step cannot trace this axis's parameters; None when it can."""


class _NoCheck:
    def flag(self, losses: Sequence[torch.Tensor]) -> float | None:
        return None

    def raise_if(self, apart: float) -> None:
        return None


NO_CHECK = _NoCheck()


class NoAxis:
    """The axis of a model no axis splits: one rank, every parameter whole."""

    leaves: Mapping[str, Any] = {}
    size = 1
    rank = 0
    group = None

    def sharded(self, name: str) -> bool:
        return False

    def on_experts(self, name: str) -> bool:
        return False

    def expert_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(1, -1)

    def splits(self, name: str) -> bool:
        return False

    def counts(self, name: str) -> bool:
        return True

    def span(self, name: str) -> tuple[int, int, int]:
        raise KeyError(f"{name!r} is split over no model-parallel axis")

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return local

    agreed_shape = rule_shape = full_shape

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return local

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return local

    def gather_whole(self, name: str, local: torch.Tensor, *, kind: str) -> torch.Tensor:
        return local

    def part_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full

    def counted_parts(self, flats: Sequence[torch.Tensor], specs: Sequence) -> list[torch.Tensor]:
        return list(flats)

    def sum_square(self, square: torch.Tensor) -> torch.Tensor:
        return square

    def squares_in_order(self, square: torch.Tensor) -> torch.Tensor:
        return square.reshape(1)

    def replica_groups(self, labels: list[str]) -> list[tuple[str, Any, list[str]]]:
        return []

    def batch_check(self, batch: Any, device: torch.device) -> BatchCheck:
        return NO_CHECK

    capture_refusal = None

    def __repr__(self) -> str:
        return "NO_AXIS"


NO_AXIS = NoAxis()
