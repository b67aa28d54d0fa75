"""What is sharded: the ZeRO stage over the "shard" axis, and room for one over "replicate".

A strategy is a value with predicates; code asks ``strategy.shards_grads`` instead of
comparing names. The names are Megatron-FSDP's and stay the spelling users pass
(``fs.init(..., strategy="optim")``); a :class:`Strategy` compares equal to its name.

>>> Strategy.parse("optim_grads").shards_grads
True
>>> Strategy.parse("optim").shards_params
False
>>> Strategy.OPTIM_GRADS_PARAMS == "optim_grads_params"
True
"""

from __future__ import annotations

import enum

__all__ = ["Strategy", "OuterStrategy"]


class _Named(str, enum.Enum):
    """A str enum whose ``str()`` and format are its name as users spell it."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: str | _Named, *, what: str = "strategy"):
        """The member named ``value``.

        Raises:
          ValueError: ``value`` names no member (the message lists the valid names).
        """
        try:
            return cls(value)
        except ValueError:
            names = tuple(m.value for m in cls)
            raise ValueError(f"unknown {what} {value!r}; expected one of {names}") from None


class Strategy(_Named):
    """The ZeRO stage over the "shard" axis (ZeRO 0-3)."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def shards_optim(self) -> bool:
        """Master weights and optimizer state are sharded over "shard" (ZeRO 1-3)."""
        return self is not Strategy.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered into shards every microbatch (ZeRO 2-3)."""
        return self in (Strategy.OPTIM_GRADS, Strategy.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        """Compute params are sharded and gathered unit by unit (ZeRO-3)."""
        return self is Strategy.OPTIM_GRADS_PARAMS

    @property
    def runs_units(self) -> bool:
        """Forward and backward run unit by unit, reducing each unit as backward ends it."""
        return self.shards_grads

    @property
    def keeps_full_compute(self) -> bool:
        """Full compute params persist between steps (ZeRO 0-2), gathered after the update."""
        return not self.shards_params


class OuterStrategy(_Named):
    """What is sharded over the "replicate" axis (Megatron-FSDP's outer strategy).

    ``NO_SHARD``: each replica keeps its shard group's masters and optimizer state whole
    (HSDP); gradient shards are all-reduced over "replicate".
    """

    NO_SHARD = "no_shard"
    OPTIM = "optim"

    @property
    def shards_optim(self) -> bool:
        """Masters and optimizer state are sharded over "replicate" too (HFSDP)."""
        return self is OuterStrategy.OPTIM
