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
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
from collections.abc import Iterator

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from funcshard.distributed import graph_ops
from funcshard.distributed.graph_ops import (
    ALL_GATHER_SECTIONS,
    ALL_GATHER_SECTIONS_START,
    ALL_GATHER_SECTIONS_WAIT,
)

__all__ = ["PrefetchGathers", "installed", "prefetch_gathers"]

_META = ("val", "tensor_meta", "stack_trace", "nn_module_stack")


def prefetch_gathers(graph: fx.Graph) -> int:
    """Rewrites ``graph`` (module docstring); returns how many gathers it starts early."""
    gathers = [n for n in graph.nodes if n.target is ALL_GATHER_SECTIONS]
    previous: fx.Node | None = None
    early = 0
    for gather in gathers:
        shard, *rest = gather.args
        with graph.inserting_before(gather):
            start = graph.call_function(ALL_GATHER_SECTIONS_START, (shard, previous, *rest))
            wait = graph.call_function(ALL_GATHER_SECTIONS_WAIT, (start, shard, rest[0]))
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


class PrefetchGathers(CustomGraphPass):
    """:func:`prefetch_gathers` as one of inductor's ``post_grad_custom_post_pass`` passes
    (its ``uuid``, the source of this module and of the ops it writes into the graphs, keys
    inductor's graph cache: a cached graph never calls the ops as an older version did)."""

    def __call__(self, graph: fx.Graph) -> None:
        prefetch_gathers(graph)

    def uuid(self) -> bytes:
        sources = (sys.modules[__name__], graph_ops)
        return hashlib.sha256("".join(map(inspect.getsource, sources)).encode()).digest()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """:class:`PrefetchGathers` as inductor's first post-grad pass, the passes a user set there
    (one, or a list or tuple of them) after it, each as inductor runs and keys it alone (an
    inference-aware pass told ``is_inference``; one without a ``uuid`` bypasses the cache)."""
    import torch._inductor.config as config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    user = get_custom_graph_passes(config.post_grad_custom_post_pass)
    if any(isinstance(p, PrefetchGathers) for p in user):  # installed already (a nested call)
        yield
        return
    with config.patch(post_grad_custom_post_pass=(PrefetchGathers(), *user)):
        yield
