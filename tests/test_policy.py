"""Each MixedPrecisionPolicy field is proven by a test that fails if the field were ignored."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs

import models

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


def test_promotion_table_and_none_rules() -> None:
    P = fs.MixedPrecisionPolicy
    d = P().resolve(FP32)
    assert (d.compute, d.master, d.grad, d.comm) == (FP32, FP32, FP32, FP32)
    d = P(param_dtype=BF16).resolve(FP32)
    assert (d.compute, d.master, d.grad, d.comm) == (BF16, FP32, FP32, FP32)
    d = P(param_dtype=BF16, grad_comm_dtype=BF16).resolve(FP32)
    assert (d.compute, d.master, d.grad, d.comm) == (BF16, FP32, FP32, BF16)
    d = P(param_dtype=BF16, main_params_dtype=None, main_grads_dtype=None).resolve(FP32)
    assert (d.compute, d.master, d.grad, d.comm) == (BF16, BF16, BF16, BF16)
    d = P(param_dtype=None, main_params_dtype=None, main_grads_dtype=None).resolve(BF16)
    assert (d.compute, d.master, d.grad, d.comm) == (BF16, BF16, BF16, BF16)


def test_policy_is_frozen_hashable_and_validated() -> None:
    policy = fs.MixedPrecisionPolicy(param_dtype=BF16)
    assert hash(policy) == hash(fs.MixedPrecisionPolicy(param_dtype=BF16))
    with pytest.raises(AttributeError):
        policy.param_dtype = FP32  # type: ignore[misc]
    with pytest.raises(TypeError, match="grad_comm_dtype"):
        fs.MixedPrecisionPolicy(grad_comm_dtype=torch.int32)


class Probe(nn.Module):
    """Records the dtype of the weight it computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        for block in self.blocks:
            self.seen.append(block.weight.dtype)
            x = block(x.to(block.weight.dtype))
        return x


def compute_dtype_worker(strategy: str, param_dtype) -> list:
    mesh = fs.make_mesh(device_type="cpu")
    model = Probe()
    policy = fs.MixedPrecisionPolicy(param_dtype=param_dtype)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, strategy=strategy)
    loss_fn = lambda p, b: fs.functional_call(model, p, (b,)).float().square().mean()
    state, _ = fs.train_step(state, torch.randn(4, 4), loss_fn)
    return sorted({str(d) for d in model.seen})


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_param_dtype_is_what_the_model_computes_in(pool2, strategy: str) -> None:
    assert pool2.run(compute_dtype_worker, strategy, BF16)[0] == ["torch.bfloat16"]
    assert pool2.run(compute_dtype_worker, strategy, None)[0] == ["torch.float32"]


def wire_worker(strategy: str, comm) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=comm)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, strategy=strategy)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    with fs.comm_stats() as stats:
        fs.train_step(state, batch, models.make_loss_fn(model))
    return {k: stats.bytes[k] for k in ("reduce_scatter", "all_reduce")}


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_grad_comm_dtype_is_the_wire_dtype(pool2, strategy: str) -> None:
    fp32 = pool2.run(wire_worker, strategy, None)[0]
    bf16 = pool2.run(wire_worker, strategy, BF16)[0]
    total = lambda b: b["reduce_scatter"] + b["all_reduce"]
    assert total(fp32) > 0
    assert total(bf16) * 2 == total(fp32)


class Scalar(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([value]))

    def forward(self, c):
        return (self.w * c).sum()


def accumulation_worker(strategy: str, main_grads) -> float:
    # Per-microbatch gradients 64, .25, .25, .25 (after the 1/M scaling): a bf16 accumulator
    # cannot hold 64.25, an fp32 one ends at 64.75.
    mesh = fs.make_mesh(device_type="cpu")
    model = Scalar(0.0)
    policy = fs.MixedPrecisionPolicy(main_grads_dtype=main_grads, grad_comm_dtype=FP32)
    state = fs.init(model, fs.optim.sgd(1.0), mesh=mesh, policy=policy, strategy=strategy)
    c = torch.tensor([[256.0], [1.0], [1.0], [1.0]])
    state, _ = fs.train_step(
        state, c, lambda p, b: fs.functional_call(model, p, (b,)), microbatches=4
    )
    return float(fs.full_params(state)["w"])


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_main_grads_dtype_is_the_accumulation_dtype(pool2, strategy: str) -> None:
    assert pool2.run(accumulation_worker, strategy, FP32)[0] == pytest.approx(-64.75)
    assert pool2.run(accumulation_worker, strategy, BF16)[0] == pytest.approx(-64.0)


def master_worker(strategy: str, main_params) -> tuple:
    # Ten steps of -1e-3 on w = 1: an fp32 master reaches 0.99, a bf16 one cannot move.
    mesh = fs.make_mesh(device_type="cpu")
    model = Scalar(1.0)
    policy = fs.MixedPrecisionPolicy(param_dtype=BF16, main_params_dtype=main_params)
    state = fs.init(model, fs.optim.sgd(1e-3), mesh=mesh, policy=policy, strategy=strategy)
    loss_fn = lambda p, b: fs.functional_call(model, p, (b,)).float()
    for _ in range(10):
        state, _ = fs.train_step(state, torch.ones(1, 1), loss_fn)
    return float(fs.full_params(state)["w"]), str(state.master[0].dtype)


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_main_params_dtype_is_the_master_dtype(pool2, strategy: str) -> None:
    w, dtype = pool2.run(master_worker, strategy, FP32)[0]
    assert dtype == "torch.float32" and w == pytest.approx(0.99, abs=1e-4)
    w, dtype = pool2.run(master_worker, strategy, None)[0]
    assert dtype == "torch.bfloat16" and w == 1.0


_CPUINFO_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f\n\n"
_CPUINFO_AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
_CPUINFO_AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16\n\n"
_CPUINFO_ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n\n"


@pytest.mark.parametrize(
    ("text", "native", "says"),
    [
        (_CPUINFO_AVX2, False, "emulated"),
        (_CPUINFO_AVX512_BF16, True, "avx512_bf16"),
        (_CPUINFO_AMX, True, "amx_bf16"),
        (_CPUINFO_ARM, True, "bf16"),
        (None, False, "no /proc/cpuinfo"),
    ],
)
def test_native_bf16_reads_the_cpu_flags(monkeypatch, text, native, says) -> None:
    from funcshard.layout import policy

    monkeypatch.setattr(policy, "_cpuinfo", lambda: text)
    assert policy.native_bf16("cpu") is native
    ok, why = policy.native_bf16_reason(torch.device("cpu"))
    assert ok is native and says in why
