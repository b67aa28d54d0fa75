"""Ring attention, flash style: one autograd node over the whole ring.

Each rank of a context group holds some query, key and value chunks of every sequence
(:class:`funcshard.parallel.attention.Chunks`). The forward passes the k, v blocks around the
group (``C - 1`` shifts to the next rank, each started before the block it overlaps is
computed); each pair of a query chunk and a key chunk runs a fused attention kernel that
returns its log-sum-exp (:class:`Kernel`: torch's CPU flash kernel on a CPU), the pairs a
causal mask hides wholly skipped and the diagonal ones causally masked, and the partial outputs
are merged by their log-sum-exp in fp32 as they arrive. Only this rank's q, k, v, the merged
output and its log-sum-exp are kept for the backward, which passes the k, v blocks around
again, runs the kernel's backward per pair against the merged output and log-sum-exp (the
flash-attention backward of the whole row), and sends each block's k, v gradients along with it
(accumulated in fp32; ``C`` shifts, the last bringing each rank its own). Every rank runs every
shift, whatever its mask skipped, in the same order, so no rank waits on a peer that will not
send.

Per attention call and rank, with ``part`` one of q, k, v's bytes: ``2 (C - 1)`` parts sent in
the forward (k and v), ``2 (C - 1)`` in the backward plus ``2 C`` parts of fp32 gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from funcshard.distributed import ops

__all__ = ["Kernel", "CPU_KERNEL", "MATH_KERNEL", "flops", "kernel_for", "ring"]

_KV_TAG, _GRAD_TAG = 11, 12


class Kernel(NamedTuple):
    """One block of attention and its backward.

    ``forward(q, k, v, causal, scale) -> (out, lse)`` (``out`` in q's dtype, ``lse`` fp32 of
    shape ``(B, H, Lq)``); ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk,
    dv)``, where ``out`` and ``lse`` are the whole row's (all blocks merged).
    """

    name: str
    forward: Callable
    backward: Callable


def _cpu_forward(q, k, v, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse.float()


def _cpu_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _math_forward(q, k, v, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dout = dout.float()
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.float().transpose(-2, -1)
    ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True))
    return ds @ k.float() * scale, ds.transpose(-2, -1) @ q.float() * scale, dv


CPU_KERNEL = Kernel("cpu_flash", _cpu_forward, _cpu_backward)
MATH_KERNEL = Kernel("math", _math_forward, _math_backward)


def kernel_for(device: torch.device) -> Kernel:
    """torch's fused CPU flash kernel on a CPU; elsewhere (for now) the fp32 math kernel."""
    return CPU_KERNEL if device.type == "cpu" else MATH_KERNEL


class _Setup(NamedTuple):
    chunks: object  # attention.Chunks (imported by the caller: no cycle)
    group: dist.ProcessGroup
    causal: bool
    scale: float
    kernel: Kernel


