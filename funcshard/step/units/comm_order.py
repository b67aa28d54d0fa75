"""Where inductor's schedule issues the captured step's gathers and reduces by sends (a CPU
gloo group).

:func:`funcshard.step.units.prefetch.overlap_reduces` splits each bucket's reduce into a start
(``funcshard::reduce_scatter_sections_start``: the sections sent, the peers' posted for) and a wait
(the sum, once they have arrived), each start taking the previous reduce's wait as an input
it does not read, so that every rank issues the reduces in one order. Left to inductor, both
go to the end of the backward graph: its peak-memory ordering
(``torch._inductor.memory.reorder_for_peak_memory``) gains nothing from a start (it frees
nothing: its input lives until the wait) and runs every gradient matmul first, so every
bucket's gradients would be held to the end and no reduce would overlap the backward.

:func:`place_starts`, run last among inductor's ``reorder_for_compute_comm_overlap_passes``
(after the peak-memory ordering), places the starts of both kinds one at a time in the
graph's order (each start's inputs fix it: :func:`funcshard.step.units.prefetch.order_kinds`).
Each reduce's start goes just after the last node it depends on (its bucket's gradients
complete, each of them first moved to just after its own inputs: inductor's order deferred
a block's weight gradient to the tail, holding every block's output gradient there) and
the previous reduce's wait just before it: the eager step's order, where a
bucket's reduce is waited for as the next one starts, one in flight while the backward
computes. Each gather's previous wait goes just before the first node that reads the
gathered params, and the gather's start as soon after that wait as its inputs allow (one
bucket ahead). A start never goes before a node it depends on, and a wait never after a node
that reads it; where the result were not valid all the same, inductor's order stays (the
record first). Either way the starts' order is the graph's, the same on every rank.
``overlap=False``'s pass (:func:`place_in_order`) places its whole reduces the same way.
"""

from __future__ import annotations

from typing import Any

from torch._inductor import ir
from torch._inductor.dependencies import WeakDep

from funcshard.distributed.graph_ops import (
    ALL_GATHER_SECTIONS,
    ALL_GATHER_SECTIONS_START,
    ALL_GATHER_SECTIONS_WAIT,
    GRAPH_COLLECTIVES,
    REDUCE_SCATTER_SECTIONS,
    REDUCE_SCATTER_SECTIONS_START,
    REDUCE_SCATTER_SECTIONS_WAIT,
)

__all__ = ["place_comms", "place_in_order", "place_mark", "place_starts"]


def place_comms(snodes: list[Any]) -> list[Any]:
    """:func:`place_mark`, then :func:`place_starts`, or the order with the mark first if
    their result were not valid (a node before one it depends on)."""
    first = place_mark(snodes)
    order = place_starts(list(first))
    return order if _valid(order) else first


def place_mark(snodes: list[Any]) -> list[Any]:
    """The graph's record of its collectives (``funcshard::graph_collectives``) first, so that
    nothing can raise before it, the rest as it was (the order both passes fall back to)."""
    first = list(snodes)
    for mark in _ops(first, GRAPH_COLLECTIVES):  # it reads nothing: first is valid
        _remove(first, mark)
        first[0:0] = mark
    return first


def place_in_order(snodes: list[Any]) -> list[Any]:
    """``overlap=False``'s one reorder pass: :func:`place_mark`, then each whole reduce by
    sends (``funcshard::reduce_scatter_sections``, chained after the collective before it)
    just after its bucket's gradients, computed as soon as their inputs are
    (:func:`_hoist_ancestors`); the mark first alone if that order were not valid."""
    first = place_mark(snodes)
    order = list(first)
    reduces = _ops(order, REDUCE_SCATTER_SECTIONS)
    collectives = (*reduces, *_ops(order, ALL_GATHER_SECTIONS))
    fixed = {id(s) for group in collectives for s in group}
    for k, group in enumerate(reduces):
        _hoist_ancestors(order, group, reduces[k - 1] if k else [], fixed, set())
        _remove(order, group)
        to = _last_ancestor(order, group, set()) + 1
        order[to:to] = group
    return order if _valid(order) else first


