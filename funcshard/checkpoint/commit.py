"""The commit protocol: every rank writes, all agree, one rank commits.

1. Rank 0 creates ``<final>.orbax-checkpoint-tmp-<ns>`` (after removing leftovers of killed
   saves of the same name) and broadcasts its name, or its error. On an object store, which
   has no rename (:mod:`funcshard.checkpoint.storage`), the ranks write at ``<final>``
   itself, after rank 0 removed what a killed save of it left: a checkpoint there counts
   only once its commit file is written, last (step 3).
2. Every rank writes its rows durably, with a checksum of every chunk it wrote; one
   all-reduce of success flags decides, and rank 0 gathers the checksums.
3. On success rank 0 writes the metadata, the checksums and the commit files (fsync; see
   ``writing.write_records``; the checkpoint's commit file last), renames the directory into
   place and fsyncs the parent (on a filesystem); one more all-reduce tells every rank. A
   failed save leaves nothing behind; what runs after the commit (retention) never touches
   the committed checkpoint, and its failure is logged, not raised.

``write_and_commit`` is steps 2-3 for any writer (``export_safetensors`` too); a ``Saver`` runs
it, synchronously or in one background thread (at most one save in flight; the next
``save``/``wait`` raises a background failure). A background save returns once this rank's
rows are staged in host buffers it keeps (:mod:`.staging`); step 1 runs in its thread too.
Its collectives run on the state's world group, or for asynchronous saves on a gloo group of
the saver's own, so that they never interleave with training's collectives.
"""

from __future__ import annotations

import atexit
import contextvars
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from funcshard.checkpoint import pipelined, storage
from funcshard.checkpoint import tree as tree_lib
from funcshard.checkpoint.agreement import Agreement
from funcshard.checkpoint.checksums import (
    Checksums,
)
from funcshard.checkpoint.format import (
    CHUNK_BYTES,
    COMMIT_FILE,
    DELETE_MARK,
    TMP_MARK,
    Keys,
)
from funcshard.checkpoint.staging import Staging
from funcshard.checkpoint.writing import write_arrays, write_records
from funcshard.distributed import mesh as mesh_lib
from funcshard.state.state import TrainState

__all__ = [
    "Saver",
    "Agreement",
    "remove_tree",
    "is_leftover",
    "start",
    "write_and_commit",
]


# --- temporary directories and leftovers ------------------------------------------------------


def remove_tree(path: str) -> None:
    """Removes ``path`` if it exists; a failure to remove is logged, never raised over the
    error that made the removal necessary."""
    try:
        storage.remove_tree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning("funcshard.checkpoint: could not remove %s: %s", path, e)


def is_leftover(name: str, base: str | None = None) -> bool:
    """A save's temporary or a removal's doomed directory (of ``base``, or of any)."""
    for mark in (TMP_MARK, DELETE_MARK):
        head, sep, _ = name.partition(mark)
        if sep and (head == base if base is not None else True):
            return True
    return False


def _remove_stale(final: str) -> None:
    parent, base = os.path.split(final)
    for name in storage.listdir(parent):
        if is_leftover(name, base):
            remove_tree(os.path.join(parent, name))


def _fresh(final: str) -> str:
    """Where the ranks write ``final`` (rank 0, once it refused a committed one): a temporary
    directory beside it, or on an object store ``final`` itself, emptied of a killed save."""
    if not storage.atomic_rename(final):
        if storage.exists(os.path.join(final, COMMIT_FILE)):
            raise FileExistsError(f"save: {final} already exists")
        remove_tree(final)  # a save of it that never committed: replaced
        return final
    if storage.exists(final):
        raise FileExistsError(f"save: {final} already exists")
    storage.makedirs(os.path.dirname(final))
    _remove_stale(final)
    tmp = f"{final}{TMP_MARK}{time.time_ns()}"
    storage.makedirs(tmp)
    return tmp