def ring(q, k, v, *, chunks, group, is_causal: bool, scale: float | None = None, kernel=None):
    """Ring attention of this rank's ``(B, H, L / C, D)`` query chunks over every rank's keys
    and values, merged in fp32, returned in ``q``'s dtype (``kernel``: :func:`kernel_for`
    q's device unless given)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    setup = _Setup(chunks, group, is_causal, scale, kernel or kernel_for(q.device))
    return _Ring.apply(q, k, v, setup)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup: _Setup):
        out, lse = _forward(q, k, v, setup)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.setup)
        return dq, dk, dv, None


class _Shift:
    """``x`` sent to the rank ``step`` ahead, the one ``step`` behind's received; started at
    construction, :meth:`wait` returns what arrived."""

    def __init__(self, x: torch.Tensor, group, step: int, tag: int) -> None:
        size, me = dist.get_world_size(group), dist.get_rank(group)
        to = dist.get_global_rank(group, (me + step) % size)
        source = dist.get_global_rank(group, (me - step) % size)
        self.out = torch.empty_like(x)
        ops.record("send", x, ops.Axis.CONTEXT)
        self.works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, x, to, group, tag),
                dist.P2POp(dist.irecv, self.out, source, group, tag),
            ]
        )

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.out


def _blocks(setup: _Setup, me: int, source: int):
    """The (query slot, key slot, diagonal) pairs this rank computes against ``source``'s
    chunks: the causally hidden ones skipped."""
    chunks = setup.chunks
    for i, a in enumerate(chunks.of(me)):
        for j, b in enumerate(chunks.of(source)):
            if setup.causal and b > a:  # wholly in the future: masked out
                continue
            yield i, j, setup.causal and a == b


def _unpack(held: torch.Tensor, shape: torch.Size, per: int) -> tuple[list, list]:
    n = held.numel() // 2
    # views, not copies: the kernels take strided (B, H, L, D) blocks
    return held[:n].view(shape).chunk(per, dim=2), held[n:].view(shape).chunk(per, dim=2)


def _merge(out, lse, o: torch.Tensor, o_lse: torch.Tensor):
    """``(out, lse)`` over one key set and ``(o, o_lse)`` over a disjoint one, merged in fp32."""
    o = o.float()
    if out is None:
        return o, o_lse
    both = torch.logaddexp(lse, o_lse)
    merged = out * torch.exp(lse - both).unsqueeze(-1) + o * torch.exp(o_lse - both).unsqueeze(-1)
    return merged, both


def _forward(q, k, v, setup: _Setup) -> tuple[torch.Tensor, torch.Tensor]:
    size, me, per = setup.chunks.size, dist.get_rank(setup.group), setup.chunks.per_rank
    queries = q.chunk(per, dim=2)
    outs, lses = [None] * per, [None] * per
    held = torch.cat([k.reshape(-1), v.reshape(-1)])
    for step in range(size):
        shift = _Shift(held, setup.group, 1, _KV_TAG) if step < size - 1 else None
        keys, values = _unpack(held, k.shape, per)
        for i, j, diagonal in _blocks(setup, me, (me - step) % size):
            o, o_lse = setup.kernel.forward(queries[i], keys[j], values[j], diagonal, setup.scale)
            outs[i], lses[i] = _merge(outs[i], lses[i], o, o_lse)
        if shift is not None:
            held = shift.wait()
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _backward(dout, q, k, v, out, lse, setup: _Setup):
    size, me, per = setup.chunks.size, dist.get_rank(setup.group), setup.chunks.per_rank
    douts, queries, outs, lses = (x.chunk(per, dim=2) for x in (dout, q, out, lse))
    dq = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in queries]
    held = torch.cat([k.reshape(-1), v.reshape(-1)])
    grads = torch.zeros(held.shape, dtype=torch.float32, device=held.device)
    incoming = None
    for step in range(size):
        shift = _Shift(held, setup.group, 1, _KV_TAG) if step < size - 1 else None
        keys, values = _unpack(held, k.shape, per)
        block_grads = []
        for i, j, diagonal in _blocks(setup, me, (me - step) % size):
            dq_b, dk_b, dv_b = setup.kernel.backward(
                douts[i], queries[i], keys[j], values[j], outs[i], lses[i], diagonal, setup.scale
            )
            dq[i] += dq_b
            block_grads.append((j, dk_b, dv_b))
        if incoming is not None:  # the gradients of the block held now, from the previous rank
            grads = incoming.wait()
        dkeys, dvalues = _unpack_views(grads, k.shape, per)
        for j, dk_b, dv_b in block_grads:
            dkeys[j].add_(dk_b)
            dvalues[j].add_(dv_b)
        incoming = _Shift(grads, setup.group, 1, _GRAD_TAG) if size > 1 else None
        if shift is not None:
            held = shift.wait()
    if incoming is not None:
        grads = incoming.wait()  # this rank's own k, v gradients, home from the last rank
    n = k.numel()
    dk, dv = grads[:n].view(k.shape).to(k.dtype), grads[n:].view(v.shape).to(v.dtype)
    return torch.cat(dq, dim=2).to(q.dtype), dk, dv


def _unpack_views(grads: torch.Tensor, shape: torch.Size, per: int) -> tuple[tuple, tuple]:
    n = grads.numel() // 2
    return grads[:n].view(shape).chunk(per, dim=2), grads[n:].view(shape).chunk(per, dim=2)


def flops(chunks, rank: int, causal: bool, shape: tuple[int, int, int, int]) -> int:
    """The attention FLOPs of rank ``rank``'s ring forward (``2 x 2 x B x H x Lq x Lk x D``
    per block, half of it, plus the diagonal, for a causally masked block): what the load
    balance evens out. ``shape``: one rank's ``(B, H, L / C, D)``."""
    B, H, Lc, D = shape
    n = Lc // chunks.per_rank
    setup = _Setup(chunks, None, causal, 1.0, MATH_KERNEL)
    total = 0
    for step in range(chunks.size):
        for _, _, diagonal in _blocks(setup, rank, (rank - step) % chunks.size):
            total += 4 * B * H * D * (n * (n + 1) // 2 if diagonal else n * n)
    return total
