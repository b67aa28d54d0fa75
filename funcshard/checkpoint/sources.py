"""Where a restore reads from: one small protocol, one class per kind of checkpoint.

A source holds arrays by keys (``("params", name)``, ...) and scalars; ``read_into`` copies
row ranges of dim 0 straight into the target's flat buffers (casting to their dtype), so a
rank reads exactly the rows it owns. Sources: an Orbax checkpoint read with tensorstore (or,
for the uncompressed zarr funcshard writes, as byte ranges of its chunk files; ``orbax``), a
Hugging Face safetensors checkpoint (``hf``), a DCP directory (``dcp``), full tensors in
memory (here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from funcshard.checkpoint import storage
from funcshard.checkpoint.format import (
    Keys,
)

__all__ = ["ReadRequest", "Source", "DictSource", "copy_rows", "is_dcp", "DCP_METADATA_FILE"]

DCP_METADATA_FILE = ".metadata"  # DCP's own name for its index


def is_dcp(path: str) -> bool:
    """A directory DCP wrote (it holds DCP's ``.metadata``): read by ``dcp.DCPSource``, a
    module imported only then (torch's DCP brings DTensor, most of a second)."""
    return storage.exists(os.path.join(path, DCP_METADATA_FILE))


class ReadRequest(NamedTuple):
    """Rows ``[start, stop)`` of array ``keys`` into ``out`` (shape ``(stop - start, ...)``;
    a 0-d array is one row); ``box``: only ``[lo, hi)`` along a dim >= 1, ``(dim, lo, hi)``
    (a tensor-parallel shard's block, :mod:`funcshard.checkpoint.coords`)."""

    keys: Keys
    start: int
    stop: int
    out: torch.Tensor
    box: tuple[int, int, int] | None = None


class Source(Protocol):
    """What ``restore`` reads from."""

    info: dict | None  # funcshard's record of the checkpoint; None if funcshard did not write it

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        """Every array's keys -> (shape, dtype name)."""

    def scalars(self) -> set[Keys]:
        """The keys of the scalars (step, optimizer counters)."""

    def check(self, requests: Sequence[ReadRequest]) -> None:
        """Raises what ``read_into(requests)`` would raise, as far as that is known without
        keeping the bytes (checksums verified block by block, files' sizes), and writes no
        ``out``: ``restore`` calls it before it reads into ``like``'s own buffers."""

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        """Copies each request's rows into its ``out``, cast to ``out``'s dtype."""

    def read_scalar(self, keys: Keys) -> Any: ...


def copy_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    out.copy_(rows.reshape(out.shape))


# --- in memory -----------------------------------------------------------------------------


class DictSource:
    """Full tensors in memory, keyed like the checkpoint tree (e.g. a seed from one rank)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.label = "params"
        self.tensors = {("params", n): t.detach() for n, t in params.items()}
        self.info = None

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        return {
            k: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for k, t in self.tensors.items()
        }

    def scalars(self) -> set[Keys]:
        return set()

    def check(self, requests: Sequence[ReadRequest]) -> None:
        pass  # in memory: nothing can fail to be read

    def read_into(self, requests: Sequence[ReadRequest]) -> None:
        for keys, start, stop, out, box in requests:
            t = self.tensors[keys]
            rows = t[start:stop] if t.dim() else t.reshape(1)
            if box is not None:
                rows = rows.narrow(box[0], box[1], box[2] - box[1])
            copy_rows(out, rows)

    def read_scalar(self, keys: Keys) -> Any:
        raise KeyError(keys)
