"""What the local tier records of a step, and which step a restore takes.

A committed step's ``COMMIT`` names the run (a token kept in the persistent root, so that
another run sharing ``local_dir`` is never restored) and the timeline it was saved on: a
timeline begins when a manager is made or restores anything but the tier's newest step of its
current timeline (``restore(2)`` after step 4 abandons 3 and 4). A restore takes the newest
step of the newest timeline only, and only where the persistent root holds no newer step that
the timeline did not know of when it began (the run went on elsewhere).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any, NamedTuple

import optree
import torch

from funcshard.checkpoint import storage
from funcshard.layout.buckets import NAMESPACE
from funcshard.state.state import TrainState

__all__ = ["RUN_FILE", "Timeline", "Choice", "run_id", "choose", "leaf_signature", "mismatch"]

RUN_FILE = "funcshard_run.json"  # in the persistent root: the run the local tier serves


class Timeline(NamedTuple):
    """A line of saves: ``id`` (unique), ``created`` (rank 0's clock, ns: the newest timeline
    is the live one) and ``root`` (the persistent root's newest step when it began)."""

    id: str
    created: int
    root: int | None

    @classmethod
    def new(cls, root_latest: int | None) -> Timeline:
        return cls(uuid.uuid4().hex, time.time_ns(), root_latest)

    @classmethod
    def of(cls, record: dict[str, Any]) -> Timeline:
        return cls(*record["timeline"])


class Choice(NamedTuple):
    """The step a restore takes, its timeline, and whether saves go on on that timeline (the
    step is the timeline's newest; else a new one begins)."""

    step: int
    timeline: Timeline
    continues: bool


def run_id(root: str) -> str:
    """The run's token in ``root`` (rank 0 only): made if missing, and made anew if unreadable
    (a write cut short; the tier's steps are then another run's, never restored)."""
    path = os.path.join(root, RUN_FILE)
    if storage.exists(path):
        data = storage.read_bytes(path)  # an OSError is raised: the root may come back
        try:
            return str(json.loads(data)["run"])
        except (ValueError, TypeError, KeyError) as e:
            logging.warning("funcshard.checkpoint: %s unreadable (%s): a new run", path, e)
    run = uuid.uuid4().hex
    data = json.dumps({"run": run}).encode()
    if storage.atomic_rename(path):  # never a token cut short: written aside, then renamed
        tmp = f"{path}.tmp-{run}"
        storage.write_bytes(tmp, data)
        storage.rename(tmp, path)
    else:
        storage.write_bytes(path, data)  # an object is written whole or not at all
    return run


Views = list[dict[tuple[str, int], tuple[Timeline, list[int]]]]


def choose(views: Views, world: int, root_latest: int | None) -> Choice | None:
    """The step to restore from every rank's view ({(timeline id, step): (timeline, the ranks
    whose values its node holds, none if of another layout)} of this run), or None (read the
    root): the newest step of the newest timeline that the live nodes hold for every rank."""
    timelines = {key[0]: tl for view in views for key, (tl, _) in view.items()}
    if not timelines:
        return None
    current = max(timelines.values(), key=lambda tl: (tl.created, tl.id))
    held: dict[int, set[int]] = {}
    for view in views:
        for (tl_id, step), (_, ranks) in view.items():
            if tl_id == current.id:
                held.setdefault(step, set()).update(ranks)
    complete = [s for s, ranks in held.items() if ranks == set(range(world))]
    if not complete:
        return None
    best = max(complete)
    known = -1 if current.root is None else current.root
    if root_latest is not None and root_latest > best and root_latest > known:
        return None  # the root went on past the tier without it
    return Choice(best, current, best == max(held))


def leaf_signature(state: TrainState) -> list[tuple[str, Any, str]]:
    """(name, shape, dtype) of every value the tier keeps of ``state`` on this rank."""
    opt = optree.tree_leaves(state.opt_state, none_is_leaf=True, namespace=NAMESPACE)
    named = [(f"master[{i}]", t) for i, t in enumerate(state.master)]
    named += [(f"opt_state leaf {i}", t) for i, t in enumerate(opt)]
    named += [(f"buffer {n!r}", t) for n, t in state.buffers.values().items()]
    named.append(("loss_scale", state.loss_scale))
    return [
        (n, tuple(t.shape), str(t.dtype))
        if isinstance(t, torch.Tensor)
        else (n, None, type(t).__name__)
        for n, t in named
    ]


def mismatch(saved: list[Any], like: list[Any]) -> str | None:
    """How the saved leaves differ from ``like``'s (None: they match)."""
    saved = [tuple(x) for x in saved]  # a list once through torch.save
    if saved == like:
        return None
    if len(saved) != len(like):
        return f"it holds {len(saved)} values, the state restored into {len(like)}"
    first = next(i for i, (a, b) in enumerate(zip(saved, like, strict=True)) if a != b)
    return f"its {saved[first][0]} is {saved[first][1:]}, the state's {like[first][1:]}"
