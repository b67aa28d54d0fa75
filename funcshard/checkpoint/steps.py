"""The steps of a ``CheckpointManager`` root: which are committed, and what killed saves left.

A step ``root/<n>/`` counts once its commit file is there (the commit protocol writes it
last). On a filesystem the root is listed (one readdir), and what killed saves and removals
left carries a temporary name (``<n>.orbax-checkpoint-tmp-...``), swept by that name.

An object store has no directories: listing a root lists every object of every step, and a
killed save leaves its objects under the step's own name. There the manager keeps an index,
``root/_funcshard_steps/<n>``: an empty object rank 0 writes before any rank writes step
``n`` (:func:`mark`) and removes last when the step goes (:func:`remove`). Listing the index
lists one key a step; a step is committed when its commit file is there (one read each); a
marked step without it is what a killed or failed save left, which :func:`sweep` removes. A
root written without an index (an older funcshard) is listed whole until its index holds
``root/_funcshard_steps/whole``, which its first :func:`mark` writes once every step of the
root is entered (an indexing cut short leaves an index that is not trusted, never a step lost).
"""

from __future__ import annotations

import logging
import os
import re
import time

from funcshard.checkpoint import storage
from funcshard.checkpoint.commit import is_leftover, remove_tree
from funcshard.checkpoint.format import COMMIT_FILE, DELETE_MARK

__all__ = ["INDEX", "committed", "mark", "remove", "sweep"]

INDEX = "_funcshard_steps"
WHOLE = "whole"  # in the index once every step of the root is: until then the root is listed
_STEP = re.compile(r"^\d+$")


def _numbers(names: list[str]) -> list[int]:
    return sorted(int(n) for n in names if _STEP.match(n))


def _marker(root: str, step: int) -> str:
    return os.path.join(root, INDEX, str(step))


def _is_committed(root: str, step: int) -> bool:
    return storage.isfile(os.path.join(root, str(step), COMMIT_FILE))


def _candidates(root: str) -> list[int]:
    """The steps ``root`` may hold, committed or not: its index's on an object store (the
    whole root's names until the index is whole), else the directory's step names."""
    if storage.is_object(root):
        names = storage.listdir(os.path.join(root, INDEX))
        if WHOLE in names:
            return _numbers(names)
    return _numbers(storage.listdir(root))


def committed(root: str) -> list[int]:
    """The committed steps of ``root``, ascending."""
    return [s for s in _candidates(root) if _is_committed(root, s)]


def mark(root: str, step: int) -> None:
    """Enters ``step`` in ``root``'s index before any rank writes it (rank 0; an object store's
    only). An index that is not whole first gets every step the root holds (a root of an older
    funcshard), then :data:`WHOLE`, so that none of them is left unlisted or unswept, even when
    this is cut short."""
    if not storage.is_object(root):
        return
    if WHOLE not in storage.listdir(os.path.join(root, INDEX)):
        for old in _numbers(storage.listdir(root)):
            storage.write_bytes(_marker(root, old), b"")
        storage.write_bytes(os.path.join(root, INDEX, WHOLE), b"")
    storage.write_bytes(_marker(root, step), b"")


def sweep(root: str) -> None:
    """Removes what killed (or failed) saves and removals left in ``root``; never a committed
    step. Rank 0, between its own saves only: a save of ``root`` in flight would look the same.
    """
    if not storage.is_object(root):
        for name in storage.listdir(root):
            if is_leftover(name) and _STEP.match(name.split(".", 1)[0]):
                remove_tree(os.path.join(root, name))
        return
    for step in _numbers(storage.listdir(os.path.join(root, INDEX))):
        if not _is_committed(root, step):
            try:  # the entry goes only once its objects have: else the next sweep retries
                storage.remove_tree(os.path.join(root, str(step)))
            except OSError as e:
                logging.warning("funcshard.checkpoint: could not sweep %s/%d: %s", root, step, e)
                continue
            storage.remove_file(_marker(root, step))


def remove(root: str, step: int) -> None:
    """Removes a committed step so that it is unlisted at once, even if the removal is cut
    short: renamed aside on a filesystem; on an object store its commit file removed first,
    its index entry last (a removal cut short leaves an entry that :func:`sweep` finishes)."""
    path = os.path.join(root, str(step))
    if storage.atomic_rename(path):
        doomed = f"{path}{DELETE_MARK}{time.time_ns()}"
        storage.rename(path, doomed)
        remove_tree(doomed)
        return
    storage.remove_file(os.path.join(path, COMMIT_FILE))
    storage.remove_tree(path)
    storage.remove_file(_marker(root, step))
