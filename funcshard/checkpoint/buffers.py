"""Restoring the model's persistent buffers (:mod:`funcshard.state.buffers`) a checkpoint holds
as ``("buffers", name)`` arrays: every rank reads each whole and copies it into the buffer of
``like``'s model, in place, bit for bit.

A checkpoint that holds buffers must hold exactly the model's, each of the model's shape and
dtype: a buffer on one side only, or of another shape or dtype, is a mismatch (named, the
model's beside the checkpoint's), as a parameter's is. A checkpoint that holds no buffer at
all (one written before buffers were carried, or from a model without persistent buffers, a
Hugging Face or DCP checkpoint) leaves every buffer of the model as it is.
"""

from __future__ import annotations

import torch

from funcshard.checkpoint.format import param_dir
from funcshard.checkpoint.sources import ReadRequest, Source
from funcshard.state.state import TrainState

__all__ = ["buffer_reads", "copy_into_model"]


def _described(shape: tuple[int, ...], dtype: str) -> str:
    return f"shape {shape} dtype {dtype}"


def buffer_reads(
    like: TrainState, source: Source, others: frozenset[str] = frozenset()
) -> tuple[list[ReadRequest], list[str]]:
    """Reads of every carried buffer of ``like``'s model (into fresh CPU tensors of the
    buffer's dtype), and the mismatches named (see the module docstring). ``others``: the
    buffers of a pipelined state's other stages (in the checkpoint, not read here)."""
    stored = {k[1]: v for k, v in source.arrays().items() if len(k) == 2 and k[0] == "buffers"}
    if not stored:
        return [], []
    ours = like.buffers.values()
    reads, problems = [], []
    for name, tensor in ours.items():
        keys = ("buffers", name)
        want = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        if name not in stored:
            problems.append(
                f"{param_dir(keys)}: missing from the checkpoint (the model's buffer: "
                f"{_described(*want)}); the checkpoint's buffers: "
                + ", ".join(f"{n} {_described(*v)}" for n, v in sorted(stored.items()))
            )
            continue
        got = (tuple(stored[name][0]), stored[name][1])
        if got != want:
            problems.append(
                f"{param_dir(keys)}: {_described(*got)} in the checkpoint, expected "
                f"{_described(*want)} (the model's buffer)"
            )
            continue
        rows = tensor.shape[0] if tensor.dim() else 1
        out = torch.empty(rows, *tensor.shape[1:], dtype=tensor.dtype)
        reads.append(ReadRequest(keys, 0, rows, out))
    for name in sorted(set(stored) - set(ours) - others):
        problems.append(
            f"{param_dir(('buffers', name))}: in the checkpoint ({_described(*stored[name])}) "
            "but not a persistent buffer of the model; the model's: "
            + (", ".join(sorted(ours)) or "none")
        )
    return reads, problems


@torch.no_grad()
def copy_into_model(like: TrainState, reads: list[ReadRequest]) -> None:
    """The values ``reads`` read, copied into the model's buffers (under a pipeline, into
    every one of this rank's stages holding each); an unfilled state's (meta-device) model's
    buffers are made here, on the state's device."""
    for r in reads:
        name = r.keys[1]
        like.buffers.load(name, r.out.reshape(like.buffers.get(name).shape), like.layout.device)
