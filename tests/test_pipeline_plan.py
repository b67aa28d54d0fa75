"""``fs.plan(..., pipeline=P, schedule=, microbatches=, split=)``: each pipeline rank's bytes
per axis, kind and calls equal what a pipelined run of the pipeline tests' model measures
(GPipe, 1F1B and Interleaved1F1B over every strategy at P=2 x S=2, 1F1B at P=2 x R=2,
deterministic at P=2 x S=2 and HFSDP at P=2 x R=2; 2
steps of 4 microbatches, one pool call), its state's bytes equal the state's; every
schedule's "pipeline" bytes at P=2 and P=4 those the pipeline tests expect; the bubble and
in-flight microbatches, from torch's own order, against the closed forms; bad arguments
named."""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard.parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from funcshard.planner.pipeline import schedule_order, simulate

import helpers_pipeline as hp
import helpers_pipeline_plan as hpp

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
CASES = [(s, st, 1) for s in SCHEDULES for st in STRATEGIES] + [("1F1B", "optim_grads", 2)]
CASES += [  # deterministic (the norm's row sums all-gathered) and HFSDP (over "replicate")
    ("1F1B", "optim_grads_params", 1, {"deterministic": True}),
    ("Interleaved1F1B", "optim", 1, {"deterministic": True}),
    ("1F1B", "optim_grads_params", 2, {"outer_strategy": "optim"}),
]


def _plan(
    schedule: str,
    strategy: str,
    replicate: int,
    rank: int,
    pipeline: int = 2,
    micro: int = 4,
    init: dict | None = None,
) -> fs.Plan:
    with torch.device("meta"):
        net = hp.Net()
    return fs.plan(
        net,
        world_size=4,
        replicate=replicate,
        strategy=strategy,
        optimizer="sgd_momentum",
        microbatches=micro,
        device_type="cpu",
        pipeline=pipeline,
        schedule=schedule,
        split=hp.split_points(pipeline * hpp.per_rank(schedule)),
        pipeline_rank=rank,
        boundary=(hpp.ROWS, hp.WIDTH),
        **(init or {}),
    )


def _nonzero(d: dict, times: int = 1) -> dict:
    return {k: v * times for k, v in d.items() if v}


def test_bytes_and_state_equal_the_measured_run(pool4):
    results = pool4.run(hpp.measure_cases, CASES)
    for k, case in enumerate(CASES):
        for rank, got in enumerate(r[k] for r in results):
            schedule, strategy, replicate, *init = case
            p = _plan(schedule, strategy, replicate, got["pipeline_rank"], init=init and init[0])
            what = (case, rank)
            assert got["by_axis"] == _nonzero(p.comm_by_axis, hpp.STEPS), (what, got, p)
            assert got["bytes"] == _nonzero(p.comm, hpp.STEPS), (what, got, p.comm)
            assert got["calls"] == _nonzero(p.calls, hpp.STEPS), (what, got, p.calls)
            assert got["state"] == p.memory.state, (what, got["state"], p.memory)
            assert got["by_axis"]["pipeline"] > 0, what


def test_pipeline_bytes_of_every_schedule():
    for schedule in PIPELINE_SCHEDULES:
        for P in (2, 4):
            for rank in range(P):
                micro = 8 if schedule == "DualPipeV" else 4  # >= stages (torch's rule)
                p = _plan(schedule, "no_shard", 1, rank, P, micro)
                n = P * hpp.per_rank(schedule)
                want = hp.expected_bytes(p.pipeline.stages, n, P, schedule, hpp.ROWS)
                got = p.comm_by_axis["pipeline"] * hp.STEPS
                assert got == want > 0, (schedule, P, rank, got, want)


