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
    # the second gather's start moved before the node that makes its shard: not valid
    shard2 = _Node("shard2")
    start2 = _Node("start2", (wait1, shard2), graph_ops.ALL_GATHER_SECTIONS_START)
    wait2 = _Node("wait2", (start2,), graph_ops.ALL_GATHER_SECTIONS_WAIT)
    read2 = _Node("read2", (wait2, read1))
    order = [start1, wait1, grads, a2a1, a2a1_wait, read1, shard2, start2, wait2, read2]
    assert comm_order.place_comms(order) == order


def test_the_graphs_record_of_its_collectives_runs_first():
    """``funcshard::graph_collectives`` (a graph's record of its gathers and reduces by sends,
    which a rank the graph raises on drains) goes first, so that no op of the graph can raise
    before it: where the pass's placement stands and where inductor's order is kept."""
    mark = _Node("mark", op=graph_ops.GRAPH_COLLECTIVES)
    grads = _Node("grads")
    tap = _Node("tap", (grads,))
    start = _Node("start", (grads, mark), graph_ops.REDUCE_SECTIONS_START)
    wait = _Node("wait", (start,), graph_ops.REDUCE_SECTIONS_WAIT)
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
