"""The captured step's gathers one bucket ahead, on a CPU gloo group (inductor's graphs).

The eager ZeRO-3 step gathers the next unit's buckets while the current one computes (its
prefetch). In a captured step the joint-graph pass (:mod:`funcshard.step.units.schedule`)
puts each bucket's gather just before its first use; on a CPU gloo group that gather is
:func:`funcshard.distributed.graph_ops.all_gather_sections`, which returns when its sections
have arrived, so the graph computes nothing while it runs. inductor's overlap passes move
only torch's functional collectives, and a peak-memory budget of zero (funcshard's, see
:data:`funcshard.step.compiling.OVERLAP_COMMS`) keeps them from issuing a gather early.

:class:`PrefetchGathers`, run on each of inductor's post-grad graphs (forward and backward),
turns each such gather into ``all_gather_sections_start`` and ``all_gather_sections_wait``
(:mod:`funcshard.distributed.graph_ops`), the wait where the gather was and the start just
after the previous gather's wait: at most one gather is in flight, as in eager, and it runs
while the previous bucket's compute does. A shard packed on a param wire inside the graph
keeps its start where the gather was (its encode would have to move too), in the same chain:
every gather by sends of a graph, prefetched or not, in one order on every rank (they share
a gloo tag, matched in order per pair). The start returns an eight-byte ticket, so
inductor's peak-memory ordering has no buffer to defer it for (with torch's ``wait_tensor`` on
the start's output it issued each forward gather after the previous bucket's compute); it
takes the previous wait's output as an input it does not read, so the gathers keep their
order on every rank whatever order the scheduler picks around them; the wait takes the
shard, kept alive until the sends are done. ``gathered_peak`` counts a bucket from its wait,
as eager's does; the bucket in flight is one more, as in eager.

:func:`overlap_reduces` does the same for the backward graph's reduces by sends
(``funcshard::reduce_scatter_sections``): each becomes ``reduce_scatter_sections_start``
where it was and ``reduce_scatter_sections_wait`` just before the reduce's first reader or
the next reduce, each start taking the previous wait as its ``after``. Where inductor's
schedule runs them is :mod:`funcshard.step.units.comm_order`'s to say (its peak-memory
ordering would put every start and wait at the graph's tail), installed with the post-grad
pass by :func:`installed`.

:func:`order_kinds` then ties the two chains into one order: each start whose previous start
in the graph is of the other kind takes that start as an input it does not read, so that
every rank starts its gathers and reduces in the graph's order (a rank waits only for starts
its peers posted before: no deadlock whatever each rank's scheduler does around them).

:func:`mark_collectives` then records the graph's gathers and reduces, in their chains'
order, in an op that comm_order runs first (``funcshard::graph_collectives``): a graph that
raises on one rank posts the rest of them there
(:func:`funcshard.distributed.graph_ops.drain_failed_graph`), so that a peer whose schedule
waits for one before the op that raised is met, and the pairs of ranks stay in step.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import sys
from collections.abc import Iterator

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import optimization_hint

from funcshard.distributed import graph_ops
from funcshard.distributed.graph_ops import (
    ALL_GATHER_SECTIONS,
    ALL_GATHER_SECTIONS_START,
    ALL_GATHER_SECTIONS_WAIT,
    GRAPH_COLLECTIVES,
    REDUCE_SCATTER_SECTIONS,
    REDUCE_SCATTER_SECTIONS_START,
    REDUCE_SCATTER_SECTIONS_WAIT,
)
from funcshard.step.units.comm_order import place_comms, place_in_order

__all__ = [
    "PrefetchGathers",
    "installed",
    "mark_collectives",
    "order_kinds",
    "overlap_reduces",
    "prefetch_gathers",
]

_META = ("val", "tensor_meta", "stack_trace", "nn_module_stack")


def prefetch_gathers(graph: fx.Graph) -> int:
    """Rewrites ``graph`` (module docstring); returns how many gathers it starts early."""
    gathers = [n for n in graph.nodes if n.target is ALL_GATHER_SECTIONS]
    previous: fx.Node | None = None
    early = 0
    for gather in gathers:
        shard, size, name, _ = gather.args
        with graph.inserting_before(gather):
            start = graph.call_function(ALL_GATHER_SECTIONS_START, (shard, previous, size, name))
            wait = graph.call_function(ALL_GATHER_SECTIONS_WAIT, (start, shard, size))
        # the gather's value (not its recorded eager inputs: other args)
        wait.meta.update({k: v for k, v in gather.meta.items() if k in _META})
        start.meta["val"] = gather.meta["val"].new_empty(1, dtype=torch.int64)
        gather.replace_all_uses_with(wait)
        graph.erase_node(gather)
        # issued as the previous bucket's sections arrive; a packed shard where it was packed
        if previous is not None and shard.op == "placeholder":
            previous.append(start)
            early += 1
        previous = wait
    return early


def overlap_reduces(graph: fx.Graph) -> int:
    """Splits each reduce by sends of ``graph`` into its start, where the reduce was, and its
    wait, just before the reduce's first user or the next reduce's start (module docstring;
    :mod:`funcshard.step.units.comm_order` places them in inductor's schedule). Returns
    how many it split."""
    reduces = [n for n in graph.nodes if n.target is REDUCE_SCATTER_SECTIONS]
    order = {n: i for i, n in enumerate(graph.nodes)}
    previous: fx.Node | None = None
    for i, reduce in enumerate(reduces):
        x, _, size, name, *summed = reduce.args  # summed: a narrow wire's exchange if False
        summed += [reduce.kwargs["summed"]] if "summed" in reduce.kwargs else []
        with graph.inserting_before(reduce):
            start = graph.call_function(REDUCE_SCATTER_SECTIONS_START, (x, previous, size, name))
        start.meta["val"] = reduce.meta["val"].new_empty(1, dtype=torch.int64)
        then = min([*reduce.users, *reduces[i + 1 : i + 2]], key=order.__getitem__)
        with graph.inserting_before(then):
            wait = graph.call_function(REDUCE_SCATTER_SECTIONS_WAIT, (start, x, size, *summed))
        wait.meta.update({k: v for k, v in reduce.meta.items() if k in _META})
        reduce.replace_all_uses_with(wait)
        graph.erase_node(reduce)
        previous = wait
    return len(reduces)


def order_kinds(graph: fx.Graph) -> int:
    """Each start by sends of ``graph`` whose previous start in the graph is of the other
    kind (a gather's after a reduce's, or the reverse) takes that start as its ``other``, an
    input it does not read: every rank then starts its gathers and reduces in one order, the
    graph's, as each kind's chain orders its own (module docstring). Returns how many it
    tied."""
    kinds = (ALL_GATHER_SECTIONS_START, REDUCE_SCATTER_SECTIONS_START)
    starts = [n for n in graph.nodes if n.target in kinds]
    tied = 0
    for previous, start in zip(starts, starts[1:], strict=False):
        if previous.target is not start.target:
            start.update_kwarg("other", previous)
            tied += 1
    return tied


def mark_collectives(graph: fx.Graph) -> fx.Node | None:
    """Records ``graph``'s gathers and reduces by sends (starts, or under ``overlap=False``
    whole ops) in its first op, ``funcshard::graph_collectives``
    (:func:`funcshard.distributed.graph_ops.drain_failed_graph`), which the first of each
    chain takes as its ``after``; None where it has none."""
    kinds = {"gathers": _GATHERS, "reduces": _REDUCES}
    chains = {k: [n for n in graph.nodes if n.target in ops] for k, ops in kinds.items()}
    if not any(chains.values()):
        return None
    manifest = {kind: [_spec(node) for node in nodes] for kind, nodes in chains.items()}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        mark = graph.call_function(GRAPH_COLLECTIVES, (json.dumps(manifest),))
    some = next(nodes[0] for nodes in chains.values() if nodes)
    mark.meta["val"] = some.meta["val"].new_empty(1, dtype=torch.int64)
    for nodes in chains.values():
        after = _AFTER[nodes[0].target] if nodes else None
        if after is not None and nodes[0].args[after] is None:
            nodes[0].update_arg(after, mark)
    return mark


# each op by sends, by kind; where its ``after`` and its group's size and name are
_GATHERS = (ALL_GATHER_SECTIONS_START, ALL_GATHER_SECTIONS)
_REDUCES = (REDUCE_SCATTER_SECTIONS_START, REDUCE_SCATTER_SECTIONS)
_AFTER = {ALL_GATHER_SECTIONS: 3, ALL_GATHER_SECTIONS_START: 1}
_AFTER.update(dict.fromkeys(_REDUCES, 1))


def _spec(node: fx.Node) -> list:
    """``[numel, dtype, group_size, group_name]`` of a collective's input (its first arg)."""
    size_name = node.args[1:3] if node.target is ALL_GATHER_SECTIONS else node.args[2:4]
    return [*_numel_dtype(node.args[0]), *size_name]


