"""The local checkpoint tier (Orbax's emergency checkpointing, NVRx's local checkpoints).

Every ``save`` keeps each rank's values (:func:`funcshard.state.values.values`: masters,
optimizer state, step, loss scale) in ``local_dir`` on its own node, and ``replicas`` copies
of them on the next nodes (rank ``r``'s go to rank ``r + k * ranks_per_node``, which writes
them into its own node's directory): a node lost takes no step with it while a replica of each
of its ranks lives. A node's step counts once its ``COMMIT`` file is written, after every rank
of the world wrote its own and its replicas. ``restore`` takes the newest step that the live
nodes' tiers hold for every rank, for the same world and layout: each rank reads its own
values from its node's directory, or receives them from a rank whose node holds a replica.

A per-rank file, not an Orbax checkpoint: the tier serves a restart on the same layout (the
common case after a lost node, and the one a local tier can serve fast); a restore onto
another layout reads the persistent checkpoint. The files live in RAM disk or node-local disk
(``/dev/shm``, NVMe): no checksums beyond what a copy on two nodes gives, and the newest two
committed steps only.

Every step is written under a temporary name and renamed into place once committed (a
committed step is never overwritten in place; one of the same number is renamed aside first),
its ``COMMIT`` naming the run and the timeline (:mod:`.local_records`); a save's failure on any
rank raises on every rank, and what a failed or killed save left is swept. A ``local_dir``
without ``{node}`` that several nodes share is refused when the tier is made.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from funcshard.checkpoint import storage
from funcshard.checkpoint.agreement import Agreement
from funcshard.checkpoint.commit import is_leftover, remove_tree
from funcshard.checkpoint.format import DELETE_MARK, TMP_MARK
from funcshard.checkpoint.local_records import (
    Choice,
    Timeline,
    Views,
    choose,
    leaf_signature,
    mismatch,
    run_id,
)
from funcshard.checkpoint.reading import materialized
from funcshard.state.state import TrainState
from funcshard.state.values import load_values, values

__all__ = ["LocalTier", "ranks_per_node"]

COMMIT = "COMMIT"
KEEP = 2
PROBE = ".probe-"  # the files that tell whether nodes share local_dir
_RANK_FILE = re.compile(r"^rank(\d+)\.pt$")


def ranks_per_node(world: int) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else every rank on one node."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if n < 1 or world % n:
        raise ValueError(f"local tier: {world} ranks do not split into nodes of {n}")
    return n


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _exchange(sends: dict[int, bytes], recvs: list[int]) -> dict[int, bytes]:
    """Point to point over the world: ``sends`` {dst: bytes}, ``recvs`` [src]; sizes first."""
    sizes = {s: torch.zeros(1, dtype=torch.int64) for s in recvs}
    ops = [dist.P2POp(dist.isend, torch.tensor([len(b)]), d) for d, b in sends.items()]
    ops += [dist.P2POp(dist.irecv, sizes[s], s) for s in recvs]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    out = {s: torch.empty(int(sizes[s]), dtype=torch.uint8) for s in recvs}
    ops = [
        dist.P2POp(dist.isend, torch.frombuffer(bytearray(b), dtype=torch.uint8), d)
        for d, b in sends.items()
    ]
    ops += [dist.P2POp(dist.irecv, out[s], s) for s in recvs]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return {s: out[s].numpy().tobytes() for s in recvs}


def _signature(state: TrainState) -> str:
    """What a restore from the tier needs to match, the same on every rank of a node: the
    world, strategy, mesh, and the masters with the names each bucket packs; under a pipeline
    the schedule and every stage's parameter names instead of this rank's masters (another
    split or schedule may give a rank masters of the same shapes over other parameters). Each
    rank's values are checked leaf by leaf once read (:func:`.local_records.mismatch`)."""
    layout, run = state.layout, state.pipeline
    if run is None:
        shapes = [tuple(m.shape) for m in state.master]
        names = repr([shapes, [m.names for m in layout.members]])
    else:
        stages = [[n for n, _ in stage.named_parameters()] for stage in run.stages]
        names = repr([run.pipe.torch_class, dist.get_world_size(run.group), stages])
    names = hashlib.sha256(names.encode()).hexdigest()[:16]
    world = dist.get_world_size()
    return f"{world} {layout.strategy} {layout.outer} {layout.mesh.shape} {names}"


