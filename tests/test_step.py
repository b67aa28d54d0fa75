"""train_step: nonfinite skip, fp16 dynamic loss scaling, consumed state, unfilled state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models


def _tensors(state) -> list[torch.Tensor]:
    return [t.clone() for t in fs.tree.leaves(state) if isinstance(t, torch.Tensor)]


def nonfinite_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy=strategy)
    base = models.make_loss_fn(model)
    rank = dist.get_rank()
    batch = models.local_batch(models.global_batch(0, 8), rank, 2)
    state, _ = fs.train_step(state, batch, base)  # a real optimizer state to protect
    before = _tensors(state)

    def poisoned(params, b):
        if rank == 1 and not isinstance(params, dict):  # ZeRO-2/3: poison the input on rank 1
            b = {"x": b["x"] * float("nan"), "y": b["y"]}
        loss = base(params, b)
        if rank == 1 and isinstance(params, dict):  # NaN gradient for head.bias, rank 1 only
            loss = loss + (params["head.bias"] * float("nan")).sum() * 0
        return loss

    state, metrics = fs.train_step(state, batch, poisoned)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _tensors(state), strict=True))
    return {"nonfinite": metrics["nonfinite"], "names": metrics["nonfinite_params"],
            "unchanged": unchanged, "step": state.step}


@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_nonfinite_step_changes_nothing_and_names_the_leaves(pool2, strategy: str) -> None:
    for r in pool2.run(nonfinite_worker, strategy):
        assert r["nonfinite"] == 1 and r["unchanged"] and r["step"] == 1
        if strategy in ("optim_grads", "optim_grads_params"):  # params handed unit by unit
            assert "inp.weight" in r["names"]
        else:
            assert r["names"] == ["head.bias"]


def fp16_worker(strategy: str) -> list:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.float16, loss_scale_init=2.0**10,
                                     loss_scale_growth_interval=2)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=policy, strategy=strategy)
    base = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    trace = [state.loss_scale.scale]
    for factor in (1e6, 1.0, 1.0, 1.0):  # 1e6 * 2**10 overflows fp16 in backward
        before = fs.full_params(state)
        state, metrics = fs.train_step(state, batch, lambda p, b, f=factor: base(p, b) * f)
        moved = any(not torch.equal(before[n], v) for n, v in fs.full_params(state).items())
        trace.append((metrics["nonfinite"], metrics["loss_scale"], moved))
    return trace


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_fp16_overflow_halves_the_scale_and_skips_then_growth(pool2, strategy: str) -> None:
    trace = pool2.run(fp16_worker, strategy)[0]
    assert trace == [1024.0, (1, 512.0, False), (0, 512.0, True), (0, 1024.0, True),
                     (0, 1024.0, True)]


def consumed_worker() -> list[str]:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    loss_fn = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    new, _ = fs.train_step(state, batch, loss_fn)
    errors = []
    for use in (lambda: fs.train_step(state, batch, loss_fn), lambda: state.params,
                lambda: fs.tree.leaves(state), lambda: fs.full_params(state)):
        try:
            use()
            errors.append("no error")
        except fs.ConsumedStateError as e:
            errors.append(str(e))
    fs.train_step(new, batch, loss_fn)  # the returned state works
    return errors


def test_consumed_state_refuses_reuse(pool2) -> None:
    for msg in pool2.run(consumed_worker)[0]:
        assert "consumed by train_step" in msg


def meta_worker() -> str:
    mesh = fs.make_mesh(device_type="cpu")
    with torch.device("meta"):
        model = models.MLP()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    assert not state.filled
    try:
        fs.train_step(state, {"x": torch.randn(2, 5), "y": torch.zeros(2).long()},
                      models.make_loss_fn(model))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_meta_model_gives_unfilled_state_that_refuses_to_step(pool2) -> None:
    assert "holds no values" in pool2.run(meta_worker)[0]


def test_microbatch_split_errors_name_the_leaf() -> None:
    from funcshard.step import split_microbatches

    with pytest.raises(ValueError, match=r"'x'.*3 rows"):
        split_microbatches({"x": torch.zeros(3, 2)}, 4)
    parts = split_microbatches({"x": torch.arange(6)}, 3)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]


def huge_gradient_worker(strategy: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    base = models.make_loss_fn(model)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    norms = {}
    for factor in (1.0, 1e22):  # 1e22: finite gradients whose squares overflow fp32
        state = fs.init(model, fs.optim.sgd(0.0), mesh=mesh, strategy=strategy)
        _, metrics = fs.train_step(state, batch, lambda p, b, f=factor: base(p, b) * f)
        norms[factor] = (metrics["grad_norm"], metrics["nonfinite"])
    return norms


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_huge_finite_gradient_is_not_an_overflow(pool2, strategy: str) -> None:
    for r in pool2.run(huge_gradient_worker, strategy):
        (small, bad_small), (huge, bad_huge) = r[1.0], r[1e22]
        assert bad_small == 0 and bad_huge == 0
        assert huge == pytest.approx(small * 1e22, rel=1e-5)
