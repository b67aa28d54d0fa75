"""torch's DTensor API, imported at its first use.

``import torch.distributed.tensor`` takes most of a second (sympy through its collective
utilities, then DTensor's op table), more than the rest of funcshard's import, and every
process pays it: each rank a launch starts, each restart. A data-parallel program never makes
a DTensor, so funcshard reaches torch's names through this module (``dt.DTensor``,
``dt.Shard(0)``), which imports them the first time one is asked for, and asks
:func:`is_dtensor` where any tensor may come: no DTensor can exist before torch's module is
imported, so the answer needs no import.

    >>> import torch
    >>> is_dtensor(torch.zeros(2))
    False
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["is_dtensor"]

_TENSOR = "torch.distributed.tensor"
_PARALLEL = "torch.distributed.tensor.parallel"
_HOME = {
    "DTensor": _TENSOR,
    "Replicate": _TENSOR,
    "Shard": _TENSOR,
    "distribute_module": _TENSOR,
    "distribute_tensor": _TENSOR,
    "ColwiseParallel": _PARALLEL,
    "ParallelStyle": _PARALLEL,
    "PrepareModuleInput": _PARALLEL,
    "PrepareModuleInputOutput": _PARALLEL,
    "PrepareModuleOutput": _PARALLEL,
    "RowwiseParallel": _PARALLEL,
    "SequenceParallel": _PARALLEL,
}


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a DTensor, without importing DTensor where none can exist yet."""
    module = sys.modules.get(_TENSOR)
    return module is not None and isinstance(x, getattr(module, "DTensor", ()))


def __getattr__(name: str) -> Any:
    """torch's ``name`` (a DTensor class, placement, function or parallel style), imported now
    and kept as this module's attribute."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
