"""Where the captured step's collectives sit: a pass over AOTAutograd's joint graph.

AOTAutograd traces the captured microbatch (:mod:`funcshard.step.units.captured`) into one
joint forward + backward graph, then a partitioner splits it, saving for backward what the
backward reads of the forward. Left alone it saves the all-gathered params (ZeRO-3's point
lost) and, since every bucket's gather is applied before ``loss_fn`` runs, the autograd engine
orders every reduce-scatter after the whole backward. :func:`place_collectives`, run on the
joint graph before any partitioner (``torch._functorch.config.joint_custom_pass``, so it
serves every AOTAutograd backend: inductor, aot_eager, a callable built on ``aot_autograd``),
does what FSDP does eagerly:

* each all-gather, its wait and the views of its output are tagged ``MUST_RECOMPUTE``
  (SimpleFSDP's policy): the partitioner saves the shard, a graph input, and the backward
  gathers again where it needs the params;
* each all-gather chain moves to just before the first op that reads its params (forward
  gathers unit by unit, not all at the start);
* each reduce-scatter, with what feeds only it (the bucket's gradients' concatenation, the
  cast to the wire, the mean) and its wait, runs as soon as its inputs are ready: as the
  unit's backward ends, its gradients reduced and dropped before the next unit's backward.

Every rank traces the same program, so every rank's graph holds the collectives in the same
order.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import fx
from torch._guards import CompileContext
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.checkpoint import CheckpointPolicy

from funcshard.distributed.graph_ops import ALL_GATHER_SECTIONS, REDUCE_SCATTER_SECTIONS

__all__ = [
    "Placed",
    "compile_key",
    "joint_pass",
    "place_collectives",
    "GATHER",
    "GATHERS",
    "REDUCE_SCATTER",
    "ALL_TO_ALL",
    "WAIT",
]

_C10D = torch.ops._c10d_functional
GATHER = _C10D.all_gather_into_tensor.default
# the gathers of buckets: torch's functional one, or funcshard's in place on gloo
GATHERS = (GATHER, ALL_GATHER_SECTIONS)
REDUCE_SCATTER = _C10D.reduce_scatter_tensor.default
ALL_TO_ALL = _C10D.all_to_all_single.default  # a narrow gradient wire's reduce-scatter
WAIT = _C10D.wait_tensor.default


# what turns a gathered buffer into its leaves' params: views, and the copy that makes a leaf
# contiguous (its rank pieces are strided in the gathered rank sections)
_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default, WAIT)


class _Graph(NamedTuple):
    """What the pass placed in one graph: its re-gathers, its own gathered peak and the
    gathered bytes it holds from its forward to its backward (saved, not re-gathered)."""

    regathered: tuple[tuple[int, torch.dtype], ...]
    peak: int
    held: int


@dataclasses.dataclass
class Placed:
    """What :func:`place_collectives` placed in a captured step's graphs, per compile (dynamo
    frame, its compile number), and which compile of each frame ran in the current call.

    A frame compiled more than once (new shapes, another ``loss_fn``) keeps every compile:
    dynamo runs whichever one's guards pass, so a call's figures are those of the compiles
    that ran in it (:meth:`ran`, cleared by :meth:`start`), not the latest compile's.

    Attributes:
      graphs: (frame, compile) -> what the pass placed in that compile's graph.
      running: frame -> the compile of it that ran since :meth:`start`, in run order.
    """

    graphs: dict[tuple[int, int], _Graph] = dataclasses.field(default_factory=dict)
    running: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def start(self) -> None:
        """A new call of the step: no compile has run in it yet."""
        self.running.clear()

    def ran(self, key: tuple[int, int]) -> None:
        """The compile ``key`` (frame, compile number) ran (called as its graph is called)."""
        self.running[key[0]] = key

    def _ran_graphs(self) -> list[_Graph]:
        keys = sorted(self.running.values())
        return [self.graphs[k] for k in keys if k in self.graphs]

    @property
    def regathered(self) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of each all-gather the backward graphs that ran run again (its
        params read by the backward), in graph order."""
        return [r for g in self._ran_graphs() for r in g.regathered]

    @property
    def gathered_peak(self) -> int:
        """The most bytes of all-gathered buffers alive at once in the graphs that ran, each
        run in the order the pass left it (each from its all-gather to the last op that reads
        its params; in backward, from the first op that needs them again to the last); over
        the graphs of a step broken by dynamo, each graph's own peak plus what the graphs
        before it hold from their forward to their backward (a lower bound: the resumed
        graphs' forward outputs are not counted)."""
        peak = held = 0
        for g in self._ran_graphs():
            peak, held = max(peak, held + g.peak), held + g.held
        return peak


