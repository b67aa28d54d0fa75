"""Torch TP's batch rule, checked: every rank of a tensor group passes the same local batch.

A wrong split (by global rank instead of the data-parallel index) trains silently wrong;
:func:`batch_fingerprint` reads every byte of a batch leaf cheaply, and
:class:`TensorBatchCheck` compares a digest of the fingerprints and the loss over "tensor".
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from funcshard.distributed import ops

__all__ = ["batch_fingerprint", "leaf_paths", "TensorBatchCheck"]


class TensorBatchCheck:
    """One step's check of a tensor group's batch: the fingerprint taken as the batch was
    passed (before ``loss_fn`` sees it), compared with the losses after the microbatches."""

    def __init__(self, tensor: Any, batch: Any, device: torch.device) -> None:
        self.tensor = tensor
        self.device = device
        self.paths, self.fingerprint = batch_fingerprint(batch, device)
        self.why: str | None = None

    def flag(self, losses: Sequence[torch.Tensor]) -> float:
        """1.0 where this tensor group did not step on one batch; the verdict then travels
        with the loss over the data-parallel world, so every rank raises, or none."""
        loss = torch.stack([loss.double() for loss in losses]).sum().to(self.device)
        self.why = self._apart(self.paths, self.fingerprint, loss)
        return float(self.why is not None)

    def raise_if(self, apart: float) -> None:
        if apart:
            raise ValueError(
                "train_step: every rank of a tensor group must step on the same local batch "
                "(torch TP's rule: split the global batch by the data-parallel index, "
                "replicate * shard, not the global rank); "
                f"{self.why or 'the ranks of another tensor group did not (their error says how)'}"
            )

    def _apart(
        self, paths: tuple[str, ...], fingerprint: torch.Tensor, loss: torch.Tensor
    ) -> str | None:
        """Why this tensor group's ranks did not run on the same batch, or None.

        One all-gather over "tensor" (counted under "metrics") of four words whatever the
        batch: a digest of this rank's :func:`batch_fingerprint` (its leaves' rows summed with
        odd weights, modulo 2^64) and its loss. Only where the digests differ, a second one
        of every leaf's fingerprint names the batch leaves that differ from tensor rank 0's,
        with the ranks; the same bytes but losses apart (1e-3 relative: the model's
        reductions may round apart) say the model draws other random numbers per tensor
        rank."""
        odd = torch.arange(1, 2 * fingerprint.shape[0], 2, dtype=torch.int64)
        digest = (fingerprint * odd.to(fingerprint.device).unsqueeze(1)).sum(dim=0)
        local = torch.cat([digest.reshape(-1), loss.double().reshape(1).view(torch.int64)])
        every = ops.all_gather(local, self.tensor.group, axis=ops.Axis.TENSOR, kind="metrics")
        rows = every.view(self.tensor.size, -1).tolist()  # one sync; the rest is Python on ints
        losses = [struct.unpack("<d", struct.pack("<q", row[-1]))[0] for row in rows]
        if any(row[:-1] != rows[0][:-1] for row in rows):
            return self._leaves_apart(paths, fingerprint)
        if not all(math.isfinite(v) for v in losses):
            return None  # a nonfinite loss: the step is skipped as any other
        if max(losses) - min(losses) > 1e-3 * max(abs(v) for v in losses):
            ranks = dist.get_process_group_ranks(self.tensor.group)
            return (
                f"the tensor group of ranks {ranks} passed the same bytes but their losses "
                f"differ ({losses}): the model draws other random numbers per tensor rank "
                "(dropout seeded by rank?)"
            )
        return None

    def _leaves_apart(self, paths: tuple[str, ...], fingerprint: torch.Tensor) -> str:
        """The batch leaves whose fingerprint differs from tensor rank 0's, with the ranks (an
        all-gather of every leaf's fingerprint: only once the digests differ)."""
        every = ops.all_gather(
            fingerprint.reshape(-1), self.tensor.group, axis=ops.Axis.TENSOR, kind="metrics"
        )
        prints = every.view(self.tensor.size, len(paths), -1).tolist()
        ranks = dist.get_process_group_ranks(self.tensor.group)
        apart = [
            [ranks[t] for t in range(self.tensor.size) if prints[t][i] != prints[0][i]]
            for i in range(len(paths))
        ]
        named = ", ".join(f"{p!r} on ranks {r}" for p, r in zip(paths, apart, strict=True) if r)
        return (
            f"the tensor group of ranks {ranks} passed different batches: batch leaf "
            f"{named or '(every leaf alike, their order or count not)'} differs from rank "
            f"{ranks[0]}'s"
        )


