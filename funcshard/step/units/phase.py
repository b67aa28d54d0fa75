"""Where a run and its units are, stored rather than inferred (FSDP2's ``TrainingState``)."""

from __future__ import annotations

import enum

__all__ = ["Phase", "UnitState"]


class Phase(enum.Enum):
    """The phase of one :class:`~funcshard.step.units.run.UnitRun`.

    A unit's forward in ``BACKWARD`` is a recomputation (activation checkpointing): it runs on
    the unit's re-gathered params, takes no collective of its own, and does not count as a
    use of the bucket in forward.
    """

    FORWARD = "forward"  # loss_fn is running
    BACKWARD = "backward"  # the run's backward is running (recomputations happen here)
    DONE = "done"  # backward is over; the run only closes


class UnitState(enum.Enum):
    """What one unit holds (each unit of a run has its own)."""

    IDLE = "idle"  # nothing gathered; the module holds placeholders (or its own params)
    FORWARD = "forward"  # gathered for its forward (pre-forward to post-forward)
    BACKWARD = "backward"  # re-gathered for its backward (pre-backward to its release)
