"""``StateParts``: an optimizer state cut along its per-bucket parts, the one combinator of the
offloaded step.

The offloaded step updates some buckets' state on the device and the others' on the CPU, each
CPU bucket in cache-sized blocks of elements. Both are slices of one state: by buckets
(:meth:`StateParts.select`, put back together by :meth:`StateParts.merge`) and, within a
one-bucket state, by elements (:meth:`StateParts.blocks`, views the update writes in place, so
:meth:`StateParts.keep_buffers` takes only the new scalars, a step count, from its result).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from funcshard.layout.buckets import (
    BlockScales,
    flatten_parts,
    granule,
    is_per_bucket,
)

__all__ = ["StateParts", "is_one_bucket_part"]


def is_one_bucket_part(x: Any) -> bool:
    """A per-bucket part of a one-bucket state: a PerBucket, or a plain one-tuple of a tensor."""
    return is_per_bucket(x) or (type(x) is tuple and len(x) == 1 and isinstance(x[0], torch.Tensor))


@dataclasses.dataclass(frozen=True, slots=True)
class StateParts:
    """An optimizer state flattened down to its per-bucket parts and its other leaves.

    >>> from funcshard.layout.buckets import Members, PerBucket
    >>> m = [Members(("a",), ((2,),)), Members(("b",), ((3,),))]
    >>> parts = StateParts.of({"mu": PerBucket([torch.zeros(2), torch.ones(3)], m), "count": 1})
    >>> one = parts.select([1])
    >>> [x.tolist() for x in one["mu"]], one["count"]
    ([[1.0, 1.0, 1.0]], 1)
    >>> [x.tolist() for x in parts.merge([([1], one), ([0], parts.select([0]))])["mu"]]
    [[0.0, 0.0], [1.0, 1.0, 1.0]]
    """

    leaves: tuple[Any, ...]
    unflatten: Callable[[Sequence[Any]], Any]
    is_part: tuple[bool, ...]

    @classmethod
    def of(
        cls,
        opt_state: Any,
        *,
        is_part: Callable[[Any], bool] = is_per_bucket,
        where: str | None = "offload_step",
    ) -> StateParts:
        """Cuts ``opt_state``; with ``where`` set, a tensor outside every part is refused (it
        could not follow a subset of the buckets), the message naming ``where``."""
        leaves, unflatten = flatten_parts(opt_state, is_part=is_part)
        flags = tuple(is_part(x) for x in leaves)
        stray = [x for x, p in zip(leaves, flags, strict=True) if not p and torch.is_tensor(x)]
        if where is not None and stray:
            raise TypeError(
                f"{where}: the optimizer state holds {len(stray)} tensors outside "
                "per-bucket parts; build it as opt.init(state.layout.per_bucket(master)), "
                "not from a plain tuple of buffers"
            )
        return cls(tuple(leaves), unflatten, flags)

    def _each(self) -> Iterator[tuple[Any, bool]]:
        return zip(self.leaves, self.is_part, strict=True)

    def select(self, index: Sequence[int]) -> Any:
        """The state of buckets ``index`` only (the same tree, shorter per-bucket parts)."""
        return self.unflatten([x.select(index) if p else x for x, p in self._each()])

    def merge(self, parts: Sequence[tuple[Sequence[int], Any]]) -> Any:
        """The whole state again from the new states of disjoint bucket subsets ``(index,
        state)`` that cover every bucket; a leaf outside the parts (a step count) must agree."""
        flat = [(index, flatten_parts(sub)[0]) for index, sub in parts]
        out = []
        for j, (x, p) in enumerate(self._each()):
            if p:
                slots: list[Any] = list(x)
                covered = [False] * len(x)
                for index, sub in flat:
                    for k, i in enumerate(index):
                        slots[i], covered[i] = sub[j][k], True
                assert all(covered), "bucket subsets must cover every bucket"
                out.append(x.with_entries(slots))
                continue
            values = [sub[j] for _, sub in flat]
            if any(v != values[0] for v in values[1:]):
                raise RuntimeError(
                    f"offload_step: optimizer state leaf {j} differs between "
                    f"device and CPU buckets after the step: {values}"
                )
            out.append(values[0] if values else x)
        return self.unflatten(out)

    def covers(self, numel: int) -> bool:
        """Whether every part of this one-bucket state covers ``numel`` elements."""
        return all(_numel_of(x) == numel for x, p in self._each() if p and x[0] is not None)

    def blocks(self, numel: int, block: int) -> Iterator[tuple[int, int, Any]]:
        """``(start, stop, state)`` over a one-bucket state of ``numel`` elements in blocks of
        about ``block`` (a multiple of 64, rounded down to whole 8-bit blocks of the state, or
        whole rows of ragged ones): each state holds views of elements ``[start, stop)``."""
        if block % 64:
            raise ValueError(f"blocks: block must be a multiple of 64, got {block}")
        unit = math.lcm(
            64, *[granule(b) for x in self.leaves if isinstance(x, BlockScales) for b in x.blocks]
        )
        block = max(1, block // unit) * unit
        for start in range(0, max(numel, 1), block):
            stop = min(start + block, numel)
            yield (
                start,
                stop,
                self.unflatten([_range(x, start, stop) if p else x for x, p in self._each()]),
            )

    def keep_buffers(self, new_state: Any) -> Any:
        """The one-bucket state whose parts are this one's buffers (updated in place through
        :meth:`blocks`) and whose other leaves (a step count) are ``new_state``'s."""
        new = flatten_parts(new_state, is_part=is_one_bucket_part)[0]
        return self.unflatten([x if p else y for (x, p), y in zip(self._each(), new, strict=True)])


def _numel_of(x: tuple) -> int:
    """Elements of the master that a one-bucket part covers (8-bit scales: one per block)."""
    return x.element_numel(0) if is_per_bucket(x) else x[0].numel()


def _range(x: tuple, start: int, stop: int) -> tuple:
    if is_per_bucket(x):
        return x.element_range(start, stop)
    return (None if x[0] is None else x[0][start:stop],)
