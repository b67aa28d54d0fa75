"""The collectives funcshard issues, each one torch.distributed call (but the gather of
pieces on gloo: :func:`all_gather_pieces`), and the byte accounting tests and benchmarks read.

Bytes are counted per rank as the size of the collective's full buffer: the output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce. A collective over a
group of one rank is skipped and counts nothing. Scalar reductions for metrics are counted
under "metrics", apart from the formula of the strategies (see ``funcshard.planner.plan`` and
docs/strategies.md, "Communication per step").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "Axis",
    "AXES",
    "Pending",
    "CommStats",
    "comm_stats",
    "all_gather",
    "all_gather_pieces",
    "gather_in_place",
    "gathers_by_sends",
    "place_rank_sections",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "all_to_all_rows",
    "exchange_blocks",
]


class Axis(str, enum.Enum):
    """The mesh axes a collective is counted under (a ``str``: ``Axis.SHARD == "shard"``)."""

    SHARD = "shard"
    REPLICATE = "replicate"
    WORLD = "world"  # a group over every data-parallel rank
    TENSOR = "tensor"  # a tensor-parallel group (what funcshard issues there: norms, Muon)
    REPLICAS = "replicas"  # torchft's all-reduce across the replica groups (fs.FaultTolerance)
    EXPERT = "expert"  # an expert-parallel group: the tokens' all-to-all (fs.ExpertParallel)
    CONTEXT = "context"  # a context-parallel group: attention's exchange (fs.ContextParallel)
    PIPELINE = "pipeline"  # what a pipeline rank sends: stage outputs, input gradients


# Their names, as ``CommStats.bytes_by_axis`` keys them.
AXES = tuple(a.value for a in Axis)


@dataclasses.dataclass
class CommStats:
    """Counts filled in while a ``comm_stats()`` block is active.

    Attributes:
      bytes: bytes per kind ("all_gather", "reduce_scatter", "all_reduce", "metrics", and
        "muon" for the exchange of whole matrices of ``fs.optim.muon``).
      calls: collective calls per kind.
      bytes_by_axis: the same bytes per mesh axis the collective ran on: "shard",
        "replicate", "world" (a group over every data-parallel rank: the loss, and the
        gradients of ``no_shard``), "tensor" (funcshard's own collectives over a
        tensor-parallel group), "replicas" (a fault-tolerant step's all-reduce across the
        replica groups, through torchft: the gradient shards, and the loss under
        "metrics"), "expert" (tokens sent to their experts and back by
        :func:`all_to_all_rows`, forward and backward, under "all_to_all") or "context"
        (attention's exchange of ``fs.ContextParallel``: q, k, v and the output under
        "all_to_all", k and v blocks around the ring under "send", forward and backward) or
        "pipeline" (what a pipeline rank sends to another under "send": its stages' outputs
        and the gradients of their inputs); its values sum to those of ``bytes``.
      gathered_live: bytes of gathered (unsharded) ZeRO-3 params alive right now.
      gathered_peak: the most bytes of gathered ZeRO-3 params alive at one moment.
    """

    bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bytes_by_axis: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    gathered_live: int = 0
    gathered_peak: int = 0

    def record(self, kind: str, nbytes: int, axis: Axis | str) -> None:
        if axis not in AXES:
            raise ValueError(f"comm_stats: unknown axis {axis!r}; expected one of {AXES}")
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.bytes_by_axis[Axis(axis).value] += nbytes


_ACTIVE: list[CommStats] = []

# torch 2.13 named the flat-tensor collectives all_gather_single / reduce_scatter_single and
# deprecated all_gather_into_tensor / reduce_scatter_tensor (same signatures); earlier torch
# (2.11 and 2.12, which pyproject allows) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Counts collective bytes and gathered-param memory inside the block.

    Typical use, on each rank: ``with fs.comm_stats() as stats: state, _ =
    fs.train_step(state, batch, loss_fn)``, then read ``stats.bytes["all_gather"]``. Each
    collective of this module records its full buffer under its kind and mesh axis, as below
    (the all-gathered output here, 4 x 8 fp32 values over the "shard" axis):

    >>> with comm_stats() as stats:
    ...     record("all_gather", torch.zeros(4, 8), "shard")
    >>> stats.bytes["all_gather"], stats.calls["all_gather"], stats.bytes["reduce_scatter"]
    (128, 1, 0)
    >>> stats.bytes_by_axis["shard"], stats.bytes_by_axis["replicate"]
    (128, 0)
    """
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:  # by identity: two blocks that counted the same bytes compare equal
        del _ACTIVE[next(i for i, s in enumerate(_ACTIVE) if s is stats)]