@pytest.mark.parametrize("P", [2, 4])
def test_bubble_and_in_flight_from_torchs_order(P):
    M = 8
    for schedule in ("GPipe", "1F1B"):
        t = simulate(schedule_order(schedule, P, M), P)
        assert t.bubble == pytest.approx((P - 1) / (M + P - 1)), schedule
        want = (M,) * P if schedule == "GPipe" else tuple(range(P, 0, -1))
        assert t.in_flight == want, (schedule, t.in_flight)
    t = simulate(schedule_order("Interleaved1F1B", P, M), 2 * P)  # v = 2 virtual stages
    assert t.bubble == pytest.approx((P - 1) / (2 * M + P - 1))
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        zb = simulate(schedule_order(schedule, P, M), 2 * P)
        assert 0 < zb.bubble < t.bubble, (schedule, zb)
    p = _plan("1F1B", "optim_grads_params", 1, 0)
    assert p.pipeline.stages == (0,) and p.pipeline.in_flight == (2, 1)
    assert p.pipeline.bubble == pytest.approx(1 / (hp.MICROBATCHES + 1))
    assert p.memory.activations == 2 * (hpp.ROWS // hp.MICROBATCHES) * hp.WIDTH * 4
    assert "bubble=0.200" in p.table()


def test_bad_pipeline_arguments():
    net = hp.make_net()
    kw = dict(world_size=4, pipeline=2, microbatches=4)
    for extra, words in [
        (dict(), "needs split="),
        (dict(split=["blocks.2", "blocks.4"]), "this schedule takes P stages"),
        (dict(split=["blocks.4"], schedule="Zigzag"), "unknown schedule 'Zigzag'"),
        (dict(split=["blocks.4"], pipeline_rank=2), r"pipeline_rank=2 is not in \[0, "),
        (dict(split=["blocks.4"], context=2), "context=2 is not supported"),
        (dict(split=["blocks.4"], world_size=8, replicate=2, outer_strategy="optim"), "x shard=2"),
        (dict(split=["blocks.4"], boundary=(6, 16)), "6 rows, not a multiple"),
        (dict(split=["blocks.4"], microbatches=1), "Schedule1F1B"),
    ]:
        with pytest.raises(ValueError, match=words):
            fs.plan(net, **{**kw, **extra})
    with pytest.raises(ValueError, match="world_size=3 is not a multiple of pipeline=2"):
        fs.plan(net, world_size=3, pipeline=2, split=["blocks.4"])


def test_regather_of_a_stage_the_meta_device_cannot_run():
    """fs.plan(..., regather=True): a stage that reads its input's values does not run on
    the meta device: its rank's plan says so (``exact`` False, the note naming the stage and
    its error, the table too) and counts every bucket it uses in forward and backward (at
    most what it gathers); the other rank's is exact; inputs= missing or of rows the
    microbatches do not divide, and regather without a pipeline, are refused, naming them, as
    is a stage with activation checkpointing (its recomputation reads a parameter outside the
    stage's forward: the step raises UnitParamsError on every step).
    (The exact figures against a run: test_pipeline_math.)"""
    with torch.device("meta"):
        net = hp.Net()
        net.blocks[5] = hpp.ValueCheck(hp.WIDTH)
    kw = dict(world_size=4, optimizer="sgd_momentum", microbatches=4, device_type="cpu")
    kw |= dict(pipeline=2, schedule="1F1B", split=hp.split_points(2), regather=True)
    x = torch.empty(hpp.ROWS, hp.D_IN, device="meta")
    p0, p1 = (fs.plan(net, **kw, pipeline_rank=r, inputs=x) for r in (0, 1))
    assert p0.pipeline.regather and p0.pipeline.exact and p0.pipeline.note == "", p0.pipeline
    assert not p1.pipeline.exact and "not exact" in p1.table(), p1.pipeline
    assert "a steady step's gathers" in p0.table(), p0.table()
    assert "stage 1 does not run on the meta device" in p1.pipeline.note, p1.pipeline.note
    assert p1.calls["all_gather"] == 4 * 2 * p1.buckets, p1.calls  # forward + backward, each
    assert p0.calls["all_gather"] == 4 * (2 * p0.buckets - 1), p0.calls  # embed's: no input grad
    with pytest.raises(ValueError, match=r"regather=True under ZeRO-3 needs inputs="):
        fs.plan(net, **kw)
    with pytest.raises(ValueError, match=r"inputs= of shape \(6, 5\).*microbatches=4"):
        fs.plan(net, **kw, inputs=torch.empty(6, hp.D_IN, device="meta"))
    with pytest.raises(ValueError, match=r"regather= without pipeline=P > 1"):
        fs.plan(net, world_size=2, regather=True, inputs=x)
    with torch.device("meta"):  # activation checkpointing: the step raises, so does the plan
        net.blocks[1] = hpp.Checkpointed(hp.WIDTH)
    with pytest.raises(ValueError, match=r"stage 0 cannot run.*'blocks\.1\.norm\.weight'"):
        fs.plan(net, **kw, pipeline_rank=0, inputs=x)
