"""Saved-tensor hooks (ZeRO-3): gathered params saved for backward travel as tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from funcshard.distributed import dtensor as dt

__all__ = ["Holder", "SavedParams"]


class Holder(Protocol):
    """What holds a bucket's re-gathered buffer in backward (a unit of the run)."""

    def backward_full(self, bucket: int) -> torch.Tensor:
        """The bucket's full buffer, re-gathered if not held."""
        ...

    def maybe_release(self, bucket: int) -> None:
        """Drops the buffer once backward and the tokens are done with it."""
        ...


@dataclasses.dataclass(frozen=True)
class _Token:
    """A gathered param saved for backward, as a recipe to re-gather it."""

    bucket: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True)
class _DTensorToken:
    """A tensor-parallel param saved for backward: its local tensor's token and its spec."""

    local: _Token
    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]


class SavedParams:
    """Saved-tensor hooks (ZeRO-3): a gathered param that autograd saves for backward is
    stored as a token, and backward unpacks it from its unit's re-gathered buffer, so full
    params are not kept alive between forward and backward and no unit is recomputed."""

    def __init__(self, holder_of: Callable[[int], Holder]) -> None:
        self.holder_of = holder_of  # bucket -> what re-gathers and releases it
        self._storages: dict[int, tuple[int, weakref.ref]] = {}  # data_ptr -> (bucket, buffer)
        self.refs: dict[int, int] = {}  # tokens of a bucket not unpacked yet

    def register(self, bucket: int, full: torch.Tensor) -> None:
        self._storages[full.untyped_storage().data_ptr()] = (bucket, weakref.ref(full))

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        if dt.is_dtensor(t):  # a tensor-parallel param: its local tensor travels
            with torch.no_grad():
                local = self.pack(t.to_local())
            if not isinstance(local, _Token):
                return t
            return _DTensorToken(local, t.device_mesh, t.placements, t.shape, t.stride())
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self._storages.get(ptr)
        if entry is None or entry[1]() is None:
            return t
        bucket = entry[0]
        self.refs[bucket] = self.refs.get(bucket, 0) + 1
        return _Token(bucket, t.size(), t.stride(), t.storage_offset())

    def unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, _DTensorToken):
            local = self.unpack(x.local)
            with torch.no_grad():
                return dt.DTensor.from_local(
                    local, x.mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride
                )
        if not isinstance(x, _Token):
            return x
        holder = self.holder_of(x.bucket)
        full = holder.backward_full(x.bucket)
        self.refs[x.bucket] -= 1
        holder.maybe_release(x.bucket)
        return full.as_strided(x.size, x.stride, x.offset)