def start(final: str, agreement: Agreement) -> str:
    """Rank 0 makes the place the ranks write to; every rank learns it, or raises rank 0's
    error (whatever its kind: a store's error or a bug, never left to a collective's timeout
    on the other ranks)."""
    msg: Any = None
    error: BaseException | None = None
    if agreement.rank == 0:
        try:
            msg = ("ok", _fresh(final))
        except BaseException as e:  # noqa: BLE001 - every rank must learn of it
            error = e
            msg = (
                "error",
                f"save to {final}: rank 0 could not make its place: {type(e).__name__}: {e}",
            )
    kind, value = agreement.broadcast(msg)
    if error is not None:
        raise error
    if kind != "ok":
        raise OSError(value)
    return value


def commit(tmp: str, final: str) -> None:
    """Renames the complete ``tmp`` into place, durably (rank 0); on an object store the
    commit file written last did it."""
    if tmp == final:
        return
    storage.rename(tmp, final)
    storage.fsync_dir(os.path.dirname(final))


def _agree(agreement: Agreement, what: str, error: BaseException | None, tmp: str) -> None:
    """Raises on every rank if some rank failed (quoting each failed rank's error), rank 0
    once it has removed ``tmp``."""
    try:
        agreement.raise_if_failed(what, error)
    except BaseException:
        if agreement.rank == 0:  # nothing of a failed save stays behind
            remove_tree(tmp)
        raise


def write_and_commit(
    agreement: Agreement,
    tmp: str,
    final: str,
    what: str,
    *,
    write: Callable[[], Any],
    finish: Callable[[list[Any]], None],
    prepare: Callable[[], None] | None = None,
    after_commit: Callable[[], None] | None = None,
) -> None:
    """The protocol after ``start``: every rank writes into ``tmp``, all agree, rank 0
    finishes and renames it to ``final``; on any failure every rank raises and nothing of
    ``tmp`` stays behind.

    Args:
      agreement: the group the ranks agree on.
      tmp: the temporary directory ``start`` made; final: where it goes.
      what: the operation, for messages ("save to DIR").
      write: run on every rank; its result is handed to ``finish``.
      finish: run on rank 0 with every rank's ``write`` result (rank order), before the rename
        (metadata, index files, fsync).
      prepare: run on rank 0 before any rank writes (e.g. creating files at their size).
      after_commit: run on rank 0 once the directory is in place (e.g. retention); its
        failure is logged, never raised: the checkpoint stands and is never touched.
    """
    first = agreement.rank == 0
    error: BaseException | None = None
    if prepare is not None:
        if first:
            try:
                prepare()
            except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
                error = e
        _agree(agreement, f"{what}: preparing", error, tmp)
    result = None
    try:
        result = write()
    except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
        error = e
    _agree(agreement, f"{what}: writing", error, tmp)
    results = agreement.gather(result)
    if first:
        assert results is not None
        try:
            finish(results)
            commit(tmp, final)
        except BaseException as e:  # noqa: BLE001
            error = e
            remove_tree(tmp)  # gone already if the rename happened: then the save stands
        else:  # committed: nothing after may remove it (on an object store tmp is final)
            _after(after_commit, what)
    agreement.raise_if_failed(f"{what}: commit", error)


def _after(after_commit: Callable[[], None] | None, what: str) -> None:
    """Runs ``after_commit`` (rank 0, once committed); its failure is logged, not raised."""
    if after_commit is None:
        return
    try:
        after_commit()
    except Exception as e:  # noqa: BLE001 - the checkpoint is committed: it stands
        logging.warning(
            "funcshard.checkpoint: %s committed, but what runs after the commit (retention) "
            "failed; the checkpoint stands and the next save tries again: %s: %s",
            what,
            type(e).__name__,
            e,
        )


# --- one save -----------------------------------------------------------------------------------


def _bytes(arrays: list[tree_lib.ArrayWrite]) -> int:
    """The bytes of the rows this rank writes."""
    return sum(a.data.numel() * a.data.element_size() for a in arrays if a.data is not None)


