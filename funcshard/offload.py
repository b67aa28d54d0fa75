"""``offload_step``: the optimizer step with some buckets' masters and state on the CPU.

An offloaded bucket's CPU master is its one source of truth; the device keeps only what
``derive_compute`` makes from it. The step moves each gradient shard to its master's device,
runs the optimizer's fused kernels per device (CPU buckets with torch's fused CPU kernel), and
derives the compute copies from the updated masters.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from funcshard import sharding as shard_lib
from funcshard.state import TrainState, derive_compute

__all__ = ["offload_step", "offload_threads"]


def _default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@contextlib.contextmanager
def offload_threads(n: int | None) -> Iterator[None]:
    """Runs the block with ``n`` intra-op CPU threads (torchrun sets OMP_NUM_THREADS=1)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_bucket_flats(state: TrainState, grads) -> tuple[torch.Tensor, ...]:
    """Accepts per-bucket flats, or ``{name: shard}`` as ``reduce_scatter_grads`` returns."""
    layout = state.layout
    if isinstance(grads, dict):
        missing = sorted(set(layout.names) - set(grads))
        if missing:
            raise KeyError(f"offload_step: no gradient for {missing}")
        flats = []
        for bucket in layout.buckets:
            flat = torch.zeros(bucket.numel, dtype=bucket.dtypes.grad, device=layout.device)
            for spec in layout.bucket_leaves(bucket):
                view = shard_lib.local_view(flat, spec, layout.shard_rank)
                if grads[spec.name].shape != view.shape:
                    raise ValueError(f"offload_step: gradient {spec.name!r} has shape "
                                     f"{tuple(grads[spec.name].shape)}, expected {tuple(view.shape)}")
                view.copy_(grads[spec.name])
            flats.append(flat)
        return tuple(flats)
    grads = tuple(grads)
    if len(grads) != len(layout.buckets):
        raise ValueError(f"offload_step: {len(grads)} gradient buckets for {len(layout.buckets)}")
    return grads


def offload_step(state: TrainState, grads, *, threads: int | None = None,
                 _consumer: str = "offload_step") -> TrainState:
    """Applies reduced gradient shards with the state's optimizer; consumes ``state``.

    Args:
      state: the current state (consumed: its buffers are updated in place).
      grads: per-bucket local gradient flats, or ``{name: reduced shard}``.
      threads: CPU threads for the offloaded part of the step; None = all cores of this process.

    Returns:
      The new state: masters and optimizer state stepped, compute copies derived from them.
    """
    layout = state.layout
    grads = _as_bucket_flats(state, grads)
    master = state.master
    moved = tuple(g.to(m.device, m.dtype, non_blocking=True) for g, m in zip(grads, master, strict=True))
    any_cpu = any(b.offload for b in layout.buckets) and layout.device.type != "cpu"
    with offload_threads(threads if threads is not None else (_default_threads() if any_cpu else None)):
        new_master, new_opt = state.optimizer.update(moved, state.opt_state, master, donate=True)
    state._consume(_consumer)
    return TrainState(
        master=new_master,
        compute=derive_compute(layout, new_master),
        opt_state=new_opt,
        step=state._step + 1,
        loss_scale=state._loss_scale,
        static=state._static,
    )
