"""Where checkpoints live: the one module of the checkpoint package that touches storage.

A location is a path (or a ``file://`` URL) on a filesystem, or an ``s3://bucket/key`` or
``gs://bucket/key`` URL of an object store, reached through tensorstore's kvstores (its
``s3`` and ``gcs`` drivers; never a client of our own). Every function here takes either and
dispatches on it, so the writers, readers, the commit protocol and the manager above it never
ask which kind they hold, but for the one difference that shapes the protocol: a filesystem
renames a finished directory into place (:data:`atomic_rename`), an object store cannot, and a
checkpoint there counts once its commit marker is written, last.

Object stores take their endpoint and credentials from the standard environment:
``AWS_ENDPOINT_URL`` (a local server in tests), ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` and the
credentials tensorstore's s3 driver reads (``AWS_ACCESS_KEY_ID``, ...); GCS's defaults. A
request that fails for a reason worth retrying (no connection, a 5xx, throttling) is retried
with exponential backoff for at most ``FUNCSHARD_STORE_TIMEOUT_S`` seconds (default 60;
tensorstore's own default gives up after 32 attempts, about 15 minutes); every failure of a
store raises :class:`StoreError`, an OSError naming the URL, the endpoint and the cause.
:func:`probe` checks that a store answers, with at most :data:`PROBE_TIMEOUT_S` of retries.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import threading
from typing import Any


class _Tensorstore:
    """tensorstore, imported at its first use (with ml_dtypes, most of a second)."""

    def __getattr__(self, name: str) -> Any:
        import tensorstore

        return getattr(tensorstore, name)


ts = _Tensorstore()
__all__ = [
    "CURL_DEFAULTS",
    "PROBE_TIMEOUT_S",
    "TIMEOUT_ENV",
    "Reader",
    "StoreError",
    "Writer",
    "create_file",
    "isfile",
    "write_stream",
    "atomic_rename",
    "exists",
    "fsync_dir",
    "is_object",
    "isdir",
    "kvstore",
    "listdir",
    "makedirs",
    "normalize",
    "open_reader",
    "probe",
    "retry_budget",
    "read_bytes",
    "remove_tree",
    "rename",
    "write_bytes",
    "yield_to_compute",
]

_SCHEMES = {"s3://": "s3", "gs://": "gcs"}


def is_object(path: str) -> bool:
    """Whether ``path`` names an object store (s3://, gs://) rather than a filesystem."""
    return str(path).startswith(tuple(_SCHEMES))


def atomic_rename(path: str) -> bool:
    """Whether a finished directory can be renamed into place at ``path`` (a filesystem)."""
    return not is_object(path)


def normalize(path: str | os.PathLike) -> str:
    """An absolute filesystem path (``file://`` dropped), or the object URL without a trailing
    slash."""
    path = os.fspath(path)
    if is_object(path):
        return path.rstrip("/")
    if path.startswith("file://"):
        path = path[len("file://") :]
    return os.path.abspath(path)


# --- object stores through tensorstore's kvstores -----------------------------------------------


def _split(url: str) -> tuple[str, str, str]:
    """``(driver, bucket, key)`` of an object URL."""
    scheme = next(s for s in _SCHEMES if url.startswith(s))
    bucket, _, key = url[len(scheme) :].partition("/")
    if not bucket:
        raise ValueError(f"checkpoint: {url!r} names no bucket (expected {scheme}BUCKET/PATH)")
    return _SCHEMES[scheme], bucket, key.strip("/")


TIMEOUT_ENV = "FUNCSHARD_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 10.0  # the check when a CheckpointManager is made: fail fast
_RETRIES = {"s3": "s3_request_retries", "gcs": "gcs_request_retries"}


class StoreError(OSError):
    """A request to an object store failed (after its retries), naming the URL, the endpoint
    and the store's answer."""


def retry_budget() -> float:
    """Seconds a store request may keep retrying: ``FUNCSHARD_STORE_TIMEOUT_S``, default 60."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        budget = float(text)
    except ValueError:
        budget = -1.0
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a finite number of seconds > 0")
    return budget


def _retries(budget: float) -> dict[str, Any]:
    """Tensorstore's retry resource whose backoff (doubling from ``initial_delay`` up to
    ``max_delay``, each wait plus a jitter of at most ``min(initial_delay, 1 s)``) sums to at
    most ``budget`` seconds."""
    initial = min(1.0, budget / 8)
    cap = max(initial, min(16.0, budget / 4))
    jitter = min(initial, 1.0)
    retries, spent = 0, 0.0
    while True:
        delay = min(initial * 2.0 ** min(retries, 64), cap)  # never past a float's range
        if spent + delay + jitter > budget:
            break
        if delay == cap:  # every later wait is the cap's: counted at once (a budget of days)
            retries += int((budget - spent) // (delay + jitter))
            break
        spent, retries = spent + delay + jitter, retries + 1
    retries = min(retries, 2**31 - 1)
    return {"max_retries": retries, "initial_delay": f"{initial:.6f}s", "max_delay": f"{cap:.6f}s"}


def _endpoint(driver: str) -> str | None:
    if driver != "s3":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _bucket_spec(driver: str, bucket: str, budget: float | None = None) -> dict[str, Any]:
    budget = retry_budget() if budget is None else budget
    spec: dict[str, Any] = {
        "driver": driver,
        "bucket": bucket,
        "context": {_RETRIES[driver]: _retries(budget)},
    }
    if driver == "s3":
        endpoint = _endpoint(driver)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
    return spec


def kvstore(path: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of the location ``path`` (a directory: its keys below it)."""
    if not is_object(path):
        return {"driver": "file", "path": path}
    driver, bucket, key = _split(path)
    return {**_bucket_spec(driver, bucket), "path": f"{key}/" if key else ""}


