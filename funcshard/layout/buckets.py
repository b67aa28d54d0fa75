"""``PerBucket``: one value per bucket of a state, with the parameters each bucket packs.

A state keeps many parameters in one flat buffer per bucket. Optimizer rules are per parameter
(a decay mask, a label of ``multi_transform``), so the flat buffers travel through the
optimizer as a ``PerBucket``: a tuple whose static metadata (never a leaf) says, per entry,
which parameters it packs (:class:`Members`). The optimizer state built from it by
``tree.map`` is again ``PerBucket`` with the same metadata, which is how checkpoints and the
offloaded step recognise the per-bucket parts of any optimizer state. An entry may be None:
a bucket that an inner optimizer of ``multi_transform`` does not own.

:func:`map_parts` and :func:`flatten_parts` are THE walk over an optimizer state down to its
per-bucket parts (offload, checkpoints, ``fs.plan`` and ``TrainState.opt_state_by_name`` all
use them): NamedTuples by field name, tuples and lists by index, dicts by key; anything else
(None, a step count, a stray tensor) is a leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree

from funcshard.parallel.axis import GlobalShape

__all__ = [
    "NAMESPACE",
    "Members",
    "PerBucket",
    "BlockScales",
    "Ragged",
    "Block",
    "scale_index",
    "granule",
    "Path",
    "is_per_bucket",
    "map_parts",
    "flatten_parts",
    "per_bucket_parts",
]

NAMESPACE = "funcshard"


@dataclasses.dataclass(frozen=True, slots=True)
class Members:
    """The parameters packed in one flat buffer: names and shapes, in buffer order.

    ``shapes`` are what the buffer holds of each (a tensor-parallel parameter's local shard);
    ``global_shapes`` the model's shapes where they differ (None: the same), which the
    optimizer's rules (masks, labels, partitions) are asked with."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    global_shapes: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise ValueError(f"Members: {len(self.names)} names for {len(self.shapes)} shapes")

    def pairs(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(name, shape)`` of every parameter, in the model's (global) shapes (each a
        :class:`GlobalShape` carrying the local one, under tensor parallelism)."""
        if self.global_shapes is None:
            return tuple(zip(self.names, self.shapes, strict=True))
        shapes = (GlobalShape(g, s) for g, s in zip(self.global_shapes, self.shapes, strict=True))
        return tuple(zip(self.names, shapes, strict=True))


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
        return self.with_entries((self[i] for i in index), (self.members[i] for i in index))

    def with_entries(
        self, values: Iterable[Any], members: Iterable[Members] | None = None
    ) -> PerBucket:
        """A part of the same kind (and metadata) with other entries."""
        return type(self)(values, self.members if members is None else members)

    def element_range(self, start: int, stop: int) -> PerBucket:
        """Elements ``[start, stop)`` of each entry's flat buffer (views; None stays None)."""
        return self.with_entries(None if x is None else x[start:stop] for x in self)

    def element_numel(self, i: int) -> int:
        """Elements of the parameters' flat buffer that entry ``i`` covers."""
        return self[i].numel()

    def __reduce__(self):
        return PerBucket, (tuple(self), self.members)

    def __repr__(self) -> str:
        return f"PerBucket({tuple.__repr__(self)})"


@dataclasses.dataclass(frozen=True, slots=True)
class Ragged:
    """The 8-bit blocks of rows of ``row`` > ``size`` elements that ``size`` does not divide:
    each row cut into blocks of ``size``, the last one shorter (a block never crosses a row).
    A row of at most ``size`` elements is one block: a plain ``int`` block.

    >>> b = Ragged(256, 769)  # 256 + 256 + 256 + 1
    >>> b.per_row, scale_index(b, 769), scale_index(b, 769 + 512), scale_index(b, 2 * 769)
    (4, 4, 6, 8)
    """

    size: int
    row: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.row <= self.size or self.row % self.size == 0:
            raise ValueError(f"Ragged: rows of {self.row} in blocks of {self.size} are not ragged")

    @property
    def per_row(self) -> int:
        return -(-self.row // self.size)


# Elements per scale of an 8-bit moment: an int divides every row of its parameters (a buffer
# is blocks of that size back to back); a Ragged cuts rows of its length.
Block = int | Ragged


def scale_index(block: Block, element: int) -> int:
    """The first scale at or after element ``element`` of a buffer of whole rows (at a block
    boundary: the index of the block that starts there)."""
    if isinstance(block, Ragged):
        rows, rest = divmod(element, block.row)
        return rows * block.per_row + -(-rest // block.size)
    return -(-element // block)


def granule(block: Block | None) -> int:
    """What a chunk of a buffer cut by ``block`` is a multiple of, in elements: a block, or a
    row when ragged; 1 without blocks."""
    if block is None:
        return 1
    return block.row if isinstance(block, Ragged) else block


def _at_boundary(block: Block, element: int) -> bool:
    if isinstance(block, Ragged):
        return element % block.row % block.size == 0
    return element % block == 0


def _elements(block: Block, scales: int) -> int:
    """Elements of a buffer of whole rows with ``scales`` scales."""
    if isinstance(block, Ragged):
        return scales // block.per_row * block.row
    return scales * block


class BlockScales(PerBucket):
    """The fp32 scales of an 8-bit blockwise moment: entry ``i`` holds one scale per block of
    bucket ``i``'s flat buffer, ``blocks[i]`` (a :data:`Block`; None where the bucket's moment
    is not 8-bit). A block never crosses a row of a parameter, so a parameter's scales are an
    array of shape ``(rows, blocks per row)``."""

    def __new__(
        cls, values: Iterable[Any], members: Iterable[Members], blocks: Iterable[int | None]
    ) -> BlockScales:
        self = super().__new__(cls, values, members)
        self.blocks = tuple(blocks)
        if len(self.blocks) != len(self):
            raise ValueError(f"BlockScales: {len(self)} entries for {len(self.blocks)} blocks")
        return self

    def with_entries(
        self, values: Iterable[Any], members: Iterable[Members] | None = None
    ) -> BlockScales:
        values = tuple(values)
        if members is None:
            return BlockScales(values, self.members, self.blocks)
        members = tuple(members)
        index = {m: i for i, m in enumerate(self.members)}
        return BlockScales(values, members, (self.blocks[index[m]] for m in members))

    def element_range(self, start: int, stop: int) -> BlockScales:
        out = []
        for x, b in zip(self, self.blocks, strict=True):
            end = None if x is None else _elements(b, x.numel())
            if x is not None and not (
                _at_boundary(b, start) and (_at_boundary(b, stop) or stop == end)
            ):
                raise ValueError(f"BlockScales: [{start}, {stop}) cuts a block of {b}")
            out.append(None if x is None else x[scale_index(b, start) : scale_index(b, stop)])
        return self.with_entries(out)

    def element_numel(self, i: int) -> int:
        return _elements(self.blocks[i], self[i].numel())

    def __reduce__(self):
        return BlockScales, (tuple(self), self.members, self.blocks)

    def __repr__(self) -> str:
        return f"BlockScales({tuple.__repr__(self)}, blocks={self.blocks})"


def is_per_bucket(x: Any) -> bool:
    return isinstance(x, PerBucket)


Path = tuple[str, ...]


def map_parts(
    tree: Any,
    on_part: Callable[[Path, PerBucket], Any],
    on_leaf: Callable[[Path, Any], Any] | None = None,
    path: Path = (),
    *,
    is_part: Callable[[Any], bool] = is_per_bucket,
) -> Any:
    """Rebuilds an optimizer state, calling ``on_part(path, part)`` on every per-bucket part
    and ``on_leaf(path, x)`` (default: keep it) on everything else that is not a container.

    ``path`` names a part by NamedTuple field, tuple/list index and dict key, as strings
    (checkpoint keys are made of them). ``is_part`` says what a part is (by default a
    :class:`PerBucket`).

    >>> import torch
    >>> pb = PerBucket([torch.zeros(3)], [Members(("w",), ((3,),))])
    >>> map_parts({"mu": pb, "count": 0}, lambda p, x: p, lambda p, x: x + 1)
    {'mu': ('mu',), 'count': 1}
    """
    if is_part(tree):
        return on_part(path, tree)

    def rec(value: Any, key: Any) -> Any:
        return map_parts(value, on_part, on_leaf, (*path, str(key)), is_part=is_part)

    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(rec(getattr(tree, f), f) for f in tree._fields))
    if isinstance(tree, (tuple, list)):
        return type(tree)(rec(v, i) for i, v in enumerate(tree))
    if isinstance(tree, dict):
        return {k: rec(v, k) for k, v in tree.items()}
    return tree if on_leaf is None else on_leaf(path, tree)


def flatten_parts(
    tree: Any, *, is_part: Callable[[Any], bool] = is_per_bucket
) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``(leaves, unflatten)``: the per-bucket parts and other leaves of ``tree`` in walk
    order, and the function that rebuilds the same tree from as many new leaves."""
    leaves: list[Any] = []
    keep = lambda p, x: leaves.append(x)
    map_parts(tree, keep, keep, is_part=is_part)

    def unflatten(values: Sequence[Any]) -> Any:
        it = iter(values)
        take = lambda p, x: next(it)
        return map_parts(tree, take, take, is_part=is_part)

    return leaves, unflatten


def per_bucket_parts(tree: Any) -> list[PerBucket]:
    """Every per-bucket part of ``tree``, in walk order."""
    return [x for x in flatten_parts(tree)[0] if isinstance(x, PerBucket)]


optree.register_pytree_node(
    PerBucket,
    lambda pb: (tuple(pb), pb.members, pb.members),
    lambda members, children: PerBucket(children, members),
    namespace=NAMESPACE,
)
optree.register_pytree_node(
    BlockScales,
    lambda pb: (tuple(pb), (pb.members, pb.blocks), pb.members),
    lambda meta, children: BlockScales(children, *meta),
    namespace=NAMESPACE,
)
