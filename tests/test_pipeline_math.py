"""Pipeline parallel's precision and math: a bf16 or fp16 compute policy, fp16 loss scaling
skipping a step on every rank when one stage's gradient is not finite, the whole model's
``nonfinite_params`` (P=2 x S=2, 1F1B, 4 microbatches, SGD momentum; helpers_pipeline_math).

The rounding bound. A compute dtype of ``b`` significant bits rounds to nearest with a
relative error of at most ``u = 2^-b`` (bf16: 2^-8, fp16: 2^-11); the masters, the summed
and reduced gradients and the update stay fp32 (exact against the fp32 run but for the
order of sums, ~2^-24). Counting the roundings on the model's longest path (first order:
each one's relative error carried unamplified through layers whose Lipschitz constants are
about 1, the residual blocks behind a LayerNorm and a tanh):

* forward: the input cast, embed's weight and output (3); per block its LayerNorm's weight
  and output, fc's weight and output, the tanh and the residual sum (6 x 8 = 48); the head's
  weight and output (2): FORWARD = 53;
* backward to the first weight: the output's gradient, the head's input gradient (2); per
  block the residual sum, tanh's, fc's and LayerNorm's input gradients (4 x 8 = 32); embed's
  weight gradient (1): BACKWARD = 35.

So the loss (an MSE: the square doubles its output's relative error) is within
``2 x FORWARD x u`` of the fp32 run's; every gradient, their norm and the update (a sum of
gradients with positive weights over 3 steps: SGD momentum) within ``(FORWARD + BACKWARD)
x u``: 0.414 and 0.344 in bf16, 0.052 and 0.043 in fp16 (measured: loss 2.1e-3 and
update 1.8e-2 in bf16, 3.6e-4 and 1.9e-3 in fp16).
Each run is also checked to round at all (not bitwise the fp32 run's) and to send its
boundary tensors in the compute dtype (bytes under "pipeline" = rows x width x 2 a step).

The last test (helpers_pipeline_more) composes the optimizers (clipped AdamW, Muon, narrow
and 8-bit moments), offload and the low-precision wires with the pipeline.
"""

from __future__ import annotations

import torch

import funcshard as fs

import helpers_pipeline as hp
import helpers_pipeline_math as hm
import helpers_pipeline_more as hpm

FORWARD, BACKWARD = 53, 35
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

POLICY_CASES = [("run_policy", s, torch.bfloat16) for s in hm.STRATEGIES] + [
    ("run_policy", s, torch.float16) for s in ("optim", "optim_grads_params")
]
INF_CASES = [("run_one_stage_inf", "optim_grads_params"), ("run_first_step_failure",)]


def _rel(got: list[float], want: list[float]) -> float:
    return hp._rel(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64))


def _check_policy(case: tuple, per_rank: list[dict], ref: dict, p0: dict) -> None:
    _, strategy, dtype = case
    u = UNIT[dtype]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, (case, rank, r)
        assert r["metrics"] == per_rank[0]["metrics"], (case, rank)  # bitwise on every rank
        assert all(m[2] == 0 for m in r["metrics"]), (case, rank, r["metrics"])  # no skips
        assert list(r["full"]) == list(ref["params"]), (case, rank)
        update = max(hp._rel(r["full"][n] - p0[n], ref["params"][n] - p0[n]) for n in p0)
        loss = _rel([m[0] for m in r["metrics"]], ref["loss"])
        norm = _rel([m[1] for m in r["metrics"]], ref["grad_norm"])
        assert loss < 2 * FORWARD * u, (case, rank, loss)
        assert max(update, norm) < (FORWARD + BACKWARD) * u, (case, rank, update, norm)
        assert update > 0, (case, rank)  # the compute dtype rounded: not the fp32 run
        # each rank sends one boundary a step (stage 0 its output, stage 1 its input's
        # gradient): rows x width in the compute dtype
        assert r["pipeline_bytes"] == hp.STEPS * hm.ROWS * hp.WIDTH * 2, (case, rank, r)
        if dtype == torch.float16:
            assert r["metrics"][-1][3] == 2.0**10, (case, rank)  # the scale, never backed off


