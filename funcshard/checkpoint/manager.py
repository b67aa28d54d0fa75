"""Numbered checkpoints with retention and asynchronous saves."""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

from funcshard.checkpoint import steps as steps_lib
from funcshard.checkpoint import storage
from funcshard.checkpoint.api import restore
from funcshard.checkpoint.commit import Saver
from funcshard.checkpoint.format import DEFAULT_ITEM
from funcshard.checkpoint.local_tier import LocalTier
from funcshard.state.state import TrainState

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Numbered checkpoints ``root/<step>/`` with retention and asynchronous saves.

    A step is laid out as Orbax's own ``CheckpointManager`` lays out a single item
    (``root/<step>/default/`` + the step's ``_CHECKPOINT_METADATA``), so a JAX process reads
    it with ``ocp.CheckpointManager(root).restore(step)``. An incomplete step (still under its
    temporary name, or without ``commit_success.txt``) is never listed; retention keeps the
    ``max_to_keep`` highest steps and never deletes the latest one nor the one just written.
    On an object store the steps are listed from a small index (:mod:`.steps`), and the store
    is probed when the manager is made (:func:`.storage.probe`).

    ``saver`` owns the asynchronous save in flight (one at a time).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        max_to_keep: int | None = 3,
        *,
        async_save: bool = True,
        local_dir: str | os.PathLike | None = None,
        local_replicas: int = 1,
        persistent_every: int | None = None,
        ranks_per_node: int | None = None,
    ) -> None:
        """Args beyond ``root``, ``max_to_keep`` and ``async_save``: ``local_dir`` (may hold
        ``{node}``) keeps every save in the local tier too (:mod:`.local_tier`), with
        ``local_replicas`` copies of each rank's on other nodes; ``persistent_every``: only the
        saves whose step is a multiple of it go to ``root`` (None: every one);
        ``ranks_per_node``: torchrun's ``LOCAL_WORLD_SIZE`` by default."""
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(
                f"CheckpointManager: max_to_keep must be >= 1 or None, got {max_to_keep}"
            )
        if persistent_every is not None and persistent_every < 1:
            raise ValueError(
                f"CheckpointManager: persistent_every must be >= 1 or None, got {persistent_every}"
            )
        self.root = storage.normalize(root)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.saver = Saver()
        self.persistent_every = persistent_every
        self._last: _Last | None = None
        storage.makedirs(self.root)
        storage.probe(self.root)  # an object store that does not answer fails here, fast
        self.local = None
        if local_dir is not None:
            self.local = LocalTier(
                os.fspath(local_dir),
                local_replicas,
                ranks_per_node,
                root=self.root,
                root_latest=self.latest_step,
            )

    def _dir(self, step: int) -> str:
        return os.path.join(self.root, str(int(step)))

    def _complete_steps(self) -> list[int]:
        return steps_lib.committed(self.root)  # on an object store: its index of steps

    def all_steps(self) -> list[int]:
        """The complete steps, ascending (waits for an asynchronous save first)."""
        self.wait()
        return self._complete_steps()

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _sweep(self) -> None:
        """Removes what killed or failed saves and removals left behind (rank 0, between
        saves: the save in flight, if any, has just been committed)."""
        steps_lib.sweep(self.root)

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
                steps_lib.remove(self.root, step)

    def save(self, step: int, state: TrainState) -> None:
        """Saves ``state`` as ``root/<step>/`` (collective); async unless ``async_save=False``.
        With a local tier, every step to it (synchronously: a local copy) and to ``root``
        the multiples of ``persistent_every``."""
        called = time.perf_counter()
        self._last = _Last(int(step), None, 0, False, None)  # what a failed save leaves
        local_s, local_bytes = None, 0
        if self.local is not None:
            local_bytes = self.local.save(step, state)
            local_s = time.perf_counter() - called
            if self.persistent_every is not None and step % self.persistent_every:
                self._last = _Last(int(step), local_s, local_bytes, False, local_s)
                return
        self.saver.save(
            self._dir(step),
            state,
            background=self.async_save,
            item=DEFAULT_ITEM,
            after_commit=lambda: self._retain(int(step)),
            prepare=lambda: steps_lib.mark(self.root, int(step)),
        )
        blocked = time.perf_counter() - called
        self._last = _Last(int(step), local_s, local_bytes, True, blocked)

    def restore(
        self, step: int | None = None, *, like: TrainState, model_only: bool = False
    ) -> TrainState:
        """Restores ``step`` (default: the latest complete one) into ``like``'s layout. With a
        local tier and no ``step``: the newest step the live nodes' tiers hold for every rank
        (bitwise the state saved; every save goes to the tier, so it is at least as new as
        ``root``'s, which is not listed then), else ``root``'s newest."""
        self.wait()
        if step is None and self.local is not None and not model_only:
            state = self.local.restore_newest(like)
            if state is not None:
                return state
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"CheckpointManager: no complete checkpoint in {self.root}")
        state = restore(self._dir(step), like=like, model_only=model_only)
        if self.local is not None:  # what the tier holds past ``step`` is abandoned
            self.local.begin()
        return state

    def last_save_stats(self) -> dict[str, Any]:
        """The last ``save``'s: ``step``; ``staged_s`` (how long it blocked the caller: the
        local tier's write, then the persistent save's staging, or all of it when synchronous);
        ``written_s`` (the persistent write; None while it runs in the background; the tier's
        when the step went to the tier only); ``bytes`` (this rank's array bytes in ``root``, 0
        when it went to the tier only); ``local_s`` and ``local_bytes`` (the tier's write and
        the bytes this rank wrote there, its replicas' included; None and 0 without a tier);
        ``persistent`` (whether it went to ``root``)."""
        last = self._last
        if last is None:
            out = {"step": None, **self.saver.last_save_stats(), "persistent": False}
        elif last.persistent:
            out = {"step": last.step, **self.saver.last_save_stats(), "persistent": True}
            out["staged_s"] = last.blocked_s
            if not self.async_save:
                out["written_s"] = last.blocked_s
        else:
            out = {"step": last.step, "staged_s": last.blocked_s, "written_s": last.blocked_s}
            out |= {"bytes": 0, "persistent": False}
        if last is None or last.blocked_s is None:  # none yet, or a failed save
            out |= {"staged_s": None, "written_s": None}
        if last is None:
            return out | {"local_s": None, "local_bytes": 0}
        return out | {"local_s": last.local_s, "local_bytes": last.local_bytes}

    def wait(self) -> None:
        """Waits for the asynchronous save in flight; raises if it failed."""
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Last(NamedTuple):
    """What ``last_save_stats`` reports of the last save (``blocked_s`` None: it failed)."""

    step: int
    local_s: float | None
    local_bytes: int
    persistent: bool
    blocked_s: float | None
