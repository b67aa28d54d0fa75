"""Staging: this rank's rows copied to host memory before a background write, into buffers
kept between saves.

An asynchronous save must not see the in-place updates the next steps make to the state's
buffers, so ``save`` copies the rows it writes to host memory and returns; the write reads the
copies. What the loop waits for is that copy. Buffers allocated afresh every save would cost
their page faults on every save (and, for CUDA tensors, a pinned allocation, which is slow and
synchronizing); so a ``Staging`` keeps one host buffer per array it has staged, reused while
the array keeps its shape and dtype: page-locked (pinned) when the source is on an
accelerator, so that the copies run asynchronously and ``ready`` waits for them once.

The buffers hold one host copy of this rank's rows between saves; ``release`` drops them
(``Saver.close``). A buffer is written again only by the next save, which waits for the write
in flight first (one save at a time per ``Saver``).
"""

from __future__ import annotations

import numpy as np
import torch

from funcshard.checkpoint.format import Keys

__all__ = ["Staging"]


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` of contiguous host tensors as one memcpy on this thread. torch's
    copy splits a large one over its intra-op threads, which, with a rank per core, contend
    with the other ranks' and make the stall erratic (docs/benchmarks.md, "Checkpoints at
    scale")."""
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


class Staging:
    """Host buffers keyed by array, reused across saves (see the module's docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[Keys, torch.Tensor] = {}
        self._devices: set[torch.device] = set()

    def copy(self, keys: Keys, rows: torch.Tensor) -> torch.Tensor:
        """A host copy of ``rows`` in the buffer of ``keys`` (valid once ``ready`` returned)."""
        pinned = rows.device.type != "cpu"
        buf = self._buffers.get(keys)
        if (
            buf is None
            or buf.shape != rows.shape
            or buf.dtype != rows.dtype
            or (buf.is_pinned() != pinned)
        ):
            buf = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pinned)
            self._buffers[keys] = buf
        if pinned:
            self._devices.add(rows.device)
            buf.copy_(rows, non_blocking=True)
        elif rows.is_contiguous():  # one thread: see _host_copy
            _host_copy(buf, rows)
        else:
            buf.copy_(rows)
        return buf

    def ready(self) -> None:
        """Waits for the asynchronous copies from accelerators (the current streams')."""
        for device in self._devices:
            torch.get_device_module(device.type).current_stream(device).synchronize()
        self._devices.clear()

    def retain(self, keys: set[Keys]) -> None:
        """Drops the buffers of arrays the last save did not stage (a layout changed)."""
        for k in [k for k in self._buffers if k not in keys]:
            del self._buffers[k]

    def nbytes(self) -> int:
        """The bytes of host memory held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        """Drops every buffer."""
        self._buffers.clear()
        self._devices.clear()
