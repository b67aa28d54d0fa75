"""Local multi-process launch over torch.distributed (gloo on CPU, NCCL one process per GPU)."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    backend = _backend(backend, rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def _backend(backend: str | None, local_rank: int) -> str:
    """NCCL with CUDA (this process on GPU ``local_rank``), gloo otherwise, unless given."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return backend


def init_from_env(backend: str | None = None) -> None:
    """Joins the process group that torchrun (or any launcher setting ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) describes; restart-safe under torchrun.

    After ``torchrun --max-restarts`` restarts a job, its store still holds the keys of the
    failed attempt, and a plain ``dist.init_process_group("gloo")`` connects to the dead
    ranks' addresses ("Connection refused"). Here each attempt
    (``TORCHELASTIC_RESTART_COUNT``) gets its own key space. ``backend`` defaults to NCCL with
    CUDA (one GPU per ``LOCAL_RANK``) and gloo otherwise.
    """
    env = os.environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set; run under torchrun "
                           "or use fs.launch")
    backend = _backend(backend, int(env.get("LOCAL_RANK", 0)))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, rank=rank, world_size=world)
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world,
                          is_master=False)
    store = dist.PrefixStore(f"funcshard/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    try:
        init_process_group(rank, world_size, port)
        result = fn(*args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Runs ``fn(*args)`` on ``nproc`` local ranks and returns each rank's result (rank order).

    ``fn`` must be importable (a module-level function). Raises RuntimeError carrying the first
    failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = mp.start_processes(
        _entry, args=(nproc, port, fn, args, queue), nprocs=nproc, join=False, start_method="spawn"
    )
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(nproc):
        rank, ok, value = queue.get()
        if ok:
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    if errors:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        raise RuntimeError("fs.launch: a rank failed\n" + "\n".join(errors))
    procs.join()
    return [results[r] for r in range(nproc)]
