"""What ``fs.init(buffers="broadcast")`` moves, for ``fs.plan``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from funcshard.distributed import dtensor as dt
from funcshard.state import buffers as buffer_lib

__all__ = ["buffer_broadcast"]


def buffer_broadcast(
    model: nn.Module | None, buffers: str, dp_size: int, comm, calls, by_axis, pp: Any = None
) -> None:
    """``fs.init(buffers="broadcast")``'s one broadcast of the model's persistent buffers'
    bytes over the data-parallel world after each applied step (none: no such buffer, one
    data-parallel rank, or ``buffers="local"``). The buffers :meth:`ModelBuffers.of` carries,
    a meta-device model's counted by their shapes and dtypes; under a pipeline (``pp``, the
    plan's ``Setup``) once per stage of the rank holding one (each stage's own copy)."""
    buffer_lib.mode(buffers)
    if model is None or buffers != "broadcast" or dp_size == 1:
        return
    held = [_carried(pp.stages[i]) for i in pp.mine] if pp is not None else []
    nbytes = sum(
        t.numel() * t.element_size() * max(1, sum(n in h for h in held))
        for n, t in _carried(model).items()
    )
    if nbytes:
        comm["buffers"] += nbytes
        calls["buffers"] += 1
        by_axis["world"] += nbytes


def _carried(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent plain-tensor buffers of ``model`` by name."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {
        n: t
        for n, t in model.state_dict(keep_vars=True).items()
        if n not in params and isinstance(t, torch.Tensor) and not dt.is_dtensor(t)
    }