def _check_one_stage_inf(case: tuple, per_rank: list[dict]) -> None:
    """Step 1's infinite gradient in stage 1 only skips the step on every rank: params
    unchanged everywhere, the loss scale halved on every rank, the parameter named on every
    rank (stage 0's ranks included); step 2 trains."""
    for rank, r in enumerate(per_rank):
        assert "error" not in r, (case, rank, r)
        m0, m1, m2 = r["metrics"]
        assert (m0["nonfinite"], m1["nonfinite"], m2["nonfinite"]) == (0, 1, 0), (case, rank)
        assert m1["nonfinite_params"] == ["blocks.5.fc.weight"], (case, rank, m1)
        scales = (m0["loss_scale"], m1["loss_scale"], m2["loss_scale"])
        assert scales == (2.0**12, 2.0**11, 2.0**11), (case, rank, scales)
        assert r["steps"] == [1, 1, 2], (case, rank, r["steps"])
        before, skipped, after = r["full"]
        assert all(torch.equal(before[n], skipped[n]) for n in before), (case, rank)
        assert all(torch.isfinite(t).all() for t in after.values()), (case, rank)
        assert sum(not torch.equal(before[n], after[n]) for n in before) == len(before), rank
        same = zip(r["full"], per_rank[0]["full"], strict=True)
        assert all(torch.equal(a[n], b[n]) for a, b in same for n in a), (case, rank)
    assert {r["stages"] for r in per_rank} == {(0,), (1,)}


def test_compute_policies_and_loss_scaling(pool4):
    """bf16 compute at P=2 x S=2 for every strategy, fp16 (loss scale 2^10) for ZeRO-1 and
    ZeRO-3, within the rounding bound of one fp32 process; fp16 with an infinite gradient in
    one stage (ZeRO-3); a stage raising in its forward on the first step (fp32)."""
    results = pool4.run(hm.run_cases, POLICY_CASES + INF_CASES)
    ref = hp.reference(hm.ROWS, 2)
    p0 = {n: p.detach() for n, p in hp.make_net().named_parameters()}
    for k, case in enumerate(POLICY_CASES + INF_CASES):
        per_rank = [r[k] for r in results]
        if case[0] == "run_policy":
            _check_policy(case, per_rank, ref, p0)
        elif case[0] == "run_one_stage_inf":
            _check_one_stage_inf(case, per_rank)
        else:  # torch sized stage 0's gradient buffers by the stand-in's contiguous gradient
            for rank, r in enumerate(per_rank):
                assert "error" not in r, (rank, r)
                assert "boom: a stage's forward failed" in r["error_text"], (rank, r)
                assert "stage 1" in r["error_text"] and r["step"] == 1, (rank, r)


LAYOUT_CASES = [
    ("run_layout", "S2", "optim_grads_params", {"deterministic": True}),
    ("run_layout", "R2", "optim_grads_params", {"deterministic": True}),
    ("run_layout", "R2", "optim_grads_params", {"outer_strategy": "optim"}),
    ("run_layout", "R2", "optim", {"outer_strategy": "optim"}),
]
REGATHER_CASES = [
    ("run_regather", "1F1B", 1, True),
    ("run_regather", "1F1B", 1, False),
    ("run_regather", "ZBVZeroBubble", 2, True),
]
EMBED_CASES = [  # an embedding first (its weight not saved), fs.plan's figures only
    ("run_regather", "1F1B", 1, True, True),
    ("run_regather", "ZBVZeroBubble", 2, True, True),
]


def _parity(case: tuple, r: dict, ref: dict) -> None:
    assert "error" not in r, (case, r)
    param = max(hp._rel(r["full"][n], ref["params"][n]) for n in ref["params"])
    loss = _rel([m[0] for m in r["metrics"]], ref["loss"])
    assert list(r["full"]) == list(ref["params"]) and max(param, loss) < 1e-5, (case, r)


def _check_regather(rank: int, runs: list[dict]) -> None:
    """ZeRO-3 with regather=True: bitwise the once-a-step run's (1F1B); over steps 1 and 2 a
    stage gathers each of its buckets per microbatch in forward, and again in backward each
    bucket holding a tensor its backward reads: all of them but stage 0's embed (its input
    needs no gradient, so its weight is not saved), against once a step without regather."""
    again, once, zbv = runs
    assert again["metrics"] == once["metrics"], rank
    assert all(torch.equal(again["full"][n], once["full"][n]) for n in once["full"]), rank
    steps, buckets = hp.STEPS - 1, once["buckets"]
    assert once["gathers"] == steps * buckets, (rank, once)
    backward = buckets - (1 if again["stages"] == (0,) else 0)
    assert again["gathers"] == steps * hp.MICROBATCHES * (buckets + backward), (rank, again)
    assert zbv["gathers"] > steps * hp.MICROBATCHES * zbv["buckets"], (rank, zbv)


