"""Local multi-process launch over torch.distributed (gloo on CPU, NCCL one process per GPU)."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from funcshard.distributed.results import call_and_send, gather, stop

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


def init_from_env(backend: str | None = None, *, timeout: timedelta | None = None) -> None:
    """Joins the process group that torchrun (or any launcher setting ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) describes, in every torchrun mode.

    torchrun starts a new set of workers in every rendezvous round: after a failure
    (``--max-restarts``) and after a membership change (a node lost or joining under
    ``--nnodes=MIN:MAX``). What the workers must do then depends on who hosts the store at
    ``MASTER_ADDR:MASTER_PORT``:

    - Not shared (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which a node needs to rejoin),
      and launchers other than torchrun: worker rank 0 hosts a new store, at a port the agent
      picks anew every round. ``dist.init_process_group`` is restart-safe as it is; this calls
      it.
    - Shared (torchrun's default, ``TORCHELASTIC_USE_AGENT_STORE=True``): the rank-0 node's
      agent hosts the store and keeps it across rounds, with the keys of the round before. A
      plain ``dist.init_process_group`` then reads a dead rank's address and fails
      ("Connection refused"). Here worker rank 0 hosts a new store of the round's own and
      publishes its port with a random nonce in the agent's store; every other rank connects
      to the port it reads there once that store answers with the same nonce, so a stale entry
      of an earlier round (its host is dead) is skipped. ``TORCHELASTIC_RESTART_COUNT`` cannot
      key a round: a membership change does not advance it and a relaunched agent starts again
      at 0, so nodes of one round can hold different counts.

    Args:
      backend: default NCCL with CUDA (one GPU per ``LOCAL_RANK``; CPU tensors over gloo),
        gloo otherwise.
      timeout: for joining and for the group's collectives; default torch's.

    Raises:
      RuntimeError: a variable is missing (not under torchrun).
      TimeoutError: shared mode, and no live store of this round appeared within ``timeout``.
    """
    env = os.environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise RuntimeError(
            f"init_from_env: {', '.join(missing)} not set; run under torchrun or use fs.launch"
        )
    backend = _backend(backend, int(env.get("LOCAL_RANK", 0)))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    kw = {} if timeout is None else {"timeout": timeout}
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
        return
    store = _round_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), rank, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)


_ROUND_KEY = "funcshard/round_store"  # in the agent's store: "<port> <nonce>" of this round's
_NONCE_KEY = "funcshard/nonce"  # in the round's store: its nonce


def _round_store(addr: str, agent_port: int, rank: int, timeout: timedelta | None) -> dist.Store:
    """A store of this rendezvous round only, hosted by rank 0 (see ``init_from_env``)."""
    timeout = timeout or timedelta(minutes=30)
    agent = dist.TCPStore(addr, agent_port, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(addr, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        store.set(_NONCE_KEY, nonce)
        agent.set(_ROUND_KEY, f"{store.port} {nonce}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = agent.get(_ROUND_KEY).decode().split()
        store = _connect_if_live(addr, int(port), nonce, timeout)
        if store is not None:
            return store
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"init_from_env: rank {rank} found no live store of this round at {addr} "
                f"within {timeout} (the agent's store at port {agent_port} names port {port})"
            )
        time.sleep(0.05)  # rank 0 of this round has not published yet: the entry is stale


def _connect_if_live(addr: str, port: int, nonce: str, timeout: timedelta) -> dist.Store | None:
    """A client of the store at ``addr:port`` if it is up and holds ``nonce``, else None."""
    try:  # a plain socket first: a dead port refuses at once, where TCPStore retries and logs
        socket.create_connection((addr, port), timeout=5.0).close()
    except OSError:
        return None
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        if store.check([_NONCE_KEY]) and store.get(_NONCE_KEY).decode() == nonce:
            return store
    except RuntimeError:  # something else took the port (DistError is a RuntimeError)
        pass
    return None


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
