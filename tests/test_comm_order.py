"""funcshard.step.units.comm_order on scheduler nodes made by hand (inductor's, in small)."""

from __future__ import annotations

from types import SimpleNamespace

from torch._inductor.dependencies import StarDep, WeakDep

from funcshard.distributed import graph_ops
from funcshard.step.units import comm_order


class _Node:
    """What comm_order reads of an inductor scheduler node: one op (``op``, its target; None:
    a kernel of the compute or a functional collective) making the buffer of its name, and
    its dependencies (``fake``: inductor's WeakDep(is_fake=True) on the buffer)."""

    def __init__(self, name: str, deps: tuple = (), op=None, fake: tuple = ()) -> None:
        self.name, self.node = name, SimpleNamespace(op_overload=op)
        self.read_writes = SimpleNamespace(reads=[SimpleNamespace(name=d.name) for d in deps])
        self.unmet_dependencies = {StarDep(d.name) for d in deps} | {
            WeakDep(d.name, mutating_buf=name, is_fake=True) for d in fake
        }
        self.ancestors = set().union(*({d.name} | d.ancestors for d in (*deps, *fake)))

    def get_buffer_names(self) -> set[str]:
        return {self.name}

    def get_operation_names(self) -> set[str]:
        return {self.name}

    def get_name(self) -> str:
        return self.name


