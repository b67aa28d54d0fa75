"""Collectives as torch custom ops, for compiled graphs that run on gloo.

A graph's collectives are torch's functional ones (``_c10d_functional``) where they cost
what the eager ones cost (NCCL). On a CPU gloo group the functional all-gather goes through
gloo's coalesced all-gather, which gathers into a buffer of its own and copies each rank's
section out of it: two copies of the gathered bytes a call that the eager step does not make
(:func:`funcshard.distributed.ops.all_gather_pieces` receives each peer's section in place).
:func:`all_gather_sections` is that eager gather as one op a graph holds (dynamo and
AOTAutograd trace it, inductor calls it as an extern kernel): the same values, the bytes
received where they belong. It returns when the sections have arrived (no separate wait: the
compiler's overlap passes, which move only functional collectives, do not see it).

:func:`all_gather_sections_start` and :func:`all_gather_sections_wait` are the same gather
in two ops, so that a graph can issue a bucket's gather before the compute it overlaps
(:mod:`funcshard.step.units.prefetch`): the start posts the sends and returns a ticket (eight
bytes: the graph's memory planning sees no buffer held from the start), the wait redeems it
for the gathered sections. The start's ``after``, not read, orders the gathers in the graph
(every rank posts its sends in the same order).

:func:`reduce_scatter_sections` is the reduce-scatter's counterpart (the eager step reduces on a
CPU group by exchanging rank sections and summing them: gloo's reduce-scatter is an
all-reduce, twice the bytes): each rank's section sent to it by point-to-point sends and
added as it arrives (:func:`reduce_by_sends`), in one op whose output is the section alone.
In the two-op form (``_c10d_functional.all_to_all_single``, whose output is the whole
bucket, then a sum) inductor's peak-memory ordering put every bucket's reduce at the end of
the backward graph, each unit's gradients held until then; as one op it runs where the
captured step places it, as the unit's backward ends. :func:`reduce_scatter_sections_start` and
:func:`reduce_scatter_sections_wait` are it in two ops (the sections sent and the peers' posted for;
the sum once they have arrived), so that a reduce runs while the next unit's backward
computes (:mod:`funcshard.step.units.prefetch`, :mod:`funcshard.step.units.comm_order`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from funcshard.distributed.ops import _PIECES_TAG, _UNWAITED, Pending, _Works, gather_in_place

__all__ = [
    "drain_failed_graph",
    "drained_on_failure",
    "GRAPH_COLLECTIVES",
    "graph_collectives",
    "all_gather_sections",
    "all_gather_sections_start",
    "ALL_GATHER_SECTIONS",
    "ALL_GATHER_SECTIONS_START",
    "ALL_GATHER_SECTIONS_WAIT",
    "all_gather_sections_wait",
    "reduce_by_sends",
    "reduce_scatter_sections",
    "REDUCE_SCATTER_SECTIONS",
    "reduce_scatter_sections_start",
    "REDUCE_SCATTER_SECTIONS_START",
    "reduce_scatter_sections_wait",
    "REDUCE_SCATTER_SECTIONS_WAIT",
    "sum_by_rank",
]


@torch.library.custom_op("funcshard::all_gather_sections", mutates_args=())
def all_gather_sections(
    shard: torch.Tensor, group_size: int, group_name: str, after: torch.Tensor | None
) -> torch.Tensor:
    """Every rank's 1-D ``shard`` of the group named ``group_name`` (``group_size`` ranks),
    concatenated in group rank order: what ``_c10d_functional.all_gather_into_tensor``
    returns, received in place by point-to-point sends (gloo). ``after``, not read: the
    collective before it in the graph (``overlap=False``'s chain)."""
    del after
    group = _resolve_process_group(group_name)
    assert dist.get_world_size(group) == group_size, (group_name, group_size)
    out = shard.new_empty(group_size * shard.numel())
    _started("gathers")  # before it blocks: a peer's drain posts it if this rank fails after
    return gather_in_place(out, shard.contiguous(), group)


@all_gather_sections.register_fake
def _(
    shard: torch.Tensor,
    group_size: int,
    group_name: str,  # noqa: ARG001
    after: torch.Tensor | None,  # noqa: ARG001
) -> torch.Tensor:
    return shard.new_empty(group_size * shard.numel())


@torch.library.custom_op("funcshard::all_gather_sections_start", mutates_args=())
def all_gather_sections_start(
    shard: torch.Tensor,
    after: torch.Tensor | None,
    group_size: int,
    group_name: str,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """Starts :func:`all_gather_sections`; returns its ticket, a one-element int64 tensor
    that :func:`all_gather_sections_wait` redeems (``after`` and ``other``, the previous
    reduce's start where one comes between the two gathers, are not read)."""
    del after, other
    group = _resolve_process_group(group_name)
    assert dist.get_world_size(group) == group_size, (group_name, group_size)
    while _IN_FLIGHT:  # left by a graph that raised between a start and its wait
        _IN_FLIGHT.popitem()[1].discard()
    out = shard.new_empty(group_size * shard.numel())
    ticket = next(_TICKETS)
    _IN_FLIGHT[ticket] = gather_in_place(out, shard.contiguous(), group, async_op=True)
    _started("gathers")
    return torch.tensor([ticket], dtype=torch.int64)


@all_gather_sections_start.register_fake
def _(
    shard: torch.Tensor,
    after: torch.Tensor | None,  # noqa: ARG001
    group_size: int,  # noqa: ARG001
    group_name: str,  # noqa: ARG001
    other: torch.Tensor | None = None,  # noqa: ARG001
) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("funcshard::all_gather_sections_wait", mutates_args=())
def all_gather_sections_wait(
    ticket: torch.Tensor, shard: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The gathered sections of the start that gave ``ticket`` (``shard``, its input, is an
    input here too so that a graph keeps it until the sends are done)."""
    del shard, group_size
    return _IN_FLIGHT.pop(int(ticket)).wait()


@all_gather_sections_wait.register_fake
def _(ticket: torch.Tensor, shard: torch.Tensor, group_size: int) -> torch.Tensor:  # noqa: ARG001
    return shard.new_empty(group_size * shard.numel())


def sum_by_rank(blocks: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of ``blocks`` (one block per rank), added in rank order in float32
    for a 16-bit dtype (else its own), then cast back: :func:`reduce_by_sends`'s order, and
    ``torch.sum``'s own where it adds the rows in turn (measured equal for 2-4 rows, fp32 /
    bf16 / fp16), so that a sum received whole and one received a block at a time agree for
    any number of ranks. The first two blocks are added in one pass (no zeros first):

    >>> blocks = torch.tensor([[1.0, 1e8], [2.0, -1e8], [3.0, 1.0]])
    >>> sum_by_rank(blocks)  # (1e8 - 1e8) + 1, where 1e8 + 1 would lose the 1 in float32
    tensor([6., 1.])
    """
    out = _first_two(blocks[0], blocks[1] if len(blocks) > 1 else None, None)
    for block in blocks[2:]:
        out += block
    return out.to(blocks.dtype)


def _first_two(
    first: torch.Tensor, second: torch.Tensor | None, owned: torch.Tensor | None
) -> torch.Tensor:
    """``first + second`` in the accumulator's dtype, a tensor the caller may add into:
    ``owned``, one of the two that is a buffer of the caller's own in that dtype, takes the
    sum in place (float addition is commutative, so either order gives the same bits)."""
    acc = _accumulator(first.dtype)
    if second is None:
        return first.to(acc, copy=True)
    if owned is not None and owned.dtype == acc:
        return owned.add_(second if owned is first else first)
    if first.dtype == acc:
        return torch.add(first, second)
    return first.to(acc).add_(second)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def reduce_by_sends(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's section of the sum over ``group`` of every rank's contiguous 1-D ``x``
    (one equal section per rank, in group rank order), by sends to each peer (a CPU gloo
    group), added as :func:`sum_by_rank` adds, one received section at a time: besides
    ``x``, the sum (float32 for a 16-bit ``x``) and one received section, where an
    all-to-all receives all of ``x``'s size first. Counts nothing."""
    while _UNWAITED:
        _UNWAITED.pop(0).wait()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    sections = x.view(size, -1)
    sends = _Works(
        [
            dist.isend(sections[peer], group=group, group_dst=peer, tag=_REDUCE_TAG)
            for peer in range(size)
            if peer != rank
        ]
    )
    own, free = sections[rank], []  # free: received buffers added already, to receive into
    first = total = None  # the first block in rank order until the second; then their sum
    for peer in range(size):
        block = own
        if peer != rank:
            block = free.pop() if free else torch.empty_like(own)
            dist.irecv(block, group=group, group_src=peer, tag=_REDUCE_TAG).wait()
        if first is None and total is None:
            first = block
        elif total is None:
            total = _first_two(first, block, block if block is not own else first)
            free += [t for t in (first, block) if t is not total and t is not own]
        else:
            total += block
            free += [block] if block is not own else []
    sends.wait()
    return (_first_two(first, None, None) if total is None else total).to(x.dtype)


class _Reducing:
    """A reduce by sends in flight (:func:`reduce_scatter_sections_start`): this rank's sections
    sent, every peer's section received into a buffer of its own while the graph computes;
    :meth:`wait` adds them as :func:`reduce_by_sends` does (the same bits)."""

    def __init__(self, x: torch.Tensor, group: dist.ProcessGroup) -> None:
        while _UNWAITED:
            _UNWAITED.pop(0).wait()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        sections = x.view(size, -1)
        self._dtype, self._blocks = x.dtype, []
        sends = []
        for peer in range(size):
            if peer == rank:
                self._blocks.append((sections[rank], None))
                continue
            sends.append(dist.isend(sections[peer], group=group, group_dst=peer, tag=_REDUCE_TAG))
            block = torch.empty_like(sections[0])
            recv = dist.irecv(block, group=group, group_src=peer, tag=_REDUCE_TAG)
            self._blocks.append((block, _Works([recv])))
        self._sends = _Works(sends)

    def wait(self) -> torch.Tensor:
        """This rank's section of the sum, once every section has arrived and been sent."""
        first = total = None  # as in reduce_by_sends; a received block is ours to add into
        for block, received in self._blocks:
            if received is not None:
                received.wait()
            if first is None and total is None:
                first = block
            elif total is None:
                total = _first_two(first, block, block if received is not None else first)
            else:
                total += block
        self._sends.wait()
        return (_first_two(first, None, None) if total is None else total).to(self._dtype)

    def sections(self) -> torch.Tensor:
        """Every rank's section of this rank's part, in group rank order, not added (an
        all-to-all's output: a narrow wire sums them itself)."""
        self.discard()
        return torch.cat([block for block, _ in self._blocks])

    def discard(self) -> None:
        """Waits for every section to arrive and be sent, and adds nothing."""
        for _, received in self._blocks:
            if received is not None:
                received.wait()
        self._sends.wait()


@torch.library.custom_op("funcshard::reduce_scatter_sections_start", mutates_args=())
def reduce_scatter_sections_start(
    x: torch.Tensor,
    after: torch.Tensor | None,
    group_size: int,
    group_name: str,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """Starts :func:`reduce_scatter_sections`; returns its ticket, a one-element int64 tensor that
    :func:`reduce_scatter_sections_wait` redeems (not read: ``after``, the previous reduce's wait;
    ``other``, the previous gather's start where one comes between the two reduces)."""
    del after, other
    group = _resolve_process_group(group_name)
    assert dist.get_world_size(group) == group_size, (group_name, group_size)
    _REDUCING.clear()  # left by a graph that raised between a start and its wait (their
    # works wait in _UNWAITED, each keeping its buffer, until the next sends are posted)
    ticket = next(_TICKETS)
    _REDUCING[ticket] = _Reducing(x.contiguous(), group)
    _started("reduces")
    return torch.tensor([ticket], dtype=torch.int64)


@reduce_scatter_sections_start.register_fake
def _(
    x: torch.Tensor,  # noqa: ARG001
    after: torch.Tensor | None,  # noqa: ARG001
    group_size: int,  # noqa: ARG001
    group_name: str,  # noqa: ARG001
    other: torch.Tensor | None = None,  # noqa: ARG001
) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("funcshard::reduce_scatter_sections_wait", mutates_args=())
def reduce_scatter_sections_wait(
    ticket: torch.Tensor, x: torch.Tensor, group_size: int, summed: bool = True
) -> torch.Tensor:
    """The section of the reduce that gave ``ticket`` (``x``, its input, is an input here too
    so that a graph keeps it until its sends are done); not ``summed``: every rank's section
    (:meth:`_Reducing.sections`)."""
    del x, group_size
    reducing = _REDUCING.pop(int(ticket))
    return reducing.wait() if summed else reducing.sections()


@reduce_scatter_sections_wait.register_fake
def _(ticket: torch.Tensor, x: torch.Tensor, group_size: int, summed: bool = True) -> torch.Tensor:  # noqa: ARG001
    return x.new_empty(x.numel() // group_size if summed else x.numel())


@torch.library.custom_op("funcshard::reduce_scatter_sections", mutates_args=())
def reduce_scatter_sections(
    x: torch.Tensor,
    after: torch.Tensor | None,
    group_size: int,
    group_name: str,
    summed: bool = True,
) -> torch.Tensor:
    """This rank's section of the sum over the group named ``group_name`` (``group_size``
    ranks) of every rank's 1-D ``x`` (``group_size`` sections in group rank order), by
    :func:`reduce_by_sends`, in one op whose output is the section alone (module docstring).
    ``after``, not read, is the previous reduce's output in the graph (under
    ``overlap=False`` the previous gather's or reduce's: one chain of both kinds): the
    captured step's passes chain them so that every rank posts its sends in one order. Not
    ``summed``: every rank's section of this rank's part, in rank order (a narrow wire's
    exchange, in the reduces' chain: an all-to-all's output by the same sends)."""
    del after
    group = _resolve_process_group(group_name)
    assert dist.get_world_size(group) == group_size, (group_name, group_size)
    _started("reduces")
    if not summed:
        return _Reducing(x.contiguous(), group).sections()
    return reduce_by_sends(x.contiguous(), group)


@reduce_scatter_sections.register_fake
def _(
    x: torch.Tensor,
    after: torch.Tensor | None,  # noqa: ARG001
    group_size: int,
    group_name: str,  # noqa: ARG001
    summed: bool = True,
) -> torch.Tensor:
    return x.new_empty(x.numel() // group_size if summed else x.numel())


# the reduces' sends, apart from the gathers' (gloo matches a pair's messages in order per
# tag): a graph orders its reduces among themselves (``after``) and its gathers among
# themselves, not a reduce against a gather, and a rank's inductor may order those two by its
# own shapes' costs
_REDUCE_TAG = _PIECES_TAG + 1

# gathers started and not yet waited for, by ticket (at most one per graph at a time)
_IN_FLIGHT: dict[int, Pending] = {}
# reduces started and not yet waited for, by ticket (at most one at a time)
_REDUCING: dict[int, _Reducing] = {}
_TICKETS = itertools.count()

# the ops as graph nodes' targets
ALL_GATHER_SECTIONS = torch.ops.funcshard.all_gather_sections.default
ALL_GATHER_SECTIONS_START = torch.ops.funcshard.all_gather_sections_start.default
ALL_GATHER_SECTIONS_WAIT = torch.ops.funcshard.all_gather_sections_wait.default
REDUCE_SCATTER_SECTIONS = torch.ops.funcshard.reduce_scatter_sections.default
REDUCE_SCATTER_SECTIONS_START = torch.ops.funcshard.reduce_scatter_sections_start.default
REDUCE_SCATTER_SECTIONS_WAIT = torch.ops.funcshard.reduce_scatter_sections_wait.default


@torch.library.custom_op("funcshard::graph_collectives", mutates_args=())
def graph_collectives(manifest: str) -> torch.Tensor:
    """A graph's first op (:mod:`funcshard.step.units.comm_order` puts it there): records
    the graph's gathers and reduces by sends, in their chains' order (``manifest``, JSON: for
    "gathers" and "reduces", each one's ``[numel, dtype, group_size, group_name]``), as the
    open graph's, none started yet, so that the graph raising on this rank can post the rest
    (:func:`drain_failed_graph`). Returns a ticket each chain's first start (or, under
    ``overlap=False``, the first whole op) takes as its ``after``.

    torch's functional collectives in a graph (a tensor-parallel model's; on a GPU every
    gather and reduce-scatter) are not recorded: inductor's code issues them, nothing of ours
    could count them, and a drain of some of a group's collectives but not the others would
    pair a collective with one of another kind. A graph with none by sends has no record."""
    _OPEN[:] = [_Open(json.loads(manifest))]
    return torch.empty(1, dtype=torch.int64)


@graph_collectives.register_fake
def _(manifest: str) -> torch.Tensor:  # noqa: ARG001
    return torch.empty(1, dtype=torch.int64)


class _Open:
    """The collectives of the graph that runs (:func:`graph_collectives`), and how many of
    each chain this rank has started."""

    def __init__(self, manifest: dict[str, list[list]]) -> None:
        self.specs = {kind: manifest.get(kind, []) for kind in _KINDS}
        self.started = dict.fromkeys(self.specs, 0)

    def rest(self, kind: str) -> list[list]:
        return self.specs[kind][self.started[kind] :]


def _started(kind: str) -> None:
    """Counts a start of the open graph's."""
    if _OPEN and _OPEN[0].started[kind] < len(_OPEN[0].specs[kind]):
        _OPEN[0].started[kind] += 1


def drain_failed_graph() -> None:
    """Where a captured graph raised on this rank: each gather and reduce by sends of the
    graph that this rank had not started yet, posted with every byte 0xFF (NaN in each float
    format), then every one in flight waited for.

    Each rank's inductor schedules its graph by its own shapes, so a rank may wait for a
    reduce before an op that raises on every rank while a peer raises there before starting
    that reduce: the first waits for ever, the second's next step pairs its sends with the
    failed step's. Posted here, each collective of the failed graph is met by every rank (by
    its own start, or this one) in the chains' order, and the pairs of ranks stay in step. A
    peer that did not fail finishes the graph with NaN where this rank's sections were (never
    values that look right), then waits at its step's next collective. Everything is posted
    before anything is waited for: a peer may be waiting for a reduce while this rank has
    gathers left."""
    opened = _OPEN.pop() if _OPEN else None
    held: list[Pending | _Reducing] = [*_IN_FLIGHT.values(), *_REDUCING.values()]
    _IN_FLIGHT.clear()
    _REDUCING.clear()
    posted: list[Pending | _Reducing] = []
    if opened is not None:
        for numel, dtype, size, name in opened.rest("gathers"):
            shard = _poison(numel, dtype)
            out = shard.new_empty(size * numel)
            group = _resolve_process_group(name)
            posted.append(gather_in_place(out, shard, group, async_op=True))
        for numel, dtype, _, name in opened.rest("reduces"):
            posted.append(_Reducing(_poison(numel, dtype), _resolve_process_group(name)))
    for work in [*held, *posted]:
        work.discard()


@contextlib.contextmanager
def drained_on_failure() -> Iterator[None]:
    """Runs graphs of a captured step: one raising on this rank posts the rest of its
    collectives (:func:`drain_failed_graph`) before the error goes on."""
    try:
        yield
    except Exception:
        drain_failed_graph()
        raise


def _poison(numel: int, dtype: str) -> torch.Tensor:
    kind = getattr(torch, dtype)
    return torch.full((numel * kind.itemsize,), 0xFF, dtype=torch.uint8).view(kind)


_KINDS = ("gathers", "reduces")
# the open graph (:func:`graph_collectives`): none, or the one that ran last
_OPEN: list[_Open] = []
GRAPH_COLLECTIVES = torch.ops.funcshard.graph_collectives.default