def _numel_dtype(node: fx.Node) -> tuple[int, str]:
    val = node.meta["val"]  # symbolic in a dynamic compile: its layout's size (no guard)
    return optimization_hint(val.numel()), str(val.dtype).removeprefix("torch.")


def chain_collectives(graph: fx.Graph) -> int:
    """``fs.init(overlap=False)``'s pass: each gather and reduce by sends of ``graph``, whole
    ops that block until done, takes the one before it in the graph, of either kind, as its
    ``after``, so that inductor's scheduler runs them in one order on every rank. Left to
    it, a rank of 2 rows and one of 30 ran a gather and a reduce in opposite orders, each
    blocked in its own (found by review). Returns how many it chained."""
    ops = [n for n in graph.nodes if n.target in (ALL_GATHER_SECTIONS, REDUCE_SCATTER_SECTIONS)]
    for previous, node in zip([None, *ops], ops, strict=False):
        if node.target is REDUCE_SCATTER_SECTIONS:
            node.update_arg(1, previous)
        else:
            node.update_arg(3, previous)
    return len(ops)


class PrefetchGathers(CustomGraphPass):
    """:func:`prefetch_gathers` as one of inductor's ``post_grad_custom_post_pass`` passes
    (its ``uuid``, the source of this module and of the ops it writes into the graphs, keys
    inductor's graph cache: a cached graph never calls the ops as an older version did);
    ``overlap=False``: :func:`chain_collectives` alone."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap

    def __call__(self, graph: fx.Graph) -> None:
        if not self.overlap:
            chain_collectives(graph)
            mark_collectives(graph)
            return
        prefetch_gathers(graph)
        overlap_reduces(graph)
        order_kinds(graph)
        mark_collectives(graph)

    def uuid(self) -> bytes:
        sources = (sys.modules[__name__], graph_ops, sys.modules[place_comms.__module__])
        text = "".join(map(inspect.getsource, sources)) + f"overlap={self.overlap}"
        return hashlib.sha256(text.encode()).digest()


# one of each, made once: a pass made per captured call was left to the cycle collector
_PASSES = {overlap: PrefetchGathers(overlap) for overlap in (True, False)}


@contextlib.contextmanager
def installed(overlap: bool = True) -> Iterator[None]:
    """:class:`PrefetchGathers` as inductor's first post-grad pass, the passes a user set there
    (one, or a list or tuple of them) after it, each as inductor runs and keys it alone (an
    inference-aware pass told ``is_inference``; one without a ``uuid`` bypasses the cache);
    with ``overlap``, comm_order last among inductor's reorder passes; without, comm_order's
    :func:`~funcshard.step.units.comm_order.place_in_order` as the only one."""
    import torch._inductor.config as config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    user = get_custom_graph_passes(config.post_grad_custom_post_pass)
    if any(isinstance(p, PrefetchGathers) for p in user):  # installed already (a nested call)
        yield
        return
    patch = {"post_grad_custom_post_pass": (_PASSES[overlap], *user)}
    if overlap:
        passes = [*config.reorder_for_compute_comm_overlap_passes, place_comms]
        patch["reorder_for_compute_comm_overlap_passes"] = passes
    else:  # the record first, each whole reduce after its gradients
        patch["reorder_for_compute_comm_overlap"] = True
        patch["reorder_for_compute_comm_overlap_passes"] = [place_in_order]
    with config.patch(patch):
        yield