def _remove(path: str) -> None:
    """Removes a file or a directory tree; a failure is logged (a sweep never fails a save)."""
    if storage.isdir(path):
        remove_tree(path)
        return
    try:
        storage.remove_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning("funcshard.checkpoint: could not remove %s: %s", path, e)


def _remove_step(path: str) -> None:
    """Removes a committed step: renamed aside first, so that a removal cut short leaves no
    committed step with some of its files gone."""
    doomed = f"{path}{DELETE_MARK}{time.time_ns()}"
    try:
        storage.rename(path, doomed)
    except OSError as e:
        logging.warning("funcshard.checkpoint: could not remove %s: %s", path, e)
        return
    remove_tree(doomed)


def _refuse_root_inside(template: str, nodes: int, root: str) -> None:
    """Refuses a node's directory that is ``root``, or holds it (or is held in it) under a
    step's name: the tier's sweep would remove root's checkpoints, or root's saves collide."""
    if not storage.atomic_rename(root):
        return
    for node in range(nodes):
        here = storage.normalize(template.format(node=node))
        for rel in (os.path.relpath(root, here), os.path.relpath(here, root)):
            first = rel.split(os.sep, 1)[0]
            if rel == os.curdir or first.isdigit() or is_leftover(first):
                raise ValueError(
                    f"CheckpointManager: local_dir {template!r} is (or holds, or is under a "
                    f"step's name in) the root {root!r}; give the tier a directory of its own"
                )


