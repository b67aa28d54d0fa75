"""Local multi-process launch over torch.distributed (gloo on CPU, NCCL one process per GPU)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from funcshard._results import call_and_send, gather, stop

__all__ = ["launch", "free_port", "init_process_group", "init_from_env"]


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, backend: str | None = None) -> None:
    """Joins a local process group on 127.0.0.1:port and sets the usual torchrun variables."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    backend = _backend(backend, rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


# With CUDA, CPU tensors take gloo and CUDA tensors NCCL, through one process group: a CPU
# mesh (tests, CPU benchmarks) then works on a GPU machine too.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def _backend(backend: str | None, local_rank: int) -> str:
    """``CUDA_BACKEND`` with CUDA (this process on GPU ``local_rank`` modulo the GPUs: more
    ranks than GPUs may share them for CPU meshes; ``make_mesh`` refuses a CUDA mesh then),
    gloo otherwise, unless given."""
    if backend is None:
        backend = CUDA_BACKEND if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return backend


def init_from_env(backend: str | None = None) -> None:
    """Joins the process group that torchrun (or any launcher setting ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) describes; restart-safe under torchrun.

    After ``torchrun --max-restarts`` restarts a job, its store still holds the keys of the
    failed attempt, and a plain ``dist.init_process_group("gloo")`` connects to the dead
    ranks' addresses ("Connection refused"). Here each attempt
    (``TORCHELASTIC_RESTART_COUNT``) gets its own key space. ``backend`` defaults to NCCL with
    CUDA (one GPU per ``LOCAL_RANK``; CPU tensors over gloo) and gloo otherwise.
    """
    env = os.environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise RuntimeError(
            f"init_from_env: {', '.join(missing)} not set; run under torchrun or use fs.launch"
        )
    backend = _backend(backend, int(env.get("LOCAL_RANK", 0)))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, rank=rank, world_size=world)
        return
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world, is_master=False
    )
    store = dist.PrefixStore(f"funcshard/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _run_rank(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> Any:
    init_process_group(rank, world_size, port)
    return fn(*args)


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, conn: Connection
) -> None:
    try:
        ok = call_and_send(conn, _run_rank, (rank, world_size, port, fn, args), {})
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Runs ``fn(*args)`` on ``nproc`` local ranks and returns each rank's result (rank order).

    ``fn`` must be importable (a module-level function). Each result travels as
    ``torch.save`` bytes, so it arrives whole even though its rank has exited (tensors keep
    their device). When a rank fails, the others are terminated.

    Raises:
      RuntimeError: a rank raised (the message carries its traceback) or died without a result
        (the message names the rank and its exit code or signal).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    try:
        for rank in range(nproc):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_entry,
                args=(rank, nproc, port, fn, args, send),
                name=f"fs.launch rank {rank}",
            )
            p.start()
            send.close()  # only the rank holds its write end: its death closes the pipe
            procs.append(p)
            conns.append(recv)
        results = gather(conns, procs, "fs.launch")
        deadline = time.monotonic() + 30.0  # let the ranks leave the group on their own
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        return results
    finally:
        stop(procs)
        for c in conns:
            c.close()
