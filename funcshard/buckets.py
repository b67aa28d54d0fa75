"""``PerBucket``: one value per bucket of a state, with the parameters each bucket packs.

A state keeps many parameters in one flat buffer per bucket. Optimizer rules are per parameter
(a decay mask, a label of ``multi_transform``), so the flat buffers travel through the
optimizer as a ``PerBucket``: a tuple whose static metadata (never a leaf) says, per entry,
which parameters it packs (:class:`Members`). The optimizer state built from it by
``tree.map`` is again ``PerBucket`` with the same metadata, which is how checkpoints and the
offloaded step recognise the per-bucket parts of any optimizer state. An entry may be None:
a bucket that an inner optimizer of ``multi_transform`` does not own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import optree

__all__ = ["NAMESPACE", "Members", "PerBucket", "is_per_bucket"]

NAMESPACE = "funcshard"


@dataclasses.dataclass(frozen=True, slots=True)
class Members:
    """The parameters packed in one flat buffer: names and full shapes, in buffer order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ValueError(f"Members: {len(self.names)} names for {len(self.shapes)} shapes")

    def pairs(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple(zip(self.names, self.shapes, strict=True))


class PerBucket(tuple):
    """A tuple with one entry per bucket and each bucket's :class:`Members` off the leaves.

    >>> import torch
    >>> pb = PerBucket([torch.zeros(3)], [Members(("w",), ((3,),))])
    >>> [m.names for m in pb.members], len(optree.tree_leaves(pb, namespace=NAMESPACE))
    ([('w',)], 1)
    """

    def __new__(cls, values: Iterable[Any], members: Iterable[Members]) -> PerBucket:
        self = super().__new__(cls, values)
        members = tuple(members)
        if len(members) != len(self):
            raise ValueError(f"PerBucket: {len(self)} entries for {len(members)} members")
        self.members = members
        return self

    def select(self, index: Sequence[int]) -> PerBucket:
        """The entries ``index`` only, with their members."""
        return PerBucket((self[i] for i in index), (self.members[i] for i in index))

    def __reduce__(self):
        return PerBucket, (tuple(self), self.members)

    def __repr__(self) -> str:
        return f"PerBucket({tuple.__repr__(self)})"


def is_per_bucket(x: Any) -> bool:
    return isinstance(x, PerBucket)


optree.register_pytree_node(
    PerBucket,
    lambda pb: (tuple(pb), pb.members, pb.members),
    lambda members, children: PerBucket(children, members),
    namespace=NAMESPACE,
)
