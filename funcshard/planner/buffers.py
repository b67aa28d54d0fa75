"""What ``fs.init(buffers="broadcast")`` moves, for ``fs.plan``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from funcshard.state import buffers as buffer_lib

__all__ = ["buffer_broadcast"]


def buffer_broadcast(
    model: nn.Module | None, buffers: str, dp_size: int, comm, calls, by_axis
) -> None:
    """``fs.init(buffers="broadcast")``'s one broadcast of the model's persistent buffers'
    bytes over the data-parallel world after each applied step (none: no such buffer, one
    data-parallel rank, or ``buffers="local"``). The buffers :meth:`ModelBuffers.of` carries,
    a meta-device model's counted by their shapes and dtypes."""
    buffer_lib.mode(buffers)
    if model is None or buffers != "broadcast" or dp_size == 1:
        return
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    nbytes = sum(
        t.numel() * t.element_size()
        for n, t in model.state_dict(keep_vars=True).items()
        if n not in params and isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
    )
    if nbytes:
        comm["buffers"] += nbytes
        calls["buffers"] += 1
        by_axis["world"] += nbytes
