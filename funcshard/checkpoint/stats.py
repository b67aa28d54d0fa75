"""Byte accounting of checkpoint I/O, scoped to a ``with io_stats()`` block.

The counters are the ``IOStats`` objects themselves; which ones are counting is a context
variable (each thread and task has its own; a background save runs in its caller's context,
and a reader's worker threads in copies of it: ``in_context``). A lock keeps the counts of
threads counting at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["IOStats", "io_stats", "in_context", "count", "count_checked", "count_verified"]


@dataclasses.dataclass
class IOStats:
    """Array bytes moved by checkpoint reads and writes on this rank inside ``io_stats()``."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    bytes_verified_extra: int = 0  # read only to verify a checksum block a read cut into
    bytes_checked: int = 0  # read and verified before a restore writes anything (then dropped)


_ACTIVE: contextvars.ContextVar[tuple[IOStats, ...]] = contextvars.ContextVar(
    "funcshard_checkpoint_io_stats", default=()
)


_LOCK = threading.Lock()


def in_context(fn: Callable[[T], R]) -> Callable[[T], R]:
    """``fn`` run in a copy of the caller's context (the counters counting now), for a
    worker thread to count into them: ``pool.map(in_context(fn), items)``."""
    ctx = contextvars.copy_context()
    return lambda x: ctx.copy().run(fn, x)


@contextlib.contextmanager
def io_stats() -> Iterator[IOStats]:
    """Counts the array bytes this rank reads and writes in checkpoints inside the block."""
    stats = IOStats()
    token = _ACTIVE.set((*_ACTIVE.get(), stats))
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


def count(read: bool, nbytes: int) -> None:
    """Adds one read or write of ``nbytes`` to every counter active in this context."""
    with _LOCK:
        _count(read, nbytes)


def _count(read: bool, nbytes: int) -> None:
    for s in _ACTIVE.get():
        if read:
            s.bytes_read += nbytes
            s.reads += 1
        else:
            s.bytes_written += nbytes
            s.writes += 1


def count_verified(nbytes: int) -> None:
    """Adds bytes read only to complete a checksum block (not part of ``bytes_read``)."""
    with _LOCK:
        for s in _ACTIVE.get():
            s.bytes_verified_extra += nbytes


def count_checked(nbytes: int) -> None:
    """Adds bytes read only to verify them before a restore writes into its target."""
    with _LOCK:
        for s in _ACTIVE.get():
            s.bytes_checked += nbytes