@dataclasses.dataclass
class _Job:
    """One save: what to write, and what to run on rank 0 once it is committed."""

    final: str
    tmp: str  # "" until the place is made (a background save makes it in its thread)
    item: str | None
    arrays: list[tree_lib.ArrayWrite]
    scalars: dict[Keys, Any]
    info: dict
    started_ns: int
    after_commit: Callable[[], None] | None
    prepare: Callable[[], None] | None = None
    creates: bool = False  # whether this rank creates its arrays' metadata

    @property
    def item_dir(self) -> str:
        return self.tmp if self.item is None else os.path.join(self.tmp, self.item)


class Saver:
    """Writes checkpoints by the commit protocol; owns the asynchronous save in flight.

    ``write_arrays`` and ``write_metadata`` are the two steps that touch the disk (an
    instance may replace them, e.g. to inject failures in tests).
    """

    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES, checksums: bool = True) -> None:
        self.chunk_bytes = chunk_bytes
        self.checksums = checksums  # False only to measure what they cost
        self._group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._final: str | None = None
        self._atexit = False
        self._stats: dict[str, Any] = {"staged_s": None, "written_s": None, "bytes": 0}
        self._staging = Staging()  # a background save's host buffers, kept between saves

    # the two disk-touching steps -----------------------------------------------------------
    def write_arrays(
        self,
        item_dir: str,
        arrays: list[tree_lib.ArrayWrite],
        scalars: dict[Keys, Any],
        is_first: bool,
    ) -> Checksums:
        return write_arrays(item_dir, arrays, scalars, is_first, checksums=self.checksums)

    def write_metadata(
        self,
        tmp: str,
        item_dir: str,
        final: str,
        arrays: list[tree_lib.ArrayWrite],
        scalars: dict[Keys, Any],
        info: dict,
        started_ns: int,
        item: str | None,
        checksums: Checksums,
    ) -> None:
        write_records(
            item_dir,
            tmp,
            os.path.basename(final),
            item,
            ([a.keys for a in arrays], list(scalars)),
            info,
            started_ns,
            checksums if self.checksums else None,
        )

    # the protocol --------------------------------------------------------------------------
    def _agreement(self, state: TrainState, background: bool) -> Agreement:
        if not background:
            return Agreement.of_state(state)
        if self._group is None:  # collective: every rank saves
            self._group = mesh_lib.inherit_timeout(dist.new_group(backend="gloo"))
            mesh_lib.hold(self, Saver._drop_group)  # dropped with its world
        return Agreement(self._group, torch.device("cpu"))

    def _drop_group(self) -> None:
        self._group = None

    def _run(self, job: _Job, agreement: Agreement) -> None:
        scalars = job.scalars if pipelined.writes_scalars(agreement.rank) else {}
        if not job.tmp:  # a background save makes its place here, off the caller's stall
            job.tmp = start(job.final, agreement)

        def finish(per_rank: list[tuple[Checksums, list[Keys]]]) -> None:
            checksums: Checksums = {}
            listed = {}  # every rank's arrays (a pipeline rank plans only its stages')
            for c, keys in per_rank:
                listed.update(dict.fromkeys(keys))
                for leaf, chunks in c.items():
                    checksums.setdefault(leaf, {}).update(chunks)
            self.write_metadata(
                job.tmp,
                job.item_dir,
                job.final,
                [tree_lib.ArrayWrite(k, (), torch.float32, 1, 0, 0, None) for k in listed],
                job.scalars,
                job.info,
                job.started_ns,
                job.item,
                checksums,
            )

        write_and_commit(
            agreement,
            job.tmp,
            job.final,
            f"save to {job.final}",
            write=lambda: (
                self.write_arrays(job.item_dir, job.arrays, scalars, job.creates),
                [a.keys for a in job.arrays],
            ),
            finish=finish,
            prepare=job.prepare,
            after_commit=job.after_commit,
        )

    def save(
        self,
        directory: str | os.PathLike,
        state: TrainState,
        *,
        background: bool = False,
        item: str | None = None,
        after_commit: Callable[[], None] | None = None,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        """Writes ``state`` at ``directory`` (collective; see ``funcshard.checkpoint.save``).

        Args:
          directory: the checkpoint's directory; must not exist.
          state: not consumed; with ``background`` its rows are staged in host memory first.
          background: return once staged; the write runs in a thread of this saver.
          item: None writes the item at the top of ``directory``; a name writes it as
            ``directory/<item>/`` with Orbax's step metadata (a CheckpointManager step).
          after_commit: run on rank 0 once the checkpoint is in place (e.g. retention); its
            failure is logged.
          prepare: run on rank 0 before any rank writes (e.g. the manager's step index); its
            failure fails the save on every rank.
        """
        state.check()
        if not state.filled:
            raise RuntimeError(
                "save: the state holds no values (built from a meta-device "
                "model); fill it with fs.restore(..., model_only=True) first"
            )
        self.wait()
        called = time.perf_counter()
        agreement = self._agreement(state, background)
        final = storage.normalize(directory)
        started = time.time_ns()
        arrays, scalars = self._plan(state, agreement, background)
        # a background save's place is made in its thread (a collective on the saver's group)
        tmp = "" if background else start(final, agreement)
        info = tree_lib.info(state)
        job = _Job(final, tmp, item, arrays, scalars, info, started, after_commit, prepare)
        job.creates = pipelined.creates_arrays(state, agreement.rank)
        stats = self._stats = {"staged_s": None, "written_s": None, "bytes": _bytes(arrays)}
        if not background:
            self._run(job, agreement)
            stats["staged_s"] = stats["written_s"] = time.perf_counter() - called
            return
        context = contextvars.copy_context()  # the caller's io_stats count the writes

        def target() -> None:
            storage.yield_to_compute()  # the write takes what the step leaves idle
            began = time.perf_counter()
            try:
                context.run(self._run, job, agreement)
                stats["written_s"] = time.perf_counter() - began
            except BaseException as e:  # noqa: BLE001 - raised on the next wait()
                self._error = e

        self._final = final
        self._thread = threading.Thread(target=target, name="funcshard-checkpoint", daemon=True)
        if not self._atexit:
            atexit.register(self._wait_at_exit)
            self._atexit = True
        self._thread.start()
        stats["staged_s"] = time.perf_counter() - called

    def _plan(
        self, state: TrainState, agreement: Agreement, background: bool
    ) -> tuple[list[tree_lib.ArrayWrite], dict[Keys, Any]]:
        """This rank's writes; a background save's rows staged in the saver's host buffers."""
        stage = self._staging.copy if background else None
        arrays, scalars = tree_lib.plan_writes(state, stage=stage, chunk_bytes=self.chunk_bytes)
        skipped = pipelined.skipped_buffers(state, [a.keys for a in arrays])
        arrays = [a for a in arrays if a.keys not in skipped]  # another stage's rank's
        if background:
            self._staging.ready()
            self._staging.retain({a.keys for a in arrays if a.data is not None})
        if state.layout.tensor.size > 1:  # chunks that no two tensor ranks share
            tree_lib.align_chunks(arrays, agreement.group, self.chunk_bytes)
        return arrays, scalars

    def last_save_stats(self) -> dict[str, Any]:
        """The last save's ``staged_s`` (how long ``save`` blocked its caller: the rows copied
        to host memory, for a background save), ``written_s`` (the write itself; None while a
        background write runs) and ``bytes`` (this rank's array bytes)."""
        return dict(self._stats)

    def wait(self) -> None:
        """Waits for the save in flight, if any; raises if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"asynchronous save to {self._final} failed") from error

    def _wait_at_exit(self) -> None:
        if self._thread is not None:
            self.wait()

    def close(self) -> None:
        """Waits for the save in flight and drops the staging buffers; the saver may still be
        used after."""
        try:
            self.wait()
        finally:
            self._staging.release()
            if self._atexit:
                atexit.unregister(self._wait_at_exit)
                self._atexit = False
