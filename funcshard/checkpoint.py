"""Checkpoints in Orbax's on-disk format, written and read shard by shard with tensorstore.

A checkpoint is what ``orbax.checkpoint.PyTreeCheckpointer`` writes with ``use_ocdbt=False``:
one zarr (v2) array per leaf in ``<dir>/<key.key...>/``, the tree in ``_METADATA``,
``_CHECKPOINT_METADATA``, ``commit_success.txt``. A plain JAX process restores it with no
target and gets::

    {"params": {name: full master array}, "opt_state": {"count": int, "mu": {...}, ...},
     "step": int, "loss_scale": {"scale": float, "good_steps": int}}   # loss_scale: fp16 only

Writing: the zarr chunk grid is aligned to the rows each rank owns (a chunk never straddles
two writers), so every rank writes its own real rows of each array straight from its shard,
in parallel, and nothing is gathered. Under HSDP only replica 0 writes (the replicas hold the
same shards); under ``no_shard`` the ranks split the rows among themselves. The directory is
written under ``<dir>.orbax-checkpoint-tmp-<ns>``; after every rank has agreed that its part
is durable, rank 0 writes the metadata and renames it into place.

Reading: every rank reads exactly the rows its target layout needs (any world size, mesh,
strategy, offload fraction), and the state is rebuilt from the masters read: compute copies,
CPU copies and the optimizer state all derive from the checkpoint, none from ``like``.

The collectives of checkpointing (one broadcast and two small all-reduces per save, one per
restore) run on a gloo group of their own, so an asynchronous save may run them in a
background thread while training runs its collectives on the mesh's groups.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch
import torch.distributed as dist

from funcshard import mesh as mesh_lib
from funcshard import sharding as shard_lib
from funcshard.buckets import is_per_bucket
from funcshard.layout import Bucket, Layout, LeafSpec
from funcshard.state import LossScale, TrainState, derive_compute

__all__ = [
    "save",
    "restore",
    "wait",
    "CheckpointManager",
    "CheckpointMismatchError",
    "IOStats",
    "io_stats",
]

FORMAT_VERSION = 1
CHUNK_BYTES = 64 << 20  # target size of one zarr chunk
READ_THREADS = 4
TMP_MARK = ".orbax-checkpoint-tmp-"
DELETE_MARK = ".orbax-checkpoint-deleting-"
COMMIT_FILE = "commit_success.txt"
ORBAX_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"

Keys = tuple[str, ...]


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the target state; the message lists every mismatch."""


# --- dtypes --------------------------------------------------------------------------------

_ZARR_DTYPE = {
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.float16: "<f2",
    torch.bfloat16: "bfloat16",
}
_TORCH_FROM_NUMPY = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a: np.ndarray, where: str) -> torch.Tensor:
    dtype = _TORCH_FROM_NUMPY.get(a.dtype)
    if dtype is None:
        raise TypeError(f"{where}: expected a floating array, found dtype {a.dtype}")
    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# --- byte accounting ------------------------------------------------------------------------