def active() -> tuple[CommStats, ...]:
    """The ``comm_stats`` blocks open now (what a collective issued outside this module counts
    its bytes into)."""
    return tuple(_ACTIVE)


def record(kind: str | None, tensor: torch.Tensor, axis: Axis | str) -> None:
    """Counts ``tensor``'s bytes under ``kind`` and ``axis`` (kind None: counted by the caller
    as a whole)."""
    if kind is None:
        return
    for stats in _ACTIVE:
        stats.record(kind, tensor.numel() * tensor.element_size(), axis)


def track_gathered(buffer: torch.Tensor) -> None:
    """Accounts a gathered-params buffer as live until it is freed."""
    nbytes = buffer.numel() * buffer.element_size()
    watchers = list(_ACTIVE)
    for stats in watchers:
        stats.gathered_live += nbytes
        stats.gathered_peak = max(stats.gathered_peak, stats.gathered_live)

    def _release() -> None:
        for stats in watchers:
            stats.gathered_live -= nbytes

    weakref.finalize(buffer, _release)


def note_gathered_peak(nbytes: int) -> None:
    """Accounts ``nbytes`` of gathered params held at once by code that holds them where no
    buffer of this module can be watched (the captured step's compiled graphs)."""
    for stats in _ACTIVE:
        stats.gathered_peak = max(stats.gathered_peak, stats.gathered_live + nbytes)


