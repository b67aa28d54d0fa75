"""``fs.plan`` against the ZeRO paper's Table 1 and against measured runs on 1-4 ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs
from funcshard.planner.plan import transformer_shapes

import models as M

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
POLICIES = {
    "fp32": fs.MixedPrecisionPolicy(),
    "bf16": fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "bf16_wire": fs.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, grad_comm_dtype=torch.bfloat16
    ),
    "bf16_pure": fs.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, main_params_dtype=None, main_grads_dtype=None
    ),
}
OPTIMIZERS = {
    "adamw": lambda: fs.optim.adamw(1e-3),
    "sgd": lambda: fs.optim.sgd(0.1),
    "sgd_momentum": lambda: fs.optim.sgd(0.1, momentum=0.9),
}


@pytest.mark.parametrize(
    ("strategy", "expected_gb"),
    [("no_shard", 120.0), ("optim", 31.4), ("optim_grads", 16.6), ("optim_grads_params", 1.88)],
)
def test_zero_paper_table1(strategy, expected_gb):
    # 7.5B params, Adam with fp32 masters (K = 12), fp16 params and grads, N = 64.
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.float16, main_grads_dtype=None)
    p = fs.plan(
        {"w": (7_500_000_000,)}, world_size=64, strategy=strategy, policy=policy, optimizer="adamw"
    )
    assert round(p.memory.model_states / 1e9, 2 if expected_gb < 10 else 1) == expected_gb


def test_zero3_table1_parts():
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_grads_dtype=None)
    p = fs.plan({"w": (64 * 1000,)}, world_size=64, policy=policy)
    m = p.memory
    got = (m.master, m.opt_state, m.compute_shard, m.grads, m.compute)
    assert got == (4000, 8000, 2000, 2000, 0)


def test_formula_by_strategy():
    shapes = {"a": (10, 3), "b": (7,)}  # padded over S=4: 12*3 + 8 = 44
    kw = dict(world_size=8, replicate=2, microbatches=3, optimizer="sgd")
    c = {s: fs.plan(shapes, strategy=s, **kw).comm for s in STRATEGIES}
    Pp, w = 44, 4
    assert fs.plan(shapes, strategy="optim", **kw).padded_numel == Pp
    assert c["no_shard"] == {
        "all_reduce": (30 + 7) * w,
        "all_gather": 0,
        "reduce_scatter": 0,
        "metrics": 8 + 8 + 16,  # the loss, the batch's verdict, fs.summed's shape header
        "muon": 0,
        "buffers": 0,  # a table of shapes: no model, no buffers
    }
    assert c["optim"] == {
        "reduce_scatter": Pp * w,
        "all_reduce": Pp // 4 * w,
        "all_gather": Pp * w,
        "metrics": 16 + 8 + 16,
        "muon": 0,
        "buffers": 0,
    }
    assert c["optim_grads"]["reduce_scatter"] == 3 * Pp * w
    assert c["optim_grads_params"]["all_gather"] == 2 * 3 * Pp * w


def test_replica_groups_add_the_replicas_axis():
    # fault-tolerant replica groups: each bucket's reduced gradient shard (the master's numel
    # on the gradient wire: bf16 here) and the loss across the groups under "replicas", and the
    # group's heal agreement (2 fp32 flags) over "world"; one group: nothing more
    shapes = {"a": (10, 3), "b": (7,)}  # padded over S=4: 12*3 + 8 = 44, 11 a rank
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)
    kw = dict(world_size=4, strategy="optim", optimizer="sgd", policy=policy)
    one, two = fs.plan(shapes, **kw), fs.plan(shapes, replica_groups=2, **kw)
    assert one.comm_by_axis["replicas"] == 0
    assert two.comm_by_axis["replicas"] == 11 * 2 + 8
    assert two.comm_by_axis["world"] == one.comm_by_axis["world"] + 8
    assert two.comm["all_reduce"] == one.comm["all_reduce"] + 11 * 2
    assert two.calls["all_reduce"] == one.calls["all_reduce"] + 1
    with pytest.raises(ValueError, match="replica_groups must be an int >= 1, got 0"):
        fs.plan(shapes, replica_groups=0, **kw)


class _NoTensorOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise AssertionError(f"plan ran a tensor op: {func}")


def test_llama70b_on_1024_ranks_from_shapes_alone():
    with _NoTensorOps():  # shape arithmetic only: nothing is allocated, nothing computed
        p = fs.plan(
            transformer_shapes(),
            world_size=1024,
            strategy="optim_grads_params",
            policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        )
    assert 68e9 < p.numel < 70e9
    assert p.units == 81 and p.buckets == 81
    assert p.memory.master == math.ceil(p.padded_numel / 1024) * 4


def test_meta_model_and_errors():
    with torch.device("meta"):
        model = M.make_model()
    p = fs.plan(model, world_size=2, strategy="optim_grads_params")
    assert p.units == 4
    with pytest.raises(ValueError, match="shard"):
        fs.plan(model, world_size=4, shard=3)
    with pytest.raises(ValueError, match="unknown optimizer"):
        fs.plan(model, world_size=2, optimizer="lion")
    assert (
        fs.plan(model, world_size=1, optimizer=fs.optim.adamw()).memory.opt_state
        == 2 * fs.plan(model, world_size=1, optimizer="adamw").memory.master
    )


def test_a_plain_model_with_experts_is_refused_not_planned_dense():
    """``expert=E`` needs the experts' placement: a plain model or a table of shapes would
    plan every expert as a dense weight (gathered and reduced whole), so both are refused."""
    import helpers_experts as moe

    with torch.device("meta"):
        model = moe.make_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for params in (model, shapes):
        with pytest.raises(ValueError, match=r"expert=2.*planned as a dense weight"):
            fs.plan(params, world_size=4, expert=2)
    assert fs.plan(model, world_size=4).numel == sum(p.numel() for p in model.parameters())


def _state_bytes(state) -> int:
    tensors = [t for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measure(strategy, shard, replicate, microbatches, policy, optimizer, offload):
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = M.make_model()
    state = fs.init(
        model,
        OPTIMIZERS[optimizer](),
        mesh=mesh,
        policy=POLICIES[policy],
        strategy=strategy,
        offload_fraction=offload,
    )
    dtype = POLICIES[policy].param_dtype or torch.float32

    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"].to(dtype),))
        return torch.nn.functional.cross_entropy(logits.float(), batch["y"])

    batch = M.local_batch(M.global_batch(0, 24), dist.get_rank(), dist.get_world_size())
    with fs.comm_stats() as stats:
        state, _ = fs.train_step(state, batch, loss_fn, microbatches=microbatches)
    return {
        "comm": dict(stats.bytes),
        "calls": dict(stats.calls),
        "gathered_peak": stats.gathered_peak,
        "state": _state_bytes(state),
    }


CASES = [  # (strategy, shard, replicate, microbatches, policy, optimizer, offload)
    ("no_shard", -1, 1, 2, "fp32", "adamw", 0.0),
    ("optim", -1, 1, 2, "bf16", "sgd_momentum", 0.0),
    ("optim_grads", -1, 1, 3, "bf16_wire", "adamw", 0.0),
    ("optim_grads_params", -1, 1, 2, "bf16", "adamw", 0.0),
    ("optim_grads_params", -1, 1, 1, "bf16_pure", "sgd", 0.5),
    ("optim_grads", -1, 1, 1, "fp32", "adamw", 0.5),
]


def _check(pool, world, case):
    strategy, shard, replicate, mb, policy, optimizer, offload = case
    with torch.device("meta"):
        model = M.make_model()
    p = fs.plan(
        model,
        world_size=world,
        shard=shard,
        replicate=replicate,
        strategy=strategy,
        policy=POLICIES[policy],
        offload_fraction=offload,
        microbatches=mb,
        optimizer=optimizer,
        device_type="cpu",
    )
    for got in pool.run(measure, *case):
        assert {k: v for k, v in got["comm"].items() if v} == {k: v for k, v in p.comm.items() if v}
        assert {k: v for k, v in got["calls"].items() if v} == {
            k: v for k, v in p.calls.items() if v
        }
        assert got["state"] == p.memory.state
        assert got["gathered_peak"] == p.memory.gathered_peak


@pytest.mark.parametrize("case", CASES[:3] + CASES[4:5], ids=str)
def test_matches_one_rank(pool1, case):
    _check(pool1, 1, case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_two_ranks(pool2, case):
    _check(pool2, 2, case)


@pytest.mark.parametrize("case", CASES[1:4], ids=str)
def test_matches_three_ranks(pool3, case):
    _check(pool3, 3, case)


@pytest.mark.parametrize(
    "case",
    [
        CASES[3],
        ("optim_grads_params", 2, 2, 2, "bf16", "adamw", 0.0),
        ("optim", 2, 2, 1, "fp32", "sgd", 0.0),
        ("no_shard", 2, 2, 1, "bf16", "sgd", 0.0),
    ],
    ids=str,
)
def test_matches_four_ranks(pool4, case):
    _check(pool4, 4, case)