def _where(path: str) -> str:
    """The store ``path`` lives in, for messages: its bucket and endpoint."""
    driver, bucket, _ = _split(path)
    endpoint = _endpoint(driver) or "the driver's default endpoint"
    return f"{driver} bucket {bucket!r} at {endpoint}"


def _result(
    future: Any, path: str, what: str, budget: float | None = None, deadline: float | None = None
) -> Any:
    """``future``'s result; a store's failure as a :class:`StoreError` naming ``what`` was
    asked of ``path``, the bucket, the endpoint and the answer; with ``deadline``, no answer
    within that many seconds too."""
    try:
        return future.result(timeout=deadline)
    except TimeoutError as e:
        future.cancel()
        raise StoreError(
            f"{what} {path}: the {_where(path)} did not answer within {deadline:g} s"
        ) from e
    except ValueError as e:  # tensorstore's errors: a status message
        answer = str(e).split(" [http_response_body=", 1)[0]
        budget = retry_budget() if budget is None else budget
        raise StoreError(
            f"{what} {path}: the {_where(path)} failed: {answer} (requests are retried for "
            f"at most {budget:g} s: {TIMEOUT_ENV})"
        ) from e


# libcurl's limits on one request, unless the environment sets them: tensorstore sets none, so a
# connection that the network drops silently waits minutes, and one that stalls, forever
CURL_DEFAULTS = {
    "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": "10",
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "30",  # 30 s below 1 byte/s: cut, retried
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1",
}


@functools.cache
def _store(driver: str, bucket: str, endpoint: str | None, budget: float) -> ts.KvStore:
    del endpoint  # part of the cache key: a test's server
    for name, value in CURL_DEFAULTS.items():  # read when tensorstore makes its transport
        os.environ.setdefault(name, value)
    spec = _bucket_spec(driver, bucket, budget)
    url = f"{'s3' if driver == 's3' else 'gs'}://{bucket}"
    return _result(ts.KvStore.open(spec), url, "opening", budget)


def _object(path: str, budget: float | None = None) -> tuple[ts.KvStore, str]:
    driver, bucket, key = _split(path)
    budget = retry_budget() if budget is None else budget
    return _store(driver, bucket, _endpoint(driver), budget), key


def probe(path: str) -> None:
    """Checks that the store holding ``path`` answers a listing (the bucket exists and may be
    listed) within ``PROBE_TIMEOUT_S`` (retries included); a no-op on a filesystem.

    Raises:
      StoreError: naming the bucket, the endpoint and the store's answer.
    """
    if not is_object(path):
        return
    budget = min(PROBE_TIMEOUT_S, retry_budget())
    store, key = _object(path, budget)
    nothing = _prefix_range(f"{key}/_funcshard_probe" if key else "_funcshard_probe")
    listing = store.list(nothing)  # an empty listing: the cheapest request
    _result(listing, path, "probing", budget, deadline=PROBE_TIMEOUT_S)


def _prefix_range(key: str) -> ts.KvStore.KeyRange:
    prefix = f"{key}/" if key else ""
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + "0" if prefix else "")


def _keys_under(path: str) -> list[str]:
    store, key = _object(path)
    prefix = f"{key}/" if key else ""
    keys = _result(store.list(_prefix_range(key)), path, "listing")
    return [k.decode()[len(prefix) :] for k in keys]


# --- the operations ---------------------------------------------------------------------------


def exists(path: str) -> bool:
    """A file, a directory, an object or a prefix holding objects."""
    if not is_object(path):
        return os.path.exists(path)
    store, key = _object(path)
    if _result(store.read(key), path, "reading").state == "value":
        return True
    return bool(_keys_under(path))


def isdir(path: str) -> bool:
    if not is_object(path):
        return os.path.isdir(path)
    return bool(_keys_under(path))


def listdir(path: str) -> list[str]:
    """The names directly below ``path`` (on an object store: none when no object is there)."""
    if not is_object(path):
        return os.listdir(path)
    return sorted({k.split("/", 1)[0] for k in _keys_under(path)})


def makedirs(path: str) -> None:
    """A directory and its parents (nothing to make on an object store)."""
    if not is_object(path):
        os.makedirs(path, exist_ok=True)


def read_bytes(path: str) -> bytes:
    if not is_object(path):
        with open(path, "rb") as f:
            return f.read()
    store, key = _object(path)
    got = _result(store.read(key), path, "reading")
    if got.state != "value":
        raise FileNotFoundError(f"{path}: no such object")
    return bytes(got.value)


