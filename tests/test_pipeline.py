"""Pipeline parallel (``fs.Pipeline`` on ``fs.make_mesh(pipeline=P)``): stages from
``fs.pipeline.split`` run by torch.distributed.pipelining's own schedules train as one
process trains the unsplit model on the concatenated global batch.

fp32, SGD with momentum 0.9, 3 steps of 4 microbatches: every schedule at P=4 (S=1) and at
P=2 x S=2, the four strategies spread over the latter; within 1e-5 (the whole model's params
from ``fs.full_params``, losses, grad norms), loss and grad norm bitwise the same on every
rank, the bytes each rank sends under "pipeline" equal to its stages' outputs and input
gradients crossing to another rank, ZeRO-3 gathering each bucket once a step. Bad input is
refused on every rank by name; a stage raising in its forward fails every rank, naming it,
and the next step runs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch

import funcshard as fs
from funcshard.parallel.pipeline import SCHEDULES

import helpers_pipeline as hp
import helpers_pipeline_tiers as hpt

TOL = 1e-5
ROWS = 8  # per data-parallel rank: 2 rows a microbatch
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _case(schedule: str, pipeline: int, k: int) -> tuple:
    """(schedule, P, strategy, rows, stages per rank, microbatches): DualPipeV takes at least
    as many microbatches as stages (torch's rule)."""
    per_rank = 1 if SCHEDULES[schedule][1] == "single" else 2
    micro = max(hp.MICROBATCHES, pipeline * per_rank) if schedule == "DualPipeV" else 4
    return (schedule, pipeline, STRATEGIES[k % 4], ROWS, per_rank, micro)


CASES = [_case(s, 4, k) for k, s in enumerate(SCHEDULES)] + [
    _case(s, 2, k) for k, s in enumerate(reversed(SCHEDULES))
]


def test_split_and_pipeline_arguments():
    with torch.device("meta"):  # a meta model splits: nothing is materialized or copied
        net = hp.Net()
    stages = fs.pipeline.split(net, hp.split_points(4))
    names = [sorted({".".join(n.split(".")[:2]) for n, _ in s.named_parameters()}) for s in stages]
    assert names[0] == ["blocks.0", "blocks.1", "embed.bias", "embed.weight"]
    assert names[3] == ["blocks.6", "blocks.7", "head.bias", "head.weight"]
    assert all(p.is_meta for s in stages for p in s.parameters())
    assert list(stages[1].blocks) == [net.blocks[2], net.blocks[3]]  # shared, not copied
    assert isinstance(stages[1].embed, torch.nn.Identity) and len(list(net.blocks)) == 8
    plain = hp.make_net()  # the stages chained are the model
    x = torch.randn(3, hp.D_IN)
    y = x
    for s in fs.pipeline.split(plain, hp.split_points(4)):
        y = s(y)
    torch.testing.assert_close(y, plain(x), rtol=0, atol=0)
    for bad, words in [
        (["blocks.9"], "not a submodule"),
        (["blocks.4", "blocks.2"], "not in model order"),
        (["blocks", "blocks.2"], "inside 'blocks'"),
    ]:
        with pytest.raises(ValueError, match=words):
            fs.pipeline.split(hp.make_net(), bad)
    with pytest.raises(ValueError, match="unknown schedule 'Zigzag'"):
        fs.Pipeline("Zigzag", microbatches=4)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        fs.Pipeline("GPipe", microbatches=0)
    assert fs.Pipeline("GPipe", microbatches=2, regather=True).regather  # test_pipeline_math
    with pytest.raises(ValueError, match="this schedule takes 2 x P stages"):
        fs.Pipeline("DualPipeV", microbatches=4).stages_of(0, 2, 3)


class _Checkpointed(torch.nn.Module):
    """Two linears with tied weights, the first under activation checkpointing (``ckpt``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.ckpt = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), True
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = lambda t: torch.tanh(self.a(t))  # noqa: E731
        if self.ckpt:
            return self.b(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False))
        return self.b(inner(x))


def test_a_stage_runs_its_microbatches_on_the_steps_leaves(monkeypatch):
    """A stage's microbatches (#53): the stage run with the step's leaves in place of its
    parameters (a tied weight taking its leaf), bitwise as ``torch.func.functional_call``
    runs it, without walking the stage's modules and parameters (torch's walk on every
    microbatch, once per StageModule here); the leaves held until ``release`` (the step's
    schedule over), so that an activation-checkpointed recomputation in backward uses them
    (not the stage's own parameters: silently other gradients before), the stage's own
    parameters back after."""
    from funcshard.step.pipeline_stage import StageModule

    torch.manual_seed(0)
    stage = _Checkpointed()
    own = dict(stage.named_parameters())
    module = StageModule(stage, 0)
    module.leaves = {n: torch.randn_like(p).requires_grad_() for n, p in own.items()}
    twins = {n: t.detach().clone().requires_grad_() for n, t in module.leaves.items()}
    xs = torch.randn(2, 3, 4)
    stage.ckpt = False  # the reference: no recomputation
    want = [torch.func.functional_call(stage, twins, (x,)) for x in xs]
    stage.ckpt = True
    walks: list[str] = []
    for walk in ("named_modules", "named_parameters", "named_buffers", "named_children"):
        real = getattr(stage, walk)
        counted = lambda *a, r=real, w=walk, **k: walks.append(w) or r(*a, **k)  # noqa: E731
        monkeypatch.setattr(stage, walk, counted)
    got = [module(x) for x in xs]  # both forwards, then both backwards (as 1F1B may)
    assert walks == [], walks
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for g, w in zip(got, want, strict=True):
        (g * w.detach()).sum().backward()
        (w * w.detach()).sum().backward()
    for n in own:
        assert torch.equal(module.leaves[n].grad, twins[n].grad), n
    assert stage.a.weight is module.leaves["a.weight"]
    module.release()
    assert stage.a.weight is stage.b.weight is own["a.weight"] and stage.b.bias is own["b.bias"]
    # regather=True: a microbatch's gathered params are in the stage during its forward only;
    # the recomputation in backward raises naming the parameter (before: the stage's own
    # parameters, other gradients silently)
    from funcshard.step.units.placeholders import UnitParamsError

    module.regather = object()  # only its presence matters to a stage's run
    out = module._run((xs[0],), module.leaves)
    with pytest.raises(UnitParamsError, match=r"stage 0: parameter 'a\.weight'.*regather=False"):
        out.sum().backward()
    module.release()
    assert stage.a.weight is stage.b.weight is own["a.weight"] and stage.b.bias is own["b.bias"]


def test_schedules_and_strategies_as_one_process(pool4):
    results = pool4.run(hp.run_cases, CASES)
    refs = {}
    for k, case in enumerate(CASES):
        schedule, pipeline, _, rows, _, micro = case
        per_rank = [r[k] for r in results]
        assert all("error" not in r for r in per_rank), (case, per_rank)
        dp = 4 // pipeline
        if (dp, micro) not in refs:
            refs[dp, micro] = hp.reference(rows, dp, micro)
        for rank, r in enumerate(per_rank):
            err = hp.errors(r, refs[dp, micro])
            assert err["names"], (case, rank)
            assert max(err["param"], err["loss"], err["norm"]) < TOL, (case, rank, err)
            assert r["metrics"] == per_rank[0]["metrics"], (case, rank)  # bitwise on every rank
            want = hp.expected_bytes(r["stages"], r["nstages"], pipeline, schedule, rows)
            assert r["pipeline_bytes"] == want > 0, (case, rank, r["pipeline_bytes"], want)
            if case[2] == "optim_grads_params" and pipeline == 2:  # S=2: gathered once a step
                assert r["gathers"] == hp.STEPS * r["buckets"] > 0, (case, rank, r)


def test_bad_input_and_a_failing_stage(pool4):
    for rank, out in enumerate(pool4.run(hp.run_refusals)):
        assert out["names"] == ("pipeline", "replicate", "shard"), out
        assert out["pipeline_ranks"] == [rank % 2, rank % 2 + 2], out  # p * (world // P) + s
        assert "takes P stages" in out["count"] and "ValueError" in out["count"], out
        assert "is in stage 0 and stage 1" in out["twice"], out
        assert "torch's Schedule1F1B refuses" in out["microbatches"], out
        assert "mesh has a 'pipeline' axis" in out["no_pipeline"], out
        assert "compile=True is not supported yet" in out["compile"], out
        assert "7 rows, not a multiple of microbatches=4" in out["uneven"], out
        assert "rank 0: ValueError" in out["uneven"] and "rank 3: ValueError" in out["uneven"]
        # rows refused on one rank alone: every rank raises, naming it (not a hang), and
        # nothing was consumed (the steps below train)
        assert "rank 3: ValueError" in out["one_rank"], out["one_rank"]
        assert "rank 2:" not in out["one_rank"] and "7 rows" in out["one_rank"], out
        assert "has 4 rows, input 0 has 8" in out["target_rows"], out["target_rows"]
        # shapes valid alone but unlike the other ranks': refused on every rank, and no rank
        # rebuilt its schedule alone (the steps below train)
        assert "the ranks' batches differ" in out["apart"], out["apart"]
        assert "rank 0: (inputs, target) of shapes and dtypes (((16," in out["apart"], out
        assert "boom: a stage's backward failed" in out["first_back"], out["first_back"]
        assert "rank 2: stage 1" in out["first_back"], out["first_back"]
        assert "RuntimeError" in out["boom"] and "boom: a stage's forward failed" in out["boom"]
        assert "stage 1" in out["boom"] and "rank 2" in out["boom"], out["boom"]
        # in its backward on rank 2 alone (stage 1): every rank raises naming it, no hang
        assert "boom: a stage's backward failed" in out["back"], out["back"]
        assert "rank 2: stage 1" in out["back"] and "rank 3:" not in out["back"], out["back"]
        rg = out["regather"]  # regather=True, one data-parallel rank failing: no hang
        assert "boom: a stage's forward failed" in rg["forward_on"], rg["forward_on"]
        assert "boom: a stage's backward failed" in rg["backward_on"], rg["backward_on"]
        assert "rank 2: stage 1" in rg["backward_on"] and "rank 3:" not in rg["backward_on"]
        assert rg["step"] == 2 and math.isfinite(rg["loss"]), rg
        assert out["step_after"] == 1 and out["step_then"] == 2, out
        assert out["loss_then"] > 0, out


def test_a_stage_failing_on_any_input_in_its_first_step(pool4):
    """A stage whose output shape no rank knows (it raises on the meta device too) failing in
    the step that infers the stages' shapes: before, that rank raised alone and its peers
    waited for the collective timeout; now its stand-in takes its input's shape, the step
    fails on every rank, and the next one infers the shapes again (not the guessed ones:
    stage 1 would receive stage 0's output into buffers of its input's shape) and trains.
    Under regather=True, a forward, then a backward, failing on one rank in such a step
    gathers again what its data-parallel peer's backward does (before, the peers waited)."""
    ref = hp.reference(ROWS, 2, steps=1)
    for rank, out in enumerate(pool4.run(hp.run_first_step_failures)):
        one, every = out["last_one_rank"], out["first_every_rank"]
        assert one.startswith("RuntimeError: train_step: the pipeline step failed"), one
        assert "rank 2: stage 1" in one and "rank 3:" not in one, (rank, one)
        assert "boom: a stage's forward failed" in one, one
        assert "rank 0: stage 0" in every and "rank 1: stage 0" in every, (rank, every)
        assert "boom: a stage's forward failed" in every, every
        err = hp.errors(out, ref)
        assert err["names"] and max(err["param"], err["loss"], err["norm"]) < TOL, (rank, err)
        fwd, back = out["regather_forward"], out["regather_back"]
        assert "rank 2: stage 1" in fwd and "boom: a stage's forward failed" in fwd, fwd
        assert "rank 2: stage 1" in back and "boom: a stage's backward failed" in back, back
        assert out["again"] == 1, out["again"]


ORBAX_READ = """
import sys, numpy as np, orbax.checkpoint as ocp
tree = ocp.PyTreeCheckpointer().restore(sys.argv[1])
np.savez(sys.argv[2], **{n: np.asarray(a) for n, a in tree["params"].items()})
"""


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_checkpoints_of_the_whole_model(pool4, tmp_path):
    """fs.save of a pipelined state (P=2 x S=2, every strategy) is one checkpoint of the whole
    model: restored bitwise onto a plain state (S=4) and onto pipelined states of another P,
    split and schedule, which train on as one process does; the optimizer state restored
    exactly (the same layout resumes bitwise as if uninterrupted); JAX's Orbax reads it; a
    CheckpointManager saves and restores it across P into a meta-device model's state;
    export_safetensors writes the whole model. And buffers the forward updates
    (:func:`_check_trained_buffers`)."""
    out = pool4.run(hpt.run_checkpoints_and_buffers, str(tmp_path))
    _check_trained_buffers([r["trained_buffers"] for r in out], tmp_path / "norm")
    ref = hp.reference(ROWS, 2, steps=2)
    for rank, r in enumerate(out):
        for k, case in enumerate(r["cases"]):
            saved = case["saved"]
            assert list(saved) == list(ref["params"]), (rank, k)  # the whole model's names
            assert _equal(case["plain"], saved), (rank, k)  # bitwise
            assert _equal(case["restored"], saved) and case["restored_step"] == 1, (rank, k)
            for buffers in (case["plain_buffers"], case["restored_buffers"]):
                assert torch.equal(buffers["root_stat"], torch.arange(3.0)), (rank, k)
                if "blocks.5.stat" in buffers or buffers is case["plain_buffers"]:
                    assert torch.equal(buffers["blocks.5.stat"], torch.full((2,), 7.0)), rank
            if k < 2:  # momentum restored: one process's second step
                err = max(hp._rel(case["resumed"][n], ref["params"][n]) for n in ref["params"])
                assert err < TOL, (rank, k, err)
            if case["same_layout"]:
                assert _equal(case["resumed"], case["uninterrupted"]), (rank, k)
        mgr = r["manager"]
        assert mgr["latest"] == 1 and not mgr["filled"], mgr  # restored into a meta model
        assert _equal(mgr["restored"], mgr["saved"]), rank
        assert torch.equal(mgr["buffers"]["root_stat"], torch.arange(3.0)), mgr["buffers"]
    path, npz = str(tmp_path / "optim_grads"), str(tmp_path / "orbax.npz")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", ORBAX_READ, path, npz], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(npz)
    saved = out[0]["cases"][2]["saved"]
    assert sorted(got.files) == sorted(saved)
    for name, t in saved.items():
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)
    exported = safetensors.torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    saved = out[0]["cases"][0]["saved"]
    assert sorted(exported) == sorted(saved)  # the whole model
    assert all(torch.equal(exported[n], t) for n, t in saved.items())


