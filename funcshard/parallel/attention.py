"""Attention over sequences split across a context group (``fs.ContextParallel``'s math).

Each rank of a context group holds some chunks of every sequence (:class:`Chunks`: chunk ``c``
of ``C``, or the head-tail pair ``c`` and ``2C - 1 - c`` of ``2C`` when load balanced), and
every query attends over the whole sequence by one of two exchanges:

* :func:`all_to_all` (DeepSpeed-Ulysses): q, k, v from sequence-split to head-split (each rank
  then holds ``H / C`` heads of the whole sequence, its chunks put back in global order), any
  attention kernel on the full sequence, and the output back to sequence-split.
* :func:`ring`: the k, v blocks passed around the group, ``C - 1`` shifts; each pair of a
  query chunk and a key chunk attends on its own (the pairs a causal mask hides wholly
  skipped, the diagonal ones masked), the partial outputs merged by their log-sum-exp in fp32.

Both are differentiable: the backward of an exchange is the exchange back (the gradient of
an all-to-all is the all-to-all of the gradient; of a shift to the next rank, the shift to
the previous one), so each rank's backward carries the gradients of the other ranks' queries
to the keys and values it holds. Every exchange counts its input buffer under the "context"
axis (:func:`funcshard.distributed.ops.comm_stats`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from funcshard.distributed import ops

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


def _seq_to_heads(x: torch.Tensor, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """``(B, H, L / C, D)``, this rank's chunks, to ``(B, H / C, L, D)``: its heads of the whole
    sequence in global order."""
    B, H, Lc, D = x.shape
    C, k = chunks.size, chunks.per_rank
    send = x.reshape(B, C, H // C, Lc, D).transpose(0, 1)  # [j]: rank j's heads
    recv = _AllToAll.apply(send, group)  # [i]: rank i's chunks of this rank's heads
    slots = recv.reshape(C, B, H // C, k, Lc // k, D).permute(1, 2, 0, 3, 4, 5)
    slots = slots.reshape(B, H // C, C * k, Lc // k, D)
    inverse = torch.argsort(torch.tensor(chunks.order())).to(x.device)
    return slots.index_select(2, inverse).reshape(B, H // C, C * Lc, D)


def _heads_to_seq(y: torch.Tensor, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(B, H / C, L, D)`` to ``(B, H, L / C, D)``."""
    B, h, L, D = y.shape
    C, k = chunks.size, chunks.per_rank
    n = C * k
    order = torch.tensor(chunks.order(), device=y.device)
    slots = y.reshape(B, h, n, L // n, D).index_select(2, order)
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


class _Shift(torch.autograd.Function):
    """``x`` to the next rank of the group, the previous rank's in return; the backward sends
    the gradient the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    size, me = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    ops.record("send", x, ops.Axis.CONTEXT)
    to = dist.get_global_rank(group, (me + step) % size)
    source = dist.get_global_rank(group, (me - step) % size)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, source, group)]
    )
    for work in works:
        work.wait()
    return out


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk against one key chunk in fp32: ``(out, lse)``, ``diagonal``: the same
    positions, causally masked (each row keeps at least its own position)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        n = s.shape[-1]
        hidden = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Partial outputs over disjoint key sets, merged by their log-sum-exp."""
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    out = None
    for o, part_lse in parts:
        term = o * torch.exp(part_lse - lse).unsqueeze(-1)
        out = term if out is None else out + term
    return out


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
    and values, merged in fp32, returned in ``q``'s dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Ring.apply(q, k, v, chunks, group, is_causal, scale)


class _Ring(torch.autograd.Function):
    """The ring as one node of the caller's graph: its forward builds the ring's own graph
    (blocks, merges, shifts) and its backward runs that graph's backward, whose shifts go in
    the ring's order on every rank. Left as nodes of the caller's graph, the shifts' backwards
    would run in the order the autograd engine finds for each rank's graph, which differs where
    the causal mask skips different blocks on different ranks: a rank could wait on a
    gradient's reduce-scatter while its peer waits on a shift (or never run the backward of a
    shift whose block it did not use)."""

    @staticmethod
    def forward(ctx, q, k, v, chunks, group, is_causal, scale):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        with torch.enable_grad():
            out = _ring_graph(*inputs, chunks, group, is_causal, scale)
        ctx.graph = (inputs, out)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.graph
        del ctx.graph
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return *(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None


def _ring_graph(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: Chunks,
    group: dist.ProcessGroup,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    size, me = chunks.size, dist.get_rank(group)
    per = chunks.per_rank
    queries, mine = q.float().chunk(per, dim=2), chunks.of(me)
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in mine]
    k_numel = k.numel()
    held = torch.cat([k.reshape(-1), v.reshape(-1)])
    for step in range(size):
        if step:
            held = _Shift.apply(held, group)
        source = (me - step) % size
        keys = held[:k_numel].view(k.shape).float().chunk(per, dim=2)
        values = held[k_numel:].view(v.shape).float().chunk(per, dim=2)
        for i, a in enumerate(mine):
            for j, b in enumerate(chunks.of(source)):
                if is_causal and b > a:  # wholly in the future: masked out
                    continue
                diagonal = is_causal and a == b
                parts[i].append(_block(queries[i], keys[j], values[j], scale, diagonal))
    out = torch.cat([_merge(p) for p in parts], dim=2).to(q.dtype)
    # the last block received joins the graph even where the mask skipped it, so that every
    # rank runs every shift's backward
    return out + held[:1].sum().to(out.dtype) * 0