def compile_key() -> tuple[int, int]:
    """(dynamo frame, its compile number) of the graph being compiled ((0, 0) outside dynamo)."""
    compile_id = CompileContext.current_compile_id()
    if compile_id is None:
        return (0, 0)
    return (compile_id.frame_id or 0, compile_id.frame_compile_id or 0)


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return target is operator.getitem or target in _COPIES or bool(getattr(target, "is_view", 0))


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on a tangent (the joint graph's backward half)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _gather_chain(gather: fx.Node, backward: set[fx.Node]) -> list[fx.Node]:
    """The all-gather, its wait and every view (or contiguous copy) of the result: the params
    it hands out, in graph order; what backward recomputes from the shard. A param wire's
    decode (:func:`_derived`) joins it: the forward then saves no decoded param either."""
    chain, todo = [gather], [gather]
    while todo:
        for user in todo.pop().users:
            if user in backward or user in chain:
                continue
            if _is_view(user) or _derived(user, chain):
                chain.append(user)
                todo.append(user)
                chain.extend(_constants_of(user, chain))
    order = {n: i for i, n in enumerate(gather.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


# what a param wire's decode (funcshard.comm.codec.unpack) is made of, beside views: casts and
# the 8-bit formats' arithmetic on the gathered bytes alone
_DECODE = {
    "convert_element_type",
    "_to_copy",
    "mul",
    "div",
    "copy",
    "slice_scatter",
    "where",
    "bitwise_and",
    "bitwise_or",
    "bitwise_left_shift",
    "__lshift__",
    "lt",
    "gt",
    "reciprocal",
    "full",
    "empty",
    "clone",
    "cat",
    "abs",
    "amax",
    "sum",
    "add",
    "view_copy",
}


def _of_one_input(gather: fx.Node) -> bool:
    """Whether ``gather`` gathers a function of one graph input (a bucket's shard, packed on
    its wire or not), not an activation (a tensor-parallel model's DTensor ops gather those
    over "tensor": they stay where torch put them)."""
    inputs, seen, todo = set(), {gather}, [gather]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a.op == "placeholder":
                inputs.add(a)
                if len(inputs) > 1:
                    return False
            elif a not in seen:
                seen.add(a)
                todo.append(a)
    return len(inputs) == 1


def _constant(node: fx.Node) -> bool:
    """A tensor made from no tensor (``scalar_tensor``, ``empty``, ``full``, views of them):
    no placeholder among its inputs' inputs."""
    seen, todo = {node}, [node]
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.is_impure():
            return False
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return True


def _constants_of(node: fx.Node, chain: list[fx.Node]) -> list[fx.Node]:
    """The constants ``node`` reads (:func:`_constant`: a decode's output buffer, its views),
    those they are made of too, not in ``chain`` yet: they move and recompute with it."""
    out, todo = [], [a for a in node.all_input_nodes if _constant(a)]
    while todo:
        a = todo.pop()
        if a not in chain and a not in out:
            out.append(a)
            todo.extend(a.all_input_nodes)
    return out


def _constants_before_use(graph: fx.Graph) -> None:
    """Moves each tensor made from nothing to just before its first user: a chain sunk to its
    first use may have moved a decode op above a constant another chain took along."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n.op == "call_function" and not n.all_input_nodes]:
        if node.users and not node.is_impure():
            min(node.users, key=order.__getitem__).prepend(node)


def _derived(node: fx.Node, chain: list[fx.Node]) -> bool:
    """Whether ``node`` is a decode op (:data:`_DECODE`) whose tensor inputs are all of the
    chain (or made from no tensor at all: a constant)."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    if node.op != "call_function" or name not in _DECODE:
        return False
    return all(a in chain or _constant(a) for a in node.all_input_nodes)


def _sink_before_first_use(chain: list[fx.Node]) -> None:
    """Moves the chain (graph order) to just before its first consumer outside it (the
    graph's output aside: a param the graph returns stays where it was gathered)."""
    members = set(chain)
    order = {n: i for i, n in enumerate(chain[0].graph.nodes)}
    consumers = [u for n in chain for u in n.users if u not in members and u.op != "output"]
    if not consumers:
        return
    first = min(consumers, key=order.__getitem__)
    for node in chain:
        first.prepend(node)


def _reduce_chain(scatter: fx.Node, backward: set[fx.Node]) -> set[fx.Node]:
    """The reduce-scatter, the backward ops that feed only it (each node all of whose users
    are in the chain; an 8-bit wire's buffers, made of no input, too) and its wait with that
    wait's casts."""
    chain, todo = {scatter}, list(scatter.all_input_nodes)
    while todo:
        node = todo.pop()
        if node in chain or node.op != "call_function":
            continue
        if node not in backward and not _constant(node):
            continue
        if all(u in chain for u in node.users):  # looked at again as each user joins
            chain.add(node)
            todo.extend(node.all_input_nodes)
    if scatter.target is REDUCE_SCATTER_SECTIONS:  # returns when its sections have arrived
        _after_wait(scatter, chain)
    for user in scatter.users:
        if user.target is WAIT:
            chain.add(user)
            _after_wait(user, chain)
    return chain


def _after_wait(wait: fx.Node, chain: set[fx.Node]) -> None:
    """Adds to ``chain`` what turns the wait's result into the bucket's shard (a cast; a
    narrow wire's view, decode and sum over ranks): each op of one user that reads the chain
    alone (and constants)."""
    todo = [wait]
    while todo:
        for u in todo.pop().users:
            inputs = [a for a in u.all_input_nodes if a not in chain]
            if u.op != "call_function" or u in chain or any(a.all_input_nodes for a in inputs):
                continue
            if len(u.users) <= 1:
                chain.add(u)
                todo.append(u)


def _hoist(graph: fx.Graph, eager: set[fx.Node], backward: set[fx.Node]) -> None:
    """Reorders ``graph``: every node of ``eager`` (backward nodes) runs as soon as its inputs
    have run and the forward is over (a bucket whose gradients are all tangents, its params
    returned by a graph a break ends, is ready at the start), the others keep their order (an
    eager node made of no input, as soon as an eager user of it is otherwise ready)."""
    done: set[fx.Node] = set()
    order: list[fx.Node] = []
    skip = ("placeholder", "output")
    # the forward: what is neither backward nor eager nor made from an eager node (an eager
    # constant, an 8-bit wire's buffers, is made of no input; a detach of a reduced gradient
    # waits on its chain): its last node, the barrier, never waits on an eager one
    held = set(backward)
    for n in graph.nodes:  # topological order
        if n in eager or any(a in held and a not in backward for a in n.all_input_nodes):
            held.add(n)
    # (before the first backward node: the ops of no tangent that only the backward reads,
    # an embedding backward's mask of the tokens, sit late in it and held every reduce back)
    nodes = list(graph.nodes)
    first = next((i for i, n in enumerate(nodes) if n in backward and n.op not in skip), len(nodes))
    forward = [n for n in nodes[:first] if n not in held and n.op not in skip]
    barrier = forward[-1] if forward else None

    def ready(node: fx.Node) -> bool:
        if node in done or not all(a in done for a in node.all_input_nodes):
            return False
        return node not in eager or barrier is None or barrier in done

    deferred: set[fx.Node] = set()  # met before an input an eager node held: placed after it
    for node in graph.nodes:
        if node in done or node.op == "output":
            continue
        if not ready(node):  # an eager node is emitted once its inputs are
            if node not in eager:
                deferred.add(node)
            continue
        todo = [node]
        while todo:
            n = todo.pop()
            if not ready(n):
                if n in eager and n not in done:  # its constants (an 8-bit wire's buffers)
                    todo.extend(a for a in n.all_input_nodes if a in eager and a not in done)
                continue
            order.append(n)
            done.add(n)
            deferred.discard(n)
            todo.extend(u for u in reversed(n.users) if u in eager or u in deferred)
            if n is barrier:  # the eager nodes held back by the forward
                todo.extend(reversed([e for e in graph.nodes if e in eager and ready(e)]))
    left = [n.name for n in graph.nodes if n not in done and n.op != "output"]
    assert not left, f"every node but the output placed; not: {left[:8]}"
    for prev, node in zip(order, order[1:], strict=False):
        prev.append(node)


def _nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return optimization_hint(val.numel()) * val.element_size()


def _held_bytes(chain: list[fx.Node], members: set[fx.Node]) -> int:
    """The bytes a gather chain hands out: the buffers (each read through views) its params
    are, a param wire's decoded buffer rather than the packed bytes gathered (as eager's
    ``gathered_peak`` counts them)."""
    bases: dict[fx.Node, int] = {}
    for node in chain:
        if all(u in members for u in node.users):
            continue
        base = node
        while _is_view(base) and base.all_input_nodes and base.all_input_nodes[0] in members:
            base = base.all_input_nodes[0]
        bases[base] = _nbytes(base)
    return sum(bases.values()) or _nbytes(chain[0])


def _peak(intervals: list[tuple[int, int, int]]) -> int:
    """The most bytes alive at once over (first, last, bytes) intervals of positions."""
    events = sorted([(a, n) for a, _, n in intervals] + [(b + 1, -n) for _, b, n in intervals])
    live = peak = 0
    for _, n in sorted(events, key=lambda e: (e[0], e[1])):
        live += n
        peak = max(peak, live)
    return peak


def _account(
    chains: list[list[fx.Node]], backward: set[fx.Node], placed: Placed, recomputed: list[bool]
) -> None:
    """Records in ``placed``, for the frame being compiled, what the placed graph gathers
    again in backward, its gathered peak and what it holds (a chain not ``recomputed``: a
    gather the backward reads is held from forward to backward)."""
    pos = {n: i for i, n in enumerate(chains[0][0].graph.nodes)} if chains else {}
    intervals, held, regathered = [], 0, []
    for chain, recompute in zip(chains, recomputed, strict=True):
        members = set(chain)
        nbytes = _held_bytes(chain, members)
        users = [u for n in chain for u in n.users if u not in members]
        forward = [pos[u] for u in users if u not in backward]
        if forward:
            intervals.append((pos[chain[0]], max(forward), nbytes))
        later = [pos[u] for u in users if u in backward]
        if later and not recompute:
            intervals.append((pos[chain[0]], max(later), nbytes))
            held += nbytes
        elif later:
            intervals.append((min(later), max(later), nbytes))
            val = chain[0].meta["val"]
            # a size a dynamic compile made symbolic (automatic dynamic: the step's frame saw
            # another layout's sizes) is this layout's, its compiles being its own
            regathered.append((optimization_hint(val.numel()), val.dtype))
    placed.graphs[compile_key()] = _Graph(tuple(regathered), _peak(intervals), held)


def _chain_reduces(graph: fx.Graph) -> None:
    """Each reduce by sends (:data:`REDUCE_SCATTER_SECTIONS`) takes the one before it in ``graph``
    as its ``after``: the compiler keeps their order, the same on every rank (it may order
    two unchained ones by a rank's own shapes, and gloo matches a pair's sends in order)."""
    reduces = [n for n in graph.nodes if n.target is REDUCE_SCATTER_SECTIONS]
    for previous, node in zip(reduces, reduces[1:], strict=False):
        node.update_arg(1, previous)


def place_collectives(
    gm: fx.GraphModule,
    joint_inputs: object = None,
    placed: Placed | None = None,
    *,
    recompute: bool = True,
) -> fx.GraphModule:
    """The joint graph pass (module docstring): gathers recomputed in backward (unless
    ``recompute`` is False: then the partitioner saves them) and placed at their first use,
    reduce-scatters as soon as their gradients are ready; what it placed goes into
    ``placed``."""
    del joint_inputs
    graph = gm.graph
    backward = _backward_nodes(graph)
    chains, recomputed = [], []
    for gather in [n for n in graph.nodes if n.target in GATHERS and n not in backward]:
        if not _of_one_input(gather):  # an activation's (a DTensor op's), not a bucket's
            continue
        chain = _gather_chain(gather, backward)
        # a gathered param the graph returns (a graph break in loss_fn: the next graph reads
        # it) cannot be recomputed: the partitioner keeps it as an output, saved
        again = recompute and not any(u.op == "output" for n in chain for u in n.users)
        for node in chain if again else ():
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        _sink_before_first_use(chain)
        chains.append(chain)
        recomputed.append(again)
    if chains:
        _constants_before_use(graph)
    eager: set[fx.Node] = set()
    scatters = (REDUCE_SCATTER, ALL_TO_ALL, REDUCE_SCATTER_SECTIONS)
    for scatter in [n for n in graph.nodes if n.target in scatters and n in backward]:
        eager |= _reduce_chain(scatter, backward)
    if eager:
        _hoist(graph, eager, backward)
    _chain_reduces(graph)
    graph.lint()
    gm.recompile()
    if placed is not None:
        _account(chains, backward, placed, recomputed)
    return gm


def joint_pass(
    placed: Placed, *, recompute: bool = True
) -> Callable[[fx.GraphModule, object], fx.GraphModule]:
    """What ``joint_custom_pass`` is set to around a captured call: :func:`place_collectives`
    (recording into ``placed``), then a pass the user set there, if any."""
    user = torch._functorch.config.joint_custom_pass

    def run(gm: fx.GraphModule, inputs: object) -> fx.GraphModule:
        gm = place_collectives(gm, inputs, placed, recompute=recompute)
        return gm if user is None or getattr(user, "placed", None) else user(gm, inputs)

    run.placed = placed  # type: ignore[attr-defined]
    return run