def _check_trained_buffers(out: list[dict], root) -> None:
    """BatchNorm in the first and last stages at P=2 x S=2 (4 stages, two a rank): after 2
    steps each stage's running statistics and counter are one process's (the first
    data-parallel rank's microbatches: 8 forwards, not one more for torch's shape
    inference; the last stage's, under activation checkpointing, 8 more, its
    recomputations, not one more for the shape inference's backward nor 8 for
    InterleavedZeroBubble's weight backward, which recomputes once more), and so is the
    root's counter in each stage (not once a stage: each its own copy); the checkpoint
    holds every stage's from that stage's ranks, bitwise, whoever restores it (a plain
    state; from the plain state's checkpoint, a meta model's stages under ZBVZeroBubble,
    the root's buffers in both of a rank's stages, each its own); the same layout restored
    (InterleavedZeroBubble) trains on bitwise as uninterrupted, a third step within 1e-5 of
    one process. The whole-model views carry the parameters only (no buffer is claimed)."""
    ref = hpt.norm_reference(3)
    params = list(ref[0]["params"])
    persistent = [n for n in ref[0]["buffers"] if n != "head.scale"]
    for r in out:
        for got in (r["trained"], r["meta"], r["resumed"][0], r["uninterrupted"][0]):
            assert got.pop("shared") == [], got  # each stage its own root buffers
    trained = {n.split(":")[1]: b for r in out for n, b in r["trained"].items()}
    for rank, r in enumerate(out):
        for step, buffers in ((1, r["trained"]), (2, r["uninterrupted"][0])):
            for key, b in buffers.items():
                want = ref[step]["buffers"][key.split(":")[1]]
                assert b.dtype == want.dtype and hp._rel(b.double(), want.double()) < TOL, key
                if key.endswith(("num_batches_tracked", ":calls")):  # 4 microbatches a step
                    twice = 2 if ":norm1" in key else 1  # recomputed in backward: counted again
                    assert int(b) == twice * hp.MICROBATCHES * (step + 1), (rank, key, int(b))
        names = {n.split(":")[1] for n in r["trained"]}
        assert {"root_stat", f"norm{rank // 2}.running_var"} <= names, names
        assert r["full_names"] == sorted(params), r["full_names"]  # params only
        # broadcast over the stage's data-parallel ranks: each stage's copy of the root's
        assert r["buffer_bytes"] == 2 * r["planned"] > 2 * 2 * (12 + 8), r  # 2 steps
        assert sorted(r["plain"]) == sorted(ref[0]["buffers"]), rank
        assert all(torch.equal(r["plain"][n], trained[n]) for n in persistent), rank
        for key, b in r["meta"].items():
            if not key.endswith(":head.scale"):  # not persistent: a meta model's stays meta
                assert not isinstance(b, str) and torch.equal(b, trained[key.split(":")[1]]), key
        assert len([k for k in r["meta"] if k.endswith(":calls")]) == 2, r["meta"]
        assert _equal(r["resumed"][1], r["uninterrupted"][1]), rank
        assert _equal(r["resumed"][0], r["uninterrupted"][0]), rank
        err = max(hp._rel(r["uninterrupted"][1][n], ref[2]["params"][n]) for n in params)
        assert err < TOL, (rank, err)
    exported = safetensors.torch.load_file(str(root / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(params)


def test_a_module_dict_of_blocks_and_the_local_and_dcp_tiers(pool4, tmp_path):
    """torchtitan's ModuleDict of blocks (keys "0".."7") splits into the same gather units as
    the ModuleList and trains as one process under ZeRO-3 at P=2 x S=2 (one gather a bucket a
    step); its state saved by a CheckpointManager's local tier only, then restored by a new
    manager into a meta model's state, bitwise, while a tier step of another split whose
    masters have the same shapes is not taken; converted to DCP, restored model_only at P=4,
    bitwise. And a stage that cannot run on the meta device raising on one rank in its very
    first forward: every rank raises naming it (its stand-in sized by the stage run on
    zeros), never a hang, and the next stage's first input in torch's shape inference is
    zeros, not torch.empty's; a
    forward raising under ZBVZeroBubble fails every rank and the next step trains; a stage
    returning a dict is refused on every rank."""
    out = pool4.run(hpt.run_titan_and_tiers, str(tmp_path), ROWS)
    ref = hp.reference(ROWS, 2)
    for rank, r in enumerate(out):
        stage = rank // 2  # 2 stages of 4 blocks: stage 0 holds blocks 0-3
        assert r["units"] == ["", *(f"blocks.{k}" for k in range(4 * stage, 4 * stage + 4))], r
        assert r["gathers"] == hp.STEPS * r["buckets"], r
        err = max(hp._rel(r["full"][n], ref["params"][n]) for n in ref["params"])
        assert list(r["full"]) == list(ref["params"]) and err < TOL, (rank, err)
        assert str(hp.STEPS) not in r["root_steps"], r["root_steps"]  # in the tier only
        assert _equal(r["tier"], r["full"]), rank  # from the local tier alone
        assert r["another_split"].startswith("FileNotFoundError"), r["another_split"]
        zb = r["zero_bubble"]
        assert "boom: a stage's forward failed" in zb["zbv"], zb["zbv"]
        assert "boom: a stage's backward failed" in zb["zbv_back"], zb["zbv_back"]
        assert "rank 3: stage 2" in zb["zbv_back"], zb["zbv_back"]
        assert zb["zbv_step"] == 2 and math.isfinite(zb["zbv_loss"]), zb
        assert zb["dict"].startswith("ValueError") and "stage 0 returns dict" in zb["dict"], zb
        for nm in r["no_meta"]:  # regather=False, True
            assert "rank 0: stage 0" in nm["error"] and "no_meta: a stage's" in nm["error"], nm
            assert nm["step"] == 1 and math.isfinite(nm["loss"]), nm
            if stage == 1:  # torch's shape inference: zeros, rejected, then a normal
                assert nm["first_seen"][0] == 0.0 < nm["first_seen"][1], nm
        assert _equal(r["dcp"], r["full"]), rank
