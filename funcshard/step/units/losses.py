"""What ``loss_fn`` returned, as the producers read it: the loss and its aux, the value the step
sums, and the backward of a DTensor loss."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import optree
import torch

from funcshard.distributed import dtensor as dt
from funcshard.step.summed import Summed

__all__ = ["copied_out", "described", "loss_and_aux", "reported", "dtensor_backward"]


def loss_and_aux(out: Any) -> tuple[torch.Tensor, Any]:
    """Splits what ``loss_fn`` returned into a 0-d loss and its aux (None when absent). The
    loss may be a DTensor (torch's ``loss_parallel``): its backward runs as a DTensor's."""
    loss, aux = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar tensor or (loss, aux); got {described(loss)}"
        )
    return loss.reshape(()), aux


def described(loss: Any) -> str:
    """What a loss that is not a scalar was, for an error: a tensor by its shape (its values
    may be many), anything else by its type."""
    if isinstance(loss, torch.Tensor):
        return f"a tensor of shape {tuple(loss.shape)}"
    return str(type(loss))


def reported(loss: torch.Tensor) -> torch.Tensor:
    """The loss's value as the step sums it: a plain tensor, a DTensor's full value."""
    loss = loss.detach()
    return loss.full_tensor() if dt.is_dtensor(loss) else loss


@contextlib.contextmanager
def dtensor_backward(loss: torch.Tensor) -> Iterator[None]:
    """Around a backward of ``loss``: a DTensor loss whose backward meets a plain tensor (a
    cross-entropy made under ``loss_parallel``, whose context is left) raises ValueError
    saying where the context belongs."""
    try:
        yield
    except RuntimeError as e:
        if not dt.is_dtensor(loss) or "got mixed torch.Tensor and DTensor" not in str(e):
            raise
        raise ValueError(
            "train_step: loss_fn returned a DTensor loss whose backward meets plain tensors: "
            "torch's loss_parallel needs its backward inside the context too, and funcshard "
            "runs the backward after loss_fn returns; call the step inside it "
            "(with loss_parallel(): fs.train_step(...)) rather than inside loss_fn"
        ) from e


def copied_out(aux: Any) -> Any:
    """``aux`` with each tensor leaf (an ``fs.summed``'s value too) a copy: a CUDA graph's
    replay overwrites the static buffers its outputs live in."""

    def copy(x: Any) -> Any:
        if isinstance(x, Summed):
            return Summed(x.value.clone())
        return x.clone() if isinstance(x, torch.Tensor) else x

    return optree.tree_map(copy, aux, is_leaf=lambda x: isinstance(x, Summed), none_is_leaf=True)