def place_starts(order: list[Any]) -> list[Any]:
    """``order`` (inductor's scheduler nodes) with the starts by sends placed one at a time,
    in their order (the graph's, which their inputs fix: each kind's chain and the start of
    the other kind before it, :func:`funcshard.step.units.prefetch.order_kinds`), each after
    those before it: a gather's (:func:`_place_gather`) or a reduce's
    (:func:`_place_reduce`); the last gather's wait then just before its first reader."""
    g_starts, g_waits = (
        _ops(order, ALL_GATHER_SECTIONS_START),
        _ops(order, ALL_GATHER_SECTIONS_WAIT),
    )
    r_starts, r_waits = (
        _ops(order, REDUCE_SCATTER_SECTIONS_START),
        _ops(order, REDUCE_SCATTER_SECTIONS_WAIT),
    )
    if len(g_starts) != len(g_waits) or len(r_starts) != len(r_waits):
        return order
    turns = [(s, g_waits[j - 1], _place_gather) for j, s in enumerate(g_starts) if j]
    turns += [(s, r_waits[k - 1] if k else [], _place_reduce) for k, s in enumerate(r_starts)]
    turns.sort(key=lambda turn: order.index(turn[0][0]))
    fixed = {id(s) for group in (*g_starts, *g_waits, *r_starts, *r_waits) for s in group}
    before = {id(s[0]): r_starts[k - 1] if k else [] for k, s in enumerate(r_starts)}
    placed: set[int] = set()
    for start, wait, place in turns:
        if place is _place_reduce:
            _hoist_ancestors(order, start, before[id(start[0])], fixed, placed)
        place(order, start, wait)
        placed |= {id(s) for s in (*start, *wait)}
    if g_waits:  # no start after it
        _remove(order, g_waits[-1])
        to = _first_user(order, g_waits[-1])
        order[to:to] = g_waits[-1]
    return order


def _place_gather(order: list[Any], start: list[Any], wait: list[Any]) -> None:
    """The previous gather's ``wait`` just before the first node that reads the gathered
    params, and this gather's ``start`` as soon after it as the start's inputs allow (a
    packed shard's encode, a reduce's start before it)."""
    _remove(order, wait)
    _remove(order, start)
    to = _first_user(order, wait)
    order[to:to] = wait
    at = max(to + len(wait), _last_ancestor(order, start, set()) + 1)
    order[at:at] = start


def _place_reduce(order: list[Any], start: list[Any], wait: list[Any]) -> None:
    """A reduce's ``start`` just after its gradients (and whatever else it depends on) and
    the previous reduce's ``wait`` just before that start."""
    _remove(order, wait)
    _remove(order, start)
    to = _last_ancestor(order, start, _names(wait)) + 1
    # the wait no later than a node that reads its result (the start after it does)
    to_wait = min(to, _first_user(order, wait))
    order[to_wait:to_wait] = wait
    order[to + len(wait) : to + len(wait)] = start  # after both


def _hoist_ancestors(
    order: list[Any], start: list[Any], previous: list[Any], fixed: set[int], placed: set[int]
) -> None:
    """Each node a reduce's ``start`` depends on, after the ``previous`` reduce's start, moved
    to just after the last node it depends on (not before that start), in order: the bucket's
    gradients computed as soon as their inputs are, as eager's autograd computes a layer's
    weight gradient beside its input gradient. inductor's peak-memory ordering defers them
    (a gradient it computes early lives to the reduce, which it sees at the graph's tail),
    so that without this each block's output gradient was held to the end of the backward
    and every reduce came after the last block's. The collectives' own nodes (``fixed``)
    stay where they are, each placed in its own turn, and a node moved goes after those at
    its place that a turn ``placed`` already and that do not depend on it (a gather's start
    placed one bucket ahead stays ahead of the compute)."""
    floor = order.index(previous[-1]) + 1 if previous else _after_mark(order)
    ancestors = set().union(*(s.ancestors for s in start)) - _names(start)
    for snode in [s for s in order[floor:] if id(s) not in fixed and _names([s]) & ancestors]:
        order.remove(snode)
        to = max(floor, _last_ancestor(order, [snode], set()) + 1)
        while _stays_ahead(order, to, snode, placed):
            to += 1
        order.insert(to, snode)