_CHUNK = 1 << 17  # int64 words a fingerprint reads at a time: its scratch is one MiB at most


def leaf_paths(batch: Any) -> list[str]:
    """Each leaf of ``batch`` named by its path, as the step's errors name a batch leaf
    ("x", "inputs/0"; "<batch>" for a batch that is one tensor)."""
    return ["/".join(map(str, p)) or "<batch>" for p in optree.tree_paths(batch)]


def batch_fingerprint(batch: Any, device: torch.device) -> tuple[tuple[str, ...], torch.Tensor]:
    """``(paths, fingerprint)``: per batch leaf (by its path), three int64 that change with
    any change of its bytes, shape or dtype: a CRC of shape and dtype, the sum of its bytes
    read as int64 words (the last one zero-padded) and their sum weighted by odd position
    factors (modulo 2^64, so the same bits give the same sums in any order; a single word
    apart changes both, rows swapped the weighted one). Computed on the leaf's device
    over a view of its bytes, never widened: the scratch is one chunk of weights (1 MiB at
    most) whatever the batch; ``fingerprint`` is ``(leaves, 3)`` on ``device``.

    >>> paths, fp = batch_fingerprint({"x": torch.arange(4)}, torch.device("cpu"))
    >>> paths, fp[0, 1:].tolist()
    (('x',), [6, 34])

    Raises:
      TypeError: a batch leaf that is not a tensor (named by its path), as ``train_step``'s
        split would.
    """
    leaves = optree.tree_leaves(batch)
    paths = tuple(leaf_paths(batch))
    rows = []
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"batch leaf {path!r}: expected a tensor with a batch dim, got {leaf!r}"
            )
        head = zlib.crc32(f"{tuple(leaf.shape)} {leaf.dtype}".encode())
        sums = _word_sums(_bytes(leaf.detach())).to(device)
        rows.append(torch.cat([sums.new_tensor([head]), sums]))
    if not rows:
        return paths, torch.zeros(0, 3, dtype=torch.int64, device=device)
    return paths, torch.stack(rows)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat uint8: a view where ``t`` is contiguous and starts on a word (a copy
    otherwise), so int64 words of it are views too."""
    if not t.is_contiguous():
        t = t.contiguous()
    elif (t.storage_offset() * t.element_size()) % 8:
        t = t.clone()
    return t.reshape(-1).view(torch.uint8)


def _word_sums(flat: torch.Tensor) -> torch.Tensor:
    """``[sum(w), sum((2i + 1) * w_i)]`` (int64, modulo 2^64) of ``flat``'s bytes read as
    int64 words ``w``, a chunk at a time; the weights and their products share one buffer."""
    whole = flat.numel() // 8
    scratch = torch.empty(min(max(whole, 1), _CHUNK), dtype=torch.int64, device=flat.device)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    words = flat[: whole * 8].view(torch.int64)
    for start in range(0, whole, _CHUNK):
        part = words[start : start + _CHUNK]
        odd = scratch[: part.numel()]
        torch.arange(2 * start + 1, 2 * (start + part.numel()), 2, out=odd)
        plain += part.sum()
        weighted += odd.mul_(part).sum()
    if flat.numel() > whole * 8:  # the tail: under 8 bytes, zero-padded to one word
        last = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        last[: flat.numel() - whole * 8] = flat[whole * 8 :]
        word = last.view(torch.int64)[0]
        plain += word
        weighted += word * (2 * whole + 1)
    return torch.stack([plain, weighted])
