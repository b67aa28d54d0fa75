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
  without answering (``os._exit``, a signal, the OOM killer) is reported within
  ``SETTLE_S`` seconds, with its exit code or signal, instead of being waited for forever.
  The error names the first cause (the dead rank, not the rank whose collective failed
  because it died) and lists the other failures after it.
"""

from __future__ import annotations

import io
import signal
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

import torch

_OK, _ERR = b"R", b"E"
_TIME = struct.Struct("<d")  # an error report's time.time() of the raise, after _ERR
SETTLE_S = 2.0  # seconds the other ranks get, once one failed, to show the first cause


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
        when = _TIME.pack(time.time())
        payload, ok = _ERR + when + traceback.format_exc().encode(), False
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


class _Failure(NamedTuple):
    """One rank's failure: it died without a result (``silent``) or raised (its report)."""

    silent: bool
    when: float  # time.time(): when the rank raised, or when its death was seen
    rank: int
    text: str  # "rank 1 died without a result (exit code 3)" or "rank 0 raised:\n<traceback>"

    def summary(self) -> str:
        """The first line, or the raised exception's line (a traceback's last line)."""
        lines = self.text.rstrip().splitlines()
        return lines[0] if self.silent else f"rank {self.rank} raised {lines[-1].strip()}"


def _first_cause(failures: list[_Failure], who: str) -> RuntimeError:
    """The error of the failure that came first, listing the others after it.

    A rank that died without a result (``os._exit``, a signal, the OOM killer) comes first: it
    could not have been a consequence of a report, whereas a rank waiting in a collective with
    it raises *because* it died, and under load the parent sees both at once. Among the silent
    deaths the one seen first; otherwise the report raised first (its rank's clock, carried in
    the report). Never rank order, nor the order in which the reports arrived.
    """
    first, *rest = sorted(failures, key=lambda f: (not f.silent, f.when, f.rank))
    text = f"{who}: {first.text}"
    if rest:
        then = "; ".join(f.summary() for f in rest)
        text += f"\n{who}: first cause above; then (by time): {then}"
    return RuntimeError(text)


def _read(conn: Connection, proc: BaseProcess, conn_ready: bool) -> bytes | None:
    """The rank's answer; None with the rank still running (its sentinel raced ahead); raises
    EOFError when it died without one."""
    try:
        data = conn.recv_bytes() if conn.poll() else None
    except (EOFError, OSError):
        data = None
    if data is None and (conn_ready or not proc.is_alive()):
        raise EOFError
    return data


def gather(
    conns: Sequence[Connection],
    procs: Sequence[BaseProcess],
    who: str,
    timeout: float | None = None,
    settle: float = SETTLE_S,
) -> list[Any]:
    """Receives one answer per rank (``conns[r]`` is rank ``r``'s pipe, ``procs[r]`` its process).

    After the first failure the other ranks get ``settle`` more seconds to answer or die, so
    that the error names the first cause (see :func:`_first_cause`) and lists the others.

    Args:
      conns: the parent's read ends, one per rank.
      procs: the ranks' processes, in the same order.
      who: the caller's name, for the error messages.
      timeout: seconds to wait for all answers; ``None`` waits as long as every rank lives.
      settle: seconds to wait for the other ranks once one has failed.

    Returns:
      The results in rank order.

    Raises:
      RuntimeError: a rank raised (its traceback is in the message), died without answering
        (its exit code or signal is), or no answer came within ``timeout``. The caller then
        stops the remaining ranks.
    """
    pending = dict(enumerate(conns))
    results: dict[int, Any] = {}
    failures: list[_Failure] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    settling = False
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        sentinels = {procs[r].sentinel: r for r in pending}
        ready = wait([*pending.values(), *sentinels], timeout=left)
        if not ready:
            break
        # Pipes first: a rank that answered and then exited has its whole answer in the pipe.
        for r, conn in list(pending.items()):
            if conn not in ready and procs[r].sentinel not in ready:
                continue
            try:
                data = _read(conn, procs[r], conn in ready)
            except EOFError:
                seen = time.time()
                died = f"rank {r} died without a result ({describe_exit(procs[r])})"
                failures.append(_Failure(True, seen, r, died))
                del pending[r]
                continue
            if data is None:
                continue  # only its sentinel raced ahead; look again
            del pending[r]
            if data[:1] == _ERR:
                (when,) = _TIME.unpack_from(data, 1)
                body = data[1 + _TIME.size :].decode()
                failures.append(_Failure(False, when, r, f"rank {r} raised:\n{body}"))
                continue
            buf = io.BytesIO(data)
            buf.seek(1)
            results[r] = torch.load(buf, weights_only=False)  # our own rank's bytes
        if failures and not settling:  # once: the others get ``settle`` seconds from now
            settling, until = True, time.monotonic() + settle
            deadline = until if deadline is None else min(deadline, until)
    if failures:
        error = _first_cause(failures, who)
        if pending:  # a rank that neither answered nor failed: hung, not hidden by the settle
            error.args = (
                f"{error.args[0]}\n{who}: rank(s) {sorted(pending)} still running, without an "
                f"answer {settle:g} s after the first failure (hung?)",
            )
        raise error
    if pending:
        raise RuntimeError(f"{who}: no answer from rank(s) {sorted(pending)} within {timeout}s")
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
