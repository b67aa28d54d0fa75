"""A pool of local ranks that stays alive across calls, for tests and notebooks.

Spawning a process group costs seconds; a :class:`RankPool` starts ``nproc`` gloo ranks once
and then runs any importable function on all of them::

    with RankPool(3) as pool:
        results = pool.run(my_module.check_something, arg)   # one result per rank
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from funcshard.launch import free_port, init_process_group

__all__ = ["RankPool"]


def _worker(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    import torch.distributed as dist

    init_process_group(rank, world, port, backend="gloo")
    try:
        while True:
            job = inbox.get()
            if job is None:
                break
            fn, args, kwargs = job
            try:
                outbox.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - sent back to the parent
                outbox.put((rank, False, traceback.format_exc()))
    finally:
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
        self._outbox = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, nproc, port, self._inboxes[r], self._outbox),
                        daemon=True)
            for r in range(nproc)
        ]
        for p in self._procs:
            p.start()
        self._broken = False

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results in rank order.

        Raises:
          RuntimeError: a rank raised (its traceback is in the message) or timed out; the
            ranks are then stopped (they may disagree on the collectives they ran) and the
            next call starts fresh ones.
        """
        if self._broken:  # an earlier call failed: the ranks may disagree, start afresh
            self._start()
        for q in self._inboxes:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors = []
        for _ in range(self.nproc):
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout)
            except Exception as e:  # queue.Empty
                self.close(force=True)
                raise RuntimeError(f"RankPool: no answer within {self.timeout}s") from e
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break
        if errors:
            self.close(force=True)
            raise RuntimeError("RankPool: a rank failed\n" + "\n".join(errors))
        return [results[r] for r in range(self.nproc)]

    def close(self, force: bool = False) -> None:
        if not self._broken and not force:
            for q in self._inboxes:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        self._broken = True
        for p in self._procs:
            if p.is_alive():
                p.terminate()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
