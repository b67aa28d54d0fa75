"""A pool of local ranks that stays alive across calls, for tests and notebooks.

Spawning a process group costs seconds; a :class:`RankPool` starts ``nproc`` gloo ranks once
and then runs any importable function on all of them::

    with RankPool(3) as pool:
        results = pool.run(my_module.check_something, arg)   # one result per rank
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing as mp

from funcshard._results import call_and_send, gather, stop
from funcshard.launch import free_port, init_process_group

__all__ = ["RankPool"]


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


class RankPool:
    """``nproc`` CPU ranks joined in one gloo process group, reused across ``run`` calls."""

    def __init__(self, nproc: int, timeout: float = 600.0) -> None:
        self.nproc = nproc
        self.timeout = timeout
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
            for p in self._procs:
                p.join(timeout=30)
        self._broken = True
        stop(self._procs)
        for c in self._outboxes:
            c.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
