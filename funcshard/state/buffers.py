"""The model's persistent buffers as a state knows them: what checkpoints carry beside the params.

A buffer (a router's bias, BatchNorm's running statistics) is not trained by the step: the
user's loop or the forward updates it in place in the model, and the forward reads it there.
The model stays its one source of truth: a state holds the model and its persistent buffers'
NAMES (``fs.init`` records them), never a copy, and ``fs.save`` / ``CheckpointManager`` read
each buffer's current value from the model when they write; ``fs.restore`` copies the saved
values into the buffers of ``like``'s model, in place. One rank writes them (the first of the
data-parallel world of tensor rank 0), so they must agree across the data-parallel ranks.

What keeps them agreeing is ``fs.init``'s ``buffers``: ``"broadcast"`` (the default, DDP's
rule) sends the first rank's values to every data-parallel rank after each applied step (one
broadcast of their bytes; nothing when the model has none), so a forward that updates them
from this rank's batch (BatchNorm's running statistics) leaves every rank with the values the
checkpoint holds, and :func:`funcshard.check_replicas` compares them across those ranks;
``"local"`` leaves each rank's own values (a loop that keeps them equal itself, or buffers
that differ by design: the checkpoint then holds the first rank's) and the check skips them.
Either way a step that changes nothing (a nonfinite gradient, a step a fault-tolerant quorum
did not commit, an error) puts back the values they held before it: the forward's updates
are undone (:meth:`ModelBuffers.snapshot`, a copy of the buffers per step).

Carried: persistent plain-tensor buffers (what ``model.state_dict()`` holds beside the
params). Not carried: non-persistent buffers (``persistent=False``: derived, such as rotary
frequencies) and DTensor buffers. An unfilled state's (meta-device) model's buffers are
carried too: ``fs.restore`` gives them the checkpoint's values on the state's device.

Under a pipeline the model is the merge of this rank's stages (read, never run) and the
buffers live in the stages that run them: ``stages`` (this rank's). A buffer on a module every
stage keeps (the root, a cut container) is each stage's own copy (``fs.init`` copies it for a
rank's second stage on, as torchtitan's stages, each a copy of the model, have it), so a
forward updating it in place does so once a microbatch, as the unsplit model's does. A buffer
is read (and saved) from the first of this rank's stages holding it; :meth:`ModelBuffers.load`
puts a value into every one of them and the merge (a stage module the split copied is not the
merge's: a buffer given to the merge alone, a meta-device model's made by a restore, would
never reach the stage); the step's snapshot and broadcast cover every stage's copy.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from funcshard.distributed import dtensor as dt
from funcshard.distributed import ops
from funcshard.state.dtypes import ZARR_DTYPE

__all__ = ["ModelBuffers", "BUFFER_MODES", "mode"]

BUFFER_MODES = ("broadcast", "local")


def mode(buffers: Any) -> str:
    """``fs.init``'s ``buffers``, checked: ``"broadcast"`` or ``"local"``."""
    if buffers not in BUFFER_MODES:
        raise ValueError(
            f"init: buffers must be one of {', '.join(map(repr, BUFFER_MODES))}, got {buffers!r}"
        )
    return buffers