def _check_regather_plan(case: tuple, rank: int, r: dict) -> None:
    """A steady step's bytes per axis and kind, calls and gathered peak (steps 1 and 2, or
    1) equal to ``fs.plan(..., regather=)``'s, found by running the stages on the meta device."""
    p = hm.regather_plan(*case[1:4], len(case) > 4, r["pipeline_rank"])
    steps, what = r["steady_steps"], (case, rank)
    nonzero = lambda d: {k: v * steps for k, v in d.items() if v}  # noqa: E731
    assert p.pipeline.exact and p.pipeline.regather == case[3], (what, p.pipeline)
    assert r["by_axis"] == nonzero(p.comm_by_axis), (what, r["by_axis"], p.comm_by_axis)
    assert r["bytes"] == nonzero(p.comm), (what, r["bytes"], p.comm)
    assert r["calls"] == nonzero(p.calls), (what, r["calls"], p.calls)
    assert r["peak"] == p.memory.gathered_peak > 0, (what, r["peak"], p.memory)


def test_deterministic_hfsdp_and_regather(pool4):
    """deterministic=True at P=2 x S=2 and P=2 x R=2 (ZeRO-3): bitwise alike (params, loss,
    grad norm) and within 1e-5 of one process; HFSDP (outer_strategy="optim", P=2 x R=2)
    over ZeRO-3 and ZeRO-1 within 1e-5 (the whole model's gradient clipped to norm 1, so the
    update reads the norm's bits too); ZeRO-3 with fs.Pipeline(regather=True) under 1F1B and
    ZBVZeroBubble within 1e-5, gathering per microbatch; with and without regather, and with
    an embedding first, a steady step's bytes, calls and gathered peak equal fs.plan's."""
    results = pool4.run(hm.run_cases, LAYOUT_CASES + REGATHER_CASES + EMBED_CASES)
    clipped, plain = hm.reference_clipped(), hp.reference(hm.ROWS, 2)
    for k, case in enumerate(LAYOUT_CASES + REGATHER_CASES):
        for r in results:
            _parity(case, r[k], clipped if k < len(LAYOUT_CASES) else plain)
    for rank, r in enumerate(results):
        s2, r2 = r[0], r[1]
        assert s2["metrics"] == r2["metrics"], rank
        assert all(torch.equal(s2["full"][n], r2["full"][n]) for n in s2["full"]), rank
        _check_regather(rank, r[len(LAYOUT_CASES) : len(LAYOUT_CASES) + len(REGATHER_CASES)])
        for k, case in enumerate(REGATHER_CASES + EMBED_CASES):
            _check_regather_plan(case, rank, r[len(LAYOUT_CASES) + k])


# --- the remaining compositions: optimizers, offload and wires (helpers_pipeline_more) ---------

OPT_CASES = [
    ("run_optimizer", "adamw_clip", "optim_grads_params"),
    ("run_optimizer", "muon", "no_shard"),
    ("run_optimizer", "narrow", "optim_grads"),
    ("run_optimizer", "eight_bit", "optim"),
    ("run_optimizer", "offload", "optim"),
]
WIRE_CASES = [
    ("run_wire", "optim_grads_params", torch.bfloat16, torch.bfloat16),
    ("run_wire", "optim_grads_params", torch.int8, torch.int8),
    ("run_wire", "optim", torch.float8_e4m3fn, torch.float8_e4m3fn),
]
# a wire's rounding, relative (test_optimizers_offload_and_wires's docstring derives each)
WIRE_UNIT = {torch.bfloat16: 2.0**-8, torch.int8: 3**0.5 / 254, torch.float8_e4m3fn: 2.0**-4}
WIRE_ROUNDINGS = 2 * 36 + 1  # the 36 weights in forward and backward, the gradient's wire


def _movement(got: dict, want: dict, p0: dict, names) -> float:
    """The largest ``|got - want| / |want - p0|`` over ``names`` (relative to the update)."""
    return max(hp._rel(got[n] - p0[n], want[n] - p0[n]) for n in names)