def test_gathers_placed_where_inductor_sinks_a_collectives_wait():
    """Inductor orders each functional collective after the one before it by a fake
    dependency (WeakDep is_fake) that its own passes do not keep: they sink the first
    all-to-all's wait past the second (a narrow gradient wire's, one per bucket). That order
    is valid, and the pass places the backward's gathers in it: each wait just before its
    first reader, the next start just after. Fails without the fix: the fake dependency
    counted, inductor's own order read as invalid and kept whole, every re-gather waited at
    the graph's head (ZeRO-3, bf16 param and grad wires, 3 ranks: no matmul ran while a
    backward gather was in flight, one did with the fix). A real dependency broken still
    keeps inductor's order."""
    start1 = _Node("start1", op=graph_ops.ALL_GATHER_SECTIONS_START)
    wait1 = _Node("wait1", (start1,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    start2 = _Node("start2", (wait1,), graph_ops.ALL_GATHER_SECTIONS_START)
    wait2 = _Node("wait2", (start2,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    grads = _Node("grads")
    a2a1 = _Node("a2a1", (grads,))
    a2a1_wait = _Node("a2a1_wait", (a2a1,))
    a2a2 = _Node("a2a2", (grads,), fake=(a2a1_wait,))
    read1 = _Node("read1", (wait1, a2a1_wait))
    read2 = _Node("read2", (wait2, read1))
    order = [start1, wait1, start2, wait2, grads, a2a1, a2a2, a2a1_wait, read1, read2]
    placed = comm_order.place_comms(order)
    names = [n.name for n in placed]
    assert names == [
        *("start1", "grads", "a2a1", "a2a2", "a2a1_wait"),
        *("wait1", "start2", "read1", "wait2", "read2"),
    ], names
    # a start waits for the node that makes its shard (a packed gather's encode)
    shard2 = _Node("shard2")
    start2 = _Node("start2", (wait1, shard2), graph_ops.ALL_GATHER_SECTIONS_START)
    wait2 = _Node("wait2", (start2,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    read2 = _Node("read2", (wait2, read1))
    order = [start1, wait1, grads, a2a1, a2a1_wait, read1, shard2, start2, wait2, read2]
    names = [n.name for n in comm_order.place_comms(order)]
    assert names == [
        *("start1", "grads", "a2a1", "a2a1_wait", "wait1"),
        *("read1", "shard2", "start2", "wait2", "read2"),
    ], names


def test_a_gather_starts_after_the_reduce_the_graph_puts_before_it():
    """Unit a's reduce comes before unit c's gather in the graph (``order_kinds``: the
    gather's start takes the reduce's as an input). Where a unit's last gradient needs the
    next unit's compute (a weight unit b reads too), the gather's start waits for the
    reduce's instead of going one bucket ahead, and the reduce's start still follows the
    gather's before it: one order of starts, the graph's, whatever the scheduler chose.
    Where the scheduler only deferred that gradient, it runs as soon as its inputs are, the
    reduce with it, and the gather goes one bucket ahead."""
    g1 = _Node("g1", op=graph_ops.ALL_GATHER_SECTIONS_START)
    w1 = _Node("w1", (g1,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    g2 = _Node("g2", (w1,), graph_ops.ALL_GATHER_SECTIONS_START)
    w2 = _Node("w2", (g2,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    comp_a = _Node("comp_a", (w1,))
    comp_b = _Node("comp_b", (w2, comp_a))
    for late_a, placed in (
        (  # unit a's last weight gradient, after unit b's compute
            _Node("late_a", (comp_a, comp_b)),
            ("g1", "w1", "g2", "comp_a", "w2", "comp_b", "late_a", "ra", "g3", "w3"),
        ),
        (  # ... deferred there by the scheduler alone
            _Node("late_a", (comp_a,)),
            ("g1", "w1", "g2", "comp_a", "late_a", "ra", "w2", "g3", "comp_b", "w3"),
        ),
    ):
        ra = _Node("ra", (late_a, g2), graph_ops.REDUCE_SCATTER_SECTIONS_START)
        ra_wait = _Node("ra_wait", (ra,), graph_ops.REDUCE_SCATTER_SECTIONS_WAIT)
        g3 = _Node("g3", (w2, ra), graph_ops.ALL_GATHER_SECTIONS_START)
        w3 = _Node("w3", (g3,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
        comp_c = _Node("comp_c", (w3, comp_b))
        order = [g1, w1, comp_a, g2, w2, comp_b, late_a, ra, g3, w3, comp_c, ra_wait]
        names = [n.name for n in comm_order.place_comms(order)]
        assert names == [*placed, "comp_c", "ra_wait"], names
        starts = [n for n in names if n in ("g1", "g2", "ra", "g3")]
        assert starts == ["g1", "g2", "ra", "g3"]


def test_the_graphs_record_of_its_collectives_runs_first():
    """``funcshard::graph_collectives`` (a graph's record of its gathers and reduces by sends,
    which a rank the graph raises on drains) goes first, so that no op of the graph can raise
    before it: where the pass's placement stands and where inductor's order is kept."""
    mark = _Node("mark", op=graph_ops.GRAPH_COLLECTIVES)
    grads = _Node("grads")
    tap = _Node("tap", (grads,))
    start = _Node("start", (grads, mark), graph_ops.REDUCE_SCATTER_SECTIONS_START)
    wait = _Node("wait", (start,), graph_ops.REDUCE_SCATTER_SECTIONS_WAIT)
    placed = comm_order.place_comms([grads, tap, mark, start, wait])
    assert [n.name for n in placed] == ["mark", "grads", "start", "tap", "wait"], placed
    # a start before the node that makes its shard: inductor's order kept, the record first
    shard = _Node("shard")
    start1 = _Node("start1", (mark,), graph_ops.ALL_GATHER_SECTIONS_START)
    wait1 = _Node("wait1", (start1,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    start2 = _Node("start2", (wait1, shard), graph_ops.ALL_GATHER_SECTIONS_START)
    wait2 = _Node("wait2", (start2,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    read = _Node("read", (wait1,))
    order = [start1, wait1, read, shard, start2, wait2, mark]
    assert comm_order.place_comms(order) == [mark, *order[:-1]]


def test_each_buckets_gradients_run_before_the_next_blocks():
    """inductor's peak-memory order runs every block's input gradient first and defers each
    weight gradient to the tail, beside its reduce: every block's output gradient held to the
    end of the backward (captured ZeRO-2, 16 blocks: 1.18x eager's peak). The pass moves each
    bucket's gradients to just after their inputs, never before the previous reduce's start
    nor before the graph's record, then the reduce: with overlap (a start, the previous wait
    just before it) and without (each whole reduce, chained). Fails without the hoist: every
    weight gradient stays after the last input gradient."""
    mark = _Node("mark", op=graph_ops.GRAPH_COLLECTIVES)
    out2 = _Node("out2")  # block 2's output gradient (the loss's)
    in2, w2 = _Node("in2", (out2,)), _Node("w2", (out2,))  # its input's and weight's
    in1, w1 = _Node("in1", (in2,)), _Node("w1", (in2,))  # block 1's
    r2 = _Node("r2", (w2, mark), graph_ops.REDUCE_SCATTER_SECTIONS_START)
    r2_wait = _Node("r2_wait", (r2,), graph_ops.REDUCE_SCATTER_SECTIONS_WAIT)
    r1 = _Node("r1", (w1, r2_wait), graph_ops.REDUCE_SCATTER_SECTIONS_START)
    r1_wait = _Node("r1_wait", (r1,), graph_ops.REDUCE_SCATTER_SECTIONS_WAIT)
    order = [out2, in2, in1, mark, w2, w1, r2, r1, r2_wait, r1_wait]
    names = [n.name for n in comm_order.place_comms(order)]
    assert names == [
        *("mark", "out2", "w2", "r2", "in2", "w1"),
        *("r2_wait", "r1", "in1", "r1_wait"),
    ], names
    # overlap=False: whole reduces, each after the collective before it
    r2 = _Node("r2", (w2, mark), graph_ops.REDUCE_SCATTER_SECTIONS)
    r1 = _Node("r1", (w1, r2), graph_ops.REDUCE_SCATTER_SECTIONS)
    order = [out2, in2, in1, mark, w2, w1, r2, r1]
    names = [n.name for n in comm_order.place_in_order(order)]
    assert names == ["mark", "out2", "w2", "r2", "in2", "w1", "r1", "in1"], names
