"""The CPU side of an offloaded step: one flat master stepped with the optimizer's fused CPU
kernel in cache-sized blocks, each followed by its cast to the compute dtype while the updated
master is still in cache, on a chosen number of threads. Bitwise the step of one unblocked
call (the update is elementwise).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from funcshard.layout.buckets import Members, PerBucket
from funcshard.layout.layout import Placement
from funcshard.layout.parts import StateParts, is_one_bucket_part
from funcshard.optim import Optimizer

__all__ = ["BLOCK_NUMEL", "THREADS_ENV", "default_threads", "offload_threads", "step_and_cast"]

THREADS_ENV = "FUNCSHARD_OFFLOAD_THREADS"
# Elements per block of the blocked step: p, g, m, v of one block (16 MiB in fp32) stay in the
# last-level cache when the cast re-reads p, and the per-block cost (a Python update call, two
# parallel regions) stays a few percent of the block's step. experiments/bench_offload.py:
# 1Mi beat 64Ki, 256Ki and 4Mi. A multiple of 64 keeps the fused kernels' vector tails where
# the unblocked step has them.
BLOCK_NUMEL = 1 << 20


def default_threads() -> int:
    """CPU threads for the offloaded step of one rank.

    ``$FUNCSHARD_OFFLOAD_THREADS`` if set; else the cores this process may run on divided by
    the local ranks sharing them (``$LOCAL_WORLD_SIZE``, set by torchrun, which also sets
    OMP_NUM_THREADS=1 and so would leave the CPU step on one core).
    """
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, (cores or 1) // max(1, local_ranks))


@contextlib.contextmanager
def offload_threads(n: int | None) -> Iterator[None]:
    """Runs the block with ``n`` intra-op CPU threads; None leaves the setting alone."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_and_cast(
    optimizer: Optimizer,
    opt_state: Any,
    master: torch.Tensor,
    grad: torch.Tensor,
    compute_out: torch.Tensor | None = None,
    *,
    block: int = BLOCK_NUMEL,
    members: Members | None = None,
    grad_norm: float | None = None,
    placement: Placement | None = None,
) -> Any:
    """Steps one flat master in place; optionally writes its cast into ``compute_out``.

    With ``compute_out`` the step runs in blocks of ``block`` elements, each followed by the
    cast of that block while the updated master is still in cache: one pass over memory
    instead of a fused step plus a separate cast pass. The update is elementwise, so the result
    is bitwise that of one unblocked call.

    Args:
      optimizer: a pure optimizer whose state per bucket is elementwise (same numel as master).
      opt_state: its state over the one-tuple ``(master,)`` (donated, updated in place).
      master: the flat master buffer (donated, updated in place).
      grad: the flat gradient, any floating dtype (cast to the master dtype per block).
      compute_out: a flat buffer of the master's numel for the compute dtype copy, or None.
      block: elements per block (a multiple of 64; rounded down to whole 8-bit blocks of the
        state, or whole rows of ragged ones, where it cuts them).
      members: the parameters the master packs (their rules: masks, labels); None for a
        plain one-tuple state.
      grad_norm: the global gradient norm, for a clip in the optimizer.
      placement: the state's row placement, for an optimizer that is not elementwise (Muon
        assembles whole matrices); such an optimizer steps the buffer in one call, unblocked.

    Returns:
      The new optimizer state.
    """
    one = (lambda t: (t,)) if members is None else (lambda t: PerBucket((t,), (members,)))
    if compute_out is None or not optimizer.elementwise:
        _, new_state = optimizer.update(
            one(grad), opt_state, one(master), donate=True, grad_norm=grad_norm, placement=placement
        )
        if compute_out is not None:
            compute_out.copy_(master)
        return new_state
    numel = master.numel()
    parts = StateParts.of(opt_state, is_part=is_one_bucket_part, where=None)
    if grad.numel() != numel or compute_out.numel() != numel or not parts.covers(numel):
        raise ValueError(
            f"step_and_cast: master numel {numel}, grad {grad.numel()}, "
            f"compute_out {compute_out.numel()}: expected equal sizes"
        )
    new_state = opt_state
    for start, stop, chunk in parts.blocks(numel, block):
        _, new_state = optimizer.update(
            one(grad[start:stop]),
            chunk,
            one(master[start:stop]),
            donate=True,
            grad_norm=grad_norm,
            placement=placement,
        )
        compute_out[start:stop].copy_(master[start:stop])
    # The blocks updated the state's buffers in place; keep them, take the scalars (count).
    return parts.keep_buffers(new_state)
