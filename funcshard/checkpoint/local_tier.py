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
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from funcshard.checkpoint import storage
from funcshard.state.state import TrainState
from funcshard.state.values import load_values, values

__all__ = ["LocalTier", "ranks_per_node"]

COMMIT = "COMMIT"
KEEP = 2
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
    """What a restore from the tier needs to match: the world, strategy, mesh and buffers."""
    layout = state.layout
    shapes = [tuple(m.shape) for m in state.master]
    return f"{dist.get_world_size()} {layout.strategy} {layout.outer} {layout.mesh.shape} {shapes}"


class LocalTier:
    """One rank's view of the local tier (see the module's docstring)."""

    def __init__(self, local_dir: str, replicas: int = 1, per_node: int | None = None) -> None:
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
        self.dir = storage.normalize(self.template.format(node=self.node))

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.dir, str(int(step)))

    def save(self, step: int, state: TrainState) -> None:
        """Writes this rank's values and its replicas' (collective over the world)."""
        blob = _to_bytes({"rank": self.rank, "world": self.world, "values": values(state)})
        ks = range(1, 1 + self.replicas)
        sends = {(self.rank + k * self.per_node) % self.world: blob for k in ks}
        recvs = [(self.rank - k * self.per_node) % self.world for k in ks]
        received = _exchange(sends, recvs)
        where = self._step_dir(step)
        storage.makedirs(where)
        for r, data in ((self.rank, blob), *received.items()):
            storage.write_bytes(os.path.join(where, f"rank{r}.pt"), data)
        dist.barrier()  # every rank of every node wrote its own and its replicas
        if self.rank % self.per_node == 0:
            record = {"world": self.world, "step": int(step), "layout": _signature(state)}
            storage.write_bytes(os.path.join(where, COMMIT), json.dumps(record).encode())
            self._retain()
        dist.barrier()  # returns once the step is committed on every node

    def _retain(self) -> None:
        for step in self._committed()[:-KEEP]:
            storage.remove_tree(self._step_dir(step))

    def _committed(self, layout: str | None = None) -> list[int]:
        """This node's committed steps (of the layout ``layout`` only, when given)."""
        if not storage.isdir(self.dir):
            return []
        steps = []
        for name in storage.listdir(self.dir):
            commit = os.path.join(self.dir, name, COMMIT)
            if name.isdigit() and storage.exists(commit):
                record = json.loads(storage.read_bytes(commit))
                if layout is None or record.get("layout") == layout:
                    steps.append(int(name))
        return sorted(steps)

    def _held(self, layout: str) -> dict[int, list[int]]:
        """{committed step of ``layout``: the ranks whose values this node holds}."""
        held = {}
        for step in self._committed(layout):
            names = storage.listdir(self._step_dir(step))
            held[step] = sorted(int(m[1]) for n in names if (m := _RANK_FILE.match(n)))
        return held

    def newest(self, like: TrainState) -> int | None:
        """The newest step the live nodes hold for every rank, saved from a state of
        ``like``'s layout (collective); None if none."""
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, self._held(_signature(like)))
        self._every = every
        complete = [
            step
            for step in {s for held in every for s in held}
            if {r for held in every for r in held.get(step, [])} == set(range(self.world))
        ]
        return max(complete) if complete else None

    def restore(self, step: int, like: TrainState) -> TrainState:
        """``like`` (donated) with this rank's values of ``step`` (collective): read from this
        node's directory, or received from the first rank whose node holds them."""
        sources = {}
        for r in range(self.world):  # the same plan on every rank
            node_first = [q for q in range(self.world) if r in self._every[q].get(step, [])]
            mine = [q for q in node_first if q // self.per_node == r // self.per_node]
            sources[r] = r if r in mine else node_first[0]
        path = os.path.join(self._step_dir(step), "rank{}.pt")
        payload = {
            r: storage.read_bytes(path.format(r))
            for r, src in sources.items()
            if src == self.rank and r != self.rank
        }
        src = sources[self.rank]
        got = _exchange(payload, [] if src == self.rank else [src])
        data = storage.read_bytes(path.format(self.rank)) if src == self.rank else got[src]
        record = _from_bytes(data)
        assert record["rank"] == self.rank and record["world"] == self.world, record.keys()
        return load_values(like, record["values"], by=f"local restore of step {step}")
