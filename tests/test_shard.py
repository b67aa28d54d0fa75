"""fs.shard, fs.reduce_scatter_grads and fs.full_params as building blocks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models


def shard_worker(strategy: str, shard: int, replicate: int) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    params = {"w": torch.arange(37 * 3.0).reshape(37, 3), "s": torch.tensor(2.0)}
    local = fs.shard(params, mesh, strategy=strategy)
    return {k: v.clone() for k, v in local.items()}


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_shard_rows_are_uneven_and_unpadded(pool4, strategy: str) -> None:
    w = torch.arange(37 * 3.0).reshape(37, 3)
    results = pool4.run(shard_worker, strategy, 2, 2)
    for rank, local in enumerate(results):
        if strategy == "no_shard":
            assert torch.equal(local["w"], w) and local["s"].shape == ()
            continue
        shard_rank = rank % 2  # mesh (replicate, shard): shard is the fast axis
        torch.testing.assert_close(local["w"], w[19 * shard_rank : 19 * shard_rank + 19])
        assert local["s"].shape == (() if shard_rank == 0 else (0,))  # a 0-d param is one row


def reduce_worker(strategy: str, comm) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    all_grads = [torch.randn(37, 4, generator=g) for _ in range(world)]
    policy = fs.MixedPrecisionPolicy(grad_comm_dtype=comm)
    out = fs.reduce_scatter_grads({"w": all_grads[rank]}, mesh, policy, strategy=strategy)
    mean = torch.stack(all_grads).mean(0)
    expect = fs.shard({"w": mean}, mesh, strategy=strategy)["w"]
    return {"dtype": str(out["w"].dtype), "err": float((out["w"] - expect).abs().max())}


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_reduce_scatter_grads_is_the_mean_shard(pool3, strategy: str) -> None:
    for r in pool3.run(reduce_worker, strategy, None):
        assert r["dtype"] == "torch.float32" and r["err"] < 1e-6
    for r in pool3.run(reduce_worker, strategy, torch.bfloat16):
        assert r["dtype"] == "torch.float32" and 0 < r["err"] < 5e-2  # bf16 on the wire


def full_params_worker(strategy: str) -> float:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=3)
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy, policy=policy)
    full = fs.full_params(state)
    assert list(full) == [n for n, _ in model.named_parameters()]
    return max(
        float((full[n] - p).abs().max())
        for n, p in model.named_parameters()
        if full[n].dtype == p.dtype
    )


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_full_params_round_trip_exactly(pool3, strategy: str) -> None:
    assert pool3.run(full_params_worker, strategy) == [0.0, 0.0, 0.0]


def _specs(shapes: list[tuple[int, ...]], shard_size: int) -> list:
    """Leaf specs of one bucket laid out as ``build_layout`` does (rows padded per shard)."""
    from funcshard.layout.layout import LeafSpec

    specs, offset = [], 0
    for i, shape in enumerate(shapes):
        rows = shape[0] if shape else 1
        row_numel = 1 if not shape else int(torch.tensor(shape[1:]).prod())
        rps = -(-rows // shard_size)
        specs.append(LeafSpec(f"p{i}", shape, None, 0, rows, rps, row_numel, 0, offset))
        offset += rps * row_numel
    return specs


@pytest.mark.parametrize("shard_size", [1, 2, 3, 4])
def test_add_to_rank_sections_equals_building_them(shard_size: int) -> None:
    """The one-pass accumulation (a later microbatch, ZeRO-0/1 or one rank) gives the bits of
    building the sections and adding them, with uneven rows, a 0-d leaf, an unused leaf and
    bf16 gradients into an fp32 accumulator."""
    from funcshard.layout import sharding

    shapes = [(37, 5), (), (7,), (3, 4, 2), (2, 3)]
    specs = _specs(shapes, shard_size)
    g = torch.Generator().manual_seed(shard_size)
    for dtype in (torch.float32, torch.bfloat16):
        grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        grads[4] = None  # no gradient reached it
        grads[0] = torch.randn(5, 37, generator=g).to(dtype).T  # autograd may hand these out
        acc = sharding.to_rank_sections(
            [torch.randn(s, generator=g) for s in shapes], specs, shard_size, torch.float32
        )
        want = acc + sharding.to_rank_sections(grads, specs, shard_size, torch.float32)
        sharding.add_to_rank_sections(acc, grads, specs, shard_size)
        assert torch.equal(acc, want), dtype


def test_rank_sections_of_no_gradient_are_on_the_given_device() -> None:
    from funcshard.layout import sharding

    specs = _specs([(5, 2)], 2)
    out = sharding.to_rank_sections([None], specs, 2, torch.float32, device="meta")
    assert out.device.type == "meta" and out.numel() == 2 * 3 * 2