class LocalTier:
    """One rank's view of the local tier (see the module's docstring).

    Made collectively: node leaders sweep what failed saves left, rank 0 reads the run's
    token in ``root`` (making it if missing) and begins a timeline, and every rank checks that
    the ranks sharing its directory are its node's.
    """

    def __init__(
        self,
        local_dir: str,
        replicas: int = 1,
        per_node: int | None = None,
        *,
        root: str,
        root_latest: Callable[[], int | None],
    ) -> None:
        """Args: ``root`` and ``root_latest`` (its newest complete step; called on rank 0):
        the persistent checkpoints the tier stands in front of."""
        if replicas < 0:
            raise ValueError(f"CheckpointManager: local_replicas must be >= 0, got {replicas}")
        self.template = str(local_dir)
        self.replicas = replicas
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.per_node = per_node or ranks_per_node(self.world)
        self.node = self.rank // self.per_node
        self.nodes = self.world // self.per_node
        if self.replicas >= self.nodes and self.replicas:
            raise ValueError(
                f"CheckpointManager: local_replicas={replicas} needs more than {self.nodes} "
                f"node(s) ({self.world} ranks, {self.per_node} a node)"
            )
        try:
            self.dir = storage.normalize(self.template.format(node=self.node))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"CheckpointManager: local_dir {self.template!r} may hold '{{node}}' and no other "
                f"field ({type(e).__name__}: {e}); write a literal brace as '{{{{'"
            ) from None
        if not storage.atomic_rename(self.dir):
            raise ValueError(
                f"CheckpointManager: local_dir must be a node's filesystem (RAM disk, local "
                f"disk), not an object store: {self.template!r}"
            )
        _refuse_root_inside(self.template, self.nodes, storage.normalize(root))
        self.root_latest = root_latest
        self.agreement = Agreement(dist.group.WORLD, torch.device("cpu"))
        self.leader = self.rank % self.per_node == 0
        self._saves = 0
        if self.leader:
            try:
                self._sweep()
            except OSError as e:  # a sweep never fails: writing the probes below tells
                logging.warning("funcshard.checkpoint: could not sweep %s: %s", self.dir, e)
        self.root = root
        self.run, timeline = self._from_rank0(lambda: (run_id(root), Timeline.new(root_latest())))
        self.timeline = Timeline(*timeline)
        self._check_not_shared()

    # --- making -------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Removes what killed or failed saves left in this node's directory (its leader)."""
        if not storage.isdir(self.dir):
            return
        for name in storage.listdir(self.dir):
            path = os.path.join(self.dir, name)
            uncommitted = name.isdigit() and not storage.exists(os.path.join(path, COMMIT))
            if uncommitted or is_leftover(name) or name.startswith(PROBE):
                _remove(path)

    def _check_not_shared(self) -> None:
        """Refuses a directory that ranks of several nodes share (``local_dir`` without
        ``{node}`` on a shared filesystem), or that a node's ranks do not share."""
        probe = os.path.join(self.dir, f"{PROBE}{self.timeline.id}-{self.rank}")
        error = None
        try:
            storage.makedirs(self.dir)
            storage.write_bytes(probe, b"")
        except OSError as e:
            error = e
        self.agreement.raise_if_failed(f"local tier: writing in {self.dir}", error)
        prefix = f"{PROBE}{self.timeline.id}-"
        names: list[str] = []
        try:
            names = storage.listdir(self.dir)
        except OSError as e:
            error = e
        self.agreement.raise_if_failed(f"local tier: listing {self.dir}", error)
        seen = sorted(int(n[len(prefix) :]) for n in names if n.startswith(prefix))
        dist.barrier()  # every rank looked before any removes its probe
        _remove(probe)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, seen)
        for rank, ranks in enumerate(every):
            node = rank // self.per_node
            mine = set(range(node * self.per_node, (node + 1) * self.per_node))
            if set(ranks) - mine:
                nodes = sorted({r // self.per_node for r in ranks})
                raise ValueError(
                    f"CheckpointManager: local_dir {self.template!r} is one directory for "
                    f"nodes {nodes} (ranks {ranks} see each other's files in it: a shared "
                    "filesystem); put {node} in it, e.g. '/dev/shm/run-{node}'"
                )
            if mine - set(ranks):
                raise ValueError(
                    f"CheckpointManager: ranks {sorted(mine - set(ranks))} of node {node} do "
                    f"not see rank {rank}'s files in local_dir {self.template!r}: each node's "
                    f"ranks must share it (ranks_per_node={self.per_node}: torchrun's "
                    "LOCAL_WORLD_SIZE or the argument)"
                )

    # --- saving ---------------------------------------------------------------------------
    def _step_dir(self, step: int) -> str:
        return os.path.join(self.dir, str(int(step)))

    def _agree(self, what: str, error: BaseException | None, tmp: str | None) -> None:
        """Raises on every rank if one failed; node leaders remove ``tmp`` first."""
        try:
            self.agreement.raise_if_failed(what, error)
        except BaseException:
            if self.leader and tmp is not None:
                remove_tree(tmp)
            raise

    def save(self, step: int, state: TrainState) -> int:
        """Writes this rank's values and its replicas' (collective over the world); returns
        the bytes this rank wrote. Raises on every rank if a rank failed: the step is then kept
        by no node (a node whose leader had committed it removes it again)."""
        step = int(step)
        tmp = os.path.join(self.dir, f"{step}{TMP_MARK}{self.timeline.id}-{self._saves}")
        self._saves += 1
        error: BaseException | None = None
        try:
            record = {"rank": self.rank, "world": self.world, "leaves": leaf_signature(state)}
            blob = _to_bytes({**record, "values": values(state)})
        except Exception as e:  # noqa: BLE001 - the peers wait in the exchange
            error, blob = e, _to_bytes(None)
        ks = range(1, 1 + self.replicas)
        sends = {(self.rank + k * self.per_node) % self.world: blob for k in ks}
        recvs = [(self.rank - k * self.per_node) % self.world for k in ks]
        received = _exchange(sends, recvs)
        written = 0
        if error is None:
            try:
                storage.makedirs(tmp)
                for r, data in ((self.rank, blob), *received.items()):
                    storage.write_bytes(os.path.join(tmp, f"rank{r}.pt"), data)
                    written += len(data)
            except BaseException as e:  # noqa: BLE001 - every rank must reach the agreement
                error = e
        where = f"local tier: saving step {step} in {self.template!r}"
        self._agree(where, error, tmp)  # every rank of every node wrote its own and replicas'
        committed = False
        if self.leader:
            try:
                self._commit(step, tmp, _signature(state))
                committed = True
            except BaseException as e:  # noqa: BLE001
                error = e
        try:
            self._agree(f"{where}: committing", error, tmp)
        except BaseException:
            if committed:  # another node's commit failed: the step is whole on no tier
                _remove_step(self._step_dir(step))
            raise
        if self.leader:  # only once every node holds the step: a failed save removes nothing
            try:
                self._retain(step)
            except OSError as e:  # the step stands; the next save's retention tries again
                logging.warning("funcshard.checkpoint: local tier retention failed: %s", e)
        self.agreement.failed_ranks(True)  # every rank returns once retention is done
        return written

    def _commit(self, step: int, tmp: str, layout: str) -> None:
        """Node leader: the step's ``COMMIT`` written, the directory renamed into place (one
        of the same number renamed aside first); retention follows once every node has."""
        record = {"run": self.run, "timeline": list(self.timeline), "world": self.world}
        record |= {"step": step, "layout": layout}
        storage.write_bytes(os.path.join(tmp, COMMIT), json.dumps(record).encode())
        final = self._step_dir(step)
        if storage.exists(final):
            _remove_step(final)
        storage.rename(tmp, final)
        storage.fsync_dir(self.dir)

    def _retain(self, just_saved: int) -> None:
        """Keeps this timeline's newest ``KEEP`` steps and ``just_saved``; removes the rest
        (other runs', abandoned timelines')."""
        ours = []
        for step, record in self._records().items():
            if record is not None and (record["run"], record["timeline"][0]) == (
                self.run,
                self.timeline.id,
            ):
                ours.append(step)
            else:
                _remove_step(self._step_dir(step))
        keep = set(sorted(ours)[-KEEP:]) | {just_saved}
        for step in ours:
            if step not in keep:
                _remove_step(self._step_dir(step))

    def _records(self) -> dict[int, dict[str, Any] | None]:
        """This node's committed steps: {step: its COMMIT (None if unreadable)}."""
        if not storage.isdir(self.dir):
            return {}
        out: dict[int, dict[str, Any] | None] = {}
        for name in storage.listdir(self.dir):
            commit = os.path.join(self.dir, name, COMMIT)
            if name.isdigit() and storage.exists(commit):
                try:
                    record = json.loads(storage.read_bytes(commit))
                    out[int(name)] = record if "run" in record and "timeline" in record else None
                except (OSError, ValueError):
                    out[int(name)] = None
        return out

    # --- restoring ------------------------------------------------------------------------
    def begin(self) -> None:
        """Begins a new timeline (collective): the state was restored from elsewhere, so what
        the tier holds of later steps is abandoned (removed by the next save)."""
        self.timeline = Timeline(*self._from_rank0(lambda: Timeline.new(self.root_latest())))

    def _from_rank0(self, make: Callable[[], Any]) -> Any:
        """``make()`` on rank 0, on every rank (collective); its error raised on every rank."""
        msg: Any = None
        if self.rank == 0:
            try:
                msg = ("ok", make())
            except Exception as e:  # noqa: BLE001 - every rank raises it
                msg = ("error", f"{type(e).__name__}: {e}")
        kind, got = self.agreement.broadcast(msg)
        if kind != "ok":
            raise OSError(f"CheckpointManager: the local tier could not read {self.root}: {got}")
        return got

    def _view(self, like: TrainState) -> dict[tuple[str, int], tuple[Timeline, list[int]]]:
        """{(timeline id, step): (timeline, the ranks this node holds; none if another
        layout)} of this run's committed steps."""
        layout = _signature(like)
        view = {}
        for step, record in self._records().items():
            if record is None or record["run"] != self.run:
                continue
            names = storage.listdir(self._step_dir(step))
            ranks = sorted(int(m[1]) for n in names if (m := _RANK_FILE.match(n)))
            tl = Timeline.of(record)
            view[(tl.id, step)] = (tl, ranks if record.get("layout") == layout else [])
        return view

    def restore_newest(self, like: TrainState) -> TrainState | None:
        """``like`` (donated) with the newest step of this run's newest timeline that the
        live nodes hold for every rank (collective); None, ``like`` untouched, where the tier
        has none or a rank's values do not fit ``like``: read the root then."""
        latest = self._from_rank0(self.root_latest)
        try:
            view = self._view(like)
        except Exception as e:  # noqa: BLE001 - as if this node's tier were lost
            logging.warning("funcshard.checkpoint: could not read %s: %s", self.dir, e)
            view = {}
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, (view, latest))
        views: Views = [view for view, _ in every]
        choice = choose(views, self.world, every[0][1])
        if choice is None:
            return None
        state = self._restore(choice, views, like)
        if state is not None:
            if choice.continues:
                self.timeline = choice.timeline
            else:
                self.begin()
        return state

    def _read(self, step: int, rank: int) -> bytes:
        """Rank ``rank``'s file of ``step`` here, or an error record to send in its place."""
        try:
            return storage.read_bytes(os.path.join(self._step_dir(step), f"rank{rank}.pt"))
        except OSError as e:
            return _to_bytes({"error": f"{type(e).__name__}: {e}"})

    def _restore(self, choice: Choice, views: Views, like: TrainState) -> TrainState | None:
        """Each rank's values of ``choice``: read from its node's directory, or received from
        the first rank whose node holds them; loaded into ``like`` once every rank's fit."""
        key = (choice.timeline.id, choice.step)
        sources = {}
        for r in range(self.world):  # the same plan on every rank
            holders = [q for q in range(self.world) if r in views[q].get(key, (None, []))[1]]
            mine = [q for q in holders if q // self.per_node == r // self.per_node]
            sources[r] = r if r in mine else holders[0]
        payload = {
            r: self._read(choice.step, r)
            for r, src in sources.items()
            if src == self.rank and r != self.rank
        }
        src = sources[self.rank]
        got = _exchange(payload, [] if src == self.rank else [src])
        data = self._read(choice.step, self.rank) if src == self.rank else got[src]
        problem, record = None, None
        try:
            record = _from_bytes(data)
            if "error" in record:
                problem = record["error"]
            elif (record["rank"], record["world"]) != (self.rank, self.world):
                problem = f"it holds rank {record['rank']} of {record['world']}"
            else:
                problem = mismatch(record["leaves"], leaf_signature(like))
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
            problem = f"{type(e).__name__}: {e}"
        failed = self.agreement.failed_ranks(problem is None)
        if failed:
            problems: list[Any] = [None] * self.world
            dist.all_gather_object(problems, problem)
            if self.rank == 0:
                quoted = "; ".join(f"rank {r}: {problems[r]}" for r in failed)
                logging.warning(
                    "funcshard.checkpoint: local tier step %d does not fit (%s); restoring "
                    "from the persistent root",
                    choice.step,
                    quoted,
                )
            return None
        assert record is not None
        by = f"local restore of step {choice.step}"
        return load_values(materialized(like), record["values"], by=by)
