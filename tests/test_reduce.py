"""Gradient reduction through its public behaviour, on a 2x2 mesh (replicate x shard).

``fs.reduce_scatter_grads`` gives this rank's shard of the mean over every data-parallel rank
(reduce-scatter over "shard", then all-reduce over "replicate"), never added to the local
gradient, in ``main_grads_dtype``, with ``grad_comm_dtype`` on the wire; its input is left
alone. Inside ``train_step`` the reductions give the global mean loss and the L2 norm of the
averaged gradient, the same for one microbatch or several.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models

SHAPES = {"w": (37, 4), "s": (), "b": (5,)}


def _grads(rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def scatter_worker(strategy: str, dtype: torch.dtype, policy: fs.MixedPrecisionPolicy) -> dict:
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = _grads(rank, dtype)
    kept = {n: g.clone() for n, g in grads.items()}
    with fs.comm_stats() as stats:
        out = fs.reduce_scatter_grads(grads, mesh, policy, strategy=strategy)
    mean = {
        n: torch.stack([_grads(r, dtype)[n].double() for r in range(world)]).mean(0) for n in SHAPES
    }
    expect = fs.shard(mean, mesh, strategy=strategy)
    return {
        "names": list(out),
        "dtypes": {str(v.dtype) for v in out.values()},
        "shapes": {n: tuple(v.shape) == tuple(expect[n].shape) for n, v in out.items()},
        "err": max(
            float((out[n].double() - expect[n]).abs().max()) if out[n].numel() else 0.0 for n in out
        ),
        "input_kept": all(torch.equal(grads[n], kept[n]) for n in grads),
        "bytes": dict(stats.bytes),
    }


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_reduce_scatter_grads_is_this_ranks_shard_of_the_mean_over_both_axes(pool4, strategy):
    for r in pool4.run(scatter_worker, strategy, torch.float32, fs.MixedPrecisionPolicy()):
        assert r["names"] == list(SHAPES) and all(r["shapes"].values()), r
        assert r["dtypes"] == {"torch.float32"} and r["err"] < 1e-6, r
        assert r["input_kept"]


def _wire_bytes(strategy: str, element_size: int) -> dict:
    """Full buffers per collective: the padded rank sections of the reduce-scatter (2 shards:
    w 19 rows of 4, s one row, b 3 rows), the local shard on the replicate all-reduce."""
    if strategy == "no_shard":
        return {"all_reduce": (37 * 4 + 1 + 5) * element_size}
    local = 19 * 4 + 1 + 3
    return {"reduce_scatter": 2 * local * element_size, "all_reduce": local * element_size}


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_the_wire_carries_grad_comm_dtype_and_returns_main_grads_dtype(pool4, strategy):
    bf16 = torch.bfloat16
    cases = [
        # policy, input dtype -> returned dtype, wire element size
        (fs.MixedPrecisionPolicy(), torch.float32, "torch.float32", 4),
        (fs.MixedPrecisionPolicy(grad_comm_dtype=bf16), torch.float32, "torch.float32", 2),
        (fs.MixedPrecisionPolicy(main_grads_dtype=None), bf16, "torch.bfloat16", 2),
        (fs.MixedPrecisionPolicy(main_grads_dtype=torch.float32), bf16, "torch.float32", 4),
    ]
    for policy, dtype, returned, size in cases:
        for r in pool4.run(scatter_worker, strategy, dtype, policy):
            assert r["dtypes"] == {returned}, (policy, r)
            assert r["bytes"] == _wire_bytes(strategy, size), (policy, r["bytes"])
            assert r["err"] < (5e-2 if size == 2 else 1e-6), (policy, r["err"])


def metrics_worker(strategy: str, microbatches: int) -> dict:
    mesh = fs.make_mesh(shard=2, replicate=2, device_type="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_model(seed=6)
    batch = models.global_batch(0, 4 * world)
    reference = copy.deepcopy(model)
    loss = torch.nn.functional.cross_entropy(reference(batch["x"]), batch["y"])
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy)
    _, metrics = fs.train_step(
        state,
        models.local_batch(batch, rank, world),
        models.make_loss_fn(model),
        microbatches=microbatches,
    )
    return {
        "loss": (metrics["loss"], float(loss)),
        "grad_norm": (metrics["grad_norm"], float(norm)),
        "nonfinite": metrics["nonfinite"],
    }


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_step_loss_and_grad_norm_are_those_of_the_global_mean(pool4, strategy, microbatches):
    for r in pool4.run(metrics_worker, strategy, microbatches):
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5), r
        assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=1e-5), r
        assert r["nonfinite"] == 0
