"""``fs.plan(..., pipeline=P, schedule=, microbatches=, split=)``: each pipeline rank's bytes
per axis, kind and calls equal what a pipelined run of the pipeline tests' model measures
(GPipe, 1F1B and Interleaved1F1B over every strategy at P=2 x S=2, 1F1B at P=2 x R=2,
deterministic at P=2 x S=2 and HFSDP at P=2 x R=2; 2
steps of 4 microbatches, one pool call), its state's bytes equal the state's; every
schedule's "pipeline" bytes at P=2 and P=4 those the pipeline tests expect; the bubble and
in-flight microbatches, from torch's own order, against the closed forms, of equal stages
and of stages weighted by their FLOPs (``inputs=``); bad arguments named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard.parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from funcshard.planner.pipeline import schedule_order, simulate

import helpers_pipeline as hp
import helpers_pipeline_math as hm
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


def _flops_plan(net: nn.Module, schedule: str, split: list[str], inputs: torch.Tensor):
    """Pipeline rank 0's plan at P=2 with the bubble weighted by each stage's FLOPs."""
    kw = dict(world_size=4, strategy="no_shard", optimizer="sgd", device_type="cpu")
    return fs.plan(
        net,
        **kw,
        microbatches=hp.MICROBATCHES,
        pipeline=2,
        schedule=schedule,
        split=split,
        inputs=inputs,
    )


def _flat(costs: tuple) -> list[float]:
    return [c for stage in costs for c in stage]


def test_bubble_weighted_by_each_stages_flops():
    """With inputs= the bubble weighs each stage by its FLOPs (counted on the meta device; a
    Linear's 2 x in x out a row, norms and tanh none). A wide head makes stage 1 the heavier
    in forward and backward: then GPipe and 1F1B both run stage 1's M forwards and backwards
    back to back after stage 0's first forward and before its last backward, a makespan of
    ``c0 + M c1`` (``c``: a stage's forward + backward), each rank busy ``M c``. Stage 0
    computes no input gradient (the batch needs none): its backward lacks the embed's."""
    W, M = hp.WIDTH, hp.MICROBATCHES
    with torch.device("meta"):
        net = hp.Net()
        net.head = nn.Linear(W, 16 * W)  # 8192 FLOPs a row: 16 blocks' worth
    x = torch.empty(hpp.ROWS, hp.D_IN, device="meta")
    block = 2 * W * W
    f0 = 2 * hp.D_IN * W + 4 * block
    f1, b0 = 4 * block + 2 * W * 16 * W, f0 + 4 * block
    c0, c1, T, mean = 2 * f0 + 4 * block, 3 * f1, f0 + b0 + M * 3 * f1, (f0 + f1) / 2
    for schedule in ("GPipe", "1F1B"):
        pp = _flops_plan(net, schedule, hp.split_points(2), x).pipeline
        assert pp.bubble_model == "flops" and pp.bubble_note == "", pp
        want = ((f0 / mean, b0 / mean, 0, 0), (f1 / mean, 2 * f1 / mean, 0, 0))
        assert _flat(pp.stage_costs) == pytest.approx(_flat(want)), pp.stage_costs
        bubble = 1 - M * (c0 + c1) / (2 * T)
        assert pp.bubble == pytest.approx(bubble), schedule
        assert pp.bubble_by_rank == pytest.approx((1 - M * c0 / T, 1 - M * c1 / T))
        assert pp.bubble > 1.5 / (M + 1), pp.bubble  # equal stages': 1 / (M + 1)
    assert (
        f"bubble={bubble:.3f} (stages by FLOPs)"
        in _flops_plan(net, "1F1B", ["blocks.4"], x).table()
    )


def test_equal_stages_by_flops_give_the_equal_bubble():
    """Stages of equal FLOPs (an embedding first, so stage 0's first product computes its
    input gradient too; no head) give the equal model's bubble; under a zero-bubble schedule
    a stage's input and weight backward cost a forward each, but the first stage's, which
    as torch runs it computes nothing in its input backward and all in its weight one."""
    with torch.device("meta"):
        net = hm.EmbedNet()  # embed + 4 blocks + head
        net.head = nn.Identity()
    tokens = torch.empty(hpp.ROWS, dtype=torch.long, device="meta")
    M = hp.MICROBATCHES
    for schedule, split, want in [
        ("GPipe", ["blocks.2"], 1 / (M + 1)),
        ("1F1B", ["blocks.2"], 1 / (M + 1)),
        ("Interleaved1F1B", ["blocks.1", "blocks.2", "blocks.3"], 1 / (2 * M + 1)),
    ]:
        pp = _flops_plan(net, schedule, split, tokens).pipeline
        assert pp.bubble_model == "flops", pp
        assert _flat(pp.stage_costs) == pytest.approx([1, 2, 0, 0] * (len(split) + 1)), pp
        assert pp.bubble == pytest.approx(want), (schedule, pp.bubble)
    pp = _flops_plan(net, "ZBVZeroBubble", ["blocks.1", "blocks.2", "blocks.3"], tokens).pipeline
    assert _flat(pp.stage_costs) == pytest.approx([1, 2, 0, 2] + [1, 2, 1, 1] * 3), pp


def test_a_stage_of_no_flops_keeps_equal_stages():
    """A first stage of the embedding alone counts no FLOP (a gather): weighted by FLOPs its
    rank would idle through the step (a bubble of 1 on that rank, 0.5 over both); the plan
    keeps equal stages instead and says which stage."""
    with torch.device("meta"):
        net = hm.EmbedNet()
    tokens = torch.empty(hpp.ROWS, dtype=torch.long, device="meta")
    p = _flops_plan(net, "1F1B", ["blocks.0"], tokens)
    pp = p.pipeline
    assert pp.bubble_model == "equal" and pp.stage_costs == (), pp
    assert "stage 0's forward counts no FLOP" in pp.bubble_note, pp.bubble_note
    assert pp.bubble == pytest.approx(1 / (hp.MICROBATCHES + 1)), pp.bubble
    assert max(pp.bubble_by_rank) < 1, pp.bubble_by_rank
    assert "bubble of equal stages: stage 0's forward counts no FLOP" in p.table(), p.table()


def test_inputs_the_first_stage_cannot_take_are_named():
    """inputs= of the wrong width fail in the first stage on the meta device: the plan keeps
    equal stages and its note shows the microbatch it was given, not the model alone."""
    with torch.device("meta"):
        net = hp.Net()
    wrong = torch.empty(hpp.ROWS, hp.D_IN + 1, device="meta")
    pp = _flops_plan(net, "1F1B", hp.split_points(2), wrong).pipeline
    assert pp.bubble_model == "equal", pp
    note = pp.bubble_note
    assert note.startswith("stage 0 does not run on the meta device"), note
    shape = (hpp.ROWS // hp.MICROBATCHES, hp.D_IN + 1)
    assert f"inputs=: {shape} torch.float32; is it train_step's batch[0]?" in note, note


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
    for p in (p0, p1):  # the bubble involves every stage: equal ones stand in on both ranks
        assert p.pipeline.bubble_model == "equal", p.pipeline
        assert "stage 1 does not run on the meta device" in p.pipeline.bubble_note, p.pipeline
    assert "bubble of equal stages: stage 1" in p0.table(), p0.table()
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
