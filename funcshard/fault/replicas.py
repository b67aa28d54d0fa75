"""Live fault tolerance across replica groups, through torchft.

Each replica group is its own job (its own world and mesh); a torchft lighthouse joins the
groups as HSDP's replicas. torchft's :class:`torchft.Manager` is the coordinator: every step
it forms a quorum of the live groups, averages each rank's gradient shard over the groups of
the quorum (its fault-tolerant all-reduce on a reconfigurable gloo process group), decides
whether the step is committed (``should_commit``) and heals a group that (re)starts from a
live peer's memory (torchft's process-group checkpoint transport). This module holds the
user's :class:`FaultTolerance` value and :class:`Replicas`, the manager of one rank; what a
state's values are on the wire is :mod:`funcshard.state.state`'s, how the step uses it
:mod:`funcshard.step.train`'s.

torchft is imported only here, and only when a :class:`Replicas` is made.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from funcshard.distributed import ops
from funcshard.distributed.ops import Pending
from funcshard.layout.strategy import OuterStrategy

__all__ = ["FaultTolerance", "Replicas", "LIGHTHOUSE_ENV", "check_init"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

_INSTALL = 'fault_tolerance needs torchft: pip install "funcshard[ft]"'


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """How a replica group joins the others (``fs.init(..., fault_tolerance=...)``).

    Args:
      replica_id: this group's name, the same on every rank of the group and different from
        every other group's (a restarted group takes its old name).
      min_replicas: the fewest groups a step may commit with.
      lighthouse: the lighthouse's address (``http://host:port``); None: the environment's
        ``TORCHFT_LIGHTHOUSE``.
      timeout: seconds a cross-group all-reduce, a commit or a heal may take; a quorum
        waits twice as long (a peer may first have to time out of a step this group broke,
        and then come to the quorum). A quorum that times out raises ``TimeoutError`` out of
        ``train_step`` with the state unchanged; the next call asks the lighthouse again. In
        ``fs.init`` it raises ``TimeoutError`` naming this group and the lighthouse, with the
        group's manager shut down (docs/fault-tolerance.md: when a retry may follow).
    """

    replica_id: str = "0"
    min_replicas: int = 1
    lighthouse: str | None = None
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.replica_id, str) or not self.replica_id or ":" in self.replica_id:
            raise ValueError(
                f"FaultTolerance: replica_id must be a non-empty string without ':', "
                f"got {self.replica_id!r}"
            )
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int):
            raise TypeError(
                f"FaultTolerance: min_replicas must be an int, got {self.min_replicas!r}"
            )
        if self.min_replicas < 1:
            raise ValueError(f"FaultTolerance: min_replicas must be >= 1, got {self.min_replicas}")
        if not (isinstance(self.timeout, int | float) and self.timeout > 0):
            raise ValueError(f"FaultTolerance: timeout must be > 0 seconds, got {self.timeout!r}")
        if self.lighthouse is not None and not (
            isinstance(self.lighthouse, str) and self.lighthouse
        ):
            raise ValueError(
                f"FaultTolerance: lighthouse must be an address such as 'http://host:29510' "
                f"or None (the environment's {LIGHTHOUSE_ENV}), got {self.lighthouse!r}"
            )

    def lighthouse_address(self) -> str:
        """The lighthouse's address: the argument, else the environment's."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                "FaultTolerance: no lighthouse address: pass lighthouse='http://host:port' or "
                f"set {LIGHTHOUSE_ENV} (start one with `torchft_lighthouse --min_replicas N`)"
            )
        return address


def _torchft() -> tuple[Any, Any, Any]:
    """torchft's Manager, ProcessGroupGloo and PGTransport; a clear error without it."""
    try:
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        raise ImportError(f"{_INSTALL} ({e})") from e
    return Manager, ProcessGroupGloo, PGTransport


StateDict = dict[str, Any]


