"""``fs.plan(model, ..., tensor=T)`` against measured tensor-parallel runs, and memory per rank.

The Llama-like model of ``helpers_tp`` parallelized with torchtitan's plan on 4 ranks; the
Muon + AdamW recipe of ``helpers_muon`` (Muon's exchange over "shard", its gathers of split
matrices over "tensor") or AdamW alone. Per rank and step: the bytes on every mesh axis (the
norm's sums over "tensor" under "metrics", Muon's gathers under "muon"), the bytes and calls of
every kind, and the state's bytes equal the plan's; the masters and optimizer state of the
split parameters are 1/(S*T) of the model's (1/T where nothing is sharded over "shard").
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

import funcshard as fs

import helpers_tp as H
from helpers_muon import is_muon, ours

SEED, ROWS = 12, 8


def _state_bytes(state) -> int:
    """Bytes of every distinct storage the state holds (as tests/test_plan.py measures)."""
    seen = {}
    for t in fs.tree.leaves(state):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _named_tensors(tree, out: dict) -> dict:
    """Every ``{name: tensor}`` entry of ``opt_state_by_name()``'s tree, summed per name."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if isinstance(v, torch.Tensor):
                out[k] = out.get(k, 0) + v.numel() * v.element_size()
            else:
                _named_tensors(v, out)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            _named_tensors(v, out)
    return out


def split_bytes(state, model, muon: bool) -> tuple[int, int]:
    """(this rank's masters + optimizer state of the split params, the model's in one process)."""
    layout = state.layout
    split = [n for n, p in model.named_parameters() if layout.tensor.sharded(n)]
    states = _named_tensors(state.opt_state_by_name(), {})
    mine = sum(
        math.prod(layout.leaf(n).shard_shape(layout.shard_rank)) * 4 + states[n] for n in split
    )
    params = dict(model.named_parameters())
    # fp32 masters; Muon keeps a momentum, AdamW two moments
    model_bytes = sum(
        params[n].numel() * 4 * (2 if muon and is_muon(n, tuple(params[n].shape)) else 3)
        for n in split
    )
    return mine, model_bytes


def measure(strategy, shard, replicate, tensor, deterministic, muon, outer="no_shard"):
    mesh = H.world_mesh(shard, replicate, tensor)
    model = H.parallelize(H.make_model(SEED), mesh)
    opt = ours() if muon else fs.optim.adamw(1e-3)
    p = fs.plan(
        model,
        world_size=dist.get_world_size(),
        shard=shard,
        replicate=replicate,
        tensor=tensor,
        strategy=strategy,
        optimizer=opt,
        device_type="cpu",
        deterministic=deterministic,
        outer_strategy=outer,
    )
    state = fs.init(
        model, opt, mesh=mesh, strategy=strategy, deterministic=deterministic, outer_strategy=outer
    )
    batch = H.local_batch(H.global_batch(0, ROWS), mesh)
    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, batch, H.make_loss_fn(model))
    return {
        "plan": p,
        "by_axis": dict(stats.bytes_by_axis),
        "bytes": dict(stats.bytes),
        "calls": dict(stats.calls),
        "state": _state_bytes(state),
        "split": split_bytes(state, model, muon),
    }


