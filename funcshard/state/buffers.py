"""The model's persistent buffers as a state knows them: what checkpoints carry beside the params.

A buffer (a router's bias, BatchNorm's running statistics) is not trained by the step: the
user's loop or the forward updates it in place in the model, and the forward reads it there.
The model stays its one source of truth: a state holds the model and its persistent buffers'
NAMES (``fs.init`` records them), never a copy, and ``fs.save`` / ``CheckpointManager`` read
each buffer's current value from the model when they write; ``fs.restore`` copies the saved
values into the buffers of ``like``'s model, in place. Every rank holds the same values (a
loop that updates a buffer from a global quantity, such as ``fs.summed``'s load, does so on
every rank alike), so one rank writes them.

Carried: persistent plain-tensor buffers (what ``model.state_dict()`` holds beside the
params). Not carried: non-persistent buffers (``persistent=False``: derived, such as rotary
frequencies), DTensor buffers, and buffers on the meta device (an unfilled state's model).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ModelBuffers"]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelBuffers:
    """A model and the names of the persistent buffers its checkpoints carry."""

    model: nn.Module | None = None
    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> ModelBuffers:
        """The persistent plain-tensor buffers of ``model`` (see the module docstring).

        Raises:
          TypeError: a buffer of a dtype no checkpoint can hold (named, with its dtype).
        """
        # imported here: the checkpoint package imports the state's modules
        from funcshard.checkpoint.format import ZARR_DTYPE

        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names = [
            n
            for n, t in model.state_dict(keep_vars=True).items()
            if n not in params
            and isinstance(t, torch.Tensor)
            and not isinstance(t, DTensor)
            and t.device.type != "meta"
        ]
        for n in names:
            dtype = model.get_buffer(n).dtype
            if dtype not in ZARR_DTYPE:
                raise TypeError(
                    f"init: the model's persistent buffer {n!r} has dtype {dtype}, which no "
                    "checkpoint can hold (saved: "
                    + ", ".join(str(d).removeprefix("torch.") for d in ZARR_DTYPE)
                    + "); register it with persistent=False, or keep it in one of those"
                )
        return cls(model, tuple(names))

    def get(self, name: str) -> torch.Tensor:
        """Buffer ``name``'s tensor as the model holds it now (it may have been reassigned)."""
        assert self.model is not None
        return self.model.get_buffer(name)

    def values(self) -> dict[str, torch.Tensor]:
        """Every carried buffer's current tensor (the model's own, not a copy)."""
        return {n: self.get(n) for n in self.names}


NO_BUFFERS = ModelBuffers()