def _check_optimizer(case: tuple, r: dict, p0: dict, torch_ref: dict) -> None:
    """Pipelined against plain (same fs optimizer, same global batch) within 1e-5 of the
    update; Muon's matrices (bf16 results) within one bf16 rounding of an element per step
    where the two runs' fp32 inputs round apart, every other leaf within 1e-5."""
    _, kind, _ = case
    assert "error" not in r, (case, r)
    assert list(r["full"]) == list(r["plain"]) == list(p0), case
    assert all(m[2] == 0 for m in r["metrics"]), (case, r["metrics"])
    loss = _rel([m[0] for m in r["metrics"]], [m[0] for m in r["plain_metrics"]])
    norm = _rel([m[1] for m in r["metrics"]], [m[1] for m in r["plain_metrics"]])
    assert max(loss, norm) < 1e-5, (case, loss, norm)
    muon = [n for n in p0 if kind == "muon" and hpm._is_muon(n, tuple(p0[n].shape))]
    rest = [n for n in p0 if n not in muon]
    assert _movement(r["full"], r["plain"], p0, rest) < 1e-5, case
    for n in muon:  # |O| <= 1 per element: one bf16 rounding apart is <= lr * 2^-8 a step
        diff = (r["full"][n] - r["plain"][n]).abs()
        assert float(diff.max()) <= hp.STEPS * hpm.MUON_LR * 2.0**-8, (case, n)
        assert int((diff > 0).sum()) <= diff.numel() // 50, (case, n)  # a few elements
    if kind == "adamw_clip":  # and torch's AdamW after clip_grad_norm_, in one process
        assert _movement(r["full"], torch_ref, p0, p0) < 1e-5, case
    if kind == "offload":
        assert 0.3 < r["offloaded"] <= 0.7, r["offloaded"]


def _check_wire(case: tuple, r: dict, ref: dict, p0: dict) -> None:
    """Within sqrt(WIRE_ROUNDINGS) x the wire's unit of the fp32 run's update, rounding at
    all, and each rank's bytes by axis those ``fs.plan`` predicts for the policy."""
    _, strategy, param_wire, grad_wire = case
    assert "error" not in r, (case, r)
    err = _movement(r["full"], ref["params"], p0, p0)
    unit = max(WIRE_UNIT[param_wire], WIRE_UNIT[grad_wire])
    assert 0 < err < WIRE_ROUNDINGS**0.5 * unit, (case, err)
    loss = _rel([m[0] for m in r["metrics"]], ref["loss"])
    assert loss < WIRE_ROUNDINGS**0.5 * unit, (case, loss)
    policy = fs.MixedPrecisionPolicy(param_comm_dtype=param_wire, grad_comm_dtype=grad_wire)
    with torch.device("meta"):
        net = hp.Net()
    plan = fs.plan(
        net,
        world_size=4,
        strategy=strategy,
        policy=policy,
        optimizer="sgd_momentum",
        microbatches=hp.MICROBATCHES,
        device_type="cpu",
        pipeline=2,
        schedule="1F1B",
        split=hp.split_points(2),
        pipeline_rank=r["pipeline_rank"],
        boundary=(hpm.ROWS, hp.WIDTH),
    )
    want = {k: v * hp.STEPS for k, v in plan.comm_by_axis.items() if v}
    assert r["by_axis"] == want, (case, r["by_axis"], want)


def test_optimizers_offload_and_wires(pool4):
    """Under a pipeline (P=2 x S=2, 1F1B, 4 microbatches, 3 steps): AdamW with the whole
    model's gradient clipped (ZeRO-3; also against torch's AdamW in one process), Muon with
    AdamW beside it (no_shard: under a sharded strategy the update reaches its owner in bf16,
    where a ~1e-7 difference of the two runs' sums crossing a rounding is amplified by
    Newton-Schulz: 5.7e-3 of one matrix's update measured), bf16 moments (ZeRO-2), 8-bit
    moments (ZeRO-1), half the optimizer offloaded (ZeRO-1): each against the same fs
    optimizer on a plain S=4 state trained on the same global batch, within 1e-5 of the
    update. Wires (SGD momentum against one fp32 process): bf16 and int8 on both wires under
    ZeRO-3, fp8 on both under ZeRO-1. The bound: each of the 36 weights is rounded once a
    step on the param wire and read in forward and backward, and each rank's gradient
    contribution once on the grad wire: 73 roundings of relative size u (bf16 2^-8; int8
    blockwise half a step of 127 levels of the block's absmax, sqrt(3) x an element's RMS for
    these uniform inits: sqrt(3)/254; fp8 e4m3 half an ulp of 3 mantissa bits, 2^-4), unbiased
    and independent, so adding as a random walk: sqrt(73) u (0.033, 0.058, 0.53; measured
    0.0105, 0.0146, 0.129); bytes by axis equal fs.plan's."""
    cases = OPT_CASES + WIRE_CASES
    results = pool4.run(hpm.run_cases, cases)
    p0 = {n: p.detach() for n, p in hp.make_net().named_parameters()}
    ref, torch_ref = hp.reference(hpm.ROWS, 2), hpm.reference_adamw_clip()
    for k, case in enumerate(cases):
        for r in results:
            if case[0] == "run_optimizer":
                _check_optimizer(case, r[k], p0, torch_ref)
            else:
                _check_wire(case, r[k], ref, p0)