@dataclasses.dataclass(frozen=True, eq=False)
class ModelBuffers:
    """A model and the names of the persistent buffers its checkpoints carry."""

    model: nn.Module | None = None
    names: tuple[str, ...] = ()
    mode: str = "broadcast"  # fs.init's buffers: what keeps the ranks' values agreeing
    # under a pipeline: per buffer, this rank's stages holding it (see the module docstring)
    holders: dict[str, tuple[nn.Module, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls, model: nn.Module, mode: str = "broadcast", stages: tuple[nn.Module, ...] = ()
    ) -> ModelBuffers:
        """The persistent plain-tensor buffers of ``model`` (see the module docstring);
        ``stages``: under a pipeline, this rank's stages (``model`` their merge).

        Raises:
          TypeError: a buffer of a dtype no checkpoint can hold (named, with its dtype).
        """
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        names = [
            n
            for n, t in model.state_dict(keep_vars=True).items()
            if n not in params and isinstance(t, torch.Tensor) and not dt.is_dtensor(t)
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
        holders = {n: tuple(s for s in stages if _holds(s, n)) for n in names}
        return cls(model, tuple(names), mode, {n: h for n, h in holders.items() if h})

    def get(self, name: str) -> torch.Tensor:
        """Buffer ``name``'s tensor as the model (under a pipeline: the first of this rank's
        stages holding it) holds it now (it may have been reassigned)."""
        assert self.model is not None
        return self._trees(name)[0].get_buffer(name)

    def _trees(self, name: str) -> tuple[nn.Module, ...]:
        """The module trees holding buffer ``name``: the stages running it, then the model."""
        assert self.model is not None
        return (*self.holders.get(name, ()), self.model)

    @torch.no_grad()
    def load(self, name: str, value: torch.Tensor, device: torch.device | None = None) -> None:
        """``value`` into buffer ``name`` of every tree holding it: copied in place where a
        tree's tensor has its shape and dtype and is not on the meta device, else ``value``
        (moved to ``device``, the tree's tensor's when None) put in its place: trees that
        shared a tensor share the new one, each other tree gets a copy of its own."""
        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old): (old, new)
        for tree in self._trees(name):
            buf = tree.get_buffer(name)
            if buf.device.type != "meta" and buf.shape == value.shape and buf.dtype == value.dtype:
                if buf is not value:
                    buf.copy_(value)
                continue
            if id(buf) not in made:
                where = device if device is not None else buf.device
                made[id(buf)] = (buf, value.to(where, copy=bool(made)))
            owner, _, leaf = name.rpartition(".")
            setattr(tree.get_submodule(owner), leaf, made[id(buf)][1])

    def _each(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """``(tree, name, tensor)`` of every tree's tensor of every carried buffer."""
        return [(t, n, t.get_buffer(n)) for n in self.names for t in self._trees(n)]

    def values(self) -> dict[str, torch.Tensor]:
        """Every carried buffer's current tensor (the model's own, not a copy)."""
        return {n: self.get(n) for n in self.names}

    @property
    def agree(self) -> bool:
        """Whether every data-parallel rank must hold the same values (``"broadcast"``)."""
        return self.mode == "broadcast" and bool(self.names)

    def on_meta(self) -> list[str]:
        """The model's buffers (non-persistent ones too) still on the meta device: a state
        built from a meta-device model and restored holds every persistent buffer, but the
        non-persistent ones (derived: rotary tables, masks) are no checkpoint's to give. A
        model found with none is not looked at again (a buffer made stays made)."""
        if self.model is None or self.model in _MADE:
            return []
        meta = [n for n, b in self.model.named_buffers() if b.is_meta]
        if not meta:
            _MADE.add(self.model)
        return meta

    def snapshot(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """A copy of every carried buffer's values in every tree (before a step that may be
        undone; a tensor several trees share copied once)."""
        copies: dict[int, torch.Tensor] = {}
        for _, _, t in self._each():
            if id(t) not in copies:
                copies[id(t)] = t.detach().clone()
        return [(tree, n, copies[id(t)]) for tree, n, t in self._each()]

    @torch.no_grad()
    def put_back(self, kept: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        """The values of :meth:`snapshot` copied back into the model's buffers, in place (a
        buffer the step reassigned: the tensor it was before, as it was)."""
        for tree, n, t in kept:
            buf = tree.get_buffer(n)
            if buf.shape == t.shape and buf.dtype == t.dtype:
                buf.copy_(t)
            else:
                owner, _, leaf = n.rpartition(".")
                setattr(tree.get_submodule(owner), leaf, t)

    @torch.no_grad()
    def broadcast(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Every carried buffer set to the first rank of ``group``'s values (under
        ``"broadcast"``; one collective of their bytes, counted as "buffers" on "world")."""
        if not self.agree or dist.get_world_size(group) == 1:
            return
        tensors = list({id(t): t for _, _, t in self._each()}.values())  # every stage's copy
        parts = [t.detach().reshape(-1).view(torch.uint8).to(device) for t in tensors]
        flat = torch.cat(parts)
        ops.record("buffers", flat, ops.Axis.WORLD)
        dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
        for t, part in zip(tensors, flat.split([p.numel() for p in parts]), strict=True):
            # a part's offset in the bytes need not suit its dtype (an int64 counter after 12
            # bytes of floats): a copy of it starts aligned
            t.copy_(part.clone().view(t.dtype).reshape(t.shape))


def _holds(tree: nn.Module, name: str) -> bool:
    try:
        tree.get_buffer(name)
    except AttributeError:  # another stage's module (removed: an nn.Identity, or dropped)
        return False
    return True


NO_BUFFERS = ModelBuffers()


# models whose buffers are all made (ModelBuffers.on_meta)
_MADE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
