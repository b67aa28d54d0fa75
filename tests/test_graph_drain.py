"""A captured graph that raises on a rank posts the rest of its collectives by sends
(``funcshard.distributed.graph_ops.drain_failed_graph``): the ranks, each stopped at another
point of the graph, all come back, and their next gathers and reduces pair as before.

The ops are called here as a compiled graph calls them, in the orders two ranks' schedules
can take (each rank's inductor orders its graph by its own shapes; the compiled case is
``tests/test_compile_failures.py``)."""

from __future__ import annotations

import faulthandler
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
            ticket = ops.reduce_sections_start(x, None, size, group.group_name)
            if step == "r":
                out[f"reduce{i}"] = ops.reduce_sections_wait(ticket, x, size)
    if rank in fails:
        ops.drain_failed_graph()
    shard = torch.arange(N, dtype=torch.float32) + 100 * rank
    gathered = ops.all_gather_sections(shard, size, group.group_name)
    bucket = torch.arange(size * N, dtype=torch.float32) * (rank + 1)
    reduced = ops.reduce_sections(bucket, None, size, group.group_name)
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


def all_to_all_worker(plan: list[str]) -> dict:
    """A graph of a gather by sends and two functional all-to-alls ("a", a narrow gradient
    wire's): rank 0 runs ``plan`` ("G": the gather started, left in flight) then raises and
    drains; rank 1 runs the graph whole ("a", "g", "a"). Then an all-to-all of known values."""
    from torch.distributed import _functional_collectives as funcol

    from funcshard.distributed import graph_ops as ops

    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the test, not CI
    group, rank = dist.group.WORLD, dist.get_rank()
    size, name = dist.get_world_size(group), group.group_name
    splits = [N] * size
    manifest = json.loads(_manifest(group, gathers=1, reduces=0))
    manifest["all_to_alls"] = [[size * N, "float32", size, name, splits, splits]] * 2
    ops.graph_collectives(json.dumps(manifest))
    todo = ["a", "g", "a"] if rank else plan
    out = []
    for step in todo:
        if step in "gG":
            x = torch.full((N,), float(rank))
            ticket = ops.all_gather_sections_start(x, None, size, name)
            if step == "g":
                ops.all_gather_sections_wait(ticket, x, size)
        else:
            x = torch.full((size * N,), float(rank))
            out.append(funcol.wait_tensor(funcol.all_to_all_single(x, splits, splits, name)))
    if rank == 0:
        ops.drain_failed_graph()
    x = torch.arange(size * N, dtype=torch.float32) + 100 * rank
    got = funcol.wait_tensor(funcol.all_to_all_single(x, splits, splits, name))
    want = torch.cat([torch.arange(N) + rank * N + 100.0 * r for r in range(size)])
    faulthandler.cancel_dump_traceback_later()
    return {"in_step": torch.equal(got, want), "nan": [bool(t.isnan().any()) for t in out]}


@pytest.mark.parametrize("plan", [[], ["G"], ["a", "G"]])
def test_a_graphs_functional_all_to_alls_are_drained_by_count(pool2, plan) -> None:
    """The all-to-alls rank 0 had not issued (the group's sequence number's growth, less the
    gather's messages) are posted: rank 1 gets NaN from them, and the two ranks' next
    all-to-all pairs. Hung without them in the record (rank 1 waits for the second)."""
    fail, done = pool2.run(all_to_all_worker, plan)
    assert fail["in_step"] and done["in_step"], (fail, done)
    assert done["nan"] == ["a" not in plan, True], done
