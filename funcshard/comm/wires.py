"""How a bucket's gradient is summed over a group: one :class:`Wire` per summation rule.

:func:`wire_for` is the one place the choice is made, from the bucket's dtypes and the
layout's ``deterministic``:

* :class:`NarrowWire`: ``grad_comm_dtype`` narrower than the main grads (or 8-bit). Each
  rank's contribution is rounded to the wire once, on the sending side, and the sum over ranks
  runs in fp32 (or ``main_grads_dtype`` when wider), with any backend's plain collectives. A
  ring collective in bf16 rounds every partial sum, so its error grows with the group; here a
  contribution is rounded once going out (and the sum once coming back, for an all-reduce),
  whatever the group size (``experiments/bench_wire.py`` measures both).
* :class:`TreeWire` (``deterministic=True``): the rank blocks summed by the adjacent pairwise
  tree of :mod:`funcshard.layout.determinism`, bitwise the same on every layout.
* :class:`RingWire`: the default, ring collectives in the wire dtype.

Every wire reduce-scatters by moving the bytes of a ring reduce-scatter (counted as its full
buffer), and all-reduces as that reduce-scatter and an all-gather (:func:`all_reduce_by_halves`;
the ring's own all-reduce where the backend has one), counted as an all-reduce of the wire
tensor. A wire also says those byte counts, for :func:`funcshard.planner.plan.plan`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from funcshard.comm import codec
from funcshard.distributed import graph_ops, ops
from funcshard.distributed.ops import Axis, Pending
from funcshard.layout import determinism

if TYPE_CHECKING:
    from funcshard.layout.layout import Bucket, Layout

__all__ = [
    "Wire",
    "RingWire",
    "TreeWire",
    "NarrowWire",
    "wire_for",
    "reduces_by_all_to_all",
    "all_reduce_by_halves",
    "sum_dtype",
]

Group = dist.ProcessGroup | None


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a sum of ``dtype`` values runs in on a narrow wire: fp32, or ``dtype`` when wider."""
    return torch.promote_types(dtype, torch.float32)


class Wire(Protocol):
    """One rule for summing a bucket's gradient over a group of ranks."""

    sections_dtype: torch.dtype
    """The dtype the unreduced rank sections are built in before the wire."""

    scale_dtype: torch.dtype
    """The dtype the sections are divided by the data-parallel size in, before the wire."""

    def start_reduce_scatter(
        self, full: torch.Tensor, group: Group, *, axis: Axis | str, kind: str | None = ...
    ) -> Pending:
        """The group's sum of 1-D ``full`` (consumed), this rank's contiguous 1/size of it
        (``axis``: the mesh axis of ``group``, for the accounting; ``kind``: what the full
        buffer is counted under, None: nothing)."""
        ...

    def start_all_reduce(self, tensor: torch.Tensor, group: Group, *, axis: Axis | str) -> Pending:
        """The group's sum of ``tensor``, read before this returns. Every rank waits for a
        group's sums in the same order (a sum may issue an all-gather at ``wait()``)."""
        ...

    def reduce_scatter_nbytes(self, size: int) -> int:
        """Bytes counted for one reduce-scatter of the bucket's sections over ``size`` ranks."""
        ...

    def all_reduce_nbytes(self, size: int) -> int:
        """Bytes counted for one all-reduce of the bucket's local gradient over ``size`` ranks."""
        ...


def all_reduce_by_halves(
    wire: Wire,
    tensor: torch.Tensor,
    group: Group,
    *,
    axis: Axis | str,
    send: torch.dtype,
    out: torch.dtype,
) -> Pending:
    """An all-reduce as ``wire``'s reduce-scatter of the group's parts of ``tensor`` (padded to
    a multiple of the group size; cast to ``send``, a copy) and an all-gather of the summed
    parts, sent in ``send`` and returned in ``out``: the bytes of a ring all-reduce, counted
    as one of the ``send`` tensor. The reduce-scatter starts now; the all-gather is issued at
    ``wait()``, so every rank waits for a group's chains in the same order."""
    flat, shape = tensor.reshape(-1), tensor.shape
    n, size = flat.numel(), _size(group)
    padded = torch.nn.functional.pad(flat.to(send), (0, -n % size))  # a copy, even unpadded
    ops.record("all_reduce", padded[:n], axis)
    part = wire.start_reduce_scatter(padded, group, axis=axis, kind=None)

    def gather(summed: torch.Tensor) -> torch.Tensor:
        back = ops.all_gather(summed.to(send), group, axis=axis, kind=None)
        return back[:n].to(out).view(shape)

    return Pending.then(part, gather)


@dataclasses.dataclass(frozen=True, slots=True)
class _Float:
    """The byte counts of a wire that carries ``numel`` elements of ``dtype`` per rank."""

    dtype: torch.dtype
    numel: int = 0

    @property
    def sections_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.dtype

    def reduce_scatter_nbytes(self, size: int) -> int:
        return size * self.numel * self.dtype.itemsize

    def all_reduce_nbytes(self, size: int) -> int:
        del size
        return self.numel * self.dtype.itemsize