CASES = [  # (strategy, shard, replicate, tensor, deterministic, muon[, outer_strategy])
    *[(s, 2, 1, 2, False, True) for s in fs.STRATEGIES],
    ("optim_grads_params", 2, 1, 2, False, False),
    ("optim_grads", 2, 1, 2, True, True),
    ("optim_grads_params", 1, 1, 4, False, True),
    ("optim", 1, 2, 2, False, True),
    ("optim_grads_params", 1, 2, 2, False, True, "optim"),  # HFSDP x tensor
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tp_plan_equals_measurement(pool4, case) -> None:
    strategy, shard, replicate, tensor, deterministic, muon, *outer = case
    results = pool4.run(measure, *case)
    p = results[0]["plan"]
    assert p.tensor == tensor and p.shard == shard
    measured = {a: max(r["by_axis"].get(a, 0) for r in results) for a in p.comm_by_axis}
    assert measured == p.comm_by_axis, (measured, p.comm_by_axis)
    assert p.comm_by_axis["tensor"] > 0  # the norm's sum, at least
    for kind in p.comm:
        assert max(r["bytes"].get(kind, 0) for r in results) == p.comm[kind], kind
        assert max(r["calls"].get(kind, 0) for r in results) == p.calls[kind], kind
    if muon:
        assert p.comm["muon"] > 0
    for r in results:
        assert sum(r["by_axis"].values()) == sum(r["bytes"].values()), r
        assert r["state"] == p.memory.state
        if deterministic:  # its leaves' rows padded to 128 bytes: not an even split
            continue
        # every split param divides evenly at these (S, T): exactly 1/(S*T) of the model's
        # (1/(R*S*T) under HFSDP)
        mine, model_bytes = r["split"]
        sharded = fs.Strategy.parse(strategy).shards_optim
        masters = shard * (replicate if outer == ["optim"] else 1) if sharded else 1
        assert mine * tensor * masters == model_bytes, (mine, model_bytes)


def test_plan_refuses_what_it_cannot_plan(pool4) -> None:
    for msg in pool4.run(refusals_worker):
        assert msg == "ok", msg


def refusals_worker() -> str:
    mesh = H.world_mesh(2, 1, 2)
    model = H.parallelize(H.make_model(SEED), mesh)
    assert any(isinstance(p, DTensor) for p in model.parameters())
    cases = [
        (dict(tensor=1), "DTensor parameters.*tensor=T"),
        (dict(tensor=4, shard=1), "'layers.0.attn.q.weight'.*tensor=4"),
        (dict(tensor=3), "not divisible|must equal"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fs.plan(model, world_size=4, **kwargs)
    with pytest.raises(ValueError, match="not a table of shapes"):
        fs.plan({"w": (4, 4)}, world_size=4, tensor=2)
    with pytest.raises(ValueError, match="already parallelized.*'layers.0.attn.q.weight'"):
        fs.plan(model, world_size=4, tensor=2, tensor_plan=H.model_plan())
    return "ok"


# (world_size, shard, replicate, strategy, deterministic, outer_strategy) at tensor=2
PLANNED = [
    *[(8, 4, 1, s, False, "no_shard") for s in fs.STRATEGIES],
    (8, 2, 2, "optim_grads_params", False, "optim"),
    (4, 2, 1, "optim_grads", True, "no_shard"),
]


def _plans(model, **kw) -> list:
    return [
        fs.plan(
            model,
            world_size=world,
            shard=shard,
            replicate=replicate,
            strategy=strategy,
            deterministic=deterministic,
            outer_strategy=outer,
            optimizer=opt,
            tensor=2,
            **kw,
        )
        for world, shard, replicate, strategy, deterministic, outer in PLANNED
        for opt in ("adamw", ours())
    ]


def parallelized_plans_worker(sequence_parallel: bool) -> list:
    """fs.plan of the model after parallelize_module on a tensor mesh of 2 ranks."""
    mesh = H.world_mesh(1, 1, 2)
    model = H.parallelize(H.make_model(SEED), mesh, sequence_parallel=sequence_parallel)
    return _plans(model)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_plan_of_a_plain_model_under_a_tensor_plan(pool2, sequence_parallel: bool) -> None:
    """``fs.plan(plain_model, tensor=T, tensor_plan=plan)``, in this process (no process group,
    a meta-device model) plans what ``fs.plan`` of the model after ``parallelize_module(model,
    mesh["tensor"], plan)`` plans: memory, bytes and calls on every axis, Muon's gathers of the
    split matrices included (the embedding rowwise and SequenceParallel norms under SP)."""
    parallelized = pool2.run(parallelized_plans_worker, sequence_parallel)[0]
    with torch.device("meta"):
        plain = H.make_model(SEED)
    planned = _plans(plain, tensor_plan=H.model_plan(sequence_parallel=sequence_parallel))
    assert planned == parallelized
    assert all(p.comm_by_axis["tensor"] > 0 for p in planned)


def test_plan_refuses_a_plain_model_without_a_tensor_plan() -> None:
    """A plain model with tensor=T > 1 and no tensor_plan would plan every parameter as
    replicated over "tensor": a ValueError saying to apply the plan first or pass it; a
    tensor_plan that names no submodule, splits a module torch cannot split, or comes without
    a tensor axis: a ValueError naming it."""
    plain = H.make_model(SEED)
    with pytest.raises(ValueError, match="no parameter of the model is a DTensor") as e:
        fs.plan(plain, world_size=4, tensor=4)
    assert "parallelize_module" in str(e.value) and "tensor_plan=" in str(e.value)
    cases = [
        (dict(tensor=1), "tensor=T > 1"),
        (dict(tensor_plan={"layers.*.nope": ColwiseParallel()}), "'layers.\\*.nope'"),
        (dict(tensor_plan={"norm": ColwiseParallel()}), "'norm'.*ColwiseParallel on RMSNorm"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fs.plan(
                plain, **{"world_size": 4, "tensor": 2, "tensor_plan": H.model_plan(), **kwargs}
            )