def write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` at ``path`` durably: fsync'd on a filesystem, acknowledged by the store."""
    if not is_object(path):
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return
    store, key = _object(path)
    _result(store.write(key, data), path, "writing")


def remove_tree(path: str) -> None:
    """Removes a directory and everything below it (every object under the prefix)."""
    if not is_object(path):
        shutil.rmtree(path)
        return
    store, key = _object(path)
    _result(store.delete_range(_prefix_range(key)), path, "removing")


def remove_file(path: str) -> None:
    if not is_object(path):
        os.remove(path)
        return
    store, key = _object(path)
    _result(store.delete_range(ts.KvStore.KeyRange(key, key + "\0")), path, "removing")


def rename(src: str, dst: str) -> None:
    """Moves a directory into place atomically (filesystems only: :func:`atomic_rename`)."""
    assert atomic_rename(dst), "an object store has no rename"
    os.rename(src, dst)


def fsync_dir(path: str) -> None:
    """Makes a rename or a new entry in ``path`` durable (an object store's are already)."""
    if is_object(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- positioned reads -------------------------------------------------------------------------


class Reader:
    """Positioned reads of one file or object: ``preadv`` into buffers, ``size``.

    An object is fetched whole on its first read (one request; a chunk file is at most the
    checkpoint's chunk target) and served from memory until :meth:`close`: a verified read
    reads a chunk's checksum blocks one after another, which would otherwise be a request each.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._data: bytes | None = None
        if is_object(path):
            store, key = _object(path)
            got = _result(store.read(key), path, "reading")
            if got.state != "value":
                raise FileNotFoundError(f"{path}: no such object")
            self._data = bytes(got.value)
        else:
            self._fd = os.open(path, os.O_RDONLY)

    def preadv(self, buffers: list[memoryview], offset: int) -> int:
        """Reads into ``buffers`` (one after another) from byte ``offset``; the bytes read."""
        if self._fd is not None:
            return os.preadv(self._fd, buffers, offset)
        assert self._data is not None, "read after close"
        at = offset
        for b in buffers:
            n = max(0, min(len(b), len(self._data) - at))
            b[:n] = self._data[at : at + n]
            at += n
            if n < len(b):
                break
        return at - offset

    def size(self) -> int:
        if self._fd is not None:
            return os.fstat(self._fd).st_size
        assert self._data is not None, "read after close"
        return len(self._data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._data = None


class Writer:
    """Positioned writes into a file made at its full size (:func:`create_file`), by every
    rank at once; ``close`` makes them durable. A filesystem's only: an object is written
    whole, by one writer."""

    def __init__(self, path: str) -> None:
        if is_object(path):
            raise ValueError(
                f"{path}: positioned writes by several ranks need a filesystem; an object "
                "store takes whole objects (fs.save writes there, export_safetensors does not)"
            )
        self.path = path
        self._fd = os.open(path, os.O_WRONLY)

    def pwrite_all(self, data: memoryview, at: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], at + done)

    def close(self, *, sync: bool = True) -> None:
        if self._fd is None:
            return
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None


def create_file(path: str, head: bytes, size: int) -> None:
    """A file of ``size`` bytes starting with ``head`` (the rest zeros, sparse where it can)."""
    if is_object(path):
        raise ValueError(f"{path}: files written at positions by several ranks need a filesystem")
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def write_stream(path: str, parts) -> None:
    """Writes the byte buffers ``parts`` one after another at ``path``, durably; one part in
    memory at a time on a filesystem, the object assembled whole on a store."""
    if is_object(path):
        write_bytes(path, b"".join(bytes(p) for p in parts))
        return
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())


def isfile(path: str) -> bool:
    if not is_object(path):
        return os.path.isfile(path)
    store, key = _object(path)
    got = _result(store.read(key, byte_range=slice(0, 0)), path, "reading")
    return got.state == "value"


def open_reader(path: str) -> Reader:
    """A :class:`Reader` of ``path``; FileNotFoundError when it is not there."""
    return Reader(path)


# --- the background writer's priority -------------------------------------------------------

BACKGROUND_NICE = 19


def yield_to_compute() -> None:
    """Lowers the CPU priority of the calling thread (a background save's writer) and of
    tensorstore's worker threads, which do its copies and system calls, to
    ``BACKGROUND_NICE``, so that a write in flight takes the cores the training step leaves
    idle rather than time from the step. Linux only (threads found under
    ``/proc/self/task``); a no-op elsewhere, and for a thread already at that nice or above.

    An unprivileged process cannot raise a thread's priority again: tensorstore's workers stay
    at this priority for the process's life, so on a busy CPU a synchronous save or a restore
    after a background save yields to other work too (on an idle one it runs as fast).
    """
    if not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"):
        return
    tids = [threading.get_native_id()]
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ts_pool"):  # tensorstore's ts_pool_worker
                    tids.append(int(tid))
        except OSError:  # the thread has exited
            continue
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
        except OSError:
            continue