def _stays_ahead(order: list[Any], at: int, snode: Any, placed: set[int]) -> bool:
    """Whether the node at ``at`` is a collective's a turn placed that ``snode`` may follow
    (it does not depend on ``snode``)."""
    return (
        at < len(order)
        and id(order[at]) in placed
        and not (snode.get_operation_names() & order[at].ancestors)
    )


def _after_mark(order: list[Any]) -> int:
    """The index after the graph's record of its collectives where it leads ``order``
    (:func:`place_mark`), else 0."""
    marks = _ops(order[:2], GRAPH_COLLECTIVES)
    return len(marks[0]) if marks and marks[0][0] is order[0] else 0


def _remove(order: list[Any], group: list[Any]) -> None:
    if group:
        at = order.index(group[0])
        del order[at : at + len(group)]


def _first_user(order: list[Any], group: list[Any]) -> int:
    """The index in ``order`` of the first node that reads a buffer of ``group`` (its
    length: none)."""
    bufs = {name for snode in group for name in snode.get_buffer_names()}
    reads = (i for i, s in enumerate(order) if {d.name for d in s.read_writes.reads} & bufs)
    return next(reads, len(order))


def _ops(order: list[Any], target: Any) -> list[list[Any]]:
    """The scheduler nodes of each call of ``target`` in ``order``: its kernel and the
    nodes that unpack its outputs (``ir.MultiOutput``)."""
    groups = []
    for i, snode in enumerate(order):
        node = getattr(snode, "node", None)
        if getattr(node, "op_overload", None) is not target:
            continue
        group = [snode]
        for later in order[i + 1 :]:
            out = getattr(later, "node", None)
            if not isinstance(out, ir.MultiOutput) or not _unpacks(out, node):
                break
            group.append(later)
        groups.append(group)
    return groups


def _unpacks(out: ir.MultiOutput, node: Any) -> bool:
    return any(i is node for i in out.inputs)


def _names(group: list[Any]) -> set[str]:
    return {name for snode in group for name in snode.get_operation_names()}


def _last_ancestor(order: list[Any], group: list[Any], leave_out: set[str]) -> int:
    """The index in ``order`` of the last node ``group`` depends on (-1: none), the nodes
    named ``leave_out`` and their own ancestors not counted."""
    ancestors = set().union(*(s.ancestors for s in group)) - _names(group) - leave_out
    return max((i for i, s in enumerate(order) if _names([s]) & ancestors), default=-1)


def _valid(order: list[Any]) -> bool:
    """Whether every node of ``order`` comes after the nodes of ``order`` whose buffers it
    depends on (a buffer no node makes is a graph input's, or one inductor removed).

    Not the fake dependency (``WeakDep(is_fake=True)``) that inductor gives each functional
    collective on the one before it, which its own passes do not keep either (they sink a
    collective's wait past the next collective): counted, it made inductor's own order of a
    graph with two all-to-alls (a narrow gradient wire's) invalid, and every such graph
    kept it, its gathers placed by no one."""
    made = {name: i for i, snode in enumerate(order) for name in snode.get_buffer_names()}
    return all(
        made.get(dep.name, -1) <= i
        for i, snode in enumerate(order)
        for dep in snode.unmet_dependencies
        if not (isinstance(dep, WeakDep) and dep.is_fake)
    )