class Replicas:
    """One rank's view of the replica groups: torchft's Manager and the step's quorum.

    The group's store (``MASTER_ADDR`` / ``MASTER_PORT``, as torchrun sets them) carries the
    manager's address from the group's rank 0 to the others. ``serve`` (given with each
    quorum) is what a healing peer receives; a state this group receives is returned by
    :meth:`quorum` / :meth:`join`.

    torchft decides per rank whether a rank heals (at step 0 each rank of a group may take a
    different peer group's rank as its source, and heal or not); after each quorum
    :meth:`agree` makes the ranks of a group agree (:func:`funcshard.state.state.heal`), so that
    all of them derive their compute copies, or none.
    """

    def __init__(self, ft: FaultTolerance, device: torch.device) -> None:
        manager_cls, pg_cls, transport_cls = _torchft()
        address = ft.lighthouse_address()
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing or not torch.distributed.is_initialized():
            raise RuntimeError(
                "fault_tolerance: each replica group is a torchrun job (or sets MASTER_ADDR / "
                "MASTER_PORT and initializes torch.distributed); missing: "
                + (", ".join(missing) or "torch.distributed.init_process_group")
            )
        self.ft = ft
        self.device = device
        self._serve: Callable[[], StateDict] | None = None
        self._received: StateDict | None = None
        # the identity of the state fs.init returned after its quorum (join's): the first
        # step reuses that quorum only for that very state (a restore replaces it)
        self._joined: Any = None
        # rank 0 publishes its manager's address in the group's store before the others read
        # it (a store that outlives a job, as torchrun's agent's, may hold an older one)
        if torch.distributed.get_rank() == 0:
            self.manager = self._manager(manager_cls, pg_cls, transport_cls, address)
        try:
            torch.distributed.barrier()
            if torch.distributed.get_rank() != 0:
                self.manager = self._manager(manager_cls, pg_cls, transport_cls, address)
        except BaseException:
            self.shutdown()  # nothing of this rank's left asking the lighthouse
            raise

    def _manager(self, manager_cls: Any, pg_cls: Any, transport_cls: Any, address: str) -> Any:
        ft = self.ft
        timeout = timedelta(seconds=float(ft.timeout))
        pg = pg_cls(timeout=timeout)
        return manager_cls(
            pg=pg,
            load_state_dict=self._receive,
            state_dict=self._send,
            min_replica_size=ft.min_replicas,
            use_async_quorum=False,  # heal before the step: its first step is the peers'
            timeout=timeout,
            # a peer may wait out a broken step's all-reduce (``timeout``) before it comes
            # to the quorum this group is already in: the quorum outlasts that
            quorum_timeout=2 * timeout,
            connect_timeout=timeout,
            rank=torch.distributed.get_rank(),
            world_size=torch.distributed.get_world_size(),
            lighthouse_addr=address,
            replica_id=ft.replica_id,
            checkpoint_transport=transport_cls(pg, timeout=timeout, device=torch.device("cpu")),
        )

    def _send(self) -> StateDict:
        assert self._serve is not None, "a quorum serves the state it was started with"
        return self._serve()

    def _receive(self, state_dict: StateDict) -> None:
        self._received = state_dict

    def join(self, serve: Callable[[], StateDict], step: int) -> StateDict | None:
        """The first quorum (inside ``fs.init``): the peers' state when this group heals,
        else None. :meth:`joined` then names the state it may be reused for."""
        return self.quorum(serve, step, None)

    def joined(self, identity: Any) -> None:
        """``fs.init`` returns the state of this identity: the first step reuses join's quorum
        if it is given this state, and asks for a new one if it is given another (a state
        restored from a checkpoint after ``fs.init``, whose step the quorum never saw)."""
        self._joined = identity

    def quorum(self, serve: Callable[[], StateDict], step: int, identity: Any) -> StateDict | None:
        """The step's quorum (join's, for the first step on the state ``fs.init`` returned):
        the peers' state when this group is behind them, else None.

        Raises:
          TimeoutError: no quorum formed within the quorum timeout; nothing changed, and the
            next call asks the lighthouse again.
        """
        self._serve = serve
        joined, self._joined = self._joined, None
        if (
            joined is not None
            and len(joined) == len(identity)
            and all(a is b for a, b in zip(joined, identity, strict=True))
        ):
            return None
        manager = self.manager
        manager.load_state_dict({"step": step, "batches_committed": manager.batches_committed()})
        self._received = None
        # torchft 0.2.0 keeps a failed quorum's future and re-raises its error at every later
        # start_quorum without asking the lighthouse: a group would stay wedged after one
        # timeout, even once its peers are back. A done, failed future is dropped here.
        future = manager._quorum_future
        if future is not None and future.done() and future.exception() is not None:
            manager._quorum_future = None
        manager.start_quorum()
        received, self._received = self._received, None
        return received

    def agree(self, healed: bool, moved: bool) -> tuple[bool, bool]:
        """Whether any rank of this group healed in the quorum, and whether any heal moved
        its step: a collective over the group's own world, so every rank of the group derives
        its compute copies (a collective under ZeRO-1/2) or none, and every rank refuses the
        batch or none."""
        flags = torch.tensor([float(healed), float(moved)], device=self.device)
        group = torch.distributed.group.WORLD
        flags = ops.all_reduce(flags, group, axis=ops.Axis.WORLD, kind="metrics")
        return bool(flags[0] > 0), bool(flags[1] > 0)

    @property
    def size(self) -> int:
        """The number of groups whose gradients this step averages."""
        return self.manager.num_participants()

    def start_all_reduce(self, tensor: torch.Tensor) -> Pending:
        """The mean of ``tensor`` over the quorum's groups (``tensor`` is read before this
        returns). A failure is torchft's to record: the step is then not committed."""
        return self._all_reduce(tensor, "all_reduce")

    def _all_reduce(self, tensor: torch.Tensor, kind: str, op: Any = None) -> Pending:
        x = tensor.clone()
        ops.record(kind, x, ops.Axis.REPLICAS)
        work = self.manager.allreduce(x) if op is None else self.manager.allreduce(x, reduce_op=op)
        return Pending(work, x)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the quorum's groups (``fs.summed``'s totals; a failure is
        torchft's to record, and the step is then not committed)."""
        return self._all_reduce(tensor, "metrics", torch.distributed.ReduceOp.SUM).wait()

    def mean(self, value: float) -> float:
        """A scalar's mean over the quorum's groups (the step's loss)."""
        loss = torch.tensor([value], dtype=torch.float64)
        return float(self._all_reduce(loss, "metrics").wait())

    def commit(self) -> bool:
        """Whether every rank of every group of the quorum may apply the step (torchft's
        ``should_commit``: no error anywhere in the group, enough replicas)."""
        return bool(self.manager.should_commit())

    def no_quorum(self, error: BaseException) -> str:
        """What ``fs.init`` says when its first quorum timed out (torchft's ``error``)."""
        ft = self.ft
        return (
            f"fs.init: replica group {ft.replica_id!r} formed no quorum at the lighthouse "
            f"{ft.lighthouse_address()} within {2 * float(ft.timeout):g} s (twice "
            f"FaultTolerance.timeout; min_replicas={ft.min_replicas} here, the lighthouse's "
            "--min_replicas may ask for more groups): too few groups alive, or the lighthouse "
            f"is unreachable. This group's manager is shut down; fs.init may be called again. "
            f"(torchft: {error})"
        )

    def shutdown(self) -> None:
        """Stops this rank's manager (its server, its checkpoint transport): it no longer
        asks the lighthouse for quorums nor answers peers."""
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.shutdown(wait=False)


def check_init(
    ft: FaultTolerance | None, outer: str | OuterStrategy, named: dict[str, Any]
) -> None:
    """Refuses what ``fs.init(fault_tolerance=ft)`` cannot do, naming it."""
    if ft is None:
        return
    if not isinstance(ft, FaultTolerance):
        raise TypeError(
            f"init: fault_tolerance must be an fs.FaultTolerance or None, got {type(ft).__name__}"
        )
    if OuterStrategy.parse(outer, what="outer_strategy") is not OuterStrategy.NO_SHARD:
        raise ValueError(
            f"init: fault_tolerance needs outer_strategy='no_shard', got {str(outer)!r} (a lost "
            "group would take the masters and optimizer state it alone holds with it)"
        )
    meta = [n for n, p in named.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"init: fault_tolerance needs the model's weights (a group may serve them to a "
            f"peer in fs.init); {meta[0]!r} is on the meta device"
        )
