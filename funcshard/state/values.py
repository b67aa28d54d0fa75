"""A state's values in plain containers, and a state rebuilt from them: what a healing
replica group receives from a live peer, and what the local checkpoint tier keeps of a rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from funcshard.layout.buckets import NAMESPACE
from funcshard.state.buffers import ModelBuffers
from funcshard.state.derive import derive_compute
from funcshard.state.state import LossScale, TrainState

__all__ = ["values", "load_values"]


def values(state: TrainState) -> dict[str, Any]:
    """Every value of ``state`` but the derived compute copies: masters, optimizer state
    leaves, step, loss scale (offloaded parts included), the model's persistent buffers
    (:mod:`funcshard.state.buffers`), in plain containers. What a healing
    replica group receives, and what the local checkpoint tier keeps of each rank."""
    leaves = optree.tree_leaves(state.opt_state, none_is_leaf=True, namespace=NAMESPACE)
    ls = state.loss_scale
    return {
        "master": list(state.master),
        "opt_state": list(leaves),
        "step": state.step,
        "loss_scale": None if ls is None else [ls.scale, ls.good_steps],
        "buffers": {n: t.detach() for n, t in state.buffers.values().items()},
    }


def load_values(state: TrainState, received: dict[str, Any] | None, by: str = "heal") -> TrainState:
    """``state`` (donated) with ``received`` (:func:`values`, a peer's or a saved one) copied
    into its buffers (None: its own values) and the compute copies derived from them (a
    collective under ZeRO-1/2).

    Raises:
      ValueError: another count of leaves, or a leaf of another shape or dtype, naming it.
    """
    d = state.donate(by)
    if received is None:
        return d.state(compute=derive_compute(d.layout, d.master))
    leaves, treedef = optree.tree_flatten(d.opt_state, none_is_leaf=True, namespace=NAMESPACE)
    ours = enumerate(_pairs(d.master, received, "master"))
    master = tuple(_copy_into(m, r, f"master[{i}]") for i, (m, r) in ours)
    opt = [
        _copy_into(x, r, f"opt_state leaf {i}") if isinstance(x, torch.Tensor) else r
        for i, (x, r) in enumerate(_pairs(leaves, received, "opt_state"))
    ]
    ls = received["loss_scale"]
    _load_buffers(d.static.buffers, received.get("buffers", {}))
    return TrainState(
        master=master,
        compute=derive_compute(d.layout, master),
        opt_state=optree.tree_unflatten(treedef, opt),
        step=int(received["step"]),
        loss_scale=None if ls is None else LossScale(float(ls[0]), int(ls[1])),
        static=d.static,
    )


@torch.no_grad()
def _load_buffers(buffers: ModelBuffers, received: dict[str, torch.Tensor]) -> None:
    """The received values of the model's persistent buffers, copied into the model's own
    (those both hold; checked like the other leaves)."""
    for name in buffers.names:
        if name in received:
            _copy_into(buffers.get(name), received[name], f"buffer {name!r}")
            buffers.load(name, buffers.get(name))  # every stage holding it (a pipeline's)


def _pairs(ours: Sequence[Any], received: dict[str, Any], key: str) -> list[tuple[Any, Any]]:
    """(ours, the received) leaf by leaf; refuses another count."""
    theirs = received[key]
    if len(theirs) != len(ours):
        raise ValueError(
            f"the received {key} has {len(theirs)} leaves, this state's {len(ours)} "
            "(the same model, optimizer and layout are needed)"
        )
    return list(zip(ours, theirs, strict=True))


def _copy_into(ours: torch.Tensor, theirs: Any, what: str) -> torch.Tensor:
    """``ours`` with the received values; refuses another shape or dtype."""
    if (
        not isinstance(theirs, torch.Tensor)
        or theirs.shape != ours.shape
        or theirs.dtype != ours.dtype
    ):
        got = (tuple(theirs.shape), theirs.dtype) if isinstance(theirs, torch.Tensor) else theirs
        raise ValueError(
            f"the received {what} is {got}, this state's {(tuple(ours.shape), ours.dtype)} "
            "(the same model, optimizer and layout are needed)"
        )
    return ours.copy_(theirs)
