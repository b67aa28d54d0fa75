"""A read of a collective's output kept after its wait in inductor's CPU kernels.

Inductor lowers ``_c10d_functional.wait_tensor`` as a kernel that *mutates* the collective's
output buffer; a kernel that reads that buffer (a view of a gathered param) depends on the
wait through the scheduler's mutation renames (it reads the buffer under the wait's name).
torch 2.13's ``SchedulerNode.recompute_size_and_body``, which the CPU backend calls to align
two nodes' loop ranges before fusing them, re-extracts a node's reads from its loop body
(the buffer's own name) and applies the node's renames only when it also holds a fake
(Star/Weak) dependency. A node without one forgets the wait: read in the captured ZeRO-3
step's backward, where the re-gathered root bucket's 0-d ``scale`` fed a fused kernel that
inductor emitted before the all-gather's ``wait_tensor``, reading the buffer while gloo
still filled it (step-2 loss 1e33 on the test MLP). The same bug gave wrong gradients in
pytorch/pytorch#185509 (max_pool2d backward); upstream's fix, #185873, applies the renames
whenever the node has any, which is what :func:`mutation_renames_kept` does for the
duration of a captured call (its forward compile, and the backward's, which AOTAutograd
compiles lazily at the first backward).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["mutation_renames_kept"]


def _kept(recompute: Callable[..., None]) -> Callable[..., None]:
    """``recompute`` (``SchedulerNode.recompute_size_and_body``) followed by the node's
    mutation renames (idempotent: a renamed read names the newest writer already)."""

    @functools.wraps(recompute)
    def recompute_size_and_body(self: Any, *args: Any, **kwargs: Any) -> None:
        recompute(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None)
        if renames:
            self.set_read_writes(self.read_writes.rename(renames))

    recompute_size_and_body.funcshard_kept = True  # type: ignore[attr-defined]
    return recompute_size_and_body


@contextlib.contextmanager
def mutation_renames_kept() -> Iterator[None]:
    """Inductor's scheduler, while open, keeps a node's mutation renames when the CPU backend
    recomputes its loop body (the module docstring). Nothing where torch's scheduler has no
    such method (another version: the caller's compile runs as torch has it)."""
    try:
        from torch._inductor.scheduler import SchedulerNode
    except ImportError:  # pragma: no cover - torch without inductor
        yield
        return
    recompute = getattr(SchedulerNode, "recompute_size_and_body", None)
    if recompute is None or getattr(recompute, "funcshard_kept", False):
        yield  # absent, or kept already by an enclosing call
        return
    SchedulerNode.recompute_size_and_body = _kept(recompute)
    try:
        yield
    finally:
        SchedulerNode.recompute_size_and_body = recompute