class RingWire(_Float):
    """The default: ring collectives in the wire dtype."""

    __slots__ = ()

    def start_reduce_scatter(
        self,
        full: torch.Tensor,
        group: Group,
        *,
        axis: Axis | str,
        kind: str | None = "reduce_scatter",
    ) -> Pending:
        if _size(group) == 1:
            return Pending(None, full)
        if reduces_by_all_to_all(full.device):
            return ops.exchange_blocks(full, group, _sum_blocks, axis=axis, kind=kind)
        return ops.reduce_scatter(full, group, axis=axis, async_op=True)

    def start_all_reduce(self, tensor: torch.Tensor, group: Group, *, axis: Axis | str) -> Pending:
        return ops.all_reduce(tensor.to(self.dtype), group, axis=axis, async_op=True)


def reduces_by_all_to_all(device: torch.device) -> bool:
    """Whether a ring wire's reduce-scatter on ``device`` is an all-to-all and a local sum (the
    eager step's and the captured step's choice): on CPU, where gloo reduce-scatters by an
    all-reduce, twice a ring reduce-scatter's bytes (measured on a veth link:
    experiments/bench_nodes.py); an all-to-all and a local sum move exactly the ring's."""
    return device.type == "cpu"


def _sum_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The received blocks' sum in rank order (not the deterministic tree's), as the
    captured step's reduce adds them (:func:`funcshard.distributed.graph_ops.sum_by_rank`)."""
    return graph_ops.sum_by_rank(blocks)


def _tree_blocks(blocks: torch.Tensor) -> torch.Tensor:
    return determinism.pairwise_sum(blocks.unbind(0))


