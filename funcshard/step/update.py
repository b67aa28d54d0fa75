"""``offload_step``: the optimizer step with some buckets' masters and state on the CPU.

An offloaded bucket's CPU master is its one source of truth; the device keeps only the compute
copy that :func:`funcshard.state.state.derive_compute` makes from it. One step:

1. the device buckets step on the device, launched first (asynchronous on CUDA);
2. the offloaded buckets' gradient shards go device -> host in ``main_grads_dtype`` (pinned
   buffers, a side stream, all copies queued at once so bucket i+1 arrives while bucket i
   steps);
3. each offloaded bucket steps on the CPU with the optimizer's fused CPU kernel (torch's fused
   AdamW runs at the memory-bandwidth bound), in cache-sized blocks that also write the compute
   dtype copy while the updated master is still in cache;
4. that compute copy goes host -> device on another side stream, and the compute params are
   derived from it (gathered for ZeRO 0-2).

On a CPU layout, elementwise kernels on the same bytes give bitwise the same result whatever
the blocking and placement, so trajectories equal those of ``offload_fraction=0``. On CUDA the
offloaded buckets step with torch's CPU kernel and the others with its CUDA kernel, which may
round an element differently (an ulp); trajectories then agree to rounding, not bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from funcshard.layout import sharding as shard_lib
from funcshard.layout.buckets import PerBucket
from funcshard.layout.layout import Bucket
from funcshard.layout.parts import StateParts
from funcshard.state.state import Donation, TrainState, derive_compute
from funcshard.step.host import (
    BLOCK_NUMEL,
    THREADS_ENV,
    default_threads,
    offload_threads,
    step_and_cast,
)
from funcshard.step.reduction import reduction_of

__all__ = [
    "offload_step",
    "apply_update",
    "offload_threads",
    "default_threads",
    "step_and_cast",
    "BLOCK_NUMEL",
    "THREADS_ENV",
]


def _needs_cast(bucket: Bucket) -> bool:
    return bucket.dtypes.compute != bucket.dtypes.master


# --- inputs ---------------------------------------------------------------------------------
def _as_bucket_flats(state: TrainState | Donation, grads: Any) -> tuple[torch.Tensor, ...]:
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
                view = shard_lib.local_view(flat, spec, layout.over(bucket).shard_rank)
                if grads[spec.name].shape != view.shape:
                    raise ValueError(
                        f"offload_step: gradient {spec.name!r} has shape "
                        f"{tuple(grads[spec.name].shape)}, expected {tuple(view.shape)}"
                    )
                view.copy_(grads[spec.name])
            flats.append(flat)
        return tuple(flats)
    grads = tuple(grads)
    if len(grads) != len(layout.buckets):
        raise ValueError(f"offload_step: {len(grads)} gradient buckets for {len(layout.buckets)}")
    for bucket, g in zip(layout.buckets, grads, strict=True):
        if g.dim() != 1 or g.numel() != bucket.numel:
            names = [s.name for s in layout.bucket_leaves(bucket)]
            raise ValueError(
                f"offload_step: gradient of bucket {bucket.index} ({names}) has "
                f"shape {tuple(g.shape)}, expected ({bucket.numel},)"
            )
    return grads


# --- the step ------------------------------------------------------------------------------------
def offload_step(
    state: TrainState, grads: Any, *, threads: int | None = None, grad_norm: float | None = None
) -> TrainState:
    """Applies reduced gradient shards with the state's optimizer; donates ``state``.

    Like JAX's ``donate_argnums``: the masters and the optimizer state are updated in place, so
    ``state`` and every state sharing a buffer with it raise ``ConsumedStateError`` afterwards.
    The gradient buffers may be overwritten too (a clip scales them inside the fused kernel).

    Args:
      state: the current state (donated).
      grads: per-bucket local gradient flats (as ``train_step`` accumulates them, in
        ``main_grads_dtype``), or ``{name: reduced shard}``.
      threads: CPU threads for the offloaded part of the step; None = :func:`default_threads`
        when the device is an accelerator, the current setting when the device is the CPU
        (its ranks already share the cores).
      grad_norm: the global L2 norm of ``grads`` (every shard and replica), for a clip in the
        optimizer; None computes it here (a collective).

    Returns:
      The new state: masters and optimizer state stepped, compute copies derived from them.

    Raises:
      ValueError / KeyError: a gradient is missing or has the wrong size.
    """
    grads = _as_bucket_flats(state, grads)  # bad input raises before anything is consumed
    return apply_update(state.donate("offload_step"), grads, threads=threads, grad_norm=grad_norm)


def apply_update(
    state: Donation,
    grads: tuple[torch.Tensor, ...],
    *,
    threads: int | None,
    grad_norm: float | None,
) -> TrainState:
    """The update of ``offload_step`` on a donated state's leaves (``train_step``'s last part):
    masters and optimizer state stepped in place, compute copies derived from them.

    ``grads`` are per-bucket flats the caller has checked (``offload_step`` checks them before
    it donates; ``train_step`` builds them)."""
    layout = state.layout
    master = state.master
    split = StateParts.of(state.opt_state)
    if grad_norm is None:
        grad_norm = float(reduction_of(layout).global_norm(layout, list(grads)))
    device_idx = [b.index for b in layout.buckets if not b.offload]
    cpu_idx = [b.index for b in layout.buckets if b.offload]
    if threads is None and cpu_idx and layout.device.type != "cpu":
        threads = default_threads()

    if layout.device.type == "cuda" and cpu_idx:
        new_master, parts, local = _cuda_step(
            state, grads, split, device_idx, cpu_idx, threads, grad_norm
        )
    else:
        new_master, parts, local = _host_step(
            state, grads, split, device_idx, cpu_idx, threads, grad_norm
        )
    new_opt = split.merge(parts)
    assert all(m is master[i] for i, m in enumerate(new_master)), "masters step in place"
    return state.state(
        master=tuple(new_master),
        compute=derive_compute(layout, tuple(new_master), local),
        opt_state=new_opt,
        step=state.step + 1,
    )


def _device_step(state: Donation, grads, split, device_idx: list[int], grad_norm: float):
    """One fused update over every device bucket (asynchronous on CUDA)."""
    if not device_idx:
        return []
    master, members = state.master, state.layout.members
    subset = lambda xs: PerBucket(xs, (members[i] for i in device_idx))
    moved = subset(grads[i].to(master[i].dtype) for i in device_idx)
    _, new = state.optimizer.update(
        moved,
        split.select(device_idx),
        subset(master[i] for i in device_idx),
        donate=True,
        grad_norm=grad_norm,
        placement=state.layout.placement,
    )
    return [(device_idx, new)]


def _host_step(state: Donation, grads, split, device_idx, cpu_idx, threads, grad_norm):
    """The step when the device is the CPU (or nothing is offloaded): no copies to overlap.

    Offloaded buckets that need a cast step blocked and write their compute shard directly.
    """
    layout, master = state.layout, state.master
    parts = _device_step(state, grads, split, device_idx, grad_norm)
    local: list[torch.Tensor | None] = [None] * len(master)
    with offload_threads(threads if cpu_idx else None):
        for i in cpu_idx:
            bucket, m = layout.buckets[i], master[i]
            g = grads[i].to("cpu")
            out = None
            if _needs_cast(bucket) and layout.device.type == "cpu":
                out = _reusable(state.compute[i], m, bucket)
                if out is None:
                    out = torch.empty(m.numel(), dtype=bucket.dtypes.compute)
            parts.append(_cpu_bucket_step(state, split, i, g, out, grad_norm))
            local[i] = out
    return list(master), parts, local


def _reusable(
    prev: torch.Tensor | None, master: torch.Tensor, bucket: Bucket
) -> torch.Tensor | None:
    """The consumed state's compute copy of a bucket, when the new one can be written into it.

    It is derived from the master being stepped, so nothing else reads it; writing it in place
    spares a fresh allocation whose pages the cast would fault in on every step (as much time
    again as the cast itself on a CPU).
    """
    if (
        prev is None
        or prev.numel() != master.numel()
        or prev.dtype != bucket.dtypes.compute
        or prev.device != master.device
        or prev.data_ptr() == master.data_ptr()
    ):
        return None
    return prev


def _cuda_step(state: Donation, grads, split, device_idx, cpu_idx, threads, grad_norm):
    """The overlapped step: GPU buckets on the GPU while the CPU steps offloaded ones.

    Streams: ``main`` (the current one) runs the device step and later the gathers; ``d2h``
    brings every offloaded gradient into pinned host memory, one event per bucket, queued at
    once so the CPU steps bucket i while bucket i+1 is in flight; ``h2d`` sends each bucket's
    compute copy back as soon as the CPU has written it.
    """
    layout, master = state.layout, state.master
    device = layout.device
    main = torch.cuda.current_stream(device)
    d2h, h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

    grads_ready = torch.cuda.Event()
    grads_ready.record(main)
    parts = _device_step(state, grads, split, device_idx, grad_norm)  # async, launched first

    # Device buffers for the compute shards, allocated on main; h2d writes them after main
    # is done with whatever they held before.
    dst = {i: _device_compute(state, i) for i in cpu_idx}
    dst_free = torch.cuda.Event()
    dst_free.record(main)

    d2h.wait_event(grads_ready)
    host_grads, arrived = _grads_to_host(grads, cpu_idx, d2h)

    h2d.wait_event(dst_free)
    with offload_threads(threads):
        for i in cpu_idx:
            bucket, m = layout.buckets[i], master[i]
            cast = _needs_cast(bucket)
            out = None
            if cast:
                out = torch.empty(m.numel(), dtype=bucket.dtypes.compute, pin_memory=True)
            arrived[i].synchronize()
            parts.append(_cpu_bucket_step(state, split, i, host_grads[i], out, grad_norm))
            with torch.cuda.stream(h2d):
                # A pinned source records the copy on the host allocator, so it outlives it.
                dst[i].copy_(out if cast else m, non_blocking=True)
                dst[i].record_stream(h2d)
    main.wait_stream(h2d)
    local: list[torch.Tensor | None] = [None] * len(master)
    for i in cpu_idx:
        local[i] = dst[i]
    return list(master), parts, local


def _cpu_bucket_step(
    state: Donation, split, i: int, grad: torch.Tensor, out: torch.Tensor | None, grad_norm
) -> tuple[list[int], Any]:
    """Offloaded bucket ``i`` stepped on the CPU (its cast written into ``out`` when given):
    the part ``StateParts.merge`` takes."""
    layout = state.layout
    new = step_and_cast(
        state.optimizer,
        split.select([i]),
        state.master[i],
        grad,
        out,
        members=layout.members[i],
        grad_norm=grad_norm,
        placement=layout.placement,
    )
    return [i], new


def _device_compute(state: Donation, i: int) -> torch.Tensor:
    """The device buffer for offloaded bucket ``i``'s compute shard: the consumed state's
    when it fits (ZeRO-3, whose compute copy is the shard itself), else a new one."""
    layout = state.layout
    bucket, prev = layout.buckets[i], state.compute[i]
    reuse = (
        layout.strategy.shards_params
        and prev is not None
        and prev.device == layout.device
        and prev.numel() == bucket.numel
        and prev.dtype == bucket.dtypes.compute
    )
    if reuse:
        return prev
    return torch.empty(bucket.numel, dtype=bucket.dtypes.compute, device=layout.device)


def _grads_to_host(
    grads: tuple[torch.Tensor, ...], cpu_idx: list[int], d2h: torch.cuda.Stream
) -> tuple[dict[int, torch.Tensor], dict[int, torch.cuda.Event]]:
    """Every offloaded gradient queued at once on ``d2h`` into pinned host memory, with the
    event of each one's arrival."""
    host_grads, arrived = {}, {}
    with torch.cuda.stream(d2h):
        for i in cpu_idx:
            g = grads[i]
            host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            host.copy_(g, non_blocking=True)
            if g.is_cuda:  # g may be freed on main while the copy is in flight
                g.record_stream(d2h)
            arrived[i] = torch.cuda.Event()
            arrived[i].record(d2h)
            host_grads[i] = host
    return host_grads, arrived
