"""A captured graph that raises on a rank posts the rest of its collectives by sends
(``funcshard.distributed.graph_ops.drain_failed_graph``): the ranks, each stopped at another
point of the graph, all come back, and their next gathers and reduces pair as before.

The ops are called here as a compiled graph calls them, in the orders two ranks' schedules
can take (each rank's inductor orders its graph by its own shapes; the compiled case is
``tests/test_compile_failures.py``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

N = 12  # elements a rank's shard; a bucket is world x N


def _manifest(group: dist.ProcessGroup, gathers: int, reduces: int) -> str:
    size, name = dist.get_world_size(group), group.group_name
    return json.dumps(
        {
            "gathers": [[N, "float32", size, name]] * gathers,
            "reduces": [[size * N, "float32", size, name]] * reduces,
        }
    )


def drain_worker(plan: dict[int, list[str]], fails: list[int]) -> dict:
    """Runs ``plan[rank]`` (steps of one graph: "g" a gather started and waited for, "r" a
    reduce started and waited for, "G" / "R" started and left in flight); a rank in ``fails``
    then raises and drains, the others run the graph to its end. Then a fresh gather and
    reduce of known values on every rank."""
    from funcshard.distributed import graph_ops as ops

    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    ops.graph_collectives(_manifest(group, gathers=3, reduces=2))
    todo = plan[rank] if rank in fails else ["g", "g", "g", "r", "r"]
    out = {}
    for i, step in enumerate(todo):
        x = torch.full((size * N,) if step in "rR" else (N,), float(rank + i))
        if step in "gG":
            ticket = ops.all_gather_sections_start(x, None, size, group.group_name)
            if step == "g":
                out[f"gather{i}"] = ops.all_gather_sections_wait(ticket, x, size)
        else:
            ticket = ops.reduce_scatter_sections_start(x, None, size, group.group_name)
            if step == "r":
                out[f"reduce{i}"] = ops.reduce_scatter_sections_wait(ticket, x, size)
    if rank in fails:
        ops.drain_failed_graph()
    shard = torch.arange(N, dtype=torch.float32) + 100 * rank
    gathered = ops.all_gather_sections(shard, size, group.group_name, None)
    bucket = torch.arange(size * N, dtype=torch.float32) * (rank + 1)
    reduced = ops.reduce_scatter_sections(bucket, None, size, group.group_name)
    want = torch.arange(size * N, dtype=torch.float32).view(size, N)[rank] * sum(range(1, size + 1))
    return {
        "in_step": torch.equal(
            gathered, torch.cat([torch.arange(N) + 100.0 * r for r in range(size)])
        )
        and torch.equal(reduced, want),
        "nan": sorted(k for k, v in out.items() if v.isnan().any()),
        "left": (len(ops._IN_FLIGHT), len(ops._REDUCING)),
    }


@pytest.mark.parametrize(
    "plan",
    [
        # rank 0 ahead in the reduces (one in flight), rank 1 in the gathers: neither may
        # wait for what it holds before posting the rest
        {0: ["g", "R"], 1: ["g", "g", "G"]},
        {0: [], 1: ["g", "g", "g", "r", "R"]},  # one rank before the graph's first start
        {0: ["G"], 1: ["g", "g", "g", "r"]},
    ],
)
def test_ranks_failing_at_different_points_of_a_graph_all_come_back(pool2, plan) -> None:
    for r in pool2.run(drain_worker, plan, [0, 1]):
        assert r["in_step"] and r["left"] == (0, 0), r


def test_a_peer_that_did_not_fail_finishes_the_graph_with_nan(pool2) -> None:
    """Rank 0 fails after its first gather; rank 1 runs the graph whole: what it gathers from
    rank 0 and reduces with it after that is NaN (its step non-finite, so it changes nothing),
    and the two ranks are in step after."""
    fail, done = pool2.run(drain_worker, {0: ["g"], 1: []}, [0])
    assert fail["in_step"] and done["in_step"], (fail, done)
    assert done["nan"] == ["gather1", "gather2", "reduce3", "reduce4"], done
