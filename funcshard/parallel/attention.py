"""Attention over sequences split across a context group (``fs.ContextParallel``'s math).

Each rank of a context group holds some chunks of every sequence (:class:`Chunks`: chunk ``c``
of ``C``, or the head-tail pair ``c`` and ``2C - 1 - c`` of ``2C`` when load balanced), and
every query attends over the whole sequence by one of two exchanges:

* :func:`all_to_all` (DeepSpeed-Ulysses): q, k, v from sequence-split to head-split (each rank
  then holds ``H / C`` heads of the whole sequence, its chunks put back in global order), any
  attention kernel on the full sequence, and the output back to sequence-split.
* :func:`ring`: the k, v blocks passed around the group, ``C - 1`` shifts; each pair of a
  query chunk and a key chunk attends on its own (the pairs a causal mask hides wholly
  skipped, the diagonal ones masked), the partial outputs merged by their log-sum-exp in fp32
  (flash style, one autograd node: :mod:`funcshard.parallel.ring`).

Both are differentiable: the backward of an all-to-all is the all-to-all of the gradient;
the ring's backward passes the k, v blocks around again with their gradients, so each rank's
backward carries the gradients of the other ranks' queries to the keys and values it holds.
Every exchange counts its input buffer under the "context" axis
(:func:`funcshard.distributed.ops.comm_stats`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from funcshard.distributed import ops
from funcshard.parallel import ring as ring_lib

__all__ = ["Chunks", "all_to_all", "ring"]


class Chunks(NamedTuple):
    """How a sequence is cut over the ``size`` ranks of a context group.

    >>> Chunks(2, balanced=True).of(0), Chunks(2, balanced=True).of(1), Chunks(2, False).of(1)
    ((0, 3), (1, 2), (1,))
    """

    size: int
    balanced: bool

    @property
    def count(self) -> int:
        """The chunks a sequence is cut into: ``2C`` load balanced, else ``C``."""
        return 2 * self.size if self.balanced else self.size

    @property
    def per_rank(self) -> int:
        return 2 if self.balanced else 1

    def of(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices ``rank`` holds, in the order it holds them."""
        return (rank, 2 * self.size - 1 - rank) if self.balanced else (rank,)

    def order(self) -> list[int]:
        """The global chunk held at each slot of the ranks' parts laid end to end."""
        return [c for r in range(self.size) for c in self.of(r)]


# --- all-to-all (Ulysses) -----------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """``x[j]`` to rank ``j``, ``out[i]`` from rank ``i`` (leading dim the group's size); its
    own adjoint, so the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    ops.record("all_to_all", x, ops.Axis.CONTEXT)
    dist.all_to_all_single(out, x, group=group)
    return out


def _slots(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x``'s slots along dim 2 in ``order``: a concatenation, which keeps nothing for the
    backward (an index_select would keep its index)."""
    return torch.cat([x.narrow(2, i, 1) for i in order], dim=2)


def _seq_to_heads(x: torch.Tensor, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, H, L / C, D)``, this rank's chunks, to ``(B, H / C, L, D)``: its heads of the whole
    sequence in global order."""
    B, H, Lc, D = x.shape
    C, k = chunks.size, chunks.per_rank
    send = x.reshape(B, C, H // C, Lc, D).transpose(0, 1)  # [j]: rank j's heads
    recv = _AllToAll.apply(send, group)  # [i]: rank i's chunks of this rank's heads
    slots = recv.reshape(C, B, H // C, k, Lc // k, D).permute(1, 2, 0, 3, 4, 5)
    slots = slots.reshape(B, H // C, C * k, Lc // k, D)
    inverse = sorted(range(C * k), key=chunks.order().__getitem__)
    return _slots(slots, inverse).reshape(B, H // C, C * Lc, D)


def _heads_to_seq(y: torch.Tensor, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(B, H / C, L, D)`` to ``(B, H, L / C, D)``."""
    B, h, L, D = y.shape
    C, k = chunks.size, chunks.per_rank
    n = C * k
    slots = _slots(y.reshape(B, h, n, L // n, D), chunks.order())
    send = slots.reshape(B, h, C, L // C, D).permute(2, 0, 1, 3, 4)  # [r]: rank r's chunks
    recv = _AllToAll.apply(send, group)  # [j]: head group j of this rank's chunks
    return recv.permute(1, 0, 2, 3, 4).reshape(B, C * h, L // C, D)


def all_to_all(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunks: Chunks,
    group: dist.ProcessGroup,
    is_causal: bool,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses: ``scaled_dot_product_attention`` over the whole sequence of
    ``(B, H, L / C, D)`` parts, head-split in between (``H`` divisible by ``C``: checked by
    the caller)."""
    full = [_seq_to_heads(t, chunks, group) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *full, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    return _heads_to_seq(out, chunks, group)


# --- ring ---------------------------------------------------------------------------------------


def ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    chunks: Chunks,
    group: dist.ProcessGroup,
    is_causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Ring attention of this rank's ``(B, H, L / C, D)`` query chunks over every rank's keys
    and values, merged in fp32, returned in ``q``'s dtype (:mod:`funcshard.parallel.ring`)."""
    return ring_lib.ring(q, k, v, chunks=chunks, group=group, is_causal=is_causal, scale=scale)
