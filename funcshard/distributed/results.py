"""Rank results as plain bytes over one pipe per rank, and a wait that notices dead ranks.

Shared by :func:`funcshard.distributed.launch` and :class:`funcshard.testing.RankPool`.
Two failure modes of a ``multiprocessing`` queue are impossible here:

* A result is serialized with ``torch.save`` into bytes in the rank and read back with
  ``torch.load`` in the parent, so it owns its memory: no shared-memory segment or file
  descriptor of the rank (torch's ``file_descriptor`` sharing strategy) has to outlive the
  rank, and the rank may exit as soon as the send returns. Tensors keep their device and
  dtype; a view travels with its whole storage (as with ``torch.save``). The cost is one
  copy of the result in each process while it travels.
* The parent waits on each rank's pipe *and* its process sentinel, so a rank that dies
  without answering (``os._exit``, a signal, the OOM killer) is reported at once, with its
  exit code or signal, instead of being waited for forever.
"""

from __future__ import annotations

import io
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

_OK, _ERR = b"R", b"E"


def call_and_send(conn: Connection, fn: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """Runs ``fn(*args, **kwargs)`` and sends its result (or its traceback) through ``conn``.

    A result that ``torch.save`` cannot serialize is reported as an error of the call.

    Returns:
      Whether ``fn`` returned and its result was sent.
    """
    try:
        buf = io.BytesIO()
        buf.write(_OK)
        torch.save(fn(*args, **kwargs), buf)
        payload, ok = buf.getbuffer(), True
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        payload, ok = _ERR + traceback.format_exc().encode(), False
    conn.send_bytes(payload)
    return ok


def describe_exit(proc: BaseProcess) -> str:
    """``exit code 3`` or ``killed by signal 9 (SIGKILL)`` for a finished process."""
    proc.join(timeout=5.0)  # the pipe may close a moment before the exit code is known
    code = proc.exitcode
    if code is None:
        return "closed its result pipe but is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


def gather(
    conns: Sequence[Connection],
    procs: Sequence[BaseProcess],
    who: str,
    timeout: float | None = None,
) -> list[Any]:
    """Receives one answer per rank (``conns[r]`` is rank ``r``'s pipe, ``procs[r]`` its process).

    Args:
      conns: the parent's read ends, one per rank.
      procs: the ranks' processes, in the same order.
      who: the caller's name, for the error messages.
      timeout: seconds to wait for all answers; ``None`` waits as long as every rank lives.

    Returns:
      The results in rank order.

    Raises:
      RuntimeError: a rank raised (its traceback is in the message), died without answering
        (its exit code or signal is), or no answer came within ``timeout``. The caller then
        stops the remaining ranks.
    """
    pending = dict(enumerate(conns))
    results: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        sentinels = {procs[r].sentinel: r for r in pending}
        ready = wait([*pending.values(), *sentinels], timeout=left)
        if not ready:
            raise RuntimeError(f"{who}: no answer from rank(s) {sorted(pending)} within {timeout}s")
        # Pipes first: a rank that answered and then exited has its whole answer in the pipe.
        for r, conn in list(pending.items()):
            if conn not in ready and procs[r].sentinel not in ready:
                continue
            try:
                data = conn.recv_bytes() if conn.poll() else None
            except (EOFError, OSError):
                data = None
            if data is None:
                if procs[r].is_alive() and conn not in ready:
                    continue  # only its sentinel raced ahead; look again
                raise RuntimeError(
                    f"{who}: rank {r} died without a result ({describe_exit(procs[r])})"
                )
            if data[:1] == _ERR:
                raise RuntimeError(f"{who}: rank {r} raised:\n{data[1:].decode()}")
            buf = io.BytesIO(data)
            buf.seek(1)
            results[r] = torch.load(buf, weights_only=False)  # our own rank's bytes
            del pending[r]
    return [results[r] for r in range(len(conns))]


def stop(procs: Sequence[BaseProcess], grace: float = 5.0) -> None:
    """Terminates the ranks still running (SIGKILL after ``grace`` seconds) and reaps all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.0))
        if p.is_alive():
            p.kill()
            p.join()
