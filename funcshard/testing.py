"""A pool of local ranks that stays alive across calls, for tests and notebooks; and
``PeakMemory``, the peak resident memory of a block of code.

Spawning a process group costs seconds; a :class:`RankPool` starts ``nproc`` gloo ranks once
and then runs any importable function on all of them::

    with RankPool(3) as pool:
        results = pool.run(my_module.check_something, arg)   # one result per rank
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from funcshard.distributed.launch import free_port, init_process_group
from funcshard.distributed.results import call_and_send, gather, stop
from funcshard.state.state import tree

__all__ = ["PeakMemory", "RankPool", "TIMEOUT_ENV", "scaled_timeout", "state_bytes"]

TIMEOUT_ENV = "FUNCSHARD_POOL_TIMEOUT"


def scaled_timeout(base: float, nproc: int, cpus: int | None = None) -> float:
    """Seconds a call of ``nproc`` ranks may take, given ``base`` on a machine with a core per
    rank: ``base`` times the ranks per core (4 ranks on 2 cores wait twice as long), or the
    environment's ``FUNCSHARD_POOL_TIMEOUT`` (seconds) where it is set, for a slow machine.
    ``cpus``: the cores this process may run on (None: its affinity).
    """
    override = os.environ.get(TIMEOUT_ENV)
    if override:
        try:
            seconds = float(override)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}: expected seconds, got {override!r}") from None
        if not seconds > 0:
            raise ValueError(f"{TIMEOUT_ENV}: expected seconds > 0, got {override!r}")
        return seconds
    if cpus is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return base * max(1.0, nproc / cpus)


@dataclasses.dataclass
class PeakMemory:
    """The peak resident memory of this process inside a ``with`` block, above what it held
    on entry (Linux: the kernel's high-water mark, reset on entry through
    ``/proc/self/clear_refs``). It sees every allocation that is touched, torch's, numpy's
    and the interpreter's alike, which ``tracemalloc`` does not. For allocations to show up
    and go as they happen, start the process with glibc's ``MALLOC_MMAP_THRESHOLD_`` set
    (e.g. 65536): large blocks are then mapped and unmapped, never kept for reuse.

    >>> with PeakMemory() as peak:  # doctest: +SKIP
    ...     x = bytearray(64 << 20)
    >>> peak.extra >= 64 << 20  # doctest: +SKIP
    True
    """

    start: int = 0  # resident bytes on entry
    peak: int = 0  # the high-water mark inside the block

    @property
    def extra(self) -> int:
        """Bytes the block held at its peak beyond those held on entry."""
        return self.peak - self.start

    def __enter__(self) -> PeakMemory:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark := the resident size now
        self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(rank: int, world: int, port: int, inbox: Any, outbox: Connection) -> None:
    import torch.distributed as dist

    init_process_group(rank, world, port, backend="gloo")
    try:
        while True:
            job = inbox.get()
            if job is None:
                break
            fn, args, kwargs = job
            call_and_send(outbox, fn, args, kwargs)
    finally:
        outbox.close()
        dist.destroy_process_group()
    # closed: no interpreter shutdown (the threads and pools the jobs left, e.g. a
    # checkpoint writer's, would each be joined): every answer is already sent
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """``nproc`` CPU ranks joined in one gloo process group, reused across ``run`` calls.

    ``timeout``: seconds one ``run`` may take; None: 600 s scaled by the ranks per core
    (:func:`scaled_timeout`, which ``FUNCSHARD_POOL_TIMEOUT`` overrides).
    """

    def __init__(self, nproc: int, timeout: float | None = None) -> None:
        self.nproc = nproc
        self.timeout = scaled_timeout(600.0, nproc) if timeout is None else timeout
        self._start()

    def _start(self) -> None:
        ctx, nproc = mp.get_context("spawn"), self.nproc
        self._inboxes = [ctx.Queue() for _ in range(nproc)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
        self._outboxes = [recv for recv, _ in pipes]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, nproc, port, self._inboxes[r], send), daemon=True)
            for r, (_, send) in enumerate(pipes)
        ]
        for p in self._procs:
            p.start()
        for _, send in pipes:
            send.close()  # only the rank holds its write end: its death closes the pipe
        self._broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order.

        Raises:
          RuntimeError: a rank raised (its traceback is in the message), died without an
            answer (its exit code or signal is), or timed out; the ranks are then stopped
            (they may disagree on the collectives they ran) and the next call starts fresh
            ones.
        """
        if self._broken:  # an earlier call failed: the ranks may disagree, start afresh
            self._start()
        for q in self._inboxes:
            q.put((fn, args, kwargs))
        try:
            return gather(self._outboxes, self._procs, "RankPool", self.timeout)
        except BaseException:
            self.close(force=True)
            raise

    def close(self, force: bool = False) -> None:
        if not self._broken and not force:
            for q in self._inboxes:
                q.put(None)
            deadline = time.monotonic() + 10.0  # then stopped: a rank is a test's, not a job's
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._broken = True
        stop(self._procs)
        for c in self._outboxes:
            c.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def state_bytes(state: Any) -> int:
    """Bytes of every distinct buffer of a ``TrainState`` (masters, compute copies, optimizer
    state; a buffer several leaves view counts once)."""
    storages = {}
    for t in tree.leaves(state):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            s = t.untyped_storage()
            storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


@contextlib.contextmanager
def local_s3(bucket: str) -> Iterator[dict[str, str]]:
    """A local S3 server (moto's, from the test extra) with ``bucket`` made, for tests and
    benchmarks of object-store checkpoints; yields the environment a process needs to reach
    it (also set in this one's while the server runs, so that ranks spawned meanwhile
    inherit it; the previous values come back on exit)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    before = dict(os.environ)
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
        }
        os.environ.update(env)
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        yield env
    finally:
        for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        server.stop()