class TreeWire(_Float):
    """``deterministic=True``: an all-to-all hands every rank the blocks of its part from every
    rank (the bytes of a ring reduce-scatter); ``wait()`` sums them by
    :func:`funcshard.layout.determinism.pairwise_sum` over group ranks."""

    __slots__ = ()

    def start_reduce_scatter(
        self,
        full: torch.Tensor,
        group: Group,
        *,
        axis: Axis | str,
        kind: str | None = "reduce_scatter",
    ) -> Pending:
        if _size(group) == 1:
            return Pending(None, full)
        return ops.exchange_blocks(full, group, _tree_blocks, axis=axis, kind=kind)

    def start_all_reduce(self, tensor: torch.Tensor, group: Group, *, axis: Axis | str) -> Pending:
        if _size(group) == 1:
            return Pending(None, tensor.to(self.dtype))
        dtype = self.dtype
        return all_reduce_by_halves(self, tensor, group, axis=axis, send=dtype, out=dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class NarrowWire:
    """Contributions rounded to ``dtype`` once, summed in fp32 (or ``grad`` when wider).

    Args:
      dtype: the wire: a floating dtype (a cast) or an 8-bit format of
        :data:`funcshard.comm.codec.EIGHT_BIT`.
      grad: the main-grads dtype (what the sections are built in).
      numel: elements of one rank's section (the bucket's local flat).
      blocks: the blocks of one section (8-bit wires; every section has the same).
    """

    dtype: torch.dtype
    grad: torch.dtype
    numel: int = 0
    blocks: codec.Blocks | None = None

    @property
    def sections_dtype(self) -> torch.dtype:
        return self.grad

    @property
    def scale_dtype(self) -> torch.dtype:
        return sum_dtype(self.grad)

    def start_reduce_scatter(
        self,
        full: torch.Tensor,
        group: Group,
        *,
        axis: Axis | str,
        kind: str | None = "reduce_scatter",
    ) -> Pending:
        """An all-to-all of the rank sections in the wire format, then each rank sums the
        sections it received in fp32: per rank the bytes of a ring reduce-scatter of the same
        wire (counted as one: the full wire buffer). ``full``'s buffer may hold the decoded
        sections."""
        size, acc = _size(group), sum_dtype(full.dtype)
        if size == 1:
            return Pending(None, full.to(acc))
        section, dtype = full.numel() // size, self.dtype
        if dtype not in codec.EIGHT_BIT:
            wire = full.to(dtype).view(size, section)
            return _all_to_all(wire, group, axis, kind, lambda r: r.sum(0, dtype=acc))
        blocks = codec.check(self.blocks, section)
        send = torch.empty(size, blocks.nbytes, dtype=torch.uint8, device=full.device)
        codec.encode(full.view(size, section), dtype, blocks, send)
        scratch = full.view(size, section) if full.dtype == acc else None

        def finish(recv: torch.Tensor) -> torch.Tensor:
            out = scratch
            if out is None:
                out = torch.empty(size, section, dtype=acc, device=recv.device)
            return codec.decode(recv, dtype, blocks, out).sum(0)

        return _all_to_all(send, group, axis, kind, finish)

    def start_all_reduce(self, tensor: torch.Tensor, group: Group, *, axis: Axis | str) -> Pending:
        """The sum, the same bits on every rank: every rank, a part's owner too, takes each
        part from the wire. 8-bit: the parts are cut on block boundaries, of about equal bytes,
        each padded to the largest (counted so)."""
        size, acc = _size(group), sum_dtype(tensor.dtype)
        if size == 1:
            return Pending(None, tensor.to(acc))
        if self.dtype not in codec.EIGHT_BIT:
            return all_reduce_by_halves(self, tensor, group, axis=axis, send=self.dtype, out=acc)
        return _eight_bit_all_reduce(self, tensor.reshape(-1), group, axis, acc)

    def reduce_scatter_nbytes(self, size: int) -> int:
        if self.dtype in codec.EIGHT_BIT:
            return size * codec.check(self.blocks, self.numel).nbytes
        return size * self.numel * self.dtype.itemsize

    def all_reduce_nbytes(self, size: int) -> int:
        if self.dtype in codec.EIGHT_BIT:
            parts = codec.check(self.blocks, self.numel).split(size)
            return size * max(p.nbytes for _, p in parts)
        return self.numel * self.dtype.itemsize


def _eight_bit_all_reduce(
    wire: NarrowWire, flat: torch.Tensor, group: Group, axis: Axis | str, acc: torch.dtype
) -> Pending:
    """:meth:`NarrowWire.start_all_reduce` on an 8-bit wire (1-D ``flat``)."""
    size, n, dtype = _size(group), flat.numel(), wire.dtype
    parts = codec.check(wire.blocks, n).split(size)
    width = max(p.nbytes for _, p in parts)
    send = torch.zeros(size, width, dtype=torch.uint8, device=flat.device)
    for r, (start, p) in enumerate(parts):
        codec.encode(flat[start : start + p.numel], dtype, p, send[r, : p.nbytes])
    ops.record("all_reduce", send, axis)
    start, mine = parts[dist.get_rank(group)]

    def finish(recv: torch.Tensor) -> torch.Tensor:
        out = torch.empty(size, mine.numel, dtype=acc, device=flat.device)
        reduced = codec.decode(recv[:, : mine.nbytes], dtype, mine, out).sum(0)
        packed = torch.zeros(width, dtype=torch.uint8, device=flat.device)
        codec.encode(reduced, dtype, mine, packed[: mine.nbytes])
        gathered = ops.all_gather(packed, group, axis=axis, kind=None).view(size, width)
        full = torch.empty(n, dtype=acc, device=flat.device)
        for r, (begin, p) in enumerate(parts):
            codec.decode(gathered[r, : p.nbytes], dtype, p, full[begin : begin + p.numel])
        return full

    return _all_to_all(send, group, axis, None, finish)


def _all_to_all(send: torch.Tensor, group: Group, axis: Axis | str, kind: str | None, finish):
    """All-to-all of the rows of ``send`` (row r to rank r); ``finish`` of the ``(size, -1)``
    rows that came back."""
    size, width = send.shape
    recv = torch.empty_like(send)
    pending = ops.all_to_all(
        recv.view(-1), send.view(-1), [width] * size, [width] * size, group, axis=axis, kind=kind
    )
    return Pending.then(pending, lambda r: finish(r.view(size, width)))


def blocks_of(layout: Layout, bucket: Bucket) -> codec.Blocks:
    """The blocks of a bucket's local flat (one padded shard of every leaf, leaf after leaf);
    rows are never split between shards, so every section of the full buffer has them too."""
    segments = tuple((s.rows_per_shard, s.row_numel) for s in layout.bucket_leaves(bucket))
    return codec.blocks(segments)


def is_narrow(comm: torch.dtype, grad: torch.dtype) -> bool:
    """Whether gradients on the ``comm`` wire are rounded once and summed in fp32: an 8-bit
    wire, or one narrower than (or as narrow as, but other than) the main grads ``grad``.
    Otherwise the ring collectives run in the wire dtype as ever."""
    return comm in codec.EIGHT_BIT or (comm != grad and comm.itemsize <= grad.itemsize)


def wire_for(layout: Layout, bucket: Bucket) -> Wire:
    """The wire a bucket's gradient is summed on over ``layout``'s groups (the one place the
    choice is made)."""
    comm, grad = bucket.dtypes.comm, bucket.dtypes.grad
    if is_narrow(comm, grad):
        blocks = blocks_of(layout, bucket) if comm in codec.EIGHT_BIT else None
        return NarrowWire(comm, grad, bucket.numel, blocks)
    return TreeWire(comm, bucket.numel) if layout.deterministic else RingWire(comm, bucket.numel)
