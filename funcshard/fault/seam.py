"""The one seam through which fault tolerance enters ``fs.init`` and ``train_step``.

A state holds a guard: :data:`SOLO` for a run without fault tolerance (it does nothing), or a
:class:`Group` of torchft replica groups. ``init`` asks the guard to ``join`` (a group behind
its peers heals from them there); every step asks it to ``begin`` (the step's quorum, and a
heal when this group is behind) and to ``end`` (whether the step may change the state:
torchft's commit). Nothing else of funcshard knows of quorums, heals or commits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from funcshard.fault.replicas import FaultTolerance, Replicas
from funcshard.state.state import TrainState
from funcshard.state.values import load_values, values

__all__ = ["SOLO", "Group", "guard_for", "heal"]


class Solo:
    """No fault tolerance: every step commits, nothing heals."""

    across = None  # no replica groups to average the gradients over

    def join(self, state: TrainState) -> TrainState:
        return state

    def begin(self, state: TrainState) -> tuple[TrainState, dict[str, Any] | None]:
        return state, None

    def end(self, state: TrainState, metrics: dict[str, Any]) -> bool:
        return True

    def total(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        return sums

    def shutdown(self) -> None:
        pass

    @contextlib.contextmanager
    def shut_down_on_error(self) -> Iterator[None]:
        yield

    def __repr__(self) -> str:
        return "SOLO"


SOLO = Solo()


class Group:
    """This rank's replica group among the others (torchft): quorums, heals and commits."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    @property
    def across(self) -> Replicas:
        """What the step's gradient shards are averaged over after the group's own axes."""
        return self.replicas

    def join(self, state: TrainState) -> TrainState:
        """``fs.init``'s quorum: a group behind its peers takes their state, step included.

        Raises:
          TimeoutError: no quorum formed in time (naming the lighthouse and the group).
        """
        try:
            received = self.replicas.join(lambda: values(state), step=0)
        except TimeoutError as e:
            raise TimeoutError(self.replicas.no_quorum(e)) from e
        state, _ = heal(state, received)
        self.replicas.joined(state.identity)
        return state

    def begin(self, state: TrainState) -> tuple[TrainState, dict[str, Any] | None]:
        """The step's quorum: ``(state, None)``, or, when the group healed to the peers' other
        step, ``(their state, metrics)``: the caller's batch was built for the step the group
        left, so nothing is computed or averaged."""
        received = self.replicas.quorum(lambda: values(state), state.step, state.identity)
        state, moved = heal(state, received)
        if not moved:
            return state, None
        metrics: dict[str, Any] = {"loss": math.nan, "grad_norm": math.nan, "nonfinite": 0}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        metrics.update(replicas=self.replicas.size, committed=0, healed=1)
        return state, metrics

    def total(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        """The step's ``fs.summed`` totals of this group (float64, summed over its ranks),
        summed over the quorum's groups too: every group's tokens counted once (a group that
        heals counts none)."""
        return None if sums is None else self.replicas.sum(sums)

    def end(self, state: TrainState, metrics: dict[str, Any]) -> bool:
        """Whether the step may change the state: the quorum's groups all finished (torchft's
        ``should_commit``); the metrics get the groups' mean loss and the commit."""
        metrics["loss"] = self.replicas.mean(metrics["loss"])
        metrics["replicas"] = self.replicas.size
        metrics["healed"] = 0
        metrics["committed"] = int(self.replicas.commit())
        return bool(metrics["committed"])

    def shutdown(self) -> None:
        self.replicas.shutdown()

    @contextlib.contextmanager
    def shut_down_on_error(self) -> Iterator[None]:
        """The block (the rest of ``fs.init``), with this rank's manager shut down when it
        raises: a retry in the same process must not meet the manager of the failed call at
        the lighthouse as a second group."""
        try:
            yield
        except BaseException:
            self.shutdown()
            raise


def guard_for(ft: FaultTolerance | None, device: torch.device) -> Solo | Group:
    """The guard ``fs.init(fault_tolerance=ft)`` gives its state, once every rank has passed
    :func:`~funcshard.fault.replicas.check_init` (``fs.init`` checks inside its agreement:
    the manager's constructor waits for the group's other ranks)."""
    return SOLO if ft is None else Group(Replicas(ft, device))


def heal(state: TrainState, received: dict[str, Any] | None) -> tuple[TrainState, bool]:
    """A fault-tolerant state after its group's quorum: ``state`` itself when no rank of the
    group healed, else (donated) with the peer's values where this rank received them
    (``received``, from :meth:`funcshard.fault.replicas.Replicas.quorum`) and every rank's
    compute copies derived again (the ranks of a group agree first: torchft may heal one rank
    of a group and not the other, and under ZeRO-1/2 deriving is an all-gather over the group).

    Returns:
      ``(state, moved)``: ``moved`` when the heal changed the group's step (the caller's
      batch, built for the old step, is then not this state's).
    """
    replicas = state.guard.replicas
    moved = received is not None and int(received["step"]) != state.step
    healed, moved = replicas.agree(received is not None, moved)
    if not healed:
        return state, False
    return load_values(state, received), moved