class Pending:
    """An in-flight collective; ``wait()`` returns its result."""

    def __init__(
        self, work: dist.Work | None, result: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        self._work = work
        self._result = result
        self._keep = keep  # the input, alive until the collective is done
        self._finish: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def then(cls, pending: Pending, finish: Callable[[torch.Tensor], torch.Tensor]) -> Pending:
        """``pending`` whose ``wait()`` gives ``finish`` of its result (run once, at wait;
        after ``pending``'s own finish, if it has one)."""
        out = cls(pending._work, pending._result, pending._keep)
        first = pending._finish
        out._finish = finish if first is None else (lambda result: finish(first(result)))
        return out

    @property
    def in_flight(self) -> bool:
        """Whether a collective is still to be waited for (else ``wait()`` only finishes)."""
        return self._work is not None

    @property
    def buffer(self) -> torch.Tensor:
        """The result's buffer; its values are valid only after ``wait()``."""
        return self._result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._keep = None
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result

    def discard(self) -> None:
        """Waits for the collective in flight and drops its result: no ``then`` runs (one
        that would issue a collective of its own issues none)."""
        if self._work is not None:
            self._work.wait()
        self._work, self._keep, self._finish = None, None, None


def all_gather(
    local: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    axis: Axis | str,
    async_op: bool = False,
    kind: str | None = "all_gather",
):
    """Concatenates every rank's 1-D ``local`` in group rank order (``axis``: the mesh axis
    ``group`` belongs to, for the accounting)."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(None, local) if async_op else local
    out = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    record(kind, out, axis)
    work = _all_gather_single(out, local.contiguous(), group=group, async_op=async_op)
    return Pending(work, out) if async_op else out


def all_gather_pieces(
    local: torch.Tensor,
    sizes: list[int],
    group: dist.ProcessGroup,
    *,
    axis: Axis | str,
    async_op: bool = False,
    out: torch.Tensor | None = None,
):
    """Every rank's 1-D ``local``, cut into pieces of ``sizes``, gathered piece by piece: piece
    ``i`` of group rank ``q`` lands at ``size * offset_i + q * sizes[i]`` of the result
    (``offset_i``: the sizes before it), so each piece's ranks are adjacent, in rank order.

    That is an all-gather followed by a permutation, and that is how it runs on a backend that
    writes an all-gather's output in place (NCCL). gloo copies a collective's result out of its
    own buffer, so a CPU gloo group gets each peer's pieces by point-to-point sends that land
    where they belong: ``local`` is copied once (this rank's own pieces), where the
    collective's way copies the whole gathered buffer twice (gloo's copy-out, then the
    permutation). Counted as the all-gather it replaces (its full output). ``out``: where the
    result goes (default: a new tensor; with one rank, ``local`` itself is the result)."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(None, local) if async_op else local
    assert sum(sizes) == local.numel(), f"pieces {sum(sizes)} of a {local.numel()} buffer"
    if out is None:
        out = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    assert out.numel() == size * local.numel() and out.dtype == local.dtype, "an all-gather's out"
    record("all_gather", out, axis)
    if gathers_by_sends(local.device, group):
        pending = _gather_by_sends(out, local.contiguous(), sizes, group)
    else:
        gathered = torch.empty_like(out)
        work = _all_gather_single(gathered, local.contiguous(), group=group, async_op=True)
        pending = Pending.then(
            Pending(work, gathered), lambda g: place_rank_sections(g, sizes, size, out)
        )
    return pending if async_op else pending.wait()


def place_rank_sections(
    sections: torch.Tensor, sizes: list[int], size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``size`` ranks' pieces of ``sizes`` back to back (an all-gather's output) into ``out``
    (default: a new tensor) with each piece's ranks adjacent: :func:`all_gather_pieces`'s
    layout."""
    out = torch.empty_like(sections) if out is None else out
    torch.split_with_sizes_copy(
        sections.view(size, -1), sizes, dim=1, out=_rank_pieces(out, sizes, size)
    )
    return out


def _rank_pieces(out: torch.Tensor, sizes: list[int], size: int) -> list[torch.Tensor]:
    """Each piece's ``(size, n)`` view in :func:`all_gather_pieces`'s layout."""
    offsets = itertools.accumulate(sizes, initial=0)  # one more than sizes: its end
    pairs = zip(offsets, sizes, strict=False)
    return [out[size * o : size * (o + n)].view(size, n) for o, n in pairs]


def gather_in_place(
    out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False
):
    """Every rank's contiguous 1-D ``local`` into ``out`` in group rank order, each peer's
    section received in place by point-to-point sends (a CPU gloo group); returns ``out``
    once they have arrived (``async_op``: a :class:`Pending` of it, ``local`` kept alive
    until then). Counts nothing (the caller counts its gather)."""
    pending = _gather_by_sends(out, local, [local.numel()], group)
    return pending if async_op else pending.wait()


def gathers_by_sends(device: torch.device | str, group: dist.ProcessGroup) -> bool:
    """Whether a gather on ``device`` over ``group`` sends the sections to their place
    (:func:`all_gather_pieces`, :func:`gather_in_place`): a CPU gloo group."""
    return torch.device(device).type == "cpu" and dist.get_backend(group) == "gloo"


# The tag of these sends, apart from a user's point-to-point messages on the same group (tag 0
# by default): gloo matches a pair's messages in order per tag.
_PIECES_TAG = 0x6673

# Pieces below this many bytes travel together, received into one buffer and placed from it:
# each gloo message has a fixed cost (a round of the pair's protocol) that outweighs copying a
# small piece such as a LayerNorm's weight.
_SMALL_PIECE = 64 << 10


class _Works:
    """Point-to-point works waited for as one.

    gloo completes a collective whether or not anyone waits for it, but a send or receive
    whose work is dropped unwaited is forgotten by its side only, and the pair of ranks is then
    out of step (the next message lands in the wrong receive). Works dropped unwaited (a step
    that failed with a gather in flight, on every rank alike) are kept, and waited for before
    the next gather by sends posts anything."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def __del__(self) -> None:
        if self._works:
            _UNWAITED.extend(self._works)


_UNWAITED: list[dist.Work] = []


def _gather_by_sends(out, local, sizes, group) -> Pending:
    """:func:`all_gather_pieces` by sends to each peer and receives in place (gloo).

    Consecutive small pieces form one run, sent as one message (they are contiguous in
    ``local``) and received into a buffer that ``wait()`` places. Every rank posts its sends
    and receives in the same order (by peer, then by run), so each pair's messages match in
    order."""
    while _UNWAITED:
        _UNWAITED.pop(0).wait()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    offsets, pieces = [0, *itertools.accumulate(sizes)], _rank_pieces(out, sizes, size)
    small = _SMALL_PIECE // local.element_size()
    runs: list[list[int]] = []  # piece indices, consecutive
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if runs and n < small and sizes[runs[-1][-1]] < small and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    works, staged = [], []
    for peer in range(size):
        if peer == rank:
            continue
        for run in runs:
            start, stop = offsets[run[0]], offsets[run[-1] + 1]
            works.append(
                dist.isend(local[start:stop], group=group, group_dst=peer, tag=_PIECES_TAG)
            )
            into = pieces[run[0]][peer] if len(run) == 1 else local.new_empty(stop - start)
            works.append(dist.irecv(into, group=group, group_src=peer, tag=_PIECES_TAG))
            if len(run) > 1:
                staged.append((into, [sizes[i] for i in run], [pieces[i][peer] for i in run]))
    torch.split_with_sizes_copy(local, sizes, out=[p[rank] for p in pieces])

    def place(result: torch.Tensor) -> torch.Tensor:
        for buffer, run_sizes, dests in staged:
            torch.split_with_sizes_copy(buffer, run_sizes, out=dests)
        return result

    return Pending.then(Pending(_Works(works), out, keep=local), place)


def reduce_scatter(
    full: torch.Tensor, group: dist.ProcessGroup, *, axis: Axis | str, async_op: bool = False
):
    """Sums 1-D ``full`` over the group and returns this rank's contiguous 1/size of it."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(None, full) if async_op else full
    out = torch.empty(full.numel() // size, dtype=full.dtype, device=full.device)
    record("reduce_scatter", full, axis)
    full = full.contiguous()
    work = _reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Pending(work, out, keep=full) if async_op else out


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    axis: Axis | str,
    kind: str = "all_reduce",
    async_op: bool = False,
):
    """Sums ``tensor`` over the group into a new tensor (the input is read before this returns
    and left untouched, so it may change while an ``async_op`` one is in flight)."""
    if dist.get_world_size(group) == 1:
        return Pending(None, tensor) if async_op else tensor
    out = tensor.clone()
    record(kind, out, axis)
    work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Pending(work, out) if async_op else out


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    *,
    axis: Axis | str,
    kind: str | None,
) -> Pending:
    """Asynchronous all-to-all of 1-D buffers: ``in_splits[r]`` elements of ``inp`` go to rank
    ``r`` and ``out_splits[r]`` elements of ``out`` come from it, in rank order. Counts the
    input buffer (what this rank sends, its own part included) under ``kind``."""
    record(kind, inp, axis)
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    return Pending(work, out, keep=inp)


def exchange_blocks(
    full: torch.Tensor,
    group: dist.ProcessGroup,
    combine: Callable[[torch.Tensor], torch.Tensor],
    *,
    axis: Axis | str,
    kind: str | None = "reduce_scatter",
) -> Pending:
    """A reduce-scatter as an all-to-all and a local sum: 1-D ``full`` is ``size`` equal
    blocks, block r goes to rank r, and ``wait()`` gives ``combine`` of the ``(size, block)``
    blocks received (the order of the sum is the caller's). The bytes of a ring
    reduce-scatter; counted as one of ``full`` under ``kind``."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending(None, full)
    block = full.numel() // size
    recv = torch.empty_like(full)
    pending = all_to_all(
        recv, full.contiguous(), [block] * size, [block] * size, group, axis=axis, kind=kind
    )
    return Pending.then(pending, lambda r: combine(r.view(size, block)))


class _RowsAllToAll(torch.autograd.Function):
    """The differentiable all-to-all of rows: the backward sends the gradient back the way the
    rows came (the splits swapped), counted as the forward is."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows, group, axis, kind):
        ctx.meta = (out_rows, in_rows, group, axis, kind)
        return _rows_all_to_all(x, out_rows, in_rows, group, axis, kind)

    @staticmethod
    def backward(ctx, grad):
        out_rows, in_rows, group, axis, kind = ctx.meta
        return _rows_all_to_all(grad, in_rows, out_rows, group, axis, kind), *([None] * 5)


def _rows_all_to_all(x, out_rows, in_rows, group, axis, kind) -> torch.Tensor:
    row = x.shape[1:]
    out = x.new_empty((sum(out_rows), *row))
    record(kind, x, axis)
    dist.all_to_all_single(out, x.contiguous(), list(out_rows), list(in_rows), group=group)
    return out


def all_to_all_rows(
    x: torch.Tensor,
    out_rows: list[int],
    in_rows: list[int],
    group: dist.ProcessGroup,
    *,
    axis: Axis | str = Axis.EXPERT,
    kind: str = "all_to_all",
) -> torch.Tensor:
    """Rows of ``x`` to the ranks of ``group`` (``in_rows[r]`` to rank ``r``, ``out_rows[r]``
    from it), differentiable: tokens to their experts and back. Counts the rows this rank
    sends (its own part included) under ``kind`` and ``axis``, in forward and backward."""
    return _RowsAllToAll.apply(x, list(out_rows), list(in_rows), group, axis, kind)
