"""The old import path of :mod:`funcshard.comm.grads` (``funcshard.units.run`` still uses it)."""

from funcshard.comm.grads import ReplicateAxis  # noqa: F401
