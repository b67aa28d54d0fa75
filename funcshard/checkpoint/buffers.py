"""Restoring the model's persistent buffers (:mod:`funcshard.state.buffers`) a checkpoint holds
as ``("buffers", name)`` arrays: every rank reads each whole and copies it into the buffer of
``like``'s model, in place. A buffer the checkpoint lacks (one written before buffers were
carried, a Hugging Face or DCP checkpoint) keeps the model's value."""

from __future__ import annotations

import torch

from funcshard.checkpoint.format import param_dir
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.state.state import TrainState

__all__ = ["buffer_reads", "copy_into_model"]


def buffer_reads(like: TrainState, source: Source) -> tuple[list[ReadRequest], list[str]]:
    """Reads of every carried buffer of ``like``'s model that ``source`` holds (into fresh
    CPU tensors of the buffer's dtype), and the mismatches (a shape that differs) named."""
    found = source.arrays()
    reads, problems = [], []
    for name, tensor in like.buffers.values().items():
        keys = ("buffers", name)
        if keys not in found:
            continue
        shape = tuple(found[keys][0])
        if shape != tuple(tensor.shape):
            problems.append(
                f"{param_dir(keys)}: shape {shape} in the checkpoint, expected "
                f"{tuple(tensor.shape)} (the model's buffer)"
            )
            continue
        rows = tensor.shape[0] if tensor.dim() else 1
        out = torch.empty(rows, *tensor.shape[1:], dtype=tensor.dtype)
        reads.append(ReadRequest(keys, 0, rows, out))
    return reads, problems


@torch.no_grad()
def copy_into_model(like: TrainState, reads: list[ReadRequest]) -> None:
    """The values ``reads`` read, copied into the model's buffers."""
    for r in reads:
        buf = like.buffers.get(r.keys[1])
        buf.copy_(r.out.reshape(buf.shape))