@dataclasses.dataclass
class IOStats:
    """Array bytes moved by checkpoint reads and writes on this rank inside ``io_stats()``."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0


_IO: list[IOStats] = []


@contextlib.contextmanager
def io_stats() -> Iterator[IOStats]:
    """Counts the array bytes this rank reads and writes in checkpoints inside the block."""
    stats = IOStats()
    _IO.append(stats)
    try:
        yield stats
    finally:
        _IO.remove(stats)


def _count(read: bool, nbytes: int) -> None:
    for s in list(_IO):
        if read:
            s.bytes_read += nbytes
            s.reads += 1
        else:
            s.bytes_written += nbytes
            s.writes += 1


# --- the checkpoint's own process group -----------------------------------------------------

_GROUPS: dict[int, dist.ProcessGroup] = {}


def _group() -> dist.ProcessGroup:
    """A gloo group over the whole world, for checkpoint collectives only (created once)."""
    if not dist.is_initialized():
        raise RuntimeError("checkpoints are collective: torch.distributed must be initialized")
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


def _failed_ranks(ok: bool, group: dist.ProcessGroup) -> list[int]:
    """All-reduces one success flag per rank; returns the ranks that failed (all ranks agree)."""
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32)
    flags[dist.get_rank(group)] = 0 if ok else 1
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _raise_if_failed(what: str, error: BaseException | None, group: dist.ProcessGroup) -> None:
    failed = _failed_ranks(error is None, group)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; see their errors")


# --- the tree of a state --------------------------------------------------------------------


def _is_bucket_tuple(x: Any, n_buckets: int) -> bool:
    return is_per_bucket(x) and len(x) == n_buckets


def _map_opt(
    x: Any,
    n_buckets: int,
    on_buckets: Callable[[Keys, tuple], Any],
    on_scalar: Callable[[Keys, Any], Any],
    path: Keys = (),
) -> Any:
    """Rebuilds an optimizer state, calling back on each per-bucket tuple and each scalar."""
    rec = lambda v, k: _map_opt(v, n_buckets, on_buckets, on_scalar, (*path, str(k)))
    if _is_bucket_tuple(x, n_buckets):
        return on_buckets(path, x)
    if x is None:
        return None
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(rec(getattr(x, f), f) for f in x._fields))
    if isinstance(x, (bool, int, float)):
        return on_scalar(path, x)
    if isinstance(x, (tuple, list)):
        return type(x)(rec(v, i) for i, v in enumerate(x))
    if isinstance(x, dict):
        return {k: rec(v, k) for k, v in x.items()}
    where = ".".join(("opt_state", *path))
    raise TypeError(f"{where}: cannot checkpoint a {type(x).__name__}")


def _opt_layout(opt_state: Any, n_buckets: int) -> tuple[dict[Keys, Any], dict[Keys, Any]]:
    """The per-bucket parts by path and the scalars (with values) of an optimizer state."""
    arrays: dict[Keys, Any] = {}
    scalars: dict[Keys, Any] = {}
    _map_opt(opt_state, n_buckets, lambda p, x: arrays.__setitem__(p, x),
             lambda p, x: scalars.__setitem__(p, x))
    return arrays, scalars


def _owned_leaves(layout: Layout, part: Any) -> list:
    """The leaves a per-bucket part holds values for (a None entry holds none)."""
    return [s for b, x in zip(layout.buckets, part, strict=True) if x is not None
            for s in layout.bucket_leaves(b)]


def _opt_kind(opt_state: Any) -> str:
    return type(opt_state).__name__


# --- writing --------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _chunk_rows(piece_rows: int, row_bytes: int) -> int:
    """Rows per chunk: a divisor of the rows one writer owns, so no chunk has two writers.

    The largest divisor whose chunk fits ``CHUNK_BYTES``; when only tiny ones fit (a prime
    row count), the divisor nearest to ``CHUNK_BYTES`` in ratio, so a chunk may exceed it.
    """
    if piece_rows <= 1 or piece_rows * row_bytes <= CHUNK_BYTES:
        return max(piece_rows, 1)
    divs = _divisors(piece_rows)
    fitting = [d for d in divs if d * row_bytes <= CHUNK_BYTES]
    if fitting and fitting[-1] * row_bytes * 8 >= CHUNK_BYTES:
        return fitting[-1]
    return min(divs, key=lambda d: abs(math.log(d * row_bytes / CHUNK_BYTES)))


@dataclasses.dataclass(frozen=True, slots=True)
class _Writers:
    """How the rows of every array split among the writing ranks."""

    parts: int  # writers per array
    index: int  # this rank's writer index
    active: bool  # False on replicas that write nothing

    @classmethod
    def of(cls, layout: Layout) -> _Writers:
        mesh = layout.mesh
        if layout.strategy == "no_shard":  # every rank holds everything: split the rows
            shard = mesh_lib.axis_size(mesh, "shard")
            index = (mesh_lib.axis_rank(mesh, "replicate") * shard
                     + mesh_lib.axis_rank(mesh, "shard"))
            return cls(layout.dp_size, index, True)
        return cls(layout.shard_size, layout.shard_rank,
                   mesh_lib.axis_rank(mesh, "replicate") == 0)

    def rows(self, spec: LeafSpec) -> tuple[int, int, int]:
        """``(start, stop, chunk_rows)`` of ``spec``'s rows this writer writes."""
        piece = -(-spec.rows // self.parts)
        start = min(self.index * piece, spec.rows) if self.active else spec.rows
        stop = min(start + piece, spec.rows)
        row_bytes = spec.row_numel * spec.dtypes.master.itemsize
        return start, stop, _chunk_rows(piece, row_bytes)


@dataclasses.dataclass(slots=True)
class _ArrayWrite:
    keys: Keys
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk_rows: int
    start: int
    stop: int
    data: torch.Tensor | None  # rows [start, stop); None when this rank writes none


def _zarr_metadata(shape: tuple[int, ...], dtype: torch.dtype, chunk_rows: int) -> dict:
    chunks = [chunk_rows, *(max(d, 1) for d in shape[1:])] if shape else []
    return {"zarr_format": 2, "shape": list(shape), "chunks": chunks,
            "dtype": _ZARR_DTYPE[dtype], "compressor": None, "fill_value": None,
            "filters": None, "order": "C", "dimension_separator": "."}


def _param_dir(keys: Keys) -> str:
    return ".".join(keys)  # orbax's name for a leaf's directory


def _plan(state: TrainState, stage: bool) -> tuple[list[_ArrayWrite], dict[Keys, Any]]:
    """What this rank writes: its rows of every array, and (all ranks know them) the scalars."""
    layout = state.layout
    writers = _Writers.of(layout)
    r = layout.shard_rank
    n = len(layout.buckets)

    def rows_of(flats: tuple[torch.Tensor, ...], prefix: Keys) -> list[_ArrayWrite]:
        out = []
        for bucket, flat in zip(layout.buckets, flats, strict=True):
            if flat is None:
                continue
            for spec in layout.bucket_leaves(bucket):
                start, stop, chunk = writers.rows(spec)
                data = None
                if stop > start:
                    lo = spec.row_range(r)[0]
                    view = shard_lib.rows_view(flat, spec, r)[start - lo : stop - lo]
                    data = view.detach().to("cpu", copy=True) if stage else view.detach()
                out.append(_ArrayWrite((*prefix, spec.name), spec.shape, flat.dtype, chunk,
                                       start, stop, data))
        return out

    arrays = rows_of(state.master, ("params",))
    _map_opt(state.opt_state, n, lambda p, x: arrays.extend(rows_of(x, ("opt_state", *p))),
             lambda p, x: x)
    scalars = {("opt_state", *p): v for p, v in _opt_layout(state.opt_state, n)[1].items()}
    scalars[("step",)] = int(state.step)
    if state.loss_scale is not None:
        scalars[("loss_scale", "scale")] = float(state.loss_scale.scale)
        scalars[("loss_scale", "good_steps")] = int(state.loss_scale.good_steps)
    order = {n: i for i, n in enumerate(layout.names)}
    arrays.sort(key=lambda a: (a.keys[:-1], order[a.keys[-1]]))
    return arrays, scalars


def _settle(futures: list[Any]) -> list[Any]:
    """Waits for every future, then raises the first error: nothing is still writing after."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:  # noqa: BLE001 - raised once all have finished
            results.append(None)
            error = error or e
    if error is not None:
        raise error
    return results


def _scalar_spec(path: str, value: int | float) -> dict:
    dtype = "<i8" if isinstance(value, int) else "<f8"
    return {"driver": "zarr", "create": True, "kvstore": {"driver": "file", "path": path},
            "metadata": {"zarr_format": 2, "shape": [], "chunks": [], "dtype": dtype,
                         "compressor": None, "fill_value": None, "filters": None,
                         "order": "C", "dimension_separator": "."}}


def _write_arrays(tmp: str, arrays: list[_ArrayWrite], scalars: dict[Keys, Any],
                  is_first: bool) -> None:
    """Writes this rank's rows (and, on the first rank, array metadata and scalars) durably.

    Returns or raises only once every write it started has finished, so that a failed save's
    directory can be removed without a late write recreating files in it.
    """
    ctx = ts.Context()
    specs, sources = [], []
    for a in arrays:
        if a.data is None and not is_first:
            continue
        spec = {"driver": "zarr", "kvstore": {"driver": "file",
                                              "path": os.path.join(tmp, _param_dir(a.keys))},
                "metadata": _zarr_metadata(a.shape, a.dtype, a.chunk_rows)}
        # one rank writes each .zarray; the others only write their chunks
        spec.update({"create": True} if is_first else {"open": True, "assume_metadata": True})
        specs.append(spec)
        sources.append(a)
    if is_first:
        for keys, value in scalars.items():
            spec = _scalar_spec(os.path.join(tmp, _param_dir(keys)), value)
            specs.append(spec)
            sources.append(np.asarray(value, dtype=np.dtype(spec["metadata"]["dtype"])))
    opened = _settle([ts.open(spec, context=ctx) for spec in specs])
    writes = []
    for source, arr in zip(sources, opened, strict=True):
        if isinstance(source, np.ndarray):
            writes.append(arr.write(source))
        elif source.data is not None:
            src = _to_numpy(source.data)
            target = arr[source.start : source.stop] if source.shape else arr
            writes.append(target.write(src.reshape(target.shape)))
            _count(False, src.nbytes)
    _settle(writes)


def _leaf_metadata(keys: Keys, value_type: str) -> dict:
    return {"key_metadata": [{"key": k, "key_type": 2} for k in keys],
            "value_metadata": {"value_type": value_type, "skip_deserialize": False}}


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_metadata(tmp: str, final: str, arrays: list[_ArrayWrite], scalars: dict[Keys, Any],
                    info: dict, started_ns: int) -> None:
    tree = {str(a.keys): _leaf_metadata(a.keys, "np.ndarray") for a in arrays}
    tree.update({str(k): _leaf_metadata(k, "scalar") for k in scalars})
    _write_json(os.path.join(tmp, "_METADATA"), {
        "tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None,
    })
    _write_json(os.path.join(tmp, "_CHECKPOINT_METADATA"), {
        "item_handlers": ORBAX_HANDLER, "metrics": {}, "performance_metrics": {},
        "init_timestamp_nsecs": started_ns, "commit_timestamp_nsecs": time.time_ns(),
        "custom_metadata": {"funcshard": info},
    })
    with open(os.path.join(tmp, COMMIT_FILE), "w") as f:
        f.write(f"Checkpoint commit was successful to {os.path.basename(final)}")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _info(state: TrainState) -> dict:
    layout = state.layout
    return {
        "version": FORMAT_VERSION,
        "optimizer": _opt_kind(state.opt_state),
        "opt_arrays": [list(p) for p in _opt_layout(state.opt_state, len(layout.buckets))[0]],
        "strategy": layout.strategy,
        "mesh": list(layout.mesh.shape),
        "step": int(state.step),
    }


def _remove_tree(path: str) -> None:
    """Removes ``path`` if it exists; a failure to remove is logged, never raised over the
    error that made the removal necessary."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning("funcshard.checkpoint: could not remove %s: %s", path, e)


def _is_leftover(name: str, base: str | None = None) -> bool:
    """A save's temporary or a removal's doomed directory (of step ``base``, or of any)."""
    for mark in (TMP_MARK, DELETE_MARK):
        head, sep, _ = name.partition(mark)
        if sep and (head == base if base is not None else True):
            return True
    return False


def _remove_stale(final: str) -> None:
    parent, base = os.path.split(final)
    for name in os.listdir(parent):
        if _is_leftover(name, base):
            _remove_tree(os.path.join(parent, name))


def _start(final: str, group: dist.ProcessGroup) -> str:
    """Rank 0 creates the temporary directory; every rank learns its name (or the error)."""
    msg: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            if os.path.exists(final):
                raise FileExistsError(f"save: {final} already exists")
            os.makedirs(os.path.dirname(final), exist_ok=True)
            _remove_stale(final)
            tmp = f"{final}{TMP_MARK}{time.time_ns()}"
            os.makedirs(tmp)
            msg = [("ok", tmp)]
        except OSError as e:
            msg = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(msg, group_src=0, group=group)
    kind, value = msg[0]
    if kind != "ok":
        raise OSError(value)
    return value


@dataclasses.dataclass
class _Job:
    """One save: what to write, and what to run on rank 0 once it is committed."""

    final: str
    tmp: str
    arrays: list[_ArrayWrite]
    scalars: dict[Keys, Any]
    info: dict
    started_ns: int
    after_commit: Callable[[], None] | None = None

    def run(self, group: dist.ProcessGroup) -> None:
        first = dist.get_rank(group) == 0
        error: BaseException | None = None
        try:
            _write_arrays(self.tmp, self.arrays, self.scalars, first)
        except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
            error = e
        failed = _failed_ranks(error is None, group)
        if failed:
            if first:  # nothing of a failed save stays behind
                _remove_tree(self.tmp)
            raise error or RuntimeError(f"save to {self.final}: writing failed on rank(s) "
                                        f"{failed}; see their errors")
        error = None
        if first:
            try:
                _write_metadata(self.tmp, self.final, self.arrays, self.scalars, self.info,
                                self.started_ns)
                os.rename(self.tmp, self.final)
                _fsync_dir(os.path.dirname(self.final))
                if self.after_commit is not None:
                    self.after_commit()
            except BaseException as e:  # noqa: BLE001
                error = e
                if not os.path.exists(os.path.join(self.final, COMMIT_FILE)):
                    _remove_tree(self.tmp)  # not committed: nothing of it stays behind
        _raise_if_failed(f"save to {self.final}: commit", error, group)


class _Background:
    """The one asynchronous save in flight in this process, if any."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.final: str | None = None

    def start(self, job: _Job, group: dist.ProcessGroup) -> None:
        def target() -> None:
            try:
                job.run(group)
            except BaseException as e:  # noqa: BLE001 - raised on the next wait()
                self.error = e

        self.final = job.final
        self.thread = threading.Thread(target=target, name="funcshard-checkpoint", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(f"asynchronous save to {self.final} failed") from error


_BACKGROUND = _Background()


def wait() -> None:
    """Waits for this process's asynchronous save, if any; raises if it failed."""
    _BACKGROUND.wait()


@atexit.register
def _wait_at_exit() -> None:
    if _BACKGROUND.thread is not None:
        _BACKGROUND.wait()


def save(directory: str | os.PathLike, state: TrainState, *, async_: bool = False,
         _after_commit: Callable[[], None] | None = None) -> None:
    """Writes ``state`` as one Orbax checkpoint at ``directory`` (collective).

    Every rank writes its own rows of each array; the directory appears only when complete.

    Args:
      directory: where the checkpoint goes; must not exist.
      state: the state to save (not consumed).
      async_: stage this rank's rows in host memory, return at once and write in a background
        thread; the save is awaited by the next ``save``/``restore``/``wait()`` and at exit,
        which raise if it failed.

    Raises:
      RuntimeError: the state holds no values, or writing failed on some rank (on every rank).
      OSError: ``directory`` exists or cannot be created.
    """
    state._check()
    if not state.filled:
        raise RuntimeError("save: the state holds no values (built from a meta-device model); "
                           "fill it with fs.restore(..., model_only=True) first")
    wait()
    group = _group()
    final = os.path.abspath(os.fspath(directory))
    started = time.time_ns()
    arrays, scalars = _plan(state, stage=async_)
    tmp = _start(final, group)
    job = _Job(final, tmp, arrays, scalars, _info(state), started, _after_commit)
    if async_:
        _BACKGROUND.start(job, group)
    else:
        job.run(group)


# --- reading --------------------------------------------------------------------------------


class _Source(Protocol):
    """Where ``_rebuild`` reads from: arrays by keys (row ranges of dim 0) and scalars."""

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        """Every array's keys -> (shape, dtype name)."""

    def scalars(self) -> set[Keys]: ...

    def read_rows(self, requests: Sequence[tuple[Keys, int, int]]) -> list[torch.Tensor]:
        """Rows ``[start, stop)`` of each requested array (a 0-d array: the whole, as 1 row)."""

    def read_scalar(self, keys: Keys) -> Any: ...


def _read_json(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"restore: {path} is not valid JSON ({e}); the checkpoint is "
                         "damaged") from None
    if not isinstance(obj, dict):
        raise ValueError(f"restore: {path} holds a JSON {type(obj).__name__}, expected an "
                         "object; the checkpoint is damaged")
    return obj


class _TensorstoreSource:
    """An Orbax checkpoint directory (zarr or OCDBT, zarr v2 or v3), read with tensorstore."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        meta_path = os.path.join(directory, "_METADATA")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"restore: {directory} holds no Orbax checkpoint "
                                    "(no _METADATA)")
        meta = _read_json(meta_path)
        self.use_ocdbt = bool(meta.get("use_ocdbt", False))
        self.driver = "zarr3" if meta.get("use_zarr3", False) else "zarr"
        self.value_types: dict[Keys, str] = {}
        for entry in meta["tree_metadata"].values():
            keys = tuple(str(k["key"]) for k in entry["key_metadata"])
            self.value_types[keys] = entry["value_metadata"]["value_type"]
        ckpt_meta = os.path.join(directory, "_CHECKPOINT_METADATA")
        custom = _read_json(ckpt_meta).get("custom_metadata") if os.path.exists(ckpt_meta) else {}
        self.info: dict | None = (custom or {}).get("funcshard")
        self.ctx = ts.Context()
        self._open: dict[Keys, ts.TensorStore] = {}

    def _spec(self, keys: Keys) -> dict:
        name = _param_dir(keys)
        if self.use_ocdbt:
            kv = {"driver": "ocdbt", "base": f"file://{self.directory}/", "path": name}
        else:
            kv = {"driver": "file", "path": os.path.join(self.directory, name)}
        spec = {"driver": self.driver, "kvstore": kv, "open": True}
        if self.info is not None:
            # funcshard writes every chunk, so a missing one is damage, not the fill value
            spec["fill_missing_data_reads"] = False
        return spec

    def open_many(self, keys: Sequence[Keys]) -> None:
        todo = [k for k in keys if k not in self._open]
        futs = [(k, ts.open(self._spec(k), context=self.ctx, read=True)) for k in todo]
        for k, f in futs:
            self._open[k] = f.result()

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        # a 0-d param may be stored as an Orbax "scalar": it is a 0-d zarr array all the same
        keys = [k for k, v in self.value_types.items() if v != "scalar" or k[:1] == ("params",)]
        self.open_many(keys)
        return {k: (tuple(self._open[k].shape), str(self._open[k].dtype.name)) for k in keys}

    def scalars(self) -> set[Keys]:
        return {k for k, v in self.value_types.items() if v == "scalar" and k[:1] != ("params",)}

    def _row_ranges(self, keys: Keys) -> tuple[int, str] | None:
        """``(chunk_rows, separator)`` when rows can be read as byte ranges of chunk files.

        That is an uncompressed C-order zarr v2 array chunked along dim 0 only (what
        ``save`` writes): a row range is then one contiguous byte range per chunk, and only
        the rows asked for are read, not whole chunks.
        """
        arr = self._open[keys]
        md = arr.spec().to_json().get("metadata", {})
        simple = (self.driver == "zarr" and arr.ndim > 0 and md.get("compressor") is None
                  and not md.get("filters") and md.get("order") == "C"
                  and not str(md.get("dtype", ">")).startswith(">")
                  and list(md.get("chunks", [])[1:]) == list(md.get("shape", [])[1:]))
        return (md["chunks"][0], md.get("dimension_separator", ".")) if simple else None

    def _read_ranges(self, keys: Keys, start: int, stop: int) -> np.ndarray | None:
        """Rows ``[start, stop)`` read as byte ranges of the chunk files, or None if the
        array is not laid out for it. Local files are read straight into the result."""
        layout = self._row_ranges(keys)
        if layout is None:
            return None
        chunk, sep = layout
        arr = self._open[keys]
        out = np.empty((stop - start, *arr.shape[1:]), dtype=arr.dtype.numpy_dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        row_bytes = math.prod(arr.shape[1:]) * out.itemsize
        suffix = (sep + "0") * (arr.ndim - 1)
        kv = arr.kvstore
        local = kv.spec().to_json().get("driver") == "file"
        at = 0
        for k in range(start // chunk, (stop - 1) // chunk + 1):
            lo, hi = max(start, k * chunk) - k * chunk, min(stop, (k + 1) * chunk) - k * chunk
            n = (hi - lo) * row_bytes
            if local:
                try:
                    fd = os.open(os.path.join(kv.path, f"{k}{suffix}"), os.O_RDONLY)
                except FileNotFoundError:
                    if self.info is not None:  # funcshard writes every chunk: data was lost
                        raise FileNotFoundError(f"{self.directory}: chunk {k} of "
                                                f"{_param_dir(keys)} is missing") from None
                    return None  # Orbax may omit chunks equal to the fill value
                try:
                    got = os.preadv(fd, [buf[at : at + n]], lo * row_bytes)
                finally:
                    os.close(fd)
            else:
                res = kv.read(f"{k}{suffix}", byte_range=slice(lo * row_bytes, hi * row_bytes))
                res = res.result()
                if res.state != "value":
                    return None
                got = len(res.value)
                buf[at : at + got] = res.value
            if got != n:
                raise OSError(f"{_param_dir(keys)}: chunk {k} is short ({got} of {n} bytes)")
            at += n
        return out

    def _read_one(self, keys: Keys, start: int, stop: int) -> np.ndarray:
        arr = self._open[keys]
        if not arr.ndim:
            return np.asarray(arr.read().result())
        a = self._read_ranges(keys, start, stop)
        return a if a is not None else np.asarray(arr[start:stop].read().result())

    def read_rows(self, requests: Sequence[tuple[Keys, int, int]]) -> list[torch.Tensor]:
        self.open_many([k for k, _, _ in requests])
        with concurrent.futures.ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            arrays = list(pool.map(lambda r: self._read_one(*r), requests))
        out = []
        for (keys, _, _), a in zip(requests, arrays, strict=True):
            _count(True, a.nbytes)
            out.append(_to_torch(a.reshape(-1, *a.shape[1:]) if a.ndim else a.reshape(1),
                                 _param_dir(keys)))
        return out

    def read_scalar(self, keys: Keys) -> Any:
        self.open_many([keys])
        return np.asarray(self._open[keys].read().result()).item()


class _DictSource:
    """Full tensors in memory, keyed like the checkpoint tree (e.g. a seed from one rank)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.tensors = {("params", n): t.detach() for n, t in params.items()}
        self.info = None

    def arrays(self) -> dict[Keys, tuple[tuple[int, ...], str]]:
        return {k: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                for k, t in self.tensors.items()}

    def scalars(self) -> set[Keys]:
        return set()

    def read_rows(self, requests: Sequence[tuple[Keys, int, int]]) -> list[torch.Tensor]:
        out = []
        for keys, start, stop in requests:
            t = self.tensors[keys]
            out.append(t[start:stop] if t.dim() else t.reshape(1))
        return out

    def read_scalar(self, keys: Keys) -> Any:
        raise KeyError(keys)


def _mismatches(like: TrainState, source: _Source, model_only: bool) -> list[str]:
    """Every way the checkpoint does not fit ``like`` (empty when it fits)."""
    layout = like.layout
    found = source.arrays()
    problems = []
    expected: dict[Keys, tuple[int, ...]] = {("params", s.name): s.shape for s in layout.leaves}
    if not model_only:
        paths, scalars = _opt_layout(like.opt_state, len(layout.buckets))
        for p, part in paths.items():
            expected.update({("opt_state", *p, s.name): s.shape
                             for s in _owned_leaves(layout, part)})
        info = source.info
        kind = _opt_kind(like.opt_state)
        if info is None:
            problems.append("optimizer: the checkpoint was not written by funcshard (no "
                            "optimizer state it can map); restore it with model_only=True")
        elif info.get("optimizer") != kind:
            problems.append(f"optimizer: the checkpoint holds {info.get('optimizer')}, "
                            f"the target state has {kind}")
        have_scalars = source.scalars()
        for p in [("opt_state", *p) for p in scalars] + [("step",)]:
            if p not in have_scalars:
                problems.append(f"{_param_dir(p)}: missing from the checkpoint")
    for keys, shape in expected.items():
        if keys not in found:
            problems.append(f"{_param_dir(keys)}: missing from the checkpoint "
                            f"(expected shape {shape})")
            continue
        got_shape, got_dtype = found[keys]
        if got_shape != shape:
            problems.append(f"{_param_dir(keys)}: shape {got_shape} in the checkpoint, "
                            f"expected {shape}")
        if got_dtype not in ("float32", "float64", "float16", "bfloat16"):
            problems.append(f"{_param_dir(keys)}: dtype {got_dtype} in the checkpoint, "
                            "expected a floating dtype")
    prefixes = {("params",)} | ({("opt_state", *p) for p in paths} if not model_only else set())
    for keys in found:
        if keys[:-1] in prefixes and keys not in expected:
            problems.append(f"{_param_dir(keys)}: in the checkpoint but not in the target "
                            "state")
        elif keys[:1] == ("opt_state",) and not model_only and keys[:-1] not in prefixes:
            problems.append(f"{_param_dir(keys)}: optimizer state the target optimizer lacks")
    return problems


def _flat_like(old: torch.Tensor, bucket: Bucket, layout: Layout,
               dtype: torch.dtype) -> torch.Tensor:
    """A zeroed flat for ``bucket``: ``like``'s own buffer when it has one (it is consumed)."""
    if not old.is_meta and old.numel() == bucket.numel and old.dtype == dtype:
        return old.zero_()
    device = torch.device("cpu") if bucket.offload else layout.device
    flat = torch.zeros(bucket.numel, dtype=dtype, device=device)
    if bucket.offload and layout.device.type == "cuda":
        flat = flat.pin_memory()
    return flat


def _fill(flats: Sequence[torch.Tensor], layout: Layout, source: _Source, prefix: Keys) -> None:
    """Copies this rank's real rows of every leaf from ``source`` into the bucket flats."""
    r = layout.shard_rank
    for bucket, flat in zip(layout.buckets, flats, strict=True):
        if flat is None:
            continue
        specs = [s for s in layout.bucket_leaves(bucket) if s.row_range(r)[1] > s.row_range(r)[0]]
        rows = source.read_rows([((*prefix, s.name), *s.row_range(r)) for s in specs])
        for spec, t in zip(specs, rows, strict=True):
            view = shard_lib.local_view(flat, spec, r)
            view.copy_(t.reshape(view.shape))


@dataclasses.dataclass
class _Read:
    """What ``_read`` produced: every leaf of the new state but the derived compute copies."""

    like: TrainState
    master: tuple[torch.Tensor, ...]
    opt_state: Any
    step: int
    loss_scale: LossScale | None

    def assemble(self) -> TrainState:
        """The new state (``derive_compute`` is a collective under ZeRO 1-2)."""
        layout = self.like.layout
        return TrainState(master=self.master, compute=derive_compute(layout, self.master),
                          opt_state=self.opt_state, step=self.step,
                          loss_scale=self.loss_scale, static=self.like._static)


def _read(like: TrainState, source: _Source, *, model_only: bool) -> _Read:
    """Reads every leaf for ``like``'s layout from ``source``, with no collectives.

    Masters are read (cast to the master dtype); with ``model_only`` the optimizer state is
    ``like.optimizer.init(master)`` and the step 0, otherwise both are read too. ``like``'s
    buffers are reused where they fit (it is consumed).
    """
    layout = like.layout
    n = len(layout.buckets)
    old_master, old_opt = like._master, like._opt_state
    like._consume("restore")
    master = tuple(_flat_like(old, b, layout, b.dtypes.master)
                   for old, b in zip(old_master, layout.buckets, strict=True))
    _fill(master, layout, source, ("params",))
    if model_only:
        opt_state = like.optimizer.init(layout.per_bucket(master))
        step = 0
    else:
        def buckets(path: Keys, olds: tuple) -> tuple:
            flats = layout.per_bucket(None if o is None else _flat_like(o, b, layout, o.dtype)
                                      for o, b in zip(olds, layout.buckets, strict=True))
            _fill(flats, layout, source, ("opt_state", *path))
            return flats

        opt_state = _map_opt(old_opt, n, buckets,
                             lambda p, x: type(x)(source.read_scalar(("opt_state", *p))))
        step = int(source.read_scalar(("step",)))
    loss_scale = like._loss_scale
    if loss_scale is not None:
        loss_scale = LossScale(float(layout.policy.loss_scale_init), 0)
        if not model_only and ("loss_scale", "scale") in source.scalars():
            loss_scale = LossScale(float(source.read_scalar(("loss_scale", "scale"))),
                                   int(source.read_scalar(("loss_scale", "good_steps"))))
    return _Read(like, master, opt_state, step, loss_scale)


def _rebuild(like: TrainState, source: _Source, *, model_only: bool) -> TrainState:
    """A state for ``like``'s layout whose every buffer derives from ``source``'s values."""
    return _read(like, source, model_only=model_only).assemble()


def rebuild_from_params(like: TrainState, params: dict[str, torch.Tensor]) -> TrainState:
    """``like`` rebuilt from full parameter tensors (any float dtype), fresh optimizer state.

    The in-memory twin of ``restore(..., model_only=True)``; consumes ``like``.
    """
    source = _DictSource(params)
    problems = _mismatches(like, source, model_only=True)
    if problems:
        raise CheckpointMismatchError("params do not fit the target state:\n  "
                                      + "\n  ".join(problems))
    return _rebuild(like, source, model_only=True)


def restore(directory: str | os.PathLike, *, like: TrainState,
            model_only: bool = False) -> TrainState:
    """Reads a checkpoint into ``like``'s layout (collective; donates ``like``: it and every
    state sharing a buffer with it raise ``ConsumedStateError`` afterwards).

    Each rank reads only the rows its shards need; the mesh, strategy, policy and offload
    fraction may all differ from those at save time.

    Args:
      directory: a funcshard checkpoint, or with ``model_only`` any Orbax checkpoint whose
        "params" tree is keyed by parameter names (zarr or OCDBT).
      like: a state from ``fs.init`` for the target layout (may be unfilled, from a
        meta-device model). Only its structure is used; it is consumed.
      model_only: read only "params" and start a fresh optimizer state at step 0.

    Returns:
      The restored state; every buffer derives from the checkpoint's masters.

    Raises:
      CheckpointMismatchError: on every rank, listing every mismatched name, shape, dtype or
        optimizer kind (``like`` is then left usable).
      RuntimeError: reading failed on some rank (raised on every rank).
    """
    like._check()
    wait()
    group = _group()
    path = os.path.abspath(os.fspath(directory))
    error: BaseException | None = None
    try:
        source = _TensorstoreSource(path)
        problems = _mismatches(like, source, model_only)
        if problems:
            raise CheckpointMismatchError(f"checkpoint {path} does not fit the target state:\n  "
                                          + "\n  ".join(problems))
    except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
        error = e
    _raise_if_failed(f"restore from {path}: checking", error, group)
    try:
        result = _read(like, source, model_only=model_only)
    except BaseException as e:  # noqa: BLE001
        error = e
    _raise_if_failed(f"restore from {path}: reading", error, group)
    return result.assemble()


# --- manager --------------------------------------------------------------------------------

_STEP_DIR = re.compile(r"^\d+$")


class CheckpointManager:
    """Numbered checkpoints ``root/<step>/`` with retention and asynchronous saves.

    An incomplete step (still under its temporary name, or without ``commit_success.txt``) is
    never listed; retention keeps the ``max_to_keep`` highest steps and never deletes the
    latest one nor the one just written.
    """

    def __init__(self, root: str | os.PathLike, max_to_keep: int | None = 3, *,
                 async_save: bool = True) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"CheckpointManager: max_to_keep must be >= 1 or None, "
                             f"got {max_to_keep}")
        self.root = os.path.abspath(os.fspath(root))
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        os.makedirs(self.root, exist_ok=True)

    def _dir(self, step: int) -> str:
        return os.path.join(self.root, str(int(step)))

    def _complete_steps(self) -> list[int]:
        steps = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if _STEP_DIR.match(name) and os.path.exists(os.path.join(path, COMMIT_FILE)):
                steps.append(int(name))
        return sorted(steps)

    def all_steps(self) -> list[int]:
        """The complete steps, ascending (waits for an asynchronous save first)."""
        self.wait()
        return self._complete_steps()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _sweep(self) -> None:
        """Removes what killed saves and removals left behind (rank 0, between saves: the
        save in flight, if any, has just been committed)."""
        for name in os.listdir(self.root):
            if _is_leftover(name) and _STEP_DIR.match(name.split(".", 1)[0]):
                _remove_tree(os.path.join(self.root, name))

    def _retain(self, just_saved: int) -> None:
        self._sweep()
        if self.max_to_keep is None:
            return
        steps = self._complete_steps()
        keep = set(steps[-self.max_to_keep :]) | {just_saved}
        if steps:
            keep.add(steps[-1])
        for step in steps:
            if step not in keep:
                path = self._dir(step)
                doomed = f"{path}{DELETE_MARK}{time.time_ns()}"
                os.rename(path, doomed)  # unlisted at once, even if the removal is cut short
                _remove_tree(doomed)

    def save(self, step: int, state: TrainState) -> None:
        """Saves ``state`` as ``root/<step>/`` (collective); async unless ``async_save=False``."""
        save(self._dir(step), state, async_=self.async_save,
             _after_commit=lambda: self._retain(int(step)))

    def restore(self, step: int | None = None, *, like: TrainState,
                model_only: bool = False) -> TrainState:
        """Restores ``step`` (default: the latest complete one) into ``like``'s layout."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"CheckpointManager: no complete checkpoint in {self.root}")
        return restore(self._dir(step), like=like, model_only=model_only)

    def wait(self) -> None:
        """Waits for the asynchronous save in flight; raises if it failed."""
        wait()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
